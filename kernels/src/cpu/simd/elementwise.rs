//! Elementwise and conversion kernels: softmax, SwiGLU, f32 dots, row decoders, and the
//! Q8 activation quantization (bit-identical to the scalar definition).

use std::arch::x86_64::*;

use super::{Avx2, f16x1};
use crate::quant::BlockQ8;
use crate::types::{GgmlType, QK};

impl Avx2 {
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

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
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
