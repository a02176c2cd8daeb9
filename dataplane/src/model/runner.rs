//! `CpuModelRunner`: the model on the CPU backend behind the `ModelRunner` contract. All
//! of the model is [`LoadedModel`]'s; this adds host sampling straight from the logits
//! buffer.

use std::path::Path;
use std::sync::Arc;

use tandem_kernels::{CpuBackend, CpuKernels, Kernels};

use super::config::ModelConfig;
use super::kv_cache::KvCacheConfig;
use super::loaded::{LoadedModel, RunnerConfig, split_logits};
use crate::engine_api::{
    KvUsage, ModelInfo, ModelRunner, Sampled, SeqId, StepInput, check_samplers,
};
use crate::error::Result;
use crate::gguf::Gguf;
use crate::sampling::Sampler;

/// Runs a Llama-family GGUF model on a CPU kernel backend (the optimized one by default;
/// the scalar reference or exact activations for tests).
pub struct CpuModelRunner {
    model: LoadedModel<CpuBackend>,
}

impl std::fmt::Debug for CpuModelRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuModelRunner")
            .field("model", &self.model)
            .finish()
    }
}

impl CpuModelRunner {
    /// Load a GGUF file with the best kernel backend of this machine.
    pub fn load(path: &Path, rc: RunnerConfig) -> Result<Self> {
        Self::load_with(path, rc, Arc::new(CpuKernels::new()))
    }

    /// Load a GGUF file onto `kernels`.
    pub fn load_with(path: &Path, rc: RunnerConfig, kernels: Arc<dyn Kernels>) -> Result<Self> {
        Ok(Self {
            model: LoadedModel::open(path, rc, CpuBackend::new(kernels))?,
        })
    }

    pub fn new(g: Arc<Gguf>, rc: RunnerConfig, kernels: Arc<dyn Kernels>) -> Result<Self> {
        Ok(Self {
            model: LoadedModel::load(g, rc, CpuBackend::new(kernels))?,
        })
    }

    pub fn model(&self) -> &LoadedModel<CpuBackend> {
        &self.model
    }

    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    pub fn kernels_name(&self) -> &'static str {
        self.model.backend().kernels().name()
    }

    pub fn kv_config(&self) -> &KvCacheConfig {
        self.model.kv_config()
    }

    /// Run a step; the logits of the entries that want them, rows in batch order, in the
    /// reused logits buffer.
    fn forward_step(&mut self, batch: &[StepInput]) -> Result<&[f32]> {
        let rows = self.model.step(batch)?.rows;
        let n = rows * self.model.config().vocab_size;
        Ok(&self.model.activations().logits()[..n])
    }
}

impl ModelRunner for CpuModelRunner {
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
        let vocab = self.model.config().vocab_size;
        let logits = self.forward_step(batch)?;
        Ok(split_logits(batch, logits, vocab))
    }

    /// Samples straight from the logits buffer (no per-row copy), rows in parallel on the
    /// pool: each sampler sees only its own row, so the result does not depend on the
    /// number of threads and equals `step` + `Sampler::sample`.
    fn step_sample(
        &mut self,
        batch: &[StepInput],
        samplers: &mut [&mut Sampler],
    ) -> Result<Vec<Option<Sampled>>> {
        check_samplers(batch, samplers)?;
        let vocab = self.model.config().vocab_size;
        let pool = self.model.backend().pool();
        let logits = self.forward_step(batch)?;
        let mut out: Vec<Option<Sampled>> = vec![None; batch.len()];
        let mut rows = logits.chunks_exact(vocab);
        let parts: Vec<_> = batch
            .iter()
            .zip(samplers.iter_mut())
            .zip(out.iter_mut())
            .filter(|((b, _), _)| b.want_logits)
            .filter_map(|((_, s), o)| rows.next().map(|row| (&mut **s, row, o)))
            .collect();
        pool.for_each(parts, |_, (s, row, o)| *o = Some(s.sample(row)));
        Ok(out)
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
