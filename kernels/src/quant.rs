//! Scalar conversions between f32 and the GGML block formats, and the Q8 activation
//! blocks that quantized matrix products consume. These are the definitions the
//! optimized backends are tested against.

use crate::error::{Result, shape};
use crate::types::{GgmlType, QK, f16_at, put_f16};

/// One block of 32 activations quantized to i8 for integer dot products.
///
/// `d` is kept in f32 (not f16 as in GGUF's Q8_0) because activations never leave memory
/// and the extra precision is free; `s = d · Σq` lets Q4_1's offset term be applied per
/// block without touching the elements.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ8 {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; QK],
}

impl Default for BlockQ8 {
    fn default() -> Self {
        Self {
            d: 0.0,
            s: 0.0,
            qs: [0; QK],
        }
    }
}

/// The scale and its reciprocal for symmetric 8-bit quantization of a block whose largest
/// magnitude is `amax`. Shared by every path so that they round identically.
#[inline]
pub(crate) fn q8_scale(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    (d, id)
}

/// Round half to even (what `_mm256_round_ps` and numpy's `rint` do), clamped to ±127.
/// Adding and subtracting 1.5·2²³ leaves no fraction bits, so the FPU's default
/// round-to-nearest-even does the rounding; exact for |v| < 2²², and inlined, unlike
/// `round_ties_even`, which calls libm's `rintf` on baseline x86-64.
#[inline]
pub(crate) fn round_q8(v: f32) -> i8 {
    const MAGIC: f32 = 12_582_912.0;
    let c = v.clamp(-127.0, 127.0);
    ((c + MAGIC) - MAGIC) as i8
}

/// Quantize one row of activations (length a multiple of 32) into Q8 blocks.
pub fn quantize_act_row(x: &[f32], out: &mut [BlockQ8]) -> Result<()> {
    if !x.len().is_multiple_of(QK) || out.len() != x.len() / QK {
        return Err(shape(
            "quantize_act_row",
            format!("{} values into {} blocks", x.len(), out.len()),
        ));
    }
    for (blk, xs) in out.iter_mut().zip(x.chunks_exact(QK)) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let (d, id) = q8_scale(amax);
        let mut sum = 0i32;
        for (q, v) in blk.qs.iter_mut().zip(xs) {
            *q = round_q8(v * id);
            sum += *q as i32;
        }
        blk.d = d;
        blk.s = d * sum as f32;
    }
    Ok(())
}

/// Decode a row of `ty` into f32. `src` must hold exactly `dst.len()` elements.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    if ty.row_bytes(dst.len())? != src.len() {
        return Err(shape(
            "dequantize_row",
            format!("{} bytes of {ty} for {} values", src.len(), dst.len()),
        ));
    }
    let bb = ty.block_bytes();
    match ty {
        GgmlType::F32 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (i, o) in dst.iter_mut().enumerate() {
                *o = f16_at(src, 2 * i);
            }
        }
        GgmlType::BF16 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in dst.chunks_exact_mut(QK).zip(src.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                for (v, q) in o.iter_mut().zip(&b[2..]) {
                    *v = (*q as i8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in dst.chunks_exact_mut(QK).zip(src.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                for j in 0..QK / 2 {
                    let byte = b[2 + j];
                    o[j] = ((byte & 0x0f) as i32 - 8) as f32 * d;
                    o[j + QK / 2] = ((byte >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in dst.chunks_exact_mut(QK).zip(src.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for j in 0..QK / 2 {
                    let byte = b[4 + j];
                    o[j] = (byte & 0x0f) as f32 * d + m;
                    o[j + QK / 2] = (byte >> 4) as f32 * d + m;
                }
            }
        }
    }
    Ok(())
}

/// Encode a row of f32 as `ty` (used for KV-cache storage and to build test weights).
/// The 4-bit encoders follow ggml's reference quantizers.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    if ty.row_bytes(src.len())? != dst.len() {
        return Err(shape(
            "quantize_row",
            format!("{} values into {} bytes of {ty}", src.len(), dst.len()),
        ));
    }
    let bb = ty.block_bytes();
    match ty {
        GgmlType::F32 => {
            for (b, v) in dst.chunks_exact_mut(4).zip(src) {
                b.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (i, v) in src.iter().enumerate() {
                put_f16(dst, 2 * i, *v);
            }
        }
        GgmlType::BF16 => {
            for (b, v) in dst.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&half::bf16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            for (b, xs) in dst.chunks_exact_mut(bb).zip(src.chunks_exact(QK)) {
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                let (d, id) = q8_scale(amax);
                put_f16(b, 0, d);
                for (q, v) in b[2..].iter_mut().zip(xs) {
                    *q = round_q8(v * id) as u8;
                }
            }
        }
        GgmlType::Q4_0 => {
            for (b, xs) in dst.chunks_exact_mut(bb).zip(src.chunks_exact(QK)) {
                // The signed value of largest magnitude maps to -8, so the full range of
                // the 4-bit code is used on the side that needs it.
                let max = xs
                    .iter()
                    .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                put_f16(b, 0, d);
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                for j in 0..QK / 2 {
                    b[2 + j] = q(xs[j]) | (q(xs[j + QK / 2]) << 4);
                }
            }
        }
        GgmlType::Q4_1 => {
            for (b, xs) in dst.chunks_exact_mut(bb).zip(src.chunks_exact(QK)) {
                let min = xs.iter().fold(f32::INFINITY, |m, &v| m.min(v));
                let max = xs.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                put_f16(b, 0, d);
                put_f16(b, 2, min);
                let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                for j in 0..QK / 2 {
                    b[4 + j] = q(xs[j]) | (q(xs[j + QK / 2]) << 4);
                }
            }
        }
    }
    Ok(())
}

/// Scalar dot product of one quantized weight row with Q8 activation blocks. Per block
/// the integer sum is exact; the scales are applied in f32.
pub fn vec_dot_q8(ty: GgmlType, row: &[u8], act: &[BlockQ8]) -> f32 {
    let bb = ty.block_bytes();
    let mut acc = 0f32;
    let mut acc_m = 0f32;
    for (b, a) in row.chunks_exact(bb).zip(act) {
        let (d, sumi) = match ty {
            GgmlType::Q8_0 => {
                let s: i32 = b[2..]
                    .iter()
                    .zip(&a.qs)
                    .map(|(w, x)| (*w as i8) as i32 * *x as i32)
                    .sum();
                (f16_at(b, 0), s)
            }
            GgmlType::Q4_0 => {
                let mut s = 0i32;
                for j in 0..QK / 2 {
                    let byte = b[2 + j];
                    s += ((byte & 0x0f) as i32 - 8) * a.qs[j] as i32;
                    s += ((byte >> 4) as i32 - 8) * a.qs[j + QK / 2] as i32;
                }
                (f16_at(b, 0), s)
            }
            GgmlType::Q4_1 => {
                let mut s = 0i32;
                for j in 0..QK / 2 {
                    let byte = b[4 + j];
                    s += (byte & 0x0f) as i32 * a.qs[j] as i32;
                    s += (byte >> 4) as i32 * a.qs[j + QK / 2] as i32;
                }
                acc_m += f16_at(b, 2) * a.s;
                (f16_at(b, 0), s)
            }
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => unreachable!("float type"),
        };
        acc += (d * a.d) * sumi as f32;
    }
    acc + acc_m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn round_trip_error_is_bounded_per_type() {
        let mut seed = 7;
        let x: Vec<f32> = (0..256).map(|_| lcg(&mut seed) * 3.0).collect();
        // Worst-case absolute error of each format for values in [-3, 3].
        for (ty, tol) in [
            (GgmlType::F32, 0.0),
            (GgmlType::F16, 3.0 / 1024.0),
            (GgmlType::BF16, 3.0 / 128.0),
            (GgmlType::Q8_0, 3.0 / 127.0),
            // The code opposite the extreme clamps at 15, one step short: error up to d.
            (GgmlType::Q4_0, 3.0 / 8.0 + 1e-3),
            (GgmlType::Q4_1, 6.0 / 15.0 * 0.5 + 3e-3),
        ] {
            let mut bytes = vec![0u8; ty.row_bytes(x.len()).unwrap()];
            quantize_row(ty, &x, &mut bytes).unwrap();
            let mut y = vec![0f32; x.len()];
            dequantize_row(ty, &bytes, &mut y).unwrap();
            let err = x
                .iter()
                .zip(&y)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err <= tol, "{ty}: max error {err} > {tol}");
        }
    }

    #[test]
    fn layouts_match_gguf_definition() {
        // Q4_0: d = 1.0, low nibble of byte j = element j, high nibble = element j+16.
        let mut b = vec![0u8; 18];
        b[..2].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
        b[2] = 0x9a; // element 0 = 0xa - 8 = 2, element 16 = 0x9 - 8 = 1
        let mut y = [0f32; 32];
        dequantize_row(GgmlType::Q4_0, &b, &mut y).unwrap();
        assert_eq!((y[0], y[16], y[1]), (2.0, 1.0, -8.0));
        // Q4_1: d = 0.5, m = -1.0.
        let mut b = vec![0u8; 20];
        b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        b[2..4].copy_from_slice(&half::f16::from_f32(-1.0).to_bits().to_le_bytes());
        b[4 + 3] = 0x4f;
        let mut y = [0f32; 32];
        dequantize_row(GgmlType::Q4_1, &b, &mut y).unwrap();
        assert_eq!((y[3], y[19], y[0]), (6.5, 1.0, -1.0));
        // Q8_0: d = 0.25, signed bytes.
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&half::f16::from_f32(0.25).to_bits().to_le_bytes());
        b[2 + 5] = (-4i8) as u8;
        let mut y = [0f32; 32];
        dequantize_row(GgmlType::Q8_0, &b, &mut y).unwrap();
        assert_eq!((y[5], y[0]), (-1.0, 0.0));
    }

    #[test]
    fn integer_dot_approximates_float_dot() {
        let mut seed = 11;
        let n = 512;
        let w: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
        let x: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
        let mut act = vec![BlockQ8::default(); n / QK];
        quantize_act_row(&x, &mut act).unwrap();
        for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
            let mut bytes = vec![0u8; ty.row_bytes(n).unwrap()];
            quantize_row(ty, &w, &mut bytes).unwrap();
            let mut wd = vec![0f32; n];
            dequantize_row(ty, &bytes, &mut wd).unwrap();
            let exact: f32 = wd.iter().zip(&x).map(|(a, b)| a * b).sum();
            let got = vec_dot_q8(ty, &bytes, &act);
            // Activation quantization error: |Σ w·e| with |e| ≤ d/2 = 1/254 per element.
            let bound: f32 = wd.iter().map(|v| v.abs()).sum::<f32>() / 254.0;
            assert!(
                (exact - got).abs() <= bound,
                "{ty}: {exact} vs {got} (bound {bound})"
            );
        }
    }

    #[test]
    fn rounding_is_half_to_even_and_clamped() {
        for (v, q) in [
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (126.5, 126),
            (200.0, 127),
            (-1e9, -127),
            (0.49999997, 0),
            (3.7, 4),
        ] {
            assert_eq!(round_q8(v), q, "{v}");
        }
        let mut seed = 5;
        for _ in 0..10000 {
            let v = lcg(&mut seed) * 130.0;
            assert_eq!(
                round_q8(v) as f32,
                v.round_ties_even().clamp(-127.0, 127.0),
                "{v}"
            );
        }
    }

    #[test]
    fn shape_errors_are_reported() {
        let mut y = [0f32; 31];
        assert!(dequantize_row(GgmlType::Q8_0, &[0; 34], &mut y).is_err());
        let mut out = [BlockQ8::default(); 1];
        assert!(quantize_act_row(&[0.0; 33], &mut out).is_err());
    }
}
