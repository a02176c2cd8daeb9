//! Exact prefix caching: the index of whole KV blocks of prompts that stay in the pool
//! after their sequence ends, so that a later prompt starting with the same tokens reuses
//! their KV instead of computing it again.
//!
//! A cached block is keyed by a hash chain: the key of block `i` hashes the key of block
//! `i - 1` and the block's own token ids (FNV-1a 64 over little-endian bytes, so the same
//! tokens give the same keys in every process and version). The key is only an index:
//! a hit is exact because every entry also keeps its token ids and the identity of its
//! parent block (block id and the generation it entered the cache in), and a lookup
//! checks both, so no hash collision and no reuse of an evicted block can make a prompt
//! read another prompt's KV.
//!
//! Blocks are reference-counted by the allocator (`kv_cache::BlockAllocator`); this
//! index keeps the cached blocks that no sequence references ("idle") in least recently
//! used order. They count as free memory: the allocator evicts the least recently used
//! one whenever it needs a block and the free list is empty. Only whole prompt blocks are
//! cached, and a cached block is never written again (a sequence only writes positions at
//! or after its length, and a cached block lies wholly before it), so sharing one between
//! sequences needs no copy and no new kernel on any backend.

use std::collections::{BTreeMap, HashMap};

use crate::engine_api::PrefixCacheCounters;

/// Index of a block of token ids in the hash chain of a prompt.
pub type BlockKey = u64;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// The key of a block holding `tokens` after the block keyed `parent` (`None`: the first
/// block of a prompt).
pub fn block_key(parent: Option<BlockKey>, tokens: &[u32]) -> BlockKey {
    let mut h = FNV_OFFSET;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(FNV_PRIME);
        }
    };
    match parent {
        None => eat(&[0]),
        Some(p) => {
            eat(&[1]);
            eat(&p.to_le_bytes());
        }
    }
    for t in tokens {
        eat(&t.to_le_bytes());
    }
    h
}

/// The chained keys of the whole `block_tokens`-token blocks of `tokens`.
pub fn chain_keys(tokens: &[u32], block_tokens: usize) -> Vec<BlockKey> {
    let mut parent = None;
    tokens
        .chunks_exact(block_tokens)
        .map(|b| {
            let k = block_key(parent, b);
            parent = Some(k);
            k
        })
        .collect()
}

#[derive(Debug)]
struct Entry {
    key: BlockKey,
    tokens: Box<[u32]>,
    /// The block before this one in its prompt, as (block id, its generation).
    parent: Option<(u32, u64)>,
    /// Distinguishes this stay in the cache from earlier ones of the same block id.
    generation: u64,
    /// LRU stamp while no sequence references the block.
    idle_since: Option<u64>,
}

/// The cached blocks of one pool.
#[derive(Debug)]
pub struct PrefixCache {
    by_key: HashMap<BlockKey, u32>,
    /// Per block id: its entry while it is cached.
    entries: Vec<Option<Entry>>,
    /// Idle cached blocks by LRU stamp, least recently used first.
    idle: BTreeMap<u64, u32>,
    clock: u64,
    generations: u64,
    counters: PrefixCacheCounters,
    /// Bumped by every block entered or evicted: a report of [`Self::keys`] at one version
    /// is still exact while the version is.
    version: u64,
}

impl PrefixCache {
    pub fn new(n_blocks: usize) -> Self {
        Self {
            by_key: HashMap::new(),
            entries: (0..n_blocks).map(|_| None).collect(),
            idle: BTreeMap::new(),
            clock: 0,
            generations: 0,
            counters: PrefixCacheCounters::default(),
            version: 0,
        }
    }

    /// Blocks in the cache, referenced or idle.
    pub fn cached(&self) -> usize {
        self.by_key.len()
    }

    /// Cached blocks no sequence references (evictable).
    pub fn idle(&self) -> usize {
        self.idle.len()
    }

    pub fn counters(&self) -> PrefixCacheCounters {
        self.counters
    }

    /// Changes with every block entered or evicted (0: none yet).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The keys of every cached block, referenced or idle (what a router matches prompts
    /// against: `GET /tandem/report`).
    pub fn keys(&self) -> impl Iterator<Item = BlockKey> + '_ {
        self.by_key.keys().copied()
    }

    pub fn is_cached(&self, block: u32) -> bool {
        self.entry(block).is_some()
    }

    pub fn is_idle(&self, block: u32) -> bool {
        self.entry(block).is_some_and(|e| e.idle_since.is_some())
    }

    fn entry(&self, block: u32) -> Option<&Entry> {
        self.entries.get(block as usize)?.as_ref()
    }

    /// The longest chain of cached blocks holding the first whole blocks of `tokens`
    /// (`keys` are their [`chain_keys`]), at most `max_blocks` of them.
    pub fn lookup(
        &self,
        tokens: &[u32],
        keys: &[BlockKey],
        block_tokens: usize,
        max_blocks: usize,
    ) -> Vec<u32> {
        let mut hits: Vec<u32> = Vec::new();
        for (i, key) in keys.iter().take(max_blocks).enumerate() {
            let Some(&b) = self.by_key.get(key) else {
                break;
            };
            let Some(e) = self.entry(b) else { break };
            let parent = hits
                .last()
                .map(|&p| (p, self.entry(p).map_or(0, |pe| pe.generation)));
            let own = &tokens[i * block_tokens..(i + 1) * block_tokens];
            if e.key != *key || e.parent != parent || *e.tokens != *own {
                break;
            }
            hits.push(b);
        }
        hits
    }

    /// Count one lookup of `tokens` prompt tokens of which `hit` were found.
    pub fn count_lookup(&mut self, tokens: usize, hit: usize) {
        self.counters.lookup_tokens += tokens as u64;
        self.counters.hit_tokens += hit as u64;
    }

    /// A sequence references the idle cached `block` again: it is no longer evictable.
    pub fn pin(&mut self, block: u32) {
        if let Some(Some(e)) = self.entries.get_mut(block as usize)
            && let Some(stamp) = e.idle_since.take()
        {
            self.idle.remove(&stamp);
        }
    }

    /// No sequence references the cached `block` any more: it becomes the most recently
    /// used idle block.
    pub fn unpin(&mut self, block: u32) {
        let stamp = self.clock;
        if let Some(Some(e)) = self.entries.get_mut(block as usize)
            && e.idle_since.is_none()
        {
            self.clock += 1;
            e.idle_since = Some(stamp);
            self.idle.insert(stamp, block);
        }
    }

    /// Enter `block`, holding `tokens` after `parent` (a cached block), under `key`;
    /// `false` (and nothing changes) when another block already holds that key or the
    /// parent is not cached.
    pub fn publish(
        &mut self,
        block: u32,
        key: BlockKey,
        tokens: &[u32],
        parent: Option<u32>,
    ) -> bool {
        if self.by_key.contains_key(&key) || self.is_cached(block) {
            return false;
        }
        let parent = match parent {
            None => None,
            Some(p) => match self.entry(p) {
                Some(pe) => Some((p, pe.generation)),
                None => return false,
            },
        };
        let Some(slot) = self.entries.get_mut(block as usize) else {
            return false;
        };
        self.generations += 1;
        *slot = Some(Entry {
            key,
            tokens: tokens.into(),
            parent,
            generation: self.generations,
            idle_since: None,
        });
        self.by_key.insert(key, block);
        self.version += 1;
        true
    }

    /// Drop the least recently used idle block from the cache; its id, now free.
    pub fn evict_lru(&mut self) -> Option<u32> {
        let (_, block) = self.idle.pop_first()?;
        if let Some(e) = self.entries.get_mut(block as usize).and_then(Option::take)
            && self.by_key.get(&e.key) == Some(&block)
        {
            self.by_key.remove(&e.key);
        }
        self.counters.evictions += 1;
        self.version += 1;
        Some(block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FNV-1a 64 as its specification states it, byte by byte.
    fn fnv_reference(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
        })
    }

    #[test]
    fn keys_chain_and_are_stable() {
        assert_eq!(
            fnv_reference(b"a"),
            0xaf63_dc4c_8601_ec8c,
            "the published test vector"
        );
        // FNV-1a is fixed: these values must never change (prefill and decode of one
        // group, and any two versions, must agree). The first: FNV-1a 64 of the one byte
        // 0 (the no-parent tag), computed independently; the second with one token.
        assert_eq!(block_key(None, &[]), 0xaf63_bd4c_8601_b7df);
        assert_eq!(
            block_key(None, &[0x61]),
            fnv_reference(b"\x00\x61\x00\x00\x00")
        );
        let a = chain_keys(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4);
        assert_eq!(a.len(), 2, "whole blocks only");
        assert_eq!(a[0], block_key(None, &[1, 2, 3, 4]));
        assert_eq!(a[1], block_key(Some(a[0]), &[5, 6, 7, 8]));
        // The same block after a different prefix has another key.
        let b = chain_keys(&[0, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_ne!(a[1], b[1]);
        assert_ne!(block_key(None, &[1]), block_key(None, &[1, 0]));
    }

    #[test]
    fn lookups_are_exact_even_when_keys_collide() {
        let mut c = PrefixCache::new(8);
        let t = [1u32, 2, 3, 4, 5, 6, 7, 8];
        let k = chain_keys(&t, 4);
        assert!(c.publish(3, k[0], &t[..4], None));
        assert!(c.publish(5, k[1], &t[4..], Some(3)));
        assert_eq!(c.lookup(&t, &k, 4, 9), vec![3, 5]);
        assert_eq!(c.lookup(&t, &k, 4, 1), vec![3], "at most max_blocks");
        // Other tokens under the same keys (a forged collision) do not match.
        let other = [1u32, 2, 3, 4, 5, 6, 7, 9];
        assert_eq!(c.lookup(&other, &k, 4, 9), vec![3]);
        // A key already held, or an uncached parent, is not published.
        assert!(!c.publish(6, k[0], &t[..4], None));
        assert!(!c.publish(6, 99, &t[..4], Some(7)));
        assert_eq!(c.cached(), 2);
        // The parent evicted and its block id cached again for the same tokens: the
        // child was computed after the old parent, so the chain stops there.
        c.unpin(3);
        assert_eq!(c.evict_lru(), Some(3));
        assert!(c.publish(3, k[0], &t[..4], None));
        assert_eq!(c.lookup(&t, &k, 4, 9), vec![3]);
        assert_eq!(c.counters().evictions, 1);
    }

    #[test]
    fn the_version_changes_with_every_entry_and_eviction_and_the_keys_follow() {
        let mut c = PrefixCache::new(4);
        assert_eq!((c.version(), c.keys().count()), (0, 0));
        assert!(c.publish(0, 10, &[1], None));
        assert!(c.publish(1, 11, &[2], Some(0)));
        assert!(!c.publish(2, 10, &[1], None), "refused: no change");
        assert_eq!(c.version(), 2);
        let mut keys: Vec<u64> = c.keys().collect();
        keys.sort_unstable();
        assert_eq!(keys, vec![10, 11]);
        c.unpin(1);
        assert_eq!(
            c.version(),
            2,
            "becoming idle changes nothing a router sees"
        );
        assert_eq!(c.evict_lru(), Some(1));
        assert_eq!((c.version(), c.keys().collect::<Vec<_>>()), (3, vec![10]));
    }

    #[test]
    fn idle_blocks_are_evicted_least_recently_used_first() {
        let mut c = PrefixCache::new(8);
        for b in 0..3u32 {
            assert!(c.publish(b, 100 + u64::from(b), &[b], None));
        }
        assert_eq!(c.evict_lru(), None, "referenced blocks are never evicted");
        c.unpin(2);
        c.unpin(0);
        c.unpin(1);
        assert_eq!((c.idle(), c.cached()), (3, 3));
        c.pin(0);
        assert!(!c.is_idle(0) && c.is_idle(1));
        c.unpin(0);
        assert_eq!(c.evict_lru(), Some(2));
        assert_eq!(c.evict_lru(), Some(1));
        assert_eq!(c.evict_lru(), Some(0));
        assert_eq!((c.idle(), c.cached()), (0, 0));
        assert_eq!(c.counters().evictions, 3);
    }
}
