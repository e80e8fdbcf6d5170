//! Kubernetes discovery: the router balances across the ready pods of a service itself
//! instead of going through the service's cluster DNS name (`serve --discovery kubernetes`).
//!
//! A controller task follows the profile set ([`ProfileStore::subscribe`]) and keeps one
//! watcher task per service upstream (`{service, namespace, port}`), started when a profile
//! set first names the service and stopped when none does any more. Each watcher task
//! watches the EndpointSlices labelled `kubernetes.io/service-name=<service>` in the
//! namespace (kube's `watcher` into a reflector store), turns them into base URLs
//! ([`slices::ready_urls`]) and replaces the endpoint list of every pool of that service
//! ([`crate::upstream::Pool::set_urls`]). New profile sets start their service pools from
//! the last known list ([`ProfileStore::use_discovered_endpoints`]).
//!
//! What keeps the pool right when things go wrong:
//! - Until a service was listed once, its pool uses the cluster DNS name, so a router that
//!   cannot reach the API server (say, RBAC is missing) still routes through kube-proxy.
//! - A failed list or watch leaves the last known endpoints in place; the watcher backs off
//!   (exponential, [`DiscoveryConfig`]) and resumes from its resourceVersion, or relists
//!   after a 410 Gone. A relist replaces the endpoints only once it is complete, so only a
//!   successful list that finds no ready endpoint empties a pool.
//! - Removing an endpoint from a pool stops new requests to it; requests and streams already
//!   on it hold it by `Arc` and finish.
//!
//! ## RBAC
//!
//! The router's service account needs read access to EndpointSlices in every namespace
//! its profiles name, and nothing else:
//!
//! ```yaml
//! apiVersion: rbac.authorization.k8s.io/v1
//! kind: Role            # one per namespace with vLLM services (or a ClusterRole)
//! metadata: {name: quantrouter-discovery, namespace: llm}
//! rules:
//!   - apiGroups: ["discovery.k8s.io"]
//!     resources: ["endpointslices"]
//!     verbs: ["get", "list", "watch"]
//! ```
//! bound to the router's service account with a RoleBinding. The client comes from
//! [`kube::Config::infer`]: a kubeconfig (`KUBECONFIG` or `~/.kube/config`) when there is
//! one, else the in-cluster service account.

pub mod slices;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::utils::{Backoff, ResetTimerBackoff};
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::Api;
use quantrouter_policy::{ProfileSet, ServiceUpstream, Upstream};
use tokio::task::JoinHandle;

use crate::profiles::{DiscoveredEndpoints, ProfileStore, Snapshot};
use crate::resilience::backoff::Schedule;
use crate::telemetry;

/// The label the EndpointSlice controller puts on every slice of a service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// One watched service: a profile's `{service, namespace, port}` upstream.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServiceKey {
    pub namespace: String,
    pub service: String,
    /// The service port; picks the slice port (see [`slices::resolve_port`]).
    pub port: u16,
}

/// Watch retry settings.
#[derive(Debug, Clone, Copy)]
pub struct DiscoveryConfig {
    /// Ceiling of the first wait after a failed list or watch (full jitter below it);
    /// kube-rs's default, long enough not to hammer an API server that is restarting.
    pub min_backoff: Duration,
    /// The ceiling doubles up to this; an outage longer than that is retried about twice a
    /// minute.
    pub max_backoff: Duration,
    /// The wait starts again from `min_backoff` only after this long without a retry, so a
    /// watch that fails right after connecting every time still backs off.
    pub reset_backoff_after: Duration,
}

/// Why a Kubernetes client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("no Kubernetes configuration (neither a kubeconfig nor in-cluster): {0}")]
    Config(#[from] kube::config::InferConfigError),
    #[error("building the Kubernetes client: {0}")]
    Client(#[from] kube::Error),
}

/// Running discovery; dropping it stops every watch.
#[derive(Debug)]
pub struct Discovery {
    known: Arc<KnownEndpoints>,
    controller: JoinHandle<()>,
}

/// The last known ready endpoints of every watched service.
#[derive(Debug, Default)]
struct KnownEndpoints {
    by_service: Mutex<HashMap<ServiceKey, Vec<String>>>,
}

struct Shared {
    client: kube::Client,
    store: Arc<ProfileStore>,
    known: Arc<KnownEndpoints>,
    config: DiscoveryConfig,
}

/// A running watcher task; dropping it stops the task.
#[derive(Debug)]
struct Watch {
    /// Set before the task is aborted, so a list it is about to record is discarded.
    stopped: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

/// The router's one backoff ([`crate::resilience::backoff`]) as kube's `StreamBackoff` wants it.
#[derive(Debug)]
struct WatchBackoff(Schedule);

/// A Kubernetes client from the environment: a kubeconfig if there is one, else the
/// in-cluster service account.
pub async fn kube_client() -> Result<kube::Client, DiscoveryError> {
    crate::tls::install_crypto_provider();
    let config = kube::Config::infer().await?;
    Ok(kube::Client::try_from(config)?)
}

// === impl Discovery ===

impl Discovery {
    /// Starts following `store`'s profile set; spawns on the current tokio runtime.
    pub fn start(store: Arc<ProfileStore>, client: kube::Client, config: DiscoveryConfig) -> Self {
        let known = Arc::new(KnownEndpoints::default());
        if !store.use_discovered_endpoints(Arc::clone(&known) as Arc<dyn DiscoveredEndpoints>) {
            tracing::warn!("the profile store already follows another discovery; new pools start from its endpoints");
        }
        let shared = Arc::new(Shared {
            client,
            store,
            known: Arc::clone(&known),
            config,
        });
        Self {
            known,
            controller: tokio::spawn(control(shared)),
        }
    }

    /// The last known ready endpoints of a service; `None` before its first list.
    pub fn last_known(&self, key: &ServiceKey) -> Option<Vec<String>> {
        self.known.lock().get(key).cloned()
    }
}

impl Drop for Discovery {
    fn drop(&mut self) {
        // The controller owns the watches; aborting it drops (and so stops) them.
        self.controller.abort();
    }
}

/// Keeps one watch per service the active profile set names, and re-applies the known
/// endpoints to the pools of every new snapshot (one built while an update was landing may
/// have started from the list before it).
async fn control(shared: Arc<Shared>) {
    let mut changes = shared.store.subscribe();
    let mut watches: HashMap<ServiceKey, Watch> = HashMap::new();
    loop {
        changes.borrow_and_update();
        let snapshot = shared.store.load();
        let wanted = service_keys(&snapshot.set);
        watches.retain(|key, _| wanted.contains(key));
        shared.known.retain(&wanted);
        for key in &wanted {
            if !watches.contains_key(key) {
                tracing::info!(service = %key, "watching EndpointSlices");
                watches.insert(key.clone(), Watch::start(&shared, key.clone()));
            }
        }
        shared.known.apply_all(&snapshot);
        if changes.changed().await.is_err() {
            return;
        }
    }
}

/// Every service upstream of the set (disabled profiles too, so re-enabling one finds its
/// pool current).
fn service_keys(set: &ProfileSet) -> HashSet<ServiceKey> {
    set.profiles
        .iter()
        .filter_map(|p| match &p.upstream {
            Upstream::Service(s) => Some(ServiceKey::from(s)),
            Upstream::Static(_) => None,
        })
        .collect()
}

/// Follows one service's EndpointSlices until aborted.
async fn watch_service(shared: Arc<Shared>, key: ServiceKey, stopped: Arc<AtomicBool>) {
    let api: Api<EndpointSlice> = Api::namespaced(shared.client.clone(), &key.namespace);
    let selector = format!("{SERVICE_NAME_LABEL}={}", key.service);
    // Kept across watcher restarts: it holds the last complete state until a relist is done.
    let (reflected, mut writer) = reflector::store::<EndpointSlice>();
    loop {
        let events = watcher(api.clone(), watcher::Config::default().labels(&selector))
            .backoff(shared.config.backoff());
        let mut events = pin!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(event) => {
                    writer.apply_watcher_event(&event);
                    // Init and InitApply only fill the store's relist buffer.
                    if let watcher::Event::Apply(_)
                    | watcher::Event::Delete(_)
                    | watcher::Event::InitDone = event
                    {
                        let state = reflected.state();
                        let urls = slices::ready_urls(state.iter().map(AsRef::as_ref), key.port);
                        shared.known.update(&shared.store, &key, urls, &stopped);
                    }
                }
                Err(error) => {
                    telemetry::discovery_event("error");
                    tracing::warn!(service = %key, %error, "EndpointSlice list/watch failed; keeping the last known endpoints");
                    if is_gone(&error) {
                        break;
                    }
                }
            }
        }
        // kube's watcher relists after a 410 ERROR event, but answers an HTTP 410 to a watch
        // request by retrying the same expired resourceVersion forever; a new watcher relists.
        tokio::time::sleep(shared.config.min_backoff).await;
    }
}

/// An HTTP 410 Gone answering a watch request. (A 410 ERROR event inside a watch stream is
/// `WatchError`, which kube's watcher handles itself by relisting.)
fn is_gone(error: &watcher::Error) -> bool {
    matches!(
        error,
        watcher::Error::WatchStartFailed(kube::Error::Api(status))
            | watcher::Error::WatchFailed(kube::Error::Api(status))
            if status.code == 410
    )
}

// === impl ServiceKey ===

impl From<&ServiceUpstream> for ServiceKey {
    fn from(s: &ServiceUpstream) -> Self {
        Self {
            namespace: s.namespace.clone(),
            service: s.service.clone(),
            port: s.port,
        }
    }
}

impl ServiceKey {
    fn is_for(&self, s: &ServiceUpstream) -> bool {
        self.port == s.port && self.service == s.service && self.namespace == s.namespace
    }
}

impl fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}:{}", self.namespace, self.service, self.port)
    }
}

// === impl KnownEndpoints ===

impl KnownEndpoints {
    fn lock(&self) -> MutexGuard<'_, HashMap<ServiceKey, Vec<String>>> {
        self.by_service
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a service's endpoints and applies them to the active pools of the service.
    /// Applying under the lock keeps pool updates in the order they were recorded.
    fn update(
        &self,
        store: &ProfileStore,
        key: &ServiceKey,
        urls: Vec<String>,
        stopped: &AtomicBool,
    ) {
        let mut known = self.lock();
        if stopped.load(Ordering::SeqCst) || known.get(key) == Some(&urls) {
            return;
        }
        tracing::info!(service = %key, endpoints = urls.len(), "service endpoints changed");
        telemetry::discovery_event("updated");
        apply(&store.load(), key, &urls);
        known.insert(key.clone(), urls);
    }

    fn apply_all(&self, snapshot: &Snapshot) {
        for (key, urls) in self.lock().iter() {
            apply(snapshot, key, urls);
        }
    }

    /// Forgets services no longer watched (their watches were stopped first), so a service
    /// added again later does not start from a stale list.
    fn retain(&self, wanted: &HashSet<ServiceKey>) {
        self.lock().retain(|key, _| wanted.contains(key));
    }
}

fn apply(snapshot: &Snapshot, key: &ServiceKey, urls: &[String]) {
    for (profile, pool) in snapshot.set.profiles.iter().zip(snapshot.pools()) {
        if matches!(&profile.upstream, Upstream::Service(s) if key.is_for(s)) {
            pool.set_urls(urls);
        }
    }
}

impl DiscoveredEndpoints for KnownEndpoints {
    fn last_known(&self, service: &ServiceUpstream) -> Option<Vec<String>> {
        self.lock().get(&ServiceKey::from(service)).cloned()
    }
}

// === impl Watch ===

impl Watch {
    fn start(shared: &Arc<Shared>, key: ServiceKey) -> Self {
        let stopped = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(watch_service(Arc::clone(shared), key, Arc::clone(&stopped)));
        Self { stopped, task }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::SeqCst);
        self.task.abort();
    }
}

// === impl DiscoveryConfig ===

impl DiscoveryConfig {
    fn backoff(&self) -> ResetTimerBackoff<WatchBackoff> {
        let backoff = crate::resilience::backoff::Backoff {
            base: self.min_backoff,
            cap: self.max_backoff,
            // The API server's watch errors carry no Retry-After.
            retry_after_cap: Duration::ZERO,
        };
        ResetTimerBackoff::new(WatchBackoff(backoff.schedule()), self.reset_backoff_after)
    }
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            min_backoff: Duration::from_millis(800),
            max_backoff: Duration::from_secs(30),
            reset_backoff_after: Duration::from_secs(120),
        }
    }
}

// === impl WatchBackoff ===

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        self.0.next()
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.0.reset();
    }
}
