//! The node's HTTP face for operators: `/metrics` (Prometheus text), `/healthz`
//! (the process is up) and `/readyz` (connected to NATS and serving its shards).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::health::Health;

/// Installs the process-wide Prometheus recorder (once) and returns its handle.
pub fn install_recorder() -> Result<PrometheusHandle, String> {
    let latency_buckets = [
        0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
        0.5, 1.0,
    ];
    PrometheusBuilder::new()
        .set_buckets(&latency_buckets)
        .map_err(|e| e.to_string())?
        .install_recorder()
        .map_err(|e| e.to_string())
}

/// Describes every metric the node exports, and creates the counters at zero so
/// that dashboards and alerts see them before the first event.
pub fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        "ankusa_requests_total",
        "Answers given, by result (ok, duplicate, pending, rate_limited, settled, reset)"
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
        "Tenant actors that failed and were restarted"
    );
    describe_gauge!(
        "ankusa_requests_shed",
        "Requests shed because a tenant's queue was full"
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
        "ankusa_state_unreadable_total",
        "State bucket messages a shard load could not read and skipped (each load that reads one counts it)"
    );
    for counter in [
        "ankusa_kv_call_timeouts_total",
        "ankusa_state_unreadable_total",
        "ankusa_kv_write_failures_total",
        "ankusa_kv_backlog_refusals_total",
        "ankusa_lease_renew_failures_total",
        "ankusa_lease_acquire_failures_total",
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
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(AppState { metrics, health });
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            tracing::error!(error = %err, "HTTP endpoint stopped");
        }
    });
    Ok(bound)
}

async fn render_metrics(State(state): State<AppState>) -> String {
    state.health.export_gauges();
    state.metrics.render()
}

async fn ready(State(state): State<AppState>) -> (StatusCode, String) {
    match state.health.readiness() {
        Ok(summary) => (StatusCode::OK, summary),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
    }
}
