//! Weight tensors located in the mapped GGUF file. Matrices stay in their stored
//! (quantized) format; only the small norm vectors are decoded to f32 at load.

use std::sync::Arc;

use tandem_kernels::{GgmlType, HostMatrix, Layout, Matrix, SharedBytes, dequantize_row};

use super::config::LlamaConfig;
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

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: WeightRef,
    pub wk: WeightRef,
    pub wv: WeightRef,
    pub wo: WeightRef,
    pub ffn_norm: Vec<f32>,
    pub w_gate: WeightRef,
    pub w_up: WeightRef,
    pub w_down: WeightRef,
}

#[derive(Debug)]
pub struct Weights {
    pub gguf: Arc<Gguf>,
    pub token_embd: WeightRef,
    pub output_norm: Vec<f32>,
    /// `output.weight`, or the token embedding when the model ties them.
    pub output: WeightRef,
    pub layers: Vec<LayerWeights>,
}

fn matrix(g: &Gguf, name: &str, rows: usize, cols: usize) -> Result<WeightRef, GgufError> {
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
    Ok(WeightRef {
        ty: t.ty,
        rows,
        cols,
        start: data.as_ptr() as usize - g.bytes().as_ptr() as usize,
        len: data.len(),
    })
}

fn vector(g: &Gguf, name: &str, n: usize) -> Result<Vec<f32>, GgufError> {
    let t = g.tensor(name)?;
    if t.dims != [n as u64] {
        return Err(GgufError::Tensor {
            tensor: name.to_string(),
            reason: format!("shape {:?}, expected [{n}]", t.dims),
        });
    }
    let mut v = vec![0f32; n];
    dequantize_row(t.ty, g.tensor_data(t), &mut v).map_err(|e| GgufError::Tensor {
        tensor: name.to_string(),
        reason: e.to_string(),
    })?;
    Ok(v)
}

impl Weights {
    pub fn load(g: Arc<Gguf>, c: &LlamaConfig) -> Result<Self, GgufError> {
        let token_embd = matrix(&g, "token_embd.weight", c.vocab_size, c.dim)?;
        let output = match g.tensor("output.weight") {
            Ok(_) => matrix(&g, "output.weight", c.vocab_size, c.dim)?,
            Err(_) => token_embd,
        };
        let layers = (0..c.n_layers)
            .map(|i| {
                let n = |s: &str| format!("blk.{i}.{s}.weight");
                Ok(LayerWeights {
                    attn_norm: vector(&g, &n("attn_norm"), c.dim)?,
                    wq: matrix(&g, &n("attn_q"), c.q_dim(), c.dim)?,
                    wk: matrix(&g, &n("attn_k"), c.kv_dim(), c.dim)?,
                    wv: matrix(&g, &n("attn_v"), c.kv_dim(), c.dim)?,
                    wo: matrix(&g, &n("attn_output"), c.dim, c.q_dim())?,
                    ffn_norm: vector(&g, &n("ffn_norm"), c.dim)?,
                    w_gate: matrix(&g, &n("ffn_gate"), c.ffn_dim, c.dim)?,
                    w_up: matrix(&g, &n("ffn_up"), c.ffn_dim, c.dim)?,
                    w_down: matrix(&g, &n("ffn_down"), c.dim, c.ffn_dim)?,
                })
            })
            .collect::<Result<_, GgufError>>()?;
        Ok(Self {
            output_norm: vector(&g, "output_norm.weight", c.dim)?,
            token_embd,
            output,
            layers,
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
