//! [`Edge`]: the degrading edge client. It wraps a fleet [`Store`] and, when the
//! fleet does not answer in time, answers from this process's [`LocalStore`] and
//! says so ([`Source::Local`]); a store outage degrades the edge, it never stops it.
//!
//! Per call:
//!
//! 1. The request is validated; an invalid one is [`StoreError::Invalid`] and is
//!    never degraded (it would fail anywhere).
//! 2. A claim made locally stays local until it expires (see [`crate::local`]):
//!    a hit on a key this process claimed, and a settle of a claim this process
//!    made, are answered locally (`LocalReason::LocalClaim`), whether or not the
//!    fleet is back — the fleet never saw those claims.
//! 3. The [`CircuitBreaker`] decides whether a hit or a reset is tried on the
//!    fleet at all; while it is open a hit is answered locally at once
//!    (`LocalReason::BreakerOpen`). A settle of a fleet claim is tried
//!    whatever the breaker says, and its result does not move the breaker
//!    unless the breaker let it through (below).
//! 4. The fleet gets the call's budget less a small reserve for the local answer,
//!    under a guard timer of its own, so a store that overruns its budget still
//!    cannot make the call late (the guard is a tokio timer: call the edge from
//!    within a tokio runtime). On an outage error (`StoreError::is_outage`) a
//!    hit or reset is answered locally; any other error is returned as is.
//!    Every outage counts against the breaker but `overloaded`: that node
//!    answered, shedding one hot tenant, and the edge's other tenants keep the
//!    fleet.
//!
//! # Settles are never degraded into local commits
//!
//! A settle of a claim the fleet made goes to the fleet only, even while the
//! breaker is open: a breaker backing off for up to `max_backoff` after the
//! fleet is back would otherwise fail every commit meanwhile, and each of
//! their hooks would be delivered again. If the fleet is out the settle
//! returns the error (it costs the settle its budget where the breaker would
//! have failed it at once): committing locally a
//! claim this process never made would let it answer `Duplicate` for a key whose
//! fleet claim may be released, expired or held by another hook — and answering
//! `NotFound` would be a lie about a claim the fleet still holds. The caller keeps
//! the error; the fleet's pending claim expires after `pending_ttl_ms`, and at
//! worst the sender's retry is delivered twice.
//!
//! # Resets go everywhere
//!
//! A reset is applied locally always (so a later outage starts from the new
//! limits) and sent to the fleet best effort; the answer's source says whether
//! the fleet took it.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ankusa_actors::types::validate_tenant;
use ankusa_actors::{AnchoredClock, Clock, HitOutcome, HitRequest, SettleOutcome, SettleRequest};
use serde::Serialize;

use crate::breaker::{
    Admission, BreakerConfig, BreakerState, CircuitBreaker, Monotonic, SystemMonotonic,
};
use crate::local::{LocalConfig, LocalStats, LocalStore};
use crate::protocol::ErrorCode;
use crate::store::{Store, StoreError};

/// Why an answer came from this process's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LocalReason {
    /// The breaker is open: the fleet was not tried.
    BreakerOpen,
    /// The fleet did not answer within the budget.
    Timeout,
    /// No node serves the tenant's shard.
    NoResponders,
    /// The client is not connected.
    Disconnected,
    /// A node answered with an error that is the fleet's fault.
    NodeError(ErrorCode),
    /// The fleet's reply could not be understood.
    BadReply,
    /// Another transport failure.
    Transport,
    /// The key's claim was made here during an outage and lives here.
    LocalClaim,
}

impl LocalReason {
    /// The reason to answer locally after `err`, or `None` when `err` is the
    /// request's fault and must be returned instead.
    pub fn for_error(err: &StoreError) -> Option<Self> {
        if !err.is_outage() {
            return None;
        }
        Some(match err {
            StoreError::Timeout(_) => LocalReason::Timeout,
            StoreError::NoResponders => LocalReason::NoResponders,
            StoreError::Disconnected => LocalReason::Disconnected,
            StoreError::Refused(reply) => LocalReason::NodeError(reply.code),
            StoreError::BadReply(_) => LocalReason::BadReply,
            StoreError::Transport(_) => LocalReason::Transport,
            StoreError::Invalid(_) => return None,
        })
    }
}

/// Who answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "source", rename_all = "snake_case")]
pub enum Source {
    Fleet,
    Local { reason: LocalReason },
}

/// An outcome and who produced it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Answer<T> {
    pub outcome: T,
    pub source: Source,
}

impl<T> Answer<T> {
    fn fleet(outcome: T) -> Self {
        Self {
            outcome,
            source: Source::Fleet,
        }
    }

    fn local(outcome: T, reason: LocalReason) -> Self {
        Self {
            outcome,
            source: Source::Local { reason },
        }
    }

    pub fn is_local(&self) -> bool {
        matches!(self.source, Source::Local { .. })
    }
}

/// How an [`Edge`] degrades.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EdgeConfig {
    pub breaker: BreakerConfig,
    pub local: LocalConfig,
    /// Kept back from each call's budget for the local answer after a fleet
    /// timeout (at most a tenth of the budget is kept).
    pub local_reserve: Duration,
}

impl Default for EdgeConfig {
    fn default() -> Self {
        Self {
            breaker: BreakerConfig::default(),
            local: LocalConfig::default(),
            local_reserve: Duration::from_millis(1),
        }
    }
}

/// A snapshot of an edge's counters, for printing and export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct EdgeStats {
    /// Answers (hit, settle, reset) from the fleet.
    pub fleet_answers: u64,
    /// Answers from local state, all reasons.
    pub local_answers: u64,
    pub local_breaker_open: u64,
    pub local_timeout: u64,
    pub local_no_responders: u64,
    pub local_disconnected: u64,
    pub local_node_error: u64,
    pub local_bad_reply: u64,
    pub local_transport: u64,
    pub local_claim: u64,
    /// Requests refused as invalid before any state was touched.
    pub invalid: u64,
    /// Fleet errors returned to the caller: non-outage refusals, and settles of
    /// fleet claims during an outage.
    pub errors: u64,
    pub breaker_state: BreakerState,
    pub breaker_opened: u64,
    pub breaker_half_open: u64,
    pub breaker_closed: u64,
    pub local_store: LocalStats,
}

#[derive(Debug, Default)]
struct Counters {
    fleet: AtomicU64,
    breaker_open: AtomicU64,
    timeout: AtomicU64,
    no_responders: AtomicU64,
    disconnected: AtomicU64,
    node_error: AtomicU64,
    bad_reply: AtomicU64,
    transport: AtomicU64,
    local_claim: AtomicU64,
    invalid: AtomicU64,
    errors: AtomicU64,
}

impl Counters {
    fn count(&self, source: Source) {
        let counter = match source {
            Source::Fleet => &self.fleet,
            Source::Local { reason } => match reason {
                LocalReason::BreakerOpen => &self.breaker_open,
                LocalReason::Timeout => &self.timeout,
                LocalReason::NoResponders => &self.no_responders,
                LocalReason::Disconnected => &self.disconnected,
                LocalReason::NodeError(_) => &self.node_error,
                LocalReason::BadReply => &self.bad_reply,
                LocalReason::Transport => &self.transport,
                LocalReason::LocalClaim => &self.local_claim,
            },
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Whether a fleet call waits for the breaker's leave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admit {
    /// Answered locally at once while the breaker is open.
    ByBreaker,
    /// Tried while it is open too: a settle has no local answer to fall back
    /// on, and a commit not made leaves its hook to be delivered again.
    Always,
}

/// What a fleet call came to.
enum Fleet<T> {
    Answered(T),
    /// Not tried, or an outage: answer locally for this reason.
    Out(LocalReason, Option<StoreError>),
    /// The fleet refused the request itself.
    Refused(StoreError),
}

/// The degrading edge client; see the module doc. `Send + Sync`: share it as
/// `Arc<Edge<S>>`.
pub struct Edge<S> {
    store: S,
    local: LocalStore,
    breaker: CircuitBreaker,
    mono: Arc<dyn Monotonic>,
    local_reserve: Duration,
    counters: Counters,
}

impl<S> std::fmt::Debug for Edge<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Edge")
            .field("breaker", &self.breaker.state())
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl<S: Store> Edge<S> {
    /// An edge over `store` on the system clocks: the local rules on wall
    /// time carried by the monotonic clock, so that a step of the host's
    /// clock does not empty or refill the local buckets.
    pub fn new(store: S, config: EdgeConfig) -> Self {
        Self::with_clocks(
            store,
            config,
            Arc::new(AnchoredClock::from_system()),
            Arc::new(SystemMonotonic),
        )
    }

    /// An edge over `store` with injected clocks: `clock` (unix µs) for the local
    /// rules, `mono` for the breaker's backoff.
    pub fn with_clocks(
        store: S,
        config: EdgeConfig,
        clock: Arc<dyn Clock>,
        mono: Arc<dyn Monotonic>,
    ) -> Self {
        Self {
            store,
            local: LocalStore::new(clock, config.local),
            breaker: CircuitBreaker::new(config.breaker, mono.now()),
            mono,
            local_reserve: config.local_reserve,
            counters: Counters::default(),
        }
    }

    /// The wrapped fleet store.
    pub fn store(&self) -> &S {
        &self.store
    }

    pub fn local(&self) -> &LocalStore {
        &self.local
    }

    pub fn breaker(&self) -> &CircuitBreaker {
        &self.breaker
    }

    /// The contract's `hit`, answered by the fleet or, on an outage, locally;
    /// returns within `timeout`.
    pub async fn hit(
        &self,
        req: HitRequest,
        timeout: Duration,
    ) -> Result<Answer<HitOutcome>, StoreError> {
        if req.is_empty() {
            // The fleet's answer, which needs no round trip (and no tenant
            // names a shard to send it to): every charge taken, there are none.
            return Ok(Answer::fleet(HitOutcome::Ok));
        }
        self.valid(req.validate())?;
        if let Some(claim) = &req.claim {
            if self
                .local
                .has_live_claim(&claim.tenant, &claim.source_id, &claim.key)
            {
                return Ok(self.answer_locally(&req, LocalReason::LocalClaim));
            }
        }
        let budget = self.fleet_budget(timeout);
        match self
            .call_fleet(
                || self.store.hit(req.clone(), budget),
                budget,
                Admit::ByBreaker,
            )
            .await
        {
            Fleet::Answered(outcome) => Ok(self.counted(Answer::fleet(outcome))),
            Fleet::Out(reason, _) => Ok(self.answer_locally(&req, reason)),
            Fleet::Refused(err) => Err(self.error(err)),
        }
    }

    /// The contract's `settle`: locally for a claim made here, else on the fleet
    /// (an outage is returned as the error, never settled locally; see the module
    /// doc). Returns within `timeout`.
    pub async fn settle(
        &self,
        req: SettleRequest,
        timeout: Duration,
    ) -> Result<Answer<SettleOutcome>, StoreError> {
        self.valid(req.validate())?;
        if self.local.holds_claim(&req.claim) {
            let outcome = self.local.settle_valid(&req);
            return Ok(self.counted(Answer::local(outcome, LocalReason::LocalClaim)));
        }
        let budget = self.fleet_budget(timeout);
        match self
            .call_fleet(|| self.store.settle(req, budget), budget, Admit::Always)
            .await
        {
            Fleet::Answered(outcome) => Ok(self.counted(Answer::fleet(outcome))),
            Fleet::Out(_, Some(err)) | Fleet::Refused(err) => Err(self.error(err)),
            Fleet::Out(_, None) => Err(self.error(StoreError::Timeout(budget))),
        }
    }

    /// The contract's `reset`: local always, fleet best effort. `Source::Fleet`
    /// when the fleet took it too. Returns within `timeout`.
    pub async fn reset(&self, tenant: &str, timeout: Duration) -> Result<Answer<()>, StoreError> {
        self.valid(validate_tenant(tenant))?;
        self.local.reset_valid(tenant);
        let budget = self.fleet_budget(timeout);
        match self
            .call_fleet(
                || self.store.reset(tenant.to_string(), budget),
                budget,
                Admit::ByBreaker,
            )
            .await
        {
            Fleet::Answered(()) => Ok(self.counted(Answer::fleet(()))),
            Fleet::Out(reason, _) => Ok(self.counted(Answer::local((), reason))),
            Fleet::Refused(err) => Err(self.error(err)),
        }
    }

    /// Sweeps the local store (for a periodic tick); returns the claims dropped.
    pub fn sweep(&self) -> usize {
        self.local.sweep()
    }

    pub fn stats(&self) -> EdgeStats {
        let c = &self.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let by_reason = [
            load(&c.breaker_open),
            load(&c.timeout),
            load(&c.no_responders),
            load(&c.disconnected),
            load(&c.node_error),
            load(&c.bad_reply),
            load(&c.transport),
            load(&c.local_claim),
        ];
        let transitions = self.breaker.transitions();
        EdgeStats {
            fleet_answers: load(&c.fleet),
            local_answers: by_reason.iter().sum(),
            local_breaker_open: by_reason[0],
            local_timeout: by_reason[1],
            local_no_responders: by_reason[2],
            local_disconnected: by_reason[3],
            local_node_error: by_reason[4],
            local_bad_reply: by_reason[5],
            local_transport: by_reason[6],
            local_claim: by_reason[7],
            invalid: load(&c.invalid),
            errors: load(&c.errors),
            breaker_state: self.breaker.state(),
            breaker_opened: transitions.opened,
            breaker_half_open: transitions.half_open,
            breaker_closed: transitions.closed,
            local_store: self.local.stats(),
        }
    }

    /// Runs one fleet call (made only if the breaker admits it) through the
    /// breaker, bounded by `budget` even if the
    /// store overruns it.
    async fn call_fleet<T, F>(
        &self,
        call: impl FnOnce() -> F,
        budget: Duration,
        admit: Admit,
    ) -> Fleet<T>
    where
        F: Future<Output = Result<T, StoreError>>,
    {
        // No time left for the fleet is the caller's budget, not the fleet's
        // failure: it is answered locally at once, and the breaker not told.
        if budget < S::LEAST_BUDGET || budget.is_zero() {
            return Fleet::Out(LocalReason::Timeout, None);
        }
        let permit = match self.breaker.admit(self.mono.now()) {
            Admission::Allowed(permit) => Some(permit),
            // Tried all the same, and not told: the breaker's own probe decides.
            Admission::Rejected if admit == Admit::Always => None,
            Admission::Rejected => return Fleet::Out(LocalReason::BreakerOpen, None),
        };
        let tell = |ok: bool| {
            if let Some(permit) = permit {
                permit.record(ok, self.mono.now());
            }
        };
        let result = match tokio::time::timeout(budget, call()).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(budget)),
        };
        match result {
            Ok(outcome) => {
                tell(true);
                Fleet::Answered(outcome)
            }
            Err(err) => match LocalReason::for_error(&err) {
                Some(reason) => {
                    // A node shedding one hot tenant's requests answered: the
                    // fleet is up for this edge's other tenants, which a breaker
                    // opened by that one tenant would send local too.
                    tell(
                        matches!(&err, StoreError::Refused(reply) if reply.code == ErrorCode::Overloaded),
                    );
                    Fleet::Out(reason, Some(err))
                }
                None => {
                    // The fleet answered, so it is up, even if it refused.
                    tell(true);
                    Fleet::Refused(err)
                }
            },
        }
    }

    fn answer_locally(&self, req: &HitRequest, reason: LocalReason) -> Answer<HitOutcome> {
        self.counted(Answer::local(self.local.hit_valid(req), reason))
    }

    fn fleet_budget(&self, timeout: Duration) -> Duration {
        timeout.saturating_sub(self.local_reserve.min(timeout / 10))
    }

    fn valid(&self, check: Result<(), ankusa_actors::InvalidRequest>) -> Result<(), StoreError> {
        check.map_err(|why| {
            self.counters.invalid.fetch_add(1, Ordering::Relaxed);
            StoreError::Invalid(why)
        })
    }

    fn counted<T>(&self, answer: Answer<T>) -> Answer<T> {
        self.counters.count(answer.source);
        answer
    }

    fn error(&self, err: StoreError) -> StoreError {
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        err
    }
}
