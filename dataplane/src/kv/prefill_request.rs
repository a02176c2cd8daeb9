//! PREFILL's content: the prompt, the decode's cached prefix, and how to sample the first
//! token, with the one conversion of sampling parameters to and from their wire form.

use crate::sampling::{InvalidSampling, SamplingParams};

/// A prompt and how to sample its first token: the decode's own [`SamplingParams`], so
/// that the prefill samples exactly as the decode would (the penalties see the prompt, and
/// `min_tokens` masks the tokens that would end generation). On the wire the parameters are
/// a [`WireSampling`]; the codec converts, and a PREFILL whose parameters are out of their
/// limits does not decode.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PrefillRequest {
    pub tokens: Vec<u32>,
    pub sampling: SamplingParams,
    /// Leading prompt tokens whose KV the decode holds already (its prefix cache; whole
    /// KV blocks, fewer than `tokens`): their KV is not sent.
    pub cached_tokens: u32,
}

/// The sampling parameters as a PREFILL carries them, field for field in the frame's order
/// (module header of `kv`). The one conversion each way: [`From<&SamplingParams>`] narrows
/// counts to `u32` (saturating: a `top_k` or `min_tokens` past `u32::MAX` means the same as
/// `u32::MAX`, more than any vocabulary or context), and [`TryFrom<WireSampling>`] checks
/// every limit with [`SamplingParams::validate`].
#[derive(Debug, Clone, PartialEq)]
pub struct WireSampling {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub seed: Option<u64>,
    pub logprobs: Option<u32>,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub min_tokens: u32,
    pub min_tokens_masked: Vec<u32>,
}

fn narrow(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl From<&SamplingParams> for WireSampling {
    fn from(p: &SamplingParams) -> Self {
        Self {
            temperature: p.temperature,
            top_k: narrow(p.top_k),
            top_p: p.top_p,
            seed: p.seed,
            logprobs: p.logprobs.map(narrow),
            repetition_penalty: p.repetition_penalty,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            min_tokens: narrow(p.min_tokens),
            min_tokens_masked: p.min_tokens_masked.clone(),
        }
    }
}

impl TryFrom<WireSampling> for SamplingParams {
    type Error = InvalidSampling;

    fn try_from(w: WireSampling) -> Result<Self, InvalidSampling> {
        let p = SamplingParams {
            temperature: w.temperature,
            top_k: w.top_k as usize,
            top_p: w.top_p,
            seed: w.seed,
            logprobs: w.logprobs.map(|n| n as usize),
            repetition_penalty: w.repetition_penalty,
            frequency_penalty: w.frequency_penalty,
            presence_penalty: w.presence_penalty,
            min_tokens: w.min_tokens as usize,
            min_tokens_masked: w.min_tokens_masked,
        };
        p.validate()?;
        Ok(p)
    }
}
