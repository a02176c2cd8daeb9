//! A model's hyperparameters and per-layer description from GGUF metadata: the
//! architecture's [`Family`] combined with the `{arch}.*` keys, as llama.cpp reads them.

use tandem_kernels::RopeStyle;

use super::arch::{self, Activation, Family};
use crate::gguf::{Gguf, GgufArray, GgufError, GgufValue};

/// Upper bounds that keep a hostile file from sizing huge tables (the rope table and the
/// default KV pool scale with these).
const MAX_CONTEXT: usize = 1 << 20;
const MAX_LAYERS: usize = 1024;

/// One RoPE table: angles `pos · freq_scale · base^(-2i/rope_dim) / factor_i`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeSpec {
    pub base: f32,
    /// `1 / rope.scaling.factor` under linear scaling, else 1.
    pub freq_scale: f32,
    /// Divide by the file's `rope_freqs.weight` factors (Llama 3.1).
    pub factors: bool,
}

/// What differs between layers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerSpec {
    /// Sliding-window attention over this many positions; `None`: global.
    pub window: Option<usize>,
    /// Index of this layer's table in [`ModelConfig::ropes`].
    pub rope: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub family: &'static Family,
    pub name: String,
    pub n_layers: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Dimensions of each head that rope rotates.
    pub rope_dim: usize,
    pub rms_eps: f32,
    pub context_length: usize,
    pub vocab_size: usize,
    /// The distinct RoPE tables (one, or Gemma's local and global).
    pub ropes: Vec<RopeSpec>,
    pub layers: Vec<LayerSpec>,
    /// Token embeddings are multiplied by this (`sqrt(dim)` for Gemma).
    pub embed_scale: Option<f32>,
    /// Q is multiplied by this before attention, whose own scale is `1/sqrt(head_dim)`,
    /// where the family scales attention otherwise (Gemma 3 27B).
    pub q_scale: Option<f32>,
}

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    pub fn rope_style(&self) -> RopeStyle {
        self.family.rope
    }

    pub fn activation(&self) -> Activation {
        self.family.activation
    }

    pub fn from_gguf(g: &Gguf) -> Result<Self, GgufError> {
        let arch_name = g.get_str("general.architecture")?;
        let family = arch::family(arch_name).ok_or_else(|| GgufError::BadValue {
            key: "general.architecture".into(),
            reason: format!(
                "architecture '{arch_name}' is not supported (supported: {})",
                arch::supported_architectures()
            ),
        })?;
        let m = Meta { g, arch: arch_name };
        let n_heads = m.usize("attention.head_count")?;
        let dim = m.usize("embedding_length")?;
        let n_kv_heads = m.opt_usize("attention.head_count_kv")?.unwrap_or(n_heads);
        if n_heads == 0 {
            return Err(m.bad("attention.head_count", "0 heads".into()));
        }
        if n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(m.bad(
                "attention.head_count_kv",
                format!("{n_kv_heads} KV heads do not divide {n_heads} heads"),
            ));
        }
        // Qwen3 and Gemma 3 name the head size; Llama-style files leave it to dim / heads.
        let head_dim = match m.opt_usize("attention.key_length")? {
            Some(k) => k,
            None if dim.is_multiple_of(n_heads) => dim / n_heads,
            None => {
                return Err(m.bad(
                    "attention.head_count",
                    format!("{n_heads} heads do not divide embedding_length {dim}"),
                ));
            }
        };
        if let Some(v) = m.opt_usize("attention.value_length")?
            && v != head_dim
        {
            return Err(m.bad(
                "attention.value_length",
                format!("{v} differs from the key length {head_dim}; only equal K and V head sizes are supported"),
            ));
        }
        if head_dim == 0 {
            return Err(m.bad("attention.key_length", "heads of size 0".into()));
        }
        let rope_dim = m.opt_usize("rope.dimension_count")?.unwrap_or(head_dim);
        if rope_dim == 0 || !rope_dim.is_multiple_of(2) || rope_dim > head_dim {
            return Err(m.bad(
                "rope.dimension_count",
                format!("{rope_dim} must be even and at most the head size {head_dim}"),
            ));
        }
        let n_layers = m.usize("block_count")?;
        if n_layers == 0 || n_layers > MAX_LAYERS {
            return Err(m.bad(
                "block_count",
                format!("{n_layers} is outside 1..={MAX_LAYERS}"),
            ));
        }
        let context_length = m.usize("context_length")?;
        if context_length == 0 || context_length > MAX_CONTEXT {
            return Err(m.bad(
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
        if let Some(cap) = m.opt_f32("final_logit_softcapping")?
            && cap != 0.0
        {
            return Err(m.bad(
                "final_logit_softcapping",
                format!("{cap}: final logit soft-capping is not supported"),
            ));
        }
        let global = RopeSpec {
            base: m.opt_f32("rope.freq_base")?.unwrap_or(10_000.0),
            freq_scale: m.rope_freq_scale()?,
            factors: g.has_tensor("rope_freqs.weight"),
        };
        let (ropes, layers) = m.layers(family, n_layers, global)?;
        let name = g
            .get("general.name")
            .and_then(|v| v.as_str())
            .unwrap_or(arch_name)
            .to_string();
        let q_scale = attention_q_scale(family, n_layers, dim, n_heads, head_dim);
        Ok(Self {
            family,
            name,
            n_layers,
            dim,
            ffn_dim: m.usize("feed_forward_length")?,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dim,
            rms_eps: m.f32("attention.layer_norm_rms_epsilon")?,
            context_length,
            vocab_size,
            ropes,
            layers,
            embed_scale: family.embed_scale.then(|| (dim as f32).sqrt()),
            q_scale,
        })
    }
}

/// Gemma 3 27B scales attention by `1/sqrt(dim / n_heads)` instead of `1/sqrt(head_dim)`
/// (llama.cpp keys this on the 62-layer size): Q carries the ratio.
fn attention_q_scale(
    f: &Family,
    n_layers: usize,
    dim: usize,
    n_heads: usize,
    head_dim: usize,
) -> Option<f32> {
    (f.arch == "gemma3" && n_layers == 62 && dim / n_heads != head_dim)
        .then(|| (head_dim as f32).sqrt() / ((dim / n_heads) as f32).sqrt())
}

/// The `{arch}.*` keys of one file.
struct Meta<'a> {
    g: &'a Gguf,
    arch: &'a str,
}

impl Meta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    fn bad(&self, k: &str, reason: String) -> GgufError {
        GgufError::BadValue {
            key: self.key(k),
            reason,
        }
    }

    fn usize(&self, k: &str) -> Result<usize, GgufError> {
        self.g.get_usize(&self.key(k))
    }

    fn f32(&self, k: &str) -> Result<f32, GgufError> {
        self.g.get_f32(&self.key(k))
    }

    fn opt_usize(&self, k: &str) -> Result<Option<usize>, GgufError> {
        let key = self.key(k);
        self.g.get(&key).map(|_| self.g.get_usize(&key)).transpose()
    }

    fn opt_f32(&self, k: &str) -> Result<Option<f32>, GgufError> {
        let key = self.key(k);
        self.g.get(&key).map(|_| self.g.get_f32(&key)).transpose()
    }

    /// `rope.scaling.type` / `rope.scaling.factor`: none, or linear (angles divided by the
    /// factor). Anything else would silently compute another model: refused by name.
    fn rope_freq_scale(&self) -> Result<f32, GgufError> {
        let ty_key = self.key("rope.scaling.type");
        let ty = match self.g.get(&ty_key) {
            Some(_) => self.g.get_str(&ty_key)?,
            None => "none",
        };
        let factor = self.opt_f32("rope.scaling.factor")?;
        match ty {
            "none" => Ok(1.0),
            "linear" => match factor {
                Some(f) if f.is_finite() && f > 0.0 => Ok(1.0 / f),
                Some(f) => Err(self.bad("rope.scaling.factor", format!("{f} must be > 0"))),
                None => Ok(1.0),
            },
            other => Err(self.bad(
                "rope.scaling.type",
                format!("RoPE scaling '{other}' is not supported (supported: none, linear)"),
            )),
        }
    }

    /// Per-layer windows and RoPE tables: every layer global with `global`'s table, or,
    /// for a family with sliding windows in a file that names a window, llama.cpp's
    /// pattern (the last of every `period` layers global) with the sliding layers on
    /// their own table.
    fn layers(
        &self,
        f: &Family,
        n_layers: usize,
        global: RopeSpec,
    ) -> Result<(Vec<RopeSpec>, Vec<LayerSpec>), GgufError> {
        let all_global = || {
            let l = LayerSpec {
                window: None,
                rope: 0,
            };
            Ok((vec![global], vec![l; n_layers]))
        };
        let window = self.opt_usize("attention.sliding_window")?;
        let (Some(sw), Some(window)) = (f.sliding, window.filter(|w| *w > 0)) else {
            if f.sliding.is_none() && window.is_some_and(|w| w > 0) && f.arch != "llama" {
                return Err(self.bad(
                    "attention.sliding_window",
                    format!("the {} architecture has no sliding-window layers", f.arch),
                ));
            }
            // Llama-architecture Mistral files name a window that llama.cpp ignores.
            return all_global();
        };
        let sliding = self.sliding_layers(sw.period, n_layers)?;
        let local = RopeSpec {
            base: self.opt_f32("rope.freq_base_swa")?.unwrap_or(sw.rope_base),
            freq_scale: 1.0,
            factors: false,
        };
        let layers = sliding
            .iter()
            .map(|&s| LayerSpec {
                window: s.then_some(window),
                rope: usize::from(s),
            })
            .collect();
        Ok((vec![global, local], layers))
    }

    /// Which layers slide: `attention.sliding_window_pattern` as a per-layer array of
    /// booleans or as a period (llama.cpp: layer `il` slides when `il % n < n - 1`; a
    /// period of 0 makes every layer slide), else the family's period.
    fn sliding_layers(&self, default: usize, n_layers: usize) -> Result<Vec<bool>, GgufError> {
        let key = self.key("attention.sliding_window_pattern");
        let period = match self.g.get(&key) {
            None => default,
            Some(GgufValue::Array(GgufArray::Bool(v))) => {
                if v.len() != n_layers {
                    return Err(self.bad(
                        "attention.sliding_window_pattern",
                        format!("{} entries for {n_layers} layers", v.len()),
                    ));
                }
                return Ok(v.clone());
            }
            Some(_) => self.g.get_usize(&key)?,
        };
        Ok((0..n_layers)
            .map(|il| period == 0 || il % period < period - 1)
            .collect())
    }
}
