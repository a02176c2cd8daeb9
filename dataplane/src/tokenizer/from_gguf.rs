//! Building the tokenizer spec and chat template inputs from GGUF metadata.

use super::TokenizerSpec;
use crate::gguf::{Gguf, GgufArray, GgufError};
use crate::{Error, Result};

fn strings(g: &Gguf, key: &str) -> Result<Vec<String>> {
    match g.get_array(key)? {
        GgufArray::String(v) => Ok(v.clone()),
        other => Err(bad(key, other)),
    }
}

fn bad(key: &str, a: &GgufArray) -> Error {
    GgufError::BadValue {
        key: key.into(),
        reason: format!(
            "expected an array of strings/integers, found {} elements of another type",
            a.len()
        ),
    }
    .into()
}

fn ints(g: &Gguf, key: &str) -> Result<Vec<i32>> {
    let a = g.get_array(key)?;
    let v: Option<Vec<i32>> = match a {
        GgufArray::I32(v) => Some(v.clone()),
        GgufArray::U32(v) => v.iter().map(|&x| i32::try_from(x).ok()).collect(),
        GgufArray::I8(v) => Some(v.iter().map(|&x| x.into()).collect()),
        GgufArray::U8(v) => Some(v.iter().map(|&x| x.into()).collect()),
        GgufArray::I64(v) => v.iter().map(|&x| i32::try_from(x).ok()).collect(),
        _ => None,
    };
    v.ok_or_else(|| bad(key, a))
}

fn opt_id(g: &Gguf, key: &str) -> Result<Option<u32>> {
    if g.get(key).is_none() {
        return Ok(None);
    }
    let n = g.get_usize(key)?;
    u32::try_from(n).map(Some).map_err(|_| {
        GgufError::BadValue {
            key: key.into(),
            reason: format!("{n} is not a token id"),
        }
        .into()
    })
}

impl TokenizerSpec {
    /// Reads `tokenizer.ggml.*`. A missing `tokenizer.ggml.pre` means the default
    /// GPT-2 pattern, as in llama.cpp.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let pre = match g.get("tokenizer.ggml.pre") {
            None => "gpt2".to_owned(),
            Some(_) => g.get_str("tokenizer.ggml.pre")?.to_owned(),
        };
        let merges = if g.get("tokenizer.ggml.merges").is_some() {
            strings(g, "tokenizer.ggml.merges")?
        } else {
            vec![]
        };
        let token_types = if g.get("tokenizer.ggml.token_type").is_some() {
            ints(g, "tokenizer.ggml.token_type")?
        } else {
            vec![]
        };
        Ok(Self {
            model: g.get_str("tokenizer.ggml.model")?.to_owned(),
            pre,
            tokens: strings(g, "tokenizer.ggml.tokens")?,
            token_types,
            merges,
            bos_id: opt_id(g, "tokenizer.ggml.bos_token_id")?,
            eos_id: opt_id(g, "tokenizer.ggml.eos_token_id")?,
            add_bos: g
                .get("tokenizer.ggml.add_bos_token")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
        })
    }
}

/// `tokenizer.chat_template`, if the model has one.
pub fn chat_template(g: &Gguf) -> Result<Option<String>> {
    match g.get("tokenizer.chat_template") {
        None => Ok(None),
        Some(_) => Ok(Some(g.get_str("tokenizer.chat_template")?.to_owned())),
    }
}
