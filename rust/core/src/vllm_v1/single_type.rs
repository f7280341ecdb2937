//! vLLM v1's single-type KV cache managers (`single_type_kv_cache_manager.py`): one per KV
//! cache group, every group's blocks drawn from one shared [`Pool`], block ids as vLLM's.
//!
//! ```text
//!   group 0 (full):     [ 7][ 3][12][ 9]            every block kept until the request ends
//!   group 1 (window 8): [ 0][ 0][ 5][ 8]            blocks out of the window -> null block 0
//!   group 2 (chunk 8):  [ 0][ 0][ 2][ 6]            blocks left of the current chunk -> null
//! ```
//!
//! Kinds mirrored ([`AttentionKind`]): full attention (`FullAttentionManager`), sliding window
//! (`SlidingWindowManager`) and chunked local attention (`ChunkedLocalAttentionManager`), each
//! with vLLM's `find_longest_cache_hit`, `get_num_skipped_tokens`, `remove_skipped_blocks`,
//! `get_num_blocks_to_allocate`, `add_local_computed_blocks`, `allocate_new_blocks`,
//! `cache_blocks` (with the sliding window's `reachable_block_mask` under each retention mode,
//! [`super::retention`]) and `free`. This file holds what the kinds share (the group manager,
//! the table bookkeeping, the lookup's driver); each kind's own rules (its skipped tokens,
//! admission cap and lookup) are in a file of its own: [`super::full_attention`],
//! [`super::sliding_window`], [`super::chunked_local`], [`super::mamba`]. The single-group [`super::manager::Manager`] is the
//! full-attention path of this file with one group: it calls the shared pieces below
//! ([`cached_prefix`], [`blocks_to_allocate`], [`cache_full_blocks`]) rather than a copy of them.
//!
//! EAGLE/MTP's last-block drop is here ([`find_longest_cache_hit_eagle`], the group's
//! [`GroupEagle`]; the rules in [`super::eagle`]). Scope (what the callers must rule out, as
//! `pagedkv.vllm_v1`'s scope does for the single group): no `extra_retained_tokens` (multi-
//! module MTP), EAGLE never with chunked local attention (vLLM asserts), no KV connector
//! (no external tokens), no context parallelism, no fine-grained partial hash hits (they need
//! a Mamba "align" group with blocks larger than the hash block), no R-SWA, sink, circular-buffer, cross-attention or HiSparse
//! groups, and full-attention groups only at the hash block size: with larger blocks vLLM's
//! `FullAttentionManager.cache_blocks` also registers the prompt's last hash boundary inside
//! a block as a partial entry on that block (`cache_partial_block`: a second hash per block,
//! its own `BlockStored`, re-registered after an eviction), which [`GroupManager::new`]
//! refuses rather than mirror half of (the lookup, [`find_longest_cache_hit`], reads such
//! groups' hashes correctly; the caching would not match). Other kinds may use any multiple
//! of the hash block size. Mamba groups are the kind [`AttentionKind::Mamba`] (mode "none",
//! no prefix caching), rules in [`super::mamba`], or [`AttentionKind::MambaAlign`] (mode
//! "align", at the hash block size), rules in [`super::mamba_align`], its per-request
//! bookkeeping kept beside the table (`ReqBlocks`).
//! Without prefix caching no hash is read, so the hash block size constrains no group.
//!
//! Invariants (per group): a request's table holds its blocks in token order; null blocks
//! ([`NULL_BLOCK`]) only form a prefix of it (the skipped part), except in a Mamba align
//! group's (retired and unwritten states are null anywhere); `num_cached`, once set, counts
//! the table's leading blocks that are cached or skipped (vLLM's `num_cached_block`; `None`
//! while the request is not tracked, which is what makes a first allocation count prefix
//! hits). Every non-null block in a table holds one reference for it.
//!
//! Costs: a lookup scans at most `max_length / block_size` hashes per group (the sliding
//! window scans from the right and stops at its first run); `remove_skipped_blocks` is O(blocks
//! newly skipped) (it stops at the first null, as vLLM does); everything else is O(blocks
//! allocated, cached or freed). 4 B per table entry plus the request map.

use foldhash::fast::RandomState;

use hashbrown::HashMap;

use super::eagle::GroupEagle;
use super::engine::Release;
use super::mamba_align::{
    self, AlignAlloc, AlignGroup, AlignReq, AlignRules, CountArgs, TailCtx, TailPlan,
};
use super::manager::HashSource;
use super::pool::{Event, HashKey, Pool, NULL_BLOCK};
use super::retention::{Boundaries, Retained, Retention};
use super::{chunked_local, mamba, sliding_window};
use crate::error::{Error, Result};

/// The attention kinds a group can serve (vLLM's `KVCacheSpec` subclasses mirrored here).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// `FullAttentionSpec`: every token attends to every earlier one.
    Full,
    /// `SlidingWindowSpec`: a token attends to the `sliding_window` tokens ending at it.
    SlidingWindow { sliding_window: u32 },
    /// `ChunkedLocalAttentionSpec`: a token attends to its own `attention_chunk_size` chunk.
    ChunkedLocal { attention_chunk_size: u32 },
    /// `MambaSpec` in mode `"none"`: one state per request ([`super::mamba`]).
    Mamba { num_speculative_blocks: u32 },
    /// `MambaSpec` in mode `"align"` (prefix caching on): per-step state blocks
    /// ([`super::mamba_align`]); `checkpoint_alignment` is the spec's
    /// `prefill_checkpoint_alignment` when it has prefill checkpoint blocks, else 0.
    MambaAlign {
        num_speculative_blocks: u32,
        checkpoint_alignment: u32,
    },
}

/// One KV cache group's spec: what vLLM's hybrid coordinator compares to batch lookups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupSpec {
    pub kind: AttentionKind,
    /// Tokens per block (the group's own; a multiple of the hash block size).
    pub block_size: u32,
    /// Everything else of vLLM's spec (heads, head size, dtype...), as an opaque tag: two
    /// groups share one lookup only when kind, block size and this tag are all equal (vLLM
    /// compares the whole spec).
    pub layout: u32,
}

impl AttentionKind {
    /// Whether `prefix_cache_retention_interval` applies to this kind (vLLM validates a
    /// positive interval only when some sliding-window or Mamba group has it).
    pub fn retention_applies(&self) -> bool {
        matches!(
            self,
            AttentionKind::SlidingWindow { .. }
                | AttentionKind::Mamba { .. }
                | AttentionKind::MambaAlign { .. }
        )
    }
}

impl GroupSpec {
    pub fn new(kind: AttentionKind, block_size: u32) -> Self {
        GroupSpec {
            kind,
            block_size,
            layout: 0,
        }
    }

    pub fn check(&self) -> Result<()> {
        if self.block_size == 0 {
            return Err(Error::invalid("a group's block_size must be positive"));
        }
        match self.kind {
            AttentionKind::SlidingWindow { sliding_window: 0 } => {
                Err(Error::invalid("sliding_window must be positive"))
            }
            AttentionKind::ChunkedLocal {
                attention_chunk_size: 0,
            } => Err(Error::invalid("attention_chunk_size must be positive")),
            _ => Ok(()),
        }
    }

    /// vLLM's `get_num_skipped_tokens(num_computed_tokens)`: the leading tokens no later
    /// token attends to (full: none; sliding window: all but the last `sliding_window - 1`;
    /// chunked local: every token before the current chunk).
    pub fn num_skipped_tokens(&self, num_computed_tokens: u64) -> u64 {
        match self.kind {
            AttentionKind::Full => 0,
            AttentionKind::SlidingWindow { sliding_window } => {
                sliding_window::num_skipped_tokens(sliding_window, num_computed_tokens)
            }
            AttentionKind::ChunkedLocal {
                attention_chunk_size,
            } => chunked_local::num_skipped_tokens(attention_chunk_size, num_computed_tokens),
            AttentionKind::Mamba { .. } | AttentionKind::MambaAlign { .. } => {
                mamba::num_skipped_tokens(num_computed_tokens)
            }
        }
    }

    /// The token slots this kind counts and allocates for `num_tokens` (Mamba adds its
    /// speculative blocks; every other kind `num_tokens`).
    pub fn slot_tokens(&self, num_tokens: u64) -> u64 {
        match self.kind {
            AttentionKind::Mamba {
                num_speculative_blocks,
            } => mamba::slot_tokens(num_tokens, self.block_size, num_speculative_blocks),
            _ => num_tokens,
        }
    }

    /// The spec's `max_admission_blocks_per_request` (`None`: no cap, full attention), the
    /// per-request reservation cap that `get_num_blocks_to_allocate(apply_admission_cap)`
    /// applies for the recycling kinds.
    pub fn max_admission_blocks(
        &self,
        max_in_flight_tokens: u64,
        max_model_len: u64,
    ) -> Option<u64> {
        let bs = u64::from(self.block_size);
        let (in_flight, max_len) = (max_in_flight_tokens, max_model_len);
        match self.kind {
            AttentionKind::Full
            | AttentionKind::Mamba { .. }
            | AttentionKind::MambaAlign { .. } => None,
            AttentionKind::SlidingWindow { sliding_window } => Some(
                sliding_window::max_admission_blocks(sliding_window, bs, in_flight, max_len),
            ),
            AttentionKind::ChunkedLocal {
                attention_chunk_size,
            } => Some(chunked_local::max_admission_blocks(
                attention_chunk_size,
                bs,
                in_flight,
                max_len,
            )),
        }
    }

    /// Blocks a sliding-window hit needs in a row (`_contiguous_blocks_for_hit`, no EAGLE).
    pub(crate) fn contiguous_blocks_for_hit(sliding_window: u32, block_size: u32) -> usize {
        (sliding_window as usize - 1).div_ceil(block_size as usize)
    }
}

/// The hashes viewed at `scale` hash blocks per block (`BlockHashListWithBlockSize`: a block's
/// hash is the hash at its last hash-block boundary, chained over the whole prefix).
pub(super) struct View<'a> {
    pub(super) hashes: &'a mut dyn HashSource,
    pub(super) scale: usize,
}

impl View<'_> {
    pub(super) fn count(&mut self) -> Result<usize> {
        Ok(self.hashes.count()? / self.scale)
    }

    pub(super) fn key(&mut self, i: usize) -> Result<HashKey> {
        self.hashes.key((i + 1) * self.scale - 1)
    }
}

/// vLLM's `BlockPool.get_cached_block(hash, group_ids)`: the first block cached under `key`
/// in each group, into `out`; `false` (and `out` unspecified) when any group misses.
pub(super) fn cached_in_all(
    pool: &Pool,
    key: &HashKey,
    groups: &[u32],
    out: &mut Vec<u32>,
) -> bool {
    out.clear();
    for &g in groups {
        match pool.get_cached_in(key, g) {
            Some(b) => out.push(b),
            None => return false,
        }
    }
    true
}

/// The full-attention scan: the longest run of blocks from block 0 cached in every group of
/// `groups`, at most `max_blocks` long, appended to `out[j]` for `groups[j]` (the hashes
/// viewed at `scale` hash blocks per block). Returns the run's length in blocks.
pub(crate) fn cached_prefix(
    pool: &Pool,
    groups: &[u32],
    hashes: &mut dyn HashSource,
    scale: usize,
    max_blocks: usize,
    out: &mut [Vec<u32>],
) -> Result<usize> {
    let mut view = View { hashes, scale };
    let n = max_blocks.min(view.count()?);
    for i in 0..n {
        let key = view.key(i)?;
        for (j, &g) in groups.iter().enumerate() {
            match pool.get_cached_in(&key, g) {
                Some(b) => out[j].push(b),
                None => {
                    // A miss in any group ends the run for all (no scratch list needed).
                    for o in &mut out[..j] {
                        o.pop();
                    }
                    return Ok(i);
                }
            }
        }
    }
    Ok(n)
}

/// vLLM's `get_num_blocks_to_allocate` arithmetic for one group: `required` blocks wanted,
/// `held` in the table, `running` (tracked in `num_cached_block`: no new hits), the hit to
/// adopt and the whole blocks the window skips. Every block the hit brings back from the
/// free queue (evictable, past the skipped ones) counts as one to allocate.
pub(crate) fn blocks_to_allocate(
    pool: &Pool,
    required: u64,
    held: u64,
    running: bool,
    new_computed: &[u32],
    num_skipped_blocks: u64,
) -> u64 {
    if running {
        return required.saturating_sub(held);
    }
    let local = new_computed.len() as u64 + held;
    let new = required.saturating_sub(num_skipped_blocks.max(local));
    let skipped_hits = num_skipped_blocks
        .saturating_sub(held)
        .min(new_computed.len() as u64) as usize;
    let evictable = new_computed[skipped_hits..]
        .iter()
        .filter(|&&b| pool.is_evictable(b))
        .count() as u64;
    new + evictable
}

/// vLLM's `BlockPool.cache_full_blocks` for group `group`: cache blocks
/// `first..first + keys.len()` of `blocks` (`keys[i]` is block `first + i`'s hash), skipping
/// null blocks and those `reachable` rules out, then log one `Stored` event for the whole
/// range (vLLM logs one `BlockStored` even when every block was skipped).
pub(crate) fn cache_full_blocks(
    pool: &mut Pool,
    group: u32,
    block_size: u32,
    blocks: &[u32],
    first: u32,
    keys: &[HashKey],
    reachable: impl Fn(usize) -> bool,
) {
    let grouped = pool.is_grouped();
    let mut cached = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        let idx = first as usize + i;
        let b = blocks[idx];
        if b == NULL_BLOCK || !reachable(idx) {
            continue;
        }
        // A newly full block was handed out uncached (get_new_blocks evicts) and is past the
        // request's cached prefix, so it has no hash yet: this cannot fail.
        pool.insert_hash_in(b, *k, group, (idx as u32 + 1) * block_size)
            .expect("a newly full block has no hash yet");
        if grouped && pool.events_enabled() {
            cached.push(idx as u32);
        }
    }
    let end = first + keys.len() as u32;
    pool.push_event(if grouped {
        Event::StoredIn {
            group,
            first,
            end,
            cached,
        }
    } else {
        Event::Stored { first, end }
    });
}

/// vLLM's `find_longest_cache_hit` of the manager for `spec`, over the groups `groups`
/// (all of that spec): per group the hit's blocks (skipped positions as the null block), and
/// the hit in tokens. `max_length` caps the hit; `alignment` (the coordinator's
/// `cache_hit_alignment_tokens`) is what the hit's length must be a multiple of; the hashes
/// are at `hash_block_size` tokens each.
pub fn find_longest_cache_hit(
    spec: &GroupSpec,
    groups: &[u32],
    pool: &Pool,
    hashes: &mut dyn HashSource,
    hash_block_size: u32,
    max_length: u64,
    alignment: u64,
) -> Result<(Vec<Vec<u32>>, u64)> {
    let args = (hash_block_size, max_length, alignment);
    find_longest_cache_hit_eagle(spec, groups, pool, hashes, args, false)
}

/// [`find_longest_cache_hit`] with vLLM's `drop_eagle_block` ([`super::eagle`]): full
/// attention drops the last matched block, a sliding window needs one more block in a row and
/// pops it, chunked local attention refuses (vLLM asserts). `args` is `(hash_block_size,
/// max_length, alignment)`.
pub fn find_longest_cache_hit_eagle(
    spec: &GroupSpec,
    groups: &[u32],
    pool: &Pool,
    hashes: &mut dyn HashSource,
    (hash_block_size, max_length, alignment): (u32, u64, u64),
    drop_eagle: bool,
) -> Result<(Vec<Vec<u32>>, u64)> {
    spec.check()?;
    let bs = u64::from(spec.block_size);
    if hash_block_size == 0 || spec.block_size % hash_block_size != 0 || alignment == 0 {
        return Err(Error::invalid(format!(
            "block size {} must be a positive multiple of the hash block size \
             {hash_block_size}, the alignment ({alignment}) positive",
            spec.block_size
        )));
    }
    let scale = (spec.block_size / hash_block_size) as usize;
    let search = HitSearch {
        pool,
        groups,
        bs,
        max_blocks: usize::try_from(max_length / bs).unwrap_or(usize::MAX),
        alignment,
        drop_eagle,
        out: vec![Vec::new(); groups.len()],
    };
    match spec.kind {
        AttentionKind::Full => search.full(hashes, scale),
        AttentionKind::SlidingWindow { sliding_window } => {
            let need = GroupSpec::contiguous_blocks_for_hit(sliding_window, spec.block_size)
                + usize::from(drop_eagle);
            search.sliding_window(View { hashes, scale }, need)
        }
        AttentionKind::ChunkedLocal { .. } if drop_eagle => Err(Error::invalid(
            "EAGLE with chunked local attention is not supported (vLLM asserts the same)",
        )),
        AttentionKind::ChunkedLocal {
            attention_chunk_size,
        } => search.chunked_local(
            View { hashes, scale },
            u64::from(attention_chunk_size),
            max_length,
        ),
        // Mode "none" has no prefix caching, hence no hits.
        AttentionKind::Mamba { .. } => mamba::check(spec.kind, true).map(|()| (Vec::new(), 0)),
        // Align mode's finder never drops EAGLE's block (draft models have no Mamba layers).
        AttentionKind::MambaAlign { .. } => search.mamba_align(View { hashes, scale }),
    }
}

/// One `find_longest_cache_hit` once its arguments are checked: a method per attention kind,
/// each returning the groups' tables (`out`) and the hit in tokens.
/// The kinds' own searches live beside their other rules: [`super::full_attention`],
/// [`super::sliding_window`], [`super::chunked_local`].
pub(super) struct HitSearch<'a> {
    pub(super) pool: &'a Pool,
    pub(super) groups: &'a [u32],
    /// The group's block size in tokens.
    pub(super) bs: u64,
    /// `max_length // block_size`.
    pub(super) max_blocks: usize,
    pub(super) alignment: u64,
    /// vLLM's `drop_eagle_block`.
    pub(super) drop_eagle: bool,
    pub(super) out: Vec<Vec<u32>>,
}

#[derive(Clone, Debug, Default)]
struct ReqBlocks {
    blocks: Vec<u32>,
    num_cached: Option<u32>,
    /// A Mamba align group's per-request bookkeeping (unused by the other kinds).
    align: AlignReq,
}

/// What a `cache_blocks` call will cache, read before anything changes: blocks
/// `first..first + keys.len()`, those `retained` holds.
#[derive(Clone, Debug, Default)]
pub struct CachePlan {
    pub first: u32,
    pub keys: Vec<HashKey>,
    pub retained: Retained,
    /// `false`: nothing becomes full (vLLM returns before touching anything).
    pub active: bool,
    /// A Mamba align group's tail (cached even when no block becomes full).
    pub tail: Option<TailPlan>,
}

/// What `allocate_new_blocks` will append to a request's table, planned before anything
/// changes ([`GroupManager::plan_new_blocks`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NewBlocks {
    /// This many blocks from the free queue's head.
    Plain(usize),
    /// A Mamba align group's allocation.
    Align(AlignAlloc),
}

impl NewBlocks {
    /// The blocks it takes from the pool's free queue.
    pub fn num_new(&self) -> usize {
        match self {
            NewBlocks::Plain(n) => *n,
            NewBlocks::Align(a) => a.num_new,
        }
    }
}

/// One KV cache group's manager (vLLM's `SingleTypeKVCacheManager` subclass for its kind),
/// over a [`Pool`] its caller owns and shares with the other groups.
#[derive(Clone, Debug)]
pub struct GroupManager {
    spec: GroupSpec,
    group_id: u32,
    hash_block_size: u32,
    /// `cache_hit_alignment_tokens` (the scheduler block size, no fine-grained hits).
    alignment: u64,
    admission_cap: Option<u64>,
    caching: bool,
    retention: Retention,
    /// EAGLE's effect on this group's caching (set by the coordinator; none by default).
    eagle: GroupEagle,
    /// A Mamba align group's rules and `cached_blocks_this_step` (`None` for other kinds).
    align: Option<AlignGroup>,
    release: Release,
    reqs: HashMap<Box<str>, ReqBlocks, RandomState>,
}

/// Everything a group manager is built from, besides its spec and id.
#[derive(Clone, Copy, Debug)]
pub struct GroupParams {
    pub hash_block_size: u32,
    pub scheduler_block_size: u32,
    pub enable_caching: bool,
    pub max_in_flight_tokens: u64,
    pub max_model_len: u64,
    /// `prefix_cache_retention_interval` (checked by the coordinator, as vLLM checks it).
    pub retention: Retention,
    pub release: Release,
    /// The coordinator's `use_eagle`, which sets every Mamba manager's
    /// `drop_eagle_checkpoint_block` (align mode's checkpoint positions).
    pub mamba_drop_eagle: bool,
    /// vLLM 0.33's `num_hash_lookahead_tokens` (align mode's checkpoint positions).
    pub hash_lookahead_tokens: u64,
}

impl GroupManager {
    pub fn new(spec: GroupSpec, group_id: u32, p: GroupParams) -> Result<Self> {
        spec.check()?;
        mamba::check(spec.kind, p.enable_caching)?;
        mamba_align::check_group(&spec, p.enable_caching, p.hash_block_size)?;
        // Without caching no hash is read (vLLM then hashes at the scheduler block size).
        let hashed = p.enable_caching;
        if hashed && (p.hash_block_size == 0 || spec.block_size % p.hash_block_size != 0) {
            return Err(Error::invalid(format!(
                "block size {} must be a positive multiple of the hash block size {}",
                spec.block_size, p.hash_block_size
            )));
        }
        if hashed && spec.kind == AttentionKind::Full && spec.block_size != p.hash_block_size {
            // vLLM's FullAttentionManager.cache_blocks then also registers the prompt's last
            // hash boundary inside a block as a second, partial cache entry on that block
            // (`_cache_partial_tail_block`), which a pool of one hash per block cannot hold.
            return Err(Error::invalid(format!(
                "a full-attention group's block size ({}) must equal the hash block size \
                 ({}): vLLM caches partial prompt-tail entries otherwise, which pagedkv does not",
                spec.block_size, p.hash_block_size
            )));
        }
        if p.scheduler_block_size % spec.block_size != 0 {
            return Err(Error::invalid(format!(
                "the scheduler block size {} must be a multiple of block size {}",
                p.scheduler_block_size, spec.block_size
            )));
        }
        Ok(GroupManager {
            spec,
            group_id,
            hash_block_size: p.hash_block_size,
            alignment: u64::from(p.scheduler_block_size),
            admission_cap: spec.max_admission_blocks(p.max_in_flight_tokens, p.max_model_len),
            caching: p.enable_caching,
            retention: p.retention,
            eagle: GroupEagle::default(),
            align: AlignRules::new(
                &spec,
                p.hash_block_size,
                u64::from(p.scheduler_block_size),
                (p.mamba_drop_eagle, p.hash_lookahead_tokens),
            )
            .map(AlignGroup::new),
            release: p.release,
            reqs: HashMap::with_hasher(RandomState::default()),
        })
    }

    /// Set EAGLE's effect on this group ([`super::eagle`]; the coordinator decides it once).
    pub fn set_eagle(&mut self, eagle: GroupEagle) {
        self.eagle = eagle;
    }

    /// The group's `use_eagle` (it caches one block past the aligned boundary).
    pub fn use_eagle(&self) -> bool {
        self.eagle.group
    }

    /// Recompute the admission cap for these lengths (`max_admission_blocks`).
    pub fn set_admission_cap(&mut self, max_in_flight_tokens: u64, max_model_len: u64) {
        self.admission_cap = self
            .spec
            .max_admission_blocks(max_in_flight_tokens, max_model_len);
    }

    pub fn spec(&self) -> &GroupSpec {
        &self.spec
    }

    pub fn group_id(&self) -> u32 {
        self.group_id
    }

    pub fn block_size(&self) -> u32 {
        self.spec.block_size
    }

    /// The request's table (empty for an unknown request).
    pub fn blocks(&self, req: &str) -> &[u32] {
        self.reqs.get(req).map_or(&[], |r| &r.blocks)
    }

    /// vLLM's `num_cached_block[req]` (`None`: not tracked).
    pub fn num_cached_blocks(&self, req: &str) -> Option<u32> {
        self.reqs.get(req).and_then(|r| r.num_cached)
    }

    pub fn is_running(&self, req: &str) -> bool {
        self.num_cached_blocks(req).is_some()
    }

    pub fn num_requests(&self) -> usize {
        self.reqs.len()
    }

    fn skipped_blocks(&self, num_computed_tokens: u64) -> u64 {
        self.spec.num_skipped_tokens(num_computed_tokens) / u64::from(self.spec.block_size)
    }

    /// vLLM's `get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
    /// total_computed_tokens, ..., apply_admission_cap)` for this group.
    pub fn num_blocks_to_allocate(
        &self,
        pool: &Pool,
        req: &str,
        num_tokens: u64,
        new_computed: &[u32],
        total_computed_tokens: u64,
        apply_admission_cap: bool,
    ) -> Result<u64> {
        let num_tokens = self.spec.slot_tokens(num_tokens);
        let mut required = num_tokens.div_ceil(u64::from(self.spec.block_size));
        if apply_admission_cap {
            if let Some(cap) = self.admission_cap {
                required = required.min(cap);
            }
        }
        let r = self.reqs.get(req);
        let running = r.is_some_and(|r| r.num_cached.is_some());
        if running && !new_computed.is_empty() {
            return Err(Error::invalid(format!(
                "request {req} is running: it cannot adopt prefix-cache blocks"
            )));
        }
        let held = r.map_or(0, |r| r.blocks.len()) as u64;
        Ok(blocks_to_allocate(
            pool,
            required,
            held,
            running,
            new_computed,
            self.skipped_blocks(total_computed_tokens),
        ))
    }

    /// A Mamba align group's `get_num_blocks_to_allocate` ([`super::mamba_align`]), recording
    /// the chunk's checkpoint as vLLM does; `None` for every other kind.
    pub fn align_count(&mut self, pool: &Pool, req: &str, a: &CountArgs) -> Option<i64> {
        let g = self.align.as_ref()?;
        let deferred = g.defers(pool, a.new_computed);
        let r = self.reqs.entry_ref(req).or_default();
        let (n, record) = g.rules.count(pool, &r.blocks, &r.align, a, deferred);
        if let Some(c) = record {
            r.align.checkpoint = c;
        }
        Some(n)
    }

    /// vLLM's `new_step_starts`: a Mamba align group forgets what it cached this step.
    pub fn new_step_starts(&mut self) {
        if let Some(g) = self.align.as_mut() {
            g.cached_this_step.clear();
        }
    }

    /// Whether this is a Mamba align group (its tables may hold inner null blocks).
    pub fn is_mamba_align(&self) -> bool {
        self.align.is_some()
    }

    /// vLLM's `add_local_computed_blocks` (no external tokens): the hit's skipped blocks become
    /// null blocks, the rest are touched and adopted; the request becomes tracked.
    pub fn add_local_computed_blocks(
        &mut self,
        pool: &mut Pool,
        req: &str,
        new_computed: &[u32],
        num_local_computed_tokens: u64,
    ) -> Result<()> {
        if !self.blocks(req).is_empty() {
            return Err(Error::invalid(format!(
                "request {req} holds blocks: it cannot adopt prefix-cache blocks"
            )));
        }
        if !self.caching && new_computed.iter().any(|&b| b != NULL_BLOCK) {
            return Err(Error::invalid("computed blocks without prefix caching"));
        }
        self.adopt_computed_blocks(pool, req, new_computed, num_local_computed_tokens);
        Ok(())
    }

    /// How adopting the hit `new_computed` over `num_local_computed_tokens` changes the
    /// request's (empty) table: its length then, and the hit's blocks it touches (those past
    /// the skipped ones, which become null blocks).
    pub fn adoption<'a>(
        &self,
        new_computed: &'a [u32],
        num_local_computed_tokens: u64,
    ) -> (usize, &'a [u32]) {
        let skipped = self.skipped_blocks(num_local_computed_tokens) as usize;
        let kept = &new_computed[skipped.min(new_computed.len())..];
        (skipped.max(new_computed.len()), kept)
    }

    /// [`Self::add_local_computed_blocks`] once its checks hold (the request holds no block;
    /// no real block without caching): it cannot fail.
    pub fn adopt_computed_blocks(
        &mut self,
        pool: &mut Pool,
        req: &str,
        new_computed: &[u32],
        num_local_computed_tokens: u64,
    ) {
        let (len, kept) = self.adoption(new_computed, num_local_computed_tokens);
        if self.caching {
            pool.touch(kept);
        }
        let r = self.reqs.entry_ref(req).or_default();
        r.blocks.resize(len - kept.len(), NULL_BLOCK);
        r.blocks.extend_from_slice(kept);
        r.num_cached = Some(r.blocks.len() as u32);
    }

    /// vLLM's `allocate_new_blocks`: enough blocks for `num_tokens` slots, from the queue's
    /// head, appended to the table; returns the new ones. A call that fails changes nothing.
    pub fn allocate_new_blocks(
        &mut self,
        pool: &mut Pool,
        req: &str,
        num_tokens: u64,
        num_tokens_main: u64,
    ) -> Result<Vec<u32>> {
        let plan =
            self.plan_new_blocks(req, self.blocks(req).len(), num_tokens, num_tokens_main)?;
        if plan.num_new() > pool.num_free() {
            return Err(Error::OutOfBlocks {
                device: "gpu",
                needed: plan.num_new(),
                free: pool.num_free(),
            });
        }
        Ok(self.apply_new_blocks(pool, req, &plan))
    }

    /// Plan `allocate_new_blocks(req, num_tokens, num_tokens_main)` for the request holding
    /// `held` table entries by then (it may adopt a hit first). Nothing changes; it fails
    /// only where vLLM asserts (a Mamba align step past its cap).
    pub fn plan_new_blocks(
        &self,
        req: &str,
        held: usize,
        num_tokens: u64,
        num_tokens_main: u64,
    ) -> Result<NewBlocks> {
        if let Some(g) = self.align.as_ref() {
            let st = self.reqs.get(req).map(|r| r.align).unwrap_or_default();
            return g
                .rules
                .plan_allocate(held, &st, num_tokens_main)
                .map(NewBlocks::Align);
        }
        let num_tokens = self.spec.slot_tokens(num_tokens);
        let required = num_tokens.div_ceil(u64::from(self.spec.block_size)) as usize;
        Ok(NewBlocks::Plain(required.saturating_sub(held)))
    }

    /// Apply a [`NewBlocks`] planned for the request's table as it now is, the pool holding
    /// its new blocks free (the caller checked [`NewBlocks::num_new`]): it cannot fail.
    /// Returns the entries appended; the request becomes known (vLLM's `req_to_blocks` is a
    /// defaultdict).
    pub fn apply_new_blocks(&mut self, pool: &mut Pool, req: &str, plan: &NewBlocks) -> Vec<u32> {
        let r = self.reqs.entry_ref(req).or_default();
        match (plan, self.align.as_ref()) {
            (NewBlocks::Align(a), Some(g)) => {
                g.rules.apply_allocate(pool, &mut r.blocks, &mut r.align, a)
            }
            (NewBlocks::Plain(n), None) => {
                let have = r.blocks.len();
                pool.get_new_blocks(*n, &mut r.blocks)
                    .expect("the caller checked the pool's free blocks");
                r.blocks[have..].to_vec()
            }
            _ => unreachable!("a plan is made by its own group"),
        }
    }

    /// Read the hashes a `cache_blocks(req, num_tokens)` call would cache, the request then
    /// holding `held` blocks and its first uncached one being `first`, and which of them its
    /// `boundaries` retain (nothing changes).
    /// vLLM 0.33 caps the full blocks at the hashes the request has; 0.32 does not, and raises
    /// IndexError past them, which the cap turns into caching fewer (callers keep within).
    pub fn plan_cache(
        &self,
        first: u32,
        held: usize,
        num_tokens: u64,
        boundaries: Boundaries,
        hashes: &mut dyn HashSource,
    ) -> Result<CachePlan> {
        let mut plan = CachePlan {
            first,
            ..Default::default()
        };
        if !self.caching {
            return Ok(plan);
        }
        let count = hashes.count()?;
        let hashed = count as u64 * u64::from(self.hash_block_size);
        let full = (num_tokens.min(hashed) / u64::from(self.spec.block_size)) as usize;
        if full <= first as usize {
            return Ok(plan);
        }
        // A table shorter than its full blocks (tokens past max_model_len): cache what it has.
        let full = full.min(held.max(first as usize));
        if full as u64 * u64::from(self.spec.block_size) > u64::from(u32::MAX) {
            return Err(Error::invalid(format!(
                "a cached block would cover {} tokens; at most 2**32 - 1 are counted",
                full as u64 * u64::from(self.spec.block_size)
            )));
        }
        let mut view = View {
            hashes,
            scale: (self.spec.block_size / self.hash_block_size) as usize,
        };
        for i in first as usize..full {
            plan.keys.push(view.key(i)?);
        }
        plan.retained = Retained::new(
            &self.spec,
            self.retention,
            self.alignment,
            boundaries,
            self.eagle,
        );
        plan.active = true;
        Ok(plan)
    }

    /// A Mamba align group's tail reads for `cache_blocks(req, num_tokens)` (`None` for every
    /// other kind).
    pub fn plan_tail(
        &self,
        req: &str,
        num_tokens: u64,
        boundaries: Boundaries,
        hashes: &mut dyn HashSource,
    ) -> Result<Option<TailPlan>> {
        let Some(g) = self.align.as_ref() else {
            return Ok(None);
        };
        let st = self.reqs.get(req).map(|r| r.align).unwrap_or_default();
        g.rules
            .plan_tail(&st, num_tokens, boundaries, hashes)
            .map(Some)
    }

    /// Apply a [`CachePlan`] (vLLM's `cache_blocks` after its reads): cache the planned
    /// blocks this kind can serve hits from and count them cached; a Mamba align group then
    /// caches its tail and notes what it cached this step.
    pub fn apply_cache(&mut self, pool: &mut Pool, req: &str, plan: &CachePlan) {
        let Some(r) = self.reqs.get_mut(req) else {
            return;
        };
        let before = r.num_cached.unwrap_or(0) as usize;
        if plan.active {
            cache_full_blocks(
                pool,
                self.group_id,
                self.spec.block_size,
                &r.blocks,
                plan.first,
                &plan.keys,
                |i| plan.retained.contains(i),
            );
            r.num_cached = Some(plan.first + plan.keys.len() as u32);
        }
        if let (Some(g), Some(tail)) = (self.align.as_mut(), plan.tail.as_ref()) {
            let ctx = TailCtx {
                group: self.group_id,
                retention: self.retention,
                v033: self.release == Release::V033,
            };
            g.cache_tail(pool, &r.blocks, &r.align, tail, ctx);
            let after = r.num_cached.unwrap_or(0) as usize;
            g.note_cached(pool, &r.blocks, before, after);
        }
    }

    /// vLLM's `cache_blocks(request, num_tokens)`, the request at `boundaries`.
    pub fn cache_blocks(
        &mut self,
        pool: &mut Pool,
        req: &str,
        num_tokens: u64,
        boundaries: Boundaries,
        hashes: &mut dyn HashSource,
    ) -> Result<()> {
        let first = self.num_cached_blocks(req).unwrap_or(0);
        let mut plan = self.plan_cache(
            first,
            self.blocks(req).len(),
            num_tokens,
            boundaries,
            hashes,
        )?;
        plan.tail = self.plan_tail(req, num_tokens, boundaries, hashes)?;
        self.apply_cache(pool, req, &plan);
        Ok(())
    }

    /// vLLM's `remove_skipped_blocks(request_id, processed_computed_tokens)`: the blocks
    /// wholly skipped become the null block, freed from the last one back to the first
    /// already null (so in descending position: the latest skipped is evicted first).
    pub fn remove_skipped_blocks(
        &mut self,
        pool: &mut Pool,
        req: &str,
        processed_computed_tokens: u64,
    ) -> Result<()> {
        if let Some(g) = self.align.as_ref() {
            let Some(r) = self.reqs.get_mut(req) else {
                return Ok(());
            };
            return g.rules.remove_skipped(
                pool,
                &mut r.blocks,
                &mut r.align,
                processed_computed_tokens,
            );
        }
        let skipped = self.skipped_blocks(processed_computed_tokens) as usize;
        if skipped == 0 {
            return Ok(());
        }
        let Some(r) = self.reqs.get_mut(req) else {
            return Ok(());
        };
        let end = skipped.min(r.blocks.len());
        let mut freed = Vec::new();
        for b in r.blocks[..end].iter().rev() {
            if *b == NULL_BLOCK {
                break;
            }
            freed.push(*b);
        }
        pool.free_blocks(freed.iter().copied())?;
        let n = freed.len();
        r.blocks[end - n..end].fill(NULL_BLOCK);
        Ok(())
    }

    /// vLLM's `pop_blocks_for_free`: forget the request, hand back its table without freeing
    /// it. 0.33 leaves out the leading null blocks (`trim_null_head`); 0.32 returns them too.
    pub fn pop_blocks_for_free(&mut self, req: &str, release: Release) -> Vec<u32> {
        let blocks = self.reqs.remove(req).map(|r| r.blocks).unwrap_or_default();
        match release {
            Release::V032 => blocks,
            Release::V033 => {
                let nulls = blocks.iter().take_while(|&&b| b == NULL_BLOCK).count();
                blocks[nulls..].to_vec()
            }
        }
    }

    /// vLLM's `free(request)`: the table goes back last block first (null blocks skipped).
    pub fn free(&mut self, pool: &mut Pool, req: &str, release: Release) -> Result<()> {
        let blocks = self.pop_blocks_for_free(req, release);
        pool.free_blocks(blocks.iter().rev().copied())
    }

    /// Every request's table (tests and accounting).
    pub fn tables(&self) -> impl Iterator<Item = (&str, &[u32])> {
        self.reqs.iter().map(|(k, r)| (&**k, &r.blocks[..]))
    }

    /// Heap bytes held (memory accounting).
    pub fn heap_bytes(&self) -> usize {
        use crate::mem::{table_bytes, vec_bytes};
        let per_req: usize = self
            .reqs
            .iter()
            .map(|(k, r)| k.len() + vec_bytes(&r.blocks))
            .sum();
        per_req
            + self.align.as_ref().map_or(0, AlignGroup::heap_bytes)
            + table_bytes(
                self.reqs.capacity(),
                std::mem::size_of::<(Box<str>, ReqBlocks)>(),
            )
    }
}
