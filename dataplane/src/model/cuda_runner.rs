//! `CudaModelRunner`: the Llama forward pass entirely on a CUDA device (feature `cuda`).
//!
//! Weights are uploaded once, in their GGUF formats; the paged KV pool lives on the
//! device with the CPU cache's layout (`tandem_kernels::cuda::DeviceKv`), so KV export
//! and import produce and accept exactly the CPU runner's `TKV1` payloads. Per step only
//! token ids, positions, slot and block-table indices go in; token ids come out
//! ([`ModelRunner::step_sample`]), or logits ([`ModelRunner::step`]).
//!
//! The step mirrors `forward.rs` operation for operation (same Q8 activation quantization
//! before quantized products, same rope table values, same KV encoding), so greedy outputs
//! match the CPU runner's within float-summation noise.
//!
//! Sampling on the device (`step_sample`, [`CudaOptions::device_sampling`]): greedy,
//! temperature, top-k and top-p run in `tandem_sample` (sampling.cu) with the host
//! sampler's semantics; per row only the parameters and one uniform number go in, drawn
//! on the host from the request's seeded RNG ([`Sampler::draw`]), so a seed gives the same
//! tokens as host sampling of the same logits, up to float rounding of the
//! probabilities. The kernel materialises the 256 best candidates; a row whose
//! decision needs a candidate past them (the top-p prefix or, with top_p = 1, the draw
//! lands in the tail) is finished on the host from that row's logits with the same draw,
//! so there is no candidate cap in the results. Rows of requests asking for logprobs
//! copy their logits to the host and use `Sampler::sample` (the logprobs need the whole
//! row). Counted in [`SamplingStats`].
//!
//! CUDA graphs for decode steps ([`CudaOptions::graphs`], `TANDEM_CUDA_GRAPHS=1`; off by
//! default until checked on a GPU): a step whose entries are all one token with logits,
//! at most 64 of them, runs as a graph captured for its batch-size bucket (1, 2, 4, 8,
//! 16, 24, 32, 48, 64) over fixed input buffers (`DecodeInputs`: tokens, positions, KV
//! slots, context lengths, block tables), refreshed by copies before each replay; the
//! batch is padded to the bucket with rows that write no KV and whose outputs are
//! dropped. Every other step (prompt chunks, mixed steps, larger batches) and a bucket
//! whose capture failed (logged, counted in [`GraphStats`]) runs launch by launch.
//! Graphs hold the activation buffers by address, so growing those drops the graphs (they
//! are captured again on use); sampling runs after the replay, outside the graph.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use tandem_kernels::cuda::launch::{self, DecodeRow, SampleRow};
use tandem_kernels::cuda::{
    CudaDevice, CudaSlice, CudaView, DecodeInputs, DeviceAttnPlan, DeviceGraph, DeviceKv,
    DeviceMatrix, DeviceRope, HostQuery,
};
use tandem_kernels::{AttnShape, Matrix, RopeStyle, RopeTable, ScalarKernels};

use super::config::LlamaConfig;
use super::runner::{CpuModelRunner, RunnerConfig};
use super::weights::Weights;
use super::{KV_EXPORT_MAGIC, KV_EXPORT_VERSION};
use crate::engine_api::{
    KvUsage, ModelInfo, ModelRunner, Sampled, SeqId, StepInput, check_samplers, sample_on_host,
};
use crate::error::{Error, Result};
use crate::gguf::Gguf;
use crate::sampling::{Sampler, SamplingParams};

/// The `TKV1` header size (see `kv_transfer.rs`).
const KV_HEADER: usize = 32;

/// Batch sizes decode graphs are captured for. A decode step of `n` sequences replays
/// the graph of the smallest bucket `>= n`. 16 is a bucket so that a batch of up to
/// `launch::MMV_MAX_TOKENS` rows is never padded past it: the padded graph runs the same
/// matrix kernels as the batch would without a graph.
pub const GRAPH_BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 24, 32, 48, 64];

/// The largest decode batch that runs as a graph.
pub const GRAPH_MAX_BATCH: usize = GRAPH_BUCKETS[GRAPH_BUCKETS.len() - 1];

/// The graph bucket of a decode step of `n` sequences; `None` for 0 or above the largest.
pub fn graph_bucket(n: usize) -> Option<usize> {
    GRAPH_BUCKETS.iter().copied().find(|&b| n > 0 && b >= n)
}

/// Whether a step is a pure decode step (every entry one token, with logits) that a graph
/// can replay, and its bucket.
fn decode_bucket(batch: &[StepInput]) -> Option<usize> {
    if batch.iter().all(|b| b.tokens.len() == 1 && b.want_logits) {
        graph_bucket(batch.len())
    } else {
        None
    }
}

/// Block-table entries of a graph step's inputs: each of `rows` sequences may use a whole
/// context's blocks, plus the padding rows' one entry.
fn decode_table_cap(rows: usize, context_length: usize, block_tokens: usize) -> usize {
    rows * context_length.div_ceil(block_tokens.max(1)) + 1
}

/// New (token, logits-row) capacities of the activation buffers when a step of `n`
/// tokens and `nw` logits rows does not fit `(cap, want_cap)`; they only grow, to powers
/// of two.
fn grown_caps(cap: usize, want_cap: usize, n: usize, nw: usize) -> Option<(usize, usize)> {
    (n > cap || nw > want_cap).then(|| {
        (
            n.max(cap).next_power_of_two(),
            nw.max(want_cap).next_power_of_two(),
        )
    })
}

/// Parse an on/off environment switch; unset or empty is `default`.
fn parse_switch(name: &str, value: Option<&str>, default: bool) -> Result<bool> {
    match value.map(str::trim) {
        None | Some("") => Ok(default),
        Some("1" | "on" | "true" | "yes") => Ok(true),
        Some("0" | "off" | "false" | "no") => Ok(false),
        Some(other) => Err(Error::Model(format!(
            "{name}={other:?}: expected 1/on/true/yes or 0/off/false/no"
        ))),
    }
}

/// Run-time switches of the CUDA runner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// `step_sample` samples on the device and copies only token ids back
    /// (`TANDEM_CUDA_SAMPLING`, default on). Off: it copies every logits row back and
    /// samples on the host, exactly like `step` + `Sampler::sample`.
    pub device_sampling: bool,
    /// Decode steps replay CUDA graphs (`TANDEM_CUDA_GRAPHS`, default off: the capture
    /// path has not yet run on a GPU; `tests/gpu/run.sh` checks it).
    pub graphs: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            device_sampling: true,
            graphs: false,
        }
    }
}

impl CudaOptions {
    /// From `TANDEM_CUDA_SAMPLING` and `TANDEM_CUDA_GRAPHS` (1/on/true/yes, 0/off/false/no;
    /// unset: the defaults). Any other value is an error, never silently ignored.
    pub fn from_env() -> Result<Self> {
        let var = |n: &str| std::env::var(n).ok();
        Self::from_values(
            var("TANDEM_CUDA_SAMPLING").as_deref(),
            var("TANDEM_CUDA_GRAPHS").as_deref(),
        )
    }

    fn from_values(sampling: Option<&str>, graphs: Option<&str>) -> Result<Self> {
        let d = Self::default();
        Ok(Self {
            device_sampling: parse_switch("TANDEM_CUDA_SAMPLING", sampling, d.device_sampling)?,
            graphs: parse_switch("TANDEM_CUDA_GRAPHS", graphs, d.graphs)?,
        })
    }
}

/// How decode graphs fared since load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GraphStats {
    /// Graphs captured (one per bucket, again after an invalidation).
    pub captured: u64,
    /// Steps run by replaying a graph.
    pub replayed: u64,
    /// Captures that failed (each logged; that bucket then runs without a graph).
    pub capture_failures: u64,
    /// Times all graphs were dropped because the activation buffers grew.
    pub invalidated: u64,
}

/// Where `step_sample` sampled its rows since load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SamplingStats {
    /// Decided by the device: only the token id was copied back.
    pub device_rows: u64,
    /// Left to the host by the device (beyond its candidates, or no finite logit); the
    /// row's logits were copied back and sampled with the same draw.
    pub deferred_rows: u64,
    /// Sampled on the host from the start (logprobs requested, parameters the kernel does
    /// not take, or device sampling switched off).
    pub host_rows: u64,
}

/// How `tandem_sample` takes a request's rows; `None`: on the host. Requests asking for
/// logprobs need the whole row of logits; and a 1/T that is not finite and positive or a
/// NaN top_p would not mean on the device what it means to the host sampler. The uniform
/// number is filled in per row.
fn device_row(p: &SamplingParams) -> Option<SampleRow> {
    if p.logprobs.is_some() {
        return None;
    }
    if p.temperature <= 0.0 {
        return Some(SampleRow::GREEDY);
    }
    // Exactly the host sampler's scale factor, so the scaled logits are the same bits.
    let inv = 1.0 / p.temperature;
    if !(inv.is_finite() && inv > 0.0) || p.top_p.is_nan() {
        return None;
    }
    Some(SampleRow {
        inv_temperature: inv,
        top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
        top_p: p.top_p,
        uniform: 0.0,
    })
}

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

/// Everything of the model on the device except the KV pool.
struct GpuWeights {
    token_embd: DeviceMatrix,
    /// `None` when the output projection is tied to the token embedding.
    output: Option<DeviceMatrix>,
    output_norm: CudaSlice<f32>,
    layers: Vec<GpuLayer>,
    rope: DeviceRope,
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
    /// Sampling parameters, `launch::SAMPLE_WORDS` per logits row.
    sample_params: CudaSlice<u32>,
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
            sample_params: dev.zeros(want_cap * launch::SAMPLE_WORDS)?,
        })
    }
}

/// Decode graphs by bucket, over one set of fixed inputs.
#[derive(Default)]
struct DecodeGraphs {
    inputs: Option<DecodeInputs>,
    graphs: HashMap<usize, DeviceGraph>,
    /// Buckets whose capture failed: not tried again (until the options change).
    failed: HashSet<usize>,
    stats: GraphStats,
}

/// A step's per-token inputs and attention plan on the device.
struct StepIo<'a> {
    tokens: CudaView<'a, u32>,
    positions: CudaView<'a, i32>,
    slots: CudaView<'a, i64>,
    want: CudaView<'a, u32>,
    plan: &'a DeviceAttnPlan,
}

/// Enqueue the forward pass of `n` tokens whose `nw` logits rows (`io.want`) end up in
/// `bf.logits`: kernel launches only, so that it can also be captured into a graph.
#[allow(clippy::too_many_arguments)]
fn encode_forward(
    d: &CudaDevice,
    c: &LlamaConfig,
    w: &GpuWeights,
    kv: &mut DeviceKv,
    bf: &mut Buffers,
    io: &StepIo<'_>,
    n: usize,
    nw: usize,
) -> Result<()> {
    let (dim, qd, ffn) = (c.dim, c.q_dim(), c.ffn_dim);
    let shape = AttnShape {
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
    };
    d.embed(&w.token_embd, &io.tokens, n, &mut bf.x.as_view_mut())?;
    for (l, lw) in w.layers.iter().enumerate() {
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
        d.rope(
            &mut bf.q.as_view_mut(),
            n,
            c.n_heads,
            c.head_dim,
            &io.positions,
            &w.rope,
        )?;
        d.rope(
            &mut bf.k.as_view_mut(),
            n,
            c.n_kv_heads,
            c.head_dim,
            &io.positions,
            &w.rope,
        )?;
        d.kv_store(kv, l, &bf.k.as_view(), &bf.v.as_view(), &io.slots, n)?;
        d.attention(
            &shape,
            &bf.q.as_view(),
            io.plan,
            kv,
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
    if nw > 0 {
        d.gather_rows(
            &bf.x.as_view(),
            &io.want,
            nw,
            dim,
            &mut bf.last.as_view_mut(),
        )?;
        d.rmsnorm(
            &bf.last.as_view(),
            &w.output_norm.as_view(),
            c.rms_eps,
            nw,
            &mut bf.normed.as_view_mut(),
        )?;
        let out_w = w.output.as_ref().unwrap_or(&w.token_embd);
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
    Ok(())
}

pub struct CudaModelRunner {
    cfg: LlamaConfig,
    info: ModelInfo,
    dev: CudaDevice,
    w: GpuWeights,
    kv: DeviceKv,
    blocks: BlockAllocator,
    bufs: Buffers,
    opts: CudaOptions,
    graphs: DecodeGraphs,
    sampling: SamplingStats,
}

impl std::fmt::Debug for CudaModelRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaModelRunner")
            .field("info", &self.info)
            .field("device", self.dev.info())
            .field("options", &self.opts)
            .finish()
    }
}

fn upload_matrix(dev: &CudaDevice, m: Matrix<'_>) -> Result<DeviceMatrix> {
    Ok(dev.upload_matrix(&m)?)
}

impl CudaModelRunner {
    /// Load a GGUF file onto CUDA device `ordinal`. Without a driver or device this is a
    /// clear `Error::Kernel(Cuda(..))` ("no CUDA driver: libcuda.so.1 not found", ...).
    /// Options come from the environment ([`CudaOptions::from_env`]).
    pub fn load(path: &Path, rc: RunnerConfig, ordinal: usize) -> Result<Self> {
        let opts = CudaOptions::from_env()?;
        // Probe before reading a model of possibly many GB.
        tandem_kernels::cuda::probe(ordinal)?;
        let g = Gguf::open(path)?;
        let fallback = path.file_stem().map(|s| s.to_string_lossy().into_owned());
        let mut r = Self::new(Arc::new(g), rc, ordinal)?;
        r.set_options(opts);
        if r.info.name.is_empty() {
            r.info.name = fallback.unwrap_or_default();
        }
        Ok(r)
    }

    /// A runner with the default [`CudaOptions`].
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
        let output_norm = dev.upload(&w.output_norm)?;
        dev.synchronize()?;
        Ok(Self {
            info,
            w: GpuWeights {
                token_embd,
                output,
                output_norm,
                layers,
                rope,
            },
            kv,
            blocks: BlockAllocator::new(rc.kv.block_tokens, rc.kv.n_blocks),
            bufs,
            cfg,
            dev,
            opts: CudaOptions::default(),
            graphs: DecodeGraphs::default(),
            sampling: SamplingStats::default(),
        })
    }

    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    pub fn options(&self) -> CudaOptions {
        self.opts
    }

    /// Change the options; switching graphs off (or on again) drops the captured graphs
    /// and forgets failed captures.
    pub fn set_options(&mut self, opts: CudaOptions) {
        if opts.graphs != self.opts.graphs {
            self.graphs.graphs.clear();
            self.graphs.failed.clear();
        }
        tracing::info!(
            device_sampling = opts.device_sampling,
            graphs = opts.graphs,
            "CUDA runner options"
        );
        self.opts = opts;
    }

    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.stats
    }

    pub fn sampling_stats(&self) -> SamplingStats {
        self.sampling
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

    /// Validate a step and reserve the blocks of its new tokens (all or nothing; again
    /// for a step that was already admitted, it is a no-op).
    fn admit(&mut self, batch: &[StepInput]) -> Result<()> {
        self.validate(batch)?;
        for b in batch {
            let total = self.blocks.len(b.seq) + b.tokens.len();
            self.blocks.reserve(b.seq, total)?;
        }
        Ok(())
    }

    /// Make the activation buffers hold `n` tokens and `nw` logits rows. Growing them
    /// moves them, so the captured graphs (which hold their addresses) are dropped.
    fn ensure_buffers(&mut self, n: usize, nw: usize) -> Result<()> {
        if let Some((cap, want_cap)) = grown_caps(self.bufs.cap, self.bufs.want_cap, n, nw) {
            self.bufs = Buffers::new(&self.dev, &self.cfg, cap, want_cap)?;
            if !self.graphs.graphs.is_empty() {
                tracing::info!(
                    graphs = self.graphs.graphs.len(),
                    cap,
                    want_cap,
                    "CUDA decode graphs dropped: the activation buffers grew (captured again on use)"
                );
                self.graphs.graphs.clear();
                self.graphs.stats.invalidated += 1;
            }
        }
        Ok(())
    }

    fn finish_step(&mut self, batch: &[StepInput]) {
        for b in batch {
            let len = self.blocks.len(b.seq) + b.tokens.len();
            self.blocks.set_len(b.seq, len);
        }
    }

    /// Run the batch through the model; leaves the logits of the `want_logits` entries in
    /// `bufs.logits` (rows in batch order) and returns how many there are. Decode steps
    /// replay a graph when graphs are on.
    fn forward(&mut self, batch: &[StepInput]) -> Result<usize> {
        if self.opts.graphs
            && let Some(bucket) = decode_bucket(batch)
            && !self.graphs.failed.contains(&bucket)
            && let Some(nw) = self.forward_graph(batch, bucket)?
        {
            return Ok(nw);
        }
        self.forward_plain(batch)
    }

    /// A decode step by graph replay. `Ok(None)`: this bucket's capture failed (logged and
    /// counted); the caller runs the step without a graph.
    fn forward_graph(&mut self, batch: &[StepInput], bucket: usize) -> Result<Option<usize>> {
        self.admit(batch)?;
        // Sized once for every bucket, so that later captures do not move them.
        self.ensure_buffers(GRAPH_MAX_BATCH, GRAPH_MAX_BATCH)?;
        if self.graphs.inputs.is_none() {
            let table_cap = decode_table_cap(
                GRAPH_MAX_BATCH,
                self.cfg.context_length,
                self.blocks.block_tokens,
            );
            self.graphs.inputs = Some(self.dev.alloc_decode_inputs(GRAPH_MAX_BATCH, table_cap)?);
        }
        let rows: Vec<DecodeRow<'_>> = batch
            .iter()
            .map(|b| DecodeRow {
                token: b.tokens[0],
                position: self.blocks.len(b.seq),
                table: self.blocks.table(b.seq),
            })
            .collect();
        let inputs = self.graphs.inputs.as_mut().expect("allocated above");
        self.dev
            .write_decode_inputs(inputs, &self.kv, &rows, bucket)?;
        if !self.graphs.graphs.contains_key(&bucket) {
            let inputs = self.graphs.inputs.as_ref().expect("allocated above");
            let io = StepIo {
                tokens: inputs.tokens(),
                positions: inputs.positions(),
                slots: inputs.slots(),
                want: inputs.want(),
                plan: inputs.plan(),
            };
            let (d, c, w) = (&self.dev, &self.cfg, &self.w);
            let (kv, bf) = (&mut self.kv, &mut self.bufs);
            match d.capture(|| encode_forward(d, c, w, kv, bf, &io, bucket, bucket)) {
                Ok(g) => {
                    tracing::info!(bucket, "captured a CUDA graph for decode steps");
                    self.graphs.graphs.insert(bucket, g);
                    self.graphs.stats.captured += 1;
                }
                Err(e) => {
                    tracing::warn!(
                        bucket,
                        error = %e,
                        "CUDA graph capture failed: decode steps of this size run without a graph"
                    );
                    self.graphs.failed.insert(bucket);
                    self.graphs.stats.capture_failures += 1;
                    return Ok(None);
                }
            }
        }
        let g = self.graphs.graphs.get(&bucket).expect("captured above");
        self.dev.launch_graph(g)?;
        self.graphs.stats.replayed += 1;
        self.finish_step(batch);
        // Inputs live in fixed buffers: nothing to wait for before returning.
        Ok(Some(batch.len()))
    }

    /// Any step, launch by launch.
    fn forward_plain(&mut self, batch: &[StepInput]) -> Result<usize> {
        self.admit(batch)?;
        let n: usize = batch.iter().map(|b| b.tokens.len()).sum();
        let nw = batch.iter().filter(|b| b.want_logits).count();
        self.ensure_buffers(n, nw)?;
        let mut tokens = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        let mut slots = Vec::with_capacity(n);
        let mut want = Vec::with_capacity(nw);
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
        let d = &self.dev;
        let plan = d.attn_plan(&queries, &runs, &self.kv)?;
        let tok_d = d.upload(&tokens)?;
        let pos_d = d.upload(&positions)?;
        let slot_d = d.upload(&slots)?;
        let want_d = d.upload(&want)?;
        let io = StepIo {
            tokens: tok_d.as_view(),
            positions: pos_d.as_view(),
            slots: slot_d.as_view(),
            want: want_d.as_view(),
            plan: &plan,
        };
        encode_forward(
            d,
            &self.cfg,
            &self.w,
            &mut self.kv,
            &mut self.bufs,
            &io,
            n,
            nw,
        )?;
        debug_assert!(self.bufs.logits.len() >= nw * self.cfg.vocab_size);
        // The uploads above are freed on return; finish the work that reads them first.
        d.synchronize()?;
        self.finish_step(batch);
        Ok(nw)
    }

    /// Row `r` of the last step's logits, copied to the host.
    fn logits_row(&self, r: usize) -> Result<Vec<f32>> {
        let vocab = self.cfg.vocab_size;
        Ok(self
            .dev
            .download(&self.bufs.logits.slice(r * vocab..(r + 1) * vocab), vocab)?)
    }

    /// Sample the `nw` logits rows of the last forward step (the `want_logits` entries of
    /// `batch`, in order) for `step_sample`.
    fn sample_rows(
        &mut self,
        batch: &[StepInput],
        samplers: &mut [&mut Sampler],
        nw: usize,
    ) -> Result<Vec<Option<Sampled>>> {
        let vocab = self.cfg.vocab_size;
        let owners: Vec<usize> = (0..batch.len()).filter(|&j| batch[j].want_logits).collect();
        if owners.len() != nw {
            return Err(Error::Model(format!(
                "{nw} logits rows for {} entries that want them",
                owners.len()
            )));
        }
        // Per row: `Some(draw)` when the device samples it (the draw is made now, in the
        // place `Sampler::sample` would make it), `None` when the host does.
        let mut draws: Vec<Option<Option<f32>>> = Vec::with_capacity(nw);
        let mut rows = Vec::with_capacity(nw);
        for &j in &owners {
            let s = &mut *samplers[j];
            match device_row(s.params()) {
                Some(mut row) => {
                    let u = s.draw();
                    row.uniform = u.unwrap_or(0.0);
                    rows.push(row);
                    draws.push(Some(u));
                }
                None => {
                    rows.push(SampleRow::GREEDY);
                    draws.push(None);
                }
            }
        }
        let mut ids = vec![launch::SAMPLE_DEFER; nw];
        if draws.iter().any(Option::is_some) {
            let d = &self.dev;
            d.upload_into(
                &launch::pack_sample_rows(&rows),
                &mut self.bufs.sample_params,
            )?;
            d.sample(
                &self.bufs.logits.as_view(),
                nw,
                vocab,
                &self.bufs.sample_params.as_view(),
                &mut self.bufs.ids.as_view_mut(),
            )?;
            ids = d.download(&self.bufs.ids.as_view(), nw)?;
        }
        let mut out: Vec<Option<Sampled>> = vec![None; batch.len()];
        for (r, &j) in owners.iter().enumerate() {
            let s = &mut *samplers[j];
            out[j] = Some(match draws[r] {
                Some(_) if ids[r] != launch::SAMPLE_DEFER => {
                    if ids[r] as usize >= vocab {
                        return Err(Error::Model(format!(
                            "the device sampler returned token {} (vocabulary of {vocab})",
                            ids[r]
                        )));
                    }
                    self.sampling.device_rows += 1;
                    // Device rows never ask for logprobs (see `device_row`).
                    (ids[r], None)
                }
                Some(u) => {
                    self.sampling.deferred_rows += 1;
                    tracing::debug!(row = r, "device sampler deferred a row to the host");
                    s.sample_drawn(&self.logits_row(r)?, u)
                }
                None => {
                    self.sampling.host_rows += 1;
                    s.sample(&self.logits_row(r)?)
                }
            });
        }
        Ok(out)
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

    /// Samples on the device (see the module docs); with device sampling off, exactly
    /// the default (`step` + `Sampler::sample`).
    fn step_sample(
        &mut self,
        batch: &[StepInput],
        samplers: &mut [&mut Sampler],
    ) -> Result<Vec<Option<Sampled>>> {
        check_samplers(batch, samplers)?;
        if !self.opts.device_sampling {
            let out = self.step(batch)?;
            self.sampling.host_rows += out.iter().flatten().count() as u64;
            return Ok(sample_on_host(out, samplers));
        }
        let nw = self.forward(batch)?;
        self.sample_rows(batch, samplers, nw)
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

    #[test]
    fn graph_buckets_cover_every_batch_and_keep_the_matrix_kernel() {
        assert_eq!(graph_bucket(0), None);
        assert_eq!(graph_bucket(GRAPH_MAX_BATCH + 1), None);
        let mut prev = 0;
        for n in 1..=GRAPH_MAX_BATCH {
            let b = graph_bucket(n).unwrap();
            assert!(b >= n && b >= prev, "{n} -> {b}");
            assert!(GRAPH_BUCKETS.contains(&b));
            // The smallest such bucket: the one below is too small.
            let i = GRAPH_BUCKETS.iter().position(|x| *x == b).unwrap();
            assert!(i == 0 || GRAPH_BUCKETS[i - 1] < n);
            // Padding never switches a batch from the warp-per-row to the tiled kernels,
            // so graph and plain steps compute the real rows with the same kernels.
            assert_eq!(
                n <= launch::MMV_MAX_TOKENS,
                b <= launch::MMV_MAX_TOKENS,
                "{n} -> {b}"
            );
            prev = b;
        }
        assert_eq!(
            [1, 2, 3, 5, 16, 17, 25, 33, 49, 64].map(|n| graph_bucket(n).unwrap()),
            [1, 2, 4, 8, 16, 24, 32, 48, 64, 64]
        );
        // Only pure decode steps: one token each, all with logits.
        let e = |n: usize, want: bool| StepInput {
            seq: SeqId(n as u64),
            tokens: vec![1; n],
            want_logits: want,
        };
        assert_eq!(
            decode_bucket(&[e(1, true), e(1, true), e(1, true)]),
            Some(4)
        );
        assert_eq!(decode_bucket(&[e(1, true), e(2, true)]), None, "mixed");
        assert_eq!(decode_bucket(&[e(1, false)]), None, "no logits");
        assert_eq!(decode_bucket(&vec![e(1, true); 65]), None, "too large");
    }

    #[test]
    fn buffer_sizing_for_graphs_and_steps() {
        // SmolLM2: context 8192 in 16-token blocks: 512 entries per row, plus padding.
        assert_eq!(decode_table_cap(64, 8192, 16), 64 * 512 + 1);
        assert_eq!(decode_table_cap(1, 10, 4), 3 + 1);
        // Growth only when needed, to powers of two, never shrinking either capacity.
        assert_eq!(grown_caps(64, 32, 64, 32), None);
        assert_eq!(grown_caps(64, 32, 65, 1), Some((128, 32)));
        assert_eq!(grown_caps(64, 32, 1, 33), Some((64, 64)));
        assert_eq!(grown_caps(64, 32, 300, 40), Some((512, 64)));
        // Sizing for the largest bucket up front covers every bucket.
        let (cap, want) = grown_caps(64, 32, GRAPH_MAX_BATCH, GRAPH_MAX_BATCH).unwrap();
        for b in GRAPH_BUCKETS {
            assert_eq!(grown_caps(cap, want, b, b), None, "bucket {b}");
        }
    }

    #[test]
    fn options_come_from_on_off_switches() {
        let d = CudaOptions::from_values(None, None).unwrap();
        assert_eq!(d, CudaOptions::default());
        assert!(
            d.device_sampling && !d.graphs,
            "graphs off until checked on a GPU"
        );
        let o = CudaOptions::from_values(Some("off"), Some("1")).unwrap();
        assert!(!o.device_sampling && o.graphs);
        let o = CudaOptions::from_values(Some(" true "), Some("")).unwrap();
        assert!(o.device_sampling && !o.graphs);
        let err = CudaOptions::from_values(None, Some("maybe"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("TANDEM_CUDA_GRAPHS=\"maybe\""), "{err}");
    }

    #[test]
    fn sampling_parameters_pack_for_the_device_like_the_host_reads_them() {
        let p =
            |temperature: f32, top_k: usize, top_p: f32, logprobs: Option<usize>| SamplingParams {
                temperature,
                top_k,
                top_p,
                seed: Some(1),
                logprobs,
            };
        assert_eq!(device_row(&p(0.0, 5, 0.5, None)), Some(SampleRow::GREEDY));
        assert_eq!(device_row(&p(-1.0, 0, 1.0, None)), Some(SampleRow::GREEDY));
        let r = device_row(&p(0.7, 40, 0.9, None)).unwrap();
        // The very bits the host multiplies by (sampling.rs: `1.0 / temperature`).
        assert_eq!(r.inv_temperature.to_bits(), (1.0f32 / 0.7).to_bits());
        assert_eq!((r.top_k, r.top_p, r.uniform), (40, 0.9, 0.0));
        assert_eq!(
            device_row(&p(1.0, usize::MAX, 1.0, None)).unwrap().top_k,
            u32::MAX,
            "larger than any vocabulary: no cut, as on the host"
        );
        // On the host: logprobs, and parameters the kernel would read differently.
        assert_eq!(device_row(&p(0.0, 0, 1.0, Some(2))), None);
        assert_eq!(device_row(&p(1.0, 0, 1.0, Some(0))), None);
        assert_eq!(device_row(&p(f32::NAN, 0, 1.0, None)), None);
        assert_eq!(device_row(&p(f32::INFINITY, 0, 1.0, None)), None);
        assert_eq!(device_row(&p(1e-40, 0, 1.0, None)), None, "1/T overflows");
        assert_eq!(device_row(&p(1.0, 0, f32::NAN, None)), None);
        let words = launch::pack_sample_rows(&[SampleRow { uniform: 0.5, ..r }]);
        assert_eq!(words.len(), launch::SAMPLE_WORDS);
        assert_eq!(f32::from_bits(words[3]), 0.5);
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
            for (graphs, conc) in [
                (false, 1usize),
                (true, 1),
                (false, 32),
                (true, 32),
                (false, 64),
                (true, 64),
            ] {
                r.set_options(CudaOptions {
                    graphs,
                    device_sampling: true,
                });
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
                // One untimed step: a graph's capture happens on its bucket's first use.
                let warm: Vec<StepInput> = next
                    .iter()
                    .enumerate()
                    .map(|(s, tok)| StepInput {
                        seq: SeqId(1000 + s as u64),
                        tokens: vec![*tok],
                        want_logits: true,
                    })
                    .collect();
                for (n, o) in next.iter_mut().zip(r.step_greedy(&warm).unwrap()) {
                    *n = o.unwrap();
                }
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
                let mode = if graphs { "on" } else { "off" };
                println!(
                    "decode: {tps:.0} tok/s at concurrency {conc} ({steps} steps, CUDA graphs {mode})"
                );
                for s in 0..conc {
                    r.free(SeqId(1000 + s as u64));
                }
            }
            let st = r.graph_stats();
            println!("graphs: {st:?}");
            assert_eq!(st.capture_failures, 0, "{st:?}");
        }

        /// Greedy through `step_sample` (the serving path).
        fn greedy_sampled(r: &mut CudaModelRunner, seq: u64, prompt: &[u32], n: usize) -> Vec<u32> {
            let mut s = Sampler::new(SamplingParams {
                temperature: 0.0,
                ..Default::default()
            });
            let mut toks = Vec::new();
            let mut next = prompt.to_vec();
            while toks.len() < n {
                let out = r
                    .step_sample(
                        &[StepInput {
                            seq: SeqId(seq),
                            tokens: next,
                            want_logits: true,
                        }],
                        &mut [&mut s],
                    )
                    .unwrap();
                let t = out[0].as_ref().unwrap().0;
                toks.push(t);
                next = vec![t];
            }
            toks
        }

        #[test]
        fn gpu_step_sample_greedy_equals_cpu_with_and_without_graphs() {
            let rc = RunnerConfig::with_kv_tokens(4096, tandem_kernels::GgmlType::F16);
            let mut cpu = CpuModelRunner::load(&crate::test_support::model_path(), rc).unwrap();
            let want: Vec<Vec<u32>> = prompts()
                .iter()
                .enumerate()
                .map(|(i, p)| greedy(&mut cpu, i as u64, p, 32))
                .collect();
            for graphs in [false, true] {
                let mut g = gpu_runner(4096);
                g.set_options(CudaOptions {
                    graphs,
                    device_sampling: true,
                });
                for (i, p) in prompts().iter().enumerate() {
                    let got = greedy_sampled(&mut g, i as u64, p, 32);
                    assert_eq!(got, want[i], "prompt {i}, graphs {graphs}");
                }
                let st = g.sampling_stats();
                assert_eq!(
                    (st.device_rows, st.deferred_rows, st.host_rows),
                    (5 * 32, 0, 0)
                );
                let gs = g.graph_stats();
                assert_eq!(gs.capture_failures, 0, "{gs:?}");
                assert_eq!(gs.replayed, if graphs { 5 * 31 } else { 0 }, "{gs:?}");
            }
        }

        /// Steps a batch of five requests with `step_sample`; their tokens (and logprobs).
        fn sample_batch(
            r: &mut CudaModelRunner,
            params: &[SamplingParams],
            steps: usize,
        ) -> Vec<Vec<Sampled>> {
            let mut samplers: Vec<Sampler> = params.iter().cloned().map(Sampler::new).collect();
            let mut next: Vec<Vec<u32>> = prompts();
            let mut out = vec![Vec::new(); params.len()];
            for _ in 0..steps {
                let batch: Vec<StepInput> = next
                    .iter()
                    .enumerate()
                    .map(|(i, t)| StepInput {
                        seq: SeqId(i as u64),
                        tokens: t.clone(),
                        want_logits: true,
                    })
                    .collect();
                let mut refs: Vec<&mut Sampler> = samplers.iter_mut().collect();
                let got = r.step_sample(&batch, &mut refs).unwrap();
                for (i, g) in got.into_iter().enumerate() {
                    let g = g.unwrap();
                    next[i] = vec![g.0];
                    out[i].push(g);
                }
            }
            out
        }

        #[test]
        fn gpu_seeded_device_sampling_equals_host_sampling_of_the_same_logits() {
            // Five requests in one batch: temperature / top-k / top-p mixes, one with
            // top_k above the device's candidate cap, one asking for logprobs (host row).
            let sp = |temperature, top_k, top_p, seed, logprobs| SamplingParams {
                temperature,
                top_k,
                top_p,
                seed: Some(seed),
                logprobs,
            };
            let params = [
                sp(0.8, 40, 0.9, 1, None),
                sp(1.0, 0, 1.0, 2, None),
                sp(0.6, 0, 0.7, 3, None),
                sp(1.2, 500, 0.95, 4, None),
                sp(0.9, 0, 1.0, 5, Some(3)),
            ];
            let mut host = gpu_runner(4096);
            host.set_options(CudaOptions {
                graphs: false,
                device_sampling: false,
            });
            let mut dev = gpu_runner(4096);
            let want = sample_batch(&mut host, &params, 24);
            let got = sample_batch(&mut dev, &params, 24);
            // Equal unless a draw falls within float rounding (~1e-6) of a boundary
            // between two tokens: not expected in 120 draws.
            assert_eq!(got, want);
            let st = dev.sampling_stats();
            println!("device sampling of 5 x 24 tokens: {st:?}");
            assert_eq!(st.host_rows, 24, "the logprobs request");
            assert_eq!(st.device_rows + st.deferred_rows, 4 * 24);
            assert!(st.device_rows > 0);
            assert_eq!(host.sampling_stats().host_rows, 5 * 24);
        }

        struct Lcg(u64);
        impl Lcg {
            fn unit(&mut self) -> f32 {
                self.0 = self
                    .0
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (self.0 >> 40) as f32 / (1u64 << 24) as f32
            }
        }

        /// Rank of `tok` among the finite logits scaled by 1/T, sorted like the host
        /// sampler (value descending, index ascending).
        fn rank(row: &[f32], inv_t: f32, tok: u32) -> usize {
            let v = row[tok as usize] * inv_t;
            row.iter()
                .enumerate()
                .filter(|(i, l)| {
                    let w = **l * inv_t;
                    l.is_finite() && (w.total_cmp(&v).is_gt() || (w == v && (*i as u32) < tok))
                })
                .count()
        }

        /// How many candidates the host's top-p prefix keeps (approximately, in f64).
        fn nucleus_len(row: &[f32], p: &SamplingParams) -> usize {
            let inv_t = 1.0 / p.temperature;
            let mut v: Vec<f64> = row
                .iter()
                .filter(|l| l.is_finite())
                .map(|l| (l * inv_t) as f64)
                .collect();
            v.sort_by(|a, b| b.total_cmp(a));
            if p.top_k > 0 && p.top_k < v.len() {
                v.truncate(p.top_k);
            }
            if p.top_p >= 1.0 {
                return v.len();
            }
            let z: f64 = v.iter().map(|x| (x - v[0]).exp()).sum();
            let mut acc = 0.0;
            for (i, x) in v.iter().enumerate() {
                acc += (x - v[0]).exp() / z;
                if acc >= p.top_p as f64 {
                    return i + 1;
                }
            }
            v.len()
        }

        #[test]
        fn gpu_sample_kernel_matches_the_host_sampler_on_fixed_logits() {
            // No model: the kernel on hand-made rows of SmolLM2's vocabulary size, every
            // parameter set x 4 rows x 65 uniforms, against `Sampler::sample_drawn`.
            // Tolerance: the device sums probabilities in another order (and the wide
            // normaliser in parallel) and its expf differs by an ulp or two, so a token may
            // differ only where the host's choice changes within +-5e-4 of u; at most 2%
            // of the draws. A row left to the host (SAMPLE_DEFER) is only allowed where
            // the decision needs a candidate past the 256 the kernel keeps.
            let d = tandem_kernels::cuda::CudaDevice::new(0)
                .unwrap_or_else(|e| panic!("GPU test without a usable CUDA device: {e}"));
            let vocab = 49152;
            let mut rng = Lcg(5);
            let mut perm: Vec<usize> = (0..vocab).collect();
            for i in (1..vocab).rev() {
                perm.swap(i, (rng.unit() * (i + 1) as f32) as usize % (i + 1));
            }
            let zipf = |s: f32| {
                let mut r = vec![0f32; vocab];
                for (rank, &i) in perm.iter().enumerate() {
                    r[i] = -s * ((rank + 1) as f32).ln();
                }
                r
            };
            let peaked: Vec<f32> = (0..vocab)
                .map(|i| match i {
                    7 => 12.0,
                    100 => 11.0,
                    3000 => 10.5,
                    _ => rng.unit() * 2.0,
                })
                .collect();
            let ties: Vec<f32> = (0..vocab)
                .map(|i| match i % 997 {
                    5 => f32::NEG_INFINITY,
                    6 => f32::NAN,
                    _ => (rng.unit() * 4.0).round(),
                })
                .collect();
            let base = [zipf(1.5), zipf(1.1), peaked, ties];
            let us: Vec<f32> = (0..64)
                .map(|i| (i as f32 + 0.5) / 64.0)
                .chain([0.0])
                .collect();
            let mut logits = Vec::with_capacity(base.len() * us.len() * vocab);
            for row in &base {
                for _ in &us {
                    logits.extend_from_slice(row);
                }
            }
            let rows = base.len() * us.len();
            let ld = d.upload(&logits).unwrap();
            let mut pd = d.zeros::<u32>(rows * launch::SAMPLE_WORDS).unwrap();
            let mut od = d.zeros::<u32>(rows).unwrap();
            let sets = [
                (0.0, 0, 1.0),
                (1.0, 0, 1.0),
                (0.7, 40, 1.0),
                (1.0, 0, 0.9),
                (1.3, 300, 0.95),
                (0.5, 5, 0.5),
                (1.0, 1, 1.0),
                (2.0, 0, 0.3),
                (0.8, 1000, 1.0),
            ];
            let (mut total, mut near, mut deferred) = (0usize, 0usize, 0usize);
            for (temperature, top_k, top_p) in sets {
                let p = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    seed: Some(0),
                    logprobs: None,
                };
                let host = Sampler::new(p.clone());
                let dr = device_row(&p).unwrap();
                let packed: Vec<SampleRow> = (0..rows)
                    .map(|k| SampleRow {
                        uniform: us[k % us.len()],
                        ..dr
                    })
                    .collect();
                d.upload_into(&launch::pack_sample_rows(&packed), &mut pd)
                    .unwrap();
                d.sample(
                    &ld.as_view(),
                    rows,
                    vocab,
                    &pd.as_view(),
                    &mut od.as_view_mut(),
                )
                .unwrap();
                let got = d.download(&od.as_view(), rows).unwrap();
                let kept: Vec<usize> = if temperature > 0.0 {
                    base.iter().map(|row| nucleus_len(row, &p)).collect()
                } else {
                    vec![0; base.len()]
                };
                for k in 0..rows {
                    let (row, u) = (&base[k / us.len()], us[k % us.len()]);
                    let draw = (temperature > 0.0).then_some(u);
                    let want = host.sample_drawn(row, draw).0;
                    let what = format!(
                        "T {temperature} k {top_k} p {top_p} row {} u {u}",
                        k / us.len()
                    );
                    total += 1;
                    if got[k] == launch::SAMPLE_DEFER {
                        deferred += 1;
                        assert!(temperature > 0.0, "greedy never defers: {what}");
                        let inv_t = 1.0 / temperature;
                        let finite = row.iter().any(|l| l.is_finite());
                        assert!(
                            !finite || rank(row, inv_t, want) >= 250 || kept[k / us.len()] >= 250,
                            "deferred without need: {what}, host token {want}"
                        );
                        continue;
                    }
                    if got[k] != want {
                        let lo = host.sample_drawn(row, Some((u - 5e-4).max(0.0))).0;
                        let hi = host.sample_drawn(row, Some((u + 5e-4).min(0.99999))).0;
                        assert!(
                            temperature > 0.0 && (got[k] == lo || got[k] == hi),
                            "{what}: device {} host {want} (host at u -+ 5e-4: {lo}, {hi})",
                            got[k]
                        );
                        near += 1;
                    }
                }
            }
            println!(
                "sample kernel: {total} draws, {near} boundary differences, {deferred} deferred"
            );
            assert!(
                near * 50 <= total,
                "{near} of {total} differ near a boundary"
            );
            // Both paths ran: the device decided at least a quarter of the draws.
            assert!(
                deferred > 0 && (total - deferred) * 4 >= total,
                "{deferred} of {total}"
            );
        }

        #[test]
        fn gpu_graph_decode_equals_plain_decode() {
            let mut plain = gpu_runner(16384);
            let mut graph = gpu_runner(16384);
            graph.set_options(CudaOptions {
                graphs: true,
                device_sampling: true,
            });
            let decode = |r: &mut CudaModelRunner, seqs: &[u64], next: &[u32]| {
                let batch: Vec<StepInput> = seqs
                    .iter()
                    .zip(next)
                    .map(|(s, t)| StepInput {
                        seq: SeqId(*s),
                        tokens: vec![*t],
                        want_logits: true,
                    })
                    .collect();
                r.step(&batch).unwrap()
            };
            let argmaxes = |out: &[Option<Vec<f32>>]| -> Vec<u32> {
                out.iter().map(|l| argmax(l.as_ref().unwrap())).collect()
            };
            let mut first_seq = 0u64;
            // Buckets 1, 4, 8, 16, 24, 48, 64.
            for n in [1usize, 3, 8, 16, 17, 40, 64] {
                let seqs: Vec<u64> = (first_seq..first_seq + n as u64).collect();
                first_seq += n as u64;
                let prefill: Vec<StepInput> = seqs
                    .iter()
                    .map(|&s| {
                        let mut p = prompts()[s as usize % 5].clone();
                        p.push(100 + s as u32);
                        StepInput {
                            seq: SeqId(s),
                            tokens: p,
                            want_logits: true,
                        }
                    })
                    .collect();
                let a = plain.step(&prefill).unwrap();
                let b = graph.step(&prefill).unwrap();
                let mut next = argmaxes(&a);
                assert_eq!(next, argmaxes(&b), "prefill, batch {n}");
                let mut max_diff = 0f32;
                for step in 0..6 {
                    let a = decode(&mut plain, &seqs, &next);
                    let replayed = graph.graph_stats().replayed;
                    let b = decode(&mut graph, &seqs, &next);
                    assert_eq!(graph.graph_stats().replayed, replayed + 1, "batch {n}");
                    for (x, y) in a.iter().zip(&b) {
                        let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
                        for (p, q) in x.iter().zip(y) {
                            max_diff = max_diff.max((p - q).abs());
                        }
                    }
                    next = argmaxes(&a);
                    assert_eq!(next, argmaxes(&b), "batch {n}, decode step {step}");
                }
                // The padded rows compute nothing the real rows see: same kernels, same
                // rows, so the logits agree to the bit (tolerance 1e-3 in case a driver
                // reorders a reduction).
                println!("graph vs plain, batch {n}: max logit difference {max_diff}");
                assert!(max_diff <= 1e-3, "batch {n}: {max_diff}");
                // A mixed step (a prompt chunk beside decodes) runs without a graph.
                let replayed = graph.graph_stats().replayed;
                let mut mixed = vec![StepInput {
                    seq: SeqId(9999),
                    tokens: prompts()[0].clone(),
                    want_logits: true,
                }];
                mixed.extend(seqs.iter().zip(&next).map(|(s, t)| StepInput {
                    seq: SeqId(*s),
                    tokens: vec![*t],
                    want_logits: true,
                }));
                let a = plain.step(&mixed).unwrap();
                let b = graph.step(&mixed).unwrap();
                assert_eq!(argmaxes(&a), argmaxes(&b), "mixed step, batch {n}");
                assert_eq!(graph.graph_stats().replayed, replayed);
                for s in seqs.iter().copied().chain([9999]) {
                    plain.free(SeqId(s));
                    graph.free(SeqId(s));
                }
            }
            let st = graph.graph_stats();
            assert_eq!(st.capture_failures, 0, "{st:?}");
            assert!(st.captured >= 7, "{st:?}");
            assert_eq!(plain.graph_stats(), GraphStats::default());
            // A step larger than the activation buffers grows them and drops the graphs;
            // decode graphs are captured again and stay correct.
            let long: Vec<u32> = (0..graph.bufs.cap as u32 + 1)
                .map(|i| 200 + i % 3000)
                .collect();
            for r in [&mut plain, &mut graph] {
                r.step(&[StepInput {
                    seq: SeqId(5000),
                    tokens: long.clone(),
                    want_logits: true,
                }])
                .unwrap();
            }
            let captured = graph.graph_stats().captured;
            assert_eq!(graph.graph_stats().invalidated, st.invalidated + 1);
            let mut next = vec![7042];
            for _ in 0..4 {
                let a = argmaxes(&decode(&mut plain, &[5000], &next));
                assert_eq!(a, argmaxes(&decode(&mut graph, &[5000], &next)));
                next = a;
            }
            assert_eq!(graph.graph_stats().captured, captured + 1);
        }
    }
}
