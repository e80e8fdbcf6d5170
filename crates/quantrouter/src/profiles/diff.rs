//! A readable, profile-level diff between two profile sets.

use quantrouter_policy::ProfileSet;
use serde_json::Value;

/// Lines describing how `new` differs from `old`: `+ id` added, `- id` removed,
/// `~ path: old -> new` changed. Empty when they are the same apart from the version.
pub fn diff(old: &ProfileSet, new: &ProfileSet) -> Vec<String> {
    let mut lines = Vec::new();
    let (old_v, new_v) = (to_value(old), to_value(new));
    for key in ["default_profile", "policy"] {
        changed_fields(key, &old_v[key], &new_v[key], &mut lines);
    }
    for p in &old.profiles {
        if new.profile(&p.id).is_none() {
            lines.push(format!("- {}", p.id));
        }
    }
    for p in &new.profiles {
        match old.profile(&p.id) {
            None => lines.push(format!("+ {}", p.id)),
            Some(before) => {
                let (b, a) = (to_value(before), to_value(p));
                changed_fields(&p.id, &b, &a, &mut lines);
            }
        }
    }
    lines
}

fn to_value<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// Recurses into objects so a change names its leaf field.
pub(crate) fn changed_fields(path: &str, old: &Value, new: &Value, lines: &mut Vec<String>) {
    if old == new {
        return;
    }
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            let mut keys: Vec<&String> = o.keys().chain(n.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let child = format!("{path}.{k}");
                changed_fields(
                    &child,
                    o.get(k).unwrap_or(&Value::Null),
                    n.get(k).unwrap_or(&Value::Null),
                    lines,
                );
            }
        }
        _ => lines.push(format!("~ {path}: {old} -> {new}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quantrouter_policy::DEFAULT_PROFILE_SET;

    #[test]
    fn names_added_removed_and_changed_fields() {
        let old = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
        let mut new = old.clone();
        new.version = 9;
        assert!(
            diff(&old, &new).is_empty(),
            "a version bump alone is no change"
        );
        new.profiles[0].latency.itl_ms = 11.0;
        new.policy.weights.cost = 0.4;
        let removed = new.profiles.remove(2);
        let mut added = removed.clone();
        added.id = "llama8b-gptq".into();
        new.profiles.push(added);
        let lines = diff(&old, &new);
        assert_eq!(
            lines,
            vec![
                "~ policy.weights.cost: 0.5 -> 0.4".to_owned(),
                "- llama8b-awq".to_owned(),
                "~ llama8b-fp16.latency.itl_ms: 12.0 -> 11.0".to_owned(),
                "+ llama8b-gptq".to_owned(),
            ]
        );
    }
}
