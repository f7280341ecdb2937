//! A group manager's block counting and allocation: vLLM's `get_num_blocks_to_allocate`
//! ([`GroupManager::num_blocks_to_allocate`], its arithmetic in [`blocks_to_allocate`], which
//! the single-group [`crate::vllm_v1::manager::Manager`] calls too; a Mamba align group's own
//! count in [`GroupManager::align_count`]), `add_local_computed_blocks` (adopting a hit) and
//! `allocate_new_blocks`, each allocation planned before anything changes ([`NewBlocks`]) and
//! then applied.
//!
//! Invariants: an adopted hit's skipped blocks become null blocks leading the table, and the
//! request becomes tracked (`num_cached` set); applying a plan cannot fail (its caller checked
//! the pool's free blocks); a call that fails changes nothing.
//!
//! Costs: O(blocks allocated or adopted).

use super::{GroupManager, ReqSlot};
use crate::error::{Error, Result};
use crate::vllm_v1::mamba_align::{AlignAlloc, CountArgs};
use crate::vllm_v1::pool::{Pool, NULL_BLOCK};

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

impl GroupManager {
    /// vLLM's `get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
    /// total_computed_tokens, ..., apply_admission_cap)` for this group.
    pub fn num_blocks_to_allocate(
        &self,
        pool: &Pool,
        slot: ReqSlot,
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
        let r = self.reqs.get(slot);
        let running = r.is_some_and(|r| r.num_cached.is_some());
        if running && !new_computed.is_empty() {
            return Err(Error::invalid(
                "a running request cannot adopt prefix-cache blocks",
            ));
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

    /// A Mamba align group's `get_num_blocks_to_allocate` ([`crate::vllm_v1::mamba_align`]),
    /// recording the chunk's checkpoint as vLLM does; `None` for every other kind.
    pub fn align_count(&mut self, pool: &Pool, slot: ReqSlot, a: &CountArgs) -> Option<i64> {
        let g = self.align.as_ref()?;
        let deferred = g.defers(pool, a.new_computed);
        let r = self.reqs.entry(slot);
        let (n, record) = g.rules.count(pool, &r.blocks, &r.align, a, deferred);
        if let Some(c) = record {
            r.align.checkpoint = c;
        }
        Some(n)
    }

    /// vLLM's `add_local_computed_blocks` (no external tokens): the hit's skipped blocks become
    /// null blocks, the rest are touched and adopted; the request becomes tracked.
    pub fn add_local_computed_blocks(
        &mut self,
        pool: &mut Pool,
        slot: ReqSlot,
        new_computed: &[u32],
        num_local_computed_tokens: u64,
    ) -> Result<()> {
        if !self.blocks(slot).is_empty() {
            return Err(Error::invalid(
                "a request holding blocks cannot adopt prefix-cache blocks",
            ));
        }
        if !self.caching && new_computed.iter().any(|&b| b != NULL_BLOCK) {
            return Err(Error::invalid("computed blocks without prefix caching"));
        }
        self.adopt_computed_blocks(pool, slot, new_computed, num_local_computed_tokens);
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

    /// vLLM's `allocate_external_computed_blocks`: how many blocks the group takes for a
    /// connector's `external` tokens past `local` ones, its table holding `held` entries once
    /// the hit is adopted: up to the blocks all computed tokens fill, unless the window
    /// skips every external token (vLLM then takes none).
    pub fn external_blocks(&self, held: usize, local: u64, external: u64) -> usize {
        let computed = local.saturating_add(external);
        let skipped = self.spec.num_skipped_tokens(computed);
        let inside = match skipped {
            0 => external,
            _ => computed.saturating_sub(skipped).min(external),
        };
        if inside == 0 {
            return 0;
        }
        let bs = u64::from(self.spec.block_size);
        (computed.div_ceil(bs) as usize).saturating_sub(held)
    }

    /// [`Self::add_local_computed_blocks`] once its checks hold (the request holds no block;
    /// no real block without caching): it cannot fail.
    pub fn adopt_computed_blocks(
        &mut self,
        pool: &mut Pool,
        slot: ReqSlot,
        new_computed: &[u32],
        num_local_computed_tokens: u64,
    ) {
        let (len, kept) = self.adoption(new_computed, num_local_computed_tokens);
        if self.caching {
            pool.touch(kept);
        }
        let r = self.reqs.entry(slot);
        r.blocks.resize(len - kept.len(), NULL_BLOCK);
        r.blocks.extend_from_slice(kept);
        r.num_cached = Some(r.blocks.len() as u32);
    }

    /// vLLM's `allocate_new_blocks`: enough blocks for `num_tokens` slots, from the queue's
    /// head, appended to the table; returns the new ones. A call that fails changes nothing.
    pub fn allocate_new_blocks(
        &mut self,
        pool: &mut Pool,
        slot: ReqSlot,
        num_tokens: u64,
        num_tokens_main: u64,
    ) -> Result<Vec<u32>> {
        let plan =
            self.plan_new_blocks(slot, self.blocks(slot).len(), num_tokens, num_tokens_main)?;
        if plan.num_new() > pool.num_free() {
            return Err(Error::OutOfBlocks {
                device: "gpu",
                needed: plan.num_new(),
                free: pool.num_free(),
            });
        }
        Ok(self.apply_new_blocks(pool, slot, &plan))
    }

    /// Plan `allocate_new_blocks(req, num_tokens, num_tokens_main)` for the request holding
    /// `held` table entries by then (it may adopt a hit first). Nothing changes; it fails
    /// only where vLLM asserts (a Mamba align step past its cap).
    pub fn plan_new_blocks(
        &self,
        slot: ReqSlot,
        held: usize,
        num_tokens: u64,
        num_tokens_main: u64,
    ) -> Result<NewBlocks> {
        if let Some(g) = self.align.as_ref() {
            let st = self.reqs.get(slot).map(|r| r.align).unwrap_or_default();
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
    pub fn apply_new_blocks(
        &mut self,
        pool: &mut Pool,
        slot: ReqSlot,
        plan: &NewBlocks,
    ) -> Vec<u32> {
        let r = self.reqs.entry(slot);
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
}
