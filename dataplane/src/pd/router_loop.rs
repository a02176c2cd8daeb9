//! The prefill's loop (`RouterLoop`): I/O and timers around the pure
//! [`PrefillSession`](crate::kv::prefill_session). It owns the ROUTER socket and the
//! engine's channels: it reads the socket and the engine's events, turns them into session
//! events, carries out the session's effects (sends, engine submissions, KV streams),
//! counts and logs the session's notes, and publishes what `/ready` reads a few times a
//! second. Every decision (authentication, fencing, budgets, deadlines, drops) is the
//! session's.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::mpsc::error::TryRecvError;

use super::report::{PeerReport, Problem};
use super::settings::PdLimits;
use super::supervise::{Lifecycle, LoopHealth, Phase, Supervised};
use super::wire::{self, hex_id};
use crate::kv::auth::{GroupKey, LocalIdentity};
use crate::kv::prefill_session::{
    EngineUpdate, PrefillConfig, PrefillEffect, PrefillEvent, PrefillNote, PrefillSession, RoomEnd,
};
use crate::kv::{Envelope, FailCode, Message, PdTimings, chunks, decode};
use crate::metrics::Metrics;
use crate::scheduler::{EngineHandle, FailReason, GenEvent, GenerateRequest, Transfer};

#[cfg(test)]
pub(super) use crate::kv::prefill_session::MAX_SESSIONS;

/// Decode sessions listed in `/ready` (the most recently seen).
pub(super) const REPORTED_PEERS: usize = 32;
/// How often the loop publishes its report for `/ready`.
const REPORT_EVERY: Duration = Duration::from_millis(100);

/// What the loop publishes for `/ready` (a few times a second).
#[derive(Debug, Default)]
pub(super) struct RouterReport {
    /// The most recently seen decode sessions (at most `REPORTED_PEERS`).
    pub(super) peers: Vec<PeerReport>,
    /// The last handshake this prefill refused, or session it dropped, with the peer's
    /// routing id.
    pub(super) last_refusal: Option<(String, Problem)>,
}

/// What a `RouterLoop` is built from.
pub(super) struct RouterConfig {
    pub(super) ctx: zmq::Context,
    pub(super) sock: zmq::Socket,
    pub(super) local: LocalIdentity,
    pub(super) key: GroupKey,
    pub(super) timings: PdTimings,
    pub(super) limits: PdLimits,
    pub(super) engine: EngineHandle,
    pub(super) metrics: Arc<Metrics>,
    pub(super) lifecycle: Arc<Lifecycle>,
    pub(super) report: Arc<Mutex<RouterReport>>,
    pub(super) rooms_open: Arc<AtomicUsize>,
}

pub(super) struct RouterLoop {
    _ctx: zmq::Context,
    sock: zmq::Socket,
    incarnation: u64,
    group_incarnation: u64,
    session: PrefillSession,
    /// The engine's channel of each room in flight; dropping it tells the engine to drop
    /// the sequence and free its blocks.
    engine_rooms: HashMap<u64, tokio::sync::mpsc::Receiver<GenEvent>>,
    engine: EngineHandle,
    /// PROGRESS stops when the engine loop has not gone round for this long.
    engine_stall: Duration,
    metrics: Arc<Metrics>,
    health: Arc<LoopHealth>,
    lifecycle: Arc<Lifecycle>,
    report: Arc<Mutex<RouterReport>>,
    rooms_open: Arc<AtomicUsize>,
    draining: bool,
    stopped: bool,
    last_report: Instant,
}

impl RouterLoop {
    pub(super) fn new(c: RouterConfig, health: Arc<LoopHealth>) -> Self {
        let session = PrefillSession::new(PrefillConfig {
            local: c.local.clone(),
            key: c.key,
            timings: c.timings,
            send_budget: c.limits.send_budget,
            seed: None,
        });
        Self {
            _ctx: c.ctx,
            sock: c.sock,
            incarnation: c.local.incarnation,
            group_incarnation: c.local.group_incarnation,
            session,
            engine_rooms: HashMap::new(),
            engine: c.engine,
            engine_stall: c.limits.engine_stall,
            metrics: c.metrics,
            health,
            lifecycle: c.lifecycle,
            report: c.report,
            rooms_open: c.rooms_open,
            draining: false,
            stopped: false,
            last_report: Instant::now(),
        }
    }
}

impl Supervised for RouterLoop {
    fn run(&mut self) {
        loop {
            self.health.beat();
            match self.lifecycle.phase() {
                Phase::Stop => {
                    self.shutdown();
                    return;
                }
                Phase::Drain if !self.draining => {
                    self.draining = true;
                    self.event(PrefillEvent::Drain);
                }
                _ => {}
            }
            self.health.fault_point();
            wire::wait_readable(&self.sock);
            for _ in 0..wire::RECV_BATCH {
                let Some(frames) = wire::try_recv(&self.sock) else {
                    break;
                };
                self.frames(frames);
            }
            self.pump_engine();
            let engine = self.engine.health();
            let engine_live = !engine.stopped() && engine.heartbeat_age() <= self.engine_stall;
            self.event(PrefillEvent::Tick { engine_live });
            self.publish(Instant::now());
        }
    }

    fn after_panic(&mut self, message: &str) {
        self.event(PrefillEvent::Panicked {
            message: message.to_owned(),
        });
    }
}

impl RouterLoop {
    fn frames(&mut self, frames: Vec<zmq::Message>) {
        let Some((peer, rest)) = frames.split_first() else {
            return;
        };
        let peer: &[u8] = peer;
        let refs: Vec<&[u8]> = rest.iter().map(|m| &m[..]).collect();
        let effects = match decode(&refs) {
            Ok(env) => self
                .session
                .on(PrefillEvent::Received { peer, env }, Instant::now()),
            Err(e) => self.session.on(
                PrefillEvent::Undecodable { peer, error: &e },
                Instant::now(),
            ),
        };
        self.carry_out(effects);
    }

    /// The engine's news of every room in flight.
    fn pump_engine(&mut self) {
        let ids: Vec<u64> = self.engine_rooms.keys().copied().collect();
        for room in ids {
            while let Some(rx) = self.engine_rooms.get_mut(&room) {
                let update = match rx.try_recv() {
                    Ok(GenEvent::Token { id, logprob, .. }) => {
                        EngineUpdate::Token { token: id, logprob }
                    }
                    Ok(GenEvent::KvExported(p)) => EngineUpdate::Exported(p),
                    Ok(GenEvent::Progress { prefilled, .. }) => {
                        EngineUpdate::Progress { prefilled }
                    }
                    Ok(GenEvent::KvReserved { .. }) => continue,
                    Ok(GenEvent::Done { .. }) => EngineUpdate::Done,
                    Ok(GenEvent::Failed { reason, message }) => EngineUpdate::Failed {
                        code: fail_code(reason),
                        message,
                    },
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => EngineUpdate::Gone,
                };
                self.event(PrefillEvent::Engine { room, update });
            }
        }
    }

    fn event(&mut self, e: PrefillEvent<'_>) {
        let effects = self.session.on(e, Instant::now());
        self.carry_out(effects);
    }

    /// Carry out effects in order; what the engine and the KV stream answer goes back to
    /// the session at once, and its answer is carried out next.
    fn carry_out(&mut self, effects: Vec<PrefillEffect>) {
        let mut todo: VecDeque<PrefillEffect> = effects.into();
        while let Some(e) = todo.pop_front() {
            let back = match e {
                PrefillEffect::Send { peer, room, msg } => {
                    self.send(&peer, room, msg);
                    None
                }
                PrefillEffect::Submit { room, request } => {
                    let req = GenerateRequest {
                        prompt: request.prompt,
                        max_tokens: 1,
                        sampling: request.sampling,
                        stop: Vec::new(),
                        stop_token_ids: Vec::new(),
                        transfer: Transfer::Export {
                            from: request.export_from,
                        },
                    };
                    match self.engine.submit(req) {
                        Ok(rx) => {
                            self.engine_rooms.insert(room, rx);
                            None
                        }
                        Err(e) => Some(PrefillEvent::SubmitFailed {
                            room,
                            message: e.to_string(),
                        }),
                    }
                }
                PrefillEffect::StreamKv {
                    peer,
                    room,
                    payload,
                    done,
                } => Some(self.stream(&peer, room, &payload, done)),
                PrefillEffect::RoomEnded {
                    room,
                    peer,
                    peer_incarnation,
                    end,
                } => {
                    self.room_ended(room, &peer, peer_incarnation, end);
                    None
                }
                PrefillEffect::Note(n) => {
                    self.note(n);
                    None
                }
            };
            if let Some(ev) = back {
                todo.extend(self.session.on(ev, Instant::now()));
            }
        }
        self.rooms_open
            .store(self.session.rooms_open(), Ordering::Relaxed);
        self.metrics.kv.sessions.set(self.session.sessions() as i64);
    }

    fn send(&self, peer: &[u8], room: u64, msg: Message) -> bool {
        let env = Envelope {
            incarnation: self.incarnation,
            group_incarnation: self.group_incarnation,
            room,
            msg,
        };
        match wire::send(&self.sock, Some(peer), &env) {
            Ok(_) => true,
            Err(e) => {
                let label = wire::send_error_label(e);
                self.metrics.kv.send_failure(label);
                tracing::warn!(peer = %hex_id(peer), room, reason = label, "KV send failed");
                false
            }
        }
    }

    /// Send a room's KV chunks, then its DONE; what came of it, for the session.
    fn stream(
        &self,
        peer: &[u8],
        room: u64,
        payload: &[u8],
        done: Message,
    ) -> PrefillEvent<'static> {
        let mut sent = 0u64;
        for c in chunks::plan(payload) {
            match wire::send_chunk(
                &self.sock,
                Some(peer),
                self.incarnation,
                self.group_incarnation,
                room,
                &c,
            ) {
                Ok(n) => {
                    self.metrics.kv.bytes("sent", n);
                    sent += n as u64;
                }
                Err(e) => {
                    let label = wire::send_error_label(e);
                    self.metrics.kv.send_failure(label);
                    tracing::warn!(peer = %hex_id(peer), room, chunk = c.index, reason = label, "KV chunk send failed");
                    return PrefillEvent::Streamed {
                        room,
                        sent,
                        failed: Some((label, "KV chunk send failed")),
                    };
                }
            }
        }
        let failed = (!self.send(peer, room, done)).then_some(("send_failed", "DONE send failed"));
        PrefillEvent::Streamed { room, sent, failed }
    }

    fn room_ended(&mut self, room: u64, peer: &[u8], peer_incarnation: u64, end: RoomEnd) {
        // Dropping the receiver tells the engine to drop the sequence and free its blocks.
        self.engine_rooms.remove(&room);
        let (state, reason, text) = match &end {
            RoomEnd::Done => ("done", "none", ""),
            RoomEnd::Failed { code, text } => ("failed", code.label(), text.as_str()),
            RoomEnd::Aborted => ("aborted", "client_abort", "aborted by the decode"),
        };
        self.metrics.kv.room(state, reason);
        if end != RoomEnd::Done {
            tracing::warn!(room, peer = %hex_id(peer), peer_incarnation = %format!("{peer_incarnation:016x}"), state, reason, %text, "room ended");
        }
    }

    fn note(&self, n: PrefillNote) {
        let kv = &self.metrics.kv;
        match n {
            PrefillNote::Malformed { peer, kind, detail } => {
                kv.malformed(kind);
                tracing::warn!(peer = %hex_id(&peer), kind, error = %detail, "malformed KV message dropped");
            }
            PrefillNote::Dropped { kind, .. } => kv.malformed(kind),
            PrefillNote::Unexpected { peer, msg_type } => {
                kv.malformed("unexpected_type");
                tracing::warn!(peer = %hex_id(&peer), ?msg_type, "unexpected KV message dropped");
            }
            PrefillNote::DuplicateRoom { peer, room, kind } => {
                kv.malformed(kind);
                tracing::warn!(room, peer = %hex_id(&peer), kind, "PREFILL for an existing or finished room dropped");
            }
            PrefillNote::Refused {
                peer,
                reason,
                text,
                counted,
            } => {
                if counted {
                    kv.handshake(reason.label());
                }
                tracing::warn!(peer = %hex_id(&peer), reason = reason.label(), %text, "KV peer refused");
            }
            PrefillNote::RefusedByDecode { peer, reason, text } => {
                kv.handshake(reason.label());
                tracing::warn!(peer = %hex_id(&peer), reason = reason.label(), %text, "a decode refused this prefill");
            }
            PrefillNote::Authenticated { peer, incarnation } => {
                // Before the ACCEPTED goes out (the notes come first).
                kv.sessions.set(self.session.sessions() as i64);
                kv.handshake("ok");
                tracing::info!(peer = %hex_id(&peer), peer_incarnation = %format!("{incarnation:016x}"), "decode authenticated");
            }
            PrefillNote::SessionDropped {
                peer,
                incarnation,
                why,
                silent,
                rooms_failed,
                text,
            } => {
                if why == crate::kv::prefill_session::DropReason::PeerRestarted {
                    kv.peer_incarnation_changes.inc();
                }
                kv.session_dropped(why.label());
                kv.sessions.set(self.session.sessions() as i64);
                tracing::warn!(
                    peer = %hex_id(&peer),
                    peer_incarnation = %format!("{incarnation:016x}"),
                    reason = why.label(),
                    silent_ms = silent.as_millis() as u64,
                    rooms_failed,
                    %text,
                    "decode session dropped"
                );
            }
            PrefillNote::DecodeLeaving { peer, reason, text } => {
                tracing::info!(peer = %hex_id(&peer), reason = reason.label(), %text, "decode said goodbye");
            }
            PrefillNote::FailedByDecode {
                peer,
                room,
                reason,
                text,
            } => {
                tracing::warn!(room, peer = %hex_id(&peer), reason = reason.label(), %text, "decode failed the room");
            }
            PrefillNote::RoomOpened => {
                kv.rooms_opened.inc();
            }
            PrefillNote::RoomRefused {
                peer,
                room,
                peer_incarnation,
                code,
                text,
            } => {
                kv.room("failed", code.label());
                tracing::warn!(room, peer = %hex_id(&peer), peer_incarnation = %format!("{peer_incarnation:016x}"), reason = code.label(), %text, "room refused");
            }
            PrefillNote::OverBudget => kv.send_failure("byte_budget"),
            PrefillNote::Draining { decodes, rooms } => tracing::info!(
                decodes,
                rooms_in_flight = rooms,
                "draining: said goodbye to every decode; refusing new rooms"
            ),
            PrefillNote::Stopped { rooms_failed } => {
                self.lifecycle.rooms_ended(rooms_failed);
                let reason = if self.lifecycle.is_reset() {
                    "reset"
                } else {
                    "shutdown"
                };
                tracing::info!(rooms_failed, reason, "KV loop stopped")
            }
        }
    }

    /// Stop: the session fails every room left (pushed to its decode, which counts it as
    /// `peer_shutdown`, or `reset` for an in-place reset); the connections stay a moment so
    /// that the decodes read it; the socket closes with a bounded linger; returning from
    /// `run` drops the engine handle and the socket (the port is free once the loop's
    /// thread has ended).
    fn shutdown(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        self.draining = true;
        let stop = if self.lifecycle.is_reset() {
            PrefillEvent::Reset
        } else {
            PrefillEvent::Stop
        };
        self.event(stop);
        self.publish(Instant::now() + REPORT_EVERY);
        if self.session.sessions() > 0 {
            std::thread::sleep(wire::CLOSE_GRACE);
        }
        wire::set_close_linger(&self.sock);
    }

    fn publish(&mut self, now: Instant) {
        self.rooms_open
            .store(self.session.rooms_open(), Ordering::Relaxed);
        if now.duration_since(self.last_report) < REPORT_EVERY {
            return;
        }
        self.last_report = now;
        self.metrics
            .kv
            .bytes_in_flight
            .set(self.session.bytes_in_flight() as i64);
        let wall = |at: Instant| {
            let ago = Instant::now().saturating_duration_since(at);
            SystemTime::now()
                .checked_sub(ago)
                .unwrap_or(SystemTime::now())
        };
        let peers = self
            .session
            .report(REPORTED_PEERS, now)
            .into_iter()
            .map(|s| PeerReport {
                address: hex_id(&s.peer),
                state: "established",
                incarnation: Some(s.incarnation),
                rooms: s.rooms,
                last_contact_ms: Some(s.silent.as_millis() as u64),
                bytes_in_flight: Some(s.bytes_in_flight),
                last_refusal: None,
                last_failure: s.last_failure.map(|(reason, message, at)| Problem {
                    reason,
                    message,
                    at: wall(at),
                }),
            })
            .collect();
        let last_refusal =
            self.session
                .last_refusal()
                .as_ref()
                .map(|(peer, reason, message, at)| {
                    let p = Problem {
                        reason: reason.clone(),
                        message: message.clone(),
                        at: wall(*at),
                    };
                    (hex_id(peer), p)
                });
        if let Ok(mut r) = self.report.lock() {
            r.peers = peers;
            r.last_refusal = last_refusal;
        }
    }
}

/// The protocol's reason for an engine failure.
fn fail_code(reason: FailReason) -> FailCode {
    match reason {
        FailReason::QueueFull => FailCode::Overloaded,
        FailReason::QueueTimeout => FailCode::QueueTimeout,
        FailReason::TooLarge | FailReason::InvalidRequest => FailCode::TooLarge,
        _ => FailCode::EngineFailed,
    }
}
