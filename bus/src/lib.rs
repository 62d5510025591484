//! ankusa-fleet's bus: the wire protocol, the NATS transport, the JetStream KV
//! persistence adapter and the edge client.
//!
//! An edge starts with [`Edge`] over a [`FleetStore`]: every call returns within
//! its budget, answered by the fleet or, when the fleet cannot answer in time,
//! from this process's own state ([`Answer::source`] says which).
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use ankusa_actors::{Charge, Claim, HitOutcome, HitRequest, Kind, SettleRequest, Settlement};
//! use ankusa_bus::{Edge, EdgeConfig, FleetConfig, FleetStore, NatsOptions};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // Returns at once: NATS is reached in the background.
//! let store = FleetStore::connect(FleetConfig::new(
//!     NatsOptions::with_servers(["nats://127.0.0.1:4222"]),
//!     "default",
//! ))
//! .await?;
//! let edge = Edge::new(store, EdgeConfig::default());
//!
//! // A burst of 100 hooks, then one every 10 ms; and the event's key.
//! let hooks = Charge {
//!     kind: Kind::Hooks,
//!     tenant: "acme".into(),
//!     increment_us: 10_000,
//!     capacity_us: 1_000_000,
//! };
//! let claim = Claim {
//!     tenant: "acme".into(),
//!     source_id: "github".into(),
//!     key: "evt-1".into(),
//!     hook_id: "h1".into(),
//!     node: "edge-1".into(),
//!     ttl_ms: 86_400_000,
//!     pending_ttl_ms: 30_000,
//! };
//! let budget = Duration::from_millis(50);
//! let hit = HitRequest {
//!     charges: vec![hooks],
//!     claim: Some(claim.clone()),
//! };
//! match edge.hit(hit, budget).await?.outcome {
//!     HitOutcome::Ok => {
//!         // Store the hook, then commit the claim (or release it if storing failed).
//!         let settle = SettleRequest {
//!             claim,
//!             settlement: Settlement::Commit,
//!         };
//!         edge.settle(settle, budget).await?;
//!     }
//!     HitOutcome::Duplicate { hook_id } => println!("already stored as {hook_id}: answer 2xx"),
//!     HitOutcome::Pending { retry_after_ms } | HitOutcome::RateLimited { retry_after_ms } => {
//!         println!("ask the sender to retry in {retry_after_ms} ms")
//!     }
//! }
//! # Ok(())
//! # }
//! ```
//!
//! - [`edge`]: the degrading edge ([`Edge`]): fleet first, local state on an
//!   outage, a circuit breaker ([`breaker`]) between them;
//! - [`client`]: the fleet client ([`FleetStore`]), with hard deadlines and
//!   micro-batching;
//! - [`local`]: the edge's own state for an outage ([`LocalStore`]);
//! - [`connect`]: how edges and nodes reach NATS;
//! - [`protocol`]: requests, replies, versions and error codes on the wire;
//! - [`shard`]: the shard function and subjects;
//! - [`store`]: the contract as the edge sees it ([`Store`], [`StoreError`]);
//! - [`responder`]: the node's side of the protocol for one shard;
//! - [`persist`]: where a shard's changes are kept;
//! - [`kv`], [`claimlog`]: JetStream KV persistence: the claim logs, buckets,
//!   leases, heartbeats.

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
pub use connect::{connection_ended, jetstream, server_caught_up, ConnectError, NatsOptions};
pub use edge::{Answer, Edge, EdgeConfig, EdgeStats, LocalReason, Source};
pub use local::{LocalConfig, LocalStore};
pub use protocol::{DecodeError, ErrorCode, ErrorReply, Op, Reply, ReplyBody, Request};
pub use shard::{is_node_id, shard_of, Subjects};
pub use store::{Store, StoreError};

/// Locks `mutex`, even one a panicking holder left poisoned: for values that
/// are valid whatever their holder was doing, as every value this crate (and
/// the node) guards with a mutex is.
pub fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
