//! [`CpuBackend`]: the [`Backend`] trait on host memory. Buffers are `Vec<f32>`, weights
//! are [`HostMatrix`] in the layout the kernels read fastest (a repacked copy of the
//! mapped file's bytes, or views into it for the layouts kept as stored), the KV pools are
//! [`HostKv`], and every kernel is a [`Kernels`] implementation's (the optimized
//! [`super::CpuKernels`] when serving, [`crate::ScalarKernels`] or exact-activation
//! variants in tests), called on exactly the prefix of each buffer a step uses.

use std::sync::Arc;

use super::pool::ThreadPool;
use crate::api::{AttnShape, Kernels, KvView};
use crate::backend::{Backend, HostMatrix, PagedKvSpec, StepDesc};
use crate::error::{Result, shape};
use crate::quant::{dequantize_row, quantize_row};
use crate::rope::RopeTable;

/// Paged K and V pools of every layer in host memory: per layer one K and one V pool of
/// `n_blocks · block_tokens` rows of `row_bytes`, the row of (block b, offset o) at
/// `(b · block_tokens + o) · row_bytes` (the same layout as the CUDA backend's pools).
///
/// Pools are allocated zeroed but untouched, so the OS commits pages only as blocks are
/// first written.
#[derive(Debug)]
pub struct HostKv {
    spec: PagedKvSpec,
    row_bytes: usize,
    k: Vec<Vec<u8>>,
    v: Vec<Vec<u8>>,
}

impl HostKv {
    pub fn new(spec: PagedKvSpec) -> Result<Self> {
        spec.check()?;
        let pool = spec.pool_bytes()?;
        Ok(Self {
            spec,
            row_bytes: spec.row_bytes()?,
            k: (0..spec.n_layers).map(|_| vec![0u8; pool]).collect(),
            v: (0..spec.n_layers).map(|_| vec![0u8; pool]).collect(),
        })
    }

    pub fn spec(&self) -> &PagedKvSpec {
        &self.spec
    }

    /// Bytes of one token's K (or V) row in one layer.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Rows in each pool.
    fn rows(&self) -> usize {
        self.spec.n_blocks * self.spec.block_tokens
    }

    /// Layer `layer`'s pools as the attention kernels read them.
    pub fn views(&self, layer: usize) -> (KvView<'_>, KvView<'_>) {
        let (ty, block_tokens) = (self.spec.ty, self.spec.block_tokens);
        (
            KvView {
                ty,
                data: &self.k[layer],
                block_tokens,
            },
            KvView {
                ty,
                data: &self.v[layer],
                block_tokens,
            },
        )
    }

    /// Pool rows of positions `0..n_tok` of a sequence with block table `table`.
    fn slots(&self, table: &[u32], n_tok: usize) -> Result<Vec<usize>> {
        let bt = self.spec.block_tokens;
        let need = n_tok.div_ceil(bt);
        if table.len() < need
            || table[..need]
                .iter()
                .any(|b| *b as usize >= self.spec.n_blocks)
        {
            return Err(shape(
                "kv transfer",
                format!(
                    "{n_tok} tokens with table {table:?} in {} blocks",
                    self.spec.n_blocks
                ),
            ));
        }
        Ok((0..n_tok)
            .map(|p| table[p / bt] as usize * bt + p % bt)
            .collect())
    }
}

/// The host backend: a [`Kernels`] implementation plus the pool that the work around the
/// kernels (KV stores, sampling) runs on.
pub struct CpuBackend {
    kernels: Arc<dyn Kernels>,
    pool: &'static ThreadPool,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("kernels", &self.kernels.name())
            .field("threads", &self.pool.threads())
            .finish()
    }
}

impl CpuBackend {
    /// On `kernels`, sharing their pool: the shared pool of the size they run on
    /// ([`Kernels::parallelism`]; the global pool for kernels without a preference).
    pub fn new(kernels: Arc<dyn Kernels>) -> Self {
        let pool = ThreadPool::shared(kernels.parallelism());
        Self { kernels, pool }
    }

    pub fn kernels(&self) -> &dyn Kernels {
        self.kernels.as_ref()
    }

    pub fn pool(&self) -> &'static ThreadPool {
        self.pool
    }
}

/// The first `n` values of `buf`, or a shape error naming `what`.
fn prefix<'a>(op: &'static str, what: &str, buf: &'a [f32], n: usize) -> Result<&'a [f32]> {
    buf.get(..n)
        .ok_or_else(|| shape(op, format!("{what}: {} values, need {n}", buf.len())))
}

fn prefix_mut<'a>(
    op: &'static str,
    what: &str,
    buf: &'a mut [f32],
    n: usize,
) -> Result<&'a mut [f32]> {
    let len = buf.len();
    buf.get_mut(..n)
        .ok_or_else(|| shape(op, format!("{what}: {len} values, need {n}")))
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Weight = HostMatrix;
    type Rope = RopeTable;
    type Kv = HostKv;
    type Step = StepDesc;
    /// The slice kernels keep their own per-thread scratch.
    type Scratch = ();

    fn name(&self) -> &'static str {
        self.kernels.name()
    }

    fn zeros(&self, n: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; n])
    }

    fn upload(&self, values: &[f32]) -> Result<Vec<f32>> {
        Ok(values.to_vec())
    }

    fn to_host(&self, buf: &Vec<f32>, n: usize) -> Result<Vec<f32>> {
        Ok(prefix("to_host", "buffer", buf, n)?.to_vec())
    }

    /// Repacked once into the layout the kernels multiply fastest (a copy of the mapped
    /// bytes when that is not GGUF's; the mapping's pages are then not read again).
    fn load_weight(&self, m: &HostMatrix) -> Result<HostMatrix> {
        m.to_layout(self.kernels.weight_layout(m.ty))
    }

    fn holds_host_bytes(&self, m: &HostMatrix) -> bool {
        self.kernels.weight_layout(m.ty) == m.layout()
    }

    /// Embedding lookups read a row per token: the mapped bytes as they are.
    fn load_table(&self, m: &HostMatrix) -> Result<HostMatrix> {
        Ok(m.clone())
    }

    fn load_rope(&self, table: &RopeTable) -> Result<RopeTable> {
        Ok(table.clone())
    }

    fn alloc_kv(&self, spec: &PagedKvSpec) -> Result<HostKv> {
        HostKv::new(*spec)
    }

    fn scratch(&self, _values: usize) -> Result<()> {
        Ok(())
    }

    fn prepare_step(&self, desc: StepDesc, kv: &HostKv) -> Result<StepDesc> {
        let n = desc.len();
        if desc.positions.len() != n || desc.slots.len() != n {
            return Err(shape(
                "step",
                format!("{n} tokens, inconsistent description"),
            ));
        }
        if let Some(s) = desc.slots.iter().find(|s| **s >= kv.rows()) {
            return Err(shape("step", format!("KV slot {s} outside {}", kv.rows())));
        }
        if let Some(w) = desc.want.iter().find(|w| **w >= n) {
            return Err(shape("step", format!("wanted token {w} of {n}")));
        }
        Ok(desc)
    }

    fn finish_step(&self, _step: StepDesc) -> Result<()> {
        Ok(())
    }

    fn embed(
        &self,
        table: &HostMatrix,
        step: &StepDesc,
        n: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let m = table.matrix();
        let out = prefix_mut("embed", "out", out, n * m.cols)?;
        let tokens = step
            .tokens
            .get(..n)
            .ok_or_else(|| shape("embed", format!("{n} of {} tokens", step.len())))?;
        for (row, &t) in out.chunks_exact_mut(m.cols).zip(tokens) {
            if t as usize >= m.rows {
                return Err(shape("embed", format!("token {t} of {}", m.rows)));
            }
            // A tied table may be repacked for the output product: `row` gathers it.
            dequantize_row(m.ty, &m.row(t as usize), row)?;
        }
        Ok(())
    }

    fn rmsnorm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        eps: f32,
        rows: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let n = rows * w.len();
        self.kernels.rmsnorm(
            prefix("rmsnorm", "x", x, n)?,
            w,
            eps,
            prefix_mut("rmsnorm", "out", out, n)?,
        )
    }

    fn matmul<const N: usize>(
        &self,
        ws: [&HostMatrix; N],
        x: &Vec<f32>,
        n_tok: usize,
        outs: [&mut Vec<f32>; N],
        _scratch: &mut (),
    ) -> Result<()> {
        let cols = ws.first().map_or(0, |w| w.cols);
        let x = prefix("matmul", "x", x, n_tok * cols)?;
        for (w, o) in ws.iter().zip(outs.iter()) {
            prefix("matmul", "out", o, n_tok * w.rows)?;
        }
        let mats = ws.map(HostMatrix::matrix);
        let mut i = 0;
        let mut outs = outs.map(|o| {
            let n = n_tok * mats[i].rows;
            i += 1;
            &mut o[..n]
        });
        self.kernels.matmul(&mats, x, n_tok, &mut outs)
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        n_tok: usize,
        n_heads: usize,
        head_dim: usize,
        step: &StepDesc,
        rope: &RopeTable,
    ) -> Result<()> {
        let positions = step
            .positions
            .get(..n_tok)
            .ok_or_else(|| shape("rope", format!("{n_tok} of {} positions", step.len())))?;
        let x = prefix_mut("rope", "x", x, n_tok * n_heads * head_dim)?;
        self.kernels.rope(x, n_heads, head_dim, positions, rope)
    }

    /// Rows are converted exactly as `quantize_row` converts one row, in parallel on the
    /// pool for batches, so a token's stored row does not depend on its batch.
    fn kv_store(
        &self,
        kv: &mut HostKv,
        layer: usize,
        k: &Vec<f32>,
        v: &Vec<f32>,
        step: &StepDesc,
        n_tok: usize,
    ) -> Result<()> {
        let (kvd, rb, ty, rows) = (kv.spec.kv_dim, kv.row_bytes, kv.spec.ty, kv.rows());
        if layer >= kv.spec.n_layers {
            return Err(shape("kv_store", format!("layer {layer}")));
        }
        let k = prefix("kv_store", "k", k, n_tok * kvd)?;
        let v = prefix("kv_store", "v", v, n_tok * kvd)?;
        let slots = step
            .slots
            .get(..n_tok)
            .ok_or_else(|| shape("kv_store", format!("{n_tok} of {} slots", step.len())))?;
        if let Some(s) = slots.iter().find(|s| **s >= rows) {
            return Err(shape("kv_store", format!("slot {s} outside {rows}")));
        }
        let (kp, vp) = (&mut kv.k[layer], &mut kv.v[layer]);
        if n_tok < 8 {
            for (i, &slot) in slots.iter().enumerate() {
                let off = slot * rb;
                quantize_row(ty, &k[i * kvd..(i + 1) * kvd], &mut kp[off..off + rb])?;
                quantize_row(ty, &v[i * kvd..(i + 1) * kvd], &mut vp[off..off + rb])?;
            }
            return Ok(());
        }
        let mut order: Vec<(usize, usize)> = slots
            .iter()
            .enumerate()
            .map(|(i, &s)| (s * rb, i))
            .collect();
        order.sort_unstable();
        if order.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err(shape(
                "kv_store",
                "two tokens of one step write the same KV slot",
            ));
        }
        // Disjoint destination rows, cut off the pools in increasing offset order.
        let mut parts = Vec::with_capacity(order.len());
        let (mut krest, mut vrest) = (&mut kp[..], &mut vp[..]);
        let mut at = 0;
        for &(off, i) in &order {
            let (_, kt) = std::mem::take(&mut krest).split_at_mut(off - at);
            let (kd, kt) = kt.split_at_mut(rb);
            let (_, vt) = std::mem::take(&mut vrest).split_at_mut(off - at);
            let (vd, vt) = vt.split_at_mut(rb);
            (krest, vrest, at) = (kt, vt, off + rb);
            parts.push((i, kd, vd));
        }
        self.pool.for_each(parts, |_, (i, kd, vd)| {
            // Sizes match (kv_dim floats into one row of the pool's type): cannot fail.
            let _ = quantize_row(ty, &k[i * kvd..(i + 1) * kvd], kd);
            let _ = quantize_row(ty, &v[i * kvd..(i + 1) * kvd], vd);
        });
        Ok(())
    }

    fn attention(
        &self,
        s: &AttnShape,
        q: &Vec<f32>,
        step: &StepDesc,
        kv: &HostKv,
        layer: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        if layer >= kv.spec.n_layers || s.kv_dim() != kv.spec.kv_dim {
            return Err(shape(
                "attention",
                format!("layer {layer}, {s:?} vs KV of dim {}", kv.spec.kv_dim),
            ));
        }
        let queries = step.queries();
        let n = queries.len() * s.q_dim();
        let (kview, vview) = kv.views(layer);
        self.kernels.attention(
            s,
            prefix("attention", "q", q, n)?,
            &queries,
            &kview,
            &vview,
            prefix_mut("attention", "out", out, n)?,
        )
    }

    fn rmsnorm_in_place(
        &self,
        x: &mut Vec<f32>,
        w: &Vec<f32>,
        eps: f32,
        rows: usize,
    ) -> Result<()> {
        let n = rows * w.len();
        self.kernels
            .rmsnorm_in_place(prefix_mut("rmsnorm_in_place", "x", x, n)?, w, eps)
    }

    fn add_bias(&self, x: &mut Vec<f32>, bias: &Vec<f32>, rows: usize) -> Result<()> {
        if bias.is_empty() {
            return Err(shape("add_bias", "an empty bias"));
        }
        let x = prefix_mut("add_bias", "x", x, rows * bias.len())?;
        for row in x.chunks_exact_mut(bias.len()) {
            row.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
        }
        Ok(())
    }

    fn scale(&self, x: &mut Vec<f32>, s: f32, n: usize) -> Result<()> {
        prefix_mut("scale", "x", x, n)?
            .iter_mut()
            .for_each(|v| *v *= s);
        Ok(())
    }

    fn silu_mul(&self, gate: &mut Vec<f32>, up: &Vec<f32>, n: usize) -> Result<()> {
        self.kernels.silu_mul(
            prefix_mut("silu_mul", "gate", gate, n)?,
            prefix("silu_mul", "up", up, n)?,
        )
    }

    fn gelu_mul(&self, gate: &mut Vec<f32>, up: &Vec<f32>, n: usize) -> Result<()> {
        self.kernels.gelu_mul(
            prefix_mut("gelu_mul", "gate", gate, n)?,
            prefix("gelu_mul", "up", up, n)?,
        )
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>, n: usize) -> Result<()> {
        let x = prefix_mut("add", "x", x, n)?;
        let y = prefix("add", "y", y, n)?;
        x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn gather_wanted(
        &self,
        src: &Vec<f32>,
        step: &StepDesc,
        n: usize,
        dim: usize,
        dst: &mut Vec<f32>,
    ) -> Result<()> {
        let want = step
            .want
            .get(..n)
            .ok_or_else(|| shape("gather", format!("{n} of {} wanted rows", step.want.len())))?;
        let dst = prefix_mut("gather", "dst", dst, n * dim)?;
        for (row, &i) in dst.chunks_exact_mut(dim).zip(want) {
            row.copy_from_slice(
                prefix("gather", "src", src, (i + 1) * dim)?
                    .split_at(i * dim)
                    .1,
            );
        }
        Ok(())
    }

    fn kv_gather(&self, kv: &HostKv, table: &[u32], n_tok: usize, out: &mut Vec<u8>) -> Result<()> {
        let slots = kv.slots(table, n_tok)?;
        let rb = kv.row_bytes;
        out.reserve(kv.spec.n_layers * 2 * n_tok * rb);
        for layer in 0..kv.spec.n_layers {
            for pool in [&kv.k[layer], &kv.v[layer]] {
                for &s in &slots {
                    out.extend_from_slice(&pool[s * rb..(s + 1) * rb]);
                }
            }
        }
        Ok(())
    }

    fn kv_scatter(&self, kv: &mut HostKv, table: &[u32], n_tok: usize, body: &[u8]) -> Result<()> {
        let slots = kv.slots(table, n_tok)?;
        let rb = kv.row_bytes;
        let want = kv.spec.n_layers * 2 * n_tok * rb;
        if body.len() != want {
            return Err(shape(
                "kv_scatter",
                format!("{} bytes, need {want}", body.len()),
            ));
        }
        let mut rows = body.chunks_exact(rb.max(1));
        for layer in 0..kv.spec.n_layers {
            for pool in [&mut kv.k[layer], &mut kv.v[layer]] {
                for &s in &slots {
                    let row = rows.next().expect("length checked above");
                    pool[s * rb..(s + 1) * rb].copy_from_slice(row);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ScalarKernels;
    use crate::api::Layout;
    use crate::types::GgmlType;

    fn spec(n_blocks: usize) -> PagedKvSpec {
        PagedKvSpec {
            ty: GgmlType::F16,
            n_layers: 2,
            kv_dim: 32,
            block_tokens: 4,
            n_blocks,
        }
    }

    #[test]
    fn the_backend_runs_on_the_pool_of_its_kernels() {
        use crate::cpu::{CpuKernels, CpuOptions};
        let k = CpuKernels::with_options(CpuOptions {
            threads: Some(3),
            simd: true,
        });
        let pool = k.pool();
        assert!(std::ptr::eq(CpuBackend::new(Arc::new(k)).pool(), pool));
        // Kernels without a preference (the scalar reference): the global pool.
        let b = CpuBackend::new(Arc::new(ScalarKernels));
        assert!(std::ptr::eq(b.pool(), ThreadPool::global()));
        let k = CpuKernels::new();
        assert!(std::ptr::eq(
            CpuBackend::new(Arc::new(k)).pool(),
            ThreadPool::global()
        ));
    }

    #[test]
    fn stores_land_in_the_step_slots_and_transfer_round_trips() {
        let b = CpuBackend::new(Arc::new(ScalarKernels));
        let mut kv = b.alloc_kv(&spec(4)).unwrap();
        let mut step = StepDesc::default();
        // Positions 4, 5 of a sequence in blocks [3, 1]: slots 1·4+0, 1·4+1.
        step.push_seq(&[3, 1], 4, 4, &[1, 2], true).unwrap();
        let step = b.prepare_step(step, &kv).unwrap();
        let k: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let v: Vec<f32> = (0..64).map(|i| -(i as f32)).collect();
        b.kv_store(&mut kv, 1, &k, &v, &step, 2).unwrap();
        let row = &kv.views(1).0.data[5 * 64..6 * 64];
        let mut back = vec![0f32; 32];
        dequantize_row(GgmlType::F16, row, &mut back).unwrap();
        assert_eq!(back, k[32..]);
        assert!(b.kv_store(&mut kv, 2, &k, &v, &step, 2).is_err(), "layer");
        assert!(
            b.kv_store(&mut kv, 1, &k[..32].to_vec(), &v, &step, 2)
                .is_err()
        );

        let mut out = b"head".to_vec();
        b.kv_gather(&kv, &[3, 1], 6, &mut out).unwrap();
        assert_eq!(
            out.len(),
            4 + 2 * 2 * 6 * 64,
            "appended after what was there"
        );
        let mut kv2 = b.alloc_kv(&spec(4)).unwrap();
        b.kv_scatter(&mut kv2, &[0, 2], 6, &out[4..]).unwrap();
        let mut again = Vec::new();
        b.kv_gather(&kv2, &[0, 2], 6, &mut again).unwrap();
        assert_eq!(again, out[4..]);
        assert!(b.kv_scatter(&mut kv2, &[0, 2], 6, &out[5..]).is_err());
        assert!(
            b.kv_gather(&kv2, &[0, 9], 6, &mut again).is_err(),
            "block 9"
        );
        assert!(
            b.kv_gather(&kv2, &[0], 6, &mut again).is_err(),
            "short table"
        );
    }

    #[test]
    fn weights_are_repacked_for_the_simd_kernels_and_tables_are_not() {
        let (rows, cols) = (13, 64);
        let ty = GgmlType::Q8_0;
        let rb = ty.row_bytes(cols).unwrap();
        let mut bytes = vec![0u8; rows * rb];
        for (r, row) in bytes.chunks_mut(rb).enumerate() {
            let x: Vec<f32> = (0..cols).map(|c| (r * cols + c) as f32 * 0.01).collect();
            quantize_row(ty, &x, row).unwrap();
        }
        let m = HostMatrix::owned(ty, rows, cols, bytes).unwrap();
        let simd = crate::CpuKernels::with_simd(true);
        let packs = simd.has_simd();
        for (b, repacked) in [
            (CpuBackend::new(Arc::new(simd)), packs),
            (CpuBackend::new(Arc::new(ScalarKernels)), false),
        ] {
            let w = b.load_weight(&m).unwrap();
            let want = if repacked {
                Layout::Rows8
            } else {
                Layout::Gguf
            };
            assert_eq!(w.layout(), want, "{}", b.name());
            assert_eq!(b.holds_host_bytes(&m), !repacked, "{}", b.name());
            assert_eq!(b.load_table(&m).unwrap().layout(), Layout::Gguf);
            // A tied table is also the output product's weight: lookups read it as is.
            let mut step = StepDesc::default();
            step.push_seq(&[0], 16, 0, &[12, 0, 7], true).unwrap();
            let (mut got, mut want) = (vec![0f32; 3 * cols], vec![0f32; 3 * cols]);
            b.embed(&w, &step, 3, &mut got).unwrap();
            b.embed(&m, &step, 3, &mut want).unwrap();
            assert_eq!(got, want, "{}", b.name());
            assert_eq!(want[cols], 0.0, "row 0 holds 0.0 first");
            assert!(want[..cols].iter().all(|v| *v > 7.0), "row 12");
        }
    }

    #[test]
    fn kernels_check_buffer_lengths_instead_of_panicking() {
        let b = CpuBackend::new(Arc::new(ScalarKernels));
        let kv = b.alloc_kv(&spec(2)).unwrap();
        let mut step = StepDesc::default();
        step.push_seq(&[0], 4, 0, &[1, 2, 3], true).unwrap();
        let step = b.prepare_step(step, &kv).unwrap();
        let w = b.upload(&[1.0; 32]).unwrap();
        let x = b.zeros(2 * 32).unwrap();
        let mut out = b.zeros(3 * 32).unwrap();
        assert!(b.rmsnorm(&x, &w, 1e-5, 3, &mut out).is_err(), "x too short");
        b.rmsnorm(&x, &w, 1e-5, 2, &mut out).unwrap();
        let m = HostMatrix::owned(GgmlType::F32, 4, 32, vec![0; 4 * 32 * 4]).unwrap();
        let mut o = b.zeros(4).unwrap();
        assert!(b.matmul([&m], &x, 2, [&mut o], &mut ()).is_err());
        assert!(b.embed(&m, &step, 3, &mut out).is_ok());
        assert!(
            b.embed(&m, &step, 4, &mut out).is_err(),
            "more tokens than the step"
        );
        let mut big = StepDesc::default();
        big.push_seq(&[0], 4, 0, &[9], true).unwrap();
        assert!(
            b.embed(&m, &big, 1, &mut out).is_err(),
            "token past the table"
        );
        let mut far = StepDesc::default();
        far.push_seq(&[5], 4, 0, &[1], true).unwrap();
        assert!(b.prepare_step(far, &kv).is_err(), "block 5 of 2");
    }
}
