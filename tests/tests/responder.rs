//! A shard's responder in this process, against a real nats-server: what its
//! stop does with the requests NATS had already delivered to it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use ankusa_actors::actor::{spawn_shard, ShardConfig};
use ankusa_actors::SystemClock;
use ankusa_bus::persist::Persistence;
use ankusa_bus::protocol::{Op, Reply, ReplyBody, Request};
use ankusa_bus::responder::{ShardContext, ShardResponder};
use ankusa_tests::requests::hit;
use ankusa_tests::NatsServer;
use futures::{FutureExt, StreamExt};

/// Messages a subscription of these clients holds: more than any attempt
/// sends, so that none is dropped as a slow consumer's.
const CAPACITY: usize = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_responder_answers_every_request_already_delivered() {
    let nats = NatsServer::start().await.expect("nats-server starts");
    // The stop must find many requests still waiting to be read (fewer than
    // half answered, whatever is still on its way back); a responder that
    // kept up with the sender tests nothing, so the burst grows until one
    // outruns it.
    for (attempt, requests) in [20_000, 60_000, 180_000].into_iter().enumerate() {
        let (before_stop, answered) = stop_amid_a_burst(&nats, attempt, requests).await;
        if before_stop < requests / 2 {
            assert_eq!(
                answered, requests,
                "requests delivered before the stop were left unanswered \
                 ({before_stop} of {requests} answered before it)"
            );
            return;
        }
    }
    panic!("the responder answered every burst before its stop: nothing was tested");
}

/// Sends `requests` hits to a new responder, stops it once NATS has delivered
/// them all, and returns how many were answered before the stop and in all.
async fn stop_amid_a_burst(nats: &NatsServer, attempt: usize, requests: usize) -> (usize, usize) {
    let connect = || {
        async_nats::ConnectOptions::new()
            .subscription_capacity(CAPACITY)
            .connect(nats.url())
    };
    let node = connect().await.expect("connect");
    let subject = format!("ankusa.attempt{attempt}.shard.0");
    let actors = spawn_shard(ShardConfig::new(Arc::new(SystemClock)), Vec::new(), None)
        .await
        .expect("shard actor");
    let ctx = ShardContext {
        shard: 0,
        shards: 1,
        subject: subject.clone(),
        actors,
        persistence: Persistence::Memory,
        window: None,
        routing: None,
    };
    let responder = ShardResponder::start(node.clone(), ctx)
        .await
        .expect("responder starts");

    let edge = connect().await.expect("connect");
    let mut answers = edge.subscribe("answers.>").await.expect("subscribe");
    edge.flush().await.expect("flush");
    for i in 0..requests {
        let op = Op::Hit(hit(&format!("t{}", i % 64), &format!("k{i}"), "h"));
        edge.publish_with_reply(
            subject.clone(),
            format!("answers.{i}"),
            Request::encode_op(60_000, &op).into(),
        )
        .await
        .expect("publish");
    }
    // The server has routed every request once the edge's flush returns, and
    // the node's connection has read every one into its subscription once
    // its own flush returns (the server answers a flush after what it sent
    // before it).
    edge.flush().await.expect("flush");
    node.flush().await.expect("flush");

    // Every answer the edge has by now (unconstrained: tokio's budget would
    // end the loop after 128 ready messages).
    let mut answered = HashSet::new();
    tokio::task::unconstrained(async {
        while let Some(Some(message)) = answers.next().now_or_never() {
            take(&mut answered, message);
        }
    })
    .await;
    let before_stop = answered.len();
    responder.stop(Duration::from_secs(60)).await;
    while let Ok(Some(message)) =
        tokio::time::timeout(Duration::from_millis(500), answers.next()).await
    {
        take(&mut answered, message);
    }
    (before_stop, answered.len())
}

/// Notes the request a reply answers, which must be a hit's outcome.
fn take(answered: &mut HashSet<String>, message: async_nats::Message) {
    let reply = Reply::decode(&message.payload).expect("a readable reply");
    assert!(
        matches!(reply.body, ReplyBody::Hit(_)),
        "{:?} for {}",
        reply.body,
        message.subject
    );
    answered.insert(message.subject.to_string());
}
