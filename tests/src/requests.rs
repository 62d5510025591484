//! Builders for the contract's requests, so tests read as the scenario they run.

use ankusa_actors::{Charge, Claim, HitRequest, Kind, SettleRequest, Settlement};

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
