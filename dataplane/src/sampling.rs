//! Token sampling: greedy, temperature, top-k, top-p with a per-request seeded RNG, plus
//! optional log-probabilities of the chosen and top-n tokens.

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
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            logprobs: None,
        }
    }
}

/// The chosen token's log-probability and the `n` most likely alternatives, under the
/// model's unmodified distribution (before temperature and cuts), as OpenAI reports them.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        Self {
            params,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// Consume the random draw of one sample without sampling. A decode continuing from a
    /// first token that a prefill sampled with the same seed skips that draw, so seeded
    /// output is the same as when one process samples every token.
    pub fn skip_draw(&mut self) {
        if self.params.temperature > 0.0 {
            let _ = self.rng.random::<f32>();
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> (u32, Option<TokenLogprob>) {
        let token = if self.params.temperature <= 0.0 {
            argmax(logits)
        } else {
            self.sample_random(logits)
        };
        let lp = self.params.logprobs.map(|n| logprobs(logits, token, n));
        (token, lp)
    }

    fn sample_random(&mut self, logits: &[f32]) -> u32 {
        let inv_t = 1.0 / self.params.temperature;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, l * inv_t))
            .collect();
        if cand.is_empty() {
            return argmax(logits);
        }
        let by_logit_desc =
            |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = self.params.top_k;
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
        let p = self.params.top_p;
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
        let total: f32 = probs.iter().sum();
        let mut r = self.rng.random::<f32>() * total;
        for (i, &pr) in probs.iter().enumerate() {
            if r < pr {
                return cand[i].0;
            }
            r -= pr;
        }
        cand[probs.len() - 1].0
    }
}

/// Index of the largest logit; the lowest index wins ties.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
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

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, 3.0, -1.0, 0.5]
    }

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(seed),
            logprobs: None,
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
}
