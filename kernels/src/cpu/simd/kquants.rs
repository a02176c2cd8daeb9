//! The K-quants (Q4_K, Q5_K, Q6_K) against [`BlockQ8K`] activations: one [`KFormat`]
//! per type (where its codes and scales lie), one single-token kernel ([`gemv8`]) and one
//! batch kernel ([`tile`]) generic over it.
//!
//! Per super-block b and (row, token), the integer part is exact (bounds in
//! `crate::quant::kquants`): `maddubs` of the unsigned codes (≤ 63) with the i8
//! activations gives i16 pairs ≤ 2·63·127 = 16002, and a sub-block scale multiplies them
//! in `madd` into i32. The float steps, in block order, are those of the scalar reference:
//!
//! ```text
//! Q4_K, Q5_K: acc  = fma(float(isum_b), d_w[b] · d_a[b], acc)
//!             accm = fma(float(msum_b), dmin_w[b] · d_a[b], accm)     out = acc − accm
//! Q6_K:       acc  = fma(float(isum_b − 32 · osum_b), d_w[b] · d_a[b], acc)   out = acc
//! ```
//!
//! with `msum = Σ_j m_j · (sum of sub-block j's codes)` and `osum = Σ_s sc_s · bsum_s`
//! from the activations' 16-code sums. [`gemv8`] runs them with one lane per weight row,
//! [`tile`] with one lane per token: the same operations on the same values, so a token's
//! result is the same alone or in a batch.

use std::arch::x86_64::*;

pub(super) use super::kformats::KFormat;
use super::kformats::{Q4K, Q5K, Q6K};
use super::{Avx2, Avx512, Q32, RowBlocks, f16x1, sum8_i32, transpose4x8};
use crate::api::Matrix;
use crate::cpu::pool::ThreadPool;
use crate::quant::{BlockQ8K, q8k_scale};
use crate::types::{GgmlType, QK_K};

/// Rows of the batch kernel's register tile (one group of 8 tokens per tile).
pub(super) const TILE_ROWS: usize = 4;
/// Weight rows unpacked at a time: one [`crate::api::Layout::Rows8`] group.
const UNPACK_ROWS: usize = 8;
/// Scale words per unpacked super-block: one per step of [`KFormat::STEP`] quads (at most
/// 64 / 2).
pub(super) const STEPS_MAX: usize = 32;

/// One row's super-block against one token's activation block: the exact integer sums,
/// not yet reduced over their 8 lanes: `(isum, msum)` (Q6_K: `isum − 32·osum`, msum 0).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_sums<F: KFormat>(blk: *const u8, a: &BlockQ8K, b32: __m256i) -> (__m256i, __m256i) {
    // SAFETY: the caller passes a whole super-block of F.
    let (codes, scales, offs) = unsafe { (F::codes(blk), F::scales(blk), F::offsets(blk)) };
    let mut acc = _mm256_setzero_si256();
    for (j, (c, s)) in codes.iter().zip(scales).enumerate() {
        // SAFETY: `qs` holds 256 codes, vector j is codes 32j..32j+32.
        let av = unsafe { _mm256_loadu_si256(a.qs.as_ptr().add(32 * j).cast()) };
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(*c, av), s));
    }
    // SAFETY: [i32; 8] and __m256i have the same size.
    let offs: __m256i = unsafe { std::mem::transmute(offs) };
    if F::DMIN.is_some() {
        // Mins against the 32-code sums (lanes 0..4 of `b32` pairs, the rest 0).
        (acc, _mm256_madd_epi16(offs, b32))
    } else {
        // SAFETY: `bsums` holds 16 i16.
        let bs = unsafe { _mm256_loadu_si256(a.bsums.as_ptr().cast()) };
        let osum = _mm256_madd_epi16(offs, bs);
        (
            _mm256_sub_epi32(acc, _mm256_slli_epi32::<5>(osum)),
            _mm256_setzero_si256(),
        )
    }
}

/// The sums of each 32 codes of `a` as i16 pairs in lanes 0..8 (lanes 8..16 zero).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sums32(a: &BlockQ8K) -> __m256i {
    // SAFETY: `bsums` holds 16 i16.
    let (lo, hi) = unsafe {
        (
            _mm_loadu_si128(a.bsums.as_ptr().cast()),
            _mm_loadu_si128(a.bsums.as_ptr().add(8).cast()),
        )
    };
    _mm256_zextsi128_si256(_mm_hadd_epi16(lo, hi))
}

/// The f16 at byte `off` of each of 8 super-blocks, as 8 f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gather_f16(blks: [*const u8; 8], off: usize) -> __m256 {
    // SAFETY: the caller passes 8 whole super-blocks, `off` inside each.
    let h = |k: usize| unsafe { blks[k].add(off).cast::<i16>().read_unaligned() };
    _mm256_cvtph_ps(_mm_setr_epi16(
        h(0),
        h(1),
        h(2),
        h(3),
        h(4),
        h(5),
        h(6),
        h(7),
    ))
}

/// 8 rows (lanes, super-blocks `stride` bytes apart) times one token: see the module docs.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv8<F: KFormat>(
    rows: [*const u8; 8],
    stride: usize,
    act: *const BlockQ8K,
    nb: usize,
) -> __m256 {
    let mut acc = _mm256_setzero_ps();
    let mut accm = _mm256_setzero_ps();
    for b in 0..nb {
        // SAFETY: b < nb; the caller guarantees nb super-blocks behind every row pointer
        // and behind `act`.
        unsafe {
            let a = &*act.add(b);
            let blks: [*const u8; 8] = std::array::from_fn(|r| rows[r].add(b * stride));
            let b32 = sums32(a);
            let mut iv = [_mm256_setzero_si256(); 8];
            let mut mv = [_mm256_setzero_si256(); 8];
            for r in 0..8 {
                (iv[r], mv[r]) = row_sums::<F>(blks[r], a, b32);
            }
            let da = _mm256_set1_ps(a.d);
            let scale = _mm256_mul_ps(gather_f16(blks, F::D), da);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8_i32(iv)), scale, acc);
            if let Some(dm) = F::DMIN {
                let mscale = _mm256_mul_ps(gather_f16(blks, dm), da);
                accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8_i32(mv)), mscale, accm);
            }
        }
    }
    if F::DMIN.is_some() {
        _mm256_sub_ps(acc, accm)
    } else {
        acc
    }
}

/// A batch's Q8K activations in the batch kernel's layout: tokens in groups of 8 lanes,
/// padded with zero tokens. For group `g` and super-block `b` (`at = g·nb + b`):
/// `q[at·64 + j]` holds codes `4j..4j+4` of each of the 8 tokens (token `l` in bytes
/// `4l..4l+4`); `d[at·8 + l]` token l's scale; `b16[at·8 + p]` each token's 16-code sums
/// `2p, 2p+1` as an i16 pair (token l in lanes 2l, 2l+1); `b32[at·4 + p]` likewise its
/// 32-code sums `2p, 2p+1`.
#[derive(Debug, Default)]
pub(crate) struct InterleavedK {
    pub(super) nb: usize,
    pub(super) groups: usize,
    n_tok: usize,
    pub(super) q: Vec<Q32>,
    pub(super) d: Vec<f32>,
    pub(super) b16: Vec<Q32>,
    pub(super) b32: Vec<Q32>,
}

impl InterleavedK {
    /// Quantize `n_tok` rows of `x` (`nb` super-blocks each) with
    /// [`Avx2::quantize_act_row_k`] and interleave them, a group of 8 tokens per task.
    pub(crate) fn from_f32(
        simd: Avx2,
        x: &[f32],
        n_tok: usize,
        nb: usize,
        pool: &ThreadPool,
    ) -> Self {
        assert_eq!(x.len(), n_tok * nb * QK_K);
        let groups = n_tok.div_ceil(8);
        let per = nb.max(1);
        let mut q = vec![Q32::default(); groups * per * 64];
        let mut d = vec![0f32; groups * per * 8];
        let mut b16 = vec![Q32::default(); groups * per * 8];
        let mut b32 = vec![Q32::default(); groups * per * 4];
        let parts: Vec<_> = q
            .chunks_mut(per * 64)
            .zip(d.chunks_mut(per * 8))
            .zip(b16.chunks_mut(per * 8))
            .zip(b32.chunks_mut(per * 4))
            .collect();
        pool.for_each(parts, |g, (((q, d), b16), b32)| {
            let mut row = vec![BlockQ8K::default(); nb];
            for l in 0..8.min(n_tok - 8 * g) {
                let t = 8 * g + l;
                simd.quantize_act_row_k(&x[t * nb * QK_K..(t + 1) * nb * QK_K], &mut row);
                for (b, blk) in row.iter().enumerate() {
                    for (j, quad) in blk.qs.chunks_exact(4).enumerate() {
                        for (o, v) in q[b * 64 + j].0[4 * l..4 * l + 4].iter_mut().zip(quad) {
                            *o = *v as u8;
                        }
                    }
                    d[b * 8 + l] = blk.d;
                    let s32: [i16; 8] =
                        std::array::from_fn(|j| blk.bsums[2 * j] + blk.bsums[2 * j + 1]);
                    for p in 0..8 {
                        let pair = [blk.bsums[2 * p], blk.bsums[2 * p + 1]];
                        put_pair(&mut b16[b * 8 + p], l, pair);
                        if p < 4 {
                            put_pair(&mut b32[b * 4 + p], l, [s32[2 * p], s32[2 * p + 1]]);
                        }
                    }
                }
            }
        });
        Self {
            nb,
            groups,
            n_tok,
            q,
            d,
            b16,
            b32,
        }
    }
}

/// Token `l`'s i16 pair into lanes 2l, 2l+1 of `v`.
fn put_pair(v: &mut Q32, l: usize, pair: [i16; 2]) {
    v.0[4 * l..4 * l + 2].copy_from_slice(&pair[0].to_le_bytes());
    v.0[4 * l + 2..4 * l + 4].copy_from_slice(&pair[1].to_le_bytes());
}

/// Per-thread buffers of the K-quant batch kernel: [`UNPACK_ROWS`] weight rows, unpacked
/// (row i's super-block b at entry `i·nb + b`).
#[derive(Debug, Default)]
pub(crate) struct TileScratchK {
    /// 8 vectors of codes per entry.
    pub(super) codes: Vec<Q32>,
    /// [`STEPS_MAX`] scale words (`sc | sc << 16`) per entry, one per step of STEP quads.
    pub(super) steps: Vec<i32>,
    /// The 8 offset words of [`KFormat::offsets`] per entry.
    pub(super) offs: Vec<i32>,
    pub(super) d: Vec<f32>,
    pub(super) dmin: Vec<f32>,
}

impl TileScratchK {
    fn reserve(&mut self, entries: usize) {
        fn grow<T: Default + Clone>(v: &mut Vec<T>, n: usize) {
            if v.len() < n {
                v.resize(n, T::default());
            }
        }
        grow(&mut self.codes, entries * 8);
        grow(&mut self.steps, entries * STEPS_MAX);
        grow(&mut self.offs, entries * 8);
        grow(&mut self.d, entries);
        grow(&mut self.dmin, entries);
    }
}

/// Expand super-block `blk` into scratch entry `at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack<F: KFormat>(blk: *const u8, sc: &mut TileScratchK, at: usize) {
    // SAFETY: the caller passes a whole super-block of F and an entry the scratch holds.
    unsafe {
        let codes = F::codes(blk);
        for (j, c) in codes.iter().enumerate() {
            _mm256_store_si256(sc.codes.as_mut_ptr().add(at * 8 + j).cast(), *c);
        }
        // Step t covers quads STEP·t.., inside the 16 codes of quad / 4.
        let s16 = F::scales16(blk);
        for t in 0..64 / F::STEP {
            let s = s16[t * F::STEP / 4] as u16 as i32;
            sc.steps[at * STEPS_MAX + t] = s | (s << 16);
        }
        sc.offs[at * 8..at * 8 + 8].copy_from_slice(&F::offsets(blk));
        sc.d[at] = f16x1(blk.add(F::D));
        sc.dmin[at] = F::DMIN.map_or(0.0, |o| f16x1(blk.add(o)));
    }
}

/// R unpacked rows (scratch entries `first + r·nb + b`) × the 8 tokens of group `g`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<F: KFormat, const R: usize>(
    sc: &TileScratchK,
    first: usize,
    il: &InterleavedK,
    g: usize,
) -> [__m256; R] {
    let nb = il.nb;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut accm = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let at = g * nb + b;
        // SAFETY: b < nb; the scratch holds R rows of nb entries from `first`, `il` nb
        // super-blocks of group g.
        unsafe {
            let q = il.q.as_ptr().add(at * 64);
            let mut isum = [_mm256_setzero_si256(); R];
            for t in 0..64 / F::STEP {
                let mut s16 = [_mm256_setzero_si256(); R];
                for j in t * F::STEP..(t + 1) * F::STEP {
                    let av = _mm256_load_si256(q.add(j).cast());
                    for (r, s) in s16.iter_mut().enumerate() {
                        let e = first + r * nb + b;
                        let quad = sc.codes.as_ptr().add(e * 8).cast::<i32>().add(j).read();
                        let w = _mm256_set1_epi32(quad);
                        *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(w, av));
                    }
                }
                for (r, (is, s)) in isum.iter_mut().zip(s16).enumerate() {
                    let e = first + r * nb + b;
                    let step = _mm256_set1_epi32(*sc.steps.get_unchecked(e * STEPS_MAX + t));
                    *is = _mm256_add_epi32(*is, _mm256_madd_epi16(s, step));
                }
            }
            let da = _mm256_loadu_ps(il.d.as_ptr().add(at * 8));
            for r in 0..R {
                let e = first + r * nb + b;
                let offs = sc.offs.as_ptr().add(e * 8);
                let dw = _mm256_set1_ps(*sc.d.get_unchecked(e));
                let mut osum = _mm256_setzero_si256();
                if F::DMIN.is_some() {
                    for p in 0..4 {
                        let bp = _mm256_load_si256(il.b32.as_ptr().add(at * 4 + p).cast());
                        let m = _mm256_set1_epi32(*offs.add(p));
                        osum = _mm256_add_epi32(osum, _mm256_madd_epi16(bp, m));
                    }
                    let isf = _mm256_cvtepi32_ps(isum[r]);
                    acc[r] = _mm256_fmadd_ps(isf, _mm256_mul_ps(dw, da), acc[r]);
                    let dm = _mm256_set1_ps(*sc.dmin.get_unchecked(e));
                    let msf = _mm256_cvtepi32_ps(osum);
                    accm[r] = _mm256_fmadd_ps(msf, _mm256_mul_ps(dm, da), accm[r]);
                } else {
                    for p in 0..8 {
                        let bp = _mm256_load_si256(il.b16.as_ptr().add(at * 8 + p).cast());
                        let s = _mm256_set1_epi32(*offs.add(p));
                        osum = _mm256_add_epi32(osum, _mm256_madd_epi16(bp, s));
                    }
                    let v = _mm256_sub_epi32(isum[r], _mm256_slli_epi32::<5>(osum));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(dw, da), acc[r]);
                }
            }
        }
    }
    if F::DMIN.is_some() {
        for (a, m) in acc.iter_mut().zip(accm) {
            *a = _mm256_sub_ps(*a, m);
        }
    }
    acc
}

/// The K-quant formats' kernels behind one runtime type switch.
macro_rules! with_kformat {
    ($ty:expr, $F:ident => $body:expr) => {
        match $ty {
            GgmlType::Q4_K => {
                type $F = Q4K;
                $body
            }
            GgmlType::Q5_K => {
                type $F = Q5K;
                $body
            }
            GgmlType::Q6_K => {
                type $F = Q6K;
                $body
            }
            other => unreachable!("{other} is not a K-quant"),
        }
    };
}

impl Avx2 {
    /// Rows `r0..r0+nr` of the K-quant matrix `w` (either layout) times each of
    /// `out.len()` tokens (`act`: their Q8K blocks one token after another) into
    /// `out[t][i]`, 8 rows at a time and [`gemv8`] once per token on them.
    pub(crate) fn gemv_tokens_kquant(
        self,
        w: &Matrix<'_>,
        r0: usize,
        act: &[BlockQ8K],
        out: &mut [&mut [f32]],
    ) {
        with_kformat!(w.ty, F => self.gemv_tokens_f::<F>(w, r0, act, out))
    }

    fn gemv_tokens_f<F: KFormat>(
        self,
        w: &Matrix<'_>,
        r0: usize,
        act: &[BlockQ8K],
        out: &mut [&mut [f32]],
    ) {
        debug_assert_eq!((w.ty, w.ty.block_bytes()), (F::TY, F::BYTES));
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
                // r < w.rows, whose `nb` super-blocks of F lie `stride` apart inside
                // `w.data` (`RowBlocks::new` checked the size), and `a` holds `nb` blocks.
                let r = unsafe { gemv8::<F>(ptrs, rows.stride, a.as_ptr(), nb) };
                // SAFETY: __m256 and [f32; 8] have the same size and any bits are valid.
                let v: [f32; 8] = unsafe { std::mem::transmute(r) };
                o[i..i + here].copy_from_slice(&v[..here]);
            }
        }
    }

    /// Rows `r0..r0+nr` of the K-quant matrix `w` (either layout) against all tokens of
    /// `il`, into `out[t][i]` (one slice of `nr` per token).
    pub(crate) fn gemm_rows_kquant(
        self,
        w: &Matrix<'_>,
        r0: usize,
        il: &InterleavedK,
        sc: &mut TileScratchK,
        out: &mut [&mut [f32]],
        wide: Option<Avx512>,
    ) {
        with_kformat!(w.ty, F => self.gemm_rows_f::<F>(w, r0, il, sc, out, wide))
    }

    fn gemm_rows_f<F: KFormat>(
        self,
        w: &Matrix<'_>,
        r0: usize,
        il: &InterleavedK,
        sc: &mut TileScratchK,
        out: &mut [&mut [f32]],
        wide: Option<Avx512>,
    ) {
        const R: usize = TILE_ROWS;
        const { assert!(UNPACK_ROWS.is_multiple_of(R)) };
        let nb = il.nb;
        let nr = out.first().map_or(0, |o| o.len());
        let rows = RowBlocks::new(w, nb);
        assert!(out.len() == il.n_tok && out.iter().all(|o| o.len() == nr));
        assert!(nr > 0 && r0 + nr <= w.rows);
        sc.reserve(UNPACK_ROWS * nb);
        let mut rt = 0;
        while rt < nr {
            if rt.is_multiple_of(UNPACK_ROWS) {
                // Rows past the end repeat the last row; their results are dropped.
                let (first, last) = (r0 + rt, r0 + nr - 1);
                let starts: [*const u8; 8] =
                    std::array::from_fn(|i| rows.start(w.data, (first + i).min(last)));
                for b in 0..nb {
                    for (i, s) in starts.iter().enumerate() {
                        // SAFETY: features proven by the token; every row r <= last <
                        // w.rows has `nb` super-blocks `stride` apart in `w.data`
                        // (`RowBlocks::new` checked the size); the scratch holds
                        // UNPACK_ROWS · nb entries. In block order across the rows: one
                        // sequential read of a Rows8 group.
                        unsafe { unpack::<F>(s.add(b * rows.stride), sc, i * nb + b) };
                    }
                }
                if first + 16 <= r0 + nr {
                    rows.prefetch_group(w.data, first + 8);
                }
            }
            let first = rt % UNPACK_ROWS * nb;
            let rows_here = R.min(nr - rt);
            let mut g = 0;
            while g < il.groups {
                // SAFETY: features proven by the token; entries first..first + R·nb lie
                // inside the UNPACK_ROWS·nb unpacked (R divides UNPACK_ROWS), and `il`
                // holds group g (and g + 1 for the AVX-512 tile).
                let (res, n_groups) = match wide {
                    Some(x) if g + 2 <= il.groups => {
                        let r = unsafe { x.tile_k::<F, R>(sc, first, il, g) };
                        (x.halves(&r).to_vec(), 2)
                    }
                    _ => (vec![unsafe { tile::<F, R>(sc, first, il, g) }], 1),
                };
                for (gg, res) in res.iter().enumerate() {
                    self.store_tile(res, g + gg, il.n_tok, rows_here, rt, out);
                }
                g += n_groups;
            }
            rt += R;
        }
    }

    /// One tile's results (lane l of row i: token 8·g + l) into `out[t][rt + i]`.
    fn store_tile(
        self,
        res: &[__m256; TILE_ROWS],
        g: usize,
        n_tok: usize,
        rows_here: usize,
        rt: usize,
        out: &mut [&mut [f32]],
    ) {
        {
            {
                let t0 = g * 8;
                let n_here = (n_tok - t0).min(8);
                if rows_here == 4 {
                    // SAFETY: features proven by the token.
                    let tr = unsafe { transpose4x8(res[0], res[1], res[2], res[3]) };
                    for (l, v) in tr.iter().enumerate().take(n_here) {
                        out[t0 + l][rt..rt + 4].copy_from_slice(v);
                    }
                } else {
                    for (i, v) in res.iter().enumerate().take(rows_here) {
                        // SAFETY: __m256 and [f32; 8] have the same size.
                        let lanes: [f32; 8] = unsafe { std::mem::transmute(*v) };
                        for (l, x) in lanes.iter().enumerate().take(n_here) {
                            out[t0 + l][rt + i] = *x;
                        }
                    }
                }
            }
        }
    }

    /// [`crate::quant::quantize_act_row_k`] for rows whose length is a multiple of 256,
    /// with the same bits: the same scale arithmetic, products and half-to-even rounding.
    pub(crate) fn quantize_act_row_k(self, x: &[f32], out: &mut [BlockQ8K]) {
        assert_eq!(x.len(), out.len() * QK_K);
        for (blk, xs) in out.iter_mut().zip(x.chunks_exact(QK_K)) {
            // SAFETY: features proven by the token; `xs` holds 256 floats.
            unsafe { quantize_block_k(xs.as_ptr(), blk) }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_block_k(x: *const f32, blk: &mut BlockQ8K) {
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_setzero_ps();
    for j in 0..32 {
        // SAFETY: the caller passes 256 readable floats.
        let v = unsafe { _mm256_loadu_ps(x.add(8 * j)) };
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
    }
    // SAFETY: __m256 and [f32; 8] have the same size and any bits are valid.
    let lanes: [f32; 8] = unsafe { std::mem::transmute(m) };
    let amax = lanes.iter().fold(0f32, |m, v| m.max(*v));
    let (d, id) = q8k_scale(amax);
    let (idv, lo, hi) = (
        _mm256_set1_ps(id),
        _mm256_set1_ps(-127.0),
        _mm256_set1_ps(127.0),
    );
    for c in 0..8 {
        let q: [__m256i; 4] = std::array::from_fn(|k| {
            // SAFETY: 32c + 8k + 8 <= 256 floats.
            let v = unsafe { _mm256_loadu_ps(x.add(32 * c + 8 * k)) };
            let v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v, idv), lo), hi);
            _mm256_cvtps_epi32(_mm256_round_ps::<
                { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
            >(v))
        });
        // Packing works per 128-bit half; the permute restores element order.
        let p8 = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `qs` holds 256 bytes, 32c + 32 of them.
        unsafe { _mm256_storeu_si256(blk.qs.as_mut_ptr().add(32 * c).cast(), p8) };
        // 16-code sums: i8 codes widened and summed in pairs.
        let w = _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_set1_epi8(1), p8),
            _mm256_set1_epi16(1),
        );
        // SAFETY: __m256i and [i32; 8] have the same size.
        let s: [i32; 8] = unsafe { std::mem::transmute(w) };
        blk.bsums[2 * c] = (s[0] + s[1] + s[2] + s[3]) as i16;
        blk.bsums[2 * c + 1] = (s[4] + s[5] + s[6] + s[7]) as i16;
    }
    blk.d = d;
}
