//! OpenTelemetry traces: an OTLP/HTTP receiver in the test decodes what the router exports
//! and checks span names, parent/child links, attributes and that the upstream saw the
//! attempt span as `traceparent`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use quantrouter::traces::Traces;
use quantrouter_policy::{ProfileSet, StaticUpstream, Upstream, DEFAULT_PROFILE_SET};
use support::{capture_upstream, chat, client, eventually, loopback, send, start_router, SIMPLE};

/// Collects the spans of every OTLP/HTTP export it receives.
async fn otlp_receiver() -> (String, Arc<Mutex<Vec<Span>>>) {
    let listener = tokio::net::TcpListener::bind(loopback()).await.unwrap();
    let url = format!("http://{}/v1/traces", listener.local_addr().unwrap());
    let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
    let store = Arc::clone(&spans);
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: http::Request<Incoming>| {
                    let store = Arc::clone(&store);
                    async move {
                        assert_eq!(req.uri().path(), "/v1/traces");
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        let export = ExportTraceServiceRequest::decode(body).unwrap();
                        let mut store = store.lock().unwrap();
                        for resource in export.resource_spans {
                            for scope in resource.scope_spans {
                                store.extend(scope.spans);
                            }
                        }
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                            Bytes::new(),
                        )))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (url, spans)
}

fn attribute(span: &Span, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.clone())
        .and_then(|v| v.value)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_exports_request_route_and_attempt_spans_linked_to_the_client_trace() {
    let (collector, spans) = otlp_receiver().await;
    let (upstream, seen) = capture_upstream().await;
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    for p in &mut set.profiles {
        p.upstream = Upstream::Static(StaticUpstream::new(vec![upstream.clone()]));
    }
    let traces = Traces::to_endpoint(&collector).unwrap();
    let exporter = traces.clone();
    let router = start_router(set, move |c| c.traces = Some(traces)).await;

    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace_id}-{client_span}-01");
    let r = send(
        &client(),
        "POST",
        &format!("http://{}/v1/chat/completions", router.public_addr()),
        &chat("auto", SIMPLE),
        &[
            ("content-type", "application/json"),
            ("traceparent", &traceparent),
        ],
    )
    .await;
    assert_eq!(r.status, http::StatusCode::OK);
    exporter.flush();
    let exported = eventually(Duration::from_secs(5), || async {
        spans.lock().unwrap().len() >= 3
    })
    .await;
    assert!(exported, "three spans reach the collector");

    let spans = spans.lock().unwrap().clone();
    let find = |name: &str| spans.iter().find(|s| s.name == name).unwrap().clone();
    let request = find("POST /v1/chat/completions");
    let route = find("route");
    let attempt = find("upstream attempt");
    for span in [&request, &route, &attempt] {
        assert_eq!(
            hex(&span.trace_id),
            trace_id,
            "one trace, continued from the client"
        );
    }
    assert_eq!(hex(&request.parent_span_id), client_span);
    assert_eq!(route.parent_span_id, request.span_id);
    assert_eq!(attempt.parent_span_id, request.span_id);

    let int = |span: &Span, key: &str| match attribute(span, key) {
        Some(Value::IntValue(v)) => v,
        other => panic!("{key}: {other:?}"),
    };
    let text = |span: &Span, key: &str| match attribute(span, key) {
        Some(Value::StringValue(v)) => v,
        other => panic!("{key}: {other:?}"),
    };
    assert_eq!(int(&request, "http.response.status_code"), 200);
    assert_eq!(text(&request, "gen_ai.request.model"), "auto");
    assert_eq!(text(&request, "quantrouter.tier"), "int4");
    assert_eq!(int(&request, "gen_ai.usage.input_tokens"), 7);
    assert_eq!(int(&request, "gen_ai.usage.output_tokens"), 1);
    assert_eq!(text(&route, "quantrouter.reason"), "utility");
    assert!(matches!(
        attribute(&route, "quantrouter.complexity"),
        Some(Value::DoubleValue(_))
    ));
    assert_eq!(text(&attempt, "server.address"), upstream);
    assert_eq!(int(&attempt, "http.response.status_code"), 200);
    assert_eq!(int(&attempt, "quantrouter.retry"), 0);

    // vLLM saw the attempt span as its parent.
    let headers = seen.lock().unwrap()[0].0.clone();
    let sent = headers["traceparent"].to_str().unwrap().to_owned();
    assert_eq!(sent, format!("00-{trace_id}-{}-01", hex(&attempt.span_id)));
}
