//! Continuous batching. One dedicated engine thread owns the `ModelRunner`; async HTTP
//! handlers submit requests through a bounded channel and receive a per-request event
//! stream. Between forward steps requests join (when KV blocks allow) and leave (finished,
//! failed, or their receiver dropped); prompts are prefilled in chunks so a long prompt
//! never stalls the running decodes for more than one chunk.

mod engine;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc as tmpsc;

use crate::engine_api::ModelRunner;
use crate::metrics::Metrics;
use crate::sampling::{SamplingParams, TokenLogprob};
use crate::tokenizer::TokenText;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Most sequences in the running batch.
    pub max_batch: usize,
    /// Most prompt tokens prefilled per step, over all prefilling sequences.
    pub chunk_size: usize,
    /// Most requests waiting for admission; more are refused at once.
    pub max_waiting: usize,
    /// How long a request may wait for KV memory before it fails.
    pub queue_timeout: Duration,
    /// Heartbeat period while idle.
    pub idle_tick: Duration,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_batch: 16,
            chunk_size: 256,
            max_waiting: 256,
            queue_timeout: Duration::from_secs(30),
            idle_tick: Duration::from_millis(200),
        }
    }
}

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Tokens that end generation (EOS and friends); they are not part of the output text.
    pub stop_token_ids: Vec<u32>,
    /// KV transfer role of this request (PD serving); `None` for colocated serving.
    pub transfer: Transfer,
}

/// How a request's KV cache relates to another process.
#[derive(Debug, Clone, Default)]
pub enum Transfer {
    #[default]
    None,
    /// Prefill role: after the last sampled token, export the sequence's KV from token
    /// `from` on (`GenEvent::KvExported`) before it is freed. `from` is the prefix the
    /// decode holds in its own prefix cache: a whole number of KV blocks, less than the
    /// prompt (0: all of it).
    Export { from: usize },
    /// Decode role: the prompt's KV is computed elsewhere. The engine first reserves the
    /// whole sequence's blocks, starting with the longest prefix of the prompt in its
    /// prefix cache (`GenEvent::KvReserved`), then waits for the KV on the
    /// slot's channel, imports it and continues from the first token the prefill sampled.
    /// The reservation is freed once the channel's sender is dropped without KV (the
    /// room ended, after ABORT_ACK when aborted), or once the request itself ends (its
    /// event receiver dropped: a reset, the drain deadline, the client), whichever comes
    /// first: a stuck KV loop holding the sender must not hold the blocks too.
    Import(Arc<KvImport>),
}

/// Where a decode-role request's KV arrives from (the KV loop's room holds the sender).
pub struct KvImport {
    rx: std::sync::Mutex<Option<tmpsc::Receiver<ImportedKv>>>,
}

impl KvImport {
    /// A slot and the sender that delivers its KV.
    pub fn channel() -> (tmpsc::Sender<ImportedKv>, Self) {
        let (tx, rx) = tmpsc::channel(1);
        (
            tx,
            Self {
                rx: std::sync::Mutex::new(Some(rx)),
            },
        )
    }

    /// A slot whose KV is already there.
    pub fn ready(kv: ImportedKv) -> Self {
        let (tx, slot) = Self::channel();
        let _ = tx.try_send(kv);
        slot
    }

    fn take(&self) -> Option<tmpsc::Receiver<ImportedKv>> {
        self.rx.lock().ok()?.take()
    }
}

impl std::fmt::Debug for KvImport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvImport").finish_non_exhaustive()
    }
}

/// Bytes of a prompt's KV as they arrived. The engine only reads them; whoever delivered
/// them decides what dropping them does (the KV transfer layer returns its reassembly
/// buffer to a pool), so the engine API does not depend on any transport's buffer type.
pub type KvBytes = Box<dyn AsRef<[u8]> + Send>;

pub struct ImportedKv {
    /// A `model::kv_transfer` buffer holding exactly the prompt's tokens.
    pub payload: KvBytes,
    pub first_token: u32,
    pub first_logprob: Option<TokenLogprob>,
}

// Manual: a derived Debug would print megabytes of KV into any log of a request.
impl std::fmt::Debug for ImportedKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedKv")
            .field("payload_bytes", &(*self.payload).as_ref().len())
            .field("first_token", &self.first_token)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop string.
    Stop,
    /// max_tokens or the context length reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
}

/// Why a generation failed; `label()` is the metrics reason label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailReason {
    QueueFull,
    QueueTimeout,
    /// Can never fit in the KV cache or the context.
    TooLarge,
    InvalidRequest,
    StepFailed,
    EngineStopped,
    /// PD: the KV transfer (room) failed; the message carries the protocol reason.
    KvTransfer,
}

impl FailReason {
    pub fn label(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::QueueTimeout => "queue_timeout",
            Self::TooLarge => "too_large",
            Self::InvalidRequest => "invalid_request",
            Self::StepFailed => "step_failed",
            Self::EngineStopped => "engine_stopped",
            Self::KvTransfer => "kv_transfer",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// One sampled token; `text` is what became safe to show (may be empty while UTF-8
    /// bytes or a possible stop string are held back).
    Token {
        id: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// Final event of a successful generation; `text` is the held-back remainder.
    Done {
        reason: FinishReason,
        text: String,
        usage: Usage,
    },
    Failed {
        reason: FailReason,
        message: String,
    },
    /// `Transfer::Export` only: the sequence's KV (from the `Export`'s `from`), sent just
    /// before `Done`.
    KvExported(Vec<u8>),
    /// `Transfer::Import` only: the sequence's KV blocks are reserved; the KV may come.
    /// The first `cached` prompt tokens are in the prefix cache already: only the KV of
    /// the rest is needed.
    KvReserved {
        cached: usize,
    },
    /// `Transfer::Export` only: a chunk of the prompt was prefilled (`prefilled` of
    /// `total` tokens); the KV transfer layer turns this into keep-alives for the peer.
    Progress {
        prefilled: usize,
        total: usize,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    #[error("server overloaded: the request queue is full")]
    QueueFull,
    #[error("the engine thread is not running")]
    EngineStopped,
}

/// Liveness and progress of the engine thread, read by `/ready`. Times are milliseconds
/// since `start` plus one (0: never), written by the engine thread with relaxed stores.
#[derive(Debug)]
pub struct EngineHealth {
    start: Instant,
    last_beat_ms: AtomicU64,
    stopped: AtomicBool,
    /// When the current spell of queued or running work began (0: idle).
    work_since: AtomicU64,
    last_step_ok: AtomicU64,
    /// First failed step since the last success (0: none), the last one, and how many.
    failing_since: AtomicU64,
    last_step_failed: AtomicU64,
    failed_steps: AtomicU64,
    /// Fault injection (`POST /debug/fault?loop=engine`): until when the engine holds its
    /// work without stepping, and until when every step fails (0: unarmed).
    hold_until: AtomicU64,
    fail_until: AtomicU64,
}

/// The engine's progress as [`crate::progress::judge`] reads it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineProgress {
    pub now: Duration,
    pub work: bool,
    pub work_since: Option<Duration>,
    pub last_step_ok: Option<Duration>,
    pub failing_since: Option<Duration>,
    pub last_step_failed: Option<Duration>,
    pub failed_steps: u64,
}

/// How long work must have gone without a step for its departure to leave the stall
/// counting ([`EngineHealth::note_work`]): far above any step of a working engine.
pub const ABANDONED_STALL: Duration = Duration::from_secs(1);

impl EngineProgress {
    /// How long the engine has had work without a successful step: from the later of
    /// the work's start and the last success (zero while idle). What a router reads to
    /// stop sending to an engine that is alive but stuck (`engineStalledMs`).
    pub fn stalled_for(&self) -> Duration {
        let since = match (self.work_since, self.last_step_ok) {
            (Some(w), Some(ok)) => w.max(ok),
            (Some(w), None) => w,
            (None, _) => return Duration::ZERO,
        };
        self.now.saturating_sub(since)
    }
}

/// A fault the engine can be told to play (tests only; see `pd::supervise`'s opt-in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineFault {
    /// Keep the work, go round, step nothing (a wedged backend).
    Hold(Duration),
    /// Every step fails (a backend that errors).
    FailSteps(Duration),
}

impl EngineHealth {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            last_beat_ms: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
            work_since: AtomicU64::new(0),
            last_step_ok: AtomicU64::new(0),
            failing_since: AtomicU64::new(0),
            last_step_failed: AtomicU64::new(0),
            failed_steps: AtomicU64::new(0),
            hold_until: AtomicU64::new(0),
            fail_until: AtomicU64::new(0),
        }
    }
    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }
    fn beat(&self) {
        self.last_beat_ms.store(self.now_ms(), Ordering::Relaxed);
    }
    /// Time since the engine loop last went round.
    pub fn heartbeat_age(&self) -> Duration {
        let now = self.now_ms();
        Duration::from_millis(now.saturating_sub(self.last_beat_ms.load(Ordering::Relaxed)))
    }
    pub fn stopped(&self) -> bool {
        self.stopped.load(Ordering::Relaxed)
    }
    /// Once per loop round: whether requests are queued or running. A store only when the
    /// state changes.
    ///
    /// Work that leaves after [`ABANDONED_STALL`] without a successful step — its clients
    /// gave up on the engine, or a router took the requests back to send them elsewhere —
    /// leaves the spell open: the engine has not shown it can step, so the stall goes on
    /// counting (`/ready`'s `no_progress`, the report's `engineStalledMs`) until a step
    /// succeeds. Otherwise a wedged engine whose waiting requests are always withdrawn in
    /// time would look idle, and ready, for ever. Work that leaves sooner (a client that
    /// cancels at once) closes the spell as before.
    pub(crate) fn note_work(&self, work: bool) {
        let since = self.work_since.load(Ordering::Relaxed);
        if work && since == 0 {
            self.work_since.store(self.now_ms() + 1, Ordering::Relaxed);
        } else if !work && since != 0 {
            let last_ok = self.last_step_ok.load(Ordering::Relaxed);
            let stalled_ms = (self.now_ms() + 1).saturating_sub(since.max(last_ok));
            let stepped = last_ok >= since;
            if stepped || stalled_ms < ABANDONED_STALL.as_millis() as u64 {
                self.work_since.store(0, Ordering::Relaxed);
            }
        }
    }
    /// A step succeeded: one relaxed store, two more only after a failure streak.
    pub(crate) fn note_step_ok(&self) {
        self.last_step_ok
            .store(self.now_ms() + 1, Ordering::Relaxed);
        if self.failed_steps.load(Ordering::Relaxed) != 0 {
            self.failed_steps.store(0, Ordering::Relaxed);
            self.failing_since.store(0, Ordering::Relaxed);
        }
    }
    pub(crate) fn note_step_failed(&self) {
        let now = self.now_ms() + 1;
        if self.failed_steps.fetch_add(1, Ordering::Relaxed) == 0 {
            self.failing_since.store(now, Ordering::Relaxed);
        }
        self.last_step_failed.store(now, Ordering::Relaxed);
    }
    /// The progress record, for `/ready`.
    pub fn progress(&self) -> EngineProgress {
        let t = |a: &AtomicU64| match a.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms - 1)),
        };
        let work_since = t(&self.work_since);
        EngineProgress {
            now: Duration::from_millis(self.now_ms()),
            work: work_since.is_some(),
            work_since,
            last_step_ok: t(&self.last_step_ok),
            failing_since: t(&self.failing_since),
            last_step_failed: t(&self.last_step_failed),
            failed_steps: self.failed_steps.load(Ordering::Relaxed),
        }
    }
    /// Arm an engine fault (tests, and `POST /debug/fault?loop=engine` when fault
    /// injection is on).
    pub fn inject(&self, f: EngineFault) {
        let (slot, d) = match f {
            EngineFault::Hold(d) => (&self.hold_until, d),
            EngineFault::FailSteps(d) => (&self.fail_until, d),
        };
        // A fault of 0 ms disarms at once (an `until` of now + 1 would still play within
        // the current millisecond: a request sent right after the disarm failed).
        let until = if d.is_zero() {
            0
        } else {
            self.now_ms() + d.as_millis() as u64 + 1
        };
        slot.store(until, Ordering::Relaxed);
    }
    /// Whether an armed fault of this kind is playing now (one relaxed load when unarmed).
    fn playing(&self, slot: &AtomicU64) -> bool {
        match slot.load(Ordering::Relaxed) {
            0 => false,
            until if self.now_ms() < until => true,
            _ => {
                slot.store(0, Ordering::Relaxed);
                false
            }
        }
    }
    pub(crate) fn holding(&self) -> bool {
        self.playing(&self.hold_until)
    }
    pub(crate) fn failing_injected(&self) -> bool {
        self.playing(&self.fail_until)
    }
}

pub(crate) struct Submission {
    req: GenerateRequest,
    out: tmpsc::Sender<GenEvent>,
    arrived: Instant,
}

#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::SyncSender<Submission>,
    health: Arc<EngineHealth>,
    metrics: Arc<Metrics>,
}

impl EngineHandle {
    /// Queue a request. Never blocks: a full channel is reported as overload.
    pub fn submit(&self, req: GenerateRequest) -> Result<tmpsc::Receiver<GenEvent>, SubmitError> {
        // Room for every token event plus the final one (and, for an export, one progress
        // event per prompt chunk: at most one per prompt token), so the engine's sends never
        // fail for lack of space however slowly the receiver reads.
        let progress = match req.transfer {
            Transfer::Export { .. } => req.prompt.len(),
            _ => 0,
        };
        let (out, rx) = tmpsc::channel(req.max_tokens + 3 + progress);
        let sub = Submission {
            req,
            out,
            arrived: Instant::now(),
        };
        let err = match self.tx.try_send(sub) {
            Ok(()) => return Ok(rx),
            Err(mpsc::TrySendError::Full(_)) => SubmitError::QueueFull,
            Err(mpsc::TrySendError::Disconnected(_)) => SubmitError::EngineStopped,
        };
        let reason = match err {
            SubmitError::QueueFull => FailReason::QueueFull,
            SubmitError::EngineStopped => FailReason::EngineStopped,
        };
        tracing::warn!(reason = reason.label(), "request refused: {err}");
        self.metrics.fail(reason.label());
        Err(err)
    }

    pub fn health(&self) -> &Arc<EngineHealth> {
        &self.health
    }
}

/// Start the engine thread. It exits once every handle is dropped and no work is left.
pub fn spawn<R: ModelRunner + 'static>(
    runner: R,
    text: Arc<dyn TokenText>,
    cfg: SchedulerConfig,
    metrics: Arc<Metrics>,
) -> std::io::Result<(EngineHandle, JoinHandle<()>)> {
    let (tx, rx) = mpsc::sync_channel(cfg.max_waiting.max(1));
    let health = Arc::new(EngineHealth::new());
    health.beat();
    let h = health.clone();
    let m = metrics.clone();
    let join = std::thread::Builder::new()
        .name("tandem-engine".into())
        .spawn(move || {
            engine::Engine::new(runner, text, cfg, m, rx, h.clone()).run();
            h.stopped.store(true, Ordering::Relaxed);
        })?;
    Ok((
        EngineHandle {
            tx,
            health,
            metrics,
        },
        join,
    ))
}
