//! The decode's channel deadline without sockets: a prefill that stops answering (a
//! SIGSTOP, seen from the decode: its messages stop, what the decode sends queues up) is
//! found within the deadline, its rooms fail `peer_unresponsive` with FAILED pushed, new
//! rooms are refused at once, late messages of the old session change nothing, and the
//! channel comes back by a new handshake when the prefill resumes.

use std::time::Duration;

use super::decode_session::{ChannelState, DecodeEffect, DecodeEvent, DecodeNote, RoomEnd};
use super::prefill_session::PrefillEvent;
use super::session_harness::*;
use super::*;

fn ends(p: &Pair) -> Vec<(u64, &'static str)> {
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

/// Messages queued towards the (stopped) prefill, decoded.
fn queued_to_prefill(p: &Pair) -> Vec<(u64, Message)> {
    p.to_prefill
        .iter()
        .map(|f| {
            let e = decode(&[&f[0], &f[1]]).unwrap();
            (e.room, e.msg)
        })
        .collect()
}

/// The decode's loop while the prefill is stopped: it ticks every 10 ms and hears nothing;
/// what it sends stays queued (the TCP connection of a stopped process stays open).
/// Returns when `until` holds, with the time it took.
fn tick_alone(p: &mut Pair, limit: Duration, until: impl Fn(&Pair) -> bool) -> Duration {
    let t0 = p.now;
    while !until(p) {
        assert!(p.now.duration_since(t0) <= limit, "not within {limit:?}");
        p.advance(Duration::from_millis(10));
        p.decode_event(DecodeEvent::Tick);
    }
    p.now.duration_since(t0)
}

#[test]
fn a_stopped_prefill_fails_its_rooms_within_the_deadline_and_new_rooms_at_once() {
    let t = timings();
    let mut p = Pair::new();
    p.establish();
    p.open(1, 10);
    p.open(2, 12);
    p.settle();
    assert_eq!(p.prefill_submitted, [1, 2]);
    // Room 3 is being aborted (its client left) when the prefill stops: it keeps its KV
    // buffer until the ABORT_ACK, or its own deadline.
    p.open(3, 8);
    p.settle();
    p.decode_event(DecodeEvent::ClientGone { room: 3 });
    let stopped = p.now;

    let took = tick_alone(&mut p, Duration::from_secs(5), |p| {
        !p.decode_ended.is_empty()
    });
    // From the stop: one deadline after the first PING it did not answer, which went out
    // at most one heartbeat after its last message.
    assert!(
        took >= t.channel_deadline && took <= t.channel_deadline + t.channel_heartbeat(),
        "found after {took:?} (deadline {:?}, heartbeat {:?})",
        t.channel_deadline,
        t.channel_heartbeat()
    );
    let mut failed_rooms = ends(&p);
    failed_rooms.sort();
    assert_eq!(
        failed_rooms,
        [(1, "peer_unresponsive"), (2, "peer_unresponsive")]
    );
    for (_, e) in &p.decode_ended {
        let RoomEnd::Failed {
            text,
            peer_incarnation,
            ..
        } = e
        else {
            panic!("{e:?}")
        };
        assert_eq!(*peer_incarnation, 0xAAAA);
        assert!(text.contains("channel deadline 1000 ms"), "{text}");
    }
    let st = p.decode.status();
    assert_ne!(st.state, ChannelState::Established);
    assert!(st.unresponsive);
    let refusal = st.last_refusal.unwrap();
    assert_eq!(refusal.reason, "peer_unresponsive");
    assert!(
        refusal.message.contains("prefill-0:5600"),
        "{}",
        refusal.message
    );
    assert!(p.decode_effects.iter().any(|e| matches!(
        e,
        DecodeEffect::Note(DecodeNote::PeerUnresponsive {
            peer_incarnation: 0xAAAA,
            rooms_failed: 2,
            unanswered,
            deadline,
        }) if *unanswered >= *deadline
    )));
    // FAILED for each is queued towards the prefill, ahead of the new HELLO (sent on the
    // next tick).
    p.advance(Duration::from_millis(10));
    p.decode_event(DecodeEvent::Tick);
    let queued = queued_to_prefill(&p);
    let mut failed: Vec<u64> = queued
        .iter()
        .filter(|(_, m)| {
            matches!(
                m,
                Message::Failed {
                    reason: FailCode::PeerUnresponsive,
                    ..
                }
            )
        })
        .map(|(r, _)| *r)
        .collect();
    failed.sort();
    assert_eq!(failed, [1, 2]);
    let hello = queued
        .iter()
        .position(|(_, m)| matches!(m, Message::Hello { .. }));
    let last_failed = queued
        .iter()
        .rposition(|(_, m)| matches!(m, Message::Failed { .. }));
    assert!(hello > last_failed, "{queued:?}");

    // While it stays silent, a new room ends at once with the reason, never waits.
    p.open(4, 10);
    assert_eq!(ends(&p).last(), Some(&(4, "peer_unresponsive")));
    assert!(!p.decode.has_room(4));
    assert!(p.decode.has_room(3), "the aborting room waits for its ack");
    assert!(p.now.duration_since(stopped) < t.bootstrap_timeout);

    // SIGCONT. The prefill's engine finished room 1 just then: its KV and DONE, and
    // the PONGs of the PINGs it had not read, reach the decode late. Nothing of the old
    // session comes back: rooms 1 and 2 stay ended once, the session stays down.
    p.engine_finishes(1);
    while p.deliver_to_decode() {}
    assert_ne!(p.decode.status().state, ChannelState::Established);
    while p.deliver_to_prefill() {}
    // It read FAILED for 1 and 2 (room 1 had ended already) and the ABORT of 3.
    assert!(p.prefill_ended.contains(&2), "{:?}", p.prefill_ended);
    assert_eq!(p.prefill.rooms_open(), 0);
    p.settle();
    assert_eq!(p.decode.status().state, ChannelState::Established);
    assert!(!p.decode.status().unresponsive);
    let mut counts = std::collections::HashMap::new();
    for (room, _) in &p.decode_ended {
        *counts.entry(*room).or_insert(0) += 1;
    }
    assert!(counts.values().all(|&n| n == 1), "{:?}", ends(&p));
    assert!(ends(&p).contains(&(3, "client_abort")), "acked on resume");
    // And serves again.
    p.open(5, 10);
    p.settle();
    p.engine_finishes(5);
    p.settle();
    assert_eq!(ends(&p).last(), Some(&(5, "done")));
}

#[test]
fn a_decode_that_was_itself_paused_does_not_take_the_prefill_for_unresponsive() {
    let t = timings();
    let mut p = Pair::new();
    p.establish();
    p.open(1, 10);
    p.settle();
    // The decode's PING goes out and is answered, but the decode stops before reading the
    // PONG, for 1.5 deadlines (within the prefill's session expiry), while the prefill
    // works on room 1 (its PROGRESS queues up too). The loop then reads what came before
    // it ticks (the loop's order).
    p.advance(t.channel_heartbeat());
    p.decode_event(DecodeEvent::Tick);
    while p.deliver_to_prefill() {}
    assert!(!p.to_decode.is_empty(), "the PONG is queued");
    let pause = t.channel_deadline * 3 / 2;
    assert!(pause < t.session_expiry());
    for _ in 0..15 {
        p.advance(pause / 15);
        p.prefill_event(PrefillEvent::Tick { engine_live: true });
    }
    while p.deliver_to_decode() {}
    p.decode_event(DecodeEvent::Tick);
    assert_eq!(p.decode.status().state, ChannelState::Established);
    p.settle();
    p.engine_finishes(1);
    p.settle();
    assert_eq!(ends(&p), [(1, "done")]);
    // Paused with nothing outstanding and nothing to hear (no room, its last PING
    // answered): longer than the deadline since the prefill's last message, yet not its
    // fault. The decode PINGs first and waits for the answer.
    p.round();
    p.advance(pause);
    p.decode_event(DecodeEvent::Tick);
    assert_eq!(p.decode.status().state, ChannelState::Established);
    p.settle();
    p.advance(t.channel_heartbeat());
    p.round();
    assert_eq!(p.decode.status().state, ChannelState::Established);
    assert_eq!(ends(&p), [(1, "done")]);
}

#[test]
fn welcomes_to_earlier_hellos_after_a_long_stop_are_dropped_not_refused() {
    let t = timings();
    let mut p = Pair::new();
    p.establish();
    // Stopped for the deadline and then two bootstrap timeouts: three HELLOs queue up.
    tick_alone(&mut p, Duration::from_secs(3), |p| {
        p.decode.status().unresponsive
    });
    let hellos = |p: &Pair| {
        queued_to_prefill(p)
            .iter()
            .filter(|(_, m)| matches!(m, Message::Hello { .. }))
            .count()
    };
    tick_alone(&mut p, t.bootstrap_timeout * 3, |p| hellos(p) == 3);
    let effects_before = p.decode_effects.len();
    // Resumed: it answers every HELLO (the last one's is the handshake it keeps), and
    // the decode completes the handshake of its newest HELLO.
    while p.deliver_to_prefill() {}
    p.settle();
    assert_eq!(p.decode.status().state, ChannelState::Established);
    let after = &p.decode_effects[effects_before..];
    let stale = after
        .iter()
        .filter(|e| matches!(e, DecodeEffect::Note(DecodeNote::StaleWelcome { .. })))
        .count();
    assert_eq!(stale, 2, "{after:?}");
    assert!(
        !after.iter().any(|e| matches!(
            e,
            DecodeEffect::Note(DecodeNote::HandshakeFailed { .. })
                | DecodeEffect::Send {
                    msg: Message::Reject { .. },
                    ..
                }
        )),
        "a stale WELCOME is no failed proof: {after:?}"
    );
    // A forged WELCOME is still refused.
    p.restart_prefill(0xBBBB);
    p.prefill = prefill_session(0xBBBB, b"another key");
    p.advance(t.channel_heartbeat());
    p.round();
    p.advance(t.probe_period);
    for _ in 0..3 {
        p.round();
    }
    assert!(p.decode_effects.iter().any(|e| matches!(
        e,
        DecodeEffect::Note(DecodeNote::HandshakeFailed {
            result: "auth_failed",
            ..
        })
    )));
}

#[test]
fn a_welcome_after_its_attempt_was_abandoned_is_dropped_as_stale() {
    let t = timings();
    let mut p = Pair::new();
    p.establish();
    // A partition: each side hears nothing. The decode finds the prefill unresponsive and
    // queues a HELLO; the prefill expires the silent decode's session.
    tick_alone(&mut p, Duration::from_secs(2), |p| {
        p.decode.status().unresponsive
    });
    p.advance(Duration::from_millis(10));
    p.decode_event(DecodeEvent::Tick);
    p.advance(t.session_expiry());
    p.prefill_event(PrefillEvent::Tick { engine_live: true });
    assert_eq!(p.prefill.sessions(), 0);
    // Healed: the prefill refuses the PINGs of the expired session (REJECT peer_expired),
    // which ends the decode's attempt, then answers its HELLO; that WELCOME finds the
    // decode waiting to retry.
    while p.deliver_to_prefill() {}
    let effects_before = p.decode_effects.len();
    while p.deliver_to_decode() {}
    let after = &p.decode_effects[effects_before..];
    assert!(
        after
            .iter()
            .any(|e| matches!(e, DecodeEffect::Note(DecodeNote::StaleWelcome { .. }))),
        "{after:?}"
    );
    assert!(
        !after
            .iter()
            .any(|e| matches!(e, DecodeEffect::Note(DecodeNote::Unexpected { .. }))),
        "{after:?}"
    );
    assert_eq!(
        p.decode.status().last_refusal.unwrap().reason,
        "peer_expired"
    );
    // The next attempt, a probe period later, establishes the channel again.
    p.advance(t.probe_period);
    p.establish();
    assert_eq!(p.decode.status().state, ChannelState::Established);
}
