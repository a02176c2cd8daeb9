//! Weight tensors located in the mapped GGUF file. Matrices stay in their stored
//! (quantized) format; only the small vectors (norms, biases, RoPE factors) are decoded to
//! f32 at load. Which optional tensors a layer has is read from the file's tensor names and
//! held against the architecture's [`Family`]: a file with a tensor no step of the forward
//! pass would read is refused, naming it, rather than served without it.

use std::collections::HashSet;
use std::sync::Arc;

use tandem_kernels::{GgmlType, HostMatrix, Layout, Matrix, SharedBytes, dequantize_row};

use super::arch::{Family, Presence};
use super::config::ModelConfig;
use crate::gguf::{Gguf, GgufError};

/// A matrix inside the file: `rows` × `cols` of `ty` starting at byte `start`.
#[derive(Debug, Clone, Copy)]
pub struct WeightRef {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    start: usize,
    len: usize,
}

impl WeightRef {
    /// This matrix inside `file` (the bytes it was located in), kept alive by the handle.
    pub fn host(&self, file: &SharedBytes) -> tandem_kernels::Result<HostMatrix> {
        HostMatrix::new(
            self.ty,
            self.rows,
            self.cols,
            file.clone(),
            self.start,
            self.len,
        )
    }

    /// Whether two references name the same bytes (a tied output projection).
    pub fn same_place(&self, other: &WeightRef) -> bool {
        (self.start, self.len) == (other.start, other.len)
    }

    pub fn matrix<'a>(&self, file: &'a [u8]) -> Matrix<'a> {
        Matrix {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            data: &file[self.start..self.start + self.len],
            layout: Layout::Gguf,
        }
    }
}

/// Biases of the attention projections (Qwen2).
#[derive(Debug, Clone)]
pub struct AttnBias {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: WeightRef,
    pub wk: WeightRef,
    pub wv: WeightRef,
    pub wo: WeightRef,
    pub qkv_bias: Option<AttnBias>,
    /// `attn_output.bias`.
    pub wo_bias: Option<Vec<f32>>,
    /// Per-head norms of Q and K (`head_dim` each).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// Norm of the attention output before its residual add (Gemma).
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: WeightRef,
    pub w_up: WeightRef,
    pub w_down: WeightRef,
    /// Norm of the FFN output before its residual add (Gemma).
    pub post_ffn_norm: Option<Vec<f32>>,
}

#[derive(Debug)]
pub struct Weights {
    pub gguf: Arc<Gguf>,
    pub token_embd: WeightRef,
    pub output_norm: Vec<f32>,
    /// `output.weight`, or the token embedding when the model ties them.
    pub output: WeightRef,
    pub layers: Vec<LayerWeights>,
    /// `rope_freqs.weight`: one frequency factor per rotated pair (Llama 3.1).
    pub rope_freqs: Option<Vec<f32>>,
}

/// Reads tensors by name and remembers which it read, so that what is left over can be
/// refused.
struct Reader<'a> {
    g: &'a Gguf,
    family: &'static Family,
    used: HashSet<String>,
}

impl Reader<'_> {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<WeightRef, GgufError> {
        let g = self.g;
        let t = g.tensor(name)?;
        if t.dims != [cols as u64, rows as u64] {
            return Err(GgufError::Tensor {
                tensor: name.to_string(),
                reason: format!("shape {:?}, expected [{cols}, {rows}]", t.dims),
            });
        }
        let data = g.tensor_data(t);
        // The kernels accept exactly this; checking here makes later use infallible.
        Matrix::new(t.ty, rows, cols, data).map_err(|e| GgufError::Tensor {
            tensor: name.to_string(),
            reason: e.to_string(),
        })?;
        self.used.insert(name.to_string());
        Ok(WeightRef {
            ty: t.ty,
            rows,
            cols,
            start: data.as_ptr() as usize - g.bytes().as_ptr() as usize,
            len: data.len(),
        })
    }

    fn vector(&mut self, name: &str, n: usize) -> Result<Vec<f32>, GgufError> {
        let t = self.g.tensor(name)?;
        if t.dims != [n as u64] {
            return Err(GgufError::Tensor {
                tensor: name.to_string(),
                reason: format!("shape {:?}, expected [{n}]", t.dims),
            });
        }
        let mut v = vec![0f32; n];
        dequantize_row(t.ty, self.g.tensor_data(t), &mut v).map_err(|e| GgufError::Tensor {
            tensor: name.to_string(),
            reason: e.to_string(),
        })?;
        self.used.insert(name.to_string());
        Ok(v)
    }

    /// The vectors `names` (each of `n` values) as the family's `presence` of `what`
    /// allows: all present or all absent, required ones present.
    fn group(
        &mut self,
        presence: Presence,
        what: &str,
        names: &[(&str, usize)],
    ) -> Result<Option<Vec<Vec<f32>>>, GgufError> {
        let found: Vec<bool> = names.iter().map(|(n, _)| self.g.has_tensor(n)).collect();
        let arch = self.family.arch;
        match (presence, found.iter().any(|f| *f)) {
            (_, false) if presence != Presence::Required => return Ok(None),
            (Presence::Never, true) => {
                let name = names[found.iter().position(|f| *f).unwrap_or(0)].0;
                return Err(GgufError::Tensor {
                    tensor: name.to_string(),
                    reason: format!("{what} are not part of the {arch} architecture"),
                });
            }
            _ => {}
        }
        if let Some(i) = found.iter().position(|f| !*f) {
            return Err(GgufError::Tensor {
                tensor: names[i].0.to_string(),
                reason: format!("missing: the {arch} architecture has {what}"),
            });
        }
        names
            .iter()
            .map(|(n, len)| self.vector(n, *len))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}

impl Weights {
    pub fn load(g: Arc<Gguf>, c: &ModelConfig) -> Result<Self, GgufError> {
        let mut r = Reader {
            g: &g,
            family: c.family,
            used: HashSet::new(),
        };
        let token_embd = r.matrix("token_embd.weight", c.vocab_size, c.dim)?;
        let output = if g.has_tensor("output.weight") {
            r.matrix("output.weight", c.vocab_size, c.dim)?
        } else {
            token_embd
        };
        let rope_freqs = r
            .group(
                c.family.rope_freqs,
                "RoPE frequency factors",
                &[("rope_freqs.weight", c.rope_dim / 2)],
            )?
            .and_then(|mut v| v.pop());
        let (d, hd, qd, kvd) = (c.dim, c.head_dim, c.q_dim(), c.kv_dim());
        let f = c.family;
        let layers = (0..c.n_layers)
            .map(|i| {
                let n = |s: &str| format!("blk.{i}.{s}");
                let qkv_bias = r
                    .group(
                        f.qkv_bias,
                        "attention projection biases",
                        &[
                            (&n("attn_q.bias"), qd),
                            (&n("attn_k.bias"), kvd),
                            (&n("attn_v.bias"), kvd),
                        ],
                    )?
                    .map(|mut v| AttnBias {
                        v: v.pop().unwrap_or_default(),
                        k: v.pop().unwrap_or_default(),
                        q: v.pop().unwrap_or_default(),
                    });
                let wo_bias = r
                    .group(
                        if f.qkv_bias == Presence::Never {
                            Presence::Never
                        } else {
                            Presence::Optional
                        },
                        "attention output biases",
                        &[(&n("attn_output.bias"), d)],
                    )?
                    .and_then(|mut v| v.pop());
                let qk = r.group(
                    f.qk_norm,
                    "per-head Q/K norms",
                    &[
                        (&n("attn_q_norm.weight"), hd),
                        (&n("attn_k_norm.weight"), hd),
                    ],
                )?;
                let post = r.group(
                    f.post_norms,
                    "post-attention and post-FFN norms",
                    &[
                        (&n("post_attention_norm.weight"), d),
                        (&n("post_ffw_norm.weight"), d),
                    ],
                )?;
                let (q_norm, k_norm) = split2(qk);
                let (post_attn_norm, post_ffn_norm) = split2(post);
                Ok(LayerWeights {
                    attn_norm: r.vector(&n("attn_norm.weight"), d)?,
                    wq: r.matrix(&n("attn_q.weight"), qd, d)?,
                    wk: r.matrix(&n("attn_k.weight"), kvd, d)?,
                    wv: r.matrix(&n("attn_v.weight"), kvd, d)?,
                    wo: r.matrix(&n("attn_output.weight"), d, qd)?,
                    qkv_bias,
                    wo_bias,
                    q_norm,
                    k_norm,
                    post_attn_norm,
                    ffn_norm: r.vector(&n("ffn_norm.weight"), d)?,
                    w_gate: r.matrix(&n("ffn_gate.weight"), c.ffn_dim, d)?,
                    w_up: r.matrix(&n("ffn_up.weight"), c.ffn_dim, d)?,
                    w_down: r.matrix(&n("ffn_down.weight"), d, c.ffn_dim)?,
                    post_ffn_norm,
                })
            })
            .collect::<Result<_, GgufError>>()?;
        let output_norm = r.vector("output_norm.weight", c.dim)?;
        if let Some(t) = g.tensors().iter().find(|t| !r.used.contains(&t.name)) {
            return Err(GgufError::Tensor {
                tensor: t.name.clone(),
                reason: format!(
                    "not a tensor of the {} architecture as this engine computes it \
                     (serving the model without it would compute another model)",
                    f.arch
                ),
            });
        }
        Ok(Self {
            output_norm,
            token_embd,
            output,
            layers,
            rope_freqs,
            gguf: g,
        })
    }

    pub fn file(&self) -> &[u8] {
        self.gguf.bytes()
    }

    /// The mapped file as bytes that backends may hold on to.
    pub fn bytes(&self) -> SharedBytes {
        self.gguf.clone()
    }

    /// `r`'s pages are no longer read (its backend copied it): drop them from the RSS.
    /// Best effort: a refusal costs memory, not correctness, so it is logged, not raised.
    pub fn release(&self, name: &str, r: &WeightRef) {
        if let Err(e) = self.gguf.release_pages(r.start, r.len) {
            tracing::warn!(tensor = name, error = %e, "could not release the mapped pages of a copied weight");
        }
    }
}

/// The two vectors of a pair group.
fn split2(v: Option<Vec<Vec<f32>>>) -> (Option<Vec<f32>>, Option<Vec<f32>>) {
    match v {
        Some(mut v) if v.len() == 2 => {
            let b = v.pop();
            (v.pop(), b)
        }
        _ => (None, None),
    }
}
