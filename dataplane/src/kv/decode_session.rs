//! The decode's session with one prefill, as a pure state machine: [`DecodeSession::on`]
//! takes one event and the time, and returns what to do ([`DecodeEffect`]). No socket,
//! channel, clock, thread, counter or log here: the loop (`pd::dealer_loop`) reads the
//! socket and the clock, turns what happened into events, carries out the effects, and
//! counts and logs the [`DecodeNote`]s. So the handshake, the heartbeat deadlines,
//! incarnation fencing and failure pushing are tested without sockets.
//!
//! What the session does:
//! - **Handshake**, by itself, whenever it has no session: HELLO, then the prefill's
//!   WELCOME is checked (compatibility, its proof of the group key) and answered with AUTH,
//!   then ACCEPTED establishes the session. A refusal either way, a handshake past the
//!   bootstrap timeout or an unreachable prefill ends the attempt with a reason (the
//!   status's refusal, which `/ready` shows) and a new one starts: at once, after 200 ms
//!   when unreachable, after a probe period after a refusal. A WELCOME that answers an
//!   earlier HELLO of this decode (the prefill read several at once after a pause) is
//!   recognised and dropped, not refused as a failed proof.
//! - **Heartbeat and channel deadline**: a PING every channel heartbeat (a quarter of the
//!   channel deadline, at most a probe period) while established. Any message from the
//!   prefill answers it. A PING left unanswered for the channel deadline ends the session
//!   as `peer_unresponsive`: every room sent there fails with that reason (FAILED pushed),
//!   rooms not yet sent fail too, and until a handshake succeeds again every new room
//!   fails at once. The deadline counts from the first PING sent after the last message
//!   heard, never from the last message itself: a decode that was itself paused (stopped,
//!   starved) PINGs first and then waits, so its own pause is not taken for the prefill's.
//!   The status's last PONG is what `/ready` measures against the liveness window.
//! - **Incarnation fencing**: a message from another prefill incarnation than the one this
//!   session authenticated fails every room sent to the old one (`peer_restarted`) and
//!   starts a new handshake; a REJECT from the new one is still read. Rooms only ever
//!   reach the incarnation they were sent to.
//! - **Rooms**: an HTTP request opens one; it waits for the session (`Bootstrap`), goes out
//!   as PREFILL within the send budget, waits for KV (refreshed by PROGRESS), receives and
//!   reassembles the chunks (acknowledged by CREDIT), and ends on DONE. A client that left
//!   aborts it (ABORT, then the KV buffer is released on ABORT_ACK or its deadline). Every
//!   room ends exactly once, with a reason ([`RoomEnd`]); a failure the prefill should know
//!   of is pushed to it at once (FAILED).
//! - **Connection lost** (the socket monitor saw the TCP connection close): the rooms sent
//!   there fail at once with `peer_lost`, and the session ends until a handshake succeeds.
//! - **No room outlives the channel deadline without a session**: a room not yet sent
//!   (opened just before the session ended, or after, by a request that picked the peer
//!   while it was still established) waits for a new session at most the channel deadline,
//!   counted from the later of its opening and the session's end, then fails with the
//!   reason the session ended (`peer_lost`, `peer_restarted`, ...). A link that comes back
//!   at once still serves it; a dead prefill never holds it for the bootstrap timeout.

mod events;
mod heartbeat;
mod rooms;

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub use events::{
    ChannelState, DecodeEffect, DecodeEvent, DecodeNote, DecodeStatus, Refusal, RefusedBy, RoomEnd,
};
use rooms::DecodeRoom;

use super::auth::{GroupKey, Initiator, LocalIdentity};
use super::chunks::BufferPool;
use super::room::{Deadlines, RoomState, RoomTable};
use super::{DecodeError, Decoded, FailCode, Header, Message, MsgType, PdTimings, RejectReason};

/// How long to wait before handshaking again with a prefill that no connection reaches.
pub const UNREACHABLE_RETRY: Duration = Duration::from_millis(200);
/// Earlier handshake attempts remembered (their HELLO went out, then the attempt ended),
/// so that a late WELCOME answering one of them is told apart from a failed proof of the
/// key or an unexpected message.
const STALE_ATTEMPTS: usize = 4;

/// What a [`DecodeSession`] is made with.
#[derive(Debug, Clone)]
pub struct DecodeConfig {
    /// The prefill's `host:port` (for messages).
    pub addr: String,
    pub local: LocalIdentity,
    pub key: GroupKey,
    pub timings: PdTimings,
    /// Upper bound of one prompt token's KV bytes, to refuse oversized KV.
    pub per_token: u64,
    /// Most PREFILL bytes outstanding (sent, not yet answered) to this prefill.
    pub send_budget: u64,
    /// Reassembly buffers, shared by every peer's session.
    pub pool: BufferPool,
    /// Seed of the handshake and PING nonces (`None`: a random one).
    pub seed: Option<u64>,
}

/// The handshake's progress.
#[derive(Debug, Clone)]
enum Handshake {
    Idle { retry_at: Instant },
    HelloSent { init: Initiator, at: Instant },
    AuthSent { peer_incarnation: u64, at: Instant },
    Established { peer_incarnation: u64 },
}

/// The decode's session with one prefill (see the module header).
pub struct DecodeSession {
    c: DecodeConfig,
    rng: StdRng,
    /// PING timestamps count from here.
    base: Instant,
    /// The prefill incarnation `/ready` names: the last one this session authenticated.
    peer_incarnation: u64,
    handshake: Handshake,
    rooms: RoomTable<DecodeRoom>,
    last_ping: Option<(u64, Instant)>,
    last_pong: Option<Instant>,
    /// The first PING sent since the last message heard from the established prefill:
    /// the channel deadline counts from here (`None`: nothing unanswered).
    unanswered_since: Option<Instant>,
    /// The session ended because the prefill stopped answering (the deadline passed);
    /// until a handshake succeeds again, new rooms fail at once.
    unresponsive: bool,
    /// Handshake attempts ended since the last session, whose WELCOME may still come
    /// (newest last).
    stale_attempts: std::collections::VecDeque<Initiator>,
    /// The incarnation of the last prefill authenticated, kept across a closed connection
    /// so that a replacement process is still counted and logged as a restart.
    last_authenticated: Option<u64>,
    peer_draining: bool,
    /// When the last session ended (or this one began, before any) and why: rooms waiting
    /// for a session fail with that reason once they waited the channel deadline past it.
    session_down: (Instant, FailCode),
    last_refusal: Option<Refusal>,
    /// KV chunk data bytes received in this session; a CREDIT is due when it grew.
    consumed: u64,
    credit_due: bool,
    stopped: bool,
    out: Vec<DecodeEffect>,
}

impl DecodeSession {
    pub fn new(c: DecodeConfig, now: Instant) -> Self {
        let rng = match c.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let deadlines = Deadlines::new(c.timings.bootstrap_timeout, c.timings.kv_timeout);
        Self {
            c,
            rng,
            base: now,
            peer_incarnation: 0,
            handshake: Handshake::Idle { retry_at: now },
            rooms: RoomTable::new(deadlines, 65_536),
            last_ping: None,
            last_pong: None,
            unanswered_since: None,
            unresponsive: false,
            stale_attempts: std::collections::VecDeque::new(),
            last_authenticated: None,
            peer_draining: false,
            session_down: (now, FailCode::NoPeer),
            last_refusal: None,
            consumed: 0,
            credit_due: false,
            stopped: false,
            out: Vec::new(),
        }
    }

    /// Take one event at `now`; returns what to do, in order.
    pub fn on(&mut self, event: DecodeEvent<'_>, now: Instant) -> Vec<DecodeEffect> {
        match event {
            DecodeEvent::Tick => self.tick(now),
            DecodeEvent::Received(h, d) => self.received(h, d, now),
            DecodeEvent::Undecodable(e) => self.undecodable(e, now),
            DecodeEvent::Disconnected { endpoint } => self.disconnected(endpoint, now),
            DecodeEvent::Open { room, req } => self.open(room, req, now),
            DecodeEvent::ClientGone { room } => self.client_gone(room, now),
            DecodeEvent::SendFailed { room, msg } => self.send_failed(room, msg, now),
            DecodeEvent::Stop => self.stop(FailCode::Shutdown, now),
            DecodeEvent::Reset => self.stop(FailCode::Reset, now),
            DecodeEvent::Panicked { message } => {
                for id in self.rooms.ids() {
                    self.fail_room(id, FailCode::LoopPanic, &message, true);
                }
            }
        }
        std::mem::take(&mut self.out)
    }

    pub fn status(&self) -> DecodeStatus<'_> {
        let state = match self.handshake {
            Handshake::Established { .. } => ChannelState::Established,
            Handshake::Idle { .. } => ChannelState::Idle,
            _ => ChannelState::Handshaking,
        };
        let block = self.c.local.layout.block_size.max(1) as usize;
        DecodeStatus {
            state,
            peer_incarnation: self.peer_incarnation,
            peer_draining: self.peer_draining,
            unresponsive: self.unresponsive,
            last_pong: self.last_pong,
            rooms: self.rooms.len(),
            blocks_held: self
                .rooms
                .iter()
                .filter(|(_, r)| matches!(r.state, RoomState::Transferring | RoomState::Aborting))
                .map(|(_, r)| r.data.prompt_len.div_ceil(block))
                .sum(),
            last_refusal: self.last_refusal.as_ref(),
        }
    }

    /// Whether `room` is open (not yet ended).
    pub fn has_room(&self, room: u64) -> bool {
        self.rooms.get(room).is_some()
    }

    fn send(&mut self, room: u64, msg: Message) {
        self.out.push(DecodeEffect::Send { room, msg });
    }

    fn note(&mut self, n: DecodeNote) {
        self.out.push(DecodeEffect::Note(n));
    }

    fn refused(&mut self, reason: &str, message: String, now: Instant) {
        self.last_refusal = Some(Refusal {
            reason: reason.to_owned(),
            message,
            at: now,
        });
    }

    fn established(&self) -> Option<u64> {
        match self.handshake {
            Handshake::Established { peer_incarnation } => Some(peer_incarnation),
            _ => None,
        }
    }

    /// The prefill incarnation this session has heard from in the handshake or since.
    fn known_incarnation(&self) -> Option<u64> {
        match self.handshake {
            Handshake::AuthSent {
                peer_incarnation, ..
            }
            | Handshake::Established { peer_incarnation } => Some(peer_incarnation),
            _ => None,
        }
    }

    /// Note why there is no session (`code`, the reason rooms still waiting for one fail
    /// with): from `now` if a session was established, else since the last one ended.
    fn session_ended(&mut self, code: FailCode, now: Instant) {
        let since = match self.established() {
            Some(_) => now,
            None => self.session_down.0,
        };
        self.session_down = (since, code);
    }

    /// End the handshake attempt (or the session) and try again at `at`. An attempt whose
    /// HELLO went out is remembered: its WELCOME may still come (a paused prefill reads
    /// every HELLO at once when it resumes), and is then dropped as stale, not taken for
    /// a forgery or an unexpected message.
    fn retry(&mut self, at: Instant) {
        let ended = std::mem::replace(&mut self.handshake, Handshake::Idle { retry_at: at });
        if let Handshake::HelloSent { init, .. } = ended {
            if self.stale_attempts.len() == STALE_ATTEMPTS {
                self.stale_attempts.pop_front();
            }
            self.stale_attempts.push_back(init);
        }
    }

    fn tick(&mut self, now: Instant) {
        if self.stopped {
            return;
        }
        if self.credit_due && self.established().is_some() {
            self.credit_due = false;
            self.send(
                0,
                Message::Credit {
                    consumed: self.consumed,
                },
            );
        }
        self.drive_handshake(now);
        self.expire_unserved(now);
        self.expire(now);
    }

    fn drive_handshake(&mut self, now: Instant) {
        match &self.handshake {
            Handshake::Idle { retry_at } if now >= *retry_at => {
                let init = Initiator::new(self.rng.random());
                let hello = init.hello(&self.c.local);
                self.send(0, hello);
                self.handshake = Handshake::HelloSent { init, at: now };
            }
            Handshake::HelloSent { at, .. } | Handshake::AuthSent { at, .. }
                if now.duration_since(*at) >= self.c.timings.bootstrap_timeout =>
            {
                let since_hello = now.duration_since(*at);
                self.note(DecodeNote::HandshakeFailed {
                    result: "timeout",
                    by: None,
                    peer_incarnation: 0,
                    text: format!("no answer within {} ms", since_hello.as_millis()),
                });
                // A refusal seen during this attempt (an unreadable answer: another
                // protocol version) says more than the timeout it led to: keep it. So
                // does `peer_unresponsive` while the prefill that stopped answering goes
                // on not answering.
                let explained = self.unresponsive
                    || self
                        .last_refusal
                        .as_ref()
                        .is_some_and(|r| now.duration_since(r.at) <= since_hello);
                if !explained {
                    let message = format!(
                        "no handshake answer from {} within {} ms",
                        self.c.addr,
                        self.c.timings.bootstrap_timeout.as_millis()
                    );
                    self.refused("handshake_timeout", message, now);
                }
                self.retry(now);
            }
            Handshake::Established { peer_incarnation } => {
                let peer_incarnation = *peer_incarnation;
                self.heartbeat(peer_incarnation, now);
            }
            _ => {}
        }
    }

    fn send_failed(&mut self, room: u64, msg: MsgType, now: Instant) {
        match msg {
            // No connection to send on (the DEALER queues only on live ones).
            MsgType::Hello | MsgType::Auth => {
                if matches!(
                    self.handshake,
                    Handshake::HelloSent { .. } | Handshake::AuthSent { .. }
                ) {
                    let known = self.last_refusal.as_ref().map(|r| r.reason.as_str());
                    if known != Some("peer_unreachable") {
                        let message = format!("no connection to the prefill at {}", self.c.addr);
                        self.refused("peer_unreachable", message, now);
                    }
                    self.retry(now + UNREACHABLE_RETRY);
                }
            }
            MsgType::Credit => self.credit_due = true,
            MsgType::Prefill => self.fail_room(
                room,
                FailCode::SendFailed,
                "PREFILL could not be sent",
                false,
            ),
            // The rest is best effort (PING, ABORT, FAILED, REJECT, GOODBYE): a lost PING is
            // a PONG that does not come, a lost ABORT an ack that does not.
            _ => {}
        }
    }

    fn undecodable(&mut self, e: &DecodeError, now: Instant) {
        self.note(DecodeNote::Malformed {
            kind: e.kind(),
            detail: e.to_string(),
        });
        if let DecodeError::WrongVersion { got, want, .. } = e {
            let reason = RejectReason::VersionMismatch.label();
            self.note(DecodeNote::HandshakeFailed {
                result: reason,
                by: Some(RefusedBy::Us),
                peer_incarnation: 0,
                text: format!("protocol version {got}"),
            });
            let message = format!("the prefill speaks protocol version {got}, this decode {want}");
            self.refused(reason, message, now);
        }
    }

    /// The TCP connection closed: the rooms sent there fail now with `peer_lost` (their KV
    /// will not arrive on this connection); rooms not yet sent stay queued. The session
    /// ends too, and a handshake is tried at once (then every 200 ms while unreachable).
    fn disconnected(&mut self, endpoint: String, now: Instant) {
        let lost: Vec<u64> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.data.sent() && r.state != RoomState::Aborting)
            .map(|(id, _)| id)
            .collect();
        self.note(DecodeNote::Disconnected {
            endpoint,
            peer_incarnation: self.last_authenticated.unwrap_or(0),
            rooms_failed: lost.len(),
        });
        self.session_ended(FailCode::PeerLost, now);
        // Not ready before the rooms' clients hear of it, and saying why (not an older
        // refusal, which `/ready` would show until the next attempt says more).
        if !matches!(self.handshake, Handshake::Idle { .. }) {
            let message = format!("the connection to the prefill at {} closed", self.c.addr);
            self.refused(FailCode::PeerLost.label(), message, now);
            self.retry(now);
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

    fn received(&mut self, h: Header, d: Decoded<'_>, now: Instant) {
        // A new prefill incarnation invalidates everything about the old one.
        if let Some(known) = self.known_incarnation()
            && h.incarnation != known
        {
            self.note(DecodeNote::PeerRestarted {
                old: known,
                new: h.incarnation,
            });
            self.last_authenticated = Some(h.incarnation);
            let message = format!(
                "prefill incarnation changed from {known:016x} to {:016x}",
                h.incarnation
            );
            self.refused(FailCode::PeerRestarted.label(), message, now);
            self.session_ended(FailCode::PeerRestarted, now);
            self.fail_rooms_not_of(h.incarnation);
            self.retry(now);
            if !matches!(d, Decoded::Message(Message::Reject { .. })) {
                return;
            }
        }
        if self.established() == Some(h.incarnation) {
            // Any message proves the prefill's socket loop alive: the PING is answered.
            self.unanswered_since = None;
        }
        let msg = match d {
            Decoded::Chunk(c) => {
                // Every chunk this session received counts for the CREDIT, whether its
                // room is still wanted or not: the prefill spent budget on it either way.
                if self.established().is_some() {
                    self.consumed += c.data.len() as u64;
                    self.credit_due = true;
                }
                self.chunk(h.room, c, now);
                return;
            }
            Decoded::Message(m) => m,
        };
        match msg {
            Message::Welcome { .. } => self.welcome(&h, &msg, now),
            Message::Accepted => self.accepted(&h, now),
            Message::Reject { reason, text } => {
                self.note(DecodeNote::HandshakeFailed {
                    result: reason.label(),
                    by: Some(RefusedBy::Peer),
                    peer_incarnation: h.incarnation,
                    text: text.clone(),
                });
                self.refused(
                    reason.label(),
                    format!("the prefill refused us: {text}"),
                    now,
                );
                self.retry(now + self.c.timings.probe_period);
            }
            Message::Pong { nonce, .. } => {
                if let Some((n, at)) = self.last_ping
                    && n == nonce
                {
                    self.note(DecodeNote::PongRtt(now.duration_since(at)));
                }
                if self.established().is_some() {
                    self.last_pong = Some(now);
                }
            }
            Message::Progress { .. } => self.progress(h.room, now),
            Message::Goodbye {
                reason: FailCode::Reset,
                text,
            } => {
                // The prefill resets in place: its rooms fail (`reset`, pushed next) and it
                // is back in a moment, at a new group incarnation and with a new process
                // incarnation. Not draining: handshake again shortly (the old socket closes
                // within that; the new prefill refuses this decode as `incarnation_mismatch`
                // until it is reset to the same group incarnation too).
                self.note(DecodeNote::PeerLeaving {
                    peer_incarnation: h.incarnation,
                    reason: FailCode::Reset,
                    text: text.clone(),
                });
                self.refused(
                    FailCode::Reset.label(),
                    format!("the prefill is resetting: {text}"),
                    now,
                );
                self.session_ended(FailCode::Reset, now);
                self.retry(now + UNREACHABLE_RETRY);
            }
            Message::Goodbye { reason, text } => {
                self.note(DecodeNote::PeerLeaving {
                    peer_incarnation: h.incarnation,
                    reason,
                    text: text.clone(),
                });
                self.peer_draining = true;
                self.refused(
                    FailCode::PeerShutdown.label(),
                    format!("the prefill said goodbye: {text}"),
                    now,
                );
                self.session_ended(FailCode::PeerShutdown, now);
                // Rooms in flight finish by their own messages; a new handshake is tried
                // (and refused until the prefill is gone or replaced).
                self.retry(now + self.c.timings.probe_period);
            }
            Message::Done {
                first_token,
                prompt_tokens,
                logprob,
            } => self.done(h.room, first_token, prompt_tokens, logprob),
            Message::Failed { reason, text } => {
                if self
                    .rooms
                    .get(h.room)
                    .is_some_and(|r| r.state != RoomState::Aborting)
                {
                    // The prefill failing a room because it shuts down is, seen from here,
                    // the peer shutting down.
                    let reason = match reason {
                        FailCode::Shutdown => FailCode::PeerShutdown,
                        r => r,
                    };
                    self.fail_room(h.room, reason, &text, false);
                }
            }
            Message::AbortAck => {
                // The KV buffer is released only now: the prefill stopped writing it.
                if self.rooms.abort_acked(h.room).is_some() {
                    self.out.push(DecodeEffect::RoomEnded {
                        room: h.room,
                        end: RoomEnd::Aborted {
                            reason: "client_abort",
                            acked: true,
                        },
                    });
                }
            }
            other => self.note(DecodeNote::Unexpected {
                msg_type: other.msg_type(),
            }),
        }
    }

    fn welcome(&mut self, h: &Header, msg: &Message, now: Instant) {
        let Handshake::HelloSent { init, .. } = &self.handshake else {
            let note = if self.answers_stale_attempt(h, msg) {
                DecodeNote::StaleWelcome {
                    peer_incarnation: h.incarnation,
                }
            } else {
                DecodeNote::Unexpected {
                    msg_type: MsgType::Welcome,
                }
            };
            self.note(note);
            return;
        };
        match init.on_welcome(
            &self.c.local,
            &self.c.key,
            h.incarnation,
            h.group_incarnation,
            msg,
        ) {
            Ok((auth, peer)) => {
                self.send(0, auth);
                self.handshake = Handshake::AuthSent {
                    peer_incarnation: peer.peer_incarnation,
                    at: now,
                };
            }
            Err((RejectReason::AuthFailed, _)) if self.answers_stale_attempt(h, msg) => {
                // The answer to an earlier HELLO: the prefill proved the key over that
                // HELLO's nonce. This attempt's own WELCOME follows.
                self.note(DecodeNote::StaleWelcome {
                    peer_incarnation: h.incarnation,
                });
            }
            Err((reason, text)) => {
                self.note(DecodeNote::HandshakeFailed {
                    result: reason.label(),
                    by: Some(RefusedBy::Us),
                    peer_incarnation: h.incarnation,
                    text: text.clone(),
                });
                self.refused(
                    reason.label(),
                    format!("we refused the prefill: {text}"),
                    now,
                );
                self.send(0, Message::Reject { reason, text });
                self.retry(now + self.c.timings.probe_period);
            }
        }
    }

    fn accepted(&mut self, h: &Header, now: Instant) {
        let Handshake::AuthSent {
            peer_incarnation, ..
        } = self.handshake
        else {
            return;
        };
        if h.incarnation != peer_incarnation {
            return;
        }
        // A new process met after the connection closed (the session had already ended,
        // so the fencing above did not see the change).
        let replaced = self
            .last_authenticated
            .filter(|&old| old != peer_incarnation);
        self.note(DecodeNote::Authenticated {
            peer_incarnation,
            replaced,
        });
        self.last_authenticated = Some(peer_incarnation);
        self.peer_incarnation = peer_incarnation;
        self.peer_draining = false;
        self.last_pong = Some(now);
        self.unanswered_since = None;
        self.unresponsive = false;
        self.stale_attempts.clear();
        self.consumed = 0;
        self.credit_due = false;
        self.handshake = Handshake::Established { peer_incarnation };
        self.fail_rooms_not_of(peer_incarnation);
        let waiting: Vec<u64> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.state == RoomState::Bootstrap)
            .map(|(id, _)| id)
            .collect();
        for id in waiting {
            self.send_prefill(id, now);
        }
    }

    /// Fail the rooms sent to another prefill incarnation than `current`.
    fn fail_rooms_not_of(&mut self, current: u64) {
        let stale: Vec<u64> = self
            .rooms
            .iter()
            .filter(|(_, r)| {
                r.data.sent()
                    && r.data.peer_incarnation != current
                    && r.state != RoomState::Aborting
            })
            .map(|(id, _)| id)
            .collect();
        for id in stale {
            self.fail_room(id, FailCode::PeerRestarted, "prefill restarted", false);
        }
    }

    /// The process is stopping (`why`: `shutdown`) or resetting in place (`reset`): fail
    /// every room left with `why` (pushing FAILED for those the prefill knows), say GOODBYE
    /// so the prefill drops this session at once, and make no new attempt.
    fn stop(&mut self, why: FailCode, now: Instant) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let text = match why {
            FailCode::Reset => "the decode is resetting in place to a new group incarnation",
            _ => "the decode is shutting down",
        };
        for id in self.rooms.ids() {
            if self
                .rooms
                .get(id)
                .is_some_and(|r| r.state == RoomState::Aborting)
            {
                self.rooms.finish(id, RoomState::Aborted);
                self.out.push(DecodeEffect::RoomEnded {
                    room: id,
                    end: RoomEnd::Aborted {
                        reason: why.label(),
                        acked: false,
                    },
                });
                continue;
            }
            self.fail_room(id, why, text, true);
        }
        if self.established().is_some() {
            self.send(
                0,
                Message::Goodbye {
                    reason: why,
                    text: text.into(),
                },
            );
        }
        self.retry(now + Duration::from_secs(3600));
        self.note(DecodeNote::Stopped);
    }
}
