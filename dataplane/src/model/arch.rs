//! Architectures as data. A [`Family`] says what a `general.architecture` computes
//! differently from the plain Llama block, independent of the model's size; the loader
//! combines it with the file's metadata ([`super::config::ModelConfig`]) and tensor names
//! ([`super::weights::Weights`]) into the description the one forward pass reads
//! ([`super::forward::forward`]). Adding an architecture is one entry in [`FAMILIES`] (and,
//! only for a genuinely new operation, a backend kernel), never a second forward pass.
//!
//! The block every family shares (pre-norm residual transformer):
//!
//! ```text
//! x = embed(tokens) [· sqrt(dim)]
//! per layer:
//!   h = rmsnorm(x, attn_norm)
//!   q, k, v = h·Wq [+ bq], h·Wk [+ bk], h·Wv [+ bv]
//!   [q, k = rmsnorm per head (attn_q_norm, attn_k_norm)]
//!   q, k = rope(q, k)                   style and base per layer
//!   o = attention(q, K, V)[·Wo + bo]    window per layer
//!   x += [rmsnorm(o, post_attention_norm)] o
//!   h = rmsnorm(x, ffn_norm)
//!   f = act(h·Wgate) · h·Wup · Wdown    act: SiLU or tanh-GELU
//!   x += [rmsnorm(f, post_ffw_norm)] f
//! logits = rmsnorm(x, output_norm) · Wout   (Wout = token_embd when tied)
//! ```
//! Bracketed steps happen when the tensors exist (biases, Q/K norms, sandwich norms) or
//! when the family says so (embedding scale, windows).

use tandem_kernels::RopeStyle;

/// The feed-forward gate's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU: `silu(gate) · up`.
    Silu,
    /// GeGLU: `gelu(gate) · up`, GELU's tanh approximation.
    GeluTanh,
}

/// Whether a family's files carry a tensor group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// Never: a file of this family that has them is refused (its weights would be
    /// ignored otherwise).
    Never,
    /// When the file has them.
    Optional,
    /// Always: a file without them is refused.
    Required,
}

/// Sliding-window attention on some layers, as llama.cpp derives it for the family.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlidingWindow {
    /// In each run of `period` layers the last is global, the others slide
    /// (`{arch}.attention.sliding_window_pattern` overrides it).
    pub period: usize,
    /// RoPE base of the sliding layers when `{arch}.rope.freq_base_swa` is absent (the
    /// global layers use `{arch}.rope.freq_base`).
    pub rope_base: f32,
}

/// What an architecture computes differently from the plain Llama block.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Family {
    /// `general.architecture`.
    pub arch: &'static str,
    pub rope: RopeStyle,
    pub activation: Activation,
    /// Token embeddings are multiplied by `sqrt(embedding_length)`.
    pub embed_scale: bool,
    /// `attn_{q,k,v}.bias` (and `attn_output.bias`).
    pub qkv_bias: Presence,
    /// Per-head RMS norms of Q and K before RoPE (`attn_q_norm`, `attn_k_norm`).
    pub qk_norm: Presence,
    /// Norms of the attention and FFN outputs before their residual adds
    /// (`post_attention_norm`, `post_ffw_norm`: Gemma's sandwich).
    pub post_norms: Presence,
    /// `rope_freqs.weight`: per-pair frequency factors (Llama 3.1).
    pub rope_freqs: Presence,
    /// Sliding-window layers when the file names a window (`attention.sliding_window`).
    pub sliding: Option<SlidingWindow>,
}

const LLAMA: Family = Family {
    arch: "llama",
    // The GGUF converter permutes Llama's Q/K rows so that adjacent pairs rotate.
    rope: RopeStyle::Normal,
    activation: Activation::Silu,
    embed_scale: false,
    qkv_bias: Presence::Optional,
    qk_norm: Presence::Never,
    post_norms: Presence::Never,
    rope_freqs: Presence::Optional,
    sliding: None,
};

/// Every architecture this engine serves; [`family`] looks one up.
pub const FAMILIES: &[Family] = &[
    LLAMA,
    Family {
        arch: "qwen2",
        rope: RopeStyle::Neox,
        qkv_bias: Presence::Required,
        rope_freqs: Presence::Never,
        ..LLAMA
    },
    Family {
        arch: "qwen3",
        rope: RopeStyle::Neox,
        qkv_bias: Presence::Never,
        qk_norm: Presence::Required,
        rope_freqs: Presence::Never,
        ..LLAMA
    },
    Family {
        arch: "gemma3",
        rope: RopeStyle::Neox,
        activation: Activation::GeluTanh,
        embed_scale: true,
        qkv_bias: Presence::Never,
        qk_norm: Presence::Required,
        post_norms: Presence::Required,
        rope_freqs: Presence::Never,
        sliding: Some(SlidingWindow {
            period: 6,
            rope_base: 10_000.0,
        }),
    },
];

/// The family of `general.architecture = arch`.
pub fn family(arch: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.arch == arch)
}

/// `llama, qwen2, …` for refusals.
pub fn supported_architectures() -> String {
    FAMILIES
        .iter()
        .map(|f| f.arch)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_found_by_its_name_once() {
        for f in FAMILIES {
            assert_eq!(family(f.arch), Some(f));
            assert_eq!(FAMILIES.iter().filter(|g| g.arch == f.arch).count(), 1);
        }
        assert_eq!(family("phi3"), None);
        assert_eq!(supported_architectures(), "llama, qwen2, qwen3, gemma3");
    }
}
