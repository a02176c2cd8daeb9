//! The prefill's sessions with its decodes, as a pure state machine:
//! [`PrefillSession::on`] takes one event and the time, and returns what to do
//! ([`PrefillEffect`]). The loop (`pd::router_loop`) owns the ROUTER socket, the engine
//! handle and the clock; it turns messages, engine events and timers into events, carries
//! out the effects (sends, engine submissions, KV streams), and counts and logs the
//! [`PrefillNote`]s.
//!
//! What the session does:
//! - **Authenticates** every decode (HELLO → WELCOME with our proof → AUTH checked →
//!   ACCEPTED); an unauthenticated peer gets no state beyond a bounded, short-lived
//!   pending handshake, and every message from it is refused (REJECT), naming
//!   `peer_expired` when this prefill dropped its session earlier.
//! - **Fences incarnations**: the same peer with another process incarnation drops the old
//!   session and its rooms (`peer_restarted`); a message of another group incarnation is
//!   refused.
//! - **Runs rooms**: a PREFILL becomes an engine submission (one token, KV exported from
//!   the decode's cached prefix on); while the engine goes round, PROGRESS keeps the
//!   decode's deadline fresh; the KV and DONE go out within the decode's send budget
//!   (CREDIT acknowledges); every room ends exactly once with a reason ([`RoomEnd`]), and a
//!   failure is pushed to the decode at once (FAILED). ABORT is always acknowledged.
//! - **Drops sessions** that went silent (session expiry), restarted, said GOODBYE, or no
//!   longer fit the session table, with their rooms; on drain it says GOODBYE and takes
//!   no new work; on stop it fails what is left.

mod events;
mod rooms;

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub use events::{
    DropReason, EngineRequest, EngineUpdate, LastRefusal, PrefillEffect, PrefillEvent, PrefillNote,
    RoomEnd, SessionReport,
};
use rooms::PrefillRoom;

use super::auth::{self, GroupKey, LocalIdentity, Pending};
use super::room::{Deadlines, RoomTable};
use super::{DecodeError, Envelope, FailCode, Message, PROTOCOL_VERSION, PdTimings, RejectReason};

/// Most handshakes waiting for AUTH; the oldest is dropped beyond this (an
/// unauthenticated peer gets bounded, short-lived state only).
pub const MAX_PENDING: usize = 256;
/// Most authenticated decode sessions; the longest-silent one makes room beyond this.
pub const MAX_SESSIONS: usize = 1024;
/// Dropped sessions remembered, so a decode that comes back is told why (`peer_expired`).
const DROPPED_REMEMBERED: usize = 1024;

/// A decode, by its ZeroMQ routing id.
pub type PeerId = Vec<u8>;

/// What a [`PrefillSession`] is made with.
#[derive(Debug, Clone)]
pub struct PrefillConfig {
    pub local: LocalIdentity,
    pub key: GroupKey,
    pub timings: PdTimings,
    /// Most KV bytes in flight to one decode (sent, not yet acknowledged).
    pub send_budget: u64,
    /// Seed of the handshake nonces (`None`: a random one).
    pub seed: Option<u64>,
}

/// The prefill's session with one authenticated decode.
#[derive(Debug)]
struct Session {
    incarnation: u64,
    last_seen: Instant,
    /// KV chunk data bytes handed to ZeroMQ for this decode, and the part it acknowledged.
    sent: u64,
    acked: u64,
    last_failure: Option<(String, String, Instant)>,
}

impl Session {
    fn in_flight(&self) -> u64 {
        self.sent.saturating_sub(self.acked)
    }
}

/// The prefill's sessions and rooms (see the module header).
pub struct PrefillSession {
    c: PrefillConfig,
    rng: StdRng,
    pending: HashMap<PeerId, (Pending, Instant)>,
    sessions: HashMap<PeerId, Session>,
    /// Recently dropped sessions and why, oldest first (bounded).
    dropped: HashMap<PeerId, DropReason>,
    dropped_order: VecDeque<PeerId>,
    session_expiry: Duration,
    /// Least time between two PROGRESS of one room.
    progress_every: Duration,
    rooms: RoomTable<PrefillRoom>,
    draining: bool,
    stopped: bool,
    last_refusal: LastRefusal,
    out: Vec<PrefillEffect>,
}

impl PrefillSession {
    pub fn new(c: PrefillConfig) -> Self {
        let t = c.timings;
        let rng = match c.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Self {
            rng,
            pending: HashMap::new(),
            sessions: HashMap::new(),
            dropped: HashMap::new(),
            dropped_order: VecDeque::new(),
            session_expiry: t.session_expiry(),
            progress_every: t
                .probe_period
                .min(t.kv_timeout / 4)
                .max(Duration::from_millis(50)),
            rooms: RoomTable::new(Deadlines::new(t.bootstrap_timeout, t.kv_timeout), 65_536),
            draining: false,
            stopped: false,
            last_refusal: None,
            out: Vec::new(),
            c,
        }
    }

    /// Take one event at `now`; returns what to do, in order.
    pub fn on(&mut self, event: PrefillEvent<'_>, now: Instant) -> Vec<PrefillEffect> {
        match event {
            PrefillEvent::Tick { engine_live } => {
                if !self.stopped {
                    if engine_live {
                        self.keep_alive(now);
                    }
                    self.expire(now);
                }
            }
            PrefillEvent::Received { peer, env } => self.received(peer, env, now),
            PrefillEvent::Undecodable { peer, error } => {
                self.note(PrefillNote::Malformed {
                    peer: peer.to_vec(),
                    kind: error.kind(),
                    detail: error.to_string(),
                });
                if let DecodeError::WrongVersion { got, .. } = error {
                    let text =
                        format!("protocol version {got}, this prefill speaks {PROTOCOL_VERSION}");
                    self.reject(peer, RejectReason::VersionMismatch, text, true, now);
                }
            }
            PrefillEvent::Engine { room, update } => self.engine(room, update, now),
            PrefillEvent::SubmitFailed { room, message } => {
                self.fail_room(room, FailCode::Overloaded, &message, now)
            }
            PrefillEvent::Streamed { room, sent, failed } => self.streamed(room, sent, failed, now),
            PrefillEvent::Drain => self.begin_drain(FailCode::Shutdown),
            PrefillEvent::Stop => self.stop(FailCode::Shutdown, now),
            PrefillEvent::Reset => self.stop(FailCode::Reset, now),
            PrefillEvent::Panicked { message } => {
                for id in self.rooms.ids() {
                    self.fail_room(id, FailCode::LoopPanic, &message, now);
                }
            }
        }
        std::mem::take(&mut self.out)
    }

    /// Rooms not yet ended.
    pub fn rooms_open(&self) -> usize {
        self.rooms.len()
    }

    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// KV bytes sent and not yet acknowledged, over every session.
    pub fn bytes_in_flight(&self) -> u64 {
        self.sessions.values().map(Session::in_flight).sum()
    }

    /// The `n` most recently seen decode sessions, most recent first.
    pub fn report(&self, n: usize, now: Instant) -> Vec<SessionReport> {
        let mut recent: Vec<(&PeerId, &Session)> = self.sessions.iter().collect();
        recent.sort_by_key(|(_, s)| std::cmp::Reverse(s.last_seen));
        recent
            .into_iter()
            .take(n)
            .map(|(peer, s)| SessionReport {
                peer: peer.clone(),
                incarnation: s.incarnation,
                rooms: self
                    .rooms
                    .iter()
                    .filter(|(_, r)| &r.data.peer == peer)
                    .count(),
                silent: now.saturating_duration_since(s.last_seen),
                bytes_in_flight: s.in_flight(),
                last_failure: s.last_failure.clone(),
            })
            .collect()
    }

    pub fn last_refusal(&self) -> &LastRefusal {
        &self.last_refusal
    }

    fn note(&mut self, n: PrefillNote) {
        self.out.push(PrefillEffect::Note(n));
    }

    fn send(&mut self, peer: &[u8], room: u64, msg: Message) {
        self.out.push(PrefillEffect::Send {
            peer: peer.to_vec(),
            room,
            msg,
        });
    }

    /// Refuse `peer` with `reason` (REJECT, and remembered for `/ready`).
    fn reject(
        &mut self,
        peer: &[u8],
        reason: RejectReason,
        text: String,
        count: bool,
        now: Instant,
    ) {
        self.note(PrefillNote::Refused {
            peer: peer.to_vec(),
            reason,
            text: text.clone(),
            counted: count,
        });
        self.last_refusal = Some((peer.to_vec(), reason.label().into(), text.clone(), now));
        self.send(peer, 0, Message::Reject { reason, text });
    }

    fn received(&mut self, peer: &[u8], env: Envelope, now: Instant) {
        match &env.msg {
            Message::Hello { .. } => self.hello(peer, &env, now),
            Message::Auth { .. } => self.auth(peer, &env, now),
            _ => self.session_message(peer, env, now),
        }
    }

    fn hello(&mut self, peer: &[u8], env: &Envelope, now: Instant) {
        if self.draining {
            let text = "this prefill is shutting down".to_string();
            self.reject(peer, RejectReason::ShuttingDown, text, true, now);
            return;
        }
        let nonce: [u8; 32] = self.rng.random();
        match auth::respond_hello(
            &self.c.local,
            &self.c.key,
            PROTOCOL_VERSION,
            env.incarnation,
            env.group_incarnation,
            &env.msg,
            nonce,
        ) {
            Ok((welcome, pending)) => {
                if self.pending.len() >= MAX_PENDING
                    && !self.pending.contains_key(peer)
                    && let Some(oldest) = self
                        .pending
                        .iter()
                        .min_by_key(|(_, (_, t))| *t)
                        .map(|(k, _)| k.clone())
                {
                    self.pending.remove(&oldest);
                }
                self.pending.insert(peer.to_vec(), (pending, now));
                self.send(peer, 0, welcome);
            }
            Err((reason, text)) => self.reject(peer, reason, text, true, now),
        }
    }

    fn auth(&mut self, peer: &[u8], env: &Envelope, now: Instant) {
        let Some((pending, _)) = self.pending.remove(peer) else {
            let text = "AUTH without HELLO".to_string();
            self.reject(peer, RejectReason::NotAuthenticated, text, true, now);
            return;
        };
        if let Err((reason, text)) =
            auth::check_auth(&self.c.key, &pending, env.incarnation, &env.msg)
        {
            self.reject(peer, reason, text, true, now);
            return;
        }
        // A decode that restarted comes back under a new routing id; its old rooms end by
        // their deadlines or by failed sends. The same routing id with a new incarnation
        // is invalidated here.
        if let Some(old) = self.sessions.get(peer)
            && old.incarnation != env.incarnation
        {
            self.drop_session(peer, DropReason::PeerRestarted, now);
        }
        if !self.sessions.contains_key(peer)
            && self.sessions.len() >= MAX_SESSIONS
            && let Some(oldest) = self
                .sessions
                .iter()
                .min_by_key(|(_, s)| s.last_seen)
                .map(|(k, _)| k.clone())
        {
            self.drop_session(&oldest, DropReason::Capacity, now);
        }
        self.dropped.remove(peer);
        self.sessions.insert(
            peer.to_vec(),
            Session {
                incarnation: env.incarnation,
                last_seen: now,
                sent: 0,
                acked: 0,
                last_failure: None,
            },
        );
        self.note(PrefillNote::Authenticated {
            peer: peer.to_vec(),
            incarnation: env.incarnation,
        });
        self.send(peer, 0, Message::Accepted);
    }

    /// Forget everything about one decode session: its rooms fail with the reason (FAILED
    /// is pushed to the peer, which may be gone), and the drop is noted once with the
    /// peer, its incarnation and the reason.
    fn drop_session(&mut self, peer: &[u8], why: DropReason, now: Instant) {
        let Some(old) = self.sessions.remove(peer) else {
            return;
        };
        let ids: Vec<u64> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.data.peer == peer && r.data.peer_incarnation == old.incarnation)
            .map(|(id, _)| id)
            .collect();
        let text = why.text(self.session_expiry);
        for &id in &ids {
            self.fail_room(id, why.code(), &text, now);
        }
        self.note(PrefillNote::SessionDropped {
            peer: peer.to_vec(),
            incarnation: old.incarnation,
            why,
            silent: now.saturating_duration_since(old.last_seen),
            rooms_failed: ids.len(),
            text: text.clone(),
        });
        self.last_refusal = Some((peer.to_vec(), why.label().into(), text, now));
        if self.dropped.insert(peer.to_vec(), why).is_none() {
            self.dropped_order.push_back(peer.to_vec());
        }
        while self.dropped_order.len() > DROPPED_REMEMBERED {
            if let Some(old) = self.dropped_order.pop_front() {
                self.dropped.remove(&old);
            }
        }
    }

    fn session_message(&mut self, peer: &[u8], env: Envelope, now: Instant) {
        let authed = match self.sessions.get_mut(peer) {
            Some(s) if s.incarnation == env.incarnation => {
                s.last_seen = now;
                true
            }
            Some(_) => {
                self.drop_session(peer, DropReason::PeerRestarted, now);
                false
            }
            None => false,
        };
        if let Message::Reject { reason, text } = &env.msg
            && !authed
        {
            // The decode refused our WELCOME (a wrong key, say): note why; never answer a
            // refusal with another one.
            self.pending.remove(peer);
            self.note(PrefillNote::RefusedByDecode {
                peer: peer.to_vec(),
                reason: *reason,
                text: text.clone(),
            });
            self.last_refusal = Some((
                peer.to_vec(),
                reason.label().into(),
                format!("the decode refused us: {text}"),
                now,
            ));
            return;
        }
        if !authed {
            // No state for unauthenticated peers; the REJECT (with our incarnation in its
            // header) tells a decode whose session we lost to handshake again, and why.
            self.note(PrefillNote::Dropped {
                peer: peer.to_vec(),
                kind: "unauthenticated",
            });
            let (reason, text) = match self.dropped.get(peer) {
                Some(why @ (DropReason::Expired | DropReason::Capacity)) => (
                    RejectReason::SessionExpired,
                    format!(
                        "this prefill dropped the session: {}",
                        why.text(self.session_expiry)
                    ),
                ),
                _ => (
                    RejectReason::NotAuthenticated,
                    format!("{:?} before a handshake", env.msg.msg_type()),
                ),
            };
            self.reject(peer, reason, text, false, now);
            return;
        }
        if env.group_incarnation != self.c.local.group_incarnation {
            self.note(PrefillNote::Dropped {
                peer: peer.to_vec(),
                kind: "group_incarnation",
            });
            let text = "group incarnation changed".to_string();
            self.reject(peer, RejectReason::IncarnationMismatch, text, false, now);
            return;
        }
        match env.msg {
            Message::Ping {
                nonce,
                timestamp_us,
            } => self.send(
                peer,
                0,
                Message::Pong {
                    nonce,
                    timestamp_us,
                },
            ),
            Message::Prefill(req) => self.prefill(peer, env.incarnation, env.room, req, now),
            Message::Credit { consumed } => {
                if let Some(s) = self.sessions.get_mut(peer) {
                    s.acked = consumed.min(s.sent).max(s.acked);
                }
            }
            Message::Goodbye { reason, text } => {
                self.note(PrefillNote::DecodeLeaving {
                    peer: peer.to_vec(),
                    reason,
                    text,
                });
                self.drop_session(peer, DropReason::PeerShutdown, now);
            }
            Message::Abort => {
                // Stop writing, then confirm; unknown or finished rooms are a no-op that
                // is still confirmed (we are not writing to them either).
                if self
                    .rooms
                    .get(env.room)
                    .is_some_and(|r| r.data.peer == peer)
                {
                    self.end_room(env.room, RoomEnd::Aborted, now);
                }
                self.send(peer, env.room, Message::AbortAck);
            }
            Message::Failed { reason, text } => {
                if self
                    .rooms
                    .get(env.room)
                    .is_some_and(|r| r.data.peer == peer)
                {
                    self.note(PrefillNote::FailedByDecode {
                        peer: peer.to_vec(),
                        room: env.room,
                        reason,
                        text,
                    });
                    let end = RoomEnd::Failed {
                        code: reason,
                        text: "failed by the decode".into(),
                    };
                    self.end_room(env.room, end, now);
                }
            }
            other => self.note(PrefillNote::Unexpected {
                peer: peer.to_vec(),
                msg_type: other.msg_type(),
            }),
        }
    }

    /// Drain begins: every decode hears GOODBYE (it stops sending new rooms here); new
    /// rooms and handshakes are refused from now on, rooms in flight go on. `why` is
    /// `shutdown`, or `reset` for an in-place reset (which stops at once after).
    fn begin_drain(&mut self, why: FailCode) {
        if self.draining {
            return;
        }
        self.draining = true;
        let peers: Vec<PeerId> = self.sessions.keys().cloned().collect();
        for peer in &peers {
            let msg = Message::Goodbye {
                reason: why,
                text: ending_text(why).into(),
            };
            self.send(peer, 0, msg);
        }
        self.note(PrefillNote::Draining {
            decodes: peers.len(),
            rooms: self.rooms.len(),
        });
    }

    /// Stop: every room left fails with `why` (pushed to its decode): `shutdown`, which the
    /// decode counts as `peer_shutdown`, or `reset`, which it counts as such.
    fn stop(&mut self, why: FailCode, now: Instant) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        self.begin_drain(why);
        let ids = self.rooms.ids();
        for &id in &ids {
            self.fail_room(id, why, ending_text(why), now);
        }
        self.note(PrefillNote::Stopped {
            rooms_failed: ids.len(),
        });
    }
}

/// What a prefill that ends its rooms and sessions for `why` tells its decodes.
fn ending_text(why: FailCode) -> &'static str {
    match why {
        FailCode::Reset => "this prefill is resetting in place to a new group incarnation",
        _ => "this prefill is shutting down",
    }
}
