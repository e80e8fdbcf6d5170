//! The leaf of the public stack ([`super::stack`]): the endpoints, and a generation request
//! in named phases, top-down in [`proxy`].

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use opentelemetry::KeyValue;
use quantrouter_policy::limits::Reservation;
use quantrouter_policy::{ProfileIndex, Reason, RoutingDecision};
use serde::Deserialize;
use tokio::time::Instant;

use super::agents;
use super::bookkeeping::Ledger;
use super::context::RequestId;
use super::context::{Detached, Received, RequestCtx};
use super::delivery::{ColdAnswer, Relayed};
use super::{App, ResponseBody, REQUEST_ID};
use crate::apis::{AgentApi, Translation};
use crate::calibration::{self, Sample};
use crate::openai::{self, ApiError, BodyEdits, Endpoint, ParsedRequest};
use crate::profiles::Snapshot;
use crate::resilience::resume::{self, ResumeRequest};
use crate::resilience::retry::{Answer, Fallback, FallbackReason, Forwarder, Outgoing, Plan};
use crate::routing::{self, RouteInput, Routed, AUTO_MODEL};
use crate::second_opinion::Rated;
use crate::telemetry::{self, RequestLabels};
use crate::tenants::{ActiveTenant, Grant};
use crate::traces::RequestTrace;
use crate::upstream::body::Resumable;
use crate::upstream::keepalive::KeepAlive;
use crate::upstream::{is_event_stream, sse, Reading, TimeLimits, UpstreamBody};

/// The leaf: which endpoint a request is for.
pub async fn endpoints(
    app: Arc<App>,
    req: Request<Incoming>,
) -> Result<Response<ResponseBody>, ApiError> {
    match (req.method(), req.uri().path()) {
        (&Method::POST, "/v1/chat/completions") => proxy(&app, req, Endpoint::Chat).await,
        (&Method::POST, "/v1/completions") => proxy(&app, req, Endpoint::Completions).await,
        (&Method::POST, "/v1/messages") => agents::create(&app, req, AgentApi::Messages).await,
        (&Method::POST, "/v1/messages/count_tokens") => agents::count_tokens(&app, req).await,
        (&Method::POST, "/v1/responses") => agents::create(&app, req, AgentApi::Responses).await,
        (&Method::GET | &Method::DELETE, path) if agents::stored_id(path).is_some() => {
            agents::stored(&app, req).await
        }
        (&Method::GET, "/v1/models") => models(&app, req.headers()),
        (&Method::POST, "/v1/route") => dry_run(&app, req).await,
        (
            _,
            "/v1/chat/completions"
            | "/v1/completions"
            | "/v1/messages"
            | "/v1/messages/count_tokens"
            | "/v1/responses"
            | "/v1/models"
            | "/v1/route",
        ) => Err(ApiError::MethodNotAllowed),
        (_, path) => Err(ApiError::RouteNotFound(path.to_owned())),
    }
}

/// A generation request, phase by phase.
pub(super) async fn proxy(
    app: &Arc<App>,
    req: Request<Incoming>,
    endpoint: Endpoint,
) -> Result<Response<ResponseBody>, ApiError> {
    let started = Instant::now();
    let (parts, body) = req.into_parts();
    // Auth: only known keys spend upstream capacity.
    let tenant = app.authenticate(&parts.headers)?;
    // Body limit and parse: read what routing needs, refuse what no upstream would take.
    let body = read_json_body(app, body, &parts.headers).await?;
    let mut received = Received {
        parts,
        body,
        endpoint,
        started,
    };
    let parsed = ParsedRequest::parse(&received.body, endpoint)?;
    // A Responses follow-up goes where the response it continues is stored.
    if let Some(previous) = &parsed.previous_response_id {
        let owner = tenant.as_deref().map(|t| &*t.id);
        agents::place_follow_up(app, &mut received.parts.headers, previous, owner).await?;
    }
    let mut ctx = RequestCtx::new(&received, parsed, app.store.load());
    // Tenant limits: refused at a hard limit, routed cheaper past a soft one.
    ctx.grant = admit_tenant(app, tenant, &ctx.parsed, &ctx.snapshot).await?;
    // Route: the policy's decision, with the request's and the tenant's overrides, and a
    // cheap tier's rating when the risk is uncertain (`policy.second_opinion`).
    let rated = Rated {
        snapshot: &ctx.snapshot,
        parsed: &ctx.parsed,
        headers: ctx.headers(),
        tenant: ctx.grant.as_ref().map(|g| &*g.tenant),
    };
    let rating = crate::second_opinion::consult(app, rated).await;
    let routed = route(app, &mut ctx, rating)?;
    // Cold wait: a tier scaling from zero gets its first endpoint, or the request fails. A
    // stream answers at once and waits in its body, with keep-alives.
    if ctx.parsed.stream && routed.wait_for.is_some() {
        let detached = ctx.detach();
        return Ok(cold_stream(app, received, detached, routed));
    }
    wait_for_cold_tier(&ctx, &routed).await?;
    // Forward, then respond: the router's headers and the answer's bookkeeping.
    let answer = forward(app, &ctx, &routed).await?;
    let response = respond(app, &mut ctx, &routed, answer);
    Ok(response.map(|body| Either::Right(body.into())))
}

/// The tenant's limits, before routing: one counter round trip at most. The request
/// reserves its worst case — the prompt's estimate (a quarter of its bytes) plus
/// `max_tokens` for each of its `n` choices, at the dearest profile the tenant may be served
/// by — settled to what it used when the answer ends.
pub(crate) async fn admit_tenant(
    app: &App,
    tenant: Option<Arc<ActiveTenant>>,
    parsed: &ParsedRequest<'_>,
    snapshot: &Snapshot,
) -> Result<Option<Grant>, ApiError> {
    let (Some(tenants), Some(tenant)) = (&app.tenants, tenant) else {
        return Ok(None);
    };
    let bytes: usize = parsed.prompt().segments.iter().map(|s| s.text.len()).sum();
    let prompt = u64::try_from(bytes.div_ceil(4)).unwrap_or(u64::MAX);
    // A tenant without limits reserves nothing: no need to price the request.
    let reserved = match tenant.quota.is_limited() {
        true => {
            let allowed = tenant.allowed_profiles.as_deref();
            let may_serve = snapshot
                .set
                .profiles
                .iter()
                .filter(|p| p.enabled && allowed.is_none_or(|ids| ids.contains(&p.id)));
            let max_tokens = parsed.max_tokens.map(u64::from);
            let choices = u64::from(parsed.choices);
            Reservation::worst_case(prompt, max_tokens, choices, may_serve)
        }
        false => Reservation::default(),
    };
    Ok(Some(tenants.admit(tenant, prompt, reserved).await?))
}

/// The policy's decision for the request (with a second opinion's rating, if one was
/// asked), and its deadline; KEDA hears of the tiers it wants.
fn route(
    app: &App,
    ctx: &mut RequestCtx<'_>,
    rating: Option<quantrouter_policy::Rating>,
) -> Result<Routed, ApiError> {
    let snapshot = &ctx.snapshot;
    let headers = ctx.headers();
    let id = ctx.request_id();
    let classifier = app.config.classifier.load();
    let input = RouteInput {
        classifier: classifier.model.as_ref(),
        headers,
        aliases: &app.config.aliases,
        request_key: id.to_str().unwrap_or_default(),
        tenant: ctx.grant.as_ref().map(|g| (&*g.tenant, g.downgraded)),
        among: None,
        rating,
    };
    let mut routed = routing::route(snapshot, &ctx.parsed, input)?;
    app.sessions.settle(snapshot, &mut routed, true);
    app.keda.on_route(snapshot, routed.decision.profile);
    if let Some(cold) = routed.cold_preferred {
        app.keda.on_route(snapshot, cold);
    }
    let resilience = &app.config.resilience;
    let timeout = routing::timeout(headers)?.unwrap_or(resilience.default_deadline);
    ctx.deadline = ctx.received.started + timeout;
    Ok(routed)
}

/// Scale from zero: waits (counted in the tier's queue depth, which activates KEDA) for the
/// preferred tier's first endpoint, within the deadline.
async fn wait_for_cold_tier(ctx: &RequestCtx<'_>, routed: &Routed) -> Result<(), ApiError> {
    let Some((cold, timeout)) = routed.wait_for else {
        return Ok(());
    };
    let timeout = timeout.min(ctx.deadline.saturating_duration_since(Instant::now()));
    if ctx.snapshot.runtime[cold]
        .pool
        .wait_for_endpoints(timeout)
        .await
    {
        return Ok(());
    }
    let id = &ctx.snapshot.set.profiles[cold].id;
    Err(ApiError::Unavailable(format!(
        "profile {id} is scaled to zero and got no endpoint within {timeout:?}"
    )))
}

/// Forward: per-tier admission, attempts, retries and fallbacks ([`Forwarder`]), with each
/// profile's body native or translated to chat.
async fn forward(app: &App, ctx: &RequestCtx<'_>, routed: &Routed) -> Result<Answer, ApiError> {
    let Received { body, endpoint, .. } = ctx.received;
    let (snapshot, parsed) = (&*ctx.snapshot, &ctx.parsed);
    let id = ctx.request_id();
    let trace = ctx.trace();
    let decision = &routed.decision;
    DecisionLog {
        snapshot,
        decision,
        parsed,
        request_id: id.to_str().unwrap_or_default(),
    }
    .record(app, trace);
    let headers = upstream_headers(ctx.headers(), &id);
    // An agent API goes natively where the upstream serves it, translated to chat elsewhere.
    let translation = Translation::prepare(*endpoint, body, &snapshot.set, decision.profile)?;
    Translation::report(translation.as_ref(), &ctx.received.parts.extensions);
    let native_only = translation.as_ref().is_some_and(Translation::native_only);
    let plan = Plan {
        snapshot,
        decision,
        pinned: decision.reason == Reason::Pinned || native_only,
        stream: parsed.stream,
        wants_json: parsed.wants_json,
        headers: &headers,
        started: ctx.received.started,
        deadline: ctx.deadline,
        trace,
        request_id: id.to_str().unwrap_or_default(),
        priority: ctx.grant.as_ref().map_or(0, |g| g.tenant.priority),
        placement: &routed.placement,
    };
    let salt = routed.cache_salt.as_deref();
    let body_for = |profile: ProfileIndex| {
        let model_json = &snapshot.runtime[profile].model_json;
        // `policy.output_ceiling`: a limit the profile's context cannot hold is lowered.
        let edits = BodyEdits {
            ceiling: routing::output_ceiling(snapshot, decision, parsed, profile),
            cache_salt: salt,
        };
        let chat = translation
            .as_ref()
            .and_then(|t| t.chat_body(&snapshot.set, profile, model_json, edits));
        match chat {
            Some(body) => Outgoing {
                path: Endpoint::Chat.path(),
                body,
            },
            None => Outgoing {
                path: endpoint.path(),
                body: parsed.upstream_body(body, model_json, edits),
            },
        }
    };
    telemetry::routed(decision.complexity, ctx.received.started.elapsed());
    let forwarder = Forwarder::new(&app.client, &app.config.resilience, plan, &body_for);
    forwarder.forward().await
}

/// The upstream's response head, with the router's headers, and its body, which books the
/// request ([`Ledger`]) when it ends: one path for streamed and whole answers.
fn respond(
    app: &App,
    ctx: &mut RequestCtx<'_>,
    routed: &Routed,
    answer: Answer,
) -> Response<UpstreamBody> {
    let snapshot = &*ctx.snapshot;
    let decision = &routed.decision;
    let served = Served::of(&answer);
    let labels = served.labels(snapshot, decision);
    let resumable = resumable(app, ctx, routed, &answer);
    let Answer {
        response,
        held,
        sent_at,
        ..
    } = answer;
    let status = response.status();
    telemetry::response_headers(&labels, status.as_u16());
    let (mut head, incoming) = response.into_parts();
    if resumable.is_some() {
        // A continuation makes the stream longer than the upstream's length says.
        head.headers.remove(header::CONTENT_LENGTH);
    }
    let sse = is_event_stream(&head.headers);
    if !sse {
        // Not a stream: the first token comes with the head (vLLM, and any server that
        // answers whole). A stream reports its first output event through the ledger.
        telemetry::first_token(&labels, ctx.received.started.elapsed());
    }
    finish_head(&mut head, snapshot, decision, &served);
    if let Some(grant) = &ctx.grant {
        crate::tenants::gate::insert_rate_headers(&mut head.headers, &grant.rate);
    }
    let affinity = routed.affinity_used();
    head.headers
        .insert(AFFINITY_HEADER, HeaderValue::from_static(affinity.as_str()));
    let sample =
        sample_for_calibration(app, ctx, routed, served.profile).filter(|_| status.is_success());
    let attributes = match ctx.trace() {
        Some(_) => span_attributes(snapshot, &served, status, &ctx.parsed),
        None => Vec::new(),
    };
    let ledger = Ledger::new(snapshot, served.profile, labels, routed.prompt)
        .traced(ctx.trace(), attributes)
        .charging(
            app.tenants.as_ref(),
            ctx.grant.take(),
            status.is_success(),
            sse,
        )
        .sampled(sample);
    let limits = TimeLimits {
        idle: app.config.resilience.idle_timeout,
        deadline: ctx.deadline,
        // From the send, not from now: a stream start the check held replays at once, and
        // the upstream's first output had the whole header timeout either way.
        first_output_by: sent_at + app.client.header_timeout,
    };
    let reading = Reading {
        started: ctx.received.started,
        sse,
        strip_usage: ctx.parsed.adds_usage(),
    };
    let copy = ledger.wants_answer();
    let body = UpstreamBody::new(incoming, held, limits, reading)
        .on_end(Box::new(ledger))
        .resuming(resumable);
    let body = match copy {
        true => body.copy_answer(calibration::MAX_ANSWER),
        false => body,
    };
    Response::from_parts(head, body)
}

/// A stream that goes on elsewhere when its upstream breaks (`policy.stream_resume`).
fn resumable(
    app: &App,
    ctx: &RequestCtx<'_>,
    routed: &Routed,
    answer: &Answer,
) -> Option<Resumable> {
    let (parsed, received) = (&ctx.parsed, ctx.received);
    let set = &ctx.snapshot.set;
    if !parsed.stream || !resume::eligible(set, received.endpoint, parsed.choices, answer) {
        return None;
    }
    let id = ctx.request_id();
    let request = ResumeRequest {
        client: app.client.clone(),
        config: app.config.resilience,
        snapshot: Arc::clone(&ctx.snapshot),
        decision: routed.decision.clone(),
        pinned: routed.decision.reason == Reason::Pinned,
        headers: upstream_headers(ctx.headers(), &id),
        started: received.started,
        deadline: ctx.deadline,
        trace: ctx.trace().cloned(),
        request_id: id.to_str().unwrap_or_default().to_owned(),
        priority: ctx.grant.as_ref().map_or(0, |g| g.tenant.priority),
        blocks: routed.placement.blocks.clone(),
        body: received.body.clone(),
        api: received.endpoint,
        adds_usage: parsed.adds_usage(),
        ceilings: (0..set.profiles.len())
            .map(|p| {
                routing::output_ceiling(
                    &ctx.snapshot,
                    &routed.decision,
                    parsed,
                    ProfileIndex::new(p),
                )
            })
            .collect(),
        cache_salt: routed.cache_salt.clone(),
    };
    Some(request.into_resumable(answer))
}

/// `policy.calibration`: a non-streamed request answered by another profile than the
/// reference, in the sample (the router's own draw), is asked of the reference too. Every
/// such request counts towards the limit on that extra load, sampled or not.
fn sample_for_calibration(
    app: &App,
    ctx: &RequestCtx<'_>,
    routed: &Routed,
    served: ProfileIndex,
) -> Option<Sample> {
    let decision = &routed.decision;
    let (snapshot, parsed, received) = (&ctx.snapshot, &ctx.parsed, ctx.received);
    let policy = snapshot.set.policy.calibration.as_ref()?;
    let reference = snapshot.set.index_of(&policy.reference_profile)?;
    // An agent API's answer is not a chat answer to compare.
    if parsed.stream || served == reference || AgentApi::of(received.endpoint).is_some() {
        return None;
    }
    if !app.calibrator.sample(policy.sample_rate) {
        return None;
    }
    // A call asked again may act again; such a request is not sent twice.
    if parsed.offers_tools {
        app.calibrator.not_comparable();
        return None;
    }
    let id = ctx.request_id();
    let key = id.to_str().unwrap_or_default();
    Some(Sample {
        calibrator: Arc::clone(&app.calibrator),
        client: app.client.clone(),
        config: app.config.resilience,
        snapshot: Arc::clone(snapshot),
        policy: policy.clone(),
        decision: decision.clone(),
        served,
        reference,
        wants_json: parsed.wants_json,
        max_tokens: parsed.max_tokens,
        choices: parsed.choices,
        path: received.endpoint.path(),
        headers: upstream_headers(&received.parts.headers, &id),
        body: parsed.upstream_body(
            &received.body,
            &snapshot.runtime[reference].model_json,
            BodyEdits {
                cache_salt: routed.cache_salt.as_deref(),
                ..BodyEdits::default()
            },
        ),
        request_id: key.to_owned(),
    })
}

/// Says whether the conversation's profile or the prompt's cached prefix decided.
const AFFINITY_HEADER: HeaderName = HeaderName::from_static("x-quantrouter-affinity");

/// How often a stream waiting for a cold tier gets a keep-alive comment: well inside the
/// idle timeouts of proxies and clients (60 s is common, some use 10 to 30 s).
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);

/// A stream that waits for a tier scaling from zero: the head goes out at once with the
/// decision's headers, keep-alive comments hold the connection while the tier starts, then
/// the upstream's stream follows (or an error event, as for any failure after the head).
fn cold_stream(
    app: &Arc<App>,
    received: Received,
    detached: Detached,
    routed: Routed,
) -> Response<ResponseBody> {
    let (mut head, ()) = Response::new(()).into_parts();
    let sse = [
        (header::CONTENT_TYPE, "text/event-stream"),
        (header::CACHE_CONTROL, "no-cache"),
    ];
    for (name, value) in sse {
        head.headers.insert(name, HeaderValue::from_static(value));
    }
    let served = Served {
        profile: routed.decision.profile,
        attempts: 0,
        fallback: None,
    };
    let deadline = detached.deadline();
    finish_head(&mut head, detached.snapshot(), &routed.decision, &served);
    let affinity = HeaderValue::from_static(routed.affinity.as_str());
    head.headers.insert(AFFINITY_HEADER, affinity);
    // Not known when the head goes out; the stream itself is the answer.
    head.headers.remove("x-quantrouter-attempts");
    if let Some(grant) = detached.grant() {
        crate::tenants::gate::insert_rate_headers(&mut head.headers, &grant.rate);
    }
    let app = Arc::clone(app);
    // The watchdog sees a body polled by each comment: keep them inside the idle timeout.
    let interval = KEEPALIVE_INTERVAL.min(app.config.resilience.idle_timeout / 2);
    let answer: ColdAnswer = Box::pin(async move {
        let answered = async {
            let mut ctx = RequestCtx::attach(&received, detached)?;
            wait_for_cold_tier(&ctx, &routed).await?;
            let answer = forward(&app, &ctx, &routed).await?;
            Ok(respond(&app, &mut ctx, &routed, answer))
        };
        match answered.await {
            Ok(response) => streamed_body(response).await,
            Err(error) => Err(error_event(&error, &received.parts, app.config.log_prompts)),
        }
    });
    let body = Relayed::ColdStart {
        body: KeepAlive::new(answer, interval),
        deadline,
    };
    Response::from_parts(head, Either::Right(body))
}

/// The upstream's stream, or, when it answered otherwise (an error status, or a whole
/// answer to a stream request), an error event carrying its error when it sent one.
async fn streamed_body(response: Response<UpstreamBody>) -> Result<UpstreamBody, Bytes> {
    /// An error answer is small; a bigger body is not one worth relaying.
    const MAX_ERROR: usize = 64 * 1024;
    let (head, body) = response.into_parts();
    if head.status.is_success() && is_event_stream(&head.headers) {
        return Ok(body);
    }
    let read = Limited::new(body, MAX_ERROR).collect().await;
    let relayed = read.ok().map(|c| c.to_bytes()).filter(|bytes| {
        serde_json::from_slice::<serde_json::Value>(bytes).is_ok_and(|v| v.get("error").is_some())
    });
    let data = relayed.unwrap_or_else(|| {
        let message = format!("the upstream answered {} without a stream", head.status);
        let error = openai::error_body(&message, "upstream_error", None, Some("bad_gateway"));
        Bytes::from(error.to_string())
    });
    Err(sse::data_event(&data))
}

/// The error event a cold-start stream ends with, counted and traced as the rescue and
/// trace layers do for an error answered with a status.
fn error_event(error: &ApiError, parts: &http::request::Parts, log_prompts: bool) -> Bytes {
    let (kind, code) = error.kind();
    telemetry::router_error(code);
    // What a client sent can be quoted in the message, prompt text included.
    let quoted = error.quotes_request() && !log_prompts;
    if let Some(trace) = parts.extensions.get::<RequestTrace>() {
        let message = match quoted {
            true => code.to_owned(),
            false => error.to_string(),
        };
        trace.fail(error.status().as_u16(), message);
    }
    let body = openai::error_body(&error.to_string(), kind, None, Some(code));
    sse::data_event(body.to_string().as_bytes())
}

/// A routing decision, as the log and the trace record it.
pub(crate) struct DecisionLog<'a> {
    pub snapshot: &'a Snapshot,
    pub decision: &'a RoutingDecision,
    pub parsed: &'a ParsedRequest<'a>,
    pub request_id: &'a str,
}

impl DecisionLog<'_> {
    /// The decision in the log (with the prompt only under `--log-prompts`) and the trace.
    pub(crate) fn record(self, app: &App, trace: Option<&RequestTrace>) {
        let Self {
            snapshot,
            decision,
            parsed,
            request_id,
        } = self;
        let chosen = &snapshot.set.profiles[decision.profile];
        if app.config.log_prompts {
            let prompt: Vec<&str> = parsed.prompt().segments.iter().map(|s| s.text).collect();
            tracing::info!(request_id, profile = %chosen.id, reason = decision.reason.as_str(),
            complexity = decision.complexity, prompt = %prompt.join("\n"), "routed");
        } else {
            tracing::debug!(profile = %chosen.id, reason = decision.reason.as_str(),
            complexity = decision.complexity, "routed");
        }
        if let Some(trace) = trace {
            trace.record(
                "route",
                vec![
                    KeyValue::new("quantrouter.profile", chosen.id.clone()),
                    KeyValue::new("quantrouter.tier", chosen.tier.clone()),
                    KeyValue::new("quantrouter.reason", decision.reason.as_str()),
                    KeyValue::new("quantrouter.complexity", decision.complexity),
                    KeyValue::new(
                        "quantrouter.task_class",
                        format!("{:?}", decision.task_class),
                    ),
                ],
            );
        }
    }
}

/// The content type checked, then the body read within its limits.
pub(super) async fn read_json_body(
    app: &App,
    body: Incoming,
    headers: &HeaderMap,
) -> Result<Bytes, ApiError> {
    check_content_type(headers)?;
    read_body(app, body, headers).await
}

const HOP_BY_HOP: [HeaderName; 6] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::TRAILER,
];
/// Client headers worth passing to vLLM; everything else (API keys above all) stays here.
const FORWARDED: [HeaderName; 5] = [
    header::ACCEPT,
    header::USER_AGENT,
    HeaderName::from_static("traceparent"),
    HeaderName::from_static("tracestate"),
    HeaderName::from_static("openai-organization"),
];

/// How a request was served, for the response headers and metric labels.
#[derive(Debug)]
struct Served {
    profile: ProfileIndex,
    attempts: u32,
    fallback: Option<Fallback>,
}

impl Served {
    fn of(answer: &Answer) -> Self {
        Self {
            profile: answer.profile,
            attempts: answer.attempts,
            fallback: answer.fallback,
        }
    }

    fn reason(&self, decision: &RoutingDecision) -> Reason {
        match self.fallback {
            Some(Fallback {
                reason: FallbackReason::Quality,
                ..
            }) => Reason::FallbackQuality,
            Some(_) => Reason::FallbackError,
            None => decision.reason,
        }
    }

    fn labels(&self, snapshot: &Snapshot, decision: &RoutingDecision) -> RequestLabels {
        RequestLabels {
            profile: Arc::clone(&snapshot.runtime[self.profile].telemetry),
            reason: self.reason(decision),
        }
    }
}

/// Attributes of a finished request span (HTTP and `gen_ai.*` conventions).
fn span_attributes(
    snapshot: &Snapshot,
    served: &Served,
    status: StatusCode,
    parsed: &ParsedRequest<'_>,
) -> Vec<KeyValue> {
    let profile = &snapshot.set.profiles[served.profile];
    vec![
        KeyValue::new("http.response.status_code", i64::from(status.as_u16())),
        KeyValue::new("gen_ai.request.model", parsed.model.to_string()),
        KeyValue::new("gen_ai.response.model", profile.model.clone()),
        KeyValue::new("quantrouter.profile", profile.id.clone()),
        KeyValue::new("quantrouter.tier", profile.tier.clone()),
        KeyValue::new("quantrouter.attempts", i64::from(served.attempts)),
    ]
}

/// Drops hop-by-hop headers and adds the `x-quantrouter-*` ones.
fn finish_head(
    head: &mut http::response::Parts,
    snapshot: &Snapshot,
    decision: &RoutingDecision,
    served: &Served,
) {
    const PROFILE: HeaderName = HeaderName::from_static("x-quantrouter-profile");
    const TIER: HeaderName = HeaderName::from_static("x-quantrouter-tier");
    const REASON: HeaderName = HeaderName::from_static("x-quantrouter-reason");
    const ATTEMPTS: HeaderName = HeaderName::from_static("x-quantrouter-attempts");
    const COMPLEXITY: HeaderName = HeaderName::from_static("x-quantrouter-complexity");
    let headers = &mut head.headers;
    // Looked for before removal: a removal hashes the name, a look at the few names an
    // upstream sends compares them.
    if headers.keys().any(|name| HOP_BY_HOP.contains(name)) {
        // Headers the upstream's `Connection` names are hop-by-hop too (RFC 9110 §7.6.1).
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
            .collect();
        for name in HOP_BY_HOP.iter().chain(&named) {
            headers.remove(name);
        }
    }
    let telemetry = &snapshot.runtime[served.profile].telemetry;
    let values = [
        (PROFILE, telemetry.profile_header.clone()),
        (TIER, telemetry.tier_header.clone()),
        (
            REASON,
            Some(HeaderValue::from_static(served.reason(decision).as_str())),
        ),
        (ATTEMPTS, Some(attempts_header(served.attempts))),
        (COMPLEXITY, complexity_header(decision.complexity)),
    ];
    for (name, value) in values {
        if let Some(value) = value {
            headers.insert(name, value);
        }
    }
    if let Some(v) = crate::second_opinion::header(decision) {
        headers.insert(crate::second_opinion::HEADER, v);
    }
    if let Some(f) = served.fallback {
        let value = format!(
            "from={}; to={}; reason={}",
            snapshot.set.profiles[f.from].id,
            snapshot.set.profiles[f.to].id,
            f.reason.as_str()
        );
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(HeaderName::from_static("x-quantrouter-fallback"), v);
        }
    }
}

/// `x-quantrouter-attempts`: a static value for the usual few attempts.
fn attempts_header(attempts: u32) -> HeaderValue {
    const SMALL: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
    match SMALL.get(attempts as usize) {
        Some(s) => HeaderValue::from_static(s),
        None => HeaderValue::from(attempts),
    }
}

/// `x-quantrouter-complexity`: the score with three decimals, exactly as `{:.3}` writes it.
/// A score in [0, 1] not within a hair of a rounding tie is written directly; the
/// formatter's exact decimal expansion cost ~1,000 instructions per request.
pub(super) fn complexity_header(score: f64) -> Option<HeaderValue> {
    let scaled = score * 1000.0;
    let near_tie = (scaled - scaled.floor() - 0.5).abs() < 1e-6;
    if near_tie || !(0.0..=1.0).contains(&score) || score.is_sign_negative() {
        return HeaderValue::from_str(&format!("{score:.3}")).ok();
    }
    // In 0..=1000 by the check above.
    let milli = scaled.round() as u32;
    let digit = |n: u32| b'0' + (n % 10) as u8;
    let text = [
        digit(milli / 1000),
        b'.',
        digit(milli / 100),
        digit(milli / 10),
        digit(milli),
    ];
    HeaderValue::from_bytes(&text).ok()
}

/// Headers for every upstream attempt: JSON content type, the client headers worth
/// forwarding, and the request id.
fn upstream_headers(client: &HeaderMap, request_id: &HeaderValue) -> HeaderMap {
    let mut headers = HeaderMap::with_capacity(FORWARDED.len() + 2);
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    for name in &FORWARDED {
        if let Some(v) = client.get(name) {
            headers.insert(name.clone(), v.clone());
        }
    }
    headers.insert(REQUEST_ID, request_id.clone());
    headers
}

pub(crate) fn check_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let essence = value
        .to_str()
        .unwrap_or_default()
        .split(';')
        .next()
        .unwrap_or_default()
        .trim();
    if essence.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else {
        Err(ApiError::UnsupportedMediaType)
    }
}

/// Reads the whole body within the client body timeout, refusing more than the body limit
/// (early, from Content-Length, when the client declares it).
async fn read_body(app: &App, body: Incoming, headers: &HeaderMap) -> Result<Bytes, ApiError> {
    let limit = app.config.body_limit;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::PayloadTooLarge { limit });
    }
    let timeout = app.config.client_body_timeout;
    let read = tokio::time::timeout(timeout, Limited::new(body, limit).collect());
    let Ok(read) = read.await else {
        // Unread, the rest of the body makes hyper close the connection after the answer.
        return Err(ApiError::InvalidRequest {
            message: format!("the request body did not arrive within {timeout:?}"),
            param: None,
        });
    };
    match read {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(ApiError::PayloadTooLarge { limit })
        }
        Err(e) => Err(ApiError::InvalidRequest {
            message: format!("failed to read the request body: {e}"),
            param: None,
        }),
    }
}

fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<ResponseBody> {
    let mut response = Response::new(Either::Left(Full::new(Bytes::from(value.to_string()))));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// `GET /v1/models`: `auto`, the aliases and every enabled profile id.
fn models(app: &App, headers: &HeaderMap) -> Result<Response<ResponseBody>, ApiError> {
    app.authenticate(headers)?;
    let snapshot = app.store.load();
    let entry = |id: &str| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "quantrouter"});
    let data: Vec<serde_json::Value> = std::iter::once(AUTO_MODEL)
        .chain(app.config.aliases.iter().map(String::as_str))
        .chain(
            snapshot
                .set
                .profiles
                .iter()
                .filter(|p| p.enabled)
                .map(|p| p.id.as_str()),
        )
        .map(entry)
        .collect();
    Ok(json_response(
        StatusCode::OK,
        &serde_json::json!({"object": "list", "data": data}),
    ))
}

/// `POST /v1/route`: the decision for a chat or completion body, with every candidate.
async fn dry_run(app: &App, req: Request<Incoming>) -> Result<Response<ResponseBody>, ApiError> {
    #[derive(Deserialize)]
    struct Shape {
        #[serde(default)]
        messages: Option<serde::de::IgnoredAny>,
    }
    let (parts, body) = req.into_parts();
    let tenant = app.authenticate(&parts.headers)?;
    let body = read_json_body(app, body, &parts.headers).await?;
    let started = Instant::now();
    let endpoint = match serde_json::from_slice::<Shape>(&body) {
        Ok(Shape { messages: None }) => Endpoint::Completions,
        _ => Endpoint::Chat,
    };
    let parsed = ParsedRequest::parse(&body, endpoint)?;
    let snapshot = app.store.load();
    let classifier = app.config.classifier.load();
    let model = classifier.model.as_ref();
    let id = RequestId::of(&parts);
    let key = id.to_str().unwrap_or_default();
    let rated = Rated {
        snapshot: &snapshot,
        parsed: &parsed,
        headers: &parts.headers,
        tenant: tenant.as_deref(),
    };
    let rating = crate::second_opinion::consult(app, rated).await;
    let input = RouteInput {
        classifier: model,
        headers: &parts.headers,
        aliases: &app.config.aliases,
        request_key: key,
        tenant: tenant.as_deref().map(|t| (t, false)),
        among: None,
        rating,
    };
    let mut routed = routing::route(&snapshot, &parsed, input)?;
    // A dry run reads the conversation's memory but adds no turn to it.
    app.sessions.settle(&snapshot, &mut routed, false);
    let decision_us = started.elapsed().as_secs_f64() * 1e6;
    let prompt = parsed.prompt();
    let top = model.map_or_else(Vec::new, |m| {
        routing::top_features(&snapshot.set, m, &prompt)
    });
    let classification = routed.classification.as_ref();
    let mut explain = routing::explain(&snapshot.set, &routed.decision, classification, &top);
    explain["decision_us"] = decision_us.into();
    explain["affinity"] = routed.affinity.as_str().into();
    Ok(json_response(StatusCode::OK, &explain))
}
