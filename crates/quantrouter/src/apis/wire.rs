//! The pieces of the agent APIs' wire formats that both translations use: what refuses a
//! translation, the text of a content field, and Anthropic's error object. A leaf, so the
//! translations and the module that chooses between them do not import each other.

use serde_json::{json, Value};

/// A request that has no faithful Chat Completions form; the message names what.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0} cannot be translated to Chat Completions for an upstream without this API")]
pub struct Untranslatable(pub String);

/// Anthropic's error object: the one place it is built.
pub(crate) fn anthropic_error(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// Text of chat `content` or of blocks with `text` (tool results, system prompts).
pub(crate) fn joined_text(content: &Value) -> Option<String> {
    match content {
        Value::String(text) => Some(text.clone()),
        Value::Array(blocks) => {
            let mut joined = String::new();
            for block in blocks {
                joined.push_str(block.get("text").and_then(Value::as_str)?);
            }
            Some(joined)
        }
        Value::Null => Some(String::new()),
        _ => None,
    }
}

/// The keys of `request` outside `known`: what the translation would otherwise drop.
pub(crate) fn check_keys(request: &Value, known: &[&str]) -> Result<(), Untranslatable> {
    let Some(object) = request.as_object() else {
        return Err(Untranslatable("a body that is not a JSON object".into()));
    };
    match object.keys().find(|k| !known.contains(&k.as_str())) {
        Some(key) => Err(Untranslatable(format!("`{key}`"))),
        None => Ok(()),
    }
}

/// The model's reasoning in a chat message or delta: vLLM's `reasoning_content` (older) or
/// `reasoning` (newer).
pub(crate) fn reasoning_of(message: &Value) -> Option<&str> {
    [&message["reasoning_content"], &message["reasoning"]]
        .into_iter()
        .find_map(Value::as_str)
        .filter(|r| !r.is_empty())
}

/// The tools of `request` that are `hosted` (no chat upstream can run them, so the
/// translation leaves them out), by name, or by type when unnamed.
pub(crate) fn hosted_tools(request: &Value, hosted: fn(&Value) -> bool) -> Vec<String> {
    let tools = request.get("tools").and_then(Value::as_array);
    let name = |t: &Value| t["name"].as_str().or(t["type"].as_str()).map(str::to_owned);
    let hosted = tools.into_iter().flatten().filter(|t| hosted(t));
    hosted.filter_map(name).collect()
}

/// The chat functions of `request`'s tools but the `hosted` ones, each converted by `function`.
pub(crate) fn chat_functions(
    request: &Value,
    hosted: fn(&Value) -> bool,
    function: fn(&Value) -> Result<Value, Untranslatable>,
) -> Option<Result<Value, Untranslatable>> {
    let tools = request.get("tools").and_then(Value::as_array)?;
    let functions: Result<Vec<Value>, _> =
        tools.iter().filter(|t| !hosted(t)).map(function).collect();
    Some(functions.map(Value::Array))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let request = json!({"model": "m", "container": "c"});
        let error = check_keys(&request, &["model"]).unwrap_err();
        assert_eq!(error, Untranslatable("`container`".into()));
    }
}
