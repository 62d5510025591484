//! The shards this node serves right now: for each, a `ShardActor` holding its
//! tenants and a `ShardResponder` answering on its subject.
//!
//! [`ShardHost::serve`] starts a shard from the state it is given (loaded from KV,
//! or empty); [`ShardHost::release`] stops taking requests first, then answers
//! those already delivered and waits for the answers in flight, then stops the
//! shard's actors, so a handoff never drops an accepted request.

use std::collections::BTreeMap;
use std::time::Duration;

use ankusa_actors::actor::{spawn_shard, ShardConfig, ShardMsg, ShardStats};
use ankusa_actors::TenantSnapshot;
use ankusa_bus::persist::Persistence;
use ankusa_bus::responder::{
    NodeResponder, NodeRouting, ServeWindow, ShardContext, ShardResponder, ShardTable,
};
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
    #[error("could not subscribe the node's subject {subject}: {reason}")]
    NodeSubject { subject: String, reason: String },
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
    /// Batches for any served shard on the node's own subject.
    routing: Option<NodeRouting>,
    node_responder: Option<NodeResponder>,
}

/// How long a releasing shard waits for its in-flight answers.
const RELEASE_GRACE: Duration = Duration::from_secs(2);
/// How long the gauges wait for a shard's figures (a busy shard's are skipped).
const STATS_WAIT: Duration = Duration::from_secs(1);

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
            routing: None,
            node_responder: None,
        }
    }

    /// Also takes batches for every served shard on `node_id`'s own subject
    /// (started with the first shard served).
    pub fn with_node_subject(mut self, node_id: &str) -> Self {
        self.routing = Some(NodeRouting {
            node: node_id.into(),
            table: ShardTable::new(self.shards),
        });
        self
    }

    async fn start_node_subject(&mut self) -> Result<(), HostError> {
        let Some(routing) = self.routing.as_ref() else {
            return Ok(());
        };
        if self.node_responder.is_some() {
            return Ok(());
        }
        let subject = self.subjects.node(&routing.node);
        let responder =
            NodeResponder::start(self.client.clone(), subject.clone(), routing.table.clone())
                .await
                .map_err(|e| HostError::NodeSubject {
                    subject,
                    reason: e.to_string(),
                })?;
        self.node_responder = Some(responder);
        Ok(())
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
        self.start_node_subject().await?;
        let actors = spawn_shard(self.shard_config.clone(), tenants, None)
            .await
            .map_err(|e| HostError::Actor {
                shard,
                reason: e.to_string(),
            })?;
        // The responder hands hits and settles to the tenants; the host only
        // talks to the shard's actor.
        let actor = actors.actor().clone();
        let ctx = ShardContext {
            shard,
            shards: self.shards,
            subject: self.subjects.shard(shard),
            actors,
            persistence: self.persistence.clone(),
            window,
            routing: self.routing.clone(),
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

    /// Stops serving `shard`: its responder first (answering what it was
    /// sent, for at most a grace of 2 s), then its actors. Its state needs
    /// no handing back: every answered change is in KV, or goes with the
    /// next bucket flush, and standalone mode keeps nothing.
    pub async fn release(&mut self, shard: u32) {
        let Some(served) = self.served.remove(&shard) else {
            return;
        };
        metrics::gauge!("ankusa_shards_owned").set(self.served.len() as f64);
        served.responder.stop(RELEASE_GRACE).await;
        served.actor.stop(None);
    }

    /// Stops serving `shards`, whose leases lapsed, all at once, keeping
    /// nothing: their windows are closed, so what their responders still have
    /// in flight answers `unavailable`. Their graces run together: when the
    /// leases lapsed because NATS is out of reach, no answer can leave, and one
    /// after another each shard waited out its whole grace.
    pub async fn drop_lapsed(&mut self, shards: &[u32]) {
        let lapsed: Vec<Served> = shards
            .iter()
            .filter_map(|shard| self.served.remove(shard))
            .collect();
        metrics::gauge!("ankusa_shards_owned").set(self.served.len() as f64);
        futures::future::join_all(lapsed.into_iter().map(|served| async move {
            served.responder.stop(RELEASE_GRACE).await;
            served.actor.stop(None);
        }))
        .await;
    }

    /// Releases every shard, one after another, dropping their state (standalone
    /// mode keeps nothing; fleet mode hands shards back one by one instead).
    pub async fn release_all(&mut self) {
        for shard in self.serving() {
            self.release(shard).await;
        }
        if let Some(responder) = self.node_responder.take() {
            responder.stop(RELEASE_GRACE).await;
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
        // All shards at once, so that the ownership loop, which asks between
        // its renewals, waits a second at most however many shards are slow.
        let asked = self
            .served
            .values()
            .map(|served| served.actor.call(ShardMsg::Stats, Some(STATS_WAIT)));
        let mut total = ShardStats::default();
        for answer in futures::future::join_all(asked).await {
            if let Ok(CallResult::Success(s)) = answer {
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
