//! [`Backend`]: the operations of a forward pass over buffers and weights that are the
//! backend's own types (host vectors and mapped file bytes for the CPU, device
//! allocations for CUDA), so that one forward pass, written once against this trait,
//! drives every backend. A backend adds kernels, not a model.
//!
//! What crosses the trait boundary besides the backend's own types is host-side and
//! small: shapes and counts, the rope table, and a step's description ([`StepDesc`]:
//! token ids, positions, KV slots, block tables), which the backend turns into its own
//! step inputs once per step ([`Backend::prepare_step`]) before any kernel reads them.
//!
//! Conventions shared by every method:
//! - activation buffers hold `rows × width` f32 values row-major and may be longer than
//!   a call needs (they are sized for the largest step so far); a call names its row
//!   count and reads or writes only that prefix, and fails with a shape error when a
//!   buffer is too short;
//! - nothing here copies activations between host and device; [`Backend::to_host`] is
//!   the one explicit download (for logits and tests).

use std::sync::Arc;

use crate::api::{AttnQuery, AttnShape, Layout, Matrix};
use crate::error::{Result, shape};
use crate::rope::RopeTable;
use crate::types::GgmlType;

/// Bytes that outlive any borrow: a mapped model file or an owned buffer.
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// A weight matrix inside bytes the matrix keeps alive: as stored in GGUF, in the mapped
/// model file, so that a backend can hold it without copying or upload it once (CUDA);
/// or a backend's own repacked copy ([`HostMatrix::to_layout`], the CPU).
#[derive(Clone)]
pub struct HostMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    bytes: SharedBytes,
    start: usize,
    len: usize,
    layout: Layout,
}

impl std::fmt::Debug for HostMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("start", &self.start)
            .field("len", &self.len)
            .field("layout", &self.layout)
            .finish()
    }
}

impl HostMatrix {
    /// The matrix at `bytes[start..start + len]`; checked once here (sizes and range), so
    /// that [`HostMatrix::matrix`] cannot fail later.
    pub fn new(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: SharedBytes,
        start: usize,
        len: usize,
    ) -> Result<Self> {
        let all = (*bytes).as_ref();
        let data = start
            .checked_add(len)
            .and_then(|end| all.get(start..end))
            .ok_or_else(|| {
                shape(
                    "HostMatrix::new",
                    format!("bytes {start}..+{len} outside {} bytes", all.len()),
                )
            })?;
        Matrix::new(ty, rows, cols, data)?;
        Ok(Self {
            ty,
            rows,
            cols,
            bytes,
            start,
            len,
            layout: Layout::Gguf,
        })
    }

    /// This matrix in `layout`: itself when it already is, else an owned repacked copy
    /// (which then no longer reads the bytes it came from). A layout the type cannot take
    /// is an error naming both.
    pub fn to_layout(&self, layout: Layout) -> Result<Self> {
        if layout == self.layout {
            return Ok(self.clone());
        }
        let m = self.matrix();
        let bytes = match layout {
            Layout::Rows8 => m.to_rows8(),
            Layout::Gguf => Some(m.to_gguf().into_owned()),
        }
        .ok_or_else(|| {
            shape(
                "HostMatrix::to_layout",
                format!("{} has no {layout:?} layout", m.ty),
            )
        })?;
        // Checks the size the layout needs.
        Matrix::with_layout(m.ty, m.rows, m.cols, &bytes, layout)?;
        let len = bytes.len();
        Ok(Self {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            bytes: Arc::new(bytes),
            start: 0,
            len,
            layout,
        })
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The whole of `bytes` as one matrix (tests, small models held in memory).
    pub fn owned(ty: GgmlType, rows: usize, cols: usize, bytes: Vec<u8>) -> Result<Self> {
        let len = bytes.len();
        Self::new(ty, rows, cols, Arc::new(bytes), 0, len)
    }

    /// The borrowed view the slice kernels ([`crate::Kernels`]) take.
    pub fn matrix(&self) -> Matrix<'_> {
        Matrix {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            data: &(*self.bytes).as_ref()[self.start..self.start + self.len],
            layout: self.layout,
        }
    }

    /// Whether two matrices are the same bytes (a tied output projection).
    pub fn same_bytes(&self, other: &HostMatrix) -> bool {
        self.matrix().data.as_ptr() == other.matrix().data.as_ptr() && self.len == other.len
    }
}

/// Geometry of a paged KV cache: per layer a K pool and a V pool of `n_blocks` blocks of
/// `block_tokens` rows; a row is one token's `kv_dim` values stored as `ty`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedKvSpec {
    pub ty: GgmlType,
    pub n_layers: usize,
    pub kv_dim: usize,
    pub block_tokens: usize,
    pub n_blocks: usize,
}

impl PagedKvSpec {
    /// Bytes of one row.
    pub fn row_bytes(&self) -> Result<usize> {
        self.ty.row_bytes(self.kv_dim)
    }

    /// Bytes of one layer's K (or V) pool.
    pub fn pool_bytes(&self) -> Result<usize> {
        self.row_bytes()?
            .checked_mul(self.block_tokens)
            .and_then(|b| b.checked_mul(self.n_blocks))
            .ok_or_else(|| shape("kv pool", format!("{self:?}: size overflows")))
    }

    /// Refuse what no backend stores: other row types, empty pools, block ids past u32.
    pub fn check(&self) -> Result<()> {
        if !matches!(self.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0) {
            return Err(shape(
                "kv pool",
                format!("KV dtype {} (use F32, F16 or Q8_0)", self.ty),
            ));
        }
        if self.block_tokens == 0 || self.n_blocks == 0 || self.n_blocks > u32::MAX as usize {
            return Err(shape(
                "kv pool",
                format!("{} blocks of {} tokens", self.n_blocks, self.block_tokens),
            ));
        }
        self.pool_bytes()?
            .checked_mul(self.n_layers)
            .and_then(|b| b.checked_mul(2))
            .map(|_| ())
            .ok_or_else(|| shape("kv pool", format!("{self:?}: size overflows")))
    }
}

/// One sequence's tokens in a step: step tokens `first..first + len`, at positions
/// `start..start + len` of the sequence, whose block table is
/// `tables[table_offset..table_offset + table_len]` of the [`StepDesc`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepSeq {
    pub first: usize,
    pub len: usize,
    pub start: usize,
    pub table_offset: usize,
    pub table_len: usize,
}

/// One forward step as the host describes it, for every backend: the tokens of all its
/// sequences flattened into one batch, where each token's K and V go, and what each
/// token attends to. Built with [`StepDesc::push_seq`], which computes positions and KV
/// slots from the block tables so that no backend computes them differently.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepDesc {
    pub tokens: Vec<u32>,
    pub positions: Vec<usize>,
    /// Pool row of each token's K and V: `block · block_tokens + pos % block_tokens`.
    pub slots: Vec<usize>,
    /// Tokens whose final hidden state (and logits) the step returns, in order.
    pub want: Vec<usize>,
    pub seqs: Vec<StepSeq>,
    pub tables: Vec<u32>,
}

impl StepDesc {
    /// Tokens in the step.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Append a sequence holding `start` tokens already, whose block table is `table`
    /// (blocks of `block_tokens`), with `tokens` new tokens; `want` marks its last token
    /// as one whose logits the step returns.
    pub fn push_seq(
        &mut self,
        table: &[u32],
        block_tokens: usize,
        start: usize,
        tokens: &[u32],
        want: bool,
    ) -> Result<()> {
        let end = start + tokens.len();
        if tokens.is_empty() || block_tokens == 0 || table.len() * block_tokens < end {
            return Err(shape(
                "step",
                format!(
                    "{} tokens after {start} with {} blocks of {block_tokens}",
                    tokens.len(),
                    table.len()
                ),
            ));
        }
        self.seqs.push(StepSeq {
            first: self.tokens.len(),
            len: tokens.len(),
            start,
            table_offset: self.tables.len(),
            table_len: table.len(),
        });
        self.tables.extend_from_slice(table);
        self.tokens.extend_from_slice(tokens);
        for pos in start..end {
            self.positions.push(pos);
            let block = table[pos / block_tokens] as usize;
            self.slots.push(block * block_tokens + pos % block_tokens);
        }
        if want {
            self.want.push(self.tokens.len() - 1);
        }
        Ok(())
    }

    /// The block table of sequence `i`.
    pub fn table(&self, i: usize) -> &[u32] {
        let s = &self.seqs[i];
        &self.tables[s.table_offset..s.table_offset + s.table_len]
    }

    /// Every token as an attention query (positions `0..=pos` of its sequence), in order.
    pub fn queries(&self) -> Vec<AttnQuery<'_>> {
        let mut out = Vec::with_capacity(self.len());
        for (i, s) in self.seqs.iter().enumerate() {
            let table = self.table(i);
            out.extend((0..s.len).map(|j| AttnQuery {
                block_table: table,
                n_ctx: s.start + j + 1,
            }));
        }
        out
    }
}

/// A compute backend for the forward pass. Every kernel validates the lengths it is given
/// and returns an error rather than reading or writing out of bounds.
pub trait Backend {
    /// f32 activations (and norm weights).
    type Buf;
    /// A weight matrix in the backend's form (GGUF bytes or a repacked copy on the host,
    /// a device copy on a GPU).
    type Weight;
    /// Rope cos/sin table.
    type Rope;
    /// All layers' paged K and V pools.
    type Kv;
    /// One step's inputs as the kernels read them ([`Backend::prepare_step`]).
    type Step;
    /// Working memory of [`Backend::matmul`] (quantized activations), allocated with the
    /// activation buffers so that a step allocates nothing.
    type Scratch;

    fn name(&self) -> &'static str;

    // ---- memory ----

    /// A buffer of `n` zeros.
    fn zeros(&self, n: usize) -> Result<Self::Buf>;
    fn upload(&self, values: &[f32]) -> Result<Self::Buf>;
    /// The first `n` values of `buf` on the host.
    fn to_host(&self, buf: &Self::Buf, n: usize) -> Result<Vec<f32>>;
    fn load_weight(&self, m: &HostMatrix) -> Result<Self::Weight>;
    /// Whether the weight [`Backend::load_weight`] makes of `m` keeps reading `m`'s bytes.
    /// When it does not (a repacked or uploaded copy), the caller may drop those bytes'
    /// pages from memory.
    fn holds_host_bytes(&self, m: &HostMatrix) -> bool {
        let _ = m;
        true
    }
    /// A matrix only ever read a row at a time by [`Backend::embed`] (an untied token
    /// embedding): a backend that repacks weights for its products need not.
    fn load_table(&self, m: &HostMatrix) -> Result<Self::Weight> {
        self.load_weight(m)
    }
    fn load_rope(&self, table: &RopeTable) -> Result<Self::Rope>;
    fn alloc_kv(&self, spec: &PagedKvSpec) -> Result<Self::Kv>;
    /// Scratch for products of up to `values` input values (tokens × columns).
    fn scratch(&self, values: usize) -> Result<Self::Scratch>;

    /// Turn a step description into step inputs; checks every block id against `kv`.
    fn prepare_step(&self, desc: StepDesc, kv: &Self::Kv) -> Result<Self::Step>;
    /// End a step: the step's inputs may be freed once the work reading them is done.
    fn finish_step(&self, step: Self::Step) -> Result<()>;

    // ---- kernels ----

    /// `out[t] = dequantized row step.tokens[t]` of `table`, for the first `n` tokens.
    fn embed(
        &self,
        table: &Self::Weight,
        step: &Self::Step,
        n: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;

    /// Row-wise RMS norm of `rows` rows of `w`'s length: `out = x / sqrt(mean(x²) + eps) · w`.
    fn rmsnorm(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        eps: f32,
        rows: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;

    /// For each `ws[i]`: `outs[i][t·rows + r] = Σ_c W[r][c] · x[t·cols + c]` for `n_tok`
    /// tokens. The matrices share `cols`, and one quantization of `x` (quantized weights
    /// multiply Q8 activation blocks, float weights f32 activations).
    fn matmul<const N: usize>(
        &self,
        ws: [&Self::Weight; N],
        x: &Self::Buf,
        n_tok: usize,
        outs: [&mut Self::Buf; N],
        scratch: &mut Self::Scratch,
    ) -> Result<()>;

    /// Rotate the first `rope.rot_dim()` dims of every head of the first `n_tok` tokens
    /// in place, each at its step position.
    fn rope(
        &self,
        x: &mut Self::Buf,
        n_tok: usize,
        n_heads: usize,
        head_dim: usize,
        step: &Self::Step,
        rope: &Self::Rope,
    ) -> Result<()>;

    /// Store the first `n_tok` tokens' K and V rows (f32, `kv_dim` each) of `layer` at
    /// their step slots, converted to the pool's type.
    fn kv_store(
        &self,
        kv: &mut Self::Kv,
        layer: usize,
        k: &Self::Buf,
        v: &Self::Buf,
        step: &Self::Step,
        n_tok: usize,
    ) -> Result<()>;

    /// Causal attention of every query token of the step over `layer` of `kv`
    /// (scale `1/sqrt(head_dim)`, GQA and the sliding window as in [`AttnShape`]).
    fn attention(
        &self,
        shape: &AttnShape,
        q: &Self::Buf,
        step: &Self::Step,
        kv: &Self::Kv,
        layer: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;

    /// RMS norm in place of `rows` rows of `w`'s length (the per-head norms of Q and K:
    /// rows are heads), the same bits as [`Backend::rmsnorm`] into another buffer.
    fn rmsnorm_in_place(
        &self,
        x: &mut Self::Buf,
        w: &Self::Buf,
        eps: f32,
        rows: usize,
    ) -> Result<()>;

    /// `x[r] += bias` for the first `rows` rows of `bias`'s length (projection biases).
    fn add_bias(&self, x: &mut Self::Buf, bias: &Self::Buf, rows: usize) -> Result<()>;

    /// `x[..n] *= s` (Gemma's embedding scale).
    fn scale(&self, x: &mut Self::Buf, s: f32, n: usize) -> Result<()>;

    /// `gate[..n] = silu(gate) · up` (SwiGLU).
    fn silu_mul(&self, gate: &mut Self::Buf, up: &Self::Buf, n: usize) -> Result<()>;

    /// `gate[..n] = gelu_tanh(gate) · up` (GeGLU, [`crate::Kernels::gelu_mul`]).
    fn gelu_mul(&self, gate: &mut Self::Buf, up: &Self::Buf, n: usize) -> Result<()>;

    /// `x[..n] += y`.
    fn add(&self, x: &mut Self::Buf, y: &Self::Buf, n: usize) -> Result<()>;

    /// `dst[r] = src[step.want[r]]` for the first `n` wanted tokens, rows of `dim`.
    fn gather_wanted(
        &self,
        src: &Self::Buf,
        step: &Self::Step,
        n: usize,
        dim: usize,
        dst: &mut Self::Buf,
    ) -> Result<()>;

    // ---- KV transfer ----

    /// Append the first `n_tok` positions of the sequence with block table `table`, in
    /// the transfer layout (per layer: K rows of every position, then V rows), to `out`.
    fn kv_gather(
        &self,
        kv: &Self::Kv,
        table: &[u32],
        n_tok: usize,
        out: &mut Vec<u8>,
    ) -> Result<()>;

    /// Inverse of [`Backend::kv_gather`]: write `body` into the blocks of `table`.
    fn kv_scatter(&self, kv: &mut Self::Kv, table: &[u32], n_tok: usize, body: &[u8])
    -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_positions_slots_and_queries_come_from_the_tables() {
        let mut s = StepDesc::default();
        // Sequence A: 5 tokens held in blocks [7, 2] of 4, 2 new tokens (positions 5, 6).
        s.push_seq(&[7, 2], 4, 5, &[10, 11], true).unwrap();
        // Sequence B: a 3-token prompt in block [0], no logits.
        s.push_seq(&[0], 4, 0, &[1, 2, 3], false).unwrap();
        assert_eq!(s.tokens, [10, 11, 1, 2, 3]);
        assert_eq!(s.positions, [5, 6, 0, 1, 2]);
        assert_eq!(s.slots, [2 * 4 + 1, 2 * 4 + 2, 0, 1, 2]);
        assert_eq!(s.want, [1]);
        assert_eq!(s.table(1), &[0]);
        let q: Vec<_> = s
            .queries()
            .iter()
            .map(|q| (q.block_table, q.n_ctx))
            .collect();
        assert_eq!(
            q,
            [
                (&[7u32, 2][..], 6),
                (&[7, 2][..], 7),
                (&[0][..], 1),
                (&[0][..], 2),
                (&[0][..], 3)
            ]
        );
        // A table too short for the new tokens, and an empty entry, are refused.
        assert!(s.push_seq(&[1], 4, 3, &[5, 6], true).is_err());
        assert!(s.push_seq(&[1], 4, 0, &[], true).is_err());
        assert_eq!(s.len(), 5, "a refused sequence adds nothing");
    }

    #[test]
    fn host_matrices_check_their_range_and_size() {
        let bytes: SharedBytes = Arc::new(vec![0u8; 100]);
        let m = HostMatrix::new(GgmlType::F32, 2, 4, bytes.clone(), 60, 32).unwrap();
        assert_eq!(m.matrix().data.len(), 32);
        assert!(HostMatrix::new(GgmlType::F32, 2, 4, bytes.clone(), 80, 32).is_err());
        assert!(HostMatrix::new(GgmlType::F32, 2, 4, bytes.clone(), 0, 31).is_err());
        assert!(HostMatrix::new(GgmlType::F32, 2, 4, bytes, usize::MAX, 32).is_err());
        let tied = m.clone();
        assert!(m.same_bytes(&tied));
    }

    #[test]
    fn kv_specs_refuse_what_no_backend_stores() {
        let ok = PagedKvSpec {
            ty: GgmlType::F16,
            n_layers: 30,
            kv_dim: 192,
            block_tokens: 16,
            n_blocks: 2048,
        };
        ok.check().unwrap();
        assert_eq!(ok.pool_bytes().unwrap(), 2048 * 16 * 384);
        for bad in [
            PagedKvSpec {
                ty: GgmlType::Q4_1,
                ..ok
            },
            PagedKvSpec { n_blocks: 0, ..ok },
            PagedKvSpec {
                block_tokens: 0,
                ..ok
            },
            PagedKvSpec {
                n_layers: usize::MAX,
                ..ok
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
        let err = PagedKvSpec {
            ty: GgmlType::Q4_1,
            ..ok
        }
        .check()
        .unwrap_err()
        .to_string();
        assert!(err.contains("Q4_1"), "{err}");
    }
}
