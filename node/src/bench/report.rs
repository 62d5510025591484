//! What a finished run measured, and how it is told: a run's figures
//! (throughput, HDR latency percentiles, counts by outcome), printed as JSON
//! or as tables, and the ratios between runs.
//!
//! A run can be unfit to stand for its store ([`WorkloadReport::flaw`]): more
//! than [`MAX_ERROR_SHARE`] of its calls failed, calls were abandoned at its
//! hard end, or (open loop) more than [`MAX_UNSENT_SHARE`] of its hits were
//! never sent, so the rate offered was not the rate meant. Its figures are
//! still printed, flagged, and no target is judged on them. Hits sent late do
//! not flag a run: their latency counts from when they were due, so the
//! lateness is in the figures, and it falls on every store alike (on a
//! shared 2-vCPU host 1–3 % of an open loop's hits leave over 1 ms late,
//! the echo's as much as the fleet's).

use std::collections::BTreeMap;
use std::fmt;

use ankusa_bus::StoreError;
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use super::workload::{LoadMode, WorkloadConfig};

/// Most calls (hits, or settles) of a run that may fail for its figures to
/// be judged: above it, the store was not serving the workload.
pub const MAX_ERROR_SHARE: f64 = 0.001;
/// Most hits of an open-loop run that may go unsent (its hard end came
/// first) for its figures to be judged: above it, the load generator did not
/// offer the rate it was to.
pub const MAX_UNSENT_SHARE: f64 = 0.01;

/// Latency percentiles of one kind of call, µs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    pub count: u64,
    pub min_us: u64,
    pub mean_us: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
}

impl LatencySummary {
    pub(super) fn of(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        Self {
            count: h.len(),
            min_us: h.min(),
            mean_us: h.mean(),
            p50_us: h.value_at_quantile(0.50),
            p90_us: h.value_at_quantile(0.90),
            p99_us: h.value_at_quantile(0.99),
            p999_us: h.value_at_quantile(0.999),
            max_us: h.max(),
        }
    }
}

/// Hits by outcome; errors by kind (see [`error_kind`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HitCounts {
    pub ok: u64,
    pub duplicate: u64,
    pub pending: u64,
    pub rate_limited: u64,
    pub errors: BTreeMap<String, u64>,
}

/// Settles by outcome; errors by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettleCounts {
    pub ok: u64,
    pub not_found: u64,
    pub not_owner: u64,
    pub already_committed: u64,
    pub errors: BTreeMap<String, u64>,
}

fn error_total(errors: &BTreeMap<String, u64>) -> u64 {
    errors.values().sum()
}

impl HitCounts {
    pub fn errors_total(&self) -> u64 {
        error_total(&self.errors)
    }
}

impl SettleCounts {
    pub fn errors_total(&self) -> u64 {
        error_total(&self.errors)
    }
}

/// A stable snake_case name for each way a call can fail, for counting.
pub fn error_kind(err: &StoreError) -> String {
    match err {
        StoreError::Timeout(_) => "timeout".into(),
        StoreError::NoResponders => "no_responders".into(),
        StoreError::Disconnected => "disconnected".into(),
        StoreError::Invalid(_) => "invalid".into(),
        StoreError::Refused(reply) => format!("refused_{}", reply.code),
        StoreError::BadReply(_) => "bad_reply".into(),
        StoreError::Transport(_) => "transport".into(),
    }
}

/// What a run measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkloadReport {
    /// What was measured (e.g. `fleet`, `echo`, `redis-lua`); set by the caller.
    pub label: String,
    pub config: WorkloadConfig,
    /// From the start to the last answer.
    pub elapsed_s: f64,
    /// Hits answered with an outcome (ok, duplicate, pending, rate limited);
    /// failed ones are only in `hit_outcomes.errors`.
    pub hits: u64,
    /// Settles answered with an outcome.
    pub settles: u64,
    /// Answered hits per second.
    pub hits_per_sec: f64,
    pub settles_per_sec: f64,
    /// Of the answered hits.
    pub hit_latency: LatencySummary,
    pub settle_latency: LatencySummary,
    /// Of the failed hits (timeouts, disconnections, ...).
    #[serde(default)]
    pub hit_error_latency: LatencySummary,
    #[serde(default)]
    pub settle_error_latency: LatencySummary,
    pub hit_outcomes: HitCounts,
    pub settle_outcomes: SettleCounts,
    /// Open loop: hits sent more than 1 ms after they were due (the driver or
    /// `max_in_flight` could not keep up; their latency still counts from due).
    pub late_sends: u64,
    /// Open loop: hits due within the run never sent, the hard end having
    /// come first.
    #[serde(default)]
    pub unsent: u64,
    /// Calls still outstanding when the run's hard end came (they were
    /// aborted); not counted above.
    pub abandoned: bool,
    /// CPU seconds this process (the load generator: the edge client, and for
    /// the echo baseline its responder too) used during the run; `None` where
    /// the platform does not tell.
    #[serde(default)]
    pub loadgen_cpu_s: Option<f64>,
    /// Share of the host's CPU time (every core, every process) that was busy
    /// during the run, from `/proc/stat`: near 1, the run was bound by the
    /// machine rather than by any one process. `None` off Linux.
    #[serde(default)]
    pub host_busy: Option<f64>,
    /// CPU seconds the host spent busy during the run, every core summed.
    #[serde(default)]
    pub host_cpu_s: Option<f64>,
    /// CPU seconds of each watched process (by name, summed over its
    /// processes) during the run; see [`WorkloadConfig::watch`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub process_cpu_s: BTreeMap<String, f64>,
}

/// `self / other` for each figure (`None` where `other`'s is 0). For
/// throughput, above 1 means `self` is faster; for latency, below 1 does.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ReportRatio {
    pub hits_per_sec: Option<f64>,
    pub settles_per_sec: Option<f64>,
    pub hit_p50: Option<f64>,
    pub hit_p99: Option<f64>,
    pub hit_p999: Option<f64>,
    pub settle_p50: Option<f64>,
    pub settle_p99: Option<f64>,
}

fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0).then(|| a / b)
}

impl WorkloadReport {
    /// The load generator's CPU per hit and its settle, µs (`None` without a
    /// CPU reading or a hit).
    pub fn loadgen_us_per_hit(&self) -> Option<f64> {
        self.loadgen_cpu_s.and_then(|cpu| self.per_hit_us(cpu))
    }

    /// CPU µs per hit and its settle of `seconds` spent in the run (`None`
    /// without a hit).
    fn per_hit_us(&self, seconds: f64) -> Option<f64> {
        (self.hits > 0).then(|| 1e6 * seconds / self.hits as f64)
    }

    /// The rate this run would have reached on the same host, as busy, had
    /// the processes watched as `name` cost nothing and everything else cost
    /// what it did per hit: a bound on what making them cheaper can gain.
    pub fn hits_per_sec_without(&self, name: &str) -> Option<f64> {
        let host = self.host_cpu_s?;
        let spared = *self.process_cpu_s.get(name)?;
        (host > spared).then(|| self.hits_per_sec * host / (host - spared))
    }

    /// The same report under another name.
    pub fn labelled(mut self, label: impl Into<String>) -> Self {
        self.label = label.into();
        self
    }

    /// Why this run's figures cannot be judged, if they cannot: too many
    /// failed calls, calls abandoned at the hard end, or (open loop) too many
    /// hits never sent. See the module's doc.
    pub fn flaw(&self) -> Option<String> {
        if self.abandoned {
            return Some("calls were abandoned at the hard end".into());
        }
        let hit_errors = self.hit_outcomes.errors_total();
        let sent = self.hits + hit_errors;
        if sent == 0 {
            return Some("no hit was answered".into());
        }
        let calls = [
            ("hits", hit_errors, sent),
            (
                "settles",
                self.settle_outcomes.errors_total(),
                self.settles + self.settle_outcomes.errors_total(),
            ),
        ];
        for (what, failed, of) in calls {
            if failed as f64 > MAX_ERROR_SHARE * of as f64 {
                let share = 100.0 * failed as f64 / of as f64;
                return Some(format!("{share:.2} % of {what} failed"));
            }
        }
        if let LoadMode::Rate { .. } = self.config.mode {
            let offered = sent + self.unsent;
            if self.unsent as f64 > MAX_UNSENT_SHARE * offered as f64 {
                let share = 100.0 * self.unsent as f64 / offered as f64;
                return Some(format!("{share:.1} % of hits were never sent"));
            }
        }
        None
    }

    /// How this run compares with `other`, figure by figure.
    pub fn ratio_to(&self, other: &WorkloadReport) -> ReportRatio {
        let (a, b) = (&self.hit_latency, &other.hit_latency);
        let (sa, sb) = (&self.settle_latency, &other.settle_latency);
        ReportRatio {
            hits_per_sec: ratio(self.hits_per_sec, other.hits_per_sec),
            settles_per_sec: ratio(self.settles_per_sec, other.settles_per_sec),
            hit_p50: ratio(a.p50_us as f64, b.p50_us as f64),
            hit_p99: ratio(a.p99_us as f64, b.p99_us as f64),
            hit_p999: ratio(a.p999_us as f64, b.p999_us as f64),
            settle_p50: ratio(sa.p50_us as f64, sb.p50_us as f64),
            settle_p99: ratio(sa.p99_us as f64, sb.p99_us as f64),
        }
    }

    pub fn to_json(&self) -> String {
        // Plain data with string map keys: serializing cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

fn fmt_counts(errors: &BTreeMap<String, u64>) -> String {
    if errors.is_empty() {
        return "none".into();
    }
    errors
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn latency_row(f: &mut fmt::Formatter<'_>, name: &str, l: &LatencySummary) -> fmt::Result {
    writeln!(
        f,
        "  {name:<7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        l.count, l.p50_us, l.p90_us, l.p99_us, l.p999_us, l.max_us
    )
}

impl fmt::Display for WorkloadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let label = if self.label.is_empty() {
            "store"
        } else {
            &self.label
        };
        writeln!(
            f,
            "{label}: {:.2} s, {}, {} tenants; {:.0} hits/s, {:.0} settles/s{}",
            self.elapsed_s,
            self.config.mode_label(),
            self.config.tenants,
            self.hits_per_sec,
            self.settles_per_sec,
            if self.abandoned {
                " (calls abandoned at the hard end)"
            } else {
                ""
            }
        )?;
        writeln!(
            f,
            "  {:<7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "µs", "count", "p50", "p90", "p99", "p99.9", "max"
        )?;
        latency_row(f, "hit", &self.hit_latency)?;
        latency_row(f, "settle", &self.settle_latency)?;
        // Failed calls' latency, apart, when there were any.
        if self.hit_error_latency.count > 0 {
            latency_row(f, "hit err", &self.hit_error_latency)?;
        }
        if self.settle_error_latency.count > 0 {
            latency_row(f, "set err", &self.settle_error_latency)?;
        }
        let h = &self.hit_outcomes;
        writeln!(
            f,
            "  hits:    ok {}, duplicate {}, pending {}, rate_limited {}; errors: {}",
            h.ok,
            h.duplicate,
            h.pending,
            h.rate_limited,
            fmt_counts(&h.errors)
        )?;
        let s = &self.settle_outcomes;
        write!(
            f,
            "  settles: ok {}, not_found {}, not_owner {}, already_committed {}; errors: {}",
            s.ok,
            s.not_found,
            s.not_owner,
            s.already_committed,
            fmt_counts(&s.errors)
        )?;
        if let (Some(cpu), Some(per_hit)) = (self.loadgen_cpu_s, self.loadgen_us_per_hit()) {
            write!(
                f,
                "\n  load generator CPU: {cpu:.2} s, {per_hit:.1} µs per hit"
            )?;
        }
        for (name, &cpu) in &self.process_cpu_s {
            if let Some(per_hit) = self.per_hit_us(cpu) {
                write!(f, "\n  {name} CPU: {cpu:.2} s, {per_hit:.1} µs per hit")?;
            }
        }
        if let Some(busy) = self.host_busy {
            write!(f, "\n  host CPU busy: {:.0} %", 100.0 * busy)?;
        }
        if self.late_sends > 0 {
            write!(f, "\n  late sends (> 1 ms after due): {}", self.late_sends)?;
        }
        if self.unsent > 0 {
            write!(
                f,
                "\n  hits never sent (the hard end came first): {}",
                self.unsent
            )?;
        }
        if let Some(flaw) = self.flaw() {
            write!(f, "\n  NOT JUDGED: {flaw}")?;
        }
        Ok(())
    }
}

fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "-".into(), |r| format!("{r:.2}x"))
}

impl fmt::Display for ReportRatio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "hits/s {}, settles/s {}, hit p50 {}, p99 {}, p99.9 {}, settle p50 {}, p99 {}",
            fmt_ratio(self.hits_per_sec),
            fmt_ratio(self.settles_per_sec),
            fmt_ratio(self.hit_p50),
            fmt_ratio(self.hit_p99),
            fmt_ratio(self.hit_p999),
            fmt_ratio(self.settle_p50),
            fmt_ratio(self.settle_p99),
        )
    }
}

/// Several runs side by side, one row each, with throughput and hit p99 as a
/// ratio to the first row, and the load generator's CPU per hit (the edge's
/// cost of a hit and its settle; for the echo, its responder's too).
pub fn comparison_table(reports: &[&WorkloadReport]) -> String {
    let mut out = format!(
        "{:<12} {:>10} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>10} {:>6}\n",
        "store",
        "hits/s",
        "settles/s",
        "hit p50",
        "p99",
        "p99.9",
        "set p50",
        "p99",
        "errors",
        "x hits/s",
        "x hit p99",
        "gen µs/hit",
        "host"
    );
    let base = reports.first();
    for r in reports {
        let rel = base.map(|b| r.ratio_to(b));
        out.push_str(&format!(
            "{:<12} {:>10.0} {:>10.0} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>10} {:>6}\n",
            r.label,
            r.hits_per_sec,
            r.settles_per_sec,
            r.hit_latency.p50_us,
            r.hit_latency.p99_us,
            r.hit_latency.p999_us,
            r.settle_latency.p50_us,
            r.settle_latency.p99_us,
            r.hit_outcomes.errors_total() + r.settle_outcomes.errors_total(),
            fmt_ratio(rel.and_then(|x| x.hits_per_sec)),
            fmt_ratio(rel.and_then(|x| x.hit_p99)),
            r.loadgen_us_per_hit()
                .map_or_else(|| "-".into(), |us| format!("{us:.1}")),
            r.host_busy
                .map_or_else(|| "-".into(), |busy| format!("{:.0}%", 100.0 * busy)),
        ));
    }
    for r in reports {
        if let Some(flaw) = r.flaw() {
            out.push_str(&format!("{}: not judged: {flaw}\n", r.label));
        }
    }
    out.push_str(
        "hits/s: answered calls only; latencies in µs, of answered calls; \
         gen µs/hit: the load generator's CPU per hit and its settle; \
         host: the machine's CPU busy during the run",
    );
    out
}

/// Where the CPU of each run went, µs per hit and its settle: the load
/// generator, each watched process, the rest of the host (the kernel's work
/// for processes not watched, and anything else running) and the host in all.
/// Empty when no run watched a process.
pub fn cpu_table(reports: &[&WorkloadReport]) -> String {
    let names: std::collections::BTreeSet<&str> = reports
        .iter()
        .flat_map(|r| r.process_cpu_s.keys().map(String::as_str))
        .collect();
    if names.is_empty() {
        return String::new();
    }
    let cell = |us: Option<f64>| us.map_or_else(|| "-".into(), |us| format!("{us:.1}"));
    let mut out = format!("{:<12} {:>10} {:>10}", "store", "hits/s", "load gen");
    for name in &names {
        out.push_str(&format!(" {name:>12}"));
    }
    out.push_str(&format!(" {:>8} {:>8}\n", "rest", "host"));
    for r in reports {
        let watched: Vec<Option<f64>> = names
            .iter()
            .map(|&name| r.process_cpu_s.get(name).copied())
            .collect();
        let host = r.host_cpu_s;
        let rest = host
            .zip(r.loadgen_cpu_s)
            .map(|(host, gen)| (host - gen - watched.iter().flatten().sum::<f64>()).max(0.0));
        out.push_str(&format!(
            "{:<12} {:>10.0} {:>10}",
            r.label,
            r.hits_per_sec,
            cell(r.loadgen_us_per_hit())
        ));
        for seconds in &watched {
            out.push_str(&format!(
                " {:>12}",
                cell(seconds.and_then(|s| r.per_hit_us(s)))
            ));
        }
        out.push_str(&format!(
            " {:>8} {:>8}\n",
            cell(rest.and_then(|s| r.per_hit_us(s))),
            cell(host.and_then(|s| r.per_hit_us(s)))
        ));
    }
    out.push_str("CPU µs per hit and its settle, by process; rest: the host's other busy time");
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    use crate::bench::workload::LoadMode;

    /// A report of `hits` answered hits (each settled) in 1 s, nothing else.
    pub(crate) fn report(label: &str, mode: LoadMode, hits: u64) -> WorkloadReport {
        WorkloadReport {
            label: label.into(),
            config: WorkloadConfig {
                mode,
                ..WorkloadConfig::default()
            },
            elapsed_s: 1.0,
            hits,
            settles: hits,
            hits_per_sec: hits as f64,
            settles_per_sec: hits as f64,
            hit_latency: LatencySummary::default(),
            settle_latency: LatencySummary::default(),
            hit_error_latency: LatencySummary::default(),
            settle_error_latency: LatencySummary::default(),
            hit_outcomes: HitCounts {
                ok: hits,
                ..HitCounts::default()
            },
            settle_outcomes: SettleCounts {
                ok: hits,
                ..SettleCounts::default()
            },
            late_sends: 0,
            unsent: 0,
            abandoned: false,
            loadgen_cpu_s: None,
            host_busy: None,
            host_cpu_s: None,
            process_cpu_s: BTreeMap::new(),
        }
    }

    pub(crate) const CLOSED: LoadMode = LoadMode::Concurrency { in_flight: 8 };
    const OPEN: LoadMode = LoadMode::Rate {
        per_sec: 1000.0,
        max_in_flight: 64,
    };

    #[test]
    fn a_clean_run_stands() {
        assert_eq!(report("a", CLOSED, 10_000).flaw(), None);
        assert_eq!(report("a", OPEN, 10_000).flaw(), None);
    }

    #[test]
    fn failures_above_a_thousandth_make_a_run_unfit() {
        // 10 failed of 10,010 hits: just under 0.1 %.
        let mut r = report("a", CLOSED, 10_000);
        r.hit_outcomes.errors.insert("timeout".into(), 10);
        assert_eq!(r.flaw(), None);
        r.hit_outcomes.errors.insert("disconnected".into(), 2);
        let flaw = r.flaw().expect("12 of 10,012 hits failed");
        assert!(flaw.contains("of hits failed"), "{flaw}");
        // Settles are held to the same share.
        let mut r = report("a", CLOSED, 10_000);
        r.settle_outcomes.errors.insert("timeout".into(), 11);
        assert!(r.flaw().is_some_and(|f| f.contains("settles")));
        assert!(r.to_string().contains("NOT JUDGED"), "{r}");
        assert!(comparison_table(&[&r]).contains("a: not judged"));
    }

    #[test]
    fn a_run_without_answers_or_with_abandoned_calls_is_unfit() {
        let mut r = report("a", CLOSED, 0);
        r.hit_outcomes.errors.insert("no_responders".into(), 50);
        assert!(r.flaw().is_some_and(|f| f.contains("100.00 % of hits")));
        assert!(report("a", CLOSED, 0).flaw().is_some());
        let mut r = report("a", CLOSED, 10_000);
        r.abandoned = true;
        assert!(r.flaw().is_some_and(|f| f.contains("abandoned")));
    }

    #[test]
    fn an_open_loop_that_fell_behind_is_unfit() {
        let mut r = report("a", OPEN, 9_900);
        r.unsent = 100; // exactly 1 % of the 10,000 due
        assert_eq!(r.flaw(), None);
        r.unsent = 101;
        assert!(r.flaw().is_some_and(|f| f.contains("never sent")));
        // Late hits count their lateness in their latency: not a flaw.
        r.unsent = 0;
        r.late_sends = 5_000;
        assert_eq!(r.flaw(), None);
        // A closed loop has no schedule to keep.
        let mut r = report("a", CLOSED, 10_000);
        r.late_sends = 5_000;
        assert_eq!(r.flaw(), None);
    }

    #[test]
    fn reports_without_the_new_fields_still_read() {
        let r = report("a", CLOSED, 10);
        let mut json: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        for field in ["hit_error_latency", "settle_error_latency", "unsent"] {
            json.as_object_mut().unwrap().remove(field);
        }
        json["config"].as_object_mut().unwrap().remove("warmup_ms");
        let back: WorkloadReport = serde_json::from_value(json).unwrap();
        assert_eq!(back, r);
    }
}
