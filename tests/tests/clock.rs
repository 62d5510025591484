//! A node keeps the NATS server's time, not its host's: a tenant that moves
//! to a node whose host clock is an hour off keeps its buckets and its
//! pending claims as they were.
//!
//! The hosts' clocks are played by `ANKUSA_TEST_CLOCK_SKEW_MS`, which starts a
//! node's clock that far off its host's. Read by the host's clock, an hour
//! behind would leave the tenant's emptied bucket empty for an hour more, and
//! an hour ahead would find it full and expire a claim still in flight (a
//! second delivery of the hook let through): each assertion below fails then.

use std::time::Duration;

use ankusa_actors::{HitOutcome, HitRequest};
use ankusa_bus::{FleetConfig, FleetStore, NatsOptions, Store};
use ankusa_node::run::TEST_CLOCK_SKEW_ENV;
use ankusa_tests::requests::{claim, hooks};
use ankusa_tests::{connected_edge, NatsServer, NodeProcess, NodeSpec};

const T: Duration = Duration::from_millis(1000);
const HOUR_MS: i64 = 3_600_000;
/// One hook per ten minutes, two at once.
const PER_MS: u64 = 600_000;
const TENANT: &str = "clocked";

async fn node(id: &str, nats: &NatsServer, skew_ms: i64) -> NodeProcess {
    let spec = NodeSpec {
        env: vec![(TEST_CLOCK_SKEW_ENV.into(), skew_ms.to_string())],
        ..NodeSpec::fleet(id, vec![nats.url()])
    };
    let node = NodeProcess::start(spec).expect("node starts");
    node.wait_ready(Duration::from_secs(20))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    node
}

fn charge() -> HitRequest {
    HitRequest {
        charges: vec![hooks(TENANT, 2, PER_MS)],
        claim: None,
    }
}

/// A claim on the key in flight, pending for half an hour, by `hook_id`.
fn in_flight(hook_id: &str) -> HitRequest {
    let mut claim = claim(TENANT, "in-flight", hook_id);
    claim.pending_ttl_ms = 1_800_000;
    HitRequest {
        charges: vec![],
        claim: Some(claim),
    }
}

/// The hooks bucket's wait: about ten minutes while it is empty.
async fn denied_for_ms(store: &FleetStore, on: &str) -> u64 {
    match store.hit(charge(), T).await {
        Ok(HitOutcome::RateLimited { retry_after_ms }) => retry_after_ms,
        other => panic!("on {on}, the emptied bucket answered {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_moving_to_a_node_whose_clock_is_an_hour_off_keeps_its_buckets_and_claims() {
    let nats = NatsServer::start().await.expect("nats");
    let mut config = FleetConfig::new(NatsOptions::with_servers([nats.url()]), "test");
    config.shards = 16;
    let store = connected_edge(config).await;

    // On a node whose clock is right: the claim is taken, the bucket emptied.
    let mut right = node("node-right", &nats, 0).await;
    assert_eq!(store.hit(in_flight("h1"), T).await, Ok(HitOutcome::Ok));
    for _ in 0..2 {
        assert_eq!(store.hit(charge(), T).await, Ok(HitOutcome::Ok));
    }
    let wait = denied_for_ms(&store, "node-right").await;
    assert!((PER_MS - 5_000..=PER_MS).contains(&wait), "{wait} ms");
    right.stop().await.expect("node-right stops");

    // An hour behind: the bucket's wait is still about ten minutes, not 70.
    let mut behind = node("node-behind", &nats, -HOUR_MS).await;
    let wait = denied_for_ms(&store, "node-behind").await;
    assert!(
        (PER_MS - 60_000..=PER_MS).contains(&wait),
        "on a node an hour behind the bucket waits {wait} ms"
    );
    match store.hit(in_flight("h2"), T).await {
        Ok(HitOutcome::Pending { .. }) => {}
        other => panic!("on node-behind, the claim in flight answered {other:?}"),
    }
    let offset = behind
        .metric("ankusa_clock_offset_seconds")
        .await
        .expect("the node reports its clock's offset");
    assert!(
        offset.abs() < 1.0,
        "offset {offset} s after the clock was set"
    );
    assert!(
        behind.log().contains("clock set to the NATS server's"),
        "{}",
        behind.log_tail(20)
    );
    behind.stop().await.expect("node-behind stops");

    // An hour ahead: the claim is still in flight and the bucket still empty.
    let ahead = node("node-ahead", &nats, HOUR_MS).await;
    match store.hit(in_flight("h3"), T).await {
        Ok(HitOutcome::Pending { retry_after_ms }) => assert!(
            retry_after_ms > 1_700_000,
            "the claim has {retry_after_ms} ms left of its 30 minutes"
        ),
        other => panic!("on node-ahead, the claim in flight answered {other:?}"),
    }
    let wait = denied_for_ms(&store, "node-ahead").await;
    assert!((PER_MS - 60_000..=PER_MS).contains(&wait), "{wait} ms");
    drop(ahead);
}
