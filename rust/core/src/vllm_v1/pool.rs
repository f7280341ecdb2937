//! vLLM v1's block pool: ref counts, the free-block queue and the prefix-cache map.
//!
//! Semantics are vLLM v1's `BlockPool` (0.32 and 0.33 agree on everything below):
//! * Block 0 is the *null block*: taken out of the queue at construction, never handed out,
//!   never freed, its ref count not kept.
//! * `get_new_blocks(n)` pops the queue's head `n` times; a popped block that still holds a
//!   cached hash is evicted from the map first (a `Removed` event), then gets ref count 1.
//! * `free_blocks(order)` drops one reference per listed block; blocks that reach 0 rejoin the
//!   queue: uncached ones (or all, with caching off) at the head, in list order (reused first,
//!   for locality), cached ones at the tail, in list order (LRU eviction).
//! * `touch(blocks)` adds a reference, taking an evictable block (ref count 0) out of the queue.
//! * The map sends a hash to the blocks cached under it, in insertion order; a lookup returns
//!   the first. Identical blocks are not de-duplicated (block tables stay append-only).
//!
//! Layout: per block, a ref count, queue links, its hash slot (empty while uncached), the tokens
//! the hash covers and the link to the next block cached under the same hash. The map is a
//! table of block ids (the first block cached under each hash; later ones chain through
//! `next_holder`), compared through the blocks' hash slots, so a hash is stored once.
//!
//! KV cache groups: vLLM keys its map by the hash *and* the KV cache group id
//! (`BlockHashWithGroupId`), so one pool serves several groups (hybrid models) without their
//! blocks answering for one another. A pool made by [`Pool::new_grouped`] (the group
//! managers' pool, for one group or several) keeps each cached block's group id (`group[b]`,
//! 4 B per block); the one-group manager's pool ([`Pool::new`]) has one group, id 0, and
//! keeps no such table (no bytes, no change to its layout). A
//! lookup hashes the block hash alone and compares hash and group, so a hash cached in `G`
//! groups shares one probe sequence (`G` is a handful). Events carry the hash only, as
//! vLLM's `BlockRemoved` hashes do; a grouped pool logs each event with its group
//! ([`Event::StoredIn`], [`Event::RemovedIn`]), the one-group manager's without (as before).
//!
//! Invariants: `ref_cnt[b] == 0` iff `b` is in the queue (null block excepted); `hash[b]` is
//! set iff `b` is on the chain the table keeps for that hash and `b`'s group.
//!
//! Costs: every operation O(1) per block touched (a chain is as long as the number of identical
//! blocks cached, almost always 1); 53 B per block (4 ref count, 8 queue links, 33 hash slot,
//! 4 hashed tokens, 4 chain link) plus, with caching on, a table of 4-byte ids sized for every
//! block (about 5 to 7 B per block): about 60 B per block, cached or not.

use foldhash::fast::RandomState;
use std::hash::BuildHasher;

use hashbrown::HashTable;

use super::free_queue::FreeQueue;
use crate::error::{Error, Result};
use crate::mem::try_filled;

/// The null block's id.
pub const NULL_BLOCK: u32 = 0;

/// No block (the end of a holder chain).
const NIL: u32 = u32::MAX;

/// A vLLM block hash (the bytes of `request.block_hashes[i]`), stored inline. Every hash
/// function vLLM offers yields at most 32 bytes (SHA-256; xxh3-128 gives 16).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct HashKey {
    len: u8,
    bytes: [u8; 32],
}

impl HashKey {
    pub const MAX_LEN: usize = 32;

    /// An empty hash slot (no valid key is empty).
    const NONE: HashKey = HashKey {
        len: 0,
        bytes: [0; 32],
    };

    fn is_none(&self) -> bool {
        self.len == 0
    }

    pub fn new(b: &[u8]) -> Result<Self> {
        if b.is_empty() || b.len() > Self::MAX_LEN {
            return Err(Error::invalid(format!(
                "a block hash must be 1 to {} bytes, got {}",
                Self::MAX_LEN,
                b.len()
            )));
        }
        let mut bytes = [0u8; 32];
        bytes[..b.len()].copy_from_slice(b);
        Ok(HashKey {
            len: b.len() as u8,
            bytes,
        })
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

/// What the pool (and the manager on top of it) did, in order, for KV cache events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Blocks `first..end` of the request at hand were cached (one `BlockStored`).
    Stored { first: u32, end: u32 },
    /// A cached hash left the map (one `BlockRemoved`).
    Removed(HashKey),
    /// `reset_prefix_cache` succeeded (`AllBlocksCleared`).
    Cleared,
    /// In a pool of several groups ([`Pool::new_grouped`]): blocks `first..end` of the
    /// request at hand in KV cache group `group` went through caching (one `BlockStored`
    /// with `group_idx`), and `cached` lists the positions really cached, ascending (vLLM's
    /// event lists only their hashes: null and unreachable blocks are skipped).
    StoredIn {
        group: u32,
        first: u32,
        end: u32,
        cached: Vec<u32>,
    },
    /// In a pool of several groups: a hash cached for `group` left the map (`BlockRemoved`
    /// with `group_idx`).
    RemovedIn(HashKey, u32),
}

#[derive(Clone, Debug)]
pub struct Pool {
    ref_cnt: Vec<u32>,
    /// The hash each block is cached under ([`HashKey::NONE`] while uncached).
    hash: Vec<HashKey>,
    /// Tokens covered by a cached block's hash (its position in the caching request + 1, in
    /// tokens); 0 while uncached.
    hashed_tokens: Vec<u32>,
    /// The next block cached under the same hash, in insertion order ([`NIL`]: the last).
    next_holder: Vec<u32>,
    /// The KV cache group each cached block is cached for; empty in a one-group pool (every
    /// block's group is 0 there).
    group: Vec<u32>,
    num_groups: u32,
    queue: FreeQueue,
    /// The first block cached under each hash, found through `hash[b]`.
    cached: HashTable<u32>,
    /// foldhash with a random seed per pool. The keys are digests of vLLM's block hash
    /// function, which clients cannot choose; the seed keeps a table's probe pattern private
    /// (foldhash's "minimal" DoS resistance). SipHash cost ~5% of a native-loop step here.
    hasher: RandomState,
    caching: bool,
    events: Option<Vec<Event>>,
    /// Scratch lists of `free_blocks` (kept to avoid allocating per call).
    to_head: Vec<u32>,
    to_tail: Vec<u32>,
}

impl Pool {
    /// The one-group manager's pool: no group table, events without a group.
    pub fn new(num_blocks: u32, caching: bool, events: bool) -> Result<Self> {
        Self::build(num_blocks, caching, events, 1, false)
    }

    /// A pool shared by `num_groups` KV cache groups (ids `0..num_groups`), as vLLM's one
    /// `BlockPool` under a coordinator of group managers (hybrid, or unitary over one
    /// sliding-window, chunked local or Mamba group): it keeps each cached block's group
    /// and logs events with their groups, whatever the count.
    pub fn new_grouped(
        num_blocks: u32,
        caching: bool,
        events: bool,
        num_groups: u32,
    ) -> Result<Self> {
        Self::build(num_blocks, caching, events, num_groups, true)
    }

    fn build(
        num_blocks: u32,
        caching: bool,
        events: bool,
        num_groups: u32,
        grouped: bool,
    ) -> Result<Self> {
        if num_groups == 0 {
            return Err(Error::invalid("a pool serves at least one KV cache group"));
        }
        if num_blocks == 0 || num_blocks >= u32::MAX - 2 {
            return Err(Error::invalid(format!(
                "num_blocks must be in 1..{}, got {num_blocks}",
                u32::MAX - 2
            )));
        }
        let n = num_blocks as usize;
        // Every table is sized for every block up front (no rehash while serving), each
        // allocated fallibly: a pool too large for the memory is refused, not an abort.
        // The largest table first: a count far too large fails before anything is touched.
        let hash = try_filled(HashKey::NONE, n, "block hashes")?;
        let mut cached = HashTable::new();
        let hasher = RandomState::default();
        cached
            .try_reserve(if caching { n - 1 } else { 0 }, |&b: &u32| b as u64)
            .map_err(|_| Error::invalid(format!("cannot allocate a cache map for {n} blocks")))?;
        let ref_cnt = try_filled(0, n, "ref counts")?;
        let hashed_tokens = try_filled(0, n, "hashed token counts")?;
        let next_holder = try_filled(NIL, n, "holder links")?;
        let group = if grouped {
            try_filled(0, n, "block groups")?
        } else {
            Vec::new()
        };
        let mut queue = FreeQueue::new(num_blocks)?;
        let null = queue.popleft();
        debug_assert_eq!(null, Some(NULL_BLOCK));
        Ok(Pool {
            ref_cnt,
            hash,
            hashed_tokens,
            next_holder,
            group,
            num_groups,
            queue,
            cached,
            hasher,
            caching,
            events: events.then(Vec::new),
            to_head: Vec::new(),
            to_tail: Vec::new(),
        })
    }

    pub fn num_blocks(&self) -> u32 {
        self.ref_cnt.len() as u32
    }

    pub fn num_free(&self) -> usize {
        self.queue.len()
    }

    pub fn caching(&self) -> bool {
        self.caching
    }

    /// vLLM's `get_usage`: the used share of the blocks other than the null block.
    pub fn usage(&self) -> f64 {
        let total = self.num_blocks() as usize - 1;
        if total == 0 {
            return 0.0;
        }
        1.0 - self.num_free() as f64 / total as f64
    }

    pub fn ref_cnt(&self, b: u32) -> u32 {
        self.ref_cnt[b as usize]
    }

    pub fn hash_of(&self, b: u32) -> Option<&HashKey> {
        let k = &self.hash[b as usize];
        (!k.is_none()).then_some(k)
    }

    /// vLLM's `block_hash_num_tokens` (`None` while the block is not cached).
    pub fn hashed_tokens(&self, b: u32) -> Option<u32> {
        self.hash_of(b).map(|_| self.hashed_tokens[b as usize])
    }

    pub fn is_free(&self, b: u32) -> bool {
        self.queue.contains(b)
    }

    /// The queue from head (next handed out) to tail.
    pub fn free_queue(&self) -> Vec<u32> {
        self.queue.to_vec()
    }

    pub fn num_cached_hashes(&self) -> usize {
        self.cached.len()
    }

    /// `Ok` when `b` names a block of this pool.
    pub fn check_block(&self, b: i64) -> Result<u32> {
        if b < 0 || b >= self.num_blocks() as i64 {
            return Err(Error::BlockOutOfRange {
                block: b,
                num_blocks: self.num_blocks(),
            });
        }
        Ok(b as u32)
    }

    /// How many KV cache groups the pool serves (1 unless made by [`Pool::new_grouped`]).
    pub fn num_groups(&self) -> u32 {
        self.num_groups
    }

    /// Made by [`Pool::new_grouped`]: blocks keep their group, events carry it.
    pub fn is_grouped(&self) -> bool {
        !self.group.is_empty()
    }

    /// The group `b` is cached for (0 in a one-group pool or while `b` is uncached).
    pub fn group_of(&self, b: u32) -> u32 {
        self.group.get(b as usize).copied().unwrap_or(0)
    }

    /// The first block cached under `key` (in group 0).
    pub fn get_cached(&self, key: &HashKey) -> Option<u32> {
        self.get_cached_in(key, 0)
    }

    /// The first block cached under `key` for KV cache group `group` (vLLM's
    /// `get_one_block(make_block_hash_with_group_id(key, group))`).
    pub fn get_cached_in(&self, key: &HashKey, group: u32) -> Option<u32> {
        let (hash, groups) = (&self.hash, &self.group);
        let h = self.hasher.hash_one(key);
        if groups.is_empty() {
            // One group: the hash alone (the single-group manager's lookup, as before).
            return (group == 0)
                .then(|| self.cached.find(h, |&b| hash[b as usize] == *key))
                .flatten()
                .copied();
        }
        self.cached
            .find(h, |&b| {
                hash[b as usize] == *key && groups[b as usize] == group
            })
            .copied()
    }

    /// The blocks cached under the hash whose chain starts at `first`, in insertion order.
    fn holders(&self, first: u32) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors(Some(first), |&b| {
            Some(self.next_holder[b as usize]).filter(|&n| n != NIL)
        })
    }

    /// Whether `b` holds no reference and no other owner (evictable or plain free).
    pub fn is_evictable(&self, b: u32) -> bool {
        b != NULL_BLOCK && self.ref_cnt[b as usize] == 0
    }

    /// One more reference to each block; evictable ones leave the queue.
    pub fn touch(&mut self, blocks: &[u32]) {
        for &b in blocks {
            if b == NULL_BLOCK {
                continue;
            }
            if self.ref_cnt[b as usize] == 0 {
                self.queue.remove(b);
            }
            self.ref_cnt[b as usize] += 1;
        }
    }

    /// `n` blocks from the queue's head, appended to `out`, each with ref count 1.
    pub fn get_new_blocks(&mut self, n: usize, out: &mut Vec<u32>) -> Result<()> {
        if n > self.num_free() {
            return Err(Error::OutOfBlocks {
                device: "gpu",
                needed: n,
                free: self.num_free(),
            });
        }
        let start = out.len();
        self.queue.popleft_n(n, out);
        for &b in &out[start..] {
            if self.caching {
                self.evict(b);
            }
            debug_assert_eq!(self.ref_cnt[b as usize], 0);
            self.ref_cnt[b as usize] = 1;
        }
        Ok(())
    }

    /// Drop one reference per listed block (in eviction-priority order), all or nothing.
    pub fn free_blocks(&mut self, order: impl Iterator<Item = u32> + Clone) -> Result<()> {
        self.check_free(order.clone())?;
        let (mut head, mut tail) = (
            std::mem::take(&mut self.to_head),
            std::mem::take(&mut self.to_tail),
        );
        for b in order {
            if b == NULL_BLOCK {
                continue;
            }
            let rc = &mut self.ref_cnt[b as usize];
            *rc -= 1;
            if *rc == 0 {
                if self.hash[b as usize].is_none() || !self.caching {
                    head.push(b);
                } else {
                    tail.push(b);
                }
            }
        }
        self.queue.prepend_n(&head);
        self.queue.append_n(&tail);
        head.clear();
        tail.clear();
        (self.to_head, self.to_tail) = (head, tail);
        Ok(())
    }

    /// Every listed block is in range and holds as many references as the list drops (a
    /// trial decrement, undone before returning, so duplicates in one list count).
    fn check_free(&mut self, order: impl Iterator<Item = u32> + Clone) -> Result<()> {
        let mut done = 0usize;
        let mut failed = None;
        for b in order.clone() {
            if b as usize >= self.ref_cnt.len() {
                failed = Some(Error::BlockOutOfRange {
                    block: b as i64,
                    num_blocks: self.num_blocks(),
                });
                break;
            }
            if b != NULL_BLOCK {
                if self.ref_cnt[b as usize] == 0 {
                    failed = Some(Error::DoubleFree(b));
                    break;
                }
                self.ref_cnt[b as usize] -= 1;
            }
            done += 1;
        }
        for b in order.take(done) {
            if b != NULL_BLOCK {
                self.ref_cnt[b as usize] += 1;
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Cache `b` under `key`, its hash covering `num_tokens` tokens (vLLM's
    /// `_insert_block_hash` for a block without a hash).
    pub fn insert_hash(&mut self, b: u32, key: HashKey, num_tokens: u32) -> Result<()> {
        self.insert_hash_in(b, key, 0, num_tokens)
    }

    /// [`Pool::insert_hash`] for KV cache group `group` (below the pool's group count).
    pub fn insert_hash_in(
        &mut self,
        b: u32,
        key: HashKey,
        group: u32,
        num_tokens: u32,
    ) -> Result<()> {
        if group >= self.num_groups {
            return Err(Error::invalid(format!(
                "KV cache group {group} in a pool of {} groups",
                self.num_groups
            )));
        }
        match self.hash_of(b) {
            Some(k) if *k == key && self.group_of(b) == group => return Ok(()),
            Some(_) => {
                return Err(Error::invalid(format!(
                    "block {b} is already cached under another hash"
                )))
            }
            None => {}
        }
        match self.get_cached_in(&key, group) {
            Some(first) => {
                let last = self.holders(first).last().unwrap_or(first);
                self.next_holder[last as usize] = b;
            }
            None => {
                let (hash, hasher) = (&self.hash, &self.hasher);
                let h = hasher.hash_one(key);
                self.cached
                    .insert_unique(h, b, |&x| hasher.hash_one(hash[x as usize]));
            }
        }
        self.hash[b as usize] = key;
        self.hashed_tokens[b as usize] = num_tokens;
        self.next_holder[b as usize] = NIL;
        if let Some(g) = self.group.get_mut(b as usize) {
            *g = group;
        }
        Ok(())
    }

    /// Take `b`'s hash out of the map (vLLM's `_maybe_evict_cached_block`).
    pub fn evict(&mut self, b: u32) -> bool {
        let Some(&key) = self.hash_of(b) else {
            return false;
        };
        let group = self.group_of(b);
        let popped = self.pop_holder(&key, b);
        self.hash[b as usize] = HashKey::NONE;
        self.hashed_tokens[b as usize] = 0;
        self.next_holder[b as usize] = NIL;
        if let Some(g) = self.group.get_mut(b as usize) {
            *g = 0;
        }
        if popped {
            self.push_event(if self.group.is_empty() {
                Event::Removed(key)
            } else {
                Event::RemovedIn(key, group)
            });
        }
        popped
    }

    /// Take `b` off the chain of `key` in `b`'s group (its hash slot still set: the table
    /// compares through it).
    fn pop_holder(&mut self, key: &HashKey, b: u32) -> bool {
        let h = self.hasher.hash_one(key);
        let group = self.group_of(b);
        let (hash, groups) = (&self.hash, &self.group);
        let group_of = |x: u32| groups.get(x as usize).copied().unwrap_or(0);
        let Ok(entry) = self
            .cached
            .find_entry(h, |&x| hash[x as usize] == *key && group_of(x) == group)
        else {
            return false;
        };
        let first = *entry.get();
        let next = self.next_holder[b as usize];
        if first == b {
            if next == NIL {
                entry.remove();
            } else {
                *entry.into_mut() = next;
            }
            return true;
        }
        let Some(prev) = self
            .holders(first)
            .find(|&x| self.next_holder[x as usize] == b)
        else {
            return false;
        };
        self.next_holder[prev as usize] = next;
        true
    }

    /// vLLM's `reset_prefix_cache`: only when every block but the null block is free.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_blocks() as usize - self.num_free() != 1 {
            return false;
        }
        self.cached.clear();
        self.hash.fill(HashKey::NONE);
        self.hashed_tokens.fill(0);
        self.next_holder.fill(NIL);
        self.group.fill(0);
        self.push_event(Event::Cleared);
        true
    }

    /// Whether events were logged since the last `take_events`.
    pub fn has_events(&self) -> bool {
        self.events.as_ref().is_some_and(|e| !e.is_empty())
    }

    pub fn events_enabled(&self) -> bool {
        self.events.is_some()
    }

    pub fn push_event(&mut self, e: Event) {
        if let Some(ev) = self.events.as_mut() {
            ev.push(e);
        }
    }

    /// The events since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<Event> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Heap bytes held (memory accounting: every buffer's capacity).
    pub fn heap_bytes(&self) -> usize {
        use crate::mem::{table_bytes, vec_bytes};
        let events = self.events.as_ref().map_or(0, vec_bytes);
        vec_bytes(&self.ref_cnt)
            + vec_bytes(&self.hash)
            + vec_bytes(&self.hashed_tokens)
            + vec_bytes(&self.next_holder)
            + vec_bytes(&self.group)
            + self.queue.heap_bytes()
            + table_bytes(self.cached.capacity(), std::mem::size_of::<u32>())
            + events
            + vec_bytes(&self.to_head)
            + vec_bytes(&self.to_tail)
    }

    /// Check every invariant (tests).
    pub fn check(&self) -> std::result::Result<(), String> {
        let queue = self.queue.to_vec();
        if queue.len() != self.queue.len() {
            return Err("queue length disagrees with its links".into());
        }
        for b in 1..self.num_blocks() {
            let free = self.queue.contains(b);
            if free != (self.ref_cnt[b as usize] == 0) {
                return Err(format!(
                    "block {b}: in queue {free}, ref {}",
                    self.ref_cnt(b)
                ));
            }
            if let Some(k) = self.hash_of(b) {
                if !self
                    .get_cached_in(k, self.group_of(b))
                    .is_some_and(|f| self.holders(f).any(|x| x == b))
                {
                    return Err(format!("block {b}'s hash is not mapped to it"));
                }
            }
        }
        if self.queue.contains(NULL_BLOCK) {
            return Err("the null block is in the free queue".into());
        }
        let mapped: usize = self.cached.iter().map(|&f| self.holders(f).count()).sum();
        let hashed = self.hash.iter().filter(|h| !h.is_none()).count();
        if mapped != hashed {
            return Err(format!("{mapped} mapped blocks, {hashed} hashed"));
        }
        Ok(())
    }
}
