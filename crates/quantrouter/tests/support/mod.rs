//! Test harness: simulated vLLM tiers and a router on free loopback ports, and a small
//! HTTP client. Everything talks real HTTP.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod kube_api;
pub mod redis_server;

use std::collections::HashSet;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use quantrouter::profiles::{ProfileStore, SourceKind};
use quantrouter::server::{Server, ServerConfig};
use quantrouter_policy::{ProfileSet, StaticUpstream, Upstream, DEFAULT_PROFILE_SET};
use vllm_sim::{SimConfig, SimServer};

pub const SIMPLE: &str = "What is the capital of France?";
pub const CODE: &str =
    "Complete this Python function:\ndef merge(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n";

pub fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// Three simulated tiers (the embedded profiles) behind a router.
pub struct Harness {
    pub router: Server,
    pub sims: Vec<SimServer>,
    pub set: ProfileSet,
    pub client: Client<HttpConnector, Full<Bytes>>,
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("", |v| v.to_str().unwrap())
    }
}

impl Harness {
    /// Sims with the given per-token latency; the router with `config` tweaks.
    pub async fn start_with(itl: Duration, tweak: impl FnOnce(&mut ServerConfig)) -> Self {
        let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
        let mut sims = Vec::new();
        for profile in &mut set.profiles {
            let sim = SimServer::bind(
                loopback(),
                SimConfig {
                    model: profile.model.clone(),
                    itl,
                    ..SimConfig::default()
                },
            )
            .await
            .unwrap();
            profile.upstream = Upstream::Static(StaticUpstream {
                urls: vec![sim.url()],
            });
            sims.push(sim);
        }
        let router = start_router(set.clone(), tweak).await;
        Self {
            router,
            sims,
            set,
            client: client(),
        }
    }

    pub async fn start() -> Self {
        Self::start_with(Duration::ZERO, |_| {}).await
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.router.public_addr())
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.router.admin_addr())
    }

    pub fn sim(&self, tier: &str) -> &SimServer {
        let i = self
            .set
            .profiles
            .iter()
            .position(|p| p.tier == tier)
            .unwrap();
        &self.sims[i]
    }

    pub async fn post(&self, path: &str, body: &str) -> Reply {
        self.post_with(path, body, &[("content-type", "application/json")])
            .await
    }

    pub async fn post_with(&self, path: &str, body: &str, headers: &[(&str, &str)]) -> Reply {
        send(&self.client, "POST", &self.url(path), body, headers).await
    }

    pub async fn get(&self, url: &str) -> Reply {
        send(&self.client, "GET", url, "", &[]).await
    }

    /// Sends a request and returns the response with its body unread.
    pub async fn open(&self, path: &str, body: &str) -> http::Response<Incoming> {
        let req = Request::post(self.url(path))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_owned())))
            .unwrap();
        self.client.request(req).await.unwrap()
    }
}

pub async fn start_router(set: ProfileSet, tweak: impl FnOnce(&mut ServerConfig)) -> Server {
    let store = Arc::new(ProfileStore::new(set, SourceKind::Embedded));
    let mut config = ServerConfig {
        listen: loopback(),
        admin_listen: loopback(),
        shutdown_grace: Duration::from_secs(5),
        ..ServerConfig::default()
    };
    tweak(&mut config);
    Server::start(config, store).await.unwrap()
}

pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

pub async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    method: &str,
    url: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> Reply {
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body.to_owned()))).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(30), client.request(req))
        .await
        .expect("response within 30 s")
        .unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// Polls `check` until it holds or `deadline` passes.
pub async fn eventually<F, Fut>(deadline: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let until = tokio::time::Instant::now() + deadline;
    let mut poll = tokio::time::interval(Duration::from_millis(10));
    loop {
        poll.tick().await;
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= until {
            return false;
        }
    }
}

/// `quantrouter_profile_reloads_total{source, result}` as exported now (0 before the first).
/// Call `quantrouter::telemetry::metrics_handle()` before the code under test records.
pub fn reloads(source: &str, result: &str) -> u64 {
    let (source, result) = (
        format!("source=\"{source}\""),
        format!("result=\"{result}\""),
    );
    quantrouter::telemetry::metrics_handle()
        .render()
        .lines()
        .find(|l| {
            l.starts_with("quantrouter_profile_reloads_total{")
                && l.contains(&source)
                && l.contains(&result)
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// Waits until `reloads(source, "rejected")` has grown by `n` from `before`.
pub async fn rejected_since(source: &str, before: u64, n: u64) -> bool {
    eventually(Duration::from_secs(5), || async {
        reloads(source, "rejected") >= before + n
    })
    .await
}

pub fn chat(model: &str, content: &str) -> String {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8})
        .to_string()
}

pub fn keys(list: &[&str]) -> Option<HashSet<String>> {
    Some(list.iter().map(|s| (*s).to_owned()).collect())
}
