//! Rooms: one prompt's transfer between a decode and a prefill. A table of rooms with a
//! small state machine: forward-only progress, sticky terminal states, no resurrection of
//! ids (finished ids are remembered, bounded), a no-progress deadline per state (every wait
//! has a deadline), and aborts that keep the room's resources until the peer acknowledges
//! (memory is reused only once the peer stopped writing it).

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use super::message::FailCode;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoomState {
    /// Opened; the request is not yet with the peer (decode: no session yet).
    Bootstrap,
    /// The peer has the request; no KV yet (prefill running the prompt).
    WaitingKv,
    /// KV chunks are flowing.
    Transferring,
    /// Waiting for KV memory / an engine slot.
    QueuedForMemory,
    /// ABORT sent; resources stay held until ABORT_ACK (or its deadline).
    Aborting,
    Done,
    Failed(FailCode),
    Aborted,
}

impl RoomState {
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Done | Self::Failed(_) | Self::Aborted)
    }

    /// Position in the forward order of the live states.
    fn rank(self) -> u8 {
        match self {
            Self::Bootstrap => 0,
            Self::WaitingKv => 1,
            Self::Transferring => 2,
            Self::QueuedForMemory => 3,
            Self::Aborting => 4,
            Self::Done | Self::Failed(_) | Self::Aborted => 5,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Self::Bootstrap => "bootstrap",
            Self::WaitingKv => "waiting_kv",
            Self::Transferring => "transferring",
            Self::QueuedForMemory => "queued_for_memory",
            Self::Aborting => "aborting",
            Self::Done => "done",
            Self::Failed(_) => "failed",
            Self::Aborted => "aborted",
        }
    }

    /// The failure a missed deadline in this state becomes.
    pub fn timeout_code(self) -> FailCode {
        match self {
            Self::Bootstrap => FailCode::BootstrapTimeout,
            Self::QueuedForMemory => FailCode::QueueTimeout,
            _ => FailCode::KvTimeout,
        }
    }
}

/// No-progress limits per live state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    pub bootstrap: Duration,
    pub waiting_kv: Duration,
    pub transferring: Duration,
    pub queued: Duration,
    pub abort_ack: Duration,
}

impl Deadlines {
    pub fn new(bootstrap: Duration, kv: Duration) -> Self {
        Self {
            bootstrap,
            waiting_kv: kv,
            transferring: kv,
            queued: kv,
            abort_ack: bootstrap,
        }
    }

    fn of(&self, s: RoomState) -> Option<Duration> {
        match s {
            RoomState::Bootstrap => Some(self.bootstrap),
            RoomState::WaitingKv => Some(self.waiting_kv),
            RoomState::Transferring => Some(self.transferring),
            RoomState::QueuedForMemory => Some(self.queued),
            RoomState::Aborting => Some(self.abort_ack),
            _ => None,
        }
    }
}

impl Default for Deadlines {
    fn default() -> Self {
        Self::new(Duration::from_secs(10), Duration::from_secs(30))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RoomError {
    #[error("room id 0 is reserved")]
    ZeroId,
    #[error("room {0} is already open")]
    Duplicate(u64),
    #[error("room {0} has finished; ids are never reused")]
    Finished(u64),
    #[error("room {0} is unknown")]
    Unknown(u64),
    #[error("room {id}: illegal transition {from:?} -> {to:?}")]
    Illegal {
        id: u64,
        from: RoomState,
        to: RoomState,
    },
}

#[derive(Debug)]
pub struct Room<T> {
    pub state: RoomState,
    /// Last progress (state entry or refresh).
    pub since: Instant,
    pub data: T,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortOutcome {
    /// Unknown or already finished: nothing to do (an ABORT can never hurt the receiver).
    NoOp,
    /// Already aborting: nothing new to send.
    AlreadyAborting,
    /// The room is now `Aborting`; send ABORT to the peer.
    SendAbort,
}

pub struct RoomTable<T> {
    active: HashMap<u64, Room<T>>,
    finished: HashSet<u64>,
    finished_order: VecDeque<u64>,
    remember: usize,
    pub deadlines: Deadlines,
}

impl<T> RoomTable<T> {
    /// `remember`: how many finished ids are kept to refuse their reuse.
    pub fn new(deadlines: Deadlines, remember: usize) -> Self {
        Self {
            active: HashMap::new(),
            finished: HashSet::new(),
            finished_order: VecDeque::new(),
            remember: remember.max(1),
            deadlines,
        }
    }

    pub fn open(
        &mut self,
        id: u64,
        state: RoomState,
        data: T,
        now: Instant,
    ) -> Result<(), RoomError> {
        if id == 0 {
            return Err(RoomError::ZeroId);
        }
        if self.active.contains_key(&id) {
            return Err(RoomError::Duplicate(id));
        }
        if self.finished.contains(&id) {
            return Err(RoomError::Finished(id));
        }
        debug_assert!(!state.is_terminal());
        self.active.insert(
            id,
            Room {
                state,
                since: now,
                data,
            },
        );
        Ok(())
    }

    pub fn get(&self, id: u64) -> Option<&Room<T>> {
        self.active.get(&id)
    }

    pub fn get_mut(&mut self, id: u64) -> Option<&mut Room<T>> {
        self.active.get_mut(&id)
    }

    pub fn len(&self) -> usize {
        self.active.len()
    }

    pub fn is_empty(&self) -> bool {
        self.active.is_empty()
    }

    pub fn ids(&self) -> Vec<u64> {
        self.active.keys().copied().collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, &Room<T>)> {
        self.active.iter().map(|(k, v)| (*k, v))
    }

    pub fn is_finished(&self, id: u64) -> bool {
        self.finished.contains(&id)
    }

    /// Move forward to a live state (or stay, which refreshes the deadline: progress).
    pub fn advance(&mut self, id: u64, to: RoomState, now: Instant) -> Result<(), RoomError> {
        let r = self
            .active
            .get_mut(&id)
            .ok_or(if self.finished.contains(&id) {
                RoomError::Finished(id)
            } else {
                RoomError::Unknown(id)
            })?;
        if to.is_terminal()
            || to == RoomState::Aborting
            || to.rank() < r.state.rank()
            || r.state == RoomState::Aborting
        {
            return Err(RoomError::Illegal {
                id,
                from: r.state,
                to,
            });
        }
        r.state = to;
        r.since = now;
        Ok(())
    }

    /// End a live room as Done or Failed. Terminal states are sticky: a finished or
    /// unknown room yields None.
    pub fn finish(&mut self, id: u64, outcome: RoomState) -> Option<Room<T>> {
        debug_assert!(matches!(
            outcome,
            RoomState::Done | RoomState::Failed(_) | RoomState::Aborted
        ));
        let mut r = self.active.remove(&id)?;
        r.state = outcome;
        self.remember_finished(id);
        Some(r)
    }

    /// Start aborting. Resources stay with the room until `abort_acked`.
    pub fn abort(&mut self, id: u64, now: Instant) -> AbortOutcome {
        match self.active.get_mut(&id) {
            None => AbortOutcome::NoOp,
            Some(r) if r.state == RoomState::Aborting => AbortOutcome::AlreadyAborting,
            Some(r) => {
                r.state = RoomState::Aborting;
                r.since = now;
                AbortOutcome::SendAbort
            }
        }
    }

    /// The peer confirmed it stopped writing: the room ends `Aborted` and its resources
    /// are handed back. An ack for a room that is not aborting is ignored.
    pub fn abort_acked(&mut self, id: u64) -> Option<Room<T>> {
        if self.active.get(&id)?.state != RoomState::Aborting {
            return None;
        }
        self.finish(id, RoomState::Aborted)
    }

    /// Rooms whose current state has made no progress within its deadline.
    pub fn expired(&self, now: Instant) -> Vec<(u64, RoomState)> {
        self.active
            .iter()
            .filter(|(_, r)| {
                self.deadlines
                    .of(r.state)
                    .is_some_and(|d| now.saturating_duration_since(r.since) >= d)
            })
            .map(|(id, r)| (*id, r.state))
            .collect()
    }

    fn remember_finished(&mut self, id: u64) {
        if self.finished.insert(id) {
            self.finished_order.push_back(id);
        }
        while self.finished_order.len() > self.remember {
            if let Some(old) = self.finished_order.pop_front() {
                self.finished.remove(&old);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> RoomTable<&'static str> {
        RoomTable::new(
            Deadlines::new(Duration::from_secs(2), Duration::from_secs(5)),
            3,
        )
    }

    #[test]
    fn forward_progress_and_sticky_terminal_states() {
        let t0 = Instant::now();
        let mut t = table();
        t.open(1, RoomState::Bootstrap, "a", t0).unwrap();
        t.advance(1, RoomState::WaitingKv, t0).unwrap();
        t.advance(1, RoomState::Transferring, t0).unwrap();
        t.advance(1, RoomState::Transferring, t0).unwrap();
        assert!(matches!(
            t.advance(1, RoomState::WaitingKv, t0),
            Err(RoomError::Illegal { .. })
        ));
        assert!(
            t.advance(1, RoomState::Done, t0).is_err(),
            "terminal only via finish"
        );
        let r = t.finish(1, RoomState::Failed(FailCode::BadChunk)).unwrap();
        assert_eq!(r.state, RoomState::Failed(FailCode::BadChunk));
        // Sticky: no second finish, no progress, no reopening.
        assert!(t.finish(1, RoomState::Done).is_none());
        assert_eq!(
            t.advance(1, RoomState::Transferring, t0),
            Err(RoomError::Finished(1))
        );
        assert_eq!(
            t.open(1, RoomState::Bootstrap, "b", t0),
            Err(RoomError::Finished(1))
        );
        assert_eq!(
            t.open(0, RoomState::Bootstrap, "z", t0),
            Err(RoomError::ZeroId)
        );
        t.open(2, RoomState::Bootstrap, "c", t0).unwrap();
        assert_eq!(
            t.open(2, RoomState::Bootstrap, "c", t0),
            Err(RoomError::Duplicate(2))
        );
    }

    #[test]
    fn finished_ids_are_remembered_boundedly() {
        let t0 = Instant::now();
        let mut t = table();
        for id in 1..=5 {
            t.open(id, RoomState::Bootstrap, "x", t0).unwrap();
            t.finish(id, RoomState::Done).unwrap();
        }
        // The last 3 are remembered; the oldest were forgotten to bound memory.
        assert!((3..=5).all(|id| t.is_finished(id)));
        assert!(!t.is_finished(1) && !t.is_finished(2));
    }

    #[test]
    fn deadlines_per_state_reset_on_progress() {
        let t0 = Instant::now();
        let mut t = table();
        t.open(1, RoomState::Bootstrap, "a", t0).unwrap();
        t.open(2, RoomState::Bootstrap, "b", t0).unwrap();
        t.advance(2, RoomState::WaitingKv, t0).unwrap();
        assert!(t.expired(t0 + Duration::from_secs(1)).is_empty());
        let e = t.expired(t0 + Duration::from_secs(2));
        assert_eq!(e, vec![(1, RoomState::Bootstrap)]);
        assert_eq!(e[0].1.timeout_code(), FailCode::BootstrapTimeout);
        // Progress at 4 s pushes room 2's deadline to 9 s.
        t.advance(2, RoomState::Transferring, t0 + Duration::from_secs(4))
            .unwrap();
        let later = t.expired(t0 + Duration::from_secs(8));
        assert!(later.iter().all(|(id, _)| *id != 2));
        let last = t.expired(t0 + Duration::from_secs(9));
        assert!(last.contains(&(2, RoomState::Transferring)));
        assert_eq!(
            RoomState::QueuedForMemory.timeout_code(),
            FailCode::QueueTimeout
        );
    }

    #[test]
    fn abort_is_acknowledged_before_release_and_noop_when_unknown() {
        let t0 = Instant::now();
        let mut t = table();
        assert_eq!(t.abort(42, t0), AbortOutcome::NoOp, "unknown room");
        t.open(1, RoomState::Bootstrap, "blocks", t0).unwrap();
        t.advance(1, RoomState::Transferring, t0).unwrap();
        assert!(t.abort_acked(1).is_none(), "no ack before abort");
        assert_eq!(t.abort(1, t0), AbortOutcome::SendAbort);
        assert_eq!(t.abort(1, t0), AbortOutcome::AlreadyAborting);
        // Still held: chunks for it are refused, but the resources stay until the ack.
        assert_eq!(t.get(1).unwrap().state, RoomState::Aborting);
        assert!(t.advance(1, RoomState::Transferring, t0).is_err());
        let released = t.abort_acked(1).unwrap();
        assert_eq!(
            (released.state, released.data),
            (RoomState::Aborted, "blocks")
        );
        assert_eq!(t.abort(1, t0), AbortOutcome::NoOp, "finished room");
        assert!(t.abort_acked(1).is_none());
        assert_eq!(
            t.open(1, RoomState::Bootstrap, "again", t0),
            Err(RoomError::Finished(1))
        );
        // An ack that never comes expires after the abort deadline.
        t.open(9, RoomState::WaitingKv, "b", t0).unwrap();
        t.abort(9, t0);
        assert_eq!(
            t.expired(t0 + Duration::from_secs(2)),
            vec![(9, RoomState::Aborting)]
        );
    }
}
