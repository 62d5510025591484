//! Hard deadlines: with its node paused (SIGSTOP), every call answers within its
//! timeout plus a small slack, 1000 calls in a row. Alone in its test binary so
//! that no other test's processes compete for the CPU while it measures.

use std::time::{Duration, Instant};

use ankusa_actors::HitOutcome;
use ankusa_bus::{FleetConfig, FleetStore, NatsOptions, Store, StoreError};
use ankusa_tests::requests::hit;
use ankusa_tests::{wait_until, NatsServer, NodeProcess, NodeSpec};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_node_costs_each_call_its_timeout_and_no_more() {
    let (nats, mut node) = serving_pair().await;
    let store = connected(&nats.url()).await;
    assert_eq!(
        store.hit(hit("acme", "warm", "w"), T).await,
        Ok(HitOutcome::Ok)
    );
    node.pause().expect("SIGSTOP");

    let timeout = Duration::from_millis(10);
    let slack = Duration::from_millis(5);
    let streams = (0..2).map(|s| {
        let store = store.clone();
        async move {
            let mut worst = Duration::ZERO;
            for i in 0..500 {
                let started = Instant::now();
                let result = store
                    .hit(hit("acme", &format!("p{s}-{i}"), "h"), timeout)
                    .await;
                let took = started.elapsed();
                assert!(matches!(result, Err(StoreError::Timeout(_))), "{result:?}");
                worst = worst.max(took);
            }
            worst
        }
    });
    let worst = futures::future::join_all(streams)
        .await
        .into_iter()
        .max()
        .unwrap_or_default();
    node.resume().expect("SIGCONT");
    assert!(
        worst <= timeout + slack,
        "slowest call took {worst:?} for a {timeout:?} budget"
    );
    println!("1000 calls to a paused node: slowest {worst:?} for a {timeout:?} budget");
}

const T: Duration = Duration::from_millis(500);

async fn serving_pair() -> (NatsServer, NodeProcess) {
    let nats = NatsServer::start().await.expect("nats-server starts");
    let node =
        NodeProcess::start(NodeSpec::standalone("solo", vec![nats.url()])).expect("node starts");
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");
    (nats, node)
}

async fn connected(url: &str) -> FleetStore {
    let mut config = FleetConfig::new(NatsOptions::with_servers([url]), "test");
    config.shards = 16;
    let store = FleetStore::connect(config).await.expect("valid config");
    wait_until(Duration::from_secs(5), || async {
        store.nats().connection_state() == async_nats::connection::State::Connected
    })
    .await
    .expect("edge connects");
    store
}
