//! Security against real, locked-down nats-servers and real `ankusa-node`s:
//!
//! - user/password with per-user permissions, loaded from the deploy file
//!   `deploy/nats/permissions.conf` itself (so the documented example and what is
//!   tested cannot drift apart): the node (fleet mode, so its KV use is covered)
//!   serves with exactly those rights, the edge works end to end; an edge without
//!   or with wrong credentials never reaches the fleet (`Disconnected`, and the
//!   degrading edge answers locally); an authenticated user without publish
//!   rights on the shard subjects never gets an answer; an edge cannot pose as a
//!   node or write the instance's KV; an edge whose rights predate node
//!   batches (shard subjects only) turns them off when the server refuses one,
//!   and its calls are answered again; an edge cannot have the node write a
//!   bucket by naming it as a request's reply subject; an edge user limited to a private inbox
//!   prefix is answered there, and only there; the node's JetStream answers
//!   (a shard load carries every claim) come to an inbox no edge may read;
//! - token and nkey authentication;
//! - TLS with a private CA, and client certificates (`verify: true`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ankusa_actors::HitOutcome;
use ankusa_bus::edge::{Edge, EdgeConfig, LocalReason, Source};
use ankusa_bus::{FleetConfig, FleetStore, NatsOptions, Store, StoreError};
use ankusa_tests::permissions::{
    permissions_conf, violations, EDGE_PASSWORD, NODE_INBOX_PREFIX, NODE_PASSWORD, NODE_USER_ARGS,
};
use ankusa_tests::requests::{hit, round_trip};
use ankusa_tests::{connected_edge, wait_until, NatsServer, NodeProcess, NodeSpec, ServerConfig};
use futures::StreamExt;

const SHARDS: u32 = 16;
const INSTANCE: &str = "prod";
const T: Duration = Duration::from_millis(500);

fn options(url: &str, tweak: impl FnOnce(&mut NatsOptions)) -> NatsOptions {
    let mut nats = NatsOptions::with_servers([url]);
    // Retry quickly, so a refused client is seen retrying within the test.
    nats.max_reconnect_delay_ms = 200;
    tweak(&mut nats);
    nats
}

fn config(nats: NatsOptions) -> FleetConfig {
    let mut config = FleetConfig::new(nats, INSTANCE);
    config.shards = SHARDS;
    config
}

async fn store(nats: NatsOptions) -> FleetStore {
    FleetStore::connect(config(nats))
        .await
        .expect("valid config")
}

/// An edge that has finished connecting.
async fn connected(nats: NatsOptions) -> FleetStore {
    connected_edge(config(nats)).await
}

fn node_spec(id: &str, url: &str, mode: &str, auth: &[&str]) -> NodeSpec {
    let mut spec = if mode == "fleet" {
        NodeSpec::fleet(id, vec![url.to_string()])
    } else {
        NodeSpec::standalone(id, vec![url.to_string()])
    };
    spec.instance = INSTANCE.into();
    spec.shards = SHARDS;
    spec.extra_args = auth.iter().map(|s| s.to_string()).collect();
    spec
}

async fn start_node(spec: NodeSpec) -> NodeProcess {
    let node = NodeProcess::start(spec).expect("node starts");
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");
    node
}

/// A fleet node connected as the file's `ankusa-node` user.
async fn fleet_node_as_node_user(id: &str, url: &str) -> NodeProcess {
    start_node(node_spec(id, url, "fleet", &NODE_USER_ARGS)).await
}

/// A bare NATS client of the file's edge user, to try what the edge client
/// never does.
async fn raw_edge_user(url: &str) -> async_nats::Client {
    async_nats::ConnectOptions::with_user_and_password("ankusa-edge".into(), EDGE_PASSWORD.into())
        .connect(url)
        .await
        .expect("the edge user connects")
}

/// An edge connected as `user`.
async fn edge_as(url: &str, user: &str, password: &str) -> FleetStore {
    connected(options(url, |o| {
        o.user = Some(user.into());
        o.password = Some(password.into());
    }))
    .await
}

/// An edge the server refuses: it must keep failing fast with `Disconnected`
/// (never an answer from the fleet) and the degrading edge must answer locally.
async fn assert_locked_out(nats: NatsOptions, what: &str) {
    let store = store(nats).await;
    let until = Instant::now() + Duration::from_millis(1500);
    let mut calls = 0;
    while Instant::now() < until {
        calls += 1;
        let got = store
            .hit(hit("acme", &format!("{what}-{calls}"), "h"), T)
            .await;
        assert_eq!(got, Err(StoreError::Disconnected), "{what}: call {calls}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_ne!(
        store.nats().connection_state(),
        async_nats::connection::State::Connected,
        "{what}: the server let it in"
    );
    let edge = Edge::new(store, EdgeConfig::default());
    let answer = edge
        .hit(hit("acme", what, "h"), T)
        .await
        .expect("a local answer");
    assert_eq!(answer.outcome, HitOutcome::Ok);
    assert_eq!(
        answer.source,
        Source::Local {
            reason: LocalReason::Disconnected
        },
        "{what}"
    );
}

/// `count` hits on as many tenants at once; how many were answered `Ok`.
async fn burst(store: &FleetStore, round: &str, count: usize) -> usize {
    let calls = (0..count).map(|i| store.hit(hit(&format!("t{i}"), round, "h"), T));
    futures::future::join_all(calls)
        .await
        .into_iter()
        .filter(|r| r == &Ok(HitOutcome::Ok))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_with_a_private_inbox_prefix_is_answered_there() {
    let private = r#"    { user = "edge-eu1", password = "eu1-pw", permissions = { publish = { allow = ["ankusa.prod.shard.*", "ankusa.prod.node.*"] }, subscribe = { allow = ["_INBOX_edge_eu1.>"] } } }"#;
    let nats = NatsServer::start_with(ServerConfig::new().append(&permissions_conf(private)))
        .await
        .expect("nats-server with the deploy permissions starts");
    let url = nats.url();
    let _node = fleet_node_as_node_user("n1", &url).await;
    let edge = connected(options(&url, |o| {
        o.user = Some("edge-eu1".into());
        o.password = Some("eu1-pw".into());
        o.inbox_prefix = Some("_INBOX_edge_eu1".into());
    }))
    .await;
    round_trip(&edge, "acme", "evt-private", T).await;
    assert!(
        !violations(&nats)
            .iter()
            .any(|l| l.contains("user:edge-eu1")),
        "{}",
        nats.log_tail(20)
    );

    // The same user on the shared inbox: its subscription is refused, so no
    // answer ever reaches it.
    let shared = edge_as(&url, "edge-eu1", "eu1-pw").await;
    let got = shared.hit(hit("acme", "evt-shared", "h"), T).await;
    assert!(matches!(got, Err(StoreError::Timeout(_))), "{got:?}");
    assert!(
        violations(&nats).iter().any(|l| l.contains("user:edge-eu1")
            && l.contains("Subscription Violation - Subject \"_INBOX.")),
        "{}",
        nats.log_tail(20)
    );

    // A prefix that is not a literal subject is refused before connecting.
    let bad = config(options(&url, |o| o.inbox_prefix = Some("_INBOX.*".into())));
    assert!(matches!(
        FleetStore::connect(bad).await,
        Err(ankusa_bus::client::ClientConfigError::Connect(
            ankusa_bus::ConnectError::BadInboxPrefix(_)
        ))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_allowed_only_shard_subjects_stops_batching_to_nodes() {
    let old_edge = r#"    { user = "old-edge", password = "old-edge-pw", permissions = { publish = { allow = ["ankusa.prod.shard.*"] }, subscribe = { allow = ["_INBOX.>"] } } }"#;
    let nats = NatsServer::start_with(ServerConfig::new().append(&permissions_conf(old_edge)))
        .await
        .expect("nats-server with the deploy permissions starts");
    let url = nats.url();
    let _node = fleet_node_as_node_user("n1", &url).await;
    let edge = edge_as(&url, "old-edge", "old-edge-pw").await;
    // Lone calls go to shard subjects; their replies name the node.
    for i in 0..32 {
        let got = edge.hit(hit(&format!("t{i}"), "learn", "h"), T).await;
        assert_eq!(got, Ok(HitOutcome::Ok));
    }
    // The first burst is batched to the node's subject, which the server
    // refuses: those calls time out, once.
    burst(&edge, "first", 32).await;
    let refused =
        format!("user:old-edge\" - Publish Violation - Subject \"ankusa.{INSTANCE}.node.n1\"");
    assert!(
        violations(&nats).iter().any(|l| l.contains(&refused)),
        "the edge never tried the node subject: {}",
        nats.log_tail(20)
    );
    // From then on its batches go shard by shard, and every call is answered
    // (a call lost to the node subject would have timed out instead).
    for round in ["second", "third"] {
        assert_eq!(burst(&edge, round, 32).await, 32, "round {round}");
    }
    let refusals = violations(&nats)
        .iter()
        .filter(|l| l.contains(&refused))
        .count();
    assert_eq!(
        refusals, 1,
        "the edge went on publishing to the node subject"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_permissions_let_node_and_edge_work_and_nobody_else() {
    let intruder = r#"    { user = "intruder", password = "intruder-pw", permissions = { publish = { allow = ["_INBOX.>"] }, subscribe = { allow = ["_INBOX.>"] } } }"#;
    let nats = NatsServer::start_with(ServerConfig::new().append(&permissions_conf(intruder)))
        .await
        .expect("nats-server with the deploy permissions starts");
    let url = nats.url();

    // The edge user listens on every inbox it may, and tries the node's: what
    // the node's shard loads deliver (every claim's key) must never reach it.
    let spy = raw_edge_user(&url).await;
    let leaked = Arc::new(AtomicUsize::new(0));
    let mut listening = Vec::new();
    for inboxes in ["_INBOX.>".to_string(), format!("{NODE_INBOX_PREFIX}.>")] {
        let mut heard = spy.subscribe(inboxes).await.expect("subscribe is sent");
        let leaked = Arc::clone(&leaked);
        listening.push(tokio::spawn(async move {
            while let Some(message) = heard.next().await {
                if message.payload.windows(5).any(|w| w == b"evt-1") {
                    leaked.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    spy.flush().await.expect("flush");

    // The node in fleet mode: subjects, KV buckets, leases, heartbeats, all
    // within the rights the file gives it.
    let mut node = fleet_node_as_node_user("secure", &url).await;

    let edge = edge_as(&url, "ankusa-edge", EDGE_PASSWORD).await;
    round_trip(&edge, "acme", "evt-1", T).await;
    round_trip(&edge, "other.tenant", "evt-2", T).await;
    let node_violations: Vec<_> = violations(&nats)
        .into_iter()
        .filter(|l| l.contains("user:ankusa-node"))
        .collect();
    assert!(
        node_violations.is_empty(),
        "the node needed rights the file does not give: {node_violations:#?}"
    );

    // No credentials, a wrong password, the node's password for the edge user:
    // all locked out.
    assert_locked_out(options(&url, |_| {}), "anonymous").await;
    assert_locked_out(
        options(&url, |o| {
            o.user = Some("ankusa-edge".into());
            o.password = Some("guess".into());
        }),
        "wrong-password",
    )
    .await;
    assert_locked_out(
        options(&url, |o| {
            o.user = Some("ankusa-edge".into());
            o.password = Some(NODE_PASSWORD.into());
        }),
        "crossed-password",
    )
    .await;

    // Authenticated, but without publish rights on the shard subjects: the
    // request is dropped by the server, so no answer can ever come.
    let intruder = edge_as(&url, "intruder", "intruder-pw").await;
    for i in 0..3 {
        let got = intruder
            .hit(hit("acme", &format!("intrude-{i}"), "x"), T)
            .await;
        assert!(
            matches!(got, Err(StoreError::Timeout(_))),
            "an intruder got {got:?}"
        );
    }
    // Nor did its attempts leave a trace: the key is still free for the real edge.
    assert_eq!(
        edge.hit(hit("acme", "intrude-0", "h"), T).await,
        Ok(HitOutcome::Ok)
    );

    // The edge user cannot pose as a node: its subscription to a shard subject
    // is refused and it never sees a request, while the real node answers.
    let impostor = raw_edge_user(&url).await;
    let shard = ankusa_bus::shard_of("acme", SHARDS);
    let mut stolen = impostor
        .subscribe(format!("ankusa.{INSTANCE}.shard.{shard}"))
        .await
        .expect("subscribe is sent (the server refuses it)");
    // Nor may it write the instance's KV: a forged lease, a forged claim.
    impostor
        .publish(
            format!("$KV.ankusa_{INSTANCE}_leases.s.{shard}"),
            "mine".into(),
        )
        .await
        .expect("publish is sent (the server drops it)");
    impostor
        .publish(
            format!("$KV.ankusa_{INSTANCE}_state.c.{shard}.forged"),
            "x".into(),
        )
        .await
        .expect("publish is sent (the server drops it)");
    // Nor may it have the node write there for it, naming a bucket's key as
    // the reply subject of a request: the node answers no `$` subject.
    let forged_key = format!("c.{shard}.forged-by-reply");
    for (subject, reply) in [
        (
            format!("ankusa.{INSTANCE}.shard.{shard}"),
            format!("$KV.ankusa_{INSTANCE}_state.{forged_key}"),
        ),
        (
            format!("ankusa.{INSTANCE}.node.secure"),
            format!("$KV.ankusa_{INSTANCE}_leases.s.{shard}"),
        ),
    ] {
        impostor
            .publish_with_reply(subject, reply, "not a request".into())
            .await
            .expect("publish is sent");
    }
    impostor.flush().await.expect("flush");
    let reserved = "ankusa_requests_refused_total{code=\"reserved_reply_subject\"}";
    let _ = wait_until(Duration::from_secs(5), || async {
        node.metric(reserved).await.unwrap_or(0.0) >= 2.0
    })
    .await;
    assert_eq!(
        node.metric(reserved).await,
        Some(2.0),
        "requests answering into a bucket were not refused"
    );
    let as_node = async_nats::ConnectOptions::with_user_and_password(
        "ankusa-node".into(),
        NODE_PASSWORD.into(),
    )
    .custom_inbox_prefix(NODE_INBOX_PREFIX)
    .connect(&url)
    .await
    .expect("the node user connects");
    let state = async_nats::jetstream::new(as_node)
        .get_key_value(format!("ankusa_{INSTANCE}_state"))
        .await
        .expect("the state bucket opens");
    assert_eq!(
        state.get(&forged_key).await.expect("a read of the state"),
        None,
        "a reply was written into the state bucket"
    );
    assert_eq!(
        edge.hit(hit("acme", "evt-after-impostor", "h"), T).await,
        Ok(HitOutcome::Ok)
    );
    let heard = tokio::time::timeout(Duration::from_millis(300), stolen.next()).await;
    assert!(
        !matches!(heard, Ok(Some(_))),
        "the edge user received a request meant for a node"
    );
    // The server says why, for the operator.
    let log = violations(&nats).join("\n");
    for what in [
        format!("user:intruder\" - Publish Violation - Subject \"ankusa.{INSTANCE}.shard.{shard}\""),
        format!("user:ankusa-edge\" - Subscription Violation - Subject \"ankusa.{INSTANCE}.shard.{shard}\""),
        format!("user:ankusa-edge\" - Publish Violation - Subject \"$KV.ankusa_{INSTANCE}_leases.s.{shard}\""),
        format!("user:ankusa-edge\" - Publish Violation - Subject \"$KV.ankusa_{INSTANCE}_state.c.{shard}.forged\""),
    ] {
        assert!(
            log.contains(&what),
            "not logged: {what}\n{}",
            nats.log_tail(30)
        );
    }
    // And the node kept its lease through all of it.
    assert!(node.is_ready().await, "{}", node.log_tail(20));

    // A graceful stop hands the leases back and says goodbye in KV: within the
    // file's rights as well.
    node.stop().await.expect("node stops");
    let node_violations: Vec<_> = violations(&nats)
        .into_iter()
        .filter(|l| l.contains("user:ankusa-node"))
        .collect();
    assert!(
        node_violations.is_empty(),
        "the node needed rights the file does not give: {node_violations:#?}"
    );
    let log = node.log();
    assert!(
        log.contains("node left the fleet")
            && !log.contains("lease release failed")
            && !log.contains("could not withdraw heartbeat"),
        "no clean leave: {}",
        node.log_tail(20)
    );

    // The next node loads every shard, claims and all, from KV: evt-1 is
    // still a duplicate, and none of what the load read reached the edge user.
    let mut successor = fleet_node_as_node_user("secure-2", &url).await;
    assert_eq!(
        edge.hit(hit("acme", "evt-1", "h3"), T).await,
        Ok(HitOutcome::Duplicate {
            hook_id: "h1".into()
        })
    );
    successor.stop().await.expect("node stops");
    spy.flush().await.expect("flush");
    listening.iter().for_each(|task| task.abort());
    assert_eq!(
        leaked.load(Ordering::Relaxed),
        0,
        "the edge user read the node's shard loads"
    );
    let log = violations(&nats).join("\n");
    let refused =
        format!("user:ankusa-edge\" - Subscription Violation - Subject \"{NODE_INBOX_PREFIX}.>\"");
    assert!(log.contains(&refused), "not logged: {refused}\n{log}");
    assert!(
        !log.contains("user:ankusa-node"),
        "the node needed rights the file does not give: {log}"
    );
}

/// A node that heartbeats but cannot load (here: its NATS user may not make
/// a consumer on the state stream) would keep the shards rendezvous hashing
/// gives it unserved for good. Holding none, its loads failing for three
/// lease TTLs (at least 10 s), it steps aside: out of the live nodes, not
/// ready, trying a load from time to time; the other node serves every shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_cannot_load_steps_aside_for_the_others() {
    let conf = permissions_conf(
        r#"    { user = "no-loads", password = "no-loads-pw", permissions = $ANKUSA_NO_LOADS_PERMISSIONS }"#,
    );
    // The node's own permissions, less the consumers that load the state bucket.
    let start = conf
        .find("ANKUSA_NODE_PERMISSIONS = {")
        .expect("the node's permissions");
    let end = start + conf[start..].find("\n}\n").expect("their end") + 3;
    let no_loads = conf[start..end]
        .replace("ANKUSA_NODE_PERMISSIONS", "ANKUSA_NO_LOADS_PERMISSIONS")
        .lines()
        .filter(|line| !line.contains("CONSUMER.CREATE.KV_ankusa_prod_state"))
        .collect::<Vec<_>>()
        .join("\n");
    let conf = conf.replacen(
        "authorization {",
        &format!("{no_loads}\n\nauthorization {{"),
        1,
    );
    let nats = NatsServer::start_with(ServerConfig::new().append(&conf))
        .await
        .expect("nats-server with the deploy permissions starts");
    let url = nats.url();

    let healthy = fleet_node_as_node_user("healthy", &url).await;
    let mut spec = node_spec(
        "no-loads",
        &url,
        "fleet",
        &[
            "--nats-user",
            "no-loads",
            "--nats-password",
            "no-loads-pw",
            "--nats-inbox-prefix",
            NODE_INBOX_PREFIX,
        ],
    );
    spec.lease_ttl_ms = 2_000;
    let no_loads = NodeProcess::start(spec).expect("node starts");

    let stepped_aside = wait_until(Duration::from_secs(60), || async {
        no_loads.metric("ankusa_steps_aside_total").await == Some(1.0)
            && healthy.metric("ankusa_shards_owned").await == Some(SHARDS as f64)
    })
    .await;
    assert!(
        stepped_aside.is_ok(),
        "the healthy node serves {:?} of {SHARDS}; the other: {}",
        healthy.metric("ankusa_shards_owned").await,
        no_loads.log_tail(20)
    );
    let (status, why) = no_loads.http("/readyz").await.expect("readyz");
    assert_eq!(status, 503);
    assert!(why.contains("stepped aside"), "{why}");
    assert_eq!(no_loads.metric("ankusa_shards_owned").await, Some(0.0));
    // Every tenant is answered by the fleet, wherever its shard is.
    let edge = edge_as(&url, "ankusa-edge", EDGE_PASSWORD).await;
    for i in 0..32 {
        let tenant = format!("tenant-{i}");
        round_trip(&edge, &tenant, "evt-1", Duration::from_secs(2)).await;
    }
    assert!(
        healthy.is_ready().await,
        "{}",
        healthy
            .http("/readyz")
            .await
            .map(|(_, why)| why)
            .unwrap_or_default()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_and_nkey_authentication() {
    // Token.
    let nats = NatsServer::start_with(
        ServerConfig::new().append("authorization { token: \"tok-0008-secret\" }"),
    )
    .await
    .expect("nats-server with a token starts");
    let url = nats.url();
    let _node = start_node(node_spec(
        "token",
        &url,
        "standalone",
        &["--nats-token", "tok-0008-secret"],
    ))
    .await;
    let edge = connected(options(&url, |o| o.token = Some("tok-0008-secret".into()))).await;
    round_trip(&edge, "acme", "tok-1", T).await;
    assert_locked_out(
        options(&url, |o| o.token = Some("wrong".into())),
        "wrong-token",
    )
    .await;
    assert_locked_out(options(&url, |_| {}), "no-token").await;

    // Nkeys: the server knows only public keys; the clients hold the seeds.
    let node_key = nkeys::KeyPair::new_user();
    let edge_key = nkeys::KeyPair::new_user();
    let stranger = nkeys::KeyPair::new_user();
    let nats = NatsServer::start_with(ServerConfig::new().append(&format!(
        "authorization {{ users = [ {{ nkey: \"{}\" }}, {{ nkey: \"{}\" }} ] }}",
        node_key.public_key(),
        edge_key.public_key()
    )))
    .await
    .expect("nats-server with nkeys starts");
    let url = nats.url();
    let seed = |k: &nkeys::KeyPair| k.seed().expect("a user key has a seed");
    let _node = start_node(node_spec(
        "nkey",
        &url,
        "standalone",
        &["--nats-nkey-seed", &seed(&node_key)],
    ))
    .await;
    let edge = connected(options(&url, |o| o.nkey_seed = Some(seed(&edge_key)))).await;
    round_trip(&edge, "acme", "nkey-1", T).await;
    assert_locked_out(
        options(&url, |o| o.nkey_seed = Some(seed(&stranger))),
        "unknown-nkey",
    )
    .await;
}

/// A private CA and, signed by it, a server certificate for 127.0.0.1 and client
/// certificates, as PEM files in `dir`.
struct Pki {
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
    /// A client certificate from another CA.
    rogue_cert: PathBuf,
    rogue_key: PathBuf,
}

fn make_ca(name: &str) -> (rcgen::Certificate, rcgen::Issuer<'static, rcgen::KeyPair>) {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let key = rcgen::KeyPair::generate().expect("CA key");
    let cert = params.self_signed(&key).expect("CA certificate");
    (cert, rcgen::Issuer::new(params, key))
}

fn make_leaf(
    issuer: &rcgen::Issuer<'static, rcgen::KeyPair>,
    names: &[&str],
    usage: rcgen::ExtendedKeyUsagePurpose,
    dir: &Path,
    stem: &str,
) -> (PathBuf, PathBuf) {
    let mut params =
        rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .expect("params");
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, stem);
    params.extended_key_usages = vec![usage];
    params.use_authority_key_identifier_extension = true;
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = params.signed_by(&key, issuer).expect("signed certificate");
    let cert_path = dir.join(format!("{stem}.pem"));
    let key_path = dir.join(format!("{stem}-key.pem"));
    std::fs::write(&cert_path, cert.pem()).expect("write cert");
    std::fs::write(&key_path, key.serialize_pem()).expect("write key");
    (cert_path, key_path)
}

fn make_pki(dir: &Path) -> Pki {
    let (ca_cert, ca) = make_ca("ankusa test CA");
    let ca_path = dir.join("ca.pem");
    std::fs::write(&ca_path, ca_cert.pem()).expect("write CA");
    let (server_cert, server_key) = make_leaf(
        &ca,
        &["127.0.0.1", "localhost"],
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        dir,
        "server",
    );
    let (client_cert, client_key) = make_leaf(
        &ca,
        &["ankusa-client"],
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        dir,
        "client",
    );
    let (_, rogue_ca) = make_ca("someone else's CA");
    let (rogue_cert, rogue_key) = make_leaf(
        &rogue_ca,
        &["rogue"],
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        dir,
        "rogue",
    );
    Pki {
        ca: ca_path,
        server_cert,
        server_key,
        client_cert,
        client_key,
        rogue_cert,
        rogue_key,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_private_ca_and_client_certificates() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = make_pki(dir.path());
    let path = |p: &Path| p.display().to_string();

    // The server requires TLS and verifies client certificates against the CA.
    let nats = NatsServer::start_with(ServerConfig::new().append(&format!(
        "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: true\n  timeout: 2\n}}",
        path(&pki.server_cert),
        path(&pki.server_key),
        path(&pki.ca)
    )))
    .await
    .expect("nats-server with TLS starts");
    let url = nats.url();

    let _node = start_node(node_spec(
        "tls",
        &url,
        "standalone",
        &[
            "--nats-tls-ca",
            &path(&pki.ca),
            "--nats-tls-cert",
            &path(&pki.client_cert),
            "--nats-tls-key",
            &path(&pki.client_key),
            "--nats-require-tls",
            "true",
        ],
    ))
    .await;

    let with_cert = |o: &mut NatsOptions| {
        o.tls_ca = Some(pki.ca.clone());
        o.tls_cert = Some(pki.client_cert.clone());
        o.tls_key = Some(pki.client_key.clone());
        o.require_tls = true;
    };
    let edge = connected(options(&url, with_cert)).await;
    round_trip(&edge, "acme", "tls-1", T).await;

    // Trusting the CA is not enough: the server wants a client certificate.
    assert_locked_out(
        options(&url, |o| {
            o.tls_ca = Some(pki.ca.clone());
            o.require_tls = true;
        }),
        "no-client-cert",
    )
    .await;
    // A client certificate from another CA is refused.
    assert_locked_out(
        options(&url, |o| {
            o.tls_ca = Some(pki.ca.clone());
            o.tls_cert = Some(pki.rogue_cert.clone());
            o.tls_key = Some(pki.rogue_key.clone());
            o.require_tls = true;
        }),
        "rogue-client-cert",
    )
    .await;
    // And a client that does not trust the private CA will not talk to the
    // server (it cannot tell it from an impostor).
    assert_locked_out(
        options(&url, |o| {
            o.tls_cert = Some(pki.client_cert.clone());
            o.tls_key = Some(pki.client_key.clone());
            o.require_tls = true;
        }),
        "untrusted-server",
    )
    .await;
}
