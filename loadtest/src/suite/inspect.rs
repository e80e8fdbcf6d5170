//! The analyses of one router that count rather than time, so that a change shows up as a
//! number where wall-clock runs on a shared machine only show noise: instructions per
//! request (callgrind), system calls per request (strace), and the router's legs of a
//! request from kernel tracepoints (perf). Each runs the router with one worker in front of
//! a zero-latency simulator; the tool's output is parsed here.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;
use tokio::process::Command;
use tokio::time::Instant;

use super::process::{which, Proc};
use super::services::{single_profile, Server, Sim};
use super::{describe, write_section, Load, Suite, Target};
use crate::report::RunReport;
use crate::run::LoadMode;
use crate::scenario::Scenario;

/// Warm-up before the counters start: connections open, caches and pools filled.
const WARMUP: Duration = Duration::from_secs(2);
/// A router under valgrind starts tens of times slower than natively.
const VALGRIND_READY: Duration = Duration::from_secs(60);

/// `instructions`: the whole request as the router runs it — hyper, parse, decision,
/// rewrite, upstream client, metrics, response — at 100 req/s (each request alone in the
/// router), total instructions over requests answered; and the code a request runs from.
pub async fn instructions(suite: &Suite) -> anyhow::Result<String> {
    let valgrind = require("valgrind")?;
    let control = require("callgrind_control")?;
    let dir = suite.scenario_dir("instructions")?;
    let out_file = suite.work().join("callgrind.out");
    let out_flag = format!("--callgrind-out-file={}", out_file.display());
    let router_bin = suite.router_bin.to_string_lossy().into_owned();
    let prefix = [
        "--tool=callgrind",
        "--dump-instr=yes",
        out_flag.as_str(),
        router_bin.as_str(),
    ];
    let (sim, router) = start_pair(suite, &valgrind, &prefix, Some(VALGRIND_READY)).await?;
    let target = Target::new("quantrouter", &router.url, "auto");
    let rate = 100.0;
    drive(
        suite,
        &target,
        rate,
        WARMUP,
        &suite.work().join("warmup.json"),
    )
    .await?;
    let pid = router.proc.pid().to_string();
    tool(&control, &["--zero", &pid]).await?;
    let measured = Duration::from_secs_f64(suite.options.requests as f64 / rate);
    let report = drive(suite, &target, rate, measured, &dir.join("run.json")).await?;
    tool(&control, &["--dump", &pid]).await?;
    let dump = first_file_with_prefix(suite.work(), "callgrind.out.")?;
    let text = std::fs::read_to_string(&dump)?;
    let answered = report.ok.max(1);
    let total = callgrind_total(&text).context("no summary line in the callgrind dump")?;
    let code = hot_code(&text, answered);
    let mut out = format!(
        "router: {}\nrequests answered: {}\ninstructions: {total} in all, {} per request\n\
         code run per request: {} instructions in {} cache lines ({:.1} KiB) on {} pages\n",
        suite.router_bin.display(),
        report.ok,
        total / answered,
        code.instructions,
        code.cache_lines,
        code.cache_lines as f64 * 64.0 / 1024.0,
        code.pages
    );
    if suite.options.top > 0 {
        let annotate = require("callgrind_annotate")?;
        let listing = tool(&annotate, &["--inclusive=yes", &dump.to_string_lossy()]).await?;
        out.push_str("the router's own functions, instructions per request including callees:\n");
        for (count, function) in own_functions(&listing, answered)
            .into_iter()
            .take(suite.options.top)
        {
            let _ = writeln!(out, "{count:9}  {function}");
        }
    }
    router.proc.kill().await;
    sim.proc.kill().await;
    write_section(&dir, out)
}

/// `syscalls`: the kernel side of the same request, `strace -f -c` attached after the
/// warm-up, non-streamed requests at 200 req/s; calls per request by system call.
pub async fn syscalls(suite: &Suite) -> anyhow::Result<String> {
    let strace = require("strace")?;
    let dir = suite.scenario_dir("syscalls")?;
    let router_bin = suite.router_bin.clone();
    let (sim, router) = start_pair(suite, &router_bin, &[], None).await?;
    let target = Target::new("quantrouter", &router.url, "auto");
    let rate = 200.0;
    drive(
        suite,
        &target,
        rate,
        WARMUP,
        &suite.work().join("warmup.json"),
    )
    .await?;
    let summary = suite.work().join("strace.txt");
    let pid = router.proc.pid().to_string();
    let summary_text = summary.to_string_lossy().into_owned();
    let tracer = Proc::spawn(
        "strace",
        &strace,
        ["-f", "-c", "-o", &summary_text, "-p", &pid],
        &[],
        suite.work(),
    )?;
    wait_for_log(
        &suite.work().join("strace.log"),
        "attached",
        Duration::from_secs(10),
    )
    .await?;
    let measured = Duration::from_secs_f64(suite.options.requests as f64 / rate);
    let report = drive(suite, &target, rate, measured, &dir.join("run.json")).await?;
    tracer.interrupt().await?;
    let text = std::fs::read_to_string(&summary)?;
    let mut out = format!(
        "router: {}\nrequests answered: {}\nsystem calls per request:\n",
        suite.router_bin.display(),
        report.ok
    );
    for (calls, name) in calls_per_request(&text, report.ok.max(1)) {
        let _ = writeln!(out, "{calls:8.2}  {name}");
    }
    router.proc.kill().await;
    sim.proc.kill().await;
    write_section(&dir, out)
}

/// `legs`: `perf record` of the scheduler's switches and the router's socket calls on every
/// CPU for 2 s while load runs; medians and quartiles of each leg in µs.
pub async fn legs(suite: &Suite) -> anyhow::Result<String> {
    let perf = require("perf")?;
    let dir = suite.scenario_dir("legs")?;
    let router_bin = suite.router_bin.clone();
    let (sim, router) = start_pair(suite, &router_bin, &[], None).await?;
    let target = Target::new("quantrouter", &router.url, "auto");
    let mode = suite
        .options
        .legs_concurrency
        .map_or(LoadMode::Rate(200.0), LoadMode::Concurrency);
    let load = Load::new(Scenario::Overhead, mode, Duration::from_secs(5));
    let data = suite.work().join("perf.data");
    let mut events = String::from("sched:sched_switch");
    for call in ["recvfrom", "sendto", "writev"] {
        let _ = write!(
            events,
            ",syscalls:sys_enter_{call},syscalls:sys_exit_{call}"
        );
    }
    let data_text = data.to_string_lossy().into_owned();
    let record = async {
        tokio::time::sleep(WARMUP).await;
        tool(
            &perf,
            &[
                "record", "-q", "-m", "1024", "-a", "-e", &events, "-o", &data_text, "--", "sleep",
                "2",
            ],
        )
        .await
        .context("perf record failed (tracepoints need root)")
    };
    let run_file = dir.join("run.json");
    let (report, recorded) = tokio::join!(
        suite.run_load("quantrouter", &target, &load, &run_file),
        record
    );
    let report = report?;
    recorded?;
    let trace = tool(
        &perf,
        &["script", "-i", &data_text, "-F", "pid,tid,time,event,trace"],
    )
    .await?;
    let legs = router_legs(&trace, router.proc.pid());
    let mut out = format!(
        "router: {} ({}, {} µs p50 end to end)\nleg          p50    p25    p75 (µs)      n\n",
        suite.router_bin.display(),
        describe(mode),
        report.latency_us.p50
    );
    let mut total = 0.0;
    for (name, mut values) in legs {
        if values.is_empty() {
            continue;
        }
        values.sort_by(f64::total_cmp);
        let n = values.len();
        total += values[n / 2];
        let _ = writeln!(
            out,
            "{name:<8} {:7.0} {:6.0} {:6.0} {n:10}",
            values[n / 2],
            values[n / 4],
            values[3 * n / 4]
        );
    }
    let _ = writeln!(out, "sum of the medians: {total:.0} µs");
    router.proc.kill().await;
    sim.proc.kill().await;
    write_section(&dir, out)
}

/// A zero-latency simulator and the router on one worker (`program prefix...`, the router
/// itself or a tool wrapping it).
async fn start_pair(
    suite: &Suite,
    program: &Path,
    prefix: &[&str],
    ready: Option<Duration>,
) -> anyhow::Result<(Sim, Server)> {
    let sim = suite
        .start_sim("sim", "sim-model", (0, 0), 1024, None)
        .await?;
    let profiles = suite.write_profiles(
        "inspect-profiles.json",
        1,
        "sim",
        json!({}),
        &[single_profile(&sim.url, (10, 1), 4096)],
    )?;
    let router = suite
        .start_router_command(
            "quantrouter",
            program,
            prefix,
            &profiles,
            &[],
            &[("QUANTROUTER_WORKERS", "1")],
            ready,
        )
        .await?;
    Ok((sim, router))
}

/// Non-streamed requests of the prompt mix at `rate` for `duration`.
async fn drive(
    suite: &Suite,
    target: &Target,
    rate: f64,
    duration: Duration,
    out: &Path,
) -> anyhow::Result<RunReport> {
    let load = Load::new(Scenario::Overhead, LoadMode::Rate(rate), duration);
    suite.run_load("quantrouter", target, &load, out).await
}

fn require(tool: &str) -> anyhow::Result<PathBuf> {
    which(tool).with_context(|| format!("{tool} is not installed"))
}

/// Runs a tool to its end; its stdout, or an error with its stderr.
async fn tool(program: &Path, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new(program)
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("cannot run {}", program.display()))?;
    anyhow::ensure!(
        output.status.success(),
        "{} {} failed: {}",
        program.display(),
        args.join(" "),
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Polls a log until it contains `needle`.
async fn wait_for_log(log: &Path, needle: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !std::fs::read_to_string(log).is_ok_and(|text| text.contains(needle)) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "{needle:?} not in {} after {timeout:?}",
            log.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

fn first_file_with_prefix(dir: &Path, prefix: &str) -> anyhow::Result<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with(prefix))
        })
        .collect();
    files.sort();
    files
        .into_iter()
        .next()
        .with_context(|| format!("no {prefix}* in {}", dir.display()))
}

/// The `summary:` (or `totals:`) line of a callgrind dump.
pub fn callgrind_total(dump: &str) -> Option<u64> {
    dump.lines().find_map(|line| {
        line.strip_prefix("summary:")
            .or_else(|| line.strip_prefix("totals:"))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// The code a request runs from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HotCode {
    /// Distinct instructions that ran at least once every other request.
    pub instructions: usize,
    /// 64-byte cache lines holding them.
    pub cache_lines: usize,
    /// 4 KiB pages holding them.
    pub pages: usize,
}

/// Self cost per instruction address from a callgrind dump written with `--dump-instr=yes`
/// (positions `instr line`): a position is absolute (`0x...`), relative (`+n`, `-n`) or the
/// same (`*`); the line after a `calls=` line is the call's inclusive cost, not the calling
/// instruction's own. Hot = run at least once every other request.
pub fn hot_code(dump: &str, answered: u64) -> HotCode {
    let mut cost: BTreeMap<i64, u64> = BTreeMap::new();
    let mut address: i64 = 0;
    let mut call_cost = false;
    for line in dump.lines() {
        if line.starts_with("calls=") {
            call_cost = true;
            continue;
        }
        let Some(first) = line.chars().next() else {
            continue;
        };
        if !(first.is_ascii_digit() || matches!(first, '+' | '-' | '*')) {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let position = fields[0];
        if let Some(delta) = position.strip_prefix('+') {
            address += parse_int(delta);
        } else if let Some(delta) = position.strip_prefix('-') {
            address -= parse_int(delta);
        } else if position != "*" {
            address = parse_int(position);
        }
        if call_cost {
            call_cost = false;
        } else if let Some(count) = fields.get(2).and_then(|c| c.parse::<u64>().ok()) {
            *cost.entry(address).or_default() += count;
        }
    }
    let hot: Vec<i64> = cost
        .into_iter()
        .filter(|(_, count)| 2 * count >= answered)
        .map(|(address, _)| address)
        .collect();
    let cache_lines: HashSet<i64> = hot.iter().map(|a| a >> 6).collect();
    let pages: HashSet<i64> = hot.iter().map(|a| a >> 12).collect();
    HotCode {
        instructions: hot.len(),
        cache_lines: cache_lines.len(),
        pages: pages.len(),
    }
}

/// A decimal or `0x` hexadecimal integer, 0 when neither.
fn parse_int(text: &str) -> i64 {
    match text.strip_prefix("0x") {
        Some(hex) => i64::from_str_radix(hex, 16).unwrap_or(0),
        None => text.parse().unwrap_or(0),
    }
}

/// The router's own functions (under `crates/`, closures left out) from
/// `callgrind_annotate --inclusive=yes`, instructions per request, costliest first.
pub fn own_functions(listing: &str, answered: u64) -> Vec<(u64, String)> {
    let mut functions: Vec<(u64, String)> = listing
        .lines()
        .filter(|line| line.contains("crates/"))
        .filter_map(|line| {
            let line = line.trim_start();
            let (count, rest) = line.split_once(' ')?;
            let count: u64 = count.replace(',', "").parse().ok()?;
            // "(12.34%)  path/crates/x/src/y.rs:function [binary]"
            let rest = rest.trim_start();
            let rest = rest.strip_prefix('(')?.split_once(')')?.1.trim_start();
            let name = rest.rsplit_once(" [").map_or(rest, |(name, _)| name);
            let name = name.rsplit_once("crates/").map_or(name, |(_, name)| name);
            (!name.ends_with("{{closure}}")).then(|| (count / answered, name.to_owned()))
        })
        .collect();
    functions.sort_by_key(|(count, _)| std::cmp::Reverse(*count));
    functions
}

/// Calls per request by system call from `strace -c`'s table, most first.
pub fn calls_per_request(summary: &str, answered: u64) -> Vec<(f64, String)> {
    let mut calls: Vec<(f64, String)> = summary
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let name = *fields.last()?;
            let count: u64 = fields.get(3)?.parse().ok()?;
            let is_name = name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            (is_name && name != "total").then(|| (count as f64 / answered as f64, name.to_owned()))
        })
        .collect();
    calls.sort_by(|a, b| b.0.total_cmp(&a.0));
    calls
}

/// The router's legs of each request from `perf script -F pid,tid,time,event,trace`, in µs:
///
/// - `wake`: a router thread switched in, up to its next read (twice per request);
/// - `request`: that read's end up to its write to the upstream (`sendto`);
/// - `send`: that write;
/// - `answer`: a read's end up to the write to the client (`writev`);
/// - `reply`: that write.
pub fn router_legs(trace: &str, router_pid: u32) -> Vec<(&'static str, Vec<f64>)> {
    let router = router_pid.to_string();
    let events: Vec<(&str, &str, f64, &str, &str)> = trace
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (pid, tid) = fields.first()?.split_once('/')?;
            let time: f64 = fields.get(1)?.trim_end_matches(':').parse().ok()?;
            let event = fields.get(2)?.trim_end_matches(':');
            Some((pid, tid, time * 1e6, event, line))
        })
        .collect();
    let threads: HashSet<&str> = events
        .iter()
        .filter(|(pid, ..)| *pid == router)
        .map(|(_, tid, ..)| *tid)
        .collect();
    let mut legs: Vec<(&'static str, Vec<f64>)> = ["wake", "request", "send", "answer", "reply"]
        .into_iter()
        .map(|name| (name, Vec::new()))
        .collect();
    let mut push = |name: &str, value: f64| {
        if let Some((_, values)) = legs.iter_mut().find(|(leg, _)| *leg == name) {
            values.push(value);
        }
    };
    let (mut switched_in, mut read_done, mut write_start, mut pending) =
        (None::<f64>, None::<f64>, 0.0, None::<&str>);
    for (pid, _, t, event, line) in &events {
        if *event == "sched:sched_switch" {
            let next = line
                .split_once("next_pid=")
                .and_then(|(_, rest)| rest.split(|c: char| !c.is_ascii_digit()).next());
            if next.is_some_and(|next| threads.contains(next)) {
                switched_in = Some(*t);
            }
            continue;
        }
        if *pid != router {
            continue;
        }
        match *event {
            "syscalls:sys_enter_recvfrom" => {
                if let Some(start) = switched_in.take() {
                    push("wake", t - start);
                }
            }
            "syscalls:sys_exit_recvfrom" => read_done = Some(*t),
            "syscalls:sys_enter_sendto" | "syscalls:sys_enter_writev" => {
                if let Some(done) = read_done.take() {
                    // The upstream request goes out with send, the answer with writev.
                    let leg = if event.ends_with("sendto") {
                        "request"
                    } else {
                        "answer"
                    };
                    push(leg, t - done);
                    pending = Some(leg);
                    write_start = *t;
                }
            }
            "syscalls:sys_exit_sendto" | "syscalls:sys_exit_writev" => {
                if let Some(leg) = pending.take() {
                    push(
                        if leg == "request" { "send" } else { "reply" },
                        t - write_start,
                    );
                }
            }
            _ => {}
        }
    }
    legs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callgrind_costs_follow_relative_positions_and_skip_call_costs() {
        let dump = "\
positions: instr line
events: Ir
summary: 4000
fn=(1) main
0x1000 10 100
+4 11 100
*  11 50
calls=1 0x2000 20
+4 12 9999
+4 13 1
0x2000 20 100
";
        assert_eq!(callgrind_total(dump), Some(4000));
        // 100 answers: hot = at least 50; 0x1000, 0x1004 (+50 on the same), 0x2000; not the
        // call's inclusive cost at 0x1008, nor 0x100c with 1.
        let code = hot_code(dump, 100);
        assert_eq!(code.instructions, 3);
        assert_eq!(code.cache_lines, 2);
        assert_eq!(code.pages, 2);
    }

    #[test]
    fn strace_table_becomes_calls_per_request() {
        let summary = "\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 40.00    0.004000           2      2030           epoll_wait
 30.00    0.003000           1      2010        10 recvfrom
 10.00    0.001000           1      1000           writev
------ ----------- ----------- --------- --------- ----------------
100.00    0.010000           1      5040        10 total
";
        let calls = calls_per_request(summary, 1000);
        assert_eq!(calls.len(), 3, "{calls:?}");
        assert_eq!(calls[0], (2.03, "epoll_wait".to_owned()));
        assert_eq!(calls[1], (2.01, "recvfrom".to_owned()));
        assert_eq!(calls[2], (1.0, "writev".to_owned()));
    }

    #[test]
    fn annotate_listing_keeps_own_functions_without_closures() {
        let listing = "\
 70,000,000 (100.0%)  PROGRAM TOTALS
 20,000,000 (28.57%)  /src/crates/quantrouter/src/server.rs:quantrouter::server::handle [/bin/qr]
  9,000,000 (12.86%)  /src/crates/quantrouter/src/server.rs:quantrouter::server::handle::{{closure}} [/bin/qr]
  5,000,000 ( 7.14%)  /rustc/library/core/src/ptr/mod.rs:core::ptr::drop [/bin/qr]
  6,000,000 ( 8.57%)  /src/crates/policy/src/lib.rs:quantrouter_policy::decide [/bin/qr]
";
        let functions = own_functions(listing, 1000);
        assert_eq!(
            functions,
            vec![
                (
                    20_000,
                    "quantrouter/src/server.rs:quantrouter::server::handle".to_owned()
                ),
                (
                    6_000,
                    "policy/src/lib.rs:quantrouter_policy::decide".to_owned()
                ),
            ]
        );
    }

    #[test]
    fn legs_are_timed_between_switches_reads_and_writes() {
        let trace = "\
    99/99    10.000000: sched:sched_switch: prev_pid=1 next_pid=42
    42/42    10.000010: syscalls:sys_enter_recvfrom: fd: 1
    42/42    10.000012: syscalls:sys_exit_recvfrom: 0x100
    42/42    10.000042: syscalls:sys_enter_sendto: fd: 2
    42/42    10.000062: syscalls:sys_exit_sendto: 0x100
    77/77    10.000070: syscalls:sys_enter_recvfrom: fd: 9
    42/42    10.000100: syscalls:sys_exit_recvfrom: 0x80
    42/42    10.000115: syscalls:sys_enter_writev: fd: 1
    42/42    10.000125: syscalls:sys_exit_writev: 0x80
";
        let legs: BTreeMap<&str, Vec<f64>> = router_legs(trace, 42).into_iter().collect();
        let rounded =
            |name: &str| -> Vec<i64> { legs[name].iter().map(|v| v.round() as i64).collect() };
        assert_eq!(rounded("wake"), vec![10]);
        assert_eq!(rounded("request"), vec![30]);
        assert_eq!(rounded("send"), vec![20]);
        assert_eq!(rounded("answer"), vec![15]);
        assert_eq!(rounded("reply"), vec![10]);
    }
}
