//! The routing quality bar on the shared prompt mix: heavy prompts almost never land on the
//! cheapest profile, most light prompts do.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use quantrouter_policy::{audit, ProfileSet, DEFAULT_PROFILE_SET};

fn prompt_mix() -> String {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/eval/prompt-mix.jsonl");
    std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "read {}: {e} (the shared/ folder sits beside the repo)",
            path.display()
        )
    })
}

#[test]
fn default_profiles_route_heavy_prompts_off_the_cheapest_tier() {
    let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    let report = audit(&set, &prompt_mix()).unwrap();
    println!("{report}");
    let cheapest = set
        .profiles
        .iter()
        .min_by(|a, b| {
            a.cost_per_1m_output_tokens
                .total_cmp(&b.cost_per_1m_output_tokens)
        })
        .unwrap();
    let heavy = report.share("heavy", &cheapest.id);
    let light = report.share("light", &cheapest.id);
    assert!(report.labels["heavy"].total >= 100 && report.labels["light"].total >= 100);
    assert!(
        heavy <= 0.05,
        "{:.1}% of heavy prompts on {}",
        heavy * 100.0,
        cheapest.id
    );
    assert!(
        light >= 0.70,
        "only {:.1}% of light prompts on {}",
        light * 100.0,
        cheapest.id
    );
    for stats in report.labels.values() {
        assert!(
            stats.cost <= stats.default_cost,
            "routing must not cost more than the default"
        );
    }
}
