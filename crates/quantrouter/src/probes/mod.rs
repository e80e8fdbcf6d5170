//! Background probes of the upstreams of the active profile set: the queue scrape
//! ([`scrape`], which also publishes the per-tier gauges KEDA and dashboards read) and the
//! active health checks ([`health`]). They read the profile store and write what they find
//! into each endpoint ([`crate::upstream::Pool`]), so the request path never waits on them
//! and `upstream/` depends on neither profiles nor KEDA.

pub mod health;
pub mod scrape;
