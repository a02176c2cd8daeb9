//! `CudaModelRunner`: the Llama forward pass entirely on a CUDA device (feature `cuda`).
//!
//! Weights are uploaded once, in their GGUF formats; the paged KV pool lives on the
//! device with the CPU cache's layout (`tandem_kernels::cuda::DeviceKv`), so KV export
//! and import produce and accept exactly the CPU runner's `TKV1` payloads. Per step only
//! token ids, positions, slot and block-table indices go in; logits (or, through
//! [`CudaModelRunner::step_greedy`], token ids) come out.
//!
//! The step mirrors `forward.rs` operation for operation (same Q8 activation quantization
//! before quantized products, same rope table values, same KV encoding), so greedy outputs
//! match the CPU runner's within float-summation noise.
//!
//! Not done: CUDA graphs for decode steps (the per-step host work is small uploads; the
//! kernels are already captured-safe since the context runs without event tracking).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use tandem_kernels::cuda::{
    CudaDevice, CudaSlice, DeviceKv, DeviceMatrix, DeviceRope, HostQuery, launch,
};
use tandem_kernels::{AttnShape, Matrix, RopeStyle, RopeTable, ScalarKernels};

use super::config::LlamaConfig;
use super::runner::{CpuModelRunner, RunnerConfig};
use super::weights::Weights;
use super::{KV_EXPORT_MAGIC, KV_EXPORT_VERSION};
use crate::engine_api::{KvUsage, ModelInfo, ModelRunner, SeqId, StepInput};
use crate::error::{Error, Result};
use crate::gguf::Gguf;

/// The `TKV1` header size (see `kv_transfer.rs`).
const KV_HEADER: usize = 32;

/// Host-side block accounting for the device pool, with `PagedKvCache`'s semantics:
/// all-or-nothing reservations, most recently freed blocks reused first.
#[derive(Debug)]
struct BlockAllocator {
    block_tokens: usize,
    n_blocks: usize,
    free: Vec<u32>,
    seqs: HashMap<SeqId, (Vec<u32>, usize)>,
}

impl BlockAllocator {
    fn new(block_tokens: usize, n_blocks: usize) -> Self {
        Self {
            block_tokens,
            n_blocks,
            free: (0..n_blocks as u32).rev().collect(),
            seqs: HashMap::new(),
        }
    }

    fn len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.1)
    }

    fn table(&self, seq: SeqId) -> &[u32] {
        self.seqs.get(&seq).map_or(&[], |s| &s.0)
    }

    fn needed(&self, seq: SeqId, total: usize) -> usize {
        let have = self.seqs.get(&seq).map_or(0, |s| s.0.len());
        total.div_ceil(self.block_tokens).saturating_sub(have)
    }

    fn reserve(&mut self, seq: SeqId, total: usize) -> Result<()> {
        let needed = self.needed(seq, total);
        if needed > self.free.len() {
            return Err(Error::KvCacheFull {
                needed,
                free: self.free.len(),
            });
        }
        let at = self.free.len() - needed;
        let st = self.seqs.entry(seq).or_default();
        st.0.extend(self.free.drain(at..).rev());
        Ok(())
    }

    fn set_len(&mut self, seq: SeqId, len: usize) {
        if let Some(st) = self.seqs.get_mut(&seq) {
            st.1 = len;
        }
    }

    fn release(&mut self, seq: SeqId) {
        if let Some((blocks, _)) = self.seqs.remove(&seq) {
            self.free.extend(blocks.into_iter().rev());
        }
    }

    /// Pool slot of `pos` (`block · block_tokens + pos % block_tokens`).
    fn slot(&self, seq: SeqId, pos: usize) -> Option<i64> {
        let b = *self.table(seq).get(pos / self.block_tokens)? as usize;
        Some((b * self.block_tokens + pos % self.block_tokens) as i64)
    }

    fn usage(&self) -> KvUsage {
        KvUsage {
            blocks_total: self.n_blocks,
            blocks_used: self.n_blocks - self.free.len(),
        }
    }
}

struct GpuLayer {
    attn_norm: CudaSlice<f32>,
    wq: DeviceMatrix,
    wk: DeviceMatrix,
    wv: DeviceMatrix,
    wo: DeviceMatrix,
    ffn_norm: CudaSlice<f32>,
    w_gate: DeviceMatrix,
    w_up: DeviceMatrix,
    w_down: DeviceMatrix,
}

/// Activation buffers sized for `cap` tokens and `want_cap` logits rows; grown (never
/// shrunk) when a step is larger. Logits are sized apart because a long prompt chunk
/// needs one row, not one per token.
struct Buffers {
    cap: usize,
    want_cap: usize,
    x: CudaSlice<f32>,
    h: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    att: CudaSlice<f32>,
    o: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    xq: CudaSlice<u8>,
    last: CudaSlice<f32>,
    normed: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    ids: CudaSlice<u32>,
}

impl Buffers {
    fn new(dev: &CudaDevice, c: &LlamaConfig, cap: usize, want_cap: usize) -> Result<Self> {
        let widest = c.dim.max(c.q_dim()).max(c.ffn_dim);
        Ok(Self {
            cap,
            want_cap,
            x: dev.zeros(cap * c.dim)?,
            h: dev.zeros(cap * c.dim)?,
            q: dev.zeros(cap * c.q_dim())?,
            k: dev.zeros(cap * c.kv_dim())?,
            v: dev.zeros(cap * c.kv_dim())?,
            att: dev.zeros(cap * c.q_dim())?,
            o: dev.zeros(cap * c.dim)?,
            gate: dev.zeros(cap * c.ffn_dim)?,
            up: dev.zeros(cap * c.ffn_dim)?,
            xq: dev.zeros(launch::q8_bytes(cap * widest))?,
            last: dev.zeros(want_cap * c.dim)?,
            normed: dev.zeros(want_cap * c.dim)?,
            logits: dev.zeros(want_cap * c.vocab_size)?,
            ids: dev.zeros(want_cap)?,
        })
    }
}

pub struct CudaModelRunner {
    cfg: LlamaConfig,
    info: ModelInfo,
    dev: CudaDevice,
    token_embd: DeviceMatrix,
    /// `None` when the output projection is tied to the token embedding.
    output: Option<DeviceMatrix>,
    output_norm: CudaSlice<f32>,
    layers: Vec<GpuLayer>,
    rope: DeviceRope,
    kv: DeviceKv,
    blocks: BlockAllocator,
    bufs: Buffers,
}

impl std::fmt::Debug for CudaModelRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaModelRunner")
            .field("info", &self.info)
            .field("device", self.dev.info())
            .finish()
    }
}

fn upload_matrix(dev: &CudaDevice, m: Matrix<'_>) -> Result<DeviceMatrix> {
    Ok(dev.upload_matrix(&m)?)
}

impl CudaModelRunner {
    /// Load a GGUF file onto CUDA device `ordinal`. Without a driver or device this is a
    /// clear `Error::Kernel(Cuda(..))` ("no CUDA driver: libcuda.so.1 not found", ...).
    pub fn load(path: &Path, rc: RunnerConfig, ordinal: usize) -> Result<Self> {
        // Probe before reading a model of possibly many GB.
        tandem_kernels::cuda::probe(ordinal)?;
        let g = Gguf::open(path)?;
        let fallback = path.file_stem().map(|s| s.to_string_lossy().into_owned());
        let mut r = Self::new(Arc::new(g), rc, ordinal)?;
        if r.info.name.is_empty() {
            r.info.name = fallback.unwrap_or_default();
        }
        Ok(r)
    }

    pub fn new(g: Arc<Gguf>, rc: RunnerConfig, ordinal: usize) -> Result<Self> {
        let dev = CudaDevice::new(ordinal)?;
        // ModelInfo (above all the fingerprint the PD handshake compares) must be the CPU
        // runner's exactly, so a CPU prefill and a GPU decode accept each other: take it
        // from a CPU runner with a one-block cache rather than re-deriving it.
        let probe_rc = RunnerConfig::with_kv_tokens(1, rc.kv.dtype);
        let cpu = CpuModelRunner::new(Arc::clone(&g), probe_rc, Arc::new(ScalarKernels))?;
        let cfg = cpu.config().clone();
        let mut info = cpu.info().clone();
        info.kv_block_size = rc.kv.block_tokens;
        drop(cpu);

        let w = Weights::load(Arc::clone(&g), &cfg)?;
        let file = w.file();
        let token_embd = upload_matrix(&dev, w.token_embd.matrix(file))?;
        let tied = w.output.matrix(file).data.as_ptr() == w.token_embd.matrix(file).data.as_ptr();
        let output = if tied {
            None
        } else {
            Some(upload_matrix(&dev, w.output.matrix(file))?)
        };
        let layers = w
            .layers
            .iter()
            .map(|l| {
                Ok(GpuLayer {
                    attn_norm: dev.upload(&l.attn_norm)?,
                    wq: upload_matrix(&dev, l.wq.matrix(file))?,
                    wk: upload_matrix(&dev, l.wk.matrix(file))?,
                    wv: upload_matrix(&dev, l.wv.matrix(file))?,
                    wo: upload_matrix(&dev, l.wo.matrix(file))?,
                    ffn_norm: dev.upload(&l.ffn_norm)?,
                    w_gate: upload_matrix(&dev, l.w_gate.matrix(file))?,
                    w_up: upload_matrix(&dev, l.w_up.matrix(file))?,
                    w_down: upload_matrix(&dev, l.w_down.matrix(file))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // The same table the CPU runner builds (runner.rs): llama uses the "normal" rope.
        let table = RopeTable::new(
            RopeStyle::Normal,
            cfg.rope_dim,
            cfg.rope_base,
            cfg.context_length,
        )?;
        let rope = dev.upload_rope(&table)?;
        let kv = dev.alloc_kv(
            rc.kv.dtype,
            cfg.n_layers,
            cfg.kv_dim(),
            rc.kv.block_tokens,
            rc.kv.n_blocks,
        )?;
        let bufs = Buffers::new(&dev, &cfg, 64, 32)?;
        dev.synchronize()?;
        Ok(Self {
            output_norm: dev.upload(&w.output_norm)?,
            info,
            token_embd,
            output,
            layers,
            rope,
            kv,
            blocks: BlockAllocator::new(rc.kv.block_tokens, rc.kv.n_blocks),
            bufs,
            cfg,
            dev,
        })
    }

    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    fn validate(&self, batch: &[StepInput]) -> Result<()> {
        super::runner::validate_step(
            batch,
            &self.cfg,
            |seq| self.blocks.len(seq),
            |seq, total| self.blocks.needed(seq, total),
            self.blocks.free.len(),
        )
    }

    /// Run the batch through the model; leaves the logits of the `want_logits` entries in
    /// `bufs.logits` (rows in batch order) and returns how many there are.
    fn forward(&mut self, batch: &[StepInput]) -> Result<usize> {
        self.validate(batch)?;
        for b in batch {
            let total = self.blocks.len(b.seq) + b.tokens.len();
            self.blocks.reserve(b.seq, total)?;
        }
        let c = &self.cfg;
        let (dim, qd, ffn, vocab) = (c.dim, c.q_dim(), c.ffn_dim, c.vocab_size);
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut slots = Vec::new();
        let mut want = Vec::new();
        let mut runs = Vec::with_capacity(batch.len());
        for b in batch {
            let start = self.blocks.len(b.seq);
            runs.push(launch::QueryRun {
                first: tokens.len(),
                len: b.tokens.len(),
                table_offset: 0,
            });
            for (j, &t) in b.tokens.iter().enumerate() {
                tokens.push(t);
                positions.push((start + j) as i32);
                slots.push(self.blocks.slot(b.seq, start + j).ok_or_else(|| {
                    Error::InvalidInput(format!("{:?}: no block for {}", b.seq, start + j))
                })?);
            }
            if b.want_logits {
                want.push((tokens.len() - 1) as u32);
            }
        }
        let n = tokens.len();
        let queries: Vec<HostQuery<'_>> = batch
            .iter()
            .flat_map(|b| {
                let start = self.blocks.len(b.seq);
                let table = self.blocks.table(b.seq);
                (0..b.tokens.len()).map(move |j| HostQuery {
                    table,
                    n_ctx: start + j + 1,
                })
            })
            .collect();
        if n > self.bufs.cap || want.len() > self.bufs.want_cap {
            let cap = n.max(self.bufs.cap).next_power_of_two();
            let want_cap = want.len().max(self.bufs.want_cap).next_power_of_two();
            self.bufs = Buffers::new(&self.dev, c, cap, want_cap)?;
        }
        let d = &self.dev;
        let plan = d.attn_plan(&queries, &runs, &self.kv)?;
        let tok_d = d.upload(&tokens)?;
        let pos_d = d.upload(&positions)?;
        let slot_d = d.upload(&slots)?;
        let want_d = d.upload(&want)?;
        let shape = AttnShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
        };
        let bf = &mut self.bufs;
        d.embed(
            &self.token_embd,
            &tok_d.as_view(),
            n,
            &mut bf.x.as_view_mut(),
        )?;
        for (l, lw) in self.layers.iter().enumerate() {
            d.rmsnorm(
                &bf.x.as_view(),
                &lw.attn_norm.as_view(),
                c.rms_eps,
                n,
                &mut bf.h.as_view_mut(),
            )?;
            d.quantize_q8(&bf.h.as_view(), n * dim, &mut bf.xq.as_view_mut())?;
            let (h, xq) = (bf.h.as_view(), bf.xq.as_view());
            d.matmul(&lw.wq, &h, &xq, n, &mut bf.q.as_view_mut())?;
            d.matmul(&lw.wk, &h, &xq, n, &mut bf.k.as_view_mut())?;
            d.matmul(&lw.wv, &h, &xq, n, &mut bf.v.as_view_mut())?;
            let pos = pos_d.as_view();
            d.rope(
                &mut bf.q.as_view_mut(),
                n,
                c.n_heads,
                c.head_dim,
                &pos,
                &self.rope,
            )?;
            d.rope(
                &mut bf.k.as_view_mut(),
                n,
                c.n_kv_heads,
                c.head_dim,
                &pos,
                &self.rope,
            )?;
            d.kv_store(
                &mut self.kv,
                l,
                &bf.k.as_view(),
                &bf.v.as_view(),
                &slot_d.as_view(),
                n,
            )?;
            d.attention(
                &shape,
                &bf.q.as_view(),
                &plan,
                &self.kv,
                l,
                &mut bf.att.as_view_mut(),
            )?;
            d.quantize_q8(&bf.att.as_view(), n * qd, &mut bf.xq.as_view_mut())?;
            d.matmul(
                &lw.wo,
                &bf.att.as_view(),
                &bf.xq.as_view(),
                n,
                &mut bf.o.as_view_mut(),
            )?;
            d.add(&mut bf.x.as_view_mut(), &bf.o.as_view(), n * dim)?;

            d.rmsnorm(
                &bf.x.as_view(),
                &lw.ffn_norm.as_view(),
                c.rms_eps,
                n,
                &mut bf.h.as_view_mut(),
            )?;
            d.quantize_q8(&bf.h.as_view(), n * dim, &mut bf.xq.as_view_mut())?;
            let (h, xq) = (bf.h.as_view(), bf.xq.as_view());
            d.matmul(&lw.w_gate, &h, &xq, n, &mut bf.gate.as_view_mut())?;
            d.matmul(&lw.w_up, &h, &xq, n, &mut bf.up.as_view_mut())?;
            d.silu_mul(&mut bf.gate.as_view_mut(), &bf.up.as_view(), n * ffn)?;
            d.quantize_q8(&bf.gate.as_view(), n * ffn, &mut bf.xq.as_view_mut())?;
            d.matmul(
                &lw.w_down,
                &bf.gate.as_view(),
                &bf.xq.as_view(),
                n,
                &mut bf.o.as_view_mut(),
            )?;
            d.add(&mut bf.x.as_view_mut(), &bf.o.as_view(), n * dim)?;
        }
        let nw = want.len();
        if nw > 0 {
            d.gather_rows(
                &bf.x.as_view(),
                &want_d.as_view(),
                nw,
                dim,
                &mut bf.last.as_view_mut(),
            )?;
            d.rmsnorm(
                &bf.last.as_view(),
                &self.output_norm.as_view(),
                c.rms_eps,
                nw,
                &mut bf.normed.as_view_mut(),
            )?;
            let out_w = self.output.as_ref().unwrap_or(&self.token_embd);
            if out_w.ty.is_quantized() {
                d.quantize_q8(&bf.normed.as_view(), nw * dim, &mut bf.xq.as_view_mut())?;
            }
            d.matmul(
                out_w,
                &bf.normed.as_view(),
                &bf.xq.as_view(),
                nw,
                &mut bf.logits.as_view_mut(),
            )?;
        }
        debug_assert!(bf.logits.len() >= nw * vocab);
        for b in batch {
            let len = self.blocks.len(b.seq) + b.tokens.len();
            self.blocks.set_len(b.seq, len);
        }
        // The uploads above are freed on return; finish the work that reads them first.
        d.synchronize()?;
        Ok(nw)
    }

    /// Like [`ModelRunner::step`], but sampling greedily on the device: only the token ids
    /// of the `want_logits` entries come back.
    pub fn step_greedy(&mut self, batch: &[StepInput]) -> Result<Vec<Option<u32>>> {
        let nw = self.forward(batch)?;
        let vocab = self.cfg.vocab_size;
        let d = &self.dev;
        d.argmax(
            &self.bufs.logits.as_view(),
            nw,
            vocab,
            &mut self.bufs.ids.as_view_mut(),
        )?;
        let ids = d.download(&self.bufs.ids.as_view(), nw)?;
        let mut it = ids.into_iter();
        Ok(batch
            .iter()
            .map(|b| if b.want_logits { it.next() } else { None })
            .collect())
    }
}

/// Parse and check a `TKV1` header against this runner; returns the token count.
fn check_kv_header(p: &[u8], cfg: &LlamaConfig, kv: &DeviceKv) -> Result<usize> {
    let bad = |m: String| Error::KvTransfer(m);
    if p.len() < KV_HEADER || &p[..4] != KV_EXPORT_MAGIC {
        return Err(bad("payload lacks the TKV1 header".into()));
    }
    let field = |at: usize| u32::from_le_bytes([p[at], p[at + 1], p[at + 2], p[at + 3]]);
    if field(4) != KV_EXPORT_VERSION {
        return Err(bad(format!(
            "layout version {}, expected {KV_EXPORT_VERSION}",
            field(4)
        )));
    }
    let ours = [
        cfg.n_layers as u32,
        cfg.n_kv_heads as u32,
        cfg.head_dim as u32,
        kv.ty.id(),
    ];
    let theirs = [field(8), field(12), field(16), field(20)];
    if ours != theirs {
        return Err(bad(format!(
            "layout (layers, kv heads, head dim, dtype) {theirs:?} does not match ours {ours:?}"
        )));
    }
    let n = u64::from_le_bytes(p[24..32].try_into().expect("8 bytes"));
    let want = (n as u128) * (cfg.n_layers as u128) * 2 * kv.row_bytes as u128 + KV_HEADER as u128;
    if want != p.len() as u128 {
        return Err(bad(format!(
            "{} bytes for {n} tokens, expected {want}",
            p.len()
        )));
    }
    if n as usize > cfg.context_length {
        return Err(bad(format!(
            "{n} tokens exceed the context length {}",
            cfg.context_length
        )));
    }
    Ok(n as usize)
}

impl ModelRunner for CudaModelRunner {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> Result<()> {
        if total_tokens > self.cfg.context_length {
            return Err(Error::InvalidInput(format!(
                "{total_tokens} tokens exceed the context length {}",
                self.cfg.context_length
            )));
        }
        self.blocks.reserve(seq, total_tokens)
    }

    fn step(&mut self, batch: &[StepInput]) -> Result<Vec<Option<Vec<f32>>>> {
        let nw = self.forward(batch)?;
        let vocab = self.cfg.vocab_size;
        let logits = self.dev.download(&self.bufs.logits.as_view(), nw * vocab)?;
        Ok(super::runner::split_logits(batch, &logits, vocab))
    }

    fn seq_len(&self, seq: SeqId) -> usize {
        self.blocks.len(seq)
    }

    fn free(&mut self, seq: SeqId) {
        self.blocks.release(seq);
    }

    fn kv_usage(&self) -> KvUsage {
        self.blocks.usage()
    }

    fn export_kv(&self, seq: SeqId) -> Result<Vec<u8>> {
        if !self.blocks.seqs.contains_key(&seq) {
            return Err(Error::InvalidInput(format!("export of unknown {seq:?}")));
        }
        let n = self.blocks.len(seq);
        let body = self.dev.kv_gather(&self.kv, self.blocks.table(seq), n)?;
        let mut out = Vec::with_capacity(KV_HEADER + body.len());
        out.extend_from_slice(KV_EXPORT_MAGIC);
        for v in [
            KV_EXPORT_VERSION,
            self.cfg.n_layers as u32,
            self.cfg.n_kv_heads as u32,
            self.cfg.head_dim as u32,
            self.kv.ty.id(),
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(n as u64).to_le_bytes());
        out.extend_from_slice(&body);
        Ok(out)
    }

    fn import_kv(&mut self, seq: SeqId, payload: &[u8]) -> Result<()> {
        let n = check_kv_header(payload, &self.cfg, &self.kv)?;
        if self.blocks.len(seq) != 0 {
            return Err(Error::KvTransfer(format!("{seq:?} already holds tokens")));
        }
        let existed = self.blocks.seqs.contains_key(&seq);
        self.blocks.reserve(seq, n)?;
        let table = self.blocks.table(seq).to_vec();
        if let Err(e) = self
            .dev
            .kv_scatter(&mut self.kv, &table, n, &payload[KV_HEADER..])
        {
            if !existed {
                self.blocks.release(seq);
            }
            return Err(e.into());
        }
        self.blocks.set_len(seq, n);
        Ok(())
    }
}

/// Which runner `--device` asks for (`cpu`, `cuda`, `cuda:N`); see
/// `tandem_kernels::cuda::parse_device`.
pub fn load_runner(device: &str, path: &Path, rc: RunnerConfig) -> Result<Box<dyn ModelRunner>> {
    match tandem_kernels::cuda::parse_device(device)? {
        None => Ok(Box::new(CpuModelRunner::load(path, rc)?)),
        Some(n) => Ok(Box::new(CudaModelRunner::load(path, rc, n)?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocator_matches_the_cpu_cache_semantics() {
        let mut a = BlockAllocator::new(4, 5);
        let (s1, s2) = (SeqId(1), SeqId(2));
        a.reserve(s1, 9).unwrap();
        assert_eq!(a.usage().blocks_used, 3);
        assert_eq!(a.table(s1), &[0, 1, 2]);
        match a.reserve(s2, 12) {
            Err(Error::KvCacheFull { needed: 3, free: 2 }) => {}
            other => panic!("{other:?}"),
        }
        assert!(a.table(s2).is_empty(), "a failed reserve creates nothing");
        a.reserve(s2, 8).unwrap();
        assert_eq!(a.slot(s2, 5), Some((a.table(s2)[1] as i64) * 4 + 1));
        assert_eq!(a.slot(s2, 8), None);
        a.set_len(s1, 9);
        assert_eq!(a.len(s1), 9);
        a.release(s1);
        a.release(s1);
        assert_eq!(a.usage().blocks_used, 2);
        // Most recently freed blocks come back first, in the same order.
        a.reserve(SeqId(3), 8).unwrap();
        assert_eq!(a.table(SeqId(3)), &[0, 1]);
    }

    fn load_err(device: &str, path: &str) -> String {
        match load_runner(device, Path::new(path), RunnerConfig::default()) {
            Ok(_) => panic!("{device} loaded {path}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn cuda_device_without_a_driver_is_a_clear_error() {
        // On machines without a driver (CI) loading must fail with the probe's message,
        // never panic; the model path is not even opened.
        if tandem_kernels::cuda::probe(0).is_ok() {
            return; // a GPU machine: the GPU tests below cover loading
        }
        let err = load_err("cuda", "/nonexistent.gguf");
        assert!(
            err.contains("libcuda.so.1 not found") || err.contains("no device"),
            "{err}"
        );
        let err = load_err("tpu", "/x");
        assert!(err.contains("cpu, cuda or cuda:N"), "{err}");
    }

    // ---- GPU only (feature `gpu-tests`): compiled and linted in CI, run by
    // tests/gpu/run.sh; they fail (never skip) without a device. ----

    #[cfg(feature = "gpu-tests")]
    mod gpu {
        use super::*;

        fn gpu_runner(kv_tokens: usize) -> CudaModelRunner {
            let rc = RunnerConfig::with_kv_tokens(kv_tokens, tandem_kernels::GgmlType::F16);
            CudaModelRunner::load(&crate::test_support::model_path(), rc, 0)
                .unwrap_or_else(|e| panic!("GPU test without a usable CUDA device: {e}"))
        }

        fn prompts() -> Vec<Vec<u32>> {
            // Five prompts as token ids: "The capital of France is", then arbitrary valid ids
            // of various lengths (40 tokens spans several prefill tiles and 3 KV blocks).
            vec![
                vec![504, 3575, 282, 4649, 314],
                vec![1780, 314, 253, 1345, 30, 378, 436],
                vec![2683, 253, 2283, 563, 2066, 28, 216, 31, 28],
                vec![504, 1345, 282, 3807, 314],
                (1..=40).map(|i| 100 + 37 * i).collect(),
            ]
        }

        fn argmax(v: &[f32]) -> u32 {
            let mut best = 0;
            for (i, x) in v.iter().enumerate() {
                if *x > v[best] {
                    best = i;
                }
            }
            best as u32
        }

        fn greedy<R: ModelRunner + ?Sized>(
            r: &mut R,
            seq: u64,
            prompt: &[u32],
            n: usize,
        ) -> Vec<u32> {
            let step = |r: &mut R, toks: Vec<u32>| {
                let out = r
                    .step(&[StepInput {
                        seq: SeqId(seq),
                        tokens: toks,
                        want_logits: true,
                    }])
                    .unwrap();
                argmax(out[0].as_ref().unwrap())
            };
            let mut toks = vec![step(r, prompt.to_vec())];
            while toks.len() < n {
                let t = step(r, vec![*toks.last().unwrap()]);
                toks.push(t);
            }
            toks
        }

        #[test]
        fn gpu_greedy_equals_cpu_for_five_prompts() {
            let mut gpu = gpu_runner(4096);
            let rc = RunnerConfig::with_kv_tokens(4096, tandem_kernels::GgmlType::F16);
            let mut cpu = CpuModelRunner::load(&crate::test_support::model_path(), rc).unwrap();
            assert_eq!(gpu.info(), cpu.info(), "same ModelInfo and fingerprint");
            for (i, p) in prompts().iter().enumerate() {
                let want = greedy(&mut cpu, i as u64, p, 32);
                let got = greedy(&mut gpu, i as u64, p, 32);
                assert_eq!(got, want, "prompt {i}");
            }
            assert_eq!(
                greedy(&mut gpu, 99, &prompts()[0], 2),
                vec![7042, 30],
                "Paris."
            );
            // Device-side greedy agrees with host argmax over downloaded logits.
            let mut g2 = gpu_runner(1024);
            let mut ids = vec![];
            let mut next = prompts()[1].clone();
            for _ in 0..8 {
                let out = g2
                    .step_greedy(&[StepInput {
                        seq: SeqId(1),
                        tokens: next,
                        want_logits: true,
                    }])
                    .unwrap();
                let t = out[0].unwrap();
                ids.push(t);
                next = vec![t];
            }
            assert_eq!(ids, greedy(&mut cpu, 50, &prompts()[1], 8));
        }

        #[test]
        fn gpu_kv_export_imports_into_cpu_and_back() {
            let mut gpu = gpu_runner(2048);
            let rc = RunnerConfig::with_kv_tokens(2048, tandem_kernels::GgmlType::F16);
            let mut cpu = CpuModelRunner::load(&crate::test_support::model_path(), rc).unwrap();
            let p = &prompts()[2];
            let first = greedy(&mut gpu, 1, p, 1)[0];
            let payload = gpu.export_kv(SeqId(1)).unwrap();
            let cpu_payload = {
                greedy(&mut cpu, 7, p, 1);
                cpu.export_kv(SeqId(7)).unwrap()
            };
            assert_eq!(payload.len(), cpu_payload.len());
            assert_eq!(payload[..32], cpu_payload[..32], "identical TKV1 header");
            // GPU prefill -> CPU decode and CPU prefill -> GPU decode continue identically.
            cpu.import_kv(SeqId(2), &payload).unwrap();
            gpu.import_kv(SeqId(3), &cpu_payload).unwrap();
            let a = greedy(&mut cpu, 2, &[first], 16);
            let b = greedy(&mut gpu, 3, &[first], 16);
            let c = greedy(&mut gpu, 1, &[first], 16);
            assert_eq!(a, c);
            assert_eq!(b, c);
            assert!(
                gpu.import_kv(SeqId(3), &payload).is_err(),
                "sequence not empty"
            );
            assert!(
                gpu.import_kv(SeqId(4), &payload[..40]).is_err(),
                "truncated"
            );
        }

        #[test]
        fn gpu_throughput() {
            use std::time::Instant;
            let mut r = gpu_runner(64 * 1024);
            // Prompt throughput: 8 sequences of 512 tokens in 256-token chunks.
            let chunk: Vec<u32> = (0..256).map(|i| 200 + (i * 13) % 4000).collect();
            r.step_greedy(&[StepInput {
                seq: SeqId(999),
                tokens: chunk.clone(),
                want_logits: true,
            }])
            .unwrap(); // warm-up
            r.free(SeqId(999));
            let t = Instant::now();
            for s in 0..8u64 {
                for c in 0..2 {
                    r.step_greedy(&[StepInput {
                        seq: SeqId(s),
                        tokens: chunk.clone(),
                        want_logits: c == 1,
                    }])
                    .unwrap();
                }
            }
            let prompt_tps = 8.0 * 512.0 / t.elapsed().as_secs_f64();
            for s in 0..8u64 {
                r.free(SeqId(s));
            }
            println!("prompt: {prompt_tps:.0} tok/s (8 x 512 tokens, 256-token chunks)");
            for conc in [1usize, 32] {
                let mut next: Vec<u32> = vec![0; conc];
                for (s, n) in next.iter_mut().enumerate() {
                    let out = r
                        .step_greedy(&[StepInput {
                            seq: SeqId(1000 + s as u64),
                            tokens: prompts()[s % 5].clone(),
                            want_logits: true,
                        }])
                        .unwrap();
                    *n = out[0].unwrap();
                }
                let steps = 64;
                let t = Instant::now();
                for _ in 0..steps {
                    let batch: Vec<StepInput> = next
                        .iter()
                        .enumerate()
                        .map(|(s, tok)| StepInput {
                            seq: SeqId(1000 + s as u64),
                            tokens: vec![*tok],
                            want_logits: true,
                        })
                        .collect();
                    let out = r.step_greedy(&batch).unwrap();
                    for (n, o) in next.iter_mut().zip(out) {
                        *n = o.unwrap();
                    }
                }
                let tps = (steps * conc) as f64 / t.elapsed().as_secs_f64();
                println!("decode: {tps:.0} tok/s at concurrency {conc} ({steps} steps)");
                for s in 0..conc {
                    r.free(SeqId(1000 + s as u64));
                }
            }
        }
    }
}
