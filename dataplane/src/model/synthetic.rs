//! Tiny random Llama models written as GGUF, for tests (here and in the serving layer)
//! that need a real forward pass but not real weights.

use tandem_kernels::{GgmlType, quantize_row};

use crate::gguf::writer::GgufWriter;
use crate::gguf::{GgufArray, GgufValue};

#[derive(Debug, Clone)]
pub struct TinyLlama {
    pub n_layers: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
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
            n_layers: 2,
            dim: 128,
            ffn_dim: 192,
            n_heads: 4,
            n_kv_heads: 2,
            vocab: 96,
            context_length: 256,
            weight_type: GgmlType::Q4_1,
            embd_type: GgmlType::Q8_0,
            untied_output: false,
            seed: 1,
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

    pub fn to_writer(&self) -> GgufWriter {
        let mut rng = Rng(self.seed);
        let mut w = GgufWriter::new();
        let head_dim = self.dim / self.n_heads;
        let u32v = |v: usize| GgufValue::U32(v as u32);
        w.meta("general.architecture", GgufValue::String("llama".into()))
            .meta("general.name", GgufValue::String("tiny-llama".into()))
            .meta("llama.block_count", u32v(self.n_layers))
            .meta("llama.context_length", u32v(self.context_length))
            .meta("llama.embedding_length", u32v(self.dim))
            .meta("llama.feed_forward_length", u32v(self.ffn_dim))
            .meta("llama.attention.head_count", u32v(self.n_heads))
            .meta("llama.attention.head_count_kv", u32v(self.n_kv_heads))
            .meta("llama.rope.freq_base", GgufValue::F32(10000.0))
            .meta("llama.rope.dimension_count", u32v(head_dim))
            .meta(
                "llama.attention.layer_norm_rms_epsilon",
                GgufValue::F32(1e-5),
            )
            .meta(
                "tokenizer.ggml.tokens",
                GgufValue::Array(GgufArray::String(
                    (0..self.vocab).map(|i| format!("<t{i}>")).collect(),
                )),
            );
        let mat = |rng: &mut Rng,
                   w: &mut GgufWriter,
                   name: &str,
                   rows: usize,
                   cols: usize,
                   ty: GgmlType,
                   scale: f32| {
            let vals: Vec<f32> = (0..rows * cols).map(|_| rng.next() * scale).collect();
            let rb = ty.row_bytes(cols).expect("tiny dims are multiples of 32");
            let mut data = vec![0u8; rows * rb];
            for (src, dst) in vals.chunks(cols).zip(data.chunks_mut(rb)) {
                quantize_row(ty, src, dst).expect("sizes match");
            }
            let dims: Vec<u64> = if rows == 1 {
                vec![cols as u64]
            } else {
                vec![cols as u64, rows as u64]
            };
            w.tensor(name, &dims, ty, data);
        };
        let (d, kvd, f) = (self.dim, self.n_kv_heads * head_dim, self.ffn_dim);
        // Scales keep activations O(1) through the layers, like trained weights do.
        let s_in = 1.0 / (d as f32).sqrt() * 1.7;
        mat(
            &mut rng,
            &mut w,
            "token_embd.weight",
            self.vocab,
            d,
            self.embd_type,
            1.0,
        );
        for l in 0..self.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            let norm: Vec<f32> = (0..d).map(|_| 1.0 + 0.2 * rng.next()).collect();
            w.tensor(
                &n("attn_norm"),
                &[d as u64],
                GgmlType::F32,
                norm.iter().flat_map(|v| v.to_le_bytes()).collect(),
            );
            mat(
                &mut rng,
                &mut w,
                &n("attn_q"),
                d,
                d,
                self.weight_type,
                s_in * 2.0,
            );
            mat(
                &mut rng,
                &mut w,
                &n("attn_k"),
                kvd,
                d,
                self.weight_type,
                s_in * 2.0,
            );
            mat(
                &mut rng,
                &mut w,
                &n("attn_v"),
                kvd,
                d,
                self.weight_type,
                s_in,
            );
            mat(
                &mut rng,
                &mut w,
                &n("attn_output"),
                d,
                d,
                self.weight_type,
                s_in,
            );
            let norm: Vec<f32> = (0..d).map(|_| 1.0 + 0.2 * rng.next()).collect();
            w.tensor(
                &n("ffn_norm"),
                &[d as u64],
                GgmlType::F32,
                norm.iter().flat_map(|v| v.to_le_bytes()).collect(),
            );
            mat(
                &mut rng,
                &mut w,
                &n("ffn_gate"),
                f,
                d,
                self.weight_type,
                s_in,
            );
            mat(&mut rng, &mut w, &n("ffn_up"), f, d, self.weight_type, s_in);
            mat(
                &mut rng,
                &mut w,
                &n("ffn_down"),
                d,
                f,
                self.weight_type,
                1.0 / (f as f32).sqrt(),
            );
        }
        let norm: Vec<f32> = (0..d).map(|_| 1.0 + 0.1 * rng.next()).collect();
        w.tensor(
            "output_norm.weight",
            &[d as u64],
            GgmlType::F32,
            norm.iter().flat_map(|v| v.to_le_bytes()).collect(),
        );
        if self.untied_output {
            mat(
                &mut rng,
                &mut w,
                "output.weight",
                self.vocab,
                d,
                self.weight_type,
                s_in * 4.0,
            );
        }
        w
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.to_writer().to_bytes()
    }
}
