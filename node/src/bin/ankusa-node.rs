//! `ankusa-node`: one node of an ankusa-fleet instance.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use ankusa_node::config::{LogFormat, NodeConfig, Overrides};
use clap::Parser;

// A request allocates a few dozen small, short-lived objects across threads;
// glibc malloc spent a fifth of the node's CPU on them at peak (its
// consolidation and free-list walks: docs/benchmarks-history.md, session 13).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A node of an ankusa-fleet instance: serves tenant rate limits (GCRA) and
/// two-phase webhook dedupe claims to edges over NATS request-reply, sharing the
/// instance's shards with its other nodes through JetStream KV leases.
///
/// Settings come from the --config file, then ANKUSA_* environment variables,
/// then flags; each overrides the one before.
#[derive(Debug, Parser)]
#[command(name = "ankusa-node", version, about, long_about)]
struct Cli {
    /// TOML configuration file (see docs/configuration.md)
    #[arg(long, short, env = "ANKUSA_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    overrides: Overrides,
}

fn init_logs(config: &NodeConfig) {
    let filter = tracing_subscriber::EnvFilter::try_new(&config.log_level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: a log file or journald gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match config.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Human => builder.init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match NodeConfig::load(cli.config.as_deref(), &cli.overrides) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("ankusa-node: {err}");
            return ExitCode::from(2);
        }
    };
    init_logs(&config);
    let runtime = match ankusa_node::run::runtime(&config) {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("ankusa-node: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(ankusa_node::run::run(
        config,
        ankusa_node::run::shutdown_signal(),
    )) {
        Ok(()) => ExitCode::SUCCESS,
        // A configuration error, like the ones found at start: the same status,
        // which supervisors are told not to restart on (deploy/systemd).
        Err(err @ ankusa_node::run::NodeError::Misconfigured(_)) => {
            tracing::error!("{err}");
            eprintln!("ankusa-node: {err}");
            ExitCode::from(2)
        }
        Err(err) => {
            tracing::error!("{err}");
            eprintln!("ankusa-node: {err}");
            ExitCode::FAILURE
        }
    }
}
