//! Splitting an exported KV buffer (`model::kv_transfer` layout) into chunks along layer
//! boundaries, and reassembling them on the receiver with validation (rule 9: every chunk
//! names its room, and must be the next expected chunk with a matching checksum).

use super::checksum::crc32;
use super::message::KvChunk;

/// Largest chunk of KV bytes sent in one message (several layers share a chunk up to this;
/// a single layer larger than this is still sent whole).
pub const MAX_CHUNK: usize = 4 << 20;
/// Size of the `TKV1` export header, which rides in the first chunk.
const EXPORT_HEADER: usize = 32;

/// Cut `payload` into chunks of whole layers. The layer count is read from the export
/// header; a buffer that does not look like one is sent as a single chunk (the importer
/// will refuse it with a precise error).
pub fn split(payload: &[u8]) -> Vec<KvChunk> {
    let layers = payload
        .get(8..12)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .unwrap_or(0);
    let body = payload.len().saturating_sub(EXPORT_HEADER);
    let per_layer = (layers > 0 && layers <= u16::MAX as usize && body.is_multiple_of(layers))
        .then(|| body / layers)
        .filter(|&n| n > 0);
    // (first layer, end layer, byte range)
    let mut ranges: Vec<(u16, u16, usize, usize)> = Vec::new();
    match per_layer {
        None => ranges.push((0, layers.min(u16::MAX as usize) as u16, 0, payload.len())),
        Some(per_layer) => {
            let per_chunk = (MAX_CHUNK / per_layer).max(1);
            let mut l = 0;
            while l < layers {
                let end = (l + per_chunk).min(layers);
                // The export header rides in front of the first chunk.
                let start_byte = if l == 0 {
                    0
                } else {
                    EXPORT_HEADER + l * per_layer
                };
                ranges.push((
                    l as u16,
                    end as u16,
                    start_byte,
                    EXPORT_HEADER + end * per_layer,
                ));
                l = end;
            }
        }
    }
    let count = ranges.len() as u32;
    ranges
        .into_iter()
        .enumerate()
        .map(|(i, (fl, el, a, b))| KvChunk {
            index: i as u32,
            count,
            first_layer: fl,
            end_layer: el,
            offset: a as u64,
            total: payload.len() as u64,
            crc32: crc32(&payload[a..b]),
            data: payload[a..b].to_vec(),
        })
        .collect()
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    #[error("chunk {got}, expected chunk {want}")]
    OutOfOrder { got: u32, want: u32 },
    #[error("chunk says {got} chunks / {got_total} bytes, the room expects {want} / {want_total}")]
    Inconsistent {
        got: u32,
        want: u32,
        got_total: u64,
        want_total: u64,
    },
    #[error("chunk at byte {got}, expected byte {want}")]
    BadOffset { got: u64, want: u64 },
    #[error("chunk starts at layer {got}, expected layer {want}")]
    BadLayer { got: u16, want: u16 },
    #[error("checksum mismatch: chunk says {want:08x}, data has {got:08x}")]
    Checksum { got: u32, want: u32 },
    #[error("KV of {0} bytes exceeds what this room may receive")]
    TooLarge(u64),
}

/// Receiver side of one room's KV stream.
#[derive(Debug, Default)]
pub struct Assembler {
    buf: Vec<u8>,
    next: u32,
    count: u32,
    total: u64,
    layer: u16,
}

impl Assembler {
    /// Accept the next chunk, or say precisely why not (the room then fails).
    /// `limit` bounds the total the room may receive (the receiver's own estimate).
    pub fn push(&mut self, c: &KvChunk, limit: u64) -> Result<bool, ChunkError> {
        if c.index != self.next {
            return Err(ChunkError::OutOfOrder {
                got: c.index,
                want: self.next,
            });
        }
        if self.next == 0 {
            if c.total > limit {
                return Err(ChunkError::TooLarge(c.total));
            }
            self.count = c.count;
            self.total = c.total;
            // Bounded by `limit`, which the receiver computed from its own model.
            self.buf.reserve_exact(c.total as usize);
        } else if c.count != self.count || c.total != self.total {
            return Err(ChunkError::Inconsistent {
                got: c.count,
                want: self.count,
                got_total: c.total,
                want_total: self.total,
            });
        }
        if c.offset != self.buf.len() as u64 {
            return Err(ChunkError::BadOffset {
                got: c.offset,
                want: self.buf.len() as u64,
            });
        }
        if c.first_layer != self.layer {
            return Err(ChunkError::BadLayer {
                got: c.first_layer,
                want: self.layer,
            });
        }
        let got = crc32(&c.data);
        if got != c.crc32 {
            return Err(ChunkError::Checksum { got, want: c.crc32 });
        }
        if self.buf.len() as u64 + c.data.len() as u64 > self.total {
            return Err(ChunkError::TooLarge(
                self.buf.len() as u64 + c.data.len() as u64,
            ));
        }
        self.buf.extend_from_slice(&c.data);
        self.layer = c.end_layer;
        self.next += 1;
        Ok(self.complete())
    }

    pub fn complete(&self) -> bool {
        self.count > 0 && self.next == self.count && self.buf.len() as u64 == self.total
    }

    pub fn received_bytes(&self) -> usize {
        self.buf.len()
    }

    pub fn into_payload(self) -> Vec<u8> {
        self.buf
    }
}
