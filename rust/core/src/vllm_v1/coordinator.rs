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
//! Not here (yet): KV connector (external tokens), encoder (cross-attention) tokens, EAGLE with
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
//! allocation and freeing are O(groups + blocks moved).
//!
//! KV events: the pool is grouped, so caching logs [`super::pool::Event::StoredIn`] (per group,
//! in group order, with the positions really cached) and eviction
//! [`super::pool::Event::RemovedIn`], each with its group, as vLLM's `BlockStored` /
//! `BlockRemoved` carry `group_idx`.

use super::eagle::{self, GroupEagle};
use super::engine::Release;
use super::mamba::ZeroList;
use super::mamba_align::CountArgs;
use super::manager::HashSource;
use super::pool::{Pool, NULL_BLOCK};
use super::retention::{Boundaries, Retention};
use super::single_type::{
    find_longest_cache_hit_eagle, AttentionKind, CachePlan, GroupManager, GroupParams, GroupSpec,
    NewBlocks,
};
use crate::error::{Error, Result};

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
    pub delay_cache_blocks: bool,
    pub full_sequence_must_fit: bool,
    pub reserved_blocks: u64,
    pub has_scheduled_reqs: bool,
    /// `request.num_prompt_tokens` and `request.shared_prefix_boundary` (what sparse
    /// retention caches around).
    pub boundaries: Boundaries,
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

/// One `allocate_slots` call's token counts (vLLM's names) and watermark.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    /// `num_local_computed_tokens`.
    local: u64,
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
#[derive(Debug)]
struct SlotPlan {
    /// The request adopts the call's hit.
    adopt: bool,
    /// Per group, what it caches (none: `delay_cache_blocks`).
    caches: Vec<CachePlan>,
    /// Per group, what it allocates.
    allocs: Vec<NewBlocks>,
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

    /// The request's table in every group (vLLM's `get_blocks`).
    pub fn blocks(&self, req: &str) -> Vec<Vec<u32>> {
        self.managers
            .iter()
            .map(|m| m.blocks(req).to_vec())
            .collect()
    }

    /// vLLM's `estimate_cached_tokens`: per group the most tokens a hash of the request's
    /// blocks covers (null blocks skipped), the least over groups (every group here is
    /// prefix-cacheable); 0 for an unknown request. O(the request's blocks).
    pub fn estimate_cached_tokens(&self, req: &str) -> u32 {
        let group_max = |m: &GroupManager| {
            let blocks = m.blocks(req).iter().filter(|&&b| b != NULL_BLOCK);
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

    /// vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit`; with caching off, vLLM's
    /// no-prefix-cache coordinator: no hit. An attention group that drops EAGLE's block looks
    /// one of its blocks past the candidate (at most the hashes' length) and drops once per
    /// candidate length: a lookup that shortens the candidate without dropping makes every
    /// such group drop again.
    pub fn find_longest_cache_hit(
        &self,
        hashes: &mut dyn HashSource,
        max_cache_hit_length: u64,
    ) -> Result<Hit> {
        let n = self.managers.len();
        if !self.cfg.enable_caching {
            return Ok(Hit {
                blocks: vec![Vec::new(); n],
                ..Default::default()
            });
        }
        if self.unitary() {
            return self.unitary_hit(hashes, max_cache_hit_length);
        }
        let mut hit_length = max_cache_hit_length;
        let mut longest = 0u64;
        let mut by_group: Vec<Option<Vec<u32>>> = vec![None; n];
        let mut len_by_group = vec![0u64; n];
        let simple = self.attention_groups.len() == 2 && is_full(&self.attention_groups[0].spec);
        let hashed = self.eagle_lookup_limit(hashes)?;
        let mut verified = vec![false; self.attention_groups.len()];
        loop {
            let mut curr = hit_length;
            for (idx, g) in self.attention_groups.iter().enumerate() {
                let first = g.ids[0] as usize;
                if is_full(&g.spec) && by_group[first].is_some() {
                    // Full attention's hits are prefix-closed: looked up once.
                    curr = curr.min(len_by_group[first]);
                    continue;
                }
                let drop = g.eagle && !verified[idx];
                let (blocks, len) = self.lookup(g, curr, drop, hashed, hashes)?;
                if drop {
                    verified[idx] = true;
                } else if len < curr {
                    verified.iter_mut().for_each(|v| *v = false);
                }
                curr = len;
                for (&id, b) in g.ids.iter().zip(blocks) {
                    by_group[id as usize] = Some(b);
                    len_by_group[id as usize] = len;
                }
                longest = longest.max(curr);
            }
            if curr >= hit_length {
                break;
            }
            hit_length = curr;
            if simple {
                break;
            }
        }
        for g in self.attention_groups.iter().filter(|g| is_full(&g.spec)) {
            let keep = hit_length.div_ceil(u64::from(g.spec.block_size)) as usize;
            for &id in &g.ids {
                if let Some(b) = by_group[id as usize].as_mut() {
                    b.truncate(keep);
                }
            }
        }
        Ok(Hit {
            blocks: by_group
                .into_iter()
                .map(Option::unwrap_or_default)
                .collect(),
            num_tokens: hit_length,
            num_uncached_common_prefix_tokens: longest.saturating_sub(hit_length),
        })
    }

    /// vLLM's `UnitaryKVCacheCoordinator` (one group, prefix caching on) rather than its
    /// hybrid one: one lookup, no fixed point.
    fn unitary(&self) -> bool {
        self.managers.len() == 1 && self.cfg.enable_caching
    }

    /// `UnitaryKVCacheCoordinator.find_longest_cache_hit`: the group's own lookup capped at
    /// `max_cache_hit_length` (no EAGLE margin past it), aligned to its block size; nothing is
    /// uncached in common (no other group lags it).
    fn unitary_hit(&self, hashes: &mut dyn HashSource, max_len: u64) -> Result<Hit> {
        let g = &self.attention_groups[0];
        let args = (
            self.cfg.hash_block_size,
            max_len,
            u64::from(g.spec.block_size),
        );
        let (blocks, len) =
            find_longest_cache_hit_eagle(&g.spec, &g.ids, &self.pool, hashes, args, g.eagle)?;
        Ok(Hit {
            blocks,
            num_tokens: len,
            num_uncached_common_prefix_tokens: 0,
        })
    }

    /// The hashes' length in tokens when some attention group drops EAGLE's block (the cap of
    /// its one-block-further lookup), else 0 (unread).
    fn eagle_lookup_limit(&self, hashes: &mut dyn HashSource) -> Result<u64> {
        if !self.attention_groups.iter().any(|g| g.eagle) {
            return Ok(0);
        }
        Ok((hashes.count()? as u64).saturating_mul(u64::from(self.cfg.hash_block_size)))
    }

    /// One attention group's lookup within a candidate of `curr` tokens; dropping EAGLE's
    /// block (`drop`), it looks one of its blocks further, at most `hashed` tokens.
    fn lookup(
        &self,
        g: &SpecGroup,
        curr: u64,
        drop: bool,
        hashed: u64,
        hashes: &mut dyn HashSource,
    ) -> Result<(Vec<Vec<u32>>, u64)> {
        // No margin for a Mamba group: its finder never drops (draft models have no Mamba
        // layers), so the hit would grow past the candidate.
        let max_len = match drop && !is_mamba(&g.spec) {
            true => curr
                .saturating_add(eagle::margin(g.spec.block_size))
                .min(hashed),
            false => curr,
        };
        let alignment = u64::from(self.cfg.scheduler_block_size);
        let args = (self.cfg.hash_block_size, max_len, alignment);
        find_longest_cache_hit_eagle(&g.spec, &g.ids, &self.pool, hashes, args, drop)
    }

    /// vLLM's `get_num_blocks_to_allocate` across groups: the sum of every group's count (a
    /// Mamba align group's may be negative, or the pool's size plus one to defer a hit on a
    /// state cached this step; it records the chunk's checkpoint, as vLLM does).
    pub fn num_blocks_to_allocate(
        &mut self,
        req: &str,
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
            if let Some(n) = m.align_count(&self.pool, req, &args) {
                sum += n;
                continue;
            }
            let n = m.num_blocks_to_allocate(
                &self.pool,
                req,
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
        for m in &mut self.managers {
            m.remove_skipped_blocks(&mut self.pool, req, processed_computed_tokens)?;
        }
        Ok(())
    }

    fn check_args(&self, req: &str, a: &HybridSlots) -> Result<()> {
        if a.num_new_tokens == 0 && a.num_new_computed_tokens == 0 {
            return Err(Error::invalid(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt",
            ));
        }
        // A request never has more computed tokens than max_model_len; the bound also keeps a
        // window's null padding (one entry per skipped block) within max_model_len's blocks.
        let local = a
            .num_computed_tokens
            .saturating_add(a.num_new_computed_tokens);
        if local > self.cfg.max_model_len {
            return Err(Error::invalid(format!(
                "{local} computed tokens pass max_model_len {}",
                self.cfg.max_model_len
            )));
        }
        // A Mamba align group sizes its table by the main-model tokens, uncapped (vLLM's
        // scheduler keeps them within max_model_len): bound them so a table stays bounded.
        let main = local.saturating_add(a.num_new_tokens);
        if main > self.cfg.max_model_len && self.managers.iter().any(|m| m.is_mamba_align()) {
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
        if self.managers.iter().any(|m| m.is_running(req)) {
            return match any {
                true => Err(Error::invalid(format!(
                    "request {req} is running: it cannot adopt prefix-cache blocks"
                ))),
                false => Ok(()),
            };
        }
        if self.managers.iter().any(|m| !m.blocks(req).is_empty()) {
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
        let s = self.sizes(a);
        if !self.admit(req, a, &s)? {
            return Ok(None);
        }
        let plan = self.plan_slots(req, a, &s, hashes)?;
        Ok(Some(self.apply_slots(req, a, &s, &plan)))
    }

    /// An `allocate_slots` call's token counts and watermark, from its arguments.
    fn sizes(&self, a: &HybridSlots) -> Sizes {
        let local = a
            .num_computed_tokens
            .saturating_add(a.num_new_computed_tokens);
        let total = local.min(self.cfg.max_model_len);
        let main = total.saturating_add(a.num_new_tokens);
        let watermark = match a.has_scheduled_reqs && a.waiting_or_preempted {
            true => self.cfg.watermark_blocks,
            false => 0,
        };
        Sizes {
            local,
            total,
            main,
            need_slots: main
                .saturating_add(a.num_lookahead_tokens)
                .min(self.cfg.max_model_len),
            prefill_end: a
                .boundaries
                .num_prompt_tokens
                .max(a.num_tokens.saturating_sub(1)),
            watermark: i64::try_from(watermark).unwrap_or(i64::MAX),
        }
    }

    /// vLLM's steps up to its refusal, in its order: the full-sequence gate, then
    /// `remove_skipped_blocks`, then the count against the free blocks less the reserved ones.
    /// `false`: refused (what those steps did stays done, as in vLLM).
    fn admit(&mut self, req: &str, a: &HybridSlots, s: &Sizes) -> Result<bool> {
        if a.full_sequence_must_fit {
            let full = a.num_tokens.min(self.cfg.max_model_len);
            let c = Count {
                num_tokens: full,
                num_tokens_main: full,
                total_computed: s.total,
                prefill_end: s.prefill_end,
                apply_admission_cap: true,
            };
            let needed = self.num_blocks_to_allocate(req, &c, a.new_computed)?;
            if needed.saturating_add(s.watermark) > self.pool.num_free() as i64 {
                return Ok(false);
            }
        }
        self.remove_skipped_blocks(req, s.total.saturating_sub(a.num_in_flight_tokens))?;
        let c = Count {
            num_tokens: s.need_slots,
            num_tokens_main: s.main,
            total_computed: s.local,
            prefill_end: s.prefill_end,
            apply_admission_cap: false,
        };
        let needed = self.num_blocks_to_allocate(req, &c, a.new_computed)?;
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
        req: &str,
        a: &HybridSlots,
        s: &Sizes,
        hashes: &mut dyn HashSource,
    ) -> Result<SlotPlan> {
        let running = self.managers.iter().any(|m| m.is_running(req));
        let adopt = match a.new_computed {
            Some(nc) if !running => Some(nc), // check_hit refused a running request's hit
            _ => None,
        };
        // Each group's table length once the hit is adopted, and the hit's blocks it touches.
        let mut held = Vec::with_capacity(self.managers.len());
        let mut touched: Vec<u32> = Vec::new();
        for (i, m) in self.managers.iter().enumerate() {
            match adopt {
                Some(nc) => {
                    let (len, kept) = m.adoption(&nc[i], s.local);
                    held.push(len);
                    touched.extend(kept.iter().filter(|&&b| self.pool.is_evictable(b)));
                }
                None => held.push(m.blocks(req).len()),
            }
        }
        let caches = match a.delay_cache_blocks {
            true => Vec::new(),
            false => self.plan_caches(req, a, s, adopt.is_some(), &held, hashes)?,
        };
        // Touching a free block takes it off the queue before any group allocates.
        touched.sort_unstable();
        touched.dedup();
        let mut free = self.pool.num_free() - touched.len();
        let mut allocs = Vec::with_capacity(self.managers.len());
        for (m, &len) in self.managers.iter().zip(&held) {
            let plan = m.plan_new_blocks(req, len, s.need_slots, s.main)?;
            if plan.num_new() > free {
                return Err(Error::OutOfBlocks {
                    device: "gpu",
                    needed: plan.num_new(),
                    free,
                });
            }
            free -= plan.num_new();
            allocs.push(plan);
        }
        Ok(SlotPlan {
            adopt: adopt.is_some(),
            caches,
            allocs,
        })
    }

    /// What each group caches once the call's blocks are held (`cache_blocks` at the call's
    /// verified tokens), every hash read; `held[i]` is group `i`'s table length once any hit
    /// is adopted.
    fn plan_caches(
        &self,
        req: &str,
        a: &HybridSlots,
        s: &Sizes,
        adopt: bool,
        held: &[usize],
        hashes: &mut dyn HashSource,
    ) -> Result<Vec<CachePlan>> {
        let n = s.total.saturating_add(a.num_new_tokens).min(a.num_tokens);
        let mut plans = Vec::with_capacity(self.managers.len());
        for (m, &have) in self.managers.iter().zip(held) {
            let t = self.cacheable_tokens(m, n);
            let first = match adopt {
                true => have as u32,
                false => m.num_cached_blocks(req).unwrap_or(0),
            };
            let bs = u64::from(m.block_size());
            let held = have.max(s.need_slots.div_ceil(bs) as usize);
            let mut plan = m.plan_cache(first, held, t, a.boundaries, hashes)?;
            plan.tail = m.plan_tail(req, t, a.boundaries, hashes)?;
            plans.push(plan);
        }
        Ok(plans)
    }

    /// Apply a [`SlotPlan`]: adopt the hit (every group), allocate (group 0, 1, ...), cache.
    /// Every check was made while planning: nothing here can fail.
    fn apply_slots(
        &mut self,
        req: &str,
        a: &HybridSlots,
        s: &Sizes,
        plan: &SlotPlan,
    ) -> Vec<Vec<u32>> {
        if plan.adopt {
            let nc = a.new_computed.unwrap_or(&[]);
            for (m, blocks) in self.managers.iter_mut().zip(nc) {
                m.adopt_computed_blocks(&mut self.pool, req, blocks, s.local);
            }
        }
        let mut new = Vec::with_capacity(self.managers.len());
        for (i, (m, alloc)) in self.managers.iter_mut().zip(&plan.allocs).enumerate() {
            let blocks = m.apply_new_blocks(&mut self.pool, req, alloc);
            if let Some(z) = self.zeroing.as_mut() {
                z.record(i, m.spec().kind, &blocks);
            }
            new.push(blocks);
        }
        for (m, cache) in self.managers.iter_mut().zip(&plan.caches) {
            m.apply_cache(&mut self.pool, req, cache);
        }
        new
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
        let mut plans = Vec::with_capacity(self.managers.len());
        for m in &self.managers {
            let t = self.cacheable_tokens(m, num_computed_tokens);
            let first = m.num_cached_blocks(req).unwrap_or(0);
            let mut plan = m.plan_cache(first, m.blocks(req).len(), t, boundaries, hashes)?;
            plan.tail = m.plan_tail(req, t, boundaries, hashes)?;
            plans.push(plan);
        }
        for (m, plan) in self.managers.iter_mut().zip(&plans) {
            m.apply_cache(&mut self.pool, req, plan);
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
        self.managers
            .iter_mut()
            .flat_map(|m| m.pop_blocks_for_free(req, release))
            .collect()
    }

    /// vLLM's `free(request)`: group by group, each group's table last block first.
    pub fn free(&mut self, req: &str) -> Result<()> {
        for m in &mut self.managers {
            m.free(&mut self.pool, req, self.cfg.release)?;
        }
        Ok(())
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// Heap bytes held (memory accounting).
    pub fn heap_bytes(&self) -> usize {
        self.pool.heap_bytes()
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
        for m in &self.managers {
            for (req, t) in m.tables() {
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
