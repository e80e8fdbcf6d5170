//! OpenTelemetry traces: an OTLP/HTTP receiver in the test decodes what the router exports
//! and checks span names, parent/child links, attributes and that the upstream saw the
//! attempt span as `traceparent`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use quantrouter::traces::Traces;
use quantrouter_policy::{ProfileSet, StaticUpstream, Upstream, DEFAULT_PROFILE_SET};
use support::otlp::{attribute, hex, otlp_receiver};
use support::{capture_upstream, chat, client, eventually, send, start_router, SIMPLE};

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
