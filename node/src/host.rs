//! The shards this node serves right now: for each, a `ShardActor` holding its
//! tenants and a `ShardResponder` answering on its subject.
//!
//! [`ShardHost::serve`] starts a shard from the state it is given (loaded from KV,
//! or empty); [`ShardHost::release`] stops answering first, then waits for the
//! answers in flight, then hands the shard's state back, so a handoff never
//! drops an accepted request.

use std::collections::BTreeMap;
use std::time::Duration;

use ankusa_actors::actor::{spawn_shard, ShardConfig, ShardMsg, ShardStats};
use ankusa_actors::TenantSnapshot;
use ankusa_bus::persist::Persistence;
use ankusa_bus::responder::{ServeWindow, ShardContext, ShardResponder};
use ankusa_bus::Subjects;
use ractor::rpc::CallResult;
use ractor::{ActorRef, ActorStatus};

/// Why a shard could not be started.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("could not start the actor of shard {shard}: {reason}")]
    Actor { shard: u32, reason: String },
    #[error("could not subscribe shard {shard}: {reason}")]
    Subscribe { shard: u32, reason: String },
}

struct Served {
    actor: ActorRef<ShardMsg>,
    responder: ShardResponder,
}

/// The shards a node serves.
pub struct ShardHost {
    client: async_nats::Client,
    subjects: Subjects,
    shards: u32,
    shard_config: ShardConfig,
    persistence: Persistence,
    served: BTreeMap<u32, Served>,
}

/// How long a releasing shard waits for its in-flight answers.
const RELEASE_GRACE: Duration = Duration::from_secs(2);
/// How long an export of a shard's state may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

impl ShardHost {
    pub fn new(
        client: async_nats::Client,
        subjects: Subjects,
        shards: u32,
        shard_config: ShardConfig,
        persistence: Persistence,
    ) -> Self {
        Self {
            client,
            subjects,
            shards,
            shard_config,
            persistence,
            served: BTreeMap::new(),
        }
    }

    pub fn shards(&self) -> u32 {
        self.shards
    }

    pub fn is_serving(&self, shard: u32) -> bool {
        self.served.contains_key(&shard)
    }

    /// The shards served now, ascending.
    pub fn serving(&self) -> Vec<u32> {
        self.served.keys().copied().collect()
    }

    /// Starts serving `shard` with `tenants` as its state, answering only while
    /// `window` (if any) is open. Serving a shard twice is a no-op.
    pub async fn serve(
        &mut self,
        shard: u32,
        tenants: Vec<TenantSnapshot>,
        window: Option<ServeWindow>,
    ) -> Result<(), HostError> {
        if self.served.contains_key(&shard) {
            return Ok(());
        }
        let actor = spawn_shard(self.shard_config.clone(), tenants, None)
            .await
            .map_err(|e| HostError::Actor {
                shard,
                reason: e.to_string(),
            })?;
        let ctx = ShardContext {
            shard,
            shards: self.shards,
            subject: self.subjects.shard(shard),
            actor: actor.clone(),
            persistence: self.persistence.clone(),
            window,
        };
        match ShardResponder::start(self.client.clone(), ctx).await {
            Ok(responder) => {
                self.served.insert(shard, Served { actor, responder });
                metrics::gauge!("ankusa_shards_owned").set(self.served.len() as f64);
                Ok(())
            }
            Err(e) => {
                actor.stop(None);
                Err(HostError::Subscribe {
                    shard,
                    reason: e.to_string(),
                })
            }
        }
    }

    /// Stops serving `shard` and returns its state (`None` if it was not served).
    pub async fn release(&mut self, shard: u32) -> Option<Vec<TenantSnapshot>> {
        let served = self.served.remove(&shard)?;
        metrics::gauge!("ankusa_shards_owned").set(self.served.len() as f64);
        served.responder.stop(RELEASE_GRACE).await;
        let state = match served
            .actor
            .call(ShardMsg::Export, Some(EXPORT_TIMEOUT))
            .await
        {
            Ok(CallResult::Success(state)) => state,
            _ => Vec::new(),
        };
        served.actor.stop(None);
        Some(state)
    }

    /// Releases every shard, one after another, dropping their state (standalone
    /// mode keeps nothing; fleet mode hands shards back one by one instead).
    pub async fn release_all(&mut self) {
        for shard in self.serving() {
            let _ = self.release(shard).await;
        }
    }

    /// Served shards whose actor has stopped on its own: it failed, and its
    /// owner must restart it.
    pub fn failed(&self) -> Vec<u32> {
        self.served
            .iter()
            .filter(|(_, s)| {
                matches!(
                    s.actor.get_status(),
                    ActorStatus::Stopping | ActorStatus::Stopped
                )
            })
            .map(|(&shard, _)| shard)
            .collect()
    }

    /// Sends each shard its periodic tick (retire idle tenants, sweep claims).
    pub fn tick(&self) {
        for served in self.served.values() {
            let _ = served.actor.cast(ShardMsg::Tick);
        }
    }

    /// Gauges summed over the shards served.
    pub async fn stats(&self) -> ShardStats {
        let mut total = ShardStats::default();
        for served in self.served.values() {
            if let Ok(CallResult::Success(s)) = served
                .actor
                .call(ShardMsg::Stats, Some(Duration::from_secs(1)))
                .await
            {
                total.active_tenants += s.active_tenants;
                total.parked_tenants += s.parked_tenants;
                total.claims += s.claims;
                total.restarts += s.restarts;
                total.shed += s.shed;
            }
        }
        total
    }
}
