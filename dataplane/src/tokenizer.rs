//! Tokenizers built from GGUF metadata (`tokenizer.ggml.*`), as llama.cpp builds and runs
//! them (it is the reference the tests hold them against):
//! - `gpt2`: byte-level BPE after a pre-tokenizer named by `tokenizer.ggml.pre`
//!   ([`pretok`]: the SmolLM/StarCoder, GPT-2, Llama 3 and Qwen2 patterns);
//! - `llama`: SentencePiece with scores and byte fallback ([`spm`]: Llama 2, Mistral,
//!   Gemma).
//!
//! Both first cut the text at special tokens ([`special`]): user-defined tokens always,
//! control tokens when asked to (`parse_special`: chat templates and raw completion
//! prompts; never chat message content, see [`Tokenizer::protect`]).

mod bpe;
mod byte_map;
mod from_gguf;
mod pretok;
mod special;
mod spm;
mod stream;
mod unicode;

use std::collections::{HashMap, HashSet};

use crate::{Error, Result};
use bpe::Bpe;
use byte_map::ByteMap;
pub use from_gguf::chat_template;
use pretok::PreTokenizer;
pub use pretok::supported_names as supported_pre_tokenizers;
use special::{Fragment, Specials, unprotect};
use spm::Spm;
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

/// `tokenizer.ggml.model` values this engine tokenizes.
pub const SUPPORTED_MODELS: &[&str] = &["gpt2", "llama"];

/// Token texts that end generation whatever their type (llama.cpp's end-of-generation
/// list): a model may emit one of them instead of its declared EOS (SmolLM2 declares
/// `<|im_end|>` but can also produce `<|endoftext|>`).
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<EOT>",
];

/// Everything needed to build a tokenizer, as plain values (from GGUF metadata or tests).
#[derive(Debug, Clone, Default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: `gpt2` (byte-level BPE) or `llama` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre` (BPE only).
    pub pre: String,
    pub tokens: Vec<String>,
    /// One per token; empty means all normal.
    pub token_types: Vec<i32>,
    /// SentencePiece scores, one per token; empty means all 0.
    pub scores: Vec<f32>,
    /// `"left right"` pairs in rank order (BPE).
    pub merges: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// `tokenizer.ggml.eot_token_id` / `eom_token_id`: also end generation.
    pub eot_ids: Vec<u32>,
    /// `tokenizer.ggml.add_bos_token`; `None`: the tokenizer model's default.
    pub add_bos: Option<bool>,
    pub add_eos: bool,
    /// `tokenizer.ggml.add_space_prefix` (SentencePiece; default true).
    pub add_space_prefix: Option<bool>,
}

/// Turns sampled ids into output bytes; the scheduler depends only on this.
pub trait TokenText: Send + Sync {
    /// Bytes the token contributes to generated text (empty for control tokens).
    fn token_bytes(&self, id: u32) -> &[u8];
}

enum Model {
    Bpe {
        pre: PreTokenizer,
        bpe: Box<Bpe>,
    },
    Spm {
        spm: Box<Spm>,
        add_space_prefix: bool,
    },
}

pub struct Tokenizer {
    model: Model,
    /// Decoded bytes per id, special tokens as their text.
    pieces: Vec<Vec<u8>>,
    /// Control, unknown and unused tokens: no text in generated output.
    special: HashSet<u32>,
    specials: Specials,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    end_of_generation: Vec<u32>,
}

/// Whether `tokenizer.ggml.model = model` with `tokenizer.ggml.pre = pre` can be served;
/// the reason, naming what is supported, when not.
pub fn check_support(model: &str, pre: &str) -> std::result::Result<(), String> {
    match model {
        "llama" => Ok(()),
        "gpt2" => PreTokenizer::from_name(pre).map(|_| ()).map_err(|_| {
            format!(
                "pre-tokenizer '{pre}' (tokenizer.ggml.pre; supported: {})",
                supported_pre_tokenizers().join(", ")
            )
        }),
        other => Err(format!(
            "tokenizer model '{other}' (tokenizer.ggml.model; supported: gpt2 (byte-level BPE), \
             llama (SentencePiece))"
        )),
    }
}

impl Tokenizer {
    pub fn from_gguf(g: &crate::gguf::Gguf) -> Result<Self> {
        Self::new(TokenizerSpec::from_gguf(g)?)
    }

    pub fn new(spec: TokenizerSpec) -> Result<Self> {
        check_support(&spec.model, &spec.pre)
            .map_err(|e| Error::Tokenizer(format!("unsupported {e}")))?;
        let n = spec.tokens.len();
        if !spec.token_types.is_empty() && spec.token_types.len() != n {
            return Err(Error::Tokenizer(format!(
                "{} token types for {n} tokens",
                spec.token_types.len()
            )));
        }
        if !spec.scores.is_empty() && spec.scores.len() != n {
            return Err(Error::Tokenizer(format!(
                "{} token scores for {n} tokens",
                spec.scores.len()
            )));
        }
        let mut ty: Vec<i32> = (0..n)
            .map(|i| {
                spec.token_types
                    .get(i)
                    .copied()
                    .unwrap_or(token_type::NORMAL)
            })
            .collect();
        // As llama.cpp: end-of-turn texts are control tokens whatever the file says.
        for (i, t) in spec.tokens.iter().enumerate() {
            if END_OF_GENERATION_TEXTS.contains(&t.as_str()) {
                ty[i] = token_type::CONTROL;
            }
        }
        let is_spm = spec.model == "llama";
        let (model, default_bos) = if is_spm {
            let spm = Box::new(Spm::new(&spec.tokens, spec.scores.clone()));
            if !spm.has_byte_tokens() {
                return Err(Error::Tokenizer(
                    "SentencePiece vocabulary without the 256 <0xXX> byte tokens: byte \
                     fallback is impossible"
                        .into(),
                ));
            }
            let add_space_prefix = spec.add_space_prefix.unwrap_or(true);
            (
                Model::Spm {
                    spm,
                    add_space_prefix,
                },
                true,
            )
        } else {
            let pre = PreTokenizer::from_name(&spec.pre)?;
            (
                Model::Bpe {
                    bpe: Box::new(bpe_tables(&spec)?),
                    pre,
                },
                pre.add_bos_default,
            )
        };
        let bytes = ByteMap::new();
        let mut pieces = Vec::with_capacity(n);
        let mut special = HashSet::new();
        let mut partition = Vec::new();
        for (i, t) in spec.tokens.iter().enumerate() {
            let id = i as u32;
            let piece = match ty[i] {
                token_type::CONTROL | token_type::UNKNOWN => {
                    special.insert(id);
                    partition.push((t.clone(), id, true));
                    t.as_bytes().to_vec()
                }
                token_type::USER_DEFINED => {
                    partition.push((t.clone(), id, false));
                    t.as_bytes().to_vec()
                }
                token_type::UNUSED => {
                    special.insert(id);
                    t.as_bytes().to_vec()
                }
                token_type::BYTE if is_spm => {
                    byte_of(t).map_or_else(|| t.as_bytes().to_vec(), |b| vec![b])
                }
                _ if is_spm => t.replace(spm::SPACE, " ").into_bytes(),
                // Normal BPE tokens are stored byte-mapped; anything else is taken literally.
                _ => bytes.bytes_of(t).unwrap_or_else(|| t.as_bytes().to_vec()),
            };
            pieces.push(piece);
        }
        for (name, id) in [("bos", spec.bos_id), ("eos", spec.eos_id)] {
            if let Some(id) = id.filter(|&id| id as usize >= n) {
                return Err(Error::Tokenizer(format!(
                    "{name} id {id} out of range ({n} tokens)"
                )));
            }
        }
        let mut end_of_generation: Vec<u32> = spec.eos_id.into_iter().collect();
        let texts = spec
            .tokens
            .iter()
            .enumerate()
            .filter(|(_, t)| END_OF_GENERATION_TEXTS.contains(&t.as_str()));
        for id in spec
            .eot_ids
            .iter()
            .copied()
            .chain(texts.map(|(i, _)| i as u32))
        {
            if (id as usize) < n && !end_of_generation.contains(&id) {
                end_of_generation.push(id);
            }
        }
        Ok(Self {
            model,
            pieces,
            special,
            specials: Specials::new(partition),
            bos_id: spec.bos_id,
            eos_id: spec.eos_id,
            add_bos: spec.add_bos.unwrap_or(default_bos),
            add_eos: spec.add_eos,
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
    /// Whether [`Tokenizer::encode`] with `add_special` prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos && self.bos_id.is_some()
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

    /// Tokenize `text` as llama.cpp's `llama_tokenize`. `add_special`: BOS (and EOS) as
    /// the model asks for them. `parse_special`: control-token texts such as
    /// `<|im_start|>` become their ids instead of being tokenized as characters.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        self.encode_with(text, add_special, parse_special, false)
    }

    /// Tokenize a rendered chat template: control tokens parsed, except inside the message
    /// content that [`Tokenizer::protect`] marked, which stays text.
    pub fn encode_rendered(&self, text: &str, add_special: bool) -> Vec<u32> {
        self.encode_with(text, add_special, true, true)
    }

    fn encode_with(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        protected: bool,
    ) -> Vec<u32> {
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.extend(self.bos_id);
        }
        let mut prev_special = true;
        for f in self.specials.partition(text, parse_special) {
            match f {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(t) if protected => {
                    self.encode_plain(&unprotect(t), prev_special, &mut out);
                    prev_special = false;
                }
                Fragment::Text(t) => {
                    self.encode_plain(t, prev_special, &mut out);
                    prev_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos_id);
        }
        out
    }

    /// Text between special tokens; `after_special`: at the start or after a token (where
    /// SentencePiece adds its space prefix).
    fn encode_plain(&self, text: &str, after_special: bool, out: &mut Vec<u32>) {
        match &self.model {
            Model::Bpe { pre, bpe } => {
                for piece in pre.split(text) {
                    bpe.encode_piece(piece.as_bytes(), pre.ignore_merges, out);
                }
            }
            Model::Spm {
                spm,
                add_space_prefix,
            } => {
                if text.is_empty() {
                    return;
                }
                let mut s = String::with_capacity(text.len() + 3);
                if *add_space_prefix && after_special {
                    s.push(spm::SPACE);
                }
                s.extend(text.chars().map(|c| if c == ' ' { spm::SPACE } else { c }));
                spm.encode(&s, out);
            }
        }
    }

    /// Chat message content made safe to render into a template whose output is
    /// tokenized with special parsing: its control-token texts stay text.
    pub fn protect(&self, content: &str) -> String {
        self.specials.protect(content)
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

/// The byte of a SentencePiece `<0xXX>` token.
fn byte_of(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// The BPE merge table and byte tokens of a byte-level vocabulary.
fn bpe_tables(spec: &TokenizerSpec) -> Result<Bpe> {
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
        let (l, r) = m
            .split_once(' ')
            .ok_or_else(|| Error::Tokenizer(format!("merge {rank} '{m}' is not 'left right'")))?;
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
    let whole = spec
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    Ok(Bpe::new(merges, byte_ids, whole))
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
