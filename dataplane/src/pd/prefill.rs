//! Prefill role: one ROUTER socket on `--kv-port`, one supervised loop. It authenticates
//! decodes, answers PINGs, runs each PREFILL through the local engine (chunked prefill,
//! max_tokens 1, KV export) and streams the KV chunks and DONE(first token) back.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::error::TryRecvError;

use super::supervise::Supervised;
use super::wire::{self, hex_id};
use super::{Check, LoopHealth, loop_stale_after, supervise};
use crate::config::PdTimings;
use crate::kv::auth::{self, GroupKey, LocalIdentity, Pending};
use crate::kv::room::{Deadlines, RoomState, RoomTable};
use crate::kv::{
    DecodeError, Envelope, FailCode, Message, PROTOCOL_VERSION, PrefillRequest, RejectReason,
    WireLogprob, chunks, decode,
};
use crate::metrics::Metrics;
use crate::sampling::{SamplingParams, TokenLogprob};
use crate::scheduler::{EngineHandle, FailReason, GenEvent, GenerateRequest, Transfer};

/// Most handshakes waiting for AUTH; the oldest is dropped beyond this (rule 11 in
/// docs/architecture.md: an unauthenticated peer gets bounded, short-lived state only).
const MAX_PENDING: usize = 256;
const MAX_SESSIONS: usize = 1024;

pub struct PrefillHandle {
    bound: Arc<AtomicBool>,
    health: Arc<LoopHealth>,
    stale_after: Duration,
    pub endpoint: String,
}

impl PrefillHandle {
    pub fn checks(&self) -> Vec<Check> {
        let bound = self.bound.load(Ordering::Relaxed);
        let age = self.health.age();
        vec![
            Check {
                name: "kv_socket_bound".into(),
                ok: bound,
                detail: if bound {
                    format!("ROUTER bound on {}", self.endpoint)
                } else {
                    format!("ROUTER not bound on {}", self.endpoint)
                },
            },
            Check {
                name: format!("loop_{}", self.health.name),
                ok: age <= self.stale_after,
                detail: format!(
                    "heartbeat {} ms ago (limit {} ms), {} restarts",
                    age.as_millis(),
                    self.stale_after.as_millis(),
                    self.health.restarts()
                ),
            },
        ]
    }
}

/// Bind the ROUTER (failing the start when the port is taken) and start the loop.
pub fn start(
    host: &str,
    port: u16,
    local: LocalIdentity,
    key: GroupKey,
    timings: PdTimings,
    engine: EngineHandle,
    metrics: Arc<Metrics>,
) -> crate::Result<PrefillHandle> {
    let io = |e: zmq::Error| crate::Error::Io {
        path: format!("KV socket tcp://{host}:{port}"),
        source: std::io::Error::other(e),
    };
    let ctx = zmq::Context::new();
    let sock = ctx.socket(zmq::ROUTER).map_err(io)?;
    wire::configure(&sock).map_err(io)?;
    // Sends to a peer that went away fail (and are counted) instead of vanishing.
    sock.set_router_mandatory(true).map_err(io)?;
    let endpoint = format!("tcp://{host}:{port}");
    sock.bind(&endpoint).map_err(io)?;
    let bound = Arc::new(AtomicBool::new(true));
    let health = LoopHealth::new("kv_router");
    health.beat();
    tracing::info!(%endpoint, incarnation = local.incarnation, group_incarnation = local.group_incarnation, "KV ROUTER bound");
    let body = RouterLoop {
        _ctx: ctx,
        sock,
        local,
        key,
        engine,
        metrics: metrics.clone(),
        health: health.clone(),
        pending: HashMap::new(),
        sessions: HashMap::new(),
        session_expiry: timings.session_expiry(),
        rooms: RoomTable::new(
            Deadlines::new(timings.bootstrap_timeout, timings.kv_timeout),
            65_536,
        ),
    };
    supervise(body, health.clone(), metrics).map_err(|e| crate::Error::Io {
        path: "KV loop thread".into(),
        source: e,
    })?;
    Ok(PrefillHandle {
        bound,
        health,
        stale_after: loop_stale_after(timings.probe_period),
        endpoint,
    })
}

struct Session {
    incarnation: u64,
    last_seen: Instant,
}

struct PrefillRoom {
    peer: Vec<u8>,
    peer_incarnation: u64,
    rx: tokio::sync::mpsc::Receiver<GenEvent>,
    prompt_tokens: u32,
    first: Option<(u32, Option<TokenLogprob>)>,
    export: Option<Vec<u8>>,
}

struct RouterLoop {
    _ctx: zmq::Context,
    sock: zmq::Socket,
    local: LocalIdentity,
    key: GroupKey,
    engine: EngineHandle,
    metrics: Arc<Metrics>,
    health: Arc<LoopHealth>,
    pending: HashMap<Vec<u8>, (Pending, Instant)>,
    sessions: HashMap<Vec<u8>, Session>,
    /// A session silent for this long is dropped with its rooms (`PdTimings::session_expiry`).
    session_expiry: Duration,
    rooms: RoomTable<PrefillRoom>,
}

impl Supervised for RouterLoop {
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
            self.pump_rooms();
            self.expire(Instant::now());
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

    fn reject(&self, peer: &[u8], reason: RejectReason, text: String) {
        tracing::warn!(peer = %hex_id(peer), reason = reason.label(), %text, "KV peer refused");
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
        self.sessions.insert(
            peer.clone(),
            Session {
                incarnation: env.incarnation,
                last_seen: Instant::now(),
            },
        );
        self.metrics.kv.sessions.set(self.sessions.len() as i64);
        self.metrics.kv.handshake("ok");
        tracing::info!(peer = %hex_id(&peer), peer_incarnation = %format!("{:016x}", env.incarnation), "decode authenticated");
        self.reply(&peer, 0, Message::Accepted);
    }

    /// Forget everything about one decode session (docs/architecture.md rule 4): its rooms
    /// fail with the reason (FAILED is pushed to the peer, which may be gone), one log line
    /// names the peer, its incarnation and the reason, and the drop is counted by reason.
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
        if !authed {
            // No state for unauthenticated peers; the REJECT (with our incarnation in its
            // header) tells a decode whose session we lost to handshake again.
            self.metrics.kv.malformed("unauthenticated");
            self.reject(
                &peer,
                RejectReason::NotAuthenticated,
                format!("{:?} before a handshake", env.msg.msg_type()),
            );
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
        let request = GenerateRequest {
            prompt: req.tokens,
            max_tokens: 1,
            sampling: SamplingParams {
                temperature: req.temperature,
                top_k: req.top_k as usize,
                top_p: req.top_p,
                seed: req.seed,
                logprobs: req.logprobs.map(|n| n.min(20) as usize),
            },
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            transfer: Transfer::Export,
        };
        let rx = match self.engine.submit(request) {
            Ok(rx) => rx,
            Err(e) => {
                self.metrics.kv.room("failed", FailCode::Overloaded.label());
                tracing::warn!(room, peer = %hex_id(&peer), reason = FailCode::Overloaded.label(), "room refused: {e}");
                self.reply(
                    &peer,
                    room,
                    Message::Failed {
                        reason: FailCode::Overloaded,
                        text: e.to_string(),
                    },
                );
                return;
            }
        };
        let data = PrefillRoom {
            peer,
            peer_incarnation: peer_inc,
            rx,
            prompt_tokens,
            first: None,
            export: None,
        };
        // Checked above: the id is fresh.
        let _ = self
            .rooms
            .open(room, RoomState::WaitingKv, data, Instant::now());
    }

    /// Collect engine events of every room; finished prefills are streamed out.
    fn pump_rooms(&mut self) {
        for id in self.rooms.ids() {
            while let Some(r) = self.rooms.get_mut(id) {
                match r.data.rx.try_recv() {
                    Ok(GenEvent::Token { id: t, logprob, .. }) => r.data.first = Some((t, logprob)),
                    Ok(GenEvent::KvExported(p)) => r.data.export = Some(p),
                    Ok(GenEvent::KvReserved) => {}
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
                Ok(n) => self.metrics.kv.bytes("sent", n),
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

    /// Fail a room: push FAILED to its decode at once (docs/architecture.md rule 6), log once,
    /// count.
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
}

impl DropReason {
    fn label(self) -> &'static str {
        match self {
            Self::Expired => "expired",
            Self::PeerRestarted => "peer_restarted",
            Self::Capacity => "capacity",
        }
    }

    fn code(self) -> FailCode {
        match self {
            Self::Expired | Self::Capacity => FailCode::PeerExpired,
            Self::PeerRestarted => FailCode::PeerRestarted,
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
        }
    }
}
