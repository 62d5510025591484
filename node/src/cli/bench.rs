//! `ankusa bench`: the workload ([`crate::bench::workload`]) against a running
//! fleet, or with `--compare` side by side, in one invocation and with the same
//! workload, against
//!
//! 1. the bare NATS echo ([`EchoResponder`] + [`EchoStore`]): the transport alone;
//! 2. Redis + Lua ([`RedisLuaStore`]) at `--redis-url`: the incumbent design;
//! 3. the fleet without edge batching, and 4. with it;
//!
//! then, open loop at half of the fleet's measured peak, the fleet and the echo
//! again, to compare their p99 at a rate both can sustain. The subcommands
//! `durable`, `recovery` and `memory` are in [`super::kvbench`] and
//! [`super::memory`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ankusa_bus::{FleetStore, NatsOptions};
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::bench::workload::{self, comparison_table, BucketLimits};
use crate::bench::{EchoResponder, EchoStore, LoadMode, RedisLuaStore, TenantDistribution};
use crate::bench::{WorkloadConfig, WorkloadReport};

use super::{write_json, CliError, Global};

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: Option<BenchWhat>,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Also run, in this invocation, the bare NATS echo and Redis + Lua, and
    /// print the ratios (and p99 at half the fleet's peak rate)
    #[arg(long)]
    pub compare: bool,
    /// Redis for the Redis + Lua baseline of --compare
    #[arg(long, default_value = "redis://127.0.0.1:6379/")]
    pub redis_url: String,
    /// Multiplexed connections to Redis
    #[arg(long, default_value_t = 4)]
    pub redis_pool: usize,
    /// Skip the open-loop runs at half the fleet's peak
    #[arg(long)]
    pub no_half_peak: bool,
    /// Write the report(s) as JSON to this file
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Clone, Subcommand)]
pub enum BenchWhat {
    /// Durable claims: KV group commit (KvWriter) vs sequential KV puts
    Durable(super::kvbench::DurableArgs),
    /// Recovery: write one shard's claims to KV, time loading them back
    Recovery(super::kvbench::RecoveryArgs),
    /// Node RSS per committed claim or per idle tenant (drives a running node)
    Memory(super::memory::MemoryArgs),
    /// Write idle tenants' buckets into KV, for a node to load them parked
    SeedParked(super::memory::SeedArgs),
}

fn on_off(text: &str) -> Result<bool, String> {
    match text {
        "on" | "true" | "yes" | "1" => Ok(true),
        "off" | "false" | "no" | "0" => Ok(false),
        other => Err(format!("`{other}`: say on or off")),
    }
}

/// The workload's knobs (see [`WorkloadConfig`]).
#[derive(Debug, Clone, Args)]
pub struct WorkloadArgs {
    /// Tenants the hits spread over
    #[arg(long, default_value_t = 1000)]
    pub tenants: usize,
    /// Zipf exponent of the tenant distribution (0 = uniform)
    #[arg(long, default_value_t = 1.1)]
    pub zipf: f64,
    /// Closed loop: calls in flight
    #[arg(long, default_value_t = 256, conflicts_with = "rate")]
    pub concurrency: usize,
    /// Open loop: hits offered per second (instead of --concurrency)
    #[arg(long)]
    pub rate: Option<f64>,
    /// Open loop: most calls outstanding
    #[arg(long, default_value_t = 8192)]
    pub max_in_flight: usize,
    /// How long to offer load, seconds
    #[arg(long, default_value_t = 10.0)]
    pub duration_s: f64,
    /// Stop after this many hits
    #[arg(long, default_value_t = 100_000_000)]
    pub max_hits: u64,
    /// Share of hits carrying a claim (0..1)
    #[arg(long, default_value_t = 1.0)]
    pub claim_share: f64,
    /// Share of claims re-using a committed key (a redelivery; 0..1)
    #[arg(long, default_value_t = 0.01)]
    pub duplicate_rate: f64,
    /// Share of settles that release (0..1)
    #[arg(long, default_value_t = 0.01)]
    pub release_share: f64,
    /// Payload size charged to the bytes bucket
    #[arg(long, default_value_t = 2048)]
    pub payload_bytes: u64,
    /// TTL of committed claims, ms
    #[arg(long, default_value_t = 30_000)]
    pub ttl_ms: u64,
    /// Edge batching of the fleet client (on/off)
    #[arg(long, default_value = "on", value_parser = on_off, action = clap::ArgAction::Set)]
    pub batching: bool,
    /// With batching: most requests the edge keeps in flight to one node
    /// [default: the edge client's, 4]
    #[arg(long)]
    pub edge_in_flight: Option<usize>,
    /// With batching: most calls in one of the edge's batches
    /// [default: the edge client's, 64]
    #[arg(long)]
    pub edge_max_batch: Option<usize>,
    /// Seed of the random choices
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

impl WorkloadArgs {
    pub fn config(&self, global: &Global) -> Result<WorkloadConfig, CliError> {
        if !(self.duration_s.is_finite() && self.duration_s > 0.0) {
            return Err(CliError::Usage("--duration-s must be above 0".into()));
        }
        let cfg = WorkloadConfig {
            tenants: self.tenants,
            distribution: if self.zipf == 0.0 {
                TenantDistribution::Uniform
            } else {
                TenantDistribution::Zipf { s: self.zipf }
            },
            mode: match self.rate {
                Some(per_sec) => LoadMode::Rate {
                    per_sec,
                    max_in_flight: self.max_in_flight,
                },
                None => LoadMode::Concurrency {
                    in_flight: self.concurrency,
                },
            },
            duration: Duration::from_secs_f64(self.duration_s.min(3600.0)),
            max_hits: self.max_hits,
            timeout: global.timeout(Duration::from_millis(250)),
            claim_share: self.claim_share,
            duplicate_rate: self.duplicate_rate,
            release_share: self.release_share,
            payload_bytes: self.payload_bytes,
            limits: BucketLimits::generous(),
            ttl_ms: self.ttl_ms,
            seed: self.seed,
            ..WorkloadConfig::default()
        };
        cfg.validate()
            .map_err(|e| CliError::Usage(format!("workload: {e}")))?;
        Ok(cfg)
    }
}

pub async fn bench(global: &Global, args: BenchArgs) -> Result<(), CliError> {
    match &args.what {
        Some(BenchWhat::Durable(a)) => return super::kvbench::durable(global, a).await,
        Some(BenchWhat::Recovery(a)) => return super::kvbench::recovery(global, a).await,
        Some(BenchWhat::Memory(a)) => return super::memory::memory(global, a).await,
        Some(BenchWhat::SeedParked(a)) => return super::memory::seed_parked(global, a).await,
        None => {}
    }
    let cfg = args.workload.config(global)?;
    if args.compare {
        return compare(global, &args, cfg).await;
    }
    let report = run_fleet(global, &cfg, &args.workload, args.workload.batching).await?;
    println!("{report}");
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}

async fn run_fleet(
    global: &Global,
    cfg: &WorkloadConfig,
    args: &WorkloadArgs,
    batching: bool,
) -> Result<WorkloadReport, CliError> {
    let mut config = global.fleet_config(batching);
    if let Some(n) = args.edge_in_flight {
        config.max_in_flight = n;
    }
    if let Some(n) = args.edge_max_batch {
        config.max_batch = n;
    }
    let store = FleetStore::connect(config).await?;
    super::wait_connected(store.nats(), Duration::from_secs(5)).await?;
    let label = if batching { "fleet+batch" } else { "fleet" };
    eprintln!("bench: {label}, {} ...", cfg.mode_label());
    Ok(workload::run(Arc::new(store), cfg).await?.labelled(label))
}

/// The echo responder on a runtime and NATS connection of its own, as a
/// separate responder process would have: the load generator's tasks do not
/// share its scheduler.
struct EchoServer {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EchoServer {
    fn start(nats: NatsOptions, base: String) -> Result<Self, CliError> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("echo-responder".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let started = async {
                        let client = nats.connect().await.map_err(|e| e.to_string())?;
                        super::wait_connected(&client, Duration::from_secs(5))
                            .await
                            .map_err(|e| e.to_string())?;
                        EchoResponder::start(client, base)
                            .await
                            .map_err(|e| e.to_string())
                    };
                    match started.await {
                        Ok(responder) => {
                            let _ = ready_tx.send(Ok(()));
                            let _ = stopped.await;
                            drop(responder);
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                        }
                    }
                });
            })
            .map_err(|e| CliError::Baseline(format!("echo thread: {e}")))?;
        match ready_rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => Ok(Self {
                stop: Some(stop),
                thread: Some(thread),
            }),
            Ok(Err(e)) => Err(CliError::Baseline(format!("echo responder: {e}"))),
            Err(_) => Err(CliError::Baseline(
                "echo responder did not start within 10 s".into(),
            )),
        }
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One ratio, with the target it is held to.
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    pub what: String,
    pub value: Option<f64>,
    pub target: String,
    pub met: Option<bool>,
}

fn ratio(what: &str, value: Option<f64>, target: &str, ok: impl Fn(f64) -> bool) -> Ratio {
    Ratio {
        what: what.into(),
        value,
        target: target.into(),
        met: value.map(ok),
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct CompareReport {
    pub peak: Vec<WorkloadReport>,
    /// Open loop at half the fleet's peak: (rate, fleet, echo) per fleet client mode.
    pub half_peak: Vec<HalfPeak>,
    pub ratios: Vec<Ratio>,
}

#[derive(Debug, Clone, Serialize)]
pub struct HalfPeak {
    pub batching: bool,
    pub rate_per_sec: f64,
    pub fleet: WorkloadReport,
    pub echo: WorkloadReport,
    /// The echo's closed-loop peak was below the offered rate: its p99 then
    /// measures queueing, and the ratio flatters the fleet.
    pub echo_saturated: bool,
}

fn fmt_opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.2}x"))
}

async fn compare(global: &Global, args: &BenchArgs, cfg: WorkloadConfig) -> Result<(), CliError> {
    let base = format!("ankusa_bench.echo.p{}", std::process::id());
    let echo_server = EchoServer::start(global.nats_options(), base.clone())?;
    let echo_client = global.nats_client(Duration::from_secs(5)).await?;
    let echo = Arc::new(EchoStore::new(echo_client, &base));

    eprintln!("bench: echo, {} ...", cfg.mode_label());
    let echo_peak = workload::run(Arc::clone(&echo), &cfg)
        .await?
        .labelled("echo");
    let redis = RedisLuaStore::connect(&args.redis_url, args.redis_pool)
        .await
        .map_err(|e| CliError::Baseline(e.to_string()))?;
    eprintln!("bench: redis-lua, {} ...", cfg.mode_label());
    let redis_peak = workload::run(Arc::new(redis), &cfg)
        .await?
        .labelled("redis-lua");
    let fleet = run_fleet(global, &cfg, &args.workload, false).await?;
    let fleet_batch = run_fleet(global, &cfg, &args.workload, true).await?;

    let mut half_peak = Vec::new();
    if !args.no_half_peak {
        for (batching, peak) in [(false, &fleet), (true, &fleet_batch)] {
            let rate = (peak.hits_per_sec * 0.5).max(1.0);
            let open = WorkloadConfig {
                mode: LoadMode::Rate {
                    per_sec: rate,
                    max_in_flight: args.workload.max_in_flight,
                },
                ..cfg.clone()
            };
            let label = if batching { "fleet+b@50%" } else { "fleet@50%" };
            let f = run_fleet(global, &open, &args.workload, batching)
                .await?
                .labelled(label);
            eprintln!("bench: echo, {} ...", open.mode_label());
            let e = workload::run(Arc::clone(&echo), &open)
                .await?
                .labelled(if batching { "echo@50%b" } else { "echo@50%" });
            half_peak.push(HalfPeak {
                batching,
                rate_per_sec: rate,
                fleet: f,
                echo: e,
                echo_saturated: echo_peak.hits_per_sec < rate,
            });
        }
    }
    drop(echo_server);

    let vs = |a: &WorkloadReport, b: &WorkloadReport| a.ratio_to(b);
    let mut ratios = vec![
        ratio(
            "fleet / redis-lua hits/s (no batching)",
            vs(&fleet, &redis_peak).hits_per_sec,
            ">= 1.5",
            |r| r >= 1.5,
        ),
        ratio(
            "fleet+batch / redis-lua hits/s",
            vs(&fleet_batch, &redis_peak).hits_per_sec,
            ">= 1.5",
            |r| r >= 1.5,
        ),
        ratio(
            "fleet / redis-lua hit p99 (no batching)",
            vs(&fleet, &redis_peak).hit_p99,
            "lower is better",
            |r| r <= 1.0,
        ),
        ratio(
            "fleet+batch / redis-lua hit p99",
            vs(&fleet_batch, &redis_peak).hit_p99,
            "lower is better",
            |r| r <= 1.0,
        ),
        ratio(
            "fleet / echo hits/s (no batching)",
            vs(&fleet, &echo_peak).hits_per_sec,
            ">= 0.5",
            |r| r >= 0.5,
        ),
        ratio(
            "fleet+batch / echo hits/s",
            vs(&fleet_batch, &echo_peak).hits_per_sec,
            ">= 2",
            |r| r >= 2.0,
        ),
    ];
    for h in &half_peak {
        ratios.push(ratio(
            &format!(
                "p99 at {:.0}/s (50% of fleet{} peak): fleet / echo{}",
                h.rate_per_sec,
                if h.batching { "+batch" } else { "" },
                if h.echo_saturated {
                    " [echo saturated]"
                } else {
                    ""
                }
            ),
            vs(&h.fleet, &h.echo).hit_p99,
            "<= 2",
            |r| r <= 2.0,
        ));
    }

    let peak = vec![echo_peak, redis_peak, fleet, fleet_batch];
    println!("== peak, {} ({} tenants) ==", cfg.mode_label(), cfg.tenants);
    for r in &peak {
        println!("{r}");
    }
    let refs: Vec<&WorkloadReport> = peak.iter().collect();
    println!("\n{}", comparison_table(&refs));
    if !half_peak.is_empty() {
        println!("\n== open loop at 50% of the fleet's peak ==");
        let mut rows: Vec<&WorkloadReport> = Vec::new();
        for h in &half_peak {
            rows.push(&h.echo);
            rows.push(&h.fleet);
        }
        println!("{}", comparison_table(&rows));
    }
    println!("\n== ratios ==");
    for r in &ratios {
        let verdict = match r.met {
            Some(true) => "met",
            Some(false) => "MISSED",
            None => "n/a",
        };
        println!(
            "{:<62} {:>8}  target {:<16} {verdict}",
            r.what,
            fmt_opt(r.value),
            r.target
        );
    }
    if let Some(path) = &args.json {
        let report = CompareReport {
            peak,
            half_peak,
            ratios,
        };
        write_json(path, &report)?;
    }
    Ok(())
}
