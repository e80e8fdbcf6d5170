//! The headers the pipeline writes: the router's own on every answer (`x-quantrouter-*`,
//! the tenant's `x-ratelimit-*`), and which client headers never reach a model server.

use std::sync::Arc;

use http::{header, HeaderMap, HeaderName, HeaderValue};
use quantrouter_policy::{ProfileIndex, Reason, RoutingDecision};

use super::context::{RequestCtx, REQUEST_ID};
use crate::resilience::retry::{Fallback, FallbackReason};
use crate::telemetry::RequestLabels;

/// Says whether the conversation's profile or the prompt's cached prefix decided.
pub(crate) const AFFINITY_HEADER: HeaderName = HeaderName::from_static("x-quantrouter-affinity");

/// Client headers that carry a credential: the caller's key is the router's business, and
/// a model server gets its own key, if any.
const CREDENTIALS: [HeaderName; 4] = [
    header::AUTHORIZATION,
    header::PROXY_AUTHORIZATION,
    HeaderName::from_static("x-api-key"),
    HeaderName::from_static("api-key"),
];

/// The prefix of the headers a Gateway's endpoint picker answers with, which Envoy trusts as
/// they arrive (`ORIGINAL_DST`): `x-gateway-destination-endpoint`, `-fallback`, `-subset`…
const DESTINATION_PREFIX: &str = "x-gateway-destination-endpoint";

/// Client headers worth passing to a model server; everything else (API keys above all)
/// stays here.
const FORWARDED: [HeaderName; 5] = [
    header::ACCEPT,
    header::USER_AGENT,
    HeaderName::from_static("traceparent"),
    HeaderName::from_static("tracestate"),
    HeaderName::from_static("openai-organization"),
];

/// How a request was served, for the response headers and metric labels.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Served {
    pub profile: ProfileIndex,
    /// Attempts made; 0 when not known yet (a stream answered before it is sent).
    pub attempts: u32,
    pub fallback: Option<Fallback>,
}

// === impl Served ===

impl Served {
    pub fn reason(&self, decision: &RoutingDecision) -> Reason {
        match self.fallback {
            Some(Fallback {
                reason: FallbackReason::Quality,
                ..
            }) => Reason::FallbackQuality,
            Some(_) => Reason::FallbackError,
            None => decision.reason,
        }
    }

    pub fn labels(&self, ctx: &RequestCtx) -> RequestLabels {
        RequestLabels {
            profile: Arc::clone(&ctx.snapshot.runtime[self.profile].telemetry),
            reason: self.reason(&ctx.routed.decision),
        }
    }
}

/// Step 3: the router's headers on an answer — the profile, tier, reason, attempts,
/// complexity, second opinion, fallback and affinity, and the tenant's rate limits.
pub(crate) fn router_headers(headers: &mut HeaderMap, ctx: &RequestCtx, served: &Served) {
    const PROFILE: HeaderName = HeaderName::from_static("x-quantrouter-profile");
    const TIER: HeaderName = HeaderName::from_static("x-quantrouter-tier");
    const REASON: HeaderName = HeaderName::from_static("x-quantrouter-reason");
    const ATTEMPTS: HeaderName = HeaderName::from_static("x-quantrouter-attempts");
    const COMPLEXITY: HeaderName = HeaderName::from_static("x-quantrouter-complexity");
    let (snapshot, decision) = (&ctx.snapshot, &ctx.routed.decision);
    let telemetry = &snapshot.runtime[served.profile].telemetry;
    let attempts = (served.attempts > 0).then(|| attempts_header(served.attempts));
    let values = [
        (PROFILE, telemetry.profile_header.clone()),
        (TIER, telemetry.tier_header.clone()),
        (
            REASON,
            Some(HeaderValue::from_static(served.reason(decision).as_str())),
        ),
        (ATTEMPTS, attempts),
        (COMPLEXITY, complexity_header(decision.complexity)),
        (
            AFFINITY_HEADER,
            Some(HeaderValue::from_static(
                ctx.routed.affinity_used().as_str(),
            )),
        ),
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
    if let Some(grant) = &ctx.grant {
        crate::tenants::gate::insert_rate_headers(headers, &grant.rate);
    }
}

/// The client headers a door that passes the rest on must remove before a model server
/// sees the request: every credential, and every Gateway destination header (the picker
/// sets only the ones it chose).
pub(crate) fn strip_client_headers(headers: &HeaderMap) -> Vec<&HeaderName> {
    headers
        .keys()
        .filter(|name| CREDENTIALS.contains(name) || name.as_str().starts_with(DESTINATION_PREFIX))
        .collect()
}

/// Headers for every upstream request the router sends itself: JSON content type, the
/// client headers worth forwarding, and the request id.
pub(crate) fn upstream_headers(client: &HeaderMap, request_id: &HeaderValue) -> HeaderMap {
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
pub(crate) fn complexity_header(score: f64) -> Option<HeaderValue> {
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
