//! `CudaModelRunner`: the model on a CUDA device (feature `cuda`). The model, its forward
//! pass, block accounting and KV transfer are [`LoadedModel`]'s, on the
//! `tandem_kernels::cuda::CudaBackend`: weights are uploaded once in their GGUF formats,
//! the paged KV pool lives on the device with the CPU pools' layout (so KV export and
//! import produce and accept exactly the CPU runner's `TKV1` payloads), and per step only
//! token ids, positions, slot and block-table indices go in; token ids come out
//! ([`ModelRunner::step_sample`]), or logits ([`ModelRunner::step`]).
//!
//! What is CUDA's own lives here, by concern:
//! - [`forward`](self::forward): the step (graph replay or launch by launch) and greedy
//!   sampling on the device;
//! - [`graphs`]: CUDA graphs for decode steps ([`CudaOptions::graphs`]);
//! - [`sampling`]: sampling on the device ([`CudaOptions::device_sampling`]);
//! - [`options`]: the run-time switches.

mod forward;
#[cfg(all(test, feature = "gpu-tests"))]
mod gpu_tests;
mod graphs;
mod options;
mod sampling;
#[cfg(test)]
mod tests;

use std::path::Path;
use std::sync::Arc;

use tandem_kernels::cuda::{CudaBackend, CudaDevice};

pub use graphs::{GRAPH_BUCKETS, GRAPH_MAX_BATCH, GraphStats, graph_bucket};
pub use options::CudaOptions;
pub use sampling::SamplingStats;

use super::config::ModelConfig;
use super::loaded::{LoadedModel, RunnerConfig, split_logits};
use crate::engine_api::{
    KvUsage, ModelInfo, ModelRunner, Sampled, SeqId, StepInput, check_samplers, sample_on_host,
};
use crate::error::{Context, Result};
use crate::gguf::Gguf;
use crate::sampling::Sampler;

pub struct CudaModelRunner {
    model: LoadedModel<CudaBackend>,
    opts: CudaOptions,
    graphs: graphs::DecodeGraphs,
    samples: sampling::SampleBufs,
    sampling: SamplingStats,
}

impl std::fmt::Debug for CudaModelRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaModelRunner")
            .field("model", &self.model)
            .field("device", self.dev().info())
            .field("options", &self.opts)
            .finish()
    }
}

impl CudaModelRunner {
    /// Load a GGUF file onto CUDA device `ordinal`. Without a driver or device this is a
    /// clear `Error::Kernel(Cuda(..))` ("no CUDA driver: libcuda.so.1 not found", ...),
    /// found before the file is read.
    pub fn load(path: &Path, rc: RunnerConfig, ordinal: usize, opts: CudaOptions) -> Result<Self> {
        // Probe before reading a model of possibly many GB.
        tandem_kernels::cuda::probe(ordinal)?;
        let g = Gguf::open(path)?;
        let mut r = Self::new(Arc::new(g), rc, ordinal, opts)?;
        r.model.info = r.model.info.clone().or_file_name(path);
        Ok(r)
    }

    pub fn new(g: Arc<Gguf>, rc: RunnerConfig, ordinal: usize, opts: CudaOptions) -> Result<Self> {
        let backend =
            CudaBackend::new(ordinal).with_context(|| format!("opening cuda:{ordinal}"))?;
        let model = LoadedModel::load(g, rc, backend)
            .with_context(|| format!("loading the model onto cuda:{ordinal}"))?;
        let samples = sampling::SampleBufs::new(model.backend().device(), 32)?;
        model.backend().device().synchronize()?;
        tracing::info!(
            device_sampling = opts.device_sampling,
            graphs = opts.graphs,
            "CUDA runner options"
        );
        Ok(Self {
            model,
            opts,
            graphs: graphs::DecodeGraphs::default(),
            samples,
            sampling: SamplingStats::default(),
        })
    }

    pub fn device(&self) -> &CudaDevice {
        self.dev()
    }

    fn dev(&self) -> &CudaDevice {
        self.model.backend().device()
    }

    pub fn model(&self) -> &LoadedModel<CudaBackend> {
        &self.model
    }

    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    pub fn options(&self) -> CudaOptions {
        self.opts
    }

    /// Change the options; switching graphs off (or on again) drops the captured graphs
    /// and forgets failed captures.
    pub fn set_options(&mut self, opts: CudaOptions) {
        if opts.graphs != self.opts.graphs {
            self.graphs.reset();
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
}

impl ModelRunner for CudaModelRunner {
    fn info(&self) -> &ModelInfo {
        self.model.info()
    }

    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> Result<()> {
        self.model.reserve(seq, total_tokens)
    }

    fn reserve_prompt(&mut self, seq: SeqId, prompt: &[u32], total_tokens: usize) -> Result<usize> {
        self.model.reserve_prompt(seq, prompt, total_tokens)
    }

    fn step(&mut self, batch: &[StepInput]) -> Result<Vec<Option<Vec<f32>>>> {
        let rows = self.forward(batch)?;
        let logits = self.model.logits_to_host(rows)?;
        Ok(split_logits(batch, &logits, self.model.config().vocab_size))
    }

    /// Samples on the device (see [`sampling`]); with device sampling off, exactly the
    /// default (`step` + `Sampler::sample`).
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
        let rows = self.forward(batch)?;
        self.sample_rows(batch, samplers, rows)
    }

    fn seq_len(&self, seq: SeqId) -> usize {
        self.model.seq_len(seq)
    }

    fn free(&mut self, seq: SeqId) {
        self.model.free(seq);
    }

    fn kv_usage(&self) -> KvUsage {
        self.model.kv_usage()
    }

    fn prefix_keys(&self, since: u64) -> Option<crate::engine_api::PrefixKeys> {
        self.model.prefix_keys(since)
    }

    fn export_kv(&self, seq: SeqId) -> Result<Vec<u8>> {
        self.model.export_kv(seq)
    }

    fn import_kv(&mut self, seq: SeqId, payload: &[u8]) -> Result<()> {
        self.model.import_kv(seq, payload)
    }

    fn export_kv_from(&self, seq: SeqId, start: usize) -> Result<Vec<u8>> {
        self.model.export_kv_from(seq, start)
    }

    fn import_kv_after(&mut self, seq: SeqId, prefix: usize, payload: &[u8]) -> Result<()> {
        self.model.import_kv_after(seq, prefix, payload)
    }
}
