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
