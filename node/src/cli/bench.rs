//! `ankusa bench`: the workload ([`crate::bench::workload`]) against a running
//! fleet, or with `--compare` side by side, in one invocation and with the same
//! workload, against
//!
//! 1. the bare NATS echo ([`EchoResponder`] + [`EchoStore`]): the transport alone;
//! 2. Redis + Lua ([`RedisLuaStore`]) at `--redis-url`: the incumbent design;
//! 3. the fleet without edge batching, and 4. with it;
//! 5. the same batching edge against a node that does nothing
//!    ([`NodeEchoResponder`]): the most batching can gain on this host, the
//!    bound that "fleet+batch / echo" is read against;
//!
//! then, open loop at half of the fleet's measured peak, the fleet and the echo
//! again, to compare their p99 at a rate both can sustain.
//!
//! With `--rounds N` the stores take turns: each round runs all five, then
//! each round both open loops, and every ratio is the median of its rounds'.
//! A shared host's speed drifts by tens of percent within minutes; stores
//! measured seconds apart in the same round see about the same host, and the
//! median leaves out a round that a neighbour's burst fell on. Round r starts
//! with the store after round r-1's first (and an open loop's pair swaps who
//! goes first), so that no store always runs first on a quiet host or after
//! the same neighbour.
//!
//! Every run is preceded by a warm-up (`--warmup-s`) of the same plan, and
//! each store keeps one client (and connection) across rounds: what is
//! measured is the store in steady state, not its first sight of the tenants
//! or a new client learning its routes. A ratio is judged only on runs whose
//! figures stand ([`WorkloadReport::flaw`]): otherwise it is printed `n/a`
//! with the reason. The targets are loopback only: `--nats` and `--redis-url`
//! must name this host unless `--allow-remote`.
//!
//! The subcommands `durable`, `recovery` and `memory` are in
//! [`super::kvbench`] and [`super::memory`].

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ankusa_bus::{FleetConfig, FleetStore, NatsOptions, Store};
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::bench::cpu::{self, Watched};
use crate::bench::report::{comparison_table, cpu_table};
use crate::bench::workload::{self, BucketLimits};
use crate::bench::{
    EchoResponder, EchoStore, LoadMode, NodeEchoResponder, RedisLuaStore, TenantDistribution,
};
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
    /// Multiplexed connections to Redis (1 to 64)
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub redis_pool: u16,
    /// Skip the open-loop runs at half the fleet's peak
    #[arg(long)]
    pub no_half_peak: bool,
    /// With --compare: rounds in which the stores take turns (1 to 20); each
    /// ratio is the median of its rounds'
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub rounds: u32,
    /// Write the report(s) as JSON to this file
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Let --nats and --redis-url name another host (the bench is meant for
    /// loopback: its load would be a remote system's, and its figures the
    /// network's)
    #[arg(long, global = true)]
    pub allow_remote: bool,
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
    /// Before each run, run the same workload (same tenants) this long,
    /// unmeasured, seconds (0 to 60) [default: 2, or --duration-s if shorter]
    #[arg(long, value_parser = warmup_seconds)]
    pub warmup_s: Option<f64>,
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
    /// Also report the CPU of process PID, as NAME (repeat it; processes
    /// sharing a name are summed), e.g. --cpu-of nats-server=1234
    #[arg(long = "cpu-of", value_name = "NAME=PID")]
    pub cpu_of: Vec<Watched>,
}

/// The warm-up when `--warmup-s` is not given, seconds: enough to start a
/// thousand tenants and let a new client learn its routes.
const DEFAULT_WARMUP_S: f64 = 2.0;

/// `--warmup-s`: a number of seconds from 0 to 60 (a NaN would get past a
/// clamp, and make no duration).
fn warmup_seconds(text: &str) -> Result<f64, String> {
    let most = workload::MAX_WARMUP.as_secs_f64();
    match text.parse::<f64>() {
        Ok(s) if (0.0..=most).contains(&s) => Ok(s),
        _ => Err(format!(
            "`{text}`: say a number of seconds from 0 to {most}"
        )),
    }
}

impl WorkloadArgs {
    pub fn config(&self, global: &Global) -> Result<WorkloadConfig, CliError> {
        if !(self.duration_s.is_finite() && self.duration_s > 0.0) {
            return Err(CliError::Usage("--duration-s must be above 0".into()));
        }
        // A short run (a test's, a smoke run's) gets a warm-up as short.
        let warmup_s = self
            .warmup_s
            .unwrap_or(DEFAULT_WARMUP_S.min(self.duration_s));
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
            warmup: Duration::from_secs_f64(
                warmup_s.clamp(0.0, workload::MAX_WARMUP.as_secs_f64()),
            ),
            max_hits: self.max_hits,
            timeout: global.timeout(Duration::from_millis(250)),
            claim_share: self.claim_share,
            duplicate_rate: self.duplicate_rate,
            release_share: self.release_share,
            payload_bytes: self.payload_bytes,
            limits: BucketLimits::generous(),
            ttl_ms: self.ttl_ms,
            seed: self.seed,
            watch: self.cpu_of.clone(),
            ..WorkloadConfig::default()
        };
        if let Some(gone) = self.cpu_of.iter().find(|w| cpu::of_pid(w.pid).is_none()) {
            return Err(CliError::Usage(format!(
                "--cpu-of {}={}: no process {} whose CPU this host tells",
                gone.name, gone.pid, gone.pid
            )));
        }
        cfg.validate()
            .map_err(|e| CliError::Usage(format!("workload: {e}")))?;
        Ok(cfg)
    }
}

pub async fn bench(global: &Global, args: BenchArgs) -> Result<(), CliError> {
    if !args.allow_remote {
        let redis = args.compare.then_some(args.redis_url.as_str());
        check_loopback(&global.nats_options().servers, redis)?;
    }
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
    let batching = args.workload.batching;
    let store = connect_edge(edge_config(global, &args.workload, batching)).await?;
    let report = measure(&store, &cfg, fleet_label(batching)).await?;
    println!("{report}");
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}

/// Refuses NATS servers or a Redis URL (when given) that are not on this
/// host: the bench is for loopback, see `--allow-remote`.
fn check_loopback(nats: &[String], redis: Option<&str>) -> Result<(), CliError> {
    let named = nats
        .iter()
        .map(|url| ("--nats", url.as_str()))
        .chain(redis.map(|url| ("--redis-url", url)));
    for (flag, url) in named {
        if !is_loopback_url(url) {
            return Err(CliError::Usage(format!(
                "{flag} {url}: not this host; the bench is meant for loopback \
                 (give --allow-remote to run it anyway)"
            )));
        }
    }
    Ok(())
}

/// Whether `url` (`scheme://[user[:pass]@]host[:port][/...]`, or without a
/// scheme) names this host: `localhost`, a loopback address, or a Unix socket.
fn is_loopback_url(url: &str) -> bool {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    if matches!(scheme, "unix" | "redis+unix") {
        return true;
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_port = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let host = match host_port.strip_prefix('[') {
        // [v6]:port
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host_port.split(':').next().unwrap_or_default(),
    };
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn fleet_label(batching: bool) -> &'static str {
    if batching {
        "fleet+batch"
    } else {
        "fleet"
    }
}

/// The edge client's configuration for the fleet, with the workload's edge
/// knobs.
fn edge_config(global: &Global, args: &WorkloadArgs, batching: bool) -> FleetConfig {
    let mut config = global.fleet_config(batching);
    if let Some(n) = args.edge_in_flight {
        config.max_in_flight = n;
    }
    if let Some(n) = args.edge_max_batch {
        config.max_batch = n;
    }
    config
}

/// An edge client, connected.
async fn connect_edge(config: FleetConfig) -> Result<Arc<FleetStore>, CliError> {
    let store = FleetStore::connect(config).await?;
    super::wait_connected(store.nats(), Duration::from_secs(5)).await?;
    Ok(Arc::new(store))
}

/// Runs the workload against `store`, its report under `label`.
async fn measure<S: Store>(
    store: &Arc<S>,
    cfg: &WorkloadConfig,
    label: &str,
) -> Result<WorkloadReport, CliError> {
    let warmup = if cfg.warmup.is_zero() {
        String::new()
    } else {
        format!(" after a {:.1} s warm-up", cfg.warmup.as_secs_f64())
    };
    eprintln!("bench: {label}, {}{warmup} ...", cfg.mode_label());
    Ok(workload::run(Arc::clone(store), cfg).await?.labelled(label))
}

/// The echo responders (the bare one on `base`, the node echo on its
/// instance) on a runtime and NATS connection of their own, as a separate
/// responder process would have: the load generator's tasks do not share
/// their scheduler.
struct EchoServer {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EchoServer {
    fn start(nats: NatsOptions, base: String, node_instance: String) -> Result<Self, CliError> {
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
                        let node = NodeEchoResponder::start(client.clone(), &node_instance)
                            .await
                            .map_err(|e| e.to_string())?;
                        let bare = EchoResponder::start(client, base)
                            .await
                            .map_err(|e| e.to_string())?;
                        Ok::<_, String>((bare, node))
                    };
                    match started.await {
                        Ok(responders) => {
                            let _ = ready_tx.send(Ok(()));
                            let _ = stopped.await;
                            drop(responders);
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

/// What a ratio is held to.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    AtLeast(f64),
    AtMost(f64),
    /// No target; at most 1 counts as met.
    LowerIsBetter,
    /// Not judged: a bound the targets are read against.
    Context,
}

impl Target {
    fn met(self, value: f64) -> Option<bool> {
        match self {
            Target::AtLeast(t) => Some(value >= t),
            Target::AtMost(t) => Some(value <= t),
            Target::LowerIsBetter => Some(value <= 1.0),
            Target::Context => None,
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::AtLeast(t) => write!(f, ">= {t}"),
            Target::AtMost(t) => write!(f, "<= {t}"),
            Target::LowerIsBetter => f.write_str("lower is better"),
            Target::Context => f.write_str("none (a bound)"),
        }
    }
}

/// One ratio, with the target it is held to: of one round, or the median of
/// every round's (then `rounds` holds each round's value).
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    pub what: String,
    pub value: Option<f64>,
    pub target: Target,
    pub met: Option<bool>,
    /// Why the ratio is not judged though it may have a value: a run it is
    /// taken from has figures that cannot stand ([`WorkloadReport::flaw`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub invalid: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rounds: Vec<Option<f64>>,
}

impl Ratio {
    fn new(what: impl Into<String>, value: Option<f64>, target: Target) -> Self {
        Self {
            what: what.into(),
            value,
            target,
            met: value.and_then(|v| target.met(v)),
            invalid: None,
            rounds: Vec::new(),
        }
    }

    /// A ratio between figures of `runs`: not judged when any of them has
    /// figures that cannot stand.
    fn of(
        what: impl Into<String>,
        value: Option<f64>,
        target: Target,
        runs: &[&WorkloadReport],
    ) -> Self {
        let flaw = runs
            .iter()
            .find_map(|r| r.flaw().map(|flaw| format!("{}: {flaw}", r.label)));
        Self::new(what, value, target).unjudged(flaw)
    }

    /// The same ratio, not judged, for `why` (when there is one).
    fn unjudged(mut self, why: Option<String>) -> Self {
        if why.is_some() {
            self.met = None;
            self.invalid = why;
        }
        self
    }

    /// The median of the rounds' values of the same ratio; a round without a
    /// value (a run without hits) is left out. Judged only when every round
    /// could be: a round in which a store failed calls (or the load generator
    /// fell behind) says the comparison did not hold, whatever the others say.
    fn median_of(rounds: &[&Ratio]) -> Option<Self> {
        let first = rounds.first()?;
        let values: Vec<Option<f64>> = rounds.iter().map(|r| r.value).collect();
        let median = median(values.iter().flatten().copied().collect());
        let several = rounds.len() > 1;
        let invalid = rounds.iter().enumerate().find_map(|(i, r)| {
            let why = r.invalid.as_ref()?;
            Some(if several {
                format!("round {}, {why}", i + 1)
            } else {
                why.clone()
            })
        });
        Some(
            Self {
                rounds: values,
                ..Self::new(first.what.clone(), median, first.target)
            }
            .unjudged(invalid),
        )
    }

    /// `met`, `MISSED`, or `n/a` (with why, when a run was unfit).
    fn verdict(&self) -> String {
        match (&self.invalid, self.met) {
            (Some(why), _) => format!("n/a: {why}"),
            (None, Some(true)) => "met".into(),
            (None, Some(false)) => "MISSED".into(),
            (None, None) => "n/a".into(),
        }
    }
}

/// The ratios of several rounds, each the median of its rounds' values.
/// Every round lists the same ratios in the same order.
fn median_ratios(rounds: &[&[Ratio]]) -> Vec<Ratio> {
    let count = rounds.iter().map(|r| r.len()).min().unwrap_or(0);
    (0..count)
        .filter_map(|i| Ratio::median_of(&rounds.iter().map(|r| &r[i]).collect::<Vec<_>>()))
        .collect()
}

#[derive(Debug, Clone, Serialize)]
pub struct CompareReport {
    pub rounds: Vec<CompareRound>,
    /// Each the median of the rounds' (with one round, that round's).
    pub ratios: Vec<Ratio>,
}

/// One round: the stores at peak, the open loops, and their ratios.
#[derive(Debug, Clone, Serialize)]
pub struct CompareRound {
    /// echo, redis-lua, fleet, fleet+batch, echo+batch.
    pub peak: Vec<WorkloadReport>,
    /// The labels of `peak` in the order they ran: each round starts one
    /// store later than the last.
    pub order: Vec<String>,
    /// Open loop at half the fleet's peak, per fleet client mode.
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
    /// The fleet's run came before the echo's (the two take turns).
    pub fleet_first: bool,
}

/// The name `--cpu-of` gives the fleet's nodes (`scripts/bench.sh` does), for
/// the bound on what a cheaper node could gain.
const NODE_PROCESS: &str = "node";

/// A store run at peak, in the order [`Peaks`] and the report list them.
#[derive(Debug, Clone, Copy, PartialEq)]
enum PeakStore {
    Echo,
    Redis,
    Fleet,
    FleetBatch,
    /// The edge, batching, against the node echo.
    EchoBatch,
}

impl PeakStore {
    const ALL: [PeakStore; 5] = [
        PeakStore::Echo,
        PeakStore::Redis,
        PeakStore::Fleet,
        PeakStore::FleetBatch,
        PeakStore::EchoBatch,
    ];

    fn label(self) -> &'static str {
        match self {
            PeakStore::Echo => "echo",
            PeakStore::Redis => "redis-lua",
            PeakStore::Fleet => "fleet",
            PeakStore::FleetBatch => "fleet+batch",
            PeakStore::EchoBatch => "echo+batch",
        }
    }

    /// The order of round `round` (from 0): each round starts one store
    /// later, so that no store always runs first (on a host still quiet from
    /// the last round's open loops) or always after the same neighbour.
    fn order(round: usize) -> [PeakStore; 5] {
        std::array::from_fn(|i| Self::ALL[(i + round) % Self::ALL.len()])
    }
}

/// Whether the fleet's open loop runs before the echo's, for fleet client
/// mode `mode` (0 unbatched, 1 batched) in round `round` (from 0): in turn,
/// round by round and mode by mode, so that neither always runs second on a
/// host the other has just warmed (or loaded).
fn fleet_first(round: usize, mode: usize) -> bool {
    (round + mode) % 2 == 0
}

/// The stores of a comparison, each with one client (and connection) for
/// every round: a new edge client would learn its reply inbox and the nodes'
/// routes inside each measured run, where the echo's and Redis's are reused.
struct Stores {
    echo: Arc<EchoStore>,
    redis: Arc<RedisLuaStore>,
    fleet: Arc<FleetStore>,
    fleet_batch: Arc<FleetStore>,
    echo_batch: Arc<FleetStore>,
}

impl Stores {
    async fn peak(
        &self,
        which: PeakStore,
        cfg: &WorkloadConfig,
    ) -> Result<WorkloadReport, CliError> {
        let label = which.label();
        match which {
            PeakStore::Echo => measure(&self.echo, cfg, label).await,
            PeakStore::Redis => measure(&self.redis, cfg, label).await,
            PeakStore::Fleet => measure(&self.fleet, cfg, label).await,
            PeakStore::FleetBatch => measure(&self.fleet_batch, cfg, label).await,
            PeakStore::EchoBatch => measure(&self.echo_batch, cfg, label).await,
        }
    }

    fn fleet(&self, batching: bool) -> &Arc<FleetStore> {
        if batching {
            &self.fleet_batch
        } else {
            &self.fleet
        }
    }
}

/// The stores at peak in one round.
struct Peaks {
    echo: WorkloadReport,
    redis: WorkloadReport,
    fleet: WorkloadReport,
    fleet_batch: WorkloadReport,
    /// The edge, batching, against the node echo.
    echo_batch: WorkloadReport,
}

impl Peaks {
    /// From one run of each store, indexed as [`PeakStore::ALL`].
    fn from_runs(runs: [Option<WorkloadReport>; 5]) -> Result<Self, CliError> {
        match runs {
            [Some(echo), Some(redis), Some(fleet), Some(fleet_batch), Some(echo_batch)] => {
                Ok(Self {
                    echo,
                    redis,
                    fleet,
                    fleet_batch,
                    echo_batch,
                })
            }
            _ => Err(CliError::Other("a store did not run in a round".into())),
        }
    }

    fn ratios(&self, half_peak: &[HalfPeak]) -> Vec<Ratio> {
        let vs = |a: &WorkloadReport, b: &WorkloadReport| a.ratio_to(b);
        let (echo, redis) = (&self.echo, &self.redis);
        let (fleet, batch, echo_batch) = (&self.fleet, &self.fleet_batch, &self.echo_batch);
        let mut ratios = vec![
            Ratio::of(
                "fleet / redis-lua hits/s (no batching)",
                vs(fleet, redis).hits_per_sec,
                Target::AtLeast(1.5),
                &[fleet, redis],
            ),
            Ratio::of(
                "fleet+batch / redis-lua hits/s",
                vs(batch, redis).hits_per_sec,
                Target::AtLeast(1.5),
                &[batch, redis],
            ),
            Ratio::of(
                "fleet / redis-lua hit p99 (no batching)",
                vs(fleet, redis).hit_p99,
                Target::LowerIsBetter,
                &[fleet, redis],
            ),
            Ratio::of(
                "fleet+batch / redis-lua hit p99",
                vs(batch, redis).hit_p99,
                Target::LowerIsBetter,
                &[batch, redis],
            ),
            Ratio::of(
                "fleet / redis-lua hits/s were the nodes free: a bound",
                fleet
                    .hits_per_sec_without(NODE_PROCESS)
                    .filter(|_| redis.hits_per_sec > 0.0)
                    .map(|free| free / redis.hits_per_sec),
                Target::Context,
                &[fleet, redis],
            ),
            Ratio::of(
                "fleet / echo hits/s (no batching)",
                vs(fleet, echo).hits_per_sec,
                Target::AtLeast(0.5),
                &[fleet, echo],
            ),
            Ratio::of(
                "fleet+batch / echo hits/s",
                vs(batch, echo).hits_per_sec,
                Target::AtLeast(2.0),
                &[batch, echo],
            ),
            Ratio::of(
                "echo+batch / echo hits/s: batching's ceiling here",
                vs(echo_batch, echo).hits_per_sec,
                Target::Context,
                &[echo_batch, echo],
            ),
            Ratio::of(
                "fleet+batch / echo+batch hits/s: of that ceiling",
                vs(batch, echo_batch).hits_per_sec,
                Target::Context,
                &[batch, echo_batch],
            ),
        ];
        for h in half_peak {
            let what = format!(
                "p99 at {:.0}/s (50% of fleet{} peak): fleet / echo{}",
                h.rate_per_sec,
                if h.batching { "+batch" } else { "" },
                if h.echo_saturated {
                    " [echo saturated]"
                } else {
                    ""
                }
            );
            ratios.push(Ratio::of(
                what,
                vs(&h.fleet, &h.echo).hit_p99,
                Target::AtMost(2.0),
                &[&h.fleet, &h.echo],
            ));
        }
        ratios
    }

    fn into_vec(self) -> Vec<WorkloadReport> {
        vec![
            self.echo,
            self.redis,
            self.fleet,
            self.fleet_batch,
            self.echo_batch,
        ]
    }
}

/// The median of some figures (`None` without any).
fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => None,
        n if n % 2 == 1 => Some(values[n / 2]),
        n => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

fn fmt_opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.2}x"))
}

async fn compare(global: &Global, args: &BenchArgs, cfg: WorkloadConfig) -> Result<(), CliError> {
    let base = format!("ankusa_bench.echo.p{}", std::process::id());
    let node_echo = format!("bench-echo-p{}", std::process::id());
    let echo_server = EchoServer::start(global.nats_options(), base.clone(), node_echo.clone())?;
    let echo_client = global.nats_client(Duration::from_secs(5)).await?;
    let redis = RedisLuaStore::connect(&args.redis_url, usize::from(args.redis_pool))
        .await
        .map_err(|e| CliError::Baseline(e.to_string()))?;
    let edge = |batching| edge_config(global, &args.workload, batching);
    let stores = Stores {
        echo: Arc::new(EchoStore::new(echo_client, &base)),
        redis: Arc::new(redis),
        fleet: connect_edge(edge(false)).await?,
        fleet_batch: connect_edge(edge(true)).await?,
        echo_batch: connect_edge(FleetConfig {
            instance: node_echo.clone(),
            ..edge(true)
        })
        .await?,
    };
    let rounds = args.rounds.max(1) as usize;
    let announce = |round: usize, what: &str| {
        if rounds > 1 {
            eprintln!("bench: round {round} of {rounds}, {what}");
        }
    };

    let mut peaks = Vec::with_capacity(rounds);
    let mut orders = Vec::with_capacity(rounds);
    for round in 0..rounds {
        announce(round + 1, "peak");
        let order = PeakStore::order(round);
        // Indexed as `PeakStore::ALL`, which lists the variants in order.
        let mut runs: [Option<WorkloadReport>; 5] = Default::default();
        for which in order {
            runs[which as usize] = Some(stores.peak(which, &cfg).await?);
        }
        peaks.push(Peaks::from_runs(runs)?);
        orders.push(order.map(|s| s.label().to_string()).to_vec());
    }

    // Every round's open loops run at one rate: half the fleet's median peak,
    // of the runs whose figures stand (of all, if none does).
    let median_peak = |pick: fn(&Peaks) -> &WorkloadReport| {
        let rates = |sound_only: bool| {
            peaks
                .iter()
                .map(pick)
                .filter(|r| !sound_only || r.flaw().is_none())
                .map(|r| r.hits_per_sec)
                .collect()
        };
        median(rates(true))
            .or_else(|| median(rates(false)))
            .unwrap_or(0.0)
    };
    let echo_peak = median_peak(|p| &p.echo);
    let modes: [(bool, f64); 2] = [
        (false, median_peak(|p| &p.fleet)),
        (true, median_peak(|p| &p.fleet_batch)),
    ];
    let mut half_peaks: Vec<Vec<HalfPeak>> = (0..rounds).map(|_| Vec::new()).collect();
    if !args.no_half_peak {
        for (round, half_peak) in half_peaks.iter_mut().enumerate() {
            announce(round + 1, "open loops at half the peak");
            for (mode, (batching, peak)) in modes.into_iter().enumerate() {
                let rate = (peak * 0.5).max(1.0);
                let open = WorkloadConfig {
                    mode: LoadMode::Rate {
                        per_sec: rate,
                        max_in_flight: args.workload.max_in_flight,
                    },
                    ..cfg.clone()
                };
                let fleet = stores.fleet(batching);
                let (fleet_label, echo_label) = if batching {
                    ("fleet+b@50%", "echo@50%b")
                } else {
                    ("fleet@50%", "echo@50%")
                };
                let fleet_first = fleet_first(round, mode);
                let (fleet, echo) = if fleet_first {
                    let f = measure(fleet, &open, fleet_label).await?;
                    (f, measure(&stores.echo, &open, echo_label).await?)
                } else {
                    let e = measure(&stores.echo, &open, echo_label).await?;
                    (measure(fleet, &open, fleet_label).await?, e)
                };
                half_peak.push(HalfPeak {
                    batching,
                    rate_per_sec: rate,
                    fleet,
                    echo,
                    echo_saturated: echo_peak < rate,
                    fleet_first,
                });
            }
        }
    }
    drop(stores);
    drop(echo_server);

    let rounds: Vec<CompareRound> = peaks
        .into_iter()
        .zip(half_peaks)
        .zip(orders)
        .map(|((peaks, half_peak), order)| CompareRound {
            ratios: peaks.ratios(&half_peak),
            peak: peaks.into_vec(),
            order,
            half_peak,
        })
        .collect();
    let each: Vec<&[Ratio]> = rounds.iter().map(|r| r.ratios.as_slice()).collect();
    let ratios = median_ratios(&each);
    print_comparison(&cfg, &rounds, &ratios);
    if let Some(path) = &args.json {
        write_json(path, &CompareReport { rounds, ratios })?;
    }
    Ok(())
}

/// The CPU table of `reports`, when any watched a process.
fn print_cpu(reports: &[&WorkloadReport]) {
    let table = cpu_table(reports);
    if !table.is_empty() {
        println!("\n{table}");
    }
}

fn print_comparison(cfg: &WorkloadConfig, rounds: &[CompareRound], ratios: &[Ratio]) {
    let several = rounds.len() > 1;
    for (i, round) in rounds.iter().enumerate() {
        let which = if several {
            format!("round {} of {}, ", i + 1, rounds.len())
        } else {
            String::new()
        };
        println!(
            "== {which}peak, {} ({} tenants) ==",
            cfg.mode_label(),
            cfg.tenants
        );
        println!("(run in the order {})", round.order.join(", "));
        for r in &round.peak {
            println!("{r}");
        }
        let refs: Vec<&WorkloadReport> = round.peak.iter().collect();
        println!("\n{}", comparison_table(&refs));
        print_cpu(&refs);
        if !round.half_peak.is_empty() {
            println!("\n== {which}open loop at 50% of the fleet's peak ==");
            let rows: Vec<&WorkloadReport> = round
                .half_peak
                .iter()
                .flat_map(|h| [&h.echo, &h.fleet])
                .collect();
            println!("{}", comparison_table(&rows));
            print_cpu(&rows);
            println!();
        }
    }
    if several {
        println!(
            "== ratios: the median of {} rounds (each round's) ==",
            rounds.len()
        );
    } else {
        println!("== ratios ==");
    }
    for r in ratios {
        let verdict = r.verdict();
        let each = if several {
            let values: Vec<String> = r
                .rounds
                .iter()
                .map(|v| v.map_or_else(|| "-".into(), |v| format!("{v:.2}")))
                .collect();
            format!("  ({})", values.join(", "))
        } else {
            String::new()
        };
        println!(
            "{:<62} {:>8}  target {:<16} {verdict}{each}",
            r.what,
            fmt_opt(r.value),
            r.target.to_string()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(values: &[Option<f64>]) -> Vec<Ratio> {
        values
            .iter()
            .enumerate()
            .map(|(i, &v)| Ratio::new(format!("r{i}"), v, Target::AtLeast(1.5)))
            .collect()
    }

    #[test]
    fn each_ratio_is_the_median_of_its_rounds() {
        let rounds = [
            round(&[Some(1.4), Some(0.9)]),
            round(&[Some(1.7), None]),
            round(&[Some(1.6), Some(1.1)]),
        ];
        let ratios = median_ratios(&rounds.each_ref().map(Vec::as_slice));
        assert_eq!(ratios.len(), 2);
        assert_eq!(ratios[0].value, Some(1.6), "the middle of three");
        assert_eq!(ratios[0].met, Some(true));
        assert_eq!(ratios[0].rounds, [Some(1.4), Some(1.7), Some(1.6)]);
        // A round without a value is left out: the median of two is their mean.
        assert_eq!(ratios[1].value, Some(1.0));
        assert_eq!(ratios[1].met, Some(false));
        assert_eq!(ratios[1].rounds, [Some(0.9), None, Some(1.1)]);
    }

    #[test]
    fn a_ratio_without_any_value_is_not_judged() {
        let (a, b) = (round(&[None]), round(&[None]));
        let ratios = median_ratios(&[&a, &b]);
        assert_eq!(ratios[0].value, None);
        assert_eq!(ratios[0].met, None);
    }

    #[test]
    fn targets_hold_their_bounds() {
        assert_eq!(Target::AtLeast(1.5).met(1.5), Some(true));
        assert_eq!(Target::AtLeast(1.5).met(1.49), Some(false));
        assert_eq!(Target::AtMost(2.0).met(2.0), Some(true));
        assert_eq!(Target::AtMost(2.0).met(2.01), Some(false));
        assert_eq!(Target::LowerIsBetter.met(0.9), Some(true));
        assert_eq!(Target::LowerIsBetter.met(1.1), Some(false));
        // A bound is printed, never judged.
        assert_eq!(Target::Context.met(1.7), None);
        assert_eq!(Ratio::new("bound", Some(1.7), Target::Context).met, None);
        assert_eq!(Target::AtLeast(1.5).to_string(), ">= 1.5");
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0]), Some(2.5));
        assert_eq!(median(Vec::new()), None);
    }

    use crate::bench::report::tests::{report, CLOSED};

    #[test]
    fn a_ratio_over_an_unfit_run_is_not_judged() {
        let redis = report("redis-lua", CLOSED, 10_000);
        let mut fleet = report("fleet", CLOSED, 20_000);
        let value = fleet.ratio_to(&redis).hits_per_sec;
        let clean = Ratio::of("x", value, Target::AtLeast(1.5), &[&fleet, &redis]);
        assert_eq!((clean.met, clean.invalid.as_deref()), (Some(true), None));
        assert_eq!(clean.verdict(), "met");

        // 0.5 % of the fleet's hits failed: 2.00x, but not "met".
        fleet.hit_outcomes.errors.insert("disconnected".into(), 100);
        let ratio = Ratio::of("x", value, Target::AtLeast(1.5), &[&fleet, &redis]);
        assert_eq!(ratio.value, Some(2.0));
        assert_eq!(ratio.met, None);
        let verdict = ratio.verdict();
        assert!(
            verdict.starts_with("n/a: fleet: 0.50 % of hits failed"),
            "{verdict}"
        );

        // Nor "MISSED": the run says nothing either way.
        let missed = Ratio::of("x", Some(0.5), Target::AtLeast(1.5), &[&redis, &fleet]);
        assert_eq!(missed.met, None);
        let mut stuck = report("echo", CLOSED, 10_000);
        stuck.abandoned = true;
        let bound = Ratio::of("b", Some(1.2), Target::Context, &[&redis, &stuck]);
        assert!(bound.verdict().contains("echo: calls were abandoned"));
    }

    #[test]
    fn a_median_is_not_judged_when_any_round_was_unfit() {
        let clean = |v| Ratio::new("r", Some(v), Target::AtLeast(1.5));
        let unfit = clean(1.9).unjudged(Some("fleet: 1.00 % of hits failed".into()));
        let rounds = [vec![clean(1.6)], vec![unfit], vec![clean(1.7)]];
        let ratios = median_ratios(&rounds.each_ref().map(Vec::as_slice));
        assert_eq!(ratios[0].value, Some(1.7));
        assert_eq!(ratios[0].met, None);
        assert_eq!(
            ratios[0].invalid.as_deref(),
            Some("round 2, fleet: 1.00 % of hits failed")
        );
    }

    #[test]
    fn each_round_starts_with_the_next_store() {
        assert_eq!(PeakStore::order(0), PeakStore::ALL);
        assert_eq!(
            PeakStore::order(1).map(PeakStore::label),
            ["redis-lua", "fleet", "fleet+batch", "echo+batch", "echo"]
        );
        // Over five rounds every store runs first once, and every round runs
        // every store.
        let firsts: Vec<PeakStore> = (0..5).map(|r| PeakStore::order(r)[0]).collect();
        assert_eq!(firsts, PeakStore::ALL);
        for round in 0..7 {
            let order = PeakStore::order(round);
            assert!(PeakStore::ALL.iter().all(|s| order.contains(s)));
        }
        for (i, s) in PeakStore::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i, "ALL is in declaration order");
        }
        // The open loops' pairs take turns, by round and by mode.
        assert!(fleet_first(0, 0) && !fleet_first(0, 1));
        assert!(!fleet_first(1, 0) && fleet_first(1, 1));
    }

    #[test]
    fn only_loopback_targets_are_taken() {
        for url in [
            "nats://127.0.0.1:4222",
            "127.0.0.1:4222",
            "localhost",
            "tls://LOCALHOST:4222",
            "nats://user:pw@127.0.0.1:4222",
            "nats://[::1]:4222",
            "redis://127.0.0.1:6379/",
            "redis://127.0.0.2:6379/0",
            "redis+unix:///tmp/redis.sock",
        ] {
            assert!(is_loopback_url(url), "{url}");
        }
        for url in [
            "nats://10.0.0.5:4222",
            "nats://nats.example.com:4222",
            "nats://localhost.example.com",
            "redis://user@192.168.1.9:6379/",
            "nats://[2001:db8::1]:4222",
            "redis:///",
            "",
        ] {
            assert!(!is_loopback_url(url), "{url}");
        }
        let local = ["nats://127.0.0.1:4222".to_string()];
        assert!(check_loopback(&local, Some("redis://localhost:6379/")).is_ok());
        let err = check_loopback(&local, Some("redis://10.1.1.1/")).unwrap_err();
        assert!(err.to_string().contains("--redis-url"), "{err}");
        assert_eq!(err.exit_code(), 2);
        let remote = [
            "nats://127.0.0.1:4222".into(),
            "nats://10.0.0.2:4222".into(),
        ];
        assert!(check_loopback(&remote, None).is_err());
    }

    #[test]
    fn the_warm_up_defaults_to_two_seconds_or_the_run() {
        use clap::Parser;

        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            global: Global,
            #[command(flatten)]
            workload: WorkloadArgs,
        }
        let config = |args: &[&str]| {
            let cli =
                Cli::try_parse_from([&["ankusa"], args].concat()).map_err(|e| e.to_string())?;
            cli.workload.config(&cli.global).map_err(|e| e.to_string())
        };
        let warmup = |args: &[&str]| config(args).map(|c| c.warmup.as_secs_f64());
        assert_eq!(warmup(&[]), Ok(2.0));
        assert_eq!(warmup(&["--duration-s", "0.4"]), Ok(0.4));
        assert_eq!(warmup(&["--warmup-s", "0"]), Ok(0.0));
        assert_eq!(warmup(&["--warmup-s", "5", "--duration-s", "1"]), Ok(5.0));
        for bad in ["61", "-1", "NaN", "soon"] {
            assert!(warmup(&["--warmup-s", bad]).is_err(), "{bad}");
        }
    }
}
