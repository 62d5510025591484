//! The workload driver: hooks arriving for many tenants, run against any
//! [`Store`], with the same shape whatever is behind it.
//!
//! Each hit charges a tenant's two buckets (`hooks`: one hook; `bytes`: the
//! payload's size) and, in [`WorkloadConfig::claim_share`] of hits, claims a
//! provider event key. A claim uses a fresh key, except that
//! [`WorkloadConfig::duplicate_rate`] of them re-use a key committed a moment
//! ago with a new hook id — a redelivery, which must be answered `Duplicate`.
//! Every `Ok` with a claim is followed by its settle: a commit, or a release in
//! [`WorkloadConfig::release_share`] of them.
//!
//! Two ways to apply load ([`LoadMode`]):
//! - **fixed concurrency** (closed loop): N workers, each with one call in
//!   flight at a time; latency is from each call's send;
//! - **fixed offered rate** (open loop): hit *i* is due at `start + i / rate`,
//!   whether or not earlier ones have been answered, and its latency is measured
//!   from that *intended* time, so a stall is charged to every hit it delayed
//!   (no coordinated omission). `max_in_flight` bounds memory; a hit waiting for
//!   a slot is still timed from when it was due.
//!
//! A run is bounded by its duration and by `max_hits`; every call by the
//! per-call timeout (and a store that overruns it is counted as such). The run
//! uses tenant names and keys unique to it, so runs against a long-lived store
//! do not see each other's buckets or claims.
//!
//! With [`WorkloadConfig::warmup`], the same plan (the same tenant names) first
//! runs that long and its figures are thrown away: a store's first call for a
//! tenant starts that tenant's state (an actor, Lua keys), and a new client
//! learns its routes, which is not what a store costs in steady state.
//!
//! Throughput counts *answered* calls only: those the store answered with an
//! outcome (ok, duplicate, pending, rate limited; a settle's four). A failed
//! call (timeout, disconnected, refused, ...) can come back at once, and a
//! closed-loop worker then spins: counted as throughput, failures would raise
//! hits/s and lower the p50. They are counted by kind, and their latency kept
//! in histograms of their own, in HDR histograms at µs resolution like the
//! answered calls'.

use std::fmt;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ankusa_actors::{
    Charge, Claim, HitOutcome, HitRequest, Kind, SettleOutcome, SettleRequest, Settlement,
};
use ankusa_bus::Store;
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::cpu::{self, HostCpu, Watched};
use super::report::{error_kind, HitCounts, LatencySummary, SettleCounts, WorkloadReport};

/// The longest run a config may ask for.
pub const MAX_DURATION: Duration = Duration::from_secs(3600);
/// The longest warm-up a config may ask for: enough to start every tenant and
/// grow every table, short enough that a comparison of many runs stays bounded.
pub const MAX_WARMUP: Duration = Duration::from_secs(60);
/// Most calls one run may have in flight.
pub const MAX_IN_FLIGHT: usize = 65_536;
/// How long past its own budget a store may take before the driver gives up on
/// the call and counts it as `budget_overrun` (the contract's limit is hard).
pub const OVERRUN_GRACE: Duration = Duration::from_millis(25);
/// How many recently committed keys are kept for duplicates to draw from.
const RECENT_KEYS: usize = 4096;
/// Slack above a run's longest possible latency in its histograms' range.
const HIST_SLACK: Duration = Duration::from_secs(1);
/// Mixed into the seed of a warm-up's random choices, so that the measured run
/// draws the same sequence as a run without a warm-up would.
const WARMUP_SEED: u64 = 0x5741_524d_5550;
/// How long the open loop waits for its aborted calls to be gone.
const ABORT_WAIT: Duration = Duration::from_secs(1);
/// An open-loop hit sent this long after it was due counts as a late send.
const LATE_SEND: Duration = Duration::from_millis(1);
/// The open loop's scheduler sleeps at least this long between wake-ups and
/// then sends every hit that has fallen due: a wake-up per hit would cost the
/// load generator more CPU than the calls themselves at tens of thousands a
/// second, taken from the stores it measures on a shared host. Hits are still
/// timed from when they were due, so the wait counts in every latency.
const DISPATCH_QUANTUM: Duration = Duration::from_micros(100);
/// How often the open loop's collector takes the finished calls: one wake-up
/// per call would be one more thread switch per call.
const COLLECT_EVERY: Duration = Duration::from_millis(2);

/// How a config can be wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WorkloadError {
    #[error("`{field}` must be {rule}, got {value}")]
    Invalid {
        field: &'static str,
        rule: &'static str,
        value: String,
    },
    #[error("a workload task panicked: {0}")]
    Task(String),
}

fn invalid(field: &'static str, rule: &'static str, value: impl fmt::Display) -> WorkloadError {
    WorkloadError::Invalid {
        field,
        rule,
        value: value.to_string(),
    }
}

/// How hits spread over the tenants.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TenantDistribution {
    /// Every tenant equally often.
    Uniform,
    /// Tenant of rank k (1-based) with weight 1/k^s: a few hot tenants.
    Zipf { s: f64 },
}

/// How load is applied.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LoadMode {
    /// Closed loop: `in_flight` workers, one call outstanding each.
    Concurrency { in_flight: usize },
    /// Open loop: `per_sec` hits offered on a fixed schedule, at most
    /// `max_in_flight` outstanding.
    Rate { per_sec: f64, max_in_flight: usize },
}

/// Every tenant's limits, from which each hit's two charges are derived.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BucketLimits {
    /// Sustained hooks per second per tenant (the `hooks` increment is 1/rate).
    pub hooks_per_sec: f64,
    /// Sustained payload bytes per second per tenant.
    pub bytes_per_sec: f64,
    /// Burst allowance of both buckets: their capacity, in ms.
    pub burst_ms: u64,
}

impl BucketLimits {
    /// Limits far above what one tenant gets in a bench: nearly every hit passes,
    /// so the run measures the claim path.
    pub fn generous() -> Self {
        Self {
            hooks_per_sec: 100_000.0,
            bytes_per_sec: 1e9,
            burst_ms: 1000,
        }
    }

    /// Limits every tenant blows through at once: nearly every hit is
    /// `RateLimited`, so the run measures the denial path.
    pub fn saturating() -> Self {
        Self {
            hooks_per_sec: 1.0,
            bytes_per_sec: 1e3,
            burst_ms: 1,
        }
    }

    /// `(increment_us, capacity_us)` of the hooks and the bytes bucket.
    fn buckets(&self, payload_bytes: u64) -> [(u64, u64); 2] {
        let burst_us = self.burst_ms.saturating_mul(1000);
        let hooks_inc = (1e6 / self.hooks_per_sec).round().max(1.0) as u64;
        let bytes_inc = (payload_bytes as f64 * 1e6 / self.bytes_per_sec)
            .round()
            .max(1.0) as u64;
        // A charge that exceeds its capacity could never pass (and is invalid),
        // so a bucket always holds at least one hit.
        [
            (hooks_inc, burst_us.max(hooks_inc)),
            (bytes_inc, burst_us.max(bytes_inc)),
        ]
    }
}

impl Default for BucketLimits {
    fn default() -> Self {
        Self::generous()
    }
}

mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}

/// What to run. `Default` is 1000 zipf(1.1) tenants, 256 in flight for 10 s,
/// a claim on every hit, 1 % duplicates and 1 % releases, 2 KiB payloads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkloadConfig {
    pub tenants: usize,
    pub distribution: TenantDistribution,
    pub mode: LoadMode,
    /// How long to offer load (in-flight calls are then let finish).
    #[serde(rename = "duration_ms", with = "millis")]
    pub duration: Duration,
    /// How long to run the same plan first, its figures discarded (0: none).
    #[serde(default, rename = "warmup_ms", with = "millis")]
    pub warmup: Duration,
    /// Stop after this many hits even if time is left.
    pub max_hits: u64,
    /// The per-call budget passed to the store.
    #[serde(rename = "timeout_ms", with = "millis")]
    pub timeout: Duration,
    /// Share of hits that carry a claim, 0..=1.
    pub claim_share: f64,
    /// Share of claims that re-use a recently committed key, 0..=1.
    pub duplicate_rate: f64,
    /// Share of settles that release instead of committing, 0..=1.
    pub release_share: f64,
    /// Payload size charged to the `bytes` bucket.
    pub payload_bytes: u64,
    pub limits: BucketLimits,
    /// How long a committed claim is kept.
    pub ttl_ms: u64,
    /// How long an unsettled claim stays pending.
    pub pending_ttl_ms: u64,
    pub source_id: String,
    /// The node name the claims are made on.
    pub node: String,
    /// Tenant names are `<prefix>-<run id>-<n>`.
    pub tenant_prefix: String,
    /// Seed of the random choices (which tenant, claim or not, ...).
    pub seed: u64,
    /// Show a progress bar on stderr when it is a terminal and the run is long.
    pub progress: bool,
    /// Processes whose CPU the report gives beside the load generator's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub watch: Vec<Watched>,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        Self {
            tenants: 1000,
            distribution: TenantDistribution::Zipf { s: 1.1 },
            mode: LoadMode::Concurrency { in_flight: 256 },
            duration: Duration::from_secs(10),
            warmup: Duration::ZERO,
            max_hits: 100_000_000,
            timeout: Duration::from_millis(250),
            claim_share: 1.0,
            duplicate_rate: 0.01,
            release_share: 0.01,
            payload_bytes: 2048,
            limits: BucketLimits::generous(),
            // Short, so a long bench does not fill the store with committed keys.
            ttl_ms: 30_000,
            pending_ttl_ms: 5_000,
            source_id: "bench".into(),
            node: "bench-edge".into(),
            tenant_prefix: "bench".into(),
            seed: 1,
            progress: true,
            watch: Vec::new(),
        }
    }
}

fn share(field: &'static str, value: f64) -> Result<(), WorkloadError> {
    if (0.0..=1.0).contains(&value) {
        Ok(())
    } else {
        Err(invalid(field, "a share in 0..=1", value))
    }
}

impl WorkloadConfig {
    pub fn validate(&self) -> Result<(), WorkloadError> {
        if self.tenants == 0 || self.tenants > u32::MAX as usize {
            return Err(invalid("tenants", "in 1..=2^32-1", self.tenants));
        }
        if let TenantDistribution::Zipf { s } = self.distribution {
            if !(s.is_finite() && s >= 0.0) {
                return Err(invalid("distribution.s", "a finite exponent >= 0", s));
            }
        }
        match self.mode {
            LoadMode::Concurrency { in_flight } => {
                if in_flight == 0 || in_flight > MAX_IN_FLIGHT {
                    return Err(invalid("mode.in_flight", "in 1..=65536", in_flight));
                }
            }
            LoadMode::Rate {
                per_sec,
                max_in_flight,
            } => {
                if !(per_sec.is_finite() && per_sec > 0.0 && per_sec <= 1e8) {
                    return Err(invalid("mode.per_sec", "in (0, 1e8]", per_sec));
                }
                if max_in_flight == 0 || max_in_flight > MAX_IN_FLIGHT {
                    return Err(invalid("mode.max_in_flight", "in 1..=65536", max_in_flight));
                }
            }
        }
        if self.duration.is_zero() || self.duration > MAX_DURATION {
            return Err(invalid(
                "duration",
                "in (0, 1 h]",
                format!("{:?}", self.duration),
            ));
        }
        if self.warmup > MAX_WARMUP {
            return Err(invalid(
                "warmup",
                "at most 60 s",
                format!("{:?}", self.warmup),
            ));
        }
        if self.max_hits == 0 {
            return Err(invalid("max_hits", "at least 1", 0));
        }
        if self.timeout.is_zero() || self.timeout > Duration::from_secs(60) {
            return Err(invalid(
                "timeout",
                "in (0, 60 s]",
                format!("{:?}", self.timeout),
            ));
        }
        share("claim_share", self.claim_share)?;
        share("duplicate_rate", self.duplicate_rate)?;
        share("release_share", self.release_share)?;
        let l = self.limits;
        for (field, rate) in [
            ("limits.hooks_per_sec", l.hooks_per_sec),
            ("limits.bytes_per_sec", l.bytes_per_sec),
        ] {
            if !(rate.is_finite() && rate > 0.0) {
                return Err(invalid(field, "a rate > 0", rate));
            }
        }
        // Build one hit and one settle and let the contract's own rules judge
        // the rest (name lengths, capacities, TTLs).
        let probe = Plan::new(self, 0);
        let req = probe.hit_request(0, Some(("k".into(), "h".into())));
        req.validate()
            .map_err(|e| invalid("limits/claim", "a valid request", e))?;
        Ok(())
    }

    /// A short human description of the mode, for tables.
    pub fn mode_label(&self) -> String {
        match self.mode {
            LoadMode::Concurrency { in_flight } => format!("{in_flight} in flight"),
            LoadMode::Rate { per_sec, .. } => format!("{per_sec:.0}/s offered"),
        }
    }
}

/// The name counted when a store did not answer within its budget plus
/// [`OVERRUN_GRACE`]: a breach of the contract, not a timeout it reported.
pub const BUDGET_OVERRUN: &str = "budget_overrun";

// ---------------------------------------------------------------------------
// The driver.

enum Sampler {
    Uniform(usize),
    Zipf(Zipf<f64>, usize),
}

impl Sampler {
    fn tenant(&self, rng: &mut SmallRng) -> u32 {
        let index = match self {
            Sampler::Uniform(n) => rng.random_range(0..*n),
            // Zipf draws a rank in 1..=n.
            Sampler::Zipf(z, n) => (z.sample(rng) as usize).saturating_sub(1).min(n - 1),
        };
        // `validate` keeps `tenants` within u32.
        u32::try_from(index).unwrap_or(u32::MAX)
    }
}

/// A key committed a moment ago, for a redelivery to re-use.
#[derive(Clone)]
struct RecentKey {
    tenant: u32,
    key: Arc<str>,
}

/// A ring of recently committed keys, overwritten oldest first.
#[derive(Default)]
struct RecentKeys {
    slots: Vec<RecentKey>,
    cursor: usize,
}

/// Everything a run shares between its tasks.
struct Plan {
    cfg: WorkloadConfig,
    run: u32,
    tenants: Vec<Arc<str>>,
    sampler: Sampler,
    /// `(kind, increment_us, capacity_us)` of each charge.
    charges: [(Kind, u64, u64); 2],
    recent: Mutex<RecentKeys>,
    /// Hits started (tickets against `max_hits`).
    started: AtomicU64,
    /// Hits answered, for the progress bar.
    answered: AtomicU64,
    /// Makes keys and hook ids unique within the run, warm-up included.
    seq: AtomicU64,
    /// The top of the histograms' range, µs: the longest latency the run can see.
    hist_max_us: u64,
}

/// One hit's random choices, drawn before it is sent.
struct OpSpec {
    tenant: u32,
    /// The key to claim, and whether it is fresh (not a redelivery).
    claim: Option<(Arc<str>, bool)>,
    release: bool,
}

/// How a hit or settle came out, for counting.
enum Class<T> {
    Done(T),
    Failed(String),
}

struct OpResult {
    hit_us: u64,
    hit: Class<HitOutcome>,
    settle: Option<(u64, Class<SettleOutcome>)>,
    done_at: Instant,
    late: bool,
}

impl Plan {
    fn new(cfg: &WorkloadConfig, run: u32) -> Self {
        let n = cfg.tenants.max(1);
        let sampler = match cfg.distribution {
            TenantDistribution::Zipf { s } if n > 1 => match Zipf::new(n as f64, s) {
                Ok(z) => Sampler::Zipf(z, n),
                Err(_) => Sampler::Uniform(n),
            },
            _ => Sampler::Uniform(n),
        };
        let [(hi, hc), (bi, bc)] = cfg.limits.buckets(cfg.payload_bytes);
        Self {
            tenants: (0..n)
                .map(|i| format!("{}-{run:08x}-{i}", cfg.tenant_prefix).into())
                .collect(),
            sampler,
            charges: [(Kind::Hooks, hi, hc), (Kind::Bytes, bi, bc)],
            recent: Mutex::new(RecentKeys::default()),
            started: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            hist_max_us: micros(span(cfg.duration.max(cfg.warmup), cfg) + HIST_SLACK),
            cfg: cfg.clone(),
            run,
        }
    }

    /// Readies the plan for the measured run after its warm-up: `max_hits`
    /// and the progress count start over; the tenants, the key sequence (so
    /// no fresh key repeats one of the warm-up's) and the recent keys stay.
    fn restart(&self) {
        self.started.store(0, Ordering::Relaxed);
        self.answered.store(0, Ordering::Relaxed);
    }

    fn stats(&self) -> Stats {
        Stats::new(self.hist_max_us)
    }

    fn next_id(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Whether another hit may start (`max_hits` not reached).
    fn ticket(&self) -> bool {
        self.started.fetch_add(1, Ordering::Relaxed) < self.cfg.max_hits
    }

    fn draw(&self, rng: &mut SmallRng) -> OpSpec {
        let mut tenant = self.sampler.tenant(rng);
        let mut claim = None;
        if rng.random_bool(self.cfg.claim_share) {
            let mut recent = None;
            if rng.random_bool(self.cfg.duplicate_rate) {
                // A poisoned lock only means another task panicked mid-push;
                // the ring itself is still a valid set of keys.
                let ring = self.recent.lock().unwrap_or_else(|p| p.into_inner());
                if !ring.slots.is_empty() {
                    recent = Some(ring.slots[rng.random_range(0..ring.slots.len())].clone());
                }
            }
            claim = Some(match recent {
                // A redelivery is for the tenant the event belongs to.
                Some(r) => {
                    tenant = r.tenant;
                    (r.key, false)
                }
                None => (
                    format!("e-{:08x}-{}", self.run, self.next_id()).into(),
                    true,
                ),
            });
        }
        OpSpec {
            tenant,
            claim,
            release: rng.random_bool(self.cfg.release_share),
        }
    }

    fn remember(&self, tenant: u32, key: Arc<str>) {
        let mut ring = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if ring.slots.len() < RECENT_KEYS {
            ring.slots.push(RecentKey { tenant, key });
        } else {
            let at = ring.cursor;
            ring.slots[at] = RecentKey { tenant, key };
            ring.cursor = (at + 1) % RECENT_KEYS;
        }
    }

    fn claim(&self, tenant: u32, key: String, hook_id: String) -> Claim {
        Claim {
            tenant: self.tenant_name(tenant).to_string(),
            source_id: self.cfg.source_id.clone(),
            key,
            hook_id,
            node: self.cfg.node.clone(),
            ttl_ms: self.cfg.ttl_ms,
            pending_ttl_ms: self.cfg.pending_ttl_ms,
        }
    }

    fn tenant_name(&self, tenant: u32) -> &str {
        self.tenants
            .get(tenant as usize)
            .map_or("bench", |t| t.as_ref())
    }

    fn hit_request(&self, tenant: u32, claim: Option<(String, String)>) -> HitRequest {
        let name = self.tenant_name(tenant);
        HitRequest {
            charges: self
                .charges
                .iter()
                .map(|&(kind, increment_us, capacity_us)| Charge {
                    kind,
                    tenant: name.to_string(),
                    increment_us,
                    capacity_us,
                })
                .collect(),
            claim: claim.map(|(key, hook)| self.claim(tenant, key, hook)),
        }
    }

    /// Sends one hit (and its settle), timing the hit from `due`.
    async fn execute<S: Store>(&self, store: &S, spec: OpSpec, due: Instant) -> OpResult {
        let budget = self.cfg.timeout;
        let sent = Instant::now();
        let late = sent.saturating_duration_since(due) > LATE_SEND;
        let hook_id = format!("h-{:08x}-{}", self.run, self.next_id());
        let claim = spec
            .claim
            .as_ref()
            .map(|(key, _)| (key.to_string(), hook_id.clone()));
        let req = self.hit_request(spec.tenant, claim);
        let claim = req.claim.clone();
        let hit = match tokio::time::timeout(budget + OVERRUN_GRACE, store.hit(req, budget)).await {
            Ok(Ok(outcome)) => Class::Done(outcome),
            Ok(Err(err)) => Class::Failed(error_kind(&err)),
            Err(_) => Class::Failed(BUDGET_OVERRUN.into()),
        };
        let hit_us = micros(due.elapsed());
        self.answered.fetch_add(1, Ordering::Relaxed);

        let mut settle = None;
        if let (Class::Done(HitOutcome::Ok), Some(claim)) = (&hit, claim) {
            let settlement = if spec.release {
                Settlement::Release
            } else {
                Settlement::Commit
            };
            let req = SettleRequest { claim, settlement };
            let started = Instant::now();
            let class =
                match tokio::time::timeout(budget + OVERRUN_GRACE, store.settle(req, budget)).await
                {
                    Ok(Ok(outcome)) => Class::Done(outcome),
                    Ok(Err(err)) => Class::Failed(error_kind(&err)),
                    Err(_) => Class::Failed(BUDGET_OVERRUN.into()),
                };
            if let (Class::Done(SettleOutcome::Ok), Settlement::Commit, Some((key, true))) =
                (&class, settlement, spec.claim)
            {
                self.remember(spec.tenant, key);
            }
            settle = Some((micros(started.elapsed()), class));
        }
        OpResult {
            hit_us,
            hit,
            settle,
            done_at: Instant::now(),
            late,
        }
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

fn histogram(max_us: u64) -> Histogram<u64> {
    // Low 1, high at least 2 and far below u64::MAX / 2, 3 significant digits:
    // bounds that are always valid.
    let high = max_us.clamp(2, u64::MAX / 4);
    Histogram::new_with_bounds(1, high, 3).expect("clamped histogram bounds are valid")
}

/// Records `us` into `h`, made (with the range `max_us`) on its first sample:
/// failed calls are rare, and a histogram costs ~100 KiB in each of hundreds
/// of tasks.
fn record_into(h: &mut Option<Histogram<u64>>, max_us: u64, us: u64) {
    h.get_or_insert_with(|| histogram(max_us))
        .saturating_record(us);
}

/// Adds `other` into `into`, either of which may not exist yet.
fn merge_into(into: &mut Option<Histogram<u64>>, other: Option<Histogram<u64>>) {
    match (into.as_mut(), other) {
        // Same bounds on both sides; an add that fails would only lose samples.
        (Some(a), Some(b)) => {
            let _ = a.add(&b);
        }
        (None, b) => *into = b,
        (Some(_), None) => {}
    }
}

fn summary(h: &Option<Histogram<u64>>) -> LatencySummary {
    h.as_ref().map(LatencySummary::of).unwrap_or_default()
}

/// What one task (or the collector) has counted.
struct Stats {
    /// Answered hits (an outcome from the store), their latency.
    hit_hist: Histogram<u64>,
    /// Answered settles.
    settle_hist: Histogram<u64>,
    /// Failed hits and settles, kept apart: a failure that comes back at once
    /// would lower the answered calls' percentiles.
    hit_error_hist: Option<Histogram<u64>>,
    settle_error_hist: Option<Histogram<u64>>,
    hits: HitCounts,
    settles: SettleCounts,
    last_done: Option<Instant>,
    late: u64,
    max_us: u64,
}

impl Stats {
    fn new(max_us: u64) -> Self {
        Self {
            hit_hist: histogram(max_us),
            settle_hist: histogram(max_us),
            hit_error_hist: None,
            settle_error_hist: None,
            hits: HitCounts::default(),
            settles: SettleCounts::default(),
            last_done: None,
            late: 0,
            max_us,
        }
    }

    fn record(&mut self, op: OpResult) {
        match op.hit {
            Class::Done(outcome) => {
                self.hit_hist.saturating_record(op.hit_us);
                match outcome {
                    HitOutcome::Ok => self.hits.ok += 1,
                    HitOutcome::Duplicate { .. } => self.hits.duplicate += 1,
                    HitOutcome::Pending { .. } => self.hits.pending += 1,
                    HitOutcome::RateLimited { .. } => self.hits.rate_limited += 1,
                }
            }
            Class::Failed(kind) => {
                record_into(&mut self.hit_error_hist, self.max_us, op.hit_us);
                *self.hits.errors.entry(kind).or_default() += 1;
            }
        }
        if let Some((us, class)) = op.settle {
            match class {
                Class::Done(outcome) => {
                    self.settle_hist.saturating_record(us);
                    match outcome {
                        SettleOutcome::Ok => self.settles.ok += 1,
                        SettleOutcome::NotFound => self.settles.not_found += 1,
                        SettleOutcome::NotOwner { .. } => self.settles.not_owner += 1,
                        SettleOutcome::AlreadyCommitted => self.settles.already_committed += 1,
                    }
                }
                Class::Failed(kind) => {
                    record_into(&mut self.settle_error_hist, self.max_us, us);
                    *self.settles.errors.entry(kind).or_default() += 1;
                }
            }
        }
        self.late += u64::from(op.late);
        self.last_done = Some(self.last_done.map_or(op.done_at, |t| t.max(op.done_at)));
    }

    fn merge(&mut self, other: Stats) {
        // Same bounds on both sides; an add that fails would only lose samples.
        let _ = self.hit_hist.add(&other.hit_hist);
        let _ = self.settle_hist.add(&other.settle_hist);
        merge_into(&mut self.hit_error_hist, other.hit_error_hist);
        merge_into(&mut self.settle_error_hist, other.settle_error_hist);
        let (h, o) = (&mut self.hits, other.hits);
        h.ok += o.ok;
        h.duplicate += o.duplicate;
        h.pending += o.pending;
        h.rate_limited += o.rate_limited;
        for (k, v) in o.errors {
            *h.errors.entry(k).or_default() += v;
        }
        let (s, o) = (&mut self.settles, other.settles);
        s.ok += o.ok;
        s.not_found += o.not_found;
        s.not_owner += o.not_owner;
        s.already_committed += o.already_committed;
        for (k, v) in o.errors {
            *s.errors.entry(k).or_default() += v;
        }
        self.late += other.late;
        self.last_done = match (self.last_done, other.last_done) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
}

/// A progress bar on stderr, only on a terminal and for runs of 2 s or more.
struct Progress {
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Progress {
    fn start(plan: &Arc<Plan>, start: Instant) -> Self {
        let cfg = &plan.cfg;
        if !cfg.progress
            || cfg.duration < Duration::from_secs(2)
            || !std::io::stderr().is_terminal()
        {
            return Self { task: None };
        }
        let total_ms = u64::try_from(cfg.duration.as_millis()).unwrap_or(u64::MAX);
        let bar = indicatif::ProgressBar::new(total_ms);
        if let Ok(style) =
            indicatif::ProgressStyle::with_template("{bar:40} {elapsed}/{duration} {msg}")
        {
            bar.set_style(style);
        }
        let plan = Arc::clone(plan);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                tick.tick().await;
                let elapsed = start.elapsed();
                bar.set_position(u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX));
                let answered = plan.answered.load(Ordering::Relaxed);
                let rate = answered as f64 / elapsed.as_secs_f64().max(1e-3);
                bar.set_message(format!("{answered} hits, {rate:.0}/s"));
                if bar.position() >= total_ms {
                    bar.finish_and_clear();
                    break;
                }
            }
        });
        Self { task: Some(task) }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// How long a phase of `duration` can last: load stops after `duration`;
/// calls then in flight have two budgets (hit and settle) plus slack to finish.
fn span(duration: Duration, cfg: &WorkloadConfig) -> Duration {
    duration + 2 * (cfg.timeout + OVERRUN_GRACE) + Duration::from_secs(1)
}

/// One stretch of load: the warm-up or the measured run.
#[derive(Clone, Copy)]
struct Phase {
    start: Instant,
    /// How long load is offered.
    duration: Duration,
    /// Seed of the random choices.
    seed: u64,
}

impl Phase {
    fn deadline(&self) -> Instant {
        self.start + self.duration
    }

    /// The hard end: calls still in flight then are given up on.
    fn hard_end(&self, cfg: &WorkloadConfig) -> Instant {
        self.start + span(self.duration, cfg)
    }
}

/// What a phase counted, and how it ended.
struct Counted {
    stats: Stats,
    /// Calls were still in flight at the hard end (and were aborted).
    abandoned: bool,
    /// Open loop: hits due within the phase that were never sent.
    unsent: u64,
}

/// The stats the closed loop's tasks count into, one each; empty in the open
/// loop.
fn task_stats(plan: &Plan) -> Vec<Stats> {
    match plan.cfg.mode {
        LoadMode::Concurrency { in_flight } => (0..in_flight).map(|_| plan.stats()).collect(),
        LoadMode::Rate { .. } => Vec::new(),
    }
}

/// Runs one phase of `plan` against `store`.
async fn drive<S: Store>(
    store: &Arc<S>,
    plan: &Arc<Plan>,
    task_stats: Vec<Stats>,
    phase: Phase,
) -> Result<Counted, WorkloadError> {
    match plan.cfg.mode {
        LoadMode::Concurrency { .. } => {
            closed_loop(Arc::clone(store), Arc::clone(plan), task_stats, phase).await
        }
        LoadMode::Rate {
            per_sec,
            max_in_flight,
        } => {
            open_loop(
                Arc::clone(store),
                Arc::clone(plan),
                per_sec,
                max_in_flight,
                phase,
            )
            .await
        }
    }
}

/// One task per element of `task_stats` (the calls in flight), each counting
/// into its own.
async fn closed_loop<S: Store>(
    store: Arc<S>,
    plan: Arc<Plan>,
    task_stats: Vec<Stats>,
    phase: Phase,
) -> Result<Counted, WorkloadError> {
    let deadline = phase.deadline();
    let mut workers = Vec::with_capacity(task_stats.len());
    for (worker, mut stats) in task_stats.into_iter().enumerate() {
        let (store, plan) = (Arc::clone(&store), Arc::clone(&plan));
        workers.push(tokio::spawn(async move {
            let mut rng = SmallRng::seed_from_u64(phase.seed ^ (worker as u64).rotate_left(32));
            while Instant::now() < deadline && plan.ticket() {
                let spec = plan.draw(&mut rng);
                let op = plan.execute(&*store, spec, Instant::now()).await;
                stats.record(op);
            }
            stats
        }));
    }
    let end = phase.hard_end(&plan.cfg);
    let mut total = plan.stats();
    let mut abandoned = false;
    for mut worker in workers {
        match tokio::time::timeout_at(end, &mut worker).await {
            Ok(Ok(stats)) => total.merge(stats),
            Ok(Err(err)) => return Err(WorkloadError::Task(err.to_string())),
            Err(_) => {
                worker.abort();
                abandoned = true;
            }
        }
    }
    Ok(Counted {
        stats: total,
        abandoned,
        unsent: 0,
    })
}

/// The open loop's calls, each a task: the scheduler adds them, the collector
/// reaps the finished ones and, at the hard end, aborts the rest, so that none
/// runs on into the next run. `None` once the run is over: nothing more may
/// be sent.
type Calls = Arc<Mutex<Option<JoinSet<()>>>>;

fn lock_calls(calls: &Calls) -> std::sync::MutexGuard<'_, Option<JoinSet<()>>> {
    // A poisoned lock only means a thread panicked holding it; the set is
    // still a set of tasks.
    calls.lock().unwrap_or_else(|p| p.into_inner())
}

/// Takes the finished calls out of `set`; the first panic among them, if any.
fn reap(set: &mut JoinSet<()>) -> Option<String> {
    let mut panicked = None;
    while let Some(done) = set.try_join_next() {
        if let Err(err) = done {
            if err.is_panic() && panicked.is_none() {
                panicked = Some(err.to_string());
            }
        }
    }
    panicked
}

async fn open_loop<S: Store>(
    store: Arc<S>,
    plan: Arc<Plan>,
    per_sec: f64,
    max_in_flight: usize,
    phase: Phase,
) -> Result<Counted, WorkloadError> {
    let (start, deadline) = (phase.start, phase.deadline());
    let (tx, mut rx) = mpsc::unbounded_channel::<OpResult>();
    let slots = Arc::new(Semaphore::new(max_in_flight));
    let calls: Calls = Arc::new(Mutex::new(Some(JoinSet::new())));
    // Hits sent; final once `calls` is `None` (a hit is counted as it is
    // added to the set, under its lock).
    let sent = Arc::new(AtomicU64::new(0));
    // The schedule is kept by an OS thread, not a task: tokio's timer is
    // ms-grained, which would send hits up to 1 ms late and charge that to
    // every latency; a thread's sleep wakes within tens of µs. Calls themselves
    // run on the runtime, spawned through its handle.
    let runtime = tokio::runtime::Handle::current();
    let scheduler = {
        let (plan, slots) = (Arc::clone(&plan), Arc::clone(&slots));
        let (calls, sent) = (Arc::clone(&calls), Arc::clone(&sent));
        let (start, deadline) = (start.into_std(), deadline.into_std());
        std::thread::Builder::new()
            .name("bench-schedule".into())
            .spawn(move || {
                let mut rng = SmallRng::seed_from_u64(phase.seed);
                let mut i: u64 = 0;
                let mut woke = start;
                loop {
                    let due = start + Duration::from_secs_f64(i as f64 / per_sec);
                    if due >= deadline || !plan.ticket() {
                        break;
                    }
                    let now = std::time::Instant::now();
                    if due > now {
                        std::thread::sleep(due.max(woke + DISPATCH_QUANTUM) - now);
                        woke = std::time::Instant::now();
                    }
                    // A full window waits here; the hit is still timed from
                    // `due`. The semaphore is closed when the run ends.
                    let permit = match Arc::clone(&slots).try_acquire_owned() {
                        Ok(permit) => permit,
                        Err(_) => match runtime.block_on(Arc::clone(&slots).acquire_owned()) {
                            Ok(permit) => permit,
                            Err(_) => break,
                        },
                    };
                    let spec = plan.draw(&mut rng);
                    let (store, plan, tx) = (Arc::clone(&store), Arc::clone(&plan), tx.clone());
                    let due = Instant::from_std(due);
                    let mut guard = lock_calls(&calls);
                    let Some(set) = guard.as_mut() else { break };
                    set.spawn_on(
                        async move {
                            let op = plan.execute(&*store, spec, due).await;
                            // The collector is gone only once the run is over.
                            let _ = tx.send(op);
                            drop(permit);
                        },
                        &runtime,
                    );
                    sent.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
            .map_err(|e| WorkloadError::Task(format!("cannot start the scheduler thread: {e}")))?
    };
    let end = phase.hard_end(&plan.cfg);
    let mut stats = plan.stats();
    let mut abandoned = false;
    let mut panicked = None;
    let mut done = Vec::new();
    let mut tick = tokio::time::interval(COLLECT_EVERY);
    loop {
        tick.tick().await;
        let taking = rx.recv_many(&mut done, usize::MAX);
        let received = tokio::time::timeout_at(end, taking).await;
        done.drain(..).for_each(|op| stats.record(op));
        if let Some(set) = lock_calls(&calls).as_mut() {
            panicked = panicked.or(reap(set));
        }
        match received {
            Ok(0) => break, // every sender (the scheduler and each call) is done
            Ok(_) => {}
            Err(_) => {
                abandoned = true;
                break;
            }
        }
    }
    // Unblocks a scheduler still waiting for a slot; it then ends by itself
    // (it never outlives the run's duration otherwise), and sends nothing
    // more once the set is taken.
    slots.close();
    drop(scheduler);
    let set = lock_calls(&calls).take();
    if let Some(mut set) = set {
        panicked = panicked.or(reap(&mut set));
        set.abort_all();
        // Aborted calls end at their next await; waiting for them keeps
        // them out of whatever runs next. Bounded, in case one does not.
        let _ = tokio::time::timeout(ABORT_WAIT, set.shutdown()).await;
    }
    if let Some(panic) = panicked {
        return Err(WorkloadError::Task(panic));
    }
    let unsent = if abandoned {
        // Hits due before the deadline (the schedule's, capped by `max_hits`)
        // that the hard end came before.
        let due = (phase.duration.as_secs_f64() * per_sec).ceil() as u64;
        due.min(plan.cfg.max_hits)
            .saturating_sub(sent.load(Ordering::Relaxed))
    } else {
        0
    };
    Ok(Counted {
        stats,
        abandoned,
        unsent,
    })
}

/// Runs the workload `cfg` against `store` and reports what it measured.
///
/// With `cfg.warmup`, the same plan runs that long first, unmeasured. Load is
/// then offered for `cfg.duration` (or until `cfg.max_hits`); calls in flight
/// at the end are let finish within their budgets.
pub async fn run<S: Store>(
    store: Arc<S>,
    cfg: &WorkloadConfig,
) -> Result<WorkloadReport, WorkloadError> {
    cfg.validate()?;
    let plan = Arc::new(Plan::new(cfg, rand::random()));
    if !cfg.warmup.is_zero() {
        let warmup = Phase {
            start: Instant::now(),
            duration: cfg.warmup,
            seed: cfg.seed ^ WARMUP_SEED,
        };
        // Its figures are dropped; a warm-up cut short at its hard end shows
        // again in the measured run.
        drive(&store, &plan, task_stats(&plan), warmup).await?;
        plan.restart();
    }
    // A task's histograms are ~100 KiB each to zero; made before the clock
    // starts, so that 256 tasks do not spend the run's first 100 ms on them.
    let task_stats = task_stats(&plan);
    let cpu_at_start = cpu::own();
    let host_at_start = HostCpu::now();
    let watched_at_start = cpu::read_watched(&cfg.watch);
    let start = Instant::now();
    let progress = Progress::start(&plan, start);
    let phase = Phase {
        start,
        duration: cfg.duration,
        seed: cfg.seed,
    };
    let Counted {
        stats,
        abandoned,
        unsent,
    } = drive(&store, &plan, task_stats, phase).await?;
    drop(progress);
    // Every reading of the end taken together, as those of the start were:
    // the table's "rest" is the host's time less the others'.
    let cpu_at_end = cpu::own();
    let watched_at_end = cpu::read_watched(&cfg.watch);
    let host_at_end = HostCpu::now();
    let elapsed = stats
        .last_done
        .map_or(Duration::ZERO, |t| t.saturating_duration_since(start))
        .as_secs_f64();
    // Answered calls only: failures are counted apart (see the module's doc).
    let hits = stats.hit_hist.len();
    let settles = stats.settle_hist.len();
    let per_sec = |n: u64| {
        if elapsed > 0.0 {
            n as f64 / elapsed
        } else {
            0.0
        }
    };
    Ok(WorkloadReport {
        label: String::new(),
        config: cfg.clone(),
        elapsed_s: elapsed,
        hits,
        settles,
        hits_per_sec: per_sec(hits),
        settles_per_sec: per_sec(settles),
        hit_latency: LatencySummary::of(&stats.hit_hist),
        settle_latency: LatencySummary::of(&stats.settle_hist),
        hit_error_latency: summary(&stats.hit_error_hist),
        settle_error_latency: summary(&stats.settle_error_hist),
        hit_outcomes: stats.hits,
        settle_outcomes: stats.settles,
        late_sends: stats.late,
        unsent,
        abandoned,
        loadgen_cpu_s: cpu_at_start
            .zip(cpu_at_end)
            .map(|(before, after)| after.saturating_sub(before).as_secs_f64()),
        process_cpu_s: cpu::used_by_name(&cfg.watch, &watched_at_start, &watched_at_end),
        host_busy: host_at_start
            .zip(host_at_end)
            .and_then(|(before, after)| after.busy_share_since(&before)),
        host_cpu_s: host_at_start
            .zip(host_at_end)
            .and_then(|(before, after)| after.busy_since(&before)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use ankusa_actors::tenant::TenantState;
    use ankusa_bus::StoreError;

    use crate::bench::report::{comparison_table, cpu_table};

    /// The pure domain behind a lock: the contract's exact semantics, no transport.
    #[derive(Default)]
    struct LocalStore {
        tenants: Mutex<std::collections::HashMap<String, TenantState>>,
    }

    fn now_us() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64)
    }

    impl Store for LocalStore {
        async fn hit(&self, req: HitRequest, _: Duration) -> Result<HitOutcome, StoreError> {
            req.validate()?;
            let mut map = self.tenants.lock().unwrap();
            let state = map.entry(req.tenant().to_string()).or_default();
            Ok(state.hit(now_us(), &req).outcome)
        }
        async fn settle(
            &self,
            req: SettleRequest,
            _: Duration,
        ) -> Result<SettleOutcome, StoreError> {
            req.validate()?;
            let mut map = self.tenants.lock().unwrap();
            let state = map.entry(req.claim.tenant.clone()).or_default();
            Ok(state.settle(now_us(), &req).outcome)
        }
        async fn reset(&self, tenant: String, _: Duration) -> Result<(), StoreError> {
            if let Some(state) = self.tenants.lock().unwrap().get_mut(&tenant) {
                state.reset();
            }
            Ok(())
        }
    }

    /// A store that never answers: the driver must still end on time.
    struct Stuck;

    impl Store for Stuck {
        async fn hit(&self, _: HitRequest, _: Duration) -> Result<HitOutcome, StoreError> {
            std::future::pending().await
        }
        async fn settle(&self, _: SettleRequest, _: Duration) -> Result<SettleOutcome, StoreError> {
            std::future::pending().await
        }
        async fn reset(&self, _: String, _: Duration) -> Result<(), StoreError> {
            std::future::pending().await
        }
    }

    fn quick(mode: LoadMode) -> WorkloadConfig {
        WorkloadConfig {
            tenants: 20,
            mode,
            duration: Duration::from_millis(300),
            max_hits: 5_000,
            duplicate_rate: 0.2,
            release_share: 0.1,
            progress: false,
            ..WorkloadConfig::default()
        }
    }

    #[tokio::test]
    async fn closed_loop_sees_every_outcome_it_should() {
        let cfg = quick(LoadMode::Concurrency { in_flight: 8 });
        let report = run(Arc::new(LocalStore::default()), &cfg).await.unwrap();
        let h = &report.hit_outcomes;
        assert_eq!(report.hits, h.ok + h.duplicate + h.pending + h.rate_limited);
        assert!(report.hits > 0 && report.hits <= cfg.max_hits);
        assert!(
            h.duplicate > 0,
            "redeliveries must meet committed keys: {h:?}"
        );
        assert_eq!(h.errors_total(), 0);
        assert!(report.settle_outcomes.ok > 0);
        assert_eq!(report.settles, h.ok);
        assert!(report.hits_per_sec > 0.0);
        assert!(report.hit_latency.p50_us <= report.hit_latency.max_us);
        let json = report.to_json();
        let back: WorkloadReport = serde_json::from_str(&json).unwrap();
        assert_eq!(back.hits, report.hits);
        assert!(report.to_string().contains("duplicate"));
        // The load generator did the work itself, so it used some CPU.
        let cpu = report.loadgen_cpu_s.expect("getrusage answers on Linux");
        assert!(cpu > 0.0 && cpu < 60.0, "{cpu}");
        assert_eq!(back.loadgen_cpu_s, report.loadgen_cpu_s);
        assert!(report.to_string().contains("load generator CPU"));
        let busy = report.host_busy.expect("/proc/stat on Linux");
        assert!(busy > 0.0 && busy <= 1.0, "{busy}");
        assert_eq!(back.host_busy, report.host_busy);
        assert!(report.host_cpu_s.is_some_and(|s| s > 0.0));
        // Nothing watched: no CPU table, no bound.
        assert!(cpu_table(&[&report]).is_empty());
        assert_eq!(report.hits_per_sec_without("node"), None);
    }

    #[tokio::test]
    async fn a_watched_process_is_reported_beside_the_load_generator() {
        // The load generator watches itself: the two readings must agree, and
        // sparing its CPU would raise the rate (the host did other work too).
        let mut cfg = quick(LoadMode::Concurrency { in_flight: 8 });
        cfg.watch = vec![Watched {
            name: "me".into(),
            pid: std::process::id(),
        }];
        let report = run(Arc::new(LocalStore::default()), &cfg).await.unwrap();
        let me = report.process_cpu_s["me"];
        let gen = report.loadgen_cpu_s.expect("getrusage on Linux");
        assert!((me - gen).abs() < 0.1, "{me} vs {gen}");
        assert!(report.to_string().contains("me CPU:"));
        let back: WorkloadReport = serde_json::from_str(&report.to_json()).unwrap();
        assert_eq!(back.process_cpu_s, report.process_cpu_s);
        assert_eq!(back.config.watch, cfg.watch);
        let table = cpu_table(&[&report.clone().labelled("local")]);
        assert!(table.lines().next().is_some_and(|head| head.contains("me")));
        assert!(table.contains("local"));

        let mut made_up = report.clone();
        made_up.hits_per_sec = 1000.0;
        made_up.host_cpu_s = Some(4.0);
        made_up.process_cpu_s.insert("me".into(), 1.0);
        let bound = made_up.hits_per_sec_without("me").expect("a bound");
        assert!((bound - 1000.0 * 4.0 / 3.0).abs() < 1e-6, "{bound}");
        made_up.host_cpu_s = Some(1.0);
        assert_eq!(made_up.hits_per_sec_without("me"), None);
        assert_eq!(made_up.hits_per_sec_without("nobody"), None);
    }

    #[tokio::test]
    async fn open_loop_offers_the_rate_and_saturating_limits_deny() {
        let mut cfg = quick(LoadMode::Rate {
            per_sec: 2000.0,
            max_in_flight: 64,
        });
        cfg.limits = BucketLimits::saturating();
        cfg.tenants = 2;
        let report = run(Arc::new(LocalStore::default()), &cfg).await.unwrap();
        // 0.3 s at 2000/s: about 600 hits offered.
        assert!((500..=601).contains(&report.hits), "{}", report.hits);
        assert!(report.hit_outcomes.rate_limited > report.hits * 9 / 10);
        let ratio = report.ratio_to(&report);
        assert_eq!(ratio.hits_per_sec, Some(1.0));
        let table = comparison_table(&[&report.clone().labelled("a"), &report]);
        assert!(table.contains("1.00x"));
    }

    #[tokio::test]
    async fn a_store_that_never_answers_is_counted_and_bounded() {
        let mut cfg = quick(LoadMode::Concurrency { in_flight: 4 });
        cfg.timeout = Duration::from_millis(20);
        cfg.duration = Duration::from_millis(100);
        let t0 = std::time::Instant::now();
        let report = run(Arc::new(Stuck), &cfg).await.unwrap();
        assert!(t0.elapsed() < Duration::from_secs(2));
        // Nothing was answered: no throughput, and figures that cannot stand.
        assert_eq!((report.hits, report.hits_per_sec), (0, 0.0));
        let failed = report.hit_outcomes.errors.get(BUDGET_OVERRUN).copied();
        assert!(failed.is_some_and(|n| n > 0), "{report}");
        assert_eq!(Some(report.hit_error_latency.count), failed);
        assert!(report.hit_error_latency.min_us >= 20_000);
        assert_eq!(report.hit_latency.count, 0);
        assert!(report.flaw().is_some());
    }

    /// The local store, noting every hit and every tenant it is asked about;
    /// every `fail_every`-th hit (0: none) fails at once, and each other one
    /// takes `delay`.
    #[derive(Default)]
    struct Observed {
        inner: LocalStore,
        hits: AtomicU64,
        tenants: Mutex<std::collections::HashSet<String>>,
        fail_every: u64,
        delay: Duration,
    }

    impl Store for Observed {
        async fn hit(&self, req: HitRequest, budget: Duration) -> Result<HitOutcome, StoreError> {
            let n = self.hits.fetch_add(1, Ordering::Relaxed);
            self.tenants
                .lock()
                .unwrap()
                .insert(req.tenant().to_string());
            if self.fail_every > 0 && n % self.fail_every == 0 {
                return Err(StoreError::Disconnected);
            }
            tokio::time::sleep(self.delay).await;
            self.inner.hit(req, budget).await
        }
        async fn settle(
            &self,
            req: SettleRequest,
            budget: Duration,
        ) -> Result<SettleOutcome, StoreError> {
            self.inner.settle(req, budget).await
        }
        async fn reset(&self, tenant: String, budget: Duration) -> Result<(), StoreError> {
            self.inner.reset(tenant, budget).await
        }
    }

    #[tokio::test]
    async fn failed_calls_are_counted_apart_from_throughput() {
        let cfg = quick(LoadMode::Concurrency { in_flight: 4 });
        let store = Arc::new(Observed {
            fail_every: 4,
            ..Observed::default()
        });
        let report = run(Arc::clone(&store), &cfg).await.unwrap();
        let h = &report.hit_outcomes;
        let failed = h.errors.get("disconnected").copied().unwrap_or(0);
        assert!(failed > 0, "{report}");
        // hits (and hits/s) are the answered ones; the failed ones are apart.
        assert_eq!(report.hits, h.ok + h.duplicate + h.pending + h.rate_limited);
        assert_eq!(report.hits + failed, store.hits.load(Ordering::Relaxed));
        assert_eq!(report.hit_latency.count, report.hits);
        assert_eq!(report.hit_error_latency.count, failed);
        let rate = report.hits as f64 / report.elapsed_s;
        assert!((report.hits_per_sec - rate).abs() < 1e-6);
        assert!(report.flaw().is_some_and(|f| f.contains("of hits failed")));
        assert!(report.to_string().contains("hit err"), "{report}");
    }

    #[tokio::test]
    async fn the_warm_up_runs_the_same_tenants_and_is_not_counted() {
        for mode in [
            LoadMode::Concurrency { in_flight: 4 },
            LoadMode::Rate {
                per_sec: 2000.0,
                max_in_flight: 64,
            },
        ] {
            let cfg = WorkloadConfig {
                tenants: 5,
                distribution: TenantDistribution::Uniform,
                warmup: Duration::from_millis(200),
                duration: Duration::from_millis(200),
                duplicate_rate: 0.0,
                ..quick(mode)
            };
            // A millisecond a hit, so that `max_hits` is not what ends a phase.
            let store = Arc::new(Observed {
                delay: Duration::from_millis(1),
                ..Observed::default()
            });
            let t0 = std::time::Instant::now();
            let report = run(Arc::clone(&store), &cfg).await.unwrap();
            assert!(t0.elapsed() >= Duration::from_millis(400));
            // Five tenants in all: the measured run's are the warm-up's.
            assert_eq!(store.tenants.lock().unwrap().len(), 5);
            // The warm-up's hits reached the store but are not in the report.
            let sent = store.hits.load(Ordering::Relaxed);
            assert!(
                report.hits > 0 && sent > report.hits + 100,
                "{sent}: {report}"
            );
            assert!(report.elapsed_s < 0.35, "{report}");
            // No fresh key of the measured run repeats one of the warm-up's.
            assert_eq!(report.hit_outcomes.duplicate, 0, "{report}");
            // (Not `flaw()`: on a busy host the open loop may send late.)
            assert_eq!(report.hit_outcomes.errors_total(), 0, "{report}");
            assert!(!report.abandoned, "{report}");
        }
    }

    /// A store that never answers, counting the calls still pending.
    #[derive(Default)]
    struct Counting {
        pending: Arc<AtomicU64>,
    }

    /// Counts one pending call down when the call is dropped, finished or not.
    struct Pending(Arc<AtomicU64>);

    impl Drop for Pending {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::Relaxed);
        }
    }

    impl Store for Counting {
        async fn hit(&self, _: HitRequest, _: Duration) -> Result<HitOutcome, StoreError> {
            self.pending.fetch_add(1, Ordering::Relaxed);
            let _pending = Pending(Arc::clone(&self.pending));
            std::future::pending().await
        }
        async fn settle(&self, _: SettleRequest, _: Duration) -> Result<SettleOutcome, StoreError> {
            std::future::pending().await
        }
        async fn reset(&self, _: String, _: Duration) -> Result<(), StoreError> {
            std::future::pending().await
        }
    }

    #[tokio::test]
    async fn an_open_loop_leaves_no_call_behind_its_hard_end() {
        // 100 hits due in 0.1 s, two at a time, each taking its 20 ms budget
        // and the grace: the schedule is still far behind at the hard end.
        let mut cfg = quick(LoadMode::Rate {
            per_sec: 1000.0,
            max_in_flight: 2,
        });
        cfg.timeout = Duration::from_millis(20);
        cfg.duration = Duration::from_millis(100);
        cfg.max_hits = 1_000;
        let store = Arc::new(Counting::default());
        let t0 = std::time::Instant::now();
        let report = run(Arc::clone(&store), &cfg).await.unwrap();
        assert!(t0.elapsed() < Duration::from_secs(3));
        assert!(report.abandoned, "{report}");
        assert!(report.unsent > 0 && report.unsent < 100, "{report}");
        assert!(report.to_string().contains("never sent"), "{report}");
        // Every call still in flight at the hard end was aborted.
        assert_eq!(store.pending.load(Ordering::Relaxed), 0);
        assert!(report.flaw().is_some());
    }

    #[test]
    fn the_histograms_hold_the_longest_latency_a_run_can_see() {
        let cfg = WorkloadConfig {
            duration: MAX_DURATION,
            ..WorkloadConfig::default()
        };
        let plan = Plan::new(&cfg, 1);
        let mut stats = plan.stats();
        // Latency from due, in an open loop an hour behind.
        let longest = micros(span(cfg.duration, &cfg));
        assert!(stats.hit_hist.record(longest).is_ok());
        // A short run's are small.
        let short = Plan::new(&WorkloadConfig::default(), 1);
        assert!(short.hist_max_us < 20_000_000);
        assert!(short.hist_max_us > micros(span(Duration::from_secs(10), &cfg)));
        stats.merge(short.stats());
    }

    #[test]
    fn bad_configs_are_refused() {
        let ok = WorkloadConfig::default();
        assert_eq!(ok.validate(), Ok(()));
        let bad = [
            WorkloadConfig {
                tenants: 0,
                ..ok.clone()
            },
            WorkloadConfig {
                claim_share: 1.5,
                ..ok.clone()
            },
            WorkloadConfig {
                mode: LoadMode::Rate {
                    per_sec: 0.0,
                    max_in_flight: 1,
                },
                ..ok.clone()
            },
            WorkloadConfig {
                duration: Duration::ZERO,
                ..ok.clone()
            },
            WorkloadConfig {
                ttl_ms: 0,
                ..ok.clone()
            },
            WorkloadConfig {
                distribution: TenantDistribution::Zipf { s: f64::NAN },
                ..ok.clone()
            },
        ];
        for cfg in bad {
            assert!(cfg.validate().is_err(), "{cfg:?}");
        }
    }

    #[test]
    fn zipf_favours_the_first_tenants() {
        let plan = Plan::new(
            &WorkloadConfig {
                tenants: 100,
                distribution: TenantDistribution::Zipf { s: 1.2 },
                ..WorkloadConfig::default()
            },
            7,
        );
        let mut rng = SmallRng::seed_from_u64(3);
        let mut counts = [0u32; 100];
        for _ in 0..10_000 {
            counts[plan.sampler.tenant(&mut rng) as usize] += 1;
        }
        assert!(counts[0] > counts[10] && counts[10] > 0);
        assert!(counts[0] > 1000);
    }

    #[test]
    fn charges_follow_the_limits() {
        let [(hi, hc), (bi, bc)] = BucketLimits::generous().buckets(2048);
        assert_eq!((hi, hc), (10, 1_000_000));
        assert_eq!((bi, bc), (2, 1_000_000));
        let [(hi, hc), (bi, bc)] = BucketLimits::saturating().buckets(2048);
        assert_eq!((hi, hc), (1_000_000, 1_000_000));
        assert_eq!(bi, 2_048_000);
        assert_eq!(bc, bi);
    }
}
