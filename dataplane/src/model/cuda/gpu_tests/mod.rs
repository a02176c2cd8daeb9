//! GPU tests of the CUDA runner (feature `gpu-tests`): run on a GPU by `tests/gpu/run.sh`
//! and on the CPU executor of kernels/cuda-sim by `make cuda-sim` (`TANDEM_CUDA_SIM=1`);
//! without either they fail, never skip.
//!
//! Comparisons across backends. The CPU and CUDA kernels quantize activations to Q8 bit
//! for bit alike but sum floats in other orders, so one int8 rounding that goes the other
//! way perturbs everything downstream (tests/model_reference.rs measures that noise at
//! ~0.2 rms / ~0.7 max on the logits). Greedy outputs are therefore compared teacher-forced:
//! both runners are fed the reference's tokens, must pick the same token at every step
//! unless the reference's best two logits are within [`TIE_MARGIN`], and their logits must
//! stay within [`MAX_ABS`] / [`RMS`] — the bounds model_reference.rs sets for the same noise.
//! (A real defect — a wrong index, a missing barrier — moves logits by whole units.)
//! Comparisons on one backend (graphs on and off, device and host sampling of the same
//! logits, a KV transfer GPU to GPU, the prefix cache) are exact.
//!
//! On the CPU executor one SmolLM2 decode step costs ~40 M fiber switches (about half a
//! CPU-second), so [`count`] lowers the number of generated tokens and decode steps there,
//! the CUDA-against-CPU greedy test takes the three prompts with distinct kernel paths,
//! and the tests that compare CUDA with CUDA run on a synthetic model
//! ([`same_backend_model`]); every check keeps its meaning, and each change is printed.

mod architectures;
mod prefix;
mod sampling;

use tandem_kernels::cuda::launch::{self, SampleRow};

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::sampling::device_row;
use super::*;
use crate::model::CpuModelRunner;
use crate::model::synthetic::TinyLlama;
use crate::sampling::SamplingParams;

/// Largest |Δlogit| between backends (see the module header).
const MAX_ABS: f32 = 3.0;
/// Largest rms Δlogit between backends over a comparison.
const RMS: f32 = 0.45;
/// Below this margin between the reference's best two logits, the other backend may pick
/// the second.
const TIE_MARGIN: f32 = 1.0;

/// Whether these tests run on the CPU executor rather than a GPU.
fn on_executor() -> bool {
    #[cfg(feature = "cuda-sim")]
    {
        tandem_kernels::cuda::sim::requested()
    }
    #[cfg(not(feature = "cuda-sim"))]
    {
        false
    }
}

/// `gpu` on a GPU, `sim` on the CPU executor (printed).
fn count(what: &str, gpu: usize, sim: usize) -> usize {
    if on_executor() {
        println!("CPU executor: {what}: {sim} (a GPU runs {gpu})");
        sim
    } else {
        gpu
    }
}

fn gpu_runner(kv_tokens: usize) -> CudaModelRunner {
    gpu_runner_of(&crate::test_support::model_path(), kv_tokens)
}

fn gpu_runner_of(model: &Path, kv_tokens: usize) -> CudaModelRunner {
    let rc = RunnerConfig::with_kv_tokens(kv_tokens, tandem_kernels::GgmlType::F16);
    CudaModelRunner::load(model, rc, 0, CudaOptions::default())
        .unwrap_or_else(|e| panic!("GPU test without a usable CUDA device: {e}"))
}

/// The model of the tests that compare CUDA with CUDA (graphs on and off, device and host
/// sampling, the prefix cache): SmolLM2 on a GPU; on the CPU executor a synthetic
/// 2-layer Llama ([`TinyLlama`], GGUF written once into the temp directory) with
/// SmolLM2's tensor types (Q4_1 matrices, Q8_0 embedding tied to the output), head
/// size (64) and GQA ratio (3 query heads per KV head), and rows that are not multiples
/// of the matmul tiles (FFN 352, vocabulary 1000: past the sampler's 256 candidates).
/// These tests compare one backend with itself, exactly, so they mean the same on any
/// weights; SmolLM2 through the executor costs ~100x more per step. CUDA against the CPU
/// (`gpu_greedy_equals_cpu_for_five_prompts`, the KV transfer) stays on SmolLM2.
fn same_backend_model() -> (PathBuf, u32) {
    if !on_executor() {
        return (crate::test_support::model_path(), 49152);
    }
    static TINY: OnceLock<PathBuf> = OnceLock::new();
    let m = TinyLlama {
        n_layers: 2,
        dim: 192,
        ffn_dim: 352,
        n_heads: 3,
        n_kv_heads: 1,
        vocab: 1000,
        context_length: 4096,
        weight_type: tandem_kernels::GgmlType::Q4_1,
        embd_type: tandem_kernels::GgmlType::Q8_0,
        untied_output: false,
        seed: 18,
        ..TinyLlama::default()
    };
    let path = TINY.get_or_init(|| {
        let bytes = m.to_bytes();
        // Named by its content (FNV-1a), so that every run and test binary shares one file.
        let hash = bytes.iter().fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ *b as u64).wrapping_mul(0x100000001b3)
        });
        let path =
            std::env::temp_dir().join(format!("tandem-cuda-sim-tiny-llama-{hash:016x}.gguf"));
        if !path.is_file() {
            let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
            std::fs::write(&tmp, &bytes).unwrap();
            std::fs::rename(&tmp, &path).unwrap();
        }
        println!(
            "CPU executor: CUDA-vs-CUDA tests on {} (a GPU runs SmolLM2)",
            path.display()
        );
        path
    });
    (path.clone(), m.vocab as u32)
}

fn prompts() -> Vec<Vec<u32>> {
    // Five prompts as token ids: "The capital of France is", then arbitrary valid ids
    // of various lengths (40 tokens spans several prefill tiles and 3 KV blocks).
    vec![
        vec![504, 3575, 282, 4649, 314],
        vec![1780, 314, 253, 1345, 30, 378, 436],
        vec![2683, 253, 2283, 563, 2066, 28, 216, 31, 28],
        vec![504, 1345, 282, 3807, 314],
        (1..=40).map(|i| 100 + 37 * i).collect(),
    ]
}

/// [`prompts`] with every id reduced modulo a smaller vocabulary.
fn prompts_in(vocab: u32) -> Vec<Vec<u32>> {
    let mut p = prompts();
    p.iter_mut().flatten().for_each(|t| *t %= vocab);
    p
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn greedy<R: ModelRunner + ?Sized>(r: &mut R, seq: u64, prompt: &[u32], n: usize) -> Vec<u32> {
    let step = |r: &mut R, toks: Vec<u32>| {
        let out = r
            .step(&[StepInput {
                seq: SeqId(seq),
                tokens: toks,
                want_logits: true,
            }])
            .unwrap();
        argmax(out[0].as_ref().unwrap())
    };
    let mut toks = vec![step(r, prompt.to_vec())];
    while toks.len() < n {
        let t = step(r, vec![*toks.last().unwrap()]);
        toks.push(t);
    }
    toks
}

fn logits<R: ModelRunner + ?Sized>(r: &mut R, seq: u64, tokens: &[u32]) -> Vec<f32> {
    let out = r
        .step(&[StepInput {
            seq: SeqId(seq),
            tokens: tokens.to_vec(),
            want_logits: true,
        }])
        .unwrap();
    out.into_iter().next().unwrap().unwrap()
}

/// Feed `input`, then `n - 1` times the reference's greedy token, to two runs: `both`
/// steps the reference and the other run on one input and returns their logits. Every
/// step's logits are compared bit for bit when `exact`, else within the cross-backend
/// bounds, the picks equal except at a near tie of the reference. The reference's tokens.
fn teacher_forced(
    what: &str,
    input: &[u32],
    n: usize,
    exact: bool,
    mut both: impl FnMut(&[u32]) -> (Vec<f32>, Vec<f32>),
) -> Vec<u32> {
    let mut input = input.to_vec();
    let (mut toks, mut worst, mut sq, mut values, mut ties) = (Vec::new(), 0f32, 0f64, 0usize, 0);
    for step in 0..n {
        let (want, got) = both(&input);
        if exact {
            assert!(
                want.iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}: step {step}: logits differ"
            );
        }
        let (theirs, mine) = (argmax(&want), argmax(&got));
        if mine != theirs {
            let margin = want[theirs as usize] - want[mine as usize];
            assert!(
                margin < TIE_MARGIN,
                "{what}: step {step}: picked {mine}, the reference {theirs} (its margin {margin})"
            );
            ties += 1;
        }
        for (a, b) in want.iter().zip(&got) {
            let d = (a - b).abs();
            worst = worst.max(d);
            sq += (d as f64) * (d as f64);
        }
        values += want.len();
        toks.push(theirs);
        input = vec![theirs];
    }
    let rms = (sq / values.max(1) as f64).sqrt() as f32;
    println!(
        "{what}: {n} steps, max |Δlogit| {worst:.3}, rms {rms:.4}, {ties} picks differ at near ties"
    );
    assert!(
        worst <= MAX_ABS && rms <= RMS,
        "{what}: max {worst}, rms {rms}"
    );
    toks
}

#[test]
fn gpu_greedy_equals_cpu_for_five_prompts() {
    let n = count("greedy tokens per prompt", 32, 8);
    let mut gpu = gpu_runner(4096);
    let rc = RunnerConfig::with_kv_tokens(4096, tandem_kernels::GgmlType::F16);
    let mut cpu = CpuModelRunner::load(&crate::test_support::model_path(), rc).unwrap();
    assert_eq!(gpu.info(), cpu.info(), "same ModelInfo and fingerprint");
    // On the executor the prompts that take distinct kernel paths: 5 tokens (one group of
    // the warp-per-row matmul), 9 (a full group and a 1-token tail, the reduction for
    // <= 2 tokens) and 40 (the tiled matmul, 3 KV blocks); prompts 1 and 3 (7 and 5
    // tokens) repeat prompt 0's paths.
    let which: &[usize] = if on_executor() {
        println!("CPU executor: prompts 0, 2 and 4 (a GPU runs all five)");
        &[0, 2, 4]
    } else {
        &[0, 1, 2, 3, 4]
    };
    for (i, p) in prompts()
        .iter()
        .enumerate()
        .filter(|(i, _)| which.contains(i))
    {
        let what = format!("greedy, prompt {i}: CUDA vs CPU");
        let s = i as u64;
        teacher_forced(&what, p, n, false, |t| {
            (logits(&mut cpu, s, t), logits(&mut gpu, s, t))
        });
    }
    assert_eq!(
        greedy(&mut gpu, 99, &prompts()[0], 2),
        vec![7042, 30],
        "Paris."
    );
    // Device-side greedy equals host argmax over the device's own logits (exactly: the
    // same kernels on the same inputs).
    let m = count("device-greedy tokens", 8, 4);
    let mut g2 = gpu_runner(1024);
    let mut ids = vec![];
    let mut next = prompts()[1].clone();
    for _ in 0..m {
        let out = g2
            .step_greedy(&[StepInput {
                seq: SeqId(1),
                tokens: next,
                want_logits: true,
            }])
            .unwrap();
        let t = out[0].unwrap();
        ids.push(t);
        next = vec![t];
    }
    assert_eq!(ids, greedy(&mut gpu, 50, &prompts()[1], m));
}

#[test]
fn gpu_kv_export_imports_into_cpu_and_back() {
    let n = count("continuation steps", 16, 4);
    let mut gpu = gpu_runner(2048);
    let rc = RunnerConfig::with_kv_tokens(2048, tandem_kernels::GgmlType::F16);
    let mut cpu = CpuModelRunner::load(&crate::test_support::model_path(), rc).unwrap();
    let p = &prompts()[2];
    let first = greedy(&mut gpu, 1, p, 1)[0];
    let payload = gpu.export_kv(SeqId(1)).unwrap();
    greedy(&mut cpu, 7, p, 1);
    let cpu_payload = cpu.export_kv(SeqId(7)).unwrap();
    assert_eq!(payload.len(), cpu_payload.len());
    assert_eq!(payload[..32], cpu_payload[..32], "identical TKV1 header");
    gpu.import_kv(SeqId(3), &payload).unwrap();
    gpu.import_kv(SeqId(4), &cpu_payload).unwrap();
    cpu.import_kv(SeqId(2), &payload).unwrap();
    cpu.import_kv(SeqId(8), &cpu_payload).unwrap();
    // GPU -> GPU: the very rows come back, so the continuation is bit for bit the same.
    teacher_forced("KV GPU -> GPU", &[first], n, true, |t| {
        (logits(&mut gpu, 1, t), logits(&mut gpu, 3, t))
    });
    // GPU prefill -> CPU decode, and CPU prefill -> GPU decode: within the backends' noise
    // (the references decode from the CPU's own KV).
    teacher_forced("KV GPU -> CPU", &[first], n, false, |t| {
        (logits(&mut cpu, 7, t), logits(&mut cpu, 2, t))
    });
    teacher_forced("KV CPU -> GPU", &[first], n, false, |t| {
        (logits(&mut cpu, 8, t), logits(&mut gpu, 4, t))
    });
    assert!(
        gpu.import_kv(SeqId(3), &payload).is_err(),
        "sequence not empty"
    );
    assert!(
        gpu.import_kv(SeqId(5), &payload[..40]).is_err(),
        "truncated"
    );
}

#[test]
fn gpu_throughput() {
    use std::time::Instant;
    if on_executor() {
        println!("gpu_throughput: skipped on the CPU executor, which measures no speed");
        return;
    }
    let mut r = gpu_runner(64 * 1024);
    // Prompt throughput: 8 sequences of 512 tokens in 256-token chunks.
    let chunk: Vec<u32> = (0..256).map(|i| 200 + (i * 13) % 4000).collect();
    r.step_greedy(&[StepInput {
        seq: SeqId(999),
        tokens: chunk.clone(),
        want_logits: true,
    }])
    .unwrap(); // warm-up
    r.free(SeqId(999));
    let t = Instant::now();
    for s in 0..8u64 {
        for c in 0..2 {
            r.step_greedy(&[StepInput {
                seq: SeqId(s),
                tokens: chunk.clone(),
                want_logits: c == 1,
            }])
            .unwrap();
        }
    }
    let prompt_tps = 8.0 * 512.0 / t.elapsed().as_secs_f64();
    for s in 0..8u64 {
        r.free(SeqId(s));
    }
    println!("prompt: {prompt_tps:.0} tok/s (8 x 512 tokens, 256-token chunks)");
    for (graphs, conc) in [
        (false, 1usize),
        (true, 1),
        (false, 32),
        (true, 32),
        (false, 64),
        (true, 64),
    ] {
        r.set_options(CudaOptions {
            graphs,
            device_sampling: true,
        });
        let mut next: Vec<u32> = vec![0; conc];
        for (s, n) in next.iter_mut().enumerate() {
            let out = r
                .step_greedy(&[StepInput {
                    seq: SeqId(1000 + s as u64),
                    tokens: prompts()[s % 5].clone(),
                    want_logits: true,
                }])
                .unwrap();
            *n = out[0].unwrap();
        }
        let steps = 64;
        // One untimed step: a graph's capture happens on its bucket's first use.
        let warm: Vec<StepInput> = next
            .iter()
            .enumerate()
            .map(|(s, tok)| StepInput {
                seq: SeqId(1000 + s as u64),
                tokens: vec![*tok],
                want_logits: true,
            })
            .collect();
        for (n, o) in next.iter_mut().zip(r.step_greedy(&warm).unwrap()) {
            *n = o.unwrap();
        }
        let t = Instant::now();
        for _ in 0..steps {
            let batch: Vec<StepInput> = next
                .iter()
                .enumerate()
                .map(|(s, tok)| StepInput {
                    seq: SeqId(1000 + s as u64),
                    tokens: vec![*tok],
                    want_logits: true,
                })
                .collect();
            let out = r.step_greedy(&batch).unwrap();
            for (n, o) in next.iter_mut().zip(out) {
                *n = o.unwrap();
            }
        }
        let tps = (steps * conc) as f64 / t.elapsed().as_secs_f64();
        let mode = if graphs { "on" } else { "off" };
        println!(
            "decode: {tps:.0} tok/s at concurrency {conc} ({steps} steps, CUDA graphs {mode})"
        );
        for s in 0..conc {
            r.free(SeqId(1000 + s as u64));
        }
    }
    let st = r.graph_stats();
    println!("graphs: {st:?}");
    assert_eq!(st.capture_failures, 0, "{st:?}");
}

/// Greedy through `step_sample` (the serving path).
fn greedy_sampled(r: &mut CudaModelRunner, seq: u64, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut s = Sampler::new(SamplingParams {
        temperature: 0.0,
        ..Default::default()
    });
    let mut toks = Vec::new();
    let mut next = prompt.to_vec();
    while toks.len() < n {
        let out = r
            .step_sample(
                &[StepInput {
                    seq: SeqId(seq),
                    tokens: next,
                    want_logits: true,
                }],
                &mut [&mut s],
            )
            .unwrap();
        let t = out[0].as_ref().unwrap().0;
        toks.push(t);
        next = vec![t];
    }
    toks
}

/// Device sampling (greedy, through `step_sample`, the serving path) with CUDA graphs off
/// and on gives exactly the greedy tokens of the device's own logits copied to the host
/// (`step` + argmax): the same kernels on the same inputs, and graph padding computes the
/// real rows with the kernels of the plain step. (CUDA against the CPU is
/// `gpu_greedy_equals_cpu_for_five_prompts`.)
#[test]
fn gpu_step_sample_greedy_equals_greedy_with_and_without_graphs() {
    let n = count("greedy tokens per prompt", 32, 6);
    let (model, vocab) = same_backend_model();
    let mut plain = gpu_runner_of(&model, 4096);
    let want: Vec<Vec<u32>> = prompts_in(vocab)
        .iter()
        .enumerate()
        .map(|(i, p)| greedy(&mut plain, i as u64, p, n))
        .collect();
    for graphs in [false, true] {
        let mut g = gpu_runner_of(&model, 4096);
        g.set_options(CudaOptions {
            graphs,
            device_sampling: true,
        });
        for (i, p) in prompts_in(vocab).iter().enumerate() {
            let got = greedy_sampled(&mut g, i as u64, p, n);
            assert_eq!(got, want[i], "prompt {i}, graphs {graphs}");
        }
        let n = n as u64;
        let st = g.sampling_stats();
        assert_eq!(
            (st.device_rows, st.deferred_rows, st.host_rows),
            (5 * n, 0, 0)
        );
        let gs = g.graph_stats();
        assert_eq!(gs.capture_failures, 0, "{gs:?}");
        assert_eq!(gs.replayed, if graphs { 5 * (n - 1) } else { 0 }, "{gs:?}");
    }
}

#[test]
fn gpu_graph_decode_equals_plain_decode() {
    let (model, vocab) = same_backend_model();
    let mut plain = gpu_runner_of(&model, 16384);
    let mut graph = gpu_runner_of(&model, 16384);
    graph.set_options(CudaOptions {
        graphs: true,
        device_sampling: true,
    });
    let decode = |r: &mut CudaModelRunner, seqs: &[u64], next: &[u32]| {
        let batch: Vec<StepInput> = seqs
            .iter()
            .zip(next)
            .map(|(s, t)| StepInput {
                seq: SeqId(*s),
                tokens: vec![*t],
                want_logits: true,
            })
            .collect();
        r.step(&batch).unwrap()
    };
    let argmaxes = |out: &[Option<Vec<f32>>]| -> Vec<u32> {
        out.iter().map(|l| argmax(l.as_ref().unwrap())).collect()
    };
    let decode_steps = count("decode steps per batch size", 6, 2);
    let mut first_seq = 0u64;
    // Buckets 1, 4, 8, 16, 24, 48, 64.
    for n in [1usize, 3, 8, 16, 17, 40, 64] {
        let seqs: Vec<u64> = (first_seq..first_seq + n as u64).collect();
        first_seq += n as u64;
        let prefill: Vec<StepInput> = seqs
            .iter()
            .map(|&s| {
                let mut p = prompts_in(vocab)[s as usize % 5].clone();
                p.push((100 + s as u32) % vocab);
                StepInput {
                    seq: SeqId(s),
                    tokens: p,
                    want_logits: true,
                }
            })
            .collect();
        let a = plain.step(&prefill).unwrap();
        let b = graph.step(&prefill).unwrap();
        let mut next = argmaxes(&a);
        assert_eq!(next, argmaxes(&b), "prefill, batch {n}");
        let mut max_diff = 0f32;
        for step in 0..decode_steps {
            let a = decode(&mut plain, &seqs, &next);
            let replayed = graph.graph_stats().replayed;
            let b = decode(&mut graph, &seqs, &next);
            assert_eq!(graph.graph_stats().replayed, replayed + 1, "batch {n}");
            for (x, y) in a.iter().zip(&b) {
                let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
                for (p, q) in x.iter().zip(y) {
                    max_diff = max_diff.max((p - q).abs());
                }
            }
            next = argmaxes(&a);
            assert_eq!(next, argmaxes(&b), "batch {n}, decode step {step}");
        }
        // The padded rows compute nothing the real rows see: same kernels, same
        // rows, so the logits agree to the bit (tolerance 1e-3 in case a driver
        // reorders a reduction).
        println!("graph vs plain, batch {n}: max logit difference {max_diff}");
        assert!(max_diff <= 1e-3, "batch {n}: {max_diff}");
        // A mixed step (a prompt chunk beside decodes) runs without a graph.
        let replayed = graph.graph_stats().replayed;
        let mut mixed = vec![StepInput {
            seq: SeqId(9999),
            tokens: prompts_in(vocab)[0].clone(),
            want_logits: true,
        }];
        mixed.extend(seqs.iter().zip(&next).map(|(s, t)| StepInput {
            seq: SeqId(*s),
            tokens: vec![*t],
            want_logits: true,
        }));
        let a = plain.step(&mixed).unwrap();
        let b = graph.step(&mixed).unwrap();
        assert_eq!(argmaxes(&a), argmaxes(&b), "mixed step, batch {n}");
        assert_eq!(graph.graph_stats().replayed, replayed);
        for s in seqs.iter().copied().chain([9999]) {
            plain.free(SeqId(s));
            graph.free(SeqId(s));
        }
    }
    let st = graph.graph_stats();
    assert_eq!(st.capture_failures, 0, "{st:?}");
    assert!(st.captured >= 7, "{st:?}");
    assert_eq!(plain.graph_stats(), GraphStats::default());
    // A step larger than the activation buffers grows them and drops the graphs;
    // decode graphs are captured again and stay correct. (The last mixed step grew the
    // logits rows and dropped the graphs already: first a graph to drop, one decode
    // step of a fresh sequence.)
    let mut next = Vec::new();
    for r in [&mut plain, &mut graph] {
        let p = prompts_in(vocab)[0].clone();
        next = argmaxes(
            &r.step(&[StepInput {
                seq: SeqId(5000),
                tokens: p,
                want_logits: true,
            }])
            .unwrap(),
        );
    }
    let a = argmaxes(&decode(&mut plain, &[5000], &next));
    assert_eq!(a, argmaxes(&decode(&mut graph, &[5000], &next)));
    next = a;
    let before = graph.graph_stats();
    assert_eq!(before.captured, st.captured + 1, "{before:?}");
    let long: Vec<u32> = (0..graph.model().activations().caps().0 as u32 + 1)
        .map(|i| (200 + i % 3000) % vocab)
        .collect();
    for r in [&mut plain, &mut graph] {
        r.step(&[StepInput {
            seq: SeqId(5001),
            tokens: long.clone(),
            want_logits: true,
        }])
        .unwrap();
    }
    assert_eq!(graph.graph_stats().invalidated, before.invalidated + 1);
    for _ in 0..4 {
        let a = argmaxes(&decode(&mut plain, &[5000], &next));
        assert_eq!(a, argmaxes(&decode(&mut graph, &[5000], &next)));
        next = a;
    }
    assert_eq!(graph.graph_stats().captured, before.captured + 1);
}
