//! Tenant metric labels with bounded cardinality: `top` tenants are labelled with their id
//! and every other with `other`, so thousands of tenants do not make thousands of series per
//! metric (the exporter keeps every series it ever saw).
//!
//! Which tenants are the top ones is decided from the document, not from traffic: the highest
//! priority first, then the largest monthly budget (none counts as the largest), then the
//! largest daily budget, then id. Every replica therefore labels the same tenants, so sums
//! across replicas add up per tenant, and the labels change only when the document does.

use std::cmp::Reverse;
use std::sync::Arc;

use super::ActiveTenant;

/// The label of every tenant outside the top N (a tenant id the document refuses).
pub const OTHER: &str = "other";

/// How many tenants get a label of their own unless configured: enough for a team-per-tenant
/// fleet, few enough that six per-tenant metrics stay a few hundred series.
pub const DEFAULT_TOP: usize = 50;

/// Sets each tenant's metric label: its id for the `top` first in label order, [`OTHER`]
/// for the rest.
pub fn assign(tenants: &mut [ActiveTenant], top: usize) {
    let mut order: Vec<usize> = (0..tenants.len()).collect();
    let budget = |b: Option<f64>| Reverse(b.unwrap_or(f64::INFINITY).to_bits());
    order.sort_by_key(|&i| {
        let t = &tenants[i];
        (
            Reverse(t.priority),
            budget(t.limits.budget_per_month),
            budget(t.limits.budget_per_day),
            Arc::clone(&t.id),
        )
    });
    let other: Arc<str> = Arc::from(OTHER);
    for (rank, i) in order.into_iter().enumerate() {
        let tenant = &mut tenants[i];
        tenant.label = if rank < top {
            Arc::clone(&tenant.id)
        } else {
            Arc::clone(&other)
        };
    }
}
