//! Fleet mode: which shards this node serves, agreed with the other nodes of the
//! instance through JetStream KV, and kept durable there.
//!
//! Every `lease_renew_ms` a node renews the leases it holds, heartbeats, reads
//! the live nodes (kept by [`Membership`] from a watch of the heartbeats), and
//! computes each shard's target owner by rendezvous (highest random weight)
//! hashing, so a node joining takes about S/N shards and one leaving spreads its
//! shards over the rest; nothing else moves. It hands back the
//! shards now targeted elsewhere (stop answering, finish in-flight answers, flush,
//! release), and takes the shards targeted to it once free: lease first, then the
//! shard's claims and buckets from KV, and only then answers.
//!
//! A lease is valid for this node until `renewal sent + TTL − margin` by its own
//! monotonic clock. The server keeps the lease at least TTL after it received
//! the renewal, so this node stops answering before anyone else can start.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use ankusa_actors::actor::{ShardConfig, TenantFailure};
use ankusa_actors::{AnchoredClock, TenantSnapshot};
use ankusa_bus::claimlog;
use ankusa_bus::kv::{within, FleetKv, Heartbeat, KvError, KvWriter, LeaseError};
use ankusa_bus::persist::Persistence;
use ankusa_bus::responder::ServeWindow;
use ankusa_bus::shard::ranges;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::config::NodeConfig;
use crate::health::Health;
use crate::host::ShardHost;
use crate::membership::Membership;
use crate::run::{export_stats, shard_config, SHARD_TICK, STATS_EVERY};
use crate::time::{Reading, TimeKeeper};

/// Why fleet mode stopped.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error(transparent)]
    Host(#[from] crate::host::HostError),
    /// Another live process has this node's id and started first: this one
    /// left the fleet. A configuration error (exit status 2).
    #[error(
        "another live process has node_id `{node_id}` (started at {elder_started_ms} ms \
         since the epoch, before this one); this one left the fleet: give every node \
         its own node_id"
    )]
    TwinNodeId {
        node_id: String,
        elder_started_ms: u64,
    },
}

/// The rendezvous weight of `node` for `shard`.
fn weight(node: &str, shard: u32) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    hasher.update(node.as_bytes());
    hasher.update(&shard.to_le_bytes());
    hasher.digest()
}

/// The node that should own `shard` among `nodes` (highest weight, ties by name).
pub fn target_owner(nodes: &BTreeSet<String>, shard: u32) -> Option<&str> {
    nodes
        .iter()
        .max_by(|a, b| {
            weight(a, shard)
                .cmp(&weight(b, shard))
                .then_with(|| b.cmp(a))
        })
        .map(String::as_str)
}

/// Until when this node may answer for a lease taken or renewed by a request
/// sent at `sent`: the server keeps it at least the TTL from receipt, and the
/// margin covers clock drift between the two.
fn lease_valid_until(config: &NodeConfig, sent: Instant) -> std::time::Instant {
    let keep = config
        .lease_ttl()
        .saturating_sub(Duration::from_millis(config.lease_margin_ms));
    (sent + keep).into_std()
}

/// How long a lease renewal waits for its ack: half of what a lease's
/// validity leaves after the round that sends it is due. A renewal whose ack
/// is lost (the connection dropped and came back) then fails in time for the
/// next round, which starts at once, to renew again while the lease still
/// holds; waiting a whole TTL let every lease of the node lapse over one lost
/// ack.
fn renewal_wait(config: &NodeConfig) -> Duration {
    let slack = config.lease_ttl().saturating_sub(Duration::from_millis(
        config.lease_margin_ms.saturating_add(config.lease_renew_ms),
    ));
    slack / 2
}

/// The longest a graceful leave may take: three lease TTLs, and at least 10 s.
/// A healthy leave hands a shard back in about 100 ms.
fn leave_bound(config: &NodeConfig) -> Duration {
    (3 * config.lease_ttl()).max(Duration::from_secs(10))
}

/// How long every load of a node that serves no shard may fail before it
/// steps aside, and how long it stays aside before a trial load: three lease
/// TTLs, and at least 10 s.
fn step_aside_after(config: &NodeConfig) -> Duration {
    (3 * config.lease_ttl()).max(Duration::from_secs(10))
}

/// The most a round's step other than a load takes (a load shows its progress
/// to the health check as it goes).
const STEP_BOUND: Duration = Duration::from_secs(30);

/// A lease this node holds.
struct Held {
    revision: u64,
    window: ServeWindow,
}

struct Fleet {
    config: NodeConfig,
    kv: FleetKv,
    writer: Arc<KvWriter>,
    host: ShardHost,
    held: BTreeMap<u32, Held>,
    live: BTreeSet<String>,
    /// Shards whose leases this node's life before a restart holds, until
    /// they lapse: not asked for again before then.
    lapsing: BTreeMap<u32, Instant>,
    /// Since when every shard load has failed (none succeeded since), and
    /// when the last one failed.
    loads_failing: Option<(Instant, Instant)>,
    /// While set, the node has stepped aside: out of the live nodes, holding
    /// nothing, until this instant brings a trial load.
    aside_until: Option<Instant>,
    membership: Membership,
    health: Arc<Health>,
    started_ms: u64,
    /// When the held leases were last renewed.
    last_renew: Instant,
    time: TimeKeeper,
}

/// Pause between attempts to take a shard that is still held elsewhere.
const ACQUIRE_RETRY: Duration = Duration::from_millis(100);

/// Lease takes sent together once a round's first has gone through. One at a
/// time, a node whose 1,024 leases had lapsed in a nats-server pause took
/// 0.24–0.35 s to serve them all again after it; in waves, 0.10–0.16 s.
const TAKES_AT_ONCE: usize = 64;

impl Fleet {
    fn me(&self) -> &str {
        &self.config.node_id
    }

    fn targets(&self) -> Vec<u32> {
        (0..self.config.shards)
            .filter(|&s| target_owner(&self.live, s) == Some(self.me()))
            .collect()
    }

    /// Writes this node's heartbeat, reading the server's time from its ack;
    /// whether it was written.
    async fn beat(&mut self) -> bool {
        let beat = Heartbeat {
            node: self.config.node_id.clone(),
            started_ms: self.started_ms,
            http: self.config.http_addr.map(|a| a.to_string()),
            claim_log_format: claimlog::NODE_LOG_FORMAT,
            incarnation: self.kv.incarnation(),
            shards: self.config.shards,
            serving: self.held.len() as u32,
            ttl_ms: self.config.lease_ttl_ms,
        };
        // No longer than a renewal waits, so that the next round renews in time.
        let bound = renewal_wait(&self.config);
        let sent_us = self.time.now_us();
        let beat = within(bound, self.kv.heartbeat(&beat, self.config.lease_ttl())).await;
        match beat {
            Ok(revision) => {
                self.read_time(revision, sent_us).await;
                true
            }
            Err(err) => {
                metrics::counter!("ankusa_heartbeat_failures_total").increment(1);
                tracing::warn!(error = %err, "heartbeat failed");
                false
            }
        }
    }

    /// Heartbeats, then brings the view of the live nodes up to date.
    async fn heartbeat(&mut self) {
        let beaten = self.beat().await;
        let bound = renewal_wait(&self.config);
        let nodes = match self.membership.live(self.config.lease_ttl()) {
            Some(nodes) => Ok(nodes),
            // The listing reads the bucket the heartbeat could not write: in an
            // outage it would wait out its bound too, every round. Keep the
            // last view.
            None if !beaten => return,
            None => {
                self.renew_if_due().await;
                metrics::counter!("ankusa_membership_listings_total").increment(1);
                within(bound, self.kv.live_nodes()).await
            }
        };
        match nodes {
            Ok(nodes) => {
                let node_log = Heartbeat::all_read_node_log(&nodes);
                let format = if node_log {
                    claimlog::NODE_LOG_FORMAT
                } else {
                    claimlog::GROUP_LOG_FORMAT
                };
                metrics::gauge!("ankusa_claim_log_format").set(f64::from(format));
                if self.writer.write_node_log(node_log) != node_log {
                    tracing::info!(
                        node_log,
                        "claim changes go to {}",
                        if node_log {
                            "this node's log: every live node reads it"
                        } else {
                            "the group logs: a live node does not read the node log"
                        }
                    );
                }
                let mut live: BTreeSet<String> = nodes.into_iter().map(|b| b.node).collect();
                live.insert(self.config.node_id.clone());
                if live != self.live {
                    tracing::info!(nodes = ?live, "live nodes changed");
                }
                self.live = live;
            }
            Err(err) => {
                tracing::warn!(error = %err, "cannot list live nodes; keeping the last view")
            }
        }
    }

    /// Reads back when the server stored the heartbeat written at `sent_us`
    /// (revision `revision`), and keeps the node's clock by it.
    async fn read_time(&mut self, revision: u64, sent_us: u64) {
        // A reading that waits longer says little (its span is its
        // uncertainty), and the renewals wait behind it.
        let bound = Duration::from_millis(self.config.lease_renew_ms);
        match within(bound, self.kv.heartbeat_stored_at(revision)).await {
            Ok(server_us) => {
                let reading = Reading {
                    sent_us,
                    server_us,
                    read_us: self.time.now_us(),
                };
                let serving = !self.held.is_empty();
                self.time.take(reading, serving, Instant::now());
            }
            Err(err) => self.time.unreadable(&err),
        }
    }

    async fn renew(&mut self) {
        self.last_renew = Instant::now();
        let ttl = self.config.lease_ttl();
        let wait = renewal_wait(&self.config);
        // All at once: one after another, a round with NATS out of reach would
        // wait out every shard's bound in turn.
        let renewals = self.held.iter().map(|(&shard, held)| {
            let sent = Instant::now();
            let renewal = self
                .kv
                .renew_lease(shard, &self.config.node_id, held.revision, ttl);
            async move { (shard, sent, within(wait, renewal).await) }
        });
        let renewed = futures::future::join_all(renewals).await;
        let mut lost = Vec::new();
        let mut failed = Vec::new();
        let mut first_error = None;
        for (shard, sent, result) in renewed {
            let Some(held) = self.held.get_mut(&shard) else {
                continue;
            };
            match result {
                Ok(revision) => {
                    held.revision = revision;
                    held.window.extend_to(lease_valid_until(&self.config, sent));
                }
                Err(LeaseError::Lost { .. }) | Err(LeaseError::Taken { .. }) => {
                    held.window.close();
                    lost.push(shard);
                }
                Err(LeaseError::Kv(err)) => {
                    metrics::counter!("ankusa_lease_renew_failures_total").increment(1);
                    failed.push(shard);
                    first_error.get_or_insert(err);
                    if !held.window.is_open() {
                        lost.push(shard);
                    }
                }
            }
        }
        // One line a round, not one a shard: with 1,024 shards, an outage
        // wrote 1,024 warnings a second.
        if let Some(error) = first_error {
            tracing::warn!(
                failed = failed.len(),
                shards = %ranges(&failed),
                %error,
                "lease renewals failed; serving until the leases lapse"
            );
        }
        for &shard in &lost {
            metrics::counter!("ankusa_leases_lost_total").increment(1);
            self.held.remove(&shard);
        }
        if !lost.is_empty() {
            tracing::warn!(
                lost = lost.len(),
                shards = %ranges(&lost),
                "leases lost; no longer serving the shards"
            );
        }
        self.host.drop_lapsed(&lost).await;
        self.writer.stop_writing(&lost);
    }

    /// Renews the leases if a renewal period has passed since the last: called
    /// between the steps of a round, each bounded but together longer than a
    /// lease's serve window when JetStream is slow.
    async fn renew_if_due(&mut self) {
        if self.last_renew.elapsed() >= Duration::from_millis(self.config.lease_renew_ms) {
            self.renew().await;
        }
    }

    /// Hands a shard back: stop taking requests, finish those in flight, flush its
    /// buckets, then release the lease so the next owner can start.
    async fn hand_back(&mut self, shard: u32) {
        let Some(held) = self.held.remove(&shard) else {
            return;
        };
        let started = Instant::now();
        self.renew_if_due().await;
        self.host.release(shard).await;
        self.renew_if_due().await;
        self.writer.flush_buckets(Some(shard)).await;
        self.writer.stop_writing(&[shard]);
        held.window.close();
        self.renew_if_due().await;
        let release = self
            .kv
            .release_lease(shard, &self.config.node_id, held.revision);
        if let Err(err) = within(renewal_wait(&self.config), release).await {
            tracing::warn!(shard, error = %err, "lease release failed; it will lapse by TTL");
        }
        tracing::debug!(
            shard,
            took_ms = started.elapsed().as_millis() as u64,
            "shard handed back"
        );
    }

    /// Hands `shards` back one after another (each waits for its answers in
    /// flight and its flush), and says so in one line.
    async fn hand_back_each(&mut self, shards: Vec<u32>) {
        if shards.is_empty() {
            return;
        }
        let started = Instant::now();
        for &shard in &shards {
            self.hand_back(shard).await;
        }
        tracing::info!(
            count = shards.len(),
            shards = %ranges(&shards),
            took_ms = started.elapsed().as_millis() as u64,
            "shards handed back"
        );
    }

    /// Takes every shard targeted here that is free: their leases first, then
    /// their state from KV in one read (a log message holding changes of
    /// several is read once), then serves them. Returns whether to try again
    /// before the next round: some target shard is still held elsewhere, and
    /// KV takes lease writes.
    async fn acquire(&mut self) -> bool {
        if !self.time.is_set() {
            // A shard is served by the NATS server's time, which the next
            // heartbeat reads.
            return true;
        }
        let mut waiting = false;
        let mut kv_failing = false;
        let ttl = self.config.lease_ttl();
        let mut taken = Vec::new();
        let now = Instant::now();
        self.lapsing.retain(|_, at| *at > now);
        let free: Vec<u32> = self
            .targets()
            .into_iter()
            .filter(|shard| !self.held.contains_key(shard))
            .filter(|shard| {
                let lapsing = self.lapsing.contains_key(shard);
                waiting |= lapsing;
                !lapsing
            })
            .collect();
        // The first write goes alone: while JetStream takes no writes, a
        // round costs one. Once it is through, the rest go in waves.
        let mut wave = 1;
        let mut tried = 0;
        // As long as a renewal waits: a take whose ack was lost (a reconnect)
        // must not hold back the renewals of the leases already held. The
        // next round takes over the lease at its own unacknowledged write.
        let take_wait = renewal_wait(&self.config);
        while tried < free.len() && !kv_failing {
            self.renew_if_due().await;
            let shards = &free[tried..free.len().min(tried + wave)];
            tried += shards.len();
            wave = TAKES_AT_ONCE;
            let takes = shards.iter().map(|&shard| {
                let sent = Instant::now();
                let take = self.kv.acquire_lease(shard, &self.config.node_id, ttl);
                async move { (shard, sent, within(take_wait, take).await) }
            });
            for (shard, sent, result) in futures::future::join_all(takes).await {
                let revision = match result {
                    Ok(revision) => revision,
                    Err(LeaseError::Taken {
                        holder, lapses_in, ..
                    }) => {
                        waiting = true;
                        metrics::counter!("ankusa_lease_takes_refused_total").increment(1);
                        // This node's life before a restart hands nothing
                        // back: its lease is waited out. Asking every 100 ms
                        // was two KV operations a shard, 10 times a second
                        // for up to a TTL, after every restart. Another
                        // holder is asked again at the next try: a node
                        // leaving, already gone from the live nodes, releases
                        // its shards within a moment, and its lease may
                        // have seconds to run.
                        if holder == self.config.node_id {
                            if let Some(lapses_in) = lapses_in {
                                self.lapsing.insert(shard, sent + lapses_in.min(ttl));
                            }
                        }
                        continue;
                    }
                    Err(err) => {
                        // JetStream did not take the write, so the other shards'
                        // would fail alike, at once (a stream without a leader
                        // answers "no responders") or each after its bound (NATS
                        // out of reach). Trying them all was a write and a
                        // warning per shard every 100 ms, and a round that
                        // outlasted its health bound; the next round tries again.
                        if !kv_failing {
                            tracing::warn!(
                                shard,
                                untried = free.len() - tried,
                                error = %err,
                                "cannot take lease; the next round tries again"
                            );
                        }
                        metrics::counter!("ankusa_lease_acquire_failures_total").increment(1);
                        kv_failing = true;
                        continue;
                    }
                };
                // Held from here, so that renewals keep the lease while it loads;
                // nothing answers for it until it is served.
                let window = ServeWindow::closed();
                window.extend_to(lease_valid_until(&self.config, sent));
                self.writer.start_writing(shard, window.clone());
                self.held.insert(shard, Held { revision, window });
                taken.push(shard);
            }
        }
        if taken.is_empty() {
            return waiting && !kv_failing;
        }

        let loaded_at = Instant::now();
        let loaded = self.load_renewing(&taken).await;
        let load_ms = loaded_at.elapsed().as_millis() as u64;
        let mut served = Vec::with_capacity(taken.len());
        let (mut tenants_loaded, mut claims_loaded) = (0, 0);
        let mut states = match loaded {
            Ok(states) => {
                self.loads_failing = None;
                states
            }
            Err(err) => {
                let now = Instant::now();
                let since = self.loads_failing.map_or(now, |(since, _)| since);
                self.loads_failing = Some((since, now));
                tracing::error!(shards = ?taken, error = %err, "cannot load shards; giving the leases back");
                for shard in taken {
                    self.drop_lease(shard).await;
                }
                return true;
            }
        };
        for shard in taken {
            // A lease lost while loading was dropped by the renewal.
            let Some(window) = self.held.get(&shard).map(|h| h.window.clone()) else {
                waiting = true;
                continue;
            };
            let state = states.remove(&shard).unwrap_or_default();
            let tenants = state.len();
            let claims: usize = state.iter().map(|t| t.claims.len()).sum();
            if let Err(err) = self.host.serve(shard, state, Some(window)).await {
                tracing::error!(shard, error = %err, "cannot serve shard; giving the lease back");
                self.drop_lease(shard).await;
                waiting = true;
                continue;
            }
            metrics::histogram!("ankusa_shard_load_seconds").record(load_ms as f64 / 1000.0);
            tracing::debug!(shard, tenants, claims, load_ms, "serving shard");
            served.push(shard);
            tenants_loaded += tenants;
            claims_loaded += claims;
        }
        if !served.is_empty() {
            tracing::info!(
                count = served.len(),
                shards = %ranges(&served),
                tenants = tenants_loaded,
                claims = claims_loaded,
                load_ms,
                "serving shards"
            );
        }
        waiting && !kv_failing
    }

    /// Loads `shards` from KV (within the bound the bucket's size gives it,
    /// [`ankusa_bus::kv::load_bound`]), renewing the held leases and the
    /// heartbeat meanwhile: a load may take longer than a lease.
    async fn load_renewing(
        &mut self,
        shards: &[u32],
    ) -> Result<HashMap<u32, Vec<TenantSnapshot>>, KvError> {
        let renew_every = Duration::from_millis(self.config.lease_renew_ms);
        let kv = self.kv.clone();
        let load = kv.load_shards(shards);
        tokio::pin!(load);
        loop {
            tokio::select! {
                loaded = &mut load => return loaded,
                _ = tokio::time::sleep(renew_every) => {
                    // The heartbeat too: a load longer than a TTL would
                    // otherwise have the other nodes count this one gone.
                    self.renew().await;
                    self.beat().await;
                    // A long load is the loop at work, not stuck.
                    self.health.round_done(self.round_stall_bound());
                }
            }
        }
    }

    /// Stops holding `shard` and releases its lease, without a hand-back (it
    /// is not being served: not yet, or its actor failed).
    async fn drop_lease(&mut self, shard: u32) {
        if let Some(held) = self.held.remove(&shard) {
            self.writer.stop_writing(&[shard]);
            held.window.close();
            let _ = within(
                renewal_wait(&self.config),
                self.kv
                    .release_lease(shard, &self.config.node_id, held.revision),
            )
            .await;
        }
    }

    /// How long the loop may go without finishing a round (or showing a
    /// load's progress) before it counts as stuck.
    fn round_stall_bound(&self) -> Duration {
        3 * self.config.lease_ttl() + 2 * STEP_BOUND
    }

    /// Steps aside when this node holds no shard, its loads have failed for
    /// [`step_aside_after`] (the last one lately), and another live node
    /// serves shards; or tries a load when its time aside is up. Says
    /// whether the node is aside (and the round is to go no further).
    ///
    /// Rendezvous hashing gives a live node its shards whatever it can do
    /// with them: a node that heartbeats but cannot load (its NATS user
    /// may not read the state bucket, say) would keep its targets unserved
    /// for good. Aside, it is not a live node, and the others serve them. A
    /// node that serves shards never steps aside, nor one whose peers serve
    /// none: when loads fail for every node (a JetStream outage, a cold
    /// start), stepping aside would only add to the wait.
    async fn step_aside_if_failing(&mut self) -> bool {
        let now = Instant::now();
        if let Some(until) = self.aside_until {
            if now < until {
                self.health.round_done(self.round_stall_bound());
                return true;
            }
            // A trial load, of one shard, holding no lease: the whole bucket
            // is read as by any load (which the health check is told of, as
            // a round that is under way).
            self.health.round_done(self.round_stall_bound());
            match self.kv.load_shards(&[0]).await {
                Ok(_) => {
                    tracing::info!("a trial load succeeded; back among the live nodes");
                    self.aside_until = None;
                    self.loads_failing = None;
                    self.health.set_aside(false);
                    return false;
                }
                Err(err) => {
                    tracing::warn!(error = %err, "a trial load failed; staying aside");
                    self.aside_until = Some(Instant::now() + step_aside_after(&self.config));
                    return true;
                }
            }
        }
        let after = step_aside_after(&self.config);
        let Some((since, last)) = self.loads_failing else {
            return false;
        };
        // A node serving shards, or whose last failed load is old news (its
        // targets moved away since), forgets the failures.
        if !self.held.is_empty() || now - last > after {
            self.loads_failing = None;
            return false;
        }
        let me = self.me();
        let others_serve = self
            .membership
            .live(self.config.lease_ttl())
            .is_some_and(|beats| beats.iter().any(|b| b.node != me && b.serving > 0));
        if now - since < after || !others_serve {
            return false;
        }
        tracing::error!(
            failing_ms = (now - since).as_millis() as u64,
            "every shard load has failed for this long, and this node serves no shard: it \
             steps aside (out of the live nodes, so that the others serve its shards) and \
             tries a load again from time to time; see the load errors above"
        );
        metrics::counter!("ankusa_steps_aside_total").increment(1);
        self.health.set_aside(true);
        self.hand_back_all(true).await;
        self.aside_until = Some(Instant::now() + step_aside_after(&self.config));
        self.health.round_done(self.round_stall_bound());
        true
    }

    /// One full round: renew, heartbeat, hand back, take.
    async fn round(&mut self) -> bool {
        if self.step_aside_if_failing().await {
            return false;
        }
        // Renewals first, at the round's start: a heartbeat whose ack was
        // lost would otherwise hold them back until the leases lapse.
        self.renew().await;
        self.heartbeat().await;
        let targets: BTreeSet<u32> = self.targets().into_iter().collect();
        let moving: Vec<u32> = self
            .held
            .keys()
            .filter(|s| !targets.contains(s))
            .copied()
            .collect();
        self.hand_back_each(moving).await;
        let waiting = self.acquire().await;
        self.health.set_shards(self.held.len(), targets.len());
        // A round is bounded (every KV call in it is); several missed in a row
        // mean the loop is stuck.
        self.health.round_done(self.round_stall_bound());
        waiting
    }

    /// Restarts every shard whose actor failed, from its state in KV (claims are
    /// written there before they are answered, so none is lost).
    ///
    /// The reload gets a window of its own: an answer of the failed actor still
    /// waiting for its write after the release's grace would otherwise go out
    /// after a reload that did not see its claim, and a second hook on the same
    /// key would be accepted too. Under the old window it goes silent instead.
    async fn restart_failed(&mut self) {
        for shard in self.host.failed() {
            self.renew_if_due().await;
            if !self.held.contains_key(&shard) {
                continue;
            }
            tracing::error!(shard, "shard actor failed; reloading it from KV");
            metrics::counter!("ankusa_shard_restarts_total").increment(1);
            self.host.release(shard).await;
            let Some(held) = self.held.get_mut(&shard) else {
                continue;
            };
            held.window = held.window.close_into_successor();
            let window = held.window.clone();
            self.writer.start_writing(shard, window.clone());
            self.writer.flush_buckets(Some(shard)).await;
            let restarted = match self.load_renewing(&[shard]).await {
                // A lease lost while loading was dropped by the renewal.
                Ok(_) if !self.held.contains_key(&shard) => continue,
                Ok(mut state) => self
                    .host
                    .serve(
                        shard,
                        state.remove(&shard).unwrap_or_default(),
                        Some(window),
                    )
                    .await
                    .map_err(|e| e.to_string()),
                Err(err) => Err(err.to_string()),
            };
            if let Err(err) = restarted {
                tracing::error!(shard, error = %err, "cannot restart shard; handing it back");
                self.drop_lease(shard).await;
            }
        }
    }

    /// Leaves the fleet: withdraws the heartbeat (unless it is a twin's too)
    /// and hands every shard back, within [`leave_bound`]. With NATS out of
    /// reach each KV call would wait out its own bound, one shard after
    /// another; past the bound, the shards not yet handed back stop answering
    /// and their leases lapse by TTL, as after a crash, and the node exits all
    /// the same.
    async fn leave(&mut self, withdraw_heartbeat: bool) {
        self.health.set_shutting_down();
        let bound = leave_bound(&self.config);
        if tokio::time::timeout(bound, self.hand_back_all(withdraw_heartbeat))
            .await
            .is_err()
        {
            for held in self.held.values() {
                held.window.close();
            }
            tracing::warn!(
                shards = self.held.len(),
                bound_ms = bound.as_millis() as u64,
                "leaving took longer than its bound; the shards not handed back stop answering and their leases lapse by TTL"
            );
        }
    }

    async fn hand_back_all(&mut self, withdraw_heartbeat: bool) {
        if withdraw_heartbeat {
            let left = within(self.config.lease_ttl(), self.kv.leave(&self.config.node_id));
            if let Err(err) = left.await {
                tracing::warn!(error = %err, "could not withdraw heartbeat");
            }
        }
        let shards: Vec<u32> = self.held.keys().copied().collect();
        self.hand_back_each(shards).await;
        self.writer.flush_buckets(None).await;
    }
}

/// Opens the instance's KV buckets, retrying until NATS answers or shutdown.
async fn open_kv(
    config: &NodeConfig,
    client: &async_nats::Client,
    shutdown: &mut (impl Future<Output = ()> + Unpin),
) -> Option<FleetKv> {
    let mut pause = Duration::from_millis(100);
    loop {
        // A fresh cluster may take a while to place replicated buckets; bound each
        // attempt so the node keeps saying what it waits for.
        let attempt = FleetKv::open(client.clone(), &config.instance, config.kv_replicas);
        match tokio::time::timeout(Duration::from_secs(5), attempt).await {
            Ok(Ok(kv)) => return Some(kv),
            Ok(Err(err)) => {
                tracing::warn!(error = %err, "JetStream KV not reachable yet; retrying")
            }
            Err(_) => tracing::warn!("opening the KV buckets took over 5 s; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = &mut *shutdown => return None,
        }
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

pub async fn run(
    config: NodeConfig,
    client: async_nats::Client,
    health: Arc<Health>,
    shutdown: impl Future<Output = ()>,
    clock: Arc<AnchoredClock>,
) -> Result<(), FleetError> {
    tokio::pin!(shutdown);
    let Some(kv) = open_kv(&config, &client, &mut shutdown).await else {
        return Ok(());
    };
    let kv = kv.with_clock(clock.clone());
    let writer = KvWriter::start(kv.clone(), Duration::from_millis(config.write_behind_ms));
    let host = ShardHost::new(
        client,
        config.subjects(),
        config.shards,
        ShardConfig {
            // KV holds every answered claim: a failed tenant is reloaded with its shard.
            on_tenant_failure: TenantFailure::Escalate,
            ..shard_config(&config, clock.clone())
        },
        Persistence::Kv(writer.clone()),
    )
    .with_node_subject(&config.node_id);
    // Wakes the ownership loop whenever the set of live nodes changes (a
    // join, a graceful leave, or a heartbeat lapsing), so it is acted on at
    // once rather than at the next round.
    let wake = Arc::new(Notify::new());
    let started_ms = ankusa_bus::kv::now_unix_ms();
    let membership = Membership::watch(
        kv.clone(),
        &config.node_id,
        started_ms,
        config.lease_ttl(),
        wake.clone(),
    );
    let renew_every = Duration::from_millis(config.lease_renew_ms);
    // How long a stop waits for the round under way.
    let finish_grace = config.lease_ttl();
    let stopping_health = health.clone();
    let mut fleet = Fleet {
        started_ms,
        last_renew: Instant::now(),
        config,
        kv,
        writer,
        host,
        held: BTreeMap::new(),
        live: BTreeSet::new(),
        lapsing: BTreeMap::new(),
        loads_failing: None,
        aside_until: None,
        membership,
        health,
        time: TimeKeeper::new(clock),
    };
    let mut next_round = Instant::now();
    let mut next_stats = Instant::now();
    let mut next_tick = Instant::now();
    let mut next_acquire = Instant::now();
    let mut waiting = false;
    loop {
        let now = Instant::now();
        // A round with NATS out of reach waits out a KV bound for its heartbeat,
        // its renewals and its first lease write; a stop waits for it one lease
        // TTL at most. What a round cut short leaves half done (a lease taken
        // but not yet served) lapses by TTL.
        let stopping = {
            let work = async {
                if now >= next_round {
                    waiting = fleet.round().await;
                    // From the round's start: a round that waited out a
                    // lost ack is followed at once by the next, which
                    // renews again while the leases still hold.
                    next_round = now + renew_every;
                    next_acquire = Instant::now() + ACQUIRE_RETRY;
                } else if waiting && now >= next_acquire {
                    waiting = fleet.acquire().await;
                    next_acquire = Instant::now() + ACQUIRE_RETRY;
                    fleet
                        .health
                        .set_shards(fleet.held.len(), fleet.targets().len());
                }
                if now >= next_tick {
                    fleet.host.tick();
                    next_tick = now + SHARD_TICK;
                }
                if now >= next_stats {
                    fleet.restart_failed().await;
                    export_stats(&fleet.host).await;
                    next_stats = now + STATS_EVERY;
                }
            };
            tokio::pin!(work);
            tokio::select! {
                _ = &mut work => false,
                _ = &mut shutdown => {
                    // Not ready from the signal on, while the step under way
                    // finishes: a load balancer stops sending here first.
                    stopping_health.set_shutting_down();
                    let _ = tokio::time::timeout(finish_grace, &mut work).await;
                    true
                }
            }
        };
        if stopping {
            break;
        }
        if let Some(elder) = fleet.membership.yield_to() {
            // The heartbeat key is the elder's too: left as it is.
            fleet.leave(false).await;
            return Err(FleetError::TwinNodeId {
                node_id: fleet.config.node_id.clone(),
                elder_started_ms: elder.started_ms,
            });
        }
        let wake_at = if waiting {
            next_acquire.min(next_round)
        } else {
            next_round
        };
        tokio::select! {
            _ = tokio::time::sleep_until(wake_at.min(next_tick).min(next_stats)) => {}
            _ = wake.notified() => next_round = Instant::now(),
            _ = &mut shutdown => break,
        }
    }
    fleet.leave(true).await;
    tracing::info!("node left the fleet");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize) -> BTreeSet<String> {
        (0..n).map(|i| format!("node-{i}")).collect()
    }

    #[test]
    fn a_renewal_gives_up_in_time_for_the_next_round_to_keep_the_lease() {
        for (ttl, margin, renew) in [(5_000, 1_000, 1_000), (2_000, 500, 400), (3_000, 0, 2_999)] {
            let config = NodeConfig {
                lease_ttl_ms: ttl,
                lease_margin_ms: margin,
                lease_renew_ms: renew,
                ..NodeConfig::default()
            };
            let wait = renewal_wait(&config);
            // The round after the last good renewal starts `renew` later and
            // gives up `wait` after that; the retry must leave the lease valid.
            assert!(!wait.is_zero());
            assert!(
                Duration::from_millis(renew) + wait < Duration::from_millis(ttl - margin),
                "{ttl}/{margin}/{renew}: waits {wait:?}"
            );
        }
        let defaults = NodeConfig::default();
        assert_eq!(renewal_wait(&defaults), Duration::from_millis(1_500));
    }

    #[test]
    fn adding_a_node_moves_about_s_over_n_shards_and_only_to_it() {
        let shards = 256;
        let before = nodes(3);
        let mut after = before.clone();
        after.insert("node-new".into());
        let mut moved = 0;
        for s in 0..shards {
            let (a, b) = (
                target_owner(&before, s).unwrap(),
                target_owner(&after, s).unwrap(),
            );
            if a != b {
                assert_eq!(b, "node-new", "shard {s} moved between old nodes");
                moved += 1;
            }
        }
        // Expect S/N = 64; allow the spread of a hash.
        assert!((40..=90).contains(&moved), "{moved} shards moved");
    }

    #[test]
    fn removing_a_node_moves_only_its_shards() {
        let before = nodes(4);
        let mut after = before.clone();
        after.remove("node-2");
        for s in 0..256 {
            let a = target_owner(&before, s).unwrap();
            let b = target_owner(&after, s).unwrap();
            if a != "node-2" {
                assert_eq!(a, b);
            }
        }
    }

    #[test]
    fn every_shard_has_an_owner() {
        for n in 1..6 {
            let live = nodes(n);
            assert!((0..64).all(|s| target_owner(&live, s).is_some()));
        }
        assert!(target_owner(&BTreeSet::new(), 0).is_none());
    }
}
