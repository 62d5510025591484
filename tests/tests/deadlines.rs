//! Hard deadlines: with its node paused (SIGSTOP), every call answers within its
//! timeout plus 5 ms, 1000 calls in a row. Alone in its test binary so that no
//! other test's processes compete for the CPU while it measures.
//!
//! A shared or virtual machine can wake any timer late: a vCPU that went idle
//! waits for the hypervisor, a busy neighbour holds the core. That is not the
//! client's to answer for, so each call is raced against a plain tokio timer
//! set to the same deadline, started with it on the same task, and the client
//! answers for the time it took beyond the later of the deadline and that
//! timer's wake-up. A client that overran its deadline would still be caught:
//! the plain timer does not wait for the client's work. How long the calls
//! took (the median ends at 9.4–9.6 ms of 10 here, idle or loaded) is printed
//! beside it, not asserted: an absolute figure is a speed target, which a
//! loaded host misses for reasons of its own.

use std::time::{Duration, Instant};

use ankusa_actors::HitOutcome;
use ankusa_bus::{FleetConfig, FleetStore, NatsOptions, Store, StoreError};
use ankusa_tests::requests::hit;
use ankusa_tests::{connected_edge, standalone_pair};

#[test]
fn a_paused_node_costs_each_call_its_timeout_and_no_more() {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(paused_node_calls());
}

async fn paused_node_calls() {
    let (nats, mut node) = standalone_pair("solo").await;
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
            let mut calls = Vec::with_capacity(500);
            for i in 0..500 {
                let invoked = Instant::now();
                let call = async {
                    let result = store
                        .hit(hit("acme", &format!("p{s}-{i}"), "h"), timeout)
                        .await;
                    (result, Instant::now())
                };
                let reference = async {
                    tokio::time::sleep(timeout).await;
                    Instant::now()
                };
                let ((result, answered), woke) = tokio::join!(call, reference);
                assert!(matches!(result, Err(StoreError::Timeout(_))), "{result:?}");
                calls.push(Call {
                    invoked,
                    answered,
                    woke,
                });
            }
            calls
        }
    });
    let calls: Vec<Call> = futures::future::join_all(streams)
        .await
        .into_iter()
        .flatten()
        .collect();
    node.resume().expect("SIGCONT");

    let took = |c: &Call| (c.answered - c.invoked).as_micros() as u64;
    let late_by = |c: &Call| {
        let deadline = c.invoked + timeout;
        c.answered.saturating_duration_since(deadline.max(c.woke))
    };
    let worst_late = calls.iter().map(late_by).max().unwrap_or_default();
    let mut raw: Vec<u64> = calls.iter().map(took).collect();
    raw.sort_unstable();
    let woken_late = calls
        .iter()
        .filter(|c| c.woke > c.invoked + timeout + slack)
        .count();
    println!(
        "1000 calls to a paused node, {timeout:?} budget: took p50 {} us, p99 {} us, max {} us; \
         latest answer {worst_late:?} after both the deadline and a plain timer set to it \
         ({woken_late} such timers themselves woke more than {slack:?} late)",
        raw[raw.len() / 2],
        raw[raw.len() * 99 / 100],
        raw[raw.len() - 1],
    );
    assert_eq!(calls.len(), 1000);
    assert!(
        worst_late <= slack,
        "a call answered {worst_late:?} after its deadline and its reference timer"
    );
}

/// One call's instants: when it was made, when it answered, and when a plain
/// timer set to its deadline, started with it, woke.
struct Call {
    invoked: Instant,
    answered: Instant,
    woke: Instant,
}

const T: Duration = Duration::from_millis(500);

async fn connected(url: &str) -> FleetStore {
    let mut config = FleetConfig::new(NatsOptions::with_servers([url]), "test");
    config.shards = 16;
    connected_edge(config).await
}
