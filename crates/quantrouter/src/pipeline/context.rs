//! A generation request's context (like pingora's `CTX`): made once per request by
//! [`super::route`] and owned from then on by whichever door the request came in by, which
//! hands it to each phase that follows.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use tokio::time::Instant;

use quantrouter_policy::ProfileIndex;

use crate::openai::{BodyEdits, BodyRewrite, Endpoint, ParsedRequest};
use crate::profiles::Snapshot;
use crate::routing::Routed;
use crate::tenants::Grant;
use crate::traces::RequestTrace;

/// The request id header, taken from clients and sent to upstreams and back.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// A generation request at a door: its head, and its body still to come — `body` reads it
/// whole, within the door's limits, once the caller (its tenant, if any) is known, and only
/// then.
#[derive(Debug)]
pub(crate) struct Arrival<B> {
    pub parts: http::request::Parts,
    pub endpoint: Endpoint,
    pub started: Instant,
    pub body: B,
    pub door: Door,
}

/// What a door can do, which shapes how its requests are routed.
#[derive(Debug, Default)]
pub(crate) struct Door {
    /// Bodies go out per profile, natively or translated to chat (the HTTP port); without
    /// it an agent API goes only to the profiles that serve it natively.
    pub translates: bool,
    /// A stream can answer at once and wait for a tier scaling from zero in its body (the
    /// HTTP port); without it the wait comes before the request is routed on.
    pub streams_while_cold: bool,
    /// The only endpoints the request may go to, as `ip:port` (a Gateway's subset hint);
    /// `None`: any.
    pub subset: Option<Vec<String>>,
    /// The door can cut the usage chunk the router asks for from a stream on its way back.
    pub strips_usage: bool,
}

/// A generation request as it arrived, its body read.
#[derive(Debug)]
pub(crate) struct Received {
    pub parts: http::request::Parts,
    pub body: Bytes,
    pub endpoint: Endpoint,
    pub started: Instant,
}

/// What the phases after routing read of the request's parse, owned: the context keeps
/// the body, not a parse borrowing from it.
#[derive(Debug, Clone)]
pub(crate) struct Shape {
    pub stream: bool,
    pub wants_json: bool,
    pub max_tokens: Option<u32>,
    pub choices: u32,
    pub offers_tools: bool,
    /// How the body is written for each profile (`model`, the usage chunk).
    pub rewrite: BodyRewrite,
    /// Per profile, by index: the output limit its context holds, where it is below the
    /// request's (`policy.output_ceiling`); empty when no limit is lowered.
    pub ceilings: Box<[Option<u32>]>,
}

/// One routed generation request: made by [`super::route`], then read and filled in by
/// the door's phases until its answer is booked.
#[derive(Debug)]
pub(crate) struct RequestCtx {
    pub received: Received,
    pub shape: Shape,
    /// The profile set and upstream pools the request is routed and forwarded with.
    pub snapshot: Arc<Snapshot>,
    /// The tenant's admission (tenant limits); `None` without tenants.
    pub grant: Option<Grant>,
    /// The default deadline, or the client's.
    pub deadline: Instant,
    pub routed: Routed,
    /// The endpoints the request may go to (the door's subset), `None`: any.
    pub subset: Option<Vec<String>>,
}

// === impl Shape ===

impl Shape {
    pub fn of(parsed: &ParsedRequest<'_>) -> Self {
        Self {
            stream: parsed.stream,
            wants_json: parsed.wants_json,
            max_tokens: parsed.max_tokens,
            choices: parsed.choices,
            offers_tools: parsed.offers_tools,
            rewrite: parsed.rewrite(),
            ceilings: Box::default(),
        }
    }

    /// The output limit `profile`'s context holds, where it lowers the request's.
    pub fn ceiling(&self, profile: ProfileIndex) -> Option<u32> {
        self.ceilings.get(profile.get()).copied().flatten()
    }
}

// === impl RequestCtx ===

impl RequestCtx {
    pub fn request_id(&self) -> HeaderValue {
        RequestId::of(&self.received.parts)
    }

    /// The request span, with tracing on.
    pub fn trace(&self) -> Option<&RequestTrace> {
        self.received.parts.extensions.get::<RequestTrace>()
    }

    pub fn headers(&self) -> &http::HeaderMap {
        &self.received.parts.headers
    }

    /// The body for `profile`'s upstream: the client's, with that profile's model, output
    /// ceiling and the tenant's cache salt ([`BodyRewrite::apply`]).
    pub fn upstream_body(&self, profile: ProfileIndex) -> Bytes {
        let model_json = &self.snapshot.runtime[profile].model_json;
        self.shape
            .rewrite
            .apply(&self.received.body, model_json, self.edits(profile))
    }

    /// What routing changes in the body on its way to `profile`.
    pub fn edits(&self, profile: ProfileIndex) -> BodyEdits<'_> {
        BodyEdits {
            ceiling: self.shape.ceiling(profile),
            cache_salt: self.routed.cache_salt.as_deref(),
        }
    }
}

/// The request's id, as the door gave it ([`RequestId::assign`]).
#[derive(Debug, Clone)]
pub struct RequestId(pub HeaderValue);

impl RequestId {
    /// The id the door gave the request.
    pub fn of(parts: &http::request::Parts) -> HeaderValue {
        parts
            .extensions
            .get::<Self>()
            .map_or_else(|| HeaderValue::from_static("qr"), |id| id.0.clone())
    }

    /// The client's `x-request-id` (1 to 128 bytes), or `next` made one; kept in the
    /// request's extensions and returned.
    pub fn assign(
        parts: &mut http::request::Parts,
        next: impl FnOnce() -> HeaderValue,
    ) -> HeaderValue {
        let id = match parts.headers.get(&REQUEST_ID) {
            Some(v) if !v.is_empty() && v.len() <= 128 => v.clone(),
            _ => next(),
        };
        parts.extensions.insert(Self(id.clone()));
        id
    }
}
