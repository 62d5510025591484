//! The contract as the edge sees it: [`Store`], implemented by the NATS client
//! ([`crate::client::FleetStore`]) and wrapped by the degrading edge.
//!
//! Failure is a value: every method answers within its `timeout`, with a
//! [`StoreError`] when the fleet could not.

use std::future::Future;
use std::time::Duration;

use ankusa_actors::{HitOutcome, HitRequest, InvalidRequest, SettleOutcome, SettleRequest};

use crate::protocol::{ErrorCode, ErrorReply, ReplyBody};

/// Why a call to the fleet did not produce an outcome.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// No answer within the call's budget.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// No node serves the tenant's shard (none running, or a handoff outlasted the budget).
    #[error("no node serves the shard")]
    NoResponders,
    /// The client is not connected to NATS.
    #[error("not connected to NATS")]
    Disconnected,
    /// The request breaks a rule; it would fail anywhere.
    #[error("invalid request: {0}")]
    Invalid(#[from] InvalidRequest),
    /// A node answered with an error.
    #[error("node refused: {0}")]
    Refused(ErrorReply),
    /// A reply that could not be understood.
    #[error("bad reply: {0}")]
    BadReply(String),
    /// Any other transport failure.
    #[error("transport: {0}")]
    Transport(String),
}

impl StoreError {
    /// Whether the fleet, not the request, is at fault: the edge may answer from
    /// local state instead.
    pub fn is_outage(&self) -> bool {
        match self {
            StoreError::Invalid(_) => false,
            StoreError::Refused(reply) => !matches!(
                reply.code,
                ErrorCode::Invalid | ErrorCode::Malformed | ErrorCode::TooLarge
            ),
            _ => true,
        }
    }

    /// The error for a reply whose body does not answer the call made (`what`):
    /// the node's refusal, or a reply of another kind.
    pub fn unexpected(what: &str, body: ReplyBody) -> Self {
        match body {
            ReplyBody::Error(err) => StoreError::Refused(err),
            other => StoreError::BadReply(format!("a {what} was answered with {other:?}")),
        }
    }
}

/// A fleet store: the contract's `hit`, `settle` and `reset`, each bounded by `timeout`.
pub trait Store: Send + Sync + 'static {
    /// The least budget with which this store tries a call at all: one given
    /// less is answered `Timeout` at once, unsent, which says nothing of the
    /// store's health (the degrading edge answers it locally without telling
    /// its breaker).
    const LEAST_BUDGET: Duration = Duration::ZERO;

    fn hit(
        &self,
        req: HitRequest,
        timeout: Duration,
    ) -> impl Future<Output = Result<HitOutcome, StoreError>> + Send;

    fn settle(
        &self,
        req: SettleRequest,
        timeout: Duration,
    ) -> impl Future<Output = Result<SettleOutcome, StoreError>> + Send;

    fn reset(
        &self,
        tenant: String,
        timeout: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}
