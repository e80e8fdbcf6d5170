//! Following a document in Redis: read it, SUBSCRIBE to its update channel, and poll as a
//! safety net for missed messages. Reconnects with capped exponential backoff and jitter;
//! requests never wait on Redis, and what a follower applied stays in force while Redis is
//! down or holds bad data.

use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::StreamExt;
use tokio::task::JoinHandle;

use super::{Document, RedisStore, StoreError};
use crate::redis_conn::Redis;
use crate::resilience::backoff::{Backoff, Schedule};

/// Reconnect waits: a first ceiling of 100 ms does not hammer a restarting Redis; at most
/// 5 s, so an outage is recovered from within seconds.
const BACKOFF: Backoff = Backoff {
    base: Duration::from_millis(100),
    cap: Duration::from_secs(5),
    retry_after_cap: Duration::ZERO,
};

/// Something kept in step with the active document of one kind.
pub trait Follower: Send + 'static {
    type Doc: Document;

    /// What the logs call it ("profile set", "classifier").
    const WHAT: &'static str;

    /// Reads the active document and applies it if it is new. A bad document is rejected
    /// here (logged, counted, the last good one kept); an error means Redis itself failed.
    fn refresh<'a>(
        &'a mut self,
        redis: &'a RedisStore<Self::Doc>,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
}

/// Runs `follower` against Redis until the task is aborted.
pub fn spawn<F: Follower>(
    redis: Redis,
    prefix: String,
    poll: Duration,
    mut follower: F,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut backoff = BACKOFF.schedule();
        let mut switches = redis.switches();
        loop {
            let result = session(&redis, &prefix, poll, &mut follower, &mut backoff).await;
            if let Err(error) = result {
                tracing::warn!(%error, what = F::WHAT, "redis source disconnected; keeping what is active");
            }
            // A new master ends the wait: it is where the next update is published.
            tokio::select! {
                _ = tokio::time::sleep(backoff.next_delay()) => {}
                _ = switches.changed() => backoff.reset(),
            }
        }
    })
}

/// One connected period: subscribe, apply the current document, then follow updates until
/// the connection ends or the master changes.
async fn session<F: Follower>(
    redis: &Redis,
    prefix: &str,
    poll: Duration,
    follower: &mut F,
    backoff: &mut Schedule,
) -> Result<(), StoreError> {
    let mut switches = redis.switches();
    switches.borrow_and_update();
    let store = RedisStore::<F::Doc>::connect(redis, prefix).await?;
    let mut pubsub = redis.subscribe(&store.keys().channel).await?;
    tracing::info!(channel = %store.keys().channel, what = F::WHAT, "redis source connected");
    follower.refresh(&store).await?;
    // Only a session that got as far as reading the document resets the backoff: one that
    // fails right after connecting must not reconnect at the starting delay forever.
    backoff.reset();
    let mut messages = pubsub.on_message();
    let mut ticker = tokio::time::interval(poll);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            message = messages.next() => {
                if message.is_none() {
                    return Ok(());
                }
            }
            _ = switches.changed() => {
                tracing::info!(what = F::WHAT, "redis master changed; subscribing on the new one");
                return Ok(());
            }
            _ = ticker.tick() => {}
        }
        follower.refresh(&store).await?;
    }
}

/// A key's text (`Some(Ok)`), or why it cannot be a document (`Some(Err)`: a rejected
/// document, not a connection failure); connection failures stay errors.
pub fn document(
    read: Result<Option<String>, StoreError>,
) -> Result<Option<Result<String, String>>, StoreError> {
    match read {
        Ok(text) => Ok(text.map(Ok)),
        Err(error @ (StoreError::NotADocument { .. } | StoreError::TooLarge { .. })) => {
            Ok(Some(Err(error.to_string())))
        }
        Err(error) => Err(error),
    }
}

/// The `version` field of a stored document, without validating the rest.
pub fn stored_version(text: &str) -> Option<u64> {
    serde_json::from_str::<serde_json::Value>(text).ok()?["version"].as_u64()
}
