//! The admission slot: a place in a tier's admission queue, by the tenant's priority, for
//! as long as the request's answer lasts. A leaf of the pipeline, so that the HTTP port's
//! forwarder, which takes a slot for each profile it tries, calls it too.

use std::time::Duration;

use crate::openai::ApiError;
use crate::resilience::{Overloaded, Permit};
use crate::telemetry;
use crate::upstream::Pool;

/// A slot in `pool`'s admission queue for a request of `priority`, waiting at most
/// `queue_timeout`; refused with `profile`'s name (429 `tier_overloaded`).
pub(crate) async fn admit_to(
    pool: &Pool,
    profile: &str,
    priority: i32,
    queue_timeout: Duration,
) -> Result<Permit, ApiError> {
    pool.admission
        .admit(priority, queue_timeout)
        .await
        .map_err(|overloaded| {
            telemetry::admission_rejected(profile);
            ApiError::Overloaded {
                profile: profile.to_owned(),
                reason: match overloaded {
                    Overloaded::QueueFull => "the wait queue is full".into(),
                    Overloaded::Timeout => format!("no slot within {queue_timeout:?}"),
                    Overloaded::Displaced => "a higher-priority request took its place".into(),
                },
                retry_after_s: 1,
            }
        })
}
