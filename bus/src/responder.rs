//! The node's side of the protocol for one shard: [`ShardResponder`] takes the
//! requests on the shard's subject, hands them to the shard's actors (a running
//! tenant's own, or the shard's, which starts it), makes the changes durable
//! and answers.
//!
//! Requests are handed to the actors in the order they arrive (a cast, without
//! waiting), and only the wait for each answer runs concurrently, so one slow
//! tenant never holds the subscription. Every payload gets an answer when it has
//! a reply subject: an error reply for anything malformed, of an unknown version,
//! for another shard, or past its deadline. Nothing here can panic on input.
//!
//! A node answers for a leased shard only inside its [`ServeWindow`]: the lease's
//! validity by this node's own monotonic clock. A node that was paused past its
//! lease wakes up to a closed window and stays silent, so the shard's new owner is
//! the only one answering.
//!
//! [`NodeResponder`] takes batches on the node's own subject, their items for any
//! of the shards the node serves (the [`ShardTable`]), so that an edge's batch is
//! as large as its calls in flight to the node, not to one shard. An item for a
//! shard the node does not serve (or whose window is closed) is answered
//! `wrong_node` without being applied, and the edge sends it to the shard's
//! subject instead. Each item counts as in flight on its shard, so a shard's
//! release waits for it as for its own requests.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use ankusa_actors::actor::{InOrder, Reply as ActorReply, ShardHandle};
use ankusa_actors::{
    Changes, HitOutcome, Refused, ResetRequest, SettleOutcome, TenantRequest, TenantView,
};
use futures::StreamExt;
use tokio::sync::{oneshot, watch, Notify};
use tokio::task::JoinHandle;

use crate::persist::{PersistError, Persistence};
use crate::protocol::{ErrorCode, ErrorReply, Op, Reply, ReplyBody, Request};
use crate::shard::shard_of;

/// Until when this node may answer for a shard, by its monotonic clock. Shared
/// between the lease keeper (which extends or closes it) and the responder.
#[derive(Debug, Clone, Default)]
pub struct ServeWindow(Arc<AtomicU64>);

fn monotonic_ns(at: Instant) -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    let base = *BASE.get_or_init(Instant::now);
    at.saturating_duration_since(base).as_nanos() as u64
}

impl ServeWindow {
    /// A window that is closed until extended.
    pub fn closed() -> Self {
        // 0 would be "open until the base instant", which is already past.
        Self::default()
    }

    /// Answers may go out until `until`.
    pub fn extend_to(&self, until: Instant) {
        self.0.store(monotonic_ns(until), Ordering::Release);
    }

    pub fn close(&self) {
        self.0.store(0, Ordering::Release);
    }

    /// Closes this window for good and returns a new one open until this one
    /// would have closed. What still holds this window (answers waiting on a
    /// shard actor that is being replaced) goes silent, and only the holders
    /// of the new one answer.
    pub fn close_into_successor(&self) -> ServeWindow {
        let until = self.0.swap(0, Ordering::AcqRel);
        ServeWindow(Arc::new(AtomicU64::new(until)))
    }

    pub fn is_open(&self) -> bool {
        monotonic_ns(Instant::now()) < self.0.load(Ordering::Acquire)
    }

    /// Time left, zero when closed.
    pub fn remaining(&self) -> Duration {
        let now = monotonic_ns(Instant::now());
        Duration::from_nanos(self.0.load(Ordering::Acquire).saturating_sub(now))
    }
}

/// What a responder needs to serve one shard.
#[derive(Clone)]
pub struct ShardContext {
    pub shard: u32,
    pub shards: u32,
    pub subject: String,
    pub actors: ShardHandle,
    pub persistence: Persistence,
    /// `None`: always answer (standalone); `Some`: only while the lease is valid.
    pub window: Option<ServeWindow>,
    /// The node's own subject, if it also takes this shard's calls there.
    pub routing: Option<NodeRouting>,
}

/// A node's name and the table its [`NodeResponder`] routes by.
#[derive(Clone)]
pub struct NodeRouting {
    pub node: Arc<str>,
    pub table: ShardTable,
}

/// The shards a node serves, by number, for its [`NodeResponder`]. A shard's
/// responder enters it once subscribed and leaves it before stopping.
#[derive(Clone)]
pub struct ShardTable(Arc<TableInner>);

struct TableInner {
    shards: u32,
    served: RwLock<HashMap<u32, Routed>>,
}

struct Routed {
    ctx: ShardContext,
    in_flight: Arc<InFlight>,
}

impl ShardTable {
    pub fn new(shards: u32) -> Self {
        Self(Arc::new(TableInner {
            shards,
            served: RwLock::default(),
        }))
    }

    fn enter(&self, ctx: &ShardContext, in_flight: &Arc<InFlight>) {
        let ctx = ShardContext {
            routing: None,
            ..ctx.clone()
        };
        let routed = Routed {
            ctx,
            in_flight: in_flight.clone(),
        };
        self.write().insert(routed.ctx.shard, routed);
    }

    fn leave(&self, shard: u32) {
        self.write().remove(&shard);
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<u32, Routed>> {
        // The map is valid whatever a panicking holder was doing.
        self.0.served.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<u32, Routed>> {
        // The map is valid whatever a panicking holder was doing.
        self.0.served.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// A running responder. Stopping it unsubscribes first, then waits for the
/// answers already in flight, so nothing accepted is left unanswered.
pub struct ShardResponder {
    running: Running,
    /// Where it is entered, to leave on stop.
    entered: Option<(ShardTable, u32)>,
}

impl ShardResponder {
    /// Subscribes to the shard's subject and starts answering (on the node's
    /// subject too, when the context has routing).
    pub async fn start(
        client: async_nats::Client,
        ctx: ShardContext,
    ) -> Result<Self, async_nats::SubscribeError> {
        let subscription = client.subscribe(ctx.subject.clone()).await?;
        let in_flight = Arc::new(InFlight::default());
        let entered = ctx.routing.as_ref().map(|routing| {
            routing.table.enter(&ctx, &in_flight);
            (routing.table.clone(), ctx.shard)
        });
        let running = Running::spawn(|stopped| run(client, ctx, subscription, stopped, in_flight));
        Ok(Self { running, entered })
    }

    /// Stops taking requests, answers those already delivered and waits (at
    /// most `grace` in all) for the answers in flight.
    pub async fn stop(self, grace: Duration) {
        if let Some((table, shard)) = &self.entered {
            table.leave(*shard);
        }
        self.running.stop(grace).await;
    }
}

/// A responder's task and the switch that stops it.
struct Running {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Running {
    fn spawn<F: Future<Output = ()> + Send + 'static>(
        run: impl FnOnce(watch::Receiver<bool>) -> F,
    ) -> Self {
        let (stop, stopped) = watch::channel(false);
        Self {
            stop,
            task: tokio::spawn(run(stopped)),
        }
    }

    /// Stops taking requests and waits (at most `grace`) for the answers in
    /// flight.
    async fn stop(self, grace: Duration) {
        let _ = self.stop.send(true);
        if tokio::time::timeout(grace, self.task).await.is_err() {
            tracing::warn!("responder did not finish its in-flight answers within {grace:?}");
        }
    }
}

/// Answers in flight, so that a stop can wait for them.
#[derive(Default)]
struct InFlight {
    count: AtomicUsize,
    idle: Notify,
}

impl InFlight {
    fn enter(self: &Arc<Self>) -> InFlightGuard {
        self.count.fetch_add(1, Ordering::AcqRel);
        InFlightGuard(self.clone())
    }

    async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self.count.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

struct InFlightGuard(Arc<InFlight>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

async fn run(
    client: async_nats::Client,
    ctx: ShardContext,
    subscription: async_nats::Subscriber,
    stopped: watch::Receiver<bool>,
    in_flight: Arc<InFlight>,
) {
    let mut requests = Requests::new(subscription, stopped);
    let answering = Arc::new(Answering {
        client: client.clone(),
        window: ctx.window.clone(),
        node: ctx.routing.as_ref().map(|r| r.node.clone()),
        metrics: RequestMetrics::new(),
    });
    while let Some(message) = requests.next().await {
        if !window_open(&ctx.window) {
            metrics::counter!("ankusa_requests_dropped_total", "why" => "lease").increment(1);
            continue;
        }
        let Some(reply_to) = reply_subject(&message) else {
            continue;
        };
        let received = Instant::now();
        let (op, asked) = match Request::decode(&message.payload) {
            Ok(request) => (
                Timed::Op(request.op.index()),
                ask_shard(&ctx, request, received),
            ),
            Err(err) => (
                Timed::Undecodable,
                Asked::One(Pending::Now(ReplyBody::Error(err.into()))),
            ),
        };
        let guard = in_flight.enter();
        let answering = answering.clone();
        tokio::spawn(async move {
            let body = match asked {
                Asked::One(pending) => pending.answer().await.durable_body().await,
                Asked::Batch(items) => {
                    let items = items.into_iter().map(|pending| (pending, ())).collect();
                    batch_body(answer_batch(items).await)
                }
            };
            if !window_open(&answering.window) {
                // The lease lapsed while this was in flight: someone else owns the
                // shard now and answers for it.
                metrics::counter!("ankusa_requests_dropped_total", "why" => "lease").increment(1);
                return;
            }
            let reply = Reply::new(body).from_node(answering.node.as_deref());
            answering.send((op, received), reply_to, reply).await;
            drop(guard);
        });
    }
    requests.close().await;
    in_flight.wait_idle().await;
    let _ = client.flush().await;
}

/// A responder's incoming requests: the subscription's until the responder
/// is stopped, then those it had already delivered. Unsubscribing ends the
/// stream behind them, so a stop answers every request that reached the node
/// (its callers would otherwise wait out their budgets), and a shard that is
/// handed back gets no request after its release.
struct Requests {
    subscription: async_nats::Subscriber,
    stopped: watch::Receiver<bool>,
    draining: bool,
}

impl Requests {
    fn new(subscription: async_nats::Subscriber, stopped: watch::Receiver<bool>) -> Self {
        Self {
            subscription,
            stopped,
            draining: false,
        }
    }

    async fn next(&mut self) -> Option<async_nats::Message> {
        if !self.draining {
            tokio::select! {
                message = self.subscription.next() => return message,
                _ = self.stopped.changed() => {}
            }
            self.draining = true;
            if self.subscription.unsubscribe().await.is_err() {
                // The connection is gone: nothing delivered can be answered.
                return None;
            }
        }
        self.subscription.next().await
    }

    /// Unsubscribes, if the stream ended before a stop.
    async fn close(mut self) {
        if !self.draining {
            let _ = self.subscription.unsubscribe().await;
        }
    }
}

/// What a request asked: one answer, or a batch's, in order.
enum Asked<T> {
    One(T),
    Batch(Vec<T>),
}

/// Hands a request on the shard's subject (a lone call or a batch) to the
/// shard's actors.
fn ask_shard(ctx: &ShardContext, request: Request, received: Instant) -> Asked<Pending> {
    match request {
        Request {
            op: Op::Batch(items),
            timeout_ms,
            ..
        } => match admit(timeout_ms, Request::validate_batch(&items)) {
            Ok(()) => {
                let mut order = InOrder::default();
                Asked::Batch(
                    within_batch(items, timeout_ms)
                        .map(|item| dispatch(ctx, item, received, &mut order))
                        .collect(),
                )
            }
            Err(body) => Asked::One(Pending::Now(body)),
        },
        lone => Asked::One(dispatch(ctx, lone, received, &mut InOrder::default())),
    }
}

/// A node's responder on its own subject: batches whose items may be for any
/// shard the node serves.
pub struct NodeResponder {
    running: Running,
}

impl NodeResponder {
    /// Subscribes to `subject` (the node's) and routes by `table`.
    pub async fn start(
        client: async_nats::Client,
        subject: String,
        table: ShardTable,
    ) -> Result<Self, async_nats::SubscribeError> {
        // Not a queue group, though two processes with one node id (a
        // mistake, until the later steps down) both take every batch: a
        // server may hold a dead process's subscription for minutes (a host
        // that crashed, until its pings lapse), and in a group it would get
        // half the batches of the node restarted under that id, to time out.
        let subscription = client.subscribe(subject).await?;
        let running = Running::spawn(|stopped| run_node(client, table, subscription, stopped));
        Ok(Self { running })
    }

    /// Stops taking requests, answers those already delivered and waits (at
    /// most `grace` in all) for the answers in flight.
    pub async fn stop(self, grace: Duration) {
        self.running.stop(grace).await;
    }
}

/// What an item on the node subject holds of its shard until its reply
/// leaves: the shard's window, checked again just before, and its place among
/// the shard's requests in flight (a release waits for it).
struct ShardHold {
    window: Option<ServeWindow>,
    _in_flight: Option<InFlightGuard>,
}

impl ShardHold {
    /// Held by no shard: an item answered without reaching one.
    fn none() -> Self {
        Self {
            window: None,
            _in_flight: None,
        }
    }

    /// `body`, or an error if the shard's lease lapsed meanwhile, since
    /// another node may be answering for it by now.
    fn checked(self, body: ReplyBody) -> ReplyBody {
        if window_open(&self.window) {
            body
        } else {
            metrics::counter!("ankusa_requests_dropped_total", "why" => "lease").increment(1);
            unavailable("the shard's lease lapsed while this was in flight")
        }
    }
}

async fn run_node(
    client: async_nats::Client,
    table: ShardTable,
    subscription: async_nats::Subscriber,
    stopped: watch::Receiver<bool>,
) {
    let mut requests = Requests::new(subscription, stopped);
    let in_flight = Arc::new(InFlight::default());
    let answering = Arc::new(Answering {
        client: client.clone(),
        window: None,
        node: None,
        metrics: RequestMetrics::new(),
    });
    while let Some(message) = requests.next().await {
        let Some(reply_to) = reply_subject(&message) else {
            continue;
        };
        let received = Instant::now();
        let (timed, asked) = ask_node(&table, &message.payload, received);
        let items = match asked {
            Asked::Batch(items) => items,
            // A lone call is answered as itself, not as a batch of one.
            Asked::One(lone) => {
                tokio::spawn(answer_lone(
                    answering.clone(),
                    reply_to,
                    lone,
                    (timed, received),
                    in_flight.enter(),
                ));
                continue;
            }
        };
        let guard = in_flight.enter();
        let answering = answering.clone();
        tokio::spawn(async move {
            let body = ReplyBody::Batch(
                answer_batch(items)
                    .await
                    .into_iter()
                    .map(|(body, hold)| Reply::new(hold.checked(body)))
                    .collect(),
            );
            answering
                .send((timed, received), reply_to, Reply::new(body))
                .await;
            drop(guard);
        });
    }
    requests.close().await;
    in_flight.wait_idle().await;
    let _ = client.flush().await;
}

/// Hands a request on the node's subject (a batch, or a lone call) to the
/// actors of the shards it is for. A batch's items are all handed over before
/// any answer is awaited, under one look at the table.
fn ask_node(
    table: &ShardTable,
    payload: &[u8],
    received: Instant,
) -> (Timed, Asked<(Pending, ShardHold)>) {
    let unheld = |body| Asked::One((Pending::Now(body), ShardHold::none()));
    match Request::decode(payload) {
        Err(err) => (Timed::Undecodable, unheld(ReplyBody::Error(err.into()))),
        Ok(Request {
            op: Op::Batch(items),
            timeout_ms,
            ..
        }) => match admit(timeout_ms, Request::validate_batch(&items)) {
            Ok(()) => {
                let served = table.read();
                let mut order = InOrder::default();
                let items = within_batch(items, timeout_ms)
                    .map(|item| route(&served, table.0.shards, item, received, &mut order))
                    .collect();
                (Timed::NodeBatch, Asked::Batch(items))
            }
            Err(body) => (Timed::NodeBatch, unheld(body)),
        },
        Ok(lone) => (
            Timed::Op(lone.op.index()),
            Asked::One(route(
                &table.read(),
                table.0.shards,
                lone,
                received,
                &mut InOrder::default(),
            )),
        ),
    }
}

async fn answer_lone(
    answering: Arc<Answering>,
    reply_to: async_nats::Subject,
    (pending, hold): (Pending, ShardHold),
    timed: (Timed, Instant),
    in_flight: InFlightGuard,
) {
    let body = hold.checked(pending.answer().await.durable_body().await);
    answering.send(timed, reply_to, Reply::new(body)).await;
    drop(in_flight);
}

/// What a responder's answers share, in one place so that each answer holds
/// it by one count rather than a clone of every field.
struct Answering {
    client: async_nats::Client,
    /// The shard's window (on a shard's subject), checked before answering.
    window: Option<ServeWindow>,
    /// The node named in answers on a shard's subject.
    node: Option<Arc<str>>,
    metrics: RequestMetrics,
}

impl Answering {
    /// Counts and times a reply, then publishes it; one that cannot be sent
    /// is only logged (the caller's deadline tells it).
    async fn send(
        &self,
        (timed, received): (Timed, Instant),
        reply_to: async_nats::Subject,
        reply: Reply,
    ) {
        self.metrics.count(&reply.body);
        self.metrics.timed(timed, received);
        let sent = self.client.publish(reply_to, reply.encode().into()).await;
        if let Err(err) = sent {
            tracing::debug!(error = %err, "reply not sent");
        }
    }
}

/// Hands one request to the shard its tenant belongs to, if this node serves
/// it (`served`: the [`ShardTable`]'s, read once for a whole batch).
fn route(
    served: &HashMap<u32, Routed>,
    shards: u32,
    request: Request,
    received: Instant,
    order: &mut InOrder,
) -> (Pending, ShardHold) {
    let unheld = |body| (Pending::Now(body), ShardHold::none());
    if let Err(body) = admit(request.timeout_ms, request.validate()) {
        return unheld(body);
    }
    let not_here = |message: String| {
        unheld(ReplyBody::Error(ErrorReply::new(
            ErrorCode::WrongNode,
            message,
        )))
    };
    let Some(tenant) = request.tenant() else {
        // Only a batch has no tenant, and a batch inside a batch is not admitted.
        return unheld(ReplyBody::Error(ErrorReply::new(
            ErrorCode::Malformed,
            "a batch inside a batch",
        )));
    };
    let shard = shard_of(tenant, shards);
    let Some(routed) = served.get(&shard) else {
        return not_here(format!("this node does not serve shard {shard}"));
    };
    if !window_open(&routed.ctx.window) {
        return not_here(format!("this node's lease on shard {shard} has lapsed"));
    }
    // Entered under the table's lock: a release that has left the table waits
    // for every item entered before it.
    let hold = ShardHold {
        window: routed.ctx.window.clone(),
        _in_flight: Some(routed.in_flight.enter()),
    };
    (hand_over(&routed.ctx, request, received, order), hold)
}

/// The `code`s of `ankusa_requests_refused_total` for a request that gets no
/// answer at all, beside the [`ErrorCode`]s of those answered with an error.
pub const NO_REPLY_SUBJECT: &str = "no_reply_subject";
pub const RESERVED_REPLY_SUBJECT: &str = "reserved_reply_subject";

/// Where a request's answer goes: its reply subject, unless it has none or it
/// is a `$` subject (JetStream's API, the KV buckets, the system account),
/// which are never a caller's inbox. The node may publish into its own
/// buckets, so answering there would let an edge write into the fleet's
/// leases or state. Either is counted, and the request is not carried out.
fn reply_subject(message: &async_nats::Message) -> Option<async_nats::Subject> {
    let code = match &message.reply {
        Some(reply) if !reply.starts_with('$') => return Some(reply.clone()),
        Some(_) => RESERVED_REPLY_SUBJECT,
        None => NO_REPLY_SUBJECT,
    };
    metrics::counter!("ankusa_requests_refused_total", "code" => code).increment(1);
    None
}

fn window_open(window: &Option<ServeWindow>) -> bool {
    window.as_ref().is_none_or(ServeWindow::is_open)
}

/// The handles of the per-request metrics, looked up once per responder: a
/// lookup by name and labels hashes the key and copies its labels, which cost
/// more than the count itself, once or twice for every request.
struct RequestMetrics {
    /// `ankusa_requests_total`, at `Answered as usize`.
    answered: [metrics::Counter; Answered::ALL.len()],
    /// `ankusa_request_duration_seconds`, at [`Timed::slot`].
    duration: [metrics::Histogram; Timed::SLOTS],
}

/// What a request's time is recorded under: the `op` label of
/// `ankusa_request_duration_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Timed {
    /// A request of one op (on a shard's subject, or lone on the node's), by
    /// the op's place in [`Op::NAMES`].
    Op(usize),
    /// A payload that could not be read.
    Undecodable,
    /// A batch on the node's own subject.
    NodeBatch,
}

impl Timed {
    /// The labels past the ops', in slot order.
    const OTHERS: [&'static str; 2] = ["undecodable", "node_batch"];
    const SLOTS: usize = Op::NAMES.len() + Self::OTHERS.len();

    fn slot(self) -> usize {
        match self {
            Timed::Op(index) => index,
            Timed::Undecodable => Op::NAMES.len(),
            Timed::NodeBatch => Op::NAMES.len() + 1,
        }
    }

    /// The label of a slot.
    fn label(slot: usize) -> &'static str {
        Op::NAMES
            .iter()
            .chain(&Self::OTHERS)
            .nth(slot)
            .copied()
            .unwrap_or("other")
    }
}

impl RequestMetrics {
    /// Made after the node installed its recorder (before any responder
    /// starts); without one, every handle is a no-op.
    fn new() -> Self {
        Self {
            answered: Answered::ALL.map(
                |result| metrics::counter!("ankusa_requests_total", "result" => result.label()),
            ),
            duration: std::array::from_fn(
                |slot| metrics::histogram!("ankusa_request_duration_seconds", "op" => Timed::label(slot)),
            ),
        }
    }

    /// Counts a reply's answers in `ankusa_requests_total` (by result) and
    /// `ankusa_requests_refused_total` (by code, rare enough to be looked up).
    /// Tallied first, so that a batch costs one increment per result it holds,
    /// not one per answer.
    fn count(&self, body: &ReplyBody) {
        let mut tally = Tally::default();
        tally.add(body);
        for (counter, n) in self.answered.iter().zip(tally.results) {
            if n > 0 {
                counter.increment(n);
            }
        }
        for (code, n) in tally.refused {
            metrics::counter!("ankusa_requests_refused_total", "code" => code.to_string())
                .increment(n);
        }
    }

    /// Records how long a request took since it was `received`.
    fn timed(&self, what: Timed, received: Instant) {
        if let Some(histogram) = self.duration.get(what.slot()) {
            histogram.record(received.elapsed().as_secs_f64());
        }
    }
}

/// The results counted in `ankusa_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answered {
    Ok,
    Duplicate,
    Pending,
    RateLimited,
    Settled,
    Reset,
    Inspected,
}

impl Answered {
    /// Every result, in declaration order: `ALL[r as usize] == r`.
    const ALL: [Answered; 7] = [
        Answered::Ok,
        Answered::Duplicate,
        Answered::Pending,
        Answered::RateLimited,
        Answered::Settled,
        Answered::Reset,
        Answered::Inspected,
    ];

    fn label(self) -> &'static str {
        match self {
            Answered::Ok => "ok",
            Answered::Duplicate => "duplicate",
            Answered::Pending => "pending",
            Answered::RateLimited => "rate_limited",
            Answered::Settled => "settled",
            Answered::Reset => "reset",
            Answered::Inspected => "inspected",
        }
    }
}

#[derive(Default)]
struct Tally {
    /// Per result, at `result as usize`.
    results: [u64; Answered::ALL.len()],
    refused: Vec<(ErrorCode, u64)>,
}

impl Tally {
    fn add(&mut self, body: &ReplyBody) {
        let result = match body {
            ReplyBody::Hit(outcome) => match outcome {
                ankusa_actors::HitOutcome::Ok => Answered::Ok,
                ankusa_actors::HitOutcome::Duplicate { .. } => Answered::Duplicate,
                ankusa_actors::HitOutcome::Pending { .. } => Answered::Pending,
                ankusa_actors::HitOutcome::RateLimited { .. } => Answered::RateLimited,
            },
            ReplyBody::Settle(_) => Answered::Settled,
            ReplyBody::Reset => Answered::Reset,
            ReplyBody::Inspect(_) => Answered::Inspected,
            ReplyBody::Batch(items) => {
                items.iter().for_each(|item| self.add(&item.body));
                return;
            }
            ReplyBody::Error(err) => {
                match self.refused.iter_mut().find(|(code, _)| *code == err.code) {
                    Some((_, n)) => *n += 1,
                    None => self.refused.push((err.code, 1)),
                }
                return;
            }
        };
        self.results[result as usize] += 1;
    }
}

fn refused(why: Refused) -> ReplyBody {
    ReplyBody::Error(match why {
        Refused::Invalid(invalid) => ErrorReply::invalid(invalid),
        Refused::DeadlineExpired => ErrorReply::new(ErrorCode::DeadlineExpired, why.to_string()),
        Refused::Overloaded { .. } => ErrorReply::new(ErrorCode::Overloaded, why.to_string()),
        Refused::ClaimsFull(_) => {
            metrics::counter!("ankusa_tenant_claims_full_total").increment(1);
            ErrorReply::new(ErrorCode::Overloaded, why.to_string())
        }
        Refused::Unavailable => ErrorReply::new(ErrorCode::Unavailable, why.to_string()),
    })
}

fn unavailable(message: impl Into<String>) -> ReplyBody {
    ReplyBody::Error(ErrorReply::new(ErrorCode::Unavailable, message))
}

/// A request handed to the actors, or answered at once.
enum Pending {
    Now(ReplyBody),
    Hit(ActorAnswer<HitOutcome>, Place),
    Settle(ActorAnswer<SettleOutcome>, Place),
    Reset(ActorAnswer<()>, Place),
    Inspect(ActorAnswer<TenantView>, Place),
}

type ActorAnswer<T> = oneshot::Receiver<ActorReply<T>>;

/// Where a request's changes are kept: its tenant, its shard, and how.
struct Place {
    persistence: Persistence,
    shard: u32,
    tenant: String,
}

impl Pending {
    /// The actors' answer, with the changes it made.
    async fn answer(self) -> Answer {
        let (result, place) = match self {
            Pending::Now(body) => return Answer::now(body),
            Pending::Hit(rx, place) => (applied(rx.await, ReplyBody::Hit), place),
            Pending::Settle(rx, place) => (applied(rx.await, ReplyBody::Settle), place),
            Pending::Reset(rx, place) => (applied(rx.await, |()| ReplyBody::Reset), place),
            // A read changes nothing, so it waits for no write.
            Pending::Inspect(rx, place) => (applied(rx.await, ReplyBody::Inspect), place),
        };
        match result {
            Ok(Ok((body, changes))) => Answer::after(body, Durable { place, changes }),
            Ok(Err(why)) => Answer::now(refused(why)),
            Err(_) => Answer::now(unavailable("shard actor dropped the request")),
        }
    }
}

/// An actor's reply as a body and the changes behind it.
fn applied<T, E>(
    received: Result<ActorReply<T>, E>,
    body: fn(T) -> ReplyBody,
) -> Result<Result<(ReplyBody, Changes), Refused>, E> {
    received.map(|reply| reply.map(|applied| (body(applied.outcome), applied.changes)))
}

/// What the actors answered, and the changes that must be durable before
/// the answer may leave.
struct Answer {
    body: ReplyBody,
    durable: Option<Durable>,
}

/// Changes of one tenant, and where they are kept.
struct Durable {
    place: Place,
    changes: Changes,
}

impl Durable {
    fn item(&self) -> (u32, &str, &Changes) {
        (self.place.shard, self.place.tenant.as_str(), &self.changes)
    }
}

impl Answer {
    /// An answer that changed nothing.
    fn now(body: ReplyBody) -> Self {
        Self {
            body,
            durable: None,
        }
    }

    /// An answer that may leave once `changes` are durable.
    fn after(body: ReplyBody, durable: Durable) -> Self {
        Self {
            body,
            durable: (!durable.changes.is_empty()).then_some(durable),
        }
    }

    /// The body to send, once this answer's changes are durable.
    async fn durable_body(self) -> ReplyBody {
        let Some(d) = &self.durable else {
            return self.body;
        };
        match d.place.persistence.record([d.item()]).await {
            Ok(()) => self.body,
            Err(err) => not_persisted(&err),
        }
    }
}

fn not_persisted(err: &PersistError) -> ReplyBody {
    unavailable(format!("not persisted: {err}"))
}

/// The bodies of a batch's items (each with what it carries along), once all
/// are answered and their changes durable. Awaited in order: the batch waits
/// for every answer anyway, and one that came in meanwhile is taken at once,
/// without a future per item.
async fn answer_batch<T>(items: Vec<(Pending, T)>) -> Vec<(ReplyBody, T)> {
    let mut answers = Vec::with_capacity(items.len());
    for (pending, carried) in items {
        answers.push((pending.answer().await, carried));
    }
    durable_bodies(answers).await
}

fn batch_body(bodies: Vec<(ReplyBody, ())>) -> ReplyBody {
    ReplyBody::Batch(
        bodies
            .into_iter()
            .map(|(body, ())| Reply::new(body))
            .collect(),
    )
}

/// The bodies to send for `answers` (each with what it carries along), once
/// their changes are durable: all changes kept in one place are recorded
/// together, and an answer whose changes could not be recorded becomes an
/// error.
async fn durable_bodies<T>(answers: Vec<(Answer, T)>) -> Vec<(ReplyBody, T)> {
    let mut failed: Vec<Option<PersistError>> = vec![None; answers.len()];
    let mut left: Vec<usize> = (0..answers.len())
        .filter(|&i| answers[i].0.durable.is_some())
        .collect();
    // A node keeps every shard's changes in one place, so this loop runs once.
    while let Some(&first) = left.first() {
        let Some(place) = answers[first]
            .0
            .durable
            .as_ref()
            .map(|d| &d.place.persistence)
        else {
            break;
        };
        let (together, rest): (Vec<usize>, Vec<usize>) = left.iter().partition(|&&i| {
            answers[i]
                .0
                .durable
                .as_ref()
                .is_some_and(|d| d.place.persistence.same_as(place))
        });
        let items = together
            .iter()
            .filter_map(|&i| answers[i].0.durable.as_ref().map(Durable::item));
        if let Err(err) = place.record(items).await {
            for &i in &together {
                failed[i] = Some(err.clone());
            }
        }
        left = rest;
    }
    answers
        .into_iter()
        .zip(failed)
        .map(|((answer, carried), failed)| match failed {
            Some(err) => (not_persisted(&err), carried),
            None => (answer.body, carried),
        })
        .collect()
}

/// The checks on a request itself, before it is handed to anyone: its rules,
/// and a budget left.
fn admit(timeout_ms: u64, rules: Result<(), ErrorReply>) -> Result<(), ReplyBody> {
    rules.map_err(ReplyBody::Error)?;
    if timeout_ms == 0 {
        return Err(ReplyBody::Error(ErrorReply::new(
            ErrorCode::DeadlineExpired,
            "timeout_ms is 0: the caller has already given up",
        )));
    }
    Ok(())
}

/// A batch's items, each with a budget no longer than the batch's own: the
/// caller waits for the batch's one reply no longer than that, so an item
/// applied later would be answered to nobody (protocol §5.5).
fn within_batch(items: Vec<Request>, batch_ms: u64) -> impl Iterator<Item = Request> {
    items.into_iter().map(move |mut item| {
        item.timeout_ms = item.timeout_ms.min(batch_ms);
        item
    })
}

/// Hands one request on the shard's subject to the actor now, once admitted
/// and found to be the shard's.
fn dispatch(
    ctx: &ShardContext,
    request: Request,
    received: Instant,
    order: &mut InOrder,
) -> Pending {
    if let Err(body) = admit(request.timeout_ms, request.validate()) {
        return Pending::Now(body);
    }
    if let Some(tenant) = request.tenant() {
        let owner = shard_of(tenant, ctx.shards);
        if owner != ctx.shard {
            return Pending::Now(ReplyBody::Error(ErrorReply::new(
                ErrorCode::WrongShard,
                format!(
                    "tenant belongs to shard {owner} of {}, not {}",
                    ctx.shards, ctx.shard
                ),
            )));
        }
    }
    hand_over(ctx, request, received, order)
}

/// Hands an admitted request for the shard of `ctx` to its tenant.
fn hand_over(
    ctx: &ShardContext,
    request: Request,
    received: Instant,
    order: &mut InOrder,
) -> Pending {
    let deadline = Some(received + Duration::from_millis(request.timeout_ms));
    let place = |tenant: &str| Place {
        persistence: ctx.persistence.clone(),
        shard: ctx.shard,
        tenant: tenant.to_owned(),
    };
    match request.op {
        Op::Hit(req) => {
            let place = place(req.tenant_name());
            Pending::Hit(order.ask(&ctx.actors, req, deadline), place)
        }
        Op::Settle(req) => {
            let place = place(req.tenant_name());
            Pending::Settle(order.ask(&ctx.actors, req, deadline), place)
        }
        Op::Reset { tenant } => {
            let place = place(&tenant);
            Pending::Reset(
                order.ask(&ctx.actors, ResetRequest { tenant }, deadline),
                place,
            )
        }
        Op::Inspect(req) => {
            let place = place(&req.tenant);
            Pending::Inspect(order.ask(&ctx.actors, req, deadline), place)
        }
        // Admitted requests hold no batch inside a batch.
        Op::Batch(_) => Pending::Now(ReplyBody::Error(ErrorReply::new(
            ErrorCode::Malformed,
            "a batch inside a batch",
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ankusa_actors::{HitOutcome, SettleOutcome};

    #[test]
    fn a_batch_items_budget_is_no_longer_than_the_batchs() {
        let item = |timeout_ms| Request::new(timeout_ms, Op::Reset { tenant: "t".into() });
        let budgets: Vec<u64> = within_batch(vec![item(60_000), item(3), item(5)], 5)
            .map(|item| item.timeout_ms)
            .collect();
        assert_eq!(budgets, [5, 3, 5]);
    }

    #[test]
    fn a_window_closed_into_its_successor_hands_it_the_time_left() {
        let window = ServeWindow::closed();
        window.extend_to(Instant::now() + Duration::from_secs(60));
        let holder = window.clone();
        let next = window.close_into_successor();
        assert!(!holder.is_open(), "the old window still answers");
        assert!(next.is_open());
        assert!(next.remaining() > Duration::from_secs(59));
        // The successor is extended and closed on its own from here.
        window.extend_to(Instant::now() + Duration::from_secs(60));
        next.close();
        assert!(!next.is_open() && holder.is_open());
        assert!(!ServeWindow::closed().close_into_successor().is_open());
    }

    #[test]
    fn every_op_is_timed_under_its_own_name() {
        let labels: Vec<&str> = (0..Timed::SLOTS).map(Timed::label).collect();
        for (index, name) in Op::NAMES.iter().enumerate() {
            assert_eq!(labels[Timed::Op(index).slot()], *name);
        }
        assert_eq!(labels[Timed::Undecodable.slot()], "undecodable");
        assert_eq!(labels[Timed::NodeBatch.slot()], "node_batch");
        let distinct: std::collections::HashSet<_> = labels.iter().collect();
        assert_eq!(distinct.len(), labels.len(), "{labels:?}");
    }

    #[test]
    fn a_batch_is_tallied_answer_by_answer() {
        let items = [
            ReplyBody::Hit(HitOutcome::Ok),
            ReplyBody::Hit(HitOutcome::Ok),
            ReplyBody::Hit(HitOutcome::Duplicate {
                hook_id: "h".into(),
            }),
            ReplyBody::Hit(HitOutcome::RateLimited { retry_after_ms: 1 }),
            ReplyBody::Settle(SettleOutcome::Ok),
            ReplyBody::Error(ErrorReply::new(ErrorCode::WrongNode, "x")),
            ReplyBody::Error(ErrorReply::new(ErrorCode::DeadlineExpired, "x")),
            ReplyBody::Error(ErrorReply::new(ErrorCode::WrongNode, "y")),
        ];
        let mut tally = Tally::default();
        tally.add(&ReplyBody::Batch(
            items.into_iter().map(Reply::new).collect(),
        ));
        tally.add(&ReplyBody::Reset);
        tally.add(&ReplyBody::Inspect(Default::default()));
        assert!(Answered::ALL
            .iter()
            .enumerate()
            .all(|(i, &r)| r as usize == i));
        let counted: Vec<_> = Answered::ALL
            .iter()
            .map(|r| r.label())
            .zip(tally.results)
            .collect();
        assert_eq!(
            counted,
            [
                ("ok", 2),
                ("duplicate", 1),
                ("pending", 0),
                ("rate_limited", 1),
                ("settled", 1),
                ("reset", 1),
                ("inspected", 1)
            ]
        );
        assert_eq!(
            tally.refused,
            [(ErrorCode::WrongNode, 2), (ErrorCode::DeadlineExpired, 1)]
        );
    }
}
