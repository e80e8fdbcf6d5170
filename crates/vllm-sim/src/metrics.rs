//! Counters, gauges and histograms kept in atomics and rendered by hand in the Prometheus
//! text format under the metric names of the server the simulator imitates (vLLM by
//! default; SGLang, llama.cpp or TGI), so dashboards and the router's scrapers see what that
//! server would export.

use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::MetricsFlavor;

/// vLLM's bucket bounds (seconds) for `vllm:time_to_first_token_seconds`.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// vLLM's bucket bounds (seconds) for `vllm:e2e_request_latency_seconds`.
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// What `GET /sim/stats` answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimStats {
    /// Completion requests received, including those answered with errors.
    pub requests: u64,
    /// Requests whose client went away before the response (or stream) completed.
    pub cancelled: u64,
    /// Completion requests that at least one injected fault acted on.
    pub faults_injected: u64,
    /// Completion requests that came over HTTP/2 (h2c or h2 by ALPN).
    #[serde(default)]
    pub http2_requests: u64,
}

/// Everything the simulator counts.
#[derive(Debug)]
pub(crate) struct Metrics {
    pub(crate) requests: AtomicU64,
    pub(crate) http2_requests: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) faults_injected: AtomicU64,
    pub(crate) prompt_tokens: AtomicU64,
    pub(crate) generation_tokens: AtomicU64,
    pub(crate) running: AtomicUsize,
    pub(crate) waiting: AtomicUsize,
    /// Prompt tokens looked up in the prefix cache, and those found (vLLM counts tokens).
    pub(crate) prefix_cache_queries: AtomicU64,
    pub(crate) prefix_cache_hits: AtomicU64,
    /// KV blocks held by running requests, and the cache's capacity (0: no prefix cache,
    /// and usage is the share of sequence slots taken).
    pub(crate) kv_blocks: AtomicUsize,
    pub(crate) kv_capacity_blocks: AtomicUsize,
    pub(crate) ttft: Histogram,
    pub(crate) e2e: Histogram,
}

/// A fixed-bucket histogram; buckets hold per-bucket counts and are made cumulative when
/// rendered, so observing is one bucket increment plus sum and count.
#[derive(Debug)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    buckets: Box<[AtomicU64]>,
    sum_nanos: AtomicU64,
    count: AtomicU64,
}

// === impl Metrics ===

impl Metrics {
    pub(crate) fn new() -> Self {
        Self {
            requests: AtomicU64::new(0),
            http2_requests: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            faults_injected: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            running: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            prefix_cache_queries: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            kv_blocks: AtomicUsize::new(0),
            kv_capacity_blocks: AtomicUsize::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }

    pub(crate) fn stats(&self) -> SimStats {
        SimStats {
            requests: self.requests.load(Ordering::Relaxed),
            cancelled: self.cancelled.load(Ordering::Relaxed),
            faults_injected: self.faults_injected.load(Ordering::Relaxed),
            http2_requests: self.http2_requests.load(Ordering::Relaxed),
        }
    }

    /// Renders the Prometheus text exposition (format 0.0.4) under `flavor`'s names.
    pub(crate) fn render(
        &self,
        model: &str,
        max_num_seqs: usize,
        flavor: MetricsFlavor,
    ) -> Result<String, fmt::Error> {
        let names = Names::of(flavor);
        // vLLM and SGLang label every sample with the model; llama.cpp and TGI serve one
        // model and label nothing.
        let label = match names.labelled {
            true => format!("model_name=\"{}\"", escape_label(model)),
            false => String::new(),
        };
        let braces = |extra: &str| match (label.is_empty(), extra.is_empty()) {
            (true, true) => String::new(),
            (true, false) => format!("{{{extra}}}"),
            (false, true) => format!("{{{label}}}"),
            (false, false) => format!("{{{label},{extra}}}"),
        };
        let running = self.running.load(Ordering::Relaxed);
        let waiting = self.waiting.load(Ordering::Relaxed);
        let usage = match self.kv_capacity_blocks.load(Ordering::Relaxed) {
            0 => running as f64 / max_num_seqs.max(1) as f64,
            capacity => (self.kv_blocks.load(Ordering::Relaxed) as f64 / capacity as f64).min(1.0),
        };
        let mut out = String::with_capacity(4096);
        let gauges: [(&str, &str, f64); 3] = [
            (names.running, "Requests being generated.", running as f64),
            (
                names.waiting,
                "Requests waiting to be processed.",
                waiting as f64,
            ),
            (
                names.usage,
                "KV-cache usage. 1 means 100 percent usage.",
                usage,
            ),
        ];
        for (name, help, value) in gauges {
            writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge")?;
            writeln!(out, "{name}{} {value}", braces(""))?;
        }
        for (histogram, name, help) in [
            (
                &self.ttft,
                names.ttft,
                "Histogram of time to first token in seconds.",
            ),
            (
                &self.e2e,
                names.e2e,
                "Histogram of end to end request latency in seconds.",
            ),
        ] {
            if let Some(name) = name {
                histogram.render(&mut out, name, help, &braces)?;
            }
        }
        let counters = [
            (
                names.prompt_tokens,
                "Number of prefill tokens processed.",
                &self.prompt_tokens,
            ),
            (
                names.generation_tokens,
                "Number of generation tokens processed.",
                &self.generation_tokens,
            ),
            (
                "vllm_sim_requests_cancelled_total",
                "Requests whose client went away before the response completed.",
                &self.cancelled,
            ),
        ];
        let prefix_counters = [
            (
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
                &self.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
                &self.prefix_cache_hits,
            ),
        ];
        // Only vLLM exports its prefix cache as counters under these names.
        let prefix_counters = match flavor {
            MetricsFlavor::Vllm => &prefix_counters[..],
            _ => &[],
        };
        for (name, help, counter) in counters.iter().chain(prefix_counters) {
            let value = counter.load(Ordering::Relaxed);
            writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter")?;
            writeln!(out, "{name}{} {value}", braces(""))?;
        }
        Ok(out)
    }
}

/// The metric names of one server.
#[derive(Debug, Clone, Copy)]
struct Names {
    running: &'static str,
    waiting: &'static str,
    usage: &'static str,
    ttft: Option<&'static str>,
    e2e: Option<&'static str>,
    prompt_tokens: &'static str,
    generation_tokens: &'static str,
    labelled: bool,
}

impl Names {
    fn of(flavor: MetricsFlavor) -> Self {
        match flavor {
            MetricsFlavor::Vllm => Self {
                running: "vllm:num_requests_running",
                waiting: "vllm:num_requests_waiting",
                usage: "vllm:kv_cache_usage_perc",
                ttft: Some("vllm:time_to_first_token_seconds"),
                e2e: Some("vllm:e2e_request_latency_seconds"),
                prompt_tokens: "vllm:prompt_tokens_total",
                generation_tokens: "vllm:generation_tokens_total",
                labelled: true,
            },
            MetricsFlavor::Sglang => Self {
                running: "sglang:num_running_reqs",
                waiting: "sglang:num_queue_reqs",
                usage: "sglang:token_usage",
                ttft: Some("sglang:time_to_first_token_seconds"),
                e2e: Some("sglang:e2e_request_latency_seconds"),
                prompt_tokens: "sglang:prompt_tokens_total",
                generation_tokens: "sglang:generation_tokens_total",
                labelled: true,
            },
            MetricsFlavor::Llamacpp => Self {
                running: "llamacpp:requests_processing",
                waiting: "llamacpp:requests_deferred",
                usage: "llamacpp:kv_cache_usage_ratio",
                ttft: None,
                e2e: None,
                prompt_tokens: "llamacpp:prompt_tokens_total",
                generation_tokens: "llamacpp:tokens_predicted_total",
                labelled: false,
            },
            MetricsFlavor::Tgi => Self {
                running: "tgi_batch_current_size",
                waiting: "tgi_queue_size",
                usage: "tgi_batch_current_max_tokens_ratio",
                ttft: None,
                e2e: Some("tgi_request_duration"),
                prompt_tokens: "tgi_request_input_length_total",
                generation_tokens: "tgi_request_generated_tokens_total",
                labelled: false,
            },
        }
    }
}

// === impl Histogram ===

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub(crate) fn observe(&self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        // Observations above the last bound only show up in `+Inf`, i.e. in `count`.
        if let Some(bucket) = self
            .bounds
            .iter()
            .position(|&bound| seconds <= bound)
            .and_then(|i| self.buckets.get(i))
        {
            bucket.fetch_add(1, Ordering::Relaxed);
        }
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// `braces(extra)` writes the label set of a sample with `extra` labels added.
    fn render(
        &self,
        out: &mut String,
        name: &str,
        help: &str,
        braces: &dyn Fn(&str) -> String,
    ) -> fmt::Result {
        writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram")?;
        let mut cumulative = 0;
        for (bound, bucket) in self.bounds.iter().zip(self.buckets.iter()) {
            cumulative += bucket.load(Ordering::Relaxed);
            let labels = braces(&format!("le=\"{bound:?}\""));
            writeln!(out, "{name}_bucket{labels} {cumulative}")?;
        }
        let count = self.count.load(Ordering::Relaxed);
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        writeln!(out, "{name}_bucket{} {count}", braces("le=\"+Inf\""))?;
        writeln!(out, "{name}_sum{} {sum}", braces(""))?;
        writeln!(out, "{name}_count{} {count}", braces(""))
    }
}

/// Prometheus label values escape backslash, double quote and newline.
fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let metrics = Metrics::new();
        metrics.ttft.observe(Duration::from_millis(3));
        metrics.ttft.observe(Duration::from_millis(30));
        metrics.ttft.observe(Duration::from_secs(5000));
        let text = metrics.render("m", 4, MetricsFlavor::Vllm).unwrap();
        let line = |needle: &str| {
            text.lines()
                .find(|l| l.starts_with(needle))
                .unwrap_or_else(|| panic!("no line {needle} in\n{text}"))
                .to_owned()
        };
        let ttft = "vllm:time_to_first_token_seconds";
        assert!(line(&format!("{ttft}_bucket{{model_name=\"m\",le=\"0.001\"}}")).ends_with(" 0"));
        assert!(line(&format!("{ttft}_bucket{{model_name=\"m\",le=\"0.005\"}}")).ends_with(" 1"));
        assert!(line(&format!("{ttft}_bucket{{model_name=\"m\",le=\"0.04\"}}")).ends_with(" 2"));
        assert!(line(&format!("{ttft}_bucket{{model_name=\"m\",le=\"2560.0\"}}")).ends_with(" 2"));
        assert!(line(&format!("{ttft}_bucket{{model_name=\"m\",le=\"+Inf\"}}")).ends_with(" 3"));
        assert!(line(&format!("{ttft}_count{{model_name=\"m\"}}")).ends_with(" 3"));
        assert!(line(&format!("{ttft}_sum{{model_name=\"m\"}}")).ends_with(" 5000.033"));
    }

    #[test]
    fn kv_cache_usage_is_running_share() {
        let metrics = Metrics::new();
        metrics.running.store(1, Ordering::Relaxed);
        let text = metrics.render("m", 4, MetricsFlavor::Vllm).unwrap();
        assert!(text.contains("vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n"));
    }

    #[test]
    fn each_flavor_exports_its_servers_queue_names() {
        let metrics = Metrics::new();
        metrics.waiting.store(3, Ordering::Relaxed);
        metrics.running.store(2, Ordering::Relaxed);
        for (flavor, waiting, running) in [
            (
                MetricsFlavor::Vllm,
                "vllm:num_requests_waiting{model_name=\"m\"} 3",
                "vllm:num_requests_running{model_name=\"m\"} 2",
            ),
            (
                MetricsFlavor::Sglang,
                "sglang:num_queue_reqs{model_name=\"m\"} 3",
                "sglang:num_running_reqs{model_name=\"m\"} 2",
            ),
            (
                MetricsFlavor::Llamacpp,
                "llamacpp:requests_deferred 3",
                "llamacpp:requests_processing 2",
            ),
            (
                MetricsFlavor::Tgi,
                "tgi_queue_size 3",
                "tgi_batch_current_size 2",
            ),
        ] {
            let text = metrics.render("m", 4, flavor).unwrap();
            assert!(
                text.contains(&format!("{waiting}\n")),
                "{flavor:?}:\n{text}"
            );
            assert!(
                text.contains(&format!("{running}\n")),
                "{flavor:?}:\n{text}"
            );
            let vllm_names = text.lines().any(|l| l.starts_with("vllm:"));
            assert_eq!(
                vllm_names,
                flavor == MetricsFlavor::Vllm,
                "{flavor:?}:\n{text}"
            );
        }
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
