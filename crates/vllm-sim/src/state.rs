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

use crate::api::Endpoint;
use crate::config::SimConfig;
use crate::faults::FaultState;
use crate::generate::SplitMix64;
use crate::metrics::Metrics;

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
        let paced = !config.ttft.is_zero() || !config.itl.is_zero();
        Self {
            admission: Arc::new(Semaphore::new(max_num_seqs)),
            max_num_seqs,
            paced,
            ids: AtomicU64::new(0),
            id_salt: RandomState::new().build_hasher().finish(),
            responses: Mutex::new(HashMap::new()),
            metrics: Metrics::new(),
            faults: FaultState::default(),
            config,
        }
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
