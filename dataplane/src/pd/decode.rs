//! Decode role: one DEALER socket and one supervised loop (`dealer_loop`) per configured
//! prefill. HTTP tasks talk to the loops through `DecodeHandle`: pick the least-loaded
//! healthy prefill, open a room, await its KV. `/ready` reads what the loops publish.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

use tokio::sync::mpsc as tmpsc;

use super::dealer_loop::{
    Command, DealerConfig, DealerLoop, PeerShared, RoomFailure, STATE_ESTABLISHED,
    STATE_HANDSHAKING, STATE_UNRESPONSIVE,
};
use super::report::{Check, PeerReport, loop_check, loop_stale_after};
use super::settings::PdTimings;
use super::settings::{ChannelConfig, random_id};
use super::supervise::{Lifecycle, LoopHealth, LoopThreads, supervise};
use super::wire;
use crate::engine_api::ModelInfo;
use crate::kv::decode_session::DecodeConfig;
use crate::kv::{FailCode, PrefillRequest};
use crate::metrics::Metrics;
use crate::sampling::SamplingParams;
use crate::scheduler::ImportedKv;

struct Peer {
    addr: String,
    tx: SyncSender<Command>,
    shared: Arc<PeerShared>,
    health: Arc<LoopHealth>,
}

pub struct DecodeHandle {
    peers: Vec<Peer>,
    rotate: AtomicUsize,
    timings: PdTimings,
    stale_after: Duration,
    lifecycle: Arc<Lifecycle>,
    threads: LoopThreads,
}

/// Start one loop per prefill address (`host:port`).
pub fn start(
    addrs: &[String],
    channel: ChannelConfig,
    info: &ModelInfo,
    metrics: Arc<Metrics>,
) -> crate::Result<DecodeHandle> {
    let ChannelConfig {
        local,
        key,
        timings,
        limits,
    } = channel;
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
    let lifecycle = Arc::new(Lifecycle::default());
    let threads = LoopThreads::default();
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
        // Before connecting, so that no closed connection goes unreported.
        let monitor =
            wire::disconnect_monitor(&ctx, &sock, &format!("decode-peer-{i}")).map_err(io)?;
        sock.connect(&format!("tcp://{addr}")).map_err(io)?;
        let (tx, rx) = sync_channel(1024);
        let shared = Arc::new(PeerShared::new());
        let health = LoopHealth::new(format!("kv_peer_{i}"));
        health.beat();
        let config = DealerConfig {
            ctx: ctx.clone(),
            sock,
            monitor,
            session: DecodeConfig {
                addr: addr.clone(),
                local: local.clone(),
                key: key.clone(),
                timings,
                per_token,
                send_budget: limits.send_budget,
                pool: pool.clone(),
                seed: None,
            },
            metrics: metrics.clone(),
            lifecycle: lifecycle.clone(),
        };
        let body = DealerLoop::new(config, health.clone(), shared.clone(), rx);
        let thread = supervise(body, health.clone(), metrics.clone()).map_err(|source| {
            crate::Error::Thread {
                name: "KV loop".into(),
                source,
            }
        })?;
        threads.push(health.name.clone(), thread);
        peers.push(Peer {
            addr: addr.clone(),
            tx,
            shared,
            health,
        });
    }
    Ok(DecodeHandle {
        peers,
        rotate: AtomicUsize::new(0),
        timings,
        stale_after: loop_stale_after(timings.probe_period),
        lifecycle,
        threads,
    })
}

/// The least-loaded of the usable peers (`None` = not usable, `Some(rooms)` = its rooms in
/// flight); ties go to the first one from `start` on, so idle peers take turns.
pub(super) fn least_loaded(loads: &[Option<usize>], start: usize) -> Option<usize> {
    let n = loads.len();
    (0..n)
        .map(|i| (start + i) % n)
        .filter_map(|i| loads[i].map(|load| (i, load)))
        .min_by_key(|&(_, load)| load)
        .map(|(i, _)| i)
}

impl DecodeHandle {
    #[cfg(test)]
    pub(super) fn loop_health(&self, i: usize) -> Arc<LoopHealth> {
        self.peers[i].health.clone()
    }

    pub fn loops(&self) -> Vec<Arc<LoopHealth>> {
        self.peers.iter().map(|p| p.health.clone()).collect()
    }

    fn peer_ok(&self, p: &Peer) -> bool {
        p.shared.established.load(Ordering::Relaxed)
            && !p.shared.peer_draining.load(Ordering::Relaxed)
            && p.shared.pong_age() <= self.timings.liveness_window()
            && p.health.age() <= self.stale_after
    }

    pub fn checks(&self) -> Vec<Check> {
        let mut out = Vec::new();
        for p in &self.peers {
            let est = p.shared.established.load(Ordering::Relaxed);
            let draining = p.shared.peer_draining.load(Ordering::Relaxed);
            let inc = p.shared.peer_incarnation.load(Ordering::Relaxed);
            let refusal = p.shared.last_refusal.get();
            let (reason, detail) = if est {
                (
                    "",
                    format!("authenticated with prefill incarnation {inc:016x}"),
                )
            } else if draining {
                (
                    "peer_shutdown",
                    "the prefill is shutting down (it said goodbye)".to_owned(),
                )
            } else if let Some(r) = &refusal {
                (
                    r.reason.as_str(),
                    format!("no authenticated session: {} ({})", r.message, r.reason),
                )
            } else {
                (
                    "handshaking",
                    "no authenticated session yet (handshaking)".to_owned(),
                )
            };
            out.push(Check::new(
                format!("handshake {}", p.addr),
                est,
                reason,
                detail,
            ));
            let age = p.shared.pong_age();
            let window = self.timings.liveness_window();
            out.push(Check::new(
                format!("probe {}", p.addr),
                est && age <= window,
                if est { "probe_timeout" } else { "no_session" },
                format!(
                    "last PONG {} ms ago (limit {} ms = failure threshold x probe period)",
                    age.as_millis(),
                    window.as_millis()
                ),
            ));
            out.push(loop_check(&p.health, self.stale_after));
        }
        out
    }

    pub fn peers(&self) -> Vec<PeerReport> {
        self.peers
            .iter()
            .map(|p| {
                let s = &p.shared;
                let state = match s.state.load(Ordering::Relaxed) {
                    _ if s.peer_draining.load(Ordering::Relaxed) => "peer_draining",
                    STATE_ESTABLISHED => "established",
                    STATE_UNRESPONSIVE => "unresponsive",
                    STATE_HANDSHAKING => "handshaking",
                    _ => "idle",
                };
                let est = s.established.load(Ordering::Relaxed);
                PeerReport {
                    address: p.addr.clone(),
                    state,
                    incarnation: Some(s.peer_incarnation.load(Ordering::Relaxed))
                        .filter(|&i| i != 0),
                    rooms: s.in_flight.load(Ordering::Relaxed),
                    last_contact_ms: est.then(|| s.pong_age().as_millis() as u64),
                    bytes_in_flight: None,
                    last_refusal: s.last_refusal.get(),
                    last_failure: s.last_failure.get(),
                }
            })
            .collect()
    }

    /// Why no prefill can take a room, peer by peer: the refusal or failure that ended each
    /// one's channel (`peer_unresponsive`, `peer_unreachable`, ...), so that a refused
    /// request says what the operator would look up in `/ready`.
    fn no_peer_message(&self) -> String {
        let why: Vec<String> = self
            .peers
            .iter()
            .map(|p| {
                let s = &p.shared;
                let reason = if s.peer_draining.load(Ordering::Relaxed) {
                    "peer_shutdown: the prefill is shutting down".to_owned()
                } else if s.established.load(Ordering::Relaxed) {
                    if p.health.age() > self.stale_after {
                        "loop_stalled: its KV loop is not going round".to_owned()
                    } else {
                        format!(
                            "probe_timeout: last PONG {} ms ago",
                            s.pong_age().as_millis()
                        )
                    }
                } else if let Some(r) = s.last_refusal.get() {
                    format!("{}: {}", r.reason, r.message)
                } else {
                    "handshaking: no session yet".to_owned()
                };
                format!("{} ({reason})", p.addr)
            })
            .collect();
        format!("no prefill with a healthy KV channel: {}", why.join("; "))
    }

    /// Nothing changes for a decode when draining starts: its rooms belong to HTTP requests
    /// in flight, which go on; no new ones arrive because the HTTP listener is closed.
    pub fn drain(&self) {
        self.lifecycle.drain();
    }

    pub fn stop(&self, deadline: Instant) -> Vec<String> {
        self.lifecycle.stop();
        self.threads.join_until(deadline)
    }

    /// As `stop`, for an in-place reset: the rooms end with `reset` (pushed to the
    /// prefills), and every room asked for after it fails with `reset` at once.
    pub fn stop_for_reset(&self, deadline: Instant) -> Vec<String> {
        self.lifecycle.stop_for_reset();
        self.stop(deadline)
    }

    /// Rooms the loops ended when they stopped.
    pub fn rooms_ended(&self) -> usize {
        self.lifecycle.rooms_ended_total()
    }

    /// Why a room cannot open (or was dropped) once the loops stop: `reset` for an in-place
    /// reset, so the request says what happened rather than that a loop is gone.
    fn stopped_failure(&self, otherwise: FailCode, message: &str) -> RoomFailure {
        if self.lifecycle.is_reset() {
            RoomFailure {
                code: FailCode::Reset,
                message: "the decode was reset in place to a new group incarnation while this \
                          request waited for its KV"
                    .into(),
            }
        } else {
            RoomFailure {
                code: otherwise,
                message: message.into(),
            }
        }
    }

    /// Run `prompt` on the least-loaded healthy prefill and wait until its KV went to
    /// `kv` (the engine's reserved sequence, which holds the first `cached` tokens from
    /// its prefix cache already: only the rest's KV is sent). Dropping the returned future
    /// (client gone) aborts the room on both sides; the room holds `kv` until it has ended.
    pub async fn prefill(
        &self,
        prompt: &[u32],
        cached: usize,
        sampling: &SamplingParams,
        kv: tmpsc::Sender<ImportedKv>,
    ) -> Result<(), RoomFailure> {
        if self.lifecycle.is_reset() {
            return Err(self.stopped_failure(FailCode::NoPeer, ""));
        }
        let start = self.rotate.fetch_add(1, Ordering::Relaxed);
        let loads: Vec<Option<usize>> = self
            .peers
            .iter()
            .map(|p| {
                self.peer_ok(p)
                    .then(|| p.shared.in_flight.load(Ordering::Relaxed))
            })
            .collect();
        let peer = least_loaded(&loads, start)
            .map(|i| &self.peers[i])
            .ok_or_else(|| RoomFailure {
                code: FailCode::NoPeer,
                message: self.no_peer_message(),
            })?;
        let (reply, mut rx) = tmpsc::channel(1);
        let req = PrefillRequest {
            tokens: prompt.to_vec(),
            sampling: sampling.clone(),
            cached_tokens: cached as u32,
        };
        let cmd = Command::Open {
            room: random_id(),
            req,
            reply,
            kv,
        };
        // Counted at once, so that requests arriving before the loop publishes see it.
        peer.shared.in_flight.fetch_add(1, Ordering::Relaxed);
        match peer.tx.try_send(cmd) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                return Err(RoomFailure {
                    code: FailCode::Overloaded,
                    message: "too many rooms opening".into(),
                });
            }
            Err(TrySendError::Disconnected(_)) => {
                return Err(self.stopped_failure(FailCode::LoopPanic, "KV loop is gone"));
            }
        }
        rx.recv().await.unwrap_or_else(|| {
            Err(self.stopped_failure(FailCode::LoopPanic, "KV loop dropped the room"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::least_loaded;

    #[test]
    fn least_loaded_prefers_the_idle_peer_whatever_the_rotation() {
        // A busy peer 0 and an idle peer 1: every rotation start picks 1 (round-robin
        // would pick 0 half the time).
        for start in 0..4 {
            assert_eq!(least_loaded(&[Some(3), Some(0)], start), Some(1));
            assert_eq!(least_loaded(&[Some(0), Some(2), Some(1)], start), Some(0));
        }
        // Ties rotate.
        assert_eq!(least_loaded(&[Some(1), Some(1)], 0), Some(0));
        assert_eq!(least_loaded(&[Some(1), Some(1)], 1), Some(1));
        // Unusable peers are never picked, however idle.
        assert_eq!(least_loaded(&[None, Some(5)], 0), Some(1));
        assert_eq!(least_loaded(&[None, None], 0), None);
        assert_eq!(least_loaded(&[], 0), None);
    }
}
