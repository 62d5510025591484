//! A burst of hits against a running fleet, as an edge would send them, with a
//! count of what came back. `scripts/dev-fleet.sh` runs it once the fleet is up.
//!
//! ```sh
//! cargo run --release -p ankusa-node --example burst -- --nats nats://127.0.0.1:4222
//! ```
//!
//! Three phases, all through `ankusa_bus::FleetStore` (the edge client):
//!
//! 1. **burst**: `--hits` hits spread over `--tenants` tenants, `--concurrency` in
//!    flight. Each charges a `hooks` bucket of `--burst` hooks refilling one per
//!    `--per-ms` ms, and claims a fresh event key. A tenant that sends more than
//!    its bucket holds sees `rate_limited`.
//! 2. **settle**: every claim answered `ok` is committed, except the first
//!    `--leave-pending` of each tenant, which stay pending.
//! 3. **replay**: each claimed key is sent once more by another hook (claim only,
//!    no charge): a committed key answers `duplicate`, a pending one `pending`.
//!
//! It then prints the outcome counts, latency percentiles and, when the instance
//! runs in fleet mode, how many hits each node's shards took.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ankusa_actors::{
    Charge, Claim, HitOutcome, HitRequest, Kind, SettleOutcome, SettleRequest, Settlement,
};
use ankusa_bus::{FleetConfig, FleetStore, NatsOptions, Store, StoreError};
use clap::Parser;
use futures::StreamExt;
use tokio::sync::Semaphore;

/// Sends a burst of hits (claims + settles) to an ankusa-fleet instance and
/// prints what they got.
#[derive(Debug, Parser)]
struct Args {
    /// NATS server URL(s), comma-separated
    #[arg(
        long,
        env = "ANKUSA_NATS",
        value_delimiter = ',',
        default_value = "nats://127.0.0.1:4222"
    )]
    nats: Vec<String>,
    /// Fleet instance name
    #[arg(long, env = "ANKUSA_INSTANCE", default_value = "default")]
    instance: String,
    /// Shard count of the instance (must match the nodes)
    #[arg(long, env = "ANKUSA_SHARDS", default_value_t = 64)]
    shards: u32,
    /// Hits in the burst
    #[arg(long, default_value_t = 1000)]
    hits: usize,
    /// Tenants the hits are spread over
    #[arg(long, default_value_t = 10)]
    tenants: usize,
    /// Hits in flight at once
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Hooks bucket size of each tenant
    #[arg(long, default_value_t = 80)]
    burst: u64,
    /// The bucket refills one hook per this many ms
    #[arg(long, default_value_t = 100)]
    per_ms: u64,
    /// Claims per tenant left unsettled (they answer `pending` on replay)
    #[arg(long, default_value_t = 2)]
    leave_pending: usize,
    /// Per-call deadline, ms
    #[arg(long, default_value_t = 1000)]
    timeout_ms: u64,
    /// Fail (exit 1) if any call errored
    #[arg(long)]
    strict: bool,
}

#[derive(Default)]
struct Tally {
    counts: BTreeMap<String, usize>,
    latencies_us: Vec<u64>,
}

impl Tally {
    fn add(&mut self, what: String, took: Duration) {
        *self.counts.entry(what).or_default() += 1;
        self.latencies_us.push(took.as_micros() as u64);
    }

    fn errors(&self) -> usize {
        self.counts
            .iter()
            .filter(|(k, _)| k.starts_with("error"))
            .map(|(_, n)| n)
            .sum()
    }

    fn print(&mut self, phase: &str, took: Duration) {
        let total: usize = self.counts.values().sum();
        let rate = total as f64 / took.as_secs_f64().max(1e-9);
        println!("{phase}: {total} calls in {took:.2?} ({rate:.0}/s)");
        for (what, n) in &self.counts {
            println!("  {what:<16} {n:>6}");
        }
        self.latencies_us.sort_unstable();
        let pct = |p: f64| {
            let v = &self.latencies_us;
            if v.is_empty() {
                0
            } else {
                v[((v.len() - 1) as f64 * p).round() as usize]
            }
        };
        println!(
            "  latency          p50 {} µs, p99 {} µs, max {} µs",
            pct(0.5),
            pct(0.99),
            pct(1.0)
        );
    }
}

fn hit_name(result: &Result<HitOutcome, StoreError>) -> String {
    match result {
        Ok(HitOutcome::Ok) => "ok".into(),
        Ok(HitOutcome::Duplicate { .. }) => "duplicate".into(),
        Ok(HitOutcome::Pending { .. }) => "pending".into(),
        Ok(HitOutcome::RateLimited { .. }) => "rate_limited".into(),
        Err(err) => format!("error: {}", error_name(err)),
    }
}

fn settle_name(result: &Result<SettleOutcome, StoreError>) -> String {
    match result {
        Ok(SettleOutcome::Ok) => "ok".into(),
        Ok(SettleOutcome::NotFound) => "not_found".into(),
        Ok(SettleOutcome::NotOwner { .. }) => "not_owner".into(),
        Ok(SettleOutcome::AlreadyCommitted) => "already_committed".into(),
        Err(err) => format!("error: {}", error_name(err)),
    }
}

fn error_name(err: &StoreError) -> String {
    match err {
        StoreError::Timeout(_) => "timeout".into(),
        StoreError::NoResponders => "no_responders".into(),
        StoreError::Disconnected => "disconnected".into(),
        StoreError::Refused(reply) => format!("refused {}", reply.code),
        other => other.to_string(),
    }
}

struct Plan {
    run: String,
    args: Args,
}

impl Plan {
    fn tenant(&self, i: usize) -> String {
        format!("demo-tenant-{}", i % self.args.tenants.max(1))
    }

    fn claim(&self, tenant: &str, n: usize, hook: &str) -> Claim {
        Claim {
            tenant: tenant.to_string(),
            source_id: "burst".into(),
            key: format!("evt-{}-{n}", self.run),
            hook_id: format!("{hook}-{}-{n}", self.run),
            node: "burst-example".into(),
            ttl_ms: 600_000,
            pending_ttl_ms: 30_000,
        }
    }

    fn hit(&self, n: usize) -> HitRequest {
        let tenant = self.tenant(n);
        HitRequest {
            charges: vec![Charge {
                kind: Kind::Hooks,
                tenant: tenant.clone(),
                increment_us: self.args.per_ms * 1000,
                capacity_us: self.args.burst * self.args.per_ms * 1000,
            }],
            claim: Some(self.claim(&tenant, n, "hook")),
        }
    }
}

/// Who holds each shard's lease, from the instance's KV (fleet mode only).
async fn lease_holders(client: &async_nats::Client, instance: &str) -> BTreeMap<u32, String> {
    let mut holders = BTreeMap::new();
    let js = async_nats::jetstream::new(client.clone());
    let Ok(store) = js.get_key_value(format!("ankusa_{instance}_leases")).await else {
        return holders;
    };
    let Ok(mut keys) = store.keys().await else {
        return holders;
    };
    let mut names = Vec::new();
    while let Some(Ok(key)) = keys.next().await {
        names.push(key);
    }
    for key in names {
        let Some(shard) = key.strip_prefix("s.").and_then(|s| s.parse().ok()) else {
            continue;
        };
        if let Ok(Some(value)) = store.get(&key).await {
            if let Ok(lease) = rmp_serde::from_slice::<ankusa_bus::kv::LeaseValue>(&value) {
                holders.insert(shard, lease.node);
            }
        }
    }
    holders
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let mut config = FleetConfig::new(NatsOptions::with_servers(args.nats.clone()), &args.instance);
    config.shards = args.shards;
    let store = match FleetStore::connect(config).await {
        Ok(store) => store,
        Err(err) => {
            eprintln!("burst: {err}");
            return std::process::ExitCode::from(2);
        }
    };
    // The client connects in the background; give it a bounded moment.
    let connecting = Instant::now();
    while store.nats().connection_state() != async_nats::connection::State::Connected {
        if connecting.elapsed() > Duration::from_secs(5) {
            eprintln!("burst: not connected to NATS at {:?} after 5 s", args.nats);
            return std::process::ExitCode::FAILURE;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let run = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
        .to_string();
    let timeout = Duration::from_millis(args.timeout_ms);
    let plan = Arc::new(Plan { run, args });
    let a = &plan.args;
    println!(
        "burst: {} hits over {} tenants ({} in flight), hooks bucket {} per tenant refilling 1 per {} ms, instance `{}`, {} shards",
        a.hits, a.tenants, a.concurrency, a.burst, a.per_ms, a.instance, a.shards
    );

    // 1. The burst.
    let permits = Arc::new(Semaphore::new(plan.args.concurrency.max(1)));
    let started = Instant::now();
    let mut calls = Vec::with_capacity(plan.args.hits);
    for n in 0..plan.args.hits {
        let (store, plan, permits) = (store.clone(), plan.clone(), permits.clone());
        calls.push(tokio::spawn(async move {
            let _permit = permits.acquire_owned().await;
            let req = plan.hit(n);
            let t = Instant::now();
            let result = store.hit(req, timeout).await;
            (n, result, t.elapsed())
        }));
    }
    let mut burst = Tally::default();
    let mut granted: Vec<usize> = Vec::new();
    let mut per_shard: BTreeMap<u32, usize> = BTreeMap::new();
    for call in calls {
        let Ok((n, result, took)) = call.await else {
            continue;
        };
        *per_shard
            .entry(store.shard_of(&plan.tenant(n)))
            .or_default() += 1;
        if result == Ok(HitOutcome::Ok) {
            granted.push(n);
        }
        burst.add(hit_name(&result), took);
    }
    burst.print("burst", started.elapsed());

    // 2. Commit the granted claims, leaving a few per tenant pending.
    granted.sort_unstable();
    let mut left: BTreeMap<String, usize> = BTreeMap::new();
    let mut pending = Vec::new();
    let mut committed = Vec::new();
    for &n in &granted {
        let seen = left.entry(plan.tenant(n)).or_default();
        if *seen < plan.args.leave_pending {
            *seen += 1;
            pending.push(n);
        } else {
            committed.push(n);
        }
    }
    let started = Instant::now();
    let mut settles = Vec::new();
    for &n in &committed {
        let (store, plan, permits) = (store.clone(), plan.clone(), permits.clone());
        settles.push(tokio::spawn(async move {
            let _permit = permits.acquire_owned().await;
            let tenant = plan.tenant(n);
            let req = SettleRequest {
                claim: plan.claim(&tenant, n, "hook"),
                settlement: Settlement::Commit,
            };
            let t = Instant::now();
            let result = store.settle(req, timeout).await;
            (result, t.elapsed())
        }));
    }
    let mut settled = Tally::default();
    for call in settles {
        if let Ok((result, took)) = call.await {
            settled.add(settle_name(&result), took);
        }
    }
    settled.print(
        &format!("settle (commit; {} left pending)", pending.len()),
        started.elapsed(),
    );

    // 3. Replay every claimed key from another hook.
    let started = Instant::now();
    let mut replays = Vec::new();
    for &n in granted.iter() {
        let (store, plan, permits) = (store.clone(), plan.clone(), permits.clone());
        replays.push(tokio::spawn(async move {
            let _permit = permits.acquire_owned().await;
            let tenant = plan.tenant(n);
            let req = HitRequest {
                charges: Vec::new(),
                claim: Some(plan.claim(&tenant, n, "retry")),
            };
            let t = Instant::now();
            let result = store.hit(req, timeout).await;
            (result, t.elapsed())
        }));
    }
    let mut replay = Tally::default();
    for call in replays {
        if let Ok((result, took)) = call.await {
            replay.add(hit_name(&result), took);
        }
    }
    replay.print("replay (same keys, other hooks)", started.elapsed());

    // Where the hits went.
    let holders = lease_holders(store.nats(), &plan.args.instance).await;
    if !holders.is_empty() {
        let mut per_node: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
        for (shard, holder) in &holders {
            per_node.entry(holder).or_default().0 += 1;
            per_node.entry(holder).or_default().1 += per_shard.get(shard).copied().unwrap_or(0);
        }
        println!("nodes (by shard lease):");
        for (node, (shards, hits)) in per_node {
            println!("  {node:<16} {shards:>4} shards, {hits:>6} burst hits");
        }
    }

    let errors = burst.errors() + settled.errors() + replay.errors();
    if errors > 0 {
        println!("{errors} calls failed");
        if plan.args.strict {
            return std::process::ExitCode::FAILURE;
        }
    }
    std::process::ExitCode::SUCCESS
}
