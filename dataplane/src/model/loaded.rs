//! [`LoadedModel`]: a model loaded onto a [`Backend`], with everything a runner does that
//! does not depend on the backend: step validation, KV block accounting (one
//! [`BlockAllocator`] for every backend), step descriptions, the forward pass
//! ([`super::forward::forward`]) and KV export / import ([`KvHeader`]). The runners add
//! only what is their own: how logits reach the sampler (the CPU reads them in place; the
//! GPU samples on the device), and for CUDA graphs and streams.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use tandem_kernels::{Backend, GgmlType, StepDesc};

use super::config::ModelConfig;
use super::forward::{Activations, ModelWeights, forward, rope_tables};
use super::kv_cache::{BlockAllocator, KvCacheConfig};
use super::kv_transfer::KvHeader;
use super::weights::Weights;
use crate::engine_api::{KvUsage, ModelInfo, SeqId, StepInput};
use crate::error::{Context, Error, Result};
use crate::gguf::Gguf;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunnerConfig {
    pub kv: KvCacheConfig,
    /// Keep whole prompt blocks cached for later prompts that start alike
    /// (`prefix_cache`); on by default.
    pub prefix_cache: bool,
}

impl Default for RunnerConfig {
    fn default() -> Self {
        Self {
            kv: KvCacheConfig::default(),
            prefix_cache: true,
        }
    }
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
            ..Self::default()
        }
    }
}

/// What a forward step left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepOutcome {
    /// Logits rows in the activations (the `want_logits` entries, in batch order).
    pub rows: usize,
    /// The activation buffers were reallocated for this step (they moved).
    pub buffers_moved: bool,
}

pub struct LoadedModel<B: Backend> {
    pub(crate) backend: B,
    pub(crate) info: ModelInfo,
    pub(crate) kv_cfg: KvCacheConfig,
    pub(crate) weights: ModelWeights<B>,
    pub(crate) kv: B::Kv,
    pub(crate) blocks: BlockAllocator,
    pub(crate) acts: Activations<B>,
}

impl<B: Backend> std::fmt::Debug for LoadedModel<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("backend", &self.backend.name())
            .field("info", &self.info)
            .field("kv", &self.kv_cfg)
            .finish()
    }
}

impl<B: Backend> LoadedModel<B> {
    /// Parse the model in `g`, put its weights, KV pools and activation buffers on
    /// `backend`.
    pub fn load(g: Arc<Gguf>, rc: RunnerConfig, backend: B) -> Result<Self> {
        let cfg = ModelConfig::from_gguf(&g)?;
        let spec = rc.kv.spec(cfg.n_layers, cfg.kv_dim())?;
        let w = Weights::load(Arc::clone(&g), &cfg)?;
        let ropes = rope_tables(&cfg, w.rope_freqs.as_deref())?;
        let weights = ModelWeights::load(&backend, &w, &cfg, &ropes)?;
        let kv = backend
            .alloc_kv(&spec)
            .with_context(|| format!("allocating the KV cache ({:?})", rc.kv))?;
        let acts = Activations::new(&backend, &cfg, 64, 32)?;
        Ok(Self {
            info: ModelInfo::from_gguf(&g, &cfg, rc.kv.block_tokens),
            kv_cfg: rc.kv,
            blocks: BlockAllocator::with_prefix_cache(
                rc.kv.block_tokens,
                rc.kv.n_blocks,
                rc.prefix_cache,
            ),
            weights,
            kv,
            acts,
            backend,
        })
    }

    /// [`LoadedModel::load`] of the file at `path`, named after it if it names no model.
    pub fn open(path: &Path, rc: RunnerConfig, backend: B) -> Result<Self> {
        let g = Gguf::open(path)?;
        let mut m = Self::load(Arc::new(g), rc, backend)?;
        m.info = m.info.or_file_name(path);
        Ok(m)
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn config(&self) -> &ModelConfig {
        &self.weights.cfg
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn kv_config(&self) -> &KvCacheConfig {
        &self.kv_cfg
    }

    pub fn activations(&self) -> &Activations<B> {
        &self.acts
    }

    /// Check a step before it touches the cache: each sequence once, with tokens in the
    /// vocabulary, within the context length, and KV blocks for everyone or no one (a step
    /// never half-reserves).
    pub fn validate(&self, batch: &[StepInput]) -> Result<()> {
        let cfg = self.config();
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
            let total = self.blocks.len(b.seq) + b.tokens.len();
            if total > cfg.context_length {
                return Err(Error::InvalidInput(format!(
                    "{:?} would hold {total} tokens, beyond the context length {}",
                    b.seq, cfg.context_length
                )));
            }
        }
        let needed: usize = batch
            .iter()
            .map(|b| {
                self.blocks
                    .blocks_needed(b.seq, self.blocks.len(b.seq) + b.tokens.len())
            })
            .sum();
        let free = self.blocks.free_blocks();
        if needed > free {
            return Err(Error::KvCacheFull { needed, free });
        }
        Ok(())
    }

    /// Validate a step and reserve the blocks of its new tokens (all or nothing; again
    /// for a step that was already admitted, it is a no-op).
    pub fn admit(&mut self, batch: &[StepInput]) -> Result<()> {
        self.validate(batch)?;
        for b in batch {
            let total = self.blocks.len(b.seq) + b.tokens.len();
            self.blocks.reserve(b.seq, total)?;
        }
        Ok(())
    }

    /// The description of an admitted step: tokens in batch order, positions after each
    /// sequence's stored tokens, KV slots from its block table.
    pub fn describe(&self, batch: &[StepInput]) -> Result<StepDesc> {
        let mut d = StepDesc::default();
        for b in batch {
            d.push_seq(
                self.blocks.table(b.seq),
                self.blocks.block_tokens(),
                self.blocks.len(b.seq),
                &b.tokens,
                b.want_logits,
            )?;
        }
        Ok(d)
    }

    /// Make the activations hold `n` tokens and `nw` logits rows; `true` if they moved.
    pub fn ensure_activations(&mut self, n: usize, nw: usize) -> Result<bool> {
        let cfg = &self.weights.cfg;
        self.acts.ensure(&self.backend, cfg, n, nw)
    }

    /// Run the forward pass over step inputs already on the backend.
    pub fn run(&mut self, step: &B::Step, n: usize, nw: usize) -> Result<()> {
        forward(
            &self.backend,
            &self.weights,
            &mut self.kv,
            &mut self.acts,
            step,
            n,
            nw,
        )
    }

    /// Record that the step's tokens are stored.
    pub fn finish(&mut self, batch: &[StepInput]) {
        for b in batch {
            let len = self.blocks.len(b.seq) + b.tokens.len();
            self.blocks.set_len(b.seq, len);
        }
    }

    /// One whole step: admit, describe, prepare the inputs, run the forward pass, finish.
    /// The logits of the `want_logits` entries are left in the activations (rows in batch
    /// order).
    pub fn step(&mut self, batch: &[StepInput]) -> Result<StepOutcome> {
        self.admit(batch)?;
        let desc = self.describe(batch)?;
        let (n, nw) = (desc.len(), desc.want.len());
        let buffers_moved = self.ensure_activations(n, nw)?;
        let step = self.backend.prepare_step(desc, &self.kv)?;
        self.run(&step, n, nw)?;
        self.backend.finish_step(step)?;
        self.finish(batch);
        Ok(StepOutcome {
            rows: nw,
            buffers_moved,
        })
    }

    /// The first `rows` logits rows of the last step on the host.
    pub fn logits_to_host(&self, rows: usize) -> Result<Vec<f32>> {
        let n = rows * self.config().vocab_size;
        Ok(self.backend.to_host(self.acts.logits(), n)?)
    }

    /// [`crate::engine_api::ModelRunner::step`] on any backend: the step, then its logits
    /// copied to the host.
    pub fn step_logits(&mut self, batch: &[StepInput]) -> Result<Vec<Option<Vec<f32>>>> {
        let out = self.step(batch)?;
        let logits = self.logits_to_host(out.rows)?;
        Ok(split_logits(batch, &logits, self.config().vocab_size))
    }

    fn check_context(&self, total_tokens: usize) -> Result<()> {
        let ctx = self.config().context_length;
        if total_tokens > ctx {
            return Err(Error::InvalidInput(format!(
                "{total_tokens} tokens exceed the context length {ctx}"
            )));
        }
        Ok(())
    }

    pub fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> Result<()> {
        self.check_context(total_tokens)?;
        self.blocks.reserve(seq, total_tokens)
    }

    /// [`crate::engine_api::ModelRunner::reserve_prompt`]: the block bookkeeping only (a
    /// shared block is read by the same attention kernels as any other block), so every
    /// backend has it.
    pub fn reserve_prompt(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        total_tokens: usize,
    ) -> Result<usize> {
        self.check_context(total_tokens.max(prompt.len()))?;
        self.blocks.reserve_prompt(seq, prompt, total_tokens)
    }

    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.blocks.len(seq)
    }

    pub fn free(&mut self, seq: SeqId) {
        self.blocks.release(seq);
    }

    pub fn kv_usage(&self) -> KvUsage {
        self.blocks.usage()
    }

    pub fn prefix_keys(&self, since: u64) -> Option<crate::engine_api::PrefixKeys> {
        self.blocks.prefix_keys(since)
    }

    /// The header this model's exports carry, for `n_tokens` tokens.
    fn kv_header(&self, n_tokens: usize) -> KvHeader {
        let c = self.config();
        KvHeader {
            n_layers: c.n_layers as u32,
            n_kv_heads: c.n_kv_heads as u32,
            head_dim: c.head_dim as u32,
            dtype: self.kv_cfg.dtype.id(),
            n_tokens: n_tokens as u64,
        }
    }

    fn kv_row_bytes(&self) -> Result<usize> {
        Ok(self.kv_cfg.dtype.row_bytes(self.config().kv_dim())?)
    }

    /// `seq`'s KV in the transfer layout (see `kv_transfer`).
    pub fn export_kv(&self, seq: SeqId) -> Result<Vec<u8>> {
        self.export_kv_from(seq, 0)
    }

    /// The KV of `seq`'s tokens from `start` on (a whole number of blocks: the prefix a
    /// decode holds already), in the transfer layout; its header counts those tokens.
    pub fn export_kv_from(&self, seq: SeqId, start: usize) -> Result<Vec<u8>> {
        if !self.blocks.contains(seq) {
            return Err(Error::InvalidInput(format!("export of unknown {seq:?}")));
        }
        let len = self.blocks.len(seq);
        let bt = self.blocks.block_tokens();
        if !start.is_multiple_of(bt) || start > len {
            return Err(Error::InvalidInput(format!(
                "export of {seq:?} from token {start}: not a block boundary within its {len} tokens"
            )));
        }
        let n = len - start;
        let body = self.config().n_layers * 2 * n * self.kv_row_bytes()?;
        let mut out = Vec::with_capacity(KvHeader::LEN + body);
        self.kv_header(n).write(&mut out);
        let table = &self.blocks.table(seq)[start / bt..];
        self.backend.kv_gather(&self.kv, table, n, &mut out)?;
        Ok(out)
    }

    /// Create `seq` (which must hold no tokens) from an export of a runner with the same
    /// model and KV layout; fails without side effects on a mismatched payload.
    pub fn import_kv(&mut self, seq: SeqId, payload: &[u8]) -> Result<()> {
        self.import_kv_after(seq, 0, payload)
    }

    /// Append an export to `seq`, which must hold exactly `prefix` tokens, a whole number
    /// of blocks (0, or the cached prefix [`Self::reserve_prompt`] found): the KV of the
    /// rest of its prompt (all of it, for a sequence made by `reserve_prompt`), exported
    /// from `prefix` on. Fails without side effects on a mismatched payload.
    pub fn import_kv_after(&mut self, seq: SeqId, prefix: usize, payload: &[u8]) -> Result<()> {
        let header = KvHeader::parse(payload)?;
        let n = header.check(
            &self.kv_header(0),
            self.kv_row_bytes()?,
            payload.len(),
            self.config().context_length.saturating_sub(prefix),
        )?;
        let bt = self.blocks.block_tokens();
        let held = self.blocks.len(seq);
        if held != prefix || !prefix.is_multiple_of(bt) {
            return Err(Error::KvTransfer(format!(
                "{seq:?} holds {held} tokens; KV can only follow a prefix of whole blocks \
                 ({prefix} expected)"
            )));
        }
        // A sequence made for a prompt caches its blocks from the prompt's tokens: KV of
        // another length would put wrong rows under their keys.
        if let Some(want) = self.blocks.prompt_len(seq)
            && prefix + n != want
        {
            return Err(Error::KvTransfer(format!(
                "{n} tokens of KV after {prefix} for {seq:?}, whose prompt has {want}"
            )));
        }
        let existed = self.blocks.contains(seq);
        self.blocks.reserve(seq, prefix + n)?;
        let body = &payload[KvHeader::LEN..];
        let table = &self.blocks.table(seq)[prefix / bt..];
        if let Err(e) = self.backend.kv_scatter(&mut self.kv, table, n, body) {
            if !existed {
                self.blocks.release(seq);
            }
            return Err(e.into());
        }
        self.blocks.set_len(seq, prefix + n);
        Ok(())
    }
}

/// Hand each `want_logits` entry its row of `logits` (rows in batch order).
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
