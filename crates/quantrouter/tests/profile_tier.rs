//! `quantrouter profile-tier` against real endpoints over loopback: simulated vLLM tiers
//! (with injected wrong answers), a scripted server that sends its headers long before the
//! first token, and a real redis-server for `--push`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use quantrouter::documents::RedisStore;
use quantrouter_policy::ProfileSet;
use serde_json::Value;
use support::redis_server::RedisServer;
use support::{eventually, loopback};
use tokio::net::TcpListener;
use vllm_sim::{Faults, SimConfig, SimServer};

const MODEL: &str = "sim-model";
/// The int4 profile of profiles/default.json.
const PROFILE: &str = "llama8b-awq";

struct Run {
    code: i32,
    report: Value,
    stderr: String,
}

/// Runs the real binary with `args` (and `env`), waiting for it without blocking the
/// simulators this runtime serves.
async fn profile_tier(args: &[&str], env: &[(&str, &str)]) -> Run {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_quantrouter"))
        .arg("profile-tier")
        .args(args)
        .envs(env.iter().copied())
        .env_remove("QUANTROUTER_REDIS_URL")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let report = if out.stdout.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}); stderr:\n{stderr}"))
    };
    Run {
        code: out.status.code().unwrap_or(-1),
        report,
        stderr,
    }
}

async fn sim(config: SimConfig) -> SimServer {
    SimServer::bind(loopback(), config).await.unwrap()
}

fn seeded(seed: u64) -> SimConfig {
    SimConfig {
        model: MODEL.into(),
        seed,
        ..SimConfig::default()
    }
}

fn wrong(rates: &[(&str, f64)]) -> Faults {
    Faults {
        wrong_rate: rates.iter().map(|&(c, r)| (c.to_owned(), r)).collect(),
        ..Faults::default()
    }
}

fn repo_file(path: &str) -> String {
    format!("{}/../../{path}", env!("CARGO_MANIFEST_DIR"))
}

fn rate(pass: &Value, class: &str) -> f64 {
    pass["by_class"][class]["rate"]
        .as_f64()
        .unwrap_or_else(|| panic!("no {class} figure in {pass}"))
}

fn copy_default_profiles(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("profiles.json");
    std::fs::copy(repo_file("profiles/default.json"), &path).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measures_latency_and_throughput_of_a_streaming_tier_per_level() {
    let tier = sim(SimConfig {
        ttft: Duration::from_millis(100),
        itl: Duration::from_millis(5),
        ..seeded(0)
    })
    .await;
    let run = profile_tier(
        &[
            "--url",
            &tier.url(),
            "--model",
            MODEL,
            "--concurrency",
            "1,4",
        ],
        &[],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let levels = run.report["measurements"]["levels"].as_array().unwrap();
    let shape: Vec<(u64, u64, u64)> = levels
        .iter()
        .map(|l| {
            let n = |k: &str| l[k].as_u64().unwrap();
            (n("concurrency"), n("requests"), n("succeeded"))
        })
        .collect();
    assert_eq!(shape, [(1, 8, 8), (4, 16, 16)]);
    for level in levels {
        // The sim's first token comes at ttft + itl; loopback adds little. Generous above.
        let ttft = level["ttft_ms"]["p50"].as_f64().unwrap();
        assert!((100.0..2000.0).contains(&ttft), "{level}");
        let itl = level["itl_ms"]["p50"].as_f64().unwrap();
        assert!((2.5..100.0).contains(&itl), "{level}");
        assert!(level["output_tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(level["requests_per_s"].as_f64().unwrap() > 0.0);
    }
    // The entry's latency is the least loaded level's median; no eval, no quality.
    assert_eq!(
        run.report["latency"]["ttft_ms"],
        levels[0]["ttft_ms"]["p50"]
    );
    assert_eq!(run.report["latency"]["itl_ms"], levels[0]["itl_ms"]["p50"]);
    assert!(run.report.get("quality").is_none());
    assert_eq!(tier.stats().requests, 24);
    assert!(run.stderr.contains("concurrency"), "{}", run.stderr);
}

/// A server that sends the response head and a role-only event at once, then the first
/// token `first_token_after` later, and answers 401 without `Bearer <key>`.
async fn slow_prefill_server(first_token_after: Duration, key: &'static str) -> SocketAddr {
    let listener = TcpListener::bind(loopback()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let service = service_fn(move |request: Request<Incoming>| async move {
                let authorized = request
                    .headers()
                    .get("authorization")
                    .is_some_and(|v| v == format!("Bearer {key}").as_str());
                let _ = request.into_body().collect().await;
                Ok::<_, Infallible>(slow_prefill_response(authorized, first_token_after))
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

type Body = http_body_util::Either<
    Full<Bytes>,
    StreamBody<futures_util::stream::BoxStream<'static, Result<Frame<Bytes>, Infallible>>>,
>;

fn slow_prefill_response(authorized: bool, first_token_after: Duration) -> Response<Body> {
    use futures_util::StreamExt as _;
    if !authorized {
        let body = r#"{"error":{"message":"bad key","type":"AuthenticationError"}}"#;
        let mut response = Response::new(Body::Left(Full::new(Bytes::from(body))));
        *response.status_mut() = StatusCode::UNAUTHORIZED;
        return response;
    }
    let chunk =
        |delta: &str| format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{delta}}}]}}\n\n");
    let events = vec![
        (
            Duration::ZERO,
            chunk(r#"{"role":"assistant","content":""}"#),
        ),
        (first_token_after, chunk(r#"{"content":"Hello"}"#)),
        (Duration::from_millis(20), chunk(r#"{"content":" world"}"#)),
        (
            Duration::ZERO,
            "data: {\"choices\":[],\"usage\":{\"completion_tokens\":2}}\n\ndata: [DONE]\n\n"
                .to_owned(),
        ),
    ];
    let stream = futures_util::stream::iter(events)
        .then(|(pause, event)| async move {
            tokio::time::sleep(pause).await;
            Ok(Frame::data(Bytes::from(event)))
        })
        .boxed();
    let mut response = Response::new(Body::Right(StreamBody::new(stream)));
    response
        .headers_mut()
        .insert("content-type", "text/event-stream".parse().unwrap());
    response
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttft_counts_from_the_first_content_event_not_the_response_head() {
    let addr = slow_prefill_server(Duration::from_millis(300), "t0ken").await;
    let url = format!("http://{addr}/v1");
    let args = [
        "--url",
        &url,
        "--model",
        "m",
        "--concurrency",
        "2",
        "--requests-per-level",
        "4",
        "--api-key-env",
        "QR_TEST_TIER_KEY",
    ];
    let run = profile_tier(&args, &[("QR_TEST_TIER_KEY", "t0ken")]).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let level = &run.report["measurements"]["levels"][0];
    assert_eq!(level["succeeded"], 4, "{level}");
    let ttft = level["ttft_ms"]["p50"].as_f64().unwrap();
    assert!(
        ttft >= 300.0,
        "TTFT {ttft} ms counts the response head: {level}"
    );
    // Two tokens 20 ms apart, as the usage event says. The client may see the first a
    // little late on a busy machine; a wrong divisor would give 10 ms, timing from the
    // response head 320 ms.
    let itl = level["itl_ms"]["p50"].as_f64().unwrap();
    assert!((15.0..100.0).contains(&itl), "{level}");

    // Without the key every request is refused: exit 2, the refusals counted by status.
    let run = profile_tier(&args[..8], &[]).await;
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert_eq!(
        run.report["measurements"]["levels"][0]["errors"]["status_401"],
        4
    );
    assert!(run.stderr.contains("no request"), "{}", run.stderr);
    // A key variable that is not set fails before any request.
    let run = profile_tier(&args, &[]).await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(run.stderr.contains("QR_TEST_TIER_KEY"), "{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_wrong_answers_lower_accuracy_and_agreement_with_the_baseline() {
    let clean = sim(seeded(11)).await;
    let faulty = sim(seeded(11)).await;
    faulty.set_faults(wrong(&[("math", 0.2)]));
    let eval = repo_file("eval/tier-eval.jsonl");
    let common = ["--model", MODEL, "--eval", &eval, "--concurrency", "1"];

    let run = profile_tier(&[&["--url", &clean.url()][..], &common].concat(), &[]).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let accuracy = &run.report["measurements"]["accuracy"];
    assert_eq!(accuracy["overall"]["rate"], 1.0, "{accuracy}");
    assert_eq!(accuracy["answered"], 310);
    assert_eq!(run.report["quality"]["math"], 1.0);

    let (faulty_url, clean_url) = (faulty.url(), clean.url());
    let args = [
        &["--url", &faulty_url, "--baseline", &clean_url][..],
        &common,
    ]
    .concat();
    let run = profile_tier(&args, &[]).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let accuracy = &run.report["measurements"]["accuracy"];
    let math = rate(accuracy, "math");
    assert_eq!(accuracy["by_class"]["math"]["total"], 120);
    assert!((0.7..=0.9).contains(&math), "1 - wrong_rate ± 0.1: {math}");
    for class in ["general", "code", "structured", "reasoning"] {
        assert_eq!(rate(accuracy, class), 1.0, "{class}");
    }
    // The clean baseline answers right, so agreeing with it is being right.
    let agreement = &run.report["measurements"]["agreement"];
    assert_eq!(rate(agreement, "math"), math);
    assert_eq!(rate(agreement, "structured"), 1.0);
    assert_eq!(run.report["quality"]["math"], round3(math));
    assert_eq!(run.report["quality"]["default"], 1.0);
    assert!(run.stderr.contains("agreement with"), "{}", run.stderr);

    // Quality from agreement instead: against a baseline that is itself wrong elsewhere.
    clean.set_faults(wrong(&[("code", 1.0)]));
    let run = profile_tier(&[&args[..], &["--quality", "agreement"]].concat(), &[]).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(rate(&run.report["measurements"]["accuracy"], "code"), 1.0);
    assert_eq!(run.report["quality"]["code"], 0.0);
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_writes_the_measurement_into_a_valid_profile_set() {
    let tier = sim(seeded(5)).await;
    tier.set_faults(wrong(&[("structured", 0.5)]));
    let dir = tempfile::Builder::new()
        .prefix("qr-tier-")
        .tempdir()
        .unwrap();
    let file = copy_default_profiles(dir.path());
    let before = ProfileSet::from_json(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let args = [
        "--url",
        &tier.url(),
        "--model",
        MODEL,
        "--eval",
        "builtin",
        "--concurrency",
        "1",
        "--merge",
        file.to_str().unwrap(),
    ];

    // An unknown profile fails before a single request, and leaves the file alone.
    let run = profile_tier(&[&args[..], &["--id", "nope"]].concat(), &[]).await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(run.stderr.contains("no profile `nope`"), "{}", run.stderr);
    assert_eq!(tier.stats().requests, 0);

    let run = profile_tier(&[&args[..], &["--id", PROFILE]].concat(), &[]).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let after = ProfileSet::from_json(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(after.version, before.version + 1);
    assert!(after.updated_at.is_some());
    let (old, new) = (
        before.profile(PROFILE).unwrap(),
        after.profile(PROFILE).unwrap(),
    );
    let entry = &run.report;
    assert_eq!(entry["id"], PROFILE);
    let round2 = |v: &Value| (v.as_f64().unwrap() * 100.0).round() / 100.0;
    assert_eq!(
        new.latency.ttft_ms,
        round2(&entry["latency"]["ttft_ms"]).max(0.01)
    );
    assert_eq!(
        new.quality.structured,
        entry["quality"]["structured"].as_f64()
    );
    assert!(new.quality.structured.unwrap() < 0.75, "{:?}", new.quality);
    assert_eq!(new.quality.math, Some(1.0));
    assert_eq!(new.quality.default, 1.0);
    assert_eq!(new.upstream, old.upstream);
    assert_eq!(new.cost_per_1m_output_tokens, old.cost_per_1m_output_tokens);
    for id in ["llama8b-fp16", "llama8b-fp8"] {
        assert_eq!(after.profile(id), before.profile(id), "{id} changed");
    }
    assert!(run.stderr.contains("wrote"), "{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_updates_the_active_set_with_compare_and_set() {
    let redis = RedisServer::start(None);
    let store = RedisStore::<ProfileSet>::connect(&redis.handle(), "quantrouter")
        .await
        .unwrap();
    let tier = sim(SimConfig {
        ttft: Duration::from_millis(200),
        ..seeded(9)
    })
    .await;
    let (tier_url, redis_url) = (tier.url(), redis.url());
    let base = [
        "--url",
        &tier_url,
        "--model",
        MODEL,
        "--concurrency",
        "1",
        "--id",
        PROFILE,
        "--push",
        "--redis-url",
        &redis_url,
    ];
    let owned: Vec<String> = base.iter().map(|s| s.to_string()).collect();

    // Nothing in Redis to update: refused before measuring.
    let run = profile_tier(&base, &[]).await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert_eq!(tier.stats().requests, 0);

    let initial = ProfileSet::from_json(
        &std::fs::read_to_string(repo_file("profiles/default.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(store.push(initial.clone()).await.unwrap(), 1);
    // Another operator pushes while the tier is being measured: the measurement lands on
    // top of their version instead of overwriting it.
    let running = tokio::spawn(async move {
        let args: Vec<&str> = owned.iter().map(String::as_str).collect();
        profile_tier(&args, &[]).await
    });
    assert!(
        eventually(Duration::from_secs(10), || async {
            tier.stats().requests >= 1
        })
        .await,
        "the measurement never started"
    );
    let mut theirs = initial.clone();
    theirs.profiles[0].cost_per_1m_input_tokens = 0.42;
    assert_eq!(store.push(theirs).await.unwrap(), 2);
    let run = running.await.unwrap();
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stderr.contains("pushed version 3"), "{}", run.stderr);
    let active = store.active().await.unwrap().unwrap();
    assert_eq!(active.version, 3);
    assert_eq!(active.profiles[0].cost_per_1m_input_tokens, 0.42);
    let measured = active.profile(PROFILE).unwrap();
    assert!(measured.latency.ttft_ms >= 200.0, "{:?}", measured.latency);
    assert_eq!(store.history().await.unwrap()[0].version, 2);

    // With --merge the file is written and pushed as `profiles push` pushes a file.
    let dir = tempfile::Builder::new()
        .prefix("qr-tier-")
        .tempdir()
        .unwrap();
    let file = copy_default_profiles(dir.path());
    let args = [&base[..], &["--merge", file.to_str().unwrap()]].concat();
    let run = profile_tier(&args, &[]).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let written = ProfileSet::from_json(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let active = store.active().await.unwrap().unwrap();
    assert_eq!(active.version, 4);
    assert_eq!(active.profiles, written.profiles);
    assert_eq!(
        active.profiles[0].cost_per_1m_input_tokens,
        initial.profiles[0].cost_per_1m_input_tokens
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_stop_at_max_requests_and_at_the_timeout() {
    let tier = sim(seeded(0)).await;
    let run = profile_tier(
        &[
            "--url",
            &tier.url(),
            "--model",
            MODEL,
            "--eval",
            "builtin",
            "--concurrency",
            "1,4",
            "--max-requests",
            "30",
        ],
        &[],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let m = &run.report["measurements"];
    assert_eq!(tier.stats().requests, 30);
    assert_eq!(m["requests"], 30);
    assert_eq!(m["accuracy"]["items"], 6, "{m}");
    assert_eq!(m["eval_items_in_set"], 310);
    // Six items spread over the interleaved set still reach several classes.
    assert!(
        m["accuracy"]["by_class"].as_object().unwrap().len() >= 3,
        "{m}"
    );

    let hung = sim(seeded(0)).await;
    hung.set_faults(Faults {
        hang: true,
        ..Faults::default()
    });
    let run = profile_tier(
        &[
            "--url",
            &hung.url(),
            "--model",
            MODEL,
            "--concurrency",
            "2",
            "--timeout",
            "1",
        ],
        &[],
    )
    .await;
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("before --timeout"), "{}", run.stderr);
    assert_eq!(run.report["measurements"]["timed_out"], true);
    // The two requests in flight were cut off, not counted as the tier's errors.
    let level = &run.report["measurements"]["levels"][0];
    assert_eq!(
        level["errors"],
        Value::Object(Default::default()),
        "{level}"
    );
    assert_eq!(hung.stats().requests, 2);
}
