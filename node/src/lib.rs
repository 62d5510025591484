//! ankusa-node: the node process (configuration, the shards it hosts, shard
//! ownership, persistence, metrics) and the `ankusa` CLI.
//!
//! - [`config`]: file, environment and flags, validated;
//! - [`host`]: the shards served now, each an actor and a responder;
//! - [`fleet`]: shard ownership through KV leases, balance, handoff;
//! - [`membership`]: the live nodes, from a watch of their heartbeats;
//! - [`time`]: the node's clock, kept with the NATS server's;
//! - [`run`]: the node's life from start to graceful stop;
//! - [`health`], [`http`]: readiness and the operator endpoints;
//! - [`cli`]: the `ankusa` command line (hit, settle, reset, inspect, status,
//!   bench);
//! - [`bench`](mod@bench): the workload `ankusa bench` drives, against the fleet and its
//!   two baselines (a bare NATS echo, Redis + Lua).

pub mod bench;
pub mod cli;
pub mod config;
pub mod fleet;
pub mod health;
pub mod host;
pub mod http;
pub mod membership;
pub mod run;
pub mod time;
