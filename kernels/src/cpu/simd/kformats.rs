//! Where each K-quant's codes and scales lie, as the AVX2 kernels of [`super::kquants`]
//! extract them: one [`KFormat`] per type (adding a K-quant to the CPU backend is one
//! impl here and one line of `with_kformat!`).

use std::arch::x86_64::*;

use crate::types::GgmlType;

/// Where a K-quant's parts lie and how its codes and scales are extracted. Every method
/// reads exactly one super-block of `BYTES` bytes at `blk`.
pub(super) trait KFormat {
    const TY: GgmlType;
    const BYTES: usize;
    /// Byte offsets of the f16 super-scales `d` and `dmin` (`None`: no mins).
    const D: usize;
    const DMIN: Option<usize>;
    /// Quads (4 codes) summed in i16 before their scale is applied in the batch kernel:
    /// as many as keep the i16 sums below 2¹⁵ (4·STEP codes ≤ 32767 / (2·qmax·127) pairs)
    /// and within one scale.
    const STEP: usize;

    /// The 256 codes (unsigned), 32 per vector, in element order.
    unsafe fn codes(blk: *const u8) -> [__m256i; 8];
    /// For each vector of [`Self::codes`]: the i16 scale of each of its 16 `maddubs`
    /// pairs (lanes 0..8 the first 16 codes, 8..16 the last 16).
    unsafe fn scales(blk: *const u8) -> [__m256i; 8];
    /// The scale of each 16 codes (scalar: what the batch kernel's unpack stores).
    unsafe fn scales16(blk: *const u8) -> [i16; 16];
    /// The offset multipliers as i16 pairs, one i32 word per pair of sub-sums: the mins
    /// `m_{2p} | m_{2p+1} << 16` of 32-code sub-blocks (4 words), or Q6_K's scales
    /// `sc_{2p} | sc_{2p+1} << 16` of 16-code sub-blocks (8 words).
    unsafe fn offsets(blk: *const u8) -> [i32; 8];
}

/// The 6-bit scales and mins of a Q4_K/Q5_K super-block (12 bytes at `p`) as two u64 of
/// 8 bytes: the layout of [`crate::quant::kquant_scales`], four at a time.
#[inline]
unsafe fn scales_mins(p: *const u8) -> (u64, u64) {
    // SAFETY: the caller passes 12 readable bytes.
    let [s0, s1, s2] = unsafe { p.cast::<[u32; 3]>().read_unaligned() };
    let sc_lo = s0 & 0x3f3f_3f3f;
    let m_lo = s1 & 0x3f3f_3f3f;
    let sc_hi = (s2 & 0x0f0f_0f0f) | (((s0 >> 6) & 0x0303_0303) << 4);
    let m_hi = ((s2 >> 4) & 0x0f0f_0f0f) | (((s1 >> 6) & 0x0303_0303) << 4);
    (
        sc_lo as u64 | (sc_hi as u64) << 32,
        m_lo as u64 | (m_hi as u64) << 32,
    )
}

/// `x` as 8 u16 lanes broadcast to both 128-bit halves.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bytes_to_u16x8x2(x: u64) -> __m256i {
    _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(x as i64)))
}

/// Scale vectors of a format with one scale per 32 codes (`sc8`, 8 bytes): vector j all
/// `sc_j`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn per32_scales(sc8: u64) -> [__m256i; 8] {
    let v = bytes_to_u16x8x2(sc8);
    std::array::from_fn(|j| {
        let lo = (2 * j) as i8;
        _mm256_shuffle_epi8(
            v,
            _mm256_set1_epi16(i16::from_le_bytes([lo as u8, lo as u8 + 1])),
        )
    })
}

/// One scale per 32 codes (`sc8`, 8 bytes) as the scale of each 16.
fn per16(sc8: u64) -> [i16; 16] {
    let b = sc8.to_le_bytes();
    std::array::from_fn(|k| b[k / 2] as i16)
}

/// Min pairs of 8 mins (`m8`, 8 bytes) as the words [`KFormat::offsets`] returns.
fn min_pairs(m8: u64) -> [i32; 8] {
    let m = m8.to_le_bytes();
    std::array::from_fn(|p| {
        if p < 4 {
            m[2 * p] as i32 | (m[2 * p + 1] as i32) << 16
        } else {
            0
        }
    })
}

/// The 4-bit codes of Q4_K's 128 bytes at `qs`: vector 2c the low nibbles of bytes
/// 32c..32c+32, vector 2c+1 their high nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_nibbles(qs: *const u8) -> [__m256i; 8] {
    let mask = _mm256_set1_epi8(0x0f);
    let mut out = [_mm256_setzero_si256(); 8];
    for c in 0..4 {
        // SAFETY: the caller passes 128 readable bytes.
        let v = unsafe { _mm256_loadu_si256(qs.add(32 * c).cast()) };
        out[2 * c] = _mm256_and_si256(v, mask);
        out[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
    }
    out
}

pub(super) struct Q4K;
pub(super) struct Q5K;
pub(super) struct Q6K;

impl KFormat for Q4K {
    const TY: GgmlType = GgmlType::Q4_K;
    const BYTES: usize = 144;
    const D: usize = 0;
    const DMIN: Option<usize> = Some(2);
    // 32 codes ≤ 15: 16 pairs ≤ 2·15·127 each, 8 quads sum to 30480.
    const STEP: usize = 8;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn codes(blk: *const u8) -> [__m256i; 8] {
        // SAFETY: a whole block: its codes are bytes 16..144.
        unsafe { q4k_nibbles(blk.add(16)) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(blk: *const u8) -> [__m256i; 8] {
        // SAFETY: a whole block: its scales are bytes 4..16.
        per32_scales(unsafe { scales_mins(blk.add(4)) }.0)
    }
    #[inline]
    unsafe fn scales16(blk: *const u8) -> [i16; 16] {
        // SAFETY: as above.
        per16(unsafe { scales_mins(blk.add(4)) }.0)
    }
    #[inline]
    unsafe fn offsets(blk: *const u8) -> [i32; 8] {
        // SAFETY: as above.
        min_pairs(unsafe { scales_mins(blk.add(4)) }.1)
    }
}

impl KFormat for Q5K {
    const TY: GgmlType = GgmlType::Q5_K;
    const BYTES: usize = 176;
    const D: usize = 0;
    const DMIN: Option<usize> = Some(2);
    // Codes ≤ 31: 4 quads sum to 4·2·31·127 = 31496.
    const STEP: usize = 4;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn codes(blk: *const u8) -> [__m256i; 8] {
        // SAFETY: a whole block: `qh` is bytes 16..48, the nibbles 48..176.
        let (mut c, qh) = unsafe {
            (
                q4k_nibbles(blk.add(48)),
                _mm256_loadu_si256(blk.add(16).cast()),
            )
        };
        let bit4 = _mm256_set1_epi8(0x10);
        // Bit j of each `qh` byte is bit 4 of vector j's code: shifted there within
        // 16-bit lanes (bits 4 and 12 of a lane come from the same byte position).
        let hb = [
            _mm256_slli_epi16::<4>(qh),
            _mm256_slli_epi16::<3>(qh),
            _mm256_slli_epi16::<2>(qh),
            _mm256_slli_epi16::<1>(qh),
            qh,
            _mm256_srli_epi16::<1>(qh),
            _mm256_srli_epi16::<2>(qh),
            _mm256_srli_epi16::<3>(qh),
        ];
        for (cj, h) in c.iter_mut().zip(hb) {
            *cj = _mm256_or_si256(*cj, _mm256_and_si256(h, bit4));
        }
        c
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(blk: *const u8) -> [__m256i; 8] {
        // SAFETY: a whole block: its scales are bytes 4..16.
        per32_scales(unsafe { scales_mins(blk.add(4)) }.0)
    }
    #[inline]
    unsafe fn scales16(blk: *const u8) -> [i16; 16] {
        // SAFETY: as above.
        per16(unsafe { scales_mins(blk.add(4)) }.0)
    }
    #[inline]
    unsafe fn offsets(blk: *const u8) -> [i32; 8] {
        // SAFETY: as above.
        min_pairs(unsafe { scales_mins(blk.add(4)) }.1)
    }
}

impl KFormat for Q6K {
    const TY: GgmlType = GgmlType::Q6_K;
    const BYTES: usize = 210;
    const D: usize = 208;
    const DMIN: Option<usize> = None;
    // Codes ≤ 63: 2 quads sum to 2·2·63·127 = 32004.
    const STEP: usize = 2;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn codes(blk: *const u8) -> [__m256i; 8] {
        let low = _mm256_set1_epi8(0x0f);
        let high = _mm256_set1_epi8(0x30);
        let mut out = [_mm256_setzero_si256(); 8];
        for h in 0..2 {
            // SAFETY: a whole block: `ql` is bytes 0..128, `qh` 128..192.
            let (l0, l1, qh) = unsafe {
                (
                    _mm256_loadu_si256(blk.add(64 * h).cast()),
                    _mm256_loadu_si256(blk.add(64 * h + 32).cast()),
                    _mm256_loadu_si256(blk.add(128 + 32 * h).cast()),
                )
            };
            // Vector k of half h: elements 128h + 32k + i, high bits `qh >> 2k`.
            let o = &mut out[4 * h..4 * h + 4];
            o[0] = _mm256_or_si256(
                _mm256_and_si256(l0, low),
                _mm256_and_si256(_mm256_slli_epi16::<4>(qh), high),
            );
            o[1] = _mm256_or_si256(
                _mm256_and_si256(l1, low),
                _mm256_and_si256(_mm256_slli_epi16::<2>(qh), high),
            );
            o[2] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(l0), low),
                _mm256_and_si256(qh, high),
            );
            o[3] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(l1), low),
                _mm256_and_si256(_mm256_srli_epi16::<2>(qh), high),
            );
        }
        out
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(blk: *const u8) -> [__m256i; 8] {
        // SAFETY: a whole block: the 16 i8 scales are bytes 192..208.
        let sc = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(blk.add(192).cast()) });
        let halves = [
            _mm256_permute2x128_si256::<0x00>(sc, sc),
            _mm256_permute2x128_si256::<0x11>(sc, sc),
        ];
        // Vector 4h + k covers sub-blocks 8h + 2k (low lanes) and 8h + 2k + 1 (high).
        std::array::from_fn(|v| {
            let (h, k) = (v / 4, (v % 4) as u8);
            let (a, b) = (4 * k, 4 * k + 2);
            let pick = _mm256_setr_epi8(
                a as i8,
                a as i8 + 1,
                a as i8,
                a as i8 + 1,
                a as i8,
                a as i8 + 1,
                a as i8,
                a as i8 + 1,
                a as i8,
                a as i8 + 1,
                a as i8,
                a as i8 + 1,
                a as i8,
                a as i8 + 1,
                a as i8,
                a as i8 + 1,
                b as i8,
                b as i8 + 1,
                b as i8,
                b as i8 + 1,
                b as i8,
                b as i8 + 1,
                b as i8,
                b as i8 + 1,
                b as i8,
                b as i8 + 1,
                b as i8,
                b as i8 + 1,
                b as i8,
                b as i8 + 1,
                b as i8,
                b as i8 + 1,
            );
            _mm256_shuffle_epi8(halves[h], pick)
        })
    }
    #[inline]
    unsafe fn scales16(blk: *const u8) -> [i16; 16] {
        // SAFETY: a whole block: the scales are bytes 192..208.
        let sc = unsafe { blk.add(192).cast::<[i8; 16]>().read() };
        sc.map(i16::from)
    }
    #[inline]
    unsafe fn offsets(blk: *const u8) -> [i32; 8] {
        // SAFETY: a whole block: the scales are bytes 192..208.
        let sc = unsafe { blk.add(192).cast::<[i8; 16]>().read() };
        std::array::from_fn(|p| (sc[2 * p] as i16 as u16 as i32) | ((sc[2 * p + 1] as i32) << 16))
    }
}
