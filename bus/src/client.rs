//! The edge client: [`FleetStore`] sends each call to its tenant's shard over NATS
//! request-reply and answers within the call's timeout, whatever the fleet does.
//!
//! - The budget is a hard limit: `Timeout` at the limit, `NoResponders` and
//!   `Disconnected` as soon as they are known. The remaining budget travels in
//!   the request (`timeout_ms`) so a node drops work the edge has given up on.
//! - "No responders" means no node serves the shard right now (a handoff): the
//!   client retries with a short, growing pause while the budget allows.
//! - Replies come to one inbox of the client's own (`replies::Inbox`), where a call's
//!   slot leaves with the call, so one whose reply never comes (its node died
//!   or went silent) leaves nothing behind: [`FleetStore::awaiting_replies`].
//! - Micro-batching: while a request is in flight to the node serving a shard,
//!   further hits and settles for any shard of that node queue up and leave
//!   together in one `batch` message to the node's subject when a request comes
//!   back, or at once when they fill a batch ([`FleetConfig::max_batch`]), up to
//!   [`FleetConfig::max_in_flight`] requests in flight to the node. A lone
//!   request (the lane idle) is never held back, and always goes to its shard's subject,
//!   whose reply names the node serving the shard: that is how the edge learns
//!   where to batch. Until it knows, it batches per shard. An item the node no
//!   longer serves comes back `wrong_node`, unapplied, and is sent again to its
//!   shard's subject; a node that stops answering is forgotten for every shard.
//!   A batch refused whole as `too_large`, `malformed` or
//!   `unsupported_version` (a node of another release) was not applied
//!   either: each of its calls is sent again alone.
//! - A request holds its place among those in flight until it comes back or
//!   the earliest deadline of its calls passes, whichever is first: past it, the
//!   node has let a caller down and may be gone (paused, crashed), so it is
//!   forgotten and the place goes to the next batch, while the other calls
//!   wait on for the reply up to their own deadlines. A call given up while
//!   still queued does the same for the requests it waited behind (a lone
//!   call with a long budget keeps its place): the node is forgotten and the
//!   queue may leave without a return. So one long budget never stalls a
//!   lane for the shorter calls behind it. A request retrying "no
//!   responders" gives its place back at the first one: the node it was
//!   routed by does not serve the shard (forgotten for it), and the node's
//!   other shards need not wait out the retries.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ankusa_actors::{
    HitOutcome, HitRequest, InspectRequest, SettleOutcome, SettleRequest, TenantView,
};
use async_nats::connection::State;
use async_nats::Subject;
use bytes::Bytes;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::connect::{ConnectError, NatsOptions};
use crate::lock;
use crate::protocol::{ErrorCode, Op, Reply, ReplyBody, Request, MAX_BATCH, MAX_REQUEST_BYTES};
use crate::replies::Inbox;
use crate::shard::{is_node_id, shard_of, InstanceError, Subjects, MAX_SHARDS};
use crate::store::{Store, StoreError};

/// How an edge reaches its fleet.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    pub nats: NatsOptions,
    /// The fleet's instance name (subjects live under `ankusa.<instance>`).
    pub instance: String,
    /// The instance's shard count; must match the nodes'.
    pub shards: u32,
    /// Share one message among concurrent calls to a shard.
    pub batching: bool,
    /// With batching: send batches to the node serving their shards (on the
    /// node's subject), not shard by shard. Off where the edge may not publish
    /// to `ankusa.<instance>.node.*`; an edge that [`FleetStore::connect`]ed
    /// turns it off by itself when the server reports such a violation.
    pub node_batches: bool,
    /// Most calls in one batch.
    pub max_batch: usize,
    /// With batching: most requests in flight at once to one node (or, until
    /// its node is known, to one shard). Beyond the first, only full batches
    /// leave early: they let the node work on the next batch while the last
    /// one waits for its claims' KV write. A request counts until it comes
    /// back, the earliest deadline of its calls passes, or its shard's
    /// subject has no responders.
    pub max_in_flight: usize,
}

impl FleetConfig {
    pub fn new(nats: NatsOptions, instance: impl Into<String>) -> Self {
        Self {
            nats,
            instance: instance.into(),
            shards: 64,
            batching: true,
            node_batches: true,
            max_batch: 64,
            max_in_flight: 4,
        }
    }
}

/// Why an edge client could not be built: always a configuration mistake.
#[derive(Debug, thiserror::Error)]
pub enum ClientConfigError {
    #[error(transparent)]
    Instance(#[from] InstanceError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("shards must be between 1 and {MAX_SHARDS}, not {0}")]
    Shards(u32),
}

/// Most requests a lane keeps in flight at once, whatever is configured.
pub const MAX_IN_FLIGHT_PER_LANE: usize = 64;

/// How many times a batch that came back steps aside before handing its room
/// on. Two let the callers it answered (woken on either worker of a
/// two-thread runtime) queue their next calls first: one edge at 256 calls in
/// flight then sends full batches, and its calls wait 0.2 ms in the queue
/// instead of 0.7 (1, 2 and 4 were measured; 4 holds the room too long).
const HANDOFF_YIELDS: usize = 2;

/// A call waiting for its lane's in-flight request to come back.
struct Queued {
    shard: usize,
    op: Op,
    deadline: Instant,
    reply: oneshot::Sender<Result<ReplyBody, StoreError>>,
}

impl Queued {
    /// The call, unless its caller is gone (dropped) or its deadline has
    /// passed (answered `Timeout`).
    fn live(self, now: Instant) -> Option<Self> {
        if self.reply.is_closed() {
            return None;
        }
        if self.deadline <= now {
            let _ = self.reply.send(Err(StoreError::Timeout(Duration::ZERO)));
            return None;
        }
        Some(self)
    }
}

/// Per lane: how many requests are in flight, and who waits to go next.
#[derive(Default)]
struct Lane {
    in_flight: usize,
    queue: VecDeque<Queued>,
    /// How many calls the queue's last sweep left in it ([`Lane::join`]).
    swept: usize,
}

impl Lane {
    /// Takes the lane for a call that finds it idle: a lone call is never held
    /// back. Otherwise the call waits in the queue for its batch.
    fn go_alone(&mut self) -> bool {
        let idle = self.in_flight == 0 && self.queue.is_empty();
        if idle {
            self.in_flight += 1;
        }
        idle
    }

    /// Queues a call for its batch. While the lane has no room, nothing leaves
    /// the queue, and calls whose callers gave up would pile up in it: so it
    /// is swept of them whenever it has doubled since its last sweep, which
    /// bounds it by twice the live calls that sweep found and costs each call
    /// a constant share, however long the queue.
    fn join(&mut self, call: Queued, now: Instant) {
        self.queue.push_back(call);
        if self.queue.len() > 2 * self.swept {
            for _ in 0..self.queue.len() {
                if let Some(q) = self.queue.pop_front().and_then(|q| q.live(now)) {
                    self.queue.push_back(q);
                }
            }
            self.swept = self.queue.len();
        }
    }

    /// The next batch to send (up to `max_batch` calls, oldest first), with its
    /// room taken: if there is room, and the batch is full or `partial` ones
    /// may leave (a request just came back or gave its room up, or a queued
    /// call was given up). On the way, calls whose caller is
    /// gone are dropped and those past their deadline answered `Timeout`.
    ///
    /// Costs what it takes, not the queue's length: it runs for every call
    /// that joins a long queue, and a backlog must not make each call dearer.
    fn next_batch(
        &mut self,
        now: Instant,
        max_in_flight: usize,
        max_batch: usize,
        partial: bool,
    ) -> Option<Vec<Queued>> {
        let ready = partial || self.queue.len() >= max_batch;
        if !ready || self.in_flight >= max_in_flight {
            return None;
        }
        let mut batch = Vec::with_capacity(self.queue.len().min(max_batch));
        while batch.len() < max_batch {
            let Some(q) = self.queue.pop_front() else {
                break;
            };
            if let Some(q) = q.live(now) {
                batch.push(q);
            }
        }
        if batch.is_empty() {
            return None;
        }
        self.in_flight += 1;
        Some(batch)
    }

    /// A request of this lane ended: its room is free.
    fn finished(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }
}

type LaneRef = Arc<Mutex<Lane>>;

/// A node that answered for a shard, and its subject.
#[derive(Clone)]
struct NodeTarget {
    name: Arc<str>,
    subject: Subject,
}

/// Where a call queues: the lane of the node serving its shard when that is
/// known (batches then go to the node's subject), else the shard's own lane.
#[derive(Clone)]
struct Route {
    lane: LaneRef,
    node: Option<NodeTarget>,
}

struct Inner {
    client: async_nats::Client,
    /// Where replies come.
    inbox: Inbox,
    subjects: Subjects,
    shard_subjects: Vec<Subject>,
    shards: u32,
    batching: bool,
    node_batches: bool,
    /// Set once the server refused this edge a publish on a node subject.
    node_subjects_denied: Arc<AtomicBool>,
    max_batch: usize,
    max_in_flight: usize,
    shard_lanes: Vec<LaneRef>,
    /// The node each shard was last answered by, learned from its replies.
    owners: Vec<Mutex<Option<Arc<str>>>>,
    node_lanes: Mutex<HashMap<Arc<str>, Route>>,
}

/// The edge client of a fleet. Cheap to clone; clones share one connection.
#[derive(Clone)]
pub struct FleetStore {
    inner: Arc<Inner>,
}

const FIRST_RETRY: Duration = Duration::from_millis(2);
/// The granularity of tokio's timer.
const TIMER_TICK: Duration = Duration::from_millis(1);
const MAX_RETRY: Duration = Duration::from_millis(50);
/// The least budget a retry is sent with.
const RETRY_ROUND_TRIP: Duration = Duration::from_millis(10);
/// The longest a call waits, whatever it is given: a year, far from the end
/// of `Instant`'s range, which `Duration::MAX` ("no limit") would overflow.
const LONGEST_CALL: Duration = Duration::from_secs(365 * 24 * 3600);

impl FleetStore {
    /// Builds the client. Returns at once: NATS is reached in the background, and
    /// until it is, calls fail fast with `Disconnected`.
    pub async fn connect(config: FleetConfig) -> Result<Self, ClientConfigError> {
        let subjects = Subjects::new(&config.instance)?;
        if config.shards == 0 || config.shards > MAX_SHARDS {
            return Err(ClientConfigError::Shards(config.shards));
        }
        let denied = Arc::new(AtomicBool::new(false));
        let client = config
            .nats
            .connect_with_events(watch_node_denials(&subjects, denied.clone()))
            .await?;
        Ok(Self::build(client, &subjects, &config, denied))
    }

    /// Builds the client on a connection the caller already has. Its events
    /// are the caller's: node batching stays as configured, whatever the
    /// server's permissions.
    pub fn with_client(
        client: async_nats::Client,
        subjects: &Subjects,
        config: &FleetConfig,
    ) -> Self {
        Self::build(client, subjects, config, Arc::default())
    }

    fn build(
        client: async_nats::Client,
        subjects: &Subjects,
        config: &FleetConfig,
        node_subjects_denied: Arc<AtomicBool>,
    ) -> Self {
        let shards = config.shards.clamp(1, MAX_SHARDS);
        Self {
            inner: Arc::new(Inner {
                inbox: Inbox::new(client.clone()),
                client,
                subjects: subjects.clone(),
                shard_subjects: (0..shards).map(|n| subjects.shard(n).into()).collect(),
                shards,
                batching: config.batching,
                node_batches: config.node_batches,
                node_subjects_denied,
                max_batch: config.max_batch.clamp(1, MAX_BATCH),
                max_in_flight: config.max_in_flight.clamp(1, MAX_IN_FLIGHT_PER_LANE),
                shard_lanes: (0..shards).map(|_| LaneRef::default()).collect(),
                owners: (0..shards).map(|_| Mutex::default()).collect(),
                node_lanes: Mutex::default(),
            }),
        }
    }

    /// The NATS connection (for status and tests).
    pub fn nats(&self) -> &async_nats::Client {
        &self.inner.client
    }

    /// Requests on the wire whose reply has not come: each leaves when its
    /// call ends, answered or not, so this stays at the calls in flight.
    pub fn awaiting_replies(&self) -> usize {
        self.inner.inbox.waiting()
    }

    pub fn shard_of(&self, tenant: &str) -> u32 {
        shard_of(tenant, self.inner.shards)
    }

    /// What the node serving `req.tenant`'s shard holds for it, changing
    /// nothing: an operator's read, so it has no local answer to degrade to.
    pub async fn inspect(
        &self,
        req: InspectRequest,
        timeout: Duration,
    ) -> Result<TenantView, StoreError> {
        req.validate()?;
        let shard = self.shard_of(&req.tenant);
        match self.call(shard, Op::Inspect(req), timeout).await? {
            ReplyBody::Inspect(view) => Ok(view),
            other => Err(StoreError::unexpected("inspect", other)),
        }
    }

    /// Sends `op` to its tenant's shard and waits for its reply body, all
    /// within `timeout`.
    async fn call(&self, shard: u32, op: Op, timeout: Duration) -> Result<ReplyBody, StoreError> {
        // The timer fires on a millisecond tick at or after the instant it is
        // given, its driver sleeps in whole milliseconds, and the thread it
        // wakes needs a moment more: aim two ticks early so that the answer is
        // out by the deadline, not just after it (one tick early, half the calls
        // of 10 ms answered at 10.5 ms). The budget sent ends there too: the
        // node is told how long this edge really waits.
        let limited = timeout.min(LONGEST_CALL);
        let alarm = Instant::now() + limited - (2 * TIMER_TICK).min(limited / 5);
        let shard = shard as usize;
        let batchable = self.inner.batching && matches!(op, Op::Hit(_) | Op::Settle(_));
        let work = async {
            if batchable {
                self.inner.clone().call_batched(shard, op, alarm).await
            } else {
                self.inner.send(shard, op, alarm, None).await
            }
        };
        match tokio::time::timeout_at(alarm, work).await {
            Ok(Err(StoreError::Timeout(_))) | Err(_) => Err(StoreError::Timeout(timeout)),
            Ok(result) => result,
        }
    }
}

/// An event handler that sets `denied` (once, with a warning) when the server
/// refuses this edge a publish on one of the instance's node subjects: an edge
/// whose NATS permissions predate node batches then batches per shard, as
/// before, instead of losing a batch to a timeout every time it learns a node.
fn watch_node_denials(
    subjects: &Subjects,
    denied: Arc<AtomicBool>,
) -> impl Fn(async_nats::Event) + Send + Sync + 'static {
    let node_subjects = subjects.node("");
    move |event| {
        let async_nats::Event::ServerError(async_nats::ServerError::Other(error)) = event else {
            return;
        };
        let refused =
            error.contains("Permissions Violation for Publish") && error.contains(&node_subjects);
        if refused && !denied.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                %error,
                "this edge may not publish to {node_subjects}*: batches go shard by shard \
                 from now on (grant the subjects, see docs/security.md, or set node_batches = false)"
            );
        }
    }
}

fn budget_ms(deadline: Instant) -> u64 {
    budget_ms_at(deadline, Instant::now())
}

/// The whole milliseconds left at `now` until `deadline`: what a request
/// carries as its `timeout_ms`, 0 (refused as expired) under one.
fn budget_ms_at(deadline: Instant, now: Instant) -> u64 {
    deadline.saturating_duration_since(now).as_millis() as u64
}

impl Inner {
    /// One request on the wire, retried while no node serves the shard; it
    /// holds `room` (its lane's place) up to the first "no responders".
    async fn send(
        &self,
        shard: usize,
        op: Op,
        deadline: Instant,
        room: Option<&LaneHandoff>,
    ) -> Result<ReplyBody, StoreError> {
        if budget_ms(deadline) == 0 {
            // A budget of 0 would be refused as expired (§5.1): the caller's
            // timeout, told here.
            return Err(StoreError::Timeout(Duration::ZERO));
        }
        let encode = || Request::encode_op(budget_ms(deadline), &op);
        self.send_request(shard, deadline, encode(), encode, room)
            .await
    }

    /// Sends `payload` to the shard's subject; a resend after "no responders"
    /// is written again by `encode`, with the budget left then. The first "no
    /// responders" gives `room` back ([`LaneHandoff::unserved`]): the retries
    /// go outside the lane.
    async fn send_request(
        &self,
        shard: usize,
        deadline: Instant,
        mut payload: Vec<u8>,
        encode: impl Fn() -> Vec<u8>,
        mut room: Option<&LaneHandoff>,
    ) -> Result<ReplyBody, StoreError> {
        let mut pause = FIRST_RETRY;
        loop {
            match self
                .send_once(&self.shard_subjects[shard], payload.into(), deadline)
                .await
            {
                Ok(reply) => {
                    self.learn(shard, reply.node.as_deref());
                    return Ok(reply.body);
                }
                Err(StoreError::NoResponders) => {
                    if let Some(room) = room.take() {
                        room.unserved(shard);
                    }
                    // A retry keeps time for its own round trip: one squeezed into
                    // the budget's last moment would time out, and the caller would
                    // hear "timeout" where "no responders" was what was known.
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left <= RETRY_ROUND_TRIP {
                        return Err(StoreError::NoResponders);
                    }
                    tokio::time::sleep(pause.min(left - RETRY_ROUND_TRIP)).await;
                    pause = (pause * 2).min(MAX_RETRY);
                    payload = encode();
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// One request to `subject`, no retry.
    async fn send_once(
        &self,
        subject: &Subject,
        payload: Bytes,
        deadline: Instant,
    ) -> Result<Reply, StoreError> {
        if self.client.connection_state() != State::Connected {
            return Err(StoreError::Disconnected);
        }
        let budget = deadline.saturating_duration_since(Instant::now());
        // The publish is bounded too: while the connection's write buffer is
        // full, or it reconnects, async-nats holds it, and a batch has no
        // caller's timer above it to end the wait.
        let waiting =
            tokio::time::timeout_at(deadline, self.inbox.request(subject.clone(), None, payload))
                .await
                .map_err(|_| StoreError::Timeout(budget))??;
        let message = tokio::time::timeout_at(deadline, waiting.reply())
            .await
            .map_err(|_| StoreError::Timeout(budget))??;
        Reply::decode(&message.payload).map_err(|e| StoreError::BadReply(e.to_string()))
    }

    /// Remembers which node answered for `shard`. A name that cannot be a
    /// node's is not learned: it would make a subject other than a node's.
    fn learn(&self, shard: usize, node: Option<&str>) {
        let Some(node) = node.filter(|node| self.node_batches() && is_node_id(node)) else {
            return;
        };
        let mut owner = lock(&self.owners[shard]);
        if owner.as_deref() != Some(node) {
            let previous = owner.replace(node.into());
            drop(owner);
            if let Some(previous) = previous {
                self.drop_lane_if_unowned(&previous);
            }
        }
    }

    /// Forgets `node` as the server of `shard` (or, with `None`, of every shard).
    fn forget(&self, node: &str, shard: Option<usize>) {
        let shards = match shard {
            Some(shard) => shard..shard + 1,
            None => 0..self.owners.len(),
        };
        for owner in &self.owners[shards] {
            let mut owner = lock(owner);
            if owner.as_deref() == Some(node) {
                *owner = None;
            }
        }
        self.drop_lane_if_unowned(node);
    }

    /// Drops the lane of `node` once it serves no shard this edge knows of,
    /// so that the lanes of nodes gone in rollouts do not pile up. Calls on
    /// the lane keep it until they end.
    fn drop_lane_if_unowned(&self, node: &str) {
        let owns_any = self
            .owners
            .iter()
            .any(|owner| lock(owner).as_deref() == Some(node));
        if !owns_any {
            lock(&self.node_lanes).remove(node);
        }
    }

    /// Whether batches go to nodes: configured so, and not refused by the server.
    fn node_batches(&self) -> bool {
        self.node_batches && !self.node_subjects_denied.load(Ordering::Relaxed)
    }

    /// The lane a call for `shard` queues on.
    fn route(&self, shard: usize) -> Route {
        // The owner is read under the lanes' lock: a lane dropped because its
        // node lost its last shard meanwhile is then never put back.
        let mut lanes = lock(&self.node_lanes);
        let node = lock(&self.owners[shard])
            .clone()
            .filter(|_| self.node_batches());
        let Some(node) = node else {
            return Route {
                lane: self.shard_lanes[shard].clone(),
                node: None,
            };
        };
        lanes
            .entry(node.clone())
            .or_insert_with(|| Route {
                lane: LaneRef::default(),
                node: Some(NodeTarget {
                    subject: self.subjects.node(&node).into(),
                    name: node,
                }),
            })
            .clone()
    }

    /// Goes alone when the call's lane is idle; otherwise waits to leave with
    /// the next batch.
    async fn call_batched(
        self: Arc<Self>,
        shard: usize,
        op: Op,
        deadline: Instant,
    ) -> Result<ReplyBody, StoreError> {
        if self.client.connection_state() != State::Connected {
            // Known at once, not after the calls in flight on the lane.
            return Err(StoreError::Disconnected);
        }
        let route = self.route(shard);
        // Either the call takes the idle lane or it waits for its batch, which
        // leaves at once if this call fills it and there is room.
        let op = {
            let mut lane = lock(&route.lane);
            if lane.go_alone() {
                Ok(op)
            } else {
                let (reply, rx) = oneshot::channel();
                let call = Queued {
                    shard,
                    op,
                    deadline,
                    reply,
                };
                lane.join(call, Instant::now());
                Err(rx)
            }
        };
        let op = match op {
            Ok(op) => op,
            Err(rx) => {
                self.pump(&route, false);
                let mut waiting = QueuedWait {
                    inner: &self,
                    route: &route,
                    deadline,
                    answered: false,
                };
                let answer = rx
                    .await
                    .unwrap_or_else(|_| Err(StoreError::Transport("batch dropped".into())));
                waiting.answered = true;
                return answer;
            }
        };
        // Whatever happens to this call, its room must be handed on.
        let room = LaneHandoff::new(self.clone(), route);
        let result = self.send(shard, op, deadline, Some(&room)).await;
        drop(room);
        result
    }

    /// Sends the lane's queue, batch by batch, while the lane has room: after
    /// a request came back or gave its room up, or a queued call was given up
    /// (`returned`), whatever waits; otherwise full batches only. Each batch
    /// hands its room on when it ends, or before (see [`Inner::send_batch`]).
    fn pump(self: &Arc<Self>, route: &Route, returned: bool) {
        let mut partial = returned;
        loop {
            let Some(batch) = lock(&route.lane).next_batch(
                Instant::now(),
                self.max_in_flight,
                self.max_batch,
                partial,
            ) else {
                return;
            };
            partial = false;
            let handoff = LaneHandoff::new(self.clone(), route.clone());
            tokio::spawn(async move {
                handoff
                    .inner
                    .send_batch(handoff.route.node.as_ref(), batch, &handoff)
                    .await;
                // The callers just answered often call again at once (a hit's
                // settle): they queue before the room is handed on, and leave
                // together instead of waiting for the next return.
                for _ in 0..HANDOFF_YIELDS {
                    tokio::task::yield_now().await;
                }
                drop(handoff);
            });
        }
    }

    /// Sends `batch` to `node`'s subject, or to its first call's shard subject
    /// when the node is not known (every call is then for that shard). The
    /// batch holds `room`, its lane's place, until its reply or the earliest
    /// deadline of its calls, whichever is first.
    async fn send_batch(
        self: &Arc<Self>,
        node: Option<&NodeTarget>,
        mut batch: Vec<Queued>,
        room: &LaneHandoff,
    ) {
        if node.is_some() && !self.node_batches() {
            // Node subjects were refused since this batch queued for one.
            batch.into_iter().for_each(|q| self.resend(q));
            return;
        }
        // A call with less than a millisecond left would go with a budget of
        // 0, which the node refuses as expired: its timeout, told here.
        let now = Instant::now();
        let timely = |q: &Queued| budget_ms_at(q.deadline, now) > 0;
        if !batch.iter().all(timely) {
            let expired;
            (batch, expired) = batch.into_iter().partition(timely);
            for q in expired {
                let _ = q.reply.send(Err(StoreError::Timeout(Duration::ZERO)));
            }
            if batch.is_empty() {
                return;
            }
        }
        if batch.len() == 1 {
            if let Some(q) = batch.pop() {
                let result = self.send(q.shard, q.op, q.deadline, Some(room)).await;
                let _ = q.reply.send(result);
            }
            return;
        }
        let deadlines = batch.iter().map(|q| q.deadline);
        let first = deadlines.clone().min().unwrap_or_else(Instant::now);
        let deadline = deadlines.max().unwrap_or_else(Instant::now);
        // Each call keeps its own operation, to be sent again alone if the
        // node turns it away.
        let encode = || {
            let items = batch.iter().map(|q| (budget_ms(q.deadline), &q.op));
            Request::encode_batch(budget_ms(deadline), items)
        };
        let payload = encode();
        if payload.len() > MAX_REQUEST_BYTES {
            // Too large for one message: two halves, each as small as it needs.
            let second = batch.split_off(batch.len() / 2);
            futures::join!(
                Box::pin(self.send_batch(node, batch, room)),
                Box::pin(self.send_batch(node, second, room))
            );
            return;
        }
        let result = {
            let request = async {
                match node {
                    Some(node) => self
                        .send_once(&node.subject, payload.into(), deadline)
                        .await
                        .map(|reply| reply.body),
                    None => {
                        self.send_request(batch[0].shard, deadline, payload, encode, Some(room))
                            .await
                    }
                }
            };
            let mut request = std::pin::pin!(request);
            match tokio::time::timeout_at(first, request.as_mut()).await {
                Ok(result) => result,
                Err(_) => {
                    // The first caller has heard `Timeout`: a node that has
                    // answered nothing by then may be gone, and the lane must
                    // not wait for the batch's longest budget to send anything
                    // else. The other calls wait on, each to its own deadline.
                    if let Some(node) = node {
                        self.forget(&node.name, None);
                    }
                    room.release();
                    request.await
                }
            }
        };
        match result {
            Ok(ReplyBody::Batch(replies)) if replies.len() == batch.len() => {
                for (q, reply) in batch.into_iter().zip(replies) {
                    match (node, reply.body) {
                        (Some(node), ReplyBody::Error(err)) if err.code == ErrorCode::WrongNode => {
                            self.forget(&node.name, Some(q.shard));
                            self.resend(q);
                        }
                        (_, body) => {
                            let _ = q.reply.send(Ok(body));
                        }
                    }
                }
            }
            // The node would not take the batch as a batch (a release with a
            // smaller limit, or that does not read its form), and applied
            // nothing: each call goes again alone, to be answered on its own.
            Ok(ReplyBody::Error(err))
                if matches!(
                    err.code,
                    ErrorCode::TooLarge | ErrorCode::Malformed | ErrorCode::UnsupportedVersion
                ) =>
            {
                tracing::debug!(error = %err.message, code = %err.code, "batch refused whole; its calls go alone");
                batch.into_iter().for_each(|q| self.resend(q));
            }
            Ok(ReplyBody::Error(err)) => {
                for q in batch {
                    let _ = q.reply.send(Ok(ReplyBody::Error(err.clone())));
                }
            }
            Ok(other) => {
                let why = format!("batch of {} answered with {other:?}", batch.len());
                for q in batch {
                    let _ = q.reply.send(Err(StoreError::BadReply(why.clone())));
                }
            }
            Err(err) => {
                if let Some(node) = node {
                    // A node that does not answer may have lost its shards.
                    self.forget(&node.name, None);
                }
                for q in batch {
                    if node.is_some() && err == StoreError::NoResponders {
                        // The node is gone and nothing was applied: to the
                        // shard's subject, which finds the new owner.
                        self.resend(q);
                    } else {
                        let _ = q.reply.send(Err(err.clone()));
                    }
                }
            }
        }
    }

    /// Sends a call that was not applied again, alone to its shard's subject,
    /// unless its caller has gone.
    fn resend(self: &Arc<Self>, q: Queued) {
        if q.reply.is_closed() {
            return;
        }
        let inner = self.clone();
        tokio::spawn(async move {
            let result = inner.send(q.shard, q.op, q.deadline, None).await;
            let _ = q.reply.send(result);
        });
    }
}

/// Gives a lane's room back, and sends its queue, when the request that held
/// the room ends, even if that request was cancelled by its deadline, or
/// before, once it no longer needs the room ([`LaneHandoff::release`]).
struct LaneHandoff {
    inner: Arc<Inner>,
    route: Route,
    released: AtomicBool,
}

impl LaneHandoff {
    fn new(inner: Arc<Inner>, route: Route) -> Self {
        Self {
            inner,
            route,
            released: AtomicBool::new(false),
        }
    }

    /// Hands the room on now; it is handed on once, whoever calls first.
    fn release(&self) {
        if !self.released.swap(true, Ordering::Relaxed) {
            lock(&self.route.lane).finished();
            self.inner.pump(&self.route, true);
        }
    }

    /// No node serves `shard` right now (its subject had no responders): the
    /// node this lane sends to is forgotten for it, and the room is handed on
    /// while the call retries, so that the calls for the node's other shards
    /// do not wait out this one's budget behind it.
    fn unserved(&self, shard: usize) {
        if let Some(node) = &self.route.node {
            self.inner.forget(&node.name, Some(shard));
        }
        self.release();
    }
}

impl Drop for LaneHandoff {
    fn drop(&mut self) {
        self.release();
    }
}

/// A queued call's wait for its answer. Given up unanswered at its deadline
/// (in the queue, or in a batch still out), it has shown that waiting for
/// the lane's requests to come back lets callers down: one of them (a lone
/// call with a long budget, say) may be held by a node that stopped
/// answering. So the node is forgotten, and the next calls go to their
/// shards' subjects, which find whoever serves them now; and the queue may
/// leave without a return, while the lane has room.
struct QueuedWait<'a> {
    inner: &'a Arc<Inner>,
    route: &'a Route,
    deadline: Instant,
    answered: bool,
}

impl Drop for QueuedWait<'_> {
    fn drop(&mut self) {
        // A caller that left earlier (for reasons of its own) says nothing
        // of the node.
        if !self.answered && Instant::now() >= self.deadline {
            if let Some(node) = &self.route.node {
                self.inner.forget(&node.name, None);
            }
            self.inner.pump(self.route, true);
        }
    }
}

impl Store for FleetStore {
    /// Less, and what is left of it at the alarm (`call`: two timer ticks
    /// early, or a fifth of the budget) is under the millisecond a request's
    /// `timeout_ms` counts in: the call is answered `Timeout` unsent.
    const LEAST_BUDGET: Duration = Duration::from_micros(1_250);

    async fn hit(&self, req: HitRequest, timeout: Duration) -> Result<HitOutcome, StoreError> {
        if req.is_empty() {
            return Ok(HitOutcome::Ok);
        }
        req.validate()?;
        let shard = self.shard_of(req.tenant());
        match self.call(shard, Op::Hit(req), timeout).await? {
            ReplyBody::Hit(outcome) => Ok(outcome),
            other => Err(StoreError::unexpected("hit", other)),
        }
    }

    async fn settle(
        &self,
        req: SettleRequest,
        timeout: Duration,
    ) -> Result<SettleOutcome, StoreError> {
        req.validate()?;
        let shard = self.shard_of(&req.claim.tenant);
        match self.call(shard, Op::Settle(req), timeout).await? {
            ReplyBody::Settle(outcome) => Ok(outcome),
            other => Err(StoreError::unexpected("settle", other)),
        }
    }

    async fn reset(&self, tenant: String, timeout: Duration) -> Result<(), StoreError> {
        ankusa_actors::types::validate_tenant(&tenant)?;
        match self
            .call(self.shard_of(&tenant), Op::Reset { tenant }, timeout)
            .await?
        {
            ReplyBody::Reset => Ok(()),
            other => Err(StoreError::unexpected("reset", other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queued(
        lane: &mut Lane,
        tenant: &str,
        deadline: Instant,
    ) -> oneshot::Receiver<Result<ReplyBody, StoreError>> {
        let (reply, rx) = oneshot::channel();
        lane.queue.push_back(Queued {
            shard: 0,
            op: Op::Reset {
                tenant: tenant.into(),
            },
            deadline,
            reply,
        });
        rx
    }

    fn tenants(batch: &[Queued]) -> Vec<String> {
        batch
            .iter()
            .map(|q| match &q.op {
                Op::Reset { tenant } => tenant.clone(),
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_lone_call_goes_only_on_an_idle_lane() {
        let now = Instant::now();
        let mut lane = Lane::default();
        assert!(lane.go_alone());
        assert!(
            !lane.go_alone(),
            "a second call went alone with one in flight"
        );
        let _a = queued(&mut lane, "a", now + Duration::from_secs(1));
        lane.finished();
        assert!(!lane.go_alone(), "a call went ahead of the queue");
        assert_eq!(lane.in_flight, 0);
    }

    #[test]
    fn a_partial_batch_waits_for_a_request_to_come_back() {
        let now = Instant::now();
        let mut lane = Lane::default();
        assert!(lane.go_alone());
        let _a = queued(&mut lane, "a", now + Duration::from_secs(1));
        assert!(
            lane.next_batch(now, 4, 64, false).is_none(),
            "a partial batch left early"
        );
        lane.finished();
        let batch = lane
            .next_batch(now, 4, 64, true)
            .expect("the queue leaves on a return");
        assert_eq!(tenants(&batch), ["a"]);
        assert_eq!(lane.in_flight, 1);
    }

    #[test]
    fn full_batches_leave_while_the_lane_has_room() {
        let now = Instant::now();
        let later = now + Duration::from_secs(1);
        let mut lane = Lane::default();
        assert!(lane.go_alone());
        let _rx: Vec<_> = ["a", "b", "c", "d", "e"]
            .iter()
            .map(|t| queued(&mut lane, t, later))
            .collect();
        let first = lane
            .next_batch(now, 3, 2, false)
            .expect("a full batch leaves");
        let second = lane
            .next_batch(now, 3, 2, false)
            .expect("room for a second");
        assert!(
            lane.next_batch(now, 3, 2, true).is_none(),
            "a batch left with max_in_flight out"
        );
        assert_eq!(
            (tenants(&first), tenants(&second)),
            (
                vec!["a".to_string(), "b".into()],
                vec!["c".to_string(), "d".into()]
            )
        );
        assert_eq!(lane.in_flight, 3);
        lane.finished();
        assert!(
            lane.next_batch(now, 3, 2, false).is_none(),
            "the last one is not full"
        );
        let last = lane
            .next_batch(now, 3, 2, true)
            .expect("it leaves on a return");
        assert_eq!(tenants(&last), ["e"]);
    }

    #[test]
    fn a_lane_without_room_leaves_its_queue_untouched() {
        // Every call joining a long queue asks for a batch: without room, that
        // must not walk the queue (a backlog would make each call dearer).
        let now = Instant::now();
        let mut lane = Lane::default();
        assert!(lane.go_alone());
        let mut expired: Vec<_> = (0..100)
            .map(|i| queued(&mut lane, &format!("t{i}"), now))
            .collect();
        assert!(lane.next_batch(now, 1, 64, true).is_none());
        assert_eq!(lane.queue.len(), 100);
        assert!(expired.iter_mut().all(|rx| rx.try_recv().is_err()));
    }

    #[test]
    fn a_queue_without_room_is_swept_of_the_calls_given_up() {
        // A lane whose request never comes back: calls keep joining its
        // queue, and their callers give up (or their deadlines pass).
        let now = Instant::now();
        let later = now + Duration::from_secs(1);
        let mut lane = Lane::default();
        assert!(lane.go_alone());
        let mut join = |tenant: &str, deadline| {
            let (reply, rx) = oneshot::channel();
            let op = Op::Reset {
                tenant: tenant.into(),
            };
            lane.join(
                Queued {
                    shard: 0,
                    op,
                    deadline,
                    reply,
                },
                now,
            );
            rx
        };
        let _first = join("first", later);
        let mut expired: Vec<_> = (0..1000).map(|i| join(&format!("e{i}"), now)).collect();
        for i in 0..1000 {
            drop(join(&format!("g{i}"), later));
        }
        let _last = join("last", later);
        assert!(lane.queue.len() <= 4, "{} queued", lane.queue.len());
        assert_eq!(tenants(lane.queue.make_contiguous())[0], "first");
        assert_eq!(
            tenants(lane.queue.make_contiguous())
                .last()
                .map(String::as_str),
            Some("last")
        );
        let timeouts = expired
            .iter_mut()
            .map(|rx| rx.try_recv())
            .filter(|answer| matches!(answer, Ok(Err(StoreError::Timeout(_)))))
            .count();
        assert_eq!(timeouts, 1000, "every expired call was answered");
    }

    #[test]
    fn expired_calls_are_answered_timeout_and_abandoned_ones_dropped() {
        let now = Instant::now();
        let mut lane = Lane::default();
        let mut expired = queued(&mut lane, "expired", now);
        drop(queued(&mut lane, "abandoned", now + Duration::from_secs(1)));
        let _live = queued(&mut lane, "live", now + Duration::from_secs(1));
        let batch = lane
            .next_batch(now, 1, 64, true)
            .expect("the live call leaves");
        assert_eq!(tenants(&batch), ["live"]);
        assert!(matches!(
            expired.try_recv(),
            Ok(Err(StoreError::Timeout(_)))
        ));
    }

    /// An edge whose connection never comes up: enough to learn and route.
    async fn offline_edge(shards: u32) -> FleetStore {
        let nats = NatsOptions::with_servers(["nats://127.0.0.1:1"]);
        let mut config = FleetConfig::new(nats.clone(), "lanes");
        config.shards = shards;
        let client = nats
            .connect()
            .await
            .expect("a client, connecting in the background");
        let subjects = Subjects::new("lanes").expect("instance");
        FleetStore::with_client(client, &subjects, &config)
    }

    fn lanes(inner: &Inner) -> Vec<String> {
        let mut names: Vec<String> = lock(&inner.node_lanes)
            .keys()
            .map(|n| n.to_string())
            .collect();
        names.sort();
        names
    }

    #[tokio::test]
    async fn a_node_lane_goes_once_the_node_serves_no_shard_and_bad_names_are_not_learned() {
        let store = offline_edge(3).await;
        let inner = &store.inner;
        for shard in [0, 1] {
            inner.learn(shard, Some("node-a"));
            inner.route(shard);
        }
        assert_eq!(lanes(inner), ["node-a"]);
        inner.learn(0, Some("node-b"));
        inner.route(0);
        assert_eq!(lanes(inner), ["node-a", "node-b"], "node-a still serves 1");
        inner.learn(1, Some("node-b"));
        assert_eq!(lanes(inner), ["node-b"], "node-a left in a rollout");
        inner.forget("node-b", None);
        assert_eq!(
            lanes(inner),
            Vec::<String>::new(),
            "node-b stopped answering"
        );

        for name in ["a.b", "node.>", "*", "", "é", &"n".repeat(129)] {
            inner.learn(2, Some(name));
            assert_eq!(*lock(&inner.owners[2]), None, "learned {name:?}");
        }
    }

    /// The contract answers a hit with no charge and no claim `:ok`; it names
    /// no tenant whose shard could take it, so it is answered here, even with
    /// the fleet out of reach.
    #[tokio::test]
    async fn a_hit_with_nothing_to_do_is_ok_without_a_round_trip() {
        let store = offline_edge(4).await;
        let empty = || HitRequest {
            charges: vec![],
            claim: None,
        };
        let quick = Duration::from_millis(5);
        assert_eq!(store.hit(empty(), quick).await, Ok(HitOutcome::Ok));
        let edge = crate::Edge::new(store, crate::EdgeConfig::default());
        let answer = edge.hit(empty(), quick).await.expect("answered");
        assert_eq!(
            (answer.outcome, answer.source),
            (HitOutcome::Ok, crate::Source::Fleet)
        );
    }
}
