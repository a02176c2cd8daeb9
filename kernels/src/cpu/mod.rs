//! The optimized CPU backend: SIMD inner loops picked at run time, threads over output
//! rows (matmul) or (query, KV head) pairs (attention).

mod attention;
mod backend;
mod matmul;
mod pool;
#[cfg(target_arch = "x86_64")]
mod simd;

pub use backend::{CpuBackend, HostKv};
pub use pool::ThreadPool;

use std::cell::RefCell;

use crate::api::{
    AttnQuery, AttnShape, Kernels, KvView, Layout, Matrix, check_attention, kv_head_offset,
};
use crate::error::Result;
use crate::quant::dequantize_row;
use crate::reference::{
    ScalarKernels, check_glu, check_rmsnorm, check_rmsnorm_in_place, gelu_tanh, rmsnorm_apply,
    rmsnorm_apply_in_place,
};
use crate::rope::RopeTable;
use crate::types::GgmlType;

#[cfg(target_arch = "x86_64")]
use simd::{Avx2, Avx512, TileScratch, TileScratchK};

/// Stand-ins on other architectures: never constructed, so the scalar paths run.
#[cfg(not(target_arch = "x86_64"))]
#[derive(Debug, Clone, Copy)]
enum Avx2 {}
#[cfg(not(target_arch = "x86_64"))]
#[derive(Debug, Clone, Copy)]
enum Avx512 {}

/// The instruction-set tiers of the CPU backend's kernels, each a superset of the one
/// before. Run time detection picks the best the CPU has ([`SimdTier::best`]); tests run
/// every tier the machine has against the scalar reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdTier {
    /// Plain Rust loops (the scalar reference's arithmetic), threaded.
    Portable,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX2's kernels plus AVX-512 F/BW/VL/VNNI matrix kernels where they are faster.
    Avx512,
}

impl SimdTier {
    pub const ALL: [SimdTier; 3] = [SimdTier::Portable, SimdTier::Avx2, SimdTier::Avx512];

    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
        }
    }

    /// Whether this CPU runs the tier.
    pub fn available(self) -> bool {
        match self {
            Self::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => Avx2::detect().is_some(),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => Avx512::detect().is_some(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The best tier this CPU runs.
    pub fn best() -> Self {
        *Self::ALL
            .iter()
            .rev()
            .find(|t| t.available())
            .unwrap_or(&Self::Portable)
    }
}

impl std::fmt::Display for SimdTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Per-thread scratch reused across calls so the hot loops never allocate.
#[derive(Default)]
struct Scratch {
    #[cfg(target_arch = "x86_64")]
    tile: TileScratch,
    #[cfg(target_arch = "x86_64")]
    tile_k: TileScratchK,
    f: Vec<f32>,
    f2: Vec<f32>,
    offs: Vec<usize>,
}

/// Rows (tokens) from which norms and rope spread over the pool.
const PARALLEL_ROWS: usize = 8;

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
    /// The AVX-512 matrix kernels (only with `simd`).
    avx512: Option<Avx512>,
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
            .field("tier", &self.tier())
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
        let tier = if simd {
            SimdTier::best()
        } else {
            SimdTier::Portable
        };
        Self {
            simd: None,
            avx512: None,
            exact: false,
            pool,
        }
        .with_tier(tier)
        .expect("the best tier is available")
    }

    /// These kernels at `tier`, or `None` where the CPU lacks it.
    pub fn with_tier(self, tier: SimdTier) -> Option<Self> {
        if !tier.available() {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        let (simd, avx512) = (
            (tier >= SimdTier::Avx2).then(Avx2::detect).flatten(),
            (tier >= SimdTier::Avx512).then(Avx512::detect).flatten(),
        );
        #[cfg(not(target_arch = "x86_64"))]
        let (simd, avx512) = (None, None);
        Some(Self {
            simd,
            avx512,
            ..self
        })
    }

    /// The tier these kernels run.
    pub fn tier(&self) -> SimdTier {
        match (self.simd, self.avx512) {
            (_, Some(_)) => SimdTier::Avx512,
            (Some(_), None) => SimdTier::Avx2,
            (None, None) => SimdTier::Portable,
        }
    }

    /// Quantized weights times f32 activations (see the `exact` field).
    pub fn exact_activations(mut self) -> Self {
        self.exact = true;
        self
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
        match (self.tier(), self.exact) {
            (SimdTier::Avx512, false) => "cpu-avx512",
            (SimdTier::Avx2, false) => "cpu-avx2",
            (SimdTier::Portable, false) => "cpu-portable",
            (SimdTier::Avx512, true) => "cpu-avx512-exact",
            (SimdTier::Avx2, true) => "cpu-avx2-exact",
            (SimdTier::Portable, true) => "cpu-portable-exact",
        }
    }

    fn matmul(
        &self,
        ws: &[Matrix<'_>],
        x: &[f32],
        n_tok: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<()> {
        self.matmul_impl(ws, x, n_tok, outs)
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
    use crate::quant::{BlockQ8, BlockQ8K, quantize_act_row, quantize_act_row_k};
    use crate::types::{QK, QK_K};

    #[test]
    fn simd_activation_quantization_is_bit_identical_to_scalar() {
        let Some(s) = Avx2::detect() else {
            eprintln!(
                "skipped: this CPU has no AVX2, so its activation quantization was not compared"
            );
            return;
        };
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
        // Q8K: 256 at a time over the same edge cases (a zero block needs its own 256).
        x.extend(std::iter::repeat_n(0.0, 256));
        x.extend((0..256).map(|i| (i as f32 - 128.0) + 0.5));
        let nb = x.len() / QK_K;
        let (mut a, mut b) = (vec![BlockQ8K::default(); nb], vec![BlockQ8K::default(); nb]);
        quantize_act_row_k(&x, &mut a).unwrap();
        s.quantize_act_row_k(&x, &mut b);
        for (i, (p, q)) in a.iter().zip(&b).enumerate() {
            assert_eq!(p.qs, q.qs, "Q8K block {i}");
            assert_eq!(p.d.to_bits(), q.d.to_bits(), "Q8K block {i}");
            assert_eq!(p.bsums, q.bsums, "Q8K block {i}");
        }
    }
}
