//! Where a shard's changes go before (claims) or after (buckets) its answer.
//!
//! A claim answered `Ok`, and a settle answered `Ok`, must be durable before the
//! answer leaves the node; bucket TATs may trail behind. [`Persistence`] is that
//! seam: in memory only (tests, a lone node) or JetStream KV.

use std::sync::Arc;

use ankusa_actors::Changes;

use crate::kv::KvWriter;

/// Why changes could not be made durable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PersistError {
    #[error("KV write failed: {0}")]
    Write(String),
    #[error("the KV writer has stopped")]
    Stopped,
    #[error("KV writes are behind: {queued} changes already wait for JetStream")]
    Backlog { queued: usize },
}

/// How a shard's changes are kept.
#[derive(Clone)]
pub enum Persistence {
    /// Nothing outlives the process.
    Memory,
    /// Claims written to JetStream KV before the answer; buckets written behind.
    Kv(Arc<KvWriter>),
}

impl Persistence {
    /// Makes the changes of every `(shard, tenant, changes)` as durable as this
    /// persistence is: returns once their claim changes (if any) are all
    /// acknowledged, in as few log messages as they fit.
    pub async fn record<'a>(
        &self,
        items: impl IntoIterator<Item = (u32, &'a str, &'a Changes)>,
    ) -> Result<(), PersistError> {
        match self {
            Persistence::Memory => Ok(()),
            Persistence::Kv(writer) => writer.record(items).await,
        }
    }

    /// Whether both keep changes in the same place (one node's writer).
    pub fn same_as(&self, other: &Persistence) -> bool {
        match (self, other) {
            (Persistence::Memory, Persistence::Memory) => true,
            (Persistence::Kv(a), Persistence::Kv(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}
