//! [`CircuitBreaker`]: whether the edge should try the fleet at all.
//!
//! Closed, every call goes to the fleet. After `failure_threshold` consecutive
//! outage failures it opens: for a backoff period every call is refused at once
//! (the edge answers locally in microseconds instead of spending its budget on a
//! fleet that is down). When the backoff has passed, exactly one call is let
//! through as a probe while the others keep being refused; the probe's success
//! closes the breaker, its failure re-opens it with the backoff doubled, up to
//! `max_backoff`. A success resets the backoff.
//!
//! Time is passed in (`now: Instant`) so tests are exact; [`Monotonic`] is the
//! clock the edge reads it from. The whole state — closed, open until when, or
//! probing — is one atomic word, so admitting a call is a load (and one CAS to
//! start a probe); the mutex is only taken on transitions.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

/// A monotonic clock, injectable so breaker timing can be tested exactly.
pub trait Monotonic: Send + Sync + 'static {
    fn now(&self) -> Instant;
}

/// `Instant::now()`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemMonotonic;

impl Monotonic for SystemMonotonic {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A monotonic clock that only moves when told to; clones share one time.
#[derive(Debug, Clone)]
pub struct ManualMonotonic {
    base: Instant,
    offset_ns: Arc<AtomicU64>,
}

impl Default for ManualMonotonic {
    fn default() -> Self {
        Self::new()
    }
}

impl ManualMonotonic {
    pub fn new() -> Self {
        Self {
            base: Instant::now(),
            offset_ns: Arc::new(AtomicU64::new(0)),
        }
    }

    pub fn advance(&self, by: Duration) {
        self.offset_ns.fetch_add(duration_ns(by), Ordering::SeqCst);
    }
}

impl Monotonic for ManualMonotonic {
    fn now(&self) -> Instant {
        self.base + Duration::from_nanos(self.offset_ns.load(Ordering::SeqCst))
    }
}

/// When a breaker opens and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive outage failures that open a closed breaker (at least 1).
    pub failure_threshold: u32,
    /// The first backoff after opening.
    pub base_backoff: Duration,
    /// The longest backoff, however many probes failed.
    pub max_backoff: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_threshold: 5,
            base_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
        }
    }
}

/// Where a breaker stands, for export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    Closed,
    Open,
    /// A probe is in flight.
    HalfOpen,
}

/// Transitions a breaker made, for export.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct BreakerTransitions {
    /// Times it opened (from closed, or after a failed probe).
    pub opened: u64,
    /// Probes it let through.
    pub half_open: u64,
    /// Times a probe closed it.
    pub closed: u64,
}

/// Whether a call may go to the fleet.
#[derive(Debug)]
pub enum Admission<'a> {
    /// Go to the fleet, then report the result on the permit.
    Allowed(Permit<'a>),
    /// The breaker is open (or another call is probing): do not call the fleet.
    Rejected,
}

/// A call let through to the fleet. Report its result with [`Permit::record`];
/// a probe permit dropped without a result (its caller gave up) lets the next
/// call probe instead, so the breaker can never stay half-open forever.
#[derive(Debug)]
pub struct Permit<'a> {
    breaker: &'a CircuitBreaker,
    probe: bool,
    recorded: bool,
}

impl Permit<'_> {
    /// Whether this call is the half-open probe.
    pub fn is_probe(&self) -> bool {
        self.probe
    }

    /// Reports the call's result: `healthy` when the fleet answered (even with a
    /// refusal of the request), false on an outage.
    pub fn record(mut self, healthy: bool, now: Instant) {
        self.recorded = true;
        self.breaker.record(self.probe, healthy, now);
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if self.probe && !self.recorded {
            self.breaker.abandon_probe();
        }
    }
}

const CLOSED: u64 = 0;
const OPEN: u64 = 1;
const PROBING: u64 = 2;
const STATE_BITS: u64 = 0b11;

/// The state word: the low two bits are the state, the rest the instant (ns since
/// the breaker's base) an open breaker lets a probe through.
fn pack(state: u64, until_ns: u64) -> u64 {
    (until_ns << 2) | state
}

fn unpack(word: u64) -> (u64, u64) {
    (word & STATE_BITS, word >> 2)
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// See the module doc. Cheap to share: `&self` everywhere.
#[derive(Debug)]
pub struct CircuitBreaker {
    config: BreakerConfig,
    base: Instant,
    word: AtomicU64,
    failures: AtomicU32,
    /// The backoff the breaker is in (or would start with); only read and written
    /// on transitions.
    backoff: Mutex<Duration>,
    opened: AtomicU64,
    half_open: AtomicU64,
    closed: AtomicU64,
}

impl CircuitBreaker {
    /// A closed breaker; `now` anchors its clock (pass the clock's current time).
    pub fn new(config: BreakerConfig, now: Instant) -> Self {
        let config = BreakerConfig {
            failure_threshold: config.failure_threshold.max(1),
            base_backoff: config.base_backoff,
            max_backoff: config.max_backoff.max(config.base_backoff),
        };
        Self {
            base: now,
            word: AtomicU64::new(pack(CLOSED, 0)),
            failures: AtomicU32::new(0),
            backoff: Mutex::new(config.base_backoff),
            config,
            opened: AtomicU64::new(0),
            half_open: AtomicU64::new(0),
            closed: AtomicU64::new(0),
        }
    }

    pub fn config(&self) -> BreakerConfig {
        self.config
    }

    /// Whether a call made at `now` may go to the fleet.
    pub fn admit(&self, now: Instant) -> Admission<'_> {
        let word = self.word.load(Ordering::Acquire);
        let (state, until_ns) = unpack(word);
        let allowed = |probe| {
            Admission::Allowed(Permit {
                breaker: self,
                probe,
                recorded: false,
            })
        };
        match state {
            CLOSED => allowed(false),
            OPEN if self.ns(now) >= until_ns => {
                // Only the call that wins the CAS probes; the word includes the
                // deadline, so a stale read of an older open period cannot win.
                match self.word.compare_exchange(
                    word,
                    pack(PROBING, until_ns),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        self.half_open.fetch_add(1, Ordering::Relaxed);
                        allowed(true)
                    }
                    Err(_) => Admission::Rejected,
                }
            }
            _ => Admission::Rejected,
        }
    }

    pub fn state(&self) -> BreakerState {
        match unpack(self.word.load(Ordering::Acquire)).0 {
            CLOSED => BreakerState::Closed,
            OPEN => BreakerState::Open,
            _ => BreakerState::HalfOpen,
        }
    }

    /// The backoff of the current (or next) open period.
    pub fn backoff(&self) -> Duration {
        *self.lock_backoff()
    }

    pub fn transitions(&self) -> BreakerTransitions {
        BreakerTransitions {
            opened: self.opened.load(Ordering::Relaxed),
            half_open: self.half_open.load(Ordering::Relaxed),
            closed: self.closed.load(Ordering::Relaxed),
        }
    }

    fn record(&self, probe: bool, healthy: bool, now: Instant) {
        match (probe, healthy) {
            (false, true) => {
                // Skip the write on the hot path when there is nothing to reset.
                if self.failures.load(Ordering::Relaxed) != 0 {
                    self.failures.store(0, Ordering::Relaxed);
                }
            }
            (false, false) => {
                let failures = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
                if failures >= self.config.failure_threshold {
                    let mut backoff = self.lock_backoff();
                    // Calls admitted before the breaker opened report late; only
                    // the first over the threshold opens it.
                    if unpack(self.word.load(Ordering::Acquire)).0 == CLOSED {
                        *backoff = self.config.base_backoff;
                        self.open(now, *backoff);
                    }
                }
            }
            (true, true) => {
                let mut backoff = self.lock_backoff();
                *backoff = self.config.base_backoff;
                self.failures.store(0, Ordering::Release);
                self.word.store(pack(CLOSED, 0), Ordering::Release);
                self.closed.fetch_add(1, Ordering::Relaxed);
            }
            (true, false) => {
                let mut backoff = self.lock_backoff();
                *backoff = backoff.saturating_mul(2).min(self.config.max_backoff);
                self.open(now, *backoff);
            }
        }
    }

    fn open(&self, now: Instant, backoff: Duration) {
        let until = self.ns(now).saturating_add(duration_ns(backoff));
        self.word.store(pack(OPEN, until), Ordering::Release);
        self.failures.store(0, Ordering::Release);
        self.opened.fetch_add(1, Ordering::Relaxed);
    }

    /// The probe's caller gave up: back to open with the deadline already past, so
    /// the next call probes.
    fn abandon_probe(&self) {
        let _backoff = self.lock_backoff();
        let (state, until_ns) = unpack(self.word.load(Ordering::Acquire));
        if state == PROBING {
            self.word.store(pack(OPEN, until_ns), Ordering::Release);
        }
    }

    fn ns(&self, now: Instant) -> u64 {
        // 62 bits of nanoseconds is 146 years of uptime.
        duration_ns(now.saturating_duration_since(self.base)).min(u64::MAX >> 2)
    }

    fn lock_backoff(&self) -> std::sync::MutexGuard<'_, Duration> {
        // A Duration cannot be left half-written by a panic.
        self.backoff
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    fn breaker() -> (CircuitBreaker, ManualMonotonic) {
        let clock = ManualMonotonic::new();
        let config = BreakerConfig {
            failure_threshold: 3,
            base_backoff: SEC,
            max_backoff: 5 * SEC,
        };
        (CircuitBreaker::new(config, clock.now()), clock)
    }

    fn call(b: &CircuitBreaker, healthy: bool, now: Instant) -> Option<bool> {
        match b.admit(now) {
            Admission::Allowed(permit) => {
                let probe = permit.is_probe();
                permit.record(healthy, now);
                Some(probe)
            }
            Admission::Rejected => None,
        }
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let (b, clock) = breaker();
        let now = clock.now();
        assert_eq!(call(&b, false, now), Some(false));
        assert_eq!(call(&b, false, now), Some(false));
        assert_eq!(
            call(&b, true, now),
            Some(false),
            "a success resets the count"
        );
        assert_eq!(call(&b, false, now), Some(false));
        assert_eq!(call(&b, false, now), Some(false));
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(call(&b, false, now), Some(false));
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(call(&b, true, now), None);
        assert_eq!(b.transitions().opened, 1);
    }

    #[test]
    fn one_probe_after_backoff_and_success_closes() {
        let (b, clock) = breaker();
        for _ in 0..3 {
            call(&b, false, clock.now());
        }
        clock.advance(SEC - Duration::from_nanos(1));
        assert!(matches!(b.admit(clock.now()), Admission::Rejected));
        clock.advance(Duration::from_nanos(1));
        let Admission::Allowed(probe) = b.admit(clock.now()) else {
            panic!("the backoff has passed: probe");
        };
        assert!(probe.is_probe());
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(
            matches!(b.admit(clock.now()), Admission::Rejected),
            "only one probe at a time"
        );
        probe.record(true, clock.now());
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(call(&b, true, clock.now()), Some(false));
        assert_eq!(
            b.transitions(),
            BreakerTransitions {
                opened: 1,
                half_open: 1,
                closed: 1
            }
        );
    }

    #[test]
    fn a_closing_probe_resets_the_backoff() {
        let (b, clock) = breaker();
        for _ in 0..3 {
            call(&b, false, clock.now());
        }
        clock.advance(SEC);
        assert_eq!(call(&b, false, clock.now()), Some(true));
        assert_eq!(b.backoff(), 2 * SEC);
        clock.advance(2 * SEC - Duration::from_millis(1));
        assert_eq!(call(&b, true, clock.now()), None, "still open");
        clock.advance(Duration::from_millis(1));
        assert_eq!(call(&b, true, clock.now()), Some(true));
        assert_eq!(b.backoff(), SEC);
        for _ in 0..3 {
            call(&b, false, clock.now());
        }
        clock.advance(SEC);
        assert_eq!(
            call(&b, true, clock.now()),
            Some(true),
            "next outage starts at base"
        );
    }

    #[test]
    fn backoff_sequence_is_exact() {
        let (b, clock) = breaker();
        for _ in 0..3 {
            call(&b, false, clock.now());
        }
        let mut seen = vec![b.backoff()];
        for _ in 0..4 {
            clock.advance(b.backoff());
            assert_eq!(call(&b, false, clock.now()), Some(true));
            seen.push(b.backoff());
        }
        assert_eq!(seen, vec![SEC, 2 * SEC, 4 * SEC, 5 * SEC, 5 * SEC]);
        assert_eq!(b.transitions().opened, 5);
        assert_eq!(b.transitions().half_open, 4);
    }

    #[test]
    fn abandoned_probe_lets_the_next_call_probe() {
        let (b, clock) = breaker();
        for _ in 0..3 {
            call(&b, false, clock.now());
        }
        clock.advance(SEC);
        match b.admit(clock.now()) {
            Admission::Allowed(p) => assert!(p.is_probe()),
            Admission::Rejected => panic!("due a probe"),
        }
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(call(&b, true, clock.now()), Some(true));
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn late_reports_do_not_reopen_or_close() {
        let (b, clock) = breaker();
        let now = clock.now();
        let permits: Vec<_> = (0..5)
            .map(|_| match b.admit(now) {
                Admission::Allowed(p) => p,
                Admission::Rejected => panic!("closed"),
            })
            .collect();
        for p in permits {
            p.record(false, now);
        }
        assert_eq!(b.transitions().opened, 1, "opened once, not per report");
    }
}
