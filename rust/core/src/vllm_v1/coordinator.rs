//! vLLM v1's hybrid KV cache coordinator (`HybridKVCacheCoordinator` in
//! `kv_cache_coordinator.py`, with the parts of `KVCacheManager.allocate_slots` that drive it):
//! several KV cache groups, one [`GroupManager`] each, all over one [`Pool`].
//!
//! ```text
//!   find_longest_cache_hit:  full groups first, then the others; each may only shorten the
//!                            candidate length; repeat until a pass shortens nothing
//!   allocate_slots:          remove_skipped_blocks (every group) -> count (every group) ->
//!                            plan (every hash read, every allocation checked) -> adopt the
//!                            hit (every group) -> allocate (group 0, 1, ...) -> cache
//!   free:                    group 0's table (last block first), then group 1's, ...
//! ```
//!
//! This file holds the types, construction (vLLM's group split), caching, freeing and the
//! invariant check; `coordinator/lookup.rs` holds `find_longest_cache_hit` and
//! `coordinator/allocate.rs` the block counting and `allocate_slots` (its checks, admission,
//! plan and apply); `coordinator/slots.rs` the request slots (a request's id is looked up once
//! per call; every group indexes its table by the slot).
//!
//! What the installed vLLM (0.32 and 0.33 alike, for what is mirrored here) does, and this
//! does:
//! * groups whose specs are equal (kind, block size, the rest as [`GroupSpec::layout`]) form
//!   one *attention group*, looked up together: a block position hits only when every member
//!   group has it cached; attention groups are ordered full attention first (stable);
//! * the candidate hit starts at `max_cache_hit_length`; each attention group's lookup is
//!   capped by the candidate and replaces it; a full-attention group is looked up once and
//!   afterwards only caps the candidate with its first result; passes repeat until the
//!   candidate is stable, except that one full group plus one other ("simple hybrid") stops
//!   after one pass; full-attention hits are then cut to the final length; the longest length
//!   any lookup returned, minus the final one, is `num_uncached_common_prefix_tokens`;
//! * hits are aligned to the scheduler block size (a multiple of every group's block size,
//!   which are multiples of the hash block size): groups may have different block sizes,
//!   except that chunked local attention requires its block size to equal the alignment
//!   (vLLM asserts it) and full attention here requires the hash block size (see
//!   [`super::single_type`]: vLLM adds partial prompt-tail entries otherwise);
//! * a group caches its blocks up to the computed tokens rounded down to the scheduler block
//!   size (`get_num_cacheable_tokens`); a sliding window caches those its retention mode
//!   keeps ([`super::retention`]: `prefix_cache_retention_interval`, validated here as vLLM's
//!   coordinator validates it, caching on or off), reading the request's prompt length and
//!   shared-prefix junction ([`Boundaries`]) at each caching call.
//!
//! Differences between the releases that reach this code: `pop_blocks_for_free` leaves the
//! leading null blocks out in 0.33 only (`trim_null_head`; the free queue ends up the same,
//! as both skip the null block when freeing); 0.33 caps `cache_blocks` at the request's
//! hashes; EAGLE's drop set differs ([`super::eagle::drop_groups`]: a group flagged
//! `is_eagle_group` drops without `use_eagle` in 0.32 only), and so does what a dropping sliding
//! window retains at a junction (0.33 also keeps the tail one block below it). Everything else
//! here is the same in both (partial hash hits changed, out of this scope; 0.33's lookahead
//! hashes reach the requests' hashes and the KV events, built in `rust/py`, and align mode's
//! checkpoint positions).
//!
//! EAGLE/MTP ([`super::eagle`]): attention groups holding a dropping group drop for all their
//! members; such a group's lookup is capped one of its blocks past the candidate (at most the
//! hashes' tokens) and drops once per candidate length (a lookup that shortens the candidate
//! without dropping re-arms every dropping group); it caches one block past the aligned
//! boundary. A dropping Mamba group gets no margin (its finder never drops) yet counts as
//! verified, as in vLLM.
//!
//! Mamba groups (mode "none": prefix caching off, so this is vLLM's
//! `KVCacheCoordinatorNoPrefixCache`) are a group kind ([`super::mamba`]); with them the
//! attention groups record their new blocks for zeroing ([`Hybrid::with_zeroing`]). Mamba
//! groups in mode "align" (prefix caching on) are another ([`super::mamba_align`]): their
//! counts read the main-model tokens and the prefill end (passed only under retention 0, as
//! vLLM's coordinator passes it), may be negative or defer the request, and record the
//! chunk's checkpoint; [`Hybrid::new_step_starts`] clears what they cached this step; their
//! checkpoints read `use_eagle` and the hash lookahead ([`HybridConfig::hash_lookahead_tokens`]).
//!
//! Not here (yet): KV connector (external) tokens beside a Mamba group, encoder
//! (cross-attention) tokens, EAGLE with
//! a chunked local group, Mamba "align" with blocks larger than the hash block (fine-grained
//! hits).
//!
//! One group alone (a lone sliding-window, chunked local or Mamba group; a lone full-attention
//! group is [`super::manager::Manager`]'s) is vLLM's `UnitaryKVCacheCoordinator` with prefix
//! caching on (one lookup capped at the candidate, no EAGLE margin, aligned to the group's
//! block; every computed token cacheable) and `KVCacheCoordinatorNoPrefixCache` without.
//!
//! Invariants: every group's invariants ([`super::single_type`]); a block's ref count is the
//! number of tables, of any group, holding it; a block is only in tables of the group it is
//! cached for (the pool hands each out once; hits come from the group's own cache).
//!
//! Costs: a lookup is at most a few passes (each pass that does not stop shortens the
//! candidate) of every non-full attention group's lookup, plus one lookup of each full group;
//! allocation and freeing are O(groups + blocks moved), with one hash lookup of the request's
//! id per call.
//!
//! KV events: the pool is grouped, so caching logs [`super::pool::Event::StoredIn`] (per group,
//! in group order, with the positions really cached) and eviction
//! [`super::pool::Event::RemovedIn`], each with its group, as vLLM's `BlockStored` /
//! `BlockRemoved` carry `group_idx`.

use super::eagle::{self, GroupEagle};
use super::engine::Release;
use super::mamba::ZeroList;
use super::manager::HashSource;
use super::pool::{Pool, NULL_BLOCK};
use super::retention::{Boundaries, BoundarySource, Retention};
use super::single_type::{AttentionKind, GroupManager, GroupParams, GroupSpec, ReqSlot};
use crate::error::{Error, Result};

mod allocate;
mod lookup;
mod slots;

use slots::ReqSlots;

#[derive(Clone, Debug)]
pub struct HybridConfig {
    pub num_blocks: u32,
    /// The KV cache groups, in vLLM's group order (group `i` is `groups[i]`).
    pub groups: Vec<GroupSpec>,
    /// Tokens per block hash (`hash_block_size`).
    pub hash_block_size: u32,
    /// vLLM's `scheduler_block_size`: a multiple of every group's block size and of the hash
    /// block size (the least common multiple of the block sizes, as vLLM's config makes it).
    pub scheduler_block_size: u32,
    pub max_model_len: u64,
    /// `VllmConfig.max_in_flight_tokens` (for the sliding-window and chunked admission caps;
    /// vLLM's `KVCacheManager` takes `max_model_len` when it is not given).
    pub max_in_flight_tokens: u64,
    pub enable_caching: bool,
    pub enable_events: bool,
    /// `int(watermark * num_blocks)`, as vLLM computes it.
    pub watermark_blocks: u64,
    pub release: Release,
    /// `KVCacheConfig.prefix_cache_retention_interval` (vLLM's engines default to 0, sparse).
    pub retention: Retention,
    /// The manager's `use_eagle` (the scheduler's `use_eagle_block_drop`).
    pub use_eagle: bool,
    /// Each group's `is_eagle_group` (group order; empty: none flagged).
    pub eagle_groups: Vec<bool>,
    /// vLLM 0.33's `num_hash_lookahead_tokens` (0 on 0.32): each block's hash covers that
    /// many tokens past it; align mode's checkpoint positions read it.
    pub hash_lookahead_tokens: u64,
}

/// A prefix-cache hit across groups.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hit {
    /// Per group, the hit's blocks (skipped positions as the null block).
    pub blocks: Vec<Vec<u32>>,
    /// The hit in tokens, common to every group.
    pub num_tokens: u64,
    /// `num_uncached_common_prefix_tokens`: how much longer some group's own hit was.
    pub num_uncached_common_prefix_tokens: u64,
}

impl Hit {
    /// `get_computed_blocks`' `shared_prefix_boundary` (the scheduler stores it on the
    /// request): the longest single-group hit when some group's was longer, else 0.
    pub fn shared_prefix_boundary(&self) -> u64 {
        match self.num_uncached_common_prefix_tokens {
            0 => 0,
            u => self.num_tokens + u,
        }
    }
}

/// One `allocate_slots` call's arguments (vLLM's names), the request's fields included.
#[derive(Clone, Copy, Debug, Default)]
pub struct HybridSlots<'a> {
    pub num_computed_tokens: u64,
    pub num_tokens: u64,
    /// `request.num_in_flight_tokens` (scheduled, not yet processed: not freed yet).
    pub num_in_flight_tokens: u64,
    pub waiting_or_preempted: bool,
    pub num_new_tokens: u64,
    pub num_new_computed_tokens: u64,
    /// The hit to adopt, per group; `None` is vLLM's shared empty `KVCacheBlocks`.
    pub new_computed: Option<&'a [Vec<u32>]>,
    pub num_lookahead_tokens: u64,
    /// Tokens a KV connector supplies past the local hit (vLLM's
    /// `num_external_computed_tokens`): on a first allocation each group takes blocks for
    /// those inside its window, which the call does not return.
    pub num_external_computed_tokens: u64,
    pub delay_cache_blocks: bool,
    pub full_sequence_must_fit: bool,
    pub reserved_blocks: u64,
    pub has_scheduled_reqs: bool,
    /// `request.num_prompt_tokens` and `request.shared_prefix_boundary` (what sparse
    /// retention caches around, and a Mamba align group's prefill end), read only if needed.
    pub boundaries: BoundarySource<'a>,
}

/// One `get_num_blocks_to_allocate` call's token counts (vLLM's names).
#[derive(Clone, Copy, Debug, Default)]
pub struct Count {
    /// `num_tokens`: the slots needed, lookahead included.
    pub num_tokens: u64,
    /// `num_tokens_main_model`: without the lookahead (draft) slots.
    pub num_tokens_main: u64,
    /// `total_computed_tokens`.
    pub total_computed: u64,
    /// The request's prefill end (`max(num_prompt_tokens, num_tokens - 1)`).
    pub prefill_end: u64,
    pub apply_admission_cap: bool,
}

impl Count {
    /// A count without lookahead slots or a prefill end, uncapped.
    pub fn new(num_tokens: u64, total_computed: u64) -> Self {
        Count {
            num_tokens,
            num_tokens_main: num_tokens,
            total_computed,
            ..Default::default()
        }
    }
}

/// Groups sharing a spec, looked up together (vLLM's `SpecGroup`).
#[derive(Clone, Debug)]
struct SpecGroup {
    spec: GroupSpec,
    ids: Vec<u32>,
    /// Some member drops EAGLE's last block (vLLM's `SpecGroup.use_eagle`).
    eagle: bool,
}

#[derive(Clone, Debug)]
pub struct Hybrid {
    pool: Pool,
    cfg: HybridConfig,
    managers: Vec<GroupManager>,
    attention_groups: Vec<SpecGroup>,
    /// The attention groups' new blocks to zero (`None`: no zeroing; [`super::mamba`]).
    zeroing: Option<ZeroList>,
    /// `num_reprefillable_tokens` ([`Hybrid::set_prefill_lookahead`]).
    reprefillable: u64,
    /// Each held request's slot in every group's table.
    slots: ReqSlots,
    /// `allocate_slots`'s plan, refilled by each call (its buffers kept).
    plan: allocate::SlotPlan,
}

fn is_full(spec: &GroupSpec) -> bool {
    spec.kind == AttentionKind::Full
}

/// vLLM's `isinstance(spec, MambaSpec)` (either cache mode).
fn is_mamba(spec: &GroupSpec) -> bool {
    matches!(
        spec.kind,
        AttentionKind::Mamba { .. } | AttentionKind::MambaAlign { .. }
    )
}

impl Hybrid {
    pub fn new(cfg: HybridConfig) -> Result<Self> {
        let n = cfg.groups.len();
        if n == 0 {
            return Err(Error::invalid(
                "a KV cache coordinator needs a KV cache group",
            ));
        }
        let (hbs, sbs) = (cfg.hash_block_size, cfg.scheduler_block_size);
        if hbs == 0 || sbs == 0 || sbs % hbs != 0 {
            return Err(Error::invalid(format!(
                "the scheduler block size {sbs} must be a positive multiple of the hash block \
                 size {hbs}"
            )));
        }
        let has_window = cfg.groups.iter().any(|g| g.kind.retention_applies());
        let retention = Retention::from_interval(cfg.retention.interval(), sbs, has_window)?;
        let params = GroupParams {
            hash_block_size: hbs,
            scheduler_block_size: sbs,
            enable_caching: cfg.enable_caching,
            max_in_flight_tokens: cfg.max_in_flight_tokens,
            max_model_len: cfg.max_model_len,
            retention,
            release: cfg.release,
            mamba_drop_eagle: cfg.use_eagle,
            hash_lookahead_tokens: cfg.hash_lookahead_tokens,
        };
        let managers = cfg
            .groups
            .iter()
            .enumerate()
            .map(|(i, &spec)| GroupManager::new(spec, i as u32, params))
            .collect::<Result<Vec<_>>>()?;
        let pool = Pool::new_grouped(
            cfg.num_blocks,
            cfg.enable_caching,
            cfg.enable_events,
            n as u32,
        )?;
        let mut managers = managers;
        let attention_groups = Self::split_groups(&cfg, &mut managers)?;
        Ok(Hybrid {
            pool,
            cfg,
            managers,
            attention_groups,
            zeroing: None,
            reprefillable: 0,
            slots: ReqSlots::default(),
            plan: allocate::SlotPlan::default(),
        })
    }

    /// Lower `max_model_len` to `cap` (the KV cache's size where it holds fewer tokens), and
    /// `max_in_flight_tokens` to `in_flight`: the coordinator then decides as vLLM's built at
    /// that length (slot counts, lookahead slots and the window and chunk admission caps,
    /// recomputed). Only before any request is held; values above the current ones change
    /// nothing.
    pub fn cap_max_model_len(&mut self, cap: u64, in_flight: u64) -> Result<()> {
        if self.managers.iter().any(|m| m.num_requests() > 0) {
            return Err(Error::invalid(
                "max_model_len can be capped only before any request is held",
            ));
        }
        self.cfg.max_model_len = self.cfg.max_model_len.min(cap);
        self.cfg.max_in_flight_tokens = self.cfg.max_in_flight_tokens.min(in_flight);
        for m in &mut self.managers {
            m.set_admission_cap(self.cfg.max_in_flight_tokens, self.cfg.max_model_len);
        }
        Ok(())
    }

    /// vLLM's `verify_and_split_kv_cache_groups`: equal specs share one lookup; full attention
    /// first (a stable sort keeps the rest in group order); an attention group holding a
    /// group that drops EAGLE's block drops for all its members ([`super::eagle`]), which is
    /// set on their managers.
    fn split_groups(cfg: &HybridConfig, managers: &mut [GroupManager]) -> Result<Vec<SpecGroup>> {
        let n = cfg.groups.len();
        let mut flagged = cfg.eagle_groups.clone();
        if flagged.is_empty() {
            flagged = vec![false; n];
        } else if flagged.len() != n {
            return Err(Error::invalid(format!(
                "{} is_eagle_group flags for {n} KV cache groups",
                flagged.len()
            )));
        }
        let drops = eagle::drop_groups(cfg.release, cfg.use_eagle, &flagged);
        let mut attention_groups: Vec<SpecGroup> = Vec::new();
        for (i, spec) in cfg.groups.iter().enumerate() {
            match attention_groups.iter_mut().find(|g| g.spec == *spec) {
                Some(g) => {
                    g.ids.push(i as u32);
                    g.eagle |= drops[i];
                }
                None => attention_groups.push(SpecGroup {
                    spec: *spec,
                    ids: vec![i as u32],
                    eagle: drops[i],
                }),
            }
        }
        attention_groups.sort_by_key(|g| !is_full(&g.spec));
        let replay = drops.contains(&true);
        for g in &attention_groups {
            for &id in &g.ids {
                managers[id as usize].set_eagle(GroupEagle::new(cfg.release, g.eagle, replay));
            }
        }
        Ok(attention_groups)
    }

    /// With `on`, the attention groups record the blocks they hand out for zeroing, as vLLM's
    /// managers do when `KVCacheConfig.needs_kv_cache_zeroing` (a Mamba layer) holds.
    pub fn with_zeroing(mut self, on: bool) -> Self {
        self.zeroing = on.then(|| ZeroList::new(self.managers.len()));
        self
    }

    /// vLLM's `num_prefill_lookahead` (multi-module MTP: `num_speculative_tokens`): the last
    /// `n - 1` computed tokens may be re-prefilled, so EAGLE groups (a lone group: every
    /// group) cache only the finalized ones. Refused as vLLM's coordinator refuses it (prefix
    /// caching, an EAGLE group, `n` above the scheduler block size), nothing changed.
    pub fn set_prefill_lookahead(&mut self, n: u64) -> Result<()> {
        let eagle = self.cfg.use_eagle || self.cfg.eagle_groups.contains(&true);
        let applies = self.cfg.enable_caching && eagle;
        self.reprefillable =
            eagle::reprefillable_tokens(n, self.cfg.scheduler_block_size, applies)?;
        Ok(())
    }

    /// vLLM's `KVCacheManager.take_new_block_ids`: the blocks handed out since the last call,
    /// attention groups only, group by group (empty without zeroing).
    pub fn take_new_block_ids(&mut self) -> Vec<u32> {
        self.zeroing.as_mut().map_or_else(Vec::new, ZeroList::take)
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    pub fn pool_mut(&mut self) -> &mut Pool {
        &mut self.pool
    }

    pub fn config(&self) -> &HybridConfig {
        &self.cfg
    }

    pub fn group(&self, i: usize) -> &GroupManager {
        &self.managers[i]
    }

    pub fn num_groups(&self) -> usize {
        self.managers.len()
    }

    /// The request's slot in every group's table ([`ReqSlot::UNKNOWN`] if it has none).
    pub fn slot(&self, req: &str) -> ReqSlot {
        self.slots.get(req)
    }

    /// The request's table in every group (vLLM's `get_blocks`).
    pub fn blocks(&self, req: &str) -> Vec<Vec<u32>> {
        let slot = self.slots.get(req);
        self.managers
            .iter()
            .map(|m| m.blocks(slot).to_vec())
            .collect()
    }

    /// vLLM's `estimate_cached_tokens`: per group the most tokens a hash of the request's
    /// blocks covers (null blocks skipped), the least over groups (every group here is
    /// prefix-cacheable); 0 for an unknown request. O(the request's blocks).
    pub fn estimate_cached_tokens(&self, req: &str) -> u32 {
        let slot = self.slots.get(req);
        let group_max = |m: &GroupManager| {
            let blocks = m.blocks(slot).iter().filter(|&&b| b != NULL_BLOCK);
            blocks
                .filter_map(|&b| self.pool.hashed_tokens(b))
                .max()
                .unwrap_or(0)
        };
        self.managers.iter().map(group_max).min().unwrap_or(0)
    }

    /// The attention groups' member ids, in lookup order (tests and introspection).
    pub fn lookup_order(&self) -> Vec<Vec<u32>> {
        self.attention_groups
            .iter()
            .map(|g| g.ids.clone())
            .collect()
    }

    /// Some group is a Mamba align group (it keeps per-request state a count writes, and
    /// reads the prefill end).
    fn has_mamba_align(&self) -> bool {
        self.managers.iter().any(GroupManager::is_mamba_align)
    }

    /// vLLM's `UnitaryKVCacheCoordinator` (one group, prefix caching on) rather than its
    /// hybrid one: one lookup, no fixed point.
    fn unitary(&self) -> bool {
        self.managers.len() == 1 && self.cfg.enable_caching
    }

    /// vLLM's `cache_blocks(request, num_computed_tokens)` across groups, each group caching up
    /// to the tokens rounded down to the scheduler block size, the request at `boundaries`.
    pub fn cache_blocks(
        &mut self,
        req: &str,
        num_computed_tokens: u64,
        boundaries: Boundaries,
        hashes: &mut dyn HashSource,
    ) -> Result<()> {
        let slot = self.slots.get(req);
        let boundaries = BoundarySource::Given(boundaries);
        let mut plans = Vec::with_capacity(self.managers.len());
        for m in &self.managers {
            let t = self.cacheable_tokens(m, num_computed_tokens);
            let first = m.num_cached_blocks(slot).unwrap_or(0);
            let mut plan = m.plan_cache(first, m.blocks(slot).len(), t, boundaries, hashes)?;
            plan.tail = m.plan_tail(slot, t, boundaries, hashes)?;
            plans.push(plan);
        }
        for (m, plan) in self.managers.iter_mut().zip(&plans) {
            m.apply_cache(&mut self.pool, slot, plan);
        }
        Ok(())
    }

    /// vLLM's `get_num_cacheable_tokens` for group `m` ([`eagle::cacheable_tokens`]).
    fn cacheable_tokens(&self, m: &GroupManager, num_computed_tokens: u64) -> u64 {
        if self.unitary() {
            // The base coordinator's rule: every finalized token.
            return num_computed_tokens.saturating_sub(self.reprefillable);
        }
        let sbs = u64::from(self.cfg.scheduler_block_size);
        let r = self.reprefillable;
        eagle::cacheable_tokens(num_computed_tokens, sbs, m.block_size(), m.use_eagle(), r)
    }

    /// vLLM's `pop_blocks_for_free` across groups: every group's table, group order.
    pub fn pop_blocks_for_free(&mut self, req: &str) -> Vec<u32> {
        let release = self.cfg.release;
        let slot = self.slots.release(req);
        self.managers
            .iter_mut()
            .flat_map(|m| m.pop_blocks_for_free(slot, release))
            .collect()
    }

    /// vLLM's `free(request)`: group by group, each group's table last block first.
    pub fn free(&mut self, req: &str) -> Result<()> {
        let slot = self.slots.get(req);
        for m in &mut self.managers {
            m.free(&mut self.pool, slot, self.cfg.release)?;
        }
        // Released once every group let the request go (a failed free keeps the slot).
        self.slots.release(req);
        Ok(())
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// Heap bytes held (memory accounting).
    pub fn heap_bytes(&self) -> usize {
        self.pool.heap_bytes()
            + self.slots.heap_bytes()
            + self.plan.heap_bytes()
            + self.zeroing.as_ref().map_or(0, ZeroList::heap_bytes)
            + self
                .managers
                .iter()
                .map(GroupManager::heap_bytes)
                .sum::<usize>()
    }

    /// Every invariant, tests only: the pool's; null blocks only lead a table; each block's
    /// ref count equals the number of tables (of any group) holding it; a cached block is
    /// cached for the group whose table holds it.
    pub fn check(&self) -> std::result::Result<(), String> {
        self.pool.check()?;
        let mut holders = vec![0u32; self.pool.num_blocks() as usize];
        let ids: std::collections::HashMap<ReqSlot, &str> =
            self.slots.iter().map(|(id, s)| (s, id)).collect();
        for m in &self.managers {
            for (slot, t) in m.tables() {
                let Some(req) = ids.get(&slot) else {
                    return Err(format!(
                        "group {}: slot {slot:?} has no request",
                        m.group_id()
                    ));
                };
                let nulls = t.iter().take_while(|&&b| b == 0).count();
                if t[nulls..].contains(&0) && !m.is_mamba_align() {
                    return Err(format!(
                        "group {}: {req}'s table has an inner null",
                        m.group_id()
                    ));
                }
                for &b in t[nulls..].iter().filter(|&&b| b != NULL_BLOCK) {
                    holders[b as usize] += 1;
                    if self.pool.hash_of(b).is_some() && self.pool.group_of(b) != m.group_id() {
                        return Err(format!("block {b} is cached for another group"));
                    }
                }
            }
        }
        for b in 1..self.pool.num_blocks() {
            if self.pool.ref_cnt(b) != holders[b as usize] {
                return Err(format!(
                    "block {b}: ref {} but {} holders",
                    self.pool.ref_cnt(b),
                    holders[b as usize]
                ));
            }
        }
        Ok(())
    }
}
