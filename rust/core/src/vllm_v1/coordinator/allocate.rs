//! The hybrid coordinator's block counting and allocation: vLLM's `get_num_blocks_to_allocate`,
//! `remove_skipped_blocks` and `new_step_starts` across groups, and `KVCacheManager.allocate_slots`
//! over them ([`Hybrid::allocate_slots`]: a KV connector's external tokens too, beside attention
//! groups only; no encoder tokens).
//!
//! ```text
//!   allocate_slots:  check the arguments (and an adopted hit) ->
//!                    admit (full-sequence gate, remove_skipped_blocks, count vs free) ->
//!                    plan (every hash read, every allocation checked) ->
//!                    apply (adopt the hit in every group, the connector's blocks in group
//!                    0, 1, ..., then the call's own in group 0, 1, ..., cache)
//! ```
//!
//! Invariants: a call that fails changes nothing but what vLLM too does before refusing
//! (blocks that left a window freed, Mamba align checkpoints recorded); applying a
//! [`SlotPlan`] cannot fail. A Mamba align group's count may be negative, or the pool's size
//! plus one to defer a hit on a state cached this step ([`crate::vllm_v1::mamba_align`]).
//!
//! Costs: O(groups + blocks moved), plus the hashes read for the blocks cached.

use super::{is_full, is_mamba, Count, Hybrid, HybridSlots};
use crate::error::{Error, Result};
use crate::vllm_v1::mamba_align::CountArgs;
use crate::vllm_v1::manager::HashSource;
use crate::vllm_v1::pool::NULL_BLOCK;
use crate::vllm_v1::retention::Retention;
use crate::vllm_v1::single_type::{CachePlan, GroupManager, NewBlocks, ReqSlot};

/// One `allocate_slots` call's token counts (vLLM's names) and watermark.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    /// `num_local_computed_tokens`.
    local: u64,
    /// `num_external_computed_tokens`.
    external: u64,
    /// Local and external computed tokens, uncapped (what the groups skip by).
    computed: u64,
    /// `total_computed_tokens` (at most `max_model_len`).
    total: u64,
    /// `num_tokens_main_model`.
    main: u64,
    /// `num_tokens_need_slot`.
    need_slots: u64,
    prefill_end: u64,
    /// The watermark in blocks (0 unless it applies to this request).
    watermark: i64,
}

/// What an admitted `allocate_slots` call does, planned and checked before anything changes.
/// The coordinator keeps one between calls and refills it (no allocation per call).
#[derive(Clone, Debug, Default)]
pub(super) struct SlotPlan {
    /// The request adopts the call's hit.
    adopt: bool,
    /// Per group, its table's length once the hit is adopted.
    held: Vec<usize>,
    /// Per group, the blocks it takes for the connector's tokens after adopting the hit.
    external: Vec<usize>,
    /// Per group, what it caches (none: `delay_cache_blocks`).
    caches: Vec<CachePlan>,
    /// Per group, what it allocates.
    allocs: Vec<NewBlocks>,
}

impl SlotPlan {
    fn clear(&mut self) {
        self.adopt = false;
        self.held.clear();
        self.external.clear();
        self.caches.clear();
        self.allocs.clear();
    }

    /// Heap bytes of the (cleared) buffers.
    pub(super) fn heap_bytes(&self) -> usize {
        use crate::mem::vec_bytes;
        vec_bytes(&self.held)
            + vec_bytes(&self.external)
            + vec_bytes(&self.caches)
            + vec_bytes(&self.allocs)
    }
}

impl Hybrid {
    /// vLLM's `get_num_blocks_to_allocate` across groups: the sum of every group's count (a
    /// Mamba align group's may be negative, or the pool's size plus one to defer a hit on a
    /// state cached this step; it records the chunk's checkpoint, as vLLM does).
    pub fn num_blocks_to_allocate(
        &mut self,
        req: &str,
        c: &Count,
        new_computed: Option<&[Vec<u32>]>,
    ) -> Result<i64> {
        let slot = self.slot_to_count(req);
        self.count_blocks(slot, c, new_computed)
    }

    /// The slot a count reads: a Mamba align group records the chunk's checkpoint in the
    /// request's state, so the request becomes known there (vLLM's defaultdict); other groups
    /// only read.
    fn slot_to_count(&mut self, req: &str) -> ReqSlot {
        match self.has_mamba_align() {
            true => self.slots.get_or_insert(req),
            false => self.slots.get(req),
        }
    }

    /// [`Self::num_blocks_to_allocate`] for the request at `slot`.
    fn count_blocks(
        &mut self,
        slot: ReqSlot,
        c: &Count,
        new_computed: Option<&[Vec<u32>]>,
    ) -> Result<i64> {
        // vLLM's coordinator passes the prefill end only under retention 0.
        let prefill_end = match self.cfg.retention {
            Retention::Sparse { interval: 0 } => c.prefill_end,
            _ => 0,
        };
        let mut sum = 0i64;
        for (i, m) in self.managers.iter_mut().enumerate() {
            let nc = new_computed.map_or(&[][..], |nc| nc.get(i).map_or(&[][..], |v| &v[..]));
            let args = CountArgs {
                num_tokens_main: c.num_tokens_main,
                new_computed: nc,
                total_computed: c.total_computed,
                prefill_end,
                apply_admission_cap: c.apply_admission_cap,
            };
            if let Some(n) = m.align_count(&self.pool, slot, &args) {
                sum += n;
                continue;
            }
            let n = m.num_blocks_to_allocate(
                &self.pool,
                slot,
                c.num_tokens,
                nc,
                c.total_computed,
                c.apply_admission_cap,
            )?;
            sum += i64::try_from(n).unwrap_or(i64::MAX);
        }
        Ok(sum)
    }

    /// vLLM's `new_step_starts`: every Mamba align group forgets what it cached this step.
    pub fn new_step_starts(&mut self) {
        self.managers
            .iter_mut()
            .for_each(GroupManager::new_step_starts);
    }

    /// vLLM's `remove_skipped_blocks` across groups, in group order.
    pub fn remove_skipped_blocks(
        &mut self,
        req: &str,
        processed_computed_tokens: u64,
    ) -> Result<()> {
        let slot = self.slots.get(req);
        self.remove_skipped_at(slot, processed_computed_tokens)
    }

    fn remove_skipped_at(&mut self, slot: ReqSlot, processed_computed_tokens: u64) -> Result<()> {
        for m in &mut self.managers {
            m.remove_skipped_blocks(&mut self.pool, slot, processed_computed_tokens)?;
        }
        Ok(())
    }

    fn check_args(&self, req: &str, a: &HybridSlots) -> Result<()> {
        if a.num_new_tokens == 0
            && a.num_new_computed_tokens == 0
            && a.num_external_computed_tokens == 0
        {
            return Err(Error::invalid(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt",
            ));
        }
        // A request never has more computed tokens than max_model_len; the bound also keeps a
        // window's null padding (one entry per skipped block) within max_model_len's blocks,
        // and the connector's blocks within the blocks the call counts.
        let local = a
            .num_computed_tokens
            .saturating_add(a.num_new_computed_tokens);
        let computed = local.saturating_add(a.num_external_computed_tokens);
        if computed > self.cfg.max_model_len {
            return Err(Error::invalid(format!(
                "{computed} computed tokens (local and external) pass max_model_len {}",
                self.cfg.max_model_len
            )));
        }
        if a.num_external_computed_tokens > 0 {
            self.check_external(req)?;
        }
        // A Mamba align group sizes its table by the main-model tokens, uncapped (vLLM's
        // scheduler keeps them within max_model_len): bound them so a table stays bounded.
        let main = local.saturating_add(a.num_new_tokens);
        if main > self.cfg.max_model_len && self.has_mamba_align() {
            return Err(Error::invalid(format!(
                "{main} tokens pass max_model_len {} (a Mamba align group sizes its states by \
                 them)",
                self.cfg.max_model_len
            )));
        }
        match a.new_computed {
            Some(nc) => self.check_hit(req, a.num_new_computed_tokens, nc),
            None => Ok(()),
        }
    }

    /// Some group tracks the request (vLLM's `num_cached_block`): it is running and adopts no
    /// hit.
    fn is_running(&self, slot: ReqSlot) -> bool {
        self.managers.iter().any(|m| m.is_running(slot))
    }

    /// External (connector) tokens: beside attention groups only (a Mamba group's states are
    /// not modelled with them here), and not for a request that holds blocks no group tracks
    /// (vLLM asserts).
    fn check_external(&self, req: &str) -> Result<()> {
        let mamba = self.managers.iter().any(|m| is_mamba(m.spec()));
        if mamba || self.zeroing.is_some() {
            return Err(Error::invalid(
                "external (connector) tokens beside a Mamba group are outside pagedkv's manager",
            ));
        }
        let slot = self.slots.get(req);
        let running = self.is_running(slot);
        if !running && self.managers.iter().any(|m| !m.blocks(slot).is_empty()) {
            return Err(Error::invalid(format!(
                "request {req} holds blocks: it cannot take external (connector) tokens"
            )));
        }
        Ok(())
    }

    /// An adopted hit is what `find_longest_cache_hit` makes: one list per group, none for a
    /// running request (or one already holding blocks), each `hit tokens / block_size` long,
    /// its blocks cached in that group, null blocks only leading and only in a group that
    /// skips tokens. Checked before anything changes; O(blocks listed).
    fn check_hit(&self, req: &str, tokens: u64, nc: &[Vec<u32>]) -> Result<()> {
        if nc.len() != self.managers.len() {
            return Err(Error::invalid(format!(
                "a hit for {} groups, the coordinator has {}",
                nc.len(),
                self.managers.len()
            )));
        }
        let any = nc.iter().any(|g| !g.is_empty());
        let slot = self.slots.get(req);
        if self.is_running(slot) {
            return match any {
                true => Err(Error::invalid(format!(
                    "request {req} is running: it cannot adopt prefix-cache blocks"
                ))),
                false => Ok(()),
            };
        }
        if self.managers.iter().any(|m| !m.blocks(slot).is_empty()) {
            return Err(Error::invalid(format!(
                "request {req} holds blocks: it cannot adopt prefix-cache blocks"
            )));
        }
        if any && !self.cfg.enable_caching {
            return Err(Error::invalid("computed blocks without prefix caching"));
        }
        for (m, blocks) in self.managers.iter().zip(nc) {
            self.check_group_hit(m, tokens, blocks)?;
        }
        Ok(())
    }

    fn check_group_hit(&self, m: &GroupManager, tokens: u64, blocks: &[u32]) -> Result<()> {
        let group = m.group_id();
        if !blocks.is_empty() && blocks.len() as u64 * u64::from(m.block_size()) != tokens {
            return Err(Error::invalid(format!(
                "num_new_computed_tokens ({tokens}) must cover group {group}'s {} adopted \
                 blocks exactly",
                blocks.len()
            )));
        }
        let nulls = blocks.iter().take_while(|&&b| b == NULL_BLOCK).count();
        if nulls > 0 && is_full(m.spec()) {
            return Err(Error::invalid(format!(
                "group {group} (full attention) cannot adopt the null block"
            )));
        }
        for &b in &blocks[nulls..] {
            self.pool.check_block(i64::from(b))?;
            let cached_here = self.pool.hash_of(b).is_some() && self.pool.group_of(b) == group;
            if b == NULL_BLOCK || !cached_here {
                return Err(Error::invalid(format!(
                    "block {b} is not a cached block of group {group}"
                )));
            }
        }
        Ok(())
    }

    /// vLLM's `KVCacheManager.allocate_slots` over this coordinator (no external tokens, no
    /// encoder tokens): `Ok(None)` when the blocks do not fit, else the new blocks per group.
    ///
    /// Checked, then admitted (`admit`: as in vLLM, blocks that left the window are
    /// freed and Mamba align checkpoints recorded before the fit is checked, so a refused call
    /// may still have done those), then planned (`plan_slots`: every hash read, every
    /// group's allocation checked, the pool's free blocks included) and only then applied
    /// (`apply_slots`, which cannot fail): a call that fails changes nothing else.
    pub fn allocate_slots(
        &mut self,
        req: &str,
        a: &HybridSlots,
        hashes: &mut dyn HashSource,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        self.check_args(req, a)?;
        let s = self.sizes(a)?;
        let counted = self.slot_to_count(req);
        if !self.admit(counted, a, &s)? {
            return Ok(None);
        }
        // Admitted: the request is known from here on (it holds blocks once applied).
        let slot = match counted {
            ReqSlot::UNKNOWN => self.slots.get_or_insert(req),
            known => known,
        };
        let mut plan = std::mem::take(&mut self.plan);
        let planned = self.plan_slots(slot, a, &s, hashes, &mut plan);
        let new = planned.map(|()| self.apply_slots(slot, a, &s, &plan));
        plan.clear(); // what the groups' plans hold goes; the buffers stay
        self.plan = plan;
        new.map(Some)
    }

    /// An `allocate_slots` call's token counts and watermark, from its arguments (the
    /// request's boundaries read only for a Mamba align group, the prefill end's one reader).
    fn sizes(&self, a: &HybridSlots) -> Result<Sizes> {
        let local = a
            .num_computed_tokens
            .saturating_add(a.num_new_computed_tokens);
        let external = a.num_external_computed_tokens;
        let computed = local.saturating_add(external);
        let total = computed.min(self.cfg.max_model_len);
        let main = total.saturating_add(a.num_new_tokens);
        let watermark = match a.has_scheduled_reqs && a.waiting_or_preempted {
            true => self.cfg.watermark_blocks,
            false => 0,
        };
        let prefill_end = match self.has_mamba_align() {
            true => a.boundaries.get()?.num_prompt_tokens,
            false => 0,
        };
        Ok(Sizes {
            local,
            external,
            computed,
            total,
            main,
            need_slots: main
                .saturating_add(a.num_lookahead_tokens)
                .min(self.cfg.max_model_len),
            prefill_end: prefill_end.max(a.num_tokens.saturating_sub(1)),
            watermark: i64::try_from(watermark).unwrap_or(i64::MAX),
        })
    }

    /// vLLM's steps up to its refusal, in its order: the full-sequence gate, then
    /// `remove_skipped_blocks`, then the count against the free blocks less the reserved ones.
    /// `false`: refused (what those steps did stays done, as in vLLM).
    fn admit(&mut self, slot: ReqSlot, a: &HybridSlots, s: &Sizes) -> Result<bool> {
        if a.full_sequence_must_fit {
            let full = a.num_tokens.min(self.cfg.max_model_len);
            let c = Count {
                num_tokens: full,
                num_tokens_main: full,
                total_computed: s.total,
                prefill_end: s.prefill_end,
                apply_admission_cap: true,
            };
            let needed = self.count_blocks(slot, &c, a.new_computed)?;
            if needed.saturating_add(s.watermark) > self.pool.num_free() as i64 {
                return Ok(false);
            }
        }
        self.remove_skipped_at(slot, s.total.saturating_sub(a.num_in_flight_tokens))?;
        let c = Count {
            num_tokens: s.need_slots,
            num_tokens_main: s.main,
            total_computed: s.computed,
            prefill_end: s.prefill_end,
            apply_admission_cap: false,
        };
        let needed = self.count_blocks(slot, &c, a.new_computed)?;
        // vLLM: `needed + watermark > free - reserved` (a negative right side refuses all).
        let available =
            self.pool.num_free() as i64 - i64::try_from(a.reserved_blocks).unwrap_or(i64::MAX);
        Ok(needed.saturating_add(s.watermark) <= available)
    }

    /// Everything an admitted call will do, read and checked while nothing changes: whether
    /// it adopts the hit, what each group caches (every hash read) and allocates. Fails where
    /// vLLM would fail partway (a Mamba align step past its cap, more blocks taken than the
    /// pool has free), here before anything changes.
    fn plan_slots(
        &self,
        slot: ReqSlot,
        a: &HybridSlots,
        s: &Sizes,
        hashes: &mut dyn HashSource,
        plan: &mut SlotPlan,
    ) -> Result<()> {
        let running = self.is_running(slot);
        // vLLM adopts on a first allocation with a hit or external tokens (check_hit refused a
        // running request's hit); the skipped blocks count the external tokens too.
        plan.adopt = (a.new_computed.is_some() || s.external > 0) && !running;
        // Each group's table length once the hit is adopted, the hit's blocks it touches and
        // the blocks it then takes for the connector's tokens.
        let mut touched: Vec<u32> = Vec::new();
        for (i, m) in self.managers.iter().enumerate() {
            if !plan.adopt {
                plan.held.push(m.blocks(slot).len());
                plan.external.push(0);
                continue;
            }
            let nc = a.new_computed.map_or(&[][..], |nc| &nc[i][..]);
            let (len, kept) = m.adoption(nc, s.computed);
            plan.held.push(len);
            plan.external
                .push(m.external_blocks(len, s.local, s.external));
            touched.extend(kept.iter().filter(|&&b| self.pool.is_evictable(b)));
        }
        if !a.delay_cache_blocks {
            self.plan_caches(slot, a, s, hashes, plan)?;
        }
        // Touching a free block takes it off the queue before any group allocates.
        touched.sort_unstable();
        touched.dedup();
        let mut free = self.pool.num_free() - touched.len();
        let external: usize = plan.external.iter().sum();
        if external > free {
            return Err(Error::OutOfBlocks {
                device: "gpu",
                needed: external,
                free,
            });
        }
        free -= external;
        for ((m, &len), &ext) in self.managers.iter().zip(&plan.held).zip(&plan.external) {
            let alloc = m.plan_new_blocks(slot, len + ext, s.need_slots, s.main)?;
            if alloc.num_new() > free {
                return Err(Error::OutOfBlocks {
                    device: "gpu",
                    needed: alloc.num_new(),
                    free,
                });
            }
            free -= alloc.num_new();
            plan.allocs.push(alloc);
        }
        Ok(())
    }

    /// What each group caches once the call's blocks are held (`cache_blocks` at the call's
    /// verified tokens), every hash read, into `plan.caches`; `plan.held[i]` is group `i`'s
    /// table length once any hit is adopted (`plan.adopt`).
    fn plan_caches(
        &self,
        slot: ReqSlot,
        a: &HybridSlots,
        s: &Sizes,
        hashes: &mut dyn HashSource,
        plan: &mut SlotPlan,
    ) -> Result<()> {
        let n = s.total.saturating_add(a.num_new_tokens).min(a.num_tokens);
        for ((m, &have), &ext) in self.managers.iter().zip(&plan.held).zip(&plan.external) {
            let t = self.cacheable_tokens(m, n);
            let first = match plan.adopt {
                true => have as u32,
                false => m.num_cached_blocks(slot).unwrap_or(0),
            };
            let bs = u64::from(m.block_size());
            let table_len = (have + ext).max(s.need_slots.div_ceil(bs) as usize);
            let mut cache = m.plan_cache(first, table_len, t, a.boundaries, hashes)?;
            cache.tail = m.plan_tail(slot, t, a.boundaries, hashes)?;
            plan.caches.push(cache);
        }
        Ok(())
    }

    /// Apply a [`SlotPlan`]: adopt the hit (every group), allocate (group 0, 1, ...), cache.
    /// Every check was made while planning: nothing here can fail.
    fn apply_slots(
        &mut self,
        slot: ReqSlot,
        a: &HybridSlots,
        s: &Sizes,
        plan: &SlotPlan,
    ) -> Vec<Vec<u32>> {
        if plan.adopt {
            for (i, m) in self.managers.iter_mut().enumerate() {
                let nc = a.new_computed.map_or(&[][..], |nc| &nc[i][..]);
                m.adopt_computed_blocks(&mut self.pool, slot, nc, s.computed);
            }
            // Only attention groups take external blocks (check_external).
            for (m, &ext) in self.managers.iter_mut().zip(&plan.external) {
                if ext > 0 {
                    m.apply_new_blocks(&mut self.pool, slot, &NewBlocks::Plain(ext));
                }
            }
        }
        let mut new = Vec::with_capacity(self.managers.len());
        for (i, (m, alloc)) in self.managers.iter_mut().zip(&plan.allocs).enumerate() {
            let blocks = m.apply_new_blocks(&mut self.pool, slot, alloc);
            if let Some(z) = self.zeroing.as_mut() {
                z.record(i, m.spec().kind, &blocks);
            }
            new.push(blocks);
        }
        for (m, cache) in self.managers.iter_mut().zip(&plan.caches) {
            m.apply_cache(&mut self.pool, slot, cache);
        }
        new
    }
}
