//! The edge client: [`FleetStore`] sends each call to its tenant's shard over NATS
//! request-reply and answers within the call's timeout, whatever the fleet does.
//!
//! - The budget is a hard limit: `Timeout` at the limit, `NoResponders` and
//!   `Disconnected` as soon as they are known. The remaining budget travels in
//!   the request (`timeout_ms`) so a node drops work the edge has given up on.
//! - "No responders" means no node serves the shard right now (a handoff): the
//!   client retries with a short, growing pause while the budget allows.
//! - Micro-batching: while a request to a shard is in flight, further hits and
//!   settles for that shard queue up and leave together in one `batch` message
//!   when it returns. A lone request is never held back.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ankusa_actors::{HitOutcome, HitRequest, SettleOutcome, SettleRequest};
use async_nats::client::RequestErrorKind;
use async_nats::connection::State;
use bytes::Bytes;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::connect::{ConnectError, NatsOptions};
use crate::protocol::{Op, Reply, ReplyBody, Request, MAX_BATCH};
use crate::shard::{shard_of, InstanceError, Subjects, MAX_SHARDS};
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
    /// Most calls in one batch.
    pub max_batch: usize,
}

impl FleetConfig {
    pub fn new(nats: NatsOptions, instance: impl Into<String>) -> Self {
        Self {
            nats,
            instance: instance.into(),
            shards: 64,
            batching: true,
            max_batch: 64,
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

/// A call waiting for its shard's in-flight request to come back.
struct Queued {
    op: Op,
    deadline: Instant,
    reply: oneshot::Sender<Result<ReplyBody, StoreError>>,
}

/// Per shard: is a request in flight, and who waits to go next.
#[derive(Default)]
struct Lane {
    busy: bool,
    queue: Vec<Queued>,
}

struct Inner {
    client: async_nats::Client,
    subjects: Vec<String>,
    shards: u32,
    batching: bool,
    max_batch: usize,
    lanes: Vec<Mutex<Lane>>,
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

impl FleetStore {
    /// Builds the client. Returns at once: NATS is reached in the background, and
    /// until it is, calls fail fast with `Disconnected`.
    pub async fn connect(config: FleetConfig) -> Result<Self, ClientConfigError> {
        let subjects = Subjects::new(&config.instance)?;
        if config.shards == 0 || config.shards > MAX_SHARDS {
            return Err(ClientConfigError::Shards(config.shards));
        }
        let client = config.nats.connect().await?;
        Ok(Self::with_client(client, &subjects, &config))
    }

    /// Builds the client on a connection the caller already has.
    pub fn with_client(
        client: async_nats::Client,
        subjects: &Subjects,
        config: &FleetConfig,
    ) -> Self {
        let shards = config.shards.clamp(1, MAX_SHARDS);
        Self {
            inner: Arc::new(Inner {
                client,
                subjects: (0..shards).map(|n| subjects.shard(n)).collect(),
                shards,
                batching: config.batching,
                max_batch: config.max_batch.clamp(1, MAX_BATCH),
                lanes: (0..shards).map(|_| Mutex::default()).collect(),
            }),
        }
    }

    /// The NATS connection (for status and tests).
    pub fn nats(&self) -> &async_nats::Client {
        &self.inner.client
    }

    pub fn shard_of(&self, tenant: &str) -> u32 {
        shard_of(tenant, self.inner.shards)
    }

    /// Sends `op` to the tenant's shard and waits for its reply body, all within
    /// `timeout`.
    async fn call(&self, tenant: &str, op: Op, timeout: Duration) -> Result<ReplyBody, StoreError> {
        let deadline = Instant::now() + timeout;
        let shard = self.shard_of(tenant) as usize;
        let batchable = self.inner.batching && matches!(op, Op::Hit(_) | Op::Settle(_));
        let work = async {
            if batchable {
                self.inner.clone().call_batched(shard, op, deadline).await
            } else {
                self.inner.send(shard, op, deadline).await
            }
        };
        // The timer fires on a millisecond tick at or after the instant it is
        // given, and the thread it wakes needs a moment more: aim one tick early
        // so that the answer is out by the deadline, not just after it.
        let alarm = deadline - TIMER_TICK.min(timeout / 10);
        match tokio::time::timeout_at(alarm, work).await {
            Ok(Err(StoreError::Timeout(_))) | Err(_) => Err(StoreError::Timeout(timeout)),
            Ok(result) => result,
        }
    }
}

fn budget_ms(deadline: Instant) -> u64 {
    deadline
        .saturating_duration_since(Instant::now())
        .as_millis() as u64
}

impl Inner {
    /// One request on the wire, retried while no node serves the shard.
    async fn send(&self, shard: usize, op: Op, deadline: Instant) -> Result<ReplyBody, StoreError> {
        let request = Request::new(budget_ms(deadline), op);
        self.send_request(shard, request, deadline).await
    }

    async fn send_request(
        &self,
        shard: usize,
        mut request: Request,
        deadline: Instant,
    ) -> Result<ReplyBody, StoreError> {
        let mut pause = FIRST_RETRY;
        loop {
            if self.client.connection_state() != State::Connected {
                return Err(StoreError::Disconnected);
            }
            request.timeout_ms = budget_ms(deadline);
            let payload = Bytes::from(request.encode());
            let sent = self
                .client
                .send_request(
                    self.subjects[shard].clone(),
                    async_nats::Request::new()
                        .payload(payload)
                        .timeout(Some(deadline.saturating_duration_since(Instant::now()))),
                )
                .await;
            match sent {
                Ok(message) => {
                    let reply = Reply::decode(&message.payload)
                        .map_err(|e| StoreError::BadReply(e.to_string()))?;
                    return Ok(reply.body);
                }
                Err(err) if err.kind() == RequestErrorKind::NoResponders => {
                    if Instant::now() + pause >= deadline {
                        return Err(StoreError::NoResponders);
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MAX_RETRY);
                }
                Err(err) if err.kind() == RequestErrorKind::TimedOut => {
                    return Err(StoreError::Timeout(Duration::from_millis(
                        request.timeout_ms,
                    )));
                }
                Err(err) => return Err(StoreError::Transport(err.to_string())),
            }
        }
    }

    /// Goes alone when the shard's lane is idle; otherwise waits to leave with
    /// the next batch.
    async fn call_batched(
        self: Arc<Self>,
        shard: usize,
        op: Op,
        deadline: Instant,
    ) -> Result<ReplyBody, StoreError> {
        // Either the call joins the queue (and waits for its batch) or it takes the lane.
        let op = {
            let mut lane = self.lanes[shard].lock().unwrap_or_else(|p| p.into_inner());
            if lane.busy {
                let (reply, rx) = oneshot::channel();
                lane.queue.push(Queued {
                    op,
                    deadline,
                    reply,
                });
                Err(rx)
            } else {
                lane.busy = true;
                Ok(op)
            }
        };
        let op = match op {
            Ok(op) => op,
            Err(rx) => {
                return rx
                    .await
                    .unwrap_or_else(|_| Err(StoreError::Transport("batch dropped".into())));
            }
        };
        // Whatever happens to this call, the lane must be handed on.
        let lane_guard = LaneHandoff {
            inner: self.clone(),
            shard,
        };
        let result = self.send(shard, op, deadline).await;
        drop(lane_guard);
        result
    }

    /// Flushes a shard's queue batch by batch until it is empty, then frees the lane.
    async fn drain(self: Arc<Self>, shard: usize) {
        loop {
            let batch: Vec<Queued> = {
                let mut lane = self.lanes[shard].lock().unwrap_or_else(|p| p.into_inner());
                let now = Instant::now();
                let (live, expired): (Vec<_>, Vec<_>) = std::mem::take(&mut lane.queue)
                    .into_iter()
                    .filter(|q| !q.reply.is_closed())
                    .partition(|q| q.deadline > now);
                lane.queue = live;
                for q in expired {
                    let _ = q.reply.send(Err(StoreError::Timeout(Duration::ZERO)));
                }
                if lane.queue.is_empty() {
                    lane.busy = false;
                    return;
                }
                let take = lane.queue.len().min(self.max_batch);
                lane.queue.drain(..take).collect()
            };
            self.send_batch(shard, batch).await;
        }
    }

    async fn send_batch(&self, shard: usize, mut batch: Vec<Queued>) {
        if batch.len() == 1 {
            if let Some(q) = batch.pop() {
                let result = self.send(shard, q.op, q.deadline).await;
                let _ = q.reply.send(result);
            }
            return;
        }
        let deadline = batch
            .iter()
            .map(|q| q.deadline)
            .max()
            .unwrap_or_else(Instant::now);
        let items = batch
            .iter()
            .map(|q| Request::new(budget_ms(q.deadline), q.op.clone()))
            .collect();
        let result = self
            .send_request(
                shard,
                Request::new(budget_ms(deadline), Op::Batch(items)),
                deadline,
            )
            .await;
        match result {
            Ok(ReplyBody::Batch(replies)) if replies.len() == batch.len() => {
                for (q, reply) in batch.into_iter().zip(replies) {
                    let _ = q.reply.send(Ok(reply.body));
                }
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
                for q in batch {
                    let _ = q.reply.send(Err(err.clone()));
                }
            }
        }
    }
}

/// Hands a shard's lane to its queue (or frees it) when the call that held it
/// ends, even if that call was cancelled by its deadline.
struct LaneHandoff {
    inner: Arc<Inner>,
    shard: usize,
}

impl Drop for LaneHandoff {
    fn drop(&mut self) {
        let inner = self.inner.clone();
        let shard = self.shard;
        let has_queue = {
            let mut lane = inner.lanes[shard].lock().unwrap_or_else(|p| p.into_inner());
            if lane.queue.is_empty() {
                lane.busy = false;
                false
            } else {
                true
            }
        };
        if has_queue {
            tokio::spawn(inner.drain(shard));
        }
    }
}

fn unexpected(body: ReplyBody) -> StoreError {
    match body {
        ReplyBody::Error(err) => StoreError::Refused(err),
        other => StoreError::BadReply(format!("unexpected reply {other:?}")),
    }
}

impl Store for FleetStore {
    async fn hit(&self, req: HitRequest, timeout: Duration) -> Result<HitOutcome, StoreError> {
        req.validate()?;
        let tenant = req.tenant().to_owned();
        match self.call(&tenant, Op::Hit(req), timeout).await? {
            ReplyBody::Hit(outcome) => Ok(outcome),
            other => Err(unexpected(other)),
        }
    }

    async fn settle(
        &self,
        req: SettleRequest,
        timeout: Duration,
    ) -> Result<SettleOutcome, StoreError> {
        req.validate()?;
        let tenant = req.claim.tenant.clone();
        match self.call(&tenant, Op::Settle(req), timeout).await? {
            ReplyBody::Settle(outcome) => Ok(outcome),
            other => Err(unexpected(other)),
        }
    }

    async fn reset(&self, tenant: String, timeout: Duration) -> Result<(), StoreError> {
        ankusa_actors::types::validate_tenant(&tenant)?;
        match self
            .call(&tenant.clone(), Op::Reset { tenant }, timeout)
            .await?
        {
            ReplyBody::Reset => Ok(()),
            other => Err(unexpected(other)),
        }
    }
}
