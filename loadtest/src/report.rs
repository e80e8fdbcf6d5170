//! The results of one run: the JSON file and the human table.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

use crate::stats::{Accounting, Summary, TierSummary};

/// How load was generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Open loop at a fixed arrival rate.
    Rate,
    /// Closed loop with a fixed number of workers.
    Concurrency,
}

/// One run's results, as written by `loadtest run --out`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// Free-form name of the run.
    pub label: String,
    /// Base URL that was driven.
    pub url: String,
    /// Open or closed loop.
    pub mode: Mode,
    /// Requests/s (rate mode only).
    pub rate: Option<f64>,
    /// Workers (concurrency mode only).
    pub concurrency: Option<u64>,
    /// Length of the measured window, excluding warm-up.
    pub duration_s: f64,
    /// Warm-up before the measured window.
    #[serde(default)]
    pub warmup_s: f64,
    /// `model` sent in every request.
    #[serde(default)]
    pub model: String,
    /// `chat` or `completions`.
    #[serde(default)]
    pub endpoint: String,
    /// `max_tokens` sent (the mean, rounded, when a mix was sent).
    #[serde(default)]
    pub max_tokens: u32,
    /// The `max_tokens` mix, e.g. `16:50,64:30,256:20`.
    #[serde(default)]
    pub max_tokens_mix: String,
    /// Share of streamed requests.
    #[serde(default)]
    pub stream_share: f64,
    /// Requests in the measured window (including errors and client overflows).
    pub requests: u64,
    /// 2xx answers read to the end.
    pub ok: u64,
    /// Failures by kind.
    pub errors: BTreeMap<String, u64>,
    /// Successful requests per second over the measured window (until the last completion).
    pub throughput_rps: f64,
    /// End-to-end latency of successful requests.
    pub latency_us: Summary,
    /// Time to first token of successful requests.
    pub ttft_us: Summary,
    /// `x-quantrouter-tier` response header values.
    #[serde(default)]
    pub tiers: BTreeMap<String, u64>,
    /// `x-quantrouter-profile` response header values.
    #[serde(default)]
    pub profiles: BTreeMap<String, u64>,
    /// `x-quantrouter-reason` response header values.
    #[serde(default)]
    pub reasons: BTreeMap<String, u64>,
    /// Latency and TTFT of successful requests by `x-quantrouter-tier`.
    #[serde(default)]
    pub per_tier: BTreeMap<String, TierSummary>,
    /// Answers with `x-quantrouter-fallback`.
    #[serde(default)]
    pub fallbacks: u64,
    /// 429 answers that carried `Retry-After`.
    #[serde(default)]
    pub retry_after_429: u64,
    /// Lost-request accounting: did every request get one well-formed answer?
    #[serde(default)]
    pub accounting: Accounting,
}

// === impl RunReport ===

impl RunReport {
    /// Writes the report as pretty JSON, creating the parent directory.
    pub fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        if let Some(parent) = path
            .parent()
            .filter(|parent| !parent.as_os_str().is_empty())
        {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("cannot create {}", parent.display()))?;
        }
        let mut text = serde_json::to_string_pretty(self)?;
        text.push('\n');
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
    }

    /// Reads a report written by [`RunReport::write_json`].
    pub fn read_json(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not a loadtest result", path.display()))
    }

    /// A compact table for the terminal.
    pub fn render_table(&self) -> String {
        let load = match self.mode {
            Mode::Rate => format!("rate {} req/s", self.rate.unwrap_or_default()),
            Mode::Concurrency => format!("concurrency {}", self.concurrency.unwrap_or_default()),
        };
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{}  {}  {load}  {}s  {}",
            self.label, self.url, self.duration_s, self.endpoint
        );
        let _ = writeln!(
            out,
            "requests {}  ok {}  errors {}  throughput {:.1} req/s",
            self.requests,
            self.ok,
            self.errors.values().sum::<u64>(),
            self.throughput_rps
        );
        let _ = writeln!(
            out,
            "{:<10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "µs", "p50", "p90", "p99", "p99.9", "max", "mean"
        );
        for (name, summary) in [("latency", &self.latency_us), ("ttft", &self.ttft_us)] {
            let _ = writeln!(
                out,
                "{name:<10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10.0}",
                summary.p50, summary.p90, summary.p99, summary.p999, summary.max, summary.mean
            );
        }
        for (name, tier) in &self.per_tier {
            let _ = writeln!(
                out,
                "tier {name:<5} {:>10} {:>10} {:>10}   ttft p50 {} p99 {}",
                tier.latency_us.count,
                tier.latency_us.p50,
                tier.latency_us.p99,
                tier.ttft_us.p50,
                tier.ttft_us.p99
            );
        }
        for (title, counts) in [
            ("errors", &self.errors),
            ("tiers", &self.tiers),
            ("profiles", &self.profiles),
            ("reasons", &self.reasons),
        ] {
            if !counts.is_empty() {
                let _ = writeln!(out, "{title}: {}", render_counts(counts));
            }
        }
        let a = &self.accounting;
        let _ = writeln!(
            out,
            "answers: sent {} ok {} well-formed errors {} lost {} not sent {}  fallbacks {}  429 with Retry-After {}",
            a.sent, a.ok, a.well_formed_errors, a.lost, a.not_sent, self.fallbacks, self.retry_after_429
        );
        out
    }
}

fn render_counts(counts: &BTreeMap<String, u64>) -> String {
    counts
        .iter()
        .map(|(name, count)| format!("{name}={count}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample(label: &str, p50: u64, throughput_rps: f64) -> RunReport {
        RunReport {
            label: label.to_owned(),
            url: "http://127.0.0.1:8080".to_owned(),
            mode: Mode::Rate,
            rate: Some(200.0),
            concurrency: None,
            duration_s: 15.0,
            warmup_s: 0.0,
            model: "auto".to_owned(),
            endpoint: "chat".to_owned(),
            max_tokens: 16,
            stream_share: 0.0,
            requests: 3000,
            ok: 2999,
            errors: BTreeMap::from([("http_5xx".to_owned(), 1)]),
            throughput_rps,
            latency_us: Summary {
                count: 2999,
                p50,
                p90: p50 * 2,
                p99: p50 * 3,
                p999: p50 * 4,
                max: p50 * 5,
                mean: p50 as f64 * 1.5,
            },
            ttft_us: Summary {
                count: 2999,
                p50: p50 / 2,
                p90: p50,
                p99: p50,
                p999: p50,
                max: p50,
                mean: p50 as f64 / 2.0,
            },
            tiers: BTreeMap::from([("fp16".to_owned(), 2999)]),
            profiles: BTreeMap::new(),
            max_tokens_mix: "16".to_owned(),
            reasons: BTreeMap::new(),
            per_tier: BTreeMap::new(),
            fallbacks: 0,
            retry_after_429: 0,
            accounting: Accounting::default(),
        }
    }

    #[test]
    fn json_has_the_documented_fields() {
        let value = serde_json::to_value(sample("router", 1000, 199.9)).unwrap();
        for field in [
            "label",
            "url",
            "mode",
            "rate",
            "concurrency",
            "duration_s",
            "requests",
            "ok",
            "errors",
            "throughput_rps",
            "latency_us",
            "ttft_us",
            "tiers",
        ] {
            assert!(value.get(field).is_some(), "missing {field}");
        }
        assert_eq!(value["mode"], "rate");
        assert_eq!(value["concurrency"], serde_json::Value::Null);
        assert_eq!(value["errors"]["http_5xx"], 1);
        for field in ["p50", "p90", "p99", "p999", "max", "mean"] {
            assert!(value["latency_us"].get(field).is_some(), "missing {field}");
        }
    }

    #[test]
    fn json_round_trips_through_a_file() {
        let dir = tempfile::Builder::new()
            .prefix("loadtest-report-")
            .tempdir()
            .unwrap();
        // `nested` does not exist yet: `write_json` creates it.
        let path = dir.path().join("nested").join("run.json");
        let report = sample("direct", 800, 200.0);
        report.write_json(&path).unwrap();
        assert_eq!(RunReport::read_json(&path).unwrap(), report);
        dir.close().unwrap();
    }

    #[test]
    fn reads_minimal_json_without_optional_fields() {
        let text = r#"{"label":"x","url":"u","mode":"concurrency","rate":null,"concurrency":4,
            "duration_s":1.0,"requests":1,"ok":1,"errors":{},"throughput_rps":1.0,
            "latency_us":{"p50":1,"p90":1,"p99":1,"p999":1,"max":1,"mean":1.0},
            "ttft_us":{"p50":1,"p90":1,"p99":1,"p999":1,"max":1,"mean":1.0}}"#;
        let report: RunReport = serde_json::from_str(text).unwrap();
        assert_eq!(report.mode, Mode::Concurrency);
        assert!(report.tiers.is_empty());
    }

    #[test]
    fn table_shows_percentiles_errors_and_tiers() {
        let table = sample("router", 1000, 199.9).render_table();
        assert!(table.contains("p99.9"), "{table}");
        assert!(table.contains("http_5xx=1"), "{table}");
        assert!(table.contains("fp16=2999"), "{table}");
    }
}
