//! The bench: one workload, run against the fleet and against two baselines, so
//! that the fleet's figures mean something.
//!
//! - [`workload`]: the load generator, generic over [`ankusa_bus::Store`]: many
//!   tenants (uniform or zipf), two charges and usually a claim per hit, a share
//!   of redeliveries of committed keys, a settle after each `Ok`; closed loop
//!   (N in flight) or open loop (a fixed offered rate, latency from each hit's
//!   due time).
//! - [`report`]: what a run measured: throughput, HDR latency percentiles and
//!   counts by outcome, as JSON or a compact table, and ratios between runs.
//! - [`echo`]: the floor. The same encoded requests over the same NATS
//!   request-reply, answered by a responder that does nothing: what the
//!   transport alone costs; and [`echo::NodeEchoResponder`], a node that does
//!   nothing, the floor of the edge's batching.
//! - [`redis_lua`]: the incumbent. The same contract as one Lua script per call
//!   on a single `redis-server`, the way the contract's Redis store does it.
//!
//! - [`cpu`]: where a run's CPU went, read from the OS: the load generator's,
//!   the host's, and that of the processes it is told to watch.
//!
//! The `ankusa bench` subcommand runs [`workload::run`] with one
//! [`workload::WorkloadConfig`] against each and prints
//! [`report::comparison_table`]. Only loopback targets are meant: every run
//! is bounded in time and in hits.

pub mod cpu;
pub mod echo;
pub mod redis_lua;
pub mod report;
pub mod workload;

pub use echo::{EchoResponder, EchoStore, NodeEchoResponder};
pub use redis_lua::RedisLuaStore;
pub use report::WorkloadReport;
pub use workload::{run, LoadMode, TenantDistribution, WorkloadConfig};
