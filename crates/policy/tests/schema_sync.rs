//! `profiles/profile-set.schema.json` agrees with the Rust types: every shipped document
//! validates, invalid ones do not, and the schema's property names are exactly the fields
//! the types serialize. `profiles/tenants.schema.json` agrees with the tenant document's
//! types in the same ways, on the tenant corpus.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::PathBuf;

use quantrouter_policy::{
    from_seed_list, ProfileSet, Quality, TenantDocument, DEFAULT_PROFILE_SET,
};
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn schema() -> Value {
    let text = std::fs::read_to_string(repo().join("profiles/profile-set.schema.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn documents() -> Vec<(PathBuf, String)> {
    let mut docs = vec![];
    for dir in ["profiles", "profiles/examples"] {
        for entry in std::fs::read_dir(repo().join(dir)).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if name.ends_with(".json") && !name.contains("schema") {
                docs.push((path.clone(), std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    assert!(docs.len() >= 3, "expected default.json and examples");
    docs
}

#[test]
fn every_shipped_profile_set_validates_against_the_schema_and_the_types() {
    let validator = jsonschema::validator_for(&schema()).unwrap();
    for (path, text) in documents() {
        if quantrouter_policy::looks_like_seed_list(&text) {
            // The seed list converts (with endpoints) into a set that passes the schema.
            let ids: Vec<String> = serde_json::from_str::<Vec<Value>>(&text)
                .unwrap()
                .iter()
                .map(|v| v["model_id"].as_str().unwrap().to_owned())
                .collect();
            let endpoints = ids
                .into_iter()
                .map(|id| (id, "http://127.0.0.1:8000".to_owned()))
                .collect();
            let set = from_seed_list(&text, &endpoints, 1).unwrap();
            let value = serde_json::to_value(&set).unwrap();
            assert!(validator.is_valid(&value), "converted {}", path.display());
            continue;
        }
        let value: Value = serde_json::from_str(&text).unwrap();
        let errors: Vec<String> = validator
            .iter_errors(&value)
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{}: {errors:#?}", path.display());
        ProfileSet::from_json(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}

#[test]
fn schema_rejects_what_the_types_reject() {
    let validator = jsonschema::validator_for(&schema()).unwrap();
    let base: Value = serde_json::from_str(DEFAULT_PROFILE_SET).unwrap();
    let cases: [(&str, Value); 14] = [
        ("/profiles/0/bogus", Value::from(1)),
        ("/profiles/0/quality/default", Value::from(1.5)),
        ("/profiles/0/latency/itl_ms", Value::from(0)),
        ("/policy/mode", Value::from("yolo")),
        (
            "/profiles/0/upstream",
            serde_json::json!({"urls": ["ftp://x"]}),
        ),
        ("/version", Value::from(9_007_199_254_740_992u64)),
        (
            "/profiles/0/upstream",
            serde_json::json!({"service": "a", "api_key_env": "A", "api_key_file": "/k"}),
        ),
        (
            "/profiles/0/upstream",
            serde_json::json!({"urls": ["http://a:1"], "api_key_env": "not a name"}),
        ),
        (
            "/profiles/0/upstream",
            serde_json::json!({"urls": ["http://a:1"], "metrics": {"waiting": "a b"}}),
        ),
        (
            "/profiles/0/upstream",
            serde_json::json!({"urls": ["https://a:1"], "ca_file": " "}),
        ),
        (
            "/profiles/0/upstream",
            serde_json::json!({"urls": ["http://a:1"], "http2": "yes"}),
        ),
        (
            "/profiles/0/upstream",
            serde_json::json!({"urls": ["http://a:1"], "balance": "random"}),
        ),
        (
            "/policy/affinity",
            serde_json::json!({"max_load_factor": 0.5}),
        ),
        (
            "/policy/affinity",
            serde_json::json!({"recompute_weight": 0.5}),
        ),
    ];
    for (pointer, bad) in cases {
        let mut doc = base.clone();
        let (parent, key) = pointer.rsplit_once('/').unwrap();
        doc.pointer_mut(parent)
            .unwrap()
            .as_object_mut()
            .unwrap()
            .insert(key.to_owned(), bad);
        assert!(!validator.is_valid(&doc), "schema accepted {pointer}");
        assert!(
            ProfileSet::from_json(&doc.to_string()).is_err(),
            "types accepted {pointer}"
        );
    }
}

/// Property names of every object in the schema, as JSON-pointer-like paths.
fn schema_paths(schema: &Value, node: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    if let Some(r) = node.get("$ref").and_then(Value::as_str) {
        let target = schema.pointer(r.trim_start_matches('#')).unwrap();
        return schema_paths(schema, target, prefix, out);
    }
    if let Some(variants) = node.get("oneOf").and_then(Value::as_array) {
        for v in variants {
            schema_paths(schema, v, prefix, out);
        }
    }
    if let Some(props) = node.get("properties").and_then(Value::as_object) {
        for (k, v) in props {
            let path = format!("{prefix}/{k}");
            out.insert(path.clone());
            schema_paths(schema, v, &path, out);
        }
    }
    if let Some(items) = node.get("items") {
        schema_paths(schema, items, &format!("{prefix}/*"), out);
    }
}

fn value_paths(node: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match node {
        Value::Object(map) => {
            for (k, v) in map {
                let path = format!("{prefix}/{k}");
                out.insert(path.clone());
                value_paths(v, &path, out);
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
fn schema_property_names_match_the_rust_fields() {
    // A set with every optional field present and both upstream variants.
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    set.updated_at = Some("2026-11-22T00:00:00Z".into());
    set.profiles[0].quality = Quality {
        default: 0.9,
        code: Some(0.9),
        math: Some(0.9),
        structured: Some(0.9),
        reasoning: Some(0.9),
    };
    set.profiles[1].upstream = serde_json::from_str(
        r#"{"urls": ["https://127.0.0.1:1"], "api_key_file": "/k",
            "metrics": {"waiting": "w", "running": "r"}, "ca_file": "/ca.pem", "http2": true,
            "apis": ["chat", "completions", "messages", "responses"],
            "balance": "least_load"}"#,
    )
    .unwrap();
    set.profiles[2].upstream = serde_json::from_str(
        r#"{"service": "s", "api_key_env": "K", "metrics": {"waiting": "w", "running": "r"},
            "resume": false}"#,
    )
    .unwrap();
    set.policy.stream_check = Some(quantrouter_policy::StreamCheck::default());
    set.policy.calibration = Some(quantrouter_policy::Calibration {
        sample_rate: 0.01,
        reference_profile: set.profiles[0].id.clone(),
        max_extra_cost_per_hour: 1.0,
        outcomes: Some(quantrouter_policy::OutcomeSink {
            file: Some("/var/lib/quantrouter/outcomes.jsonl".into()),
            ..Default::default()
        }),
    });
    set.policy.second_opinion = Some(quantrouter_policy::SecondOpinion {
        band: [0.35, 0.65],
        profile: set.profiles[2].id.clone(),
        timeout_ms: 150,
        streams: false,
    });
    set.validate().unwrap();
    let mut from_types = BTreeSet::new();
    value_paths(&serde_json::to_value(&set).unwrap(), "", &mut from_types);
    let schema = schema();
    let mut from_schema = BTreeSet::new();
    schema_paths(&schema, &schema, "", &mut from_schema);
    let only_types: Vec<_> = from_types.difference(&from_schema).collect();
    let only_schema: Vec<_> = from_schema.difference(&from_types).collect();
    assert!(only_types.is_empty() && only_schema.is_empty(),
        "fields missing from the schema: {only_types:?}; schema properties the types lack: {only_schema:?}");
}

#[test]
fn schema_and_types_bound_the_resumes_of_a_stream() {
    let validator = jsonschema::validator_for(&schema()).unwrap();
    let mut doc: Value = serde_json::from_str(DEFAULT_PROFILE_SET).unwrap();
    for (max_resumes, valid) in [(0, true), (3, true), (4, false)] {
        doc["policy"]["stream_resume"] = serde_json::json!({ "max_resumes": max_resumes });
        assert_eq!(validator.is_valid(&doc), valid, "schema, {max_resumes}");
        let typed = ProfileSet::from_json(&doc.to_string());
        assert_eq!(typed.is_ok(), valid, "types, {max_resumes}");
    }
}

// === the tenant document ===

fn tenant_schema() -> Value {
    let text = std::fs::read_to_string(repo().join("profiles/tenants.schema.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The tenant corpus in the stored format (`push-` documents carry plain keys, which only
/// `tenants push` reads), by name.
fn tenant_corpus() -> Vec<(String, String)> {
    let dir = repo().join("crates/policy/tests/corpus/tenants");
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
fn the_tenant_schema_accepts_the_valid_corpus_and_refuses_the_invalid() {
    let validator = jsonschema::validator_for(&tenant_schema()).unwrap();
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
    for (name, text) in tenant_corpus() {
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

#[test]
fn tenant_schema_property_names_match_the_rust_fields() {
    let hash = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
    let full = serde_json::json!({"version": 1, "updated_at": "2026-11-22T00:00:00Z", "tenants": [{
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
    let schema = tenant_schema();
    schema_paths(&schema, &schema, "", &mut from_schema);
    assert_eq!(from_schema, from_types);
    assert!(jsonschema::validator_for(&schema)
        .unwrap()
        .is_valid(&written));
}
