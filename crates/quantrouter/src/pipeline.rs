//! The one request pipeline behind both front doors: the HTTP port ([`crate::server`]) and
//! the endpoint picker of a Gateway ([`crate::epp`]). A door only translates its protocol;
//! every step that decides or counts something is here, called in this order:
//!
//! 1. [`route`]: from authentication to the routed request — the key (`Authorization:
//!    Bearer` or `x-api-key`), the body (read by the door, only for a known key), its parse,
//!    a Responses follow-up pinned where its predecessor is stored, the tenant's limits, a
//!    second opinion, the policy's decision with session affinity and the prompt's prefix
//!    blocks, KEDA's demand, the deadline and the wait for a tier scaling from zero. It
//!    returns the request's one owned context, [`RequestCtx`].
//! 2. [`admission_slot`]: a slot of the chosen tier's admission queue, by tenant priority,
//!    then [`pick_endpoint`]: the endpoint, by cached prefix and load.
//! 3. [`router_headers`]: the `x-quantrouter-*` and `x-ratelimit-*` headers of the answer.
//! 4. [`ledger`]: the answer's head counted, and its [`Ledger`], which books usage, cost, the
//!    tenant's spend, the calibration sample and the trace when the answer ends.
//!
//! What happens between 2 and 3 — sending the request and relaying the answer — is the
//! door's: the HTTP port's [`crate::resilience::retry::Forwarder`] with its retries and
//! fallbacks, or the Gateway's own connection to the endpoint the picker named.

mod admission;
mod bookkeeping;
mod context;
mod decision;
mod headers;
mod stored;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, Response};
use http_body_util::Full;
use quantrouter_policy::limits::Reservation;
use quantrouter_policy::{ProfileIndex, RoutingDecision};
use tokio::time::Instant;

use crate::apis::AgentApi;
use crate::app::App;
use crate::openai::{ApiError, Endpoint as Api, ParsedRequest};
use crate::profiles::Snapshot;
use crate::resilience::Permit;
use crate::second_opinion::Rated;
use crate::telemetry;
use crate::tenants::{ActiveTenant, Grant};
use crate::upstream::{Endpoint, Pick};

pub(crate) use admission::admit_to;
pub(crate) use bookkeeping::{ledger, reads_answer, AnswerHead, Ledger};
pub(crate) use context::{Arrival, Door, Received, RequestCtx, Shape};
pub use context::{RequestId, REQUEST_ID};
pub(crate) use decision::{wait_for_cold_tier, DecisionLog};
#[cfg(test)]
pub(crate) use headers::complexity_header;
pub(crate) use headers::{router_headers, strip_client_headers, upstream_headers, Served};
pub(crate) use stored::{on_stored, StoredWatch};

/// Step 1: from authentication to the routed request. Refuses an unknown key before the
/// body is read, and anything the policy, the tenant's limits or the profile set cannot
/// serve; on success the request has its decision, its deadline and, unless the door lets
/// a stream wait in its body ([`Door::streams_while_cold`]), an endpoint of a tier that was
/// scaled to zero.
pub(crate) async fn route<B, F>(app: &App, arrival: Arrival<B>) -> Result<RequestCtx, ApiError>
where
    B: FnOnce(Option<&Arc<ActiveTenant>>) -> F,
    F: Future<Output = Result<Bytes, ApiError>>,
{
    let Arrival {
        mut parts,
        endpoint,
        started,
        body,
        door,
    } = arrival;
    // Auth: only known keys spend upstream capacity, or have their bodies read.
    let tenant = app.authenticate(&parts.headers)?;
    check_content_type(&parts.headers)?;
    let body = body(tenant.as_ref()).await?;
    let parsed = ParsedRequest::parse(&body, endpoint)?;
    // A Responses follow-up goes where the response it continues is stored.
    if let Some(previous) = &parsed.previous_response_id {
        let owner = tenant.as_deref().map(|t| &*t.id);
        stored::place_follow_up(app, &mut parts.headers, previous, owner).await?;
    }
    let snapshot = app.store.load();
    // Tenant limits: refused at a hard limit, routed cheaper past a soft one.
    let grant = admit_tenant(app, tenant, &parsed, &snapshot).await?;
    // Route: the policy's decision, with the request's and the tenant's overrides, and a
    // cheap tier's rating when the risk is uncertain (`policy.second_opinion`).
    let rated = Rated {
        snapshot: &snapshot,
        parsed: &parsed,
        headers: &parts.headers,
        tenant: grant.as_ref().map(|g| &*g.tenant),
    };
    let rating = crate::second_opinion::consult(app, rated).await;
    let among = among(&snapshot, &door, AgentApi::of(endpoint))?;
    let request_id = RequestId::of(&parts);
    let decided = decision::Decide {
        snapshot: &snapshot,
        parsed: &parsed,
        headers: &parts.headers,
        request_id: request_id.to_str().unwrap_or_default(),
        grant: grant.as_ref(),
    };
    let routed = decided.route(app, rating, among.as_deref(), door.subset.is_some())?;
    let timeout = crate::routing::timeout(&parts.headers)?;
    DecisionLog {
        snapshot: &snapshot,
        decision: &routed.decision,
        parsed: &parsed,
        request_id: request_id.to_str().unwrap_or_default(),
    }
    .record(app, parts.extensions.get());
    let mut shape = Shape::of(&parsed);
    shape.ceilings = ceilings(&snapshot, &routed.decision, &parsed);
    if !door.strips_usage {
        shape.rewrite = shape.rewrite.without_usage();
    }
    let stream = parsed.stream;
    drop(parsed);
    let ctx = RequestCtx {
        received: Received {
            parts,
            body,
            endpoint,
            started,
        },
        shape,
        snapshot,
        grant,
        deadline: started + timeout.unwrap_or(app.config.resilience.default_deadline),
        routed,
        subset: door.subset,
    };
    // Cold wait: a tier scaling from zero gets its first endpoint, or the request fails.
    if !(stream && door.streams_while_cold) {
        wait_for_cold_tier(&ctx).await?;
    }
    Ok(ctx)
}

/// Step 2: a slot in `profile`'s admission queue, by the tenant's priority, within the
/// queue timeout and the request's deadline; held until the answer ends.
pub(crate) async fn admission_slot(
    app: &App,
    ctx: &RequestCtx,
    profile: ProfileIndex,
) -> Result<Permit, ApiError> {
    let priority = ctx.grant.as_ref().map_or(0, |g| g.tenant.priority);
    let pool = &ctx.snapshot.runtime[profile].pool;
    let id = &ctx.snapshot.set.profiles[profile].id;
    let queue_timeout = app.config.resilience.admission.queue_timeout;
    admit_to(pool, id, priority, queue_timeout.min(until(ctx.deadline))).await
}

/// Step 2, then: an endpoint of `profile` not yet `tried` and within the door's subset — by
/// the prompt's cached prefix where the profile balances by prefix, else by load.
pub(crate) fn pick_endpoint(
    ctx: &RequestCtx,
    profile: ProfileIndex,
    tried: &[Arc<Endpoint>],
) -> Option<Pick> {
    let pool = &ctx.snapshot.runtime[profile].pool;
    let placement = &ctx.routed.placement;
    let placed = crate::upstream::placed(&ctx.snapshot.set, profile, placement);
    let Some(subset) = &ctx.subset else {
        return pool.pick_placed(placed, tried, Instant::now());
    };
    let mut outside: Vec<Arc<Endpoint>> = pool
        .endpoints()
        .iter()
        .filter(|e| !subset.contains(&address(e.base())))
        .cloned()
        .collect();
    outside.extend(tried.iter().cloned());
    pool.pick_placed(placed, &outside, Instant::now())
}

/// A refusal, as every door answers it: counted, logged (without what the client sent
/// unless prompts may be logged), in the API's own error shape — Anthropic's on
/// `/v1/messages`, OpenAI's elsewhere (`endpoint`: the generation endpoint the request
/// was for, if any).
pub(crate) fn refusal(app: &App, error: ApiError, endpoint: Option<Api>) -> Response<Full<Bytes>> {
    let code = error.kind().1;
    telemetry::router_error(code);
    match error.quotes_request() && !app.config.log_prompts {
        true => tracing::debug!(code, "request rejected"),
        false => tracing::debug!(%error, code, "request rejected"),
    }
    match endpoint == Some(Api::Messages) {
        true => crate::apis::anthropic_error_response(error),
        false => error.into_response(),
    }
}

/// `POST /v1/messages/count_tokens` at either door: the router's own estimate of the
/// prompt's tokens (text and tool definitions, at the default profile's characters per
/// token), the one its context checks use; no upstream is asked. `body` is the request's,
/// read once its key was accepted.
pub(crate) fn count_tokens(app: &App, body: &[u8]) -> Result<Bytes, ApiError> {
    let parsed = ParsedRequest::parse_to_count(body)?;
    let snapshot = app.store.load();
    let set = &snapshot.set;
    let (features, _) = quantrouter_policy::score(&parsed.prompt(), &set.policy.complexity, None);
    let profile = set.default_index();
    let per_token = crate::routing::chars_per_token(&snapshot, profile);
    let tools = crate::routing::tool_tokens(&snapshot, profile, parsed.tools_bytes);
    let tokens = features.estimated_input_tokens(per_token) + tools;
    Ok(Bytes::from(
        serde_json::json!({"input_tokens": tokens}).to_string(),
    ))
}

/// The time left until `deadline`.
fn until(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// The profiles the door can send the request to, by index; `None`: all of them. A door
/// that cannot translate sends an agent API only to profiles that serve it natively, and a
/// subset leaves out the tiers with no endpoint in it.
fn among(
    snapshot: &Snapshot,
    door: &Door,
    api: Option<AgentApi>,
) -> Result<Option<Vec<bool>>, ApiError> {
    let native = api.filter(|_| !door.translates);
    if native.is_none() && door.subset.is_none() {
        return Ok(None);
    }
    let mask: Vec<bool> = snapshot
        .set
        .profiles
        .iter()
        .zip(snapshot.pools())
        .map(|(profile, pool)| {
            let serves = native.is_none_or(|api| profile.upstream.serves(api.upstream()));
            let in_subset = door.subset.as_ref().is_none_or(|subset| {
                pool.endpoints()
                    .iter()
                    .any(|e| subset.contains(&address(e.base())))
            });
            serves && in_subset
        })
        .collect();
    if let Some(api) = native {
        let served = snapshot
            .set
            .profiles
            .iter()
            .any(|p| p.enabled && p.upstream.serves(api.upstream()));
        if !served {
            return Err(ApiError::InvalidRequest {
                message: format!(
                    "No enabled profile serves {} natively, and requests through the Gateway \
                     cannot be translated to Chat Completions; send them to the router's HTTP \
                     port.",
                    api.endpoint().path()
                ),
                param: None,
            });
        }
    }
    Ok(Some(mask))
}

/// `policy.output_ceiling`, per profile: the output limits that profiles' contexts hold,
/// where they lower the request's; empty when the request sets no limit.
fn ceilings(
    snapshot: &Snapshot,
    decision: &RoutingDecision,
    parsed: &ParsedRequest<'_>,
) -> Box<[Option<u32>]> {
    if parsed.max_tokens.is_none() {
        return Box::default();
    }
    (0..snapshot.set.profiles.len())
        .map(|p| crate::routing::output_ceiling(snapshot, decision, parsed, ProfileIndex::new(p)))
        .collect()
}

/// The tenant's limits, before routing: one counter round trip at most. The request
/// reserves its worst case — the prompt's estimate (a quarter of its bytes) plus
/// `max_tokens` for each of its `n` choices, at the dearest profile the tenant may be served
/// by — settled to what it used when the answer ends.
async fn admit_tenant(
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

/// Only JSON bodies (or none declared) are read.
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
