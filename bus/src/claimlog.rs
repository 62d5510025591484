//! The claim log: how a shard's claim changes are stored, many to a message, and
//! read back.
//!
//! Claims are not one KV key each. A node writes its claim changes as a log: each
//! message holds every change the node made since its last message was
//! acknowledged (a group commit), under a KV key of its own with a TTL as long
//! as its longest-lived change. A burst of hits is then a handful of stored
//! messages, not one each, which is what JetStream's per-message cost makes the
//! limit of a node's throughput. There are two layouts; every node reads both:
//!
//! - **The node log** ([`NODE_LOG_FORMAT`]), `m.<writer>.<seq>`: one log per
//!   node, whatever shards its changes are for. A node writes it once every
//!   live node says it reads it (its heartbeat's `claim_log_format`), so that
//!   a node of an earlier release running beside it never takes over a shard
//!   whose *new* changes it cannot see. One that joins later (a rollback, a
//!   canary) cannot see the node-log messages written before it came: see
//!   the upgrade notes in docs/operations.md.
//! - **The group log** ([`GROUP_LOG_FORMAT`]), `l.<log>.<writer>.<seq>`: a log
//!   per group of [`SHARDS_PER_LOG`] consecutive shards, each with its own
//!   messages in flight. A node spreads its shards over every group, so its messages
//!   were a fraction as full as the node log's.
//!
//! Any message may hold any shard's changes, so a load reads every message of
//! the bucket and keeps its shards' (see `FleetKv::load_shards`).
//!
//! The payload is a MessagePack array of [`LoggedChange`] records, each an
//! array of its fields in order (the compact form of `docs/protocol.md` §3):
//! `[tenant, shard, {"Put": ClaimRecord} | {"Delete": [..]}, []]` for a claim
//! change, `[tenant, shard, nil, [BucketRecord, ..]]` for the bucket TATs a
//! node writes behind (a TAT of 0 is a reset); a `ClaimRecord` is
//! `[source_id, key, hook_id, node, committed, expires_us]`. It is half the
//! bytes of the map form, which releases before session 22 wrote and every
//! release reads; those releases read this form too, as serde's derived
//! decoders read a record sent as an array of its fields.
//!
//! [`Replay`] applies the logs' messages in stream order to rebuild the claims
//! and buckets of the shards being loaded, skipping the other shards' changes.
//! A bucket's last record wins.
//! Two rules make the replay safe against writes that land late (a paused node
//! waking up with writes still in its socket):
//! - a pending claim never replaces a live committed one;
//! - a release deletes only the pending claim of the hook that made it, and
//!   only the claim it cancelled or an earlier one (by expiry: a claim made
//!   again expires later), never one the hook made after it.
//!
//! Neither can turn a claim that was not committed into a committed one, so a
//! replayed log never answers `Duplicate` for a hook that was not stored.

use std::collections::HashMap;

use ankusa_actors::{BucketRecord, ClaimChange, ClaimRecord, Kind, TenantSnapshot};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::kv::KvError;
use crate::protocol::{self, encode_compact};

/// Shards whose changes share a group log: `log = shard / SHARDS_PER_LOG`.
/// Part of the stored format (format 1): every node of an instance must agree
/// on it.
pub const SHARDS_PER_LOG: u32 = 8;

/// The claim log format of the group logs, which every release reads.
pub const GROUP_LOG_FORMAT: u32 = 1;

/// The claim log format a node writes once every live node reads it: the node
/// log. Nodes say which they read in their heartbeat; those of releases
/// before it say nothing (0), and read only the group log.
pub const NODE_LOG_FORMAT: u32 = 2;

/// Largest payload of one log message. Below the state bucket's value limit
/// (64 KiB), so a batch is never refused for its size.
pub const MAX_MESSAGE_BYTES: usize = 60 * 1024;

/// How long the log keeps a reset. A reset's record must outlive the TATs it
/// cancels, which the writer does not know; a day covers any bucket whose
/// capacity (burst window) is under a day. A longer one may see its pre-reset
/// TAT again after a failover more than a day after the reset: a reset is best
/// effort by the contract.
pub const RESET_KEEP_US: u64 = 24 * 3600 * 1_000_000;

/// One change of a tenant, as the log stores it: a claim change or the
/// tenant's bucket TATs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoggedChange {
    pub tenant: String,
    pub shard: u32,
    // Written always, for the array form is read by position; absent only
    // from the map form of earlier releases.
    #[serde(default)]
    pub change: Option<ClaimChange>,
    #[serde(default)]
    pub buckets: Vec<BucketRecord>,
}

/// The borrowed twin of [`LoggedChange`]: the same bytes, without copying the
/// change's strings to encode it.
#[derive(Serialize)]
struct LoggedChangeRef<'a> {
    tenant: &'a str,
    shard: u32,
    change: Option<&'a ClaimChange>,
    buckets: &'a [BucketRecord],
}

/// Bytes a change takes besides its strings, at most: the headers of its
/// arrays, strings and variant, the shard, the flags and the expiry, each
/// number at its widest. A change's buffer is sized from its own strings, so
/// that it is written without regrowing and a log's queue (many changes in a
/// stall of the log) holds no more than the changes' bytes.
const CHANGE_FRAMING_BYTES: usize = 64;
/// Bytes one bucket record takes, at most: its kind and its TAT.
const BUCKET_RECORD_BYTES: usize = 16;

/// One change, encoded, and until when the log must keep it (unix µs).
#[derive(Debug, Clone)]
pub struct EncodedChange {
    pub bytes: Vec<u8>,
    pub keep_until_us: u64,
}

impl EncodedChange {
    /// A claim change, kept as long as the claim it writes or cancels.
    pub fn claim(shard: u32, tenant: &str, change: &ClaimChange) -> Self {
        let keep_until_us = match change {
            ClaimChange::Put(record) => record.expires_us,
            // The release must outlive the pending claim it cancels.
            ClaimChange::Delete { expires_us, .. } => *expires_us,
        };
        let strings = match change {
            ClaimChange::Put(record) => [
                record.source_id(),
                record.key(),
                record.hook_id(),
                record.node().unwrap_or_default(),
            ],
            ClaimChange::Delete {
                source_id,
                key,
                hook_id,
                ..
            } => [source_id.as_str(), key, hook_id, ""],
        };
        let room = tenant.len() + strings.iter().map(|s| s.len()).sum::<usize>();
        Self::encode(
            &LoggedChangeRef {
                tenant,
                shard,
                change: Some(change),
                buckets: &[],
            },
            room,
            keep_until_us,
        )
    }

    /// A tenant's bucket TATs, each kept until its bucket is full again; a
    /// reset (TAT 0) for [`RESET_KEEP_US`] from `now_us`.
    pub fn buckets(shard: u32, tenant: &str, buckets: &[BucketRecord], now_us: u64) -> Self {
        let keep_until_us = buckets
            .iter()
            .map(|b| match b.tat_us {
                0 => now_us.saturating_add(RESET_KEEP_US),
                tat => tat,
            })
            .max()
            .unwrap_or(now_us);
        Self::encode(
            &LoggedChangeRef {
                tenant,
                shard,
                change: None,
                buckets,
            },
            tenant.len() + buckets.len() * BUCKET_RECORD_BYTES,
            keep_until_us,
        )
    }

    /// `entry`, whose strings and bucket records take `content` bytes.
    fn encode(entry: &LoggedChangeRef<'_>, content: usize, keep_until_us: u64) -> Self {
        Self {
            bytes: encode_compact(entry, CHANGE_FRAMING_BYTES + content),
            keep_until_us,
        }
    }
}

/// The group log a shard's changes go to (format 1).
pub fn log_of(shard: u32) -> u32 {
    shard / SHARDS_PER_LOG
}

/// The KV key of a group log message: unique per writer and sequence number.
pub fn log_key(log: u32, writer: &str, seq: u64) -> String {
    format!("l.{log}.{writer}.{seq}")
}

/// The KV key of a node log message: unique per writer and sequence number.
pub fn node_log_key(writer: &str, seq: u64) -> String {
    format!("m.{writer}.{seq}")
}

/// Frames encoded changes as one message payload (a MessagePack array).
pub fn frame<'a>(changes: impl ExactSizeIterator<Item = &'a [u8]>) -> Bytes {
    let mut payload = Vec::with_capacity(5 + changes.len() * 160);
    // Writing to a Vec cannot fail.
    let _ = rmp::encode::write_array_len(&mut payload, changes.len() as u32);
    for change in changes {
        payload.extend_from_slice(change);
    }
    Bytes::from(payload)
}

/// Shards' claims and buckets, rebuilt change by change in log order; changes
/// of other shards are skipped. A load of several shards reads each message
/// once.
#[derive(Debug)]
pub struct Replay {
    shards: HashMap<u32, ShardReplay>,
}

/// One shard's state as of the last change applied.
#[derive(Debug, Default)]
struct ShardReplay {
    /// Per tenant, per (source_id, key): the claim as of the last change applied.
    tenants: HashMap<String, HashMap<(String, String), ClaimRecord>>,
    /// Per tenant, per bucket kind: the last TAT recorded.
    buckets: HashMap<String, [Option<u64>; 2]>,
}

impl Replay {
    pub fn new(shards: impl IntoIterator<Item = u32>) -> Self {
        Self {
            shards: shards
                .into_iter()
                .map(|shard| (shard, ShardReplay::default()))
                .collect(),
        }
    }

    /// Applies every change of one log message that belongs to these shards
    /// and can be read. `Corrupt` (naming the message by `key`) tells what
    /// could not: the whole message, when it is not a complete frame (then
    /// nothing of it is applied), or the changes skipped, one by one, when
    /// they are not changes this release knows (a later release's). Skipping
    /// one only takes away what it held (a commit, whose hook may then be
    /// delivered again; a release; TATs): no change can commit a claim but its
    /// own commit.
    pub fn apply_message(&mut self, key: &str, payload: &[u8], now_us: u64) -> Result<(), KvError> {
        let corrupt = |reason: String| KvError::Corrupt {
            key: key.to_string(),
            reason,
        };
        let records = protocol::array_elements(payload).map_err(|e| corrupt(e.to_string()))?;
        let (total, mut skipped, mut first_error) = (records.len(), 0, None);
        for record in records {
            let logged: LoggedChange = match rmp_serde::from_slice(record) {
                Ok(logged) => logged,
                Err(err) => {
                    skipped += 1;
                    first_error.get_or_insert(err);
                    continue;
                }
            };
            if !logged.buckets.is_empty() {
                self.apply_buckets(logged.shard, &logged.tenant, &logged.buckets);
            }
            if let Some(change) = logged.change {
                self.apply(logged.shard, logged.tenant, change, now_us);
            }
        }
        match first_error {
            None => Ok(()),
            Some(err) => Err(corrupt(format!(
                "{skipped} of its {total} changes unreadable, the others applied (first: {err})"
            ))),
        }
    }

    /// Records a tenant's bucket TATs; the last record of a bucket wins.
    pub fn apply_buckets(&mut self, shard: u32, tenant: &str, buckets: &[BucketRecord]) {
        let Some(state) = self.shards.get_mut(&shard) else {
            return;
        };
        let tats = match state.buckets.get_mut(tenant) {
            Some(tats) => tats,
            None => state.buckets.entry(tenant.to_owned()).or_default(),
        };
        for bucket in buckets {
            tats[kind_index(bucket.kind)] = Some(bucket.tat_us);
        }
    }

    /// Applies one change, by the two rules in the module doc.
    pub fn apply(&mut self, shard: u32, tenant: String, change: ClaimChange, now_us: u64) {
        let Some(state) = self.shards.get_mut(&shard) else {
            return;
        };
        match change {
            ClaimChange::Put(record) => {
                let claims = state.tenants.entry(tenant).or_default();
                let slot = (record.source_id().to_owned(), record.key().to_owned());
                // A pending claim never replaces a live commit.
                let holds_commit = claims
                    .get(&slot)
                    .is_some_and(|held| held.committed && held.expires_us > now_us);
                if record.committed || !holds_commit {
                    claims.insert(slot, record);
                }
            }
            ClaimChange::Delete {
                source_id,
                key,
                hook_id,
                expires_us,
            } => {
                let Some(claims) = state.tenants.get_mut(&tenant) else {
                    return;
                };
                let slot = (source_id, key);
                if claims.get(&slot).is_some_and(|held| {
                    !held.committed && held.hook_id() == hook_id && held.expires_us <= expires_us
                }) {
                    claims.remove(&slot);
                }
            }
        }
    }

    /// The live state of each shard, per tenant: claims not expired, buckets
    /// not full. Every shard replayed has an entry.
    pub fn finish(self, now_us: u64) -> HashMap<u32, Vec<TenantSnapshot>> {
        self.shards
            .into_iter()
            .map(|(shard, state)| (shard, state.finish(now_us)))
            .collect()
    }
}

impl ShardReplay {
    fn finish(mut self, now_us: u64) -> Vec<TenantSnapshot> {
        let mut snapshots = Vec::with_capacity(self.tenants.len());
        for (tenant, claims) in self.tenants {
            let buckets = self
                .buckets
                .remove(&tenant)
                .map(|tats| live_buckets(tats, now_us))
                .unwrap_or_default();
            let claims: Vec<ClaimRecord> = claims
                .into_values()
                .filter(|c| c.expires_us > now_us)
                .collect();
            snapshots.push(TenantSnapshot {
                tenant,
                buckets,
                claims,
            });
        }
        snapshots.extend(
            self.buckets
                .into_iter()
                .map(|(tenant, tats)| TenantSnapshot {
                    tenant,
                    buckets: live_buckets(tats, now_us),
                    claims: Vec::new(),
                }),
        );
        snapshots.retain(|s| !s.claims.is_empty() || !s.buckets.is_empty());
        snapshots
    }
}

pub(crate) fn kind_index(kind: Kind) -> usize {
    match kind {
        Kind::Hooks => 0,
        Kind::Bytes => 1,
    }
}

fn live_buckets(tats: [Option<u64>; 2], now_us: u64) -> Vec<BucketRecord> {
    Kind::ALL
        .iter()
        .zip(tats)
        .filter_map(|(&kind, tat)| {
            tat.filter(|&t| t > now_us)
                .map(|tat_us| BucketRecord { kind, tat_us })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_000_000_000;

    fn record(key: &str, hook: &str, committed: bool, expires_us: u64) -> ClaimRecord {
        ClaimRecord::new(
            "src",
            key,
            hook,
            (!committed).then_some("n1"),
            committed,
            expires_us,
        )
    }

    fn put(key: &str, hook: &str, committed: bool, expires_us: u64) -> ClaimChange {
        ClaimChange::Put(record(key, hook, committed, expires_us))
    }

    fn delete(key: &str, hook: &str) -> ClaimChange {
        ClaimChange::Delete {
            source_id: "src".into(),
            key: key.into(),
            hook_id: hook.into(),
            expires_us: NOW + 10,
        }
    }

    fn replay(changes: Vec<ClaimChange>) -> Vec<ClaimRecord> {
        let mut encoded: Vec<EncodedChange> = changes
            .iter()
            .map(|c| EncodedChange::claim(3, "t", c))
            .collect();
        // Another shard of the same log: left out of shard 3's replay.
        encoded.push(EncodedChange::claim(
            4,
            "t",
            &put("z", "h9", true, NOW + 50),
        ));
        let payload = frame(encoded.iter().map(|e| e.bytes.as_slice()));
        let mut replay = Replay::new([3]);
        replay
            .apply_message("l.0.w.1", &payload, NOW)
            .expect("decodes");
        let mut claims: Vec<ClaimRecord> = replay.finish(NOW)[&3]
            .clone()
            .into_iter()
            .flat_map(|t| t.claims)
            .collect();
        claims.sort_by(|a, b| a.key().cmp(b.key()));
        claims
    }

    #[test]
    fn the_last_change_of_a_key_wins() {
        let claims = replay(vec![
            put("a", "h1", false, NOW + 5),
            put("a", "h1", true, NOW + 50),
            put("b", "h2", false, NOW + 5),
            delete("b", "h2"),
            put("c", "h3", false, NOW + 5),
        ]);
        assert_eq!(
            claims,
            vec![
                record("a", "h1", true, NOW + 50),
                record("c", "h3", false, NOW + 5)
            ]
        );
    }

    #[test]
    fn a_late_pending_write_never_replaces_a_live_commit() {
        let claims = replay(vec![
            put("a", "h2", true, NOW + 50),
            put("a", "h1", false, NOW + 5),
            // Its own pending write landing after its commit changes nothing either.
            put("a", "h2", false, NOW + 5),
        ]);
        assert_eq!(claims, vec![record("a", "h2", true, NOW + 50)]);
    }

    #[test]
    fn a_release_landing_late_keeps_the_claim_its_hook_made_after_it() {
        // h1 claimed, released (its claim would have expired at NOW + 10),
        // then claimed again on another owner; the release's write landed after
        // the new claim's.
        let claims = replay(vec![
            put("a", "h1", false, NOW + 10),
            put("a", "h1", false, NOW + 40),
            delete("a", "h1"),
        ]);
        assert_eq!(claims, vec![record("a", "h1", false, NOW + 40)]);
        // In order, the release deletes the claim it cancelled.
        assert_eq!(
            replay(vec![put("a", "h1", false, NOW + 10), delete("a", "h1")]),
            vec![]
        );
    }

    #[test]
    fn a_release_deletes_only_its_own_pending_claim() {
        let claims = replay(vec![
            put("a", "h2", true, NOW + 50),
            delete("a", "h2"),
            put("b", "h3", false, NOW + 5),
            delete("b", "h1"),
            delete("c", "h1"),
        ]);
        assert_eq!(
            claims,
            vec![
                record("a", "h2", true, NOW + 50),
                record("b", "h3", false, NOW + 5)
            ]
        );
    }

    #[test]
    fn a_change_is_written_into_its_buffer_without_regrowing() {
        use ankusa_actors::types::limits::{
            MAX_HOOK_ID, MAX_KEY, MAX_NODE, MAX_SOURCE_ID, MAX_TENANT,
        };
        let (tenant, source, key, hook, node) = (
            "t".repeat(MAX_TENANT),
            "s".repeat(MAX_SOURCE_ID),
            "k".repeat(MAX_KEY),
            "h".repeat(MAX_HOOK_ID),
            "n".repeat(MAX_NODE),
        );
        let widest = ClaimRecord::new(&source, &key, &hook, Some(&node), false, u64::MAX);
        let delete = ClaimChange::Delete {
            source_id: source.clone(),
            key: key.clone(),
            hook_id: hook.clone(),
            expires_us: u64::MAX,
        };
        let text = source.len() + key.len() + hook.len();
        // Each change with the bytes of its strings and bucket records.
        let changes = [
            (
                EncodedChange::claim(u32::MAX, &tenant, &ClaimChange::Put(widest)),
                tenant.len() + text + node.len(),
            ),
            (
                EncodedChange::claim(u32::MAX, "t", &put("a", "h1", true, NOW)),
                "t".len() + "src".len() + "a".len() + "h1".len(),
            ),
            (
                EncodedChange::claim(u32::MAX, &tenant, &delete),
                tenant.len() + text,
            ),
            (
                EncodedChange::buckets(u32::MAX, &tenant, &[tats(Kind::Bytes, u64::MAX); 2], NOW),
                tenant.len() + 2 * BUCKET_RECORD_BYTES,
            ),
            (EncodedChange::buckets(0, "", &[], NOW), 0),
        ];
        for (change, content) in changes {
            let room = CHANGE_FRAMING_BYTES + content;
            assert!(
                change.bytes.len() <= room,
                "{} > {room}",
                change.bytes.len()
            );
            // A buffer that had to grow would hold more than it was given.
            assert_eq!(change.bytes.capacity(), room);
        }
    }

    #[test]
    fn expired_claims_are_left_out_and_free_the_key() {
        let claims = replay(vec![
            put("a", "h1", true, NOW),
            // The commit above has expired: a new pending claim may follow it.
            put("a", "h2", false, NOW + 5),
            put("b", "h3", true, NOW - 1),
        ]);
        assert_eq!(claims, vec![record("a", "h2", false, NOW + 5)]);
    }

    fn tats(kind: Kind, tat_us: u64) -> BucketRecord {
        BucketRecord { kind, tat_us }
    }

    #[test]
    fn the_last_bucket_record_wins_and_a_reset_is_kept_a_day() {
        let entries = [
            EncodedChange::buckets(
                3,
                "t",
                &[tats(Kind::Hooks, NOW + 9), tats(Kind::Bytes, NOW + 9)],
                NOW,
            ),
            EncodedChange::buckets(3, "t", &[tats(Kind::Hooks, NOW + 20)], NOW),
            EncodedChange::buckets(3, "u", &[tats(Kind::Hooks, NOW + 30)], NOW),
            // A reset of u's buckets, then a claim of a tenant with no buckets.
            EncodedChange::buckets(3, "u", &[tats(Kind::Hooks, 0), tats(Kind::Bytes, 0)], NOW),
            EncodedChange::claim(3, "v", &put("a", "h1", true, NOW + 5)),
            // Another shard of the log.
            EncodedChange::buckets(4, "t", &[tats(Kind::Hooks, NOW + 99)], NOW),
        ];
        assert_eq!(entries[0].keep_until_us, NOW + 9);
        assert_eq!(entries[3].keep_until_us, NOW + RESET_KEEP_US);
        let payload = frame(entries.iter().map(|e| e.bytes.as_slice()));
        let mut replay = Replay::new([3]);
        replay
            .apply_message("l.0.w.1", &payload, NOW)
            .expect("decodes");
        let mut snapshots = replay.finish(NOW).remove(&3).expect("shard 3");
        snapshots.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        let got: Vec<(&str, Vec<BucketRecord>, usize)> = snapshots
            .iter()
            .map(|s| (s.tenant.as_str(), s.buckets.clone(), s.claims.len()))
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    "t",
                    vec![tats(Kind::Hooks, NOW + 20), tats(Kind::Bytes, NOW + 9)],
                    0
                ),
                ("v", vec![], 1),
            ]
        );
    }

    #[test]
    fn eight_consecutive_shards_share_a_log() {
        assert_eq!((0..8).map(log_of).collect::<Vec<_>>(), vec![0; 8]);
        assert_eq!(log_of(8), 1);
        assert_eq!(log_key(1, "w", 7), "l.1.w.7");
    }

    #[test]
    fn a_node_log_key_names_its_writer_and_sequence_number() {
        assert_eq!(node_log_key("00112233445566ff", 7), "m.00112233445566ff.7");
    }

    #[test]
    fn a_change_is_kept_as_long_as_the_claim_it_writes_or_cancels() {
        assert_eq!(
            EncodedChange::claim(0, "t", &put("a", "h", true, NOW + 7)).keep_until_us,
            NOW + 7
        );
        assert_eq!(
            EncodedChange::claim(0, "t", &delete("a", "h")).keep_until_us,
            NOW + 10
        );
    }

    #[test]
    fn an_unreadable_message_is_a_typed_error() {
        let mut replay = Replay::new([0]);
        for payload in [&b"\xc1"[..], b"", b"\x91\x01"] {
            assert!(matches!(
                replay.apply_message("l.0.w.2", payload, NOW),
                Err(KvError::Corrupt { .. })
            ));
        }
    }

    /// A change this release does not know (a later release's) is skipped,
    /// and the message's other changes are applied.
    #[test]
    fn an_unknown_change_is_skipped_and_the_others_applied() {
        let good = EncodedChange::claim(0, "t", &put("a", "h1", true, NOW + 50));
        let later = rmp_serde::to_vec(&(
            "t",
            0u32,
            HashMap::from([("Purge", ("src", "b"))]),
            Vec::<u8>::new(),
        ))
        .expect("encodes");
        let payload = frame([later.as_slice(), good.bytes.as_slice()].into_iter());
        let mut replay = Replay::new([0]);
        match replay.apply_message("m.w.5", &payload, NOW) {
            Err(KvError::Corrupt { key, reason }) => {
                assert_eq!(key, "m.w.5");
                assert!(reason.contains("1 of its 2 changes"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        let tenants = replay.finish(NOW);
        assert_eq!(tenants[&0].len(), 1, "the readable change was not applied");
    }

    /// Nested far deeper than any record, as plain arrays and as the value of
    /// a field the decoder does not know (which serde would recurse into to
    /// skip it): refused by the frame check before serde sees it.
    #[test]
    fn a_deeply_nested_message_is_a_typed_error_not_a_stack_overflow() {
        let arrays = vec![0x91u8; 100_000];
        let mut unknown_field = b"\x91\x81\xa1x".to_vec();
        unknown_field.resize(100_000, 0x91);
        unknown_field.push(0xc0);
        let mut replay = Replay::new([0]);
        for payload in [arrays, unknown_field] {
            match replay.apply_message("m.w.3", &payload, NOW) {
                Err(KvError::Corrupt { key, reason }) => {
                    assert_eq!(key, "m.w.3");
                    assert!(reason.contains("nested deeper"), "{reason}");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    /// A message that fails to read changes nothing, even after changes of
    /// it that would have read.
    #[test]
    fn an_unreadable_message_applies_none_of_its_changes() {
        let good = EncodedChange::claim(0, "t", &put("a", "h1", true, NOW + 50));
        let mut payload =
            frame([good.bytes.as_slice(), good.bytes.as_slice()].into_iter()).to_vec();
        // The second change cut short.
        payload.truncate(payload.len() - 3);
        let mut replay = Replay::new([0]);
        assert!(matches!(
            replay.apply_message("m.w.4", &payload, NOW),
            Err(KvError::Corrupt { .. })
        ));
        assert_eq!(replay.finish(NOW)[&0], Vec::new());
    }

    #[test]
    fn framing_matches_a_serialized_vec() {
        let changes = [put("a", "h1", false, NOW + 5), delete("a", "h1")];
        let encoded: Vec<EncodedChange> = changes
            .iter()
            .map(|c| EncodedChange::claim(1, "t", c))
            .collect();
        let framed = frame(encoded.iter().map(|e| e.bytes.as_slice()));
        let owned: Vec<LoggedChange> = changes
            .iter()
            .map(|c| LoggedChange {
                tenant: "t".into(),
                shard: 1,
                change: Some(c.clone()),
                buckets: Vec::new(),
            })
            .collect();
        assert_eq!(framed.as_ref(), rmp_serde::to_vec(&owned).expect("encodes"));
    }

    /// The map form, as releases before session 22 wrote it (fields without
    /// a value left out), replays as the compact form does.
    #[test]
    fn the_map_form_of_earlier_releases_replays_like_the_compact_form() {
        #[derive(Serialize)]
        struct Earlier<'a> {
            tenant: &'a str,
            shard: u32,
            #[serde(skip_serializing_if = "Option::is_none")]
            change: Option<&'a ClaimChange>,
            #[serde(skip_serializing_if = "<[BucketRecord]>::is_empty")]
            buckets: &'a [BucketRecord],
        }
        let committed = put("a", "h1", true, NOW + 5_000_000);
        // Released: the release carries the expiry of the claim it cancels.
        let released = put("b", "h2", false, NOW + 10);
        let buckets = [BucketRecord {
            kind: Kind::Hooks,
            tat_us: NOW + 7,
        }];
        let earlier = [
            Earlier {
                tenant: "t",
                shard: 1,
                change: Some(&committed),
                buckets: &[],
            },
            Earlier {
                tenant: "t",
                shard: 1,
                change: Some(&released),
                buckets: &[],
            },
            Earlier {
                tenant: "t",
                shard: 1,
                change: Some(&delete("b", "h2")),
                buckets: &[],
            },
            Earlier {
                tenant: "t",
                shard: 1,
                change: None,
                buckets: &buckets,
            },
        ];
        let compact = [
            EncodedChange::claim(1, "t", &committed),
            EncodedChange::claim(1, "t", &released),
            EncodedChange::claim(1, "t", &delete("b", "h2")),
            EncodedChange::buckets(1, "t", &buckets, NOW),
        ];
        let named = rmp_serde::to_vec_named(&earlier).expect("encodes");
        let framed = frame(compact.iter().map(|e| e.bytes.as_slice()));
        assert!(
            framed.len() < named.len() * 2 / 3,
            "{} against {}",
            framed.len(),
            named.len()
        );
        let replayed = |payload: &[u8]| {
            let mut replay = Replay::new([1]);
            replay
                .apply_message("m.w.1", payload, NOW)
                .expect("replays");
            replay.finish(NOW)
        };
        let from_named = replayed(&named);
        assert_eq!(from_named, replayed(&framed));
        let snapshot = &from_named[&1][0];
        assert_eq!(snapshot.claims.len(), 1, "{snapshot:?}");
        assert_eq!(snapshot.buckets, buckets.to_vec());
    }
}
