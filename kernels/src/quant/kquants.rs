//! The K-quants (Q4_K, Q5_K, Q6_K: 256-element super-blocks with per-sub-block integer
//! scales), as the scalar reference defines them. Their products consume [`BlockQ8K`]
//! activations: 256 codes under one f32 scale, with the sums of each 16 codes.
//!
//! Per super-block the whole integer part is exact (i32, bounds below), so a product has
//! two float steps per super-block at most:
//!
//! ```text
//! Q4_K, Q5_K: isum = Σ_j sc_j · Σ_i q·a        msum = Σ_j m_j · (sum of sub-block j's a)
//!             main = fma(isum, d·d_a, main)    off = fma(msum, dmin·d_a, off)
//!             row product: main − off
//! Q6_K:       isum = Σ_s sc_s · (Σ_i q·a − 32 · bsum_s)
//!             main = fma(isum, d·d_a, main)    row product: main
//! ```
//!
//! Bounds: Q4_K |isum| ≤ 8 · 63 · 32 · 15 · 127 < 2³¹ (31M); Q5_K 8 · 63 · 32 · 31 · 127
//! (64M); Q6_K 16 · 128 · 16 · 64 · 127 (266M); msum ≤ 8 · 63 · 4064 (2M).

use super::{BlockQ8K, Format, Offset, Terms, round_q8};
use crate::types::{QK_K, f16_at, put_f16};

/// The eight 6-bit scales and mins of a Q4_K / Q5_K super-block from their 12 bytes:
/// bytes 0..4 hold sc₀..₃ and bytes 4..8 m₀..₃ in their low 6 bits; bytes 8..12 hold the
/// low 4 bits of sc₄..₇ (low nibble) and m₄..₇ (high nibble), whose top 2 bits are the top
/// 2 bits of bytes 0..4 (sc) and 4..8 (m).
pub fn kquant_scales(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 6) << 4);
        m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, m)
}

pub(crate) fn put_kquant_scales(s: &mut [u8], sc: &[u8; 8], m: &[u8; 8]) {
    for j in 0..4 {
        s[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
    }
}

/// Q4_K code of element e (0..16): sub-block e / 32 is the low (even) or high (odd) nibble
/// of bytes 32c..32c+32, c = e / 64.
fn q4k_code(qs: &[u8], e: usize) -> u8 {
    let byte = qs[e / 64 * 32 + e % 32];
    if (e / 32).is_multiple_of(2) {
        byte & 0x0f
    } else {
        byte >> 4
    }
}

/// Q5_K code of element e (0..32): the Q4_K nibble plus bit e / 32 of `qh[e % 32]`.
fn q5k_code(qh: &[u8], qs: &[u8], e: usize) -> u8 {
    q4k_code(qs, e) | (((qh[e % 32] >> (e / 32)) & 1) << 4)
}

/// Q6_K code of element e (0..64).
fn q6k_code(ql: &[u8], qh: &[u8], e: usize) -> u8 {
    let (h, k, i) = (e / 128, e % 128 / 32, e % 32);
    let byte = ql[64 * h + i + 32 * (k & 1)];
    let low = if k < 2 { byte & 0x0f } else { byte >> 4 };
    low | (((qh[32 * h + i] >> (2 * k)) & 3) << 4)
}

/// Encode a sub-block's (scale, min) pairs for a format whose values are d·sc·q − dmin·m
/// with codes 0..=qmax: per sub-block the smallest step covering [min(x, 0), max(x)],
/// the steps and mins quantized to 6 bits under two f16 super-scales.
fn encode_scaled_min(x: &[f32], b: &mut [u8], qmax: u8) -> (f32, f32, [u8; 8], [u8; 8]) {
    let mut step = [0f32; 8];
    let mut off = [0f32; 8];
    for (j, xs) in x.chunks_exact(32).enumerate() {
        let lo = xs.iter().fold(0f32, |m, &v| m.min(v));
        let hi = xs.iter().fold(lo, |m, &v| m.max(v));
        off[j] = -lo;
        step[j] = (hi - lo) / qmax as f32;
    }
    let d = half::f16::from_f32(step.iter().fold(0f32, |m, v| m.max(*v)) / 63.0).to_f32();
    let dmin = half::f16::from_f32(off.iter().fold(0f32, |m, v| m.max(*v)) / 63.0).to_f32();
    put_f16(b, 0, d);
    put_f16(b, 2, dmin);
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..8 {
        // Round the min up and the step up, so that the codes reach both ends.
        m[j] = if dmin > 0.0 {
            (off[j] / dmin).ceil().min(63.0) as u8
        } else {
            0
        };
        let need = (x[32 * j..32 * j + 32].iter().fold(0f32, |a, &v| a.max(v))
            + dmin * m[j] as f32)
            / qmax as f32;
        sc[j] = if d > 0.0 {
            (need / d).ceil().min(63.0) as u8
        } else {
            0
        };
    }
    put_kquant_scales(&mut b[4..16], &sc, &m);
    (d, dmin, sc, m)
}

/// The code of x in sub-block j of a d·sc·q − dmin·m format.
fn scaled_min_code(x: f32, d: f32, dmin: f32, sc: u8, m: u8, qmax: u8) -> u8 {
    let step = d * sc as f32;
    if step == 0.0 {
        return 0;
    }
    ((x + dmin * m as f32) / step)
        .round()
        .clamp(0.0, qmax as f32) as u8
}

/// Σ over sub-blocks of `scale(j) · Σ_i code(e) · a(e)` for sub-blocks of `len` elements.
fn scaled_isum(
    a: &BlockQ8K,
    len: usize,
    scale: impl Fn(usize) -> i32,
    code: impl Fn(usize) -> u8,
) -> i32 {
    (0..QK_K / len)
        .map(|j| {
            let s: i32 = (j * len..(j + 1) * len)
                .map(|e| code(e) as i32 * a.qs[e] as i32)
                .sum();
            scale(j) * s
        })
        .sum()
}

/// Σ_j m_j · (sum of the codes of 32-element sub-block j).
fn min_sum(a: &BlockQ8K, m: &[u8; 8]) -> i32 {
    (0..8)
        .map(|j| m[j] as i32 * (a.bsums[2 * j] as i32 + a.bsums[2 * j + 1] as i32))
        .sum()
}

pub(crate) struct Q4K;
pub(crate) struct Q5K;
pub(crate) struct Q6K;

impl Format for Q4K {
    type Act = BlockQ8K;
    fn decode(b: &[u8], out: &mut [f32]) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let (sc, m) = kquant_scales(&b[4..16]);
        for (e, v) in out.iter_mut().enumerate() {
            let j = e / 32;
            let (dl, ml) = (d * sc[j] as f32, dmin * m[j] as f32);
            *v = dl * q4k_code(&b[16..], e) as f32 - ml;
        }
    }
    fn encode(x: &[f32], b: &mut [u8]) {
        let (d, dmin, sc, m) = encode_scaled_min(x, b, 15);
        let qs = &mut b[16..];
        qs.fill(0);
        for (e, &v) in x.iter().enumerate() {
            let j = e / 32;
            let q = scaled_min_code(v, d, dmin, sc[j], m[j], 15);
            qs[e / 64 * 32 + e % 32] |= if j % 2 == 0 { q } else { q << 4 };
        }
    }
    const OFFSET: Offset = Offset::Minus;
    fn dot(b: &[u8], a: &BlockQ8K) -> Terms {
        let (sc, m) = kquant_scales(&b[4..16]);
        let isum = scaled_isum(a, 32, |j| sc[j] as i32, |e| q4k_code(&b[16..], e));
        Terms {
            ox: min_sum(a, &m) as f32,
            oy: f16_at(b, 2) * a.d,
            ..Terms::main(isum, f16_at(b, 0) * a.d)
        }
    }
}

impl Format for Q5K {
    type Act = BlockQ8K;
    fn decode(b: &[u8], out: &mut [f32]) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let (sc, m) = kquant_scales(&b[4..16]);
        let (qh, qs) = (&b[16..48], &b[48..]);
        for (e, v) in out.iter_mut().enumerate() {
            let j = e / 32;
            let (dl, ml) = (d * sc[j] as f32, dmin * m[j] as f32);
            *v = dl * q5k_code(qh, qs, e) as f32 - ml;
        }
    }
    fn encode(x: &[f32], b: &mut [u8]) {
        let (d, dmin, sc, m) = encode_scaled_min(x, b, 31);
        b[16..].fill(0);
        for (e, &v) in x.iter().enumerate() {
            let j = e / 32;
            let q = scaled_min_code(v, d, dmin, sc[j], m[j], 31);
            b[16 + e % 32] |= (q >> 4) << j;
            let lo = q & 0x0f;
            b[48 + e / 64 * 32 + e % 32] |= if j % 2 == 0 { lo } else { lo << 4 };
        }
    }
    const OFFSET: Offset = Offset::Minus;
    fn dot(b: &[u8], a: &BlockQ8K) -> Terms {
        let (sc, m) = kquant_scales(&b[4..16]);
        let (qh, qs) = (&b[16..48], &b[48..]);
        let isum = scaled_isum(a, 32, |j| sc[j] as i32, |e| q5k_code(qh, qs, e));
        Terms {
            ox: min_sum(a, &m) as f32,
            oy: f16_at(b, 2) * a.d,
            ..Terms::main(isum, f16_at(b, 0) * a.d)
        }
    }
}

/// Byte offsets of Q6_K's parts.
const Q6_QH: usize = QK_K / 2;
const Q6_SC: usize = Q6_QH + QK_K / 4;
const Q6_D: usize = Q6_SC + QK_K / 16;

impl Format for Q6K {
    type Act = BlockQ8K;
    fn decode(b: &[u8], out: &mut [f32]) {
        let d = f16_at(b, Q6_D);
        let (ql, qh) = (&b[..Q6_QH], &b[Q6_QH..Q6_SC]);
        for (e, v) in out.iter_mut().enumerate() {
            let dl = d * (b[Q6_SC + e / 16] as i8) as f32;
            *v = dl * (q6k_code(ql, qh, e) as i32 - 32) as f32;
        }
    }
    fn encode(x: &[f32], b: &mut [u8]) {
        // Per 16 elements the signed extreme maps to code 0 (value −32 · step), as Q4_0
        // does; the steps are quantized to i8 under one f16 scale.
        let mut step = [0f32; 16];
        for (s, xs) in x.chunks_exact(16).enumerate() {
            let mx = xs
                .iter()
                .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            step[s] = mx / -32.0;
        }
        let amax = step.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = half::f16::from_f32(amax / 127.0).to_f32();
        put_f16(b, Q6_D, d);
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[..Q6_SC].fill(0);
        for s in 0..16 {
            let sc = round_q8(step[s] * id);
            b[Q6_SC + s] = sc as u8;
            let st = d * sc as f32;
            for (e, &v) in x.iter().enumerate().skip(16 * s).take(16) {
                let q = if st != 0.0 {
                    ((v / st).round() + 32.0).clamp(0.0, 63.0) as u8
                } else {
                    32
                };
                let (h, k, i) = (e / 128, e % 128 / 32, e % 32);
                let l = 64 * h + i + 32 * (k & 1);
                b[l] |= if k < 2 { q & 0x0f } else { (q & 0x0f) << 4 };
                b[Q6_QH + 32 * h + i] |= (q >> 4) << (2 * k);
            }
        }
    }
    const OFFSET: Offset = Offset::None;
    fn dot(b: &[u8], a: &BlockQ8K) -> Terms {
        let (ql, qh) = (&b[..Q6_QH], &b[Q6_QH..Q6_SC]);
        let sc = |s: usize| (b[Q6_SC + s] as i8) as i32;
        let raw = scaled_isum(a, 16, sc, |e| q6k_code(ql, qh, e));
        let off: i32 = (0..16).map(|s| sc(s) * a.bsums[s] as i32).sum();
        Terms::main(raw - 32 * off, f16_at(b, Q6_D) * a.d)
    }
}
