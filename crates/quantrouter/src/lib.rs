//! quantrouter: an OpenAI-compatible router that sends each request to the cheapest
//! model-quantization profile that meets its quality and latency needs.
//!
//! The request path reads top-down: [`server`] → [`routing`] → [`upstream`]; decisions come
//! from the pure `quantrouter-policy` crate.

pub mod admin;
pub mod affinity;
pub mod apis;
pub mod app;
pub mod bootstrap;
pub mod calibration;
pub mod classifier;
pub mod cli;
pub mod descriptors;
pub mod discovery;
pub mod documents;
pub mod epp;
pub mod keda;
pub mod openai;
pub mod pipeline;
pub mod probes;
pub mod profiles;
pub mod redis_conn;
pub mod resilience;
pub mod routing;
pub mod second_opinion;
pub mod server;
pub mod telemetry;
pub mod tenants;
pub mod tier_profile;
pub mod tls;
pub mod traces;
pub mod upstream;
