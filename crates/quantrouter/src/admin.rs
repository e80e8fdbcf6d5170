//! The admin port: metrics, liveness, readiness, the active profile set and classifier, the
//! tenants' usage, and the tier numbers for KEDA's metrics-api trigger. Separate from the
//! public port so a sidecar can keep it private.

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;

use crate::app::App;

/// Answers one admin request.
pub async fn handle(app: &App, req: Request<Incoming>) -> Response<Full<Bytes>> {
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
            json(StatusCode::OK, &body)
        }
        "/admin/classifier" => json(StatusCode::OK, &app.config.classifier.load().describe()),
        "/admin/tenants" => tenants(app).await,
        "/admin/calibration" => {
            let snapshot = app.store.load();
            let report = app
                .calibrator
                .report(snapshot.set.policy.calibration.as_ref());
            match serde_json::to_value(&report) {
                Ok(body) => json(StatusCode::OK, &body),
                Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            }
        }
        path => match path.strip_prefix("/keda/tiers/") {
            Some(tier) => keda_tier(app, tier).await,
            None => text(StatusCode::NOT_FOUND, "not found\n"),
        },
    }
}

/// `GET /keda/tiers/{tier}`: the tier's numbers, cluster-wide when Redis answers.
async fn keda_tier(app: &App, tier: &str) -> Response<Full<Bytes>> {
    let snapshot = app.store.load();
    match app.keda.tier(&snapshot, tier).await {
        Some(report) => match serde_json::to_value(&report) {
            Ok(body) => json(StatusCode::OK, &body),
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        },
        None => {
            let mut tiers: Vec<&str> = snapshot
                .set
                .profiles
                .iter()
                .map(|p| p.tier.as_str())
                .collect();
            tiers.sort_unstable();
            tiers.dedup();
            let message = format!(
                "no tier `{}` in the active profile set (tiers: {})",
                crate::keda::quoted(tier),
                tiers.join(", ")
            );
            let body = crate::openai::error_body(
                &message,
                "not_found_error",
                Some("tier"),
                Some("unknown_tier"),
            );
            json(StatusCode::NOT_FOUND, &body)
        }
    }
}

/// `GET /admin/tenants`: each tenant's limits and usage in the current windows; of a key,
/// only a short prefix of its hash.
async fn tenants(app: &App) -> Response<Full<Bytes>> {
    let Some(tenants) = &app.tenants else {
        let body = crate::openai::error_body(
            "no tenants are configured (--tenants, a tenant document in Redis, or --api-keys-file)",
            "not_found_error",
            None,
            Some("no_tenants"),
        );
        return json(StatusCode::NOT_FOUND, &body);
    };
    let snapshot = tenants.store.load();
    let now = tenants.clock.now_ms();
    let report = crate::tenants::usage::usage(&tenants.limiter, &snapshot, now).await;
    match serde_json::to_value(&report) {
        Ok(body) => json(StatusCode::OK, &body),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

fn json(status: StatusCode, body: &serde_json::Value) -> Response<Full<Bytes>> {
    let mut response = text(status, body.to_string());
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response
}
