//! The group commit: [`KvWriter`] and the loop that writes a node's claim
//! logs.
//!
//! A caller is answered only once JetStream holds its change, and a stored
//! message per change would cost a burst of hits a message each; so a log's
//! changes queue while its messages are in flight and leave together as the
//! next one, and bucket TATs are written behind into the same logs. How a
//! message is written and its ack read is `write`'s; this file decides what
//! goes into each message, and when.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ankusa_actors::{BucketRecord, Changes, Clock};
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tokio::sync::{mpsc, oneshot};

use super::write::{acked, Write};
use super::{now_unix_us, ttl_secs_until, FleetKv};
use crate::claimlog::{self, EncodedChange};
use crate::lock;
use crate::persist::PersistError;
use crate::replies::Inbox;
use crate::responder::ServeWindow;
use crate::store::StoreError;

/// Who waits for the changes it submitted together: answered once every
/// message holding one of them is acknowledged, with the first failure if
/// any. A node batch's changes are submitted together, so its items cost one
/// channel send and one answer between them, not one each.
struct Waiter(Mutex<Waiting>);

struct Waiting {
    /// Changes not yet acknowledged (or failed).
    left: usize,
    /// The first failure among them.
    failure: Option<PersistError>,
    reply: Option<oneshot::Sender<Result<(), PersistError>>>,
}

/// A change's share of its [`Waiter`].
type Done = Arc<Waiter>;

impl Waiter {
    fn new(changes: usize) -> (Done, oneshot::Receiver<Result<(), PersistError>>) {
        let (reply, answer) = oneshot::channel();
        let waiting = Waiting {
            left: changes,
            failure: None,
            reply: Some(reply),
        };
        (Arc::new(Self(Mutex::new(waiting))), answer)
    }

    /// The message holding one of its changes was acknowledged, or failed.
    fn settle(&self, result: &Result<(), PersistError>) {
        let mut waiting = lock(&self.0);
        if let Err(err) = result {
            waiting.failure.get_or_insert_with(|| err.clone());
        }
        waiting.left = waiting.left.saturating_sub(1);
        if waiting.left == 0 {
            let outcome = waiting.failure.take().map_or(Ok(()), Err);
            if let Some(reply) = waiting.reply.take() {
                let _ = reply.send(outcome);
            }
        }
    }
}

/// What the commit loop is given: changes of shards (claim changes or
/// tenants' TATs) for their logs, and who waits for them.
struct Submitted {
    changes: Vec<(u32, EncodedChange)>,
    done: Done,
    carrying: Carrying,
}

/// What a submission carries, which says how much of the queues it may fill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Carrying {
    /// A request's claims and resets, which it waits on: all of the queues.
    Requests,
    /// Written-behind TATs: [`BUCKETS_ROOM`] of them.
    WrittenBehind,
}

impl Carrying {
    /// The most changes the queues may hold with a submission's in.
    fn room(self) -> usize {
        match self {
            Carrying::Requests => MAX_QUEUED_CHANGES,
            Carrying::WrittenBehind => BUCKETS_ROOM,
        }
    }
}

/// Submissions queued for the commit loop before their tenants wait, and log
/// messages awaited at once before it takes new ones. The second never binds
/// today: a log has at most [`LOG_MESSAGES_IN_FLIGHT`] messages out, and a node
/// writes at most one log per 8 shards.
const MAX_IN_FLIGHT: usize = 4000;

/// A tenant of a shard whose buckets changed since the last flush.
type DirtyTenant = (u32, String);
/// The latest TAT per bucket kind, where it moved.
type DirtyTats = [Option<u64>; 2];

/// Bucket changes waiting for the write-behind flush.
#[derive(Default)]
struct DirtyBuckets {
    /// Buckets changed since the last flush, latest TATs per tenant.
    tats: HashMap<DirtyTenant, DirtyTats>,
    /// Shards this node stopped serving. Their TATs are not written any more:
    /// another node may serve them now, and the last record of a bucket wins
    /// when a shard is loaded, so a late write of this node's TAT would undo
    /// the new owner's (a reset, or the TATs it charged since).
    stopped: HashSet<u32>,
    /// The serve windows of the shards this node took. A shard's TATs are
    /// written only while its window is open: once it has closed (a pause
    /// past the lease), another node may own the shard before this one's
    /// renewal finds out, so they wait for that renewal, which either
    /// reopens the window or stops the shard's writing.
    windows: HashMap<u32, ServeWindow>,
}

/// Group-committing writer of one node's claims and buckets.
pub struct KvWriter {
    kv: FleetKv,
    tx: mpsc::Sender<Submitted>,
    dirty: Mutex<DirtyBuckets>,
    /// Whether changes go to the node log rather than the group logs.
    node_log: Arc<AtomicBool>,
}

impl KvWriter {
    /// Starts the writer and its write-behind flusher.
    pub fn start(kv: FleetKv, write_behind: Duration) -> Arc<Self> {
        let (tx, rx) = mpsc::channel(MAX_IN_FLIGHT);
        let node_log = Arc::new(AtomicBool::new(false));
        let writer = Arc::new(Self {
            kv: kv.clone(),
            tx,
            dirty: Mutex::default(),
            node_log: node_log.clone(),
        });
        let logs = ClaimLogs::new(kv.state_bucket.clone(), kv.clock.clone());
        tokio::spawn(commit_loop(kv.writes.clone(), logs, node_log, rx));
        let flusher = Arc::downgrade(&writer);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(write_behind);
            loop {
                ticks.tick().await;
                let Some(writer) = flusher.upgrade() else {
                    break;
                };
                writer.flush_buckets(None).await;
            }
        });
        writer
    }

    pub fn kv(&self) -> &FleetKv {
        &self.kv
    }

    /// Writes the changes from now on to the node log (`true`) or to the group
    /// logs (`false`, the start); returns the previous setting. A fleet turns
    /// it on once every live node reads the node log
    /// ([`Heartbeat::all_read_node_log`]).
    ///
    /// [`Heartbeat::all_read_node_log`]: super::Heartbeat::all_read_node_log
    pub fn write_node_log(&self, on: bool) -> bool {
        self.node_log.swap(on, Ordering::Relaxed)
    }

    /// Hands changes to the commit loop, if the queues have room for what
    /// they carry; returns once all are in JetStream.
    async fn submit(
        &self,
        changes: Vec<(u32, EncodedChange)>,
        carrying: Carrying,
    ) -> Result<(), PersistError> {
        if changes.is_empty() {
            return Ok(());
        }
        let (done, ack) = Waiter::new(changes.len());
        self.tx
            .send(Submitted {
                changes,
                done,
                carrying,
            })
            .await
            .map_err(|_| PersistError::Stopped)?;
        ack.await.map_err(|_| PersistError::Stopped)?
    }

    /// The claims and resets of every `(shard, tenant, changes)` are durable
    /// when this returns (all of them, or an error); other bucket changes are
    /// queued for the next flush.
    pub async fn record<'a>(
        &self,
        items: impl IntoIterator<Item = (u32, &'a str, &'a Changes)>,
    ) -> Result<(), PersistError> {
        let mut claims = Vec::new();
        {
            let mut dirty = lock(&self.dirty);
            for (shard, tenant, changes) in items {
                if !changes.buckets.is_empty() {
                    let slot = dirty.tats.entry((shard, tenant.to_string())).or_default();
                    for bucket in &changes.buckets {
                        slot[claimlog::kind_index(bucket.kind)] = Some(bucket.tat_us);
                    }
                }
                // A reset is answered as recorded (docs/protocol.md §7.3), and
                // it is rare: it is written now, not behind. It stays in the
                // dirty slot too, so that it is written again after any older
                // TATs a flush already in flight may still store.
                let resets: Vec<BucketRecord> = changes
                    .buckets
                    .iter()
                    .filter(|bucket| bucket.tat_us == 0)
                    .copied()
                    .collect();
                if !resets.is_empty() {
                    let change = EncodedChange::buckets(shard, tenant, &resets, self.kv.now_us());
                    claims.push((shard, change));
                }
                if let Some(change) = &changes.claim {
                    // Encoded here, on the caller's task, so the commit loop
                    // only frames bytes.
                    claims.push((shard, EncodedChange::claim(shard, tenant, change)));
                }
            }
        }
        self.submit(claims, Carrying::Requests).await
    }

    /// Stops writing the buckets of `shards`, which this node no longer
    /// serves, dropping what it had not written yet: call it once a shard's
    /// last flush is done (or not to be had, its lease lapsed).
    pub fn stop_writing(&self, shards: &[u32]) {
        let mut dirty = lock(&self.dirty);
        dirty.stopped.extend(shards);
        dirty.tats.retain(|(shard, _), _| !shards.contains(shard));
        for shard in shards {
            dirty.windows.remove(shard);
        }
    }

    /// Writes the buckets of `shard` again, which this node is taking (back),
    /// while `window` (the shard's serve window) is open.
    pub fn start_writing(&self, shard: u32, window: ServeWindow) {
        let mut dirty = lock(&self.dirty);
        dirty.stopped.remove(&shard);
        dirty.windows.insert(shard, window);
    }

    /// Writes the dirty buckets (of one shard, or all) now and waits for the
    /// acks; returns how many tenants' writes failed (kept for the next flush).
    pub async fn flush_buckets(&self, shard: Option<u32>) -> usize {
        let batch: Vec<(DirtyTenant, DirtyTats)> = {
            let mut dirty = lock(&self.dirty);
            let DirtyBuckets {
                tats,
                stopped,
                windows,
            } = &mut *dirty;
            // A request answered while its shard was being let go.
            if !stopped.is_empty() {
                tats.retain(|(sh, _), _| !stopped.contains(sh));
            }
            if shard.is_none() && windows.values().all(ServeWindow::is_open) {
                tats.drain().collect()
            } else {
                let ready = |sh: &u32| {
                    shard.is_none_or(|s| s == *sh)
                        && windows.get(sh).is_none_or(ServeWindow::is_open)
                };
                let keys: Vec<DirtyTenant> =
                    tats.keys().filter(|(sh, _)| ready(sh)).cloned().collect();
                keys.into_iter()
                    .filter_map(|k| tats.remove_entry(&k))
                    .collect()
            }
        };
        if batch.is_empty() {
            return 0;
        }
        metrics::histogram!("ankusa_kv_flush_buckets").record(batch.len() as f64);
        let now_us = self.kv.now_us();
        let writes = batch.iter().map(|((shard, tenant), tats)| {
            let buckets: Vec<BucketRecord> = ankusa_actors::Kind::ALL
                .iter()
                .zip(tats)
                .filter_map(|(&kind, &tat)| match tat {
                    // A reset: its record must outlive the TATs it cancels.
                    Some(0) => Some(BucketRecord { kind, tat_us: 0 }),
                    Some(tat_us) if tat_us > now_us => Some(BucketRecord { kind, tat_us }),
                    // Full again by itself: the bucket's earlier records, with
                    // earlier TATs, have expired or soon will.
                    _ => None,
                })
                .collect();
            let change = (!buckets.is_empty())
                .then(|| EncodedChange::buckets(*shard, tenant, &buckets, now_us));
            async move {
                match change {
                    Some(change) => {
                        self.submit(vec![(*shard, change)], Carrying::WrittenBehind)
                            .await
                    }
                    None => Ok(()),
                }
            }
        });
        let results = futures::future::join_all(writes).await;
        let mut failed = 0;
        let mut dirty = lock(&self.dirty);
        for ((tenant, tats), result) in batch.into_iter().zip(results) {
            if result.is_ok() || dirty.stopped.contains(&tenant.0) {
                continue;
            }
            failed += 1;
            // Back in for the next flush, unless the tenant moved on since.
            let slot = dirty.tats.entry(tenant).or_default();
            for (newer, older) in slot.iter_mut().zip(tats) {
                if newer.is_none() {
                    *newer = older;
                }
            }
        }
        drop(dirty);
        if failed > 0 {
            tracing::warn!(
                failed,
                "bucket write-behind failed; retrying at the next flush"
            );
        }
        failed
    }
}

/// A claim log a writer writes to (see [`claimlog`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum LogId {
    /// This node's own log.
    Node,
    /// The group log of shards `8 × n` to `8 × n + 7`.
    Group(u32),
}

/// The claim logs this writer has written to: what waits to go out, and
/// whether a message is in flight.
struct ClaimLogs {
    bucket: String,
    /// The clock the changes' `keep_until_us` were set by.
    clock: Arc<dyn Clock>,
    /// Makes this writer's log keys unique among every writer, past and present.
    writer: String,
    seq: u64,
    logs: HashMap<LogId, ClaimLog>,
    /// Changes queued in all logs.
    queued: usize,
}

/// Messages of one log awaiting their acks at once. With one, a change made
/// while a message is in flight waits for that ack and then for its own: at
/// 19 k unbatched hits/s a request spent 0.9–1.1 ms in the node against a
/// 0.4 ms ack. A second message lets it leave at once; at the peak the
/// messages stay as full (the changes of a round still leave together). Both
/// go out on one connection, so they are stored in the order they were sent;
/// the replay does not depend on that order anyway (see `claimlog`).
const LOG_MESSAGES_IN_FLIGHT: usize = 2;

/// Changes queued in all logs at most. Past it, new ones are refused at once
/// (`unavailable`) rather than queued: a server that acknowledges more
/// slowly than changes come in would otherwise grow the queue (and the
/// requests waiting on it) without end, long after their callers gave up.
/// Healthy, the queues hold a few hundred; this is about 50 MB with the
/// requests waiting on them.
const MAX_QUEUED_CHANGES: usize = 100_000;

/// How full the queues may be for a written-behind TAT to join them: the rest
/// is kept for claims, which requests wait on. Past it a tenant's TATs stay
/// dirty for the next flush, so a server slow to acknowledge fills the queues
/// with claims, not with the bucket records of every tenant that moved.
const BUCKETS_ROOM: usize = MAX_QUEUED_CHANGES / 2;

#[derive(Default)]
struct ClaimLog {
    queue: Vec<(EncodedChange, Done)>,
    /// Messages awaiting their ack, at most [`LOG_MESSAGES_IN_FLIGHT`].
    in_flight: usize,
}

impl ClaimLogs {
    fn new(bucket: String, clock: Arc<dyn Clock>) -> Self {
        // Two log messages under one key would be one too many: the bucket keeps
        // only the last. Process, start time and a per-process count keep every
        // writer's keys apart.
        static STARTED: AtomicU64 = AtomicU64::new(0);
        let writer = {
            let mut hasher = xxhash_rust::xxh3::Xxh3::new();
            hasher.update(&std::process::id().to_le_bytes());
            hasher.update(&now_unix_us().to_le_bytes());
            hasher.update(&STARTED.fetch_add(1, Ordering::Relaxed).to_le_bytes());
            format!("{:016x}", hasher.digest())
        };
        Self {
            bucket,
            clock,
            writer,
            seq: 0,
            logs: HashMap::new(),
            queued: 0,
        }
    }

    /// Queues `changes` on their logs (the node log, or each shard's group
    /// log) and returns the logs that got some; refuses them all, unqueued,
    /// when they would take the queues past `room`.
    fn queue(
        &mut self,
        changes: Vec<(u32, EncodedChange)>,
        done: &Done,
        node_log: bool,
        room: usize,
        touched: &mut Vec<LogId>,
    ) -> Result<(), PersistError> {
        if self.queued + changes.len() > room {
            return Err(PersistError::Backlog {
                queued: self.queued,
            });
        }
        self.queued += changes.len();
        for (shard, change) in changes {
            let id = if node_log {
                LogId::Node
            } else {
                LogId::Group(claimlog::log_of(shard))
            };
            self.logs
                .entry(id)
                .or_default()
                .queue
                .push((change, done.clone()));
            if !touched.contains(&id) {
                touched.push(id);
            }
        }
        Ok(())
    }

    /// A message of log `id` was acknowledged (or failed): its room is free.
    fn acknowledged(&mut self, id: LogId) {
        if let Some(log) = self.logs.get_mut(&id) {
            log.in_flight = log.in_flight.saturating_sub(1);
        }
    }

    /// Takes the next message of log `id` (its queued changes, up to the size
    /// limit), unless the log has as many in flight as it may or nothing waits.
    fn next_message(&mut self, id: LogId) -> Option<(Write, Vec<Done>)> {
        let log = self.logs.get_mut(&id)?;
        if log.in_flight >= LOG_MESSAGES_IN_FLIGHT || log.queue.is_empty() {
            return None;
        }
        let mut bytes = 0;
        let take = log
            .queue
            .iter()
            .take_while(|(change, _)| {
                bytes += change.bytes.len();
                bytes <= claimlog::MAX_MESSAGE_BYTES
            })
            .count()
            .max(1);
        let batch: Vec<(EncodedChange, Done)> = log.queue.drain(..take).collect();
        log.in_flight += 1;
        self.queued -= batch.len();
        self.seq += 1;
        let keep_until = batch
            .iter()
            .map(|(c, _)| c.keep_until_us)
            .max()
            .unwrap_or(0);
        let payload = claimlog::frame(batch.iter().map(|(c, _)| c.bytes.as_slice()));
        metrics::histogram!("ankusa_claim_log_batch").record(batch.len() as f64);
        let key = match id {
            LogId::Node => claimlog::node_log_key(&self.writer, self.seq),
            LogId::Group(group) => claimlog::log_key(group, &self.writer, self.seq),
        };
        let write = Write::put(
            &self.bucket,
            &key,
            payload,
            ttl_secs_until(keep_until, self.clock.now_us()),
        );
        Some((write, batch.into_iter().map(|(_, done)| done).collect()))
    }
}

/// How many times a round waits for a burst still landing.
const LANDING_YIELDS: usize = 4;

/// Publishes writes as they come and completes each once its ack is in; many
/// acks are awaited at once. Claim changes are grouped per log (the node log,
/// or a group log each while `node_log` is off): while a log has its
/// messages in flight, its next changes queue up and leave together when one
/// is acknowledged.
async fn commit_loop(
    inbox: Arc<Inbox>,
    mut logs: ClaimLogs,
    node_log: Arc<AtomicBool>,
    mut rx: mpsc::Receiver<Submitted>,
) {
    let mut acks = FuturesUnordered::new();
    // Exported from the start: `ankusa status` shows it as the node's lag.
    metrics::gauge!("ankusa_kv_writes_in_flight").set(0.0);
    metrics::gauge!("ankusa_kv_writes_queued").set(0.0);
    let mut open = true;
    while open || !acks.is_empty() {
        tokio::select! {
            submitted = rx.recv(), if open && acks.len() < MAX_IN_FLIGHT => {
                let Some(first) = submitted else {
                    open = false;
                    continue;
                };
                // Everything already waiting joins this round, so a burst is grouped;
                // and while a burst is still landing (a batch's items reach their
                // tenants a moment apart), the loop steps aside to let it land.
                let mut ready = Vec::new();
                let mut next = Some(first);
                let mut yields = 0;
                loop {
                    while let Some(Submitted {
                        changes,
                        done,
                        carrying,
                    }) = next.take()
                    {
                        // Switching logs midway is safe: the replay does not
                        // depend on the order of two messages in flight at once.
                        let node_log = node_log.load(Ordering::Relaxed);
                        let count = changes.len();
                        if let Err(refused) =
                            logs.queue(changes, &done, node_log, carrying.room(), &mut ready)
                        {
                            // Requests refused; deferred TATs are not counted.
                            if carrying == Carrying::Requests {
                                metrics::counter!("ankusa_kv_backlog_refusals_total")
                                    .increment(1);
                            }
                            for _ in 0..count {
                                done.settle(&Err(refused.clone()));
                            }
                        }
                        next = rx.try_recv().ok();
                    }
                    if yields == LANDING_YIELDS {
                        break;
                    }
                    yields += 1;
                    tokio::task::yield_now().await;
                    next = rx.try_recv().ok();
                    if next.is_none() {
                        break;
                    }
                }
                for id in ready {
                    send_next(&inbox, &mut logs, id, &mut acks).await;
                }
                metrics::gauge!("ankusa_kv_writes_in_flight").set(acks.len() as f64);
                metrics::gauge!("ankusa_kv_writes_queued").set(logs.queued as f64);
            }
            Some(id) = acks.next(), if !acks.is_empty() => {
                logs.acknowledged(id);
                send_next(&inbox, &mut logs, id, &mut acks).await;
                metrics::gauge!("ankusa_kv_writes_in_flight").set(acks.len() as f64);
                metrics::gauge!("ankusa_kv_writes_queued").set(logs.queued as f64);
            }
        }
    }
}

/// Publishes log `id`'s next message, if it has one to send now, and adds
/// its ack to those awaited.
async fn send_next(
    inbox: &Inbox,
    logs: &mut ClaimLogs,
    id: LogId,
    acks: &mut FuturesUnordered<BoxFuture<'static, LogId>>,
) {
    if let Some((write, waiters)) = logs.next_message(id) {
        let acked = publish_log_message(inbox, write, waiters, id).await;
        acks.push(acked);
    }
}

/// How long a log message's publish, then its ack, is awaited. A message
/// whose ack was lost (its connection dropped, its server restarted) would
/// otherwise hold its log for good (with `async_nats`'s publish, which this
/// loop no longer uses, for its context's 5 s): every later change of the
/// log's shards waits behind it. Its waiters are answered `unavailable` (their callers have given
/// up by then) and the log moves on; replay does not depend on the order
/// of a lost message and the next.
const ACK_WAIT: Duration = Duration::from_secs(1);

/// Publishes one write; the future it returns completes the waiters once the
/// ack is in, and yields the log whose message it was.
async fn publish_log_message(
    inbox: &Inbox,
    write: Write,
    waiters: Vec<Done>,
    log: LogId,
) -> BoxFuture<'static, LogId> {
    // The publish is bounded too: async-nats holds it while the connection
    // reconnects or its write buffer is full, and this loop would stop taking
    // changes and acks meanwhile, and send the message late, after another
    // node may have loaded its shards.
    let published = tokio::time::timeout(ACK_WAIT, write.send(inbox))
        .await
        .unwrap_or(Err(StoreError::Timeout(ACK_WAIT)));
    let sent = std::time::Instant::now();
    async move {
        let result = acked(published, ACK_WAIT)
            .await
            .map(|_| ())
            .map_err(|err| PersistError::Write(err.to_string()));
        metrics::histogram!("ankusa_kv_write_seconds").record(sent.elapsed().as_secs_f64());
        if result.is_err() {
            metrics::counter!("ankusa_kv_write_failures_total").increment(1);
        }
        for done in waiters {
            done.settle(&result);
        }
        log
    }
    .boxed()
}

#[cfg(test)]
mod tests {
    use ankusa_actors::SystemClock;

    use super::*;

    #[test]
    fn changes_submitted_together_are_answered_once_all_are_in() {
        // Three changes, say split over two messages; the second fails.
        let (done, mut answer) = Waiter::new(3);
        done.settle(&Ok(()));
        assert!(answer.try_recv().is_err(), "two changes still out");
        done.settle(&Err(PersistError::Write("no ack".into())));
        assert!(answer.try_recv().is_err(), "one change still out");
        done.settle(&Ok(()));
        assert_eq!(
            answer.try_recv().expect("answered"),
            Err(PersistError::Write("no ack".into())),
            "one failure fails them all"
        );

        let (done, mut answer) = Waiter::new(2);
        done.settle(&Ok(()));
        done.settle(&Ok(()));
        assert_eq!(answer.try_recv().expect("answered"), Ok(()));

        // A waiter dropped with changes out (the writer stopped) is no
        // answer: the submitter reads it as `Stopped`.
        let (done, mut answer) = Waiter::new(2);
        done.settle(&Ok(()));
        drop(done);
        assert!(matches!(
            answer.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        ));
    }

    #[test]
    fn a_log_sends_its_next_message_while_one_awaits_its_ack_but_no_more() {
        let mut logs = ClaimLogs::new("state".into(), Arc::new(SystemClock));
        let queue = |logs: &mut ClaimLogs, n: usize| {
            queue_changes(logs, n).expect("room");
        };
        queue(&mut logs, 3);
        let (_, first) = logs.next_message(LogId::Node).expect("the first leaves");
        assert_eq!(first.len(), 3, "everything queued leaves together");
        queue(&mut logs, 2);
        let (_, second) = logs.next_message(LogId::Node).expect("a second leaves");
        assert_eq!(second.len(), 2);
        queue(&mut logs, 4);
        assert!(
            logs.next_message(LogId::Node).is_none(),
            "a third waits for an ack"
        );
        logs.acknowledged(LogId::Node);
        let (_, third) = logs.next_message(LogId::Node).expect("then it leaves");
        assert_eq!(third.len(), 4, "with everything that waited");
        assert!(logs.next_message(LogId::Node).is_none(), "nothing waits");
    }

    /// Queues `n` one-byte changes on the node log, as one submission.
    fn queue_changes(logs: &mut ClaimLogs, n: usize) -> Result<(), PersistError> {
        queue_changes_within(logs, n, MAX_QUEUED_CHANGES)
    }

    fn queue_changes_within(
        logs: &mut ClaimLogs,
        n: usize,
        room: usize,
    ) -> Result<(), PersistError> {
        let changes = (0..n)
            .map(|_| {
                let change = EncodedChange {
                    bytes: vec![0xc0],
                    keep_until_us: now_unix_us() + 60_000_000,
                };
                (0, change)
            })
            .collect();
        let (done, _) = Waiter::new(n);
        let mut touched = Vec::new();
        logs.queue(changes, &done, true, room, &mut touched)?;
        assert_eq!(touched, [LogId::Node]);
        Ok(())
    }

    #[test]
    fn changes_past_the_backlog_are_refused_whole_until_messages_leave() {
        let mut logs = ClaimLogs::new("state".into(), Arc::new(SystemClock));
        queue_changes(&mut logs, MAX_QUEUED_CHANGES - 1).expect("room");
        assert_eq!(
            queue_changes(&mut logs, 2),
            Err(PersistError::Backlog {
                queued: MAX_QUEUED_CHANGES - 1
            }),
            "a submission is refused whole"
        );
        assert_eq!(logs.queued, MAX_QUEUED_CHANGES - 1, "nothing of it queued");
        queue_changes(&mut logs, 1).expect("the last place");
        let (_, sent) = logs.next_message(LogId::Node).expect("a message leaves");
        assert_eq!(logs.queued, MAX_QUEUED_CHANGES - sent.len());
        queue_changes(&mut logs, sent.len()).expect("room again");
    }

    #[test]
    fn written_behind_tats_leave_the_fuller_half_of_the_queues_to_claims() {
        let mut logs = ClaimLogs::new("state".into(), Arc::new(SystemClock));
        queue_changes_within(&mut logs, BUCKETS_ROOM, BUCKETS_ROOM).expect("TATs up to half");
        assert_eq!(
            queue_changes_within(&mut logs, 1, BUCKETS_ROOM),
            Err(PersistError::Backlog {
                queued: BUCKETS_ROOM
            }),
            "no TAT past half"
        );
        queue_changes(&mut logs, MAX_QUEUED_CHANGES - BUCKETS_ROOM).expect("claims fill the rest");
    }
}
