//! Wearing another server's clothes: SGLang, llama.cpp and TGI metric names, llama.cpp's
//! early response head, and an API key like `--api-key`.

mod common;

use std::time::Duration;

use common::*;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use tokio::time::Instant;
use vllm_sim::{MetricsFlavor, SimConfig};

/// The value of an unlabelled or `model_name`-labelled sample.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let rest = match rest.strip_prefix('{') {
            Some(labels) => labels.split_once("} ")?.1,
            None => rest.strip_prefix(' ')?,
        };
        rest.parse().ok()
    })
}

#[tokio::test]
async fn each_flavor_reports_its_queue_under_its_servers_names() {
    for (flavor, waiting, running) in [
        (
            MetricsFlavor::Vllm,
            "vllm:num_requests_waiting",
            "vllm:num_requests_running",
        ),
        (
            MetricsFlavor::Sglang,
            "sglang:num_queue_reqs",
            "sglang:num_running_reqs",
        ),
        (
            MetricsFlavor::Llamacpp,
            "llamacpp:requests_deferred",
            "llamacpp:requests_processing",
        ),
        (
            MetricsFlavor::Tgi,
            "tgi_queue_size",
            "tgi_batch_current_size",
        ),
    ] {
        let sim = start(SimConfig {
            ttft: Duration::from_secs(30),
            max_num_seqs: 1,
            metrics_flavor: flavor,
            ..SimConfig::default()
        })
        .await;
        let _running = raw_post(sim.local_addr(), "/v1/completions", &json!({"prompt": "a"})).await;
        let _queued = raw_post(sim.local_addr(), "/v1/completions", &json!({"prompt": "b"})).await;
        eventually("one running, one waiting", || async {
            sim.running() == 1 && sim.waiting() == 1
        })
        .await;
        let text = scrape(&sim).await;
        assert_eq!(sample(&text, waiting), Some(1.0), "{flavor:?}:\n{text}");
        assert_eq!(sample(&text, running), Some(1.0), "{flavor:?}:\n{text}");
        if flavor != MetricsFlavor::Vllm {
            assert!(!text.contains("vllm:"), "{flavor:?}:\n{text}");
        }
    }
}

#[tokio::test]
async fn llamacpp_sends_a_streams_head_before_prefill_and_vllm_with_the_first_event() {
    // llama.cpp: the head arrives while the request still waits for its first token.
    let sim = start(SimConfig {
        ttft: Duration::from_secs(30),
        metrics_flavor: MetricsFlavor::Llamacpp,
        ..SimConfig::default()
    })
    .await;
    let body =
        json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let mut stream = raw_post(sim.local_addr(), "/v1/chat/completions", &body).await;
    let head = read_until_contains(&mut stream, "\r\n\r\n").await;
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(!head.contains("data:"), "{head}");
    assert_eq!(sim.generated_tokens(), 0);

    // vLLM: the head leaves with the first event, after the time to first token.
    let ttft = Duration::from_millis(300);
    let sim = start(SimConfig {
        ttft,
        ..SimConfig::default()
    })
    .await;
    let sent = Instant::now();
    let mut stream = raw_post(sim.local_addr(), "/v1/chat/completions", &body).await;
    let head = read_until_contains(&mut stream, "\r\n\r\n").await;
    assert!(sent.elapsed() >= ttft, "head after {:?}", sent.elapsed());
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    let rest = read_until_contains(&mut stream, "[DONE]").await;
    assert!(format!("{head}{rest}").contains("\"role\":\"assistant\""));
}

#[tokio::test]
async fn an_api_key_is_required_everywhere_but_health_and_sim_controls() {
    let sim = start(SimConfig {
        api_key: Some("sk-sim".into()),
        ..SimConfig::default()
    })
    .await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<bytes::Bytes>>();
    let send = |method: Method, path: &str, key: Option<&str>| {
        let mut request = Request::builder()
            .method(method.clone())
            .uri(format!("{}{path}", sim.url()));
        if let Some(key) = key {
            request = request.header("authorization", format!("Bearer {key}"));
        }
        let body = match method {
            Method::POST => chat("hi").to_string(),
            _ => String::new(),
        };
        let request = request
            .header("content-type", "application/json")
            .body(Full::new(bytes::Bytes::from(body)))
            .unwrap();
        let client = client.clone();
        async move {
            let response = client.request(request).await.unwrap();
            let status = response.status();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, body)
        }
    };
    for (method, path) in [
        (Method::POST, "/v1/chat/completions"),
        (Method::GET, "/v1/models"),
        (Method::GET, "/metrics"),
    ] {
        let (status, body) = send(method.clone(), path, None).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{path}");
        let error: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(error["error"]["type"], "AuthenticationError", "{path}");
        assert_eq!(
            send(method.clone(), path, Some("sk-wrong")).await.0,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            send(method, path, Some("sk-sim")).await.0,
            StatusCode::OK,
            "{path}"
        );
    }
    assert_eq!(send(Method::GET, "/health", None).await.0, StatusCode::OK);
    assert_eq!(
        send(Method::GET, "/sim/stats", None).await.0,
        StatusCode::OK
    );
    assert_eq!(
        sim.stats().requests,
        3,
        "refused completions count as received"
    );
}
