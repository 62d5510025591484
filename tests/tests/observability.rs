//! What an operator sees: a fleet node's `/metrics` (Prometheus text),
//! `/healthz` and `/readyz`, scraped while it serves and after NATS goes away.

use std::time::Duration;

use ankusa_actors::{HitOutcome, HitRequest, Settlement};
use ankusa_bus::protocol::{Op, Request};
use ankusa_bus::{FleetConfig, FleetStore, NatsOptions, Store, Subjects};
use ankusa_tests::requests::{claim, hit, hooks, settle};
use ankusa_tests::{cargo_bin, read_repo_file, wait_until, NatsServer, NodeProcess, NodeSpec};

const T: Duration = Duration::from_millis(1000);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_health_and_readiness() {
    let mut nats = NatsServer::start().await.expect("nats");
    let node = NodeProcess::start(NodeSpec::fleet("watched", vec![nats.url()])).expect("node");
    let alive = wait_until(Duration::from_secs(20), || async {
        matches!(node.http("/healthz").await, Ok((200, _)))
    })
    .await;
    assert!(
        alive.is_ok(),
        "healthz never answered:\n{}",
        node.log_tail(20)
    );
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("ready");
    let (status, body) = node.http("/readyz").await.expect("readyz");
    assert_eq!((status, body.trim()), (200, "ready: serving 16 shards"));

    let mut config = FleetConfig::new(NatsOptions::with_servers([nats.url()]), "test");
    config.shards = 16;
    let store = FleetStore::connect(config).await.expect("config");
    wait_until(Duration::from_secs(5), || async {
        store.nats().connection_state() == async_nats::connection::State::Connected
    })
    .await
    .expect("edge connects");
    assert_eq!(
        store.hit(hit("acme", "k", "h1"), T).await,
        Ok(HitOutcome::Ok)
    );
    store
        .settle(settle("acme", "k", "h1", Settlement::Commit), T)
        .await
        .expect("settled");
    assert!(matches!(
        store.hit(hit("acme", "k", "h2"), T).await,
        Ok(HitOutcome::Duplicate { .. })
    ));
    let tight = |key: &str| HitRequest {
        charges: vec![hooks("acme", 1, 60_000)],
        claim: Some(claim("acme", key, key)),
    };
    assert_eq!(store.hit(tight("t1"), T).await, Ok(HitOutcome::Ok));
    assert!(matches!(
        store.hit(tight("t2"), T).await,
        Ok(HitOutcome::RateLimited { .. })
    ));
    let client = nats.connect().await.expect("connect");
    let subject = Subjects::new("test")
        .unwrap()
        .shard(ankusa_bus::shard_of("acme", 16));
    let expired = Request::new(0, Op::Hit(hit("acme", "late", "h")));
    client
        .request(subject, expired.encode().into())
        .await
        .expect("answered");

    // Some gauges refresh on a tick of their own: scraped until every line
    // is there (bounded), then each checked on the last scrape.
    let expected = [
        "ankusa_requests_total{result=\"ok\"}",
        "ankusa_requests_total{result=\"duplicate\"}",
        "ankusa_requests_total{result=\"rate_limited\"}",
        "ankusa_requests_total{result=\"settled\"}",
        "ankusa_requests_refused_total{code=\"deadline_expired\"} 1",
        // Every code is exported from the start, for alerts on `increase()`.
        "ankusa_requests_refused_total{code=\"overloaded\"} 0",
        // Counts, in buckets of counts.
        "ankusa_claim_log_batch_bucket{le=\"4\"}",
        "ankusa_request_duration_seconds_bucket{op=\"hit\"",
        "ankusa_request_duration_seconds_count{op=\"settle\"}",
        "ankusa_kv_write_seconds_bucket",
        "ankusa_kv_flush_buckets",
        "ankusa_shards_owned 16",
        "ankusa_shards_target 16",
        "ankusa_tenants_active 1",
        "ankusa_claims 2",
        "ankusa_lease_renew_failures_total 0",
        "ankusa_nats_connected 1",
        "# HELP ankusa_claims",
    ];
    let last = std::cell::RefCell::new(String::new());
    let all_there = wait_until(Duration::from_secs(10), || async {
        match node.http("/metrics").await {
            Ok((200, body)) => {
                let complete = expected.iter().all(|line| body.contains(line));
                *last.borrow_mut() = body;
                complete
            }
            _ => false,
        }
    })
    .await;
    println!("/metrics had every expected line after {all_there:?}");
    let metrics = last.into_inner();
    for line in expected {
        assert!(
            metrics.contains(line),
            "no `{line}` in /metrics:\n{metrics}"
        );
    }

    // What operators are told to watch is what a node exports: every metric
    // in the alerting rules, the dashboard and the operations guide's table.
    let dashboard = read_repo_file("deploy/grafana/ankusa-fleet.json");
    let alerts = read_repo_file("deploy/prometheus/alerts.yml");
    check_queries("the dashboard", dashboard_queries(&dashboard), 20);
    check_queries("the alerting rules", alert_queries(&alerts), 10);
    for (source, text) in [
        ("deploy/prometheus/alerts.yml", alerts),
        ("deploy/grafana/ankusa-fleet.json", dashboard),
        ("docs/operations.md", read_repo_file("docs/operations.md")),
    ] {
        let named = metric_names(&text);
        assert!(named.len() >= 10, "{source} names only {named:?}");
        let missing: Vec<_> = named
            .iter()
            .filter(|name| !metrics.contains(&format!("# TYPE {name} ")))
            .collect();
        assert!(
            missing.is_empty(),
            "{source} names metrics the node does not export: {missing:?}\n{metrics}"
        );
    }

    // Without NATS the node is alive but not ready.
    nats.stop().await.expect("nats stops");
    let unready = wait_until(Duration::from_secs(10), || async {
        matches!(node.http("/readyz").await, Ok((503, body)) if body.contains("not connected"))
    })
    .await;
    assert!(unready.is_ok(), "readyz stayed ready without NATS");
    assert_eq!(node.http("/healthz").await.expect("healthz").0, 200);
}

/// `ankusa status --json` against the instance of `node`, bounded at 20 s.
async fn fleet_status(nats: &NatsServer, node: &NodeProcess) -> serde_json::Value {
    let out = run_status(nats, node, node.spec.shards).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("`status --json` prints JSON")
}

/// `ankusa status --json` with `--shards shards`.
async fn run_status(nats: &NatsServer, node: &NodeProcess, shards: u32) -> std::process::Output {
    let run = tokio::process::Command::new(cargo_bin("ankusa"))
        .args(["--nats", &nats.url(), "--instance", &node.spec.instance])
        .args(["--shards", &shards.to_string()])
        .args(["status", "--json"])
        .env_remove("ANKUSA_NATS")
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("`ankusa status` answers within 20 s")
        .expect("ankusa runs")
}

/// Whether every listed node's gauges say it is connected and owns the
/// shards the map gives it.
fn gauges_match_the_map(status: &serde_json::Value) -> bool {
    let Some(nodes) = status["nodes"].as_array() else {
        return false;
    };
    nodes.iter().all(|node| {
        let leased = node["shards"].as_array().map(Vec::len);
        node["metrics_error"].is_null()
            && node["gauges"]["nats_connected"] == 1.0
            && node["gauges"]["shards_owned"].as_f64() == leased.map(|n| n as f64)
    })
}

/// Each listed node's name, with its leased shards.
fn leased_shards(status: &serde_json::Value) -> Vec<(String, Vec<u64>)> {
    let nodes = status["nodes"].as_array().expect("nodes");
    nodes
        .iter()
        .map(|n| {
            let shards = n["shards"].as_array().expect("shards");
            let shards = shards.iter().map(|s| s.as_u64().expect("shard")).collect();
            (n["node"].as_str().expect("node").to_string(), shards)
        })
        .collect()
}

/// `ankusa status`, the operator's view: every live node with the shards it
/// leases and its gauges; a node whose HTTP endpoint is silent is still
/// listed, with why its gauges are missing; once its heartbeat and leases
/// lapse, it is gone and its shards are the other node's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_shard_map_each_nodes_gauges_and_a_silent_node() {
    let nats = NatsServer::start().await.expect("nats");
    // Leases (and heartbeats) of 5 s: a paused node is still listed while
    // `status` runs.
    let spec = |id: &str| NodeSpec {
        lease_ttl_ms: 5_000,
        lease_renew_ms: 1_000,
        lease_margin_ms: 1_000,
        ..NodeSpec::fleet(id, vec![nats.url()])
    };
    let first = NodeProcess::start(spec("status-a")).expect("node a");
    let mut second = NodeProcess::start(spec("status-b")).expect("node b");
    for node in [&first, &second] {
        node.wait_ready(Duration::from_secs(30))
            .await
            .unwrap_or_else(|why| panic!("{why}\n{}", node.log_tail(20)));
    }
    // Both nodes serve once the shards are split between them.
    let split = wait_until(Duration::from_secs(30), || async {
        let status = fleet_status(&nats, &first).await;
        let leased = leased_shards(&status);
        leased.len() == 2 && leased.iter().all(|(_, shards)| !shards.is_empty())
    })
    .await;
    assert!(split.is_ok(), "the shards were never split");
    // The gauges are published on a tick: asked again (bounded) until every
    // node's gauges agree with the map, then each part checked on the last
    // answer.
    let last = std::cell::RefCell::new(serde_json::Value::Null);
    let agreed = wait_until(Duration::from_secs(10), || async {
        let status = fleet_status(&nats, &first).await;
        let matched = gauges_match_the_map(&status);
        *last.borrow_mut() = status;
        matched
    })
    .await;
    println!("the gauges matched the shard map after {agreed:?}");
    let status = last.into_inner();
    let leased = leased_shards(&status);
    let names: Vec<&str> = leased.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["status-a", "status-b"], "{status:#}");
    let mut every: Vec<u64> = leased.iter().flat_map(|(_, s)| s.clone()).collect();
    every.sort_unstable();
    assert_eq!(every, (0..16).collect::<Vec<u64>>(), "{status:#}");
    assert_eq!(status["unowned"], serde_json::json!([]), "{status:#}");
    assert_eq!(
        status["held_by_unknown"],
        serde_json::json!({}),
        "{status:#}"
    );
    for (node, (_, shards)) in status["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .zip(&leased)
    {
        assert!(node["metrics_error"].is_null(), "{node:#}");
        assert_eq!(node["gauges"]["nats_connected"], 1.0, "{node:#}");
        assert_eq!(
            node["gauges"]["shards_owned"].as_f64(),
            Some(shards.len() as f64),
            "{node:#}"
        );
    }

    // Asked with another shard count than the nodes', it says so rather than
    // draw a map that leaves shards out.
    let wrong = run_status(&nats, &first, 64).await;
    let said = String::from_utf8_lossy(&wrong.stderr);
    assert!(
        !wrong.status.success() && said.contains("serves 16 shards, not --shards 64"),
        "{wrong:?}"
    );

    // A stopped process: its heartbeat still stands, its endpoint is silent.
    second.pause().expect("pause node b");
    let asked = std::time::Instant::now();
    let status = fleet_status(&nats, &first).await;
    let took = asked.elapsed();
    let silent = status["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["node"] == "status-b")
        .unwrap_or_else(|| panic!("node b is gone at once: {status:#}"));
    let why = silent["metrics_error"].as_str().unwrap_or_default();
    assert!(why.contains("no answer within"), "{status:#}");
    assert!(silent["gauges"]["shards_owned"].is_null(), "{status:#}");
    assert!(took < Duration::from_secs(10), "status took {took:?}");

    // Once its heartbeat and leases lapse, node a serves every shard.
    let taken_over = wait_until(Duration::from_secs(30), || async {
        let status = fleet_status(&nats, &first).await;
        let leased = leased_shards(&status);
        leased.len() == 1
            && leased[0].0 == "status-a"
            && leased[0].1.len() == 16
            && status["unowned"] == serde_json::json!([])
    })
    .await;
    second.resume().expect("resume node b");
    assert!(
        taken_over.is_ok(),
        "node a never held every shard: {:#}",
        fleet_status(&nats, &first).await
    );
}

/// The queries of the dashboard (JSON Grafana imports): every panel but a
/// row queries something, and only the fleet chosen in its `job` variable.
fn dashboard_queries(text: &str) -> Vec<String> {
    let dashboard: serde_json::Value = serde_json::from_str(text).expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut queries = Vec::new();
    for panel in panels.iter().filter(|p| p["type"] != "row") {
        let exprs: Vec<&str> = panel["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t["expr"].as_str())
            .collect();
        assert!(
            !exprs.is_empty(),
            "panel {} queries nothing",
            panel["title"]
        );
        for expr in exprs {
            assert!(
                expr.contains("job=~\"$job\""),
                "panel {}: {expr} is not limited to the chosen fleet",
                panel["title"]
            );
            // What Grafana puts in place of its variables before querying.
            queries.push(
                expr.replace("$__rate_interval", "1m")
                    .replace("$job", "ankusa"),
            );
        }
    }
    queries
}

/// The `expr` of every rule in the alerting rules file.
fn alert_queries(text: &str) -> Vec<String> {
    let rules: serde_yaml_ng::Value = serde_yaml_ng::from_str(text).expect("the rules are YAML");
    let groups = rules["groups"].as_sequence().expect("groups");
    groups
        .iter()
        .flat_map(|group| group["rules"].as_sequence().expect("rules").iter())
        .map(|rule| {
            rule["expr"]
                .as_str()
                .expect("each rule has an expr")
                .to_string()
        })
        .collect()
}

/// Every query is PromQL Prometheus would accept, and there are at least `min`.
fn check_queries(source: &str, queries: Vec<String>, min: usize) {
    assert!(
        queries.len() >= min,
        "{source} has only {} queries",
        queries.len()
    );
    for query in &queries {
        if let Err(err) = promql_parser::parser::parse(query) {
            panic!("{source}: `{query}` is not PromQL: {err}");
        }
    }
}

/// The `ankusa_*` metric names in `text`, a histogram's series
/// (`_bucket`, `_sum`, `_count`) by the histogram's name.
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("ankusa_") && word.len() > "ankusa_".len())
        .map(|word| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| word.strip_suffix(suffix))
                .unwrap_or(word)
                .to_string()
        })
        .collect()
}
