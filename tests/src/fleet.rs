//! Our own node processes: [`NodeProcess`] runs one `ankusa-node` on loopback
//! with its HTTP port, [`standalone_pair`] starts one with its nats-server,
//! [`connected_edge`] is an edge client ready to call, and [`wait_until`]
//! polls a condition with a bound.

use std::future::Future;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::nats::{http_get, LOOPBACK};
use crate::process::{cargo_bin, ChildProcess, Signal};
use crate::{free_port, HarnessError};

/// How a test node is started. Lease timings are short so failover tests are quick.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    pub node_id: String,
    pub instance: String,
    pub shards: u32,
    pub servers: Vec<String>,
    /// `fleet` or `standalone`.
    pub mode: &'static str,
    pub lease_ttl_ms: u64,
    pub lease_renew_ms: u64,
    pub lease_margin_ms: u64,
    pub kv_replicas: usize,
    pub extra_args: Vec<String>,
    /// Set in the node's environment.
    pub env: Vec<(String, String)>,
}

impl NodeSpec {
    pub fn fleet(node_id: &str, servers: Vec<String>) -> Self {
        Self {
            node_id: node_id.to_string(),
            instance: "test".into(),
            shards: 16,
            servers,
            mode: "fleet",
            lease_ttl_ms: 2_000,
            lease_renew_ms: 400,
            lease_margin_ms: 500,
            kv_replicas: 1,
            extra_args: Vec::new(),
            env: Vec::new(),
        }
    }

    pub fn standalone(node_id: &str, servers: Vec<String>) -> Self {
        Self {
            mode: "standalone",
            ..Self::fleet(node_id, servers)
        }
    }
}

/// A running `ankusa-node`.
pub struct NodeProcess {
    pub spec: NodeSpec,
    pub http_port: u16,
    process: ChildProcess,
}

impl NodeProcess {
    pub fn start(spec: NodeSpec) -> Result<Self, HarnessError> {
        Self::launch(spec, None)
    }

    /// Like [`NodeProcess::start`], appending the node's output to `log`, so a
    /// node restarted under the same name keeps one log across its lives.
    pub fn start_logged(spec: NodeSpec, log: &Path) -> Result<Self, HarnessError> {
        Self::launch(spec, Some(log))
    }

    fn launch(spec: NodeSpec, log: Option<&Path>) -> Result<Self, HarnessError> {
        let http_port = free_port()?;
        let name = format!("ankusa-node {}", spec.node_id);
        let cmd = Self::command(&spec, http_port);
        let process = match log {
            Some(log) => ChildProcess::spawn_logged(name, cmd, log)?,
            None => ChildProcess::spawn(name, cmd)?,
        };
        Ok(Self {
            spec,
            http_port,
            process,
        })
    }

    fn command(spec: &NodeSpec, http_port: u16) -> Command {
        let mut cmd = Command::new(cargo_bin("ankusa-node"));
        cmd.args(["--node-id", &spec.node_id])
            .args(["--instance", &spec.instance])
            .args(["--shards", &spec.shards.to_string()])
            .args(["--mode", spec.mode])
            .args(["--nats", &spec.servers.join(",")])
            .args(["--lease-ttl-ms", &spec.lease_ttl_ms.to_string()])
            .args(["--lease-renew-ms", &spec.lease_renew_ms.to_string()])
            .args(["--lease-margin-ms", &spec.lease_margin_ms.to_string()])
            .args(["--kv-replicas", &spec.kv_replicas.to_string()])
            .args(["--http-addr", &format!("{LOOPBACK}:{http_port}")])
            .args(&spec.extra_args)
            .env("ANKUSA_LOG", "info,ankusa_node=debug")
            .env_remove("ANKUSA_CONFIG")
            .envs(spec.env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    /// GET on the node's HTTP port: (status, body).
    pub async fn http(&self, path: &str) -> Result<(u16, String), HarnessError> {
        http_get(LOOPBACK, self.http_port, path)
            .await
            .map_err(|e| HarnessError::Io {
                context: format!("GET {path} on node {}", self.spec.node_id),
                source: std::io::Error::other(e),
            })
    }

    /// Whether `/readyz` answers 200.
    pub async fn is_ready(&self) -> bool {
        matches!(self.http("/readyz").await, Ok((200, _)))
    }

    /// Waits (bounded) until `/readyz` answers 200.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), String> {
        wait_until(timeout, || self.is_ready())
            .await
            .map(|_| ())
            .map_err(|_| {
                format!(
                    "node {} not ready within {timeout:?}; log tail:\n{}",
                    self.spec.node_id,
                    self.process.log_tail(30)
                )
            })
    }

    /// The value of a metric line starting with `name` (first match), if present.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        let (_, body) = self.http("/metrics").await.ok()?;
        body.lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    pub fn process(&mut self) -> &mut ChildProcess {
        &mut self.process
    }

    pub fn log(&self) -> String {
        self.process.read_log()
    }

    pub fn log_tail(&self, lines: usize) -> String {
        self.process.log_tail(lines)
    }

    pub fn pause(&mut self) -> Result<(), HarnessError> {
        self.process.signal(Signal::Stop)
    }

    pub fn resume(&mut self) -> Result<(), HarnessError> {
        self.process.signal(Signal::Cont)
    }

    /// SIGTERM and wait for a graceful exit.
    pub async fn stop(&mut self) -> Result<(), HarnessError> {
        self.process.stop(Duration::from_secs(10)).await.map(|_| ())
    }

    pub async fn kill(&mut self) -> Result<(), HarnessError> {
        self.process.kill().await.map(|_| ())
    }
}

/// A nats-server and a standalone node named `node_id` serving on it, ready.
pub async fn standalone_pair(node_id: &str) -> (crate::NatsServer, NodeProcess) {
    let nats = crate::NatsServer::start()
        .await
        .expect("nats-server starts");
    let node =
        NodeProcess::start(NodeSpec::standalone(node_id, vec![nats.url()])).expect("node starts");
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");
    (nats, node)
}

/// An edge client of `config` that has finished connecting (connecting itself
/// never waits).
pub async fn connected_edge(config: ankusa_bus::FleetConfig) -> ankusa_bus::FleetStore {
    let store = ankusa_bus::FleetStore::connect(config)
        .await
        .expect("valid config");
    wait_until(Duration::from_secs(10), || async {
        store.nats().connection_state() == async_nats::connection::State::Connected
    })
    .await
    .expect("edge connects");
    store
}

/// Polls `condition` every 50 ms until it holds or `timeout` passes.
pub async fn wait_until<F, Fut>(timeout: Duration, mut condition: F) -> Result<Duration, Duration>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = tokio::time::Instant::now();
    loop {
        if condition().await {
            return Ok(start.elapsed());
        }
        if start.elapsed() >= timeout {
            return Err(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
