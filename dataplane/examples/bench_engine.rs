//! Engine throughput on the real model.
//!
//! cargo run --release -p tandem-dataplane --example bench_engine -- \
//!     [--kv f16|q8_0|f32] [--reps N] [--only C[,C...]] [--via-step] [--threads N] [MODEL.gguf]
//!
//! Prints prompt tok/s for a 512-token prompt, then decode tok/s (greedy, through
//! `step_sample` as the scheduler calls it) at concurrency 1, 8 and 32, for short
//! (16..80-token) and long (448..512-token) contexts, and the peak RSS. Long contexts are
//! set up by prefilling one 448-token prompt and importing its KV into every sequence
//! (the PD import path), so the setup does not dominate the run.
//!
//! Shared machines drift in speed by tens of percent over a minute, so the concurrency
//! levels are measured interleaved (1, 8, 32, 1, 8, 32, ...) `--reps` times (default 3)
//! and each figure is the median; the C=32 / C=1 ratios compare medians of interleaved
//! runs. `--only C` measures one level (for profiling), `--only 1,2,3,4` those levels
//! (interleaved as above); `--via-step` decodes through
//! `step` + host sampling of copied logits instead (the path before `step_sample`);
//! `--threads N` sizes the kernel pool (the dataplane's `--threads`; default one per core).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tandem_dataplane::engine_api::{ModelRunner, SeqId, StepInput};
use tandem_dataplane::model::{CpuModelRunner, RunnerConfig};
use tandem_dataplane::sampling::{Sampler, SamplingParams};
use tandem_kernels::{CpuKernels, CpuOptions, GgmlType};

const DECODE_STEPS: usize = 64;
/// Prompt length of the short-context runs.
const SHORT_PROMPT: usize = 16;
const CONTEXT: usize = 512;

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold(0, |b, (i, x)| if *x > v[b] { i } else { b }) as u32
}

fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    // Arbitrary but valid token ids; the cost of a step does not depend on their values.
    (0..n as u32)
        .map(|i| (i * 7919 + salt * 104729 + 1000) % 49000)
        .collect()
}

/// Decode `DECODE_STEPS` tokens for every sequence in `seqs` together, sampling greedily
/// through `step_sample` as the scheduler does; returns tok/s.
fn decode(r: &mut CpuModelRunner, seqs: &[SeqId], next: &mut [u32], via_step: bool) -> f64 {
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let mut samplers: Vec<Sampler> = seqs.iter().map(|_| Sampler::new(greedy.clone())).collect();
    let start = Instant::now();
    for _ in 0..DECODE_STEPS {
        let batch: Vec<StepInput> = seqs
            .iter()
            .zip(next.iter())
            .map(|(s, t)| StepInput {
                seq: *s,
                tokens: vec![*t],
                want_logits: true,
            })
            .collect();
        if via_step {
            // The path before `step_sample`: logits copied out per row, sampled after.
            let out = r.step(&batch).expect("decode step");
            for ((n, l), s) in next.iter_mut().zip(out).zip(&mut samplers) {
                *n = s.sample(&l.expect("logits")).0;
            }
            continue;
        }
        let mut refs: Vec<&mut Sampler> = samplers.iter_mut().collect();
        let out = r.step_sample(&batch, &mut refs).expect("decode step");
        for (n, sampled) in next.iter_mut().zip(out) {
            *n = sampled.expect("a sampled token").0;
        }
    }
    (seqs.len() * DECODE_STEPS) as f64 / start.elapsed().as_secs_f64()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Sequences of the long-context runs start from this imported KV (448 tokens).
struct LongStart {
    payload: Vec<u8>,
    first: u32,
}

/// Set up `c` sequences (short prompts, or `long`'s imported KV), decode them together,
/// free them; returns aggregate tok/s.
fn run_level(r: &mut CpuModelRunner, c: usize, long: Option<&LongStart>, via_step: bool) -> f64 {
    let seqs: Vec<SeqId> = (0..c as u64).map(|i| SeqId(2000 + i)).collect();
    let mut next = match long {
        Some(l) => {
            for s in &seqs {
                r.import_kv(*s, &l.payload).expect("import KV");
            }
            vec![l.first; c]
        }
        None => {
            // Each sequence its own prompt, prefilled in one batched step.
            let batch: Vec<StepInput> = seqs
                .iter()
                .enumerate()
                .map(|(i, s)| StepInput {
                    seq: *s,
                    tokens: prompt(SHORT_PROMPT, 10 + i as u32),
                    want_logits: true,
                })
                .collect();
            let out = r.step(&batch).expect("prefill");
            out.iter().map(|l| argmax(l.as_ref().unwrap())).collect()
        }
    };
    let tps = decode(r, &seqs, &mut next, via_step);
    for s in &seqs {
        r.free(*s);
    }
    tps
}

fn main() {
    let mut kv = GgmlType::F16;
    let mut only: Option<Vec<usize>> = None;
    let mut reps = 3usize;
    let mut via_step = false;
    let mut threads = None;
    let mut model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--kv" => {
                kv = match args.next().as_deref() {
                    Some("f32") => GgmlType::F32,
                    Some("q8_0") => GgmlType::Q8_0,
                    _ => GgmlType::F16,
                }
            }
            "--only" => {
                let list = args.next().unwrap_or_default();
                let levels: Vec<usize> = list
                    .split(',')
                    .map(|c| {
                        c.trim()
                            .parse()
                            .ok()
                            .filter(|&n: &usize| (1..=32).contains(&n))
                            .unwrap_or_else(|| {
                                panic!(
                                    "--only {list:?}: concurrency levels 1..=32, comma-separated"
                                )
                            })
                    })
                    .collect();
                only = Some(levels);
            }
            "--via-step" => via_step = true,
            "--threads" => threads = args.next().and_then(|c| c.parse().ok()),
            "--reps" => reps = args.next().and_then(|c| c.parse().ok()).unwrap_or(3).max(1),
            other => model = PathBuf::from(other),
        }
    }
    // Room for 32 sequences of 512 tokens plus the setup sequences.
    let rc = RunnerConfig::with_kv_tokens(34 * CONTEXT, kv);
    let kernels = CpuKernels::with_options(CpuOptions {
        threads,
        simd: true,
    });
    let n_threads = kernels.threads();
    let mut r = CpuModelRunner::load_with(&model, rc, Arc::new(kernels))
        .expect("load model (run `make model`)");
    println!(
        "model {} | kernels {} | threads {} | KV {kv} | {reps} interleaved reps, medians{}",
        model.display(),
        r.kernels_name(),
        n_threads,
        if via_step {
            " | via step + copied logits"
        } else {
            ""
        }
    );

    // Warm up: page in the weights and the thread pool.
    r.step(&[StepInput {
        seq: SeqId(1000),
        tokens: prompt(32, 9),
        want_logits: true,
    }])
    .unwrap();
    r.free(SeqId(1000));

    if only.is_none() {
        let mut runs: Vec<f64> = (0..reps)
            .map(|_| {
                let t = Instant::now();
                r.step(&[StepInput {
                    seq: SeqId(1001),
                    tokens: prompt(CONTEXT, 1),
                    want_logits: true,
                }])
                .unwrap();
                r.free(SeqId(1001));
                CONTEXT as f64 / t.elapsed().as_secs_f64()
            })
            .collect();
        println!(
            "prompt (512 tokens, one step):            {:8.1} tok/s",
            median(&mut runs)
        );
    }

    let base_len = CONTEXT - DECODE_STEPS;
    let l = r
        .step(&[StepInput {
            seq: SeqId(1003),
            tokens: prompt(base_len, 3),
            want_logits: true,
        }])
        .unwrap();
    let long = LongStart {
        first: argmax(l[0].as_ref().unwrap()),
        payload: r.export_kv(SeqId(1003)).unwrap(),
    };
    r.free(SeqId(1003));

    let levels = only.unwrap_or_else(|| vec![1usize, 8, 32]);
    let short_ctx = format!("{SHORT_PROMPT}..{}", SHORT_PROMPT + DECODE_STEPS);
    let long_ctx = format!("{base_len}..{CONTEXT}");
    for (name, start) in [(short_ctx, None), (long_ctx, Some(&long))] {
        let mut tps: Vec<Vec<f64>> = vec![Vec::new(); levels.len()];
        for _ in 0..reps {
            for (i, &c) in levels.iter().enumerate() {
                tps[i].push(run_level(&mut r, c, start, via_step));
            }
        }
        let mut medians = Vec::new();
        for (&c, runs) in levels.iter().zip(&mut tps) {
            let (lo, hi) = runs
                .iter()
                .fold((f64::MAX, 0f64), |(a, b), &x| (a.min(x), b.max(x)));
            let m = median(runs);
            println!(
                "decode C={c:<2}, context {name:>8}: {m:8.1} tok/s aggregate  (runs {lo:.1}..{hi:.1})"
            );
            medians.push(m);
        }
        if levels == [1, 8, 32] {
            println!(
                "C=32 / C=1, context {name:>8}: {:.1}x",
                medians[2] / medians[0]
            );
        }
    }
    println!("peak RSS: {:.0} MB", peak_rss_mb());
}
