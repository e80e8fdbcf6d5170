//! The endpoints of one profile, with per-endpoint state (in-flight count, latency EWMA,
//! scraped upstream queue, circuit breaker), power-of-two-choices balancing, the profile's
//! admission slots, its retry budget, its upstream credential and the characters per token
//! its upstream's tokenizer was seen to average.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{HeaderValue, Uri};
use quantrouter_policy::{choose_endpoint, Affinity, EndpointLoad, PrefixTable};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::client::Transport;
use super::credential::Credential;
use super::queue::{QueueReading, QueueSource};
use super::UpstreamError;
use crate::resilience::{Admission, Admit, Breaker, CircuitState, ResilienceConfig, RetryBudget};

/// Endpoints of one profile.
#[derive(Debug)]
pub struct Pool {
    endpoints: ArcSwap<Vec<Arc<Endpoint>>>,
    pub admission: Admission,
    budget: Mutex<RetryBudget>,
    config: ResilienceConfig,
    inflight: AtomicU64,
    /// Wakes requests waiting for a first endpoint (scale from zero).
    changed: Notify,
    cold_waiting: AtomicU64,
    /// The bearer token for this profile's upstream, when the profile names one.
    credential: Option<Arc<Credential>>,
    /// How connections to this profile's upstream are made (CA file, HTTP/2).
    transport: Transport,
    /// Prompt bytes per token as the upstream counted them.
    token_ratio: Mutex<TokenRatio>,
}

/// The API paths requests are forwarded to.
const GENERATION_PATHS: [&str; 2] = [
    crate::openai::Endpoint::Chat.path(),
    crate::openai::Endpoint::Completions.path(),
];

/// One upstream base URL (`http[s]://host:port[/prefix]`, no trailing slash) and what the router
/// knows about it.
#[derive(Debug)]
pub struct Endpoint {
    base: String,
    /// [`Endpoint::uri`] of the generation paths, parsed once instead of per request.
    generation_uris: [OnceLock<Uri>; GENERATION_PATHS.len()],
    inflight: AtomicU64,
    /// This router's requests in flight here when the last scrape was recorded: the part
    /// of the scraped queue that was its own.
    inflight_at_scrape: AtomicU64,
    /// Prompt blocks this router sent here, not estimated to be cached, whose answers have
    /// not started: the prefill queued ahead of a new request.
    queued_blocks: AtomicU64,
    /// Requests waiting upstream (`vllm:num_requests_waiting` or another server's
    /// equivalent) from the last scrape.
    waiting: AtomicU64,
    /// Requests the upstream is generating, from the last scrape.
    running: AtomicU64,
    /// Whose queue metrics the last scrape found ([`QueueSource`] as a byte).
    queue_source: AtomicU8,
    /// The health check's path: 0 `/health`, 1 `/v1/models` (the server has no `/health`).
    health_path: AtomicU8,
    /// Response-header latency EWMA in microseconds (f64 bits); 0 before the first answer.
    latency_ewma_us: AtomicU64,
    breaker: Mutex<Breaker>,
    /// The server's KV-cache usage from the last scrape (f64 bits); NaN when it has none.
    kv_usage: AtomicU64,
    /// Prompt blocks recently sent here: where a prompt's cached prefix likely is.
    prefixes: Mutex<PrefixTable>,
}

/// A request's prompt as endpoint choice sees it, and what the choice did with it.
#[derive(Debug, Default)]
pub struct Placement {
    /// The prompt's chained block hashes (`quantrouter_policy::prefix_blocks`).
    pub blocks: Vec<u64>,
    /// The whole prompt's size in blocks, hashed or not.
    prompt_blocks: u64,
    /// The last endpoint was chosen for its cached prefix.
    by_prefix: AtomicBool,
}

/// A chosen endpoint; report the outcome with [`Pick::succeeded`] or [`Pick::failed`]. A
/// pick dropped unreported (the client left mid-attempt) frees its half-open probe slot.
#[derive(Debug)]
pub struct Pick {
    pub endpoint: Arc<Endpoint>,
    probe: bool,
    reported: bool,
    /// Blocks this request added to the endpoint's queued prefill until its answer starts.
    queued_blocks: u64,
}

/// Counts a request in flight on a pool and an endpoint until dropped.
#[derive(Debug)]
pub struct InflightGuard {
    pool: Arc<Pool>,
    endpoint: Arc<Endpoint>,
}

/// Counts a request waiting for a pool's first endpoint until dropped, however the wait ends.
#[derive(Debug)]
struct ColdWaiter<'a>(&'a AtomicU64);

/// Weight of the newest sample in the latency EWMA: about the last ten requests.
const EWMA_WEIGHT: f64 = 0.1;

/// Characters per token learned from the upstream's `usage.prompt_tokens`: decayed sums of
/// prompt bytes and reported tokens, read against the profile's own figure as a prior.
/// Long prompts weigh most, which suits the context check: it matters for long prompts.
#[derive(Debug, Default, Clone, Copy)]
struct TokenRatio {
    bytes: f64,
    tokens: f64,
}

/// Share each new answer takes from the sums: the last few dozen answers count.
const RATIO_DECAY: f64 = 1.0 / 32.0;
/// The profile's `chars_per_token` counts as this many tokens' worth of evidence, so one
/// odd answer moves the figure only as far as its size warrants.
const RATIO_PRIOR_TOKENS: f64 = 512.0;
/// The learned figure stays within this factor of the profile's: a tokenizer is not four
/// times denser or sparser than the operator measured, whatever an upstream reports.
const RATIO_BOUND: f64 = 4.0;

// === impl Pool ===

impl Pool {
    pub fn new(urls: &[String], max_concurrency: u32, config: &ResilienceConfig) -> Self {
        let now = Instant::now();
        let pool = Self {
            endpoints: ArcSwap::from_pointee(Vec::new()),
            admission: Admission::new(max_concurrency, &config.admission),
            budget: Mutex::new(RetryBudget::new(config.budget, now)),
            config: *config,
            inflight: AtomicU64::new(0),
            changed: Notify::new(),
            cold_waiting: AtomicU64::new(0),
            credential: None,
            transport: Transport::default(),
            token_ratio: Mutex::default(),
        };
        pool.set_urls(urls);
        pool
    }

    /// Sends `credential`'s token to this pool's upstream.
    pub fn with_credential(mut self, credential: Option<Arc<Credential>>) -> Self {
        self.credential = credential;
        self
    }

    /// Connects to this pool's upstream as `transport` says.
    pub fn with_transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    /// How connections to this pool's upstream are made.
    pub fn transport(&self) -> &Transport {
        &self.transport
    }

    /// The upstream's credential, if the profile names one.
    pub fn credential(&self) -> Option<&Credential> {
        self.credential.as_deref()
    }

    /// The `Authorization` header for requests, scrapes and health checks to this upstream.
    pub fn authorization(&self) -> Option<HeaderValue> {
        self.credential.as_ref()?.header()
    }

    /// Learns from an answer: a prompt of `bytes` that the upstream counted as
    /// `prompt_tokens`, of which `overhead_tokens` are the per-message framing the estimate
    /// adds on its own.
    pub fn observe_prompt(&self, bytes: usize, overhead_tokens: u64, prompt_tokens: u64) {
        let text_tokens = prompt_tokens.saturating_sub(overhead_tokens);
        if bytes == 0 || text_tokens == 0 {
            return;
        }
        let mut ratio = lock(&self.token_ratio);
        ratio.bytes = ratio.bytes * (1.0 - RATIO_DECAY) + bytes as f64;
        ratio.tokens = ratio.tokens * (1.0 - RATIO_DECAY) + text_tokens as f64;
    }

    /// Characters per token as learned for a profile whose document says `configured`;
    /// `None` before any answer reported usage.
    pub fn chars_per_token(&self, configured: f64) -> Option<f64> {
        let ratio = *lock(&self.token_ratio);
        if ratio.tokens <= 0.0 || !(configured > 0.0 && configured.is_finite()) {
            return None;
        }
        let learned =
            (RATIO_PRIOR_TOKENS * configured + ratio.bytes) / (RATIO_PRIOR_TOKENS + ratio.tokens);
        Some(learned.clamp(configured / RATIO_BOUND, configured * RATIO_BOUND))
    }

    /// Replaces the endpoint list (discovery, reloads). Endpoints whose URL stays keep their
    /// state; removed ones get no new requests, and requests in flight on them finish (they
    /// hold their endpoint).
    pub fn set_urls(&self, urls: &[String]) {
        let current = self.endpoints.load();
        let now = Instant::now();
        let next = urls
            .iter()
            .map(|url| {
                let base = url.trim_end_matches('/');
                current
                    .iter()
                    .find(|e| e.base == base)
                    .cloned()
                    .unwrap_or_else(|| Arc::new(Endpoint::new(base, &self.config, now)))
            })
            .collect();
        self.endpoints.store(Arc::new(next));
        self.changed.notify_waiters();
    }

    /// Waits up to `timeout` for the pool to have an endpoint (a tier scaled to zero coming
    /// up). Waiting requests count in the tier's queue depth until their wait ends, also when
    /// a client gives up and drops it: a phantom waiter would keep the tier from ever scaling
    /// back to zero.
    pub async fn wait_for_endpoints(&self, timeout: Duration) -> bool {
        let _waiting = ColdWaiter::enter(&self.cold_waiting);
        let deadline = Instant::now() + timeout;
        loop {
            // Register before checking, so an update in between is not missed.
            let changed = self.changed.notified();
            if self.has_endpoints() {
                return true;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return self.has_endpoints();
            }
        }
    }

    /// Requests waiting for this pool's first endpoint.
    pub fn cold_waiting(&self) -> u64 {
        self.cold_waiting.load(Ordering::Relaxed)
    }

    /// The base URLs requests are balanced over now.
    pub fn endpoint_urls(&self) -> Vec<String> {
        self.endpoints
            .load()
            .iter()
            .map(|e| e.base.clone())
            .collect()
    }

    /// The current endpoints.
    pub fn endpoints(&self) -> Arc<Vec<Arc<Endpoint>>> {
        self.endpoints.load_full()
    }

    pub fn has_endpoints(&self) -> bool {
        !self.endpoints.load().is_empty()
    }

    /// Some endpoint would take a request now (not every circuit is open).
    pub fn available(&self, now: Instant) -> bool {
        self.endpoints
            .load()
            .iter()
            .any(|e| e.lock_breaker().would_admit(now))
    }

    /// Endpoints whose circuit is not open.
    pub fn ready_endpoints(&self, now: Instant) -> usize {
        self.endpoints
            .load()
            .iter()
            .filter(|e| e.circuit(now) != CircuitState::Open)
            .count()
    }

    /// Requests this router has in flight on this pool.
    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Requests waiting upstream (the servers' own queues) over all endpoints, as last
    /// scraped.
    pub fn upstream_waiting(&self) -> u64 {
        self.endpoints
            .load()
            .iter()
            .map(|e| e.waiting.load(Ordering::Relaxed))
            .sum()
    }

    /// Power of two choices among endpoints not yet `tried` whose circuit admits a request:
    /// of two random candidates, the one with less load (router in-flight plus the other
    /// clients' requests in the scraped upstream queue). Deterministic for one or two
    /// candidates.
    pub fn pick(&self, tried: &[Arc<Endpoint>], now: Instant) -> Option<Pick> {
        self.pick_placed(None, tried, now)
    }

    /// [`Pool::pick`], or with `placed` (`upstream.balance: prefix`) the endpoint where the
    /// prompt's first token is expected soonest (prefill queued there and the part of the
    /// prompt it does not hold) within the load bound; the prompt is then remembered there
    /// and its uncached blocks count as queued there until its answer starts.
    pub fn pick_placed(
        &self,
        placed: Option<(&Placement, Affinity)>,
        tried: &[Arc<Endpoint>],
        now: Instant,
    ) -> Option<Pick> {
        let endpoints = self.endpoints.load();
        let untried = |e: &&Arc<Endpoint>| !tried.iter().any(|t| Arc::ptr_eq(t, e));
        let candidates: Vec<&Arc<Endpoint>> = endpoints
            .iter()
            .filter(untried)
            .filter(|e| e.lock_breaker().would_admit(now))
            .collect();
        let (chosen, queued_blocks) = match (placed, candidates.as_slice()) {
            (_, []) => return None,
            // One endpoint: nothing to choose, and its table would only cost time.
            (_, [only]) => (*only, 0),
            (Some((placement, affinity)), all) => by_prefix(placement, &affinity, all)?,
            (None, [a, b]) => (lighter(a, b), 0),
            (None, many) => {
                let i = fastrand::usize(..many.len());
                let j = (i + 1 + fastrand::usize(..many.len() - 1)) % many.len();
                (lighter(many[i], many[j]), 0)
            }
        };
        let probe = match chosen.lock_breaker().admit(now) {
            Admit::Yes => false,
            Admit::Probe => true,
            // Raced with another request for the last probe slot.
            Admit::No => return None,
        };
        if queued_blocks != 0 {
            chosen
                .queued_blocks
                .fetch_add(queued_blocks, Ordering::Relaxed);
        }
        Some(Pick {
            endpoint: Arc::clone(chosen),
            probe,
            reported: false,
            queued_blocks,
        })
    }

    /// Counts a first attempt against the retry budget.
    pub fn on_request(&self, now: Instant) {
        lock(&self.budget).on_request(now);
    }

    /// Takes a retry from the budget, if any is left.
    pub fn try_retry(&self, now: Instant) -> bool {
        lock(&self.budget).try_retry(now)
    }

    /// Counts a request in flight on this pool and `endpoint` until the guard drops.
    pub fn enter(self: &Arc<Self>, endpoint: &Arc<Endpoint>) -> InflightGuard {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        endpoint.inflight.fetch_add(1, Ordering::Relaxed);
        InflightGuard {
            pool: Arc::clone(self),
            endpoint: Arc::clone(endpoint),
        }
    }
}

/// How a request to `profile` picks its endpoint: by `placement`'s expected first-token
/// wait within the policy's load bound when the profile balances by prefix, else by load
/// alone.
pub fn placed<'p>(
    set: &quantrouter_policy::ProfileSet,
    profile: quantrouter_policy::ProfileIndex,
    placement: &'p Placement,
) -> Option<(&'p Placement, Affinity)> {
    let balance = set.profiles[profile].upstream.balance();
    let affinity = set.policy.affinity;
    (balance == quantrouter_policy::Balance::Prefix).then_some((placement, affinity))
}

/// The policy's choice by queued prefill, cached prefix and load among `candidates`, and
/// the blocks of the prompt the chosen endpoint must compute; the prompt's blocks are then
/// remembered there.
fn by_prefix<'a>(
    placement: &Placement,
    affinity: &Affinity,
    candidates: &[&'a Arc<Endpoint>],
) -> Option<(&'a Arc<Endpoint>, u64)> {
    let blocks = &placement.blocks;
    let loads: Vec<EndpointLoad> = candidates
        .iter()
        .map(|e| EndpointLoad {
            load: e.load(),
            queued_blocks: e.queued_blocks.load(Ordering::Relaxed),
            kv_usage: e.kv_usage(),
            matched_blocks: match blocks.is_empty() {
                true => 0,
                false => lock(&e.prefixes).matched(blocks),
            },
        })
        .collect();
    let choice = choose_endpoint(&loads, placement.prompt_blocks, affinity, fastrand::u64(..))?;
    let chosen = candidates.get(choice.index)?;
    if !blocks.is_empty() {
        lock(&chosen.prefixes).record(blocks);
    }
    placement
        .by_prefix
        .store(choice.by_prefix, Ordering::Relaxed);
    Some((chosen, choice.uncached_blocks))
}

fn lighter<'a>(a: &'a Arc<Endpoint>, b: &'a Arc<Endpoint>) -> &'a Arc<Endpoint> {
    if b.load() < a.load() {
        b
    } else {
        a
    }
}

/// A poisoned lock's data is still sound: nothing locked with this panics mid-update.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

// === impl Endpoint ===

impl Endpoint {
    pub(crate) fn new(base: &str, config: &ResilienceConfig, now: Instant) -> Self {
        Self {
            base: base.to_owned(),
            generation_uris: Default::default(),
            inflight: AtomicU64::new(0),
            inflight_at_scrape: AtomicU64::new(0),
            queued_blocks: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            running: AtomicU64::new(0),
            queue_source: AtomicU8::new(QueueSource::Unknown.as_byte()),
            health_path: AtomicU8::new(0),
            latency_ewma_us: AtomicU64::new(0f64.to_bits()),
            breaker: Mutex::new(Breaker::new(config.breaker, now)),
            kv_usage: AtomicU64::new(f64::NAN.to_bits()),
            prefixes: Mutex::default(),
        }
    }

    /// The full URI for an API path such as `/v1/chat/completions`.
    pub fn uri(&self, path: &str) -> Result<Uri, UpstreamError> {
        let parse = || {
            let mut s = String::with_capacity(self.base.len() + path.len());
            s.push_str(&self.base);
            s.push_str(path);
            s.parse().map_err(|_| UpstreamError::InvalidUrl(s))
        };
        let Some(i) = GENERATION_PATHS.iter().position(|p| *p == path) else {
            return parse();
        };
        if let Some(uri) = self.generation_uris[i].get() {
            return Ok(uri.clone());
        }
        let uri = parse()?;
        Ok(self.generation_uris[i].get_or_init(|| uri).clone())
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Load for balancing: this router's requests in flight now, plus the requests of
    /// other clients (other router replicas) the last scrape found beyond this router's
    /// own at that moment. The scrape is up to a second old: taken whole, it would hide
    /// the requests that ended or started since, and every pick until the next scrape
    /// would see the same stale counts and herd onto one endpoint.
    fn load(&self) -> u64 {
        let upstream = self.running.load(Ordering::Relaxed) + self.waiting();
        let others = upstream.saturating_sub(self.inflight_at_scrape.load(Ordering::Relaxed));
        self.inflight() + others
    }

    /// Prompt blocks queued for prefill here by this router (see [`Pool::pick_placed`]).
    pub fn queued_blocks(&self) -> u64 {
        self.queued_blocks.load(Ordering::Relaxed)
    }

    /// Requests waiting upstream, as last scraped.
    pub fn waiting(&self) -> u64 {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Requests the upstream was generating, as last scraped.
    pub fn running(&self) -> u64 {
        self.running.load(Ordering::Relaxed)
    }

    pub fn set_waiting(&self, waiting: u64) {
        self.waiting.store(waiting, Ordering::Relaxed);
    }

    /// Records a scrape; returns the previous source when the source changed.
    pub fn set_queue(&self, reading: QueueReading) -> Option<QueueSource> {
        self.inflight_at_scrape
            .store(self.inflight(), Ordering::Relaxed);
        self.waiting
            .store(reading.waiting.unwrap_or(0), Ordering::Relaxed);
        self.running
            .store(reading.running.unwrap_or(0), Ordering::Relaxed);
        let new = reading.source.as_byte();
        let old = self.queue_source.swap(new, Ordering::Relaxed);
        (old != new).then(|| QueueSource::from_byte(old))
    }

    /// The server's KV-cache usage in [0, 1] from the last scrape, if it exports one.
    pub fn kv_usage(&self) -> Option<f64> {
        let usage = f64::from_bits(self.kv_usage.load(Ordering::Relaxed));
        (!usage.is_nan()).then_some(usage)
    }

    /// Records the KV-cache usage a scrape found (`None`: the page had none).
    pub fn set_kv_usage(&self, usage: Option<f64>) {
        let usage = usage.filter(|u| u.is_finite()).unwrap_or(f64::NAN);
        self.kv_usage.store(usage.to_bits(), Ordering::Relaxed);
    }

    /// Whose queue metrics the last scrape found.
    pub fn queue_source(&self) -> QueueSource {
        QueueSource::from_byte(self.queue_source.load(Ordering::Relaxed))
    }

    /// The path health checks use: `/health` until the server showed it has none.
    pub fn health_path(&self) -> &'static str {
        match self.health_path.load(Ordering::Relaxed) {
            0 => "/health",
            _ => "/v1/models",
        }
    }

    /// The server has no `/health`: check `/v1/models` from now on.
    pub fn use_models_for_health(&self) {
        self.health_path.store(1, Ordering::Relaxed);
    }

    /// When an open circuit will let a probe through.
    pub fn open_until(&self) -> Option<Instant> {
        self.lock_breaker().open_until()
    }

    /// An active health check's turn at the breaker: `None` while the circuit refuses
    /// requests (open, or its half-open probes taken).
    pub fn admit_check(self: &Arc<Self>, now: Instant) -> Option<Pick> {
        let probe = match self.lock_breaker().admit(now) {
            Admit::Yes => false,
            Admit::Probe => true,
            Admit::No => return None,
        };
        Some(Pick {
            endpoint: Arc::clone(self),
            probe,
            reported: false,
            queued_blocks: 0,
        })
    }

    /// The endpoint failed after its answer started (a stream broke): its breaker counts
    /// it like a failed request.
    pub fn failed_mid_answer(&self) {
        self.lock_breaker().on_failure(Instant::now(), false);
    }

    pub fn circuit(&self, now: Instant) -> CircuitState {
        self.lock_breaker().state(now)
    }

    /// Response-header latency EWMA, if any answer was seen.
    pub fn latency_ewma(&self) -> Option<Duration> {
        let us = f64::from_bits(self.latency_ewma_us.load(Ordering::Relaxed));
        (us > 0.0).then(|| Duration::from_secs_f64(us / 1e6))
    }

    fn observe_latency(&self, latency: Duration) {
        let sample = latency.as_secs_f64() * 1e6;
        // Lost updates under a race only drop a sample; a CAS loop is not worth it here.
        let old = f64::from_bits(self.latency_ewma_us.load(Ordering::Relaxed));
        let new = if old == 0.0 {
            sample
        } else {
            old + EWMA_WEIGHT * (sample - old)
        };
        self.latency_ewma_us.store(new.to_bits(), Ordering::Relaxed);
    }

    fn lock_breaker(&self) -> MutexGuard<'_, Breaker> {
        lock(&self.breaker)
    }
}

// === impl Placement ===

impl Placement {
    pub fn new(blocks: Vec<u64>) -> Self {
        Self {
            prompt_blocks: blocks.len() as u64,
            blocks,
            by_prefix: AtomicBool::new(false),
        }
    }

    /// The prompt is `bytes` long: its blocks past the hashed prefix count as prefill too.
    pub fn with_prompt_bytes(mut self, bytes: usize) -> Self {
        self.prompt_blocks = quantrouter_policy::prompt_blocks(bytes).max(self.prompt_blocks);
        self
    }

    /// The endpoint that got the last attempt was chosen for its cached prefix.
    pub fn by_prefix(&self) -> bool {
        self.by_prefix.load(Ordering::Relaxed)
    }
}

// === impl Pick ===

impl Pick {
    /// The endpoint answered (any status that is not its own failure).
    pub fn succeeded(mut self, latency: Duration) {
        self.reported = true;
        self.endpoint.observe_latency(latency);
        self.endpoint
            .lock_breaker()
            .on_success(Instant::now(), self.probe);
    }

    /// The endpoint failed: connection error, timeout, or a 5xx of its own.
    pub fn failed(mut self) {
        self.reported = true;
        self.endpoint
            .lock_breaker()
            .on_failure(Instant::now(), self.probe);
    }

    /// An active health check's outcome. A failed check counts like a failed request; a
    /// passed one counts only as a half-open probe: it can close a circuit without traffic,
    /// but it must not wipe out the failures of real requests (a server can answer `/health`
    /// and still fail every generation).
    pub fn checked(mut self, healthy: bool) {
        self.reported = true;
        let now = Instant::now();
        let mut breaker = self.endpoint.lock_breaker();
        match (healthy, self.probe) {
            (false, probe) => breaker.on_failure(now, probe),
            (true, true) => breaker.on_success(now, true),
            (true, false) => {}
        }
    }
}

impl Drop for Pick {
    /// The answer started (or the attempt ended): its prefill is no longer queued.
    fn drop(&mut self) {
        if self.queued_blocks != 0 {
            self.endpoint
                .queued_blocks
                .fetch_sub(self.queued_blocks, Ordering::Relaxed);
        }
        if self.probe && !self.reported {
            self.endpoint.lock_breaker().abandon_probe();
        }
    }
}

// === impl ColdWaiter ===

impl<'a> ColdWaiter<'a> {
    fn enter(count: &'a AtomicU64) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count)
    }
}

impl Drop for ColdWaiter<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.pool.inflight.fetch_sub(1, Ordering::Relaxed);
        self.endpoint.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resilience::BreakerConfig;

    fn pool(urls: &[&str]) -> Arc<Pool> {
        let config = ResilienceConfig {
            breaker: BreakerConfig {
                consecutive_failures: 1,
                ..BreakerConfig::default()
            },
            ..ResilienceConfig::default()
        };
        let urls: Vec<String> = urls.iter().map(|u| (*u).to_owned()).collect();
        Arc::new(Pool::new(&urls, 8, &config))
    }

    #[test]
    fn picks_the_less_loaded_and_skips_tried_and_open_endpoints() {
        let pool = pool(&["http://a:1/", "http://b:2"]);
        let now = Instant::now();
        let a = pool.pick(&[], now).unwrap();
        assert_eq!(a.endpoint.base(), "http://a:1", "ties go to the first");
        let _busy = pool.enter(&a.endpoint);
        let b = pool.pick(&[], now).unwrap();
        assert_eq!(b.endpoint.base(), "http://b:2", "a has a request in flight");
        let again = pool.pick(&[Arc::clone(&b.endpoint)], now).unwrap();
        assert_eq!(again.endpoint.base(), "http://a:1", "b was tried");
        let b_endpoint = Arc::clone(&b.endpoint);
        b.failed();
        assert_eq!(b_endpoint.circuit(now), CircuitState::Open);
        assert_eq!(pool.ready_endpoints(now), 1);
        let a_endpoint = Arc::clone(&a.endpoint);
        assert!(
            pool.pick(&[Arc::clone(&a_endpoint)], now).is_none(),
            "b is open"
        );
        a.failed();
        assert!(!pool.available(now));
        assert!(pool.pick(&[], now).is_none());
    }

    #[test]
    fn scraped_queue_counts_as_load() {
        let pool = pool(&["http://a:1", "http://b:2", "http://c:3"]);
        let now = Instant::now();
        for e in pool.endpoints().iter().take(2) {
            e.set_waiting(50);
        }
        assert_eq!(pool.upstream_waiting(), 100);
        // Whichever two p2c samples, c wins whenever it is one of them.
        let picks: Vec<String> = (0..200)
            .map(|_| pool.pick(&[], now).unwrap().endpoint.base().to_owned())
            .collect();
        let c = picks.iter().filter(|b| b.as_str() == "http://c:3").count();
        assert!(c > 100, "c is idle and should win most picks, got {c}/200");
    }

    #[test]
    fn a_scrape_adds_other_clients_requests_and_goes_stale_with_this_routers_own() {
        let pool = pool(&["http://a:1", "http://b:2"]);
        let [a, b] = [0, 1].map(|i| Arc::clone(&pool.endpoints()[i]));
        let reading = |running| QueueReading {
            waiting: Some(1),
            running: Some(running),
            source: QueueSource::Known(0),
        };
        // Three requests of this router at a when it was scraped, with one other running
        // and one waiting there; b idle.
        let mine: Vec<_> = (0..3).map(|_| pool.enter(&a)).collect();
        a.set_queue(reading(4));
        b.set_queue(reading(0));
        assert_eq!((a.load(), b.load()), (5, 1));
        // This router's requests at a ended since: the scrape still shows them, the load
        // does not.
        drop(mine);
        assert_eq!(a.load(), 2);
        let _now = pool.enter(&b);
        assert_eq!(b.load(), 2);
    }

    #[test]
    fn a_prompts_uncached_blocks_stay_queued_until_its_answer_starts() {
        let pool = pool(&["http://a:1", "http://b:2"]);
        let affinity = Affinity::default();
        let now = Instant::now();
        // 20 blocks of conversation, then 100 more bytes: 22 blocks in all.
        let turn = || Placement::new((1..=20).collect()).with_prompt_bytes(20 * 64 + 100);
        let first = turn();
        let cold = pool
            .pick_placed(Some((&first, affinity)), &[], now)
            .unwrap();
        let home = Arc::clone(&cold.endpoint);
        assert_eq!(home.queued_blocks(), 22, "nothing cached yet");
        cold.succeeded(Duration::from_millis(1));
        assert_eq!(home.queued_blocks(), 0);
        // Held there, the same conversation adds only what follows the 20 blocks sent.
        let next = Placement::new((1..=21).collect()).with_prompt_bytes(21 * 64 + 100);
        let warm = pool.pick_placed(Some((&next, affinity)), &[], now).unwrap();
        assert!(Arc::ptr_eq(&warm.endpoint, &home));
        assert!(next.by_prefix());
        assert_eq!(home.queued_blocks(), 23 - 20);
        // A failed or abandoned attempt frees its blocks too.
        warm.failed();
        assert_eq!(home.queued_blocks(), 0);
        let again = pool
            .pick_placed(Some((&turn(), affinity)), &[], now)
            .unwrap();
        drop(again);
        assert!(pool.endpoints().iter().all(|e| e.queued_blocks() == 0));
    }

    #[test]
    fn set_urls_keeps_state_of_endpoints_that_stay() {
        let pool = pool(&["http://a:1", "http://b:2"]);
        let a = Arc::clone(&pool.endpoints()[0]);
        let guard = pool.enter(&a);
        pool.set_urls(&["http://c:3".into(), "http://a:1".into()]);
        let now = pool.endpoints();
        assert!(Arc::ptr_eq(&now[1], &a), "a kept its state");
        assert_eq!(now[1].inflight(), 1);
        assert_eq!(now[0].base(), "http://c:3");
        drop(guard);
        assert_eq!(a.inflight(), 0);
        assert_eq!(pool.inflight(), 0);
    }

    #[test]
    fn passed_health_checks_close_circuits_but_hide_no_request_failures() {
        let config = ResilienceConfig {
            breaker: BreakerConfig {
                consecutive_failures: 2,
                open_base: Duration::ZERO,
                ..BreakerConfig::default()
            },
            ..ResilienceConfig::default()
        };
        let pool = Arc::new(Pool::new(&["http://a:1".into()], 8, &config));
        let a = Arc::clone(&pool.endpoints()[0]);
        let now = Instant::now();
        pool.pick(&[], now).unwrap().failed();
        a.admit_check(now).unwrap().checked(true);
        pool.pick(&[], now).unwrap().failed();
        assert!(
            a.open_until().is_some(),
            "two request failures open it, whatever the check said between them"
        );
        // Open time is up: checks are the probes that close it again.
        let later = Instant::now();
        for _ in 0..2 {
            a.admit_check(later).unwrap().checked(true);
        }
        assert_eq!(a.circuit(later), CircuitState::Closed);
        // Failed checks count like failed requests.
        a.admit_check(later).unwrap().checked(false);
        a.admit_check(later).unwrap().checked(false);
        assert!(a.open_until().is_some());
    }

    #[test]
    fn learned_chars_per_token_follow_reported_usage_within_bounds() {
        let pool = pool(&["http://a:1"]);
        assert_eq!(pool.chars_per_token(4.0), None, "nothing learned yet");
        // 4000 bytes the upstream counted as 2000 tokens, plus 4 of framing.
        for _ in 0..30 {
            pool.observe_prompt(4000, 4, 2004);
        }
        let learned = pool.chars_per_token(4.0).unwrap();
        assert!((2.0..2.2).contains(&learned), "{learned}");
        // An upstream reporting absurd counts moves the figure at most fourfold.
        for _ in 0..100 {
            pool.observe_prompt(4000, 4, 1_000_000);
        }
        assert_eq!(pool.chars_per_token(4.0), Some(1.0));
        // Usage that carries nothing beyond the framing teaches nothing.
        let fresh = self::pool(&["http://b:2"]);
        fresh.observe_prompt(4000, 8, 8);
        fresh.observe_prompt(0, 0, 100);
        assert_eq!(fresh.chars_per_token(4.0), None);
    }

    #[test]
    fn endpoint_uri_joins_base_and_path() {
        let pool = pool(&["http://127.0.0.1:8000/prefix/"]);
        let uri = pool.endpoints()[0].uri("/v1/models").unwrap();
        assert_eq!(uri.to_string(), "http://127.0.0.1:8000/prefix/v1/models");
    }
}
