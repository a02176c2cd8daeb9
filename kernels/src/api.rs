//! The backend-neutral kernel interface and the shapes it works on.

use std::borrow::Cow;

use crate::error::{Result, shape};
use crate::rope::RopeTable;
use crate::types::GgmlType;

/// How a matrix's rows lie in its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// As stored in GGUF: row after row, each `ty.row_bytes(cols)` bytes.
    #[default]
    Gguf,
    /// Block-quantized rows in groups of 8, interleaved block by block: block `b` of rows
    /// `8g..8g+8` lie side by side, then block `b + 1` of the same rows. A kernel that
    /// computes 8 rows at once then reads one sequential stream instead of 8 short ones,
    /// which the hardware prefetcher follows far better (single-token decoding reads
    /// every weight once per token, so it runs at the speed of that stream). The last
    /// group is padded to 8 rows with copies of the last row. Same blocks, same bits:
    /// only the order of the bytes changes.
    Rows8,
}

/// A weight matrix: `rows` rows of `cols` elements of type `ty`, each row
/// `ty.row_bytes(cols)` bytes, laid out as `layout` says. Borrowed, typically from a mmap
/// (GGUF layout) or from a backend's repacked copy ([`Layout::Rows8`]).
#[derive(Debug, Clone, Copy)]
pub struct Matrix<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    pub layout: Layout,
}

impl<'a> Matrix<'a> {
    /// A matrix in GGUF layout.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self> {
        Self::with_layout(ty, rows, cols, data, Layout::Gguf)
    }

    /// A matrix in `layout`; `data` must hold exactly what that layout stores
    /// ([`Layout::Rows8`]: whole groups of 8 rows, block-quantized types only).
    pub fn with_layout(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
        layout: Layout,
    ) -> Result<Self> {
        if layout == Layout::Rows8 && !ty.is_quantized() {
            return Err(shape(
                "Matrix::new",
                format!("{ty} rows cannot be interleaved in blocks (block-quantized types only)"),
            ));
        }
        let want = ty.row_bytes(cols)?.checked_mul(stored_rows(rows, layout));
        if want != Some(data.len()) {
            return Err(shape(
                "Matrix::new",
                format!(
                    "{rows}x{cols} {ty} ({layout:?} layout) needs {want:?} bytes, got {}",
                    data.len()
                ),
            ));
        }
        Ok(Self {
            ty,
            rows,
            cols,
            data,
            layout,
        })
    }

    pub fn row_bytes(&self) -> usize {
        self.data.len() / stored_rows(self.rows, self.layout).max(1)
    }

    /// Row `r`'s bytes in GGUF order: borrowed in GGUF layout, gathered from its group
    /// in [`Layout::Rows8`] (a copy, for the paths that read few rows).
    pub fn row(&self, r: usize) -> Cow<'a, [u8]> {
        let rb = self.row_bytes();
        match self.layout {
            Layout::Gguf => Cow::Borrowed(&self.data[r * rb..(r + 1) * rb]),
            Layout::Rows8 => {
                let bb = self.ty.block_bytes();
                let group = &self.data[r / 8 * 8 * rb..(r / 8 + 1) * 8 * rb];
                Cow::Owned(
                    group
                        .chunks_exact(8 * bb)
                        .flat_map(|blocks| &blocks[r % 8 * bb..(r % 8 + 1) * bb])
                        .copied()
                        .collect(),
                )
            }
        }
    }

    /// This matrix's bytes in GGUF layout (borrowed when they already are).
    pub fn to_gguf(&self) -> Cow<'a, [u8]> {
        match self.layout {
            Layout::Gguf => Cow::Borrowed(self.data),
            Layout::Rows8 => Cow::Owned(
                (0..self.rows)
                    .flat_map(|r| self.row(r).into_owned())
                    .collect(),
            ),
        }
    }

    /// This matrix's bytes in [`Layout::Rows8`], or `None` for a type without blocks.
    pub fn to_rows8(&self) -> Option<Vec<u8>> {
        if !self.ty.is_quantized() {
            return None;
        }
        if self.layout == Layout::Rows8 {
            return Some(self.data.to_vec());
        }
        let (rb, bb) = (self.row_bytes(), self.ty.block_bytes());
        let mut out = Vec::with_capacity(stored_rows(self.rows, Layout::Rows8) * rb);
        for g in 0..self.rows.div_ceil(8) {
            for b in 0..rb / bb {
                for k in 0..8 {
                    // Padding lanes repeat the last row (kernels drop their results).
                    let r = (8 * g + k).min(self.rows - 1);
                    out.extend_from_slice(&self.data[r * rb + b * bb..r * rb + (b + 1) * bb]);
                }
            }
        }
        Some(out)
    }
}

/// Rows a layout stores for a matrix of `rows` rows.
fn stored_rows(rows: usize, layout: Layout) -> usize {
    match layout {
        Layout::Gguf => rows,
        Layout::Rows8 => rows.next_multiple_of(8),
    }
}

/// Attention geometry. Query head `h` reads KV head `h / (n_heads / n_kv_heads)` (GQA).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Sliding-window attention: a query at position `p` attends to the `w` positions
    /// `p + 1 - w ..= p` only (llama.cpp's standard SWA mask: key `k` is masked when
    /// `p - k >= w`). `None`: every earlier position.
    pub window: Option<usize>,
}

impl AttnShape {
    /// The first position a query attending to `0..n_ctx` reads under this shape's window.
    pub fn first_pos(&self, n_ctx: usize) -> usize {
        match self.window {
            Some(w) => n_ctx.saturating_sub(w),
            None => 0,
        }
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
}

/// One layer's K (or V) pool of a paged cache: blocks of `block_tokens` rows, each row
/// the `kv_dim` values of one token stored as `ty`.
#[derive(Debug, Clone, Copy)]
pub struct KvView<'a> {
    pub ty: GgmlType,
    pub data: &'a [u8],
    pub block_tokens: usize,
}

/// One query token: it attends to positions `0..n_ctx` of its sequence, found through
/// the sequence's block table.
#[derive(Debug, Clone, Copy)]
pub struct AttnQuery<'a> {
    pub block_table: &'a [u32],
    pub n_ctx: usize,
}

/// Byte offset of head `g`'s row at position `pos` in a paged pool.
#[inline]
pub(crate) fn kv_head_offset(
    table: &[u32],
    block_tokens: usize,
    row_bytes: usize,
    head_bytes: usize,
    pos: usize,
    g: usize,
) -> usize {
    let block = table[pos / block_tokens] as usize;
    (block * block_tokens + pos % block_tokens) * row_bytes + g * head_bytes
}

/// Validate an attention call once so the loops can index without further checks.
pub(crate) fn check_attention(
    s: &AttnShape,
    q: &[f32],
    queries: &[AttnQuery<'_>],
    k: &KvView<'_>,
    v: &KvView<'_>,
    out: &[f32],
) -> Result<()> {
    let op = "attention";
    if s.n_kv_heads == 0 || !s.n_heads.is_multiple_of(s.n_kv_heads) || s.head_dim == 0 {
        return Err(shape(op, format!("bad head counts {s:?}")));
    }
    if s.window == Some(0) {
        return Err(shape(op, "a sliding window of 0 positions"));
    }
    if q.len() != queries.len() * s.q_dim() || out.len() != q.len() {
        return Err(shape(
            op,
            format!(
                "q {} / out {} for {} queries",
                q.len(),
                out.len(),
                queries.len()
            ),
        ));
    }
    for kv in [k, v] {
        kv.ty.check_row(s.head_dim)?;
        if kv.block_tokens == 0 {
            return Err(shape(op, "block_tokens is 0"));
        }
        let row = kv.ty.row_bytes(s.kv_dim())?;
        let n_blocks = kv.data.len() / (row * kv.block_tokens);
        for qu in queries {
            let used = qu.n_ctx.div_ceil(kv.block_tokens);
            if qu.n_ctx == 0 || qu.block_table.len() < used {
                return Err(shape(
                    op,
                    format!("n_ctx {} with {} blocks", qu.n_ctx, qu.block_table.len()),
                ));
            }
            if let Some(b) = qu.block_table[..used]
                .iter()
                .find(|b| **b as usize >= n_blocks)
            {
                return Err(shape(op, format!("block {b} outside a pool of {n_blocks}")));
            }
        }
    }
    Ok(())
}

pub(crate) fn check_matmul(
    ws: &[Matrix<'_>],
    x: &[f32],
    n_tok: usize,
    outs: &[&mut [f32]],
) -> Result<usize> {
    let op = "matmul";
    let cols = ws.first().map_or(0, |w| w.cols);
    if ws.len() != outs.len() {
        return Err(shape(
            op,
            format!("{} matrices, {} outputs", ws.len(), outs.len()),
        ));
    }
    if x.len() != n_tok * cols {
        return Err(shape(op, format!("input {} != {n_tok} x {cols}", x.len())));
    }
    for (w, o) in ws.iter().zip(outs) {
        if w.cols != cols || o.len() != n_tok * w.rows {
            return Err(shape(
                op,
                format!("{}x{} matrix, output {}", w.rows, w.cols, o.len()),
            ));
        }
    }
    Ok(cols)
}

/// The operations a forward pass needs. Every method validates its shapes and returns an
/// error instead of panicking on a bad call.
pub trait Kernels: Send + Sync {
    fn name(&self) -> &'static str;

    /// How many threads (the calling one included) this implementation spreads its work
    /// over, so that a host backend runs the work around the kernels (KV stores,
    /// sampling) on as many; `None`: no preference (one per core). A count, not a pool:
    /// this trait is backend-neutral and names no backend's types.
    fn parallelism(&self) -> Option<usize> {
        None
    }

    /// The layout in which this implementation multiplies `ty` matrices fastest; a
    /// backend repacks weights into it once, at load. Every implementation multiplies
    /// every layout (the same bits); this only says which one is fast.
    fn weight_layout(&self, ty: GgmlType) -> Layout {
        let _ = ty;
        Layout::Gguf
    }

    /// For each `ws[i]`: `outs[i][t·rows + r] = Σ_c W[r][c] · x[t·cols + c]` for all `n_tok`
    /// tokens. All matrices share `cols` (and therefore one quantization of `x`); each
    /// weight row is read once for the whole batch. Quantized weights multiply `x`
    /// quantized to Q8 blocks; float weights multiply `x` in f32.
    fn matmul(
        &self,
        ws: &[Matrix<'_>],
        x: &[f32],
        n_tok: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<()>;

    /// Row-wise RMS norm: `out = x / sqrt(mean(x²) + eps) · w` for each row of `w.len()`.
    fn rmsnorm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> Result<()>;

    /// [`Kernels::rmsnorm`] in place (per-head norms of Q and K): the same bits as
    /// `rmsnorm` into another buffer.
    fn rmsnorm_in_place(&self, x: &mut [f32], w: &[f32], eps: f32) -> Result<()>;

    /// Rotate the first `table.rot_dim()` dims of every head of each token in place;
    /// `x` holds `positions.len()` tokens × `n_heads` heads × `head_dim`.
    fn rope(
        &self,
        x: &mut [f32],
        n_heads: usize,
        head_dim: usize,
        positions: &[usize],
        table: &RopeTable,
    ) -> Result<()>;

    /// `gate = silu(gate) · up` (SwiGLU).
    fn silu_mul(&self, gate: &mut [f32], up: &[f32]) -> Result<()>;

    /// `gate = gelu(gate) · up` (GeGLU) with GELU's tanh approximation,
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    fn gelu_mul(&self, gate: &mut [f32], up: &[f32]) -> Result<()>;

    /// In-place softmax over the whole slice.
    fn softmax(&self, x: &mut [f32]);

    /// Causal attention of each query token over its sequence's paged K/V, with scale
    /// `1/sqrt(head_dim)`, over the positions `shape.first_pos(n_ctx)..n_ctx` (all of
    /// them without a window). `q` and `out` hold `queries.len()` rows of `shape.q_dim()`.
    fn attention(
        &self,
        shape: &AttnShape,
        q: &[f32],
        queries: &[AttnQuery<'_>],
        k: &KvView<'_>,
        v: &KvView<'_>,
        out: &mut [f32],
    ) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row;

    fn encoded(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
        let rb = ty.row_bytes(cols).unwrap();
        let mut bytes = vec![0u8; rows * rb];
        for (r, row) in bytes.chunks_mut(rb).enumerate() {
            let x: Vec<f32> = (0..cols)
                .map(|c| ((r * 31 + c * 7) % 23) as f32 - 11.0)
                .collect();
            quantize_row(ty, &x, row).unwrap();
        }
        bytes
    }

    #[test]
    fn rows8_keeps_every_row_and_pads_the_last_group() {
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            for rows in [1usize, 7, 8, 9, 13, 16, 37] {
                let cols = 96;
                let bytes = encoded(ty, rows, cols);
                let m = Matrix::new(ty, rows, cols, &bytes).unwrap();
                let packed = m.to_rows8().unwrap();
                let rb = ty.row_bytes(cols).unwrap();
                assert_eq!(packed.len(), rows.next_multiple_of(8) * rb, "{ty} {rows}");
                let p = Matrix::with_layout(ty, rows, cols, &packed, Layout::Rows8).unwrap();
                assert_eq!(p.row_bytes(), rb);
                for r in 0..rows {
                    assert_eq!(p.row(r), m.row(r), "{ty} {rows} rows: row {r}");
                }
                // Block b of row r sits at ((group · blocks + b) · 8 + lane) blocks.
                let (bb, nb) = (ty.block_bytes(), cols / 32);
                let r = rows - 1;
                let at = ((r / 8 * nb + 1) * 8 + r % 8) * bb;
                assert_eq!(&packed[at..at + bb], &bytes[r * rb + bb..r * rb + 2 * bb]);
                // Padding lanes repeat the last row.
                if rows % 8 != 0 {
                    let lane7 = ((r / 8 * nb) * 8 + 7) * bb;
                    assert_eq!(&packed[lane7..lane7 + bb], &bytes[r * rb..r * rb + bb]);
                }
                assert_eq!(p.to_gguf(), bytes, "{ty} {rows}: back to GGUF");
                assert_eq!(p.to_rows8().unwrap(), packed, "already packed");
            }
        }
    }

    #[test]
    fn layouts_check_their_sizes_and_types() {
        let bytes = encoded(GgmlType::Q8_0, 9, 64);
        // 9 rows in Rows8 need 16 rows' bytes.
        let err = Matrix::with_layout(GgmlType::Q8_0, 9, 64, &bytes, Layout::Rows8)
            .unwrap_err()
            .to_string();
        assert!(err.contains("Rows8") && err.contains("9x64"), "{err}");
        let f16 = vec![0u8; 8 * 64 * 2];
        let err = Matrix::with_layout(GgmlType::F16, 8, 64, &f16, Layout::Rows8)
            .unwrap_err()
            .to_string();
        assert!(err.contains("F16"), "{err}");
        let m = Matrix::new(GgmlType::F16, 8, 64, &f16).unwrap();
        assert!(
            m.to_rows8().is_none(),
            "float rows have no blocks to interleave"
        );
    }
}
