//! Admission per profile: at most `max_concurrency` requests in flight, a bounded queue for
//! the rest, and a queue timeout, after which the client gets 429 with `Retry-After`.
//!
//! The queue is ordered by tenant priority: a freed slot goes to the highest
//! priority waiting, first come first served within a priority, and a full queue refuses
//! the lowest priority first ([`quantrouter_policy::wait_queue`] decides; this module only
//! hands slots over). Every change of slots and queue happens under one lock, so a slot is
//! never both handed to a waiter and counted free.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use quantrouter_policy::wait_queue::{Place, Push, WaitQueue};
use tokio::sync::oneshot;

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
    inner: Arc<Inner>,
}

/// A slot, held until the response body ends; dropping it hands the slot to the next
/// waiter.
#[derive(Debug)]
pub struct Permit {
    inner: Arc<Inner>,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Overloaded {
    #[error("the queue is full")]
    QueueFull,
    #[error("no slot freed up within the queue timeout")]
    Timeout,
    /// It waited, and a request of a higher priority took its place in the full queue.
    #[error("a request of a higher priority took its place in the queue")]
    Displaced,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    /// Mirrors the queue's length for readers that must not take the lock (every routing
    /// decision reads it for every profile).
    waiting: AtomicU64,
}

#[derive(Debug)]
struct State {
    free: usize,
    /// Each waiter's sender: a message is a slot; a dropped sender a lost place.
    queue: WaitQueue<oneshot::Sender<()>>,
}

/// A place in the queue; dropped before its slot arrives (timeout, client gone), it leaves
/// the queue, or gives back a slot handed to it meanwhile.
struct Waiter<'a> {
    inner: &'a Arc<Inner>,
    place: Place,
    slot: oneshot::Receiver<()>,
    settled: bool,
}

// === impl Admission ===

impl Admission {
    pub fn new(max_concurrency: u32, config: &AdmissionConfig) -> Self {
        let slots = max_concurrency.max(1) as usize;
        let queue_cap = (slots as f64 * config.queue_per_slot).ceil() as usize;
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    free: slots,
                    queue: WaitQueue::new(queue_cap),
                }),
                waiting: AtomicU64::new(0),
            }),
        }
    }

    /// Requests waiting for a slot (part of the tier's queue depth).
    pub fn waiting(&self) -> u64 {
        self.inner.waiting.load(Ordering::Relaxed)
    }

    /// A slot now, or after waiting in the queue at most `timeout`, served by `priority`
    /// (higher first). The permit is held until the response body ends.
    pub async fn admit(&self, priority: i32, timeout: Duration) -> Result<Permit, Overloaded> {
        let (tx, rx) = oneshot::channel();
        let place = {
            let mut state = self.inner.lock();
            if state.free > 0 {
                state.free -= 1;
                return Ok(self.inner.permit());
            }
            let pushed = state.queue.push(priority, tx);
            self.inner.count_waiting(&state);
            match pushed {
                Push::Queued(place) => place,
                // The displaced waiter sees its sender dropped: refused before this one.
                Push::Displaced { place, .. } => place,
                Push::Refused(_) => return Err(Overloaded::QueueFull),
            }
        };
        let mut waiter = Waiter {
            inner: &self.inner,
            place,
            slot: rx,
            settled: false,
        };
        let waited = tokio::time::timeout(timeout, &mut waiter.slot).await;
        waiter.settled = true;
        match waited {
            Ok(Ok(())) => Ok(self.inner.permit()),
            Ok(Err(_)) => Err(Overloaded::Displaced),
            Err(_) => waiter.leave(),
        }
    }
}

// === impl Inner ===

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn permit(self: &Arc<Self>) -> Permit {
        Permit {
            inner: Arc::clone(self),
        }
    }

    fn count_waiting(&self, state: &State) {
        self.waiting
            .store(state.queue.len() as u64, Ordering::Relaxed);
    }

    /// A slot came back: to the next waiter still listening, else to the free count.
    fn release(&self, state: &mut State) {
        while let Some((_, waiter)) = state.queue.pop() {
            // Sent under the lock: a waiter that checks under the lock sees it.
            if waiter.send(()).is_ok() {
                self.count_waiting(state);
                return;
            }
        }
        self.count_waiting(state);
        state.free += 1;
    }
}

// === impl Waiter ===

impl Waiter<'_> {
    /// The wait timed out: out of the queue, unless a slot (or a displacement) came in the
    /// meantime.
    fn leave(&mut self) -> Result<Permit, Overloaded> {
        let state = &mut *self.inner.lock();
        if state.queue.remove(self.place).is_some() {
            self.inner.count_waiting(state);
            return Err(Overloaded::Timeout);
        }
        match self.slot.try_recv() {
            Ok(()) => Ok(self.inner.permit()),
            Err(_) => Err(Overloaded::Displaced),
        }
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        // The request went away while waiting.
        let state = &mut *self.inner.lock();
        if state.queue.remove(self.place).is_some() {
            self.inner.count_waiting(state);
        } else if self.slot.try_recv().is_ok() {
            self.inner.release(state);
        }
    }
}

// === impl Permit ===

impl Drop for Permit {
    fn drop(&mut self) {
        let inner = &self.inner;
        inner.release(&mut inner.lock());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(timeout: Duration) -> AdmissionConfig {
        AdmissionConfig {
            queue_per_slot: 1.0,
            queue_timeout: timeout,
        }
    }

    fn wait(
        admission: &Arc<Admission>,
        priority: i32,
    ) -> tokio::task::JoinHandle<Result<Permit, Overloaded>> {
        let admission = Arc::clone(admission);
        tokio::spawn(async move { admission.admit(priority, Duration::from_secs(10)).await })
    }

    #[tokio::test(start_paused = true)]
    async fn excess_waits_then_times_out_and_a_full_queue_refuses_at_once() {
        let config = config(Duration::from_secs(1));
        let admission = Arc::new(Admission::new(1, &config));
        let held = admission.admit(0, config.queue_timeout).await.unwrap();
        let waiter = {
            let admission = Arc::clone(&admission);
            tokio::spawn(async move { admission.admit(0, Duration::from_secs(1)).await })
        };
        tokio::task::yield_now().await;
        assert_eq!(admission.waiting(), 1);
        assert_eq!(
            admission
                .admit(0, Duration::from_secs(1))
                .await
                .unwrap_err(),
            Overloaded::QueueFull
        );
        assert_eq!(waiter.await.unwrap().unwrap_err(), Overloaded::Timeout);
        assert_eq!(admission.waiting(), 0);
        // A freed slot goes to the next waiter.
        let waiter = wait(&admission, 0);
        tokio::task::yield_now().await;
        drop(held);
        assert!(waiter.await.unwrap().is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn freed_slots_go_to_the_highest_priority_first_and_in_order_within_one() {
        // One slot, room for four waiters.
        let config = AdmissionConfig {
            queue_per_slot: 4.0,
            queue_timeout: Duration::from_secs(10),
        };
        let admission = Arc::new(Admission::new(1, &config));
        let held = admission.admit(0, Duration::ZERO).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, priority) in [("low-1", 0), ("high-1", 5), ("low-2", 0), ("high-2", 5)] {
            let (admission, order) = (Arc::clone(&admission), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                let permit = admission.admit(priority, Duration::from_secs(10)).await;
                order.lock().unwrap().push(name);
                // Dropping the slot hands it to the next waiter in the queue's order.
                drop(permit);
            }));
            tokio::task::yield_now().await;
        }
        assert_eq!(admission.waiting(), 4);
        drop(held);
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(
            *order.lock().unwrap(),
            ["high-1", "high-2", "low-1", "low-2"]
        );
        assert_eq!(admission.waiting(), 0);
        assert_eq!(admission.inner.lock().free, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_refuses_the_lowest_priority_first() {
        let admission = Arc::new(Admission::new(1, &config(Duration::from_secs(10))));
        let held = admission.admit(0, Duration::ZERO).await.unwrap();
        let low = wait(&admission, 0);
        tokio::task::yield_now().await;
        // Full: an equal priority is refused, a higher one takes the low one's place.
        assert_eq!(
            admission
                .admit(0, Duration::from_secs(1))
                .await
                .unwrap_err(),
            Overloaded::QueueFull
        );
        let high = wait(&admission, 3);
        tokio::task::yield_now().await;
        assert_eq!(low.await.unwrap().unwrap_err(), Overloaded::Displaced);
        assert_eq!(admission.waiting(), 1);
        drop(held);
        assert!(high.await.unwrap().is_ok());
        assert_eq!(admission.inner.lock().free, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_goes_away_gives_its_place_and_any_slot_back() {
        let admission = Arc::new(Admission::new(1, &config(Duration::from_secs(10))));
        let held = admission.admit(0, Duration::ZERO).await.unwrap();
        let gone = wait(&admission, 0);
        tokio::task::yield_now().await;
        gone.abort();
        let _ = gone.await;
        assert_eq!(admission.waiting(), 0);
        drop(held);
        // The slot came back to the free count, not to the waiter that left.
        let again = admission.admit(0, Duration::ZERO).await;
        assert!(again.is_ok());
    }
}
