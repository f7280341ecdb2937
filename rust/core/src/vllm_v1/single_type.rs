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
//! [`super::retention`]) and `free`. This module holds what the kinds share: this file the
//! specs, the group manager and its table bookkeeping (skipping, freeing);
//! `single_type/hit.rs` the lookup's driver; `single_type/allocate.rs` the block counting and
//! allocation; `single_type/cache.rs` the caching. Each kind's own rules (its skipped tokens,
//! admission cap and lookup) are in a file of its own: [`super::full_attention`],
//! [`super::sliding_window`], [`super::chunked_local`], [`super::mamba`]. The single-group
//! [`super::manager::Manager`] is the full-attention path of this module with one group: it
//! calls the shared pieces ([`cached_prefix`], [`blocks_to_allocate`], [`cache_full_blocks`])
//! rather than a copy of them.
//!
//! EAGLE/MTP's last-block drop is here ([`find_longest_cache_hit_eagle`], the group's
//! [`GroupEagle`]; the rules in [`super::eagle`]). Scope (what the callers must rule out, as
//! `pagedkv.vllm_v1`'s scope does for the single group): EAGLE never with chunked local
//! attention (vLLM asserts), no KV connector's external tokens beside a Mamba group (attention
//! groups take them: [`GroupManager::external_blocks`]), no context parallelism,
//! no fine-grained partial hash hits (they need a Mamba "align" group with blocks larger than
//! the hash block), no R-SWA, sink, circular-buffer, cross-attention or HiSparse groups, and
//! full-attention groups only at the hash block size: with larger blocks vLLM's
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
//! allocated, cached or freed); a request's state is an index away ([`ReqSlot`], which the
//! coordinator looks up once per call). 4 B per table entry plus one state per slot.

use super::eagle::GroupEagle;
use super::engine::Release;
use super::mamba_align::{self, AlignGroup, AlignReq, AlignRules};
use super::pool::{Pool, NULL_BLOCK};
use super::retention::Retention;
use super::{chunked_local, mamba, sliding_window};
use crate::error::{Error, Result};

mod allocate;
mod cache;
mod hit;

pub(crate) use allocate::blocks_to_allocate;
pub use allocate::NewBlocks;
pub(crate) use cache::cache_full_blocks;
pub use cache::CachePlan;
pub(crate) use hit::cached_prefix;
pub(super) use hit::{cached_in_all, HitSearch, View};
pub use hit::{find_longest_cache_hit, find_longest_cache_hit_eagle};

/// The attention kinds a group can serve (vLLM's `KVCacheSpec` subclasses mirrored here).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// `FullAttentionSpec`: every token attends to every earlier one.
    Full,
    /// `SlidingWindowSpec`: a token attends to the `sliding_window` tokens ending at it;
    /// `extra_retained_tokens` more below the window stay held (never attended): vLLM tags
    /// every window with `num_prefill_lookahead_tokens - 1` under multi-module MTP, whose
    /// drafter may re-prefill that many tokens.
    SlidingWindow {
        sliding_window: u32,
        extra_retained_tokens: u32,
    },
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
            AttentionKind::SlidingWindow {
                sliding_window: 0, ..
            } => Err(Error::invalid("sliding_window must be positive")),
            AttentionKind::SlidingWindow {
                sliding_window,
                extra_retained_tokens,
            } if sliding_window.checked_add(extra_retained_tokens).is_none() => {
                Err(Error::invalid(format!(
                    "sliding_window {sliding_window} plus extra_retained_tokens \
                     {extra_retained_tokens} exceeds {}",
                    u32::MAX
                )))
            }
            AttentionKind::ChunkedLocal {
                attention_chunk_size: 0,
            } => Err(Error::invalid("attention_chunk_size must be positive")),
            _ => Ok(()),
        }
    }

    /// vLLM's `get_num_skipped_tokens(num_computed_tokens)`: the leading tokens no later
    /// token attends to (full: none; sliding window: all but the last `sliding_window - 1`
    /// and the `extra_retained_tokens` below them; chunked local: every token before the
    /// current chunk).
    pub fn num_skipped_tokens(&self, num_computed_tokens: u64) -> u64 {
        match self.kind {
            AttentionKind::Full => 0,
            AttentionKind::SlidingWindow {
                sliding_window,
                extra_retained_tokens,
            } => sliding_window::num_skipped_tokens(
                sliding_window + extra_retained_tokens,
                num_computed_tokens,
            ),
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
            AttentionKind::SlidingWindow {
                sliding_window,
                extra_retained_tokens,
            } => Some(sliding_window::max_admission_blocks(
                sliding_window + extra_retained_tokens,
                bs,
                in_flight,
                max_len,
            )),
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

/// A request's index in every group's request table, assigned by the coordinator when the
/// request first needs state ([`super::coordinator::Hybrid`] looks the id up once per call;
/// each group then indexes). [`ReqSlot::UNKNOWN`] is no group's request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReqSlot(pub u32);

impl ReqSlot {
    /// A request no group holds (reads see an unknown request; it is never written).
    pub const UNKNOWN: ReqSlot = ReqSlot(u32::MAX);
}

#[derive(Clone, Debug, Default)]
struct ReqBlocks {
    blocks: Vec<u32>,
    num_cached: Option<u32>,
    /// A Mamba align group's per-request bookkeeping (unused by the other kinds).
    align: AlignReq,
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
    /// Per [`ReqSlot`], the request's state here.
    reqs: ReqTable,
}

/// A group's request states indexed by [`ReqSlot`] (`None`: unknown to this group, as absent
/// from vLLM's `req_to_blocks`). Its methods borrow only the table, so a caller may hold the
/// group's rules beside a request's state.
#[derive(Clone, Debug, Default)]
struct ReqTable(Vec<Option<ReqBlocks>>);

impl ReqTable {
    fn get(&self, slot: ReqSlot) -> Option<&ReqBlocks> {
        self.0.get(slot.0 as usize).and_then(Option::as_ref)
    }

    fn get_mut(&mut self, slot: ReqSlot) -> Option<&mut ReqBlocks> {
        self.0.get_mut(slot.0 as usize).and_then(Option::as_mut)
    }

    /// The request's state, made known if it was not (vLLM's `req_to_blocks` is a
    /// defaultdict). `slot` is one the coordinator assigned, never [`ReqSlot::UNKNOWN`].
    fn entry(&mut self, slot: ReqSlot) -> &mut ReqBlocks {
        debug_assert_ne!(
            slot,
            ReqSlot::UNKNOWN,
            "a request is made known only at its slot"
        );
        let i = slot.0 as usize;
        if i >= self.0.len() {
            self.0.resize_with(i + 1, || None);
        }
        self.0[i].get_or_insert_with(ReqBlocks::default)
    }

    /// Forget the request; its state, if it was known.
    fn take(&mut self, slot: ReqSlot) -> Option<ReqBlocks> {
        self.0.get_mut(slot.0 as usize).and_then(Option::take)
    }

    /// Every known request's state, by slot.
    fn known(&self) -> impl Iterator<Item = (ReqSlot, &ReqBlocks)> {
        let all = self.0.iter().enumerate();
        all.filter_map(|(i, r)| r.as_ref().map(|r| (ReqSlot(i as u32), r)))
    }

    fn heap_bytes(&self) -> usize {
        use crate::mem::vec_bytes;
        let tables: usize = self.known().map(|(_, r)| vec_bytes(&r.blocks)).sum();
        tables + vec_bytes(&self.0)
    }
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
            reqs: ReqTable::default(),
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
    pub fn blocks(&self, slot: ReqSlot) -> &[u32] {
        self.reqs.get(slot).map_or(&[], |r| &r.blocks)
    }

    /// vLLM's `num_cached_block[req]` (`None`: not tracked).
    pub fn num_cached_blocks(&self, slot: ReqSlot) -> Option<u32> {
        self.reqs.get(slot).and_then(|r| r.num_cached)
    }

    pub fn is_running(&self, slot: ReqSlot) -> bool {
        self.num_cached_blocks(slot).is_some()
    }

    /// The requests this group knows. O(slots).
    pub fn num_requests(&self) -> usize {
        self.reqs.known().count()
    }

    fn skipped_blocks(&self, num_computed_tokens: u64) -> u64 {
        self.spec.num_skipped_tokens(num_computed_tokens) / u64::from(self.spec.block_size)
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

    /// vLLM's `remove_skipped_blocks(request_id, processed_computed_tokens)`: the blocks
    /// wholly skipped become the null block, freed from the last one back to the first
    /// already null (so in descending position: the latest skipped is evicted first).
    pub fn remove_skipped_blocks(
        &mut self,
        pool: &mut Pool,
        slot: ReqSlot,
        processed_computed_tokens: u64,
    ) -> Result<()> {
        if let Some(g) = self.align.as_ref() {
            let Some(r) = self.reqs.get_mut(slot) else {
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
        let Some(r) = self.reqs.get_mut(slot) else {
            return Ok(());
        };
        let end = skipped.min(r.blocks.len());
        let skipped = &mut r.blocks[..end];
        let n = skipped
            .iter()
            .rev()
            .take_while(|&&b| b != NULL_BLOCK)
            .count();
        if n == 0 {
            return Ok(());
        }
        pool.free_blocks(skipped[end - n..].iter().rev().copied())?;
        skipped[end - n..].fill(NULL_BLOCK);
        Ok(())
    }

    /// vLLM's `pop_blocks_for_free`: forget the request, hand back its table without freeing
    /// it. 0.33 leaves out the leading null blocks (`trim_null_head`); 0.32 returns them too.
    pub fn pop_blocks_for_free(&mut self, slot: ReqSlot, release: Release) -> Vec<u32> {
        let blocks = self.reqs.take(slot).map(|r| r.blocks).unwrap_or_default();
        match release {
            Release::V032 => blocks,
            Release::V033 => {
                let nulls = blocks.iter().take_while(|&&b| b == NULL_BLOCK).count();
                blocks[nulls..].to_vec()
            }
        }
    }

    /// vLLM's `free(request)`: the table goes back last block first (null blocks skipped).
    pub fn free(&mut self, pool: &mut Pool, slot: ReqSlot, release: Release) -> Result<()> {
        let blocks = self.pop_blocks_for_free(slot, release);
        pool.free_blocks(blocks.iter().rev().copied())
    }

    /// Every known request's table by slot (tests and accounting).
    pub fn tables(&self) -> impl Iterator<Item = (ReqSlot, &[u32])> {
        self.reqs.known().map(|(slot, r)| (slot, &r.blocks[..]))
    }

    /// Heap bytes held (memory accounting).
    pub fn heap_bytes(&self) -> usize {
        self.reqs.heap_bytes() + self.align.as_ref().map_or(0, AlignGroup::heap_bytes)
    }
}
