//! OpenTelemetry traces over OTLP/HTTP, off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set. `OTEL_SERVICE_NAME` and
//! `OTEL_TRACES_SAMPLER(_ARG)` are read by the SDK.
//!
//! Spans: one per request (server kind, HTTP and `gen_ai.*` attributes), a `route` child for
//! the decision, and an `upstream attempt` child per upstream call (client kind), whose
//! context goes to vLLM as W3C `traceparent`, and a `stream resume` child per break of a
//! stream, from the break to its continuation. The client's `traceparent` is continued.
//! Export is batched on the SDK's own thread; an unreachable collector drops spans and
//! never slows a request.

use std::time::{Duration, SystemTime};

use http::HeaderMap;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt, Tracer, TracerProvider};
use opentelemetry::{Context, KeyValue};
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;

/// The tracer of one router; cheap to clone.
#[derive(Debug, Clone)]
pub struct Traces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

/// Why tracing could not be set up (the router then runs without it).
#[derive(Debug, thiserror::Error)]
#[error("OTLP exporter: {0}")]
pub struct TracesError(#[from] opentelemetry_otlp::ExporterBuildError);

impl Traces {
    /// From the standard environment variables; `None` when no endpoint is configured.
    pub fn from_env() -> Result<Option<Self>, TracesError> {
        let configured = [
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ]
        .iter()
        .any(|var| std::env::var(var).is_ok_and(|v| !v.is_empty()));
        if !configured {
            return Ok(None);
        }
        let exporter = SpanExporter::builder().with_http().build()?;
        Ok(Some(Self::with_exporter(exporter)))
    }

    /// Exports to an explicit OTLP/HTTP traces URL (e.g. `http://collector:4318/v1/traces`).
    pub fn to_endpoint(url: &str) -> Result<Self, TracesError> {
        let exporter = SpanExporter::builder()
            .with_http()
            .with_endpoint(url)
            .with_timeout(Duration::from_secs(5))
            .build()?;
        Ok(Self::with_exporter(exporter))
    }

    fn with_exporter(exporter: SpanExporter) -> Self {
        let mut resource = Resource::builder();
        if std::env::var("OTEL_SERVICE_NAME").is_err() {
            resource = resource.with_service_name("quantrouter");
        }
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build();
        let tracer = provider.tracer("quantrouter");
        Self { provider, tracer }
    }

    /// Starts the request span, continuing the client's `traceparent` if any.
    pub fn request(&self, client_headers: &HeaderMap, method: &str, path: &str) -> Context {
        let parent = TraceContextPropagator::new().extract(&HeaderExtractor(client_headers));
        let span = self
            .tracer
            .span_builder(format!("{method} {path}"))
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("http.request.method", method.to_owned()),
                KeyValue::new("url.path", path.to_owned()),
                KeyValue::new("gen_ai.system", "vllm"),
            ])
            .start_with_context(&self.tracer, &parent);
        parent.with_span(span)
    }

    /// Starts a child span of `parent`.
    pub fn child(
        &self,
        parent: &Context,
        name: &'static str,
        kind: SpanKind,
        attributes: Vec<KeyValue>,
    ) -> Context {
        let span = self
            .tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, parent);
        parent.with_span(span)
    }

    /// Writes `cx` as `traceparent`/`tracestate` into upstream headers.
    pub fn inject(cx: &Context, headers: &mut HeaderMap) {
        TraceContextPropagator::new().inject_context(cx, &mut HeaderInjector(headers));
    }

    /// Sends finished spans now (tests, shutdown).
    pub fn flush(&self) {
        let _ = self.provider.force_flush();
    }

    pub fn shutdown(&self) {
        let _ = self.provider.shutdown();
    }
}

/// The span of one client request, ended once: by the response body's end, or by an error.
#[derive(Debug, Clone)]
pub struct RequestTrace {
    pub traces: Traces,
    pub cx: Context,
}

impl RequestTrace {
    pub fn start(traces: &Traces, client_headers: &HeaderMap, path: &str) -> Self {
        Self {
            cx: traces.request(client_headers, "POST", path),
            traces: traces.clone(),
        }
    }

    /// A finished child span for something already done (the routing decision).
    pub fn record(&self, name: &'static str, attributes: Vec<KeyValue>) {
        self.traces
            .child(&self.cx, name, SpanKind::Internal, attributes)
            .span()
            .end();
    }

    /// A finished child span for something that began at `start` (a stream's break).
    pub fn record_since(&self, name: &'static str, start: SystemTime, attributes: Vec<KeyValue>) {
        let tracer = &self.traces.tracer;
        tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .with_start_time(start)
            .with_attributes(attributes)
            .start_with_context(tracer, &self.cx)
            .end();
    }

    /// Starts an upstream attempt span and writes its context into the upstream headers.
    pub fn attempt(&self, attributes: Vec<KeyValue>, headers: &mut HeaderMap) -> Context {
        let cx = self
            .traces
            .child(&self.cx, "upstream attempt", SpanKind::Client, attributes);
        Traces::inject(&cx, headers);
        cx
    }

    pub fn finish(&self, attributes: Vec<KeyValue>) {
        end(&self.cx, attributes, None);
    }

    pub fn fail(&self, status: u16, message: String) {
        let attributes = vec![KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        )];
        end(&self.cx, attributes, Some(message));
    }
}

/// Sets attributes (and an error status) on the span in `cx` and ends it.
pub fn end(cx: &Context, attributes: Vec<KeyValue>, error: Option<String>) {
    let span = cx.span();
    span.set_attributes(attributes);
    if let Some(message) = error {
        span.set_status(Status::error(message));
    }
    span.end();
}
