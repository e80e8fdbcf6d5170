//! Metrics and logs. Every metric name lives here; callers use the small recording
//! functions so names and label sets cannot drift apart (`docs/metrics.md` lists them).
//!
//! A leaf module: it takes plain values (ids, counts, states as numbers) and imports nothing
//! else from the crate, so any module can record without a dependency cycle.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http::HeaderValue;
use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use quantrouter_policy::{Profile, ProfileSet, Reason};

/// Requests answered, by profile, tier, status class and decision reason.
pub const REQUESTS: &str = "quantrouter_requests_total";
/// End-to-end request duration (to the last byte) by profile.
pub const REQUEST_DURATION: &str = "quantrouter_request_duration_seconds";
/// Time to the first token by profile: a stream's first event with generated output, or
/// the response headers of an answer sent whole.
pub const TIME_TO_FIRST_TOKEN: &str = "quantrouter_time_to_first_token_seconds";
/// Router overhead: body read, parse, decision and request rewrite, before the upstream call.
pub const OVERHEAD: &str = "quantrouter_router_overhead_seconds";
/// Complexity scores, to watch the prompt mix drift.
pub const COMPLEXITY: &str = "quantrouter_complexity_score";
/// Errors the router answered itself, by OpenAI error code.
pub const ERRORS: &str = "quantrouter_errors_total";
/// Upstream failures by profile and kind.
pub const UPSTREAM_ERRORS: &str = "quantrouter_upstream_errors_total";
/// Requests in flight per tier.
pub const INFLIGHT: &str = "quantrouter_inflight";
/// Retries (attempts after the first within a profile) by profile.
pub const RETRIES: &str = "quantrouter_retries_total";
/// Switches to another profile, by from, to and reason (`error`, `quality`).
pub const FALLBACKS: &str = "quantrouter_fallbacks_total";
/// Streams whose upstream broke after content reached the client, by the profile that broke
/// and result (`resumed`, `failed`, `not_resumable`).
pub const STREAM_RESUMES: &str = "quantrouter_stream_resumes_total";
/// Requests refused by admission (queue full or queue timeout), by profile.
pub const ADMISSION_REJECTED: &str = "quantrouter_admission_rejected_total";
/// Circuit state per endpoint: 0 closed, 1 half-open, 2 open.
pub const CIRCUIT_STATE: &str = "quantrouter_circuit_state";
/// Per tier: requests waiting for admission plus the upstreams' scraped queue.
pub const QUEUE_DEPTH: &str = "quantrouter_queue_depth";
/// Per tier: endpoints whose circuit is not open.
pub const READY_ENDPOINTS: &str = "quantrouter_ready_endpoints";
/// Per endpoint: 1 when its `/metrics` page has a queue metric the router reads, else 0.
pub const UPSTREAM_QUEUE_METRIC: &str = "quantrouter_upstream_queue_metric_found";
/// Tokens from upstream `usage`, by profile and direction (`input`, `output`).
pub const TOKENS: &str = "quantrouter_tokens_total";
/// Estimated cost in USD of the requests served, by profile. A gauge that only grows: the
/// `metrics` facade's counters count whole numbers, and cents would round cheap requests
/// away; `increase()` reads it like a counter.
pub const COST: &str = "quantrouter_cost_usd_total";
/// What the same requests would have cost on `default_profile`, by serving profile;
/// savings = this − `quantrouter_cost_usd_total`.
pub const COUNTERFACTUAL_COST: &str = "quantrouter_counterfactual_cost_usd_total";
/// Version of the active profile set.
pub const PROFILE_SET_VERSION: &str = "quantrouter_profile_set_version";
/// Profile-set reload attempts by source and result.
pub const PROFILE_RELOADS: &str = "quantrouter_profile_reloads_total";
/// Version of the active classifier model (0: built in or off).
pub const CLASSIFIER_VERSION: &str = "quantrouter_classifier_version";
/// Classifier reload attempts by source and result.
pub const CLASSIFIER_RELOADS: &str = "quantrouter_classifier_reloads_total";
/// Kubernetes discovery events: `updated` (a service's endpoint list changed), `error`
/// (a list or watch failed; the last known endpoints stay).
pub const DISCOVERY_EVENTS: &str = "quantrouter_discovery_events_total";
/// 1 while this replica's tier numbers reach Redis (the last publish succeeded), else 0.
pub const REDIS_UP: &str = "quantrouter_redis_up";
/// Requests a tenant sent past authentication, by tenant label (its id among the top N,
/// else `other`).
pub const TENANT_REQUESTS: &str = "quantrouter_tenant_requests_total";
/// Tokens from the `usage` of a tenant's answers, by tenant and direction.
pub const TENANT_TOKENS: &str = "quantrouter_tenant_tokens_total";
/// A tenant's spend in the profiles' currency, by tenant; a gauge that only grows, like
/// [`COST`].
pub const TENANT_SPEND: &str = "quantrouter_tenant_spend_total";
/// A tenant's requests routed cheaper because it is past a soft limit, by tenant.
pub const TENANT_DOWNGRADES: &str = "quantrouter_tenant_downgrades_total";
/// A tenant's requests refused at a hard limit, by tenant and limit.
pub const TENANT_REFUSALS: &str = "quantrouter_tenant_refusals_total";
/// 1 while this replica decides tenant limits on its local shares because the Redis
/// counters are out of reach, else 0.
pub const TENANT_LIMITS_LOCAL: &str = "quantrouter_tenant_limits_local";
/// Calibration: sampled answers of a profile compared with the reference profile's, by
/// profile, task class and result (`agree`, `disagree`, `error`: the reference failed).
pub const TIER_AGREEMENT: &str = "quantrouter_tier_agreement_total";
/// Outcome records of calibration comparisons, by destination and result (`written`,
/// `dropped`: too many writes in flight, `error`).
pub const OUTCOME_RECORDS: &str = "quantrouter_outcome_records_total";
/// Second opinions (`policy.second_opinion`), by result (`rated`, `cached`, `timeout`,
/// `error`).
pub const SECOND_OPINIONS: &str = "quantrouter_second_opinions_total";
/// How long a second opinion's rating call took.
pub const SECOND_OPINION_DURATION: &str = "quantrouter_second_opinion_duration_seconds";

/// The label naming an upstream endpoint (its URL). Not `endpoint`: the Prometheus Operator's
/// monitors set that label to the scraped port's name and would rename ours.
pub const UPSTREAM: &str = "upstream";

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
            let _ = ROUTED.set([histogram!(OVERHEAD), histogram!(COMPLEXITY)]);
            handle
        })
        .clone()
}

/// How often [`spawn_upkeep`] drains the recorder.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Drains histogram samples into their buckets every few seconds. The recorder keeps every
/// sample until a render or an upkeep folds it in; without this task a router nobody scrapes
/// would grow by each request's samples forever.
pub fn spawn_upkeep(handle: PrometheusHandle) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(UPKEEP_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            handle.run_upkeep();
        }
    })
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
        TIME_TO_FIRST_TOKEN,
        metrics::Unit::Seconds,
        "Time to the first token (a stream's first output event, else the response headers), by profile."
    );
    metrics::describe_histogram!(
        OVERHEAD,
        metrics::Unit::Seconds,
        "Router overhead before the upstream call."
    );
    metrics::describe_histogram!(COMPLEXITY, "Prompt complexity scores.");
    metrics::describe_counter!(ERRORS, "Errors answered by the router, by code.");
    metrics::describe_counter!(UPSTREAM_ERRORS, "Upstream failures, by profile and kind.");
    metrics::describe_gauge!(INFLIGHT, "Requests in flight, by tier.");
    metrics::describe_counter!(RETRIES, "Retries within a profile, by profile.");
    metrics::describe_counter!(
        FALLBACKS,
        "Switches to another profile, by from, to and reason."
    );
    metrics::describe_counter!(
        STREAM_RESUMES,
        "Streams broken after content reached the client, by profile and result."
    );
    metrics::describe_counter!(
        ADMISSION_REJECTED,
        "Requests refused by admission, by profile."
    );
    metrics::describe_gauge!(
        CIRCUIT_STATE,
        "Circuit per endpoint: 0 closed, 1 half-open, 2 open."
    );
    metrics::describe_gauge!(
        QUEUE_DEPTH,
        "Requests queued for a tier: admission plus upstream."
    );
    metrics::describe_gauge!(
        READY_ENDPOINTS,
        "Endpoints of a tier whose circuit is not open."
    );
    metrics::describe_gauge!(
        UPSTREAM_QUEUE_METRIC,
        "1 when the endpoint's /metrics has a queue metric the router reads, else 0."
    );
    metrics::describe_gauge!(PROFILE_SET_VERSION, "Version of the active profile set.");
    metrics::describe_counter!(
        PROFILE_RELOADS,
        "Profile-set reloads, by source and result."
    );
    metrics::describe_gauge!(
        CLASSIFIER_VERSION,
        "Version of the active classifier model (0: built in or off)."
    );
    metrics::describe_counter!(
        CLASSIFIER_RELOADS,
        "Classifier reloads, by source and result."
    );
    metrics::describe_counter!(
        DISCOVERY_EVENTS,
        "Kubernetes discovery endpoint updates and errors, by result."
    );
    metrics::describe_gauge!(
        COST,
        "Estimated cost in USD of the requests served, by profile."
    );
    metrics::describe_gauge!(
        COUNTERFACTUAL_COST,
        "Cost in USD the same requests would have had on default_profile, by serving profile."
    );
    metrics::describe_gauge!(
        REDIS_UP,
        "1 while the last publish of tier numbers to Redis succeeded, else 0."
    );
    metrics::describe_counter!(TENANT_REQUESTS, "Requests past authentication, by tenant.");
    metrics::describe_counter!(
        TENANT_TOKENS,
        "Tokens from the usage of answers, by tenant and direction."
    );
    metrics::describe_gauge!(TENANT_SPEND, "Spend in the profiles' currency, by tenant.");
    metrics::describe_counter!(
        TENANT_DOWNGRADES,
        "Requests routed cheaper past a soft limit, by tenant."
    );
    metrics::describe_counter!(
        TENANT_REFUSALS,
        "Requests refused at a hard limit, by tenant and limit."
    );
    metrics::describe_gauge!(
        TENANT_LIMITS_LOCAL,
        "1 while tenant limits are decided on local shares because Redis is out of reach."
    );
    metrics::describe_counter!(
        TIER_AGREEMENT,
        "Sampled answers compared with the calibration reference's, by profile, task class and result."
    );
    metrics::describe_counter!(
        OUTCOME_RECORDS,
        "Outcome records of calibration comparisons, by destination and result."
    );
    metrics::describe_counter!(
        SECOND_OPINIONS,
        "Second opinions on uncertain prompts, by result."
    );
    metrics::describe_histogram!(
        SECOND_OPINION_DURATION,
        "Duration of second-opinion rating calls."
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

/// What became of a profile document a source offered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReloadResult {
    Applied,
    /// Invalid, or older than the active version.
    Rejected,
    /// Valid, but a preferred source's set is active (a file edit while Redis rules).
    Ignored,
}

pub fn profile_reload(source: &'static str, result: ReloadResult) {
    counter!(PROFILE_RELOADS, "source" => source, "result" => result.label()).increment(1);
}

// === impl ReloadResult ===

impl ReloadResult {
    fn label(self) -> &'static str {
        match self {
            ReloadResult::Applied => "applied",
            ReloadResult::Rejected => "rejected",
            ReloadResult::Ignored => "ignored",
        }
    }
}

pub fn classifier_applied(version: u64) {
    gauge!(CLASSIFIER_VERSION).set(version as f64);
}

pub fn classifier_reload(source: &'static str, result: ReloadResult) {
    counter!(CLASSIFIER_RELOADS, "source" => source, "result" => result.label()).increment(1);
}

/// `result`: `updated` or `error`.
pub fn discovery_event(result: &'static str) {
    counter!(DISCOVERY_EVENTS, "result" => result).increment(1);
}

/// Whether the last publish of tier numbers to Redis succeeded.
pub fn redis_up(up: bool) {
    gauge!(REDIS_UP).set(if up { 1.0 } else { 0.0 });
}

/// One profile's metric labels, handles and response header values, made once per
/// snapshot. A `counter!` with labels looks its metric up on every call (a label vector,
/// its hash, comparisons, a clone of each label string): per request that cost more than
/// the routing decision. The handles are resolved on first use, when the recorder is
/// certainly installed (a snapshot can be built before it is).
#[derive(Debug)]
pub struct ProfileTelemetry {
    profile: String,
    tier: String,
    /// `x-quantrouter-profile` and `-tier` (`None` when not a valid header value).
    pub profile_header: Option<HeaderValue>,
    pub tier_header: Option<HeaderValue>,
    handles: OnceLock<Handles>,
    /// `quantrouter_requests_total` by status class and reason.
    requests: [[OnceLock<Counter>; Reason::ALL.len()]; STATUS_CLASSES.len()],
}

#[derive(Debug)]
struct Handles {
    time_to_first_token: Histogram,
    duration: Histogram,
    input_tokens: Counter,
    output_tokens: Counter,
    cost: Gauge,
    counterfactual: Gauge,
}

const STATUS_CLASSES: [&str; 4] = ["2xx", "4xx", "5xx", "other"];

/// Labels of one routed request.
#[derive(Debug, Clone)]
pub struct RequestLabels {
    pub profile: Arc<ProfileTelemetry>,
    pub reason: Reason,
}

impl ProfileTelemetry {
    pub fn new(profile: &Profile) -> Self {
        Self {
            profile: profile.id.clone(),
            tier: profile.tier.clone(),
            profile_header: HeaderValue::from_str(&profile.id).ok(),
            tier_header: HeaderValue::from_str(&profile.tier).ok(),
            handles: OnceLock::new(),
            requests: Default::default(),
        }
    }

    pub fn id(&self) -> &str {
        &self.profile
    }

    fn handles(&self) -> &Handles {
        self.handles.get_or_init(|| {
            let (profile, tier) = (self.profile.clone(), self.tier.clone());
            Handles {
                time_to_first_token: histogram!(TIME_TO_FIRST_TOKEN, "profile" => profile.clone(), "tier" => tier.clone()),
                duration: histogram!(REQUEST_DURATION, "profile" => profile.clone(), "tier" => tier),
                input_tokens: counter!(TOKENS, "profile" => profile.clone(), "direction" => "input"),
                output_tokens: counter!(TOKENS, "profile" => profile.clone(), "direction" => "output"),
                cost: gauge!(COST, "profile" => profile.clone()),
                counterfactual: gauge!(COUNTERFACTUAL_COST, "profile" => profile),
            }
        })
    }

    fn count_request(&self, status: u16, reason: Reason) {
        let class = match status {
            200..=299 => 0,
            400..=499 => 1,
            500..=599 => 2,
            _ => 3,
        };
        self.requests[class][reason.index()]
            .get_or_init(|| {
                counter!(
                    REQUESTS,
                    "profile" => self.profile.clone(),
                    "tier" => self.tier.clone(),
                    "status" => STATUS_CLASSES[class],
                    "reason" => reason.as_str(),
                )
            })
            .increment(1);
    }
}

/// The unlabelled per-request histograms, resolved once the recorder is installed.
static ROUTED: OnceLock<[Histogram; 2]> = OnceLock::new();

pub fn routed(complexity: f64, overhead: Duration) {
    match ROUTED.get() {
        Some([overhead_seconds, score]) => {
            overhead_seconds.record(overhead.as_secs_f64());
            score.record(complexity);
        }
        None => {
            histogram!(OVERHEAD).record(overhead.as_secs_f64());
            histogram!(COMPLEXITY).record(complexity);
        }
    }
}

/// An upstream's answer is on its way to the client: counted by its status.
pub fn response_headers(labels: &RequestLabels, status: u16) {
    labels.profile.count_request(status, labels.reason);
}

/// The first token reached the router, `elapsed` after the request arrived.
pub fn first_token(labels: &RequestLabels, elapsed: Duration) {
    labels
        .profile
        .handles()
        .time_to_first_token
        .record(elapsed.as_secs_f64());
}

pub fn finished(labels: &RequestLabels, elapsed: Duration) {
    labels
        .profile
        .handles()
        .duration
        .record(elapsed.as_secs_f64());
}

/// A request's `(input, output)` tokens, what they cost, and what they would have cost on
/// the default profile.
pub fn usage(labels: &RequestLabels, (input, output): (u64, u64), cost: f64, counterfactual: f64) {
    let handles = labels.profile.handles();
    handles.input_tokens.increment(input);
    handles.output_tokens.increment(output);
    handles.cost.increment(cost);
    handles.counterfactual.increment(counterfactual);
}

/// The `/metrics` page, all of it from the exporter, which escapes every label value (a
/// profile id may hold quotes or backslashes).
pub fn render(handle: &PrometheusHandle) -> String {
    handle.render()
}

pub fn upstream_error(profile: &str, kind: &'static str) {
    counter!(UPSTREAM_ERRORS, "profile" => profile.to_owned(), "kind" => kind).increment(1);
}

pub fn retry(profile: &str) {
    counter!(RETRIES, "profile" => profile.to_owned()).increment(1);
}

pub fn fallback(from: &str, to: &str, reason: &'static str) {
    counter!(FALLBACKS, "from" => from.to_owned(), "to" => to.to_owned(), "reason" => reason)
        .increment(1);
}

/// A stream of `profile` broke after content reached the client; `result`: `resumed`,
/// `failed` or `not_resumable`.
pub fn stream_resume(profile: &str, result: &'static str) {
    counter!(STREAM_RESUMES, "profile" => profile.to_owned(), "result" => result).increment(1);
}

/// One calibration comparison of `profile`'s answer with the reference's.
pub fn tier_agreement(profile: &str, task_class: &'static str, result: &'static str) {
    counter!(TIER_AGREEMENT, "profile" => profile.to_owned(), "task_class" => task_class,
        "result" => result)
    .increment(1);
}

/// One outcome record to `destination` (`redis`, `file`) and what became of it.
pub fn outcome_record(destination: &'static str, result: &'static str) {
    counter!(OUTCOME_RECORDS, "destination" => destination, "result" => result).increment(1);
}

/// One second opinion asked (or found cached) and what became of it.
pub fn second_opinion(result: &'static str, elapsed: Option<Duration>) {
    counter!(SECOND_OPINIONS, "result" => result).increment(1);
    if let Some(elapsed) = elapsed {
        histogram!(SECOND_OPINION_DURATION).record(elapsed.as_secs_f64());
    }
}

pub fn admission_rejected(profile: &str) {
    counter!(ADMISSION_REJECTED, "profile" => profile.to_owned()).increment(1);
}

/// An endpoint's circuit state as the gauge encodes it: 0 closed, 1 half-open, 2 open.
pub fn circuit_state(profile: &str, endpoint: &str, state: u8) {
    gauge!(CIRCUIT_STATE, "profile" => profile.to_owned(), UPSTREAM => endpoint.to_owned())
        .set(f64::from(state));
}

/// Whether an endpoint's `/metrics` page has a queue metric the router reads.
pub fn upstream_queue_metric(profile: &str, endpoint: &str, found: bool) {
    gauge!(UPSTREAM_QUEUE_METRIC, "profile" => profile.to_owned(), UPSTREAM => endpoint.to_owned())
        .set(if found { 1.0 } else { 0.0 });
}

/// A tier's queue, in-flight requests and endpoints with a circuit not open.
pub fn tier_gauges(tier: &str, queue_depth: u64, inflight: u64, ready_endpoints: u64) {
    gauge!(QUEUE_DEPTH, "tier" => tier.to_owned()).set(queue_depth as f64);
    gauge!(INFLIGHT, "tier" => tier.to_owned()).set(inflight as f64);
    gauge!(READY_ENDPOINTS, "tier" => tier.to_owned()).set(ready_endpoints as f64);
}

pub fn router_error(code: &'static str) {
    counter!(ERRORS, "code" => code).increment(1);
}

/// Whether this replica decides tenant limits on its local shares (Redis out of reach).
pub fn tenant_limits_local(local: bool) {
    gauge!(TENANT_LIMITS_LOCAL).set(if local { 1.0 } else { 0.0 });
}

/// One tenant label's metric handles, made with each tenant snapshot and resolved on first
/// use, so a request does not look its series up by label (see [`ProfileTelemetry`]).
#[derive(Debug)]
pub struct TenantTelemetry {
    label: String,
    handles: OnceLock<TenantHandles>,
}

#[derive(Debug)]
struct TenantHandles {
    requests: Counter,
    downgrades: Counter,
    input_tokens: Counter,
    output_tokens: Counter,
    spend: Gauge,
}

impl TenantTelemetry {
    /// `label`: the tenant's id among the top N, else `other`; never anything a client sent.
    pub fn new(label: &str) -> Self {
        Self {
            label: label.to_owned(),
            handles: OnceLock::new(),
        }
    }

    fn handles(&self) -> &TenantHandles {
        self.handles.get_or_init(|| {
            let tenant = self.label.clone();
            TenantHandles {
                requests: counter!(TENANT_REQUESTS, "tenant" => tenant.clone()),
                downgrades: counter!(TENANT_DOWNGRADES, "tenant" => tenant.clone()),
                input_tokens: counter!(TENANT_TOKENS, "tenant" => tenant.clone(), "direction" => "input"),
                output_tokens: counter!(TENANT_TOKENS, "tenant" => tenant.clone(), "direction" => "output"),
                spend: gauge!(TENANT_SPEND, "tenant" => tenant),
            }
        })
    }

    /// A request of the tenant passed authentication.
    pub fn request(&self) {
        self.handles().requests.increment(1);
    }

    /// A request routed cheaper, past a soft limit.
    pub fn downgrade(&self) {
        self.handles().downgrades.increment(1);
    }

    /// A request refused at `limit` (the limit's field name).
    pub fn refusal(&self, limit: &'static str) {
        counter!(TENANT_REFUSALS, "tenant" => self.label.clone(), "limit" => limit).increment(1);
    }

    /// An answer's tokens and cost.
    pub fn usage(&self, input: u64, output: u64, spend: f64) {
        let handles = self.handles();
        handles.input_tokens.increment(input);
        handles.output_tokens.increment(output);
        handles.spend.increment(spend);
    }
}

#[cfg(test)]
mod tests {
    use metrics_exporter_prometheus::PrometheusBuilder;
    use quantrouter_policy::DEFAULT_PROFILE_SET;

    use super::*;

    #[test]
    fn requests_are_counted_by_profile_status_class_and_reason() {
        let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).expect("the default set parses");
        let recorder = PrometheusBuilder::new().build_recorder();
        let page = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            let first = ProfileTelemetry::new(&set.profiles[0]);
            let second = ProfileTelemetry::new(&set.profiles[1]);
            first.count_request(200, Reason::Utility);
            first.count_request(204, Reason::Utility);
            first.count_request(200, Reason::Pinned);
            first.count_request(503, Reason::FallbackError);
            second.count_request(429, Reason::ColdStartAvoided);
            second.count_request(101, Reason::Pinned);
        });
        let page = page.render();
        let series = |profile: &Profile, status: &str, reason: &str| {
            format!(
                "{REQUESTS}{{profile=\"{}\",tier=\"{}\",status=\"{status}\",reason=\"{reason}\"}}",
                profile.id, profile.tier
            )
        };
        let (p0, p1) = (&set.profiles[0], &set.profiles[1]);
        for (series, count) in [
            (series(p0, "2xx", "utility"), 2),
            (series(p0, "2xx", "pinned"), 1),
            (series(p0, "5xx", "fallback_error"), 1),
            (series(p1, "4xx", "cold_start_avoided"), 1),
            (series(p1, "other", "pinned"), 1),
        ] {
            assert!(
                page.contains(&format!("{series} {count}\n")),
                "{series} {count} in:\n{page}"
            );
        }
        assert_eq!(page.matches(&format!("{REQUESTS}{{")).count(), 5, "{page}");
    }
}
