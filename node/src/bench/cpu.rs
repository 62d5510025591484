//! CPU time as the OS counts it, so that a run can say where the CPU of a hit
//! and its settle went: this process's (the load generator, `getrusage`), the
//! whole host's (`/proc/stat`), and other processes' by pid
//! (`/proc/<pid>/stat`: nats-server, the nodes, redis-server), each named by
//! what it is.
//!
//! Everything here is `None` where the OS does not tell (off Linux, or a
//! process that is gone): a report then leaves the figure out rather than
//! guess it.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A process whose CPU a run reports beside the load generator's. Several may
/// share a name (every node of a fleet is `node`); their times are summed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Watched {
    pub name: String,
    pub pid: u32,
}

/// Why a `NAME=PID` could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WatchedError {
    #[error("`{0}`: say NAME=PID, e.g. nats-server=1234")]
    Shape(String),
    #[error("`{0}`: a name is 1 to 32 letters, digits, `-` or `_`")]
    Name(String),
    #[error("`{0}`: the pid is a positive number")]
    Pid(String),
}

impl FromStr for Watched {
    type Err = WatchedError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (name, pid) = text
            .split_once('=')
            .ok_or_else(|| WatchedError::Shape(text.into()))?;
        let name_ok = (1..=32).contains(&name.len())
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !name_ok {
            return Err(WatchedError::Name(text.into()));
        }
        let pid = pid
            .parse::<u32>()
            .ok()
            .filter(|&pid| pid > 0)
            .ok_or_else(|| WatchedError::Pid(text.into()))?;
        Ok(Self {
            name: name.into(),
            pid,
        })
    }
}

/// CPU time (user and system) this process has used so far.
pub fn own() -> Option<Duration> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage only writes the struct it is given, which outlives the call.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: a successful getrusage filled the struct.
    let usage = unsafe { usage.assume_init() };
    let time = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    Some(time(usage.ru_utime) + time(usage.ru_stime))
}

/// CPU time (user and system, every thread) process `pid` has used so far.
pub fn of_pid(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    ticks_to_time(parse_process_ticks(&stat)?)
}

/// `utime + stime` of a `/proc/<pid>/stat` line, in clock ticks. The fields
/// are counted after the command name, which is in parentheses and may hold
/// spaces or parentheses itself.
fn parse_process_ticks(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    // After the name: state is field 3 of the line, utime 14 and stime 15.
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

fn ticks_to_time(ticks: u64) -> Option<Duration> {
    // SAFETY: sysconf only reads a configuration value.
    let per_sec = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .ok()
        .filter(|&t| t > 0)?;
    Some(Duration::from_secs_f64(ticks as f64 / per_sec as f64))
}

/// The CPU time of every watched process now, in the order given.
pub fn read_watched(watch: &[Watched]) -> Vec<Option<Duration>> {
    watch.iter().map(|w| of_pid(w.pid)).collect()
}

/// Seconds each name's processes used between two readings of `watch`. A name
/// is left out if any of its processes could not be read both times.
pub fn used_by_name(
    watch: &[Watched],
    before: &[Option<Duration>],
    after: &[Option<Duration>],
) -> BTreeMap<String, f64> {
    let mut used: BTreeMap<String, Option<f64>> = BTreeMap::new();
    for ((w, before), after) in watch.iter().zip(before).zip(after) {
        let spent = before
            .zip(*after)
            .map(|(b, a)| a.saturating_sub(b).as_secs_f64());
        let total = used.entry(w.name.clone()).or_insert(Some(0.0));
        *total = total.zip(spent).map(|(sum, s)| sum + s);
    }
    used.into_iter()
        .filter_map(|(name, s)| s.map(|s| (name, s)))
        .collect()
}

/// The host's CPU time so far, in clock ticks summed over every core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostCpu {
    total: u64,
    /// Idle and waiting for I/O.
    idle: u64,
}

impl HostCpu {
    /// The aggregate `cpu` line of `/proc/stat` (`None` where there is none).
    pub fn now() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        Self::parse(stat.lines().next()?)
    }

    /// `cpu  user nice system idle iowait irq softirq steal …`: guest time is
    /// already inside user and nice, so it is not added again.
    fn parse(line: &str) -> Option<Self> {
        let mut fields = line.split_whitespace();
        if fields.next()? != "cpu" {
            return None;
        }
        let ticks: Vec<u64> = fields
            .take(8)
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        if ticks.len() < 5 {
            return None;
        }
        Some(Self {
            total: ticks.iter().sum(),
            idle: ticks[3] + ticks[4],
        })
    }

    /// Share of the host's CPU time that was busy since `before` (`None` if no
    /// time passed).
    pub fn busy_share_since(&self, before: &HostCpu) -> Option<f64> {
        let total = self.total.saturating_sub(before.total);
        let idle = self.idle.saturating_sub(before.idle);
        (total > 0).then(|| 1.0 - idle as f64 / total as f64)
    }

    /// CPU seconds the host spent busy since `before`, every core summed.
    pub fn busy_since(&self, before: &HostCpu) -> Option<f64> {
        let total = self.total.saturating_sub(before.total);
        let idle = self.idle.saturating_sub(before.idle);
        ticks_to_time(total.saturating_sub(idle)).map(|t| t.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hosts_cpu_line_is_read_field_by_field() {
        let cpu = HostCpu::parse("cpu  100 5 50 800 20 3 2 10 0 0").expect("a cpu line");
        assert_eq!((cpu.total, cpu.idle), (990, 820));
        assert!(HostCpu::parse("cpu0 100 5 50 800 20 3 2 10").is_none());
        assert!(HostCpu::parse("cpu  100 5 x 800").is_none());
        assert!(HostCpu::parse("cpu  100 5").is_none());
        let later = HostCpu {
            total: 1990,
            idle: 1320,
        };
        let share = later.busy_share_since(&cpu).expect("time passed");
        assert!((share - 0.5).abs() < 1e-9, "{share}");
        assert_eq!(cpu.busy_share_since(&cpu), None);
    }

    #[test]
    fn a_process_line_is_read_after_its_name() {
        // The name holds a space and a parenthesis; utime 7 and stime 5.
        let line = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 7 5 0 0 20 0 3 0 99";
        assert_eq!(parse_process_ticks(line), Some(12));
        assert_eq!(parse_process_ticks("42 (x) S 1 2"), None);
        assert_eq!(parse_process_ticks("no name here"), None);
    }

    #[test]
    fn this_process_is_read_by_pid_and_by_getrusage() {
        let busy = std::time::Instant::now();
        while busy.elapsed() < Duration::from_millis(30) {
            std::hint::black_box(busy.elapsed());
        }
        let by_pid = of_pid(std::process::id()).expect("/proc on Linux");
        let own = own().expect("getrusage on Linux");
        assert!(by_pid > Duration::ZERO && own > Duration::ZERO);
        // Clock ticks are 10 ms here: the two agree to a few of them.
        let apart = by_pid.abs_diff(own);
        assert!(apart < Duration::from_millis(100), "{by_pid:?} vs {own:?}");
        assert_eq!(of_pid(u32::MAX), None);
    }

    #[test]
    fn times_are_summed_by_name_and_a_name_with_a_gap_left_out() {
        let watch: Vec<Watched> = ["node=1", "node=2", "nats-server=3", "redis=4"]
            .iter()
            .map(|t| t.parse().expect("NAME=PID"))
            .collect();
        let s = |secs: f64| Some(Duration::from_secs_f64(secs));
        let before = [s(1.0), s(2.0), s(0.5), s(1.0)];
        let after = [s(1.5), s(2.25), s(1.0), None];
        let used = used_by_name(&watch, &before, &after);
        assert_eq!(used.len(), 2, "{used:?}");
        assert!((used["node"] - 0.75).abs() < 1e-9);
        assert!((used["nats-server"] - 0.5).abs() < 1e-9);
    }

    #[test]
    fn a_watched_process_is_named_then_numbered() {
        assert_eq!(
            "nats-server=77".parse::<Watched>(),
            Ok(Watched {
                name: "nats-server".into(),
                pid: 77
            })
        );
        for bad in ["node", "=5", "a b=5", "node=0", "node=x", "node=-1"] {
            assert!(bad.parse::<Watched>().is_err(), "{bad}");
        }
        assert!(format!("{}=1", "n".repeat(33)).parse::<Watched>().is_err());
    }
}
