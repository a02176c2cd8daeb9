//! Moving one sequence's KV cache between processes (prefill → decode): the payload
//! layout and its header, [`KvHeader`], written and parsed here only.
//!
//! Payload layout (all integers little endian):
//!
//! | offset | size | field                                                  |
//! |--------|------|--------------------------------------------------------|
//! | 0      | 4    | magic `TKV1`                                           |
//! | 4      | 4    | u32 layout version (1)                                 |
//! | 8      | 4    | u32 n_layers                                           |
//! | 12     | 4    | u32 n_kv_heads                                         |
//! | 16     | 4    | u32 head_dim                                           |
//! | 20     | 4    | u32 dtype: GGML type id of the stored rows (F32=0, F16=1, Q8_0=8) |
//! | 24     | 8    | u64 n_tokens                                           |
//! | 32     | …    | for each layer: K rows of tokens 0..n_tokens, then V rows |
//!
//! A row is one token's `n_kv_heads · head_dim` values encoded as `dtype`
//! (`row_bytes` = dtype row size), so the payload is
//! `32 + n_layers · 2 · n_tokens · row_bytes` bytes. Rows are post-rope K and V exactly as
//! the cache stores them (every backend stores them alike); the block size is not part of
//! the layout, since the importer re-pages into its own blocks.

use crate::error::{Error, Result};

pub const KV_EXPORT_MAGIC: &[u8; 4] = b"TKV1";
pub const KV_EXPORT_VERSION: u32 = 1;

/// The header of a KV payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvHeader {
    pub n_layers: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    /// GGML type id of the stored rows.
    pub dtype: u32,
    pub n_tokens: u64,
}

impl KvHeader {
    /// Bytes of the header; the rows follow.
    pub const LEN: usize = 32;

    /// Append the header (magic and version included) to `out`.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(KV_EXPORT_MAGIC);
        for v in [
            KV_EXPORT_VERSION,
            self.n_layers,
            self.n_kv_heads,
            self.head_dim,
            self.dtype,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.n_tokens.to_le_bytes());
    }

    /// Read the header at the start of `payload`, checking the magic and the version.
    pub fn parse(payload: &[u8]) -> Result<Self> {
        let bad = |m: String| Error::KvTransfer(m);
        if payload.len() < Self::LEN || &payload[..4] != KV_EXPORT_MAGIC {
            return Err(bad("payload lacks the TKV1 header".into()));
        }
        let field = |at: usize| {
            u32::from_le_bytes([
                payload[at],
                payload[at + 1],
                payload[at + 2],
                payload[at + 3],
            ])
        };
        let version = field(4);
        if version != KV_EXPORT_VERSION {
            return Err(bad(format!(
                "layout version {version}, expected {KV_EXPORT_VERSION}"
            )));
        }
        Ok(Self {
            n_layers: field(8),
            n_kv_heads: field(12),
            head_dim: field(16),
            dtype: field(20),
            n_tokens: u64::from_le_bytes(payload[24..32].try_into().expect("8 bytes")),
        })
    }

    /// Check that a payload of `len` bytes with this header fits a runner whose own
    /// export would have header `ours` (any token count) and rows of `row_bytes`, holding
    /// at most `context_length` tokens; returns the token count.
    pub fn check(
        &self,
        ours: &KvHeader,
        row_bytes: usize,
        len: usize,
        context_length: usize,
    ) -> Result<usize> {
        let bad = |m: String| Error::KvTransfer(m);
        let layout = |h: &KvHeader| [h.n_layers, h.n_kv_heads, h.head_dim, h.dtype];
        if layout(self) != layout(ours) {
            return Err(bad(format!(
                "layout (layers, kv heads, head dim, dtype) {:?} does not match ours {:?}",
                layout(self),
                layout(ours)
            )));
        }
        let n = self.n_tokens;
        let want = (n as u128)
            .checked_mul(self.n_layers as u128 * 2 * row_bytes as u128)
            .and_then(|b| b.checked_add(Self::LEN as u128))
            .unwrap_or(u128::MAX);
        if want != len as u128 {
            return Err(bad(format!("{len} bytes for {n} tokens, expected {want}")));
        }
        if n > context_length as u64 {
            return Err(bad(format!(
                "{n} tokens exceed the context length {context_length}"
            )));
        }
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_refuses_what_does_not_fit() {
        let h = KvHeader {
            n_layers: 30,
            n_kv_heads: 3,
            head_dim: 64,
            dtype: 1,
            n_tokens: 7,
        };
        let mut p = Vec::new();
        h.write(&mut p);
        assert_eq!(p.len(), KvHeader::LEN);
        assert_eq!(&p[..4], KV_EXPORT_MAGIC);
        assert_eq!(KvHeader::parse(&p).unwrap(), h);
        let row = 384;
        p.resize(KvHeader::LEN + 30 * 2 * 7 * row, 0);
        assert_eq!(h.check(&h, row, p.len(), 8192).unwrap(), 7);
        let short = h.check(&h, row, p.len() - 1, 8192).unwrap_err().to_string();
        assert!(short.contains("expected"), "{short}");
        let q8 = KvHeader { dtype: 8, ..h };
        let e = h.check(&q8, row, p.len(), 8192).unwrap_err().to_string();
        assert!(e.contains("dtype"), "{e}");
        assert!(
            h.check(&h, row, p.len(), 6)
                .unwrap_err()
                .to_string()
                .contains("context")
        );
        let mut v2 = p.clone();
        v2[4] = 2;
        assert!(
            KvHeader::parse(&v2)
                .unwrap_err()
                .to_string()
                .contains("version 2")
        );
        assert!(matches!(
            KvHeader::parse(&p[..31]),
            Err(Error::KvTransfer(_))
        ));
        assert!(matches!(
            KvHeader::parse(b"XXXX0000000000000000000000000000"),
            Err(Error::KvTransfer(_))
        ));
    }
}
