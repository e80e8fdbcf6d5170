//! Settings of one simulated vLLM server.

use std::time::Duration;

/// vLLM's default `--block-size` on GPUs.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

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
    /// Which server's metric names `/metrics` uses, and when a stream's head goes out.
    pub metrics_flavor: MetricsFlavor,
    /// Bearer token every route but `/health` and `/sim/*` requires (vLLM's and
    /// llama.cpp's `--api-key`); `None` accepts anyone.
    pub api_key: Option<String>,
    /// Serve only the OpenAI APIs (`/v1/chat/completions`, `/v1/completions`): Anthropic's
    /// `/v1/messages` and OpenAI's `/v1/responses` answer 404, as on a server without them.
    pub chat_only: bool,
    /// Prefix-cache capacity in KV blocks (vLLM's automatic prefix caching); 0 turns the
    /// cache off, so every prompt token is prefilled.
    pub prefix_cache_blocks: usize,
    /// Tokens per KV block: the unit the prefix cache hashes and evicts.
    pub block_size: usize,
    /// Prefill time per prompt token not found in the cache, added to the time to first
    /// token. Prefills share one compute stream, so they queue behind each other.
    pub prefill_per_token: Duration,
}

/// An OpenAI-compatible server the simulator imitates on the wire, beyond the OpenAI API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum MetricsFlavor {
    /// vLLM: `vllm:num_requests_waiting` / `vllm:num_requests_running`.
    #[default]
    Vllm,
    /// SGLang: `sglang:num_queue_reqs` / `sglang:num_running_reqs`.
    Sglang,
    /// llama.cpp's `llama-server`: `llamacpp:requests_deferred` /
    /// `llamacpp:requests_processing`, and a stream's response head leaves before prefill.
    Llamacpp,
    /// Text Generation Inference: `tgi_queue_size` / `tgi_batch_current_size`.
    Tgi,
}

impl MetricsFlavor {
    /// Whether a stream's response head goes out as soon as the request is accepted, before
    /// the queue and the time to first token (llama.cpp), rather than with the first event.
    pub fn head_before_prefill(self) -> bool {
        self == Self::Llamacpp
    }
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
            metrics_flavor: MetricsFlavor::Vllm,
            api_key: None,
            // vLLM serves both agent APIs next to chat.
            chat_only: false,
            prefix_cache_blocks: 0,
            block_size: DEFAULT_BLOCK_SIZE,
            prefill_per_token: Duration::ZERO,
        }
    }
}
