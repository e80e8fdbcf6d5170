//! The agent APIs' endpoints: `POST /v1/messages` and `POST /v1/responses` (routed like
//! chat by [`super::proxy::proxy`], their answers relayed in their API by
//! [`crate::apis::relay`]), and `GET`/`DELETE /v1/responses/{id}` on the profile that
//! stored the response.

use std::sync::Arc;

use bytes::Bytes;
use http::{header, Method, Request, Response};
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::Incoming;
use tokio::time::Instant;

use super::proxy::proxy;
use super::{App, ResponseBody};
use crate::apis::relay::relay;
use crate::apis::AgentApi;
use crate::openai::ApiError;
use crate::pipeline::{self, RequestId, REQUEST_ID};

/// `POST /v1/messages` or `POST /v1/responses`.
pub(super) async fn create(
    app: &Arc<App>,
    req: Request<Incoming>,
    api: AgentApi,
) -> Result<Response<ResponseBody>, ApiError> {
    let response = proxy(app, req, api.endpoint()).await?;
    let on_stored = match api {
        AgentApi::Responses => pipeline::on_stored(app, response.headers()),
        AgentApi::Messages => None,
    };
    Ok(relay(response, api, on_stored))
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
    app.authenticate(&parts.headers)?;
    let path = parts.uri.path().to_owned();
    let id = stored_id(&path).unwrap_or_default().to_owned();
    let method = parts.method.clone();
    let request_id = RequestId::of(&parts);
    let unknown = || ApiError::ResponseNotFound(id.clone());
    let profile = app.responses.profile_of(&id).await.ok_or_else(unknown)?;
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
    Ok(Response::from_parts(head, Either::Left(Full::new(bytes))))
}
