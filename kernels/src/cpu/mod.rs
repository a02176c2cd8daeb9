//! The optimized CPU backend: SIMD inner loops picked at run time, threads over output
//! rows (matmul) or (query, KV head) pairs (attention).

mod attention;
mod backend;
mod pool;
#[cfg(target_arch = "x86_64")]
mod simd;

pub use backend::{CpuBackend, HostKv};
pub use pool::ThreadPool;

use std::cell::RefCell;

use crate::api::{
    AttnQuery, AttnShape, Kernels, KvView, Layout, Matrix, check_attention, check_matmul,
    kv_head_offset,
};
use crate::error::Result;
use crate::quant::{BlockQ8, dequantize_row, quantize_act_row, vec_dot_q8};
use crate::reference::{
    ScalarKernels, check_glu, check_rmsnorm, check_rmsnorm_in_place, gelu_tanh, rmsnorm_apply,
    rmsnorm_apply_in_place,
};
use crate::rope::RopeTable;
use crate::types::{GgmlType, QK};

#[cfg(target_arch = "x86_64")]
use simd::{Avx2, Interleaved, TileScratch};

/// Stand-in on other architectures: never constructed, so the scalar paths run.
#[cfg(not(target_arch = "x86_64"))]
#[derive(Debug, Clone, Copy)]
enum Avx2 {}

/// Per-thread scratch reused across calls so the hot loops never allocate.
#[derive(Default)]
struct Scratch {
    #[cfg(target_arch = "x86_64")]
    tile: TileScratch,
    f: Vec<f32>,
    f2: Vec<f32>,
    offs: Vec<usize>,
}

/// Activations of a batch as the batch kernel wants them.
#[cfg(target_arch = "x86_64")]
type BatchActs = Option<Interleaved>;
#[cfg(not(target_arch = "x86_64"))]
type BatchActs = Option<()>;

/// Rows (tokens) from which norms and rope spread over the pool.
const PARALLEL_ROWS: usize = 8;

/// Largest batch multiplied by the single-token kernel once per token (per group of 8
/// weight rows, so the weights still come from memory once) rather than by the tiled
/// batch kernel, which computes 8 token lanes however few are used. `bench_kernels`'
/// "model matmuls" (SmolLM2 from DRAM, 2 threads): the tiled kernel takes 14–17 ms at
/// T=2, 3 or 4 (and 7 ms at T=1); once per token takes 10, 12.5 and 15–16 ms. Both give
/// every token the bits it gets alone.
const GEMV_MAX_TOKENS: usize = 3;

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// `offs[t] = kv_head_offset(table, block_tokens, row_bytes, head_bytes, t, g)` for every
/// position, a block at a time (no division per position).
fn fill_offsets(
    offs: &mut [usize],
    table: &[u32],
    block_tokens: usize,
    row_bytes: usize,
    head_bytes: usize,
    g: usize,
) {
    for (chunk, &block) in offs.chunks_mut(block_tokens).zip(table) {
        let base = block as usize * block_tokens * row_bytes + g * head_bytes;
        for (i, off) in chunk.iter_mut().enumerate() {
            *off = base + i * row_bytes;
        }
    }
    debug_assert!(
        offs.iter().enumerate().all(|(t, &o)| {
            o == kv_head_offset(table, block_tokens, row_bytes, head_bytes, t, g)
        })
    );
}

fn grow<T: Default + Clone>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

pub struct CpuKernels {
    simd: Option<Avx2>,
    /// Multiply quantized weights with f32 activations (decoded rows) instead of Q8
    /// activation blocks: slower, but free of activation rounding, which lets tests
    /// compare a whole model against an f32 reference tightly.
    exact: bool,
    pool: &'static ThreadPool,
}

impl Default for CpuKernels {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for CpuKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuKernels")
            .field("simd", &self.simd.is_some())
            .field("exact", &self.exact)
            .field("threads", &self.pool.threads())
            .finish()
    }
}

/// How the CPU backend runs: the dataplane's `--threads` and `--no-simd`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuOptions {
    /// Threads of the kernel pool, the calling thread included; `None`: one per core.
    pub threads: Option<usize>,
    /// Use SIMD when the CPU has it; `false` forces the portable paths.
    pub simd: bool,
}

impl Default for CpuOptions {
    fn default() -> Self {
        Self {
            threads: None,
            simd: true,
        }
    }
}

impl CpuKernels {
    /// SIMD when the CPU has it, on the global pool.
    pub fn new() -> Self {
        Self::with_options(CpuOptions::default())
    }

    /// SIMD as asked (and available), on the shared pool of the asked size.
    pub fn with_options(o: CpuOptions) -> Self {
        Self::on_pool(o.simd, ThreadPool::shared(o.threads))
    }

    /// `simd = false` forces the portable paths (still threaded); used to test them.
    pub fn with_simd(simd: bool) -> Self {
        Self::on_pool(simd, ThreadPool::global())
    }

    fn on_pool(simd: bool, pool: &'static ThreadPool) -> Self {
        #[cfg(target_arch = "x86_64")]
        let simd = if simd { Avx2::detect() } else { None };
        #[cfg(not(target_arch = "x86_64"))]
        let simd: Option<Avx2> = {
            let _ = simd;
            None
        };
        Self {
            simd,
            exact: false,
            pool,
        }
    }

    /// Quantized weights times f32 activations (see the `exact` field).
    pub fn exact_activations(mut self) -> Self {
        self.exact = true;
        self
    }

    /// Whether `w` is multiplied with Q8 activation blocks.
    fn uses_q8(&self, w: &Matrix<'_>) -> bool {
        w.ty.is_quantized() && !self.exact
    }

    pub fn has_simd(&self) -> bool {
        self.simd.is_some()
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub fn pool(&self) -> &'static ThreadPool {
        self.pool
    }

    fn quantize_acts(&self, x: &[f32], n_tok: usize, cols: usize) -> Result<Vec<BlockQ8>> {
        let nb = cols / QK;
        let mut act = vec![BlockQ8::default(); n_tok * nb];
        // Shapes were validated, so the per-row calls cannot fail.
        let quant = |xs: &[f32], a: &mut [BlockQ8]| match self.simd {
            #[cfg(target_arch = "x86_64")]
            Some(s) if cols.is_multiple_of(QK) => s.quantize_act_row(xs, a),
            _ => {
                let _ = quantize_act_row(xs, a);
            }
        };
        if n_tok < 8 {
            for (a, xs) in act.chunks_mut(nb).zip(x.chunks(cols)) {
                quant(xs, a);
            }
        } else {
            let rows: Vec<_> = act.chunks_mut(nb).zip(x.chunks(cols)).collect();
            self.pool.for_each(rows, |_, (a, xs)| quant(xs, a));
        }
        Ok(act)
    }

    fn dot_f32(&self, a: &[f32], b: &[f32]) -> f32 {
        match self.simd {
            #[cfg(target_arch = "x86_64")]
            Some(s) => s.dot_f32(a, b),
            _ => a.iter().zip(b).map(|(x, y)| x * y).sum(),
        }
    }

    /// Decode a float-typed (or KV-cache) row to f32.
    fn decode_row(&self, ty: GgmlType, src: &[u8], dst: &mut [f32]) {
        match (self.simd, ty) {
            #[cfg(target_arch = "x86_64")]
            (Some(s), GgmlType::F16) => s.f16_to_f32(src, dst),
            #[cfg(target_arch = "x86_64")]
            (Some(s), GgmlType::BF16) => s.bf16_to_f32(src, dst),
            #[cfg(target_arch = "x86_64")]
            (Some(s), GgmlType::Q8_0) => s.q8_0_to_f32(src, dst),
            // Sizes were validated by the caller.
            _ => {
                let _ = dequantize_row(ty, src, dst);
            }
        }
    }

    /// One weight row against one token.
    fn dot_row(
        &self,
        w: &Matrix<'_>,
        r: usize,
        act: &[BlockQ8],
        x: &[f32],
        sc: &mut Scratch,
    ) -> f32 {
        let row = w.row(r);
        if self.uses_q8(w) {
            return vec_dot_q8(w.ty, &row, act);
        }
        grow(&mut sc.f, w.cols);
        let buf = &mut sc.f[..w.cols];
        self.decode_row(w.ty, &row, buf);
        self.dot_f32(buf, x)
    }

    /// Rows `r0..r0+nr` of `w` against every token into `out[t][i]` (one slice of `nr` per
    /// token), decoding each weight row once.
    #[allow(clippy::too_many_arguments)]
    fn rows_batch(
        &self,
        w: &Matrix<'_>,
        r0: usize,
        nr: usize,
        act: &[BlockQ8],
        il: &BatchActs,
        x: &[f32],
        out: &mut [&mut [f32]],
    ) {
        let cols = w.cols;
        SCRATCH.with_borrow_mut(|sc| {
            #[cfg(target_arch = "x86_64")]
            if let (Some(s), true) = (self.simd, self.uses_q8(w)) {
                match il {
                    Some(il) => s.gemm_rows(w, r0, il, &mut sc.tile, out),
                    None => s.gemv_tokens(w, r0, act, out),
                }
                return;
            }
            let _ = il;
            if self.uses_q8(w) {
                let nb = cols / QK;
                for (i, r) in (r0..r0 + nr).enumerate() {
                    let row = w.row(r);
                    for (o, a) in out.iter_mut().zip(act.chunks_exact(nb)) {
                        o[i] = vec_dot_q8(w.ty, &row, a);
                    }
                }
                return;
            }
            grow(&mut sc.f, cols);
            for (i, r) in (r0..r0 + nr).enumerate() {
                self.decode_row(w.ty, &w.row(r), &mut sc.f[..cols]);
                for (o, xt) in out.iter_mut().zip(x.chunks_exact(cols)) {
                    o[i] = self.dot_f32(&sc.f[..cols], xt);
                }
            }
        });
    }

    /// Rows per task: enough tasks to balance the pool, few enough to keep overhead low;
    /// for batches, small enough that the decoded rows stay in L1/L2.
    fn chunk_rows(&self, rows: usize, cols: usize, n_tok: usize) -> usize {
        let threads = self.pool.threads();
        // Multiples of 8 rows: the single-token kernel computes 8 rows at a time, the
        // batch kernel R rows per tile (a divisor of 8).
        let balance = rows.div_ceil(threads * 8).max(8).next_multiple_of(8);
        if n_tok == 1 {
            balance
        } else {
            // Enough tasks to keep every thread busy to the end of the call.
            let _ = cols;
            rows.div_ceil(threads * 6).next_multiple_of(8).clamp(8, 64)
        }
    }
}

impl Kernels for CpuKernels {
    /// Its pool's size: `ThreadPool::shared` keeps one pool per size, so a backend asking
    /// for this many threads gets this very pool.
    fn parallelism(&self) -> Option<usize> {
        Some(self.pool.threads())
    }

    /// Block-quantized weights interleaved 8 rows at a time for the SIMD kernels, which
    /// compute 8 rows per pass: single-token decoding then streams each matrix in order.
    fn weight_layout(&self, ty: GgmlType) -> Layout {
        if self.simd.is_some() && ty.is_quantized() && !self.exact {
            Layout::Rows8
        } else {
            Layout::Gguf
        }
    }

    fn name(&self) -> &'static str {
        match (self.simd.is_some(), self.exact) {
            (true, false) => "cpu-avx2",
            (false, false) => "cpu-portable",
            (true, true) => "cpu-avx2-exact",
            (false, true) => "cpu-portable-exact",
        }
    }

    fn matmul(
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
        let any_q8 = ws.iter().any(|w| self.uses_q8(w));
        // Small batches run the single-token kernel once per token on each group of rows
        // (see `GEMV_MAX_TOKENS`); larger ones the tiled batch kernel.
        let tiled = n_tok > GEMV_MAX_TOKENS && self.simd.is_some();
        // The SIMD batch kernel reads only the interleaved activations, which are
        // quantized and interleaved in one dispatch below.
        let act = if any_q8 && !(tiled && cols.is_multiple_of(QK)) {
            self.quantize_acts(x, n_tok, cols)?
        } else {
            Vec::new()
        };
        if n_tok == 1 {
            let mut parts = Vec::new();
            for (j, out) in outs.iter_mut().enumerate() {
                let chunk = self.chunk_rows(ws[j].rows, cols, 1);
                for (c, o) in out.chunks_mut(chunk).enumerate() {
                    parts.push((j, c * chunk, o));
                }
            }
            self.pool
                .for_each(parts, |_, (j, r0, o): (usize, usize, &mut [f32])| {
                    let w = &ws[j];
                    #[cfg(target_arch = "x86_64")]
                    if let (Some(s), true) = (self.simd, self.uses_q8(w)) {
                        s.gemv(w, r0, &act, o);
                        return;
                    }
                    SCRATCH.with_borrow_mut(|sc| {
                        for (i, v) in o.iter_mut().enumerate() {
                            *v = self.dot_row(w, r0 + i, &act, x, sc);
                        }
                    })
                });
            return Ok(());
        }
        // Batches: each task computes rows r0..r0+nr of one matrix for all tokens and
        // writes them straight into the outputs, through one slice per token.
        #[cfg(target_arch = "x86_64")]
        let il: BatchActs = match self.simd {
            Some(s) if tiled && any_q8 && act.is_empty() => {
                Some(Interleaved::from_f32(s, x, n_tok, cols / QK, self.pool))
            }
            Some(_) if tiled && any_q8 => Some(Interleaved::new(&act, n_tok, cols / QK, self.pool)),
            _ => None,
        };
        #[cfg(not(target_arch = "x86_64"))]
        let il: BatchActs = None;
        let mut parts = Vec::new();
        for (j, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
            let chunk = self.chunk_rows(w.rows, cols, n_tok);
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
                let nr = o[0].len();
                self.rows_batch(&ws[j], r0, nr, &act, &il, x, &mut o)
            },
        );
        Ok(())
    }

    fn rmsnorm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> Result<()> {
        check_rmsnorm(x, w, out)?;
        let dim = w.len();
        // Each row on its own (the sum of squares vectorized), so a row's result does not
        // depend on the batch; rows spread over the pool in large batches.
        let norm_row =
            |xs: &[f32], os: &mut [f32]| rmsnorm_apply(xs, w, self.dot_f32(xs, xs), eps, os);
        let rows = x.len() / dim;
        if rows < PARALLEL_ROWS {
            for (xs, os) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
                norm_row(xs, os);
            }
        } else {
            let per = rows.div_ceil(self.pool.threads());
            let parts: Vec<_> = x.chunks(per * dim).zip(out.chunks_mut(per * dim)).collect();
            self.pool.for_each(parts, |_, (xs, os)| {
                for (xr, or) in xs.chunks_exact(dim).zip(os.chunks_exact_mut(dim)) {
                    norm_row(xr, or);
                }
            });
        }
        Ok(())
    }

    fn rmsnorm_in_place(&self, x: &mut [f32], w: &[f32], eps: f32) -> Result<()> {
        check_rmsnorm_in_place(x, w)?;
        let dim = w.len();
        // As `rmsnorm`: each row on its own, the same sum and expression.
        let norm_row = |xs: &mut [f32]| {
            let ss = self.dot_f32(xs, xs);
            rmsnorm_apply_in_place(xs, w, ss, eps)
        };
        let rows = x.len() / dim;
        if rows < PARALLEL_ROWS * 4 {
            x.chunks_exact_mut(dim).for_each(norm_row);
        } else {
            let per = rows.div_ceil(self.pool.threads());
            let parts: Vec<_> = x.chunks_mut(per * dim).collect();
            self.pool
                .for_each(parts, |_, xs| xs.chunks_exact_mut(dim).for_each(norm_row));
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
        let n = positions.len();
        if n < PARALLEL_ROWS {
            return ScalarKernels.rope(x, n_heads, head_dim, positions, table);
        }
        table.check(x, n_heads, head_dim, positions)?;
        // Tokens are independent: the reference loop on a slice of tokens per task (the
        // same bits as one call).
        let per = n.div_ceil(self.pool.threads());
        let width = n_heads * head_dim;
        let mut results: Vec<Result<()>> = Vec::new();
        results.resize_with(n.div_ceil(per), || Ok(()));
        let parts: Vec<_> = x
            .chunks_mut(per * width)
            .zip(positions.chunks(per))
            .zip(results.iter_mut())
            .collect();
        self.pool.for_each(parts, |_, ((xs, ps), r)| {
            *r = ScalarKernels.rope(xs, n_heads, head_dim, ps, table);
        });
        results.into_iter().collect()
    }

    fn silu_mul(&self, gate: &mut [f32], up: &[f32]) -> Result<()> {
        match self.simd {
            #[cfg(target_arch = "x86_64")]
            Some(s) if gate.len() == up.len() => {
                // Elementwise: chunks cut at multiples of 8 send every element through the
                // same vector or tail path as one call would (the same bits). Split only
                // when there is enough work to pay for a dispatch.
                const MIN_SPLIT: usize = 32 * 1024;
                if gate.len() < MIN_SPLIT {
                    s.silu_mul(gate, up);
                } else {
                    let per = gate.len().div_ceil(self.pool.threads()).next_multiple_of(8);
                    let parts: Vec<_> = gate.chunks_mut(per).zip(up.chunks(per)).collect();
                    self.pool.for_each(parts, |_, (g, u)| s.silu_mul(g, u));
                }
                Ok(())
            }
            _ => ScalarKernels.silu_mul(gate, up),
        }
    }

    /// The scalar expression (there is no vector tanh here; GeGLU is a small part of a
    /// step), split over the pool for large batches: elementwise, so the same bits.
    fn gelu_mul(&self, gate: &mut [f32], up: &[f32]) -> Result<()> {
        check_glu("gelu_mul", gate, up)?;
        const MIN_SPLIT: usize = 32 * 1024;
        let run = |g: &mut [f32], u: &[f32]| {
            for (a, b) in g.iter_mut().zip(u) {
                *a = gelu_tanh(*a) * b;
            }
        };
        if gate.len() < MIN_SPLIT {
            run(gate, up);
        } else {
            let per = gate.len().div_ceil(self.pool.threads());
            let parts: Vec<_> = gate.chunks_mut(per).zip(up.chunks(per)).collect();
            self.pool.for_each(parts, |_, (g, u)| run(g, u));
        }
        Ok(())
    }

    fn softmax(&self, x: &mut [f32]) {
        ScalarKernels.softmax(x)
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
        attention::run(self, s, q, queries, k, v, out)
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn simd_activation_quantization_is_bit_identical_to_scalar() {
        let Some(s) = Avx2::detect() else { return };
        let mut seed = 99u64;
        let mut f = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let mut x: Vec<f32> = (0..32 * 40).map(|i| f() * (1 + i % 7) as f32).collect();
        // Edge cases: all zeros, ties (x·id = k + 0.5), one huge value, negatives only.
        x[..32].fill(0.0);
        for (i, v) in x[32..64].iter_mut().enumerate() {
            *v = (i as f32 - 16.0) + 0.5;
        }
        x[64..96].fill(1e-3);
        x[70] = 1e30;
        x[96..128].iter_mut().for_each(|v| *v = -v.abs() - 1.0);
        let nb = x.len() / QK;
        let (mut a, mut b) = (vec![BlockQ8::default(); nb], vec![BlockQ8::default(); nb]);
        quantize_act_row(&x, &mut a).unwrap();
        s.quantize_act_row(&x, &mut b);
        for (i, (p, q)) in a.iter().zip(&b).enumerate() {
            assert_eq!(p.qs, q.qs, "block {i}");
            assert_eq!(p.d.to_bits(), q.d.to_bits(), "block {i}");
            assert_eq!(p.s.to_bits(), q.s.to_bits(), "block {i}");
        }
    }
}
