//! The live nodes of the instance, kept from one watch of their heartbeats.
//!
//! Every ownership round needs the live nodes. Listing them from KV makes a
//! JetStream consumer each time, on every node, every round, each left for the
//! server to reap (tens per node at any moment, and in a clustered JetStream
//! each one a proposal to the meta leader). A watch is one consumer for the
//! node's life: [`Membership`] keeps what it delivers, and a round lists only
//! while the watch cannot be trusted (before it has caught up, or when this
//! node's own heartbeats stop coming back through it).
//!
//! The same watch tells when another live process has this node's id: its
//! heartbeats keep coming, for a heartbeat's lifetime, after this process's
//! own came back (one or a burst of them may be a dead process's writes that
//! a paused server stored late). Of two such twins the one started later
//! steps down ([`Membership::yield_to`]), so that a mistaken second start
//! leaves the first serving.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ankusa_bus::kv::{FleetKv, Heartbeat, KvError, NodeChange, NodeEvent};
use ankusa_bus::lock;
use futures::StreamExt;
use tokio::sync::Notify;
use tokio::time::Instant;

/// The heartbeats a watch has delivered, each with when it came.
#[derive(Debug)]
struct View {
    me: String,
    /// This process's [`FleetKv::incarnation`].
    incarnation: u64,
    /// When this process started (its heartbeats' `started_ms`).
    started_ms: u64,
    /// A heartbeat's lifetime: how long another process's heartbeats must
    /// keep coming for it to be a twin.
    ttl: Duration,
    beats: BTreeMap<String, (Heartbeat, Instant)>,
    caught_up: bool,
    /// Whether a heartbeat of this process has come back through the watch.
    /// Before, one of this node's id from another process is a life before a
    /// restart; after, it is a live twin.
    heard_myself: bool,
    /// The twins already reported, so that each is logged once.
    twins: Vec<u64>,
    /// When each other process of this id was first heard after this one.
    heard_others: BTreeMap<u64, Instant>,
    /// A twin started before this process, which this one steps down for.
    elder: Option<Heartbeat>,
}

impl View {
    fn new(me: String, incarnation: u64, started_ms: u64, ttl: Duration) -> Self {
        Self {
            me,
            incarnation,
            started_ms,
            ttl,
            heard_others: BTreeMap::new(),
            beats: BTreeMap::new(),
            caught_up: false,
            heard_myself: false,
            twins: Vec::new(),
            elder: None,
        }
    }

    /// Takes in one event; says whether the set of nodes changed, or this
    /// process is to step down for a twin.
    fn apply(&mut self, event: NodeEvent, at: Instant) -> bool {
        self.caught_up |= event.caught_up;
        match event.change {
            NodeChange::Beat(beat) => {
                let stepping_down = beat.node == self.me && self.check_twin(&beat, at);
                self.beats.insert(beat.node.clone(), (beat, at)).is_none() || stepping_down
            }
            NodeChange::Gone(node) => self.beats.remove(&node).is_some(),
        }
    }

    /// Reports a heartbeat of this node's id written by another live
    /// process, and says whether this process is to step down for it (it
    /// started later). Two processes under one id take and serve one node's
    /// shards between them, each unaware, while the fleet counts them as one
    /// node: the other nodes' targets are wrong, and so are both processes'
    /// handoffs.
    fn check_twin(&mut self, beat: &Heartbeat, at: Instant) -> bool {
        if beat.incarnation == self.incarnation {
            self.heard_myself = true;
            return false;
        }
        // 0: a release that does not say; heard before this process's own:
        // the last heartbeat of this node's life before a restart.
        if !self.heard_myself || beat.incarnation == 0 || self.twins.contains(&beat.incarnation) {
            return false;
        }
        // Still coming a heartbeat's lifetime after the first: a live process.
        let first = *self.heard_others.entry(beat.incarnation).or_insert(at);
        if at.saturating_duration_since(first) < self.ttl {
            return false;
        }
        self.twins.push(beat.incarnation);
        metrics::counter!("ankusa_node_id_conflicts_total").increment(1);
        // The incarnation breaks a tie: both processes come to the same answer.
        let elder = (beat.started_ms, beat.incarnation) < (self.started_ms, self.incarnation);
        let what = if elder {
            "this process, started later, leaves the fleet and exits with status 2"
        } else {
            "the other process, started later, leaves the fleet"
        };
        tracing::error!(
            node_id = %self.me,
            started_ms = beat.started_ms,
            "another live process has this node's id; {what}. Give every node its own \
             node_id (several nodes on one host share its name, the default)"
        );
        if elder && self.elder.is_none() {
            self.elder = Some(beat.clone());
        }
        elder
    }

    /// Forgets everything, for a watch that begins again.
    fn reset(&mut self) {
        self.beats.clear();
        self.caught_up = false;
    }

    /// The heartbeats seen within their lifetime (the writer's TTL, or `ttl`
    /// for a writer of an earlier release that does not say), if the view is
    /// current: caught up, and this node's own heartbeat seen within its
    /// lifetime — a watch that stopped delivering would keep nodes that left.
    ///
    /// Heartbeats past their lifetime are forgotten here: a node whose last
    /// one lapsed without a marker saying so (a bucket made by an earlier
    /// release) is gone, and its next heartbeat, if it comes back, is a change.
    fn live(&mut self, now: Instant, ttl: Duration) -> Option<Vec<Heartbeat>> {
        let lifetime = |beat: &Heartbeat| match beat.ttl_ms {
            0 => ttl,
            ms => Duration::from_millis(ms),
        };
        self.beats
            .retain(|_, (beat, at)| now.saturating_duration_since(*at) < lifetime(beat));
        if !(self.caught_up && self.beats.contains_key(&self.me)) {
            return None;
        }
        Some(self.beats.values().map(|(beat, _)| beat.clone()).collect())
    }
}

/// The live nodes as the watch of their heartbeats knows them.
#[derive(Clone)]
pub struct Membership {
    view: Arc<Mutex<View>>,
}

/// Pause before watching again after a watch failed or ended.
const REWATCH_AFTER: Duration = Duration::from_secs(1);

impl Membership {
    /// Starts watching the heartbeats; `wake` is notified whenever a node
    /// joins or leaves (renewals of known nodes wake nobody; a heartbeat that
    /// lapses without a marker is found by the next round's [`Membership::live`]).
    pub fn watch(kv: FleetKv, me: &str, started_ms: u64, ttl: Duration, wake: Arc<Notify>) -> Self {
        let view = Arc::new(Mutex::new(View::new(
            me.to_string(),
            kv.incarnation(),
            started_ms,
            ttl,
        )));
        let kept = view.clone();
        tokio::spawn(async move {
            loop {
                match kv.watch_nodes().await {
                    Ok(events) => {
                        tokio::pin!(events);
                        while let Some(event) = events.next().await {
                            match event {
                                Ok(event) => {
                                    if lock(&kept).apply(event, Instant::now()) {
                                        wake.notify_one();
                                    }
                                }
                                Err(err @ KvError::Corrupt { .. }) => {
                                    tracing::warn!(error = %err, "unreadable heartbeat; skipped")
                                }
                                Err(err) => {
                                    tracing::debug!(error = %err, "membership watch failed");
                                    break;
                                }
                            }
                        }
                    }
                    Err(err) => tracing::debug!(error = %err, "cannot watch membership"),
                }
                lock(&kept).reset();
                tokio::time::sleep(REWATCH_AFTER).await;
            }
        });
        Self { view }
    }

    /// The live nodes' heartbeats, or `None` while the watch is not to be
    /// trusted (then list them from KV).
    pub fn live(&self, ttl: Duration) -> Option<Vec<Heartbeat>> {
        lock(&self.view).live(Instant::now(), ttl)
    }

    /// The heartbeat of a live process with this node's id that started
    /// before this one, if the watch has heard one: this process is to leave
    /// the fleet (it wakes the ownership loop when it is heard).
    pub fn yield_to(&self) -> Option<Heartbeat> {
        lock(&self.view).elder.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(2);

    fn beat(node: &str) -> NodeEvent {
        beat_of(node, 1)
    }

    fn beat_of(node: &str, incarnation: u64) -> NodeEvent {
        started_beat(node, incarnation, 1)
    }

    /// The heartbeat of process `incarnation` of `node`, started at `started_ms`.
    fn started_beat(node: &str, incarnation: u64, started_ms: u64) -> NodeEvent {
        NodeEvent {
            change: NodeChange::Beat(Heartbeat {
                node: node.into(),
                started_ms,
                http: None,
                claim_log_format: 2,
                incarnation,
                shards: 16,
                serving: 0,
                ttl_ms: 0,
            }),
            caught_up: true,
        }
    }

    fn nodes(view: &mut View, now: Instant) -> Option<Vec<String>> {
        view.live(now, TTL)
            .map(|beats| beats.into_iter().map(|b| b.node).collect())
    }

    #[test]
    fn the_view_lists_the_nodes_heard_within_a_heartbeat_lifetime() {
        let t0 = Instant::now();
        let mut view = View::new("a".into(), 1, 1, TTL);
        assert!(view.apply(beat("a"), t0), "a new node is a change");
        assert!(view.apply(beat("b"), t0));
        assert!(!view.apply(beat("b"), t0 + TTL / 2), "a renewal is not");
        assert!(view.apply(beat("c"), t0));
        assert!(view.apply(
            NodeEvent {
                change: NodeChange::Gone("c".into()),
                caught_up: true
            },
            t0
        ));
        assert_eq!(nodes(&mut view, t0), Some(vec!["a".into(), "b".into()]));
        // `a` renews; `b`'s last heartbeat lapses without a marker saying so.
        view.apply(beat("a"), t0 + TTL);
        assert_eq!(
            nodes(&mut view, t0 + TTL + TTL / 4),
            Some(vec!["a".into(), "b".into()])
        );
        assert_eq!(nodes(&mut view, t0 + TTL * 3 / 2), Some(vec!["a".into()]));
        // Forgotten: `b` coming back is a change again.
        assert!(view.apply(beat("b"), t0 + TTL * 3 / 2));
    }

    #[test]
    fn a_heartbeat_lives_by_its_writers_ttl_when_it_says() {
        let t0 = Instant::now();
        let mut view = View::new("a".into(), 1, 1, TTL);
        view.apply(beat("a"), t0);
        // `b` beats every 10 TTLs with a lifetime of 20: mid-way through a
        // rolling change of the lease timings.
        let mut slow = beat("b");
        if let NodeChange::Beat(hb) = &mut slow.change {
            hb.ttl_ms = u64::try_from((TTL * 20).as_millis()).expect("ms");
        }
        view.apply(slow, t0);
        view.apply(beat("a"), t0 + TTL * 10);
        assert_eq!(
            nodes(&mut view, t0 + TTL * 10),
            Some(vec!["a".into(), "b".into()]),
            "live by its own lifetime, not this node's"
        );
        view.apply(beat("a"), t0 + TTL * 20);
        assert_eq!(nodes(&mut view, t0 + TTL * 20), Some(vec!["a".into()]));
    }

    #[test]
    fn the_view_is_not_trusted_before_it_caught_up_or_without_this_nodes_heartbeat() {
        let t0 = Instant::now();
        let mut view = View::new("a".into(), 1, 1, TTL);
        let mut early = beat("b");
        early.caught_up = false;
        view.apply(early, t0);
        assert_eq!(
            nodes(&mut view, t0),
            None,
            "more heartbeats were still coming"
        );
        view.apply(beat("b"), t0);
        assert_eq!(
            nodes(&mut view, t0),
            None,
            "this node's own heartbeat is missing"
        );
        view.apply(beat("a"), t0);
        assert_eq!(nodes(&mut view, t0), Some(vec!["a".into(), "b".into()]));
        assert_eq!(
            nodes(&mut view, t0 + TTL),
            None,
            "no heartbeat came back for a lifetime"
        );
        view.reset();
        view.apply(beat("a"), t0 + TTL);
        assert_eq!(
            nodes(&mut view, t0 + TTL),
            Some(vec!["a".into()]),
            "a watch begun again starts from what it delivers"
        );
    }

    #[test]
    fn a_twin_is_a_process_of_this_id_heard_after_this_ones_own_heartbeat() {
        let t0 = Instant::now();
        let mut view = View::new("a".into(), 1, 1, TTL);
        view.apply(beat_of("a", 9), t0);
        assert!(view.twins.is_empty(), "the last heartbeat before a restart");
        view.apply(beat_of("a", 1), t0);
        view.apply(beat_of("a", 0), t0);
        view.apply(beat_of("b", 5), t0);
        assert!(
            view.twins.is_empty(),
            "a release that does not say, another node"
        );
        // Late writes of a dead process, stored together by a server that
        // had paused: heard within a heartbeat's lifetime of the first.
        for _ in 0..3 {
            view.apply(beat_of("a", 9), t0);
        }
        view.apply(beat_of("a", 9), t0 + TTL / 2);
        assert!(view.twins.is_empty(), "a burst of late heartbeats");
        for _ in 0..3 {
            view.apply(beat_of("a", 9), t0 + TTL);
        }
        assert_eq!(view.twins, [9], "a live twin, reported once");
        view.reset();
        view.apply(beat_of("a", 9), t0);
        assert_eq!(view.twins, [9], "still known after a new watch");
    }

    #[test]
    fn of_two_twins_the_one_started_later_steps_down() {
        let t0 = Instant::now();
        let twin = |incarnation, started_ms| started_beat("a", incarnation, started_ms);
        let heard_after_own = |me: (u64, u64), other: (u64, u64)| {
            let mut view = View::new("a".into(), me.0, me.1, TTL);
            view.apply(twin(me.0, me.1), t0);
            assert!(!view.apply(twin(other.0, other.1), t0), "heard once");
            let woke = view.apply(twin(other.0, other.1), t0 + TTL);
            (woke, view.elder.map(|beat| beat.incarnation))
        };
        // (incarnation, started_ms) of this process, then of its twin.
        assert_eq!(heard_after_own((1, 200), (2, 100)), (true, Some(2)));
        assert_eq!(heard_after_own((2, 100), (1, 200)), (false, None));
        // Started in the same millisecond: the incarnations decide, the
        // same way in both processes.
        assert_eq!(heard_after_own((7, 100), (3, 100)), (true, Some(3)));
        assert_eq!(heard_after_own((3, 100), (7, 100)), (false, None));
    }
}
