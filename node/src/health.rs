//! What the node knows about its own health, shared between the runtime (which
//! updates it) and the HTTP endpoints (which report it).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Readiness facts, updated by the runtime.
#[derive(Debug, Default)]
pub struct Health {
    nats: Mutex<Option<async_nats::Client>>,
    /// The node holds every shard it is meant to (by the balance of live nodes).
    settled: AtomicBool,
    shards_served: AtomicU64,
    shards_target: AtomicU64,
    shutting_down: AtomicBool,
    /// Fleet mode: the node stepped aside, its loads failing.
    aside: AtomicBool,
    /// Fleet mode: when the ownership loop last finished a round, and how long
    /// it may go without one before the node stops calling itself ready.
    last_round: Mutex<Option<(Instant, Duration)>>,
}

impl Health {
    pub fn set_client(&self, client: async_nats::Client) {
        *self.nats.lock().unwrap_or_else(|p| p.into_inner()) = Some(client);
    }

    pub fn set_shards(&self, served: usize, target: usize) {
        self.shards_served.store(served as u64, Ordering::Relaxed);
        self.shards_target.store(target as u64, Ordering::Relaxed);
        self.settled.store(served >= target, Ordering::Relaxed);
    }

    /// The ownership loop finished a round; it must finish another within `stall_after`.
    pub fn round_done(&self, stall_after: Duration) {
        *self.last_round.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((Instant::now(), stall_after));
    }

    fn stalled_for(&self) -> Option<Duration> {
        let (at, bound) = (*self.last_round.lock().unwrap_or_else(|p| p.into_inner()))?;
        let since = at.elapsed();
        (since > bound).then_some(since)
    }

    pub fn set_aside(&self, aside: bool) {
        self.aside.store(aside, Ordering::Relaxed);
    }

    pub fn set_shutting_down(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
    }

    /// The NATS client, once the node has one (a cheap clone).
    fn client(&self) -> Option<async_nats::Client> {
        self.nats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn connected(&self) -> bool {
        self.client()
            .is_some_and(|c| c.connection_state() == async_nats::connection::State::Connected)
    }

    /// Connections made so far, the first included: more than one means the
    /// node lost NATS and reconnected.
    fn connects(&self) -> u64 {
        self.client()
            .map_or(0, |c| c.statistics().connects.load(Ordering::Relaxed))
    }

    /// `Ok` while the process is worth keeping, else why it wants a restart:
    /// an ownership loop stuck past its bound renews no lease and takes no
    /// shard again by itself (every call of a round is bounded, so only a bug
    /// gets it there).
    pub fn liveness(&self) -> Result<String, String> {
        match self.stalled_for() {
            Some(since) => Err(format!(
                "the ownership loop has not finished a round for {} ms (leases are not being renewed)\n",
                since.as_millis()
            )),
            None => Ok("ok\n".into()),
        }
    }

    /// `Ok(summary)` when ready to serve, else why not.
    pub fn readiness(&self) -> Result<String, String> {
        let served = self.shards_served.load(Ordering::Relaxed);
        let target = self.shards_target.load(Ordering::Relaxed);
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err("shutting down\n".into());
        }
        if !self.connected() {
            return Err("not connected to NATS\n".into());
        }
        self.liveness()?;
        if self.aside.load(Ordering::Relaxed) {
            return Err(
                "stepped aside: its shard loads failed while it served no shard (see the log); \
                 trying a load again from time to time\n"
                    .into(),
            );
        }
        if !self.settled.load(Ordering::Relaxed) {
            return Err(format!("serving {served} of {target} target shards\n"));
        }
        Ok(format!("ready: serving {served} shards\n"))
    }

    /// Refreshes the gauges that are read rather than counted.
    pub fn export_gauges(&self) {
        metrics::gauge!("ankusa_nats_connected").set(if self.connected() { 1.0 } else { 0.0 });
        metrics::counter!("ankusa_nats_connects_total").absolute(self.connects());
        metrics::gauge!("ankusa_shards_target")
            .set(self.shards_target.load(Ordering::Relaxed) as f64);
        metrics::gauge!("ankusa_ready").set(if self.readiness().is_ok() { 1.0 } else { 0.0 });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stuck_ownership_loop_fails_liveness_as_well_as_readiness() {
        let health = Health::default();
        assert_eq!(health.liveness(), Ok("ok\n".into()), "no round yet");
        health.round_done(Duration::from_secs(60));
        assert!(health.liveness().is_ok());
        health.round_done(Duration::ZERO);
        std::thread::sleep(Duration::from_millis(5));
        let why = health.liveness().expect_err("past its bound");
        assert!(why.contains("ownership loop"), "{why}");
        // Readiness says first that it has no NATS client; a stuck loop
        // never reads as ready either way.
        assert!(health.readiness().is_err());
        health.round_done(Duration::from_secs(60));
        assert!(
            health.liveness().is_ok(),
            "a finished round makes it live again"
        );
    }
}
