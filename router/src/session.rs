//! Session affinity: the decode each client-chosen session id (`x-session-id`) was last
//! answered by. Ids are kept as hashes (a client's string is never stored), at most
//! [`MAX_SESSIONS`] of them, the oldest pinned forgotten first.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;

/// Most sessions remembered.
pub const MAX_SESSIONS: usize = 100_000;

/// A session's decode: its pod and the incarnation it served at.
pub type Pin = (String, i64);

#[derive(Debug, Default)]
pub struct Sessions {
    hasher: RandomState,
    pins: HashMap<u64, Pin>,
    /// Pinning order, oldest first (an id pinned again is listed again; stale entries are
    /// skipped when the oldest is forgotten).
    order: VecDeque<(u64, u64)>,
    stamp: u64,
    stamps: HashMap<u64, u64>,
}

impl Sessions {
    pub fn id(&self, session: &[u8]) -> u64 {
        self.hasher.hash_one(session)
    }

    pub fn get(&self, id: u64) -> Option<&Pin> {
        self.pins.get(&id)
    }

    pub fn len(&self) -> usize {
        self.pins.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pins.is_empty()
    }

    /// Pin session `id` to `pin` (a no-op when it already is).
    pub fn pin(&mut self, id: u64, pin: Pin) {
        if self.pins.get(&id) == Some(&pin) {
            return;
        }
        self.pins.insert(id, pin);
        self.stamp += 1;
        self.stamps.insert(id, self.stamp);
        self.order.push_back((id, self.stamp));
        while self.pins.len() > MAX_SESSIONS {
            let Some((old, stamp)) = self.order.pop_front() else {
                break;
            };
            if self.stamps.get(&old) == Some(&stamp) {
                self.pins.remove(&old);
                self.stamps.remove(&old);
            }
        }
        // Stale entries (ids pinned again since) are dropped when they pile up.
        if self.order.len() > 2 * MAX_SESSIONS {
            let stamps = &self.stamps;
            self.order.retain(|(id, s)| stamps.get(id) == Some(s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_keeps_its_latest_pin_and_the_oldest_are_forgotten() {
        let mut s = Sessions::default();
        let a = s.id(b"alice");
        assert_ne!(a, s.id(b"bob"));
        s.pin(a, ("d0".into(), 1));
        s.pin(a, ("d1".into(), 2));
        assert_eq!(s.get(a), Some(&("d1".to_string(), 2)));
        for i in 0..MAX_SESSIONS as u64 {
            s.pin(i + 1_000_000_000, ("d".into(), 1));
        }
        assert_eq!(s.len(), MAX_SESSIONS);
        assert_eq!(s.get(a), None, "the oldest session went first");
    }
}
