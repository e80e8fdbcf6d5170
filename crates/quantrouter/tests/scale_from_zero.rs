//! Scale from zero: a preferred tier with no endpoint (KEDA scaled it to zero) and a
//! cold-start allowance makes requests wait, counted in its queue depth, unless a warm tier
//! fits; the wait ends when an endpoint appears or the allowance runs out. A streamed
//! request gets its response head at once and SSE keep-alive comments while it waits.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use quantrouter::keda::local_tiers;
use support::{chat, client, eventually, simple_stream, Tiers, SIMPLE};
use tokio::io::AsyncWriteExt as _;
use tokio::time::Instant;
use vllm_sim::SimConfig;

const INT4: usize = 2;

async fn tiers(cold_start_ms: u64) -> Tiers {
    Tiers::start(
        [1, 1, 1],
        |_| SimConfig::default(),
        move |set| set.profiles[INT4].cold_start_timeout_ms = cold_start_ms,
        |_| {},
    )
    .await
}

/// Scales `profiles` to zero (what discovery does when a Deployment has no ready pod).
fn scale_to_zero(t: &Tiers, profiles: &[usize]) {
    let snapshot = t.router.app.store.load();
    for &p in profiles {
        snapshot.runtime[p].pool.set_urls(&[]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_a_cold_tier_and_counts_in_its_queue_depth() {
    let t = Arc::new(tiers(10_000).await);
    scale_to_zero(&t, &[0, 1, 2]);
    let request = {
        let t = Arc::clone(&t);
        tokio::spawn(async move { t.post(&chat("auto", SIMPLE), &[]).await })
    };
    let queued = eventually(Duration::from_secs(5), || async {
        let snapshot = t.router.app.store.load();
        local_tiers(&snapshot, Instant::now())["int4"].queue_depth == 1
    })
    .await;
    assert!(queued, "the waiting request is in int4's queue depth");
    let demand = &t.router.app.keda.demand;
    assert!(demand.recent("int4", Duration::from_secs(60), Instant::now()));
    assert!(!request.is_finished());
    // The tier comes up.
    let url = t.sims[INT4][0].url();
    t.router.app.store.load().runtime[INT4]
        .pool
        .set_urls(&[url]);
    let r = request.await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-quantrouter-tier"), "int4");
    let snapshot = t.router.app.store.load();
    assert_eq!(
        local_tiers(&snapshot, Instant::now())["int4"].queue_depth,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_give_up_waiting_for_a_cold_tier_leave_its_queue_depth() {
    let t = tiers(20_000).await;
    scale_to_zero(&t, &[0, 1, 2]);
    let depth = || {
        let snapshot = t.router.app.store.load();
        local_tiers(&snapshot, Instant::now())["int4"].queue_depth
    };
    // Clients that send a request, then close their connection before any answer.
    let body = chat("auto", SIMPLE);
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut clients = Vec::new();
    for _ in 0..10 {
        let mut stream = tokio::net::TcpStream::connect(t.router.public_addr())
            .await
            .unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        clients.push(stream);
    }
    let waiting = eventually(Duration::from_secs(5), || async { depth() == 10 }).await;
    assert!(
        waiting,
        "the waits count in int4's queue depth: {}",
        depth()
    );
    drop(clients);
    let gone = eventually(Duration::from_secs(5), || async { depth() == 0 }).await;
    assert!(gone, "abandoned waits left {} in the queue depth", depth());
    // The tier never came up: nothing was sent anywhere.
    assert_eq!(t.requests(INT4), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_tier_that_stays_down_answers_503_after_its_allowance() {
    let t = tiers(200).await;
    scale_to_zero(&t, &[0, 1, 2]);
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.json()["error"]["code"], "no_healthy_profile");
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("scaled to zero"));
    assert_eq!(r.header("retry-after"), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_tier_within_budget_serves_instead_and_says_why() {
    // The allowance counts as queue wait: 2 s still fits int4 in the 8 s budget.
    let t = tiers(2_000).await;
    scale_to_zero(&t, &[INT4]);
    let started = Instant::now();
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-quantrouter-tier"), "fp8");
    assert_eq!(r.header("x-quantrouter-reason"), "cold_start_avoided");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "no cold-start wait"
    );
    let demand = &t.router.app.keda.demand;
    assert!(
        demand.recent("int4", Duration::from_secs(60), Instant::now()),
        "the cold tier is still woken for KEDA"
    );
    assert!(!demand.recent("fp8", Duration::from_secs(60), Instant::now()));
    // An allowance beyond the budget, or none, makes the cold tier simply unavailable.
    let t = tiers(10_000).await;
    scale_to_zero(&t, &[INT4]);
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.header("x-quantrouter-reason"), "utility");
    let t = tiers(0).await;
    scale_to_zero(&t, &[INT4]);
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.header("x-quantrouter-reason"), "utility");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_tier_that_alone_holds_the_prompt_is_waited_for_beyond_the_latency_budget() {
    // An allowance above the 8 s budget, and the only context that holds the prompt.
    let t = Tiers::start(
        [1, 1, 1],
        |_| SimConfig::default(),
        |set| {
            for (i, profile) in set.profiles.iter_mut().enumerate() {
                profile.max_context_tokens = if i == INT4 { 32_768 } else { 4_096 };
            }
            set.profiles[INT4].cold_start_timeout_ms = 20_000;
        },
        |_| {},
    )
    .await;
    let t = Arc::new(t);
    scale_to_zero(&t, &[INT4]);
    // About 6,000 tokens at the profiles' 4 characters per token.
    let long = "word ".repeat(4_800);
    let request = {
        let t = Arc::clone(&t);
        tokio::spawn(async move { t.post(&chat("auto", &long), &[]).await })
    };
    let queued = eventually(Duration::from_secs(5), || async {
        let snapshot = t.router.app.store.load();
        local_tiers(&snapshot, Instant::now())["int4"].queue_depth == 1
    })
    .await;
    assert!(
        queued,
        "the request waits for int4, counted in its queue depth"
    );
    let demand = &t.router.app.keda.demand;
    assert!(demand.recent("int4", Duration::from_secs(60), Instant::now()));
    assert_eq!(
        t.requests(0) + t.requests(1),
        0,
        "no tier too small was asked"
    );
    let url = t.sims[INT4][0].url();
    t.router.app.store.load().runtime[INT4]
        .pool
        .set_urls(&[url]);
    let r = request.await.unwrap();
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert_eq!(r.header("x-quantrouter-tier"), "int4");
    assert_eq!(r.header("x-quantrouter-reason"), "constraints_unmet");
}

/// Tiers whose int4 may wait `cold_start_ms` for an endpoint, with a 1 s idle timeout, so
/// keep-alive comments come every 500 ms (half of it) instead of every 5 s, and a 1 s
/// shutdown grace.
async fn keepalive_tiers(cold_start_ms: u64) -> Tiers {
    Tiers::start(
        [1, 1, 1],
        |_| SimConfig::default(),
        move |set| set.profiles[INT4].cold_start_timeout_ms = cold_start_ms,
        |c| {
            c.resilience.idle_timeout = Duration::from_secs(1);
            c.shutdown_grace = Duration::from_secs(1);
        },
    )
    .await
}

/// Sends a streamed request; the response head, its body unread.
async fn open_stream(t: &Tiers) -> http::Response<Incoming> {
    let request = http::Request::post(format!(
        "http://{}/v1/chat/completions",
        t.router.public_addr()
    ))
    .header("content-type", "application/json")
    .body(Full::new(Bytes::from(simple_stream(16))))
    .unwrap();
    tokio::time::timeout(Duration::from_secs(5), client().request(request))
        .await
        .expect("the head comes before the tier")
        .unwrap()
}

/// Reads `body` until `done` holds for what arrived so far, or it ends; what arrived.
async fn read_until(body: &mut Incoming, text: &mut String, done: impl Fn(&str) -> bool) {
    while !done(text) {
        let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .expect("a frame within 10 s");
        match frame {
            Some(frame) => {
                if let Ok(data) = frame.unwrap().into_data() {
                    text.push_str(std::str::from_utf8(&data).unwrap());
                }
            }
            None => return,
        }
    }
}

const COMMENT: &str = ": waiting for a tier to start\n\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_waiting_for_a_cold_tier_gets_keepalives_then_its_answer() {
    let t = keepalive_tiers(20_000).await;
    scale_to_zero(&t, &[0, 1, 2]);
    let response = open_stream(&t).await;
    assert_eq!(response.status(), StatusCode::OK);
    let header = |name: &str| response.headers()[name].to_str().unwrap().to_owned();
    assert!(header("content-type").starts_with("text/event-stream"));
    assert_eq!(header("x-quantrouter-tier"), "int4");
    let mut body = response.into_body();
    let mut text = String::new();
    read_until(&mut body, &mut text, |t| t.matches(COMMENT).count() >= 2).await;
    assert_eq!(
        text,
        COMMENT.repeat(2),
        "only comments while the tier is down"
    );
    assert_eq!(t.requests(INT4), 0);
    // The tier comes up.
    let url = t.sims[INT4][0].url();
    t.router.app.store.load().runtime[INT4]
        .pool
        .set_urls(&[url]);
    read_until(&mut body, &mut text, |_| false).await;
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty() && !e.starts_with(':'))
        .collect();
    assert!(events.len() > 2, "{text}");
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{text}");
    assert!(!text.contains("\"error\""), "{text}");
    let first: serde_json::Value =
        serde_json::from_str(events[0].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(t.requests(INT4), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_cold_tier_stays_down_ends_with_an_error_event() {
    let t = keepalive_tiers(1_500).await;
    scale_to_zero(&t, &[0, 1, 2]);
    let started = Instant::now();
    let response = open_stream(&t).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut text = String::new();
    read_until(&mut body, &mut text, |_| false).await;
    assert!(text.starts_with(COMMENT), "{text}");
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    let event: serde_json::Value =
        serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(event["error"]["code"], "no_healthy_profile", "{text}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(1_400) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_waiting_for_a_cold_tier_ends_when_the_shutdown_grace_does() {
    let t = keepalive_tiers(20_000).await;
    scale_to_zero(&t, &[0, 1, 2]);
    let response = open_stream(&t).await;
    let mut body = response.into_body();
    let mut text = String::new();
    read_until(&mut body, &mut text, |t| t.contains(COMMENT)).await;
    let Tiers { router, sims, .. } = t;
    let started = Instant::now();
    let shutdown = tokio::spawn(router.shutdown());
    read_until(&mut body, &mut text, |_| false).await;
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    let event: serde_json::Value =
        serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(event["error"]["code"], "shutting_down", "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "ended by the watchdog at the 1 s grace, not by the 20 s cold start"
    );
    shutdown.await.unwrap();
    drop(sims);
}
