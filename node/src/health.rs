//! What the node knows about its own health, shared between the runtime (which
//! updates it) and the HTTP endpoints (which report it).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// Readiness facts, updated by the runtime.
#[derive(Debug, Default)]
pub struct Health {
    nats: Mutex<Option<async_nats::Client>>,
    /// The node holds every shard it is meant to (by the balance of live nodes).
    settled: AtomicBool,
    shards_served: AtomicU64,
    shards_target: AtomicU64,
    shutting_down: AtomicBool,
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

    pub fn set_shutting_down(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
    }

    fn connected(&self) -> bool {
        self.nats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|c| c.connection_state() == async_nats::connection::State::Connected)
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
        if !self.settled.load(Ordering::Relaxed) {
            return Err(format!("serving {served} of {target} target shards\n"));
        }
        Ok(format!("ready: serving {served} shards\n"))
    }

    /// Refreshes the gauges that are read rather than counted.
    pub fn export_gauges(&self) {
        metrics::gauge!("ankusa_nats_connected").set(if self.connected() { 1.0 } else { 0.0 });
        metrics::gauge!("ankusa_shards_target")
            .set(self.shards_target.load(Ordering::Relaxed) as f64);
    }
}
