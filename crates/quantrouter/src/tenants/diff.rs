//! A readable, tenant-level diff between two tenant documents: what `tenants diff` prints.
//! Keys appear only as the first characters of their hash.

use quantrouter_policy::TenantDocument;
use serde_json::Value;

use super::HASH_PREFIX_CHARS;
use crate::profiles::diff::changed_fields;

/// Lines describing how `new` differs from `old`: `+ id` added, `- id` removed,
/// `~ id.path: old -> new` changed, `+ id key 1a2b3c4d…` / `- id key …` for keys. Empty when
/// they are the same apart from the version.
pub fn diff(old: &TenantDocument, new: &TenantDocument) -> Vec<String> {
    let mut lines = Vec::new();
    for t in &old.tenants {
        if new.tenant(&t.id).is_none() {
            lines.push(format!("- {}", t.id));
        }
    }
    for t in &new.tenants {
        let Some(before) = old.tenant(&t.id) else {
            lines.push(format!("+ {} ({} keys)", t.id, t.key_sha256.len()));
            continue;
        };
        let (mut b, mut a) = (to_value(before), to_value(t));
        for v in [&mut b, &mut a] {
            if let Value::Object(map) = v {
                map.remove("key_sha256");
            }
        }
        changed_fields(&t.id, &b, &a, &mut lines);
        for hash in &before.key_sha256 {
            if !t.key_sha256.contains(hash) {
                lines.push(format!("- {} key {}…", t.id, prefix(hash)));
            }
        }
        for hash in &t.key_sha256 {
            if !before.key_sha256.contains(hash) {
                lines.push(format!("+ {} key {}…", t.id, prefix(hash)));
            }
        }
    }
    lines
}

fn prefix(hash: &str) -> &str {
    hash.get(..HASH_PREFIX_CHARS).unwrap_or(hash)
}

fn to_value<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use quantrouter_policy::hash_key;

    fn doc(text: &str) -> TenantDocument {
        TenantDocument::from_push_json(text).unwrap()
    }

    #[test]
    fn names_tenants_fields_and_key_prefixes_never_keys() {
        let old = doc(r#"{"version": 1, "tenants": [
                {"id": "a", "keys": ["sk-a-1"], "limits": {"requests_per_minute": 60}},
                {"id": "b", "keys": ["sk-b-1"]}]}"#);
        let mut new = doc(r#"{"version": 2, "tenants": [
                {"id": "a", "keys": ["sk-a-2"], "limits": {"requests_per_minute": 120},
                 "priority": 5},
                {"id": "c", "keys": ["sk-c-1", "sk-c-2"]}]}"#);
        let lines = diff(&old, &new);
        let (gone, added) = (&hash_key("sk-a-1")[..8], &hash_key("sk-a-2")[..8]);
        assert_eq!(
            lines,
            vec![
                "- b".to_owned(),
                "~ a.limits.requests_per_minute: 60 -> 120".to_owned(),
                "~ a.priority: 0 -> 5".to_owned(),
                format!("- a key {gone}…"),
                format!("+ a key {added}…"),
                "+ c (2 keys)".to_owned(),
            ]
        );
        assert!(lines.iter().all(|l| !l.contains("sk-")));
        new = old.clone();
        new.version = 9;
        assert!(diff(&old, &new).is_empty());
    }
}
