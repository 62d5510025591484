//! The cost of one hit: the pure decision (`TenantState::hit`) and the round trip
//! to a running tenant's actor through its `ShardHandle`, on a current-thread runtime (the
//! one a node runs on by default, `worker_threads = 1`) and on a multi-thread one
//! (`worker_threads = 0`). After the criterion runs, a plain latency pass prints
//! p50/p99/p99.9 of single actor round trips, since the target is a median.
//!
//! Run: `cargo bench -p ankusa-actors --bench hit`; set `HIT_BENCH_LATENCY=off` to
//! skip the latency pass.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ankusa_actors::{
    spawn_shard, Charge, Claim, HitOutcome, HitRequest, Kind, SettleRequest, Settlement,
    ShardConfig, ShardHandle, SystemClock, TenantState,
};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tokio::runtime::{Builder, Runtime};

const T0: u64 = 1_700_000_000_000_000;
const TENANT: &str = "tenant-0042";
/// Keys in rotation. With a 1 ms pending TTL and at least 1 µs between hits, a key
/// comes round only after its claim expired, so every hit claims a free key while
/// the table stays at a steady size (as it does under a live sweep).
const KEYS: usize = 4096;

fn charges(tenant: &str) -> Vec<Charge> {
    // Wide enough that no hit in the run is ever denied.
    vec![
        Charge {
            kind: Kind::Hooks,
            tenant: tenant.into(),
            increment_us: 1,
            capacity_us: 1_000_000_000,
        },
        Charge {
            kind: Kind::Bytes,
            tenant: tenant.into(),
            increment_us: 1,
            capacity_us: 1_000_000_000,
        },
    ]
}

fn claim(tenant: &str, i: usize) -> Claim {
    Claim {
        tenant: tenant.into(),
        source_id: "src_stripe_live".into(),
        // Realistic lengths: provider event id and a UUID-sized hook id.
        key: format!("evt_1Nq8xY2eZvKYlo2C{i:010}"),
        hook_id: format!("0190c3e2-7b1a-7c4e-9f3d-{i:012}"),
        node: "ankusa-edge-3".into(),
        ttl_ms: 86_400_000,
        pending_ttl_ms: 1,
    }
}

fn fresh_key_requests(tenant: &str) -> Vec<HitRequest> {
    (0..KEYS)
        .map(|i| HitRequest {
            charges: charges(tenant),
            claim: Some(claim(tenant, i)),
        })
        .collect()
}

fn pure(c: &mut Criterion) {
    let mut group = c.benchmark_group("pure");
    group.throughput(Throughput::Elements(1));

    let reqs = fresh_key_requests(TENANT);
    group.bench_function("hit_2_charges_new_claim", |b| {
        let mut state = TenantState::default();
        let mut now = T0;
        let mut i = 0;
        b.iter(|| {
            now += 1;
            i = (i + 1) % KEYS;
            let applied = state.hit(now, &reqs[i]);
            debug_assert_eq!(applied.outcome, HitOutcome::Ok);
            black_box(applied)
        });
    });

    group.bench_function("hit_2_charges_duplicate", |b| {
        let mut state = TenantState::default();
        let first = HitRequest {
            charges: vec![],
            claim: Some(claim(TENANT, 7)),
        };
        state.hit(T0, &first);
        state.settle(
            T0,
            &SettleRequest {
                claim: claim(TENANT, 7),
                settlement: Settlement::Commit,
            },
        );
        let mut replay = claim(TENANT, 7);
        replay.hook_id = "0190c3e2-7b1a-7c4e-9f3d-another-hook".into();
        let req = HitRequest {
            charges: charges(TENANT),
            claim: Some(replay),
        };
        let mut now = T0;
        b.iter(|| {
            now += 1;
            let applied = state.hit(now, &req);
            debug_assert!(matches!(applied.outcome, HitOutcome::Duplicate { .. }));
            black_box(applied)
        });
    });

    group.bench_function("hit_2_charges_no_claim", |b| {
        let mut state = TenantState::default();
        let req = HitRequest {
            charges: charges(TENANT),
            claim: None,
        };
        let mut now = T0;
        b.iter(|| {
            now += 1;
            black_box(state.hit(now, &req))
        });
    });
    group.finish();
}

fn runtime(multi_thread: bool) -> Runtime {
    if multi_thread {
        Builder::new_multi_thread().enable_all().build()
    } else {
        Builder::new_current_thread().enable_all().build()
    }
    .expect("tokio runtime")
}

/// A shard on the system clock (claims expire in real time, see [`KEYS`]) with its
/// tenant actor already running.
fn shard(rt: &Runtime) -> ShardHandle {
    rt.block_on(async {
        let shard = spawn_shard(ShardConfig::new(Arc::new(SystemClock)), vec![], None)
            .await
            .expect("shard spawns");
        round_trip(&shard, fresh_key_requests(TENANT)[0].clone()).await;
        shard
    })
}

async fn round_trip(shard: &ShardHandle, req: HitRequest) -> HitOutcome {
    match shard.ask(req, None).await {
        Ok(Ok(applied)) => applied.outcome,
        other => panic!("hit failed: {other:?}"),
    }
}

/// `iters` sequential round trips, run as a task of the runtime (not in
/// `block_on`'s thread, which a node's request handlers never are).
fn timed_round_trips(rt: &Runtime, shard: &ShardHandle, iters: u64) -> Duration {
    let shard = shard.clone();
    // Building the requests is the caller's cost, not the store's: done untimed.
    let reqs = fresh_key_requests(TENANT);
    rt.block_on(rt.spawn(async move {
        let start = Instant::now();
        for i in 0..iters as usize {
            let outcome = round_trip(&shard, reqs[i % KEYS].clone()).await;
            debug_assert_eq!(outcome, HitOutcome::Ok);
        }
        start.elapsed()
    }))
    .expect("bench task")
}

/// Callers in flight across several tenants of one shard, as a node's
/// subscriber sees them: each caller runs `iters` round trips over its keys.
fn timed_in_flight(
    rt: &Runtime,
    shard: &ShardHandle,
    per_caller: &Arc<Vec<Vec<HitRequest>>>,
    iters: u64,
) -> Duration {
    rt.block_on(async {
        let start = Instant::now();
        let tasks: Vec<_> = (0..per_caller.len())
            .map(|caller| {
                let shard = shard.clone();
                let reqs = per_caller.clone();
                tokio::spawn(async move {
                    let mine = &reqs[caller];
                    for i in 0..iters as usize {
                        round_trip(&shard, mine[i % mine.len()].clone()).await;
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("caller");
        }
        start.elapsed()
    })
}

fn actor(c: &mut Criterion) {
    const CALLERS: u64 = 64;
    // 256 keys a caller: a key comes round only after its 1 ms pending TTL.
    let per_caller: Arc<Vec<Vec<HitRequest>>> = Arc::new(
        (0..CALLERS as usize)
            .map(|caller| {
                let tenant = format!("tenant-{}", caller % 16);
                (0..256)
                    .map(|i| HitRequest {
                        charges: charges(&tenant),
                        claim: Some(claim(&tenant, caller * 256 + i)),
                    })
                    .collect()
            })
            .collect(),
    );
    let mut group = c.benchmark_group("actor");
    for (runtime_name, multi) in [("current_thread", false), ("multi_thread", true)] {
        let rt = runtime(multi);
        let shard = shard(&rt);
        group.throughput(Throughput::Elements(1));
        group.bench_function(format!("round_trip_{runtime_name}"), |b| {
            b.iter_custom(|iters| timed_round_trips(&rt, &shard, iters))
        });
        group.throughput(Throughput::Elements(CALLERS));
        group.bench_function(format!("64_in_flight_16_tenants_{runtime_name}"), |b| {
            b.iter_custom(|iters| timed_in_flight(&rt, &shard, &per_caller, iters))
        });
        shard.actor().stop(None);
    }
    group.finish();
}

/// Single round trips timed one by one, for the median the target is set on.
/// `HIT_BENCH_LATENCY=off` skips it (e.g. when profiling one criterion bench).
fn latency() {
    if std::env::var("HIT_BENCH_LATENCY").is_ok_and(|v| v == "off") {
        return;
    }
    for (name, multi) in [("current_thread", false), ("multi_thread", true)] {
        let rt = runtime(multi);
        let shard = shard(&rt);
        let reqs = fresh_key_requests(TENANT);
        let task_shard = shard.clone();
        let mut samples = rt
            .block_on(rt.spawn(async move {
                let mut samples = Vec::with_capacity(200_000);
                for i in 0..220_000usize {
                    let req = reqs[i % KEYS].clone();
                    let start = Instant::now();
                    round_trip(&task_shard, req).await;
                    // The first 20k warm the allocator and caches.
                    if i >= 20_000 {
                        samples.push(start.elapsed().as_nanos() as u64);
                    }
                }
                samples
            }))
            .expect("latency task");
        samples.sort_unstable();
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
        println!(
            "actor round trip latency ({name}, {} samples): p50 {} ns, p99 {} ns, p99.9 {} ns, max {} ns",
            samples.len(),
            at(0.5),
            at(0.99),
            at(0.999),
            samples[samples.len() - 1],
        );
        shard.actor().stop(None);
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(40);
    targets = pure, actor
}
criterion_main!(benches, latency);
