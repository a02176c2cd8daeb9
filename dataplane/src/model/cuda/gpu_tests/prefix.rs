//! The prefix cache on the CUDA runner: a prompt that shares whole blocks with an earlier
//! one computes only the rest, and its outputs are bit for bit those of the same prompt
//! computed without the cache in the same two steps (the cached blocks, then the rest).
//! Unlike the CPU kernels, the CUDA matrix kernels give a token other bits in batches of
//! other sizes (the warp-per-row kernel up to 16 tokens, the tiled one beyond), so the
//! reference takes the same steps rather than the whole prompt at once.

use super::*;

/// Greedy tokens and the bits of every logits row that chose them, from `first` (a step
/// of prompt tokens) then `n - 1` decode steps.
fn run(r: &mut CudaModelRunner, seq: u64, first: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<u32>>) {
    let (mut toks, mut bits) = (Vec::new(), Vec::new());
    let mut input = first.to_vec();
    for _ in 0..n {
        let l = logits(r, seq, &input);
        let t = argmax(&l);
        toks.push(t);
        bits.push(l.iter().map(|x| x.to_bits()).collect());
        input = vec![t];
    }
    (toks, bits)
}

#[test]
fn gpu_prefix_cache_hits_and_changes_no_output_bit() {
    let n = count("decode steps after each prompt", 6, 2);
    // A 45-token prefix (two whole 16-token blocks and part of a third), two prompts on it.
    let (model, vocab) = same_backend_model();
    let prefix: Vec<u32> = (0..45u32).map(|i| (i * 37 + 11) % vocab).collect();
    let with = |tail: &[u32]| -> Vec<u32> { prefix.iter().chain(tail).copied().collect() };
    let (a, b) = (
        with(&[17, 400, 9000 % vocab]),
        with(&[5, 6, 7, 8, 9, 10, 11, 12, 13]),
    );
    let rc = |prefix_cache| RunnerConfig {
        prefix_cache,
        ..RunnerConfig::with_kv_tokens(2048, tandem_kernels::GgmlType::F16)
    };
    let load = |prefix_cache| {
        CudaModelRunner::load(&model, rc(prefix_cache), 0, CudaOptions::default())
            .unwrap_or_else(|e| panic!("GPU test without a usable CUDA device: {e}"))
    };
    let mut cached = load(true);
    assert_eq!(cached.reserve_prompt(SeqId(1), &a, a.len() + n).unwrap(), 0);
    run(&mut cached, 1, &a, n);
    cached.free(SeqId(1));
    let hit = cached.reserve_prompt(SeqId(2), &b, b.len() + n).unwrap();
    assert_eq!(hit, 32, "two whole blocks of the shared prefix");
    assert_eq!(cached.seq_len(SeqId(2)), 32);
    let got = run(&mut cached, 2, &b[hit..], n);
    let u = cached.kv_usage();
    assert!(u.prefix.hit_tokens >= 32, "{u:?}");

    let mut plain = load(false);
    assert_eq!(plain.reserve_prompt(SeqId(2), &b, b.len() + n).unwrap(), 0);
    plain
        .step(&[StepInput {
            seq: SeqId(2),
            tokens: b[..hit].to_vec(),
            want_logits: false,
        }])
        .unwrap();
    let want = run(&mut plain, 2, &b[hit..], n);
    assert_eq!(got.0, want.0, "tokens");
    assert!(got.1 == want.1, "logits bits");
    println!(
        "prefix cache on CUDA: {hit} of {} prompt tokens cached, {n} steps bit-identical",
        b.len()
    );
}
