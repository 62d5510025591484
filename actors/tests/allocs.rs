//! Heap allocations per hit, counted by a wrapping global allocator: the pure
//! decision's cost is mostly allocation (`docs/benchmarks.md`), so its count per
//! path is pinned here. The count is per thread, so the harness's own threads
//! do not add to it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use ankusa_actors::{
    Charge, Claim, HitOutcome, HitRequest, Kind, SettleRequest, Settlement, TenantState,
};

struct Counting;

thread_local! {
    // Const and without drop glue: reading it never allocates.
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    let _ = ALLOCS.try_with(|n| n.set(n.get() + 1));
}

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

// SAFETY: every call is passed on unchanged to the system allocator.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const T0: u64 = 1_700_000_000_000_000;
const KEYS: usize = 512;

fn charges() -> Vec<Charge> {
    [Kind::Hooks, Kind::Bytes]
        .into_iter()
        .map(|kind| Charge {
            kind,
            tenant: "t".into(),
            increment_us: 1,
            capacity_us: 1_000_000_000,
        })
        .collect()
}

fn claim(i: usize, hook: &str) -> Claim {
    Claim {
        tenant: "t".into(),
        source_id: "src_stripe_live".into(),
        key: format!("evt_1Nq8xY2eZvKYlo2C{i:010}"),
        hook_id: format!("{hook}-{i:012}"),
        node: "ankusa-edge-3".into(),
        ttl_ms: 86_400_000,
        pending_ttl_ms: 1,
    }
}

/// Allocations made by `f` over `reqs`, per request; what it returns is dropped
/// in the count, as a caller would.
fn per_hit(reqs: &[HitRequest], mut f: impl FnMut(&HitRequest) -> HitOutcome) -> f64 {
    let before = allocs();
    for req in reqs {
        std::hint::black_box(f(req));
    }
    (allocs() - before) as f64 / reqs.len() as f64
}

#[test]
fn allocations_per_hit() {
    let fresh: Vec<HitRequest> = (0..KEYS)
        .map(|i| HitRequest {
            charges: charges(),
            claim: Some(claim(i, "hook")),
        })
        .collect();
    let mut state = TenantState::default();
    let mut now = T0;
    let mut hit = |req: &HitRequest| {
        now += 10;
        let applied = state.hit(now, req);
        applied.outcome
    };
    // The first round fills (and grows) the table; in the second every key's claim
    // has expired (1 ms TTL) and is claimed again in place, as under a live sweep.
    assert!(per_hit(&fresh, &mut hit) >= 1.0);
    let new_claim = per_hit(&fresh, &mut hit);
    assert_eq!(new_claim, 1.0, "a new claim allocates its text only");

    let no_claim: Vec<HitRequest> = (0..KEYS)
        .map(|_| HitRequest {
            charges: charges(),
            claim: None,
        })
        .collect();
    assert_eq!(per_hit(&no_claim, &mut hit), 0.0);

    // The same hooks again while their claims are pending: replays, answered with
    // the record the table already holds.
    let mut state = TenantState::default();
    for req in &fresh {
        let mut long = req.clone();
        if let Some(c) = long.claim.as_mut() {
            c.pending_ttl_ms = 60_000;
        }
        state.hit(T0, &long);
    }
    let replay = per_hit(&fresh, |req| state.hit(T0, req).outcome);
    assert_eq!(replay, 0.0, "a replay shares the held record");

    // Another hook meets committed keys: only the answer's hook_id is a new String.
    for req in &fresh {
        let claim = req.claim.clone().expect("claim");
        state.settle(
            T0,
            &SettleRequest {
                claim,
                settlement: Settlement::Commit,
            },
        );
    }
    let others: Vec<HitRequest> = (0..KEYS)
        .map(|i| HitRequest {
            charges: charges(),
            claim: Some(claim(i, "other")),
        })
        .collect();
    let duplicate = per_hit(&others, |req| {
        let outcome = state.hit(T0, req).outcome;
        assert!(matches!(outcome, HitOutcome::Duplicate { .. }));
        outcome
    });
    assert_eq!(duplicate, 1.0);
}
