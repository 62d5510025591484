//! Child processes started by tests: our own binaries (`ankusa-node`, `ankusa`) and,
//! underneath [`crate::NatsServer`], nats-server.
//!
//! A [`ChildProcess`] sends stdout and stderr to a log file, can be signalled
//! (STOP/CONT/TERM/KILL, with `kill(2)`: no process spawned, so the async code
//! that injects faults does not block on one) and is SIGKILLed and reaped when
//! dropped, so a panicking test leaves nothing behind.
//! [`cargo_bin`] finds a workspace binary in the target directory the tests run from.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::HarnessError;

/// Signals the harness sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// SIGSTOP: freeze (simulates a GC pause / VM stall).
    Stop,
    /// SIGCONT: resume after [`Signal::Stop`].
    Cont,
    /// SIGTERM: graceful shutdown.
    Term,
    /// SIGKILL: crash.
    Kill,
}

impl Signal {
    /// The signal's name, as `kill -<NAME>` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Signal::Stop => "STOP",
            Signal::Cont => "CONT",
            Signal::Term => "TERM",
            Signal::Kill => "KILL",
        }
    }

    fn number(self) -> rustix::process::Signal {
        use rustix::process::Signal as Sig;
        match self {
            Signal::Stop => Sig::STOP,
            Signal::Cont => Sig::CONT,
            Signal::Term => Sig::TERM,
            Signal::Kill => Sig::KILL,
        }
    }
}

/// Sends `signal` to `pid`.
pub fn send_signal(pid: u32, signal: Signal) -> Result<(), HarnessError> {
    let error = |detail: String| HarnessError::Signal {
        signal: signal.name(),
        pid,
        detail,
    };
    let target = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .ok_or_else(|| error("not a process id".into()))?;
    rustix::process::kill_process(target, signal.number()).map_err(|e| error(e.to_string()))
}

/// How long [`ChildProcess::pause`] waits for the process's threads to stop.
const STOP_WAIT: Duration = Duration::from_secs(2);

/// Whether every thread of `pid` is stopped (state `T` or `t` in
/// `/proc/<pid>/task/<tid>/stat`). False when the process cannot be read.
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            return false;
        };
        // The state follows the command name, which is in parentheses and may
        // itself hold spaces or parentheses.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next());
        matches!(state, Some("T" | "t"))
    })
}

/// Returns the last `lines` lines of a log file (reads at most its last 64 KiB).
pub fn tail_file(path: &Path, lines: usize) -> String {
    let Ok(mut file) = File::open(path) else {
        return format!("<no log at {}>", path.display());
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(64 * 1024);
    if file.seek(SeekFrom::Start(start)).is_err() {
        return String::new();
    }
    let mut buf = Vec::new();
    let _ = file.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A running child process whose output goes to a log file; killed on drop.
#[derive(Debug)]
pub struct ChildProcess {
    name: String,
    child: Child,
    log: PathBuf,
    exited: Option<ExitStatus>,
    // Keeps the log directory alive when the process owns it (see `spawn`).
    _dir: Option<tempfile::TempDir>,
}

impl ChildProcess {
    /// Spawns `cmd` with stdout/stderr in a log file inside a fresh temporary directory
    /// that lives as long as this handle. `name` is used in messages.
    pub fn spawn(name: impl Into<String>, cmd: Command) -> Result<Self, HarnessError> {
        let name = name.into();
        let dir = tempfile::Builder::new()
            .prefix(&format!("ankusa-{}-", sanitize(&name)))
            .tempdir()
            .map_err(HarnessError::io("create temp dir for process log"))?;
        let log = dir.path().join(format!("{}.log", sanitize(&name)));
        let mut proc = Self::spawn_logged(name, cmd, &log)?;
        proc._dir = Some(dir);
        Ok(proc)
    }

    /// Spawns `cmd` appending stdout/stderr to `log` (appending so a restarted process
    /// keeps the earlier run's output in the same file).
    pub fn spawn_logged(
        name: impl Into<String>,
        mut cmd: Command,
        log: &Path,
    ) -> Result<Self, HarnessError> {
        let name = name.into();
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(HarnessError::io(format!("open log {}", log.display())))?;
        let err = out
            .try_clone()
            .map_err(HarnessError::io("clone log handle"))?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        let child = cmd.spawn().map_err(|source| HarnessError::Spawn {
            what: format!("{name} ({:?})", cmd.get_program()),
            source,
        })?;
        Ok(ChildProcess {
            name,
            child,
            log: log.to_path_buf(),
            exited: None,
            _dir: None,
        })
    }

    /// The name given at spawn.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// OS process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Path of the log file (stdout and stderr interleaved).
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail_file(&self.log, lines)
    }

    /// The whole log as text.
    pub fn read_log(&self) -> String {
        std::fs::read(&self.log)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Exit status if the process has exited (reaps it), `None` while it runs.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>, HarnessError> {
        if let Some(status) = self.exited {
            return Ok(Some(status));
        }
        let status = self
            .child
            .try_wait()
            .map_err(HarnessError::io(format!("try_wait {}", self.name)))?;
        self.exited = status;
        Ok(status)
    }

    /// Whether the process is still running (a stopped process counts as running).
    pub fn is_running(&mut self) -> bool {
        matches!(self.try_wait(), Ok(None))
    }

    /// Sends a signal. Fails if the process already exited.
    pub fn signal(&mut self, signal: Signal) -> Result<(), HarnessError> {
        if self.try_wait()?.is_some() {
            return Err(HarnessError::NotRunning(self.name.clone()));
        }
        send_signal(self.pid(), signal)
    }

    /// SIGSTOP, returning once every thread of the process has stopped.
    ///
    /// `kill(2)` only queues the signal: a thread running on another core goes on
    /// until it is interrupted, long enough to answer a request sent right after.
    pub fn pause(&mut self) -> Result<(), HarnessError> {
        self.signal(Signal::Stop)?;
        let deadline = Instant::now() + STOP_WAIT;
        while !all_threads_stopped(self.pid()) {
            if Instant::now() >= deadline || !self.is_running() {
                return Err(HarnessError::Signal {
                    signal: Signal::Stop.name(),
                    pid: self.pid(),
                    detail: format!("not stopped after {} ms", STOP_WAIT.as_millis()),
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// SIGCONT.
    pub fn resume(&mut self) -> Result<(), HarnessError> {
        self.signal(Signal::Cont)
    }

    /// Waits (polling, async-friendly) up to `timeout` for the process to exit.
    pub async fn wait_timeout(&mut self, timeout: Duration) -> Result<ExitStatus, HarnessError> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(status);
            }
            if start.elapsed() >= timeout {
                return Err(HarnessError::ExitTimeout {
                    what: self.name.clone(),
                    pid: self.pid(),
                    waited_ms: timeout.as_millis(),
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Graceful stop: SIGCONT (a paused process cannot handle SIGTERM), SIGTERM, wait up
    /// to `grace`, then SIGKILL. Returns the exit status.
    pub async fn stop(&mut self, grace: Duration) -> Result<ExitStatus, HarnessError> {
        if let Some(status) = self.try_wait()? {
            return Ok(status);
        }
        let _ = send_signal(self.pid(), Signal::Cont);
        let _ = send_signal(self.pid(), Signal::Term);
        match self.wait_timeout(grace).await {
            Ok(status) => Ok(status),
            Err(HarnessError::ExitTimeout { .. }) => self.kill().await,
            Err(e) => Err(e),
        }
    }

    /// SIGKILL and reap. Returns the exit status.
    pub async fn kill(&mut self) -> Result<ExitStatus, HarnessError> {
        if let Some(status) = self.try_wait()? {
            return Ok(status);
        }
        // Child::kill sends SIGKILL, which also ends a SIGSTOPped process.
        let _ = self.child.kill();
        self.wait_timeout(Duration::from_secs(10)).await
    }

    /// Waits until the log contains `needle`, up to `timeout`. Fails early if the
    /// process exits first.
    pub async fn wait_for_log(
        &mut self,
        needle: &str,
        timeout: Duration,
    ) -> Result<(), HarnessError> {
        let start = Instant::now();
        loop {
            if self.read_log().contains(needle) {
                return Ok(());
            }
            if let Some(status) = self.try_wait()? {
                return Err(HarnessError::ExitedEarly {
                    what: self.name.clone(),
                    status,
                    log: self.log.clone(),
                    tail: self.log_tail(40),
                });
            }
            if start.elapsed() >= timeout {
                return Err(HarnessError::NotReady {
                    what: self.name.clone(),
                    waited_ms: timeout.as_millis(),
                    last_error: format!("log never contained {needle:?}"),
                    log: self.log.clone(),
                    tail: self.log_tail(40),
                });
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if self.exited.is_none() {
            let _ = self.child.kill();
            // Reap so no zombie outlives the test; SIGKILL makes this prompt.
            let _ = self.child.wait();
        }
    }
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The directory holding this workspace's binaries for the profile the tests were
/// built with: `CARGO_TARGET_DIR`/`<profile>` if set, else the profile directory the
/// running test executable lives in (`target/<profile>/deps/<test>`), else
/// `<workspace>/target/debug`.
fn profile_dir() -> PathBuf {
    let exe_profile = std::env::current_exe().ok().and_then(|exe| {
        let deps = exe.parent()?;
        (deps.file_name()? == "deps").then(|| deps.parent().map(Path::to_path_buf))?
    });
    let profile_name = exe_profile
        .as_ref()
        .and_then(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "debug".to_string());
    if let Some(target) = std::env::var_os("CARGO_TARGET_DIR") {
        let target = PathBuf::from(target);
        let target = if target.is_absolute() {
            target
        } else {
            workspace_root().join(target)
        };
        return target.join(profile_name);
    }
    exe_profile.unwrap_or_else(|| workspace_root().join("target").join("debug"))
}

/// The repository's root (tests/ is a direct member of the workspace).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// A file of the repository, by its path from the root; a test that cannot
/// read it fails.
pub fn read_repo_file(rel: &str) -> String {
    std::fs::read_to_string(workspace_root().join(rel))
        .unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// Builds each binary at most once per test process; the result is remembered.
fn build_once(name: &str, dir: &Path) -> Result<(), HarnessError> {
    static BUILT: OnceLock<Mutex<HashMap<String, Result<(), String>>>> = OnceLock::new();
    let map = BUILT.get_or_init(|| Mutex::new(HashMap::new()));
    // Held across the build so parallel tests wait for one cargo instead of racing.
    let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(result) = map.get(name) {
        return result.clone().map_err(|detail| HarnessError::CargoBin {
            name: name.to_string(),
            detail,
        });
    }
    let result = run_cargo_build(name, dir);
    map.insert(name.to_string(), result.clone());
    result.map_err(|detail| HarnessError::CargoBin {
        name: name.to_string(),
        detail,
    })
}

/// Removes from `cmd`'s environment the variables cargo sets for a test
/// binary, so that a cargo it runs builds as the outer `cargo test` did.
/// Build scripts that rerun when those change (ring's does) would see them
/// differ from the outer `cargo test` and rebuild, and the next `cargo test`
/// would rebuild them back: minutes per run on a small box.
pub fn outer_cargo_env(cmd: &mut Command) -> &mut Command {
    for (key, _) in std::env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        if is_test_package_var(key) {
            cmd.env_remove(key);
        }
    }
    cmd
}

/// Variables cargo sets for the test binary of a package, not for the cargo
/// process that built it.
fn is_test_package_var(key: &str) -> bool {
    [
        "CARGO_PKG_",
        "CARGO_MANIFEST_",
        "CARGO_CRATE_",
        "CARGO_BIN_",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
    ]
    .iter()
    .any(|prefix| key.starts_with(prefix))
        || key == "OUT_DIR"
}

fn run_cargo_build(name: &str, dir: &Path) -> Result<(), String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace_root())
        .args(["build", "-p", "ankusa-node", "--bin", name]);
    // Cargo runs a test with its package's variables set (CARGO_PKG_NAME,
    // CARGO_MANIFEST_DIR, OUT_DIR, ...); the nested build gets the outer ones.
    outer_cargo_env(&mut cmd);
    let profile = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match profile.as_str() {
        "debug" | "" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    if let Some(target) = dir.parent() {
        cmd.env("CARGO_TARGET_DIR", target);
    }
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running cargo build: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        Err(format!(
            "`cargo build -p ankusa-node --bin {name}` failed ({}):\n{}",
            out.status,
            lines[lines.len().saturating_sub(40)..].join("\n")
        ))
    }
}

/// Path of one of this workspace's binaries (`ankusa-node`, `ankusa`), building it
/// with `cargo build -p ankusa-node --bin <name>` once per test process.
///
/// It runs the build even when the file exists, because `cargo test -p ankusa-tests`
/// does not rebuild another package's binaries and a stale binary makes tests test old
/// code; when it is fresh the build is a quick no-op. Set `ANKUSA_TESTS_NO_BUILD=1` to
/// use an existing binary as is (it is still built when missing).
pub fn try_cargo_bin(name: &str) -> Result<PathBuf, HarnessError> {
    let dir = profile_dir();
    let path = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    let no_build = std::env::var_os("ANKUSA_TESTS_NO_BUILD").is_some_and(|v| v != "0");
    if !(no_build && path.is_file()) {
        build_once(name, &dir)?;
    }
    if path.is_file() {
        Ok(path)
    } else {
        Err(HarnessError::CargoBin {
            name: name.to_string(),
            detail: format!("built, but {} does not exist", path.display()),
        })
    }
}

/// [`try_cargo_bin`] that panics with the reason (for use inside tests).
pub fn cargo_bin(name: &str) -> PathBuf {
    try_cargo_bin(name).unwrap_or_else(|e| panic!("{e}"))
}
