//! Scrapes each endpoint's `/metrics` for its queue about once a second, so a busy tier's
//! predicted latency rises and routing shifts away from it. The same pass publishes the
//! per-tier gauges (queue depth, in flight, ready endpoints, circuit states).
//!
//! The queue is read under the names of the server behind the endpoint: vLLM, SGLang,
//! llama.cpp or TGI, detected from what the page exposes ([`KNOWN`]), or the names a profile
//! sets in `upstream.metrics`. What a scrape found is written into the endpoint
//! ([`crate::upstream::queue`]); routing reads it there.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Request};
use http_body_util::{BodyExt, Limited};
use quantrouter_policy::QueueMetrics;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::profiles::{ProfileStore, Snapshot};
use crate::telemetry;
use crate::upstream::queue::{QueueReading, QueueSource, KNOWN};
use crate::upstream::{Endpoint, Pool, UpstreamClient};

/// A metrics page larger than this is not an inference server's; stop reading.
const MAX_PAGE: usize = 1 << 20;

/// KV-cache usage in [0, 1] under each server's name (vLLM's older name too), in the order
/// tried: a page has at most one of them.
pub const KV_USAGE: [&str; 4] = [
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
    "llamacpp:kv_cache_usage_ratio",
];

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
            let scrapes =
                snapshot
                    .set
                    .profiles
                    .iter()
                    .zip(snapshot.pools())
                    .flat_map(|(profile, pool)| {
                        // Once a pass: a rotated Secret file is picked up within a scrape.
                        if let Some(credential) = pool.credential() {
                            credential.refresh();
                        }
                        let names = profile.upstream.queue_metrics();
                        let client = &client;
                        pool.endpoints()
                            .iter()
                            .map(|endpoint| {
                                scrape(client, pool, Arc::clone(endpoint), names, timeout)
                            })
                            .collect::<Vec<_>>()
                    });
            futures_util::future::join_all(scrapes).await;
            record_gauges(&snapshot, Instant::now());
            drop(snapshot);
            let jitter = interval.mul_f64(0.9 + 0.2 * fastrand::f64());
            tokio::time::sleep(jitter).await;
        }
    })
}

/// Per-endpoint circuit and queue-metric gauges and per-tier gauges from the live pools.
fn record_gauges(snapshot: &Snapshot, now: Instant) {
    for (profile, pool) in snapshot.set.profiles.iter().zip(snapshot.pools()) {
        for endpoint in pool.endpoints().iter() {
            let state = endpoint.circuit(now).gauge_value();
            telemetry::circuit_state(&profile.id, endpoint.base(), state);
            if let Some(found) = endpoint.queue_source().found() {
                telemetry::upstream_queue_metric(&profile.id, endpoint.base(), found);
            }
        }
    }
    for (tier, stats) in crate::keda::local_tiers(snapshot, now) {
        telemetry::tier_gauges(
            &tier,
            stats.queue_depth,
            stats.inflight,
            stats.ready_endpoints,
        );
    }
}

async fn scrape(
    client: &UpstreamClient,
    pool: &Pool,
    endpoint: Arc<Endpoint>,
    names: Option<&QueueMetrics>,
    timeout: Duration,
) {
    let Ok(uri) = endpoint.uri("/metrics") else {
        return;
    };
    let mut request = Request::get(uri);
    if let Some(auth) = pool.authorization() {
        request = request.header(header::AUTHORIZATION, auth);
    }
    let Ok(request) = request.body(Bytes::new()) else {
        return;
    };
    let page = async {
        let response = client
            .send(pool.transport(), &endpoint, request, timeout)
            .await
            .ok()?;
        if !response.status().is_success() {
            // A server without /metrics (or refusing it) has no queue to read.
            return Some(Bytes::new());
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
        let reading = read_queue(&page, names);
        endpoint.set_kv_usage(read_kv_usage(&page));
        if let Some(before) = endpoint.set_queue(reading) {
            log_source_change(&endpoint, before, reading.source);
        }
    }
}

fn log_source_change(endpoint: &Endpoint, before: QueueSource, now: QueueSource) {
    let endpoint = endpoint.base();
    match now {
        QueueSource::Known(i) => {
            tracing::info!(
                endpoint,
                server = KNOWN[i].server,
                "upstream queue metrics found"
            );
        }
        QueueSource::Configured => {
            tracing::info!(
                endpoint,
                "upstream queue metrics found under the configured names"
            );
        }
        QueueSource::Missing => {
            tracing::warn!(endpoint, ?before,
                "no queue metric the router reads on the upstream's /metrics; routing sees only its own requests (set upstream.metrics to name them)");
        }
        QueueSource::Unknown => {}
    }
}

/// The queue in a Prometheus text page: under the configured names where the profile sets
/// them, else under the first server of [`KNOWN`] whose waiting metric the page has.
pub fn read_queue(page: &[u8], configured: Option<&QueueMetrics>) -> QueueReading {
    let text = std::str::from_utf8(page).unwrap_or_default();
    let waiting_name = configured.and_then(|m| m.waiting.as_deref());
    let running_name = configured.and_then(|m| m.running.as_deref());
    let detected = KNOWN
        .iter()
        .position(|names| sum_samples(text, names.waiting).is_some());
    let waiting = match (waiting_name, detected) {
        (Some(name), _) => sum_samples(text, name),
        (None, Some(i)) => sum_samples(text, KNOWN[i].waiting),
        (None, None) => None,
    };
    let running = match (running_name, detected) {
        (Some(name), _) => sum_samples(text, name),
        (None, Some(i)) => sum_samples(text, KNOWN[i].running),
        (None, None) => None,
    };
    let source = match (waiting_name, detected) {
        (Some(_), _) if waiting.is_some() => QueueSource::Configured,
        (None, Some(i)) => QueueSource::Known(i),
        _ => QueueSource::Missing,
    };
    QueueReading {
        waiting,
        running,
        source,
    }
}

/// The KV-cache usage on a metrics page, the fullest of its samples (one per model), under
/// the first name of [`KV_USAGE`] the page has.
pub fn read_kv_usage(page: &[u8]) -> Option<f64> {
    let text = std::str::from_utf8(page).unwrap_or_default();
    KV_USAGE.iter().find_map(|name| {
        samples(text, name)
            .filter(|v| v.is_finite())
            .map(|v| v.clamp(0.0, 1.0))
            .reduce(f64::max)
    })
}

/// Sum of the samples of metric `name` (one per model or label set), if it has any.
fn sum_samples(text: &str, name: &str) -> Option<u64> {
    let mut found = None;
    for value in samples(text, name) {
        let total = found.get_or_insert(0u64);
        if value.is_finite() && value >= 0.0 {
            *total = total.saturating_add(value as u64);
        }
    }
    found
}

/// The values of metric `name`'s samples.
fn samples<'t>(text: &'t str, name: &'t str) -> impl Iterator<Item = f64> + 't {
    text.lines()
        .filter_map(move |line| sample_value(line, name))
}

/// The value of `line` if it is a sample of metric `name`.
fn sample_value(line: &str, name: &str) -> Option<f64> {
    let rest = line.strip_prefix(name)?;
    // The exact name, then labels or a space.
    if !(rest.starts_with('{') || rest.starts_with(' ')) {
        return None;
    }
    // The value follows the labels (which may hold spaces); a timestamp may follow it.
    let after_labels = match rest.strip_prefix('{') {
        Some(labels) => labels.rsplit_once('}').map_or("", |(_, after)| after),
        None => rest,
    };
    after_labels
        .split_ascii_whitespace()
        .next()
        .and_then(|v| v.parse::<f64>().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(page: &[u8]) -> Option<u64> {
        read_queue(page, None).waiting
    }

    #[test]
    fn sums_waiting_requests_over_models_and_ignores_lookalikes() {
        let page = b"# HELP vllm:num_requests_waiting Number of requests waiting.\n\
# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{model_name=\"a\"} 3.0\n\
vllm:num_requests_waiting{model_name=\"b\"} 4\n\
vllm:num_requests_waiting_total 99\n\
vllm:num_requests_running{model_name=\"a\"} 7.0\n";
        assert_eq!(waiting(page), Some(7));
        assert_eq!(read_queue(page, None).running, Some(7));
        assert_eq!(waiting(b"other_metric 1\n"), None);
        assert_eq!(waiting(b"vllm:num_requests_waiting 2\n"), Some(2));
        assert_eq!(
            waiting(b"vllm:num_requests_waiting{a=\"x y\"} 2 1700000000000\n"),
            Some(2),
            "labels with spaces and a timestamp"
        );
    }

    #[test]
    fn detects_each_servers_names_and_honours_configured_ones() {
        for (i, names) in KNOWN.iter().enumerate() {
            let page = format!("{} 5\n{} 2\n", names.waiting, names.running);
            let reading = read_queue(page.as_bytes(), None);
            assert_eq!(
                reading,
                QueueReading {
                    waiting: Some(5),
                    running: Some(2),
                    source: QueueSource::Known(i)
                },
                "{}",
                names.server
            );
        }
        let page = b"my_queue{pool=\"a\"} 3\nmy_running 1\nvllm:num_requests_waiting 9\n";
        let configured = QueueMetrics {
            waiting: Some("my_queue".into()),
            running: Some("my_running".into()),
        };
        let reading = read_queue(page, Some(&configured));
        assert_eq!(
            (reading.waiting, reading.running, reading.source),
            (Some(3), Some(1), QueueSource::Configured)
        );
        let missing = read_queue(b"tgi_request_count 4\n", Some(&configured));
        assert_eq!(missing.source, QueueSource::Missing);
        assert_eq!(read_queue(b"", None).source, QueueSource::Missing);
        for source in [
            QueueSource::Unknown,
            QueueSource::Known(3),
            QueueSource::Configured,
            QueueSource::Missing,
        ] {
            assert_eq!(QueueSource::from_byte(source.as_byte()), source);
        }
    }

    #[test]
    fn reads_each_servers_kv_cache_usage() {
        for (i, name) in KV_USAGE.iter().enumerate() {
            let page = format!("{name}{{model_name=\"a\"}} 0.25\n{name}{{model_name=\"b\"}} 0.5\n");
            assert_eq!(read_kv_usage(page.as_bytes()), Some(0.5), "{i}: {name}");
        }
        assert_eq!(read_kv_usage(b"vllm:kv_cache_usage_perc 7\n"), Some(1.0));
        assert_eq!(read_kv_usage(b"vllm:kv_cache_usage_perc_total 0.5\n"), None);
        assert_eq!(read_kv_usage(b"tgi_queue_size 3\n"), None);
    }
}
