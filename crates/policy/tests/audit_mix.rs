//! The routing audit on the repository's prompt mix: heavy prompts almost never land on the
//! cheapest profile, most light prompts do, with the classifier and without it.
//!
//! Most of this mix is in the built-in model's training data; `tests/classifier.rs` holds
//! the out-of-sample checks (leave-one-source-out).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use quantrouter_policy::{audit, AuditReport, Classifier, ProfileSet, DEFAULT_PROFILE_SET};

fn prompt_mix() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../eval/prompt-mix.jsonl");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn shares(set: &ProfileSet, report: &AuditReport) -> (f64, f64) {
    let cheapest = &set.cheapest().id;
    assert!(report.labels["heavy"].total >= 100 && report.labels["light"].total >= 100);
    for stats in report.labels.values() {
        assert!(
            stats.cost <= stats.default_cost,
            "routing must not cost more than the default"
        );
    }
    (
        report.share("heavy", cheapest),
        report.share("light", cheapest),
    )
}

#[test]
fn default_profiles_route_heavy_prompts_off_the_cheapest_tier() {
    let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    let model = Classifier::builtin().unwrap();
    let report = audit(&set, Some(&model), &prompt_mix()).unwrap();
    println!("{report}");
    let (heavy, light) = shares(&set, &report);
    assert!(
        heavy <= 0.03,
        "{:.1}% of heavy prompts on the cheapest",
        heavy * 100.0
    );
    assert!(
        light >= 0.80,
        "only {:.1}% of light prompts on the cheapest",
        light * 100.0
    );
    // Prompts without a labelled class are counted under the class they were given.
    assert!(report.task_classes.contains_key("code"), "{report}");
    assert!(report.task_classes.contains_key("math"), "{report}");
}

#[test]
fn the_structural_score_alone_still_separates_the_mix() {
    let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    let report = audit(&set, None, &prompt_mix()).unwrap();
    let (heavy, light) = shares(&set, &report);
    assert!(
        heavy <= 0.05,
        "{:.1}% of heavy prompts on the cheapest",
        heavy * 100.0
    );
    assert!(
        light >= 0.70,
        "only {:.1}% of light prompts on the cheapest",
        light * 100.0
    );
}
