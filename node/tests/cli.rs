//! The `ankusa` CLI as a person uses it: `--help`, and `hit`, `settle`, `reset`
//! and `status` against a standalone node started here on a real nats-server
//! (found as `NATS_SERVER_BIN` or on PATH; the test fails without one).

use std::net::TcpListener;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn nats_server() -> PathBuf {
    if let Some(path) = std::env::var_os("NATS_SERVER_BIN") {
        return PathBuf::from(path);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("nats-server"))
        .find(|p| p.is_file())
        .expect("nats-server is needed (scripts/ensure-nats.sh installs one)")
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
    ankusa_command(nats, args).output().expect("ankusa runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn help_lists_every_subcommand() {
    let out = Command::new(env!("CARGO_BIN_EXE_ankusa"))
        .arg("--help")
        .output()
        .expect("ankusa runs");
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
    let gone = gone.wait_with_output().expect("ankusa ends");
    let said = String::from_utf8_lossy(&gone.stderr);
    assert!(!said.contains("panicked"), "{said}");
    assert_eq!(gone.status.signal(), Some(libc::SIGPIPE), "{gone:?}");

    // Nobody serves another instance: an error, exit code 1, within the budget.
    // The budget is roomy so that a loaded machine's stalls land inside the
    // retries (which then say `no_responders`) rather than past the deadline.
    let start = Instant::now();
    let none = Command::new(env!("CARGO_BIN_EXE_ankusa"))
        .args([
            "--nats",
            &nats,
            "--instance",
            "nobody",
            "--timeout-ms",
            "2000",
        ])
        .args(["hit", "--tenant", "acme"])
        .output()
        .expect("ankusa runs");
    assert_eq!(none.status.code(), Some(1), "{none:?}");
    let said = String::from_utf8_lossy(&none.stderr);
    assert!(said.contains("code no_responders"), "{said}");
    assert!(start.elapsed() < Duration::from_secs(5));

    // Status only looks: an instance no node has run is an error, twice over,
    // since the first look did not create its buckets.
    for _ in 0..2 {
        let status = Command::new(env!("CARGO_BIN_EXE_ankusa"))
            .args(["--nats", &nats, "--instance", "nobody", "status"])
            .output()
            .expect("ankusa runs");
        assert_eq!(status.status.code(), Some(1), "{status:?}");
        let said = String::from_utf8_lossy(&status.stderr);
        assert!(
            said.contains("ankusa_nobody_state does not exist"),
            "{said}"
        );
    }
}
