//! `quantrouter profile-tier`: measure a live OpenAI-compatible endpoint and print the
//! profile fields it supports — `latency.ttft_ms`/`itl_ms` from streamed requests at a few
//! concurrency levels, `quality.*` from an eval set — optionally merged into a profile-set
//! file and pushed to Redis with compare-and-set.
//!
//! Pure logic (answer checks, statistics, merging, scoring, SSE reading) lives in its own
//! modules; `client` and `run` do the I/O.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args;
use quantrouter_policy::ProfileSet;
use tokio::time::Instant;

use crate::cli::documents::{connect_store, store_error, RedisArgs};
use crate::cli::error::CliError;
use crate::documents::RedisStore;

pub mod client;
pub mod eval;
pub mod matchers;
pub mod merge;
pub mod report;
pub mod run;
pub mod sse;
pub mod stats;

use client::{Endpoint, TierClient};
use eval::EvalItem;
use merge::{Measured, MeasuredLatency, QualityFigures};
use report::{Measurements, PassReport, QualitySource, Report};
use run::{RunOutcome, RunSettings};

/// Connecting to a tier takes milliseconds; five seconds only fails a wrong address.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Measure a live OpenAI-compatible endpoint and print a profile entry.
#[derive(Debug, Args)]
pub struct ProfileTierArgs {
    /// Base URL of the server (`http://host:port`, with or without `/v1`).
    #[arg(long)]
    pub url: String,
    /// Model name to request.
    #[arg(long)]
    pub model: String,
    /// Eval set: JSON Lines of {"prompt", "expected", "task_class", "match"}, or `builtin`
    /// for the shipped set (eval/tier-eval.jsonl). Without it only latency is measured.
    #[arg(long)]
    pub eval: Option<PathBuf>,
    /// Concurrency levels of the latency measurement.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub concurrency: Vec<usize>,
    /// Streamed requests per level [default: 4 × concurrency, at least 8].
    #[arg(long)]
    pub requests_per_level: Option<usize>,
    /// `max_tokens` of every request: room for a worked answer, and enough tokens to time
    /// decoding.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
    /// Reference tier (e.g. the FP16 deployment of the same model) that answers the eval set
    /// too; agreement with it is reported per task class.
    #[arg(long)]
    pub baseline: Option<String>,
    /// Model name on the baseline [default: --model].
    #[arg(long)]
    pub baseline_model: Option<String>,
    /// Environment variable holding the endpoint's API key (sent as a bearer token).
    #[arg(long)]
    pub api_key_env: Option<String>,
    /// Environment variable holding the baseline's API key.
    #[arg(long)]
    pub baseline_api_key_env: Option<String>,
    /// Eval requests in flight at once (per endpoint): a few hundred items in a minute or
    /// two without loading a production tier much.
    #[arg(long, default_value_t = 8)]
    pub eval_concurrency: usize,
    /// What the quality figures measure: accuracy on the eval set, or agreement with
    /// --baseline.
    #[arg(long, value_enum, default_value = "accuracy")]
    pub quality: QualitySource,
    /// Fewest answers behind a quality figure in the profile entry: below ten, one answer
    /// moves a figure by more than ten points.
    #[arg(long, default_value_t = 10)]
    pub min_items: u32,
    /// Most requests the run sends: the latency levels first, then eval items spread over
    /// the set.
    #[arg(long, default_value_t = 1000)]
    pub max_requests: usize,
    /// Seconds the whole run may take; no request starts later and those in flight are
    /// cut off (the default fits the shipped set with a baseline on a slow tier).
    #[arg(long, default_value_t = 900)]
    pub timeout: u64,
    /// Seconds one request may take.
    #[arg(long, default_value_t = 120)]
    pub request_timeout: u64,
    /// Profile-set file to write the measured fields into (profile --id), validated first.
    #[arg(long, requires = "id")]
    pub merge: Option<PathBuf>,
    /// The profile the measurement is for.
    #[arg(long)]
    pub id: Option<String>,
    /// Push the result to Redis with compare-and-set: the merged file, or without --merge
    /// the active set with profile --id updated.
    #[arg(long, requires_all = ["id", "redis_url"])]
    pub push: bool,
    /// `redis://[user:password@]host:port[/db]`,
    /// `redis+sentinel://[user:password@]host:port[,host:port...]/MASTER[/db]` or
    /// `redis+cluster://[user:password@]host:port[,host:port...]`; `rediss…` for TLS.
    #[arg(long, env = "QUANTROUTER_REDIS_URL")]
    pub redis_url: Option<String>,
    /// Key prefix.
    #[arg(long, env = "QUANTROUTER_REDIS_PREFIX", default_value = "quantrouter")]
    pub redis_prefix: String,
    /// PEM CA certificate to verify a TLS (`rediss…`) Redis with (default: system roots).
    #[arg(long, env = "QUANTROUTER_REDIS_CA_FILE")]
    pub redis_ca_file: Option<PathBuf>,
    /// The sentinels' own password; the URL's password is the master's.
    #[arg(
        long,
        env = "QUANTROUTER_REDIS_SENTINEL_PASSWORD",
        hide_env_values = true
    )]
    pub redis_sentinel_password: Option<String>,
}

/// Checked arguments, ready to run.
#[derive(Debug)]
struct Setup {
    tier: Endpoint,
    baseline: Option<Endpoint>,
    /// The eval set given with --eval.
    eval: Option<Vec<EvalItem>>,
    redis: Option<RedisArgs>,
}

/// Runs the command.
pub fn run(args: ProfileTierArgs) -> Result<(), CliError> {
    let setup = Setup::new(&args)?;
    if let (Some(path), Some(id)) = (&args.merge, &args.id) {
        // Fail before measuring, not after.
        with_profile(read_profile_file(path)?, id)?;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::Io(format!("starting the runtime: {e}")))?;
    runtime.block_on(measure_and_write(&args, &setup))
}

async fn measure_and_write(args: &ProfileTierArgs, setup: &Setup) -> Result<(), CliError> {
    if let (Some(redis), None, Some(id)) = (&setup.redis, &args.merge, &args.id) {
        let store = connect_store(redis).await?;
        with_profile(active_set(&store).await?, id)?;
    }
    let items: Vec<&EvalItem> = setup.eval.iter().flatten().collect();
    let budget = run::allocate(
        &args.concurrency,
        args.requests_per_level,
        items.len(),
        setup.baseline.is_some(),
        args.max_requests,
    );
    let latency_requests: usize = budget.levels.iter().map(|(_, n)| n).sum();
    let prompts = run::latency_prompts(latency_requests.max(1), fastrand::u32(..));
    let planned: Vec<&EvalItem> = eval::spread(&items, budget.eval_items)
        .into_iter()
        .copied()
        .collect();
    let settings = RunSettings {
        tier: &setup.tier,
        baseline: setup.baseline.as_ref(),
        budget,
        prompts: &prompts,
        items: &planned,
        eval_concurrency: args.eval_concurrency.max(1),
        max_tokens: args.max_tokens.max(1),
        request_timeout: Duration::from_secs(args.request_timeout.max(1)),
        deadline: Instant::now() + Duration::from_secs(args.timeout.max(1)),
    };
    let outcome = run::run(&TierClient::new(CONNECT_TIMEOUT), &settings).await;
    let (accuracy, agreement) = match &setup.eval {
        Some(_) => {
            let (accuracy, agreement) =
                report::score(&planned, &outcome.outcomes, setup.baseline.is_some());
            (Some(accuracy), agreement)
        }
        None => (None, None),
    };
    let measured = measured(args, &outcome, accuracy.as_ref(), agreement.as_ref());
    print_report(
        args,
        setup,
        &outcome,
        &measured,
        accuracy.as_ref(),
        agreement.as_ref(),
    )?;
    if !succeeded(&outcome, accuracy.as_ref()) {
        return Err(CliError::Io(format!(
            "no request to {} succeeded{}",
            setup.tier.url,
            if outcome.timed_out {
                " before --timeout"
            } else {
                ""
            }
        )));
    }
    write_measurement(args, setup, &measured).await
}

/// The entry as JSON on stdout, the table on stderr.
fn print_report(
    args: &ProfileTierArgs,
    setup: &Setup,
    outcome: &RunOutcome,
    measured: &Measured,
    accuracy: Option<&PassReport>,
    agreement: Option<&PassReport>,
) -> Result<(), CliError> {
    let report = Report {
        id: args.id.as_deref(),
        model: &args.model,
        measured,
        measurements: Measurements {
            url: &setup.tier.url,
            baseline: setup.baseline.as_ref().map(|b| b.url.as_str()),
            quality_source: args.quality,
            min_items: args.min_items,
            requests: outcome.requests,
            timed_out: outcome.timed_out,
            levels: &outcome.levels,
            eval_items_in_set: setup.eval.as_ref().map(Vec::len),
            accuracy,
            agreement,
        },
    };
    let json = serde_json::to_string_pretty(&report)
        .map_err(|e| CliError::Io(format!("encoding the report: {e}")))?;
    println!("{json}");
    eprint!("{}", report::table(&report));
    Ok(())
}

/// The profile fields the run supports.
fn measured(
    args: &ProfileTierArgs,
    outcome: &RunOutcome,
    accuracy: Option<&PassReport>,
    agreement: Option<&PassReport>,
) -> Measured {
    // The least loaded level: the router adds queueing from live load itself.
    let latency = outcome
        .levels
        .iter()
        .filter(|level| level.ttft_ms.is_some())
        .min_by_key(|level| level.concurrency)
        .and_then(|level| {
            Some(MeasuredLatency {
                ttft_ms: level.ttft_ms?.p50,
                itl_ms: level.itl_ms.map(|s| s.p50),
            })
        });
    let source = match args.quality {
        QualitySource::Accuracy => accuracy,
        QualitySource::Agreement => agreement,
    };
    Measured {
        latency,
        quality: source
            .map(|pass| QualityFigures::from_tallies(&pass.tallies, args.min_items))
            .unwrap_or_default(),
    }
}

fn succeeded(outcome: &RunOutcome, accuracy: Option<&PassReport>) -> bool {
    outcome.levels.iter().any(|level| level.succeeded > 0)
        || accuracy.is_some_and(|a| a.answered > 0)
}

/// `--merge` and `--push`.
async fn write_measurement(
    args: &ProfileTierArgs,
    setup: &Setup,
    measured: &Measured,
) -> Result<(), CliError> {
    let Some(id) = &args.id else {
        return Ok(());
    };
    let mut merged = None;
    if let Some(path) = &args.merge {
        let mut set = read_profile_file(path)?;
        apply(&mut set, id, measured)?;
        set.version += 1;
        write_set(path, &set)?;
        eprintln!("wrote {} (version {})", path.display(), set.version);
        merged = Some(set);
    }
    let Some(redis) = &setup.redis else {
        return Ok(());
    };
    let store = connect_store(redis).await?;
    let version = match merged {
        // The file as `profiles push` would push it.
        Some(set) => store.push(set).await.map_err(store_error)?,
        // Read, update, and write back only if nobody pushed in between.
        None => {
            let mut set = active_set(&store).await?;
            let expected = set.version;
            apply(&mut set, id, measured)?;
            set.version = expected + 1;
            store
                .push_expecting(&set, expected as i64)
                .await
                .map_err(store_error)?
        }
    };
    eprintln!("pushed version {version}");
    Ok(())
}

/// Writes the measurement into profile `id` and stamps the document.
fn apply(set: &mut ProfileSet, id: &str, measured: &Measured) -> Result<(), CliError> {
    merge::apply(set, id, measured).map_err(|e| CliError::Invalid(e.to_string()))?;
    set.updated_at = Some(now_rfc3339());
    Ok(())
}

fn with_profile(set: ProfileSet, id: &str) -> Result<ProfileSet, CliError> {
    if set.profile(id).is_none() {
        return Err(CliError::Invalid(
            merge::MergeError::UnknownProfile(id.to_owned()).to_string(),
        ));
    }
    Ok(set)
}

async fn active_set(store: &RedisStore<ProfileSet>) -> Result<ProfileSet, CliError> {
    store.active().await.map_err(store_error)?.ok_or_else(|| {
        CliError::Invalid(format!(
            "no profile set at {} to update; push one first, or use --merge FILE",
            store.keys().active
        ))
    })
}

/// Replaces the file in one rename, so a router watching it never reads half a document.
fn write_set(path: &Path, set: &ProfileSet) -> Result<(), CliError> {
    let mut text = serde_json::to_string_pretty(set)
        .map_err(|e| CliError::Invalid(format!("encoding the profile set: {e}")))?;
    text.push('\n');
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".profile-tier.tmp");
    let temporary = PathBuf::from(temporary);
    let io = |e: std::io::Error| CliError::Io(format!("writing {}: {e}", path.display()));
    std::fs::write(&temporary, text).map_err(io)?;
    std::fs::rename(&temporary, path).map_err(|e| {
        let _ = std::fs::remove_file(&temporary);
        io(e)
    })
}

/// The current time as RFC 3339 (UTC, seconds), for `updated_at`. chrono comes with
/// k8s-openapi; only its calendar arithmetic is used, not its clock.
fn now_rfc3339() -> String {
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    k8s_openapi::chrono::DateTime::from_timestamp(i64::try_from(seconds).unwrap_or(0), 0)
        .map(|t| t.to_rfc3339_opts(k8s_openapi::chrono::SecondsFormat::Secs, true))
        .unwrap_or_default()
}

// === impl Setup ===

impl Setup {
    fn new(args: &ProfileTierArgs) -> Result<Self, CliError> {
        let invalid = |message: String| CliError::Invalid(message);
        if args.concurrency.is_empty() || args.concurrency.iter().any(|&c| c == 0 || c > 1024) {
            return Err(invalid(
                "--concurrency: give levels between 1 and 1024, e.g. 1,4,16".to_owned(),
            ));
        }
        let eval = args.eval.as_deref().map(load_eval).transpose()?;
        if args.baseline.is_some() && eval.is_none() {
            return Err(invalid(
                "--baseline compares eval answers: give --eval too".to_owned(),
            ));
        }
        if args.quality == QualitySource::Agreement && args.baseline.is_none() {
            return Err(invalid("--quality agreement needs --baseline".to_owned()));
        }
        let tier = Endpoint::new(
            &args.url,
            &args.model,
            api_key(args.api_key_env.as_deref())?.as_deref(),
        )
        .map_err(|e| invalid(format!("--url {e}")))?;
        let baseline = match &args.baseline {
            Some(url) => Some(
                Endpoint::new(
                    url,
                    args.baseline_model.as_deref().unwrap_or(&args.model),
                    api_key(args.baseline_api_key_env.as_deref())?.as_deref(),
                )
                .map_err(|e| invalid(format!("--baseline {e}")))?,
            ),
            None => None,
        };
        let redis = match (args.push, &args.redis_url) {
            (true, Some(url)) => Some(RedisArgs {
                redis_url: url.clone(),
                redis_prefix: args.redis_prefix.clone(),
                redis_ca_file: args.redis_ca_file.clone(),
                redis_sentinel_password: args.redis_sentinel_password.clone(),
            }),
            _ => None,
        };
        Ok(Self {
            tier,
            baseline,
            eval,
            redis,
        })
    }
}

fn load_eval(path: &Path) -> Result<Vec<EvalItem>, CliError> {
    let (name, text) = if path == Path::new("builtin") {
        ("builtin".to_owned(), eval::BUILTIN.to_owned())
    } else {
        let text = std::fs::read_to_string(path)
            .map_err(|e| CliError::Invalid(format!("reading {}: {e}", path.display())))?;
        (path.display().to_string(), text)
    };
    eval::parse(&text).map_err(|e| CliError::Invalid(format!("--eval {name}: {e}")))
}

/// The key in environment variable `var`; never from the command line, which `ps` shows.
fn api_key(var: Option<&str>) -> Result<Option<String>, CliError> {
    let Some(var) = var else {
        return Ok(None);
    };
    match std::env::var(var) {
        Ok(key) if !key.trim().is_empty() => Ok(Some(key)),
        _ => Err(CliError::Invalid(format!(
            "environment variable {var} (named by an --*api-key-env flag) is unset or empty"
        ))),
    }
}

/// The profile-set file (or seed-format list) a measured profile is merged into.
fn read_profile_file(path: &std::path::Path) -> Result<ProfileSet, CliError> {
    crate::profiles::read_set_or_seed_list(path, &Default::default()).map_err(CliError::Invalid)
}
