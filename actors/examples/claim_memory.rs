//! Resident memory per claim held in the pure domain: 1,000,000 claims over
//! 10,000 tenant states, made by `hit` (and committed by `settle` unless `pending`
//! is given), with the key and hook lengths of `benches/hit.rs`. ΔRSS ÷ claims;
//! glibc malloc. The node's own figure (`docs/benchmarks.md`, Memory) adds the
//! node around it.
//!
//! Run: `cargo run --release -p ankusa-actors --example claim_memory [pending]`

use ankusa_actors::{Claim, HitRequest, SettleRequest, Settlement, TenantState};

const TENANTS: usize = 10_000;
const PER_TENANT: usize = 100;

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/self/status")
}

fn main() {
    let pending = std::env::args().nth(1).is_some_and(|a| a == "pending");
    let mut states: Vec<TenantState> = (0..TENANTS).map(|_| TenantState::default()).collect();
    let now = 1_700_000_000_000_000;
    let before = rss_kib();
    for (t, state) in states.iter_mut().enumerate() {
        for i in 0..PER_TENANT {
            let n = t * PER_TENANT + i;
            let claim = Claim {
                tenant: format!("tenant-{t}"),
                source_id: "src_stripe_live".into(),
                key: format!("evt_1Nq8xY2eZvKYlo2C{n:010}"),
                hook_id: format!("0190c3e2-7b1a-7c4e-9f3d-{n:012}"),
                node: "ankusa-edge-3".into(),
                ttl_ms: 3_600_000,
                pending_ttl_ms: 60_000,
            };
            let hit = HitRequest {
                charges: vec![],
                claim: Some(claim.clone()),
            };
            state.hit(now, &hit);
            if !pending {
                let settle = SettleRequest {
                    claim,
                    settlement: Settlement::Commit,
                };
                state.settle(now, &settle);
            }
        }
    }
    let after = rss_kib();
    let claims: usize = states.iter().map(|s| s.claims().len()).sum();
    println!(
        "{claims} {} claims: RSS {before} -> {after} KiB, {:.0} B per claim",
        if pending { "pending" } else { "committed" },
        (after - before) as f64 * 1024.0 / claims as f64
    );
}
