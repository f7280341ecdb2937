//! A group manager's caching: vLLM's `cache_blocks` ([`GroupManager::cache_blocks`]), split
//! into its reads ([`GroupManager::plan_cache`] and [`GroupManager::plan_tail`], into a
//! [`CachePlan`]; nothing changes) and its writes ([`GroupManager::apply_cache`], which cannot
//! fail); and `BlockPool.cache_full_blocks` ([`cache_full_blocks`], which the single-group
//! [`crate::vllm_v1::manager::Manager`] calls too): which blocks each retention mode keeps
//! ([`crate::vllm_v1::retention`]), a Mamba align group's prompt tail
//! ([`crate::vllm_v1::mamba_align`]), the `Stored` / `StoredIn` event.
//!
//! Invariants: `num_cached` counts the table's leading blocks that are cached or skipped
//! (vLLM's `num_cached_block`); a newly full block has no hash yet, so caching it cannot fail.
//!
//! Costs: O(blocks cached), one hash read each.

use super::hit::View;
use super::{GroupManager, ReqSlot};
use crate::error::{Error, Result};
use crate::vllm_v1::engine::Release;
use crate::vllm_v1::mamba_align::{TailCtx, TailPlan};
use crate::vllm_v1::manager::HashSource;
use crate::vllm_v1::pool::{Event, HashKey, Pool, NULL_BLOCK};
use crate::vllm_v1::retention::{Boundaries, BoundarySource, Retained};

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

impl GroupManager {
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
        boundaries: BoundarySource,
        hashes: &mut dyn HashSource,
    ) -> Result<CachePlan> {
        let mut plan = CachePlan {
            first,
            ..Default::default()
        };
        // No block past `first` can become full below the tokens' own full blocks: then no
        // hash is read (the caller's hashes may cost a call into Python).
        if !self.caching || num_tokens / u64::from(self.spec.block_size) <= u64::from(first) {
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
            boundaries.get()?,
            self.eagle,
        );
        plan.active = true;
        Ok(plan)
    }

    /// A Mamba align group's tail reads for `cache_blocks(req, num_tokens)` (`None` for every
    /// other kind).
    pub fn plan_tail(
        &self,
        slot: ReqSlot,
        num_tokens: u64,
        boundaries: BoundarySource,
        hashes: &mut dyn HashSource,
    ) -> Result<Option<TailPlan>> {
        let Some(g) = self.align.as_ref() else {
            return Ok(None);
        };
        let st = self.reqs.get(slot).map(|r| r.align).unwrap_or_default();
        g.rules
            .plan_tail(&st, num_tokens, boundaries.get()?, hashes)
            .map(Some)
    }

    /// Apply a [`CachePlan`] (vLLM's `cache_blocks` after its reads): cache the planned
    /// blocks this kind can serve hits from and count them cached; a Mamba align group then
    /// caches its tail and notes what it cached this step.
    pub fn apply_cache(&mut self, pool: &mut Pool, slot: ReqSlot, plan: &CachePlan) {
        let Some(r) = self.reqs.get_mut(slot) else {
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
        slot: ReqSlot,
        num_tokens: u64,
        boundaries: Boundaries,
        hashes: &mut dyn HashSource,
    ) -> Result<()> {
        let first = self.num_cached_blocks(slot).unwrap_or(0);
        let boundaries = BoundarySource::Given(boundaries);
        let mut plan = self.plan_cache(
            first,
            self.blocks(slot).len(),
            num_tokens,
            boundaries,
            hashes,
        )?;
        plan.tail = self.plan_tail(slot, num_tokens, boundaries, hashes)?;
        self.apply_cache(pool, slot, &plan);
        Ok(())
    }
}
