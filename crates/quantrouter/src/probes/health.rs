//! Active health checks: every endpoint gets `GET /health` (or `GET /v1/models` on a server
//! without one) every few seconds, jittered, and the outcome feeds the endpoint's circuit
//! breaker like a request's would. An upstream that is down is then noticed without any
//! traffic, so `/readyz` turns 503 when nothing can serve, and a recovered one closes its
//! circuit again on its own.
//!
//! An open circuit is checked the moment its open time ends (not at the next regular pass),
//! so an endpoint that is still down reopens at once instead of looking ready meanwhile.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Request, StatusCode};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::profiles::ProfileStore;
use crate::resilience::CircuitState;
use crate::upstream::{Endpoint, Pool, UpstreamClient};

/// Runs until aborted: a pass over every endpoint every `interval` (±20% so replicas and
/// endpoints spread out), each check bounded by `timeout`, and in between a check of each
/// endpoint whose circuit just turned half-open.
pub fn spawn(
    store: Arc<ProfileStore>,
    client: UpstreamClient,
    interval: Duration,
    timeout: Duration,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut next_pass = Instant::now();
        loop {
            let now = Instant::now();
            let snapshot = store.load();
            let full = now >= next_pass;
            let checks = snapshot.pools().flat_map(|pool| {
                let client = &client;
                pool.endpoints()
                    .iter()
                    // Between passes, only circuits whose open time is up.
                    .filter(|e| full || e.circuit(now) == CircuitState::HalfOpen)
                    .map(|endpoint| check(client, pool, Arc::clone(endpoint), timeout))
                    .collect::<Vec<_>>()
            });
            futures_util::future::join_all(checks).await;
            if full {
                next_pass = Instant::now() + interval.mul_f64(0.8 + 0.4 * fastrand::f64());
            }
            // Wake for the next pass, or as soon as an open circuit may be probed.
            let reopening = snapshot
                .pools()
                .flat_map(|pool| {
                    pool.endpoints()
                        .iter()
                        .filter_map(|e| e.open_until())
                        .collect::<Vec<_>>()
                })
                .filter(|until| *until > Instant::now())
                .min();
            drop(snapshot);
            let wake = reopening.map_or(next_pass, |until| until.min(next_pass));
            tokio::time::sleep_until(wake).await;
        }
    })
}

/// One check of one endpoint, reported to its breaker. A circuit that refuses requests
/// (open, or its probes taken) is left alone.
async fn check(client: &UpstreamClient, pool: &Pool, endpoint: Arc<Endpoint>, timeout: Duration) {
    let Some(pick) = endpoint.admit_check(Instant::now()) else {
        return;
    };
    let healthy = tokio::time::timeout(timeout, probe(client, pool, &endpoint, timeout))
        .await
        .unwrap_or(false);
    if !healthy {
        tracing::debug!(endpoint = endpoint.base(), "health check failed");
    }
    pick.checked(healthy);
}

/// `GET /health`; a server without it (404, 405) is asked `GET /v1/models` instead, from
/// then on. Healthy means a 2xx answer.
async fn probe(
    client: &UpstreamClient,
    pool: &Pool,
    endpoint: &Endpoint,
    timeout: Duration,
) -> bool {
    let mut path = endpoint.health_path();
    loop {
        let Some(status) = get(client, pool, endpoint, path, timeout).await else {
            return false;
        };
        let missing = matches!(
            status,
            StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED
        );
        if missing && path == "/health" {
            endpoint.use_models_for_health();
            path = endpoint.health_path();
            continue;
        }
        return status.is_success();
    }
}

/// The status of `GET path`, with its body read so the connection can be kept.
async fn get(
    client: &UpstreamClient,
    pool: &Pool,
    endpoint: &Endpoint,
    path: &str,
    timeout: Duration,
) -> Option<StatusCode> {
    let mut request = Request::get(endpoint.uri(path).ok()?);
    if let Some(auth) = pool.authorization() {
        request = request.header(header::AUTHORIZATION, auth);
    }
    let request = request.body(Bytes::new()).ok()?;
    let response = client
        .send(pool.transport(), endpoint, request, timeout)
        .await
        .ok()?;
    let status = response.status();
    // A model list is small; one that is not is still an answer.
    let body = http_body_util::Limited::new(response.into_body(), 1 << 20);
    let _ = http_body_util::BodyExt::collect(body).await;
    Some(status)
}
