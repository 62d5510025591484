//! A history of a fault run: every call concurrent edge clients made (what, on
//! which key, by which hook, when it was invoked and completed, its budget and
//! what came back) and every fault injected (what, on whom, from when to when).
//!
//! Instants are microseconds since the history began, by one monotonic clock, so
//! a history can also be written by hand (the checker's own tests do) and the
//! [`crate::checker`] stays a pure function of it.
//!
//! Appending is a mutex push: cheap next to a NATS round trip, and it never
//! reorders what one client did.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use ankusa_actors::{Charge, HitOutcome, HitRequest, SettleOutcome, SettleRequest, Settlement};
use ankusa_bus::{Answer, ErrorCode, Source, StoreError};

/// Microseconds since the history began.
pub type Micros = u64;

/// What a call asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Hit,
    Settle(Settlement),
}

/// The claim a call carried (a hit may carry none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRef {
    pub source_id: String,
    pub key: String,
    pub hook_id: String,
    pub ttl_ms: u64,
    pub pending_ttl_ms: u64,
}

/// Who answered a call that got an outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Answered {
    /// A node of the fleet.
    Fleet,
    /// The edge's own local state (a degraded [`ankusa_bus::Edge`]).
    Local,
}

/// Why a call got no outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    Timeout,
    NoResponders,
    Disconnected,
    Invalid,
    Refused(ErrorCode),
    BadReply,
    Transport,
}

impl ErrorKind {
    pub fn of(err: &StoreError) -> Self {
        match err {
            StoreError::Timeout(_) => ErrorKind::Timeout,
            StoreError::NoResponders => ErrorKind::NoResponders,
            StoreError::Disconnected => ErrorKind::Disconnected,
            StoreError::Invalid(_) => ErrorKind::Invalid,
            StoreError::Refused(reply) => ErrorKind::Refused(reply.code),
            StoreError::BadReply(_) => ErrorKind::BadReply,
            StoreError::Transport(_) => ErrorKind::Transport,
        }
    }

    /// Whether the call certainly changed nothing. Only refusals a node (or the
    /// edge) makes before touching any state are certain; a timeout, a lost
    /// connection or an `unavailable` may come after the change was applied (and
    /// even persisted), so they are uncertain: the call may have taken effect.
    pub fn certainly_not_applied(self) -> bool {
        match self {
            ErrorKind::Invalid | ErrorKind::NoResponders | ErrorKind::Disconnected => true,
            ErrorKind::Refused(code) => matches!(
                code,
                ErrorCode::Invalid
                    | ErrorCode::Malformed
                    | ErrorCode::TooLarge
                    | ErrorCode::UnsupportedVersion
                    | ErrorCode::WrongShard
                    | ErrorCode::WrongNode
            ),
            ErrorKind::Timeout | ErrorKind::BadReply | ErrorKind::Transport => false,
        }
    }
}

/// What a call came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallResult {
    Hit(HitOutcome, Answered),
    Settle(SettleOutcome, Answered),
    Error(ErrorKind),
}

impl CallResult {
    pub fn hit(result: &Result<HitOutcome, StoreError>) -> Self {
        match result {
            Ok(outcome) => CallResult::Hit(outcome.clone(), Answered::Fleet),
            Err(err) => CallResult::Error(ErrorKind::of(err)),
        }
    }

    pub fn settle(result: &Result<SettleOutcome, StoreError>) -> Self {
        match result {
            Ok(outcome) => CallResult::Settle(outcome.clone(), Answered::Fleet),
            Err(err) => CallResult::Error(ErrorKind::of(err)),
        }
    }

    pub fn edge_hit(result: &Result<Answer<HitOutcome>, StoreError>) -> Self {
        match result {
            Ok(answer) => CallResult::Hit(answer.outcome.clone(), answered(answer.source)),
            Err(err) => CallResult::Error(ErrorKind::of(err)),
        }
    }

    pub fn edge_settle(result: &Result<Answer<SettleOutcome>, StoreError>) -> Self {
        match result {
            Ok(answer) => CallResult::Settle(answer.outcome.clone(), answered(answer.source)),
            Err(err) => CallResult::Error(ErrorKind::of(err)),
        }
    }

    /// Who answered, when something did.
    pub fn answered(&self) -> Option<Answered> {
        match self {
            CallResult::Hit(_, a) | CallResult::Settle(_, a) => Some(*a),
            CallResult::Error(_) => None,
        }
    }

    /// A short label for counting (`hit:ok`, `settle:not_found`, `error:timeout`, …).
    pub fn label(&self) -> String {
        let local = |a: &Answered| if *a == Answered::Local { "(local)" } else { "" };
        match self {
            CallResult::Hit(outcome, a) => {
                let name = match outcome {
                    HitOutcome::Ok => "ok",
                    HitOutcome::Duplicate { .. } => "duplicate",
                    HitOutcome::Pending { .. } => "pending",
                    HitOutcome::RateLimited { .. } => "rate_limited",
                };
                format!("hit:{name}{}", local(a))
            }
            CallResult::Settle(outcome, a) => {
                let name = match outcome {
                    SettleOutcome::Ok => "ok",
                    SettleOutcome::NotFound => "not_found",
                    SettleOutcome::NotOwner { .. } => "not_owner",
                    SettleOutcome::AlreadyCommitted => "already_committed",
                };
                format!("settle:{name}{}", local(a))
            }
            CallResult::Error(kind) => match kind {
                ErrorKind::Refused(code) => format!("error:refused:{code}"),
                other => format!("error:{other:?}").to_lowercase(),
            },
        }
    }
}

fn answered(source: Source) -> Answered {
    match source {
        Source::Fleet => Answered::Fleet,
        Source::Local { .. } => Answered::Local,
    }
}

/// One call, from invocation to completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Which edge client made it.
    pub client: String,
    pub op: OpKind,
    pub tenant: String,
    /// The tenant's shard (for the recovery rule).
    pub shard: u32,
    pub claim: Option<ClaimRef>,
    pub charges: Vec<Charge>,
    pub invoked: Micros,
    pub completed: Micros,
    pub timeout: Micros,
    pub result: CallResult,
}

impl Event {
    pub fn latency(&self) -> Micros {
        self.completed.saturating_sub(self.invoked)
    }

    pub fn hook_id(&self) -> Option<&str> {
        self.claim.as_ref().map(|c| c.hook_id.as_str())
    }

    /// (tenant, source_id, key): the scope a claim lives in.
    pub fn claim_scope(&self) -> Option<(&str, &str, &str)> {
        self.claim
            .as_ref()
            .map(|c| (self.tenant.as_str(), c.source_id.as_str(), c.key.as_str()))
    }
}

/// What kind of fault was injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    /// SIGKILL of a node, then a restart under the same name.
    KillNode,
    /// SIGSTOP of a node for longer than the lease TTL, then SIGCONT (a zombie).
    PauseNode,
    /// SIGTERM of a node (graceful handoff), then a restart.
    StopNode,
    /// A nats-server (or one cluster member) stopped and started again.
    RestartNats,
    /// A new node joining the fleet (shards move to it).
    AddNode,
    /// A node's network link to NATS cut for longer than the lease TTL while
    /// the node runs: first blackholed (nothing forwarded either way, new
    /// connections held silent), then every connection reset and new ones
    /// refused; then restored, and the node has to reconnect.
    NetCut,
    /// A node's network link to NATS blackholed for longer than the lease TTL,
    /// then forwarding resumes on the same connections: a partition that heals
    /// before TCP gives up, so what either side sent during it arrives late.
    NetBlackhole,
}

impl FaultKind {
    /// Whether the fault leaves the node running but unable to reach NATS for
    /// longer than its lease: the rest of the fleet must take its shards over
    /// while it lasts.
    pub fn isolates_node(self) -> bool {
        matches!(self, FaultKind::NetCut | FaultKind::NetBlackhole)
    }
}

/// One injected fault: from its first action to the end of its repair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultEvent {
    pub kind: FaultKind,
    /// Node id or server name.
    pub target: String,
    pub start: Micros,
    /// When the repair was done; `None` while the fault lasts.
    pub end: Option<Micros>,
}

/// A history being recorded by concurrent clients.
#[derive(Debug)]
pub struct History {
    origin: Instant,
    events: Mutex<Vec<Event>>,
    faults: Mutex<Vec<FaultEvent>>,
    stalls: Mutex<Vec<(Micros, Micros)>>,
}

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

fn micros(d: Duration) -> Micros {
    d.as_micros() as Micros
}

impl History {
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
            events: Mutex::new(Vec::new()),
            faults: Mutex::new(Vec::new()),
            stalls: Mutex::new(Vec::new()),
        }
    }

    /// Now, on the history's clock.
    pub fn now(&self) -> Micros {
        micros(self.origin.elapsed())
    }

    pub fn push(&self, event: Event) {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(event);
    }

    /// Records a hit that was invoked at `invoked` and has just completed.
    pub fn record_hit(
        &self,
        client: &str,
        shard: u32,
        req: &HitRequest,
        timeout: Duration,
        invoked: Micros,
        result: CallResult,
    ) {
        let completed = self.now();
        self.push(Event {
            client: client.to_string(),
            op: OpKind::Hit,
            tenant: req.tenant().to_string(),
            shard,
            claim: req.claim.as_ref().map(|c| ClaimRef {
                source_id: c.source_id.clone(),
                key: c.key.clone(),
                hook_id: c.hook_id.clone(),
                ttl_ms: c.ttl_ms,
                pending_ttl_ms: c.pending_ttl_ms,
            }),
            charges: req.charges.clone(),
            invoked,
            completed,
            timeout: micros(timeout),
            result,
        });
    }

    /// Records a settle that was invoked at `invoked` and has just completed.
    pub fn record_settle(
        &self,
        client: &str,
        shard: u32,
        req: &SettleRequest,
        timeout: Duration,
        invoked: Micros,
        result: CallResult,
    ) {
        let completed = self.now();
        let c = &req.claim;
        self.push(Event {
            client: client.to_string(),
            op: OpKind::Settle(req.settlement),
            tenant: c.tenant.clone(),
            shard,
            claim: Some(ClaimRef {
                source_id: c.source_id.clone(),
                key: c.key.clone(),
                hook_id: c.hook_id.clone(),
                ttl_ms: c.ttl_ms,
                pending_ttl_ms: c.pending_ttl_ms,
            }),
            charges: Vec::new(),
            invoked,
            completed,
            timeout: micros(timeout),
            result,
        });
    }

    /// Marks a fault as begun now; returns its index for [`History::fault_end`].
    pub fn fault_start(&self, kind: FaultKind, target: &str) -> usize {
        let mut faults = self.faults.lock().unwrap_or_else(|p| p.into_inner());
        faults.push(FaultEvent {
            kind,
            target: target.to_string(),
            start: self.now(),
            end: None,
        });
        faults.len() - 1
    }

    /// Marks fault `index` as repaired now.
    pub fn fault_end(&self, index: usize) {
        let now = self.now();
        let mut faults = self.faults.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(fault) = faults.get_mut(index) {
            fault.end = Some(now);
        }
    }

    /// `look` at the events so far, under the lock and without copying them:
    /// for a run that looks while its clients are still recording (keep the
    /// look short: they wait on the lock meanwhile).
    pub fn with_events<R>(&self, look: impl FnOnce(&[Event]) -> R) -> R {
        look(&self.events.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn events(&self) -> Vec<Event> {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn faults(&self) -> Vec<FaultEvent> {
        self.faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records that this process was not scheduled from `start` to `end`.
    pub fn record_stall(&self, start: Micros, end: Micros) {
        self.stalls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((start, end));
    }

    pub fn stalls(&self) -> Vec<(Micros, Micros)> {
        self.stalls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Watches, on an OS thread of its own, for stretches in which this process
    /// got no CPU: it sleeps 1 ms at a time and records every wake-up later than
    /// `threshold` as a stall. A call cannot be blamed for lateness the OS
    /// imposed on the whole process (the checker's deadline rule uses this); an
    /// async runtime that starves its own tasks is not seen here, so it still
    /// counts against the client. Stops when `stop` is set, or after `max`.
    pub fn spawn_stall_monitor(
        self: &std::sync::Arc<Self>,
        stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
        threshold: Duration,
        max: Duration,
    ) -> std::thread::JoinHandle<()> {
        let history = self.clone();
        std::thread::spawn(move || {
            let tick = Duration::from_millis(1);
            let began = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && began.elapsed() < max {
                let before = history.now();
                std::thread::sleep(tick);
                let after = history.now();
                if after - before > micros(tick + threshold) {
                    history.record_stall(before + micros(tick), after);
                }
            }
        })
    }

    pub fn len(&self) -> usize {
        self.events.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
