//! The shard and tenant actors driven through [`spawn_shard`]: routing, retirement
//! and parking of idle tenants, claim sweeps, deadlines, per-tenant shedding,
//! export/handoff to a fresh shard, inspection, and refusal of invalid requests.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ankusa_actors::actor::Job;
use ankusa_actors::{
    spawn_shard, Applied, Changes, Charge, Claim, ClaimView, EventKey, HitOutcome, HitRequest,
    InspectRequest, InvalidRequest, Kind, ManualClock, Refused, ResetRequest, SettleOutcome,
    SettleRequest, Settlement, ShardConfig, ShardHandle, ShardMsg, ShardStats, TenantRequest,
    TenantSnapshot, TenantView,
};
use ractor::rpc::CallResult;
use ractor::RpcReplyPort;
use tokio::sync::oneshot;

const T0: u64 = 1_700_000_000_000_000;
const MS: u64 = 1_000;

fn config(clock: &ManualClock, idle_after_ms: u64, sweep_every_ms: u64) -> ShardConfig {
    let mut config = ShardConfig::new(Arc::new(clock.clone()));
    config.idle_after = Duration::from_millis(idle_after_ms);
    config.sweep_every = Duration::from_millis(sweep_every_ms);
    config
}

fn charge(tenant: &str, increment_us: u64, capacity_us: u64) -> Charge {
    Charge {
        kind: Kind::Hooks,
        tenant: tenant.into(),
        increment_us,
        capacity_us,
    }
}

fn claim(tenant: &str, key: &str, hook_id: &str) -> Claim {
    Claim {
        tenant: tenant.into(),
        source_id: "stripe".into(),
        key: key.into(),
        hook_id: hook_id.into(),
        node: "node-a".into(),
        ttl_ms: 60_000,
        pending_ttl_ms: 5_000,
    }
}

fn claim_only(c: Claim) -> HitRequest {
    HitRequest {
        charges: vec![],
        claim: Some(c),
    }
}

fn charge_only(c: Charge) -> HitRequest {
    HitRequest {
        charges: vec![c],
        claim: None,
    }
}

/// The shard's answer to a tenant request: it answers every job.
async fn answer<R: TenantRequest>(
    shard: &ShardHandle,
    req: R,
    deadline: Option<Instant>,
) -> Result<Applied<R::Outcome>, Refused> {
    shard
        .ask(req, deadline)
        .await
        .expect("the shard answers every job")
}

async fn hit_by(
    shard: &ShardHandle,
    req: HitRequest,
    deadline: Option<Instant>,
) -> Result<Applied<HitOutcome>, Refused> {
    answer(shard, req, deadline).await
}

async fn hit(shard: &ShardHandle, req: HitRequest) -> HitOutcome {
    hit_by(shard, req, None).await.expect("hit refused").outcome
}

async fn settle_by(
    shard: &ShardHandle,
    claim: Claim,
    settlement: Settlement,
    deadline: Option<Instant>,
) -> Result<Applied<SettleOutcome>, Refused> {
    answer(shard, SettleRequest { claim, settlement }, deadline).await
}

async fn settle(shard: &ShardHandle, claim: Claim, settlement: Settlement) -> SettleOutcome {
    settle_by(shard, claim, settlement, None)
        .await
        .expect("settle refused")
        .outcome
}

/// The shard's answer to the message `message` makes around a reply port.
async fn ask<T: std::fmt::Debug + Send + 'static>(
    shard: &ShardHandle,
    message: impl FnOnce(RpcReplyPort<T>) -> ShardMsg,
) -> T {
    match shard.actor().call(message, None).await {
        Ok(CallResult::Success(reply)) => reply,
        other => panic!("shard did not answer: {other:?}"),
    }
}

async fn reset(shard: &ShardHandle, tenant: &str) -> Result<Changes, Refused> {
    let req = ResetRequest {
        tenant: tenant.to_string(),
    };
    let applied = answer(shard, req, None).await;
    applied.map(|applied| applied.changes)
}

async fn inspect(shard: &ShardHandle, tenant: &str, key: &str) -> Result<TenantView, Refused> {
    let req = InspectRequest {
        tenant: tenant.to_string(),
        claim: Some(EventKey {
            source_id: "stripe".into(),
            key: key.into(),
        }),
    };
    let applied = answer(shard, req, None).await;
    applied.map(|applied| applied.outcome)
}

async fn stats(shard: &ShardHandle) -> ShardStats {
    ask(shard, ShardMsg::Stats).await
}

async fn export(shard: &ShardHandle) -> Vec<TenantSnapshot> {
    let mut snaps = ask(shard, ShardMsg::Export).await;
    snaps.sort_by(|a, b| a.tenant.cmp(&b.tenant));
    for snap in &mut snaps {
        snap.claims.sort_by(|a, b| a.key().cmp(b.key()));
    }
    snaps
}

fn tick(shard: &ShardHandle) {
    shard.actor().cast(ShardMsg::Tick).expect("shard running");
}

#[tokio::test]
async fn hit_settle_reset_round_trip() {
    let clock = ManualClock::new(T0);
    let shard = spawn_shard(config(&clock, 60_000, 60_000), vec![], None)
        .await
        .unwrap();
    let c = claim("acme", "evt-1", "hook-1");
    let req = HitRequest {
        charges: vec![charge("acme", 1_000 * MS, 1_000 * MS)],
        claim: Some(c.clone()),
    };
    let applied = hit_by(&shard, req, None).await.unwrap();
    assert_eq!(applied.outcome, HitOutcome::Ok);
    assert_eq!(applied.changes.buckets.len(), 1);
    assert!(applied.changes.claim.is_some());

    let other = claim("acme", "evt-1", "hook-2");
    assert_eq!(
        hit(&shard, claim_only(other.clone())).await,
        HitOutcome::Pending {
            retry_after_ms: 5_000
        }
    );
    assert_eq!(
        settle(&shard, other.clone(), Settlement::Commit).await,
        SettleOutcome::NotOwner {
            hook_id: "hook-1".into()
        }
    );
    assert_eq!(
        settle(&shard, c.clone(), Settlement::Commit).await,
        SettleOutcome::Ok
    );
    assert_eq!(
        hit(&shard, claim_only(other)).await,
        HitOutcome::Duplicate {
            hook_id: "hook-1".into()
        }
    );
    assert_eq!(
        settle(&shard, c, Settlement::Release).await,
        SettleOutcome::AlreadyCommitted
    );

    let limited = charge_only(charge("acme", 1_000 * MS, 1_000 * MS));
    assert_eq!(
        hit(&shard, limited.clone()).await,
        HitOutcome::RateLimited {
            retry_after_ms: 1_000
        }
    );
    let changes = reset(&shard, "acme").await.unwrap();
    assert_eq!(changes.buckets.len(), 2);
    assert!(changes.buckets.iter().all(|b| b.tat_us == 0));
    assert_eq!(hit(&shard, limited).await, HitOutcome::Ok);
    // Reset of a tenant the shard has never seen is a harmless Ok.
    assert!(reset(&shard, "nobody").await.is_ok());
    assert_eq!(stats(&shard).await.active_tenants, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_tenants_are_routed_to_their_own_state() {
    let clock = ManualClock::new(T0);
    let shard = spawn_shard(config(&clock, 60_000, 60_000), vec![], None)
        .await
        .unwrap();
    let tenants: Vec<String> = (0..200).map(|i| format!("tenant-{i}")).collect();
    let mut tasks = Vec::new();
    for tenant in &tenants {
        let shard = shard.clone();
        let tenant = tenant.clone();
        tasks.push(tokio::spawn(async move {
            // Same key in every tenant: claims are per tenant, so no collision.
            let req = HitRequest {
                charges: vec![charge(&tenant, 1_000 * MS, 1_000 * MS)],
                claim: Some(claim(&tenant, "evt", &format!("hook-{tenant}"))),
            };
            let first = hit(&shard, req).await;
            let second = hit(&shard, charge_only(charge(&tenant, 1_000 * MS, 1_000 * MS))).await;
            (first, second)
        }));
    }
    for task in tasks {
        let (first, second) = task.await.unwrap();
        assert_eq!(first, HitOutcome::Ok);
        assert_eq!(
            second,
            HitOutcome::RateLimited {
                retry_after_ms: 1_000
            }
        );
    }
    let s = stats(&shard).await;
    assert_eq!(s.active_tenants, 200);
    assert_eq!(s.claims, 200);
    assert_eq!(s.shed, 0);
    let snaps = export(&shard).await;
    assert_eq!(snaps.len(), 200);
    for snap in snaps {
        assert_eq!(snap.claims.len(), 1);
        assert_eq!(snap.claims[0].hook_id(), format!("hook-{}", snap.tenant));
    }
}

#[tokio::test]
async fn idle_tenants_retire_park_their_state_and_come_back() {
    let clock = ManualClock::new(T0);
    let shard = spawn_shard(config(&clock, 10, 3_600_000), vec![], None)
        .await
        .unwrap();
    let committed = claim("keeper", "evt-1", "hook-1");
    assert_eq!(
        hit(&shard, claim_only(committed.clone())).await,
        HitOutcome::Ok
    );
    assert_eq!(
        settle(&shard, committed, Settlement::Commit).await,
        SettleOutcome::Ok
    );
    assert_eq!(
        hit(&shard, charge_only(charge("burst", 1_000 * MS, 1_000 * MS))).await,
        HitOutcome::Ok
    );
    assert_eq!(
        hit(&shard, charge_only(charge("quiet", MS, MS))).await,
        HitOutcome::Ok
    );

    clock.advance_us(5 * MS);
    tick(&shard);
    let s = stats(&shard).await;
    assert_eq!(
        (s.active_tenants, s.parked_tenants),
        (3, 0),
        "retired too early"
    );

    clock.advance_us(10 * MS);
    tick(&shard);
    let s = stats(&shard).await;
    // "quiet" has nothing left (bucket full again): dropped, not parked.
    assert_eq!((s.active_tenants, s.parked_tenants), (0, 2));
    assert_eq!(s.claims, 1);
    let names: Vec<String> = export(&shard).await.into_iter().map(|s| s.tenant).collect();
    assert_eq!(names, vec!["burst".to_string(), "keeper".to_string()]);

    // Parked state is used again: the commit still answers Duplicate...
    assert_eq!(
        hit(&shard, claim_only(claim("keeper", "evt-1", "hook-2"))).await,
        HitOutcome::Duplicate {
            hook_id: "hook-1".into()
        }
    );
    // ...and the bucket is still drained, 15 ms into its 1 s.
    assert_eq!(
        hit(&shard, charge_only(charge("burst", 1_000 * MS, 1_000 * MS))).await,
        HitOutcome::RateLimited {
            retry_after_ms: 985
        }
    );
    let s = stats(&shard).await;
    assert_eq!((s.active_tenants, s.parked_tenants), (2, 0));
    // A dropped tenant starts afresh.
    assert_eq!(
        hit(&shard, charge_only(charge("quiet", MS, MS))).await,
        HitOutcome::Ok
    );
}

#[tokio::test]
async fn reset_reaches_a_parked_tenant() {
    let clock = ManualClock::new(T0);
    let shard = spawn_shard(config(&clock, 1, 3_600_000), vec![], None)
        .await
        .unwrap();
    let limited = charge_only(charge("acme", 1_000 * MS, 1_000 * MS));
    assert_eq!(hit(&shard, limited.clone()).await, HitOutcome::Ok);
    clock.advance_us(2 * MS);
    tick(&shard);
    assert_eq!(stats(&shard).await.parked_tenants, 1);
    reset(&shard, "acme").await.unwrap();
    assert_eq!(hit(&shard, limited).await, HitOutcome::Ok);
}

#[tokio::test]
async fn inspect_reads_running_parked_and_unknown_tenants_without_starting_one() {
    let clock = ManualClock::new(T0);
    let shard = spawn_shard(config(&clock, 1, 3_600_000), vec![], None)
        .await
        .unwrap();
    let unknown = inspect(&shard, "nobody", "evt-1").await.unwrap();
    assert_eq!(unknown, TenantView::default());
    assert_eq!(
        stats(&shard).await.active_tenants,
        0,
        "inspect started a tenant"
    );

    let held = claim("acme", "evt-1", "hook-1");
    assert_eq!(hit(&shard, claim_only(held.clone())).await, HitOutcome::Ok);
    let running = inspect(&shard, "acme", "evt-1").await.unwrap();
    assert_eq!(stats(&shard).await.active_tenants, 1);
    assert!(
        matches!(&running.claim, Some(ClaimView::Pending { hook_id, .. }) if hook_id == "hook-1"),
        "{running:?}"
    );

    clock.advance_us(2 * MS);
    tick(&shard);
    assert_eq!(stats(&shard).await.parked_tenants, 1);
    let parked = inspect(&shard, "acme", "evt-1").await.unwrap();
    assert_eq!(parked.claims_held, 1);
    assert!(matches!(parked.claim, Some(ClaimView::Pending { .. })));
    let s = stats(&shard).await;
    assert_eq!((s.active_tenants, s.parked_tenants), (0, 1));

    assert_eq!(
        inspect(&shard, "", "evt-1").await,
        Err(Refused::Invalid(InvalidRequest::Empty {
            field: "tenant".into()
        }))
    );
}

#[tokio::test]
async fn expired_claims_are_swept_on_tick() {
    let clock = ManualClock::new(T0);
    let shard = spawn_shard(config(&clock, 3_600_000, 10), vec![], None)
        .await
        .unwrap();
    let mut short = claim("acme", "evt-1", "hook-1");
    short.pending_ttl_ms = 5;
    let long = claim("acme", "evt-2", "hook-2");
    assert_eq!(hit(&shard, claim_only(short)).await, HitOutcome::Ok);
    assert_eq!(hit(&shard, claim_only(long)).await, HitOutcome::Ok);
    assert_eq!(stats(&shard).await.claims, 2);

    // Expired, but the sweep is not due yet: held until then (though not live).
    clock.advance_us(6 * MS);
    tick(&shard);
    assert_eq!(stats(&shard).await.claims, 2);
    assert_eq!(export(&shard).await[0].claims.len(), 1);

    clock.advance_us(5 * MS);
    tick(&shard);
    // Gauges are as of each tenant's last message: a round trip through the
    // tenant's mailbox lets it process the sweep first.
    assert_eq!(export(&shard).await[0].claims.len(), 1);
    assert_eq!(stats(&shard).await.claims, 1);
    assert_eq!(
        hit(&shard, claim_only(claim("acme", "evt-1", "hook-3"))).await,
        HitOutcome::Ok
    );
}

#[tokio::test]
async fn parked_tenants_whose_claims_expire_are_dropped_by_the_sweep() {
    let clock = ManualClock::new(T0);
    let shard = spawn_shard(config(&clock, 1, 10), vec![], None)
        .await
        .unwrap();
    let mut c = claim("acme", "evt-1", "hook-1");
    c.pending_ttl_ms = 50;
    assert_eq!(hit(&shard, claim_only(c)).await, HitOutcome::Ok);
    clock.advance_us(2 * MS);
    tick(&shard);
    let s = stats(&shard).await;
    assert_eq!((s.active_tenants, s.parked_tenants, s.claims), (0, 1, 1));

    clock.advance_us(60 * MS);
    tick(&shard);
    let s = stats(&shard).await;
    assert_eq!((s.active_tenants, s.parked_tenants, s.claims), (0, 0, 0));
    assert!(export(&shard).await.is_empty());
}

#[tokio::test]
async fn shards_started_together_sweep_at_different_times() {
    // Each shard parks one tenant whose claim expires 5 ms in; with a sweep
    // every 10 ms, the step at which a shard drops it is when it next sweeps.
    let clock = ManualClock::new(T0);
    let mut shards = Vec::new();
    for _ in 0..16 {
        let shard = spawn_shard(config(&clock, 1, 10), vec![], None)
            .await
            .unwrap();
        let mut c = claim("acme", "evt-1", "hook-1");
        c.pending_ttl_ms = 5;
        assert_eq!(hit(&shard, claim_only(c)).await, HitOutcome::Ok);
        shards.push(shard);
    }
    let mut dropped_at = vec![None; shards.len()];
    for step in 1..=25 {
        clock.advance_us(MS);
        for (shard, dropped) in shards.iter().zip(dropped_at.iter_mut()) {
            tick(shard);
            if dropped.is_none() && stats(shard).await.claims == 0 {
                *dropped = Some(step);
            }
        }
    }
    assert!(
        dropped_at
            .iter()
            .all(|d| d.is_some_and(|step| (5..=20).contains(&step))),
        "every shard sweeps within a period of the claim's expiry: {dropped_at:?}"
    );
    let steps: std::collections::BTreeSet<_> = dropped_at.iter().collect();
    assert!(
        steps.len() > 1,
        "all 16 shards swept at the same step: {dropped_at:?}"
    );
}

#[tokio::test]
async fn jobs_past_their_deadline_are_refused_untouched() {
    let clock = ManualClock::new(T0);
    let shard = spawn_shard(config(&clock, 60_000, 60_000), vec![], None)
        .await
        .unwrap();
    let c = claim("acme", "evt-1", "hook-1");
    let passed = Some(Instant::now());
    let req = HitRequest {
        charges: vec![charge("acme", 1_000 * MS, 1_000 * MS)],
        claim: Some(c.clone()),
    };
    assert_eq!(
        hit_by(&shard, req.clone(), passed).await,
        Err(Refused::DeadlineExpired)
    );
    assert_eq!(
        settle_by(&shard, c.clone(), Settlement::Commit, passed).await,
        Err(Refused::DeadlineExpired)
    );
    // Nothing was charged or claimed: the same hit still passes in full.
    let future = Some(Instant::now() + Duration::from_secs(60));
    assert_eq!(
        hit_by(&shard, req, future).await.unwrap().outcome,
        HitOutcome::Ok
    );
    assert_eq!(
        settle_by(&shard, c, Settlement::Commit, future)
            .await
            .unwrap()
            .outcome,
        SettleOutcome::Ok
    );
}

/// Current-thread runtime: every job below is cast before the test first awaits,
/// so the shard routes the whole burst before any tenant actor runs, and the
/// tenant's queue fills deterministically.
#[tokio::test(flavor = "current_thread")]
async fn a_flooding_tenant_is_shed_while_its_neighbour_is_served() {
    let clock = ManualClock::new(T0);
    let mut cfg = config(&clock, 60_000, 60_000);
    cfg.tenant_queue = 2;
    let shard = spawn_shard(cfg, vec![], None).await.unwrap();
    let flood = || charge_only(charge("flood", MS, 1_000_000 * MS));
    // Both tenants' actors running before the burst.
    assert_eq!(hit(&shard, flood()).await, HitOutcome::Ok);
    assert_eq!(
        hit(&shard, charge_only(charge("calm", MS, 1_000 * MS))).await,
        HitOutcome::Ok
    );

    let send = |req: HitRequest| {
        let (tx, rx) = oneshot::channel();
        shard.send(Job {
            req,
            deadline: None,
            reply: tx.into(),
        });
        rx
    };
    let flooded: Vec<_> = (0..8).map(|_| send(flood())).collect();
    let calm = send(charge_only(charge("calm", MS, 1_000 * MS)));

    let (mut ok, mut shed) = (0, 0);
    for rx in flooded {
        match rx.await.expect("every job is answered") {
            Ok(applied) => {
                assert_eq!(applied.outcome, HitOutcome::Ok);
                ok += 1;
            }
            Err(Refused::Overloaded { queued }) => {
                assert!(queued >= 2);
                shed += 1;
            }
            Err(other) => panic!("unexpected refusal {other:?}"),
        }
    }
    assert_eq!((ok, shed), (2, 6));
    assert_eq!(calm.await.unwrap().unwrap().outcome, HitOutcome::Ok);
    assert_eq!(stats(&shard).await.shed, 6);
    // Once drained, the flooding tenant is served again.
    assert_eq!(hit(&shard, flood()).await, HitOutcome::Ok);
}

/// Requests whose answer must not change across a handoff; none of them writes.
fn probes() -> Vec<HitRequest> {
    vec![
        claim_only(claim("acme", "evt-1", "probe")),
        claim_only(claim("acme", "evt-2", "probe")),
        charge_only(charge("acme", 1_000 * MS, 1_000 * MS)),
        claim_only(claim("parked", "evt-9", "probe")),
    ]
}

#[tokio::test]
async fn export_hands_off_to_a_fresh_shard_that_answers_the_same() {
    let clock = ManualClock::new(T0);
    let parked_commit = TenantSnapshot {
        tenant: "parked".into(),
        buckets: vec![],
        claims: vec![ankusa_actors::ClaimRecord::new(
            "stripe",
            "evt-9",
            "hook-9",
            None,
            true,
            T0 + 60_000 * MS,
        )],
    };
    let old = spawn_shard(config(&clock, 60_000, 60_000), vec![parked_commit], None)
        .await
        .unwrap();
    let committed = claim("acme", "evt-1", "hook-1");
    let pending = claim("acme", "evt-2", "hook-2");
    let req = HitRequest {
        charges: vec![charge("acme", 1_000 * MS, 1_000 * MS)],
        claim: Some(committed.clone()),
    };
    assert_eq!(hit(&old, req).await, HitOutcome::Ok);
    assert_eq!(
        settle(&old, committed, Settlement::Commit).await,
        SettleOutcome::Ok
    );
    assert_eq!(hit(&old, claim_only(pending.clone())).await, HitOutcome::Ok);
    // A tenant whose only state is already past is not exported.
    assert_eq!(
        hit(&old, charge_only(charge("gone", MS, MS))).await,
        HitOutcome::Ok
    );
    clock.advance_us(100 * MS);

    let snaps = export(&old).await;
    let names: Vec<&str> = snaps.iter().map(|s| s.tenant.as_str()).collect();
    assert_eq!(names, vec!["acme", "parked"]);
    assert_eq!(snaps[0].claims.len(), 2);
    assert_eq!(snaps[0].buckets.len(), 1);

    let new = spawn_shard(config(&clock, 60_000, 60_000), snaps.clone(), None)
        .await
        .unwrap();
    assert_eq!(export(&new).await, snaps);
    let mut answers = Vec::new();
    for probe in probes() {
        let before = hit(&old, probe.clone()).await;
        let after = hit(&new, probe).await;
        assert_eq!(before, after);
        answers.push(after);
    }
    assert_eq!(
        answers,
        vec![
            HitOutcome::Duplicate {
                hook_id: "hook-1".into()
            },
            HitOutcome::Pending {
                retry_after_ms: 4_900
            },
            HitOutcome::RateLimited {
                retry_after_ms: 900
            },
            HitOutcome::Duplicate {
                hook_id: "hook-9".into()
            },
        ]
    );
    // The in-flight hook can finish on its new shard.
    assert_eq!(
        settle(&new, pending, Settlement::Commit).await,
        SettleOutcome::Ok
    );
}

#[tokio::test]
async fn invalid_requests_are_refused_before_touching_state() {
    let clock = ManualClock::new(T0);
    let shard = spawn_shard(config(&clock, 60_000, 60_000), vec![], None)
        .await
        .unwrap();
    let nothing = HitRequest {
        charges: vec![],
        claim: None,
    };
    assert_eq!(
        hit_by(&shard, nothing, None).await,
        Err(Refused::Invalid(InvalidRequest::NothingToDo))
    );
    assert_eq!(
        hit_by(&shard, charge_only(charge("acme", 2, 1)), None).await,
        Err(Refused::Invalid(InvalidRequest::IncrementExceedsCapacity {
            increment_us: 2,
            capacity_us: 1
        }))
    );
    let mut no_key = claim("acme", "", "hook-1");
    assert_eq!(
        settle_by(&shard, no_key.clone(), Settlement::Commit, None).await,
        Err(Refused::Invalid(InvalidRequest::Empty {
            field: "key".into()
        }))
    );
    no_key.key = "k".into();
    no_key.ttl_ms = 0;
    assert_eq!(
        settle_by(&shard, no_key, Settlement::Commit, None).await,
        Err(Refused::Invalid(InvalidRequest::Zero {
            field: "ttl_ms".into()
        }))
    );
    assert_eq!(
        reset(&shard, "").await,
        Err(Refused::Invalid(InvalidRequest::Empty {
            field: "tenant".into()
        }))
    );
    let long = "x".repeat(257);
    assert!(matches!(
        reset(&shard, &long).await,
        Err(Refused::Invalid(InvalidRequest::TooLong { len: 257, .. }))
    ));
    // An invalid request wakes no tenant.
    assert_eq!(stats(&shard).await, ShardStats::default());
}

/// Tenants that go quiet together are parked with their claims and swept a
/// step a tick, not all in the tick that retires them: the shard's turn stays
/// short when a burst of traffic ends.
#[tokio::test]
async fn tenants_retired_together_are_swept_over_several_ticks() {
    let clock = ManualClock::new(T0);
    let shard = spawn_shard(config(&clock, 1, 10), vec![], None)
        .await
        .unwrap();
    const TENANTS: usize = 8;
    const KEYS: usize = 2_000;
    for t in 0..TENANTS {
        for k in 0..KEYS {
            let mut c = claim(&format!("tenant-{t}"), &format!("evt-{k}"), "hook-1");
            c.pending_ttl_ms = 1;
            assert_eq!(hit(&shard, claim_only(c)).await, HitOutcome::Ok);
        }
    }
    // Every claim has expired by the tick that retires the tenants.
    clock.advance_us(20 * MS);
    tick(&shard);
    let s = stats(&shard).await;
    assert_eq!(s.active_tenants, 0);
    assert!(
        s.parked_tenants > 0 && s.claims > 0,
        "one tick sweeps a step, not every table: {s:?}"
    );
    let mut ticks = 1;
    while stats(&shard).await.parked_tenants > 0 {
        assert!(ticks < 100, "the parked tenants are never dropped");
        tick(&shard);
        ticks += 1;
    }
    assert!(ticks > 2, "swept over {ticks} ticks");
    assert_eq!(stats(&shard).await.claims, 0);
    assert!(export(&shard).await.is_empty());
}

/// A sweep pass that takes longer than the sweep period is finished before
/// the next begins: restarting it every period from the same end swept the
/// same big tables again and again, and the tenants before them in the map
/// kept their expired claims for good.
#[tokio::test]
async fn a_sweep_pass_longer_than_the_period_reaches_every_parked_tenant() {
    let clock = ManualClock::new(T0);
    let shard = spawn_shard(config(&clock, 1, 10), vec![], None)
        .await
        .unwrap();
    // Big tables of live claims: one takes about a whole step to sweep.
    const BIG: usize = 16;
    const KEYS: usize = 2_000;
    for t in 0..BIG {
        for k in 0..KEYS {
            let mut c = claim(&format!("big-{t}"), &format!("evt-{k}"), "hook-1");
            c.pending_ttl_ms = 3_600_000;
            assert_eq!(hit(&shard, claim_only(c)).await, HitOutcome::Ok);
        }
    }
    // Small tenants whose one claim expires at once, wherever the map puts them.
    const SMALL: usize = 16;
    for t in 0..SMALL {
        let mut c = claim(&format!("small-{t}"), "evt", "hook-1");
        c.pending_ttl_ms = 1;
        assert_eq!(hit(&shard, claim_only(c)).await, HitOutcome::Ok);
    }
    // Every tick is a new sweep period.
    for _ in 0..200 {
        clock.advance_us(20 * MS);
        tick(&shard);
        if stats(&shard).await.parked_tenants == BIG {
            break;
        }
    }
    let s = stats(&shard).await;
    assert_eq!(
        (s.parked_tenants, s.claims),
        (BIG, BIG * KEYS),
        "the small tenants' expired claims were never swept: {s:?}"
    );
}
