//! The Redis + Lua baseline against a real `redis-server` that this test starts
//! on a free loopback port: every outcome of the contract, all-or-nothing
//! charges, expiry, retry hints, the hard per-call budget, and a short workload;
//! and `ankusa bench --compare` in rounds, side by side with a node.
//!
//! The server binary comes from `REDIS_SERVER_BIN` or `PATH`; without one the
//! test fails (it never skips): run `scripts/ensure-redis.sh`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ankusa_actors::{
    Charge, Claim, HitOutcome, HitRequest, Kind, SettleOutcome, SettleRequest, Settlement,
};
use ankusa_bus::{Store, StoreError};
use ankusa_node::bench::redis_lua::RedisLuaStore;
use ankusa_node::bench::workload::{self, LoadMode, WorkloadConfig};
use ankusa_tests::fleet::standalone_pair;
use ankusa_tests::process::cargo_bin;
use ankusa_tests::redis::RedisServer;
use ankusa_tests::requests::answered_within;

const BUDGET: Duration = Duration::from_millis(500);

fn charge(tenant: &str, kind: Kind, increment_us: u64, capacity_us: u64) -> Charge {
    Charge {
        kind,
        tenant: tenant.into(),
        increment_us,
        capacity_us,
    }
}

fn claim(tenant: &str, key: &str, hook: &str) -> Claim {
    Claim {
        tenant: tenant.into(),
        source_id: "src".into(),
        key: key.into(),
        hook_id: hook.into(),
        node: "n1".into(),
        ttl_ms: 60_000,
        pending_ttl_ms: 5_000,
    }
}

fn hit(charges: Vec<Charge>, claim: Option<Claim>) -> HitRequest {
    HitRequest { charges, claim }
}

fn settle(claim: Claim, settlement: Settlement) -> SettleRequest {
    SettleRequest { claim, settlement }
}

/// Generous buckets: never the reason for an answer.
fn roomy(tenant: &str) -> Vec<Charge> {
    vec![
        charge(tenant, Kind::Hooks, 1, 1_000_000),
        charge(tenant, Kind::Bytes, 1, 1_000_000),
    ]
}

async fn store(server: &RedisServer) -> RedisLuaStore {
    RedisLuaStore::connect(&server.url(), 2)
        .await
        .expect("connect to the test's redis-server")
}

#[tokio::test]
async fn every_outcome_of_the_two_phase_claim() {
    let server = RedisServer::start().expect("redis-server starts");
    let store = store(&server).await;
    let t = "tenant-a";
    let a = claim(t, "evt-1", "hook-a");
    let b = claim(t, "evt-1", "hook-b");

    let first = store.hit(hit(roomy(t), Some(a.clone())), BUDGET).await;
    assert_eq!(first, Ok(HitOutcome::Ok));
    // The same hook's replay of its pending claim is Ok again.
    let replay = store.hit(hit(roomy(t), Some(a.clone())), BUDGET).await;
    assert_eq!(replay, Ok(HitOutcome::Ok));
    // Another hook meets a pending key: Pending, never Duplicate.
    match store.hit(hit(roomy(t), Some(b.clone())), BUDGET).await {
        Ok(HitOutcome::Pending { retry_after_ms }) => {
            assert!(
                retry_after_ms > 0 && retry_after_ms <= 5_000,
                "{retry_after_ms}"
            );
        }
        other => panic!("expected Pending, got {other:?}"),
    }
    // Only the holder may settle.
    assert_eq!(
        store
            .settle(settle(b.clone(), Settlement::Commit), BUDGET)
            .await,
        Ok(SettleOutcome::NotOwner {
            hook_id: "hook-a".into()
        })
    );
    assert_eq!(
        store
            .settle(settle(a.clone(), Settlement::Commit), BUDGET)
            .await,
        Ok(SettleOutcome::Ok)
    );
    // A repeated commit is Ok; a release after a commit is refused.
    assert_eq!(
        store
            .settle(settle(a.clone(), Settlement::Commit), BUDGET)
            .await,
        Ok(SettleOutcome::Ok)
    );
    assert_eq!(
        store
            .settle(settle(a.clone(), Settlement::Release), BUDGET)
            .await,
        Ok(SettleOutcome::AlreadyCommitted)
    );
    // Committed: now, and only now, a duplicate.
    assert_eq!(
        store.hit(hit(roomy(t), Some(b.clone())), BUDGET).await,
        Ok(HitOutcome::Duplicate {
            hook_id: "hook-a".into()
        })
    );
    // The same hook meeting its own committed key is a duplicate too.
    assert_eq!(
        store.hit(hit(roomy(t), Some(a.clone())), BUDGET).await,
        Ok(HitOutcome::Duplicate {
            hook_id: "hook-a".into()
        })
    );
    // No live claim: not found.
    assert_eq!(
        store
            .settle(
                settle(claim(t, "never", "hook-a"), Settlement::Commit),
                BUDGET
            )
            .await,
        Ok(SettleOutcome::NotFound)
    );
    // A released claim frees its key for the next hook.
    let c = claim(t, "evt-2", "hook-c");
    let d = claim(t, "evt-2", "hook-d");
    assert_eq!(
        store.hit(hit(vec![], Some(c.clone())), BUDGET).await,
        Ok(HitOutcome::Ok)
    );
    assert_eq!(
        store
            .settle(settle(c.clone(), Settlement::Release), BUDGET)
            .await,
        Ok(SettleOutcome::Ok)
    );
    assert_eq!(
        store.settle(settle(c, Settlement::Release), BUDGET).await,
        Ok(SettleOutcome::NotFound)
    );
    assert_eq!(
        store.hit(hit(vec![], Some(d)), BUDGET).await,
        Ok(HitOutcome::Ok)
    );
    // Claims are scoped by tenant: another tenant's evt-1 is free.
    assert_eq!(
        store
            .hit(
                hit(vec![], Some(claim("tenant-b", "evt-1", "hook-x"))),
                BUDGET
            )
            .await,
        Ok(HitOutcome::Ok)
    );
}

#[tokio::test]
async fn charges_are_all_or_nothing_and_taken_keys_spend_nothing() {
    let server = RedisServer::start().expect("redis-server starts");
    let store = store(&server).await;
    let t = "tenant-aon";
    // Hooks holds two hits in a burst, bytes one: the second hit is denied by
    // bytes alone, and must not move hooks either.
    let both = || {
        vec![
            charge(t, Kind::Hooks, 1_000_000, 2_000_000),
            charge(t, Kind::Bytes, 1_000_000, 1_000_000),
        ]
    };
    assert_eq!(
        store
            .hit(hit(both(), Some(claim(t, "k1", "h1"))), BUDGET)
            .await,
        Ok(HitOutcome::Ok)
    );
    match store
        .hit(hit(both(), Some(claim(t, "k2", "h2"))), BUDGET)
        .await
    {
        Ok(HitOutcome::RateLimited { retry_after_ms }) => {
            assert!(
                retry_after_ms > 0 && retry_after_ms <= 1_000,
                "{retry_after_ms}"
            );
        }
        other => panic!("expected RateLimited, got {other:?}"),
    }
    // Nothing was written by the denied hit: hooks still has its second slot...
    let hooks_only = vec![charge(t, Kind::Hooks, 1_000_000, 2_000_000)];
    assert_eq!(
        store.hit(hit(hooks_only.clone(), None), BUDGET).await,
        Ok(HitOutcome::Ok)
    );
    assert!(matches!(
        store.hit(hit(hooks_only, None), BUDGET).await,
        Ok(HitOutcome::RateLimited { .. })
    ));
    // ...and k2 was never claimed.
    assert_eq!(
        store
            .hit(hit(vec![], Some(claim(t, "k2", "other"))), BUDGET)
            .await,
        Ok(HitOutcome::Ok)
    );

    // A duplicate or pending answer spends no charge.
    let u = "tenant-spend";
    let one_left = || vec![charge(u, Kind::Hooks, 1_000_000, 2_000_000)];
    let first = claim(u, "k", "h1");
    assert_eq!(
        store
            .hit(hit(one_left(), Some(first.clone())), BUDGET)
            .await,
        Ok(HitOutcome::Ok)
    );
    assert!(matches!(
        store
            .hit(hit(one_left(), Some(claim(u, "k", "h2"))), BUDGET)
            .await,
        Ok(HitOutcome::Pending { .. })
    ));
    assert_eq!(
        store
            .settle(settle(first, Settlement::Commit), BUDGET)
            .await,
        Ok(SettleOutcome::Ok)
    );
    assert!(matches!(
        store
            .hit(hit(one_left(), Some(claim(u, "k", "h3"))), BUDGET)
            .await,
        Ok(HitOutcome::Duplicate { .. })
    ));
    // The second slot is still there for a fresh key.
    assert_eq!(
        store
            .hit(hit(one_left(), Some(claim(u, "k-new", "h4"))), BUDGET)
            .await,
        Ok(HitOutcome::Ok)
    );
    // A denied charge answers before the claim: even a committed key is
    // RateLimited while the bucket is empty.
    assert!(matches!(
        store
            .hit(hit(one_left(), Some(claim(u, "k", "h5"))), BUDGET)
            .await,
        Ok(HitOutcome::RateLimited { .. })
    ));

    // Reset forgets the buckets (claims stay).
    store.reset(u.into(), BUDGET).await.expect("reset");
    assert_eq!(
        store.hit(hit(one_left(), None), BUDGET).await,
        Ok(HitOutcome::Ok)
    );
    assert!(matches!(
        store
            .hit(hit(one_left(), Some(claim(u, "k", "h6"))), BUDGET)
            .await,
        Ok(HitOutcome::Duplicate { .. })
    ));
}

#[tokio::test]
async fn pending_claims_expire_and_bad_requests_are_refused() {
    let server = RedisServer::start().expect("redis-server starts");
    let store = store(&server).await;
    let t = "tenant-exp";
    let mut short = claim(t, "k", "h1");
    short.pending_ttl_ms = 100;
    assert_eq!(
        store.hit(hit(vec![], Some(short.clone())), BUDGET).await,
        Ok(HitOutcome::Ok)
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The holder died without settling: the key is free again.
    assert_eq!(
        store
            .hit(hit(vec![], Some(claim(t, "k", "h2"))), BUDGET)
            .await,
        Ok(HitOutcome::Ok)
    );
    assert_eq!(
        store
            .settle(settle(short, Settlement::Commit), BUDGET)
            .await,
        Ok(SettleOutcome::NotOwner {
            hook_id: "h2".into()
        })
    );

    // Nothing to do is the contract's `:ok`, and the rules' refusals come
    // before Redis is asked, as with the fleet's edge client.
    assert_eq!(
        store.hit(hit(vec![], None), BUDGET).await,
        Ok(HitOutcome::Ok)
    );
    assert!(matches!(
        store
            .hit(hit(vec![charge(t, Kind::Hooks, 10, 5)], None), BUDGET)
            .await,
        Err(StoreError::Invalid(_))
    ));
}

#[tokio::test]
async fn a_stalled_server_answers_timeout_within_the_budget() {
    let server = RedisServer::start().expect("redis-server starts");
    let store = Arc::new(store(&server).await);
    // Stall the server for 1 s from a connection of its own: every client's
    // commands wait until the pause ends, and the pause is in effect once the
    // server has answered it (a DEBUG SLEEP sent from another connection has
    // no answer that says it began, only one that says it ended).
    let client = redis::Client::open(server.url()).expect("url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let paused: String = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(1000)
        .arg("ALL")
        .query_async(&mut conn)
        .await
        .expect("CLIENT PAUSE");
    assert_eq!(paused, "OK");
    let budget = Duration::from_millis(100);
    let t0 = Instant::now();
    let answer = answered_within(store.hit(hit(roomy("tenant-stall"), None), budget), budget).await;
    println!("the paused server's call ended after {:?}", t0.elapsed());
    assert_eq!(answer, Err(StoreError::Timeout(budget)));
    // And once the server is back (the pause ends within this budget), so
    // are answers.
    assert_eq!(
        store
            .hit(hit(roomy("tenant-stall"), None), Duration::from_secs(5))
            .await,
        Ok(HitOutcome::Ok)
    );
}

#[tokio::test]
async fn a_short_workload_runs_clean() {
    let server = RedisServer::start().expect("redis-server starts");
    let store = Arc::new(store(&server).await);
    let cfg = WorkloadConfig {
        tenants: 50,
        mode: LoadMode::Concurrency { in_flight: 32 },
        // The run ends on its count of hits, not on the clock: a slow host
        // makes it longer, not smaller.
        duration: Duration::from_secs(60),
        max_hits: 1_000,
        duplicate_rate: 0.1,
        release_share: 0.1,
        progress: false,
        ..WorkloadConfig::default()
    };
    let report = workload::run(store, &cfg).await.expect("run");
    let h = &report.hit_outcomes;
    assert_eq!(report.hits, cfg.max_hits, "{report}");
    assert_eq!(h.errors_total(), 0, "{report}");
    assert_eq!(report.settle_outcomes.errors_total(), 0, "{report}");
    assert!(h.duplicate > 0, "{report}");
    assert_eq!(report.settles, h.ok, "{report}");
    assert_eq!(report.settle_outcomes.ok, report.settles, "{report}");
}

/// `ankusa bench --compare --rounds 2`: every store runs in every round, the
/// open loops of every round run at one rate, and each ratio printed is the
/// median (of two: the mean) of its rounds' values.
#[tokio::test]
async fn the_comparison_takes_the_median_of_its_rounds() {
    let (mut nats, mut node) = standalone_pair("cmp-1").await;
    let server = RedisServer::start().expect("redis-server starts");
    let watch = [
        format!("nats-server={}", nats.pid().expect("nats-server runs")),
        format!("node={}", node.process().pid()),
        format!("redis-server={}", server.pid()),
    ];
    let dir = tempfile::tempdir().expect("temp dir");
    let json = dir.path().join("compare.json");
    let out = tokio::process::Command::new(cargo_bin("ankusa"))
        .args(["--nats", &nats.url(), "--instance", &node.spec.instance])
        .args(["--shards", &node.spec.shards.to_string()])
        .args(["bench", "--compare", "--rounds", "2", "--duration-s", "0.4"])
        .args(["--tenants", "20", "--concurrency", "16", "--redis-url"])
        .arg(server.url())
        .args(watch.iter().flat_map(|w| ["--cpu-of", w.as_str()]))
        .arg("--json")
        .arg(&json)
        .env_remove("ANKUSA_NATS")
        .output()
        .await
        .expect("ankusa runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("== ratios: the median of 2 rounds"),
        "{stdout}"
    );

    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the JSON report")).expect("JSON");
    let rounds = report["rounds"].as_array().expect("rounds");
    assert_eq!(rounds.len(), 2);
    let mut rates = Vec::new();
    for round in rounds {
        let labels: Vec<&str> = round["peak"]
            .as_array()
            .expect("peak")
            .iter()
            .map(|r| r["label"].as_str().expect("label"))
            .collect();
        assert_eq!(
            labels,
            ["echo", "redis-lua", "fleet", "fleet+batch", "echo+batch"]
        );
        for r in round["peak"].as_array().expect("peak") {
            assert!(r["hits"].as_u64() > Some(0), "{r}");
            // Every watched process is read in every run.
            let cpu = &r["process_cpu_s"];
            for name in ["nats-server", "node", "redis-server"] {
                assert!(cpu[name].as_f64().is_some_and(|s| s >= 0.0), "{name}: {r}");
            }
        }
        // The fleet's hits cost its node CPU; the bare echo's do not reach it.
        let fleet = &round["peak"][2]["process_cpu_s"]["node"];
        assert!(fleet.as_f64() > Some(0.0), "{fleet}");
        let half_peak = round["half_peak"].as_array().expect("half_peak");
        assert_eq!(half_peak.len(), 2, "unbatched and batched");
        rates.extend(half_peak.iter().map(|h| h["rate_per_sec"].as_f64()));
    }
    assert_eq!(
        rates[..2],
        rates[2..],
        "both rounds' open loops at one rate"
    );

    let ratios = report["ratios"].as_array().expect("ratios");
    assert_eq!(
        ratios.len(),
        11,
        "six judged and three bounds at peak, two at half the peak"
    );
    let bounds: Vec<_> = ratios.iter().filter(|r| r["target"] == "context").collect();
    assert_eq!(bounds.len(), 3, "{bounds:?}");
    assert!(bounds.iter().all(|r| r["met"].is_null()), "{bounds:?}");
    // With the node watched, the bound of a free node is measured, and above
    // the fleet's own ratio to Redis.
    let free = ratios
        .iter()
        .find(|r| r["what"].as_str().is_some_and(|w| w.contains("nodes free")))
        .expect("the free-node bound");
    let actual = &ratios[0];
    assert!(
        free["value"].as_f64() > actual["value"].as_f64(),
        "{free} against {actual}"
    );
    assert!(stdout.contains("CPU µs per hit and its settle"), "{stdout}");
    for (i, ratio) in ratios.iter().enumerate() {
        let each: Vec<f64> = rounds
            .iter()
            .filter_map(|round| round["ratios"][i]["value"].as_f64())
            .collect();
        assert_eq!(ratio["rounds"].as_array().map(Vec::len), Some(2), "{ratio}");
        if each.len() == 2 {
            let median = (each[0] + each[1]) / 2.0;
            let value = ratio["value"].as_f64().expect("a value");
            assert!((value - median).abs() < 1e-9, "{ratio} against {each:?}");
        }
    }
}
