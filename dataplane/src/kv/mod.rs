//! The KV transfer protocol between prefill and decode processes: pure message codec,
//! handshake authentication, room state machine and KV chunk validation. No I/O here; the
//! ZeroMQ transport and the roles live in `crate::pd`. `docs/protocol.md` describes the
//! protocol for readers of the repository; this header is its source for the framing.
//!
//! # Framing
//!
//! Every message is a ZeroMQ multipart message of exactly two frames (a ROUTER socket adds
//! the peer's routing id in front; the transport strips it before decoding).
//!
//! Frame 0, the fixed header (36 bytes, little endian). Magic, version and type sit at the
//! same offsets in every protocol version, so a peer of another version is recognised and
//! refused with a reason instead of being misparsed:
//!
//! | offset | size | field                                                        |
//! |--------|------|--------------------------------------------------------------|
//! | 0      | 4    | magic `TKVP`                                                 |
//! | 4      | 2    | u16 protocol version ([`PROTOCOL_VERSION`])                  |
//! | 6      | 1    | u8 message type ([`MsgType`])                                |
//! | 7      | 1    | u8 flags (reserved, 0; ignored by this version)              |
//! | 8      | 8    | u64 sender process incarnation (random per process start)    |
//! | 16     | 8    | u64 group incarnation (from the operator)                    |
//! | 24     | 8    | u64 room id; 0 for messages that belong to no room            |
//! | 32     | 4    | u32 payload length; must equal the length of frame 1          |
//!
//! Frame 1, the payload, per type (all integers little endian; `str16` is a u16 byte length
//! then UTF-8; `[u8; 32]` is raw bytes):
//!
//! | type | name      | room | payload                                                   |
//! |------|-----------|------|-----------------------------------------------------------|
//! | 1    | HELLO     | 0    | fingerprint str16, layout (5 × u32: dtype, layers, KV heads, head dim, block size), nonce [u8; 32] |
//! | 2    | WELCOME   | 0    | fingerprint str16, layout, nonce [u8; 32], mac [u8; 32]   |
//! | 3    | AUTH      | 0    | mac [u8; 32]                                              |
//! | 4    | ACCEPTED  | 0    | (empty)                                                   |
//! | 5    | REJECT    | 0    | u8 reason code, text str16                                |
//! | 6    | PREFILL   | ≠0   | u32 n, n × u32 token ids, f32 temperature, u32 top_k, f32 top_p, u8 has_seed, u64 seed, u8 has_logprobs, u32 logprobs, f32 repetition penalty, f32 frequency penalty, f32 presence penalty, u32 min_tokens, u32 m, m × u32 token ids masked until min_tokens, u32 cached (< n; see below) |
//! | 7    | KV_CHUNK  | ≠0   | u32 index, u32 count, u16 first layer, u16 end layer, u64 offset, u64 total, u32 CRC-32C of the data, u32 n, n bytes |
//! | 8    | DONE      | ≠0   | u32 first token, u32 prompt tokens, u8 has_logprob, [f32 logprob, u8 k, k × (u32 token, f32 logprob)] |
//! | 9    | FAILED    | ≠0   | u8 reason code, text str16                                |
//! | 10   | ABORT     | ≠0   | (empty)                                                   |
//! | 11   | ABORT_ACK | ≠0   | (empty)                                                   |
//! | 12   | PING      | 0    | u64 nonce, u64 sender timestamp (µs)                      |
//! | 13   | PONG      | 0    | u64 nonce, u64 timestamp echoed from the PING             |
//! | 14   | PROGRESS  | ≠0   | u32 prompt tokens prefilled so far, u32 prompt tokens in all |
//! | 15   | CREDIT    | 0    | u64 KV chunk data bytes received from this peer since the session was established |
//! | 16   | GOODBYE   | 0    | u8 reason code (a FAILED code, normally `shutdown`), text str16 |
//!
//! Reason codes: REJECT uses [`RejectReason`], FAILED and GOODBYE use [`FailCode`]; both are
//! listed with their numbers and labels in `message.rs`.
//!
//! # Liveness, progress and flow control (since version 3)
//!
//! - **PROGRESS** (prefill → decode) is sent for every room the prefill holds, at most once
//!   per `min(probe period, KV timeout / 4)`, while its engine loop is going round: the
//!   decode's no-progress deadline of a room (`--kv-timeout-seconds`) then measures
//!   silence, not the length of the prompt or the queue in front of it. An engine that
//!   stops going round stops the PROGRESS, and the deadline fires as before.
//! - **CREDIT** (decode → prefill) after every batch of KV chunks the decode received: the
//!   running total of chunk data bytes. The prefill's bytes in flight to a decode are the
//!   chunk bytes it handed to ZeroMQ for that session minus the last CREDIT; a room whose
//!   KV would take them past `--kv-send-budget-mib` fails at once (`send_budget`, pushed
//!   as FAILED) instead of being queued, so a decode that stops reading pins at most the
//!   budget (or one room's KV, when nothing else is in flight).
//! - **GOODBYE** (either side) when a process starts shutting down. A prefill sends it when
//!   its drain begins: the decode stops opening rooms there and reports the peer as
//!   `peer_shutdown`; rooms in flight still finish, and those left at the prefill's drain
//!   deadline fail with FAILED(`shutdown`), which the decode counts as `peer_shutdown`. A
//!   decode sends it when it stops: the prefill drops the session and its rooms at once.
//!   With the code `reset` (version 6) the sender is resetting in place to a new group
//!   incarnation (`pd::slot`): its rooms fail with FAILED(`reset`) right after, and it is
//!   back within a moment with a new process incarnation; a decode hearing it from its
//!   prefill handshakes again at once instead of treating the prefill as gone.
//!
//! - **PING / PONG** (decode → prefill → decode) every channel heartbeat (a quarter of
//!   `--channel-deadline-ms`, at most a probe period) while a session is established; the
//!   prefill answers from its socket loop, not from its engine thread, so a prefill busy
//!   computing still answers. Any message from the prefill counts as an answer. When a
//!   PING has gone unanswered for the channel deadline, the decode ends the session as
//!   `peer_unresponsive` (version 5): every room sent there fails with that reason, pushed
//!   as FAILED (a prefill that was only paused drops them when it reads them), new requests
//!   are refused until a new handshake succeeds, and a new HELLO goes out at once. Messages
//!   of the old session that arrive later (a late PONG, DONE of a failed room) change
//!   nothing: the rooms' ends are final and only ACCEPTED establishes a session.
//!
//! # Prefix caching (version 4)
//!
//! PREFILL's `cached` is the number of leading prompt tokens whose KV the decode already
//! holds in its prefix cache: a whole number of KV blocks, less than the prompt. The
//! prefill still runs the whole prompt (from its own prefix cache where it can) and sends
//! the KV of tokens `cached..n` only; the KV_CHUNKs carry that suffix in the usual export
//! layout (its header counts the suffix's tokens), and DONE's prompt tokens stay `n`. The
//! decode stitches its cached blocks and the received suffix into one sequence. A
//! `cached` the prefill cannot honour (not a whole number of its blocks) fails the room.
//!
//! A KV_CHUNK payload is its 36-byte prefix ([`CHUNK_PREFIX`]) then the data. The sender
//! builds that frame once, straight from the exported KV, and hands the buffer to ZeroMQ
//! ([`encode_chunk`]); the receiver reads the prefix in place from the received frame
//! ([`decode_borrowed`]) and copies the data once, into the room's reassembly buffer.
//!
//! A payload must be consumed exactly: trailing bytes are an error. Every length is checked
//! against the bytes actually present before anything is allocated, so decoding never
//! panics and never allocates from an unchecked length.
//!
//! # Handshake (decode initiates, see [`auth`])
//!
//! HELLO(nonce_d) → WELCOME(nonce_p, mac_p) → AUTH(mac_d) → ACCEPTED, or REJECT(reason) at
//! any step. `mac_x = HMAC-SHA256(group key, label_x ‖ nonce_d ‖ nonce_p ‖ decode
//! incarnation ‖ prefill incarnation ‖ group incarnation)` with distinct labels per role,
//! so neither MAC can be replayed as the other and the key never crosses the wire.

pub mod auth;
pub mod checksum;
pub mod chunks;
mod codec;
pub mod decode_session;
pub mod message;
mod prefill_request;
pub mod prefill_session;
pub mod room;
mod timings;

#[cfg(test)]
mod session_deadline_tests;
#[cfg(test)]
mod session_harness;
#[cfg(test)]
mod session_lost_tests;
#[cfg(test)]
mod session_props;
#[cfg(test)]
mod session_tests;
#[cfg(test)]
mod tests;

pub use codec::DecodeError;
pub use message::{
    CHUNK_PREFIX, Decoded, Envelope, FailCode, Header, KvChunk, KvChunkRef, KvLayout, Message,
    MsgType, PrefillRequest, RejectReason, WireLogprob, WireSampling, decode, decode_borrowed,
    encode, encode_chunk,
};
pub use timings::PdTimings;

/// Wire protocol version; bumped on any incompatible change of a payload (2: the chunk
/// checksum is CRC-32C instead of the IEEE CRC-32; 3: PROGRESS, CREDIT and GOODBYE, REJECT
/// reasons `shutting_down` and `peer_expired`, FAILED codes `peer_shutdown` and
/// `send_budget`; 4: PREFILL carries the penalties, the `min_tokens` masking and the `cached`
/// prefix, whose KV is not sent; 5: the FAILED code `peer_unresponsive`; 6: the FAILED and
/// GOODBYE code `reset`). A peer of another version is refused in the handshake with the
/// reason.
pub const PROTOCOL_VERSION: u16 = 6;
pub const MAGIC: &[u8; 4] = b"TKVP";
pub const HEADER_LEN: usize = 36;
/// Largest payload accepted (one KV chunk is at most [`chunks::MAX_CHUNK`]).
pub const MAX_PAYLOAD: usize = 64 << 20;
/// Most prompt tokens in one PREFILL.
pub const MAX_TOKENS: usize = 1 << 20;
/// Most token ids masked until `min_tokens` in one PREFILL (the sampling limit).
pub const MAX_MASKED: usize = crate::sampling::limits::MAX_MASKED;
/// Longest reason text or fingerprint.
pub const MAX_TEXT: usize = 1024;
