//! GGML tensor element types as GGUF stores them.
//!
//! Layouts (little endian, one block after another, no padding):
//! - `F32`: 4 bytes per element. `F16`: IEEE half. `BF16`: upper 16 bits of an f32.
//! - `Q8_0`: 32 elements per block: f16 scale `d`, then 32 × i8; value = q · d.
//! - `Q4_0`: 32 elements per block: f16 `d`, then 16 bytes; byte j holds element j in its
//!   low nibble and element j+16 in its high nibble; value = (q − 8) · d.
//! - `Q4_1`: 32 elements per block: f16 `d`, f16 `m`, then 16 bytes of nibbles as in
//!   Q4_0; value = q · d + m.

use crate::error::{Error, Result};

/// Elements per block of the 32-element quantized formats.
pub const QK: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
}

impl GgmlType {
    pub const ALL: [GgmlType; 6] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
    ];

    /// The type id GGUF uses in tensor infos.
    pub fn from_id(id: u32) -> Result<Self> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            30 => Self::BF16,
            other => return Err(Error::UnknownType(other)),
        })
    }

    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 8,
            Self::BF16 => 30,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q8_0 => "Q8_0",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
        }
    }

    /// Elements per block.
    pub fn block_len(self) -> usize {
        if self.is_quantized() { QK } else { 1 }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q8_0 => 2 + QK,
            Self::Q4_0 => 2 + QK / 2,
            Self::Q4_1 => 4 + QK / 2,
        }
    }

    /// Block-quantized types are multiplied against activations quantized to Q8 blocks;
    /// float types against f32 activations.
    pub fn is_quantized(self) -> bool {
        matches!(self, Self::Q8_0 | Self::Q4_0 | Self::Q4_1)
    }

    /// Bytes of a row of `n` elements; `n` must be a multiple of the block length.
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        self.check_row(n)?;
        Ok(n / self.block_len() * self.block_bytes())
    }

    pub fn check_row(self, n: usize) -> Result<()> {
        if !n.is_multiple_of(self.block_len()) {
            return Err(Error::RowNotBlockAligned {
                ty: self.name(),
                len: n,
                block: self.block_len(),
            });
        }
        Ok(())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[inline]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

#[inline]
pub(crate) fn put_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
}
