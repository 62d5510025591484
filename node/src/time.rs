//! The node's time: one [`AnchoredClock`], shared by its actors and its KV
//! adapter, set to the NATS server's time before the node serves a shard and
//! only slewed while it does.
//!
//! Why: a tenant's bucket TATs and claim expiries are unix times, and they
//! move with their shard from node to node. Read by each host's own clock, a
//! tenant taken over by a node whose clock is an hour ahead would find its
//! buckets full and its pending claims expired (a second delivery of a hook
//! still in flight let through); an hour behind, its buckets empty for an
//! hour. A host's clock that steps while the node runs does the same to
//! every tenant it serves. So every node keeps the time of the one server
//! that stamps the heartbeats (the nodes bucket's stream leader), as the
//! contract's Redis store keeps Redis's `TIME`.
//!
//! Each heartbeat is read back with the time the server stored it at: that
//! instant lies between this node's clock before the write and after the
//! read, unless the clock is off ([`Reading`]). While the node serves no
//! shard, its clock is stepped to the server's; while it serves, it is only
//! slewed, by what a reading proves and at most [`MAX_SLEW_PPM`] of the time
//! since the last reading, so that no answer given is contradicted by a jump.

use std::sync::Arc;
use std::time::Duration;

use ankusa_actors::{AnchoredClock, Clock};
use ankusa_bus::kv::KvError;
use tokio::time::Instant;

/// The fastest the clock is slewed while the node serves: 500 µs a second,
/// NTP's own bound, so that a rate limit is off by at most 0.05 % meanwhile.
pub const MAX_SLEW_PPM: u64 = 500;

/// An offset from the server past which the node warns: beyond it, tenants
/// that move between nodes see their buckets and claims off by as much.
pub const WARN_OFFSET: Duration = Duration::from_secs(1);

/// Heartbeats in a row whose time could not be read back before a node that
/// has not set its clock gives up and serves by its host's.
pub const UNREADABLE_ROUNDS: u32 = 3;

/// The widest reading (write to read-back) that sets a clock not set yet:
/// its midpoint is off by at most half of it. A wider one (a stream's leader
/// election at start, say) waits for a narrower, at most [`WIDE_ROUNDS`]
/// heartbeats, then the narrowest seen sets the clock. Once the node serves,
/// its clock only slews, 40 minutes for a second's error.
pub const SET_SPAN: Duration = Duration::from_millis(100);

/// Heartbeats whose reading was too wide that a clock not set yet waits out.
pub const WIDE_ROUNDS: u32 = 3;

/// One heartbeat's times: this node's clock before writing it and after
/// reading it back, and the server's when it stored it (all unix µs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    pub sent_us: u64,
    pub server_us: u64,
    pub read_us: u64,
}

impl Reading {
    /// The server's time minus this node's, taking the server's stamp as
    /// made halfway between the write and the read: off by at most half
    /// their span.
    pub fn offset_us(&self) -> i64 {
        let midpoint = self.sent_us + self.read_us.saturating_sub(self.sent_us) / 2;
        signed_difference(self.server_us, midpoint)
    }

    /// The offset the reading proves: none when the server's stamp lies
    /// between the write and the read, else how far outside it lies.
    pub fn proven_us(&self) -> i64 {
        if self.server_us < self.sent_us {
            signed_difference(self.server_us, self.sent_us)
        } else if self.server_us > self.read_us {
            signed_difference(self.server_us, self.read_us)
        } else {
            0
        }
    }
}

fn signed_difference(a: u64, b: u64) -> i64 {
    let magnitude = i64::try_from(a.abs_diff(b)).unwrap_or(i64::MAX);
    if a >= b {
        magnitude
    } else {
        -magnitude
    }
}

/// Keeps the node's clock with the server's.
pub struct TimeKeeper {
    clock: Arc<AnchoredClock>,
    /// Whether the clock has been set (or the node has given up setting it):
    /// until then the node takes no shard.
    set: bool,
    /// Whether the node has warned that its clock is off.
    warned: bool,
    last_reading: Option<Instant>,
    /// Heartbeats in a row whose time could not be read.
    unreadable: u32,
    /// Before the clock is set: the narrowest reading too wide to set it,
    /// and how many there were.
    narrowest: Option<Reading>,
    wide: u32,
}

impl TimeKeeper {
    pub fn new(clock: Arc<AnchoredClock>) -> Self {
        Self {
            clock,
            set: false,
            warned: false,
            last_reading: None,
            unreadable: 0,
            narrowest: None,
            wide: 0,
        }
    }

    pub fn now_us(&self) -> u64 {
        self.clock.now_us()
    }

    /// Whether the node may take shards: its clock is the server's, or
    /// could not be read and stays the host's.
    pub fn is_set(&self) -> bool {
        self.set
    }

    /// Takes in a heartbeat's reading, at `now`; `serving` says whether the
    /// node answers for any shard (then the clock may only slew).
    pub fn take(&mut self, reading: Reading, serving: bool, now: Instant) {
        let reading = if !self.set && !serving {
            let span = |r: &Reading| r.read_us.saturating_sub(r.sent_us);
            let narrowest = match self.narrowest {
                Some(kept) if span(&kept) < span(&reading) => kept,
                _ => reading,
            };
            if span(&narrowest) > SET_SPAN.as_micros() as u64 && self.wide < WIDE_ROUNDS {
                // The host's clock has not moved since a kept reading was
                // made, so its offset still holds when it is used later.
                self.narrowest = Some(narrowest);
                self.wide += 1;
                self.last_reading = Some(now);
                self.unreadable = 0;
                return;
            }
            narrowest
        } else {
            reading
        };
        let offset = reading.offset_us();
        metrics::gauge!("ankusa_clock_offset_seconds").set(offset as f64 / 1e6);
        if !serving && (!self.set || reading.proven_us() != 0) {
            self.clock.step_by(offset);
            metrics::counter!("ankusa_clock_steps_total").increment(1);
            if !self.set || offset.unsigned_abs() >= WARN_OFFSET.as_micros() as u64 {
                tracing::info!(
                    step_ms = offset / 1000,
                    within_ms = reading.read_us.saturating_sub(reading.sent_us) / 2000,
                    "clock set to the NATS server's"
                );
            }
            self.set = true;
        } else if serving {
            let since = self
                .last_reading
                .map_or(Duration::ZERO, |last| now.saturating_duration_since(last));
            let limit = since.as_micros() as u64 * MAX_SLEW_PPM / 1_000_000;
            let made = self.clock.slew_by(reading.proven_us(), limit);
            if made != 0 {
                metrics::counter!("ankusa_clock_slewed_microseconds_total")
                    .increment(made.unsigned_abs());
            }
        }
        self.last_reading = Some(now);
        self.unreadable = 0;
        let off = offset.unsigned_abs() > WARN_OFFSET.as_micros() as u64;
        if off && serving && !self.warned {
            tracing::warn!(
                offset_ms = offset / 1000,
                "clock differs from the NATS server's while serving; slewing it at most {MAX_SLEW_PPM} µs a second"
            );
            self.warned = true;
        } else if !off && self.warned {
            tracing::info!(
                offset_ms = offset / 1000,
                "clock agrees with the NATS server's again"
            );
            self.warned = false;
        }
    }

    /// The heartbeat was written but its time could not be read back. After
    /// [`UNREADABLE_ROUNDS`] in a row, a node whose clock is not set yet
    /// keeps its host's rather than never serving.
    pub fn unreadable(&mut self, err: &KvError) {
        self.unreadable = self.unreadable.saturating_add(1);
        if !self.set && self.unreadable >= UNREADABLE_ROUNDS {
            tracing::warn!(error = %err, "cannot read the NATS server's time; keeping this host's clock");
            self.set = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR_US: u64 = 3_600_000_000;

    fn reading(clock: &AnchoredClock, server_us: u64, span_us: u64) -> Reading {
        let sent_us = clock.now_us();
        Reading {
            sent_us,
            server_us,
            read_us: sent_us + span_us,
        }
    }

    #[test]
    fn the_offset_is_read_from_the_middle_and_proven_only_outside_the_span() {
        let r = |server_us| Reading {
            sent_us: 1_000,
            server_us,
            read_us: 3_000,
        };
        assert_eq!(r(2_000).offset_us(), 0);
        assert_eq!(r(2_900).offset_us(), 900);
        assert_eq!(r(2_900).proven_us(), 0);
        assert_eq!(r(500).proven_us(), -500);
        assert_eq!(r(3_700).proven_us(), 700);
        assert_eq!(r(u64::MAX).offset_us(), i64::MAX);
    }

    #[test]
    fn a_node_serving_nothing_is_set_to_the_servers_time() {
        let server_now = 1_800_000_000_000_000;
        let clock = Arc::new(AnchoredClock::starting_at(server_now + HOUR_US));
        let mut keeper = TimeKeeper::new(clock.clone());
        assert!(!keeper.is_set());
        keeper.take(reading(&clock, server_now, 1_000), false, Instant::now());
        assert!(keeper.is_set());
        let now = clock.now_us();
        assert!(
            now.abs_diff(server_now) < 100_000,
            "{now} against {server_now}"
        );
    }

    #[test]
    fn a_wide_reading_waits_for_a_narrower_one_to_set_the_clock() {
        let server_now = 1_800_000_000_000_000;
        let clock = Arc::new(AnchoredClock::starting_at(server_now + HOUR_US));
        let mut keeper = TimeKeeper::new(clock.clone());
        // 2.4 s from the write to the read-back, the stamp early in it: a
        // midpoint 1.2 s off.
        let wide = |server_us| reading(&clock, server_us, 2_400_000);
        keeper.take(wide(clock.now_us() - HOUR_US), false, Instant::now());
        assert!(!keeper.is_set(), "set from a reading 2.4 s wide");
        keeper.take(
            reading(&clock, clock.now_us() - HOUR_US + 500, 1_000),
            false,
            Instant::now(),
        );
        assert!(keeper.is_set());
        let off = clock.now_us().abs_diff(server_now);
        assert!(off < 100_000, "off by {off} µs");
        // Readings that stay wide: after a few, the narrowest of them.
        let clock = Arc::new(AnchoredClock::starting_at(server_now + HOUR_US));
        let mut keeper = TimeKeeper::new(clock.clone());
        for span_us in [3_000_000, 900_000, 2_000_000] {
            keeper.take(
                reading(&clock, clock.now_us() - HOUR_US, span_us),
                false,
                Instant::now(),
            );
            assert!(!keeper.is_set());
        }
        keeper.take(
            reading(&clock, clock.now_us() - HOUR_US, 2_500_000),
            false,
            Instant::now(),
        );
        assert!(keeper.is_set(), "never set");
        let off = clock.now_us().abs_diff(server_now);
        assert!(
            (400_000..600_000).contains(&off),
            "off by {off} µs, not the 0.9 s reading's half"
        );
    }

    #[test]
    fn a_serving_node_is_slewed_by_what_a_reading_proves_at_most_500_ppm() {
        let server_now = 1_800_000_000_000_000;
        let clock = Arc::new(AnchoredClock::starting_at(server_now));
        let mut keeper = TimeKeeper::new(clock.clone());
        let start = Instant::now();
        keeper.take(reading(&clock, server_now, 1_000), false, start);
        // The server's stamp is an hour past the span: the clock is an hour
        // behind, and a second later it may move 500 µs.
        let before = clock.now_us();
        let ahead = reading(&clock, before + HOUR_US, 1_000);
        keeper.take(ahead, true, start + Duration::from_secs(1));
        let moved = clock.now_us() - before;
        assert!((500..100_000).contains(&moved), "moved {moved} µs");
        // A stamp inside the span proves nothing: no slew.
        let before = clock.now_us();
        let inside = reading(&clock, before + 500, 1_000);
        keeper.take(inside, true, start + Duration::from_secs(2));
        assert!(clock.now_us() - before < 50_000);
    }

    proptest::proptest! {
        /// Whatever the readings say, a serving node's clock never goes
        /// back and never gains more than the slew bound on the time that
        /// passed.
        #[test]
        fn a_serving_nodes_clock_only_moves_forward_within_the_slew_bound(
            start_off_us in -7_200_000_000i64..7_200_000_000,
            readings in proptest::collection::vec(
                (-3_600_000_000i64..3_600_000_000, 0u64..50_000, 1u64..5_000_000),
                1..30,
            ),
        ) {
            let server_now = 1_800_000_000_000_000u64;
            let clock = Arc::new(AnchoredClock::starting_at(
                server_now.saturating_add_signed(start_off_us),
            ));
            let mut keeper = TimeKeeper::new(clock.clone());
            let mut now = Instant::now();
            keeper.take(reading(&clock, server_now, 1_000), false, now);
            for (server_off_us, span_us, gap_us) in readings {
                now += Duration::from_micros(gap_us);
                let real = std::time::Instant::now();
                let before = clock.now_us();
                let server_us = before.saturating_add_signed(server_off_us);
                keeper.take(reading(&clock, server_us, span_us), true, now);
                let after = clock.now_us();
                let elapsed_us = real.elapsed().as_micros() as u64;
                let bound = gap_us * MAX_SLEW_PPM / 1_000_000;
                proptest::prop_assert!(after >= before, "went back: {before} then {after}");
                proptest::prop_assert!(
                    after - before <= elapsed_us + bound + 1,
                    "moved {} µs in {elapsed_us} µs with a bound of {bound}",
                    after - before
                );
            }
        }
    }

    #[test]
    fn a_clock_that_cannot_be_read_three_times_stays_the_hosts_and_lets_the_node_serve() {
        let clock = Arc::new(AnchoredClock::starting_at(5_000_000));
        let mut keeper = TimeKeeper::new(clock.clone());
        let err = KvError::Request("no message get".into());
        keeper.unreadable(&err);
        keeper.unreadable(&err);
        assert!(!keeper.is_set(), "two misses are not enough to give up");
        keeper.unreadable(&err);
        assert!(keeper.is_set());
        assert!(clock.now_us() < 6_000_000);
    }
}
