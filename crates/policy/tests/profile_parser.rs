//! The profile-set parsers never panic, and what they accept survives a round trip.
//!
//! Three kinds of input: arbitrary JSON (objects keyed by the real field names, so some get
//! deep), valid documents with random mutations, and the regression corpus in
//! `tests/corpus/profile-set/` (`valid-*` must parse, `invalid-*` must be refused). An input
//! that once broke a parser goes into the corpus, so every `cargo test` replays it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use proptest::prelude::*;
use quantrouter_policy::{
    from_seed_list, looks_like_seed_list, ProfileSet, ProfileSetError, DEFAULT_PROFILE_SET,
};
use serde_json::{Map, Value};

/// Field names of both document formats, so generated objects reach past the first
/// unknown-field check.
const FIELDS: &[&str] = &[
    "version",
    "updated_at",
    "default_profile",
    "policy",
    "profiles",
    "weights",
    "quality",
    "latency",
    "cost",
    "latency_budget_ms",
    "expected_output_tokens",
    "required_quality",
    "base",
    "max",
    "complexity",
    "entropy",
    "lexical",
    "code",
    "math",
    "json",
    "numeric",
    "length",
    "scoring_window_chars",
    "quality_fallback",
    "enabled",
    "max_repetition_ratio",
    "mode",
    "canary_percent",
    "id",
    "model",
    "quantization",
    "tier",
    "upstream",
    "service",
    "namespace",
    "port",
    "urls",
    "api_key_env",
    "api_key_file",
    "metrics",
    "waiting",
    "running",
    "cost_per_1m_input_tokens",
    "cost_per_1m_output_tokens",
    "ttft_ms",
    "itl_ms",
    "default",
    "structured",
    "max_context_tokens",
    "max_concurrency",
    "chars_per_token",
    "cold_start_timeout_ms",
    "model_id",
    "cost_per_1m_tokens",
    "predicted_latency_ms",
    "accuracy_score",
    "min_gpu_vram_gb",
];

fn any_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        prop::num::f64::NORMAL.prop_map(Value::from),
        (0u64..2, 0u64..1_000_000).prop_map(|(sign, n)| Value::from(if sign == 0 {
            n as f64 / 1000.0
        } else {
            -(n as f64)
        })),
        Just(Value::from(9_007_199_254_740_991u64)),
        Just(Value::from(9_007_199_254_740_992u64)),
    ]
}

fn any_string() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(FIELDS).prop_map(str::to_owned),
        any::<String>(),
        "http://[a-z0-9.:\\[\\]@]{0,20}(/[a-z]{0,5})?",
        Just("llama8b-fp16".to_owned()),
        Just("enforce".to_owned()),
    ]
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any_number(),
        any_string().prop_map(Value::from),
    ];
    leaf.prop_recursive(6, 128, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((any_string(), inner), 0..8)
                .prop_map(|entries| Value::Object(entries.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// One change to a document: at a path chosen by `steps`, remove the member, replace it,
/// or add an unknown one.
#[derive(Debug, Clone)]
enum Mutation {
    Remove,
    Replace(Value),
    AddUnknown(String, Value),
}

fn mutation() -> impl Strategy<Value = (Vec<usize>, Mutation)> {
    let change = prop_oneof![
        Just(Mutation::Remove),
        any_json().prop_map(Mutation::Replace),
        any_number().prop_map(Mutation::Replace),
        (any_string(), any_json()).prop_map(|(k, v)| Mutation::AddUnknown(k, v)),
    ];
    (prop::collection::vec(any::<usize>(), 1..6), change)
}

fn mutate(doc: &mut Value, steps: &[usize], change: Mutation) {
    let (last, walk) = steps.split_last().unwrap();
    let mut node = doc;
    for &step in walk {
        // Which child to descend into, decided before borrowing it mutably.
        let key = match &*node {
            Value::Object(map) if !map.is_empty() => map.keys().nth(step % map.len()).cloned(),
            _ => None,
        };
        let index = match &*node {
            Value::Array(items) if !items.is_empty() => Some(step % items.len()),
            _ => None,
        };
        let container = |v: &Value| v.is_object() || v.is_array();
        let descend = match (&key, index) {
            (Some(k), _) => node.get(k).is_some_and(container),
            (None, Some(i)) => node.get(i).is_some_and(container),
            (None, None) => false,
        };
        if !descend {
            break;
        }
        node = match (key, index) {
            (Some(k), _) => &mut node[k.as_str()],
            (None, Some(i)) => &mut node[i],
            (None, None) => unreachable!(),
        };
    }
    match (node, change) {
        (Value::Object(map), Mutation::AddUnknown(key, value)) => {
            map.insert(key, value);
        }
        (Value::Object(map), change) if !map.is_empty() => {
            let key = map.keys().nth(last % map.len()).unwrap().clone();
            match change {
                Mutation::Remove => {
                    map.remove(&key);
                }
                Mutation::Replace(value) => {
                    map.insert(key, value);
                }
                Mutation::AddUnknown(..) => {}
            }
        }
        (Value::Array(items), change) if !items.is_empty() => {
            let i = last % items.len();
            match change {
                Mutation::Remove => {
                    items.remove(i);
                }
                Mutation::Replace(value) => items[i] = value,
                Mutation::AddUnknown(_, value) => items.push(value),
            }
        }
        _ => {}
    }
}

/// Two documents are the same up to float parsing: serde_json's default float parser may
/// land one unit in the last place away from what it printed.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_f64(), y.as_f64()) {
            _ if x == y => true,
            (Some(x), Some(y)) => (x - y).abs() <= 1e-12 * x.abs().max(y.abs()),
            _ => false,
        },
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

/// Endpoints for seed lists: one for each model the tests use.
fn seed_endpoints() -> BTreeMap<String, String> {
    ["llama8b-fp16", "model_id", "id"]
        .into_iter()
        .map(|m| (m.to_owned(), "http://127.0.0.1:8000".to_owned()))
        .collect()
}

/// Parses `text` in the format it looks like; anything accepted validates and round-trips.
fn parse_and_round_trip(text: &str) -> Result<ProfileSet, ProfileSetError> {
    let parsed = if looks_like_seed_list(text) {
        from_seed_list(text, &seed_endpoints(), 1)
    } else {
        ProfileSet::from_json(text)
    };
    if let Ok(set) = &parsed {
        if let Err(errors) = set.validate() {
            panic!("accepted but invalid: {errors}\n{text}");
        }
        let written = serde_json::to_string(set).unwrap();
        let again = ProfileSet::from_json(&written)
            .unwrap_or_else(|e| panic!("accepted {text}\nbut not its own output {written}: {e}"));
        let (a, b) = (
            serde_json::to_value(set).unwrap(),
            serde_json::to_value(&again).unwrap(),
        );
        assert!(same(&a, &b), "round trip changed\n{a}\ninto\n{b}");
    }
    parsed
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_json_never_panics(doc in any_json()) {
        let _ = parse_and_round_trip(&doc.to_string());
    }

    #[test]
    fn arbitrary_text_never_panics(text in any::<String>()) {
        let _ = parse_and_round_trip(&text);
    }

    #[test]
    fn mutated_documents_never_panic_and_round_trip(
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let mut doc: Value = serde_json::from_str(DEFAULT_PROFILE_SET).unwrap();
        for (steps, change) in mutations {
            mutate(&mut doc, &steps, change);
        }
        let _ = parse_and_round_trip(&doc.to_string());
    }

    #[test]
    fn mutated_seed_lists_never_panic(
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let mut doc = serde_json::json!([{"model_id": "llama8b-fp16", "quantization": "FP16",
            "cost_per_1m_tokens": 0.3, "predicted_latency_ms": 900, "accuracy_score": 0.95,
            "min_gpu_vram_gb": 16}]);
        for (steps, change) in mutations {
            mutate(&mut doc, &steps, change);
        }
        let _ = parse_and_round_trip(&doc.to_string());
    }
}

#[test]
fn the_regression_corpus_replays() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/profile-set");
    let mut replayed = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).unwrap();
        let result = parse_and_round_trip(&text);
        if name.starts_with("valid-") {
            assert!(result.is_ok(), "{name} was refused: {:?}", result.err());
        } else if name.starts_with("invalid-") {
            assert!(result.is_err(), "{name} was accepted");
        } else {
            panic!("{name}: corpus files are named valid-* or invalid-*");
        }
        replayed += 1;
    }
    assert!(replayed >= 20, "only {replayed} corpus files");
}
