//! ankusa-node: the node process (configuration, the shards it hosts, shard
//! ownership, persistence, metrics) and the `ankusa` CLI.
//!
//! - [`config`]: file, environment and flags, validated;
//! - [`host`]: the shards served now, each an actor and a responder.

pub mod config;
pub mod host;
