//! A loopback TCP proxy that owns one process's network link to its
//! nats-server(s), so a test can cut that link and restore it: [`NetCut`].
//!
//! The process is given the proxy's URLs instead of the servers' (one proxy
//! port per server, all switched together). The link is in one of three
//! states ([`Link`]):
//!
//! - **Up**: bytes are forwarded both ways.
//! - **Blackhole**: every connection stays open but the proxy stops reading
//!   from both sides, so nothing arrives either way; the kernel's socket
//!   buffers fill and the senders stall, as in a partition that drops packets.
//!   New connections are accepted and held silent. Going back to Up resumes
//!   the same connections, and what was sent meanwhile arrives late.
//! - **Refuse**: every connection is reset (RST, both sides) and the listening
//!   sockets are closed, so new connections are refused, as when a firewall
//!   rejects the host. Going back to Up listens again on the same ports; the
//!   process has to reconnect.
//!
//! Everything binds 127.0.0.1 only. The proxy is bounded: at most
//! [`MAX_LIVE`] connections per server at once (more are reset), at most
//! [`MAX_ACCEPTS`] accepted in its life, one fixed buffer per direction; all
//! of its tasks end when the handle drops. Its loops live as long as a
//! connection or the handle and each turn waits on I/O or a state change, so
//! none spins; waiting for a state change to take effect, and binding the port
//! again, are bounded in time.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::HarnessError;

/// Connections one proxy port carries at once; a process needs one or two.
pub const MAX_LIVE: usize = 64;
/// Connections one proxy port accepts in its whole life.
pub const MAX_ACCEPTS: u64 = 100_000;
/// Bytes read per direction before they are written on.
const BUFFER: usize = 16 * 1024;
/// Bound on connecting to the upstream server.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound on a state change taking effect (listeners closed or open again,
/// connections reset).
const SETTLE_TIMEOUT: Duration = Duration::from_secs(5);

/// The state of the link; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    Up,
    Blackhole,
    Refuse,
}

/// What the proxy has done so far (all ports together).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetCutStats {
    /// Connections accepted.
    pub accepted: u64,
    /// Connections accepted while blackholed (held silent).
    pub held: u64,
    /// Connections reset by a cut, or because the proxy was full or the
    /// upstream unreachable.
    pub reset: u64,
    /// Bytes forwarded process → server and server → process.
    pub bytes_up: u64,
    pub bytes_down: u64,
}

#[derive(Debug, Default)]
struct Counters {
    accepted: AtomicU64,
    held: AtomicU64,
    reset: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
}

/// One proxy port in front of one upstream server.
struct Port {
    port: u16,
    /// Whether its listening socket is open (false while refusing).
    listening: Arc<AtomicBool>,
    /// Connections open through it.
    live: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

/// A cuttable link between one process and its nats-server(s).
pub struct NetCut {
    ports: Vec<Port>,
    link: watch::Sender<Link>,
    counters: Arc<Counters>,
}

impl NetCut {
    /// Starts one proxy port per upstream URL (`nats://127.0.0.1:<port>`), with
    /// the link up.
    pub async fn start(upstreams: &[String]) -> Result<Self, HarnessError> {
        let (link, _) = watch::channel(Link::Up);
        let counters = Arc::new(Counters::default());
        let mut ports = Vec::with_capacity(upstreams.len());
        for url in upstreams {
            let upstream = loopback_addr(url)?;
            let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
                .await
                .map_err(HarnessError::io("bind the net-cut proxy on 127.0.0.1:0"))?;
            let port = listener
                .local_addr()
                .map_err(HarnessError::io("local_addr of the net-cut proxy"))?
                .port();
            let listening = Arc::new(AtomicBool::new(true));
            let live = Arc::new(AtomicU64::new(0));
            let task = tokio::spawn(accept_loop(
                listener,
                port,
                upstream,
                link.subscribe(),
                listening.clone(),
                live.clone(),
                counters.clone(),
            ));
            ports.push(Port {
                port,
                listening,
                live,
                task,
            });
        }
        Ok(Self {
            ports,
            link,
            counters,
        })
    }

    /// The URLs to give the process instead of the servers', in the same order.
    pub fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("nats://127.0.0.1:{}", p.port))
            .collect()
    }

    pub fn link(&self) -> Link {
        *self.link.borrow()
    }

    /// Stops forwarding both ways at once; connections stay open, new ones are
    /// held silent.
    pub fn blackhole(&self) {
        self.link.send_replace(Link::Blackhole);
    }

    /// Resets every connection and refuses new ones; returns once the listening
    /// sockets are closed and no connection is left (bounded).
    pub async fn refuse(&self) -> Result<(), HarnessError> {
        self.link.send_replace(Link::Refuse);
        self.settle("refusing", |p| {
            !p.listening.load(Ordering::Acquire) && p.live.load(Ordering::Acquire) == 0
        })
        .await
    }

    /// Forwards again (resuming blackholed connections); returns once every
    /// port listens again (bounded).
    pub async fn restore(&self) -> Result<(), HarnessError> {
        self.link.send_replace(Link::Up);
        self.settle("restoring", |p| p.listening.load(Ordering::Acquire))
            .await
    }

    async fn settle(&self, what: &str, done: impl Fn(&Port) -> bool) -> Result<(), HarnessError> {
        let began = tokio::time::Instant::now();
        while !self.ports.iter().all(&done) {
            if began.elapsed() >= SETTLE_TIMEOUT {
                let ports: Vec<u16> = self.ports.iter().map(|p| p.port).collect();
                return Err(HarnessError::Io {
                    context: format!("net-cut proxy on ports {ports:?}"),
                    source: io::Error::other(format!(
                        "{what} did not take effect within {SETTLE_TIMEOUT:?}"
                    )),
                });
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }

    pub fn stats(&self) -> NetCutStats {
        let c = &self.counters;
        NetCutStats {
            accepted: c.accepted.load(Ordering::Relaxed),
            held: c.held.load(Ordering::Relaxed),
            reset: c.reset.load(Ordering::Relaxed),
            bytes_up: c.bytes_up.load(Ordering::Relaxed),
            bytes_down: c.bytes_down.load(Ordering::Relaxed),
        }
    }
}

impl Drop for NetCut {
    fn drop(&mut self) {
        // Each accept loop owns its connections' tasks (a JoinSet), so aborting
        // it ends them too.
        for p in &self.ports {
            p.task.abort();
        }
    }
}

/// `nats://127.0.0.1:4222` (or `127.0.0.1:4222`) → the socket address; any
/// other host is refused, the proxy is for loopback only.
fn loopback_addr(url: &str) -> Result<SocketAddr, HarnessError> {
    let hostport = url.strip_prefix("nats://").unwrap_or(url);
    hostport
        .parse::<SocketAddrV4>()
        .ok()
        .filter(|a| *a.ip() == Ipv4Addr::LOCALHOST)
        .map(SocketAddr::V4)
        .ok_or_else(|| HarnessError::Io {
            context: format!("net-cut upstream {url}"),
            source: io::Error::new(
                io::ErrorKind::InvalidInput,
                "expected nats://127.0.0.1:<port>",
            ),
        })
}

/// Accepts connections while the link is up or blackholed, closes the
/// listening socket while it refuses and binds the same port again after.
async fn accept_loop(
    listener: TcpListener,
    port: u16,
    upstream: SocketAddr,
    mut link: watch::Receiver<Link>,
    listening: Arc<AtomicBool>,
    live: Arc<AtomicU64>,
    counters: Arc<Counters>,
) {
    let mut listener = Some(listener);
    let mut connections = JoinSet::new();
    let mut accepts = 0u64;
    while accepts < MAX_ACCEPTS {
        while connections.try_join_next().is_some() {}
        live.store(connections.len() as u64, Ordering::Release);
        let state = *link.borrow_and_update();
        if state == Link::Refuse {
            listener = None;
            listening.store(false, Ordering::Release);
            // The connections see the same state and reset themselves.
            tokio::select! {
                changed = link.changed() => if changed.is_err() { return },
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
            continue;
        }
        let Some(open) = listener.as_ref() else {
            match rebind(port).await {
                Some(l) => {
                    listener = Some(l);
                    listening.store(true, Ordering::Release);
                }
                None => {
                    tracing::warn!(port, "net-cut proxy cannot listen again; giving up");
                    return;
                }
            }
            continue;
        };
        tokio::select! {
            accepted = open.accept() => {
                let Ok((client, _)) = accepted else { continue };
                accepts += 1;
                counters.accepted.fetch_add(1, Ordering::Relaxed);
                if connections.len() >= MAX_LIVE {
                    reset(&client, &counters);
                    continue;
                }
                if state == Link::Blackhole {
                    counters.held.fetch_add(1, Ordering::Relaxed);
                }
                connections.spawn(connection(client, upstream, link.clone(), counters.clone()));
            }
            changed = link.changed() => if changed.is_err() { return },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    tracing::warn!(
        port,
        "net-cut proxy accepted {MAX_ACCEPTS} connections; no more"
    );
}

/// Binds `port` again after a refusal (SO_REUSEADDR is set by tokio), a
/// bounded number of times.
async fn rebind(port: u16) -> Option<TcpListener> {
    for _ in 0..100 {
        if let Ok(l) = TcpListener::bind((Ipv4Addr::LOCALHOST, port)).await {
            return Some(l);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Sends RST instead of FIN when the socket is dropped.
fn reset(stream: &TcpStream, counters: &Counters) {
    let _ = stream.set_zero_linger();
    counters.reset.fetch_add(1, Ordering::Relaxed);
}

/// Waits until the link is up (true) or refusing (false).
async fn wait_up(link: &mut watch::Receiver<Link>) -> bool {
    loop {
        match *link.borrow_and_update() {
            Link::Up => return true,
            Link::Refuse => return false,
            Link::Blackhole => {}
        }
        if link.changed().await.is_err() {
            return false;
        }
    }
}

/// Waits until the link refuses.
async fn wait_refuse(link: &mut watch::Receiver<Link>) {
    loop {
        if *link.borrow_and_update() == Link::Refuse {
            return;
        }
        if link.changed().await.is_err() {
            return;
        }
    }
}

/// How one direction of a connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// EOF or an I/O error on one side: close both.
    Closed,
    /// The link refuses: reset both.
    Refused,
}

/// One proxied connection, from acceptance to close or reset.
async fn connection(
    mut client: TcpStream,
    upstream: SocketAddr,
    mut link: watch::Receiver<Link>,
    counters: Arc<Counters>,
) {
    // A connection made while blackholed is held silent until the link is up.
    if !wait_up(&mut link).await {
        reset(&client, &counters);
        return;
    }
    let mut server = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(upstream)).await
    {
        Ok(Ok(server)) => server,
        // The server is down (a restart): the process sees its connection
        // reset, as it would without the proxy.
        _ => {
            reset(&client, &counters);
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let end = {
        let (mut client_read, mut client_write) = client.split();
        let (mut server_read, mut server_write) = server.split();
        let up = pump(
            &mut client_read,
            &mut server_write,
            link.clone(),
            &counters.bytes_up,
        );
        let down = pump(
            &mut server_read,
            &mut client_write,
            link.clone(),
            &counters.bytes_down,
        );
        tokio::select! {
            end = up => end,
            end = down => end,
        }
    };
    if end == End::Refused {
        reset(&client, &counters);
        let _ = server.set_zero_linger();
    }
}

/// Copies one direction while the link is up. While it is blackholed nothing
/// is read (a read in progress is cancelled, which loses nothing) and what was
/// read before is held until it is up again.
async fn pump(
    from: &mut ReadHalf<'_>,
    to: &mut WriteHalf<'_>,
    mut link: watch::Receiver<Link>,
    bytes: &AtomicU64,
) -> End {
    let mut buf = vec![0u8; BUFFER];
    loop {
        if !wait_up(&mut link).await {
            return End::Refused;
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => return End::Closed,
                Ok(n) => n,
            },
            changed = link.changed() => {
                if changed.is_err() {
                    return End::Closed;
                }
                continue;
            }
        };
        if !wait_up(&mut link).await {
            return End::Refused;
        }
        tokio::select! {
            written = to.write_all(&buf[..n]) => if written.is_err() { return End::Closed },
            _ = wait_refuse(&mut link) => return End::Refused,
        }
        bytes.fetch_add(n as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on loopback: (its URL, the task).
    async fn echo() -> (String, JoinHandle<()>) {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind echo");
        let port = listener.local_addr().expect("echo addr").port();
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            for _ in 0..16 {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                conns.spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (format!("nats://127.0.0.1:{port}"), task)
    }

    async fn round_trip(s: &mut TcpStream, msg: &[u8], within: Duration) -> io::Result<Vec<u8>> {
        s.write_all(msg).await?;
        let mut got = vec![0u8; msg.len()];
        tokio::time::timeout(within, s.read_exact(&mut got))
            .await
            .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))??;
        Ok(got)
    }

    fn port_of(url: &str) -> u16 {
        loopback_addr(url).expect("proxy url").port()
    }

    #[tokio::test]
    async fn blackhole_holds_bytes_until_restored_and_refuse_resets_and_refuses() {
        let (upstream, _echo) = echo().await;
        let cut = NetCut::start(std::slice::from_ref(&upstream))
            .await
            .expect("proxy starts");
        let port = port_of(&cut.urls()[0]);
        let mut s = TcpStream::connect((Ipv4Addr::LOCALHOST, port))
            .await
            .expect("connect through the proxy");
        let short = Duration::from_millis(300);
        assert_eq!(round_trip(&mut s, b"up", short).await.expect("echo"), b"up");

        // Blackholed: nothing comes back, on this connection or a new one...
        cut.blackhole();
        assert_eq!(
            round_trip(&mut s, b"late", short)
                .await
                .map_err(|e| e.kind()),
            Err(io::ErrorKind::TimedOut)
        );
        let mut held = TcpStream::connect((Ipv4Addr::LOCALHOST, port))
            .await
            .expect("a new connection is accepted while blackholed");
        assert!(round_trip(&mut held, b"hi", short).await.is_err());
        // ...until restored: then what was sent meanwhile arrives, late.
        cut.restore().await.expect("restore");
        let mut got = [0u8; 4];
        tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut got))
            .await
            .expect("the held bytes arrive")
            .expect("read");
        assert_eq!(&got, b"late");
        let mut got = [0u8; 2];
        tokio::time::timeout(Duration::from_secs(2), held.read_exact(&mut got))
            .await
            .expect("the held connection goes through")
            .expect("read");
        assert_eq!(&got, b"hi");

        // Refused: live connections are reset and new ones refused.
        cut.refuse().await.expect("refuse");
        let mut buf = [0u8; 8];
        let read = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf))
            .await
            .expect("the reset arrives");
        assert_eq!(
            read.map_err(|e| e.kind()),
            Err(io::ErrorKind::ConnectionReset)
        );
        let refused = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await;
        assert_eq!(
            refused.map(|_| ()).map_err(|e| e.kind()),
            Err(io::ErrorKind::ConnectionRefused)
        );

        // Restored: the same port takes connections again.
        cut.restore().await.expect("restore");
        let mut again = TcpStream::connect((Ipv4Addr::LOCALHOST, port))
            .await
            .expect("connect after restore");
        assert_eq!(
            round_trip(&mut again, b"back", short).await.expect("echo"),
            b"back"
        );
        let stats = cut.stats();
        assert_eq!(stats.accepted, 3);
        assert_eq!(stats.held, 1);
        assert!(stats.reset >= 2, "{stats:?}");
    }

    #[test]
    fn only_loopback_upstreams() {
        assert!(loopback_addr("nats://127.0.0.1:4222").is_ok());
        assert!(loopback_addr("127.0.0.1:4222").is_ok());
        assert!(loopback_addr("nats://10.0.0.1:4222").is_err());
        assert!(loopback_addr("nats://localhost:4222").is_err());
    }
}
