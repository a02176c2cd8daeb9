//! Tests of the CUDA runner. Host-side logic runs everywhere (`make cuda-check`); the GPU
//! tests exist only with feature `gpu-tests` (compiled and linted in CI, run by
//! `tests/gpu/run.sh`) and fail, never skip, without a device.

use std::path::Path;

use tandem_kernels::cuda::launch::{self, SampleRow};

use super::graphs::{decode_bucket, decode_table_cap};
use super::sampling::{device_row, sampler_row};
use super::*;
use crate::model::forward::grown_caps;
use crate::sampling::SamplingParams;

#[test]
fn cuda_device_without_a_driver_is_a_clear_error() {
    // On machines without a driver (CI) loading must fail with the probe's message,
    // never panic; the model path is not even opened.
    if tandem_kernels::cuda::probe(0).is_ok() {
        return; // a GPU machine: the GPU tests below cover loading
    }
    let err = CudaModelRunner::load(
        Path::new("/nonexistent.gguf"),
        RunnerConfig::default(),
        0,
        CudaOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(
            err.root(),
            crate::Error::Kernel(tandem_kernels::Error::Cuda(_))
        ),
        "{err:?}"
    );
    let err = err.to_string();
    assert!(
        err.contains("libcuda.so.1 not found") || err.contains("no device"),
        "{err}"
    );
}

#[test]
fn buffer_sizing_for_graphs_and_steps() {
    // SmolLM2: context 8192 in 16-token blocks: 512 entries per row, plus padding.
    assert_eq!(decode_table_cap(64, 8192, 16), 64 * 512 + 1);
    assert_eq!(decode_table_cap(1, 10, 4), 3 + 1);
    // Sizing for the largest bucket up front covers every bucket.
    let (cap, want) = grown_caps(64, 32, GRAPH_MAX_BATCH, GRAPH_MAX_BATCH).unwrap();
    for b in GRAPH_BUCKETS {
        assert_eq!(grown_caps(cap, want, b, b), None, "bucket {b}");
    }
}

#[test]
fn default_options_leave_graphs_off_until_checked_on_a_gpu() {
    let d = CudaOptions::default();
    assert!(d.device_sampling && !d.graphs);
}

#[test]
fn graph_buckets_cover_every_batch_and_keep_the_matrix_kernel() {
    assert_eq!(graph_bucket(0), None);
    assert_eq!(graph_bucket(GRAPH_MAX_BATCH + 1), None);
    let mut prev = 0;
    for n in 1..=GRAPH_MAX_BATCH {
        let b = graph_bucket(n).unwrap();
        assert!(b >= n && b >= prev, "{n} -> {b}");
        assert!(GRAPH_BUCKETS.contains(&b));
        // The smallest such bucket: the one below is too small.
        let i = GRAPH_BUCKETS.iter().position(|x| *x == b).unwrap();
        assert!(i == 0 || GRAPH_BUCKETS[i - 1] < n);
        // Padding never switches a batch from the warp-per-row to the tiled kernels,
        // so graph and plain steps compute the real rows with the same kernels.
        assert_eq!(
            n <= launch::MMV_MAX_TOKENS,
            b <= launch::MMV_MAX_TOKENS,
            "{n} -> {b}"
        );
        prev = b;
    }
    assert_eq!(
        [1, 2, 3, 5, 16, 17, 25, 33, 49, 64].map(|n| graph_bucket(n).unwrap()),
        [1, 2, 4, 8, 16, 24, 32, 48, 64, 64]
    );
    // Only pure decode steps: one token each, all with logits.
    let e = |n: usize, want: bool| StepInput {
        seq: SeqId(n as u64),
        tokens: vec![1; n],
        want_logits: want,
    };
    assert_eq!(
        decode_bucket(&[e(1, true), e(1, true), e(1, true)]),
        Some(4)
    );
    assert_eq!(decode_bucket(&[e(1, true), e(2, true)]), None, "mixed");
    assert_eq!(decode_bucket(&[e(1, false)]), None, "no logits");
    assert_eq!(decode_bucket(&vec![e(1, true); 65]), None, "too large");
}

#[test]
fn sampling_parameters_pack_for_the_device_like_the_host_reads_them() {
    let p = |temperature: f32, top_k: usize, top_p: f32, logprobs: Option<usize>| SamplingParams {
        temperature,
        top_k,
        top_p,
        seed: Some(1),
        logprobs,
        ..Default::default()
    };
    assert_eq!(device_row(&p(0.0, 5, 0.5, None)), Some(SampleRow::GREEDY));
    assert_eq!(device_row(&p(-1.0, 0, 1.0, None)), Some(SampleRow::GREEDY));
    let r = device_row(&p(0.7, 40, 0.9, None)).unwrap();
    // The very bits the host multiplies by (sampling.rs: `1.0 / temperature`).
    assert_eq!(r.inv_temperature.to_bits(), (1.0f32 / 0.7).to_bits());
    assert_eq!((r.top_k, r.top_p, r.uniform), (40, 0.9, 0.0));
    assert_eq!(
        device_row(&p(1.0, usize::MAX, 1.0, None)).unwrap().top_k,
        u32::MAX,
        "larger than any vocabulary: no cut, as on the host"
    );
    // On the host: logprobs, and parameters the kernel would read differently.
    assert_eq!(device_row(&p(0.0, 0, 1.0, Some(2))), None);
    assert_eq!(device_row(&p(1.0, 0, 1.0, Some(0))), None);
    assert_eq!(device_row(&p(f32::NAN, 0, 1.0, None)), None);
    assert_eq!(device_row(&p(f32::INFINITY, 0, 1.0, None)), None);
    assert_eq!(device_row(&p(1e-40, 0, 1.0, None)), None, "1/T overflows");
    assert_eq!(device_row(&p(1.0, 0, f32::NAN, None)), None);
    let words = launch::pack_sample_rows(&[SampleRow { uniform: 0.5, ..r }]);
    assert_eq!(words.len(), launch::SAMPLE_WORDS);
    assert_eq!(f32::from_bits(words[3]), 0.5);
}

#[test]
fn rows_with_penalties_or_min_tokens_masking_are_sampled_on_the_host() {
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    assert_eq!(
        sampler_row(&Sampler::new(greedy.clone())),
        Some(SampleRow::GREEDY)
    );
    for p in [
        SamplingParams {
            repetition_penalty: 1.1,
            ..greedy.clone()
        },
        SamplingParams {
            frequency_penalty: 0.5,
            ..greedy.clone()
        },
        SamplingParams {
            presence_penalty: -0.5,
            ..greedy.clone()
        },
    ] {
        assert_eq!(sampler_row(&Sampler::with_prompt(p, &[1, 2])), None);
    }
    // min_tokens masks (host) until that many tokens were accepted, then the device takes
    // the row again.
    let mut s = Sampler::new(SamplingParams {
        min_tokens: 2,
        min_tokens_masked: vec![0],
        ..greedy
    });
    assert_eq!(sampler_row(&s), None);
    s.accept(5);
    assert_eq!(sampler_row(&s), None);
    s.accept(6);
    assert_eq!(sampler_row(&s), Some(SampleRow::GREEDY));
}

// ---- GPU only (feature `gpu-tests`): compiled and linted in CI, run by
// tests/gpu/run.sh; they fail (never skip) without a device. ----

#[cfg(feature = "gpu-tests")]
mod gpu {
    use super::*;
    use crate::model::CpuModelRunner;

    fn gpu_runner(kv_tokens: usize) -> CudaModelRunner {
        let rc = RunnerConfig::with_kv_tokens(kv_tokens, tandem_kernels::GgmlType::F16);
        CudaModelRunner::load(
            &crate::test_support::model_path(),
            rc,
            0,
            CudaOptions::default(),
        )
        .unwrap_or_else(|e| panic!("GPU test without a usable CUDA device: {e}"))
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

    #[test]
    fn gpu_greedy_equals_cpu_for_five_prompts() {
        let mut gpu = gpu_runner(4096);
        let rc = RunnerConfig::with_kv_tokens(4096, tandem_kernels::GgmlType::F16);
        let mut cpu = CpuModelRunner::load(&crate::test_support::model_path(), rc).unwrap();
        assert_eq!(gpu.info(), cpu.info(), "same ModelInfo and fingerprint");
        for (i, p) in prompts().iter().enumerate() {
            let want = greedy(&mut cpu, i as u64, p, 32);
            let got = greedy(&mut gpu, i as u64, p, 32);
            assert_eq!(got, want, "prompt {i}");
        }
        assert_eq!(
            greedy(&mut gpu, 99, &prompts()[0], 2),
            vec![7042, 30],
            "Paris."
        );
        // Device-side greedy agrees with host argmax over downloaded logits.
        let mut g2 = gpu_runner(1024);
        let mut ids = vec![];
        let mut next = prompts()[1].clone();
        for _ in 0..8 {
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
        assert_eq!(ids, greedy(&mut cpu, 50, &prompts()[1], 8));
    }

    #[test]
    fn gpu_kv_export_imports_into_cpu_and_back() {
        let mut gpu = gpu_runner(2048);
        let rc = RunnerConfig::with_kv_tokens(2048, tandem_kernels::GgmlType::F16);
        let mut cpu = CpuModelRunner::load(&crate::test_support::model_path(), rc).unwrap();
        let p = &prompts()[2];
        let first = greedy(&mut gpu, 1, p, 1)[0];
        let payload = gpu.export_kv(SeqId(1)).unwrap();
        let cpu_payload = {
            greedy(&mut cpu, 7, p, 1);
            cpu.export_kv(SeqId(7)).unwrap()
        };
        assert_eq!(payload.len(), cpu_payload.len());
        assert_eq!(payload[..32], cpu_payload[..32], "identical TKV1 header");
        // GPU prefill -> CPU decode and CPU prefill -> GPU decode continue identically.
        cpu.import_kv(SeqId(2), &payload).unwrap();
        gpu.import_kv(SeqId(3), &cpu_payload).unwrap();
        let a = greedy(&mut cpu, 2, &[first], 16);
        let b = greedy(&mut gpu, 3, &[first], 16);
        let c = greedy(&mut gpu, 1, &[first], 16);
        assert_eq!(a, c);
        assert_eq!(b, c);
        assert!(
            gpu.import_kv(SeqId(3), &payload).is_err(),
            "sequence not empty"
        );
        assert!(
            gpu.import_kv(SeqId(4), &payload[..40]).is_err(),
            "truncated"
        );
    }

    #[test]
    fn gpu_throughput() {
        use std::time::Instant;
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

    #[test]
    fn gpu_step_sample_greedy_equals_cpu_with_and_without_graphs() {
        let rc = RunnerConfig::with_kv_tokens(4096, tandem_kernels::GgmlType::F16);
        let mut cpu = CpuModelRunner::load(&crate::test_support::model_path(), rc).unwrap();
        let want: Vec<Vec<u32>> = prompts()
            .iter()
            .enumerate()
            .map(|(i, p)| greedy(&mut cpu, i as u64, p, 32))
            .collect();
        for graphs in [false, true] {
            let mut g = gpu_runner(4096);
            g.set_options(CudaOptions {
                graphs,
                device_sampling: true,
            });
            for (i, p) in prompts().iter().enumerate() {
                let got = greedy_sampled(&mut g, i as u64, p, 32);
                assert_eq!(got, want[i], "prompt {i}, graphs {graphs}");
            }
            let st = g.sampling_stats();
            assert_eq!(
                (st.device_rows, st.deferred_rows, st.host_rows),
                (5 * 32, 0, 0)
            );
            let gs = g.graph_stats();
            assert_eq!(gs.capture_failures, 0, "{gs:?}");
            assert_eq!(gs.replayed, if graphs { 5 * 31 } else { 0 }, "{gs:?}");
        }
    }

    /// Steps a batch of five requests with `step_sample`; their tokens (and logprobs).
    /// Each sampler knows its prompt and accepts its tokens, as in the engine.
    fn sample_batch(
        r: &mut CudaModelRunner,
        params: &[SamplingParams],
        steps: usize,
    ) -> Vec<Vec<Sampled>> {
        let mut next: Vec<Vec<u32>> = prompts();
        let mut samplers: Vec<Sampler> = params
            .iter()
            .zip(&next)
            .map(|(p, prompt)| Sampler::with_prompt(p.clone(), prompt))
            .collect();
        let mut out = vec![Vec::new(); params.len()];
        for _ in 0..steps {
            let batch: Vec<StepInput> = next
                .iter()
                .enumerate()
                .map(|(i, t)| StepInput {
                    seq: SeqId(i as u64),
                    tokens: t.clone(),
                    want_logits: true,
                })
                .collect();
            let mut refs: Vec<&mut Sampler> = samplers.iter_mut().collect();
            let got = r.step_sample(&batch, &mut refs).unwrap();
            for (i, g) in got.into_iter().enumerate() {
                let g = g.unwrap();
                samplers[i].accept(g.0);
                next[i] = vec![g.0];
                out[i].push(g);
            }
        }
        out
    }

    #[test]
    fn gpu_seeded_device_sampling_equals_host_sampling_of_the_same_logits() {
        // Five requests in one batch: temperature / top-k / top-p mixes, one with
        // top_k above the device's candidate cap, one asking for logprobs (host row).
        let sp = |temperature, top_k, top_p, seed, logprobs| SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(seed),
            logprobs,
            ..Default::default()
        };
        let params = [
            sp(0.8, 40, 0.9, 1, None),
            sp(1.0, 0, 1.0, 2, None),
            sp(0.6, 0, 0.7, 3, None),
            sp(1.2, 500, 0.95, 4, None),
            sp(0.9, 0, 1.0, 5, Some(3)),
        ];
        let mut host = gpu_runner(4096);
        host.set_options(CudaOptions {
            graphs: false,
            device_sampling: false,
        });
        let mut dev = gpu_runner(4096);
        let want = sample_batch(&mut host, &params, 24);
        let got = sample_batch(&mut dev, &params, 24);
        // Equal unless a draw falls within float rounding (~1e-6) of a boundary
        // between two tokens: not expected in 120 draws.
        assert_eq!(got, want);
        let st = dev.sampling_stats();
        println!("device sampling of 5 x 24 tokens: {st:?}");
        assert_eq!(st.host_rows, 24, "the logprobs request");
        assert_eq!(st.device_rows + st.deferred_rows, 4 * 24);
        assert!(st.device_rows > 0);
        assert_eq!(host.sampling_stats().host_rows, 5 * 24);
    }

    #[test]
    fn gpu_rows_with_penalties_or_min_tokens_go_to_the_host_and_equal_host_sampling() {
        let greedy = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        let params = [
            SamplingParams {
                repetition_penalty: 1.3,
                ..greedy.clone()
            },
            SamplingParams {
                temperature: 0.9,
                seed: Some(8),
                frequency_penalty: 0.5,
                presence_penalty: 0.3,
                ..Default::default()
            },
            SamplingParams {
                min_tokens: 3,
                min_tokens_masked: vec![13, 30],
                ..greedy.clone()
            },
            greedy,
            SamplingParams {
                temperature: 0.8,
                seed: Some(9),
                ..Default::default()
            },
        ];
        let mut host = gpu_runner(4096);
        host.set_options(CudaOptions {
            graphs: false,
            device_sampling: false,
        });
        let mut dev = gpu_runner(4096);
        let want = sample_batch(&mut host, &params, 24);
        let got = sample_batch(&mut dev, &params, 24);
        assert_eq!(got, want);
        let st = dev.sampling_stats();
        println!("device sampling with penalties, 5 x 24 tokens: {st:?}");
        // Two penalized rows every step, the min_tokens row for its first 3 tokens.
        assert_eq!(st.host_rows, 2 * 24 + 3);
        assert_eq!(st.device_rows + st.deferred_rows, 3 * 24 - 3);
    }

    struct Lcg(u64);
    impl Lcg {
        fn unit(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    /// Rank of `tok` among the finite logits scaled by 1/T, sorted like the host
    /// sampler (value descending, index ascending).
    fn rank(row: &[f32], inv_t: f32, tok: u32) -> usize {
        let v = row[tok as usize] * inv_t;
        row.iter()
            .enumerate()
            .filter(|(i, l)| {
                let w = **l * inv_t;
                l.is_finite() && (w.total_cmp(&v).is_gt() || (w == v && (*i as u32) < tok))
            })
            .count()
    }

    /// How many candidates the host's top-p prefix keeps (approximately, in f64).
    fn nucleus_len(row: &[f32], p: &SamplingParams) -> usize {
        let inv_t = 1.0 / p.temperature;
        let mut v: Vec<f64> = row
            .iter()
            .filter(|l| l.is_finite())
            .map(|l| (l * inv_t) as f64)
            .collect();
        v.sort_by(|a, b| b.total_cmp(a));
        if p.top_k > 0 && p.top_k < v.len() {
            v.truncate(p.top_k);
        }
        if p.top_p >= 1.0 {
            return v.len();
        }
        let z: f64 = v.iter().map(|x| (x - v[0]).exp()).sum();
        let mut acc = 0.0;
        for (i, x) in v.iter().enumerate() {
            acc += (x - v[0]).exp() / z;
            if acc >= p.top_p as f64 {
                return i + 1;
            }
        }
        v.len()
    }

    #[test]
    fn gpu_sample_kernel_matches_the_host_sampler_on_fixed_logits() {
        // No model: the kernel on hand-made rows of SmolLM2's vocabulary size, every
        // parameter set x 4 rows x 65 uniforms, against `Sampler::sample_drawn`.
        // Tolerance: the device sums probabilities in another order (and the wide
        // normaliser in parallel) and its expf differs by an ulp or two, so a token may
        // differ only where the host's choice changes within +-5e-4 of u; at most 2%
        // of the draws. A row left to the host (SAMPLE_DEFER) is only allowed where
        // the decision needs a candidate past the 256 the kernel keeps.
        let d = tandem_kernels::cuda::CudaDevice::new(0)
            .unwrap_or_else(|e| panic!("GPU test without a usable CUDA device: {e}"));
        let vocab = 49152;
        let mut rng = Lcg(5);
        let mut perm: Vec<usize> = (0..vocab).collect();
        for i in (1..vocab).rev() {
            perm.swap(i, (rng.unit() * (i + 1) as f32) as usize % (i + 1));
        }
        let zipf = |s: f32| {
            let mut r = vec![0f32; vocab];
            for (rank, &i) in perm.iter().enumerate() {
                r[i] = -s * ((rank + 1) as f32).ln();
            }
            r
        };
        let peaked: Vec<f32> = (0..vocab)
            .map(|i| match i {
                7 => 12.0,
                100 => 11.0,
                3000 => 10.5,
                _ => rng.unit() * 2.0,
            })
            .collect();
        let ties: Vec<f32> = (0..vocab)
            .map(|i| match i % 997 {
                5 => f32::NEG_INFINITY,
                6 => f32::NAN,
                _ => (rng.unit() * 4.0).round(),
            })
            .collect();
        let base = [zipf(1.5), zipf(1.1), peaked, ties];
        let us: Vec<f32> = (0..64)
            .map(|i| (i as f32 + 0.5) / 64.0)
            .chain([0.0])
            .collect();
        let mut logits = Vec::with_capacity(base.len() * us.len() * vocab);
        for row in &base {
            for _ in &us {
                logits.extend_from_slice(row);
            }
        }
        let rows = base.len() * us.len();
        let ld = d.upload(&logits).unwrap();
        let mut pd = d.zeros::<u32>(rows * launch::SAMPLE_WORDS).unwrap();
        let mut od = d.zeros::<u32>(rows).unwrap();
        let sets = [
            (0.0, 0, 1.0),
            (1.0, 0, 1.0),
            (0.7, 40, 1.0),
            (1.0, 0, 0.9),
            (1.3, 300, 0.95),
            (0.5, 5, 0.5),
            (1.0, 1, 1.0),
            (2.0, 0, 0.3),
            (0.8, 1000, 1.0),
        ];
        let (mut total, mut near, mut deferred) = (0usize, 0usize, 0usize);
        for (temperature, top_k, top_p) in sets {
            let p = SamplingParams {
                temperature,
                top_k,
                top_p,
                seed: Some(0),
                ..Default::default()
            };
            let host = Sampler::new(p.clone());
            let dr = device_row(&p).unwrap();
            let packed: Vec<SampleRow> = (0..rows)
                .map(|k| SampleRow {
                    uniform: us[k % us.len()],
                    ..dr
                })
                .collect();
            d.upload_into(&launch::pack_sample_rows(&packed), &mut pd)
                .unwrap();
            d.sample(
                &ld.as_view(),
                rows,
                vocab,
                &pd.as_view(),
                &mut od.as_view_mut(),
            )
            .unwrap();
            let got = d.download(&od.as_view(), rows).unwrap();
            let kept: Vec<usize> = if temperature > 0.0 {
                base.iter().map(|row| nucleus_len(row, &p)).collect()
            } else {
                vec![0; base.len()]
            };
            for k in 0..rows {
                let (row, u) = (&base[k / us.len()], us[k % us.len()]);
                let draw = (temperature > 0.0).then_some(u);
                let want = host.sample_drawn(row, draw).0;
                let what = format!(
                    "T {temperature} k {top_k} p {top_p} row {} u {u}",
                    k / us.len()
                );
                total += 1;
                if got[k] == launch::SAMPLE_DEFER {
                    deferred += 1;
                    assert!(temperature > 0.0, "greedy never defers: {what}");
                    let inv_t = 1.0 / temperature;
                    let finite = row.iter().any(|l| l.is_finite());
                    assert!(
                        !finite || rank(row, inv_t, want) >= 250 || kept[k / us.len()] >= 250,
                        "deferred without need: {what}, host token {want}"
                    );
                    continue;
                }
                if got[k] != want {
                    let lo = host.sample_drawn(row, Some((u - 5e-4).max(0.0))).0;
                    let hi = host.sample_drawn(row, Some((u + 5e-4).min(0.99999))).0;
                    assert!(
                        temperature > 0.0 && (got[k] == lo || got[k] == hi),
                        "{what}: device {} host {want} (host at u -+ 5e-4: {lo}, {hi})",
                        got[k]
                    );
                    near += 1;
                }
            }
        }
        println!("sample kernel: {total} draws, {near} boundary differences, {deferred} deferred");
        assert!(
            near * 50 <= total,
            "{near} of {total} differ near a boundary"
        );
        // Both paths ran: the device decided at least a quarter of the draws.
        assert!(
            deferred > 0 && (total - deferred) * 4 >= total,
            "{deferred} of {total}"
        );
    }

    #[test]
    fn gpu_graph_decode_equals_plain_decode() {
        let mut plain = gpu_runner(16384);
        let mut graph = gpu_runner(16384);
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
        let mut first_seq = 0u64;
        // Buckets 1, 4, 8, 16, 24, 48, 64.
        for n in [1usize, 3, 8, 16, 17, 40, 64] {
            let seqs: Vec<u64> = (first_seq..first_seq + n as u64).collect();
            first_seq += n as u64;
            let prefill: Vec<StepInput> = seqs
                .iter()
                .map(|&s| {
                    let mut p = prompts()[s as usize % 5].clone();
                    p.push(100 + s as u32);
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
            for step in 0..6 {
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
                tokens: prompts()[0].clone(),
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
        // decode graphs are captured again and stay correct.
        let long: Vec<u32> = (0..graph.model().activations().caps().0 as u32 + 1)
            .map(|i| 200 + i % 3000)
            .collect();
        for r in [&mut plain, &mut graph] {
            r.step(&[StepInput {
                seq: SeqId(5000),
                tokens: long.clone(),
                want_logits: true,
            }])
            .unwrap();
        }
        let captured = graph.graph_stats().captured;
        assert_eq!(graph.graph_stats().invalidated, st.invalidated + 1);
        let mut next = vec![7042];
        for _ in 0..4 {
            let a = argmaxes(&decode(&mut plain, &[5000], &next));
            assert_eq!(a, argmaxes(&decode(&mut graph, &[5000], &next)));
            next = a;
        }
        assert_eq!(graph.graph_stats().captured, captured + 1);
    }
}
