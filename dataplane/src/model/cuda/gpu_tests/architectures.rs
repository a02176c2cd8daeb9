//! Every architecture the engine serves, on CUDA against the CPU backend: tiny random
//! models ([`TinyLlama::of`]) whose weights are the types issue 19 added CUDA kernels for,
//! so each new kernel runs inside a whole forward pass — Q5_0 products with a Q5_1
//! embedding (Llama 3.1's `rope_freqs` and linear RoPE scaling), Q4_K (Qwen2's Q/K/V
//! biases, an untied output), Q6_K (Qwen3's per-head Q/K norms, heads wider than
//! `dim / heads`), Q5_K (Gemma 3: embedding scale, sandwich norms, GeGLU, sliding windows
//! of 8 positions on 5 of its 6 layers).
//!
//! A 20-token prompt (past the window, and more than 16 tokens: the tiled products and
//! the prefill attention kernel) and a 3-token one (inside the window), each followed by
//! decode steps (the warp-per-row products and the decode attention kernel) that carry the
//! short one past the window. Both backends quantize activations to Q8 / Q8K alike and
//! sum floats in other orders; on models this small that noise stays within the bounds
//! `tests/model_reference.rs` sets for Q8-activation rounding against numpy (|Δlogit|
//! ≤ 0.5, rms ≤ 0.05, another pick only where the CPU's best two logits are within 0.2).
//! A defect (a wrong window, a missing bias or norm) moves logits by whole units (a decode
//! kernel that ignores the window: Gemma's max |Δlogit| 1.53, rms 0.35).
//!
//! A third runner decodes with CUDA graphs: every decode step replays a captured graph of
//! the architecture's kernels (captured on its first use), and its logits equal the plain
//! CUDA runner's (the same kernels on the same inputs; 1e-3 as in
//! `gpu_graph_decode_equals_plain_decode`, in case a driver reorders a reduction).

use std::sync::Arc;

use tandem_kernels::{CpuKernels, GgmlType};

use super::*;
use crate::gguf::Gguf;
use crate::model::synthetic::{TinyArch, TinyLlama};

const MAX_ABS: f32 = 0.5;
const RMS: f32 = 0.05;
const TIE_MARGIN: f32 = 0.2;

/// The tiny model of `arch` with `wt` products (dimensions whole K-quant super-blocks
/// where `wt` is one).
fn model(arch: TinyArch, wt: GgmlType) -> TinyLlama {
    let base = TinyLlama {
        weight_type: wt,
        untied_output: arch == TinyArch::Qwen2,
        ..TinyLlama::of(arch)
    };
    if wt.block_len() < 256 {
        return base;
    }
    // Widths (and Q/K/V widths: heads · head size) of 256, a 512-wide FFN.
    let heads = match arch {
        TinyArch::Gemma3 { .. } => (2, 1, Some(128)),
        TinyArch::Qwen3 => (4, 2, Some(128)),
        _ => (4, 2, None),
    };
    TinyLlama {
        dim: 256,
        ffn_dim: 512,
        n_heads: heads.0,
        n_kv_heads: heads.1,
        head_dim: heads.2,
        ..base
    }
}

#[test]
fn gpu_every_architecture_equals_cpu_on_the_new_tensor_types() {
    let decode = count("decode steps per prompt", 8, 6);
    let cases = [
        (
            TinyArch::Llama {
                rope_freqs: true,
                linear_scaling: Some(4.0),
            },
            GgmlType::Q5_0,
            GgmlType::Q5_1,
        ),
        (TinyArch::Qwen2, GgmlType::Q4_K, GgmlType::Q8_0),
        (TinyArch::Qwen3, GgmlType::Q6_K, GgmlType::Q8_0),
        (
            TinyArch::Gemma3 { window: 8 },
            GgmlType::Q5_K,
            GgmlType::Q8_0,
        ),
    ];
    let prompts: [Vec<u32>; 2] = [
        (0..20).map(|i| (i * 37 + 5) % 96).collect(),
        vec![35, 3, 90],
    ];
    for (arch, wt, et) in cases {
        let m = TinyLlama {
            embd_type: et,
            ..model(arch, wt)
        };
        let g = Arc::new(Gguf::from_bytes(m.to_bytes()).unwrap());
        let rc = || RunnerConfig::with_kv_tokens(256, GgmlType::F16);
        let mut cpu = CpuModelRunner::new(g.clone(), rc(), Arc::new(CpuKernels::new())).unwrap();
        let cuda = |graphs| {
            let opts = CudaOptions {
                graphs,
                device_sampling: true,
            };
            CudaModelRunner::new(g.clone(), rc(), 0, opts)
                .unwrap_or_else(|e| panic!("GPU test without a usable CUDA device: {e}"))
        };
        let (mut gpu, mut graph) = (cuda(false), cuda(true));
        let what = format!("{} {wt} (embedding {et})", arch.name());
        let (mut worst, mut sq, mut values, mut ties) = (0f32, 0f64, 0usize, 0);
        let mut graph_diff = 0f32;
        for (s, p) in prompts.iter().enumerate() {
            let seq = s as u64;
            let mut input = p.clone();
            for step in 0..=decode {
                let (want, got) = (logits(&mut cpu, seq, &input), logits(&mut gpu, seq, &input));
                let replayed = graph.graph_stats().replayed;
                let from_graph = logits(&mut graph, seq, &input);
                if step >= 1 {
                    assert_eq!(graph.graph_stats().replayed, replayed + 1, "{what}");
                }
                for (a, b) in got.iter().zip(&from_graph) {
                    graph_diff = graph_diff.max((a - b).abs());
                }
                assert!(
                    want.iter().any(|v| v.abs() > 1e-2),
                    "{what}: the CPU's logits are all near zero"
                );
                let (theirs, mine) = (argmax(&want), argmax(&got));
                if mine != theirs {
                    let margin = want[theirs as usize] - want[mine as usize];
                    assert!(
                        margin < TIE_MARGIN,
                        "{what}: prompt {s}, step {step}: CUDA picked {mine}, the CPU \
                         {theirs} (margin {margin})"
                    );
                    ties += 1;
                }
                for (a, b) in want.iter().zip(&got) {
                    let d = (a - b).abs();
                    worst = worst.max(d);
                    sq += f64::from(d) * f64::from(d);
                }
                values += want.len();
                input = vec![theirs];
            }
        }
        let rms = (sq / values as f64).sqrt() as f32;
        println!(
            "{what}: CUDA vs CPU over {values} logits: max |Δlogit| {worst:.2e}, rms {rms:.2e}, \
             {ties} picks differ at near ties; graphs vs plain max |Δlogit| {graph_diff:.2e}"
        );
        assert!(graph_diff <= 1e-3, "{what}: graphs vs plain {graph_diff}");
        let gs = graph.graph_stats();
        assert_eq!(gs.capture_failures, 0, "{what}: {gs:?}");
        assert!(
            worst <= MAX_ABS && rms <= RMS,
            "{what}: max {worst}, rms {rms}"
        );
    }
}
