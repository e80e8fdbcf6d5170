//! The attempt loop: the one place that retries.
//!
//! For the chosen profile: take an admission slot, then try endpoints (a different one each
//! time, power of two choices among closed circuits), retrying only before any byte reached
//! the client — connect errors, header timeouts, 429/502/503/504 — with full-jitter backoff
//! (at least `Retry-After`), within the profile's retry budget, the attempt cap and the
//! deadline. When the profile is exhausted, fall back to the next-best profile (unless the
//! client pinned one). An upstream that says the prompt exceeds its context ([`context`])
//! sends the request to a feasible profile with a larger context instead, or answers
//! `context_length_exceeded`. The policies are the state machines in [`crate::resilience`];
//! this module only drives them.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, Request, Response, StatusCode};
use opentelemetry::KeyValue;
use quantrouter_policy::RoutingDecision;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use super::context::{self, Checked};
use super::{Endpoint, InflightGuard, UpstreamClient, UpstreamError, UpstreamIncoming};
use crate::openai::ApiError;
use crate::profiles::Snapshot;
use crate::resilience::{Overloaded, ResilienceConfig};
use crate::telemetry;
use crate::traces::{self, RequestTrace};

/// One request's way through the upstreams.
#[derive(Debug)]
pub struct Plan<'a> {
    pub snapshot: &'a Snapshot,
    pub decision: &'a RoutingDecision,
    /// The client named the profile: no cross-tier fallback.
    pub pinned: bool,
    /// `/v1/chat/completions` or `/v1/completions`.
    pub path: &'static str,
    /// Headers for the upstream (content type, forwarded client headers, request id).
    pub headers: &'a HeaderMap,
    pub deadline: Instant,
    /// The request span, when tracing is on; each attempt gets a child span.
    pub trace: Option<&'a RequestTrace>,
    /// For log lines (the request's log span exists at debug level only).
    pub request_id: &'a str,
}

/// A response with headers from some upstream.
#[derive(Debug)]
pub struct Answer {
    pub response: Response<UpstreamIncoming>,
    pub profile: usize,
    pub endpoint: Arc<Endpoint>,
    /// In-flight accounting and the admission slot, held until the body ends.
    pub held: (InflightGuard, Option<OwnedSemaphorePermit>),
    pub attempts: u32,
    pub fallback: Option<Fallback>,
    /// When the request that got this answer was sent: the header timeout runs from here
    /// until the first output (see [`super::BodyLimits::first_output_by`]).
    pub sent_at: Instant,
}

/// A switch to another profile: from, to, why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fallback {
    pub from: usize,
    pub to: usize,
    pub reason: &'static str,
}

/// The last thing that went wrong, to answer the client with. The details (which
/// endpoint, what error) are for logs and traces: clients learn the profile, never the
/// upstream's address.
#[derive(Debug)]
enum Failure {
    Nothing,
    Status(StatusCode),
    Connect,
    Timeout,
    /// The upstream answered, but not in HTTP.
    Invalid,
    /// The prompt does not fit the upstream's context; its message.
    ContextOverflow(String),
}

/// Sends the request to `start` and onwards. `body_for(profile)` is the body with that
/// profile's model name. `attempts_before` counts attempts an earlier call already made for
/// the same client request (quality fallback), against `max_attempts`.
pub async fn forward(
    client: &UpstreamClient,
    config: &ResilienceConfig,
    plan: &Plan<'_>,
    start: usize,
    attempts_before: u32,
    body_for: &(dyn Fn(usize) -> Bytes + Sync),
) -> Result<Answer, ApiError> {
    let mut attempts = attempts_before;
    let mut profiles_tried = Vec::with_capacity(2);
    let mut profile = start;
    let mut fallback = None;
    let mut failure = Failure::Nothing;
    let mut retries = 0u32;
    let mut retry_after = None;
    loop {
        profiles_tried.push(profile);
        let pool = &plan.snapshot.pools[profile];
        let id = plan.snapshot.set.profiles[profile].id.as_str();
        let now = Instant::now();
        let queue_timeout = config
            .admission
            .queue_timeout
            .min(plan.deadline.saturating_duration_since(now));
        let permit = match pool.admission.admit(queue_timeout).await {
            Ok(permit) => permit,
            Err(overloaded) => {
                telemetry::admission_rejected(id);
                return Err(ApiError::Overloaded {
                    profile: id.to_owned(),
                    reason: match overloaded {
                        Overloaded::QueueFull => "the wait queue is full".into(),
                        Overloaded::Timeout => format!("no slot within {queue_timeout:?}"),
                    },
                    retry_after_s: 1,
                });
            }
        };
        pool.on_request(Instant::now());
        let mut endpoints_tried: Vec<Arc<Endpoint>> = Vec::with_capacity(2);
        let mut permit = Some(permit);
        while attempts < config.max_attempts {
            if !endpoints_tried.is_empty() {
                if !pool.try_retry(Instant::now()) {
                    tracing::debug!(profile = id, "retry budget exhausted");
                    break;
                }
                let wait = config.backoff.delay(retries, fastrand::f64(), retry_after);
                if Instant::now() + wait >= plan.deadline {
                    break;
                }
                tokio::time::sleep(wait).await;
                retries += 1;
                telemetry::retry(id);
            }
            let Some(pick) = pool.pick(&endpoints_tried, Instant::now()) else {
                break;
            };
            attempts += 1;
            endpoints_tried.push(Arc::clone(&pick.endpoint));
            let mut request = build(plan, id, &pick.endpoint, body_for(profile))?;
            if let Some(auth) = pool.authorization() {
                request.headers_mut().insert(header::AUTHORIZATION, auth);
            }
            let span = plan.trace.map(|trace| {
                let attributes = vec![
                    KeyValue::new("server.address", pick.endpoint.base().to_owned()),
                    KeyValue::new("quantrouter.profile", id.to_owned()),
                    KeyValue::new("quantrouter.retry", i64::from(attempts - 1)),
                ];
                trace.attempt(attributes, request.headers_mut())
            });
            let guard = pool.enter(&pick.endpoint);
            let sent_at = Instant::now();
            let timeout = client
                .header_timeout
                .min(plan.deadline.saturating_duration_since(sent_at));
            let result = client.send(&pick.endpoint, &request, timeout).await;
            if let Some(span) = &span {
                let (attributes, error) = match &result {
                    Ok(r) => (
                        vec![KeyValue::new(
                            "http.response.status_code",
                            i64::from(r.status().as_u16()),
                        )],
                        None,
                    ),
                    Err(e) => (Vec::new(), Some(e.to_string())),
                };
                traces::end(span, attributes, error);
            }
            match result {
                Ok(response) if retryable(response.status()) => {
                    let status = response.status();
                    // 429 is a live server asking for patience, not a broken one.
                    if status == StatusCode::TOO_MANY_REQUESTS {
                        pick.succeeded(sent_at.elapsed());
                    } else {
                        pick.failed();
                    }
                    retry_after = retry_after_header(response.headers());
                    telemetry::upstream_error(id, status_kind(status));
                    failure = Failure::Status(status);
                }
                Ok(response) => {
                    let endpoint = Arc::clone(&pick.endpoint);
                    pick.succeeded(sent_at.elapsed());
                    let left = plan.deadline.saturating_duration_since(Instant::now());
                    let response =
                        match context::check(response, config.idle_timeout.min(left)).await {
                            Checked::Answer(response) => response,
                            Checked::Overflow(message) => {
                                telemetry::upstream_error(id, "context_length");
                                tracing::info!(
                                    request_id = plan.request_id,
                                    profile = id,
                                    "the prompt exceeds the upstream's context"
                                );
                                failure = Failure::ContextOverflow(message);
                                // Another endpoint of this profile has the same context.
                                break;
                            }
                            Checked::Unreadable(why) => return Err(ApiError::BadGateway(why)),
                        };
                    return Ok(Answer {
                        response,
                        profile,
                        endpoint,
                        held: (guard, permit.take()),
                        attempts,
                        fallback,
                        sent_at,
                    });
                }
                Err(error) => {
                    pick.failed();
                    retry_after = None;
                    tracing::warn!(request_id = plan.request_id, %error, profile = id,
                        "upstream attempt failed");
                    let (kind, next) = match error {
                        UpstreamError::HeaderTimeout { .. } => ("header_timeout", Failure::Timeout),
                        UpstreamError::InvalidResponse { .. } => {
                            ("invalid_response", Failure::Invalid)
                        }
                        UpstreamError::Connect { .. }
                        | UpstreamError::Exchange { .. }
                        | UpstreamError::InvalidUrl(_) => ("connect", Failure::Connect),
                    };
                    telemetry::upstream_error(id, kind);
                    failure = next;
                }
            }
        }
        drop(permit);
        let overflow = matches!(failure, Failure::ContextOverflow(_));
        let next = if plan.pinned || attempts >= config.max_attempts {
            None
        } else if overflow {
            next_with_larger_context(plan, &profiles_tried, profile)
        } else {
            next_profile(plan, &profiles_tried)
        };
        let Some(next) = next else {
            return Err(exhausted(failure, plan.deadline, id));
        };
        let reason = if overflow { "context" } else { "error" };
        telemetry::fallback(id, &plan.snapshot.set.profiles[next].id, reason);
        fallback = Some(Fallback {
            from: fallback.map_or(profile, |f: Fallback| f.from),
            to: next,
            reason,
        });
        profile = next;
    }
}

/// The next profile after `tried`, by the decision's fallback order, that can take a
/// request now.
fn next_profile(plan: &Plan<'_>, tried: &[usize]) -> Option<usize> {
    let now = Instant::now();
    let mut tried = tried.to_vec();
    while let Some(next) = plan.decision.next_after_error(&tried) {
        if plan.snapshot.pools[next].available(now) {
            return Some(next);
        }
        tried.push(next);
    }
    None
}

/// After a context overflow on `current`: the untried feasible profile with a larger
/// context and the highest utility that can take a request now.
fn next_with_larger_context(plan: &Plan<'_>, tried: &[usize], current: usize) -> Option<usize> {
    let profiles = &plan.snapshot.set.profiles;
    let context = profiles[current].max_context_tokens;
    let now = Instant::now();
    plan.decision
        .candidates
        .iter()
        .filter(|c| {
            c.feasible
                && !tried.contains(&c.profile)
                && profiles[c.profile].max_context_tokens > context
                && plan.snapshot.pools[c.profile].available(now)
        })
        .max_by(|a, b| a.utility.total_cmp(&b.utility))
        .map(|c| c.profile)
}

fn build(
    plan: &Plan<'_>,
    profile: &str,
    endpoint: &Endpoint,
    body: Bytes,
) -> Result<Request<Bytes>, ApiError> {
    let invalid = |error: &dyn std::fmt::Display| {
        tracing::warn!(request_id = plan.request_id, %error, profile, "invalid upstream request");
        ApiError::BadGateway(format!("profile {profile} has an invalid upstream URL"))
    };
    let uri = endpoint.uri(plan.path).map_err(|e| invalid(&e))?;
    let mut request = Request::post(uri).body(body).map_err(|e| invalid(&e))?;
    *request.headers_mut() = plan.headers.clone();
    Ok(request)
}

/// Statuses that mean "this attempt did not happen", worth another try elsewhere.
fn retryable(status: StatusCode) -> bool {
    matches!(status.as_u16(), 429 | 502 | 503 | 504)
}

fn status_kind(status: StatusCode) -> &'static str {
    match status.as_u16() {
        429 => "status_429",
        502 => "status_502",
        503 => "status_503",
        _ => "status_504",
    }
}

/// `Retry-After` in seconds (the HTTP-date form is not used by vLLM or proxies in front).
fn retry_after_header(headers: &HeaderMap) -> Option<Duration> {
    let secs = headers
        .get(header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(Duration::from_secs(secs))
}

/// The client's answer when every attempt failed.
fn exhausted(failure: Failure, deadline: Instant, profile: &str) -> ApiError {
    if Instant::now() >= deadline {
        return ApiError::Timeout("every attempt ran out of time".into());
    }
    match failure {
        Failure::Nothing => ApiError::Unavailable("no endpoint can take the request now".into()),
        Failure::Status(StatusCode::TOO_MANY_REQUESTS) => ApiError::Overloaded {
            profile: profile.to_owned(),
            reason: "its upstreams answered 429".into(),
            retry_after_s: 1,
        },
        Failure::Status(status) => ApiError::Unavailable(format!(
            "the upstreams of profile {profile} answered {status}"
        )),
        Failure::Connect => ApiError::Unavailable(format!(
            "the upstreams of profile {profile} could not be reached"
        )),
        Failure::Timeout => ApiError::Timeout(format!(
            "the upstreams of profile {profile} sent no response headers in time"
        )),
        Failure::Invalid => ApiError::BadGateway(format!(
            "the upstreams of profile {profile} did not answer in HTTP"
        )),
        Failure::ContextOverflow(message) => ApiError::ContextLengthExceeded(message),
    }
}
