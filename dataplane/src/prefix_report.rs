//! The prefix cache's keys as the HTTP side reports them to a router (`GET
//! /tandem/report`): the engine thread copies them from its runner here, at most every
//! [`PERIOD`] and only when they changed, and only once a router has asked for them (a
//! decode nobody routes to copies nothing).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::engine_api::PrefixKeys;

/// Longest the reported keys lag the cache (routers ask every 250 ms).
pub const PERIOD: Duration = Duration::from_millis(100);

#[derive(Debug)]
pub struct PrefixReport {
    start: Instant,
    /// A router asked for the keys.
    wanted: AtomicBool,
    /// When (ms since `start`, plus one) the engine last looked (0: never).
    checked_ms: AtomicU64,
    version: AtomicU64,
    keys: Mutex<Arc<[u64]>>,
}

impl Default for PrefixReport {
    fn default() -> Self {
        Self {
            start: Instant::now(),
            wanted: AtomicBool::new(false),
            checked_ms: AtomicU64::new(0),
            version: AtomicU64::new(0),
            keys: Mutex::new(Arc::from(Vec::new())),
        }
    }
}

impl PrefixReport {
    /// The HTTP side: a router asked; the engine keeps the keys fresh from now on.
    pub fn want(&self) {
        self.wanted.store(true, Ordering::Relaxed);
    }

    /// The engine thread, once a round: the version to compare the runner's cache with
    /// when a look is due (wanted, and [`PERIOD`] since the last), else `None` (two
    /// relaxed loads).
    pub fn due(&self) -> Option<u64> {
        if !self.wanted.load(Ordering::Relaxed) {
            return None;
        }
        let now = self.start.elapsed().as_millis() as u64 + 1;
        let last = self.checked_ms.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < PERIOD.as_millis() as u64 {
            return None;
        }
        self.checked_ms.store(now, Ordering::Relaxed);
        Some(self.version.load(Ordering::Relaxed))
    }

    /// The engine thread: the cache changed.
    pub fn publish(&self, p: PrefixKeys) {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        *keys = Arc::from(p.keys);
        self.version.store(p.version, Ordering::Relaxed);
    }

    /// The version and the keys reported now (consistent: taken under one lock).
    pub fn snapshot(&self) -> (u64, Arc<[u64]>) {
        let keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        (self.version.load(Ordering::Relaxed), keys.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_copied_only_once_wanted_and_at_most_every_period() {
        let r = PrefixReport::default();
        assert_eq!(r.due(), None, "nobody asked");
        r.want();
        assert_eq!(r.due(), Some(0));
        assert_eq!(r.due(), None, "not again within the period");
        r.publish(PrefixKeys {
            version: 3,
            keys: vec![7, 9],
        });
        let (v, k) = r.snapshot();
        assert_eq!((v, &*k), (3, &[7u64, 9][..]));
        std::thread::sleep(PERIOD + Duration::from_millis(5));
        assert_eq!(r.due(), Some(3));
    }
}
