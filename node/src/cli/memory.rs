//! `ankusa bench memory`: what a live claim and an idle tenant cost in a real
//! node's resident memory.
//!
//! It drives a running `ankusa-node` (best a fresh `--mode standalone` one, so
//! nothing else lives in it) over NATS with the batching edge client, and reads
//! the node's `VmRSS` from `/proc/<pid>/status` before and after:
//!
//! - `--what claims`: `--count` hits each claiming a fresh key, each committed
//!   by a settle (TTL 1 h, so they all stay live), spread over `--tenants`;
//!   figure = ΔRSS / claims the node reports live (`ankusa_claims`).
//! - `--what tenants`: `--count` tenants, one hit each (two charges, no claim)
//!   whose buckets stay non-full for 10 minutes; once the node has retired
//!   them all to its parked map (start it with a short `idle_after_ms`), figure
//!   = ΔRSS / parked tenants (`ankusa_tenants_parked`).
//! - `--what control`: as `tenants`, but each bucket is full again 1 ms after
//!   its hit, so retired tenants are dropped. Run on a fresh node, its ΔRSS is
//!   what the churn of the tenants' actors alone leaves behind; `tenants` minus
//!   `control` is what the parked state costs.
//!
//! ΔRSS counts everything the load left behind: the state itself, the hash
//! tables' spare room, and heap the allocator keeps after the actors that
//! served the load are gone. It is an upper bound on the state's own size.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ankusa_actors::{
    Charge, Claim, HitOutcome, HitRequest, Kind, SettleOutcome, SettleRequest, Settlement,
};
use ankusa_bus::Store;
use clap::{Args, ValueEnum};
use futures::StreamExt;
use serde::Serialize;

use super::status::{http_get, metric};
use super::{write_json, CliError, Global};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum What {
    /// Live committed claims
    Claims,
    /// Idle (parked) tenants with non-full buckets
    Tenants,
    /// The control for `tenants`: the same calls, but buckets that are full
    /// again within 1 ms, so retired tenants are dropped, not parked. What it
    /// leaves in RSS is the allocator keeping the retired actors' heap.
    Control,
}

#[derive(Debug, Clone, Args)]
pub struct MemoryArgs {
    /// The node process to measure (its `/proc/<pid>/status`)
    #[arg(long)]
    pub pid: u32,
    /// The node's HTTP address, for its claim and tenant gauges
    #[arg(long)]
    pub http: String,
    #[arg(long, value_enum, default_value = "claims")]
    pub what: What,
    /// Claims or tenants to create
    #[arg(long, default_value_t = 1_000_000)]
    pub count: u64,
    /// Tenants the claims spread over (claims only)
    #[arg(long, default_value_t = 10_000)]
    pub tenants: u64,
    /// Calls in flight
    #[arg(long, default_value_t = 1024)]
    pub concurrency: usize,
    /// Stop issuing calls after this long, seconds (at most a day)
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub max_seconds: u64,
    /// Longest wait for the node to park every tenant, seconds (at most a day)
    #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub settle_wait_s: u64,
    /// Write the figures as JSON to this file
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// `VmRSS` and `VmHWM` of a process, bytes.
pub fn rss_of(pid: u32) -> Result<(u64, u64), CliError> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| CliError::Other(format!("reading {path}: {e}")))?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    match (field("VmRSS:"), field("VmHWM:")) {
        (Some(rss), Some(hwm)) => Ok((rss, hwm)),
        _ => Err(CliError::Other(format!("{path} has no VmRSS/VmHWM"))),
    }
}

async fn gauge(http: &str, name: &str) -> Option<f64> {
    let text = http_get(http, "/metrics", Duration::from_secs(2))
        .await
        .ok()?;
    metric(&text, name)
}

#[derive(Debug, Serialize)]
struct MemoryReport {
    what: What,
    asked: u64,
    answered_ok: u64,
    errors: u64,
    drive_s: f64,
    rss_before: u64,
    rss_after: u64,
    peak_rss: u64,
    /// What the node says it holds (claims, or parked tenants).
    live: u64,
    bytes_per_item: f64,
    target_bytes: f64,
    target_met: bool,
}

fn charges(tenant: &str, hooks_inc_us: u64) -> Vec<Charge> {
    vec![
        Charge {
            kind: Kind::Hooks,
            tenant: tenant.to_string(),
            increment_us: hooks_inc_us,
            capacity_us: hooks_inc_us * 10,
        },
        Charge {
            kind: Kind::Bytes,
            tenant: tenant.to_string(),
            increment_us: hooks_inc_us,
            capacity_us: hooks_inc_us * 10,
        },
    ]
}

pub async fn memory(global: &Global, args: &MemoryArgs) -> Result<(), CliError> {
    let store = Arc::new(global.fleet(true).await?);
    super::wait_connected(store.nats(), Duration::from_secs(5)).await?;
    let timeout = global.timeout(Duration::from_secs(2));
    let run = std::process::id();
    let (rss_before, _) = rss_of(args.pid)?;
    let ok = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let stop_at = start + Duration::from_secs(args.max_seconds.max(1));
    let what = args.what;
    let tenants = args.tenants.max(1);
    futures::stream::iter(0..args.count)
        .take_while(|_| futures::future::ready(Instant::now() < stop_at))
        .map(|i| {
            let (store, ok, errors) = (Arc::clone(&store), Arc::clone(&ok), Arc::clone(&errors));
            async move {
                let done = match what {
                    What::Claims => {
                        let tenant = format!("mem{run}-{}", i % tenants);
                        let claim = Claim {
                            tenant: tenant.clone(),
                            source_id: "mem".into(),
                            key: format!("evt-{i:08}"),
                            hook_id: format!("h{i:08}"),
                            node: "bench-edge".into(),
                            ttl_ms: 3_600_000,
                            pending_ttl_ms: 60_000,
                        };
                        // 1 µs per hook: a tenant's buckets never deny here.
                        let req = HitRequest {
                            charges: charges(&tenant, 1),
                            claim: Some(claim.clone()),
                        };
                        match store.hit(req, timeout).await {
                            Ok(HitOutcome::Ok) => matches!(
                                store
                                    .settle(
                                        SettleRequest {
                                            claim,
                                            settlement: Settlement::Commit,
                                        },
                                        timeout,
                                    )
                                    .await,
                                Ok(SettleOutcome::Ok)
                            ),
                            _ => false,
                        }
                    }
                    What::Tenants | What::Control => {
                        let tenant = format!("idle{run}-{i}");
                        // 60 s per hook: the buckets stay non-full for ten
                        // minutes, so the retired tenant must be kept, parked.
                        // The control's 1 ms lets it be dropped instead.
                        let increment_us = if what == What::Tenants {
                            60_000_000
                        } else {
                            1000
                        };
                        let req = HitRequest {
                            charges: charges(&tenant, increment_us),
                            claim: None,
                        };
                        matches!(store.hit(req, timeout).await, Ok(HitOutcome::Ok))
                    }
                };
                if done {
                    ok.fetch_add(1, Ordering::Relaxed);
                } else {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
        .buffer_unordered(args.concurrency.max(1))
        .collect::<Vec<()>>()
        .await;
    let drive = start.elapsed();
    let answered_ok = ok.load(Ordering::Relaxed);
    eprintln!(
        "memory: {answered_ok} done, {} failed in {:.1} s; waiting for the node to settle",
        errors.load(Ordering::Relaxed),
        drive.as_secs_f64()
    );
    // The node publishes its gauges once a second; tenants park after their idle time.
    let wait_until = Instant::now() + Duration::from_secs(args.settle_wait_s);
    let live = loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let live = match what {
            What::Claims => gauge(&args.http, "ankusa_claims").await,
            What::Tenants | What::Control => {
                let active = gauge(&args.http, "ankusa_tenants_active").await;
                let parked = gauge(&args.http, "ankusa_tenants_parked").await;
                match (active, parked) {
                    (Some(a), Some(p)) if a < 1.0 => Some(p),
                    (_, Some(p)) if Instant::now() >= wait_until => Some(p),
                    _ => None,
                }
            }
        };
        match live {
            Some(n) if what == What::Claims || n as u64 >= answered_ok => break n as u64,
            // Every control tenant is dropped: the count is what was created.
            Some(_) if what == What::Control => break answered_ok,
            Some(n) if Instant::now() >= wait_until => break n as u64,
            None if Instant::now() >= wait_until => {
                return Err(CliError::Other(format!(
                    "no gauges from {} within {} s",
                    args.http, args.settle_wait_s
                )))
            }
            _ => {}
        }
    };
    let (rss_after, peak_rss) = rss_of(args.pid)?;
    let per = rss_after.saturating_sub(rss_before) as f64 / live.max(1) as f64;
    let target = match what {
        What::Claims => 300.0,
        What::Tenants | What::Control => 150.0,
    };
    let report = MemoryReport {
        what,
        asked: args.count,
        answered_ok,
        errors: errors.load(Ordering::Relaxed),
        drive_s: drive.as_secs_f64(),
        rss_before,
        rss_after,
        peak_rss,
        live,
        bytes_per_item: per,
        target_bytes: target,
        target_met: per < target,
    };
    let noun = match what {
        What::Claims => "live committed claim",
        What::Tenants => "idle (parked) tenant, 2 buckets",
        What::Control => "dropped tenant (control: actor churn only)",
    };
    println!(
        "memory ({:?}): node RSS {:.1} MiB -> {:.1} MiB (peak {:.1} MiB) for {} live; {:.0} bytes per {noun} (target < {target:.0}: {})",
        what,
        rss_before as f64 / 1048576.0,
        rss_after as f64 / 1048576.0,
        peak_rss as f64 / 1048576.0,
        live,
        per,
        if report.target_met { "met" } else { "MISSED" }
    );
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}

#[derive(Debug, Clone, Args)]
pub struct SeedArgs {
    /// Tenants whose (non-full) buckets to write into the instance's KV
    #[arg(long, default_value_t = 1_000_000)]
    pub count: u64,
    /// Start no slice of 50,000 tenants after this long, seconds (at most a day)
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub max_seconds: u64,
}

/// `ankusa bench seed-parked`: writes `count` tenants' bucket TATs (ten
/// minutes ahead, no claim) into the instance's KV, as a node's write-behind
/// would. A fleet node started on the instance then loads every tenant straight
/// into its parked map, with no actor ever started: its RSS over that of a node
/// on an empty instance is what idle tenants alone cost.
pub async fn seed_parked(global: &Global, args: &SeedArgs) -> Result<(), CliError> {
    use ankusa_actors::{BucketRecord, Changes};
    use ankusa_bus::kv::{now_unix_ms, FleetKv, KvWriter};

    let client = global.nats_client(Duration::from_secs(5)).await?;
    let kv = FleetKv::open(client, &global.instance, 1).await?;
    // A write-behind period longer than the run: one explicit flush below.
    let writer = KvWriter::start(kv, Duration::from_secs(3600));
    writer.write_node_log(true);
    let tat_us = (now_unix_ms() + 600_000) * 1000;
    let start = Instant::now();
    let stop_at = start + Duration::from_secs(args.max_seconds);
    let run = std::process::id();
    let mut written = 0u64;
    // In slices, so the dirty map and the flush's futures stay small.
    let mut next = 0u64;
    while next < args.count && Instant::now() < stop_at {
        let end = (next + 50_000).min(args.count);
        for i in next..end {
            let tenant = format!("idle{run}-{i}");
            let changes = Changes {
                claim: None,
                buckets: [
                    BucketRecord {
                        kind: Kind::Hooks,
                        tat_us,
                    },
                    BucketRecord {
                        kind: Kind::Bytes,
                        tat_us,
                    },
                ]
                .into_iter()
                .collect(),
            };
            let shard = ankusa_bus::shard_of(&tenant, global.shards);
            writer
                .record([(shard, tenant.as_str(), &changes)])
                .await
                .map_err(|e| CliError::Other(format!("recording tenant {tenant}: {e}")))?;
        }
        let failed = writer.flush_buckets(None).await;
        if failed > 0 {
            return Err(CliError::Other(format!(
                "{failed} tenants' buckets were not written (JetStream refused or did not \
                 acknowledge them); {written} seeded before this slice"
            )));
        }
        written = end;
        next = end;
    }
    println!(
        "seeded {written} tenants' buckets into instance {} ({} shards) in {:.1} s",
        global.instance,
        global.shards,
        start.elapsed().as_secs_f64()
    );
    if written < args.count {
        println!(
            "stopped at --max-seconds {}: {} of {} tenants not seeded",
            args.max_seconds,
            args.count - written,
            args.count
        );
    }
    Ok(())
}
