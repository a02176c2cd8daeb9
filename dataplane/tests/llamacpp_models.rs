//! The engine against llama.cpp on the real models CI serves — SmolLM2-135M (Q4_1),
//! Qwen2.5-Coder-0.5B (Q4_K_M: Q5_0, Q8_0, Q4_K, Q6_K) and Gemma 3 270M (Q4_K_M; sliding
//! windows, GeGLU, sandwich norms) — from the fixtures scripts/llamacpp_reference.py wrote
//! with llama.cpp itself (tests/fixtures/llamacpp/). For each prompt (llama.cpp's token
//! ids), 64 greedy tokens: each must be llama.cpp's, until the two may part at a near tie
//! of llama.cpp's own logits — Tandem's pick within [`NEAR_TIE`] of llama.cpp's top logit
//! (so the top two are within it too; with a three-way tie, as SmolLM2's "def
//! fibonacci(n):" prompt has at step 21 — 19.360, 19.241, 19.221 — the third counts as
//! tied as well) — after which the continuations differ and the prompt's comparison ends. At every
//! step compared, the logits of llama.cpp's top 8 tokens must lie within the model's stated
//! tolerance of llama.cpp's (both quantize activations, each its own way: llama.cpp Q8_0 /
//! Q8_K per its kernels, Tandem its own Q8 / Q8K; the measured figures are printed).

mod common;

use std::sync::Arc;

use serde_json::Value;
use tandem_dataplane::engine_api::{ModelRunner, SeqId, StepInput};
use tandem_dataplane::gguf::Gguf;
use tandem_dataplane::model::{CpuModelRunner, RunnerConfig};
use tandem_kernels::GgmlType;

/// llama.cpp's top-two margin below which the engine may pick the other token.
const NEAR_TIE: f32 = 0.5;

fn fixture(name: &str) -> Value {
    let p = common::repo_root().join(format!("dataplane/tests/fixtures/llamacpp/{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold(0, |b, (i, x)| if *x > v[b] { i } else { b }) as u32
}

/// One llama.cpp step: its token and its top logits `(id, logit)`, highest first.
struct Step {
    token: u32,
    top: Vec<(u32, f32)>,
}

fn steps(v: &Value) -> Vec<Step> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| Step {
            token: s["token"].as_u64().unwrap() as u32,
            top: s["top"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
                .collect(),
        })
        .collect()
}

/// Compare every prompt of `name`'s fixture; `max_abs` and `max_rms` bound |Δlogit| over
/// llama.cpp's top 8 at every compared step.
fn check(name: &str, max_abs: f32, max_rms: f64) {
    let f = fixture(name);
    let path = common::model_file(f["model"].as_str().unwrap());
    let g = Arc::new(Gguf::open(&path).unwrap());
    let rc = RunnerConfig::with_kv_tokens(4096, GgmlType::F16);
    let mut r = CpuModelRunner::new(g, rc, tandem_kernels::best_backend()).unwrap();
    let prompts = f["generate"].as_array().unwrap();
    let refs: Vec<Vec<Step>> = prompts.iter().map(|p| steps(&p["steps"])).collect();
    let (mut worst, mut sq, mut n) = (0f32, 0f64, 0usize);
    let mut equal = vec![0usize; prompts.len()];
    let mut active: Vec<usize> = (0..prompts.len()).collect();
    let mut logits: Vec<Vec<f32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let l = r.step(&[StepInput {
                seq: SeqId(i as u64),
                tokens: ids(&p["ids"]),
                want_logits: true,
            }]);
            l.unwrap().into_iter().next().unwrap().unwrap()
        })
        .collect();
    for s in 0.. {
        // Check step s of every prompt still compared; drop those that part here.
        active.retain(|&i| {
            let want = &refs[i][s];
            let l = &logits[i];
            for &(id, lg) in &want.top {
                let d = (l[id as usize] - lg).abs();
                worst = worst.max(d);
                sq += (d as f64).powi(2);
                n += 1;
            }
            let mine = argmax(l);
            if mine == want.token {
                equal[i] += 1;
                return s + 1 < refs[i].len();
            }
            // llama.cpp's own logit for Tandem's pick, if in its top 8.
            let theirs = want.top.iter().find(|t| t.0 == mine).map(|t| t.1);
            let margin = theirs.map(|t| want.top[0].1 - t);
            assert!(
                margin.is_some_and(|m| m < NEAR_TIE),
                "{name} prompt {i} step {s}: Tandem picked {mine}, llama.cpp {} with its top \
                 {:?}: not a near tie (Tandem's pick {margin:?} below llama.cpp's top, must be \
                 < {NEAR_TIE})",
                want.token,
                &want.top[..4]
            );
            let margin = margin.unwrap_or_default();
            eprintln!(
                "{name} prompt {i}: parts from llama.cpp at step {s}, a near tie (margin {margin:.3})"
            );
            false
        });
        if active.is_empty() {
            break;
        }
        let batch: Vec<StepInput> = active
            .iter()
            .map(|&i| StepInput {
                seq: SeqId(i as u64),
                tokens: vec![refs[i][s].token],
                want_logits: true,
            })
            .collect();
        for (&i, l) in active.iter().zip(r.step(&batch).unwrap()) {
            logits[i] = l.unwrap();
        }
    }
    let rms = (sq / n.max(1) as f64).sqrt();
    eprintln!(
        "{name}: greedy tokens equal to llama.cpp's per prompt {equal:?} of {}; |Δlogit| over \
         llama.cpp's top 8: max {worst:.3}, rms {rms:.3} ({n} logits)",
        refs[0].len()
    );
    assert!(worst <= max_abs, "{name}: max |Δlogit| {worst} > {max_abs}");
    assert!(rms <= max_rms, "{name}: rms |Δlogit| {rms} > {max_rms}");
}

// Bounds: about twice what was measured here (printed by each test; SmolLM2 max 1.05 /
// rms 0.21, Qwen2.5 0.39 / 0.09, Gemma 3 1.49 / 0.30 on logits of magnitude ~20). A real
// defect — a wrong RoPE base, a missing norm, an off-by-one window — moves whole units
// and parts greedy paths outside near ties.

#[test]
fn smollm2_generates_as_llama_cpp() {
    check("smollm2", 2.0, 0.4);
}

#[test]
fn qwen2_5_coder_0_5b_generates_as_llama_cpp() {
    check("qwen2.5-coder-0.5b", 0.8, 0.2);
}

#[test]
fn gemma3_270m_generates_as_llama_cpp() {
    check("gemma-3-270m", 2.5, 0.5);
}
