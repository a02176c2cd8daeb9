//! The contract between the model runner (weights + forward pass + paged KV cache) and
//! the scheduler / HTTP layers above it. The scheduler never touches tensors; the
//! runner never sees requests, only sequences and token ids.

/// Identifies one sequence (one request) inside the runner's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// Static facts about the loaded model that the layers above need.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// Served model name (from `general.name` or the file name).
    pub name: String,
    pub vocab_size: usize,
    pub context_length: usize,
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per KV block.
    pub kv_block_size: usize,
    /// Stable fingerprint of the weights and architecture (hex), used by the PD handshake.
    pub fingerprint: String,
}

/// One sequence's share of a batched forward step.
#[derive(Debug, Clone)]
pub struct StepInput {
    pub seq: SeqId,
    /// Tokens appended to the sequence in this step (a prompt chunk, or one decoded token).
    /// Their positions start at the sequence's current length in the cache.
    pub tokens: Vec<u32>,
    /// Whether the caller wants logits for the last token of this entry (false for
    /// non-final prompt chunks, which saves the output projection).
    pub want_logits: bool,
}

/// KV-cache accounting, exposed in metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvUsage {
    pub blocks_total: usize,
    pub blocks_used: usize,
}

/// A model runner: owns weights and the paged KV cache. Not shared between threads; the
/// scheduler thread owns it.
pub trait ModelRunner: Send {
    fn info(&self) -> &ModelInfo;

    /// Reserve KV capacity so that `seq` can hold `total_tokens` tokens in all. Creates the
    /// sequence if it does not exist. Fails without side effects when blocks are short.
    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> crate::Result<()>;

    /// Run one forward step over a batch of sequences. Returns, in input order, one entry
    /// per input: `Some(logits)` (length `vocab_size`) where `want_logits`, else `None`.
    /// Every weight matrix is read once for the whole batch.
    fn step(&mut self, batch: &[StepInput]) -> crate::Result<Vec<Option<Vec<f32>>>>;

    /// Number of tokens currently stored for `seq` (0 if unknown).
    fn seq_len(&self, seq: SeqId) -> usize;

    /// Drop a sequence and return its blocks to the free pool at once.
    fn free(&mut self, seq: SeqId);

    fn kv_usage(&self) -> KvUsage;

    /// Serialize `seq`'s KV cache (every layer's K and V for all its tokens) into one
    /// contiguous, self-describing buffer for transfer to a decode process. The layout is
    /// documented in `model::kv_transfer`. Runners without KV transfer return an error.
    fn export_kv(&self, seq: SeqId) -> crate::Result<Vec<u8>> {
        Err(crate::Error::KvTransfer(format!(
            "export of {seq:?}: not supported by this runner"
        )))
    }

    /// Create `seq` (which must hold no tokens) from a buffer made by `export_kv` of a
    /// runner with the same model and KV layout; afterwards `seq_len(seq)` is the exported
    /// token count. Fails without side effects on a mismatched or malformed buffer.
    fn import_kv(&mut self, seq: SeqId, payload: &[u8]) -> crate::Result<()> {
        let _ = payload;
        Err(crate::Error::KvTransfer(format!(
            "import into {seq:?}: not supported by this runner"
        )))
    }
}

/// A boxed runner is a runner, so the binary can pick the backend (`--device`) at run time.
impl<T: ModelRunner + ?Sized> ModelRunner for Box<T> {
    fn info(&self) -> &ModelInfo {
        (**self).info()
    }
    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> crate::Result<()> {
        (**self).reserve(seq, total_tokens)
    }
    fn step(&mut self, batch: &[StepInput]) -> crate::Result<Vec<Option<Vec<f32>>>> {
        (**self).step(batch)
    }
    fn seq_len(&self, seq: SeqId) -> usize {
        (**self).seq_len(seq)
    }
    fn free(&mut self, seq: SeqId) {
        (**self).free(seq)
    }
    fn kv_usage(&self) -> KvUsage {
        (**self).kv_usage()
    }
    fn export_kv(&self, seq: SeqId) -> crate::Result<Vec<u8>> {
        (**self).export_kv(seq)
    }
    fn import_kv(&mut self, seq: SeqId, payload: &[u8]) -> crate::Result<()> {
        (**self).import_kv(seq, payload)
    }
}
