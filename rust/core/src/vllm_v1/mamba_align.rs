//! vLLM v1's Mamba groups in `mamba_cache_mode` "align" (prefix caching on: vLLM's model
//! config forces it for Mamba hybrids whenever prefix caching is), as the group kind
//! [`AttentionKind::MambaAlign`] of [`super::single_type::GroupManager`]: `MambaManager`'s
//! align branches in `single_type_kv_cache_manager.py`, with `get_mamba_prefill_checkpoint_
//! position` and `is_mamba_prefill_checkpoint_valid` from `kv_cache_interface.py`.
//!
//! ```text
//!   block 4, a 10-token prompt in one chunk, prefill checkpoints on (C checkpoint, S state)
//!   prefill (0..10):   [ 0][ C][ S]       C keeps the state at 8, the prompt's hash boundary
//!   10 processed:      [ 0][ 0][ S]       C retired: freed, still cached for later hits
//!   12 processed:      [ 0][ 0][ S][S']   token 13 needs a fourth state block
//!   13 processed:      [ 0][ 0][ 0][S']   S retired
//! ```
//!
//! Rules mirrored (0.32 and 0.33 agree except where said):
//! * the lookup scans the group's hashes right to left and takes the first block cached in
//!   every group of the spec whose end is a multiple of the hit alignment: the hit is that one
//!   block, after `i` null blocks (`HitSearch::mamba_align`);
//! * counting ([`AlignRules::count`]) ignores lookahead (draft) slots: `cdiv(main, block) +
//!   num_speculative_blocks` blocks are required, minus the table and the hit; a positive
//!   count is capped at one running-state block, plus one prefill checkpoint block when this
//!   chunk exports one, plus the speculative blocks on a request's first allocation; the
//!   hit's blocks that sit in the free queue add one each (vLLM's `_get_num_evictable_blocks`,
//!   every hit block, skipped or not). A negative count is returned as is (vLLM sums it). A
//!   hit whose last block this group cached during the current step defers the request: the
//!   count is the pool's size plus one (`cached_blocks_this_step`, cleared by
//!   `new_step_starts`);
//! * a prefill checkpoint (a spec with `num_prefill_checkpoint_blocks > 0` and a
//!   `prefill_checkpoint_alignment`) is reserved on the chunk that reaches the prefill end (any
//!   chunk unless the retention interval is 0: vLLM's coordinator passes `prefill_end = 0`
//!   then) when the backend can export the state at the last hash boundary before the chunk
//!   end inside the chunk ([`checkpoint_valid`]); the block before the running state then is
//!   a real block rather than a null one, and caching re-keys it at the checkpoint;
//! * allocating ([`AlignRules::plan_allocate`]) pads the table with null blocks up to the running
//!   state's position (minus the checkpoint), moves the speculative blocks a step leaves
//!   behind to the end (their positions become null), and appends the new blocks; it
//!   remembers the previous running state (`last_state_block_idx`), which
//!   [`AlignRules::remove_skipped`] frees two steps on; the skipped prefix is freed past the
//!   retired mark (`_num_retired_blocks`), null gaps stepped over;
//! * caching ([`AlignGroup::cache_tail`]) caches the full blocks (nulls skipped, sparse
//!   retention's mask with one block per boundary) and then the prompt's tail: the checkpoint
//!   block at its position (or, when no boundary keeps it, its hash dropped), or the block
//!   ending on the prompt's last hash boundary; 0.33 leaves a block already keyed there alone,
//!   0.32 re-keys it as cached this step.
//!
//! * EAGLE/MTP: every checkpoint position ([`AlignRules::checkpoint_at`]) reads the
//!   coordinator's `use_eagle` (`drop_eagle_checkpoint_block`: one unit below the aligned end)
//!   and 0.33's `num_hash_lookahead_tokens` (the tokens a hash covers past its block).
//!
//! Scope (refused at construction, [`check_group`]): block size equal to the hash block size,
//! so no fine-grained (sub-block) hits, no partial tails, no copy-on-write, and one hash per
//! block; hence no shared-prefix checkpoint (`enable_mamba_shared_prefix_checkpoint` acts only
//! with finer hashes); no KV connector (boundary-state offloads are never read without one, so
//! none are recorded).
//!
//! Invariants: a table holds null blocks wherever a state was retired or never written
//! (inner nulls allowed, unlike the other kinds); a request's [`AlignReq`] lives and dies with
//! its table; `retired` never exceeds the table's length; every non-null entry holds one
//! reference. Costs: counting O(hit blocks); allocating O(new entries); freeing skipped states
//! O(newly retired positions); caching O(newly full blocks); the lookup reads at most
//! `max_length / block_size` hashes (right to left, stopping at the first hit).

use foldhash::fast::RandomState;
use hashbrown::HashSet;

use super::manager::HashSource;
use super::pool::{Event, HashKey, Pool, NULL_BLOCK};
use super::retention::{Boundaries, Retained, Retention};
use super::single_type::{cached_in_all, AttentionKind, GroupSpec, HitSearch, View};
use crate::error::{Error, Result};

/// vLLM's `get_mamba_prefill_checkpoint_position(num_tokens, unit, drop_eagle_block,
/// num_hash_lookahead_tokens)`: the last multiple of `unit` at most `num_tokens` less
/// `max(1, lookahead)` (less nothing, then one `unit` less, with the EAGLE block drop), 0 if
/// none.
pub fn checkpoint_position(num_tokens: u64, unit: u64, drop_eagle: bool, lookahead: u64) -> u64 {
    if unit == 0 {
        return 0;
    }
    let proof_limit = match drop_eagle {
        true => num_tokens,
        false => num_tokens.saturating_sub(lookahead.max(1)),
    };
    let position = proof_limit / unit * unit;
    match drop_eagle {
        true => position.saturating_sub(unit),
        false => position,
    }
}

/// vLLM's `is_mamba_prefill_checkpoint_valid`: whether the backend can export the state at
/// `cp` within the query `qs..qe` (`alignment` 0: `prefill_checkpoint_alignment` is None).
pub fn checkpoint_valid(qs: u64, qe: u64, cp: u64, hbs: u64, bs: u64, alignment: u64) -> bool {
    if alignment == 0 || hbs == 0 || bs == 0 {
        return false;
    }
    let (qs_i, bs_i) = (qs as i64, bs as i64);
    let initial_state_col = (qs_i - 1).div_euclid(bs_i);
    let checkpoint_col = qe.div_ceil(bs) as i64 - 2;
    qs % hbs == 0
        && checkpoint_col > initial_state_col
        && qs.saturating_add(hbs) <= cp
        && qs < cp
        && cp < qe
        && (cp - qs) % alignment == 0
}

/// Refuse what align mode mirrors only partly (see the module's scope).
pub fn check_group(spec: &GroupSpec, enable_caching: bool, hash_block_size: u32) -> Result<()> {
    if !matches!(spec.kind, AttentionKind::MambaAlign { .. }) {
        return Ok(());
    }
    if !enable_caching {
        return Err(Error::invalid(
            "mamba_cache_mode \"align\" without prefix caching is not mirrored (vLLM's model \
             config turns it into \"none\")",
        ));
    }
    if spec.block_size != hash_block_size {
        return Err(Error::invalid(format!(
            "a Mamba \"align\" group's block size ({}) must equal the hash block size ({}): \
             fine-grained partial hits (copy-on-write tails) are not mirrored",
            spec.block_size, hash_block_size
        )));
    }
    Ok(())
}

/// One request's align-mode bookkeeping (vLLM's per-request dicts and set).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AlignReq {
    /// `last_state_block_idx`: the running state two steps back, freed once passed.
    pub last_state: Option<usize>,
    /// `_num_retired_blocks`: positions below it were freed as skipped.
    pub retired: usize,
    /// In `_allocated_block_reqs`.
    pub allocated: bool,
    /// `_checkpoints`: (position in tokens, table index) of this chunk's checkpoint.
    pub checkpoint: Option<(u64, usize)>,
}

/// A Mamba align group's constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AlignRules {
    pub block_size: u64,
    pub num_speculative_blocks: u64,
    /// `prefill_checkpoint_alignment` of a spec with checkpoint blocks; 0: no checkpoints.
    pub checkpoint_alignment: u64,
    pub hash_block_size: u64,
    /// The coordinator's `cache_hit_alignment_tokens` (the scheduler block size here).
    pub alignment: u64,
    /// vLLM's `drop_eagle_checkpoint_block`: the coordinator's `use_eagle` (the scheduler's
    /// `use_eagle_block_drop`); checkpoints then sit one unit below EAGLE's replay boundary.
    pub drop_eagle: bool,
    /// vLLM 0.33's `num_hash_lookahead_tokens` (the block pool's), read by the checkpoint
    /// positions as `get_mamba_prefill_checkpoint_position` reads it.
    pub hash_lookahead: u64,
}

/// A count's inputs beyond the table (vLLM's `get_num_blocks_to_allocate` arguments).
#[derive(Clone, Copy, Debug)]
pub struct CountArgs<'a> {
    pub num_tokens_main: u64,
    pub new_computed: &'a [u32],
    pub total_computed: u64,
    pub prefill_end: u64,
    pub apply_admission_cap: bool,
}

/// What caching a Mamba align group's tail reads from the request's hashes, read before
/// anything changes (see [`AlignRules::plan_tail`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct TailPlan {
    pub num_tokens: u64,
    pub boundaries: Boundaries,
    /// The hash at the request's checkpoint position (if it has one and the hashes reach it).
    pub checkpoint_key: Option<HashKey>,
    /// The hash at `num_tokens` when that is the prompt's last hash boundary.
    pub boundary_key: Option<HashKey>,
}

/// What an align-mode `allocate_new_blocks` will do to a table, planned before anything
/// changes ([`AlignRules::plan_allocate`], applied by [`AlignRules::apply_allocate`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AlignAlloc {
    /// The table's length when planned.
    pub prev: usize,
    /// Null entries pad the table up to here.
    pub null_end: usize,
    /// Speculative blocks left behind, moved to the end.
    pub relocate: usize,
    /// Blocks taken from the pool's free queue.
    pub num_new: usize,
    /// `false`: nothing is appended (the request is only marked allocated).
    pub append: bool,
}

impl AlignRules {
    pub fn new(
        spec: &GroupSpec,
        hash_block_size: u32,
        alignment: u64,
        (drop_eagle, hash_lookahead): (bool, u64),
    ) -> Option<Self> {
        let AttentionKind::MambaAlign {
            num_speculative_blocks,
            checkpoint_alignment,
        } = spec.kind
        else {
            return None;
        };
        Some(AlignRules {
            block_size: u64::from(spec.block_size),
            num_speculative_blocks: u64::from(num_speculative_blocks),
            checkpoint_alignment: u64::from(checkpoint_alignment),
            hash_block_size: u64::from(hash_block_size),
            alignment,
            drop_eagle,
            hash_lookahead,
        })
    }

    /// vLLM's `get_mamba_prefill_checkpoint_position(num_tokens, unit,
    /// self.drop_eagle_checkpoint_block, num_hash_lookahead_tokens)`.
    pub fn checkpoint_at(&self, num_tokens: u64, unit: u64) -> u64 {
        checkpoint_position(num_tokens, unit, self.drop_eagle, self.hash_lookahead)
    }

    fn required(&self, num_tokens_main: u64) -> u64 {
        num_tokens_main
            .div_ceil(self.block_size)
            .saturating_add(self.num_speculative_blocks)
    }

    /// vLLM's `_needs_internal_checkpoint` for a query `qs..qe`, checkpoint at `cp`.
    fn needs_checkpoint(
        &self,
        table: &[u32],
        st: &AlignReq,
        q: (u64, u64),
        cp: u64,
        end: u64,
    ) -> bool {
        let (qs, qe) = q;
        let idx = qe.div_ceil(self.block_size) as i64 - 2;
        let (bs, hbs, ca) = (
            self.block_size,
            self.hash_block_size,
            self.checkpoint_alignment,
        );
        let spec = self.num_speculative_blocks as i64;
        let len = table.len() as i64;
        qe >= end
            && checkpoint_valid(qs, qe, cp, hbs, bs, ca)
            && idx >= 0
            && (idx >= len
                || table[idx as usize] == NULL_BLOCK
                || (st.allocated && idx >= len - spec))
    }

    /// vLLM's align-mode `get_num_blocks_to_allocate`: the count, and the checkpoint to record
    /// (`None`: leave it; `Some(c)`: set it to `c`), as vLLM records it even when the count
    /// then does not fit. `deferred`: the hit's last block was cached this step.
    pub fn count(
        &self,
        pool: &Pool,
        table: &[u32],
        st: &AlignReq,
        a: &CountArgs,
        deferred: bool,
    ) -> (i64, Option<Option<(u64, usize)>>) {
        if deferred {
            return (i64::from(pool.num_blocks()) + 1, None);
        }
        let n = a.num_tokens_main;
        let required = self.required(n) as i64;
        let mut new = required - a.new_computed.len() as i64 - table.len() as i64;
        let mut cp = self.checkpoint_at(n, self.alignment);
        if !self.needs_checkpoint(table, st, (a.total_computed, n), cp, a.prefill_end) {
            cp = 0;
        }
        let idx = (n.div_ceil(self.block_size) as usize).saturating_sub(2);
        let record = (!a.apply_admission_cap).then_some((cp > 0).then_some((cp, idx)));
        if new > 0 {
            let mut cap = 1 + i64::from(cp > 0);
            if !st.allocated {
                cap += self.num_speculative_blocks as i64;
            }
            new = new.min(cap);
        }
        let evictable = a
            .new_computed
            .iter()
            .filter(|&&b| pool.is_evictable(b))
            .count();
        (new + evictable as i64, record)
    }

    /// Plan vLLM's align-mode `allocate_new_blocks` for a table of `table_len` entries (null
    /// padding, relocated speculative blocks, new blocks): fails, as vLLM asserts, when a step
    /// would take more blocks than its cap. Nothing changes; whether the pool has the new
    /// blocks free is the caller's check ([`AlignAlloc::num_new`]).
    pub fn plan_allocate(
        &self,
        table_len: usize,
        st: &AlignReq,
        num_tokens_main: u64,
    ) -> Result<AlignAlloc> {
        let required = self.required(num_tokens_main) as usize;
        let ck = usize::from(st.checkpoint.is_some());
        let prev = table_len;
        if required <= prev && ck == 0 {
            return Ok(AlignAlloc {
                prev,
                null_end: prev,
                relocate: 0,
                num_new: 0,
                append: false,
            });
        }
        let spec = self.num_speculative_blocks as usize;
        // The running state's position (may be -1 for no main tokens).
        let skipped = required as i64 - spec as i64 - 1;
        let limit = skipped - ck as i64;
        let null_end = if (prev as i64) < skipped {
            limit.max(prev as i64) as usize
        } else {
            prev
        };
        let first_spec = prev.saturating_sub(spec);
        let relocate = match st.allocated {
            true => (first_spec..prev)
                .take_while(|&i| (i as i64) < limit)
                .count(),
            false => 0,
        };
        let num_new = required.saturating_sub(null_end + relocate);
        let cap = 1 + ck + if st.allocated { 0 } else { spec };
        if num_new > cap {
            return Err(Error::invalid(format!(
                "a Mamba state allocation of {num_new} blocks passes the {cap} a step may take \
                 (vLLM asserts)"
            )));
        }
        Ok(AlignAlloc {
            prev,
            null_end,
            relocate,
            num_new,
            append: true,
        })
    }

    /// Apply an [`AlignAlloc`] planned for this table and state (the pool holding its new
    /// blocks free, as the caller checked): returns the entries appended.
    pub fn apply_allocate(
        &self,
        pool: &mut Pool,
        table: &mut Vec<u32>,
        st: &mut AlignReq,
        a: &AlignAlloc,
    ) -> Vec<u32> {
        debug_assert_eq!(table.len(), a.prev, "planned for another table");
        if !a.append {
            st.allocated = true;
            return Vec::new();
        }
        let spec = self.num_speculative_blocks as usize;
        if st.allocated {
            st.last_state = Some(a.prev - 1 - spec);
        } else if a.prev > 0 {
            st.last_state = Some(a.prev - 1);
        }
        table.resize(a.null_end, NULL_BLOCK);
        let first_spec = a.prev.saturating_sub(spec);
        for i in first_spec..first_spec + a.relocate {
            let b = table[i];
            table.push(b);
            table[i] = NULL_BLOCK;
        }
        pool.get_new_blocks(a.num_new, table)
            .expect("the caller checked the pool's free blocks");
        st.allocated = true;
        table[a.prev..].to_vec()
    }

    /// vLLM's align-mode `remove_skipped_blocks`: free the skipped positions past the retired
    /// mark (last first, nulls stepped over), then the running state two steps back once the
    /// processed tokens have passed its block.
    pub fn remove_skipped(
        &self,
        pool: &mut Pool,
        table: &mut [u32],
        st: &mut AlignReq,
        processed: u64,
    ) -> Result<()> {
        let skipped_tokens = processed.saturating_sub(1);
        if skipped_tokens > 0 {
            let last = ((skipped_tokens / self.block_size) as usize).min(table.len());
            let first = st.retired;
            if first < last {
                let freed: Vec<u32> = (first..last)
                    .rev()
                    .map(|i| table[i])
                    .filter(|&b| b != NULL_BLOCK)
                    .collect();
                pool.free_blocks(freed.iter().copied())?;
                table[first..last].fill(NULL_BLOCK);
                st.retired = last;
            }
        }
        if let Some(l) = st.last_state {
            let passed = (l as i64) < processed.div_ceil(self.block_size) as i64 - 1;
            if passed && table.get(l).is_some_and(|&b| b != NULL_BLOCK) {
                pool.free_blocks(std::iter::once(table[l]))?;
                table[l] = NULL_BLOCK;
            }
        }
        Ok(())
    }

    /// Read the hashes caching the tail will need (`cache_blocks` at `num_tokens`).
    pub fn plan_tail(
        &self,
        st: &AlignReq,
        num_tokens: u64,
        boundaries: Boundaries,
        hashes: &mut dyn HashSource,
    ) -> Result<TailPlan> {
        let mut plan = TailPlan {
            num_tokens,
            boundaries,
            ..Default::default()
        };
        let count = hashes.count()? as u64;
        let key_at = |tokens: u64, hashes: &mut dyn HashSource| -> Result<Option<HashKey>> {
            let n = tokens / self.hash_block_size;
            match n > 0 && n <= count && tokens % self.hash_block_size == 0 {
                true => hashes.key(n as usize - 1).map(Some),
                false => Ok(None),
            }
        };
        if let Some((cp, _)) = st.checkpoint {
            plan.checkpoint_key = key_at(cp, hashes)?;
        } else if num_tokens > 0
            && num_tokens == self.checkpoint_at(boundaries.num_prompt_tokens, self.hash_block_size)
        {
            plan.boundary_key = key_at(num_tokens, hashes)?;
        }
        Ok(plan)
    }
}

/// A Mamba align group's state beside its tables: its rules and `cached_blocks_this_step`.
#[derive(Clone, Debug)]
pub struct AlignGroup {
    pub rules: AlignRules,
    pub cached_this_step: HashSet<HashKey, RandomState>,
}

impl AlignGroup {
    pub fn new(rules: AlignRules) -> Self {
        AlignGroup {
            rules,
            cached_this_step: HashSet::with_hasher(RandomState::default()),
        }
    }

    /// Whether a hit ending on `new_computed`'s last block must wait a step.
    pub fn defers(&self, pool: &Pool, new_computed: &[u32]) -> bool {
        new_computed
            .last()
            .and_then(|&b| pool.hash_of(b))
            .is_some_and(|k| self.cached_this_step.contains(k))
    }

    /// Note the hashes of the table's positions `from..to` cached by this call.
    pub fn note_cached(&mut self, pool: &Pool, table: &[u32], from: usize, to: usize) {
        for &b in table.get(from..to.min(table.len())).unwrap_or(&[]) {
            if let Some(k) = pool.hash_of(b).filter(|_| b != NULL_BLOCK) {
                self.cached_this_step.insert(*k);
            }
        }
    }

    /// Heap bytes held (memory accounting).
    pub fn heap_bytes(&self) -> usize {
        self.cached_this_step.capacity() * (std::mem::size_of::<HashKey>() + 1)
    }
}

/// Where a tail caching call stands (group, retention, release).
#[derive(Clone, Copy, Debug)]
pub struct TailCtx {
    pub group: u32,
    pub retention: Retention,
    pub v033: bool,
}

impl AlignGroup {
    /// vLLM's `_cache_partial_tail_block` (block size = hash block size): the hash now keyed
    /// this step, if any, noted as cached this step.
    pub fn cache_tail(
        &mut self,
        pool: &mut Pool,
        table: &[u32],
        st: &AlignReq,
        plan: &TailPlan,
        ctx: TailCtx,
    ) {
        let keyed = match st.checkpoint {
            Some((cp, idx)) => self.checkpoint_tail(pool, table, (cp, idx), plan, ctx),
            None => self.boundary_tail(pool, table, plan, ctx),
        };
        if let Some(k) = keyed {
            self.cached_this_step.insert(k);
        }
    }

    fn checkpoint_tail(
        &self,
        pool: &mut Pool,
        table: &[u32],
        (cp, idx): (u64, usize),
        plan: &TailPlan,
        ctx: TailCtx,
    ) -> Option<HashKey> {
        let r = &self.rules;
        let b = *table.get(idx)?;
        let prompt = cp == r.checkpoint_at(plan.boundaries.num_prompt_tokens, r.alignment);
        let retained = cp % r.block_size == 0 && {
            let spec = GroupSpec::new(
                AttentionKind::MambaAlign {
                    num_speculative_blocks: 0,
                    checkpoint_alignment: 0,
                },
                r.block_size as u32,
            );
            let mask = Retained::new(
                &spec,
                ctx.retention,
                r.alignment,
                Boundaries::default(),
                Default::default(),
            );
            mask.contains((cp / r.block_size) as usize - 1)
        };
        if !prompt && !retained && cp != plan.boundaries.shared_prefix_boundary {
            if b != NULL_BLOCK {
                pool.evict(b);
            }
            return None;
        }
        if b == NULL_BLOCK || pool.hashed_tokens(b) == Some(cp as u32) {
            return None;
        }
        let key = plan.checkpoint_key?;
        pool.evict(b);
        store_one(pool, b, key, ctx.group, cp, r.block_size)
    }

    fn boundary_tail(
        &self,
        pool: &mut Pool,
        table: &[u32],
        plan: &TailPlan,
        ctx: TailCtx,
    ) -> Option<HashKey> {
        let key = plan.boundary_key?;
        let n = plan.num_tokens;
        let idx = (n.div_ceil(self.rules.block_size) as usize).checked_sub(1)?;
        let b = *table.get(idx)?;
        if b == NULL_BLOCK || (ctx.v033 && pool.hashed_tokens(b) == Some(n as u32)) {
            return None;
        }
        let already = pool.hash_of(b) == Some(&key) && pool.group_of(b) == ctx.group;
        if already {
            return Some(key);
        }
        if pool.hashed_tokens(b).is_some_and(|t| u64::from(t) < n) {
            pool.evict(b);
        }
        store_one(pool, b, key, ctx.group, n, self.rules.block_size)
    }
}

/// Key block `b` (uncached) at `tokens` in `group` and log its `BlockStored` (one block).
fn store_one(
    pool: &mut Pool,
    b: u32,
    key: HashKey,
    group: u32,
    tokens: u64,
    bs: u64,
) -> Option<HashKey> {
    pool.insert_hash_in(b, key, group, tokens as u32).ok()?;
    let idx = (tokens / bs) as u32 - 1;
    pool.push_event(Event::StoredIn {
        group,
        first: idx,
        end: idx + 1,
        cached: vec![idx],
    });
    Some(key)
}

impl HitSearch<'_> {
    /// Mamba (align): the rightmost block cached in every group of the spec whose end is a
    /// multiple of the alignment, after that many null blocks.
    pub(super) fn mamba_align(mut self, mut view: View<'_>) -> Result<(Vec<Vec<u32>>, u64)> {
        let n = self.max_blocks.min(view.count()?);
        let mut found = Vec::with_capacity(self.groups.len());
        for i in (0..n).rev() {
            let key = view.key(i)?;
            if !cached_in_all(self.pool, &key, self.groups, &mut found) {
                continue;
            }
            let end = (i as u64 + 1) * self.bs;
            if self.bs != self.alignment && end % self.alignment != 0 {
                continue;
            }
            for (o, &b) in self.out.iter_mut().zip(&found) {
                o.resize(i, NULL_BLOCK);
                o.push(b);
            }
            return Ok((self.out, end));
        }
        Ok((self.out, 0))
    }
}
