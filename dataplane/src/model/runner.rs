//! `CpuModelRunner`: weights + paged KV cache + a kernel backend behind the
//! `ModelRunner` contract.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use tandem_kernels::cpu::ThreadPool;
use tandem_kernels::{GgmlType, Kernels, RopeStyle, RopeTable};

use super::config::LlamaConfig;
use super::forward::{Buffers, Forward, TokenSlot};
use super::kv_cache::{KvCacheConfig, PagedKvCache};
use super::weights::Weights;
use crate::engine_api::{
    KvUsage, ModelInfo, ModelRunner, Sampled, SeqId, StepInput, check_samplers,
};
use crate::error::{Error, Result};
use crate::gguf::Gguf;
use crate::sampling::Sampler;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RunnerConfig {
    pub kv: KvCacheConfig,
}

impl RunnerConfig {
    /// A KV pool able to hold `tokens` tokens in `block_tokens`-token blocks.
    pub fn with_kv_tokens(tokens: usize, dtype: GgmlType) -> Self {
        let block_tokens = KvCacheConfig::default().block_tokens;
        Self {
            kv: KvCacheConfig {
                block_tokens,
                n_blocks: tokens.div_ceil(block_tokens).max(1),
                dtype,
            },
        }
    }
}

/// Runs a Llama-family GGUF model on a CPU kernel backend (the optimized one by default;
/// the scalar reference for tests).
pub struct CpuModelRunner {
    cfg: LlamaConfig,
    weights: Weights,
    rope: RopeTable,
    kernels: Arc<dyn Kernels>,
    pub(super) kv: PagedKvCache,
    info: ModelInfo,
    buffers: Buffers,
}

impl std::fmt::Debug for CpuModelRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuModelRunner")
            .field("info", &self.info)
            .field("kernels", &self.kernels.name())
            .finish()
    }
}

impl CpuModelRunner {
    /// Load a GGUF file with the best kernel backend of this machine.
    pub fn load(path: &Path, rc: RunnerConfig) -> Result<Self> {
        let g = Gguf::open(path)?;
        let fallback = path.file_stem().map(|s| s.to_string_lossy().into_owned());
        let mut r = Self::new(Arc::new(g), rc, tandem_kernels::best_backend())?;
        if r.info.name.is_empty() {
            r.info.name = fallback.unwrap_or_default();
        }
        Ok(r)
    }

    pub fn new(g: Arc<Gguf>, rc: RunnerConfig, kernels: Arc<dyn Kernels>) -> Result<Self> {
        let cfg = LlamaConfig::from_gguf(&g)?;
        let weights = Weights::load(Arc::clone(&g), &cfg)?;
        // The llama architecture uses the interleaved-pairs ("normal") rope: the GGUF
        // converter permutes the Q/K rows of HF checkpoints so that this is correct.
        let rope = RopeTable::new(
            RopeStyle::Normal,
            cfg.rope_dim,
            cfg.rope_base,
            cfg.context_length,
        )?;
        let kv = PagedKvCache::new(rc.kv, cfg.n_layers, cfg.kv_dim())?;
        let info = ModelInfo {
            name: cfg.name.clone(),
            vocab_size: cfg.vocab_size,
            context_length: cfg.context_length,
            n_layers: cfg.n_layers,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            kv_block_size: rc.kv.block_tokens,
            fingerprint: fingerprint(&g),
        };
        Ok(Self {
            cfg,
            weights,
            rope,
            kernels,
            kv,
            info,
            buffers: Buffers::default(),
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    pub fn kernels_name(&self) -> &'static str {
        self.kernels.name()
    }

    pub fn kv_config(&self) -> &KvCacheConfig {
        self.kv.config()
    }

    /// Validate, reserve, run the forward pass and return the logits of the entries that
    /// want them (rows in batch order) in the reused logits buffer.
    fn forward_step(&mut self, batch: &[StepInput]) -> Result<&[f32]> {
        self.validate(batch)?;
        for b in batch {
            let total = self.kv.len(b.seq) + b.tokens.len();
            self.kv.reserve(b.seq, total)?;
        }
        let mut slots = Vec::new();
        let mut want = Vec::new();
        for b in batch {
            let start = self.kv.len(b.seq);
            for (j, &token) in b.tokens.iter().enumerate() {
                slots.push(TokenSlot {
                    seq: b.seq,
                    pos: start + j,
                    token,
                });
            }
            if b.want_logits {
                want.push(slots.len() - 1);
            }
        }
        let fwd = Forward {
            cfg: &self.cfg,
            w: &self.weights,
            rope: &self.rope,
            k: self.kernels.as_ref(),
        };
        let hidden = fwd.run(&slots, &mut self.kv, &want, &mut self.buffers)?;
        let logits = fwd.logits(&hidden, &mut self.buffers)?;
        for b in batch {
            let len = self.kv.len(b.seq) + b.tokens.len();
            self.kv.set_len(b.seq, len);
        }
        Ok(logits)
    }

    fn validate(&self, batch: &[StepInput]) -> Result<()> {
        validate_step(
            batch,
            &self.cfg,
            |seq| self.kv.len(seq),
            |seq, total| self.kv.blocks_needed(seq, total),
            self.kv.free_blocks(),
        )
    }
}

/// Hand each `want_logits` entry its row of `logits` (rows in batch order), for every
/// backend's `step`.
pub(crate) fn split_logits(
    batch: &[StepInput],
    logits: &[f32],
    vocab: usize,
) -> Vec<Option<Vec<f32>>> {
    let mut rows = logits.chunks_exact(vocab);
    batch
        .iter()
        .map(|b| {
            b.want_logits
                .then(|| rows.next().map(<[f32]>::to_vec).unwrap_or_default())
        })
        .collect()
}

/// Check a step before it touches the cache, for every backend: each sequence once, with
/// tokens in the vocabulary, within the context length, and KV blocks for everyone or no
/// one (a step never half-reserves).
pub(crate) fn validate_step(
    batch: &[StepInput],
    cfg: &LlamaConfig,
    len_of: impl Fn(SeqId) -> usize,
    blocks_needed: impl Fn(SeqId, usize) -> usize,
    free_blocks: usize,
) -> Result<()> {
    let mut seen = HashSet::new();
    for b in batch {
        if !seen.insert(b.seq) {
            return Err(Error::InvalidInput(format!(
                "{:?} appears twice in one step",
                b.seq
            )));
        }
        if b.tokens.is_empty() {
            return Err(Error::InvalidInput(format!(
                "{:?} has no tokens in this step",
                b.seq
            )));
        }
        if let Some(t) = b.tokens.iter().find(|t| **t as usize >= cfg.vocab_size) {
            return Err(Error::InvalidInput(format!(
                "token id {t} out of range (vocabulary of {})",
                cfg.vocab_size
            )));
        }
        let total = len_of(b.seq) + b.tokens.len();
        if total > cfg.context_length {
            return Err(Error::InvalidInput(format!(
                "{:?} would hold {total} tokens, beyond the context length {}",
                b.seq, cfg.context_length
            )));
        }
    }
    let needed: usize = batch
        .iter()
        .map(|b| blocks_needed(b.seq, len_of(b.seq) + b.tokens.len()))
        .sum();
    if needed > free_blocks {
        return Err(Error::KvCacheFull {
            needed,
            free: free_blocks,
        });
    }
    Ok(())
}

/// SHA-256 over everything before the tensor data (architecture, hyperparameters,
/// vocabulary, tensor names, types, shapes and offsets) plus a 4 KiB sample from the
/// start, middle and end of every tensor: distinguishes different weights without
/// hashing the whole file at every start.
fn fingerprint(g: &Gguf) -> String {
    let mut h = Sha256::new();
    h.update(&g.bytes()[..g.header().data_offset.min(g.bytes().len())]);
    for t in g.tensors() {
        let d = g.tensor_data(t);
        const S: usize = 4096;
        for start in [0, d.len().saturating_sub(S) / 2, d.len().saturating_sub(S)] {
            h.update(&d[start..(start + S).min(d.len())]);
        }
    }
    hex::encode(h.finalize())
}

impl ModelRunner for CpuModelRunner {
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
        self.kv.reserve(seq, total_tokens)
    }

    fn step(&mut self, batch: &[StepInput]) -> Result<Vec<Option<Vec<f32>>>> {
        let vocab = self.cfg.vocab_size;
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
        let vocab = self.cfg.vocab_size;
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
        ThreadPool::global().for_each(parts, |_, (s, row, o)| *o = Some(s.sample(row)));
        Ok(out)
    }

    fn seq_len(&self, seq: SeqId) -> usize {
        self.kv.len(seq)
    }

    fn free(&mut self, seq: SeqId) {
        self.kv.release(seq);
    }

    fn kv_usage(&self) -> KvUsage {
        self.kv.usage()
    }

    fn export_kv(&self, seq: SeqId) -> Result<Vec<u8>> {
        super::kv_transfer::export(&self.kv, &self.cfg, seq)
    }

    fn import_kv(&mut self, seq: SeqId, payload: &[u8]) -> Result<()> {
        let cfg = self.cfg.clone();
        super::kv_transfer::import(&mut self.kv, &cfg, seq, payload)
    }
}
