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

fn floats(g: &Gguf, key: &str) -> Result<Vec<f32>> {
    match g.get_array(key)? {
        GgufArray::F32(v) => Ok(v.clone()),
        other => Err(bad(key, other)),
    }
}

fn opt_bool(g: &Gguf, key: &str) -> Option<bool> {
    g.get(key).and_then(|v| v.as_bool())
}

impl TokenizerSpec {
    /// Reads `tokenizer.ggml.*`. A missing `tokenizer.ggml.pre` means the default
    /// GPT-2 pattern; a SentencePiece file without BOS/EOS ids has llama.cpp's 1 and 2.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let model = g.get_str("tokenizer.ggml.model")?.to_owned();
        let pre = match g.get("tokenizer.ggml.pre") {
            None => "gpt2".to_owned(),
            Some(_) => g.get_str("tokenizer.ggml.pre")?.to_owned(),
        };
        let present = |k: &str| g.get(k).is_some();
        let merges = if present("tokenizer.ggml.merges") {
            strings(g, "tokenizer.ggml.merges")?
        } else {
            vec![]
        };
        let token_types = if present("tokenizer.ggml.token_type") {
            ints(g, "tokenizer.ggml.token_type")?
        } else {
            vec![]
        };
        let scores = if present("tokenizer.ggml.scores") {
            floats(g, "tokenizer.ggml.scores")?
        } else {
            vec![]
        };
        let spm = model == "llama";
        let id_or = |key: &str, default: u32| -> Result<Option<u32>> {
            Ok(opt_id(g, key)?.or(spm.then_some(default)))
        };
        let eot_ids = ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"]
            .iter()
            .map(|k| opt_id(g, k))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .flatten()
            .collect();
        Ok(Self {
            model,
            pre,
            tokens: strings(g, "tokenizer.ggml.tokens")?,
            token_types,
            scores,
            merges,
            bos_id: id_or("tokenizer.ggml.bos_token_id", 1)?,
            eos_id: id_or("tokenizer.ggml.eos_token_id", 2)?,
            eot_ids,
            add_bos: opt_bool(g, "tokenizer.ggml.add_bos_token"),
            add_eos: opt_bool(g, "tokenizer.ggml.add_eos_token").unwrap_or(false),
            add_space_prefix: opt_bool(g, "tokenizer.ggml.add_space_prefix"),
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
