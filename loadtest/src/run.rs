//! The two drivers: open loop at a fixed rate, closed loop with fixed concurrency.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use http::Uri;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::client::{self, Exchange, HttpClient, Transport};
use crate::outcome::{ErrorKind, Outcome};
use crate::report::{Mode, RunReport};
use crate::schedule::{scheduled_offset, OpenLoopPlan};
use crate::stats::Recorder;
use crate::workload::{BodyParams, Endpoint, TokenMix, Workload};

/// Default cap on outstanding open-loop requests: far above what a healthy run needs, low
/// enough that a dead server cannot make the client exhaust sockets or memory.
pub const DEFAULT_MAX_OUTSTANDING: usize = 10_000;

/// How load is generated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LoadMode {
    /// Open loop: request `i` is due at `t0 + i / rate`.
    Rate(f64),
    /// Closed loop: this many workers sending back to back.
    Concurrency(usize),
}

/// Everything a run needs.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Base URL, e.g. `http://127.0.0.1:8080`; the API path is appended.
    pub url: String,
    /// Open or closed loop.
    pub mode: LoadMode,
    /// Measured window.
    pub duration: Duration,
    /// Sent but not recorded, before the measured window.
    pub warmup: Duration,
    /// Prompts, used round-robin.
    pub prompts: Vec<String>,
    /// Share of streamed requests, 0..=1.
    pub stream_share: f64,
    /// `max_tokens` of each request, drawn from this mix.
    pub max_tokens: TokenMix,
    /// Check that every non-streamed 200 is a completion.
    pub check_answers: bool,
    /// Send `ignore_eos` so that every answer runs to its `max_tokens`.
    pub ignore_eos: bool,
    /// `model` of every request.
    pub model: String,
    /// Chat or completions.
    pub endpoint: Endpoint,
    /// Name written into the results.
    pub label: String,
    /// Open-loop cap on requests in flight; the excess counts as `client_overflow`.
    pub max_outstanding: usize,
    /// Per-request limit, from the actual send to the last byte.
    pub request_timeout: Duration,
    /// TCP connect limit.
    pub connect_timeout: Duration,
    /// HTTP/1.1, or HTTP/2 over a fixed number of connections.
    pub transport: Transport,
    /// Sent as `Authorization: Bearer <key>` (a router with tenants or API keys).
    pub api_key: Option<String>,
}

/// State shared by every request task.
#[derive(Debug)]
struct Shared {
    /// Request `i` goes through `clients[i % len]`.
    clients: Vec<HttpClient>,
    uri: Uri,
    workload: Workload,
    request_timeout: Duration,
    check_answers: bool,
    authorization: Option<http::HeaderValue>,
    measured: Mutex<Measured>,
}

/// What the recorded requests produced; one lock so a request is recorded in one step.
#[derive(Debug)]
struct Measured {
    recorder: Recorder,
    last_completion: Option<Instant>,
}

// === impl Shared ===

impl Shared {
    async fn send(&self, index: u64, origin: Instant) -> Outcome {
        let (body, stream) = self.workload.request(index);
        let exchange = Exchange {
            uri: &self.uri,
            body,
            stream,
            origin,
            timeout: self.request_timeout,
            check_answers: self.check_answers,
            authorization: self.authorization.as_ref(),
        };
        let client = &self.clients[index as usize % self.clients.len()];
        client::send(client, exchange).await
    }

    fn record(&self, outcome: &Outcome) {
        let now = Instant::now();
        let mut measured = self.lock_measured();
        measured.recorder.record(outcome);
        measured.last_completion = Some(measured.last_completion.map_or(now, |last| last.max(now)));
    }

    fn record_dropped(&self, kind: ErrorKind) {
        self.lock_measured().recorder.record_dropped(kind);
    }

    fn lock_measured(&self) -> MutexGuard<'_, Measured> {
        // A panicking request task cannot leave the counters half-updated in a way that
        // matters more than losing the whole run, so poisoning is ignored.
        self.measured.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Runs the load described by `config` and returns its report.
pub async fn run(config: &RunConfig) -> anyhow::Result<RunReport> {
    validate(config)?;
    let uri: Uri = format!(
        "{}{}",
        config.url.trim_end_matches('/'),
        config.endpoint.path()
    )
    .parse()
    .with_context(|| format!("invalid --url {}", config.url))?;
    let params = BodyParams {
        endpoint: config.endpoint,
        model: &config.model,
        max_tokens: 1,
        ignore_eos: config.ignore_eos,
    };
    let shared = Arc::new(Shared {
        clients: client::build_clients(config.transport, config.connect_timeout),
        uri,
        workload: Workload::prepare_mix(
            &config.prompts,
            &params,
            config.stream_share,
            &config.max_tokens,
        )?,
        request_timeout: config.request_timeout,
        check_answers: config.check_answers,
        authorization: match &config.api_key {
            Some(key) => Some(
                http::HeaderValue::from_str(&format!("Bearer {key}"))
                    .map_err(|_| anyhow::anyhow!("the API key is not a valid header value"))?,
            ),
            None => None,
        },
        measured: Mutex::new(Measured {
            recorder: Recorder::new()?,
            last_completion: None,
        }),
    });
    let measure_start = match config.mode {
        LoadMode::Rate(rate) => open_loop(&shared, rate, config).await?,
        LoadMode::Concurrency(workers) => closed_loop(&shared, workers, config).await?,
    };
    let (totals, last_completion) = {
        let measured = shared.lock_measured();
        (measured.recorder.totals(), measured.last_completion)
    };
    // Throughput over the window, stretched to the last completion when requests were still
    // finishing after it, so a server that falls behind is not credited for queued work.
    let window_end =
        (measure_start + config.duration).max(last_completion.unwrap_or(measure_start));
    let elapsed = window_end.duration_since(measure_start).as_secs_f64();
    let throughput_rps = if elapsed > 0.0 {
        totals.ok as f64 / elapsed
    } else {
        0.0
    };
    let (mode, rate, concurrency) = match config.mode {
        LoadMode::Rate(rate) => (Mode::Rate, Some(rate), None),
        LoadMode::Concurrency(workers) => (Mode::Concurrency, None, Some(workers as u64)),
    };
    Ok(RunReport {
        label: config.label.clone(),
        url: config.url.clone(),
        mode,
        rate,
        concurrency,
        duration_s: config.duration.as_secs_f64(),
        warmup_s: config.warmup.as_secs_f64(),
        model: config.model.clone(),
        endpoint: config.endpoint.as_str().to_owned(),
        max_tokens: config.max_tokens.mean().round() as u32,
        max_tokens_mix: config.max_tokens.to_string(),
        stream_share: config.stream_share,
        requests: totals.requests,
        ok: totals.ok,
        errors: totals.errors,
        throughput_rps,
        latency_us: totals.latency_us,
        ttft_us: totals.ttft_us,
        tiers: totals.tiers,
        profiles: totals.profiles,
        reasons: totals.reasons,
        per_tier: totals.per_tier,
        fallbacks: totals.fallbacks,
        retry_after_429: totals.retry_after_429,
        accounting: totals.accounting,
    })
}

fn validate(config: &RunConfig) -> anyhow::Result<()> {
    match config.mode {
        LoadMode::Rate(rate) => anyhow::ensure!(
            rate.is_finite() && rate > 0.0,
            "--rate must be a positive number, got {rate}"
        ),
        LoadMode::Concurrency(workers) => {
            anyhow::ensure!(workers > 0, "--concurrency must be at least 1")
        }
    }
    anyhow::ensure!(!config.duration.is_zero(), "--duration-s must be positive");
    anyhow::ensure!(
        (1..=u32::MAX as usize).contains(&config.max_outstanding),
        "--max-outstanding must be within 1..={}",
        u32::MAX
    );
    Ok(())
}

/// Open loop: each request in its own task, due at `t0 + i / rate`, latency measured from
/// that due time even when the dispatcher or the server is late. Returns when the measured
/// window starts.
async fn open_loop(shared: &Arc<Shared>, rate: f64, config: &RunConfig) -> anyhow::Result<Instant> {
    let plan = OpenLoopPlan::new(rate, config.warmup, config.duration);
    let outstanding = Arc::new(Semaphore::new(config.max_outstanding));
    let t0 = std::time::Instant::now();
    // The dispatcher sleeps on its own thread: tokio's timer wheel rounds every wake-up up to
    // the next millisecond, which would add up to 1 ms of client lag to every measured
    // latency, while a thread sleep is accurate to tens of microseconds.
    let dispatcher = {
        let shared = Arc::clone(shared);
        let outstanding = Arc::clone(&outstanding);
        let runtime = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            for index in 0..plan.total {
                let due = t0 + scheduled_offset(index, rate);
                let now = std::time::Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                dispatch(
                    &runtime,
                    &shared,
                    &outstanding,
                    index,
                    plan.is_measured(index),
                    due,
                );
            }
        })
    };
    dispatcher
        .await
        .context("the open-loop dispatcher failed")?;
    // Every task gives its permit back within the request timeout, so holding all permits
    // means every request has been recorded.
    let all = u32::try_from(config.max_outstanding).context("--max-outstanding too large")?;
    let drain = config.request_timeout + Duration::from_secs(1);
    tokio::time::timeout(drain, outstanding.acquire_many(all))
        .await
        .context("requests still outstanding after the request timeout")?
        .context("outstanding-request semaphore closed")?
        .forget();
    Ok(Instant::from_std(
        t0 + scheduled_offset(plan.warmup_end, rate),
    ))
}

/// Starts request `index` in its own task, or counts it as a client overflow when the cap on
/// outstanding requests is reached.
fn dispatch(
    runtime: &tokio::runtime::Handle,
    shared: &Arc<Shared>,
    outstanding: &Arc<Semaphore>,
    index: u64,
    measured: bool,
    due: std::time::Instant,
) {
    let Ok(permit) = Arc::clone(outstanding).try_acquire_owned() else {
        if measured {
            shared.record_dropped(ErrorKind::ClientOverflow);
        }
        return;
    };
    let shared = Arc::clone(shared);
    runtime.spawn(async move {
        let outcome = shared.send(index, Instant::from_std(due)).await;
        if measured {
            shared.record(&outcome);
        }
        drop(permit);
    });
}

/// Closed loop: `workers` tasks each send back to back until the window ends; requests
/// started during warm-up are not recorded. Returns when the measured window started.
async fn closed_loop(
    shared: &Arc<Shared>,
    workers: usize,
    config: &RunConfig,
) -> anyhow::Result<Instant> {
    let measure_start = Instant::now() + config.warmup;
    let stop_at = measure_start + config.duration;
    let next_index = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let shared = Arc::clone(shared);
            let next_index = Arc::clone(&next_index);
            tokio::spawn(async move {
                loop {
                    let started = Instant::now();
                    if started >= stop_at {
                        break;
                    }
                    let index = next_index.fetch_add(1, Ordering::Relaxed);
                    let outcome = shared.send(index, started).await;
                    if started >= measure_start {
                        shared.record(&outcome);
                    }
                }
            })
        })
        .collect();
    for result in futures_util::future::join_all(tasks).await {
        result.context("a load worker failed")?;
    }
    Ok(measure_start)
}
