//! Upstream vLLM servers: one [`Pool`] of endpoints per profile, a pooled keep-alive HTTP
//! client, and the response body wrapper that keeps in-flight accounting honest for the
//! whole life of a stream.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

/// Endpoints of one profile, balanced round-robin.
///
/// The endpoint list can be replaced while requests run ([`Pool::set_urls`], fed by
/// Kubernetes discovery): a request holds the endpoint it picked by `Arc`, so dropping an
/// endpoint from the list stops new requests to it while in-flight ones finish.
#[derive(Debug)]
pub struct Pool {
    /// The URLs this pool was built from (the profile's configured upstream), to reuse it
    /// across profile reloads; not changed by [`Pool::set_urls`].
    pub urls: Vec<String>,
    endpoints: ArcSwap<Vec<Arc<Endpoint>>>,
    next: AtomicUsize,
    inflight: AtomicU64,
}

/// One upstream base URL (`http://host:port[/prefix]`, no trailing slash).
#[derive(Debug)]
pub struct Endpoint {
    base: String,
}

/// Why an upstream call failed before a response arrived.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("invalid upstream URL {0}")]
    InvalidUrl(String),
    #[error("connecting to {endpoint}: {source}")]
    Connect {
        endpoint: String,
        source: hyper_util::client::legacy::Error,
    },
    #[error("{endpoint} sent no response headers within {timeout:?}")]
    HeaderTimeout { endpoint: String, timeout: Duration },
}

/// Connection-pooling client shared by every profile.
#[derive(Debug, Clone)]
pub struct UpstreamClient {
    client: Client<HttpConnector, Full<Bytes>>,
    header_timeout: Duration,
}

/// Upstream client settings.
#[derive(Debug, Clone, Copy)]
pub struct ClientConfig {
    /// Fail fast on unroutable pods; a healthy pod on the cluster network connects in ms.
    pub connect_timeout: Duration,
    /// vLLM sends headers when the first token is ready; a long queue can take a while, but
    /// a minute with nothing means the pod is stuck.
    pub header_timeout: Duration,
    /// Idle keep-alive connections per endpoint; enough for bursts without hoarding sockets.
    pub max_idle_per_host: usize,
}

// === impl Pool ===

impl Pool {
    /// A pool over base URLs (validated by the profile set).
    pub fn new(urls: Vec<String>) -> Self {
        let endpoints = urls.iter().map(|u| Arc::new(Endpoint::new(u))).collect();
        Self {
            urls,
            endpoints: ArcSwap::from_pointee(endpoints),
            next: AtomicUsize::new(0),
            inflight: AtomicU64::new(0),
        }
    }

    /// Replaces the endpoint list, keeping the `Endpoint` (and its state) of every URL that
    /// stays. Requests already sent to a removed endpoint are not affected.
    pub fn set_urls(&self, urls: Vec<String>) {
        let current = self.endpoints.load();
        let endpoints = urls
            .iter()
            .map(|u| {
                let base = u.trim_end_matches('/');
                current
                    .iter()
                    .find(|e| e.base == base)
                    .map_or_else(|| Arc::new(Endpoint::new(base)), Arc::clone)
            })
            .collect();
        self.endpoints.store(Arc::new(endpoints));
    }

    /// The base URLs requests are balanced over now.
    pub fn endpoint_urls(&self) -> Vec<String> {
        self.endpoints
            .load()
            .iter()
            .map(|e| e.base.clone())
            .collect()
    }

    /// The next endpoint in round-robin order, if the pool has any.
    pub fn pick(&self) -> Option<Arc<Endpoint>> {
        let endpoints = self.endpoints.load();
        if endpoints.is_empty() {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % endpoints.len();
        endpoints.get(i).cloned()
    }

    pub fn has_endpoints(&self) -> bool {
        !self.endpoints.load().is_empty()
    }

    /// Requests this router has in flight on this pool.
    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Counts a request in flight until the guard drops.
    pub fn enter(self: &Arc<Self>) -> InflightGuard {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        InflightGuard {
            pool: Arc::clone(self),
        }
    }
}

// === impl Endpoint ===

impl Endpoint {
    fn new(base: &str) -> Self {
        Self {
            base: base.trim_end_matches('/').to_owned(),
        }
    }

    /// The full URI for an API path such as `/v1/chat/completions`.
    pub fn uri(&self, path: &str) -> Result<Uri, UpstreamError> {
        let mut s = String::with_capacity(self.base.len() + path.len());
        s.push_str(&self.base);
        s.push_str(path);
        s.parse().map_err(|_| UpstreamError::InvalidUrl(s))
    }

    pub fn base(&self) -> &str {
        &self.base
    }
}

/// Decrements the pool's in-flight count when dropped.
#[derive(Debug)]
pub struct InflightGuard {
    pool: Arc<Pool>,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.pool.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

// === impl UpstreamClient ===

impl UpstreamClient {
    pub fn new(config: ClientConfig) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(config.connect_timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(config.max_idle_per_host)
            .build(connector);
        Self {
            client,
            header_timeout: config.header_timeout,
        }
    }

    /// Sends one request and waits for the response headers (bounded by the header timeout).
    pub async fn send(
        &self,
        endpoint: &Endpoint,
        request: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        match tokio::time::timeout(self.header_timeout, self.client.request(request)).await {
            Ok(Ok(response)) => Ok(response),
            Ok(Err(source)) => Err(UpstreamError::Connect {
                endpoint: endpoint.base.clone(),
                source,
            }),
            Err(_) => Err(UpstreamError::HeaderTimeout {
                endpoint: endpoint.base.clone(),
                timeout: self.header_timeout,
            }),
        }
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            header_timeout: Duration::from_secs(60),
            max_idle_per_host: 256,
        }
    }
}

pin_project_lite::pin_project! {
    /// The upstream response body on its way to the client, frame by frame. Holds the
    /// in-flight guard and reports when the body ends or is dropped (client went away), so
    /// streams count as in flight until their last byte.
    pub struct UpstreamBody {
        #[pin]
        inner: Incoming,
        guard: Option<InflightGuard>,
        on_end: Option<Box<dyn FnOnce(BodyEnd) + Send + Sync>>,
        started: Instant,
    }

    impl PinnedDrop for UpstreamBody {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(on_end) = this.on_end.take() {
                on_end(BodyEnd { completed: false, elapsed: this.started.elapsed() });
            }
        }
    }
}

/// How an upstream body ended.
#[derive(Debug, Clone, Copy)]
pub struct BodyEnd {
    /// The last frame was delivered (false: dropped early or failed).
    pub completed: bool,
    pub elapsed: Duration,
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody").finish_non_exhaustive()
    }
}

// === impl UpstreamBody ===

impl UpstreamBody {
    pub fn new(
        inner: Incoming,
        guard: InflightGuard,
        started: Instant,
        on_end: Box<dyn FnOnce(BodyEnd) + Send + Sync>,
    ) -> Self {
        Self {
            inner,
            guard: Some(guard),
            on_end: Some(on_end),
            started,
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        let end = match &polled {
            Poll::Ready(None) => Some(true),
            Poll::Ready(Some(Err(_))) => Some(false),
            _ => None,
        };
        if let Some(completed) = end {
            this.guard.take();
            if let Some(on_end) = this.on_end.take() {
                on_end(BodyEnd {
                    completed,
                    elapsed: this.started.elapsed(),
                });
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_cycles_through_endpoints() {
        let pool = Pool::new(vec!["http://a:1/".into(), "http://b:2".into()]);
        let picks: Vec<String> = (0..4)
            .map(|_| pool.pick().unwrap().base().to_owned())
            .collect();
        assert_eq!(
            picks,
            ["http://a:1", "http://b:2", "http://a:1", "http://b:2"]
        );
        assert!(Pool::new(vec![]).pick().is_none());
    }

    #[test]
    fn set_urls_keeps_unchanged_endpoints_and_in_flight_picks() {
        let pool = Pool::new(vec!["http://a:1".into(), "http://b:2".into()]);
        let held = pool.pick().unwrap();
        let b = pool.pick().unwrap();
        pool.set_urls(vec!["http://b:2/".into(), "http://c:3".into()]);
        assert_eq!(pool.endpoint_urls(), ["http://b:2", "http://c:3"]);
        // The removed endpoint lives on for the request holding it.
        assert_eq!(held.base(), "http://a:1");
        // An unchanged URL keeps its Endpoint (and whatever state it carries).
        assert!(pool.endpoint_urls().contains(&b.base().to_owned()));
        let same = (0..2)
            .map(|_| pool.pick().unwrap())
            .find(|e| e.base() == "http://b:2");
        assert!(Arc::ptr_eq(&b, &same.unwrap()));
        pool.set_urls(vec![]);
        assert!(!pool.has_endpoints() && pool.pick().is_none());
        assert_eq!(pool.urls, ["http://a:1", "http://b:2"]);
    }

    #[test]
    fn inflight_guard_counts_until_dropped() {
        let pool = Arc::new(Pool::new(vec!["http://a:1".into()]));
        let g1 = pool.enter();
        let g2 = pool.enter();
        assert_eq!(pool.inflight(), 2);
        drop(g1);
        assert_eq!(pool.inflight(), 1);
        drop(g2);
        assert_eq!(pool.inflight(), 0);
    }

    #[test]
    fn endpoint_uri_joins_base_and_path() {
        let pool = Pool::new(vec!["http://127.0.0.1:8000/prefix/".into()]);
        let uri = pool.pick().unwrap().uri("/v1/models").unwrap();
        assert_eq!(uri.to_string(), "http://127.0.0.1:8000/prefix/v1/models");
    }
}
