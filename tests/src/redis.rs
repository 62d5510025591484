//! A `redis-server` of a test's own, for the Redis + Lua baseline: on a free
//! loopback port, without persistence, killed when the handle drops. Without a
//! `redis-server` (`REDIS_SERVER_BIN`, else `PATH`) a test fails with a message
//! naming `scripts/ensure-redis.sh`; it never skips.

use std::net::{Ipv4Addr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::process::ChildProcess;
use crate::{free_port, HarnessError};

/// The redis-server binary, or a panic that says how to install one.
pub fn redis_server_bin() -> PathBuf {
    let from_env = std::env::var_os("REDIS_SERVER_BIN")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from);
    let on_path = || {
        std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("redis-server"))
                .find(|candidate| candidate.is_file())
        })
    };
    match from_env.or_else(on_path) {
        Some(path) if path.is_file() => path,
        found => panic!(
            "redis-server not found (REDIS_SERVER_BIN={found:?}, nor on PATH): run scripts/ensure-redis.sh"
        ),
    }
}

/// A running redis-server.
pub struct RedisServer {
    port: u16,
    process: ChildProcess,
}

impl RedisServer {
    /// Starts a server (with `DEBUG` enabled, so tests can stall it) and waits,
    /// at most 10 s, until it accepts connections.
    pub fn start() -> Result<Self, HarnessError> {
        let port = free_port()?;
        let mut cmd = Command::new(redis_server_bin());
        cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            // No persistence: the test's data dies with the server.
            .args(["--save", "", "--appendonly", "no"])
            // DEBUG SLEEP stalls the server to test per-call budgets.
            .args(["--enable-debug-command", "local"]);
        let process = ChildProcess::spawn("redis-server", cmd)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err() {
            if Instant::now() >= deadline {
                return Err(HarnessError::NotReady {
                    what: "redis-server".into(),
                    waited_ms: 10_000,
                    last_error: format!("nothing listens on 127.0.0.1:{port}"),
                    log: process.log_path().to_path_buf(),
                    tail: process.log_tail(20),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Self { port, process })
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}
