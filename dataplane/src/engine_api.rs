//! The contract between the model runner (weights + forward pass + paged KV cache) and
//! the scheduler / HTTP layers above it. The scheduler never touches tensors; the
//! runner never sees requests, only sequences and token ids.

use crate::sampling::{Sampler, TokenLogprob};

/// One sampled token and, when its request asked for them, its log-probabilities.
pub type Sampled = (u32, Option<TokenLogprob>);

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
    /// Blocks referenced by sequences. The others are free for new sequences: really
    /// free, or idle prefix-cache blocks that are evicted when needed.
    pub blocks_used: usize,
    /// Blocks in the prefix cache, referenced or idle.
    pub blocks_cached: usize,
    pub prefix: PrefixCacheCounters,
}

/// Cumulative prefix-cache counters of a runner (all zero when it has no prefix cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixCacheCounters {
    /// Prompt tokens of the sequences that looked for a cached prefix.
    pub lookup_tokens: u64,
    /// Of those, the tokens found in the cache (not computed again).
    pub hit_tokens: u64,
    /// Idle cached blocks given up for new ones.
    pub evictions: u64,
}

/// The keys of the blocks a runner's prefix cache holds, at one version of it (see
/// `model::prefix_cache`: chained FNV-1a keys of whole KV blocks).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixKeys {
    pub version: u64,
    pub keys: Vec<u64>,
}

/// A model runner: owns weights and the paged KV cache. Not shared between threads; the
/// scheduler thread owns it.
pub trait ModelRunner: Send {
    fn info(&self) -> &ModelInfo;

    /// Reserve KV capacity so that `seq` can hold `total_tokens` tokens in all. Creates the
    /// sequence if it does not exist. Fails without side effects when blocks are short.
    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> crate::Result<()>;

    /// [`ModelRunner::reserve`] for a new sequence whose first tokens will be `prompt`,
    /// reusing the longest cached prefix of it (whole KV blocks, never all of the prompt:
    /// at least one token is left to compute so its logits exist). Returns the number of
    /// prompt tokens the sequence already holds (`seq_len(seq)`); the caller steps only
    /// the rest. The runner remembers the prompt so that its whole blocks are cached once
    /// computed. The default (no prefix cache) reserves and returns 0.
    fn reserve_prompt(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        total_tokens: usize,
    ) -> crate::Result<usize> {
        let _ = prompt;
        self.reserve(seq, total_tokens)?;
        Ok(0)
    }

    /// Run one forward step over a batch of sequences. Returns, in input order, one entry
    /// per input: `Some(logits)` (length `vocab_size`) where `want_logits`, else `None`.
    /// Every weight matrix is read once for the whole batch.
    fn step(&mut self, batch: &[StepInput]) -> crate::Result<Vec<Option<Vec<f32>>>>;

    /// Run one forward step and sample: `samplers[i]` is the sampler of `batch[i]`'s
    /// request. Returns, in input order, `Some(token)` for each entry that gets logits,
    /// `None` for the others. The default runs [`ModelRunner::step`] and
    /// [`Sampler::sample`] on every row, so results are exactly those of step + sample; a
    /// device runner overrides it to sample where the logits are and move only token ids
    /// (it must keep each sampler's results and stream of random draws). A runner that
    /// returns a wrong number of outputs from `step` returns that many here as well.
    fn step_sample(
        &mut self,
        batch: &[StepInput],
        samplers: &mut [&mut Sampler],
    ) -> crate::Result<Vec<Option<Sampled>>> {
        check_samplers(batch, samplers)?;
        let out = self.step(batch)?;
        Ok(sample_on_host(out, samplers))
    }

    /// Number of tokens currently stored for `seq` (0 if unknown).
    fn seq_len(&self, seq: SeqId) -> usize;

    /// Drop a sequence and return its blocks to the free pool at once.
    fn free(&mut self, seq: SeqId);

    fn kv_usage(&self) -> KvUsage;

    /// The prefix cache's keys when it changed since version `since`; `None` when it did
    /// not, or there is no prefix cache (the default).
    fn prefix_keys(&self, since: u64) -> Option<PrefixKeys> {
        let _ = since;
        None
    }

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

    /// [`ModelRunner::export_kv`] of the tokens from `start` on (whole KV blocks: the
    /// prefix the importing side holds in its prefix cache).
    fn export_kv_from(&self, seq: SeqId, start: usize) -> crate::Result<Vec<u8>> {
        if start == 0 {
            return self.export_kv(seq);
        }
        Err(crate::Error::KvTransfer(format!(
            "export of {seq:?} from token {start}: not supported by this runner"
        )))
    }

    /// [`ModelRunner::import_kv`] after the `prefix` tokens `seq` holds already (the
    /// cached prefix [`ModelRunner::reserve_prompt`] found): the payload is an export from
    /// `prefix` on, appended to them.
    fn import_kv_after(&mut self, seq: SeqId, prefix: usize, payload: &[u8]) -> crate::Result<()> {
        if prefix == 0 {
            return self.import_kv(seq, payload);
        }
        Err(crate::Error::KvTransfer(format!(
            "import into {seq:?} after {prefix} tokens: not supported by this runner"
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
    fn reserve_prompt(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        total_tokens: usize,
    ) -> crate::Result<usize> {
        (**self).reserve_prompt(seq, prompt, total_tokens)
    }
    fn step(&mut self, batch: &[StepInput]) -> crate::Result<Vec<Option<Vec<f32>>>> {
        (**self).step(batch)
    }
    fn step_sample(
        &mut self,
        batch: &[StepInput],
        samplers: &mut [&mut Sampler],
    ) -> crate::Result<Vec<Option<Sampled>>> {
        (**self).step_sample(batch, samplers)
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
    fn prefix_keys(&self, since: u64) -> Option<PrefixKeys> {
        (**self).prefix_keys(since)
    }
    fn export_kv(&self, seq: SeqId) -> crate::Result<Vec<u8>> {
        (**self).export_kv(seq)
    }
    fn import_kv(&mut self, seq: SeqId, payload: &[u8]) -> crate::Result<()> {
        (**self).import_kv(seq, payload)
    }
    fn export_kv_from(&self, seq: SeqId, start: usize) -> crate::Result<Vec<u8>> {
        (**self).export_kv_from(seq, start)
    }
    fn import_kv_after(&mut self, seq: SeqId, prefix: usize, payload: &[u8]) -> crate::Result<()> {
        (**self).import_kv_after(seq, prefix, payload)
    }
}

/// The contract of [`ModelRunner::step_sample`]: one sampler per batch entry.
pub fn check_samplers(batch: &[StepInput], samplers: &[&mut Sampler]) -> crate::Result<()> {
    if samplers.len() != batch.len() {
        return Err(crate::Error::InvalidInput(format!(
            "{} samplers for a batch of {}",
            samplers.len(),
            batch.len()
        )));
    }
    Ok(())
}

/// Sample every row of `step` output on the host, in order (the default `step_sample`).
pub fn sample_on_host(
    logits: Vec<Option<Vec<f32>>>,
    samplers: &mut [&mut Sampler],
) -> Vec<Option<Sampled>> {
    logits
        .into_iter()
        .enumerate()
        .map(|(i, l)| {
            let l = l?;
            samplers.get_mut(i).map(|s| s.sample(&l))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::gguf::Gguf;
    use crate::model::synthetic::TinyLlama;
    use crate::model::{CpuModelRunner, RunnerConfig};
    use crate::sampling::SamplingParams;
    use crate::test_support::fake_runner::fake;

    fn tiny() -> CpuModelRunner {
        let g = Arc::new(Gguf::from_bytes(TinyLlama::default().to_bytes()).unwrap());
        let rc = RunnerConfig::with_kv_tokens(1024, tandem_kernels::GgmlType::F16);
        CpuModelRunner::new(g, rc, Arc::new(tandem_kernels::ScalarKernels)).unwrap()
    }

    fn params(i: usize) -> SamplingParams {
        let table = [
            (0.0, 0, 1.0, None),
            (1.0, 0, 1.0, Some(3)),
            (0.8, 7, 1.0, None),
            (1.2, 0, 0.9, None),
            (0.6, 20, 0.7, Some(1)),
        ];
        let (temperature, top_k, top_p, logprobs) = table[i % table.len()];
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(1000 + i as u64),
            logprobs,
            ..Default::default()
        }
    }

    /// Drive `r` for `steps` steps over five sequences (prompts of different lengths, then
    /// one token each), by `step_sample` or by `step` + `Sampler::sample`; the tokens and
    /// logprobs of every step.
    fn drive<R: ModelRunner>(r: &mut R, by_step_sample: bool, steps: usize) -> Vec<Sampled> {
        let mut samplers: Vec<Sampler> = (0..5).map(|i| Sampler::new(params(i))).collect();
        let mut next: Vec<Vec<u32>> = (0..5u32)
            .map(|i| (0..2 + 3 * i).map(|j| (7 * i + j + 1) % 90).collect())
            .collect();
        for i in 0..5u64 {
            r.reserve(SeqId(i), 64).unwrap();
        }
        let mut got = Vec::new();
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
            let out = if by_step_sample {
                let mut refs: Vec<&mut Sampler> = samplers.iter_mut().collect();
                r.step_sample(&batch, &mut refs).unwrap()
            } else {
                let logits = r.step(&batch).unwrap();
                logits
                    .into_iter()
                    .zip(samplers.iter_mut())
                    .map(|(l, s)| l.map(|l| s.sample(&l)))
                    .collect()
            };
            for (i, o) in out.into_iter().enumerate() {
                let o = o.expect("every entry wants logits");
                next[i] = vec![o.0];
                got.push(o);
            }
        }
        got
    }

    #[test]
    fn default_step_sample_is_step_then_sample_bit_for_bit() {
        // CPU runner on a tiny random model: same tokens, same logprob bits, every step.
        let a = drive(&mut tiny(), false, 6);
        let b = drive(&mut tiny(), true, 6);
        assert_eq!(a.len(), 30);
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.0, y.0);
            let bits = |t: &Option<TokenLogprob>| {
                t.as_ref().map(|t| {
                    let top: Vec<(u32, u32)> =
                        t.top.iter().map(|(i, l)| (*i, l.to_bits())).collect();
                    (t.token, t.logprob.to_bits(), top)
                })
            };
            assert_eq!(bits(&x.1), bits(&y.1));
        }
        // Through a boxed runner (how the binary holds it) too.
        let mut boxed: Box<dyn ModelRunner> = Box::new(tiny());
        assert_eq!(drive(&mut boxed, true, 6), a);
        // And on the scheduler tests' toy runner.
        let (mut f1, _) = fake(1000);
        let (mut f2, _) = fake(1000);
        assert_eq!(drive(&mut f1, false, 8), drive(&mut f2, true, 8));
    }

    #[test]
    fn step_sample_requires_one_sampler_per_entry() {
        let mut r = tiny();
        r.reserve(SeqId(1), 8).unwrap();
        let batch = [StepInput {
            seq: SeqId(1),
            tokens: vec![3],
            want_logits: true,
        }];
        let err = r.step_sample(&batch, &mut []).unwrap_err().to_string();
        assert!(err.contains("0 samplers for a batch of 1"), "{err}");
        assert_eq!(r.seq_len(SeqId(1)), 0, "nothing ran");
        // Entries without logits (non-final prompt chunks) sample nothing.
        let mut s = Sampler::new(params(1));
        let out = r
            .step_sample(
                &[StepInput {
                    want_logits: false,
                    ..batch[0].clone()
                }],
                &mut [&mut s],
            )
            .unwrap();
        assert!(out[0].is_none());
    }
}
