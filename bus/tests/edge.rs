//! The edge's own logic — degrade, breaker, settle routing, counters — against a
//! scripted fake `Store`. The fake stands in for the fleet only; the real NATS
//! client is tested against real servers elsewhere.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ankusa_actors::{
    Charge, Claim, HitOutcome, HitRequest, InvalidRequest, Kind, ManualClock, SettleOutcome,
    SettleRequest, Settlement,
};
use ankusa_bus::breaker::{BreakerConfig, BreakerState, ManualMonotonic};
use ankusa_bus::edge::{Answer, Edge, EdgeConfig, LocalReason, Source};
use ankusa_bus::local::LocalConfig;
use ankusa_bus::{ErrorCode, ErrorReply, Store, StoreError};
use futures::FutureExt;

const T0: u64 = 1_700_000_000_000_000;
const BUDGET: Duration = Duration::from_millis(200);

/// What the fake fleet does with the next calls.
#[derive(Debug, Clone)]
enum Behave {
    Answer,
    Fail(StoreError),
    /// Never answers: only the edge's own guard ends the call.
    Hang,
}

#[derive(Debug)]
struct Fake {
    behave: Mutex<Behave>,
    hit_outcome: Mutex<HitOutcome>,
    settle_outcome: Mutex<SettleOutcome>,
    hits: AtomicUsize,
    settles: AtomicUsize,
    resets: AtomicUsize,
}

impl Fake {
    fn new() -> Self {
        Self {
            behave: Mutex::new(Behave::Answer),
            hit_outcome: Mutex::new(HitOutcome::Ok),
            settle_outcome: Mutex::new(SettleOutcome::Ok),
            hits: AtomicUsize::new(0),
            settles: AtomicUsize::new(0),
            resets: AtomicUsize::new(0),
        }
    }

    fn set(&self, behave: Behave) {
        *self.behave.lock().unwrap() = behave;
    }

    fn calls(&self) -> (usize, usize, usize) {
        (
            self.hits.load(Ordering::SeqCst),
            self.settles.load(Ordering::SeqCst),
            self.resets.load(Ordering::SeqCst),
        )
    }

    /// Counted when the call is made, not when its future is polled, so a call
    /// the edge only builds shows up too.
    fn respond<T: Send + 'static>(
        &self,
        counter: &AtomicUsize,
        answer: T,
    ) -> impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static {
        counter.fetch_add(1, Ordering::SeqCst);
        let behave = self.behave.lock().unwrap().clone();
        async move {
            match behave {
                Behave::Answer => Ok(answer),
                Behave::Fail(err) => Err(err),
                Behave::Hang => {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    Err(StoreError::Transport("woke up".into()))
                }
            }
        }
    }
}

impl Store for Fake {
    fn hit(
        &self,
        _req: HitRequest,
        _timeout: Duration,
    ) -> impl std::future::Future<Output = Result<HitOutcome, StoreError>> + Send {
        let outcome = self.hit_outcome.lock().unwrap().clone();
        self.respond(&self.hits, outcome)
    }

    fn settle(
        &self,
        _req: SettleRequest,
        _timeout: Duration,
    ) -> impl std::future::Future<Output = Result<SettleOutcome, StoreError>> + Send {
        let outcome = self.settle_outcome.lock().unwrap().clone();
        self.respond(&self.settles, outcome)
    }

    fn reset(
        &self,
        _tenant: String,
        _timeout: Duration,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        self.respond(&self.resets, ())
    }
}

struct Rig {
    edge: Edge<Fake>,
    clock: ManualClock,
    mono: ManualMonotonic,
}

fn rig(failure_threshold: u32) -> Rig {
    let clock = ManualClock::new(T0);
    let mono = ManualMonotonic::new();
    let config = EdgeConfig {
        breaker: BreakerConfig {
            failure_threshold,
            base_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
        },
        local: LocalConfig::default(),
        local_reserve: Duration::from_millis(1),
    };
    let edge = Edge::with_clocks(
        Fake::new(),
        config,
        Arc::new(clock.clone()),
        Arc::new(mono.clone()),
    );
    Rig { edge, clock, mono }
}

fn claim(key: &str, hook: &str) -> Claim {
    Claim {
        tenant: "acme".into(),
        source_id: "stripe".into(),
        key: key.into(),
        hook_id: hook.into(),
        node: "edge-1".into(),
        ttl_ms: 60_000,
        pending_ttl_ms: 5_000,
    }
}

/// Three hooks per burst, one per 100 ms after.
fn charge() -> Charge {
    Charge {
        kind: Kind::Hooks,
        tenant: "acme".into(),
        increment_us: 100_000,
        capacity_us: 300_000,
    }
}

fn hit(key: &str, hook: &str) -> HitRequest {
    HitRequest {
        charges: vec![charge()],
        claim: Some(claim(key, hook)),
    }
}

fn charge_only() -> HitRequest {
    HitRequest {
        charges: vec![charge()],
        claim: None,
    }
}

fn settle(key: &str, hook: &str, settlement: Settlement) -> SettleRequest {
    SettleRequest {
        claim: claim(key, hook),
        settlement,
    }
}

fn local(reason: LocalReason) -> Source {
    Source::Local { reason }
}

fn refused(code: ErrorCode) -> StoreError {
    StoreError::Refused(ErrorReply::new(code, "test"))
}

/// Fails enough fleet calls to open the breaker.
async fn open_breaker(r: &Rig, threshold: u32) {
    r.edge.store().set(Behave::Fail(StoreError::NoResponders));
    for _ in 0..threshold {
        r.edge.hit(charge_only(), BUDGET).await.unwrap();
    }
    r.clock.advance_us(1_000_000);
    assert_eq!(r.edge.breaker().state(), BreakerState::Open);
}

#[tokio::test]
async fn fleet_answers_are_passed_through() {
    let r = rig(5);
    *r.edge.store().hit_outcome.lock().unwrap() = HitOutcome::Duplicate {
        hook_id: "h0".into(),
    };
    let answer = r.edge.hit(hit("k", "h1"), BUDGET).await.unwrap();
    assert_eq!(
        answer,
        Answer {
            outcome: HitOutcome::Duplicate {
                hook_id: "h0".into()
            },
            source: Source::Fleet
        }
    );
    assert!(!answer.is_local());
    assert_eq!(
        r.edge.local().tenants(),
        0,
        "the fleet path writes nothing local"
    );
}

#[tokio::test]
async fn every_outage_kind_degrades_with_its_reason() {
    let cases = [
        (StoreError::Timeout(BUDGET), LocalReason::Timeout),
        (StoreError::NoResponders, LocalReason::NoResponders),
        (StoreError::Disconnected, LocalReason::Disconnected),
        (
            refused(ErrorCode::Unavailable),
            LocalReason::NodeError(ErrorCode::Unavailable),
        ),
        (
            refused(ErrorCode::Overloaded),
            LocalReason::NodeError(ErrorCode::Overloaded),
        ),
        (
            refused(ErrorCode::DeadlineExpired),
            LocalReason::NodeError(ErrorCode::DeadlineExpired),
        ),
        (StoreError::BadReply("junk".into()), LocalReason::BadReply),
        (StoreError::Transport("io".into()), LocalReason::Transport),
    ];
    for (i, (err, reason)) in cases.into_iter().enumerate() {
        let r = rig(100);
        r.edge.store().set(Behave::Fail(err.clone()));
        let answer = r
            .edge
            .hit(hit(&format!("k{i}"), "h1"), BUDGET)
            .await
            .unwrap_or_else(|e| panic!("{err:?} must degrade, got {e:?}"));
        assert_eq!(answer.outcome, HitOutcome::Ok, "{err:?}");
        assert_eq!(answer.source, local(reason), "{err:?}");
        assert_eq!(r.edge.store().calls().0, 1);
        assert_eq!(r.edge.stats().local_answers, 1);
    }
}

/// A node shedding one hot tenant (`overloaded`) is answered locally for
/// that tenant, but it answered: however many such answers come in a row, the
/// breaker stays closed for the edge's other tenants.
#[tokio::test]
async fn a_shed_tenant_is_local_without_tripping_the_breaker() {
    let r = rig(2);
    r.edge
        .store()
        .set(Behave::Fail(refused(ErrorCode::Overloaded)));
    for n in 0..5 {
        let answer = r
            .edge
            .hit(hit(&format!("k{n}"), "h1"), BUDGET)
            .await
            .unwrap();
        assert_eq!(
            answer.source,
            local(LocalReason::NodeError(ErrorCode::Overloaded))
        );
    }
    assert_eq!(r.edge.store().calls().0, 5, "every call tried the fleet");
    assert_eq!(r.edge.breaker().state(), BreakerState::Closed);
}

/// A call given no time is answered locally at once, and says nothing about
/// the fleet: as many as open the breaker leave it closed.
#[tokio::test]
async fn a_call_with_no_budget_is_local_and_does_not_trip_the_breaker() {
    let r = rig(2);
    for n in 0..5 {
        let answer = r
            .edge
            .hit(hit(&format!("k{n}"), "h1"), Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(answer.source, local(LocalReason::Timeout));
    }
    assert_eq!(r.edge.store().calls().0, 0, "the fleet was tried");
    assert_eq!(r.edge.breaker().state(), BreakerState::Closed);
}

#[tokio::test]
async fn a_store_that_overruns_its_budget_is_cut_within_the_timeout() {
    let r = rig(100);
    r.edge.store().set(Behave::Hang);
    let timeout = Duration::from_millis(50);
    let started = Instant::now();
    // Raced against a plain timer of the whole timeout, started once the
    // call has set its guard (on its first poll) and polled after it: the
    // call must be over when that timer fires, however late a loaded host
    // fires both (a wall-clock bound would fail for the host's sake).
    let call = r.edge.hit(hit("k", "h1"), timeout);
    tokio::pin!(call);
    assert!(futures::poll!(&mut call).is_pending(), "answered at once");
    let reference = tokio::time::sleep(timeout);
    let answer = tokio::select! {
        biased;
        answer = &mut call => answer.unwrap(),
        () = reference => panic!("the call outlived a plain timer of its whole timeout"),
    };
    let took = started.elapsed();
    assert_eq!(answer.source, local(LocalReason::Timeout));
    assert_eq!(answer.outcome, HitOutcome::Ok);
    // The fleet gets 49 ms: a late timer only makes it longer.
    assert!(took >= Duration::from_millis(45), "{took:?}");
}

#[tokio::test]
async fn invalid_requests_are_refused_never_degraded() {
    let r = rig(1);
    r.edge.store().set(Behave::Fail(StoreError::NoResponders));
    let mut zero = charge_only();
    zero.charges[0].capacity_us = 0;
    assert!(matches!(
        r.edge.hit(zero, BUDGET).await,
        Err(StoreError::Invalid(InvalidRequest::Zero { .. }))
    ));
    // Nothing to charge or claim is no error: the contract's `:ok`, the fleet's
    // answer without a round trip, the fleet out or not.
    let nothing = HitRequest {
        charges: vec![],
        claim: None,
    };
    let answer = r.edge.hit(nothing, BUDGET).await.expect("answered");
    assert_eq!(
        (answer.outcome, answer.source),
        (HitOutcome::Ok, Source::Fleet)
    );
    assert_eq!(r.edge.store().calls().0, 0, "an empty hit was sent");
    let mut bad = settle("k", "h1", Settlement::Commit);
    bad.claim.hook_id.clear();
    assert!(matches!(
        r.edge.settle(bad, BUDGET).await,
        Err(StoreError::Invalid(InvalidRequest::Empty { .. }))
    ));
    assert!(matches!(
        r.edge.reset("", BUDGET).await,
        Err(StoreError::Invalid(_))
    ));
    assert_eq!(r.edge.store().calls(), (0, 0, 0), "never sent");
    assert_eq!(r.edge.breaker().state(), BreakerState::Closed);

    // A node refusing the request itself is returned, not degraded, and shows
    // the fleet is up.
    for code in [
        ErrorCode::Invalid,
        ErrorCode::Malformed,
        ErrorCode::TooLarge,
    ] {
        r.edge.store().set(Behave::Fail(refused(code)));
        assert_eq!(r.edge.hit(hit("k", "h1"), BUDGET).await, Err(refused(code)));
    }
    assert_eq!(r.edge.breaker().state(), BreakerState::Closed);
    let stats = r.edge.stats();
    assert_eq!(
        (stats.invalid, stats.errors, stats.local_answers),
        (3, 3, 0)
    );
    assert_eq!(r.edge.local().tenants(), 0);
}

#[tokio::test]
async fn open_breaker_skips_the_fleet_without_waiting() {
    let r = rig(3);
    open_breaker(&r, 3).await;
    assert_eq!(r.edge.store().calls().0, 3);
    // Any call that reached the fleet now would take the whole budget.
    r.edge.store().set(Behave::Hang);
    // Without waiting: answered on the call's first poll, so nothing was
    // awaited (a timer or the fleet), whatever the host's speed.
    for _ in 0..100 {
        let answer = r
            .edge
            .hit(charge_only(), BUDGET)
            .now_or_never()
            .expect("answered without waiting")
            .unwrap();
        assert_eq!(answer.source, local(LocalReason::BreakerOpen));
        r.clock.advance_us(100_000);
    }
    assert_eq!(
        r.edge
            .reset("acme", BUDGET)
            .now_or_never()
            .expect("answered without waiting")
            .unwrap()
            .source,
        local(LocalReason::BreakerOpen)
    );
    assert_eq!(r.edge.store().calls(), (3, 0, 0), "the fleet got no call");
    let stats = r.edge.stats();
    assert_eq!(stats.local_breaker_open, 101);
    assert_eq!(stats.local_no_responders, 3);
    assert_eq!(stats.breaker_opened, 1);
}

#[tokio::test]
async fn half_open_sends_exactly_one_probe() {
    let r = rig(3);
    open_breaker(&r, 3).await;
    r.mono.advance(Duration::from_secs(1));
    r.edge.store().set(Behave::Hang);
    let timeout = Duration::from_millis(30);
    // The probe is polled first and parks on the fleet; the second call meets the
    // half-open breaker and is answered locally at once.
    let (probe, other) = tokio::join!(
        r.edge.hit(charge_only(), timeout),
        r.edge.hit(charge_only(), timeout)
    );
    assert_eq!(probe.unwrap().source, local(LocalReason::Timeout));
    assert_eq!(other.unwrap().source, local(LocalReason::BreakerOpen));
    assert_eq!(r.edge.store().calls().0, 4, "one probe");
    assert_eq!(r.edge.breaker().state(), BreakerState::Open);
    let stats = r.edge.stats();
    assert_eq!((stats.breaker_opened, stats.breaker_half_open), (2, 1));
}

#[tokio::test]
async fn a_successful_probe_closes_the_breaker() {
    let r = rig(3);
    open_breaker(&r, 3).await;
    r.edge.store().set(Behave::Answer);
    r.mono.advance(Duration::from_millis(999));
    assert_eq!(
        r.edge.hit(charge_only(), BUDGET).await.unwrap().source,
        local(LocalReason::BreakerOpen)
    );
    r.mono.advance(Duration::from_millis(1));
    assert_eq!(
        r.edge.hit(charge_only(), BUDGET).await.unwrap().source,
        Source::Fleet
    );
    assert_eq!(r.edge.breaker().state(), BreakerState::Closed);
    assert_eq!(
        r.edge.hit(charge_only(), BUDGET).await.unwrap().source,
        Source::Fleet
    );
    let stats = r.edge.stats();
    assert_eq!(
        (
            stats.breaker_opened,
            stats.breaker_half_open,
            stats.breaker_closed
        ),
        (1, 1, 1)
    );
    assert_eq!(stats.breaker_state, BreakerState::Closed);
}

#[tokio::test]
async fn failed_probes_grow_the_backoff() {
    let r = rig(3);
    open_breaker(&r, 3).await;
    let mut probes = 3;
    for backoff_s in [1u64, 2, 4, 8] {
        r.mono
            .advance(Duration::from_secs(backoff_s) - Duration::from_millis(1));
        assert_eq!(
            r.edge.hit(charge_only(), BUDGET).await.unwrap().source,
            local(LocalReason::BreakerOpen),
            "still backing off {backoff_s} s"
        );
        r.mono.advance(Duration::from_millis(1));
        assert_eq!(
            r.edge.hit(charge_only(), BUDGET).await.unwrap().source,
            local(LocalReason::NoResponders),
            "probe after {backoff_s} s"
        );
        probes += 1;
        assert_eq!(r.edge.store().calls().0, probes);
        assert_eq!(
            r.edge.breaker().backoff(),
            Duration::from_secs(backoff_s * 2)
        );
        r.clock.advance_us(1_000_000);
    }
}

#[tokio::test]
async fn claims_made_locally_are_settled_locally_after_the_fleet_is_back() {
    let r = rig(100);
    r.edge.store().set(Behave::Fail(StoreError::Disconnected));
    let made = r.edge.hit(hit("k1", "h1"), BUDGET).await.unwrap();
    assert_eq!(made.source, local(LocalReason::Disconnected));
    assert_eq!(made.outcome, HitOutcome::Ok);

    // The fleet is back and would not know k1.
    r.edge.store().set(Behave::Answer);
    *r.edge.store().settle_outcome.lock().unwrap() = SettleOutcome::NotFound;
    let settled = r
        .edge
        .settle(settle("k1", "h1", Settlement::Commit), BUDGET)
        .await
        .unwrap();
    assert_eq!(settled.outcome, SettleOutcome::Ok);
    assert_eq!(settled.source, local(LocalReason::LocalClaim));
    assert_eq!(r.edge.store().calls().1, 0, "the fleet never saw the claim");

    // Retries of k1 meet the local commit, not a fleet that never heard of it.
    let retry = r.edge.hit(hit("k1", "h2"), BUDGET).await.unwrap();
    assert_eq!(
        retry,
        Answer {
            outcome: HitOutcome::Duplicate {
                hook_id: "h1".into()
            },
            source: local(LocalReason::LocalClaim)
        }
    );
    assert_eq!(r.edge.store().calls().0, 1);

    // A claim the fleet made is settled on the fleet.
    *r.edge.store().settle_outcome.lock().unwrap() = SettleOutcome::Ok;
    assert_eq!(
        r.edge.hit(hit("k2", "h3"), BUDGET).await.unwrap().source,
        Source::Fleet
    );
    let settled = r
        .edge
        .settle(settle("k2", "h3", Settlement::Commit), BUDGET)
        .await
        .unwrap();
    assert_eq!(settled.source, Source::Fleet);
    assert_eq!(r.edge.store().calls().1, 1);

    // Another hook's settle of a locally held key is not this hook's claim: fleet.
    r.edge
        .settle(settle("k1", "h9", Settlement::Release), BUDGET)
        .await
        .unwrap();
    assert_eq!(r.edge.store().calls().1, 2);
}

/// A settle of a fleet claim goes to the fleet only, whatever the breaker
/// says: never committed locally, and not failed unsent while the breaker backs off.
#[tokio::test]
async fn a_failed_fleet_settle_never_becomes_a_local_commit() {
    let r = rig(2);
    assert_eq!(
        r.edge.hit(hit("k", "h1"), BUDGET).await.unwrap().source,
        Source::Fleet
    );
    r.edge.store().set(Behave::Fail(StoreError::NoResponders));
    assert_eq!(
        r.edge
            .settle(settle("k", "h1", Settlement::Commit), BUDGET)
            .await,
        Err(StoreError::NoResponders)
    );
    // Nothing was committed locally: a retry during the outage is let through
    // (delivered twice at worst), never answered Duplicate.
    let retry = r.edge.hit(hit("k", "h2"), BUDGET).await.unwrap();
    assert_eq!(retry.outcome, HitOutcome::Ok);
    assert_eq!(retry.source, local(LocalReason::NoResponders));
    assert_eq!(r.edge.breaker().state(), BreakerState::Open);

    // With the breaker open, a fleet settle is still tried: a failure is
    // the caller's error again, and tells the breaker nothing.
    let err = r
        .edge
        .settle(settle("k0", "h0", Settlement::Commit), BUDGET)
        .await
        .unwrap_err();
    assert!(err.is_outage(), "{err:?}");
    assert_eq!(r.edge.store().calls().1, 2);
    assert_eq!(r.edge.stats().errors, 2);
    assert_eq!(r.edge.breaker().state(), BreakerState::Open);
    // The fleet is back while the breaker still backs off: hits stay local,
    // and a commit is made all the same.
    r.edge.store().set(Behave::Answer);
    assert_eq!(
        r.edge.hit(hit("k1", "h1"), BUDGET).await.unwrap().source,
        local(LocalReason::BreakerOpen)
    );
    let committed = r
        .edge
        .settle(settle("k0", "h0", Settlement::Commit), BUDGET)
        .await
        .expect("the fleet took the commit");
    assert_eq!(committed.source, Source::Fleet);
    assert_eq!(r.edge.breaker().state(), BreakerState::Open);
}

#[tokio::test]
async fn local_answers_obey_gcra() {
    let r = rig(100);
    r.edge.store().set(Behave::Fail(StoreError::Disconnected));
    for _ in 0..3 {
        assert_eq!(
            r.edge.hit(charge_only(), BUDGET).await.unwrap().outcome,
            HitOutcome::Ok
        );
    }
    assert_eq!(
        r.edge.hit(charge_only(), BUDGET).await.unwrap().outcome,
        HitOutcome::RateLimited {
            retry_after_ms: 100
        }
    );
    // A denied hit writes nothing: the claim is not taken.
    assert_eq!(
        r.edge.hit(hit("k", "h1"), BUDGET).await.unwrap().outcome,
        HitOutcome::RateLimited {
            retry_after_ms: 100
        }
    );
    assert!(!r.edge.local().has_live_claim("acme", "stripe", "k"));
    r.clock.advance_us(100_000);
    assert_eq!(
        r.edge.hit(charge_only(), BUDGET).await.unwrap().outcome,
        HitOutcome::Ok
    );
}

#[tokio::test]
async fn local_dedupe_answers_duplicate_only_after_a_local_commit() {
    let r = rig(100);
    r.edge
        .store()
        .set(Behave::Fail(StoreError::Timeout(BUDGET)));
    let claim_only = |key: &str, hook: &str| HitRequest {
        charges: vec![],
        claim: Some(claim(key, hook)),
    };
    assert_eq!(
        r.edge
            .hit(claim_only("k", "h1"), BUDGET)
            .await
            .unwrap()
            .outcome,
        HitOutcome::Ok
    );
    assert_eq!(
        r.edge
            .hit(claim_only("k", "h2"), BUDGET)
            .await
            .unwrap()
            .outcome,
        HitOutcome::Pending {
            retry_after_ms: 5_000
        }
    );
    let released = r
        .edge
        .settle(settle("k", "h1", Settlement::Release), BUDGET)
        .await
        .unwrap();
    assert_eq!(released.outcome, SettleOutcome::Ok);
    assert_eq!(
        r.edge
            .hit(claim_only("k", "h2"), BUDGET)
            .await
            .unwrap()
            .outcome,
        HitOutcome::Ok
    );
    r.edge
        .settle(settle("k", "h2", Settlement::Commit), BUDGET)
        .await
        .unwrap();
    assert_eq!(
        r.edge
            .hit(claim_only("k", "h3"), BUDGET)
            .await
            .unwrap()
            .outcome,
        HitOutcome::Duplicate {
            hook_id: "h2".into()
        }
    );
    // An unsettled pending claim expires and frees the key.
    assert_eq!(
        r.edge
            .hit(claim_only("p", "h4"), BUDGET)
            .await
            .unwrap()
            .outcome,
        HitOutcome::Ok
    );
    r.clock.advance_us(5_000_000);
    assert_eq!(
        r.edge
            .hit(claim_only("p", "h5"), BUDGET)
            .await
            .unwrap()
            .outcome,
        HitOutcome::Ok
    );
    assert_eq!(r.edge.store().calls().1, 0);
}

#[tokio::test]
async fn reset_clears_local_always_and_the_fleet_best_effort() {
    let r = rig(100);
    r.edge.store().set(Behave::Fail(StoreError::Disconnected));
    for _ in 0..3 {
        r.edge.hit(charge_only(), BUDGET).await.unwrap();
    }
    let reset = r.edge.reset("acme", BUDGET).await.unwrap();
    assert_eq!(reset.source, local(LocalReason::Disconnected));
    assert_eq!(
        r.edge.hit(charge_only(), BUDGET).await.unwrap().outcome,
        HitOutcome::Ok,
        "the local buckets were forgotten"
    );

    r.edge.store().set(Behave::Answer);
    r.edge.hit(charge_only(), BUDGET).await.unwrap();
    let reset = r.edge.reset("acme", BUDGET).await.unwrap();
    assert_eq!(reset.source, Source::Fleet);
    assert_eq!(r.edge.store().calls().2, 2);
    assert_eq!(r.edge.local().tenants(), 0, "local reset too");
}

#[tokio::test]
async fn stats_count_every_answer_and_serialize() {
    let r = rig(2);
    r.edge.hit(charge_only(), BUDGET).await.unwrap();
    r.edge
        .store()
        .set(Behave::Fail(StoreError::Timeout(BUDGET)));
    r.edge.hit(charge_only(), BUDGET).await.unwrap();
    r.edge
        .store()
        .set(Behave::Fail(refused(ErrorCode::Unavailable)));
    r.edge.hit(charge_only(), BUDGET).await.unwrap();
    r.edge.hit(charge_only(), BUDGET).await.unwrap();
    let mut invalid = charge_only();
    invalid.charges[0].capacity_us = 0;
    let _ = r.edge.hit(invalid, BUDGET).await;
    let stats = r.edge.stats();
    assert_eq!(stats.fleet_answers, 1);
    assert_eq!(stats.local_timeout, 1);
    assert_eq!(stats.local_node_error, 1);
    assert_eq!(stats.local_breaker_open, 1);
    assert_eq!(stats.local_answers, 3);
    assert_eq!(stats.invalid, 1);
    assert_eq!(stats.breaker_state, BreakerState::Open);
    assert_eq!(stats.breaker_opened, 1);
    assert_eq!(stats.local_store.tenants, 1);
    let bytes = rmp_serde::to_vec_named(&stats).expect("stats serialize");
    assert!(!bytes.is_empty());
    let answer = Answer {
        outcome: HitOutcome::Ok,
        source: local(LocalReason::NodeError(ErrorCode::Overloaded)),
    };
    assert!(rmp_serde::to_vec_named(&answer).is_ok());
}

#[tokio::test]
async fn the_edge_is_shareable_across_tasks() {
    fn shareable<T: Send + Sync + 'static>(_: &T) {}
    let edge = Arc::new(rig(5).edge);
    shareable(&edge);
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let edge = Arc::clone(&edge);
            tokio::spawn(async move {
                edge.hit(hit(&format!("k{i}"), "h"), BUDGET)
                    .await
                    .map(|a| a.source)
            })
        })
        .collect();
    for task in tasks {
        assert_eq!(task.await.unwrap(), Ok(Source::Fleet));
    }
}
