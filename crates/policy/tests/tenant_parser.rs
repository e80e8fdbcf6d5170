//! The tenant-document parsers never panic, and what they accept survives a round trip.
//!
//! Three kinds of input: arbitrary JSON (objects keyed by the real field names, so some get
//! deep), valid documents with random mutations, and the regression corpus in
//! `tests/corpus/tenants/` (`valid-*` must parse, `invalid-*` must be refused). An input that
//! once broke a parser goes into the corpus, so every `cargo test` replays it. Documents with
//! plain `keys` go through the push parser, the rest through the stored format's.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use proptest::prelude::*;
use quantrouter_policy::{hash_key, TenantDocument, TenantError};
use serde_json::{Map, Value};

/// Field names of the document (and of its push format), so generated objects reach past
/// the first unknown-field check.
const FIELDS: &[&str] = &[
    "version",
    "updated_at",
    "tenants",
    "id",
    "key_sha256",
    "keys",
    "limits",
    "requests_per_minute",
    "tokens_per_minute",
    "budget_per_day",
    "budget_per_month",
    "soft_limit",
    "min_quality",
    "risk_tolerance",
    "allowed_profiles",
    "priority",
    "prefix_cache",
    "shared",
    "isolated",
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
        "[0-9a-f]{64}",
        "[ -~]{0,8}",
        Just(hash_key("sk-team-a-1")),
        Just("team-a".to_owned()),
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

/// A valid document in the push format: limits, routing bounds, hashes and plain keys.
fn base_document() -> Value {
    serde_json::json!({"version": 1, "tenants": [
        {"id": "team-a", "key_sha256": [hash_key("sk-team-a-1")],
         "limits": {"requests_per_minute": 60, "tokens_per_minute": 20000,
                    "budget_per_day": 5.0, "budget_per_month": 100.0, "soft_limit": 0.8},
         "min_quality": 0.85, "allowed_profiles": ["llama8b-fp8"], "priority": 10},
        {"id": "batch.jobs", "keys": ["sk-batch-1"], "limits": {"budget_per_month": 50.0}}
    ]})
}

/// Whether a tenant lists plain `keys`: the push format.
fn looks_like_push(text: &str) -> bool {
    serde_json::from_str::<Value>(text).is_ok_and(|doc| {
        doc["tenants"]
            .as_array()
            .is_some_and(|tenants| tenants.iter().any(|t| t.get("keys").is_some()))
    })
}

/// Parses `text` in the format it looks like; anything accepted validates, holds no plain
/// key, and round-trips through the stored format.
fn parse_and_round_trip(text: &str) -> Result<TenantDocument, TenantError> {
    let parsed = if looks_like_push(text) {
        TenantDocument::from_push_json(text)
    } else {
        TenantDocument::from_json(text)
    };
    if let Ok(doc) = &parsed {
        if let Err(errors) = doc.validate() {
            panic!("accepted but invalid: {errors}\n{text}");
        }
        assert!(doc.tenants.iter().all(|t| t.keys.is_empty()), "{text}");
        let written = serde_json::to_string(doc).unwrap();
        let again = TenantDocument::from_json(&written)
            .unwrap_or_else(|e| panic!("accepted {text}\nbut not its own output {written}: {e}"));
        let (a, b) = (
            serde_json::to_value(doc).unwrap(),
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
        let mut doc = base_document();
        for (steps, change) in mutations {
            mutate(&mut doc, &steps, change);
        }
        let _ = parse_and_round_trip(&doc.to_string());
    }
}

#[test]
fn the_base_document_is_valid() {
    parse_and_round_trip(&base_document().to_string()).unwrap();
}

#[test]
fn the_regression_corpus_replays() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/tenants");
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
    assert!(replayed >= 30, "only {replayed} corpus files");
}
