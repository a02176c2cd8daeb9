//! Rooms that wait for a session which a dead prefill will never give: one opened by a
//! request that picked the peer just before its connection closed (the loop reads the
//! disconnect first, then the room), or one queued while handshaking, ends within the
//! channel deadline with the reason the session ended, never at the bootstrap timeout.

use std::time::Duration;

use super::decode_session::{ChannelState, DecodeEvent, RoomEnd};
use super::session_harness::*;

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

/// The decode's loop with the prefill gone: a tick every 10 ms, every send fails (no
/// connection). Returns how long it took until `room` ended.
fn until_ended(p: &mut Pair, room: u64, limit: Duration) -> Duration {
    let t0 = p.now;
    while !p.decode_ended.iter().any(|(r, _)| *r == room) {
        assert!(
            p.now.duration_since(t0) <= limit,
            "room {room} still open after {limit:?}: {:?}",
            ends(p)
        );
        p.advance(Duration::from_millis(10));
        p.decode_event(DecodeEvent::Tick);
    }
    p.now.duration_since(t0)
}

#[test]
fn a_room_opened_just_after_the_connection_closed_fails_peer_lost_within_the_deadline() {
    let t = timings();
    assert!(t.bootstrap_timeout > t.channel_deadline);
    let mut p = Pair::new();
    p.establish();
    p.open(1, 10);
    p.settle();
    // SIGKILL of the prefill: the connection closes; the room sent fails at once.
    p.cut = true;
    p.decode_event(DecodeEvent::Disconnected {
        endpoint: "tcp://prefill-0:5600".into(),
    });
    assert_eq!(ends(&p), [(1, "peer_lost")]);
    // A request that picked the peer while it was still established: its room comes after.
    p.open(2, 10);
    p.decode_event(DecodeEvent::Tick);
    assert!(
        p.decode.has_room(2),
        "a link that comes back at once would serve it"
    );
    let took = until_ended(&mut p, 2, t.bootstrap_timeout);
    assert!(
        took <= t.channel_deadline + Duration::from_millis(20),
        "ended after {took:?}, channel deadline {:?}",
        t.channel_deadline
    );
    assert_eq!(ends(&p)[1], (2, "peer_lost"));
    let RoomEnd::Failed { text, .. } = &p.decode_ended[1].1 else {
        unreachable!()
    };
    assert!(text.contains("no session with the prefill"), "{text}");
    assert!(text.contains("peer_unreachable"), "says why: {text}");
    assert_eq!(p.decode.status().rooms, 0);
}

#[test]
fn a_room_opened_later_still_gets_a_whole_deadline_and_a_returning_link_serves_it() {
    let t = timings();
    let mut p = Pair::new();
    p.establish();
    p.cut = true;
    p.decode_event(DecodeEvent::Disconnected {
        endpoint: String::new(),
    });
    // Long after the loss (the HTTP side refuses then; one that slipped through).
    p.advance(t.channel_deadline * 3);
    p.decode_event(DecodeEvent::Tick);
    p.open(3, 10);
    let took = until_ended(&mut p, 3, t.bootstrap_timeout);
    assert!(took >= t.channel_deadline, "ended after {took:?}");
    assert!(took <= t.channel_deadline + Duration::from_millis(20));
    assert_eq!(ends(&p), [(3, "peer_lost")]);
    // The link comes back within the deadline of a room: it is served.
    p.open(4, 10);
    p.advance(t.channel_deadline / 2);
    p.cut = false;
    p.establish();
    assert_eq!(p.decode.status().state, ChannelState::Established);
    p.engine_finishes(4);
    p.settle();
    assert_eq!(ends(&p)[1], (4, "done"));
}

#[test]
fn a_room_queued_when_the_prefill_restarted_fails_with_that_reason_if_no_session_follows() {
    let t = timings();
    let mut p = Pair::new();
    p.establish();
    // A new prefill process with another group key: every handshake is refused.
    p.prefill = prefill_session(0xBBBB, b"another key");
    p.prefill_incarnation = 0xBBBB;
    p.to_prefill.clear();
    // The decode hears of the new incarnation at its next PING's answer.
    let t0 = p.now;
    while p.decode.status().state == ChannelState::Established {
        assert!(
            p.now.duration_since(t0) <= t.channel_deadline,
            "no restart seen"
        );
        p.advance(Duration::from_millis(10));
        p.round();
    }
    assert!(ends(&p).is_empty());
    p.open(5, 10);
    let t0 = p.now;
    while !p.decode_ended.iter().any(|(r, _)| *r == 5) {
        assert!(
            p.now.duration_since(t0) <= t.bootstrap_timeout,
            "{:?}",
            ends(&p)
        );
        p.advance(Duration::from_millis(10));
        p.round();
    }
    assert!(p.now.duration_since(t0) <= t.channel_deadline + Duration::from_millis(20));
    assert_eq!(ends(&p), [(5, "peer_restarted")]);
}
