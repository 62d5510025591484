//! The NATS echo baseline against a real `nats-server` that this test starts on a
//! free loopback port: the echo answers every call, the store sends exactly the
//! fleet client's bytes, and transport failures are the right errors in budget.
//! The node echo (the floor of edge batching) answers the fleet's own edge
//! client, which batches to it as to a node.
//!
//! The server comes from the shared harness: without a `nats-server` the test
//! fails (it never skips); `scripts/ensure-nats.sh` installs one.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ankusa_actors::{
    Charge, Claim, HitOutcome, HitRequest, Kind, SettleOutcome, SettleRequest, Settlement,
};
use ankusa_bus::{
    ErrorCode, FleetConfig, NatsOptions, Op, Reply, ReplyBody, Request, Store, StoreError,
};
use ankusa_node::bench::echo::{EchoError, EchoResponder, EchoStore, NodeEchoResponder};
use ankusa_node::bench::workload::{self, LoadMode, WorkloadConfig};
use ankusa_tests::fleet::connected_edge;
use ankusa_tests::requests::answered_within;
use ankusa_tests::NatsServer;
use futures::StreamExt;

const BUDGET: Duration = Duration::from_millis(500);

fn claim() -> Claim {
    Claim {
        tenant: "t".into(),
        source_id: "src".into(),
        key: "k".into(),
        hook_id: "h".into(),
        node: "n1".into(),
        ttl_ms: 60_000,
        pending_ttl_ms: 5_000,
    }
}

fn hit() -> HitRequest {
    HitRequest {
        charges: vec![Charge {
            kind: Kind::Hooks,
            tenant: "t".into(),
            increment_us: 1_000,
            capacity_us: 1_000_000,
        }],
        claim: Some(claim()),
    }
}

#[tokio::test]
async fn the_echo_answers_hits_settles_and_resets() {
    let server = NatsServer::start().await.expect("nats-server starts");
    let client = server.connect().await.expect("connect");
    let _echo = EchoResponder::start(client.clone(), "bench.echo")
        .await
        .expect("start echo");
    let store = EchoStore::new(client, "bench.echo");
    assert_eq!(store.hit(hit(), BUDGET).await, Ok(HitOutcome::Ok));
    let settle = SettleRequest {
        claim: claim(),
        settlement: Settlement::Commit,
    };
    assert_eq!(store.settle(settle, BUDGET).await, Ok(SettleOutcome::Ok));
    assert_eq!(store.reset("t".into(), BUDGET).await, Ok(()));
    // Invalid requests are refused before anything is sent, as the fleet client
    // does; a hit with nothing to do is the contract's `:ok`, sent nowhere.
    let mut invalid = hit();
    invalid.charges[0].capacity_us = 0;
    assert!(matches!(
        store.hit(invalid, BUDGET).await,
        Err(StoreError::Invalid(_))
    ));
    let empty = HitRequest {
        charges: vec![],
        claim: None,
    };
    assert_eq!(store.hit(empty, BUDGET).await, Ok(HitOutcome::Ok));
}

#[tokio::test]
async fn the_store_sends_the_fleet_clients_bytes() {
    let server = NatsServer::start().await.expect("nats-server starts");
    let client = server.connect().await.expect("connect");
    // A raw responder that records what arrives and answers like the echo.
    let mut sub = client.subscribe("bench.raw.hit").await.expect("subscribe");
    client.flush().await.expect("flush");
    let responder = client.clone();
    let seen = tokio::spawn(async move {
        let msg = sub.next().await.expect("one request");
        let reply = ankusa_bus::Reply::new(ankusa_bus::ReplyBody::Hit(HitOutcome::Ok)).encode();
        if let Some(to) = msg.reply.clone() {
            responder.publish(to, reply.into()).await.expect("publish");
        }
        msg.payload.to_vec()
    });
    let store = EchoStore::new(client, "bench.raw");
    assert_eq!(store.hit(hit(), BUDGET).await, Ok(HitOutcome::Ok));
    let payload = seen.await.expect("responder task");
    let expected = Request::new(BUDGET.as_millis() as u64, Op::Hit(hit())).encode_compact();
    assert_eq!(payload, expected);
}

#[tokio::test]
async fn transport_failures_are_errors_within_the_budget() {
    let server = NatsServer::start().await.expect("nats-server starts");
    let client = server.connect().await.expect("connect");
    // Nobody listens: no responders, at once.
    let store = EchoStore::new(client.clone(), "bench.nobody");
    let t0 = Instant::now();
    assert_eq!(
        store.hit(hit(), BUDGET).await,
        Err(StoreError::NoResponders)
    );
    assert!(t0.elapsed() < BUDGET);

    // Someone listens but never answers: a timeout, within the budget.
    let _sub = client.subscribe("bench.mute.hit").await.expect("subscribe");
    client.flush().await.expect("flush");
    let store = EchoStore::new(client, "bench.mute");
    let budget = Duration::from_millis(100);
    let t0 = Instant::now();
    let answer = answered_within(store.hit(hit(), budget), budget).await;
    println!(
        "the mute subject answered {answer:?} after {:?}",
        t0.elapsed()
    );
    assert_eq!(answer, Err(StoreError::Timeout(budget)));
}

#[tokio::test]
async fn a_responder_stops_answering_when_dropped() {
    let server = NatsServer::start().await.expect("nats-server starts");
    let client = server.connect().await.expect("connect");
    let echo = EchoResponder::start(client.clone(), "bench.gone")
        .await
        .expect("start echo");
    let wildcard = EchoResponder::start(client.clone(), "bench.*").await;
    assert!(
        matches!(&wildcard, Err(EchoError::BadSubject(base)) if base == "bench.*"),
        "{wildcard:?}"
    );
    let store = EchoStore::new(client.clone(), echo.base());
    assert_eq!(store.hit(hit(), BUDGET).await, Ok(HitOutcome::Ok));
    drop(echo);
    // The unsubscribe reaches the server asynchronously; give it a moment.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match store.hit(hit(), Duration::from_millis(200)).await {
            Err(StoreError::NoResponders) => break,
            other => assert!(Instant::now() < deadline, "still answered: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_short_workload_runs_clean() {
    let server = NatsServer::start().await.expect("nats-server starts");
    let client = server.connect().await.expect("connect");
    let _echo = EchoResponder::start(client.clone(), "bench.load")
        .await
        .expect("start echo");
    let store = Arc::new(EchoStore::new(client, "bench.load"));
    let cfg = WorkloadConfig {
        tenants: 50,
        mode: LoadMode::Rate {
            per_sec: 2_000.0,
            max_in_flight: 256,
        },
        // The run ends on its count of hits (half a second at this rate),
        // not on the clock: a slow host makes it longer, not smaller.
        duration: Duration::from_secs(60),
        max_hits: 1_000,
        progress: false,
        ..WorkloadConfig::default()
    };
    let report = workload::run(store, &cfg).await.expect("run");
    // The echo answers Ok to everything, so every hit settles.
    assert_eq!(report.hits, cfg.max_hits, "{report}");
    assert_eq!(report.hit_outcomes.ok, report.hits, "{report}");
    assert_eq!(report.settles, report.hits, "{report}");
    assert_eq!(report.settle_outcomes.ok, report.settles, "{report}");
}

#[tokio::test]
async fn the_node_echo_is_batched_to_as_a_node() {
    let server = NatsServer::start().await.expect("nats-server starts");
    let client = server.connect().await.expect("connect");
    let instance = "bench-echo-test";
    let _echo = NodeEchoResponder::start(client.clone(), instance)
        .await
        .expect("start node echo");
    let bad = NodeEchoResponder::start(client.clone(), "Bad Instance").await;
    assert!(
        matches!(&bad, Err(EchoError::BadSubject(instance)) if instance == "Bad Instance"),
        "{bad:?}"
    );

    // What does not decode gets its error, not an `ok`.
    let garbage = client
        .request(format!("ankusa.{instance}.shard.0"), vec![0xc1].into())
        .await
        .expect("an answer");
    let reply = Reply::decode(&garbage.payload).expect("a reply");
    assert!(
        matches!(&reply.body, ReplyBody::Error(e) if e.code == ErrorCode::Malformed),
        "{reply:?}"
    );

    // Copies of what reaches the node's subject: the edge's batches.
    let node_subject = format!("ankusa.{instance}.node.{}", NodeEchoResponder::NODE);
    let mut batches = client.subscribe(node_subject).await.expect("subscribe");
    ankusa_bus::server_caught_up(&client)
        .await
        .expect("the server has the subscription");
    let mut config = FleetConfig::new(NatsOptions::with_servers([server.url()]), instance);
    config.batching = true;
    let store = Arc::new(connected_edge(config).await);
    let cfg = WorkloadConfig {
        tenants: 50,
        mode: LoadMode::Concurrency { in_flight: 64 },
        // Ends on its count of hits, not on the clock (see above).
        duration: Duration::from_secs(60),
        max_hits: 2_000,
        progress: false,
        ..WorkloadConfig::default()
    };
    let report = workload::run(store, &cfg).await.expect("run");
    assert_eq!(report.hits, cfg.max_hits, "{report}");
    assert_eq!(report.hit_outcomes.ok, report.hits, "{report}");
    assert_eq!(report.settle_outcomes.ok, report.settles, "{report}");
    assert_eq!(report.settles, report.hits, "{report}");

    // Most calls went in batches to the node's subject, each of several calls.
    let mut calls_in_batches = 0;
    let mut messages = 0;
    while let Ok(Some(msg)) = tokio::time::timeout(Duration::from_millis(200), batches.next()).await
    {
        let request = Request::decode(&msg.payload).expect("a request");
        if let Op::Batch(items) = request.op {
            calls_in_batches += items.len() as u64;
        }
        messages += 1;
    }
    let calls = report.hits + report.settles;
    assert!(
        calls_in_batches * 2 > calls,
        "{calls_in_batches} of {calls} calls batched"
    );
    assert!(
        messages * 4 < calls_in_batches,
        "{messages} messages for {calls_in_batches} calls"
    );
}
