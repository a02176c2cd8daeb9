//! Host-side tests of the CUDA runner: they run everywhere (`make cuda-check`). The tests
//! that need a device are in `gpu_tests` (feature `gpu-tests`).

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
