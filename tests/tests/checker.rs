//! The checker against hand-built histories: each rule is broken once and must
//! be caught, and good histories (including a conflict inside a fault window,
//! uncertain commits, and an edge answering locally) must pass.

use ankusa_actors::{HitOutcome, SettleOutcome, Settlement};
use ankusa_tests::checker::{check, check_with_stalls, Attribution, CheckerConfig, Report, Rule};
use ankusa_tests::history::{
    Answered, CallResult, ClaimRef, ErrorKind, Event, FaultEvent, FaultKind, Micros, OpKind,
};
use ankusa_tests::requests::hooks;

const MS: Micros = 1_000;
const TIMEOUT: Micros = 250 * MS;

fn config() -> CheckerConfig {
    CheckerConfig {
        shards: 2,
        ..CheckerConfig::default()
    }
}

/// Asserts the checker found `want` violations of `rule`, showing its report if not.
fn expect_violations(report: &Report, rule: Rule, want: usize) {
    assert_eq!(report.violations_of(rule), want, "{}", report.render());
}

fn claim(key: &str, hook: &str) -> ClaimRef {
    ClaimRef {
        source_id: "src".into(),
        key: key.into(),
        hook_id: hook.into(),
        ttl_ms: 4_000,
        pending_ttl_ms: 3_000,
    }
}

/// A hit on tenant `t` (shard 0), key, hook, from `at_ms` for 1 ms.
fn hit(client: &str, key: &str, hook: &str, at_ms: u64, result: CallResult) -> Event {
    Event {
        client: client.into(),
        op: OpKind::Hit,
        tenant: "t".into(),
        shard: 0,
        claim: Some(claim(key, hook)),
        charges: vec![hooks("t", 1000, 1)],
        invoked: at_ms * MS,
        completed: at_ms * MS + MS,
        timeout: TIMEOUT,
        result,
    }
}

fn settle(
    client: &str,
    key: &str,
    hook: &str,
    how: Settlement,
    at_ms: u64,
    result: CallResult,
) -> Event {
    Event {
        op: OpKind::Settle(how),
        charges: Vec::new(),
        ..hit(client, key, hook, at_ms, result)
    }
}

fn ok() -> CallResult {
    CallResult::Hit(HitOutcome::Ok, Answered::Fleet)
}

fn dup(hook: &str) -> CallResult {
    CallResult::Hit(
        HitOutcome::Duplicate {
            hook_id: hook.into(),
        },
        Answered::Fleet,
    )
}

fn settled() -> CallResult {
    CallResult::Settle(SettleOutcome::Ok, Answered::Fleet)
}

fn timeout() -> CallResult {
    CallResult::Error(ErrorKind::Timeout)
}

/// h1 claims and commits k; a later hit is told Duplicate{h1}.
fn committed_then_duplicate() -> Vec<Event> {
    vec![
        hit("a", "k", "h1", 0, ok()),
        settle("a", "k", "h1", Settlement::Commit, 10, settled()),
        hit("b", "k", "h2", 20, dup("h1")),
    ]
}

#[test]
fn a_good_history_passes() {
    let report = check(&committed_then_duplicate(), &[], &config());
    assert!(report.is_clean(), "{}", report.render());
    assert_eq!(report.duplicates_checked, 1);
    assert_eq!(report.accepts_checked, 1);
}

#[test]
fn a_duplicate_without_any_commit_is_a_lost_webhook() {
    let events = vec![
        hit("a", "k", "h1", 0, ok()),
        hit("b", "k", "h2", 20, dup("h1")),
    ];
    let report = check(&events, &[], &config());
    expect_violations(&report, Rule::LostWebhook, 1);
    // The report names the violating Duplicate.
    assert_eq!(report.violations[0].events[0].hook_id(), Some("h2"));
}

#[test]
fn a_duplicate_naming_a_hook_whose_commit_was_refused_is_lost() {
    let events = vec![
        hit("a", "k", "h1", 0, ok()),
        settle(
            "a",
            "k",
            "h1",
            Settlement::Commit,
            10,
            CallResult::Settle(SettleOutcome::NotFound, Answered::Fleet),
        ),
        hit("b", "k", "h2", 20, dup("h1")),
    ];
    let report = check(&events, &[], &config());
    expect_violations(&report, Rule::LostWebhook, 1);
}

#[test]
fn a_duplicate_before_the_commit_was_invoked_is_lost() {
    let events = vec![
        hit("a", "k", "h1", 0, ok()),
        hit("b", "k", "h2", 5, dup("h1")),
        settle("a", "k", "h1", Settlement::Commit, 10, settled()),
    ];
    let report = check(&events, &[], &config());
    expect_violations(&report, Rule::LostWebhook, 1);
}

#[test]
fn a_duplicate_after_a_successful_release_is_lost() {
    // The commit timed out (uncertain), then a release succeeded: so the commit
    // never took, and the key was free.
    let events = vec![
        hit("a", "k", "h1", 0, ok()),
        settle("a", "k", "h1", Settlement::Commit, 10, timeout()),
        settle("a", "k", "h1", Settlement::Release, 300, settled()),
        hit("b", "k", "h2", 400, dup("h1")),
    ];
    let report = check(&events, &[], &config());
    expect_violations(&report, Rule::LostWebhook, 1);
}

#[test]
fn an_uncertain_commit_explains_a_duplicate() {
    let events = vec![
        hit("a", "k", "h1", 0, ok()),
        settle("a", "k", "h1", Settlement::Commit, 10, timeout()),
        hit("b", "k", "h2", 300, dup("h1")),
        // A duplicate concurrent with the commit is explained too.
        settle("a", "k2", "h3", Settlement::Commit, 500, settled()),
        Event {
            completed: 502 * MS,
            ..hit("b", "k2", "h4", 499, dup("h3"))
        },
    ];
    let report = check(&events, &[], &config());
    assert!(report.is_clean(), "{}", report.render());
}

#[test]
fn a_second_accept_of_a_committed_key_is_a_double_accept() {
    let mut events = committed_then_duplicate();
    events.push(hit("c", "k", "h3", 100, ok()));
    let report = check(&events, &[], &config());
    expect_violations(&report, Rule::DoubleAccept, 1);
}

#[test]
fn a_second_accept_that_may_have_taken_effect_after_the_expiry_is_fine() {
    // Committed at 10 ms for 4 s: the earliest expiry is 4.01 s. A hit invoked
    // at 3.9 s that completes at 4.1 s may have been applied after it.
    let mut events = committed_then_duplicate();
    events.push(Event {
        completed: 4_100 * MS,
        ..hit("c", "k", "h3", 3_900, ok())
    });
    // Pending from 0 for 3 s; a hit from 2.95 s to 3.2 s.
    events.push(hit("a", "p", "h4", 0, ok()));
    events.push(Event {
        completed: 3_200 * MS,
        ..hit("b", "p", "h5", 2_950, ok())
    });
    let report = check(&events, &[], &config());
    assert!(report.is_clean(), "{}", report.render());

    // The same hits completing before the expiries are double accepts.
    let mut events = committed_then_duplicate();
    events.push(Event {
        completed: 3_990 * MS,
        ..hit("c", "k", "h3", 3_900, ok())
    });
    events.push(hit("a", "p", "h4", 0, ok()));
    events.push(Event {
        completed: 2_980 * MS,
        ..hit("b", "p", "h5", 2_950, ok())
    });
    let report = check(&events, &[], &config());
    expect_violations(&report, Rule::DoubleAccept, 2);
}

#[test]
fn a_retried_commit_keeps_the_expiry_of_the_attempt_that_timed_out() {
    // h1's first commit (10 ms) times out at its 250 ms budget, though the node
    // may have applied it at once; the retry at 260 ms answers Ok and keeps
    // that expiry, 4.01 s. A hit by h2 at 4.03 s is then fine, although it
    // completes before 260 ms + 4 s (a history the checker used to flag).
    let history = |first_commit: Option<CallResult>| {
        let mut events = vec![hit("a", "k", "h1", 0, ok())];
        if let Some(result) = first_commit {
            events.push(Event {
                completed: 260 * MS,
                ..settle("a", "k", "h1", Settlement::Commit, 10, result)
            });
        }
        events.push(settle("a", "k", "h1", Settlement::Commit, 260, settled()));
        events.push(hit("b", "k", "h2", 4_030, ok()));
        events
    };
    let report = check(&history(Some(timeout())), &[], &config());
    assert!(report.is_clean(), "{}", report.render());

    // Without the first attempt, or with one that certainly did nothing, the
    // claim lives until 4.26 s at the earliest, and h2's Ok is a double accept.
    let refused = CallResult::Settle(SettleOutcome::NotFound, Answered::Fleet);
    for first in [None, Some(refused)] {
        let report = check(&history(first), &[], &config());
        expect_violations(&report, Rule::DoubleAccept, 1);
    }
}

#[test]
fn a_second_accept_while_the_first_is_pending_is_a_double_accept() {
    let events = vec![hit("a", "k", "h1", 0, ok()), hit("b", "k", "h2", 100, ok())];
    let report = check(&events, &[], &config());
    expect_violations(&report, Rule::DoubleAccept, 1);
}

#[test]
fn accepts_after_expiry_release_or_uncertain_release_are_fine() {
    let events = vec![
        // Committed for 4 s: a new accept after it expired.
        hit("a", "k", "h1", 0, ok()),
        settle("a", "k", "h1", Settlement::Commit, 10, settled()),
        hit("b", "k", "h2", 4_100, ok()),
        // Pending for 3 s, never settled: a new accept after it expired.
        hit("a", "p", "h3", 0, ok()),
        hit("b", "p", "h4", 3_100, ok()),
        // Released: free at once.
        hit("a", "r", "h5", 0, ok()),
        settle("a", "r", "h5", Settlement::Release, 10, settled()),
        hit("b", "r", "h6", 20, ok()),
        // A release that timed out may have freed it.
        hit("a", "u", "h7", 0, ok()),
        settle("a", "u", "h7", Settlement::Release, 10, timeout()),
        hit("b", "u", "h8", 300, ok()),
        // A commit that timed out is not known to hold the key.
        hit("a", "v", "h9", 0, ok()),
        settle("a", "v", "h9", Settlement::Commit, 10, timeout()),
        settle("a", "v", "h9", Settlement::Release, 300, settled()),
        hit("b", "v", "h10", 400, ok()),
    ];
    let report = check(&events, &[], &config());
    assert!(report.is_clean(), "{}", report.render());
    assert_eq!(report.accepts_checked, 10);
}

#[test]
fn a_double_accept_inside_a_fault_window_is_attributed_not_a_violation() {
    let mut events = committed_then_duplicate();
    // A node was killed at 50 ms and restarted at 1 s; the conflicting accept at
    // 2 s is within [start, end + lease TTL + slack].
    events.push(hit("c", "k", "h3", 2_000, ok()));
    // Every shard answers after the fault.
    events.push(Event {
        shard: 1,
        ..hit("c", "other", "h4", 1_100, ok())
    });
    let faults = vec![FaultEvent {
        kind: FaultKind::KillNode,
        target: "node-a".into(),
        start: 50 * MS,
        end: Some(1_000 * MS),
    }];
    let report = check(&events, &faults, &config());
    assert!(report.is_clean(), "{}", report.render());
    assert_eq!(report.attributed.len(), 1);
    assert_eq!(
        report.attributed[0].why,
        Attribution::Fault {
            index: 0,
            kind: FaultKind::KillNode
        }
    );
    assert_eq!(report.attributed[0].second.hook_id(), Some("h3"));

    // The same conflict well after the window, on a claim committed for a
    // minute, is a violation.
    let mut late = vec![
        hit("a", "k", "h1", 0, ok()),
        Event {
            claim: Some(ClaimRef {
                ttl_ms: 60_000,
                ..claim("k", "h1")
            }),
            ..settle("a", "k", "h1", Settlement::Commit, 10, settled())
        },
    ];
    late.push(hit("c", "k", "h3", 20_000, ok()));
    late.push(Event {
        shard: 1,
        ..hit("c", "other", "h4", 1_100, ok())
    });
    let report = check(&late, &faults, &config());
    expect_violations(&report, Rule::DoubleAccept, 1);
}

#[test]
fn a_conflict_with_a_local_answer_is_attributed() {
    let mut events = committed_then_duplicate();
    events.push(hit(
        "edge",
        "k",
        "h3",
        100,
        CallResult::Hit(HitOutcome::Ok, Answered::Local),
    ));
    let report = check(&events, &[], &config());
    assert!(report.is_clean(), "{}", report.render());
    assert_eq!(report.attributed.len(), 1);
    assert_eq!(report.attributed[0].why, Attribution::Local);
}

#[test]
fn a_late_call_breaks_the_deadline_unless_the_process_was_stalled() {
    let mut events = committed_then_duplicate();
    events.push(Event {
        completed: 1_000 * MS + TIMEOUT + 30 * MS,
        result: timeout(),
        ..hit("c", "x", "h9", 1_000, ok())
    });
    let report = check(&events, &[], &config());
    expect_violations(&report, Rule::Deadline, 1);
    assert_eq!(report.worst_overrun, 30 * MS as i64);

    // 10 ms of it with the whole process descheduled: within the slack.
    let stalls = [(1_100 * MS, 1_110 * MS)];
    let report = check_with_stalls(&events, &[], &stalls, &config());
    assert!(report.is_clean(), "{}", report.render());
    assert_eq!(report.worst_overrun_adjusted, 20 * MS as i64);
}

/// One fleet answer on each of the two shards at `at` ms (so recovery holds).
fn both_shards(at: u64) -> Vec<Event> {
    vec![
        hit(
            "probe",
            &format!("probe-{at}"),
            &format!("p0-{at}"),
            at,
            ok(),
        ),
        Event {
            shard: 1,
            ..hit(
                "probe",
                &format!("probe1-{at}"),
                &format!("p1-{at}"),
                at,
                ok(),
            )
        },
    ]
}

/// `n` accepted hits of a bucket of 5 per 500 ms (one per 100 ms), the i-th at `at(i)` ms.
fn tight_run(n: u64, at: impl Fn(u64) -> u64, answered: impl Fn(u64) -> Answered) -> Vec<Event> {
    (0..n)
        .map(|i| Event {
            charges: vec![hooks("t", 5, 100)],
            ..hit(
                "a",
                &format!("k{i}"),
                &format!("h{i}"),
                at(i),
                CallResult::Hit(HitOutcome::Ok, answered(i)),
            )
        })
        .collect()
}

#[test]
fn rate_limit_bound_holds_for_a_burst_then_the_rate() {
    // A burst of 5 at once, then one every 100 ms: exactly what GCRA admits.
    let events = tight_run(
        25,
        |i| if i < 5 { 0 } else { (i - 4) * 100 },
        |_| Answered::Fleet,
    );
    let report = check(&events, &[], &config());
    assert!(report.is_clean(), "{}", report.render());
    assert!(report.rate_windows_checked > 0);
}

#[test]
fn too_many_accepts_break_the_rate_limit() {
    // Seven at once against a burst of five (each call takes 1 ms, so the span
    // allows at most 5 + 1 ms / 100 ms).
    let events = tight_run(7, |_| 0, |_| Answered::Fleet);
    let report = check(&events, &[], &config());
    expect_violations(&report, Rule::RateLimit, 1);

    // Twice the rate for a while, after the burst.
    let events = tight_run(30, |i| i * 50, |_| Answered::Fleet);
    let report = check(&events, &[], &config());
    assert!(
        report.violations_of(Rule::RateLimit) >= 1,
        "{}",
        report.render()
    );
}

#[test]
fn a_fault_or_a_local_edge_allows_one_more_burst() {
    // Ten at once: a second burst, granted by the new owner after a failover…
    let mut events = tight_run(10, |_| 0, |_| Answered::Fleet);
    events.extend(both_shards(1_500));
    let faults = vec![FaultEvent {
        kind: FaultKind::KillNode,
        target: "node-a".into(),
        start: 0,
        end: Some(1_000 * MS),
    }];
    let report = check(&events, &faults, &config());
    assert!(report.is_clean(), "{}", report.render());
    // …or by an edge answering from its own bucket.
    let events = tight_run(
        10,
        |_| 0,
        |i| {
            if i < 5 {
                Answered::Fleet
            } else {
                Answered::Local
            }
        },
    );
    let report = check(&events, &[], &config());
    assert!(report.is_clean(), "{}", report.render());
    // But not three bursts with one fault.
    let mut events = tight_run(16, |_| 0, |_| Answered::Fleet);
    events.extend(both_shards(1_500));
    let report = check(&events, &faults, &config());
    expect_violations(&report, Rule::RateLimit, 1);
}

#[test]
fn every_shard_must_answer_again_after_the_last_fault() {
    let faults = vec![FaultEvent {
        kind: FaultKind::PauseNode,
        target: "node-b".into(),
        start: 0,
        end: Some(1_000 * MS),
    }];
    // Shard 0 answers after the fault, shard 1 only before it.
    let events = vec![
        hit("a", "k", "h1", 2_000, ok()),
        Event {
            shard: 1,
            ..hit("a", "k1", "h2", 500, ok())
        },
    ];
    let report = check(&events, &faults, &config());
    expect_violations(&report, Rule::Recovery, 1);

    // Shard 1 answers only after the bound.
    let mut late = events.clone();
    late.push(Event {
        shard: 1,
        ..hit("a", "k2", "h3", 12_000, ok())
    });
    let report = check(&late, &faults, &config());
    expect_violations(&report, Rule::Recovery, 1);

    // Within the bound: recovered, and the time is reported.
    let mut good = events.clone();
    good.push(Event {
        shard: 1,
        ..hit("a", "k2", "h3", 3_000, ok())
    });
    let report = check(&good, &faults, &config());
    assert!(report.is_clean(), "{}", report.render());
    assert_eq!(report.recovery_max, Some(2_001 * MS));

    // A fault that never ended fails recovery.
    let open = vec![FaultEvent {
        end: None,
        ..faults[0].clone()
    }];
    let report = check(&good, &open, &config());
    expect_violations(&report, Rule::Recovery, 1);
}

#[test]
fn a_degraded_edge_must_come_back_to_the_fleet() {
    let faults = vec![FaultEvent {
        kind: FaultKind::RestartNats,
        target: "nats".into(),
        start: 0,
        end: Some(1_000 * MS),
    }];
    let mut events = both_shards(1_500);
    events.push(hit(
        "edge",
        "e",
        "h3",
        500,
        CallResult::Hit(HitOutcome::Ok, Answered::Local),
    ));
    let report = check(&events, &faults, &config());
    expect_violations(&report, Rule::Recovery, 1);

    events.push(hit("edge", "e2", "h4", 1_600, ok()));
    let report = check(&events, &faults, &config());
    assert!(report.is_clean(), "{}", report.render());
}

#[test]
fn every_shard_must_answer_again_after_each_fault_not_only_the_last() {
    let faults = vec![
        FaultEvent {
            kind: FaultKind::KillNode,
            target: "node-a".into(),
            start: 0,
            end: Some(1_000 * MS),
        },
        FaultEvent {
            kind: FaultKind::AddNode,
            target: "node-d".into(),
            start: 20_000 * MS,
            end: Some(20_100 * MS),
        },
    ];
    // Both shards answer right after the last fault; shard 1 took 12 s after
    // the first one.
    let mut events = both_shards(20_200);
    events.push(hit("a", "k0", "h1", 1_100, ok()));
    events.push(Event {
        shard: 1,
        ..hit("a", "k1", "h2", 13_000, ok())
    });
    let report = check(&events, &faults, &config());
    expect_violations(&report, Rule::Recovery, 1);
    assert_eq!(report.recovery_by_fault[0], None);
    assert_eq!(report.recovery_by_fault[1], Some(101 * MS));

    // Within the bound after each: clean, and each fault's time is reported.
    events.push(Event {
        shard: 1,
        ..hit("a", "k2", "h3", 3_000, ok())
    });
    let report = check(&events, &faults, &config());
    assert!(report.is_clean(), "{}", report.render());
    assert_eq!(
        report.recovery_by_fault,
        vec![Some(2_001 * MS), Some(101 * MS)]
    );
}

/// A network cut from 0 to 6 s (lease TTL 2 s); every shard answers after it.
fn cut(kind: FaultKind) -> Vec<FaultEvent> {
    vec![FaultEvent {
        kind,
        target: "node-c".into(),
        start: 0,
        end: Some(6_000 * MS),
    }]
}

#[test]
fn a_cut_node_s_shards_must_be_taken_over_while_the_cut_lasts() {
    for kind in [FaultKind::NetCut, FaultKind::NetBlackhole] {
        // Shard 0 is answered 2.5 s into the cut; shard 1 only before the
        // lease could have lapsed (its old owner may have answered) and after
        // the cut ended: nobody took it over.
        let mut events = both_shards(6_100);
        events.push(hit("a", "k0", "h1", 2_500, ok()));
        events.push(Event {
            shard: 1,
            ..hit("a", "k1", "h2", 1_000, ok())
        });
        let report = check(&events, &cut(kind), &config());
        assert_eq!(
            report.violations_of(Rule::Takeover),
            1,
            "{kind:?}: {}",
            report.render()
        );
        assert_eq!(report.takeover_by_fault, vec![None]);

        // An answer that came back only after the cut ended does not count
        // either, even for a call made during it.
        let mut late = events.clone();
        late.push(Event {
            shard: 1,
            completed: 6_001 * MS,
            ..hit("a", "k2", "h3", 5_900, ok())
        });
        let report = check(&late, &cut(kind), &config());
        assert_eq!(
            report.violations_of(Rule::Takeover),
            1,
            "{kind:?}: {}",
            report.render()
        );

        // Shard 1 answered by another node 3.5 s into the cut: taken over.
        events.push(Event {
            shard: 1,
            ..hit("a", "k3", "h4", 3_500, ok())
        });
        let report = check(&events, &cut(kind), &config());
        assert!(report.is_clean(), "{kind:?}: {}", report.render());
        assert_eq!(report.takeover_by_fault, vec![Some(3_501 * MS)]);
    }

    // A pause does not require a takeover (the node may wake before anyone
    // takes its shards): the same history is clean.
    let mut events = both_shards(6_100);
    events.push(Event {
        shard: 1,
        ..hit("a", "k1", "h2", 1_000, ok())
    });
    let report = check(&events, &cut(FaultKind::PauseNode), &config());
    assert!(report.is_clean(), "{}", report.render());
}

#[test]
fn a_double_accept_inside_a_network_cut_is_attributed_to_it() {
    let mut events = committed_then_duplicate();
    events.push(hit("c", "k", "h3", 2_000, ok()));
    events.push(Event {
        shard: 1,
        ..hit("c", "other", "h4", 2_100, ok())
    });
    events.extend(both_shards(6_100));
    let report = check(&events, &cut(FaultKind::NetBlackhole), &config());
    assert!(report.is_clean(), "{}", report.render());
    assert_eq!(
        report.attributed[0].why,
        Attribution::Fault {
            index: 0,
            kind: FaultKind::NetBlackhole
        }
    );
}
