//! Engine throughput on the real model.
//!
//! cargo run --release -p tandem-dataplane --example bench_engine -- [--kv f16|q8_0|f32] [MODEL.gguf]
//!
//! Prints prompt tok/s for a 512-token prompt, decode tok/s at concurrency 1 (short and
//! 448–512-token contexts), aggregate decode tok/s at concurrency 8 and 32 with 448–512
//! token contexts, and the peak RSS. Long contexts are set up by prefilling one 448-token
//! prompt and importing its KV into every sequence (the PD import path), so the setup
//! does not dominate the run.

use std::path::PathBuf;
use std::time::Instant;

use tandem_dataplane::engine_api::{ModelRunner, SeqId, StepInput};
use tandem_dataplane::model::{CpuModelRunner, RunnerConfig};
use tandem_kernels::GgmlType;

const DECODE_STEPS: usize = 64;
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

/// Decode `DECODE_STEPS` tokens for every sequence in `seqs` together; returns tok/s.
fn decode(r: &mut CpuModelRunner, seqs: &[SeqId], next: &mut [u32]) -> f64 {
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
        let out = r.step(&batch).expect("decode step");
        for (n, l) in next.iter_mut().zip(out) {
            *n = argmax(&l.expect("logits"));
        }
    }
    (seqs.len() * DECODE_STEPS) as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let mut kv = GgmlType::F16;
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
            other => model = PathBuf::from(other),
        }
    }
    // Room for 32 sequences of 512 tokens plus the prefill benchmark's sequences.
    let rc = RunnerConfig::with_kv_tokens(34 * CONTEXT, kv);
    let mut r = CpuModelRunner::load(&model, rc).expect("load model (run `make model`)");
    println!(
        "model {} | kernels {} | threads {} | KV {kv}",
        model.display(),
        r.kernels_name(),
        tandem_kernels::CpuKernels::new().threads()
    );

    // Warm up: page in the weights and the thread pool.
    r.step(&[StepInput {
        seq: SeqId(1000),
        tokens: prompt(32, 9),
        want_logits: true,
    }])
    .unwrap();
    r.free(SeqId(1000));

    let p = prompt(CONTEXT, 1);
    let t = Instant::now();
    r.step(&[StepInput {
        seq: SeqId(1001),
        tokens: p,
        want_logits: true,
    }])
    .unwrap();
    let prefill = CONTEXT as f64 / t.elapsed().as_secs_f64();
    r.free(SeqId(1001));
    println!("prompt (512 tokens, one step):        {prefill:8.1} tok/s");

    let short = SeqId(1002);
    let l = r
        .step(&[StepInput {
            seq: short,
            tokens: prompt(16, 2),
            want_logits: true,
        }])
        .unwrap();
    let mut next = vec![argmax(l[0].as_ref().unwrap())];
    let c1_short = decode(&mut r, &[short], &mut next);
    r.free(short);
    println!("decode C=1, context 16..80:           {c1_short:8.1} tok/s");

    let base_len = CONTEXT - DECODE_STEPS;
    let l = r
        .step(&[StepInput {
            seq: SeqId(1003),
            tokens: prompt(base_len, 3),
            want_logits: true,
        }])
        .unwrap();
    let first = argmax(l[0].as_ref().unwrap());
    let kv_payload = r.export_kv(SeqId(1003)).unwrap();
    r.free(SeqId(1003));

    let mut results = Vec::new();
    for c in [1usize, 8, 32] {
        let seqs: Vec<SeqId> = (0..c as u64).map(SeqId).collect();
        for s in &seqs {
            r.import_kv(*s, &kv_payload).unwrap();
        }
        let mut next = vec![first; c];
        let tps = decode(&mut r, &seqs, &mut next);
        println!("decode C={c:<2}, context {base_len}..{CONTEXT}:      {tps:8.1} tok/s aggregate");
        results.push(tps);
        if c == 32 {
            println!("KV blocks used at C=32: {:?}", r.kv_usage());
        }
        for s in &seqs {
            r.free(*s);
        }
    }
    println!(
        "C=32 / C=1 (same contexts): {:.1}x",
        results[2] / results[0]
    );
    println!("peak RSS: {:.0} MB", peak_rss_mb());
}
