//! Scrapes each endpoint's `/metrics` for vLLM's queue (`vllm:num_requests_waiting`) about
//! once a second, so a busy tier's predicted latency rises and routing shifts away from it.
//! The same pass publishes the per-tier gauges (queue depth, in flight, ready endpoints,
//! circuit states).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Limited};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{Endpoint, UpstreamClient};
use crate::profiles::ProfileStore;
use crate::telemetry;

/// A metrics page larger than this is not vLLM's; stop reading.
const MAX_PAGE: usize = 1 << 20;

/// Runs until aborted: every `interval` (jittered ±10% so replicas spread out), scrape
/// every endpoint of the active snapshot concurrently, each bounded by `timeout`.
pub fn spawn(
    store: Arc<ProfileStore>,
    client: UpstreamClient,
    interval: Duration,
    timeout: Duration,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let snapshot = store.load();
            let scrapes = snapshot.pools.iter().flat_map(|pool| {
                let client = &client;
                pool.endpoints()
                    .iter()
                    .map(|endpoint| scrape(client, Arc::clone(endpoint), timeout))
                    .collect::<Vec<_>>()
            });
            futures_util::future::join_all(scrapes).await;
            telemetry::tier_gauges(&snapshot, Instant::now());
            drop(snapshot);
            let jitter = interval.mul_f64(0.9 + 0.2 * fastrand::f64());
            tokio::time::sleep(jitter).await;
        }
    })
}

async fn scrape(client: &UpstreamClient, endpoint: Arc<Endpoint>, timeout: Duration) {
    let Ok(uri) = endpoint.uri("/metrics") else {
        return;
    };
    let Ok(request) = Request::get(uri).body(Bytes::new()) else {
        return;
    };
    let page = async {
        let response = client.send(&endpoint, &request, timeout).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        let body = Limited::new(response.into_body(), MAX_PAGE)
            .collect()
            .await
            .ok()?;
        Some(body.to_bytes())
    };
    // The whole scrape, body included, within the timeout; a failed scrape keeps the last
    // value (requests, not scrapes, decide whether an endpoint is broken).
    if let Ok(Some(page)) = tokio::time::timeout(timeout, page).await {
        if let Some(waiting) = num_requests_waiting(&page) {
            endpoint.set_waiting(waiting);
        }
    }
}

/// Sum of `vllm:num_requests_waiting` samples (one per model) in a Prometheus text page.
pub fn num_requests_waiting(page: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(page).ok()?;
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("vllm:num_requests_waiting") else {
            continue;
        };
        // The exact name, then labels or a space.
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let value = rest.rsplit(' ').next()?.parse::<f64>().ok()?;
        if value.is_finite() && value >= 0.0 {
            *found.get_or_insert(0) += value as u64;
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_waiting_requests_over_models_and_ignores_lookalikes() {
        let page = b"# HELP vllm:num_requests_waiting Number of requests waiting.\n\
# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{model_name=\"a\"} 3.0\n\
vllm:num_requests_waiting{model_name=\"b\"} 4\n\
vllm:num_requests_waiting_total 99\n\
vllm:num_requests_running{model_name=\"a\"} 7.0\n";
        assert_eq!(num_requests_waiting(page), Some(7));
        assert_eq!(num_requests_waiting(b"other_metric 1\n"), None);
        assert_eq!(
            num_requests_waiting(b"vllm:num_requests_waiting 2\n"),
            Some(2)
        );
    }
}
