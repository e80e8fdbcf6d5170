//! The numbers KEDA scales each vLLM tier on: per tier, requests queued (waiting for
//! admission plus vLLM's own queue), requests in flight, and endpoints ready.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::profiles::Snapshot;

/// One tier as this replica sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierStats {
    pub queue_depth: u64,
    pub inflight: u64,
    pub ready_endpoints: u64,
}

/// Every tier of the active snapshot (profiles sharing a tier add up).
pub fn local_tiers(snapshot: &Snapshot, now: Instant) -> BTreeMap<String, TierStats> {
    let mut tiers: BTreeMap<String, TierStats> = BTreeMap::new();
    for (profile, pool) in snapshot.set.profiles.iter().zip(&snapshot.pools) {
        let tier = tiers.entry(profile.tier.clone()).or_default();
        tier.queue_depth +=
            pool.admission.waiting() + pool.cold_waiting() + pool.upstream_waiting();
        tier.inflight += pool.inflight();
        tier.ready_endpoints += pool.ready_endpoints(now) as u64;
    }
    tiers
}
