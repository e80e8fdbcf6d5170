//! The order of requests waiting for admission: the higher tenant priority is
//! served first, first come first served within a priority. A full queue refuses the lowest
//! priority first: a newcomer of higher priority takes the place of the waiter that arrived
//! last among the lowest priority, who is refused instead.
//!
//! A plain data structure with no clock and no I/O; the caller wakes the waiter it pops and
//! removes one whose wait timed out.
//!
//! ```
//! use quantrouter_policy::wait_queue::{Push, WaitQueue};
//!
//! let mut queue = WaitQueue::new(2);
//! queue.push(0, "batch-1");
//! queue.push(5, "interactive");
//! // Full: a higher priority displaces the newest lowest-priority waiter...
//! assert!(matches!(queue.push(5, "interactive-2"), Push::Displaced { displaced: "batch-1", .. }));
//! // ...and an equal or lower one is refused.
//! assert!(matches!(queue.push(0, "batch-2"), Push::Refused("batch-2")));
//! assert_eq!(queue.pop().map(|(_, w)| w), Some("interactive"));
//! assert_eq!(queue.pop().map(|(_, w)| w), Some("interactive-2"));
//! ```

use std::cmp::Reverse;
use std::collections::BTreeMap;

/// Waiters in admission order, at most `capacity` of them.
#[derive(Debug)]
pub struct WaitQueue<T> {
    /// Ordered lowest priority and latest arrival first: the first entry is the one a full
    /// queue refuses, the last the one served next.
    waiting: BTreeMap<Place, T>,
    arrivals: u64,
    capacity: usize,
}

/// A waiter's place in the queue; also how it leaves early.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Place {
    priority: i32,
    arrival: Reverse<u64>,
}

/// What happened to a newcomer.
#[derive(Debug, PartialEq, Eq)]
pub enum Push<T> {
    /// It waits at this place.
    Queued(Place),
    /// It waits at `place`; the queue was full and `displaced` lost its place.
    Displaced { place: Place, displaced: T },
    /// The queue is full of waiters of its priority or higher.
    Refused(T),
}

// === impl WaitQueue ===

impl<T> WaitQueue<T> {
    /// An empty queue that holds at most `capacity` waiters.
    pub fn new(capacity: usize) -> Self {
        Self {
            waiting: BTreeMap::new(),
            arrivals: 0,
            capacity,
        }
    }

    /// Waiters in the queue.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Queues `waiter` at `priority`, displacing a lower-priority waiter when full.
    pub fn push(&mut self, priority: i32, waiter: T) -> Push<T> {
        let place = Place {
            priority,
            arrival: Reverse(self.arrivals),
        };
        if self.waiting.len() < self.capacity {
            self.arrivals += 1;
            self.waiting.insert(place, waiter);
            return Push::Queued(place);
        }
        let lowest = self.waiting.first_key_value().map(|(p, _)| p.priority);
        match lowest {
            Some(lowest) if lowest < priority => {
                let Some((_, displaced)) = self.waiting.pop_first() else {
                    return Push::Refused(waiter);
                };
                self.arrivals += 1;
                self.waiting.insert(place, waiter);
                Push::Displaced { place, displaced }
            }
            _ => Push::Refused(waiter),
        }
    }

    /// The waiter to serve next: the highest priority, the earliest arrival within it.
    pub fn pop(&mut self) -> Option<(Place, T)> {
        self.waiting.pop_last()
    }

    /// Takes a waiter out before its turn (it stopped waiting).
    pub fn remove(&mut self, place: Place) -> Option<T> {
        self.waiting.remove(&place)
    }
}

// === impl Place ===

impl Place {
    /// The priority the waiter queued with.
    pub fn priority(&self) -> i32 {
        self.priority
    }
}
