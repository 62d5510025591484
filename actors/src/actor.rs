//! The actors: a [`TenantActor`] per tenant owns its buckets and claims; a
//! [`ShardActor`] per shard starts, retires and supervises its tenants.
//!
//! A request for a tenant whose actor runs (a hit, a settle, a reset or an
//! inspect: a [`TenantRequest`]) goes straight to that actor
//! ([`ShardHandle::send`]), into the one mailbox the tenant takes them from.
//! Only a tenant without one goes through the shard actor, which starts it for
//! a hit or a settle, and applies a reset or an inspect to the tenant's parked
//! state without starting it. The shard waits on a tenant only to retire it
//! or to export its state, never to route a request, and tenants never wait
//! on the shard, so the two cannot deadlock. The shard actor is the only one
//! that adds or removes running tenants, and a handle casts while it holds the
//! map's read lock, so a job handed to a tenant always lands in its mailbox
//! before the shard's own message retiring it.
//!
//! Memory follows live state. A tenant actor that has been quiet for
//! [`ShardConfig::idle_after`] is retired: its state comes back to the shard,
//! which drops it when empty (buckets full, no live claim) or keeps it parked in a
//! plain map, a few dozen bytes a tenant, until the tenant is heard from again.
//! Expired claims are swept on the shard's tick, never with a timer per claim,
//! each shard at its own point of the sweep period so that a node's shards do
//! not all scan their claims at once, and a tenant's table in steps of
//! [`SWEEP_STEP_BUCKETS`] with its requests answered between them; the parked
//! tenants' tables (retired ones' included) by the shard, a step a tick.
//!
//! Fairness: each tenant has a bounded queue. A tenant flooding its shard is shed
//! with [`Refused::Overloaded`] at the shard, so the other tenants of the shard,
//! each behind its own actor, keep their latency. A tenant's claims are bounded
//! too ([`ShardConfig::max_tenant_claims`]): a hit on a new key past the bound
//! is refused with [`Refused::ClaimsFull`], so one tenant's unique keys cannot
//! fill the node's memory; loads keep every persisted claim regardless.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use ractor::rpc::CallResult;
use ractor::{
    Actor, ActorCell, ActorProcessingErr, ActorRef, MessagingErr, RpcReplyPort, SupervisionEvent,
};
use serde::{Deserialize, Serialize};

use crate::clock::Clock;
use crate::tenant::{Applied, ClaimsFull, TenantSnapshot, TenantState};
use crate::types::{
    HitOutcome, HitRequest, InspectRequest, InvalidRequest, ResetRequest, SettleOutcome,
    SettleRequest, TenantView,
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
    #[error(transparent)]
    ClaimsFull(#[from] ClaimsFull),
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
pub type ResetJob = Job<ResetRequest, ()>;
pub type InspectJob = Job<InspectRequest, TenantView>;

/// Messages a tenant actor takes (from its shard and the shard's handles).
#[derive(Debug)]
pub enum TenantMsg {
    Hit(HitJob),
    Settle(SettleJob),
    Reset(ResetJob),
    Inspect(InspectJob),
    /// Sweep expired claims, unless a sweep is under way.
    Sweep,
    /// The next step of the sweep under way, queued behind the requests that
    /// came during the last one.
    SweepOn,
    Snapshot(RpcReplyPort<TenantSnapshot>),
    /// Merge persisted state in.
    Absorb(TenantSnapshot),
    /// Hand the state back and stop.
    Retire(RpcReplyPort<TenantState>),
    /// Fail, to exercise supervision.
    #[cfg(test)]
    Fail,
    /// Take this long over one message, to stand for a busy tenant.
    #[cfg(test)]
    Stall(Duration),
}

/// Messages a shard actor takes.
#[derive(Debug)]
pub enum ShardMsg {
    /// A request for a tenant whose actor was not running when it was sent.
    Hit(HitJob),
    Settle(SettleJob),
    /// Applied to the tenant's parked state; its actor is not started for it.
    Reset(ResetJob),
    /// Read from the tenant's parked state; its actor is not started for it.
    Inspect(InspectJob),
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
    /// Keep a tenant's actor busy for a while.
    #[cfg(test)]
    StallTenant(String, Duration),
    /// Hold the shard actor until told to go on.
    #[cfg(test)]
    Hold(tokio::sync::oneshot::Receiver<()>),
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
    /// Claims a tenant may hold (live, or expired and not yet swept) before a
    /// hit on a new key is refused with [`Refused::ClaimsFull`].
    pub max_tenant_claims: usize,
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
    /// `sweep_every` in the clock's microseconds, at least one.
    fn sweep_period_us(&self) -> u64 {
        u64::try_from(self.sweep_every.as_micros())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            idle_after: Duration::from_secs(30),
            sweep_every: Duration::from_secs(5),
            tenant_queue: 1024,
            max_tenant_claims: DEFAULT_MAX_TENANT_CLAIMS,
            on_tenant_failure: TenantFailure::RestartEmpty,
        }
    }
}

/// The actor of one tenant.
pub struct TenantActor;

pub struct TenantArgs {
    pub state: TenantState,
    pub clock: Arc<dyn Clock>,
    pub max_claims: usize,
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
    /// When the actor last took up a hit or settle (or started), by its clock.
    pub last_active_us: AtomicU64,
}

/// The claims one tenant may hold at a node unless configured otherwise: about
/// 2 to 3 GB of a node's memory (200 to 300 bytes a claim), and a day's claims of a
/// tenant taking over a hundred hooks a second.
pub const DEFAULT_MAX_TENANT_CLAIMS: usize = 10_000_000;

/// How many places of a claim table one sweep step looks at: a tenant is
/// busy for tens of microseconds a step, not milliseconds a table.
pub const SWEEP_STEP_BUCKETS: usize = 4096;

pub struct TenantActorState {
    state: TenantState,
    clock: Arc<dyn Clock>,
    max_claims: usize,
    gauges: Arc<TenantGauges>,
    /// A [`TenantMsg::SweepOn`] is queued.
    sweeping: bool,
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
            max_claims: args.max_claims,
            gauges: args.gauges,
            sweeping: false,
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
            TenantMsg::Hit(job) => me.take(job, now),
            TenantMsg::Settle(job) => me.take(job, now),
            TenantMsg::Reset(job) => me.take(job, now),
            TenantMsg::Inspect(job) => me.take(job, now),
            TenantMsg::Sweep if me.sweeping => {}
            TenantMsg::Sweep | TenantMsg::SweepOn => {
                let step = me.state.sweep_step(now, SWEEP_STEP_BUCKETS);
                // Failing only when the actor stops, and its state goes with it.
                me.sweeping = !step.finished && myself.cast(TenantMsg::SweepOn).is_ok();
            }
            TenantMsg::Snapshot(reply) => {
                // The shard knows the name; it fills it in.
                let _ = reply.send(me.state.snapshot("", now));
            }
            TenantMsg::Absorb(snapshot) => me.state.absorb(snapshot, now),
            #[cfg(test)]
            TenantMsg::Fail => return Err("failing on request".into()),
            #[cfg(test)]
            TenantMsg::Stall(pause) => tokio::time::sleep(pause).await,
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

impl TenantActorState {
    /// Applies one routed request, unless its caller has given up on it.
    fn take<R: TenantRequest>(&mut self, job: Job<R, R::Outcome>, now: u64) {
        self.gauges.queued.fetch_sub(1, Ordering::Relaxed);
        if R::KEEPS_AWAKE {
            self.gauges.last_active_us.store(now, Ordering::Relaxed);
        }
        if job.expired() {
            job.refuse(Refused::DeadlineExpired);
            return;
        }
        let reply = job.req.apply(&mut self.state, now, self.max_claims);
        let _ = job.reply.send(reply);
    }
}

/// A request applied to one tenant's state: a hit, a settle, a reset or an
/// inspect. All four go through the tenant's one mailbox, under the same
/// queue bound.
pub trait TenantRequest: Sized + Send + 'static {
    type Outcome: Send + 'static;
    /// Whether the request starts a parked tenant's actor and counts as the
    /// tenant's activity. An operator's reset or read does neither: it is
    /// applied to the parked state in the shard, and does not keep an idle
    /// tenant from being parked.
    const KEEPS_AWAKE: bool;
    /// The tenant whose actor applies it (the routing key).
    fn tenant_name(&self) -> &str;
    /// Its own `validate`.
    fn check(&self) -> Result<(), InvalidRequest>;
    /// Applies it to the tenant's state at `now_us`, the tenant allowed
    /// `max_claims` claims.
    fn apply(
        &self,
        state: &mut TenantState,
        now_us: u64,
        max_claims: usize,
    ) -> Reply<Self::Outcome>;
    /// The message carrying the job to its tenant's actor.
    fn to_tenant(job: Job<Self, Self::Outcome>) -> TenantMsg;
    /// The job back from a message its tenant's actor did not take.
    fn from_tenant(msg: TenantMsg) -> Option<Job<Self, Self::Outcome>>;
    /// The message carrying the job to the shard's actor.
    fn to_shard(job: Job<Self, Self::Outcome>) -> ShardMsg;
    /// The job back from a message the shard's actor did not take.
    fn from_shard(msg: ShardMsg) -> Option<Job<Self, Self::Outcome>>;
}

/// The message variants, `TenantMsg::$variant` and `ShardMsg::$variant`, that
/// carry a request's job.
macro_rules! routed_as {
    ($variant:ident) => {
        fn to_tenant(job: Job<Self, Self::Outcome>) -> TenantMsg {
            TenantMsg::$variant(job)
        }
        fn from_tenant(msg: TenantMsg) -> Option<Job<Self, Self::Outcome>> {
            match msg {
                TenantMsg::$variant(job) => Some(job),
                _ => None,
            }
        }
        fn to_shard(job: Job<Self, Self::Outcome>) -> ShardMsg {
            ShardMsg::$variant(job)
        }
        fn from_shard(msg: ShardMsg) -> Option<Job<Self, Self::Outcome>> {
            match msg {
                ShardMsg::$variant(job) => Some(job),
                _ => None,
            }
        }
    };
}

impl TenantRequest for HitRequest {
    type Outcome = HitOutcome;
    const KEEPS_AWAKE: bool = true;
    fn tenant_name(&self) -> &str {
        self.tenant()
    }
    fn check(&self) -> Result<(), InvalidRequest> {
        self.validate()
    }
    fn apply(&self, state: &mut TenantState, now_us: u64, max_claims: usize) -> Reply<HitOutcome> {
        Ok(state.hit_within(now_us, self, max_claims)?)
    }
    routed_as!(Hit);
}

impl TenantRequest for SettleRequest {
    type Outcome = SettleOutcome;
    const KEEPS_AWAKE: bool = true;
    fn tenant_name(&self) -> &str {
        &self.claim.tenant
    }
    fn check(&self) -> Result<(), InvalidRequest> {
        self.validate()
    }
    fn apply(&self, state: &mut TenantState, now_us: u64, _: usize) -> Reply<SettleOutcome> {
        Ok(state.settle(now_us, self))
    }
    routed_as!(Settle);
}

impl TenantRequest for ResetRequest {
    type Outcome = ();
    const KEEPS_AWAKE: bool = false;
    fn tenant_name(&self) -> &str {
        &self.tenant
    }
    fn check(&self) -> Result<(), InvalidRequest> {
        self.validate()
    }
    fn apply(&self, state: &mut TenantState, _now_us: u64, _: usize) -> Reply<()> {
        Ok(Applied {
            outcome: (),
            changes: state.reset(),
        })
    }
    routed_as!(Reset);
}

impl TenantRequest for InspectRequest {
    type Outcome = TenantView;
    const KEEPS_AWAKE: bool = false;
    fn tenant_name(&self) -> &str {
        &self.tenant
    }
    fn check(&self) -> Result<(), InvalidRequest> {
        self.validate()
    }
    fn apply(&self, state: &mut TenantState, now_us: u64, _: usize) -> Reply<TenantView> {
        Ok(Applied::unchanged(
            state.inspect(now_us, self.claim.as_ref()),
        ))
    }
    routed_as!(Inspect);
}

/// The job, if it may be applied; otherwise it is refused here.
fn admit<R: TenantRequest>(job: Job<R, R::Outcome>) -> Option<Job<R, R::Outcome>> {
    if let Err(why) = job.req.check() {
        job.refuse(why.into());
        return None;
    }
    if job.expired() {
        job.refuse(Refused::DeadlineExpired);
        return None;
    }
    Some(job)
}

/// A running tenant, as its shard and the shard's handles see it.
#[derive(Clone)]
struct ActiveTenant {
    actor: ActorRef<TenantMsg>,
    gauges: Arc<TenantGauges>,
}

/// A shard's running tenants, shared by its actor (the only writer) and its
/// handles.
struct Running {
    tenants: RwLock<HashMap<Box<str>, ActiveTenant>>,
    /// Requests a tenant may have waiting before more are shed.
    queue_limit: usize,
    /// Requests shed because a tenant's queue was full.
    shed: AtomicU64,
}

impl Running {
    fn read(&self) -> RwLockReadGuard<'_, HashMap<Box<str>, ActiveTenant>> {
        self.tenants.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, HashMap<Box<str>, ActiveTenant>> {
        self.tenants.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands `job` to its tenant's actor, or sheds it when the tenant's queue is
    /// full. Gives the job back when the tenant has no actor that takes it.
    fn route<R: TenantRequest>(&self, job: Job<R, R::Outcome>) -> Result<(), Job<R, R::Outcome>> {
        let tenants = self.read();
        let Some(active) = tenants.get(job.req.tenant_name()) else {
            return Err(job);
        };
        let queued = active.gauges.queued.fetch_add(1, Ordering::Relaxed);
        if queued >= self.queue_limit {
            active.gauges.queued.fetch_sub(1, Ordering::Relaxed);
            self.shed.fetch_add(1, Ordering::Relaxed);
            job.refuse(Refused::Overloaded { queued });
            return Ok(());
        }
        // Cast under the read lock: the shard removes a tenant (write lock)
        // before it sends it `Retire`, so this job is ahead of that message.
        match active.actor.cast(R::to_tenant(job)) {
            Ok(()) => Ok(()),
            Err(err) => {
                active.gauges.queued.fetch_sub(1, Ordering::Relaxed);
                match err {
                    MessagingErr::SendErr(msg) => R::from_tenant(msg).map_or(Ok(()), Err),
                    // Not a message of this actor's type: cannot happen, and the
                    // dropped reply port tells the caller.
                    _ => Ok(()),
                }
            }
        }
    }
}

/// The way into a running shard: its actor, and its running tenants' actors.
#[derive(Clone)]
pub struct ShardHandle {
    actor: ActorRef<ShardMsg>,
    running: Arc<Running>,
}

impl ShardHandle {
    /// The shard's actor, for the shard's own messages (ticks, stats, export).
    pub fn actor(&self) -> &ActorRef<ShardMsg> {
        &self.actor
    }

    /// Hands a request to its tenant: straight to the tenant's actor when it
    /// runs, otherwise through the shard actor, which starts the tenant or
    /// applies the request to its parked state. Every job is answered on its
    /// reply port, with `Refused::Unavailable` if the shard has stopped.
    pub fn send<R: TenantRequest>(&self, job: Job<R, R::Outcome>) {
        self.send_routed(job, false);
    }

    /// [`ShardHandle::send`], through the shard actor in any case if
    /// `behind_shard`. Returns the tenant's name when the job went through the
    /// shard actor because the tenant's was not running.
    fn send_routed<R: TenantRequest>(
        &self,
        job: Job<R, R::Outcome>,
        behind_shard: bool,
    ) -> Option<Box<str>> {
        let job = admit(job)?;
        let (job, tenant) = if behind_shard {
            (job, None)
        } else {
            let job = self.running.route(job).err()?;
            let tenant = job.req.tenant_name().into();
            (job, Some(tenant))
        };
        if let Err(MessagingErr::SendErr(msg)) = self.actor.cast(R::to_shard(job)) {
            if let Some(job) = R::from_shard(msg) {
                job.refuse(Refused::Unavailable);
            }
        }
        tenant
    }

    /// Hands `req` to its tenant now, as [`ShardHandle::send`] does, and gives
    /// back the receiver its answer comes on.
    pub fn ask<R: TenantRequest>(
        &self,
        req: R,
        deadline: Option<Instant>,
    ) -> tokio::sync::oneshot::Receiver<Reply<R::Outcome>> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.send(Job {
            req,
            deadline,
            reply: reply.into(),
        });
        answer
    }
}

/// Hands several requests to their tenants so that each tenant applies its
/// own in the order given (a batch's). A request for a tenant whose actor is
/// not running goes through the shard actor, which may start that actor
/// before it forwards the request: a later request of the same tenant sent
/// straight to the new actor would overtake it, so it follows through the
/// shard actor too.
#[derive(Debug, Default)]
pub struct InOrder {
    through_shard: Vec<Box<str>>,
}

impl InOrder {
    /// [`ShardHandle::ask`], behind the earlier requests of the same tenant
    /// asked through this sequence.
    pub fn ask<R: TenantRequest>(
        &mut self,
        shard: &ShardHandle,
        req: R,
        deadline: Option<Instant>,
    ) -> tokio::sync::oneshot::Receiver<Reply<R::Outcome>> {
        let behind_shard = self
            .through_shard
            .iter()
            .any(|tenant| **tenant == *req.tenant_name());
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job = Job {
            req,
            deadline,
            reply: reply.into(),
        };
        if let Some(tenant) = shard.send_routed(job, behind_shard) {
            self.through_shard.push(tenant);
        }
        answer
    }
}

/// The actor of one shard.
pub struct ShardActor;

pub struct ShardState {
    config: ShardConfig,
    running: Arc<Running>,
    parked: HashMap<Box<str>, TenantState>,
    /// Parked tenants with claims that the sweep under way has yet to finish,
    /// swept a step a tick ([`SWEEP_STEP_BUCKETS`] places in all).
    parked_to_sweep: Vec<Box<str>>,
    last_sweep_us: u64,
    restarts: u64,
}

impl ShardState {
    /// Starts the tenant's actor (from its parked state, if any) unless it runs.
    async fn start_tenant(
        &mut self,
        myself: &ActorRef<ShardMsg>,
        tenant: &str,
    ) -> Result<(), ActorProcessingErr> {
        if self.running.read().contains_key(tenant) {
            return Ok(());
        }
        let state = self.parked.remove(tenant).unwrap_or_default();
        let gauges = Arc::new(TenantGauges::default());
        gauges.claims.store(state.claims().len(), Ordering::Relaxed);
        gauges
            .last_active_us
            .store(self.config.clock.now_us(), Ordering::Relaxed);
        let args = TenantArgs {
            state,
            clock: self.config.clock.clone(),
            max_claims: self.config.max_tenant_claims,
            gauges: gauges.clone(),
        };
        let (actor, _) = Actor::spawn_linked(None, TenantActor, args, myself.get_cell()).await?;
        self.running
            .write()
            .insert(tenant.into(), ActiveTenant { actor, gauges });
        Ok(())
    }

    /// Routes a job to its tenant's actor, starting the tenant first if the
    /// request keeps it awake; otherwise applies it to the parked state.
    async fn route<R: TenantRequest>(
        &mut self,
        myself: &ActorRef<ShardMsg>,
        job: Job<R, R::Outcome>,
    ) -> Result<(), ActorProcessingErr> {
        let Some(job) = admit(job) else { return Ok(()) };
        let Err(job) = self.running.route(job) else {
            return Ok(());
        };
        if !R::KEEPS_AWAKE {
            self.apply_parked(job);
            return Ok(());
        }
        let tenant: Box<str> = job.req.tenant_name().into();
        self.start_tenant(myself, &tenant).await?;
        if let Err(job) = self.running.route(job) {
            // The actor is stopping; its supervision event will clean up.
            self.running.write().remove(&tenant);
            job.refuse(Refused::Unavailable);
        }
        Ok(())
    }

    /// Applies a job to its tenant's parked state (an absent tenant's is
    /// empty), leaving the tenant parked.
    fn apply_parked<R: TenantRequest>(&mut self, job: Job<R, R::Outcome>) {
        let now = self.config.clock.now_us();
        let max_claims = self.config.max_tenant_claims;
        let reply = match self.parked.get_mut(job.req.tenant_name()) {
            Some(parked) => job.req.apply(parked, now, max_claims),
            None => job.req.apply(&mut TenantState::default(), now, max_claims),
        };
        let _ = job.reply.send(reply);
    }

    /// A running tenant's actor, for a message of the shard's own.
    fn active(&self, tenant: &str) -> Option<ActorRef<TenantMsg>> {
        self.running.read().get(tenant).map(|t| t.actor.clone())
    }

    async fn tick(&mut self) {
        let now = self.config.clock.now_us();
        let idle_us = u64::try_from(self.config.idle_after.as_micros()).unwrap_or(u64::MAX);
        let mut quiet: Vec<(Box<str>, ActorRef<TenantMsg>)> = Vec::new();
        self.running.write().retain(|name, t| {
            let idle =
                now.saturating_sub(t.gauges.last_active_us.load(Ordering::Relaxed)) >= idle_us;
            if idle {
                quiet.push((name.clone(), t.actor.clone()));
            }
            !idle
        });
        for (name, actor) in quiet {
            // FIFO mailbox: Retire runs after every job already routed to it, and no
            // new job can be routed to it once it left the map.
            if let Ok(CallResult::Success(state)) = actor.call(TenantMsg::Retire, None).await {
                // Its claims are swept with the parked ones', in steps: tenants
                // go quiet together (a burst of traffic ending), and sweeping
                // all their tables in this turn would stall the node.
                let has_claims = !state.claims().is_empty();
                if has_claims || !state.is_empty(now) {
                    if has_claims {
                        self.parked_to_sweep.push(name.clone());
                    }
                    self.parked.insert(name, state);
                }
            }
        }

        if now.saturating_sub(self.last_sweep_us) >= self.config.sweep_period_us() {
            self.last_sweep_us = now;
            for tenant in self.running.read().values() {
                let _ = tenant.actor.cast(TenantMsg::Sweep);
            }
            // Without claims a tenant is checked at once; with claims, in
            // steps. A pass still under way is finished first: starting over
            // from the same end each period would sweep the same tenants again
            // and never reach the others' expired claims.
            if self.parked_to_sweep.is_empty() {
                let to_sweep = &mut self.parked_to_sweep;
                self.parked.retain(|name, state| {
                    if state.claims().is_empty() {
                        return !state.is_empty(now);
                    }
                    to_sweep.push(name.clone());
                    true
                });
            }
        }
        self.sweep_parked(now);
    }

    /// One step of the sweep of the parked tenants' claims: at most
    /// [`SWEEP_STEP_BUCKETS`] places of their tables; a tenant left holding
    /// nothing is dropped.
    fn sweep_parked(&mut self, now: u64) {
        let mut budget = SWEEP_STEP_BUCKETS;
        while budget > 0 {
            let Some(name) = self.parked_to_sweep.last() else {
                // The names' room goes too: a million parked tenants made it 8 MB.
                self.parked_to_sweep = Vec::new();
                return;
            };
            // Gone if it woke up since (and swept by its actor then).
            let Some(state) = self.parked.get_mut(name) else {
                self.parked_to_sweep.pop();
                continue;
            };
            let step = state.sweep_step(now, budget);
            budget = budget.saturating_sub(step.visited.max(1));
            if step.finished {
                if state.is_empty(now) {
                    self.parked.remove(name);
                }
                self.parked_to_sweep.pop();
            }
        }
    }

    async fn export(&self) -> Vec<TenantSnapshot> {
        let now = self.config.clock.now_us();
        let running: Vec<(Box<str>, ActorRef<TenantMsg>)> = self
            .running
            .read()
            .iter()
            .map(|(name, t)| (name.clone(), t.actor.clone()))
            .collect();
        let mut out = Vec::with_capacity(running.len() + self.parked.len());
        for (name, actor) in running {
            if let Ok(CallResult::Success(mut snap)) = actor.call(TenantMsg::Snapshot, None).await {
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
        let running = self.running.read();
        let active: usize = running
            .values()
            .map(|t| t.gauges.claims.load(Ordering::Relaxed))
            .sum();
        ShardStats {
            active_tenants: running.len(),
            parked_tenants: self.parked.len(),
            claims: parked + active,
            restarts: self.restarts,
            shed: self.running.shed.load(Ordering::Relaxed),
        }
    }
}

/// What a shard starts with.
pub struct ShardArgs {
    pub config: ShardConfig,
    pub tenants: Vec<TenantSnapshot>,
    running: Arc<Running>,
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
        // Shards started together would sweep together: every claim of the
        // node scanned in one burst on its one thread, stalling its requests
        // for milliseconds at a million claims. Each starts its period at a
        // point of its own, so their sweeps spread over the period.
        let period_us = args.config.sweep_period_us();
        // A fresh `RandomState` is freshly keyed: its hash of anything is a
        // random number, without a dependency for one.
        let phase_us = ahash::RandomState::new().hash_one(0u8) % period_us;
        let mut state = ShardState {
            last_sweep_us: args.config.clock.now_us().saturating_sub(phase_us),
            config: args.config,
            running: args.running,
            parked: HashMap::new(),
            parked_to_sweep: Vec::new(),
            restarts: 0,
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
            ShardMsg::Hit(job) => state.route(&myself, job).await?,
            ShardMsg::Settle(job) => state.route(&myself, job).await?,
            ShardMsg::Reset(job) => state.route(&myself, job).await?,
            ShardMsg::Inspect(job) => state.route(&myself, job).await?,
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
                state.start_tenant(&myself, &tenant).await?;
                if let Some(actor) = state.active(&tenant) {
                    let _ = actor.cast(TenantMsg::Fail);
                }
            }
            #[cfg(test)]
            ShardMsg::StallTenant(tenant, pause) => {
                if let Some(actor) = state.active(&tenant) {
                    let _ = actor.cast(TenantMsg::Stall(pause));
                }
            }
            #[cfg(test)]
            ShardMsg::Hold(go_on) => {
                let _ = go_on.await;
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
            state
                .running
                .write()
                .retain(|_, t| t.actor.get_id() != failed);
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
        if let Some(actor) = state.active(&snapshot.tenant) {
            if let Err(MessagingErr::SendErr(TenantMsg::Absorb(snapshot))) =
                actor.cast(TenantMsg::Absorb(snapshot))
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
) -> Result<ShardHandle, ractor::SpawnErr> {
    let running = Arc::new(Running {
        tenants: RwLock::new(HashMap::new()),
        queue_limit: config.tenant_queue,
        shed: AtomicU64::new(0),
    });
    let args = ShardArgs {
        config,
        tenants,
        running: running.clone(),
    };
    let (actor, _) = match supervisor {
        Some(sup) => Actor::spawn_linked(None, ShardActor, args, sup).await?,
        None => Actor::spawn(None, ShardActor, args).await?,
    };
    Ok(ShardHandle { actor, running })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::types::{BucketView, Charge, Claim, Kind};

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

    /// `key` is held: another hook meets it pending.
    async fn assert_held(shard: &ShardHandle, key: &str) {
        let mut req = hit(key);
        req.charges[0].capacity_us = 1_000_000;
        if let Some(claim) = req.claim.as_mut() {
            claim.hook_id = "another".into();
        }
        let again = shard.ask(req, None).await;
        assert!(
            matches!(
                again,
                Ok(Ok(Applied {
                    outcome: HitOutcome::Pending { .. },
                    ..
                }))
            ),
            "{key} by another hook: {again:?}"
        );
    }

    async fn send_hit(shard: &ShardHandle, key: &str) -> Option<Reply<HitOutcome>> {
        shard.ask(hit(key), None).await.ok()
    }

    async fn shard_with(policy: TenantFailure) -> ShardHandle {
        let config = ShardConfig {
            on_tenant_failure: policy,
            ..ShardConfig::new(Arc::new(ManualClock::new(1_000_000)))
        };
        spawn_shard(config, Vec::new(), None).await.expect("spawns")
    }

    /// Two requests of a batch for a tenant whose actor the shard starts
    /// between them are applied in the batch's order.
    #[tokio::test]
    async fn requests_in_order_follow_an_earlier_one_through_the_shard() {
        let shard = shard_with(TenantFailure::RestartEmpty).await;
        let by = |hook: &str| {
            let mut req = hit("k");
            if let Some(claim) = req.claim.as_mut() {
                claim.hook_id = hook.into();
            }
            req
        };
        let (go_on_first, first) = tokio::sync::oneshot::channel();
        let (go_on_second, second) = tokio::sync::oneshot::channel();
        shard.actor().cast(ShardMsg::Hold(first)).expect("cast");
        // The tenant has no actor yet: both wait on the shard actor's mailbox,
        // and the first starts the tenant's actor.
        let starting = shard.ask(hit("warm"), None);
        shard.actor().cast(ShardMsg::Hold(second)).expect("cast");
        let mut order = InOrder::default();
        let earlier = order.ask(&shard, by("h1"), None);
        let _ = go_on_first.send(());
        assert!(matches!(starting.await, Ok(Ok(_))), "the tenant started");
        // Its actor runs now, while the earlier request still waits on the shard.
        let later = order.ask(&shard, by("h2"), None);
        let _ = go_on_second.send(());
        let outcome = |answer: Result<Reply<HitOutcome>, _>| match answer {
            Ok(Ok(applied)) => Some(applied.outcome),
            _ => None,
        };
        assert_eq!(outcome(earlier.await), Some(HitOutcome::Ok));
        assert!(
            matches!(outcome(later.await), Some(HitOutcome::Pending { .. })),
            "the later request overtook the earlier one"
        );
    }

    #[tokio::test]
    async fn a_failed_tenant_restarts_empty_by_default() {
        let shard = shard_with(TenantFailure::RestartEmpty).await;
        assert!(matches!(send_hit(&shard, "a").await, Some(Ok(_))));
        let actor = shard.actor();
        actor.cast(ShardMsg::FailTenant("t".into())).expect("cast");
        // The shard counts the restart when it hears of the failure, which
        // comes after the cast: asked until it has (bounded).
        let mut restarts = 0;
        for _ in 0..1_000 {
            let stats = actor.call(ShardMsg::Stats, None).await.expect("call");
            let CallResult::Success(stats) = stats else {
                panic!("stats: {stats:?}");
            };
            restarts = stats.restarts;
            if restarts > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(restarts, 1, "the failed tenant restarted once");
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

    /// A reset or an inspect of a busy tenant waits in that tenant's mailbox,
    /// not in its shard's: a tenant only the shard can start is served at once.
    #[tokio::test]
    async fn a_busy_tenant_holds_up_only_its_own_reads_and_resets() {
        let shard = shard_with(TenantFailure::RestartEmpty).await;
        assert!(matches!(send_hit(&shard, "a").await, Some(Ok(_))));
        let actor = shard.actor();
        let stall = Duration::from_millis(600);
        actor
            .cast(ShardMsg::StallTenant("t".into(), stall))
            .expect("cast");
        let read = InspectRequest {
            tenant: "t".into(),
            claim: None,
        };
        let read = shard.ask(read, None);
        let reset = shard.ask(ResetRequest { tenant: "t".into() }, None);

        let started = Instant::now();
        let mut other = hit("a");
        other.charges[0].tenant = "u".into();
        if let Some(claim) = other.claim.as_mut() {
            claim.tenant = "u".into();
        }
        let answer = shard.ask(other, None).await;
        assert!(matches!(answer, Ok(Ok(_))), "{answer:?}");
        let waited = started.elapsed();
        assert!(
            waited < stall / 2,
            "a new tenant waited {waited:?} on a busy one"
        );

        let read = tokio::time::timeout(stall * 3, read).await;
        assert!(matches!(read, Ok(Ok(Ok(_)))), "{read:?}");
        let reset = tokio::time::timeout(stall * 3, reset).await;
        assert!(matches!(reset, Ok(Ok(Ok(_)))), "{reset:?}");
    }

    /// A reset and then a hit, sent without waiting for the reset's answer,
    /// reach a running tenant in that order: the reset takes no extra hop
    /// through the shard's actor for the hit to overtake.
    #[tokio::test]
    async fn a_hit_sent_after_a_reset_does_not_overtake_it() {
        let shard = shard_with(TenantFailure::RestartEmpty).await;
        assert!(matches!(send_hit(&shard, "a").await, Some(Ok(_))));
        let reset = shard.ask(ResetRequest { tenant: "t".into() }, None);
        let again = shard.ask(hit("b"), None);
        assert!(matches!(reset.await, Ok(Ok(_))));
        assert!(matches!(again.await, Ok(Ok(_))));
        let read = InspectRequest {
            tenant: "t".into(),
            claim: None,
        };
        let view = shard.ask(read, None).await;
        // Reset, then one charge of 1 µs: the hooks bucket is 1 µs ahead
        // (the other way round it would be full, and not listed).
        let expected = vec![BucketView {
            kind: Kind::Hooks,
            ahead_us: 1,
        }];
        assert!(
            matches!(&view, Ok(Ok(Applied { outcome, .. })) if outcome.buckets == expected),
            "{view:?}"
        );
    }

    /// An operator's read or reset waits in its tenant's queue as a hit does:
    /// shed when the queue is full, refused when its deadline passes there.
    #[tokio::test]
    async fn reads_and_resets_keep_to_the_tenants_queue_bound_and_deadline() {
        let config = ShardConfig {
            tenant_queue: 2,
            ..ShardConfig::new(Arc::new(ManualClock::new(1_000_000)))
        };
        let shard = spawn_shard(config, Vec::new(), None).await.expect("spawns");
        assert!(matches!(send_hit(&shard, "a").await, Some(Ok(_))));
        let stall = Duration::from_millis(300);
        let actor = shard.actor();
        actor
            .cast(ShardMsg::StallTenant("t".into(), stall))
            .expect("cast");
        // Once the shard has answered this, the stall is in the tenant's mailbox.
        actor.call(ShardMsg::Stats, None).await.expect("call");

        let read = InspectRequest {
            tenant: "t".into(),
            claim: None,
        };
        let late = shard.ask(read.clone(), Some(Instant::now() + stall / 3));
        let reset = shard.ask(ResetRequest { tenant: "t".into() }, None);
        let shed = shard.ask(read, None).await;
        assert!(
            matches!(shed, Ok(Err(Refused::Overloaded { queued: 2 }))),
            "{shed:?}"
        );
        let late = late.await;
        assert!(
            matches!(late, Ok(Err(Refused::DeadlineExpired))),
            "{late:?}"
        );
        let reset = reset.await;
        assert!(matches!(reset, Ok(Ok(_))), "{reset:?}");
    }

    #[tokio::test]
    async fn a_failed_tenant_can_escalate_to_its_shard() {
        let shard = shard_with(TenantFailure::Escalate).await;
        assert!(matches!(send_hit(&shard, "a").await, Some(Ok(_))));
        shard
            .actor()
            .cast(ShardMsg::FailTenant("t".into()))
            .expect("cast");
        // The shard stops once the failure reaches it: waited for (bounded).
        shard
            .actor()
            .wait(Some(Duration::from_secs(5)))
            .await
            .expect("the shard stopped within 5 s");
        assert_eq!(shard.actor().get_status(), ractor::ActorStatus::Stopped);
        let after = send_hit(&shard, "b").await;
        assert!(
            matches!(after, Some(Err(Refused::Unavailable))),
            "a failed shard takes no work: {after:?}"
        );
    }

    /// Jobs go straight to running tenants while the shard retires them on its
    /// tick: none may be lost, refused or applied to a tenant after it handed
    /// its state back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_job_is_lost_to_a_tenant_retiring_under_it() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        const KEYS: usize = 2_000;
        let config = ShardConfig {
            idle_after: Duration::from_micros(1),
            // Room for every job at once: a shed job is a refusal this test
            // must not confuse with one lost to a retirement.
            tenant_queue: KEYS,
            ..ShardConfig::new(clock.clone())
        };
        let shard = spawn_shard(config, Vec::new(), None).await.expect("spawns");
        let mut answers = Vec::with_capacity(KEYS);
        for i in 0..KEYS {
            // A burst the bucket always takes: only the claims are at stake.
            let mut req = hit(&format!("k{i}"));
            req.charges[0].capacity_us = 1_000_000;
            answers.push(shard.ask(req, None));
            if i % 7 == 0 {
                // Every tenant is idle at once: each tick retires it.
                clock.advance_us(1_000);
                shard.actor().cast(ShardMsg::Tick).expect("tick");
            }
            if i % 50 == 0 {
                tokio::task::yield_now().await;
            }
        }
        for (i, rx) in answers.into_iter().enumerate() {
            let answer = rx.await;
            assert!(
                matches!(
                    answer,
                    Ok(Ok(Applied {
                        outcome: HitOutcome::Ok,
                        ..
                    }))
                ),
                "hit {i}: {answer:?}"
            );
        }
        // Every claim survived the retirements: each key is held now.
        for i in (0..KEYS).step_by(97) {
            assert_held(&shard, &format!("k{i}")).await;
        }
        let stats = shard
            .actor()
            .call(ShardMsg::Stats, None)
            .await
            .expect("call");
        assert!(
            matches!(stats, CallResult::Success(s) if s.claims == KEYS && s.restarts == 0),
            "{stats:?}"
        );
    }

    /// A table several sweep steps long is swept to its live claims, one step a
    /// turn, by the tenant itself.
    #[tokio::test]
    async fn a_large_table_is_swept_in_steps() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let config = ShardConfig {
            idle_after: Duration::from_secs(3_600),
            ..ShardConfig::new(clock.clone())
        };
        let shard = spawn_shard(config, Vec::new(), None).await.expect("spawns");
        const KEYS: usize = 3 * SWEEP_STEP_BUCKETS;
        let claims_held = || async {
            match shard.actor().call(ShardMsg::Stats, None).await {
                Ok(CallResult::Success(stats)) => stats.claims,
                other => panic!("stats: {other:?}"),
            }
        };
        for chunk in (0..KEYS).collect::<Vec<_>>().chunks(512) {
            let answers: Vec<_> = chunk
                .iter()
                .map(|&i| {
                    let mut req = hit(&format!("k{i}"));
                    req.charges[0].capacity_us = 1_000_000;
                    if let Some(claim) = req.claim.as_mut() {
                        // Every third claim outlives the sweep.
                        claim.pending_ttl_ms = if i % 3 == 0 { 600_000 } else { 1_000 };
                    }
                    shard.ask(req, None)
                })
                .collect();
            for answer in answers {
                assert!(matches!(answer.await, Ok(Ok(_))));
            }
        }
        assert_eq!(claims_held().await, KEYS);
        clock.advance_us(10_000_000);
        shard.actor().cast(ShardMsg::Tick).expect("tick");
        let live = KEYS.div_ceil(3);
        let mut held = claims_held().await;
        for _ in 0..200 {
            if held == live {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            held = claims_held().await;
        }
        assert_eq!(held, live, "the expired claims are swept, the live kept");
        for i in (0..KEYS).step_by(3).step_by(101) {
            assert_held(&shard, &format!("k{i}")).await;
        }
    }
}
