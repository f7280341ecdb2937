//! vLLM v1's KV cache manager for one full-attention group, on [`Pool`].
//!
//! This is the whole path vLLM runs through `KVCacheManager` -> `UnitaryKVCacheCoordinator` /
//! `KVCacheCoordinatorNoPrefixCache` -> `FullAttentionManager` -> `BlockPool` when the cache has
//! one full-attention group and no context parallelism (the scope `pagedkv.vllm_v1` checks
//! before it builds this). In that scope vLLM's sliding-window removal, partial-hit
//! copy-on-write and block zeroing are all inactive, and the hash block size equals the block
//! size. A KV connector's external tokens are taken as vLLM takes them
//! ([`SlotRequest::num_external_computed_tokens`]: their blocks after the hit's, before the
//! call's own, not returned).
//!
//! Per request: its block table (block ids, allocation order) and, once any of its blocks was
//! cached or adopted from the cache, the number of its leading blocks already cached (vLLM's
//! `num_cached_block`; absent means "not tracked", which decides how a first allocation counts
//! prefix hits).
//!
//! EAGLE/MTP: a hit loses its last block when the group is in the release's drop set
//! ([`Manager::set_eagle`], [`super::eagle::drop_groups`]); nothing else changes for one group
//! (vLLM's unitary coordinator caches every computed block either way).
//!
//! The per-group pieces (the prefix scan, the blocks-to-allocate count, caching full blocks)
//! are [`super::single_type`]'s, shared with the hybrid groups' managers there.
//!
//! `allocate_slots` is planned first (every check, every hash read) and applied after, so a
//! call that fails changes nothing.

use foldhash::fast::RandomState;

use hashbrown::HashMap;

use super::eagle::drop_groups;
use super::engine::Release;
use super::pool::{HashKey, Pool, NULL_BLOCK};
use super::single_type::{blocks_to_allocate, cache_full_blocks, cached_prefix};
use crate::error::{Error, Result};

/// A request's block hashes, read on demand (`request.block_hashes` in vLLM): a call that
/// caches nothing never asks.
pub trait HashSource {
    /// How many hashes the request has.
    fn count(&mut self) -> Result<usize>;
    fn key(&mut self, i: usize) -> Result<HashKey>;
}

impl HashSource for &[HashKey] {
    fn count(&mut self) -> Result<usize> {
        Ok(<[HashKey]>::len(self))
    }
    fn key(&mut self, i: usize) -> Result<HashKey> {
        Ok(self[i])
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub num_blocks: u32,
    pub block_size: u32,
    pub max_model_len: u64,
    pub enable_caching: bool,
    pub enable_events: bool,
    /// `int(watermark * num_blocks)`, as vLLM computes it.
    pub watermark_blocks: u64,
}

/// One `allocate_slots` call's arguments (vLLM's names), the request's fields included.
/// `B` is how the adopted hit's block ids are held: one group's list (`[u32]`, this
/// manager's), or another engine's (the walk carries the engine's own block ids).
#[derive(Debug)]
pub struct SlotRequest<'a, B: ?Sized = [u32]> {
    pub num_computed_tokens: u64,
    pub num_tokens: u64,
    /// `request.status` is WAITING or PREEMPTED (the watermark applies to those).
    pub waiting_or_preempted: bool,
    pub num_new_tokens: u64,
    pub num_new_computed_tokens: u64,
    /// The prefix-cache hit to adopt; `None` is vLLM's shared empty `KVCacheBlocks`.
    pub new_computed: Option<&'a B>,
    pub num_lookahead_tokens: u64,
    /// Tokens a KV connector supplies past the local hit (vLLM's
    /// `num_external_computed_tokens`): a first allocation gives them blocks of their own,
    /// which the call does not return.
    pub num_external_computed_tokens: u64,
    pub delay_cache_blocks: bool,
    pub full_sequence_must_fit: bool,
    pub reserved_blocks: u64,
    pub has_scheduled_reqs: bool,
}

impl<B: ?Sized> Clone for SlotRequest<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: ?Sized> Copy for SlotRequest<'_, B> {}

impl<B: ?Sized> Default for SlotRequest<'_, B> {
    fn default() -> Self {
        SlotRequest {
            num_computed_tokens: 0,
            num_tokens: 0,
            waiting_or_preempted: false,
            num_new_tokens: 0,
            num_new_computed_tokens: 0,
            new_computed: None,
            num_lookahead_tokens: 0,
            num_external_computed_tokens: 0,
            delay_cache_blocks: false,
            full_sequence_must_fit: false,
            reserved_blocks: 0,
            has_scheduled_reqs: false,
        }
    }
}

impl<B: ?Sized> SlotRequest<'_, B> {
    /// The same arguments with the hit held as `hit` (the caller's view of the same ids).
    pub fn with_hit<'b, C: ?Sized>(&self, hit: Option<&'b C>) -> SlotRequest<'b, C> {
        SlotRequest {
            num_computed_tokens: self.num_computed_tokens,
            num_tokens: self.num_tokens,
            waiting_or_preempted: self.waiting_or_preempted,
            num_new_tokens: self.num_new_tokens,
            num_new_computed_tokens: self.num_new_computed_tokens,
            new_computed: hit,
            num_lookahead_tokens: self.num_lookahead_tokens,
            num_external_computed_tokens: self.num_external_computed_tokens,
            delay_cache_blocks: self.delay_cache_blocks,
            full_sequence_must_fit: self.full_sequence_must_fit,
            reserved_blocks: self.reserved_blocks,
            has_scheduled_reqs: self.has_scheduled_reqs,
        }
    }
}

#[derive(Clone, Debug, Default)]
struct ReqBlocks {
    blocks: Vec<u32>,
    num_cached: Option<u32>,
}

/// What an accepted `allocate_slots` will do, computed before anything changes.
struct Plan {
    adopt: bool,
    /// How many blocks the request holds once its external tokens have blocks (0: none).
    external_upto: usize,
    need_slots: u64,
    cache_upto: Option<u64>,
    cache_first: u32,
    /// How many blocks the request holds once the call is applied: caching stops there.
    held: usize,
}

#[derive(Clone, Debug)]
pub struct Manager {
    pool: Pool,
    cfg: Config,
    /// The group drops the last block of a prefix-cache hit (EAGLE/MTP: [`super::eagle`]).
    drop_eagle: bool,
    /// `num_reprefillable_tokens`: the last computed tokens multi-module MTP may re-prefill,
    /// never cached ([`Manager::set_prefill_lookahead`]).
    reprefillable: u64,
    /// Keyed by request id, hashed with foldhash under a random seed per manager: vLLM's
    /// engine appends a random suffix to every client's id, so clients cannot choose keys that
    /// collide, and the seed keeps the probe pattern private (SipHash, looked up a few times
    /// per request per step, cost ~4% of a native-loop step). hashbrown's map for
    /// `entry_ref`, which copies the id only when the request is new.
    reqs: HashMap<Box<str>, ReqBlocks, RandomState>,
    keys: Vec<HashKey>,
}

fn cdiv(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

impl Manager {
    pub fn new(cfg: Config) -> Result<Self> {
        if cfg.block_size == 0 {
            return Err(Error::invalid("block_size must be positive"));
        }
        Ok(Manager {
            pool: Pool::new(cfg.num_blocks, cfg.enable_caching, cfg.enable_events)?,
            cfg,
            drop_eagle: false,
            reprefillable: 0,
            reqs: HashMap::with_hasher(RandomState::default()),
            keys: Vec::new(),
        })
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    pub fn pool_mut(&mut self) -> &mut Pool {
        &mut self.pool
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The request's blocks (empty for an unknown request).
    pub fn blocks(&self, req: &str) -> &[u32] {
        self.reqs.get(req).map_or(&[], |r| &r.blocks)
    }

    pub fn num_cached_blocks(&self, req: &str) -> Option<u32> {
        self.reqs.get(req).and_then(|r| r.num_cached)
    }

    pub fn num_requests(&self) -> usize {
        self.reqs.len()
    }

    /// Requests whose cached blocks are tracked (vLLM's `len(num_cached_block)`); O(requests).
    pub fn num_tracked_requests(&self) -> usize {
        self.reqs
            .values()
            .filter(|r| r.num_cached.is_some())
            .count()
    }

    /// Lower `max_model_len` to `cap` (the KV cache's size where it holds fewer tokens):
    /// the manager then caps every slot count, lookahead slots included, as vLLM's caps them
    /// at its own `max_model_len`. Only before any request is held (state would otherwise
    /// have been decided under the old length); a cap above the current length changes nothing.
    pub fn cap_max_model_len(&mut self, cap: u64) -> Result<()> {
        if !self.reqs.is_empty() {
            return Err(Error::invalid(
                "max_model_len can be capped only before any request is held",
            ));
        }
        self.cfg.max_model_len = self.cfg.max_model_len.min(cap);
        Ok(())
    }

    /// Set the EAGLE/MTP rule: vLLM's unitary coordinator drops the last matched block when
    /// the group is in the drop set of `release` ([`super::eagle::drop_groups`] for this one
    /// group, flagged `is_eagle_group` or not, under the manager's `use_eagle`).
    pub fn set_eagle(&mut self, release: Release, use_eagle: bool, eagle_group: bool) {
        self.drop_eagle = drop_groups(release, use_eagle, &[eagle_group])[0];
    }

    /// vLLM's `num_prefill_lookahead` (multi-module MTP): the unitary coordinator caches only
    /// the finalized tokens, `n - 1` fewer than those computed. Refused as vLLM refuses it
    /// (prefix caching, an EAGLE group (`eagle`: `use_eagle` or `is_eagle_group`), `n` above
    /// the block size), nothing changed.
    pub fn set_prefill_lookahead(&mut self, n: u64, eagle: bool) -> Result<()> {
        let applies = self.cfg.enable_caching && eagle;
        self.reprefillable = super::eagle::reprefillable_tokens(n, self.cfg.block_size, applies)?;
        Ok(())
    }

    /// Whether a prefix-cache hit drops its last block.
    pub fn drops_eagle_block(&self) -> bool {
        self.drop_eagle
    }

    /// The longest run of cached blocks from the start, at most `max_blocks` long, less its
    /// last block when the group drops EAGLE's block (vLLM's full-attention lookup at the
    /// block size's alignment).
    pub fn longest_cache_hit(
        &self,
        hashes: &mut dyn HashSource,
        max_blocks: usize,
    ) -> Result<Vec<u32>> {
        let mut hit = [Vec::new()];
        cached_prefix(&self.pool, &[0], hashes, 1, max_blocks, &mut hit)?;
        let [mut hit] = hit;
        if self.drop_eagle {
            hit.pop();
        }
        Ok(hit)
    }

    /// vLLM's `get_num_blocks_to_allocate` for this group.
    pub fn num_blocks_to_allocate(
        &self,
        req: &str,
        num_tokens: u64,
        new_computed: &[u32],
    ) -> Result<u64> {
        for &b in new_computed {
            self.pool.check_block(i64::from(b))?;
        }
        self.blocks_to_allocate(req, self.reqs.get(req), num_tokens, new_computed)
    }

    /// [`Self::num_blocks_to_allocate`] for the request's entry `r`, already looked up.
    fn blocks_to_allocate(
        &self,
        req: &str,
        r: Option<&ReqBlocks>,
        num_tokens: u64,
        new_computed: &[u32],
    ) -> Result<u64> {
        let required = cdiv(num_tokens, self.cfg.block_size as u64);
        let have = r.map_or(0, |r| r.blocks.len()) as u64;
        let running = r.is_some_and(|r| r.num_cached.is_some());
        if running && !new_computed.is_empty() {
            return Err(Error::invalid(format!(
                "request {req} is running: it cannot adopt prefix-cache blocks"
            )));
        }
        // Full attention skips no tokens.
        Ok(blocks_to_allocate(
            &self.pool,
            required,
            have,
            running,
            new_computed,
            0,
        ))
    }

    /// vLLM's `allocate_slots`: `Ok(None)` when the blocks do not fit (nothing changes),
    /// else the newly allocated block ids. Caches the request's newly full blocks. The hit
    /// may be held in any list of ids (`[u32]`, `Vec<u32>`, ...).
    pub fn allocate_slots<B: AsRef<[u32]> + ?Sized>(
        &mut self,
        req: &str,
        a: &SlotRequest<'_, B>,
        hashes: &mut dyn HashSource,
    ) -> Result<Option<Vec<u32>>> {
        let a = &a.with_hit(a.new_computed.map(AsRef::as_ref));
        let Some(plan) = self.plan(req, a)? else {
            return Ok(None);
        };
        self.read_cache_keys(&plan, hashes)?;
        Ok(Some(self.apply(req, a, &plan)))
    }

    fn check_args(&self, req: &str, r: Option<&ReqBlocks>, a: &SlotRequest) -> Result<()> {
        if a.num_new_tokens == 0
            && a.num_new_computed_tokens == 0
            && a.num_external_computed_tokens == 0
        {
            return Err(Error::invalid(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt",
            ));
        }
        if a.num_external_computed_tokens > 0 {
            self.check_external(req, r, a)?;
        }
        let bs = self.cfg.block_size as u64;
        if let Some(nc) = a.new_computed {
            if !nc.is_empty() && a.num_new_computed_tokens != nc.len() as u64 * bs {
                return Err(Error::invalid(format!(
                    "num_new_computed_tokens ({}) must cover the {} adopted blocks exactly",
                    a.num_new_computed_tokens,
                    nc.len()
                )));
            }
            // Only what vLLM's lookup can hand over: cached blocks (a hash in the pool, held
            // or evictable), never a block another request holds uncached.
            for &b in nc {
                self.pool.check_block(b as i64)?;
                if b == NULL_BLOCK || self.pool.hash_of(b).is_none() {
                    return Err(Error::invalid(format!("block {b} is not a cached block")));
                }
            }
            let tracked = r.is_some_and(|r| r.num_cached.is_some());
            if tracked && !nc.is_empty() {
                // vLLM asserts a running request has no new prefix-cache hits.
                return Err(Error::invalid(format!(
                    "request {req} is running: it cannot adopt prefix-cache blocks"
                )));
            }
            if !tracked && r.is_some_and(|r| !r.blocks.is_empty()) {
                return Err(Error::invalid(format!(
                    "request {req} holds blocks: it cannot adopt prefix-cache blocks"
                )));
            }
            if !self.cfg.enable_caching && !nc.is_empty() {
                return Err(Error::invalid("computed blocks without prefix caching"));
            }
        }
        Ok(())
    }

    /// External (connector) tokens come with a first allocation, the local hit's and the
    /// connector's tokens together within `max_model_len` (vLLM's scheduler asks nothing
    /// else: its requests hold at most that many tokens). vLLM's manager asserts on a request
    /// that holds blocks it has not tracked, and past `max_model_len` would take more blocks
    /// than it checked were free; both are refused here before anything changes.
    fn check_external(&self, req: &str, r: Option<&ReqBlocks>, a: &SlotRequest) -> Result<()> {
        let computed = a
            .num_computed_tokens
            .saturating_add(a.num_new_computed_tokens)
            .saturating_add(a.num_external_computed_tokens);
        if computed > self.cfg.max_model_len {
            return Err(Error::invalid(format!(
                "{computed} computed tokens (local and external) pass max_model_len {}",
                self.cfg.max_model_len
            )));
        }
        if r.is_some_and(|r| r.num_cached.is_none() && !r.blocks.is_empty()) {
            return Err(Error::invalid(format!(
                "request {req} holds blocks: it cannot take external (connector) tokens"
            )));
        }
        Ok(())
    }

    fn plan(&self, req: &str, a: &SlotRequest) -> Result<Option<Plan>> {
        let r = self.reqs.get(req);
        self.check_args(req, r, a)?;
        let new_computed = a.new_computed.unwrap_or(&[]);
        // Python ints never overflow: saturate where vLLM's sums would pass u64 (each sum is
        // capped at max_model_len or num_tokens before it is used, as in vLLM).
        let local = a
            .num_computed_tokens
            .saturating_add(a.num_new_computed_tokens);
        let ext = a.num_external_computed_tokens;
        let total = local.saturating_add(ext).min(self.cfg.max_model_len);
        let watermark = if a.has_scheduled_reqs && a.waiting_or_preempted {
            self.cfg.watermark_blocks
        } else {
            0
        };
        let free = self.pool.num_free() as u64;
        if a.full_sequence_must_fit {
            let full = a.num_tokens.min(self.cfg.max_model_len);
            if self.blocks_to_allocate(req, r, full, new_computed)? + watermark > free {
                return Ok(None);
            }
        }
        let need_slots = total
            .saturating_add(a.num_new_tokens)
            .saturating_add(a.num_lookahead_tokens)
            .min(self.cfg.max_model_len);
        let needed = self.blocks_to_allocate(req, r, need_slots, new_computed)?;
        // vLLM: `needed + watermark > free - reserved` (a negative right side refuses all).
        if a.reserved_blocks > free || needed + watermark > free - a.reserved_blocks {
            return Ok(None);
        }
        let tracked = r.and_then(|r| r.num_cached);
        // vLLM adopts (and starts tracking) on a first allocation with a hit or with
        // external tokens; a tracked request adopts nothing.
        let adopt = (a.new_computed.is_some() || ext > 0) && tracked.is_none();
        let bs = self.cfg.block_size as u64;
        let external_upto = match adopt {
            true => self.external_blocks_upto(local, ext),
            false => 0,
        };
        let cache_first = match (tracked, adopt) {
            (Some(c), _) => c,
            (None, true) => new_computed.len() as u32,
            (None, false) => 0,
        };
        let cache_upto = (self.cfg.enable_caching && !a.delay_cache_blocks).then(|| {
            let n = total.saturating_add(a.num_new_tokens).min(a.num_tokens);
            n.saturating_sub(self.reprefillable)
        });
        let have = r.map_or(0, |r| r.blocks.len()) + if adopt { new_computed.len() } else { 0 };
        let held = have.max(cdiv(need_slots, bs) as usize);
        Ok(Some(Plan {
            adopt,
            external_upto,
            need_slots,
            cache_upto,
            cache_first,
            held,
        }))
    }

    /// vLLM's `allocate_external_computed_blocks` on a first allocation: the request holds
    /// blocks up to its local and external tokens (checked: within `max_model_len`) before
    /// the call's own new blocks; 0 without external tokens.
    fn external_blocks_upto(&self, local: u64, ext: u64) -> usize {
        match ext {
            0 => 0,
            _ => cdiv(local + ext, self.cfg.block_size as u64) as usize,
        }
    }

    /// Read the hashes of the blocks the call will cache into `self.keys` (may fail; nothing
    /// has changed yet).
    ///
    /// Caching covers blocks `cache_first..full` (`full`: the blocks `cache_upto` tokens fill)
    /// but never past the `held` blocks the request holds: a request longer than
    /// `max_model_len` has tokens beyond its last block. vLLM's `cache_full_blocks` slices its
    /// block list the same way; with KV events on it then indexes `blocks[i]` for every `i` up
    /// to `full` and raises IndexError (having already cached and allocated), so there this
    /// call is refused, before anything changes.
    fn read_cache_keys(&mut self, plan: &Plan, hashes: &mut dyn HashSource) -> Result<()> {
        self.keys.clear();
        let Some(upto) = plan.cache_upto else {
            return Ok(());
        };
        let bs = self.cfg.block_size as u64;
        let full_by_tokens = usize::try_from(upto / bs).unwrap_or(usize::MAX);
        if full_by_tokens <= plan.cache_first as usize {
            return Ok(()); // no block became full: the hashes are not read
        }
        if full_by_tokens > plan.held && self.pool.events_enabled() {
            return Err(Error::invalid(format!(
                "{full_by_tokens} full blocks to cache but the request holds {} (its tokens \
                 pass max_model_len {}); vLLM's manager fails this call too (IndexError) with \
                 KV events on",
                plan.held, self.cfg.max_model_len
            )));
        }
        let num_full = full_by_tokens.min(plan.held).min(hashes.count()?);
        if num_full as u64 * bs > u64::from(u32::MAX) {
            return Err(Error::invalid(format!(
                "a cached block would cover {} tokens; at most 2**32 - 1 are counted",
                num_full as u64 * bs
            )));
        }
        for i in plan.cache_first as usize..num_full {
            let k = hashes.key(i)?;
            self.keys.push(k);
        }
        Ok(())
    }

    fn apply(&mut self, req: &str, a: &SlotRequest, plan: &Plan) -> Vec<u32> {
        let r = self.reqs.entry_ref(req).or_default();
        if plan.adopt {
            let nc = a.new_computed.unwrap_or(&[]);
            self.pool.touch(nc);
            r.blocks.extend_from_slice(nc);
            r.num_cached = Some(r.blocks.len() as u32);
        }
        let n_external = plan.external_upto.saturating_sub(r.blocks.len());
        self.pool
            .get_new_blocks(n_external, &mut r.blocks)
            .expect("planned allocation fits");
        let required = cdiv(plan.need_slots, self.cfg.block_size as u64) as usize;
        let n_new = required.saturating_sub(r.blocks.len());
        let start = r.blocks.len();
        self.pool
            .get_new_blocks(n_new, &mut r.blocks)
            .expect("planned allocation fits");
        let new = r.blocks[start..].to_vec();
        if plan.cache_upto.is_some() {
            Self::cache_new_full(
                &mut self.pool,
                self.cfg.block_size,
                r,
                plan.cache_first,
                &self.keys,
            );
        }
        new
    }

    /// Cache blocks `first..first + keys.len()` of `r` (vLLM's `cache_full_blocks`).
    fn cache_new_full(pool: &mut Pool, bs: u32, r: &mut ReqBlocks, first: u32, keys: &[HashKey]) {
        if keys.is_empty() {
            return;
        }
        // One group (id 0), every block reachable; the table holds no null block.
        cache_full_blocks(pool, 0, bs, &r.blocks, first, keys, |_| true);
        r.num_cached = Some(first + keys.len() as u32);
    }

    /// vLLM's `cache_blocks(request, num_computed_tokens)` (a no-op with caching off).
    pub fn cache_blocks(
        &mut self,
        req: &str,
        num_tokens: u64,
        hashes: &mut dyn HashSource,
    ) -> Result<()> {
        if !self.cfg.enable_caching {
            return Ok(());
        }
        let first = self.num_cached_blocks(req).unwrap_or(0);
        let plan = Plan {
            adopt: false,
            external_upto: 0,
            need_slots: 0,
            cache_upto: Some(num_tokens.saturating_sub(self.reprefillable)),
            cache_first: first,
            held: self.blocks(req).len(),
        };
        self.read_cache_keys(&plan, hashes)?;
        if self.keys.is_empty() {
            return Ok(());
        }
        // `read_cache_keys` read keys only for blocks the request holds: it is known.
        let Some(r) = self.reqs.get_mut(req) else {
            return Ok(());
        };
        Self::cache_new_full(&mut self.pool, self.cfg.block_size, r, first, &self.keys);
        Ok(())
    }

    /// vLLM's `estimate_cached_tokens`: the most tokens any of the request's blocks' hashes
    /// covers.
    pub fn estimate_cached_tokens(&self, req: &str) -> u32 {
        self.blocks(req)
            .iter()
            .filter_map(|&b| self.pool.hashed_tokens(b))
            .max()
            .unwrap_or(0)
    }

    /// Forget the request and hand back its blocks (allocation order), without freeing them.
    pub fn pop_blocks_for_free(&mut self, req: &str) -> Vec<u32> {
        self.reqs.remove(req).map(|r| r.blocks).unwrap_or_default()
    }

    /// vLLM's `free(request)`: the blocks go back tail first.
    pub fn free(&mut self, req: &str) -> Result<()> {
        let blocks = self.pop_blocks_for_free(req);
        self.pool.free_blocks(blocks.iter().rev().copied())
    }

    /// vLLM's `evict_blocks(ids)`: drop each block's cached hash (in use or not).
    pub fn evict_blocks(&mut self, ids: &[i64]) -> Result<()> {
        for &b in ids {
            self.pool.check_block(b)?;
        }
        for &b in ids {
            self.pool.evict(b as u32);
        }
        Ok(())
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// Heap bytes held (memory accounting).
    pub fn heap_bytes(&self) -> usize {
        use crate::mem::{table_bytes, vec_bytes};
        let per_req: usize = self
            .reqs
            .iter()
            .map(|(k, r)| k.len() + vec_bytes(&r.blocks))
            .sum();
        let table = table_bytes(
            self.reqs.capacity(),
            std::mem::size_of::<(Box<str>, ReqBlocks)>(),
        );
        self.pool.heap_bytes() + per_req + table + vec_bytes(&self.keys)
    }

    /// Every invariant, tests only: the pool's, and each block's ref count equals the number
    /// of tables holding it plus `extra(b)` (references held outside, e.g. deferred frees).
    pub fn check(&self, extra: impl Fn(u32) -> u32) -> std::result::Result<(), String> {
        self.pool.check()?;
        let mut holders = vec![0u32; self.pool.num_blocks() as usize];
        for r in self.reqs.values() {
            for &b in &r.blocks {
                holders[b as usize] += 1;
            }
        }
        for b in 1..self.pool.num_blocks() {
            let want = holders[b as usize] + extra(b);
            if self.pool.ref_cnt(b) != want {
                return Err(format!(
                    "block {b}: ref {} but {want} holders",
                    self.pool.ref_cnt(b)
                ));
            }
        }
        Ok(())
    }
}
