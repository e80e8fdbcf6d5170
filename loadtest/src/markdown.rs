//! Markdown tables of runs for `docs/performance.md`: the first run is the baseline that the
//! ratios and added latencies refer to.

use std::fmt::Write as _;

use crate::compare::compare;
use crate::report::{Mode, RunReport};
use crate::stats::Accounting;

/// The availability objective the chaos scenario's error budget is measured against: 99% of
/// requests answered with a 2xx, so the budget is 1% of the requests sent.
pub const SLO_SUCCESS: f64 = 0.99;

/// Throughput, latency and TTFT per run, with ratios and added latency against `runs[0]`.
pub fn runs_table(runs: &[RunReport]) -> String {
    let mut out = String::new();
    let Some(baseline) = runs.first() else {
        return out;
    };
    out.push_str(
        "| run | load | ok / sent | throughput | × baseline | p50 | p99 | added p50 | added p99 | TTFT p50 | TTFT p99 | errors |\n",
    );
    out.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for run in runs {
        let comparison = compare(baseline, run);
        let ratio = comparison
            .throughput_ratio
            .map_or_else(|| "n/a".to_owned(), |r| format!("{:.1}%", r * 100.0));
        let (added_p50, added_p99) = if std::ptr::eq(run, baseline) {
            ("—".to_owned(), "—".to_owned())
        } else {
            (
                signed_ms(comparison.added_latency_us.p50),
                signed_ms(comparison.added_latency_us.p99),
            )
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} / {} | {:.0} req/s | {ratio} | {} | {} | {added_p50} | {added_p99} | {} | {} | {} |",
            run.label,
            load(run),
            run.ok,
            run.requests,
            run.throughput_rps,
            ms(run.latency_us.p50),
            ms(run.latency_us.p99),
            ms(run.ttft_us.p50),
            ms(run.ttft_us.p99),
            errors(run),
        );
    }
    out
}

/// Did every request get exactly one well-formed answer, and how much error budget was used.
pub fn answers_table(runs: &[RunReport]) -> String {
    let mut out = String::new();
    out.push_str("| run | sent | ok | well-formed errors | lost | not sent | 429 with Retry-After | fallbacks | error budget used (SLO 99%) |\n");
    out.push_str("|---|---|---|---|---|---|---|---|---|\n");
    for run in runs {
        let a = &run.accounting;
        let budget = error_budget_used(a, SLO_SUCCESS)
            .map_or_else(|| "n/a".to_owned(), |used| format!("{:.0}%", used * 100.0));
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | **{}** | {} | {} | {} | {budget} |",
            run.label,
            a.sent,
            a.ok,
            a.well_formed_errors,
            a.lost,
            a.not_sent,
            run.retry_after_429,
            run.fallbacks
        );
    }
    out
}

/// Tier mix and per-tier latency of each run that has tier headers.
pub fn tiers_table(runs: &[RunReport]) -> String {
    let mut out = String::new();
    out.push_str("| run | tier | share of answers | p50 | p99 | TTFT p50 | TTFT p99 |\n");
    out.push_str("|---|---|---|---|---|---|---|\n");
    for run in runs {
        let total: u64 = run.tiers.values().sum();
        for (tier, count) in &run.tiers {
            let summary = run.per_tier.get(tier).copied().unwrap_or_default();
            let _ = writeln!(
                out,
                "| {} | {tier} | {:.1}% ({count}) | {} | {} | {} | {} |",
                run.label,
                share(*count, total) * 100.0,
                ms(summary.latency_us.p50),
                ms(summary.latency_us.p99),
                ms(summary.ttft_us.p50),
                ms(summary.ttft_us.p99),
            );
        }
    }
    out
}

/// What holding the start of streams costs: per tier, the TTFT of the same streams through
/// a router without the stream-start check and through one with it, and the difference.
pub fn stream_check_table(plain: &RunReport, checked: &RunReport) -> String {
    let mut out = String::new();
    out.push_str(
        "| tier | streams without / with | TTFT p50 without | with | added p50 | TTFT p99 without | with | added p99 |\n",
    );
    out.push_str("|---|---|---|---|---|---|---|---|\n");
    for (tier, count) in &checked.tiers {
        let before = plain.per_tier.get(tier).copied().unwrap_or_default();
        let after = checked.per_tier.get(tier).copied().unwrap_or_default();
        let added = |a: u64, b: u64| signed_ms(b as i64 - a as i64);
        let _ = writeln!(
            out,
            "| {tier} | {} / {count} | {} | {} | {} | {} | {} | {} |",
            plain.tiers.get(tier).copied().unwrap_or_default(),
            ms(before.ttft_us.p50),
            ms(after.ttft_us.p50),
            added(before.ttft_us.p50, after.ttft_us.p50),
            ms(before.ttft_us.p99),
            ms(after.ttft_us.p99),
            added(before.ttft_us.p99, after.ttft_us.p99),
        );
    }
    out
}

/// Share of the error budget used: failed requests (well-formed errors and lost ones) over
/// the failures the objective allows; `None` when nothing was sent.
pub fn error_budget_used(accounting: &Accounting, slo_success: f64) -> Option<f64> {
    if accounting.sent == 0 {
        return None;
    }
    let failed = (accounting.well_formed_errors + accounting.lost) as f64;
    let allowed = accounting.sent as f64 * (1.0 - slo_success);
    (allowed > 0.0).then(|| failed / allowed)
}

/// `part / total`, 0 when `total` is 0.
pub fn share(part: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        part as f64 / total as f64
    }
}

fn load(run: &RunReport) -> String {
    let shape = match run.mode {
        Mode::Rate => format!("{} req/s", run.rate.unwrap_or_default()),
        Mode::Concurrency => format!("{} clients", run.concurrency.unwrap_or_default()),
    };
    if run.stream_share > 0.0 {
        format!("{shape}, {:.0}% streamed", run.stream_share * 100.0)
    } else {
        shape
    }
}

fn errors(run: &RunReport) -> String {
    if run.errors.is_empty() {
        return "0".to_owned();
    }
    run.errors
        .iter()
        .map(|(kind, count)| format!("{kind} {count}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Microseconds as milliseconds with three decimals.
pub fn ms(us: u64) -> String {
    format!("{:.3} ms", us as f64 / 1000.0)
}

/// A signed difference in microseconds as milliseconds with three decimals.
pub fn signed_ms(us: i64) -> String {
    format!("{:+.3} ms", us as f64 / 1000.0)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::report::tests::sample;
    use crate::stats::{Summary, TierSummary};

    #[test]
    fn stream_check_table_gives_the_added_ttft_per_tier() {
        let tier = |ttft: u64| TierSummary {
            latency_us: Summary::default(),
            ttft_us: Summary {
                count: 10,
                p50: ttft,
                p99: 2 * ttft,
                ..Summary::default()
            },
        };
        let mut plain = sample("plain", 100, 1_000.0);
        plain.tiers = BTreeMap::from([("int4".to_owned(), 9)]);
        plain.per_tier = BTreeMap::from([("int4".to_owned(), tier(20_000))]);
        let mut checked = plain.clone();
        checked.tiers = BTreeMap::from([("int4".to_owned(), 10)]);
        checked.per_tier = BTreeMap::from([("int4".to_owned(), tier(68_000))]);
        let table = stream_check_table(&plain, &checked);
        let row = table.lines().nth(2).unwrap();
        assert_eq!(
            row,
            "| int4 | 9 / 10 | 20.000 ms | 68.000 ms | +48.000 ms | 40.000 ms | 136.000 ms | +96.000 ms |"
        );
    }

    #[test]
    fn runs_table_gives_ratios_and_added_latency_against_the_first_run() {
        let direct = sample("direct", 400, 40_000.0);
        let router = sample("router", 900, 12_000.0);
        let table = runs_table(&[direct, router]);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4, "{table}");
        assert!(
            lines[2].contains("| direct |") && lines[2].contains("| 100.0% |"),
            "{table}"
        );
        assert!(lines[3].contains("| 30.0% |"), "{table}");
        assert!(lines[3].contains("| +0.500 ms | +1.500 ms |"), "{table}");
        assert!(lines[3].contains("http_5xx 1"), "{table}");
    }

    #[test]
    fn error_budget_counts_errors_and_lost_against_the_allowance() {
        let accounting = Accounting {
            sent: 10_000,
            ok: 9_950,
            well_formed_errors: 40,
            lost: 10,
            not_sent: 3,
        };
        let used = error_budget_used(&accounting, 0.99).unwrap();
        assert!((used - 0.5).abs() < 1e-9, "{used}");
        assert_eq!(error_budget_used(&Accounting::default(), 0.99), None);
        assert_eq!(error_budget_used(&accounting, 1.0), None);
    }

    #[test]
    fn tiers_table_shows_shares_and_per_tier_ttft() {
        let mut run = sample("router", 900, 100.0);
        run.tiers = BTreeMap::from([("fp16".to_owned(), 25), ("int4".to_owned(), 75)]);
        run.per_tier = BTreeMap::from([(
            "int4".to_owned(),
            TierSummary {
                latency_us: Summary::default(),
                ttft_us: Summary {
                    p99: 41_000,
                    ..Summary::default()
                },
            },
        )]);
        let table = tiers_table(&[run]);
        assert!(table.contains("| int4 | 75.0% (75) |"), "{table}");
        assert!(table.contains("| 41.000 ms |"), "{table}");
        assert!(table.contains("| fp16 | 25.0% (25) |"), "{table}");
    }
}
