//! The PD side of a process as the server holds it (`PdSlot`): the current KV channel
//! (`PdRun`: the role's handle, its group incarnation and process incarnation), which an
//! in-place reset (docs/in-place-reset.md) replaces without the process exiting. What a
//! channel is started with (`PdStarter`) is kept, so a reset starts the same role on the
//! same ports with the same engine, metrics and key, only at the new group incarnation and
//! with a fresh random process incarnation. The weights, engine thread, tokenizer, HTTP
//! server and prefix cache are outside it and stay.
//!
//! Everything that uses the channel reads the current run (`current`); a request holds
//! the run it began on, and ends with `reset` when that run is reset away (`ended`).
//! Resets are serialized; drain and stop (SIGTERM) reach whichever run is current, also
//! one installed by a reset that was under way when they came.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tandem_contract::MemberRole;

use super::report::loop_stale_after;
use super::reset::{Decision, decide};
use super::{ChannelConfig, Check, PdLimits, PdRole, PdTimings, decode, prefill};
use super::{PeerReport, local_identity, random_id};
use crate::engine_api::ModelInfo;
use crate::kv::auth::GroupKey;
use crate::metrics::Metrics;
use crate::scheduler::EngineHandle;

/// How long a reset waits for the old channel's loops to end (their last FAILED and
/// GOODBYE go out, the sockets close) before it starts the new one anyway.
const STOP_WITHIN: Duration = Duration::from_secs(2);
/// The same when every loop of the old channel has missed its heartbeat already (stuck in
/// a call, the fault a reset is often for): it will not say goodbye in time, and waiting
/// the full bound only delays the new channel. Long enough for a loop that is just waking.
const STUCK_STOP_WITHIN: Duration = Duration::from_millis(100);

/// What a KV channel of this process is started with; all but the group incarnation and
/// the process incarnation are the same for every start.
pub struct PdStarter {
    pub role: MemberRole,
    /// Prefill: the address and port its ROUTER binds.
    pub host: String,
    pub kv_port: u16,
    /// Decode: its prefills' `host:port`.
    pub prefill_peers: Vec<String>,
    pub info: ModelInfo,
    pub kv_dtype: u32,
    pub key: GroupKey,
    pub timings: PdTimings,
    pub limits: PdLimits,
    pub engine: EngineHandle,
    pub metrics: Arc<Metrics>,
}

impl PdStarter {
    /// Start the channel at `group_incarnation` with a new random process incarnation: a
    /// peer that sees it change knows this is another process (as far as the protocol
    /// goes) and forgets everything about the old one.
    pub fn start(&self, group_incarnation: u64) -> crate::Result<PdRun> {
        let incarnation = random_id();
        let local = local_identity(&self.info, self.kv_dtype, incarnation, group_incarnation);
        tracing::info!(
            role = self.role.as_str(),
            incarnation = format!("{incarnation:016x}"),
            group_incarnation,
            "process incarnation"
        );
        let channel = ChannelConfig {
            local,
            key: self.key.clone(),
            timings: self.timings,
            limits: self.limits,
        };
        let role = match self.role {
            MemberRole::Prefill => PdRole::Prefill(prefill::start(
                &self.host,
                self.kv_port,
                channel,
                self.engine.clone(),
                self.metrics.clone(),
            )?),
            MemberRole::Decode => PdRole::Decode(decode::start(
                &self.prefill_peers,
                channel,
                &self.info,
                self.metrics.clone(),
            )?),
        };
        Ok(PdRun {
            role,
            group_incarnation,
            incarnation,
            ended: tokio::sync::watch::channel(false).0,
        })
    }
}

/// One start of the KV channel.
pub struct PdRun {
    pub role: PdRole,
    pub group_incarnation: u64,
    /// The process incarnation in its handshakes and messages.
    pub incarnation: u64,
    /// Turns true when a reset replaced this run (after its loops stopped).
    ended: tokio::sync::watch::Sender<bool>,
}

impl PdRun {
    /// Resolves once a reset has replaced this run (never while it is current).
    pub async fn reset_away(&self) {
        let mut rx = self.ended.subscribe();
        // The guard `wait_for` returns is not Send: drop it inside the future.
        drop(rx.wait_for(|ended| *ended).await);
    }

    pub fn is_reset_away(&self) -> bool {
        *self.ended.borrow()
    }
}

/// What a reset call did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResetDone {
    /// Whether this call reset (false: the member was at the incarnation already).
    pub reset: bool,
    pub old_group_incarnation: u64,
    pub group_incarnation: u64,
    pub old_incarnation: u64,
    pub incarnation: u64,
    /// Rooms the stop of the old channel ended (with `reset`, pushed to the peers).
    pub rooms_ended: usize,
}

/// Why a reset call did not reset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResetError {
    /// Older than the member's group incarnation.
    Stale { current: u64, incarnation: u64 },
    /// The process is shutting down.
    Draining,
    /// The old channel stopped but the new one did not start (e.g. the KV port stayed
    /// taken); `/ready` fails `reset_failed` until a reset succeeds.
    Failed(String),
}

/// The current KV channel, replaceable by a reset (see the module header).
pub struct PdSlot {
    starter: PdStarter,
    current: RwLock<Arc<PdRun>>,
    /// Held for the whole of a reset: resets never overlap, and a repeated call waits for
    /// the one under way, then finds nothing to do.
    resetting: Mutex<()>,
    /// Set under `current`'s write lock, so a run installed by a reset is drained or
    /// stopped too.
    draining: AtomicBool,
    stopped: AtomicBool,
    /// The last reset that failed to start the channel, until one succeeds.
    failed: Mutex<Option<String>>,
}

impl PdSlot {
    /// Start the channel at `group_incarnation` (the process's first start).
    pub fn start(starter: PdStarter, group_incarnation: u64) -> crate::Result<Self> {
        let run = starter.start(group_incarnation)?;
        Ok(Self {
            starter,
            current: RwLock::new(Arc::new(run)),
            resetting: Mutex::new(()),
            draining: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            failed: Mutex::new(None),
        })
    }

    pub fn role(&self) -> MemberRole {
        self.starter.role
    }

    pub fn key(&self) -> &GroupKey {
        &self.starter.key
    }

    /// The run everything should use now.
    pub fn current(&self) -> Arc<PdRun> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn group_incarnation(&self) -> u64 {
        self.current().group_incarnation
    }

    /// The current run's checks, and `reset` while the last reset failed.
    pub fn checks(&self) -> Vec<Check> {
        let mut checks = self.current().role.checks();
        if let Some(why) = self.failed.lock().ok().and_then(|f| f.clone()) {
            checks.push(Check::new("reset", false, "reset_failed", why));
        }
        checks
    }

    pub fn peers(&self) -> Vec<PeerReport> {
        self.current().role.peers()
    }

    /// SIGTERM: the current run takes no new work; so does any a reset installs later.
    pub fn drain(&self) {
        let run = {
            let cur = self.current.write().unwrap_or_else(|p| p.into_inner());
            self.draining.store(true, Ordering::SeqCst);
            cur.clone()
        };
        run.role.drain();
    }

    pub fn is_idle(&self) -> bool {
        self.current().role.is_idle()
    }

    /// Stop the current run (and any a reset under way would install) until `deadline`;
    /// the names of loops left running.
    pub fn stop(&self, deadline: Instant) -> Vec<String> {
        let run = {
            let cur = self.current.write().unwrap_or_else(|p| p.into_inner());
            self.stopped.store(true, Ordering::SeqCst);
            cur.clone()
        };
        run.role.stop(deadline)
    }

    /// Reset to `to` (blocking: call it off the async runtime). See `reset::decide` for
    /// what it does given the current group incarnation; a reset stops the current run
    /// (its rooms end with `reset`, pushed to the peers; GOODBYE; sockets closed), ends the
    /// requests that began on it, and starts the channel again at `to` with a new process
    /// incarnation. It does not wait for the new channel to be ready.
    pub fn reset(&self, to: u64) -> Result<ResetDone, ResetError> {
        let _one = self.resetting.lock().unwrap_or_else(|p| p.into_inner());
        let start = Instant::now();
        let old = self.current();
        let draining = self.draining.load(Ordering::SeqCst) || self.stopped.load(Ordering::SeqCst);
        match decide(old.group_incarnation, to, draining) {
            Decision::Draining => return Err(ResetError::Draining),
            Decision::Stale => {
                return Err(ResetError::Stale {
                    current: old.group_incarnation,
                    incarnation: old.incarnation,
                });
            }
            Decision::Noop => {
                return Ok(ResetDone {
                    reset: false,
                    old_group_incarnation: old.group_incarnation,
                    group_incarnation: old.group_incarnation,
                    old_incarnation: old.incarnation,
                    incarnation: old.incarnation,
                    rooms_ended: 0,
                });
            }
            Decision::Reset => {}
        }
        let ended_before = old.role.rooms_ended();
        let stale_after = loop_stale_after(self.starter.timings.probe_period);
        let loops = old.role.loops();
        let stuck = !loops.is_empty() && loops.iter().all(|h| h.age() > stale_after);
        let within = if stuck {
            STUCK_STOP_WITHIN
        } else {
            STOP_WITHIN
        };
        let left = old.role.stop_for_reset(start + within);
        if !left.is_empty() {
            tracing::warn!(
                loops = ?left,
                stuck,
                "in-place reset: KV loops still running after {within:?}; abandoned"
            );
        }
        let rooms_ended = old.role.rooms_ended() - ended_before;
        // Requests still on the old run (generating on a decode) end with `reset` now.
        old.ended.send_replace(true);
        let new = match self.starter.start(to) {
            Ok(run) => run,
            Err(e) => {
                let why = format!(
                    "the reset from group incarnation {} to {to} stopped the KV channel but \
                     could not start it again: {e}",
                    old.group_incarnation
                );
                tracing::error!(
                    old_group_incarnation = old.group_incarnation,
                    group_incarnation = to,
                    error = %e,
                    "in-place reset failed"
                );
                if let Ok(mut f) = self.failed.lock() {
                    *f = Some(why.clone());
                }
                return Err(ResetError::Failed(why));
            }
        };
        let done = ResetDone {
            reset: true,
            old_group_incarnation: old.group_incarnation,
            group_incarnation: to,
            old_incarnation: old.incarnation,
            incarnation: new.incarnation,
            rooms_ended,
        };
        self.install(new)?;
        if let Ok(mut f) = self.failed.lock() {
            *f = None;
        }
        tracing::info!(
            role = self.starter.role.as_str(),
            old_group_incarnation = done.old_group_incarnation,
            group_incarnation = done.group_incarnation,
            old_incarnation = format!("{:016x}", done.old_incarnation),
            incarnation = format!("{:016x}", done.incarnation),
            rooms_ended,
            took_ms = start.elapsed().as_millis() as u64,
            "in-place reset"
        );
        Ok(done)
    }

    /// Make `new` current, unless a stop came meanwhile (then it is stopped at once); a
    /// drain that came meanwhile drains it.
    fn install(&self, new: PdRun) -> Result<(), ResetError> {
        let new = Arc::new(new);
        {
            let mut cur = self.current.write().unwrap_or_else(|p| p.into_inner());
            if !self.stopped.load(Ordering::SeqCst) {
                *cur = new.clone();
                drop(cur);
                if self.draining.load(Ordering::SeqCst) {
                    new.role.drain();
                }
                return Ok(());
            }
        }
        let _ = new.role.stop(Instant::now() + STOP_WITHIN);
        Err(ResetError::Draining)
    }
}
