//! Routing policy.
