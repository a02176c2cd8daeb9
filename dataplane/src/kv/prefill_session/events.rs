//! What goes in and out of a [`PrefillSession`](super::PrefillSession): the events the
//! loop feeds it, the effects it asks for, the notes the loop counts and logs, and what
//! `/ready` lists.

use std::time::{Duration, Instant};

use super::{MAX_SESSIONS, PeerId};
use crate::kv::{DecodeError, Envelope, FailCode, Message, MsgType, RejectReason};
use crate::sampling::{SamplingParams, TokenLogprob};

/// What the engine said about a room's request.
#[derive(Debug)]
pub enum EngineUpdate {
    /// The first (and only) token.
    Token {
        token: u32,
        logprob: Option<TokenLogprob>,
    },
    /// The prompt's KV, exported.
    Exported(Vec<u8>),
    /// Prompt tokens prefilled so far.
    Progress { prefilled: usize },
    /// The request finished.
    Done,
    /// The request failed, with the protocol's reason for it.
    Failed { code: FailCode, message: String },
    /// The engine dropped the request without a word.
    Gone,
}

/// What happened, as the loop saw it.
#[derive(Debug)]
pub enum PrefillEvent<'a> {
    /// The loop went round; `engine_live`: the engine loop is going round (PROGRESS is
    /// sent only then, so both sides' deadlines measure a stuck engine).
    Tick { engine_live: bool },
    /// A message from `peer`.
    Received { peer: &'a [u8], env: Envelope },
    /// A message from `peer` that did not decode.
    Undecodable {
        peer: &'a [u8],
        error: &'a DecodeError,
    },
    /// News from the engine about a room.
    Engine { room: u64, update: EngineUpdate },
    /// The engine refused the room's request (its queue is full, or it stopped).
    SubmitFailed { room: u64, message: String },
    /// What came of a [`PrefillEffect::StreamKv`]: the KV chunk bytes handed to ZeroMQ,
    /// and the failure (its label, and what failed) if not everything went.
    Streamed {
        room: u64,
        sent: u64,
        failed: Option<(&'static str, &'static str)>,
    },
    /// The process drains: GOODBYE to every decode, no new rooms or handshakes.
    Drain,
    /// The process stops: every room left fails.
    Stop,
    /// The process resets in place to a new group incarnation: as `Stop`, with the reason
    /// `reset` (GOODBYE and FAILED), so the decodes handshake again at once.
    Reset,
    /// The loop panicked (and will run again): fail every room.
    Panicked { message: String },
}

/// What to ask of the engine for a room: one token, its KV exported from `export_from`.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub export_from: usize,
}

/// What the loop does for the session.
#[derive(Debug, PartialEq)]
pub enum PrefillEffect {
    Send {
        peer: PeerId,
        room: u64,
        msg: Message,
    },
    /// Submit the room's request to the engine; a refusal comes back as
    /// [`PrefillEvent::SubmitFailed`], the engine's news as [`PrefillEvent::Engine`].
    Submit { room: u64, request: EngineRequest },
    /// Send the room's KV chunks, then `done`; what came of it comes back as
    /// [`PrefillEvent::Streamed`].
    StreamKv {
        peer: PeerId,
        room: u64,
        payload: Vec<u8>,
        done: Message,
    },
    /// A room ended: exactly once per room submitted, with its outcome. The engine's
    /// request is dropped with it (its sequence and blocks are freed).
    RoomEnded {
        room: u64,
        peer: PeerId,
        peer_incarnation: u64,
        end: RoomEnd,
    },
    /// Something to count and log.
    Note(PrefillNote),
}

/// How a room ended.
#[derive(Debug, Clone, PartialEq)]
pub enum RoomEnd {
    Done,
    Failed {
        code: FailCode,
        text: String,
    },
    /// The decode aborted it.
    Aborted,
}

/// Why the prefill dropped a decode session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
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
    pub fn label(self) -> &'static str {
        match self {
            Self::Expired => "expired",
            Self::PeerRestarted => "peer_restarted",
            Self::Capacity => "capacity",
            Self::PeerShutdown => "peer_shutdown",
        }
    }

    pub(super) fn code(self) -> FailCode {
        match self {
            Self::Expired | Self::Capacity => FailCode::PeerExpired,
            Self::PeerRestarted => FailCode::PeerRestarted,
            Self::PeerShutdown => FailCode::PeerShutdown,
        }
    }

    pub(super) fn text(self, expiry: Duration) -> String {
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

/// Something the loop counts and logs; each names its counter and log line.
#[derive(Debug, Clone, PartialEq)]
pub enum PrefillNote {
    /// `tandem_kv_malformed_messages_total{kind}`, `malformed KV message dropped`.
    Malformed {
        peer: PeerId,
        kind: &'static str,
        detail: String,
    },
    /// `malformed{kind}` without a line of its own (the REJECT that follows has one, or
    /// the message is a harmless duplicate).
    Dropped { peer: PeerId, kind: &'static str },
    /// `malformed{unexpected_type}`, `unexpected KV message dropped`.
    Unexpected { peer: PeerId, msg_type: MsgType },
    /// `PREFILL for an existing or finished room dropped` (`malformed{kind}`).
    DuplicateRoom {
        peer: PeerId,
        room: u64,
        kind: &'static str,
    },
    /// `tandem_kv_handshakes_total{result}` of a refusal, `KV peer refused`.
    Refused {
        peer: PeerId,
        reason: RejectReason,
        text: String,
        counted: bool,
    },
    /// `handshakes{reason}`, `a decode refused this prefill`.
    RefusedByDecode {
        peer: PeerId,
        reason: RejectReason,
        text: String,
    },
    /// `handshakes{ok}`, `decode authenticated`.
    Authenticated { peer: PeerId, incarnation: u64 },
    /// `tandem_kv_sessions_dropped_total{reason}` (and `peer_incarnation_changes` for a
    /// restart), `decode session dropped`.
    SessionDropped {
        peer: PeerId,
        incarnation: u64,
        why: DropReason,
        silent: Duration,
        rooms_failed: usize,
        text: String,
    },
    /// `decode said goodbye`.
    DecodeLeaving {
        peer: PeerId,
        reason: FailCode,
        text: String,
    },
    /// `decode failed the room`.
    FailedByDecode {
        peer: PeerId,
        room: u64,
        reason: FailCode,
        text: String,
    },
    /// `tandem_kv_rooms_opened_total`.
    RoomOpened,
    /// A room refused before it started (`rooms{failed, reason}`, `room refused`).
    RoomRefused {
        peer: PeerId,
        room: u64,
        peer_incarnation: u64,
        code: FailCode,
        text: String,
    },
    /// `tandem_kv_send_failures_total{result="byte_budget"}`.
    OverBudget,
    /// `draining: said goodbye to every decode; refusing new rooms`.
    Draining { decodes: usize, rooms: usize },
    /// `KV loop stopped`.
    Stopped { rooms_failed: usize },
}

/// One decode session as `/ready` lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionReport {
    pub peer: PeerId,
    pub incarnation: u64,
    pub rooms: usize,
    pub silent: Duration,
    pub bytes_in_flight: u64,
    /// The last room that failed with this decode: reason, message, when.
    pub last_failure: Option<(String, String, Instant)>,
}

/// The last handshake refused or session dropped, with its peer: reason, message, when.
pub type LastRefusal = Option<(PeerId, String, String, Instant)>;
