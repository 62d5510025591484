//! ankusa-fleet's bus: the wire protocol, the NATS transport, the JetStream KV
//! persistence adapter and the edge client.
//!
//! - [`protocol`]: requests, replies, versions and error codes on the wire;
//! - [`shard`]: the shard function and subjects;
//! - [`store`]: the contract as the edge sees it.

pub mod protocol;
pub mod shard;
pub mod store;

pub use protocol::{DecodeError, ErrorCode, ErrorReply, Op, Reply, ReplyBody, Request};
pub use shard::{shard_of, Subjects};
pub use store::{Store, StoreError};
