//! Session affinity's memory: which profile each recent conversation's turns went to, kept
//! per router replica (no shared store on the request path). A replica that never saw a
//! conversation routes its turn on utility alone, and remembers it from then on.
//!
//! Keys are the policy's [`quantrouter_policy::conversation_key`], within the tenant's scope:
//! one tenant's session id never reaches another tenant's conversation.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use quantrouter_policy::{prefer_session, remembers, AffinityUse};
use tokio::time::Instant;

use crate::profiles::Snapshot;
use crate::routing::Routed;

/// Conversations remembered at most: 100k keys with their profile ids fit in a few MB.
const MAX_SESSIONS: usize = 100_000;

/// A conversation idle this long is forgotten: its KV cache is likely evicted by then on a
/// busy server, so staying on its profile would save nothing.
const SESSION_IDLE: Duration = Duration::from_secs(600);

/// Conversation key to the profile id of its last turn, least recently used forgotten first.
#[derive(Debug, Default)]
pub struct Sessions {
    inner: Mutex<Memory>,
}

#[derive(Debug, Default)]
struct Memory {
    last: HashMap<u64, (String, Instant)>,
    /// Turns in order; an entry older than its key's last turn is stale.
    order: VecDeque<(u64, Instant)>,
}

// === impl Sessions ===

impl Sessions {
    /// Applies session affinity to a routed request: the profile its conversation's earlier
    /// turns used wins if it is feasible for this turn (and the request may follow them:
    /// [`quantrouter_policy::Conversation::recall`]). With `remember`, the profile this turn
    /// goes to becomes the conversation's, if the router chose it (not a pinned request).
    pub fn settle(&self, snapshot: &Snapshot, routed: &mut Routed, remember: bool) {
        let Some(conversation) = routed.conversation else {
            return;
        };
        let key = conversation.key;
        // A request waiting for a tier scaling from zero keeps the profile it waits for.
        if routed.wait_for.is_some() {
            return;
        }
        let now = Instant::now();
        let mut memory = self.lock();
        let earlier = match conversation.recall {
            true => memory.recall(key, now),
            false => None,
        };
        let earlier = earlier.and_then(|id| snapshot.set.index_of(id));
        if let Some(earlier) = earlier {
            if prefer_session(&mut routed.decision, earlier) {
                routed.affinity = AffinityUse::Session;
            }
        }
        if remember && remembers(&routed.decision) {
            let id = &snapshot.set.profiles[routed.decision.profile].id;
            memory.remember(key, id, now);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Memory> {
        // Nothing panics while holding the lock; the memory stays consistent.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

// === impl Memory ===

impl Memory {
    fn recall(&self, key: u64, now: Instant) -> Option<&str> {
        let (id, at) = self.last.get(&key)?;
        (now.saturating_duration_since(*at) < SESSION_IDLE).then_some(id.as_str())
    }

    fn remember(&mut self, key: u64, id: &str, now: Instant) {
        match self.last.get_mut(&key) {
            Some((known, at)) => {
                if known != id {
                    id.clone_into(known);
                }
                *at = now;
            }
            None => {
                self.last.insert(key, (id.to_owned(), now));
            }
        }
        self.order.push_back((key, now));
        while self.last.len() > MAX_SESSIONS
            || self
                .order
                .front()
                .is_some_and(|(_, at)| now.saturating_duration_since(*at) >= SESSION_IDLE)
        {
            let Some((key, at)) = self.order.pop_front() else {
                break;
            };
            if self.last.get(&key).is_some_and(|(_, last)| *last == at) {
                self.last.remove(&key);
            }
        }
        // Busy conversations leave stale turns behind; drop them before they pile up.
        if self.order.len() > 2 * MAX_SESSIONS {
            let last = &self.last;
            self.order
                .retain(|(key, at)| last.get(key).is_some_and(|(_, l)| l == at));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn conversations_are_forgotten_when_idle_or_crowded_out() {
        let mut memory = Memory::default();
        let start = Instant::now();
        memory.remember(1, "fp16", start);
        memory.remember(2, "int4", start);
        assert_eq!(memory.recall(1, start), Some("fp16"));
        memory.remember(1, "fp8", start + Duration::from_secs(1));
        assert_eq!(memory.recall(1, start), Some("fp8"), "the last turn counts");
        let later = start + SESSION_IDLE + Duration::from_secs(1);
        assert_eq!(memory.recall(2, later), None, "idle too long");
        memory.remember(3, "int4", later);
        assert!(
            !memory.last.contains_key(&2),
            "idle keys are dropped as others come"
        );
        for key in 0..(MAX_SESSIONS as u64 + 10) {
            memory.remember(100 + key, "int4", later);
        }
        assert!(memory.last.len() <= MAX_SESSIONS);
        assert!(memory.order.len() <= 2 * MAX_SESSIONS + 1);
    }
}
