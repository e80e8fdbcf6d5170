//! Metrics and logs. Every metric name lives here; callers use the small recording
//! functions so names and label sets cannot drift apart (`docs/metrics.md` lists them).

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use quantrouter_policy::ProfileSet;

/// Requests answered, by profile, tier, status class and decision reason.
pub const REQUESTS: &str = "quantrouter_requests_total";
/// End-to-end request duration (to the last byte) by profile.
pub const REQUEST_DURATION: &str = "quantrouter_request_duration_seconds";
/// Time to the upstream's response headers (first token for vLLM streams) by profile.
pub const TIME_TO_FIRST_BYTE: &str = "quantrouter_time_to_first_token_seconds";
/// Router overhead: body read, parse, decision and request rewrite, before the upstream call.
pub const OVERHEAD: &str = "quantrouter_router_overhead_seconds";
/// Complexity scores, to watch the prompt mix drift.
pub const COMPLEXITY: &str = "quantrouter_complexity_score";
/// Errors the router answered itself, by OpenAI error code.
pub const ERRORS: &str = "quantrouter_errors_total";
/// Upstream failures by profile and kind.
pub const UPSTREAM_ERRORS: &str = "quantrouter_upstream_errors_total";
/// Requests in flight per profile and tier.
pub const INFLIGHT: &str = "quantrouter_inflight";
/// Version of the active profile set.
pub const PROFILE_SET_VERSION: &str = "quantrouter_profile_set_version";
/// Profile-set reload attempts by source and result.
pub const PROFILE_RELOADS: &str = "quantrouter_profile_reloads_total";
/// Kubernetes discovery events: `updated` (a service's endpoint list changed), `error`
/// (a list or watch failed; the last known endpoints stay).
pub const DISCOVERY_EVENTS: &str = "quantrouter_discovery_events_total";

/// LLM latencies span milliseconds (cached short answers) to minutes (long generations).
const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
/// Router overhead is microseconds; its buckets resolve 10 µs to 10 ms.
const OVERHEAD_BUCKETS: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
];
const SCORE_BUCKETS: &[f64] = &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Json,
    Text,
}

/// Installs the process-wide Prometheus recorder once; later calls share it (tests run
/// several routers in one process).
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(OVERHEAD.into()), OVERHEAD_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(COMPLEXITY.into()), SCORE_BUCKETS)
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
                });
            let recorder = match builder {
                Ok(builder) => builder.build_recorder(),
                Err(error) => {
                    tracing::error!(%error, "invalid histogram buckets; using defaults");
                    PrometheusBuilder::new().build_recorder()
                }
            };
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics may be empty");
            }
            describe();
            handle
        })
        .clone()
}

fn describe() {
    metrics::describe_counter!(
        REQUESTS,
        "Requests answered, by profile, tier, status class and reason."
    );
    metrics::describe_histogram!(
        REQUEST_DURATION,
        metrics::Unit::Seconds,
        "Request duration to the last byte, by profile."
    );
    metrics::describe_histogram!(
        TIME_TO_FIRST_BYTE,
        metrics::Unit::Seconds,
        "Time to upstream response headers, by profile."
    );
    metrics::describe_histogram!(
        OVERHEAD,
        metrics::Unit::Seconds,
        "Router overhead before the upstream call."
    );
    metrics::describe_histogram!(COMPLEXITY, "Prompt complexity scores.");
    metrics::describe_counter!(ERRORS, "Errors answered by the router, by code.");
    metrics::describe_counter!(UPSTREAM_ERRORS, "Upstream failures, by profile and kind.");
    metrics::describe_gauge!(INFLIGHT, "Requests in flight, by profile and tier.");
    metrics::describe_gauge!(PROFILE_SET_VERSION, "Version of the active profile set.");
    metrics::describe_counter!(
        PROFILE_RELOADS,
        "Profile-set reloads, by source and result."
    );
    metrics::describe_counter!(
        DISCOVERY_EVENTS,
        "Kubernetes discovery endpoint updates and errors, by result."
    );
}

/// Sets up `tracing` output on stderr; `RUST_LOG` overrides the default `info` level.
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
    // Already initialised (tests, demo): keep the first subscriber.
    drop(result);
}

pub fn profile_set_applied(set: &ProfileSet) {
    gauge!(PROFILE_SET_VERSION).set(set.version as f64);
}

pub fn profile_reload(source: &'static str, ok: bool) {
    let result = if ok { "applied" } else { "rejected" };
    counter!(PROFILE_RELOADS, "source" => source, "result" => result).increment(1);
}

/// `result`: `updated` or `error`.
pub fn discovery_event(result: &'static str) {
    counter!(DISCOVERY_EVENTS, "result" => result).increment(1);
}

/// Labels of one routed request.
#[derive(Debug, Clone)]
pub struct RequestLabels {
    pub profile: String,
    pub tier: String,
    pub reason: &'static str,
}

pub fn routed(labels: &RequestLabels, complexity: f64, overhead: Duration) {
    histogram!(OVERHEAD).record(overhead.as_secs_f64());
    histogram!(COMPLEXITY).record(complexity);
    gauge!(INFLIGHT, "profile" => labels.profile.clone(), "tier" => labels.tier.clone())
        .increment(1.0);
}

pub fn response_headers(labels: &RequestLabels, status: u16, elapsed: Duration) {
    histogram!(TIME_TO_FIRST_BYTE, "profile" => labels.profile.clone())
        .record(elapsed.as_secs_f64());
    counter!(
        REQUESTS,
        "profile" => labels.profile.clone(),
        "tier" => labels.tier.clone(),
        "status" => status_class(status),
        "reason" => labels.reason,
    )
    .increment(1);
}

pub fn finished(labels: &RequestLabels, elapsed: Duration) {
    histogram!(REQUEST_DURATION, "profile" => labels.profile.clone()).record(elapsed.as_secs_f64());
    gauge!(INFLIGHT, "profile" => labels.profile.clone(), "tier" => labels.tier.clone())
        .decrement(1.0);
}

pub fn upstream_error(labels: &RequestLabels, kind: &'static str) {
    counter!(UPSTREAM_ERRORS, "profile" => labels.profile.clone(), "kind" => kind).increment(1);
    gauge!(INFLIGHT, "profile" => labels.profile.clone(), "tier" => labels.tier.clone())
        .decrement(1.0);
}

pub fn router_error(code: &'static str) {
    counter!(ERRORS, "code" => code).increment(1);
}

fn status_class(status: u16) -> &'static str {
    match status {
        200..=299 => "2xx",
        400..=499 => "4xx",
        500..=599 => "5xx",
        _ => "other",
    }
}
