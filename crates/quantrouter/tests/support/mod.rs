//! Test harness: simulated vLLM tiers and a router on free loopback ports, and a small
//! HTTP client. Everything talks real HTTP.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod envoy;
pub mod kube_api;
pub mod llama;
pub mod otlp;
pub mod redis_server;
pub mod sim_process;

use std::collections::HashSet;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use quantrouter::profiles::{ProfileStore, SourceKind};
use quantrouter::resilience::CircuitState;
use quantrouter::server::{Server, ServerConfig};
use quantrouter_policy::{ProfileSet, StaticUpstream, Upstream, DEFAULT_PROFILE_SET};
use vllm_sim::{SimConfig, SimServer};

pub const SIMPLE: &str = "What is the capital of France?";
pub const CODE: &str =
    "Complete this Python function:\ndef merge(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n";

pub fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// An address that refuses connections for as long as the returned socket lives: bound but
/// not listening. A listener's port freed by dropping it can be taken by the next server
/// another test starts, which would then answer in its place.
pub fn refusing_address() -> (tokio::net::TcpSocket, SocketAddr) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(loopback()).unwrap();
    let address = socket.local_addr().unwrap();
    (socket, address)
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
        let (set, sims) = sim_tiers(itl).await;
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

/// The embedded profile set with each profile's upstream replaced by a fresh simulator
/// with the given per-token latency.
pub async fn sim_tiers(itl: Duration) -> (ProfileSet, Vec<SimServer>) {
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    let mut sims = Vec::new();
    for profile in &mut set.profiles {
        let config = SimConfig {
            model: profile.model.clone(),
            itl,
            ..SimConfig::default()
        };
        let sim = SimServer::bind(loopback(), config).await.unwrap();
        profile.upstream = Upstream::Static(StaticUpstream::new(vec![sim.url()]));
        sims.push(sim);
    }
    (set, sims)
}

/// The real `quantrouter serve` binary on free loopback ports, serving `set` from a file.
pub struct RouterProcess {
    pub child: tokio::process::Child,
    pub public: SocketAddr,
    pub admin: SocketAddr,
    /// Holds the profile file the process reads; removed on drop, after `child`.
    _profiles: tempfile::TempDir,
}

impl RouterProcess {
    /// Starts the binary with `args` added and waits until `/readyz` answers 200.
    pub async fn spawn(set: &ProfileSet, args: &[&str], stderr: std::process::Stdio) -> Self {
        Self::spawn_with_env(set, args, &[], stderr).await
    }

    /// [`RouterProcess::spawn`] with environment variables set for the process.
    pub async fn spawn_with_env(
        set: &ProfileSet,
        args: &[&str],
        env: &[(&str, &str)],
        stderr: std::process::Stdio,
    ) -> Self {
        let free = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
        };
        let (public, admin) = (free(), free());
        let profiles = tempfile::Builder::new()
            .prefix("qr-process-")
            .tempdir()
            .unwrap();
        let path = profiles.path().join("profiles.json");
        std::fs::write(&path, serde_json::to_string(set).unwrap()).unwrap();
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_quantrouter"));
        command
            .arg("serve")
            .args([
                "--listen",
                &public.to_string(),
                "--admin-listen",
                &admin.to_string(),
            ])
            .arg("--profiles")
            .arg(&path);
        // The scaler's default port (9091) is fixed: another router on the machine would
        // make the test fail to start. Tests that want it name a port.
        if !args.contains(&"--keda-scaler-listen") {
            command.args(["--keda-scaler-listen", "off"]);
        }
        let child = command
            .args(args)
            .envs(env.iter().copied())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let process = Self {
            child,
            public,
            admin,
            _profiles: profiles,
        };
        let up = eventually(Duration::from_secs(10), || async {
            process.get_status("/readyz").await == Some(StatusCode::OK)
        })
        .await;
        assert!(up, "the router process came up");
        process
    }

    pub async fn get_status(&self, path: &str) -> Option<StatusCode> {
        let req = Request::get(format!("http://{}{path}", self.admin))
            .body(Full::new(Bytes::new()))
            .unwrap();
        client().request(req).await.ok().map(|r| r.status())
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.public)
    }

    pub fn terminate(&self) {
        let pid = self.child.id().unwrap().to_string();
        let killed = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        assert!(killed.success());
    }
}

/// A router over `counts[i]` sims for each profile of the embedded set.
pub struct Tiers {
    pub router: Server,
    pub sims: Vec<Vec<SimServer>>,
    pub set: ProfileSet,
}

impl Tiers {
    pub async fn start(
        counts: [usize; 3],
        sim: impl Fn(usize) -> SimConfig,
        edit: impl FnOnce(&mut ProfileSet),
        tweak: impl FnOnce(&mut ServerConfig),
    ) -> Self {
        let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
        let mut sims = Vec::new();
        for (i, profile) in set.profiles.iter_mut().enumerate() {
            let mut tier = Vec::new();
            for _ in 0..counts[i] {
                let config = SimConfig {
                    model: profile.model.clone(),
                    ..sim(i)
                };
                tier.push(SimServer::bind(loopback(), config).await.unwrap());
            }
            profile.upstream = Upstream::Static(StaticUpstream::new(
                tier.iter().map(SimServer::url).collect(),
            ));
            sims.push(tier);
        }
        edit(&mut set);
        let router = start_router(set.clone(), tweak).await;
        Self { router, sims, set }
    }

    pub async fn post(&self, body: &str, headers: &[(&str, &str)]) -> Reply {
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        let url = format!("http://{}/v1/chat/completions", self.router.public_addr());
        send(&client(), "POST", &url, body, &all).await
    }

    pub fn requests(&self, profile: usize) -> u64 {
        self.sims[profile].iter().map(|s| s.stats().requests).sum()
    }

    pub fn circuit(&self, profile: usize, endpoint: usize) -> CircuitState {
        let snapshot = self.router.app.store.load();
        let endpoints = snapshot.runtime[profile].pool.endpoints();
        endpoints[endpoint].circuit(tokio::time::Instant::now())
    }
}

/// Tenants from `doc`, written to a file in `dir`, counted by this replica alone on a clock
/// fixed in one minute (no window resets between a test's requests).
pub async fn file_tenants(
    dir: &std::path::Path,
    doc: &serde_json::Value,
) -> Arc<quantrouter::tenants::Tenants> {
    let limiter = quantrouter::tenants::limiter::LimiterConfig::new(None, "replica-0".to_owned());
    tenants_counted_by(dir, &doc.to_string(), limiter, 4_102_444_800_000).await
}

/// Tenants from the document `doc`, written to a file in `dir`, counted by `limiter` on a
/// clock stopped at `now_ms`.
pub async fn tenants_counted_by(
    dir: &std::path::Path,
    doc: &str,
    limiter: quantrouter::tenants::limiter::LimiterConfig,
    now_ms: u64,
) -> Arc<quantrouter::tenants::Tenants> {
    use quantrouter::tenants::{Clock, Tenants, TenantsConfig};
    let file = dir.join("tenants.json");
    std::fs::write(&file, doc).unwrap();
    let config = TenantsConfig {
        file: Some(file),
        file_interval: Duration::from_secs(1),
        redis: None,
        redis_poll: Duration::from_secs(1),
        api_keys: None,
        metrics_top: 50,
    };
    let clock = Clock::manual(now_ms);
    Arc::new(Tenants::start(config, limiter, clock).await.unwrap())
}

/// Three tiers whose sims serve the agent APIs natively (and say so in `upstream.apis`), or
/// only chat; the router with `tweak`.
pub async fn agent_tiers(native: bool, tweak: impl FnOnce(&mut ServerConfig)) -> Tiers {
    Tiers::start(
        [1, 1, 1],
        |_| SimConfig {
            chat_only: !native,
            ..SimConfig::default()
        },
        |set| {
            for profile in &mut set.profiles {
                if let (true, Upstream::Static(upstream)) = (native, &mut profile.upstream) {
                    upstream.apis.extend([
                        quantrouter_policy::UpstreamApi::Messages,
                        quantrouter_policy::UpstreamApi::Responses,
                    ]);
                }
            }
        },
        tweak,
    )
    .await
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

/// An upstream that answers every completion with `answer(request body)`: a status, a
/// content type and a body it sends whole (a stream's last byte ends it cleanly); `GET`s
/// (health, metrics) get 200. Returns its URL and a count of completions.
pub async fn scripted_upstream<F>(answer: F) -> (String, Arc<AtomicU64>)
where
    F: Fn(&serde_json::Value) -> (StatusCode, &'static str, String) + Send + Sync + 'static,
{
    let listener = tokio::net::TcpListener::bind(loopback()).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let answer = Arc::new(answer);
    let count = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&count);
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let (answer, counted) = (Arc::clone(&answer), Arc::clone(&counted));
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let (answer, counted) = (Arc::clone(&answer), Arc::clone(&counted));
                    async move {
                        let post = req.method() == http::Method::POST;
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        let (status, kind, text) = match post {
                            true => {
                                counted.fetch_add(1, Ordering::Relaxed);
                                answer(&serde_json::from_slice(&body).unwrap())
                            }
                            false => (StatusCode::OK, "text/plain", String::new()),
                        };
                        let mut response = Response::new(Full::new(Bytes::from(text)));
                        *response.status_mut() = status;
                        response.headers_mut().insert(
                            http::header::CONTENT_TYPE,
                            http::HeaderValue::from_static(kind),
                        );
                        Ok::<_, Infallible>(response)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (url, count)
}

/// What a child process announces on `output`: the rest of the first line that holds
/// `marker`, within `deadline`. The output is read on afterwards, so the child never
/// blocks on a full pipe.
pub async fn announced(
    output: impl tokio::io::AsyncRead + Unpin + Send + 'static,
    marker: &str,
    deadline: Duration,
) -> String {
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(output).lines();
    let found = tokio::time::timeout(deadline, async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some((_, rest)) = line.split_once(marker) {
                return rest.trim().to_owned();
            }
        }
        panic!("the process ended before it said {marker:?}");
    })
    .await;
    let found = found.unwrap_or_else(|_| panic!("no {marker:?} within {deadline:?}"));
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    found
}

/// Noon (and 30 s) two days from now, UTC: a limit window in the future, whose counters do
/// not expire under the real clock while a test runs.
pub fn future_noon() -> u64 {
    use quantrouter_policy::limits::DAY_MS;
    let today = quantrouter::tenants::limiter::unix_ms(std::time::SystemTime::now()) / DAY_MS;
    (today + 2) * DAY_MS + 12 * 3_600_000 + 30_000
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

/// `workers` tasks each sending `per_worker` chat requests for `content` (every other one
/// streamed) to `url`, one after another; each task returns the failures it saw (a status
/// other than 200 or an answer that did not end properly).
pub fn steady_requests(
    url: &str,
    workers: usize,
    per_worker: usize,
    content: &'static str,
) -> Vec<tokio::task::JoinHandle<Vec<String>>> {
    (0..workers)
        .map(|w| {
            let url = url.to_owned();
            tokio::spawn(async move {
                let client = client();
                let mut failures = Vec::new();
                for i in 0..per_worker {
                    let stream = (w + i) % 2 == 0;
                    let body =
                        serde_json::json!({"model": "auto", "stream": stream, "max_tokens": 8,
                        "messages": [{"role": "user", "content": content}]})
                        .to_string();
                    let r = send(
                        &client,
                        "POST",
                        &url,
                        &body,
                        &[("content-type", "application/json")],
                    )
                    .await;
                    let text = String::from_utf8_lossy(&r.body).into_owned();
                    let complete = if stream {
                        text.contains("[DONE]")
                    } else {
                        text.contains("\"choices\"")
                    };
                    if r.status != 200 || !complete {
                        failures.push(format!("{} {text}", r.status));
                    }
                }
                failures
            })
        })
        .collect()
}

/// Waits for [`steady_requests`] and gathers their failures.
pub async fn failures(workers: Vec<tokio::task::JoinHandle<Vec<String>>>) -> Vec<String> {
    let mut failures = Vec::new();
    for w in workers {
        failures.extend(w.await.unwrap());
    }
    failures
}

/// Runs the `quantrouter` binary: exit code, stdout, stderr.
pub fn cli(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_quantrouter"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub fn chat(model: &str, content: &str) -> String {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8})
        .to_string()
}

/// A streamed chat request for `SIMPLE` that the router routes itself.
pub fn simple_stream(max_tokens: u32) -> String {
    serde_json::json!({"model": "auto", "stream": true, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": SIMPLE}]})
    .to_string()
}

/// The JSON of the last `data:` event of an SSE body.
pub fn last_sse_event(text: &str) -> serde_json::Value {
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap()
}

pub fn keys(list: &[&str]) -> Option<HashSet<String>> {
    Some(list.iter().map(|s| (*s).to_owned()).collect())
}

/// A fixed instant mid-minute (2100-01-01 00:00:30 UTC): tenant limits' calendar-minute
/// windows do not roll over between a test's requests, however slowly they come.
pub const MID_MINUTE: u64 = 4_102_444_830_000;

/// Tenants from the document `doc` (written into `dir`), counted locally on a clock stopped
/// at [`MID_MINUTE`].
pub async fn tenants_from(
    dir: &tempfile::TempDir,
    doc: &str,
) -> Arc<quantrouter::tenants::Tenants> {
    let limiter = quantrouter::tenants::limiter::LimiterConfig::new(None, "replica-0".to_owned());
    tenants_counted_by(dir.path(), doc, limiter, MID_MINUTE).await
}

/// What a [`capture_upstream`] received: each completion request's headers and body.
pub type Captured = Arc<std::sync::Mutex<Vec<(HeaderMap, Bytes)>>>;

/// A one-route upstream that records the completion requests it receives (not the router's
/// `/metrics` scrapes) and answers each with a short chat completion.
pub async fn capture_upstream() -> (String, Captured) {
    let listener = tokio::net::TcpListener::bind(loopback()).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen: Captured = Arc::default();
    let record = Arc::clone(&seen);
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let record = Arc::clone(&record);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let record = Arc::clone(&record);
                    async move {
                        let post = req.method() == http::Method::POST;
                        let (parts, body) = req.into_parts();
                        let body = body.collect().await.unwrap().to_bytes();
                        if post {
                            record.lock().unwrap().push((parts.headers, body));
                        }
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                            Bytes::from_static(
                                br#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}],"usage":{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8}}"#,
                            ),
                        )))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (url, seen)
}

/// Runs `tests/python/<script>` with `args` in the Python of the official clients, and
/// returns its output once it exited 0 having said "checks passed".
pub async fn python_checks(script: &str, args: &[String]) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(script);
    let output = tokio::process::Command::new(python())
        .arg(path)
        .args(args)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("checks passed"),
        "{script}:\n{stdout}\n{stderr}"
    );
    stdout
}

/// The Python with the official clients in it (`QUANTROUTER_PYTHON`, else the repository's
/// `.venv`).
pub fn python() -> PathBuf {
    let path = std::env::var_os("QUANTROUTER_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python")
        });
    assert!(
        path.exists(),
        "{} not found: run `scripts/install-tools openai anthropic` (scripts/test does) or set QUANTROUTER_PYTHON",
        path.display()
    );
    path
}
