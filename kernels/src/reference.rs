//! The scalar reference backend: straightforward loops, no SIMD, no threads. Every
//! optimized backend is tested against it.

use crate::api::{
    AttnQuery, AttnShape, Kernels, KvView, Matrix, check_attention, check_matmul, kv_head_offset,
};
use crate::error::{Result, shape};
use crate::quant::{
    ActRow, BlockQ8, BlockQ8K, dequantize_row, quantize_act_row, quantize_act_row_k, vec_dot,
};
use crate::rope::RopeTable;
use crate::types::{ActFormat, QK, QK_K};

#[derive(Debug, Default, Clone, Copy)]
pub struct ScalarKernels;

/// Quantize `n_tok` rows of `cols` activations into blocks of `block` with `quant`, row
/// after row.
fn quantize_rows<B: Default + Clone>(
    x: &[f32],
    n_tok: usize,
    cols: usize,
    block: usize,
    quant: impl Fn(&[f32], &mut [B]) -> Result<()>,
) -> Result<Vec<B>> {
    let nb = cols / block;
    let mut act = vec![B::default(); n_tok * nb];
    for t in 0..n_tok {
        quant(&x[t * cols..(t + 1) * cols], &mut act[t * nb..(t + 1) * nb])?;
    }
    Ok(act)
}

pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU with the tanh approximation (HF's `gelu_pytorch_tanh`, ggml's `gelu`).
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)).tanh())
}

pub(crate) fn check_glu(op: &'static str, gate: &[f32], up: &[f32]) -> Result<()> {
    if gate.len() != up.len() {
        return Err(shape(op, format!("{} vs {}", gate.len(), up.len())));
    }
    Ok(())
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

impl Kernels for ScalarKernels {
    fn name(&self) -> &'static str {
        "scalar"
    }

    fn matmul(
        &self,
        ws: &[Matrix<'_>],
        x: &[f32],
        n_tok: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<()> {
        let cols = check_matmul(ws, x, n_tok, outs)?;
        let wants = |f| ws.iter().any(|w| w.ty.act_format() == Some(f));
        let q8: Vec<BlockQ8> = if wants(ActFormat::Q8) {
            quantize_rows(x, n_tok, cols, QK, quantize_act_row)?
        } else {
            Vec::new()
        };
        let q8k: Vec<BlockQ8K> = if wants(ActFormat::Q8K) {
            quantize_rows(x, n_tok, cols, QK_K, quantize_act_row_k)?
        } else {
            Vec::new()
        };
        let mut row_f32 = vec![0f32; cols];
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            for r in 0..w.rows {
                let row = w.row(r);
                if !w.ty.is_quantized() {
                    dequantize_row(w.ty, &row, &mut row_f32)?;
                }
                for t in 0..n_tok {
                    let act = match w.ty.act_format() {
                        Some(ActFormat::Q8) => {
                            let nb = cols / QK;
                            Some(ActRow::Q8(&q8[t * nb..(t + 1) * nb]))
                        }
                        Some(ActFormat::Q8K) => {
                            let nb = cols / QK_K;
                            Some(ActRow::Q8K(&q8k[t * nb..(t + 1) * nb]))
                        }
                        None => None,
                    };
                    out[t * w.rows + r] = match act {
                        Some(a) => vec_dot(w.ty, &row, a),
                        None => dot(&row_f32, &x[t * cols..(t + 1) * cols]),
                    };
                }
            }
        }
        Ok(())
    }

    fn rmsnorm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> Result<()> {
        check_rmsnorm(x, w, out)?;
        for (xs, os) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
            let ss: f32 = xs.iter().map(|v| v * v).sum();
            rmsnorm_apply(xs, w, ss, eps, os);
        }
        Ok(())
    }

    fn rmsnorm_in_place(&self, x: &mut [f32], w: &[f32], eps: f32) -> Result<()> {
        check_rmsnorm_in_place(x, w)?;
        for xs in x.chunks_exact_mut(w.len()) {
            let ss: f32 = xs.iter().map(|v| v * v).sum();
            rmsnorm_apply_in_place(xs, w, ss, eps);
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut [f32],
        n_heads: usize,
        head_dim: usize,
        positions: &[usize],
        table: &RopeTable,
    ) -> Result<()> {
        table.check(x, n_heads, head_dim, positions)?;
        for (tok, &pos) in x.chunks_exact_mut(n_heads * head_dim).zip(positions) {
            for head in tok.chunks_exact_mut(head_dim) {
                table.apply(head, pos);
            }
        }
        Ok(())
    }

    fn silu_mul(&self, gate: &mut [f32], up: &[f32]) -> Result<()> {
        check_glu("silu_mul", gate, up)?;
        for (g, u) in gate.iter_mut().zip(up) {
            *g = silu(*g) * u;
        }
        Ok(())
    }

    fn gelu_mul(&self, gate: &mut [f32], up: &[f32]) -> Result<()> {
        check_glu("gelu_mul", gate, up)?;
        for (g, u) in gate.iter_mut().zip(up) {
            *g = gelu_tanh(*g) * u;
        }
        Ok(())
    }

    fn softmax(&self, x: &mut [f32]) {
        let max = x.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
        let mut sum = 0f32;
        for v in x.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        let inv = 1.0 / sum;
        x.iter_mut().for_each(|v| *v *= inv);
    }

    fn attention(
        &self,
        s: &AttnShape,
        q: &[f32],
        queries: &[AttnQuery<'_>],
        k: &KvView<'_>,
        v: &KvView<'_>,
        out: &mut [f32],
    ) -> Result<()> {
        check_attention(s, q, queries, k, v, out)?;
        let hd = s.head_dim;
        let scale = 1.0 / (hd as f32).sqrt();
        let (k_row, k_head) = (k.ty.row_bytes(s.kv_dim())?, k.ty.row_bytes(hd)?);
        let (v_row, v_head) = (v.ty.row_bytes(s.kv_dim())?, v.ty.row_bytes(hd)?);
        let mut kh = vec![0f32; hd];
        let mut vh = vec![0f32; hd];
        for (qi, qu) in queries.iter().enumerate() {
            let lo = s.first_pos(qu.n_ctx);
            let mut scores = vec![0f32; qu.n_ctx - lo];
            for h in 0..s.n_heads {
                let g = h / s.group();
                let qh = &q[(qi * s.n_heads + h) * hd..][..hd];
                for (t, sc) in (lo..).zip(scores.iter_mut()) {
                    let off = kv_head_offset(qu.block_table, k.block_tokens, k_row, k_head, t, g);
                    dequantize_row(k.ty, &k.data[off..off + k_head], &mut kh)?;
                    *sc = dot(qh, &kh) * scale;
                }
                self.softmax(&mut scores);
                let oh = &mut out[(qi * s.n_heads + h) * hd..][..hd];
                oh.fill(0.0);
                for (t, p) in (lo..).zip(scores.iter()) {
                    let off = kv_head_offset(qu.block_table, v.block_tokens, v_row, v_head, t, g);
                    dequantize_row(v.ty, &v.data[off..off + v_head], &mut vh)?;
                    for (o, x) in oh.iter_mut().zip(&vh) {
                        *o += p * x;
                    }
                }
            }
        }
        Ok(())
    }
}

/// The rest of RMSNorm for one row once its sum of squares `ss` is known (backends differ
/// only in how they sum): `out = x / sqrt(ss / n + eps) · w`.
pub(crate) fn rmsnorm_apply(xs: &[f32], w: &[f32], ss: f32, eps: f32, out: &mut [f32]) {
    let scale = 1.0 / (ss / w.len() as f32 + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(xs).zip(w) {
        *o = v * scale * g;
    }
}

/// [`rmsnorm_apply`] with the output over the input (the same expression, so the same
/// bits).
pub(crate) fn rmsnorm_apply_in_place(xs: &mut [f32], w: &[f32], ss: f32, eps: f32) {
    let scale = 1.0 / (ss / w.len() as f32 + eps).sqrt();
    for (v, g) in xs.iter_mut().zip(w) {
        *v = *v * scale * g;
    }
}

pub(crate) fn check_rmsnorm_in_place(x: &[f32], w: &[f32]) -> Result<()> {
    if w.is_empty() || !x.len().is_multiple_of(w.len()) {
        return Err(shape(
            "rmsnorm_in_place",
            format!("x {} / weight {}", x.len(), w.len()),
        ));
    }
    Ok(())
}

pub(crate) fn check_rmsnorm(x: &[f32], w: &[f32], out: &[f32]) -> Result<()> {
    if w.is_empty() || !x.len().is_multiple_of(w.len()) || out.len() != x.len() {
        return Err(shape(
            "rmsnorm",
            format!("x {} / weight {} / out {}", x.len(), w.len(), out.len()),
        ));
    }
    Ok(())
}
