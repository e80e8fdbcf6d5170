//! A stand-in for one vLLM OpenAI-compatible server, for quantrouter's tests, demo and load
//! tests.
//!
//! The simulator speaks vLLM's wire shapes (`/v1/chat/completions`, `/v1/completions`,
//! Anthropic's `/v1/messages` and OpenAI's `/v1/responses` unless `chat_only`, `/v1/models`, `/health`, `/metrics` with vLLM's metric names), produces deterministic text
//! derived from the prompt and a seed, follows a simple latency model (time to first token,
//! then a fixed inter-token latency, at most `max_num_seqs` requests running at once) and lets
//! tests inject faults at run time (`POST /sim/faults`). It can also wear the metric names of
//! SGLang, llama.cpp or TGI ([`MetricsFlavor`]), require an API key like `--api-key`, and
//! serve HTTPS ([`SimServer::bind_tls`]). It speaks HTTP/1.1 and HTTP/2 (h2c with prior
//! knowledge, or by ALPN over TLS).
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use std::time::Duration;
//! use vllm_sim::{Faults, SimConfig, SimServer};
//!
//! let config = SimConfig { model: "tier-fp8".into(), ttft: Duration::from_millis(20), ..SimConfig::default() };
//! let sim = SimServer::bind("127.0.0.1:0".parse().map_err(std::io::Error::other)?, config).await?;
//! println!("simulated vLLM at {}", sim.url());
//! sim.set_faults(Faults { error_rate: 1.0, error_status: 503, ..Faults::default() });
//! sim.shutdown().await;
//! # Ok(())
//! # }
//! ```

mod agent_api;
mod answers;
mod api;
mod body;
mod completion;
mod config;
mod faults;
mod generate;
mod metrics;
mod prefix_cache;
mod routes;
mod server;
mod state;
pub mod tier_eval;
pub mod tls;

pub use answers::RATING_INSTRUCTION;
pub use config::{MetricsFlavor, SimConfig, DEFAULT_BLOCK_SIZE};
pub use faults::{Faults, FaultsError, StreamBreak, WrongWhen};
pub use metrics::SimStats;
pub use server::SimServer;
