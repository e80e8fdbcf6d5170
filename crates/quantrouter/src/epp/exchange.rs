//! One ext_proc stream: a request's headers and body in, the endpoint decision out; then the
//! response's headers and body through, with its usage counted.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue};
use http_body_util::BodyExt as _;
use prost_types::{value::Kind, Struct, Value};
use quantrouter_policy::{ProfileIndex, Reason};
use tokio::time::Instant;

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
use super::proto::BodySendMode;
use crate::app::App;
use crate::openai::{find_usage, ApiError, Endpoint, ParsedRequest, Usage};
use crate::pipeline::{self as proxy, DecisionLog, Ledger};
use crate::profiles::Snapshot;
use crate::resilience::CircuitState;
use crate::resilience::{Overloaded, Permit};
use crate::routing::{self, PromptSize, RouteInput};
use crate::telemetry::{self, RequestLabels};
use crate::tenants::{ActiveTenant, Grant};
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

/// Envoy's attribute with the address of the upstream that answered.
const UPSTREAM_ADDRESS: &str = "upstream.address";

/// Largest body chunk sent back in full-duplex mode: Envoy recommends at most 64 KiB.
const MAX_CHUNK: usize = 64 * 1024;

/// Bytes kept of a whole (non-stream) answer to find its `usage`, which ends the object.
const USAGE_TAIL: usize = 64 * 1024;

/// The state of one request between Envoy's messages.
pub(super) struct Exchange {
    app: Arc<App>,
    request_mode: BodySendMode,
    response_mode: BodySendMode,
    head: Option<Head>,
    body: BytesMut,
    picked: Option<Picked>,
    /// An immediate response went out: Envoy ignores anything more.
    refused: bool,
}

/// A generation request's head, checked.
struct Head {
    headers: HeaderMap,
    endpoint: Endpoint,
    tenant: Option<Arc<ActiveTenant>>,
    subset: Option<Vec<String>>,
    started: Instant,
}

/// What was chosen, held until the answer ends: the slot, the in-flight count and the
/// tenant's grant live as long as the request.
struct Picked {
    snapshot: Arc<Snapshot>,
    prompt: PromptSize,
    started: Instant,
    primary: String,
    pick: Option<Pick>,
    fallback: Option<(ProfileIndex, Vec<String>)>,
    grant: Option<Grant>,
    strip_usage: bool,
    served: ProfileIndex,
    reason: Reason,
    answer: Option<Answer>,
    _inflight: InflightGuard,
    _permit: Permit,
}

/// The response as it passes.
struct Answer {
    /// What the answer's end is booked with.
    ledger: Ledger,
    sse: bool,
    scan: EventScan,
    tail: BytesMut,
}

/// What the picker tells Envoy about a request it routed.
struct Destination {
    mutation: HeaderMutation,
    metadata: Struct,
    body: Bytes,
}

impl Exchange {
    pub(super) fn new(app: Arc<App>) -> Self {
        Self {
            app,
            request_mode: BodySendMode::None,
            response_mode: BodySendMode::None,
            head: None,
            body: BytesMut::new(),
            picked: None,
            refused: false,
        }
    }

    /// The answers to one message from Envoy, in order.
    pub(super) async fn handle(&mut self, message: ProcessingRequest) -> Vec<ProcessingResponse> {
        if let Some(config) = &message.protocol_config {
            self.request_mode = config.request_body_mode();
            self.response_mode = config.response_body_mode();
        }
        if self.refused {
            return Vec::new();
        }
        let metadata = message
            .metadata_context
            .as_ref()
            .map(|m| &m.filter_metadata);
        match message.request {
            Some(In::RequestHeaders(headers)) => self.on_request_headers(headers, metadata).await,
            Some(In::RequestBody(body)) => {
                self.on_request_body(body.body, body.end_of_stream).await
            }
            Some(In::RequestTrailers(_)) => {
                let mut answers = self.answer_request(true).await;
                if !self.refused {
                    answers.push(reply(Out::RequestTrailers(TrailersResponse::default())));
                }
                answers
            }
            Some(In::ResponseHeaders(headers)) => {
                self.on_response_headers(headers, metadata, &message.attributes)
            }
            Some(In::ResponseBody(body)) => self.on_response_body(body.body, body.end_of_stream),
            Some(In::ResponseTrailers(_)) => {
                self.finish();
                vec![reply(Out::ResponseTrailers(TrailersResponse::default()))]
            }
            None => Vec::new(),
        }
    }

    /// The stream ended before the answer did (Envoy gave up, the client left): what was
    /// held is released, the breaker hears nothing it cannot know.
    pub(super) fn abandon(&mut self) {
        if self.picked.as_ref().is_some_and(|p| p.answer.is_some()) {
            self.finish();
        }
        self.picked = None;
    }

    async fn on_request_headers(
        &mut self,
        message: HttpHeaders,
        metadata: Option<&std::collections::HashMap<String, Struct>>,
    ) -> Vec<ProcessingResponse> {
        let (pseudo, headers) = split_headers(message.headers);
        let method = pseudo.get(":method").map_or("", String::as_str);
        let path = pseudo.get(":path").map_or("", String::as_str);
        let path = path.split('?').next().unwrap_or_default();
        let endpoint = match (method, Endpoint::of_path(path)) {
            ("POST", Some(endpoint)) => endpoint,
            (_, Some(_)) => return self.refuse(ApiError::MethodNotAllowed),
            (_, None) => return self.refuse(ApiError::RouteNotFound(path.to_owned())),
        };
        let tenant = match self.app.authenticate(&headers) {
            Ok(tenant) => tenant,
            Err(error) => return self.refuse(error),
        };
        if let Err(error) = proxy::check_content_type(&headers) {
            return self.refuse(error);
        }
        let started = Instant::now();
        self.head = Some(Head {
            headers,
            endpoint,
            tenant,
            subset: metadata.and_then(subset_hint),
            started,
        });
        if message.end_of_stream {
            // No body: parsing refuses it as the HTTP port does.
            return self.answer_request(false).await;
        }
        match self.request_mode {
            // Envoy waits for this before it sends the body.
            BodySendMode::Buffered => vec![reply(Out::RequestHeaders(HeadersResponse {
                response: Some(CommonResponse::default()),
            }))],
            // The headers' answer carries the destination, once the body is read.
            BodySendMode::FullDuplexStreamed => Vec::new(),
            _ => self.refuse(ApiError::BadGateway(
                "the ext_proc filter must send the request body in BUFFERED or \
                 FULL_DUPLEX_STREAMED mode"
                    .to_owned(),
            )),
        }
    }

    async fn on_request_body(&mut self, chunk: Bytes, end: bool) -> Vec<ProcessingResponse> {
        if self.head.is_none() || self.picked.is_some() {
            return Vec::new();
        }
        let limit = self.app.config.body_limit;
        if self.body.len() + chunk.len() > limit {
            return self.refuse(ApiError::PayloadTooLarge { limit });
        }
        self.body.extend_from_slice(&chunk);
        if !end {
            return Vec::new();
        }
        self.answer_request(false).await
    }

    /// The whole request is in: the decision, or a refusal. `trailers`: the request's end
    /// comes with trailers, not with the body's last chunk.
    async fn answer_request(&mut self, trailers: bool) -> Vec<ProcessingResponse> {
        let destination = match self.pick().await {
            Ok(destination) => destination,
            Err(error) => return self.refuse(error),
        };
        let Destination {
            mut mutation,
            metadata,
            body,
        } = destination;
        if self.request_mode != BodySendMode::FullDuplexStreamed {
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
            return vec![answer];
        }
        let mut headers = reply(Out::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(mutation),
                ..CommonResponse::default()
            }),
        }));
        headers.dynamic_metadata = Some(metadata);
        let mut answers = vec![headers];
        let chunks = body.len().div_ceil(MAX_CHUNK).max(1);
        for i in 0..chunks {
            let part = body.slice(i * MAX_CHUNK..((i + 1) * MAX_CHUNK).min(body.len()));
            answers.push(streamed(
                Out::RequestBody,
                part,
                !trailers && i + 1 == chunks,
            ));
        }
        answers
    }

    /// The policy's decision for the request read so far, an endpoint of its tier by load,
    /// the next tier's endpoints, and the body for that tier.
    async fn pick(&mut self) -> Result<Destination, ApiError> {
        let app = Arc::clone(&self.app);
        let Some(head) = self.head.as_mut() else {
            return Err(ApiError::InvalidRequest {
                message: "the request body came before its headers".to_owned(),
                param: None,
            });
        };
        let body = self.body.split().freeze();
        let mut parsed = ParsedRequest::parse(&body, head.endpoint)?;
        // The usage event asked for the client's sake is cut from the stream on the way
        // back, which only a full-duplex response lets the picker do.
        if self.response_mode != BodySendMode::FullDuplexStreamed {
            parsed.has_stream_options = true;
        }
        let snapshot = app.store.load();
        let grant = proxy::admit_tenant(&app, head.tenant.take(), &parsed, &snapshot).await?;
        let subset = head.subset.as_deref();
        let in_subset =
            |address: &str| subset.is_none_or(|s| s.iter().any(|allowed| allowed == address));
        let among: Option<Vec<bool>> = subset.map(|_| {
            snapshot
                .pools()
                .map(|pool| {
                    pool.endpoints()
                        .iter()
                        .any(|e| in_subset(&address(e.base())))
                })
                .collect()
        });
        let generated;
        let key = match head.headers.get(REQUEST_ID).and_then(|v| v.to_str().ok()) {
            Some(key) => key.to_owned(),
            None => {
                generated = app.next_request_id();
                head.headers.insert(REQUEST_ID, generated.clone());
                generated.to_str().unwrap_or_default().to_owned()
            }
        };
        let classifier = app.config.classifier.load();
        let input = RouteInput {
            classifier: classifier.model.as_ref(),
            headers: &head.headers,
            aliases: &app.config.aliases,
            request_key: &key,
            tenant: grant.as_ref().map(|g| (&*g.tenant, g.downgraded)),
            among: among.as_deref(),
            rating: None,
        };
        let routed =
            routing::route(&snapshot, &parsed, input).map_err(|error| match (error, subset) {
                // GIE: no eligible endpoint in the subset is a 503.
                (ApiError::Unavailable(_), Some(_)) => ApiError::Unavailable(
                    "no endpoint of the subset hint can take the request".to_owned(),
                ),
                (error, _) => error,
            })?;
        app.keda.on_route(&snapshot, routed.decision.profile);
        if let Some(cold) = routed.cold_preferred {
            app.keda.on_route(&snapshot, cold);
        }
        let deadline = head.started
            + routing::timeout(&head.headers)?.unwrap_or(app.config.resilience.default_deadline);
        if let Some((cold, timeout)) = routed.wait_for {
            let timeout = timeout.min(deadline.saturating_duration_since(Instant::now()));
            if !snapshot.runtime[cold]
                .pool
                .wait_for_endpoints(timeout)
                .await
            {
                let id = &snapshot.set.profiles[cold].id;
                return Err(ApiError::Unavailable(format!(
                    "profile {id} is scaled to zero and got no endpoint within {timeout:?}"
                )));
            }
        }
        let decision = routed.decision;
        DecisionLog {
            snapshot: &snapshot,
            decision: &decision,
            parsed: &parsed,
            request_id: &key,
        }
        .record(&app, None);
        telemetry::routed(decision.complexity, head.started.elapsed());
        let profile = decision.profile;
        let runtime = &snapshot.runtime[profile];
        let pool = &runtime.pool;
        let id = &snapshot.set.profiles[profile].id;
        let now = Instant::now();
        let outside: Vec<_> = pool
            .endpoints()
            .iter()
            .filter(|e| !in_subset(&address(e.base())))
            .cloned()
            .collect();
        let pick = pool
            .pick(&outside, now)
            .ok_or_else(|| ApiError::Unavailable(format!("profile {id} has no ready endpoint")))?;
        let queue_timeout = app
            .config
            .resilience
            .admission
            .queue_timeout
            .min(deadline.saturating_duration_since(now));
        let priority = grant.as_ref().map_or(0, |g| g.tenant.priority);
        let permit = pool
            .admission
            .admit(priority, queue_timeout)
            .await
            .map_err(|overloaded| shed(id, overloaded, queue_timeout))?;
        let inflight = pool.enter(&pick.endpoint);
        let primary = address(pick.endpoint.base());
        let fallback = decision.next_after_error(&[profile]).and_then(|next| {
            let now = Instant::now();
            let mut ready: Vec<_> = snapshot.runtime[next]
                .pool
                .endpoints()
                .iter()
                .filter(|e| e.circuit(now) != CircuitState::Open)
                .map(|e| (e.inflight() + e.waiting(), address(e.base())))
                .filter(|(_, a)| in_subset(a) && *a != primary)
                .collect();
            // The least loaded first: a Gateway's retry takes the first.
            ready.sort_by_key(|(load, _)| *load);
            let addresses: Vec<String> = ready.into_iter().map(|(_, a)| a).collect();
            (!addresses.is_empty()).then_some((next, addresses))
        });
        let strip_usage = parsed.adds_usage();
        let upstream_body = parsed.upstream_body(&body, &runtime.model_json);
        let mut mutation = HeaderMutation::default();
        // Envoy trusts these headers as they are (ORIGINAL_DST): a client's own would choose
        // where its request, or its retry, goes. Removals apply before the picker's sets.
        mutation.remove_headers = client_destinations(&head.headers);
        let mut lb = BTreeMap::new();
        mutation
            .set_headers
            .push(header_option(DESTINATION_ENDPOINT, primary.as_bytes()));
        lb.insert(DESTINATION_ENDPOINT.to_owned(), string_value(&primary));
        if let Some((_, addresses)) = &fallback {
            // One header line per endpoint, best first: the same list as one comma-joined
            // value (RFC 9110), and an ORIGINAL_DST cluster keyed on the header takes the
            // first line.
            for (i, address) in addresses.iter().enumerate() {
                let mut line = header_option(DESTINATION_FALLBACK, address.as_bytes());
                if i > 0 {
                    line.append_action = HeaderAppendAction::AppendIfExistsOrAdd.into();
                }
                mutation.set_headers.push(line);
            }
            lb.insert(
                DESTINATION_FALLBACK.to_owned(),
                string_value(&addresses.join(",")),
            );
        }
        if let Some(id) = head.headers.get(REQUEST_ID) {
            mutation
                .set_headers
                .push(header_option(REQUEST_ID.as_str(), id.as_bytes()));
        }
        // The caller's key is the router's business; the model server gets its own, if any.
        match pool.authorization() {
            Some(credential) => mutation.set_headers.push(header_option(
                http::header::AUTHORIZATION.as_str(),
                credential.as_bytes(),
            )),
            None => mutation
                .remove_headers
                .push(http::header::AUTHORIZATION.as_str().to_owned()),
        }
        let metadata = Struct {
            fields: BTreeMap::from([(
                LB_NAMESPACE.to_owned(),
                Value {
                    kind: Some(Kind::StructValue(Struct { fields: lb })),
                },
            )]),
        };
        self.picked = Some(Picked {
            prompt: routed.prompt,
            started: head.started,
            primary,
            pick: Some(pick),
            fallback,
            grant,
            strip_usage,
            served: profile,
            reason: decision.reason,
            answer: None,
            snapshot,
            _inflight: inflight,
            _permit: permit,
        });
        Ok(Destination {
            mutation,
            metadata,
            body: upstream_body,
        })
    }

    fn on_response_headers(
        &mut self,
        message: HttpHeaders,
        metadata: Option<&std::collections::HashMap<String, Struct>>,
        attributes: &std::collections::HashMap<String, Struct>,
    ) -> Vec<ProcessingResponse> {
        let Some(picked) = self.picked.as_mut() else {
            return vec![reply(Out::ResponseHeaders(HeadersResponse::default()))];
        };
        let (pseudo, headers) = split_headers(message.headers);
        let status: u16 = pseudo
            .get(":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let served = metadata
            .and_then(|m| m.get(LB_NAMESPACE))
            .and_then(|lb| string_field(lb, DESTINATION_SERVED))
            .or_else(|| {
                attributes
                    .values()
                    .find_map(|s| string_field(s, UPSTREAM_ADDRESS))
            });
        let by_fallback = served.as_deref().and_then(|served| {
            let (next, addresses) = picked.fallback.as_ref()?;
            (served != picked.primary && addresses.iter().any(|a| a == served)).then_some(*next)
        });
        let elapsed = picked.started.elapsed();
        if let Some(pick) = picked.pick.take() {
            match (by_fallback, status) {
                (None, 200..=499) => pick.succeeded(elapsed),
                _ => pick.failed(),
            }
        }
        if let Some(next) = by_fallback {
            let snapshot = &picked.snapshot;
            telemetry::fallback(
                &snapshot.set.profiles[picked.served].id,
                &snapshot.set.profiles[next].id,
                "error",
            );
            picked.served = next;
            picked.reason = Reason::FallbackError;
        }
        let labels = RequestLabels {
            profile: Arc::clone(&picked.snapshot.runtime[picked.served].telemetry),
            reason: picked.reason,
        };
        telemetry::response_headers(&labels, status);
        let sse = is_event_stream(&headers);
        if !sse {
            telemetry::first_token(&labels, elapsed);
        }
        let mut mutation = HeaderMutation::default();
        let mut router = HeaderMap::new();
        let telemetry = &picked.snapshot.runtime[picked.served].telemetry;
        for (name, value) in [
            ("x-quantrouter-profile", telemetry.profile_header.clone()),
            ("x-quantrouter-tier", telemetry.tier_header.clone()),
            (
                "x-quantrouter-reason",
                Some(HeaderValue::from_static(picked.reason.as_str())),
            ),
        ] {
            if let Some(value) = value {
                router.insert(HeaderName::from_static(name), value);
            }
        }
        if let Some(grant) = &picked.grant {
            crate::tenants::gate::insert_rate_headers(&mut router, &grant.rate);
        }
        mutation.set_headers = to_options(&router);
        let strip = picked.strip_usage && sse;
        if strip {
            // The stream comes back shorter than the upstream sent it.
            mutation
                .remove_headers
                .push(http::header::CONTENT_LENGTH.as_str().to_owned());
        }
        let ledger = Ledger::new(&picked.snapshot, picked.served, labels, picked.prompt).charging(
            self.app.tenants.as_ref(),
            picked.grant.take(),
            (200..300).contains(&status),
            sse,
        );
        picked.answer = Some(Answer {
            ledger,
            sse,
            scan: EventScan::new(strip),
            tail: BytesMut::new(),
        });
        if message.end_of_stream {
            self.finish();
        }
        vec![reply(Out::ResponseHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(mutation),
                ..CommonResponse::default()
            }),
        }))]
    }

    fn on_response_body(&mut self, chunk: Bytes, end: bool) -> Vec<ProcessingResponse> {
        let duplex = self.response_mode == BodySendMode::FullDuplexStreamed;
        let echo = |out: Bytes| match duplex {
            true => streamed(Out::ResponseBody, out, end),
            false => reply(Out::ResponseBody(BodyResponse::default())),
        };
        let Some(picked) = self.picked.as_mut() else {
            return vec![echo(chunk)];
        };
        let started = picked.started;
        let Some(answer) = picked.answer.as_mut() else {
            return vec![echo(chunk)];
        };
        let mut out = match answer.sse {
            true => {
                let scanned = answer.scan.feed(chunk);
                if scanned.first_output {
                    answer.ledger.first_output(started.elapsed());
                }
                scanned.out.unwrap_or_default()
            }
            false => {
                answer.tail.extend_from_slice(&chunk);
                if answer.tail.len() > USAGE_TAIL {
                    let cut = answer.tail.len() - USAGE_TAIL;
                    let _ = answer.tail.split_to(cut);
                }
                chunk
            }
        };
        if end {
            if let Some(rest) = self.answer().and_then(|a| a.scan.finish().out) {
                out = [out, rest].concat().into();
            }
            self.finish();
        }
        vec![echo(out)]
    }

    fn answer(&mut self) -> Option<&mut Answer> {
        self.picked.as_mut().and_then(|p| p.answer.as_mut())
    }

    /// The answer ended: usage, cost and savings, the tenant's spend, the request's
    /// duration; then the slot and the in-flight count go back.
    fn finish(&mut self) {
        let Some(mut picked) = self.picked.take() else {
            return;
        };
        let Some(answer) = picked.answer.take() else {
            return;
        };
        let usage: Option<Usage> = match answer.sse {
            true => answer.scan.usage,
            false => find_usage(&answer.tail),
        };
        let end = BodyEnd {
            completed: true,
            failure: None,
            usage,
            data_events: answer.scan.data_events,
            elapsed: picked.started.elapsed(),
        };
        answer.ledger.book(Outcome { end, answer: None });
    }

    /// An OpenAI-shaped refusal Envoy sends the client itself.
    fn refuse(&mut self, error: ApiError) -> Vec<ProcessingResponse> {
        self.refused = true;
        self.picked = None;
        let code = error.kind().1;
        telemetry::router_error(code);
        match error.quotes_request() && !self.app.config.log_prompts {
            true => tracing::debug!(code, "request refused by the endpoint picker"),
            false => tracing::debug!(%error, code, "request refused by the endpoint picker"),
        }
        let (head, body) = error.into_response().into_parts();
        // A `Full` body is ready at once and cannot fail.
        let body = futures_util::FutureExt::now_or_never(body.collect())
            .and_then(Result::ok)
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        vec![reply(Out::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(head.status.as_u16()),
            }),
            headers: Some(HeaderMutation {
                set_headers: to_options(&head.headers),
                remove_headers: Vec::new(),
            }),
            body,
            details: format!("quantrouter_{code}"),
        }))]
    }
}

// An exchange Envoy ends mid-answer (its client left) charges what was delivered, as the
// proxy does; one that never got an answer gives the tenant's reservation back.
impl Drop for Exchange {
    fn drop(&mut self) {
        self.finish();
    }
}

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

fn reply(response: Out) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        dynamic_metadata: None,
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

fn shed(profile: &str, overloaded: Overloaded, queue_timeout: std::time::Duration) -> ApiError {
    telemetry::admission_rejected(profile);
    ApiError::Overloaded {
        profile: profile.to_owned(),
        reason: match overloaded {
            Overloaded::QueueFull => "the wait queue is full".into(),
            Overloaded::Timeout => format!("no slot within {queue_timeout:?}"),
            Overloaded::Displaced => "a higher-priority request took its place".into(),
        },
        retry_after_s: 1,
    }
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

/// Envoy's header list as pseudo-headers (`:method`, `:path`, `:status`) and a header map.
fn split_headers(
    headers: Option<ProtoHeaders>,
) -> (std::collections::HashMap<String, String>, HeaderMap) {
    let mut pseudo = std::collections::HashMap::new();
    let mut map = HeaderMap::new();
    for header in headers.map(|h| h.headers).unwrap_or_default() {
        // Envoy sends values in `raw_value`; older data planes in `value`.
        let value = match header.raw_value.is_empty() {
            true => Bytes::from(header.value.into_bytes()),
            false => header.raw_value,
        };
        if header.key.starts_with(':') {
            pseudo.insert(header.key, String::from_utf8_lossy(&value).into_owned());
            continue;
        }
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(header.key.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            map.append(name, value);
        }
    }
    (pseudo, map)
}

/// Every `x-gateway-destination-endpoint*` header the client sent, by name.
fn client_destinations(headers: &HeaderMap) -> Vec<String> {
    headers
        .keys()
        .filter(|name| name.as_str().starts_with(DESTINATION_ENDPOINT))
        .map(|name| name.as_str().to_owned())
        .collect()
}

/// The subset hint: the endpoints Envoy allows for this request.
fn subset_hint(metadata: &std::collections::HashMap<String, Struct>) -> Option<Vec<String>> {
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

/// An endpoint's `host:port` as a Gateway names it, from its base URL
/// (`http://10.0.0.7:8000/prefix` → `10.0.0.7:8000`; no port: the scheme's).
pub(crate) fn address(base: &str) -> String {
    let (scheme, rest) = base.split_once("://").unwrap_or(("http", base));
    let authority = rest.split('/').next().unwrap_or_default();
    let authority = authority.rsplit('@').next().unwrap_or(authority);
    let has_port = match authority.rfind(']') {
        Some(bracket) => authority[bracket..].contains(':'),
        None => authority.contains(':'),
    };
    match has_port {
        true => authority.to_owned(),
        false => {
            let port = if scheme.eq_ignore_ascii_case("https") {
                443
            } else {
                80
            };
            format!("{authority}:{port}")
        }
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
            std::collections::HashMap::from([(SUBSET_NAMESPACE.to_owned(), inner)])
        };
        let both = vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()];
        let from_list = subset_hint(&hint(list(&["10.0.0.1:8000", "10.0.0.2:8000"])));
        assert_eq!(from_list, Some(both.clone()));
        let from_text = subset_hint(&hint(string_value("10.0.0.1:8000, 10.0.0.2:8000")));
        assert_eq!(from_text, Some(both));
        // Present but empty: nothing may be chosen (a 503), unlike no hint at all.
        assert_eq!(subset_hint(&hint(list(&[]))), Some(Vec::new()));
        assert_eq!(subset_hint(&std::collections::HashMap::new()), None);
    }

    #[test]
    fn an_endpoint_is_named_by_host_and_port() {
        assert_eq!(address("http://10.0.0.7:8000"), "10.0.0.7:8000");
        assert_eq!(address("http://10.0.0.7:8000/prefix/v1"), "10.0.0.7:8000");
        assert_eq!(address("https://10.0.0.7"), "10.0.0.7:443");
        assert_eq!(address("http://10.0.0.7"), "10.0.0.7:80");
        assert_eq!(address("http://[fd00::1]:8000"), "[fd00::1]:8000");
        assert_eq!(address("http://[fd00::1]"), "[fd00::1]:80");
    }
}
