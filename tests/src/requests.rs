//! Builders for the contract's requests, so tests read as the scenario they run,
//! and the round of a hook they all start from.

use std::future::Future;
use std::time::Duration;

use ankusa_actors::{
    Charge, Claim, HitOutcome, HitRequest, Kind, SettleOutcome, SettleRequest, Settlement,
};
use ankusa_bus::Store;

/// A hook charge: `burst` hooks at once, then one per `per_ms`.
pub fn hooks(tenant: &str, burst: u64, per_ms: u64) -> Charge {
    Charge {
        kind: Kind::Hooks,
        tenant: tenant.into(),
        increment_us: per_ms * 1000,
        capacity_us: burst * per_ms * 1000,
    }
}

/// A generous bytes charge that passes unless the test floods it.
pub fn bytes(tenant: &str) -> Charge {
    Charge {
        kind: Kind::Bytes,
        tenant: tenant.into(),
        increment_us: 10,
        capacity_us: 10_000_000,
    }
}

pub fn claim(tenant: &str, key: &str, hook_id: &str) -> Claim {
    Claim {
        tenant: tenant.into(),
        source_id: "src".into(),
        key: key.into(),
        hook_id: hook_id.into(),
        node: "edge-test".into(),
        ttl_ms: 600_000,
        pending_ttl_ms: 30_000,
    }
}

/// A hit charging a roomy hooks bucket and bytes, claiming `key` for `hook_id`.
pub fn hit(tenant: &str, key: &str, hook_id: &str) -> HitRequest {
    HitRequest {
        charges: vec![hooks(tenant, 1000, 1), bytes(tenant)],
        claim: Some(claim(tenant, key, hook_id)),
    }
}

pub fn settle(tenant: &str, key: &str, hook_id: &str, settlement: Settlement) -> SettleRequest {
    SettleRequest {
        claim: claim(tenant, key, hook_id),
        settlement,
    }
}

/// The whole round of a hook on `store`: hook `h1`'s hit on `key` is `Ok`, its
/// commit `Ok`, and hook `h2`'s hit on the key then a `Duplicate` of `h1`.
pub async fn round_trip(store: &impl Store, tenant: &str, key: &str, timeout: Duration) {
    assert_eq!(
        store.hit(hit(tenant, key, "h1"), timeout).await,
        Ok(HitOutcome::Ok)
    );
    assert_eq!(
        store
            .settle(settle(tenant, key, "h1", Settlement::Commit), timeout)
            .await,
        Ok(SettleOutcome::Ok)
    );
    assert_eq!(
        store.hit(hit(tenant, key, "h2"), timeout).await,
        Ok(HitOutcome::Duplicate {
            hook_id: "h1".into()
        })
    );
}

/// `call`'s answer, which must have come when a plain timer of `budget` fires:
/// the timer starts once the call has set its own (on its first poll) and is
/// polled after it, so however late a loaded host fires both, a call that
/// honours its budget is over by then.
pub async fn answered_within<F: Future>(call: F, budget: Duration) -> F::Output {
    tokio::pin!(call);
    assert!(futures::poll!(&mut call).is_pending(), "answered at once");
    let reference = tokio::time::sleep(budget);
    tokio::select! {
        biased;
        answer = &mut call => answer,
        () = reference => panic!("no answer when a plain timer of its budget fired"),
    }
}
