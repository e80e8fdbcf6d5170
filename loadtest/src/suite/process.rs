//! The suite's child processes and what `/proc` says about them.
//!
//! Every process the suite starts is a [`Child`] it owns: dropped (a scenario ends, fails or
//! the suite is interrupted) means killed, so nothing outlives a run. Processes are told apart
//! by pid only, never by name.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use super::http;

/// How often readiness is polled: fast enough not to slow a scenario's start.
const READY_POLL: Duration = Duration::from_millis(100);

/// A process the suite started, killed when dropped.
#[derive(Debug)]
pub struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

/// The CPU time of a process tree, for per-request figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpuSample {
    /// User and system time of the process, its live descendants and the children they
    /// waited for, in seconds.
    pub seconds: f64,
}

// === impl Proc ===

impl Proc {
    /// Starts `program args...` with its output appended to `<work>/<name>.log`.
    pub fn spawn<I, S>(
        name: &str,
        program: &Path,
        args: I,
        envs: &[(&str, &str)],
        work: &Path,
    ) -> anyhow::Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let log = work.join(format!("{name}.log"));
        let out = File::options()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("cannot open {}", log.display()))?;
        let err = out.try_clone()?;
        let child = Command::new(program)
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start {name} ({})", program.display()))?;
        Ok(Self {
            name: name.to_owned(),
            child,
            log,
        })
    }

    /// Starts `program args...` and returns it with the first line it prints on stdout
    /// (a server announcing its address); the rest of its output goes to its log.
    pub async fn spawn_announcing<I, S>(
        name: &str,
        program: &Path,
        args: I,
        work: &Path,
        timeout: Duration,
    ) -> anyhow::Result<(Self, String)>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let log = work.join(format!("{name}.log"));
        let err = File::options().create(true).append(true).open(&log)?;
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start {name} ({})", program.display()))?;
        let stdout = child
            .stdout
            .take()
            .context("no stdout pipe for the announcement")?;
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(timeout, lines.next_line())
            .await
            .map_err(|_| anyhow::anyhow!("{name} announced nothing within {timeout:?}"))?
            .with_context(|| format!("cannot read {name}'s output"))?
            .with_context(|| format!("{name} exited before announcing its address"))?;
        // Keep draining stdout into nothing, so the process never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok((
            Self {
                name: name.to_owned(),
                child,
                log,
            },
            line,
        ))
    }

    /// The process id (0 once it was reaped, which the suite never reads).
    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// The name it was started under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Polls `url` until it answers 200, failing when `timeout` passes or the process exits.
    pub async fn wait_ready(&mut self, url: &str, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                anyhow::bail!(
                    "{} exited ({status}) before {url} answered; see {}",
                    self.name,
                    self.log.display()
                );
            }
            if matches!(http::get(url).await, Ok((200, _))) {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{} not ready at {url} after {timeout:?}",
                self.name
            );
            tokio::time::sleep(READY_POLL).await;
        }
    }

    /// SIGKILL, and wait for it to be gone.
    pub async fn kill(mut self) {
        let _ = self.child.kill().await;
    }

    /// SIGINT (a tracer then writes its summary), and wait for the exit.
    pub async fn interrupt(mut self) -> anyhow::Result<()> {
        let pid = rustix::process::Pid::from_raw(i32::try_from(self.pid())?)
            .context("the process is gone")?;
        rustix::process::kill_process(pid, rustix::process::Signal::INT)?;
        self.child.wait().await?;
        Ok(())
    }

    /// Resident memory of the process tree in KiB (0 when it is gone).
    pub fn rss_kib(&self) -> u64 {
        process_tree(self.pid())
            .into_iter()
            .map(|pid| status_field_kib(pid, "VmRSS:"))
            .sum()
    }

    /// CPU time of the process tree so far.
    pub fn cpu(&self) -> CpuSample {
        let ticks: u64 = process_tree(self.pid()).into_iter().map(cpu_ticks).sum();
        CpuSample {
            seconds: ticks as f64 / clock_ticks() as f64,
        }
    }

    /// Open file descriptors of the process itself.
    pub fn open_fds(&self) -> u64 {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|dir| dir.count() as u64)
            .unwrap_or(0)
    }
}

/// Kernel clock ticks per second, the unit of `/proc/<pid>/stat` times.
pub fn clock_ticks() -> u64 {
    rustix::param::clock_ticks_per_second().max(1)
}

/// `pid` and its live descendants, from every process's parent in `/proc/<pid>/stat`.
fn process_tree(pid: u32) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(child) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
                continue;
            };
            if let Some(parent) = stat_fields(child).and_then(|f| f.get(1)?.parse().ok()) {
                children.entry(parent).or_default().push(child);
            }
        }
    }
    let mut tree = vec![pid];
    let mut next = 0;
    while let Some(&current) = tree.get(next) {
        tree.extend(children.get(&current).into_iter().flatten().copied());
        next += 1;
    }
    tree
}

/// The fields of `/proc/<pid>/stat` after the command name (which may hold spaces): index 0
/// is the state, 1 the parent, 11–14 utime, stime, cutime and cstime.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = text.rsplit_once(')')?;
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// utime + stime + cutime + cstime of one process, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    stat_fields(pid).map_or(0, |fields| {
        fields
            .get(11..15)
            .into_iter()
            .flatten()
            .filter_map(|field| field.parse::<u64>().ok())
            .sum()
    })
}

/// A `kB` field of `/proc/<pid>/status`, 0 when absent.
fn status_field_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix(field))
                .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// A TCP port free on loopback right now (another process may take it before it is used;
/// servers that can announce a port they picked themselves are started on port 0 instead).
pub fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// The first executable called `name` on `PATH`.
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|path| path.is_file())
    })
}

/// Raises the open-file soft limit to the hard limit (children inherit it); returns the
/// soft limit in force afterwards.
pub fn raise_open_file_limit() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    let _ = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        },
    );
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// Waits, at most `max`, until the machine is quiet — under 10% of its CPU time busy over a
/// second — so that a backlog one target is still working through (LiteLLM after an
/// overload) does not slow the run that comes next. Returns the last busy share seen.
pub async fn settle(max: Duration) -> u32 {
    let deadline = Instant::now() + max;
    let mut busy = 0;
    while Instant::now() < deadline {
        busy = cpu_busy_percent(Duration::from_secs(1)).await;
        if busy < 10 {
            return busy;
        }
    }
    if !max.is_zero() {
        eprintln!("suite: the machine stayed busy ({busy}% of CPU time) before the next run");
    }
    busy
}

/// The share of all CPUs' time, in percent, spent busy over the next `window`.
async fn cpu_busy_percent(window: Duration) -> u32 {
    let before = cpu_times();
    tokio::time::sleep(window).await;
    let after = cpu_times();
    busy_percent(&before, &after)
}

/// The `cpu` line of `/proc/stat`: jiffies per state (user, nice, system, idle, iowait, ...).
fn cpu_times() -> Vec<u64> {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|text| {
            let line = text.lines().next()?.strip_prefix("cpu ")?.to_owned();
            Some(
                line.split_whitespace()
                    .filter_map(|v| v.parse().ok())
                    .collect(),
            )
        })
        .unwrap_or_default()
}

/// Busy share between two `cpu` lines; idle and iowait count as not busy.
fn busy_percent(before: &[u64], after: &[u64]) -> u32 {
    let delta = |i: usize| {
        after
            .get(i)
            .zip(before.get(i))
            .map_or(0, |(a, b)| a.saturating_sub(*b))
    };
    let total: u64 = (0..after.len()).map(delta).sum();
    let idle = delta(3) + delta(4);
    if total == 0 {
        return 0;
    }
    (100 * total.saturating_sub(idle) / total) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_share_counts_idle_and_iowait_as_not_busy() {
        // user nice system idle iowait irq softirq
        let before = [100, 0, 100, 1000, 50, 0, 0];
        let after = [130, 0, 110, 1050, 60, 0, 0];
        // 40 busy of 100 jiffies.
        assert_eq!(busy_percent(&before, &after), 40);
        assert_eq!(busy_percent(&before, &before), 0);
    }

    #[test]
    fn own_process_has_memory_cpu_and_descriptors() {
        let pid = std::process::id();
        assert!(status_field_kib(pid, "VmRSS:") > 0);
        assert!(stat_fields(pid).is_some_and(|f| f.len() > 15));
        assert!(process_tree(pid).contains(&pid));
        assert_eq!(status_field_kib(pid, "NoSuchField:"), 0);
    }
}
