//! Which request fields the completion endpoints take. Every top-level field of a request
//! is one of: supported (parsed in `params`), ignored because it changes nothing in the
//! answer (`user`, `metadata`, ...), or refused with a 400 that names it — a field of
//! OpenAI's or vLLM's API that Tandem does not implement is never dropped silently, and
//! neither is a misspelt one. A refused field is still accepted with the one value that
//! asks for nothing (`"best_of": 1`, `"echo": false`, `"tools": []`), which clients and
//! benchmark tools often send. The README's API section lists the same tables; a test
//! keeps them in step.

use serde_json::Value;

use super::api_error::ApiError;
use super::params::Obj;

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// Supported by both endpoints.
pub const SUPPORTED: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
];
pub const SUPPORTED_CHAT: &[&str] = &["messages", "max_completion_tokens", "top_logprobs"];
pub const SUPPORTED_COMPLETIONS: &[&str] = &["prompt"];

/// Accepted and ignored: they do not change what is generated or how it is returned.
pub const IGNORED: &[&str] = &[
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "prompt_cache_key",
    "safety_identifier",
    "request_id",
    "spaces_between_special_tokens",
];

/// Keys of `stream_options`: `include_usage` is supported, these are ignored.
pub const IGNORED_STREAM_OPTIONS: &[&str] = &["include_obfuscation"];

/// Not implemented: refused unless the value asks for nothing (described by the text).
pub const REFUSED: &[(&str, Neutral)] = &[
    ("logit_bias", Neutral::Empty),
    ("best_of", Neutral::One),
    ("use_beam_search", Neutral::False),
    ("length_penalty", Neutral::One),
    ("suffix", Neutral::Empty),
    ("echo", Neutral::False),
    ("response_format", Neutral::TextFormat),
    ("tools", Neutral::Empty),
    ("tool_choice", Neutral::NoneOrAuto),
    ("functions", Neutral::Empty),
    ("function_call", Neutral::NoneOrAuto),
    ("guided_json", Neutral::Null),
    ("guided_regex", Neutral::Null),
    ("guided_choice", Neutral::Null),
    ("guided_grammar", Neutral::Null),
    ("guided_decoding_backend", Neutral::Null),
    ("guided_whitespace_pattern", Neutral::Null),
    ("structured_outputs", Neutral::Null),
    ("min_p", Neutral::Zero),
    ("prompt_logprobs", Neutral::Null),
    ("allowed_token_ids", Neutral::Null),
    ("bad_words", Neutral::Empty),
    ("include_stop_str_in_output", Neutral::False),
    ("skip_special_tokens", Neutral::True),
    ("truncate_prompt_tokens", Neutral::Null),
    ("return_tokens_as_token_ids", Neutral::False),
    ("priority", Neutral::Zero),
    ("prediction", Neutral::Null),
    ("audio", Neutral::Null),
    ("modalities", Neutral::TextOnly),
    ("reasoning_effort", Neutral::Null),
    ("web_search_options", Neutral::Null),
    ("chat_template", Neutral::Null),
    ("chat_template_kwargs", Neutral::Empty),
    ("add_generation_prompt", Neutral::True),
    ("continue_final_message", Neutral::False),
];

/// The value of a refused field that asks for nothing (null always does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Neutral {
    Null,
    False,
    True,
    Zero,
    One,
    /// An empty string, array or object.
    Empty,
    /// `{"type": "text"}`.
    TextFormat,
    /// `"none"` or `"auto"` (with no tools, neither calls any).
    NoneOrAuto,
    /// `["text"]`.
    TextOnly,
}

impl Neutral {
    fn accepts(self, v: &Value) -> bool {
        match (self, v) {
            (_, Value::Null) => true,
            (Self::False, Value::Bool(b)) => !b,
            (Self::True, Value::Bool(b)) => *b,
            (Self::Zero, Value::Number(n)) => n.as_f64() == Some(0.0),
            (Self::One, Value::Number(n)) => n.as_f64() == Some(1.0),
            (Self::Empty, Value::String(s)) => s.is_empty(),
            (Self::Empty, Value::Array(a)) => a.is_empty(),
            (Self::Empty, Value::Object(o)) => o.is_empty(),
            (Self::TextFormat, Value::Object(o)) => {
                o.len() == 1 && o.get("type").and_then(Value::as_str) == Some("text")
            }
            (Self::NoneOrAuto, Value::String(s)) => s == "none" || s == "auto",
            (Self::TextOnly, Value::Array(a)) => a.len() == 1 && a[0] == "text",
            _ => false,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Null => "null",
            Self::False => "false",
            Self::True => "true",
            Self::Zero => "0",
            Self::One => "1",
            Self::Empty => "empty",
            Self::TextFormat => "{\"type\": \"text\"}",
            Self::NoneOrAuto => "\"none\" or \"auto\"",
            Self::TextOnly => "[\"text\"]",
        }
    }
}

/// Refuse the first field (in key order) that is neither supported nor ignored, or that
/// is refused with a value asking for something.
pub fn check(o: &Obj, endpoint: Endpoint) -> Result<(), ApiError> {
    let own = match endpoint {
        Endpoint::Chat => SUPPORTED_CHAT,
        Endpoint::Completions => SUPPORTED_COMPLETIONS,
    };
    for (k, v) in o {
        let k = k.as_str();
        if SUPPORTED.contains(&k) || own.contains(&k) || IGNORED.contains(&k) {
            continue;
        }
        if let Some((_, neutral)) = REFUSED.iter().find(|(name, _)| *name == k) {
            if neutral.accepts(v) {
                continue;
            }
            return Err(ApiError::invalid(
                Some(k),
                format!(
                    "'{k}' is not supported by this server; only {} (asking for nothing) is accepted, got {v}",
                    neutral.describe()
                ),
            )
            .with_code("unsupported_parameter"));
        }
        let path = match endpoint {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        };
        return Err(ApiError::invalid(
            Some(k),
            format!("unrecognized request field '{k}' for {path}"),
        )
        .with_code("unknown_parameter"));
    }
    if let Some(Value::Object(so)) = o.get("stream_options") {
        for k in so.keys() {
            if k != "include_usage" && !IGNORED_STREAM_OPTIONS.contains(&k.as_str()) {
                let p = format!("stream_options.{k}");
                return Err(ApiError::invalid(
                    Some(&p),
                    format!("unrecognized field '{p}'; stream_options takes include_usage"),
                )
                .with_code("unknown_parameter"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Obj {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn neutral_values_pass_and_others_are_named() {
        let ok = serde_json::json!({
            "best_of": 1, "echo": false, "logit_bias": {}, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "use_beam_search": false, "min_p": 0.0,
            "skip_special_tokens": true, "modalities": ["text"], "guided_json": null,
            "user": "u1", "metadata": {"a": "b"}, "store": false,
        });
        assert_eq!(check(&obj(ok), Endpoint::Chat), Ok(()));
        for (field, bad) in [
            ("best_of", serde_json::json!(2)),
            ("echo", serde_json::json!(true)),
            ("logit_bias", serde_json::json!({"11": -100})),
            ("tools", serde_json::json!([{"type": "function"}])),
            (
                "response_format",
                serde_json::json!({"type": "json_object"}),
            ),
            ("guided_regex", serde_json::json!("a+")),
            ("min_p", serde_json::json!(0.1)),
            ("tool_choice", serde_json::json!("required")),
        ] {
            let e = check(
                &obj(serde_json::json!({ field: bad })),
                Endpoint::Completions,
            )
            .unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field));
            assert!(e.message.contains("not supported"), "{}", e.message);
        }
        let e = check(&obj(serde_json::json!({"max_token": 5})), Endpoint::Chat).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_token"));
        assert!(e.message.contains("unrecognized"), "{}", e.message);
        // A field of the other endpoint is not one of this endpoint.
        let e = check(&obj(serde_json::json!({"prompt": "x"})), Endpoint::Chat).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let so = serde_json::json!({"stream_options": {"include_usage": true, "include_obfuscation": false}});
        assert_eq!(check(&obj(so), Endpoint::Chat), Ok(()));
        let so = serde_json::json!({"stream_options": {"continuous_usage_stats": true}});
        let e = check(&obj(so), Endpoint::Chat).unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("stream_options.continuous_usage_stats")
        );
    }

    #[test]
    fn the_readme_lists_every_field() {
        let readme = include_str!("../../../README.md");
        let section = &readme[readme.find("## Use the API").expect("API section")..];
        let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
        let names = SUPPORTED
            .iter()
            .chain(SUPPORTED_CHAT)
            .chain(SUPPORTED_COMPLETIONS)
            .chain(IGNORED)
            .chain(REFUSED.iter().map(|(n, _)| n))
            .map(|n| n.to_string())
            .chain(
                IGNORED_STREAM_OPTIONS
                    .iter()
                    .map(|n| format!("stream_options.{n}")),
            );
        for name in names {
            assert!(
                section.contains(&format!("`{name}`")),
                "README's API section does not name `{name}`"
            );
        }
    }
}
