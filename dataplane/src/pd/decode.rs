//! Decode role: one DEALER socket and one supervised loop (`peer_loop`) per configured
//! prefill. HTTP tasks talk to the loops through `DecodeClient`: pick the least-loaded
//! healthy prefill, open a room, await its KV. `/ready` reads what the loops publish.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

use tokio::sync::mpsc as tmpsc;

use super::wire;
use super::{Check, LoopHealth, loop_stale_after, random_id, supervise};
use crate::config::PdTimings;
use crate::engine_api::ModelInfo;
use crate::kv::auth::{GroupKey, LocalIdentity};
use crate::kv::room::{Deadlines, RoomTable};
use crate::kv::{FailCode, PrefillRequest};
use crate::metrics::Metrics;
use crate::sampling::SamplingParams;
use crate::scheduler::ImportedKv;

/// A room that ended without KV; `code` is the protocol reason.
#[derive(Debug, Clone, PartialEq)]
pub struct RoomFailure {
    pub code: FailCode,
    pub message: String,
}

pub(super) enum Command {
    Open {
        room: u64,
        req: PrefillRequest,
        reply: tmpsc::Sender<Result<(), RoomFailure>>,
        kv: tmpsc::Sender<ImportedKv>,
    },
}

/// What `/ready` and the router read about one peer (written by its loop only).
pub(super) struct PeerShared {
    pub(super) base: Instant,
    pub(super) established: AtomicBool,
    pub(super) peer_incarnation: AtomicU64,
    /// ms since `base` of the last PONG (or handshake completion).
    pub(super) last_pong_ms: AtomicU64,
    pub(super) in_flight: AtomicUsize,
}

impl PeerShared {
    fn pong_age(&self) -> Duration {
        let now = self.base.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last_pong_ms.load(Ordering::Relaxed)))
    }
    pub(super) fn mark_pong(&self) {
        self.last_pong_ms
            .store(self.base.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

struct Peer {
    addr: String,
    tx: SyncSender<Command>,
    shared: Arc<PeerShared>,
    health: Arc<LoopHealth>,
}

pub struct DecodeClient {
    peers: Vec<Peer>,
    rotate: AtomicUsize,
    timings: PdTimings,
    stale_after: Duration,
}

/// Start one loop per prefill address (`host:port`).
pub fn start(
    addrs: &[String],
    local: LocalIdentity,
    key: GroupKey,
    timings: PdTimings,
    info: &ModelInfo,
    metrics: Arc<Metrics>,
) -> crate::Result<DecodeClient> {
    if addrs.is_empty() {
        return Err(crate::Error::config(
            "--prefill",
            "role decode needs at least one --prefill address",
        ));
    }
    // Upper bound of one token's KV bytes (4-byte values at most), to refuse oversized KV.
    let per_token = (info.n_layers * 2 * info.n_kv_heads * info.head_dim * 4) as u64;
    let ctx = zmq::Context::new();
    let pool = crate::kv::chunks::BufferPool::default();
    let mut peers = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        let io = |source| crate::Error::Transport {
            endpoint: format!("tcp://{addr}"),
            source,
        };
        let sock = ctx.socket(zmq::DEALER).map_err(io)?;
        wire::configure(&sock).map_err(io)?;
        // Queue only on live connections: a send to a down prefill fails fast.
        sock.set_immediate(true).map_err(io)?;
        sock.set_reconnect_ivl(100).map_err(io)?;
        sock.set_reconnect_ivl_max(1000).map_err(io)?;
        sock.connect(&format!("tcp://{addr}")).map_err(io)?;
        let (tx, rx) = sync_channel(1024);
        let shared = Arc::new(PeerShared {
            base: Instant::now(),
            established: AtomicBool::new(false),
            peer_incarnation: AtomicU64::new(0),
            last_pong_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
        });
        let health = LoopHealth::new(format!("kv_peer_{i}"));
        health.beat();
        let body = super::peer_loop::PeerLoop {
            _ctx: ctx.clone(),
            sock,
            addr: addr.clone(),
            local: local.clone(),
            key: key.clone(),
            timings,
            per_token,
            metrics: metrics.clone(),
            health: health.clone(),
            shared: shared.clone(),
            rx,
            session: super::peer_loop::Session::Idle {
                retry_at: Instant::now(),
            },
            rooms: RoomTable::new(
                Deadlines::new(timings.bootstrap_timeout, timings.kv_timeout),
                65_536,
            ),
            last_ping: None,
            pool: pool.clone(),
        };
        supervise(body, health.clone(), metrics.clone()).map_err(|source| {
            crate::Error::Thread {
                name: "KV loop".into(),
                source,
            }
        })?;
        peers.push(Peer {
            addr: addr.clone(),
            tx,
            shared,
            health,
        });
    }
    Ok(DecodeClient {
        peers,
        rotate: AtomicUsize::new(0),
        timings,
        stale_after: loop_stale_after(timings.probe_period),
    })
}

impl DecodeClient {
    #[cfg(test)]
    pub(super) fn loop_health(&self, i: usize) -> Arc<LoopHealth> {
        self.peers[i].health.clone()
    }

    fn peer_ok(&self, p: &Peer) -> bool {
        p.shared.established.load(Ordering::Relaxed)
            && p.shared.pong_age() <= self.timings.liveness_window()
            && p.health.age() <= self.stale_after
    }

    pub fn checks(&self) -> Vec<Check> {
        let mut out = Vec::new();
        for p in &self.peers {
            let est = p.shared.established.load(Ordering::Relaxed);
            let inc = p.shared.peer_incarnation.load(Ordering::Relaxed);
            out.push(Check {
                name: format!("handshake {}", p.addr),
                ok: est,
                detail: if est {
                    format!("authenticated with prefill incarnation {inc:016x}")
                } else {
                    "no authenticated session (handshaking)".into()
                },
            });
            let age = p.shared.pong_age();
            let window = self.timings.liveness_window();
            out.push(Check {
                name: format!("probe {}", p.addr),
                ok: est && age <= window,
                detail: format!(
                    "last PONG {} ms ago (limit {} ms = failure threshold x probe period)",
                    age.as_millis(),
                    window.as_millis()
                ),
            });
            let h = p.health.age();
            out.push(Check {
                name: format!("loop_{}", p.health.name),
                ok: h <= self.stale_after,
                detail: format!(
                    "heartbeat {} ms ago (limit {} ms), {} restarts",
                    h.as_millis(),
                    self.stale_after.as_millis(),
                    p.health.restarts()
                ),
            });
        }
        out
    }

    /// Run `prompt` on the least-loaded healthy prefill and wait until its KV went to
    /// `kv` (the engine's reserved sequence). Dropping the returned future (client gone)
    /// aborts the room on both sides; the room holds `kv` until it has ended.
    pub async fn prefill(
        &self,
        prompt: &[u32],
        sampling: &SamplingParams,
        kv: tmpsc::Sender<ImportedKv>,
    ) -> Result<(), RoomFailure> {
        // Least loaded healthy peer; ties rotate so idle peers share the work.
        let start = self.rotate.fetch_add(1, Ordering::Relaxed);
        let n = self.peers.len();
        let peer = (0..n)
            .map(|i| &self.peers[(start + i) % n])
            .filter(|p| self.peer_ok(p))
            .min_by_key(|p| p.shared.in_flight.load(Ordering::Relaxed))
            .ok_or_else(|| RoomFailure {
                code: FailCode::NoPeer,
                message: "no prefill with a healthy KV channel".into(),
            })?;
        let (reply, mut rx) = tmpsc::channel(1);
        let req = PrefillRequest {
            tokens: prompt.to_vec(),
            temperature: sampling.temperature,
            top_k: sampling.top_k.min(u32::MAX as usize) as u32,
            top_p: sampling.top_p,
            seed: sampling.seed,
            logprobs: sampling.logprobs.map(|n| n as u32),
        };
        let cmd = Command::Open {
            room: random_id(),
            req,
            reply,
            kv,
        };
        match peer.tx.try_send(cmd) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                return Err(RoomFailure {
                    code: FailCode::Overloaded,
                    message: "too many rooms opening".into(),
                });
            }
            Err(TrySendError::Disconnected(_)) => {
                return Err(RoomFailure {
                    code: FailCode::LoopPanic,
                    message: "KV loop is gone".into(),
                });
            }
        }
        rx.recv().await.unwrap_or_else(|| {
            Err(RoomFailure {
                code: FailCode::LoopPanic,
                message: "KV loop dropped the room".into(),
            })
        })
    }
}
