//! Fleet mode with real processes: a JetStream nats-server and several
//! `ankusa-node`s sharing 16 shards through KV leases.
//!
//! Balance (joins move only the shards rendezvous hashing assigns to the new
//! node, leaves hand theirs over), durability of claims across kill -9 and a
//! nats-server restart, fencing of a paused (zombie) node, the claim log
//! format a fleet writes beside a node of an earlier release, membership
//! read from one watch of the heartbeats (not a consumer made every round),
//! the lease operations themselves (by revision; nothing kept for a write
//! never acknowledged), and a fleet on the IPv6 loopback.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use ankusa_actors::{
    BucketRecord, Changes, ClaimChange, ClaimRecord, ClaimView, EventKey, HitOutcome, HitRequest,
    InspectRequest, Kind, SettleOutcome, Settlement,
};
use ankusa_bus::kv::{within, FleetKv, Heartbeat, KvWriter, LeaseError};
use ankusa_bus::protocol::{ErrorCode, Op, Reply, ReplyBody, Request};
use ankusa_bus::responder::ServeWindow;
use ankusa_bus::{
    server_caught_up, shard_of, FleetConfig, FleetStore, NatsOptions, Store, StoreError, Subjects,
};
use ankusa_node::fleet::target_owner;
use ankusa_tests::requests::{hit, hooks, round_trip, settle};
use ankusa_tests::{
    connected_edge, wait_until, NatsCluster, NatsServer, NetCut, NodeProcess, NodeSpec,
    ServerConfig, Signal,
};
use futures::StreamExt;

const SHARDS: u32 = 16;
const T: Duration = Duration::from_millis(1000);

fn node(id: &str, nats: &NatsServer) -> NodeProcess {
    NodeProcess::start(NodeSpec::fleet(id, vec![nats.url()])).expect("node starts")
}

async fn edge(nats: &NatsServer) -> FleetStore {
    edge_with(nats, |_| {}).await
}

async fn edge_with(nats: &NatsServer, tweak: impl FnOnce(&mut FleetConfig)) -> FleetStore {
    let mut config = FleetConfig::new(NatsOptions::with_servers([nats.url()]), "test");
    config.shards = SHARDS;
    tweak(&mut config);
    connected_edge(config).await
}

async fn kv(nats: &NatsServer) -> FleetKv {
    let client = nats.connect().await.expect("connect");
    FleetKv::open(client, "test", 1).await.expect("kv buckets")
}

fn targets(nodes: &[&str]) -> HashMap<u32, String> {
    let live: BTreeSet<String> = nodes.iter().map(|n| n.to_string()).collect();
    (0..SHARDS)
        .map(|s| (s, target_owner(&live, s).expect("an owner").to_string()))
        .collect()
}

/// Waits until every shard is leased by its rendezvous target among `nodes`.
async fn wait_balanced(kv: &FleetKv, nodes: &[&str], within: Duration) -> HashMap<u32, String> {
    let want = targets(nodes);
    let deadline = Instant::now() + within;
    loop {
        let holders = kv.lease_holders().await.unwrap_or_default();
        if holders == want {
            return want;
        }
        assert!(
            Instant::now() < deadline,
            "not balanced over {nodes:?} within {within:?}: holders {holders:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Repeats `call` until it returns `Ok`, for at most `within`; the last result.
async fn retry_until_ok<T, E, F, Fut>(within: Duration, mut call: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let deadline = Instant::now() + within;
    loop {
        let result = call().await;
        if result.is_ok() || Instant::now() >= deadline {
            return result;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A tenant name that lands on `shard`.
fn tenant_on(shard: u32) -> String {
    (0..)
        .map(|i| format!("tenant-{i}"))
        .find(|t| shard_of(t, SHARDS) == shard)
        .expect("some tenant hashes to every shard")
}

/// Deletes a bucket's stream from under the fleet: the server then answers
/// its writes "no responders" at once, as it does for a stream that lost its
/// leader with its quorum.
async fn delete_stream(nats: &NatsServer, stream: &str) {
    let js = async_nats::jetstream::new(nats.connect().await.expect("connect"));
    js.delete_stream(stream)
        .await
        .unwrap_or_else(|e| panic!("deleting {stream}: {e}"));
}

/// The lease operations the fleet relies on, on `FleetKv` alone: a lease is
/// taken only where none is held, renewed and released only with its
/// current revision (a stale one is a lease lost), and taken again over the
/// marker a release leaves.
/// A nats-server that listens on `::1` only: a node and an edge reach it as
/// `nats://[::1]:<port>`, the node takes every shard, and a hook's round
/// (ok, commit, duplicate) works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_on_the_ipv6_loopback_serves() {
    let nats = NatsServer::start_with(ServerConfig::new().ipv6())
        .await
        .expect("nats-server on ::1");
    assert!(nats.url().starts_with("nats://[::1]:"), "{}", nats.url());
    let node = node("v6", &nats);
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("a node on the IPv6 loopback gets ready");
    round_trip(&edge(&nats).await, "acme", "v6-1", T).await;
    let kv = kv(&nats).await;
    assert_eq!(
        kv.lease_holders().await.expect("holders").len(),
        SHARDS as usize
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_are_taken_renewed_and_released_by_revision() {
    let nats = NatsServer::start().await.expect("nats");
    let kv = kv(&nats).await;
    let ttl = Duration::from_secs(5);
    let first = kv
        .acquire_lease(3, "n1", ttl)
        .await
        .expect("a free lease is taken");
    match kv.acquire_lease(3, "n2", ttl).await {
        Err(LeaseError::Taken {
            shard: 3,
            holder,
            lapses_in,
        }) => {
            assert_eq!(holder, "n1");
            // Written just now, with a 5 s TTL (the server's clock and this
            // host's are one here).
            let lapses_in = lapses_in.expect("known from the holder's write");
            assert!(
                lapses_in <= ttl && lapses_in > ttl - Duration::from_secs(2),
                "{lapses_in:?}"
            );
        }
        other => panic!("a held lease was taken again: {other:?}"),
    }
    let renewed = kv.renew_lease(3, "n1", first, ttl).await.expect("renewed");
    assert!(renewed > first, "revision {renewed} after {first}");
    assert_eq!(
        kv.release_lease(3, "n2", first).await,
        Err(LeaseError::Lost { shard: 3 }),
        "a release of another node's lease"
    );
    assert_eq!(kv.lease_holders().await.expect("holders")[&3], "n1");
    kv.release_lease(3, "n1", renewed).await.expect("released");
    assert!(!kv.lease_holders().await.expect("holders").contains_key(&3));
    assert_eq!(
        kv.renew_lease(3, "n1", renewed, ttl).await,
        Err(LeaseError::Lost { shard: 3 }),
        "a renewal of a released lease"
    );
    let taken = kv
        .acquire_lease(3, "n2", ttl)
        .await
        .expect("taken over the release's marker");
    assert_eq!(kv.lease_holders().await.expect("holders")[&3], "n2");
    assert_eq!(
        kv.renew_lease(3, "n1", renewed, ttl).await,
        Err(LeaseError::Lost { shard: 3 }),
        "a renewal of a lease another node took"
    );
    assert_eq!(kv.lease_holders().await.expect("holders")[&3], "n2");
    kv.renew_lease(3, "n2", taken, ttl)
        .await
        .expect("the new holder renews");
    assert_eq!(kv.awaiting_acks(), 0);
}

/// A lease whose last write was this process's own, though its ack was never
/// read (the write waited in a paused server and landed after the node had let
/// the shard go, or the connection dropped before the ack came), is taken over
/// at once by the same `FleetKv` and node id, whether it takes the shard again
/// or renews it; a namesake (another process under the same node id: a
/// restart, a zombie) and another node id wait, as for any lease held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_process_that_wrote_a_lease_takes_it_over() {
    let nats = NatsServer::start().await.expect("nats");
    let ours = kv(&nats).await;
    let namesake = kv(&nats).await;
    let ttl = Duration::from_secs(5);
    let written = ours.acquire_lease(5, "n1", ttl).await.expect("taken");
    // As if `written`'s ack had been lost: the node takes the shard again.
    let adopted = ours
        .acquire_lease(5, "n1", ttl)
        .await
        .expect("our own lease is taken over");
    assert!(adopted > written, "revision {adopted} after {written}");
    // As if `adopted`'s ack had been lost too: the next renewal is sent with
    // the revision before it, and takes the lease over at its own write.
    let renewed = ours
        .renew_lease(5, "n1", written, ttl)
        .await
        .expect("a renewal behind our own write takes it over");
    assert!(renewed > adopted, "revision {renewed} after {adopted}");
    assert_eq!(
        namesake.renew_lease(5, "n1", written, ttl).await,
        Err(LeaseError::Lost { shard: 5 }),
        "another process under the same node id, renewing behind our write"
    );
    match namesake.acquire_lease(5, "n1", ttl).await {
        Err(LeaseError::Taken {
            shard: 5, holder, ..
        }) => assert_eq!(holder, "n1"),
        other => panic!("another process under the same node id: {other:?}"),
    }
    match ours.acquire_lease(5, "n2", ttl).await {
        Err(LeaseError::Taken {
            shard: 5, holder, ..
        }) => assert_eq!(holder, "n1"),
        other => panic!("another node id through the same FleetKv: {other:?}"),
    }
    let renewed_again = ours
        .renew_lease(5, "n1", renewed, ttl)
        .await
        .expect("the taken-over lease renews");
    // As if that renewal's ack had been lost: the release, sent with the
    // revision before it, releases our own write; a namesake's does not.
    assert_eq!(
        namesake.release_lease(5, "n1", renewed).await,
        Err(LeaseError::Lost { shard: 5 }),
        "another process under the same node id, releasing behind our write"
    );
    assert_eq!(ours.lease_holders().await.expect("holders")[&5], "n1");
    ours.release_lease(5, "n1", renewed)
        .await
        .expect("a release behind our own write releases it");
    assert!(!ours
        .lease_holders()
        .await
        .expect("holders")
        .contains_key(&5));
    assert!(renewed_again > renewed);
}

/// A lease or heartbeat write whose ack never comes (JetStream without
/// quorum, a server restarting) leaves nothing behind in the node: each
/// waits in the node's own inbox and leaves it when its caller gives up.
/// A node renews every lease it holds each second, so a slot kept per
/// unanswered write (`async_nats`'s request) grew for as long as JetStream
/// could not answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_writes_never_acknowledged_leave_nothing_behind() {
    let nats = NatsServer::start().await.expect("nats");
    let kv = kv(&nats).await;
    delete_stream(&nats, "KV_ankusa_test_leases").await;
    // Without a stream, the server says at once that nobody takes the write.
    let started = Instant::now();
    let refused = kv.renew_lease(1, "n1", 1, Duration::from_secs(5)).await;
    assert!(
        matches!(&refused, Err(LeaseError::Kv(_))),
        "{refused:?} for a write no stream takes"
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    // A silent subscriber in the stream's place: the writes go out, no ack comes.
    let silent = nats.connect().await.expect("connect");
    let _stand_in = silent
        .subscribe("$KV.ankusa_test_leases.>")
        .await
        .expect("subscribes");
    // Long enough for every write to be on the wire, however busy the host.
    let bound = Duration::from_secs(3);
    tokio::time::timeout(bound, server_caught_up(&silent))
        .await
        .expect("in time")
        .expect("the server has the stand-in's subscription");
    let writes = (0..40u32).map(|shard| {
        let kv = kv.clone();
        tokio::spawn(async move {
            within(
                bound,
                kv.renew_lease(shard, "n1", 1, Duration::from_secs(5)),
            )
            .await
        })
    });
    let writes: Vec<_> = writes.collect();
    let all_out = wait_until(bound / 2, || async { kv.awaiting_acks() == 40 }).await;
    let seen_out = kv.awaiting_acks();
    let mut results = Vec::new();
    for write in writes {
        results.push(write.await.expect("the write's task"));
    }
    assert!(
        all_out.is_ok(),
        "the writes wait in the node's inbox: {seen_out} of 40, then {results:?}"
    );
    for result in &results {
        assert!(matches!(result, Err(LeaseError::Kv(_))), "{result:?}");
    }
    assert_eq!(
        kv.awaiting_acks(),
        0,
        "still awaiting after their callers gave up"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joins_and_leaves_move_only_the_expected_shards() {
    let nats = NatsServer::start().await.expect("nats");
    let kv = kv(&nats).await;
    let a = node("node-a", &nats);
    let b = node("node-b", &nats);
    let before = wait_balanced(&kv, &["node-a", "node-b"], Duration::from_secs(20)).await;

    let mut c = node("node-c", &nats);
    let started = Instant::now();
    let after = wait_balanced(
        &kv,
        &["node-a", "node-b", "node-c"],
        Duration::from_secs(20),
    )
    .await;
    let moved: Vec<u32> = (0..SHARDS).filter(|s| before[s] != after[s]).collect();
    assert!(
        moved.iter().all(|s| after[s] == "node-c"),
        "only moves to the new node: {moved:?}"
    );
    assert!(!moved.is_empty(), "the new node took nothing");
    println!(
        "join: {} of {SHARDS} shards moved to node-c in {:?}",
        moved.len(),
        started.elapsed()
    );

    // Every shard answers after the join.
    let store = edge(&nats).await;
    for shard in 0..SHARDS {
        let tenant = tenant_on(shard);
        assert_eq!(
            store.hit(hit(&tenant, "after-join", "h"), T).await,
            Ok(HitOutcome::Ok),
            "shard {shard}"
        );
    }

    // A graceful leave hands node-c's shards back to their old owners.
    let started = Instant::now();
    c.stop().await.expect("SIGTERM exits");
    let back = wait_balanced(&kv, &["node-a", "node-b"], Duration::from_secs(10)).await;
    assert_eq!(back, before);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "graceful handoff took {:?}",
        started.elapsed()
    );
    println!(
        "leave: shards back on node-a/node-b in {:?}",
        started.elapsed()
    );
    drop((a, b));
}

/// The claim `inspect` shows on each of `keys` of `tenant`, as "state hook".
async fn claims_shown(store: &FleetStore, tenant: &str, keys: &[&str]) -> Vec<Option<String>> {
    let mut shown = Vec::new();
    for key in keys {
        let req = InspectRequest {
            tenant: tenant.into(),
            claim: Some(EventKey {
                source_id: "src".into(),
                key: (*key).into(),
            }),
        };
        let view = store.inspect(req, T).await.expect("inspect answered");
        shown.push(view.claim.map(|claim| match claim {
            ClaimView::Pending { hook_id, .. } => format!("pending {hook_id}"),
            ClaimView::Committed { hook_id, .. } => format!("committed {hook_id}"),
        }));
    }
    shown
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_survive_kill_9_of_their_owner() {
    let nats = NatsServer::start().await.expect("nats");
    let kv = kv(&nats).await;
    let mut nodes = [
        node("node-a", &nats),
        node("node-b", &nats),
        node("node-c", &nats),
    ];
    let owners = wait_balanced(
        &kv,
        &["node-a", "node-b", "node-c"],
        Duration::from_secs(20),
    )
    .await;
    let store = edge(&nats).await;

    // Three claims on one shard: committed, pending, released.
    let shard = 3;
    let tenant = tenant_on(shard);
    let victim = owners[&shard].clone();
    assert_eq!(
        store.hit(hit(&tenant, "committed", "h1"), T).await,
        Ok(HitOutcome::Ok)
    );
    assert_eq!(
        store
            .settle(settle(&tenant, "committed", "h1", Settlement::Commit), T)
            .await,
        Ok(SettleOutcome::Ok)
    );
    assert_eq!(
        store.hit(hit(&tenant, "pending", "h2"), T).await,
        Ok(HitOutcome::Ok)
    );
    assert_eq!(
        store.hit(hit(&tenant, "released", "h3"), T).await,
        Ok(HitOutcome::Ok)
    );
    assert_eq!(
        store
            .settle(settle(&tenant, "released", "h3", Settlement::Release), T)
            .await,
        Ok(SettleOutcome::Ok)
    );
    let keys = ["committed", "pending", "released"];
    let before = claims_shown(&store, &tenant, &keys).await;
    assert_eq!(
        before,
        [
            Some("committed h1".to_string()),
            Some("pending h2".to_string()),
            None
        ]
    );

    let index = nodes
        .iter()
        .position(|n| n.spec.node_id == victim)
        .expect("victim runs");
    let killed_at = Instant::now();
    nodes[index].kill().await.expect("kill -9");

    // The shard serves again within lease TTL + 1 s, from another node.
    let lease_ttl = Duration::from_millis(nodes[0].spec.lease_ttl_ms);
    let first = retry_until_ok(lease_ttl + Duration::from_secs(6), || {
        store.hit(hit(&tenant, "committed", "h9"), Duration::from_millis(200))
    })
    .await;
    let recovered = killed_at.elapsed();
    assert!(first.is_ok(), "shard {shard} never served again: {first:?}");
    assert!(
        recovered <= lease_ttl + Duration::from_millis(1500),
        "shard {shard} took {recovered:?} to serve again (lease TTL {lease_ttl:?})"
    );
    println!("kill -9 of {victim}: shard {shard} served again after {recovered:?}");

    assert_eq!(
        first,
        Ok(HitOutcome::Duplicate {
            hook_id: "h1".into()
        })
    );
    // The new owner shows what the old one did: its state came from KV.
    assert_eq!(claims_shown(&store, &tenant, &keys).await, before);
    match store.hit(hit(&tenant, "pending", "h8"), T).await {
        Ok(HitOutcome::Pending { retry_after_ms }) => assert!(retry_after_ms >= 1),
        other => panic!("pending claim after failover: {other:?}"),
    }
    assert_eq!(
        store.hit(hit(&tenant, "released", "h7"), T).await,
        Ok(HitOutcome::Ok)
    );
    // The pending claim's owner can still commit it on the new owner.
    assert_eq!(
        store
            .settle(settle(&tenant, "pending", "h2", Settlement::Commit), T)
            .await,
        Ok(SettleOutcome::Ok)
    );
}

/// A reset is answered once it is stored (docs/protocol.md §7.3), not when the
/// write-behind gets to it: a kill -9 of the owner right after the answer does
/// not bring the forgotten bucket back on the next owner (it did, in each run,
/// while resets were written behind).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_answered_survives_kill_9_of_its_owner() {
    let nats = NatsServer::start().await.expect("nats");
    let kv = kv(&nats).await;
    let spec = |id: &str| NodeSpec {
        extra_args: vec!["--write-behind-ms".into(), "1000".into()],
        ..NodeSpec::fleet(id, vec![nats.url()])
    };
    let mut nodes =
        [spec("node-a"), spec("node-b")].map(|spec| NodeProcess::start(spec).expect("node starts"));
    let owners = wait_balanced(&kv, &["node-a", "node-b"], Duration::from_secs(20)).await;
    let store = edge(&nats).await;

    let shard = 5;
    let tenant = tenant_on(shard);
    // One hook an hour: the first hit takes the whole bucket.
    let hourly = || HitRequest {
        charges: vec![hooks(&tenant, 1, 3_600_000)],
        claim: None,
    };
    assert_eq!(store.hit(hourly(), T).await, Ok(HitOutcome::Ok));
    assert!(
        matches!(
            store.hit(hourly(), T).await,
            Ok(HitOutcome::RateLimited { .. })
        ),
        "the bucket is empty after one hook"
    );
    // Past a write-behind flush, so the empty bucket is stored.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(store.reset(tenant.clone(), T).await, Ok(()));
    let owner = &owners[&shard];
    let index = nodes
        .iter()
        .position(|n| &n.spec.node_id == owner)
        .expect("the owner runs");
    nodes[index].kill().await.expect("kill -9");

    let after = retry_until_ok(Duration::from_secs(10), || {
        store.hit(hourly(), Duration::from_millis(300))
    })
    .await;
    assert_eq!(
        after,
        Ok(HitOutcome::Ok),
        "the next owner of shard {shard} does not have the reset {owner} answered"
    );
}

/// A load is current as of when it began even when the meta leader puts its
/// consumer on a replica of the state stream that lags the leader: the next
/// owner of a shard reads every claim the last one had acknowledged. Here a
/// replica (neither the stream's leader nor the meta leader) is paused while
/// a claim is written through the other two, and resumed once the load has
/// asked for its consumer; about a third of the consumers land on it.
///
/// On this host the resumed replica has always caught up before it made the
/// consumer, so the loads here saw every claim without the leader's check
/// too (`FleetKv::leader_holds_past`, whose answers the next test checks):
/// this test holds the check to ending loads on a replica that was behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_reads_every_acknowledged_write_when_its_consumer_is_on_a_lagging_replica() {
    const ROUNDS: usize = 12;
    let mut cluster = NatsCluster::start(3).await.expect("cluster");
    let setup = FleetKv::open(cluster.connect().await.expect("connect"), "test", 3)
        .await
        .expect("R3 buckets");
    let js = async_nats::jetstream::new(cluster.connect().await.expect("connect"));
    let mut stream = js
        .get_stream("KV_ankusa_test_state")
        .await
        .expect("state stream");
    let leader = stream
        .info()
        .await
        .expect("stream info")
        .cluster
        .as_ref()
        .and_then(|c| c.leader.clone())
        .expect("a stream leader");
    let meta = cluster.meta_leader().await.expect("meta leader");
    let lagging = (0..cluster.len())
        .find(|&i| {
            let name = cluster.member(i).name();
            name != leader && name != meta
        })
        .expect("three members, at most two of them leaders");
    let others: Vec<String> = (0..cluster.len())
        .filter(|&i| i != lagging)
        .map(|i| cluster.member(i).url())
        .collect();
    let connect = || async {
        let client = async_nats::ConnectOptions::new()
            .connect(others.clone())
            .await
            .expect("connect to the members that run");
        FleetKv::open(client, "test", 3).await.expect("buckets")
    };
    let writer = KvWriter::start(connect().await, Duration::from_secs(3600));
    let loader = connect().await;
    drop(setup);
    let shard = 5;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let expires_us = now.expect("after 1970").as_micros() as u64 + 3_600_000_000;
    let mut missed = Vec::new();
    for round in 0..ROUNDS {
        let tenant = format!("t{round}");
        let claimed = Changes {
            claim: Some(ClaimChange::Put(ClaimRecord::new(
                "src", "key", "hook", None, true, expires_us,
            ))),
            buckets: Default::default(),
        };
        cluster.pause(lagging).expect("pause a replica");
        let written = writer.record([(shard, tenant.as_str(), &claimed)]).await;
        let load = tokio::spawn({
            let loader = loader.clone();
            async move { loader.load_shard(shard).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        cluster.resume(lagging).expect("resume it");
        written.expect("the claim acknowledged by two of three");
        let loaded = tokio::time::timeout(Duration::from_secs(30), load)
            .await
            .expect("the load ends")
            .expect("the load task")
            .expect("the load");
        if !loaded.iter().any(|t| t.tenant == tenant) {
            missed.push(round);
        }
    }
    assert!(
        missed.is_empty(),
        "loads that missed an acknowledged claim, of {ROUNDS}: rounds {missed:?}"
    );
}

/// What a load asks the state stream's leader once its consumer has nothing
/// left: whether a message lies past what it read, up to where the stream
/// ended when it began. Gaps (messages rolled up or expired) do not count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_says_whether_a_load_has_read_to_where_the_stream_ended() {
    let nats = NatsServer::start().await.expect("nats");
    let kv = kv(&nats).await;
    let writer = KvWriter::start(kv.clone(), Duration::from_secs(3600));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let expires_us = now.expect("after 1970").as_micros() as u64 + 3_600_000_000;
    let claimed = Changes {
        claim: Some(ClaimChange::Put(ClaimRecord::new(
            "src", "key", "hook", None, true, expires_us,
        ))),
        buckets: Default::default(),
    };
    let js = async_nats::jetstream::new(nats.connect().await.expect("connect"));
    let last = || async {
        js.get_stream("KV_ankusa_test_state")
            .await
            .expect("state stream")
            .cached_info()
            .state
            .last_sequence
    };
    assert!(
        !kv.leader_holds_past(0, last().await).await.expect("asked"),
        "an empty stream"
    );
    writer.record([(1, "a", &claimed)]).await.expect("written");
    let first = last().await;
    writer.record([(1, "b", &claimed)]).await.expect("written");
    let second = last().await;
    assert!(second > first);
    assert!(kv.leader_holds_past(0, second).await.expect("asked"));
    assert!(kv.leader_holds_past(first, second).await.expect("asked"));
    assert!(!kv.leader_holds_past(second, second).await.expect("asked"));
    assert!(
        !kv.leader_holds_past(second, second + 100)
            .await
            .expect("asked"),
        "nothing was written past the second"
    );
    // A message gone from the stream (its key purged) is no message to read.
    let stream = js
        .get_stream("KV_ankusa_test_state")
        .await
        .expect("state stream");
    let subject = stream
        .get_raw_message(first)
        .await
        .expect("the first")
        .subject;
    stream
        .purge()
        .filter(subject.as_str())
        .await
        .expect("purged");
    assert!(!kv.leader_holds_past(first - 1, first).await.expect("asked"));
    assert!(kv
        .leader_holds_past(first - 1, second)
        .await
        .expect("asked"));
}

/// A node writes no bucket of a shard it stopped serving: another node may
/// serve it now, and the last record of a bucket wins on a load, so a late
/// write of the old owner's TAT (a flush retried after its lease lapsed)
/// would undo the new owner's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_drops_the_buckets_of_the_shards_it_stopped_serving() {
    let nats = NatsServer::start().await.expect("nats");
    let kv = kv(&nats).await;
    // No flush of its own: the test flushes.
    let writer = KvWriter::start(kv.clone(), Duration::from_secs(3600));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let tat_us = now.expect("after 1970").as_micros() as u64 + 3_600_000_000;
    let charged = Changes {
        claim: None,
        buckets: [BucketRecord {
            kind: Kind::Hooks,
            tat_us,
        }]
        .into_iter()
        .collect(),
    };
    let stored = |shard: u32| {
        let kv = kv.clone();
        async move {
            let tenants = kv.load_shard(shard).await.expect("load");
            tenants
                .iter()
                .map(|t| (t.tenant.clone(), t.buckets.clone()))
                .collect::<Vec<_>>()
        }
    };
    let hooks_at = |tenant: &str| {
        vec![(
            tenant.to_string(),
            vec![BucketRecord {
                kind: Kind::Hooks,
                tat_us,
            }],
        )]
    };

    writer
        .record([(3, "kept", &charged), (4, "dropped", &charged)])
        .await
        .expect("recorded");
    writer.stop_writing(&[4]);
    assert_eq!(
        writer.flush_buckets(None).await,
        0,
        "every write acknowledged"
    );
    assert_eq!(stored(3).await, hooks_at("kept"));
    assert_eq!(stored(4).await, vec![], "a stopped shard's TAT was written");

    // Written again once the node takes the shard back.
    let window = ServeWindow::closed();
    window.extend_to(Instant::now() + Duration::from_secs(3600));
    writer.start_writing(4, window);
    writer
        .record([(4, "taken-back", &charged)])
        .await
        .expect("recorded");
    assert_eq!(writer.flush_buckets(Some(4)).await, 0);
    assert_eq!(stored(4).await, hooks_at("taken-back"));

    // A shard whose serve window has closed (the node was paused past its
    // lease) keeps its TATs until a renewal reopens the window: another node
    // may own the shard by then.
    let window = ServeWindow::closed();
    writer.start_writing(5, window.clone());
    writer
        .record([(5, "paused", &charged)])
        .await
        .expect("recorded");
    assert_eq!(writer.flush_buckets(None).await, 0);
    assert_eq!(stored(5).await, vec![], "written outside the serve window");
    window.extend_to(Instant::now() + Duration::from_secs(60));
    assert_eq!(writer.flush_buckets(None).await, 0);
    assert_eq!(stored(5).await, hooks_at("paused"));
    // Or the renewal finds the lease lost: the TATs are dropped.
    let window = ServeWindow::closed();
    writer.start_writing(6, window.clone());
    writer
        .record([(6, "lapsed", &charged)])
        .await
        .expect("recorded");
    assert_eq!(writer.flush_buckets(None).await, 0);
    writer.stop_writing(&[6]);
    window.extend_to(Instant::now() + Duration::from_secs(60));
    assert_eq!(writer.flush_buckets(None).await, 0);
    assert_eq!(stored(6).await, vec![], "a lapsed shard's TAT was written");
}

/// Node `id`, started, killed with -9 once ready, and started again under
/// its id: ready once its earlier life's leases have lapsed.
async fn killed_and_restarted(id: &str, nats: &NatsServer) -> NodeProcess {
    let mut first = node(id, nats);
    first
        .wait_ready(Duration::from_secs(20))
        .await
        .expect("ready");
    first.kill().await.expect("kill -9");
    let again = node(id, nats);
    again
        .wait_ready(Duration::from_secs(20))
        .await
        .expect("ready after the restart");
    again
}

/// Two live processes given one node id would split that node's shards
/// while the fleet counts one node: each hears the other's heartbeats after
/// its own and says so, and the one started later leaves the fleet and exits
/// with status 2 (a configuration error), while the first keeps serving. A
/// node restarted under its id says nothing. (Its earlier life's last
/// heartbeat reaches its watch only when the watch begins before its own
/// first heartbeat; that order is `membership.rs`'s unit test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_live_processes_with_one_node_id_the_later_leaves_and_a_restart_is_not_one() {
    const CONFLICTS: &str = "ankusa_node_id_conflicts_total";
    let nats = NatsServer::start().await.expect("nats");
    let again = killed_and_restarted("twin", &nats).await;
    // Five heartbeats (one each lease_renew_ms, 400 ms).
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        again.metric(CONFLICTS).await,
        Some(0.0),
        "a restart taken for a twin: {}",
        again.log_tail(20)
    );

    let mut twin = node("twin", &nats);
    let exited = twin
        .process()
        .wait_timeout(Duration::from_secs(20))
        .await
        .unwrap_or_else(|err| panic!("the later twin still runs: {err}"));
    assert_eq!(exited.code(), Some(2), "{}", twin.log_tail(20));
    assert!(
        twin.log()
            .contains("this process, started later, leaves the fleet"),
        "{}",
        twin.log_tail(20)
    );
    let reported = wait_until(Duration::from_secs(10), || async {
        again.metric(CONFLICTS).await == Some(1.0)
    })
    .await;
    assert!(
        reported.is_ok(),
        "the first did not report its twin once: {:?}",
        again.metric(CONFLICTS).await
    );
    assert!(again
        .log()
        .contains("the other process, started later, leaves the fleet"));
    // The first serves on, every shard its own: its heartbeat was left in place.
    let serving = wait_until(Duration::from_secs(10), || async {
        again.is_ready().await && again.metric("ankusa_shards_owned").await == Some(SHARDS as f64)
    })
    .await;
    assert!(
        serving.is_ok(),
        "the first twin stopped serving: {}",
        again.log_tail(20)
    );
    let store = edge(&nats).await;
    let answered = store
        .hit(hit("after-the-twin", "k", "h"), Duration::from_secs(2))
        .await;
    assert!(matches!(answered, Ok(HitOutcome::Ok)), "{answered:?}");
}

/// A node restarted after kill -9 finds its shards' leases held by its
/// earlier life, which will not hand them back: it waits each one out
/// rather than asking for it every 100 ms until it lapses (two KV operations
/// a shard each time, for up to a TTL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_waits_out_its_earlier_lifes_leases_without_asking_again() {
    const REFUSED: &str = "ankusa_lease_takes_refused_total";
    let nats = NatsServer::start().await.expect("nats");
    let again = killed_and_restarted("again", &nats).await;
    assert_eq!(
        again.metric("ankusa_shards_owned").await,
        Some(SHARDS as f64)
    );
    // Each shard refused once, then every 100 ms from its estimated lapse
    // until the server drops the key, a few hundred ms late: 4 a shard here.
    // Asked every 100 ms throughout, each was refused 23 times.
    let refused = again.metric(REFUSED).await.expect("exported");
    assert!(
        refused <= 8.0 * SHARDS as f64,
        "{refused} refusals for {SHARDS} shards: {}",
        again.log_tail(20)
    );
    assert!(
        refused >= SHARDS as f64,
        "the earlier life's leases were not met"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_node_does_not_answer_for_a_shard_that_moved() {
    let nats = NatsServer::start().await.expect("nats");
    let kv = kv(&nats).await;
    let mut nodes = [node("node-a", &nats), node("node-b", &nats)];
    let owners = wait_balanced(&kv, &["node-a", "node-b"], Duration::from_secs(20)).await;
    let store = edge(&nats).await;
    let shard = 5;
    let tenant = tenant_on(shard);
    let zombie_id = owners[&shard].clone();
    let survivor_id = if zombie_id == "node-a" {
        "node-b"
    } else {
        "node-a"
    };
    let zombie = nodes
        .iter()
        .position(|n| n.spec.node_id == zombie_id)
        .expect("runs");
    assert_eq!(
        store.hit(hit(&tenant, "before", "h"), T).await,
        Ok(HitOutcome::Ok)
    );

    nodes[zombie].pause().expect("SIGSTOP");
    // The survivor takes every shard once the zombie's leases lapse, and
    // serves this one once it has loaded it (a request sent before would
    // reach only the zombie's subscription).
    wait_balanced(&kv, &[survivor_id], Duration::from_secs(15)).await;
    let served = wait_until(Duration::from_secs(15), || async {
        store.hit(hit(&tenant, "served", "h"), T).await == Ok(HitOutcome::Ok)
    })
    .await;
    assert!(
        served.is_ok(),
        "the survivor does not answer for shard {shard}"
    );

    // Requests sent now reach both subscribers: the survivor answers; the
    // zombie only reads them when it wakes.
    let client = nats.connect().await.expect("connect");
    let subject = Subjects::new("test").unwrap().shard(shard);
    let inbox = client.new_inbox();
    let mut replies = client.subscribe(inbox.clone()).await.expect("inbox");
    let sent = 20;
    for i in 0..sent {
        let req = Request::new(5_000, Op::Hit(hit(&tenant, &format!("z{i}"), "h")));
        client
            .publish_with_reply(subject.clone(), inbox.clone(), req.encode().into())
            .await
            .expect("publish");
    }
    client.flush().await.expect("flush");
    tokio::time::sleep(Duration::from_millis(300)).await;
    nodes[zombie].resume().expect("SIGCONT");

    // Collect every reply for a while after the zombie woke up.
    let mut answers = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while let Ok(Some(message)) = tokio::time::timeout_at(deadline, replies.next()).await {
        answers.push(Reply::decode(&message.payload).expect("reply"));
    }
    assert_eq!(
        answers.len(),
        sent,
        "one answer per request, none from the zombie: {answers:?}"
    );
    assert!(
        answers
            .iter()
            .all(|r| r.body == ReplyBody::Hit(HitOutcome::Ok)),
        "{answers:?}"
    );
    let dropped = nodes[zombie].metric("ankusa_requests_dropped_total").await;
    assert!(
        dropped.unwrap_or(0.0) >= 1.0,
        "zombie dropped nothing: {dropped:?}"
    );

    // And the fleet rebalances with the zombie back.
    wait_balanced(&kv, &["node-a", "node-b"], Duration::from_secs(15)).await;
}

/// The keys of the instance's state bucket now.
async fn state_keys(nats: &NatsServer) -> Vec<String> {
    let client = nats.connect().await.expect("connect");
    let js = async_nats::jetstream::new(client);
    let state = js
        .get_key_value("ankusa_test_state")
        .await
        .expect("state bucket");
    let keys = state.keys().await.expect("keys");
    keys.filter_map(|k| async move { k.ok() }).collect().await
}

/// Hits and commits `key` on `tenant`'s shard, retrying while it moves.
async fn commit(store: &FleetStore, tenant: &str, key: &str, hook: &str) {
    let hit = retry_until_ok(Duration::from_secs(10), || {
        store.hit(hit(tenant, key, hook), T)
    })
    .await;
    assert_eq!(hit, Ok(HitOutcome::Ok), "hit {tenant}/{key}");
    let settled = retry_until_ok(Duration::from_secs(10), || {
        store.settle(settle(tenant, key, hook, Settlement::Commit), T)
    })
    .await;
    assert_eq!(settled, Ok(SettleOutcome::Ok), "commit {tenant}/{key}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_go_to_the_node_log_only_once_every_live_node_reads_it() {
    let nats = NatsServer::start().await.expect("nats");
    let kv = kv(&nats).await;
    // A node of an earlier release: its heartbeat names no claim log format.
    let earlier = Heartbeat {
        node: "node-earlier".into(),
        started_ms: 1,
        http: None,
        claim_log_format: 0,
        incarnation: 0,
        shards: 0,
        serving: 0,
        ttl_ms: 0,
    };
    kv.heartbeat(&earlier, Duration::from_secs(120))
        .await
        .expect("heartbeat");
    let mut nodes = [node("node-a", &nats), node("node-b", &nats)];
    let with_earlier = targets(&["node-earlier", "node-a", "node-b"]);
    let shard = (0..SHARDS)
        .find(|s| with_earlier[s] != "node-earlier")
        .expect("a shard for the new nodes");
    let deadline = Instant::now() + Duration::from_secs(20);
    while kv.lease_holders().await.unwrap_or_default().get(&shard) != Some(&with_earlier[&shard]) {
        assert!(Instant::now() < deadline, "shard {shard} never taken");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let store = edge(&nats).await;
    let tenant = tenant_on(shard);

    commit(&store, &tenant, "before", "h1").await;
    let keys = state_keys(&nats).await;
    assert!(
        keys.iter().any(|k| k.starts_with("l.")) && !keys.iter().any(|k| k.starts_with("m.")),
        "beside an earlier node, only group logs: {keys:?}"
    );
    for node in &nodes {
        // A node sets the gauge in its first round that knows the live nodes:
        // the shard's owner has had one, the other may still be starting.
        let format = "ankusa_claim_log_format";
        let _ = wait_until(Duration::from_secs(10), || async {
            node.metric(format).await.is_some()
        })
        .await;
        assert_eq!(node.metric(format).await, Some(1.0));
    }

    // Once it is gone, the next rounds switch both nodes to their node logs.
    kv.leave("node-earlier").await.expect("leave");
    wait_balanced(&kv, &["node-a", "node-b"], Duration::from_secs(20)).await;
    let mut after = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let key = format!("after-{}", after.len());
        commit(&store, &tenant, &key, "h2").await;
        after.push(key);
        if state_keys(&nats).await.iter().any(|k| k.starts_with("m.")) {
            break;
        }
        assert!(Instant::now() < deadline, "no node log message within 10 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Each node switches in its own round.
    for node in &nodes {
        let deadline = Instant::now() + Duration::from_secs(5);
        while node.metric("ankusa_claim_log_format").await != Some(2.0) {
            assert!(
                Instant::now() < deadline,
                "{} still writes the group logs",
                node.spec.node_id
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // The next owner reads both logs.
    let owner = kv.lease_holders().await.expect("holders")[&shard].clone();
    let index = nodes
        .iter()
        .position(|n| n.spec.node_id == owner)
        .expect("owner runs");
    nodes[index].kill().await.expect("kill -9");
    for (key, hook) in
        std::iter::once(("before", "h1")).chain(after.iter().map(|k| (k.as_str(), "h2")))
    {
        let answer = retry_until_ok(Duration::from_secs(10), || {
            store.hit(hit(&tenant, key, "h9"), Duration::from_millis(300))
        })
        .await;
        assert_eq!(
            answer,
            Ok(HitOutcome::Duplicate {
                hook_id: hook.into()
            }),
            "{key} after the owner's kill -9"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_restart_keeps_every_committed_claim() {
    let mut nats = NatsServer::start().await.expect("nats");
    let kv_before = kv(&nats).await;
    let _nodes = [node("node-a", &nats), node("node-b", &nats)];
    wait_balanced(&kv_before, &["node-a", "node-b"], Duration::from_secs(20)).await;
    let store = edge(&nats).await;
    let keys: Vec<(String, String)> = (0..SHARDS)
        .map(|s| (tenant_on(s), format!("restart-{s}")))
        .collect();
    for (tenant, key) in &keys {
        assert_eq!(
            store.hit(hit(tenant, key, "h1"), T).await,
            Ok(HitOutcome::Ok)
        );
        assert_eq!(
            store
                .settle(settle(tenant, key, "h1", Settlement::Commit), T)
                .await,
            Ok(SettleOutcome::Ok)
        );
    }

    nats.stop().await.expect("nats stops");
    nats.start_again()
        .await
        .expect("nats starts with its store dir");
    for (tenant, key) in &keys {
        let last = retry_until_ok(Duration::from_secs(15), || {
            store.hit(hit(tenant, key, "h2"), Duration::from_millis(300))
        })
        .await;
        assert_eq!(
            last,
            Ok(HitOutcome::Duplicate {
                hook_id: "h1".into()
            }),
            "{tenant}/{key}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_subject_answers_for_its_own_shards_only_and_edges_batch_there() {
    let nats = NatsServer::start().await.expect("nats");
    let kv = kv(&nats).await;
    let mut nodes = vec![node("node-a", &nats), node("node-b", &nats)];
    let owners = wait_balanced(&kv, &["node-a", "node-b"], Duration::from_secs(20)).await;
    let subjects = Subjects::new("test").unwrap();
    let client = nats.connect().await.expect("connect");
    let ask = |subject: String, request: Request| {
        let client = client.clone();
        async move {
            let message = tokio::time::timeout(T, client.request(subject, request.encode().into()))
                .await
                .expect("answered in time")
                .expect("request sent");
            Reply::decode(&message.payload).expect("a well-formed reply")
        }
    };

    // A shard's reply names the node serving it.
    let reply = ask(
        subjects.shard(3),
        Request::new(1_000, Op::Hit(hit(&tenant_on(3), "named", "h"))),
    )
    .await;
    assert_eq!(reply.body, ReplyBody::Hit(HitOutcome::Ok));
    assert_eq!(reply.node.as_deref(), Some(owners[&3].as_str()));

    // Garbage on a node's subject gets a typed error, like on a shard's.
    let message = tokio::time::timeout(
        T,
        client.request(subjects.node("node-a"), b"\xc1 not msgpack".to_vec().into()),
    )
    .await
    .expect("answered in time")
    .expect("request sent");
    match Reply::decode(&message.payload)
        .expect("a well-formed reply")
        .body
    {
        ReplyBody::Error(err) => assert_eq!(err.code, ErrorCode::Malformed),
        other => panic!("garbage answered {other:?}"),
    }
    // A lone call on a node's subject is answered as itself, and timed, like
    // the garbage, under its own name.
    let duration_count = |op: &str| format!("ankusa_request_duration_seconds_count{{op=\"{op}\"}}");
    let hits_before = nodes[0].metric(&duration_count("hit")).await.unwrap_or(0.0);
    let own = (0..SHARDS)
        .find(|s| owners[s] == "node-a")
        .expect("node-a owns a shard");
    let reply = ask(
        subjects.node("node-a"),
        Request::new(1_000, Op::Hit(hit(&tenant_on(own), "lone", "h"))),
    )
    .await;
    assert_eq!(reply.body, ReplyBody::Hit(HitOutcome::Ok));
    let hits_after = nodes[0].metric(&duration_count("hit")).await.unwrap_or(0.0);
    assert!(hits_after > hits_before, "{hits_before} -> {hits_after}");
    let undecodable = nodes[0].metric(&duration_count("undecodable")).await;
    assert!(undecodable >= Some(1.0), "{undecodable:?}");

    // One batch to node-a with an item for every shard: node-a applies its own
    // and answers `wrong_node` for the others, applying nothing of theirs.
    let batch = |hook: &str| {
        let items = (0..SHARDS)
            .map(|s| Request::new(1_000, Op::Hit(hit(&tenant_on(s), "k", hook))))
            .collect();
        Request::new(1_000, Op::Batch(items))
    };
    let reply = ask(subjects.node("node-a"), batch("first")).await;
    let ReplyBody::Batch(items) = reply.body else {
        panic!("a batch answered with {reply:?}");
    };
    assert_eq!(items.len(), SHARDS as usize);
    for (shard, item) in (0..SHARDS).zip(&items) {
        if owners[&shard] == "node-a" {
            assert_eq!(item.body, ReplyBody::Hit(HitOutcome::Ok), "shard {shard}");
        } else {
            match &item.body {
                ReplyBody::Error(err) => assert_eq!(err.code, ErrorCode::WrongNode),
                other => panic!("shard {shard} of node-b answered {other:?} on node-a"),
            }
        }
    }
    // The same keys under another hook: node-b's were never claimed (`Ok`),
    // node-a's are pending for the first hook.
    let reply = ask(subjects.node("node-b"), batch("second")).await;
    let ReplyBody::Batch(items) = reply.body else {
        panic!("a batch answered with {reply:?}");
    };
    for (shard, item) in (0..SHARDS).zip(&items) {
        match (owners[&shard].as_str(), &item.body) {
            ("node-b", ReplyBody::Hit(HitOutcome::Ok)) => {}
            ("node-a", ReplyBody::Error(err)) if err.code == ErrorCode::WrongNode => {}
            (owner, body) => panic!("shard {shard} ({owner}) answered {body:?} on node-b"),
        }
    }

    // An edge with batching learns the owners from its first replies, then
    // sends its batches to the nodes' subjects.
    let store = edge(&nats).await;
    let before = node_batches(&nodes).await;
    for round in ["learn", "batch"] {
        burst(&store, round).await;
    }
    let sent = node_batches(&nodes).await - before;
    assert!(sent >= 1.0, "no batch of the edge reached a node's subject");

    // An edge told not to use node subjects batches shard by shard only.
    let shard_only = edge_with(&nats, |c| c.node_batches = false).await;
    let before = node_batches(&nodes).await;
    for round in ["shard-learn", "shard-batch"] {
        burst(&shard_only, round).await;
    }
    assert_eq!(
        node_batches(&nodes).await,
        before,
        "node_batches off, yet a node batch"
    );

    // Shards move to a new node: the old owners answer `wrong_node` for what
    // the edge still sends them, and the edge sends it on to the shards.
    nodes.push(node("node-c", &nats));
    wait_balanced(
        &kv,
        &["node-a", "node-b", "node-c"],
        Duration::from_secs(20),
    )
    .await;
    burst(&store, "moved").await;
    let wrong_node = sum_metric(&nodes, "ankusa_requests_refused_total{code=\"wrong_node\"}").await;
    assert!(
        wrong_node >= 1.0,
        "no item came back wrong_node after the move"
    );

    // A node that leaves: its subject has no responders, and the edge finds
    // the shards' new owners through their subjects.
    nodes[0].stop().await.expect("node-a stops");
    wait_balanced(&kv, &["node-b", "node-c"], Duration::from_secs(20)).await;
    burst(&store, "left").await;
}

/// A node whose lease writes fail (its leases' stream gone: the server
/// answers "no responders" at once, as it does for a stream that lost its
/// leader with its quorum) tries one lease write a round, not one per free
/// shard every 100 ms. Before, an outage made each node a load generator
/// against the servers still up and filled its log: with 1,024 shards, 90 s
/// without quorum took the node 16 s of CPU, the surviving server 20 s, and
/// wrote 74 MB of warnings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_lease_writes_fail_tries_once_a_round() {
    let nats = NatsServer::start().await.expect("nats");
    let node = node("node-a", &nats);
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");
    delete_stream(&nats, "KV_ankusa_test_leases").await;
    let failures = || node.metric("ankusa_lease_acquire_failures_total");
    // The leases lapse (TTL 2 s, margin 0.5 s), then every free shard is tried.
    let lapsed = Instant::now() + Duration::from_secs(10);
    while failures().await.unwrap_or(0.0) == 0.0 {
        assert!(Instant::now() < lapsed, "no lease write failed in 10 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = failures().await.unwrap_or(0.0);
    let watched = Duration::from_secs(4);
    tokio::time::sleep(watched).await;
    let failed = failures().await.unwrap_or(0.0) - before;
    // Rounds every 400 ms: about 10 in 4 s; per shard every 100 ms, 640.
    assert!(
        (1.0..=20.0).contains(&failed),
        "{failed} failed lease writes in {watched:?} with {SHARDS} shards free"
    );
    assert_eq!(node.metric("ankusa_shards_owned").await, Some(0.0));
}

/// A bucket keeps the replica count it was created with. A node configured
/// for more serves with the bucket as it is, and says so in its log and its
/// metrics, rather than leave its operator believing in a redundancy the
/// fleet does not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_says_when_its_buckets_have_fewer_replicas_than_configured() {
    let nats = NatsServer::start().await.expect("nats");
    let kv = kv(&nats).await;
    let buckets = kv.bucket_replicas().await.expect("bucket info");
    assert_eq!(
        buckets,
        ["state", "leases", "nodes"]
            .map(|b| (format!("ankusa_test_{b}"), 1))
            .to_vec()
    );
    let mut spec = NodeSpec::fleet("node-a", vec![nats.url()]);
    spec.kv_replicas = 3;
    let mut node = NodeProcess::start(spec).expect("node starts");
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");
    node.process()
        .wait_for_log(
            "exists with 1 replica(s), not the 3 configured",
            Duration::from_secs(5),
        )
        .await
        .expect("the node warns of the replica count");
    assert_eq!(
        node.metric("ankusa_kv_bucket_replicas{bucket=\"ankusa_test_state\"}")
            .await,
        Some(1.0)
    );
    let store = edge(&nats).await;
    assert_eq!(
        retry_until_ok(Duration::from_secs(10), || store
            .hit(hit("acme", "replicas", "h1"), T))
        .await,
        Ok(HitOutcome::Ok)
    );
}

/// The state bucket expires its messages without leaving a marker for each
/// (a second stored message and a second expiry); leases and heartbeats keep
/// theirs, which the nodes' watch learns of a dead node from. A state bucket
/// that an earlier release created with markers is used as it is, with a
/// warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_bucket_expires_its_messages_without_markers() {
    use async_nats::jetstream::{self, kv};
    let nats = NatsServer::start().await.expect("nats");
    let js = jetstream::new(nats.connect().await.expect("connect"));
    let markers = |stream: String| {
        let js = js.clone();
        async move {
            let mut stream = js.get_stream(stream).await.expect("stream");
            let config = stream.info().await.expect("stream info").config.clone();
            (config.allow_message_ttl, config.subject_delete_marker_ttl)
        }
    };
    let _kv = kv(&nats).await;
    let one_second = Some(Duration::from_secs(1));
    assert_eq!(markers("KV_ankusa_test_state".into()).await, (true, None));
    for bucket in ["leases", "nodes"] {
        let stream = format!("KV_ankusa_test_{bucket}");
        assert_eq!(markers(stream).await, (true, one_second), "{bucket}");
    }

    let mut headers = async_nats::HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_TTL, "1");
    js.publish_with_headers("$KV.ankusa_test_state.m.gone.1", headers, "x".into())
        .await
        .expect("publish")
        .await
        .expect("ack");
    let mut stream = js.get_stream("KV_ankusa_test_state").await.expect("stream");
    let deadline = Instant::now() + Duration::from_secs(10);
    let state = loop {
        let state = stream.info().await.expect("stream info").state.clone();
        if state.messages == 0 || Instant::now() > deadline {
            break state;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(state.messages, 0, "the message expired");
    // A marker would have been stored as the stream's second message.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let state = stream.info().await.expect("stream info").state.clone();
    assert_eq!(state.last_sequence, 1, "no marker was stored: {state:?}");

    // As releases before session 22 created it.
    js.create_key_value(kv::Config {
        bucket: "ankusa_earlier_state".into(),
        history: 1,
        limit_markers: one_second,
        ..Default::default()
    })
    .await
    .expect("state bucket with markers");
    let mut spec = NodeSpec::fleet("node-a", vec![nats.url()]);
    spec.instance = "earlier".into();
    let mut node = NodeProcess::start(spec).expect("node starts");
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");
    node.process()
        .wait_for_log("expiry markers", Duration::from_secs(5))
        .await
        .expect("the node warns of the state bucket's markers");
    let stream = "KV_ankusa_earlier_state".to_string();
    assert_eq!(markers(stream).await, (true, one_second), "left as it is");
}

/// A node told to stop while its NATS server is gone still exits in bounded
/// time. Every KV call would time out, one shard after another (16 × the lease
/// TTL here), in the round that is running and in the leave; so the stop does
/// not wait for the round, the leave as a whole is bounded, and what it could
/// not hand back lapses by TTL, as after a crash. It says so: the shards whose
/// leases lapsed before the leave, each by name, or those the leave gave up on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_nats_still_stops_in_bounded_time() {
    let mut nats = NatsServer::start().await.expect("nats");
    let mut node =
        NodeProcess::start(NodeSpec::fleet("node-a", vec![nats.url()])).expect("node starts");
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");
    assert_eq!(node.metric("ankusa_shards_owned").await, Some(16.0));
    nats.kill().await.expect("nats-server killed");
    // Stop it in the middle of a round, while each renewal waits out its bound:
    // the stop must not wait for the round.
    node.process()
        .wait_for_log("lease renewals failed", Duration::from_secs(10))
        .await
        .expect("the node notices NATS is gone");
    let asked = Instant::now();
    node.process().signal(Signal::Term).expect("SIGTERM");
    // The round under way gets one lease TTL to finish, then the leave has
    // max(3 lease TTLs, 10 s): 2 + 10 s with the 2 s TTL here.
    let status = node
        .process()
        .wait_timeout(Duration::from_secs(16))
        .await
        .unwrap_or_else(|e| panic!("{e}; log tail:\n{}", node.log_tail(30)));
    assert!(status.success(), "exit {status:?}");
    assert!(
        asked.elapsed() >= Duration::from_secs(1),
        "it left at once ({:?}): did it try to hand anything back?",
        asked.elapsed()
    );
    let log = node.log();
    // The leave renews what it still holds while it hands shards back, so a
    // shard is named either lapsed (by a renewal, before or during the leave)
    // or left to lapse by its failed release.
    let mut named = shards_named(&log, "leases lost; no longer serving the shards");
    named.extend(shards_named(
        &log,
        "lease release failed; it will lapse by TTL",
    ));
    let lapsed = (0..16).filter(|shard| named.contains(shard)).count();
    assert!(
        lapsed == 16 || log.contains("leases lapse by TTL"),
        "the node says what it left behind ({lapsed} shards named lapsed); log tail:\n{}",
        node.log_tail(30)
    );
}

/// Every shard the log's lines with `message` name in their `shards=` field
/// (runs folded as `0-15,17`) or their `shard=` field.
fn shards_named(log: &str, message: &str) -> BTreeSet<u32> {
    let number = |n: &str| {
        n.parse::<u32>()
            .unwrap_or_else(|e| panic!("shard {n:?}: {e}"))
    };
    log.lines()
        .filter(|line| line.contains(message))
        .filter_map(|line| {
            line.split_whitespace().find_map(|f| {
                f.strip_prefix("shards=")
                    .or_else(|| f.strip_prefix("shard="))
            })
        })
        .flat_map(|list| list.split(','))
        .flat_map(|run| match run.split_once('-') {
            Some((start, end)) => number(start)..=number(end),
            None => number(run)..=number(run),
        })
        .collect()
}

/// A node whose NATS server is gone stops serving all its shards together
/// once their leases lapse, and goes on with its rounds. Releasing them one
/// after another waited out each shard's in-flight grace in turn (2 s a
/// shard, its answers unable to leave): 16 shards took half a minute, a
/// node of 1,024 shards over half an hour, its ownership loop stuck in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_nats_lets_its_lapsed_shards_go_together() {
    let mut nats = NatsServer::start().await.expect("nats");
    let node = node("node-a", &nats);
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");
    assert_eq!(node.metric("ankusa_shards_owned").await, Some(16.0));
    nats.kill().await.expect("nats-server killed");
    let killed = Instant::now();
    // The leases lapse 1.5 s after their last renewal (TTL 2 s, margin
    // 0.5 s); the renewal that finds it waits out its own bound (2 s), then
    // every shard's in-flight answers get one grace (2 s), together.
    let bound = Duration::from_secs(10);
    while node.metric("ankusa_shards_owned").await != Some(0.0) {
        assert!(
            killed.elapsed() < bound,
            "still serving {:?} shards {:?} after NATS went away; log tail:\n{}",
            node.metric("ankusa_shards_owned").await,
            killed.elapsed(),
            node.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A node whose nats-server froze (SIGSTOP) longer than a lease lets its
/// shards go; the renewals it sent meanwhile wait in the server and, when it
/// wakes, are often stored before the leases they renew expire: the leases
/// are held again under the node's name. The node takes those over and
/// serves again within a round, instead of waiting a lease TTL for its own
/// leases to expire (5.6 s with the default 5 s TTL, before). Which comes
/// first on waking is the server's race: here the renewals did in five runs
/// of eight (the take-over counter says), and only such runs fail
/// without the take-over; `only_the_process_that_wrote_a_lease_takes_it_over`
/// checks the take-over itself every time, and
/// `a_node_takes_over_the_lease_its_unanswered_take_wrote` the same path
/// end to end without the race.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_takes_back_at_once_the_leases_its_late_writes_renewed() {
    let mut nats = NatsServer::start().await.expect("nats");
    let node = node("node-a", &nats);
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");
    nats.pause().expect("SIGSTOP nats-server");
    // TTL 2 s, margin 0.5 s: every shard's window closes 1.5 s after its last
    // renewal; the renewal that finds it out waits its bound (2 s).
    let let_go = wait_until(Duration::from_secs(10), || async {
        node.metric("ankusa_shards_owned").await == Some(0.0)
    })
    .await;
    assert!(
        let_go.is_ok(),
        "still serving {:?} shards with nats-server frozen; log tail:\n{}",
        node.metric("ankusa_shards_owned").await,
        node.log_tail(20)
    );
    nats.resume().expect("SIGCONT nats-server");
    let (took, adopted) = served_again(&node, "SIGCONT").await;
    // Waiting the renewed leases out cannot take less than their TTL (2 s)
    // from the moment the server woke and stored them.
    assert!(
        took < Duration::from_secs(2),
        "{took:?} to serve again, {adopted:?} leases taken over; log tail:\n{}",
        node.log_tail(20)
    );
    let store = edge(&nats).await;
    burst(&store, "after-freeze").await;
}

/// The same take-over, without the server's race: the node's link is
/// blackholed (the proxy holds its bytes) until its leases lapse, its first
/// lease take has waited out its bound, and the leases' expiry markers (1 s)
/// have expired too. On restore the held bytes reach the server in order:
/// the renewals fail (their leases expired meanwhile), the first take
/// creates the lease on the free key, and its ack reaches a node that
/// stopped waiting for it. The lease is then held under the node's name by
/// a write it never heard answered; the node takes it over at once. Without
/// the take-over its shard waits out the lease (2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_takes_over_the_lease_its_unanswered_take_wrote() {
    let nats = NatsServer::start().await.expect("nats");
    let cut = NetCut::start(&[nats.url()]).await.expect("net-cut proxy");
    let mut node = NodeProcess::start(NodeSpec::fleet("node-a", cut.urls())).expect("node starts");
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");
    cut.blackhole();
    node.process()
        .wait_for_log("cannot take lease", Duration::from_secs(15))
        .await
        .unwrap_or_else(|e| panic!("{e}; log tail:\n{}", node.log_tail(20)));
    assert_eq!(node.metric("ankusa_shards_owned").await, Some(0.0));
    // A take waits no longer than a renewal (0.55 s here): the leases' TTL
    // (2 s from their last renewal, 1.5 s before the lapse was seen) and their
    // markers' (1 s) have not all run out yet. Held bytes landing before then
    // would find a marker, fail, and leave nothing to take over.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    cut.restore().await.expect("restore the link");
    let (took, adopted) = served_again(&node, "the restore").await;
    assert!(
        adopted.unwrap_or(0.0) >= 1.0 && took < Duration::from_millis(1_500),
        "{took:?} to serve again, {adopted:?} leases taken over; log tail:\n{}",
        node.log_tail(20)
    );
}

/// Waits (10 s at most) until `node` serves all its shards again, from now,
/// the moment of `what`; returns how long that took and how many leases it
/// took over.
async fn served_again(node: &NodeProcess, what: &str) -> (Duration, Option<f64>) {
    let since = Instant::now();
    let back = wait_until(Duration::from_secs(10), || async {
        node.metric("ankusa_shards_owned").await == Some(f64::from(SHARDS))
    })
    .await;
    let took = since.elapsed();
    let adopted = node.metric("ankusa_leases_adopted_total").await;
    println!("served {SHARDS} shards again {took:?} after {what}, {adopted:?} leases taken over");
    assert!(
        back.is_ok(),
        "not serving again; log tail:\n{}",
        node.log_tail(20)
    );
    (took, adopted)
}

/// 400 hits at once, over every shard; each must be answered `Ok`.
async fn burst(store: &FleetStore, round: &str) {
    let calls = (0..400).map(|i| {
        let tenant = tenant_on(i % SHARDS);
        async move {
            store
                .hit(hit(&tenant, &format!("{round}-{i}"), "h"), T)
                .await
        }
    });
    let results = futures::future::join_all(calls).await;
    assert!(
        results.iter().all(|r| r == &Ok(HitOutcome::Ok)),
        "{results:?}"
    );
}

/// A node whose heartbeats fail (their stream gone: the server answers "no
/// responders" at once, as for a stream without quorum), and whose watch of
/// them has stopped, keeps its last view of the live nodes rather than list
/// the same bucket every round: in an outage that listing only waits out its
/// bound too. Its shards stay served (their leases are in another bucket).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_heartbeats_fail_keeps_its_view_without_listing() {
    let nats = NatsServer::start().await.expect("nats");
    let mut node = node("node-a", &nats);
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");
    delete_stream(&nats, "KV_ankusa_test_nodes").await;
    node.process()
        .wait_for_log("heartbeat failed", Duration::from_secs(5))
        .await
        .expect("the heartbeat fails");
    let listings = "ankusa_membership_listings_total";
    let before = node.metric(listings).await.unwrap_or(0.0);
    // Eight rounds (`lease_renew_ms` 400).
    tokio::time::sleep(Duration::from_millis(3_200)).await;
    let listed = node.metric(listings).await.unwrap_or(0.0) - before;
    assert!(
        listed <= 1.0,
        "{listed} listings in eight rounds without heartbeats"
    );
    assert_eq!(node.metric("ankusa_shards_owned").await, Some(16.0));
}

/// The consumers JetStream holds on the heartbeats' stream.
async fn heartbeat_consumers(nats: &NatsServer) -> usize {
    let js = async_nats::jetstream::new(nats.connect().await.expect("connect"));
    let mut stream = js
        .get_stream("KV_ankusa_test_nodes")
        .await
        .expect("nodes stream");
    stream
        .info()
        .await
        .expect("stream info")
        .state
        .consumer_count
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rounds_read_the_live_nodes_from_a_watch_not_a_consumer_each() {
    let nats = NatsServer::start().await.expect("nats");
    let kv = kv(&nats).await;
    let nodes = [node("node-a", &nats), node("node-b", &nats)];
    wait_balanced(&kv, &["node-a", "node-b"], Duration::from_secs(20)).await;
    let listings = "ankusa_membership_listings_total";
    let (listed, consumers) = (
        sum_metric(&nodes, listings).await,
        heartbeat_consumers(&nats).await,
    );
    // Eight rounds of each node (`lease_renew_ms` 400).
    tokio::time::sleep(Duration::from_millis(3_200)).await;
    let (listed_after, consumers_after) = (
        sum_metric(&nodes, listings).await,
        heartbeat_consumers(&nats).await,
    );
    println!(
        "listings {listed} -> {listed_after}, heartbeat consumers {consumers} -> {consumers_after}"
    );
    assert_eq!(
        listed_after, listed,
        "rounds listed the nodes instead of reading the watch"
    );
    assert!(
        consumers_after <= consumers,
        "consumers on the heartbeats grew from {consumers} to {consumers_after}"
    );

    // The watch still sees a node's heartbeat lapse, and a node join.
    let [a, mut b] = nodes;
    b.kill().await.expect("kill -9");
    let killed = Instant::now();
    wait_balanced(&kv, &["node-a"], Duration::from_secs(20)).await;
    let _c = node("node-c", &nats);
    let joined = Instant::now();
    wait_balanced(&kv, &["node-a", "node-c"], Duration::from_secs(20)).await;
    println!(
        "rebalanced {:?} after the kill, {:?} after the join",
        joined - killed,
        joined.elapsed()
    );
    drop(a);
}

async fn node_batches(nodes: &[NodeProcess]) -> f64 {
    sum_metric(
        nodes,
        "ankusa_request_duration_seconds_count{op=\"node_batch\"}",
    )
    .await
}

/// A metric summed over `nodes` (0 where a node does not show it).
async fn sum_metric(nodes: &[NodeProcess], name: &str) -> f64 {
    let mut total = 0.0;
    for node in nodes {
        total += node.metric(name).await.unwrap_or(0.0);
    }
    total
}

/// A tenant holding `max_tenant_claims` claims is refused a new key with
/// `overloaded` and nothing is charged or claimed, while the keys it holds are
/// answered as always (a redelivery is still a duplicate) and other tenants are
/// served. The cap only refuses new keys: a node started with a lower one
/// loads every persisted claim and still answers each a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_claim_cap_is_refused_new_keys_and_still_told_duplicates() {
    let nats = NatsServer::start().await.expect("nats");
    let capped = |cap: usize| {
        let mut spec = NodeSpec::fleet("capped", vec![nats.url()]);
        spec.extra_args = vec!["--max-tenant-claims".into(), cap.to_string()];
        NodeProcess::start(spec).expect("node starts")
    };
    let mut first = capped(3);
    first
        .wait_ready(Duration::from_secs(20))
        .await
        .expect("ready");
    let store = edge(&nats).await;
    let keys = ["k0", "k1", "k2"];
    for key in keys {
        round_trip(&store, "full", key, T).await;
    }
    let refused_new_key = async |store: &FleetStore| {
        let refused = store.hit(hit("full", "k3", "h1"), T).await;
        assert!(
            matches!(&refused, Err(StoreError::Refused(reply))
                if reply.code == ErrorCode::Overloaded && reply.message.contains("claims")),
            "a fourth key is refused for the claims held: {refused:?}"
        );
        assert_eq!(
            claims_shown(store, "full", &["k3"]).await,
            [None],
            "the refused key was not claimed"
        );
    };
    refused_new_key(&store).await;
    assert_eq!(
        first.metric("ankusa_tenant_claims_full_total").await,
        Some(1.0),
        "the refusal is told apart from a full queue"
    );
    assert_eq!(
        store.hit(hit("full", "k0", "h2"), T).await,
        Ok(HitOutcome::Duplicate {
            hook_id: "h1".into()
        }),
        "a key already held is answered at the cap"
    );
    assert_eq!(
        store.hit(hit("other", "k3", "h1"), T).await,
        Ok(HitOutcome::Ok),
        "another tenant is not held to this one's claims"
    );

    first.stop().await.expect("graceful stop");
    let again = capped(2);
    again
        .wait_ready(Duration::from_secs(20))
        .await
        .expect("ready after the restart");
    let store = edge(&nats).await;
    for key in keys {
        assert_eq!(
            store.hit(hit("full", key, "h2"), T).await,
            Ok(HitOutcome::Duplicate {
                hook_id: "h1".into()
            }),
            "{key}: a claim over the new cap is loaded all the same"
        );
    }
    refused_new_key(&store).await;
}
