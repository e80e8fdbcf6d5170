//! Faults injected at run time through `POST /sim/faults`, and the per-request decision of
//! which of them apply.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use http::StatusCode;
use serde::{Deserialize, Serialize};

use crate::tier_eval::TaskClass;

/// The fault set in force. Every field is optional in JSON; a `POST /sim/faults` replaces the
/// whole set, so absent fields fall back to "no fault".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Share (0.0..=1.0) of completion requests answered with `error_status`. The choice is a
    /// deterministic counter, so 1.0 always fails and 0.5 fails every second request.
    pub error_rate: f64,
    /// Status of injected errors; 503 by default because that is what an overloaded or
    /// restarting vLLM answers.
    pub error_status: u16,
    /// `Retry-After` header (seconds) sent with injected errors.
    pub retry_after_s: Option<u64>,
    /// Extra delay before the response headers.
    pub delay_ms: u64,
    /// Accept requests and never answer them (until the client goes away).
    pub hang: bool,
    /// Streams: abort the connection after this many data events. Non-streamed requests:
    /// abort the connection before sending a response.
    pub reset_after_chunks: Option<u64>,
    /// Streams: how one breaks after `reset_after_chunks` data events instead of the reset
    /// (non-streamed requests are still aborted).
    pub stream_break: StreamBreak,
    /// Answer with one word repeated, as a broken quantized model might.
    pub degenerate: bool,
    /// Share (0.0..=1.0) of prompts answered wrongly, per task class (`general`, `code`,
    /// `math`, `structured`, `reasoning`). Whether a prompt is answered wrongly is a fixed
    /// draw per seed and prompt. A shipped eval-set prompt has its item's class and gets a
    /// wrong answer its check rejects; any other prompt is `general` and gets other words.
    pub wrong_rate: BTreeMap<String, f64>,
    /// Wrong answers that depend on what the prompt says, not on a draw. With it set, a
    /// prompt outside the eval set that holds numbers is a word problem: its right answer is
    /// the sum of the numbers of its last user message ("The answer is 42."), the same on
    /// every simulator; a wrong one is off by 1 to 9. `{}` is never wrong: a reference tier.
    /// A difficulty rating the router asks for (`policy.second_opinion`) follows the rule.
    pub wrong_when: Option<WrongWhen>,
}

/// How a stream breaks after `reset_after_chunks` data events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamBreak {
    /// The connection is aborted, as when the server process dies.
    #[default]
    Reset,
    /// The body ends well-framed, without a finish event or `[DONE]`.
    End,
    /// Nothing more is sent; the connection stays open until the client leaves.
    Stall,
    /// vLLM's mid-stream error event (`data: {"error": {...}}`), then `[DONE]`.
    ErrorEvent,
}

/// `wrong_when`: the conditions under which a word problem, or a request without numbers,
/// is answered wrongly.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WrongWhen {
    /// Wrong when the last user message holds more than this many numbers.
    pub quantities_over: Option<u32>,
    /// Wrong when the last user message holds no numbers and lists more than this many
    /// items (lines starting `- ` or `* `): an open-ended request with many requirements.
    pub items_over: Option<u32>,
}

/// Why a fault set was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FaultsError {
    /// `error_rate` outside 0.0..=1.0 or not a number.
    #[error("error_rate must be within 0.0..=1.0, got {0}")]
    ErrorRate(f64),
    /// `error_status` is not an HTTP error status.
    #[error("error_status must be an HTTP error status (400..=599), got {0}")]
    ErrorStatus(u16),
    /// A `wrong_rate` outside 0.0..=1.0.
    #[error("wrong_rate.{class} must be within 0.0..=1.0, got {rate}")]
    WrongRate { class: String, rate: f64 },
    /// A `wrong_rate` key that is not a task class.
    #[error("wrong_rate: unknown task class `{0}` (general, code, math, structured, reasoning)")]
    UnknownClass(String),
}

/// Wrong-answer rates indexed by [`TaskClass`], ready for the per-request decision.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct WrongRates([f64; TaskClass::ALL.len()]);

/// What the faults in force do to one request.
#[derive(Debug, Clone, Default)]
pub(crate) struct FaultPlan {
    pub(crate) delay: Duration,
    pub(crate) hang: bool,
    pub(crate) error: Option<InjectedError>,
    pub(crate) reset_after_chunks: Option<u64>,
    pub(crate) stream_break: StreamBreak,
    pub(crate) degenerate: bool,
    pub(crate) wrong_rate: WrongRates,
    pub(crate) wrong_when: Option<WrongWhen>,
}

/// An error response chosen by `error_rate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct InjectedError {
    pub(crate) status: StatusCode,
    pub(crate) retry_after_s: Option<u64>,
}

/// The fault set shared by all connections. A flag keeps the common no-fault case free of
/// locking, since the zero-latency simulator is used to measure the router's overhead.
#[derive(Debug, Default)]
pub(crate) struct FaultState {
    active: AtomicBool,
    current: RwLock<Option<Arc<ActiveFaults>>>,
}

#[derive(Debug)]
struct ActiveFaults {
    faults: Faults,
    status: StatusCode,
    wrong_rate: WrongRates,
    /// Requests that went through the `error_rate` decision since this set was installed.
    seen: AtomicU64,
}

// === impl Faults ===

impl Default for Faults {
    fn default() -> Self {
        Self {
            error_rate: 0.0,
            error_status: StatusCode::SERVICE_UNAVAILABLE.as_u16(),
            retry_after_s: None,
            delay_ms: 0,
            hang: false,
            reset_after_chunks: None,
            stream_break: StreamBreak::Reset,
            degenerate: false,
            wrong_rate: BTreeMap::new(),
            wrong_when: None,
        }
    }
}

impl Faults {
    /// Checks the ranges serde cannot express.
    pub fn validate(&self) -> Result<(), FaultsError> {
        if !(0.0..=1.0).contains(&self.error_rate) {
            return Err(FaultsError::ErrorRate(self.error_rate));
        }
        if !(400..=599).contains(&self.error_status) {
            return Err(FaultsError::ErrorStatus(self.error_status));
        }
        for (class, &rate) in &self.wrong_rate {
            if TaskClass::from_name(class).is_none() {
                return Err(FaultsError::UnknownClass(class.clone()));
            }
            if !(0.0..=1.0).contains(&rate) {
                return Err(FaultsError::WrongRate {
                    class: class.clone(),
                    rate,
                });
            }
        }
        Ok(())
    }

    fn is_noop(&self) -> bool {
        self.error_rate <= 0.0
            && self.delay_ms == 0
            && !self.hang
            && self.reset_after_chunks.is_none()
            && !self.degenerate
            && self.wrong_rate.values().all(|&rate| rate <= 0.0)
            && self.wrong_when.is_none()
    }
}

// === impl WrongWhen ===

impl WrongWhen {
    /// Whether the rule makes the answer to a message holding `quantities` numbers wrong.
    pub(crate) fn wrong(&self, quantities: usize) -> bool {
        self.quantities_over
            .is_some_and(|limit| quantities > limit as usize)
    }

    /// Whether the rule makes the answer to a message without numbers that lists `items`
    /// items wrong.
    pub(crate) fn wrong_items(&self, items: usize) -> bool {
        self.items_over.is_some_and(|limit| items > limit as usize)
    }
}

// === impl WrongRates ===

impl WrongRates {
    /// Known classes only, each clamped to 0.0..=1.0 (NaN counts as 0).
    fn from_map(rates: &BTreeMap<String, f64>) -> Self {
        let mut out = Self::default();
        for (name, &rate) in rates {
            if let Some(class) = TaskClass::from_name(name) {
                out.0[class as usize] = if rate.is_nan() {
                    0.0
                } else {
                    rate.clamp(0.0, 1.0)
                };
            }
        }
        out
    }

    pub(crate) fn of(&self, class: TaskClass) -> f64 {
        self.0[class as usize]
    }

    fn is_zero(&self) -> bool {
        self.0.iter().all(|&rate| rate <= 0.0)
    }
}

// === impl FaultPlan ===

impl FaultPlan {
    pub(crate) fn is_noop(&self) -> bool {
        !self.acts() && self.wrong_rate.is_zero() && self.wrong_when.is_none()
    }

    /// Whether a fault other than wrong answers applies to this request.
    pub(crate) fn acts(&self) -> bool {
        !self.delay.is_zero()
            || self.hang
            || self.error.is_some()
            || self.reset_after_chunks.is_some()
            || self.degenerate
    }
}

// === impl FaultState ===

impl FaultState {
    /// Installs a fault set. Values out of range are clamped (the HTTP endpoint validates
    /// before calling this; library callers get the nearest sensible fault instead of a panic).
    pub(crate) fn set(&self, mut faults: Faults) {
        faults.error_rate = if faults.error_rate.is_nan() {
            0.0
        } else {
            faults.error_rate.clamp(0.0, 1.0)
        };
        let status = match StatusCode::from_u16(faults.error_status) {
            Ok(status) if status.is_client_error() || status.is_server_error() => status,
            _ => StatusCode::SERVICE_UNAVAILABLE,
        };
        faults.error_status = status.as_u16();
        let noop = faults.is_noop();
        let next = Arc::new(ActiveFaults {
            wrong_rate: WrongRates::from_map(&faults.wrong_rate),
            faults,
            status,
            seen: AtomicU64::new(0),
        });
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        *current = Some(next);
        self.active.store(!noop, Ordering::Release);
    }

    pub(crate) fn clear(&self) {
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        *current = None;
        self.active.store(false, Ordering::Release);
    }

    /// The fault set in force, as last set (defaults when none).
    pub(crate) fn snapshot(&self) -> Faults {
        let current = self.current.read().unwrap_or_else(|e| e.into_inner());
        current
            .as_ref()
            .map(|active| active.faults.clone())
            .unwrap_or_default()
    }

    /// Decides what the faults do to the next completion request; `None` when nothing applies.
    pub(crate) fn plan(&self) -> Option<FaultPlan> {
        if !self.active.load(Ordering::Acquire) {
            return None;
        }
        let active = {
            let current = self.current.read().unwrap_or_else(|e| e.into_inner());
            current.clone()?
        };
        let faults = &active.faults;
        let error = (faults.error_rate > 0.0)
            .then(|| active.seen.fetch_add(1, Ordering::Relaxed))
            .filter(|&n| nth_request_fails(n, faults.error_rate))
            .map(|_| InjectedError {
                status: active.status,
                retry_after_s: faults.retry_after_s,
            });
        let plan = FaultPlan {
            delay: Duration::from_millis(faults.delay_ms),
            hang: faults.hang,
            error,
            reset_after_chunks: faults.reset_after_chunks,
            stream_break: faults.stream_break,
            degenerate: faults.degenerate,
            wrong_rate: active.wrong_rate,
            wrong_when: faults.wrong_when,
        };
        (!plan.is_noop()).then_some(plan)
    }
}

/// Whether the `n`th request (from 0) fails at `rate`: it does when the running count of
/// failures owed, `floor((n + 1) * rate)`, steps up. Deterministic, and over any window of
/// requests the share of failures is within one request of `rate`.
fn nth_request_fails(n: u64, rate: f64) -> bool {
    let owed_after = ((n + 1) as f64 * rate).floor();
    let owed_before = (n as f64 * rate).floor();
    owed_after > owed_before
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_one_always_fails_and_zero_never() {
        assert!((0..100).all(|n| nth_request_fails(n, 1.0)));
        assert!((0..100).all(|n| !nth_request_fails(n, 0.0)));
    }

    #[test]
    fn fractional_rates_fail_their_share() {
        for rate in [0.1, 0.25, 0.5, 0.9] {
            let failed = (0..1000).filter(|&n| nth_request_fails(n, rate)).count();
            assert_eq!(failed, (1000.0 * rate) as usize, "rate {rate}");
        }
    }

    #[test]
    fn validate_rejects_out_of_range_values() {
        let bad_rate = Faults {
            error_rate: 1.5,
            ..Faults::default()
        };
        assert_eq!(bad_rate.validate(), Err(FaultsError::ErrorRate(1.5)));
        let bad_status = Faults {
            error_status: 200,
            ..Faults::default()
        };
        assert_eq!(bad_status.validate(), Err(FaultsError::ErrorStatus(200)));
        assert_eq!(Faults::default().validate(), Ok(()));
        let faults: Faults = serde_json::from_str(r#"{"wrong_rate": {"math": 1.2}}"#).unwrap();
        assert_eq!(
            faults.validate(),
            Err(FaultsError::WrongRate {
                class: "math".into(),
                rate: 1.2
            })
        );
        let faults: Faults = serde_json::from_str(r#"{"wrong_rate": {"maths": 0.2}}"#).unwrap();
        assert_eq!(
            faults.validate(),
            Err(FaultsError::UnknownClass("maths".into()))
        );
    }

    #[test]
    fn wrong_rates_alone_make_a_plan_that_acts_on_nothing_else() {
        let state = FaultState::default();
        let faults: Faults =
            serde_json::from_str(r#"{"wrong_rate": {"math": 0.2, "code": 0.0}}"#).unwrap();
        state.set(faults);
        let plan = state.plan().unwrap();
        assert!(!plan.acts());
        assert_eq!(plan.wrong_rate.of(TaskClass::Math), 0.2);
        assert_eq!(plan.wrong_rate.of(TaskClass::General), 0.0);
        state.set(serde_json::from_str(r#"{"wrong_rate": {"math": 0.0}}"#).unwrap());
        assert!(state.plan().is_none());
    }

    #[test]
    fn wrong_when_alone_makes_a_plan_and_reads_the_count() {
        let state = FaultState::default();
        state.set(serde_json::from_str(r#"{"wrong_when": {"quantities_over": 4}}"#).unwrap());
        let rule = state.plan().and_then(|p| p.wrong_when).unwrap();
        assert!(!rule.wrong(4));
        assert!(rule.wrong(5));
        state.set(serde_json::from_str(r#"{"wrong_when": {}}"#).unwrap());
        let never = state.plan().and_then(|p| p.wrong_when).unwrap();
        assert!(!never.wrong(100));
        assert!(serde_json::from_str::<Faults>(r#"{"wrong_when": {"numbers": 3}}"#).is_err());
    }

    #[test]
    fn absent_json_fields_mean_no_fault() {
        let faults: Faults = serde_json::from_str(r#"{"delay_ms": 5}"#).unwrap();
        assert_eq!(faults.error_status, 503);
        assert_eq!(faults.error_rate, 0.0);
        assert!(serde_json::from_str::<Faults>(r#"{"hnag": true}"#).is_err());
    }

    #[test]
    fn plan_is_none_without_faults_and_after_clear() {
        let state = FaultState::default();
        assert!(state.plan().is_none());
        state.set(Faults {
            degenerate: true,
            ..Faults::default()
        });
        assert!(state.plan().is_some_and(|p| p.degenerate));
        state.clear();
        assert!(state.plan().is_none());
    }

    #[test]
    fn set_clamps_library_input() {
        let state = FaultState::default();
        state.set(Faults {
            error_rate: 7.0,
            error_status: 42,
            ..Faults::default()
        });
        let error = state.plan().and_then(|p| p.error);
        assert_eq!(
            error.map(|e| e.status),
            Some(StatusCode::SERVICE_UNAVAILABLE)
        );
    }
}
