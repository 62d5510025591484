//! One tenant's state and every rule of the contract applied to it, as pure
//! functions of (state, now, request). The actors only schedule these.
//!
//! Each call returns its outcome together with the [`Changes`] it made, so the
//! layer above can persist exactly what moved (claims before answering, bucket
//! TATs written behind) without diffing state.

use serde::{Deserialize, Serialize};

use crate::claims::{ClaimRecord, ClaimTable, Phase, SweepStep};
use crate::gcra;
use crate::types::{
    BucketView, ClaimView, EventKey, HitOutcome, HitRequest, Kind, SettleOutcome, SettleRequest,
    Settlement, TenantView,
};

/// A bucket as it is persisted and exported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketRecord {
    pub kind: Kind,
    /// Theoretical arrival time, unix µs; 0 (or any past instant) means full.
    pub tat_us: u64,
}

/// A change to one claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClaimChange {
    Put(ClaimRecord),
    /// `hook_id`'s pending claim released. `expires_us` is when it would have
    /// expired: a log that replays changes keeps the deletion that long, and
    /// applies it only to that hook's pending claim.
    Delete {
        source_id: String,
        key: String,
        hook_id: String,
        expires_us: u64,
    },
}

/// What one call changed in a tenant's state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    pub claim: Option<ClaimChange>,
    /// The new TAT of every bucket that moved (0 after a reset).
    pub buckets: Buckets,
}

/// The buckets one call moved, in the order it charged them. A tenant has one
/// bucket per [`Kind`], so they fit inline: reporting them allocates nothing on
/// every hit. Reads as a slice (`iter`, `len`, `is_empty`, indexing).
#[derive(Clone, Copy)]
pub struct Buckets {
    len: u8,
    items: [BucketRecord; Kind::ALL.len()],
}

impl Buckets {
    /// Records `bucket`; a kind already here takes the new TAT, so every kind is
    /// reported once with its last value.
    pub fn push(&mut self, bucket: BucketRecord) {
        let len = usize::from(self.len);
        if let Some(same) = self.items[..len].iter_mut().find(|b| b.kind == bucket.kind) {
            *same = bucket;
        } else if let Some(free) = self.items.get_mut(len) {
            *free = bucket;
            self.len += 1;
        }
    }
}

impl Default for Buckets {
    fn default() -> Self {
        Self {
            len: 0,
            items: [BucketRecord {
                kind: Kind::Hooks,
                tat_us: 0,
            }; Kind::ALL.len()],
        }
    }
}

impl std::ops::Deref for Buckets {
    type Target = [BucketRecord];

    fn deref(&self) -> &[BucketRecord] {
        &self.items[..usize::from(self.len)]
    }
}

impl<'a> IntoIterator for &'a Buckets {
    type Item = &'a BucketRecord;
    type IntoIter = std::slice::Iter<'a, BucketRecord>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl FromIterator<BucketRecord> for Buckets {
    fn from_iter<I: IntoIterator<Item = BucketRecord>>(iter: I) -> Self {
        let mut buckets = Self::default();
        for bucket in iter {
            buckets.push(bucket);
        }
        buckets
    }
}

impl PartialEq for Buckets {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for Buckets {}

impl std::fmt::Debug for Buckets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.claim.is_none() && self.buckets.is_empty()
    }
}

/// A hit refused because it would add a claim to a tenant already holding the
/// most a node keeps for one tenant. Nothing was changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the tenant holds {held} claims, the most kept for one tenant is {max}")]
pub struct ClaimsFull {
    /// Claims held, live or expired and not yet swept.
    pub held: usize,
    pub max: usize,
}

/// An outcome and the changes that produced it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied<T> {
    pub outcome: T,
    pub changes: Changes,
}

impl<T> Applied<T> {
    pub(crate) fn unchanged(outcome: T) -> Self {
        Self {
            outcome,
            changes: Changes::default(),
        }
    }
}

/// A tenant's whole state in serde form, for persistence and handoff.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantSnapshot {
    pub tenant: String,
    pub buckets: Vec<BucketRecord>,
    pub claims: Vec<ClaimRecord>,
}

/// One tenant's buckets (a TAT per kind) and claim table.
#[derive(Debug, Clone, Default)]
pub struct TenantState {
    tats: [u64; 2],
    claims: ClaimTable,
}

fn until_ms(now_us: u64, ms: u64) -> u64 {
    now_us.saturating_add(ms.saturating_mul(1000))
}

impl TenantState {
    /// [`TenantState::hit_within`] with no cap on the claims held: for the
    /// rules alone (tests, benches), where no table grows past memory's bound.
    pub fn hit(&mut self, now_us: u64, req: &HitRequest) -> Applied<HitOutcome> {
        match self.hit_within(now_us, req, usize::MAX) {
            Ok(applied) => applied,
            // No table holds usize::MAX claims: memory runs out long before.
            Err(full) => unreachable!("{full}"),
        }
    }

    /// Applies a hit. The request must have passed [`HitRequest::validate`].
    ///
    /// Order: a replay by the hook that already holds the key pending answers `Ok`
    /// again and spends nothing (its first attempt paid); then the charges — a
    /// denied one answers `RateLimited` and writes nothing; then the claim — a
    /// taken key answers `Duplicate` (committed only) or `Pending` and spends
    /// nothing; a key that would make the table hold more than `max_claims`
    /// is refused with [`ClaimsFull`] and spends nothing; otherwise every
    /// charge is taken and the key becomes pending.
    ///
    /// The cap refuses only new keys: a key already held is always answered,
    /// so a redelivery is still told `Duplicate` or `Pending` by a full table.
    pub fn hit_within(
        &mut self,
        now_us: u64,
        req: &HitRequest,
        max_claims: usize,
    ) -> Result<Applied<HitOutcome>, ClaimsFull> {
        let Self { tats, claims } = self;
        let held = claims.len();
        // One hash of the key for the whole hit: the slot found here is read for the
        // replay and the taken checks and, if the hit passes, claimed in place.
        let slot = req
            .claim
            .as_ref()
            .map(|c| (c, claims.slot(&c.source_id, &c.key)));
        if let Some((claim, Some(entry))) = slot.as_ref().map(|(c, s)| (c, s.get())) {
            if entry.is_live(now_us)
                && matches!(entry.phase, Phase::Pending { .. })
                && entry.hook_id() == claim.hook_id
            {
                return Ok(Applied {
                    outcome: HitOutcome::Ok,
                    changes: Changes {
                        claim: Some(ClaimChange::Put(ClaimRecord::from_entry(entry))),
                        buckets: Buckets::default(),
                    },
                });
            }
        }

        let mut new_tats = *tats;
        let mut wait_us = None::<u64>;
        for charge in &req.charges {
            let slot = charge.kind.index();
            match gcra::charge(tats[slot], now_us, charge.increment_us, charge.capacity_us) {
                Ok(tat) => new_tats[slot] = tat,
                Err(denied) => wait_us = Some(wait_us.unwrap_or(0).max(denied.retry_after_us)),
            }
        }
        if let Some(wait_us) = wait_us {
            return Ok(Applied::unchanged(HitOutcome::RateLimited {
                retry_after_ms: gcra::retry_ms(wait_us),
            }));
        }

        let mut changes = Changes::default();
        if let Some((claim, slot)) = slot {
            if let Some(entry) = slot.get().filter(|e| e.is_live(now_us)) {
                let outcome = match entry.phase {
                    Phase::Committed => HitOutcome::Duplicate {
                        hook_id: entry.hook_id().to_string(),
                    },
                    Phase::Pending { .. } => HitOutcome::Pending {
                        retry_after_ms: gcra::retry_ms(entry.expires_us - now_us),
                    },
                };
                return Ok(Applied::unchanged(outcome));
            }
            // An expired claim is replaced where it lies; only a vacant place grows the table.
            if slot.get().is_none() && held >= max_claims {
                return Err(ClaimsFull {
                    held,
                    max: max_claims,
                });
            }
            let expires_us = until_ms(now_us, claim.pending_ttl_ms);
            let entry = slot.claim(
                &claim.source_id,
                &claim.key,
                &claim.hook_id,
                &claim.node,
                expires_us,
            );
            changes.claim = Some(ClaimChange::Put(ClaimRecord::from_entry(entry)));
        }

        for charge in &req.charges {
            let slot = charge.kind.index();
            tats[slot] = new_tats[slot];
            changes.buckets.push(BucketRecord {
                kind: charge.kind,
                tat_us: new_tats[slot],
            });
        }
        Ok(Applied {
            outcome: HitOutcome::Ok,
            changes,
        })
    }

    /// Settles a claim. The request must have passed [`SettleRequest::validate`].
    ///
    /// Only the hook holding the key may settle it. A repeated commit is `Ok` and
    /// keeps the first commit's expiry; a release after a commit is refused, since
    /// the hook is already durable.
    pub fn settle(&mut self, now_us: u64, req: &SettleRequest) -> Applied<SettleOutcome> {
        let claim = &req.claim;
        let Some(entry) = self.claims.find_mut(&claim.source_id, &claim.key, now_us) else {
            return Applied::unchanged(SettleOutcome::NotFound);
        };
        if entry.hook_id() != claim.hook_id {
            return Applied::unchanged(SettleOutcome::NotOwner {
                hook_id: entry.hook_id().to_string(),
            });
        }
        let change = match (&entry.phase, req.settlement) {
            (Phase::Committed, Settlement::Release) => {
                return Applied::unchanged(SettleOutcome::AlreadyCommitted);
            }
            (Phase::Pending { .. }, Settlement::Release) => {
                let expires_us = entry.expires_us;
                self.claims.remove(&claim.source_id, &claim.key);
                ClaimChange::Delete {
                    source_id: claim.source_id.clone(),
                    key: claim.key.clone(),
                    hook_id: claim.hook_id.clone(),
                    expires_us,
                }
            }
            (Phase::Pending { .. }, Settlement::Commit) => {
                entry.phase = Phase::Committed;
                entry.expires_us = until_ms(now_us, claim.ttl_ms);
                ClaimChange::Put(ClaimRecord::from_entry(entry))
            }
            (Phase::Committed, Settlement::Commit) => {
                ClaimChange::Put(ClaimRecord::from_entry(entry))
            }
        };
        Applied {
            outcome: SettleOutcome::Ok,
            changes: Changes {
                claim: Some(change),
                buckets: Buckets::default(),
            },
        }
    }

    /// Forgets the buckets (a limit changed); claims stay.
    pub fn reset(&mut self) -> Changes {
        self.tats = [0; 2];
        Changes {
            claim: None,
            buckets: Kind::ALL
                .iter()
                .map(|&kind| BucketRecord { kind, tat_us: 0 })
                .collect(),
        }
    }

    /// What this state holds at `now_us`, and the claim on `event` if it is live.
    pub fn inspect(&self, now_us: u64, event: Option<&EventKey>) -> TenantView {
        let buckets = Kind::ALL
            .iter()
            .map(|&kind| BucketView {
                kind,
                ahead_us: self.tats[kind.index()].saturating_sub(now_us),
            })
            .filter(|bucket| bucket.ahead_us > 0)
            .collect();
        let claim = event
            .and_then(|e| self.claims.find(&e.source_id, &e.key, now_us))
            .map(|entry| {
                let hook_id = entry.hook_id().to_string();
                let expires_in_ms = gcra::retry_ms(entry.expires_us - now_us);
                match &entry.phase {
                    Phase::Pending { node } => ClaimView::Pending {
                        hook_id,
                        node: node.to_string(),
                        expires_in_ms,
                    },
                    Phase::Committed => ClaimView::Committed {
                        hook_id,
                        expires_in_ms,
                    },
                }
            });
        TenantView {
            buckets,
            claims_held: self.claims.len() as u64,
            claim,
        }
    }

    /// Drops expired claims; returns how many went.
    pub fn sweep(&mut self, now_us: u64) -> usize {
        self.claims.sweep(now_us)
    }

    /// One step of a sweep over at most `buckets` places of the claim table.
    pub fn sweep_step(&mut self, now_us: u64, buckets: usize) -> SweepStep {
        self.claims.sweep_step(now_us, buckets)
    }

    /// Nothing worth keeping: every bucket full and no live claim.
    pub fn is_empty(&self, now_us: u64) -> bool {
        self.tats.iter().all(|&t| gcra::is_full(t, now_us))
            && self.claims.iter().all(|(_, e)| !e.is_live(now_us))
    }

    /// The TAT of one bucket (0 when never charged or reset).
    pub fn tat(&self, kind: Kind) -> u64 {
        self.tats[kind.index()]
    }

    pub fn claims(&self) -> &ClaimTable {
        &self.claims
    }

    /// The live part of this state, in serde form.
    pub fn snapshot(&self, tenant: &str, now_us: u64) -> TenantSnapshot {
        TenantSnapshot {
            tenant: tenant.to_string(),
            buckets: Kind::ALL
                .iter()
                .filter(|k| !gcra::is_full(self.tats[k.index()], now_us))
                .map(|&kind| BucketRecord {
                    kind,
                    tat_us: self.tats[kind.index()],
                })
                .collect(),
            claims: self
                .claims
                .iter()
                .filter(|(_, e)| e.is_live(now_us))
                .map(|(_, e)| ClaimRecord::from_entry(e))
                .collect(),
        }
    }

    /// Adds a snapshot's buckets and claims to this state; a record that is
    /// already past is skipped, and a later TAT or a committed claim wins over
    /// what is here (so merging partial loads never forgets a commit).
    pub fn absorb(&mut self, snapshot: TenantSnapshot, now_us: u64) {
        for bucket in snapshot.buckets {
            let slot = &mut self.tats[bucket.kind.index()];
            *slot = (*slot).max(bucket.tat_us);
        }
        for record in snapshot.claims {
            self.absorb_claim(record, now_us);
        }
    }

    /// Adds one persisted claim in place of what holds its key, except that a
    /// live committed claim is never replaced by a pending one. Loads give one
    /// record per key, so which of two records of one phase wins is moot.
    pub fn absorb_claim(&mut self, record: ClaimRecord, now_us: u64) {
        if record.expires_us() <= now_us {
            return;
        }
        let entry = record.into_entry();
        if let Some(existing) = self.claims.find(entry.source_id(), entry.key(), now_us) {
            if existing.phase == Phase::Committed && entry.phase != Phase::Committed {
                return;
            }
        }
        self.claims.insert(entry);
    }

    pub fn from_snapshot(snapshot: TenantSnapshot, now_us: u64) -> Self {
        let mut state = Self::default();
        state.absorb(snapshot, now_us);
        state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(kind: Kind, tat_us: u64) -> BucketRecord {
        BucketRecord { kind, tat_us }
    }

    #[test]
    fn buckets_keep_charge_order_and_one_record_per_kind() {
        let mut buckets = Buckets::default();
        assert!(buckets.is_empty());
        buckets.push(bucket(Kind::Bytes, 1));
        buckets.push(bucket(Kind::Hooks, 2));
        assert_eq!(&*buckets, &[bucket(Kind::Bytes, 1), bucket(Kind::Hooks, 2)]);
        // Never more than one per kind, and never past the inline capacity.
        buckets.push(bucket(Kind::Bytes, 3));
        let seen: Vec<_> = (&buckets).into_iter().copied().collect();
        assert_eq!(seen, [bucket(Kind::Bytes, 3), bucket(Kind::Hooks, 2)]);
        assert_eq!(format!("{buckets:?}"), format!("{seen:?}"));
    }

    #[test]
    fn buckets_compare_by_what_they_hold() {
        let mut a = Buckets::default();
        a.push(bucket(Kind::Hooks, 5));
        let b: Buckets = [bucket(Kind::Hooks, 5)].into_iter().collect();
        assert_eq!(a, b);
        assert_ne!(a, Buckets::default());
    }
}
