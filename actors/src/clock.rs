//! Time as the domain sees it: unix microseconds behind a trait.
//!
//! Bucket TATs and claim expiries are persisted and handed between nodes, so they
//! are wall-clock instants (unix µs), not `Instant`s. Injecting the clock keeps
//! every rule testable to the microsecond.
//!
//! A node runs on an [`AnchoredClock`]: wall time read once, then carried by the
//! monotonic clock, so that a step of the host's clock (an NTP step, an operator's
//! `date -s`) does not move a tenant's buckets or claims. The node anchors it to
//! the NATS server's time before it serves anything, so that the nodes between
//! which a tenant moves read the same time (docs/architecture.md, "Time").

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// A source of "now" in unix microseconds.
pub trait Clock: Send + Sync + 'static {
    fn now_us(&self) -> u64;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_us(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0)
    }
}

/// Wall time that does not step with the host's clock: an anchor (unix µs
/// at a monotonic instant) carried forward by the monotonic clock. It moves
/// only when told to: [`Self::step_by`] jumps, either way; [`Self::slew_by`]
/// moves it a bounded amount and never makes `now_us` smaller than a time it
/// already gave (backwards, it holds still until it has caught up).
#[derive(Debug)]
pub struct AnchoredClock {
    base: Instant,
    anchor: Mutex<Anchor>,
}

#[derive(Debug)]
struct Anchor {
    /// Unix µs at `base`.
    at_base_us: u64,
    /// The largest time given since the last step, which no reading goes below.
    floor_us: u64,
}

impl AnchoredClock {
    /// A clock that reads `now_us` now.
    pub fn starting_at(now_us: u64) -> Self {
        Self {
            base: Instant::now(),
            anchor: Mutex::new(Anchor {
                at_base_us: now_us,
                floor_us: 0,
            }),
        }
    }

    /// A clock that starts at the system's wall time.
    pub fn from_system() -> Self {
        Self::starting_at(SystemClock.now_us())
    }

    fn anchor(&self) -> std::sync::MutexGuard<'_, Anchor> {
        // The anchor is two integers, whole at every step: a panic elsewhere
        // while it was held leaves nothing half written.
        self.anchor
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Moves the clock by `delta_us` at once, back as well as forward.
    pub fn step_by(&self, delta_us: i64) {
        let mut anchor = self.anchor();
        anchor.at_base_us = anchor.at_base_us.saturating_add_signed(delta_us);
        anchor.floor_us = 0;
    }

    /// Moves the clock towards `delta_us`, by at most `limit_us`, without
    /// going back; returns the move made.
    pub fn slew_by(&self, delta_us: i64, limit_us: u64) -> i64 {
        let limit = i64::try_from(limit_us).unwrap_or(i64::MAX);
        let made = delta_us.clamp(-limit, limit);
        let mut anchor = self.anchor();
        anchor.at_base_us = anchor.at_base_us.saturating_add_signed(made);
        made
    }
}

impl Clock for AnchoredClock {
    fn now_us(&self) -> u64 {
        let elapsed = self.base.elapsed().as_micros().min(u128::from(u64::MAX)) as u64;
        let mut anchor = self.anchor();
        let now = anchor
            .at_base_us
            .saturating_add(elapsed)
            .max(anchor.floor_us);
        anchor.floor_us = now;
        now
    }
}

/// A clock that only moves when told to; clones share one time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    pub fn new(start_us: u64) -> Self {
        Self(Arc::new(AtomicU64::new(start_us)))
    }

    pub fn advance_us(&self, us: u64) {
        self.0.fetch_add(us, Ordering::SeqCst);
    }

    pub fn set_us(&self, us: u64) {
        self.0.store(us, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn an_anchored_clock_runs_with_the_monotonic_clock() {
        let clock = AnchoredClock::starting_at(1_000_000);
        let first = clock.now_us();
        assert!((1_000_000..1_100_000).contains(&first), "{first}");
        std::thread::sleep(Duration::from_millis(20));
        let later = clock.now_us();
        assert!(later - first >= 20_000, "{first} then {later}");
    }

    #[test]
    fn a_step_moves_it_either_way() {
        let clock = AnchoredClock::starting_at(10_000_000);
        clock.step_by(3_600_000_000);
        let ahead = clock.now_us();
        assert!((3_610_000_000..3_611_000_000).contains(&ahead), "{ahead}");
        clock.step_by(-3_600_000_000);
        let back = clock.now_us();
        assert!((10_000_000..11_000_000).contains(&back), "{back}");
    }

    #[test]
    fn a_slew_is_bounded_and_says_what_it_moved() {
        let clock = AnchoredClock::starting_at(10_000_000);
        assert_eq!(clock.slew_by(5_000, 1_000), 1_000);
        assert_eq!(clock.slew_by(-5_000, 1_000), -1_000);
        assert_eq!(clock.slew_by(300, 1_000), 300);
        assert_eq!(clock.slew_by(i64::MIN, u64::MAX), i64::MIN + 1);
    }

    #[test]
    fn a_slew_back_never_goes_back() {
        let clock = AnchoredClock::starting_at(10_000_000);
        let mut last = clock.now_us();
        for i in 0..10_000 {
            if i % 100 == 0 {
                clock.slew_by(-1_000, 1_000);
            }
            let now = clock.now_us();
            assert!(now >= last, "{now} after {last}");
            last = now;
        }
    }
}
