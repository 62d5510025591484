//! The `ankusa` CLI for people at a terminal: one call at a time (`hit`,
//! `settle`, `reset`), a look at the fleet (`status`) and the load generator
//! (`bench`, with its baselines and the durable, recovery and memory figures).
//!
//! - [`calls`]: `hit`, `settle`, `reset` and `inspect` through the edge client;
//! - [`status`]: nodes, the shard map and per-node gauges, from KV and `/metrics`;
//! - [`bench`](mod@bench): the workload against the fleet, side by side with the baselines;
//! - [`kvbench`]: durable claims (group commit vs sequential puts) and recovery;
//! - [`memory`]: node RSS per committed claim and per idle tenant.
//!
//! Every subcommand is bounded: single calls by `--timeout-ms`, benches by their
//! duration and hit count. Exit codes: 0 for an answer (whatever it says), 1 for
//! a call or run that failed, 2 for bad arguments.

pub mod bench;
pub mod calls;
pub mod kvbench;
pub mod memory;
pub mod status;

use std::path::PathBuf;
use std::time::Duration;

use ankusa_bus::client::ClientConfigError;
use ankusa_bus::kv::KvError;
use ankusa_bus::{FleetConfig, FleetStore, NatsOptions, StoreError};
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::config::{ConfigError, NatsArgs, NodeConfig, Overrides};

/// Talk to an ankusa-fleet instance: single calls, its status, and benchmarks.
///
/// Every option of the connection also reads an ANKUSA_* variable, as the
/// node's do, so the same environment serves both.
#[derive(Debug, Parser)]
#[command(name = "ankusa", version, about, long_about)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// The command line, with what `--config` gives (a node's configuration
    /// file: its NATS settings, instance and shard count) under what the
    /// command line and environment set. A usage mistake exits as clap's do.
    pub fn parse_with_config() -> Result<Self, CliError> {
        Self::with_config(&Self::command().get_matches())
    }

    fn with_config(matches: &ArgMatches) -> Result<Self, CliError> {
        let mut cli = Self::from_arg_matches(matches).unwrap_or_else(|err| err.exit());
        cli.global.read_config(matches)?;
        Ok(cli)
    }
}

/// How to reach the instance; shared by every subcommand.
#[derive(Debug, Clone, Args)]
pub struct Global {
    /// A node's configuration file (TOML), for its NATS settings, instance and
    /// shard count; the options and variables here come first
    #[arg(long, short, env = "ANKUSA_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// The NATS settings read from `config`, under `nats`.
    #[arg(skip)]
    file_nats: Option<NatsOptions>,
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Fleet instance name
    #[arg(
        long,
        env = "ANKUSA_INSTANCE",
        default_value = "default",
        global = true
    )]
    pub instance: String,
    /// Shards of the instance; must match the nodes'
    #[arg(long, env = "ANKUSA_SHARDS", default_value_t = 64, global = true)]
    pub shards: u32,
    /// Budget of each call, ms [default: 1000 for single calls, 250 per bench call]
    #[arg(long, env = "ANKUSA_TIMEOUT_MS", global = true)]
    pub timeout_ms: Option<u64>,
}

impl Global {
    /// Takes from the node configuration file `config` (if given) what
    /// `matches` left at its default: the instance, the shard count and the
    /// NATS settings (each NATS option given here replaces the file's).
    fn read_config(&mut self, matches: &ArgMatches) -> Result<(), CliError> {
        let Some(path) = &self.config else {
            return Ok(());
        };
        let node = NodeConfig::load(Some(path), &Overrides::default())?;
        let unset = |id: &str| {
            matches!(
                matches.value_source(id),
                None | Some(ValueSource::DefaultValue)
            )
        };
        if unset("instance") {
            self.instance = node.instance;
        }
        if unset("shards") {
            self.shards = node.shards;
        }
        self.file_nats = Some(node.nats);
        Ok(())
    }

    pub fn nats_options(&self) -> NatsOptions {
        let mut nats = NatsOptions {
            name: Some(format!("ankusa-cli {}", std::process::id())),
            ..self.file_nats.clone().unwrap_or_default()
        };
        self.nats.apply_to(&mut nats);
        nats
    }

    /// The budget of a call, or `default` when none was given.
    pub fn timeout(&self, default: Duration) -> Duration {
        self.timeout_ms.map_or(default, Duration::from_millis)
    }

    pub fn fleet_config(&self, batching: bool) -> FleetConfig {
        FleetConfig {
            shards: self.shards,
            batching,
            ..FleetConfig::new(self.nats_options(), self.instance.clone())
        }
    }

    /// An edge client, connected (or connecting in the background).
    pub async fn fleet(&self, batching: bool) -> Result<FleetStore, CliError> {
        Ok(FleetStore::connect(self.fleet_config(batching)).await?)
    }

    /// A raw NATS client; waits up to `wait` for the connection so a CLI
    /// command fails with a clear message rather than a `Disconnected` later.
    pub async fn nats_client(&self, wait: Duration) -> Result<async_nats::Client, CliError> {
        let client = self.nats_options().connect().await?;
        wait_connected(&client, wait).await?;
        Ok(client)
    }
}

/// Waits until `client` is connected, at most `wait`.
pub async fn wait_connected(client: &async_nats::Client, wait: Duration) -> Result<(), CliError> {
    let start = tokio::time::Instant::now();
    while client.connection_state() != async_nats::connection::State::Connected {
        if start.elapsed() >= wait {
            return Err(CliError::NotConnected(wait));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Charge a tenant's buckets and (optionally) claim a webhook key: one call
    Hit(calls::HitArgs),
    /// Commit or release a claim made by `hit`
    Settle(calls::SettleArgs),
    /// Forget a tenant's buckets (best effort)
    Reset(calls::ResetArgs),
    /// Read a tenant's buckets and, with --source and --key, the claim on a key
    Inspect(calls::InspectArgs),
    /// Nodes, the shard map (who owns what) and each node's gauges
    Status(status::StatusArgs),
    /// Load generator: the fleet alone, or side by side with the baselines
    Bench(bench::BenchArgs),
}

/// Why a command failed (exit code 1), as opposed to an answer (exit code 0).
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Config(#[from] ClientConfigError),
    #[error(transparent)]
    Connect(#[from] ankusa_bus::ConnectError),
    #[error("not connected to NATS within {0:?}")]
    NotConnected(Duration),
    #[error("{message} (code {code})")]
    Store { code: String, message: String },
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("invalid argument: {0}")]
    Usage(String),
    #[error(transparent)]
    Workload(#[from] crate::bench::workload::WorkloadError),
    #[error("{0}")]
    Baseline(String),
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Other(String),
    #[error(transparent)]
    NodeConfig(#[from] ConfigError),
}

impl CliError {
    /// The exit code: 2 for a usage mistake, 1 for everything else.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) | CliError::Config(_) | CliError::NodeConfig(_) => 2,
            _ => 1,
        }
    }
}

impl From<StoreError> for CliError {
    fn from(err: StoreError) -> Self {
        let code = match &err {
            StoreError::Refused(reply) => reply.code.to_string(),
            other => crate::bench::report::error_kind(other),
        };
        CliError::Store {
            code,
            message: err.to_string(),
        }
    }
}

/// Runs one parsed command line.
pub async fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Hit(args) => calls::hit(&cli.global, args).await,
        Command::Settle(args) => calls::settle(&cli.global, args).await,
        Command::Reset(args) => calls::reset(&cli.global, args).await,
        Command::Inspect(args) => calls::inspect(&cli.global, args).await,
        Command::Status(args) => status::status(&cli.global, args).await,
        Command::Bench(args) => bench::bench(&cli.global, args).await,
    }
}

/// Latency for people: µs below 1 ms, ms with one decimal above.
/// Writes a report as pretty JSON to `path`.
pub fn write_json(path: &std::path::Path, report: &impl serde::Serialize) -> Result<(), CliError> {
    let text = serde_json::to_string_pretty(report).unwrap_or_default();
    std::fs::write(path, text).map_err(|source| CliError::Write {
        path: path.to_path_buf(),
        source,
    })
}

pub fn fmt_latency(d: Duration) -> String {
    let us = d.as_micros();
    if us < 1000 {
        format!("{us} µs")
    } else {
        format!("{:.1} ms", us as f64 / 1000.0)
    }
}

/// A retry delay for people: ms below 10 s, whole seconds above.
pub fn fmt_retry(ms: u64) -> String {
    if ms < 10_000 {
        format!("{ms} ms")
    } else {
        format!("{} s", ms.div_ceil(1000))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(args: &[&str]) -> Cli {
        let matches = Cli::command()
            .try_get_matches_from(args)
            .expect("valid arguments");
        Cli::with_config(&matches).expect("a readable config")
    }

    #[test]
    fn a_nodes_config_fills_in_what_the_command_line_leaves_unset() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("node.toml");
        std::fs::write(
            &path,
            "instance = \"prod\"\nshards = 128\n[nats]\nservers = [\"nats://10.0.0.7:4222\"]\nuser = \"ankusa-node\"\npassword = \"pw\"\n",
        )
        .expect("written");
        let path = path.to_str().expect("utf-8");

        let from_file = parsed(&["ankusa", "status", "--config", path]);
        assert_eq!(from_file.global.instance, "prod");
        assert_eq!(from_file.global.shards, 128);
        let nats = from_file.global.nats_options();
        assert_eq!(nats.servers, ["nats://10.0.0.7:4222"]);
        assert_eq!(nats.user.as_deref(), Some("ankusa-node"));

        let given = parsed(&[
            "ankusa",
            "--shards",
            "64",
            "status",
            "--config",
            path,
            "--nats",
            "nats://127.0.0.1:4222",
        ]);
        assert_eq!(given.global.instance, "prod");
        assert_eq!(given.global.shards, 64, "the command line comes first");
        let nats = given.global.nats_options();
        assert_eq!(nats.servers, ["nats://127.0.0.1:4222"]);
        assert_eq!(
            nats.password.as_deref(),
            Some("pw"),
            "the rest from the file"
        );

        let none = parsed(&["ankusa", "status"]);
        assert_eq!(
            (none.global.instance.as_str(), none.global.shards),
            ("default", 64)
        );
    }
}
