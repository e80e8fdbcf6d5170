//! Any OpenAI-compatible server behind the router: the queue metrics of vLLM, SGLang,
//! llama.cpp and TGI, upstreams that want an API key, and active health checks.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::convert::Infallible;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use quantrouter_policy::{ProfileSet, DEFAULT_PROFILE_SET};
use support::{chat, client, eventually, loopback, send, RouterProcess, Tiers, SIMPLE};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vllm_sim::{MetricsFlavor, SimConfig, SimServer};

const FP16: usize = 0;
const INT4: usize = 2;

/// A small HTTP server answering every request with `answer(method, path)`; returns its
/// base URL.
async fn scripted<F>(answer: F) -> String
where
    F: Fn(&http::Method, &str) -> (StatusCode, String) + Send + Sync + 'static,
{
    let listener = tokio::net::TcpListener::bind(loopback()).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let answer = Arc::new(answer);
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let answer = Arc::clone(&answer);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let answer = Arc::clone(&answer);
                    async move {
                        let (parts, body) = req.into_parts();
                        let _ = body.collect().await;
                        let (status, text) = answer(&parts.method, parts.uri.path());
                        let mut response = Response::new(Full::new(Bytes::from(text)));
                        *response.status_mut() = status;
                        Ok::<_, Infallible>(response)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    url
}

/// Opens a completion request straight to a simulator (not through the router) and leaves
/// it running or queued there.
async fn occupy(sim: &SimServer, key: Option<&str>) -> tokio::net::TcpStream {
    let body = r#"{"prompt": "hold"}"#;
    let auth = key.map_or(String::new(), |k| format!("authorization: Bearer {k}\r\n"));
    let mut stream = tokio::net::TcpStream::connect(sim.local_addr())
        .await
        .unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: sim\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream
}

async fn json_at(url: &str) -> serde_json::Value {
    send(&client(), "GET", url, "", &[]).await.json()
}

async fn metrics_page(t: &Tiers) -> String {
    let url = format!("http://{}/metrics", t.router.admin_addr());
    String::from_utf8_lossy(&send(&client(), "GET", &url, "", &[]).await.body).into_owned()
}

/// The int4 tier's queue depth as `GET /keda/tiers/int4` reports it.
async fn int4_queue_depth(t: &Tiers) -> u64 {
    let url = format!("http://{}/keda/tiers/int4", t.router.admin_addr());
    json_at(&url).await["queue_depth"].as_u64().unwrap()
}

/// The int4 candidate's predicted latency in a dry run of a short chat.
async fn int4_predicted_latency(t: &Tiers) -> f64 {
    let url = format!("http://{}/v1/route", t.router.public_addr());
    let r = send(
        &client(),
        "POST",
        &url,
        &chat("auto", SIMPLE),
        &[("content-type", "application/json")],
    )
    .await;
    let explain = r.json();
    let candidates = explain["candidates"].as_array().unwrap();
    let int4 = candidates
        .iter()
        .find(|c| c["profile"] == "llama8b-awq")
        .unwrap();
    int4["predicted_latency_ms"].as_f64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_servers_queue_metric_reaches_routing_and_the_keda_numbers() {
    for flavor in [
        MetricsFlavor::Vllm,
        MetricsFlavor::Sglang,
        MetricsFlavor::Llamacpp,
        MetricsFlavor::Tgi,
    ] {
        // int4 runs one request at a time and takes long to start it, so two requests sent
        // to it directly leave one waiting in its own queue.
        let t = Tiers::start(
            [1, 1, 1],
            |i| SimConfig {
                metrics_flavor: flavor,
                ttft: Duration::from_secs(if i == INT4 { 60 } else { 0 }),
                max_num_seqs: if i == INT4 { 1 } else { 256 },
                ..SimConfig::default()
            },
            |_| {},
            |c| c.resilience.scrape_interval = Duration::from_millis(20),
        )
        .await;
        let idle_latency = int4_predicted_latency(&t).await;
        let sim = &t.sims[INT4][0];
        let _running = occupy(sim, None).await;
        let _queued = occupy(sim, None).await;
        assert!(
            eventually(Duration::from_secs(5), || async { sim.waiting() == 1 }).await,
            "{flavor:?}: the simulator queued a request"
        );
        let seen = eventually(Duration::from_secs(5), || async {
            int4_queue_depth(&t).await >= 1
        })
        .await;
        assert!(
            seen,
            "{flavor:?}: the KEDA numbers never showed the upstream queue"
        );
        let busy_latency = int4_predicted_latency(&t).await;
        assert!(
            busy_latency > idle_latency,
            "{flavor:?}: routing did not see the queue ({busy_latency} vs {idle_latency} ms)"
        );
        let found = format!(
            "quantrouter_upstream_queue_metric_found{{profile=\"llama8b-awq\",upstream=\"{}\"}} 1",
            sim.url()
        );
        let page = metrics_page(&t).await;
        assert!(page.contains(&found), "{flavor:?}: no `{found}` in\n{page}");

        // A stream through the router from this server: with llama.cpp its head arrives
        // before prefill, and the tokens still follow.
        let body = serde_json::json!({"model": "llama8b-fp16", "stream": true, "max_tokens": 4,
            "messages": [{"role": "user", "content": SIMPLE}]});
        let r = t.post(&body.to_string(), &[]).await;
        assert_eq!(r.status, StatusCode::OK, "{flavor:?}");
        let text = String::from_utf8_lossy(&r.body).into_owned();
        assert!(
            text.contains("\"content\"") && text.ends_with("data: [DONE]\n\n"),
            "{flavor:?}: {text}"
        );
        assert_eq!(t.requests(FP16), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_queue_names_override_detection_and_a_server_without_any_is_reported() {
    let custom = scripted(|_, path| match path {
        "/metrics" => (
            StatusCode::OK,
            "# TYPE my_queue gauge\nmy_queue{pool=\"a\"} 5\nmy_queue{pool=\"b\"} 2\nvllm:num_requests_waiting 100\n".into(),
        ),
        _ => (StatusCode::OK, "{}".into()),
    })
    .await;
    let bare = scripted(|_, path| match path {
        "/metrics" => (StatusCode::NOT_FOUND, String::new()),
        _ => (StatusCode::OK, "{}".into()),
    })
    .await;
    let t = Tiers::start(
        [1, 1, 1],
        |_| SimConfig::default(),
        |set| {
            set.profiles[INT4].upstream = serde_json::from_value(serde_json::json!({
                "urls": [custom.clone()], "metrics": {"waiting": "my_queue"}
            }))
            .unwrap();
            set.profiles[FP16].upstream =
                serde_json::from_value(serde_json::json!({"urls": [bare.clone()]})).unwrap();
        },
        |c| c.resilience.scrape_interval = Duration::from_millis(20),
    )
    .await;
    assert!(
        eventually(Duration::from_secs(5), || async {
            int4_queue_depth(&t).await == 7
        })
        .await,
        "the configured metric, not vLLM's, is the queue"
    );
    let missing = format!(
        "quantrouter_upstream_queue_metric_found{{profile=\"llama8b-fp16\",upstream=\"{bare}\"}} 0"
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            metrics_page(&t).await.contains(&missing)
        })
        .await,
        "no `{missing}`"
    );
}

/// The default set with every profile on `url`, which needs a key from `access`
/// (`{"api_key_env": ...}` or `{"api_key_file": ...}`).
fn keyed_set(url: &str, access: serde_json::Value) -> ProfileSet {
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    for profile in &mut set.profiles {
        let mut upstream = serde_json::json!({"urls": [url]});
        upstream
            .as_object_mut()
            .unwrap()
            .extend(access.as_object().unwrap().clone());
        profile.upstream = serde_json::from_value(upstream).unwrap();
        profile.model = vllm_sim::SimConfig::default().model;
    }
    set
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_key_from_a_file_is_sent_on_requests_and_scrapes_and_never_shown() {
    const KEY: &str = "sk-upstream-file-7f3a9c";
    let sim = SimServer::bind(
        loopback(),
        SimConfig {
            api_key: Some(KEY.into()),
            ttft: Duration::from_secs(60),
            max_num_seqs: 1,
            ..SimConfig::default()
        },
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    let set = keyed_set(
        &sim.url(),
        serde_json::json!({"api_key_file": key_file.to_str().unwrap()}),
    );
    let router = support::start_router(set, |c| {
        c.resilience.scrape_interval = Duration::from_millis(20);
    })
    .await;
    let admin = router.admin_addr();
    // Scrapes: /metrics needs the key, so the queue only shows when the scraper sends it.
    let _running = occupy(&sim, Some(KEY)).await;
    let _queued = occupy(&sim, Some(KEY)).await;
    let url = format!("http://{admin}/keda/tiers/int4");
    assert!(
        eventually(Duration::from_secs(5), || async {
            json_at(&url).await["queue_depth"].as_u64() == Some(1)
        })
        .await,
        "the scraper did not authenticate"
    );
    let profiles = send(
        &client(),
        "GET",
        &format!("http://{admin}/admin/profiles"),
        "",
        &[],
    )
    .await;
    let shown = String::from_utf8_lossy(&profiles.body);
    assert!(shown.contains("api_key_file"), "{shown}");
    assert!(!shown.contains(KEY), "the key is shown in /admin/profiles");
    router.shutdown().await;
    drop(sim);

    // Requests: a simulator without the slow start answers once the key is sent.
    let sim = SimServer::bind(
        loopback(),
        SimConfig {
            api_key: Some(KEY.into()),
            ..SimConfig::default()
        },
    )
    .await
    .unwrap();
    let set = keyed_set(
        &sim.url(),
        serde_json::json!({"api_key_file": key_file.to_str().unwrap()}),
    );
    let router = support::start_router(set, |_| {}).await;
    let url = format!("http://{}/v1/chat/completions", router.public_addr());
    let r = send(
        &client(),
        "POST",
        &url,
        &chat("auto", SIMPLE),
        &[("content-type", "application/json")],
    )
    .await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_key_from_the_environment_reaches_the_upstream_and_no_log_line() {
    const KEY: &str = "sk-upstream-env-51be0d";
    let sim = SimServer::bind(
        loopback(),
        SimConfig {
            api_key: Some(KEY.into()),
            ..SimConfig::default()
        },
    )
    .await
    .unwrap();
    let set = keyed_set(
        &sim.url(),
        serde_json::json!({"api_key_env": "QR_TEST_UPSTREAM_KEY"}),
    );
    let mut router = RouterProcess::spawn_with_env(
        &set,
        &["--log-format", "json", "--log-prompts"],
        &[("QR_TEST_UPSTREAM_KEY", KEY), ("RUST_LOG", "debug")],
        Stdio::piped(),
    )
    .await;
    let r = send(
        &client(),
        "POST",
        &router.url("/v1/chat/completions"),
        &chat("auto", SIMPLE),
        &[("content-type", "application/json")],
    )
    .await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert_eq!(sim.stats().requests, 1);
    let admin = format!("http://{}/admin/profiles", router.admin);
    let shown = send(&client(), "GET", &admin, "", &[]).await;
    let shown = String::from_utf8_lossy(&shown.body).into_owned();
    assert!(
        shown.contains("QR_TEST_UPSTREAM_KEY") && !shown.contains(KEY),
        "{shown}"
    );
    router.terminate();
    let mut stderr = router.child.stderr.take().unwrap();
    let mut logs = String::new();
    stderr.read_to_string(&mut logs).await.unwrap();
    router.child.wait().await.unwrap();
    assert!(logs.lines().count() > 3, "debug logs were written: {logs}");
    assert!(!logs.contains(KEY), "the key is in the logs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_turns_503_when_every_upstream_is_down_without_any_traffic() {
    let mut t = Tiers::start(
        [1, 1, 1],
        |_| SimConfig::default(),
        |_| {},
        |c| {
            c.resilience.health_interval = Duration::from_millis(30);
            c.resilience.breaker.open_base = Duration::from_millis(200);
            c.resilience.breaker.open_cap = Duration::from_millis(400);
        },
    )
    .await;
    let ready = format!("http://{}/readyz", t.router.admin_addr());
    let status = || async { send(&client(), "GET", &ready, "", &[]).await.status };
    assert_eq!(status().await, StatusCode::OK);
    let addrs: Vec<_> = t.sims.iter().map(|tier| tier[0].local_addr()).collect();
    for tier in std::mem::take(&mut t.sims) {
        for sim in tier {
            sim.shutdown().await;
        }
    }
    assert!(
        eventually(Duration::from_secs(10), || async {
            status().await == StatusCode::SERVICE_UNAVAILABLE
        })
        .await,
        "/readyz stayed 200 with every upstream down"
    );
    // Back up on the same ports: the checks close the circuits again, still without traffic.
    let mut revived = Vec::new();
    for (addr, profile) in addrs.iter().zip(&t.set.profiles) {
        let config = SimConfig {
            model: profile.model.clone(),
            ..SimConfig::default()
        };
        revived.push(SimServer::bind(*addr, config).await.unwrap());
    }
    assert!(
        eventually(Duration::from_secs(10), || async {
            status().await == StatusCode::OK
        })
        .await,
        "/readyz did not recover"
    );
    assert!(
        revived.iter().all(|s| s.stats().requests == 0),
        "no request was sent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_health_is_checked_on_its_model_list() {
    let models = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&models);
    let no_health = scripted(move |_, path| match path {
        "/v1/models" => {
            seen.fetch_add(1, Ordering::Relaxed);
            (StatusCode::OK, r#"{"object":"list","data":[]}"#.into())
        }
        _ => (StatusCode::NOT_FOUND, String::new()),
    })
    .await;
    let broken = scripted(|_, _| (StatusCode::INTERNAL_SERVER_ERROR, String::new())).await;
    let t = Tiers::start(
        [1, 1, 1],
        |_| SimConfig::default(),
        |set| {
            set.profiles[FP16].upstream =
                serde_json::from_value(serde_json::json!({"urls": [no_health.clone()]})).unwrap();
            for i in 1..3 {
                set.profiles[i].upstream =
                    serde_json::from_value(serde_json::json!({"urls": [broken.clone()]})).unwrap();
            }
        },
        |c| c.resilience.health_interval = Duration::from_millis(20),
    )
    .await;
    use quantrouter::resilience::CircuitState;
    assert!(
        eventually(Duration::from_secs(10), || async {
            t.circuit(INT4, 0) == CircuitState::Open && models.load(Ordering::Relaxed) >= 5
        })
        .await,
        "the broken server's circuit opened and the model list was asked"
    );
    assert_eq!(t.circuit(FP16, 0), CircuitState::Closed);
    let ready = format!("http://{}/readyz", t.router.admin_addr());
    assert_eq!(
        send(&client(), "GET", &ready, "", &[]).await.status,
        StatusCode::OK
    );
}
