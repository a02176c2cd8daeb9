//! Scalar conversions between f32 and the GGML block formats, and the Q8 activation
//! blocks that quantized matrix products consume. These are the definitions the
//! optimized backends are tested against; `scripts/quant_reference.py` holds them against
//! gguf-py's numpy dequantization (`tests/quant_reference.rs`).
//!
//! Each block format is one `Format` implementation in its family's file (`blocks32.rs`:
//! 32-element blocks, `kquants.rs`: 256-element super-blocks); the functions below
//! dispatch on [`GgmlType`] through `with_format!`, the one list of them.
//!
//! **Activation quantization.** A quantized product multiplies the weight codes with
//! activations quantized to i8, per block, in exact integer arithmetic:
//! - [`BlockQ8`] (32 values, f32 `d` and `s = d · Σq`) for the 32-element formats, as
//!   GGML pairs Q4_0/Q5_0/Q8_0 with its Q8_0 and Q4_1/Q5_1 with its Q8_1 (the offset term
//!   `m · Σx` is `m · s`). `d = amax / 127`, codes round half to even.
//! - [`BlockQ8K`] (256 values, f32 `d`, sums of each 16 codes) for the K-quants, as GGML
//!   pairs them with its Q8_K: one scale per super-block lets the sub-block scales multiply
//!   integer partial sums (no float step per sub-block), and the 16-code sums give the
//!   min (Q4_K, Q5_K) and −32 (Q6_K) terms without touching the codes. The scale is GGML's:
//!   `id = 127 / amax`, `d = 1 / id`, codes `round_half_even(x · id)`, so the codes are
//!   those llama.cpp multiplies (its products differ only in float summation order).

mod blocks32;
mod kquants;

pub use kquants::kquant_scales;

use crate::error::{Result, shape};
use crate::types::{GgmlType, QK, QK_K, f16_at, put_f16};

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

/// One block of 256 activations quantized to i8 for the K-quants' integer dot products:
/// GGML's Q8_K layout (292 bytes).
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    /// Sum of each 16 consecutive codes.
    pub bsums: [i16; QK_K / 16],
}

impl Default for BlockQ8K {
    fn default() -> Self {
        Self {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        }
    }
}

/// The reciprocal scale and the scale of a [`BlockQ8K`] whose largest magnitude is
/// `amax`: GGML's `iscale = 127 / amax`, `d = 1 / iscale`.
#[inline]
pub(crate) fn q8k_scale(amax: f32) -> (f32, f32) {
    if amax == 0.0 {
        return (0.0, 0.0);
    }
    let id = 127.0 / amax;
    (1.0 / id, id)
}

/// Quantize one row of activations (length a multiple of 256) into Q8K blocks.
pub fn quantize_act_row_k(x: &[f32], out: &mut [BlockQ8K]) -> Result<()> {
    if !x.len().is_multiple_of(QK_K) || out.len() != x.len() / QK_K {
        return Err(shape(
            "quantize_act_row_k",
            format!("{} values into {} blocks", x.len(), out.len()),
        ));
    }
    for (blk, xs) in out.iter_mut().zip(x.chunks_exact(QK_K)) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let (d, id) = q8k_scale(amax);
        for (q, v) in blk.qs.iter_mut().zip(xs) {
            *q = round_q8(v * id);
        }
        for (s, qs) in blk.bsums.iter_mut().zip(blk.qs.chunks_exact(16)) {
            *s = qs.iter().map(|q| *q as i16).sum();
        }
        blk.d = d;
    }
    Ok(())
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

/// One block-quantized weight format as the scalar reference defines it.
pub(crate) trait Format {
    /// The activation blocks its products consume.
    type Act: ActBlock;
    /// Decode one block into its `block_len` values.
    fn decode(b: &[u8], out: &mut [f32]);
    /// Encode `block_len` values as one block.
    fn encode(x: &[f32], b: &mut [u8]);
    /// How the offset term joins the main one.
    const OFFSET: Offset;
    /// One block times one activation block as the float steps take it (see [`Terms`]);
    /// the integer sums in it are exact.
    fn dot(b: &[u8], a: &Self::Act) -> Terms;
}

/// Whether a format's product has an offset term, and its sign: Q4_1/Q5_1's `m · s`
/// (added), the K-quants' mins `dmin · d_a · msum` (subtracted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Offset {
    None,
    Plus,
    Minus,
}

/// One block's product: per row, in block order, `main = fma(x, y, main)` and (with an
/// offset) `off = fma(ox, oy, off)`, both from 0; the row's product is `main`, `main + off`
/// or `main − off`. These are exactly the steps every optimized kernel runs per lane, so
/// every backend gives the same bits (the integer sums are exact, and each float step
/// rounds once).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Terms {
    /// The exact integer sum, as f32.
    pub x: f32,
    /// Its scale: weight scale × activation scale, one product.
    pub y: f32,
    pub ox: f32,
    pub oy: f32,
}

impl Terms {
    fn main(isum: i32, y: f32) -> Self {
        Self {
            x: isum as f32,
            y,
            ox: 0.0,
            oy: 0.0,
        }
    }
}

/// `$body` with `$F` the [`Format`] of the quantized type `$ty`, or `$float` for a float
/// type: the one list of the block formats.
macro_rules! with_format {
    ($ty:expr, $F:ident => $body:expr, float => $float:expr) => {
        match $ty {
            GgmlType::Q8_0 => {
                type $F = blocks32::Q8_0;
                $body
            }
            GgmlType::Q4_0 => {
                type $F = blocks32::Q4_0;
                $body
            }
            GgmlType::Q4_1 => {
                type $F = blocks32::Q4_1;
                $body
            }
            GgmlType::Q5_0 => {
                type $F = blocks32::Q5_0;
                $body
            }
            GgmlType::Q5_1 => {
                type $F = blocks32::Q5_1;
                $body
            }
            GgmlType::Q4_K => {
                type $F = kquants::Q4K;
                $body
            }
            GgmlType::Q5_K => {
                type $F = kquants::Q5K;
                $body
            }
            GgmlType::Q6_K => {
                type $F = kquants::Q6K;
                $body
            }
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => $float,
        }
    };
}

fn decode_blocks<F: Format>(bb: usize, src: &[u8], dst: &mut [f32]) {
    let n = dst.len() / (src.len() / bb).max(1);
    for (o, b) in dst.chunks_exact_mut(n).zip(src.chunks_exact(bb)) {
        F::decode(b, o);
    }
}

fn encode_blocks<F: Format>(bb: usize, src: &[f32], dst: &mut [u8]) {
    let n = src.len() / (dst.len() / bb).max(1);
    for (b, xs) in dst.chunks_exact_mut(bb).zip(src.chunks_exact(n)) {
        F::encode(xs, b);
    }
}

fn dot_blocks<F: Format>(bb: usize, row: &[u8], act: &[F::Act]) -> f32 {
    let mut main = 0f32;
    let mut off = 0f32;
    for (b, a) in row.chunks_exact(bb).zip(act) {
        let t = F::dot(b, a);
        main = t.x.mul_add(t.y, main);
        if F::OFFSET != Offset::None {
            off = t.ox.mul_add(t.oy, off);
        }
    }
    match F::OFFSET {
        Offset::None => main,
        Offset::Plus => main + off,
        Offset::Minus => main - off,
    }
}

/// Decode a row of `ty` into f32. `src` must hold exactly `dst.len()` elements.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    if ty.row_bytes(dst.len())? != src.len() {
        return Err(shape(
            "dequantize_row",
            format!("{} bytes of {ty} for {} values", src.len(), dst.len()),
        ));
    }
    if dst.is_empty() {
        return Ok(());
    }
    let bb = ty.block_bytes();
    with_format!(ty, F => decode_blocks::<F>(bb, src, dst), float => match ty {
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
        _ => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
    });
    Ok(())
}

/// Encode a row of f32 as `ty` (used for KV-cache storage and to build test weights).
/// The 32-element encoders follow ggml's reference quantizers; the K-quant encoders are
/// simple (one pass, no search for the best scales), good enough for test weights.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    if ty.row_bytes(src.len())? != dst.len() {
        return Err(shape(
            "quantize_row",
            format!("{} values into {} bytes of {ty}", src.len(), dst.len()),
        ));
    }
    if src.is_empty() {
        return Ok(());
    }
    let bb = ty.block_bytes();
    with_format!(ty, F => encode_blocks::<F>(bb, src, dst), float => match ty {
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
        _ => {
            for (b, v) in dst.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&half::bf16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
    });
    Ok(())
}

/// One token's activations in the blocks a weight type's product consumes.
#[derive(Debug, Clone, Copy)]
pub enum ActRow<'a> {
    Q8(&'a [BlockQ8]),
    Q8K(&'a [BlockQ8K]),
}

/// The activation block types, as [`Format::Act`] names them.
pub(crate) trait ActBlock: Sized {
    fn of<'a>(row: ActRow<'a>) -> Option<&'a [Self]>;
}

impl ActBlock for BlockQ8 {
    fn of<'a>(row: ActRow<'a>) -> Option<&'a [Self]> {
        match row {
            ActRow::Q8(a) => Some(a),
            ActRow::Q8K(_) => None,
        }
    }
}

impl ActBlock for BlockQ8K {
    fn of<'a>(row: ActRow<'a>) -> Option<&'a [Self]> {
        match row {
            ActRow::Q8K(a) => Some(a),
            ActRow::Q8(_) => None,
        }
    }
}

/// Scalar dot product of one quantized weight row with one token's activation blocks of
/// the type's [`GgmlType::act_format`]. Per block the integer sum is exact; the scales are
/// applied in f32. Panics on a float type or on activations of the other format.
pub fn vec_dot(ty: GgmlType, row: &[u8], act: ActRow<'_>) -> f32 {
    let bb = ty.block_bytes();
    with_format!(ty, F => {
        let a = <F as Format>::Act::of(act)
            .unwrap_or_else(|| panic!("{ty} multiplies {:?} activations", ty.act_format()));
        dot_blocks::<F>(bb, row, a)
    }, float => panic!("{ty} is a float type"))
}

/// [`vec_dot`] of a type with [`BlockQ8`] activations.
pub fn vec_dot_q8(ty: GgmlType, row: &[u8], act: &[BlockQ8]) -> f32 {
    vec_dot(ty, row, ActRow::Q8(act))
}

/// [`vec_dot`] of a K-quant with [`BlockQ8K`] activations.
pub fn vec_dot_q8k(ty: GgmlType, row: &[u8], act: &[BlockQ8K]) -> f32 {
    vec_dot(ty, row, ActRow::Q8K(act))
}

#[cfg(test)]
mod tests;
