//! A `redis-server` of a test's own, for the Redis + Lua baseline: on a free
//! loopback port, without persistence, killed when the handle drops. Without a
//! `redis-server` (`REDIS_SERVER_BIN`, else `PATH`) a test fails with a message
//! naming `scripts/ensure-redis.sh`; it never skips.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::process::ChildProcess;
use crate::{free_port, HarnessError};

/// Fresh ports tried when another process holds the one handed out.
const PORT_RETRIES: usize = 3;

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
    /// Starts a server and waits, at most 10 s, until it answers as itself.
    /// A port another process took meanwhile is retried on a fresh one.
    pub fn start() -> Result<Self, HarnessError> {
        let mut last = None;
        for _ in 0..PORT_RETRIES {
            match Self::start_on(free_port()?) {
                Ok(server) => return Ok(server),
                Err(e) if port_clash(&e) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.expect("at least one attempt"))
    }

    fn start_on(port: u16) -> Result<Self, HarnessError> {
        let mut cmd = Command::new(redis_server_bin());
        cmd.args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            // No persistence: the test's data dies with the server.
            .args(["--save", "", "--appendonly", "no"]);
        let mut process = ChildProcess::spawn("redis-server", cmd)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // Something else may answer on the port (a process that took it
            // first): ready is this process answering, by its pid.
            if let Some(status) = process.try_wait()? {
                return Err(HarnessError::ExitedEarly {
                    what: format!("redis-server on 127.0.0.1:{port}"),
                    status,
                    log: process.log_path().to_path_buf(),
                    tail: process.log_tail(20),
                });
            }
            let last_error = match server_pid(port) {
                Ok(pid) if pid == process.pid() => return Ok(Self { port, process }),
                Ok(pid) => format!("127.0.0.1:{port} is answered by redis-server pid {pid}"),
                Err(why) => why,
            };
            if Instant::now() >= deadline {
                return Err(HarnessError::NotReady {
                    what: "redis-server".into(),
                    waited_ms: 10_000,
                    last_error,
                    log: process.log_path().to_path_buf(),
                    tail: process.log_tail(20),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

/// Whether a start failed because another process holds its port.
fn port_clash(e: &HarnessError) -> bool {
    matches!(e, HarnessError::ExitedEarly { tail, .. }
        if tail.to_ascii_lowercase().contains("address already in use"))
}

/// The `process_id` that the redis-server on `port` gives in `INFO server`.
fn server_pid(port: u16) -> Result<u32, String> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))
        .map_err(|e| format!("127.0.0.1:{port}: {e}"))?;
    let bound = Some(Duration::from_secs(1));
    stream
        .set_read_timeout(bound)
        .and_then(|()| stream.set_write_timeout(bound))
        .and_then(|()| stream.write_all(b"INFO server\r\n"))
        .map_err(|e| format!("127.0.0.1:{port}: {e}"))?;
    // The reply is a bulk string of some kilobytes; read until its pid line.
    let mut reply = Vec::new();
    let mut chunk = [0u8; 4096];
    while reply.len() < 64 * 1024 {
        let n = stream
            .read(&mut chunk)
            .map_err(|e| format!("127.0.0.1:{port}: {e}"))?;
        if n == 0 {
            break;
        }
        reply.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&reply);
        // The pid's line, once it has arrived whole.
        let line = text
            .split_once("process_id:")
            .and_then(|(_, rest)| rest.split_once("\r\n"))
            .map(|(pid, _)| pid.trim().to_string());
        if let Some(pid) = line {
            return pid
                .parse()
                .map_err(|e| format!("127.0.0.1:{port}: process_id {pid:?}: {e}"));
        }
    }
    Err(format!(
        "127.0.0.1:{port} gave no process_id: {:?}",
        String::from_utf8_lossy(&reply)
    ))
}
