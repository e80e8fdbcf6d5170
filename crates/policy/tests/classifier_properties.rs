//! Properties of the classifier that must hold for any input: probabilities are a
//! distribution, a document that fails validation never yields a model, and training is
//! deterministic for a seed.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::OnceLock;

use proptest::prelude::*;
use quantrouter_policy::classifier::{parse_labelled, train, TrainOptions};
use quantrouter_policy::{
    score, Classifier, ClassifierDocument, ComplexityWeights, Prompt, Role, Segment,
    DEFAULT_CLASSIFIER,
};

fn model() -> &'static Classifier {
    static MODEL: OnceLock<Classifier> = OnceLock::new();
    MODEL.get_or_init(|| Classifier::builtin().unwrap())
}

fn document() -> &'static serde_json::Value {
    static DOC: OnceLock<serde_json::Value> = OnceLock::new();
    DOC.get_or_init(|| serde_json::from_str(DEFAULT_CLASSIFIER).unwrap())
}

/// Text from a few bytes to a megabyte: arbitrary Unicode, repeated to size.
fn any_text() -> impl Strategy<Value = String> {
    (
        prop_oneof![
            any::<String>(),
            "[ -~\\n]{1,400}",
            "[\u{0400}-\u{04FF}\u{4E00}-\u{4E80}\u{1F300}-\u{1F6FF} ?.]{1,100}",
        ],
        prop_oneof![4 => 0usize..4096, 1 => 4096usize..(1 << 20)],
    )
        .prop_map(|(unit, len)| {
            let mut text = unit.repeat(len / unit.len().max(1) + 1);
            let mut end = len.min(text.len());
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
            text
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn class_probabilities_are_a_distribution_for_any_text(text in any_text(), json in any::<bool>()) {
        let prompt = Prompt {
            segments: vec![Segment { role: Role::User, text: &text }],
            wants_json: json,
        };
        let (features, classification) = score(&prompt, &ComplexityWeights::default(), Some(model()));
        let Some(c) = classification else {
            prop_assert!(text.trim().is_empty());
            return Ok(());
        };
        for probabilities in [&c.class_probabilities[..], &c.difficulty_probabilities[..]] {
            prop_assert!(probabilities.iter().all(|p| p.is_finite() && (0.0..=1.0).contains(p)), "{c:?}");
            prop_assert!((probabilities.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{c:?}");
        }
        prop_assert!((0.0..=1.0).contains(&c.complexity));
        prop_assert_eq!(features.complexity, c.complexity);
        prop_assert_eq!(features.task_class, c.task_class);
    }

    #[test]
    fn a_changed_weight_or_setting_is_never_accepted(
        field in 0usize..6, value in any::<f64>(), at in any::<prop::sample::Index>()
    ) {
        let mut doc = document().clone();
        match field {
            0 => doc["weights"]["bias"][at.index(8)] = serde_json::json!(value),
            1 => doc["weights"]["dense"][at.index(12)][at.index(8)] = serde_json::json!(value),
            2 => {
                // One character of the base64 table, swapped for another.
                let buckets = doc["weights"]["buckets"].as_str().unwrap().to_owned();
                let i = at.index(buckets.len());
                let swapped = if buckets.as_bytes()[i] == b'A' { "B" } else { "A" };
                doc["weights"]["buckets"] = format!("{}{swapped}{}", &buckets[..i], &buckets[i + 1..]).into();
            }
            3 => doc["weights"]["blend"] = serde_json::json!(value),
            4 => doc["features"]["bits"] = serde_json::json!(at.index(32)),
            _ => doc["sha256"] = serde_json::json!(format!("{:064x}", at.index(usize::MAX))),
        }
        prop_assume!(doc != *document());
        prop_assert!(ClassifierDocument::from_json(&doc.to_string()).is_err());
    }
}

#[test]
fn the_builtin_document_is_valid_and_round_trips() {
    let doc = ClassifierDocument::from_json(DEFAULT_CLASSIFIER).unwrap();
    let again = ClassifierDocument::from_json(&doc.to_json()).unwrap();
    assert_eq!(doc, again);
}

#[test]
fn training_is_deterministic_for_a_seed() {
    let data: String = [
        ("Write a function to reverse a linked list in place.", "heavy", "code"),
        ("Implement quicksort and explain its worst case.", "heavy", "code"),
        ("Write a SQL query that finds duplicate emails.", "heavy", "code"),
        ("A train covers 120 miles in 2 hours. How fast does it go?", "heavy", "math"),
        ("If 3 pens cost $4.50, what do 7 pens cost?", "heavy", "math"),
        ("Solve 2x + 7 = 19 for x and check the answer.", "heavy", "math"),
        ("What is the capital of Peru?", "light", "general"),
        ("Say hello in German.", "light", "general"),
        ("Suggest a name for a cat.", "light", "general"),
        ("Summarise this review: great food, slow service.", "medium", "general"),
        ("Return the names and ages as JSON.", "medium", "structured"),
        ("Why does a heavier object not fall faster?", "heavy", "reasoning"),
    ]
    .iter()
    .cycle()
    .take(60)
    .enumerate()
    .map(|(i, (prompt, label, class))| {
        format!(
            "{}\n",
            serde_json::json!({"id": i.to_string(), "prompt": format!("{prompt} ({i})"), "label": label, "task_class": class})
        )
    })
    .collect();
    let options = |seed| TrainOptions {
        seed,
        bits: 10,
        ..TrainOptions::default()
    };
    let trained = |seed| train(&parse_labelled(&data, seed).unwrap(), &options(seed)).to_json();
    let first = trained(3);
    assert_eq!(first, trained(3));
    assert_ne!(first, trained(4), "the seed holds out other prompts");
    assert!(ClassifierDocument::from_json(&first).is_ok());
}
