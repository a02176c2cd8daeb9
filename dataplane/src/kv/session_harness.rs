//! A decode session and a prefill session joined by an in-memory network, for the session
//! tests: every message goes through the real codec (encoded to frames, decoded from
//! them, KV chunks read in place), time is a variable, the engine is a script. The tests
//! drop, reorder and forge messages, restart the prefill, cut the connection.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::auth::{GroupKey, LocalIdentity};
use super::chunks::{self, BufferPool};
use super::decode_session::{DecodeConfig, DecodeEffect, DecodeEvent, DecodeSession, RoomEnd};
use super::prefill_session::{
    EngineUpdate, PrefillConfig, PrefillEffect, PrefillEvent, PrefillSession,
};
use super::{
    Envelope, KvLayout, Message, PdTimings, PrefillRequest, decode, decode_borrowed, encode,
    encode_chunk,
};
use crate::sampling::SamplingParams;

/// The decode's routing id at the prefill.
pub const DECODE_ID: &[u8] = b"decode-0";
pub const KEY: &[u8] = b"the group key";
pub const GROUP: u64 = 7;
pub const LAYERS: u32 = 2;
/// KV bytes per prompt token per layer in the fake export.
pub const PER_TOKEN_LAYER: usize = 8;

pub fn timings() -> PdTimings {
    PdTimings {
        probe_period: Duration::from_millis(500),
        failure_threshold: 2,
        bootstrap_timeout: Duration::from_secs(2),
        kv_timeout: Duration::from_secs(3),
        // PINGs every 250 ms.
        channel_deadline: Duration::from_secs(1),
    }
}

pub fn identity(incarnation: u64) -> LocalIdentity {
    LocalIdentity {
        incarnation,
        group_incarnation: GROUP,
        fingerprint: "model-1".into(),
        layout: KvLayout {
            dtype: 1,
            layers: LAYERS,
            kv_heads: 2,
            head_dim: 2,
            block_size: 16,
        },
    }
}

pub fn decode_session(t0: Instant) -> DecodeSession {
    DecodeSession::new(
        DecodeConfig {
            addr: "prefill-0:5600".into(),
            local: identity(0xD0D0),
            key: GroupKey::new(KEY),
            timings: timings(),
            per_token: (LAYERS as usize * PER_TOKEN_LAYER) as u64,
            send_budget: 1 << 20,
            pool: BufferPool::default(),
            seed: Some(1),
        },
        t0,
    )
}

pub fn prefill_session(incarnation: u64, key: &[u8]) -> PrefillSession {
    PrefillSession::new(PrefillConfig {
        local: identity(incarnation),
        key: GroupKey::new(key),
        timings: timings(),
        send_budget: 1 << 20,
        seed: Some(incarnation),
    })
}

/// The KV a prefill exports for `tokens` prompt tokens (the `TKV1` layout: 32-byte
/// header with the layer count at 8..12, then one equal slice per layer).
pub fn fake_export(tokens: usize) -> Vec<u8> {
    let mut p = b"TKV1".to_vec();
    p.extend_from_slice(&1u32.to_le_bytes());
    p.extend_from_slice(&LAYERS.to_le_bytes());
    p.resize(32, 0);
    p.extend((0..LAYERS as usize * tokens * PER_TOKEN_LAYER).map(|i| (i * 7 % 251) as u8));
    p
}

pub fn request(tokens: usize) -> PrefillRequest {
    PrefillRequest {
        tokens: (0..tokens as u32).collect(),
        sampling: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        cached_tokens: 0,
    }
}

/// Frames on the wire.
pub type Frames = Vec<Vec<u8>>;

pub fn frames_of(env: &Envelope) -> Frames {
    encode(env).to_vec()
}

/// One line of [`Pair::decode_log`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contact {
    /// The decode sent a PING (whether or not it got through).
    Ping,
    /// The decode heard a message from this prefill incarnation.
    Heard(u64),
}

/// The two sessions, the wire between them, the engine's rooms, and the record of every
/// room's end.
pub struct Pair {
    pub now: Instant,
    pub decode: DecodeSession,
    pub prefill: PrefillSession,
    pub prefill_incarnation: u64,
    /// In flight towards the prefill / the decode.
    pub to_prefill: VecDeque<Frames>,
    pub to_decode: VecDeque<Frames>,
    /// Rooms the engine holds: room → prompt length.
    pub engine: HashMap<u64, usize>,
    /// Every room end the decode reported, and every room it was asked to open.
    pub decode_ended: Vec<(u64, RoomEnd)>,
    pub decode_opened: Vec<u64>,
    /// Every room end the prefill reported, and every room it submitted.
    pub prefill_ended: Vec<u64>,
    pub prefill_submitted: Vec<u64>,
    /// Every effect of the decode, in order, and the incarnation of each message it
    /// received (for the invariants).
    pub decode_effects: Vec<DecodeEffect>,
    pub decode_heard: Vec<u64>,
    /// The decode's PINGs and the messages it heard, in order, with their times (for the
    /// channel deadline's invariant).
    pub decode_log: Vec<(Instant, Contact)>,
    /// A send fails (no connection) while true.
    pub cut: bool,
}

impl Pair {
    pub fn new() -> Self {
        let now = Instant::now();
        Self {
            now,
            decode: decode_session(now),
            prefill: prefill_session(0xAAAA, KEY),
            prefill_incarnation: 0xAAAA,
            to_prefill: VecDeque::new(),
            to_decode: VecDeque::new(),
            engine: HashMap::new(),
            decode_ended: Vec::new(),
            decode_opened: Vec::new(),
            prefill_ended: Vec::new(),
            prefill_submitted: Vec::new(),
            decode_effects: Vec::new(),
            decode_heard: Vec::new(),
            decode_log: Vec::new(),
            cut: false,
        }
    }

    pub fn advance(&mut self, d: Duration) {
        self.now += d;
    }

    /// One event to the decode; its effects are carried out (sends go on the wire, a
    /// failed send comes back at once).
    pub fn decode_event(&mut self, e: DecodeEvent<'_>) {
        let effects = self.decode.on(e, self.now);
        self.decode_effects_out(effects);
    }

    fn decode_effects_out(&mut self, effects: Vec<DecodeEffect>) {
        let mut todo: VecDeque<DecodeEffect> = effects.into();
        while let Some(e) = todo.pop_front() {
            match &e {
                DecodeEffect::Send { room, msg } => {
                    if matches!(msg, Message::Ping { .. }) {
                        self.decode_log.push((self.now, Contact::Ping));
                    }
                    if self.cut {
                        let t = msg.msg_type();
                        let more = self.decode.on(
                            DecodeEvent::SendFailed {
                                room: *room,
                                msg: t,
                            },
                            self.now,
                        );
                        todo.extend(more);
                    } else {
                        let env = Envelope {
                            incarnation: 0xD0D0,
                            group_incarnation: GROUP,
                            room: *room,
                            msg: msg.clone(),
                        };
                        self.to_prefill.push_back(frames_of(&env));
                    }
                }
                DecodeEffect::RoomEnded { room, end } => {
                    self.decode_ended.push((*room, clone_end(end)));
                }
                DecodeEffect::Note(_) => {}
            }
            self.decode_effects.push(e);
        }
    }

    pub fn prefill_event(&mut self, e: PrefillEvent<'_>) {
        let effects = self.prefill.on(e, self.now);
        let mut todo: VecDeque<PrefillEffect> = effects.into();
        while let Some(e) = todo.pop_front() {
            match e {
                PrefillEffect::Send { room, msg, .. } => {
                    if !self.cut {
                        let env = Envelope {
                            incarnation: self.prefill_incarnation,
                            group_incarnation: GROUP,
                            room,
                            msg,
                        };
                        self.to_decode.push_back(frames_of(&env));
                    }
                }
                PrefillEffect::Submit { room, request } => {
                    self.prefill_submitted.push(room);
                    self.engine.insert(room, request.prompt.len());
                }
                PrefillEffect::StreamKv {
                    room,
                    payload,
                    done,
                    ..
                } => {
                    let mut sent = 0;
                    if !self.cut {
                        for c in chunks::plan(&payload) {
                            let f = encode_chunk(self.prefill_incarnation, GROUP, room, &c);
                            sent += c.data.len() as u64;
                            self.to_decode.push_back(f.to_vec());
                        }
                        let env = Envelope {
                            incarnation: self.prefill_incarnation,
                            group_incarnation: GROUP,
                            room,
                            msg: done,
                        };
                        self.to_decode.push_back(frames_of(&env));
                    }
                    let failed = self
                        .cut
                        .then_some(("peer_unreachable", "KV chunk send failed"));
                    todo.extend(
                        self.prefill
                            .on(PrefillEvent::Streamed { room, sent, failed }, self.now),
                    );
                }
                PrefillEffect::RoomEnded { room, .. } => {
                    self.engine.remove(&room);
                    self.prefill_ended.push(room);
                }
                PrefillEffect::Note(_) => {}
            }
        }
    }

    /// Deliver the next message towards the decode; false when none is in flight.
    pub fn deliver_to_decode(&mut self) -> bool {
        let Some(f) = self.to_decode.pop_front() else {
            return false;
        };
        self.deliver_frames_to_decode(&f);
        true
    }

    pub fn deliver_frames_to_decode(&mut self, f: &Frames) {
        let refs: Vec<&[u8]> = f.iter().map(Vec::as_slice).collect();
        match decode_borrowed(&refs) {
            Ok((h, d)) => {
                self.decode_heard.push(h.incarnation);
                self.decode_log
                    .push((self.now, Contact::Heard(h.incarnation)));
                let effects = self.decode.on(DecodeEvent::Received(h, d), self.now);
                self.decode_effects_out(effects);
            }
            Err(e) => {
                let effects = self.decode.on(DecodeEvent::Undecodable(&e), self.now);
                self.decode_effects_out(effects);
            }
        }
    }

    /// Deliver the next message towards the prefill; false when none is in flight.
    pub fn deliver_to_prefill(&mut self) -> bool {
        let Some(f) = self.to_prefill.pop_front() else {
            return false;
        };
        let refs: Vec<&[u8]> = f.iter().map(Vec::as_slice).collect();
        match decode(&refs) {
            Ok(env) => self.prefill_event(PrefillEvent::Received {
                peer: DECODE_ID,
                env,
            }),
            Err(e) => self.prefill_event(PrefillEvent::Undecodable {
                peer: DECODE_ID,
                error: &e,
            }),
        }
        true
    }

    /// Deliver everything in flight both ways until the wire is quiet.
    pub fn settle(&mut self) {
        while self.deliver_to_prefill() | self.deliver_to_decode() {}
    }

    pub fn tick(&mut self) {
        self.decode_event(DecodeEvent::Tick);
        self.prefill_event(PrefillEvent::Tick { engine_live: true });
    }

    /// Tick both, then settle the wire.
    pub fn round(&mut self) {
        self.tick();
        self.settle();
    }

    pub fn open(&mut self, room: u64, tokens: usize) {
        self.decode_opened.push(room);
        self.decode_event(DecodeEvent::Open {
            room,
            req: request(tokens),
        });
    }

    /// The engine finishes `room`: its token, its KV, done.
    pub fn engine_finishes(&mut self, room: u64) {
        let Some(tokens) = self.engine.get(&room).copied() else {
            return;
        };
        for update in [
            EngineUpdate::Progress { prefilled: tokens },
            EngineUpdate::Token {
                token: 42,
                logprob: None,
            },
            EngineUpdate::Exported(fake_export(tokens)),
            EngineUpdate::Done,
        ] {
            self.prefill_event(PrefillEvent::Engine { room, update });
        }
    }

    /// The prefill process is replaced by a new one (a new incarnation, nothing in flight
    /// from the old one survives on the wire towards the decode).
    pub fn restart_prefill(&mut self, incarnation: u64) {
        self.prefill = prefill_session(incarnation, KEY);
        self.prefill_incarnation = incarnation;
        self.engine.clear();
        self.to_prefill.clear();
    }

    /// Establish the channel from scratch (a few rounds).
    pub fn establish(&mut self) {
        for _ in 0..3 {
            self.round();
        }
    }
}

fn clone_end(e: &RoomEnd) -> RoomEnd {
    match e {
        RoomEnd::Done {
            payload,
            first_token,
            first_logprob,
        } => RoomEnd::Done {
            payload: payload.to_vec().into(),
            first_token: *first_token,
            first_logprob: first_logprob.clone(),
        },
        RoomEnd::Failed {
            code,
            text,
            peer_incarnation,
        } => RoomEnd::Failed {
            code: *code,
            text: text.clone(),
            peer_incarnation: *peer_incarnation,
        },
        RoomEnd::Aborted { reason, acked } => RoomEnd::Aborted {
            reason,
            acked: *acked,
        },
    }
}

/// The messages the decode sent, by type, in order.
pub fn sent_by_decode(effects: &[DecodeEffect]) -> Vec<&Message> {
    effects
        .iter()
        .filter_map(|e| match e {
            DecodeEffect::Send { msg, .. } => Some(msg),
            _ => None,
        })
        .collect()
}
