//! Llama-family hyperparameters from GGUF metadata.

use crate::gguf::{Gguf, GgufError};

/// Upper bounds that keep a hostile file from sizing huge tables (the rope table and the
/// default KV pool scale with these).
const MAX_CONTEXT: usize = 1 << 20;
const MAX_LAYERS: usize = 1024;

#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub name: String,
    pub n_layers: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Dimensions of each head that rope rotates.
    pub rope_dim: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub context_length: usize,
    pub vocab_size: usize,
}

impl LlamaConfig {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    pub fn from_gguf(g: &Gguf) -> Result<Self, GgufError> {
        let arch = g.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(GgufError::UnsupportedArchitecture(arch.to_string()));
        }
        let key = |k: &str| format!("llama.{k}");
        let n_heads = g.get_usize(&key("attention.head_count"))?;
        let dim = g.get_usize(&key("embedding_length"))?;
        let n_kv_heads = match g.get(&key("attention.head_count_kv")) {
            Some(_) => g.get_usize(&key("attention.head_count_kv"))?,
            None => n_heads,
        };
        let bad = |k: &str, reason: String| GgufError::BadValue {
            key: key(k),
            reason,
        };
        if n_heads == 0 || dim % n_heads != 0 {
            return Err(bad(
                "attention.head_count",
                format!("{n_heads} heads do not divide embedding_length {dim}"),
            ));
        }
        if n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(bad(
                "attention.head_count_kv",
                format!("{n_kv_heads} KV heads do not divide {n_heads} heads"),
            ));
        }
        let head_dim = dim / n_heads;
        let rope_dim = match g.get(&key("rope.dimension_count")) {
            Some(_) => g.get_usize(&key("rope.dimension_count"))?,
            None => head_dim,
        };
        if rope_dim == 0 || rope_dim % 2 != 0 || rope_dim > head_dim {
            return Err(bad(
                "rope.dimension_count",
                format!("{rope_dim} must be even and at most the head size {head_dim}"),
            ));
        }
        let rope_base = match g.get(&key("rope.freq_base")) {
            Some(_) => g.get_f32(&key("rope.freq_base"))?,
            None => 10000.0,
        };
        let n_layers = g.get_usize(&key("block_count"))?;
        if n_layers == 0 || n_layers > MAX_LAYERS {
            return Err(bad(
                "block_count",
                format!("{n_layers} is outside 1..={MAX_LAYERS}"),
            ));
        }
        let context_length = g.get_usize(&key("context_length"))?;
        if context_length == 0 || context_length > MAX_CONTEXT {
            return Err(bad(
                "context_length",
                format!("{context_length} is outside 1..={MAX_CONTEXT}"),
            ));
        }
        let vocab_size = g.get_array("tokenizer.ggml.tokens")?.len();
        if vocab_size == 0 {
            return Err(GgufError::BadValue {
                key: "tokenizer.ggml.tokens".into(),
                reason: "empty vocabulary".into(),
            });
        }
        let name = g
            .get("general.name")
            .and_then(|v| v.as_str())
            .unwrap_or("llama")
            .to_string();
        Ok(Self {
            name,
            n_layers,
            dim,
            ffn_dim: g.get_usize(&key("feed_forward_length"))?,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dim,
            rope_base,
            rms_eps: g.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            context_length,
            vocab_size,
        })
    }
}
