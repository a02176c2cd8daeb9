//! The decode's loop for one prefill (`DealerLoop`): owns the DEALER socket; handshakes by
//! itself (again whenever the prefill shows a new incarnation), probes with PING/PONG, opens
//! rooms for HTTP requests, validates and reassembles KV chunks and acknowledges them
//! (CREDIT), aborts rooms whose client left, and enforces each room's no-progress deadline
//! (refreshed by the prefill's PROGRESS), and fails the rooms in flight at once when the
//! TCP connection to the prefill closes (a socket monitor; `peer_lost`). The types the decode's HTTP side shares with the
//! loop (`Command`, `PeerShared`, `RoomFailure`) live here with it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use tokio::sync::mpsc as tmpsc;

use super::report::{Problem, ProblemSlot};
use super::settings::PdTimings;
use super::settings::random_id;
use super::supervise::{Lifecycle, LoopHealth, Phase, Supervised};
use super::wire;
use crate::kv::auth::{GroupKey, Initiator, LocalIdentity};
use crate::kv::chunks::{Assembler, BufferPool};
use crate::kv::room::{AbortOutcome, Deadlines, RoomState, RoomTable};
use crate::kv::{
    Decoded, Envelope, FailCode, KvChunkRef, Message, PrefillRequest, decode_borrowed,
};
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

    fn mark_pong(&self) {
        self.last_pong_ms
            .store(self.base.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

/// The decode's session with its prefill: the handshake's progress.
enum DealerSession {
    Idle { retry_at: Instant },
    HelloSent { init: Initiator, at: Instant },
    AuthSent { peer_incarnation: u64, at: Instant },
    Established { peer_incarnation: u64 },
}

/// One room as the decode sees it.
struct DealerRoom {
    reply: tmpsc::Sender<Result<(), RoomFailure>>,
    /// Delivers the KV into the engine's reserved sequence. Dropped with the room: only
    /// then does the engine free the reservation (after ABORT_ACK for an abort, rule 8 in
    /// docs/architecture.md).
    kv: tmpsc::Sender<ImportedKv>,
    req: Option<PrefillRequest>,
    prompt_len: usize,
    asm: Assembler,
    peer_incarnation: u64,
    /// The prefill has said something about this room since its PREFILL went out; until
    /// then the PREFILL's bytes count against the send budget.
    answered: bool,
}

impl DealerRoom {
    /// Wire bytes of this room's PREFILL (tokens and sampling parameters).
    fn prefill_bytes(&self) -> u64 {
        64 + 4 * self.prompt_len as u64
    }
}

pub(super) struct DealerLoop {
    _ctx: zmq::Context,
    sock: zmq::Socket,
    /// Reports the DEALER's closed connections (`wire::disconnect_monitor`).
    monitor: zmq::Socket,
    addr: String,
    local: LocalIdentity,
    key: GroupKey,
    timings: PdTimings,
    /// Upper bound of one prompt token's KV bytes, to refuse oversized KV.
    per_token: u64,
    /// Most PREFILL bytes outstanding (sent, no answer yet) to this prefill.
    send_budget: u64,
    metrics: Arc<Metrics>,
    health: Arc<LoopHealth>,
    shared: Arc<PeerShared>,
    lifecycle: Arc<Lifecycle>,
    rx: Receiver<Command>,
    session: DealerSession,
    rooms: RoomTable<DealerRoom>,
    last_ping: Option<(u64, Instant)>,
    /// The incarnation of the last prefill this loop authenticated, kept across a closed
    /// connection so that a replacement process is still counted and logged as a restart.
    last_authenticated: Option<u64>,
    /// KV chunk data bytes received in this session, and the total last acknowledged.
    consumed: u64,
    credited: u64,
    stopped: bool,
    /// Reassembly buffers reused across rooms (shared by every peer loop).
    pool: BufferPool,
}

/// What a `DealerLoop` is built from (one per prefill address).
pub(super) struct DealerConfig {
    pub(super) ctx: zmq::Context,
    pub(super) sock: zmq::Socket,
    pub(super) monitor: zmq::Socket,
    pub(super) addr: String,
    pub(super) local: LocalIdentity,
    pub(super) key: GroupKey,
    pub(super) timings: PdTimings,
    pub(super) per_token: u64,
    pub(super) send_budget: u64,
    pub(super) metrics: Arc<Metrics>,
    pub(super) pool: BufferPool,
    pub(super) lifecycle: Arc<Lifecycle>,
}

impl DealerLoop {
    pub(super) fn new(
        c: DealerConfig,
        health: Arc<LoopHealth>,
        shared: Arc<PeerShared>,
        rx: Receiver<Command>,
    ) -> Self {
        let deadlines = Deadlines::new(c.timings.bootstrap_timeout, c.timings.kv_timeout);
        Self {
            _ctx: c.ctx,
            sock: c.sock,
            monitor: c.monitor,
            addr: c.addr,
            local: c.local,
            key: c.key,
            timings: c.timings,
            per_token: c.per_token,
            send_budget: c.send_budget,
            metrics: c.metrics,
            health,
            shared,
            lifecycle: c.lifecycle,
            rx,
            session: DealerSession::Idle {
                retry_at: Instant::now(),
            },
            rooms: RoomTable::new(deadlines, 65_536),
            last_ping: None,
            last_authenticated: None,
            consumed: 0,
            credited: 0,
            stopped: false,
            pool: c.pool,
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
                self.on_disconnected(&endpoint);
            }
            for _ in 0..wire::RECV_BATCH {
                let Some(frames) = wire::try_recv(&self.sock) else {
                    break;
                };
                self.on_frames(frames);
            }
            self.send_credit();
            self.commands();
            let now = Instant::now();
            self.drive_session(now);
            self.abort_abandoned(now);
            self.expire(now);
            self.publish();
        }
    }

    fn after_panic(&mut self, message: &str) {
        for id in self.rooms.ids() {
            self.fail_room(id, FailCode::LoopPanic, message, true);
        }
    }
}

impl DealerLoop {
    fn send(&self, room: u64, msg: Message) -> bool {
        let env = Envelope {
            incarnation: self.local.incarnation,
            group_incarnation: self.local.group_incarnation,
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

    fn set_session(&mut self, s: DealerSession) {
        let (est, state) = match s {
            DealerSession::Established { .. } => (true, STATE_ESTABLISHED),
            DealerSession::Idle { .. } => (false, STATE_IDLE),
            _ => (false, STATE_HANDSHAKING),
        };
        self.shared.established.store(est, Ordering::Relaxed);
        self.shared.state.store(state, Ordering::Relaxed);
        self.session = s;
    }

    /// Remember why the channel is not established, for `/ready`.
    fn refused(&self, reason: &str, message: impl Into<String>) {
        self.shared
            .last_refusal
            .set(Problem::new(reason, message.into()));
    }

    fn known_incarnation(&self) -> Option<u64> {
        match self.session {
            DealerSession::AuthSent {
                peer_incarnation, ..
            }
            | DealerSession::Established { peer_incarnation } => Some(peer_incarnation),
            _ => None,
        }
    }

    /// Fail the rooms that belong to another prefill incarnation than `current`
    /// (docs/architecture.md rule 4).
    fn fail_rooms_of_old_incarnations(&mut self, current: u64) {
        for id in self.rooms.ids() {
            let stale = self.rooms.get(id).is_some_and(|r| {
                r.data.req.is_none()
                    && r.data.peer_incarnation != current
                    && r.state != RoomState::Aborting
            });
            if stale {
                self.fail_room(id, FailCode::PeerRestarted, "prefill restarted", false);
            }
        }
    }

    /// The TCP connection to the prefill closed (the process died, or the link broke): the
    /// KV of the rooms already sent there will not arrive on this connection — a dead
    /// prefill's never, a reconnected one's only partly (libzmq drops what it could not
    /// deliver) — so they fail now with `peer_lost` instead of waiting out the KV timeout.
    /// Rooms not yet sent stay queued. The session ends too: until a handshake succeeds
    /// again the peer is not ready and gets no new rooms (a send on the closed connection
    /// would only fail `send_failed`); the handshake is retried at once and every 200 ms
    /// while the prefill is unreachable, whether it comes back as the same process (a
    /// broken link) or a new one (counted as a restart when authenticated).
    fn on_disconnected(&mut self, endpoint: &str) {
        self.metrics.kv.peer_disconnects.inc();
        let lost: Vec<u64> = self
            .rooms
            .ids()
            .into_iter()
            .filter(|&id| {
                self.rooms
                    .get(id)
                    .is_some_and(|r| r.data.req.is_none() && r.state != RoomState::Aborting)
            })
            .collect();
        tracing::warn!(peer = %self.addr, %endpoint, peer_incarnation = %format!("{:016x}", self.shared.peer_incarnation.load(Ordering::Relaxed)), rooms_failed = lost.len(), "connection to the prefill closed");
        // Not ready before the rooms' clients hear of it.
        if !matches!(self.session, DealerSession::Idle { .. }) {
            self.set_session(DealerSession::Idle {
                retry_at: Instant::now(),
            });
        }
        for id in lost {
            self.fail_room(
                id,
                FailCode::PeerLost,
                "connection to the prefill closed",
                false,
            );
        }
    }

    fn on_frames(&mut self, frames: Vec<zmq::Message>) {
        let refs: Vec<&[u8]> = frames.iter().map(|m| &m[..]).collect();
        let (hdr, decoded) = match decode_borrowed(&refs) {
            Ok(d) => d,
            Err(e) => {
                self.metrics.kv.malformed(e.kind());
                tracing::warn!(peer = %self.addr, kind = e.kind(), error = %e, "malformed KV message dropped");
                if let crate::kv::DecodeError::WrongVersion { got, want, .. } = e {
                    self.metrics
                        .kv
                        .handshake(crate::kv::RejectReason::VersionMismatch.label());
                    self.refused(
                        crate::kv::RejectReason::VersionMismatch.label(),
                        format!("the prefill speaks protocol version {got}, this decode {want}"),
                    );
                }
                return;
            }
        };
        // Rule 4 (docs/architecture.md): a new prefill incarnation invalidates everything
        // about the old one.
        if let Some(known) = self.known_incarnation()
            && hdr.incarnation != known
        {
            self.metrics.kv.peer_incarnation_changes.inc();
            self.last_authenticated = Some(hdr.incarnation);
            tracing::warn!(peer = %self.addr, old_incarnation = known, new_incarnation = hdr.incarnation, "prefill restarted; failing its rooms and handshaking again");
            self.refused(
                FailCode::PeerRestarted.label(),
                format!(
                    "prefill incarnation changed from {known:016x} to {:016x}",
                    hdr.incarnation
                ),
            );
            self.fail_rooms_of_old_incarnations(hdr.incarnation);
            self.set_session(DealerSession::Idle {
                retry_at: Instant::now(),
            });
            if !matches!(decoded, Decoded::Message(Message::Reject { .. })) {
                return;
            }
        }
        let msg = match decoded {
            Decoded::Chunk(c) => {
                // Every chunk this session received counts for the CREDIT, whether its room
                // is still wanted or not: the prefill spent budget on it either way.
                if matches!(self.session, DealerSession::Established { .. }) {
                    self.consumed += c.data.len() as u64;
                }
                self.on_chunk(hdr.room, c);
                return;
            }
            Decoded::Message(m) => m,
        };
        let env = Envelope {
            incarnation: hdr.incarnation,
            group_incarnation: hdr.group_incarnation,
            room: hdr.room,
            msg,
        };
        match env.msg {
            Message::Welcome { .. } => self.on_welcome(&env),
            Message::Accepted => {
                if let DealerSession::AuthSent {
                    peer_incarnation, ..
                } = self.session
                    && env.incarnation == peer_incarnation
                {
                    self.metrics.kv.handshake("ok");
                    tracing::info!(peer = %self.addr, peer_incarnation = %format!("{peer_incarnation:016x}"), "prefill authenticated");
                    // A new process met after the connection closed (the session had
                    // already ended, so rule 4's check above did not see the change).
                    if let Some(old) = self.last_authenticated
                        && old != peer_incarnation
                    {
                        self.metrics.kv.peer_incarnation_changes.inc();
                        tracing::warn!(peer = %self.addr, old_incarnation = old, new_incarnation = peer_incarnation, "prefill restarted while disconnected; handshaken again");
                    }
                    self.last_authenticated = Some(peer_incarnation);
                    self.shared
                        .peer_incarnation
                        .store(peer_incarnation, Ordering::Relaxed);
                    self.shared.peer_draining.store(false, Ordering::Relaxed);
                    self.shared.mark_pong();
                    self.consumed = 0;
                    self.credited = 0;
                    self.set_session(DealerSession::Established { peer_incarnation });
                    self.fail_rooms_of_old_incarnations(peer_incarnation);
                    self.send_bootstrapped_rooms();
                }
            }
            Message::Reject { reason, text } => {
                self.metrics.kv.handshake(reason.label());
                tracing::warn!(peer = %self.addr, peer_incarnation = %format!("{:016x}", env.incarnation), reason = reason.label(), %text, "prefill refused us");
                self.refused(reason.label(), format!("the prefill refused us: {text}"));
                self.set_session(DealerSession::Idle {
                    retry_at: Instant::now() + self.timings.probe_period,
                });
            }
            Message::Pong {
                nonce,
                timestamp_us: _,
            } => {
                if let Some((n, at)) = self.last_ping
                    && n == nonce
                {
                    self.metrics.kv.ping_rtt.observe(at.elapsed().as_secs_f64());
                }
                if matches!(self.session, DealerSession::Established { .. }) {
                    self.shared.mark_pong();
                }
            }
            Message::Progress { .. } => self.on_progress(env.room),
            Message::Goodbye { reason, text } => {
                tracing::warn!(peer = %self.addr, peer_incarnation = %format!("{:016x}", env.incarnation), reason = reason.label(), %text, "prefill is leaving; no new rooms go there");
                self.metrics.kv.peer_goodbye.inc();
                self.shared.peer_draining.store(true, Ordering::Relaxed);
                self.refused(
                    FailCode::PeerShutdown.label(),
                    format!("the prefill said goodbye: {text}"),
                );
                // Rooms in flight finish by their own messages; a new handshake is tried
                // (and refused until the prefill is gone or replaced).
                self.set_session(DealerSession::Idle {
                    retry_at: Instant::now() + self.timings.probe_period,
                });
            }
            Message::Done {
                first_token,
                prompt_tokens,
                logprob,
            } => self.on_done(env.room, first_token, prompt_tokens, logprob),
            Message::Failed { reason, text } => {
                if self
                    .rooms
                    .get(env.room)
                    .is_some_and(|r| r.state != RoomState::Aborting)
                {
                    // The prefill failing a room because it shuts down is, seen from here,
                    // the peer shutting down.
                    let reason = match reason {
                        FailCode::Shutdown => FailCode::PeerShutdown,
                        r => r,
                    };
                    self.fail_room(env.room, reason, &text, false);
                }
            }
            Message::AbortAck => {
                if let Some(r) = self.rooms.abort_acked(env.room) {
                    // The KV buffer is released only now (docs/architecture.md rule 8).
                    drop(r);
                    self.metrics.kv.room("aborted", "client_abort");
                    tracing::info!(room = env.room, peer = %self.addr, "room aborted and acknowledged");
                }
            }
            other => {
                self.metrics.kv.malformed("unexpected_type");
                tracing::warn!(peer = %self.addr, msg_type = ?other.msg_type(), "unexpected KV message dropped");
            }
        }
    }

    /// The prefill is still working on `room`: its no-progress deadline starts again.
    fn on_progress(&mut self, room: u64) {
        let Some(r) = self.rooms.get_mut(room) else {
            return; // late news of a room that ended; nothing to do (rule 2)
        };
        r.data.answered = true;
        if r.state == RoomState::WaitingKv {
            let _ = self
                .rooms
                .advance(room, RoomState::WaitingKv, Instant::now());
            self.metrics.kv.progress.inc();
        }
    }

    /// Validate one KV chunk and copy its data (read in place from the received frame)
    /// into the room's reassembly buffer.
    fn on_chunk(&mut self, room: u64, c: KvChunkRef<'_>) {
        let Some(r) = self.rooms.get_mut(room) else {
            self.metrics.kv.malformed("unknown_room");
            tracing::warn!(room, peer = %self.addr, reason = "unknown_room", "KV chunk for an unknown room dropped");
            return;
        };
        if r.state == RoomState::Aborting {
            return; // late data of an aborted room; the ack will follow
        }
        r.data.answered = true;
        let limit = 64 + self.per_token * r.data.prompt_len as u64;
        let n = c.data.len();
        match r.data.asm.push(c, limit) {
            Ok(_) => {
                self.metrics.kv.bytes("received", n);
                let _ = self
                    .rooms
                    .advance(room, RoomState::Transferring, Instant::now());
            }
            Err(e) => {
                self.metrics.kv.malformed("bad_chunk");
                self.fail_room(room, FailCode::BadChunk, &e.to_string(), true);
            }
        }
    }

    /// Acknowledge the KV bytes received so far (flow control, see the `kv` module header).
    fn send_credit(&mut self) {
        if self.consumed != self.credited
            && matches!(self.session, DealerSession::Established { .. })
            && self.send(
                0,
                Message::Credit {
                    consumed: self.consumed,
                },
            )
        {
            self.credited = self.consumed;
        }
    }

    fn on_welcome(&mut self, env: &Envelope) {
        let DealerSession::HelloSent { init, .. } = &self.session else {
            self.metrics.kv.malformed("unexpected_type");
            return;
        };
        match init.on_welcome(
            &self.local,
            &self.key,
            env.incarnation,
            env.group_incarnation,
            &env.msg,
        ) {
            Ok((auth, peer)) => {
                if self.send(0, auth) {
                    self.set_session(DealerSession::AuthSent {
                        peer_incarnation: peer.peer_incarnation,
                        at: Instant::now(),
                    });
                }
            }
            Err((reason, text)) => {
                self.metrics.kv.handshake(reason.label());
                tracing::warn!(peer = %self.addr, peer_incarnation = %format!("{:016x}", env.incarnation), reason = reason.label(), %text, "refusing the prefill");
                self.refused(reason.label(), format!("we refused the prefill: {text}"));
                self.send(0, Message::Reject { reason, text });
                self.set_session(DealerSession::Idle {
                    retry_at: Instant::now() + self.timings.probe_period,
                });
            }
        }
    }

    fn on_done(
        &mut self,
        room: u64,
        first: u32,
        prompt_tokens: u32,
        lp: Option<crate::kv::WireLogprob>,
    ) {
        let Some(r) = self.rooms.get(room) else {
            self.metrics.kv.malformed("unknown_room");
            return;
        };
        if r.state == RoomState::Aborting {
            return;
        }
        if !r.data.asm.complete() || prompt_tokens as usize != r.data.prompt_len {
            let msg = format!(
                "DONE after {} KV bytes for {prompt_tokens} tokens (expected {})",
                r.data.asm.received_bytes(),
                r.data.prompt_len
            );
            self.fail_room(room, FailCode::Incomplete, &msg, true);
            return;
        }
        let Some(r) = self.rooms.finish(room, RoomState::Done) else {
            return;
        };
        self.metrics.kv.room("done", "none");
        let kv = ImportedKv {
            payload: Box::new(r.data.asm.into_payload()),
            first_token: first,
            first_logprob: lp.map(|l| TokenLogprob {
                token: first,
                logprob: l.logprob,
                top: l.top,
            }),
        };
        let _ = r.data.kv.try_send(kv);
        let _ = r.data.reply.try_send(Ok(()));
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
            let est = match self.session {
                DealerSession::Established { peer_incarnation } => Some(peer_incarnation),
                _ => None,
            };
            let data = DealerRoom {
                reply,
                kv,
                prompt_len: req.tokens.len(),
                req: Some(req),
                asm: Assembler::with_pool(self.pool.clone()),
                peer_incarnation: est.unwrap_or(0),
                answered: false,
            };
            if let Err(e) = self
                .rooms
                .open(room, RoomState::Bootstrap, data, Instant::now())
            {
                tracing::error!(room, error = %e, "room id collision");
                continue;
            }
            self.metrics.kv.rooms_opened.inc();
            if est.is_some() {
                self.send_prefill(room);
            }
        }
    }

    /// PREFILL bytes sent to the prefill that it has not answered yet.
    fn outstanding_prefill_bytes(&self) -> u64 {
        self.rooms
            .iter()
            .filter(|(_, r)| r.data.req.is_none() && !r.data.answered)
            .map(|(_, r)| r.data.prefill_bytes())
            .sum()
    }

    fn send_prefill(&mut self, room: u64) {
        let DealerSession::Established { peer_incarnation } = self.session else {
            return;
        };
        let outstanding = self.outstanding_prefill_bytes();
        let Some(r) = self.rooms.get_mut(room) else {
            return;
        };
        if r.data.req.is_none() {
            return;
        }
        // Rule 10 in bytes: a prefill that stops answering pins at most the budget here.
        let bytes = r.data.prefill_bytes();
        if outstanding > 0 && outstanding + bytes > self.send_budget {
            self.metrics.kv.send_failure("byte_budget");
            let text = format!(
                "{outstanding} bytes of PREFILL unanswered by this prefill; {bytes} more would pass the send budget of {} bytes",
                self.send_budget
            );
            self.fail_room(room, FailCode::SendBudget, &text, false);
            return;
        }
        let Some(req) = r.data.req.take() else {
            return;
        };
        r.data.peer_incarnation = peer_incarnation;
        if self.send(room, Message::Prefill(req)) {
            let _ = self
                .rooms
                .advance(room, RoomState::WaitingKv, Instant::now());
        } else {
            self.fail_room(
                room,
                FailCode::SendFailed,
                "PREFILL could not be sent",
                false,
            );
        }
    }

    fn send_bootstrapped_rooms(&mut self) {
        let ids: Vec<u64> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.state == RoomState::Bootstrap)
            .map(|(id, _)| id)
            .collect();
        for id in ids {
            self.send_prefill(id);
        }
    }

    fn drive_session(&mut self, now: Instant) {
        match &self.session {
            DealerSession::Idle { retry_at } if now >= *retry_at => {
                let init = Initiator::new(rand::random());
                let hello = init.hello(&self.local);
                if self.send(0, hello) {
                    self.set_session(DealerSession::HelloSent { init, at: now });
                } else {
                    // No connection to send on (the DEALER queues only on live ones).
                    let known = self.shared.last_refusal.get();
                    if known.is_none_or(|p| p.reason != "peer_unreachable") {
                        self.refused(
                            "peer_unreachable",
                            format!("no connection to the prefill at {}", self.addr),
                        );
                    }
                    self.set_session(DealerSession::Idle {
                        retry_at: now + Duration::from_millis(200),
                    });
                }
            }
            DealerSession::HelloSent { at, .. } | DealerSession::AuthSent { at, .. }
                if now.duration_since(*at) >= self.timings.bootstrap_timeout =>
            {
                self.metrics.kv.handshake("timeout");
                tracing::warn!(peer = %self.addr, "handshake timed out; retrying");
                // A refusal seen during this attempt (an unreadable answer: another
                // protocol version) says more than the timeout it led to: keep it.
                let since_hello = now.duration_since(*at);
                let explained = self
                    .shared
                    .last_refusal
                    .get()
                    .is_some_and(|p| p.at.elapsed().unwrap_or_default() <= since_hello);
                if explained {
                    self.set_session(DealerSession::Idle { retry_at: now });
                    return;
                }
                self.refused(
                    "handshake_timeout",
                    format!(
                        "no handshake answer from {} within {} ms",
                        self.addr,
                        self.timings.bootstrap_timeout.as_millis()
                    ),
                );
                self.set_session(DealerSession::Idle { retry_at: now });
            }
            DealerSession::Established { .. } => {
                let due = self
                    .last_ping
                    .is_none_or(|(_, at)| now.duration_since(at) >= self.timings.probe_period);
                if due {
                    let nonce = random_id();
                    let ts = self.shared.base.elapsed().as_micros() as u64;
                    self.send(
                        0,
                        Message::Ping {
                            nonce,
                            timestamp_us: ts,
                        },
                    );
                    self.last_ping = Some((nonce, now));
                }
            }
            _ => {}
        }
    }

    /// Rooms whose HTTP request went away are aborted on both sides.
    fn abort_abandoned(&mut self, now: Instant) {
        let gone: Vec<u64> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.state != RoomState::Aborting && r.data.reply.is_closed())
            .map(|(id, _)| id)
            .collect();
        for id in gone {
            let sent_prefill = self.rooms.get(id).is_some_and(|r| r.data.req.is_none());
            if !sent_prefill {
                // The prefill never heard of it: nothing to acknowledge.
                self.rooms.finish(id, RoomState::Aborted);
                self.metrics.kv.room("aborted", "client_abort");
                continue;
            }
            if self.rooms.abort(id, now) == AbortOutcome::SendAbort {
                self.send(id, Message::Abort);
            }
        }
    }

    /// Fail a room: tell the HTTP request, push FAILED to the prefill when it knows the
    /// room (docs/architecture.md rule 6), log once with room, peer, incarnation and reason,
    /// count.
    fn fail_room(&mut self, id: u64, code: FailCode, text: &str, tell_peer: bool) {
        let Some(r) = self.rooms.finish(id, RoomState::Failed(code)) else {
            return;
        };
        if tell_peer && r.data.req.is_none() {
            self.send(
                id,
                Message::Failed {
                    reason: code,
                    text: text.to_owned(),
                },
            );
        }
        self.metrics.kv.room("failed", code.label());
        tracing::warn!(room = id, peer = %self.addr, peer_incarnation = %format!("{:016x}", r.data.peer_incarnation), reason = code.label(), %text, "room failed");
        self.shared.last_failure.set(Problem::new(
            code.label(),
            format!("room {id:016x}: {text}"),
        ));
        let _ = r.data.reply.try_send(Err(RoomFailure {
            code,
            message: format!("KV transfer failed ({}): {text}", code.label()),
        }));
    }

    fn expire(&mut self, now: Instant) {
        for (id, state) in self.rooms.expired(now) {
            if state == RoomState::Aborting {
                // The ack never came; the peer is gone or stuck. Release and count.
                self.rooms.finish(id, RoomState::Aborted);
                self.metrics.kv.room("aborted", "abort_ack_timeout");
                tracing::warn!(room = id, peer = %self.addr, reason = "abort_ack_timeout", "room released without ABORT_ACK");
                continue;
            }
            let code = state.timeout_code();
            self.fail_room(
                id,
                code,
                &format!("no progress while {}", state.label()),
                true,
            );
        }
    }

    /// The process is stopping: fail every room left (pushing FAILED to the prefill for
    /// those it knows), say GOODBYE so the prefill drops this session at once, and close
    /// the socket with a bounded linger.
    fn shutdown(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        for id in self.rooms.ids() {
            if self
                .rooms
                .get(id)
                .is_some_and(|r| r.state == RoomState::Aborting)
            {
                self.rooms.finish(id, RoomState::Aborted);
                self.metrics.kv.room("aborted", "shutdown");
                continue;
            }
            self.fail_room(id, FailCode::Shutdown, "the decode is shutting down", true);
        }
        if matches!(self.session, DealerSession::Established { .. }) {
            self.send(
                0,
                Message::Goodbye {
                    reason: FailCode::Shutdown,
                    text: "the decode is shutting down".into(),
                },
            );
            std::thread::sleep(wire::CLOSE_GRACE);
        }
        self.set_session(DealerSession::Idle {
            retry_at: Instant::now() + Duration::from_secs(3600),
        });
        self.publish();
        wire::set_close_linger(&self.sock);
        tracing::info!(peer = %self.addr, "KV loop stopped");
    }

    fn publish(&self) {
        let block = self.local.layout.block_size.max(1) as usize;
        let held: usize = self
            .rooms
            .iter()
            .filter(|(_, r)| matches!(r.state, RoomState::Transferring | RoomState::Aborting))
            .map(|(_, r)| r.data.prompt_len.div_ceil(block))
            .sum();
        self.shared
            .in_flight
            .store(self.rooms.len(), Ordering::Relaxed);
        self.metrics
            .kv
            .blocks_in_transfer
            .get_or_create(&PeerLabels {
                peer: self.addr.clone(),
            })
            .set(held as i64);
    }
}
