//! The route table and the small handlers that are not completions.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;

use crate::api::{self, json_response, ApiError, Endpoint};
use crate::body::SimBody;
use crate::completion::{self, InjectedAbort};
use crate::faults::Faults;
use crate::state::{unix_now, SimState};

/// Request bodies larger than this are refused; generous for prompts, small enough that a
/// runaway client cannot exhaust a test machine's memory.
const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// What a request asks for, decided from method and path alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Completion(Endpoint),
    /// `GET /v1/responses/{id}`.
    GetResponse,
    /// `DELETE /v1/responses/{id}`.
    DeleteResponse,
    Models,
    Health,
    Metrics,
    SetFaults,
    ClearFaults,
    GetFaults,
    Stats,
    LastRequest,
    MethodNotAllowed,
    NotFound,
}

/// Answers one request. Only an injected abort is an error: it makes hyper drop the connection.
pub(crate) async fn dispatch(
    state: Arc<SimState>,
    request: Request<Incoming>,
) -> Result<Response<SimBody>, InjectedAbort> {
    let route = match route(request.method(), request.uri().path()) {
        Route::Completion(Endpoint::Messages | Endpoint::Responses)
        | Route::GetResponse
        | Route::DeleteResponse
            if state.config.chat_only =>
        {
            Route::NotFound
        }
        route => route,
    };
    if let (Route::Completion(_), http::Version::HTTP_2) = (route, request.version()) {
        state.metrics.http2_requests.fetch_add(1, Ordering::Relaxed);
    }
    if !authorized(&state, route, request.headers()) {
        if let Route::Completion(_) = route {
            // Every completion request received counts, refused or not.
            state.metrics.requests.fetch_add(1, Ordering::Relaxed);
        }
        return Ok(ApiError::Unauthorized.into_response());
    }
    let response = match route {
        Route::Completion(endpoint) => {
            return completion::serve(state, endpoint, request.into_body()).await
        }
        Route::GetResponse | Route::DeleteResponse => {
            stored_response(&state, route, request.uri().path())
        }
        Route::Models => api::model_list(&state.config.model, unix_now())
            .map(json_response)
            .map_err(|e| ApiError::Internal(e.to_string())),
        Route::Health => Ok(Response::new(SimBody::empty())),
        Route::Metrics => metrics(&state),
        Route::SetFaults => set_faults(&state, request.into_body()).await,
        Route::ClearFaults => {
            state.faults.clear();
            faults_response(&state)
        }
        Route::GetFaults => faults_response(&state),
        Route::Stats => serde_json::to_vec(&state.metrics.stats())
            .map(json_response)
            .map_err(|e| ApiError::Internal(e.to_string())),
        Route::LastRequest => match state.last_request() {
            Some(body) => Ok(json_response(body)),
            None => Err(ApiError::RouteNotFound("/sim/last-request".to_owned())),
        },
        Route::MethodNotAllowed => Err(ApiError::MethodNotAllowed),
        Route::NotFound => Err(ApiError::RouteNotFound(request.uri().path().to_owned())),
    };
    Ok(response.unwrap_or_else(ApiError::into_response))
}

fn route(method: &Method, path: &str) -> Route {
    let endpoint = match path {
        "/v1/chat/completions" => Some(Endpoint::Chat),
        "/v1/completions" => Some(Endpoint::Completion),
        "/v1/messages" => Some(Endpoint::Messages),
        "/v1/responses" => Some(Endpoint::Responses),
        _ => None,
    };
    let stored = path
        .strip_prefix("/v1/responses/")
        .is_some_and(|id| !id.is_empty() && !id.contains('/'));
    match (method, path, endpoint) {
        (&Method::GET, _, None) if stored => Route::GetResponse,
        (&Method::DELETE, _, None) if stored => Route::DeleteResponse,
        (&Method::POST, _, Some(endpoint)) => Route::Completion(endpoint),
        (&Method::GET, "/v1/models", _) => Route::Models,
        (&Method::GET, "/health", _) => Route::Health,
        (&Method::GET, "/metrics", _) => Route::Metrics,
        (&Method::POST, "/sim/faults", _) => Route::SetFaults,
        (&Method::DELETE, "/sim/faults", _) => Route::ClearFaults,
        (&Method::GET, "/sim/faults", _) => Route::GetFaults,
        (&Method::GET, "/sim/stats", _) => Route::Stats,
        (&Method::GET, "/sim/last-request", _) => Route::LastRequest,
        (
            _,
            "/v1/models" | "/health" | "/metrics" | "/sim/faults" | "/sim/stats"
            | "/sim/last-request",
            _,
        )
        | (_, _, Some(_)) => Route::MethodNotAllowed,
        _ => Route::NotFound,
    }
}

/// With an API key configured, every route but the health check and the simulator's own
/// controls needs `Authorization: Bearer <key>` (llama.cpp's rule; vLLM leaves `/metrics`
/// open, which makes a scraper that forgets the key harder to catch).
fn authorized(state: &SimState, route: Route, headers: &http::HeaderMap) -> bool {
    let Some(key) = state.config.api_key.as_deref() else {
        return true;
    };
    let open = matches!(
        route,
        Route::Health | Route::SetFaults | Route::ClearFaults | Route::GetFaults | Route::Stats
    );
    open || headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|token| token.trim() == key)
}

/// `GET` or `DELETE /v1/responses/{id}`: a stored Responses answer.
fn stored_response(
    state: &SimState,
    route: Route,
    path: &str,
) -> Result<Response<SimBody>, ApiError> {
    let id = path.trim_start_matches("/v1/responses/");
    let missing = || ApiError::RouteNotFound(format!("response {id}"));
    match route {
        Route::DeleteResponse if state.delete_response(id) => Ok(json_response(
            serde_json::json!({"id": id, "object": "response", "deleted": true}).to_string(),
        )),
        Route::GetResponse => state
            .stored_response(id)
            .map(json_response)
            .ok_or_else(missing),
        _ => Err(missing()),
    }
}

/// Reads a whole request body, refusing oversized ones.
pub(crate) async fn read_body(body: Incoming) -> Result<Bytes, ApiError> {
    match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => {
            Err(ApiError::PayloadTooLarge(MAX_BODY_BYTES))
        }
        Err(error) => Err(ApiError::BadRequest(format!(
            "Failed to read the request body: {error}"
        ))),
    }
}

fn metrics(state: &SimState) -> Result<Response<SimBody>, ApiError> {
    let text = state
        .metrics
        .render(
            &state.config.model,
            state.max_num_seqs(),
            state.config.metrics_flavor,
        )
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    let mut response = Response::new(SimBody::full(text));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    Ok(response)
}

async fn set_faults(state: &SimState, body: Incoming) -> Result<Response<SimBody>, ApiError> {
    let body = read_body(body).await?;
    let faults: Faults = serde_json::from_slice(&body)
        .map_err(|e| ApiError::BadRequest(format!("Invalid faults: {e}")))?;
    faults
        .validate()
        .map_err(|e| ApiError::BadRequest(format!("Invalid faults: {e}")))?;
    tracing::info!(?faults, "faults set");
    state.faults.set(faults);
    faults_response(state)
}

/// Answers with the fault set now in force.
fn faults_response(state: &SimState) -> Result<Response<SimBody>, ApiError> {
    serde_json::to_vec(&state.faults.snapshot())
        .map(json_response)
        .map_err(|e| ApiError::Internal(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_by_method_and_path() {
        assert_eq!(
            route(&Method::POST, "/v1/completions"),
            Route::Completion(Endpoint::Completion)
        );
        assert_eq!(
            route(&Method::GET, "/v1/chat/completions"),
            Route::MethodNotAllowed
        );
        assert_eq!(route(&Method::DELETE, "/sim/faults"), Route::ClearFaults);
        assert_eq!(route(&Method::POST, "/health"), Route::MethodNotAllowed);
        assert_eq!(route(&Method::GET, "/v2/models"), Route::NotFound);
    }
}
