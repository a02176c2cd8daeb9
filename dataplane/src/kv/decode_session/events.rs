//! What goes in and out of a [`DecodeSession`](super::DecodeSession): the events the
//! loop feeds it, the effects it asks for, the notes the loop counts and logs, and the
//! status `/ready` reads.

use std::time::{Duration, Instant};

use crate::kv::chunks::KvPayload;
use crate::kv::{
    DecodeError, Decoded, FailCode, Header, Message, MsgType, PrefillRequest, WireLogprob,
};

/// What happened, as the loop saw it.
#[derive(Debug)]
pub enum DecodeEvent<'a> {
    /// The loop went round: drive the handshake, the PING, credit and the deadlines.
    Tick,
    /// A message from the prefill (a KV chunk still in its frame).
    Received(Header, Decoded<'a>),
    /// A message that did not decode.
    Undecodable(&'a DecodeError),
    /// The TCP connection to the prefill closed.
    Disconnected { endpoint: String },
    /// An HTTP request asks for a room.
    Open { room: u64, req: PrefillRequest },
    /// The room's HTTP request went away.
    ClientGone { room: u64 },
    /// A send asked for by an effect did not go out.
    SendFailed { room: u64, msg: MsgType },
    /// The process stops: end every room, say goodbye.
    Stop,
    /// The process resets in place to a new group incarnation: as `Stop`, with the reason
    /// `reset` (FAILED and GOODBYE).
    Reset,
    /// The loop panicked (and will run again): fail every room.
    Panicked { message: String },
}

/// What the loop does for the session.
#[derive(Debug, PartialEq)]
pub enum DecodeEffect {
    /// Send `msg` (`room` 0 for session messages); a failure comes back as
    /// [`DecodeEvent::SendFailed`].
    Send { room: u64, msg: Message },
    /// A room ended: exactly once per room opened, with its outcome.
    RoomEnded { room: u64, end: RoomEnd },
    /// Something to count and log.
    Note(DecodeNote),
}

/// How a room ended.
#[derive(Debug, PartialEq)]
pub enum RoomEnd {
    /// The KV (whole) and the first token: hand them to the engine, answer the request.
    Done {
        payload: KvPayload,
        first_token: u32,
        first_logprob: Option<WireLogprob>,
    },
    /// Failed with the protocol's reason; `peer_incarnation` is the prefill's it was sent
    /// to (0 when it never went out).
    Failed {
        code: FailCode,
        text: String,
        peer_incarnation: u64,
    },
    /// Aborted (the client left); `reason` is the counter's label: `client_abort`,
    /// `abort_ack_timeout` (released without ABORT_ACK), `shutdown`.
    Aborted { reason: &'static str, acked: bool },
}

/// Who refused a handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusedBy {
    /// This decode refused the prefill (its WELCOME did not check out).
    Us,
    /// The prefill refused this decode (REJECT).
    Peer,
}

/// Something the loop counts and logs; each names its counter and log line.
#[derive(Debug, Clone, PartialEq)]
pub enum DecodeNote {
    /// `tandem_kv_malformed_messages_total{kind}`, `malformed KV message dropped`.
    Malformed { kind: &'static str, detail: String },
    /// `malformed{unexpected_type}`, `unexpected KV message dropped`.
    Unexpected { msg_type: MsgType },
    /// `malformed{unknown_room}`; `logged`: `KV chunk for an unknown room dropped`.
    UnknownRoom { room: u64, logged: bool },
    /// `malformed{bad_chunk}` (the room fails too).
    BadChunk,
    /// `tandem_kv_handshakes_total{result}` for a refusal or a timeout, with the line
    /// `refusing the prefill` / `prefill refused us` / `handshake timed out; retrying`.
    HandshakeFailed {
        result: &'static str,
        by: Option<RefusedBy>,
        peer_incarnation: u64,
        text: String,
    },
    /// `handshakes{ok}`, `prefill authenticated`; when the prefill is another process
    /// than the last one authenticated, also `peer_incarnation_changes` and
    /// `prefill restarted while disconnected; handshaken again`.
    Authenticated {
        peer_incarnation: u64,
        replaced: Option<u64>,
    },
    /// `peer_incarnation_changes`, `prefill restarted; failing its rooms and handshaking again`.
    PeerRestarted { old: u64, new: u64 },
    /// `tandem_kv_peer_unresponsive_total`, `prefill unresponsive; failing its rooms and
    /// handshaking again`: a PING went unanswered for the channel deadline.
    PeerUnresponsive {
        peer_incarnation: u64,
        /// How long the PING went unanswered (at least the deadline).
        unanswered: Duration,
        deadline: Duration,
        rooms_failed: usize,
    },
    /// `stale WELCOME dropped`: the answer to an earlier HELLO of this decode.
    StaleWelcome { peer_incarnation: u64 },
    /// `peer_disconnects`, `connection to the prefill closed`.
    Disconnected {
        endpoint: String,
        peer_incarnation: u64,
        rooms_failed: usize,
    },
    /// `peer_goodbyes`, `prefill is leaving; no new rooms go there`.
    PeerLeaving {
        peer_incarnation: u64,
        reason: FailCode,
        text: String,
    },
    /// `tandem_kv_ping_rtt_seconds`.
    PongRtt(Duration),
    /// `tandem_kv_progress_messages_total`.
    Progress,
    /// `tandem_kv_rooms_opened_total`.
    RoomOpened,
    /// `tandem_kv_transfer_bytes_total{direction="received"}`.
    BytesReceived(usize),
    /// `tandem_kv_send_failures_total{result="byte_budget"}`.
    OverBudget,
    /// `room id collision` (an error: ids are random 64-bit).
    RoomIdCollision { room: u64 },
    /// `KV loop stopped`.
    Stopped,
}

/// The channel's state as `/ready` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelState {
    Idle,
    Handshaking,
    Established,
}

/// Why the channel is not (or was not) established, as `/ready` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub reason: String,
    pub message: String,
    pub at: Instant,
}

/// What `/ready` and the room picker read about this peer.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeStatus<'a> {
    pub state: ChannelState,
    /// The last prefill incarnation authenticated (0 before any).
    pub peer_incarnation: u64,
    /// The prefill said GOODBYE: no new rooms go there.
    pub peer_draining: bool,
    /// The session ended because the prefill stopped answering; no new rooms until a
    /// handshake succeeds again.
    pub unresponsive: bool,
    /// The last PONG (or the handshake's completion).
    pub last_pong: Option<Instant>,
    pub rooms: usize,
    /// KV blocks held by rooms receiving or aborting.
    pub blocks_held: usize,
    pub last_refusal: Option<&'a Refusal>,
}
