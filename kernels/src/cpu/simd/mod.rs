//! The CPU backend's SIMD inner loops, in two tiers. Reached only through [`Avx2`] and
//! [`Avx512`], tokens that exist only when the CPU has the features their functions are
//! compiled for, so every call below runs on a CPU that supports it.
//!
//! - `blocks32`: the 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) against Q8
//!   activation blocks; `kformats` + `kquants`: the K-quants (Q4_K, Q5_K, Q6_K) against
//!   Q8K blocks; `avx512`: the AVX-512 F/BW/VL/VNNI versions of the matrix kernels;
//!   `attention`, `elementwise`: the rest (AVX2 in both tiers).
//!
//! Quantized products: per block, the integer dot of the weight codes with the i8
//! activation codes is exact (`maddubs`/`madd` with i16 partial sums that provably do not
//! overflow, or `vpdpbusd` into i32), so only the float part decides the rounding. For
//! every (row, token) it is, with blocks in order and each step one rounding, exactly the
//! scalar reference's (`crate::quant::Terms`):
//!
//! ```text
//! acc  = fma(float(isum_b), d_w[b] · d_a[b], acc)      (acc starts at 0)
//! accm = fma(ox_b, oy_b, accm)                          (Q4_1, Q5_1: m_w · s_a; Q4_K,
//!                                                        Q5_K: float(msum_b) · dmin_w·d_a)
//! out  = acc + accm  (Q4_1, Q5_1)  |  acc − accm  (Q4_K, Q5_K)  |  acc  (the others)
//! ```
//!
//! The single-token kernels run these steps with one lane per weight row (8 rows), the
//! batch kernels with one lane per token (8, or 16 with AVX-512). Each lane performs the
//! same operations on the same values in the same order, so a token's result does not
//! depend on the size of the batch it is computed in, on the tier, or on the weight
//! layout: batched decoding reproduces sequential decoding bit for bit, and the portable
//! loops give the same bits too. The model's greedy outputs are sensitive to last-bit
//! differences (a flipped int8 rounding of an activation propagates), so this matters.
//!
//! The batch kernels are register-tiled: R weight rows × G·8 tokens. The activations of 8
//! tokens are interleaved four codes at a time (`Interleaved`, `InterleavedK`), so one
//! broadcast of four weight codes times one contiguous load of activations gives 8 tokens'
//! partial dots at once; each weight broadcast serves G loads and each activation load R
//! rows.
#![allow(unsafe_code)]

mod attention;
mod avx512;
mod blocks32;
mod elementwise;
mod kformats;
mod kquants;

use std::arch::x86_64::*;

use crate::api::{Layout, Matrix};

pub(crate) use blocks32::{Interleaved, TileScratch};
pub(crate) use kquants::{InterleavedK, TileScratchK};

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

    /// Ask for the bytes of the 8-row group starting at row `first` to be brought into L2
    /// ahead of use, when the layout stores such a group contiguously (Rows8) and it lies
    /// inside the matrix. The batch kernels call it for the next group while they compute
    /// on the current one: their reads of the weights stop during the compute, so the
    /// hardware prefetcher loses the stream, and a C=32 step's first touch of each group
    /// otherwise waits for DRAM.
    fn prefetch_group(&self, data: &[u8], first: usize) {
        if !self.rows8 || !first.is_multiple_of(8) {
            return;
        }
        let start = first / 8 * 8 * self.row_bytes;
        let Some(bytes) = data.get(start..start + 8 * self.row_bytes) else {
            return;
        };
        for line in bytes.chunks(64) {
            // SAFETY: a prefetch of an address inside `data` (it cannot fault, and reads
            // nothing into the program's state).
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
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

/// 32 bytes aligned for vector loads.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(32))]
pub(crate) struct Q32(pub [u8; 32]);

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
}

/// Proof that AVX-512 F, BW, VL and VNNI are available, and AVX2, FMA and F16C with
/// them (Cascade Lake and later Xeons, Zen 4 and later; Skylake-X lacks VNNI and runs
/// the AVX2 tier).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512(Avx2);

impl Avx512 {
    pub(crate) fn detect() -> Option<Self> {
        let avx2 = Avx2::detect()?;
        let ok = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni");
        ok.then_some(Avx512(avx2))
    }

    #[allow(dead_code)]
    pub(crate) fn avx2(self) -> Avx2 {
        self.0
    }
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

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x1(p: *const u8) -> f32 {
    // SAFETY: the caller passes a pointer to 2 readable bytes.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
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
