//! `docs/protocol.md` is enough to write an edge in another language: the Python
//! edge client in `clients/python/ankusa_edge.py`, written from that document
//! alone, speaks the protocol with the Rust nodes and edges. This keeps it so:
//!
//! - its encoder writes exactly the bytes of every request vector of §10,
//!   batches included, and its decoder reads every reply vector to its JSON
//!   view, also with unknown keys added; every shard row of §2 matches;
//! - its `shard_of` agrees with [`ankusa_bus::shard_of`] for a few hundred
//!   tenants, non-ASCII, NUL and line separators included;
//! - it installs as a package with pip, offline, and its module and
//!   `ankusa-edge` command run from the installed copy;
//! - its `LocalStore`, where its `DegradingEdge` answers from during an
//!   outage, answers a long random history of timed requests exactly as a
//!   node's `TenantState` does;
//! - against a real nats-server and `ankusa-node`, its scripted scenario (in
//!   the map form and in the compact form) gets every outcome it should, its
//!   typed errors (`invalid` from the client and from the node, `wrong_shard`,
//!   no responders, timeout) are what §9 groups them as, its own checks of §8
//!   refuse a request with the reason the node gives, its batches answer each
//!   item in its own slot and go to the node's subject once a reply named the
//!   node (to shard subjects again for `wrong_node` items and for a node gone),
//!   150 concurrent single calls leave in a few messages and each is answered
//!   as if alone, a call queued behind a silent one ends at its own budget, its
//!   `bench` command commits every hit it sends, a key either edge committed
//!   (or claimed in a batch) is a duplicate (or pending) for the other, and its
//!   degrading edge answers from the fleet while it can, then locally, with its
//!   breaker open and fleet claims never settled locally;
//! - an edge whose NATS user may not publish to node subjects (the deploy
//!   file's permissions) loses one batch to the refusal, warns, and batches to
//!   shard subjects from then on.
//!
//! The interpreter comes from `ANKUSA_PYTHON` (set by `scripts/test.sh`, made by
//! `scripts/ensure-python-edge.sh`); without it these tests fail, never skip.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use ankusa_actors::{
    Charge, Claim, HitOutcome, HitRequest, Kind, SettleOutcome, SettleRequest, Settlement,
    TenantState,
};
use ankusa_bus::protocol::{Op, Request};
use ankusa_bus::{shard_of, FleetConfig, NatsOptions, Store};
use ankusa_tests::permissions::{permissions_conf, violations, NODE_USER_ARGS};
use ankusa_tests::requests::{hit, settle};
use ankusa_tests::{
    connected_edge, read_repo_file, workspace_root, NatsServer, NodeProcess, NodeSpec, ServerConfig,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

/// Bound on any one Python process; it is killed past it.
const LIMIT: Duration = Duration::from_secs(60);
/// Bound on a Rust edge call.
const T: Duration = Duration::from_millis(2000);
/// How far past its budget a Python call may return on a busy host.
const SLACK_MS: u64 = 150;

/// What a finished Python process left.
struct Run {
    what: String,
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Run {
    /// The whole story, for assertion messages.
    fn describe(&self) -> String {
        format!(
            "{} exited {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.what, self.status, self.stdout, self.stderr
        )
    }

    fn success(self) -> Self {
        assert!(self.status.success(), "{}", self.describe());
        self
    }
}

async fn read_all(pipe: Option<impl AsyncRead + Unpin>) -> String {
    let mut bytes = Vec::new();
    if let Some(mut pipe) = pipe {
        let _ = pipe.read_to_end(&mut bytes).await;
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Runs `program args` in the repository root with `stdin`, killed after [`LIMIT`].
async fn run(program: &Path, args: &[&str], stdin: Option<String>) -> Run {
    let mut command = Command::new(program);
    command.args(args).current_dir(workspace_root());
    finish(command, stdin).await
}

/// Runs `command` to its end with `stdin`, killed after [`LIMIT`].
async fn finish(mut command: Command, stdin: Option<String>) -> Run {
    let std = command.as_std();
    let args: Vec<String> = std
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let what = format!("{} {}", std.get_program().to_string_lossy(), args.join(" "));
    let mut child = command
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    if let (Some(mut pipe), Some(text)) = (child.stdin.take(), stdin) {
        tokio::spawn(async move {
            let _ = pipe.write_all(text.as_bytes()).await;
        });
    }
    let stdout = tokio::spawn(read_all(child.stdout.take()));
    let stderr = tokio::spawn(read_all(child.stderr.take()));
    let status = match tokio::time::timeout(LIMIT, child.wait()).await {
        Ok(status) => status.unwrap_or_else(|e| panic!("waiting for {what}: {e}")),
        Err(_) => {
            let _ = child.kill().await;
            panic!(
                "{what} did not finish within {LIMIT:?} and was killed\n--- stdout ---\n{}\n--- stderr ---\n{}",
                stdout.await.unwrap_or_default(),
                stderr.await.unwrap_or_default()
            );
        }
    };
    Run {
        what,
        status,
        stdout: stdout.await.expect("stdout reader"),
        stderr: stderr.await.expect("stderr reader"),
    }
}

/// The interpreter of `ANKUSA_PYTHON`, checked to import what the client needs.
async fn python() -> PathBuf {
    const FIX: &str = "run `scripts/ensure-python-edge.sh` and set ANKUSA_PYTHON to the path \
                       it prints, or run everything with `scripts/test.sh`";
    let python = match std::env::var_os("ANKUSA_PYTHON") {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => panic!(
            "ANKUSA_PYTHON is not set: these tests need a Python with nats-py and msgpack; {FIX}"
        ),
    };
    assert!(
        python.is_file(),
        "ANKUSA_PYTHON={} is not a file; {FIX}",
        python.display()
    );
    let check = run(&python, &["-c", "import nats, msgpack"], None).await;
    assert!(
        check.status.success(),
        "ANKUSA_PYTHON={} cannot import nats-py and msgpack; {FIX}\n{}",
        python.display(),
        check.describe()
    );
    python
}

/// Lines of a self-test's output that report a passed check.
fn passed_checks(out: &Run) -> usize {
    out.stdout
        .lines()
        .filter(|l| l.starts_with("ok   "))
        .count()
}

/// A command's arguments for the live fleet of these tests (instance `test`,
/// 16 shards) at `url`.
fn against_fleet<'a>(command: &'a str, url: &'a str) -> Vec<&'a str> {
    vec![
        command,
        "--nats",
        url,
        "--instance",
        "test",
        "--shards",
        "16",
    ]
}

/// Runs the Python edge client's command line.
async fn edge(args: &[&str], stdin: Option<String>) -> Run {
    let python = python().await;
    let mut full = vec!["clients/python/ankusa_edge.py"];
    full.extend_from_slice(args);
    run(&python, &full, stdin).await
}

// ---------------------------------------------------------------------------------
// The spec's vectors
// ---------------------------------------------------------------------------------

/// Names of the doc's fenced blocks of `lang` (```` ```hex name=N ... ````).
fn block_names(doc: &str, lang: &str) -> BTreeSet<String> {
    let fence = format!("```{lang} ");
    doc.lines()
        .filter_map(|line| line.strip_prefix(&fence))
        .filter_map(|tags| {
            tags.split_whitespace()
                .find_map(|tag| tag.strip_prefix("name="))
        })
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn python_encoder_and_decoder_match_the_spec_vectors() {
    let doc = read_repo_file("docs/protocol.md");
    let out = edge(&["vectors", "docs/protocol.md"], None).await.success();
    let lines: Vec<&str> = out.stdout.lines().collect();
    let all = out.describe();
    assert!(
        !lines.iter().any(|l| l.starts_with("FAIL")),
        "a vector failed:\n{all}"
    );

    // Every frame with a JSON view is checked.
    let pairs: Vec<String> = block_names(&doc, "json")
        .intersection(&block_names(&doc, "hex"))
        .cloned()
        .collect();
    assert!(pairs.len() >= 19, "the doc has only {pairs:?}");
    let mut checked = 0;
    for name in &pairs {
        let ok = lines
            .iter()
            .any(|l| l.starts_with(&format!("ok   {name}: ")));
        assert!(ok, "{name} not checked:\n{all}");
        checked += 1;
    }
    assert!(
        pairs
            .iter()
            .filter(|n| n.starts_with("request-batch"))
            .count()
            >= 2,
        "the doc has no batch request vectors: {pairs:?}"
    );
    assert!(
        checked >= 19,
        "only {checked} request and reply vectors checked:\n{all}"
    );

    // Every row of the shard table.
    let rows = doc
        .split("<!-- shard-vectors:begin -->")
        .nth(1)
        .and_then(|rest| rest.split("<!-- shard-vectors:end -->").next())
        .expect("the shard table")
        .lines()
        .filter(|l| l.starts_with("| `"))
        .count();
    let shard_lines = lines
        .iter()
        .filter(|l| l.starts_with("ok   shard "))
        .count();
    assert!(rows >= 17, "the shard table has only {rows} rows");
    assert_eq!(shard_lines, rows, "shard rows checked:\n{all}");
    assert!(
        lines.iter().filter(|l| l.starts_with("ok   ")).count() >= 36,
        "{all}"
    );
}

// ---------------------------------------------------------------------------------
// The shard function
// ---------------------------------------------------------------------------------

/// A few hundred tenants: the awkward ones by hand, then pseudo-random strings
/// over an alphabet of 1- to 4-byte characters, NUL, and characters some line
/// splitters break on (U+0085, U+2028).
fn tenants() -> Vec<String> {
    let mut out: Vec<String> = [
        "",
        "a",
        "acme",
        "Acme",
        ".",
        "*",
        ">",
        " ",
        "\0",
        "a.b",
        "tenant\0x",
        "ünïcødé",
        "日本",
        "🦀",
        "\r",
        "\u{85}",
        "\u{2028}",
        "\u{feff}",
        "\u{10ffff}",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let alphabet = [
        'a',
        'Z',
        '0',
        '-',
        '_',
        '.',
        ' ',
        '\0',
        '\t',
        '"',
        '\\',
        '\u{7f}',
        '\u{80}',
        '\u{85}',
        'é',
        'ß',
        '\u{7ff}',
        '\u{800}',
        '日',
        '本',
        '\u{2028}',
        '\u{ffff}',
        '🦀',
        '\u{10ffff}',
    ];
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize
    };
    for _ in 0..300 {
        let len = 1 + next() % 24;
        out.push(
            (0..len)
                .map(|_| alphabet[next() % alphabet.len()])
                .collect(),
        );
    }
    out
}

#[tokio::test]
async fn python_shard_of_agrees_with_rust() {
    let tenants = tenants();
    let counts = [1u32, 2, 7, 16, 64, 256, 1000, 4096];
    let stdin: String = tenants
        .iter()
        .map(|t| serde_json::to_string(t).expect("a JSON string") + "\n")
        .collect();
    let list = counts.map(|c| c.to_string()).join(",");
    let out = edge(&["shard", "--shards", &list], Some(stdin))
        .await
        .success();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), tenants.len(), "{}", out.describe());
    for (tenant, line) in tenants.iter().zip(&lines) {
        let want: Vec<String> = counts
            .iter()
            .map(|&c| shard_of(tenant, c).to_string())
            .collect();
        assert_eq!(
            *line,
            want.join(" "),
            "shards of {tenant:?} ({:02x?}) for S = {counts:?}",
            tenant.as_bytes()
        );
    }
}

// ---------------------------------------------------------------------------------
// The local rules
// ---------------------------------------------------------------------------------

/// A random but repeatable history of timed requests over two tenants, three
/// keys and three hooks, with short TTLs and tight buckets so that every rule
/// comes up: rate limits, replays, pending, duplicates, expiries, settles of
/// every kind, resets, and requests that break a rule.
fn timed_requests(n: usize) -> Vec<(u64, Request)> {
    let mut rng = StdRng::seed_from_u64(0x0a11_5eed);
    let mut at_us = 1_700_000_000_000_000u64;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        at_us += rng.random_range(0..40_000);
        let tenant = ["t0", "t1"][rng.random_range(0..2)].to_string();
        let claim = Claim {
            tenant: tenant.clone(),
            source_id: "s".into(),
            key: format!("k{}", rng.random_range(0..3)),
            hook_id: format!("h{}", rng.random_range(0..3)),
            node: "edge-a".into(),
            ttl_ms: [60, 600][rng.random_range(0..2)],
            pending_ttl_ms: [30, 300][rng.random_range(0..2)],
        };
        let op = match rng.random_range(0..10) {
            0..=5 => {
                let mut charges = Vec::new();
                for kind in [Kind::Hooks, Kind::Bytes] {
                    if rng.random_bool(0.6) {
                        let capacity_us = [100_000, 300_000][rng.random_range(0..2)];
                        // One in twenty breaks a rule: an increment over the capacity.
                        let increment_us = if rng.random_bool(0.05) {
                            capacity_us + 1
                        } else {
                            [1_000, 40_000, 100_000][rng.random_range(0..3)]
                        };
                        charges.push(Charge {
                            kind,
                            tenant: tenant.clone(),
                            increment_us,
                            capacity_us,
                        });
                    }
                }
                let claim = rng.random_bool(0.7).then_some(claim);
                Op::Hit(HitRequest { charges, claim })
            }
            6..=8 => Op::Settle(SettleRequest {
                claim,
                settlement: if rng.random_bool(0.7) {
                    Settlement::Commit
                } else {
                    Settlement::Release
                },
            }),
            _ => Op::Reset { tenant },
        };
        out.push((at_us, Request::new(100, op)));
    }
    out
}

/// The Python breaker's transitions and the local store's bound, on clocks
/// that move when told.
#[tokio::test]
async fn python_breaker_and_local_store_self_test() {
    let out = edge(&["self-test"], None).await.success();
    let checks = passed_checks(&out);
    assert!(
        checks >= 14,
        "only {checks} checks passed\n{}",
        out.describe()
    );
}

/// The client installs as a package (`clients/python/pyproject.toml`): pip
/// builds it offline from a copy of its directory, and the installed module
/// and its `ankusa-edge` command run away from the repository.
#[tokio::test]
async fn python_client_installs_as_a_package() {
    let python = python().await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    // A copy, so that the build's own files stay out of the repository.
    let source = dir.path().join("source");
    std::fs::create_dir(&source).expect("source directory");
    for name in ["pyproject.toml", "README.md", "ankusa_edge.py"] {
        let from = workspace_root().join("clients/python").join(name);
        std::fs::copy(&from, source.join(name))
            .unwrap_or_else(|e| panic!("copying {}: {e}", from.display()));
    }
    let site = dir.path().join("site");
    let (site_arg, source_arg) = (site.to_string_lossy(), source.to_string_lossy());
    let install = [
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--target",
        &site_arg,
        &source_arg,
    ];
    run(&python, &install, None).await.success();

    let installed = |program: &Path, args: &[&str]| {
        let mut command = Command::new(program);
        command
            .args(args)
            .current_dir(dir.path())
            .env("PYTHONPATH", &site);
        command
    };
    let probe = "import ankusa_edge, importlib.metadata as m; \
                 print(ankusa_edge.__file__); print(m.version('ankusa-edge'))";
    let out = finish(installed(&python, &["-c", probe]), None)
        .await
        .success();
    let lines: Vec<&str> = out.stdout.lines().collect();
    let module = Path::new(lines.first().copied().unwrap_or_default());
    assert!(
        module.starts_with(&site),
        "the module imported is not the installed one\n{}",
        out.describe()
    );
    assert_eq!(lines.get(1).copied(), Some("0.1.0"), "{}", out.describe());

    let command = site.join("bin").join("ankusa-edge");
    let out = finish(installed(&command, &["self-test"]), None)
        .await
        .success();
    assert!(passed_checks(&out) >= 14, "{}", out.describe());
}

/// The Python `LocalStore` (the edge's state while degraded) decides every
/// request of a long random history as a node's `TenantState` does.
#[tokio::test]
async fn python_local_store_follows_the_node_rules() {
    let history = timed_requests(3_000);
    let mut tenants: HashMap<String, TenantState> = HashMap::new();
    let mut want = Vec::with_capacity(history.len());
    let mut stdin = String::new();
    for (at_us, request) in &history {
        let line = json!({"at_us": at_us, "request": request});
        stdin.push_str(&format!("{line}\n"));
        want.push(match request.validate() {
            Err(err) => json!({"invalid": err.invalid}),
            Ok(()) => {
                let tenant = request.tenant().expect("one tenant").to_string();
                let state = tenants.entry(tenant).or_default();
                match &request.op {
                    Op::Hit(hit) => json!(state.hit(*at_us, hit).outcome),
                    Op::Settle(settle) => json!(state.settle(*at_us, settle).outcome),
                    Op::Reset { .. } => {
                        state.reset();
                        json!("reset")
                    }
                    other => panic!("not in the history: {other:?}"),
                }
            }
        });
    }
    let out = edge(&["local-replay"], Some(stdin)).await.success();
    let got: Vec<Value> = out
        .stdout
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect();
    assert_eq!(got.len(), want.len(), "{}", out.describe());
    for (i, ((at_us, request), (got, want))) in
        history.iter().zip(got.iter().zip(&want)).enumerate()
    {
        assert_eq!(got, want, "request {i} at {at_us} µs: {request:?}");
    }
    // The history reaches every answer, so the agreement means something.
    let seen: BTreeSet<String> = want
        .iter()
        .map(|v| match v {
            Value::String(s) => s.clone(),
            Value::Object(o) if o.contains_key("invalid") => "invalid".into(),
            other => other["result"].as_str().unwrap_or("?").to_string(),
        })
        .collect();
    let every = [
        "ok",
        "duplicate",
        "pending",
        "rate_limited",
        "not_found",
        "not_owner",
        "already_committed",
        "reset",
        "invalid",
    ];
    for answer in every {
        assert!(
            seen.contains(answer),
            "no {answer} in the history: {seen:?}"
        );
    }
}

// ---------------------------------------------------------------------------------
// A live fleet
// ---------------------------------------------------------------------------------

/// The scenario's output, one JSON object per step.
struct Scenario {
    steps: Vec<Value>,
    all: String,
}

impl Scenario {
    fn parse(run: Run) -> Self {
        let all = run.describe();
        let steps = run
            .stdout
            .lines()
            .map(|line| {
                serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("not a JSON line: {line:?}: {e}\n{all}"))
            })
            .collect();
        Scenario { steps, all }
    }

    fn step(&self, name: &str) -> &Value {
        self.steps
            .iter()
            .find(|s| s["step"] == name)
            .unwrap_or_else(|| panic!("no step {name}:\n{}", self.all))
    }

    fn outcome(&self, name: &str) -> &Value {
        let step = self.step(name);
        assert!(
            step.get("outcome").is_some(),
            "step {name} has no outcome: {step}\n{}",
            self.all
        );
        &step["outcome"]
    }

    fn expect_outcome(&self, name: &str, want: Value) {
        assert_eq!(*self.outcome(name), want, "step {name}\n{}", self.all);
    }

    /// The step's error, checked to be of `kind` in §9's `group`.
    fn error(&self, name: &str, kind: &str, group: &str) -> &Value {
        let error = &self.step(name)["error"];
        assert_eq!(error["type"], kind, "step {name}\n{}", self.all);
        assert_eq!(error["group"], group, "step {name}\n{}", self.all);
        error
    }

    fn number(&self, value: &Value, what: &str) -> u64 {
        value
            .as_u64()
            .unwrap_or_else(|| panic!("{what} is {value}, not a number\n{}", self.all))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_edge_against_a_live_fleet() {
    // Fail on the interpreter before starting servers.
    python().await;
    let nats = NatsServer::start().await.expect("nats-server starts");
    let node = NodeProcess::start(NodeSpec::fleet("py-fleet", vec![nats.url()])).expect("node");
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");
    let mut config = FleetConfig::new(NatsOptions::with_servers([nats.url()]), "test");
    config.shards = 16;
    let rust = connected_edge(config).await;

    for (prefix, compact) in [("py", false), ("pyc", true)] {
        let tenant = format!("{prefix}-acme");
        // The Rust edge commits a key first; the Python edge must see it as a
        // duplicate (the source is `requests::claim`'s, "src").
        let rust_key = format!("{prefix}-rust-evt");
        assert_eq!(
            rust.hit(hit(&tenant, &rust_key, "rust-h1"), T).await,
            Ok(HitOutcome::Ok)
        );
        assert_eq!(
            rust.settle(settle(&tenant, &rust_key, "rust-h1", Settlement::Commit), T)
                .await,
            Ok(SettleOutcome::Ok)
        );

        let url = nats.url();
        let mut args = against_fleet("scenario", &url);
        args.extend([
            "--prefix",
            prefix,
            "--tenant",
            &tenant,
            "--source",
            "src",
            "--foreign-key",
            &rust_key,
        ]);
        if compact {
            args.push("--compact");
        }
        let s = Scenario::parse(edge(&args, None).await.success());
        let h1 = format!("{prefix}-h1");
        let h3 = format!("{prefix}-h3");

        assert_eq!(s.step("answered-by")["node"], "py-fleet", "{}", s.all);
        let fresh = s.step("hit-fresh");
        assert_eq!(fresh["tenant"], tenant.as_str(), "{}", s.all);
        assert_eq!(fresh["hook_id"], h1.as_str(), "{}", s.all);
        s.expect_outcome("hit-fresh", json!({"result": "ok"}));
        s.expect_outcome("settle-commit", json!({"result": "ok"}));
        s.expect_outcome("settle-commit-again", json!({"result": "ok"}));
        s.expect_outcome(
            "hit-duplicate",
            json!({"result": "duplicate", "hook_id": h1}),
        );
        s.expect_outcome(
            "settle-not-owner",
            json!({"result": "not_owner", "hook_id": h1}),
        );
        s.expect_outcome("release-committed", json!({"result": "already_committed"}));
        s.expect_outcome("settle-not-found", json!({"result": "not_found"}));
        let committed = s.outcome("inspect-committed");
        assert_eq!(committed["claim"]["state"], "committed", "{}", s.all);
        assert_eq!(committed["claim"]["hook_id"], h1.as_str(), "{}", s.all);
        let kept = s.number(&committed["claim"]["expires_in_ms"], "the commit's expiry");
        assert!((590_000..=600_000).contains(&kept), "{}", s.all);
        assert!(
            s.number(&committed["claims_held"], "claims held") >= 1,
            "{}",
            s.all
        );

        s.expect_outcome("hit-claim-pending", json!({"result": "ok"}));
        let pending = s.outcome("hit-pending");
        assert_eq!(pending["result"], "pending", "{}", s.all);
        let wait = s.number(&pending["retry_after_ms"], "pending's retry_after_ms");
        assert!((1..=30_000).contains(&wait), "{}", s.all);
        assert_eq!(s.step("hit-replay")["hook_id"], h3.as_str(), "{}", s.all);
        s.expect_outcome("hit-replay", json!({"result": "ok"}));
        let held = &s.outcome("inspect-pending")["claim"];
        assert_eq!(held["state"], "pending", "{}", s.all);
        assert_eq!(held["hook_id"], h3.as_str(), "{}", s.all);
        assert_eq!(held["node"], format!("{prefix}-edge").as_str(), "{}", s.all);
        s.expect_outcome("release-pending", json!({"result": "ok"}));
        s.expect_outcome("hit-after-release", json!({"result": "ok"}));

        s.expect_outcome("tight-1", json!({"result": "ok"}));
        let limited = s.outcome("tight-2");
        assert_eq!(limited["result"], "rate_limited", "{}", s.all);
        let wait = s.number(&limited["retry_after_ms"], "rate_limited's retry_after_ms");
        assert!((50_000..=60_000).contains(&wait), "{}", s.all);
        // The bucket the second hit met: one minute ahead, less what has passed.
        let tight = s.outcome("inspect-tight");
        assert_eq!(tight["buckets"][0]["kind"], "hooks", "{}", s.all);
        let ahead = s.number(&tight["buckets"][0]["ahead_us"], "the bucket's lead");
        assert!((50_000_000..=60_000_000).contains(&ahead), "{}", s.all);
        assert_eq!(tight["claim"], Value::Null, "{}", s.all);
        s.expect_outcome("reset", json!("reset"));
        s.expect_outcome("tight-after-reset", json!({"result": "ok"}));
        s.expect_outcome("hit-nothing", json!({"result": "ok"}));

        // The degrading edge: the fleet while it answers; then, on an instance
        // nobody serves, this process's state, and the breaker open after two
        // outages in a row.
        let answered = |name: &str, outcome: Value, source: &str, reason: Value| {
            let step = s.step(name);
            assert_eq!(
                (&step["outcome"], &step["source"], &step["reason"]),
                (&outcome, &json!(source), &reason),
                "step {name}\n{}",
                s.all
            );
        };
        let ok = json!({"result": "ok"});
        answered("degrade-fleet-hit", ok.clone(), "fleet", Value::Null);
        answered("degrade-fleet-commit", ok.clone(), "fleet", Value::Null);
        let bad_budget = s.step("degrade-bad-budget");
        assert_eq!(
            (&bad_budget["refused"], &bad_budget["breaker"]),
            (&json!(5), &json!("closed")),
            "{}",
            s.all
        );
        answered(
            "degrade-out-hit",
            ok.clone(),
            "local",
            json!("no_responders"),
        );
        // The fleet's committed key is unknown locally: accepted, not lost.
        answered(
            "degrade-out-fleet-key",
            ok.clone(),
            "local",
            json!("no_responders"),
        );
        answered(
            "degrade-out-breaker",
            ok.clone(),
            "local",
            json!("breaker_open"),
        );
        answered(
            "degrade-out-commit",
            ok.clone(),
            "local",
            json!("local_claim"),
        );
        answered(
            "degrade-out-duplicate",
            json!({"result": "duplicate", "hook_id": h1}),
            "local",
            json!("local_claim"),
        );
        // A fleet claim is never settled locally: tried on the fleet even
        // with the breaker open, the outage is the answer (and the breaker,
        // which did not let it through, is not told: still open below).
        s.error("degrade-out-fleet-settle", "NoResponders", "FleetError");
        // Nothing to do is the contract's ok, the fleet's answer without a
        // round trip, the breaker open or not.
        answered("degrade-out-nothing", ok, "fleet", Value::Null);
        let state = s.step("degrade-out-state");
        assert_eq!(state["breaker"], "open", "{}", s.all);
        assert_eq!(state["tenants"], 1, "{}", s.all);

        let too_long = json!({"reason": "too_long", "field": "tenant", "len": 257, "max": 256});
        let local = s.error("too-long-tenant-local", "InvalidRequest", "RequestError");
        assert_eq!(
            (&local["code"], &local["from_node"], &local["invalid"]),
            (&json!("invalid"), &json!(false), &too_long),
            "{}",
            s.all
        );
        let remote = s.error("too-long-tenant-node", "InvalidRequest", "RequestError");
        assert_eq!(
            (&remote["code"], &remote["from_node"], &remote["invalid"]),
            (&json!("invalid"), &json!(true), &too_long),
            "{}",
            s.all
        );
        let wrong = s.error("wrong-shard", "WrongShard", "FleetError");
        assert_eq!(
            (&wrong["code"], &wrong["from_node"]),
            (&json!("wrong_shard"), &json!(true)),
            "{}",
            s.all
        );

        // The client's own §8 checks give the reason the node gives, rule by rule.
        let agreements: Vec<&Value> = s
            .steps
            .iter()
            .filter(|step| {
                step["step"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("agree-"))
            })
            .collect();
        assert!(agreements.len() >= 15, "{}", s.all);
        for step in agreements {
            assert!(step["local"].is_object(), "{step}\n{}", s.all);
            assert_eq!(step["local"], step["node"], "{step}\n{}", s.all);
        }

        // A batch: each item answered in its own slot, the refused one never
        // sent, the claim it made pending for another edge.
        let batch = s.step("batch");
        // Sent to the node's subject: the calls before it named the node.
        assert_eq!(batch["via_node"], "py-fleet", "{}", s.all);
        let results = batch["results"]
            .as_array()
            .unwrap_or_else(|| panic!("no batch results\n{}", s.all));
        assert_eq!(results.len(), 5, "{}", s.all);
        assert_eq!(results[0], json!({"result": "ok"}), "{}", s.all);
        assert_eq!(results[1], json!({"result": "ok"}), "{}", s.all);
        assert_eq!(results[2], json!("reset"), "{}", s.all);
        assert_eq!(
            (
                &results[3]["type"],
                &results[3]["from_node"],
                &results[3]["invalid"]
            ),
            (&json!("InvalidRequest"), &json!(false), &too_long),
            "{}",
            s.all
        );
        assert_eq!(results[4], json!({"result": "ok"}), "{}", s.all);
        let batch_key = batch["key"]
            .as_str()
            .unwrap_or_else(|| panic!("the batch names no key\n{}", s.all));
        let seen = rust.hit(hit(&tenant, batch_key, "rust-h3"), T).await;
        assert!(
            matches!(seen, Ok(HitOutcome::Pending { .. })),
            "{seen:?}\n{}",
            s.all
        );

        let wire = s.step("batch-wire");
        assert_eq!(
            (&wire["messages"], &wire["items"]),
            (&json!(1), &json!([3])),
            "{}",
            s.all
        );
        let results = &wire["results"];
        assert_eq!(results[0], json!({"result": "ok"}), "{}", s.all);
        assert_eq!(
            results[1],
            json!({"result": "duplicate", "hook_id": "stand-in-h"}),
            "{}",
            s.all
        );
        assert_eq!(
            (
                &results[2]["type"],
                &results[2]["code"],
                &results[2]["group"]
            ),
            (
                &json!("FleetRefused"),
                &json!("unavailable"),
                &json!("FleetError")
            ),
            "{}",
            s.all
        );

        // A batch too large for one message is split; every part fits, every
        // item is answered.
        let split = s.step("batch-split");
        let items: Vec<u64> = split["items"]
            .as_array()
            .unwrap_or_else(|| panic!("no items\n{}", s.all))
            .iter()
            .map(|n| s.number(n, "items"))
            .collect();
        assert!(items.len() >= 2, "{}", s.all);
        assert_eq!(items.iter().sum::<u64>(), 70, "{}", s.all);
        for size in split["bytes"].as_array().into_iter().flatten() {
            assert!(s.number(size, "bytes") <= 65_536, "{}", s.all);
        }
        let answered = split["results"].as_array().map(Vec::len);
        assert_eq!(answered, Some(70), "{}", s.all);
        for result in split["results"].as_array().into_iter().flatten() {
            assert_eq!(*result, json!({"result": "ok"}), "{}", s.all);
        }

        // Batches to nodes, against stand-ins: an item the node no longer
        // serves goes again to its shard's subject, and so does every item of
        // a node that has gone; the node a shard's reply names is learned.
        let moved = s.step("batch-nodes-wrong-node");
        assert_eq!(moved["learned"], json!(["n1", "n1"]), "{}", s.all);
        assert_eq!(moved["routed"], json!(["node:3", "shard:1"]), "{}", s.all);
        assert_eq!(moved["known_after"], json!(["n1", "n3"]), "{}", s.all);
        let ok = json!({"result": "ok"});
        assert_eq!(moved["results"], json!([ok, ok, ok]), "{}", s.all);
        let gone = s.step("batch-nodes-gone");
        assert_eq!(gone["routed"], json!(["node:1", "shard:1"]), "{}", s.all);
        assert_eq!(gone["known_after"], json!(["n1", "n4"]), "{}", s.all);
        assert_eq!(gone["results"], json!([ok, ok]), "{}", s.all);

        // Concurrent single calls share messages, each answered as if alone.
        let ha7 = format!("{prefix}-ha7");
        for (round, expected) in [
            ("hits", json!({"result": "ok"})),
            ("commits", json!({"result": "ok"})),
            ("again", json!({"result": "duplicate", "hook_id": ha7})),
        ] {
            let step = s.step(&format!("auto-batch-{round}"));
            let outcomes = step["outcomes"]
                .as_object()
                .unwrap_or_else(|| panic!("no outcomes\n{}", s.all));
            if round == "again" {
                // Each key is a duplicate of its own hook: 150 different views.
                assert_eq!(outcomes.len(), 150, "{}", s.all);
                let seven: Value = serde_json::from_str(
                    outcomes
                        .keys()
                        .find(|k| k.contains(&format!("\"{ha7}\"")))
                        .unwrap_or_else(|| panic!("no answer names {ha7}\n{}", s.all)),
                )
                .expect("an outcome's JSON");
                assert_eq!(seven, expected, "{}", s.all);
            } else {
                let only: Vec<(Value, u64)> = outcomes
                    .iter()
                    .map(|(k, n)| (serde_json::from_str(k).expect("JSON"), s.number(n, "count")))
                    .collect();
                assert_eq!(only, vec![(expected, 150)], "{}", s.all);
            }
            let messages = s.number(&step["messages"], "messages");
            assert!(
                (1..=30).contains(&messages),
                "150 calls in {messages} messages\n{}",
                s.all
            );
        }
        let auto = s.step("auto-batch-again");
        let (auto_tenant, auto_key) = (
            auto["tenant"].as_str().expect("a tenant"),
            auto["key"].as_str().expect("a key"),
        );
        assert_eq!(
            rust.hit(hit(auto_tenant, auto_key, "rust-h9"), T).await,
            Ok(HitOutcome::Duplicate {
                hook_id: ha7.clone()
            }),
            "{}",
            s.all
        );

        s.expect_outcome(
            "foreign-duplicate",
            json!({"result": "duplicate", "hook_id": "rust-h1"}),
        );

        // §9: no responders is resent with a growing pause for the whole
        // budget, and the call still returns within it.
        let none = s.error("no-responders", "NoResponders", "FleetError");
        let attempts = s.number(&none["attempts"], "attempts");
        let elapsed = s.number(&s.step("no-responders")["elapsed_ms"], "elapsed_ms");
        assert!(attempts >= 3, "{}", s.all);
        assert!((150..=300 + SLACK_MS).contains(&elapsed), "{}", s.all);
        // The resend that finds a responder 100 ms in carries the budget left
        // then (about 900 ms), not the call's 1000 ms.
        s.expect_outcome("no-responders-then-answer", json!({"result": "ok"}));
        let sent = s.step("no-responders-then-answer-sent")["budgets_ms"]
            .as_array()
            .unwrap_or_else(|| panic!("no budgets_ms\n{}", s.all));
        assert_eq!(sent.len(), 1, "{}", s.all);
        let budget = s.number(&sent[0], "the budget sent");
        assert!((1..950).contains(&budget), "{}", s.all);
        // A subscriber that never answers: Timeout at the budget.
        s.error("timeout", "Timeout", "FleetError");
        let elapsed = s.number(&s.step("timeout")["elapsed_ms"], "elapsed_ms");
        assert!((190..=200 + SLACK_MS).contains(&elapsed), "{}", s.all);
        // A call waiting behind one in flight ends at its own budget.
        for (step, budget) in [("timeout-queued", 100), ("timeout-in-flight", 300)] {
            s.error(step, "Timeout", "FleetError");
            let elapsed = s.number(&s.step(step)["elapsed_ms"], "elapsed_ms");
            assert!(
                (budget - 10..=budget + SLACK_MS).contains(&elapsed),
                "{step}: {elapsed} ms\n{}",
                s.all
            );
        }

        // And the other way round: a key the Python edge committed is a
        // duplicate for the Rust edge.
        let py_key = fresh["key"]
            .as_str()
            .unwrap_or_else(|| panic!("hit-fresh names no key\n{}", s.all));
        assert_eq!(
            rust.hit(hit(&tenant, py_key, "rust-h2"), T).await,
            Ok(HitOutcome::Duplicate { hook_id: h1 }),
            "{}",
            s.all
        );
    }

    // The bench command: every hit answered ok and committed, batched or not.
    let url = nats.url();
    for batching in [None, Some("--no-batching")] {
        let mut args = against_fleet("bench", &url);
        args.extend(["--calls", "300", "--concurrency", "32"]);
        args.extend(batching);
        let out = edge(&args, None).await.success();
        let report: Value = serde_json::from_str(out.stdout.trim())
            .unwrap_or_else(|e| panic!("not one JSON line ({e})\n{}", out.describe()));
        assert_eq!(
            report["batching"],
            json!(batching.is_none()),
            "{}",
            out.describe()
        );
        assert_eq!(report["calls"], json!(600), "{}", out.describe());
        assert_eq!(
            report["outcomes"],
            json!({"HitOk": 300, "SettleOk": 300}),
            "{}",
            out.describe()
        );
    }
}

#[tokio::test]
async fn python_edge_stops_batching_to_node_subjects_it_may_not_publish_to() {
    python().await;
    // An edge user whose rights predate node batches: shard subjects only.
    let old_edge = r#"    { user = "old-edge", password = "old-edge-pw", permissions = { publish = { allow = ["ankusa.prod.shard.*"] }, subscribe = { allow = ["_INBOX.>"] } } }"#;
    let nats = NatsServer::start_with(ServerConfig::new().append(&permissions_conf(old_edge)))
        .await
        .expect("nats-server with the deploy permissions starts");
    let mut spec = NodeSpec::fleet("n1", vec![nats.url()]);
    spec.instance = "prod".into();
    spec.shards = 16;
    spec.extra_args = NODE_USER_ARGS.map(String::from).to_vec();
    let node = NodeProcess::start(spec).expect("node");
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");

    // 64 callers at a time, each call with 1 s: the first calls learn the
    // node, the first batch to its subject is refused and times out, and from
    // then on batches go to shard subjects. Left to batch to the node, every
    // call after the first few would time out.
    let url = format!("nats://old-edge:old-edge-pw@127.0.0.1:{}", nats.port());
    let hits = 1000;
    let concurrency = 64;
    let args = [
        "bench",
        "--nats",
        &url,
        "--instance",
        "prod",
        "--shards",
        "16",
        "--calls",
        &hits.to_string(),
        "--concurrency",
        &concurrency.to_string(),
        "--timeout-ms",
        "1000",
    ];
    let out = edge(&args, None).await.success();
    let report: Value = serde_json::from_str(out.stdout.trim())
        .unwrap_or_else(|e| panic!("not one JSON line ({e})\n{}", out.describe()));
    let count = |name: &str| report["outcomes"][name].as_u64().unwrap_or(0);
    let (ok, committed, timed_out) = (count("HitOk"), count("SettleOk"), count("Timeout"));
    assert_eq!(
        ok + committed + timed_out,
        report["calls"].as_u64().unwrap_or(0),
        "only ok, committed and timed-out calls: {}",
        out.describe()
    );
    // The calls caught by the refusal: at most the 64 in flight when it came
    // (the bound leaves as many again for a slow host).
    assert!(
        timed_out <= 2 * concurrency,
        "{timed_out} calls timed out: {}",
        out.describe()
    );
    assert!(
        ok >= hits - timed_out,
        "{ok} of {hits} hits ok: {}",
        out.describe()
    );
    let refused = "user:old-edge\" - Publish Violation - Subject \"ankusa.prod.node.n1\"";
    let refusals = violations(&nats)
        .iter()
        .filter(|l| l.contains(refused))
        .count();
    eprintln!("{refusals} refused publishes; bench: {}", out.stdout.trim());
    // At least one, or the edge never tried; at most the messages that can be
    // out at once before the refusal comes back: one per shard lane (each
    // sends what gathered behind its first call to the node it learned) and
    // four on the node's lane.
    assert!(
        (1..=16 + 4).contains(&refusals),
        "{refusals} refused publishes to the node subject: {}",
        nats.log_tail(20)
    );
    assert!(
        out.stderr.contains("may not publish to ankusa.prod.node.*"),
        "no warning: {}",
        out.describe()
    );
}
