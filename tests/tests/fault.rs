//! The fault harness: a real fleet (nats-server, or a 3-server JetStream cluster
//! with 3 KV replicas, and `ankusa-node`s in fleet mode on loopback) driven by
//! four concurrent edge clients while faults are injected one at a time, every
//! call and fault recorded in a [`History`] and the history then run through the
//! [`checker`](ankusa_tests::checker). The test fails on any violation.
//!
//! Workload per client: a hit claiming a key from a small space (so keys are
//! met again: duplicates and pendings happen), then on `Ok` a commit (mostly;
//! an uncertain commit is retried once) or a release; committed keys are hit
//! again until their short TTL passes; one tenant has a tight rate limit. One
//! of the four clients is a degrading [`Edge`], so local answers and the way
//! back to the fleet are exercised too.
//!
//! Faults, one at a time: kill -9 of a node (then a restart under the same
//! name), SIGSTOP of a node for longer than the lease TTL (a zombie) then
//! SIGCONT, two network cuts of a running node (its link to NATS goes through a
//! [`NetCut`] proxy: once blackholed then healed on the same connections, once
//! blackholed then reset and refused, then restored), SIGTERM of a node
//! (graceful handoff) then a restart, a nats-server restart (single: stop +
//! start on the same store; the cluster: one member, the meta leader), and a
//! fourth node joining. During each cut the test checks that the cut node's
//! leases all move to other nodes, and after it that the node rejoins.
//!
//! After every fault a probe hits every shard until each answers from the
//! fleet (the checker measures each fault's recovery from those calls); the
//! rest of a 3 s gap follows before the next fault.
//!
//! `ANKUSA_SOAK_SECS=<n>` repeats the fault cycle until n seconds have passed.

use std::collections::{BTreeSet, HashMap};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ankusa_actors::{Charge, Claim, HitOutcome, HitRequest, SettleRequest, Settlement};
use ankusa_bus::kv::FleetKv;
use ankusa_bus::{shard_of, Edge, EdgeConfig, FleetConfig, FleetStore, NatsOptions, Store};
use ankusa_tests::checker::{check_with_stalls, Attribution, CheckerConfig, Report};
use ankusa_tests::history::{CallResult, FaultKind, History};
use ankusa_tests::requests::{bytes, hooks};
use ankusa_tests::{
    wait_until, NatsCluster, NatsServer, NetCut, NetCutStats, NodeProcess, NodeSpec, ServerConfig,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const SHARDS: u32 = 16;
/// Every call's budget.
const CALL: Duration = Duration::from_millis(250);
/// Past its budget, a call may complete this late (tokio timers and a loaded
/// 2-core box running a nats-server, four nodes and this test).
const DEADLINE_SLACK_US: u64 = 25_000;
const LEASE_TTL_MS: u64 = 2_000;
const LEASE_RENEW_MS: u64 = 400;
const LEASE_MARGIN_MS: u64 = 500;
/// Committed claims live this long, so keys are met as duplicates and then
/// accepted again within one run.
const CLAIM_TTL_MS: u64 = 4_000;
const PENDING_TTL_MS: u64 = 3_000;
const KEYS: u32 = 100;
/// Every shard must answer again this soon after the last fault.
const RECOVERY_BOUND: Duration = Duration::from_secs(10);
/// Pause between a fault's repair and the next fault.
const GAP: Duration = Duration::from_secs(3);
/// Each client's iteration ends with this pause, so a client makes at most
/// one iteration per pause.
const ITERATION_PAUSE: Duration = Duration::from_millis(2);
/// What the iteration cap allows for a fault cycle (one takes about 40 s).
const CYCLE_ALLOWANCE: Duration = Duration::from_secs(120);
/// The node whose link to NATS runs through the [`NetCut`] proxy.
const CUT_NODE: &str = "node-c";
/// The node that runs on a pool of worker threads.
const POOL_NODE: &str = "node-b";
/// How long a network cut lasts: three lease TTLs, so the node's leases lapse
/// and the rest of the fleet has time to take its shards over while it is cut.
const CUT: Duration = Duration::from_millis(3 * LEASE_TTL_MS);

/// The NATS side of a run.
enum Nats {
    Single(Box<NatsServer>),
    Cluster(NatsCluster),
}

impl Nats {
    fn urls(&self) -> Vec<String> {
        match self {
            Nats::Single(s) => vec![s.url()],
            Nats::Cluster(c) => c.urls(),
        }
    }

    /// Every server's log (each holds all of that server's runs).
    fn log_paths(&self) -> Vec<std::path::PathBuf> {
        match self {
            Nats::Single(s) => vec![s.log_path().to_path_buf()],
            Nats::Cluster(c) => (0..c.len())
                .map(|i| c.member(i).log_path().to_path_buf())
                .collect(),
        }
    }

    /// Names the run in its report, since both tests print theirs.
    fn label(&self) -> &'static str {
        match self {
            Nats::Single(_) => "single nats-server",
            Nats::Cluster(_) => "3-server nats cluster",
        }
    }

    /// Restarts one server; returns its name.
    async fn restart_one(&mut self) -> String {
        match self {
            Nats::Single(s) => {
                s.stop().await.expect("nats-server stops");
                s.start_again().await.expect("nats-server starts again");
                s.name().to_string()
            }
            Nats::Cluster(c) => {
                // The meta leader, once the members agree on one (they may
                // not for a moment after an earlier fault): the run restarts
                // the leader, never some other member in its place.
                let started = std::time::Instant::now();
                let leader = loop {
                    match c.meta_leader().await {
                        Ok(leader) => break leader,
                        Err(why) if started.elapsed() < Duration::from_secs(20) => {
                            eprintln!("no agreed meta leader yet: {why}");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        Err(why) => panic!("the cluster agreed on no meta leader in 20 s: {why}"),
                    }
                };
                let i = c.index_of(&leader).unwrap_or_else(|| {
                    panic!("the meta leader {leader} is no member of the cluster")
                });
                c.restart(i).await.expect("cluster member restarts");
                c.wait_ready(Duration::from_secs(20))
                    .await
                    .expect("cluster ready again");
                leader
            }
        }
    }
}

struct Fleet {
    nats: Nats,
    replicas: usize,
    nodes: Vec<NodeProcess>,
    /// Between [`CUT_NODE`] and the nats-server(s).
    cut: NetCut,
    /// The test's own view of the leases (opened once the nodes made the buckets).
    kv: Option<FleetKv>,
    /// One log per node name, kept across the node's restarts (see [`keep_logs`]).
    logs: tempfile::TempDir,
}

impl Fleet {
    fn spec(&self, id: &str) -> NodeSpec {
        let servers = if id == CUT_NODE {
            self.cut.urls()
        } else {
            self.nats.urls()
        };
        // node-b runs a thread pool, the others one thread (the default), so
        // both runtimes face every fault.
        let extra_args = if id == POOL_NODE {
            vec!["--worker-threads".into(), "0".into()]
        } else {
            Vec::new()
        };
        NodeSpec {
            lease_ttl_ms: LEASE_TTL_MS,
            lease_renew_ms: LEASE_RENEW_MS,
            lease_margin_ms: LEASE_MARGIN_MS,
            kv_replicas: self.replicas,
            shards: SHARDS,
            extra_args,
            ..NodeSpec::fleet(id, servers)
        }
    }

    async fn lease_holders(&self) -> Result<HashMap<u32, String>, String> {
        match &self.kv {
            Some(kv) => lease_holders(kv).await,
            None => Err("the test's lease view is not open".into()),
        }
    }

    fn start_node(&mut self, id: &str) {
        let log = self.logs.path().join(format!("{id}.log"));
        let node = NodeProcess::start_logged(self.spec(id), &log).expect("node starts");
        match self.nodes.iter().position(|n| n.spec.node_id == id) {
            Some(i) => self.nodes[i] = node,
            None => self.nodes.push(node),
        }
    }

    fn node(&mut self, id: &str) -> &mut NodeProcess {
        self.nodes
            .iter_mut()
            .find(|n| n.spec.node_id == id)
            .expect("a node of this fleet")
    }

    /// Every node ready within `within`, or the run stops here: faults on a
    /// fleet that never formed would test nothing they claim to.
    async fn wait_all_ready(&self, within: Duration) {
        for node in &self.nodes {
            if let Err(why) = node.wait_ready(within).await {
                panic!(
                    "node {} was not ready within {within:?} of the fleet's start: {why}\n{}",
                    node.spec.node_id,
                    node.log_tail(30)
                );
            }
        }
    }
}

/// Who holds each shard's lease now, by the KV (empty if it cannot be read).
async fn lease_holders(kv: &FleetKv) -> Result<HashMap<u32, String>, String> {
    match tokio::time::timeout(Duration::from_secs(2), kv.lease_holders()).await {
        Ok(Ok(holders)) => Ok(holders),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err("listing the leases took over 2 s".into()),
    }
}

/// How many shards' leases `node` holds.
fn leases_of(holders: &HashMap<u32, String>, node: &str) -> usize {
    holders.values().filter(|n| n.as_str() == node).count()
}

/// One of the edge clients.
#[derive(Clone)]
enum Client {
    Fleet(FleetStore),
    Edge(Arc<Edge<FleetStore>>),
}

impl Client {
    async fn hit(&self, history: &History, name: &str, req: HitRequest) -> CallResult {
        let shard = shard_of(req.tenant(), SHARDS);
        let invoked = history.now();
        let result = match self {
            Client::Fleet(s) => CallResult::hit(&s.hit(req.clone(), CALL).await),
            Client::Edge(e) => CallResult::edge_hit(&e.hit(req.clone(), CALL).await),
        };
        history.record_hit(name, shard, &req, CALL, invoked, result.clone());
        result
    }

    async fn settle(&self, history: &History, name: &str, req: SettleRequest) -> CallResult {
        let shard = shard_of(&req.claim.tenant, SHARDS);
        let invoked = history.now();
        let result = match self {
            Client::Fleet(s) => CallResult::settle(&s.settle(req.clone(), CALL).await),
            Client::Edge(e) => CallResult::edge_settle(&e.settle(req.clone(), CALL).await),
        };
        history.record_settle(name, shard, &req, CALL, invoked, result.clone());
        result
    }
}

async fn fleet_store(urls: &[String]) -> FleetStore {
    let mut config = FleetConfig::new(NatsOptions::with_servers(urls.iter().cloned()), "test");
    config.shards = SHARDS;
    let store = FleetStore::connect(config).await.expect("valid config");
    wait_until(Duration::from_secs(10), || async {
        store.nats().connection_state() == async_nats::connection::State::Connected
    })
    .await
    .expect("edge connects");
    store
}

/// The tenants the workload uses: two roomy ones and one with a tight limit.
const TIGHT: &str = "tight";

fn charges(tenant: &str) -> Vec<Charge> {
    if tenant == TIGHT {
        // Bursts of 5, then one per 100 ms.
        vec![hooks(tenant, 5, 100)]
    } else {
        vec![hooks(tenant, 1000, 1), bytes(tenant)]
    }
}

fn claim(tenant: &str, key: &str, hook_id: &str, client: &str) -> Claim {
    Claim {
        tenant: tenant.into(),
        source_id: "src".into(),
        key: key.into(),
        hook_id: hook_id.into(),
        node: client.into(),
        ttl_ms: CLAIM_TTL_MS,
        pending_ttl_ms: PENDING_TTL_MS,
    }
}

fn uncertain(result: &CallResult) -> bool {
    matches!(result, CallResult::Error(kind) if !kind.certainly_not_applied())
}

/// Upper bound on the iterations one client makes, whatever the clock says:
/// the run's planned length (the soak, then one more cycle) at one iteration
/// per pause, so that the stop flag, not the cap, ends every client's loop.
fn max_iterations(soak: Option<Duration>) -> u64 {
    let planned = soak.unwrap_or_default() + CYCLE_ALLOWANCE;
    u64::try_from(planned.as_millis() / ITERATION_PAUSE.as_millis()).unwrap_or(u64::MAX)
}

/// One client's loop: until `stop`, bounded in iterations. A client that runs
/// out of iterations first is an error: its silence after the last fault would
/// read as an edge that never came back to the fleet.
async fn drive(
    client: Client,
    name: String,
    seed: u64,
    history: Arc<History>,
    stop: Arc<AtomicBool>,
    iterations: u64,
) -> Result<(), String> {
    let mut rng = StdRng::seed_from_u64(seed);
    for n in 0..iterations {
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let tenant = match rng.random_range(0..100) {
            0..45 => "acme",
            45..85 => "globex",
            _ => TIGHT,
        };
        let key = format!("k{}", rng.random_range(0..KEYS));
        let hook = format!("{name}-{n}");
        let req = HitRequest {
            charges: charges(tenant),
            claim: Some(claim(tenant, &key, &hook, &name)),
        };
        let result = client.hit(&history, &name, req.clone()).await;
        if matches!(result, CallResult::Hit(HitOutcome::Ok, _)) {
            let settlement = if rng.random_range(0..100) < 85 {
                Settlement::Commit
            } else {
                Settlement::Release
            };
            let settle = SettleRequest {
                claim: claim(tenant, &key, &hook, &name),
                settlement,
            };
            let first = client.settle(&history, &name, settle.clone()).await;
            if uncertain(&first) {
                // What a real edge does with an unanswered settle: try once more.
                tokio::time::sleep(Duration::from_millis(20)).await;
                client.settle(&history, &name, settle).await;
            }
        }
        tokio::time::sleep(ITERATION_PAUSE).await;
    }
    Err(format!(
        "{name} made all its {iterations} iterations before the run ended"
    ))
}

/// A tenant name per shard, so the probe can reach every shard.
fn probe_tenants() -> Vec<String> {
    let mut found: Vec<Option<String>> = vec![None; SHARDS as usize];
    for i in 0..100_000u32 {
        let name = format!("probe-{i}");
        let slot = &mut found[shard_of(&name, SHARDS) as usize];
        if slot.is_none() {
            *slot = Some(name);
        }
        if found.iter().all(Option::is_some) {
            break;
        }
    }
    found
        .into_iter()
        .map(|t| t.expect("every shard has a probe tenant"))
        .collect()
}

/// Hits every shard (concurrently, a round every 50 ms) until each has
/// answered from the fleet or `within` has passed, recording the calls (the
/// checker measures recovery and takeover from them). `tag` keeps the claims
/// of one probe apart from another's.
async fn probe_every_shard(client: Client, history: Arc<History>, tag: String, within: Duration) {
    let tenants = probe_tenants();
    let deadline = history.now() + within.as_micros() as u64;
    let mut pending: Vec<usize> = (0..tenants.len()).collect();
    let mut round = 0u32;
    while !pending.is_empty() && history.now() < deadline && round < 1_000 {
        round += 1;
        let calls = pending.iter().map(|&i| {
            let tenant = &tenants[i];
            let req = HitRequest {
                charges: charges(tenant),
                claim: Some(claim(
                    tenant,
                    &format!("{tag}-{round}"),
                    &format!("{tag}-{i}-{round}"),
                    "probe",
                )),
            };
            let (client, history) = (&client, &history);
            async move { (i, client.hit(history, "probe", req).await) }
        });
        pending = futures::future::join_all(calls)
            .await
            .into_iter()
            .filter(|(_, result)| result.answered().is_none())
            .map(|(i, _)| i)
            .collect();
        if !pending.is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Keeps the workload going until every client that answered locally has had
/// a fleet answer since the last fault ended, or until [`RECOVERY_BOUND`] after
/// it: a degrading edge comes back on its breaker's schedule (its backoff
/// doubles while the fleet is down), and the checker's rule that it does so
/// within the bound needs the run to last that long.
async fn wait_for_degraded_edges(history: &History) {
    use ankusa_tests::history::Answered;
    let last = history
        .faults()
        .iter()
        .filter_map(|f| f.end)
        .max()
        .unwrap_or(0);
    let until = last + RECOVERY_BOUND.as_micros() as u64;
    while history.now() < until {
        // One pass over the history, with the clients waiting on its lock.
        let all_back = history.with_events(|events| {
            let (mut degraded, mut back) = (BTreeSet::new(), BTreeSet::new());
            for e in events {
                match e.result.answered() {
                    Some(Answered::Local) => {
                        degraded.insert(e.client.as_str());
                    }
                    Some(Answered::Fleet) if e.invoked >= last => {
                        back.insert(e.client.as_str());
                    }
                    _ => {}
                }
            }
            degraded.is_subset(&back)
        });
        if all_back {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// After a fault's repair: probes every shard until each answers from the
/// fleet, then waits out the rest of the gap before the next fault.
async fn recover(history: &Arc<History>, probe: &Client, tag: String) {
    let began = tokio::time::Instant::now();
    probe_every_shard(
        probe.clone(),
        history.clone(),
        tag,
        RECOVERY_BOUND + Duration::from_secs(5),
    )
    .await;
    tokio::time::sleep(GAP.saturating_sub(began.elapsed())).await;
}

/// What one network cut showed, besides what the checker sees in the history.
#[derive(Debug)]
struct CutSeen {
    kind: FaultKind,
    /// Shards the node held when the cut began.
    held_before: usize,
    /// After the cut began: when the node reported itself disconnected from
    /// NATS (only a reset link tells it), and when no lease was the node's any
    /// more and every shard had one.
    disconnected_after: Option<Duration>,
    leases_moved_after: Option<Duration>,
    /// After the link was restored: when the node held a lease again and was
    /// ready (serving every shard it is meant to).
    rejoined_after: Option<Duration>,
    /// Leases the node counted as lost, and requests it dropped because its
    /// lease window was closed, from before the cut to its rejoining.
    leases_lost: f64,
    dropped_by_lease: f64,
    proxy: NetCutStats,
    /// When the node did not rejoin: what it said about itself then.
    diagnosis: Option<Diagnosis>,
    /// When the link was restored (the fault's end).
    restored_at: tokio::time::Instant,
}

/// What a node says about itself (readiness, lease gauges, the proxy's link,
/// its log's tail), for a failure message.
async fn diagnose(fleet: &mut Fleet, id: &str) -> String {
    let (stats, link) = (fleet.cut.stats(), fleet.cut.link());
    let node = fleet.node(id);
    let ready = node.http("/readyz").await;
    let mut gauges = Vec::new();
    for name in [
        "ankusa_shards_owned",
        "ankusa_shards_target",
        "ankusa_nats_connected",
        LEASES_LOST,
        "ankusa_lease_renew_failures_total",
    ] {
        gauges.push((name, node.metric(name).await));
    }
    format!(
        "{id}'s /readyz: {ready:?}; {gauges:?}; proxy {stats:?} (link {link:?}); log tail:\n{}",
        node.log_tail(60)
    )
}

/// A node's diagnosis, kept out of `Debug` output (it carries a log tail).
struct Diagnosis(String);

impl std::fmt::Debug for Diagnosis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<diagnosis>")
    }
}

/// A counter of a node, 0 when not exported yet (counters appear on first use).
async fn counter(node: &NodeProcess, name: &str) -> f64 {
    node.metric(name).await.unwrap_or(0.0)
}

const LEASES_LOST: &str = "ankusa_leases_lost_total";
const DROPPED_BY_LEASE: &str = "ankusa_requests_dropped_total{why=\"lease\"}";

/// Cuts [`CUT_NODE`] off from NATS for [`CUT`] (as `kind` says), while a probe
/// checks from a lease TTL into the cut that every shard is answered by the
/// rest of the fleet; restores the link, then probes every shard (recovery)
/// while waiting for the node to rejoin.
async fn net_cut(
    fleet: &mut Fleet,
    history: &Arc<History>,
    probe: &Client,
    kind: FaultKind,
    tag: String,
) -> CutSeen {
    // The cut must take shards away from the node, or it tests nothing.
    let mut held_before = 0;
    let mut seen = Err("not read yet".to_string());
    let deadline = tokio::time::Instant::now() + RECOVERY_BOUND;
    while held_before == 0 && tokio::time::Instant::now() < deadline {
        seen = fleet.lease_holders().await;
        held_before = seen.as_ref().map_or(0, |h| leases_of(h, CUT_NODE));
        if held_before == 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    if held_before == 0 {
        panic!(
            "{CUT_NODE} held no lease before the cut (for {RECOVERY_BOUND:?}); a node that holds none yet reports ready has stopped renewing and heartbeating (docs/fault-tolerance.md, \"Observed\"); the test's lease view: {seen:?}; {}",
            diagnose(fleet, CUT_NODE).await
        );
    }
    let lost_before = counter(fleet.node(CUT_NODE), LEASES_LOST).await;
    let dropped_before = counter(fleet.node(CUT_NODE), DROPPED_BY_LEASE).await;

    let f = history.fault_start(kind, CUT_NODE);
    let began = tokio::time::Instant::now();
    fleet.cut.blackhole();
    let kv = fleet.kv.clone().expect("the test's lease view is open");
    let moving = tokio::spawn(async move {
        while began.elapsed() + Duration::from_millis(100) < CUT {
            let holders = lease_holders(&kv).await.unwrap_or_default();
            if holders.len() == SHARDS as usize && leases_of(&holders, CUT_NODE) == 0 {
                return Some(began.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    });
    tokio::time::sleep(Duration::from_millis(LEASE_TTL_MS)).await;
    let taking_over = tokio::spawn(probe_every_shard(
        probe.clone(),
        history.clone(),
        tag.clone(),
        CUT.saturating_sub(began.elapsed() + Duration::from_millis(100)),
    ));
    let mut disconnected_after = None;
    if kind == FaultKind::NetCut {
        tokio::time::sleep_until(began + CUT / 2).await;
        fleet
            .cut
            .refuse()
            .await
            .expect("the proxy resets and refuses");
        let node = fleet.node(CUT_NODE);
        if wait_until(Duration::from_secs(2), || async {
            node.metric("ankusa_nats_connected").await == Some(0.0)
        })
        .await
        .is_ok()
        {
            disconnected_after = Some(began.elapsed());
        }
    }
    let leases_moved_after = moving.await.expect("lease watch");
    taking_over.await.expect("takeover probe");
    tokio::time::sleep_until(began + CUT).await;
    fleet.cut.restore().await.expect("the proxy forwards again");
    history.fault_end(f);

    // The recovery probe runs while the node rejoins, so the checker measures
    // from the repair, not from when the test stopped waiting for the node.
    let recovering = tokio::spawn(probe_every_shard(
        probe.clone(),
        history.clone(),
        format!("{tag}-after"),
        RECOVERY_BOUND + Duration::from_secs(5),
    ));
    let restored = tokio::time::Instant::now();
    let mut rejoined_after = None;
    while rejoined_after.is_none() && restored.elapsed() < RECOVERY_BOUND {
        if leases_of(&fleet.lease_holders().await.unwrap_or_default(), CUT_NODE) > 0
            && fleet.node(CUT_NODE).is_ready().await
        {
            rejoined_after = Some(restored.elapsed());
        } else {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    recovering.await.expect("recovery probe");
    let diagnosis = match rejoined_after {
        None => Some(Diagnosis(diagnose(fleet, CUT_NODE).await)),
        Some(_) => None,
    };
    let node = fleet.node(CUT_NODE);
    CutSeen {
        kind,
        held_before,
        disconnected_after,
        leases_moved_after,
        rejoined_after,
        leases_lost: counter(node, LEASES_LOST).await - lost_before,
        dropped_by_lease: counter(node, DROPPED_BY_LEASE).await - dropped_before,
        proxy: fleet.cut.stats(),
        diagnosis,
        restored_at: restored,
    }
}

/// The cut node went dark for its shards and came back: it lost its leases,
/// every one of them moved to another node while it was cut, a reset link
/// disconnected it (the proxy cannot be bypassed), and it rejoined within the
/// recovery bound.
fn assert_cut_expectations(seen: &CutSeen) {
    assert!(
        seen.rejoined_after.is_some(),
        "{:?}: {CUT_NODE} did not hold a lease and report ready within {RECOVERY_BOUND:?} of the link's restoration: {seen:?}\n{}",
        seen.kind,
        seen.diagnosis.as_ref().map_or("", |d| d.0.as_str())
    );
    assert!(
        seen.leases_moved_after.is_some(),
        "{:?}: {CUT_NODE}'s leases did not all move to other nodes within the cut: {seen:?}",
        seen.kind
    );
    assert!(
        seen.leases_lost >= 1.0,
        "{:?}: {CUT_NODE} never counted a lease as lost: {seen:?}",
        seen.kind
    );
    if seen.kind == FaultKind::NetCut {
        assert!(
            seen.disconnected_after.is_some(),
            "{CUT_NODE} still reported a NATS connection while its link was refused: {seen:?}"
        );
    }
}

fn soak() -> Option<Duration> {
    std::env::var("ANKUSA_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map(Duration::from_secs)
}

/// One cycle of faults, one at a time, each followed by a recovery probe and
/// gap. Returns what the network cuts showed.
async fn fault_cycle(
    fleet: &mut Fleet,
    history: &Arc<History>,
    probe: &Client,
    cycle: u32,
) -> Vec<CutSeen> {
    let tag = |what: &str| format!("c{cycle}-{what}");

    let f = history.fault_start(FaultKind::KillNode, "node-a");
    fleet.node("node-a").kill().await.expect("kill -9");
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    fleet.start_node("node-a");
    history.fault_end(f);
    recover(history, probe, tag("kill")).await;

    let f = history.fault_start(FaultKind::PauseNode, "node-b");
    fleet.node("node-b").pause().expect("SIGSTOP");
    // Longer than the lease TTL: its shards move while it sleeps.
    tokio::time::sleep(Duration::from_millis(LEASE_TTL_MS + 1_000)).await;
    fleet.node("node-b").resume().expect("SIGCONT");
    history.fault_end(f);
    recover(history, probe, tag("pause")).await;

    let mut cuts = Vec::new();
    for kind in [FaultKind::NetBlackhole, FaultKind::NetCut] {
        let seen = net_cut(fleet, history, probe, kind, tag(&format!("{kind:?}"))).await;
        eprintln!("{seen:?}");
        tokio::time::sleep_until(seen.restored_at + GAP).await;
        cuts.push(seen);
    }

    let f = history.fault_start(FaultKind::StopNode, "node-c");
    fleet.node("node-c").stop().await.expect("SIGTERM");
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    fleet.start_node("node-c");
    history.fault_end(f);
    recover(history, probe, tag("stop")).await;

    let f = history.fault_start(FaultKind::RestartNats, "nats");
    let name = fleet.nats.restart_one().await;
    history.fault_end(f);
    eprintln!("restarted nats server {name}");
    recover(history, probe, tag("nats")).await;

    // The fourth node joins on the first cycle; later cycles have it leave
    // (SIGTERM) and join again.
    if cycle > 0 {
        fleet.node("node-d").stop().await.expect("SIGTERM node-d");
        tokio::time::sleep(Duration::from_millis(1_000)).await;
    }
    let f = history.fault_start(FaultKind::AddNode, "node-d");
    fleet.start_node("node-d");
    history.fault_end(f);
    recover(history, probe, tag("join")).await;
    cuts
}

/// Starts the fleet, runs the workload and the faults, checks the history.
async fn run(nats: Nats, replicas: usize) -> (Report, Vec<CutSeen>) {
    let setup = std::time::Instant::now();
    let cut = NetCut::start(&nats.urls())
        .await
        .expect("net-cut proxy starts");
    let mut fleet = Fleet {
        nats,
        replicas,
        nodes: Vec::new(),
        cut,
        kv: None,
        logs: tempfile::Builder::new()
            .prefix("ankusa-fault-run-")
            .tempdir()
            .expect("a temp dir for the run's logs"),
    };
    for id in ["node-a", "node-b", "node-c"] {
        fleet.start_node(id);
    }
    fleet.wait_all_ready(Duration::from_secs(30)).await;
    let urls = fleet.nats.urls();
    let kv_client = NatsOptions::with_servers(urls.iter().cloned())
        .connect()
        .await
        .expect("valid NATS options");
    fleet.kv = Some(
        FleetKv::open(kv_client, "test", replicas)
            .await
            .expect("the nodes' KV buckets open"),
    );

    let history = Arc::new(History::new());
    let stop = Arc::new(AtomicBool::new(false));
    let monitor = history.spawn_stall_monitor(
        stop.clone(),
        Duration::from_millis(5),
        Duration::from_secs(3_600),
    );
    eprintln!("fleet ready after {:?}", setup.elapsed());
    let soak = soak();
    let mut clients = Vec::new();
    for i in 0..4u64 {
        let store = fleet_store(&urls).await;
        let client = if i == 3 {
            Client::Edge(Arc::new(Edge::new(store, EdgeConfig::default())))
        } else {
            Client::Fleet(store)
        };
        let name = if i == 3 {
            "edge-3".to_string()
        } else {
            format!("client-{i}")
        };
        clients.push(tokio::spawn(drive(
            client,
            name,
            0x5eed + i,
            history.clone(),
            stop.clone(),
            max_iterations(soak),
        )));
    }
    let probe = Client::Fleet(fleet_store(&urls).await);

    // Warm up, then the faults; each cycle ends with the recovery after its
    // last fault measured, while the workload goes on.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let began = std::time::Instant::now();
    let mut cycle = 0;
    let mut cuts = Vec::new();
    loop {
        cuts.extend(fault_cycle(&mut fleet, &history, &probe, cycle).await);
        cycle += 1;
        let more = soak.is_some_and(|s| began.elapsed() < s) && cycle < 1_000;
        if !more {
            break;
        }
    }
    wait_for_degraded_edges(&history).await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        if let Err(ran_out) = c.await.expect("client task") {
            panic!("{ran_out}: raise the cap (`max_iterations`)");
        }
    }
    monitor.join().expect("stall monitor");
    eprintln!("run done after {:?}", setup.elapsed());
    for node in &mut fleet.nodes {
        assert!(
            node.process().is_running(),
            "node {} died; log tail:\n{}",
            node.spec.node_id,
            node.log_tail(40)
        );
        // Through every fault, each life of each node kept the server's
        // time: none fell back to its host's clock.
        let log = node.log();
        assert!(
            log.contains("clock set to the NATS server's")
                && !log.contains("keeping this host's clock"),
            "node {} did not set its clock from the server:\n{}",
            node.spec.node_id,
            log.lines()
                .filter(|l| l.contains("clock"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }

    let config = CheckerConfig {
        deadline_slack: DEADLINE_SLACK_US,
        lease_ttl: LEASE_TTL_MS * 1000,
        recovery_bound: RECOVERY_BOUND.as_micros() as u64,
        shards: SHARDS,
        ..CheckerConfig::default()
    };
    let report = check_with_stalls(
        &history.events(),
        &history.faults(),
        &history.stalls(),
        &config,
    );
    let mut text = format!(
        "== fault run, {} ==\n{}\n",
        fleet.nats.label(),
        report.render()
    );
    text.push_str(&format!("network cuts of {CUT_NODE} ({CUT:?} each):\n"));
    for c in &cuts {
        let ms =
            |d: Option<Duration>| d.map_or("never".into(), |d| format!("{} ms", d.as_millis()));
        text.push_str(&format!(
            "  {:?}: held {} shards; disconnected {}, every lease moved {} after it began; rejoined {} after it ended; {} leases counted lost, {} requests dropped by lease; proxy {:?}\n",
            c.kind,
            c.held_before,
            ms(c.disconnected_after),
            ms(c.leases_moved_after),
            ms(c.rejoined_after),
            c.leases_lost,
            c.dropped_by_lease,
            c.proxy
        ));
    }
    if let Some(why) = logs_worth_keeping(&report) {
        text.push_str(&keep_logs(fleet, why));
    }
    // Written to stdout itself, past the test harness's capture of `println!`:
    // the README's test command shows the report of a passing run too. One
    // write, so the two tests' reports do not interleave.
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    (report, cuts)
}

/// Why this run's logs should outlive it, if they should: a violation, a
/// double accept the checker put down to a fault (each one is worth
/// explaining), or `ANKUSA_KEEP_LOGS=1`.
fn logs_worth_keeping(report: &Report) -> Option<&'static str> {
    if !report.violations.is_empty() {
        Some("violations")
    } else if report
        .attributed
        .iter()
        .any(|c| matches!(c.why, Attribution::Fault { .. }))
    {
        Some("double accepts in fault windows")
    } else if std::env::var("ANKUSA_KEEP_LOGS").is_ok_and(|v| v == "1") {
        Some("ANKUSA_KEEP_LOGS=1")
    } else {
        None
    }
}

/// Keeps every node's and nats-server's log of the run in a directory that
/// is not removed, and says where.
fn keep_logs(fleet: Fleet, why: &str) -> String {
    let Fleet { nats, logs, .. } = fleet;
    for (i, path) in nats.log_paths().iter().enumerate() {
        let _ = std::fs::copy(path, logs.path().join(format!("nats-server-{}.log", i + 1)));
    }
    format!("logs kept ({why}): {}\n", logs.keep().display())
}

fn assert_sound((report, cuts): &(Report, Vec<CutSeen>)) {
    assert!(
        report.is_clean(),
        "{} violations:\n{}",
        report.violations.len(),
        report.render()
    );
    // The run must actually have exercised what the rules are about.
    assert!(
        report.duplicates_checked > 0,
        "no duplicate was ever answered"
    );
    assert!(report.accepts_checked > 100, "too few accepts");
    assert!(
        report.ops_by_result.contains_key("hit:rate_limited"),
        "the tight tenant was never limited"
    );
    assert!(report.faults.len() >= 7, "faults: {:?}", report.faults);
    assert!(report.recovery_max.is_some());
    for kind in [FaultKind::NetBlackhole, FaultKind::NetCut] {
        assert!(
            report.faults.iter().any(|f| f.kind == kind),
            "no {kind:?} was injected"
        );
    }
    for seen in cuts {
        assert_cut_expectations(seen);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_lost_webhook_under_faults_single_server() {
    let nats = NatsServer::start().await.expect("nats-server starts");
    let report = run(Nats::Single(Box::new(nats)), 1).await;
    assert_sound(&report);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_lost_webhook_under_faults_three_server_cluster() {
    // A member must not advertise the others' client URLs, or the cut node's
    // client would learn them and reconnect around its proxy.
    let cluster = NatsCluster::start_with(3, ServerConfig::new().no_advertise(true))
        .await
        .expect("nats cluster starts");
    let report = run(Nats::Cluster(cluster), 3).await;
    assert_sound(&report);
}
