//! `loadtest suite`: the benchmark scenarios, run end to end on loopback.
//!
//! For each scenario the suite starts what it needs — vllm-sim processes, the router under
//! test, and the alternatives it is compared against in the same run (a do-nothing `socat`
//! relay, vllm-router, LiteLLM) when they are installed — drives them with [`crate::run()`],
//! writes every run's JSON, a `facts.json` and a `section.md` (the tables of
//! [`crate::markdown`]) under `<results>/<scenario>/`, and replaces the scenario's generated
//! block in `docs/performance.md` (between `<!-- bench:NAME:begin -->` and `... end -->`).
//! Baselines are measured in the same run as the subjects; compare numbers only within one.

mod ab;
mod burst;
mod cache;
mod chaos;
mod doc;
mod gateway;
mod http;
mod inspect;
mod mixed;
mod overhead;
mod overload;
mod process;
mod services;
mod soak;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, ValueEnum};

pub use ab::{run_ab, AbArgs};
pub use process::Proc;

use crate::client::Transport;
use crate::report::RunReport;
use crate::run::{run, LoadMode, RunConfig, DEFAULT_MAX_OUTSTANDING};
use crate::scenario::Scenario;
use crate::workload::{resolve_prompts, shuffle, Endpoint};

/// `loadtest suite`.
#[derive(Debug, Args)]
pub struct SuiteArgs {
    /// What to run, in the order given; `all` is overhead, mixed, overload, chaos and soak
    /// (the scenarios with a table in docs/performance.md). The others are analyses of the
    /// router alone: burst-memory (RSS through a burst of connections), instructions
    /// (callgrind), syscalls (strace), legs (kernel tracepoints, needs root).
    #[arg(value_enum, value_name = "SCENARIO", default_values_t = [Selection::All])]
    pub scenarios: Vec<Selection>,
    /// Settings shared with `loadtest ab`.
    #[command(flatten)]
    pub options: SuiteOptions,
}

/// What `loadtest suite` can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Selection {
    /// Overhead, mixed, overload, chaos and soak.
    All,
    /// The router's own cost against a zero-latency simulator, beside direct, socat,
    /// vllm-router and LiteLLM.
    Overhead,
    /// The router as a real Envoy's endpoint picker, beside the router as the proxy and a
    /// plain Envoy relay (needs Envoy: scripts/install-tools envoy).
    Gateway,
    /// Three tiers and the prompt mix: latency and cost.
    Mixed,
    /// Five times a tier's capacity: admission control.
    Overload,
    /// Endpoints killed, failing and hanging, Redis restarted, profiles pushed under load.
    Chaos,
    /// 10,000 streams open at once: memory and CPU per stream.
    Soak,
    /// Multi-turn conversations over four replicas with a prefix cache: cache-aware
    /// endpoint choice against round robin, least load and vllm-router's cache_aware.
    Cache,
    /// The router's RSS through a burst of 2,000 clients and after it.
    BurstMemory,
    /// Instructions per request under callgrind (needs valgrind).
    Instructions,
    /// System calls per request under strace (needs strace).
    Syscalls,
    /// The router's legs of a request from kernel tracepoints (needs perf and root).
    Legs,
}

/// Durations, binaries and places shared by every scenario.
#[derive(Debug, Clone, Args)]
pub struct SuiteOptions {
    /// Measured window of each run in seconds (chaos runs 6×, mixed 3×, overload 2×).
    #[arg(long, default_value_t = 10.0)]
    pub duration_s: f64,
    /// Warm-up before each measured window, in seconds.
    #[arg(long, default_value_t = 2.0)]
    pub warmup_s: f64,
    /// Rounds of the overhead scenario's paired runs (each target beside a direct run).
    #[arg(long, default_value_t = 5)]
    pub paired_rounds: u32,
    /// The overhead scenario's highest sustained rate must keep p99 under this.
    #[arg(long, default_value_t = 20.0)]
    pub sustain_p99_ms: f64,
    /// Arrival rate of the mixed scenario.
    #[arg(long, default_value_t = 30.0)]
    pub mixed_rate: f64,
    /// Streams the soak scenario opens at once (fewer when the open-file limit is lower).
    #[arg(long, default_value_t = 10_000)]
    pub soak_streams: usize,
    /// The soak simulator's time per token; a stream lasts 300 of them.
    #[arg(long, default_value_t = 200)]
    pub soak_itl_ms: u64,
    /// Requests measured by `instructions` and `syscalls`.
    #[arg(long, default_value_t = 1000)]
    pub requests: u64,
    /// `instructions`: also list the router's this many costliest functions.
    #[arg(long, default_value_t = 0)]
    pub top: usize,
    /// `legs`: closed loop with this many clients instead of 200 req/s.
    #[arg(long)]
    pub legs_concurrency: Option<usize>,
    /// Leave out socat, vllm-router and LiteLLM.
    #[arg(long)]
    pub no_alternatives: bool,
    /// Run every router and alternative under `taskset -c CPUS`, as in a pod with CPUs of its
    /// own (a router's default worker count follows). Run the suite itself under `taskset`
    /// on the other CPUs, so the load generator and the simulators stay off them.
    #[arg(long, value_name = "CPUS")]
    pub target_cpus: Option<String>,
    /// Where `scripts/install-alternatives` put the venvs of vllm-router and LiteLLM.
    #[arg(long, default_value = ".bench")]
    pub alternatives_dir: PathBuf,
    /// Before each run wait at most this long for the machine to be quiet (0: never wait).
    #[arg(long, default_value_t = 120)]
    pub settle_max_s: u64,
    /// How long the router, the simulators and socat may take to answer their health check.
    #[arg(long, default_value_t = 30)]
    pub ready_timeout_s: u64,
    /// How long vllm-router and LiteLLM may take to start.
    #[arg(long, default_value_t = 120)]
    pub alternative_ready_timeout_s: u64,
    /// Directory holding `vllm-sim` and `quantrouter` (default: this binary's directory,
    /// `target/release` when run by `scripts/bench`).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// The router binary under test (default: `quantrouter` in the binary directory).
    #[arg(long)]
    pub router: Option<PathBuf>,
    /// Results go to `<results>/<scenario>/`.
    #[arg(long, default_value = "loadtest/results")]
    pub results: PathBuf,
    /// The document whose generated blocks are replaced.
    #[arg(long, default_value = "docs/performance.md")]
    pub doc: PathBuf,
    /// Leave the document alone.
    #[arg(long)]
    pub no_doc: bool,
}

/// A server a load is sent to.
#[derive(Debug, Clone)]
pub struct Target {
    /// Name in the tables and file names.
    pub name: String,
    /// Base URL.
    pub url: String,
    /// `model` of the requests (`auto` through quantrouter).
    pub model: String,
    /// Sent as a bearer key (a router with tenants).
    pub api_key: Option<String>,
}

/// The shape and size of one run.
#[derive(Debug, Clone)]
pub struct Load {
    preset: Scenario,
    mode: LoadMode,
    duration: Duration,
    warmup: Duration,
    timeout: Duration,
    connect_timeout: Duration,
    max_outstanding: usize,
    stream_share: Option<f64>,
    seed: Option<u64>,
    transport: Transport,
}

/// Everything the scenarios share: options, binaries, the working directory, the prompts.
#[derive(Debug)]
pub struct Suite {
    options: SuiteOptions,
    sim_bin: PathBuf,
    router_bin: PathBuf,
    /// `quantrouter` of the binary directory, for `profiles push`.
    cli_bin: PathBuf,
    router_label: String,
    work: tempfile::TempDir,
    prompts: Vec<String>,
}

/// The scenarios with a generated block in the document.
const DOC_SCENARIOS: [&str; 7] = [
    "overhead", "mixed", "overload", "chaos", "soak", "gateway", "cache",
];

/// Runs `loadtest suite`.
pub async fn run_suite(args: SuiteArgs) -> anyhow::Result<()> {
    let suite = Suite::new(args.options)?;
    let mut ran = Vec::new();
    let mut order = Vec::new();
    for selection in args.scenarios {
        match selection {
            Selection::All => order.extend([
                Selection::Overhead,
                Selection::Mixed,
                Selection::Overload,
                Selection::Chaos,
                Selection::Soak,
            ]),
            other => order.push(other),
        }
    }
    for selection in order {
        let name = selection_name(selection);
        println!("\n=== scenario {name}");
        let section = suite
            .run_one(selection)
            .await
            .inspect_err(|_| suite.print_log_tails())?;
        println!("{section}");
        if DOC_SCENARIOS.contains(&name) {
            ran.push(name);
        }
    }
    if !suite.options.no_doc {
        doc::update(&suite.options.doc, &suite.options.results, &ran)?;
    }
    println!(
        "\n=== results in {}/<scenario>/",
        suite.options.results.display()
    );
    Ok(())
}

fn selection_name(selection: Selection) -> &'static str {
    match selection {
        Selection::All => "all",
        Selection::Overhead => "overhead",
        Selection::Gateway => "gateway",
        Selection::Mixed => "mixed",
        Selection::Overload => "overload",
        Selection::Chaos => "chaos",
        Selection::Soak => "soak",
        Selection::Cache => "cache",
        Selection::BurstMemory => "burst-memory",
        Selection::Instructions => "instructions",
        Selection::Syscalls => "syscalls",
        Selection::Legs => "legs",
    }
}

// === impl Suite ===

impl Suite {
    /// Checks the binaries and loads the prompts.
    pub fn new(options: SuiteOptions) -> anyhow::Result<Self> {
        let bin_dir = match &options.bin_dir {
            Some(dir) => dir.clone(),
            None => std::env::current_exe()?
                .parent()
                .context("this binary has no directory")?
                .to_path_buf(),
        };
        let sim_bin = bin_dir.join("vllm-sim");
        let cli_bin = bin_dir.join("quantrouter");
        let router_bin = options.router.clone().unwrap_or_else(|| cli_bin.clone());
        let cwd = std::env::current_dir().unwrap_or_default();
        let router_label = format!(
            "`{}`",
            router_bin
                .strip_prefix(&cwd)
                .unwrap_or(&router_bin)
                .display()
        );
        for binary in [&sim_bin, &router_bin, &cli_bin] {
            anyhow::ensure!(
                binary.is_file(),
                "{} is missing: `cargo build --release -p vllm-sim -p quantrouter -p loadtest` \
                 (scripts/bench does), or point --bin-dir / --router elsewhere",
                binary.display()
            );
        }
        anyhow::ensure!(
            options.duration_s > 0.0 && options.duration_s.is_finite(),
            "--duration-s must be positive"
        );
        seconds("--warmup-s", options.warmup_s)?;
        let work = tempfile::Builder::new()
            .prefix("loadtest-suite-")
            .tempdir()?;
        let (prompts, source) = resolve_prompts(None)?;
        eprintln!("suite: {} prompts from {source}", prompts.len());
        eprintln!("suite: router under test {}", router_bin.display());
        Ok(Self {
            options,
            sim_bin,
            router_bin,
            cli_bin,
            router_label,
            work,
            prompts,
        })
    }

    async fn run_one(&self, selection: Selection) -> anyhow::Result<String> {
        match selection {
            Selection::All => Ok(String::new()),
            Selection::Overhead => overhead::run(self).await,
            Selection::Gateway => gateway::run(self).await,
            Selection::Mixed => mixed::run(self).await,
            Selection::Overload => overload::run(self).await,
            Selection::Chaos => chaos::run(self).await,
            Selection::Soak => soak::run(self).await,
            Selection::Cache => cache::run(self).await,
            Selection::BurstMemory => burst::run(self).await,
            Selection::Instructions => inspect::instructions(self).await,
            Selection::Syscalls => inspect::syscalls(self).await,
            Selection::Legs => inspect::legs(self).await,
        }
    }

    /// `<results>/<name>/`, emptied.
    fn scenario_dir(&self, name: &str) -> anyhow::Result<PathBuf> {
        let dir = self.options.results.join(name);
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("cannot empty {}", dir.display()))?;
        }
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        Ok(dir)
    }

    fn work(&self) -> &Path {
        self.work.path()
    }

    fn prompts(&self) -> &[String] {
        &self.prompts
    }

    fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.options.duration_s)
    }

    fn warmup(&self) -> Duration {
        Duration::from_secs_f64(self.options.warmup_s)
    }

    async fn settle(&self) {
        process::settle(Duration::from_secs(self.options.settle_max_s)).await;
    }

    /// The load generator's configuration for `load` against `target`.
    fn config(&self, label: &str, target: &Target, load: &Load) -> RunConfig {
        let preset = load.preset.preset();
        let mut prompts = self.prompts.clone();
        if let Some(seed) = load.seed {
            shuffle(&mut prompts, seed);
        }
        RunConfig {
            url: target.url.clone(),
            mode: load.mode,
            duration: load.duration,
            warmup: load.warmup,
            prompts,
            stream_share: load.stream_share.unwrap_or(preset.stream_share),
            max_tokens: preset.max_tokens,
            check_answers: preset.check_answers,
            ignore_eos: preset.ignore_eos,
            model: target.model.clone(),
            endpoint: Endpoint::Chat,
            label: label.to_owned(),
            max_outstanding: load.max_outstanding,
            request_timeout: load.timeout,
            connect_timeout: load.connect_timeout,
            transport: load.transport,
            api_key: target.api_key.clone(),
        }
    }

    /// Runs `load` against `target`, prints the run's table and writes its JSON to `out`.
    async fn run_load(
        &self,
        label: &str,
        target: &Target,
        load: &Load,
        out: &Path,
    ) -> anyhow::Result<RunReport> {
        println!("\n--- {label}");
        let report = run(&self.config(label, target, load)).await?;
        print!("{}", report.render_table());
        report.write_json(out)?;
        Ok(report)
    }

    /// [`Suite::run_load`], and the CPU time `process` spent in the measured window (from
    /// the end of the warm-up to the last answer).
    async fn run_load_with_cpu(
        &self,
        label: &str,
        target: &Target,
        load: &Load,
        out: &Path,
        process: Option<&Proc>,
    ) -> anyhow::Result<(RunReport, Option<f64>)> {
        let Some(process) = process else {
            return Ok((self.run_load(label, target, load, out).await?, None));
        };
        let measure = async {
            tokio::time::sleep(load.warmup).await;
            process.cpu()
        };
        let (report, start) = tokio::join!(self.run_load(label, target, load, out), measure);
        let end = process.cpu();
        Ok((report?, Some(end.seconds - start.seconds)))
    }

    /// Lines naming the machine, the time and the router build, for every section.
    fn machine(&self) -> String {
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|text| {
                text.lines()
                    .find_map(|line| line.strip_prefix("model name"))
                    .and_then(|rest| Some(rest.split_once(':')?.1.trim().to_owned()))
            })
            .unwrap_or_else(|| "unknown CPU".to_owned());
        let mem_kib = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|text| {
                text.lines()
                    .find_map(|line| line.strip_prefix("MemTotal:"))
                    .and_then(|rest| rest.split_whitespace().next()?.parse::<f64>().ok())
            })
            .unwrap_or(0.0);
        format!(
            "Machine: {cores} cores ({cpu}), {:.0} GiB; load generator, router and\n\
             simulators share the cores. Run of {} UTC.\nRouter: {}.\n",
            mem_kib / 1_048_576.0,
            utc_now(),
            self.router_label
        )
    }

    /// The command line that reproduces a section, for its head.
    fn command(&self, name: &str) -> String {
        format!(
            "```sh\nscripts/bench {name} --duration-s {} --warmup-s {}\n```\n\n",
            self.options.duration_s, self.options.warmup_s
        )
    }

    /// [`Suite::command`] of a scenario that has no warm-up.
    fn command_without_warmup(&self, name: &str) -> String {
        format!(
            "```sh\nscripts/bench {name} --duration-s {}\n```\n\n",
            self.options.duration_s
        )
    }

    /// Prints the end of every log in the working directory, for a scenario that failed.
    fn print_log_tails(&self) {
        let Ok(entries) = std::fs::read_dir(self.work()) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|ext| ext == "log") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                eprintln!("--- last lines of {}", path.display());
                for line in &lines[lines.len().saturating_sub(20)..] {
                    eprintln!("{line}");
                }
            }
        }
    }
}

// === impl Load ===

impl Load {
    /// A run of `preset`'s request shape; no warm-up, a 10 s request timeout.
    pub fn new(preset: Scenario, mode: LoadMode, duration: Duration) -> Self {
        Self {
            preset,
            mode,
            duration,
            warmup: Duration::ZERO,
            timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            max_outstanding: DEFAULT_MAX_OUTSTANDING,
            stream_share: None,
            seed: None,
            transport: Transport::Http1,
        }
    }

    fn warmup(mut self, warmup: Duration) -> Self {
        self.warmup = warmup;
        self
    }

    fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn max_outstanding(mut self, max: usize) -> Self {
        self.max_outstanding = max;
        self
    }

    fn stream_share(mut self, share: f64) -> Self {
        self.stream_share = Some(share);
        self
    }
}

// === impl Target ===

impl Target {
    fn new(name: &str, url: &str, model: &str) -> Self {
        Self {
            name: name.to_owned(),
            url: url.to_owned(),
            model: model.to_owned(),
            api_key: None,
        }
    }

    /// The same target, sending `key` as a bearer key.
    fn with_api_key(mut self, key: &str) -> Self {
        self.api_key = Some(key.to_owned());
        self
    }
}

fn seconds(flag: &str, value: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(value)
        .map_err(|_| anyhow::anyhow!("{flag} must be a non-negative number of seconds"))
}

/// Writes `value` as pretty JSON.
fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> anyhow::Result<()> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// Writes a scenario's section and returns it.
fn write_section(dir: &Path, section: String) -> anyhow::Result<String> {
    let path = dir.join("section.md");
    std::fs::write(&path, &section).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(section)
}

/// `200 req/s` or `32 clients`.
fn describe(mode: LoadMode) -> String {
    match mode {
        LoadMode::Rate(rate) => format!("{rate} req/s"),
        LoadMode::Concurrency(clients) => format!("{clients} clients"),
    }
}

/// Mebibytes from kibibytes, one decimal.
fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

/// `YYYY-MM-DD HH:MM` of now, in UTC.
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    civil_from_unix(secs)
}

/// `YYYY-MM-DD HH:MM` of a Unix time (Howard Hinnant's days-to-civil algorithm).
fn civil_from_unix(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let (hour, minute) = ((secs % 86_400) / 3600, (secs % 3600) / 60);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {hour:02}:{minute:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_times_become_utc_dates() {
        assert_eq!(civil_from_unix(0), "1970-01-01 00:00");
        // 2024-02-29 13:45 UTC: a leap day.
        assert_eq!(civil_from_unix(1_709_214_300), "2024-02-29 13:45");
        assert_eq!(civil_from_unix(1_764_043_200), "2025-11-25 04:00");
    }
}
