//! A generation request's context (like pingora's `CTX`): created once per request in
//! [`super::proxy::proxy`] when its body is parsed, filled in by the phases that follow and
//! passed to each of them.

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderValue;
use tokio::time::Instant;

use crate::openai::{ApiError, Endpoint, ParsedRequest};
use crate::profiles::Snapshot;
use crate::tenants::Grant;
use crate::traces::RequestTrace;

/// A generation request as it arrived, its body read.
#[derive(Debug)]
pub(crate) struct Received {
    pub parts: http::request::Parts,
    pub body: Bytes,
    pub endpoint: Endpoint,
    pub started: Instant,
}

/// One generation request, as its phases fill it in.
#[derive(Debug)]
pub(crate) struct RequestCtx<'r> {
    pub received: &'r Received,
    pub parsed: ParsedRequest<'r>,
    /// The profile set and upstream pools the request is routed and forwarded with.
    pub snapshot: Arc<Snapshot>,
    /// The tenant's admission (tenant limits); `None` without tenants.
    pub grant: Option<Grant>,
    /// The default deadline, or the client's (route).
    pub deadline: Instant,
}

/// What a context owns, apart from the request it borrows: kept while a cold-start stream
/// waits in its body.
#[derive(Debug)]
pub(crate) struct Detached {
    snapshot: Arc<Snapshot>,
    grant: Option<Grant>,
    deadline: Instant,
}

// === impl Detached ===

impl Detached {
    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    pub fn grant(&self) -> Option<&Grant> {
        self.grant.as_ref()
    }

    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

// === impl RequestCtx ===

impl<'r> RequestCtx<'r> {
    pub fn new(received: &'r Received, parsed: ParsedRequest<'r>, snapshot: Arc<Snapshot>) -> Self {
        Self {
            received,
            parsed,
            snapshot,
            grant: None,
            deadline: received.started,
        }
    }

    /// The context again, for the same request parsed again.
    pub fn attach(received: &'r Received, detached: Detached) -> Result<Self, ApiError> {
        // Parsed before, borrowed from a body the caller now owns.
        let parsed = ParsedRequest::parse(&received.body, received.endpoint)?;
        let Detached {
            snapshot,
            grant,
            deadline,
        } = detached;
        Ok(Self {
            received,
            parsed,
            snapshot,
            grant,
            deadline,
        })
    }

    /// What the context owns, to be [attached](Self::attach) to its request again.
    pub fn detach(self) -> Detached {
        Detached {
            snapshot: self.snapshot,
            grant: self.grant,
            deadline: self.deadline,
        }
    }

    pub fn request_id(&self) -> HeaderValue {
        RequestId::of(&self.received.parts)
    }

    /// The request span, with tracing on.
    pub fn trace(&self) -> Option<&'r RequestTrace> {
        self.received.parts.extensions.get::<RequestTrace>()
    }

    pub fn headers(&self) -> &'r http::HeaderMap {
        &self.received.parts.headers
    }
}

/// The request's id, as the request-id layer ([`super::stack`]) set it.
#[derive(Debug, Clone)]
pub struct RequestId(pub HeaderValue);

impl RequestId {
    /// The id the request-id layer gave the request.
    pub fn of(parts: &http::request::Parts) -> HeaderValue {
        parts
            .extensions
            .get::<Self>()
            .map_or_else(|| HeaderValue::from_static("qr"), |id| id.0.clone())
    }
}
