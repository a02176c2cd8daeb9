//! Splitting an exported KV buffer (`model::kv_transfer` layout) into chunks along layer
//! boundaries, and reassembling them on the receiver with validation (a payload is checked
//! against its room: every chunk names its room, and must be the next expected chunk with a
//! matching checksum).

use std::sync::{Arc, Mutex};

use super::checksum::crc32c;
use super::message::{KvChunk, KvChunkRef};

/// Largest chunk of KV bytes sent in one message (several layers share a chunk up to this;
/// a single layer larger than this is still sent whole, up to `kv::MAX_PAYLOAD`).
pub const MAX_CHUNK: usize = 4 << 20;
/// Size of the `TKV1` export header, which rides in the first chunk.
const EXPORT_HEADER: usize = 32;

/// Cut `payload` into chunks of whole layers. The layer count is read from the export
/// header; a buffer that does not look like one is sent as a single chunk (the importer
/// will refuse it with a precise error).
pub fn split(payload: &[u8]) -> Vec<KvChunk> {
    plan(payload).iter().map(KvChunkRef::to_owned).collect()
}

/// [`split`] without copying: each chunk borrows its bytes from `payload` (checksummed
/// here, once).
pub fn plan(payload: &[u8]) -> Vec<KvChunkRef<'_>> {
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
        .map(|(i, (fl, el, a, b))| KvChunkRef {
            index: i as u32,
            count,
            first_layer: fl,
            end_layer: el,
            offset: a as u64,
            total: payload.len() as u64,
            crc32: crc32c(&payload[a..b]),
            data: &payload[a..b],
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

/// Most bytes of reassembly buffers a [`BufferPool`] keeps while idle.
pub const POOL_BYTES: usize = 256 << 20;

/// Reassembly buffers kept for reuse, so a room's KV is copied into memory whose pages are
/// already mapped: the first write to a fresh multi-MiB allocation takes a page fault per
/// 4 KiB, which cost more than the copy itself. Bounded by [`POOL_BYTES`] of capacity.
#[derive(Clone)]
pub struct BufferPool(Arc<Mutex<Vec<Vec<u8>>>>);

impl Default for BufferPool {
    fn default() -> Self {
        Self(Arc::new(Mutex::new(Vec::new())))
    }
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let free = self.0.lock().map(|v| v.len()).unwrap_or(0);
        f.debug_struct("BufferPool").field("free", &free).finish()
    }
}

impl BufferPool {
    /// An empty buffer with at least `cap` bytes of capacity (a pooled one if any fits).
    fn take(&self, cap: usize) -> Vec<u8> {
        let pooled = self.0.lock().ok().and_then(|mut free| {
            let i = free.iter().position(|b| b.capacity() >= cap)?;
            Some(free.swap_remove(i))
        });
        match pooled {
            Some(mut b) => {
                b.clear();
                b
            }
            None => Vec::with_capacity(cap),
        }
    }

    /// Keep `buf` for reuse if the pool stays within [`POOL_BYTES`]; smaller buffers make
    /// way for a larger one.
    pub(super) fn give(&self, buf: Vec<u8>) {
        if buf.capacity() == 0 || buf.capacity() > POOL_BYTES {
            return;
        }
        let Ok(mut free) = self.0.lock() else {
            return;
        };
        free.sort_by_key(Vec::capacity);
        let mut held: usize = free.iter().map(Vec::capacity).sum();
        while held + buf.capacity() > POOL_BYTES && !free.is_empty() {
            held -= free.remove(0).capacity();
        }
        free.push(buf);
    }

    /// Bytes of capacity held by idle buffers.
    pub fn idle_bytes(&self) -> usize {
        self.0
            .lock()
            .map(|v| v.iter().map(Vec::capacity).sum())
            .unwrap_or(0)
    }
}

/// A reassembled KV buffer; its memory goes back to the pool it came from when dropped.
pub struct KvPayload {
    buf: Vec<u8>,
    pool: Option<BufferPool>,
}

impl std::fmt::Debug for KvPayload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KvPayload(<{} bytes>)", self.buf.len())
    }
}

/// Two payloads are equal when their bytes are (wherever their memory goes back to).
impl PartialEq for KvPayload {
    fn eq(&self, other: &Self) -> bool {
        self.buf == other.buf
    }
}

impl std::ops::Deref for KvPayload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl AsRef<[u8]> for KvPayload {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl From<Vec<u8>> for KvPayload {
    fn from(buf: Vec<u8>) -> Self {
        Self { buf, pool: None }
    }
}

impl Drop for KvPayload {
    fn drop(&mut self) {
        if let Some(p) = self.pool.take() {
            p.give(std::mem::take(&mut self.buf));
        }
    }
}

/// Receiver side of one room's KV stream.
#[derive(Debug, Default)]
pub struct Assembler {
    buf: Vec<u8>,
    next: u32,
    count: u32,
    total: u64,
    layer: u16,
    pool: Option<BufferPool>,
}

impl Drop for Assembler {
    fn drop(&mut self) {
        if let Some(p) = self.pool.take() {
            p.give(std::mem::take(&mut self.buf));
        }
    }
}

impl Assembler {
    /// An assembler whose buffer comes from (and returns to) `pool`.
    pub fn with_pool(pool: BufferPool) -> Self {
        Self {
            buf: Vec::new(),
            next: 0,
            count: 0,
            total: 0,
            layer: 0,
            pool: Some(pool),
        }
    }

    /// Accept the next chunk, or say precisely why not (the room then fails).
    /// `limit` bounds the total the room may receive (the receiver's own estimate).
    /// The data is checksummed and copied once, into the reassembly buffer.
    pub fn push<'a>(
        &mut self,
        c: impl Into<KvChunkRef<'a>>,
        limit: u64,
    ) -> Result<bool, ChunkError> {
        let c: KvChunkRef<'a> = c.into();
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
            self.buf = match &self.pool {
                Some(p) => p.take(c.total as usize),
                None => Vec::with_capacity(c.total as usize),
            };
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
        let got = crc32c(c.data);
        if got != c.crc32 {
            return Err(ChunkError::Checksum { got, want: c.crc32 });
        }
        if self.buf.len() as u64 + c.data.len() as u64 > self.total {
            return Err(ChunkError::TooLarge(
                self.buf.len() as u64 + c.data.len() as u64,
            ));
        }
        self.buf.extend_from_slice(c.data);
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

    pub fn into_payload(mut self) -> KvPayload {
        KvPayload {
            buf: std::mem::take(&mut self.buf),
            pool: self.pool.take(),
        }
    }
}
