//! Where stored Responses live: the profile whose upstream stored each response, so a
//! follow-up (`previous_response_id`) and `GET`/`DELETE /v1/responses/{id}` reach it, and
//! the tenant whose request stored it: to any other tenant the response does not exist.
//!
//! With Redis the placement is shared by every replica (`<prefix>:responses:<id>`, with a
//! TTL); without it each replica knows only the responses it relayed, and a follow-up that
//! lands on another replica is refused with a clear error.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::AsyncCommands;
use serde::Deserialize;

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

/// A stored response's place and owner; in Redis as JSON (`{"profile": …, "tenant": …}`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Stored {
    /// The profile whose upstream stored it.
    pub profile: String,
    /// The tenant whose request stored it; `None` on a router without tenants.
    #[serde(default)]
    pub tenant: Option<String>,
}

/// Response id → where it is stored and whose it is, per replica and, when configured, in
/// Redis.
#[derive(Debug)]
pub struct ResponseStore {
    local: Mutex<Local>,
    redis: Option<Shared>,
    ttl: Duration,
    capacity: usize,
}

#[derive(Debug, Default)]
struct Local {
    placed: HashMap<String, Stored>,
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

    /// Notes where `response` is stored and whose it is; Redis is written in the background
    /// (the client has its answer already).
    pub fn remember(self: &Arc<Self>, response: String, stored: Stored) {
        self.local_insert(&response, &stored);
        if self.redis.is_some() {
            let store = Arc::clone(self);
            tokio::spawn(async move {
                if let Err(error) = store.redis_set(&response, &stored).await {
                    tracing::warn!(%error, "cannot share a stored response's placement in redis");
                }
            });
        }
    }

    /// The profile that stored `response` for `tenant`, if known here or in Redis. Another
    /// tenant's response is not found, exactly like an unknown one.
    pub async fn profile_of(&self, response: &str, tenant: Option<&str>) -> Option<String> {
        let stored = match self.local_get(response) {
            Some(stored) => stored,
            None => self.redis_get(response).await?,
        };
        (stored.tenant.as_deref() == tenant).then_some(stored.profile)
    }

    async fn redis_get(&self, response: &str) -> Option<Stored> {
        let shared = self.redis.as_ref()?;
        let mut conn = self.connection(shared).await.ok()?;
        match conn.get::<_, Option<String>>(shared.key(response)).await {
            Ok(value) => value.map(|value| Stored::from_redis(&value)),
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

    fn local_insert(&self, response: &str, stored: &Stored) {
        let Ok(mut local) = self.local.lock() else {
            return;
        };
        if local
            .placed
            .insert(response.to_owned(), stored.clone())
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

    fn local_get(&self, response: &str) -> Option<Stored> {
        self.local.lock().ok()?.placed.get(response).cloned()
    }

    async fn redis_set(&self, response: &str, stored: &Stored) -> redis::RedisResult<()> {
        let Some(shared) = &self.redis else {
            return Ok(());
        };
        let value = stored.to_redis();
        let mut conn = self.connection(shared).await?;
        conn.set_ex(shared.key(response), value, self.ttl.as_secs().max(1))
            .await
    }

    /// The shared connection; one that breaks is replaced on the next call (with Sentinel,
    /// on the master of the moment).
    async fn connection(&self, shared: &Shared) -> redis::RedisResult<Conn> {
        shared.link.get().await
    }
}

// === impl Stored ===

impl Stored {
    /// The Redis value: the record as JSON, without `tenant` when there is none.
    fn to_redis(&self) -> String {
        let mut value = serde_json::json!({ "profile": self.profile });
        if let Some(tenant) = &self.tenant {
            value["tenant"] = tenant.as_str().into();
        }
        value.to_string()
    }

    /// A Redis value: the JSON record, or the bare profile id routers wrote before records
    /// named their tenant, which only a router without tenants may then use.
    fn from_redis(value: &str) -> Self {
        serde_json::from_str(value).unwrap_or_else(|_| Self {
            profile: value.to_owned(),
            tenant: None,
        })
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
        let stored = Stored {
            profile: "p".into(),
            tenant: None,
        };
        for id in ["a", "b", "c"] {
            store.local_insert(id, &stored);
        }
        assert_eq!(store.local_get("a"), None);
        assert_eq!(store.local_get("c"), Some(stored));
    }

    #[tokio::test]
    async fn a_response_is_found_only_for_the_tenant_that_stored_it() {
        let store = ResponseStore::new(StoreConfig::default());
        let stored = |tenant: Option<&str>| Stored {
            profile: "p".into(),
            tenant: tenant.map(str::to_owned),
        };
        store.local_insert("a", &stored(Some("team-a")));
        store.local_insert("none", &stored(None));
        assert_eq!(
            store.profile_of("a", Some("team-a")).await.as_deref(),
            Some("p")
        );
        assert_eq!(store.profile_of("a", Some("team-b")).await, None);
        assert_eq!(store.profile_of("a", None).await, None);
        assert_eq!(store.profile_of("none", None).await.as_deref(), Some("p"));
        assert_eq!(store.profile_of("none", Some("team-a")).await, None);
    }

    #[test]
    fn redis_values_are_records_or_the_older_bare_profile_id() {
        let record = r#"{"profile":"llama8b-awq","tenant":"team-a"}"#;
        assert_eq!(
            Stored::from_redis(record),
            Stored {
                profile: "llama8b-awq".into(),
                tenant: Some("team-a".into())
            }
        );
        assert_eq!(Stored::from_redis("llama8b-awq").tenant, None);
        let none = Stored::from_redis(r#"{"profile":"p"}"#);
        assert_eq!(none.to_redis(), r#"{"profile":"p"}"#);
        assert_eq!(Stored::from_redis(record).to_redis(), record);
    }
}
