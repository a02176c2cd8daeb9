//! Sampling on the device against the host sampler: seeded requests, rows the host must
//! take (penalties, min_tokens), and the sampling kernel on fixed logits.

use super::*;

/// Steps a batch of five requests with `step_sample`; their tokens (and logprobs).
/// Each sampler knows its prompt and accepts its tokens, as in the engine.
fn sample_batch(
    r: &mut CudaModelRunner,
    vocab: u32,
    params: &[SamplingParams],
    steps: usize,
) -> Vec<Vec<Sampled>> {
    let mut next: Vec<Vec<u32>> = prompts_in(vocab);
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
    let (model, vocab) = same_backend_model();
    let mut host = gpu_runner_of(&model, 4096);
    host.set_options(CudaOptions {
        graphs: false,
        device_sampling: false,
    });
    let mut dev = gpu_runner_of(&model, 4096);
    let n = count("sampling steps", 24, 6);
    let want = sample_batch(&mut host, vocab, &params, n);
    let got = sample_batch(&mut dev, vocab, &params, n);
    // Equal unless a draw falls within float rounding (~1e-6) of a boundary
    // between two tokens: not expected in 5 x 24 draws.
    assert_eq!(got, want);
    let st = dev.sampling_stats();
    println!("device sampling of 5 x {n} tokens: {st:?}");
    assert_eq!(st.host_rows, n as u64, "the logprobs request");
    assert_eq!(st.device_rows + st.deferred_rows, 4 * n as u64);
    assert!(st.device_rows > 0);
    assert_eq!(host.sampling_stats().host_rows, 5 * n as u64);
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
    let (model, vocab) = same_backend_model();
    let mut host = gpu_runner_of(&model, 4096);
    host.set_options(CudaOptions {
        graphs: false,
        device_sampling: false,
    });
    let mut dev = gpu_runner_of(&model, 4096);
    let n = count("sampling steps", 24, 6) as u64;
    let want = sample_batch(&mut host, vocab, &params, n as usize);
    let got = sample_batch(&mut dev, vocab, &params, n as usize);
    assert_eq!(got, want);
    let st = dev.sampling_stats();
    println!("device sampling with penalties, 5 x {n} tokens: {st:?}");
    // Two penalized rows every step, the min_tokens row for its first 3 tokens.
    assert_eq!(st.host_rows, 2 * n + 3);
    assert_eq!(st.device_rows + st.deferred_rows, 3 * n - 3);
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
    // differ only where the host's choice changes within +-5e-4 of u (it is then one
    // of the host's picks for a draw in that window); at most 2% of the draws. A row left to the host (SAMPLE_DEFER) is only allowed where
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
    let nu = count("uniforms per row", 64, 16);
    let us: Vec<f32> = (0..nu)
        .map(|i| (i as f32 + 0.5) / nu as f32)
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
                // The host's pick moves down its sorted candidates as u grows, so a
                // draw within +-5e-4 of u picks one of the ranks between these two.
                let lo = host.sample_drawn(row, Some((u - 5e-4).max(0.0))).0;
                let hi = host.sample_drawn(row, Some((u + 5e-4).min(0.99999))).0;
                let inv_t = 1.0 / temperature;
                let (r_lo, r_hi) = (rank(row, inv_t, lo), rank(row, inv_t, hi));
                let r_got = rank(row, inv_t, got[k]);
                assert!(
                    temperature > 0.0 && (r_lo..=r_hi).contains(&r_got),
                    "{what}: device {} (rank {r_got}) host {want} (host at u -+ 5e-4: \
                     {lo} rank {r_lo}, {hi} rank {r_hi})",
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
