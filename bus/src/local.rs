//! [`LocalStore`]: this process's own limits and claims, which the edge answers
//! from when the fleet cannot (`Ankusa.Edge.Fleet` in the contract).
//!
//! It applies the very same rules as a fleet node — [`TenantState::hit`],
//! [`TenantState::settle`] and [`TenantState::reset`] behind
//! [`HitRequest::validate`] — to a map tenant → [`TenantState`] split over a few
//! mutex-guarded shards picked by a hash of the tenant, so concurrent hits for
//! different tenants rarely meet on one lock. An answer costs one uncontended lock
//! and a couple of hash lookups: microseconds.
//!
//! # What local answers mean
//!
//! - **Limits**: a tenant's local buckets start full and only see this process's
//!   traffic, so during an outage a tenant may get up to its quota *per edge
//!   process*. That overage is the price of never stopping the edge. Local buckets
//!   are not charged while the fleet answers (they would not describe the fleet's
//!   view anyway), so they are full again when an outage starts.
//! - **Dedupe**: only claims made here are known here. A key committed on the
//!   fleet before the outage is unknown locally and a retry of that hook is
//!   accepted again — a duplicate delivery, never a lost one. `Duplicate` is only
//!   ever answered for a claim this store itself committed.
//!
//! # Where a claim lives
//!
//! A claim taken here during an outage was never seen by the fleet: the fleet
//! would answer `NotFound` to its settle, and would hand its key to another hook.
//! So a claim lives where it was made, until it expires: the edge asks
//! [`LocalStore::holds_claim`] to route a settle here, and
//! [`LocalStore::has_live_claim`] to answer later hits on that key here (a retry
//! meets the local `Pending`/`Duplicate` instead of a fleet that never heard of
//! the key). This store never invents a claim it did not make: a settle of a claim
//! it does not hold answers `NotFound`, so a fleet settle that failed can not turn
//! into a local commit.
//!
//! # Memory
//!
//! Each shard keeps at most `ceil(max_tenants / shards)` tenants. Every
//! `sweep_every` operations on a shard, the next few of its tenants in turn
//! drop expired claims, a few thousand places of each one's claim table, and
//! those left holding nothing (full buckets, no live claim) go, so that the
//! answer that pays for it stays quick however many tenants the shard holds;
//! [`LocalStore::sweep`] does every shard whole at once for a periodic tick.
//! Live claims are kept until they expire, at most
//! `max_tenant_claims` a tenant: a hit on a new key past that is answered
//! `Pending` (retry later) and claims nothing, since this store is the edge's
//! last answer and a fleet that refused the tenant's claims (`overloaded`)
//! would otherwise move them all here. A new tenant on a full shard
//! first drops empty tenants; if that leaves less room than an eighth of the
//! shard, the least recently used tenants are evicted to make that room. Evicting a tenant can only cause extra admissions
//! (fresh buckets, forgotten claims), never a `Duplicate`.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use ankusa_actors::claims::ClaimKey;
use ankusa_actors::types::validate_tenant;
use ankusa_actors::{
    Claim, Clock, HitOutcome, HitRequest, InvalidRequest, SettleOutcome, SettleRequest, TenantState,
};
use serde::Serialize;

/// How a [`LocalStore`] is sized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalConfig {
    /// Lock shards (at least 1).
    pub shards: usize,
    /// Tenants kept at most, over all shards (at least one per shard).
    pub max_tenants: usize,
    /// Operations on a shard between two sweeps of it (at least 1).
    pub sweep_every: u32,
    /// Claims one tenant may hold here (live, or expired and not yet swept)
    /// before a hit on a new key is answered `Pending` (at least 1).
    pub max_tenant_claims: usize,
}

/// What a hit on a new key of a tenant at its claim cap is told: retry after
/// this long, by when a sweep may have made room or the fleet may be back.
pub const CLAIMS_FULL_RETRY_MS: u64 = 1_000;

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            shards: 16,
            max_tenants: 100_000,
            sweep_every: 1024,
            max_tenant_claims: 1_000_000,
        }
    }
}

/// What a [`LocalStore`] holds and has thrown away, for export.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LocalStats {
    /// Tenants held now.
    pub tenants: u64,
    /// Non-empty tenants evicted because their shard was full.
    pub evicted: u64,
    /// Empty tenants dropped by sweeps.
    pub dropped: u64,
    /// Expired claims dropped by sweeps.
    pub swept_claims: u64,
    /// Hits on a new key answered `Pending` because their tenant held
    /// `max_tenant_claims` here.
    pub claims_refused: u64,
}

struct Entry {
    state: TenantState,
    /// Unix µs of the last operation, to pick eviction victims.
    last_used_us: u64,
}

#[derive(Default)]
struct Shard {
    tenants: HashMap<Box<str>, Entry>,
    ops: u32,
    /// Where in the tenants the next sweep on the answer path begins.
    sweep_from: usize,
}

/// Places of a tenant's claim table that one sweep on the answer path looks
/// at: a tenant holding millions of claims (a long outage, long TTLs) is swept
/// over many ticks, each holding the shard's lock briefly, rather than in one
/// pass of tens of milliseconds that the answers behind it would wait out.
const SWEEP_STEP: usize = 4096;

/// Tenants one sweep on the answer path takes a step of, from where the last
/// one stopped: the answer that pays for it, and those behind it on the
/// shard's lock, wait for at most this many steps, however many tenants the
/// shard holds.
const SWEEP_TENANTS: usize = 32;

/// How much of a shard a sweep looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sweep {
    /// Every tenant's table whole: a periodic tick, off the answer path.
    Whole,
    /// A step of every tenant: making room, which looks at them all anyway.
    StepEach,
    /// A step of the next [`SWEEP_TENANTS`] tenants: on the answer path.
    StepNext,
}

/// This process's own tenant state; see the module doc.
pub struct LocalStore {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    per_shard: usize,
    sweep_every: u32,
    max_tenant_claims: usize,
    evicted: AtomicU64,
    dropped: AtomicU64,
    swept_claims: AtomicU64,
    claims_refused: AtomicU64,
}

impl std::fmt::Debug for LocalStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalStore")
            .field("shards", &self.shards.len())
            .field("per_shard", &self.per_shard)
            .field("stats", &self.stats())
            .finish()
    }
}

impl LocalStore {
    /// An empty store reading time from `clock`. Zero sizes are raised to 1.
    pub fn new(clock: Arc<dyn Clock>, config: LocalConfig) -> Self {
        let shards = config.shards.max(1);
        Self {
            shards: (0..shards).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: RandomState::new(),
            clock,
            per_shard: config.max_tenants.div_ceil(shards).max(1),
            sweep_every: config.sweep_every.max(1),
            max_tenant_claims: config.max_tenant_claims.max(1),
            evicted: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            swept_claims: AtomicU64::new(0),
            claims_refused: AtomicU64::new(0),
        }
    }

    /// Applies a hit to this process's state, by the fleet's rules.
    pub fn hit(&self, req: &HitRequest) -> Result<HitOutcome, InvalidRequest> {
        req.validate()?;
        Ok(self.hit_valid(req))
    }

    /// [`LocalStore::hit`] for a request that already passed `validate`.
    pub(crate) fn hit_valid(&self, req: &HitRequest) -> HitOutcome {
        let tenant = req.tenant();
        let now = self.clock.now_us();
        let mut shard = self.lock(tenant);
        self.tick(&mut shard, now);
        if let Some(entry) = shard.tenants.get_mut(tenant) {
            entry.last_used_us = now;
            return self.hit_capped(&mut entry.state, now, req);
        }
        let mut state = TenantState::default();
        let outcome = self.hit_capped(&mut state, now, req);
        // A hit that wrote nothing leaves nothing to remember.
        if !state.is_empty(now) {
            self.make_room(&mut shard, now);
            shard.tenants.insert(
                tenant.into(),
                Entry {
                    state,
                    last_used_us: now,
                },
            );
        }
        outcome
    }

    fn hit_capped(&self, state: &mut TenantState, now: u64, req: &HitRequest) -> HitOutcome {
        match state.hit_within(now, req, self.max_tenant_claims) {
            Ok(applied) => applied.outcome,
            Err(_) => {
                self.claims_refused.fetch_add(1, Ordering::Relaxed);
                HitOutcome::Pending {
                    retry_after_ms: CLAIMS_FULL_RETRY_MS,
                }
            }
        }
    }

    /// Settles a claim this store holds; any other claim is `NotFound` here.
    pub fn settle(&self, req: &SettleRequest) -> Result<SettleOutcome, InvalidRequest> {
        req.validate()?;
        Ok(self.settle_valid(req))
    }

    pub(crate) fn settle_valid(&self, req: &SettleRequest) -> SettleOutcome {
        let tenant = req.claim.tenant.as_str();
        let now = self.clock.now_us();
        let mut shard = self.lock(tenant);
        self.tick(&mut shard, now);
        match shard.tenants.get_mut(tenant) {
            Some(entry) => {
                entry.last_used_us = now;
                entry.state.settle(now, req).outcome
            }
            None => SettleOutcome::NotFound,
        }
    }

    /// Forgets the tenant's local buckets; its claims stay.
    pub fn reset(&self, tenant: &str) -> Result<(), InvalidRequest> {
        validate_tenant(tenant)?;
        self.reset_valid(tenant);
        Ok(())
    }

    pub(crate) fn reset_valid(&self, tenant: &str) {
        let now = self.clock.now_us();
        let mut shard = self.lock(tenant);
        let empty = match shard.tenants.get_mut(tenant) {
            Some(entry) => {
                entry.state.reset();
                entry.state.is_empty(now)
            }
            None => false,
        };
        if empty {
            shard.tenants.remove(tenant);
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whether this store holds a live claim (pending or committed) on the claim's
    /// key by the claim's own `hook_id`: its settle belongs here.
    pub fn holds_claim(&self, claim: &Claim) -> bool {
        self.claim_holder(&claim.tenant, &claim.source_id, &claim.key, |hook| {
            hook == claim.hook_id
        })
    }

    /// Whether this store holds a live claim on `(source_id, key)` by any hook:
    /// hits on that key are answered here until it expires.
    pub fn has_live_claim(&self, tenant: &str, source_id: &str, key: &str) -> bool {
        self.claim_holder(tenant, source_id, key, |_| true)
    }

    fn claim_holder(
        &self,
        tenant: &str,
        source_id: &str,
        key: &str,
        by: impl FnOnce(&str) -> bool,
    ) -> bool {
        let now = self.clock.now_us();
        let shard = self.lock(tenant);
        // Most calls find no tenant here; skip building the packed key for them.
        let Some(entry) = shard.tenants.get(tenant) else {
            return false;
        };
        if entry.state.claims().is_empty() {
            return false;
        }
        entry
            .state
            .claims()
            .live(&ClaimKey::new(source_id, key), now)
            .is_some_and(|e| by(e.hook_id()))
    }

    /// Sweeps every shard now, each claim table whole (for a periodic tick
    /// off the answer path); returns the claims dropped.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_us();
        self.shards
            .iter()
            .map(|shard| {
                let mut shard = recover(shard.lock());
                shard.ops = 0;
                self.sweep_shard(&mut shard, now, Sweep::Whole)
            })
            .sum()
    }

    /// Tenants held now.
    pub fn tenants(&self) -> usize {
        self.shards
            .iter()
            .map(|s| recover(s.lock()).tenants.len())
            .sum()
    }

    pub fn stats(&self) -> LocalStats {
        LocalStats {
            tenants: self.tenants() as u64,
            evicted: self.evicted.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            swept_claims: self.swept_claims.load(Ordering::Relaxed),
            claims_refused: self.claims_refused.load(Ordering::Relaxed),
        }
    }

    fn lock(&self, tenant: &str) -> MutexGuard<'_, Shard> {
        // `shards` is never empty (see `new`), so the modulo is defined.
        let index = (self.hasher.hash_one(tenant) % self.shards.len() as u64) as usize;
        recover(self.shards[index].lock())
    }

    /// Counts an operation on the shard and sweeps it every `sweep_every` of them.
    fn tick(&self, shard: &mut Shard, now: u64) {
        shard.ops += 1;
        if shard.ops >= self.sweep_every {
            shard.ops = 0;
            self.sweep_shard(shard, now, Sweep::StepNext);
        }
    }

    /// Drops expired claims from the tenants `how` says (a step of each
    /// table from where its last sweep stopped, or the whole table), and the
    /// tenants left holding nothing.
    fn sweep_shard(&self, shard: &mut Shard, now: u64, how: Sweep) -> usize {
        let mut claims = 0;
        let before = shard.tenants.len();
        // Whether a tenant swept is to be dropped. Only a finished pass asks
        // whether anything is left: the question walks the claims up to the
        // first live one.
        let mut sweep = |entry: &mut Entry| {
            let (swept, finished) = match how {
                Sweep::Whole => (entry.state.sweep(now), true),
                Sweep::StepEach | Sweep::StepNext => {
                    let step = entry.state.sweep_step(now, SWEEP_STEP);
                    (step.swept, step.finished)
                }
            };
            claims += swept;
            finished && entry.state.is_empty(now)
        };
        if how == Sweep::StepNext && before > SWEEP_TENANTS {
            // The map's order is its own, and moves as tenants come and go:
            // the turn is fair enough, not exact.
            let start = shard.sweep_from % before;
            let wrapped = (start + SWEEP_TENANTS).saturating_sub(before);
            let mut gone = Vec::new();
            let tenants = shard.tenants.iter_mut();
            for (name, entry) in tenants.skip(start).take(SWEEP_TENANTS) {
                if sweep(entry) {
                    gone.push(name.clone());
                }
            }
            for (name, entry) in shard.tenants.iter_mut().take(wrapped) {
                if sweep(entry) {
                    gone.push(name.clone());
                }
            }
            shard.sweep_from = start + SWEEP_TENANTS - gone.len();
            for name in gone {
                shard.tenants.remove(&name);
            }
        } else {
            shard.tenants.retain(|_, entry| !sweep(entry));
        }
        let dropped = before - shard.tenants.len();
        if shard.tenants.capacity() > 4 * shard.tenants.len().max(16) {
            shard.tenants.shrink_to_fit();
        }
        self.dropped.fetch_add(dropped as u64, Ordering::Relaxed);
        self.swept_claims
            .fetch_add(claims as u64, Ordering::Relaxed);
        claims
    }

    /// Makes room for one more tenant on a full shard.
    fn make_room(&self, shard: &mut Shard, now: u64) {
        if shard.tenants.len() < self.per_shard {
            return;
        }
        self.sweep_shard(shard, now, Sweep::StepEach);
        // Room for an eighth of the shard at once, so that a stream of new
        // tenants pays for these scans once per eighth rather than on every
        // insert (a sweep that freed a few would otherwise come again at once).
        let room = (self.per_shard / 8).max(1);
        let excess = (shard.tenants.len() + room).saturating_sub(self.per_shard);
        if excess == 0 {
            return;
        }
        let mut ages: Vec<(u64, Box<str>)> = shard
            .tenants
            .iter()
            .map(|(name, entry)| (entry.last_used_us, name.clone()))
            .collect();
        let batch = excess.min(ages.len());
        if batch < ages.len() {
            ages.select_nth_unstable(batch);
        }
        for (_, name) in ages.into_iter().take(batch) {
            shard.tenants.remove(&name);
        }
        self.evicted.fetch_add(batch as u64, Ordering::Relaxed);
    }
}

/// A panic while a shard was locked leaves its state as consistent as any single
/// `TenantState` call leaves it; keep serving rather than poison the edge.
fn recover<T>(result: std::sync::LockResult<T>) -> T {
    result.unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ankusa_actors::{Charge, Kind, ManualClock, Settlement};

    const T0: u64 = 1_700_000_000_000_000;

    fn store(clock: &ManualClock, config: LocalConfig) -> LocalStore {
        LocalStore::new(Arc::new(clock.clone()), config)
    }

    fn claim(tenant: &str, key: &str, hook: &str) -> Claim {
        Claim {
            tenant: tenant.into(),
            source_id: "src".into(),
            key: key.into(),
            hook_id: hook.into(),
            node: "edge-1".into(),
            ttl_ms: 60_000,
            pending_ttl_ms: 5_000,
        }
    }

    fn charge(tenant: &str) -> Charge {
        Charge {
            kind: Kind::Hooks,
            tenant: tenant.into(),
            increment_us: 100_000,
            capacity_us: 300_000,
        }
    }

    fn hit(tenant: &str, key: Option<(&str, &str)>) -> HitRequest {
        HitRequest {
            charges: vec![charge(tenant)],
            claim: key.map(|(k, h)| claim(tenant, k, h)),
        }
    }

    fn settle(c: Claim, settlement: Settlement) -> SettleRequest {
        SettleRequest {
            claim: c,
            settlement,
        }
    }

    #[test]
    fn gcra_burst_then_rate_limited_then_refills() {
        let clock = ManualClock::new(T0);
        let local = store(&clock, LocalConfig::default());
        for _ in 0..3 {
            assert_eq!(local.hit(&hit("t", None)), Ok(HitOutcome::Ok));
        }
        assert_eq!(
            local.hit(&hit("t", None)),
            Ok(HitOutcome::RateLimited {
                retry_after_ms: 100
            })
        );
        clock.advance_us(100_000);
        assert_eq!(local.hit(&hit("t", None)), Ok(HitOutcome::Ok));
    }

    #[test]
    fn duplicate_only_after_a_local_commit() {
        let clock = ManualClock::new(T0);
        let local = store(&clock, LocalConfig::default());
        let c1 = claim("t", "k", "h1");
        assert_eq!(local.hit(&hit("t", Some(("k", "h1")))), Ok(HitOutcome::Ok));
        assert!(local.holds_claim(&c1));
        assert!(!local.holds_claim(&claim("t", "k", "h2")));
        assert!(local.has_live_claim("t", "src", "k"));
        assert_eq!(
            local.hit(&hit("t", Some(("k", "h2")))),
            Ok(HitOutcome::Pending {
                retry_after_ms: 5_000
            })
        );
        assert_eq!(
            local.settle(&settle(c1, Settlement::Commit)),
            Ok(SettleOutcome::Ok)
        );
        assert_eq!(
            local.hit(&hit("t", Some(("k", "h2")))),
            Ok(HitOutcome::Duplicate {
                hook_id: "h1".into()
            })
        );
    }

    #[test]
    fn never_invents_a_claim_it_did_not_make() {
        let clock = ManualClock::new(T0);
        let local = store(&clock, LocalConfig::default());
        let c = claim("t", "k", "h1");
        assert_eq!(
            local.settle(&settle(c.clone(), Settlement::Commit)),
            Ok(SettleOutcome::NotFound)
        );
        assert_eq!(local.tenants(), 0);
        assert_eq!(local.hit(&hit("t", Some(("k", "h2")))), Ok(HitOutcome::Ok));
    }

    #[test]
    fn pending_claim_expires_and_is_swept() {
        let clock = ManualClock::new(T0);
        let local = store(&clock, LocalConfig::default());
        let req = HitRequest {
            charges: vec![],
            claim: Some(claim("t", "k", "h1")),
        };
        assert_eq!(local.hit(&req), Ok(HitOutcome::Ok));
        assert_eq!(local.tenants(), 1);
        clock.advance_us(5_000_000);
        assert!(!local.has_live_claim("t", "src", "k"));
        assert_eq!(local.sweep(), 1);
        assert_eq!(local.tenants(), 0);
        assert_eq!(local.stats().dropped, 1);
    }

    #[test]
    fn a_tenant_at_its_claim_cap_is_told_pending_for_new_keys_only() {
        let clock = ManualClock::new(T0);
        let config = LocalConfig {
            max_tenant_claims: 2,
            ..LocalConfig::default()
        };
        let local = store(&clock, config);
        let claim_hit = |tenant: &str, key: &str, hook: &str| HitRequest {
            charges: Vec::new(),
            claim: Some(claim(tenant, key, hook)),
        };
        assert_eq!(local.hit(&claim_hit("t", "a", "h1")), Ok(HitOutcome::Ok));
        assert_eq!(local.hit(&claim_hit("t", "b", "h1")), Ok(HitOutcome::Ok));
        let commit = settle(claim("t", "a", "h1"), Settlement::Commit);
        assert_eq!(local.settle(&commit), Ok(SettleOutcome::Ok));

        assert_eq!(
            local.hit(&claim_hit("t", "c", "h1")),
            Ok(HitOutcome::Pending {
                retry_after_ms: CLAIMS_FULL_RETRY_MS
            })
        );
        assert!(!local.has_live_claim("t", "src", "c"), "nothing claimed");
        assert_eq!(local.stats().claims_refused, 1);
        // The keys held are answered as ever, and another tenant has its own room.
        assert_eq!(
            local.hit(&claim_hit("t", "a", "h2")),
            Ok(HitOutcome::Duplicate {
                hook_id: "h1".into()
            })
        );
        assert_eq!(local.hit(&claim_hit("u", "c", "h1")), Ok(HitOutcome::Ok));
    }

    #[test]
    fn periodic_sweep_drops_empty_tenants() {
        let clock = ManualClock::new(T0);
        let config = LocalConfig {
            shards: 1,
            max_tenants: 1_000,
            sweep_every: 4,
            ..LocalConfig::default()
        };
        let local = store(&clock, config);
        for t in ["a", "b", "c"] {
            assert_eq!(local.hit(&hit(t, None)), Ok(HitOutcome::Ok));
        }
        assert_eq!(local.tenants(), 3);
        // Buckets refill after 100 ms; the fourth op sweeps the shard.
        clock.advance_us(200_000);
        assert_eq!(local.hit(&hit("d", None)), Ok(HitOutcome::Ok));
        assert_eq!(local.tenants(), 1);
    }

    #[test]
    fn a_sweep_on_the_answer_path_visits_a_few_tenants_in_turn() {
        let clock = ManualClock::new(T0);
        let config = LocalConfig {
            shards: 1,
            sweep_every: 1,
            ..LocalConfig::default()
        };
        let local = store(&clock, config);
        let tenants = 10 * SWEEP_TENANTS;
        for i in 0..tenants {
            let req = HitRequest {
                charges: Vec::new(),
                claim: Some(claim(&format!("t{i}"), "k", "h")),
            };
            assert_eq!(local.hit(&req), Ok(HitOutcome::Ok));
        }
        // Every claim is past its pending TTL: each tenant holds nothing.
        clock.advance_us(10_000_000);
        let mut dropped = Vec::new();
        // "other", whose hits sweep, keeps a bucket it charges.
        while local.tenants() > 1 && dropped.len() < 2 * tenants {
            let before = local.stats().dropped;
            local.hit(&hit("other", None)).expect("valid");
            dropped.push(local.stats().dropped - before);
        }
        assert_eq!(local.tenants(), 1, "every tenant was visited in turn");
        assert!(
            dropped.iter().all(|&d| d <= SWEEP_TENANTS as u64),
            "a sweep on the answer path dropped {:?}",
            dropped.iter().max()
        );
        assert!(dropped.len() >= tenants / SWEEP_TENANTS, "{dropped:?}");
    }

    #[test]
    fn a_large_claim_table_is_swept_a_step_at_a_time() {
        let clock = ManualClock::new(T0);
        let config = LocalConfig {
            shards: 1,
            max_tenants: 1_000,
            sweep_every: 64,
            ..LocalConfig::default()
        };
        let local = store(&clock, config);
        let claims = 8 * SWEEP_STEP;
        for i in 0..claims {
            let req = HitRequest {
                charges: Vec::new(),
                claim: Some(claim("big", &format!("k{i}"), "h")),
            };
            assert_eq!(local.hit(&req), Ok(HitOutcome::Ok));
        }
        // One claim committed, which keeps the tenant.
        let live = HitRequest {
            charges: Vec::new(),
            claim: Some(claim("big", "live", "h")),
        };
        assert_eq!(local.hit(&live), Ok(HitOutcome::Ok));
        let commit = settle(claim("big", "live", "h"), Settlement::Commit);
        assert_eq!(local.settle(&commit), Ok(SettleOutcome::Ok));
        // Every other claim is past its pending TTL; every 64th operation
        // sweeps a step.
        clock.advance_us(10_000_000);
        let swept = || local.stats().swept_claims as usize;
        let mut steps = 0;
        while swept() < claims && steps < 1_000 {
            let before = swept();
            for _ in 0..64 {
                local.hit(&hit("other", None)).expect("valid");
            }
            let step = swept() - before;
            assert!(
                step <= SWEEP_STEP,
                "one sweep on the answer path dropped {step} claims"
            );
            steps += 1;
        }
        assert_eq!(swept(), claims);
        assert!(steps > 2, "swept in {steps} steps");
        assert!(local.has_live_claim("big", "src", "live"));
    }

    #[test]
    fn bounded_tenants_evict_empty_first_then_oldest() {
        let clock = ManualClock::new(T0);
        let config = LocalConfig {
            shards: 1,
            max_tenants: 8,
            sweep_every: u32::MAX,
            ..LocalConfig::default()
        };
        let local = store(&clock, config);
        // "old" will be empty (refilled) by the time the shard fills up.
        assert_eq!(local.hit(&hit("old", None)), Ok(HitOutcome::Ok));
        clock.advance_us(1_000_000);
        for i in 0..7 {
            assert_eq!(
                local.hit(&hit(&format!("t{i}"), Some(("k", "h")))),
                Ok(HitOutcome::Ok)
            );
            clock.advance_us(1);
        }
        assert_eq!(local.tenants(), 8);
        assert_eq!(local.hit(&hit("new1", None)), Ok(HitOutcome::Ok));
        assert_eq!(local.tenants(), 8);
        assert_eq!(local.stats().evicted, 0, "the empty tenant went first");
        assert_eq!(local.hit(&hit("new2", None)), Ok(HitOutcome::Ok));
        assert_eq!(local.tenants(), 8);
        assert_eq!(local.stats().evicted, 1);
        assert!(!local.has_live_claim("t0", "src", "k"), "oldest evicted");
        assert!(local.has_live_claim("t1", "src", "k"));
    }

    #[test]
    fn reset_forgets_buckets_keeps_claims() {
        let clock = ManualClock::new(T0);
        let local = store(&clock, LocalConfig::default());
        for _ in 0..3 {
            local.hit(&hit("t", None)).ok();
        }
        assert_eq!(local.reset("t"), Ok(()));
        assert_eq!(local.tenants(), 0, "nothing left, dropped");
        assert_eq!(local.hit(&hit("t", Some(("k", "h")))), Ok(HitOutcome::Ok));
        assert_eq!(local.reset("t"), Ok(()));
        assert!(local.has_live_claim("t", "src", "k"));
        assert!(local.reset("").is_err());
    }

    #[test]
    fn invalid_requests_are_refused() {
        let clock = ManualClock::new(T0);
        let local = store(&clock, LocalConfig::default());
        let empty = HitRequest {
            charges: vec![],
            claim: None,
        };
        assert_eq!(local.hit(&empty), Err(InvalidRequest::NothingToDo));
        assert_eq!(local.tenants(), 0);
    }

    #[test]
    fn survives_a_poisoned_shard() {
        let clock = ManualClock::new(T0);
        let local = Arc::new(store(
            &clock,
            LocalConfig {
                shards: 1,
                ..LocalConfig::default()
            },
        ));
        let poisoner = Arc::clone(&local);
        let _ = std::thread::spawn(move || {
            let _guard = poisoner.lock("t");
            panic!("poison the shard");
        })
        .join();
        assert_eq!(local.hit(&hit("t", None)), Ok(HitOutcome::Ok));
    }
}
