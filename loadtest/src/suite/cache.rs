//! `cache`: multi-turn conversations over one tier of four simulators with vLLM's prefix
//! cache on, sent by client-side round robin, by quantrouter balancing on load alone, by
//! quantrouter's prefix-aware choice, and by vllm-router's `cache_aware` policy.
//!
//! Each client holds a conversation of [`TURNS`] turns and then starts another: a long
//! system prompt (half the conversations share one hot prompt, the rest one of
//! [`OTHER_SYSTEMS`]), then user turns from the prompt mix and short assistant answers, so
//! every turn repeats the whole history before it. Prefill costs time per uncached token on
//! one compute stream per simulator, so where a turn lands decides its time to first token.
//! Every target gets fresh simulators: no run inherits another's cache.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use hdrhistogram::Histogram;
use http::Uri;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::time::Instant;

use super::http::{get, metric_sum};
use super::services::{ProfileSpec, Sim};
use super::{write_json, write_section, Suite};
use crate::client::{self, Exchange, HttpClient, Transport};

/// Replicas in the tier.
const REPLICAS: usize = 4;
/// Conversations in progress at once (closed loop: one request per client at a time).
const CLIENTS: usize = 32;
/// Turns per conversation.
const TURNS: usize = 6;
/// System prompts besides the hot one.
const OTHER_SYSTEMS: usize = 6;
/// Bytes of a conversation's own material in its first turn (about 500 tokens).
const DOCUMENT_BYTES: usize = 2000;
/// Output tokens per turn: short answers keep the run about prefill, where caching acts.
const MAX_TOKENS: u32 = 16;
/// The simulators: base TTFT and ITL in ms, prefill per uncached token in µs, sequences
/// at once, prefix-cache capacity in blocks of 16 tokens (32K tokens: more than one
/// replica's share of the conversations in progress, far less than all of them).
const SIM_LATENCY_MS: (u64, u64) = (5, 4);
const PREFILL_US_PER_TOKEN: u64 = 60;
const MAX_NUM_SEQS: usize = 64;
const CACHE_BLOCKS: usize = 2048;

/// One target's figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CacheRow {
    /// Name in the table.
    pub name: String,
    /// Turns answered in the measured window.
    pub ok: u64,
    /// Turns that failed in the measured window.
    pub errors: u64,
    /// Answered turns per second.
    pub throughput_rps: f64,
    /// Time to first token, median and 99th percentile, in ms.
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    /// Prompt tokens found in the simulators' caches over those looked up, in the window.
    pub hit_rate: f64,
    /// Turns each replica served in the window.
    pub replica_requests: Vec<u64>,
    /// The busiest replica's turns over the mean.
    pub max_mean_load: f64,
    /// TTFT p99 in ms of first turns (the conversation's material is new everywhere) and
    /// of later turns (only the new question is new where the conversation ran).
    #[serde(default)]
    pub ttft_p99_first_turn_ms: f64,
    #[serde(default)]
    pub ttft_p99_later_turn_ms: f64,
}

/// What the scenario measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CacheFacts {
    pub rows: Vec<CacheRow>,
    /// vllm-router took part.
    pub vllm_router: bool,
}

/// How a target's turns reach the replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    /// The client itself, in turn.
    RoundRobin,
    /// quantrouter with `upstream.balance: least_load`.
    LeastLoad,
    /// quantrouter with its default, `prefix`.
    Prefix,
    /// vllm-router's `cache_aware` policy.
    VllmRouterCacheAware,
}

/// Counters of the replicas at one moment.
#[derive(Debug, Clone, Default)]
struct Reading {
    hits: f64,
    queries: f64,
    requests: Vec<u64>,
}

/// What the clients recorded in the measured window.
#[derive(Debug)]
struct Recorded {
    ttft_us: Histogram<u64>,
    /// The same, of first turns and of later turns.
    first_turn_us: Histogram<u64>,
    later_turn_us: Histogram<u64>,
    /// Every measured turn: when it started (µs into the window), its client, its turn
    /// number, whether its conversation has the hot system prompt, its TTFT in µs.
    turns: Vec<(u64, usize, usize, bool, u64)>,
    ok: u64,
    errors: u64,
}

/// Runs the scenario and returns its section.
pub async fn run(suite: &Suite) -> anyhow::Result<String> {
    let dir = suite.scenario_dir("cache")?;
    let mut rows = Vec::new();
    let mut vllm_router = false;
    for (name, via) in [
        ("round-robin", Via::RoundRobin),
        ("quantrouter-least-load", Via::LeastLoad),
        ("quantrouter-prefix", Via::Prefix),
        ("vllm-router-cache-aware", Via::VllmRouterCacheAware),
    ] {
        suite.settle().await;
        println!("\n--- {name}");
        let Some(row) = run_target(suite, &dir, name, via).await? else {
            continue;
        };
        vllm_router |= via == Via::VllmRouterCacheAware;
        println!(
            "{name}: {} ok, {} errors, {:.1} req/s, TTFT p50 {:.1} ms p99 {:.1} ms (first \
             turns {:.1}, later turns {:.1}), hit rate {:.2}, max/mean load {:.2} {:?}",
            row.ok,
            row.errors,
            row.throughput_rps,
            row.ttft_p50_ms,
            row.ttft_p99_ms,
            row.ttft_p99_first_turn_ms,
            row.ttft_p99_later_turn_ms,
            row.hit_rate,
            row.max_mean_load,
            row.replica_requests
        );
        rows.push(row);
    }
    let facts = CacheFacts { rows, vllm_router };
    write_json(&dir.join("facts.json"), &facts)?;
    write_section(&dir, section(suite, &facts))
}

/// Fresh replicas and the target in front of them, one measured run, its figures; `None`
/// when the target is not installed.
async fn run_target(
    suite: &Suite,
    dir: &std::path::Path,
    name: &str,
    via: Via,
) -> anyhow::Result<Option<CacheRow>> {
    let mut sims = Vec::with_capacity(REPLICAS);
    for i in 0..REPLICAS {
        let extra = [
            "--prefix-cache-blocks".to_owned(),
            CACHE_BLOCKS.to_string(),
            "--prefill-us-per-token".to_owned(),
            PREFILL_US_PER_TOKEN.to_string(),
        ];
        let sim = suite
            .start_sim_with(
                &format!("{name}-{i}"),
                "sim-model",
                SIM_LATENCY_MS,
                MAX_NUM_SEQS,
                None,
                &extra,
            )
            .await?;
        sims.push(sim);
    }
    let urls: Vec<String> = sims.iter().map(|s| s.url.clone()).collect();
    let server = match via {
        Via::RoundRobin => None,
        Via::LeastLoad | Via::Prefix => {
            let balance = match via {
                Via::LeastLoad => "least_load",
                _ => "prefix",
            };
            let spec = ProfileSpec {
                id: "sim",
                model: "sim-model",
                tier: "fp16",
                urls: urls.clone(),
                cost: (0.1, 0.2),
                latency_ms: SIM_LATENCY_MS,
                max_concurrency: MAX_NUM_SEQS * REPLICAS,
                quality: json!({"default": 0.99}),
            };
            let mut set = super::services::profile_set(1, "sim", json!({}), &[spec]);
            set["profiles"][0]["upstream"]["balance"] = balance.into();
            let path = suite.work().join(format!("{name}.json"));
            std::fs::write(&path, serde_json::to_string_pretty(&set)?)
                .with_context(|| format!("cannot write {}", path.display()))?;
            Some(suite.start_router(name, &path, &[], &[]).await?)
        }
        Via::VllmRouterCacheAware => {
            let server = suite.start_vllm_router_policy(&urls, "cache_aware").await;
            if server.is_none() {
                for sim in sims {
                    sim.proc.kill().await;
                }
                return Ok(None);
            }
            server
        }
    };
    let targets: Vec<Uri> = match &server {
        Some(server) => vec![format!("{}/v1/chat/completions", server.url).parse()?],
        None => urls
            .iter()
            .map(|url| format!("{url}/v1/chat/completions").parse())
            .collect::<Result<_, _>>()?,
    };
    let model = match via {
        Via::LeastLoad | Via::Prefix => "auto",
        Via::RoundRobin | Via::VllmRouterCacheAware => "sim-model",
    };
    let (warmup, duration) = (suite.warmup(), suite.duration());
    let at_warmup_end = async {
        tokio::time::sleep(warmup).await;
        read(&sims).await
    };
    let (recorded, before) = tokio::join!(
        drive(suite.prompts(), &targets, model, warmup, duration),
        at_warmup_end
    );
    let after = read(&sims).await?;
    let (recorded, before) = (recorded?, before?);
    if let Some(server) = server {
        server.proc.kill().await;
    }
    for sim in sims {
        sim.proc.kill().await;
    }
    let served: Vec<u64> = after
        .requests
        .iter()
        .zip(&before.requests)
        .map(|(a, b)| a.saturating_sub(*b))
        .collect();
    let mean = served.iter().sum::<u64>() as f64 / served.len().max(1) as f64;
    let max = served.iter().copied().max().unwrap_or(0) as f64;
    let queries = after.queries - before.queries;
    write_turns(&dir.join(format!("turns-{name}.csv")), &recorded)?;
    let ms = |q: f64| recorded.ttft_us.value_at_quantile(q) as f64 / 1000.0;
    let p99_ms = |h: &Histogram<u64>| h.value_at_quantile(0.99) as f64 / 1000.0;
    Ok(Some(CacheRow {
        name: name.to_owned(),
        ok: recorded.ok,
        errors: recorded.errors,
        throughput_rps: recorded.ok as f64 / duration.as_secs_f64(),
        ttft_p50_ms: ms(0.5),
        ttft_p99_ms: ms(0.99),
        hit_rate: match queries > 0.0 {
            true => (after.hits - before.hits) / queries,
            false => 0.0,
        },
        replica_requests: served,
        max_mean_load: if mean > 0.0 { max / mean } else { 0.0 },
        ttft_p99_first_turn_ms: p99_ms(&recorded.first_turn_us),
        ttft_p99_later_turn_ms: p99_ms(&recorded.later_turn_us),
    }))
}

/// The replicas' prefix-cache counters and request counts now.
async fn read(sims: &[Sim]) -> anyhow::Result<Reading> {
    let mut reading = Reading::default();
    for sim in sims {
        let (_, page) = get(&format!("{}/metrics", sim.url)).await?;
        reading.hits += metric_sum(&page, "vllm:prefix_cache_hits_total");
        reading.queries += metric_sum(&page, "vllm:prefix_cache_queries_total");
        let (_, stats) = get(&format!("{}/sim/stats", sim.url)).await?;
        let stats: serde_json::Value = serde_json::from_str(&stats)?;
        reading
            .requests
            .push(stats["requests"].as_u64().unwrap_or(0));
    }
    Ok(reading)
}

/// [`CLIENTS`] conversations at a time until the window ends; turns that start in the
/// measured window (after `warmup`) are recorded.
async fn drive(
    prompts: &[String],
    targets: &[Uri],
    model: &str,
    warmup: Duration,
    duration: Duration,
) -> anyhow::Result<Recorded> {
    let client = client::build_clients(Transport::Http1, Duration::from_secs(5))
        .into_iter()
        .next()
        .context("no HTTP client")?;
    let start = Instant::now();
    let window = (start + warmup, start + warmup + duration);
    let histogram = || Histogram::new_with_bounds(1, 3_600_000_000, 3);
    let recorded = Arc::new(Mutex::new(Recorded {
        ttft_us: histogram()?,
        first_turn_us: histogram()?,
        later_turn_us: histogram()?,
        turns: Vec::new(),
        ok: 0,
        errors: 0,
    }));
    let shared = Arc::new(Shared {
        prompts: prompts.to_vec(),
        targets: targets.to_vec(),
        model: model.to_owned(),
        systems: systems(),
        next_target: AtomicUsize::new(0),
        recorded: Arc::clone(&recorded),
    });
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|id| {
            let (client, shared) = (client.clone(), Arc::clone(&shared));
            tokio::spawn(async move { converse(id, &client, &shared, window).await })
        })
        .collect();
    for task in tasks {
        task.await?;
    }
    drop(shared);
    let recorded = Arc::try_unwrap(recorded)
        .map_err(|_| anyhow::anyhow!("a client outlived the run"))?
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner);
    Ok(recorded)
}

/// What every client reads.
struct Shared {
    prompts: Vec<String>,
    targets: Vec<Uri>,
    model: String,
    /// The hot system prompt first, then the others.
    systems: Vec<String>,
    /// Client-side round robin over the targets (one target: always it).
    next_target: AtomicUsize,
    recorded: Arc<Mutex<Recorded>>,
}

/// One client: conversation after conversation until the window ends.
async fn converse(id: usize, client: &HttpClient, shared: &Shared, window: (Instant, Instant)) {
    let (measure_from, end) = window;
    let mut rng = SplitMix(0x5eed ^ id as u64);
    while Instant::now() < end {
        // Half the conversations share the hot system prompt.
        let hot = rng.next().is_multiple_of(2);
        let system = match hot {
            true => &shared.systems[0],
            false => &shared.systems[1 + (rng.next() as usize % OTHER_SYSTEMS)],
        };
        let mut messages = vec![json!({"role": "system", "content": system})];
        let mut pick = || &shared.prompts[rng.next() as usize % shared.prompts.len().max(1)];
        // The conversation's own material (a document, a codebase's files), sent first.
        let mut document = String::from("Here is the material for this conversation:\n");
        while document.len() < DOCUMENT_BYTES {
            document.push_str(pick());
            document.push('\n');
        }
        for turn in 0..TURNS {
            let question = match turn {
                0 => format!("{document}\n{}", pick()),
                _ => pick().clone(),
            };
            messages.push(json!({"role": "user", "content": question}));
            let body = json!({
                "model": shared.model,
                "messages": messages,
                "max_tokens": MAX_TOKENS,
                "stream": true,
            });
            let i = shared.next_target.fetch_add(1, Ordering::Relaxed) % shared.targets.len();
            let origin = Instant::now();
            if origin >= end {
                return;
            }
            let outcome = client::send(
                client,
                Exchange {
                    uri: &shared.targets[i],
                    body: Bytes::from(body.to_string()),
                    stream: true,
                    origin,
                    timeout: Duration::from_secs(60),
                    check_answers: false,
                    authorization: None,
                },
            )
            .await;
            if origin >= measure_from {
                let mut recorded = shared
                    .recorded
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                match (outcome.result, outcome.ttft) {
                    (Ok(()), Some(ttft)) => {
                        let us = u64::try_from(ttft.as_micros()).unwrap_or(u64::MAX).max(1);
                        let _ = recorded.ttft_us.record(us);
                        let _ = match turn {
                            0 => recorded.first_turn_us.record(us),
                            _ => recorded.later_turn_us.record(us),
                        };
                        let at = origin.duration_since(measure_from).as_micros();
                        let at = u64::try_from(at).unwrap_or(u64::MAX);
                        recorded.turns.push((at, id, turn, hot, us));
                        recorded.ok += 1;
                    }
                    _ => recorded.errors += 1,
                }
            }
            // What the client appends before its next turn: a short answer.
            messages.push(json!({
                "role": "assistant",
                "content": format!("Noted, point {turn}: here is a short answer to that."),
            }));
        }
    }
}

/// The measured turns, one line each, for a breakdown of the slow ones.
fn write_turns(path: &std::path::Path, recorded: &Recorded) -> anyhow::Result<()> {
    let mut out = String::from("start_us,client,turn,hot,ttft_us\n");
    for (at, client, turn, hot, us) in &recorded.turns {
        let _ = writeln!(out, "{at},{client},{turn},{},{us}", u8::from(*hot));
    }
    std::fs::write(path, out).with_context(|| format!("cannot write {}", path.display()))
}

/// The hot system prompt and [`OTHER_SYSTEMS`] others, each about 3 KB (750 tokens), each
/// different from its first block on.
fn systems() -> Vec<String> {
    let rules = "Answer in the customer's language, cite the policy section you rely on, \
                 never promise a refund the policy does not cover, escalate legal threats, \
                 and keep answers under one hundred words. ";
    (0..=OTHER_SYSTEMS)
        .map(|i| {
            format!(
                "You are assistant {i} of the help desk of retailer number {i}. {}",
                rules.repeat(14)
            )
        })
        .collect()
}

/// splitmix64: each client's own choices, the same in every target's run.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// The section: how the run was made, then one row per target.
fn section(suite: &Suite, facts: &CacheFacts) -> String {
    let mut out = suite.command("cache");
    out.push_str(&suite.machine());
    let (ttft, itl) = SIM_LATENCY_MS;
    let _ = write!(
        out,
        "{REPLICAS} vllm-sim replicas with the prefix cache on ({CACHE_BLOCKS} blocks of 16 \
         tokens each), prefill {PREFILL_US_PER_TOKEN} µs per uncached token on one compute \
         stream per replica, TTFT {ttft} ms + prefill, ITL {itl} ms, max-num-seqs \
         {MAX_NUM_SEQS}. {CLIENTS} clients each hold a conversation of {TURNS} turns \
         (max_tokens {MAX_TOKENS}, streamed) and then start another: a system prompt of about \
         750 tokens (half the conversations share one hot prompt, the rest one of \
         {OTHER_SYSTEMS}), a first turn carrying about 500 tokens of the conversation's own \
         material, user turns from the prompt mix, every turn repeating the history. \
         Each target gets fresh replicas. Round robin is the client's own; the least-load \
         row is quantrouter with `upstream.balance: least_load`.{}\n\n",
        if facts.vllm_router {
            ""
        } else {
            " vllm-router was not installed: no `cache_aware` row."
        }
    );
    out.push_str(
        "| target | turns | turns/s | TTFT p50 ms | TTFT p99 ms | prefix hit rate | max/mean replica load | errors |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for row in &facts.rows {
        let _ = writeln!(
            out,
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {} |",
            row.name,
            row.ok,
            row.throughput_rps,
            row.ttft_p50_ms,
            row.ttft_p99_ms,
            row.hit_rate,
            row.max_mean_load,
            row.errors
        );
    }
    out
}
