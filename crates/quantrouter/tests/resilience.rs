//! Resilience over real HTTP with vllm-sim fault injection: breakers, retries and their
//! budget, Retry-After, timeouts, fallbacks across tiers and for quality, admission, SSE
//! error events, busy-tier routing and graceful shutdown of the real binary.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use http_body_util::BodyExt;
use quantrouter::resilience::{BreakerConfig, CircuitState, ResilienceConfig};
use quantrouter::server::ServerConfig;
use quantrouter_policy::StreamCheck;
use support::{
    chat, client, eventually, last_sse_event, send, sim_tiers, simple_stream, RouterProcess, Tiers,
    CODE, SIMPLE,
};
use tokio::time::Instant;
use vllm_sim::{Faults, SimConfig};

/// Balances the int4 tier by load alone, whose tie between idle endpoints goes to the first.
fn least_load(set: &mut quantrouter_policy::ProfileSet) {
    if let quantrouter_policy::Upstream::Static(upstream) = &mut set.profiles[INT4].upstream {
        upstream.balance = Some(quantrouter_policy::Balance::LeastLoad);
    }
}

/// Profile indices of the embedded set.
const FP16: usize = 0;
const FP8: usize = 1;
const INT4: usize = 2;

fn fails(status: u16) -> Faults {
    Faults {
        error_rate: 1.0,
        error_status: status,
        ..Faults::default()
    }
}

fn resilience(edit: impl FnOnce(&mut ResilienceConfig)) -> impl FnOnce(&mut ServerConfig) {
    move |config| edit(&mut config.resilience)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_endpoint_is_hidden_its_circuit_opens_and_probes_close_it_again() {
    let t = Tiers::start(
        [1, 1, 2],
        |_| SimConfig::default(),
        |_| {},
        resilience(|r| {
            r.breaker = BreakerConfig {
                open_base: Duration::from_millis(300),
                open_cap: Duration::from_millis(300),
                ..BreakerConfig::default()
            }
        }),
    )
    .await;
    let bad = &t.sims[INT4][0];
    bad.set_faults(fails(503));
    for _ in 0..200 {
        let r = t.post(&chat("auto", SIMPLE), &[]).await;
        assert_eq!(
            r.status,
            StatusCode::OK,
            "{}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(
            r.header("x-quantrouter-tier"),
            "int4",
            "retried on the good endpoint"
        );
    }
    let to_bad = bad.stats().requests;
    assert!(
        to_bad < 40,
        "the open circuit keeps traffic off the bad endpoint (it got {to_bad} of 200)"
    );
    assert_eq!(t.sims[INT4][1].stats().requests, 200);

    bad.clear_faults();
    let closed = eventually(Duration::from_secs(10), || async {
        let r = t.post(&chat("auto", SIMPLE), &[]).await;
        assert_eq!(r.status, StatusCode::OK);
        t.circuit(INT4, 0) == CircuitState::Closed
    })
    .await;
    assert!(closed, "half-open probes succeed and close the circuit");
    let before = bad.stats().requests;
    for _ in 0..20 {
        t.post(&chat("auto", SIMPLE), &[]).await;
    }
    assert!(
        bad.stats().requests > before,
        "the endpoint gets traffic again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_tier_falls_back_and_all_tiers_failing_is_a_quick_503() {
    let t = Tiers::start([1, 1, 1], |_| SimConfig::default(), |_| {}, |_| {}).await;
    t.sims[INT4][0].set_faults(fails(503));
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-quantrouter-reason"), "fallback_error");
    assert_eq!(r.header("x-quantrouter-attempts"), "2");
    let fallback = r.header("x-quantrouter-fallback");
    assert!(
        fallback.starts_with("from=llama8b-awq; to=") && fallback.ends_with("reason=error"),
        "{fallback}"
    );
    assert_ne!(r.header("x-quantrouter-tier"), "int4");
    // Once int4's only circuit is open the tier is ineligible: requests go straight to
    // another tier, without a failed attempt first.
    for _ in 0..5 {
        t.post(&chat("auto", SIMPLE), &[]).await;
    }
    assert_eq!(t.circuit(INT4, 0), CircuitState::Open);
    let before = t.requests(INT4);
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-quantrouter-attempts"), "1");
    assert_eq!(r.header("x-quantrouter-reason"), "utility");
    assert_eq!(t.requests(INT4), before, "no attempt on the open tier");

    for tier in &t.sims {
        tier[0].set_faults(fails(503));
    }
    let started = Instant::now();
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.json()["error"]["code"], "no_healthy_profile");
    assert!(r.headers.contains_key("retry-after"));
    // Far below any timeout: failing fast means no waiting on dead upstreams.
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_budget_caps_upstream_attempts_on_a_failing_tier() {
    let t = Tiers::start(
        [1, 1, 3],
        |_| SimConfig::default(),
        |_| {},
        resilience(|r| {
            // Never open, so only the budget limits retries.
            r.breaker.consecutive_failures = u32::MAX;
            r.breaker.min_volume = u32::MAX;
            r.backoff.base = Duration::from_millis(1);
        }),
    )
    .await;
    for sim in &t.sims[INT4] {
        sim.set_faults(fails(503));
    }
    let requests = 200u64;
    for _ in 0..requests {
        let r = t
            .post(
                &chat("auto", SIMPLE),
                &[("x-quantrouter-profile", "llama8b-awq")],
            )
            .await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    }
    let attempts = t.requests(INT4);
    let floor = ResilienceConfig::default().budget.floor as u64;
    // Without the budget each request would try all three endpoints: 600 attempts.
    assert!(
        attempts <= requests * 12 / 10 + floor,
        "{attempts} upstream attempts for {requests} requests"
    );
    assert!(
        attempts > requests,
        "the floor and the ratio still allow some retries"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_on_429_is_honoured_before_the_next_endpoint() {
    let t = Tiers::start([1, 1, 2], |_| SimConfig::default(), least_load, |_| {}).await;
    t.sims[INT4][0].set_faults(Faults {
        retry_after_s: Some(1),
        ..fails(429)
    });
    // p2c starts on the first endpoint when both are idle.
    let started = Instant::now();
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-quantrouter-attempts"), "2");
    assert_eq!(r.header("x-quantrouter-tier"), "int4");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "waited Retry-After"
    );
    assert_eq!(t.sims[INT4][1].stats().requests, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_endpoint_times_out_and_the_request_is_retried_elsewhere() {
    let t = Tiers::start(
        [1, 1, 2],
        |_| SimConfig::default(),
        least_load,
        |c| {
            c.client.header_timeout = Duration::from_millis(300);
        },
    )
    .await;
    t.sims[INT4][0].set_faults(Faults {
        hang: true,
        ..Faults::default()
    });
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-quantrouter-attempts"), "2");
    assert_eq!(t.sims[INT4][1].stats().requests, 1);
    // The abandoned attempt was cancelled upstream.
    assert!(
        eventually(Duration::from_secs(5), || async {
            t.sims[INT4][0].stats().cancelled == 1
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overall_deadline_answers_504() {
    let t = Tiers::start([1, 1, 1], |_| SimConfig::default(), |_| {}, |_| {}).await;
    for tier in &t.sims {
        tier[0].set_faults(Faults {
            hang: true,
            ..Faults::default()
        });
    }
    let r = t
        .post(
            &chat("auto", SIMPLE),
            &[("x-quantrouter-timeout-ms", "300")],
        )
        .await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(r.json()["error"]["code"], "deadline_exceeded");
    let r = t
        .post(
            &chat("auto", SIMPLE),
            &[("x-quantrouter-timeout-ms", "soon")],
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
}

/// With resumption off; a reset stream is resumed otherwise (`tests/resume.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_mid_stream_ends_with_an_sse_error_event_and_is_not_retried() {
    let t = Tiers::start(
        [1, 1, 2],
        |_| SimConfig {
            itl: Duration::from_millis(5),
            ..SimConfig::default()
        },
        |set| set.policy.stream_resume.max_resumes = 0,
        |_| {},
    )
    .await;
    for sim in &t.sims[INT4] {
        sim.set_faults(Faults {
            reset_after_chunks: Some(2),
            ..Faults::default()
        });
    }
    let body = simple_stream(20);
    let r = t.post(&body, &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    let text = String::from_utf8_lossy(&r.body);
    let event = last_sse_event(&text);
    assert_eq!(event["error"]["code"], "upstream_error", "{text}");
    assert!(
        text.matches("data: {").count() >= 3,
        "the first chunks arrived: {text}"
    );
    let total: u64 = (0..3).map(|p| t.requests(p)).sum();
    assert_eq!(total, 1, "bytes were sent, so no retry");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_goes_silent_ends_with_a_timeout_event() {
    let t = Tiers::start(
        [1, 1, 1],
        |_| SimConfig {
            itl: Duration::from_secs(5),
            ..SimConfig::default()
        },
        |_| {},
        // The sim sends its head and role chunk at once, then nothing: until the first token
        // the header timeout bounds that silence, after it the idle timeout. Both are short.
        |c| {
            c.resilience.idle_timeout = Duration::from_millis(300);
            c.client.header_timeout = Duration::from_millis(300);
        },
    )
    .await;
    let body = simple_stream(5);
    let started = Instant::now();
    let r = t.post(&body, &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    let text = String::from_utf8_lossy(&r.body);
    let event = last_sse_event(&text);
    assert_eq!(event["error"]["code"], "timeout", "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "cut at the idle timeout"
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            t.sims[INT4][0].stats().cancelled == 1
        })
        .await,
        "the silent upstream request is cancelled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_degenerate_cheap_answer_is_rerun_on_a_better_tier_but_streams_never_are() {
    let t = Tiers::start([1, 1, 1], |_| SimConfig::default(), |_| {}, |_| {}).await;
    t.sims[INT4][0].set_faults(Faults {
        degenerate: true,
        ..Faults::default()
    });
    let body = serde_json::json!({"model": "auto", "max_tokens": 32,
        "messages": [{"role": "user", "content": SIMPLE}]})
    .to_string();
    let r = t.post(&body, &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-quantrouter-reason"), "fallback_quality");
    assert_eq!(
        r.header("x-quantrouter-tier"),
        "fp8",
        "the next higher quality"
    );
    assert_eq!(
        r.header("x-quantrouter-fallback"),
        "from=llama8b-awq; to=llama8b-fp8; reason=quality"
    );
    let content = r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        quantrouter_policy::repetition_ratio(&content) < 0.5,
        "{content}"
    );

    let stream = serde_json::json!({"model": "auto", "max_tokens": 32, "stream": true,
        "messages": [{"role": "user", "content": SIMPLE}]})
    .to_string();
    let before = t.requests(FP8);
    let r = t.post(&stream, &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-quantrouter-tier"), "int4");
    assert_eq!(r.header("x-quantrouter-fallback"), "");
    assert_eq!(t.requests(FP8), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quality_fallback_whose_better_tiers_fail_answers_their_error_not_the_rejected_tier() {
    let t = Tiers::start(
        [1, 1, 1],
        |_| SimConfig::default(),
        |set| {
            set.policy.stream_check = Some(StreamCheck {
                tokens: 8,
                max_hold_ms: 5_000,
            })
        },
        |_| {},
    )
    .await;
    t.sims[INT4][0].set_faults(Faults {
        degenerate: true,
        ..Faults::default()
    });
    for tier in [FP16, FP8] {
        t.sims[tier][0].set_faults(fails(503));
    }
    for stream in [false, true] {
        let body = serde_json::json!({"model": "auto", "max_tokens": 32, "stream": stream,
            "messages": [{"role": "user", "content": SIMPLE}]})
        .to_string();
        let before = t.requests(INT4);
        let r = t.post(&body, &[]).await;
        let text = String::from_utf8_lossy(&r.body);
        assert_eq!(
            t.requests(INT4),
            before + 1,
            "the rejected tier is asked once (stream: {stream})"
        );
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
        assert_eq!(r.json()["error"]["code"], "no_healthy_profile");
        assert!(
            text.contains("llama8b-fp16"),
            "the better tiers' error: {text}"
        );
        assert_eq!(r.header("x-quantrouter-fallback"), "");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_beyond_the_queue_gets_429_and_admitted_requests_complete() {
    let t = Tiers::start(
        [1, 1, 1],
        |_| SimConfig {
            itl: Duration::from_millis(40),
            ..SimConfig::default()
        },
        |set| set.profiles[INT4].max_concurrency = 2,
        resilience(|r| r.admission.queue_timeout = Duration::from_millis(200)),
    )
    .await;
    // 5× the tier's concurrency, all at once; each takes ~0.3 s upstream.
    let body = serde_json::json!({"model": "llama8b-awq", "max_tokens": 8,
        "messages": [{"role": "user", "content": SIMPLE}]})
    .to_string();
    let t = Arc::new(t);
    let tasks: Vec<_> = (0..10)
        .map(|_| {
            let t = Arc::clone(&t);
            let body = body.clone();
            tokio::spawn(async move { t.post(&body, &[]).await })
        })
        .collect();
    // The wait queue never holds more than one request per slot: memory stays bounded.
    let mut deepest = 0;
    while tasks.iter().any(|task| !task.is_finished()) {
        let pool = &t.router.app.store.load().runtime[INT4].pool;
        deepest = deepest.max(pool.admission.waiting());
        tokio::task::yield_now().await;
    }
    assert!(deepest <= 2, "queue depth {deepest} over its cap of 2");
    let mut ok = 0;
    let mut limited = 0;
    for task in tasks {
        let r = task.await.unwrap();
        match r.status {
            StatusCode::OK => {
                assert_eq!(r.json()["choices"][0]["finish_reason"], "length");
                ok += 1;
            }
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(r.header("retry-after"), "1");
                assert_eq!(r.json()["error"]["code"], "tier_overloaded");
                limited += 1;
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert!(ok >= 2, "the admitted requests complete ({ok})");
    assert!(limited >= 4, "the excess is refused ({limited})");
    assert_eq!(ok + limited, 10);
    assert!(
        t.requests(INT4) <= 4,
        "refused requests never reached the tier"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_tier_raises_predicted_latency_and_traffic_shifts() {
    let t = Tiers::start(
        [1, 1, 1],
        |i| SimConfig {
            max_num_seqs: if i == INT4 { 1 } else { 256 },
            itl: Duration::from_millis(if i == INT4 { 50 } else { 0 }),
            ..SimConfig::default()
        },
        |set| set.profiles[INT4].max_concurrency = 1,
        resilience(|r| r.scrape_interval = Duration::from_millis(50)),
    )
    .await;
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.header("x-quantrouter-tier"), "int4", "idle: the cheapest");
    // Queue work on the int4 sim directly, behind the router's back. Each request holds
    // the sim's one slot for 20 s, so the queue cannot drain to the three that still fit
    // the budget however slowly the machine gets to the assertion.
    let sim_url = t.sims[INT4][0].url();
    let model = t.set.profiles[INT4].model.clone();
    let direct: Vec<_> = (0..8)
        .map(|_| {
            let url = format!("{sim_url}/v1/chat/completions");
            let body = serde_json::json!({"model": model, "max_tokens": 400,
                "messages": [{"role": "user", "content": SIMPLE}]})
            .to_string();
            tokio::spawn(async move {
                send(
                    &client(),
                    "POST",
                    &url,
                    &body,
                    &[("content-type", "application/json")],
                )
                .await
            })
        })
        .collect();
    assert!(
        eventually(Duration::from_secs(5), || async {
            t.sims[INT4][0].waiting() >= 6
        })
        .await
    );
    // Once the scraper has seen vLLM's queue, the next request goes elsewhere.
    let scraped = eventually(Duration::from_secs(5), || async {
        t.router.app.store.load().runtime[INT4]
            .pool
            .upstream_waiting()
            >= 6
    })
    .await;
    assert!(scraped, "the scraper reads vllm:num_requests_waiting");
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(
        r.header("x-quantrouter-tier"),
        "fp8",
        "the queue made int4 too slow for the budget"
    );
    let r = t.post(&chat("auto", CODE), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    for task in direct {
        task.abort();
    }
}

/// The real binary: SIGTERM with 50 streams open; readiness fails at once, every stream
/// completes, and the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_fifty_open_streams_finish_then_exits_zero() {
    let (set, _sims) = sim_tiers(Duration::from_millis(40)).await;
    let router = RouterProcess::spawn(
        &set,
        &["--shutdown-delay-ms", "300", "--log-format", "text"],
        std::process::Stdio::inherit(),
    )
    .await;
    let http = client();

    let body = simple_stream(25);
    let mut streams = Vec::new();
    for _ in 0..50 {
        let req = http::Request::post(router.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(body.clone())))
            .unwrap();
        let response = http.request(req).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        streams.push(tokio::spawn(async move {
            response.into_body().collect().await.unwrap().to_bytes()
        }));
    }
    router.terminate();
    // The signal reaches the router's task asynchronously: readiness fails soon after, not
    // necessarily before the next request.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    let mut status = router.get_status("/readyz").await;
    while status != Some(StatusCode::SERVICE_UNAVAILABLE) && tokio::time::Instant::now() < deadline
    {
        tokio::task::yield_now().await;
        status = router.get_status("/readyz").await;
    }
    assert_eq!(
        status,
        Some(StatusCode::SERVICE_UNAVAILABLE),
        "readiness fails once SIGTERM arrives"
    );
    for stream in streams {
        let bytes = stream.await.unwrap();
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            text.trim_end().ends_with("data: [DONE]"),
            "a stream was cut: {text}"
        );
    }
    let mut child = router.child;
    let exit = tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .expect("exits after the streams finish")
        .unwrap();
    assert_eq!(exit.code(), Some(0));
}
