//! The 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) against Q8 activation
//! blocks: kinds as const parameters (one per format: its block layout and code
//! extraction), the single-token kernel ([`gemv8`]) and the register-tiled batch kernel
//! ([`tile`]) with its interleaved activations. The float steps are in the module docs
//! of `super`.

use std::arch::x86_64::*;

use super::{Avx2, Avx512, Q32, RowBlocks, f16x1, sum8_i32, transpose4x8};
use crate::api::Matrix;
use crate::cpu::pool::ThreadPool;
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
/// [`crate::api::Layout::Rows8`] group, read in its stored order.
const UNPACK_ROWS: usize = 8;

/// Kinds of quantized weights, as const parameters of the kernels.
/// Q4_1: unsigned codes 0..15 (`value = q·d + m`), i16 block sums.
pub(super) const U4: u8 = 0;

/// Q4_0: signed codes -8..7 through the sign trick, i16 block sums.
pub(super) const S4: u8 = 1;

/// Q8_0: signed codes through the sign trick; |pair| can reach 32512, so i32 block sums.
pub(super) const S8: u8 = 2;
/// Q5_1: unsigned codes 0..31 (`value = q·d + m`); |pair| ≤ 2·31·127 = 7874, so i32 sums.
pub(super) const U5: u8 = 3;
/// Q5_0: signed codes -16..15 through the sign trick; |pair| ≤ 2·16·127 = 4064, so eight
/// of them (32512) still fit the i16 block sums.
pub(super) const S5: u8 = 4;

/// Whether kind `k` has unsigned codes and an offset term `m · s` (else signed codes).
pub(super) const fn unsigned(k: u8) -> bool {
    k == U4 || k == U5
}

/// Whether kind `k`'s block sums need i32 (else eight `maddubs` pairs fit in i16).
const fn wide(k: u8) -> bool {
    k == S8 || k == U5
}

pub(super) fn kind(ty: GgmlType) -> u8 {
    match ty {
        GgmlType::Q4_1 => U4,
        GgmlType::Q4_0 => S4,
        GgmlType::Q8_0 => S8,
        GgmlType::Q5_1 => U5,
        GgmlType::Q5_0 => S5,
        _ => unreachable!("float type in a quantized kernel"),
    }
}

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
    /// Each token's block code sum `Σq` (lane layout of `d`), for the AVX-512 tile's
    /// unsigned-code products.
    qsum: Vec<i32>,
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
        let mut qsum = vec![0i32; groups * nb * 8];
        let per = (nb * 8).max(1);
        let parts: Vec<_> = q
            .chunks_mut(per)
            .zip(d.chunks_mut(per))
            .zip(s.chunks_mut(per))
            .zip(qsum.chunks_mut(per))
            .collect();
        pool.for_each(parts, |g, (((q, d), s), qsum)| {
            let mut row = vec![BlockQ8::default(); nb];
            for l in 0..8.min(n_tok - 8 * g) {
                let t = 8 * g + l;
                simd.quantize_act_row(&x[t * nb * QK..(t + 1) * nb * QK], &mut row);
                interleave_row(&row, l, q, d, s);
                for (b, blk) in row.iter().enumerate() {
                    qsum[b * 8 + l] = blk.qs.iter().map(|v| *v as i32).sum();
                }
            }
        });
        Self {
            nb,
            groups,
            n_tok,
            q,
            d,
            s,
            qsum,
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

/// Per-thread buffers of the batch kernel: the tile's weight rows, unpacked.
#[derive(Debug, Default)]
pub(crate) struct TileScratch {
    /// Unsigned codes (Q4_1) or absolute values of the signed codes.
    wa: Vec<Q32>,
    /// Signed codes (Q4_0, Q8_0).
    ws: Vec<Q32>,
    /// Unsigned codes for the AVX-512 tile (Q4_0 / Q5_0 as stored, Q8_0 + 128).
    wu: Vec<Q32>,
    d: Vec<f32>,
    m: Vec<f32>,
}

impl Avx2 {
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
        wide: Option<Avx512>,
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
                let (st, ap) = (rows.stride, a.as_ptr());
                macro_rules! go {
                    ($k:ident) => {
                        match wide {
                            Some(x) => x.gemv8::<$k>(ptrs, st, ap, nb),
                            None => gemv8::<$k>(ptrs, st, ap, nb),
                        }
                    };
                }
                let r = unsafe {
                    match kind(w.ty) {
                        U4 => go!(U4),
                        S4 => go!(S4),
                        U5 => go!(U5),
                        S5 => go!(S5),
                        _ => go!(S8),
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
        wide: Option<Avx512>,
    ) {
        const R4: usize = TILE_4BIT.0;
        const G4: usize = TILE_4BIT.1;
        const R8: usize = TILE_8BIT.0;
        const G8: usize = TILE_8BIT.1;
        match kind(w.ty) {
            U4 => self.gemm_rows_kind::<U4, R4, G4>(w, r0, il, sc, out, wide),
            S4 => self.gemm_rows_kind::<S4, R4, G4>(w, r0, il, sc, out, wide),
            S5 => self.gemm_rows_kind::<S5, R4, G4>(w, r0, il, sc, out, wide),
            U5 => self.gemm_rows_kind::<U5, R8, G8>(w, r0, il, sc, out, wide),
            _ => self.gemm_rows_kind::<S8, R8, G8>(w, r0, il, sc, out, wide),
        }
    }

    /// [`Self::gemm_rows`] with tiles of R rows × G groups of 8 tokens.
    #[allow(clippy::too_many_arguments)]
    fn gemm_rows_kind<const K: u8, const R: usize, const G: usize>(
        self,
        w: &Matrix<'_>,
        r0: usize,
        il: &Interleaved,
        sc: &mut TileScratch,
        out: &mut [&mut [f32]],
        wide: Option<Avx512>,
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
        if sc.wu.len() < UNPACK_ROWS * nb {
            sc.wu.resize(UNPACK_ROWS * nb, Q32::default());
        }
        let u = Unpacked {
            wa: sc.wa.as_mut_ptr(),
            ws: sc.ws.as_mut_ptr(),
            wu: sc.wu.as_mut_ptr(),
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
                // With AVX-512 its own unpack (the AVX2 tile's absolute codes only where an
                // odd last group of tokens runs it).
                let wide_unpack = wide.map(|x| (x, !il.groups.is_multiple_of(2)));
                unsafe { unpack_rows::<K>(starts, rows.stride, group, &u, wide_unpack) };
                if first + 16 <= r0 + nr {
                    rows.prefetch_group(w.data, first + 8);
                }
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
                    wu: unsafe { u.wu.add(first_row) },
                    dw: unsafe { u.d.add(first_row) },
                    m: unsafe { u.m.add(first_row) },
                    q: il.q[at..].as_ptr(),
                    d: il.d[at..].as_ptr(),
                    s: il.s[at..].as_ptr(),
                    qsum: il.qsum[at..].as_ptr(),
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
                if let Some(x) = wide
                    && g + 2 <= il.groups
                {
                    // SAFETY: as below, for groups g and g + 1.
                    let res = unsafe { x.tile32::<K>(&p) };
                    for (gg, half) in x.halves(&res).iter().enumerate() {
                        store(gg, half);
                    }
                    g += 2;
                } else if full {
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
}

/// The 32 nibbles of a Q4 block in element order (low nibbles first), as bytes 0..15.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller passes a pointer to 16 readable bytes.
    let raw = unsafe { _mm_loadu_si128(p.cast()) };
    let mask = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(raw, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), mask);
    _mm256_set_m128i(hi, lo)
}

/// Block layout of each kind: bytes per block, offset of the codes.
pub(super) const fn layout(k: u8) -> (usize, usize) {
    match k {
        U4 => (20, 4),
        S4 => (18, 2),
        U5 => (24, 8),
        S5 => (22, 6),
        _ => (34, 2),
    }
}

/// Bit 4 of each of the 32 codes of a Q5 block from its `qh` word: byte e is 0x10 where
/// bit e of the little-endian u32 at `p` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn high_bits(p: *const u8) -> __m256i {
    // SAFETY: the caller passes a pointer to 4 readable bytes.
    let bits = unsafe { p.cast::<u32>().read_unaligned() };
    // Byte e takes byte e / 8 of the word, then tests its bit e % 8.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// What the codes of a signed 4- or 5-bit kind are offset by (value = (q − o)·d): the
/// single-token kernels multiply the stored unsigned `q` ([`ucodes`]) and take `o · Σa`
/// off each block sum, the activations' code sum being one per block for all 8 rows,
/// which spares the sign trick per row: Σ (q − o)·a = Σ q·a − o·Σa, exactly.
pub(super) const fn offset(k: u8) -> i32 {
    match k {
        S4 => 8,
        S5 => 16,
        _ => 0,
    }
}

/// The stored unsigned codes of a block of kind S4 or S5 (0..15, 0..31); the other kinds'
/// [`codes`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn ucodes<const K: u8>(blk: *const u8) -> __m256i {
    let off = layout(K).1;
    // SAFETY: the caller passes a whole block of kind K.
    unsafe {
        match K {
            S4 => nibbles(blk.add(off)),
            S5 => _mm256_or_si256(nibbles(blk.add(off)), high_bits(blk.add(off - 4))),
            _ => codes::<K>(blk),
        }
    }
}

/// The sum of the 32 signed bytes of `v`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn sum_i8(v: __m256i) -> i32 {
    // Σ (a + 128) over each 8 bytes as u64 lanes, then 32 · 128 taken off.
    let s = _mm256_sad_epu8(
        _mm256_xor_si256(v, _mm256_set1_epi8(-128)),
        _mm256_setzero_si256(),
    );
    let s = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    let s = _mm_add_epi64(s, _mm_unpackhi_epi64(s, s));
    _mm_cvtsi128_si32(s) - 32 * 128
}

/// Signed codes of block `blk` (S4, S5, S8) or unsigned codes (U4, U5).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn codes<const K: u8>(blk: *const u8) -> __m256i {
    let off = layout(K).1;
    // SAFETY: the caller passes a whole block of kind K; the Q5 kinds' `qh` word lies
    // right before their nibbles.
    unsafe {
        match K {
            U4 => nibbles(blk.add(off)),
            S4 => _mm256_sub_epi8(nibbles(blk.add(off)), _mm256_set1_epi8(8)),
            U5 => _mm256_or_si256(nibbles(blk.add(off)), high_bits(blk.add(off - 4))),
            S5 => _mm256_sub_epi8(
                _mm256_or_si256(nibbles(blk.add(off)), high_bits(blk.add(off - 4))),
                _mm256_set1_epi8(16),
            ),
            _ => _mm256_loadu_si256(blk.add(off).cast()),
        }
    }
}

/// Where the batch kernel unpacks weight rows: codes (`wa` unsigned or absolute, `ws`
/// signed), block scales `d` and offsets `m` (0 unless Q4_1); row i's block b at
/// `i · nb + b`.
pub(super) struct Unpacked {
    pub(super) wa: *mut Q32,
    pub(super) ws: *mut Q32,
    pub(super) wu: *mut Q32,
    pub(super) d: *mut f32,
    pub(super) m: *mut f32,
    pub(super) nb: usize,
}

/// Expand block `b` of scratch row `i` from the block at `blk`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_block<const K: u8>(blk: *const u8, u: &Unpacked, i: usize, b: usize) {
    let at = i * u.nb + b;
    // SAFETY: the caller passes a whole block of kind K and an entry inside the scratch.
    unsafe {
        let c = codes::<K>(blk);
        if unsigned(K) {
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
/// order across the rows when `interleaved` (a [`crate::api::Layout::Rows8`] group: one sequential
/// read), else row by row (GGUF rows: one sequential read each).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_rows<const K: u8>(
    starts: [*const u8; 8],
    stride: usize,
    interleaved: bool,
    u: &Unpacked,
    wide: Option<(Avx512, bool)>,
) {
    // SAFETY (all calls): the caller guarantees `u.nb` blocks of kind K `stride` apart
    // behind every start and 8 rows of `u.nb` entries in the scratch.
    let one = |s: *const u8, i: usize, b: usize| unsafe {
        match wide {
            Some((x, abs_too)) => x.unpack_block::<K>(s.add(b * stride), u, i, b, abs_too),
            None => unpack_block::<K>(s.add(b * stride), u, i, b),
        }
    };
    if interleaved {
        for b in 0..u.nb {
            for (i, s) in starts.iter().enumerate() {
                one(*s, i, b);
            }
        }
    } else {
        for (i, s) in starts.iter().enumerate() {
            for b in 0..u.nb {
                one(*s, i, b);
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

/// The scales `d` (and offsets `m`, else 0) of block `at` bytes into each of 8 rows, as
/// 8 f32 lanes each.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn block_scales<const K: u8>(
    rows: [*const u8; 8],
    at: usize,
) -> (__m256, __m256) {
    // SAFETY: the caller passes 8 rows with a whole block of kind K at `at`.
    unsafe {
        let r = |k: usize| rows[k].add(at);
        if unsigned(K) {
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
                0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2,
                3, 6, 7, 10, 11, 14, 15,
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
        }
    }
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
            // Q4_0 / Q5_0: their codes without the offset (see `offset`), so i32 sums
            // for Q5_0 (pairs up to 2·31·127).
            let wide_here = wide(K) || K == S5;
            for (r, pr) in p.iter_mut().enumerate() {
                let blk = rows[r].add(b * stride);
                let pairs = if offset(K) != 0 {
                    _mm256_maddubs_epi16(ucodes::<K>(blk), av)
                } else {
                    let c = codes::<K>(blk);
                    if unsigned(K) {
                        _mm256_maddubs_epi16(c, av)
                    } else {
                        _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(av, c))
                    }
                };
                *pr = if wide_here {
                    _mm256_madd_epi16(pairs, ones)
                } else {
                    pairs
                };
            }
            let mut isum = if wide_here { sum8_i32(p) } else { sum8_i16(p) };
            if offset(K) != 0 {
                isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(offset(K) * sum_i8(av)));
            }
            let (dw, mw) = block_scales::<K>(rows, b * stride);
            let scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.d));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc);
            if unsigned(K) {
                accm = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s), accm);
            }
        }
    }
    if unsigned(K) {
        _mm256_add_ps(acc, accm)
    } else {
        acc
    }
}

/// Pointers into a tile's unpacked weights (see [`unpack_row`], rows `nb` apart) and a
/// token group's interleaved activations (see [`Interleaved`], groups `8·nb` apart).
pub(super) struct TilePtrs {
    pub(super) wa: *const Q32,
    pub(super) ws: *const Q32,
    pub(super) wu: *const Q32,
    pub(super) dw: *const f32,
    pub(super) m: *const f32,
    pub(super) q: *const Q32,
    pub(super) d: *const f32,
    pub(super) s: *const f32,
    pub(super) qsum: *const i32,
    pub(super) nb: usize,
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
                    let ws = if unsigned(K) {
                        wa
                    } else {
                        _mm256_set1_epi32(quad(p.ws))
                    };
                    for (s, ag) in sr.iter_mut().zip(a) {
                        let av = if unsigned(K) {
                            ag
                        } else {
                            _mm256_sign_epi8(ag, ws)
                        };
                        let pr = _mm256_maddubs_epi16(wa, av);
                        *s = if wide(K) {
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
                    let isum = if wide(K) {
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
    if unsigned(K) {
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
