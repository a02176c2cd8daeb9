//! Moving one sequence's KV cache between processes (prefill → decode).
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
//! the cache stores them; the block size is not part of the layout, since the importer
//! re-pages into its own blocks.

use super::config::LlamaConfig;
use super::kv_cache::PagedKvCache;
use crate::engine_api::SeqId;
use crate::error::{Error, Result};

pub const KV_EXPORT_MAGIC: &[u8; 4] = b"TKV1";
pub const KV_EXPORT_VERSION: u32 = 1;
const HEADER: usize = 32;

pub(super) fn export(kv: &PagedKvCache, cfg: &LlamaConfig, seq: SeqId) -> Result<Vec<u8>> {
    if !kv.contains(seq) {
        return Err(Error::InvalidInput(format!("export of unknown {seq:?}")));
    }
    let n = kv.len(seq);
    let rb = kv.row_bytes();
    let mut out = Vec::with_capacity(HEADER + cfg.n_layers * 2 * n * rb);
    out.extend_from_slice(KV_EXPORT_MAGIC);
    for v in [
        KV_EXPORT_VERSION,
        cfg.n_layers as u32,
        cfg.n_kv_heads as u32,
        cfg.head_dim as u32,
        kv.config().dtype.id(),
    ] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&(n as u64).to_le_bytes());
    for layer in 0..cfg.n_layers {
        for value in [false, true] {
            for pos in 0..n {
                out.extend_from_slice(kv.raw_row(layer, value, seq, pos)?);
            }
        }
    }
    Ok(out)
}

fn field(p: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([p[at], p[at + 1], p[at + 2], p[at + 3]])
}

pub(super) fn import(kv: &mut PagedKvCache, cfg: &LlamaConfig, seq: SeqId, p: &[u8]) -> Result<()> {
    let bad = |m: String| Error::KvTransfer(m);
    if p.len() < HEADER || &p[..4] != KV_EXPORT_MAGIC {
        return Err(bad("payload lacks the TKV1 header".into()));
    }
    let version = field(p, 4);
    if version != KV_EXPORT_VERSION {
        return Err(bad(format!(
            "layout version {version}, expected {KV_EXPORT_VERSION}"
        )));
    }
    let ours = [
        cfg.n_layers as u32,
        cfg.n_kv_heads as u32,
        cfg.head_dim as u32,
        kv.config().dtype.id(),
    ];
    let theirs = [field(p, 8), field(p, 12), field(p, 16), field(p, 20)];
    if ours != theirs {
        return Err(bad(format!(
            "layout (layers, kv heads, head dim, dtype) {theirs:?} does not match ours {ours:?}"
        )));
    }
    let n = u64::from_le_bytes(p[24..32].try_into().expect("8 bytes"));
    let rb = kv.row_bytes();
    let want = (n as u128) * (cfg.n_layers as u128) * 2 * rb as u128 + HEADER as u128;
    if want != p.len() as u128 {
        return Err(bad(format!(
            "{} bytes for {n} tokens, expected {want}",
            p.len()
        )));
    }
    let n = n as usize;
    if n > cfg.context_length {
        return Err(bad(format!(
            "{n} tokens exceed the context length {}",
            cfg.context_length
        )));
    }
    if kv.len(seq) != 0 {
        return Err(bad(format!("{seq:?} already holds tokens")));
    }
    kv.reserve(seq, n)?;
    let mut rows = p[HEADER..].chunks_exact(rb);
    for layer in 0..cfg.n_layers {
        for value in [false, true] {
            for pos in 0..n {
                let row = rows.next().expect("length checked above");
                kv.put_raw_row(layer, value, seq, pos, row)?;
            }
        }
    }
    kv.set_len(seq, n);
    Ok(())
}
