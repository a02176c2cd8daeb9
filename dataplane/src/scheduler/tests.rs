//! Scheduler tests against the deterministic toy runner of `test_support::fake_runner`.

use super::*;
use crate::engine_api::SeqId;
use crate::test_support::fake_runner::{FakeRunner, VOCAB, fake, letters};

fn start(runner: FakeRunner, cfg: SchedulerConfig) -> (EngineHandle, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let (h, _join) = spawn(runner, letters(), cfg, metrics.clone()).unwrap();
    (h, metrics)
}

fn req(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        transfer: Default::default(),
        prompt,
        max_tokens,
        sampling: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        stop: vec![],
        stop_token_ids: vec![],
    }
}

#[derive(Debug, Default)]
struct Collected {
    ids: Vec<u32>,
    text: String,
    done: Option<(FinishReason, Usage)>,
    failed: Option<(FailReason, String)>,
    exported: Option<Vec<u8>>,
    progress: Vec<(usize, usize)>,
}

fn collect(mut rx: tmpsc::Receiver<GenEvent>) -> Collected {
    let mut c = Collected::default();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            GenEvent::Token { id, text, .. } => {
                c.ids.push(id);
                c.text.push_str(&text);
            }
            GenEvent::Done {
                reason,
                text,
                usage,
            } => {
                c.text.push_str(&text);
                c.done = Some((reason, usage));
            }
            GenEvent::Failed { reason, message } => c.failed = Some((reason, message)),
            GenEvent::KvExported(p) => {
                assert!(c.done.is_none(), "the export comes before Done");
                c.exported = Some(p);
            }
            GenEvent::KvReserved { .. } => {}
            GenEvent::Progress { prefilled, total } => c.progress.push((prefilled, total)),
        }
    }
    c
}

fn prompts() -> Vec<Vec<u32>> {
    (0..6u32)
        .map(|i| {
            (0..(3 + 5 * i))
                .map(|j| (i * 7 + j) % VOCAB as u32)
                .collect()
        })
        .collect()
}

fn counter(metrics: &Metrics, reason: &str) -> u64 {
    metrics
        .failures
        .get_or_create(&crate::metrics::ReasonLabels {
            reason: reason.into(),
        })
        .get()
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn batched_outputs_equal_single_runs() {
    let cfg = SchedulerConfig {
        chunk_size: 8,
        ..Default::default()
    };
    let mut singles = Vec::new();
    for p in prompts() {
        let (r, _) = fake(1000);
        let (h, _) = start(r, cfg.clone());
        singles.push(collect(h.submit(req(p, 12)).unwrap()));
    }
    let (r, st) = fake(1000);
    let (h, _) = start(r, cfg);
    let rxs: Vec<_> = prompts()
        .into_iter()
        .map(|p| h.submit(req(p, 12)).unwrap())
        .collect();
    let batched: Vec<Collected> = rxs.into_iter().map(collect).collect();
    for (i, (s, b)) in singles.iter().zip(&batched).enumerate() {
        assert_eq!(s.ids.len(), 12, "prompt {i}");
        assert_eq!(s.ids, b.ids, "prompt {i}");
        assert_eq!(s.text, b.text);
        assert_eq!(
            b.done.unwrap(),
            (
                FinishReason::Length,
                Usage {
                    prompt_tokens: prompts()[i].len(),
                    completion_tokens: 12,
                    cached_tokens: 0,
                }
            )
        );
    }
    // Different prompts really produced different outputs, and steps really were batched.
    assert_ne!(batched[0].ids, batched[1].ids);
    let st = st.lock().unwrap();
    assert!(
        st.log.iter().any(|s| s.len() >= 4),
        "no step batched 4+ sequences"
    );
    assert!(st.seqs.is_empty(), "finished sequences must be freed");
}

#[test]
fn long_prompt_is_prefilled_in_chunks_between_decodes() {
    let (r, st) = fake(1000);
    // The short request must still be decoding while the long one prefills: make it long
    // enough in steps and time (500 steps of at least 1 ms).
    st.lock().unwrap().step_delay = Duration::from_millis(1);
    let (h, _) = start(
        r,
        SchedulerConfig {
            chunk_size: 4,
            ..Default::default()
        },
    );
    let mut short = h.submit(req(vec![5, 6], 500)).unwrap();
    // Wait until the short request decodes before the long one arrives.
    assert!(matches!(
        short.blocking_recv(),
        Some(GenEvent::Token { .. })
    ));
    let long = h
        .submit(req((0..22).map(|i| i % 30 + 2).collect(), 3))
        .unwrap();
    let long = collect(long);
    assert_eq!(long.ids.len(), 3);
    drop(short);
    let st = st.lock().unwrap();
    let long_seq = SeqId(2);
    let prefill_steps: Vec<&Vec<(SeqId, usize, bool)>> = st
        .log
        .iter()
        .filter(|s| s.iter().any(|e| e.0 == long_seq && e.1 > 1))
        .collect();
    // 22 tokens in chunks of at most 4: 6 steps, only the last one wants logits.
    assert_eq!(prefill_steps.len(), 6);
    let chunks: Vec<(usize, bool)> = prefill_steps
        .iter()
        .map(|s| {
            s.iter()
                .find(|e| e.0 == long_seq)
                .map(|e| (e.1, e.2))
                .unwrap()
        })
        .collect();
    assert_eq!(
        chunks,
        vec![
            (4, false),
            (4, false),
            (4, false),
            (4, false),
            (4, false),
            (2, true)
        ]
    );
    // The running decode advanced in every one of those steps: it was not starved.
    for s in &prefill_steps {
        assert!(
            s.contains(&(SeqId(1), 1, true)),
            "decode missing from step {s:?}"
        );
    }
}

#[test]
fn client_disconnect_aborts_and_frees_blocks() {
    let (r, st) = fake(1000);
    st.lock().unwrap().step_delay = Duration::from_millis(2);
    let (h, metrics) = start(r, SchedulerConfig::default());
    let mut rx = h.submit(req(vec![3, 4, 5], 100)).unwrap();
    assert!(matches!(rx.blocking_recv(), Some(GenEvent::Token { .. })));
    assert!(st.lock().unwrap().used() > 0);
    drop(rx);
    wait_until("blocks freed", || st.lock().unwrap().used() == 0);
    wait_until("abort counted", || {
        counter(&metrics, "client_disconnected") == 1
    });
    // It stopped early: far fewer than 100 steps ran.
    assert!(st.lock().unwrap().log.len() < 50);
}

#[test]
fn kv_full_waits_for_blocks_then_runs() {
    // 10 blocks; each request needs ceil((3 + 25) / 4) = 7 blocks, so only one fits.
    let (r, st) = fake(10);
    let (h, _) = start(r, SchedulerConfig::default());
    let a = h.submit(req(vec![2, 3, 4], 25)).unwrap();
    let b = h.submit(req(vec![5, 6, 7], 25)).unwrap();
    let (a, b) = (collect(a), collect(b));
    assert_eq!((a.ids.len(), b.ids.len()), (25, 25));
    let st = st.lock().unwrap();
    // Never both in one step.
    assert!(st.log.iter().all(|s| s.len() == 1));
}

#[test]
fn kv_full_wait_times_out_with_clear_error() {
    let (r, st) = fake(10);
    st.lock().unwrap().step_delay = Duration::from_millis(5);
    let cfg = SchedulerConfig {
        queue_timeout: Duration::from_millis(100),
        ..Default::default()
    };
    let (h, metrics) = start(r, cfg);
    let a = h.submit(req(vec![2, 3, 4], 25)).unwrap();
    let started = Instant::now();
    let b = collect(h.submit(req(vec![5, 6, 7], 25)).unwrap());
    let waited = started.elapsed();
    let (reason, msg) = b.failed.expect("second request must fail");
    assert_eq!(reason, FailReason::QueueTimeout);
    assert!(msg.contains("waiting for KV cache memory"), "{msg}");
    assert!(waited >= Duration::from_millis(100), "{waited:?}");
    assert!(b.ids.is_empty());
    assert_eq!(counter(&metrics, "queue_timeout"), 1);
    assert_eq!(collect(a).ids.len(), 25);
}

#[test]
fn never_fitting_and_overflowing_queue_fail_at_once() {
    let (r, st) = fake(4);
    st.lock().unwrap().step_delay = Duration::from_millis(5);
    let cfg = SchedulerConfig {
        max_waiting: 1,
        ..Default::default()
    };
    let (h, metrics) = start(r, cfg);
    let big = collect(h.submit(req(vec![2; 10], 20)).unwrap());
    assert_eq!(big.failed.unwrap().0, FailReason::TooLarge);
    let mut a = h.submit(req(vec![2, 3], 10)).unwrap(); // takes 3 of 4 blocks
    assert!(matches!(a.blocking_recv(), Some(GenEvent::Token { .. })));
    let b = h.submit(req(vec![4, 5], 10)).unwrap(); // waits for blocks
    // The third is refused, either by the bounded channel or by the waiting-queue limit.
    match h.submit(req(vec![6, 7], 10)) {
        Err(e) => assert_eq!(e, SubmitError::QueueFull),
        Ok(c) => assert_eq!(collect(c).failed.map(|f| f.0), Some(FailReason::QueueFull)),
    }
    assert_eq!(collect(a).ids.len(), 9);
    assert_eq!(collect(b).ids.len(), 10);
    assert_eq!(counter(&metrics, "too_large"), 1);
    assert_eq!(counter(&metrics, "queue_full"), 1);
}

#[test]
fn stop_tokens_and_stop_strings_end_generation() {
    let (r, _) = fake(1000);
    let (h, _) = start(r, SchedulerConfig::default());
    let free_run = collect(h.submit(req(vec![9, 8, 7], 20)).unwrap());
    assert_eq!(free_run.ids.len(), 20);
    // EOS: stop at the first occurrence of the 5th generated token, without its text.
    let eos = free_run.ids[4];
    let first = free_run.ids.iter().position(|&t| t == eos).unwrap();
    let mut r = req(vec![9, 8, 7], 20);
    r.stop_token_ids = vec![eos];
    let c = collect(h.submit(r).unwrap());
    assert_eq!(c.done.unwrap().0, FinishReason::Stop);
    assert_eq!(c.ids, free_run.ids[..first]);
    assert_eq!(c.text, free_run.text[..first]);
    // Stop string spanning two tokens (letters 6 and 7 of the free run).
    let stop = free_run.text[6..8].to_owned();
    let cut = free_run.text.find(&stop).unwrap();
    let mut r = req(vec![9, 8, 7], 20);
    r.stop = vec![stop];
    let c = collect(h.submit(r).unwrap());
    assert_eq!(c.done.unwrap().0, FinishReason::Stop);
    assert_eq!(c.text, free_run.text[..cut]);
}

#[test]
fn runner_panic_fails_its_batch_and_the_engine_keeps_serving() {
    let (r, st) = fake(1000);
    st.lock().unwrap().panic_on_token = Some(33);
    let (h, metrics) = start(r, SchedulerConfig::default());
    let bad = collect(h.submit(req(vec![33, 2], 5)).unwrap());
    let (reason, msg) = bad.failed.unwrap();
    assert_eq!(reason, FailReason::StepFailed);
    assert!(msg.contains("toy runner told to panic"), "{msg}");
    assert_eq!(counter(&metrics, "step_failed"), 1);
    let good = collect(h.submit(req(vec![2, 3], 5)).unwrap());
    assert_eq!(good.ids.len(), 5);
    assert!(st.lock().unwrap_or_else(|e| e.into_inner()).seqs.is_empty());
    assert!(h.health().heartbeat_age() < Duration::from_secs(1));
}

#[test]
fn seeded_sampling_is_reproducible_through_the_engine() {
    let (r, _) = fake(1000);
    let (h, _) = start(r, SchedulerConfig::default());
    let run = |seed| {
        let mut r = req(vec![4, 4, 4], 16);
        r.sampling = SamplingParams {
            temperature: 1.5,
            seed: Some(seed),
            ..Default::default()
        };
        collect(h.submit(r).unwrap()).ids
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
}

/// PD in miniature: one engine prefills and exports (max_tokens 1), another imports the KV
/// and continues from the first token; the result equals one engine doing everything, and
/// both give their blocks back.
#[test]
fn export_then_import_continues_exactly_like_one_engine() {
    let prompt = prompts()[3].clone();
    let (r, _) = fake(1000);
    let (h, _) = start(r, SchedulerConfig::default());
    let whole = collect(h.submit(req(prompt.clone(), 10)).unwrap());

    let (r, prefill_st) = fake(1000);
    let (prefill, _) = start(r, SchedulerConfig::default());
    let mut pre = req(prompt.clone(), 1);
    pre.transfer = Transfer::Export { from: 0 };
    let p = collect(prefill.submit(pre).unwrap());
    let payload = p.exported.expect("KV exported");
    assert_eq!(payload.len(), prompt.len() * 4, "exactly the prompt's KV");
    assert_eq!(p.ids, whole.ids[..1]);
    wait_until("prefill blocks freed", || {
        prefill_st.lock().unwrap().used() == 0
    });

    let (r, decode_st) = fake(1000);
    let (decode, _) = start(r, SchedulerConfig::default());
    let mut dec = req(prompt.clone(), 10);
    dec.transfer = Transfer::Import(Arc::new(KvImport::ready(ImportedKv {
        payload: Box::new(payload),
        first_token: p.ids[0],
        first_logprob: None,
    })));
    let d = collect(decode.submit(dec).unwrap());
    assert_eq!(d.ids, whole.ids);
    assert_eq!(d.text, whole.text);
    assert_eq!(d.done, whole.done);
    assert!(d.exported.is_none());
    // The decode never ran the prompt: only single-token steps.
    let log = decode_st.lock().unwrap().log.clone();
    assert!(log.iter().flatten().all(|&(_, n, _)| n == 1), "{log:?}");
    wait_until("decode blocks freed", || {
        decode_st.lock().unwrap().used() == 0
    });

    // A payload that does not fit fails the request with the KV reason, holding nothing.
    let mut bad = req(prompt, 4);
    bad.transfer = Transfer::Import(Arc::new(KvImport::ready(ImportedKv {
        payload: Box::new(vec![1u8, 2, 3]),
        first_token: 5,
        first_logprob: None,
    })));
    let f = collect(decode.submit(bad).unwrap());
    assert_eq!(f.failed.map(|x| x.0), Some(FailReason::KvTransfer));
    assert!(f.ids.is_empty());
    wait_until("blocks freed after a failed import", || {
        decode_st.lock().unwrap().used() == 0
    });
}

/// How [`DeviceSampling`] answers `step_sample`.
#[derive(Clone, Copy)]
enum Mode {
    /// Like a device runner: draw, then pick with the drawn number (`Sampler::sample_drawn`).
    Drawn,
    /// Always this token, without logprobs.
    Constant(u32),
    /// One output fewer than inputs.
    Short,
    /// Panic inside `step_sample`.
    Panic,
}

/// The toy runner with its own `step_sample` (as the CUDA runner has), counting calls.
struct DeviceSampling {
    inner: FakeRunner,
    mode: Mode,
    calls: Arc<AtomicU64>,
}

impl ModelRunner for DeviceSampling {
    fn info(&self) -> &crate::engine_api::ModelInfo {
        self.inner.info()
    }
    fn reserve(&mut self, seq: SeqId, total: usize) -> crate::Result<()> {
        self.inner.reserve(seq, total)
    }
    fn step(&mut self, _: &[crate::engine_api::StepInput]) -> crate::Result<Vec<Option<Vec<f32>>>> {
        panic!("the engine must call step_sample, not step");
    }
    fn step_sample(
        &mut self,
        batch: &[crate::engine_api::StepInput],
        samplers: &mut [&mut crate::sampling::Sampler],
    ) -> crate::Result<Vec<Option<crate::engine_api::Sampled>>> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let logits = self.inner.step(batch)?;
        let mut out: Vec<_> = logits
            .into_iter()
            .zip(samplers.iter_mut())
            .map(|(l, s)| {
                let l = l?;
                Some(match self.mode {
                    Mode::Constant(t) => (t, None),
                    Mode::Panic => panic!("device sampler exploded"),
                    _ => {
                        let u = s.draw();
                        s.sample_drawn(&l, u)
                    }
                })
            })
            .collect();
        if matches!(self.mode, Mode::Short) {
            out.pop();
        }
        Ok(out)
    }
    fn seq_len(&self, seq: SeqId) -> usize {
        self.inner.seq_len(seq)
    }
    fn free(&mut self, seq: SeqId) {
        self.inner.free(seq)
    }
    fn kv_usage(&self) -> crate::engine_api::KvUsage {
        self.inner.kv_usage()
    }
}

fn start_device(mode: Mode) -> (EngineHandle, Arc<Metrics>, Arc<AtomicU64>) {
    let (inner, _) = fake(1000);
    let calls = Arc::new(AtomicU64::new(0));
    let r = DeviceSampling {
        inner,
        mode,
        calls: calls.clone(),
    };
    let metrics = Arc::new(Metrics::new());
    let (h, _join) = spawn(r, letters(), SchedulerConfig::default(), metrics.clone()).unwrap();
    (h, metrics, calls)
}

#[test]
fn the_engine_samples_through_step_sample() {
    // A runner that samples itself (draw + sample_drawn, as the CUDA runner does) gives
    // exactly the outputs of host sampling, greedy and seeded, for batched requests.
    let mut reqs: Vec<GenerateRequest> = prompts().into_iter().map(|p| req(p, 9)).collect();
    for (i, r) in reqs.iter_mut().enumerate().skip(2) {
        r.sampling = SamplingParams {
            temperature: 0.5 + 0.25 * i as f32,
            top_k: [0, 5, 0, 12][i % 4],
            top_p: [1.0, 1.0, 0.8, 0.6][i % 4],
            seed: Some(40 + i as u64),
            logprobs: (i == 3).then_some(2),
            ..Default::default()
        };
    }
    let run = |h: &EngineHandle| -> Vec<Collected> {
        let rxs: Vec<_> = reqs.iter().map(|r| h.submit(r.clone()).unwrap()).collect();
        rxs.into_iter().map(collect).collect()
    };
    let (r, _) = fake(1000);
    let (host, _) = start(r, SchedulerConfig::default());
    let want = run(&host);
    let (dev, _, calls) = start_device(Mode::Drawn);
    let got = run(&dev);
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(w.ids.len(), 9, "request {i}");
        assert_eq!(w.ids, g.ids, "request {i}");
        assert_eq!(w.text, g.text, "request {i}");
        assert_eq!(w.done, g.done, "request {i}");
    }
    assert!(
        calls.load(Ordering::Relaxed) >= 9,
        "step_sample ran every step"
    );

    // Whatever the runner samples is what the client gets.
    let (dev, _, _) = start_device(Mode::Constant(7));
    let c = collect(dev.submit(req(vec![1, 2, 3], 4)).unwrap());
    assert_eq!(c.ids, vec![7; 4]);
    assert_eq!(c.done.unwrap().0, FinishReason::Length);
}

#[test]
fn step_sample_failures_fail_the_batch_and_the_engine_keeps_serving() {
    for (mode, needle) in [
        (Mode::Short, "runner returned 0 outputs for 1 inputs"),
        (Mode::Panic, "runner panicked: device sampler exploded"),
    ] {
        let (h, metrics, _) = start_device(mode);
        let bad = collect(h.submit(req(vec![3, 4], 5)).unwrap());
        let (reason, msg) = bad.failed.unwrap();
        assert_eq!(reason, FailReason::StepFailed);
        assert!(msg.contains(needle), "{msg}");
        assert_eq!(counter(&metrics, "step_failed"), 1);
        assert!(bad.ids.is_empty());
        assert!(h.health().heartbeat_age() < Duration::from_secs(1));
    }
}

#[test]
fn an_export_reports_progress_per_prompt_chunk_and_nothing_else_does() {
    let cfg = SchedulerConfig {
        chunk_size: 4,
        ..SchedulerConfig::default()
    };
    let (r, _) = fake(1000);
    let (h, _) = start(r, cfg);
    let prompt: Vec<u32> = (2..12).collect(); // 10 tokens: chunks of 4, 4, 2
    let mut pre = req(prompt.clone(), 1);
    pre.transfer = Transfer::Export { from: 0 };
    let c = collect(h.submit(pre).unwrap());
    assert_eq!(
        c.progress,
        vec![(4, 10), (8, 10)],
        "one event per chunk but the last"
    );
    assert_eq!(c.ids.len(), 1);
    assert!(c.exported.is_some());
    // Colocated requests of the same prompt hear no progress.
    let c = collect(h.submit(req(prompt, 3)).unwrap());
    assert!(c.progress.is_empty(), "{:?}", c.progress);
    assert_eq!(c.ids.len(), 3);
}

/// Through the engine, on a tiny real model: requests sharing a prefix, arriving at once
/// into a batch of 3 with 16-token prefill chunks (so some are admitted while others are
/// mid-prefill or decoding, and reuse what those computed), give the same tokens and
/// logprob bits with the prefix cache as without it, and report their cached tokens.
#[test]
fn prefix_cached_requests_through_the_engine_equal_uncached_ones() {
    use crate::gguf::Gguf;
    use crate::model::synthetic::TinyLlama;
    use crate::model::{CpuModelRunner, RunnerConfig};
    use crate::test_support::fake_runner::letters_for;

    let g = Arc::new(Gguf::from_bytes(TinyLlama::default().to_bytes()).unwrap());
    let prefix: Vec<u32> = (0..50u32).map(|i| (i * 37 + 11) % 96).collect();
    let prompts: Vec<Vec<u32>> = (0..7u32)
        .map(|k| {
            let mut p = prefix[..(20 + 5 * k as usize).min(50)].to_vec();
            p.extend((0..=k).map(|i| (i * 13 + k) % 96));
            p
        })
        .collect();
    type Run = Vec<(Vec<(u32, u32, Vec<(u32, u32)>)>, Usage)>;
    let run = |prefix_cache: bool| -> Run {
        let rc = RunnerConfig {
            prefix_cache,
            ..RunnerConfig::with_kv_tokens(1024, tandem_kernels::GgmlType::F16)
        };
        let runner =
            CpuModelRunner::new(g.clone(), rc, Arc::new(tandem_kernels::CpuKernels::new()))
                .unwrap();
        let cfg = SchedulerConfig {
            max_batch: 3,
            chunk_size: 16,
            ..Default::default()
        };
        let (h, _join) = spawn(runner, letters_for(96), cfg, Arc::new(Metrics::new())).unwrap();
        // The first request alone, so that the others can find its prefix.
        let mut order = vec![prompts[6].clone()];
        order.extend(prompts.iter().cloned());
        let mut rxs = Vec::new();
        for (i, p) in order.into_iter().enumerate() {
            let mut r = req(p, 6);
            r.sampling.logprobs = Some(3);
            rxs.push(h.submit(r).unwrap());
            if i == 0 {
                let mut rx = rxs.pop().unwrap();
                let mut evs = Vec::new();
                while let Some(ev) = rx.blocking_recv() {
                    evs.push(ev);
                }
                rxs.push(replay(evs));
            }
        }
        rxs.into_iter()
            .map(|mut rx| {
                let mut toks = Vec::new();
                let mut usage = None;
                while let Some(ev) = rx.blocking_recv() {
                    match ev {
                        GenEvent::Token { id, logprob, .. } => {
                            let lp = logprob.expect("logprobs asked for");
                            let top = lp.top.iter().map(|(t, l)| (*t, l.to_bits())).collect();
                            toks.push((id, lp.logprob.to_bits(), top));
                        }
                        GenEvent::Done { usage: u, .. } => usage = Some(u),
                        other => panic!("{other:?}"),
                    }
                }
                (toks, usage.expect("done"))
            })
            .collect()
    };
    let cached = run(true);
    let plain = run(false);
    for (i, (a, b)) in cached.iter().zip(&plain).enumerate() {
        assert_eq!(a.0, b.0, "request {i}: tokens and logprob bits");
        assert_eq!(a.0.len(), 6);
        assert_eq!(b.1.cached_tokens, 0);
        assert_eq!(a.1.prompt_tokens, b.1.prompt_tokens);
    }
    let hits: Vec<usize> = cached.iter().map(|c| c.1.cached_tokens).collect();
    assert_eq!(hits[0], 0, "{hits:?}");
    assert_eq!(
        hits[7], 48,
        "the same prompt again: all whole blocks but the last token's"
    );
    assert!(
        hits[1..7].iter().all(|h| *h >= 16 && h % 16 == 0),
        "{hits:?}"
    );
}

/// A receiver that yields `evs` (already received) again.
fn replay(evs: Vec<GenEvent>) -> tmpsc::Receiver<GenEvent> {
    let (tx, rx) = tmpsc::channel(evs.len().max(1));
    for ev in evs {
        tx.try_send(ev).unwrap();
    }
    rx
}

/// A prefill asked to export from a token that is not a whole number of blocks within the
/// prompt (the decode's cached prefix) refuses the request at once, naming it.
#[test]
fn an_export_from_a_misaligned_or_too_long_prefix_is_refused() {
    let (r, st) = fake(1000);
    let (h, metrics) = start(r, SchedulerConfig::default());
    for (len, from) in [(9, 3), (8, 8), (8, 12)] {
        let mut pre = req((2..2 + len).collect(), 1);
        pre.transfer = Transfer::Export { from };
        let c = collect(h.submit(pre).unwrap());
        let (reason, msg) = c.failed.expect("refused");
        assert_eq!(reason, FailReason::InvalidRequest);
        assert!(msg.contains(&format!("from token {from}")), "{msg}");
    }
    assert_eq!(counter(&metrics, "invalid_request"), 3);
    assert!(st.lock().unwrap().log.is_empty(), "nothing ran");
}

/// A decode-role request ended (an in-place reset, the drain deadline, the client) while
/// its room's sender lives on in a KV loop that is stuck: its reservation must not hold a
/// batch slot and blocks until that loop wakes. Found by `bench_recovery.py --faults
/// kv_loop_stall`: after the reset, every batch slot was held by a request of the old
/// channel and new requests waited 12 s for the stalled thread.
#[test]
fn a_reservation_whose_request_ended_frees_its_slot_while_the_kv_sender_lives() {
    let (r, st) = fake(1000);
    let cfg = SchedulerConfig {
        max_batch: 2,
        ..Default::default()
    };
    let (h, _) = start(r, cfg);
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    for p in &prompts()[..2] {
        let (tx, slot) = KvImport::channel();
        let mut r = req(p.clone(), 8);
        r.transfer = Transfer::Import(Arc::new(slot));
        let mut rx = h.submit(r).unwrap();
        assert!(matches!(
            rx.blocking_recv(),
            Some(GenEvent::KvReserved { .. })
        ));
        senders.push(tx);
        receivers.push(rx);
    }
    assert!(st.lock().unwrap().used() > 0);
    // Both batch slots are held: a third request waits.
    let mut third = h.submit(req(prompts()[2].clone(), 4)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        third.try_recv().is_err(),
        "admitted while the batch was full"
    );

    drop(receivers);
    let done = collect(third);
    assert_eq!(done.ids.len(), 4, "{done:?}");
    wait_until("the ended reservations' blocks freed", || {
        st.lock().unwrap().used() == 0
    });
    // KV arriving for them later is refused by the channel, not imported.
    for tx in senders {
        let kv = ImportedKv {
            payload: Box::new(vec![0u8; 4]),
            first_token: 1,
            first_logprob: None,
        };
        assert!(tx.try_send(kv).is_err());
    }
    assert_eq!(st.lock().unwrap().used(), 0);
}

/// Work abandoned on an engine that does not step (held) leaves the stall counting; the
/// next successful step ends it. Work that leaves at once does not.
#[test]
fn work_abandoned_on_a_stalled_engine_keeps_the_stall_until_a_step_succeeds() {
    let (r, _st) = fake(1000);
    let (h, _metrics) = start(r, SchedulerConfig::default());
    // Cancelled at once, on a working engine: the spell closes.
    drop(h.submit(req(vec![3, 4, 5], 100)).unwrap());
    wait_until("idle", || !h.health().progress().work);
    h.health().inject(EngineFault::Hold(Duration::from_secs(3)));
    let rx = h.submit(req(vec![3, 4, 5], 4)).unwrap();
    std::thread::sleep(ABANDONED_STALL + Duration::from_millis(300));
    drop(rx);
    std::thread::sleep(Duration::from_millis(300));
    let p = h.health().progress();
    assert!(p.work, "the spell stays open once its work has left: {p:?}");
    let before = p.stalled_for();
    assert!(before >= ABANDONED_STALL, "{p:?}");
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        h.health().progress().stalled_for() > before,
        "still counting"
    );
    // The hold ends; a request steps: the spell closes.
    wait_until("the hold over", || !h.health().holding());
    let done = collect(h.submit(req(vec![3, 4, 5], 2)).unwrap());
    assert!(done.done.is_some(), "{done:?}");
    wait_until("the stall ended", || {
        h.health().progress().stalled_for() == Duration::ZERO
    });
}
