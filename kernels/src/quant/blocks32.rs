//! The 32-element block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), as the scalar reference
//! defines them. Their products consume [`BlockQ8`] activations (32 codes, f32 scale `d`
//! and `s = d · Σq`), the counterpart of GGML's Q8_0 for the symmetric formats and Q8_1
//! for those with an offset `m` (whose term `m · Σx` is `m · s` per block).

use super::{BlockQ8, Format, Offset, Terms, q8_scale, round_q8};
use crate::types::{QK, f16_at, put_f16};

/// Nibbles: byte j holds element j (low) and element j + 16 (high).
fn nibble(qs: &[u8], j: usize) -> u8 {
    if j < QK / 2 {
        qs[j] & 0x0f
    } else {
        qs[j - QK / 2] >> 4
    }
}

fn put_nibbles(qs: &mut [u8], q: impl Fn(usize) -> u8) {
    for (j, b) in qs[..QK / 2].iter_mut().enumerate() {
        *b = q(j) | (q(j + QK / 2) << 4);
    }
}

/// Bit 4 of element j's code: bit j of the little-endian u32 `qh`.
fn high_bit(qh: &[u8], j: usize) -> u8 {
    (qh[j / 8] >> (j % 8)) & 1
}

fn put_high_bits(qh: &mut [u8], q: impl Fn(usize) -> u8) {
    qh[..4].fill(0);
    for j in 0..QK {
        qh[j / 8] |= ((q(j) >> 4) & 1) << (j % 8);
    }
}

/// The element of largest magnitude, with its sign (the first one on ties).
fn signed_max(xs: &[f32]) -> f32 {
    xs.iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

fn min_max(xs: &[f32]) -> (f32, f32) {
    xs.iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
}

fn recip_or_zero(d: f32) -> f32 {
    if d != 0.0 { 1.0 / d } else { 0.0 }
}

/// Σ w · a over a block of integer codes `w(j)`.
fn isum(w: impl Fn(usize) -> i32, a: &BlockQ8) -> i32 {
    (0..QK).map(|j| w(j) * a.qs[j] as i32).sum()
}

pub(crate) struct Q8_0;
pub(crate) struct Q4_0;
pub(crate) struct Q4_1;
pub(crate) struct Q5_0;
pub(crate) struct Q5_1;

impl Format for Q8_0 {
    type Act = BlockQ8;
    fn decode(b: &[u8], out: &mut [f32]) {
        let d = f16_at(b, 0);
        for (v, q) in out.iter_mut().zip(&b[2..]) {
            *v = (*q as i8) as f32 * d;
        }
    }
    fn encode(xs: &[f32], b: &mut [u8]) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let (d, id) = q8_scale(amax);
        put_f16(b, 0, d);
        for (q, v) in b[2..].iter_mut().zip(xs) {
            *q = round_q8(v * id) as u8;
        }
    }
    const OFFSET: Offset = Offset::None;
    fn dot(b: &[u8], a: &BlockQ8) -> Terms {
        let s = isum(|j| (b[2 + j] as i8) as i32, a);
        Terms::main(s, f16_at(b, 0) * a.d)
    }
}

impl Format for Q4_0 {
    type Act = BlockQ8;
    fn decode(b: &[u8], out: &mut [f32]) {
        let d = f16_at(b, 0);
        for (j, v) in out.iter_mut().enumerate() {
            *v = (nibble(&b[2..], j) as i32 - 8) as f32 * d;
        }
    }
    fn encode(xs: &[f32], b: &mut [u8]) {
        // The signed value of largest magnitude maps to -8, so the full range of the
        // 4-bit code is used on the side that needs it (ggml's reference quantizer).
        let d = signed_max(xs) / -8.0;
        let id = recip_or_zero(d);
        put_f16(b, 0, d);
        put_nibbles(&mut b[2..], |j| {
            ((xs[j] * id + 8.5) as i32).clamp(0, 15) as u8
        });
    }
    const OFFSET: Offset = Offset::None;
    fn dot(b: &[u8], a: &BlockQ8) -> Terms {
        let s = isum(|j| nibble(&b[2..], j) as i32 - 8, a);
        Terms::main(s, f16_at(b, 0) * a.d)
    }
}

impl Format for Q4_1 {
    type Act = BlockQ8;
    fn decode(b: &[u8], out: &mut [f32]) {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        for (j, v) in out.iter_mut().enumerate() {
            *v = nibble(&b[4..], j) as f32 * d + m;
        }
    }
    fn encode(xs: &[f32], b: &mut [u8]) {
        let (min, max) = min_max(xs);
        let d = (max - min) / 15.0;
        let id = recip_or_zero(d);
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        put_nibbles(&mut b[4..], |j| {
            (((xs[j] - min) * id + 0.5) as i32).clamp(0, 15) as u8
        });
    }
    const OFFSET: Offset = Offset::Plus;
    fn dot(b: &[u8], a: &BlockQ8) -> Terms {
        let s = isum(|j| nibble(&b[4..], j) as i32, a);
        Terms {
            ox: f16_at(b, 2),
            oy: a.s,
            ..Terms::main(s, f16_at(b, 0) * a.d)
        }
    }
}

/// Q5_0 code of element j: 0..32 (the value is (q − 16) · d).
fn q5_code(b: &[u8], qh: usize, j: usize) -> u8 {
    nibble(&b[qh + 4..], j) | (high_bit(&b[qh..], j) << 4)
}

impl Format for Q5_0 {
    type Act = BlockQ8;
    fn decode(b: &[u8], out: &mut [f32]) {
        let d = f16_at(b, 0);
        for (j, v) in out.iter_mut().enumerate() {
            *v = (q5_code(b, 2, j) as i32 - 16) as f32 * d;
        }
    }
    fn encode(xs: &[f32], b: &mut [u8]) {
        let d = signed_max(xs) / -16.0;
        let id = recip_or_zero(d);
        put_f16(b, 0, d);
        let q = |j: usize| ((xs[j] * id + 16.5) as i32).clamp(0, 31) as u8;
        put_high_bits(&mut b[2..6], q);
        put_nibbles(&mut b[6..], |j| q(j) & 0x0f);
    }
    const OFFSET: Offset = Offset::None;
    fn dot(b: &[u8], a: &BlockQ8) -> Terms {
        let s = isum(|j| q5_code(b, 2, j) as i32 - 16, a);
        Terms::main(s, f16_at(b, 0) * a.d)
    }
}

impl Format for Q5_1 {
    type Act = BlockQ8;
    fn decode(b: &[u8], out: &mut [f32]) {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        for (j, v) in out.iter_mut().enumerate() {
            *v = q5_code(b, 4, j) as f32 * d + m;
        }
    }
    fn encode(xs: &[f32], b: &mut [u8]) {
        let (min, max) = min_max(xs);
        let d = (max - min) / 31.0;
        let id = recip_or_zero(d);
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        let q = |j: usize| (((xs[j] - min) * id + 0.5) as i32).clamp(0, 31) as u8;
        put_high_bits(&mut b[4..8], q);
        put_nibbles(&mut b[8..], |j| q(j) & 0x0f);
    }
    const OFFSET: Offset = Offset::Plus;
    fn dot(b: &[u8], a: &BlockQ8) -> Terms {
        let s = isum(|j| q5_code(b, 4, j) as i32, a);
        Terms {
            ox: f16_at(b, 2),
            oy: a.s,
            ..Terms::main(s, f16_at(b, 0) * a.d)
        }
    }
}
