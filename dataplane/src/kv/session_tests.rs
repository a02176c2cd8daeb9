//! The sessions without sockets: handshake, heartbeat deadlines, incarnation fencing,
//! failure pushing and the rooms' ends, each side on its own and both joined by the
//! in-memory wire of `session_harness`.

use std::time::Duration;

use super::auth;
use super::decode_session::{ChannelState, DecodeEffect, DecodeEvent, DecodeNote, RoomEnd};
use super::prefill_session::{DropReason, EngineUpdate, PrefillEffect, PrefillEvent, PrefillNote};
use super::session_harness::*;
use super::*;

fn state(p: &Pair) -> ChannelState {
    p.decode.status().state
}

fn refusal(p: &Pair) -> Option<String> {
    p.decode.status().last_refusal.map(|r| r.reason.clone())
}

fn decode_ends(p: &Pair) -> Vec<(u64, &'static str)> {
    p.decode_ended
        .iter()
        .map(|(room, e)| {
            let why = match e {
                RoomEnd::Done { .. } => "done",
                RoomEnd::Failed { code, .. } => code.label(),
                RoomEnd::Aborted { reason, .. } => reason,
            };
            (*room, why)
        })
        .collect()
}

#[test]
fn the_handshake_authenticates_both_ways_and_a_room_carries_kv_and_the_first_token() {
    let mut p = Pair::new();
    assert_eq!(state(&p), ChannelState::Idle);
    p.tick();
    assert!(matches!(
        sent_by_decode(&p.decode_effects)[..],
        [Message::Hello { .. }]
    ));
    assert_eq!(state(&p), ChannelState::Handshaking);
    p.settle();
    assert_eq!(state(&p), ChannelState::Established);
    let st = p.decode.status();
    assert_eq!(st.peer_incarnation, 0xAAAA);
    assert_eq!(st.last_pong, Some(p.now), "the handshake counts as contact");
    assert_eq!(p.prefill.sessions(), 1);

    p.open(1, 20);
    p.settle();
    assert_eq!(p.prefill_submitted, [1]);
    p.engine_finishes(1);
    p.settle();
    match &p.decode_ended[..] {
        [
            (
                1,
                RoomEnd::Done {
                    payload,
                    first_token,
                    ..
                },
            ),
        ] => {
            assert_eq!(*first_token, 42);
            assert_eq!(payload.len(), fake_export(20).len());
            assert_eq!(&payload[..], &fake_export(20)[..], "the KV, byte for byte");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(p.prefill_ended, [1]);
    // The decode acknowledges what it received; the prefill's bytes in flight go to 0.
    p.round();
    assert_eq!(p.prefill.bytes_in_flight(), 0);
}

#[test]
fn a_prefill_without_the_group_key_is_refused_and_the_handshake_retried_a_probe_period_later() {
    let mut p = Pair::new();
    p.prefill = prefill_session(0xBAD, b"another key");
    p.prefill_incarnation = 0xBAD;
    p.round();
    assert_eq!(state(&p), ChannelState::Idle);
    assert_eq!(refusal(&p).as_deref(), Some("auth_failed"));
    assert!(
        sent_by_decode(&p.decode_effects).iter().any(|m| matches!(
            m,
            Message::Reject {
                reason: RejectReason::AuthFailed,
                ..
            }
        )),
        "the prefill is told why"
    );
    // The prefill heard the refusal and kept no session.
    assert_eq!(p.prefill.sessions(), 0);
    let hellos = |p: &Pair| {
        sent_by_decode(&p.decode_effects)
            .iter()
            .filter(|m| matches!(m, Message::Hello { .. }))
            .count()
    };
    p.advance(timings().probe_period / 2);
    p.round();
    assert_eq!(hellos(&p), 1, "no new attempt before a probe period");
    p.advance(timings().probe_period);
    p.round();
    assert_eq!(hellos(&p), 2);
    assert_eq!(
        state(&p),
        ChannelState::Idle,
        "refused again, never established"
    );
}

#[test]
fn a_decode_without_the_key_gets_no_session_at_the_prefill() {
    let mut s = prefill_session(1, KEY);
    let decode_id = identity(9);
    let init = auth::Initiator::new([3; 32]);
    let t = std::time::Instant::now();
    let env = |msg| Envelope {
        incarnation: 9,
        group_incarnation: GROUP,
        room: 0,
        msg,
    };
    // Before any handshake: refused, nothing kept.
    let out = s.on(
        PrefillEvent::Received {
            peer: b"x",
            env: env(Message::Ping {
                nonce: 1,
                timestamp_us: 0,
            }),
        },
        t,
    );
    assert!(out.iter().any(|e| matches!(
        e,
        PrefillEffect::Send {
            msg: Message::Reject {
                reason: RejectReason::NotAuthenticated,
                ..
            },
            ..
        }
    )));
    // A HELLO, then an AUTH signed with another key.
    let out = s.on(
        PrefillEvent::Received {
            peer: b"x",
            env: env(init.hello(&decode_id)),
        },
        t,
    );
    assert!(out.iter().any(|e| matches!(
        e,
        PrefillEffect::Send {
            msg: Message::Welcome { .. },
            ..
        }
    )));
    // An AUTH that does not prove the key.
    let forged = Message::Auth { mac: [0; 32] };
    let out = s.on(
        PrefillEvent::Received {
            peer: b"x",
            env: env(forged),
        },
        t,
    );
    assert!(out.iter().any(|e| matches!(
        e,
        PrefillEffect::Send {
            msg: Message::Reject {
                reason: RejectReason::AuthFailed,
                ..
            },
            ..
        }
    )));
    assert_eq!(s.sessions(), 0, "an unauthenticated peer gets no state");
}

#[test]
fn pings_go_every_heartbeat_and_the_last_pong_is_what_readiness_measures() {
    let mut p = Pair::new();
    p.establish();
    let pings = |p: &Pair| {
        sent_by_decode(&p.decode_effects)
            .iter()
            .filter(|m| matches!(m, Message::Ping { .. }))
            .count()
    };
    let every = timings().channel_heartbeat();
    assert_eq!(
        every,
        Duration::from_millis(250),
        "a quarter of the deadline"
    );
    let before = pings(&p);
    for _ in 0..8 {
        p.advance(every / 2);
        p.round();
    }
    assert_eq!(
        pings(&p),
        before + 4,
        "one PING per heartbeat, not per tick"
    );
    assert_eq!(p.decode.status().last_pong, Some(p.now), "answered at once");
    // A prefill that answers with something else (PROGRESS of a long prompt, KV) but no
    // PONG (its PINGs are lost here; for less than its session expiry) is alive: the PONG
    // ages past the channel deadline and the liveness window (readiness measures it), the
    // session stays.
    p.open(1, 10);
    p.settle();
    let answered = p.now;
    for _ in 0..6 {
        p.advance(every);
        p.tick();
        p.to_prefill.clear();
        p.prefill_event(PrefillEvent::Engine {
            room: 1,
            update: EngineUpdate::Progress { prefilled: 5 },
        });
        p.settle();
    }
    assert_eq!(
        state(&p),
        ChannelState::Established,
        "{:?}",
        decode_ends(&p)
    );
    assert_eq!(p.decode.status().last_pong, Some(answered));
    assert!(p.now.duration_since(answered) > timings().liveness_window());
    assert!(p.now.duration_since(answered) > timings().channel_deadline);
    assert!(p.now.duration_since(answered) < timings().session_expiry());
    assert!(p.decode_ended.is_empty(), "{:?}", decode_ends(&p));
}

#[test]
fn a_new_prefill_incarnation_fails_the_rooms_sent_to_the_old_one_and_a_handshake_follows() {
    let mut p = Pair::new();
    p.establish();
    p.open(1, 10);
    p.settle();
    assert_eq!(p.prefill_submitted, [1]);
    p.restart_prefill(0xBBBB);
    // The next PING reaches the new process, which answers with a REJECT under its own
    // incarnation.
    p.advance(timings().probe_period);
    p.round();
    assert!(
        decode_ends(&p).contains(&(1, "peer_restarted")),
        "{:?}",
        decode_ends(&p)
    );
    assert!(p.decode_effects.iter().any(|e| matches!(
        e,
        DecodeEffect::Note(DecodeNote::PeerRestarted {
            old: 0xAAAA,
            new: 0xBBBB
        })
    )));
    // A room opened meanwhile waits for the new session and goes there.
    p.open(2, 10);
    for _ in 0..3 {
        p.advance(timings().probe_period);
        p.round();
    }
    assert_eq!(state(&p), ChannelState::Established);
    assert_eq!(p.decode.status().peer_incarnation, 0xBBBB);
    assert_eq!(
        p.prefill_submitted,
        [1, 2],
        "room 1 went to the old prefill only, room 2 to the new one"
    );
    p.engine_finishes(2);
    p.settle();
    assert!(decode_ends(&p).contains(&(2, "done")));
}

#[test]
fn failures_are_pushed_to_the_prefill_with_their_reason() {
    let mut p = Pair::new();
    p.establish();
    // A KV chunk that fails validation: the room fails bad_chunk, FAILED goes back.
    p.open(1, 10);
    p.settle();
    let h = |room| Header {
        version: PROTOCOL_VERSION,
        msg_type: MsgType::KvChunk as u8,
        flags: 0,
        incarnation: 0xAAAA,
        group_incarnation: GROUP,
        room,
    };
    let data = vec![1u8; 16];
    let bad = KvChunkRef {
        index: 3,
        count: 4,
        first_layer: 0,
        end_layer: 1,
        offset: 0,
        total: 64,
        crc32: 0,
        data: &data,
    };
    p.decode_event(DecodeEvent::Received(h(1), Decoded::Chunk(bad)));
    assert_eq!(decode_ends(&p), [(1, "bad_chunk")]);
    assert!(matches!(
        p.to_prefill
            .back()
            .map(|f| decode(&[&f[0], &f[1]]).unwrap().msg),
        Some(Message::Failed {
            reason: FailCode::BadChunk,
            ..
        })
    ));
    p.settle();
    assert_eq!(p.prefill_ended, [1], "the prefill ended it too");
    // No progress past the KV timeout: kv_timeout, pushed too.
    p.open(2, 10);
    p.settle();
    p.advance(timings().kv_timeout);
    p.decode_event(DecodeEvent::Tick);
    assert!(decode_ends(&p).contains(&(2, "kv_timeout")));
    assert!(matches!(
        p.to_prefill
            .back()
            .map(|f| decode(&[&f[0], &f[1]]).unwrap().msg),
        Some(Message::Failed {
            reason: FailCode::KvTimeout,
            ..
        })
    ));
    // The prefill's own failure reaches the decode with its reason.
    p.settle();
    p.open(3, 10);
    p.settle();
    p.prefill_event(PrefillEvent::Engine {
        room: 3,
        update: EngineUpdate::Failed {
            code: FailCode::EngineFailed,
            message: "step failed".into(),
        },
    });
    p.settle();
    assert!(decode_ends(&p).contains(&(3, "engine_failed")));
}

#[test]
fn progress_keeps_a_long_prefill_alive_past_the_kv_timeout() {
    let mut p = Pair::new();
    p.establish();
    p.open(1, 10);
    p.settle();
    // Ten KV timeouts of engine work, reported by PROGRESS every probe period.
    let steps =
        (timings().kv_timeout.as_millis() * 10 / timings().probe_period.as_millis()) as usize;
    for _ in 0..steps {
        p.advance(timings().probe_period);
        p.round();
    }
    assert!(p.decode_ended.is_empty(), "{:?}", decode_ends(&p));
    // An engine that stops going round stops the PROGRESS: the room times out.
    for _ in 0..8 {
        p.advance(timings().probe_period);
        p.decode_event(DecodeEvent::Tick);
        p.prefill_event(PrefillEvent::Tick { engine_live: false });
        p.settle();
    }
    assert!(decode_ends(&p).contains(&(1, "kv_timeout")));
}

#[test]
fn a_lost_connection_fails_the_rooms_sent_at_once_and_keeps_the_others() {
    let mut p = Pair::new();
    p.establish();
    p.open(1, 10);
    p.settle();
    p.cut = true;
    p.decode_event(DecodeEvent::Disconnected {
        endpoint: "tcp://prefill-0:5600".into(),
    });
    assert_eq!(decode_ends(&p), [(1, "peer_lost")]);
    assert_eq!(state(&p), ChannelState::Idle);
    assert_eq!(refusal(&p).as_deref(), Some("peer_lost"), "why, at once");
    // Unreachable: each attempt fails to send, says why, retries every 200 ms.
    p.open(2, 10);
    p.decode_event(DecodeEvent::Tick);
    assert_eq!(refusal(&p).as_deref(), Some("peer_unreachable"));
    assert_eq!(state(&p), ChannelState::Idle);
    // Room 2 waits (up to the channel deadline); the link comes back within it.
    p.cut = false;
    p.advance(decode_session_retry());
    p.establish();
    assert_eq!(state(&p), ChannelState::Established);
    p.engine_finishes(2);
    p.settle();
    assert!(decode_ends(&p).contains(&(2, "done")));
}

fn decode_session_retry() -> Duration {
    super::decode_session::UNREACHABLE_RETRY
}

#[test]
fn an_abort_waits_for_its_ack_before_the_room_ends_and_not_forever() {
    let mut p = Pair::new();
    p.establish();
    p.open(1, 10);
    p.settle();
    p.decode_event(DecodeEvent::ClientGone { room: 1 });
    assert!(
        p.decode_ended.is_empty(),
        "the KV buffer stays until the ack"
    );
    assert!(p.decode.has_room(1));
    p.settle();
    assert_eq!(decode_ends(&p), [(1, "client_abort")]);
    assert!(matches!(
        p.decode_ended[0].1,
        RoomEnd::Aborted { acked: true, .. }
    ));
    assert_eq!(
        p.prefill_ended,
        [1],
        "the prefill stopped writing and ended it"
    );
    // An ack that never comes: released at the deadline, counted as such.
    p.open(2, 10);
    p.settle();
    p.decode_event(DecodeEvent::ClientGone { room: 2 });
    p.to_prefill.clear();
    p.advance(timings().bootstrap_timeout);
    p.decode_event(DecodeEvent::Tick);
    assert!(decode_ends(&p).contains(&(2, "abort_ack_timeout")));
    // A client that leaves before its room was sent: ended at once, nothing to ack.
    p.cut = true;
    p.decode_event(DecodeEvent::Disconnected {
        endpoint: String::new(),
    });
    p.open(3, 10);
    p.decode_event(DecodeEvent::ClientGone { room: 3 });
    assert!(decode_ends(&p).contains(&(3, "client_abort")));
}

#[test]
fn a_decode_gone_silent_is_dropped_with_its_rooms_and_told_why_when_it_returns() {
    let mut p = Pair::new();
    p.establish();
    p.open(1, 10);
    p.settle();
    let expiry = timings().session_expiry();
    p.advance(expiry + Duration::from_millis(1));
    p.prefill_event(PrefillEvent::Tick { engine_live: true });
    assert_eq!(p.prefill.sessions(), 0);
    assert_eq!(p.prefill_ended, [1]);
    let (peer, reason, _, _) = p.prefill.last_refusal().clone().unwrap();
    assert_eq!((peer.as_slice(), reason.as_str()), (DECODE_ID, "expired"));
    // It speaks again: REJECT peer_expired, and the decode handshakes anew.
    p.to_prefill.clear();
    p.round();
    assert_eq!(refusal(&p).as_deref(), Some("peer_expired"));
    assert!(decode_ends(&p).contains(&(1, "peer_expired")));
    p.advance(timings().probe_period);
    p.establish();
    assert_eq!(state(&p), ChannelState::Established);
}

#[test]
fn the_prefill_refuses_another_group_incarnation_and_drops_a_restarted_decode() {
    let mut s = prefill_session(1, KEY);
    let mut p = Pair::new();
    p.establish();
    // Take the prefill's session out of the pair to script a restarted decode.
    std::mem::swap(&mut s, &mut p.prefill);
    let t = p.now;
    p.open(1, 10);
    while let Some(f) = p.to_prefill.pop_front() {
        let env = decode(&[&f[0], &f[1]]).unwrap();
        s.on(
            PrefillEvent::Received {
                peer: DECODE_ID,
                env,
            },
            t,
        );
    }
    let env = |incarnation, group, msg| Envelope {
        incarnation,
        group_incarnation: group,
        room: 0,
        msg,
    };
    let ping = Message::Ping {
        nonce: 5,
        timestamp_us: 0,
    };
    let out = s.on(
        PrefillEvent::Received {
            peer: DECODE_ID,
            env: env(0xD0D0, GROUP + 1, ping.clone()),
        },
        t,
    );
    assert!(out.iter().any(|e| matches!(
        e,
        PrefillEffect::Send {
            msg: Message::Reject {
                reason: RejectReason::IncarnationMismatch,
                ..
            },
            ..
        }
    )));
    assert_eq!(
        s.sessions(),
        1,
        "a stale group incarnation is refused, not a reason to drop"
    );
    // The same connection with another process incarnation: the old session and its
    // room are dropped.
    let out = s.on(
        PrefillEvent::Received {
            peer: DECODE_ID,
            env: env(0xD1D1, GROUP, ping),
        },
        t,
    );
    assert!(out.iter().any(|e| matches!(
        e,
        PrefillEffect::Note(PrefillNote::SessionDropped {
            why: DropReason::PeerRestarted,
            rooms_failed: 1,
            ..
        })
    )));
    assert!(
        out.iter()
            .any(|e| matches!(e, PrefillEffect::RoomEnded { room: 1, .. }))
    );
    assert_eq!(s.sessions(), 0);
}

#[test]
fn a_draining_prefill_says_goodbye_and_refuses_new_work_while_rooms_in_flight_finish() {
    let mut p = Pair::new();
    p.establish();
    p.open(1, 10);
    p.settle();
    p.prefill_event(PrefillEvent::Drain);
    p.settle();
    assert!(p.decode.status().peer_draining);
    assert_eq!(refusal(&p).as_deref(), Some("peer_shutdown"));
    // Room 1 finishes; the session is not established any more, so room 2 waits and is
    // refused by the draining prefill when it handshakes.
    p.engine_finishes(1);
    p.settle();
    assert!(decode_ends(&p).contains(&(1, "done")));
    p.advance(timings().probe_period);
    p.round();
    assert_eq!(refusal(&p).as_deref(), Some("shutting_down"));
    // Stop: nothing is left open on either side.
    p.prefill_event(PrefillEvent::Stop);
    p.decode_event(DecodeEvent::Stop);
    assert_eq!(p.prefill.rooms_open(), 0);
}

#[test]
fn prefills_past_the_send_budget_fail_at_once_instead_of_queueing() {
    let mut p = Pair::new();
    p.establish();
    // Each PREFILL of n tokens counts 64 + 4n bytes until answered; the budget is 1 MiB.
    let big = (1 << 20) / 4 - 100;
    p.open(1, big);
    p.open(2, big);
    assert!(decode_ends(&p).contains(&(2, "send_budget")));
    assert!(
        p.decode_effects
            .iter()
            .any(|e| matches!(e, DecodeEffect::Note(DecodeNote::OverBudget)))
    );
    // With nothing unanswered, a room larger than the budget still goes.
    p.settle();
    assert_eq!(p.prefill_submitted, [1]);
}

#[test]
fn stop_ends_every_room_once_with_a_reason_and_says_goodbye() {
    let mut p = Pair::new();
    p.establish();
    for room in 1..=3 {
        p.open(room, 8);
    }
    p.settle();
    p.decode_event(DecodeEvent::ClientGone { room: 3 });
    p.decode_event(DecodeEvent::Stop);
    let ends = decode_ends(&p);
    assert_eq!(ends.len(), 3, "{ends:?}");
    assert!(ends.contains(&(1, "shutdown")) && ends.contains(&(2, "shutdown")));
    assert!(
        ends.contains(&(3, "shutdown")),
        "the aborting room is released"
    );
    assert!(matches!(
        sent_by_decode(&p.decode_effects).last(),
        Some(Message::Goodbye { .. })
    ));
    // Nothing after a stop: no handshake, and a late room ends at once.
    p.advance(Duration::from_secs(60));
    p.decode_event(DecodeEvent::Tick);
    p.open(4, 8);
    assert!(decode_ends(&p).contains(&(4, "shutdown")));
    p.settle();
    assert_eq!(
        p.prefill.sessions(),
        0,
        "the prefill dropped the session on GOODBYE"
    );
}

#[test]
fn a_reset_ends_every_room_with_reset_and_is_no_drain() {
    let mut p = Pair::new();
    p.establish();
    p.open(1, 8);
    p.open(2, 8);
    p.settle();
    // The prefill resets in place: GOODBYE `reset`, then FAILED `reset` for each room.
    p.prefill_event(PrefillEvent::Reset);
    p.settle();
    let ends = decode_ends(&p);
    assert!(
        ends.contains(&(1, "reset")) && ends.contains(&(2, "reset")),
        "{ends:?}"
    );
    assert_eq!(p.prefill.rooms_open(), 0);
    assert!(
        !p.decode.status().peer_draining,
        "a reset prefill is back at once: not draining"
    );
    assert_eq!(refusal(&p).as_deref(), Some("reset"));
    // It handshakes again shortly (not a probe period later).
    let hellos = |p: &Pair| {
        sent_by_decode(&p.decode_effects)
            .iter()
            .filter(|m| matches!(m, Message::Hello { .. }))
            .count()
    };
    let before = hellos(&p);
    p.advance(super::decode_session::UNREACHABLE_RETRY);
    p.decode_event(DecodeEvent::Tick);
    assert_eq!(hellos(&p), before + 1);

    // A decode's reset: its rooms end with `reset`, FAILED pushed, GOODBYE `reset`.
    let mut p = Pair::new();
    p.establish();
    p.open(3, 8);
    p.settle();
    p.decode_event(DecodeEvent::Reset);
    assert!(decode_ends(&p).contains(&(3, "reset")));
    let sent = sent_by_decode(&p.decode_effects);
    assert!(sent.iter().any(|m| matches!(
        m,
        Message::Failed {
            reason: FailCode::Reset,
            ..
        }
    )));
    assert!(matches!(
        sent.last(),
        Some(Message::Goodbye {
            reason: FailCode::Reset,
            ..
        })
    ));
    p.settle();
    assert_eq!(p.prefill.rooms_open(), 0);
    assert_eq!(p.prefill.sessions(), 0);
}
