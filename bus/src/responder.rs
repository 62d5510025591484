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

use ankusa_actors::actor::{ShardHandle, ShardMsg};
use ankusa_actors::{Changes, Refused, TenantRequest};
use futures::future::{join_all, BoxFuture};
use futures::{FutureExt, StreamExt};
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

    /// Stops taking requests and waits (at most `grace`) for those in flight.
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
    mut subscription: async_nats::Subscriber,
    mut stopped: watch::Receiver<bool>,
    in_flight: Arc<InFlight>,
) {
    let node: Option<Arc<str>> = ctx.routing.as_ref().map(|r| r.node.clone());
    loop {
        let message = tokio::select! {
            message = subscription.next() => message,
            _ = stopped.changed() => None,
        };
        let Some(message) = message else { break };
        if !window_open(&ctx.window) {
            metrics::counter!("ankusa_requests_dropped_total", "why" => "lease").increment(1);
            continue;
        }
        let Some(reply_to) = message.reply.clone() else {
            metrics::counter!("ankusa_requests_refused_total", "code" => "no_reply_subject")
                .increment(1);
            continue;
        };
        let received = Instant::now();
        let (op, answer) = match Request::decode(&message.payload) {
            Ok(request) => (request.op.name(), dispatch(&ctx, request, received)),
            Err(err) => ("undecodable", ready(ReplyBody::Error(err.into()))),
        };
        let guard = in_flight.enter();
        let client = client.clone();
        let window = ctx.window.clone();
        let node = node.clone();
        tokio::spawn(async move {
            let body = answer.await.durable_body().await;
            if !window_open(&window) {
                // The lease lapsed while this was in flight: someone else owns the
                // shard now and answers for it.
                metrics::counter!("ankusa_requests_dropped_total", "why" => "lease").increment(1);
                return;
            }
            count(&body);
            metrics::histogram!("ankusa_request_duration_seconds", "op" => op)
                .record(received.elapsed().as_secs_f64());
            send_reply(
                &client,
                reply_to,
                Reply::new(body).from_node(node.as_deref()),
            )
            .await;
            drop(guard);
        });
    }
    let _ = subscription.unsubscribe().await;
    in_flight.wait_idle().await;
    let _ = client.flush().await;
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
        let subscription = client.subscribe(subject).await?;
        let running = Running::spawn(|stopped| run_node(client, table, subscription, stopped));
        Ok(Self { running })
    }

    /// Stops taking requests and waits (at most `grace`) for those in flight.
    pub async fn stop(self, grace: Duration) {
        self.running.stop(grace).await;
    }
}

/// One item's answer on the node subject, with what it holds until sent.
struct RoutedAnswer {
    answer: Answer,
    hold: ShardHold,
}

/// What an item holds of its shard until its reply leaves: the shard's
/// window, checked again just before, and its place among the shard's
/// requests in flight (a release waits for it).
struct ShardHold {
    window: Option<ServeWindow>,
    _in_flight: Option<InFlightGuard>,
}

impl RoutedAnswer {
    /// An answer known at once, held by no shard.
    fn unrouted(body: ReplyBody) -> BoxFuture<'static, Self> {
        futures::future::ready(Self {
            answer: Answer::now(body),
            hold: ShardHold {
                window: None,
                _in_flight: None,
            },
        })
        .boxed()
    }
}

impl ShardHold {
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
    mut subscription: async_nats::Subscriber,
    mut stopped: watch::Receiver<bool>,
) {
    let in_flight = Arc::new(InFlight::default());
    loop {
        let message = tokio::select! {
            message = subscription.next() => message,
            _ = stopped.changed() => None,
        };
        let Some(message) = message else { break };
        let Some(reply_to) = message.reply.clone() else {
            metrics::counter!("ankusa_requests_refused_total", "code" => "no_reply_subject")
                .increment(1);
            continue;
        };
        let received = Instant::now();
        let items = match Request::decode(&message.payload) {
            Ok(Request {
                op: Op::Batch(items),
                ..
            }) => items,
            // A lone call (or what did not decode) is answered as itself, not
            // as a batch of one.
            lone => {
                let answer = match lone {
                    Ok(request) => route(&table, request, received),
                    Err(err) => RoutedAnswer::unrouted(ReplyBody::Error(err.into())),
                };
                tokio::spawn(answer_lone(
                    client.clone(),
                    reply_to,
                    answer,
                    in_flight.enter(),
                ));
                continue;
            }
        };
        let answers: Vec<_> = items
            .into_iter()
            .map(|item| route(&table, item, received))
            .collect();
        let guard = in_flight.enter();
        let client = client.clone();
        tokio::spawn(async move {
            let answers = join_all(answers).await;
            // The items' changes leave together: one submission, in as few
            // log messages as they fit.
            let held = answers.into_iter().map(|a| (a.answer, a.hold)).collect();
            let body = ReplyBody::Batch(
                durable_bodies(held)
                    .await
                    .into_iter()
                    .map(|(body, hold)| Reply::new(hold.checked(body)))
                    .collect(),
            );
            count(&body);
            metrics::histogram!("ankusa_request_duration_seconds", "op" => "node_batch")
                .record(received.elapsed().as_secs_f64());
            send_reply(&client, reply_to, Reply::new(body)).await;
            drop(guard);
        });
    }
    let _ = subscription.unsubscribe().await;
    in_flight.wait_idle().await;
    let _ = client.flush().await;
}

async fn answer_lone(
    client: async_nats::Client,
    reply_to: async_nats::Subject,
    answer: BoxFuture<'static, RoutedAnswer>,
    in_flight: InFlightGuard,
) {
    let RoutedAnswer { answer, hold } = answer.await;
    let body = hold.checked(answer.durable_body().await);
    count(&body);
    send_reply(&client, reply_to, Reply::new(body)).await;
    drop(in_flight);
}

/// Publishes a reply; one that cannot be sent is only logged (the caller's
/// deadline tells it).
async fn send_reply(client: &async_nats::Client, reply_to: async_nats::Subject, reply: Reply) {
    if let Err(err) = client.publish(reply_to, reply.encode().into()).await {
        tracing::debug!(error = %err, "reply not sent");
    }
}

/// Hands one request to the shard its tenant belongs to, if this node serves it.
fn route(
    table: &ShardTable,
    request: Request,
    received: Instant,
) -> BoxFuture<'static, RoutedAnswer> {
    let not_here = |message: String| {
        RoutedAnswer::unrouted(ReplyBody::Error(ErrorReply::new(
            ErrorCode::WrongNode,
            message,
        )))
    };
    let Some(tenant) = request.tenant() else {
        // Only a batch has no tenant, and a batch inside a batch does not decode.
        let body = ReplyBody::Error(ErrorReply::new(
            ErrorCode::Malformed,
            "a batch inside a batch",
        ));
        return RoutedAnswer::unrouted(body);
    };
    let shard = shard_of(tenant, table.0.shards);
    let served = table.0.served.read().unwrap_or_else(|p| p.into_inner());
    let Some(routed) = served.get(&shard) else {
        return not_here(format!("this node does not serve shard {shard}"));
    };
    if !window_open(&routed.ctx.window) {
        return not_here(format!("this node's lease on shard {shard} has lapsed"));
    }
    // Entered under the table's lock: a release that has left the table waits
    // for every item entered before it.
    let guard = routed.in_flight.enter();
    let window = routed.ctx.window.clone();
    let answer = dispatch(&routed.ctx, request, received);
    drop(served);
    async move {
        RoutedAnswer {
            answer: answer.await,
            hold: ShardHold {
                window,
                _in_flight: Some(guard),
            },
        }
    }
    .boxed()
}

fn window_open(window: &Option<ServeWindow>) -> bool {
    window.as_ref().is_none_or(ServeWindow::is_open)
}

/// Counts a reply's answers in `ankusa_requests_total` (by result) and
/// `ankusa_requests_refused_total` (by code). Tallied first, so that a batch
/// costs one counter lookup per result it holds, not one per answer.
fn count(body: &ReplyBody) {
    let mut tally = Tally::default();
    tally.add(body);
    for (result, n) in Answered::ALL.into_iter().zip(tally.results) {
        if n > 0 {
            metrics::counter!("ankusa_requests_total", "result" => result.label()).increment(n);
        }
    }
    for (code, n) in tally.refused {
        metrics::counter!("ankusa_requests_refused_total", "code" => code.to_string()).increment(n);
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
}

impl Answered {
    /// Every result, in declaration order: `ALL[r as usize] == r`.
    const ALL: [Answered; 6] = [
        Answered::Ok,
        Answered::Duplicate,
        Answered::Pending,
        Answered::RateLimited,
        Answered::Settled,
        Answered::Reset,
    ];

    fn label(self) -> &'static str {
        match self {
            Answered::Ok => "ok",
            Answered::Duplicate => "duplicate",
            Answered::Pending => "pending",
            Answered::RateLimited => "rate_limited",
            Answered::Settled => "settled",
            Answered::Reset => "reset",
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

fn ready(body: ReplyBody) -> BoxFuture<'static, Answer> {
    futures::future::ready(Answer::now(body)).boxed()
}

fn refused(why: Refused) -> ReplyBody {
    ReplyBody::Error(match why {
        Refused::Invalid(invalid) => ErrorReply::invalid(invalid),
        Refused::DeadlineExpired => ErrorReply::new(ErrorCode::DeadlineExpired, why.to_string()),
        Refused::Overloaded { .. } => ErrorReply::new(ErrorCode::Overloaded, why.to_string()),
        Refused::Unavailable => ErrorReply::new(ErrorCode::Unavailable, why.to_string()),
    })
}

fn unavailable(message: impl Into<String>) -> ReplyBody {
    ReplyBody::Error(ErrorReply::new(ErrorCode::Unavailable, message))
}

/// What the actors answered, and the changes that must be durable before
/// the answer may leave.
struct Answer {
    body: ReplyBody,
    durable: Option<Durable>,
}

/// Changes of one tenant, and where they are kept.
struct Durable {
    persistence: Persistence,
    shard: u32,
    tenant: String,
    changes: Changes,
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
        let items = [(d.shard, d.tenant.as_str(), &d.changes)];
        match d.persistence.record(items).await {
            Ok(()) => self.body,
            Err(err) => not_persisted(&err),
        }
    }
}

fn not_persisted(err: &PersistError) -> ReplyBody {
    unavailable(format!("not persisted: {err}"))
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
        let Some(place) = answers[first].0.durable.as_ref().map(|d| &d.persistence) else {
            break;
        };
        let (together, rest): (Vec<usize>, Vec<usize>) = left.iter().partition(|&&i| {
            answers[i]
                .0
                .durable
                .as_ref()
                .is_some_and(|d| d.persistence.same_as(place))
        });
        let items = together.iter().filter_map(|&i| {
            let d = answers[i].0.durable.as_ref()?;
            Some((d.shard, d.tenant.as_str(), &d.changes))
        });
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

/// Hands one request to the actor now and returns the future of its answer.
fn dispatch(ctx: &ShardContext, request: Request, received: Instant) -> BoxFuture<'static, Answer> {
    if let Err(err) = request.validate() {
        return ready(ReplyBody::Error(err));
    }
    if request.timeout_ms == 0 {
        return ready(ReplyBody::Error(ErrorReply::new(
            ErrorCode::DeadlineExpired,
            "timeout_ms is 0: the caller has already given up",
        )));
    }
    if let Some(tenant) = request.tenant() {
        let owner = shard_of(tenant, ctx.shards);
        if owner != ctx.shard {
            return ready(ReplyBody::Error(ErrorReply::new(
                ErrorCode::WrongShard,
                format!(
                    "tenant belongs to shard {owner} of {}, not {}",
                    ctx.shards, ctx.shard
                ),
            )));
        }
    }
    let deadline = Some(received + Duration::from_millis(request.timeout_ms));
    match request.op {
        Op::Hit(req) => apply(ctx, req, deadline, ReplyBody::Hit),
        Op::Settle(req) => apply(ctx, req, deadline, ReplyBody::Settle),
        Op::Reset { tenant } => {
            let (reply, rx) = oneshot::channel();
            let msg = ShardMsg::Reset {
                tenant: tenant.clone(),
                reply: reply.into(),
            };
            if ctx.actors.actor().cast(msg).is_err() {
                return ready(unavailable("shard actor is not running"));
            }
            let (shard, persistence) = (ctx.shard, ctx.persistence.clone());
            async move {
                match rx.await {
                    Ok(Ok(changes)) => Answer::after(
                        ReplyBody::Reset,
                        Durable {
                            persistence,
                            shard,
                            tenant,
                            changes,
                        },
                    ),
                    Ok(Err(why)) => Answer::now(refused(why)),
                    Err(_) => Answer::now(unavailable("shard actor dropped the request")),
                }
            }
            .boxed()
        }
        Op::Batch(items) => {
            let answers: Vec<_> = items
                .into_iter()
                .map(|item| dispatch(ctx, item, received))
                .collect();
            async move {
                let answers = join_all(answers).await;
                let bodies = durable_bodies(answers.into_iter().map(|a| (a, ())).collect()).await;
                Answer::now(ReplyBody::Batch(
                    bodies
                        .into_iter()
                        .map(|(body, ())| Reply::new(body))
                        .collect(),
                ))
            }
            .boxed()
        }
    }
}

/// Hands a hit or settle to its tenant's actor; the future answers its outcome
/// and the changes it made, to be made durable before it leaves.
fn apply<R: TenantRequest>(
    ctx: &ShardContext,
    req: R,
    deadline: Option<Instant>,
    body: fn(R::Outcome) -> ReplyBody,
) -> BoxFuture<'static, Answer> {
    let tenant = req.tenant_name().to_owned();
    let rx = ctx.actors.ask(req, deadline);
    let (shard, persistence) = (ctx.shard, ctx.persistence.clone());
    async move {
        match rx.await {
            Ok(Ok(applied)) => Answer::after(
                body(applied.outcome),
                Durable {
                    persistence,
                    shard,
                    tenant,
                    changes: applied.changes,
                },
            ),
            Ok(Err(why)) => Answer::now(refused(why)),
            Err(_) => Answer::now(unavailable("shard actor dropped the request")),
        }
    }
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ankusa_actors::{HitOutcome, SettleOutcome};

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
                ("reset", 1)
            ]
        );
        assert_eq!(
            tally.refused,
            [(ErrorCode::WrongNode, 2), (ErrorCode::DeadlineExpired, 1)]
        );
    }
}
