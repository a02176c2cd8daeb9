//! The fused attention kernels: scores of up to 4 query heads against K rows and the
//! weighted sum of V rows, decoding F32 / F16 / BF16 / Q8_0 rows in registers.

use std::arch::x86_64::*;

use super::{Avx2, f16x1};
use crate::types::{GgmlType, QK};

/// Storage types of K rows, as const parameters of the attention kernels.
const KF32: u8 = 0;

const KF16: u8 = 1;

const KBF16: u8 = 2;

const KQ8: u8 = 3;

impl Avx2 {
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
