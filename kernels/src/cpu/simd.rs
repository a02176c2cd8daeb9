//! AVX2/FMA/F16C inner loops. Reached only through [`Avx2`], a token that exists only
//! when the CPU has those features, so every call below runs on a CPU that supports it.
//!
//! Quantized products: per 32-element block, the integer dot of the weight codes with
//! the i8 activation codes is exact (`maddubs`/`madd`, i16 partial sums that provably do
//! not overflow), so only the float part decides the rounding. For every (row, token) it
//! is, with blocks in order and each step one rounding:
//!
//! ```text
//! acc  = fma(float(isum_b), d_w[b] · d_a[b], acc)      (acc starts at 0)
//! accm = fma(m_w[b], s_a[b], accm)                      (Q4_1 only)
//! out  = acc + accm                                     (Q4_1; the others: acc)
//! ```
//!
//! Both kernels run these steps on 8 lanes: the single-token kernel ([`Avx2::gemv`]) has
//! one lane per weight row, the batch kernel ([`Avx2::gemm_rows`]) one lane per token.
//! Each lane performs the same operations on the same values in the same order, so a
//! token's result does not depend on the size of the batch it is computed in: batched
//! decoding reproduces sequential decoding bit for bit. The model's greedy outputs are
//! sensitive to last-bit differences (a flipped int8 rounding of an activation
//! propagates), so this matters.
//!
//! The batch kernel is register-tiled: R weight rows × G·8 tokens ([`TILE_4BIT`],
//! [`TILE_8BIT`]). The activations of 8 tokens are interleaved four codes at a time
//! ([`Interleaved`]), so one broadcast of four weight codes times one contiguous load of
//! activations gives 8 tokens' partial dots at once (`maddubs`), accumulated in i16 over
//! the block (i32 for Q8_0); each weight broadcast serves G loads and each activation
//! load R rows. Q4_1's offset terms run in a second pass over the blocks.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::pool::ThreadPool;
use crate::api::{Layout, Matrix};
use crate::quant::BlockQ8;
use crate::types::{GgmlType, QK};

/// Register tile of the batch kernel for 4-bit weights: weight rows × groups of 8 tokens.
/// Measured on Zen 3 (one thread, SmolLM2 layer shapes, 32 tokens): 4×1 beats 4×2 and
/// 8×1 (both spill) by ~7 % and 2×2 by ~25 %.
const TILE_4BIT: (usize, usize) = (4, 1);
/// For Q8_0 weights (sign trick and i32 sums: twice the work per code, so each weight
/// broadcast serves two token groups): 4×2 beats 4×1 and 2×4 by ~12 %.
const TILE_8BIT: (usize, usize) = (4, 2);
/// Most weight rows any tile holds.
const TILE_R_MAX: usize = 4;
/// Weight rows the batch kernel unpacks at a time (a multiple of every tile's R): one
/// [`Layout::Rows8`] group, read in its stored order.
const UNPACK_ROWS: usize = 8;

/// Kinds of quantized weights, as const parameters of the kernels.
/// Q4_1: unsigned codes 0..15 (`value = q·d + m`), i16 block sums.
const U4: u8 = 0;
/// Q4_0: signed codes -8..7 through the sign trick, i16 block sums.
const S4: u8 = 1;
/// Q8_0: signed codes through the sign trick; |pair| can reach 32512, so i32 block sums.
const S8: u8 = 2;

/// Where each row's blocks lie in a quantized matrix's bytes, for either [`Layout`]: GGUF
/// rows are contiguous (blocks `block_bytes` apart); [`Layout::Rows8`] rows start
/// `block_bytes` apart inside their group of 8 and step over the group's other 7 rows
/// (blocks `8 · block_bytes` apart).
struct RowBlocks {
    row_bytes: usize,
    block_bytes: usize,
    rows8: bool,
    stride: usize,
}

impl RowBlocks {
    /// Checks that `w` holds `nb` blocks per row and every byte its layout stores, so that
    /// `start(r)` plus `stride` times a block index below `nb` stays inside `w.data` for
    /// every row `r < w.rows`.
    fn new(w: &Matrix<'_>, nb: usize) -> Self {
        let bb = w.ty.block_bytes();
        let row_bytes = nb * bb;
        let rows8 = w.layout == Layout::Rows8;
        let stored = if rows8 {
            w.rows.next_multiple_of(8)
        } else {
            w.rows
        };
        assert_eq!(
            w.data.len(),
            stored * row_bytes,
            "{:?} matrix size",
            w.layout
        );
        Self {
            row_bytes,
            block_bytes: bb,
            rows8,
            stride: if rows8 { 8 * bb } else { bb },
        }
    }

    /// Pointer to row `r`'s first block.
    fn start(&self, data: &[u8], r: usize) -> *const u8 {
        let off = if self.rows8 {
            r / 8 * 8 * self.row_bytes + r % 8 * self.block_bytes
        } else {
            r * self.row_bytes
        };
        data[off..].as_ptr()
    }
}

fn kind(ty: GgmlType) -> u8 {
    match ty {
        GgmlType::Q4_1 => U4,
        GgmlType::Q4_0 => S4,
        GgmlType::Q8_0 => S8,
        _ => unreachable!("float type in a quantized kernel"),
    }
}

/// Storage types of K rows, as const parameters of the attention kernels.
const KF32: u8 = 0;
const KF16: u8 = 1;
const KBF16: u8 = 2;
const KQ8: u8 = 3;

/// 32 bytes aligned for vector loads.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(32))]
pub(crate) struct Q32(pub [u8; 32]);

/// A batch's Q8 activations in the batch kernel's layout: tokens in groups of 8 lanes,
/// padded with zero tokens. For group `g` and block `b`, `q[(g·nb + b)·8 + j]` holds
/// codes `4j..4j+4` of each of the 8 tokens (token `l` in bytes `4l..4l+4`), and
/// `d`/`s` hold the tokens' block scale and scaled code sum at `(g·nb + b)·8 + l`.
#[derive(Debug, Default)]
pub(crate) struct Interleaved {
    nb: usize,
    groups: usize,
    n_tok: usize,
    q: Vec<Q32>,
    d: Vec<f32>,
    s: Vec<f32>,
}

impl Interleaved {
    /// Quantize `n_tok` rows of `x` (`nb` blocks each) and interleave them, both for a
    /// group of 8 tokens in one task: one pool dispatch instead of two. Each row is
    /// quantized by [`Avx2::quantize_act_row`], so the codes equal those of [`Self::new`]
    /// fed with that function's output.
    pub(crate) fn from_f32(
        simd: Avx2,
        x: &[f32],
        n_tok: usize,
        nb: usize,
        pool: &ThreadPool,
    ) -> Self {
        assert_eq!(x.len(), n_tok * nb * QK);
        let groups = n_tok.div_ceil(8);
        let mut q = vec![Q32::default(); groups * nb * 8];
        let mut d = vec![0f32; groups * nb * 8];
        let mut s = vec![0f32; groups * nb * 8];
        let per = (nb * 8).max(1);
        let parts: Vec<_> = q
            .chunks_mut(per)
            .zip(d.chunks_mut(per))
            .zip(s.chunks_mut(per))
            .collect();
        pool.for_each(parts, |g, ((q, d), s)| {
            let mut row = vec![BlockQ8::default(); nb];
            for l in 0..8.min(n_tok - 8 * g) {
                let t = 8 * g + l;
                simd.quantize_act_row(&x[t * nb * QK..(t + 1) * nb * QK], &mut row);
                interleave_row(&row, l, q, d, s);
            }
        });
        Self {
            nb,
            groups,
            n_tok,
            q,
            d,
            s,
        }
    }

    /// `act` holds `n_tok` rows of `nb` blocks; groups of 8 tokens are interleaved in
    /// parallel on `pool`.
    pub(crate) fn new(act: &[BlockQ8], n_tok: usize, nb: usize, pool: &ThreadPool) -> Self {
        assert_eq!(act.len(), n_tok * nb);
        let groups = n_tok.div_ceil(8);
        let mut q = vec![Q32::default(); groups * nb * 8];
        let mut d = vec![0f32; groups * nb * 8];
        let mut s = vec![0f32; groups * nb * 8];
        let per = (nb * 8).max(1);
        let parts: Vec<_> = q
            .chunks_mut(per)
            .zip(d.chunks_mut(per))
            .zip(s.chunks_mut(per))
            .collect();
        pool.for_each(parts, |g, ((q, d), s)| {
            for l in 0..8.min(n_tok - 8 * g) {
                let row = &act[(8 * g + l) * nb..(8 * g + l + 1) * nb];
                interleave_row(row, l, q, d, s);
            }
        });
        Self {
            nb,
            groups,
            n_tok,
            q,
            d,
            s,
        }
    }
}

/// Put one token's blocks (`row`) into lane `l` of a group's interleaved buffers.
fn interleave_row(row: &[BlockQ8], l: usize, q: &mut [Q32], d: &mut [f32], s: &mut [f32]) {
    for (b, blk) in row.iter().enumerate() {
        for (j, quad) in blk.qs.chunks_exact(4).enumerate() {
            let dst = &mut q[b * 8 + j].0[4 * l..4 * l + 4];
            for (o, v) in dst.iter_mut().zip(quad) {
                *o = *v as u8;
            }
        }
        d[b * 8 + l] = blk.d;
        s[b * 8 + l] = blk.s;
    }
}

/// Proof that AVX2, FMA and F16C are available.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx2(());

/// Per-thread buffers of the batch kernel: the tile's weight rows, unpacked.
#[derive(Debug, Default)]
pub(crate) struct TileScratch {
    /// Unsigned codes (Q4_1) or absolute values of the signed codes.
    wa: Vec<Q32>,
    /// Signed codes (Q4_0, Q8_0).
    ws: Vec<Q32>,
    d: Vec<f32>,
    m: Vec<f32>,
}

impl Avx2 {
    pub(crate) fn detect() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        ok.then_some(Avx2(()))
    }

    /// Rows `r0..r0+out.len()` of the quantized matrix `w` (either layout) times one
    /// token's activation blocks `act`, 8 rows at a time.
    pub(crate) fn gemv(self, w: &Matrix<'_>, r0: usize, act: &[BlockQ8], out: &mut [f32]) {
        self.gemv_tokens(w, r0, act, &mut [out]);
    }

    /// Rows `r0..r0+nr` of `w` times each of `out.len()` tokens (`act`: their activation
    /// blocks one token after another) into `out[t][i]`, one group of 8 rows at a time
    /// and [`gemv8`] once per token on it: the rows come from memory once and the later
    /// tokens find them in L1, and every token's result is exactly a single-token call's.
    pub(crate) fn gemv_tokens(
        self,
        w: &Matrix<'_>,
        r0: usize,
        act: &[BlockQ8],
        out: &mut [&mut [f32]],
    ) {
        let nr = out.first().map_or(0, |o| o.len());
        let nb = act.len() / out.len().max(1);
        assert!(act.len() == nb * out.len() && out.iter().all(|o| o.len() == nr));
        let rows = RowBlocks::new(w, nb);
        assert!(r0 + nr <= w.rows);
        for i in (0..nr).step_by(8) {
            let (first, here) = (r0 + i, (nr - i).min(8));
            // Lanes past the end repeat the last row; their results are dropped.
            let ptrs: [*const u8; 8] =
                std::array::from_fn(|k| rows.start(w.data, first + k.min(here - 1)));
            for (o, a) in out.iter_mut().zip(act.chunks_exact(nb)) {
                // SAFETY: the token proves the target features; each pointer starts row
                // r < w.rows, whose `nb` blocks of `ty` lie `stride` apart inside
                // `w.data` (`RowBlocks::new` checked the size), and `a` holds `nb` blocks.
                let r = unsafe {
                    match kind(w.ty) {
                        U4 => gemv8::<U4>(ptrs, rows.stride, a.as_ptr(), nb),
                        S4 => gemv8::<S4>(ptrs, rows.stride, a.as_ptr(), nb),
                        _ => gemv8::<S8>(ptrs, rows.stride, a.as_ptr(), nb),
                    }
                };
                // SAFETY: __m256 and [f32; 8] have the same size and any bits are valid.
                let v: [f32; 8] = unsafe { std::mem::transmute(r) };
                o[i..i + here].copy_from_slice(&v[..here]);
            }
        }
    }

    /// Rows `r0..r0+nr` of the quantized matrix `w` (either layout) against all tokens
    /// of `il`, into `out[t][i]` (one slice of `nr` per token).
    pub(crate) fn gemm_rows(
        self,
        w: &Matrix<'_>,
        r0: usize,
        il: &Interleaved,
        sc: &mut TileScratch,
        out: &mut [&mut [f32]],
    ) {
        const R4: usize = TILE_4BIT.0;
        const G4: usize = TILE_4BIT.1;
        const R8: usize = TILE_8BIT.0;
        const G8: usize = TILE_8BIT.1;
        match kind(w.ty) {
            U4 => self.gemm_rows_k::<U4, R4, G4>(w, r0, il, sc, out),
            S4 => self.gemm_rows_k::<S4, R4, G4>(w, r0, il, sc, out),
            _ => self.gemm_rows_k::<S8, R8, G8>(w, r0, il, sc, out),
        }
    }

    /// [`Self::gemm_rows`] with tiles of R rows × G groups of 8 tokens.
    fn gemm_rows_k<const K: u8, const R: usize, const G: usize>(
        self,
        w: &Matrix<'_>,
        r0: usize,
        il: &Interleaved,
        sc: &mut TileScratch,
        out: &mut [&mut [f32]],
    ) {
        const { assert!(R <= TILE_R_MAX && G >= 1) };
        let nb = il.nb;
        let nr = out.first().map_or(0, |o| o.len());
        let rows = RowBlocks::new(w, nb);
        assert!(out.len() == il.n_tok && out.iter().all(|o| o.len() == nr));
        assert!(nr > 0 && r0 + nr <= w.rows);
        const { assert!(UNPACK_ROWS.is_multiple_of(R)) };
        for v in [&mut sc.wa, &mut sc.ws] {
            if v.len() < UNPACK_ROWS * nb {
                v.resize(UNPACK_ROWS * nb, Q32::default());
            }
        }
        for v in [&mut sc.d, &mut sc.m] {
            if v.len() < UNPACK_ROWS * nb {
                v.resize(UNPACK_ROWS * nb, 0.0);
            }
        }
        let u = Unpacked {
            wa: sc.wa.as_mut_ptr(),
            ws: sc.ws.as_mut_ptr(),
            d: sc.d.as_mut_ptr(),
            m: sc.m.as_mut_ptr(),
            nb,
        };
        let mut rt = 0;
        while rt < nr {
            if rt.is_multiple_of(UNPACK_ROWS) {
                // Rows past the end repeat the last row; their results are dropped.
                let first = r0 + rt;
                let last = r0 + nr - 1;
                let starts = std::array::from_fn(|i| rows.start(w.data, (first + i).min(last)));
                // One Rows8 group exactly: read it in its stored order.
                let group = rows.rows8 && first.is_multiple_of(8) && first + 7 <= last;
                // SAFETY: features proven by the token; every row r <= last < w.rows has
                // `nb` blocks `stride` apart in `w.data` (`RowBlocks::new` checked the
                // size), and the scratch holds UNPACK_ROWS rows of `nb` entries.
                unsafe { unpack_rows::<K>(starts, rows.stride, group, &u) };
            }
            // This tile's rows in the scratch.
            let first_row = rt % UNPACK_ROWS * nb;
            let rows_here = R.min(nr - rt);
            let mut g = 0;
            while g < il.groups {
                let full = g + G <= il.groups;
                let at = g * nb * 8;
                // SAFETY: first_row + R·nb <= UNPACK_ROWS·nb entries (R divides it).
                let p = TilePtrs {
                    wa: unsafe { u.wa.add(first_row) },
                    ws: unsafe { u.ws.add(first_row) },
                    dw: unsafe { u.d.add(first_row) },
                    m: unsafe { u.m.add(first_row) },
                    q: il.q[at..].as_ptr(),
                    d: il.d[at..].as_ptr(),
                    s: il.s[at..].as_ptr(),
                    nb,
                };
                // Writes rows rt.. of one group's results ([row] lanes = tokens).
                let mut store = |gg: usize, res: &[__m256]| {
                    let t0 = (g + gg) * 8;
                    let n_here = (il.n_tok - t0).min(8);
                    if res.len() == 4 && rows_here == 4 {
                        // 4 rows × 8 tokens transposed: 4 consecutive values per token.
                        // SAFETY: features proven by the token.
                        let tr = unsafe { transpose4x8(res[0], res[1], res[2], res[3]) };
                        for (l, v) in tr.iter().enumerate().take(n_here) {
                            out[t0 + l][rt..rt + 4].copy_from_slice(v);
                        }
                        return;
                    }
                    for (i, v) in res.iter().enumerate().take(rows_here) {
                        // SAFETY: __m256 and [f32; 8] have the same size and any bits are
                        // valid for both.
                        let lanes: [f32; 8] = unsafe { std::mem::transmute(*v) };
                        for (l, x) in lanes.iter().enumerate().take(n_here) {
                            out[t0 + l][rt + i] = *x;
                        }
                    }
                };
                // SAFETY (both calls): features proven by the token; the scratch holds R
                // rows of `nb` blocks, and `il` holds `nb` blocks of 8 lanes for groups
                // `g..g+G` when `full`, else for group `g`.
                if full {
                    let res = unsafe { tile::<K, R, G>(&p) };
                    for (gg, _) in res[0].iter().enumerate() {
                        let col: [__m256; R] = std::array::from_fn(|i| res[i][gg]);
                        store(gg, &col);
                    }
                    g += G;
                } else {
                    let res = unsafe { tile::<K, R, 1>(&p) };
                    let col: [__m256; R] = std::array::from_fn(|i| res[i][0]);
                    store(0, &col);
                    g += 1;
                }
            }
            rt += R;
        }
    }

    /// Whether [`Self::attn_scores`] and [`Self::attn_pv`] both have kernels for K and V
    /// of these types, heads of `hd` values and groups of `g` query heads.
    pub(crate) fn attn_fused(self, k: GgmlType, v: GgmlType, hd: usize, g: usize) -> bool {
        let typed = |t| {
            matches!(
                t,
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0
            )
        };
        typed(k) && typed(v) && hd > 0 && hd.is_multiple_of(32) && (1..=4).contains(&g)
    }

    /// Attention scores of the `q.len() / hd` query heads of one KV group against the K
    /// rows of type `ty` at byte offsets `offs` in `data` (`hd` values each), times
    /// `scale`, into `scores`: head h's score of row t at `h * stride + t`. Returns false,
    /// touching nothing, for a shape it has no kernel for.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attn_scores(
        self,
        ty: GgmlType,
        data: &[u8],
        offs: &[usize],
        hd: usize,
        q: &[f32],
        scale: f32,
        scores: &mut [f32],
        stride: usize,
    ) -> bool {
        let (n, g) = (offs.len(), q.len() / hd.max(1));
        let t = match ty {
            GgmlType::F32 => KF32,
            GgmlType::F16 => KF16,
            GgmlType::BF16 => KBF16,
            GgmlType::Q8_0 if hd.is_multiple_of(QK) => KQ8,
            _ => return false,
        };
        if hd == 0 || !hd.is_multiple_of(8) || !(1..=4).contains(&g) {
            return false;
        }
        let head_bytes = ty.row_bytes(hd).expect("checked by the caller");
        assert!(q.len() == g * hd && stride >= n && scores.len() >= (g - 1) * stride + n);
        assert!(offs.iter().all(|o| o + head_bytes <= data.len()));
        let (d, o, qp, sp) = (
            data.as_ptr(),
            offs.as_ptr(),
            q.as_ptr(),
            scores.as_mut_ptr(),
        );
        macro_rules! go {
            ($t:ident) => {
                match g {
                    1 => scores_k::<$t, 1>(d, o, n, hd, qp, scale, sp, stride),
                    2 => scores_k::<$t, 2>(d, o, n, hd, qp, scale, sp, stride),
                    3 => scores_k::<$t, 3>(d, o, n, hd, qp, scale, sp, stride),
                    _ => scores_k::<$t, 4>(d, o, n, hd, qp, scale, sp, stride),
                }
            };
        }
        // SAFETY: features proven by the token; every offset starts `hd` values of `ty`
        // inside `data` (asserted), `q` holds g·hd floats and `scores` (g-1)·stride + n
        // (asserted).
        unsafe {
            match t {
                KF32 => go!(KF32),
                KF16 => go!(KF16),
                KBF16 => go!(KBF16),
                _ => go!(KQ8),
            }
        }
        true
    }

    /// `out` (one row of `hd` per head) `= Σ_t p[h][t] · V[t]` over the V rows of type
    /// `ty` at byte offsets `offs` in `data`, head h's weight of row t at
    /// `p[h * p_stride + t]`. With `accumulate` the sum continues from `out` (the same
    /// additions in the same order as one call over all the rows, so the same bits).
    /// Returns false, touching nothing, for a shape it has no kernel for.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attn_pv(
        self,
        ty: GgmlType,
        data: &[u8],
        offs: &[usize],
        hd: usize,
        p: &[f32],
        p_stride: usize,
        out: &mut [f32],
        accumulate: bool,
    ) -> bool {
        let (n, g) = (offs.len(), out.len() / hd.max(1));
        let t = match ty {
            GgmlType::F32 => KF32,
            GgmlType::F16 => KF16,
            GgmlType::BF16 => KBF16,
            GgmlType::Q8_0 => KQ8,
            _ => return false,
        };
        if hd == 0 || !hd.is_multiple_of(32) || !(1..=4).contains(&g) {
            return false;
        }
        let head_bytes = ty.row_bytes(hd).expect("checked by the caller");
        assert!(out.len() == g * hd && p_stride >= n && p.len() >= (g - 1) * p_stride + n);
        assert!(offs.iter().all(|o| o + head_bytes <= data.len()));
        let (d, o, pp, op) = (data.as_ptr(), offs.as_ptr(), p.as_ptr(), out.as_mut_ptr());
        macro_rules! go {
            ($t:ident) => {
                match g {
                    1 => pv_k::<$t, 1>(d, o, n, hd, pp, p_stride, op, accumulate),
                    2 => pv_k::<$t, 2>(d, o, n, hd, pp, p_stride, op, accumulate),
                    3 => pv_k::<$t, 3>(d, o, n, hd, pp, p_stride, op, accumulate),
                    _ => pv_k::<$t, 4>(d, o, n, hd, pp, p_stride, op, accumulate),
                }
            };
        }
        // SAFETY: features proven by the token; every offset starts `hd` values of `ty`
        // inside `data` (asserted), `p` holds (g-1)·p_stride + n floats and `out` g·hd
        // (asserted).
        unsafe {
            match t {
                KF32 => go!(KF32),
                KF16 => go!(KF16),
                KBF16 => go!(KBF16),
                _ => go!(KQ8),
            }
        }
        true
    }

    /// In-place softmax of `x` with a vectorized exp.
    pub(crate) fn softmax(self, x: &mut [f32]) {
        // SAFETY: features proven by the token; the kernel touches `x.len()` floats.
        unsafe { softmax(x.as_mut_ptr(), x.len()) }
    }

    /// [`crate::quant::quantize_act_row`] for rows whose length is a multiple of 32, with
    /// the same bits: the same scale arithmetic, products and half-to-even rounding.
    pub(crate) fn quantize_act_row(self, x: &[f32], out: &mut [BlockQ8]) {
        assert_eq!(x.len(), out.len() * QK);
        for (blk, xs) in out.iter_mut().zip(x.chunks_exact(QK)) {
            // SAFETY: features proven by the token; `xs` holds 32 floats.
            unsafe { quantize_block(xs.as_ptr(), blk) }
        }
    }

    /// `gate = silu(gate) · up` with a vectorized exp.
    pub(crate) fn silu_mul(self, gate: &mut [f32], up: &[f32]) {
        assert_eq!(gate.len(), up.len());
        // SAFETY: features proven by the token; both slices have `gate.len()` elements.
        unsafe { silu_mul(gate.as_mut_ptr(), up.as_ptr(), gate.len()) }
    }

    pub(crate) fn dot_f32(self, a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        // SAFETY: features proven by the token; both slices have `a.len()` elements.
        unsafe { dot_f32(a.as_ptr(), b.as_ptr(), a.len()) }
    }

    /// `out = Σ_t p[t] · v[t·d .. (t+1)·d]` with `d = out.len()`, accumulating in registers.
    pub(crate) fn weighted_sum(self, p: &[f32], v: &[f32], out: &mut [f32]) {
        let d = out.len();
        assert!(d.is_multiple_of(8) && v.len() == p.len() * d);
        // SAFETY: features proven by the token; `v` holds `p.len()` rows of `d` floats and
        // `d` is a multiple of 8 (asserted), which is all the kernel touches.
        unsafe { weighted_sum(p.as_ptr(), p.len(), v.as_ptr(), d, out.as_mut_ptr()) }
    }

    /// Decode F16/BF16 rows (others fall back to the scalar decoder, which the caller does).
    pub(crate) fn f16_to_f32(self, src: &[u8], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len() * 2);
        // SAFETY: features proven by the token; `src` holds `dst.len()` halves.
        unsafe { f16_to_f32(src.as_ptr(), dst.as_mut_ptr(), dst.len()) }
    }

    pub(crate) fn bf16_to_f32(self, src: &[u8], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len() * 2);
        // SAFETY: features proven by the token; `src` holds `dst.len()` bf16 values.
        unsafe { bf16_to_f32(src.as_ptr(), dst.as_mut_ptr(), dst.len()) }
    }

    pub(crate) fn q8_0_to_f32(self, src: &[u8], dst: &mut [f32]) {
        let nb = dst.len() / QK;
        assert!(dst.len().is_multiple_of(QK) && src.len() == nb * GgmlType::Q8_0.block_bytes());
        // SAFETY: features proven by the token; `src` holds `nb` Q8_0 blocks.
        unsafe { q8_0_to_f32(src.as_ptr(), dst.as_mut_ptr(), nb) }
    }
}

/// Lanes of 4 vectors (rows) regrouped per lane: `out[l] = [a[l], b[l], c[l], d[l]]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn transpose4x8(a: __m256, b: __m256, c: __m256, d: __m256) -> [[f32; 4]; 8] {
    let ab_lo = _mm256_unpacklo_ps(a, b); // a0 b0 a1 b1 | a4 b4 a5 b5
    let ab_hi = _mm256_unpackhi_ps(a, b); // a2 b2 a3 b3 | a6 b6 a7 b7
    let cd_lo = _mm256_unpacklo_ps(c, d);
    let cd_hi = _mm256_unpackhi_ps(c, d);
    let l0 = _mm256_shuffle_ps::<0b01_00_01_00>(ab_lo, cd_lo); // lanes 0 | 4
    let l1 = _mm256_shuffle_ps::<0b11_10_11_10>(ab_lo, cd_lo); // lanes 1 | 5
    let l2 = _mm256_shuffle_ps::<0b01_00_01_00>(ab_hi, cd_hi); // lanes 2 | 6
    let l3 = _mm256_shuffle_ps::<0b11_10_11_10>(ab_hi, cd_hi); // lanes 3 | 7
    // SAFETY: [__m256; 4] and [[f32; 4]; 8] have the same size and any bits are valid.
    let v: [[f32; 4]; 8] = unsafe { std::mem::transmute([l0, l1, l2, l3]) };
    [v[0], v[2], v[4], v[6], v[1], v[3], v[5], v[7]]
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// The 32 nibbles of a Q4 block in element order (low nibbles first), as bytes 0..15.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller passes a pointer to 16 readable bytes.
    let raw = unsafe { _mm_loadu_si128(p.cast()) };
    let mask = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(raw, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), mask);
    _mm256_set_m128i(hi, lo)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x1(p: *const u8) -> f32 {
    // SAFETY: the caller passes a pointer to 2 readable bytes.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Block layout of each kind: bytes per block, offset of the codes.
const fn layout(k: u8) -> (usize, usize) {
    match k {
        U4 => (20, 4),
        S4 => (18, 2),
        _ => (34, 2),
    }
}

/// Signed codes of block `blk` (S4, S8) or unsigned codes (U4).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn codes<const K: u8>(blk: *const u8) -> __m256i {
    let off = layout(K).1;
    // SAFETY: the caller passes a whole block of kind K.
    unsafe {
        match K {
            U4 => nibbles(blk.add(off)),
            S4 => _mm256_sub_epi8(nibbles(blk.add(off)), _mm256_set1_epi8(8)),
            _ => _mm256_loadu_si256(blk.add(off).cast()),
        }
    }
}

/// Where the batch kernel unpacks weight rows: codes (`wa` unsigned or absolute, `ws`
/// signed), block scales `d` and offsets `m` (0 unless Q4_1); row i's block b at
/// `i · nb + b`.
struct Unpacked {
    wa: *mut Q32,
    ws: *mut Q32,
    d: *mut f32,
    m: *mut f32,
    nb: usize,
}

/// Expand block `b` of scratch row `i` from the block at `blk`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_block<const K: u8>(blk: *const u8, u: &Unpacked, i: usize, b: usize) {
    let at = i * u.nb + b;
    // SAFETY: the caller passes a whole block of kind K and an entry inside the scratch.
    unsafe {
        let c = codes::<K>(blk);
        if K == U4 {
            _mm256_store_si256(u.wa.add(at).cast(), c);
            *u.m.add(at) = f16x1(blk.add(2));
        } else {
            _mm256_store_si256(u.wa.add(at).cast(), _mm256_abs_epi8(c));
            _mm256_store_si256(u.ws.add(at).cast(), c);
            *u.m.add(at) = 0.0;
        }
        *u.d.add(at) = f16x1(blk);
    }
}

/// Expand rows `starts` (blocks `stride` bytes apart) into scratch rows 0..8. In block
/// order across the rows when `interleaved` (a [`Layout::Rows8`] group: one sequential
/// read), else row by row (GGUF rows: one sequential read each).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_rows<const K: u8>(
    starts: [*const u8; 8],
    stride: usize,
    interleaved: bool,
    u: &Unpacked,
) {
    // SAFETY (both loops): the caller guarantees `u.nb` blocks of kind K `stride` apart
    // behind every start and 8 rows of `u.nb` entries in the scratch.
    if interleaved {
        for b in 0..u.nb {
            for (i, s) in starts.iter().enumerate() {
                unsafe { unpack_block::<K>(s.add(b * stride), u, i, b) };
            }
        }
    } else {
        for (i, s) in starts.iter().enumerate() {
            for b in 0..u.nb {
                unsafe { unpack_block::<K>(s.add(b * stride), u, i, b) };
            }
        }
    }
}

/// Sums of the 16 i16 lanes of each of 8 vectors, as i32 lanes 0..7. Each input lane is a
/// `maddubs` pair of a 4-bit code and an i8 (|v| ≤ 2·15·127 = 3810), so the partial sums
/// of up to 8 lanes stay below 2¹⁵.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum8_i16(p: [__m256i; 8]) -> __m256i {
    let h01 = _mm256_hadd_epi16(p[0], p[1]);
    let h23 = _mm256_hadd_epi16(p[2], p[3]);
    let h45 = _mm256_hadd_epi16(p[4], p[5]);
    let h67 = _mm256_hadd_epi16(p[6], p[7]);
    let h = _mm256_hadd_epi16(_mm256_hadd_epi16(h01, h23), _mm256_hadd_epi16(h45, h67));
    // Per 128-bit half: lane k = vector k's sum over that half.
    let lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(h));
    let hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256::<1>(h));
    _mm256_add_epi32(lo, hi)
}

/// Sums of the 8 i32 lanes of each of 8 vectors, as lanes 0..7.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum8_i32(p: [__m256i; 8]) -> __m256i {
    let h01 = _mm256_hadd_epi32(p[0], p[1]);
    let h23 = _mm256_hadd_epi32(p[2], p[3]);
    let h45 = _mm256_hadd_epi32(p[4], p[5]);
    let h67 = _mm256_hadd_epi32(p[6], p[7]);
    let a = _mm256_hadd_epi32(h01, h23);
    let b = _mm256_hadd_epi32(h45, h67);
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(a, b),
        _mm256_permute2x128_si256::<0x31>(a, b),
    )
}

/// 8 rows (lanes, blocks `stride` bytes apart) times one token: see the module docs for
/// the float steps.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv8<const K: u8>(
    rows: [*const u8; 8],
    stride: usize,
    act: *const BlockQ8,
    nb: usize,
) -> __m256 {
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    let mut accm = _mm256_setzero_ps();
    for b in 0..nb {
        // SAFETY: b < nb; the caller guarantees nb blocks behind every row pointer and
        // behind `act`.
        unsafe {
            let a = &*act.add(b);
            let av = _mm256_loadu_si256(a.qs.as_ptr().cast());
            let mut p = [_mm256_setzero_si256(); 8];
            for (r, pr) in p.iter_mut().enumerate() {
                let blk = rows[r].add(b * stride);
                let c = codes::<K>(blk);
                *pr = match K {
                    U4 => _mm256_maddubs_epi16(c, av),
                    S4 => _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(av, c)),
                    _ => _mm256_madd_epi16(
                        _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(av, c)),
                        ones,
                    ),
                };
            }
            let isum = if K == S8 { sum8_i32(p) } else { sum8_i16(p) };
            let r = |k: usize| rows[k].add(b * stride);
            let (dw, mw) = if K == U4 {
                let dm = _mm256_setr_epi32(
                    r(0).cast::<i32>().read_unaligned(),
                    r(1).cast::<i32>().read_unaligned(),
                    r(2).cast::<i32>().read_unaligned(),
                    r(3).cast::<i32>().read_unaligned(),
                    r(4).cast::<i32>().read_unaligned(),
                    r(5).cast::<i32>().read_unaligned(),
                    r(6).cast::<i32>().read_unaligned(),
                    r(7).cast::<i32>().read_unaligned(),
                );
                // Per 128-bit half: the 4 d's into bytes 0..8, the 4 m's into 8..16.
                let split = _mm256_setr_epi8(
                    0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13,
                    2, 3, 6, 7, 10, 11, 14, 15,
                );
                let v = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(dm, split));
                (
                    _mm256_cvtph_ps(_mm256_castsi256_si128(v)),
                    _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(v)),
                )
            } else {
                let h = |k: usize| r(k).cast::<i16>().read_unaligned();
                let d = _mm_setr_epi16(h(0), h(1), h(2), h(3), h(4), h(5), h(6), h(7));
                (_mm256_cvtph_ps(d), _mm256_setzero_ps())
            };
            let scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.d));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc);
            if K == U4 {
                accm = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s), accm);
            }
        }
    }
    if K == U4 {
        _mm256_add_ps(acc, accm)
    } else {
        acc
    }
}

/// Pointers into a tile's unpacked weights (see [`unpack_row`], rows `nb` apart) and a
/// token group's interleaved activations (see [`Interleaved`], groups `8·nb` apart).
struct TilePtrs {
    wa: *const Q32,
    ws: *const Q32,
    dw: *const f32,
    m: *const f32,
    q: *const Q32,
    d: *const f32,
    s: *const f32,
    nb: usize,
}

/// R unpacked rows × G groups of 8 tokens: see the module docs for the float steps.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const K: u8, const R: usize, const G: usize>(p: &TilePtrs) -> [[__m256; G]; R] {
    let nb = p.nb;
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); G]; R];
    for b in 0..nb {
        // SAFETY: b < nb; the caller guarantees R rows of nb blocks in the weight
        // pointers and G groups of nb blocks of 8 lanes in the activation pointers.
        unsafe {
            let mut sums = [[_mm256_setzero_si256(); G]; R];
            for j in 0..8 {
                let mut a = [_mm256_setzero_si256(); G];
                for (g, ag) in a.iter_mut().enumerate() {
                    *ag = _mm256_load_si256(p.q.add((g * nb + b) * 8 + j).cast());
                }
                for (r, sr) in sums.iter_mut().enumerate() {
                    let quad = |w: *const Q32| w.add(r * nb + b).cast::<i32>().add(j).read();
                    let wa = _mm256_set1_epi32(quad(p.wa));
                    let ws = if K == U4 {
                        wa
                    } else {
                        _mm256_set1_epi32(quad(p.ws))
                    };
                    for (s, ag) in sr.iter_mut().zip(a) {
                        let av = if K == U4 {
                            ag
                        } else {
                            _mm256_sign_epi8(ag, ws)
                        };
                        let pr = _mm256_maddubs_epi16(wa, av);
                        *s = if K == S8 {
                            _mm256_add_epi32(*s, _mm256_madd_epi16(pr, ones))
                        } else {
                            _mm256_add_epi16(*s, pr)
                        };
                    }
                }
            }
            for (r, (ar, sr)) in acc.iter_mut().zip(sums).enumerate() {
                let dw = _mm256_set1_ps(*p.dw.add(r * nb + b));
                for (g, (a, s)) in ar.iter_mut().zip(sr).enumerate() {
                    let isum = if K == S8 {
                        s
                    } else {
                        _mm256_madd_epi16(s, ones)
                    };
                    let da = _mm256_loadu_ps(p.d.add((g * nb + b) * 8));
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, da), *a);
                }
            }
        }
    }
    if K == U4 {
        // The offset terms in a second pass (fewer live registers in the main loop): the
        // same fma chain over the blocks per lane, so the same bits.
        let mut accm = [[_mm256_setzero_ps(); G]; R];
        for b in 0..nb {
            for (r, mr) in accm.iter_mut().enumerate() {
                // SAFETY: as above.
                unsafe {
                    let m = _mm256_set1_ps(*p.m.add(r * nb + b));
                    for (g, a) in mr.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(m, _mm256_loadu_ps(p.s.add((g * nb + b) * 8)), *a);
                    }
                }
            }
        }
        for (ar, mr) in acc.iter_mut().zip(accm) {
            for (a, m) in ar.iter_mut().zip(mr) {
                *a = _mm256_add_ps(*a, m);
            }
        }
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32(a: *const f32, b: *const f32, n: usize) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut i = 0;
    // SAFETY (all blocks below): i + 8 <= n in the vector loop and i < n in the tail; the
    // caller guarantees n readable elements behind both pointers.
    while i + 16 <= n {
        unsafe {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc[0]);
            acc[1] = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.add(i + 8)),
                _mm256_loadu_ps(b.add(i + 8)),
                acc[1],
            );
        }
        i += 16;
    }
    while i + 8 <= n {
        unsafe {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc[0]);
        }
        i += 8;
    }
    let mut s = hsum(_mm256_add_ps(acc[0], acc[1]));
    while i < n {
        unsafe {
            s += *a.add(i) * *b.add(i);
        }
        i += 1;
    }
    s
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_to_f32(src: *const u8, dst: *mut f32, n: usize) {
    let mut i = 0;
    // SAFETY (both blocks): indices stay below n; the caller guarantees n halves in `src`
    // and n floats in `dst`.
    while i + 8 <= n {
        unsafe {
            let h = _mm_loadu_si128(src.add(2 * i).cast());
            _mm256_storeu_ps(dst.add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    while i < n {
        unsafe {
            *dst.add(i) = f16x1(src.add(2 * i));
        }
        i += 1;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bf16_to_f32(src: *const u8, dst: *mut f32, n: usize) {
    let mut i = 0;
    // SAFETY (both blocks): indices stay below n; the caller guarantees n values in `src`
    // and n floats in `dst`.
    while i + 8 <= n {
        unsafe {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(src.add(2 * i).cast()));
            _mm256_storeu_ps(dst.add(i), _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h)));
        }
        i += 8;
    }
    while i < n {
        unsafe {
            let bits = src.add(2 * i).cast::<u16>().read_unaligned() as u32;
            *dst.add(i) = f32::from_bits(bits << 16);
        }
        i += 1;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_to_f32(src: *const u8, dst: *mut f32, nb: usize) {
    for b in 0..nb {
        // SAFETY: b < nb; the caller guarantees nb blocks in `src` and nb·32 floats in `dst`.
        unsafe {
            let blk = src.add(b * 34);
            let d = _mm256_set1_ps(f16x1(blk));
            for j in 0..4 {
                let q = _mm_loadl_epi64(blk.add(2 + 8 * j).cast());
                let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                _mm256_storeu_ps(dst.add(b * QK + 8 * j), _mm256_mul_ps(v, d));
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weighted_sum(p: *const f32, n: usize, v: *const f32, d: usize, out: *mut f32) {
    let mut c = 0;
    // 32 output dims (4 registers) per pass over the rows, 8 at a time for the rest.
    while c < d {
        let w = if d - c >= 32 { 4 } else { 1 };
        let mut acc = [_mm256_setzero_ps(); 4];
        for t in 0..n {
            // SAFETY: t < n and c + 8·w <= d, inside the caller's `n × d` rows and `n` weights.
            unsafe {
                let pt = _mm256_set1_ps(*p.add(t));
                let row = v.add(t * d + c);
                for (j, a) in acc.iter_mut().enumerate().take(w) {
                    *a = _mm256_fmadd_ps(pt, _mm256_loadu_ps(row.add(8 * j)), *a);
                }
            }
        }
        for (j, a) in acc.iter().enumerate().take(w) {
            // SAFETY: c + 8·j + 8 <= d, inside `out`.
            unsafe { _mm256_storeu_ps(out.add(c + 8 * j), *a) };
        }
        c += 8 * w;
    }
}

/// Sums of the 8 lanes of each of 8 vectors, as lanes 0..7.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum8_ps(p: [__m256; 8]) -> __m256 {
    let h01 = _mm256_hadd_ps(p[0], p[1]);
    let h23 = _mm256_hadd_ps(p[2], p[3]);
    let h45 = _mm256_hadd_ps(p[4], p[5]);
    let h67 = _mm256_hadd_ps(p[6], p[7]);
    let a = _mm256_hadd_ps(h01, h23);
    let b = _mm256_hadd_ps(h45, h67);
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(a, b),
        _mm256_permute2f128_ps::<0x31>(a, b),
    )
}

/// Values `8c..8c+8` of a K/V head row of type T, as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<const T: u8>(row: *const u8, c: usize) -> __m256 {
    // SAFETY: the caller passes a row of at least 8c+8 values of type T.
    unsafe {
        match T {
            KF32 => _mm256_loadu_ps(row.cast::<f32>().add(8 * c)),
            KF16 => _mm256_cvtph_ps(_mm_loadu_si128(row.add(16 * c).cast())),
            KBF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(row.add(16 * c).cast()),
            ))),
            _ => {
                let blk = row.add(34 * (c / 4));
                let v = _mm_loadl_epi64(blk.add(2 + 8 * (c % 4)).cast());
                _mm256_mul_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)),
                    _mm256_set1_ps(f16x1(blk)),
                )
            }
        }
    }
}

/// `out[h] (+)= Σ_t p[h][t] · V[t]` for G heads over the V rows at `offs`, 32 dimensions
/// per pass: each row chunk is decoded once in registers and shared by the G heads (a
/// Q8_0 block's scale is folded into the weights `p`). `accumulate` starts from `out`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pv_k<const T: u8, const G: usize>(
    data: *const u8,
    offs: *const usize,
    n: usize,
    hd: usize,
    p: *const f32,
    p_stride: usize,
    out: *mut f32,
    accumulate: bool,
) {
    for c0 in (0..hd).step_by(32) {
        let mut acc = [[_mm256_setzero_ps(); 4]; G];
        if accumulate {
            for (h, ah) in acc.iter_mut().enumerate() {
                for (j, a) in ah.iter_mut().enumerate() {
                    // SAFETY: h < G and c0 + 8j + 8 <= hd, inside the caller's G·hd floats.
                    *a = unsafe { _mm256_loadu_ps(out.add(h * hd + c0 + 8 * j)) };
                }
            }
        }
        for t in 0..n {
            // SAFETY: t < n and c0 + 32 <= hd; the caller guarantees `hd` values of type T
            // at every offset, weights at h·p_stride + t < (G-1)·p_stride + n in `p`, and
            // G·hd floats in `out`.
            unsafe {
                let row = data.add(*offs.add(t));
                let mut v = [_mm256_setzero_ps(); 4];
                let mut d = 1.0;
                if T == KQ8 {
                    let blk = row.add(34 * (c0 / 32));
                    d = f16x1(blk);
                    for (j, vj) in v.iter_mut().enumerate() {
                        let q = _mm_loadl_epi64(blk.add(2 + 8 * j).cast());
                        *vj = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                    }
                } else {
                    for (j, vj) in v.iter_mut().enumerate() {
                        *vj = load8::<T>(row, c0 / 8 + j);
                    }
                }
                for (h, ah) in acc.iter_mut().enumerate() {
                    let w = *p.add(h * p_stride + t);
                    let w = _mm256_set1_ps(if T == KQ8 { w * d } else { w });
                    for (a, vj) in ah.iter_mut().zip(v) {
                        *a = _mm256_fmadd_ps(w, vj, *a);
                    }
                }
            }
        }
        for (h, ah) in acc.iter().enumerate() {
            for (j, a) in ah.iter().enumerate() {
                // SAFETY: h < G and c0 + 8j + 8 <= hd, inside the caller's G·hd floats.
                unsafe { _mm256_storeu_ps(out.add(h * hd + c0 + 8 * j), *a) };
            }
        }
    }
}

/// Scores of G heads against the K rows at `offs` (head h's row t at `out[h * stride +
/// t]`): each row is decoded 8 values at a time in registers and shared by the G heads;
/// two positions share each load of the queries, and 8 positions are reduced together.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_k<const T: u8, const G: usize>(
    data: *const u8,
    offs: *const usize,
    n: usize,
    hd: usize,
    q: *const f32,
    scale: f32,
    out: *mut f32,
    stride: usize,
) {
    let scale = _mm256_set1_ps(scale);
    let mut t0 = 0;
    while t0 < n {
        let m = (n - t0).min(8);
        let mut part = [[_mm256_setzero_ps(); 8]; G];
        let mut i = 0;
        while i < m {
            let two = i + 1 < m;
            // SAFETY: t0 + i (+ 1 when `two`) < n; the caller guarantees `hd` values of
            // type T at every offset and G·hd floats in `q`.
            unsafe {
                let r0 = data.add(*offs.add(t0 + i));
                let r1 = if two {
                    data.add(*offs.add(t0 + i + 1))
                } else {
                    r0
                };
                let mut acc = [[_mm256_setzero_ps(); 2]; G];
                let (mut d0, mut d1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                for c in 0..hd / 8 {
                    let (k0, k1) = if T == KQ8 {
                        // One scale per 32-value block, converted once.
                        let (b0, b1) = (r0.add(34 * (c / 4)), r1.add(34 * (c / 4)));
                        if c % 4 == 0 {
                            d0 = _mm256_set1_ps(f16x1(b0));
                            d1 = _mm256_set1_ps(f16x1(b1));
                        }
                        let v0 = _mm_loadl_epi64(b0.add(2 + 8 * (c % 4)).cast());
                        let v1 = _mm_loadl_epi64(b1.add(2 + 8 * (c % 4)).cast());
                        (
                            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0)), d0),
                            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1)), d1),
                        )
                    } else {
                        (load8::<T>(r0, c), load8::<T>(r1, c))
                    };
                    for (h, a) in acc.iter_mut().enumerate() {
                        let qv = _mm256_loadu_ps(q.add(h * hd + 8 * c));
                        a[0] = _mm256_fmadd_ps(qv, k0, a[0]);
                        a[1] = _mm256_fmadd_ps(qv, k1, a[1]);
                    }
                }
                for (ph, a) in part.iter_mut().zip(acc) {
                    ph[i] = a[0];
                    if two {
                        ph[i + 1] = a[1];
                    }
                }
            }
            i += 2;
        }
        for (h, ph) in part.into_iter().enumerate() {
            let v = _mm256_mul_ps(sum8_ps(ph), scale);
            // SAFETY: __m256 and [f32; 8] have the same size and any bits are valid.
            let lanes: [f32; 8] = unsafe { std::mem::transmute(v) };
            for (i, x) in lanes.iter().enumerate().take(m) {
                // SAFETY: h < G and t0 + i < n, inside the caller's (G-1)·stride + n floats.
                unsafe { *out.add(h * stride + t0 + i) = *x };
            }
        }
        t0 += 8;
    }
}

/// `exp(x)` for 8 lanes (Cephes polynomial, ~1 ulp), for inputs ≤ 0 in softmax.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn exp_ps(x: __m256) -> __m256 {
    let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
    let fx = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), x);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(
        y,
        _mm256_mul_ps(x, x),
        _mm256_add_ps(x, _mm256_set1_ps(1.0)),
    );
    let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(fx),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(y, _mm256_castsi256_ps(pow2))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_block(x: *const f32, blk: &mut BlockQ8) {
    // SAFETY: the caller passes 32 readable floats.
    let v: [__m256; 4] = std::array::from_fn(|j| unsafe { _mm256_loadu_ps(x.add(8 * j)) });
    let sign = _mm256_set1_ps(-0.0);
    let m = v.iter().fold(_mm256_setzero_ps(), |m, x| {
        _mm256_max_ps(m, _mm256_andnot_ps(sign, *x))
    });
    // SAFETY: __m256 and [f32; 8] have the same size and any bits are valid.
    let lanes: [f32; 8] = unsafe { std::mem::transmute(m) };
    let amax = lanes.iter().fold(0f32, |m, v| m.max(*v));
    let (d, id) = crate::quant::q8_scale(amax);
    let (idv, lo, hi) = (
        _mm256_set1_ps(id),
        _mm256_set1_ps(-127.0),
        _mm256_set1_ps(127.0),
    );
    let q: [__m256i; 4] = std::array::from_fn(|j| {
        let c = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[j], idv), lo), hi);
        _mm256_cvtps_epi32(_mm256_round_ps::<
            { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
        >(c))
    });
    let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    // SAFETY: as above, for i32 lanes.
    let sl: [i32; 8] = unsafe { std::mem::transmute(sum) };
    // Packing works per 128-bit half; the permute restores element order.
    let p16a = _mm256_packs_epi32(q[0], q[1]);
    let p16b = _mm256_packs_epi32(q[2], q[3]);
    let p8 = _mm256_packs_epi16(p16a, p16b);
    let p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: `qs` is 32 writable bytes.
    unsafe { _mm256_storeu_si256(blk.qs.as_mut_ptr().cast(), p8) };
    blk.d = d;
    blk.s = d * sl.iter().sum::<i32>() as f32;
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn silu_mul(g: *mut f32, u: *const f32, n: usize) {
    let one = _mm256_set1_ps(1.0);
    // exp(-x) for x < -88 would overflow; silu(x) is -0 to f32 precision there anyway.
    let lim = _mm256_set1_ps(88.0);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n, inside the caller's two slices of n floats.
        unsafe {
            let x = _mm256_loadu_ps(g.add(i));
            let e = exp_ps(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), lim));
            let s = _mm256_div_ps(x, _mm256_add_ps(one, e));
            _mm256_storeu_ps(g.add(i), _mm256_mul_ps(s, _mm256_loadu_ps(u.add(i))));
        }
        i += 8;
    }
    while i < n {
        // SAFETY: i < n.
        unsafe {
            let x = *g.add(i);
            *g.add(i) = x / (1.0 + (-x).exp()) * *u.add(i);
        }
        i += 1;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn softmax(x: *mut f32, n: usize) {
    // SAFETY (all blocks): indices stay below n, the caller's length of `x`.
    let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 8 <= n {
        mv = _mm256_max_ps(mv, unsafe { _mm256_loadu_ps(x.add(i)) });
        i += 8;
    }
    // SAFETY: __m256 and [f32; 8] have the same size and any bits are valid.
    let lanes: [f32; 8] = unsafe { std::mem::transmute(mv) };
    let mut max = lanes.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
    for j in i..n {
        max = max.max(unsafe { *x.add(j) });
    }
    let (maxv, mut sumv) = (_mm256_set1_ps(max), _mm256_setzero_ps());
    let mut i = 0;
    while i + 8 <= n {
        unsafe {
            let e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x.add(i)), maxv));
            _mm256_storeu_ps(x.add(i), e);
            sumv = _mm256_add_ps(sumv, e);
        }
        i += 8;
    }
    let mut sum = hsum(sumv);
    for j in i..n {
        unsafe {
            let e = (*x.add(j) - max).exp();
            *x.add(j) = e;
            sum += e;
        }
    }
    let inv = _mm256_set1_ps(1.0 / sum);
    let mut i = 0;
    while i + 8 <= n {
        unsafe { _mm256_storeu_ps(x.add(i), _mm256_mul_ps(_mm256_loadu_ps(x.add(i)), inv)) };
        i += 8;
    }
    for j in i..n {
        unsafe { *x.add(j) *= 1.0 / sum };
    }
}
