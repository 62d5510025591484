//! Test support: real nats-server and ankusa-node processes on loopback.
//!
//! Everything here starts real processes (no mocks), binds only 127.0.0.1, keeps its
//! state in temporary directories and kills what it started when the handle drops,
//! including during a panic unwinding out of a failed test.
//!
//! - [`nats`]: single `nats-server` with JetStream ([`NatsServer`]) and routed
//!   clusters ([`NatsCluster`]), plus locating the binary ([`nats_server_bin`]).
//! - [`process`]: a generic child-process handle ([`ChildProcess`]) for our own
//!   binaries and [`cargo_bin`] to locate (and build) them.
//! - [`fleet`]: our `ankusa-node` processes ([`NodeProcess`]) and bounded polling.
//! - [`requests`]: builders for the contract's requests.
//! - [`permissions`]: the deploy file's locked-down NATS users, and the
//!   server's log of what it refused.
//! - [`redis`]: a `redis-server` for the Redis + Lua baseline.
//! - [`ports`]: free loopback ports that are not handed out twice per test process.
//! - [`netcut`]: a loopback TCP proxy between one process and its nats-server(s)
//!   that can blackhole or reset the link ([`NetCut`]).
//! - [`history`], [`checker`]: the fault runs' history and the rules checked on it.

pub mod checker;
pub mod error;
pub mod fleet;
pub mod history;
pub mod nats;
pub mod netcut;
pub mod permissions;
pub mod ports;
pub mod process;
pub mod redis;
pub mod requests;

pub use error::HarnessError;
pub use fleet::{connected_edge, standalone_pair, wait_until, NodeProcess, NodeSpec};
pub use nats::{nats_server_bin, try_nats_server_bin, NatsCluster, NatsServer, ServerConfig};
pub use netcut::{Link, NetCut, NetCutStats};
pub use ports::free_port;
pub use process::{
    cargo_bin, outer_cargo_env, read_repo_file, try_cargo_bin, workspace_root, ChildProcess, Signal,
};
