//! Message types and their encoding into / decoding from the two frames documented in the
//! module header of `kv`.

use super::codec::{DecodeError, Reader, Writer};
pub use super::prefill_request::{PrefillRequest, WireSampling};
use super::{HEADER_LEN, MAGIC, MAX_MASKED, MAX_PAYLOAD, MAX_TEXT, MAX_TOKENS, PROTOCOL_VERSION};
use crate::sampling::SamplingParams;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MsgType {
    Hello = 1,
    Welcome = 2,
    Auth = 3,
    Accepted = 4,
    Reject = 5,
    Prefill = 6,
    KvChunk = 7,
    Done = 8,
    Failed = 9,
    Abort = 10,
    AbortAck = 11,
    Ping = 12,
    Pong = 13,
    Progress = 14,
    Credit = 15,
    Goodbye = 16,
}

impl MsgType {
    pub fn from_u8(v: u8) -> Option<Self> {
        use MsgType::*;
        Some(match v {
            1 => Hello,
            2 => Welcome,
            3 => Auth,
            4 => Accepted,
            5 => Reject,
            6 => Prefill,
            7 => KvChunk,
            8 => Done,
            9 => Failed,
            10 => Abort,
            11 => AbortAck,
            12 => Ping,
            13 => Pong,
            14 => Progress,
            15 => Credit,
            16 => Goodbye,
            _ => return None,
        })
    }

    /// Whether the header's room id must be non-zero (room messages) or zero (the rest).
    fn has_room(self) -> bool {
        use MsgType::*;
        matches!(
            self,
            Prefill | KvChunk | Done | Failed | Abort | AbortAck | Progress
        )
    }
}

/// Shape of the KV cache; both sides must agree before any KV moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvLayout {
    /// GGML type id of the stored rows.
    pub dtype: u32,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub block_size: u32,
}

macro_rules! codes {
    ($(#[$m:meta])* $name:ident { $($var:ident = $n:literal => $label:literal,)* }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name { $($var,)* }
        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$var,)*];
            pub fn code(self) -> u8 { match self { $($name::$var => $n,)* } }
            pub fn from_code(c: u8) -> Option<Self> { match c { $($n => Some($name::$var),)* _ => None } }
            /// Metrics / log label.
            pub fn label(self) -> &'static str { match self { $($name::$var => $label,)* } }
        }
    };
}

codes!(
    /// Why a handshake (or a message from an unknown peer) was refused.
    RejectReason {
        VersionMismatch = 1 => "version_mismatch",
        ModelMismatch = 2 => "model_mismatch",
        LayoutMismatch = 3 => "layout_mismatch",
        IncarnationMismatch = 4 => "incarnation_mismatch",
        AuthFailed = 5 => "auth_failed",
        NotAuthenticated = 6 => "not_authenticated",
        Malformed = 7 => "malformed",
        ShuttingDown = 8 => "shutting_down",
        SessionExpired = 9 => "peer_expired",
    }
);

codes!(
    /// Why a room ended in `Failed`.
    FailCode {
        PeerRestarted = 1 => "peer_restarted",
        BootstrapTimeout = 2 => "bootstrap_timeout",
        KvTimeout = 3 => "kv_timeout",
        QueueTimeout = 4 => "queue_timeout",
        EngineFailed = 5 => "engine_failed",
        BadChunk = 6 => "bad_chunk",
        DuplicateRoom = 7 => "duplicate_room",
        NotAuthenticated = 8 => "not_authenticated",
        SendFailed = 9 => "send_failed",
        LoopPanic = 10 => "loop_panic",
        TooLarge = 11 => "too_large",
        Overloaded = 12 => "overloaded",
        NoPeer = 13 => "no_peer",
        ImportFailed = 14 => "import_failed",
        Incomplete = 15 => "incomplete_kv",
        Shutdown = 16 => "shutdown",
        PeerExpired = 17 => "peer_expired",
        PeerShutdown = 18 => "peer_shutdown",
        SendBudget = 19 => "send_budget",
        // Decode-local: the TCP connection to the prefill closed with the room in flight.
        // Never sent (the peer is gone).
        PeerLost = 20 => "peer_lost",
        // The decode heard nothing from an established prefill for the channel deadline
        // after a PING: the room fails at once (version 5). Pushed as FAILED, so a prefill
        // that was only paused drops the room when it reads it.
        PeerUnresponsive = 21 => "peer_unresponsive",
        // The sender resets in place to a new group incarnation (version 6): its rooms end
        // as at a shutdown, but the process stays and is back at once with a new
        // incarnation, so the receiver handshakes again right away instead of waiting for
        // a replacement.
        Reset = 22 => "reset",
    }
);

#[derive(Debug, Clone, PartialEq)]
pub struct KvChunk {
    /// Position of this chunk in the room's sequence of chunks (0-based) and their count.
    pub index: u32,
    pub count: u32,
    /// Model layers whose K and V rows this chunk carries: `first_layer..end_layer`.
    pub first_layer: u16,
    pub end_layer: u16,
    /// Byte offset of `data` in the exported KV buffer, and that buffer's total size.
    pub offset: u64,
    pub total: u64,
    /// CRC-32C (Castagnoli) of `data`.
    pub crc32: u32,
    pub data: Vec<u8>,
}

/// A KV chunk whose data is borrowed: from the exported KV buffer on the sender, from the
/// received ZeroMQ frame on the receiver, so neither side copies the bytes to encode or
/// decode them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvChunkRef<'a> {
    pub index: u32,
    pub count: u32,
    pub first_layer: u16,
    pub end_layer: u16,
    pub offset: u64,
    pub total: u64,
    /// CRC-32C of `data`.
    pub crc32: u32,
    pub data: &'a [u8],
}

impl KvChunkRef<'_> {
    pub fn to_owned(&self) -> KvChunk {
        KvChunk {
            index: self.index,
            count: self.count,
            first_layer: self.first_layer,
            end_layer: self.end_layer,
            offset: self.offset,
            total: self.total,
            crc32: self.crc32,
            data: self.data.to_vec(),
        }
    }
}

impl<'a> From<&'a KvChunk> for KvChunkRef<'a> {
    fn from(c: &'a KvChunk) -> Self {
        KvChunkRef {
            index: c.index,
            count: c.count,
            first_layer: c.first_layer,
            end_layer: c.end_layer,
            offset: c.offset,
            total: c.total,
            crc32: c.crc32,
            data: &c.data,
        }
    }
}

/// The first token's log-probability and top alternatives, computed by the prefill.
#[derive(Debug, Clone, PartialEq)]
pub struct WireLogprob {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    Hello {
        fingerprint: String,
        layout: KvLayout,
        nonce: [u8; 32],
    },
    Welcome {
        fingerprint: String,
        layout: KvLayout,
        nonce: [u8; 32],
        mac: [u8; 32],
    },
    Auth {
        mac: [u8; 32],
    },
    Accepted,
    Reject {
        reason: RejectReason,
        text: String,
    },
    Prefill(PrefillRequest),
    KvChunk(KvChunk),
    Done {
        first_token: u32,
        prompt_tokens: u32,
        logprob: Option<WireLogprob>,
    },
    Failed {
        reason: FailCode,
        text: String,
    },
    Abort,
    AbortAck,
    Ping {
        nonce: u64,
        timestamp_us: u64,
    },
    Pong {
        nonce: u64,
        timestamp_us: u64,
    },
    /// Prefill → decode: the room is still being worked on (`done` of `total` prompt
    /// tokens prefilled), so the decode's no-progress deadline measures silence.
    Progress {
        done: u32,
        total: u32,
    },
    /// Decode → prefill: KV chunk data bytes received from this prefill since the session
    /// was established; the prefill's unacknowledged bytes are what it sent minus this.
    Credit {
        consumed: u64,
    },
    /// Either side: this process is shutting down (or leaving the session); the receiver
    /// stops sending it new work. Rooms in flight end by their own messages.
    Goodbye {
        reason: FailCode,
        text: String,
    },
}

impl Message {
    pub fn msg_type(&self) -> MsgType {
        match self {
            Self::Hello { .. } => MsgType::Hello,
            Self::Welcome { .. } => MsgType::Welcome,
            Self::Auth { .. } => MsgType::Auth,
            Self::Accepted => MsgType::Accepted,
            Self::Reject { .. } => MsgType::Reject,
            Self::Prefill(_) => MsgType::Prefill,
            Self::KvChunk(_) => MsgType::KvChunk,
            Self::Done { .. } => MsgType::Done,
            Self::Failed { .. } => MsgType::Failed,
            Self::Abort => MsgType::Abort,
            Self::AbortAck => MsgType::AbortAck,
            Self::Ping { .. } => MsgType::Ping,
            Self::Pong { .. } => MsgType::Pong,
            Self::Progress { .. } => MsgType::Progress,
            Self::Credit { .. } => MsgType::Credit,
            Self::Goodbye { .. } => MsgType::Goodbye,
        }
    }
}

/// The fixed header's fields other than magic, version and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub version: u16,
    pub msg_type: u8,
    pub flags: u8,
    pub incarnation: u64,
    pub group_incarnation: u64,
    pub room: u64,
}

/// A decoded message with the sender facts from its header.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    pub incarnation: u64,
    pub group_incarnation: u64,
    /// Non-zero exactly for room messages.
    pub room: u64,
    pub msg: Message,
}

/// Encode into the two frames. The caller is responsible for a non-zero `room` on room
/// messages (a zero room id there is refused by every decoder).
pub fn encode(env: &Envelope) -> [Vec<u8>; 2] {
    let payload = encode_payload(&env.msg);
    let h = encode_header(
        env.msg.msg_type(),
        env.incarnation,
        env.group_incarnation,
        env.room,
        payload.len(),
    );
    [h, payload]
}

fn encode_header(t: MsgType, incarnation: u64, group: u64, room: u64, len: usize) -> Vec<u8> {
    let mut h = Writer {
        buf: Vec::with_capacity(HEADER_LEN),
    };
    h.bytes(MAGIC);
    h.u16(PROTOCOL_VERSION);
    h.u8(t as u8);
    h.u8(0);
    h.u64(incarnation);
    h.u64(group);
    h.u64(room);
    h.u32(len as u32);
    h.buf
}

/// Bytes of a KV_CHUNK payload in front of the chunk data.
pub const CHUNK_PREFIX: usize = 36;

/// Encode one KV_CHUNK into its two frames with exactly one copy of the data: the payload
/// frame is allocated at its final size and filled straight from `c.data`, so the caller
/// can hand the `Vec` to ZeroMQ without another copy. Same bytes as [`encode`].
pub fn encode_chunk(incarnation: u64, group: u64, room: u64, c: &KvChunkRef<'_>) -> [Vec<u8>; 2] {
    let mut w = Writer {
        buf: Vec::with_capacity(CHUNK_PREFIX + c.data.len()),
    };
    chunk_prefix(&mut w, c);
    w.bytes(c.data);
    let h = encode_header(MsgType::KvChunk, incarnation, group, room, w.buf.len());
    [h, w.buf]
}

fn chunk_prefix(w: &mut Writer, c: &KvChunkRef<'_>) {
    w.u32(c.index);
    w.u32(c.count);
    w.u16(c.first_layer);
    w.u16(c.end_layer);
    w.u64(c.offset);
    w.u64(c.total);
    w.u32(c.crc32);
    w.u32(c.data.len() as u32);
}

fn layout(w: &mut Writer, l: &KvLayout) {
    for v in [l.dtype, l.layers, l.kv_heads, l.head_dim, l.block_size] {
        w.u32(v);
    }
}

fn encode_payload(m: &Message) -> Vec<u8> {
    let mut w = Writer::default();
    match m {
        Message::Hello {
            fingerprint,
            layout: l,
            nonce,
        } => {
            w.str16(fingerprint, MAX_TEXT);
            layout(&mut w, l);
            w.bytes(nonce);
        }
        Message::Welcome {
            fingerprint,
            layout: l,
            nonce,
            mac,
        } => {
            w.str16(fingerprint, MAX_TEXT);
            layout(&mut w, l);
            w.bytes(nonce);
            w.bytes(mac);
        }
        Message::Auth { mac } => w.bytes(mac),
        Message::Accepted | Message::Abort | Message::AbortAck => {}
        Message::Reject { reason, text } => {
            w.u8(reason.code());
            w.str16(text, MAX_TEXT);
        }
        Message::Failed { reason, text } | Message::Goodbye { reason, text } => {
            w.u8(reason.code());
            w.str16(text, MAX_TEXT);
        }
        Message::Progress { done, total } => {
            w.u32(*done);
            w.u32(*total);
        }
        Message::Credit { consumed } => w.u64(*consumed),
        Message::Prefill(p) => {
            w.u32(p.tokens.len() as u32);
            for &t in &p.tokens {
                w.u32(t);
            }
            let s = WireSampling::from(&p.sampling);
            w.f32(s.temperature);
            w.u32(s.top_k);
            w.f32(s.top_p);
            w.u8(s.seed.is_some() as u8);
            w.u64(s.seed.unwrap_or(0));
            w.u8(s.logprobs.is_some() as u8);
            w.u32(s.logprobs.unwrap_or(0));
            w.f32(s.repetition_penalty);
            w.f32(s.frequency_penalty);
            w.f32(s.presence_penalty);
            w.u32(s.min_tokens);
            w.u32(s.min_tokens_masked.len() as u32);
            for &t in &s.min_tokens_masked {
                w.u32(t);
            }
            w.u32(p.cached_tokens);
        }
        Message::KvChunk(c) => {
            chunk_prefix(&mut w, &c.into());
            w.bytes(&c.data);
        }
        Message::Done {
            first_token,
            prompt_tokens,
            logprob,
        } => {
            w.u32(*first_token);
            w.u32(*prompt_tokens);
            w.u8(logprob.is_some() as u8);
            if let Some(lp) = logprob {
                w.f32(lp.logprob);
                let top = &lp.top[..lp.top.len().min(u8::MAX as usize)];
                w.u8(top.len() as u8);
                for &(t, l) in top {
                    w.u32(t);
                    w.f32(l);
                }
            }
        }
        Message::Ping {
            nonce,
            timestamp_us,
        }
        | Message::Pong {
            nonce,
            timestamp_us,
        } => {
            w.u64(*nonce);
            w.u64(*timestamp_us);
        }
    }
    w.buf
}

/// Parse and check the fixed header (frame 0) against the payload length.
pub fn decode_header(h: &[u8], payload_len: usize) -> Result<Header, DecodeError> {
    if h.len() < 7 {
        return Err(DecodeError::Truncated {
            needed: HEADER_LEN - h.len(),
        });
    }
    if &h[..4] != MAGIC {
        return Err(DecodeError::BadMagic);
    }
    let mut r = Reader::new(&h[4..]);
    let version = r.u16()?;
    let msg_type = r.u8()?;
    if version != PROTOCOL_VERSION {
        return Err(DecodeError::WrongVersion {
            got: version,
            want: PROTOCOL_VERSION,
            msg_type,
        });
    }
    if h.len() != HEADER_LEN {
        return Err(DecodeError::BadLength(format!(
            "header of {} bytes, expected {HEADER_LEN}",
            h.len()
        )));
    }
    let flags = r.u8()?;
    let incarnation = r.u64()?;
    let group_incarnation = r.u64()?;
    let room = r.u64()?;
    let len = r.u32()? as usize;
    r.finish()?;
    if payload_len > MAX_PAYLOAD {
        return Err(DecodeError::Oversized(payload_len));
    }
    if len != payload_len {
        return Err(DecodeError::BadLength(format!(
            "header says {len} payload bytes, frame has {payload_len}"
        )));
    }
    Ok(Header {
        version,
        msg_type,
        flags,
        incarnation,
        group_incarnation,
        room,
    })
}

/// Decode the two frames of one message. Never panics; every failure is typed.
pub fn decode(frames: &[&[u8]]) -> Result<Envelope, DecodeError> {
    let (hdr, d) = decode_borrowed(frames)?;
    let msg = match d {
        Decoded::Chunk(c) => Message::KvChunk(c.to_owned()),
        Decoded::Message(m) => m,
    };
    Ok(Envelope {
        incarnation: hdr.incarnation,
        group_incarnation: hdr.group_incarnation,
        room: hdr.room,
        msg,
    })
}

/// A decoded message whose KV chunk data, if any, still lives in the received frame.
#[derive(Debug, Clone, PartialEq)]
pub enum Decoded<'a> {
    Chunk(KvChunkRef<'a>),
    Message(Message),
}

/// Decode the two frames of one message without copying KV chunk data; every check of
/// [`decode`] applies (it is implemented on top of this).
pub fn decode_borrowed<'a>(frames: &[&'a [u8]]) -> Result<(Header, Decoded<'a>), DecodeError> {
    let [h, p] = frames else {
        return Err(DecodeError::FrameCount(frames.len()));
    };
    let hdr = decode_header(h, p.len())?;
    let t = MsgType::from_u8(hdr.msg_type).ok_or(DecodeError::UnknownType(hdr.msg_type))?;
    if t.has_room() != (hdr.room != 0) {
        return Err(DecodeError::BadRoom { room: hdr.room });
    }
    let d = if t == MsgType::KvChunk {
        Decoded::Chunk(decode_chunk_payload(p)?)
    } else {
        Decoded::Message(decode_payload(t, p)?)
    };
    Ok((hdr, d))
}

fn decode_chunk_payload(p: &[u8]) -> Result<KvChunkRef<'_>, DecodeError> {
    let mut r = Reader::new(p);
    let index = r.u32()?;
    let count = r.u32()?;
    let first_layer = r.u16()?;
    let end_layer = r.u16()?;
    let offset = r.u64()?;
    let total = r.u64()?;
    let crc32 = r.u32()?;
    let n = r.u32()? as usize;
    let data = r.take(n)?;
    if index >= count || first_layer > end_layer {
        return Err(DecodeError::BadValue(format!(
            "chunk {index} of {count}, layers {first_layer}..{end_layer}"
        )));
    }
    if offset.checked_add(n as u64).is_none_or(|end| end > total) {
        return Err(DecodeError::BadLength(format!(
            "chunk bytes {offset}+{n} beyond the total {total}"
        )));
    }
    r.finish()?;
    Ok(KvChunkRef {
        index,
        count,
        first_layer,
        end_layer,
        offset,
        total,
        crc32,
        data,
    })
}

fn read_layout(r: &mut Reader) -> Result<KvLayout, DecodeError> {
    Ok(KvLayout {
        dtype: r.u32()?,
        layers: r.u32()?,
        kv_heads: r.u32()?,
        head_dim: r.u32()?,
        block_size: r.u32()?,
    })
}

fn decode_payload(t: MsgType, p: &[u8]) -> Result<Message, DecodeError> {
    let mut r = Reader::new(p);
    let reason_text = |r: &mut Reader| -> Result<(u8, String), DecodeError> {
        let c = r.u8()?;
        Ok((c, r.str16(MAX_TEXT)?))
    };
    let m = match t {
        MsgType::Hello => Message::Hello {
            fingerprint: r.str16(MAX_TEXT)?,
            layout: read_layout(&mut r)?,
            nonce: r.array()?,
        },
        MsgType::Welcome => Message::Welcome {
            fingerprint: r.str16(MAX_TEXT)?,
            layout: read_layout(&mut r)?,
            nonce: r.array()?,
            mac: r.array()?,
        },
        MsgType::Auth => Message::Auth { mac: r.array()? },
        MsgType::Accepted => Message::Accepted,
        MsgType::Abort => Message::Abort,
        MsgType::AbortAck => Message::AbortAck,
        MsgType::Reject => {
            let (c, text) = reason_text(&mut r)?;
            let reason = RejectReason::from_code(c)
                .ok_or_else(|| DecodeError::BadValue(format!("reject reason {c}")))?;
            Message::Reject { reason, text }
        }
        MsgType::Failed | MsgType::Goodbye => {
            let (c, text) = reason_text(&mut r)?;
            let reason = FailCode::from_code(c)
                .ok_or_else(|| DecodeError::BadValue(format!("failure code {c}")))?;
            if t == MsgType::Failed {
                Message::Failed { reason, text }
            } else {
                Message::Goodbye { reason, text }
            }
        }
        MsgType::Progress => Message::Progress {
            done: r.u32()?,
            total: r.u32()?,
        },
        MsgType::Credit => Message::Credit { consumed: r.u64()? },
        MsgType::Prefill => {
            let n = r.u32()? as usize;
            if n == 0 || n > MAX_TOKENS {
                return Err(DecodeError::BadLength(format!("{n} prompt tokens")));
            }
            r.check_count(n, 4)?;
            let tokens = (0..n).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
            let temperature = r.f32()?;
            let top_k = r.u32()?;
            let top_p = r.f32()?;
            let has_seed = r.flag()?;
            let seed = r.u64()?;
            let has_lp = r.flag()?;
            let lp = r.u32()?;
            let repetition_penalty = r.f32()?;
            let frequency_penalty = r.f32()?;
            let presence_penalty = r.f32()?;
            let min_tokens = r.u32()?;
            let m = r.u32()? as usize;
            if m > MAX_MASKED {
                return Err(DecodeError::BadLength(format!("{m} masked token ids")));
            }
            r.check_count(m, 4)?;
            let min_tokens_masked = (0..m).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
            let cached_tokens = r.u32()?;
            if cached_tokens as usize >= n {
                return Err(DecodeError::BadValue(format!(
                    "{cached_tokens} cached tokens of a {n}-token prompt"
                )));
            }
            let wire = WireSampling {
                temperature,
                top_k,
                top_p,
                seed: has_seed.then_some(seed),
                logprobs: has_lp.then_some(lp),
                repetition_penalty,
                frequency_penalty,
                presence_penalty,
                min_tokens,
                min_tokens_masked,
            };
            let sampling = SamplingParams::try_from(wire)
                .map_err(|e| DecodeError::BadValue(format!("sampling: {e}")))?;
            Message::Prefill(PrefillRequest {
                tokens,
                sampling,
                cached_tokens,
            })
        }
        MsgType::KvChunk => {
            let c = decode_chunk_payload(p)?;
            return Ok(Message::KvChunk(c.to_owned()));
        }
        MsgType::Done => {
            let first_token = r.u32()?;
            let prompt_tokens = r.u32()?;
            let logprob = if r.flag()? {
                let logprob = r.f32()?;
                let k = r.u8()? as usize;
                r.check_count(k, 8)?;
                let top = (0..k)
                    .map(|_| Ok((r.u32()?, r.f32()?)))
                    .collect::<Result<Vec<_>, DecodeError>>()?;
                Some(WireLogprob { logprob, top })
            } else {
                None
            };
            Message::Done {
                first_token,
                prompt_tokens,
                logprob,
            }
        }
        MsgType::Ping => Message::Ping {
            nonce: r.u64()?,
            timestamp_us: r.u64()?,
        },
        MsgType::Pong => Message::Pong {
            nonce: r.u64()?,
            timestamp_us: r.u64()?,
        },
    };
    r.finish()?;
    Ok(m)
}
