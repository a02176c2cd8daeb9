//! The AVX-512 tier's batch kernels: the AVX2 tiles' loops on 16 token lanes (two of
//! their 8-token groups at once) with VNNI's `vpdpbusd`, which multiplies four u8 × i8
//! pairs and adds them into an i32 lane in one instruction (AVX2 needs `maddubs`, an
//! i16 add, and a `madd` per block). Reached only through [`Avx512`], which exists only
//! when the CPU has AVX-512 F/BW/VL/VNNI.
//!
//! Same bits as the AVX2 tiles: the integer sums are exact either way (`vpdpbusd`
//! accumulates in i32, so no i16 bound applies), and every lane runs the same float
//! steps on the same values (see `crate::quant::Terms`). `vpdpbusd` wants its first
//! operand unsigned: the weights' codes take that place as stored (Q4_0, Q5_0 without
//! their offset o = 8, 16; Q8_0 plus 128), the activations the signed one, and `o · Σa`
//! per token and block (`Interleaved`'s code sums) is taken off the sum.

use std::arch::x86_64::*;

use super::blocks32::{
    S5, S8, TilePtrs, U5, Unpacked, block_scales, codes, layout, nibbles, offset, sum_i8, ucodes,
    unsigned,
};
use super::f16x1;
use super::kquants::{InterleavedK, KFormat, STEPS_MAX, TILE_ROWS, TileScratchK};
use super::sum8_i32;
use super::{Avx512, Q32};
use crate::quant::BlockQ8;

/// Two 8-lane halves at `lo` and `hi` as one 16-lane vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn load2(lo: *const Q32, hi: *const Q32) -> __m512i {
    // SAFETY: the caller passes two readable, 32-byte aligned vectors.
    unsafe {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_load_si256(lo.cast())),
            _mm256_load_si256(hi.cast()),
        )
    }
}

/// 8 floats at `lo` and 8 at `hi` as one 16-lane vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn load2_ps(lo: *const f32, hi: *const f32) -> __m512 {
    // SAFETY: the caller passes 8 readable floats behind each pointer.
    unsafe {
        let lo = _mm512_castps256_ps512(_mm256_loadu_ps(lo));
        let hi = _mm256_castps_pd(_mm256_loadu_ps(hi));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castps_pd(lo), hi))
    }
}

impl Avx512 {
    /// The AVX2 single-token kernel's 8 rows × one token (`blocks32::gemv8`) with the Q5
    /// high bits from a mask register and `vpdpbusd` for the block sums.
    ///
    /// # Safety
    /// As `blocks32::gemv8`: `nb` blocks of kind K `stride` apart behind every row
    /// pointer, `nb` activation blocks behind `act`.
    pub(super) unsafe fn gemv8<const K: u8>(
        self,
        rows: [*const u8; 8],
        stride: usize,
        act: *const BlockQ8,
        nb: usize,
    ) -> __m256 {
        // SAFETY: the token proves the target features; the rest is the caller's.
        unsafe { gemv8::<K>(rows, stride, act, nb) }
    }

    /// The AVX2 batch kernel's unpack of block `b` of scratch row `i` (`blocks32`), for
    /// the AVX-512 tile: Q5 codes through a mask register, and the absolute values of
    /// signed codes (which only the AVX2 tile reads) only when `abs_too`.
    ///
    /// # Safety
    /// `blk` is a whole block of kind K; entry `i · nb + b` lies inside the scratch.
    pub(super) unsafe fn unpack_block<const K: u8>(
        self,
        blk: *const u8,
        u: &Unpacked,
        i: usize,
        b: usize,
        abs_too: bool,
    ) {
        // SAFETY: the token proves the target features; the rest is the caller's.
        unsafe { unpack_block::<K>(blk, u, i, b, abs_too) }
    }

    /// Each 16-lane result as its two 8-lane halves (tokens of the first group, then of
    /// the second), the shape the AVX2 tiles' stores take.
    pub(super) fn halves<const R: usize>(self, res: &[__m512; R]) -> [[__m256; R]; 2] {
        // SAFETY: the token proves the target features.
        unsafe { halves(res) }
    }

    /// The AVX2 32-element tile ([`super::blocks32`]) for kind K over R unpacked rows and
    /// the token groups `g` (at `p`) and `g + 1` (`8 · nb` entries further).
    ///
    /// # Safety
    /// `p` as the AVX2 tile takes it, with a second group of `nb` blocks behind the first.
    pub(super) unsafe fn tile32<const K: u8>(self, p: &TilePtrs) -> [__m512; 4] {
        // SAFETY: the token proves the target features; the rest is the caller's.
        unsafe { tile32::<K>(p) }
    }

    /// The AVX2 K-quant tile ([`super::kquants`]) over R unpacked rows (scratch entries
    /// `first + r·nb + b`) and token groups `g`, `g + 1` of `il`.
    ///
    /// # Safety
    /// The scratch holds R rows of `il.nb` entries from `first`; `il` has group g + 1.
    pub(super) unsafe fn tile_k<F: KFormat, const R: usize>(
        self,
        sc: &TileScratchK,
        first: usize,
        il: &InterleavedK,
        g: usize,
    ) -> [__m512; R] {
        // SAFETY: the token proves the target features; the rest is the caller's.
        unsafe { tile_k::<F, R>(sc, first, il, g) }
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn halves<const R: usize>(res: &[__m512; R]) -> [[__m256; R]; 2] {
    [
        std::array::from_fn(|i| _mm512_castps512_ps256(res[i])),
        std::array::from_fn(|i| {
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(res[i])))
        }),
    ]
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile32<const K: u8>(p: &TilePtrs) -> [__m512; 4] {
    const R: usize = 4;
    let nb = p.nb;
    // The second token group's entries (8 per block).
    let g1 = 8 * nb;
    // Signed kinds: unsigned codes q = c + o, and o · Σa taken off per token.
    let shift: i32 = if K == S8 {
        7
    } else if unsigned(K) {
        0
    } else {
        offset(K).trailing_zeros() as i32
    };
    let mut acc = [_mm512_setzero_ps(); R];
    let mut accm = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY: b < nb; the caller guarantees R rows of nb blocks in the weight
        // pointers and two groups of nb blocks of 8 lanes in the activation pointers.
        unsafe {
            let mut isum = [_mm512_setzero_si512(); R];
            for j in 0..8 {
                let a = load2(p.q.add(b * 8 + j), p.q.add(g1 + b * 8 + j));
                for (r, s) in isum.iter_mut().enumerate() {
                    let w = p.wu.add(r * nb + b).cast::<i32>().add(j).read();
                    *s = _mm512_dpbusd_epi32(*s, _mm512_set1_epi32(w), a);
                }
            }
            let da = load2_ps(p.d.add(b * 8), p.d.add(g1 + b * 8));
            let corr = if unsigned(K) {
                _mm512_setzero_si512()
            } else {
                let lo = _mm256_loadu_si256(p.qsum.add(b * 8).cast());
                let hi = _mm256_loadu_si256(p.qsum.add(g1 + b * 8).cast());
                let qs = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                _mm512_sllv_epi32(qs, _mm512_set1_epi32(shift))
            };
            for (r, (a, s)) in acc.iter_mut().zip(isum).enumerate() {
                let s = _mm512_sub_epi32(s, corr);
                let dw = _mm512_set1_ps(*p.dw.add(r * nb + b));
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, da), *a);
            }
            if unsigned(K) {
                let sa = load2_ps(p.s.add(b * 8), p.s.add(g1 + b * 8));
                for (r, m) in accm.iter_mut().enumerate() {
                    *m = _mm512_fmadd_ps(_mm512_set1_ps(*p.m.add(r * nb + b)), sa, *m);
                }
            }
        }
    }
    if unsigned(K) {
        for (a, m) in acc.iter_mut().zip(accm) {
            *a = _mm512_add_ps(*a, m);
        }
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_k<F: KFormat, const R: usize>(
    sc: &TileScratchK,
    first: usize,
    il: &InterleavedK,
    g: usize,
) -> [__m512; R] {
    const { assert!(R == TILE_ROWS) };
    let nb = il.nb;
    // Quads under one integer scale: 32 codes, or 16 for Q6_K.
    let unit = if F::DMIN.is_some() { 8 } else { 4 };
    let mut acc = [_mm512_setzero_ps(); R];
    let mut accm = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let (at0, at1) = (g * nb + b, (g + 1) * nb + b);
        // SAFETY: b < nb; the scratch holds R rows of nb entries from `first`, `il` nb
        // super-blocks of groups g and g + 1.
        unsafe {
            let (q0, q1) = (il.q.as_ptr().add(at0 * 64), il.q.as_ptr().add(at1 * 64));
            let mut isum = [_mm512_setzero_si512(); R];
            for u in 0..64 / unit {
                let mut part = [_mm512_setzero_si512(); R];
                for j in u * unit..(u + 1) * unit {
                    let a = load2(q0.add(j), q1.add(j));
                    for (r, s) in part.iter_mut().enumerate() {
                        let e = first + r * nb + b;
                        let quad = sc.codes.as_ptr().add(e * 8).cast::<i32>().add(j).read();
                        *s = _mm512_dpbusd_epi32(*s, _mm512_set1_epi32(quad), a);
                    }
                }
                for (r, (is, s)) in isum.iter_mut().zip(part).enumerate() {
                    let e = first + r * nb + b;
                    let word = *sc.steps.get_unchecked(e * STEPS_MAX + u * unit / F::STEP);
                    let scale = _mm512_set1_epi32(word as i16 as i32);
                    *is = _mm512_add_epi32(*is, _mm512_mullo_epi32(s, scale));
                }
            }
            let da = load2_ps(il.d.as_ptr().add(at0 * 8), il.d.as_ptr().add(at1 * 8));
            for r in 0..R {
                let e = first + r * nb + b;
                let offs = sc.offs.as_ptr().add(e * 8);
                let dw = _mm512_set1_ps(*sc.d.get_unchecked(e));
                let mut osum = _mm512_setzero_si512();
                if F::DMIN.is_some() {
                    for p in 0..4 {
                        let bp = load2(
                            il.b32.as_ptr().add(at0 * 4 + p),
                            il.b32.as_ptr().add(at1 * 4 + p),
                        );
                        let m = _mm512_set1_epi32(*offs.add(p));
                        osum = _mm512_add_epi32(osum, _mm512_madd_epi16(bp, m));
                    }
                    let isf = _mm512_cvtepi32_ps(isum[r]);
                    acc[r] = _mm512_fmadd_ps(isf, _mm512_mul_ps(dw, da), acc[r]);
                    let dm = _mm512_set1_ps(*sc.dmin.get_unchecked(e));
                    let msf = _mm512_cvtepi32_ps(osum);
                    accm[r] = _mm512_fmadd_ps(msf, _mm512_mul_ps(dm, da), accm[r]);
                } else {
                    for p in 0..8 {
                        let bp = load2(
                            il.b16.as_ptr().add(at0 * 8 + p),
                            il.b16.as_ptr().add(at1 * 8 + p),
                        );
                        let s = _mm512_set1_epi32(*offs.add(p));
                        osum = _mm512_add_epi32(osum, _mm512_madd_epi16(bp, s));
                    }
                    let v = _mm512_sub_epi32(isum[r], _mm512_slli_epi32::<5>(osum));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(dw, da), acc[r]);
                }
            }
        }
    }
    if F::DMIN.is_some() {
        for (a, m) in acc.iter_mut().zip(accm) {
            *a = _mm512_sub_ps(*a, m);
        }
    }
    acc
}

/// The stored unsigned codes of a block of kind K (`blocks32::ucodes`; Q8_0's offset by
/// 128), the Q5 kinds' bit 4 of each code from its `qh` word through a mask register (two
/// instructions where AVX2 needs six).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn ucodes512<const K: u8>(blk: *const u8) -> __m256i {
    let off = layout(K).1;
    // SAFETY: the caller passes a whole block of kind K; a Q5 block's `qh` word lies right
    // before its nibbles.
    unsafe {
        if K == U5 || K == S5 {
            let qh = blk.add(off - 4).cast::<u32>().read_unaligned();
            let hb = _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10));
            _mm256_or_si256(nibbles(blk.add(off)), hb)
        } else if K == S8 {
            _mm256_xor_si256(codes::<K>(blk), _mm256_set1_epi8(-128))
        } else {
            ucodes::<K>(blk)
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn gemv8<const K: u8>(
    rows: [*const u8; 8],
    stride: usize,
    act: *const BlockQ8,
    nb: usize,
) -> __m256 {
    let mut acc = _mm256_setzero_ps();
    let mut accm = _mm256_setzero_ps();
    let zero = _mm256_setzero_si256();
    for b in 0..nb {
        // SAFETY: b < nb; the caller guarantees nb blocks behind every row pointer and
        // behind `act`.
        unsafe {
            let a = &*act.add(b);
            let av = _mm256_loadu_si256(a.qs.as_ptr().cast());
            // Unsigned codes against the activations, `o · Σa` taken off for the signed
            // kinds (o = 8, 16, or 128 for Q8_0's codes offset by 128).
            let p: [__m256i; 8] = std::array::from_fn(|r| {
                _mm256_dpbusd_epi32(zero, ucodes512::<K>(rows[r].add(b * stride)), av)
            });
            let mut isum = sum8_i32(p);
            let o = if K == S8 { 128 } else { offset(K) };
            if o != 0 {
                isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(o * sum_i8(av)));
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

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack_block<const K: u8>(
    blk: *const u8,
    u: &Unpacked,
    i: usize,
    b: usize,
    abs_too: bool,
) {
    let at = i * u.nb + b;
    // SAFETY: the caller passes a whole block of kind K and an entry inside the scratch.
    unsafe {
        let q = ucodes512::<K>(blk);
        _mm256_store_si256(u.wu.add(at).cast(), q);
        if unsigned(K) {
            if abs_too {
                _mm256_store_si256(u.wa.add(at).cast(), q);
            }
            *u.m.add(at) = f16x1(blk.add(2));
        } else {
            if abs_too {
                // The AVX2 tile's signed codes and their absolute values: q − o, or
                // (q + 128) − 128 for Q8_0.
                let o = if K == S8 { -128 } else { offset(K) };
                let c = _mm256_sub_epi8(q, _mm256_set1_epi8(o as i8));
                _mm256_store_si256(u.ws.add(at).cast(), c);
                _mm256_store_si256(u.wa.add(at).cast(), _mm256_abs_epi8(c));
            }
            *u.m.add(at) = 0.0;
        }
        *u.d.add(at) = f16x1(blk);
    }
}
