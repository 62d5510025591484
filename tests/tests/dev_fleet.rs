//! The README's one command for a local fleet, `scripts/dev-fleet.sh`, works as
//! shipped: with `--detach` it starts nats-server with JetStream and three
//! `ankusa-node`s (here in a temporary directory, on the binaries of this test
//! build), every node gets ready and serves shards, its burst gets every kind of
//! answer (ok, rate limited, committed, duplicate, pending) and no error,
//! `status` lists every process serving, and `stop` ends every process it
//! started, after which `status` finds no fleet.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use ankusa_tests::{cargo_bin, nats_server_bin, outer_cargo_env, workspace_root};

/// Bound on any one run of the script (it bounds its own waits, too).
const LIMIT_S: &str = "300";

/// The script, run with this test's fleet directory and build.
struct DevFleet {
    dir: tempfile::TempDir,
    profile: &'static str,
    target: PathBuf,
    nats: PathBuf,
}

impl DevFleet {
    fn new() -> Self {
        // Fail here, clearly, rather than let the script install a server.
        let nats = nats_server_bin();
        let node = cargo_bin("ankusa-node");
        let profile_dir = node.parent().expect("a binary is in a directory");
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("release") => "release",
            _ => "dev",
        };
        Self {
            dir: tempfile::tempdir().expect("a temporary directory"),
            profile,
            target: profile_dir
                .parent()
                .expect("a profile directory is in a target directory")
                .to_path_buf(),
            nats,
        }
    }

    fn run(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new("timeout");
        cmd.arg(LIMIT_S)
            .arg(workspace_root().join("scripts/dev-fleet.sh"))
            .args(args);
        outer_cargo_env(&mut cmd)
            .env("DEV_FLEET_DIR", self.dir.path())
            .env("DEV_FLEET_PROFILE", self.profile)
            .env("CARGO_TARGET_DIR", &self.target)
            .env("NATS_SERVER_BIN", &self.nats)
            .env_remove("ANKUSA_CONFIG")
            .stdin(Stdio::null())
            .output()
            .expect("runs scripts/dev-fleet.sh")
    }

    /// The pids its pid files name.
    fn pids(&self) -> Vec<(String, u32)> {
        let run = self.dir.path().join("run");
        let mut pids: Vec<(String, u32)> = std::fs::read_dir(&run)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                let name = name.strip_suffix(".pid")?.to_string();
                let pid = std::fs::read_to_string(entry.path()).ok()?;
                Some((name, pid.trim().parse().ok()?))
            })
            .collect();
        pids.sort();
        pids
    }
}

impl Drop for DevFleet {
    /// A failed test leaves no process behind.
    fn drop(&mut self) {
        self.run(&["stop"]);
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn describe(out: &Output) -> String {
    format!(
        "exited {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    )
}

/// Whether `pid` runs (a zombie has no command line).
fn alive(pid: u32) -> bool {
    std::fs::read(Path::new("/proc").join(pid.to_string()).join("cmdline"))
        .is_ok_and(|cmdline| !cmdline.is_empty())
}

/// The count on a line of the burst's report, such as `  duplicate   787`.
fn count(report: &str, answer: &str) -> u64 {
    report
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some(answer))
                .then(|| words.next()?.parse::<u64>().ok())
                .flatten()
        })
        .sum()
}

#[test]
fn the_dev_fleet_comes_up_serves_and_stops() {
    let fleet = DevFleet::new();
    let up = fleet.run(&["--detach"]);
    let report = text(&up.stdout);
    assert!(up.status.success(), "{}", describe(&up));
    assert!(
        report.contains("dev-fleet: the fleet is up."),
        "{}",
        describe(&up)
    );
    for answer in ["ok", "rate_limited", "duplicate", "pending"] {
        assert!(
            count(&report, answer) > 0,
            "no `{answer}` in the burst: {}",
            describe(&up)
        );
    }
    assert!(!report.contains("calls failed"), "{}", describe(&up));

    // The commands it prints for a reader to try, run as printed.
    let printed = |label: &str| -> String {
        let line = report
            .lines()
            .find_map(|line| line.trim_start().strip_prefix(label))
            .unwrap_or_else(|| panic!("no `{label}` command printed: {}", describe(&up)));
        let tried = Command::new("timeout")
            .args(["60", "sh", "-c", line.trim()])
            .current_dir(workspace_root())
            .stdin(Stdio::null())
            .output()
            .expect("runs a printed command");
        assert!(tried.status.success(), "`{line}`: {}", describe(&tried));
        text(&tried.stdout)
    };
    assert!(printed("a hit ").starts_with("ok (fleet"));
    assert!(printed("its commit ").starts_with("ok (fleet"));
    assert_eq!(printed("a duplicate ").trim(), "duplicate of hook h1");
    let look = printed("a look ");
    assert!(look.contains("h1"), "the key's holder is not shown: {look}");

    let status = fleet.run(&["status"]);
    let listed = text(&status.stdout);
    assert!(status.status.success(), "{}", describe(&status));
    for node in ["node-1", "node-2", "node-3"] {
        assert!(
            listed
                .lines()
                .any(|l| l.contains(node) && l.contains("ready: serving")),
            "{node} not serving: {}",
            describe(&status)
        );
    }
    assert!(!listed.contains("NOT RUNNING"), "{}", describe(&status));
    let pids = fleet.pids();
    let names: Vec<&str> = pids.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, ["nats", "node-1", "node-2", "node-3"], "{pids:?}");
    for (name, pid) in &pids {
        assert!(alive(*pid), "{name} (pid {pid}) is not running");
    }

    let stop = fleet.run(&["stop"]);
    assert!(stop.status.success(), "{}", describe(&stop));
    assert!(
        text(&stop.stdout).contains("fleet stopped"),
        "{}",
        describe(&stop)
    );
    for (name, pid) in &pids {
        assert!(!alive(*pid), "{name} (pid {pid}) still runs after stop");
    }
    let after = fleet.run(&["status"]);
    assert!(!after.status.success(), "{}", describe(&after));
    assert!(
        text(&after.stderr).contains("no fleet running"),
        "{}",
        describe(&after)
    );
}
