//! Token sampling: greedy, temperature, top-k, top-p with a per-request seeded RNG, plus
//! optional log-probabilities of the chosen and top-n tokens.
//!
//! Before any of that, a sampler may adjust its sequence's logits (a copy; the model's row
//! is never written): `min_tokens` masks the tokens that would end generation, and the
//! repetition, frequency and presence penalties lower the logits of tokens already seen.
//! The adjustment reads only this sampler's own history, so a sequence's output does not
//! depend on what else is in its batch; with the default parameters nothing is adjusted
//! and sampling reads the model's logits as before, bit for bit.

use std::collections::{HashMap, HashSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 (or below) means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1.0 means no nucleus cut.
    pub top_p: f32,
    /// Same seed and same logits -> same tokens. None: a random seed.
    pub seed: Option<u64>,
    /// Return this many top alternatives (and the chosen token's logprob) per token.
    pub logprobs: Option<usize>,
    /// Hugging Face's repetition penalty over the prompt and the generated tokens: the
    /// logit of every token seen so far is divided by it when positive, multiplied by it
    /// when negative. 1.0 means none.
    pub repetition_penalty: f32,
    /// OpenAI's penalties over the generated tokens: a token generated `c` times has its
    /// logit lowered by `frequency_penalty × c`, then by `presence_penalty` if `c > 0`.
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// While fewer than this many tokens were generated, the tokens of `min_tokens_masked`
    /// (those that would end generation) cannot be sampled.
    pub min_tokens: usize,
    pub min_tokens_masked: Vec<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            logprobs: None,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            min_tokens: 0,
            min_tokens_masked: Vec::new(),
        }
    }
}

/// The limits of every sampling parameter, for every way one arrives (the HTTP API and
/// the PREFILL of a decode): [`SamplingParams::validate`] checks them, and the HTTP layer
/// names them in its errors.
pub mod limits {
    use std::ops::RangeInclusive;

    pub const TEMPERATURE: RangeInclusive<f32> = 0.0..=2.0;
    /// Above 0: a nucleus of no probability mass is no nucleus.
    pub const TOP_P: RangeInclusive<f32> = f32::MIN_POSITIVE..=1.0;
    /// OpenAI's range of `frequency_penalty` and `presence_penalty`.
    pub const PENALTY: RangeInclusive<f32> = -2.0..=2.0;
    /// Most top alternatives returned per token (OpenAI's `top_logprobs` limit).
    pub const MAX_LOGPROBS: usize = 20;
    /// Most token ids masked until `min_tokens` (1024 `stop_token_ids` plus a model's
    /// end-of-generation tokens).
    pub const MAX_MASKED: usize = 4096;
}

/// A sampling parameter out of its limits: which one, and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("'{field}' {reason}")]
pub struct InvalidSampling {
    /// The field of [`SamplingParams`].
    pub field: &'static str,
    pub reason: String,
}

impl SamplingParams {
    /// Every limit of [`limits`], the one check of sampling parameters wherever they come
    /// from. Non-finite numbers are out of every range.
    pub fn validate(&self) -> Result<(), InvalidSampling> {
        let bad = |field: &'static str, reason: String| Err(InvalidSampling { field, reason });
        let within = |field: &'static str, v: f32, r: &std::ops::RangeInclusive<f32>| {
            if r.contains(&v) {
                Ok(())
            } else {
                bad(
                    field,
                    format!("must be between {} and {}, got {v}", r.start(), r.end()),
                )
            }
        };
        within("temperature", self.temperature, &limits::TEMPERATURE)?;
        within("top_p", self.top_p, &limits::TOP_P)?;
        within(
            "frequency_penalty",
            self.frequency_penalty,
            &limits::PENALTY,
        )?;
        within("presence_penalty", self.presence_penalty, &limits::PENALTY)?;
        let rp = self.repetition_penalty;
        if !(rp.is_finite() && rp > 0.0) {
            return bad(
                "repetition_penalty",
                format!("must be greater than 0, got {rp}"),
            );
        }
        if let Some(n) = self.logprobs
            && n > limits::MAX_LOGPROBS
        {
            return bad(
                "logprobs",
                format!("must be at most {}, got {n}", limits::MAX_LOGPROBS),
            );
        }
        if self.min_tokens_masked.len() > limits::MAX_MASKED {
            return bad(
                "min_tokens_masked",
                format!(
                    "has {} ids; at most {} are accepted",
                    self.min_tokens_masked.len(),
                    limits::MAX_MASKED
                ),
            );
        }
        Ok(())
    }

    /// Whether any penalty is on (they need the sequence's history).
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }
}

/// The chosen token's log-probability and the `n` most likely alternatives, under the
/// model's unmodified distribution (before penalties, `min_tokens` masking, temperature
/// and cuts), as OpenAI reports them.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Tokens generated so far (every one passed to [`Sampler::accept`]).
    generated: usize,
    /// The prompt's and generated tokens, kept only with a repetition penalty.
    seen: HashSet<u32>,
    /// How often each token was generated, kept only with a frequency or presence penalty.
    counts: HashMap<u32, u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        Self {
            params,
            rng: StdRng::seed_from_u64(seed),
            generated: 0,
            seen: HashSet::new(),
            counts: HashMap::new(),
        }
    }

    /// A sampler for a sequence that starts with `prompt` (the repetition penalty counts
    /// the prompt's tokens as seen).
    pub fn with_prompt(params: SamplingParams, prompt: &[u32]) -> Self {
        let mut s = Self::new(params);
        if s.params.repetition_penalty != 1.0 {
            s.seen.extend(prompt);
        }
        s
    }

    /// Record a token of the sequence, whoever sampled it (this sampler, a device, or the
    /// prefill of another process): the penalties and `min_tokens` count it from now on.
    pub fn accept(&mut self, token: u32) {
        self.generated += 1;
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token);
        }
        if self.params.frequency_penalty != 0.0 || self.params.presence_penalty != 0.0 {
            *self.counts.entry(token).or_insert(0) += 1;
        }
    }

    /// Whether the next sample adjusts the logits (a penalty is on, or `min_tokens`
    /// still masks tokens). A device that samples by itself leaves such rows to
    /// [`Sampler::sample`].
    pub fn adjusts_logits(&self) -> bool {
        self.params.has_penalties() || self.masks_now()
    }

    fn masks_now(&self) -> bool {
        self.generated < self.params.min_tokens && !self.params.min_tokens_masked.is_empty()
    }

    /// A copy of `logits` with `min_tokens` masking and the penalties applied. Each token
    /// is adjusted at most once per rule, so the order of the sets does not matter.
    fn adjusted(&self, logits: &[f32]) -> Vec<f32> {
        let mut l = logits.to_vec();
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen {
                if let Some(x) = l.get_mut(t as usize) {
                    *x = if *x < 0.0 {
                        *x * p.repetition_penalty
                    } else {
                        *x / p.repetition_penalty
                    };
                }
            }
        }
        for (&t, &c) in &self.counts {
            if let Some(x) = l.get_mut(t as usize) {
                *x -= p.frequency_penalty * c as f32;
                *x -= p.presence_penalty;
            }
        }
        if self.masks_now() {
            for &t in &p.min_tokens_masked {
                if let Some(x) = l.get_mut(t as usize) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        l
    }

    /// Consume the random draw of one sample without sampling. A decode continuing from a
    /// first token that a prefill sampled with the same seed skips that draw, so seeded
    /// output is the same as when one process samples every token.
    pub fn skip_draw(&mut self) {
        if self.params.temperature > 0.0 {
            let _ = self.rng.random::<f32>();
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Pick the next token from `logits` (adjusted first when [`Sampler::adjusts_logits`];
    /// log-probabilities are always those of the model's own `logits`). The token is not
    /// recorded: the caller passes it to [`Sampler::accept`].
    pub fn sample(&mut self, logits: &[f32]) -> (u32, Option<TokenLogprob>) {
        let adjusted = self.adjusts_logits().then(|| self.adjusted(logits));
        let l = adjusted.as_deref().unwrap_or(logits);
        let token = if self.params.temperature <= 0.0 {
            argmax(l)
        } else {
            self.sample_random(l)
        };
        (token, self.logprobs_of(logits, token))
    }

    /// The random number the next sample uses, drawn now: `None` when greedy (no draw).
    /// With [`Sampler::sample_drawn`] this splits [`Sampler::sample`] in two, so that a
    /// device can pick the token: the stream of draws is the same as with `sample`, one
    /// per token when `temperature > 0` (the one exception: a row without any finite
    /// logit, where `sample` takes the argmax without drawing).
    pub fn draw(&mut self) -> Option<f32> {
        (self.params.temperature > 0.0).then(|| self.rng.random::<f32>())
    }

    /// What [`Sampler::sample`] returns for `logits` when its draw is `u` (from
    /// [`Sampler::draw`]); consumes no randomness.
    pub fn sample_drawn(&self, logits: &[f32], u: Option<f32>) -> (u32, Option<TokenLogprob>) {
        let adjusted = self.adjusts_logits().then(|| self.adjusted(logits));
        let l = adjusted.as_deref().unwrap_or(logits);
        let token = match u {
            Some(u) if self.params.temperature > 0.0 => nucleus(&self.params, l)
                .map_or_else(|| argmax(l), |(cand, probs)| pick(&cand, &probs, u)),
            _ => argmax(l),
        };
        (token, self.logprobs_of(logits, token))
    }

    fn logprobs_of(&self, logits: &[f32], token: u32) -> Option<TokenLogprob> {
        self.params.logprobs.map(|n| logprobs(logits, token, n))
    }

    fn sample_random(&mut self, logits: &[f32]) -> u32 {
        let Some((cand, probs)) = nucleus(&self.params, logits) else {
            return argmax(logits);
        };
        let u = self.rng.random::<f32>();
        pick(&cand, &probs, u)
    }
}

/// Candidates `(token, scaled logit)`, sorted, and the probabilities of those kept.
type Nucleus = (Vec<(u32, f32)>, Vec<f32>);

/// The candidates (sorted by scaled logit, descending, ties by id) and their normalized
/// probabilities after temperature, top-k and top-p; `None` when no logit is finite.
/// Only `temperature > 0` calls it.
fn nucleus(params: &SamplingParams, logits: &[f32]) -> Option<Nucleus> {
    let inv_t = 1.0 / params.temperature;
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_finite())
        .map(|(i, &l)| (i as u32, l * inv_t))
        .collect();
    if cand.is_empty() {
        return None;
    }
    let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let k = params.top_k;
    if k > 0 && k < cand.len() {
        cand.select_nth_unstable_by(k - 1, by_logit_desc);
        cand.truncate(k);
    }
    // A total order (ties by id) keeps sampling deterministic for a given seed.
    cand.sort_unstable_by(by_logit_desc);
    let max = cand[0].1;
    let mut probs: Vec<f32> = cand.iter().map(|&(_, l)| (l - max).exp()).collect();
    let sum: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
    let p = params.top_p;
    if p < 1.0 {
        // Smallest prefix whose mass reaches top_p; at least one token.
        let mut acc = 0.0;
        let keep = probs
            .iter()
            .position(|&x| {
                acc += x;
                acc >= p
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
    }
    Some((cand, probs))
}

/// The candidate whose share of the kept mass contains `u` in `[0, 1)`.
fn pick(cand: &[(u32, f32)], probs: &[f32], u: f32) -> u32 {
    let total: f32 = probs.iter().sum();
    let mut r = u * total;
    for (i, &pr) in probs.iter().enumerate() {
        if r < pr {
            return cand[i].0;
        }
        r -= pr;
    }
    cand[probs.len() - 1].0
}

/// Index of the largest logit; the lowest index wins ties (and NaNs are passed over, but
/// a NaN at index 0 wins, as in a left-to-right scan that keeps the first maximum).
pub fn argmax(logits: &[f32]) -> u32 {
    // Greedy decoding runs this over the whole vocabulary for every token: the maximum
    // over 16 independent lanes vectorizes, then one scan finds its first position.
    const LANES: usize = 16;
    match logits.first() {
        None => return 0,
        Some(x) if x.is_nan() => return 0,
        Some(_) => {}
    }
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            *m = if x > *m { x } else { *m };
        }
    }
    let max = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    logits.iter().position(|&x| x == max).unwrap_or(0) as u32
}

fn logprobs(logits: &[f32], token: u32, n: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(idx.len());
    let desc = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if n > 0 && n < idx.len() {
        idx.select_nth_unstable_by(n - 1, desc);
    }
    idx.truncate(n);
    idx.sort_unstable_by(desc);
    TokenLogprob {
        token,
        logprob: logits[token as usize] - lse,
        top: idx
            .into_iter()
            .map(|i| (i, logits[i as usize] - lse))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition: a left-to-right scan keeping the first strictly larger value.
    fn argmax_scan(logits: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &l) in logits.iter().enumerate() {
            if l > logits[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_equals_a_left_to_right_scan_including_ties_nans_and_infinities() {
        let mut cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![f32::NAN, 5.0, 7.0],
            vec![1.0, f32::NAN, 7.0, 7.0],
            vec![f32::NEG_INFINITY; 37],
            vec![-0.0, 0.0, -0.0],
            vec![0.0, -0.0],
            vec![2.0, f32::INFINITY, 3.0, f32::INFINITY],
            vec![f32::NAN; 20],
        ];
        let mut state = 7u64;
        for len in [1usize, 15, 16, 17, 33, 100, 49152] {
            let v: Vec<f32> = (0..len)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                    // Few distinct values, so ties across lanes and the tail are common.
                    ((state >> 60) as f32) - 7.0
                })
                .collect();
            cases.push(v);
        }
        let mut with_nans = cases.last().unwrap().clone();
        with_nans[3] = f32::NAN;
        with_nans[40000] = f32::NAN;
        cases.push(with_nans);
        for (i, c) in cases.iter().enumerate() {
            assert_eq!(argmax(c), argmax_scan(c), "case {i} (len {})", c.len());
        }
    }

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, 3.0, -1.0, 0.5]
    }

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(seed),
            ..Default::default()
        }
    }

    fn draw(p: SamplingParams, n: usize) -> Vec<u32> {
        let mut s = Sampler::new(p);
        (0..n).map(|_| s.sample(&logits()).0).collect()
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(draw(params(0.0, 0, 1.0, 1), 3), vec![1, 1, 1]);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let a = draw(params(1.0, 0, 1.0, 7), 64);
        assert_eq!(a, draw(params(1.0, 0, 1.0, 7), 64));
        assert_ne!(a, draw(params(1.0, 0, 1.0, 8), 64));
        // Sampling at T=1 over these logits visits more than the argmax.
        assert!(a.iter().any(|&t| t != 1));
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let k2 = draw(params(5.0, 2, 1.0, 3), 200);
        assert!(k2.iter().all(|&t| t == 1 || t == 3), "{k2:?}");
        assert!(k2.contains(&1) && k2.contains(&3));
        // At T=1, tokens 1 and 3 hold ~0.33 each, token 2 ~0.12: p=0.6 keeps only 1 and 3.
        let p = draw(params(1.0, 0, 0.6, 4), 200);
        assert!(p.iter().all(|&t| t == 1 || t == 3), "{p:?}");
    }

    #[test]
    fn empirical_frequencies_follow_the_softmax() {
        let mut s = Sampler::new(params(1.0, 0, 1.0, 11));
        let l = [0.0f32, (3.0f32).ln()]; // p = 0.25, 0.75
        let ones = (0..4000).filter(|_| s.sample(&l).0 == 1).count() as f32 / 4000.0;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
    }

    #[test]
    fn logprobs_are_normalized_and_sorted() {
        let mut s = Sampler::new(SamplingParams {
            logprobs: Some(3),
            ..params(0.0, 0, 1.0, 0)
        });
        let (tok, lp) = s.sample(&logits());
        let lp = lp.unwrap();
        assert_eq!(lp.token, tok);
        let total: f32 = logits()
            .iter()
            .map(|&l| (l + lp.logprob - logits()[tok as usize]).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5, "{total}");
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }

    #[test]
    fn draw_then_sample_drawn_equals_sample() {
        // The split the device path uses gives the same tokens, logprobs and stream of
        // draws as `sample`, for greedy, temperature, top-k, top-p and their mixes.
        let rows: Vec<Vec<f32>> = (0..40u32)
            .map(|r| {
                (0..50u32)
                    .map(|i| ((i * 7919 + r * 104_729) % 1000) as f32 / 125.0 - 4.0)
                    .collect()
            })
            .collect();
        for (t, k, p) in [
            (0.0, 0, 1.0),
            (1.0, 0, 1.0),
            (0.7, 5, 1.0),
            (1.3, 0, 0.8),
            (0.9, 10, 0.5),
            (2.0, 1, 1.0),
        ] {
            let params = SamplingParams {
                logprobs: Some(2),
                ..params(t, k, p, 99)
            };
            let (mut a, mut b) = (Sampler::new(params.clone()), Sampler::new(params));
            for l in &rows {
                let u = b.draw();
                assert_eq!(u.is_some(), t > 0.0);
                assert_eq!(a.sample(l), b.sample_drawn(l, u), "T {t} k {k} p {p}");
            }
            // Both consumed the same draws: the streams stay in step.
            assert_eq!(a.draw(), b.draw());
        }
    }

    #[test]
    fn sample_drawn_partitions_the_unit_interval_by_probability() {
        // T = 1 over ln(1), ln(3): token 1 owns [0, 0.75) (sorted first), token 0 the rest.
        let s = Sampler::new(params(1.0, 0, 1.0, 0));
        let l = [0.0f32, (3.0f32).ln()];
        assert_eq!(s.sample_drawn(&l, Some(0.0)).0, 1);
        assert_eq!(s.sample_drawn(&l, Some(0.7499)).0, 1);
        assert_eq!(s.sample_drawn(&l, Some(0.7501)).0, 0);
        assert_eq!(s.sample_drawn(&l, Some(0.9999)).0, 0);
        // No finite logit: the argmax, whatever the draw.
        let nan = [f32::NAN, f32::NEG_INFINITY];
        assert_eq!(s.sample_drawn(&nan, Some(0.5)).0, argmax(&nan));
        // Greedy ignores the draw.
        let g = Sampler::new(params(0.0, 0, 1.0, 0));
        assert_eq!(g.sample_drawn(&l, Some(0.9)).0, 1);
    }

    fn greedy() -> SamplingParams {
        params(0.0, 0, 1.0, 0)
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..greedy()
        };
        // Prompt has tokens 0 and 4 (and 4 twice: seen is a set, penalized once).
        let mut s = Sampler::with_prompt(p, &[0, 4, 4]);
        let l = [3.0, 2.5, -1.0, 1.0, -2.0, 0.0];
        assert_eq!(s.adjusted(&l), vec![1.5, 2.5, -1.0, 1.0, -4.0, 0.0]);
        // 3.0 / 2 = 1.5 < 2.5: greedy now picks token 1.
        assert_eq!(s.sample(&l).0, 1);
        // A generated token counts as seen too; zero stays zero.
        s.accept(1);
        s.accept(5);
        assert_eq!(s.adjusted(&l), vec![1.5, 1.25, -1.0, 1.0, -4.0, 0.0]);
        assert_eq!(s.sample(&l).0, 0);
    }

    #[test]
    fn frequency_and_presence_penalties_count_generated_tokens_only() {
        let p = SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..greedy()
        };
        // The prompt does not count for these penalties.
        let mut s = Sampler::with_prompt(p, &[0, 1, 2]);
        let l = [3.0, 2.0, 1.0, -1.0];
        assert_eq!(s.adjusted(&l), l.to_vec());
        s.accept(0);
        s.accept(0);
        s.accept(0);
        s.accept(3);
        // token 0: 3 - 0.5·3 - 0.25 = 1.25; token 3: -1 - 0.5 - 0.25 = -1.75.
        assert_eq!(s.adjusted(&l), vec![1.25, 2.0, 1.0, -1.75]);
        assert_eq!(s.sample(&l).0, 1);
        // Negative penalties encourage repetition (OpenAI allows −2..2).
        let mut s = Sampler::new(SamplingParams {
            frequency_penalty: -1.0,
            presence_penalty: -0.5,
            ..greedy()
        });
        s.accept(2);
        assert_eq!(s.adjusted(&l), vec![3.0, 2.0, 2.5, -1.0]);
    }

    #[test]
    fn min_tokens_masks_the_ending_tokens_until_enough_were_generated() {
        let p = SamplingParams {
            min_tokens: 2,
            min_tokens_masked: vec![0, 9999],
            logprobs: Some(1),
            ..greedy()
        };
        let mut s = Sampler::new(p);
        let l = [5.0, 1.0, 2.0];
        for _ in 0..2 {
            assert!(s.adjusts_logits());
            let (t, lp) = s.sample(&l);
            // Masked (an id past the vocabulary is skipped): the next best is taken ...
            assert_eq!(t, 2);
            // ... and the logprobs are still those of the model's own distribution.
            let lp = lp.unwrap();
            assert_eq!(lp.top[0].0, 0);
            assert!(lp.logprob < lp.top[0].1);
            s.accept(t);
        }
        assert!(!s.adjusts_logits());
        assert_eq!(s.sample(&l).0, 0);
        // Seeded sampling never draws a masked token either, through both entry points.
        let p = SamplingParams {
            min_tokens: 1000,
            min_tokens_masked: vec![0],
            ..params(1.0, 0, 1.0, 5)
        };
        let (mut a, mut b) = (Sampler::new(p.clone()), Sampler::new(p));
        for _ in 0..200 {
            let t = a.sample(&l).0;
            let u = b.draw();
            assert_eq!(b.sample_drawn(&l, u).0, t);
            assert_ne!(t, 0);
            a.accept(t);
            b.accept(t);
        }
    }

    #[test]
    fn default_parameters_do_not_touch_the_logits() {
        let mut s = Sampler::with_prompt(params(0.8, 3, 0.9, 21), &[0, 1, 2]);
        for t in [1, 1, 3] {
            s.accept(t);
        }
        assert!(!s.adjusts_logits());
        // Same tokens and draws as a sampler that never saw a history.
        let mut fresh = Sampler::new(params(0.8, 3, 0.9, 21));
        for _ in 0..50 {
            assert_eq!(s.sample(&logits()), fresh.sample(&logits()));
        }
    }

    #[test]
    fn penalties_with_sampling_keep_draw_and_sample_in_step() {
        let p = SamplingParams {
            repetition_penalty: 1.3,
            frequency_penalty: 0.4,
            presence_penalty: 0.2,
            logprobs: Some(2),
            ..params(0.9, 4, 0.95, 77)
        };
        let (mut a, mut b) = (
            Sampler::with_prompt(p.clone(), &[1, 3]),
            Sampler::with_prompt(p, &[1, 3]),
        );
        for _ in 0..100 {
            let x = a.sample(&logits());
            let u = b.draw();
            assert_eq!(b.sample_drawn(&logits(), u), x);
            a.accept(x.0);
            b.accept(x.0);
        }
    }
}
