//! ankusa-fleet's bus: the wire protocol, the NATS transport, the JetStream KV
//! persistence adapter and the edge client.
//!
//! - [`client`]: the edge client, with hard deadlines and micro-batching;
//! - [`connect`]: how edges and nodes reach NATS;
//! - [`protocol`]: requests, replies, versions and error codes on the wire;
//! - [`kv`]: JetStream KV persistence: claims, buckets, leases, heartbeats;
//! - [`persist`]: where a shard's changes are kept;
//! - [`responder`]: the node's side of the protocol for one shard;
//! - [`shard`]: the shard function and subjects;
//! - [`store`]: the contract as the edge sees it.

pub mod breaker;
pub mod claimlog;
pub mod client;
pub mod connect;
pub mod edge;
pub mod kv;
pub mod local;
pub mod persist;
pub mod protocol;
mod replies;
pub mod responder;
pub mod shard;
pub mod store;

pub use breaker::{BreakerConfig, CircuitBreaker};
pub use client::{FleetConfig, FleetStore};
pub use connect::{server_caught_up, ConnectError, NatsOptions};
pub use edge::{Answer, Edge, EdgeConfig, EdgeStats, LocalReason, Source};
pub use local::{LocalConfig, LocalStore};
pub use protocol::{DecodeError, ErrorCode, ErrorReply, Op, Reply, ReplyBody, Request};
pub use shard::{shard_of, Subjects};
pub use store::{Store, StoreError};

/// Locks `mutex`, even one a panicking holder left poisoned: for values that
/// are valid whatever their holder was doing, as every value this crate (and
/// the node) guards with a mutex is.
pub fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
