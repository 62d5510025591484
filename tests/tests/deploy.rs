//! The files under `deploy/` and the configuration reference work as shipped:
//!
//! - `deploy/config/node.toml` and the node.toml of `deploy/k8s/configmap.yaml` load
//!   with `NodeConfig::load` and validate; the example file names every setting and
//!   its values are the defaults it says they are;
//! - every flag and environment variable of `ankusa-node --help`, and every TOML
//!   key, appears in `docs/configuration.md`, so the reference cannot drift;
//! - the 3-server JetStream cluster of `deploy/nats/cluster/n{1,2,3}.conf` (only
//!   its ports moved to free ones, its store dirs into a temp dir) carries three
//!   nodes with `--kv-replicas 3`: every shard serves, and keeps serving, with its
//!   committed claims, after one NATS server is killed.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use ankusa_actors::{HitOutcome, HitRequest, SettleOutcome, Settlement};
use ankusa_bus::{shard_of, FleetConfig, FleetStore, NatsOptions, Store};
use ankusa_node::config::{NodeConfig, Overrides};
use ankusa_tests::permissions::NODE_INBOX_PREFIX;
use ankusa_tests::requests::{claim, hit, settle};
use ankusa_tests::{cargo_bin, free_port, nats_server_bin, wait_until, ChildProcess};
use ankusa_tests::{read_repo_file, workspace_root, NodeProcess, NodeSpec};
use serde::de::IgnoredAny;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The field names a value serializes with (struct fields, in order of the map).
fn field_names<T: serde::Serialize>(value: &T) -> Vec<String> {
    let bytes = rmp_serde::to_vec_named(value).expect("serializes");
    let map: BTreeMap<String, IgnoredAny> = rmp_serde::from_slice(&bytes).expect("a map");
    map.into_keys().collect()
}

// ---------------------------------------------------------------------------------
// node.toml
// ---------------------------------------------------------------------------------

#[test]
fn example_node_toml_loads_validates_and_holds_the_defaults() {
    let path = workspace_root().join("deploy/config/node.toml");
    let loaded = NodeConfig::load(Some(&path), &Overrides::default())
        .unwrap_or_else(|e| panic!("deploy/config/node.toml: {e}"));
    loaded.validate().expect("validates");
    // Its values are the defaults (node_id is left to the default on purpose),
    // but for the node's own inbox, which deploy/nats/permissions.conf requires.
    let mut defaults = NodeConfig {
        node_id: loaded.node_id.clone(),
        ..NodeConfig::default()
    };
    defaults.nats.inbox_prefix = Some(NODE_INBOX_PREFIX.into());
    assert_eq!(
        loaded, defaults,
        "the file's values drifted from the defaults"
    );

    // Every setting is there, set or commented out.
    let text = read_repo_file("deploy/config/node.toml");
    let has_key = |key: &str| {
        text.lines().any(|l| {
            let l = l.trim_start_matches(['#', ' ']);
            l.strip_prefix(key)
                .is_some_and(|rest| rest.trim_start().starts_with('='))
        })
    };
    for key in field_names(&NodeConfig::default())
        .into_iter()
        .filter(|k| k != "nats")
        .chain(field_names(&NatsOptions::default()))
    {
        assert!(
            has_key(&key),
            "deploy/config/node.toml does not mention `{key}`"
        );
    }
    assert!(text.contains("[nats]"));
}

#[test]
fn k8s_configmap_node_toml_loads_and_validates() {
    let yaml = read_repo_file("deploy/k8s/configmap.yaml");
    // The block scalar under `node.toml: |`, indented 4 spaces.
    let mut lines = yaml
        .lines()
        .skip_while(|l| l.trim() != "node.toml: |")
        .skip(1);
    let mut toml = String::new();
    for line in lines.by_ref() {
        if !line.is_empty() && !line.starts_with("    ") {
            break;
        }
        toml.push_str(line.strip_prefix("    ").unwrap_or(line));
        toml.push('\n');
    }
    assert!(toml.contains("kv_replicas = 3"), "{toml}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("node.toml");
    std::fs::write(&path, &toml).unwrap();
    let overrides = Overrides {
        node_id: Some("ankusa-node-0".into()),
        ..Overrides::default()
    };
    let config = NodeConfig::load(Some(&path), &overrides)
        .unwrap_or_else(|e| panic!("configmap node.toml: {e}\n{toml}"));
    assert_eq!(config.kv_replicas, 3);
    assert_eq!(
        config.http_addr.map(|a| a.to_string()).as_deref(),
        Some("0.0.0.0:9464")
    );
}

// ---------------------------------------------------------------------------------
// docs/configuration.md
// ---------------------------------------------------------------------------------

#[test]
fn configuration_reference_names_every_flag_env_var_and_key() {
    let out = Command::new(cargo_bin("ankusa-node"))
        .arg("--help")
        .env_remove("ANKUSA_CONFIG")
        .output()
        .expect("ankusa-node --help runs");
    assert!(out.status.success(), "--help failed: {out:?}");
    let help = String::from_utf8_lossy(&out.stdout);
    let doc = read_repo_file("docs/configuration.md");

    let mut flags = Vec::new();
    let mut envs = Vec::new();
    for word in help.split(|c: char| c.is_whitespace() || matches!(c, ',' | '[' | ']' | '=')) {
        let word =
            word.trim_matches(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'));
        if word.starts_with("--") && word.len() > 2 && !matches!(word, "--help" | "--version") {
            flags.push(word.to_string());
        } else if word.starts_with("ANKUSA_") && !word.ends_with('_') {
            envs.push(word.to_string());
        }
    }
    assert!(
        flags.len() >= 20,
        "too few flags parsed from --help:\n{help}"
    );
    assert!(
        envs.len() >= 20,
        "too few env vars parsed from --help:\n{help}"
    );
    for flag in &flags {
        assert!(
            doc.contains(&format!("`{flag}")),
            "docs/configuration.md does not document {flag}"
        );
    }
    for env in &envs {
        assert!(
            doc.contains(&format!("`{env}`")),
            "docs/configuration.md does not document {env}"
        );
    }
    for key in field_names(&NodeConfig::default())
        .into_iter()
        .filter(|k| k != "nats")
    {
        assert!(
            doc.contains(&format!("`{key}`")),
            "docs/configuration.md does not document the key `{key}`"
        );
    }
    for key in field_names(&NatsOptions::default()) {
        assert!(
            doc.contains(&format!("`nats.{key}`")),
            "docs/configuration.md does not document the key `nats.{key}`"
        );
    }
}

// ---------------------------------------------------------------------------------
// The cluster of deploy/nats/cluster
// ---------------------------------------------------------------------------------

const SHARDS: u32 = 16;
/// Ports in deploy/nats/cluster/n<i>.conf: client, cluster (route), monitor.
const SHIPPED: [[u16; 3]; 3] = [[4222, 6222, 8222], [4223, 6223, 8223], [4224, 6224, 8224]];

struct Member {
    process: Option<ChildProcess>,
    client: u16,
    monitor: u16,
}

/// A GET on 127.0.0.1:`port`, bounded to 2 s: (status, body).
async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let request = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let req = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
        stream.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        stream.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let status = text.split_whitespace().nth(1)?.parse().ok()?;
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string());
        Some((status, body.unwrap_or_default()))
    };
    tokio::time::timeout(Duration::from_secs(2), request)
        .await
        .ok()
        .flatten()
}

/// Whether `text` names `port` after a colon as a whole number (a fresh port
/// such as 42221 must not pass for the shipped 4222).
fn mentions_port(text: &str, port: u16) -> bool {
    let needle = format!(":{port}");
    text.match_indices(&needle).any(|(at, _)| {
        !text[at + needle.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_digit())
    })
}

/// Starts n1..n3 from the shipped files, their ports replaced by free ones and run
/// from `dir` (where their relative store dirs land); waits until all are healthy.
async fn start_shipped_cluster(dir: &Path) -> Vec<Member> {
    let bin = nats_server_bin();
    let ports: Vec<[u16; 3]> = (0..3)
        .map(|_| {
            [
                free_port().unwrap(),
                free_port().unwrap(),
                free_port().unwrap(),
            ]
        })
        .collect();
    let mut members = Vec::new();
    for i in 0..3 {
        let mut text = read_repo_file(&format!("deploy/nats/cluster/n{}.conf", i + 1));
        assert!(text.contains("cluster {"), "n{} has a cluster block", i + 1);
        // Through placeholders, so that a fresh port (say 42231) is never taken
        // for a shipped one (4223) by a later replacement.
        let pairs: Vec<(u16, u16)> = SHIPPED
            .iter()
            .flatten()
            .copied()
            .zip(ports.iter().flatten().copied())
            .collect();
        for (old, _) in &pairs {
            text = text.replace(&format!("127.0.0.1:{old}"), &format!("127.0.0.1:<{old}>"));
        }
        for (old, new) in &pairs {
            text = text.replace(&format!("127.0.0.1:<{old}>"), &format!("127.0.0.1:{new}"));
        }
        for old in SHIPPED.iter().flatten() {
            assert!(
                !mentions_port(&text, *old),
                "n{}.conf uses port {old} in a way this test does not move",
                i + 1
            );
        }
        let conf = dir.join(format!("n{}.conf", i + 1));
        std::fs::write(&conf, text).unwrap();
        let mut cmd = Command::new(&bin);
        cmd.arg("-c").arg(&conf).current_dir(dir);
        let log = dir.join(format!("n{}.log", i + 1));
        let process = ChildProcess::spawn_logged(format!("nats-server n{}", i + 1), cmd, &log)
            .expect("nats-server starts");
        members.push(Member {
            process: Some(process),
            client: ports[i][0],
            monitor: ports[i][2],
        });
    }
    for (i, m) in members.iter_mut().enumerate() {
        let healthy = wait_until(Duration::from_secs(30), || async {
            matches!(http_get(m.monitor, "/healthz").await, Some((200, _)))
        })
        .await;
        if healthy.is_err() {
            let tail = m
                .process
                .as_ref()
                .map(|p| p.log_tail(30))
                .unwrap_or_default();
            panic!("n{} not healthy within 30 s:\n{tail}", i + 1);
        }
    }
    // Each store dir is where the file says, relative to the working directory.
    for i in 1..=3 {
        assert!(dir.join(format!("n{i}")).is_dir(), "store dir n{i}");
    }
    members
}

fn tenant_on(shard: u32) -> String {
    (0..)
        .map(|i| format!("tenant-{i}"))
        .find(|t| shard_of(t, SHARDS) == shard)
        .expect("some tenant hashes to every shard")
}

/// Repeats `call` until `done` holds of its result, for at most `within`.
async fn retry<T: std::fmt::Debug, F, Fut>(
    within: Duration,
    mut call: F,
    done: impl Fn(&T) -> bool,
) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let deadline = Instant::now() + within;
    loop {
        let result = call().await;
        if done(&result) || Instant::now() >= deadline {
            return result;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn replay(tenant: &str, key: &str) -> HitRequest {
    HitRequest {
        charges: Vec::new(),
        claim: Some(claim(tenant, key, "other-hook")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_cluster_carries_replicated_nodes_through_a_server_loss() {
    let dir = tempfile::Builder::new()
        .prefix("ankusa-deploy-cluster-")
        .tempdir()
        .unwrap();
    let mut members = start_shipped_cluster(dir.path()).await;
    let urls: Vec<String> = members
        .iter()
        .map(|m| format!("nats://127.0.0.1:{}", m.client))
        .collect();

    let nodes: Vec<NodeProcess> = (1..=3)
        .map(|i| {
            let mut spec = NodeSpec::fleet(&format!("node-{i}"), urls.clone());
            spec.kv_replicas = 3;
            spec.shards = SHARDS;
            NodeProcess::start(spec).expect("node starts")
        })
        .collect();
    for node in &nodes {
        node.wait_ready(Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }

    // The buckets are replicated three ways.
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(urls.clone())
        .await
        .expect("connect");
    let js = async_nats::jetstream::new(client);
    for bucket in ["state", "leases", "nodes"] {
        let mut stream = js
            .get_stream(format!("KV_ankusa_test_{bucket}"))
            .await
            .unwrap_or_else(|e| panic!("bucket {bucket}: {e}"));
        let info = stream.info().await.expect("stream info");
        assert_eq!(info.config.num_replicas, 3, "bucket {bucket}");
    }

    let mut config = FleetConfig::new(NatsOptions::with_servers(urls.clone()), "test");
    config.shards = SHARDS;
    let store = FleetStore::connect(config).await.expect("edge");
    let t = Duration::from_secs(1);

    // Every shard serves: a committed claim on each.
    for shard in 0..SHARDS {
        let tenant = tenant_on(shard);
        let got = retry(
            Duration::from_secs(10),
            || store.hit(hit(&tenant, "before", "h1"), t),
            |r| r.is_ok(),
        )
        .await;
        assert_eq!(got, Ok(HitOutcome::Ok), "shard {shard}");
        assert_eq!(
            store
                .settle(settle(&tenant, "before", "h1", Settlement::Commit), t)
                .await,
            Ok(SettleOutcome::Ok),
            "shard {shard}"
        );
    }

    // Kill one NATS server (SIGKILL): the other two are a majority.
    let started = Instant::now();
    members[0]
        .process
        .as_mut()
        .unwrap()
        .kill()
        .await
        .expect("kill n1");
    members[0].process = None;

    for shard in 0..SHARDS {
        let tenant = tenant_on(shard);
        let got = retry(
            Duration::from_secs(20),
            || store.hit(hit(&tenant, "after", "h2"), t),
            |r| r.is_ok(),
        )
        .await;
        if got != Ok(HitOutcome::Ok) {
            for n in &nodes {
                eprintln!("==== {}\n{}", n.spec.node_id, n.log_tail(40));
            }
        }
        assert_eq!(got, Ok(HitOutcome::Ok), "shard {shard} after losing n1");
        assert_eq!(
            store.hit(replay(&tenant, "before"), t).await,
            Ok(HitOutcome::Duplicate {
                hook_id: "h1".into()
            }),
            "shard {shard}: the committed claim survived"
        );
        assert_eq!(
            store
                .settle(settle(&tenant, "after", "h2", Settlement::Commit), t)
                .await,
            Ok(SettleOutcome::Ok),
            "shard {shard}: a settle after losing n1 is durable"
        );
    }
    println!(
        "every shard served again {:?} after n1 was killed",
        started.elapsed()
    );
    for node in &nodes {
        node.wait_ready(Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("after losing n1: {e}"));
    }
    drop(nodes);
    drop(members);
}
