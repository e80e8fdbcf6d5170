//! State shared by every connection of one simulator, and the guards that keep its gauges and
//! counters honest when a request future is dropped half-way.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::sync::Mutex;

use bytes::Bytes;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::api::{CompletionRequest, Endpoint};
use crate::config::SimConfig;
use crate::faults::FaultState;
use crate::generate::SplitMix64;
use crate::metrics::Metrics;
use crate::prefix_cache::PrefixCache;

/// One simulator's configuration, counters, faults and admission queue.
#[derive(Debug)]
pub(crate) struct SimState {
    pub(crate) config: SimConfig,
    pub(crate) metrics: Metrics,
    pub(crate) faults: FaultState,
    /// Permits for running requests; `max_num_seqs` of them.
    admission: Arc<Semaphore>,
    max_num_seqs: usize,
    /// Whether any latency is configured; when not, no timer is ever touched.
    paced: bool,
    ids: AtomicU64,
    /// Random per instance so several simulators in one process hand out distinct ids.
    id_salt: u64,
    /// Responses API answers by id, for `previous_response_id` and `GET /v1/responses/{id}`.
    responses: Mutex<HashMap<String, Bytes>>,
    /// The body of the last completion request, for `GET /sim/last-request`.
    last_request: Mutex<Option<Bytes>>,
    /// The prefix cache, when `prefix_cache_blocks` is set.
    prefix_cache: Option<PrefixCache>,
    /// When the prefill compute stream is free: prefills run one after another, as they
    /// share the GPU, so a server that takes many cold prompts at once answers all of them
    /// later.
    prefill_free_at: std::sync::Mutex<Option<Instant>>,
}

/// A request's prefill: the blocks it brings to the cache, when its first token can leave,
/// and the KV blocks it holds until it ends.
#[derive(Debug)]
pub(crate) struct Prefill {
    blocks: Vec<u64>,
    /// Prefill done; the time to first token counts from here.
    pub(crate) done_at: Instant,
    _kv: Option<KvBlocks>,
}

/// KV blocks a running request holds, counted in the cache usage gauge until dropped.
#[derive(Debug)]
struct KvBlocks {
    state: Arc<SimState>,
    blocks: usize,
}

/// Stored responses kept at most: plenty for tests and demos, bounded for load tests.
const MAX_STORED_RESPONSES: usize = 10_000;

/// Counts a request as cancelled unless it is disarmed: dropping it armed means the future or
/// stream holding it was dropped because the client went away.
#[derive(Debug)]
pub(crate) struct CancelGuard {
    state: Arc<SimState>,
    armed: bool,
}

/// A running request: holds its admission permit and the running gauge.
#[derive(Debug)]
pub(crate) struct Admitted {
    _permit: OwnedSemaphorePermit,
    _running: GaugeGuard,
}

/// Increments a gauge and decrements it on drop.
#[derive(Debug)]
struct GaugeGuard {
    state: Arc<SimState>,
    gauge: Gauge,
}

#[derive(Debug, Clone, Copy)]
enum Gauge {
    Running,
    Waiting,
}

/// The admission semaphore was closed; it never is while the state lives.
#[derive(Debug, thiserror::Error)]
#[error("admission queue closed")]
pub(crate) struct AdmissionClosed;

// === impl SimState ===

impl SimState {
    pub(crate) fn new(config: SimConfig) -> Self {
        // Zero permits would queue every request forever; the semaphore caps permits too.
        let max_num_seqs = config.max_num_seqs.clamp(1, Semaphore::MAX_PERMITS);
        let paced =
            !config.ttft.is_zero() || !config.itl.is_zero() || !config.prefill_per_token.is_zero();
        let prefix_cache = PrefixCache::new(config.prefix_cache_blocks, config.block_size);
        let metrics = Metrics::new();
        metrics.kv_capacity_blocks.store(
            prefix_cache.as_ref().map_or(0, PrefixCache::capacity),
            Ordering::Relaxed,
        );
        Self {
            admission: Arc::new(Semaphore::new(max_num_seqs)),
            max_num_seqs,
            paced,
            ids: AtomicU64::new(0),
            id_salt: RandomState::new().build_hasher().finish(),
            responses: Mutex::new(HashMap::new()),
            last_request: Mutex::new(None),
            metrics,
            faults: FaultState::default(),
            prefix_cache,
            prefill_free_at: std::sync::Mutex::new(None),
            config,
        }
    }

    /// Keeps the body of a completion request as the last one seen.
    pub(crate) fn record_request(&self, body: &Bytes) {
        if let Ok(mut last) = self.last_request.lock() {
            *last = Some(body.clone());
        }
    }

    /// The body of the last completion request.
    pub(crate) fn last_request(&self) -> Option<Bytes> {
        self.last_request.lock().ok()?.clone()
    }

    /// Keeps a Responses answer; the oldest are not tracked, so a full store starts over.
    pub(crate) fn store_response(&self, id: &str, body: Bytes) {
        if let Ok(mut stored) = self.responses.lock() {
            if stored.len() >= MAX_STORED_RESPONSES {
                stored.clear();
            }
            stored.insert(id.to_owned(), body);
        }
    }

    /// A stored Responses answer.
    pub(crate) fn stored_response(&self, id: &str) -> Option<Bytes> {
        self.responses.lock().ok()?.get(id).cloned()
    }

    pub(crate) fn has_response(&self, id: &str) -> bool {
        self.stored_response(id).is_some()
    }

    /// Forgets a stored answer; whether there was one.
    pub(crate) fn delete_response(&self, id: &str) -> bool {
        self.responses
            .lock()
            .is_ok_and(|mut stored| stored.remove(id).is_some())
    }

    /// Starts an admitted request's prefill at `now`: looks its prompt (under its
    /// `cache_salt`) up in the prefix cache and books the compute stream for the tokens not found there.
    pub(crate) fn start_prefill(
        self: &Arc<Self>,
        request: &CompletionRequest,
        prompt_tokens: u64,
        output_tokens: u64,
        now: Instant,
    ) -> Prefill {
        let (blocks, cached_tokens, kv) = match &self.prefix_cache {
            Some(cache) => {
                let salt = request.cache_salt.as_deref();
                let blocks = cache.block_hashes(salt, &request.cache_text);
                let block_size = cache.block_size() as u64;
                let hit = cache.lookup(&blocks) as u64 * block_size;
                // vLLM recomputes at least the last prompt token to get its logits.
                let cached = hit.min(prompt_tokens.saturating_sub(1));
                let metrics = &self.metrics;
                metrics
                    .prefix_cache_queries
                    .fetch_add(prompt_tokens, Ordering::Relaxed);
                metrics
                    .prefix_cache_hits
                    .fetch_add(cached, Ordering::Relaxed);
                let held = (prompt_tokens + output_tokens).div_ceil(block_size);
                let kv = KvBlocks::new(self, usize::try_from(held).unwrap_or(usize::MAX));
                (blocks, cached, Some(kv))
            }
            None => (Vec::new(), 0, None),
        };
        let compute = self
            .config
            .prefill_per_token
            .saturating_mul(u32::try_from(prompt_tokens - cached_tokens).unwrap_or(u32::MAX));
        let done_at = match compute.is_zero() {
            true => now,
            false => {
                let mut free_at = self
                    .prefill_free_at
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                let start = free_at.map_or(now, |t| t.max(now));
                let done = start + compute;
                *free_at = Some(done);
                done
            }
        };
        Prefill {
            blocks,
            done_at,
            _kv: kv,
        }
    }

    /// The prefill ran: its blocks are in the cache for the requests after it.
    pub(crate) fn finish_prefill(&self, prefill: &Prefill) {
        if let Some(cache) = &self.prefix_cache {
            cache.insert(&prefill.blocks);
        }
    }

    pub(crate) fn max_num_seqs(&self) -> usize {
        self.max_num_seqs
    }

    pub(crate) fn paced(&self) -> bool {
        self.paced
    }

    /// A fresh response id in vLLM's form: prefix, dash, 32 hex digits.
    pub(crate) fn next_id(&self, endpoint: Endpoint) -> String {
        let n = self.ids.fetch_add(1, Ordering::Relaxed);
        let mut rng = SplitMix64::new(n ^ self.id_salt);
        format!(
            "{}-{:016x}{:016x}",
            endpoint.id_prefix(),
            rng.next_u64(),
            rng.next_u64()
        )
    }

    /// Waits for a free sequence slot, counted as waiting meanwhile.
    pub(crate) async fn admit(self: &Arc<Self>) -> Result<Admitted, AdmissionClosed> {
        let permit = match self.admission.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                let _waiting = GaugeGuard::new(self, Gauge::Waiting);
                self.admission
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| AdmissionClosed)?
            }
        };
        Ok(Admitted {
            _permit: permit,
            _running: GaugeGuard::new(self, Gauge::Running),
        })
    }
}

/// Seconds since the Unix epoch, for the `created` fields.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

// === impl CancelGuard ===

impl CancelGuard {
    pub(crate) fn new(state: &Arc<SimState>) -> Self {
        Self {
            state: state.clone(),
            armed: true,
        }
    }

    /// The request reached an end the server chose (answer, error or injected reset).
    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            self.state.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            tracing::debug!("client went away before the response completed");
        }
    }
}

// === impl KvBlocks ===

impl KvBlocks {
    fn new(state: &Arc<SimState>, blocks: usize) -> Self {
        state.metrics.kv_blocks.fetch_add(blocks, Ordering::Relaxed);
        Self {
            state: state.clone(),
            blocks,
        }
    }
}

impl Drop for KvBlocks {
    fn drop(&mut self) {
        self.state
            .metrics
            .kv_blocks
            .fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

// === impl GaugeGuard ===

impl GaugeGuard {
    fn new(state: &Arc<SimState>, gauge: Gauge) -> Self {
        state.gauge(gauge).fetch_add(1, Ordering::Relaxed);
        Self {
            state: state.clone(),
            gauge,
        }
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.state.gauge(self.gauge).fetch_sub(1, Ordering::Relaxed);
    }
}

impl SimState {
    fn gauge(&self, gauge: Gauge) -> &AtomicUsize {
        match gauge {
            Gauge::Running => &self.metrics.running,
            Gauge::Waiting => &self.metrics.waiting,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn cached_state() -> Arc<SimState> {
        Arc::new(SimState::new(SimConfig {
            prefix_cache_blocks: 64,
            block_size: 16,
            prefill_per_token: Duration::from_micros(100),
            ..SimConfig::default()
        }))
    }

    /// A prompt of `tokens` simulated tokens (four bytes each).
    fn text(tokens: usize) -> String {
        "abcd".repeat(tokens)
    }

    /// A completion request for `text`, whose prefix cache text it is.
    fn request(text: &str) -> CompletionRequest {
        let body = serde_json::json!({"model": "m", "prompt": text}).to_string();
        CompletionRequest::parse(Endpoint::Completion, body.as_bytes()).unwrap()
    }

    #[test]
    fn prefill_time_counts_only_uncached_tokens() {
        let state = cached_state();
        let now = Instant::now();
        let prompt = text(160);
        let cold = state.start_prefill(&request(&prompt), 160, 8, now);
        assert_eq!(cold.done_at - now, Duration::from_micros(100 * 160));
        state.finish_prefill(&cold);
        // The next turn repeats the ten cached blocks and adds 40 tokens.
        let later = cold.done_at;
        let next = format!("{prompt}{}", "wxyz".repeat(40));
        let warm = state.start_prefill(&request(&next), 200, 8, later);
        assert_eq!(warm.done_at - later, Duration::from_micros(100 * 40));
        let metrics = &state.metrics;
        assert_eq!(metrics.prefix_cache_queries.load(Ordering::Relaxed), 360);
        assert_eq!(metrics.prefix_cache_hits.load(Ordering::Relaxed), 160);
    }

    #[test]
    fn a_fully_cached_prompt_still_computes_its_last_token() {
        let state = cached_state();
        let now = Instant::now();
        let first = state.start_prefill(&request(&text(32)), 32, 1, now);
        state.finish_prefill(&first);
        let again = state.start_prefill(&request(&text(32)), 32, 1, first.done_at);
        assert_eq!(again.done_at - first.done_at, Duration::from_micros(100));
    }

    #[test]
    fn cold_prefills_queue_on_one_compute_stream() {
        let state = cached_state();
        let now = Instant::now();
        let a = state.start_prefill(&request(&text(100)), 100, 1, now);
        let b = state.start_prefill(&request(&"efgh".repeat(100)), 100, 1, now);
        assert_eq!(a.done_at - now, Duration::from_millis(10));
        assert_eq!(b.done_at - now, Duration::from_millis(20));
    }

    #[test]
    fn running_requests_hold_kv_blocks_until_they_end() {
        let state = cached_state();
        let prefill = state.start_prefill(&request(&text(40)), 40, 8, Instant::now());
        // 48 tokens in blocks of 16.
        assert_eq!(state.metrics.kv_blocks.load(Ordering::Relaxed), 3);
        drop(prefill);
        assert_eq!(state.metrics.kv_blocks.load(Ordering::Relaxed), 0);
    }
}
