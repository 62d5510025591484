//! `ankusa-node` configuration: a TOML file, then `ANKUSA_*` environment
//! variables, then flags, each overriding the one before; validated once at start
//! with messages that say what to change.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ankusa_actors::DEFAULT_MAX_TENANT_CLAIMS;
use ankusa_bus::shard::MAX_SHARDS;
use ankusa_bus::{NatsOptions, Subjects};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

/// More worker threads than any host has cores: a typo, not a setting.
const MAX_WORKER_THREADS: usize = 1024;
/// The least a KV call of the ownership loop may wait (see `validate`).
const MIN_KV_WAIT_MS: u64 = 250;
/// The shortest renewal period.
const MIN_RENEW_MS: u64 = 100;
/// The least `lease_margin_ms`: the fence must leave some room.
const MIN_LEASE_MARGIN_MS: u64 = 100;

/// How a node decides which shards it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Share the shards with the other nodes of the instance through KV leases,
    /// and persist claims and buckets in JetStream KV.
    Fleet,
    /// Serve every shard alone, state in memory only (development, tests).
    Standalone,
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Human,
    Json,
}

/// `http_addr` as written, in the file as on the command line: an `IP:port`,
/// or `off` (`none`, empty) for no endpoint.
mod http_addr_text {
    use std::net::SocketAddr;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn parse(text: &str) -> Result<Option<SocketAddr>, String> {
        match text {
            "" | "off" | "none" => Ok(None),
            text => text.parse().map(Some).map_err(|e| format!("`{text}`: {e}")),
        }
    }

    pub fn serialize<S: Serializer>(addr: &Option<SocketAddr>, out: S) -> Result<S::Ok, S::Error> {
        match addr {
            Some(addr) => out.collect_str(addr),
            None => out.serialize_str("off"),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        input: D,
    ) -> Result<Option<SocketAddr>, D::Error> {
        parse(&String::deserialize(input)?).map_err(serde::de::Error::custom)
    }
}

/// Everything a node is configured with. Field docs are the reference
/// (`docs/configuration.md` mirrors them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// The fleet this node belongs to; names its subjects and KV buckets.
    pub instance: String,
    /// This node's name, unique in the instance and stable across restarts.
    pub node_id: String,
    /// Shard count of the instance; every node and edge must agree.
    pub shards: u32,
    pub mode: Mode,
    pub nats: NatsOptions,
    /// Replicas of the KV buckets (3 on a 3-server cluster).
    pub kv_replicas: usize,
    /// A lease lives this long unless renewed.
    pub lease_ttl_ms: u64,
    /// A node stops answering for a shard this long before its lease would lapse.
    pub lease_margin_ms: u64,
    /// How often leases are renewed and the shard map is rebalanced.
    pub lease_renew_ms: u64,
    /// Bucket TATs are written to KV at most this often per bucket.
    pub write_behind_ms: u64,
    /// A tenant actor with no request for this long is retired.
    pub idle_after_ms: u64,
    /// Expired claims are swept this often.
    pub sweep_every_ms: u64,
    /// Requests one tenant may have queued before more are shed.
    pub tenant_queue: usize,
    /// Claims one tenant may hold at a node (live, or expired and not yet
    /// swept) before a hit on a new key is answered `overloaded`.
    pub max_tenant_claims: usize,
    /// Threads that run the node's work. 1: one thread, on which a request's
    /// every hop (connection, shard, tenant, claim log) stays; to use more
    /// cores, run more nodes (the fleet spreads shards over them). 0: a
    /// work-stealing pool of one thread per CPU; N: a pool of N threads.
    pub worker_threads: usize,
    /// Where `/metrics`, `/healthz` and `/readyz` are served; `off` (or
    /// `none`, or empty) to disable.
    #[serde(with = "http_addr_text")]
    pub http_addr: Option<SocketAddr>,
    pub log_format: LogFormat,
    /// Log filter, as `RUST_LOG` (e.g. `info`, `ankusa=debug`).
    pub log_level: String,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            instance: "default".into(),
            node_id: default_node_id(),
            shards: 64,
            mode: Mode::Fleet,
            nats: NatsOptions::default(),
            kv_replicas: 1,
            lease_ttl_ms: 5_000,
            lease_margin_ms: 1_000,
            lease_renew_ms: 1_000,
            write_behind_ms: 100,
            idle_after_ms: 30_000,
            sweep_every_ms: 5_000,
            tenant_queue: 1024,
            max_tenant_claims: DEFAULT_MAX_TENANT_CLAIMS,
            worker_threads: 1,
            http_addr: Some(SocketAddr::from(([127, 0, 0, 1], 9464))),
            log_format: LogFormat::Human,
            log_level: "info".into(),
        }
    }
}

/// The host's name, made a valid node id. Stable across restarts; several nodes
/// on one host must each be given a `node_id`.
fn default_node_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .unwrap_or_default();
    let id: String = host
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .take(128)
        .collect();
    if id.is_empty() {
        "node".into()
    } else {
        id
    }
}

/// `slot` becomes `value`, when one is given.
fn set<T: Clone>(slot: &mut T, value: &Option<T>) {
    if let Some(v) = value {
        *slot = v.clone();
    }
}

/// An optional setting becomes `value`, when one is given (`None` leaves it).
fn set_given<T: Clone>(slot: &mut Option<T>, value: &Option<T>) {
    if value.is_some() {
        slot.clone_from(value);
    }
}

/// How to reach NATS: flags and `ANKUSA_NATS*` variables shared by the node
/// (over its file) and the `ankusa` CLI, so that one environment serves both.
#[derive(Debug, Clone, Default, Args)]
pub struct NatsArgs {
    /// NATS server URL; repeat or comma-separate for a cluster [default: nats://127.0.0.1:4222]
    #[arg(
        long = "nats",
        env = "ANKUSA_NATS",
        value_delimiter = ',',
        global = true
    )]
    pub nats_servers: Vec<String>,
    /// NATS user (with --nats-password)
    #[arg(long, env = "ANKUSA_NATS_USER", global = true)]
    pub nats_user: Option<String>,
    /// NATS password
    #[arg(
        long,
        env = "ANKUSA_NATS_PASSWORD",
        hide_env_values = true,
        global = true
    )]
    pub nats_password: Option<String>,
    /// NATS token
    #[arg(long, env = "ANKUSA_NATS_TOKEN", hide_env_values = true, global = true)]
    pub nats_token: Option<String>,
    /// NATS credentials file (.creds)
    #[arg(long, env = "ANKUSA_NATS_CREDS", global = true)]
    pub nats_creds: Option<PathBuf>,
    /// CA certificate (PEM) to verify the NATS server
    #[arg(long, env = "ANKUSA_NATS_TLS_CA", global = true)]
    pub nats_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM), with --nats-tls-key, for servers that verify clients
    #[arg(long, env = "ANKUSA_NATS_TLS_CERT", global = true)]
    pub nats_tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --nats-tls-cert
    #[arg(long, env = "ANKUSA_NATS_TLS_KEY", global = true)]
    pub nats_tls_key: Option<PathBuf>,
    /// Refuse a NATS connection that is not TLS
    #[arg(long, env = "ANKUSA_NATS_REQUIRE_TLS", global = true)]
    pub nats_require_tls: Option<bool>,
    /// Inbox prefix for the answers to this process's requests instead of `_INBOX`
    #[arg(long, env = "ANKUSA_NATS_INBOX_PREFIX", global = true)]
    pub nats_inbox_prefix: Option<String>,
    /// NATS nkey seed (`SU...`) to authenticate with
    #[arg(
        long,
        env = "ANKUSA_NATS_NKEY_SEED",
        hide_env_values = true,
        global = true
    )]
    pub nats_nkey_seed: Option<String>,
}

impl NatsArgs {
    /// Sets in `nats` each option given.
    pub fn apply_to(&self, nats: &mut NatsOptions) {
        if !self.nats_servers.is_empty() {
            nats.servers = self.nats_servers.clone();
        }
        set_given(&mut nats.user, &self.nats_user);
        set_given(&mut nats.password, &self.nats_password);
        set_given(&mut nats.token, &self.nats_token);
        set_given(&mut nats.creds_file, &self.nats_creds);
        set_given(&mut nats.tls_ca, &self.nats_tls_ca);
        set_given(&mut nats.tls_cert, &self.nats_tls_cert);
        set_given(&mut nats.tls_key, &self.nats_tls_key);
        set(&mut nats.require_tls, &self.nats_require_tls);
        set_given(&mut nats.inbox_prefix, &self.nats_inbox_prefix);
        set_given(&mut nats.nkey_seed, &self.nats_nkey_seed);
    }
}

/// Flags and `ANKUSA_*` variables; each one set overrides the file.
#[derive(Debug, Clone, Default, Args)]
pub struct Overrides {
    /// Fleet instance name (a-z, 0-9, `_`, `-`) [default: default]
    #[arg(long, env = "ANKUSA_INSTANCE")]
    pub instance: Option<String>,
    /// This node's unique, stable name; set it when several nodes share a host [default: the host name]
    #[arg(long, env = "ANKUSA_NODE_ID")]
    pub node_id: Option<String>,
    /// Shards of the instance, 1..=4096; all nodes and edges must agree [default: 64]
    #[arg(long, env = "ANKUSA_SHARDS")]
    pub shards: Option<u32>,
    /// fleet: share shards through KV leases and persist to KV; standalone: serve all shards in memory [default: fleet]
    #[arg(long, env = "ANKUSA_MODE", value_enum)]
    pub mode: Option<Mode>,
    #[command(flatten)]
    pub nats: NatsArgs,
    /// KV bucket replicas (3 on a 3-server cluster) [default: 1]
    #[arg(long, env = "ANKUSA_KV_REPLICAS")]
    pub kv_replicas: Option<usize>,
    /// Lease time to live, ms [default: 5000]
    #[arg(long, env = "ANKUSA_LEASE_TTL_MS")]
    pub lease_ttl_ms: Option<u64>,
    /// Stop answering this long before a lease would lapse, ms [default: 1000]
    #[arg(long, env = "ANKUSA_LEASE_MARGIN_MS")]
    pub lease_margin_ms: Option<u64>,
    /// Lease renewal and rebalance period, ms [default: 1000]
    #[arg(long, env = "ANKUSA_LEASE_RENEW_MS")]
    pub lease_renew_ms: Option<u64>,
    /// Bucket write-behind interval, ms [default: 100]
    #[arg(long, env = "ANKUSA_WRITE_BEHIND_MS")]
    pub write_behind_ms: Option<u64>,
    /// Retire a tenant actor after this long without a request, ms [default: 30000]
    #[arg(long, env = "ANKUSA_IDLE_AFTER_MS")]
    pub idle_after_ms: Option<u64>,
    /// Sweep expired claims this often, ms [default: 5000]
    #[arg(long, env = "ANKUSA_SWEEP_EVERY_MS")]
    pub sweep_every_ms: Option<u64>,
    /// Requests a tenant may queue before being shed [default: 1024]
    #[arg(long, env = "ANKUSA_TENANT_QUEUE")]
    pub tenant_queue: Option<usize>,
    /// Claims a tenant may hold before new keys are refused [default: 10000000]
    #[arg(long, env = "ANKUSA_MAX_TENANT_CLAIMS")]
    pub max_tenant_claims: Option<usize>,
    /// Threads for the node's work: 1 one thread, 0 one per CPU [default: 1]
    #[arg(long, env = "ANKUSA_WORKER_THREADS")]
    pub worker_threads: Option<usize>,
    /// Address for /metrics, /healthz, /readyz; `off` to disable [default: 127.0.0.1:9464]
    #[arg(long, env = "ANKUSA_HTTP_ADDR")]
    pub http_addr: Option<String>,
    /// Log format [default: human]
    #[arg(long, env = "ANKUSA_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Log filter, as RUST_LOG [default: info]
    #[arg(long, env = "ANKUSA_LOG")]
    pub log_level: Option<String>,
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Parse {
        path: PathBuf,
        source: Box<toml::de::Error>,
    },
    #[error("invalid setting `{field}`: {reason}")]
    Invalid { field: &'static str, reason: String },
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        reason: reason.into(),
    }
}

impl NodeConfig {
    /// The file (if any) with the overrides applied, validated.
    pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Self, ConfigError> {
        let mut config = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.to_owned(),
                    source,
                })?;
                toml::from_str(&text).map_err(|source| ConfigError::Parse {
                    path: path.to_owned(),
                    source: Box::new(source),
                })?
            }
            None => NodeConfig::default(),
        };
        config.apply(overrides)?;
        config.validate()?;
        Ok(config)
    }

    fn apply(&mut self, o: &Overrides) -> Result<(), ConfigError> {
        set(&mut self.instance, &o.instance);
        set(&mut self.node_id, &o.node_id);
        set(&mut self.shards, &o.shards);
        set(&mut self.mode, &o.mode);
        o.nats.apply_to(&mut self.nats);
        set(&mut self.kv_replicas, &o.kv_replicas);
        set(&mut self.lease_ttl_ms, &o.lease_ttl_ms);
        set(&mut self.lease_margin_ms, &o.lease_margin_ms);
        set(&mut self.lease_renew_ms, &o.lease_renew_ms);
        set(&mut self.write_behind_ms, &o.write_behind_ms);
        set(&mut self.tenant_queue, &o.tenant_queue);
        set(&mut self.max_tenant_claims, &o.max_tenant_claims);
        set(&mut self.worker_threads, &o.worker_threads);
        set(&mut self.idle_after_ms, &o.idle_after_ms);
        set(&mut self.sweep_every_ms, &o.sweep_every_ms);
        set(&mut self.log_format, &o.log_format);
        set(&mut self.log_level, &o.log_level);
        if let Some(addr) = &o.http_addr {
            self.http_addr = http_addr_text::parse(addr).map_err(|e| invalid("http_addr", e))?;
        }
        Ok(())
    }

    /// Checks every setting against the others.
    pub fn validate(&self) -> Result<(), ConfigError> {
        Subjects::new(&self.instance).map_err(|e| invalid("instance", e.to_string()))?;
        if !ankusa_bus::is_node_id(&self.node_id) {
            return Err(invalid(
                "node_id",
                format!(
                    "`{}` must be 1 to 128 of A-Z, a-z, 0-9, `-`, `_`",
                    self.node_id
                ),
            ));
        }
        if self.shards == 0 || self.shards > MAX_SHARDS {
            return Err(invalid(
                "shards",
                format!("{} is not in 1..={MAX_SHARDS}", self.shards),
            ));
        }
        if self.nats.servers.is_empty() {
            return Err(invalid("nats.servers", "at least one NATS URL is needed"));
        }
        self.nats
            .validate()
            .map_err(|e| invalid("nats", e.to_string()))?;
        if !(1..=5).contains(&self.kv_replicas) {
            return Err(invalid("kv_replicas", "must be 1 to 5"));
        }
        if self.lease_ttl_ms < 1_000 || self.lease_ttl_ms % 1_000 != 0 {
            return Err(invalid(
                "lease_ttl_ms",
                format!(
                    "{} is not a whole number of seconds of at least 1000: KV per-message TTL is in whole seconds, and the node must not count on a lease longer than the server keeps it",
                    self.lease_ttl_ms
                ),
            ));
        }
        if self.lease_margin_ms < MIN_LEASE_MARGIN_MS {
            return Err(invalid(
                "lease_margin_ms",
                format!(
                    "{} is below {MIN_LEASE_MARGIN_MS}: the fence that keeps a paused node from answering for a shard another has taken needs room for the node's and the server's clocks to run at slightly different rates",
                    self.lease_margin_ms
                ),
            ));
        }
        // Saturating: a huge value must fail here, not wrap into a small one.
        if self.lease_margin_ms.saturating_add(self.lease_renew_ms) >= self.lease_ttl_ms {
            return Err(invalid(
                "lease_renew_ms",
                format!(
                    "renew period ({}) + safety margin ({}) must be below the lease TTL ({}), or leases lapse between renewals",
                    self.lease_renew_ms, self.lease_margin_ms, self.lease_ttl_ms
                ),
            ));
        }
        // Each KV call of a round (heartbeat, renewal, take) waits at most
        // half of what the renewal period and the margin leave of the TTL:
        // less than this fails on a healthy replicated bucket, and the node
        // would never read the server's time, or lose its leases to one slow ack.
        let slack = self.lease_ttl_ms - self.lease_margin_ms - self.lease_renew_ms;
        if slack < 2 * MIN_KV_WAIT_MS {
            return Err(invalid(
                "lease_renew_ms",
                format!(
                    "lease_ttl_ms − lease_margin_ms − lease_renew_ms is {slack} ms; it must be at least {} ms, since half of it bounds each KV call of a round",
                    2 * MIN_KV_WAIT_MS
                ),
            ));
        }
        if self.lease_renew_ms < MIN_RENEW_MS {
            return Err(invalid(
                "lease_renew_ms",
                format!(
                    "{} is below {MIN_RENEW_MS}: every round renews every lease and heartbeats",
                    self.lease_renew_ms
                ),
            ));
        }
        if self.write_behind_ms == 0 || self.sweep_every_ms == 0 || self.idle_after_ms == 0 {
            return Err(invalid(
                "write_behind_ms/sweep_every_ms/idle_after_ms",
                "periods must be above 0",
            ));
        }
        if let Err(err) = tracing_subscriber::EnvFilter::try_new(&self.log_level) {
            return Err(invalid("log_level", format!("`{}`: {err}", self.log_level)));
        }
        if self.tenant_queue == 0 {
            return Err(invalid("tenant_queue", "must be at least 1"));
        }
        if self.max_tenant_claims == 0 {
            return Err(invalid("max_tenant_claims", "must be at least 1"));
        }
        if self.worker_threads > MAX_WORKER_THREADS {
            return Err(invalid(
                "worker_threads",
                format!(
                    "{} is over {MAX_WORKER_THREADS}; 1 is one thread, 0 one per CPU",
                    self.worker_threads
                ),
            ));
        }
        Ok(())
    }

    pub fn subjects(&self) -> Subjects {
        // Validated in `validate`; the fallback is unreachable in a loaded config.
        Subjects::new(&self.instance)
            .unwrap_or_else(|_| Subjects::new("default").expect("valid name"))
    }

    /// The lease TTL as the server applies it: whole seconds.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_ms / 1_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_then_overrides_then_validation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.toml");
        std::fs::write(
            &path,
            "instance = \"prod\"\nshards = 16\nnode_id = \"a\"\n[nats]\nservers = [\"nats://10.0.0.1:4222\"]\n",
        )
        .unwrap();
        let overrides = Overrides {
            shards: Some(32),
            ..Overrides::default()
        };
        let config = NodeConfig::load(Some(&path), &overrides).unwrap();
        assert_eq!(config.instance, "prod");
        assert_eq!(config.shards, 32);
        assert_eq!(
            config.nats.servers,
            vec!["nats://10.0.0.1:4222".to_string()]
        );
    }

    #[test]
    fn the_http_endpoint_is_switched_off_in_the_file_as_on_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.toml");
        let load = |text: &str| {
            std::fs::write(&path, text).unwrap();
            NodeConfig::load(Some(&path), &Overrides::default())
        };
        assert_eq!(load("").unwrap().http_addr, NodeConfig::default().http_addr);
        for off in ["off", "none", ""] {
            let config = load(&format!("http_addr = \"{off}\"\n")).unwrap();
            assert_eq!(config.http_addr, None, "{off:?}");
        }
        let config = load("http_addr = \"0.0.0.0:9100\"\n").unwrap();
        assert_eq!(
            config.http_addr,
            Some(SocketAddr::from(([0, 0, 0, 0], 9100)))
        );
        let refused = load("http_addr = \"localhost:9100\"\n")
            .unwrap_err()
            .to_string();
        assert!(refused.contains("localhost:9100"), "{refused}");
        // What is written back reads the same.
        let off = NodeConfig {
            http_addr: None,
            ..NodeConfig::default()
        };
        let text = toml::to_string(&off).unwrap();
        assert!(text.contains("http_addr = \"off\""), "{text}");
        assert_eq!(load(&text).unwrap(), off);
    }

    #[test]
    fn clear_refusals() {
        let bad = |o: Overrides| NodeConfig::load(None, &o).unwrap_err().to_string();
        assert!(bad(Overrides {
            shards: Some(0),
            ..Default::default()
        })
        .contains("shards"));
        assert!(bad(Overrides {
            instance: Some("A.B".into()),
            ..Default::default()
        })
        .contains("instance"));
        assert!(bad(Overrides {
            lease_ttl_ms: Some(2500),
            ..Default::default()
        })
        .contains("lease"));
        assert!(bad(Overrides {
            http_addr: Some("nope".into()),
            ..Default::default()
        })
        .contains("http_addr"));
        assert!(bad(Overrides {
            worker_threads: Some(5_000),
            ..Default::default()
        })
        .contains("worker_threads"));
        // Timings that pass the sum but leave a KV call no time to answer.
        let starved = bad(Overrides {
            lease_ttl_ms: Some(2_000),
            lease_renew_ms: Some(1_000),
            lease_margin_ms: Some(999),
            ..Default::default()
        });
        assert!(starved.contains("bounds each KV call"), "{starved}");
        let hasty = bad(Overrides {
            lease_renew_ms: Some(1),
            ..Default::default()
        });
        assert!(hasty.contains("below 100"), "{hasty}");
        // NATS settings that could never connect are refused with the rest.
        let half = bad(Overrides {
            nats: NatsArgs {
                nats_user: Some("ankusa-node".into()),
                ..Default::default()
            },
            ..Default::default()
        });
        assert!(half.contains("`user` and `password` go together"), "{half}");
        let creds = bad(Overrides {
            nats: NatsArgs {
                nats_creds: Some("/nonexistent/ankusa.creds".into()),
                ..Default::default()
            },
            ..Default::default()
        });
        assert!(creds.contains("credentials file"), "{creds}");
        // A margin so large that the sum would wrap to a small one.
        let margin = bad(Overrides {
            lease_margin_ms: Some(u64::MAX),
            ..Default::default()
        });
        assert!(margin.contains("must be below the lease TTL"), "{margin}");
        let no_fence = bad(Overrides {
            lease_margin_ms: Some(0),
            ..Default::default()
        });
        assert!(no_fence.contains("lease_margin_ms"), "{no_fence}");
        let no_idle = bad(Overrides {
            idle_after_ms: Some(0),
            ..Default::default()
        });
        assert!(no_idle.contains("idle_after_ms"), "{no_idle}");
        let no_claims = bad(Overrides {
            max_tenant_claims: Some(0),
            ..Default::default()
        });
        assert!(no_claims.contains("max_tenant_claims"), "{no_claims}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.toml");
        std::fs::write(&path, "shardz = 3\n").unwrap();
        let err = NodeConfig::load(Some(&path), &Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("shardz"), "{err}");
    }
}
