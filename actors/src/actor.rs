//! The actors: a [`ShardActor`] per shard routes each request to the
//! [`TenantActor`] of its tenant, spawning it on demand.
//!
//! Memory follows live state. A tenant actor that has been quiet for
//! [`ShardConfig::idle_after`] is retired: its state comes back to the shard,
//! which drops it when empty (buckets full, no live claim) or keeps it parked in a
//! plain map, a few dozen bytes a tenant, until the tenant is heard from again.
//! Expired claims are swept on the shard's tick, never with a timer per claim.
//!
//! Fairness: each tenant has a bounded queue. A tenant flooding its shard is shed
//! with [`Refused::Overloaded`] at the shard, so the other tenants of the shard,
//! each behind its own actor, keep their latency.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::rpc::CallResult;
use ractor::{
    Actor, ActorCell, ActorProcessingErr, ActorRef, MessagingErr, RpcReplyPort, SupervisionEvent,
};
use serde::{Deserialize, Serialize};

use crate::clock::Clock;
use crate::tenant::{Applied, Changes, TenantSnapshot, TenantState};
use crate::types::{
    validate_tenant, HitOutcome, HitRequest, InvalidRequest, SettleOutcome, SettleRequest,
};

/// Why an actor did not apply a request. Nothing was changed in every case.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("invalid request: {0}")]
    Invalid(#[from] InvalidRequest),
    #[error("the request's deadline passed before it was processed")]
    DeadlineExpired,
    #[error("tenant queue is full ({queued} waiting); shedding")]
    Overloaded { queued: usize },
    #[error("the shard is not running")]
    Unavailable,
}

/// The reply to one request: the outcome and what moved, or why nothing did.
pub type Reply<T> = Result<Applied<T>, Refused>;

/// A request with the instant after which nobody waits for its answer.
#[derive(Debug)]
pub struct Job<Req, Out> {
    pub req: Req,
    pub deadline: Option<Instant>,
    pub reply: RpcReplyPort<Reply<Out>>,
}

impl<Req, Out> Job<Req, Out> {
    fn expired(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    fn refuse(self, why: Refused) {
        // The caller may have stopped waiting; that is its right.
        let _ = self.reply.send(Err(why));
    }
}

pub type HitJob = Job<HitRequest, HitOutcome>;
pub type SettleJob = Job<SettleRequest, SettleOutcome>;

/// Messages a tenant actor takes (only from its shard).
#[derive(Debug)]
pub enum TenantMsg {
    Hit(HitJob),
    Settle(SettleJob),
    Reset(RpcReplyPort<Changes>),
    Sweep,
    Snapshot(RpcReplyPort<TenantSnapshot>),
    /// Merge persisted state in.
    Absorb(TenantSnapshot),
    /// Hand the state back and stop.
    Retire(RpcReplyPort<TenantState>),
    /// Fail, to exercise supervision.
    #[cfg(test)]
    Fail,
}

/// Messages a shard actor takes.
#[derive(Debug)]
pub enum ShardMsg {
    Hit(HitJob),
    Settle(SettleJob),
    /// Forget the tenant's buckets.
    Reset {
        tenant: String,
        reply: RpcReplyPort<Result<Changes, Refused>>,
    },
    /// Retire quiet tenants and, every `sweep_every`, sweep expired claims.
    Tick,
    /// Merge persisted state in (loading a shard, possibly in several parts).
    Absorb(Vec<TenantSnapshot>),
    /// Every live tenant's state.
    Export(RpcReplyPort<Vec<TenantSnapshot>>),
    Stats(RpcReplyPort<ShardStats>),
    /// Make a tenant's actor fail, to exercise supervision.
    #[cfg(test)]
    FailTenant(String),
}

/// Gauges of one shard.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardStats {
    /// Tenants with a running actor.
    pub active_tenants: usize,
    /// Tenants whose state is parked in the shard.
    pub parked_tenants: usize,
    /// Claims held (live, or expired and not yet swept), as of each tenant's last
    /// processed message.
    pub claims: usize,
    /// Tenant actors that failed and were restarted.
    pub restarts: u64,
    /// Requests shed because a tenant's queue was full.
    pub shed: u64,
}

/// How a shard runs its tenants.
#[derive(Clone)]
pub struct ShardConfig {
    pub clock: Arc<dyn Clock>,
    /// A tenant actor with no request for this long is retired on the next tick.
    pub idle_after: Duration,
    /// Expired claims are swept at most this often.
    pub sweep_every: Duration,
    /// Requests a tenant may have waiting before more are shed.
    pub tenant_queue: usize,
    /// What a tenant actor's failure does to its shard.
    pub on_tenant_failure: TenantFailure,
}

/// How a shard supervises its tenants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantFailure {
    /// Start the tenant afresh, empty, on its next request (state in memory only:
    /// there is nothing better to restart from).
    RestartEmpty,
    /// Fail the shard, so that its owner restarts it from persisted state and the
    /// tenant's claims come back.
    Escalate,
}

impl ShardConfig {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            idle_after: Duration::from_secs(30),
            sweep_every: Duration::from_secs(5),
            tenant_queue: 1024,
            on_tenant_failure: TenantFailure::RestartEmpty,
        }
    }
}

/// The actor of one tenant.
pub struct TenantActor;

pub struct TenantArgs {
    pub state: TenantState,
    pub clock: Arc<dyn Clock>,
    pub gauges: Arc<TenantGauges>,
}

/// What a tenant actor shows its shard without being asked: reading these never
/// waits on the actor's mailbox.
#[derive(Debug, Default)]
pub struct TenantGauges {
    /// Requests routed to the actor and not yet taken up.
    pub queued: AtomicUsize,
    /// Claims the tenant holds (live, or expired and not yet swept).
    pub claims: AtomicUsize,
}

pub struct TenantActorState {
    state: TenantState,
    clock: Arc<dyn Clock>,
    gauges: Arc<TenantGauges>,
}

impl Actor for TenantActor {
    type Msg = TenantMsg;
    type State = TenantActorState;
    type Arguments = TenantArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<TenantMsg>,
        args: TenantArgs,
    ) -> Result<TenantActorState, ActorProcessingErr> {
        Ok(TenantActorState {
            state: args.state,
            clock: args.clock,
            gauges: args.gauges,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<TenantMsg>,
        msg: TenantMsg,
        me: &mut TenantActorState,
    ) -> Result<(), ActorProcessingErr> {
        let now = me.clock.now_us();
        match msg {
            TenantMsg::Hit(job) => {
                me.gauges.queued.fetch_sub(1, Ordering::Relaxed);
                if job.expired() {
                    job.refuse(Refused::DeadlineExpired);
                    return Ok(());
                }
                let applied = me.state.hit(now, &job.req);
                let _ = job.reply.send(Ok(applied));
            }
            TenantMsg::Settle(job) => {
                me.gauges.queued.fetch_sub(1, Ordering::Relaxed);
                if job.expired() {
                    job.refuse(Refused::DeadlineExpired);
                    return Ok(());
                }
                let applied = me.state.settle(now, &job.req);
                let _ = job.reply.send(Ok(applied));
            }
            TenantMsg::Reset(reply) => {
                let _ = reply.send(me.state.reset());
            }
            TenantMsg::Sweep => {
                me.state.sweep(now);
            }
            TenantMsg::Snapshot(reply) => {
                // The shard knows the name; it fills it in.
                let _ = reply.send(me.state.snapshot("", now));
            }
            TenantMsg::Absorb(snapshot) => me.state.absorb(snapshot, now),
            #[cfg(test)]
            TenantMsg::Fail => return Err("failing on request".into()),
            TenantMsg::Retire(reply) => {
                let _ = reply.send(std::mem::take(&mut me.state));
                myself.stop(None);
            }
        }
        me.gauges
            .claims
            .store(me.state.claims().len(), Ordering::Relaxed);
        Ok(())
    }
}

/// The actor of one shard.
pub struct ShardActor;

struct ActiveTenant {
    actor: ActorRef<TenantMsg>,
    gauges: Arc<TenantGauges>,
    last_routed_us: u64,
}

pub struct ShardState {
    config: ShardConfig,
    active: HashMap<Box<str>, ActiveTenant>,
    parked: HashMap<Box<str>, TenantState>,
    last_sweep_us: u64,
    restarts: u64,
    shed: u64,
}

impl ShardState {
    /// The tenant's actor, started (from its parked state, if any) when needed.
    async fn tenant(
        &mut self,
        myself: &ActorRef<ShardMsg>,
        tenant: &str,
    ) -> Result<&mut ActiveTenant, ActorProcessingErr> {
        if !self.active.contains_key(tenant) {
            let state = self.parked.remove(tenant).unwrap_or_default();
            let gauges = Arc::new(TenantGauges::default());
            gauges.claims.store(state.claims().len(), Ordering::Relaxed);
            let args = TenantArgs {
                state,
                clock: self.config.clock.clone(),
                gauges: gauges.clone(),
            };
            let (actor, _) =
                Actor::spawn_linked(None, TenantActor, args, myself.get_cell()).await?;
            self.active.insert(
                tenant.into(),
                ActiveTenant {
                    actor,
                    gauges,
                    last_routed_us: 0,
                },
            );
        }
        let now = self.config.clock.now_us();
        let active = self
            .active
            .get_mut(tenant)
            .ok_or("tenant actor vanished while being started")?;
        active.last_routed_us = now;
        Ok(active)
    }

    /// Routes a hit or settle job, shedding it when the tenant's queue is full.
    async fn route<Req, Out>(
        &mut self,
        myself: &ActorRef<ShardMsg>,
        tenant: &str,
        job: Job<Req, Out>,
        wrap: fn(Job<Req, Out>) -> TenantMsg,
    ) -> Result<(), ActorProcessingErr> {
        let limit = self.config.tenant_queue;
        let active = self.tenant(myself, tenant).await?;
        let queued = active.gauges.queued.fetch_add(1, Ordering::Relaxed);
        if queued >= limit {
            active.gauges.queued.fetch_sub(1, Ordering::Relaxed);
            self.shed += 1;
            job.refuse(Refused::Overloaded { queued });
            return Ok(());
        }
        if let Err(err) = active.actor.cast(wrap(job)) {
            // The actor is stopping; its supervision event will clean up.
            active.gauges.queued.fetch_sub(1, Ordering::Relaxed);
            match err {
                MessagingErr::SendErr(TenantMsg::Hit(job)) => job.refuse(Refused::Unavailable),
                MessagingErr::SendErr(TenantMsg::Settle(job)) => job.refuse(Refused::Unavailable),
                _ => {}
            }
            self.active.remove(tenant);
        }
        Ok(())
    }

    async fn tick(&mut self) {
        let now = self.config.clock.now_us();
        let idle_us = self.config.idle_after.as_micros() as u64;
        let quiet: Vec<Box<str>> = self
            .active
            .iter()
            .filter(|(_, t)| now.saturating_sub(t.last_routed_us) >= idle_us)
            .map(|(name, _)| name.clone())
            .collect();
        for name in quiet {
            let Some(tenant) = self.active.remove(&name) else {
                continue;
            };
            // FIFO mailbox: Retire runs after every job already routed to it, and no
            // new job can be routed while this handler awaits.
            if let Ok(CallResult::Success(mut state)) =
                tenant.actor.call(TenantMsg::Retire, None).await
            {
                state.sweep(now);
                if !state.is_empty(now) {
                    self.parked.insert(name, state);
                }
            }
        }

        let sweep_us = self.config.sweep_every.as_micros() as u64;
        if now.saturating_sub(self.last_sweep_us) >= sweep_us {
            self.last_sweep_us = now;
            for tenant in self.active.values() {
                let _ = tenant.actor.cast(TenantMsg::Sweep);
            }
            self.parked.retain(|_, state| {
                state.sweep(now);
                !state.is_empty(now)
            });
        }
    }

    async fn export(&self) -> Vec<TenantSnapshot> {
        let now = self.config.clock.now_us();
        let mut out = Vec::with_capacity(self.active.len() + self.parked.len());
        for (name, tenant) in &self.active {
            if let Ok(CallResult::Success(mut snap)) =
                tenant.actor.call(TenantMsg::Snapshot, None).await
            {
                snap.tenant = name.to_string();
                out.push(snap);
            }
        }
        out.extend(
            self.parked
                .iter()
                .map(|(name, state)| state.snapshot(name, now)),
        );
        out.retain(|s| !s.buckets.is_empty() || !s.claims.is_empty());
        out
    }

    /// Read from the tenants' gauges: the shard never waits on a tenant for it.
    fn stats(&self) -> ShardStats {
        let parked: usize = self.parked.values().map(|s| s.claims().len()).sum();
        let active: usize = self
            .active
            .values()
            .map(|t| t.gauges.claims.load(Ordering::Relaxed))
            .sum();
        let claims = parked + active;
        ShardStats {
            active_tenants: self.active.len(),
            parked_tenants: self.parked.len(),
            claims,
            restarts: self.restarts,
            shed: self.shed,
        }
    }
}

/// What a shard starts with.
pub struct ShardArgs {
    pub config: ShardConfig,
    pub tenants: Vec<TenantSnapshot>,
}

impl Actor for ShardActor {
    type Msg = ShardMsg;
    type State = ShardState;
    type Arguments = ShardArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<ShardMsg>,
        args: ShardArgs,
    ) -> Result<ShardState, ActorProcessingErr> {
        let mut state = ShardState {
            last_sweep_us: args.config.clock.now_us(),
            config: args.config,
            active: HashMap::new(),
            parked: HashMap::new(),
            restarts: 0,
            shed: 0,
        };
        absorb(&mut state, args.tenants);
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<ShardMsg>,
        msg: ShardMsg,
        state: &mut ShardState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ShardMsg::Hit(job) => {
                if let Err(why) = job.req.validate() {
                    job.refuse(why.into());
                    return Ok(());
                }
                if job.expired() {
                    job.refuse(Refused::DeadlineExpired);
                    return Ok(());
                }
                let tenant = job.req.tenant().to_owned();
                state.route(&myself, &tenant, job, TenantMsg::Hit).await?;
            }
            ShardMsg::Settle(job) => {
                if let Err(why) = job.req.validate() {
                    job.refuse(why.into());
                    return Ok(());
                }
                if job.expired() {
                    job.refuse(Refused::DeadlineExpired);
                    return Ok(());
                }
                let tenant = job.req.claim.tenant.clone();
                state
                    .route(&myself, &tenant, job, TenantMsg::Settle)
                    .await?;
            }
            ShardMsg::Reset { tenant, reply } => {
                if let Err(why) = validate_tenant(&tenant) {
                    let _ = reply.send(Err(why.into()));
                    return Ok(());
                }
                let changes = if let Some(active) = state.active.get(tenant.as_str()) {
                    match active.actor.call(TenantMsg::Reset, None).await {
                        Ok(CallResult::Success(changes)) => Ok(changes),
                        _ => Err(Refused::Unavailable),
                    }
                } else if let Some(parked) = state.parked.get_mut(tenant.as_str()) {
                    Ok(parked.reset())
                } else {
                    Ok(TenantState::default().reset())
                };
                let _ = reply.send(changes);
            }
            ShardMsg::Tick => state.tick().await,
            ShardMsg::Absorb(tenants) => absorb(state, tenants),
            ShardMsg::Export(reply) => {
                let _ = reply.send(state.export().await);
            }
            ShardMsg::Stats(reply) => {
                let _ = reply.send(state.stats());
            }
            #[cfg(test)]
            ShardMsg::FailTenant(tenant) => {
                let active = state.tenant(&myself, &tenant).await?;
                let _ = active.actor.cast(TenantMsg::Fail);
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<ShardMsg>,
        event: SupervisionEvent,
        state: &mut ShardState,
    ) -> Result<(), ActorProcessingErr> {
        // A tenant that failed is forgotten here and, as configured, started
        // afresh by its next request or escalated; jobs in its mailbox see their
        // reply port dropped. Retired tenants were removed before they stopped, so
        // termination needs nothing.
        if let SupervisionEvent::ActorFailed(cell, err) = event {
            let failed = cell.get_id();
            state.active.retain(|_, t| t.actor.get_id() != failed);
            state.restarts += 1;
            if state.config.on_tenant_failure == TenantFailure::Escalate {
                tracing::error!(error = %err, "tenant actor failed; failing its shard to reload it");
                return Err(format!("tenant actor failed: {err}").into());
            }
            tracing::error!(error = %err, "tenant actor failed; it restarts on its next request");
        }
        Ok(())
    }
}

/// Merges persisted snapshots in: into a running tenant's actor, or its parked state.
fn absorb(state: &mut ShardState, tenants: Vec<TenantSnapshot>) {
    let now = state.config.clock.now_us();
    for snapshot in tenants {
        if let Some(active) = state.active.get(snapshot.tenant.as_str()) {
            if let Err(MessagingErr::SendErr(TenantMsg::Absorb(snapshot))) =
                active.actor.cast(TenantMsg::Absorb(snapshot))
            {
                tracing::warn!(tenant = %snapshot.tenant, "tenant stopping; state not absorbed");
            }
            continue;
        }
        let name: Box<str> = snapshot.tenant.as_str().into();
        state.parked.entry(name).or_default().absorb(snapshot, now);
    }
}

/// Starts a shard actor, optionally under a supervisor.
pub async fn spawn_shard(
    config: ShardConfig,
    tenants: Vec<TenantSnapshot>,
    supervisor: Option<ActorCell>,
) -> Result<ActorRef<ShardMsg>, ractor::SpawnErr> {
    let args = ShardArgs { config, tenants };
    let (actor, _) = match supervisor {
        Some(sup) => Actor::spawn_linked(None, ShardActor, args, sup).await?,
        None => Actor::spawn(None, ShardActor, args).await?,
    };
    Ok(actor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::types::{Charge, Claim, Kind};

    fn hit(key: &str) -> HitRequest {
        HitRequest {
            charges: vec![Charge {
                kind: Kind::Hooks,
                tenant: "t".into(),
                increment_us: 1,
                capacity_us: 1_000,
            }],
            claim: Some(Claim {
                tenant: "t".into(),
                source_id: "s".into(),
                key: key.into(),
                hook_id: "h".into(),
                node: "n".into(),
                ttl_ms: 1_000,
                pending_ttl_ms: 1_000,
            }),
        }
    }

    async fn send_hit(shard: &ActorRef<ShardMsg>, key: &str) -> Option<Reply<HitOutcome>> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        let job = Job {
            req: hit(key),
            deadline: None,
            reply: reply.into(),
        };
        shard.cast(ShardMsg::Hit(job)).ok()?;
        rx.await.ok()
    }

    async fn shard_with(policy: TenantFailure) -> ActorRef<ShardMsg> {
        let config = ShardConfig {
            on_tenant_failure: policy,
            ..ShardConfig::new(Arc::new(ManualClock::new(1_000_000)))
        };
        spawn_shard(config, Vec::new(), None).await.expect("spawns")
    }

    #[tokio::test]
    async fn a_failed_tenant_restarts_empty_by_default() {
        let shard = shard_with(TenantFailure::RestartEmpty).await;
        assert!(matches!(send_hit(&shard, "a").await, Some(Ok(_))));
        shard.cast(ShardMsg::FailTenant("t".into())).expect("cast");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let stats = shard.call(ShardMsg::Stats, None).await.expect("call");
        assert!(matches!(stats, CallResult::Success(s) if s.restarts == 1));
        // Served again, from an empty state: the old claim is gone.
        let again = send_hit(&shard, "a").await;
        assert!(
            matches!(
                again,
                Some(Ok(Applied {
                    outcome: HitOutcome::Ok,
                    ..
                }))
            ),
            "{again:?}"
        );
    }

    #[tokio::test]
    async fn a_failed_tenant_can_escalate_to_its_shard() {
        let shard = shard_with(TenantFailure::Escalate).await;
        assert!(matches!(send_hit(&shard, "a").await, Some(Ok(_))));
        shard.cast(ShardMsg::FailTenant("t".into())).expect("cast");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(shard.get_status(), ractor::ActorStatus::Stopped);
        assert!(
            send_hit(&shard, "b").await.is_none(),
            "a failed shard takes no work"
        );
    }
}
