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
        if let Some(since) = self.stalled_for() {
            return Err(format!(
                "the ownership loop has not finished a round for {} ms (leases are not being renewed)\n",
                since.as_millis()
            ));
        }
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
    }
}
