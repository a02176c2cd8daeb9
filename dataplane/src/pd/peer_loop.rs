//! The decode's loop for one prefill: owns the DEALER socket; handshakes by itself (again
//! whenever the prefill shows a new incarnation), probes with PING/PONG, opens rooms for
//! HTTP requests, validates and reassembles KV chunks, aborts rooms whose client left, and
//! enforces each room's no-progress deadline.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use tokio::sync::mpsc as tmpsc;

use super::decode::{Command, PeerShared, RoomFailure};
use super::supervise::Supervised;
use super::{LoopHealth, random_id, wire};
use crate::config::PdTimings;
use crate::kv::auth::{GroupKey, Initiator, LocalIdentity};
use crate::kv::chunks::{Assembler, BufferPool};
use crate::kv::room::{AbortOutcome, RoomState, RoomTable};
use crate::kv::{
    Decoded, Envelope, FailCode, KvChunkRef, Message, PrefillRequest, decode_borrowed,
};
use crate::metrics::{Metrics, PeerLabels};
use crate::sampling::TokenLogprob;
use crate::scheduler::ImportedKv;

pub(super) enum Session {
    Idle { retry_at: Instant },
    HelloSent { init: Initiator, at: Instant },
    AuthSent { peer_incarnation: u64, at: Instant },
    Established { peer_incarnation: u64 },
}

pub(super) struct DecodeRoom {
    reply: tmpsc::Sender<Result<(), RoomFailure>>,
    /// Delivers the KV into the engine's reserved sequence. Dropped with the room: only
    /// then does the engine free the reservation (after ABORT_ACK for an abort, rule 8 in
    /// docs/architecture.md).
    kv: tmpsc::Sender<ImportedKv>,
    req: Option<PrefillRequest>,
    prompt_len: usize,
    asm: Assembler,
    peer_incarnation: u64,
}

pub(super) struct PeerLoop {
    pub(super) _ctx: zmq::Context,
    pub(super) sock: zmq::Socket,
    pub(super) addr: String,
    pub(super) local: LocalIdentity,
    pub(super) key: GroupKey,
    pub(super) timings: PdTimings,
    pub(super) per_token: u64,
    pub(super) metrics: Arc<Metrics>,
    pub(super) health: Arc<LoopHealth>,
    pub(super) shared: Arc<PeerShared>,
    pub(super) rx: Receiver<Command>,
    pub(super) session: Session,
    pub(super) rooms: RoomTable<DecodeRoom>,
    pub(super) last_ping: Option<(u64, Instant)>,
    /// Reassembly buffers reused across rooms (shared by every peer loop).
    pub(super) pool: BufferPool,
}

impl Supervised for PeerLoop {
    fn run(&mut self) {
        loop {
            self.health.beat();
            self.health.fault_point();
            wire::wait_readable(&self.sock);
            for _ in 0..wire::RECV_BATCH {
                let Some(frames) = wire::try_recv(&self.sock) else {
                    break;
                };
                self.on_frames(frames);
            }
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

impl PeerLoop {
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

    fn set_session(&mut self, s: Session) {
        let est = matches!(s, Session::Established { .. });
        self.shared.established.store(est, Ordering::Relaxed);
        self.session = s;
    }

    fn known_incarnation(&self) -> Option<u64> {
        match self.session {
            Session::AuthSent {
                peer_incarnation, ..
            }
            | Session::Established { peer_incarnation } => Some(peer_incarnation),
            _ => None,
        }
    }

    fn on_frames(&mut self, frames: Vec<zmq::Message>) {
        let refs: Vec<&[u8]> = frames.iter().map(|m| &m[..]).collect();
        let (hdr, decoded) = match decode_borrowed(&refs) {
            Ok(d) => d,
            Err(e) => {
                self.metrics.kv.malformed(e.kind());
                tracing::warn!(peer = %self.addr, kind = e.kind(), error = %e, "malformed KV message dropped");
                return;
            }
        };
        // Rule 4 (docs/architecture.md): a new prefill incarnation invalidates everything
        // about the old one.
        if let Some(known) = self.known_incarnation()
            && hdr.incarnation != known
        {
            self.metrics.kv.peer_incarnation_changes.inc();
            tracing::warn!(peer = %self.addr, old_incarnation = known, new_incarnation = hdr.incarnation, "prefill restarted; failing its rooms and handshaking again");
            for id in self.rooms.ids() {
                if self
                    .rooms
                    .get(id)
                    .is_some_and(|r| r.data.peer_incarnation == known)
                {
                    self.fail_room(id, FailCode::PeerRestarted, "prefill restarted", false);
                }
            }
            self.set_session(Session::Idle {
                retry_at: Instant::now(),
            });
            if !matches!(decoded, Decoded::Message(Message::Reject { .. })) {
                return;
            }
        }
        let msg = match decoded {
            Decoded::Chunk(c) => {
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
                if let Session::AuthSent {
                    peer_incarnation, ..
                } = self.session
                    && env.incarnation == peer_incarnation
                {
                    self.metrics.kv.handshake("ok");
                    tracing::info!(peer = %self.addr, peer_incarnation = %format!("{peer_incarnation:016x}"), "prefill authenticated");
                    self.shared
                        .peer_incarnation
                        .store(peer_incarnation, Ordering::Relaxed);
                    self.shared.mark_pong();
                    self.set_session(Session::Established { peer_incarnation });
                    self.send_bootstrapped_rooms();
                }
            }
            Message::Reject { reason, text } => {
                self.metrics.kv.handshake(reason.label());
                tracing::warn!(peer = %self.addr, peer_incarnation = %format!("{:016x}", env.incarnation), reason = reason.label(), %text, "prefill refused us");
                self.set_session(Session::Idle {
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
                if matches!(self.session, Session::Established { .. }) {
                    self.shared.mark_pong();
                }
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

    fn on_welcome(&mut self, env: &Envelope) {
        let Session::HelloSent { init, .. } = &self.session else {
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
                    self.set_session(Session::AuthSent {
                        peer_incarnation: peer.peer_incarnation,
                        at: Instant::now(),
                    });
                }
            }
            Err((reason, text)) => {
                self.metrics.kv.handshake(reason.label());
                tracing::warn!(peer = %self.addr, peer_incarnation = %format!("{:016x}", env.incarnation), reason = reason.label(), %text, "refusing the prefill");
                self.send(0, Message::Reject { reason, text });
                self.set_session(Session::Idle {
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
            payload: r.data.asm.into_payload(),
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
                Session::Established { peer_incarnation } => Some(peer_incarnation),
                _ => None,
            };
            let data = DecodeRoom {
                reply,
                kv,
                prompt_len: req.tokens.len(),
                req: Some(req),
                asm: Assembler::with_pool(self.pool.clone()),
                peer_incarnation: est.unwrap_or(0),
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

    fn send_prefill(&mut self, room: u64) {
        let Session::Established { peer_incarnation } = self.session else {
            return;
        };
        let Some(r) = self.rooms.get_mut(room) else {
            return;
        };
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
            Session::Idle { retry_at } if now >= *retry_at => {
                let init = Initiator::new(rand::random());
                let hello = init.hello(&self.local);
                if self.send(0, hello) {
                    self.set_session(Session::HelloSent { init, at: now });
                } else {
                    self.set_session(Session::Idle {
                        retry_at: now + Duration::from_millis(200),
                    });
                }
            }
            Session::HelloSent { at, .. } | Session::AuthSent { at, .. }
                if now.duration_since(*at) >= self.timings.bootstrap_timeout =>
            {
                self.metrics.kv.handshake("timeout");
                tracing::warn!(peer = %self.addr, "handshake timed out; retrying");
                self.set_session(Session::Idle { retry_at: now });
            }
            Session::Established { .. } => {
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
