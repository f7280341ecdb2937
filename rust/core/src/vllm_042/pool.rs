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
//!
//! Memory: 161-165 bytes per block of 16 tokens with caching (64 of them the cached token
//! ids), 67 without; the layout is chosen for it (a hash array with a separate cached flag,
//! a table of 4-byte block ids found by 64 hash bits, eviction keys read from the per-block
//! arrays). `heap_bytes` accounts for it; `docs/scheduler.md` compares it with vLLM v1.

use crate::error::{Error, Result};
use crate::vllm_042::evict::{EvictionOrder, Fields};
use crate::vllm_042::hash::BlockHash;

pub type BlockId = u32;
const NIL: u32 = u32::MAX;
/// `last_accessed` of a block that was never accessed (vLLM's DEFAULT_LAST_ACCESSED_TIME).
pub const NEVER_ACCESSED: f64 = -1.0;

/// The prefix map: a table of the cached blocks' ids, found by the low 64 bits of their hash
/// ([`map_slot`]; block hashes are uniformly distributed and keyed, so no second hash). It
/// stores 4-byte block ids only (a `HashMap<u128, u32>` bucket takes 32 bytes): the key is
/// the block's own `hash` entry. At most one block per 64-bit slot, and a hit is confirmed
/// against the whole key (hash, parent, extras, tokens): two hashes sharing their low bits
/// only share a slot (the second one is not cached, as with an equal hash).
type PrefixMap = hashbrown::HashTable<BlockId>;

fn map_slot(h: BlockHash) -> u64 {
    h as u64
}

/// `hash[b]` of a block that is not cached (`cached[b]` says which; an `Option<u128>` array
/// would take 32 bytes per block instead of 17).
const NO_HASH: BlockHash = 0;

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

#[derive(Clone)]
pub struct BlockPool {
    device: &'static str,
    num_blocks: u32,
    block_size: usize,
    ref_count: Vec<u32>,
    /// The hash the block is registered under (when `cached`), else [`NO_HASH`].
    hash: Vec<BlockHash>,
    cached: Vec<bool>,
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
    /// Bytes of the per-block tables of a pool of `n` blocks (refused up front if they
    /// cannot be had: a caller's count must not abort the process).
    fn table_bytes(n: usize, block_size: usize, caching: bool) -> usize {
        use std::mem::size_of;
        let per_block = 4 * size_of::<u32>() + size_of::<BlockHash>() + 2 + size_of::<f64>();
        let evict = 3 * size_of::<u32>() + size_of::<f64>() + 1;
        let cached = if caching {
            block_size.saturating_mul(4) + 2 * size_of::<u32>() + size_of::<u128>() + 16
        } else {
            0
        };
        n.saturating_mul(per_block + evict + cached)
    }

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
        crate::mem::check_fits(Self::table_bytes(n, block_size, caching), "a block pool")?;
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
            hash: vec![NO_HASH; n],
            cached: vec![false; n],
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
            map: PrefixMap::with_capacity(if caching { n } else { 0 }),
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

    /// Heap bytes this pool holds: its per-block arrays, the free stack, the eviction order
    /// and the prefix map's table. All are sized for every block at construction, so this is
    /// also what a cached block costs (`docs/scheduler.md`, memory).
    pub fn heap_bytes(&self) -> usize {
        use crate::mem::{table_bytes, vec_bytes};
        vec_bytes(&self.ref_count)
            + vec_bytes(&self.hash)
            + vec_bytes(&self.cached)
            + vec_bytes(&self.num_hashed_tokens)
            + vec_bytes(&self.last_accessed)
            + vec_bytes(&self.computed)
            + vec_bytes(&self.tokens)
            + vec_bytes(&self.parent)
            + vec_bytes(&self.parent_gen)
            + vec_bytes(&self.extra)
            + vec_bytes(&self.generation)
            + vec_bytes(&self.free_stack)
            + self.evict.heap_bytes()
            + table_bytes(self.map.capacity(), std::mem::size_of::<BlockId>())
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
        self.cached[b as usize].then(|| self.hash[b as usize])
    }
    pub fn num_hashed_tokens(&self, b: BlockId) -> u32 {
        self.num_hashed_tokens[b as usize]
    }
    pub fn last_accessed(&self, b: BlockId) -> f64 {
        self.last_accessed[b as usize]
    }
    /// (Never on an evictable block: its place in the eviction order is keyed by it.)
    pub fn set_last_accessed(&mut self, b: BlockId, t: f64) {
        debug_assert!(!self.is_evictable(b), "block {b} is evictable");
        self.last_accessed[b as usize] = t;
    }

    fn fields(&self) -> Fields<'_> {
        Fields {
            time: &self.last_accessed,
            hashed_tokens: &self.num_hashed_tokens,
        }
    }
    pub fn is_computed(&self, b: BlockId) -> bool {
        self.computed[b as usize]
    }
    pub fn set_computed(&mut self, b: BlockId, c: bool) {
        self.computed[b as usize] = c;
    }
    pub fn is_evictable(&self, b: BlockId) -> bool {
        self.ref_count[b as usize] == 0 && self.cached[b as usize]
    }
    /// Stored token ids of a cached block.
    pub fn cached_tokens(&self, b: BlockId) -> Option<&[u32]> {
        self.block_hash(b)?;
        let s = b as usize * self.block_size;
        Some(&self.tokens[s..s + self.block_size])
    }
    /// Evictable blocks in eviction order (first = next to go). O(n); for tests and introspection.
    pub fn eviction_order(&self) -> Vec<BlockId> {
        self.evict.order(self.fields())
    }

    // ---- allocation and references -------------------------------------------------------

    /// Hand out a block with ref count 1: a free one if any, else evict the LRU cached block.
    pub fn allocate(&mut self) -> Result<BlockId> {
        let b = if let Some(b) = self.free_stack.pop() {
            b
        } else if let Some(b) = self.evict.pop_first(Fields {
            time: &self.last_accessed,
            hashed_tokens: &self.num_hashed_tokens,
        }) {
            debug_assert!(self.cached[b as usize], "an evictable block has a hash");
            let h = std::mem::replace(&mut self.hash[b as usize], NO_HASH);
            self.cached[b as usize] = false;
            self.map_remove(b, h);
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
            if !self.cached[i] {
                return Err(Error::invalid(format!(
                    "block {b} is free; it cannot be shared"
                )));
            }
            let f = Fields {
                time: &self.last_accessed,
                hashed_tokens: &self.num_hashed_tokens,
            };
            self.evict.remove(b, f);
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
            if self.cached[i] {
                let f = Fields {
                    time: &self.last_accessed,
                    hashed_tokens: &self.num_hashed_tokens,
                };
                self.evict.insert(b, f);
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
            && self.hash[i] == key.hash
            && self.parent[i] == key.parent.unwrap_or(NIL)
            && key
                .parent
                .is_none_or(|p| self.generation.get(p as usize) == Some(&self.parent_gen[i]))
            && self.extra[i] == key.extra
            && self.tokens[s..s + self.block_size] == *key.tokens
    }

    /// The block cached under 64-bit slot `h`.
    fn map_get(&self, h: u64) -> Option<BlockId> {
        let hashes = &self.hash;
        self.map
            .find(h, |&b| map_slot(hashes[b as usize]) == h)
            .copied()
    }

    /// Drop block `b` (cached under `hash`) from the prefix map.
    fn map_remove(&mut self, b: BlockId, hash: BlockHash) {
        if let Ok(e) = self.map.find_entry(map_slot(hash), |&x| x == b) {
            e.remove();
        }
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
        let b = self.map_get(map_slot(key.hash))?;
        // a hash collision never hands out different data
        self.matches(b, key).then_some(b)
    }

    /// The key a cached block is stored under.
    pub fn key_of(&self, b: BlockId) -> Option<BlockKey<'_>> {
        let i = b as usize;
        let hash = self.block_hash(b)?;
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
        if self.cached[i] {
            return Err(Error::invalid(format!("block {b} is already cached")));
        }
        if let Some(p) = key.parent {
            if p as usize >= self.ref_count.len() || p == b {
                return Err(Error::invalid(format!(
                    "bad parent block {p} for block {b}"
                )));
            }
        }
        if self.map_get(map_slot(key.hash)).is_some() {
            return Ok(false);
        }
        let hashes = &self.hash;
        self.map
            .insert_unique(map_slot(key.hash), b, |&x| map_slot(hashes[x as usize]));
        self.hash[i] = key.hash;
        self.cached[i] = true;
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
            if self.ref_count[b as usize] != 0 || self.cached[b as usize] {
                return Err(format!("free block {b} has refs or a hash"));
            }
            state[b as usize] = 1;
        }
        self.evict.check(self.fields())?;
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
            if self.cached[b] && self.map_get(map_slot(self.hash[b])) != Some(b as u32) {
                return Err(format!("block {b} hash not in the prefix map"));
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
        for &b in &self.map {
            if b >= self.num_blocks {
                return Err(format!("prefix map entry {b} points past the pool"));
            }
            if !self.cached[b as usize] {
                return Err(format!("prefix map names block {b}, which is not cached"));
            }
        }
        for b in 0..self.num_blocks as usize {
            if !self.cached[b] {
                continue;
            }
            let h = self.hash[b];
            if self.map_get(map_slot(h)) != Some(b as u32) {
                return Err(format!("block {b} hash not in the prefix map"));
            }
            let p = self.parent[b];
            if p != NIL && (p >= self.num_blocks || p as usize == b) {
                return Err(format!("cached block {b} has a bad parent {p}"));
            }
        }
        if self.map.len() != self.cached.iter().filter(|&&c| c).count() {
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
        let hashes = p.hash.clone();
        p.map.insert_unique(8, b, |&x| map_slot(hashes[x as usize])); // twice the same block
        assert!(p.check_invariants().is_err());
        p.map.find_entry(8, |&x| x == b).unwrap().remove();
        p.check_invariants().unwrap();
        p.map.insert_unique(9, 3, |&x| map_slot(hashes[x as usize])); // a block with no hash
        assert!(p.check_invariants().is_err());
    }
}

#[cfg(test)]
mod slot_tests {
    //! The prefix map is keyed by 64 of the hash's 128 bits; hits still need the whole key.
    use super::*;

    fn key(hash: BlockHash, tokens: &[u32]) -> BlockKey<'_> {
        BlockKey {
            hash,
            parent: None,
            extra: 0,
            tokens,
        }
    }

    #[test]
    fn hashes_sharing_a_slot_never_hit_each_other() {
        let mut p = BlockPool::new("gpu", 4, 2, true).unwrap();
        let (a, b) = (p.allocate().unwrap(), p.allocate().unwrap());
        let (h1, h2) = (5 | 1 << 100, 5 | 1 << 90); // same low 64 bits
        assert!(p.register(a, &key(h1, &[1, 2]), 2).unwrap());
        assert!(
            !p.register(b, &key(h2, &[1, 2]), 2).unwrap(),
            "the slot is taken"
        );
        assert_eq!(p.peek(&key(h1, &[1, 2])), Some(a));
        assert_eq!(
            p.peek(&key(h2, &[1, 2])),
            None,
            "same slot and tokens, other hash"
        );
        p.check_invariants().unwrap();
    }

    #[test]
    fn a_zero_hash_is_cached_like_any_other() {
        let mut p = BlockPool::new("gpu", 4, 2, true).unwrap();
        let a = p.allocate().unwrap();
        assert_eq!(p.block_hash(a), None);
        assert!(p.register(a, &key(0, &[1, 2]), 2).unwrap());
        assert_eq!(p.block_hash(a), Some(0));
        assert_eq!(p.peek(&key(0, &[1, 2])), Some(a));
        p.check_invariants().unwrap();
    }
}
