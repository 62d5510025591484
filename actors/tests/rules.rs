//! Every rule of [`TenantState`] and of request validation, one behaviour per test:
//! GCRA burst and rate, all-or-nothing hits, the two-phase claim and its settles,
//! expiry, reset, emptiness, inspection, snapshots, and each [`InvalidRequest`]
//! variant.

use ankusa_actors::types::limits;
use ankusa_actors::types::validate_tenant;
use ankusa_actors::{
    BucketView, Charge, Claim, ClaimChange, ClaimRecord, ClaimView, ClaimsFull, Clock, EventKey,
    HitOutcome, HitRequest, InspectRequest, InvalidRequest, Kind, ManualClock, SettleOutcome,
    SettleRequest, Settlement, TenantSnapshot, TenantState, TenantView,
};

const T0: u64 = 1_700_000_000_000_000;
const TENANT: &str = "acme";

fn charge(kind: Kind, increment_us: u64, capacity_us: u64) -> Charge {
    Charge {
        kind,
        tenant: TENANT.into(),
        increment_us,
        capacity_us,
    }
}

fn claim(key: &str, hook_id: &str) -> Claim {
    Claim {
        tenant: TENANT.into(),
        source_id: "stripe".into(),
        key: key.into(),
        hook_id: hook_id.into(),
        node: "node-a".into(),
        ttl_ms: 60_000,
        pending_ttl_ms: 5_000,
    }
}

fn hit(charges: Vec<Charge>, claim: Option<Claim>) -> HitRequest {
    let req = HitRequest { charges, claim };
    req.validate().expect("test requests are valid");
    req
}

fn settle(claim: Claim, settlement: Settlement) -> SettleRequest {
    SettleRequest { claim, settlement }
}

/// Ten hooks per second with a burst of three, and 1 kB/s of bytes with a 4 kB burst
/// charged 1 kB a hook.
fn two_charges() -> Vec<Charge> {
    vec![
        charge(Kind::Hooks, 100_000, 300_000),
        charge(Kind::Bytes, 1_000_000, 4_000_000),
    ]
}

fn rate_limited_ms(outcome: &HitOutcome) -> u64 {
    match outcome {
        HitOutcome::RateLimited { retry_after_ms } => *retry_after_ms,
        other => panic!("expected RateLimited, got {other:?}"),
    }
}

// ---------------------------------------------------------------- GCRA

#[test]
fn burst_is_capacity_over_increment_then_one_per_increment() {
    let mut state = TenantState::default();
    let req = hit(vec![charge(Kind::Hooks, 100_000, 300_000)], None);
    for _ in 0..3 {
        assert_eq!(state.hit(T0, &req).outcome, HitOutcome::Ok);
    }
    assert_eq!(rate_limited_ms(&state.hit(T0, &req).outcome), 100);
    // One increment later exactly one more passes.
    let t = T0 + 100_000;
    assert_eq!(state.hit(t, &req).outcome, HitOutcome::Ok);
    assert_eq!(rate_limited_ms(&state.hit(t, &req).outcome), 100);
}

#[test]
fn bucket_refills_fully_after_capacity_and_no_further() {
    let mut state = TenantState::default();
    let req = hit(vec![charge(Kind::Hooks, 100_000, 300_000)], None);
    for _ in 0..3 {
        assert_eq!(state.hit(T0, &req).outcome, HitOutcome::Ok);
    }
    // Long idle: still only a burst of three, not more.
    let t = T0 + 3_600_000_000;
    for _ in 0..3 {
        assert_eq!(state.hit(t, &req).outcome, HitOutcome::Ok);
    }
    assert!(matches!(
        state.hit(t, &req).outcome,
        HitOutcome::RateLimited { .. }
    ));
}

#[test]
fn increment_equal_to_capacity_allows_one_at_a_time() {
    let mut state = TenantState::default();
    let req = hit(vec![charge(Kind::Hooks, 250_000, 250_000)], None);
    assert_eq!(state.hit(T0, &req).outcome, HitOutcome::Ok);
    assert_eq!(rate_limited_ms(&state.hit(T0, &req).outcome), 250);
    assert!(matches!(
        state.hit(T0 + 249_999, &req).outcome,
        HitOutcome::RateLimited { .. }
    ));
    assert_eq!(state.hit(T0 + 250_000, &req).outcome, HitOutcome::Ok);
}

#[test]
fn retry_after_rounds_up_to_whole_ms_and_is_never_zero() {
    // Increments of 1 µs .. 1001 µs against capacity = increment: the wait after one
    // charge is exactly one increment.
    for (increment_us, want_ms) in [(1, 1), (999, 1), (1_000, 1), (1_001, 2), (2_500, 3)] {
        let mut state = TenantState::default();
        let req = hit(vec![charge(Kind::Hooks, increment_us, increment_us)], None);
        assert_eq!(state.hit(T0, &req).outcome, HitOutcome::Ok);
        assert_eq!(
            rate_limited_ms(&state.hit(T0, &req).outcome),
            want_ms,
            "increment {increment_us} µs"
        );
    }
}

#[test]
fn retry_after_is_the_wait_left_not_the_whole_increment() {
    let mut state = TenantState::default();
    let req = hit(vec![charge(Kind::Hooks, 10_000, 10_000)], None);
    assert_eq!(state.hit(T0, &req).outcome, HitOutcome::Ok);
    assert_eq!(rate_limited_ms(&state.hit(T0 + 2_500, &req).outcome), 8);
    assert_eq!(rate_limited_ms(&state.hit(T0 + 9_999, &req).outcome), 1);
    assert_eq!(state.hit(T0 + 10_000, &req).outcome, HitOutcome::Ok);
}

#[test]
fn buckets_of_the_two_kinds_are_independent() {
    let mut state = TenantState::default();
    let hooks = hit(vec![charge(Kind::Hooks, 1_000, 1_000)], None);
    let bytes = hit(vec![charge(Kind::Bytes, 1_000, 1_000)], None);
    assert_eq!(state.hit(T0, &hooks).outcome, HitOutcome::Ok);
    assert_eq!(state.hit(T0, &bytes).outcome, HitOutcome::Ok);
    assert_eq!(state.tat(Kind::Hooks), T0 + 1_000);
    assert_eq!(state.tat(Kind::Bytes), T0 + 1_000);
}

#[test]
fn accepted_hit_reports_every_moved_bucket() {
    let mut state = TenantState::default();
    let applied = state.hit(T0, &hit(two_charges(), None));
    assert_eq!(applied.outcome, HitOutcome::Ok);
    assert_eq!(applied.changes.claim, None);
    let moved: Vec<(Kind, u64)> = applied
        .changes
        .buckets
        .iter()
        .map(|b| (b.kind, b.tat_us))
        .collect();
    assert_eq!(
        moved,
        vec![(Kind::Hooks, T0 + 100_000), (Kind::Bytes, T0 + 1_000_000)]
    );
}

// ---------------------------------------------------------------- all or nothing

/// Drains the hooks bucket (burst of 3) while the bytes bucket has room left.
fn drained_hooks_state() -> TenantState {
    let mut state = TenantState::default();
    let hooks = hit(vec![charge(Kind::Hooks, 100_000, 300_000)], None);
    for _ in 0..3 {
        assert_eq!(state.hit(T0, &hooks).outcome, HitOutcome::Ok);
    }
    state
}

#[test]
fn denied_charge_moves_neither_bucket_nor_claims() {
    let mut state = drained_hooks_state();
    let before = state.snapshot(TENANT, T0);
    let bytes_tat = state.tat(Kind::Bytes);
    let applied = state.hit(T0, &hit(two_charges(), Some(claim("evt-1", "hook-1"))));
    assert!(matches!(applied.outcome, HitOutcome::RateLimited { .. }));
    assert!(applied.changes.is_empty(), "{:?}", applied.changes);
    assert_eq!(
        state.tat(Kind::Bytes),
        bytes_tat,
        "the passing bucket moved"
    );
    assert_eq!(state.snapshot(TENANT, T0), before);
    assert!(state.claims().is_empty());
    // The key was not taken: another hook can claim it once the rate allows.
    let later = T0 + 100_000;
    let applied = state.hit(later, &hit(two_charges(), Some(claim("evt-1", "hook-2"))));
    assert_eq!(applied.outcome, HitOutcome::Ok);
}

#[test]
fn denied_charge_comes_before_the_claim_even_for_a_committed_key() {
    let mut state = TenantState::default();
    let c = claim("evt-1", "hook-1");
    assert_eq!(
        state.hit(T0, &hit(vec![], Some(c.clone()))).outcome,
        HitOutcome::Ok
    );
    assert_eq!(
        state.settle(T0, &settle(c, Settlement::Commit)).outcome,
        SettleOutcome::Ok
    );
    let limited = hit(vec![charge(Kind::Hooks, 1_000, 1_000)], None);
    assert_eq!(state.hit(T0, &limited).outcome, HitOutcome::Ok);
    let dup = hit(
        vec![charge(Kind::Hooks, 1_000, 1_000)],
        Some(claim("evt-1", "hook-2")),
    );
    assert!(matches!(
        state.hit(T0, &dup).outcome,
        HitOutcome::RateLimited { .. }
    ));
}

/// Waiting exactly `retry_after_ms` lets the whole hit pass; when the rounding left
/// room, 1 ms less does not.
fn assert_retry_after_is_earliest_pass(
    mut state: TenantState,
    clock: &ManualClock,
    req: &HitRequest,
) {
    let before = state.clone();
    let ms = rate_limited_ms(&state.hit(clock.now_us(), req).outcome);
    assert!(ms >= 1);
    if ms > 1 {
        let early = clock.now_us() + (ms - 1) * 1_000;
        let mut probe = before.clone();
        assert!(
            matches!(
                probe.hit(early, req).outcome,
                HitOutcome::RateLimited { .. }
            ),
            "passed 1 ms before retry_after"
        );
    }
    clock.advance_us(ms * 1_000);
    assert_eq!(state.hit(clock.now_us(), req).outcome, HitOutcome::Ok);
}

#[test]
fn retry_after_is_when_the_whole_hit_passes_both_denied() {
    let clock = ManualClock::new(T0);
    let mut state = TenantState::default();
    // Hooks: 3 per 300 ms; bytes: 4 s burst of 1 s a hook. Four hits drain bytes to
    // its limit and hooks past its own, so both deny and bytes needs longer.
    let req = hit(two_charges(), None);
    for _ in 0..3 {
        assert_eq!(state.hit(clock.now_us(), &req).outcome, HitOutcome::Ok);
    }
    let bytes_only = hit(vec![charge(Kind::Bytes, 1_000_000, 4_000_000)], None);
    assert_eq!(
        state.hit(clock.now_us(), &bytes_only).outcome,
        HitOutcome::Ok
    );
    // Hooks needs 100 ms, bytes 1000 ms: the answer is the larger.
    let mut probe = state.clone();
    assert_eq!(
        rate_limited_ms(&probe.hit(clock.now_us(), &req).outcome),
        1_000
    );
    assert_retry_after_is_earliest_pass(state, &clock, &req);
}

#[test]
fn retry_after_is_when_the_whole_hit_passes_one_denied() {
    let clock = ManualClock::new(T0);
    let state = drained_hooks_state();
    let req = hit(two_charges(), Some(claim("evt-9", "hook-9")));
    assert_retry_after_is_earliest_pass(state, &clock, &req);
}

#[test]
fn retry_after_with_sub_ms_remainder() {
    let clock = ManualClock::new(T0);
    let mut state = TenantState::default();
    let req = hit(vec![charge(Kind::Hooks, 7_300, 7_300)], None);
    assert_eq!(state.hit(clock.now_us(), &req).outcome, HitOutcome::Ok);
    clock.advance_us(1_150);
    // 6150 µs left: 7 ms, and 6 ms is too early.
    let mut probe = state.clone();
    assert_eq!(rate_limited_ms(&probe.hit(clock.now_us(), &req).outcome), 7);
    assert_retry_after_is_earliest_pass(state, &clock, &req);
}

// ---------------------------------------------------------------- claims

#[test]
fn first_claim_is_pending_and_reported_with_its_expiry() {
    let mut state = TenantState::default();
    let c = claim("evt-1", "hook-1");
    let applied = state.hit(T0, &hit(two_charges(), Some(c.clone())));
    assert_eq!(applied.outcome, HitOutcome::Ok);
    assert_eq!(
        applied.changes.claim,
        Some(ClaimChange::Put(ClaimRecord::new(
            &c.source_id,
            &c.key,
            &c.hook_id,
            Some(&c.node),
            false,
            T0 + c.pending_ttl_ms * 1_000,
        )))
    );
    assert_eq!(applied.changes.buckets.len(), 2);
}

#[test]
fn pending_claim_answers_pending_with_time_left_and_spends_nothing() {
    let mut state = TenantState::default();
    let req1 = hit(two_charges(), Some(claim("evt-1", "hook-1")));
    assert_eq!(state.hit(T0, &req1).outcome, HitOutcome::Ok);
    let tats = (state.tat(Kind::Hooks), state.tat(Kind::Bytes));

    let req2 = hit(two_charges(), Some(claim("evt-1", "hook-2")));
    let applied = state.hit(T0 + 1_200_500, &req2);
    // 5 s pending, 1.2005 s gone: 3.7995 s left, rounded up.
    assert_eq!(
        applied.outcome,
        HitOutcome::Pending {
            retry_after_ms: 3_800
        }
    );
    assert!(applied.changes.is_empty());
    assert_eq!((state.tat(Kind::Hooks), state.tat(Kind::Bytes)), tats);
}

#[test]
fn pending_retry_after_is_at_least_one_ms() {
    let mut state = TenantState::default();
    let c = claim("evt-1", "hook-1");
    assert_eq!(
        state.hit(T0, &hit(vec![], Some(c.clone()))).outcome,
        HitOutcome::Ok
    );
    let expiry = T0 + c.pending_ttl_ms * 1_000;
    let other = hit(vec![], Some(claim("evt-1", "hook-2")));
    assert_eq!(
        state.hit(expiry - 1, &other).outcome,
        HitOutcome::Pending { retry_after_ms: 1 }
    );
}

#[test]
fn committed_claim_answers_duplicate_and_spends_nothing() {
    let mut state = TenantState::default();
    let c = claim("evt-1", "hook-1");
    assert_eq!(
        state.hit(T0, &hit(two_charges(), Some(c.clone()))).outcome,
        HitOutcome::Ok
    );
    assert_eq!(
        state
            .settle(T0, &settle(c.clone(), Settlement::Commit))
            .outcome,
        SettleOutcome::Ok
    );
    let tats = (state.tat(Kind::Hooks), state.tat(Kind::Bytes));
    let applied = state.hit(T0, &hit(two_charges(), Some(claim("evt-1", "hook-2"))));
    assert_eq!(
        applied.outcome,
        HitOutcome::Duplicate {
            hook_id: "hook-1".into()
        }
    );
    assert!(applied.changes.is_empty());
    assert_eq!((state.tat(Kind::Hooks), state.tat(Kind::Bytes)), tats);
    // The committing hook meeting its own committed key is a duplicate too: it is stored.
    assert_eq!(
        state.hit(T0, &hit(vec![], Some(c))).outcome,
        HitOutcome::Duplicate {
            hook_id: "hook-1".into()
        }
    );
}

#[test]
fn replay_of_own_pending_claim_is_ok_and_spends_nothing() {
    let mut state = TenantState::default();
    let req = hit(
        vec![charge(Kind::Hooks, 1_000, 1_000)],
        Some(claim("evt-1", "hook-1")),
    );
    let first = state.hit(T0, &req);
    assert_eq!(first.outcome, HitOutcome::Ok);
    let tat = state.tat(Kind::Hooks);
    // The bucket is empty now: a charge would be denied, the replay is not charged.
    let replay = state.hit(T0, &req);
    assert_eq!(replay.outcome, HitOutcome::Ok);
    assert!(replay.changes.buckets.is_empty());
    assert_eq!(
        replay.changes.claim, first.changes.claim,
        "same claim, same expiry"
    );
    assert_eq!(state.tat(Kind::Hooks), tat);
    assert_eq!(state.claims().len(), 1);
}

#[test]
fn claims_are_scoped_by_source_id_and_key() {
    let mut state = TenantState::default();
    let a = claim("evt-1", "hook-1");
    let mut other_source = claim("evt-1", "hook-2");
    other_source.source_id = "github".into();
    // "stripe"+"evt-1" against "strip"+"eevt-1": packing must not collide.
    let mut shifted = claim("eevt-1", "hook-3");
    shifted.source_id = "strip".into();
    for c in [a, other_source, shifted] {
        assert_eq!(state.hit(T0, &hit(vec![], Some(c))).outcome, HitOutcome::Ok);
    }
    assert_eq!(state.claims().len(), 3);
}

#[test]
fn claim_without_charges_is_allowed() {
    let mut state = TenantState::default();
    let applied = state.hit(T0, &hit(vec![], Some(claim("evt-1", "hook-1"))));
    assert_eq!(applied.outcome, HitOutcome::Ok);
    assert!(applied.changes.buckets.is_empty());
    assert!(applied.changes.claim.is_some());
}

#[test]
fn a_full_claim_table_refuses_new_keys_only_and_spends_nothing() {
    let mut state = TenantState::default();
    let charges = || vec![charge(Kind::Hooks, 100_000, 1_000_000)];
    let claim_at = |state: &mut TenantState, t: u64, key: &str, hook: &str| {
        state.hit_within(t, &hit(charges(), Some(claim(key, hook))), 2)
    };
    let ok = |r: Result<ankusa_actors::Applied<HitOutcome>, ClaimsFull>| r.map(|a| a.outcome);
    assert_eq!(ok(claim_at(&mut state, T0, "a", "h1")), Ok(HitOutcome::Ok));
    assert_eq!(ok(claim_at(&mut state, T0, "b", "h2")), Ok(HitOutcome::Ok));
    let commit = settle(claim("a", "h1"), Settlement::Commit);
    assert_eq!(state.settle(T0, &commit).outcome, SettleOutcome::Ok);

    // A third key is refused, and the refusal spent none of the bucket.
    let tat = state.tat(Kind::Hooks);
    assert_eq!(
        claim_at(&mut state, T0, "c", "h3"),
        Err(ClaimsFull { held: 2, max: 2 })
    );
    assert_eq!(state.tat(Kind::Hooks), tat);
    assert_eq!(state.claims().len(), 2);

    // Keys already held are still answered: a redelivery of the committed
    // hook is a duplicate, another hook on the pending key waits, and the
    // pending hook's own replay is its claim again.
    assert_eq!(
        ok(claim_at(&mut state, T0, "a", "h9")),
        Ok(HitOutcome::Duplicate {
            hook_id: "h1".into()
        })
    );
    assert!(matches!(
        ok(claim_at(&mut state, T0, "b", "h9")),
        Ok(HitOutcome::Pending { .. })
    ));
    assert_eq!(ok(claim_at(&mut state, T0, "b", "h2")), Ok(HitOutcome::Ok));
    // A hit without a claim is not refused.
    assert_eq!(
        state
            .hit_within(T0, &hit(charges(), None), 2)
            .map(|a| a.outcome),
        Ok(HitOutcome::Ok)
    );

    // Once the pending claim expires its place is taken again where it lies.
    let later = T0 + 5_000_000;
    assert_eq!(
        ok(claim_at(&mut state, later, "b", "h4")),
        Ok(HitOutcome::Ok)
    );
    assert_eq!(state.claims().len(), 2);
    // Only sweeping frees a place for a new key: an expired claim still counts.
    let after_pending = T0 + 10_000_001;
    assert!(claim_at(&mut state, after_pending, "c", "h3").is_err());
    assert_eq!(state.sweep(after_pending), 1);
    assert_eq!(
        ok(claim_at(&mut state, after_pending, "c", "h3")),
        Ok(HitOutcome::Ok)
    );
}

// ---------------------------------------------------------------- settle

fn pending(c: &Claim) -> TenantState {
    let mut state = TenantState::default();
    assert_eq!(
        state.hit(T0, &hit(vec![], Some(c.clone()))).outcome,
        HitOutcome::Ok
    );
    state
}

#[test]
fn commit_makes_the_claim_committed_for_ttl() {
    let c = claim("evt-1", "hook-1");
    let mut state = pending(&c);
    let t = T0 + 1_000;
    let applied = state.settle(t, &settle(c.clone(), Settlement::Commit));
    assert_eq!(applied.outcome, SettleOutcome::Ok);
    assert_eq!(
        applied.changes.claim,
        Some(ClaimChange::Put(ClaimRecord::new(
            &c.source_id,
            &c.key,
            &c.hook_id,
            None,
            true,
            t + c.ttl_ms * 1_000,
        )))
    );
    assert!(applied.changes.buckets.is_empty());
}

#[test]
fn repeated_commit_is_ok_and_keeps_the_first_expiry() {
    let c = claim("evt-1", "hook-1");
    let mut state = pending(&c);
    state.settle(T0, &settle(c.clone(), Settlement::Commit));
    let again = state.settle(T0 + 30_000_000, &settle(c.clone(), Settlement::Commit));
    assert_eq!(again.outcome, SettleOutcome::Ok);
    match again.changes.claim {
        Some(ClaimChange::Put(record)) => {
            assert!(record.committed);
            assert_eq!(record.expires_us, T0 + c.ttl_ms * 1_000);
        }
        other => panic!("expected a Put, got {other:?}"),
    }
    // Still gone at the first commit's expiry.
    let other = hit(vec![], Some(claim("evt-1", "hook-2")));
    assert_eq!(
        state.hit(T0 + c.ttl_ms * 1_000, &other).outcome,
        HitOutcome::Ok
    );
}

#[test]
fn release_frees_the_key() {
    let c = claim("evt-1", "hook-1");
    let mut state = pending(&c);
    let applied = state.settle(T0, &settle(c.clone(), Settlement::Release));
    assert_eq!(applied.outcome, SettleOutcome::Ok);
    assert_eq!(
        applied.changes.claim,
        Some(ClaimChange::Delete {
            source_id: c.source_id.clone(),
            key: c.key.clone(),
            hook_id: c.hook_id.clone(),
            expires_us: T0 + c.pending_ttl_ms * 1000,
        })
    );
    assert!(state.claims().is_empty());
    let other = hit(vec![], Some(claim("evt-1", "hook-2")));
    assert_eq!(state.hit(T0, &other).outcome, HitOutcome::Ok);
}

#[test]
fn settle_of_unknown_key_is_not_found() {
    let mut state = TenantState::default();
    for settlement in [Settlement::Commit, Settlement::Release] {
        let applied = state.settle(T0, &settle(claim("evt-1", "hook-1"), settlement));
        assert_eq!(applied.outcome, SettleOutcome::NotFound);
        assert!(applied.changes.is_empty());
    }
    assert!(state.claims().is_empty());
}

#[test]
fn settle_after_pending_expiry_is_not_found_and_commits_nothing() {
    let c = claim("evt-1", "hook-1");
    let mut state = pending(&c);
    let expiry = T0 + c.pending_ttl_ms * 1_000;
    let applied = state.settle(expiry, &settle(c.clone(), Settlement::Commit));
    assert_eq!(applied.outcome, SettleOutcome::NotFound);
    assert!(applied.changes.is_empty());
    let other = hit(vec![], Some(claim("evt-1", "hook-2")));
    assert_eq!(state.hit(expiry, &other).outcome, HitOutcome::Ok);
    assert_eq!(
        state
            .settle(expiry, &settle(c, Settlement::Release))
            .outcome,
        SettleOutcome::NotOwner {
            hook_id: "hook-2".into()
        }
    );
}

#[test]
fn settle_after_commit_expiry_is_not_found() {
    let c = claim("evt-1", "hook-1");
    let mut state = pending(&c);
    state.settle(T0, &settle(c.clone(), Settlement::Commit));
    let expiry = T0 + c.ttl_ms * 1_000;
    for settlement in [Settlement::Commit, Settlement::Release] {
        assert_eq!(
            state.settle(expiry, &settle(c.clone(), settlement)).outcome,
            SettleOutcome::NotFound
        );
    }
}

#[test]
fn settle_by_another_hook_is_not_owner_and_changes_nothing() {
    let c = claim("evt-1", "hook-1");
    let intruder = claim("evt-1", "hook-2");
    for holder_committed in [false, true] {
        let mut state = pending(&c);
        if holder_committed {
            state.settle(T0, &settle(c.clone(), Settlement::Commit));
        }
        let before = state.snapshot(TENANT, T0);
        for settlement in [Settlement::Commit, Settlement::Release] {
            let applied = state.settle(T0, &settle(intruder.clone(), settlement));
            assert_eq!(
                applied.outcome,
                SettleOutcome::NotOwner {
                    hook_id: "hook-1".into()
                }
            );
            assert!(applied.changes.is_empty());
        }
        assert_eq!(state.snapshot(TENANT, T0), before);
    }
}

#[test]
fn release_after_commit_is_refused_and_the_claim_stays() {
    let c = claim("evt-1", "hook-1");
    let mut state = pending(&c);
    state.settle(T0, &settle(c.clone(), Settlement::Commit));
    let applied = state.settle(T0, &settle(c.clone(), Settlement::Release));
    assert_eq!(applied.outcome, SettleOutcome::AlreadyCommitted);
    assert!(applied.changes.is_empty());
    assert_eq!(
        state
            .hit(T0, &hit(vec![], Some(claim("evt-1", "hook-2"))))
            .outcome,
        HitOutcome::Duplicate {
            hook_id: "hook-1".into()
        }
    );
}

#[test]
fn settle_after_release_is_not_found() {
    let c = claim("evt-1", "hook-1");
    let mut state = pending(&c);
    state.settle(T0, &settle(c.clone(), Settlement::Release));
    assert_eq!(
        state.settle(T0, &settle(c, Settlement::Commit)).outcome,
        SettleOutcome::NotFound
    );
}

// ---------------------------------------------------------------- expiry

#[test]
fn pending_claim_expiry_frees_the_key() {
    let c = claim("evt-1", "hook-1");
    let mut state = pending(&c);
    let expiry = T0 + c.pending_ttl_ms * 1_000;
    let other = hit(vec![], Some(claim("evt-1", "hook-2")));
    assert!(matches!(
        state.clone().hit(expiry - 1, &other).outcome,
        HitOutcome::Pending { .. }
    ));
    assert_eq!(state.hit(expiry, &other).outcome, HitOutcome::Ok);
}

#[test]
fn expired_pending_claim_replayed_by_its_hook_is_a_fresh_charged_claim() {
    let c = claim("evt-1", "hook-1");
    let mut state = pending(&c);
    let expiry = T0 + c.pending_ttl_ms * 1_000;
    let req = hit(vec![charge(Kind::Hooks, 1_000, 1_000)], Some(c));
    let applied = state.hit(expiry, &req);
    assert_eq!(applied.outcome, HitOutcome::Ok);
    assert_eq!(
        applied.changes.buckets.len(),
        1,
        "an expired claim is no replay"
    );
}

#[test]
fn committed_claim_expiry_frees_the_key() {
    let c = claim("evt-1", "hook-1");
    let mut state = pending(&c);
    state.settle(T0, &settle(c.clone(), Settlement::Commit));
    let expiry = T0 + c.ttl_ms * 1_000;
    let other = hit(vec![], Some(claim("evt-1", "hook-2")));
    assert!(matches!(
        state.clone().hit(expiry - 1, &other).outcome,
        HitOutcome::Duplicate { .. }
    ));
    assert_eq!(state.hit(expiry, &other).outcome, HitOutcome::Ok);
}

#[test]
fn sweep_drops_only_expired_claims() {
    let mut state = TenantState::default();
    let short = claim("evt-1", "hook-1");
    let mut long = claim("evt-2", "hook-2");
    long.pending_ttl_ms = 10_000;
    for c in [short.clone(), long] {
        state.hit(T0, &hit(vec![], Some(c)));
    }
    assert_eq!(state.sweep(T0 + 4_999_999), 0);
    assert_eq!(state.sweep(T0 + short.pending_ttl_ms * 1_000), 1);
    assert_eq!(state.claims().len(), 1);
}

// ---------------------------------------------------------------- reset, empty

#[test]
fn reset_forgets_buckets_but_not_claims() {
    let mut state = drained_hooks_state();
    let c = claim("evt-1", "hook-1");
    state.hit(T0, &hit(vec![], Some(c.clone())));
    state.settle(T0, &settle(c, Settlement::Commit));
    let changes = state.reset();
    assert_eq!(changes.claim, None);
    let zeroed: Vec<(Kind, u64)> = changes.buckets.iter().map(|b| (b.kind, b.tat_us)).collect();
    assert_eq!(zeroed, vec![(Kind::Hooks, 0), (Kind::Bytes, 0)]);
    assert_eq!(state.tat(Kind::Hooks), 0);
    // A full burst again, and the commit still answers.
    let hooks = hit(vec![charge(Kind::Hooks, 100_000, 300_000)], None);
    for _ in 0..3 {
        assert_eq!(state.hit(T0, &hooks).outcome, HitOutcome::Ok);
    }
    assert_eq!(
        state
            .hit(T0, &hit(vec![], Some(claim("evt-1", "hook-2"))))
            .outcome,
        HitOutcome::Duplicate {
            hook_id: "hook-1".into()
        }
    );
}

#[test]
fn is_empty_follows_buckets_and_live_claims() {
    let mut state = TenantState::default();
    assert!(state.is_empty(T0));
    state.hit(T0, &hit(vec![charge(Kind::Hooks, 1_000, 5_000)], None));
    assert!(!state.is_empty(T0));
    assert!(!state.is_empty(T0 + 999));
    assert!(state.is_empty(T0 + 1_000), "bucket full again");

    let c = claim("evt-1", "hook-1");
    state.hit(T0, &hit(vec![], Some(c.clone())));
    let expiry = T0 + c.pending_ttl_ms * 1_000;
    assert!(!state.is_empty(expiry - 1));
    // Expired but unswept claims do not count.
    assert!(state.is_empty(expiry));
    assert_eq!(state.claims().len(), 1);

    let mut reset = TenantState::default();
    reset.hit(T0, &hit(vec![charge(Kind::Bytes, 1_000, 5_000)], None));
    reset.reset();
    assert!(reset.is_empty(T0));
}

// ---------------------------------------------------------------- inspect

fn event(key: &str) -> EventKey {
    EventKey {
        source_id: "stripe".into(),
        key: key.into(),
    }
}

#[test]
fn inspect_reports_how_far_each_bucket_is_ahead_and_changes_nothing() {
    let mut state = TenantState::default();
    assert_eq!(state.inspect(T0, None), TenantView::default());
    // Two of the three hooks of the burst, and one kB of the four.
    state.hit(T0, &hit(two_charges(), None));
    state.hit(T0, &hit(vec![charge(Kind::Hooks, 100_000, 300_000)], None));
    let view = state.inspect(T0 + 50_000, None);
    assert_eq!(
        view.buckets,
        [
            BucketView {
                kind: Kind::Hooks,
                ahead_us: 150_000
            },
            BucketView {
                kind: Kind::Bytes,
                ahead_us: 950_000
            },
        ]
    );
    // What the view says passes, passes: 150 ms + 100 ms <= 300 ms.
    let before = state.snapshot(TENANT, T0 + 50_000);
    assert_eq!(state.inspect(T0 + 50_000, None), view);
    assert_eq!(state.snapshot(TENANT, T0 + 50_000), before);
    let third = state.hit(
        T0 + 50_000,
        &hit(vec![charge(Kind::Hooks, 100_000, 300_000)], None),
    );
    assert_eq!(third.outcome, HitOutcome::Ok);
    // A full bucket is not listed.
    assert_eq!(state.inspect(T0 + 1_000_000, None).buckets, []);
}

#[test]
fn inspect_shows_the_live_claim_on_a_key_pending_then_committed() {
    let c = claim("evt-1", "hook-1");
    let mut state = pending(&c);
    let view = state.inspect(T0 + 1_000, Some(&event("evt-1")));
    assert_eq!(view.claims_held, 1);
    assert_eq!(
        view.claim,
        Some(ClaimView::Pending {
            hook_id: "hook-1".into(),
            node: "node-a".into(),
            expires_in_ms: 4_999,
        })
    );
    assert_eq!(state.inspect(T0, Some(&event("evt-2"))).claim, None);

    state.settle(T0 + 1_000, &settle(c.clone(), Settlement::Commit));
    assert_eq!(
        state.inspect(T0 + 1_000, Some(&event("evt-1"))).claim,
        Some(ClaimView::Committed {
            hook_id: "hook-1".into(),
            expires_in_ms: 60_000,
        })
    );
    // Expired and not yet swept: held, but no longer a claim on the key.
    let after = T0 + 1_000 + c.ttl_ms * 1_000;
    let view = state.inspect(after, Some(&event("evt-1")));
    assert_eq!((view.claims_held, view.claim), (1, None));
}

#[test]
fn inspect_requests_are_validated() {
    let valid = InspectRequest {
        tenant: TENANT.into(),
        claim: Some(event("evt-1")),
    };
    assert_eq!(valid.validate(), Ok(()));
    let no_tenant = InspectRequest {
        tenant: String::new(),
        ..valid.clone()
    };
    assert_eq!(
        no_tenant.validate(),
        Err(InvalidRequest::Empty {
            field: "tenant".into()
        })
    );
    let huge_key = InspectRequest {
        claim: Some(event(&"k".repeat(limits::MAX_KEY + 1))),
        ..valid
    };
    assert_eq!(
        huge_key.validate(),
        Err(InvalidRequest::TooLong {
            field: "key".into(),
            len: limits::MAX_KEY + 1,
            max: limits::MAX_KEY,
        })
    );
}

// ---------------------------------------------------------------- snapshots

#[test]
fn snapshot_round_trip_keeps_every_rule() {
    let mut state = drained_hooks_state();
    let committed = claim("evt-1", "hook-1");
    let in_flight = claim("evt-2", "hook-2");
    state.hit(T0, &hit(vec![], Some(committed.clone())));
    state.settle(T0, &settle(committed, Settlement::Commit));
    state.hit(T0, &hit(vec![], Some(in_flight.clone())));

    let snap = state.snapshot(TENANT, T0);
    assert_eq!(snap.tenant, TENANT);
    assert_eq!(snap.buckets.len(), 1, "only the hooks bucket is not full");
    assert_eq!(snap.claims.len(), 2);

    let mut restored = TenantState::from_snapshot(snap.clone(), T0);
    let sorted = |mut s: TenantSnapshot| {
        s.claims.sort_by(|a, b| a.key().cmp(b.key()));
        s
    };
    assert_eq!(sorted(restored.snapshot(TENANT, T0)), sorted(snap));
    assert_eq!(restored.tat(Kind::Hooks), state.tat(Kind::Hooks));

    let hooks = hit(vec![charge(Kind::Hooks, 100_000, 300_000)], None);
    assert!(matches!(
        restored.hit(T0, &hooks).outcome,
        HitOutcome::RateLimited { .. }
    ));
    assert_eq!(
        restored
            .hit(T0, &hit(vec![], Some(claim("evt-1", "x"))))
            .outcome,
        HitOutcome::Duplicate {
            hook_id: "hook-1".into()
        }
    );
    assert!(matches!(
        restored
            .hit(T0, &hit(vec![], Some(claim("evt-2", "x"))))
            .outcome,
        HitOutcome::Pending { .. }
    ));
    // The pending holder can still commit on the restored state.
    assert_eq!(
        restored
            .settle(T0, &settle(in_flight, Settlement::Commit))
            .outcome,
        SettleOutcome::Ok
    );
}

#[test]
fn snapshot_leaves_out_full_buckets_and_expired_claims() {
    let mut state = TenantState::default();
    let c = claim("evt-1", "hook-1");
    state.hit(T0, &hit(two_charges(), Some(c.clone())));
    let snap = state.snapshot(TENANT, T0 + c.pending_ttl_ms * 1_000);
    assert!(snap.buckets.is_empty());
    assert!(snap.claims.is_empty());
}

#[test]
fn absorb_skips_expired_records_and_keeps_the_later_tat() {
    let mut state = TenantState::default();
    state.hit(T0, &hit(vec![charge(Kind::Hooks, 1_000, 10_000)], None));
    let snap = TenantSnapshot {
        tenant: TENANT.into(),
        buckets: vec![
            ankusa_actors::BucketRecord {
                kind: Kind::Hooks,
                tat_us: T0 + 500,
            },
            ankusa_actors::BucketRecord {
                kind: Kind::Bytes,
                tat_us: T0 + 7_000,
            },
        ],
        claims: vec![ClaimRecord::new("stripe", "old", "hook-0", None, true, T0)],
    };
    state.absorb(snap, T0);
    assert_eq!(
        state.tat(Kind::Hooks),
        T0 + 1_000,
        "earlier TAT must not win"
    );
    assert_eq!(state.tat(Kind::Bytes), T0 + 7_000);
    assert!(state.claims().is_empty(), "expired record was absorbed");
}

#[test]
fn absorb_never_lets_pending_replace_committed() {
    let c = claim("evt-1", "hook-1");
    let mut state = pending(&c);
    state.settle(T0, &settle(c.clone(), Settlement::Commit));
    let stale_pending = ClaimRecord::new(
        &c.source_id,
        &c.key,
        "hook-9",
        Some("node-b"),
        false,
        T0 + 3_000_000,
    );
    state.absorb_claim(stale_pending.clone(), T0);
    state.absorb(
        TenantSnapshot {
            tenant: TENANT.into(),
            buckets: vec![],
            claims: vec![stale_pending],
        },
        T0,
    );
    assert_eq!(
        state
            .hit(T0, &hit(vec![], Some(claim("evt-1", "hook-2"))))
            .outcome,
        HitOutcome::Duplicate {
            hook_id: "hook-1".into()
        }
    );
}

#[test]
fn absorb_lets_commit_replace_pending() {
    let c = claim("evt-1", "hook-1");
    let mut state = pending(&c);
    state.absorb_claim(
        ClaimRecord::new(&c.source_id, &c.key, "hook-1", None, true, T0 + 60_000_000),
        T0,
    );
    assert_eq!(
        state
            .hit(T0, &hit(vec![], Some(claim("evt-1", "hook-2"))))
            .outcome,
        HitOutcome::Duplicate {
            hook_id: "hook-1".into()
        }
    );
}

// ---------------------------------------------------------------- validation

fn invalid(req: &HitRequest) -> InvalidRequest {
    req.validate().expect_err("request should be refused")
}

fn empty(field: &str) -> InvalidRequest {
    InvalidRequest::Empty {
        field: field.into(),
    }
}

fn too_long(field: &str, len: usize, max: usize) -> InvalidRequest {
    InvalidRequest::TooLong {
        field: field.into(),
        len,
        max,
    }
}

#[test]
fn nothing_to_do_is_refused() {
    assert_eq!(
        invalid(&HitRequest {
            charges: vec![],
            claim: None
        }),
        InvalidRequest::NothingToDo
    );
}

#[test]
fn too_many_charges_is_refused() {
    let mut charges = two_charges();
    charges.push(charge(Kind::Hooks, 1, 1));
    assert_eq!(
        invalid(&HitRequest {
            charges,
            claim: None
        }),
        InvalidRequest::TooManyCharges {
            count: 3,
            max: limits::MAX_CHARGES
        }
    );
}

#[test]
fn duplicate_bucket_is_refused() {
    for kind in Kind::ALL {
        let req = HitRequest {
            charges: vec![charge(kind, 1, 1), charge(kind, 2, 2)],
            claim: None,
        };
        assert_eq!(invalid(&req), InvalidRequest::DuplicateBucket { kind });
    }
}

#[test]
fn mixed_tenants_are_refused() {
    let mut other = charge(Kind::Bytes, 1, 1);
    other.tenant = "globex".into();
    let between_charges = HitRequest {
        charges: vec![charge(Kind::Hooks, 1, 1), other.clone()],
        claim: None,
    };
    assert_eq!(invalid(&between_charges), InvalidRequest::MixedTenants);
    let charge_vs_claim = HitRequest {
        charges: vec![other],
        claim: Some(claim("k", "h")),
    };
    assert_eq!(invalid(&charge_vs_claim), InvalidRequest::MixedTenants);
}

#[test]
fn zero_and_inverted_capacity_are_refused() {
    let cases = [
        (
            charge(Kind::Hooks, 1, 0),
            InvalidRequest::Zero {
                field: "capacity_us".into(),
            },
        ),
        (
            charge(Kind::Hooks, 0, 10),
            InvalidRequest::Zero {
                field: "increment_us".into(),
            },
        ),
        (
            charge(Kind::Bytes, 11, 10),
            InvalidRequest::IncrementExceedsCapacity {
                increment_us: 11,
                capacity_us: 10,
            },
        ),
        (
            charge(Kind::Hooks, 1, limits::MAX_CAPACITY_US + 1),
            InvalidRequest::OutOfRange {
                field: "capacity_us".into(),
                value: limits::MAX_CAPACITY_US + 1,
                max: limits::MAX_CAPACITY_US,
            },
        ),
    ];
    for (c, want) in cases {
        assert_eq!(c.validate(), Err(want.clone()));
        let req = HitRequest {
            charges: vec![c],
            claim: None,
        };
        assert_eq!(invalid(&req), want);
    }
    let max = charge(
        Kind::Hooks,
        limits::MAX_CAPACITY_US,
        limits::MAX_CAPACITY_US,
    );
    assert_eq!(max.validate(), Ok(()));
}

#[test]
fn empty_fields_are_refused() {
    let mut c = charge(Kind::Hooks, 1, 1);
    c.tenant.clear();
    assert_eq!(
        invalid(&HitRequest {
            charges: vec![c],
            claim: None
        }),
        empty("tenant")
    );
    type Setter = fn(&mut Claim);
    let fields: [(&str, Setter); 5] = [
        ("tenant", |c| c.tenant.clear()),
        ("source_id", |c| c.source_id.clear()),
        ("key", |c| c.key.clear()),
        ("hook_id", |c| c.hook_id.clear()),
        ("node", |c| c.node.clear()),
    ];
    for (field, clear) in fields {
        let mut c = claim("k", "h");
        clear(&mut c);
        let req = HitRequest {
            charges: vec![],
            claim: Some(c.clone()),
        };
        assert_eq!(invalid(&req), empty(field));
        assert_eq!(
            settle(c, Settlement::Commit).validate(),
            Err(empty(field)),
            "settle {field}"
        );
    }
    assert_eq!(validate_tenant(""), Err(empty("tenant")));
}

/// Fills `len` bytes with a multi-byte character where it fits, so the limit is
/// checked in bytes, not chars.
fn text(len: usize) -> String {
    let mut s = "é".repeat(len / 2);
    if len % 2 == 1 {
        s.push('x');
    }
    assert_eq!(s.len(), len);
    s
}

#[test]
fn over_long_fields_are_refused_in_bytes() {
    type Setter = fn(&mut Claim, String);
    let fields: [(&str, usize, Setter); 5] = [
        ("tenant", limits::MAX_TENANT, |c, v| c.tenant = v),
        ("source_id", limits::MAX_SOURCE_ID, |c, v| c.source_id = v),
        ("key", limits::MAX_KEY, |c, v| c.key = v),
        ("hook_id", limits::MAX_HOOK_ID, |c, v| c.hook_id = v),
        ("node", limits::MAX_NODE, |c, v| c.node = v),
    ];
    for (field, max, set) in fields {
        let mut at_limit = claim("k", "h");
        set(&mut at_limit, text(max));
        assert_eq!(at_limit.validate(), Ok(()), "{field} at its limit");

        let mut over = claim("k", "h");
        set(&mut over, text(max + 1));
        let req = HitRequest {
            charges: vec![],
            claim: Some(over.clone()),
        };
        assert_eq!(invalid(&req), too_long(field, max + 1, max));
        assert_eq!(
            settle(over, Settlement::Release).validate(),
            Err(too_long(field, max + 1, max))
        );
    }
    // Half as many chars as the limit, each two bytes, plus one: over in bytes.
    let chars = "é".repeat(limits::MAX_TENANT / 2 + 1);
    assert_eq!(chars.chars().count(), limits::MAX_TENANT / 2 + 1);
    assert_eq!(
        validate_tenant(&chars),
        Err(too_long("tenant", chars.len(), limits::MAX_TENANT))
    );
    let mut c = charge(Kind::Hooks, 1, 1);
    c.tenant = text(limits::MAX_TENANT + 1);
    assert_eq!(
        c.validate(),
        Err(too_long(
            "tenant",
            limits::MAX_TENANT + 1,
            limits::MAX_TENANT
        ))
    );
}

#[test]
fn odd_but_short_text_is_accepted_and_works() {
    // NATS-subject and path metacharacters are data here, never syntax.
    let odd = [
        "ünïcødé-テナント",
        "nul\0inside",
        "*",
        ">",
        "a.b.c",
        ".",
        "..",
        "with space",
        "tab\tand\nnewline",
        "🦀",
    ];
    for value in odd {
        let c = Claim {
            tenant: value.into(),
            source_id: value.into(),
            key: value.into(),
            hook_id: value.into(),
            node: value.into(),
            ttl_ms: 1,
            pending_ttl_ms: 1,
        };
        let req = HitRequest {
            charges: vec![Charge {
                kind: Kind::Hooks,
                tenant: value.into(),
                increment_us: 1,
                capacity_us: 1,
            }],
            claim: Some(c.clone()),
        };
        assert_eq!(req.validate(), Ok(()), "{value:?}");
        assert_eq!(req.tenant(), value);
        assert_eq!(validate_tenant(value), Ok(()));
        assert_eq!(settle(c.clone(), Settlement::Commit).validate(), Ok(()));

        let mut state = TenantState::default();
        assert_eq!(state.hit(T0, &req).outcome, HitOutcome::Ok);
        assert_eq!(
            state
                .settle(T0, &settle(c.clone(), Settlement::Commit))
                .outcome,
            SettleOutcome::Ok
        );
        let snap = state.snapshot(value, T0);
        assert_eq!(snap.claims[0].source_id(), value);
        assert_eq!(snap.claims[0].key(), value);
    }
}

#[test]
fn ttls_must_be_within_one_and_their_limits() {
    type Setter = fn(&mut Claim, u64);
    let fields: [(&str, u64, Setter); 2] = [
        ("ttl_ms", limits::MAX_TTL_MS, |c, v| c.ttl_ms = v),
        ("pending_ttl_ms", limits::MAX_PENDING_TTL_MS, |c, v| {
            c.pending_ttl_ms = v
        }),
    ];
    for (field, max, set) in fields {
        let mut c = claim("k", "h");
        set(&mut c, 0);
        assert_eq!(
            c.validate(),
            Err(InvalidRequest::Zero {
                field: field.into()
            })
        );
        set(&mut c, max + 1);
        let over = InvalidRequest::OutOfRange {
            field: field.into(),
            value: max + 1,
            max,
        };
        assert_eq!(c.validate(), Err(over.clone()));
        assert_eq!(settle(c.clone(), Settlement::Commit).validate(), Err(over));
        set(&mut c, max);
        assert_eq!(c.validate(), Ok(()));
        set(&mut c, 1);
        assert_eq!(c.validate(), Ok(()));
    }
}

#[test]
fn longest_ttls_do_not_overflow() {
    let mut c = claim("k", "h");
    c.ttl_ms = limits::MAX_TTL_MS;
    c.pending_ttl_ms = limits::MAX_PENDING_TTL_MS;
    let mut state = TenantState::default();
    let req = hit(
        vec![charge(
            Kind::Hooks,
            limits::MAX_CAPACITY_US,
            limits::MAX_CAPACITY_US,
        )],
        Some(c.clone()),
    );
    assert_eq!(state.hit(T0, &req).outcome, HitOutcome::Ok);
    state.settle(T0, &settle(c, Settlement::Commit));
    let snap = state.snapshot(TENANT, T0);
    assert_eq!(snap.claims[0].expires_us, T0 + limits::MAX_TTL_MS * 1_000);
    assert_eq!(snap.buckets[0].tat_us, T0 + limits::MAX_CAPACITY_US);
}
