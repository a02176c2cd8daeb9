//! Request-body validation with OpenAI-style messages that name the offending parameter.

use serde_json::{Map, Value};

use super::api_error::ApiError;
use crate::sampling::{SamplingParams, limits};

pub type Obj = Map<String, Value>;
type R<T> = std::result::Result<T, ApiError>;

pub fn parse_object(body: &[u8]) -> R<Obj> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(
            ApiError::invalid(None, "request body must be a JSON object")
                .with_code("not_an_object"),
        ),
        Err(e) => {
            Err(ApiError::invalid(None, format!("malformed JSON body: {e}"))
                .with_code("invalid_json"))
        }
    }
}

fn present<'a>(o: &'a Obj, k: &str) -> Option<&'a Value> {
    o.get(k).filter(|v| !v.is_null())
}

pub(super) fn wrong_type(k: &str, want: &str, v: &Value) -> ApiError {
    ApiError::invalid(Some(k), format!("'{k}' must be {want}, got {v}")).with_code("invalid_type")
}

pub fn opt_bool(o: &Obj, k: &str) -> R<Option<bool>> {
    present(o, k)
        .map(|v| v.as_bool().ok_or_else(|| wrong_type(k, "a boolean", v)))
        .transpose()
}

pub fn opt_f32(o: &Obj, k: &str, lo: f32, hi: f32) -> R<Option<f32>> {
    let Some(v) = present(o, k) else {
        return Ok(None);
    };
    let x = v.as_f64().ok_or_else(|| wrong_type(k, "a number", v))? as f32;
    if !(lo..=hi).contains(&x) {
        return Err(ApiError::invalid(
            Some(k),
            format!("'{k}' must be between {lo} and {hi}, got {x}"),
        ));
    }
    Ok(Some(x))
}

/// A number within one of the sampling limits.
fn opt_range(o: &Obj, k: &str, r: &std::ops::RangeInclusive<f32>) -> R<Option<f32>> {
    opt_f32(o, k, *r.start(), *r.end())
}

/// An integer; `lo` is the smallest accepted value.
pub fn opt_int(o: &Obj, k: &str, lo: i64) -> R<Option<i64>> {
    let Some(v) = present(o, k) else {
        return Ok(None);
    };
    let x = v.as_i64().ok_or_else(|| wrong_type(k, "an integer", v))?;
    if x < lo {
        return Err(ApiError::invalid(
            Some(k),
            format!("'{k}' must be at least {lo}, got {x}"),
        ));
    }
    Ok(Some(x))
}

pub fn opt_str<'a>(o: &'a Obj, k: &str) -> R<Option<&'a str>> {
    present(o, k)
        .map(|v| v.as_str().ok_or_else(|| wrong_type(k, "a string", v)))
        .transpose()
}

/// Most `stop_token_ids` in one request.
pub const MAX_STOP_TOKEN_IDS: usize = 1024;

/// Parameters common to both completion endpoints.
#[derive(Debug, Clone)]
pub struct Common {
    pub max_tokens: Option<usize>,
    /// The penalties are set here; `min_tokens` and its masked ids once the request's stop
    /// tokens are known (`completions::generate`).
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// The model's end-of-generation tokens do not end generation.
    pub ignore_eos: bool,
    pub min_tokens: usize,
    /// More tokens that end generation (deduplicated, each below the vocabulary size).
    pub stop_token_ids: Vec<u32>,
}

pub fn check_model(o: &Obj, served: &str) -> R<()> {
    match opt_str(o, "model")? {
        None => Err(ApiError::invalid(Some("model"), "'model' is required")),
        Some(m) if m == served => Ok(()),
        Some(m) => Err(ApiError::invalid(
            Some("model"),
            format!("model '{m}' does not exist; this server serves '{served}'"),
        )
        .with_code("model_not_found")),
    }
}

/// A number above 0 (and finite).
fn opt_positive_f32(o: &Obj, k: &str) -> R<Option<f32>> {
    let Some(v) = present(o, k) else {
        return Ok(None);
    };
    let x = v.as_f64().ok_or_else(|| wrong_type(k, "a number", v))? as f32;
    if !(x.is_finite() && x > 0.0) {
        return Err(ApiError::invalid(
            Some(k),
            format!("'{k}' must be greater than 0, got {v}"),
        ));
    }
    Ok(Some(x))
}

fn stop_token_ids(o: &Obj, vocab_size: usize) -> R<Vec<u32>> {
    const K: &str = "stop_token_ids";
    let arr = match present(o, K) {
        None => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(wrong_type(K, "an array of token ids", v)),
    };
    if arr.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::invalid(
            Some(K),
            format!(
                "'{K}' has {} ids; at most {MAX_STOP_TOKEN_IDS} are accepted",
                arr.len()
            ),
        ));
    }
    let mut ids = Vec::with_capacity(arr.len());
    for v in arr {
        let id = v
            .as_u64()
            .ok_or_else(|| wrong_type(K, "an array of non-negative integer token ids", v))?;
        if id >= vocab_size as u64 {
            return Err(ApiError::invalid(
                Some(K),
                format!("token id {id} in '{K}' is out of range (vocabulary {vocab_size})"),
            ));
        }
        if !ids.contains(&(id as u32)) {
            ids.push(id as u32);
        }
    }
    Ok(ids)
}

pub fn common(o: &Obj, max_tokens_keys: &[&str], vocab_size: usize) -> R<Common> {
    let mut max_tokens = None;
    for k in max_tokens_keys {
        if let Some(n) = opt_int(o, k, 1)? {
            max_tokens = Some(n as usize);
        }
    }
    if opt_int(o, "n", 1)?.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(Some("n"), "only n=1 is supported"));
    }
    let stop = match present(o, "stop") {
        None => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| wrong_type("stop", "a string or an array of strings", v))
            })
            .collect::<R<_>>()?,
        Some(v) => return Err(wrong_type("stop", "a string or an array of strings", v)),
    };
    let include_usage = match present(o, "stream_options") {
        None => false,
        Some(Value::Object(so)) => opt_bool(so, "include_usage")?.unwrap_or(false),
        Some(v) => return Err(wrong_type("stream_options", "an object", v)),
    };
    Ok(Common {
        max_tokens,
        sampling: SamplingParams {
            temperature: opt_range(o, "temperature", &limits::TEMPERATURE)?.unwrap_or(1.0),
            top_p: opt_range(o, "top_p", &limits::TOP_P)?.unwrap_or(1.0),
            top_k: opt_int(o, "top_k", 0)?.unwrap_or(0) as usize,
            seed: opt_int(o, "seed", i64::MIN)?.map(|s| s as u64),
            logprobs: None,
            repetition_penalty: opt_positive_f32(o, "repetition_penalty")?.unwrap_or(1.0),
            frequency_penalty: opt_range(o, "frequency_penalty", &limits::PENALTY)?.unwrap_or(0.0),
            presence_penalty: opt_range(o, "presence_penalty", &limits::PENALTY)?.unwrap_or(0.0),
            min_tokens: 0,
            min_tokens_masked: Vec::new(),
        },
        stop,
        stream: opt_bool(o, "stream")?.unwrap_or(false),
        include_usage,
        ignore_eos: opt_bool(o, "ignore_eos")?.unwrap_or(false),
        min_tokens: opt_int(o, "min_tokens", 0)?.unwrap_or(0) as usize,
        stop_token_ids: stop_token_ids(o, vocab_size)?,
    })
}

/// Completions prompt: a string, a one-element array of strings, or an array of token ids.
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

pub fn prompt(o: &Obj, vocab_size: usize) -> R<Prompt> {
    let bad = |v: &Value| {
        wrong_type(
            "prompt",
            "a string, an array of one string, or an array of token ids",
            v,
        )
    };
    match present(o, "prompt") {
        None => Err(ApiError::invalid(Some("prompt"), "'prompt' is required")),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Ok(Prompt::Text(a[0].as_str().unwrap_or_default().to_owned()))
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_u64) => a
            .iter()
            .map(|v| {
                let id = v.as_u64().unwrap_or(u64::MAX);
                if id < vocab_size as u64 {
                    Ok(id as u32)
                } else {
                    Err(ApiError::invalid(
                        Some("prompt"),
                        format!("token id {id} is out of range (vocabulary {vocab_size})"),
                    ))
                }
            })
            .collect::<R<_>>()
            .map(Prompt::Tokens),
        Some(Value::Array(a)) if a.len() > 1 && a.iter().all(Value::is_string) => {
            Err(ApiError::invalid(
                Some("prompt"),
                "batched prompts are not supported; send one prompt per request",
            ))
        }
        Some(v) => Err(bad(v)),
    }
}
