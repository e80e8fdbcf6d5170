//! The numbers KEDA scales each vLLM tier on: per tier, requests queued (waiting for
//! admission plus vLLM's own queue), requests in flight, and endpoints ready.
//!
//! One replica knows only its own numbers ([`local_tiers`]); several replicas share a tier,
//! so the numbers KEDA sees are cluster-wide: every replica publishes its share to Redis
//! ([`publish`]) and any replica can answer for all of them ([`Keda::tier`]), on the admin
//! port (`GET /keda/tiers/{tier}`) and through KEDA's external scaler ([`scaler`]).
//!
//! Adding replicas up is not a plain sum: every replica sees the same vLLM endpoints and
//! scrapes the same vLLM queues, so endpoints are counted once by URL (ready if any replica
//! sees them ready) and each endpoint's queue once (the largest reading), while requests
//! waiting for admission and requests in flight belong to one replica each and add up.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use quantrouter_policy::ProfileIndex;

use crate::profiles::Snapshot;

pub mod demand;
pub mod publish;
pub mod scaler;

pub use demand::Demand;

/// KEDA's external scaler interface, generated from `proto/externalscaler.proto`.
#[allow(
    missing_debug_implementations,
    clippy::all,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]
pub mod proto {
    tonic::include_proto!("externalscaler");
}

/// One tier as this replica sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierStats {
    pub queue_depth: u64,
    pub inflight: u64,
    pub ready_endpoints: u64,
}

/// One replica's share of one tier, in the parts that add up differently across replicas
/// (what [`publish`] writes to Redis).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierShare {
    /// Requests waiting for an admission slot in this replica.
    pub admission_waiting: u64,
    /// Requests this replica has in flight upstream.
    pub inflight: u64,
    /// Every endpoint of the tier this replica knows, by base URL.
    pub endpoints: BTreeMap<String, EndpointView>,
}

/// What one replica knows about one endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointView {
    /// Its circuit is not open.
    pub ready: bool,
    /// The upstream's waiting requests (`vllm:num_requests_waiting` or another server's
    /// equivalent) as last scraped.
    pub waiting: u64,
}

/// The numbers for one tier, as `GET /keda/tiers/{tier}` answers them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TierReport {
    pub tier: String,
    pub queue_depth: u64,
    pub inflight: u64,
    pub ready_endpoints: u64,
    /// Replicas whose numbers are included (this one among them).
    pub replicas_reporting: u64,
    pub source: ReportSource,
}

/// Whether a report covers the cluster or only this replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportSource {
    /// Every live replica's share, read from Redis.
    Redis,
    /// This replica alone: no Redis configured, or Redis unreachable.
    Local,
}

/// KEDA settings of a router.
#[derive(Debug, Clone)]
pub struct KedaConfig {
    /// Where replicas share their numbers; `None`: every replica answers for itself.
    pub redis: Option<publish::RedisTarget>,
    /// This replica's name in Redis keys (the pod name in Kubernetes).
    pub replica_id: String,
    /// How often the share is published: KEDA polls every 30 s by default and the
    /// metrics-api trigger reads on each poll, so a second is fresh enough and cheap.
    pub publish_interval: Duration,
    /// Lifetime of a published share: a replica that dies without cleaning up drops out of
    /// the sums after this long (five missed publishes).
    pub ttl: Duration,
    /// Longest wait for Redis when answering; past it the answer is this replica's own.
    pub read_timeout: Duration,
    /// How long a request for a tier without a ready endpoint keeps that tier active, so a
    /// scale-from-zero signal outlives KEDA's 30 s default polling interval.
    pub demand_hold: Duration,
    /// How often an open `StreamIsActive` re-checks the numbers between demand signals.
    pub stream_check: Duration,
}

/// KEDA state shared by the admin port, the external scaler and the request path.
#[derive(Debug)]
pub struct Keda {
    pub config: KedaConfig,
    pub demand: Arc<Demand>,
    cluster: Option<publish::ClusterReader>,
}

// === impl Keda ===

impl Keda {
    pub fn new(config: KedaConfig) -> Self {
        let cluster = config
            .redis
            .clone()
            .map(|target| publish::ClusterReader::new(target, config.replica_id.clone()));
        Self {
            config,
            demand: Arc::new(Demand::default()),
            cluster,
        }
    }

    /// The numbers for `tier`: cluster-wide when Redis answers within the read timeout, this
    /// replica's own otherwise; `None` when the active profile set has no such tier.
    pub async fn tier(&self, snapshot: &Snapshot, tier: &str) -> Option<TierReport> {
        let mut shares = local_shares(snapshot, Instant::now());
        let own = shares.remove(tier)?;
        let others = match &self.cluster {
            Some(cluster) => cluster.others(tier, self.config.read_timeout).await,
            None => None,
        };
        let source = match others {
            Some(_) => ReportSource::Redis,
            None => ReportSource::Local,
        };
        let others = others.unwrap_or_default();
        let stats = merge(std::iter::once(&own).chain(&others));
        Some(TierReport {
            tier: tier.to_owned(),
            queue_depth: stats.queue_depth,
            inflight: stats.inflight,
            ready_endpoints: stats.ready_endpoints,
            replicas_reporting: 1 + others.len() as u64,
            source,
        })
    }

    /// Request-path hook: a request routed to a profile with no ready endpoint (its tier
    /// scaled to zero) wakes KEDA's `StreamIsActive` for that tier at once.
    pub fn on_route(&self, snapshot: &Snapshot, profile: ProfileIndex) {
        if let (Some(p), Some(pool)) = (
            snapshot.set.profiles.get(profile.get()),
            snapshot.runtime.get(profile.get()).map(|r| &r.pool),
        ) {
            if pool.ready_endpoints(Instant::now()) == 0 {
                self.demand.notify_demand(&p.tier);
            }
        }
    }
}

impl Default for KedaConfig {
    fn default() -> Self {
        Self {
            redis: None,
            replica_id: random_replica_id(),
            publish_interval: Duration::from_secs(1),
            ttl: Duration::from_secs(5),
            read_timeout: Duration::from_millis(500),
            demand_hold: Duration::from_secs(60),
            stream_check: Duration::from_secs(1),
        }
    }
}

// === impl TierShare ===

impl TierShare {
    /// This share alone, as the per-replica gauges show it.
    pub fn stats(&self) -> TierStats {
        merge(std::iter::once(self))
    }
}

/// A caller's name (a tier, a trigger setting) as error messages quote it: its first 64
/// characters, escaped. Whoever reaches the scaler or admin port chooses the name, and a
/// message echoing it whole (into gRPC's `grpc-message` header, or a 404 body) would let them
/// size the answer and put control characters in it.
pub fn quoted(name: &str) -> String {
    const MAX: usize = 64;
    let mut text: String = name
        .chars()
        .take(MAX)
        .flat_map(char::escape_debug)
        .collect();
    if name.chars().nth(MAX).is_some() {
        text.push_str("...");
    }
    text
}

/// A replica id for when the pod name is unknown (outside Kubernetes, tests).
pub fn random_replica_id() -> String {
    format!("qr-{:016x}", fastrand::u64(..))
}

/// Every tier of the active snapshot (profiles sharing a tier add up).
pub fn local_tiers(snapshot: &Snapshot, now: Instant) -> BTreeMap<String, TierStats> {
    local_shares(snapshot, now)
        .into_iter()
        .map(|(tier, share)| (tier, share.stats()))
        .collect()
}

/// This replica's share of every tier of the active snapshot.
pub fn local_shares(snapshot: &Snapshot, now: Instant) -> BTreeMap<String, TierShare> {
    let mut tiers: BTreeMap<String, TierShare> = BTreeMap::new();
    for (profile, pool) in snapshot.set.profiles.iter().zip(snapshot.pools()) {
        let tier = tiers.entry(profile.tier.clone()).or_default();
        // Requests waiting for a slot or for a scaled-to-zero tier's first endpoint.
        tier.admission_waiting += pool.admission.waiting() + pool.cold_waiting();
        tier.inflight += pool.inflight();
        for endpoint in pool.endpoints().iter() {
            let view = EndpointView {
                ready: endpoint.circuit(now) != crate::resilience::CircuitState::Open,
                waiting: endpoint.waiting(),
            };
            // Two profiles of a tier on one endpoint: one endpoint, one queue.
            let entry = tier
                .endpoints
                .entry(endpoint.base().to_owned())
                .or_default();
            entry.ready |= view.ready;
            entry.waiting = entry.waiting.max(view.waiting);
        }
    }
    tiers
}

/// Shares of several replicas as one tier: admission queues and in-flight requests add up;
/// endpoints count once by URL (ready if any replica sees it ready), with the largest queue
/// any replica scraped from it.
pub fn merge<'a>(shares: impl IntoIterator<Item = &'a TierShare>) -> TierStats {
    let mut admission_waiting = 0;
    let mut inflight = 0;
    let mut endpoints: BTreeMap<&str, EndpointView> = BTreeMap::new();
    for share in shares {
        admission_waiting += share.admission_waiting;
        inflight += share.inflight;
        for (base, view) in &share.endpoints {
            let entry = endpoints.entry(base.as_str()).or_default();
            entry.ready |= view.ready;
            entry.waiting = entry.waiting.max(view.waiting);
        }
    }
    TierStats {
        queue_depth: admission_waiting + endpoints.values().map(|e| e.waiting).sum::<u64>(),
        inflight,
        ready_endpoints: endpoints.values().filter(|e| e.ready).count() as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quoted_name_is_short_and_escaped() {
        assert_eq!(quoted("int4"), "int4");
        assert_eq!(quoted("a\nb\u{7}\"c"), "a\\nb\\u{7}\\\"c");
        let long = quoted(&"x".repeat(10_000));
        assert_eq!(long, format!("{}...", "x".repeat(64)));
    }

    fn share(admission: u64, inflight: u64, endpoints: &[(&str, bool, u64)]) -> TierShare {
        TierShare {
            admission_waiting: admission,
            inflight,
            endpoints: endpoints
                .iter()
                .map(|&(base, ready, waiting)| (base.to_owned(), EndpointView { ready, waiting }))
                .collect(),
        }
    }

    #[test]
    fn requests_add_up_but_shared_endpoints_and_their_queues_count_once() {
        let a = share(2, 5, &[("http://a", true, 3), ("http://b", false, 0)]);
        let b = share(1, 4, &[("http://a", true, 4), ("http://b", true, 1)]);
        let stats = merge([&a, &b]);
        assert_eq!(
            stats,
            TierStats {
                // 2 + 1 waiting for admission, max(3, 4) + max(0, 1) waiting in vLLM.
                queue_depth: 3 + 5,
                inflight: 9,
                ready_endpoints: 2,
            }
        );
    }

    #[test]
    fn replicas_with_their_own_endpoints_add_up() {
        let a = share(0, 1, &[("http://a", true, 2)]);
        let b = share(0, 1, &[("http://b", true, 2)]);
        assert_eq!(
            merge([&a, &b]),
            TierStats {
                queue_depth: 4,
                inflight: 2,
                ready_endpoints: 2
            }
        );
    }

    #[test]
    fn one_share_is_its_own_stats() {
        let a = share(1, 2, &[("http://a", true, 3), ("http://b", false, 1)]);
        assert_eq!(
            a.stats(),
            TierStats {
                queue_depth: 5,
                inflight: 2,
                ready_endpoints: 1
            }
        );
    }
}
