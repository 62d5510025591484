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
use futures::StreamExt;

/// Requests sent before the stop: enough that the responder, in a debug
/// build on two cores, is still working through them when it is stopped.
const REQUESTS: usize = 20_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_responder_answers_every_request_already_delivered() {
    let nats = NatsServer::start().await.expect("nats-server starts");
    let node = async_nats::connect(nats.url()).await.expect("connect");
    let subject = "ankusa.test.shard.0".to_string();
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

    let edge = async_nats::connect(nats.url()).await.expect("connect");
    let mut answers = edge.subscribe("answers.>").await.expect("subscribe");
    edge.flush().await.expect("flush");
    for i in 0..REQUESTS {
        let op = Op::Hit(hit(&format!("t{}", i % 64), &format!("k{i}"), "h"));
        edge.publish_with_reply(
            subject.clone(),
            format!("answers.{i}"),
            Request::encode_op(30_000, &op).into(),
        )
        .await
        .expect("publish");
    }
    edge.flush().await.expect("flush");
    // The node's connection has read them all by now (its subscription holds
    // up to 65,536), while its responder is still answering.
    node.flush().await.expect("flush");
    tokio::time::sleep(Duration::from_millis(100)).await;

    let mut answered = HashSet::new();
    while let Ok(Some(message)) =
        tokio::time::timeout(Duration::from_millis(1), answers.next()).await
    {
        take(&mut answered, message);
    }
    let before_stop = answered.len();
    assert!(
        before_stop < REQUESTS,
        "the responder had answered everything before its stop: nothing was tested"
    );

    responder.stop(Duration::from_secs(30)).await;
    while let Ok(Some(message)) =
        tokio::time::timeout(Duration::from_millis(500), answers.next()).await
    {
        take(&mut answered, message);
    }
    assert_eq!(
        answered.len(),
        REQUESTS,
        "requests delivered before the stop were left unanswered ({before_stop} answered before it)"
    );
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
