//! All retrying and backing off of the router, in one place.
//!
//! - [`Backoff`](super::Backoff) (in `backoff.rs`): upstream retries wait by it here.
//! - [`is_retryable`]: what an attempt's outcome allows — nothing, sending the request again
//!   at once (it never left: [`Sent::No`]), or another attempt elsewhere.
//! - [`Forwarder`]: a request's way through the upstreams (the client, the settings and
//!   its [`Plan`]), in named steps, each a method:
//!   1. [`Forwarder::try_profile`]: an admission slot, then endpoints of the profile, a different one
//!      each time (power of two choices among closed circuits), within the retry budget, the
//!      attempt cap and the deadline, after a backoff;
//!   2. [`Forwarder::cross_tier_fallback`]: when a profile is exhausted, the next-best profile (unless
//!      the client pinned one), or after a context overflow ([`context`]) one with a larger
//!      context;
//!   3. [`Forwarder::quality_fallback`]: a finished, non-streamed answer from a profile with a better one
//!      above it is read and checked, and re-run there if it is empty, degenerate or broken;
//!      [`Forwarder::stream_start_check`] does the same for the held start of a stream
//!      (`policy.stream_check`);
//!   4. [`Forwarder::resume`]: a stream whose upstream broke after content reached the client
//!      is continued from the delivered text (`policy.stream_resume`; the request and the
//!      relay are [`super::resume`]'s): another endpoint of its profile first, as a retry,
//!      then the next feasible profile.
//!
//! Nothing else is retried once a byte reached the client. The breaker, the budget and
//! admission are the state machines beside this module; this is their only caller on the
//! request path.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use opentelemetry::KeyValue;
use quantrouter_policy::{
    check_choices, AnswerProblem, ProfileIndex, RoutingDecision, StreamCheck,
};
use tokio::time::Instant;

use super::ResilienceConfig;
use crate::openai::ApiError;
use crate::profiles::Snapshot;
use crate::telemetry::{self, ProfileTelemetry};
use crate::traces::{self, RequestTrace};
use crate::upstream::context::{self, Checked};
use crate::upstream::stream_check::{self, Held as Start};
use crate::upstream::{
    is_event_stream, BodyError, Endpoint, Held, OnEnd, Outcome as BodyOutcome, Pick, Pool, Reading,
    Sent, TimeLimits, UpstreamBody, UpstreamClient, UpstreamError, UpstreamIncoming,
};

/// What one attempt came to, as far as retrying goes.
#[derive(Debug, Clone, Copy)]
pub enum Outcome<'a> {
    /// The upstream answered with this status.
    Answered(StatusCode),
    /// No response head.
    Failed(&'a UpstreamError),
}

/// What an [`Outcome`] allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The answer stands: a success, or an error the client should see.
    Done,
    /// The request never left ([`Sent::No`] on a live connection): send it again at once, to
    /// the same endpoint, as the same attempt. The upstream cannot work twice for it.
    Resend,
    /// Worth another attempt on another endpoint or profile, after a backoff and within the
    /// budget. A request that may have reached the upstream is only ever sent again this
    /// way: as an attempt that the budget, the breaker, the metrics and
    /// `x-quantrouter-attempts` all count.
    Retry,
}

/// One request's way through the upstreams.
#[derive(Debug)]
pub struct Plan<'a> {
    pub snapshot: &'a Snapshot,
    pub decision: &'a RoutingDecision,
    /// The client named the profile: no cross-tier or quality fallback.
    pub pinned: bool,
    /// The client asked for a stream: its answer is never held back for the quality check.
    pub stream: bool,
    /// The client asked for JSON output (`response_format`), which the quality check holds
    /// the answer to.
    pub wants_json: bool,
    /// Headers for the upstream (content type, forwarded client headers, request id).
    pub headers: &'a HeaderMap,
    /// When the request arrived.
    pub started: Instant,
    pub deadline: Instant,
    /// The request span, when tracing is on; each attempt gets a child span.
    pub trace: Option<&'a RequestTrace>,
    /// For log lines (the request's log span exists at debug level only).
    pub request_id: &'a str,
    /// The tenant's place in admission queues: higher waits less (0 without tenants).
    pub priority: i32,
    /// The prompt's blocks, for endpoint choice by cached prefix.
    pub placement: &'a crate::upstream::Placement,
}

/// A response with headers from some upstream.
#[derive(Debug)]
pub struct Answer {
    pub response: Response<UpstreamIncoming>,
    pub profile: ProfileIndex,
    pub endpoint: Arc<Endpoint>,
    /// In-flight accounting and the admission slot, held until the body ends (`None` once
    /// the quality check read the body).
    pub held: Option<Held>,
    pub attempts: u32,
    pub fallback: Option<Fallback>,
    /// When the request that got this answer was sent: the header timeout runs from here
    /// until the first output (see [`BodyLimits::first_output_by`]).
    pub sent_at: Instant,
}

/// A switch to another profile: from, to, why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fallback {
    pub from: ProfileIndex,
    pub to: ProfileIndex,
    pub reason: FallbackReason,
}

/// Why a request moved to another profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackReason {
    /// The profile's endpoints failed or the attempts there ran out.
    Error,
    /// The prompt does not fit the profile's context window.
    Context,
    /// The finished answer failed the quality check.
    Quality,
}

/// The request for a profile: the client's body with that profile's model name, on the API
/// path the profile's upstream serves (the client's, or chat for a translated request).
pub type BodyFor<'a> = &'a (dyn Fn(ProfileIndex) -> Outgoing + Sync);

/// What an attempt on a profile sends.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// The API path, e.g. `/v1/chat/completions`.
    pub path: &'static str,
    pub body: Bytes,
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

/// Where a request's attempts stand, across profiles.
#[derive(Debug)]
struct Progress {
    attempts: u32,
    retries: u32,
    retry_after: Option<Duration>,
    profiles_tried: Vec<ProfileIndex>,
    failure: Failure,
    fallback: Option<Fallback>,
    /// An endpoint the first profile tried must not take the request: the one whose stream
    /// broke ([`Forwarder::resume`]).
    avoid: Option<Arc<Endpoint>>,
}

// === impl FallbackReason ===

impl FallbackReason {
    /// The wire form: the `reason` of `x-quantrouter-fallback` and of the fallbacks metric.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::Context => "context",
            Self::Quality => "quality",
        }
    }
}

// === impl Outcome ===

/// What an attempt's outcome allows; see [`Verdict`].
pub fn is_retryable(outcome: Outcome<'_>) -> Verdict {
    match outcome {
        // A server asking for patience (429) or a proxy that found no server behind it
        // (502, 503, 504): this attempt did not happen.
        Outcome::Answered(status) => match status.as_u16() {
            429 | 502 | 503 | 504 => Verdict::Retry,
            _ => Verdict::Done,
        },
        Outcome::Failed(error) => match (error.sent(), error) {
            (Sent::No, UpstreamError::Unsent { .. }) => Verdict::Resend,
            // No connection (or no usable URL) here; another endpoint may do.
            (Sent::No, _) => Verdict::Retry,
            // Closed, reset, silent or garbled after the request went out: another endpoint,
            // counted, never on the quiet.
            (Sent::Possibly, _) => Verdict::Retry,
        },
    }
}

// === impl Forwarder ===

/// One request's way through the upstreams: the client, the settings and the [`Plan`],
/// with the steps above as methods.
pub struct Forwarder<'a> {
    client: &'a UpstreamClient,
    config: &'a ResilienceConfig,
    plan: Plan<'a>,
    body_for: BodyFor<'a>,
}

impl std::fmt::Debug for Forwarder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("plan", &self.plan)
            .finish_non_exhaustive()
    }
}

/// An attempt on an endpoint and what came of it.
struct Attempted {
    pick: Pick,
    sent_at: Instant,
    result: Result<Response<UpstreamIncoming>, UpstreamError>,
}

impl<'a> Forwarder<'a> {
    pub fn new(
        client: &'a UpstreamClient,
        config: &'a ResilienceConfig,
        plan: Plan<'a>,
        body_for: BodyFor<'a>,
    ) -> Self {
        Self {
            client,
            config,
            plan,
            body_for,
        }
    }

    pub fn plan(&self) -> &Plan<'a> {
        &self.plan
    }

    /// Sends the request to the decision's profile and onwards (the steps above); the
    /// answer whose head and body go to the client.
    pub async fn forward(&self) -> Result<Answer, ApiError> {
        let start = self.plan.decision.profile;
        let answer = self.across_tiers(start, (0, Vec::new())).await?;
        match self.plan.stream {
            true => self.stream_start_check(answer).await,
            false => self.quality_fallback(answer).await,
        }
    }

    /// Step 1 and 2: `start`, then cross-tier fallbacks until an answer or the end.
    /// `before` is what an earlier step did for the same request: the attempts it made, and
    /// the profiles no fallback may go to (their answer was already rejected).
    async fn across_tiers(
        &self,
        start: ProfileIndex,
        (attempts_before, ruled_out): (u32, Vec<ProfileIndex>),
    ) -> Result<Answer, ApiError> {
        let progress = Progress {
            attempts: attempts_before,
            retries: 0,
            retry_after: None,
            profiles_tried: ruled_out,
            failure: Failure::Nothing,
            fallback: None,
            avoid: None,
        };
        self.across_tiers_with(start, progress).await
    }

    /// [`Self::across_tiers`] from where `progress` stands.
    async fn across_tiers_with(
        &self,
        start: ProfileIndex,
        mut progress: Progress,
    ) -> Result<Answer, ApiError> {
        let plan = &self.plan;
        let mut profile = start;
        loop {
            if let Some(answer) = self.try_profile(profile, &mut progress).await? {
                return Ok(answer);
            }
            let id = &plan.snapshot.set.profiles[profile].id;
            let Some((next, reason)) = self.cross_tier_fallback(&progress, profile) else {
                return Err(exhausted(progress.failure, plan.deadline, id));
            };
            telemetry::fallback(id, &plan.snapshot.set.profiles[next].id, reason.as_str());
            progress.fallback = Some(Fallback {
                from: progress.fallback.map_or(profile, |f| f.from),
                to: next,
                reason,
            });
            profile = next;
        }
    }

    /// Step 1: the endpoints of one profile. `None`: the profile is exhausted (why is in
    /// `progress.failure`).
    async fn try_profile(
        &self,
        profile: ProfileIndex,
        progress: &mut Progress,
    ) -> Result<Option<Answer>, ApiError> {
        let (plan, config) = (&self.plan, self.config);
        progress.profiles_tried.push(profile);
        let pool = &plan.snapshot.runtime[profile].pool;
        let id = plan.snapshot.set.profiles[profile].id.as_str();
        let mut permit = Some(self.admit(pool, id).await?);
        // A continuation on the profile whose stream broke is a retry there, not a request.
        let mut endpoints_tried: Vec<Arc<Endpoint>> = progress.avoid.take().into_iter().collect();
        if endpoints_tried.is_empty() {
            pool.on_request(Instant::now());
        }
        while progress.attempts < config.max_attempts {
            if !endpoints_tried.is_empty() && !self.wait_to_retry(pool, id, progress).await {
                break;
            }
            let placed = crate::upstream::placed(&plan.snapshot.set, profile, plan.placement);
            let Some(pick) = pool.pick_placed(placed, &endpoints_tried, Instant::now()) else {
                break;
            };
            progress.attempts += 1;
            endpoints_tried.push(Arc::clone(&pick.endpoint));
            let guard = pool.enter(&pick.endpoint);
            let attempted = self.attempt(profile, pick, progress.attempts).await?;
            let response = match attempted.result {
                Ok(response)
                    if is_retryable(Outcome::Answered(response.status())) == Verdict::Done =>
                {
                    response
                }
                result => {
                    let attempted = Attempted {
                        result,
                        ..attempted
                    };
                    self.note_failure(id, attempted, progress);
                    continue;
                }
            };
            let Attempted { pick, sent_at, .. } = attempted;
            let endpoint = Arc::clone(&pick.endpoint);
            pick.succeeded(sent_at.elapsed());
            let left = plan.deadline.saturating_duration_since(Instant::now());
            let response = match context::check(response, config.idle_timeout.min(left)).await {
                Checked::Answer(response) => response,
                Checked::Overflow(message) => {
                    telemetry::upstream_error(id, "context_length");
                    tracing::info!(
                        request_id = plan.request_id,
                        profile = id,
                        "the prompt exceeds the upstream's context"
                    );
                    progress.failure = Failure::ContextOverflow(message);
                    // Another endpoint of this profile has the same context.
                    break;
                }
                Checked::Unreadable(why) => return Err(ApiError::BadGateway(why)),
            };
            return Ok(Some(Answer {
                response,
                profile,
                endpoint,
                held: Some((guard, permit.take())),
                attempts: progress.attempts,
                fallback: progress.fallback,
                sent_at,
            }));
        }
        Ok(None)
    }

    /// A slot in the profile's admission queue, within the queue timeout and the deadline.
    async fn admit(&self, pool: &Pool, id: &str) -> Result<crate::resilience::Permit, ApiError> {
        let queue_timeout = self
            .config
            .admission
            .queue_timeout
            .min(self.plan.deadline.saturating_duration_since(Instant::now()));
        crate::pipeline::admit_to(pool, id, self.plan.priority, queue_timeout).await
    }

    /// Before a retry: a token from the budget, then the backoff (at least `Retry-After`),
    /// if the deadline leaves room for it. False: no retry.
    async fn wait_to_retry(&self, pool: &Pool, id: &str, progress: &mut Progress) -> bool {
        if !pool.try_retry(Instant::now()) {
            tracing::debug!(profile = id, "retry budget exhausted");
            return false;
        }
        let wait =
            self.config
                .backoff
                .delay(progress.retries, fastrand::f64(), progress.retry_after);
        if Instant::now() + wait >= self.plan.deadline {
            return false;
        }
        tokio::time::sleep(wait).await;
        progress.retries += 1;
        telemetry::retry(id);
        true
    }

    /// A failed attempt (an error, or a status worth a retry): the breaker, the metrics and
    /// the answer the client gets if nothing better comes.
    fn note_failure(&self, id: &str, attempted: Attempted, progress: &mut Progress) {
        let Attempted {
            pick,
            sent_at,
            result,
        } = attempted;
        match result {
            Ok(response) => {
                let status = response.status();
                // 429 is a live server asking for patience, not a broken one.
                if status == StatusCode::TOO_MANY_REQUESTS {
                    pick.succeeded(sent_at.elapsed());
                } else {
                    pick.failed();
                }
                progress.retry_after = retry_after_header(response.headers());
                telemetry::upstream_error(id, status_kind(status));
                progress.failure = Failure::Status(status);
            }
            Err(error) => {
                pick.failed();
                progress.retry_after = None;
                tracing::warn!(request_id = self.plan.request_id, %error, profile = id,
                    "upstream attempt failed");
                let (kind, failure) = match error {
                    UpstreamError::HeaderTimeout { .. } => ("header_timeout", Failure::Timeout),
                    UpstreamError::InvalidResponse { .. } => ("invalid_response", Failure::Invalid),
                    UpstreamError::Connect { .. }
                    | UpstreamError::Unsent { .. }
                    | UpstreamError::Exchange { .. }
                    | UpstreamError::InvalidUrl(_) => ("connect", Failure::Connect),
                };
                telemetry::upstream_error(id, kind);
                progress.failure = failure;
            }
        }
    }

    /// One attempt on `pick` of `profile`: the request, in its own trace span, sent once —
    /// or, when it never left ([`Verdict::Resend`]), once more on a new connection.
    async fn attempt(
        &self,
        profile: ProfileIndex,
        pick: Pick,
        attempt: u32,
    ) -> Result<Attempted, ApiError> {
        let (plan, client) = (&self.plan, self.client);
        let pool = &plan.snapshot.runtime[profile].pool;
        let id = plan.snapshot.set.profiles[profile].id.as_str();
        let Outgoing { path, body } = (self.body_for)(profile);
        let mut request = self.build(id, &pick.endpoint, path, body.clone())?;
        if let Some(auth) = pool.authorization() {
            request.headers_mut().insert(header::AUTHORIZATION, auth);
        }
        let span = plan.trace.map(|trace| {
            let attributes = vec![
                KeyValue::new("server.address", pick.endpoint.base().to_owned()),
                KeyValue::new("quantrouter.profile", id.to_owned()),
                KeyValue::new("quantrouter.retry", i64::from(attempt - 1)),
            ];
            trace.attempt(attributes, request.headers_mut())
        });
        let headers = request.headers().clone();
        let mut sent_at = Instant::now();
        let timeout = |sent_at: Instant| {
            client
                .header_timeout
                .min(plan.deadline.saturating_duration_since(sent_at))
        };
        let transport = pool.transport();
        let mut result = client
            .send(transport, &pick.endpoint, request, timeout(sent_at))
            .await;
        if let Err(error) = &result {
            if is_retryable(Outcome::Failed(error)) == Verdict::Resend {
                tracing::debug!(request_id = plan.request_id, %error, "sending the request again");
                let mut again = self.build(id, &pick.endpoint, path, body)?;
                *again.headers_mut() = headers;
                sent_at = Instant::now();
                result = client
                    .send(transport, &pick.endpoint, again, timeout(sent_at))
                    .await;
            }
        }
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
        Ok(Attempted {
            pick,
            sent_at,
            result,
        })
    }

    /// Step 2: after `current` is exhausted, the profile to try next and why; `None` when
    /// the client pinned the profile, the attempts are used up, or no profile can take it.
    fn cross_tier_fallback(
        &self,
        progress: &Progress,
        current: ProfileIndex,
    ) -> Option<(ProfileIndex, FallbackReason)> {
        if self.plan.pinned || progress.attempts >= self.config.max_attempts {
            return None;
        }
        if matches!(progress.failure, Failure::ContextOverflow(_)) {
            return next_with_larger_context(&self.plan, &progress.profiles_tried, current)
                .map(|next| (next, FallbackReason::Context));
        }
        next_profile(&self.plan, &progress.profiles_tried).map(|next| (next, FallbackReason::Error))
    }

    /// Step 3: the quality check of a finished, non-streamed answer, and the re-run on the
    /// next-better profile when the answer is empty, degenerate or not the JSON asked for.
    async fn quality_fallback(&self, answer: Answer) -> Result<Answer, ApiError> {
        let plan = &self.plan;
        let quality = &plan.snapshot.set.policy.quality_fallback;
        let better = plan.decision.next_higher_quality(answer.profile);
        let checked = quality.enabled && !plan.stream && !plan.pinned;
        let Some(better) = better.filter(|_| checked && answer.response.status().is_success())
        else {
            return Ok(answer);
        };
        let Answer {
            response,
            profile,
            endpoint,
            held,
            attempts,
            fallback,
            sent_at,
        } = answer;
        let (head, bytes) = self.read_whole(response, held, sent_at, profile).await?;
        // A body that is not a completion is passed on as it is, not judged.
        let problem = crate::openai::answer_choices(&bytes).and_then(|choices| {
            check_choices(&choices, plan.wants_json, quality.max_repetition_ratio)
        });
        let Some(problem) = problem else {
            let response = Response::from_parts(head, UpstreamIncoming::buffered(bytes));
            return Ok(Answer {
                response,
                profile,
                endpoint,
                held: None,
                attempts,
                fallback,
                sent_at,
            });
        };
        self.rerun_for_quality((profile, better), attempts, problem)
            .await
    }

    /// Step 3 for a stream: its start, from a profile with a better one above it, is held
    /// and checked (`policy.stream_check`). A good start goes out at once, followed by the
    /// rest; a bad one is dropped (closing its upstream request) before the client saw a
    /// byte, and the request re-run on the better profile.
    async fn stream_start_check(&self, answer: Answer) -> Result<Answer, ApiError> {
        let plan = &self.plan;
        let policy = &plan.snapshot.set.policy;
        let Some(check) = policy.stream_check.filter(|_| !plan.pinned) else {
            return Ok(answer);
        };
        let response = &answer.response;
        let streamed = response.status().is_success() && is_event_stream(response.headers());
        let better = plan.decision.next_higher_quality(answer.profile);
        let Some(better) = better.filter(|_| streamed) else {
            return Ok(answer);
        };
        // The hold ends by the deadline too; the body's own limits take over after it.
        let left = plan.deadline.saturating_duration_since(Instant::now());
        let check = StreamCheck {
            max_hold_ms: check
                .max_hold_ms
                .min(u64::try_from(left.as_millis()).unwrap_or(u64::MAX)),
            ..check
        };
        let (head, incoming) = answer.response.into_parts();
        let max_repetition_ratio = policy.quality_fallback.max_repetition_ratio;
        let held =
            stream_check::hold_start(incoming, &check, plan.wants_json, max_repetition_ratio);
        let profiles = &plan.snapshot.set.profiles;
        let id = profiles[answer.profile].id.as_str();
        let problem = match held.await {
            Ok(Start::Pass { frames, body, .. }) => {
                let response =
                    Response::from_parts(head, UpstreamIncoming::replaying(frames, body));
                return Ok(Answer { response, ..answer });
            }
            Ok(Start::Fail(problem)) => problem,
            Err(error) => {
                // Nothing was sent yet: the better profile can still answer in full.
                tracing::warn!(request_id = plan.request_id, %error, profile = id,
                    "upstream stream failed within the stream-start check");
                telemetry::upstream_error(id, "mid_stream");
                drop(answer.held);
                let from_to = (answer.profile, better);
                return self
                    .rerun_from(from_to, answer.attempts, FallbackReason::Error)
                    .await;
            }
        };
        // Frees the slot and closes the upstream request before the next tier is asked.
        drop(answer.held);
        self.rerun_for_quality((answer.profile, better), answer.attempts, problem)
            .await
    }

    /// An answer from `from_to.0` failed a quality check before any of it was sent: the
    /// request goes to `from_to.1` (and onwards on errors), counted as a quality fallback.
    async fn rerun_for_quality(
        &self,
        from_to: (ProfileIndex, ProfileIndex),
        attempts: u32,
        problem: AnswerProblem,
    ) -> Result<Answer, ApiError> {
        let profiles = &self.plan.snapshot.set.profiles;
        let (from, to) = (&profiles[from_to.0].id, &profiles[from_to.1].id);
        tracing::info!(request_id = self.plan.request_id, %from, %to,
            problem = problem.as_str(), "quality fallback");
        self.rerun_from(from_to, attempts, FallbackReason::Quality)
            .await
    }

    /// Sends the request again from `from_to.1`, after `from_to.0` gave an answer nobody
    /// saw. Its fallbacks never return to `from_to.0`, and after a quality check never go to
    /// a profile no better than it: when every better profile fails, the client gets their
    /// error, not the rejected answer asked for again.
    async fn rerun_from(
        &self,
        (from, to): (ProfileIndex, ProfileIndex),
        attempts: u32,
        reason: FallbackReason,
    ) -> Result<Answer, ApiError> {
        let plan = &self.plan;
        let profiles = &plan.snapshot.set.profiles;
        telemetry::fallback(&profiles[from].id, &profiles[to].id, reason.as_str());
        let ruled_out = match reason {
            FallbackReason::Quality => plan.decision.no_better_than(from),
            FallbackReason::Error | FallbackReason::Context => vec![from],
        };
        let mut rerun = self.across_tiers(to, (attempts, ruled_out)).await?;
        rerun.fallback = Some(Fallback {
            from,
            to: rerun.profile,
            reason,
        });
        Ok(rerun)
    }

    /// Step 4: a continuation of a stream that broke on `endpoint` of `profile` after
    /// `attempts`: another endpoint of that profile first, as a retry (the budget, the
    /// backoff), then the next feasible profile; never one of `ruled_out` (those that cannot
    /// continue it), never a quality check. The request bodies are the continuation's.
    pub async fn resume(
        &self,
        (profile, endpoint): (ProfileIndex, Arc<Endpoint>),
        attempts: u32,
        ruled_out: Vec<ProfileIndex>,
    ) -> Result<Answer, ApiError> {
        let mut progress = Progress {
            attempts,
            retries: 0,
            retry_after: None,
            profiles_tried: ruled_out,
            failure: Failure::Nothing,
            fallback: None,
            avoid: Some(endpoint),
        };
        let start = match progress.profiles_tried.contains(&profile) {
            false => profile,
            true if self.plan.pinned => return Err(no_continuation(&self.plan, profile)),
            true => {
                progress.avoid = None;
                progress.profiles_tried.push(profile);
                next_profile(&self.plan, &progress.profiles_tried)
                    .ok_or_else(|| no_continuation(&self.plan, profile))?
            }
        };
        self.across_tiers_with(start, progress).await
    }

    /// A pinned request's whole answer, or why there is none (for the caller's log):
    /// calibration's reference question and the second opinion's rating.
    pub async fn ask(&self) -> Result<Bytes, String> {
        let answer = self.forward().await.map_err(|e| e.to_string())?;
        let status = answer.response.status();
        if !status.is_success() {
            return Err(format!("answered {status}"));
        }
        self.read_answer(answer).await.map_err(|e| e.to_string())
    }

    /// A non-streamed answer in full (bounded), for the quality check or calibration, read
    /// under the same time limits as an answer on its way to the client: the idle timeout,
    /// not just the deadline, for an upstream that goes silent after its head.
    pub async fn read_answer(&self, answer: Answer) -> Result<Bytes, ApiError> {
        let Answer {
            response,
            profile,
            held,
            sent_at,
            ..
        } = answer;
        let (_, bytes) = self.read_whole(response, held, sent_at, profile).await?;
        Ok(bytes)
    }

    /// [`Self::read_answer`] of a response from `profile`, with its head.
    async fn read_whole(
        &self,
        response: Response<UpstreamIncoming>,
        held: Option<Held>,
        sent_at: Instant,
        profile: ProfileIndex,
    ) -> Result<(http::response::Parts, Bytes), ApiError> {
        /// Far above any completion; a bigger body is not an answer.
        const LIMIT: usize = 16 * 1024 * 1024;
        let (head, incoming) = response.into_parts();
        let limits = TimeLimits {
            idle: self.config.idle_timeout,
            deadline: self.plan.deadline,
            first_output_by: sent_at + self.client.header_timeout,
        };
        let served_by = &self.plan.snapshot.runtime[profile].telemetry;
        let hook = Box::new(CountFailure(Arc::clone(served_by)));
        let reading = Reading::whole(self.plan.started);
        let body = UpstreamBody::new(incoming, held, limits, reading).on_end(hook);
        match Limited::new(body, LIMIT).collect().await {
            Ok(collected) => Ok((head, collected.to_bytes())),
            Err(e) => Err(match e.downcast_ref::<BodyError>() {
                Some(BodyError::Upstream | BodyError::Incomplete | BodyError::ErrorEvent)
                | None => ApiError::BadGateway(format!("reading the answer: {e}")),
                Some(timeout) => ApiError::Timeout(format!("reading the answer: {timeout}")),
            }),
        }
    }

    fn build(
        &self,
        profile: &str,
        endpoint: &Endpoint,
        path: &str,
        body: Bytes,
    ) -> Result<Request<Bytes>, ApiError> {
        let invalid = |error: &dyn std::fmt::Display| {
            tracing::warn!(request_id = self.plan.request_id, %error, profile,
                "invalid upstream request");
            ApiError::BadGateway(format!("profile {profile} has an invalid upstream URL"))
        };
        let uri = endpoint.uri(path).map_err(|e| invalid(&e))?;
        let mut request = Request::post(uri).body(body).map_err(|e| invalid(&e))?;
        *request.headers_mut() = self.plan.headers.clone();
        Ok(request)
    }
}

/// A whole answer read by the router itself: only a failure is counted.
struct CountFailure(Arc<ProfileTelemetry>);

impl OnEnd for CountFailure {
    fn on_end(self: Box<Self>, outcome: BodyOutcome) {
        if let Some(failure) = outcome.end.failure {
            telemetry::upstream_error(self.0.id(), failure.kind());
        }
    }
}

/// No profile may continue a stream that broke on `profile`.
fn no_continuation(plan: &Plan<'_>, profile: ProfileIndex) -> ApiError {
    let id = &plan.snapshot.set.profiles[profile].id;
    ApiError::Unavailable(format!(
        "no profile can continue the stream of profile {id}"
    ))
}

/// The next profile after `tried`, by the decision's fallback order, that can take a
/// request now.
fn next_profile(plan: &Plan<'_>, tried: &[ProfileIndex]) -> Option<ProfileIndex> {
    let now = Instant::now();
    let mut tried = tried.to_vec();
    while let Some(next) = plan.decision.next_after_error(&tried) {
        if plan.snapshot.runtime[next].pool.available(now) {
            return Some(next);
        }
        tried.push(next);
    }
    None
}

/// After a context overflow on `current`: the untried feasible profile with a larger
/// context and the highest utility that can take a request now.
fn next_with_larger_context(
    plan: &Plan<'_>,
    tried: &[ProfileIndex],
    current: ProfileIndex,
) -> Option<ProfileIndex> {
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
                && plan.snapshot.runtime[c.profile].pool.available(now)
        })
        .max_by(|a, b| a.utility.total_cmp(&b.utility))
        .map(|c| c.profile)
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

#[cfg(test)]
mod tests;
