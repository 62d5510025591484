//! The checker: a pure function from a [`crate::history`] to a [`Report`] of
//! which rules held. It reasons like a Jepsen-style checker: a call took effect
//! at one unknown instant between its invocation and its completion, and a call
//! that ended in an uncertain error (a timeout, a lost connection) may or may not
//! have taken effect. Each rule is stated so that it only fires when *no*
//! placement of those unknown instants could explain the history.
//!
//! # Rules
//!
//! 1. **No lost webhook.** A `Duplicate{hook_id: h}` for key k is a `2xx` to the
//!    sender, so h must have been stored: some `settle(commit)` of h on k was
//!    invoked before the Duplicate completed, was not refused (`Ok`, or an
//!    uncertain error: it may have committed), and no release of h answered `Ok`
//!    after that commit completed and before the Duplicate was invoked (a release
//!    that succeeds proves the claim was still pending, so that commit never took).
//! 2. **No double accept.** No hit answered `Ok` for hook h2 on key k while
//!    another hook h1 certainly held k: either a commit of h1 answered `Ok`
//!    before h2's hit was invoked and h2's hit *completed* before
//!    `commit invoked + ttl` (the earliest the commit can expire; h2's hit may
//!    have taken effect as late as its completion), or h1's own hit answered
//!    `Ok` before and h2's hit completed before `hit invoked + pending_ttl`,
//!    with no release of h1 that could have freed the key invoked before h2's
//!    hit completed. A repeat keeps the first attempt's expiry (a retried
//!    commit, a replayed hit), so the clock starts at the earliest attempt of
//!    h1 that may have taken effect, not at the one answered `Ok`. A conflict
//!    where either answer came from an edge's *local* state is *attributed*
//!    (the fleet never saw that claim), and so is one whose second hit
//!    overlaps a fault window
//!    `[fault start, fault end + lease TTL + attribution slack]`. Attributed
//!    conflicts are reported, never hidden, but they are not violations.
//!    Except that a graceful fault (a node's stop, [`FaultKind::StopNode`], or
//!    one joining, [`FaultKind::AddNode`]) hands its shards over with their
//!    state: it explains no conflict with a commit that had completed `Ok`
//!    before the fault began, which the new owner must load.
//!    `clock_tolerance` is taken off every expiry, because nodes time claims by
//!    the system clock and the history by the monotonic one.
//! 3. **Deadlines.** Every call completed within `timeout + deadline_slack`,
//!    not counting the time, inside the call, in which the whole test process
//!    was measurably not scheduled (the history's stalls, seen by an OS thread
//!    that sleeps 1 ms at a time; see [`crate::history::History::spawn_stall_monitor`]).
//!    A client that ignores its deadline is late with or without a stall; an
//!    OS that runs four nodes and a nats-server on two cores is not the client's
//!    fault. The raw worst overrun is reported next to the adjusted one.
//! 4. **Rate limits.** GCRA admits a charge when the TAT it produces is at most
//!    `capacity` past now, and every admitted charge moves the TAT on by at
//!    least its `increment`; so the charges admitted at instants `t1 ≤ … ≤ tn`
//!    satisfy `Σ increment ≤ capacity + (tn − t1)`. For every run of accepted
//!    hits of one tenant and bucket kind (sorted by invocation) the checker
//!    bounds `tn − t1` from above by `latest completion − first invocation` and
//!    requires `Σ increment ≤ (1 + L) · (capacity + span) + F · (capacity + write_behind)`
//!    where
//!    - `L` is the number of edges that answered some of those hits from their
//!      local state: each such edge runs its own GCRA bucket, which admits at
//!      most `capacity + span` more;
//!    - `F` is the number of fault windows overlapping the run. Bucket TATs are
//!      written behind every `write_behind`, so a node that dies loses at most
//!      the charges it admitted since its last flush, and the new owner re-grants
//!      them; by the same GCRA bound those are at most `capacity + write_behind`
//!      (in µs of increment). This is tighter than "one more burst" only by
//!      being exact about the flush interval: one burst (`capacity`) plus what
//!      the rate refills in one flush interval. A graceful handoff flushes first
//!      and loses nothing, but it is counted the same (it is still a fault window).
//! 5. **Recovery.** After *each* fault ended, every shard answers from the
//!    fleet again (some call on it, invoked after that instant, got a fleet
//!    answer) within `recovery_bound`; and after the last one, every edge that
//!    answered locally during the run got a fleet answer again within the same
//!    bound. Every fault must have ended.
//! 6. **Takeover.** While a fault isolates a running node from NATS for longer
//!    than its lease ([`FaultKind::isolates_node`]: a network cut), the rest of
//!    the fleet takes its shards over: every shard answers from the fleet a
//!    call invoked after `fault start + lease TTL` (the isolated node cannot
//!    answer it, nor can anything it sent before the cut still be in flight)
//!    and completed before the fault ended.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use ankusa_actors::{HitOutcome, Kind, SettleOutcome, Settlement};

use crate::history::{Answered, CallResult, Event, FaultEvent, FaultKind, Micros, OpKind};

/// The bounds the rules are checked against.
#[derive(Debug, Clone)]
pub struct CheckerConfig {
    /// Allowed lateness past a call's own timeout.
    pub deadline_slack: Micros,
    /// The nodes' lease TTL: how long after a fault ends a stale owner may matter.
    pub lease_ttl: Micros,
    /// Extra time after `fault end + lease TTL` still attributed to the fault
    /// (lease expiry is checked by the server about once a second; loading a
    /// shard takes time on a loaded box).
    pub attribution_slack: Micros,
    /// The nodes' bucket write-behind interval.
    pub write_behind: Micros,
    /// Taken off every claim expiry (system vs monotonic clock).
    pub clock_tolerance: Micros,
    /// How soon after the last fault every shard must serve again.
    pub recovery_bound: Micros,
    /// The instance's shard count: shards `0..shards` must all recover.
    pub shards: u32,
}

impl Default for CheckerConfig {
    fn default() -> Self {
        Self {
            deadline_slack: 25_000,
            lease_ttl: 2_000_000,
            attribution_slack: 2_000_000,
            write_behind: 100_000,
            clock_tolerance: 10_000,
            recovery_bound: 10_000_000,
            shards: 16,
        }
    }
}

/// Which rule a violation breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rule {
    LostWebhook,
    DoubleAccept,
    Deadline,
    RateLimit,
    Recovery,
    Takeover,
}

/// A broken rule and the events that show it.
#[derive(Debug, Clone)]
pub struct Violation {
    pub rule: Rule,
    pub message: String,
    pub events: Vec<Event>,
}

/// Why a double accept was not counted as a violation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attribution {
    /// Overlaps the window of this fault (index into the history's faults).
    Fault { index: usize, kind: FaultKind },
    /// One of the answers came from an edge's local state.
    Local,
}

/// A double accept the checker explained.
#[derive(Debug, Clone)]
pub struct AttributedConflict {
    pub why: Attribution,
    pub holder: Event,
    pub second: Event,
}

/// Everything the checker found.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub violations: Vec<Violation>,
    pub attributed: Vec<AttributedConflict>,
    /// Calls by [`CallResult::label`].
    pub ops_by_result: BTreeMap<String, u64>,
    pub calls: usize,
    /// The slowest call (latency, timeout).
    pub max_latency: Micros,
    pub max_latency_timeout: Micros,
    /// Largest `latency − timeout` seen (negative: every call was early).
    pub worst_overrun: i64,
    /// The same, less the process stalls inside each call.
    pub worst_overrun_adjusted: i64,
    /// Process stalls recorded, and the longest.
    pub stalls: usize,
    pub stall_max: Micros,
    /// Per shard, how long after the last fault ended it first answered.
    pub recovery: BTreeMap<u32, Micros>,
    /// Worst of `recovery`.
    pub recovery_max: Option<Micros>,
    /// Per fault (same order as `faults`): how long after it ended every shard
    /// had answered from the fleet (`None`: some shard never did, or the fault
    /// never ended).
    pub recovery_by_fault: Vec<Option<Micros>>,
    /// Per fault: for one that isolates a node, how long after its start every
    /// shard had answered from the fleet a call invoked after `start + lease
    /// TTL` (`None` for other kinds, or when some shard was not taken over).
    pub takeover_by_fault: Vec<Option<Micros>>,
    /// When the last fault ended.
    pub last_fault_end: Option<Micros>,
    pub faults: Vec<FaultEvent>,
    /// Duplicates checked against a commit, and hit `Ok`s checked for conflicts.
    pub duplicates_checked: usize,
    pub accepts_checked: usize,
    /// Runs of accepted charges whose rate bound was evaluated.
    pub rate_windows_checked: u64,
    /// The tightest rate margin seen: (tenant, kind, used µs, bound µs).
    pub tightest_rate: Option<(String, Kind, u64, u64)>,
}

impl Report {
    pub fn is_clean(&self) -> bool {
        self.violations.is_empty()
    }

    pub fn violations_of(&self, rule: Rule) -> usize {
        self.violations.iter().filter(|v| v.rule == rule).count()
    }

    /// A human-readable summary (what the fault tests print).
    pub fn render(&self) -> String {
        let ms = |us: Micros| us as f64 / 1000.0;
        let mut out = String::new();
        let _ = writeln!(out, "calls: {}", self.calls);
        for (label, n) in &self.ops_by_result {
            let _ = writeln!(out, "  {label:<28} {n}");
        }
        let _ = writeln!(out, "faults: {}", self.faults.len());
        for (i, f) in self.faults.iter().enumerate() {
            let took = f.end.map(|e| format!("{:.0} ms", ms(e - f.start)));
            let recovered = match self.recovery_by_fault.get(i).copied().flatten() {
                Some(r) => format!("every shard answered {:.0} ms after its end", ms(r)),
                None => "NOT every shard answered after it".into(),
            };
            let taken = match (f.kind.isolates_node(), self.takeover_by_fault.get(i)) {
                (true, Some(Some(t))) => {
                    format!("; taken over {:.0} ms after its start", ms(*t))
                }
                (true, _) => "; NOT taken over while it lasted".into(),
                (false, _) => String::new(),
            };
            let _ = writeln!(
                out,
                "  #{i} {:?} {} at {:.1} s, lasted {}; {recovered}{taken}",
                f.kind,
                f.target,
                ms(f.start) / 1000.0,
                took.unwrap_or_else(|| "forever (never ended)".into())
            );
        }
        if let Some(worst) = self.recovery_by_fault.iter().copied().flatten().max() {
            let _ = writeln!(
                out,
                "recovery after each fault: worst {:.0} ms (every shard answering from the fleet)",
                ms(worst)
            );
        }
        let _ = writeln!(
            out,
            "duplicates checked: {}, accepts checked: {}, rate windows: {}",
            self.duplicates_checked, self.accepts_checked, self.rate_windows_checked
        );
        if let Some((tenant, kind, used, bound)) = &self.tightest_rate {
            let _ = writeln!(
                out,
                "tightest rate window: {tenant}/{kind:?} used {:.1} ms of increments, bound {:.1} ms",
                ms(*used),
                ms(*bound)
            );
        }
        let _ = writeln!(
            out,
            "max latency: {:.1} ms (timeout {:.0} ms); worst overrun {:+.1} ms, {:+.1} ms less process stalls ({} stalls, longest {:.1} ms)",
            ms(self.max_latency),
            ms(self.max_latency_timeout),
            self.worst_overrun as f64 / 1000.0,
            self.worst_overrun_adjusted as f64 / 1000.0,
            self.stalls,
            ms(self.stall_max)
        );
        match self.recovery_max {
            Some(r) => {
                let _ = writeln!(
                    out,
                    "recovery after last fault: every shard within {:.0} ms",
                    ms(r)
                );
            }
            None => {
                let _ = writeln!(out, "recovery: no faults, or not measured");
            }
        }
        let local = self
            .attributed
            .iter()
            .filter(|a| a.why == Attribution::Local)
            .count();
        let mut by_kind: BTreeMap<FaultKind, usize> = BTreeMap::new();
        for a in &self.attributed {
            if let Attribution::Fault { kind, .. } = a.why {
                *by_kind.entry(kind).or_default() += 1;
            }
        }
        let _ = writeln!(
            out,
            "attributed conflicts: {} ({local} local, {} to fault windows {by_kind:?})",
            self.attributed.len(),
            self.attributed.len() - local
        );
        // Conflicts in fault windows first: the fleet answered both, which is
        // rarer and more telling than an edge's local answer.
        let (in_faults, local_only): (Vec<_>, Vec<_>) = self
            .attributed
            .iter()
            .partition(|a| a.why != Attribution::Local);
        let summary = |out: &mut String, a: &AttributedConflict| {
            let _ = writeln!(
                out,
                "  {:?}: holder {} {:?} then {} got Ok for {:?} at {:.1} s",
                a.why,
                a.holder.client,
                a.holder.hook_id(),
                a.second.client,
                a.second.hook_id(),
                ms(a.second.invoked) / 1000.0
            );
        };
        for a in in_faults.iter().take(10) {
            summary(&mut out, a);
            let _ = writeln!(out, "      holder: {:?}", a.holder);
            let _ = writeln!(out, "      second: {:?}", a.second);
        }
        for a in local_only
            .iter()
            .take(10usize.saturating_sub(in_faults.len()))
        {
            summary(&mut out, a);
        }
        let _ = writeln!(out, "violations: {}", self.violations.len());
        for v in self.violations.iter().take(20) {
            let _ = writeln!(out, "  {:?}: {}", v.rule, v.message);
            for e in &v.events {
                let _ = writeln!(out, "      {e:?}");
            }
        }
        out
    }
}

type Scope<'a> = (&'a str, &'a str, &'a str);

/// The fault windows, as `[start, end + lease TTL + slack]`; a fault that never
/// ended lasts forever.
fn windows(faults: &[FaultEvent], config: &CheckerConfig) -> Vec<(Micros, Micros)> {
    faults
        .iter()
        .map(|f| {
            let end = f
                .end
                .map(|e| e + config.lease_ttl + config.attribution_slack)
                .unwrap_or(Micros::MAX);
            (f.start, end)
        })
        .collect()
}

fn overlaps((a, b): (Micros, Micros), (c, d): (Micros, Micros)) -> bool {
    a <= d && c <= b
}

fn is_commit(e: &Event) -> bool {
    e.op == OpKind::Settle(Settlement::Commit)
}

fn is_release(e: &Event) -> bool {
    e.op == OpKind::Settle(Settlement::Release)
}

/// A settle that certainly did not change the claim.
fn settle_refused(e: &Event) -> bool {
    match &e.result {
        CallResult::Settle(outcome, _) => *outcome != SettleOutcome::Ok,
        CallResult::Error(kind) => kind.certainly_not_applied(),
        CallResult::Hit(..) => true,
    }
}

fn settled_ok(e: &Event) -> Option<Answered> {
    match &e.result {
        CallResult::Settle(SettleOutcome::Ok, a) => Some(*a),
        _ => None,
    }
}

/// A hit that certainly did not claim its key.
fn hit_refused(e: &Event) -> bool {
    match &e.result {
        CallResult::Hit(outcome, _) => *outcome != HitOutcome::Ok,
        CallResult::Error(kind) => kind.certainly_not_applied(),
        CallResult::Settle(..) => true,
    }
}

fn hit_ok(e: &Event) -> Option<Answered> {
    match (&e.op, &e.result) {
        (OpKind::Hit, CallResult::Hit(HitOutcome::Ok, a)) => Some(*a),
        _ => None,
    }
}

/// Runs every rule over the history.
pub fn check(events: &[Event], faults: &[FaultEvent], config: &CheckerConfig) -> Report {
    check_with_stalls(events, faults, &[], config)
}

/// [`check`] with the process stalls the history recorded.
pub fn check_with_stalls(
    events: &[Event],
    faults: &[FaultEvent],
    stalls: &[(Micros, Micros)],
    config: &CheckerConfig,
) -> Report {
    let mut report = Report {
        calls: events.len(),
        faults: faults.to_vec(),
        ..Report::default()
    };
    for e in events {
        *report.ops_by_result.entry(e.result.label()).or_default() += 1;
    }
    let fault_windows = windows(faults, config);

    let mut by_scope: HashMap<Scope<'_>, Vec<&Event>> = HashMap::new();
    for e in events {
        if let Some(scope) = e.claim_scope() {
            by_scope.entry(scope).or_default().push(e);
        }
    }
    for group in by_scope.values() {
        check_lost_webhooks(group, &mut report);
        check_double_accepts(group, faults, &fault_windows, config, &mut report);
    }
    check_deadlines(events, stalls, config, &mut report);
    check_rates(events, &fault_windows, config, &mut report);
    let answers = fleet_answers_by_shard(events, config.shards);
    check_recovery(events, faults, &answers, config, &mut report);
    check_takeover(faults, &answers, config, &mut report);
    report
}

fn check_lost_webhooks(group: &[&Event], report: &mut Report) {
    for dup in group {
        let CallResult::Hit(HitOutcome::Duplicate { hook_id }, _) = &dup.result else {
            continue;
        };
        report.duplicates_checked += 1;
        let same_hook = |e: &&&Event| e.hook_id() == Some(hook_id.as_str());
        let explained = group.iter().filter(same_hook).any(|commit| {
            is_commit(commit)
                && commit.invoked < dup.completed
                && !settle_refused(commit)
                && !group.iter().filter(same_hook).any(|release| {
                    is_release(release)
                        && settled_ok(release).is_some()
                        && release.invoked > commit.completed
                        && release.completed < dup.invoked
                })
        });
        if !explained {
            let mut shown = vec![(*dup).clone()];
            shown.extend(group.iter().filter(same_hook).map(|e| (*e).clone()));
            report.violations.push(Violation {
                rule: Rule::LostWebhook,
                message: format!(
                    "{} got Duplicate{{{hook_id}}} on {:?} at {} µs, but no commit of {hook_id} can explain it",
                    dup.client,
                    dup.claim_scope(),
                    dup.completed
                ),
                events: shown,
            });
        }
    }
}

/// Whether `holder` certainly held its key whenever `second` took effect
/// (anywhere from its invocation to its completion), as a committed claim
/// (`holder` is a commit) or a pending one (`holder` is a hit).
fn certainly_held(group: &[&Event], holder: &Event, second: &Event, tolerance: Micros) -> bool {
    let Some(claim) = &holder.claim else {
        return false;
    };
    if holder.completed >= second.invoked {
        return false;
    }
    if is_commit(holder) {
        return settled_ok(holder).is_some()
            && second.completed + tolerance < earliest_expiry(group, holder);
    }
    if hit_ok(holder).is_none() || second.completed + tolerance >= earliest_expiry(group, holder) {
        return false;
    }
    // Any release that may have freed it before the second hit finished.
    !group.iter().any(|e| {
        is_release(e)
            && e.hook_id() == Some(claim.hook_id.as_str())
            && e.invoked < second.completed
            && !settle_refused(e)
    })
}

/// The earliest instant the claim that `holder` (a commit or a hit answered
/// `Ok`) left on its key can expire.
///
/// A repeat does not renew a claim: a hit replayed by the hook that holds the
/// key pending, and a second commit of a committed claim, answer `Ok` and keep
/// the first one's expiry. So an earlier attempt of the same hook and kind that
/// may have taken effect (an uncertain one: a commit that timed out and was
/// retried) may have set the expiry, from as early as its invocation; but only
/// if its claim could still have been live when `holder` took effect, and then
/// not before that instant.
fn earliest_expiry(group: &[&Event], holder: &Event) -> Micros {
    let commit = is_commit(holder);
    let ttl = |e: &Event| {
        e.claim.as_ref().map_or(0, |c| {
            1000 * if commit { c.ttl_ms } else { c.pending_ttl_ms }
        })
    };
    let may_have_applied = |e: &Event| {
        if commit {
            is_commit(e) && !settle_refused(e)
        } else {
            e.op == OpKind::Hit && !hit_refused(e)
        }
    };
    let own = holder.invoked + ttl(holder);
    group
        .iter()
        .filter(|e| {
            !std::ptr::eq(**e, holder)
                && e.hook_id() == holder.hook_id()
                && may_have_applied(e)
                && e.invoked < holder.completed
                && e.completed + ttl(e) > holder.invoked
        })
        .map(|e| (e.invoked + ttl(e)).max(holder.invoked))
        .fold(own, Micros::min)
}

fn check_double_accepts(
    group: &[&Event],
    faults: &[FaultEvent],
    fault_windows: &[(Micros, Micros)],
    config: &CheckerConfig,
    report: &mut Report,
) {
    for second in group {
        let Some(second_source) = hit_ok(second) else {
            continue;
        };
        report.accepts_checked += 1;
        // Every hook that certainly held the key, commits first: the
        // conflict stands on the one least explained.
        let mut holders: Vec<&Event> = group
            .iter()
            .copied()
            .filter(|holder| {
                holder.hook_id() != second.hook_id()
                    && certainly_held(group, holder, second, config.clock_tolerance)
            })
            .collect();
        if holders.is_empty() {
            continue;
        }
        holders.sort_by_key(|holder| !is_commit(holder));
        let explain = |holder: &Event| {
            let holder_source = holder.result.answered().unwrap_or(Answered::Fleet);
            if second_source == Answered::Local || holder_source == Answered::Local {
                Some(Attribution::Local)
            } else {
                fault_windows
                    .iter()
                    .enumerate()
                    .filter(|(_, w)| overlaps(**w, (second.invoked, second.completed)))
                    .map(|(index, _)| index)
                    .find(|&index| fault_explains(&faults[index], holder))
                    .map(|index| Attribution::Fault {
                        index,
                        kind: faults[index].kind,
                    })
            }
        };
        let (holder, why) = match holders.iter().find(|holder| explain(holder).is_none()) {
            Some(unexplained) => (*unexplained, None),
            None => (holders[0], explain(holders[0])),
        };
        match why {
            Some(why) => report.attributed.push(AttributedConflict {
                why,
                holder: (*holder).clone(),
                second: (*second).clone(),
            }),
            None => report.violations.push(Violation {
                rule: Rule::DoubleAccept,
                message: format!(
                    "{} got Ok for {:?} on {:?} at {} µs while {:?} held the key ({} by {})",
                    second.client,
                    second.hook_id(),
                    second.claim_scope(),
                    second.invoked,
                    holder.hook_id(),
                    if is_commit(holder) {
                        "committed"
                    } else {
                        "pending"
                    },
                    holder.client
                ),
                events: vec![(*holder).clone(), (*second).clone()],
            }),
        }
    }
}

/// Whether `fault` may explain a conflict with `holder`. Any fault may, but a
/// graceful one: a node that stops on SIGTERM, or shards moving to a node
/// that joins, hand over state written before the handover, so a commit
/// answered `Ok` before the fault began is loaded by the new owner.
fn fault_explains(fault: &FaultEvent, holder: &Event) -> bool {
    let graceful = matches!(fault.kind, FaultKind::StopNode | FaultKind::AddNode);
    let committed_before =
        is_commit(holder) && settled_ok(holder).is_some() && holder.completed < fault.start;
    !(graceful && committed_before)
}

fn check_deadlines(
    events: &[Event],
    stalls: &[(Micros, Micros)],
    config: &CheckerConfig,
    report: &mut Report,
) {
    let mut worst = i64::MIN;
    let mut worst_adjusted = i64::MIN;
    for e in events {
        let latency = e.latency();
        if latency > report.max_latency {
            report.max_latency = latency;
            report.max_latency_timeout = e.timeout;
        }
        let stalled: Micros = stalls
            .iter()
            .map(|&(a, b)| b.min(e.completed).saturating_sub(a.max(e.invoked)))
            .sum();
        let adjusted = latency.saturating_sub(stalled);
        worst = worst.max(latency as i64 - e.timeout as i64);
        worst_adjusted = worst_adjusted.max(adjusted as i64 - e.timeout as i64);
        if adjusted > e.timeout + config.deadline_slack {
            report.violations.push(Violation {
                rule: Rule::Deadline,
                message: format!(
                    "{} {:?} took {latency} µs ({stalled} µs of it with the process stalled) against a timeout of {} µs (+{} µs slack)",
                    e.client, e.op, e.timeout, config.deadline_slack
                ),
                events: vec![e.clone()],
            });
        }
    }
    report.worst_overrun = if events.is_empty() { 0 } else { worst };
    report.worst_overrun_adjusted = if events.is_empty() { 0 } else { worst_adjusted };
    report.stalls = stalls.len();
    report.stall_max = stalls.iter().map(|&(a, b)| b - a).max().unwrap_or(0);
}

/// One accepted charge: (invoked, completed, increment, capacity, local edge).
type Accepted<'a> = (Micros, Micros, u64, u64, Option<&'a str>);

fn check_rates(
    events: &[Event],
    fault_windows: &[(Micros, Micros)],
    config: &CheckerConfig,
    report: &mut Report,
) {
    let mut by_bucket: BTreeMap<(&str, Kind), Vec<(Accepted<'_>, &Event)>> = BTreeMap::new();
    for e in events {
        let Some(source) = hit_ok(e) else { continue };
        for c in &e.charges {
            let local = (source == Answered::Local).then_some(e.client.as_str());
            by_bucket
                .entry((e.tenant.as_str(), c.kind))
                .or_default()
                .push((
                    (e.invoked, e.completed, c.increment_us, c.capacity_us, local),
                    e,
                ));
        }
    }
    let mut tightest: Option<(f64, String, Kind, u64, u64)> = None;
    for ((tenant, kind), mut accepted) in by_bucket {
        accepted.sort_by_key(|(a, _)| (a.0, a.1));
        // What is left to add from each start: a run whose bound already covers
        // it can stop growing.
        let mut suffix = vec![0u64; accepted.len() + 1];
        for i in (0..accepted.len()).rev() {
            suffix[i] = suffix[i + 1] + accepted[i].0 .2;
        }
        // One violation per bucket is enough to show it (every later start
        // inside the same burst would repeat it).
        let mut broken = false;
        for i in 0..accepted.len() {
            if broken {
                break;
            }
            let start = accepted[i].0 .0;
            let mut used = 0u64;
            let mut latest = 0u64;
            let mut capacity = 0u64;
            let mut locals: BTreeSet<&str> = BTreeSet::new();
            for (j, ((_, completed, increment, cap, local), _)) in
                accepted.iter().enumerate().skip(i)
            {
                used += increment;
                latest = latest.max(*completed);
                capacity = capacity.max(*cap);
                if let Some(edge) = local {
                    locals.insert(edge);
                }
                let span = latest.saturating_sub(start);
                let mut bound = (1 + locals.len() as u64) * (capacity + span);
                // The fault allowance only matters past the plain bound (and
                // scanning the faults for every run would dominate the check).
                let mut faults_in = 0;
                if used > bound {
                    faults_in = fault_windows
                        .iter()
                        .filter(|w| overlaps(**w, (start, latest)))
                        .count() as u64;
                    bound += faults_in * (capacity + config.write_behind);
                }
                report.rate_windows_checked += 1;
                let ratio = used as f64 / bound.max(1) as f64;
                if tightest.as_ref().is_none_or(|t| ratio > t.0) {
                    tightest = Some((ratio, tenant.to_string(), kind, used, bound));
                }
                if used > bound {
                    report.violations.push(Violation {
                        rule: Rule::RateLimit,
                        message: format!(
                            "{tenant}/{kind:?}: {} accepted hits from {start} µs to {latest} µs used {used} µs of increments, over the bound of {bound} µs (capacity {capacity}, {} local edges, {faults_in} faults)",
                            j - i + 1,
                            locals.len()
                        ),
                        events: vec![accepted[i].1.clone(), accepted[j].1.clone()],
                    });
                    broken = true;
                    break;
                }
                // Nothing later can break a bound that already covers every
                // remaining increment (the bound only grows with the run).
                if bound >= used + suffix[j + 1] {
                    break;
                }
            }
        }
    }
    report.tightest_rate = tightest.map(|(_, t, k, u, b)| (t, k, u, b));
}

/// Per shard, its calls that got a fleet answer, as (invoked, completed),
/// sorted by invocation.
fn fleet_answers_by_shard(events: &[Event], shards: u32) -> Vec<Vec<(Micros, Micros)>> {
    let mut by_shard = vec![Vec::new(); shards as usize];
    for e in events {
        if e.result.answered() != Some(Answered::Fleet) {
            continue;
        }
        if let Some(calls) = by_shard.get_mut(e.shard as usize) {
            calls.push((e.invoked, e.completed));
        }
    }
    for calls in &mut by_shard {
        calls.sort_unstable();
    }
    by_shard
}

/// The earliest completion of a call invoked at or after `from` (and, when
/// given, completed by `until`) in `calls` (sorted by invocation).
fn first_answer(calls: &[(Micros, Micros)], from: Micros, until: Option<Micros>) -> Option<Micros> {
    let start = calls.partition_point(|&(invoked, _)| invoked < from);
    let mut best: Option<Micros> = None;
    for &(invoked, completed) in &calls[start..] {
        // A call invoked later cannot complete earlier than that.
        if best.is_some_and(|b| invoked >= b) || until.is_some_and(|u| invoked > u) {
            break;
        }
        if until.is_some_and(|u| completed > u) {
            continue;
        }
        best = Some(best.map_or(completed, |b| b.min(completed)));
    }
    best
}

fn check_recovery(
    events: &[Event],
    faults: &[FaultEvent],
    answers: &[Vec<(Micros, Micros)>],
    config: &CheckerConfig,
    report: &mut Report,
) {
    report.recovery_by_fault = vec![None; faults.len()];
    if faults.is_empty() {
        return;
    }
    if let Some(open) = faults.iter().find(|f| f.end.is_none()) {
        report.violations.push(Violation {
            rule: Rule::Recovery,
            message: format!("fault {:?} on {} never ended", open.kind, open.target),
            events: Vec::new(),
        });
        return;
    }
    let last = faults.iter().filter_map(|f| f.end).max().unwrap_or(0);
    report.last_fault_end = Some(last);
    for (index, fault) in faults.iter().enumerate() {
        let end = fault.end.unwrap_or(last);
        let mut worst = Some(0);
        for (shard, calls) in answers.iter().enumerate() {
            let shard = shard as u32;
            let took = first_answer(calls, end, None).map(|at| at - end);
            if end == last {
                if let Some(took) = took.filter(|t| *t <= config.recovery_bound) {
                    report.recovery.insert(shard, took);
                }
            }
            match took {
                Some(took) if took <= config.recovery_bound => {
                    worst = worst.map(|w: Micros| w.max(took));
                }
                other => {
                    worst = None;
                    report.violations.push(Violation {
                        rule: Rule::Recovery,
                        message: match other {
                            Some(took) => format!(
                                "shard {shard} first answered {took} µs after fault #{index} ({:?} on {}) ended, over the bound of {} µs",
                                fault.kind, fault.target, config.recovery_bound
                            ),
                            None => format!(
                                "shard {shard} never answered from the fleet after fault #{index} ({:?} on {}) ended",
                                fault.kind, fault.target
                            ),
                        },
                        events: Vec::new(),
                    });
                }
            }
        }
        report.recovery_by_fault[index] = worst;
    }
    report.recovery_max = report.recovery.values().copied().max();
    let fleet_after =
        |e: &&Event| e.invoked >= last && e.result.answered() == Some(Answered::Fleet);
    let degraded: BTreeSet<&str> = events
        .iter()
        .filter(|e| e.result.answered() == Some(Answered::Local))
        .map(|e| e.client.as_str())
        .collect();
    for edge in degraded {
        let back = events
            .iter()
            .filter(|e| e.client == edge)
            .filter(fleet_after)
            .map(|e| e.completed - last)
            .min();
        if back.is_none_or(|took| took > config.recovery_bound) {
            report.violations.push(Violation {
                rule: Rule::Recovery,
                message: format!(
                    "edge {edge} answered locally and did not get a fleet answer within {} µs of the last fault (first: {back:?})",
                    config.recovery_bound
                ),
                events: Vec::new(),
            });
        }
    }
}

fn check_takeover(
    faults: &[FaultEvent],
    answers: &[Vec<(Micros, Micros)>],
    config: &CheckerConfig,
    report: &mut Report,
) {
    report.takeover_by_fault = vec![None; faults.len()];
    for (index, fault) in faults.iter().enumerate() {
        // A fault that never ended is the recovery rule's violation.
        let (true, Some(end)) = (fault.kind.isolates_node(), fault.end) else {
            continue;
        };
        let from = fault.start + config.lease_ttl;
        let mut worst = Some(0);
        for (shard, calls) in answers.iter().enumerate() {
            match first_answer(calls, from, Some(end)) {
                Some(at) => worst = worst.map(|w: Micros| w.max(at - fault.start)),
                None => {
                    worst = None;
                    report.violations.push(Violation {
                        rule: Rule::Takeover,
                        message: format!(
                            "shard {shard} got no fleet answer to a call made between {from} µs (fault #{index} {:?} on {} began + lease TTL) and the fault's end at {end} µs: nobody took it over",
                            fault.kind, fault.target
                        ),
                        events: Vec::new(),
                    });
                }
            }
        }
        report.takeover_by_fault[index] = worst;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::ClaimRef;
    use crate::requests::hooks;

    const MS: Micros = 1_000;

    fn event(op: OpKind, hook: &str, at_ms: u64, result: CallResult) -> Event {
        Event {
            client: "c".into(),
            op,
            tenant: "t".into(),
            shard: 0,
            claim: Some(ClaimRef {
                source_id: "src".into(),
                key: "k".into(),
                hook_id: hook.into(),
                ttl_ms: 60_000,
                pending_ttl_ms: 30_000,
            }),
            charges: vec![hooks("t", 1000, 1)],
            invoked: at_ms * MS,
            completed: at_ms * MS + MS,
            timeout: 250 * MS,
            result,
        }
    }

    fn ok() -> CallResult {
        CallResult::Hit(HitOutcome::Ok, Answered::Fleet)
    }

    fn committed() -> CallResult {
        CallResult::Settle(SettleOutcome::Ok, Answered::Fleet)
    }

    fn fault(kind: FaultKind) -> Vec<FaultEvent> {
        vec![FaultEvent {
            kind,
            target: "node-a".into(),
            start: 50 * MS,
            end: Some(1_000 * MS),
        }]
    }

    /// h1 claims k and commits it before the fault; h2 is accepted on k
    /// during the fault's window.
    fn committed_before_the_fault() -> Vec<Event> {
        vec![
            event(OpKind::Hit, "h1", 0, ok()),
            event(OpKind::Settle(Settlement::Commit), "h1", 10, committed()),
            event(OpKind::Hit, "h2", 2_000, ok()),
        ]
    }

    fn double_accepts(report: &Report) -> usize {
        report.violations_of(Rule::DoubleAccept)
    }

    #[test]
    fn a_graceful_fault_does_not_explain_losing_an_earlier_commit() {
        let config = CheckerConfig::default();
        for kind in [FaultKind::StopNode, FaultKind::AddNode] {
            let report = check(&committed_before_the_fault(), &fault(kind), &config);
            assert_eq!(double_accepts(&report), 1, "{kind:?}: {}", report.render());
            assert!(report.attributed.is_empty(), "{kind:?}");
        }
        // A hard fault still may (the node died with what it had not written).
        for kind in [
            FaultKind::KillNode,
            FaultKind::RestartNats,
            FaultKind::NetCut,
        ] {
            let report = check(&committed_before_the_fault(), &fault(kind), &config);
            assert_eq!(double_accepts(&report), 0, "{kind:?}: {}", report.render());
            assert_eq!(report.attributed.len(), 1, "{kind:?}");
        }
    }

    #[test]
    fn a_graceful_fault_explains_a_commit_made_during_it_or_a_pending_claim() {
        let config = CheckerConfig::default();
        let during = vec![
            event(OpKind::Hit, "h1", 0, ok()),
            event(OpKind::Settle(Settlement::Commit), "h1", 60, committed()),
            event(OpKind::Hit, "h2", 2_000, ok()),
        ];
        let report = check(&during, &fault(FaultKind::StopNode), &config);
        assert_eq!(double_accepts(&report), 0, "{}", report.render());
        assert_eq!(report.attributed.len(), 1);

        let pending = vec![
            event(OpKind::Hit, "h1", 0, ok()),
            event(OpKind::Hit, "h2", 2_000, ok()),
        ];
        let report = check(&pending, &fault(FaultKind::AddNode), &config);
        assert_eq!(double_accepts(&report), 0, "{}", report.render());
        assert_eq!(report.attributed.len(), 1);
    }

    #[test]
    fn another_overlapping_fault_may_still_explain_it() {
        let mut faults = fault(FaultKind::StopNode);
        faults.push(FaultEvent {
            kind: FaultKind::KillNode,
            start: 1_500 * MS,
            end: Some(1_600 * MS),
            ..faults[0].clone()
        });
        let report = check(
            &committed_before_the_fault(),
            &faults,
            &CheckerConfig::default(),
        );
        assert_eq!(double_accepts(&report), 0, "{}", report.render());
        assert_eq!(
            report.attributed[0].why,
            Attribution::Fault {
                index: 1,
                kind: FaultKind::KillNode
            }
        );
    }
}
