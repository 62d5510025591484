//! How edges and nodes reach NATS: servers, credentials and TLS, as one
//! serde-friendly struct shared by the node's config file and the edge client.
//!
//! Connecting never blocks on an unreachable server: the client is handed back at
//! once and keeps (re)connecting in the background, so a NATS outage degrades a
//! process, it never stops it from starting.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Connection settings for NATS.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsOptions {
    /// Server URLs; several for a cluster.
    pub servers: Vec<String>,
    /// Name shown in the server's connection list.
    pub name: Option<String>,
    pub user: Option<String>,
    pub password: Option<String>,
    pub token: Option<String>,
    /// An nkey seed (`SU...`).
    pub nkey_seed: Option<String>,
    /// A `.creds` file (JWT + nkey seed).
    pub creds_file: Option<PathBuf>,
    /// CA certificate(s) to trust, PEM.
    pub tls_ca: Option<PathBuf>,
    /// Client certificate and key, PEM, for servers that verify clients.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// Refuse a connection that is not TLS.
    pub require_tls: bool,
    /// Longest pause between reconnect attempts, ms.
    pub max_reconnect_delay_ms: u64,
    /// Where answers come back (`<prefix>.<id>.*`) instead of the shared
    /// `_INBOX`, so that a user whose subscriptions are limited to
    /// `<prefix>.>` reads its own answers and nobody else's.
    pub inbox_prefix: Option<String>,
}

impl Default for NatsOptions {
    fn default() -> Self {
        Self {
            servers: vec!["nats://127.0.0.1:4222".into()],
            name: None,
            user: None,
            password: None,
            token: None,
            nkey_seed: None,
            creds_file: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            require_tls: false,
            max_reconnect_delay_ms: 1000,
            inbox_prefix: None,
        }
    }
}

/// Why NATS settings cannot be used. These are configuration mistakes, never
/// reachability: an unreachable server is not an error at connect time.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("no NATS server URL given")]
    NoServers,
    #[error("bad NATS server URL `{url}`: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("`user` and `password` go together")]
    HalfCredentials,
    #[error("`tls_cert` and `tls_key` go together")]
    HalfClientCert,
    #[error("credentials file {path}: {source}")]
    CredsFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("`{setting}` {path}: {source}")]
    TlsFile {
        setting: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("one way to authenticate, not {0}: user and password, token, nkey_seed or creds_file")]
    SeveralAuthMethods(String),
    #[error("inbox prefix `{0}`: one or more dot-separated tokens of printable characters, without `*` or `>`")]
    BadInboxPrefix(String),
    #[error("NATS client: {0}")]
    Client(String),
}

/// A literal subject of one or more tokens: what the client may put before
/// `.<id>.*` and subscribe to.
fn is_subject_prefix(prefix: &str) -> bool {
    prefix.split('.').all(|token| {
        !token.is_empty()
            && token
                .chars()
                .all(|c| c.is_ascii_graphic() && c != '*' && c != '>')
    })
}

impl NatsOptions {
    pub fn with_servers(servers: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            servers: servers.into_iter().map(Into::into).collect(),
            ..Self::default()
        }
    }

    /// Every mistake these settings can hold, found without connecting: a
    /// process can refuse them at start rather than fail when it connects.
    pub fn validate(&self) -> Result<(), ConnectError> {
        self.server_addrs()?;
        if self.user.is_some() != self.password.is_some() {
            return Err(ConnectError::HalfCredentials);
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(ConnectError::HalfClientCert);
        }
        let methods: Vec<&str> = [
            (self.user.is_some(), "user and password"),
            (self.token.is_some(), "token"),
            (self.nkey_seed.is_some(), "nkey_seed"),
            (self.creds_file.is_some(), "creds_file"),
        ]
        .into_iter()
        .filter_map(|(set, name)| set.then_some(name))
        .collect();
        if methods.len() > 1 {
            return Err(ConnectError::SeveralAuthMethods(methods.join(", ")));
        }
        if let Some(path) = &self.creds_file {
            std::fs::File::open(path).map_err(|source| ConnectError::CredsFile {
                path: path.clone(),
                source,
            })?;
        }
        // The client reads these only when it connects, and says why it could
        // not at debug level only: a typo would leave the process retrying.
        for (setting, path) in [
            ("tls_ca", &self.tls_ca),
            ("tls_cert", &self.tls_cert),
            ("tls_key", &self.tls_key),
        ] {
            if let Some(path) = path {
                std::fs::File::open(path).map_err(|source| ConnectError::TlsFile {
                    setting,
                    path: path.clone(),
                    source,
                })?;
            }
        }
        match &self.inbox_prefix {
            Some(prefix) if !is_subject_prefix(prefix) => {
                Err(ConnectError::BadInboxPrefix(prefix.clone()))
            }
            _ => Ok(()),
        }
    }

    fn server_addrs(&self) -> Result<Vec<async_nats::ServerAddr>, ConnectError> {
        if self.servers.is_empty() {
            return Err(ConnectError::NoServers);
        }
        self.servers
            .iter()
            .map(|url| {
                url.parse::<async_nats::ServerAddr>()
                    .map_err(|e| ConnectError::BadUrl {
                        url: url.clone(),
                        reason: e.to_string(),
                    })
            })
            .collect()
    }

    /// The client's options, for settings that passed [`NatsOptions::validate`].
    async fn connect_options(&self) -> Result<async_nats::ConnectOptions, ConnectError> {
        let mut opts = async_nats::ConnectOptions::new();
        if let (Some(user), Some(pass)) = (&self.user, &self.password) {
            opts = opts.user_and_password(user.clone(), pass.clone());
        }
        if let Some(token) = &self.token {
            opts = opts.token(token.clone());
        }
        if let Some(seed) = &self.nkey_seed {
            opts = opts.nkey(seed.clone());
        }
        if let Some(path) = &self.creds_file {
            opts = opts
                .credentials_file(path)
                .await
                .map_err(|source| ConnectError::CredsFile {
                    path: path.clone(),
                    source,
                })?;
        }
        if let Some(ca) = &self.tls_ca {
            opts = opts.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            opts = opts.add_client_certificate(cert.clone(), key.clone());
        }
        if let Some(name) = &self.name {
            opts = opts.name(name);
        }
        if let Some(prefix) = &self.inbox_prefix {
            opts = opts.custom_inbox_prefix(prefix.as_str());
        }
        let max_delay = Duration::from_millis(self.max_reconnect_delay_ms.max(10));
        Ok(opts
            .require_tls(self.require_tls)
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connection_timeout(Duration::from_secs(2))
            .ping_interval(Duration::from_secs(5))
            // Callers bound every request themselves.
            .request_timeout(None)
            .reconnect_delay_callback(move |attempts| {
                let step = Duration::from_millis(25).saturating_mul(1 << attempts.min(10) as u32);
                step.min(max_delay)
            }))
    }

    /// A client that is returned at once and connects in the background.
    pub async fn connect(&self) -> Result<async_nats::Client, ConnectError> {
        self.connect_with_events(|_| {}).await
    }

    /// [`NatsOptions::connect`], with `on_event` told of each connection event
    /// (disconnects, server errors such as permission violations, ...).
    pub async fn connect_with_events(
        &self,
        on_event: impl Fn(async_nats::Event) + Send + Sync + 'static,
    ) -> Result<async_nats::Client, ConnectError> {
        self.validate()?;
        let addrs = self.server_addrs()?;
        let on_event = std::sync::Arc::new(on_event);
        let opts = self.connect_options().await?.event_callback(move |event| {
            on_event(event);
            std::future::ready(())
        });
        opts.connect(addrs)
            .await
            .map_err(|e| ConnectError::Client(e.to_string()))
    }
}

/// Returns once the server has taken in everything `client` sent before this
/// call, a subscription say, so that what other clients publish next reaches
/// it. `Client::flush` only writes the socket: the server may still be
/// reading it while another connection's messages find no subscriber (and
/// their requests hear "no responders"). The proof is a message of the
/// client's own, sent after, come back through the server. Callers bound it.
pub async fn server_caught_up(client: &async_nats::Client) -> Result<(), ConnectError> {
    use futures::StreamExt;
    let inbox = client.new_inbox();
    let mut echo = client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| ConnectError::Client(e.to_string()))?;
    client
        .publish(inbox, bytes::Bytes::new())
        .await
        .map_err(|e| ConnectError::Client(e.to_string()))?;
    match echo.next().await {
        Some(_) => Ok(()),
        None => Err(ConnectError::Client("the connection closed".into())),
    }
}

/// How long one JetStream API request (a stream's info, a consumer made or
/// deleted, a bucket opened) may wait for its answer in a [`jetstream`]
/// context: async-nats 0.51's default.
pub const JETSTREAM_API_BOUND: Duration = Duration::from_secs(5);

/// A JetStream context on `client` whose API requests fail after
/// [`JETSTREAM_API_BOUND`]. The connection's own request timeout is off
/// (every call of ours is bounded by its own deadline), and since async-nats
/// 0.52 a context without a timeout of its own takes the connection's: its
/// requests (a consumer deleted after a load, the nodes' watch, `ankusa
/// status`) could wait forever on a server that stopped answering.
pub fn jetstream(client: async_nats::Client) -> async_nats::jetstream::Context {
    async_nats::jetstream::ContextBuilder::new()
        .timeout(JETSTREAM_API_BOUND)
        .build(client)
}

/// How often [`connection_ended`] asks whether the connection's task is
/// still there.
const CONNECTION_CHECK_EVERY: Duration = Duration::from_secs(1);

/// Returns once `client`'s connection task has ended for good, which in
/// async-nats is after a `drain`, or when the task panicked on something it
/// read (as async-nats did before 0.52 on a line break in a header value).
/// The client then never reconnects and every publish fails, while its
/// state still reads "connected": a process holding it is alive, ready and
/// useless until it is restarted. A reconnecting client does not end it.
///
/// `ankusa-node` exits when its connection ends. An edge that wants the same
/// watches its store's, `connection_ended(store.nats())`: until it acts,
/// every call of its [`Edge`](crate::Edge) is answered from local state.
pub async fn connection_ended(client: &async_nats::Client) {
    use async_nats::client::FlushErrorKind;
    loop {
        tokio::time::sleep(CONNECTION_CHECK_EVERY).await;
        // A flush is a command to the connection's task; only a task that is
        // gone refuses to take it. A disconnected one takes it and answers
        // after the reconnect, which the timeout leaves for the next check.
        if let Ok(Err(err)) = tokio::time::timeout(CONNECTION_CHECK_EVERY, client.flush()).await {
            if err.kind() == FlushErrorKind::SendError {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{is_subject_prefix, ConnectError, NatsOptions};

    #[test]
    fn settings_that_could_never_connect_are_refused_before_connecting() {
        let missing = std::path::PathBuf::from("/nonexistent/ankusa/ca.pem");
        let tls = NatsOptions {
            tls_ca: Some(missing.clone()),
            ..NatsOptions::default()
        };
        assert!(matches!(
            tls.validate(),
            Err(ConnectError::TlsFile { setting: "tls_ca", path, .. }) if path == missing
        ));
        let cert_and_key = NatsOptions {
            tls_cert: Some(missing.clone()),
            tls_key: Some(missing.clone()),
            ..NatsOptions::default()
        };
        assert!(matches!(
            cert_and_key.validate(),
            Err(ConnectError::TlsFile {
                setting: "tls_cert",
                ..
            })
        ));
        let two_ways = NatsOptions {
            token: Some("t".into()),
            nkey_seed: Some("SU".into()),
            ..NatsOptions::default()
        };
        assert!(matches!(
            two_ways.validate(),
            Err(ConnectError::SeveralAuthMethods(which)) if which == "token, nkey_seed"
        ));
        let one_way = NatsOptions {
            user: Some("u".into()),
            password: Some("p".into()),
            ..NatsOptions::default()
        };
        assert!(one_way.validate().is_ok());
    }

    #[test]
    fn an_inbox_prefix_is_a_literal_subject() {
        for good in ["_INBOX_edge_eu1", "_INBOX.edge1", "a.b.c"] {
            assert!(is_subject_prefix(good), "{good}");
        }
        for bad in ["", ".", "a.", ".a", "a..b", "a b", "a.*", ">", "a\tb"] {
            assert!(!is_subject_prefix(bad), "{bad:?}");
        }
    }
}
