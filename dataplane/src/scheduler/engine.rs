//! The engine loop: intake, admission, one batched forward step, token processing.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use tokio::sync::mpsc as tmpsc;
use tokio::sync::mpsc::error::{TryRecvError as KvTryRecvError, TrySendError};

use super::{
    EngineHealth, FailReason, FinishReason, GenEvent, ImportedKv, SchedulerConfig, Submission,
    Transfer, Usage,
};
use crate::Error;
use crate::engine_api::{ModelRunner, PrefixCacheCounters, SeqId, StepInput};
use crate::metrics::Metrics;
use crate::sampling::{Sampler, TokenLogprob};
use crate::stop::StopMatcher;
use crate::tokenizer::{StreamDecoder, TokenText};

/// How long to sleep when requests wait but nothing runs (blocks held elsewhere).
const WAIT_POLL: Duration = Duration::from_millis(5);

struct Active {
    seq: SeqId,
    sub: Submission,
    /// Prompt tokens already in the KV cache.
    prefilled: usize,
    /// Prompt tokens found in the prefix cache (never computed for this request).
    cached: usize,
    /// Sampled but not yet fed back into the model.
    next_input: Option<u32>,
    generated: usize,
    sampler: Sampler,
    decoder: StreamDecoder,
    stop: StopMatcher,
    last_token_at: Option<Instant>,
}

/// A decode-role request whose blocks are reserved while its KV is on the way.
struct Reserved {
    seq: SeqId,
    sub: Submission,
    kv: tmpsc::Receiver<ImportedKv>,
    /// Prompt tokens already in the sequence (its cached prefix): the KV follows them.
    cached: usize,
}

pub(super) struct Engine<R: ModelRunner> {
    runner: R,
    text: Arc<dyn TokenText>,
    cfg: SchedulerConfig,
    metrics: Arc<Metrics>,
    rx: Receiver<Submission>,
    health: Arc<EngineHealth>,
    waiting: VecDeque<Submission>,
    running: Vec<Active>,
    reserved: Vec<Reserved>,
    next_seq: u64,
    disconnected: bool,
    /// The runner's prefix-cache counters as last published.
    prefix_seen: PrefixCacheCounters,
}

enum Outcome {
    Continue,
    Finish(FinishReason, String),
    /// The client went away: drop silently (counted).
    Gone,
}

impl<R: ModelRunner> Engine<R> {
    pub(super) fn new(
        runner: R,
        text: Arc<dyn TokenText>,
        cfg: SchedulerConfig,
        metrics: Arc<Metrics>,
        rx: Receiver<Submission>,
        health: Arc<EngineHealth>,
    ) -> Self {
        Self {
            runner,
            text,
            cfg,
            metrics,
            rx,
            health,
            waiting: VecDeque::new(),
            running: Vec::new(),
            reserved: Vec::new(),
            next_seq: 1,
            disconnected: false,
            prefix_seen: PrefixCacheCounters::default(),
        }
    }

    pub(super) fn run(mut self) {
        tracing::info!(
            max_batch = self.cfg.max_batch,
            chunk_size = self.cfg.chunk_size,
            "engine thread started"
        );
        loop {
            self.health.beat();
            if self.running.is_empty() {
                if self.disconnected && self.waiting.is_empty() && self.reserved.is_empty() {
                    break;
                }
                // Idle (or only waiting for blocks or KV): block on the channel, but wake
                // up regularly to beat the heartbeat and expire queued requests.
                let wait = if self.waiting.is_empty() && self.reserved.is_empty() {
                    self.cfg.idle_tick
                } else {
                    WAIT_POLL
                };
                match self.rx.recv_timeout(wait) {
                    Ok(sub) => self.intake(sub),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => self.disconnected = true,
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(sub) => self.intake(sub),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.disconnected = true;
                        break;
                    }
                }
            }
            self.drop_abandoned();
            self.expire_waiting();
            self.admit();
            self.poll_imports();
            // Work the engine itself must move: running sequences, or queued requests with
            // no reservation waiting for KV (those wait on a prefill, not on this engine;
            // the KV timeout and the channel deadline cover that).
            self.health.note_work(
                !self.running.is_empty() || (!self.waiting.is_empty() && self.reserved.is_empty()),
            );
            if !self.running.is_empty() && !self.health.holding() {
                self.step();
            }
            self.publish_gauges();
        }
        tracing::info!("engine thread stopped: all handles dropped and no work left");
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.runner.info().kv_block_size.max(1))
    }

    fn intake(&mut self, sub: Submission) {
        let info = self.runner.info();
        let total = sub.req.prompt.len() + sub.req.max_tokens;
        let check = if sub.req.prompt.is_empty() {
            Err((FailReason::InvalidRequest, "empty prompt".to_owned()))
        } else if sub.req.max_tokens == 0 {
            Err((
                FailReason::InvalidRequest,
                "max_tokens must be at least 1".to_owned(),
            ))
        } else if total > info.context_length {
            Err((
                FailReason::TooLarge,
                format!(
                    "prompt ({}) + max_tokens ({}) exceeds the context length {}",
                    sub.req.prompt.len(),
                    sub.req.max_tokens,
                    info.context_length
                ),
            ))
        } else if self.blocks_for(total) > self.runner.kv_usage().blocks_total {
            Err((
                FailReason::TooLarge,
                format!(
                    "needs {} KV blocks, the cache has {}",
                    self.blocks_for(total),
                    self.runner.kv_usage().blocks_total
                ),
            ))
        } else if let Transfer::Export { from } = sub.req.transfer
            && (!from.is_multiple_of(info.kv_block_size.max(1)) || from >= sub.req.prompt.len())
        {
            Err((
                FailReason::InvalidRequest,
                format!(
                    "KV export from token {from}: not a whole number of {}-token blocks \
                     within the {}-token prompt",
                    info.kv_block_size,
                    sub.req.prompt.len()
                ),
            ))
        } else if self.waiting.len() >= self.cfg.max_waiting {
            Err((
                FailReason::QueueFull,
                format!("{} requests already waiting", self.waiting.len()),
            ))
        } else {
            Ok(())
        };
        match check {
            Ok(()) => self.waiting.push_back(sub),
            Err((reason, msg)) => self.fail(&sub, reason, msg),
        }
    }

    fn fail(&self, sub: &Submission, reason: FailReason, message: String) {
        tracing::warn!(reason = reason.label(), %message, "generation failed");
        self.metrics.fail(reason.label());
        let _ = sub.out.try_send(GenEvent::Failed { reason, message });
    }

    /// Requests whose receiver was dropped (client disconnected) leave at once and free
    /// their blocks. So do decode-role reservations whose request ended while its KV was
    /// on the way (an in-place reset, the drain deadline, the client): the room's sender
    /// may outlive the request — a KV loop that is stuck holds it until it wakes — and a
    /// reservation kept for it would hold a batch slot and its blocks for no one. The
    /// request reported its own reason, so this counts nothing; KV that arrives later
    /// finds the receiver gone and is dropped by the loop.
    fn drop_abandoned(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|s| !s.out.is_closed());
        for _ in self.waiting.len()..before {
            self.note_gone();
        }
        let mut i = 0;
        while i < self.reserved.len() {
            if self.reserved[i].sub.out.is_closed() {
                let r = self.reserved.swap_remove(i);
                self.runner.free(r.seq);
                tracing::debug!(
                    seq = r.seq.0,
                    "KV reservation released: its request ended before the KV arrived"
                );
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].sub.out.is_closed() {
                let a = self.running.swap_remove(i);
                self.runner.free(a.seq);
                self.note_gone();
            } else {
                i += 1;
            }
        }
    }

    fn note_gone(&self) {
        tracing::info!(reason = "client_disconnected", "request aborted");
        self.metrics.fail("client_disconnected");
    }

    fn expire_waiting(&mut self) {
        let timeout = self.cfg.queue_timeout;
        while let Some(front) = self.waiting.front() {
            // FIFO: the front waited longest.
            if front.arrived.elapsed() < timeout {
                break;
            }
            let sub = self.waiting.pop_front().expect("front exists");
            let msg = format!("timed out after {timeout:?} waiting for KV cache memory");
            self.fail(&sub, FailReason::QueueTimeout, msg);
        }
    }

    /// Admit waiting requests in FIFO order while the batch has room and KV blocks for the
    /// whole request (prompt + max_tokens) can be reserved up front, so a running request
    /// never runs out of blocks mid-generation. A request that computes its prompt here
    /// starts after the longest prefix of it the runner has cached.
    fn admit(&mut self) {
        while self.running.len() + self.reserved.len() < self.cfg.max_batch {
            let Some(front) = self.waiting.front() else {
                break;
            };
            let total = front.req.prompt.len() + front.req.max_tokens;
            let seq = SeqId(self.next_seq);
            // The runner's reservation is all or nothing, and counts idle cached blocks as
            // free and the cached prefix as held already.
            let reserved = self.runner.reserve_prompt(seq, &front.req.prompt, total);
            let cached = match reserved {
                Ok(cached) => cached,
                Err(Error::KvCacheFull { .. }) => break,
                Err(e) => {
                    let sub = self.waiting.pop_front().expect("front exists");
                    self.runner.free(seq);
                    self.fail(
                        &sub,
                        FailReason::StepFailed,
                        format!("KV reserve failed: {e}"),
                    );
                    continue;
                }
            };
            self.next_seq += 1;
            let sub = self.waiting.pop_front().expect("front exists");
            if let Transfer::Import(slot) = &sub.req.transfer {
                // Decode role: hold the blocks until the KV arrives or the room ends.
                let Some(kv) = slot.take() else {
                    self.runner.free(seq);
                    self.fail(
                        &sub,
                        FailReason::InvalidRequest,
                        "KV import slot already used".to_owned(),
                    );
                    continue;
                };
                let _ = sub.out.try_send(GenEvent::KvReserved { cached });
                self.reserved.push(Reserved {
                    seq,
                    sub,
                    kv,
                    cached,
                });
                continue;
            }
            self.metrics
                .prompt_tokens
                .inc_by(sub.req.prompt.len() as u64);
            self.running.push(Active {
                seq,
                sampler: Sampler::with_prompt(sub.req.sampling.clone(), &sub.req.prompt),
                stop: StopMatcher::new(sub.req.stop.clone()),
                sub,
                prefilled: cached,
                cached,
                next_input: None,
                generated: 0,
                decoder: StreamDecoder::new(),
                last_token_at: None,
            });
        }
    }

    /// Reserved decode-role sequences: import KV that arrived and start decoding; free the
    /// blocks of those whose room ended without KV (exactly once: the entry leaves here).
    fn poll_imports(&mut self) {
        let mut i = 0;
        while i < self.reserved.len() {
            let kv = match self.reserved[i].kv.try_recv() {
                Err(KvTryRecvError::Empty) => {
                    i += 1;
                    continue;
                }
                Ok(kv) => Some(kv),
                Err(KvTryRecvError::Disconnected) => None,
            };
            let Reserved {
                seq, sub, cached, ..
            } = self.reserved.swap_remove(i);
            let Some(kv) = kv else {
                // The room ended (failed, or aborted and acknowledged): the HTTP request
                // reports and counts the transfer failure; only the blocks are ours.
                self.runner.free(seq);
                tracing::debug!(
                    seq = seq.0,
                    "KV reservation released: room ended without KV"
                );
                let _ = sub.out.try_send(GenEvent::Failed {
                    reason: FailReason::KvTransfer,
                    message: "the KV transfer ended without KV".to_owned(),
                });
                continue;
            };
            let payload = (*kv.payload).as_ref();
            if let Err(e) = self.runner.import_kv_after(seq, cached, payload) {
                self.runner.free(seq);
                self.fail(
                    &sub,
                    FailReason::KvTransfer,
                    format!("KV import failed: {e}"),
                );
                continue;
            }
            let mut sampler = Sampler::with_prompt(sub.req.sampling.clone(), &sub.req.prompt);
            sampler.skip_draw();
            self.running.push(Active {
                seq,
                sampler,
                stop: StopMatcher::new(sub.req.stop.clone()),
                prefilled: sub.req.prompt.len(),
                cached,
                sub,
                next_input: None,
                generated: 0,
                decoder: StreamDecoder::new(),
                last_token_at: None,
            });
            // The prefill already sampled the first token: process it as if sampled here.
            // The payload (a pooled reassembly buffer) is released right after the import.
            let (first, lp) = (kv.first_token, kv.first_logprob);
            drop(kv.payload);
            let j = self.running.len() - 1;
            let outcome = self.on_token(j, first, lp);
            self.conclude(vec![(j, outcome)]);
        }
    }

    /// One forward step: every decoding sequence feeds its last token; prefilling
    /// sequences share `chunk_size` prompt tokens, oldest first.
    fn step(&mut self) {
        let mut batch = Vec::with_capacity(self.running.len());
        let mut owners = Vec::with_capacity(self.running.len());
        for (i, a) in self.running.iter().enumerate() {
            if let Some(t) = a.next_input {
                batch.push(StepInput {
                    seq: a.seq,
                    tokens: vec![t],
                    want_logits: true,
                });
                owners.push(i);
            }
        }
        let mut budget = self.cfg.chunk_size.max(1);
        let mut progressed = Vec::new();
        for (i, a) in self.running.iter_mut().enumerate() {
            let prompt = &a.sub.req.prompt;
            if a.next_input.is_some() || a.prefilled == prompt.len() || budget == 0 {
                continue;
            }
            let n = budget.min(prompt.len() - a.prefilled);
            let end = a.prefilled + n;
            if end < prompt.len() && matches!(a.sub.req.transfer, Transfer::Export { .. }) {
                progressed.push(i);
            }
            batch.push(StepInput {
                seq: a.seq,
                tokens: prompt[a.prefilled..end].to_vec(),
                want_logits: end == prompt.len(),
            });
            a.prefilled = end;
            budget -= n;
            owners.push(i);
        }
        if batch.is_empty() {
            return;
        }
        self.metrics.engine_steps.inc();
        self.metrics
            .engine_step_sequences
            .inc_by(batch.len() as u64);
        // One sampler per batch entry (owners are distinct running indices). The runner
        // samples where the logits are (a device runner moves only token ids); by
        // default it is step + `Sampler::sample` on the host, row by row.
        // An injected step failure (tests only) skips the runner.
        let stepped = (!self.health.failing_injected()).then(|| {
            let mut slots: Vec<Option<&mut Sampler>> = self
                .running
                .iter_mut()
                .map(|a| Some(&mut a.sampler))
                .collect();
            let mut samplers: Vec<&mut Sampler> = owners
                .iter()
                .map(|&i| {
                    slots[i]
                        .take()
                        .expect("each running sequence is in a batch once")
                })
                .collect();
            let runner = &mut self.runner;
            // A panicking runner must fail the requests of this batch, not kill the thread
            // that serves everyone else.
            catch_unwind(AssertUnwindSafe(|| {
                runner.step_sample(&batch, &mut samplers)
            }))
        });
        let result = match stepped {
            None => Err("injected fault: the step fails".to_owned()),
            Some(Ok(Ok(out))) if out.len() == batch.len() => Ok(out),
            Some(Ok(Ok(out))) => Err(format!(
                "runner returned {} outputs for {} inputs",
                out.len(),
                batch.len()
            )),
            Some(Ok(Err(e))) => Err(e.to_string()),
            Some(Err(panic)) => Err(format!("runner panicked: {}", panic_message(&panic))),
        };
        let outputs = match result {
            Ok(o) => {
                self.health.note_step_ok();
                o
            }
            Err(msg) => {
                self.health.note_step_failed();
                self.fail_all(&owners, &msg);
                return;
            }
        };
        // Export requests hear how far their prompt got (the last chunk ends in a token).
        for i in progressed {
            let a = &self.running[i];
            let _ = a.sub.out.try_send(GenEvent::Progress {
                prefilled: a.prefilled,
                total: a.sub.req.prompt.len(),
            });
        }
        let mut outcomes = Vec::new();
        for (&i, sampled) in owners.iter().zip(outputs) {
            let Some((token, logprob)) = sampled else {
                continue;
            };
            outcomes.push((i, self.on_token(i, token, logprob)));
        }
        self.conclude(outcomes);
    }

    /// Remove the finished and abandoned sequences of `outcomes` and report their end.
    fn conclude(&mut self, outcomes: Vec<(usize, Outcome)>) {
        let mut finished: Vec<(usize, Option<FinishReason>, String)> = Vec::new();
        for (i, o) in outcomes {
            match o {
                Outcome::Continue => {}
                Outcome::Finish(r, text) => finished.push((i, Some(r), text)),
                Outcome::Gone => finished.push((i, None, String::new())),
            }
        }
        // Remove highest index first so the remaining indices stay valid.
        finished.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, reason, text) in finished {
            let a = self.running.swap_remove(i);
            let export = match (&a.sub.req.transfer, reason) {
                (Transfer::Export { from }, Some(_)) => {
                    Some(self.runner.export_kv_from(a.seq, *from))
                }
                _ => None,
            };
            self.runner.free(a.seq);
            match (reason, export) {
                (Some(_), Some(Err(e))) => self.fail(
                    &a.sub,
                    FailReason::KvTransfer,
                    format!("KV export failed: {e}"),
                ),
                (Some(reason), export) => {
                    if let Some(Ok(payload)) = export {
                        let _ = a.sub.out.try_send(GenEvent::KvExported(payload));
                    }
                    let usage = Usage {
                        prompt_tokens: a.sub.req.prompt.len(),
                        completion_tokens: a.generated,
                        cached_tokens: a.cached,
                    };
                    let _ = a.sub.out.try_send(GenEvent::Done {
                        reason,
                        text,
                        usage,
                    });
                }
                (None, _) => self.note_gone(),
            }
        }
    }

    fn on_token(&mut self, i: usize, token: u32, logprob: Option<TokenLogprob>) -> Outcome {
        let ctx = self.runner.info().context_length;
        let a = &mut self.running[i];
        let seq_len = self.runner.seq_len(a.seq);
        let now = Instant::now();
        match a.last_token_at {
            None => self
                .metrics
                .ttft
                .observe((now - a.sub.arrived).as_secs_f64()),
            Some(t) => self.metrics.inter_token.observe((now - t).as_secs_f64()),
        }
        a.last_token_at = Some(now);
        a.generated += 1;
        a.sampler.accept(token);
        self.metrics.generated_tokens.inc();
        // As in vLLM, neither stop tokens nor stop strings end generation before the
        // min_tokens-th token; the sampler masks the stop tokens through that token, so
        // the check matters only to a runner that samples without the sampler.
        let may_stop = a.generated >= a.sub.req.sampling.min_tokens;
        if may_stop && a.sub.req.stop_token_ids.contains(&token) {
            let rest = a.decoder.finish() + &a.stop.finish();
            return Outcome::Finish(FinishReason::Stop, rest);
        }
        let piece = a.decoder.push(self.text.token_bytes(token));
        let (text, stopped) = if may_stop {
            a.stop.push(&piece)
        } else {
            (a.stop.push_unchecked(&piece), false)
        };
        let ev = GenEvent::Token {
            id: token,
            text,
            logprob,
        };
        if let Err(TrySendError::Closed(_) | TrySendError::Full(_)) = a.sub.out.try_send(ev) {
            return Outcome::Gone;
        }
        if stopped {
            return Outcome::Finish(FinishReason::Stop, String::new());
        }
        // The sampled token still needs a slot in the cache when it is fed back.
        if a.generated >= a.sub.req.max_tokens || seq_len >= ctx {
            let piece = a.decoder.finish();
            let (mut text, stopped) = if may_stop {
                a.stop.push(&piece)
            } else {
                (a.stop.push_unchecked(&piece), false)
            };
            if !stopped {
                text.push_str(&a.stop.finish());
            }
            let reason = if stopped {
                FinishReason::Stop
            } else {
                FinishReason::Length
            };
            return Outcome::Finish(reason, text);
        }
        a.next_input = Some(token);
        Outcome::Continue
    }

    fn fail_all(&mut self, owners: &[usize], msg: &str) {
        tracing::error!(error = %msg, requests = owners.len(), "forward step failed");
        let mut idx = owners.to_vec();
        idx.sort_unstable_by(|a, b| b.cmp(a));
        for i in idx {
            let a = self.running.swap_remove(i);
            self.runner.free(a.seq);
            self.fail(
                &a.sub,
                FailReason::StepFailed,
                format!("forward step failed: {msg}"),
            );
        }
    }

    fn publish_gauges(&mut self) {
        let kv = self.runner.kv_usage();
        self.metrics
            .prefix_cache
            .publish(&mut self.prefix_seen, &kv);
        self.metrics.running.set(self.running.len() as i64);
        self.metrics.waiting.set(self.waiting.len() as i64);
        self.metrics.kv_blocks_used.set(kv.blocks_used as i64);
        self.metrics
            .kv_blocks_free
            .set(kv.blocks_total.saturating_sub(kv.blocks_used) as i64);
        self.metrics
            .kv_cache_usage
            .set(kv.blocks_used as f64 / kv.blocks_total.max(1) as f64);
        // Routers' view of the prefix cache: a copy only when one asked and it changed.
        if let Some(since) = self.metrics.prefix_report.due()
            && let Some(keys) = self.runner.prefix_keys(since)
        {
            self.metrics.prefix_report.publish(keys);
        }
    }
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}
