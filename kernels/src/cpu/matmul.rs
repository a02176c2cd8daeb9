//! The CPU backend's matrix products: activations quantized once per call into the forms
//! its matrices consume, then tasks of (matrix, rows) spread over the pool, each writing
//! its rows of every token straight into the outputs.
//!
//! Per matrix the kernel follows from its type's [`ActFormat`] and the batch size: the
//! single-token kernels up to [`gemv_max_tokens`] tokens (per type), the tiled batch kernels above,
//! the portable loops without SIMD, decoded rows against f32 for float weights (and for
//! every weight in exact mode). A token's result is the same bits whichever kernel runs.

use super::{CpuKernels, SCRATCH, grow};
use crate::api::{Matrix, check_matmul};
use crate::error::Result;
use crate::quant::{ActRow, BlockQ8, BlockQ8K, quantize_act_row, quantize_act_row_k, vec_dot};
use crate::types::{ActFormat, GgmlType, QK, QK_K};

#[cfg(target_arch = "x86_64")]
use super::simd::{Interleaved, InterleavedK};

/// Largest batch multiplied by the single-token kernel once per token (per group of 8
/// weight rows, so the weights still come from memory once) rather than by the tiled
/// batch kernel, which computes 8 token lanes however few are used: the batch size where
/// the tiled kernel's flat cost up to 8 tokens drops below T single-token products.
/// Measured per type with `KERNEL=TYPE:1536x1536:T bench_kernels` (AVX-512, 2 threads,
/// quiet machine, minimum of 100), single-token ms per token vs tiled ms at T = 4..8:
/// Q8_0 0.029 vs 0.43 (and 0.21 at T = 9..16, the 16-lane tiles), Q5_0 0.045 vs 0.24,
/// Q6_K 0.040 vs 0.21, Q4_K 0.039 vs 0.16. For Q4_0/Q4_1, SmolLM2's types, `bench_kernels`'
/// "model matmuls" (from DRAM): the tiled kernel 14–17 ms at T=2, 3 or 4 (7 ms at T=1),
/// once per token 10, 12.5 and 15–16 ms. Both kernels give every token the bits it gets
/// alone, so the choice changes speed only.
#[cfg(target_arch = "x86_64")]
fn gemv_max_tokens(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q8_0 => 8,
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q6_K => 5,
        GgmlType::Q4_K | GgmlType::Q5_K => 4,
        _ => 3,
    }
}

/// One call's activations in every form its matrices consume: [`BlockQ8`] for the
/// 32-element formats, [`BlockQ8K`] for the K-quants; per token (single-token kernels,
/// portable loops) or interleaved for the batch kernels.
#[derive(Default)]
struct Acts {
    q8: Vec<BlockQ8>,
    q8k: Vec<BlockQ8K>,
    #[cfg(target_arch = "x86_64")]
    il: Option<Interleaved>,
    #[cfg(target_arch = "x86_64")]
    ilk: Option<InterleavedK>,
}

impl Acts {
    /// Token `t`'s blocks of `fmt` (per-token forms only).
    fn row(&self, fmt: ActFormat, t: usize, cols: usize) -> ActRow<'_> {
        match fmt {
            ActFormat::Q8 => {
                let nb = cols / QK;
                ActRow::Q8(&self.q8[t * nb..(t + 1) * nb])
            }
            ActFormat::Q8K => {
                let nb = cols / QK_K;
                ActRow::Q8K(&self.q8k[t * nb..(t + 1) * nb])
            }
        }
    }
}

impl CpuKernels {
    /// The activation blocks `w` is multiplied with (`None`: f32 activations).
    fn act_format(&self, w: &Matrix<'_>) -> Option<ActFormat> {
        if self.exact { None } else { w.ty.act_format() }
    }

    /// Per-token blocks of `fmt` for `n_tok` rows of `cols` activations, rows spread over
    /// the pool in large batches. Each row's codes are the scalar definition's.
    fn per_token<B: Default + Clone + Send>(
        &self,
        x: &[f32],
        n_tok: usize,
        cols: usize,
        block: usize,
        quant: impl Fn(&[f32], &mut [B]) + Sync,
    ) -> Vec<B> {
        let nb = cols / block;
        let mut act = vec![B::default(); n_tok * nb];
        if n_tok < 8 {
            for (a, xs) in act.chunks_mut(nb).zip(x.chunks(cols)) {
                quant(xs, a);
            }
        } else {
            let rows: Vec<_> = act.chunks_mut(nb).zip(x.chunks(cols)).collect();
            self.pool.for_each(rows, |_, (a, xs)| quant(xs, a));
        }
        act
    }

    /// Quantize `x` into the form `fmt`'s matrices need: interleaved for the tiled batch
    /// kernels when `tiled`, per token otherwise (a call may need both: its matrices'
    /// types choose their kernels one by one).
    fn quantize(
        &self,
        fmt: ActFormat,
        tiled: bool,
        x: &[f32],
        n_tok: usize,
        cols: usize,
        acts: &mut Acts,
    ) {
        #[cfg(not(target_arch = "x86_64"))]
        let _ = tiled;
        match (self.simd, fmt) {
            #[cfg(target_arch = "x86_64")]
            (Some(s), ActFormat::Q8) if tiled => {
                acts.il = Some(Interleaved::from_f32(s, x, n_tok, cols / QK, self.pool));
            }
            #[cfg(target_arch = "x86_64")]
            (Some(s), ActFormat::Q8K) if tiled => {
                acts.ilk = Some(InterleavedK::from_f32(s, x, n_tok, cols / QK_K, self.pool));
            }
            #[cfg(target_arch = "x86_64")]
            (Some(s), ActFormat::Q8) => {
                acts.q8 = self.per_token(x, n_tok, cols, QK, |xs, a| s.quantize_act_row(xs, a));
            }
            #[cfg(target_arch = "x86_64")]
            (Some(s), ActFormat::Q8K) => {
                acts.q8k =
                    self.per_token(x, n_tok, cols, QK_K, |xs, a| s.quantize_act_row_k(xs, a));
            }
            // Shapes were validated, so the per-row calls cannot fail.
            (_, ActFormat::Q8) => {
                acts.q8 = self.per_token(x, n_tok, cols, QK, |xs, a| {
                    let _ = quantize_act_row(xs, a);
                });
            }
            (_, ActFormat::Q8K) => {
                acts.q8k = self.per_token(x, n_tok, cols, QK_K, |xs, a| {
                    let _ = quantize_act_row_k(xs, a);
                });
            }
        }
    }

    /// Whether `w` is multiplied by the tiled batch kernel for `n_tok` tokens.
    fn tiled(&self, w: &Matrix<'_>, n_tok: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self.simd.is_some() && n_tok > 1 && n_tok > gemv_max_tokens(w.ty)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (w, n_tok);
            false
        }
    }

    /// Rows `r0..r0+nr` of `w` against every token into `out[t][i]` (one slice of `nr`
    /// per token).
    fn rows_task(&self, w: &Matrix<'_>, r0: usize, acts: &Acts, x: &[f32], out: &mut [&mut [f32]]) {
        let (cols, nr) = (w.cols, out[0].len());
        let fmt = self.act_format(w);
        SCRATCH.with_borrow_mut(|sc| {
            #[cfg(target_arch = "x86_64")]
            if let Some(s) = self.simd {
                match fmt {
                    Some(ActFormat::Q8) => match &acts.il {
                        Some(il) if self.tiled(w, out.len()) => {
                            s.gemm_rows(w, r0, il, &mut sc.tile, out, self.avx512)
                        }
                        _ => s.gemv_tokens(w, r0, &acts.q8, out, self.avx512),
                    },
                    Some(ActFormat::Q8K) => match &acts.ilk {
                        Some(il) if self.tiled(w, out.len()) => {
                            s.gemm_rows_kquant(w, r0, il, &mut sc.tile_k, out, self.avx512)
                        }
                        _ => s.gemv_tokens_kquant(w, r0, &acts.q8k, out),
                    },
                    None => self.float_rows(w, r0, x, &mut sc.f, out),
                }
                return;
            }
            match fmt {
                Some(f) => {
                    for (i, r) in (r0..r0 + nr).enumerate() {
                        let row = w.row(r);
                        for (t, o) in out.iter_mut().enumerate() {
                            o[i] = vec_dot(w.ty, &row, acts.row(f, t, cols));
                        }
                    }
                }
                None => self.float_rows(w, r0, x, &mut sc.f, out),
            }
        });
    }

    /// Rows of `w` decoded to f32 (once each) against every token's f32 activations.
    fn float_rows(
        &self,
        w: &Matrix<'_>,
        r0: usize,
        x: &[f32],
        buf: &mut Vec<f32>,
        out: &mut [&mut [f32]],
    ) {
        let (cols, nr) = (w.cols, out[0].len());
        grow(buf, cols);
        for (i, r) in (r0..r0 + nr).enumerate() {
            self.decode_row(w.ty, &w.row(r), &mut buf[..cols]);
            for (o, xt) in out.iter_mut().zip(x.chunks_exact(cols)) {
                o[i] = self.dot_f32(&buf[..cols], xt);
            }
        }
    }

    /// Rows per task: enough tasks to balance the pool, few enough to keep overhead low;
    /// for batches, small enough that the decoded rows stay in L1/L2.
    fn chunk_rows(&self, rows: usize, n_tok: usize) -> usize {
        let threads = self.pool.threads();
        // Multiples of 8 rows: the single-token kernels compute 8 rows at a time, the
        // batch kernels R rows per tile (a divisor of 8).
        if n_tok == 1 {
            rows.div_ceil(threads * 8).max(8).next_multiple_of(8)
        } else {
            // Enough tasks to keep every thread busy to the end of the call.
            rows.div_ceil(threads * 6).next_multiple_of(8).clamp(8, 64)
        }
    }

    pub(super) fn matmul_impl(
        &self,
        ws: &[Matrix<'_>],
        x: &[f32],
        n_tok: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<()> {
        let cols = check_matmul(ws, x, n_tok, outs)?;
        if n_tok == 0 || ws.is_empty() {
            return Ok(());
        }
        if cols == 0 {
            // Sums over nothing; the kernels below assume at least one block per row.
            outs.iter_mut().for_each(|o| o.fill(0.0));
            return Ok(());
        }
        let mut acts = Acts::default();
        for fmt in [ActFormat::Q8, ActFormat::Q8K] {
            for tiled in [false, true] {
                if ws
                    .iter()
                    .any(|w| self.act_format(w) == Some(fmt) && self.tiled(w, n_tok) == tiled)
                {
                    self.quantize(fmt, tiled, x, n_tok, cols, &mut acts);
                }
            }
        }
        if n_tok == 1 {
            let mut parts = Vec::new();
            for (j, out) in outs.iter_mut().enumerate() {
                let chunk = self.chunk_rows(ws[j].rows, 1);
                for (c, o) in out.chunks_mut(chunk).enumerate() {
                    parts.push((j, c * chunk, o));
                }
            }
            self.pool
                .for_each(parts, |_, (j, r0, o): (usize, usize, &mut [f32])| {
                    self.rows_task(&ws[j], r0, &acts, x, &mut [o])
                });
            return Ok(());
        }
        // Each task computes rows r0..r0+nr of one matrix for all tokens and writes them
        // straight into the outputs, through one slice per token.
        let mut parts = Vec::new();
        for (j, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
            let chunk = self.chunk_rows(w.rows, n_tok);
            let n_chunks = w.rows.div_ceil(chunk);
            let mut per_chunk: Vec<Vec<&mut [f32]>> =
                (0..n_chunks).map(|_| Vec::with_capacity(n_tok)).collect();
            for row in out.chunks_mut(w.rows) {
                for (c, piece) in row.chunks_mut(chunk).enumerate() {
                    per_chunk[c].push(piece);
                }
            }
            for (c, slices) in per_chunk.into_iter().enumerate() {
                parts.push((j, c * chunk, slices));
            }
        }
        self.pool.for_each(
            parts,
            |_, (j, r0, mut o): (usize, usize, Vec<&mut [f32]>)| {
                self.rows_task(&ws[j], r0, &acts, x, &mut o)
            },
        );
        Ok(())
    }
}
