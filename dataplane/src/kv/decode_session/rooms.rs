//! The decode's rooms: opened for an HTTP request, sent as PREFILL within the send
//! budget, fed by PROGRESS and KV chunks, ended once by DONE, a failure, an abort or a
//! deadline.

use std::time::Instant;

use super::{DecodeEffect, DecodeNote, DecodeSession, RoomEnd};
use crate::kv::chunks::Assembler;
use crate::kv::room::{AbortOutcome, RoomState};
use crate::kv::{FailCode, KvChunkRef, Message, PrefillRequest, WireLogprob};

/// One room as the decode sees it.
#[derive(Debug)]
pub(super) struct DecodeRoom {
    /// The request, until it is sent.
    pub(super) req: Option<PrefillRequest>,
    pub(super) prompt_len: usize,
    pub(super) asm: Assembler,
    /// The prefill incarnation it was sent to (0 until it is).
    pub(super) peer_incarnation: u64,
    /// The prefill has said something about this room since its PREFILL went out; until
    /// then the PREFILL's bytes count against the send budget.
    pub(super) answered: bool,
}

impl DecodeRoom {
    /// Wire bytes of this room's PREFILL (tokens and sampling parameters).
    fn prefill_bytes(&self) -> u64 {
        64 + 4 * self.prompt_len as u64
    }

    pub(super) fn sent(&self) -> bool {
        self.req.is_none()
    }
}

impl DecodeSession {
    pub(super) fn open(&mut self, room: u64, req: PrefillRequest, now: Instant) {
        if self.stopped {
            // The loop is ending: the request ends with the reason, never waits.
            self.out.push(DecodeEffect::RoomEnded {
                room,
                end: RoomEnd::Failed {
                    code: FailCode::Shutdown,
                    text: "the decode is shutting down".into(),
                    peer_incarnation: 0,
                },
            });
            return;
        }
        if self.refuse_while_unresponsive(room) {
            return;
        }
        let data = DecodeRoom {
            prompt_len: req.tokens.len(),
            req: Some(req),
            asm: Assembler::with_pool(self.c.pool.clone()),
            peer_incarnation: 0,
            answered: false,
        };
        if self
            .rooms
            .open(room, RoomState::Bootstrap, data, now)
            .is_err()
        {
            self.note(DecodeNote::RoomIdCollision { room });
            return;
        }
        self.note(DecodeNote::RoomOpened);
        if self.established().is_some() {
            self.send_prefill(room, now);
        }
    }

    pub(super) fn send_prefill(&mut self, room: u64, now: Instant) {
        let Some(peer_incarnation) = self.established() else {
            return;
        };
        // PREFILL bytes sent to the prefill that it has not answered yet.
        let outstanding: u64 = self
            .rooms
            .iter()
            .filter(|(_, r)| r.data.sent() && !r.data.answered)
            .map(|(_, r)| r.data.prefill_bytes())
            .sum();
        let Some(r) = self.rooms.get_mut(room) else {
            return;
        };
        if r.data.sent() {
            return;
        }
        // The send budget in bytes: a prefill that stops answering pins at most the budget.
        let bytes = r.data.prefill_bytes();
        if outstanding > 0 && outstanding + bytes > self.c.send_budget {
            let text = format!(
                "{outstanding} bytes of PREFILL unanswered by this prefill; {bytes} more would pass the send budget of {} bytes",
                self.c.send_budget
            );
            self.note(DecodeNote::OverBudget);
            self.fail_room(room, FailCode::SendBudget, &text, false);
            return;
        }
        let Some(req) = r.data.req.take() else {
            return;
        };
        r.data.peer_incarnation = peer_incarnation;
        let _ = self.rooms.advance(room, RoomState::WaitingKv, now);
        self.send(room, Message::Prefill(req));
    }

    /// The prefill is still working on `room`: its no-progress deadline starts again.
    pub(super) fn progress(&mut self, room: u64, now: Instant) {
        let Some(r) = self.rooms.get_mut(room) else {
            return; // late news of a room that ended; nothing to do
        };
        r.data.answered = true;
        if r.state == RoomState::WaitingKv {
            let _ = self.rooms.advance(room, RoomState::WaitingKv, now);
            self.note(DecodeNote::Progress);
        }
    }

    /// Validate one KV chunk and copy its data into the room's reassembly buffer.
    pub(super) fn chunk(&mut self, room: u64, c: KvChunkRef<'_>, now: Instant) {
        let Some(r) = self.rooms.get_mut(room) else {
            self.note(DecodeNote::UnknownRoom { room, logged: true });
            return;
        };
        if r.state == RoomState::Aborting {
            return; // late data of an aborted room; the ack will follow
        }
        r.data.answered = true;
        let limit = 64 + self.c.per_token * r.data.prompt_len as u64;
        let n = c.data.len();
        match r.data.asm.push(c, limit) {
            Ok(_) => {
                self.note(DecodeNote::BytesReceived(n));
                let _ = self.rooms.advance(room, RoomState::Transferring, now);
            }
            Err(e) => {
                self.note(DecodeNote::BadChunk);
                self.fail_room(room, FailCode::BadChunk, &e.to_string(), true);
            }
        }
    }

    pub(super) fn done(
        &mut self,
        room: u64,
        first: u32,
        prompt_tokens: u32,
        lp: Option<WireLogprob>,
    ) {
        let Some(r) = self.rooms.get(room) else {
            self.note(DecodeNote::UnknownRoom {
                room,
                logged: false,
            });
            return;
        };
        if r.state == RoomState::Aborting {
            return;
        }
        if !r.data.asm.complete() || prompt_tokens as usize != r.data.prompt_len {
            let msg = format!(
                "DONE after {} KV bytes for {prompt_tokens} tokens (expected {})",
                r.data.asm.received_bytes(),
                r.data.prompt_len
            );
            self.fail_room(room, FailCode::Incomplete, &msg, true);
            return;
        }
        let Some(r) = self.rooms.finish(room, RoomState::Done) else {
            return;
        };
        self.out.push(DecodeEffect::RoomEnded {
            room,
            end: RoomEnd::Done {
                payload: r.data.asm.into_payload(),
                first_token: first,
                first_logprob: lp,
            },
        });
    }

    /// Rooms whose HTTP request went away are aborted on both sides.
    pub(super) fn client_gone(&mut self, room: u64, now: Instant) {
        let Some(r) = self.rooms.get(room) else {
            return;
        };
        if r.state == RoomState::Aborting {
            return;
        }
        if !r.data.sent() {
            // The prefill never heard of it: nothing to acknowledge.
            self.rooms.finish(room, RoomState::Aborted);
            self.out.push(DecodeEffect::RoomEnded {
                room,
                end: RoomEnd::Aborted {
                    reason: "client_abort",
                    acked: false,
                },
            });
            return;
        }
        if self.rooms.abort(room, now) == AbortOutcome::SendAbort {
            self.send(room, Message::Abort);
        }
    }

    /// Fail a room: push FAILED to the prefill when it knows the room (and `tell_peer`),
    /// and end it with the reason.
    pub(super) fn fail_room(&mut self, id: u64, code: FailCode, text: &str, tell_peer: bool) {
        let Some(r) = self.rooms.finish(id, RoomState::Failed(code)) else {
            return;
        };
        if tell_peer && r.data.sent() {
            self.send(
                id,
                Message::Failed {
                    reason: code,
                    text: text.to_owned(),
                },
            );
        }
        self.out.push(DecodeEffect::RoomEnded {
            room: id,
            end: RoomEnd::Failed {
                code,
                text: text.to_owned(),
                peer_incarnation: r.data.peer_incarnation,
            },
        });
    }

    pub(super) fn expire(&mut self, now: Instant) {
        for (id, state) in self.rooms.expired(now) {
            if state == RoomState::Aborting {
                // The ack never came; the peer is gone or stuck. Release and count.
                self.rooms.finish(id, RoomState::Aborted);
                self.out.push(DecodeEffect::RoomEnded {
                    room: id,
                    end: RoomEnd::Aborted {
                        reason: "abort_ack_timeout",
                        acked: false,
                    },
                });
                continue;
            }
            let text = format!("no progress while {}", state.label());
            self.fail_room(id, state.timeout_code(), &text, true);
        }
    }
}
