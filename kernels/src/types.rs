//! GGML tensor element types as GGUF stores them: the one table of every type's id, name,
//! block shape and the activation blocks its products consume.
//!
//! Layouts (little endian, one block after another, no padding; `f16` an IEEE half):
//! - `F32`: 4 bytes per element. `F16`: IEEE half. `BF16`: upper 16 bits of an f32.
//! - 32-element blocks ([`QK`]); "nibbles" are 16 bytes where byte j holds element j in its
//!   low half and element j+16 in its high half; `qh` is a little-endian u32 whose bit j is
//!   bit 4 of element j's code:
//!   - `Q8_0` (34 B): f16 `d`, 32 × i8; value = q · d.
//!   - `Q4_0` (18 B): f16 `d`, nibbles; value = (q − 8) · d.
//!   - `Q4_1` (20 B): f16 `d`, f16 `m`, nibbles; value = q · d + m.
//!   - `Q5_0` (22 B): f16 `d`, `qh`, nibbles; value = (q − 16) · d (q = nibble | bit · 16).
//!   - `Q5_1` (24 B): f16 `d`, f16 `m`, `qh`, nibbles; value = q · d + m.
//! - 256-element super-blocks ([`QK_K`], the "K-quants"):
//!   - `Q4_K` (144 B): f16 `d`, f16 `dmin`, 12 bytes of eight 6-bit scales `sc` and mins
//!     `m` (see [`crate::quant::kquant_scales`]), 128 bytes of codes: bytes 32c..32c+32 hold
//!     sub-block 2c (elements 64c..64c+32) in their low nibbles and sub-block 2c+1 in their
//!     high nibbles. Sub-block j (32 elements): value = d·sc_j · q − dmin·m_j.
//!   - `Q5_K` (176 B): as Q4_K, then `qh` 32 bytes before the 128 code bytes: bit j of
//!     `qh[i]` is bit 4 of element 32j + i. value = d·sc_j · q − dmin·m_j, q in 0..32.
//!   - `Q6_K` (210 B): `ql` 128 bytes, `qh` 64 bytes, 16 × i8 scales, f16 `d`. In each
//!     half h (128 elements), for i in 0..32: element 128h + 32k + i has low 4 bits from
//!     `ql[64h + i + 32·(k&1)]` (low nibble for k < 2, high for k ≥ 2) and high 2 bits from
//!     `qh[32h + i] >> 2k`. Sixteen-element sub-block s: value = d·sc_s · (q − 32).

use crate::error::{Error, Result};

/// Elements per block of the 32-element quantized formats.
pub const QK: usize = 32;
/// Elements per super-block of the K-quants.
pub const QK_K: usize = 256;

/// GGML's names, underscores included (`Q4_K`), as every GGUF tool prints them.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4_K,
    Q5_K,
    Q6_K,
}

/// The activation blocks a quantized type's products consume (see [`crate::quant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActFormat {
    /// [`crate::BlockQ8`]: 32 activations, f32 scale and scaled sum.
    Q8,
    /// [`crate::BlockQ8K`]: 256 activations, f32 scale and sixteen 16-element sums.
    Q8K,
}

/// One row of the type table.
struct Info {
    ty: GgmlType,
    id: u32,
    name: &'static str,
    block_len: usize,
    block_bytes: usize,
    act: Option<ActFormat>,
}

const fn info(
    ty: GgmlType,
    id: u32,
    name: &'static str,
    block_len: usize,
    block_bytes: usize,
    act: Option<ActFormat>,
) -> Info {
    Info {
        ty,
        id,
        name,
        block_len,
        block_bytes,
        act,
    }
}

use ActFormat::{Q8, Q8K};

/// Every supported type, in [`GgmlType::ALL`] order.
const TABLE: [Info; 11] = [
    info(GgmlType::F32, 0, "F32", 1, 4, None),
    info(GgmlType::F16, 1, "F16", 1, 2, None),
    info(GgmlType::BF16, 30, "BF16", 1, 2, None),
    info(GgmlType::Q8_0, 8, "Q8_0", QK, 2 + QK, Some(Q8)),
    info(GgmlType::Q4_0, 2, "Q4_0", QK, 2 + QK / 2, Some(Q8)),
    info(GgmlType::Q4_1, 3, "Q4_1", QK, 4 + QK / 2, Some(Q8)),
    info(GgmlType::Q5_0, 6, "Q5_0", QK, 6 + QK / 2, Some(Q8)),
    info(GgmlType::Q5_1, 7, "Q5_1", QK, 8 + QK / 2, Some(Q8)),
    info(
        GgmlType::Q4_K,
        12,
        "Q4_K",
        QK_K,
        4 + 12 + QK_K / 2,
        Some(Q8K),
    ),
    info(
        GgmlType::Q5_K,
        13,
        "Q5_K",
        QK_K,
        4 + 12 + QK_K / 8 + QK_K / 2,
        Some(Q8K),
    ),
    info(
        GgmlType::Q6_K,
        14,
        "Q6_K",
        QK_K,
        QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
        Some(Q8K),
    ),
];

/// GGML's names of the type ids GGUF files may carry that Tandem does not multiply, so a
/// refusal can name the type instead of a number.
const UNSUPPORTED: [(u32, &str); 21] = [
    (9, "Q8_1"),
    (10, "Q2_K"),
    (11, "Q3_K"),
    (15, "Q8_K"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
];

impl GgmlType {
    pub const ALL: [GgmlType; 11] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    fn info(self) -> &'static Info {
        let i = &TABLE[self as usize];
        debug_assert_eq!(i.ty, self);
        i
    }

    /// The type id GGUF uses in tensor infos.
    pub fn from_id(id: u32) -> Result<Self> {
        TABLE
            .iter()
            .find(|i| i.id == id)
            .map(|i| i.ty)
            .ok_or(Error::UnknownType(id))
    }

    /// GGML's name of any type id GGUF defines, supported or not (`None` for ids GGML
    /// does not define either).
    pub fn name_of_id(id: u32) -> Option<&'static str> {
        TABLE
            .iter()
            .map(|i| (i.id, i.name))
            .chain(UNSUPPORTED)
            .find(|(i, _)| *i == id)
            .map(|(_, n)| n)
    }

    pub fn id(self) -> u32 {
        self.info().id
    }

    pub fn name(self) -> &'static str {
        self.info().name
    }

    /// Elements per block.
    pub fn block_len(self) -> usize {
        self.info().block_len
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.info().block_bytes
    }

    /// Block-quantized types are multiplied against activations quantized to Q8 blocks
    /// ([`Self::act_format`]); float types against f32 activations.
    pub fn is_quantized(self) -> bool {
        self.info().act.is_some()
    }

    /// The activation blocks this type's integer products consume; `None` for float types.
    pub fn act_format(self) -> Option<ActFormat> {
        self.info().act
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

impl ActFormat {
    /// Activations per block.
    pub fn block_len(self) -> usize {
        match self {
            Self::Q8 => QK,
            Self::Q8K => QK_K,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_matches_gguf_ids_and_sizes() {
        // Sizes as GGML defines them (gguf-py's GGML_QUANT_SIZES): (id, elements, bytes).
        for (ty, id, len, bytes) in [
            (GgmlType::F32, 0, 1, 4),
            (GgmlType::F16, 1, 1, 2),
            (GgmlType::Q4_0, 2, 32, 18),
            (GgmlType::Q4_1, 3, 32, 20),
            (GgmlType::Q5_0, 6, 32, 22),
            (GgmlType::Q5_1, 7, 32, 24),
            (GgmlType::Q8_0, 8, 32, 34),
            (GgmlType::Q4_K, 12, 256, 144),
            (GgmlType::Q5_K, 13, 256, 176),
            (GgmlType::Q6_K, 14, 256, 210),
            (GgmlType::BF16, 30, 1, 2),
        ] {
            assert_eq!(
                (ty.id(), ty.block_len(), ty.block_bytes()),
                (id, len, bytes)
            );
            assert_eq!(GgmlType::from_id(id).unwrap(), ty);
            assert_eq!(GgmlType::name_of_id(id), Some(ty.name()));
        }
        for (i, ty) in GgmlType::ALL.iter().enumerate() {
            assert_eq!(TABLE[i].ty, *ty, "TABLE follows ALL");
            assert_eq!(ty.is_quantized(), ty.block_len() > 1);
            if let Some(a) = ty.act_format() {
                assert_eq!(a.block_len(), ty.block_len(), "{ty}");
            }
        }
    }

    #[test]
    fn unsupported_ids_are_named_and_refused() {
        assert_eq!(GgmlType::from_id(11), Err(Error::UnknownType(11)));
        assert_eq!(GgmlType::name_of_id(11), Some("Q3_K"));
        assert_eq!(GgmlType::name_of_id(23), Some("IQ4_XS"));
        assert_eq!(
            GgmlType::name_of_id(4),
            None,
            "ids 4 and 5 were removed from GGML"
        );
        for (id, _) in UNSUPPORTED {
            assert!(GgmlType::from_id(id).is_err(), "{id}");
        }
        assert_eq!(
            GgmlType::Q4_K.check_row(896).unwrap_err().to_string(),
            "row length 896 is not a multiple of the Q4_K block size 256"
        );
    }
}
