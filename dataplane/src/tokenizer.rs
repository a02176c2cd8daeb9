//! Byte-level BPE tokenizer built from GGUF metadata (`tokenizer.ggml.*`).

mod bpe;
mod byte_map;
mod from_gguf;
mod pretok;
mod stream;

use std::collections::{HashMap, HashSet};

use crate::{Error, Result};
use bpe::Bpe;
use byte_map::ByteMap;
pub use from_gguf::chat_template;
use pretok::PreTokenizer;
pub use stream::StreamDecoder;

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Control tokens that end a turn in common chat formats. A model may emit one of them
/// instead of its declared EOS (SmolLM2 declares `<|im_end|>` but can also produce
/// `<|endoftext|>`); generation stops on any of them.
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
];

/// Everything needed to build a tokenizer, as plain values (from GGUF metadata or tests).
#[derive(Debug, Clone, Default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`; only `gpt2` (byte-level BPE) is supported.
    pub model: String,
    /// `tokenizer.ggml.pre`.
    pub pre: String,
    pub tokens: Vec<String>,
    /// One per token; empty means all normal.
    pub token_types: Vec<i32>,
    /// `"left right"` pairs in rank order.
    pub merges: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub add_bos: bool,
}

/// Turns sampled ids into output bytes; the scheduler depends only on this.
pub trait TokenText: Send + Sync {
    /// Bytes the token contributes to generated text (empty for control tokens).
    fn token_bytes(&self, id: u32) -> &[u8];
}

pub struct Tokenizer {
    pre: PreTokenizer,
    bpe: Bpe,
    /// Decoded bytes per id.
    pieces: Vec<Vec<u8>>,
    special: HashSet<u32>,
    /// Special token texts recognized inside input text, longest first.
    special_texts: Vec<(String, u32)>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    add_bos: bool,
    end_of_generation: Vec<u32>,
}

impl Tokenizer {
    pub fn from_gguf(g: &crate::gguf::Gguf) -> Result<Self> {
        Self::new(TokenizerSpec::from_gguf(g)?)
    }

    pub fn new(spec: TokenizerSpec) -> Result<Self> {
        if spec.model != "gpt2" {
            return Err(Error::Tokenizer(format!(
                "unsupported tokenizer model '{}' (tokenizer.ggml.model); only byte-level BPE 'gpt2' is supported",
                spec.model
            )));
        }
        let pre = PreTokenizer::from_name(&spec.pre)?;
        let n = spec.tokens.len();
        if !spec.token_types.is_empty() && spec.token_types.len() != n {
            return Err(Error::Tokenizer(format!(
                "{} token types for {n} tokens",
                spec.token_types.len()
            )));
        }
        let ty = |i: usize| {
            spec.token_types
                .get(i)
                .copied()
                .unwrap_or(token_type::NORMAL)
        };
        let bytes = ByteMap::new();
        let ids: HashMap<&str, u32> = spec
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.as_str(), i as u32))
            .collect();

        let mut byte_ids = [None; 256];
        for b in 0..=255u8 {
            byte_ids[b as usize] = ids.get(bytes.char_of(b).to_string().as_str()).copied();
        }
        let missing = byte_ids.iter().filter(|b| b.is_none()).count();
        if missing > 128 {
            return Err(Error::Tokenizer(format!(
                "vocabulary lacks {missing} of 256 byte tokens: not a byte-level BPE vocabulary"
            )));
        }

        let mut merges = HashMap::with_capacity(spec.merges.len());
        for (rank, m) in spec.merges.iter().enumerate() {
            let (l, r) = m.split_once(' ').ok_or_else(|| {
                Error::Tokenizer(format!("merge {rank} '{m}' is not 'left right'"))
            })?;
            let lookup = |s: &str| {
                ids.get(s).copied().ok_or_else(|| {
                    Error::Tokenizer(format!(
                        "merge {rank} '{m}' names '{s}', not in the vocabulary"
                    ))
                })
            };
            let merged = format!("{l}{r}");
            let key = (lookup(l)?, lookup(r)?);
            // A duplicate pair keeps its first (lowest) rank.
            merges.entry(key).or_insert((rank as u32, lookup(&merged)?));
        }

        let mut pieces = Vec::with_capacity(n);
        let mut special = HashSet::new();
        let mut special_texts = Vec::new();
        for (i, t) in spec.tokens.iter().enumerate() {
            let id = i as u32;
            match ty(i) {
                token_type::CONTROL | token_type::USER_DEFINED => {
                    if ty(i) == token_type::CONTROL {
                        special.insert(id);
                    }
                    if !t.is_empty() {
                        special_texts.push((t.clone(), id));
                    }
                    pieces.push(t.as_bytes().to_vec());
                }
                // Normal tokens are stored byte-mapped; anything else is taken literally.
                _ => pieces.push(bytes.bytes_of(t).unwrap_or_else(|| t.as_bytes().to_vec())),
            }
        }
        special_texts.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));

        let mut end_of_generation: Vec<u32> = spec.eos_id.into_iter().collect();
        for &(ref text, id) in &special_texts {
            if END_OF_GENERATION_TEXTS.contains(&text.as_str()) && !end_of_generation.contains(&id)
            {
                end_of_generation.push(id);
            }
        }
        for (name, id) in [("bos", spec.bos_id), ("eos", spec.eos_id)] {
            if let Some(id) = id.filter(|&id| id as usize >= n) {
                return Err(Error::Tokenizer(format!(
                    "{name} id {id} out of range ({n} tokens)"
                )));
            }
        }

        Ok(Self {
            pre,
            bpe: Bpe::new(merges, byte_ids),
            pieces,
            special,
            special_texts,
            bos_id: spec.bos_id,
            eos_id: spec.eos_id,
            add_bos: spec.add_bos,
            end_of_generation,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }
    /// Ids that end generation (EOS plus end-of-turn control tokens).
    pub fn end_of_generation(&self) -> &[u32] {
        &self.end_of_generation
    }
    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }
    /// The literal text of a token id (special tokens included), e.g. for `bos_token`.
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.pieces
            .get(id as usize)
            .map(|b| String::from_utf8_lossy(b).into_owned())
    }

    /// Tokenize `text`. `add_special`: prepend BOS when the model asks for it
    /// (`add_bos_token`). `parse_special`: special-token texts such as `<|im_start|>`
    /// become their ids instead of being tokenized as characters.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.extend(self.bos_id);
        }
        let mut rest = text;
        while !rest.is_empty() {
            let found = if parse_special {
                self.find_special(rest)
            } else {
                None
            };
            let (plain, special) = match found {
                Some((pos, len, id)) => (&rest[..pos], Some((len, id))),
                None => (rest, None),
            };
            for piece in self.pre.split(plain) {
                self.bpe.encode_piece(piece.as_bytes(), &mut out);
            }
            match special {
                Some((len, id)) => {
                    out.push(id);
                    rest = &rest[plain.len() + len..];
                }
                None => break,
            }
        }
        out
    }

    /// Earliest special-token occurrence (longest at that position): (byte pos, len, id).
    fn find_special(&self, text: &str) -> Option<(usize, usize, u32)> {
        self.special_texts
            .iter()
            .filter_map(|(t, id)| text.find(t.as_str()).map(|p| (p, t.len(), *id)))
            .min_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            if skip_special && self.is_special(id) {
                continue;
            }
            if let Some(p) = self.pieces.get(id as usize) {
                bytes.extend_from_slice(p);
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl TokenText for Tokenizer {
    fn token_bytes(&self, id: u32) -> &[u8] {
        if self.is_special(id) {
            return &[];
        }
        self.pieces.get(id as usize).map_or(&[], |p| p.as_slice())
    }
}

#[cfg(test)]
mod tests;
