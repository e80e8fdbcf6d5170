//! `profiles/tenants.schema.json` agrees with the tenant document's Rust types: the corpus's
//! valid documents validate, its invalid ones are refused by the schema too (but for the
//! rules a schema cannot state), and the schema's property names are the fields the types
//! serialize.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::PathBuf;

use quantrouter_policy::TenantDocument;
use serde_json::{json, Value};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn validator() -> jsonschema::Validator {
    let path = crate_dir().join("../../profiles/tenants.schema.json");
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    jsonschema::validator_for(&schema).unwrap()
}

/// Corpus documents of the stored format (`push-` ones carry plain keys, which only
/// `tenants push` reads), by name.
fn corpus() -> Vec<(String, String)> {
    let dir = crate_dir().join("tests/corpus/tenants");
    let mut docs: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&path).unwrap())
        })
        .filter(|(name, _)| !name.contains("push-"))
        .collect();
    docs.sort();
    docs
}

#[test]
fn the_schema_accepts_the_valid_corpus_and_refuses_the_invalid() {
    let validator = validator();
    // Rules across items (unique ids and keys) and of the text itself (trailing bytes,
    // nesting depth, a number past u64) are the parser's alone.
    let beyond_a_schema = [
        "invalid-duplicate-id.json",
        "invalid-duplicate-key-across-tenants.json",
        "invalid-trailing-bytes.json",
        "invalid-deep-nesting.json",
        "invalid-number-overflow.json",
    ];
    let mut checked = 0;
    for (name, text) in corpus() {
        let valid = name.starts_with("valid-");
        assert_eq!(TenantDocument::from_json(&text).is_ok(), valid, "{name}");
        let Ok(value) = serde_json::from_str::<Value>(&text) else {
            assert!(
                beyond_a_schema.contains(&name.as_str()),
                "{name} is no JSON"
            );
            continue;
        };
        let errors: Vec<String> = validator
            .iter_errors(&value)
            .map(|e| e.to_string())
            .collect();
        match (valid, errors.is_empty()) {
            (true, ok) => assert!(ok, "{name}: {errors:#?}"),
            (false, true) => {
                assert!(
                    beyond_a_schema.contains(&name.as_str()),
                    "the schema accepts {name}"
                )
            }
            (false, false) => {}
        }
        checked += 1;
    }
    assert!(checked >= 30, "only {checked} corpus documents");
}

fn paths(node: &Value, schema: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    if let Some(r) = node.get("$ref").and_then(Value::as_str) {
        let target = schema.pointer(r.trim_start_matches('#')).unwrap();
        return paths(target, schema, prefix, out);
    }
    if let Some(props) = node.get("properties").and_then(Value::as_object) {
        for (k, v) in props {
            out.insert(format!("{prefix}/{k}"));
            paths(v, schema, &format!("{prefix}/{k}"), out);
        }
    }
    if let Some(items) = node.get("items") {
        paths(items, schema, &format!("{prefix}/*"), out);
    }
}

fn value_paths(node: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match node {
        Value::Object(map) => {
            for (k, v) in map {
                out.insert(format!("{prefix}/{k}"));
                value_paths(v, &format!("{prefix}/{k}"), out);
            }
        }
        Value::Array(items) if items.first().is_some_and(Value::is_object) => {
            for v in items {
                value_paths(v, &format!("{prefix}/*"), out);
            }
        }
        _ => {}
    }
}

#[test]
fn the_schemas_property_names_are_the_rust_fields() {
    let hash = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
    let full = json!({"version": 1, "updated_at": "2026-11-22T00:00:00Z", "tenants": [{
        "id": "team-a", "key_sha256": [hash],
        "limits": {"requests_per_minute": 60, "tokens_per_minute": 1000, "budget_per_day": 1.0,
                   "budget_per_month": 10.0, "soft_limit": 0.8},
        "min_quality": 0.9, "risk_tolerance": 0.1, "allowed_profiles": ["p"], "priority": 1,
        "prefix_cache": "isolated"}]});
    // What the types write back is what went in: every field is in `full`.
    let doc = TenantDocument::from_json(&full.to_string()).unwrap();
    let written = serde_json::to_value(&doc).unwrap();
    assert_eq!(written, full);
    let (mut from_types, mut from_schema) = (BTreeSet::new(), BTreeSet::new());
    value_paths(&written, "", &mut from_types);
    let path = crate_dir().join("../../profiles/tenants.schema.json");
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    paths(&schema, &schema, "", &mut from_schema);
    assert_eq!(from_schema, from_types);
    assert!(validator().is_valid(&written));
}
