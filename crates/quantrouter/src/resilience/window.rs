//! Counts over a sliding window of whole seconds, for the breaker's failure rate and the
//! retry budget. Pure: the caller passes the time.

use std::time::Duration;

use tokio::time::Instant;

/// Per-second buckets of (total, marked) events over the last `len` seconds.
#[derive(Debug, Clone)]
pub struct Window {
    origin: Instant,
    buckets: Vec<Bucket>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    /// Which second since `origin` this bucket holds.
    second: u64,
    total: u32,
    marked: u32,
}

/// Sums over the window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub total: u32,
    pub marked: u32,
}

// === impl Window ===

impl Window {
    /// A window of `span` rounded up to whole seconds (at least one).
    pub fn new(span: Duration, now: Instant) -> Self {
        let len = span.as_secs().max(1) + u64::from(span.subsec_nanos() > 0);
        Self {
            origin: now,
            buckets: vec![Bucket::default(); len as usize],
        }
    }

    /// Counts one event, `marked` (a failure, a retry) or not.
    pub fn record(&mut self, now: Instant, marked: bool) {
        let bucket = self.bucket(now);
        bucket.total = bucket.total.saturating_add(1);
        bucket.marked = bucket.marked.saturating_add(u32::from(marked));
    }

    /// Totals of the buckets still inside the window.
    pub fn counts(&self, now: Instant) -> Counts {
        let current = self.second(now);
        let len = self.buckets.len() as u64;
        self.buckets
            .iter()
            .filter(|b| b.second + len > current && b.second <= current)
            .fold(Counts::default(), |acc, b| Counts {
                total: acc.total.saturating_add(b.total),
                marked: acc.marked.saturating_add(b.marked),
            })
    }

    /// Forgets everything (a breaker that closes starts afresh).
    pub fn clear(&mut self) {
        self.buckets.fill(Bucket::default());
    }

    fn second(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.origin).as_secs()
    }

    fn bucket(&mut self, now: Instant) -> &mut Bucket {
        let second = self.second(now);
        let len = self.buckets.len();
        let slot = &mut self.buckets[(second % len as u64) as usize];
        if slot.second != second {
            *slot = Bucket {
                second,
                ..Bucket::default()
            };
        }
        slot
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_age_out_of_the_window() {
        let t0 = Instant::now();
        let mut w = Window::new(Duration::from_secs(3), t0);
        w.record(t0, true);
        w.record(t0 + Duration::from_millis(1500), false);
        assert_eq!(
            w.counts(t0 + Duration::from_secs(2)),
            Counts {
                total: 2,
                marked: 1
            }
        );
        // Second 0 has left a 3-second window at second 3; second 1 is still in.
        assert_eq!(
            w.counts(t0 + Duration::from_secs(3)),
            Counts {
                total: 1,
                marked: 0
            }
        );
        assert_eq!(w.counts(t0 + Duration::from_secs(10)), Counts::default());
        // A reused slot starts from zero.
        w.record(t0 + Duration::from_secs(6), true);
        assert_eq!(
            w.counts(t0 + Duration::from_secs(6)),
            Counts {
                total: 1,
                marked: 1
            }
        );
    }
}
