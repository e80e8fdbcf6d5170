//! Where stored Responses live: the profile whose upstream stored each response, so a
//! follow-up (`previous_response_id`) and `GET`/`DELETE /v1/responses/{id}` reach it.
//!
//! With Redis the placement is shared by every replica (`<prefix>:responses:<id>`, with a
//! TTL); without it each replica knows only the responses it relayed, and a follow-up that
//! lands on another replica is refused with a clear error.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::AsyncCommands;

use crate::redis_conn::{Conn, Link};

/// Settings of the placement store.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Redis and its key prefix, shared by the replicas; `None`: per replica.
    pub redis: Option<(crate::redis_conn::Redis, String)>,
    /// How long a placement is kept: a day covers a working day's agent sessions, and the
    /// upstreams (vLLM keeps stored responses in memory) rarely keep them longer.
    pub ttl: Duration,
    /// Placements kept per replica (the oldest go first): ~100 bytes each.
    pub local_capacity: usize,
}

/// Response id → profile id, per replica and, when configured, in Redis.
#[derive(Debug)]
pub struct ResponseStore {
    local: Mutex<Local>,
    redis: Option<Shared>,
    ttl: Duration,
    capacity: usize,
}

#[derive(Debug, Default)]
struct Local {
    placed: HashMap<String, String>,
    order: VecDeque<String>,
}

#[derive(Debug)]
struct Shared {
    link: Link,
    prefix: String,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            redis: None,
            ttl: Duration::from_secs(24 * 3600),
            local_capacity: 100_000,
        }
    }
}

// === impl ResponseStore ===

impl ResponseStore {
    pub fn new(config: StoreConfig) -> Self {
        Self {
            local: Mutex::new(Local::default()),
            redis: config.redis.map(|(redis, prefix)| Shared {
                link: Link::new(redis),
                prefix,
            }),
            ttl: config.ttl,
            capacity: config.local_capacity.max(1),
        }
    }

    /// Whether the placement is shared through Redis.
    pub fn shared(&self) -> bool {
        self.redis.is_some()
    }

    /// Notes that `profile` stored `response`; Redis is written in the background (the
    /// client has its answer already).
    pub fn remember(self: &Arc<Self>, response: String, profile: String) {
        self.local_insert(&response, &profile);
        if self.redis.is_some() {
            let store = Arc::clone(self);
            tokio::spawn(async move {
                if let Err(error) = store.redis_set(&response, &profile).await {
                    tracing::warn!(%error, "cannot share a stored response's placement in redis");
                }
            });
        }
    }

    /// The profile that stored `response`, if known here or in Redis.
    pub async fn profile_of(&self, response: &str) -> Option<String> {
        if let Some(profile) = self.local_get(response) {
            return Some(profile);
        }
        let shared = self.redis.as_ref()?;
        let mut conn = self.connection(shared).await.ok()?;
        match conn.get::<_, Option<String>>(shared.key(response)).await {
            Ok(profile) => profile,
            Err(error) => {
                tracing::warn!(%error, "cannot read a stored response's placement from redis");
                None
            }
        }
    }

    /// Forgets a deleted response.
    pub async fn forget(&self, response: &str) {
        if let Ok(mut local) = self.local.lock() {
            local.placed.remove(response);
        }
        if let Some(shared) = &self.redis {
            if let Ok(mut conn) = self.connection(shared).await {
                let _: Result<(), _> = conn.del(shared.key(response)).await;
            }
        }
    }

    fn local_insert(&self, response: &str, profile: &str) {
        let Ok(mut local) = self.local.lock() else {
            return;
        };
        if local
            .placed
            .insert(response.to_owned(), profile.to_owned())
            .is_none()
        {
            local.order.push_back(response.to_owned());
        }
        while local.order.len() > self.capacity {
            if let Some(oldest) = local.order.pop_front() {
                local.placed.remove(&oldest);
            }
        }
    }

    fn local_get(&self, response: &str) -> Option<String> {
        self.local.lock().ok()?.placed.get(response).cloned()
    }

    async fn redis_set(&self, response: &str, profile: &str) -> redis::RedisResult<()> {
        let Some(shared) = &self.redis else {
            return Ok(());
        };
        let mut conn = self.connection(shared).await?;
        conn.set_ex(shared.key(response), profile, self.ttl.as_secs().max(1))
            .await
    }

    /// The shared connection; one that breaks is replaced on the next call (with Sentinel,
    /// on the master of the moment).
    async fn connection(&self, shared: &Shared) -> redis::RedisResult<Conn> {
        shared.link.get().await
    }
}

// === impl Shared ===

impl Shared {
    fn key(&self, response: &str) -> String {
        format!("{}:responses:{response}", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_placements_go_first_past_the_capacity() {
        let store = ResponseStore::new(StoreConfig {
            local_capacity: 2,
            ..StoreConfig::default()
        });
        for id in ["a", "b", "c"] {
            store.local_insert(id, "p");
        }
        assert_eq!(store.local_get("a"), None);
        assert_eq!(store.local_get("c").as_deref(), Some("p"));
    }
}
