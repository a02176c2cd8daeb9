//! The prefill's rooms: a PREFILL becomes an engine request; PROGRESS keeps the decode
//! informed while the engine works; the KV goes out within the decode's send budget;
//! every room ends once, with a reason pushed to the decode when it failed.

use std::time::Instant;

use super::{
    DropReason, EngineRequest, EngineUpdate, PeerId, PrefillEffect, PrefillNote, PrefillSession,
    RoomEnd, Session,
};
use crate::kv::room::RoomState;
use crate::kv::{FailCode, Message, PrefillRequest, WireLogprob};
use crate::sampling::TokenLogprob;

/// One room as the prefill sees it.
#[derive(Debug)]
pub(super) struct PrefillRoom {
    pub(super) peer: PeerId,
    pub(super) peer_incarnation: u64,
    pub(super) prompt_tokens: u32,
    /// Prompt tokens the engine has prefilled so far.
    pub(super) done_tokens: u32,
    pub(super) last_progress_sent: Instant,
    pub(super) first: Option<(u32, Option<TokenLogprob>)>,
    pub(super) export: Option<Vec<u8>>,
}

impl PrefillSession {
    pub(super) fn prefill(
        &mut self,
        peer: &[u8],
        peer_inc: u64,
        room: u64,
        req: PrefillRequest,
        now: Instant,
    ) {
        let kind = if self.rooms.get(room).is_some() {
            Some("duplicate_room")
        } else if self.rooms.is_finished(room) {
            Some("finished_room")
        } else {
            None
        };
        if let Some(kind) = kind {
            // Never resurrect or disturb an existing room: count and drop.
            self.note(PrefillNote::DuplicateRoom {
                peer: peer.to_vec(),
                room,
                kind,
            });
            return;
        }
        self.note(PrefillNote::RoomOpened);
        if self.draining {
            let text = "this prefill is shutting down".to_string();
            self.note(PrefillNote::RoomRefused {
                peer: peer.to_vec(),
                room,
                peer_incarnation: peer_inc,
                code: FailCode::Shutdown,
                text: text.clone(),
            });
            let msg = Message::Failed {
                reason: FailCode::Shutdown,
                text,
            };
            self.send(peer, room, msg);
            return;
        }
        let prompt_tokens = req.tokens.len() as u32;
        let data = PrefillRoom {
            peer: peer.to_vec(),
            peer_incarnation: peer_inc,
            prompt_tokens,
            done_tokens: 0,
            last_progress_sent: now,
            first: None,
            export: None,
        };
        // Checked above: the id is fresh.
        let _ = self.rooms.open(room, RoomState::WaitingKv, data, now);
        self.out.push(PrefillEffect::Submit {
            room,
            request: EngineRequest {
                prompt: req.tokens,
                sampling: req.sampling,
                export_from: req.cached_tokens as usize,
            },
        });
    }

    pub(super) fn engine(&mut self, room: u64, update: EngineUpdate, now: Instant) {
        let Some(r) = self.rooms.get_mut(room) else {
            return;
        };
        match update {
            EngineUpdate::Token { token, logprob } => r.data.first = Some((token, logprob)),
            EngineUpdate::Exported(p) => r.data.export = Some(p),
            EngineUpdate::Progress { prefilled } => {
                r.data.done_tokens = prefilled.min(u32::MAX as usize) as u32;
            }
            EngineUpdate::Done => self.stream_out(room, now),
            EngineUpdate::Failed { code, message } => self.fail_room(room, code, &message, now),
            EngineUpdate::Gone => self.fail_room(
                room,
                FailCode::EngineFailed,
                "engine ended the request",
                now,
            ),
        }
    }

    /// While the engine loop goes round, every room it holds is being worked on: tell each
    /// decode so at most every `progress_every`, and keep the room's own deadline fresh.
    pub(super) fn keep_alive(&mut self, now: Instant) {
        let due: Vec<(u64, PeerId, u32, u32)> = self
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
            self.send(&peer, id, Message::Progress { done, total });
            if let Some(r) = self.rooms.get_mut(id) {
                r.data.last_progress_sent = now;
            }
            let _ = self.rooms.advance(id, RoomState::WaitingKv, now);
        }
    }

    pub(super) fn stream_out(&mut self, id: u64, now: Instant) {
        let Some(r) = self.rooms.get_mut(id) else {
            return;
        };
        let (Some((first, lp)), Some(payload)) = (r.data.first.take(), r.data.export.take()) else {
            self.fail_room(
                id,
                FailCode::EngineFailed,
                "engine finished without a token or KV",
                now,
            );
            return;
        };
        let (peer, prompt_tokens) = (r.data.peer.clone(), r.data.prompt_tokens);
        // The send budget in bytes: KV handed to ZeroMQ for one decode and not yet
        // acknowledged stays within it; a room that would pass it fails now rather than
        // queue. (With nothing in flight a room is always sent, so one larger than the
        // budget still goes: a peer then pins at most max(budget, one room).)
        let in_flight = self.sessions.get(&peer).map_or(0, Session::in_flight);
        let budget = self.c.send_budget;
        if in_flight > 0 && in_flight + payload.len() as u64 > budget {
            let text = format!(
                "{in_flight} KV bytes sent to this decode are unacknowledged; {} more would pass the send budget of {budget} bytes",
                payload.len()
            );
            self.note(PrefillNote::OverBudget);
            self.fail_room(id, FailCode::SendBudget, &text, now);
            return;
        }
        let _ = self.rooms.advance(id, RoomState::Transferring, now);
        let done = Message::Done {
            first_token: first,
            prompt_tokens,
            logprob: lp.map(|l| WireLogprob {
                logprob: l.logprob,
                top: l.top,
            }),
        };
        self.out.push(PrefillEffect::StreamKv {
            peer,
            room: id,
            payload,
            done,
        });
    }

    pub(super) fn streamed(
        &mut self,
        room: u64,
        sent: u64,
        failed: Option<(&'static str, &'static str)>,
        now: Instant,
    ) {
        let Some(r) = self.rooms.get(room) else {
            return;
        };
        if let Some(s) = self.sessions.get_mut(&r.data.peer) {
            s.sent += sent;
        }
        match failed {
            // The chunks' or the DONE's send failed; the label was counted by the loop.
            Some((_, what)) => self.fail_room(room, FailCode::SendFailed, what, now),
            None => self.end_room(room, RoomEnd::Done, now),
        }
    }

    /// Fail a room: push FAILED to its decode at once, and end it.
    pub(super) fn fail_room(&mut self, id: u64, code: FailCode, text: &str, now: Instant) {
        let Some(r) = self.rooms.get(id) else {
            return;
        };
        let peer = r.data.peer.clone();
        self.send(
            &peer,
            id,
            Message::Failed {
                reason: code,
                text: text.to_owned(),
            },
        );
        let end = RoomEnd::Failed {
            code,
            text: text.to_owned(),
        };
        self.end_room(id, end, now);
    }

    pub(super) fn end_room(&mut self, id: u64, end: RoomEnd, now: Instant) {
        let outcome = match &end {
            RoomEnd::Done => RoomState::Done,
            RoomEnd::Failed { code, .. } => RoomState::Failed(*code),
            RoomEnd::Aborted => RoomState::Aborted,
        };
        let Some(r) = self.rooms.finish(id, outcome) else {
            return;
        };
        if let RoomEnd::Failed { code, text } = &end
            && let Some(s) = self.sessions.get_mut(&r.data.peer)
        {
            s.last_failure = Some((code.label().into(), format!("room {id:016x}: {text}"), now));
        }
        self.out.push(PrefillEffect::RoomEnded {
            room: id,
            peer: r.data.peer,
            peer_incarnation: r.data.peer_incarnation,
            end,
        });
    }

    pub(super) fn expire(&mut self, now: Instant) {
        for (id, state) in self.rooms.expired(now) {
            let text = format!("no progress in {}", state.label());
            self.fail_room(id, state.timeout_code(), &text, now);
        }
        let limit = self.rooms.deadlines.bootstrap;
        self.pending
            .retain(|_, (_, t)| now.saturating_duration_since(*t) < limit);
        // Liveness expiry: a decode that sent nothing (not even a PING) for the expiry is
        // gone (killed, partitioned, frozen); its state must not outlive it.
        let silent: Vec<PeerId> = self
            .sessions
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.last_seen) > self.session_expiry)
            .map(|(k, _)| k.clone())
            .collect();
        for peer in silent {
            self.drop_session(&peer, DropReason::Expired, now);
        }
    }
}
