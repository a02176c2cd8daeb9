//! `messages` of a chat request, validated as OpenAI validates them before any template
//! sees them: each message an object with a known `role`; `content` present (a string or
//! text parts) except on an assistant turn that carries `tool_calls`; a `tool` message
//! names its `tool_call_id`. Every refusal is a 400 naming the field
//! (`messages[1].role`).

use serde_json::Value;

use super::api_error::ApiError;
use super::params::Obj;
use crate::chat::ChatMessage;

type R<T> = std::result::Result<T, ApiError>;

/// The roles OpenAI's chat API takes.
pub const ROLES: &[&str] = &[
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

fn missing(field: &str) -> ApiError {
    ApiError::invalid(Some(field), format!("'{field}' is required"))
}

fn wrong(field: &str, what: &str, v: &Value) -> ApiError {
    super::params::wrong_type(field, what, v)
}

pub fn parse(o: &Obj) -> R<Vec<ChatMessage>> {
    let arr = match o.get("messages") {
        None | Some(Value::Null) => return Err(missing("messages")),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(wrong("messages", "an array", v)),
    };
    if arr.is_empty() {
        return Err(ApiError::invalid(
            Some("messages"),
            "'messages' must contain at least one message",
        ));
    }
    arr.iter()
        .enumerate()
        .map(|(i, m)| message(&format!("messages[{i}]"), m))
        .collect()
}

fn message(p: &str, m: &Value) -> R<ChatMessage> {
    let m = m.as_object().ok_or_else(|| wrong(p, "an object", m))?;
    let role_field = format!("{p}.role");
    let role = match m.get("role") {
        None | Some(Value::Null) => return Err(missing(&role_field)),
        Some(Value::String(r)) => r.as_str(),
        Some(v) => return Err(wrong(&role_field, "a string", v)),
    };
    if !ROLES.contains(&role) {
        return Err(ApiError::invalid(
            Some(&role_field),
            format!(
                "'{role_field}' is '{role}', which is not a role: one of {}",
                ROLES.join(", ")
            ),
        ));
    }
    let tool_calls = match m.get("tool_calls") {
        None | Some(Value::Null) => None,
        Some(Value::Array(calls)) if role == "assistant" => {
            Some(tool_calls(&format!("{p}.tool_calls"), calls)?)
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                Some(&format!("{p}.tool_calls")),
                format!("'{p}.tool_calls' is only allowed on assistant messages"),
            ));
        }
        Some(v) => return Err(wrong(&format!("{p}.tool_calls"), "an array", v)),
    };
    let content_field = format!("{p}.content");
    let content = match m.get("content") {
        // An assistant turn may carry only tool calls.
        None | Some(Value::Null) if role == "assistant" && tool_calls.is_some() => None,
        None | Some(Value::Null) => return Err(missing(&content_field)),
        Some(v) => Some(content(&content_field, v)?),
    };
    let text = |k: &str| -> R<Option<String>> {
        let f = format!("{p}.{k}");
        match m.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(wrong(&f, "a string", v)),
        }
    };
    let tool_call_id = text("tool_call_id")?;
    if role == "tool" && tool_call_id.is_none() {
        return Err(missing(&format!("{p}.tool_call_id")));
    }
    Ok(ChatMessage {
        role: role.to_owned(),
        content,
        tool_calls,
        tool_call_id,
        name: text("name")?,
    })
}

/// A string, or an array of `{"type": "text", "text": ...}` parts (concatenated).
fn content(field: &str, v: &Value) -> R<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut s = String::new();
            for (j, part) in parts.iter().enumerate() {
                match (
                    part.get("type").and_then(Value::as_str),
                    part.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => s.push_str(t),
                    (Some(ty), _) if ty != "text" => {
                        return Err(ApiError::invalid(
                            Some(&format!("{field}[{j}].type")),
                            format!(
                                "'{field}[{j}].type' is '{ty}': this model takes text parts only"
                            ),
                        ));
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            Some(&format!("{field}[{j}]")),
                            format!("'{field}[{j}]' must be {{\"type\": \"text\", \"text\": ...}}"),
                        ));
                    }
                }
            }
            Ok(s)
        }
        v => Err(wrong(field, "a string or an array of text parts", v)),
    }
}

/// An assistant turn's tool calls, each `{"type": "function", "function": {"name": ...,
/// "arguments": ...}}` (the template gets the arguments as the object their JSON string
/// encodes: `chat::ChatTemplate`).
fn tool_calls(field: &str, calls: &[Value]) -> R<Value> {
    let mut out = Vec::with_capacity(calls.len());
    for (j, c) in calls.iter().enumerate() {
        let f = format!("{field}[{j}]");
        let mut c = c
            .as_object()
            .cloned()
            .ok_or_else(|| wrong(&f, "an object", c))?;
        let func = match c.get_mut("function") {
            Some(Value::Object(func)) => func,
            None | Some(Value::Null) => return Err(missing(&format!("{f}.function"))),
            Some(v) => return Err(wrong(&format!("{f}.function"), "an object", v)),
        };
        match func.get("name") {
            Some(Value::String(_)) => {}
            None | Some(Value::Null) => return Err(missing(&format!("{f}.function.name"))),
            Some(v) => return Err(wrong(&format!("{f}.function.name"), "a string", v)),
        }
        match func.get("arguments") {
            None | Some(Value::Null | Value::String(_) | Value::Object(_)) => {}
            Some(v) => {
                return Err(wrong(
                    &format!("{f}.function.arguments"),
                    "a JSON string",
                    v,
                ));
            }
        }
        out.push(Value::Object(c));
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse_json(v: Value) -> R<Vec<ChatMessage>> {
        parse(v.as_object().unwrap())
    }

    fn refused(v: Value) -> (String, String) {
        let e = parse_json(v).unwrap_err();
        (e.param.unwrap_or_default(), e.message)
    }

    #[test]
    fn unknown_roles_and_missing_content_are_refused_naming_the_field() {
        let (p, m) = refused(
            json!({"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "x"}]}),
        );
        assert_eq!(p, "messages[1].role");
        assert!(
            m.contains("'wizard', which is not a role") && m.contains("assistant"),
            "{m}"
        );
        let (p, m) = refused(json!({"messages": [{"role": "user"}]}));
        assert_eq!(p, "messages[0].content");
        assert!(m.contains("'messages[0].content' is required"), "{m}");
        let (p, _) = refused(json!({"messages": [{"content": "hi"}]}));
        assert_eq!(p, "messages[0].role");
        let (p, _) = refused(json!({"messages": [{"role": 3, "content": "hi"}]}));
        assert_eq!(p, "messages[0].role");
        let (p, _) = refused(json!({"messages": [{"role": "system", "content": null}]}));
        assert_eq!(p, "messages[0].content");
        let (p, _) = refused(json!({"messages": [{"role": "user", "content": 7}]}));
        assert_eq!(p, "messages[0].content");
        let (p, _) = refused(
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
        );
        assert_eq!(p, "messages[0].content[0].type");
        let (p, _) = refused(json!({"messages": [{"role": "tool", "content": "42"}]}));
        assert_eq!(p, "messages[0].tool_call_id");
        let (p, _) = refused(json!({"messages": []}));
        assert_eq!(p, "messages");
        let (p, _) = refused(json!({}));
        assert_eq!(p, "messages");
        let (p, _) = refused(json!({"messages": ["hi"]}));
        assert_eq!(p, "messages[0]");
        let (p, _) = refused(
            json!({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]}),
        );
        assert_eq!(p, "messages[0].tool_calls[0].function");
    }

    #[test]
    fn tool_turns_parse() {
        let m = parse_json(json!({"messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ]}))
        .unwrap();
        assert_eq!(m[0].content.as_deref(), Some("ab"));
        assert_eq!(m[1].content, None);
        assert_eq!(
            m[1].tool_calls.as_ref().unwrap()[0]["function"]["arguments"],
            "{\"x\": 1}"
        );
        let (p, _) = refused(json!({"messages": [{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": 3}}]}]}));
        assert_eq!(p, "messages[0].tool_calls[0].function.arguments");
        assert_eq!(m[2].tool_call_id.as_deref(), Some("c1"));
    }
}
