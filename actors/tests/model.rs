//! Property tests of [`TenantState`] against a reference model written to be
//! obviously correct rather than fast.
//!
//! The model keeps every accepted charge's timestamp and recomputes each bucket's
//! level by replaying them as a leaky bucket (a formulation of GCRA independent of
//! the TAT arithmetic under test), and keeps the claim table as a plain map next to
//! a log of every settle the store accepted. Random sequences of hits, settles,
//! resets, sweeps (whole or in steps) and clock steps over a small key/hook space (so claims collide)
//! are run through both, and every outcome is compared.

use std::collections::HashMap;

use ankusa_actors::{
    Charge, Claim, Clock, HitOutcome, HitRequest, Kind, ManualClock, SettleOutcome, SettleRequest,
    Settlement, TenantSnapshot, TenantState,
};
use proptest::prelude::*;

const T0: u64 = 1_700_000_000_000_000;
const TENANT: &str = "t";
const KEYS: [&str; 3] = ["k0", "k1", "k2"];
const HOOKS: [&str; 3] = ["h0", "h1", "h2"];

/// The limits of one test case: fixed per bucket kind, so "capacity + elapsed" is
/// a meaningful bound on what a bucket may have accepted.
#[derive(Debug, Clone, Copy)]
struct Limits {
    increment_us: [u64; 2],
    capacity_us: [u64; 2],
    ttl_ms: u64,
    pending_ttl_ms: u64,
}

#[derive(Debug, Clone)]
enum Op {
    Hit {
        kinds: Vec<Kind>,
        claim: Option<(usize, usize)>,
    },
    /// Settle `key` as `hook`, or as whoever the model says holds it.
    Settle {
        key: usize,
        hook: Option<usize>,
        commit: bool,
    },
    Reset,
    Sweep,
    /// One step of a sweep over this many places of the claim table.
    SweepStep(usize),
    Advance(u64),
}

fn limits() -> impl Strategy<Value = Limits> {
    (
        prop::array::uniform2(1_000u64..50_000),
        prop::array::uniform2(1u64..5),
        prop::array::uniform2(0u64..1_000),
        1u64..400,
        1u64..100,
    )
        .prop_map(|(inc, burst, slack, ttl_ms, pending_ttl_ms)| Limits {
            increment_us: inc,
            capacity_us: [inc[0] * burst[0] + slack[0], inc[1] * burst[1] + slack[1]],
            ttl_ms,
            pending_ttl_ms,
        })
}

fn op() -> impl Strategy<Value = Op> {
    let kinds = prop_oneof![
        Just(vec![]),
        Just(vec![Kind::Hooks]),
        Just(vec![Kind::Bytes]),
        Just(vec![Kind::Hooks, Kind::Bytes]),
        Just(vec![Kind::Bytes, Kind::Hooks]),
    ];
    let claim = prop::option::weighted(0.7, (0..KEYS.len(), 0..HOOKS.len()));
    prop_oneof![
        8 => (kinds, claim).prop_map(|(kinds, claim)| Op::Hit { kinds, claim }),
        4 => (0..KEYS.len(), prop::option::weighted(0.5, 0..HOOKS.len()), prop::bool::weighted(0.7))
            .prop_map(|(key, hook, commit)| Op::Settle { key, hook, commit }),
        1 => Just(Op::Reset),
        1 => Just(Op::Sweep),
        2 => (1usize..3).prop_map(Op::SweepStep),
        5 => prop_oneof![
            Just(0u64),
            0u64..2_000,
            0u64..60_000,
            0u64..600_000,
        ]
        .prop_map(Op::Advance),
    ]
}

#[derive(Debug, Clone)]
struct ModelClaim {
    hook: usize,
    committed: bool,
    expires_us: u64,
}

#[derive(Debug, Clone, Copy)]
enum Settled {
    Commit,
    Release,
}

/// The reference: accepted charge times per bucket and the claim map, plus the log
/// of settles the store answered `Ok`, used to check Duplicate answers on their own.
#[derive(Debug)]
struct Model {
    limits: Limits,
    reset_at: u64,
    accepted: [Vec<u64>; 2],
    claims: HashMap<usize, ModelClaim>,
    settle_log: Vec<(usize, usize, Settled, u64)>,
}

fn ceil_ms(us: u64) -> u64 {
    us.div_ceil(1_000).max(1)
}

fn slot(kind: Kind) -> usize {
    match kind {
        Kind::Hooks => 0,
        Kind::Bytes => 1,
    }
}

impl Model {
    fn new(limits: Limits) -> Self {
        Self {
            limits,
            reset_at: T0,
            accepted: [Vec::new(), Vec::new()],
            claims: HashMap::new(),
            settle_log: Vec::new(),
        }
    }

    /// Leaky bucket: every accepted charge pours `increment` in, which drains at
    /// 1 µs per µs; returns (level at `now`, time of the last pour, level just after).
    fn level(&self, s: usize, now: u64) -> (u64, u64, u64) {
        let inc = self.limits.increment_us[s];
        let (mut level, mut last) = (0u64, self.reset_at);
        for &t in &self.accepted[s] {
            level = level.saturating_sub(t - last) + inc;
            last = t;
        }
        (level.saturating_sub(now - last), last, level)
    }

    /// The TAT the store should hold: when the bucket is empty again.
    fn tat(&self, s: usize) -> u64 {
        if self.accepted[s].is_empty() {
            return 0;
        }
        let (_, last, after) = self.level(s, self.last_accept(s));
        last + after
    }

    fn last_accept(&self, s: usize) -> u64 {
        *self.accepted[s].last().expect("non-empty")
    }

    fn live(&self, key: usize, now: u64) -> Option<&ModelClaim> {
        self.claims.get(&key).filter(|c| c.expires_us > now)
    }

    fn hit(&mut self, now: u64, kinds: &[Kind], claim: Option<(usize, usize)>) -> HitOutcome {
        if let Some((key, hook)) = claim {
            if let Some(c) = self.live(key, now) {
                if !c.committed && c.hook == hook {
                    return HitOutcome::Ok;
                }
            }
        }
        let mut wait = None::<u64>;
        for &kind in kinds {
            let s = slot(kind);
            let (level, _, _) = self.level(s, now);
            let (inc, cap) = (self.limits.increment_us[s], self.limits.capacity_us[s]);
            if level + inc > cap {
                wait = Some(wait.unwrap_or(0).max(level + inc - cap));
            }
        }
        if let Some(wait) = wait {
            return HitOutcome::RateLimited {
                retry_after_ms: ceil_ms(wait),
            };
        }
        if let Some((key, hook)) = claim {
            if let Some(c) = self.live(key, now) {
                return if c.committed {
                    HitOutcome::Duplicate {
                        hook_id: HOOKS[c.hook].into(),
                    }
                } else {
                    HitOutcome::Pending {
                        retry_after_ms: ceil_ms(c.expires_us - now),
                    }
                };
            }
            self.claims.insert(
                key,
                ModelClaim {
                    hook,
                    committed: false,
                    expires_us: now + self.limits.pending_ttl_ms * 1_000,
                },
            );
        }
        for &kind in kinds {
            self.accepted[slot(kind)].push(now);
        }
        HitOutcome::Ok
    }

    fn settle(&mut self, now: u64, key: usize, hook: usize, commit: bool) -> SettleOutcome {
        let ttl_us = self.limits.ttl_ms * 1_000;
        let Some(c) = self.claims.get_mut(&key).filter(|c| c.expires_us > now) else {
            return SettleOutcome::NotFound;
        };
        if c.hook != hook {
            return SettleOutcome::NotOwner {
                hook_id: HOOKS[c.hook].into(),
            };
        }
        match (c.committed, commit) {
            (true, false) => return SettleOutcome::AlreadyCommitted,
            (false, false) => {
                self.claims.remove(&key);
            }
            (false, true) => {
                c.committed = true;
                c.expires_us = now + ttl_us;
            }
            (true, true) => {}
        }
        SettleOutcome::Ok
    }

    fn reset(&mut self, now: u64) {
        self.reset_at = now;
        self.accepted = [Vec::new(), Vec::new()];
    }

    fn is_empty(&self, now: u64) -> bool {
        (0..2).all(|s| self.level(s, now).0 == 0)
            && self.claims.values().all(|c| c.expires_us <= now)
    }

    /// (b) on its own terms: `hook` may be reported as the committed holder of `key`
    /// only if its last accepted commit of the key is still within `ttl_ms` and it
    /// has not released the key since.
    fn duplicate_is_justified(&self, now: u64, key: usize, hook: usize) -> bool {
        let last = self
            .settle_log
            .iter()
            .rev()
            .find(|(k, h, _, _)| *k == key && *h == hook);
        match last {
            Some(&(_, _, Settled::Commit, at)) => at + self.limits.ttl_ms * 1_000 > now,
            Some(&(_, _, Settled::Release, _)) | None => false,
        }
    }
}

fn request(limits: &Limits, kinds: &[Kind], claim: Option<(usize, usize)>) -> HitRequest {
    HitRequest {
        charges: kinds
            .iter()
            .map(|&kind| Charge {
                kind,
                tenant: TENANT.into(),
                increment_us: limits.increment_us[slot(kind)],
                capacity_us: limits.capacity_us[slot(kind)],
            })
            .collect(),
        claim: claim.map(|(key, hook)| claim_for(limits, key, hook)),
    }
}

fn claim_for(limits: &Limits, key: usize, hook: usize) -> Claim {
    Claim {
        tenant: TENANT.into(),
        source_id: "src".into(),
        key: KEYS[key].into(),
        hook_id: HOOKS[hook].into(),
        node: format!("node-{hook}"),
        ttl_ms: limits.ttl_ms,
        pending_ttl_ms: limits.pending_ttl_ms,
    }
}

/// A snapshot with its claims in a fixed order, so two of the same state compare equal.
fn canonical(state: &TenantState, now: u64) -> TenantSnapshot {
    let mut snap = state.snapshot(TENANT, now);
    snap.claims.sort_by(|a, b| a.key().cmp(b.key()));
    snap
}

fn run(limits: Limits, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let clock = ManualClock::new(T0);
    let mut state = TenantState::default();
    let mut model = Model::new(limits);
    // Charges the store itself reported taken since the last reset, per bucket.
    let mut taken = [0u64; 2];

    for (i, op) in ops.into_iter().enumerate() {
        let now = clock.now_us();
        match op {
            Op::Hit { kinds, claim } => {
                let kinds = if kinds.is_empty() && claim.is_none() {
                    vec![Kind::Hooks]
                } else {
                    kinds
                };
                let req = request(&limits, &kinds, claim);
                prop_assert_eq!(req.validate(), Ok(()));
                let before = canonical(&state, now);
                let tats_before = [state.tat(Kind::Hooks), state.tat(Kind::Bytes)];

                let applied = state.hit(now, &req);
                let want = model.hit(now, &kinds, claim);
                prop_assert_eq!(&applied.outcome, &want, "op {}: {:?}", i, req);

                match &applied.outcome {
                    HitOutcome::RateLimited { retry_after_ms } => {
                        prop_assert!(*retry_after_ms >= 1);
                        prop_assert!(applied.changes.is_empty());
                        prop_assert_eq!(canonical(&state, now), before, "denied hit wrote");
                    }
                    HitOutcome::Duplicate { hook_id } => {
                        let (key, _) = claim.expect("only a claim is a duplicate");
                        let hook = HOOKS.iter().position(|h| h == hook_id).expect("known hook");
                        prop_assert!(
                            model.duplicate_is_justified(now, key, hook),
                            "op {}: Duplicate({}) for {} with log {:?}",
                            i,
                            hook_id,
                            KEYS[key],
                            model.settle_log
                        );
                        prop_assert!(applied.changes.is_empty());
                        prop_assert_eq!(canonical(&state, now), before);
                    }
                    HitOutcome::Pending { retry_after_ms } => {
                        prop_assert!(*retry_after_ms >= 1);
                        prop_assert!(applied.changes.is_empty());
                        prop_assert_eq!(canonical(&state, now), before);
                    }
                    HitOutcome::Ok => {
                        let moved: Vec<Kind> =
                            applied.changes.buckets.iter().map(|b| b.kind).collect();
                        let charged = moved == kinds;
                        // A replay of one's own pending claim is the only Ok that
                        // takes nothing; any other Ok takes every charge.
                        prop_assert!(
                            charged || moved.is_empty(),
                            "op {}: partial charge {:?} of {:?}",
                            i,
                            moved,
                            kinds
                        );
                        if moved.is_empty() && !kinds.is_empty() {
                            prop_assert_eq!(
                                [state.tat(Kind::Hooks), state.tat(Kind::Bytes)],
                                tats_before
                            );
                        }
                        for kind in moved {
                            taken[slot(kind)] += 1;
                        }
                        prop_assert_eq!(applied.changes.claim.is_some(), claim.is_some());
                    }
                }
            }
            Op::Settle { key, hook, commit } => {
                let hook = hook
                    .or_else(|| model.live(key, now).map(|c| c.hook))
                    .unwrap_or(0);
                let settlement = if commit {
                    Settlement::Commit
                } else {
                    Settlement::Release
                };
                let req = SettleRequest {
                    claim: claim_for(&limits, key, hook),
                    settlement,
                };
                let tats = [state.tat(Kind::Hooks), state.tat(Kind::Bytes)];
                let applied = state.settle(now, &req);
                let want = model.settle(now, key, hook, commit);
                prop_assert_eq!(&applied.outcome, &want, "op {}: {:?}", i, req);
                prop_assert!(applied.changes.buckets.is_empty());
                prop_assert_eq!(applied.changes.claim.is_some(), want == SettleOutcome::Ok);
                prop_assert_eq!([state.tat(Kind::Hooks), state.tat(Kind::Bytes)], tats);
                if applied.outcome == SettleOutcome::Ok {
                    let settled = if commit {
                        Settled::Commit
                    } else {
                        Settled::Release
                    };
                    // A repeated commit keeps the first expiry; log only the one
                    // that made the claim committed, so the check stays exact.
                    let repeat = commit
                        && model
                            .settle_log
                            .iter()
                            .rev()
                            .find(|e| e.0 == key)
                            .is_some_and(|&(_, h, s, at)| {
                                h == hook
                                    && matches!(s, Settled::Commit)
                                    && at + limits.ttl_ms * 1_000 > now
                            });
                    if !repeat {
                        model.settle_log.push((key, hook, settled, now));
                    }
                }
            }
            Op::Reset => {
                let changes = state.reset();
                prop_assert_eq!(changes.buckets.len(), 2);
                model.reset(now);
                taken = [0, 0];
            }
            Op::Sweep => {
                let before = canonical(&state, now);
                state.sweep(now);
                prop_assert_eq!(canonical(&state, now), before, "sweep changed live state");
                prop_assert!(state.claims().iter().all(|(_, e)| e.is_live(now)));
            }
            Op::SweepStep(buckets) => {
                let before = canonical(&state, now);
                state.sweep_step(now, buckets);
                prop_assert_eq!(
                    canonical(&state, now),
                    before,
                    "sweep step changed live state"
                );
            }
            Op::Advance(us) => clock.advance_us(us),
        }

        let now = clock.now_us();
        // (a) Never more than the burst plus what the elapsed time has refilled.
        for kind in Kind::ALL {
            let s = slot(kind);
            let allowed = limits.capacity_us[s] + (now - model.reset_at);
            prop_assert!(
                taken[s] * limits.increment_us[s] <= allowed,
                "op {}: {:?} took {} × {} µs > {} µs",
                i,
                kind,
                taken[s],
                limits.increment_us[s],
                allowed
            );
            prop_assert_eq!(taken[s], model.accepted[s].len() as u64);
            prop_assert_eq!(state.tat(kind), model.tat(s), "op {}: {:?} TAT", i, kind);
        }
        prop_assert_eq!(
            state.is_empty(now),
            model.is_empty(now),
            "op {}: is_empty",
            i
        );
        let live: usize = state
            .claims()
            .iter()
            .filter(|(_, e)| e.is_live(now))
            .count();
        prop_assert_eq!(
            live,
            (0..KEYS.len())
                .filter(|&k| model.live(k, now).is_some())
                .count()
        );
    }

    // The state survives its own snapshot: a restored copy answers alike.
    let now = clock.now_us();
    let restored = TenantState::from_snapshot(state.snapshot(TENANT, now), now);
    prop_assert_eq!(canonical(&restored, now), canonical(&state, now));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn tenant_state_matches_the_reference_model(
        limits in limits(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(limits, ops)?;
    }
}
