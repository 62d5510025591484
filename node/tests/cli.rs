//! The `ankusa` CLI as a person uses it: `--help`, and `hit`, `settle`, `reset`
//! and `status` against a standalone node started here on a real nats-server
//! (found as `NATS_SERVER_BIN` or on PATH; the test fails without one).
//!
//! This crate cannot use the shared harness (`ankusa-tests` depends on it), so
//! it finds nats-server the same way on its own. Every run of the CLI is
//! bounded ([`BOUND`]): one that hangs fails the test instead of holding it.

use std::io::Read;
use std::net::TcpListener;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The longest one run of the CLI may take.
const BOUND: Duration = Duration::from_secs(60);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// `NATS_SERVER_BIN` if set, else `nats-server` on PATH; a panic that says how
/// to get one otherwise.
fn nats_server() -> PathBuf {
    const HINT: &str = "run with NATS_SERVER_BIN=$(scripts/ensure-nats.sh), \
                        which finds or installs a nats-server";
    if let Some(path) = std::env::var_os("NATS_SERVER_BIN").filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "NATS_SERVER_BIN={} is no file; {HINT}",
            path.display()
        );
        return path;
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("nats-server"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("no nats-server: NATS_SERVER_BIN is unset and none is on PATH; {HINT}")
        })
}

/// Waits for `child` to end, at most `BOUND`, and collects what it wrote (on
/// threads, so that a full pipe never holds it up). One that runs longer is
/// killed, and the test fails.
fn wait_within(mut child: Child, what: &str) -> Output {
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        pipe.map(|mut pipe| {
            std::thread::spawn(move || {
                let mut bytes = Vec::new();
                let _ = pipe.read_to_end(&mut bytes);
                bytes
            })
        })
    };
    let stdout = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the CLI") {
            break status;
        }
        if started.elapsed() > BOUND {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} ran for over {BOUND:?} and was killed");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let collect = |reader: Option<std::thread::JoinHandle<Vec<u8>>>| {
        reader.map_or_else(Vec::new, |r| r.join().expect("pipe reader"))
    };
    Output {
        status,
        stdout: collect(stdout),
        stderr: collect(stderr),
    }
}

/// `cmd`'s output, like [`Command::output`] but bounded.
fn output_within(mut cmd: Command) -> Output {
    let what = format!("{:?}", cmd);
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ankusa runs");
    wait_within(child, &what)
}

/// Kills its child when dropped, so a failing test leaves nothing running.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_listening(port: u16) {
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "nothing listens on {port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `ankusa` on the test's instance, ready to run.
fn ankusa_command(nats: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ankusa"));
    cmd.args(["--nats", nats, "--instance", "clitest", "--shards", "8"])
        .args(args)
        .env_remove("ANKUSA_NATS");
    cmd
}

fn ankusa(nats: &str, args: &[&str]) -> Output {
    output_within(ankusa_command(nats, args))
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn help_lists_every_subcommand() {
    let mut help = Command::new(env!("CARGO_BIN_EXE_ankusa"));
    help.arg("--help");
    let out = output_within(help);
    assert!(out.status.success());
    let text = stdout(&out);
    for sub in ["hit", "settle", "reset", "status", "bench"] {
        assert!(text.contains(sub), "{sub} missing from:\n{text}");
    }
}

#[test]
fn calls_against_a_standalone_node() {
    let dir = tempfile::tempdir().expect("temp dir");
    let port = free_port();
    let _nats = Proc(
        Command::new(nats_server())
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server starts"),
    );
    wait_listening(port);
    let nats = format!("nats://127.0.0.1:{port}");
    let http = free_port();
    let _node = Proc(
        Command::new(env!("CARGO_BIN_EXE_ankusa-node"))
            .args([
                "--mode",
                "standalone",
                "--nats",
                &nats,
                "--instance",
                "clitest",
            ])
            .args(["--shards", "8", "--node-id", "cli-test"])
            .args(["--http-addr", &format!("127.0.0.1:{http}")])
            .args(["--log-level", "warn"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("ankusa-node starts"),
    );
    wait_listening(http);

    // The node subscribes right after it connects: retry the first call briefly.
    let claim = [
        "--tenant", "acme", "--source", "gh", "--key", "e1", "--hook", "h1",
    ];
    let start = Instant::now();
    let first = loop {
        let out = ankusa(&nats, &[&["hit"][..], &claim[..]].concat());
        if out.status.success() || start.elapsed() > Duration::from_secs(10) {
            break out;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(first.status.success(), "{first:?}");
    assert!(stdout(&first).starts_with("ok (fleet, "), "{first:?}");

    // Taken by h1 and in flight: another hook is told to wait.
    let other = [
        "--tenant", "acme", "--source", "gh", "--key", "e1", "--hook", "h2",
    ];
    let pending = ankusa(&nats, &[&["hit"][..], &other[..]].concat());
    assert!(pending.status.success());
    assert!(
        stdout(&pending).starts_with("pending: retry after"),
        "{pending:?}"
    );

    let settle = ankusa(
        &nats,
        &[&["settle"][..], &claim[..], &["--commit"][..]].concat(),
    );
    assert!(stdout(&settle).starts_with("ok (fleet, "), "{settle:?}");
    let dup = ankusa(&nats, &[&["hit"][..], &other[..]].concat());
    assert_eq!(stdout(&dup), "duplicate of hook h1");

    let json = ankusa(&nats, &[&["hit", "--json"][..], &other[..]].concat());
    let value: serde_json::Value = serde_json::from_str(&stdout(&json)).expect("JSON");
    assert_eq!(value["result"], "duplicate");

    // A burst of 1 at 1 hook/s: the second hit is denied.
    let limited = [
        "hit",
        "--tenant",
        "slow",
        "--hooks-per-sec",
        "1",
        "--burst",
        "1",
    ];
    assert!(stdout(&ankusa(&nats, &limited)).starts_with("ok"));
    assert!(stdout(&ankusa(&nats, &limited)).starts_with("rate limited: retry after"));
    let reset = ankusa(&nats, &["reset", "--tenant", "slow"]);
    assert!(stdout(&reset).starts_with("ok"), "{reset:?}");

    // An invalid request is refused before it is sent, with exit code 2.
    let bad = ankusa(&nats, &["hit", "--tenant", "acme", "--key", "k"]);
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");

    // A reader that goes away (`ankusa ... | head`) ends the CLI by SIGPIPE,
    // quietly, as other Unix tools end; not with a panic on the closed pipe.
    let mut gone = ankusa_command(&nats, &["hit", "--tenant", "acme"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ankusa runs");
    drop(gone.stdout.take());
    let gone = wait_within(gone, "ankusa hit with its stdout closed");
    let said = String::from_utf8_lossy(&gone.stderr);
    assert!(!said.contains("panicked"), "{said}");
    assert_eq!(gone.status.signal(), Some(libc::SIGPIPE), "{gone:?}");

    // Nobody serves another instance: an error, exit code 1, within the budget.
    // The budget is roomy so that a loaded machine's stalls land inside the
    // retries (which then say `no_responders`) rather than past the deadline.
    let start = Instant::now();
    let mut none = Command::new(env!("CARGO_BIN_EXE_ankusa"));
    none.args([
        "--nats",
        &nats,
        "--instance",
        "nobody",
        "--timeout-ms",
        "2000",
    ])
    .args(["hit", "--tenant", "acme"]);
    let none = output_within(none);
    assert_eq!(none.status.code(), Some(1), "{none:?}");
    let said = String::from_utf8_lossy(&none.stderr);
    assert!(said.contains("code no_responders"), "{said}");
    assert!(start.elapsed() < Duration::from_secs(5));

    // Status only looks: an instance no node has run is an error, twice over,
    // since the first look did not create its buckets.
    for _ in 0..2 {
        let mut status = Command::new(env!("CARGO_BIN_EXE_ankusa"));
        status.args(["--nats", &nats, "--instance", "nobody", "status"]);
        let status = output_within(status);
        assert_eq!(status.status.code(), Some(1), "{status:?}");
        let said = String::from_utf8_lossy(&status.stderr);
        assert!(
            said.contains("ankusa_nobody_state does not exist"),
            "{said}"
        );
    }
}
