//! Tiny random models written as GGUF, for tests (here and in the serving layer) that need
//! a real forward pass but not real weights: every architecture the engine serves
//! ([`TinyArch`]), with the tensors and metadata that architecture's files carry.

use tandem_kernels::{GgmlType, quantize_row};

use crate::gguf::writer::GgufWriter;
use crate::gguf::{GgufArray, GgufValue};

/// The architecture of a synthetic model, with what its files carry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TinyArch {
    /// Plain Llama; optionally Llama 3.1's `rope_freqs` factors and linear RoPE scaling
    /// (`rope.scaling.factor`).
    Llama {
        rope_freqs: bool,
        linear_scaling: Option<f32>,
    },
    /// Q/K/V biases, NEOX RoPE.
    Qwen2,
    /// Per-head Q/K norms, NEOX RoPE, a head size that is not `dim / heads`.
    Qwen3,
    /// Embedding scale, Q/K norms, sandwich norms, GeGLU, sliding windows of `window`
    /// positions on 5 of 6 layers with RoPE base 1e4 there (1e6 on the global layers).
    Gemma3 { window: usize },
}

impl TinyArch {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Llama { .. } => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Gemma3 { .. } => "gemma3",
        }
    }

    pub const PLAIN_LLAMA: TinyArch = TinyArch::Llama {
        rope_freqs: false,
        linear_scaling: None,
    };
}

#[derive(Debug, Clone)]
pub struct TinyLlama {
    pub arch: TinyArch,
    pub n_layers: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Head size written as `attention.key_length`; `None`: `dim / n_heads`, unwritten.
    pub head_dim: Option<usize>,
    pub vocab: usize,
    pub context_length: usize,
    /// Type of the projection matrices.
    pub weight_type: GgmlType,
    /// Type of the token embedding.
    pub embd_type: GgmlType,
    /// Write a separate `output.weight` (else the embedding is tied).
    pub untied_output: bool,
    pub seed: u64,
}

impl Default for TinyLlama {
    fn default() -> Self {
        Self {
            arch: TinyArch::PLAIN_LLAMA,
            n_layers: 2,
            dim: 128,
            ffn_dim: 192,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: None,
            vocab: 96,
            context_length: 256,
            weight_type: GgmlType::Q4_1,
            embd_type: GgmlType::Q8_0,
            untied_output: false,
            seed: 1,
        }
    }
}

impl TinyLlama {
    /// A small model of `arch` with the shapes that exercise it: Qwen3 with heads of 64
    /// over a width of 128 split 4 ways (64 ≠ 32), Gemma 3 with 6 layers (5 sliding, 1
    /// global) and one KV head.
    pub fn of(arch: TinyArch) -> Self {
        let base = Self {
            arch,
            ..Self::default()
        };
        match arch {
            TinyArch::Qwen3 => Self {
                head_dim: Some(64),
                ..base
            },
            TinyArch::Gemma3 { .. } => Self {
                n_layers: 6,
                n_heads: 2,
                n_kv_heads: 1,
                head_dim: Some(96),
                dim: 160,
                ffn_dim: 224,
                ..base
            },
            _ => base,
        }
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        // SplitMix64: reproducible across platforms, no dependency.
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// Writes tensors of random values.
struct Tensors<'a> {
    rng: Rng,
    w: &'a mut GgufWriter,
}

impl Tensors<'_> {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize, ty: GgmlType, scale: f32) {
        let vals: Vec<f32> = (0..rows * cols).map(|_| self.rng.next() * scale).collect();
        let rb = ty.row_bytes(cols).expect("tiny dims are multiples of 32");
        let mut data = vec![0u8; rows * rb];
        for (src, dst) in vals.chunks(cols).zip(data.chunks_mut(rb)) {
            quantize_row(ty, src, dst).expect("sizes match");
        }
        self.w.tensor(name, &[cols as u64, rows as u64], ty, data);
    }

    /// An F32 vector `center + spread · uniform(-1, 1)`.
    fn vector(&mut self, name: &str, n: usize, center: f32, spread: f32) {
        let v: Vec<f32> = (0..n).map(|_| center + spread * self.rng.next()).collect();
        self.w.tensor(
            name,
            &[n as u64],
            GgmlType::F32,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        );
    }
}

impl TinyLlama {
    /// The default model with dimensions that are whole blocks of `ty` (the K-quants'
    /// rows are multiples of 256).
    pub fn fitting(ty: GgmlType) -> Self {
        let d = Self::default();
        Self {
            dim: d.dim.next_multiple_of(ty.block_len()),
            ffn_dim: d.ffn_dim.next_multiple_of(ty.block_len()),
            ..d
        }
    }

    pub fn head_size(&self) -> usize {
        self.head_dim.unwrap_or(self.dim / self.n_heads)
    }

    pub fn to_writer(&self) -> GgufWriter {
        let mut w = GgufWriter::new();
        let hd = self.head_size();
        let arch = self.arch.name();
        let u32v = |v: usize| GgufValue::U32(v as u32);
        let key = |k: &str| format!("{arch}.{k}");
        w.meta("general.architecture", GgufValue::String(arch.into()))
            .meta("general.name", GgufValue::String(format!("tiny-{arch}")))
            .meta(&key("block_count"), u32v(self.n_layers))
            .meta(&key("context_length"), u32v(self.context_length))
            .meta(&key("embedding_length"), u32v(self.dim))
            .meta(&key("feed_forward_length"), u32v(self.ffn_dim))
            .meta(&key("attention.head_count"), u32v(self.n_heads))
            .meta(&key("attention.head_count_kv"), u32v(self.n_kv_heads))
            .meta(&key("rope.dimension_count"), u32v(hd))
            .meta(
                &key("attention.layer_norm_rms_epsilon"),
                GgufValue::F32(1e-5),
            );
        let base = match self.arch {
            TinyArch::Llama { .. } => 10_000.0,
            _ => 1_000_000.0,
        };
        w.meta(&key("rope.freq_base"), GgufValue::F32(base));
        if let Some(h) = self.head_dim {
            w.meta(&key("attention.key_length"), u32v(h))
                .meta(&key("attention.value_length"), u32v(h));
        }
        if let TinyArch::Llama {
            linear_scaling: Some(f),
            ..
        } = self.arch
        {
            w.meta(
                &key("rope.scaling.type"),
                GgufValue::String("linear".into()),
            )
            .meta(&key("rope.scaling.factor"), GgufValue::F32(f));
        }
        if let TinyArch::Gemma3 { window } = self.arch {
            w.meta(&key("attention.sliding_window"), u32v(window));
        }
        // A tokenizer by name (support checks pass); its tokens are not byte-level,
        // so only the runner can load these files, not the serving stack.
        w.meta("tokenizer.ggml.model", GgufValue::String("gpt2".into()))
            .meta("tokenizer.ggml.pre", GgufValue::String("smollm".into()))
            .meta(
                "tokenizer.ggml.tokens",
                GgufValue::Array(GgufArray::String(
                    (0..self.vocab).map(|i| format!("<t{i}>")).collect(),
                )),
            );
        self.tensors(&mut w);
        w
    }

    fn tensors(&self, w: &mut GgufWriter) {
        let mut t = Tensors {
            rng: Rng(self.seed),
            w,
        };
        let hd = self.head_size();
        let (d, qd, kvd, f) = (
            self.dim,
            self.n_heads * hd,
            self.n_kv_heads * hd,
            self.ffn_dim,
        );
        let wt = self.weight_type;
        // Scales keep activations O(1) through the layers, like trained weights do.
        let s_in = 1.0 / (d as f32).sqrt() * 1.7;
        let s_q = 1.0 / (qd as f32).sqrt() * 1.7;
        let gemma = matches!(self.arch, TinyArch::Gemma3 { .. });
        // Gemma's embedding is multiplied by sqrt(dim): keep it small here.
        let embd_scale = if gemma { 1.0 / (d as f32).sqrt() } else { 1.0 };
        t.matrix(
            "token_embd.weight",
            self.vocab,
            d,
            self.embd_type,
            embd_scale,
        );
        if let TinyArch::Llama {
            rope_freqs: true, ..
        } = self.arch
        {
            // Llama 3.1's shape: 1 for the fast pairs, growing to 8 for the slow ones.
            let n = hd / 2;
            let factors: Vec<f32> = (0..n).map(|i| 1.0 + 7.0 * i as f32 / n as f32).collect();
            t.w.tensor(
                "rope_freqs.weight",
                &[n as u64],
                GgmlType::F32,
                factors.iter().flat_map(|x| x.to_le_bytes()).collect(),
            );
        }
        for l in 0..self.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            let b = |s: &str| format!("blk.{l}.{s}.bias");
            t.vector(&n("attn_norm"), d, 1.0, 0.2);
            t.matrix(&n("attn_q"), qd, d, wt, s_in * 2.0);
            t.matrix(&n("attn_k"), kvd, d, wt, s_in * 2.0);
            t.matrix(&n("attn_v"), kvd, d, wt, s_in);
            t.matrix(&n("attn_output"), d, qd, wt, s_q);
            if self.arch == TinyArch::Qwen2 {
                t.vector(&b("attn_q"), qd, 0.0, 0.5);
                t.vector(&b("attn_k"), kvd, 0.0, 0.5);
                t.vector(&b("attn_v"), kvd, 0.0, 0.3);
            }
            if matches!(self.arch, TinyArch::Qwen3 | TinyArch::Gemma3 { .. }) {
                t.vector(&n("attn_q_norm"), hd, 1.0, 0.3);
                t.vector(&n("attn_k_norm"), hd, 1.0, 0.3);
            }
            if gemma {
                t.vector(&n("post_attention_norm"), d, 0.5, 0.2);
            }
            t.vector(&n("ffn_norm"), d, 1.0, 0.2);
            t.matrix(&n("ffn_gate"), f, d, wt, s_in);
            t.matrix(&n("ffn_up"), f, d, wt, s_in);
            t.matrix(&n("ffn_down"), d, f, wt, 1.0 / (f as f32).sqrt());
            if gemma {
                t.vector(&n("post_ffw_norm"), d, 0.5, 0.2);
            }
        }
        t.vector("output_norm.weight", d, 1.0, 0.1);
        if self.untied_output {
            t.matrix("output.weight", self.vocab, d, wt, s_in * 4.0);
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.to_writer().to_bytes()
    }
}
