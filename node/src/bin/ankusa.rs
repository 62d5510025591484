//! `ankusa`: the CLI of an ankusa-fleet instance (see [`ankusa_node::cli`]).

use std::process::ExitCode;

use ankusa_node::cli::{run, Cli};

// The node's allocator (see ankusa-node.rs), also for the load generator of
// `ankusa bench`, which drives every store it compares from this one process.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // Like other Unix tools, end quietly when the reader of the output goes
    // (`ankusa status | head`); Rust ignores SIGPIPE, so each print would
    // otherwise panic on the closed pipe.
    // SAFETY: restoring a signal's default action, before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = match Cli::parse_with_config() {
        Ok(cli) => cli,
        Err(err) => {
            eprintln!("ankusa: error: {err}");
            return ExitCode::from(err.exit_code());
        }
    };
    // Logs only when asked for (RUST_LOG): the output is for people.
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("ankusa: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("ankusa: error: {err}");
            ExitCode::from(err.exit_code())
        }
    }
}
