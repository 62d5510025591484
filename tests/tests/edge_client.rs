//! The edge client against a real nats-server and a real `ankusa-node`
//! (standalone): every result kind end to end, the protocol's refusals, hard
//! deadlines with a paused node, NATS absent at start, and NATS coming back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ankusa_actors::{HitOutcome, HitRequest, SettleOutcome, Settlement};
use ankusa_bus::edge::{Edge, EdgeConfig, LocalReason, Source};
use ankusa_bus::protocol::{ErrorCode, Op, Reply, ReplyBody, Request};
use ankusa_bus::{FleetConfig, FleetStore, NatsOptions, Store, StoreError, Subjects};
use ankusa_tests::requests::{claim, hit, hooks, settle};
use ankusa_tests::{
    connected_edge, standalone_pair, wait_until, NatsServer, NodeProcess, NodeSpec,
};

const T: Duration = Duration::from_millis(500);

fn config(url: &str, batching: bool) -> FleetConfig {
    let mut config = FleetConfig::new(NatsOptions::with_servers([url]), "test");
    config.shards = 16;
    config.batching = batching;
    config
}

async fn fleet(url: &str, batching: bool) -> FleetStore {
    FleetStore::connect(config(url, batching))
        .await
        .expect("valid config")
}

async fn connected(url: &str) -> FleetStore {
    connected_edge(config(url, true)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_result_kind_end_to_end() {
    let (nats, _node) = standalone_pair("solo").await;
    let store = connected(&nats.url()).await;

    // "No limit" is a budget too (it used to overflow the deadline's instant).
    assert_eq!(
        store.hit(hit("acme", "evt-0", "h0"), Duration::MAX).await,
        Ok(HitOutcome::Ok)
    );

    // Ok, then Pending for another hook, then Duplicate once committed.
    assert_eq!(
        store.hit(hit("acme", "evt-1", "h1"), T).await,
        Ok(HitOutcome::Ok)
    );
    match store.hit(hit("acme", "evt-1", "h2"), T).await {
        Ok(HitOutcome::Pending { retry_after_ms }) => assert!(retry_after_ms >= 1),
        other => panic!("expected Pending, got {other:?}"),
    }
    assert_eq!(
        store
            .settle(settle("acme", "evt-1", "h2", Settlement::Commit), T)
            .await,
        Ok(SettleOutcome::NotOwner {
            hook_id: "h1".into()
        })
    );
    assert_eq!(
        store
            .settle(settle("acme", "evt-1", "h1", Settlement::Commit), T)
            .await,
        Ok(SettleOutcome::Ok)
    );
    assert_eq!(
        store.hit(hit("acme", "evt-1", "h3"), T).await,
        Ok(HitOutcome::Duplicate {
            hook_id: "h1".into()
        })
    );
    assert_eq!(
        store
            .settle(settle("acme", "evt-1", "h1", Settlement::Release), T)
            .await,
        Ok(SettleOutcome::AlreadyCommitted)
    );

    // Release frees the key; an unknown claim is NotFound.
    assert_eq!(
        store.hit(hit("acme", "evt-2", "h4"), T).await,
        Ok(HitOutcome::Ok)
    );
    assert_eq!(
        store
            .settle(settle("acme", "evt-2", "h4", Settlement::Release), T)
            .await,
        Ok(SettleOutcome::Ok)
    );
    assert_eq!(
        store.hit(hit("acme", "evt-2", "h5"), T).await,
        Ok(HitOutcome::Ok)
    );
    assert_eq!(
        store
            .settle(settle("acme", "nope", "h9", Settlement::Commit), T)
            .await,
        Ok(SettleOutcome::NotFound)
    );

    // A burst of two, then RateLimited; a reset forgets the bucket.
    let limited = |n: &str| HitRequest {
        charges: vec![hooks("tight", 2, 60_000)],
        claim: Some(claim("tight", n, n)),
    };
    assert_eq!(store.hit(limited("a"), T).await, Ok(HitOutcome::Ok));
    assert_eq!(store.hit(limited("b"), T).await, Ok(HitOutcome::Ok));
    match store.hit(limited("c"), T).await {
        Ok(HitOutcome::RateLimited { retry_after_ms }) => {
            assert!(
                (59_000..=60_000).contains(&retry_after_ms),
                "{retry_after_ms}"
            )
        }
        other => panic!("expected RateLimited, got {other:?}"),
    }
    // The denied hit wrote nothing: its key is still free after the reset. The
    // key is hit by another hook: had the denied hit claimed it for hook `c`,
    // a reset (which forgets buckets, not claims) would leave that claim, and
    // another hook would meet it `Pending` (the same hook would be answered
    // `Ok` as a replay, whether the claim was there or not).
    assert_eq!(store.reset("tight".into(), T).await, Ok(()));
    let other_hook = HitRequest {
        claim: Some(claim("tight", "c", "c-other-hook")),
        ..limited("c")
    };
    assert_eq!(store.hit(other_hook, T).await, Ok(HitOutcome::Ok));

    // Invalid requests are refused before they leave the edge.
    let mut bad = hit("acme", "evt-3", "h6");
    bad.charges[0].increment_us = 0;
    assert!(matches!(
        store.hit(bad, T).await,
        Err(StoreError::Invalid(_))
    ));

    // Concurrent hits on one shard share messages and all get their own answer.
    let calls = (0..200).map(|i| {
        let store = store.clone();
        async move {
            store
                .hit(hit("acme", &format!("burst-{i}"), &format!("b{i}")), T)
                .await
        }
    });
    let answers = futures::future::join_all(calls).await;
    assert!(
        answers.iter().all(|a| *a == Ok(HitOutcome::Ok)),
        "{answers:?}"
    );
    let replays = (0..200).map(|i| {
        let store = store.clone();
        async move {
            store
                .hit(hit("acme", &format!("burst-{i}"), &format!("other{i}")), T)
                .await
        }
    });
    let replays = futures::future::join_all(replays).await;
    assert!(
        replays
            .iter()
            .all(|a| matches!(a, Ok(HitOutcome::Pending { .. }))),
        "{replays:?}"
    );
}

/// Sends raw bytes to a subject and decodes the reply.
async fn raw(client: &async_nats::Client, subject: String, payload: Vec<u8>) -> Reply {
    let message = tokio::time::timeout(T, client.request(subject, payload.into()))
        .await
        .expect("answered in time")
        .expect("request sent");
    Reply::decode(&message.payload).expect("a well-formed reply")
}

fn error_code(reply: &Reply) -> ErrorCode {
    match &reply.body {
        ReplyBody::Error(err) => err.code,
        other => panic!("expected an error reply, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_refuses_bad_input_with_typed_errors_and_keeps_serving() {
    let (nats, _node) = standalone_pair("solo").await;
    let client = nats.connect().await.expect("connect");
    let subjects = Subjects::new("test").unwrap();
    let shard = ankusa_bus::shard_of("acme", 16);
    let subject = subjects.shard(shard);

    let garbage = raw(&client, subject.clone(), b"\xc1\xff not msgpack".to_vec()).await;
    assert_eq!(error_code(&garbage), ErrorCode::Malformed);

    let mut future = Request::new(
        100,
        Op::Reset {
            tenant: "acme".into(),
        },
    );
    future.v = 99;
    let reply = raw(&client, subject.clone(), future.encode()).await;
    assert_eq!(error_code(&reply), ErrorCode::UnsupportedVersion);
    match reply.body {
        ReplyBody::Error(err) => assert_eq!(err.supported_versions, Some(vec![1])),
        _ => unreachable!(),
    }

    let mut invalid = hit("acme", "k", "h");
    invalid.charges[0].capacity_us = 1;
    let reply = raw(
        &client,
        subject.clone(),
        Request::new(100, Op::Hit(invalid)).encode(),
    )
    .await;
    assert_eq!(error_code(&reply), ErrorCode::Invalid);

    let expired = Request::new(0, Op::Hit(hit("acme", "k", "h")));
    let reply = raw(&client, subject.clone(), expired.encode()).await;
    assert_eq!(error_code(&reply), ErrorCode::DeadlineExpired);

    let wrong = subjects.shard((shard + 1) % 16);
    let reply = raw(
        &client,
        wrong,
        Request::new(100, Op::Hit(hit("acme", "k", "h"))).encode(),
    )
    .await;
    assert_eq!(error_code(&reply), ErrorCode::WrongShard);

    let huge = vec![0x90u8; 70 * 1024];
    let reply = raw(&client, subject.clone(), huge).await;
    assert_eq!(error_code(&reply), ErrorCode::TooLarge);

    // And it still serves.
    let ok = raw(
        &client,
        subject,
        Request::new(100, Op::Hit(hit("acme", "k", "h"))).encode(),
    )
    .await;
    assert_eq!(ok.body, ReplyBody::Hit(HitOutcome::Ok));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_down_at_start_then_coming_back() {
    // A server that is down when the edge starts.
    let mut nats = NatsServer::start().await.expect("nats-server starts");
    nats.stop().await.expect("nats-server stops");
    let url = nats.url();
    // Bounds far from what is measured, so that a loaded host does not fail
    // them: a connect that waited for the server would wait for good (none
    // comes), and a call that did not fail fast would wait out its budget.
    let started = Instant::now();
    let store = fleet(&url, true).await;
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "connect blocked {:?}",
        started.elapsed()
    );

    let edge = Arc::new(Edge::new(store.clone(), EdgeConfig::default()));
    let budget = Duration::from_secs(30);
    let started = Instant::now();
    assert_eq!(
        store.hit(hit("acme", "k0", "h"), budget).await,
        Err(StoreError::Disconnected)
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "Disconnected took {:?} of a {budget:?} budget",
        started.elapsed()
    );
    let answer = edge
        .hit(hit("acme", "k1", "h1"), T)
        .await
        .expect("a local answer");
    assert_eq!(answer.outcome, HitOutcome::Ok);
    assert_eq!(
        answer.source,
        Source::Local {
            reason: LocalReason::Disconnected
        }
    );
    // Local dedupe holds while the fleet is away.
    let again = edge.hit(hit("acme", "k1", "h2"), T).await.expect("local");
    assert!(
        matches!(again.outcome, HitOutcome::Pending { .. }),
        "{again:?}"
    );

    // NATS (and a node) come up on that port: the same edge goes back to the fleet.
    nats.start_again()
        .await
        .expect("nats-server starts again on its port");
    let node = NodeProcess::start(NodeSpec::standalone("late", vec![nats.url()])).expect("node");
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");
    let mut n = 0;
    let back = wait_until(Duration::from_secs(15), || {
        n += 1;
        let edge = edge.clone();
        let key = format!("back-{n}");
        async move {
            matches!(edge.hit(hit("acme", &key, "h"), T).await, Ok(a) if a.source == Source::Fleet)
        }
    })
    .await;
    assert!(
        back.is_ok(),
        "edge never returned to the fleet; stats {:?}",
        edge.stats()
    );
    assert!(edge.stats().fleet_answers >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_node_means_no_responders_within_the_deadline() {
    let nats = NatsServer::start().await.expect("nats-server starts");
    let store = connected(&nats.url()).await;
    // The first request of a connection also sets up its reply subscription; an
    // edge that has been running has done that long ago.
    let _ = store.hit(hit("acme", "warm", "h"), T).await;
    for budget_ms in [5, 50, 200] {
        let budget = Duration::from_millis(budget_ms);
        let started = Instant::now();
        // A plain timer set to the budget, started once the call has set its
        // own deadline (on its first poll), is the reference: the call must
        // end by the later of its deadline and that timer's wake-up, whatever
        // a loaded host does to timers (as in `deadlines.rs`).
        let call = store.hit(hit("acme", "k", "h"), budget);
        tokio::pin!(call);
        let first = futures::poll!(&mut call);
        let reference = async {
            tokio::time::sleep(budget).await;
            Instant::now()
        };
        let ((result, answered), woke) = tokio::join!(
            async {
                match first {
                    std::task::Poll::Ready(result) => (result, Instant::now()),
                    std::task::Poll::Pending => ((&mut call).await, Instant::now()),
                }
            },
            reference
        );
        let took = answered - started;
        let late_by = answered.saturating_duration_since((started + budget).max(woke));
        if budget_ms >= 50 {
            assert_eq!(result, Err(StoreError::NoResponders), "budget {budget:?}");
        } else {
            // So short a budget may run out before the server's answer arrives.
            assert!(
                matches!(
                    result,
                    Err(StoreError::NoResponders | StoreError::Timeout(_))
                ),
                "budget {budget:?}: {result:?}"
            );
        }
        assert!(
            late_by <= Duration::from_millis(5),
            "{took:?} for {budget:?}: {late_by:?} after both the deadline and a plain timer set to it"
        );
        // It kept retrying (a handoff may end) instead of giving up at once.
        if budget_ms >= 50 {
            assert!(took >= budget / 2, "gave up after {took:?} of {budget:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_of_the_largest_calls_are_split_to_fit_a_message() {
    let (nats, _node) = standalone_pair("solo").await;
    let store = connected(&nats.url()).await;
    // Calls of the largest size the rules allow: 64 of them make a batch of
    // about 170 KB, well over the 64 KiB a request may hold.
    let long = |c: char, n: usize| std::iter::repeat_n(c, n).collect::<String>();
    let big = |tenant: &str, i: usize| {
        let mut req = hit(tenant, &format!("{i}{}", long('k', 1000)), &long('h', 256));
        if let Some(claim) = req.claim.as_mut() {
            claim.source_id = long('s', 256);
            claim.node = long('n', 256);
        }
        req
    };
    for round in 0..2 {
        let calls = (0..200).map(|i| {
            let store = store.clone();
            let tenant = format!("{round}{}{}", i % 8, long('t', 250));
            async move { store.hit(big(&tenant, i), Duration::from_secs(5)).await }
        });
        let results = futures::future::join_all(calls).await;
        assert!(
            results.iter().all(|r| r == &Ok(HitOutcome::Ok)),
            "{:?}",
            results.iter().find(|r| r != &&Ok(HitOutcome::Ok))
        );
    }
}

/// A client subscribed to the shard subject of tenant `acme` (of the `test`
/// instance's 16 shards), with the server holding the subscription.
async fn acme_shard_requests(nats: &NatsServer) -> (async_nats::Client, async_nats::Subscriber) {
    let client = async_nats::connect(nats.url()).await.expect("connects");
    let subject = Subjects::new("test")
        .expect("valid instance")
        .shard(ankusa_bus::shard_of("acme", 16));
    let requests = client.subscribe(subject).await.expect("subscribes");
    ankusa_bus::server_caught_up(&client)
        .await
        .expect("the server has the subscription");
    (client, requests)
}

/// A call tells the node the time its caller really waits: its alarm goes
/// off 2 ms early (timers fire late), and its budget on the wire ends there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_sent_ends_when_the_caller_stops_waiting() {
    let nats = NatsServer::start().await.expect("nats-server starts");
    let (_client, mut requests) = acme_shard_requests(&nats).await;
    for batching in [false, true] {
        let store = connected_edge(config(&nats.url(), batching)).await;
        let call = store.hit(hit("acme", "k", "h"), Duration::from_millis(10));
        let (result, request) = tokio::time::timeout(Duration::from_secs(30), async {
            tokio::join!(call, futures::StreamExt::next(&mut requests))
        })
        .await
        .expect("the call ends and its request arrives within 30 s");
        assert!(matches!(result, Err(StoreError::Timeout(_))), "{result:?}");
        let sent = Request::decode(&request.expect("a request").payload).expect("decodes");
        assert!(
            (1..=8).contains(&sent.timeout_ms),
            "batching {batching}: a call of 10 ms sent a budget of {} ms",
            sent.timeout_ms
        );
    }
}

/// Subscribes to every shard subject of the `test` instance and answers each
/// request `ok` after `delay`, or never (`None`), until the returned task is
/// aborted.
async fn shard_stand_in(url: &str, delay: Option<Duration>) -> tokio::task::JoinHandle<()> {
    let client = async_nats::connect(url).await.expect("connects");
    let subjects = Subjects::new("test").expect("valid instance");
    let mut all = Vec::new();
    for shard in 0..16 {
        all.push(
            client
                .subscribe(subjects.shard(shard))
                .await
                .expect("subscribes"),
        );
    }
    ankusa_bus::server_caught_up(&client)
        .await
        .expect("the server has the subscriptions");
    let mut requests = futures::stream::select_all(all);
    tokio::spawn(async move {
        while let Some(request) = futures::StreamExt::next(&mut requests).await {
            let (Some(delay), Some(reply_to)) = (delay, request.reply) else {
                continue;
            };
            let client = client.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let ok = Reply::new(ReplyBody::Hit(HitOutcome::Ok)).encode();
                let _ = client.publish(reply_to, ok.into()).await;
            });
        }
    })
}

/// A call whose reply never comes (a node that died with it, or woke from a
/// pause to a lapsed lease and stays silent) and one whose reply comes after
/// its deadline leave nothing behind in the edge: the client's count of
/// calls awaiting a reply is back at zero, batched or not, and the late
/// replies are dropped without disturbing the calls after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_without_a_reply_leave_nothing_behind() {
    let nats = NatsServer::start().await.expect("nats-server starts");
    let short = Duration::from_millis(30);
    let silent = shard_stand_in(&nats.url(), None).await;
    for batching in [false, true] {
        let store = connected_edge(config(&nats.url(), batching)).await;
        let calls = (0..40).map(|i| {
            let store = store.clone();
            async move { store.hit(hit("acme", &format!("k{i}"), "h"), short).await }
        });
        for result in futures::future::join_all(calls).await {
            assert!(
                matches!(result, Err(StoreError::Timeout(_))),
                "batching {batching}: {result:?}"
            );
        }
        // A batch's own request ends at the latest deadline of its calls,
        // a moment after its callers heard `Timeout`.
        let released = wait_until(Duration::from_secs(2), || async {
            store.awaiting_replies() == 0
        })
        .await;
        assert!(
            released.is_ok(),
            "batching {batching}: {} still awaiting",
            store.awaiting_replies()
        );
    }
    silent.abort();

    let _late = shard_stand_in(&nats.url(), Some(Duration::from_millis(100))).await;
    let store = connected_edge(config(&nats.url(), false)).await;
    for i in 0..20 {
        let result = store
            .hit(hit("acme", &format!("late{i}"), "h"), short)
            .await;
        assert!(matches!(result, Err(StoreError::Timeout(_))), "{result:?}");
    }
    assert_eq!(store.awaiting_replies(), 0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        store
            .hit(hit("acme", "after", "h"), Duration::from_secs(2))
            .await,
        Ok(HitOutcome::Ok)
    );
    assert_eq!(store.awaiting_replies(), 0);
}

/// A node stops (SIGSTOP) with every request its edge may have in flight to
/// it: a lone call and a batch of a long call and a short one. Once the
/// short call's deadline passes, the batch gives its place back: the next
/// batch, queued behind them, leaves (and, the node having crashed meanwhile,
/// finds the node that took the shards over) instead of waiting in the lane
/// behind the long call for its whole budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_to_a_stopped_node_holds_its_place_no_longer_than_its_first_deadline() {
    let (nats, mut stopped) = standalone_pair("stopped").await;
    let mut config = config(&nats.url(), true);
    // Two calls fill a batch, and two requests fill the lane: a full batch
    // leaves as soon as there is room, without waiting for a return.
    config.max_batch = 2;
    config.max_in_flight = 2;
    let store = connected_edge(config).await;
    // A lone call's reply names the node: the edge batches to it from now on.
    assert_eq!(
        store.hit(hit("acme", "learn", "h"), T).await,
        Ok(HitOutcome::Ok)
    );
    stopped.process().pause().expect("the node stops");

    // The lone call takes the idle lane, the batch of the long and the short
    // call the second place, and the next batch queues: each call is queued
    // by its first poll. The long budget is never waited for.
    let long = Duration::from_secs(60);
    let short = Duration::from_secs(3);
    let next = Duration::from_secs(15);
    let lone = {
        let store = store.clone();
        tokio::spawn(async move { store.hit(hit("acme", "lone", "h"), long).await })
    };
    let sent = wait_until(Duration::from_secs(10), || async {
        store.awaiting_replies() == 1
    })
    .await;
    assert!(sent.is_ok(), "the lone call never went out");
    let mut long_call = Box::pin(store.hit(hit("acme", "long", "h"), long));
    let mut short_call = Box::pin(store.hit(hit("acme", "short", "h"), short));
    let mut queued = Box::pin(futures::future::join(
        store.hit(hit("acme", "next-1", "h"), next),
        store.hit(hit("acme", "next-2", "h"), next),
    ));
    assert!(futures::poll!(&mut long_call).is_pending());
    assert!(futures::poll!(&mut short_call).is_pending());
    assert!(futures::poll!(&mut queued).is_pending());
    let sent = wait_until(Duration::from_secs(10), || async {
        store.awaiting_replies() == 2
    })
    .await;
    assert!(sent.is_ok(), "the batch never went out");
    // A request is counted before it is published: let the batch reach the
    // server (and the stopped node's socket) before the node goes.
    tokio::time::sleep(Duration::from_millis(200)).await;
    store.nats().flush().await.expect("flushed");

    // The stopped node crashes, and another takes its shards over.
    stopped.kill().await.expect("the node is killed");
    let taker =
        NodeProcess::start(NodeSpec::standalone("taker", vec![nats.url()])).expect("node starts");
    assert_eq!(short_call.await, Err(StoreError::Timeout(short)));
    taker
        .wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");
    let (first, second) = tokio::time::timeout(next, &mut queued)
        .await
        .expect("the queued calls end by their deadline");
    assert_eq!(
        (first, second),
        (Ok(HitOutcome::Ok), Ok(HitOutcome::Ok)),
        "the queued batch waited behind the long call"
    );
    assert!(
        !lone.is_finished(),
        "the long calls wait on, to their own deadline"
    );
    lone.abort();
    drop(long_call);
}

/// A call whose budget is too short for the edge client to send (what is
/// left of it at the client's alarm is under the protocol's millisecond) is
/// the caller's to answer, not a sign of the fleet: the degrading edge
/// answers it locally without telling its breaker, so a run of such calls
/// does not send every other call local too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_too_short_to_send_do_not_open_the_breaker() {
    let (nats, _node) = standalone_pair("short").await;
    let store = connected(&nats.url()).await;
    let edge = Edge::new(store, EdgeConfig::default());
    for n in 0..20 {
        let answer = edge
            .hit(hit("acme", &format!("k{n}"), "h"), Duration::from_millis(1))
            .await
            .expect("a local answer");
        assert_eq!(
            answer.source,
            Source::Local {
                reason: LocalReason::Timeout
            },
            "call {n}"
        );
    }
    assert_eq!(
        edge.breaker().state(),
        ankusa_bus::breaker::BreakerState::Closed
    );
    let served = edge
        .hit(hit("acme", "roomy", "h"), T)
        .await
        .expect("answer");
    assert_eq!(served.source, Source::Fleet, "the fleet still serves");
}

/// A node that will not take a batch as a batch (a release with smaller
/// limits, or one that does not read the form) refuses it whole and applies
/// nothing: the edge sends each of its calls again alone, and each is
/// answered on its own instead of every caller hearing the batch's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_refused_whole_sends_its_calls_alone() {
    let nats = NatsServer::start().await.expect("nats-server starts");
    let (client, mut requests) = acme_shard_requests(&nats).await;
    let batches = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stand_in = {
        let batches = batches.clone();
        tokio::spawn(async move {
            while let Some(request) = futures::StreamExt::next(&mut requests).await {
                let Some(reply_to) = request.reply else {
                    continue;
                };
                let reply = match Request::decode(&request.payload).map(|r| r.op) {
                    Ok(Op::Batch(_)) => {
                        batches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        Reply::error(ankusa_bus::protocol::ErrorReply::new(
                            ErrorCode::Malformed,
                            "no batches here",
                        ))
                    }
                    _ => Reply::new(ReplyBody::Hit(HitOutcome::Ok)),
                };
                let _ = client.publish(reply_to, reply.encode().into()).await;
            }
        })
    };
    let store = connected_edge(config(&nats.url(), true)).await;
    let calls = (0..16).map(|n| store.hit(hit("acme", &format!("k{n}"), "h"), T));
    let answers = futures::future::join_all(calls).await;
    assert!(
        batches.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "no batch was sent: the test tests nothing"
    );
    assert!(
        answers.iter().all(|a| *a == Ok(HitOutcome::Ok)),
        "{answers:?}"
    );
    stand_in.abort();
}
