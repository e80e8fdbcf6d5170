//! Admission per profile: at most `max_concurrency` requests in flight, a bounded queue for
//! the rest, and a queue timeout, after which the client gets 429 with `Retry-After`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Queue settings, shared by every profile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdmissionConfig {
    /// Waiting requests allowed per slot of `max_concurrency`: one full batch may wait, so a
    /// burst is smoothed while a sustained overload is refused early.
    pub queue_per_slot: f64,
    /// Longest wait for a slot: past this the client is better off retrying (and KEDA has
    /// seen the queue).
    pub queue_timeout: Duration,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            queue_per_slot: 1.0,
            queue_timeout: Duration::from_secs(2),
        }
    }
}

/// Slots and queue of one profile.
#[derive(Debug)]
pub struct Admission {
    slots: Arc<Semaphore>,
    queue_cap: u64,
    waiting: AtomicU64,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Overloaded {
    #[error("the queue is full")]
    QueueFull,
    #[error("no slot freed up within the queue timeout")]
    Timeout,
}

impl Admission {
    pub fn new(max_concurrency: u32, config: &AdmissionConfig) -> Self {
        let slots = max_concurrency.max(1) as usize;
        Self {
            slots: Arc::new(Semaphore::new(slots)),
            queue_cap: (slots as f64 * config.queue_per_slot).ceil() as u64,
            waiting: AtomicU64::new(0),
        }
    }

    /// Requests waiting for a slot (part of the tier's queue depth).
    pub fn waiting(&self) -> u64 {
        self.waiting.load(Ordering::Relaxed)
    }

    /// A slot now, or after waiting in the queue at most `timeout`. The permit is held until
    /// the response body ends.
    pub async fn admit(&self, timeout: Duration) -> Result<OwnedSemaphorePermit, Overloaded> {
        if let Ok(permit) = Arc::clone(&self.slots).try_acquire_owned() {
            return Ok(permit);
        }
        // Take a place only if one is free: adding first and taking it back on refusal
        // would show the queue over its cap for a moment (to `waiting`, the metrics, KEDA).
        let cap = self.queue_cap;
        let joined = self
            .waiting
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < cap).then_some(n + 1)
            });
        if joined.is_err() {
            return Err(Overloaded::QueueFull);
        }
        let waited = tokio::time::timeout(timeout, Arc::clone(&self.slots).acquire_owned()).await;
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        match waited {
            Ok(Ok(permit)) => Ok(permit),
            // The semaphore is never closed; treat it like a timeout if it ever is.
            Ok(Err(_)) | Err(_) => Err(Overloaded::Timeout),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn excess_waits_then_times_out_and_a_full_queue_refuses_at_once() {
        let config = AdmissionConfig {
            queue_per_slot: 1.0,
            queue_timeout: Duration::from_secs(1),
        };
        let admission = Arc::new(Admission::new(1, &config));
        let held = admission.admit(config.queue_timeout).await.unwrap();
        let waiter = {
            let admission = Arc::clone(&admission);
            tokio::spawn(async move { admission.admit(Duration::from_secs(1)).await })
        };
        tokio::task::yield_now().await;
        assert_eq!(admission.waiting(), 1);
        assert_eq!(
            admission.admit(Duration::from_secs(1)).await.unwrap_err(),
            Overloaded::QueueFull
        );
        assert_eq!(waiter.await.unwrap().unwrap_err(), Overloaded::Timeout);
        assert_eq!(admission.waiting(), 0);
        // A freed slot goes to the next waiter.
        let waiter = {
            let admission = Arc::clone(&admission);
            tokio::spawn(async move { admission.admit(Duration::from_secs(1)).await })
        };
        tokio::task::yield_now().await;
        drop(held);
        assert!(waiter.await.unwrap().is_ok());
    }
}
