//! Settings of one simulated vLLM server.

use std::time::Duration;

/// How one simulated vLLM server behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    /// The served model name; requests naming another model get a 404 like vLLM's.
    pub model: String,
    /// Time to first token, counted from the moment a request is admitted to run.
    pub ttft: Duration,
    /// Inter-token latency: the time each generated token takes.
    pub itl: Duration,
    /// How many requests run at once; the rest wait in a queue (vLLM's `--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Mixed into the prompt hash so two simulators can answer the same prompt differently.
    pub seed: u64,
}

impl Default for SimConfig {
    /// Zero latency so the router's own overhead can be measured against it; 256 running
    /// sequences is vLLM's default `--max-num-seqs`.
    fn default() -> Self {
        Self {
            model: "sim-model".to_owned(),
            ttft: Duration::ZERO,
            itl: Duration::ZERO,
            max_num_seqs: 256,
            seed: 0,
        }
    }
}
