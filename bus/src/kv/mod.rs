//! Persistence in JetStream KV: claims, bucket TATs, shard leases and node
//! heartbeats of one instance.
//!
//! Three buckets, all with per-message TTL (nats-server ≥ 2.11):
//!
//! | bucket | key | value | TTL |
//! |---|---|---|---|
//! | `ankusa_<instance>_state` | `m.<writer>.<seq>` | a message of a node's log of claim changes and bucket TATs ([`claimlog`]) | until its longest-lived record expires |
//! | | `l.<log>.<writer>.<seq>` | the same, in a log per group of 8 shards, `log = shard / 8` (written while a node of an earlier release is live) | until its longest-lived record expires |
//! | | `c.<shard>.<h128(tenant,source_id,key)>` | [`StoredClaim`] (written before the log; still read) | until the claim expires |
//! | | `b.<shard>.<h128(tenant)>` | [`StoredBuckets`] (written before the log; still read) | until every bucket is full |
//! | `ankusa_<instance>_leases` | `s.<shard>` | [`LeaseValue`] | the lease TTL |
//! | `ankusa_<instance>_nodes` | `<node_id>` | [`Heartbeat`] | the lease TTL |
//!
//! Tenants and keys never appear in a KV key in clear: any bytes are safe.
//! Claims go through [`KvWriter`], a group commit: a node's claim changes
//! queue while its log messages are in flight (two at most) and leave
//! together as the next one, so a burst of hits costs a handful of stored
//! messages, not one each. A caller is answered only once the message holding
//! its change is acknowledged (a node batch's changes are submitted together,
//! and its items answered once every message holding one of them is). Bucket
//! TATs are written behind into the same logs, coalesced to at most one record
//! per tenant per flush interval.
//!
//! This file holds the buckets, what is stored in them and [`FleetKv`]; the
//! submodule `write` holds one write to a KV key and the reading of
//! JetStream's answers, which leases, heartbeats and the claim logs share;
//! `writer` holds the group commit, [`KvWriter`].

mod write;
mod writer;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ankusa_actors::{BucketRecord, ClaimChange, ClaimRecord, Clock, SystemClock, TenantSnapshot};
use async_nats::header;
use async_nats::jetstream::{self, consumer, kv, stream};
use bytes::Bytes;
use futures::{FutureExt, StreamExt, TryStreamExt};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::claimlog::{self, Replay};
use crate::protocol::{decode_frame, encode_named, MESSAGE_ROOM};
use crate::replies::Inbox;
use write::{acked, found_seq, replied, stored_at, Write, WriteError};

pub use writer::KvWriter;

/// Why a KV operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("opening bucket {bucket}: {reason}")]
    Open { bucket: String, reason: String },
    #[error("bucket {bucket} does not exist: no node of this instance has run on this NATS (check the instance name)")]
    Missing { bucket: String },
    #[error("KV request failed: {0}")]
    Request(String),
    #[error("stored value under {key} is unreadable: {reason}")]
    Corrupt { key: String, reason: String },
}

/// Why a lease operation did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    #[error("shard {shard} is leased by {holder}")]
    Taken {
        shard: u32,
        holder: String,
        /// How long until the holder's lease lapses unless renewed (from its
        /// last write and this call's TTL, by the server's clock); `None`
        /// when not known (another node's take raced this one).
        lapses_in: Option<Duration>,
    },
    #[error("the lease on shard {shard} was lost (expired or taken over)")]
    Lost { shard: u32 },
    #[error(transparent)]
    Kv(#[from] KvError),
}

/// A claim as stored: its tenant and record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredClaim {
    pub tenant: String,
    pub claim: ClaimRecord,
}

/// A tenant's bucket TATs as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBuckets {
    pub tenant: String,
    pub buckets: Vec<BucketRecord>,
}

/// Who holds a shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseValue {
    pub node: String,
    pub since_ms: u64,
    /// The writing process's [`FleetKv`]: a node id names a node across its
    /// restarts, this one process. 0 in leases of earlier releases.
    #[serde(default)]
    pub incarnation: u64,
}

/// A node saying it is alive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub node: String,
    pub started_ms: u64,
    /// The node's HTTP endpoint, if it has one, for `ankusa status`.
    pub http: Option<String>,
    /// The newest claim log format the node reads
    /// ([`claimlog::NODE_LOG_FORMAT`]); 0 from nodes of releases before it.
    #[serde(default)]
    pub claim_log_format: u32,
    /// The writing process's [`FleetKv::incarnation`], which tells two
    /// processes given the same node id apart; 0 from earlier releases.
    #[serde(default)]
    pub incarnation: u64,
    /// The instance's shard count the node serves by; 0 from earlier
    /// releases. `ankusa status` checks its own against it.
    #[serde(default)]
    pub shards: u32,
    /// The shards the node held when it wrote this; 0 from earlier releases.
    /// A node that cannot load steps aside only while another serves.
    #[serde(default)]
    pub serving: u32,
    /// The writer's `lease_ttl_ms`, this heartbeat's lifetime: the others
    /// count the node live that long after it, whatever their own TTL, so
    /// that nodes whose timings differ (a rolling change of them) agree on
    /// who is live. 0 from earlier releases: read with the reader's own.
    #[serde(default)]
    pub ttl_ms: u64,
}

/// A change to the heartbeats, as a watch of them delivers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeChange {
    /// A node's heartbeat, first or renewed.
    Beat(Heartbeat),
    /// The node left, or its heartbeat lapsed.
    Gone(String),
}

/// One change from [`FleetKv::watch_nodes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeEvent {
    pub change: NodeChange,
    /// Whether the watch has delivered every heartbeat there was when it began.
    pub caught_up: bool,
}

impl Heartbeat {
    /// Whether every node of `live` reads the node log, so that this one may
    /// write it: whichever takes over a shard must see its changes.
    pub fn all_read_node_log<'a>(live: impl IntoIterator<Item = &'a Heartbeat>) -> bool {
        live.into_iter()
            .all(|beat| beat.claim_log_format >= claimlog::NODE_LOG_FORMAT)
    }
}

fn now_unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

pub fn now_unix_ms() -> u64 {
    now_unix_us() / 1000
}

fn hex128(parts: &[&str]) -> String {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    for part in parts {
        // Length-prefixed, so ("ab","c") and ("a","bc") differ.
        hasher.update(&(part.len() as u64).to_le_bytes());
        hasher.update(part.as_bytes());
    }
    format!("{:032x}", hasher.digest128())
}

/// The KV key of a claim.
pub fn claim_key(shard: u32, tenant: &str, source_id: &str, key: &str) -> String {
    format!("c.{shard}.{}", hex128(&[tenant, source_id, key]))
}

fn lease_key(shard: u32) -> String {
    format!("s.{shard}")
}

/// Per-message TTLs are whole seconds, at least 1; round up so a record never
/// disappears before the state it holds expires. At most a little over the
/// longest any state may live (a bucket of a year's capacity): a record loaded
/// with a wild expiry (a foreign writer's, a corrupt one) must not give its
/// message a TTL the server refuses, taking the other changes with it.
fn ttl_secs_until(expires_us: u64, now_us: u64) -> u64 {
    use ankusa_actors::types::limits::{MAX_CAPACITY_US, MAX_TTL_MS};
    const _: () = assert!(
        MAX_CAPACITY_US >= MAX_TTL_MS * 1000,
        "no claim outlives a bucket"
    );
    const LONGEST_S: u64 = MAX_CAPACITY_US / 1_000_000 + 24 * 3600;
    expires_us
        .saturating_sub(now_us)
        .div_ceil(1_000_000)
        .clamp(1, LONGEST_S)
}

fn encode<T: Serialize>(value: &T) -> Bytes {
    Bytes::from(encode_named(value, MESSAGE_ROOM))
}

/// Reads the value stored under `key`. Every node reads what every other
/// wrote, so a value gets the frame check a request gets: a deeply nested one
/// is refused before serde recurses into it, not a stack overflow.
pub(crate) fn decode<T: DeserializeOwned>(key: &str, payload: &[u8]) -> Result<T, KvError> {
    decode_frame(payload).map_err(|e| KvError::Corrupt {
        key: key.to_string(),
        reason: e.to_string(),
    })
}

fn request_err(e: impl std::fmt::Display) -> KvError {
    KvError::Request(e.to_string())
}

/// Keys a listing reads at once.
const ENTRIES_AT_ONCE: usize = 64;

/// How long a shard load waits for any one answer. A stream that lost its
/// leader (a server of the cluster died) can leave a reader waiting long
/// after the stream is back; failing the load lets the caller retry it on a
/// fresh reader, while a load that streams messages is never cut short.
const LOAD_IDLE: Duration = Duration::from_secs(5);

/// How long a whole shard load may read: a base, and the state bucket's bytes
/// at 10 MB/s, so that a bucket of millions of claims is read to its end
/// rather than cut off, and started again, every time. Every load reads the
/// whole bucket.
pub fn load_bound(bucket_bytes: u64) -> Duration {
    const BASE: Duration = Duration::from_secs(30);
    BASE + Duration::from_millis(bucket_bytes / (LOAD_BYTES_PER_SEC / 1_000))
}

/// The slowest read a load is given time for: a tenth of what one nats-server
/// on the benchmarks' 2-vCPU host delivered to a load.
const LOAD_BYTES_PER_SEC: u64 = 10_000_000;

/// Runs one KV call within `bound`. A call on a connection that dropped
/// midway (a key listing, an ordered consumer) may never finish; it fails
/// instead, counted in `ankusa_kv_call_timeouts_total`, and its caller retries.
pub async fn within<T, E: From<KvError>>(
    bound: Duration,
    call: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, E> {
    tokio::time::timeout(bound, call).await.unwrap_or_else(|_| {
        metrics::counter!("ankusa_kv_call_timeouts_total").increment(1);
        Err(KvError::Request(format!("no answer within {bound:?}")).into())
    })
}

/// How long a lease or heartbeat write waits for its ack: what `async_nats`'s
/// JetStream context allowed, before these writes came to an [`Inbox`].
/// Callers bound them more tightly (a lease's TTL).
const KV_WRITE_WAIT: Duration = Duration::from_secs(5);

/// A lease write refused for its revision is a lease lost; anything else is
/// the write failing.
fn lost_or(shard: u32, err: WriteError) -> LeaseError {
    if err.is_wrong_revision() {
        LeaseError::Lost { shard }
    } else {
        request_err(err).into()
    }
}

/// One step of a shard load, within [`LOAD_IDLE`].
async fn load_step<T, E: std::fmt::Display>(
    step: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, KvError> {
    within(LOAD_IDLE, step.map(|r| r.map_err(request_err))).await
}

/// The KV buckets of one instance.
#[derive(Clone)]
pub struct FleetKv {
    js: jetstream::Context,
    /// Every write (claim-log messages, leases, heartbeats) awaits its ack
    /// here, not in `async_nats`'s request, which keeps a slot for every ack
    /// that never comes: a node renews each lease it holds every second, and
    /// would grow by one slot a lease a second for as long as JetStream could
    /// not answer.
    writes: Arc<Inbox>,
    state_bucket: String,
    leases_bucket: String,
    nodes_bucket: String,
    leases: kv::Store,
    nodes: kv::Store,
    /// Random and never 0; written into every lease taken or renewed here.
    incarnation: u64,
    /// The time claims and buckets are kept by: their expiries, and the TTLs
    /// of the messages that hold them, are read against it.
    clock: Arc<dyn Clock>,
}

impl FleetKv {
    /// Opens (creating when missing) the instance's buckets.
    pub async fn open(
        client: async_nats::Client,
        instance: &str,
        replicas: usize,
    ) -> Result<Self, KvError> {
        Self::open_with(client, instance, Some(replicas)).await
    }

    /// Opens the instance's buckets only if they exist: for tools that look,
    /// so that a mistyped instance name is an error, not three new buckets.
    pub async fn bind(client: async_nats::Client, instance: &str) -> Result<Self, KvError> {
        Self::open_with(client, instance, None).await
    }

    /// `create`: the replicas to create missing buckets with, or `None` to
    /// refuse missing buckets.
    async fn open_with(
        client: async_nats::Client,
        instance: &str,
        create: Option<usize>,
    ) -> Result<Self, KvError> {
        let writes = Arc::new(Inbox::new(client.clone()));
        let js = crate::connect::jetstream(client);
        let state_bucket = format!("ankusa_{instance}_state");
        let leases_bucket = format!("ankusa_{instance}_leases");
        let nodes_bucket = format!("ankusa_{instance}_nodes");
        // Nobody watches the state bucket, and a load skips markers: there an
        // expiry marker would only be one more stored message, and one more
        // expiry, for every claim-log message (docs/benchmarks-history.md, session 22).
        // The nodes' watch learns of a dead node from its heartbeat's marker.
        let state = BucketSpec {
            name: &state_bucket,
            description: "ankusa-fleet claims and bucket TATs",
            expiry_markers: None,
        };
        let leases = BucketSpec {
            name: &leases_bucket,
            description: "ankusa-fleet shard leases",
            expiry_markers: Some(EXPIRY_MARKER_TTL),
        };
        let nodes = BucketSpec {
            name: &nodes_bucket,
            description: "ankusa-fleet node heartbeats",
            expiry_markers: Some(EXPIRY_MARKER_TTL),
        };
        open_bucket(&js, &state, create).await?;
        let leases = open_bucket(&js, &leases, create).await?;
        let nodes = open_bucket(&js, &nodes, create).await?;
        Ok(Self {
            js,
            writes,
            state_bucket,
            leases_bucket,
            nodes_bucket,
            leases,
            nodes,
            incarnation: rand::random::<u64>() | 1,
            clock: Arc::new(SystemClock),
        })
    }

    /// Keeps time by `clock` instead of the system's: a node's own, so that
    /// what it stores and what its actors decide agree.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    fn now_us(&self) -> u64 {
        self.clock.now_us()
    }

    /// Each of the instance's buckets with its replica count, as JetStream
    /// reports it now.
    pub async fn bucket_replicas(&self) -> Result<Vec<(String, usize)>, KvError> {
        let mut out = Vec::new();
        for bucket in [&self.state_bucket, &self.leases_bucket, &self.nodes_bucket] {
            let store = self
                .js
                .get_key_value(bucket)
                .await
                .map_err(|e| open_error(bucket, e))?;
            out.push((bucket.clone(), replicas_of(&store)));
        }
        Ok(out)
    }

    async fn publish(&self, write: Write) -> Result<u64, WriteError> {
        acked(write.send(&self.writes).await, KV_WRITE_WAIT).await
    }

    /// Writes (claim-log messages, leases, heartbeats) waiting for their acks now.
    pub fn awaiting_acks(&self) -> usize {
        self.writes.waiting()
    }

    /// The value of a lease `node` takes or renews through this `FleetKv`.
    fn lease_value(&self, node: &str) -> Bytes {
        encode(&LeaseValue {
            node: node.to_string(),
            since_ms: self.now_us() / 1000,
            incarnation: self.incarnation,
        })
    }

    /// Takes the lease on `shard` for `node` if nobody holds it, or if the
    /// lease there was written through this very `FleetKv` (see below).
    /// Returns its revision.
    pub async fn acquire_lease(
        &self,
        shard: u32,
        node: &str,
        ttl: Duration,
    ) -> Result<u64, LeaseError> {
        let key = lease_key(shard);
        let value = self.lease_value(node);
        let ttl_secs = ttl.as_secs().max(1);
        let fresh =
            Write::put(&self.leases_bucket, &key, value.clone(), ttl_secs).expect_revision(0);
        match self.publish(fresh).await {
            Ok(revision) => return Ok(revision),
            Err(err) if err.is_wrong_revision() => {}
            Err(err) => return Err(request_err(err).into()),
        }
        // Something is there: a holder, or the marker a release or expiry left.
        let entry = self.leases.entry(&key).await.map_err(request_err)?;
        match entry {
            // Our own write, whose ack we never read: a renewal or a take
            // that waited in a paused or cut-off server and landed after we
            // had let the shard go. It is taken over at that revision instead
            // of waited out for a whole TTL.
            Some(entry) if self.written_here(node, &key, &entry) => {
                self.adopt(shard, node, ttl_secs, entry.revision).await
            }
            Some(entry) if entry.operation == kv::Operation::Put => {
                let written_us = u64::try_from(entry.created.unix_timestamp_nanos() / 1000);
                let lapses_us = written_us.map(|at| at.saturating_add(ttl_secs * 1_000_000));
                Err(LeaseError::Taken {
                    shard,
                    holder: decode::<LeaseValue>(&key, &entry.value)
                        .map_or_else(|_| "an unreadable holder".into(), |lease| lease.node),
                    lapses_in: lapses_us
                        .ok()
                        .map(|at| Duration::from_micros(at.saturating_sub(self.now_us()))),
                })
            }
            Some(marker) => {
                self.take_over(shard, value, ttl_secs, marker.revision)
                    .await
            }
            None => Err(LeaseError::Taken {
                shard,
                holder: "another node (raced)".into(),
                lapses_in: None,
            }),
        }
    }

    /// Writes the lease `value` over what is at `revision` (a marker, or our
    /// own lease); a write in between is another node's take.
    async fn take_over(
        &self,
        shard: u32,
        value: Bytes,
        ttl_secs: u64,
        revision: u64,
    ) -> Result<u64, LeaseError> {
        let over = Write::put(&self.leases_bucket, &lease_key(shard), value, ttl_secs)
            .expect_revision(revision);
        self.publish(over).await.map_err(|err| match err {
            err if err.is_wrong_revision() => LeaseError::Taken {
                shard,
                holder: "another node (raced)".into(),
                lapses_in: None,
            },
            err => request_err(err).into(),
        })
    }

    /// Extends our lease (compare-and-set on its revision). Returns the new revision.
    pub async fn renew_lease(
        &self,
        shard: u32,
        node: &str,
        revision: u64,
        ttl: Duration,
    ) -> Result<u64, LeaseError> {
        let value = self.lease_value(node);
        let write = Write::put(
            &self.leases_bucket,
            &lease_key(shard),
            value,
            ttl.as_secs().max(1),
        )
        .expect_revision(revision);
        match self.publish(write).await {
            Ok(revision) => Ok(revision),
            // The revision moved: another node's take, or our own earlier
            // renewal whose ack we never read (lost in a reconnect), which
            // is adopted as `acquire_lease` adopts it.
            Err(err) if err.is_wrong_revision() => {
                let key = lease_key(shard);
                let entry = self.leases.entry(&key).await.map_err(request_err)?;
                match entry {
                    Some(entry) if self.written_here(node, &key, &entry) => self
                        .adopt(shard, node, ttl.as_secs().max(1), entry.revision)
                        .await
                        .map_err(|err| match err {
                            LeaseError::Taken { shard, .. } => LeaseError::Lost { shard },
                            err => err,
                        }),
                    _ => Err(LeaseError::Lost { shard }),
                }
            }
            Err(err) => Err(request_err(err).into()),
        }
    }

    /// Whether `entry` is a lease `node` wrote through this very `FleetKv`.
    /// Nobody else can have held the lease since such a write (a write of
    /// theirs would have moved the revision). The incarnation, not the node
    /// id, says it is ours: another process under the same id (a restart, a
    /// paused zombie) waits it out.
    fn written_here(&self, node: &str, key: &str, entry: &kv::Entry) -> bool {
        entry.operation == kv::Operation::Put
            && decode::<LeaseValue>(key, &entry.value)
                .is_ok_and(|lease| lease.node == node && lease.incarnation == self.incarnation)
    }

    /// Takes over, at `revision`, a lease [written here](Self::written_here).
    async fn adopt(
        &self,
        shard: u32,
        node: &str,
        ttl_secs: u64,
        revision: u64,
    ) -> Result<u64, LeaseError> {
        let adopted = self
            .take_over(shard, self.lease_value(node), ttl_secs, revision)
            .await?;
        metrics::counter!("ankusa_leases_adopted_total").increment(1);
        Ok(adopted)
    }

    /// Gives a lease up, if it is still ours: at `revision`, or at a later
    /// one this process wrote (a renewal whose ack a reconnect lost), which
    /// would otherwise hold the shard from its next owner until its TTL.
    pub async fn release_lease(
        &self,
        shard: u32,
        node: &str,
        revision: u64,
    ) -> Result<(), LeaseError> {
        let key = lease_key(shard);
        let purge = |revision| Write::purge(&self.leases_bucket, &key).expect_revision(revision);
        match self.publish(purge(revision)).await {
            Ok(_) => Ok(()),
            Err(err) if err.is_wrong_revision() => {
                match self.leases.entry(&key).await.map_err(request_err)? {
                    Some(entry) if self.written_here(node, &key, &entry) => self
                        .publish(purge(entry.revision))
                        .await
                        .map(|_| ())
                        .map_err(|err| lost_or(shard, err)),
                    _ => Err(LeaseError::Lost { shard }),
                }
            }
            Err(err) => Err(request_err(err).into()),
        }
    }

    /// Who holds each leased shard.
    pub async fn lease_holders(&self) -> Result<HashMap<u32, String>, KvError> {
        let mut holders = HashMap::new();
        for (key, value) in self.live_entries(&self.leases).await? {
            let Some(shard) = key.strip_prefix("s.").and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if let Ok(lease) = decode::<LeaseValue>(&key, &value) {
                holders.insert(shard, lease.node);
            }
        }
        Ok(holders)
    }

    /// Says `node` is alive for `ttl`; returns the heartbeat's revision.
    /// This process's mark, random and never 0: written into every lease
    /// and heartbeat it writes.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    pub async fn heartbeat(&self, beat: &Heartbeat, ttl: Duration) -> Result<u64, KvError> {
        let write = Write::put(
            &self.nodes_bucket,
            &beat.node,
            encode(beat),
            ttl.as_secs().max(1),
        );
        self.publish(write).await.map_err(request_err)
    }

    /// When the server stored revision `revision` of the nodes bucket (a
    /// heartbeat just written), in unix µs by the stream leader's clock. Asked
    /// of the leader (a stream message get), which has every acknowledged
    /// write, where a direct get may be answered by a replica that lags.
    /// Read through this `FleetKv`'s inbox, like its writes, so that a read
    /// never answered leaves nothing behind.
    pub async fn heartbeat_stored_at(&self, revision: u64) -> Result<u64, KvError> {
        let subject = format!("$JS.API.STREAM.MSG.GET.KV_{}", self.nodes_bucket);
        let ask = Bytes::from(format!("{{\"seq\":{revision}}}"));
        let asked = self.writes.request(subject.into(), None, ask).await;
        let answer = replied(asked, KV_WRITE_WAIT).await.map_err(request_err)?;
        stored_at(&answer.payload, revision)
    }

    /// Whether the state stream's leader holds a message in `(read_to,
    /// up_to]`: a load that has read to `read_to` must read on to be current
    /// as of `up_to`. Asked of the leader, which has every acknowledged write,
    /// because a load's consumer may be placed on a replica that lags (the
    /// meta leader places it, not the stream leader): its count of messages
    /// left can reach 0 before the last ones it has yet to apply.
    pub async fn leader_holds_past(&self, read_to: u64, up_to: u64) -> Result<bool, KvError> {
        if read_to >= up_to {
            return Ok(false);
        }
        let subject = format!("$JS.API.STREAM.MSG.GET.KV_{}", self.state_bucket);
        let ask = Bytes::from(format!(
            "{{\"seq\":{},\"next_by_subj\":\"$KV.{}.>\"}}",
            read_to + 1,
            self.state_bucket
        ));
        let asked = self.writes.request(subject.into(), None, ask).await;
        let answer = replied(asked, KV_WRITE_WAIT).await.map_err(request_err)?;
        Ok(found_seq(&answer.payload)?.is_some_and(|seq| seq <= up_to))
    }

    /// Says `node` has left.
    pub async fn leave(&self, node: &str) -> Result<(), KvError> {
        self.publish(Write::purge(&self.nodes_bucket, node))
            .await
            .map(|_| ())
            .map_err(request_err)
    }

    /// Every node's latest heartbeat, then each change to them (joins,
    /// renewals, leaves and lapses), for as long as the watch lasts. One
    /// consumer for the watch's life, where [`Self::live_nodes`] makes one a
    /// call.
    pub async fn watch_nodes(
        &self,
    ) -> Result<impl futures::Stream<Item = Result<NodeEvent, KvError>> + Send, KvError> {
        let watch = self
            .nodes
            .watch_with_history(">")
            .await
            .map_err(request_err)?;
        Ok(watch.map(|entry| {
            let entry = entry.map_err(request_err)?;
            let change = match entry.operation {
                kv::Operation::Put => NodeChange::Beat(decode(&entry.key, &entry.value)?),
                kv::Operation::Delete | kv::Operation::Purge => NodeChange::Gone(entry.key),
            };
            Ok(NodeEvent {
                change,
                caught_up: entry.delta == 0,
            })
        }))
    }

    /// Every node whose heartbeat is live.
    pub async fn live_nodes(&self) -> Result<Vec<Heartbeat>, KvError> {
        let mut nodes = Vec::new();
        for (key, value) in self.live_entries(&self.nodes).await? {
            if let Ok(beat) = decode::<Heartbeat>(&key, &value) {
                nodes.push(beat);
            }
        }
        nodes.sort_by(|a, b| a.node.cmp(&b.node));
        Ok(nodes)
    }

    async fn live_entries(&self, store: &kv::Store) -> Result<Vec<(String, Bytes)>, KvError> {
        let mut out = Vec::new();
        let mut keys = store.keys().await.map_err(request_err)?;
        let mut names = Vec::new();
        while let Some(key) = keys.next().await {
            names.push(key.map_err(request_err)?);
        }
        // Many reads at once: one after another, the 4,096 leases of the
        // largest instance at a 3 ms round trip took 12 s, past the bound a
        // listing is given (`ankusa status`, a node's membership listing).
        let mut entries = futures::stream::iter(names)
            .map(|key| async move {
                let entry = store.entry(&key).await.map_err(request_err)?;
                Ok::<_, KvError>((key, entry))
            })
            .buffered(ENTRIES_AT_ONCE);
        while let Some((key, entry)) = entries.try_next().await? {
            if let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) {
                out.push((key, entry.value));
            }
        }
        Ok(out)
    }

    /// A shard's persisted state: every live claim and bucket of its tenants.
    pub async fn load_shard(&self, shard: u32) -> Result<Vec<TenantSnapshot>, KvError> {
        let mut loaded = self.load_shards(&[shard]).await?;
        Ok(loaded.remove(&shard).unwrap_or_default())
    }

    /// Several shards' persisted state, read in one pass. Every shard asked
    /// for has an entry.
    ///
    /// Reads every key of the state bucket in stream order, and keeps these
    /// shards' changes: the claim logs (see [`claimlog`]), the bucket keys and
    /// the one-key-per-claim records that nodes before the log wrote
    /// (`c.<shard>.*`), so such a node's claims survive an upgrade. A value
    /// that cannot be read is skipped, logged and counted
    /// (`ankusa_state_unreadable_total`), not a failed load. A node
    /// log message may hold any shard's changes. Filters do not pay: one pass
    /// over the bucket took nats-server less CPU than one filtered load per
    /// shard (docs/benchmarks-history.md, session 20), and JetStream refuses filters
    /// that overlap.
    pub async fn load_shards(
        &self,
        shards: &[u32],
    ) -> Result<HashMap<u32, Vec<TenantSnapshot>>, KvError> {
        if shards.is_empty() {
            return Ok(HashMap::new());
        }
        let stream = load_step(self.js.get_stream(format!("KV_{}", self.state_bucket))).await?;
        let prefix = format!("$KV.{}.", self.state_bucket);
        let consumer = stream.create_consumer(consumer::pull::OrderedConfig {
            // Every key holds one message (history 1): all of them, in the
            // order they were stored, which is the order the log replays in.
            deliver_policy: consumer::DeliverPolicy::All,
            ..Default::default()
        });
        let mut consumer = load_step(consumer).await?;
        let info = load_step(consumer.info()).await?;
        let mut state = Replay::new(shards.iter().copied());
        // The server would reap the consumer once idle; until then it is sent every
        // write to the stream, so it goes as soon as the load is done.
        let mut reader = info.name.clone();
        // The leader's last message when the load began (its stream info): every
        // write acknowledged before, an earlier owner's last commits among them,
        // is at or below it, and the load is current once it has read that far.
        let current_at = stream.cached_info().state.last_sequence;
        if info.num_pending == 0 && !self.leader_holds_past(0, current_at).await? {
            let _ = stream.delete_consumer(&reader).await;
            return Ok(state.finish(self.now_us()));
        }
        let now_us = self.now_us();
        let bound = load_bound(stream.cached_info().state.bytes);
        let read = within(bound, async {
            let mut messages = load_step(consumer.messages()).await?;
            while let Some(message) =
                within(LOAD_IDLE, messages.next().map(Ok::<_, KvError>)).await?
            {
                let message = message.map_err(request_err)?;
                // Without it the load cannot tell whether this was the last
                // message, and stopping here would serve a partial replay: claims
                // missing, committed ones among them. The caller retries a failed load.
                let info = message.info().map_err(|e| {
                    KvError::Request(format!(
                        "a state bucket message came without its delivery info ({e}), so the load \
                     cannot tell whether it has read every message"
                    ))
                })?;
                // An ordered consumer may be recreated under a new name midway.
                if info.consumer != reader {
                    reader = info.consumer.to_string();
                }
                let left = info.pending;
                let is_value = message
                    .headers
                    .as_ref()
                    .map(|h| {
                        h.get("KV-Operation").is_none()
                            && h.get(header::NATS_MARKER_REASON).is_none()
                    })
                    .unwrap_or(true);
                if is_value && !message.payload.is_empty() {
                    let key = message
                        .subject
                        .strip_prefix(prefix.as_str())
                        .unwrap_or_default();
                    match replay_value(&mut state, key, &message.payload, now_us) {
                        Ok(()) => {}
                        // Skipped, not fatal: every load reads every message, so
                        // one unreadable message (garbage from anyone who may
                        // write the bucket, a bug) would stop every shard load of
                        // the fleet until its TTL ran out. Skipping keeps "never
                        // Duplicate for a hook that was not committed": a message
                        // not read can only take away what it held (commits, whose
                        // hooks may then be delivered twice; releases; bucket
                        // TATs and resets), and nothing it held can commit a claim.
                        Err(KvError::Corrupt { key, reason }) => skip_unreadable(&key, &reason),
                        Err(err) => return Err(err),
                    }
                }
                // Read up to where the stream ended when the load began: what
                // is written after is no earlier owner's (it had let the shard
                // go), and a busy bucket would keep the load chasing its tail.
                if info.stream_sequence >= current_at {
                    return Ok(());
                }
                // Nothing left on the consumer's server, which may lag the
                // leader: done only if the leader holds nothing more either;
                // else the rest comes once that server has it (or the load
                // times out and is retried).
                if left == 0
                    && !self
                        .leader_holds_past(info.stream_sequence, current_at)
                        .await?
                {
                    return Ok(());
                }
            }
            // The consumer's stream ended before its last message (its
            // subscription closed): serving what was read would serve a partial
            // replay, committed claims missing.
            Err(KvError::Request(
                "the load's messages ended before the last one; the load is retried".into(),
            ))
        })
        .await;
        let _ = stream.delete_consumer(&reader).await;
        read?;
        Ok(state.finish(now_us))
    }
}

/// Applies one value of the state bucket, stored under `key`, to `state`.
fn replay_value(state: &mut Replay, key: &str, payload: &[u8], now_us: u64) -> Result<(), KvError> {
    // `c.<shard>.*` and `b.<shard>.*` name their shard; the replay skips the
    // shards it was not asked for.
    let key_shard = || {
        key.split('.')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(u32::MAX)
    };
    if key.starts_with("m.") || key.starts_with("l.") {
        state.apply_message(key, payload, now_us)?;
    } else if key.starts_with("c.") {
        let stored: StoredClaim = decode(key, payload)?;
        let change = ClaimChange::Put(stored.claim);
        state.apply(key_shard(), stored.tenant, change, now_us);
    } else if key.starts_with("b.") {
        let stored: StoredBuckets = decode(key, payload)?;
        state.apply_buckets(key_shard(), &stored.tenant, &stored.buckets);
    }
    Ok(())
}

/// Says that a load skipped the unreadable message under `key`, and counts it
/// in `ankusa_state_unreadable_total`.
fn skip_unreadable(key: &str, reason: &str) {
    metrics::counter!("ankusa_state_unreadable_total").increment(1);
    tracing::error!(
        key,
        reason,
        "unreadable message in the state bucket (or changes of one), skipped: the claims \
         and bucket TATs they held are not restored, so a resent hook they had committed \
         may be delivered again (no hook is ever answered duplicate without a commit) and \
         their tenants may get up to a burst more; each load skips them until the \
         message's TTL runs out"
    );
}

/// How long the marker an expired lease or heartbeat leaves is kept.
const EXPIRY_MARKER_TTL: Duration = Duration::from_secs(1);

/// One KV bucket of an instance, as this release creates it.
struct BucketSpec<'a> {
    name: &'a str,
    description: &'a str,
    /// How long JetStream keeps the marker it writes when a key expires, or
    /// `None` for no markers.
    expiry_markers: Option<Duration>,
}

impl BucketSpec<'_> {
    /// The bucket's stream: what async-nats's `create_key_value` makes
    /// (history 1, per-message TTLs), with the markers chosen per bucket,
    /// which `create_key_value` ties to per-message TTLs.
    fn stream(&self, replicas: usize) -> stream::Config {
        stream::Config {
            name: format!("KV_{}", self.name),
            description: Some(self.description.to_string()),
            subjects: vec![format!("$KV.{}.>", self.name)],
            max_messages_per_subject: 1,
            max_message_size: 64 * 1024,
            storage: stream::StorageType::File,
            num_replicas: replicas.max(1),
            discard: stream::DiscardPolicy::New,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            allow_message_ttl: true,
            subject_delete_marker_ttl: self.expiry_markers,
            ..Default::default()
        }
    }
}

async fn open_bucket(
    js: &jetstream::Context,
    spec: &BucketSpec<'_>,
    create: Option<usize>,
) -> Result<kv::Store, KvError> {
    let bucket = spec.name;
    let replicas = match (js.get_key_value(bucket).await, create) {
        (Ok(store), create) => {
            if let Some(replicas) = create {
                check_replicas(&store, replicas);
                check_expiry_markers(&store, spec);
            }
            return Ok(store);
        }
        (Err(_), Some(replicas)) => replicas,
        (Err(err), None) if is_missing_stream(&err) => {
            return Err(KvError::Missing {
                bucket: bucket.to_string(),
            })
        }
        (Err(err), None) => return Err(open_error(bucket, err)),
    };
    // Creating a stream that exists with the same configuration succeeds, so
    // nodes starting together all get here; one whose configuration differs
    // (another release's) fails, and the bucket is then used as it is.
    let created = js.create_stream(spec.stream(replicas)).await;
    let store = match js.get_key_value(bucket).await {
        Ok(store) => store,
        Err(open_err) => {
            return Err(match created {
                Err(create_err) => open_error(bucket, create_err),
                Ok(_) => open_error(bucket, open_err),
            })
        }
    };
    check_replicas(&store, replicas);
    check_expiry_markers(&store, spec);
    Ok(store)
}

/// Says when a bucket's expiry markers are not the ones this release creates
/// it with: a state bucket created before session 22 has them, and pays a
/// second stored message for every claim-log message that expires.
fn check_expiry_markers(store: &kv::Store, spec: &BucketSpec<'_>) {
    let actual = store.stream.cached_info().config.subject_delete_marker_ttl;
    if actual != spec.expiry_markers {
        tracing::warn!(
            bucket = %store.name,
            actual = ?actual,
            wanted = ?spec.expiry_markers,
            "the KV bucket's expiry markers (subject_delete_marker_ttl) are not the ones \
             this release creates it with; it is used as it is (change it by editing the \
             stream's configuration: `nats stream info {} --json`, then `nats stream edit`)",
            store.stream_name,
        );
    }
}

fn open_error(bucket: &str, err: impl std::fmt::Display) -> KvError {
    KvError::Open {
        bucket: bucket.to_string(),
        reason: err.to_string(),
    }
}

/// The replica count of a bucket's stream, as JetStream reported it when the
/// bucket was opened.
fn replicas_of(store: &kv::Store) -> usize {
    store.stream.cached_info().config.num_replicas
}

/// Whether getting a bucket failed because its stream does not exist (and not
/// because JetStream did not answer).
fn is_missing_stream(err: &jetstream::context::KeyValueError) -> bool {
    use jetstream::context::{GetStreamError, GetStreamErrorKind};
    std::error::Error::source(err)
        .and_then(|source| source.downcast_ref::<GetStreamError>())
        .is_some_and(|get| {
            matches!(get.kind(), GetStreamErrorKind::JetStream(e)
                if e.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
        })
}

/// A bucket keeps the replica count it was created with: a node configured
/// for more does not change it (operators do, with `nats stream edit`), so it
/// says so, and exports the count, instead of running with less redundancy
/// than its operator believes.
fn check_replicas(store: &kv::Store, configured: usize) {
    let actual = replicas_of(store);
    metrics::gauge!("ankusa_kv_bucket_replicas", "bucket" => store.name.clone()).set(actual as f64);
    if actual != configured.max(1) {
        tracing::warn!(
            bucket = %store.name,
            actual,
            configured,
            "the KV bucket exists with {actual} replica(s), not the {configured} configured; \
             it is used as it is (change it with `nats stream edit {} --replicas {configured}`)",
            store.stream_name,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_ttl_is_whole_seconds_rounded_up_and_bounded() {
        const NOW: u64 = 1_700_000_000_000_000;
        assert_eq!(ttl_secs_until(NOW - 5, NOW), 1, "at least a second");
        assert_eq!(ttl_secs_until(NOW + 1_000_001, NOW), 2);
        let year = ttl_secs_until(NOW + ankusa_actors::types::limits::MAX_CAPACITY_US, NOW);
        assert_eq!(ttl_secs_until(u64::MAX, NOW), year + 24 * 3600);
    }

    /// Nodes of this release and of earlier ones read each other's leases: an
    /// earlier lease has no incarnation (0, which no `FleetKv` writes), and
    /// an earlier node's reader skips the field it does not know.
    #[test]
    fn leases_read_across_releases() {
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        struct EarlierLease {
            node: String,
            since_ms: u64,
        }
        let earlier = encode(&EarlierLease {
            node: "n1".into(),
            since_ms: 7,
        });
        assert_eq!(
            decode::<LeaseValue>("s.1", &earlier),
            Ok(LeaseValue {
                node: "n1".into(),
                since_ms: 7,
                incarnation: 0,
            })
        );
        let now = encode(&LeaseValue {
            node: "n2".into(),
            since_ms: 9,
            incarnation: 12345,
        });
        assert_eq!(
            decode::<EarlierLease>("s.1", &now),
            Ok(EarlierLease {
                node: "n2".into(),
                since_ms: 9,
            })
        );
    }

    /// Heartbeats and leases are written by other nodes and read by every
    /// one: a value nested too deep is refused before serde recurses into it.
    #[test]
    fn a_deeply_nested_value_is_corrupt_not_a_stack_overflow() {
        let mut nested = b"\x81\xa4node".to_vec();
        nested.resize(100_000, 0x91);
        nested.push(0xc0);
        match decode::<Heartbeat>("n1", &nested) {
            Err(KvError::Corrupt { key, reason }) => {
                assert_eq!(key, "n1");
                assert!(reason.contains("nested deeper"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// One unreadable value of the state bucket is the load's to skip: every
    /// kind of key reports it as `Corrupt`, and applies nothing.
    #[test]
    fn an_unreadable_state_value_is_corrupt_whatever_its_key() {
        let mut state = Replay::new([3]);
        for key in ["m.w.1", "l.0.w.1", "c.3.00ff", "b.3.00ff"] {
            assert!(
                matches!(
                    replay_value(&mut state, key, b"\xc1 garbage", 1),
                    Err(KvError::Corrupt { .. })
                ),
                "{key}"
            );
        }
        // Keys of no known shape are not the load's.
        assert_eq!(replay_value(&mut state, "x.3", b"\xc1", 1), Ok(()));
        assert_eq!(state.finish(1)[&3], Vec::new());
    }

    #[test]
    fn a_load_is_given_time_for_the_whole_bucket() {
        assert_eq!(load_bound(0), Duration::from_secs(30));
        // A gigabyte: 10 million claims or so.
        assert_eq!(load_bound(1_000_000_000), Duration::from_secs(130));
    }

    fn beat(node: &str, claim_log_format: u32) -> Heartbeat {
        Heartbeat {
            node: node.into(),
            started_ms: 1,
            http: None,
            claim_log_format,
            incarnation: 7,
            shards: 64,
            serving: 3,
            ttl_ms: 5_000,
        }
    }

    #[test]
    fn a_heartbeat_of_an_earlier_release_reads_as_group_log_only() {
        /// The heartbeat as nodes before the node log wrote it.
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        struct Earlier {
            node: String,
            started_ms: u64,
            http: Option<String>,
        }
        let earlier = encode(&Earlier {
            node: "old".into(),
            started_ms: 1,
            http: None,
        });
        let read: Heartbeat = decode("old", &earlier).expect("decodes");
        assert_eq!(
            read,
            Heartbeat {
                incarnation: 0,
                shards: 0,
                serving: 0,
                ttl_ms: 0,
                ..beat("old", 0)
            }
        );
        // And an earlier node reads this release's heartbeat: the new fields
        // are ones it ignores.
        let now = encode(&beat("new", claimlog::NODE_LOG_FORMAT));
        let read: Earlier = decode("new", &now).expect("decodes");
        assert_eq!(read.node, "new");
    }

    #[test]
    fn the_node_log_is_written_only_when_every_live_node_reads_it() {
        let format = claimlog::NODE_LOG_FORMAT;
        assert!(Heartbeat::all_read_node_log(&[
            beat("a", format),
            beat("b", format)
        ]));
        assert!(!Heartbeat::all_read_node_log(&[
            beat("a", format),
            beat("b", 0)
        ]));
        assert!(!Heartbeat::all_read_node_log(&[beat("a", 1)]));
    }
}
