//! The paged KV cache's configuration and its block accounting, shared by every backend:
//! fixed-size blocks of tokens handed out by a free-list allocator, one block table per
//! sequence. The pools themselves are the backend's (`tandem_kernels::HostKv` in host
//! memory, `DeviceKv` on a GPU), laid out alike, and are only ever indexed through the
//! tables kept here.
//!
//! Storage type: F16 by default. F32 doubles memory for no measurable accuracy gain;
//! F16 keeps the model's outputs within float noise of F32 and, unlike Q8_0, leaves
//! nothing to tune. Q8_0 (half of F16 again) is available for memory-bound deployments:
//! 32 sequences of 512 tokens of SmolLM2 need 377 MB as F16 but 200 MB as Q8_0.
//!
//! The allocator reuses the most recently freed (warm) blocks first. With the prefix cache
//! on (the default of the serving binary), whole prompt blocks outlive their sequence as
//! idle cached blocks that new prompts can share, evicted least recently used first when
//! blocks run short (`prefix_cache`).

use std::collections::HashMap;

use tandem_kernels::{GgmlType, PagedKvSpec};

use super::prefix_cache::{BlockKey, PrefixCache, chain_keys};
use crate::engine_api::{KvUsage, SeqId};
use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheConfig {
    /// Tokens per block.
    pub block_tokens: usize,
    /// Blocks in the pool (shared by all sequences).
    pub n_blocks: usize,
    /// Element type of stored K/V rows: F32, F16 or Q8_0.
    pub dtype: GgmlType,
}

impl Default for KvCacheConfig {
    fn default() -> Self {
        Self {
            block_tokens: 16,
            n_blocks: 2048,
            dtype: GgmlType::F16,
        }
    }
}

impl KvCacheConfig {
    /// The pools' geometry for a model with `n_layers` layers of `kv_dim` K/V values;
    /// a configuration no backend can store is refused, naming what is wrong.
    pub fn spec(&self, n_layers: usize, kv_dim: usize) -> Result<PagedKvSpec> {
        let spec = PagedKvSpec {
            ty: self.dtype,
            n_layers,
            kv_dim,
            block_tokens: self.block_tokens,
            n_blocks: self.n_blocks,
        };
        spec.check()
            .map_err(|e| Error::config("KV cache", format!("{self:?}: {e}")))?;
        Ok(spec)
    }
}

#[derive(Debug, Default, Clone)]
struct SeqBlocks {
    blocks: Vec<u32>,
    len: usize,
    /// Whole prompt blocks to enter into the prefix cache once computed: their tokens,
    /// their chained keys, and how many of them are cached already (hit or entered).
    prompt: Vec<u32>,
    keys: Vec<BlockKey>,
    published: usize,
    /// Tokens of the prompt given to `reserve_prompt` (its blocks are cached from it).
    prompt_len: Option<usize>,
}

/// Which blocks of the pool each sequence owns, and how many tokens it holds; with the
/// prefix cache on, also which blocks hold cached prompt prefixes (see `prefix_cache`).
/// Blocks are reference-counted: a cached block may be in several sequences' tables.
#[derive(Debug)]
pub struct BlockAllocator {
    block_tokens: usize,
    n_blocks: usize,
    /// Free block ids; taken from the end, so recently freed blocks are reused first.
    free: Vec<u32>,
    /// Per block: the sequences whose tables hold it.
    refs: Vec<u32>,
    seqs: HashMap<SeqId, SeqBlocks>,
    prefix: Option<PrefixCache>,
}

impl BlockAllocator {
    /// An allocator without a prefix cache.
    pub fn new(block_tokens: usize, n_blocks: usize) -> Self {
        Self::with_prefix_cache(block_tokens, n_blocks, false)
    }

    pub fn with_prefix_cache(block_tokens: usize, n_blocks: usize, prefix_cache: bool) -> Self {
        Self {
            block_tokens,
            n_blocks,
            free: (0..n_blocks as u32).rev().collect(),
            refs: vec![0; n_blocks],
            seqs: HashMap::new(),
            prefix: prefix_cache.then(|| PrefixCache::new(n_blocks)),
        }
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    pub fn prefix_cache_enabled(&self) -> bool {
        self.prefix.is_some()
    }

    fn idle_cached(&self) -> usize {
        self.prefix.as_ref().map_or(0, PrefixCache::idle)
    }

    /// The keys of the prefix cache's blocks when its version is not `since` (`None`: no
    /// change, or no prefix cache).
    pub fn prefix_keys(&self, since: u64) -> Option<crate::engine_api::PrefixKeys> {
        let c = self.prefix.as_ref()?;
        (c.version() != since).then(|| crate::engine_api::PrefixKeys {
            version: c.version(),
            keys: c.keys().collect(),
        })
    }

    pub fn usage(&self) -> KvUsage {
        KvUsage {
            blocks_total: self.n_blocks,
            blocks_used: self.n_blocks - self.free_blocks(),
            blocks_cached: self.prefix.as_ref().map_or(0, PrefixCache::cached),
            prefix: self
                .prefix
                .as_ref()
                .map(PrefixCache::counters)
                .unwrap_or_default(),
        }
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// Tokens `seq` holds (0 if unknown).
    pub fn len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    /// Blocks `seq` still lacks to hold `total_tokens`.
    pub fn blocks_needed(&self, seq: SeqId, total_tokens: usize) -> usize {
        let have = self.seqs.get(&seq).map_or(0, |s| s.blocks.len());
        total_tokens
            .div_ceil(self.block_tokens)
            .saturating_sub(have)
    }

    /// Blocks a reservation can take: free ones and idle cached ones (evicted on demand).
    pub fn free_blocks(&self) -> usize {
        self.free.len() + self.idle_cached()
    }

    /// `n` blocks, each referenced once, evicting idle cached blocks (least recently used
    /// first) when the free list runs short; all or nothing.
    fn take(&mut self, n: usize) -> Result<Vec<u32>> {
        let free = self.free_blocks();
        if n > free {
            return Err(Error::KvCacheFull { needed: n, free });
        }
        while self.free.len() < n {
            let b = self
                .prefix
                .as_mut()
                .and_then(PrefixCache::evict_lru)
                .expect("idle cached blocks make up the shortfall");
            self.free.push(b);
        }
        let at = self.free.len() - n;
        let got: Vec<u32> = self.free.drain(at..).rev().collect();
        for &b in &got {
            self.refs[b as usize] = 1;
        }
        Ok(got)
    }

    /// Grow `seq`'s capacity to `total_tokens` (creating it); all or nothing.
    pub fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> Result<()> {
        let needed = self.blocks_needed(seq, total_tokens);
        let got = self.take(needed)?;
        self.seqs.entry(seq).or_default().blocks.extend(got);
        Ok(())
    }

    /// Create `seq` for a prompt: its table starts with the longest cached prefix of
    /// `prompt` (whole blocks, leaving at least one token to compute), then fresh blocks
    /// up to `total_tokens`; all or nothing. Returns the tokens it already holds. Without
    /// a prefix cache, or for a sequence that exists, this is [`Self::reserve`].
    pub fn reserve_prompt(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        total_tokens: usize,
    ) -> Result<usize> {
        let bt = self.block_tokens;
        let Some(cache) = self
            .prefix
            .as_ref()
            .filter(|_| !self.seqs.contains_key(&seq))
        else {
            self.reserve(seq, total_tokens)?;
            return Ok(0);
        };
        let keys = chain_keys(prompt, bt);
        let hits = cache.lookup(prompt, &keys, bt, prompt.len().saturating_sub(1) / bt);
        let needed = total_tokens
            .max(prompt.len())
            .div_ceil(bt)
            .saturating_sub(hits.len());
        // Idle hits stop being free once this sequence references them.
        let idle_hits = hits.iter().filter(|&&b| cache.is_idle(b)).count();
        let free = self.free_blocks() - idle_hits;
        if needed > free {
            return Err(Error::KvCacheFull { needed, free });
        }
        for &b in &hits {
            if let Some(c) = self.prefix.as_mut() {
                c.pin(b);
            }
            self.refs[b as usize] += 1;
        }
        let fresh = self.take(needed)?;
        let hit_tokens = hits.len() * bt;
        if let Some(c) = self.prefix.as_mut() {
            c.count_lookup(prompt.len(), hit_tokens);
        }
        let published = hits.len();
        let mut blocks = hits;
        blocks.extend(fresh);
        self.seqs.insert(
            seq,
            SeqBlocks {
                blocks,
                len: hit_tokens,
                prompt: prompt[..keys.len() * bt].to_vec(),
                keys,
                published,
                prompt_len: Some(prompt.len()),
            },
        );
        Ok(hit_tokens)
    }

    pub fn release(&mut self, seq: SeqId) {
        let Some(st) = self.seqs.remove(&seq) else {
            return;
        };
        // Last block first: the free list hands the first block out first again, and an
        // idle prompt's blocks are evicted from its end (its start is the most shared).
        for b in st.blocks.into_iter().rev() {
            let r = &mut self.refs[b as usize];
            *r = r.saturating_sub(1);
            if *r > 0 {
                continue;
            }
            match self.prefix.as_mut() {
                Some(c) if c.is_cached(b) => c.unpin(b),
                _ => self.free.push(b),
            }
        }
    }

    /// The prompt length `seq` was created for by [`Self::reserve_prompt`] with the prefix
    /// cache on (its whole blocks enter the cache as they are stored).
    pub fn prompt_len(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq)?.prompt_len
    }

    pub fn table(&self, seq: SeqId) -> &[u32] {
        self.seqs.get(&seq).map_or(&[], |s| &s.blocks)
    }

    /// Record that `seq` holds `len` tokens; whole prompt blocks it has now computed enter
    /// the prefix cache.
    pub fn set_len(&mut self, seq: SeqId, len: usize) {
        let bt = self.block_tokens;
        let Some(st) = self.seqs.get_mut(&seq) else {
            return;
        };
        debug_assert!(len <= st.blocks.len() * bt);
        st.len = len;
        let Some(cache) = self.prefix.as_mut() else {
            return;
        };
        while st.published < st.keys.len() && (st.published + 1) * bt <= len {
            let i = st.published;
            let parent = i.checked_sub(1).map(|p| st.blocks[p]);
            let tokens = &st.prompt[i * bt..(i + 1) * bt];
            if !cache.publish(st.blocks[i], st.keys[i], tokens, parent) {
                // Another sequence entered the same prefix first: this copy stays
                // private, and so does the rest of the chain.
                st.published = st.keys.len();
                break;
            }
            st.published += 1;
        }
        if st.published == st.keys.len() {
            st.prompt = Vec::new();
        }
    }

    /// Pool row of `pos` of `seq` (`block · block_tokens + pos % block_tokens`).
    pub fn slot(&self, seq: SeqId, pos: usize) -> Option<usize> {
        let b = *self.table(seq).get(pos / self.block_tokens)? as usize;
        Some(b * self.block_tokens + pos % self.block_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_is_all_or_nothing_and_release_returns_blocks() {
        let mut c = BlockAllocator::new(4, 5);
        let (a, b) = (SeqId(1), SeqId(2));
        c.reserve(a, 9).unwrap(); // 3 blocks
        assert_eq!(
            c.usage(),
            KvUsage {
                blocks_total: 5,
                blocks_used: 3,
                ..Default::default()
            }
        );
        assert_eq!(c.table(a), &[0, 1, 2]);
        c.reserve(a, 12).unwrap(); // still 3 blocks
        assert_eq!(c.usage().blocks_used, 3);
        match c.reserve(b, 12) {
            Err(Error::KvCacheFull { needed: 3, free: 2 }) => {}
            other => panic!("{other:?}"),
        }
        assert!(!c.contains(b), "a failed reserve creates nothing");
        assert!(c.table(b).is_empty());
        assert_eq!(c.usage().blocks_used, 3);
        c.reserve(b, 8).unwrap();
        assert_eq!(c.usage().blocks_used, 5);
        assert_eq!(c.slot(b, 5), Some(c.table(b)[1] as usize * 4 + 1));
        assert_eq!(c.slot(b, 8), None, "beyond the reservation");
        assert_eq!(c.slot(SeqId(9), 0), None, "unknown sequence");
        let mut all: Vec<u32> = c.table(a).iter().chain(c.table(b)).copied().collect();
        all.sort();
        assert_eq!(all, vec![0, 1, 2, 3, 4], "no block is handed out twice");
        c.set_len(a, 9);
        assert_eq!(c.len(a), 9);
        c.release(a);
        assert_eq!(c.usage().blocks_used, 2);
        assert_eq!(c.table(a), &[] as &[u32]);
        assert_eq!(c.len(a), 0);
        c.release(a); // releasing twice is a no-op
        assert_eq!(c.usage().blocks_used, 2);
        // Most recently freed blocks come back first, in the same order.
        c.reserve(SeqId(3), 8).unwrap();
        assert_eq!(c.table(SeqId(3)), &[0, 1]);
    }

    #[test]
    fn prompt_blocks_are_shared_cached_after_release_and_evicted_lru_under_pressure() {
        let mut c = BlockAllocator::with_prefix_cache(4, 6, true);
        let p: Vec<u32> = (0..10).collect(); // 2 whole blocks + 2 tokens
        let (a, b, d) = (SeqId(1), SeqId(2), SeqId(4));
        assert_eq!(c.reserve_prompt(a, &p, 12).unwrap(), 0, "empty cache");
        assert_eq!(c.table(a).len(), 3);
        c.set_len(a, 6);
        assert_eq!(
            c.usage().blocks_cached,
            1,
            "block 0 is computed, block 1 not yet"
        );
        c.set_len(a, 10);
        assert_eq!(
            c.usage().blocks_cached,
            2,
            "the partial block is never cached"
        );
        // A second sequence shares both whole blocks while the first still runs.
        assert_eq!(c.reserve_prompt(b, &p, 12).unwrap(), 8);
        assert_eq!(c.len(b), 8);
        assert_eq!(c.table(b)[..2], c.table(a)[..2]);
        assert_ne!(c.table(b)[2], c.table(a)[2], "the last block is its own");
        assert_eq!(c.usage().blocks_used, 4);
        // A prompt of exactly two blocks keeps its last block to compute.
        let c8 = SeqId(3);
        assert_eq!(c.reserve_prompt(c8, &p[..8], 8).unwrap(), 4);
        assert_eq!(c.usage().blocks_used, 5);
        // A prompt that differs inside block 1 shares block 0 only.
        let mut q = p.clone();
        q[5] = 99;
        c.release(c8);
        assert_eq!(c.reserve_prompt(c8, &q, 10).unwrap(), 4);
        c.release(c8);
        for s in [a, b] {
            c.release(s);
        }
        let u = c.usage();
        assert_eq!((u.blocks_used, u.blocks_cached, c.free_blocks()), (0, 2, 6));
        assert_eq!(
            (u.prefix.lookup_tokens, u.prefix.hit_tokens),
            (10 + 10 + 8 + 10, 8 + 4 + 4)
        );
        // After release the prefix is still there, idle.
        assert_eq!(c.reserve_prompt(b, &p, 10).unwrap(), 8);
        c.release(b);
        // Memory pressure: a sequence needing every block evicts the idle ones.
        c.reserve(d, 24).unwrap();
        let u = c.usage();
        assert_eq!(
            (u.blocks_used, u.blocks_cached, u.prefix.evictions),
            (6, 0, 2)
        );
        c.release(d);
        assert_eq!(c.reserve_prompt(b, &p, 10).unwrap(), 0, "evicted");
    }

    #[test]
    fn idle_hits_are_not_counted_twice_and_a_full_pool_changes_nothing() {
        let mut c = BlockAllocator::with_prefix_cache(4, 3, true);
        let p: Vec<u32> = (0..9).collect();
        c.reserve_prompt(SeqId(1), &p, 9).unwrap();
        c.set_len(SeqId(1), 9);
        c.release(SeqId(1));
        assert_eq!((c.usage().blocks_used, c.free_blocks()), (0, 3));
        // Two idle hits + one fresh block: fits exactly.
        assert_eq!(c.reserve_prompt(SeqId(2), &p, 12).unwrap(), 8);
        assert_eq!(c.usage().blocks_used, 3);
        let other: Vec<u32> = (50..58).collect();
        match c.reserve_prompt(SeqId(3), &other, 8) {
            Err(Error::KvCacheFull { needed: 2, free: 0 }) => {}
            e => panic!("{e:?}"),
        }
        assert!(!c.contains(SeqId(3)));
        assert_eq!(
            c.usage().prefix.lookup_tokens,
            9 + 9,
            "a refused lookup counts nothing"
        );
        c.release(SeqId(2));
        // Not enough without evicting the hit blocks themselves: refused, nothing evicted.
        match c.reserve_prompt(SeqId(4), &p, 20) {
            Err(Error::KvCacheFull { needed: 3, free: 1 }) => {}
            e => panic!("{e:?}"),
        }
        assert_eq!(c.usage().blocks_cached, 2);
    }

    #[test]
    fn a_prefix_computed_twice_at_once_is_cached_once() {
        let mut c = BlockAllocator::with_prefix_cache(4, 8, true);
        let p: Vec<u32> = (0..9).collect();
        c.reserve_prompt(SeqId(1), &p, 9).unwrap();
        c.reserve_prompt(SeqId(2), &p, 9).unwrap(); // before the first computed anything
        c.set_len(SeqId(1), 9);
        c.set_len(SeqId(2), 9);
        assert_eq!(c.usage().blocks_cached, 2);
        c.release(SeqId(2));
        c.release(SeqId(1));
        let u = c.usage();
        assert_eq!((u.blocks_used, u.blocks_cached, c.free.len()), (0, 2, 6));
        assert_eq!(c.reserve_prompt(SeqId(3), &p, 9).unwrap(), 8);
    }

    #[test]
    fn without_the_prefix_cache_reserve_prompt_is_reserve() {
        let mut c = BlockAllocator::new(4, 4);
        let p: Vec<u32> = (0..9).collect();
        for s in 1..3 {
            assert_eq!(c.reserve_prompt(SeqId(s), &p, 9).unwrap(), 0);
            c.set_len(SeqId(s), 9);
            c.release(SeqId(s));
        }
        assert_eq!(c.usage(), BlockAllocator::new(4, 4).usage());
        assert_eq!(c.free.len(), 4);
    }

    #[test]
    fn configurations_no_backend_stores_are_refused_by_name() {
        let cfg = KvCacheConfig {
            dtype: GgmlType::Q4_1,
            ..Default::default()
        };
        let err = cfg.spec(1, 32).unwrap_err();
        assert!(matches!(err, Error::Config { .. }), "{err:?}");
        assert!(err.to_string().contains("Q4_1"), "{err}");
        let cfg = KvCacheConfig {
            n_blocks: 0,
            ..Default::default()
        };
        assert!(cfg.spec(1, 32).is_err());
        let spec = KvCacheConfig::default().spec(30, 192).unwrap();
        assert_eq!((spec.n_blocks, spec.block_tokens), (2048, 16));
    }
}
