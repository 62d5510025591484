//! `ankusa bench durable` and `ankusa bench recovery`: what persistence costs.
//!
//! - *durable*: claims made durable per second through the node's group-commit
//!   writer ([`KvWriter`], many writes published back to back, acks awaited
//!   together) against one `kv.put` awaited after another, into the same bucket.
//!   Target: group commit ≥ 10× sequential puts.
//! - *recovery*: 100,000 claims of one shard written through [`KvWriter`], then
//!   [`FleetKv::load_shard`] timed — what a node taking the shard over waits
//!   before it serves. Target: < 2 s.
//!
//! Both use a scratch instance of their own (`benchdurable_<pid>`,
//! `benchrecovery_<pid>`), never the fleet's buckets, and delete its buckets
//! at the end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ankusa_actors::{Changes, ClaimChange, ClaimRecord, TenantSnapshot};
use ankusa_bus::kv::{claim_key, now_unix_ms, FleetKv, KvWriter, StoredClaim};
use clap::Args;
use futures::StreamExt;
use serde::Serialize;

use super::{write_json, CliError, Global};

#[derive(Debug, Clone, Args)]
pub struct DurableArgs {
    /// Claims written through the group-commit writer
    #[arg(long, default_value_t = 50_000)]
    pub count: u64,
    /// Claims submitted to the writer at once
    #[arg(long, default_value_t = 2048)]
    pub concurrency: usize,
    /// Longest the sequential puts run, seconds (0.1 to 600)
    #[arg(long, default_value_t = 5.0, value_parser = sequential_seconds)]
    pub sequential_s: f64,
    /// Most sequential puts
    #[arg(long, default_value_t = 20_000)]
    pub sequential_max: u64,
    /// Stop submitting group-commit claims after this long, seconds (at most a day)
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub max_seconds: u64,
    /// Write the figures as JSON to this file
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct RecoveryArgs {
    /// Claims of the shard to write and load back
    #[arg(long, default_value_t = 100_000)]
    pub claims: u64,
    /// Tenants they belong to
    #[arg(long, default_value_t = 1000)]
    pub tenants: u64,
    /// Claims submitted to the writer at once
    #[arg(long, default_value_t = 2048)]
    pub concurrency: usize,
    /// Stop submitting claims after this long, seconds (at most a day)
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub max_seconds: u64,
    /// Write the figures as JSON to this file
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// `--sequential-s`: a number of seconds from 0.1 to 600 (a NaN would get
/// past a clamp, and make no duration).
fn sequential_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if (0.1..=600.0).contains(&s) => Ok(s),
        _ => Err(format!("`{text}`: say a number of seconds from 0.1 to 600")),
    }
}

/// A scratch set of buckets, deleted on [`Scratch::remove`].
struct Scratch {
    client: async_nats::Client,
    instance: String,
    kv: FleetKv,
}

impl Scratch {
    async fn open(global: &Global, what: &str) -> Result<Self, CliError> {
        let client = global.nats_client(Duration::from_secs(5)).await?;
        let instance = format!("bench{what}_{}", std::process::id());
        // A leftover of a killed run would skew the figures.
        delete_buckets(&client, &instance).await;
        let kv = FleetKv::open(client.clone(), &instance, 1).await?;
        Ok(Self {
            client,
            instance,
            kv,
        })
    }

    fn state_bucket(&self) -> String {
        format!("ankusa_{}_state", self.instance)
    }

    async fn remove(self) {
        delete_buckets(&self.client, &self.instance).await;
    }
}

async fn delete_buckets(client: &async_nats::Client, instance: &str) {
    let js = ankusa_bus::jetstream(client.clone());
    for suffix in ["state", "leases", "nodes"] {
        let _ = js
            .delete_key_value(format!("ankusa_{instance}_{suffix}"))
            .await;
    }
}

fn committed(i: u64, expires_us: u64) -> ClaimRecord {
    ClaimRecord::new(
        "bench",
        &format!("evt-{i:010}"),
        &format!("hook-{i:010}"),
        None,
        true,
        expires_us,
    )
}

/// What [`write_claims`] did.
#[derive(Debug, Clone, Copy)]
struct Written {
    ok: u64,
    failed: u64,
    elapsed: Duration,
    /// Claims never submitted: the time bound came first.
    cut: u64,
}

/// Writes `count` committed claims through `writer`, claim `i` on shard
/// `shards[i % len]`, `concurrency` at a time, submitting none after `stop_at`.
async fn write_claims(
    writer: &Arc<KvWriter>,
    shards: &[u32],
    count: u64,
    tenants: u64,
    concurrency: usize,
    stop_at: Instant,
) -> Written {
    let expires_us = (now_unix_ms() + 600_000) * 1000;
    let start = Instant::now();
    let results: Vec<bool> = futures::stream::iter(0..count)
        .take_while(|_| futures::future::ready(Instant::now() < stop_at))
        .map(|i| {
            let writer = Arc::clone(writer);
            let shard = shards[i as usize % shards.len()];
            async move {
                let tenant = format!("t{}", i % tenants.max(1));
                let changes = Changes {
                    claim: Some(ClaimChange::Put(committed(i, expires_us))),
                    buckets: Default::default(),
                };
                writer
                    .record([(shard, tenant.as_str(), &changes)])
                    .await
                    .is_ok()
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    let elapsed = start.elapsed();
    let ok = results.iter().filter(|r| **r).count() as u64;
    let submitted = results.len() as u64;
    Written {
        ok,
        failed: submitted - ok,
        elapsed,
        cut: count - submitted,
    }
}

/// The line that says a run stopped at its time bound, if it did.
fn cut_short(cut: u64, count: u64, max_seconds: u64) -> Option<String> {
    (cut > 0).then(|| {
        format!("stopped at --max-seconds {max_seconds}: {cut} of {count} claims never submitted")
    })
}

#[derive(Debug, Serialize)]
struct DurableReport {
    group_commit_claims: u64,
    group_commit_failed: u64,
    group_commit_s: f64,
    group_commit_per_sec: f64,
    /// Claims of --count never submitted: --max-seconds came first.
    group_commit_cut: u64,
    sequential_puts: u64,
    sequential_s: f64,
    sequential_per_sec: f64,
    sequential_p50_us: u64,
    ratio: f64,
    target_met: bool,
}

pub async fn durable(global: &Global, args: &DurableArgs) -> Result<(), CliError> {
    let scratch = Scratch::open(global, "durable").await?;
    let result = durable_in(&scratch, args).await;
    scratch.remove().await;
    let report = result?;
    println!(
        "durable claims, group commit (KvWriter, {} at once): {} in {:.2} s = {:.0} claims/s ({} failed)",
        args.concurrency,
        report.group_commit_claims,
        report.group_commit_s,
        report.group_commit_per_sec,
        report.group_commit_failed
    );
    if let Some(line) = cut_short(report.group_commit_cut, args.count, args.max_seconds) {
        println!("durable claims, group commit: {line}");
    }
    println!(
        "durable claims, sequential kv.put: {} in {:.2} s = {:.0} puts/s (p50 {} µs)",
        report.sequential_puts,
        report.sequential_s,
        report.sequential_per_sec,
        report.sequential_p50_us
    );
    println!(
        "ratio group commit / sequential: {:.1}x (target >= 10x: {})",
        report.ratio,
        if report.target_met { "met" } else { "MISSED" }
    );
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}

async fn durable_in(scratch: &Scratch, args: &DurableArgs) -> Result<DurableReport, CliError> {
    let writer = KvWriter::start(scratch.kv.clone(), Duration::from_millis(100));
    writer.write_node_log(true);
    let stop_at = Instant::now() + Duration::from_secs(args.max_seconds);
    // Warm-up: the first publishes open the stream's files.
    let _ = write_claims(&writer, &[1], 1000, 100, args.concurrency, stop_at).await;
    let group = write_claims(&writer, &[0], args.count, 1000, args.concurrency, stop_at).await;
    drop(writer);

    let js = ankusa_bus::jetstream(scratch.client.clone());
    let store = js
        .get_key_value(scratch.state_bucket())
        .await
        .map_err(|e| CliError::Other(format!("opening the state bucket: {e}")))?;
    let expires_us = (now_unix_ms() + 600_000) * 1000;
    let limit = Duration::from_secs_f64(args.sequential_s);
    let mut latencies = Vec::new();
    let start = Instant::now();
    let mut puts = 0u64;
    while puts < args.sequential_max && start.elapsed() < limit {
        let i = 10_000_000 + puts;
        let record = committed(i, expires_us);
        let key = claim_key(0, "seq", record.source_id(), record.key());
        let value = rmp_serde::to_vec_named(&StoredClaim {
            tenant: "seq".into(),
            claim: record,
        })
        .unwrap_or_default();
        let sent = Instant::now();
        store
            .put(key, value.into())
            .await
            .map_err(|e| CliError::Other(format!("kv.put: {e}")))?;
        latencies.push(sent.elapsed());
        puts += 1;
    }
    let seq_elapsed = start.elapsed();
    latencies.sort_unstable();
    let p50 = latencies
        .get(latencies.len() / 2)
        .map_or(0, |d| d.as_micros() as u64);
    let group_rate = group.ok as f64 / group.elapsed.as_secs_f64().max(1e-9);
    let seq_rate = puts as f64 / seq_elapsed.as_secs_f64().max(1e-9);
    let ratio = group_rate / seq_rate.max(1e-9);
    Ok(DurableReport {
        group_commit_claims: group.ok,
        group_commit_failed: group.failed,
        group_commit_s: group.elapsed.as_secs_f64(),
        group_commit_per_sec: group_rate,
        group_commit_cut: group.cut,
        sequential_puts: puts,
        sequential_s: seq_elapsed.as_secs_f64(),
        sequential_per_sec: seq_rate,
        sequential_p50_us: p50,
        ratio,
        target_met: ratio >= 10.0,
    })
}

#[derive(Debug, Serialize)]
struct RecoveryReport {
    written: u64,
    write_failed: u64,
    write_s: f64,
    /// Claims of shard 0 never submitted: --max-seconds came first.
    write_cut: u64,
    loaded_tenants: usize,
    loaded_claims: usize,
    load_s: f64,
    second_load_s: f64,
    /// The shards loaded in one pass (a failover's), their claims, and how long.
    shards_together: u32,
    together_claims: usize,
    together_load_s: f64,
    target_met: bool,
}

/// The shards the recovery bench writes, as one node of 2 × 64 owns.
const OWNED_SHARDS: u32 = 32;

pub async fn recovery(global: &Global, args: &RecoveryArgs) -> Result<(), CliError> {
    let scratch = Scratch::open(global, "recovery").await?;
    let result = recovery_in(&scratch, args).await;
    scratch.remove().await;
    let r = result?;
    println!(
        "recovery: wrote {} claims of shard 0 over {} tenants in {:.2} s ({} failed), as many on {} other shards in the same log messages",
        r.written, args.tenants, r.write_s, r.write_failed, r.shards_together - 1
    );
    if let Some(line) = cut_short(r.write_cut, args.claims, args.max_seconds) {
        println!("recovery: {line}");
    }
    println!(
        "recovery: load_shard(0) read {} claims of {} tenants in {:.3} s (again: {:.3} s); target < 2 s: {}",
        r.loaded_claims,
        r.loaded_tenants,
        r.load_s,
        r.second_load_s,
        if r.target_met { "met" } else { "MISSED" }
    );
    println!(
        "recovery: load_shards of all {} read {} claims in {:.3} s (one pass, as after a failover)",
        r.shards_together, r.together_claims, r.together_load_s
    );
    if let Some(path) = &args.json {
        write_json(path, &r)?;
    }
    Ok(())
}

async fn recovery_in(scratch: &Scratch, args: &RecoveryArgs) -> Result<RecoveryReport, CliError> {
    let writer = KvWriter::start(scratch.kv.clone(), Duration::from_millis(100));
    writer.write_node_log(true);
    // As many claims again on 31 other shards, written at the same time, so
    // that the log messages mix them with shard 0's as a node's do at peak:
    // the load of shard 0 reads and skips them.
    let others: Vec<u32> = (1..OWNED_SHARDS).collect();
    let stop_at = Instant::now() + Duration::from_secs(args.max_seconds);
    let (shard0, other_shards) = tokio::join!(
        write_claims(
            &writer,
            &[0],
            args.claims,
            args.tenants,
            args.concurrency,
            stop_at
        ),
        write_claims(
            &writer,
            &others,
            args.claims,
            args.tenants,
            args.concurrency,
            stop_at
        ),
    );
    let (ok, others_ok) = (shard0.ok, other_shards.ok);
    drop(writer);
    let count = |state: &[TenantSnapshot]| state.iter().map(|t| t.claims.len()).sum::<usize>();
    let start = Instant::now();
    let loaded = scratch.kv.load_shard(0).await?;
    let load = start.elapsed();
    let start = Instant::now();
    let again = scratch.kv.load_shard(0).await?;
    let second = start.elapsed();
    let claims = count(&loaded);
    if count(&again) != claims {
        return Err(CliError::Other(
            "two loads of the same shard disagree".into(),
        ));
    }
    let all: Vec<u32> = (0..OWNED_SHARDS).collect();
    let start = Instant::now();
    let together = scratch.kv.load_shards(&all).await?;
    let together_s = start.elapsed().as_secs_f64();
    let together_claims: usize = together.values().map(|state| count(state)).sum();
    if together_claims as u64 != ok + others_ok || count(&together[&0]) != claims {
        return Err(CliError::Other(format!(
            "loading {OWNED_SHARDS} shards at once read {together_claims} claims of {} written",
            ok + others_ok
        )));
    }
    Ok(RecoveryReport {
        written: ok,
        write_failed: shard0.failed,
        write_s: shard0.elapsed.as_secs_f64(),
        write_cut: shard0.cut,
        loaded_tenants: loaded.len(),
        loaded_claims: claims,
        load_s: load.as_secs_f64(),
        second_load_s: second.as_secs_f64(),
        shards_together: OWNED_SHARDS,
        together_claims,
        together_load_s: together_s,
        target_met: load < Duration::from_secs(2) && claims as u64 == ok,
    })
}
