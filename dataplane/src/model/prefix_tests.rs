//! The prefix cache changes no output: greedy tokens and the bits of every logits row are
//! those of the same prompts computed in full without it, whatever the order of the
//! requests, their batching with each other, and evictions under memory pressure.

use std::sync::Arc;

use tandem_kernels::{CpuKernels, GgmlType, Kernels};

use super::synthetic::TinyLlama;
use super::*;
use crate::engine_api::{KvUsage, ModelRunner, SeqId, StepInput};
use crate::gguf::Gguf;

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy tokens and the bits of every logits row that chose them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Out {
    tokens: Vec<u32>,
    logits: Vec<Vec<u32>>,
}

struct Live {
    seq: SeqId,
    prompt: usize,
    prefilled: usize,
    out: Out,
}

/// Serve `waves` of requests on `r` as the engine does. A wave is a list of (step,
/// prompt index): the request is admitted (`reserve_prompt`) before that step of the
/// wave, and every step carries one chunk of at most `chunk` prompt tokens of each
/// prefilling request beside one token of each decoding one, until each has `n` tokens;
/// the next wave starts when all of this one are done. Outputs in the order served.
fn serve(
    r: &mut CpuModelRunner,
    prompts: &[Vec<u32>],
    waves: &[Vec<(usize, usize)>],
    n: usize,
    chunk: usize,
) -> Vec<(usize, Out)> {
    let mut served = Vec::new();
    let mut next_seq = 1;
    for wave in waves {
        let mut live: Vec<Live> = Vec::new();
        let mut step = 0;
        while step <= wave.iter().map(|a| a.0).max().unwrap_or(0)
            || live.iter().any(|l| l.out.tokens.len() < n)
        {
            for &(_, p) in wave.iter().filter(|a| a.0 == step) {
                let seq = SeqId(next_seq);
                next_seq += 1;
                let hit = r
                    .reserve_prompt(seq, &prompts[p], prompts[p].len() + n)
                    .unwrap();
                assert_eq!(r.seq_len(seq), hit);
                assert!(hit < prompts[p].len(), "at least one token is computed");
                live.push(Live {
                    seq,
                    prompt: p,
                    prefilled: hit,
                    out: Out {
                        tokens: vec![],
                        logits: vec![],
                    },
                });
            }
            step += 1;
            let mut batch = Vec::new();
            let mut owners = Vec::new();
            for (i, l) in live.iter_mut().enumerate() {
                let p = &prompts[l.prompt];
                if l.prefilled < p.len() {
                    let end = p.len().min(l.prefilled + chunk);
                    batch.push(StepInput {
                        seq: l.seq,
                        tokens: p[l.prefilled..end].to_vec(),
                        want_logits: end == p.len(),
                    });
                    l.prefilled = end;
                } else if l.out.tokens.len() < n {
                    batch.push(StepInput {
                        seq: l.seq,
                        tokens: vec![*l.out.tokens.last().unwrap()],
                        want_logits: true,
                    });
                } else {
                    continue;
                }
                owners.push(i);
            }
            if batch.is_empty() {
                continue;
            }
            let out = r.step(&batch).unwrap();
            for (i, logits) in owners.into_iter().zip(out) {
                if let Some(l) = logits {
                    let o = &mut live[i].out;
                    o.tokens.push(argmax(&l));
                    o.logits.push(l.iter().map(|x| x.to_bits()).collect());
                }
            }
        }
        for l in live {
            r.free(l.seq);
            served.push((l.prompt, l.out));
        }
    }
    served
}

/// One wave per prompt, in this order.
fn one_by_one(order: impl IntoIterator<Item = usize>) -> Vec<Vec<(usize, usize)>> {
    order.into_iter().map(|p| vec![(0, p)]).collect()
}

/// One wave: the prompts arrive `every` steps apart (0: all together).
fn arriving(order: impl IntoIterator<Item = usize>, every: usize) -> Vec<(usize, usize)> {
    order
        .into_iter()
        .enumerate()
        .map(|(i, p)| (i * every, p))
        .collect()
}

/// Each prompt alone, in one step, without a prefix cache: the reference.
fn reference(
    mk: &dyn Fn(usize, bool) -> CpuModelRunner,
    prompts: &[Vec<u32>],
    n: usize,
) -> Vec<Out> {
    let mut r = mk(4096, false);
    (0..prompts.len())
        .map(|p| {
            let got = serve(&mut r, prompts, &one_by_one([p]), n, usize::MAX);
            got.into_iter().next().unwrap().1
        })
        .collect()
}

/// Every scenario on runners from `mk(kv_tokens, prefix_cache)` gives the reference's
/// outputs bit for bit, with hits (and evictions where the pool is small) really seen.
fn check_bit_identical(
    mk: &dyn Fn(usize, bool) -> CpuModelRunner,
    prompts: &[Vec<u32>],
    n: usize,
    what: &str,
) {
    let want = reference(mk, prompts, n);
    let check = |served: Vec<(usize, Out)>, scenario: &str| {
        for (k, (p, out)) in served.into_iter().enumerate() {
            assert!(
                out == want[p],
                "{what}, {scenario}: request {k} (prompt {p}) differs"
            );
        }
    };
    let all = 0..prompts.len();

    // Roomy pool: one at a time in both orders, then all at once (a batch mixing hits,
    // misses, prefill chunks and decodes); then in chunks of 7 tokens arriving one step
    // apart, so that requests start while the ones they share a prefix with are still
    // computing it.
    let mut r = mk(4096, true);
    let mut waves = one_by_one(all.clone());
    waves.extend(one_by_one(all.clone().rev()));
    waves.push(arriving(all.clone(), 0));
    check(
        serve(&mut r, prompts, &waves, n, 64),
        "one by one, then together",
    );
    let mut r = mk(4096, true);
    let waves = [arriving(all.clone(), 1), arriving(all.clone().rev(), 2)];
    check(
        serve(&mut r, prompts, &waves, n, 7),
        "staggered, chunks of 7",
    );
    let u: KvUsage = r.kv_usage();
    assert!(
        u.prefix.hit_tokens >= 32 * (prompts.len() as u64),
        "{what}: {u:?}"
    );
    assert_eq!(u.blocks_used, 0, "{what}: every request freed its blocks");

    // A pool of ten blocks (two requests): prompts evict each other's prefixes.
    let mut r = mk(160, true);
    let mut waves = one_by_one([0, 4, 1, 5, 2, 0, 3, 1]);
    waves.extend([arriving([0, 1], 1), arriving([1, 2], 0)]);
    check(serve(&mut r, prompts, &waves, n, 16), "small pool");
    let u = r.kv_usage();
    assert!(
        u.prefix.evictions > 0,
        "{what}: no eviction was forced: {u:?}"
    );
    assert!(u.prefix.hit_tokens > 0, "{what}: {u:?}");
}

/// Prompts sharing a 45-token prefix (two whole blocks and part of a third), one that is
/// exactly two blocks of it (its last token is computed), and two unrelated ones.
fn prompts_sharing_a_prefix(vocab: u32, lens: [usize; 3]) -> Vec<Vec<u32>> {
    let prefix: Vec<u32> = (0..45u32).map(|i| (i * 37 + 11) % vocab).collect();
    let mut v: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(k, &len)| {
            let mut p = prefix.clone();
            p.extend((0..len as u32).map(|i| (i * 13 + 7 * k as u32 + 1) % vocab));
            p
        })
        .collect();
    v.push(prefix[..32].to_vec());
    v.push((0..50u32).map(|i| (i * 29 + 5) % vocab).collect());
    v.push((0..40u32).map(|i| (i * 31 + 3) % vocab).collect());
    v
}

#[test]
fn prefix_cache_outputs_are_bit_identical_on_a_tiny_model_for_every_kv_dtype() {
    let bytes = TinyLlama::default().to_bytes();
    let g = Arc::new(Gguf::from_bytes(bytes).unwrap());
    let k: Arc<dyn Kernels> = Arc::new(CpuKernels::new());
    let prompts = prompts_sharing_a_prefix(96, [1, 6, 30]);
    for dtype in [GgmlType::F16, GgmlType::Q8_0, GgmlType::F32] {
        let mk = |tokens: usize, prefix_cache: bool| {
            let rc = RunnerConfig {
                prefix_cache,
                ..RunnerConfig::with_kv_tokens(tokens, dtype)
            };
            CpuModelRunner::new(g.clone(), rc, k.clone()).unwrap()
        };
        check_bit_identical(&mk, &prompts, 5, &format!("KV {dtype}"));
    }
}

/// The real model with the serving binary's kernels and KV type.
#[test]
fn prefix_cache_outputs_are_bit_identical_on_the_real_model() {
    let g = Arc::new(Gguf::open(&crate::test_support::model_path()).unwrap());
    let k: Arc<dyn Kernels> = Arc::new(CpuKernels::new());
    let prompts = prompts_sharing_a_prefix(49152, [3, 9, 20]);
    let mk = |tokens: usize, prefix_cache: bool| {
        let rc = RunnerConfig {
            prefix_cache,
            ..RunnerConfig::with_kv_tokens(tokens, GgmlType::F16)
        };
        CpuModelRunner::new(g.clone(), rc, k.clone()).unwrap()
    };
    check_bit_identical(&mk, &prompts, 3, "SmolLM2, KV F16");
}

/// PD with a prefix on the decode: the decode finds the prefix in its own cache, the
/// prefill exports only the rest, and the stitched sequence continues exactly as the
/// prefill's own would; every misuse fails without side effects.
#[test]
fn a_suffix_export_stitched_after_a_cached_prefix_continues_identically() {
    let g = Arc::new(Gguf::from_bytes(TinyLlama::default().to_bytes()).unwrap());
    let k: Arc<dyn Kernels> = Arc::new(CpuKernels::new());
    for dtype in [GgmlType::F16, GgmlType::Q8_0, GgmlType::F32] {
        let mk = || {
            let rc = RunnerConfig::with_kv_tokens(1024, dtype);
            CpuModelRunner::new(g.clone(), rc, k.clone()).unwrap()
        };
        let prompts = prompts_sharing_a_prefix(96, [3, 20, 1]);
        let (earlier, prompt) = (&prompts[0], &prompts[1]);
        let (mut prefill, mut decode) = (mk(), mk());
        // The decode served an earlier prompt with the same 45-token prefix (its KV
        // imported whole, as PD does), so two whole blocks of it are cached there.
        let s0 = SeqId(1);
        prefill.reserve_prompt(s0, earlier, earlier.len()).unwrap();
        prefill.step(&[step_all(s0, earlier)]).unwrap();
        assert_eq!(
            decode
                .reserve_prompt(s0, earlier, earlier.len() + 4)
                .unwrap(),
            0
        );
        decode
            .import_kv(s0, &prefill.export_kv(s0).unwrap())
            .unwrap();
        decode.free(s0);
        prefill.free(s0);

        let s = SeqId(2);
        let cached = decode.reserve_prompt(s, prompt, prompt.len() + 4).unwrap();
        assert_eq!(cached, 32, "{dtype}");
        let first = prefill.step(&[step_all(s, prompt)]).unwrap()[0]
            .clone()
            .unwrap();
        let whole = prefill.export_kv(s).unwrap();
        let suffix = prefill.export_kv_from(s, cached).unwrap();
        let row = whole.len() - KvHeader::LEN;
        assert_eq!(
            suffix.len() - KvHeader::LEN,
            row / prompt.len() * (prompt.len() - cached),
            "only the suffix's bytes"
        );
        let used = decode.kv_usage();
        for (at, payload) in [(0, &suffix), (16, &suffix), (cached, &whole)] {
            assert!(decode.import_kv_after(s, at, payload).is_err(), "{at}");
            assert_eq!((decode.seq_len(s), decode.kv_usage()), (cached, used));
        }
        assert!(
            prefill.export_kv_from(s, 7).is_err(),
            "not a block boundary"
        );
        decode.import_kv_after(s, cached, &suffix).unwrap();
        assert_eq!(decode.seq_len(s), prompt.len());
        assert_eq!(
            decode.export_kv(s).unwrap(),
            whole,
            "{dtype}: stitched = whole"
        );
        // Both continue with the same token to the same logits bits.
        let t = argmax(&first);
        let a = prefill.step(&[step_all(s, &[t])]).unwrap()[0]
            .clone()
            .unwrap();
        let b = decode.step(&[step_all(s, &[t])]).unwrap()[0]
            .clone()
            .unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b), "{dtype}");
    }
}

fn step_all(seq: SeqId, tokens: &[u32]) -> StepInput {
    StepInput {
        seq,
        tokens: tokens.to_vec(),
        want_logits: true,
    }
}
