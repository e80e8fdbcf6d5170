//! `loadtest`: an open- and closed-loop load generator for OpenAI-compatible endpoints.
//!
//! Two ways to drive a server:
//! - **rate** (open loop): request `i` is due at `t0 + i / R` whatever happened before it, and
//!   its latency is measured from that *scheduled* time, so a stall in the server shows up in
//!   the percentiles instead of silently slowing the client down (no coordinated omission);
//! - **concurrency** (closed loop): `C` workers each send back to back.
//!
//! The binary is a thin wrapper over [`cli::execute`]; tests call [`run()`] directly.
//! [`suite`] runs the benchmark scenarios end to end (`loadtest suite`).

pub mod cli;
pub mod client;
pub mod compare;
pub mod markdown;
pub mod outcome;
pub mod report;
pub mod run;
pub mod scenario;
pub mod schedule;
pub mod sse;
pub mod stats;
pub mod suite;
pub mod workload;

pub use client::Transport;
pub use compare::{compare, Comparison};
pub use report::{Mode, RunReport};
pub use run::{run, LoadMode, RunConfig};
pub use scenario::Scenario;
pub use workload::{Endpoint, TokenMix};
