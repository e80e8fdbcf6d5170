//! The admin port: metrics, liveness, readiness and the active profile set. Separate from
//! the public port so a sidecar can keep it private.

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;

use crate::server::App;

/// Answers one admin request.
pub fn handle(app: &App, req: Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
    }
    match req.uri().path() {
        "/metrics" => {
            let mut response = text(StatusCode::OK, crate::telemetry::render(&app.metrics));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            response
        }
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" if app.ready() => text(StatusCode::OK, "ready\n"),
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
        "/admin/profiles" => {
            let snapshot = app.store.load();
            let loaded_at = snapshot
                .loaded_at
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default();
            let body = serde_json::json!({
                "source": snapshot.source,
                "version": snapshot.set.version,
                "updated_at": snapshot.set.updated_at,
                "loaded_at_unix": loaded_at,
                "profile_set": snapshot.set,
            });
            let mut response = text(StatusCode::OK, body.to_string());
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            response
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response
}
