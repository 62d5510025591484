//! How long a sweep keeps a tenant from its requests: one pass over a large
//! claim table against the longest of the steps ([`SWEEP_STEP_BUCKETS`] places
//! each) the tenant actor now takes instead, answering requests between them.
//!
//! The table is the busiest tenant's after a peak (zipf 1.1 over 1,000 tenants
//! gives it about a sixth of a node's claims), with all or most of its claims
//! expired; a pass that leaves it under a quarter full also shrinks it.
//!
//! Run: `cargo bench -p ankusa-actors --bench sweep` (about 10 s). It runs on
//! the node's allocator: glibc's would add its own pause, consolidating every
//! freed claim's chunk when the table itself is freed.

use std::time::{Duration, Instant};

use ankusa_actors::claims::{ClaimEntry, ClaimTable, Phase};
use ankusa_actors::SWEEP_STEP_BUCKETS;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const CLAIMS: usize = 170_000;
const REPEATS: usize = 9;
const EXPIRED_AT: u64 = 1_000;
const LIVE_UNTIL: u64 = 10_000;

/// A table of `CLAIMS` claims with realistic key lengths, `expired_per_mille`
/// of them expired at [`EXPIRED_AT`].
fn table(expired_per_mille: usize) -> ClaimTable {
    let mut table = ClaimTable::default();
    for i in 0..CLAIMS {
        let expires_us = if i % 1000 < expired_per_mille {
            EXPIRED_AT
        } else {
            LIVE_UNTIL
        };
        table.insert(ClaimEntry::new(
            "src_stripe_live",
            &format!("evt_1Nq8xY2eZvKYlo2C{i:010}"),
            &format!("0190c3e2-7b1a-7c4e-9f3d-{i:012}"),
            Phase::Committed,
            expires_us,
        ));
    }
    table
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn main() {
    println!(
        "{CLAIMS} claims in one tenant's table; median of {REPEATS} runs; steps of {SWEEP_STEP_BUCKETS} places"
    );
    println!(
        "{:>9}  {:>13}  {:>17}  {:>6}  {:>11}",
        "expired", "one pass", "longest step", "steps", "left"
    );
    for expired_per_mille in [1000, 800, 500] {
        let (mut passes, mut longest) = (Vec::new(), Vec::new());
        let (mut steps, mut left) = (0, 0);
        for _ in 0..REPEATS {
            let mut whole = table(expired_per_mille);
            let started = Instant::now();
            std::hint::black_box(whole.sweep(EXPIRED_AT));
            passes.push(started.elapsed());

            let mut stepped = table(expired_per_mille);
            let mut worst = Duration::ZERO;
            steps = 0;
            loop {
                let started = Instant::now();
                let step = stepped.sweep_step(EXPIRED_AT, SWEEP_STEP_BUCKETS);
                worst = worst.max(started.elapsed());

                steps += 1;
                if step.finished {
                    break;
                }
            }
            longest.push(worst);
            assert_eq!(
                stepped.len(),
                whole.len(),
                "both sweeps keep the same claims"
            );
            left = stepped.len();
        }
        println!(
            "{:>8}%  {:>10.2} ms  {:>14.0} µs  {:>6}  {:>11}",
            expired_per_mille / 10,
            median(passes).as_secs_f64() * 1e3,
            median(longest).as_secs_f64() * 1e6,
            steps,
            left
        );
    }
}
