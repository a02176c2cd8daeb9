//! Property test of both sessions over random event sequences: a decode and a prefill on
//! an in-memory wire that loses, duplicates, reorders, replays and forges messages, with
//! prefill restarts, cut connections, clients that leave, an engine that finishes, fails
//! or stalls, drains and stops. After every step:
//! - nothing panicked;
//! - the decode is never established with a peer that did not prove the group key, nor
//!   with a stale one (every message it heard since it authenticated came from the
//!   incarnation it authenticated);
//! - no room ended twice, and every end has a reason;
//! - after a tick, the decode is established only if no PING has gone unanswered (no
//!   message from the prefill since) for the channel deadline.
//!
//! At the end (both sides stopped), every room either side opened ended exactly once.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use proptest::prelude::*;

use super::decode_session::{ChannelState, DecodeEffect, DecodeEvent, DecodeNote, RoomEnd};
use super::prefill_session::{EngineUpdate, PrefillEvent};
use super::session_harness::*;
use super::{Envelope, FailCode, Message};

#[derive(Debug, Clone)]
enum Step {
    Advance(u16),
    Tick,
    ToPrefill,
    ToDecode,
    LoseToPrefill,
    LoseToDecode,
    DuplicateToDecode,
    SwapToDecode,
    Open(u8),
    ClientGone(u8),
    EngineFinishes(u8),
    EngineFails(u8),
    EngineStalls,
    Disconnect,
    Cut(bool),
    RestartPrefill,
    /// Replay a frame sent to the decode before (any incarnation, any time).
    Replay(u8),
    /// A message from someone without the key: an ACCEPTED or a WELCOME under an
    /// incarnation of its own.
    Forge(bool, u64),
    Garbage,
    Drain,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (1u16..3000).prop_map(Step::Advance),
        6 => Just(Step::Tick),
        8 => Just(Step::ToPrefill),
        8 => Just(Step::ToDecode),
        1 => Just(Step::LoseToPrefill),
        1 => Just(Step::LoseToDecode),
        1 => Just(Step::DuplicateToDecode),
        1 => Just(Step::SwapToDecode),
        3 => (1u8..40).prop_map(Step::Open),
        1 => any::<u8>().prop_map(Step::ClientGone),
        3 => any::<u8>().prop_map(Step::EngineFinishes),
        1 => any::<u8>().prop_map(Step::EngineFails),
        1 => Just(Step::EngineStalls),
        1 => Just(Step::Disconnect),
        1 => any::<bool>().prop_map(Step::Cut),
        1 => Just(Step::RestartPrefill),
        1 => any::<u8>().prop_map(Step::Replay),
        1 => (any::<bool>(), any::<u64>()).prop_map(|(a, i)| Step::Forge(a, i)),
        1 => Just(Step::Garbage),
        1 => Just(Step::Drain),
    ]
}

struct World {
    p: Pair,
    next_room: u64,
    next_incarnation: u64,
    /// Incarnations of prefills that hold the key.
    genuine: HashSet<u64>,
    /// Every frame ever sent to the decode, for replays.
    seen: Vec<Frames>,
    /// Index into `p.decode_heard` where the last authentication happened.
    heard_since_auth: usize,
    checked_effects: usize,
}

impl World {
    fn new() -> Self {
        Self {
            p: Pair::new(),
            next_room: 1,
            next_incarnation: 0xAAAB,
            genuine: HashSet::from([0xAAAA]),
            seen: Vec::new(),
            heard_since_auth: 0,
            checked_effects: 0,
        }
    }

    fn pick<T: Copy>(v: &[T], i: u8) -> Option<T> {
        (!v.is_empty()).then(|| v[i as usize % v.len()])
    }

    /// After a tick: established only while the first PING since the last message heard
    /// from the established prefill is younger than the channel deadline.
    fn check_deadline(&self) -> Result<(), TestCaseError> {
        let p = &self.p;
        let st = p.decode.status();
        if st.state != ChannelState::Established {
            return Ok(());
        }
        let after_last = p
            .decode_log
            .iter()
            .rposition(|(_, c)| *c == Contact::Heard(st.peer_incarnation))
            .map_or(0, |i| i + 1);
        if let Some((at, _)) = p.decode_log[after_last..]
            .iter()
            .find(|(_, c)| *c == Contact::Ping)
        {
            prop_assert!(
                p.now.duration_since(*at) < timings().channel_deadline,
                "still established {:?} after an unanswered PING",
                p.now.duration_since(*at)
            );
        }
        Ok(())
    }

    fn run(&mut self, s: &Step) {
        let p = &mut self.p;
        match s {
            Step::Advance(ms) => p.advance(Duration::from_millis(u64::from(*ms))),
            Step::Tick => p.tick(),
            Step::ToPrefill => {
                p.deliver_to_prefill();
            }
            Step::ToDecode => {
                if let Some(f) = p.to_decode.pop_front() {
                    self.seen.push(f.clone());
                    p.deliver_frames_to_decode(&f);
                }
            }
            Step::LoseToPrefill => {
                p.to_prefill.pop_front();
            }
            Step::LoseToDecode => {
                p.to_decode.pop_front();
            }
            Step::DuplicateToDecode => {
                if let Some(f) = p.to_decode.front().cloned() {
                    p.to_decode.push_front(f);
                }
            }
            Step::SwapToDecode => {
                if p.to_decode.len() >= 2 {
                    p.to_decode.swap(0, 1);
                }
            }
            Step::Open(tokens) => {
                let room = self.next_room;
                self.next_room += 1;
                p.open(room, usize::from(*tokens));
            }
            Step::ClientGone(i) => {
                if let Some(room) = Self::pick(&p.decode_opened, *i) {
                    p.decode_event(DecodeEvent::ClientGone { room });
                }
            }
            Step::EngineFinishes(i) => {
                let rooms: Vec<u64> = p.engine.keys().copied().collect();
                if let Some(room) = Self::pick(&rooms, *i) {
                    p.engine_finishes(room);
                }
            }
            Step::EngineFails(i) => {
                let rooms: Vec<u64> = p.engine.keys().copied().collect();
                if let Some(room) = Self::pick(&rooms, *i) {
                    p.prefill_event(PrefillEvent::Engine {
                        room,
                        update: EngineUpdate::Failed {
                            code: FailCode::EngineFailed,
                            message: "step failed".into(),
                        },
                    });
                }
            }
            Step::EngineStalls => p.prefill_event(PrefillEvent::Tick { engine_live: false }),
            Step::Disconnect => p.decode_event(DecodeEvent::Disconnected {
                endpoint: "tcp://prefill-0:5600".into(),
            }),
            Step::Cut(c) => p.cut = *c,
            Step::RestartPrefill => {
                let inc = self.next_incarnation;
                self.next_incarnation += 1;
                self.genuine.insert(inc);
                p.restart_prefill(inc);
            }
            Step::Replay(i) => {
                if !self.seen.is_empty() {
                    let f = self.seen[*i as usize % self.seen.len()].clone();
                    p.deliver_frames_to_decode(&f);
                }
            }
            Step::Forge(accepted, inc) => {
                let inc = inc | 1 << 63; // never a genuine one
                let msg = if *accepted {
                    Message::Accepted
                } else {
                    Message::Welcome {
                        fingerprint: "model-1".into(),
                        layout: identity(0).layout,
                        nonce: [9; 32],
                        mac: [7; 32],
                    }
                };
                let env = Envelope {
                    incarnation: inc,
                    group_incarnation: GROUP,
                    room: 0,
                    msg,
                };
                p.deliver_frames_to_decode(&frames_of(&env));
            }
            Step::Garbage => p.deliver_frames_to_decode(&vec![b"XXXXjunk".to_vec(), vec![1, 2, 3]]),
            Step::Drain => p.prefill_event(PrefillEvent::Drain),
        }
    }

    /// The invariants that hold after every step.
    fn check(&mut self) -> Result<(), TestCaseError> {
        let p = &self.p;
        for e in &p.decode_effects[self.checked_effects..] {
            if let DecodeEffect::Note(DecodeNote::Authenticated {
                peer_incarnation, ..
            }) = e
            {
                prop_assert!(
                    self.genuine.contains(peer_incarnation),
                    "authenticated {peer_incarnation:x}, which never held the key"
                );
            }
        }
        // A step delivers at most one message: when it authenticated, the ACCEPTED was
        // the last message heard, and what counts is what came after.
        if p.decode_effects[self.checked_effects..]
            .iter()
            .any(|e| matches!(e, DecodeEffect::Note(DecodeNote::Authenticated { .. })))
        {
            self.heard_since_auth = p.decode_heard.len();
        }
        self.checked_effects = p.decode_effects.len();
        let st = p.decode.status();
        if st.state == ChannelState::Established {
            prop_assert!(self.genuine.contains(&st.peer_incarnation));
            for inc in &p.decode_heard[self.heard_since_auth..] {
                prop_assert_eq!(
                    *inc,
                    st.peer_incarnation,
                    "established with {:x} after hearing {:x}",
                    st.peer_incarnation,
                    inc
                );
            }
        }
        let mut ends: HashMap<u64, usize> = HashMap::new();
        for (room, end) in &p.decode_ended {
            *ends.entry(*room).or_default() += 1;
            match end {
                RoomEnd::Failed { code, .. } => prop_assert!(!code.label().is_empty()),
                RoomEnd::Aborted { reason, .. } => prop_assert!(!reason.is_empty()),
                RoomEnd::Done { .. } => {}
            }
        }
        prop_assert!(
            ends.values().all(|&n| n == 1),
            "a decode room ended twice: {ends:?}"
        );
        let mut pends: HashMap<u64, usize> = HashMap::new();
        for room in &p.prefill_ended {
            *pends.entry(*room).or_default() += 1;
        }
        prop_assert!(
            pends.values().all(|&n| n == 1),
            "a prefill room ended twice"
        );
        Ok(())
    }

    /// Both sides stop; every room either side opened has ended exactly once.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        let p = &mut self.p;
        p.decode_event(DecodeEvent::Stop);
        p.prefill_event(PrefillEvent::Stop);
        p.settle();
        self.check()?;
        let p = &self.p;
        let ended: HashSet<u64> = p.decode_ended.iter().map(|(r, _)| *r).collect();
        for room in &p.decode_opened {
            prop_assert!(ended.contains(room), "decode room {room} never ended");
        }
        let ended: HashSet<u64> = p.prefill_ended.iter().copied().collect();
        for room in &p.prefill_submitted {
            // A room of a prefill that was replaced died with its process.
            if p.engine.contains_key(room) || ended.contains(room) {
                prop_assert!(ended.contains(room), "prefill room {room} never ended");
            }
        }
        prop_assert_eq!(p.prefill.rooms_open(), 0);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn sessions_under_random_events_keep_their_invariants(
        steps in prop::collection::vec(step(), 1..120),
    ) {
        let mut w = World::new();
        for s in &steps {
            w.run(s);
            w.check()?;
            if matches!(s, Step::Tick) {
                w.check_deadline()?;
            }
        }
        w.finish()?;
    }
}

/// The property test reaches what it claims to: rooms are done, refused, fenced, lost.
#[test]
fn the_random_runs_exercise_every_kind_of_end() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let mut reasons: HashSet<&'static str> = HashSet::new();
    let mut established = 0;
    for _ in 0..300 {
        let steps = prop::collection::vec(step(), 60..120)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        let mut w = World::new();
        for s in &steps {
            w.run(s);
            if w.p.decode.status().state == ChannelState::Established {
                established += 1;
            }
        }
        w.finish().unwrap();
        for (_, e) in &w.p.decode_ended {
            reasons.insert(match e {
                RoomEnd::Done { .. } => "done",
                RoomEnd::Failed { code, .. } => code.label(),
                RoomEnd::Aborted { reason, .. } => reason,
            });
        }
    }
    for want in [
        "done",
        "peer_restarted",
        "peer_lost",
        "shutdown",
        "client_abort",
        "peer_unresponsive",
    ] {
        assert!(
            reasons.contains(want),
            "no run ended a room {want}: {reasons:?}"
        );
    }
    assert!(established > 0);
}
