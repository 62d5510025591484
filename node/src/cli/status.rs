//! `ankusa status`: what the instance's KV says (live nodes from their
//! heartbeats, the shard map from the leases) and, per node whose HTTP address
//! is known and reachable, the gauges of its `/metrics`.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use ankusa_bus::kv::{within, FleetKv, Heartbeat};
use ankusa_bus::shard::{ranges, MAX_SHARDS};
use clap::Args;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{CliError, Global};

#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// Print the status as JSON
    #[arg(long)]
    pub json: bool,
}

/// The gauges `status` shows per node (absent when the node was not reachable).
#[derive(Debug, Clone, Default, Serialize)]
pub struct NodeGauges {
    pub shards_owned: Option<f64>,
    pub tenants_active: Option<f64>,
    pub tenants_parked: Option<f64>,
    pub claims: Option<f64>,
    /// KV writes published and not yet acknowledged: the persistence lag.
    pub kv_writes_in_flight: Option<f64>,
    pub nats_connected: Option<f64>,
    /// The NATS server's time minus the node's, at its last heartbeat.
    pub clock_offset_seconds: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct NodeStatus {
    pub node: String,
    pub http: Option<String>,
    pub started_ms: u64,
    /// Shards whose lease this node holds.
    pub shards: Vec<u32>,
    /// Why the gauges are missing, if they are.
    pub metrics_error: Option<String>,
    pub gauges: NodeGauges,
}

#[derive(Debug, Clone, Serialize)]
pub struct FleetStatus {
    pub instance: String,
    pub shards: u32,
    pub nodes: Vec<NodeStatus>,
    /// Shards with no lease: no node serves them now.
    pub unowned: Vec<u32>,
    /// Shards leased by a node with no live heartbeat (leaving, or stuck).
    pub held_by_unknown: BTreeMap<String, Vec<u32>>,
}

/// A bare HTTP/1.0 GET on loopback-style `host:port`, bounded by `timeout`.
/// The largest answer [`http_get`] reads.
const MAX_HTTP_ANSWER_BYTES: u64 = 16 * 1024 * 1024;

pub async fn http_get(addr: &str, path: &str, timeout: Duration) -> Result<String, String> {
    let work = async {
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("send to {addr}: {e}"))?;
        // A node's /metrics is tens of KiB; whatever answers past this is
        // not one, and is not read into memory.
        let mut body = Vec::new();
        (&mut stream)
            .take(MAX_HTTP_ANSWER_BYTES + 1)
            .read_to_end(&mut body)
            .await
            .map_err(|e| format!("read from {addr}: {e}"))?;
        if body.len() as u64 > MAX_HTTP_ANSWER_BYTES {
            return Err(format!(
                "{addr}{path}: an answer over {MAX_HTTP_ANSWER_BYTES} bytes"
            ));
        }
        let text = String::from_utf8_lossy(&body).into_owned();
        match text.split_once("\r\n\r\n") {
            // The status line's code, not a " 200" anywhere in the head
            // (a `Content-Length: 200` of an error page).
            Some((head, body))
                if head
                    .lines()
                    .next()
                    .and_then(|status| status.split(' ').nth(1))
                    == Some("200")
                    && head.starts_with("HTTP/1.") =>
            {
                Ok(body.to_string())
            }
            Some((head, _)) => Err(format!(
                "{addr}{path}: {}",
                head.lines().next().unwrap_or_default()
            )),
            None => Err(format!("{addr}{path}: not an HTTP answer")),
        }
    };
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or_else(|_| Err(format!("{addr}: no answer within {timeout:?}")))
}

/// The value of an unlabelled metric (or the sum over its label sets).
pub fn metric(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        // `name value` or `name{labels} value`, not `name_suffix ...`.
        let value = if let Some(v) = rest.strip_prefix(' ') {
            v
        } else if rest.starts_with('{') {
            match rest.rsplit_once(' ') {
                Some((_, v)) => v,
                None => continue,
            }
        } else {
            continue;
        };
        if let Ok(v) = value.trim().parse::<f64>() {
            found = Some(found.unwrap_or(0.0) + v);
        }
    }
    found
}

fn gauges(text: &str) -> NodeGauges {
    NodeGauges {
        shards_owned: metric(text, "ankusa_shards_owned"),
        tenants_active: metric(text, "ankusa_tenants_active"),
        tenants_parked: metric(text, "ankusa_tenants_parked"),
        claims: metric(text, "ankusa_claims"),
        kv_writes_in_flight: metric(text, "ankusa_kv_writes_in_flight"),
        nats_connected: metric(text, "ankusa_nats_connected"),
        clock_offset_seconds: metric(text, "ankusa_clock_offset_seconds"),
    }
}

/// How long each listing of the KV buckets may take: a listing whose
/// connection dropped midway may never finish.
const LISTING_BOUND: Duration = Duration::from_secs(10);

pub async fn collect(global: &Global) -> Result<FleetStatus, CliError> {
    if !(1..=MAX_SHARDS).contains(&global.shards) {
        return Err(CliError::Usage(format!(
            "--shards {} is not in 1..={MAX_SHARDS}",
            global.shards
        )));
    }
    let client = global
        .nats_client(global.timeout(Duration::from_secs(3)))
        .await?;
    let kv = FleetKv::bind(client, &global.instance).await?;
    let beats: Vec<Heartbeat> = within(LISTING_BOUND, kv.live_nodes()).await?;
    let holders: HashMap<u32, String> = within(LISTING_BOUND, kv.lease_holders()).await?;
    // A shard map drawn for the wrong shard count would call the shards it
    // leaves out "owned": refused instead.
    if let Some(beat) = beats
        .iter()
        .find(|beat| beat.shards != 0 && beat.shards != global.shards)
    {
        return Err(CliError::Usage(format!(
            "node {} serves {} shards, not --shards {}: pass --shards {}",
            beat.node, beat.shards, global.shards, beat.shards
        )));
    }
    if let Some(shard) = holders.keys().filter(|&&s| s >= global.shards).max() {
        return Err(CliError::Usage(format!(
            "shard {shard} is leased, beyond --shards {}: pass the instance's shard count",
            global.shards
        )));
    }
    let mut by_node: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for (shard, node) in &holders {
        by_node.entry(node.clone()).or_default().push(*shard);
    }
    for shards in by_node.values_mut() {
        shards.sort_unstable();
    }
    let unowned: Vec<u32> = (0..global.shards)
        .filter(|s| !holders.contains_key(s))
        .collect();
    // Every node's gauges at once: one after another, a fleet of silent
    // endpoints cost 0.8 s each.
    let readings = futures::future::join_all(beats.iter().map(|beat| async move {
        let read = match beat.http.as_deref().map(reachable) {
            Some(Ok(addr)) => http_get(addr, "/metrics", Duration::from_millis(800)).await,
            Some(Err(why)) => Err(why),
            None => Err("no HTTP address".into()),
        };
        match read {
            Ok(text) => (gauges(&text), None),
            Err(why) => (NodeGauges::default(), Some(why)),
        }
    }))
    .await;
    let mut nodes = Vec::new();
    for (beat, (gauges, metrics_error)) in beats.into_iter().zip(readings) {
        let shards = by_node.remove(&beat.node).unwrap_or_default();
        nodes.push(NodeStatus {
            node: beat.node,
            http: beat.http,
            started_ms: beat.started_ms,
            shards,
            metrics_error,
            gauges,
        });
    }
    Ok(FleetStatus {
        instance: global.instance.clone(),
        shards: global.shards,
        nodes,
        unowned,
        held_by_unknown: by_node,
    })
}

/// A node's advertised HTTP address, unless it names no host: a node bound to
/// `0.0.0.0` advertises just that, and connecting there reaches whatever
/// listens on this machine, not the node.
fn reachable(addr: &str) -> Result<&str, String> {
    match addr.parse::<std::net::SocketAddr>() {
        Ok(socket) if socket.ip().is_unspecified() => Err(format!(
            "it advertises {addr}, which names no host (it listens on every \
             interface); read its gauges from Prometheus, or bind http_addr to \
             the node's own address"
        )),
        _ => Ok(addr),
    }
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "?".into(), |v| format!("{v:.0}"))
}

pub fn render(status: &FleetStatus) -> String {
    let mut out = format!(
        "instance {}: {} shards, {} live node(s)\n",
        status.instance,
        status.shards,
        status.nodes.len()
    );
    out.push_str(&format!(
        "{:<24} {:<22} {:>6} {:>8} {:>8} {:>9} {:>5} {:>9}  leased shards\n",
        "node", "http", "owned", "tenants", "parked", "claims", "lag", "clock ms"
    ));
    for n in &status.nodes {
        out.push_str(&format!(
            "{:<24} {:<22} {:>6} {:>8} {:>8} {:>9} {:>5} {:>9}  {} ({})\n",
            n.node,
            n.http.as_deref().unwrap_or("-"),
            opt(n.gauges.shards_owned),
            opt(n.gauges.tenants_active),
            opt(n.gauges.tenants_parked),
            opt(n.gauges.claims),
            opt(n.gauges.kv_writes_in_flight),
            n.gauges
                .clock_offset_seconds
                .map_or_else(|| "?".into(), |s| format!("{:+.1}", s * 1000.0)),
            ranges(&n.shards),
            n.shards.len()
        ));
        if let Some(why) = &n.metrics_error {
            out.push_str(&format!("  metrics unavailable: {why}\n"));
        }
    }
    for (node, shards) in &status.held_by_unknown {
        out.push_str(&format!(
            "! {} shard(s) leased by {node}, which has no live heartbeat: {}\n",
            shards.len(),
            ranges(shards)
        ));
    }
    if status.unowned.is_empty() {
        out.push_str("every shard is owned\n");
    } else {
        out.push_str(&format!(
            "! {} UNOWNED shard(s) (no node serves them; edges degrade): {}\n",
            status.unowned.len(),
            ranges(&status.unowned)
        ));
    }
    out.push_str(
        "(lag = KV writes awaiting their ack; clock ms = the NATS server's time minus the node's)",
    );
    out
}

pub async fn status(global: &Global, args: StatusArgs) -> Result<(), CliError> {
    let status = collect(global).await?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&status).unwrap_or_default()
        );
    } else {
        println!("{}", render(&status));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_that_names_no_host_is_not_read() {
        for unspecified in ["0.0.0.0:9464", "[::]:9464"] {
            let why = reachable(unspecified).expect_err(unspecified);
            assert!(why.contains("names no host"), "{why}");
        }
        for named in ["127.0.0.1:9464", "10.1.2.3:9464", "[::1]:9464"] {
            assert_eq!(reachable(named), Ok(named));
        }
    }

    #[test]
    fn metrics_are_read() {
        let text = "# TYPE ankusa_claims gauge\nankusa_claims 12\nankusa_claims_x 3\nankusa_requests_total{result=\"ok\"} 4\nankusa_requests_total{result=\"err\"} 1\n";
        assert_eq!(metric(text, "ankusa_claims"), Some(12.0));
        assert_eq!(metric(text, "ankusa_requests_total"), Some(5.0));
        assert_eq!(metric(text, "ankusa_missing"), None);
    }

    #[test]
    fn each_nodes_clock_offset_is_shown_in_milliseconds() {
        let node = |name: &str, offset: Option<f64>| NodeStatus {
            node: name.into(),
            http: None,
            started_ms: 0,
            shards: vec![0, 1, 2],
            metrics_error: None,
            gauges: NodeGauges {
                clock_offset_seconds: offset,
                ..NodeGauges::default()
            },
        };
        let status = FleetStatus {
            instance: "test".into(),
            shards: 3,
            nodes: vec![node("behind", Some(0.0015)), node("unread", None)],
            unowned: vec![],
            held_by_unknown: BTreeMap::new(),
        };
        let text = render(&status);
        let row = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .unwrap_or_else(|| panic!("no row for {name}:\n{text}"))
                .split_whitespace()
                .nth(7)
                .map(str::to_owned)
        };
        assert_eq!(row("behind").as_deref(), Some("+1.5"), "{text}");
        assert_eq!(row("unread").as_deref(), Some("?"), "{text}");
    }
}
