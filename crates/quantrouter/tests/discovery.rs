//! Kubernetes discovery end to end: the real kube client watches a stand-in API server over
//! HTTP, simulated vLLM pods (vllm-sim) serve on loopback, and requests go through the real
//! router. Each pod has its own EndpointSlice because pods on loopback differ by port.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use quantrouter::discovery::{Discovery, DiscoveryConfig};
use quantrouter::profiles::{ProfileStore, SourceKind};
use quantrouter::server::{Server, ServerConfig};
use quantrouter_policy::{
    ProfileSet, ServiceUpstream, StaticUpstream, Upstream, UpstreamApi, DEFAULT_PROFILE_SET,
};
use support::kube_api::{KubeApi, PodState};
use support::{chat, client, eventually, loopback, SIMPLE};
use vllm_sim::{SimConfig, SimServer};

const NS: &str = "llm";
/// Indexes and services of the embedded profiles.
const FP16: usize = 0;
const FP8: usize = 1;
const FP16_SVC: &str = "vllm-fp16";
const FP8_SVC: &str = "vllm-fp8";
const INT4_SVC: &str = "vllm-int4";
const WAIT: Duration = Duration::from_secs(10);

/// A stand-in API server, a profile store with discovery on, and a router.
struct Rig {
    api: KubeApi,
    store: Arc<ProfileStore>,
    router: Server,
    set: ProfileSet,
    _discovery: Discovery,
}

impl Rig {
    async fn start() -> Self {
        quantrouter::telemetry::metrics_handle();
        let api = KubeApi::start().await;
        let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
        let store = Arc::new(ProfileStore::new(set.clone(), SourceKind::Embedded));
        // Short backoff so retries after scripted trouble do not dominate the test time.
        let config = DiscoveryConfig {
            min_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(200),
            reset_backoff_after: Duration::ZERO,
        };
        let discovery = Discovery::start(Arc::clone(&store), api.client(), config);
        let config = ServerConfig {
            listen: loopback(),
            admin_listen: loopback(),
            shutdown_grace: Duration::from_secs(5),
            ..ServerConfig::default()
        };
        let router = Server::start(config, Arc::clone(&store)).await.unwrap();
        Self {
            api,
            store,
            router,
            set,
            _discovery: discovery,
        }
    }

    /// A simulated pod serving `profile`'s model.
    async fn pod(&self, profile: usize, itl: Duration) -> SimServer {
        let config = SimConfig {
            model: self.set.profiles[profile].model.clone(),
            itl,
            ..SimConfig::default()
        };
        SimServer::bind(loopback(), config).await.unwrap()
    }

    fn endpoints(&self, profile: usize) -> Vec<String> {
        self.store.load().runtime[profile].pool.endpoint_urls()
    }

    /// Waits until `profile`'s pool holds exactly `pods` (in any order).
    async fn wait_for(&self, profile: usize, pods: &[&SimServer]) {
        let mut want: Vec<String> = pods.iter().map(|p| p.url()).collect();
        want.sort();
        let ok = eventually(WAIT, || {
            let now = self.endpoints(profile);
            let want = &want;
            async move { &now == want }
        })
        .await;
        assert!(
            ok,
            "pool {profile}: want {want:?}, have {:?}",
            self.endpoints(profile)
        );
    }

    fn url(&self) -> String {
        format!("http://{}/v1/chat/completions", self.router.public_addr())
    }

    /// One chat request pinned to `profile`.
    async fn chat(&self, profile: usize) -> StatusCode {
        try_chat(&self.url(), &self.set.profiles[profile].id)
            .await
            .unwrap()
    }
}

/// Sends a chat request and reads the whole answer; any transport error is an `Err`.
async fn try_chat(url: &str, model: &str) -> Result<StatusCode, String> {
    let req = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(chat(model, SIMPLE))))
        .unwrap();
    let response = tokio::time::timeout(WAIT, client().request(req))
        .await
        .map_err(|_| "timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    let status = response.status();
    response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(status)
}

async fn until(what: &str, check: impl Fn() -> bool) {
    assert!(
        eventually(WAIT, || std::future::ready(check())).await,
        "timed out waiting for {what}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_follows_endpoints_appearing_changing_readiness_and_disappearing() {
    let rig = Rig::start().await;
    // A successful list that finds no slice empties the pool (it had the DNS name before).
    rig.wait_for(FP8, &[]).await;
    rig.wait_for(FP16, &[]).await;
    assert_eq!(rig.chat(FP16).await, StatusCode::SERVICE_UNAVAILABLE);

    let a = rig.pod(FP16, Duration::ZERO).await;
    let b = rig.pod(FP16, Duration::ZERO).await;
    rig.api
        .put_pod(NS, FP16_SVC, "fp16-a", a.local_addr(), PodState::Ready);
    rig.wait_for(FP16, &[&a]).await;
    assert_eq!(rig.chat(FP16).await, StatusCode::OK);
    assert_eq!(a.stats().requests, 1);

    rig.api
        .put_pod(NS, FP16_SVC, "fp16-b", b.local_addr(), PodState::Ready);
    rig.wait_for(FP16, &[&a, &b]).await;

    // Not ready: no new requests.
    rig.api
        .put_pod(NS, FP16_SVC, "fp16-b", b.local_addr(), PodState::NotReady);
    rig.wait_for(FP16, &[&a]).await;
    let before = b.stats().requests;
    for _ in 0..4 {
        assert_eq!(rig.chat(FP16).await, StatusCode::OK);
    }
    assert_eq!(b.stats().requests, before);

    // No conditions at all counts as ready.
    rig.api
        .put_pod(NS, FP16_SVC, "fp16-b", b.local_addr(), PodState::Unset);
    rig.wait_for(FP16, &[&a, &b]).await;

    rig.api.put_pod(
        NS,
        FP16_SVC,
        "fp16-a",
        a.local_addr(),
        PodState::Terminating,
    );
    rig.wait_for(FP16, &[&b]).await;
    rig.api.delete_pod(NS, "fp16-a");
    rig.api.delete_pod(NS, "fp16-b");
    rig.wait_for(FP16, &[]).await;
    assert_eq!(rig.chat(FP16).await, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_trouble_never_empties_the_pool_and_recovery_lands_on_the_right_endpoints() {
    let rig = Rig::start().await;
    let pods: Vec<SimServer> =
        futures_util::future::join_all((0..5).map(|_| rig.pod(FP16, Duration::ZERO))).await;
    let [a, b, c, d, e] = &pods[..] else {
        unreachable!()
    };
    let put = |name: &str, pod: &SimServer| {
        rig.api
            .put_pod(NS, FP16_SVC, name, pod.local_addr(), PodState::Ready)
    };
    let count = |kind| rig.api.count(FP16_SVC, kind);
    put("a", a);
    rig.wait_for(FP16, &[a]).await;

    // A bookmark moves the watch's resourceVersion past changes it does not see (another
    // service's): when the watch ends and the history before the bookmark is gone, it
    // resumes from the bookmark without a relist.
    until("the watch", || rig.api.open_watches(FP16_SVC) == 1).await;
    let (lists, watches) = (count("list"), count("watch"));
    rig.api.put_pod(
        "elsewhere",
        "unrelated",
        "x",
        e.local_addr(),
        PodState::Ready,
    );
    rig.api.bookmark();
    rig.api.compact();
    rig.api.end_watches();
    until("the watch to resume", || count("watch") > watches).await;
    put("b", b);
    rig.wait_for(FP16, &[a, b]).await;
    assert_eq!(count("list"), lists, "no relist after a bookmark");

    // 410 Gone as a watch ERROR event: relist, and changes made meanwhile are picked up.
    let lists = count("list");
    rig.api.expire_watches();
    rig.api.delete_pod(NS, "b");
    put("c", c);
    rig.wait_for(FP16, &[a, c]).await;
    assert!(count("list") > lists, "relisted after 410");

    // The API goes down while the watcher relists: the failed lists keep the pool.
    rig.api.set_down(true);
    let refused = count("refused");
    rig.api.expire_watches();
    until("three refused relists", || count("refused") >= refused + 3).await;
    assert_eq!(rig.endpoints(FP16).len(), 2);
    assert_eq!(rig.chat(FP16).await, StatusCode::OK);
    rig.api.set_down(false);
    put("d", d);
    rig.wait_for(FP16, &[a, c, d]).await;

    // Dropped connection, and the resourceVersion it would resume from expires meanwhile:
    // the resumed watch gets HTTP 410, the watcher relists.
    rig.api.set_down(true);
    rig.api.set_gone_as_http(true);
    let refused = count("refused");
    rig.api.drop_watches();
    rig.api.delete_pod(NS, "d");
    rig.api.compact();
    until("three refused watches", || count("refused") >= refused + 3).await;
    assert_eq!(rig.endpoints(FP16).len(), 3, "errors never empty the pool");
    let lists = count("list");
    rig.api.set_down(false);
    rig.wait_for(FP16, &[a, c]).await;
    assert!(count("list") > lists, "relisted after HTTP 410");

    // A plain dropped connection resumes from its resourceVersion, without a relist.
    let (lists, watches) = (count("list"), count("watch"));
    rig.api.drop_watches();
    put("e", e);
    rig.wait_for(FP16, &[a, c, e]).await;
    until("the watch to resume", || count("watch") > watches).await;
    assert_eq!(count("list"), lists);
    assert_eq!(rig.chat(FP16).await, StatusCode::OK);

    let metrics = quantrouter::telemetry::metrics_handle().render();
    assert!(
        metrics.contains("quantrouter_discovery_events_total{result=\"error\"}"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminating_endpoint_gets_no_new_requests_while_its_stream_finishes() {
    let rig = Rig::start().await;
    let itl = Duration::from_millis(20);
    let (a, b) = (rig.pod(FP16, itl).await, rig.pod(FP16, itl).await);
    rig.api
        .put_pod(NS, FP16_SVC, "a", a.local_addr(), PodState::Ready);
    rig.api
        .put_pod(NS, FP16_SVC, "b", b.local_addr(), PodState::Ready);
    rig.wait_for(FP16, &[&a, &b]).await;

    // ~2 s of tokens.
    let body = serde_json::json!({"model": rig.set.profiles[FP16].id, "stream": true,
        "max_tokens": 100, "ignore_eos": true,
        "messages": [{"role": "user", "content": SIMPLE}]});
    let req = Request::post(rig.url())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let stream = client().request(req).await.unwrap();
    assert_eq!(stream.status(), StatusCode::OK);
    until("the stream to run", || a.running() + b.running() == 1).await;
    let (busy, busy_name, idle) = if a.running() == 1 {
        (&a, "a", &b)
    } else {
        (&b, "b", &a)
    };

    rig.api.put_pod(
        NS,
        FP16_SVC,
        busy_name,
        busy.local_addr(),
        PodState::Terminating,
    );
    rig.wait_for(FP16, &[idle]).await;
    assert_eq!(busy.running(), 1, "the stream is still in flight");
    let before = busy.stats().requests;
    let answers = futures_util::future::join_all((0..6).map(|_| rig.chat(FP16))).await;
    assert!(answers.iter().all(|s| *s == StatusCode::OK), "{answers:?}");
    assert_eq!(
        busy.stats().requests,
        before,
        "no new request to a terminating pod"
    );

    let text = stream.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&text);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(!text.contains("\"error\""), "{text}");
    assert_eq!(busy.running(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_under_load_fails_no_request() {
    let rig = Rig::start().await;
    let itl = Duration::from_millis(2);
    let mut old = Vec::new();
    for i in 0..3 {
        let pod = rig.pod(FP16, itl).await;
        rig.api.put_pod(
            NS,
            FP16_SVC,
            &format!("old-{i}"),
            pod.local_addr(),
            PodState::Ready,
        );
        old.push(pod);
    }
    rig.wait_for(FP16, &old.iter().collect::<Vec<_>>()).await;

    // Four clients, each sending one request after another until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let done: Arc<Vec<AtomicU64>> = Arc::new((0..4).map(|_| AtomicU64::new(0)).collect());
    let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let (url, model) = (rig.url(), rig.set.profiles[FP16].id.clone());
            let (stop, done, failures) = (stop.clone(), done.clone(), failures.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    match try_chat(&url, &model).await {
                        Ok(StatusCode::OK) => {}
                        other => failures.lock().unwrap().push(format!("{other:?}")),
                    }
                    done[w].fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    let progress = || {
        done.iter()
            .map(|d| d.load(Ordering::SeqCst))
            .collect::<Vec<_>>()
    };

    let mut new = Vec::new();
    for (i, pod) in old.into_iter().enumerate() {
        // The replacement starts not ready, then becomes ready.
        let fresh = rig.pod(FP16, itl).await;
        let name = format!("new-{i}");
        rig.api
            .put_pod(NS, FP16_SVC, &name, fresh.local_addr(), PodState::NotReady);
        rig.api
            .put_pod(NS, FP16_SVC, &name, fresh.local_addr(), PodState::Ready);
        until("the new pod in the pool", || {
            rig.endpoints(FP16).contains(&fresh.url())
        })
        .await;
        // The old one terminates: out of the pool first, shut down once nothing can be
        // on its way to it (every client finished a request picked after the removal).
        let old_name = format!("old-{i}");
        rig.api.put_pod(
            NS,
            FP16_SVC,
            &old_name,
            pod.local_addr(),
            PodState::Terminating,
        );
        until("the old pod out of the pool", || {
            !rig.endpoints(FP16).contains(&pod.url())
        })
        .await;
        let mark = progress();
        until("every client to finish two more requests", || {
            progress()
                .iter()
                .zip(&mark)
                .all(|(now, then)| *now >= then + 2)
        })
        .await;
        rig.api.delete_pod(NS, &old_name);
        pod.shutdown().await;
        new.push(fresh);
    }
    let mark = progress();
    until("load on the new pods", || {
        progress()
            .iter()
            .zip(&mark)
            .all(|(now, then)| *now >= then + 2)
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.await.unwrap();
    }

    let failures = failures.lock().unwrap().clone();
    let total: u64 = progress().iter().sum();
    assert!(
        failures.is_empty(),
        "{} of {total} failed: {failures:?}",
        failures.len()
    );
    assert!(total >= 24, "{total} requests");
    assert!(new.iter().all(|p| p.stats().requests > 0));
    rig.wait_for(FP16, &new.iter().collect::<Vec<_>>()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profile_reloads_start_and_stop_watches() {
    let rig = Rig::start().await;
    for service in [FP16_SVC, FP8_SVC, INT4_SVC] {
        until("a watch per service", || rig.api.open_watches(service) == 1).await;
    }
    let a = rig.pod(FP16, Duration::ZERO).await;
    rig.api
        .put_pod(NS, FP16_SVC, "a", a.local_addr(), PodState::Ready);
    rig.wait_for(FP16, &[&a]).await;
    let fp16_watches = rig.api.count(FP16_SVC, "watch");

    // v2: the fp8 profile moves to a new service; the int4 profile to static URLs.
    let mut v2 = rig.set.clone();
    v2.version += 1;
    v2.profiles[FP8].upstream = Upstream::Service(ServiceUpstream {
        service: "vllm-fp8-b".into(),
        namespace: NS.into(),
        port: 8000,
        api_key_env: None,
        api_key_file: None,
        metrics: None,
        ca_file: None,
        http2: false,
        apis: vec![UpstreamApi::Chat, UpstreamApi::Completions],
        balance: None,
        resume: true,
    });
    v2.profiles[2].upstream =
        Upstream::Static(StaticUpstream::new(vec!["http://127.0.0.1:9".into()]));
    rig.store
        .apply(v2.clone(), SourceKind::Embedded, false)
        .unwrap();
    until("a watch on the new service", || {
        rig.api.open_watches("vllm-fp8-b") == 1
    })
    .await;
    until("the removed services' watches closed", || {
        rig.api.open_watches(FP8_SVC) == 0 && rig.api.open_watches(INT4_SVC) == 0
    })
    .await;
    assert_eq!(rig.api.open_watches(FP16_SVC), 1);
    assert_eq!(
        rig.api.count(FP16_SVC, "watch"),
        fp16_watches,
        "kept, not restarted"
    );
    let b = rig.pod(FP8, Duration::ZERO).await;
    rig.api
        .put_pod(NS, "vllm-fp8-b", "b", b.local_addr(), PodState::Ready);
    rig.wait_for(FP8, &[&b]).await;
    assert_eq!(rig.chat(FP8).await, StatusCode::OK);

    // v3 renames the fp16 profile: its new pool starts from the known endpoints at once.
    let mut v3 = v2;
    v3.version += 1;
    v3.profiles[FP16].id = "fp16-renamed".into();
    v3.default_profile = "fp16-renamed".into();
    rig.store.apply(v3, SourceKind::Embedded, false).unwrap();
    assert_eq!(rig.endpoints(FP16), [a.url()]);
    assert_eq!(
        try_chat(&rig.url(), "fp16-renamed").await.unwrap(),
        StatusCode::OK
    );
}
