//! What each decode holds in its prefix cache, as the router knows it, in the engine's own
//! terms: the chained keys of whole KV blocks (`block_key` in the dataplane's
//! `model::prefix_cache`: FNV-1a 64 over the parent's key and the block's token ids).
//!
//! Two sources, both exact keys (never guessed from text):
//! - **published**: the keys the decode reported holding at its last report (its prefix
//!   cache, referenced or idle blocks; evicted blocks are gone from the next report);
//! - **sent**: the keys of prompts this router sent it since, which the decode caches once
//!   it has their KV, before its next report can say so. They expire after a while: a
//!   prompt's blocks are in the reports by then, or were never kept.
//!
//! A request's match is the count of its leading keys found in either (a chain: the first
//! missing block ends it, as the engine's lookup does).

use std::collections::{HashMap, HashSet};

/// One whole KV block's chained key.
pub type BlockKey = u64;

/// How long a sent prompt's keys count as held without a report saying so.
pub const SENT_TTL_MS: u64 = 10_000;
/// Most sent keys remembered per decode (a bound on memory; the oldest go first).
pub const MAX_SENT: usize = 1 << 16;

#[derive(Debug, Default, Clone)]
pub struct Holdings {
    published: HashSet<BlockKey>,
    version: Option<u64>,
    /// Key → when (the host's clock, ms) a prompt holding it was last sent.
    sent: HashMap<BlockKey, u64>,
}

impl Holdings {
    /// The version of the last report taken (the decode's own counter).
    pub fn version(&self) -> Option<u64> {
        self.version
    }

    /// Keys the last report named.
    pub fn published(&self) -> usize {
        self.published.len()
    }

    /// Take a report: the decode holds exactly `keys` now.
    pub fn publish(&mut self, version: u64, keys: impl IntoIterator<Item = BlockKey>, now_ms: u64) {
        self.published = keys.into_iter().collect();
        self.version = Some(version);
        let published = &self.published;
        self.sent
            .retain(|k, at| now_ms.saturating_sub(*at) < SENT_TTL_MS && !published.contains(k));
    }

    /// A prompt with `keys` was sent to the decode.
    pub fn note_sent(&mut self, keys: &[BlockKey], now_ms: u64) {
        if self.sent.len() + keys.len() > MAX_SENT {
            self.sent
                .retain(|_, at| now_ms.saturating_sub(*at) < SENT_TTL_MS);
            if self.sent.len() + keys.len() > MAX_SENT {
                self.sent.clear();
            }
        }
        for &k in keys {
            self.sent.insert(k, now_ms);
        }
    }

    /// Leading keys of `keys` the decode holds (published, or sent within the TTL).
    pub fn matched(&self, keys: &[BlockKey], now_ms: u64) -> usize {
        keys.iter()
            .take_while(|&&k| {
                self.published.contains(&k)
                    || self
                        .sent
                        .get(&k)
                        .is_some_and(|at| now_ms.saturating_sub(*at) < SENT_TTL_MS)
            })
            .count()
    }
}

/// A key as the decodes write it: 16 lowercase hex digits.
pub fn parse_key(s: &str) -> Option<BlockKey> {
    (s.len() == 16)
        .then(|| u64::from_str_radix(s, 16).ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_match_is_the_leading_chain_of_published_or_recently_sent_keys() {
        let mut h = Holdings::default();
        assert_eq!(h.matched(&[1, 2, 3], 0), 0);
        h.publish(1, [1, 2, 4], 0);
        assert_eq!(
            h.matched(&[1, 2, 3, 4], 0),
            2,
            "the chain ends at the first miss"
        );
        h.note_sent(&[1, 2, 3], 100);
        assert_eq!(h.matched(&[1, 2, 3, 4], 100), 4);
        assert_eq!(
            h.matched(&[1, 2, 3, 4], 100 + SENT_TTL_MS),
            2,
            "sent keys expire"
        );
        // A report without a key the router sent (evicted, or not computed yet) leaves it
        // counted until it expires; a report that has it makes it published.
        h.publish(2, [1, 2], 200);
        assert_eq!(h.matched(&[1, 2, 3], 200), 3);
        h.publish(3, [1, 2, 3], 300);
        assert_eq!(h.matched(&[1, 2, 3], 300 + SENT_TTL_MS), 3);
        assert_eq!((h.version(), h.published()), (Some(3), 3));
        // A report after a restart holds nothing.
        h.publish(1, [], 400);
        assert_eq!(h.matched(&[1, 2, 3], 400), 0);
    }

    #[test]
    fn sent_keys_are_bounded() {
        let mut h = Holdings::default();
        let keys: Vec<u64> = (0..MAX_SENT as u64).collect();
        h.note_sent(&keys, 0);
        h.note_sent(&[u64::MAX], 1);
        assert!(h.sent.len() <= MAX_SENT);
        assert_eq!(h.matched(&[u64::MAX], 1), 1);
    }

    #[test]
    fn keys_are_sixteen_hex_digits() {
        assert_eq!(parse_key("00000000000000ff"), Some(255));
        assert_eq!(parse_key("ff"), None);
        assert_eq!(parse_key("zz000000000000ff"), None);
    }
}
