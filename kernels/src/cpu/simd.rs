//! AVX2/FMA/F16C inner loops. Reached only through [`Avx2`], a token that exists only
//! when the CPU has those features, so every call below runs on a CPU that supports it.
//!
//! Quantized products follow one pattern: per 32-element block, an integer dot of the
//! weight codes with the i8 activation codes (`maddubs` → i16 pairs, `madd` → i32), then
//! one f32 FMA with the product of the two block scales.
//!
//! The single-token kernels (`dot_q*`) and the batch kernel (`dot_unpacked_x4`) perform
//! the same operations in the same order (one accumulator, blocks in order, the Q4_1
//! offset term summed separately), so a token's result does not depend on the size of
//! the batch it is computed in: batched decoding reproduces sequential decoding bit for
//! bit. The model's greedy outputs are sensitive to last-bit differences (a flipped int8
//! rounding of an activation propagates), so this matters.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use crate::quant::BlockQ8;
use crate::types::{GgmlType, QK};

/// Proof that AVX2, FMA and F16C are available.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx2(());

impl Avx2 {
    pub(crate) fn detect() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        ok.then_some(Avx2(()))
    }

    /// Dot product of one quantized weight row with its Q8 activation blocks.
    pub(crate) fn dot_q(self, ty: GgmlType, row: &[u8], act: &[BlockQ8]) -> f32 {
        let nb = act.len();
        assert_eq!(row.len(), nb * ty.block_bytes());
        let (r, a) = (row.as_ptr(), act.as_ptr());
        // SAFETY: the token proves the target features; `row` holds `nb` blocks of `ty`
        // and `act` holds `nb` blocks (asserted above), which is all the kernels read.
        unsafe {
            match ty {
                GgmlType::Q4_0 => dot_q4_0(r, a, nb),
                GgmlType::Q4_1 => dot_q4_1(r, a, nb),
                GgmlType::Q8_0 => dot_q8_0(r, a, nb),
                _ => unreachable!("float type in dot_q"),
            }
        }
    }

    /// Expand a quantized row into one byte per element plus per-block `d` and `m`, so a
    /// batch can reuse the decoded row. Q4_1 codes stay unsigned (0..15, value = q·d + m);
    /// Q4_0 and Q8_0 codes become signed (value = q·d, `m` = 0).
    pub(crate) fn unpack(
        self,
        ty: GgmlType,
        row: &[u8],
        w: &mut [i8],
        d: &mut [f32],
        m: &mut [f32],
    ) {
        let nb = d.len();
        assert!(row.len() == nb * ty.block_bytes() && w.len() == nb * QK && m.len() == nb);
        // SAFETY: features proven by the token; all buffers sized for `nb` blocks above.
        unsafe {
            unpack(
                ty,
                row.as_ptr(),
                w.as_mut_ptr(),
                d.as_mut_ptr(),
                m.as_mut_ptr(),
                nb,
            )
        }
    }

    /// Four tokens against one unpacked row (see [`Avx2::unpack`]).
    pub(crate) fn dot_unpacked_x4(
        self,
        signed: bool,
        w: &[i8],
        d: &[f32],
        m: &[f32],
        acts: [&[BlockQ8]; 4],
    ) -> [f32; 4] {
        let nb = d.len();
        assert!(w.len() == nb * QK && m.len() == nb && acts.iter().all(|a| a.len() == nb));
        let ap = acts.map(|a| a.as_ptr());
        // SAFETY: features proven by the token; every buffer holds `nb` blocks (asserted).
        unsafe {
            if signed {
                dot_unpacked_x4::<true>(w.as_ptr(), d.as_ptr(), m.as_ptr(), ap, nb)
            } else {
                dot_unpacked_x4::<false>(w.as_ptr(), d.as_ptr(), m.as_ptr(), ap, nb)
            }
        }
    }

    pub(crate) fn dot_unpacked_x1(
        self,
        signed: bool,
        w: &[i8],
        d: &[f32],
        m: &[f32],
        act: &[BlockQ8],
    ) -> f32 {
        self.dot_unpacked_x4(signed, w, d, m, [act; 4])[0]
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

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// i32 lane sums of `w · a` for signed `w`: `maddubs` needs an unsigned left operand, so
/// move `w`'s sign onto `a`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mul_sum_signed(w: __m256i, a: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
    _mm256_madd_epi16(p, _mm256_set1_epi16(1))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mul_sum_unsigned(w: __m256i, a: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1))
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

/// Two f16 values at `p` (d, m) as f32 lanes 0 and 1.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x2(p: *const u8) -> __m128 {
    // SAFETY: the caller passes a pointer to 4 readable bytes.
    let bits = unsafe { p.cast::<i32>().read_unaligned() };
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x1(p: *const u8) -> f32 {
    // SAFETY: the caller passes a pointer to 2 readable bytes.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_1(row: *const u8, act: *const BlockQ8, nb: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut summ = 0f32;
    for b in 0..nb {
        // SAFETY: b < nb, and the caller guarantees nb blocks behind both pointers.
        unsafe {
            let blk = row.add(b * 20);
            let a = &*act.add(b);
            let dm = f16x2(blk);
            let w = nibbles(blk.add(4));
            let av = _mm256_loadu_si256(a.qs.as_ptr().cast());
            let p = _mm256_cvtepi32_ps(mul_sum_unsigned(w, av));
            let d = _mm256_set1_ps(_mm_cvtss_f32(dm) * a.d);
            acc = _mm256_fmadd_ps(d, p, acc);
            summ += _mm_cvtss_f32(_mm_movehdup_ps(dm)) * a.s;
        }
    }
    hsum(acc) + summ
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_0(row: *const u8, act: *const BlockQ8, nb: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let eight = _mm256_set1_epi8(8);
    for b in 0..nb {
        // SAFETY: b < nb, and the caller guarantees nb blocks behind both pointers.
        unsafe {
            let blk = row.add(b * 18);
            let a = &*act.add(b);
            let w = _mm256_sub_epi8(nibbles(blk.add(2)), eight);
            let av = _mm256_loadu_si256(a.qs.as_ptr().cast());
            let p = _mm256_cvtepi32_ps(mul_sum_signed(w, av));
            let d = _mm256_set1_ps(f16x1(blk) * a.d);
            acc = _mm256_fmadd_ps(d, p, acc);
        }
    }
    hsum(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0(row: *const u8, act: *const BlockQ8, nb: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        // SAFETY: b < nb, and the caller guarantees nb blocks behind both pointers.
        unsafe {
            let blk = row.add(b * 34);
            let a = &*act.add(b);
            let w = _mm256_loadu_si256(blk.add(2).cast());
            let av = _mm256_loadu_si256(a.qs.as_ptr().cast());
            let p = _mm256_cvtepi32_ps(mul_sum_signed(w, av));
            let d = _mm256_set1_ps(f16x1(blk) * a.d);
            acc = _mm256_fmadd_ps(d, p, acc);
        }
    }
    hsum(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack(ty: GgmlType, row: *const u8, w: *mut i8, d: *mut f32, m: *mut f32, nb: usize) {
    let bb = ty.block_bytes();
    let eight = _mm256_set1_epi8(8);
    for b in 0..nb {
        // SAFETY: b < nb; the caller guarantees nb blocks in `row` and room for nb blocks
        // (32 bytes of `w`, one `d`, one `m` each) in the outputs.
        unsafe {
            let blk = row.add(b * bb);
            let (codes, db, mb) = match ty {
                GgmlType::Q4_1 => {
                    let dm = f16x2(blk);
                    (
                        nibbles(blk.add(4)),
                        _mm_cvtss_f32(dm),
                        _mm_cvtss_f32(_mm_movehdup_ps(dm)),
                    )
                }
                GgmlType::Q4_0 => (_mm256_sub_epi8(nibbles(blk.add(2)), eight), f16x1(blk), 0.0),
                _ => (_mm256_loadu_si256(blk.add(2).cast()), f16x1(blk), 0.0),
            };
            _mm256_storeu_si256(w.add(b * QK).cast(), codes);
            *d.add(b) = db;
            *m.add(b) = mb;
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_unpacked_x4<const SIGNED: bool>(
    w: *const i8,
    d: *const f32,
    m: *const f32,
    acts: [*const BlockQ8; 4],
    nb: usize,
) -> [f32; 4] {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut summ = [0f32; 4];
    for b in 0..nb {
        // SAFETY: b < nb; the caller guarantees nb blocks behind every pointer.
        unsafe {
            let wv = _mm256_loadu_si256(w.add(b * QK).cast());
            let db = *d.add(b);
            let mb = *m.add(b);
            for k in 0..4 {
                let a = &*acts[k].add(b);
                let av = _mm256_loadu_si256(a.qs.as_ptr().cast());
                let p = if SIGNED {
                    mul_sum_signed(wv, av)
                } else {
                    mul_sum_unsigned(wv, av)
                };
                acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(db * a.d), _mm256_cvtepi32_ps(p), acc[k]);
                if !SIGNED {
                    summ[k] += mb * a.s;
                }
            }
        }
    }
    [
        hsum(acc[0]) + summ[0],
        hsum(acc[1]) + summ[1],
        hsum(acc[2]) + summ[2],
        hsum(acc[3]) + summ[3],
    ]
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
