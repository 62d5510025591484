//! Free loopback ports for test servers.
//!
//! A port is found by binding `127.0.0.1:0` and releasing it. Because the port is free
//! again once released, two tests in one process could be handed the same port before
//! either server binds it; a process-wide set of handed-out ports prevents that. Across
//! processes the kernel's ephemeral-port rotation makes reuse unlikely, and server
//! start-up retries with fresh ports when a bind fails.

use std::collections::HashSet;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::{Mutex, OnceLock};

use crate::HarnessError;

fn handed_out() -> &'static Mutex<HashSet<u16>> {
    static PORTS: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    PORTS.get_or_init(|| Mutex::new(HashSet::new()))
}

/// Returns a loopback TCP port that is currently free and has not been returned
/// before by this process.
pub fn free_port() -> Result<u16, HarnessError> {
    // Bounded: the kernel hands out ephemeral ports in rotation, so a repeat is rare.
    for _ in 0..200 {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .map_err(HarnessError::io("bind 127.0.0.1:0"))?;
        let port = listener
            .local_addr()
            .map_err(HarnessError::io("local_addr of 127.0.0.1:0"))?
            .port();
        drop(listener);
        let mut set = handed_out().lock().unwrap_or_else(|e| e.into_inner());
        if set.insert(port) {
            return Ok(port);
        }
    }
    Err(HarnessError::Io {
        context: "free_port".into(),
        source: std::io::Error::other("no unused loopback port after 200 attempts"),
    })
}
