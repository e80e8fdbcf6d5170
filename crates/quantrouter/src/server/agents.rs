//! The agent APIs' endpoints: `POST /v1/messages` and `POST /v1/responses` (routed like
//! chat by [`super::proxy::proxy`], their answers relayed in their API by
//! [`crate::apis::relay`]), and `GET`/`DELETE /v1/responses/{id}` on the profile that
//! stored the response. A stored response belongs to the tenant whose request stored it;
//! to every other tenant it does not exist (404 `response_not_found`).

use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response};
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::Incoming;
use quantrouter_policy::limits::{RateHeaders, Reservation};
use tokio::time::Instant;

use super::proxy::{proxy, read_json_body};
use super::{App, ResponseBody};
use crate::apis::relay::relay;
use crate::apis::{AgentApi, RequestSlot, DROPPED_TOOLS_HEADER};
use crate::openai::ApiError;
use crate::pipeline::{self, RequestId, REQUEST_ID};
use crate::routing::PROFILE_HEADER;
use crate::tenants::gate::{insert_rate_headers, Charge};
use crate::tenants::ActiveTenant;

/// `POST /v1/messages` or `POST /v1/responses`.
pub(super) async fn create(
    app: &Arc<App>,
    mut req: Request<Incoming>,
    api: AgentApi,
) -> Result<Response<ResponseBody>, ApiError> {
    // The tenant a stored answer will belong to (`proxy` refuses a bad key the same way).
    let owner = match api {
        AgentApi::Responses => owner(app.authenticate(req.headers())?),
        AgentApi::Messages => None,
    };
    let slot = RequestSlot::default();
    req.extensions_mut().insert(slot.clone());
    let mut response = proxy(app, req, api.endpoint()).await?;
    report_dropped_tools(app, &mut response, api, &slot);
    let on_stored = match api {
        AgentApi::Responses => pipeline::on_stored(app, response.headers(), owner),
        AgentApi::Messages => None,
    };
    Ok(relay(response, api, slot, on_stored))
}

/// `x-quantrouter-dropped-tools`: the hosted tools a translating profile's request went
/// without. (A cold-start stream's head leaves before the request is translated.)
fn report_dropped_tools(
    app: &App,
    response: &mut Response<ResponseBody>,
    api: AgentApi,
    slot: &RequestSlot,
) {
    let Some(request) = slot.0.get().filter(|r| !r.dropped_tools.is_empty()) else {
        return;
    };
    let served = response
        .headers()
        .get(PROFILE_HEADER)
        .and_then(|v| v.to_str().ok());
    let snapshot = app.store.load();
    let translated = served
        .and_then(|id| snapshot.set.index_of(id))
        .is_some_and(|i| !snapshot.set.profiles[i].upstream.serves(api.upstream()));
    if let (true, Ok(value)) = (
        translated,
        HeaderValue::from_str(&request.dropped_tools.join(", ")),
    ) {
        response.headers_mut().insert(DROPPED_TOOLS_HEADER, value);
    }
}

/// `POST /v1/messages/count_tokens`: [`pipeline::count_tokens`].
pub(super) async fn count_tokens(
    app: &Arc<App>,
    req: Request<Incoming>,
) -> Result<Response<ResponseBody>, ApiError> {
    let (parts, body) = req.into_parts();
    app.authenticate(&parts.headers)?;
    let body = read_json_body(app, body, &parts.headers).await?;
    let counted = pipeline::count_tokens(app, &body)?;
    let mut response = Response::new(Either::Left(Full::new(counted)));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(response)
}

/// The id of the tenant that owns what a request stores; `None` without tenants.
fn owner(tenant: Option<Arc<ActiveTenant>>) -> Option<String> {
    tenant.map(|t| t.id.to_string())
}

/// The id in `/v1/responses/{id}`.
pub(super) fn stored_id(path: &str) -> Option<&str> {
    path.strip_prefix("/v1/responses/")
        .filter(|id| !id.is_empty() && !id.contains('/'))
}

/// `GET` or `DELETE /v1/responses/{id}`: asked of the profile that stored the response.
pub(super) async fn stored(
    app: &Arc<App>,
    req: Request<Incoming>,
) -> Result<Response<ResponseBody>, ApiError> {
    /// A stored response is one answer; far above any.
    const LIMIT: usize = 16 * 1024 * 1024;
    let (parts, _) = req.into_parts();
    let tenant = app.authenticate(&parts.headers)?;
    let owner = owner(tenant.clone());
    let rate = count_read(app, tenant).await?;
    let path = parts.uri.path().to_owned();
    let id = stored_id(&path).unwrap_or_default().to_owned();
    let method = parts.method.clone();
    let request_id = RequestId::of(&parts);
    let unknown = || ApiError::ResponseNotFound(id.clone());
    let profile = app
        .responses
        .profile_of(&id, owner.as_deref())
        .await
        .ok_or_else(unknown)?;
    let snapshot = app.store.load();
    let index = snapshot.set.index_of(&profile).ok_or_else(unknown)?;
    let pool = &snapshot.runtime[index].pool;
    let pick = pool
        .pick(&[], Instant::now())
        .ok_or_else(|| ApiError::Unavailable(format!("profile {profile} has no endpoint now")))?;
    let uri = pick
        .endpoint
        .uri(&path)
        .map_err(|e| ApiError::BadGateway(e.to_string()))?;
    let mut upstream = Request::builder()
        .method(method.clone())
        .uri(uri)
        .body(Bytes::new())
        .map_err(|e| ApiError::BadGateway(e.to_string()))?;
    upstream.headers_mut().insert(REQUEST_ID, request_id);
    if let Some(auth) = pool.authorization() {
        upstream.headers_mut().insert(header::AUTHORIZATION, auth);
    }
    let timeout = app.client.header_timeout;
    let sent = Instant::now();
    let answer = match app
        .client
        .send(pool.transport(), &pick.endpoint, upstream, timeout)
        .await
    {
        Ok(answer) => {
            pick.succeeded(sent.elapsed());
            answer
        }
        Err(error) => {
            pick.failed();
            return Err(ApiError::Unavailable(format!("profile {profile}: {error}")));
        }
    };
    let (mut head, body) = answer.into_parts();
    let bytes = Limited::new(body, LIMIT)
        .collect()
        .await
        .map_err(|e| ApiError::BadGateway(format!("reading the stored response: {e}")))?
        .to_bytes();
    if method == Method::DELETE && head.status.is_success() {
        app.responses.forget(&id).await;
    }
    head.headers.remove(header::TRANSFER_ENCODING);
    head.headers.remove(header::CONNECTION);
    if let Some(rate) = &rate {
        insert_rate_headers(&mut head.headers, rate);
    }
    Ok(Response::from_parts(head, Either::Left(Full::new(bytes))))
}

/// A read or delete of a stored response counts as one request against the tenant's
/// limits, whatever it answers: each may be an upstream request, and none uses tokens.
/// Refused like any request at a limit (429, `Retry-After`).
async fn count_read(
    app: &App,
    tenant: Option<Arc<ActiveTenant>>,
) -> Result<Option<RateHeaders>, ApiError> {
    let (Some(tenants), Some(tenant)) = (&app.tenants, tenant) else {
        return Ok(None);
    };
    let mut grant = tenants.admit(tenant, 0, Reservation::default()).await?;
    tenants.settle(&mut grant)(Charge::Used {
        input: 0,
        output: 0,
        cost: 0.0,
    });
    Ok(Some(grant.rate))
}
