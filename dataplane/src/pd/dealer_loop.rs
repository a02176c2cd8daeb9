//! The decode's loop for one prefill (`DealerLoop`): I/O and timers around the pure
//! [`DecodeSession`](crate::kv::decode_session). It owns the DEALER socket and its
//! disconnect monitor, reads them and the HTTP side's commands, turns what it reads into
//! session events, carries out the session's effects (sends, rooms' outcomes to their
//! requests), counts and logs the session's notes, and publishes the status `/ready` and
//! the room picker read. Every decision (handshake, fencing, deadlines, budgets) is the
//! session's. The types the decode's HTTP side shares with the loop (`Command`,
//! `PeerShared`, `RoomFailure`) live here with it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::mpsc as tmpsc;

use super::report::{Problem, ProblemSlot};
use super::supervise::{Lifecycle, LoopHealth, Phase, Supervised};
use super::wire;
use crate::kv::decode_session::{
    ChannelState, DecodeEffect, DecodeEvent, DecodeNote, DecodeSession, Refusal, RefusedBy, RoomEnd,
};
use crate::kv::{Envelope, FailCode, Message, PrefillRequest, decode_borrowed};
use crate::metrics::{Metrics, PeerLabels};
use crate::sampling::TokenLogprob;
use crate::scheduler::ImportedKv;

/// A room that ended without KV; `code` is the protocol reason.
#[derive(Debug, Clone, PartialEq)]
pub struct RoomFailure {
    pub code: FailCode,
    pub message: String,
}

/// What the decode's HTTP side asks of a peer's loop.
pub(super) enum Command {
    Open {
        room: u64,
        req: PrefillRequest,
        reply: tmpsc::Sender<Result<(), RoomFailure>>,
        kv: tmpsc::Sender<ImportedKv>,
    },
}

/// `PeerShared::state` values.
pub(super) const STATE_IDLE: u8 = 0;
pub(super) const STATE_HANDSHAKING: u8 = 1;
pub(super) const STATE_ESTABLISHED: u8 = 2;
/// The prefill stopped answering (the channel deadline passed); handshaking again.
pub(super) const STATE_UNRESPONSIVE: u8 = 3;

/// What `/ready` and the router read about one peer (written by its loop only).
pub(super) struct PeerShared {
    pub(super) base: Instant,
    pub(super) established: AtomicBool,
    /// One of the `STATE_*` values.
    pub(super) state: AtomicU8,
    /// The prefill said GOODBYE (it is shutting down): no new rooms go there.
    pub(super) peer_draining: AtomicBool,
    pub(super) peer_incarnation: AtomicU64,
    /// ms since `base` of the last PONG (or handshake completion).
    pub(super) last_pong_ms: AtomicU64,
    pub(super) in_flight: AtomicUsize,
    pub(super) last_refusal: ProblemSlot,
    pub(super) last_failure: ProblemSlot,
}

impl PeerShared {
    pub(super) fn new() -> Self {
        Self {
            base: Instant::now(),
            established: AtomicBool::new(false),
            state: AtomicU8::new(STATE_IDLE),
            peer_draining: AtomicBool::new(false),
            peer_incarnation: AtomicU64::new(0),
            last_pong_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            last_refusal: ProblemSlot::default(),
            last_failure: ProblemSlot::default(),
        }
    }

    pub(super) fn pong_age(&self) -> Duration {
        let now = self.base.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last_pong_ms.load(Ordering::Relaxed)))
    }
}

/// The HTTP request behind one room: where its outcome goes.
struct RoomIo {
    reply: tmpsc::Sender<Result<(), RoomFailure>>,
    /// Delivers the KV into the engine's reserved sequence. Dropped with the room: only
    /// then does the engine free the reservation (after ABORT_ACK for an abort: the KV
    /// buffer is reused only once the prefill stopped writing it).
    kv: tmpsc::Sender<ImportedKv>,
    /// The request's going away was told to the session.
    gone_told: bool,
}

pub(super) struct DealerLoop {
    _ctx: zmq::Context,
    sock: zmq::Socket,
    /// Reports the DEALER's closed connections (`wire::disconnect_monitor`).
    monitor: zmq::Socket,
    addr: String,
    /// Identity in every message sent.
    incarnation: u64,
    group_incarnation: u64,
    session: DecodeSession,
    rooms: HashMap<u64, RoomIo>,
    /// The last refusal published, so that its time is taken once.
    published_refusal: Option<Instant>,
    metrics: Arc<Metrics>,
    health: Arc<LoopHealth>,
    shared: Arc<PeerShared>,
    lifecycle: Arc<Lifecycle>,
    rx: Receiver<Command>,
    stopped: bool,
}

/// What a `DealerLoop` is built from (one per prefill address).
pub(super) struct DealerConfig {
    pub(super) ctx: zmq::Context,
    pub(super) sock: zmq::Socket,
    pub(super) monitor: zmq::Socket,
    pub(super) session: crate::kv::decode_session::DecodeConfig,
    pub(super) metrics: Arc<Metrics>,
    pub(super) lifecycle: Arc<Lifecycle>,
}

impl DealerLoop {
    pub(super) fn new(
        c: DealerConfig,
        health: Arc<LoopHealth>,
        shared: Arc<PeerShared>,
        rx: Receiver<Command>,
    ) -> Self {
        let s = &c.session;
        Self {
            _ctx: c.ctx,
            sock: c.sock,
            monitor: c.monitor,
            addr: s.addr.clone(),
            incarnation: s.local.incarnation,
            group_incarnation: s.local.group_incarnation,
            session: DecodeSession::new(c.session, Instant::now()),
            rooms: HashMap::new(),
            published_refusal: None,
            metrics: c.metrics,
            health,
            shared,
            lifecycle: c.lifecycle,
            rx,
            stopped: false,
        }
    }
}

impl Supervised for DealerLoop {
    fn run(&mut self) {
        loop {
            self.health.beat();
            if self.lifecycle.phase() == Phase::Stop {
                self.shutdown();
                return;
            }
            self.health.fault_point();
            wire::wait_readable2(&self.sock, &self.monitor);
            // Before the inbound messages: what the prefill sent before the connection
            // closed is already read (libzmq delivers it before the event), and a
            // reconnection's first messages belong to whoever answers now.
            for endpoint in wire::take_disconnects(&self.monitor) {
                self.metrics.kv.peer_disconnects.inc();
                self.event(DecodeEvent::Disconnected { endpoint });
            }
            for _ in 0..wire::RECV_BATCH {
                let Some(frames) = wire::try_recv(&self.sock) else {
                    break;
                };
                self.frames(frames);
            }
            self.commands();
            self.clients_gone();
            self.event(DecodeEvent::Tick);
            self.publish();
        }
    }

    fn after_panic(&mut self, message: &str) {
        self.event(DecodeEvent::Panicked {
            message: message.to_owned(),
        });
        self.publish();
    }
}

impl DealerLoop {
    fn frames(&mut self, frames: Vec<zmq::Message>) {
        let refs: Vec<&[u8]> = frames.iter().map(|m| &m[..]).collect();
        match decode_borrowed(&refs) {
            Ok((h, d)) => {
                let effects = self.session.on(DecodeEvent::Received(h, d), Instant::now());
                self.carry_out(effects);
            }
            Err(e) => self.event(DecodeEvent::Undecodable(&e)),
        }
    }

    fn commands(&mut self) {
        // A disconnected channel means the client is gone: nothing more will come.
        while let Ok(Command::Open {
            room,
            req,
            reply,
            kv,
        }) = self.rx.try_recv()
        {
            if self.rooms.contains_key(&room) {
                // Ids are random 64-bit: a collision is a bug. The new request's handles
                // are dropped, so it hears that the loop dropped its room.
                tracing::error!(room, "room id collision");
                continue;
            }
            self.rooms.insert(
                room,
                RoomIo {
                    reply,
                    kv,
                    gone_told: false,
                },
            );
            self.event(DecodeEvent::Open { room, req });
            // A room the session did not take (an id it has seen end) is dropped here too.
            if !self.session.has_room(room) {
                self.rooms.remove(&room);
            }
        }
    }

    /// Rooms whose HTTP request went away are aborted (told to the session once).
    fn clients_gone(&mut self) {
        let gone: Vec<u64> = self
            .rooms
            .iter_mut()
            .filter(|(_, r)| !r.gone_told && r.reply.is_closed())
            .map(|(id, r)| {
                r.gone_told = true;
                *id
            })
            .collect();
        for room in gone {
            self.event(DecodeEvent::ClientGone { room });
        }
    }

    fn event(&mut self, e: DecodeEvent<'_>) {
        let effects = self.session.on(e, Instant::now());
        self.carry_out(effects);
    }

    /// Carry out effects in order; a failed send goes back to the session at once, and
    /// what it answers is carried out next.
    fn carry_out(&mut self, effects: Vec<DecodeEffect>) {
        let mut todo: VecDeque<DecodeEffect> = effects.into();
        let mut published = false;
        while let Some(e) = todo.pop_front() {
            // `/ready` shows the session's new state before any request hears of a room
            // that state ended (a lost connection: not ready first).
            if !published && matches!(e, DecodeEffect::RoomEnded { .. }) {
                self.publish();
                published = true;
            }
            match e {
                DecodeEffect::Send { room, msg } => {
                    let t = msg.msg_type();
                    if !self.send(room, msg) {
                        let more = self
                            .session
                            .on(DecodeEvent::SendFailed { room, msg: t }, Instant::now());
                        todo.extend(more);
                    }
                }
                DecodeEffect::RoomEnded { room, end } => self.room_ended(room, end),
                DecodeEffect::Note(n) => self.note(n),
            }
        }
    }

    fn send(&self, room: u64, msg: Message) -> bool {
        let env = Envelope {
            incarnation: self.incarnation,
            group_incarnation: self.group_incarnation,
            room,
            msg,
        };
        match wire::send(&self.sock, None, &env) {
            Ok(_) => true,
            Err(e) => {
                let label = wire::send_error_label(e);
                self.metrics.kv.send_failure(label);
                tracing::debug!(peer = %self.addr, room, reason = label, "KV send failed");
                false
            }
        }
    }

    /// A room's outcome reaches its request, is counted, and (unless it succeeded)
    /// logged once with room, peer, incarnation and reason.
    fn room_ended(&mut self, room: u64, end: RoomEnd) {
        // Dropping the handles frees the engine's reservation.
        let io = self.rooms.remove(&room);
        match end {
            RoomEnd::Done {
                payload,
                first_token,
                first_logprob,
            } => {
                self.metrics.kv.room("done", "none");
                if let Some(io) = io {
                    let kv = ImportedKv {
                        payload: Box::new(payload),
                        first_token,
                        first_logprob: first_logprob.map(|l| TokenLogprob {
                            token: first_token,
                            logprob: l.logprob,
                            top: l.top,
                        }),
                    };
                    let _ = io.kv.try_send(kv);
                    let _ = io.reply.try_send(Ok(()));
                }
            }
            RoomEnd::Failed {
                code,
                text,
                peer_incarnation,
            } => {
                self.metrics.kv.room("failed", code.label());
                tracing::warn!(room, peer = %self.addr, peer_incarnation = %format!("{peer_incarnation:016x}"), reason = code.label(), %text, "room failed");
                self.shared.last_failure.set(Problem::new(
                    code.label(),
                    format!("room {room:016x}: {text}"),
                ));
                if let Some(io) = io {
                    let _ = io.reply.try_send(Err(RoomFailure {
                        code,
                        message: format!("KV transfer failed ({}): {text}", code.label()),
                    }));
                }
            }
            RoomEnd::Aborted { reason, acked } => {
                self.metrics.kv.room("aborted", reason);
                if acked {
                    tracing::info!(room, peer = %self.addr, "room aborted and acknowledged");
                } else if reason == "abort_ack_timeout" {
                    tracing::warn!(room, peer = %self.addr, reason, "room released without ABORT_ACK");
                }
            }
        }
    }

    fn note(&self, n: DecodeNote) {
        let kv = &self.metrics.kv;
        let peer = &self.addr;
        let hex = |i: u64| format!("{i:016x}");
        match n {
            DecodeNote::Malformed { kind, detail } => {
                kv.malformed(kind);
                tracing::warn!(%peer, kind, error = %detail, "malformed KV message dropped");
            }
            DecodeNote::Unexpected { msg_type } => {
                kv.malformed("unexpected_type");
                tracing::warn!(%peer, ?msg_type, "unexpected KV message dropped");
            }
            DecodeNote::UnknownRoom { room, logged } => {
                kv.malformed("unknown_room");
                if logged {
                    tracing::warn!(room, %peer, reason = "unknown_room", "KV chunk for an unknown room dropped");
                }
            }
            DecodeNote::BadChunk => kv.malformed("bad_chunk"),
            DecodeNote::HandshakeFailed {
                result,
                by,
                peer_incarnation,
                text,
            } => {
                kv.handshake(result);
                let pi = hex(peer_incarnation);
                match by {
                    Some(RefusedBy::Us) => {
                        tracing::warn!(%peer, peer_incarnation = %pi, reason = result, %text, "refusing the prefill")
                    }
                    Some(RefusedBy::Peer) => {
                        tracing::warn!(%peer, peer_incarnation = %pi, reason = result, %text, "prefill refused us")
                    }
                    None => tracing::warn!(%peer, %text, "handshake timed out; retrying"),
                }
            }
            DecodeNote::Authenticated {
                peer_incarnation,
                replaced,
            } => {
                kv.handshake("ok");
                tracing::info!(%peer, peer_incarnation = %hex(peer_incarnation), "prefill authenticated");
                if let Some(old) = replaced {
                    kv.peer_incarnation_changes.inc();
                    tracing::warn!(%peer, old_incarnation = old, new_incarnation = peer_incarnation, "prefill restarted while disconnected; handshaken again");
                }
            }
            DecodeNote::PeerRestarted { old, new } => {
                kv.peer_incarnation_changes.inc();
                tracing::warn!(%peer, old_incarnation = old, new_incarnation = new, "prefill restarted; failing its rooms and handshaking again");
            }
            DecodeNote::Disconnected {
                endpoint,
                peer_incarnation,
                rooms_failed,
            } => {
                tracing::warn!(%peer, %endpoint, peer_incarnation = %hex(peer_incarnation), rooms_failed, "connection to the prefill closed")
            }
            DecodeNote::PeerUnresponsive {
                peer_incarnation,
                unanswered,
                deadline,
                rooms_failed,
            } => {
                kv.peer_unresponsive.inc();
                tracing::warn!(%peer, peer_incarnation = %hex(peer_incarnation), reason = "peer_unresponsive", unanswered_ms = unanswered.as_millis() as u64, deadline_ms = deadline.as_millis() as u64, rooms_failed, "prefill unresponsive; failing its rooms and handshaking again");
            }
            DecodeNote::StaleWelcome { peer_incarnation } => {
                tracing::info!(%peer, peer_incarnation = %hex(peer_incarnation), "stale WELCOME dropped (the answer to an earlier HELLO)");
            }
            DecodeNote::PeerLeaving {
                peer_incarnation,
                reason: FailCode::Reset,
                text,
            } => {
                kv.peer_goodbye.inc();
                tracing::warn!(%peer, peer_incarnation = %hex(peer_incarnation), reason = "reset", %text, "prefill is resetting in place; handshaking again");
            }
            DecodeNote::PeerLeaving {
                peer_incarnation,
                reason,
                text,
            } => {
                kv.peer_goodbye.inc();
                tracing::warn!(%peer, peer_incarnation = %hex(peer_incarnation), reason = reason.label(), %text, "prefill is leaving; no new rooms go there");
            }
            DecodeNote::PongRtt(rtt) => kv.ping_rtt.observe(rtt.as_secs_f64()),
            DecodeNote::Progress => {
                kv.progress.inc();
            }
            DecodeNote::RoomOpened => {
                kv.rooms_opened.inc();
            }
            DecodeNote::BytesReceived(n) => kv.bytes("received", n),
            DecodeNote::OverBudget => kv.send_failure("byte_budget"),
            DecodeNote::RoomIdCollision { room } => tracing::error!(room, "room id collision"),
            DecodeNote::Stopped => {
                let reason = if self.lifecycle.is_reset() {
                    "reset"
                } else {
                    "shutdown"
                };
                tracing::info!(%peer, reason, "KV loop stopped")
            }
        }
    }

    /// What `/ready` and the room picker read.
    fn publish(&mut self) {
        let st = self.session.status();
        let (est, state) = match st.state {
            ChannelState::Established => (true, STATE_ESTABLISHED),
            _ if st.unresponsive => (false, STATE_UNRESPONSIVE),
            ChannelState::Handshaking => (false, STATE_HANDSHAKING),
            ChannelState::Idle => (false, STATE_IDLE),
        };
        let sh = &self.shared;
        sh.established.store(est, Ordering::Relaxed);
        sh.state.store(state, Ordering::Relaxed);
        sh.peer_draining.store(st.peer_draining, Ordering::Relaxed);
        sh.peer_incarnation
            .store(st.peer_incarnation, Ordering::Relaxed);
        if let Some(t) = st.last_pong {
            let ms = t.saturating_duration_since(sh.base).as_millis() as u64;
            sh.last_pong_ms.store(ms, Ordering::Relaxed);
        }
        sh.in_flight.store(st.rooms, Ordering::Relaxed);
        self.metrics
            .kv
            .blocks_in_transfer
            .get_or_create(&PeerLabels {
                peer: self.addr.clone(),
            })
            .set(st.blocks_held as i64);
        if let Some(r) = st.last_refusal
            && self.published_refusal != Some(r.at)
        {
            self.published_refusal = Some(r.at);
            sh.last_refusal.set(problem(r));
        }
    }

    /// The process is stopping: the session fails every room left and says GOODBYE;
    /// the connection stays a moment so that the prefill reads them, then the socket
    /// closes with a bounded linger.
    fn shutdown(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let stop = if self.lifecycle.is_reset() {
            DecodeEvent::Reset
        } else {
            DecodeEvent::Stop
        };
        let effects = self.session.on(stop, Instant::now());
        let ended = effects
            .iter()
            .filter(|e| matches!(e, DecodeEffect::RoomEnded { .. }))
            .count();
        self.lifecycle.rooms_ended(ended);
        let said_goodbye = effects.iter().any(|e| {
            matches!(
                e,
                DecodeEffect::Send {
                    msg: Message::Goodbye { .. },
                    ..
                }
            )
        });
        self.carry_out(effects);
        if said_goodbye {
            std::thread::sleep(wire::CLOSE_GRACE);
        }
        self.publish();
        wire::set_close_linger(&self.sock);
    }
}

/// A session's refusal as `/ready` reports it, with its wall-clock time.
fn problem(r: &Refusal) -> Problem {
    let ago = Instant::now().saturating_duration_since(r.at);
    Problem {
        reason: r.reason.clone(),
        message: r.message.clone(),
        at: SystemTime::now()
            .checked_sub(ago)
            .unwrap_or(SystemTime::now()),
    }
}
