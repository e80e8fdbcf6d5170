//! The leaf of the public stack ([`super::stack`]): the endpoints, and a generation request
//! in named phases, top-down in [`proxy`].

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use quantrouter_policy::{ProfileIndex, Reason};
use serde::Deserialize;
use tokio::time::Instant;

use super::agents;
use super::delivery::{ColdAnswer, Relayed};
use super::{App, ResponseBody};
use crate::apis::{AgentApi, Translation};
use crate::calibration;
use crate::openai::{self, ApiError, Endpoint, ParsedRequest};
use crate::pipeline::{self, AnswerHead, Arrival, Door, Received, RequestCtx, RequestId, Served};
use crate::resilience::resume::{self, ResumeRequest};
use crate::resilience::retry::{Answer, Forwarder, Outgoing, Plan};
use crate::routing::{self, RouteInput, AUTO_MODEL};
use crate::second_opinion::Rated;
use crate::telemetry;
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

/// A generation request through the HTTP door: the pipeline from authentication to the
/// routed request ([`pipeline::route`], which reads the body here only for a known key),
/// then forward and respond.
pub(super) async fn proxy(
    app: &Arc<App>,
    req: Request<Incoming>,
    endpoint: Endpoint,
) -> Result<Response<ResponseBody>, ApiError> {
    let started = Instant::now();
    let (parts, body) = req.into_parts();
    let declared = content_length(&parts.headers);
    let arrival = Arrival {
        parts,
        endpoint,
        started,
        body: |_: Option<&_>| read_body(app, body, declared),
        door: Door {
            translates: true,
            streams_while_cold: true,
            subset: None,
            strips_usage: true,
        },
    };
    let mut ctx = pipeline::route(app, arrival).await?;
    // A stream for a tier scaling from zero answers at once and waits in its body, with
    // keep-alives.
    if ctx.shape.stream && ctx.routed.wait_for.is_some() {
        return Ok(cold_stream(app, ctx));
    }
    // Forward, then respond: the router's headers and the answer's bookkeeping.
    let answer = forward(app, &ctx).await?;
    let response = respond(app, &mut ctx, answer);
    Ok(response.map(|body| Either::Right(body.into())))
}

/// Forward: per-tier admission, attempts, retries and fallbacks ([`Forwarder`]), with each
/// profile's body native or translated to chat.
async fn forward(app: &App, ctx: &RequestCtx) -> Result<Answer, ApiError> {
    let Received {
        body,
        endpoint,
        started,
        ..
    } = &ctx.received;
    let (snapshot, shape) = (&*ctx.snapshot, &ctx.shape);
    let id = ctx.request_id();
    let decision = &ctx.routed.decision;
    let headers = pipeline::upstream_headers(ctx.headers(), &id);
    // An agent API goes natively where the upstream serves it, translated to chat elsewhere.
    let translation = Translation::prepare(*endpoint, body, &snapshot.set, decision.profile)?;
    Translation::report(translation.as_ref(), &ctx.received.parts.extensions);
    let native_only = translation.as_ref().is_some_and(Translation::native_only);
    let plan = Plan {
        snapshot,
        decision,
        pinned: decision.reason == Reason::Pinned || native_only,
        stream: shape.stream,
        wants_json: shape.wants_json,
        headers: &headers,
        started: *started,
        deadline: ctx.deadline,
        trace: ctx.trace(),
        request_id: id.to_str().unwrap_or_default(),
        priority: ctx.grant.as_ref().map_or(0, |g| g.tenant.priority),
        placement: &ctx.routed.placement,
    };
    let body_for = |profile: ProfileIndex| {
        let model_json = &snapshot.runtime[profile].model_json;
        let chat = translation
            .as_ref()
            .and_then(|t| t.chat_body(&snapshot.set, profile, model_json, ctx.edits(profile)));
        match chat {
            Some(body) => Outgoing {
                path: Endpoint::Chat.path(),
                body,
            },
            None => Outgoing {
                path: endpoint.path(),
                body: ctx.upstream_body(profile),
            },
        }
    };
    telemetry::routed(decision.complexity, started.elapsed());
    let forwarder = Forwarder::new(&app.client, &app.config.resilience, plan, &body_for);
    forwarder.forward().await
}

/// The upstream's response head, with the router's headers, and its body, which books the
/// request ([`pipeline::Ledger`]) when it ends: one path for streamed and whole answers.
fn respond(app: &App, ctx: &mut RequestCtx, answer: Answer) -> Response<UpstreamBody> {
    let served = Served {
        profile: answer.profile,
        attempts: answer.attempts,
        fallback: answer.fallback,
    };
    let resumable = resumable(app, ctx, &answer);
    let Answer {
        response,
        held,
        sent_at,
        ..
    } = answer;
    let status = response.status();
    let (mut head, incoming) = response.into_parts();
    if resumable.is_some() {
        // A continuation makes the stream longer than the upstream's length says.
        head.headers.remove(header::CONTENT_LENGTH);
    }
    let sse = is_event_stream(&head.headers);
    remove_hop_by_hop(&mut head.headers);
    pipeline::router_headers(&mut head.headers, ctx, &served);
    let ledger = pipeline::ledger(app, ctx, &served, AnswerHead { status, sse });
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
        strip_usage: ctx.shape.rewrite.adds_usage(),
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
fn resumable(app: &App, ctx: &RequestCtx, answer: &Answer) -> Option<Resumable> {
    let (shape, received, routed) = (&ctx.shape, &ctx.received, &ctx.routed);
    let set = &ctx.snapshot.set;
    if !shape.stream || !resume::eligible(set, received.endpoint, shape.choices, answer) {
        return None;
    }
    let id = ctx.request_id();
    let request = ResumeRequest {
        client: app.client.clone(),
        config: app.config.resilience,
        snapshot: Arc::clone(&ctx.snapshot),
        decision: routed.decision.clone(),
        pinned: routed.decision.reason == Reason::Pinned,
        headers: pipeline::upstream_headers(ctx.headers(), &id),
        started: received.started,
        deadline: ctx.deadline,
        trace: ctx.trace().cloned(),
        request_id: id.to_str().unwrap_or_default().to_owned(),
        priority: ctx.grant.as_ref().map_or(0, |g| g.tenant.priority),
        blocks: routed.placement.blocks.clone(),
        body: received.body.clone(),
        api: received.endpoint,
        adds_usage: shape.rewrite.adds_usage(),
        ceilings: (0..set.profiles.len())
            .map(|p| shape.ceiling(ProfileIndex::new(p)))
            .collect(),
        cache_salt: routed.cache_salt.clone(),
    };
    Some(request.into_resumable(answer))
}

/// How often a stream waiting for a cold tier gets a keep-alive comment: well inside the
/// idle timeouts of proxies and clients (60 s is common, some use 10 to 30 s).
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);

/// A stream that waits for a tier scaling from zero: the head goes out at once with the
/// decision's headers, keep-alive comments hold the connection while the tier starts, then
/// the upstream's stream follows (or an error event, as for any failure after the head).
fn cold_stream(app: &Arc<App>, mut ctx: RequestCtx) -> Response<ResponseBody> {
    let (mut head, ()) = Response::new(()).into_parts();
    let sse = [
        (header::CONTENT_TYPE, "text/event-stream"),
        (header::CACHE_CONTROL, "no-cache"),
    ];
    for (name, value) in sse {
        head.headers.insert(name, HeaderValue::from_static(value));
    }
    // Attempts are not known when the head goes out; the stream itself is the answer.
    let served = Served {
        profile: ctx.routed.decision.profile,
        attempts: 0,
        fallback: None,
    };
    pipeline::router_headers(&mut head.headers, &ctx, &served);
    let deadline = ctx.deadline;
    let app = Arc::clone(app);
    // The watchdog sees a body polled by each comment: keep them inside the idle timeout.
    let interval = KEEPALIVE_INTERVAL.min(app.config.resilience.idle_timeout / 2);
    let answer: ColdAnswer = Box::pin(async move {
        let answered = async {
            pipeline::wait_for_cold_tier(&ctx).await?;
            let answer = forward(&app, &ctx).await?;
            Ok::<_, ApiError>(respond(&app, &mut ctx, answer))
        };
        let answered = answered.await;
        match answered {
            Ok(response) => streamed_body(response).await,
            Err(error) => Err(error_event(
                &error,
                &ctx.received.parts,
                app.config.log_prompts,
            )),
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

/// The content type checked, then the body read within its limits.
pub(super) async fn read_json_body(
    app: &App,
    body: Incoming,
    headers: &HeaderMap,
) -> Result<Bytes, ApiError> {
    pipeline::check_content_type(headers)?;
    read_body(app, body, content_length(headers)).await
}

const HOP_BY_HOP: [HeaderName; 6] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::TRAILER,
];

/// Drops the upstream's hop-by-hop headers.
fn remove_hop_by_hop(headers: &mut HeaderMap) {
    // Looked for before removal: a removal hashes the name, a look at the few names an
    // upstream sends compares them.
    if !headers.keys().any(|name| HOP_BY_HOP.contains(name)) {
        return;
    }
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

/// The body's length as the client declared it, if it did.
fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// Reads the whole body within the client body timeout, refusing more than the body limit
/// (early, from the length the client `declared`, if it did).
async fn read_body(app: &App, body: Incoming, declared: Option<u64>) -> Result<Bytes, ApiError> {
    let limit = app.config.body_limit;
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
    pipeline::check_content_type(&parts.headers)?;
    let body = read_body(app, body, content_length(&parts.headers)).await?;
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
