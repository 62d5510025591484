//! The node's HTTP face for operators: `/metrics` (Prometheus text), `/healthz`
//! (the process is up) and `/readyz` (connected to NATS and serving its shards).
//! It holds a bounded number of connections, each for a bounded time.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use ankusa_bus::protocol::ErrorCode;
use ankusa_bus::responder::{NO_REPLY_SUBJECT, RESERVED_REPLY_SUBJECT};
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::serve::Listener;
use axum::Router;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;

use crate::health::Health;

/// Installs the process-wide Prometheus recorder (once) and returns its handle.
pub fn install_recorder() -> Result<PrometheusHandle, String> {
    let latency_buckets = [
        0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
        0.5, 1.0,
    ];
    // The histograms of counts (changes per log message, tenants per flush)
    // with the latency buckets would put every value from 2 up in `+Inf`.
    let count_buckets = [
        1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0,
    ];
    let mut builder = PrometheusBuilder::new()
        .set_buckets(&latency_buckets)
        .map_err(|e| e.to_string())?;
    for counted in ["ankusa_claim_log_batch", "ankusa_kv_flush_buckets"] {
        builder = builder
            .set_buckets_for_metric(Matcher::Full(counted.into()), &count_buckets)
            .map_err(|e| e.to_string())?;
    }
    builder.install_recorder().map_err(|e| e.to_string())
}

/// Describes every metric the node exports, and creates the counters at zero so
/// that dashboards and alerts see them before the first event.
pub fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        "ankusa_requests_total",
        "Answers given, by result (ok, duplicate, pending, rate_limited, settled, reset, inspected)"
    );
    describe_counter!(
        "ankusa_requests_refused_total",
        "Requests answered with an error, by error code"
    );
    describe_counter!(
        "ankusa_requests_dropped_total",
        "Requests left unanswered, by why (lease: the shard's lease had lapsed)"
    );
    describe_histogram!(
        "ankusa_request_duration_seconds",
        Unit::Seconds,
        "Time from receipt to answer, by op (includes the KV write of claims)"
    );
    describe_gauge!("ankusa_shards_owned", "Shards this node serves");
    describe_gauge!(
        "ankusa_claim_log_format",
        "The claim log this node writes: 2, its own; 1, the per-8-shard logs of an earlier release"
    );
    describe_histogram!(
        "ankusa_claim_log_batch",
        "Changes (claims and bucket TATs) per claim-log message"
    );
    describe_gauge!(
        "ankusa_kv_bucket_replicas",
        "Replicas of each of the instance's KV buckets, as found when opened"
    );
    describe_gauge!(
        "ankusa_shards_target",
        "Shards rendezvous hashing assigns to this node"
    );
    describe_gauge!("ankusa_tenants_active", "Tenants with a running actor");
    describe_gauge!(
        "ankusa_tenants_parked",
        "Quiet tenants whose state is parked in their shard"
    );
    describe_gauge!(
        "ankusa_claims",
        "Claims held in memory (live, or expired and not yet swept)"
    );
    describe_gauge!(
        "ankusa_tenant_restarts",
        "Tenant actors that failed and were restarted, over the shards served now"
    );
    describe_gauge!(
        "ankusa_requests_shed",
        "Requests shed because a tenant's queue was full, over the shards served now"
    );
    describe_histogram!(
        "ankusa_kv_write_seconds",
        Unit::Seconds,
        "KV write latency, publish to ack (the durability lag of an answer)"
    );
    describe_histogram!(
        "ankusa_kv_flush_buckets",
        "Tenants' buckets written per write-behind flush"
    );
    describe_gauge!("ankusa_kv_writes_in_flight", "KV writes awaiting their ack");
    describe_counter!("ankusa_kv_write_failures_total", "KV writes that failed");
    describe_gauge!(
        "ankusa_kv_writes_queued",
        "Claim changes queued for the claim log, not yet in a message sent"
    );
    describe_counter!(
        "ankusa_kv_backlog_refusals_total",
        "Submissions of changes refused because too many were queued (answered unavailable)"
    );
    describe_counter!(
        "ankusa_lease_renew_failures_total",
        "Lease renewals that failed on a KV error"
    );
    describe_counter!(
        "ankusa_lease_acquire_failures_total",
        "Lease writes to take a free shard that failed on a KV error (one a round at most)"
    );
    describe_counter!(
        "ankusa_heartbeat_failures_total",
        "Heartbeats that failed: enough in a row and the other nodes take this one's shards"
    );
    describe_counter!(
        "ankusa_tenant_claims_full_total",
        "Hits on a new key refused (overloaded) because their tenant held max_tenant_claims"
    );
    describe_counter!(
        "ankusa_steps_aside_total",
        "Times this node stepped aside from the live nodes, its loads failing while it served no shard"
    );
    describe_counter!(
        "ankusa_lease_takes_refused_total",
        "Takes of a target shard refused because another holds its lease"
    );
    describe_counter!(
        "ankusa_leases_lost_total",
        "Leases found lost (expired or taken) at renewal"
    );
    describe_histogram!(
        "ankusa_shard_load_seconds",
        Unit::Seconds,
        "Time to load a shard's state from KV before serving it"
    );
    describe_gauge!("ankusa_nats_connected", "1 while connected to NATS");
    describe_counter!(
        "ankusa_nats_connects_total",
        "Connections to NATS made, the first included (each more is a reconnect)"
    );
    describe_counter!(
        "ankusa_shard_restarts_total",
        "Shard actors that failed and were reloaded from KV"
    );
    describe_counter!(
        "ankusa_leases_adopted_total",
        "Leases this process wrote but never heard the ack of, taken back over at their revision"
    );
    describe_counter!(
        "ankusa_membership_listings_total",
        "Ownership rounds that listed the live nodes from KV, the membership watch not to be trusted"
    );
    describe_gauge!(
        "ankusa_clock_offset_seconds",
        Unit::Seconds,
        "The NATS server's time minus this node's, at the last heartbeat"
    );
    describe_counter!(
        "ankusa_clock_steps_total",
        "Times the node set its clock to the NATS server's while serving nothing"
    );
    describe_counter!(
        "ankusa_clock_slewed_microseconds_total",
        "How far the node's clock was slewed towards the NATS server's while serving"
    );
    describe_counter!(
        "ankusa_kv_call_timeouts_total",
        "KV calls of the ownership loop that did not answer within their bound"
    );
    describe_counter!(
        "ankusa_node_id_conflicts_total",
        "Other live processes seen heartbeating under this node's id"
    );
    describe_counter!(
        "ankusa_state_unreadable_total",
        "State bucket messages a shard load could not read and skipped (each load that reads one counts it)"
    );
    for counter in [
        "ankusa_kv_call_timeouts_total",
        "ankusa_node_id_conflicts_total",
        "ankusa_state_unreadable_total",
        "ankusa_kv_write_failures_total",
        "ankusa_kv_backlog_refusals_total",
        "ankusa_lease_renew_failures_total",
        "ankusa_lease_acquire_failures_total",
        "ankusa_lease_takes_refused_total",
        "ankusa_steps_aside_total",
        "ankusa_tenant_claims_full_total",
        "ankusa_heartbeat_failures_total",
        "ankusa_leases_lost_total",
        "ankusa_leases_adopted_total",
        "ankusa_shard_restarts_total",
        "ankusa_clock_steps_total",
        "ankusa_clock_slewed_microseconds_total",
        // Exported from the start: a node whose watch caught up before its
        // first round never lists, and the counter would never appear.
        "ankusa_membership_listings_total",
    ] {
        metrics::counter!(counter).increment(0);
    }
    metrics::counter!("ankusa_requests_dropped_total", "why" => "lease").increment(0);
    // Every code from the start: `increase()` does not count the first sample
    // of a new series, so a first burst of refusals would raise no alert.
    for code in ErrorCode::ALL {
        metrics::counter!("ankusa_requests_refused_total", "code" => code.to_string()).increment(0);
    }
    for code in [NO_REPLY_SUBJECT, RESERVED_REPLY_SUBJECT] {
        metrics::counter!("ankusa_requests_refused_total", "code" => code).increment(0);
    }
}

#[derive(Clone)]
struct AppState {
    metrics: PrometheusHandle,
    health: Arc<Health>,
}

/// Serves the endpoints on `addr` until the process ends.
pub async fn serve(
    addr: SocketAddr,
    metrics: PrometheusHandle,
    health: Arc<Health>,
) -> std::io::Result<SocketAddr> {
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(live))
        .route("/readyz", get(ready))
        .with_state(AppState { metrics, health });
    let listener = BoundedListener::new(
        TcpListener::bind(addr).await?,
        MAX_CONNECTIONS,
        CONNECTION_LIFETIME,
    );
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            tracing::error!(error = %err, "HTTP endpoint stopped");
        }
    });
    Ok(bound)
}

/// Connections the endpoint holds at once. A scraper needs one, kept alive
/// between scrapes. axum gives hyper no timer, so hyper waits for a request's
/// headers without end: without a cap, clients that connect and never finish
/// a request would take every file descriptor of the process, those NATS
/// reconnects need included. Past the cap, connections wait in the kernel's
/// backlog until one closes.
const MAX_CONNECTIONS: usize = 64;

/// How long a connection may live, idle or not: one that never finishes a
/// request gives its place back, and a scraper simply reconnects.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

/// A TCP listener that accepts at most `permits` connections at once, each
/// for at most `lifetime`.
struct BoundedListener {
    tcp: TcpListener,
    permits: Arc<Semaphore>,
    lifetime: Duration,
}

impl BoundedListener {
    fn new(tcp: TcpListener, connections: usize, lifetime: Duration) -> Self {
        Self {
            tcp,
            permits: Arc::new(Semaphore::new(connections)),
            lifetime,
        }
    }
}

impl Listener for BoundedListener {
    type Io = BoundedConnection;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        // A place first, then the connection: the ones beyond the cap stay in
        // the kernel's backlog, holding no descriptor of ours.
        let Ok(permit) = self.permits.clone().acquire_owned().await else {
            // Only a closed semaphore refuses, and this one is never closed.
            return std::future::pending().await;
        };
        let (stream, addr) = Listener::accept(&mut self.tcp).await;
        let connection = BoundedConnection {
            stream,
            ends: Box::pin(tokio::time::sleep(self.lifetime)),
            _place: permit,
        };
        (connection, addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

/// An accepted connection that fails its reads and writes once its lifetime
/// is over, so that hyper drops it, and gives its place back when dropped.
struct BoundedConnection {
    stream: TcpStream,
    ends: Pin<Box<Sleep>>,
    _place: OwnedSemaphorePermit,
}

impl BoundedConnection {
    fn check_lifetime(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        match self.ends.as_mut().poll(cx) {
            Poll::Ready(()) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the connection outlived its time",
            )),
            Poll::Pending => Ok(()),
        }
    }
}

impl AsyncRead for BoundedConnection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check_lifetime(cx)?;
        Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for BoundedConnection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check_lifetime(cx)?;
        Pin::new(&mut this.stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

async fn render_metrics(State(state): State<AppState>) -> String {
    state.health.export_gauges();
    state.metrics.render()
}

async fn live(State(state): State<AppState>) -> (StatusCode, String) {
    answer(state.health.liveness())
}

async fn ready(State(state): State<AppState>) -> (StatusCode, String) {
    answer(state.health.readiness())
}

fn answer(health: Result<String, String>) -> (StatusCode, String) {
    match health {
        Ok(summary) => (StatusCode::OK, summary),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn connections_past_the_cap_wait_for_a_place_and_each_lives_a_bounded_time() {
        let lifetime = Duration::from_secs(1);
        let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let listener = BoundedListener::new(tcp, 2, lifetime);
        let addr = listener.local_addr().expect("address");
        let app = Router::new().route("/healthz", get(|| async { "ok\n" }));
        tokio::spawn(async move { axum::serve(listener, app).await });

        // Two connections that never send a request take both places: the
        // kernel hands connections to `accept` in the order they came, so
        // these two are accepted before the scraper, however late. Each
        // lives `lifetime` from its accept, which comes after `connecting`.
        let connecting = tokio::time::Instant::now();
        let mut silent = Vec::new();
        for _ in 0..2 {
            silent.push(TcpStream::connect(addr).await.expect("connect"));
        }
        let mut scraper = TcpStream::connect(addr).await.expect("connect");
        scraper
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: node\r\nconnection: close\r\n\r\n")
            .await
            .expect("send");
        // No answer while both places are certainly held: until a tick before
        // the earliest instant their lifetime can end (a slow host only
        // shortens the wait, never makes it overlap a freed place).
        let held = connecting + lifetime - Duration::from_millis(100);
        let mut answer = Vec::new();
        let early = tokio::time::timeout_at(held, scraper.read_to_end(&mut answer)).await;
        assert!(early.is_err(), "answered past the cap: {answer:?}");

        // Their lifetime over, the silent ones are dropped and the scraper's
        // request is answered.
        tokio::time::timeout(Duration::from_secs(2), scraper.read_to_end(&mut answer))
            .await
            .expect("answered once a place was free")
            .expect("read");
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        for mut connection in silent {
            let mut byte = [0u8; 1];
            let read = tokio::time::timeout(Duration::from_secs(1), connection.read(&mut byte))
                .await
                .expect("closed by the server");
            assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        }
    }
}
