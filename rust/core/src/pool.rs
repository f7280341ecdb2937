//! A fixed pool of KV-cache blocks on one device, with ref counts and a prefix cache.
//!
//! Every block is in exactly one of three states:
//!
//! ```text
//!                allocate (pop)                       ref count -> 0, no hash
//!   FREE  ─────────────────────────▶  REFERENCED  ─────────────────────────────▶ FREE
//!  (stack)                          (ref_count > 0)
//!     ▲                              │          ▲
//!     │                              │ ref → 0, │ hit (revive)
//!     │                              ▼ hashed   │
//!     └─────── evict (LRU head) ─── EVICTABLE ──┘
//!                                 (ref 0, still cached)
//! ```
//!
//! * FREE blocks hold nothing worth keeping; they sit on a LIFO stack. The stack starts so that
//!   blocks come out in the order vLLM's allocators hand them out (N-1 first without caching,
//!   0 first with caching).
//! * EVICTABLE blocks have ref count 0 but keep their hash, so a later request with the same
//!   prefix can revive them. They are kept in eviction order (`evict`): least recently accessed
//!   first, and among equal access times the block holding more hashed tokens (the tail of a
//!   sequence) first. Every operation on the order is O(1) in the usual case (blocks released in
//!   access order) and O(log k) at worst.
//! * The prefix map goes from block hash to block; a lookup hits only if the stored token ids
//!   are equal too, so a hash collision can never hand out another prompt's KV data.
//!
//! In the usual case no operation allocates on the heap after construction: the map is created
//! with room for every block, and the stack and the eviction run live in preallocated vectors
//! (only blocks released out of access order take B-tree nodes).

use crate::error::{Error, Result};
use crate::evict::EvictionOrder;
use crate::hash::BlockHash;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

pub type BlockId = u32;
const NIL: u32 = u32::MAX;
/// `last_accessed` of a block that was never accessed (vLLM's DEFAULT_LAST_ACCESSED_TIME).
pub const NEVER_ACCESSED: f64 = -1.0;

/// Block hashes are already uniformly distributed (and keyed), so the map does not hash again.
#[derive(Default)]
pub struct FoldHasher(u64);
impl Hasher for FoldHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(17) ^ u64::from_le_bytes(b);
        }
    }
    fn write_u128(&mut self, x: u128) {
        self.0 = (x as u64) ^ ((x >> 64) as u64);
    }
}
type PrefixMap = HashMap<BlockHash, BlockId, BuildHasherDefault<FoldHasher>>;

/// What a cached block is stored under and confirmed against on a hit: its hash, its parent
/// *block* (the physical block holding the previous block of the sequence; `None` for block 0),
/// the sequence's extras (LoRA id, salt) and its token ids.
///
/// Confirming the parent by identity (block id plus the generation it had when the child was
/// registered) rather than by hash makes a hit safe even under hash collisions: by induction
/// from block 0, a hit at block `i` means the whole prefix is the same data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockKey<'a> {
    pub hash: BlockHash,
    pub parent: Option<BlockId>,
    pub extra: u128,
    pub tokens: &'a [u32],
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub lookups: u64,
    pub hits: u64,
    pub evictions: u64,
}

pub struct BlockPool {
    device: &'static str,
    num_blocks: u32,
    block_size: usize,
    ref_count: Vec<u32>,
    /// `Some(h)` iff the block is registered in the prefix map under `h`.
    hash: Vec<Option<BlockHash>>,
    num_hashed_tokens: Vec<u32>,
    last_accessed: Vec<f64>,
    computed: Vec<bool>,
    /// Token ids of cached blocks, `block_size` per block (only used when caching).
    tokens: Vec<u32>,
    /// Parent block (NIL for block 0), the parent's generation at registration, and extras key
    /// of cached blocks (only used when caching).
    parent: Vec<BlockId>,
    parent_gen: Vec<u32>,
    extra: Vec<u128>,
    /// Bumped every time a block is handed out fresh: a cached child remembers its parent's
    /// generation, so a parent that was evicted and reused no longer vouches for it.
    generation: Vec<u32>,
    free_stack: Vec<BlockId>,
    evict: EvictionOrder,
    map: PrefixMap,
    stats: PoolStats,
}

impl BlockPool {
    pub fn new(
        device: &'static str,
        num_blocks: u32,
        block_size: usize,
        caching: bool,
    ) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::invalid("block_size must be positive"));
        }
        if num_blocks == NIL {
            return Err(Error::invalid("too many blocks"));
        }
        let n = num_blocks as usize;
        // Popped from the end: caching hands out 0, 1, 2, ...; no caching N-1, N-2, ... (vLLM).
        let free_stack: Vec<BlockId> = if caching {
            (0..num_blocks).rev().collect()
        } else {
            (0..num_blocks).collect()
        };
        let cached_tokens = if caching { n * block_size } else { 0 };
        Ok(BlockPool {
            device,
            num_blocks,
            block_size,
            ref_count: vec![0; n],
            hash: vec![None; n],
            num_hashed_tokens: vec![0; n],
            last_accessed: vec![NEVER_ACCESSED; n],
            computed: vec![false; n],
            tokens: vec![0; cached_tokens],
            parent: vec![NIL; if caching { n } else { 0 }],
            parent_gen: vec![0; if caching { n } else { 0 }],
            generation: vec![0; n],
            extra: vec![0; if caching { n } else { 0 }],
            free_stack,
            evict: EvictionOrder::new(n),
            map: PrefixMap::with_capacity_and_hasher(
                if caching { n } else { 0 },
                Default::default(),
            ),
            stats: PoolStats::default(),
        })
    }

    // ---- counters ------------------------------------------------------------------------

    pub fn device(&self) -> &'static str {
        self.device
    }
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// Free blocks: never-used or uncached ones plus evictable cached ones.
    pub fn num_free(&self) -> usize {
        self.free_stack.len() + self.evict.len()
    }
    pub fn num_evictable(&self) -> usize {
        self.evict.len()
    }
    pub fn num_cached(&self) -> usize {
        self.map.len()
    }
    pub fn num_referenced(&self) -> usize {
        self.num_blocks as usize - self.num_free()
    }
    pub fn stats(&self) -> PoolStats {
        self.stats
    }

    // ---- per-block views -----------------------------------------------------------------

    pub fn check(&self, id: i64) -> Result<BlockId> {
        if id < 0 || id >= self.num_blocks as i64 {
            return Err(Error::BlockOutOfRange {
                block: id,
                num_blocks: self.num_blocks,
            });
        }
        Ok(id as BlockId)
    }
    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.ref_count[b as usize]
    }
    pub fn block_hash(&self, b: BlockId) -> Option<BlockHash> {
        self.hash[b as usize]
    }
    pub fn num_hashed_tokens(&self, b: BlockId) -> u32 {
        self.num_hashed_tokens[b as usize]
    }
    pub fn last_accessed(&self, b: BlockId) -> f64 {
        self.last_accessed[b as usize]
    }
    pub fn set_last_accessed(&mut self, b: BlockId, t: f64) {
        self.last_accessed[b as usize] = t;
    }
    pub fn is_computed(&self, b: BlockId) -> bool {
        self.computed[b as usize]
    }
    pub fn set_computed(&mut self, b: BlockId, c: bool) {
        self.computed[b as usize] = c;
    }
    pub fn is_evictable(&self, b: BlockId) -> bool {
        self.ref_count[b as usize] == 0 && self.hash[b as usize].is_some()
    }
    /// Stored token ids of a cached block.
    pub fn cached_tokens(&self, b: BlockId) -> Option<&[u32]> {
        self.hash[b as usize]?;
        let s = b as usize * self.block_size;
        Some(&self.tokens[s..s + self.block_size])
    }
    /// Evictable blocks in eviction order (first = next to go). O(n); for tests and introspection.
    pub fn eviction_order(&self) -> Vec<BlockId> {
        self.evict.order()
    }

    // ---- allocation and references -------------------------------------------------------

    /// Hand out a block with ref count 1: a free one if any, else evict the LRU cached block.
    pub fn allocate(&mut self) -> Result<BlockId> {
        let b = if let Some(b) = self.free_stack.pop() {
            b
        } else if let Some(b) = self.evict.pop_first() {
            let h = self.hash[b as usize]
                .take()
                .expect("evictable block has a hash");
            self.map.remove(&h);
            self.num_hashed_tokens[b as usize] = 0;
            self.computed[b as usize] = false;
            self.stats.evictions += 1;
            b
        } else {
            return Err(Error::OutOfBlocks {
                device: self.device,
                needed: 1,
                free: 0,
            });
        };
        self.ref_count[b as usize] = 1;
        self.generation[b as usize] = self.generation[b as usize].wrapping_add(1);
        Ok(b)
    }

    /// Add `n` references to a block that is referenced or evictable (an evictable block is
    /// revived: it leaves the eviction list). Sharing a FREE block, or adding no reference (which
    /// would revive a block without holding it), is an error.
    pub fn acquire(&mut self, b: BlockId, n: u32) -> Result<()> {
        let i = b as usize;
        if i >= self.ref_count.len() {
            return Err(Error::BlockOutOfRange {
                block: b as i64,
                num_blocks: self.num_blocks,
            });
        }
        if n == 0 {
            return Err(Error::invalid("n must be positive"));
        }
        if self.ref_count[i] == 0 {
            if self.hash[i].is_none() {
                return Err(Error::invalid(format!(
                    "block {b} is free; it cannot be shared"
                )));
            }
            self.evict.remove(b);
        }
        self.ref_count[i] += n;
        Ok(())
    }

    /// Drop one reference. At 0 a cached block becomes evictable, an uncached one free.
    pub fn release(&mut self, b: BlockId) -> Result<()> {
        let i = b as usize;
        if i >= self.ref_count.len() {
            return Err(Error::BlockOutOfRange {
                block: b as i64,
                num_blocks: self.num_blocks,
            });
        }
        if self.ref_count[i] == 0 {
            return Err(Error::DoubleFree(b));
        }
        self.ref_count[i] -= 1;
        if self.ref_count[i] == 0 {
            if self.hash[i].is_some() {
                self.evict
                    .insert(b, self.last_accessed[i], self.num_hashed_tokens[i]);
            } else {
                self.computed[i] = false;
                self.free_stack.push(b);
            }
        }
        Ok(())
    }

    /// `n` fresh blocks, all or nothing: fails with `OutOfBlocks` (changing nothing) unless
    /// `n` blocks are free.
    pub fn allocate_many(&mut self, n: usize) -> Result<Vec<BlockId>> {
        if n > self.num_free() {
            return Err(Error::OutOfBlocks {
                device: self.device,
                needed: n,
                free: self.num_free(),
            });
        }
        (0..n).map(|_| self.allocate()).collect()
    }

    /// Drop one reference from each listed block (a block listed k times loses k), all or
    /// nothing: every block is range-checked and every ref count is checked to cover its
    /// releases before any changes.
    pub fn release_many(&mut self, blocks: &[BlockId]) -> Result<()> {
        let mut sorted = blocks.to_vec();
        sorted.sort_unstable();
        for run in sorted.chunk_by(|a, b| a == b) {
            let b = run[0];
            if b >= self.num_blocks {
                return Err(Error::BlockOutOfRange {
                    block: b as i64,
                    num_blocks: self.num_blocks,
                });
            }
            if (self.ref_count[b as usize] as usize) < run.len() {
                return Err(Error::DoubleFree(b));
            }
        }
        for &b in blocks {
            self.release(b)?;
        }
        Ok(())
    }

    /// Set a block's last access time from outside the manager. Evictable blocks are refused:
    /// their place in the eviction list depends on the time (revive the block first), and a
    /// non-finite time would break the list's order.
    pub fn touch(&mut self, b: BlockId, t: f64) -> Result<()> {
        if b >= self.num_blocks {
            return Err(Error::BlockOutOfRange {
                block: b as i64,
                num_blocks: self.num_blocks,
            });
        }
        if !t.is_finite() {
            return Err(Error::invalid("access_time must be finite"));
        }
        if self.is_evictable(b) {
            return Err(Error::invalid(format!(
                "block {b} is evictable; revive it before touching it"
            )));
        }
        self.last_accessed[b as usize] = t;
        Ok(())
    }

    // ---- prefix cache --------------------------------------------------------------------

    pub fn caching(&self) -> bool {
        !self.parent.is_empty()
    }

    fn matches(&self, b: BlockId, key: &BlockKey<'_>) -> bool {
        let i = b as usize;
        let s = i * self.block_size;
        key.tokens.len() == self.block_size
            && self.parent[i] == key.parent.unwrap_or(NIL)
            && key
                .parent
                .is_none_or(|p| self.generation.get(p as usize) == Some(&self.parent_gen[i]))
            && self.extra[i] == key.extra
            && self.tokens[s..s + self.block_size] == *key.tokens
    }

    /// Find the cached block stored under `key` (hash, parent, extras and tokens all equal).
    /// Does not change ref counts; counts in the hit statistics.
    pub fn lookup(&mut self, key: &BlockKey<'_>) -> Option<BlockId> {
        self.stats.lookups += 1;
        let b = self.peek(key)?;
        self.stats.hits += 1;
        Some(b)
    }

    /// `lookup` without touching the statistics (dry runs, pre-checks).
    pub fn peek(&self, key: &BlockKey<'_>) -> Option<BlockId> {
        let b = *self.map.get(&key.hash)?;
        // a hash collision never hands out different data
        self.matches(b, key).then_some(b)
    }

    /// The key a cached block is stored under.
    pub fn key_of(&self, b: BlockId) -> Option<BlockKey<'_>> {
        let i = b as usize;
        let hash = self.hash[i]?;
        let s = i * self.block_size;
        Some(BlockKey {
            hash,
            parent: (self.parent[i] != NIL).then_some(self.parent[i]),
            extra: self.extra[i],
            tokens: &self.tokens[s..s + self.block_size],
        })
    }

    /// Register a referenced, uncached, full block under `key`. Returns false (and changes
    /// nothing) if another block already holds that hash.
    pub fn register(
        &mut self,
        b: BlockId,
        key: &BlockKey<'_>,
        num_hashed_tokens: u32,
    ) -> Result<bool> {
        let i = b as usize;
        if i >= self.ref_count.len() {
            return Err(Error::BlockOutOfRange {
                block: b as i64,
                num_blocks: self.num_blocks,
            });
        }
        if key.tokens.len() != self.block_size {
            return Err(Error::invalid(format!(
                "a cached block holds exactly block_size={} tokens, got {}",
                self.block_size,
                key.tokens.len()
            )));
        }
        if !self.caching() {
            return Err(Error::invalid("prefix caching is disabled on this pool"));
        }
        if self.ref_count[i] == 0 {
            return Err(Error::invalid(format!("block {b} is not allocated")));
        }
        if self.hash[i].is_some() {
            return Err(Error::invalid(format!("block {b} is already cached")));
        }
        if let Some(p) = key.parent {
            if p as usize >= self.ref_count.len() || p == b {
                return Err(Error::invalid(format!(
                    "bad parent block {p} for block {b}"
                )));
            }
        }
        if self.map.contains_key(&key.hash) {
            return Ok(false);
        }
        self.map.insert(key.hash, b);
        self.hash[i] = Some(key.hash);
        self.parent[i] = key.parent.unwrap_or(NIL);
        self.parent_gen[i] = key.parent.map_or(0, |p| self.generation[p as usize]);
        self.extra[i] = key.extra;
        self.num_hashed_tokens[i] = num_hashed_tokens;
        self.tokens[i * self.block_size..(i + 1) * self.block_size].copy_from_slice(key.tokens);
        Ok(true)
    }

    /// Check every structural invariant (tests; O(n)).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let n = self.num_blocks as usize;
        let mut state = vec![0u8; n]; // 1 free, 2 evictable, 3 referenced
        for &b in &self.free_stack {
            if state[b as usize] != 0 {
                return Err(format!("block {b} is on the free stack twice"));
            }
            if self.ref_count[b as usize] != 0 || self.hash[b as usize].is_some() {
                return Err(format!("free block {b} has refs or a hash"));
            }
            state[b as usize] = 1;
        }
        self.evict.check(|b| {
            (
                self.last_accessed[b as usize],
                self.num_hashed_tokens[b as usize],
            )
        })?;
        for &b in &self.eviction_order() {
            if state[b as usize] != 0 {
                return Err(format!("block {b} is both free and evictable"));
            }
            if !self.is_evictable(b) {
                return Err(format!("block {b} on the eviction list is not evictable"));
            }
            state[b as usize] = 2;
        }
        for (b, st) in state.iter_mut().enumerate() {
            if *st == 0 {
                if self.ref_count[b] == 0 {
                    return Err(format!("block {b} is lost: ref 0, not free, not evictable"));
                }
                *st = 3;
            }
            if let Some(h) = self.hash[b] {
                if self.map.get(&h) != Some(&(b as u32)) {
                    return Err(format!("block {b} hash not in the prefix map"));
                }
            }
        }
        self.check_prefix_map()?;
        if self.num_free() + state.iter().filter(|&&s| s == 3).count() != n {
            return Err("free + referenced != total".into());
        }
        Ok(())
    }

    /// The prefix map and the per-block cache fields agree both ways: every map entry points
    /// at a block registered under that hash, every registered block is in the map, only a
    /// caching pool has entries, and a cached block's parent is another block of the pool.
    fn check_prefix_map(&self) -> std::result::Result<(), String> {
        if !self.caching() && !self.map.is_empty() {
            return Err("a pool without caching has prefix map entries".into());
        }
        for (&h, &b) in &self.map {
            if b >= self.num_blocks {
                return Err(format!(
                    "prefix map entry for hash {h:#x} points past the pool"
                ));
            }
            if self.hash[b as usize] != Some(h) {
                return Err(format!(
                    "prefix map entry {h:#x} -> block {b}, registered as {:?}",
                    self.hash[b as usize]
                ));
            }
        }
        for b in 0..self.num_blocks as usize {
            let Some(h) = self.hash[b] else { continue };
            if self.map.get(&h) != Some(&(b as u32)) {
                return Err(format!("block {b} hash not in the prefix map"));
            }
            let p = self.parent[b];
            if p != NIL && (p >= self.num_blocks || p as usize == b) {
                return Err(format!("cached block {b} has a bad parent {p}"));
            }
        }
        if self.map.len() != self.hash.iter().filter(|h| h.is_some()).count() {
            return Err("prefix map size mismatch".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod invariant_tests {
    //! `check_invariants` notices a prefix map that disagrees with the blocks (states no public
    //! call can reach; made here by hand).
    use super::*;

    fn cached_pool() -> (BlockPool, BlockId) {
        let mut p = BlockPool::new("gpu", 4, 2, true).unwrap();
        let b = p.allocate().unwrap();
        let key = BlockKey {
            hash: 7,
            parent: None,
            extra: 0,
            tokens: &[1, 2],
        };
        assert!(p.register(b, &key, 2).unwrap());
        p.check_invariants().unwrap();
        (p, b)
    }

    #[test]
    fn a_cached_block_naming_itself_as_parent_is_caught() {
        let (mut p, b) = cached_pool();
        p.parent[b as usize] = b;
        assert!(p.check_invariants().unwrap_err().contains("bad parent"));
        p.parent[b as usize] = 99;
        assert!(p.check_invariants().is_err());
    }

    #[test]
    fn a_map_entry_under_another_hash_is_caught() {
        let (mut p, b) = cached_pool();
        p.map.insert(8, b); // a second entry for the same block
        assert!(p.check_invariants().is_err());
        p.map.remove(&8);
        p.map.insert(9, 3); // an entry for a block with no hash
        p.hash[3] = None;
        assert!(p.check_invariants().is_err());
    }
}
