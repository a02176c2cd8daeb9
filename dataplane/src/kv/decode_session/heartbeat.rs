//! The decode's heartbeat and channel deadline: a PING every channel heartbeat while the
//! session is established; a PING that no message of any kind follows within the channel
//! deadline ends the session as `peer_unresponsive` (see the module header of
//! `decode_session` for why the deadline counts from the PING).

use std::time::Instant;

use rand::Rng;

use super::{DecodeEffect, DecodeNote, DecodeSession, RoomEnd};
use crate::kv::auth::Initiator;
use crate::kv::room::RoomState;
use crate::kv::{FailCode, Header, Message};

impl DecodeSession {
    /// Established: end the session if the prefill left a PING unanswered past the
    /// deadline, else PING when one is due.
    pub(super) fn heartbeat(&mut self, peer_incarnation: u64, now: Instant) {
        if let Some(since) = self.unanswered_since
            && now.duration_since(since) >= self.c.timings.channel_deadline
        {
            self.peer_unresponsive(peer_incarnation, since, now);
            return;
        }
        let every = self.c.timings.channel_heartbeat();
        if self
            .last_ping
            .is_some_and(|(_, at)| now.duration_since(at) < every)
        {
            return;
        }
        let nonce = loop {
            let n: u64 = self.rng.random();
            if n != 0 {
                break n;
            }
        };
        let timestamp_us = now.duration_since(self.base).as_micros() as u64;
        self.send(
            0,
            Message::Ping {
                nonce,
                timestamp_us,
            },
        );
        self.last_ping = Some((nonce, now));
        self.unanswered_since.get_or_insert(now);
    }

    /// The deadline passed: the session ends first (so `/ready` and the room picker see
    /// it before any request hears of it), then every room on this prefill fails with
    /// `peer_unresponsive` (FAILED pushed for those it holds), and a handshake starts at
    /// once. Rooms being aborted keep waiting for their ABORT_ACK (or its deadline): their
    /// KV buffer is released only once the prefill stopped writing it.
    fn peer_unresponsive(&mut self, peer_incarnation: u64, since: Instant, now: Instant) {
        let unanswered = now.duration_since(since);
        let deadline = self.c.timings.channel_deadline;
        self.unresponsive = true;
        self.unanswered_since = None;
        self.session_ended(FailCode::PeerUnresponsive, now);
        self.retry(now);
        let text = format!(
            "no message from the prefill for {} ms after a PING (channel deadline {} ms)",
            unanswered.as_millis(),
            deadline.as_millis()
        );
        self.refused(
            FailCode::PeerUnresponsive.label(),
            format!(
                "the prefill at {} (incarnation {peer_incarnation:016x}) is unresponsive: {text}; handshaking again",
                self.c.addr
            ),
            now,
        );
        let ids: Vec<u64> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.state != RoomState::Aborting)
            .map(|(id, _)| id)
            .collect();
        self.note(DecodeNote::PeerUnresponsive {
            peer_incarnation,
            unanswered,
            deadline,
            rooms_failed: ids.len(),
        });
        for id in ids {
            self.fail_room(id, FailCode::PeerUnresponsive, &text, true);
        }
    }

    /// Without a session, a room not yet sent waits for one at most the channel deadline,
    /// counted from the later of its opening and the session's end; then it fails with the
    /// reason the session ended. The bootstrap timeout (seconds) is for a handshake that is
    /// slow, not for a prefill that is gone: a request that picked this peer just before
    /// its connection closed must not wait for it.
    pub(super) fn expire_unserved(&mut self, now: Instant) {
        if self.established().is_some() {
            return;
        }
        let (down, code) = self.session_down;
        let deadline = self.c.timings.channel_deadline;
        let due: Vec<(u64, u128)> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.state == RoomState::Bootstrap && !r.data.sent())
            .filter_map(|(id, r)| {
                let waited = now.saturating_duration_since(r.since.max(down));
                (waited >= deadline).then_some((id, waited.as_millis()))
            })
            .collect();
        if due.is_empty() {
            return;
        }
        let why = self
            .last_refusal
            .as_ref()
            .map(|r| format!(": {} ({})", r.message, r.reason))
            .unwrap_or_default();
        for (id, waited) in due {
            let text = format!(
                "no session with the prefill at {} for {waited} ms (channel deadline {} ms){why}",
                self.c.addr,
                deadline.as_millis()
            );
            self.fail_room(id, code, &text, false);
        }
    }

    /// A room opened while the prefill is known to be unresponsive ends at once with the
    /// reason instead of waiting for a handshake that may never come. (The request path
    /// already refuses new requests then; this covers one that picked the peer just
    /// before.) Returns whether the room was refused.
    pub(super) fn refuse_while_unresponsive(&mut self, room: u64) -> bool {
        if !self.unresponsive || self.established().is_some() {
            return false;
        }
        let text = format!(
            "the prefill at {} stopped answering; no new rooms until it answers a new handshake",
            self.c.addr
        );
        self.out.push(DecodeEffect::RoomEnded {
            room,
            end: RoomEnd::Failed {
                code: FailCode::PeerUnresponsive,
                text,
                peer_incarnation: 0,
            },
        });
        true
    }

    /// Whether a WELCOME that failed this attempt's check answers an earlier attempt of
    /// this decode: the prefill proved the key over that HELLO's nonce.
    pub(super) fn answers_stale_attempt(&self, h: &Header, welcome: &Message) -> bool {
        self.stale_attempts.iter().any(|init: &Initiator| {
            init.on_welcome(
                &self.c.local,
                &self.c.key,
                h.incarnation,
                h.group_incarnation,
                welcome,
            )
            .is_ok()
        })
    }
}
