//! One ext_proc stream, in order: the request's headers and body in, through the request
//! pipeline ([`crate::pipeline`]) to a destination out; then the answer's headers and body
//! through, booked by the pipeline when it ends. Like GIE's ext_proc server, this module
//! only translates Envoy's messages; every decision is the pipeline's.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt as _;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use http_body_util::BodyExt as _;
use prost_types::{value::Kind, Struct, Value};
use quantrouter_policy::ProfileIndex;
use tokio::sync::mpsc::UnboundedSender;
use tokio::time::Instant;
use tonic::Streaming;

use super::proto::core::header_value_option::HeaderAppendAction;
use super::proto::core::{
    HeaderMap as ProtoHeaders, HeaderValue as ProtoHeader, HeaderValueOption,
};
use super::proto::envoy::r#type::v3::HttpStatus;
use super::proto::ext_proc::body_mutation::Mutation;
use super::proto::ext_proc::processing_request::Request as In;
use super::proto::ext_proc::processing_response::Response as Out;
use super::proto::ext_proc::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse,
};
use super::proto::{BodySendMode, HeaderSendMode, ProcessingMode};
use crate::app::App;
use crate::openai::{ApiError, Endpoint};
use crate::pipeline::{
    self, address, AnswerHead, Arrival, Door, Ledger, RequestCtx, RequestId, Served, StoredWatch,
    REQUEST_ID,
};
use crate::resilience::retry::{Fallback, FallbackReason};
use crate::resilience::{CircuitState, Permit};
use crate::telemetry;
use crate::tenants::ActiveTenant;
use crate::upstream::body::{reported_usage, UsageTail};
use crate::upstream::{is_event_stream, BodyEnd, EventScan, InflightGuard, Outcome, Pick};

/// Header and `envoy.lb` key: the endpoint chosen, `ip:port`.
pub const DESTINATION_ENDPOINT: &str = "x-gateway-destination-endpoint";
/// Header and `envoy.lb` key: the next tier's endpoints, `ip:port,ip:port,...`, for the
/// Gateway's retry.
pub const DESTINATION_FALLBACK: &str = "x-gateway-destination-endpoint-fallback";
/// Key in the [`SUBSET_NAMESPACE`] metadata Envoy sends: the endpoints the picker may choose.
pub const DESTINATION_SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// Key in the `envoy.lb` metadata of a response: the endpoint that served it.
pub const DESTINATION_SERVED: &str = "x-gateway-destination-endpoint-served";
/// The dynamic metadata namespace of the decision.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";

/// Anthropic's token count, which the picker answers itself.
const COUNT_TOKENS: &str = "/v1/messages/count_tokens";

/// Envoy's attribute with the address of the upstream that answered.
const UPSTREAM_ADDRESS: &str = "upstream.address";

/// Largest body chunk sent back in full-duplex mode: Envoy recommends at most 64 KiB.
const MAX_CHUNK: usize = 64 * 1024;

/// Where the picker's answers go: the stream's response side.
pub(super) type Outbound = UnboundedSender<ProcessingResponse>;

/// Serves one ext_proc stream: the request, then its answer.
pub(super) async fn serve(app: Arc<App>, inbound: Streaming<ProcessingRequest>, out: Outbound) {
    let mut envoy = Envoy {
        inbound,
        out,
        request_mode: BodySendMode::None,
        response_mode: BodySendMode::None,
        request_trailers: false,
    };
    let Some((mut ctx, endpoint)) = envoy.routed(&app).await else {
        return;
    };
    let mut picked = match Picked::pick(&app, &ctx).await {
        Ok(picked) => picked,
        Err(error) => return envoy.refuse(&app, error, Some(endpoint)),
    };
    envoy.send_destination(&ctx, &picked);
    let mut answer = Answer::default();
    while let Some(message) = envoy.next().await {
        let served = answered_by(&message);
        let reply = match message.request {
            Some(In::ResponseHeaders(head)) => {
                let head = ResponseHead {
                    message: head,
                    served,
                };
                answer.head(&app, &mut ctx, &mut picked, head)
            }
            Some(In::ResponseBody(body)) => {
                let duplex = envoy.response_mode == BodySendMode::FullDuplexStreamed;
                answer.body(body.body, body.end_of_stream, duplex)
            }
            Some(In::ResponseTrailers(_)) => {
                answer.finish(true);
                reply(Out::ResponseTrailers(TrailersResponse::default()))
            }
            _ => continue,
        };
        envoy.send(reply);
    }
    // The stream ended, with the answer or before it (Envoy gave up, the client left):
    // what was delivered is booked; the slot and the in-flight count go back with `picked`.
    answer.finish(false);
}

/// Envoy's side of one stream: its messages in, the picker's answers out, and the body
/// modes it announced.
struct Envoy {
    inbound: Streaming<ProcessingRequest>,
    out: Outbound,
    request_mode: BodySendMode,
    response_mode: BodySendMode,
    /// The request ended with trailers, which get an answer of their own.
    request_trailers: bool,
}

/// How the request's body is read.
#[derive(Debug, Clone, Copy)]
struct BodyRead {
    limit: usize,
    /// The length the client declared, if it did.
    declared: Option<u64>,
    /// The request has no body.
    none: bool,
    /// The books need the answer's body.
    reads_answer: bool,
}

/// What was chosen, held until the answer ends: the slot and the in-flight count live as
/// long as the request.
struct Picked {
    primary: String,
    /// Told how the attempt went when the answer's head comes.
    pick: Option<Pick>,
    /// The next tier and its endpoints, for the Gateway's retry.
    fallback: Option<(ProfileIndex, Vec<String>)>,
    _inflight: InflightGuard,
    _permit: Permit,
}

/// The answer as it passes, booked once when it ends.
#[derive(Default)]
struct Answer {
    ledger: Option<Ledger>,
    sse: bool,
    scan: EventScan,
    tail: UsageTail,
    /// A copy of the whole answer, when the books ask for one (calibration).
    copy: Option<BytesMut>,
    stored: Option<StoredWatch>,
    started: Option<Instant>,
}

/// An answer's head as Envoy reports it, and the endpoint that answered, if it says.
struct ResponseHead {
    message: HttpHeaders,
    served: Option<String>,
}

// === impl Envoy ===

impl Envoy {
    /// The request, from its headers through the pipeline to its decision, or `None` when
    /// it was refused (the refusal sent) or the stream ended first.
    async fn routed(&mut self, app: &Arc<App>) -> Option<(RequestCtx, Endpoint)> {
        // Envoy opens every stream with the request's headers.
        let first = self.next().await?;
        let subset = metadata(&first).and_then(subset_hint);
        let Some(In::RequestHeaders(head)) = first.request else {
            return None;
        };
        let (parts, endpoint) = match request_head(app, head.headers) {
            Ok((parts, Some(endpoint))) => (parts, endpoint),
            Ok((parts, None)) => {
                self.count_tokens(app, &parts, head.end_of_stream).await;
                return None;
            }
            Err((error, endpoint)) => {
                self.refuse(app, error, endpoint);
                return None;
            }
        };
        let door = Door {
            translates: false,
            streams_while_cold: false,
            subset,
            // Unless the answer turns out not to stream through here (below).
            strips_usage: true,
        };
        let read = BodyRead {
            limit: app.config.body_limit,
            declared: content_length(&parts.headers),
            none: head.end_of_stream,
            reads_answer: app.config.epp_reads_answers,
        };
        let (reader, books) = (&mut *self, &**app);
        let arrival = Arrival {
            parts,
            endpoint,
            started: Instant::now(),
            body: move |tenant: Option<&Arc<ActiveTenant>>| {
                // Moved, not reborrowed: the body's future keeps the stream.
                let reader = reader;
                let needed = pipeline::reads_answer(books, tenant.map(|t| &**t), endpoint);
                reader.body(BodyRead {
                    reads_answer: read.reads_answer || needed,
                    ..read
                })
            },
            door,
        };
        let mut ctx = match pipeline::route(app, arrival).await {
            Ok(ctx) => ctx,
            Err(error) => {
                self.refuse(app, error, Some(endpoint));
                return None;
            }
        };
        if self.response_mode != BodySendMode::FullDuplexStreamed {
            // Nothing can cut a usage chunk from the stream: none is asked for.
            ctx.shape.rewrite = ctx.shape.rewrite.clone().without_usage();
        }
        Some((ctx, endpoint))
    }

    /// The next message, with the body modes it announces noted.
    async fn next(&mut self) -> Option<ProcessingRequest> {
        match self.inbound.next().await? {
            Ok(message) => {
                if let Some(config) = &message.protocol_config {
                    self.request_mode = config.request_body_mode();
                    self.response_mode = config.response_body_mode();
                }
                Some(message)
            }
            Err(status) => {
                tracing::debug!(%status, "ext_proc stream ended with an error");
                None
            }
        }
    }

    fn send(&self, response: ProcessingResponse) {
        // A closed stream has no one left to tell.
        let _ = self.out.send(response);
    }

    /// The request's body, whole and within its limit: in BUFFERED mode once Envoy has the
    /// headers' answer it waits for — which asks for the answer's body too when the books
    /// need it — and in FULL_DUPLEX_STREAMED as it streams (the answer then comes as
    /// configured: Envoy takes no mode override once it streams a body both ways).
    async fn body(&mut self, read: BodyRead) -> Result<Bytes, ApiError> {
        let limit = read.limit;
        if read.declared.is_some_and(|n| n > limit as u64) {
            return Err(ApiError::PayloadTooLarge { limit });
        }
        if read.none {
            return Ok(Bytes::new());
        }
        match self.request_mode {
            BodySendMode::Buffered => {
                let mut answer = reply(Out::RequestHeaders(HeadersResponse {
                    response: Some(CommonResponse::default()),
                }));
                if read.reads_answer && self.response_mode == BodySendMode::None {
                    answer.mode_override = Some(self.reading_answers());
                    self.response_mode = BodySendMode::FullDuplexStreamed;
                }
                self.send(answer);
            }
            BodySendMode::FullDuplexStreamed => {}
            _ => {
                return Err(ApiError::BadGateway(
                    "the ext_proc filter must send the request body in BUFFERED or \
                     FULL_DUPLEX_STREAMED mode"
                        .to_owned(),
                ))
            }
        }
        let mut body = BytesMut::new();
        while let Some(message) = self.next().await {
            let (chunk, end) = match message.request {
                Some(In::RequestBody(chunk)) => (chunk.body, chunk.end_of_stream),
                Some(In::RequestTrailers(_)) => {
                    self.request_trailers = true;
                    (Bytes::new(), true)
                }
                _ => continue,
            };
            if body.len() + chunk.len() > limit {
                return Err(ApiError::PayloadTooLarge { limit });
            }
            // A body in one piece (BUFFERED, or a small one) is kept without a copy.
            if end && body.is_empty() {
                return Ok(chunk);
            }
            body.extend_from_slice(&chunk);
            if end {
                return Ok(body.freeze());
            }
        }
        Err(ApiError::InvalidRequest {
            message: "the request ended before its body".to_owned(),
            param: None,
        })
    }

    /// The processing mode for an answer whose body the books need, which Envoy otherwise
    /// sends straight to the client: it streams through here, where a usage chunk the
    /// router asked for can be cut from it. The request's body mode stays as configured.
    fn reading_answers(&self) -> ProcessingMode {
        ProcessingMode {
            request_header_mode: HeaderSendMode::Default.into(),
            response_header_mode: HeaderSendMode::Send.into(),
            request_body_mode: self.request_mode.into(),
            response_body_mode: BodySendMode::FullDuplexStreamed.into(),
            request_trailer_mode: HeaderSendMode::Default.into(),
            response_trailer_mode: HeaderSendMode::Send.into(),
        }
    }

    /// The decision: the endpoint (and the next tier's for a retry) in headers and
    /// metadata, the client's credentials and destinations removed, and the body for the
    /// chosen profile.
    fn send_destination(&self, ctx: &RequestCtx, picked: &Picked) {
        let body = ctx.upstream_body(ctx.routed.decision.profile);
        let (mutation, metadata) = destination(ctx, picked);
        telemetry::routed(
            ctx.routed.decision.complexity,
            ctx.received.started.elapsed(),
        );
        if self.request_mode != BodySendMode::FullDuplexStreamed {
            self.send_buffered(mutation, metadata, body);
        } else {
            self.send_streamed(mutation, metadata, body);
        }
    }

    /// The decision as the answer to a buffered body: headers and the whole new body.
    fn send_buffered(&self, mut mutation: HeaderMutation, metadata: Struct, body: Bytes) {
        mutation.set_headers.push(header_option(
            http::header::CONTENT_LENGTH.as_str(),
            body.len().to_string().as_bytes(),
        ));
        let mut answer = reply(Out::RequestBody(BodyResponse {
            response: Some(CommonResponse {
                header_mutation: Some(mutation),
                body_mutation: Some(BodyMutation {
                    mutation: Some(Mutation::Body(body)),
                }),
                ..CommonResponse::default()
            }),
        }));
        answer.dynamic_metadata = Some(metadata);
        self.send(answer);
    }

    /// The decision in full-duplex mode: the headers' answer, the new body in pieces, and
    /// the trailers' answer when the request had trailers.
    fn send_streamed(&self, mutation: HeaderMutation, metadata: Struct, body: Bytes) {
        let mut headers = reply(Out::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(mutation),
                ..CommonResponse::default()
            }),
        }));
        headers.dynamic_metadata = Some(metadata);
        self.send(headers);
        let chunks = body.len().div_ceil(MAX_CHUNK).max(1);
        for i in 0..chunks {
            let part = body.slice(i * MAX_CHUNK..((i + 1) * MAX_CHUNK).min(body.len()));
            let last = !self.request_trailers && i + 1 == chunks;
            self.send(streamed(Out::RequestBody, part, last));
        }
        if self.request_trailers {
            self.send(reply(Out::RequestTrailers(TrailersResponse::default())));
        }
    }

    /// A refusal Envoy sends the client itself, in the API's shape, as the HTTP port
    /// would have answered it.
    fn refuse(&self, app: &App, error: ApiError, endpoint: Option<Endpoint>) {
        let code = error.kind().1;
        let (head, body) = pipeline::refusal(app, error, endpoint).into_parts();
        // A `Full` body is ready at once and cannot fail.
        let body = futures_util::FutureExt::now_or_never(body.collect())
            .and_then(Result::ok)
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        self.answer(
            head.status,
            &head.headers,
            body,
            format!("quantrouter_{code}"),
        );
    }

    /// `POST /v1/messages/count_tokens`, answered here as the HTTP port answers it: the
    /// pipeline's estimate, or a refusal in Anthropic's shape.
    async fn count_tokens(&mut self, app: &App, parts: &http::request::Parts, none: bool) {
        let read = BodyRead {
            limit: app.config.body_limit,
            declared: content_length(&parts.headers),
            none,
            reads_answer: false,
        };
        let counted = match app
            .authenticate(&parts.headers)
            .and_then(|_| pipeline::check_content_type(&parts.headers))
        {
            Ok(()) => match self.body(read).await {
                Ok(body) => pipeline::count_tokens(app, &body),
                Err(error) => Err(error),
            },
            Err(error) => Err(error),
        };
        match counted {
            Ok(json) => {
                let mut headers = HeaderMap::new();
                headers.insert(
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                let details = "quantrouter_count_tokens".to_owned();
                self.answer(StatusCode::OK, &headers, json, details);
            }
            Err(error) => self.refuse(app, error, Some(Endpoint::Messages)),
        }
    }

    /// Answers the request here, in place of a model server.
    fn answer(&self, status: StatusCode, headers: &HeaderMap, body: Bytes, details: String) {
        self.send(reply(Out::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status.as_u16()),
            }),
            headers: Some(HeaderMutation {
                set_headers: to_options(headers),
                remove_headers: Vec::new(),
            }),
            body,
            details,
        })));
    }
}

// === impl Picked ===

impl Picked {
    /// Where the request goes: a slot of its tier, the endpoint, and the next tier's
    /// endpoints for the Gateway's retry.
    async fn pick(app: &App, ctx: &RequestCtx) -> Result<Self, ApiError> {
        let profile = ctx.routed.decision.profile;
        let permit = pipeline::admission_slot(app, ctx, profile).await?;
        let pick = pipeline::pick_endpoint(ctx, profile, &[]).ok_or_else(|| {
            let id = &ctx.snapshot.set.profiles[profile].id;
            ApiError::Unavailable(format!("profile {id} has no ready endpoint"))
        })?;
        let inflight = ctx.snapshot.runtime[profile].pool.enter(&pick.endpoint);
        let primary = address(pick.endpoint.base());
        let fallback = fallback(ctx, &primary);
        Ok(Self {
            primary,
            pick: Some(pick),
            fallback,
            _inflight: inflight,
            _permit: permit,
        })
    }

    /// How the attempt went, for the picked endpoint's breaker: an answer from it, or none
    /// (the Gateway retried elsewhere, which the fallback metric counts).
    fn report(&mut self, ctx: &RequestCtx, served: &Served, status: StatusCode) {
        if let Some(pick) = self.pick.take() {
            match (served.fallback, status.as_u16()) {
                (None, 200..=499) => pick.succeeded(ctx.received.started.elapsed()),
                _ => pick.failed(),
            }
        }
        if let Some(f) = served.fallback {
            let profiles = &ctx.snapshot.set.profiles;
            telemetry::fallback(&profiles[f.from].id, &profiles[f.to].id, "error");
        }
    }
}

/// The request's headers for the model server — the endpoint (and the next tier's for a
/// retry), the request id, the profile's own key, the client's credentials and destinations
/// removed — and the same decision as `envoy.lb` metadata.
fn destination(ctx: &RequestCtx, picked: &Picked) -> (HeaderMutation, Struct) {
    let mut mutation = HeaderMutation {
        // Removals apply before the sets below.
        remove_headers: pipeline::strip_client_headers(ctx.headers())
            .into_iter()
            .map(|name| name.as_str().to_owned())
            .collect(),
        set_headers: Vec::new(),
    };
    let mut lb = BTreeMap::new();
    let primary = &picked.primary;
    mutation
        .set_headers
        .push(header_option(DESTINATION_ENDPOINT, primary.as_bytes()));
    lb.insert(DESTINATION_ENDPOINT.to_owned(), string_value(primary));
    if let Some((_, addresses)) = &picked.fallback {
        // One header line per endpoint, best first: the same list as one comma-joined value
        // (RFC 9110), and an ORIGINAL_DST cluster keyed on the header takes the first line.
        for (i, address) in addresses.iter().enumerate() {
            let mut line = header_option(DESTINATION_FALLBACK, address.as_bytes());
            if i > 0 {
                line.append_action = HeaderAppendAction::AppendIfExistsOrAdd.into();
            }
            mutation.set_headers.push(line);
        }
        let joined = string_value(&addresses.join(","));
        lb.insert(DESTINATION_FALLBACK.to_owned(), joined);
    }
    let id = ctx.request_id();
    mutation
        .set_headers
        .push(header_option(REQUEST_ID.as_str(), id.as_bytes()));
    // The model server gets its own key, if it has one.
    let pool = &ctx.snapshot.runtime[ctx.routed.decision.profile].pool;
    if let Some(credential) = pool.authorization() {
        let authorization = http::header::AUTHORIZATION.as_str();
        let line = header_option(authorization, credential.as_bytes());
        mutation.set_headers.push(line);
    }
    let lb = Value {
        kind: Some(Kind::StructValue(Struct { fields: lb })),
    };
    let metadata = Struct {
        fields: BTreeMap::from([(LB_NAMESPACE.to_owned(), lb)]),
    };
    (mutation, metadata)
}

/// The decision's next tier after an error, and its endpoints whose circuit admits a
/// request, least loaded first (a Gateway's retry takes the first).
fn fallback(ctx: &RequestCtx, primary: &str) -> Option<(ProfileIndex, Vec<String>)> {
    let decision = &ctx.routed.decision;
    let next = decision.next_after_error(&[decision.profile])?;
    let now = Instant::now();
    let in_subset = |a: &String| ctx.subset.as_ref().is_none_or(|s| s.contains(a));
    let mut ready: Vec<_> = ctx.snapshot.runtime[next]
        .pool
        .endpoints()
        .iter()
        .filter(|e| e.circuit(now) != CircuitState::Open)
        .map(|e| (e.inflight() + e.waiting(), address(e.base())))
        .filter(|(_, a)| in_subset(a) && a != primary)
        .collect();
    ready.sort_by_key(|(load, _)| *load);
    let addresses: Vec<String> = ready.into_iter().map(|(_, a)| a).collect();
    (!addresses.is_empty()).then_some((next, addresses))
}

// === impl Answer ===

impl Answer {
    /// The answer's head: the breaker hears how the attempt went, the router's headers go
    /// on, and the pipeline counts the head and gathers the answer's books.
    fn head(
        &mut self,
        app: &App,
        ctx: &mut RequestCtx,
        picked: &mut Picked,
        head: ResponseHead,
    ) -> ProcessingResponse {
        let (pseudo, headers) = split_headers(head.message.headers);
        let status = pseudo
            .status
            .parse::<u16>()
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .unwrap_or(StatusCode::BAD_GATEWAY);
        let served = served(ctx, picked, head.served.as_deref());
        picked.report(ctx, &served, status);
        let mut router = HeaderMap::new();
        pipeline::router_headers(&mut router, ctx, &served);
        let sse = is_event_stream(&headers);
        let mut mutation = HeaderMutation {
            set_headers: to_options(&router),
            remove_headers: Vec::new(),
        };
        let strip = ctx.shape.rewrite.adds_usage() && sse;
        if strip {
            // The stream comes back shorter than the upstream sent it.
            mutation
                .remove_headers
                .push(http::header::CONTENT_LENGTH.as_str().to_owned());
        }
        // The tenant a stored answer belongs to, before the ledger takes the grant.
        let owner = ctx.grant.as_ref().map(|g| g.tenant.id.to_string());
        let ledger = pipeline::ledger(app, ctx, &served, AnswerHead { status, sse });
        let stores = ctx.received.endpoint == Endpoint::Responses && status.is_success();
        self.stored = stores
            .then(|| pipeline::on_stored(app, &router, owner))
            .flatten()
            .map(|on_stored| StoredWatch::new(on_stored, sse));
        self.copy = ledger.wants_answer().then(BytesMut::new);
        self.ledger = Some(ledger);
        self.sse = sse;
        self.scan = EventScan::new(strip);
        self.started = Some(ctx.received.started);
        if head.message.end_of_stream {
            self.finish(true);
        }
        reply(Out::ResponseHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(mutation),
                ..CommonResponse::default()
            }),
        }))
    }

    /// A piece of the answer: on to the client (rewritten when usage is cut from a
    /// stream), and what the books need of it kept.
    fn body(&mut self, chunk: Bytes, end: bool, duplex: bool) -> ProcessingResponse {
        let echo = |out: Bytes| match duplex {
            true => streamed(Out::ResponseBody, out, end),
            false => reply(Out::ResponseBody(BodyResponse::default())),
        };
        let Some(ledger) = self.ledger.as_mut() else {
            return echo(chunk);
        };
        if let Some(stored) = &mut self.stored {
            stored.feed(&chunk);
        }
        if let Some(copy) = &mut self.copy {
            match copy.len() + chunk.len() <= crate::calibration::MAX_ANSWER {
                true => copy.extend_from_slice(&chunk),
                false => self.copy = None,
            }
        }
        let mut out = match self.sse {
            true => {
                let scanned = self.scan.feed(chunk);
                if let (true, Some(started)) = (scanned.first_output, self.started) {
                    ledger.first_output(started.elapsed());
                }
                scanned.out.unwrap_or_default()
            }
            false => chunk,
        };
        if !self.scan.strips_usage() {
            self.tail.push(&out);
        }
        if end {
            if let Some(rest) = self.scan.finish().out {
                out = [out, rest].concat().into();
            }
            self.finish(true);
        }
        echo(out)
    }

    /// The answer ended (`completed`: all of it passed): the pipeline books it, once.
    fn finish(&mut self, completed: bool) {
        let Some(ledger) = self.ledger.take() else {
            return;
        };
        if let Some(stored) = &mut self.stored {
            if completed {
                stored.finish();
            }
        }
        let events = self.sse.then_some(&self.scan);
        let usage = reported_usage(events, &mut self.tail, completed);
        let end = BodyEnd {
            completed,
            failure: None,
            usage,
            data_events: self.scan.data_events,
            elapsed: self.started.map(|s| s.elapsed()).unwrap_or_default(),
        };
        let answer = self.copy.take().filter(|_| completed).map(BytesMut::freeze);
        ledger.book(Outcome { end, answer });
    }
}

/// How the answer was served: by the picked profile, or by the next tier's endpoint the
/// Gateway retried on.
fn served(ctx: &RequestCtx, picked: &Picked, answered_by: Option<&str>) -> Served {
    let decision = &ctx.routed.decision;
    let by_fallback = answered_by.and_then(|served| {
        let (next, addresses) = picked.fallback.as_ref()?;
        (served != picked.primary && addresses.iter().any(|a| a == served)).then_some(*next)
    });
    Served {
        profile: by_fallback.unwrap_or(decision.profile),
        attempts: 1 + u32::from(by_fallback.is_some()),
        fallback: by_fallback.map(|to| Fallback {
            from: decision.profile,
            to,
            reason: FallbackReason::Error,
        }),
    }
}

/// A request's head from Envoy's headers: the generation endpoint it is for (`None`: a
/// count of Messages tokens), or why not (with the endpoint, when the path names one, for
/// the refusal's shape).
fn request_head(
    app: &App,
    headers: Option<ProtoHeaders>,
) -> Result<(http::request::Parts, Option<Endpoint>), (ApiError, Option<Endpoint>)> {
    let (pseudo, headers) = split_headers(headers);
    let (method, target) = (pseudo.method.as_str(), pseudo.path.as_str());
    let path = target.split('?').next().unwrap_or_default();
    let endpoint = match (method, path, Endpoint::of_path(path)) {
        ("POST", _, Some(endpoint)) => Some(endpoint),
        ("POST", COUNT_TOKENS, None) => None,
        (_, COUNT_TOKENS, None) => {
            return Err((ApiError::MethodNotAllowed, Some(Endpoint::Messages)))
        }
        (_, _, Some(endpoint)) => return Err((ApiError::MethodNotAllowed, Some(endpoint))),
        (_, _, None) => return Err((ApiError::RouteNotFound(path.to_owned()), None)),
    };
    let (mut parts, ()) = http::Request::new(()).into_parts();
    parts.method = http::Method::POST;
    parts.uri = target.parse().unwrap_or_default();
    parts.headers = headers;
    RequestId::assign(&mut parts, || app.next_request_id());
    Ok((parts, endpoint))
}

/// The body's length as the client declared it, if it did.
fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// The endpoint that answered, as Envoy says in a response message: its `envoy.lb`
/// metadata, or the `upstream.address` attribute.
fn answered_by(message: &ProcessingRequest) -> Option<String> {
    metadata(message)
        .and_then(|m| m.get(LB_NAMESPACE))
        .and_then(|lb| string_field(lb, DESTINATION_SERVED))
        .or_else(|| {
            message
                .attributes
                .values()
                .find_map(|s| string_field(s, UPSTREAM_ADDRESS))
        })
}

/// The dynamic metadata Envoy forwarded with a message.
fn metadata(message: &ProcessingRequest) -> Option<&HashMap<String, Struct>> {
    message
        .metadata_context
        .as_ref()
        .map(|m| &m.filter_metadata)
}

fn reply(response: Out) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        dynamic_metadata: None,
        mode_override: None,
    }
}

/// A body piece sent on in full-duplex mode.
fn streamed(
    direction: fn(BodyResponse) -> Out,
    body: Bytes,
    end_of_stream: bool,
) -> ProcessingResponse {
    reply(direction(BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                    body,
                    end_of_stream,
                })),
            }),
            ..CommonResponse::default()
        }),
    }))
}

fn header_option(name: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(ProtoHeader {
            key: name.to_owned(),
            value: String::new(),
            raw_value: Bytes::copy_from_slice(value),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd.into(),
    }
}

fn to_options(headers: &HeaderMap) -> Vec<HeaderValueOption> {
    headers
        .iter()
        .map(|(name, value)| header_option(name.as_str(), value.as_bytes()))
        .collect()
}

/// The pseudo-headers of a message from Envoy that the picker reads.
#[derive(Debug, Default)]
struct Pseudo {
    method: String,
    path: String,
    status: String,
}

/// Envoy's header list as the pseudo-headers the picker reads (`:method`, `:path`,
/// `:status`) and a header map.
fn split_headers(headers: Option<ProtoHeaders>) -> (Pseudo, HeaderMap) {
    let mut pseudo = Pseudo::default();
    let headers = headers.map(|h| h.headers).unwrap_or_default();
    let mut map = HeaderMap::with_capacity(headers.len());
    for header in headers {
        // Envoy sends values in `raw_value`; older data planes in `value`.
        let value = match header.raw_value.is_empty() {
            true => Bytes::from(header.value.into_bytes()),
            false => header.raw_value,
        };
        let slot = match header.key.as_str() {
            ":method" => &mut pseudo.method,
            ":path" => &mut pseudo.path,
            ":status" => &mut pseudo.status,
            key if key.starts_with(':') => continue,
            _ => {
                if let (Ok(name), Ok(value)) = (
                    HeaderName::from_bytes(header.key.as_bytes()),
                    HeaderValue::from_maybe_shared(value),
                ) {
                    map.append(name, value);
                }
                continue;
            }
        };
        *slot = String::from_utf8_lossy(&value).into_owned();
    }
    (pseudo, map)
}

/// The subset hint: the endpoints Envoy allows for this request.
fn subset_hint(metadata: &HashMap<String, Struct>) -> Option<Vec<String>> {
    let hint = metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(DESTINATION_SUBSET)?;
    let addresses = match &hint.kind {
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.trim().to_owned()),
                _ => None,
            })
            .collect(),
        Some(Kind::StringValue(s)) => s.split(',').map(|a| a.trim().to_owned()).collect(),
        _ => Vec::new(),
    };
    Some(addresses)
}

fn string_field(s: &Struct, key: &str) -> Option<String> {
    match &s.fields.get(key)?.kind {
        Some(Kind::StringValue(value)) => Some(value.clone()),
        _ => None,
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(values: &[&str]) -> Value {
        Value {
            kind: Some(Kind::ListValue(prost_types::ListValue {
                values: values.iter().map(|v| string_value(v)).collect(),
            })),
        }
    }

    #[test]
    fn the_subset_hint_is_read_as_a_list_or_a_comma_list() {
        let hint = |value: Value| {
            let inner = Struct {
                fields: BTreeMap::from([(DESTINATION_SUBSET.to_owned(), value)]),
            };
            HashMap::from([(SUBSET_NAMESPACE.to_owned(), inner)])
        };
        let both = vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()];
        let from_list = subset_hint(&hint(list(&["10.0.0.1:8000", "10.0.0.2:8000"])));
        assert_eq!(from_list, Some(both.clone()));
        let from_text = subset_hint(&hint(string_value("10.0.0.1:8000, 10.0.0.2:8000")));
        assert_eq!(from_text, Some(both));
        // Present but empty: nothing may be chosen (a 503), unlike no hint at all.
        assert_eq!(subset_hint(&hint(list(&[]))), Some(Vec::new()));
        assert_eq!(subset_hint(&HashMap::new()), None);
    }
}
