//! The numbers KEDA scales on: cluster-wide through a real Redis (`GET /keda/tiers/{tier}`
//! sums live replicas and forgets dead ones), this replica's own without Redis, and KEDA's
//! external scaler over gRPC, including the scale-from-zero push of `StreamIsActive`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::Response;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use quantrouter::keda::proto::external_scaler_client::ExternalScalerClient;
use quantrouter::keda::proto::{GetMetricsRequest, IsActiveResponse, ScaledObjectRef};
use quantrouter::keda::publish::{Publisher, RedisTarget};
use quantrouter::keda::KedaConfig;
use quantrouter::profiles::{ProfileStore, SourceKind};
use quantrouter::server::ServerConfig;
use serde_json::json;
use support::redis_server::RedisServer;
use support::{eventually, loopback, start_router, Harness};

/// Streams stay open ~20 s (400 tokens at 50 ms): in flight for every check below.
const ITL: Duration = Duration::from_millis(50);
const INT4: &str = "llama8b-awq";

type ScalerClient = ExternalScalerClient<Client<HttpConnector, tonic::body::Body>>;

/// Longer than any wait of these tests: a live replica's numbers never expire in them.
const LIVE_TTL: Duration = Duration::from_secs(60);

/// A replica's KEDA numbers in `redis`, kept for `ttl` after its last publish.
fn shared(redis: &RedisServer, replica: &str, ttl: Duration) -> KedaConfig {
    KedaConfig {
        redis: Some(RedisTarget {
            redis: redis.handle(),
            prefix: "qr".into(),
        }),
        replica_id: replica.into(),
        publish_interval: Duration::from_millis(100),
        ttl,
        ..KedaConfig::default()
    }
}

/// A streamed completion pinned to `profile`, left open (its body unread).
async fn open_stream(h: &Harness, public: SocketAddr, profile: &str) -> Response<Incoming> {
    let body = json!({"model": profile, "stream": true, "max_tokens": 400, "ignore_eos": true,
        "messages": [{"role": "user", "content": "Tell me a long story."}]});
    let req = http::Request::post(format!("http://{public}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let response = h.client.request(req).await.unwrap();
    assert_eq!(response.status(), 200);
    response
}

async fn tier(h: &Harness, admin: SocketAddr, tier: &str) -> serde_json::Value {
    h.get(&format!("http://{admin}/keda/tiers/{tier}"))
        .await
        .json()
}

/// Polls `GET /keda/tiers/int4` on `admin` until it equals `expected`.
async fn int4_becomes(h: &Harness, admin: SocketAddr, expected: serde_json::Value) {
    let last = Mutex::new(serde_json::Value::Null);
    let reached = eventually(Duration::from_secs(5), || {
        let (last, expected) = (&last, &expected);
        async move {
            let seen = tier(h, admin, "int4").await;
            let done = seen == *expected;
            *last.lock().unwrap() = seen;
            done
        }
    })
    .await;
    let last = last.into_inner().unwrap();
    assert!(reached, "expected {expected}, last saw {last}");
}

fn int4(queue: u64, inflight: u64, ready: u64, replicas: u64, source: &str) -> serde_json::Value {
    json!({"tier": "int4", "queue_depth": queue, "inflight": inflight, "ready_endpoints": ready,
        "replicas_reporting": replicas, "source": source})
}

/// The next message of a `StreamIsActive` stream.
async fn next(stream: &mut tonic::Streaming<IsActiveResponse>) -> IsActiveResponse {
    tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .expect("a message within 5 s")
        .unwrap()
        .expect("the stream is open")
}

fn scaler_client(addr: SocketAddr) -> ScalerClient {
    let http2 = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    ExternalScalerClient::with_origin(http2, format!("http://{addr}").parse().unwrap())
}

fn trigger(metadata: &[(&str, &str)]) -> ScaledObjectRef {
    ScaledObjectRef {
        name: "vllm-int4".into(),
        namespace: "llm".into(),
        scaler_metadata: metadata
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tier_numbers_add_up_every_live_replica_and_forget_dead_ones() {
    let redis = RedisServer::start(None);
    // Live replicas keep their numbers far longer than any wait below, so that only an
    // explicit removal (or the crashed replica's short expiry) can take numbers away, however
    // slowly a loaded machine runs the publishers.
    let a = Harness::start_with(ITL, |c| c.keda = shared(&redis, "router-a", LIVE_TTL)).await;
    // A second replica in front of the same vLLM endpoints.
    let b = start_router(a.set.clone(), |c| {
        c.keda = shared(&redis, "router-b", LIVE_TTL)
    })
    .await;
    let admin = a.router.admin_addr();
    let mut on_a = vec![
        open_stream(&a, a.router.public_addr(), INT4).await,
        open_stream(&a, a.router.public_addr(), INT4).await,
    ];
    let on_b = open_stream(&a, b.public_addr(), INT4).await;
    // Requests add up; the one endpoint both replicas share counts once.
    int4_becomes(&a, admin, int4(0, 3, 1, 2, "redis")).await;
    assert_eq!(
        tier(&a, b.admin_addr(), "int4").await,
        int4(0, 3, 1, 2, "redis"),
        "every replica answers for the cluster"
    );

    // A replica that dies without a word drops out when its numbers expire.
    let store = Arc::new(ProfileStore::new(a.set.clone(), SourceKind::Embedded));
    let crashed = Publisher::start(
        store,
        RedisTarget {
            redis: redis.handle(),
            prefix: "qr".into(),
        },
        &shared(&redis, "router-c", Duration::from_secs(1)),
    );
    int4_becomes(&a, admin, int4(0, 3, 1, 3, "redis")).await;
    crashed.abort();
    int4_becomes(&a, admin, int4(0, 3, 1, 2, "redis")).await;

    // One that shuts down removes its numbers once its requests are done.
    drop(on_b);
    b.shutdown().await;
    int4_becomes(&a, admin, int4(0, 2, 1, 1, "redis")).await;
    on_a.clear();
    int4_becomes(&a, admin, int4(0, 0, 1, 1, "redis")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_a_replica_answers_its_own_numbers() {
    let h = Harness::start_with(ITL, |_| {}).await;
    let admin = h.router.admin_addr();
    let _open = open_stream(&h, h.router.public_addr(), INT4).await;
    int4_becomes(&h, admin, int4(0, 1, 1, 1, "local")).await;

    let unknown = h.get(&format!("http://{admin}/keda/tiers/int3")).await;
    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.json()["error"]["code"], "unknown_tier");

    // Redis configured but down: the same, without waiting long.
    let dead_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let down = support::redis_server::handle_at(&format!("redis://127.0.0.1:{dead_port}"));
    let router = start_router(h.set.clone(), |c| {
        c.keda.redis = Some(RedisTarget {
            redis: down,
            prefix: "qr".into(),
        });
    })
    .await;
    int4_becomes(&h, router.admin_addr(), int4(0, 0, 1, 1, "local")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_external_scaler_reports_what_is_in_flight() {
    let h = Harness::start_with(ITL, |c| c.scaler_listen = Some(loopback())).await;
    let mut scaler = scaler_client(h.router.scaler_addr().unwrap());
    let int4 = trigger(&[("tier", "int4"), ("targetQueueDepth", "2")]);

    let spec = scaler
        .get_metric_spec(int4.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(spec.metric_specs.len(), 1);
    assert_eq!(
        spec.metric_specs[0].metric_name,
        "quantrouter-int4-requests"
    );
    assert_eq!(spec.metric_specs[0].target_size, 2);
    assert_eq!(spec.metric_specs[0].target_size_float, 2.0);
    assert!(
        !scaler
            .is_active(int4.clone())
            .await
            .unwrap()
            .into_inner()
            .result
    );

    let _open = [
        open_stream(&h, h.router.public_addr(), INT4).await,
        open_stream(&h, h.router.public_addr(), INT4).await,
        open_stream(&h, h.router.public_addr(), INT4).await,
    ];
    let request = GetMetricsRequest {
        scaled_object_ref: Some(int4.clone()),
        metric_name: "quantrouter-int4-requests".into(),
    };
    let last = Mutex::new(None);
    let three = eventually(Duration::from_secs(5), || {
        let (mut scaler, request, last) = (scaler.clone(), request.clone(), &last);
        async move {
            let metrics = scaler.get_metrics(request).await.unwrap().into_inner();
            let value = metrics
                .metric_values
                .first()
                .map(|v| (v.metric_value, v.metric_value_float));
            *last.lock().unwrap() = value;
            value == Some((3, 3.0))
        }
    })
    .await;
    assert!(
        three,
        "three requests in flight, got {:?}",
        last.lock().unwrap()
    );
    assert!(scaler.is_active(int4).await.unwrap().into_inner().result);

    let missing = scaler.is_active(trigger(&[])).await.unwrap_err();
    assert_eq!(missing.code(), tonic::Code::InvalidArgument);
    let unknown = scaler
        .get_metric_spec(trigger(&[("tier", "int3")]))
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);

    // Whatever a trigger names is echoed as a short, escaped prefix, never whole.
    let hostile = format!("t\n\u{7}{}", "t".repeat(3_000));
    for (key, value) in [("tier", hostile.as_str()), ("targetQueueDepth", &hostile)] {
        let mut metadata = vec![(key, value)];
        if key != "tier" {
            metadata.push(("tier", "int4"));
        }
        let status = scaler
            .get_metric_spec(trigger(&metadata))
            .await
            .unwrap_err();
        assert_ne!(status.code(), tonic::Code::Ok);
        let message = status.message();
        assert!(message.len() < 200, "{key}: {} bytes echoed", message.len());
        assert!(message.contains("\\n\\u{7}ttt"), "{key}: {message}");
        assert!(!message.chars().any(char::is_control), "{message:?}");
    }
    let r = h
        .get(&h.admin_url(&format!("/keda/tiers/{}", "t".repeat(3_000))))
        .await;
    assert_eq!(r.status, http::StatusCode::NOT_FOUND);
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.len() < 300, "{} bytes echoed", message.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_is_active_pushes_true_the_moment_demand_arrives() {
    let h = Harness::start_with(Duration::ZERO, |c: &mut ServerConfig| {
        c.scaler_listen = Some(loopback());
        // Only a push can deliver anything within this test.
        c.keda.stream_check = Duration::from_secs(3600);
    })
    .await;
    let mut scaler = scaler_client(h.router.scaler_addr().unwrap());

    // The hook itself.
    let mut int4 = scaler
        .stream_is_active(trigger(&[("tier", "int4")]))
        .await
        .unwrap()
        .into_inner();
    let first = next(&mut int4).await;
    assert!(!first.result, "idle at first");
    h.router.app.keda.demand.notify_demand("int4");
    assert!(next(&mut int4).await.result);

    // From the request path: a request pinned to a tier with no endpoint left.
    let mut fp8 = scaler
        .stream_is_active(trigger(&[("tier", "fp8")]))
        .await
        .unwrap()
        .into_inner();
    assert!(!next(&mut fp8).await.result);
    let snapshot = h.router.app.store.load();
    let i = snapshot
        .set
        .profiles
        .iter()
        .position(|p| p.tier == "fp8")
        .unwrap();
    snapshot.runtime[i].pool.set_urls(&[]);
    let reply = h
        .post(
            "/v1/chat/completions",
            &support::chat("llama8b-fp8", support::SIMPLE),
        )
        .await;
    assert_ne!(reply.status, 200, "nowhere to send it");
    assert!(next(&mut fp8).await.result);
    // And the poll agrees for a while (the demand hold).
    let fp8_trigger = trigger(&[("tier", "fp8")]);
    assert!(
        scaler
            .is_active(fp8_trigger)
            .await
            .unwrap()
            .into_inner()
            .result
    );
}
