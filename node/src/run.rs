//! The node's life: start the HTTP endpoints, reach NATS (in the background),
//! serve shards — all of them (standalone) or those its leases give it (fleet) —
//! and on shutdown hand every shard back before leaving.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use ankusa_actors::actor::ShardConfig;
use ankusa_actors::{AnchoredClock, Clock};
use ankusa_bus::persist::Persistence;

use crate::config::{Mode, NodeConfig};
use crate::fleet::FleetError;
use crate::health::Health;
use crate::host::{HostError, ShardHost};

/// Why a node stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Connect(#[from] ankusa_bus::ConnectError),
    #[error("HTTP endpoint on {addr}: {source}")]
    Http {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("metrics recorder: {0}")]
    Metrics(String),
    #[error(transparent)]
    Host(#[from] HostError),
    #[error("fleet: {0}")]
    Fleet(String),
    /// A configuration mistake found only once running (another live process
    /// has this node's id): restarting will not fix it.
    #[error("{0}")]
    Misconfigured(String),
    /// The NATS client's connection task ended: the node could no longer
    /// reach anything, so it stops for its supervisor to start it afresh.
    #[error("the NATS connection ended for good; exiting so that the node is restarted")]
    ConnectionEnded,
}

/// How often shards get their tick (retire idle tenants, sweep claims when
/// their point of the sweep period comes). Short, so that those points spread
/// the node's sweeps over the period: at one tick a second, every shard whose
/// point fell in that second swept at the same tick, a fifth of the node's
/// claims in one burst on its one thread.
pub(crate) const SHARD_TICK: Duration = Duration::from_millis(100);
/// How often failed shards are restarted and the gauges exported.
pub(crate) const STATS_EVERY: Duration = Duration::from_secs(1);

pub(crate) fn shard_config(config: &NodeConfig, clock: Arc<dyn Clock>) -> ShardConfig {
    ShardConfig {
        idle_after: Duration::from_millis(config.idle_after_ms),
        sweep_every: Duration::from_millis(config.sweep_every_ms),
        tenant_queue: config.tenant_queue,
        max_tenant_claims: config.max_tenant_claims,
        ..ShardConfig::new(clock)
    }
}

/// Moves a node's clock off its host's by this many milliseconds, to play a
/// host whose clock is wrong. For tests only: `tests/tests/clock.rs`.
pub const TEST_CLOCK_SKEW_ENV: &str = "ANKUSA_TEST_CLOCK_SKEW_MS";

/// The node's clock, from this host's wall time; fleet mode sets it to the
/// NATS server's before serving (see [`crate::time`]).
fn node_clock() -> AnchoredClock {
    let clock = AnchoredClock::from_system();
    let skew_ms = std::env::var(TEST_CLOCK_SKEW_ENV)
        .ok()
        .and_then(|v| v.parse::<i64>().ok());
    if let Some(skew_ms) = skew_ms {
        tracing::warn!(
            skew_ms,
            "{TEST_CLOCK_SKEW_ENV} is set: this node's clock starts off its host's"
        );
        clock.step_by(skew_ms.saturating_mul(1000));
    }
    clock
}

/// The runtime a node runs on, as `worker_threads` says. One thread keeps all
/// of a request's hops (connection, shard actor, tenant actor, claim log) on
/// the thread it arrived on; a pool lets tasks move between threads, and on a
/// small VM each move wakes a sleeping thread (docs/benchmarks.md, "Core").
pub fn runtime(config: &NodeConfig) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = match config.worker_threads {
        1 => tokio::runtime::Builder::new_current_thread(),
        0 => tokio::runtime::Builder::new_multi_thread(),
        n => {
            let mut pool = tokio::runtime::Builder::new_multi_thread();
            pool.worker_threads(n);
            pool
        }
    };
    builder.enable_all().build()
}

/// Runs a node until `shutdown` resolves, then hands its shards back.
pub async fn run(
    mut config: NodeConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), NodeError> {
    let health = Arc::new(Health::default());
    if let Some(addr) = config.http_addr {
        let handle = crate::http::install_recorder().map_err(NodeError::Metrics)?;
        crate::http::describe_metrics();
        let bound = crate::http::serve(addr, handle, health.clone())
            .await
            .map_err(|source| NodeError::Http { addr, source })?;
        tracing::info!(%bound, "serving /metrics, /healthz, /readyz");
        // What the heartbeat advertises: with port 0, the one the system chose.
        config.http_addr = Some(bound);
    }
    let mut nats = config.nats.clone();
    nats.name
        .get_or_insert_with(|| format!("ankusa-node {}", config.node_id));
    let client = nats.connect().await?;
    health.set_client(client.clone());
    tracing::info!(
        node = %config.node_id,
        instance = %config.instance,
        shards = config.shards,
        mode = ?config.mode,
        worker_threads = config.worker_threads,
        servers = ?config.nats.servers,
        "node starting"
    );
    let clock = Arc::new(node_clock());
    let watched = client.clone();
    let serve = async move {
        match config.mode {
            Mode::Standalone => standalone(config, client, health, shutdown, clock).await,
            Mode::Fleet => crate::fleet::run(config, client, health, shutdown, clock)
                .await
                .map_err(|e| match e {
                    FleetError::TwinNodeId { .. } => NodeError::Misconfigured(e.to_string()),
                    e => NodeError::Fleet(e.to_string()),
                }),
        }
    };
    tokio::select! {
        served = serve => served,
        () = ankusa_bus::connection_ended(&watched) => Err(NodeError::ConnectionEnded),
    }
}

async fn standalone(
    config: NodeConfig,
    client: async_nats::Client,
    health: Arc<Health>,
    shutdown: impl Future<Output = ()>,
    clock: Arc<AnchoredClock>,
) -> Result<(), NodeError> {
    let mut host = ShardHost::new(
        client,
        config.subjects(),
        config.shards,
        shard_config(&config, clock),
        Persistence::Memory,
    )
    .with_node_subject(&config.node_id);
    for shard in 0..config.shards {
        host.serve(shard, Vec::new(), None).await?;
    }
    health.set_shards(host.serving().len(), config.shards as usize);
    tracing::info!(
        shards = config.shards,
        "serving every shard (standalone, in memory)"
    );
    let mut ticks = tokio::time::interval(SHARD_TICK);
    let mut next_stats = tokio::time::Instant::now();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            now = ticks.tick() => {
                host.tick();
                if now >= next_stats {
                    for shard in host.failed() {
                        tracing::error!(shard, "shard actor failed; restarting it empty (standalone keeps no state)");
                        host.release(shard).await;
                        host.serve(shard, Vec::new(), None).await?;
                    }
                    export_stats(&host).await;
                    next_stats = now + STATS_EVERY;
                }
            }
            _ = &mut shutdown => break,
        }
    }
    health.set_shutting_down();
    host.release_all().await;
    tracing::info!("node stopped");
    Ok(())
}

/// Publishes the host's gauges.
pub(crate) async fn export_stats(host: &ShardHost) {
    let stats = host.stats().await;
    metrics::gauge!("ankusa_tenants_active").set(stats.active_tenants as f64);
    metrics::gauge!("ankusa_tenants_parked").set(stats.parked_tenants as f64);
    metrics::gauge!("ankusa_claims").set(stats.claims as f64);
    metrics::gauge!("ankusa_tenant_restarts").set(stats.restarts as f64);
    metrics::gauge!("ankusa_requests_shed").set(stats.shed as f64);
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: handing shards back"),
                _ = int.recv() => tracing::info!("SIGINT: handing shards back"),
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::runtime::RuntimeFlavor;

    use super::*;

    fn flavor(worker_threads: usize) -> (RuntimeFlavor, usize) {
        let config = NodeConfig {
            worker_threads,
            ..NodeConfig::default()
        };
        let rt = runtime(&config).expect("runtime");
        let metrics = rt.metrics();
        (rt.handle().runtime_flavor(), metrics.num_workers())
    }

    #[test]
    fn worker_threads_picks_the_runtime() {
        assert_eq!(NodeConfig::default().worker_threads, 1);
        assert_eq!(flavor(1), (RuntimeFlavor::CurrentThread, 1));
        assert_eq!(flavor(3), (RuntimeFlavor::MultiThread, 3));
        let (pool, workers) = flavor(0);
        assert_eq!(pool, RuntimeFlavor::MultiThread);
        assert!(workers >= 1);
    }
}
