//! The prefill's loop (`RouterLoop`): owns the ROUTER socket; authenticates decodes,
//! answers PINGs, runs each PREFILL through the local engine (chunked prefill, max_tokens 1,
//! KV export), keeps the decode informed while it works (PROGRESS), and streams the KV
//! chunks and DONE(first token) back within each decode's send budget (CREDIT). It drops
//! decode sessions that went silent, restarted, said goodbye, or no longer fit the session
//! table; on drain it says goodbye and takes no new work, on stop it fails what is left.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::error::TryRecvError;

use super::report::{PeerReport, Problem};
use super::settings::PdLimits;
use super::settings::PdTimings;
use super::supervise::{Lifecycle, LoopHealth, Phase, Supervised};
use super::wire::{self, hex_id};
use crate::kv::auth::{self, GroupKey, LocalIdentity, Pending};
use crate::kv::room::{Deadlines, RoomState, RoomTable};
use crate::kv::{
    DecodeError, Envelope, FailCode, Message, PROTOCOL_VERSION, PrefillRequest, RejectReason,
    WireLogprob, chunks, decode,
};
use crate::metrics::Metrics;
use crate::sampling::TokenLogprob;
use crate::scheduler::{EngineHandle, FailReason, GenEvent, GenerateRequest, Transfer};

/// Most handshakes waiting for AUTH; the oldest is dropped beyond this (rule 11 in
/// docs/architecture.md: an unauthenticated peer gets bounded, short-lived state only).
const MAX_PENDING: usize = 256;
/// Most authenticated decode sessions; the longest-silent one makes room beyond this.
pub(super) const MAX_SESSIONS: usize = 1024;
/// Dropped sessions remembered, so a decode that comes back is told why (`peer_expired`).
const DROPPED_REMEMBERED: usize = 1024;
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

/// The prefill's session with one authenticated decode.
struct RouterSession {
    incarnation: u64,
    last_seen: Instant,
    /// KV chunk data bytes handed to ZeroMQ for this decode, and the part it acknowledged.
    sent: u64,
    acked: u64,
    last_failure: Option<Problem>,
}

impl RouterSession {
    fn in_flight(&self) -> u64 {
        self.sent.saturating_sub(self.acked)
    }
}

/// One room as the prefill sees it.
struct RouterRoom {
    peer: Vec<u8>,
    peer_incarnation: u64,
    rx: tokio::sync::mpsc::Receiver<GenEvent>,
    prompt_tokens: u32,
    /// Prompt tokens the engine has prefilled so far.
    done_tokens: u32,
    last_progress_sent: Instant,
    first: Option<(u32, Option<TokenLogprob>)>,
    export: Option<Vec<u8>>,
}

pub(super) struct RouterLoop {
    _ctx: zmq::Context,
    sock: zmq::Socket,
    local: LocalIdentity,
    key: GroupKey,
    engine: EngineHandle,
    metrics: Arc<Metrics>,
    health: Arc<LoopHealth>,
    lifecycle: Arc<Lifecycle>,
    report: Arc<Mutex<RouterReport>>,
    rooms_open: Arc<AtomicUsize>,
    pending: HashMap<Vec<u8>, (Pending, Instant)>,
    sessions: HashMap<Vec<u8>, RouterSession>,
    /// Recently dropped sessions and why, oldest first (bounded).
    dropped: HashMap<Vec<u8>, DropReason>,
    dropped_order: VecDeque<Vec<u8>>,
    /// A session silent for this long is dropped with its rooms (`PdTimings::session_expiry`).
    session_expiry: Duration,
    limits: PdLimits,
    /// Least time between two PROGRESS of one room.
    progress_every: Duration,
    rooms: RoomTable<RouterRoom>,
    draining: bool,
    stopped: bool,
    last_refusal: Option<(String, Problem)>,
    last_report: Instant,
}

impl RouterLoop {
    pub(super) fn new(c: RouterConfig, health: Arc<LoopHealth>) -> Self {
        let t = c.timings;
        Self {
            _ctx: c.ctx,
            sock: c.sock,
            local: c.local,
            key: c.key,
            engine: c.engine,
            metrics: c.metrics,
            health,
            lifecycle: c.lifecycle,
            report: c.report,
            rooms_open: c.rooms_open,
            pending: HashMap::new(),
            sessions: HashMap::new(),
            dropped: HashMap::new(),
            dropped_order: VecDeque::new(),
            session_expiry: t.session_expiry(),
            limits: c.limits,
            progress_every: t
                .probe_period
                .min(t.kv_timeout / 4)
                .max(Duration::from_millis(50)),
            rooms: RoomTable::new(Deadlines::new(t.bootstrap_timeout, t.kv_timeout), 65_536),
            draining: false,
            stopped: false,
            last_refusal: None,
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
                Phase::Drain if !self.draining => self.begin_drain(),
                _ => {}
            }
            self.health.fault_point();
            wire::wait_readable(&self.sock);
            for _ in 0..wire::RECV_BATCH {
                let Some(frames) = wire::try_recv(&self.sock) else {
                    break;
                };
                self.on_frames(frames);
            }
            self.pump_rooms();
            let now = Instant::now();
            self.keep_alive(now);
            self.expire(now);
            self.publish(now);
        }
    }

    fn after_panic(&mut self, message: &str) {
        for id in self.rooms.ids() {
            self.fail_room(id, FailCode::LoopPanic, message);
        }
    }
}

impl RouterLoop {
    fn reply(&self, peer: &[u8], room: u64, msg: Message) -> bool {
        let env = Envelope {
            incarnation: self.local.incarnation,
            group_incarnation: self.local.group_incarnation,
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

    fn reject(&mut self, peer: &[u8], reason: RejectReason, text: String) {
        tracing::warn!(peer = %hex_id(peer), reason = reason.label(), %text, "KV peer refused");
        self.last_refusal = Some((hex_id(peer), Problem::new(reason.label(), text.clone())));
        self.reply(peer, 0, Message::Reject { reason, text });
    }

    fn on_frames(&mut self, frames: Vec<zmq::Message>) {
        let Some((peer, rest)) = frames.split_first() else {
            return;
        };
        let peer: &[u8] = peer;
        let refs: Vec<&[u8]> = rest.iter().map(|m| &m[..]).collect();
        let env = match decode(&refs) {
            Ok(env) => env,
            Err(e) => {
                self.metrics.kv.malformed(e.kind());
                tracing::warn!(peer = %hex_id(peer), kind = e.kind(), error = %e, "malformed KV message dropped");
                if let DecodeError::WrongVersion { got, .. } = e {
                    self.metrics
                        .kv
                        .handshake(RejectReason::VersionMismatch.label());
                    self.reject(
                        peer,
                        RejectReason::VersionMismatch,
                        format!("protocol version {got}, this prefill speaks {PROTOCOL_VERSION}"),
                    );
                }
                return;
            }
        };
        let peer = peer.to_vec();
        match &env.msg {
            Message::Hello { .. } => self.on_hello(peer, &env),
            Message::Auth { .. } => self.on_auth(peer, &env),
            _ => self.on_session_message(peer, env),
        }
    }

    fn on_hello(&mut self, peer: Vec<u8>, env: &Envelope) {
        if self.draining {
            self.metrics
                .kv
                .handshake(RejectReason::ShuttingDown.label());
            self.reject(
                &peer,
                RejectReason::ShuttingDown,
                "this prefill is shutting down".into(),
            );
            return;
        }
        let nonce: [u8; 32] = rand::random();
        match auth::respond_hello(
            &self.local,
            &self.key,
            PROTOCOL_VERSION,
            env.incarnation,
            env.group_incarnation,
            &env.msg,
            nonce,
        ) {
            Ok((welcome, pending)) => {
                if self.pending.len() >= MAX_PENDING
                    && let Some(oldest) = self
                        .pending
                        .iter()
                        .min_by_key(|(_, (_, t))| *t)
                        .map(|(k, _)| k.clone())
                {
                    self.pending.remove(&oldest);
                }
                self.pending.insert(peer.clone(), (pending, Instant::now()));
                self.reply(&peer, 0, welcome);
            }
            Err((reason, text)) => {
                self.metrics.kv.handshake(reason.label());
                self.reject(&peer, reason, text);
            }
        }
    }

    fn on_auth(&mut self, peer: Vec<u8>, env: &Envelope) {
        let Some((pending, _)) = self.pending.remove(&peer) else {
            self.metrics
                .kv
                .handshake(RejectReason::NotAuthenticated.label());
            self.reject(
                &peer,
                RejectReason::NotAuthenticated,
                "AUTH without HELLO".into(),
            );
            return;
        };
        if let Err((reason, text)) =
            auth::check_auth(&self.key, &pending, env.incarnation, &env.msg)
        {
            self.metrics.kv.handshake(reason.label());
            self.reject(&peer, reason, text);
            return;
        }
        // A decode that restarted comes back under a new routing id; its old rooms end
        // by their deadlines or by failed sends. The same routing id with a new
        // incarnation is invalidated here (rule 4 in docs/architecture.md).
        if let Some(old) = self.sessions.get(&peer)
            && old.incarnation != env.incarnation
        {
            self.drop_session(&peer, DropReason::PeerRestarted);
        }
        if !self.sessions.contains_key(&peer)
            && self.sessions.len() >= MAX_SESSIONS
            && let Some(oldest) = self
                .sessions
                .iter()
                .min_by_key(|(_, s)| s.last_seen)
                .map(|(k, _)| k.clone())
        {
            self.drop_session(&oldest, DropReason::Capacity);
        }
        self.dropped.remove(&peer);
        self.sessions.insert(
            peer.clone(),
            RouterSession {
                incarnation: env.incarnation,
                last_seen: Instant::now(),
                sent: 0,
                acked: 0,
                last_failure: None,
            },
        );
        self.metrics.kv.sessions.set(self.sessions.len() as i64);
        self.metrics.kv.handshake("ok");
        tracing::info!(peer = %hex_id(&peer), peer_incarnation = %format!("{:016x}", env.incarnation), "decode authenticated");
        self.reply(&peer, 0, Message::Accepted);
    }

    /// Forget everything about one decode session (docs/architecture.md rule 4): its rooms fail with the
    /// reason (FAILED is pushed to the peer, which may be gone), one log line names the
    /// peer, its incarnation and the reason, and the drop is counted by reason.
    fn drop_session(&mut self, peer: &[u8], why: DropReason) {
        let Some(old) = self.sessions.remove(peer) else {
            return;
        };
        if why == DropReason::PeerRestarted {
            self.metrics.kv.peer_incarnation_changes.inc();
        }
        let ids: Vec<u64> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.data.peer == peer && r.data.peer_incarnation == old.incarnation)
            .map(|(id, _)| id)
            .collect();
        let text = why.text(self.session_expiry);
        for &id in &ids {
            self.fail_room(id, why.code(), &text);
        }
        self.metrics.kv.session_dropped(why.label());
        self.metrics.kv.sessions.set(self.sessions.len() as i64);
        tracing::warn!(
            peer = %hex_id(peer),
            peer_incarnation = %format!("{:016x}", old.incarnation),
            reason = why.label(),
            silent_ms = old.last_seen.elapsed().as_millis() as u64,
            rooms_failed = ids.len(),
            %text,
            "decode session dropped"
        );
        self.last_refusal = Some((hex_id(peer), Problem::new(why.label(), text)));
        if self.dropped.insert(peer.to_vec(), why).is_none() {
            self.dropped_order.push_back(peer.to_vec());
        }
        while self.dropped_order.len() > DROPPED_REMEMBERED {
            if let Some(old) = self.dropped_order.pop_front() {
                self.dropped.remove(&old);
            }
        }
    }

    fn on_session_message(&mut self, peer: Vec<u8>, env: Envelope) {
        let authed = match self.sessions.get_mut(&peer) {
            Some(s) if s.incarnation == env.incarnation => {
                s.last_seen = Instant::now();
                true
            }
            Some(_) => {
                self.drop_session(&peer, DropReason::PeerRestarted);
                false
            }
            None => false,
        };
        if let Message::Reject { reason, text } = &env.msg
            && !authed
        {
            // The decode refused our WELCOME (a wrong key, say): note why; never answer a
            // refusal with another one.
            self.pending.remove(&peer);
            self.metrics.kv.handshake(reason.label());
            tracing::warn!(peer = %hex_id(&peer), reason = reason.label(), %text, "a decode refused this prefill");
            self.last_refusal = Some((
                hex_id(&peer),
                Problem::new(reason.label(), format!("the decode refused us: {text}")),
            ));
            return;
        }
        if !authed {
            // No state for unauthenticated peers; the REJECT (with our incarnation in its
            // header) tells a decode whose session we lost to handshake again, and why.
            self.metrics.kv.malformed("unauthenticated");
            let (reason, text) = match self.dropped.get(&peer) {
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
            self.reject(&peer, reason, text);
            return;
        }
        if env.group_incarnation != self.local.group_incarnation {
            self.metrics.kv.malformed("group_incarnation");
            self.reject(
                &peer,
                RejectReason::IncarnationMismatch,
                "group incarnation changed".into(),
            );
            return;
        }
        match env.msg {
            Message::Ping {
                nonce,
                timestamp_us,
            } => {
                self.reply(
                    &peer,
                    0,
                    Message::Pong {
                        nonce,
                        timestamp_us,
                    },
                );
            }
            Message::Prefill(req) => self.on_prefill(peer, env.incarnation, env.room, req),
            Message::Credit { consumed } => {
                if let Some(s) = self.sessions.get_mut(&peer) {
                    s.acked = consumed.min(s.sent).max(s.acked);
                }
            }
            Message::Goodbye { reason, text } => {
                tracing::info!(peer = %hex_id(&peer), reason = reason.label(), %text, "decode said goodbye");
                self.drop_session(&peer, DropReason::PeerShutdown);
            }
            Message::Abort => {
                // Stop writing, then confirm; unknown or finished rooms are a no-op that
                // is still confirmed (we are not writing to them either).
                if self
                    .rooms
                    .get(env.room)
                    .is_some_and(|r| r.data.peer == peer)
                {
                    self.end_room(env.room, RoomState::Aborted, "aborted by the decode");
                }
                self.reply(&peer, env.room, Message::AbortAck);
            }
            Message::Failed { reason, text } => {
                if self
                    .rooms
                    .get(env.room)
                    .is_some_and(|r| r.data.peer == peer)
                {
                    tracing::warn!(room = env.room, peer = %hex_id(&peer), reason = reason.label(), %text, "decode failed the room");
                    self.end_room(env.room, RoomState::Failed(reason), "failed by the decode");
                }
            }
            other => {
                self.metrics.kv.malformed("unexpected_type");
                tracing::warn!(peer = %hex_id(&peer), msg_type = ?other.msg_type(), "unexpected KV message dropped");
            }
        }
    }

    fn on_prefill(&mut self, peer: Vec<u8>, peer_inc: u64, room: u64, req: PrefillRequest) {
        let kind = if self.rooms.get(room).is_some() {
            Some("duplicate_room")
        } else if self.rooms.is_finished(room) {
            Some("finished_room")
        } else {
            None
        };
        if let Some(kind) = kind {
            // Never resurrect or disturb an existing room: count and drop.
            self.metrics.kv.malformed(kind);
            tracing::warn!(room, peer = %hex_id(&peer), kind, "PREFILL for an existing or finished room dropped");
            return;
        }
        let prompt_tokens = req.tokens.len() as u32;
        self.metrics.kv.rooms_opened.inc();
        let refuse = |this: &mut Self, code: FailCode, text: String| {
            this.metrics.kv.room("failed", code.label());
            tracing::warn!(room, peer = %hex_id(&peer), peer_incarnation = %format!("{peer_inc:016x}"), reason = code.label(), %text, "room refused");
            this.reply(&peer, room, Message::Failed { reason: code, text });
        };
        if self.draining {
            refuse(
                self,
                FailCode::Shutdown,
                "this prefill is shutting down".into(),
            );
            return;
        }
        let request = GenerateRequest {
            prompt: req.tokens,
            max_tokens: 1,
            sampling: req.sampling,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            transfer: Transfer::Export {
                from: req.cached_tokens as usize,
            },
        };
        let rx = match self.engine.submit(request) {
            Ok(rx) => rx,
            Err(e) => {
                refuse(self, FailCode::Overloaded, e.to_string());
                return;
            }
        };
        let now = Instant::now();
        let data = RouterRoom {
            peer,
            peer_incarnation: peer_inc,
            rx,
            prompt_tokens,
            done_tokens: 0,
            last_progress_sent: now,
            first: None,
            export: None,
        };
        // Checked above: the id is fresh.
        let _ = self.rooms.open(room, RoomState::WaitingKv, data, now);
    }

    /// Collect engine events of every room; finished prefills are streamed out.
    fn pump_rooms(&mut self) {
        for id in self.rooms.ids() {
            while let Some(r) = self.rooms.get_mut(id) {
                match r.data.rx.try_recv() {
                    Ok(GenEvent::Token { id: t, logprob, .. }) => r.data.first = Some((t, logprob)),
                    Ok(GenEvent::KvExported(p)) => r.data.export = Some(p),
                    Ok(GenEvent::Progress { prefilled, .. }) => {
                        r.data.done_tokens = prefilled.min(u32::MAX as usize) as u32;
                    }
                    Ok(GenEvent::KvReserved { .. }) => {}
                    Ok(GenEvent::Done { .. }) => {
                        self.stream_out(id);
                        break;
                    }
                    Ok(GenEvent::Failed { reason, message }) => {
                        let code = match reason {
                            FailReason::QueueFull => FailCode::Overloaded,
                            FailReason::QueueTimeout => FailCode::QueueTimeout,
                            FailReason::TooLarge | FailReason::InvalidRequest => FailCode::TooLarge,
                            _ => FailCode::EngineFailed,
                        };
                        self.fail_room(id, code, &message);
                        break;
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.fail_room(id, FailCode::EngineFailed, "engine ended the request");
                        break;
                    }
                }
            }
        }
    }

    /// While the engine loop goes round, every room it holds is being worked on (prefilled,
    /// or queued behind others): tell each decode so at most every `progress_every`, and
    /// keep the room's own deadline fresh. An engine that stops going round stops this, so
    /// both sides' no-progress deadlines measure a stuck engine, not a long prompt.
    fn keep_alive(&mut self, now: Instant) {
        let engine = self.engine.health();
        if engine.stopped() || engine.heartbeat_age() > self.limits.engine_stall {
            return;
        }
        let due: Vec<(u64, Vec<u8>, u32, u32)> = self
            .rooms
            .iter()
            .filter(|(_, r)| {
                r.state == RoomState::WaitingKv
                    && now.duration_since(r.data.last_progress_sent) >= self.progress_every
            })
            .map(|(id, r)| {
                (
                    id,
                    r.data.peer.clone(),
                    r.data.done_tokens,
                    r.data.prompt_tokens,
                )
            })
            .collect();
        for (id, peer, done, total) in due {
            self.reply(&peer, id, Message::Progress { done, total });
            if let Some(r) = self.rooms.get_mut(id) {
                r.data.last_progress_sent = now;
            }
            let _ = self.rooms.advance(id, RoomState::WaitingKv, now);
        }
    }

    fn stream_out(&mut self, id: u64) {
        let Some(r) = self.rooms.get_mut(id) else {
            return;
        };
        let (Some((first, lp)), Some(payload)) = (r.data.first.take(), r.data.export.take()) else {
            self.fail_room(
                id,
                FailCode::EngineFailed,
                "engine finished without a token or KV",
            );
            return;
        };
        let (peer, prompt_tokens) = (r.data.peer.clone(), r.data.prompt_tokens);
        // Rule 10 in bytes: KV handed to ZeroMQ for one decode and not yet acknowledged
        // stays within the budget; a room that would pass it fails now rather than queue.
        // (With nothing in flight a room is always sent, so one larger than the budget
        // still goes: a peer then pins at most max(budget, one room).)
        let in_flight = self.sessions.get(&peer).map_or(0, RouterSession::in_flight);
        let budget = self.limits.send_budget;
        if in_flight > 0 && in_flight + payload.len() as u64 > budget {
            self.metrics.kv.send_failure("byte_budget");
            let text = format!(
                "{in_flight} KV bytes sent to this decode are unacknowledged; {} more would pass the send budget of {budget} bytes",
                payload.len()
            );
            self.fail_room(id, FailCode::SendBudget, &text);
            return;
        }
        let _ = self
            .rooms
            .advance(id, RoomState::Transferring, Instant::now());
        for c in chunks::plan(&payload) {
            match wire::send_chunk(
                &self.sock,
                Some(&peer),
                self.local.incarnation,
                self.local.group_incarnation,
                id,
                &c,
            ) {
                Ok(n) => {
                    self.metrics.kv.bytes("sent", n);
                    if let Some(s) = self.sessions.get_mut(&peer) {
                        s.sent += n as u64;
                    }
                }
                Err(e) => {
                    let label = wire::send_error_label(e);
                    self.metrics.kv.send_failure(label);
                    tracing::warn!(peer = %hex_id(&peer), room = id, chunk = c.index, reason = label, "KV chunk send failed");
                    self.fail_room(id, FailCode::SendFailed, "KV chunk send failed");
                    return;
                }
            }
        }
        let done = Message::Done {
            first_token: first,
            prompt_tokens,
            logprob: lp.map(|l| WireLogprob {
                logprob: l.logprob,
                top: l.top,
            }),
        };
        if !self.reply(&peer, id, done) {
            self.fail_room(id, FailCode::SendFailed, "DONE send failed");
            return;
        }
        self.end_room(id, RoomState::Done, "");
    }

    /// Fail a room: push FAILED to its decode at once (docs/architecture.md rule 6), log
    /// once, count.
    fn fail_room(&mut self, id: u64, code: FailCode, text: &str) {
        let Some(r) = self.rooms.get(id) else {
            return;
        };
        let peer = r.data.peer.clone();
        self.reply(
            &peer,
            id,
            Message::Failed {
                reason: code,
                text: text.to_owned(),
            },
        );
        self.end_room(id, RoomState::Failed(code), text);
    }

    fn end_room(&mut self, id: u64, outcome: RoomState, text: &str) {
        // Dropping the receiver tells the engine to drop the sequence and free its blocks.
        let Some(r) = self.rooms.finish(id, outcome) else {
            return;
        };
        let reason = match outcome {
            RoomState::Failed(c) => c.label(),
            RoomState::Aborted => "client_abort",
            _ => "none",
        };
        self.metrics.kv.room(outcome.label(), reason);
        if outcome != RoomState::Done {
            tracing::warn!(room = id, peer = %hex_id(&r.data.peer), peer_incarnation = %format!("{:016x}", r.data.peer_incarnation), state = outcome.label(), reason, %text, "room ended");
        }
        if let RoomState::Failed(_) = outcome
            && let Some(s) = self.sessions.get_mut(&r.data.peer)
        {
            s.last_failure = Some(Problem::new(reason, format!("room {id:016x}: {text}")));
        }
    }

    fn expire(&mut self, now: Instant) {
        for (id, state) in self.rooms.expired(now) {
            self.fail_room(
                id,
                state.timeout_code(),
                &format!("no progress in {}", state.label()),
            );
        }
        let limit = self.rooms.deadlines.bootstrap;
        self.pending
            .retain(|_, (_, t)| now.duration_since(*t) < limit);
        // Liveness expiry: a decode that sent nothing (not even a PING) for the expiry is
        // gone (killed, partitioned, frozen); its state must not outlive it.
        let silent: Vec<Vec<u8>> = self
            .sessions
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.last_seen) > self.session_expiry)
            .map(|(k, _)| k.clone())
            .collect();
        for peer in silent {
            self.drop_session(&peer, DropReason::Expired);
        }
    }

    /// Drain begins: every decode hears GOODBYE (it stops sending new rooms here); new
    /// rooms and handshakes are refused from now on, rooms in flight go on.
    fn begin_drain(&mut self) {
        self.draining = true;
        let peers: Vec<Vec<u8>> = self.sessions.keys().cloned().collect();
        for peer in &peers {
            self.reply(
                peer,
                0,
                Message::Goodbye {
                    reason: FailCode::Shutdown,
                    text: "this prefill is shutting down".into(),
                },
            );
        }
        tracing::info!(
            decodes = peers.len(),
            rooms_in_flight = self.rooms.len(),
            "draining: said goodbye to every decode; refusing new rooms"
        );
    }

    /// Stop: every room left fails with `shutdown` (pushed to its decode, which counts it
    /// as `peer_shutdown`); the socket closes with a bounded linger; returning from `run`
    /// then drops the engine handle.
    fn shutdown(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        if !self.draining {
            self.begin_drain();
        }
        let ids = self.rooms.ids();
        for &id in &ids {
            self.fail_room(id, FailCode::Shutdown, "this prefill is shutting down");
        }
        self.publish(Instant::now() + REPORT_EVERY);
        if !self.sessions.is_empty() {
            std::thread::sleep(wire::CLOSE_GRACE);
        }
        wire::set_close_linger(&self.sock);
        tracing::info!(rooms_failed = ids.len(), "KV loop stopped");
    }

    fn publish(&mut self, now: Instant) {
        self.rooms_open.store(self.rooms.len(), Ordering::Relaxed);
        if now.duration_since(self.last_report) < REPORT_EVERY {
            return;
        }
        self.last_report = now;
        let in_flight: u64 = self.sessions.values().map(RouterSession::in_flight).sum();
        self.metrics.kv.bytes_in_flight.set(in_flight as i64);
        let mut recent: Vec<(&Vec<u8>, &RouterSession)> = self.sessions.iter().collect();
        recent.sort_by_key(|(_, s)| std::cmp::Reverse(s.last_seen));
        let peers =
            recent
                .into_iter()
                .take(REPORTED_PEERS)
                .map(|(peer, s)| PeerReport {
                    address: hex_id(peer),
                    state: "established",
                    incarnation: Some(s.incarnation),
                    rooms: self
                        .rooms
                        .iter()
                        .filter(|(_, r)| &r.data.peer == peer)
                        .count(),
                    last_contact_ms: Some(
                        now.saturating_duration_since(s.last_seen).as_millis() as u64
                    ),
                    bytes_in_flight: Some(s.in_flight()),
                    last_refusal: None,
                    last_failure: s.last_failure.clone(),
                })
                .collect();
        if let Ok(mut r) = self.report.lock() {
            r.peers = peers;
            r.last_refusal = self.last_refusal.clone();
        }
    }
}

/// Why the prefill dropped a decode session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DropReason {
    /// No message from the decode within the session expiry.
    Expired,
    /// The same connection came back with another process incarnation.
    PeerRestarted,
    /// The session table was full; the longest-silent session made room.
    Capacity,
    /// The decode said GOODBYE (it is shutting down).
    PeerShutdown,
}

impl DropReason {
    fn label(self) -> &'static str {
        match self {
            Self::Expired => "expired",
            Self::PeerRestarted => "peer_restarted",
            Self::Capacity => "capacity",
            Self::PeerShutdown => "peer_shutdown",
        }
    }

    fn code(self) -> FailCode {
        match self {
            Self::Expired | Self::Capacity => FailCode::PeerExpired,
            Self::PeerRestarted => FailCode::PeerRestarted,
            Self::PeerShutdown => FailCode::PeerShutdown,
        }
    }

    fn text(self, expiry: Duration) -> String {
        match self {
            Self::Expired => format!(
                "decode silent for more than {} ms (session expiry)",
                expiry.as_millis()
            ),
            Self::PeerRestarted => "decode restarted".into(),
            Self::Capacity => format!("session table full ({MAX_SESSIONS})"),
            Self::PeerShutdown => "decode shut down".into(),
        }
    }
}
