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

const REQUESTS: usize = 20_000;

/// Messages a subscription of these clients holds: more than the test sends,
/// so that none is dropped as a slow consumer's.
const CAPACITY: usize = 1 << 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_responder_answers_every_request_already_delivered() {
    let nats = NatsServer::start().await.expect("nats-server starts");
    let connect = || {
        async_nats::ConnectOptions::new()
            .subscription_capacity(CAPACITY)
            .connect(nats.url())
    };
    let node = connect().await.expect("connect");
    let node_connection = node.clone();
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

    // The responder's loop runs on a runtime of its own, on a thread the test
    // holds, so that every request is delivered (read by the node's
    // connection, on this runtime) while none is read by the responder: its
    // stop then finds them all waiting, whatever the host's speed.
    let (started, responder) = tokio::sync::oneshot::channel();
    let (release, held) = std::sync::mpsc::channel::<()>();
    let (hold, holding) = tokio::sync::oneshot::channel::<()>();
    let (done, finished) = tokio::sync::oneshot::channel::<()>();
    let side = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let responder = ShardResponder::start(node, ctx)
                .await
                .expect("responder starts");
            let _ = started.send(responder);
            let _ = holding.await;
            // Blocks this runtime's one thread, its responder's loop with it.
            let _ = held.recv();
            // Runs the loop until the stop has drained it.
            let _ = finished.await;
        });
    });
    let responder = responder.await.expect("the responder started");
    let _ = hold.send(());

    let edge = connect().await.expect("connect");
    let mut answers = edge.subscribe("answers.>").await.expect("subscribe");
    edge.flush().await.expect("flush");
    let mut marks = node_connection.subscribe("mark").await.expect("subscribe");
    node_connection.flush().await.expect("flush");
    for i in 0..REQUESTS {
        let op = Op::Hit(hit(&format!("t{}", i % 64), &format!("k{i}"), "h"));
        edge.publish_with_reply(
            subject.clone(),
            format!("answers.{i}"),
            Request::encode_op(60_000, &op).into(),
        )
        .await
        .expect("publish");
    }
    // A mark sent after the requests reaches the node's connection after
    // them (the server keeps one sender's order), so once it has come, that
    // connection has read every request into the responder's subscription.
    // (A flush only writes out a client's own buffer; it waits for no reply.)
    edge.publish("mark", "".into()).await.expect("publish");
    edge.flush().await.expect("flush");
    tokio::time::timeout(Duration::from_secs(30), marks.next())
        .await
        .expect("the mark comes")
        .expect("the mark's subscription");

    // The stop's first poll tells the responder's loop to stop; it then
    // waits for that loop, which cannot run while its thread is held. Only
    // then is the loop let go: it first learns of the stop with every
    // request still waiting in its subscription, so the drain is what
    // answers them.
    let stopping = responder.stop(Duration::from_secs(30));
    tokio::pin!(stopping);
    assert!(
        futures::poll!(&mut stopping).is_pending(),
        "the stop ended while the responder's loop was held"
    );
    let _ = release.send(());
    tokio::time::timeout(Duration::from_secs(60), &mut stopping)
        .await
        .expect("the stop ends");
    let _ = done.send(());
    side.join().expect("the responder's thread ends");

    // Every answer, or as many as come within 30 s.
    let mut answered = HashSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while answered.len() < REQUESTS {
        match tokio::time::timeout_at(deadline, answers.next()).await {
            Ok(Some(message)) => take(&mut answered, message),
            Ok(None) | Err(_) => break,
        }
    }
    assert_eq!(
        answered.len(),
        REQUESTS,
        "requests delivered before the stop were left unanswered"
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
