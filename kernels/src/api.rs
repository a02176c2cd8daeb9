//! The backend-neutral kernel interface and the shapes it works on.

use crate::error::{Result, shape};
use crate::rope::RopeTable;
use crate::types::GgmlType;

/// A weight matrix as stored in GGUF: `rows` rows of `cols` elements of type `ty`,
/// row-major, each row `ty.row_bytes(cols)` bytes. Borrowed, typically from a mmap.
#[derive(Debug, Clone, Copy)]
pub struct Matrix<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> Matrix<'a> {
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self> {
        let want = ty.row_bytes(cols)?.checked_mul(rows);
        if want != Some(data.len()) {
            return Err(shape(
                "Matrix::new",
                format!(
                    "{rows}x{cols} {ty} needs {want:?} bytes, got {}",
                    data.len()
                ),
            ));
        }
        Ok(Self {
            ty,
            rows,
            cols,
            data,
        })
    }

    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows.max(1)
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }
}

/// Attention geometry. Query head `h` reads KV head `h / (n_heads / n_kv_heads)` (GQA).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
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

    /// The pool this backend spreads its work over, for callers that parallelize work
    /// around the kernels (KV stores, sampling) on the same threads; `None`: it has none.
    fn thread_pool(&self) -> Option<&'static crate::cpu::ThreadPool> {
        None
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

    /// In-place softmax over the whole slice.
    fn softmax(&self, x: &mut [f32]);

    /// Causal attention of each query token over its sequence's paged K/V, with scale
    /// `1/sqrt(head_dim)`. `q` and `out` hold `queries.len()` rows of `shape.q_dim()`.
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
