//! `V1Manager`: vLLM v1's KV cache manager for one full-attention group (`pagedkv_core::vllm_v1`),
//! for `pagedkv.vllm_v1`. Requests are named by their `request_id` strings; block hashes are
//! read in place from `request.block_hashes` (a list of `bytes`), only those a call needs.
//! Every method reads its arguments before it takes the manager, and the core plans before it
//! mutates, so a raising call changes nothing. One call at a time: a concurrent call raises
//! `InUseError`.
//!
//! This file holds the class (its state and the Python methods: PyO3 allows one
//! `#[pymethods]` block per class); the longer helpers live by job: the vLLM-shaped
//! `allocate_slots` path and its bound Python objects in `crate::vllm_v1::manager_vllm`, the
//! reading of block hashes and block ids from Python in `crate::vllm_v1::manager_inputs`.
//!
//! Costs: each method is one crossing and the core's call (O(blocks moved); a lookup reads
//! only the hashes it needs), plus building the id list it returns.

use crate::args::{Count, Flag, Int64, SatCount};
use crate::errors::{busy, IntoPyResult};
use crate::vllm_v1::call::SlotArgs;
use crate::vllm_v1::events::{EventObjects, EventSink, RemovedEvents, StoredEvents};
use crate::vllm_v1::hybrid::release_of;
use crate::vllm_v1::manager_inputs::{block_ids, PyHashes};
use crate::vllm_v1::manager_vllm::VllmBinding;
use pagedkv_core::vllm_v1::{self as v1, SlotRequest};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};
use std::sync::{Mutex, MutexGuard, TryLockError};

#[pyclass(module = "pagedkv._native", name = "V1Manager", frozen)]
pub struct PyV1Manager {
    inner: Mutex<v1::Manager>,
    /// Set once by `bind_vllm`: what the vLLM-shaped `allocate_slots` needs from Python.
    pub(super) vllm: std::sync::OnceLock<VllmBinding>,
    /// Set once by `bind_removed_events` / `bind_stored_events`.
    pub(super) removed_events: std::sync::OnceLock<RemovedEvents>,
    pub(super) stored_events: std::sync::OnceLock<StoredEvents>,
    /// Set once by `bind_event_sink`.
    pub(super) event_sink: std::sync::OnceLock<EventSink>,
}

impl PyV1Manager {
    pub(super) fn lock(&self) -> PyResult<MutexGuard<'_, v1::Manager>> {
        match self.inner.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(busy("this V1Manager")),
        }
    }
}

#[pymethods]
impl PyV1Manager {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (num_blocks, block_size, max_model_len, enable_caching, enable_events,
        watermark_blocks, use_eagle=false, eagle_group=false, release="0.33",
        prefill_lookahead=None))]
    fn new(
        num_blocks: Count,
        block_size: Count,
        max_model_len: SatCount,
        enable_caching: bool,
        enable_events: bool,
        watermark_blocks: SatCount,
        use_eagle: bool,
        eagle_group: bool,
        release: &str,
        prefill_lookahead: Option<SatCount>,
    ) -> PyResult<Self> {
        let cfg = v1::Config {
            num_blocks: num_blocks.u32("num_blocks")?,
            block_size: block_size.u32("block_size")?,
            max_model_len: max_model_len.0,
            enable_caching,
            enable_events,
            watermark_blocks: watermark_blocks.0,
        };
        let mut manager = v1::Manager::new(cfg).py()?;
        manager.set_eagle(release_of(release)?, use_eagle, eagle_group);
        manager
            .set_prefill_lookahead(
                prefill_lookahead.unwrap_or_default().0,
                use_eagle || eagle_group,
            )
            .py()?;
        Ok(PyV1Manager {
            inner: Mutex::new(manager),
            vllm: std::sync::OnceLock::new(),
            removed_events: std::sync::OnceLock::new(),
            stored_events: std::sync::OnceLock::new(),
            event_sink: std::sync::OnceLock::new(),
        })
    }

    /// Give `vllm_allocate_slots` its Python objects (once).
    #[pyo3(signature = (empty, blocks_cls, waiting, preempted, request_cls=None))]
    fn bind_vllm(
        &self,
        empty: Py<PyAny>,
        blocks_cls: Py<PyAny>,
        waiting: Py<PyAny>,
        preempted: Py<PyAny>,
        request_cls: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let b = VllmBinding {
            empty,
            blocks_cls,
            waiting,
            preempted,
            request_cls,
        };
        self.vllm
            .set(b)
            .map_err(|_| crate::errors::invalid("bind_vllm was already called"))
    }

    /// vLLM's `KVCacheManager.allocate_slots`, signature and result included: reads the
    /// request's fields itself, so the scheduler's call crosses into Rust once and runs no
    /// pagedkv Python code unless blocks are new (a `KVCacheBlocks` is built) or events were
    /// logged. A KV connector's external tokens are taken as vLLM takes them; encoder
    /// tokens must be 0 (outside the manager's scope); `skip_zeroing_group_ids` is read by
    /// no one (the manager zeroes no block).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (request, num_new_tokens, num_new_computed_tokens=SatCount(0),
        new_computed_blocks=None, num_lookahead_tokens=SatCount(0),
        num_external_computed_tokens=SatCount(0), delay_cache_blocks=Flag(false),
        num_encoder_tokens=SatCount(0), full_sequence_must_fit=Flag(false),
        reserved_blocks=SatCount(0), has_scheduled_reqs=Flag(true), skip_zeroing_group_ids=None),
        text_signature = "($self, request, num_new_tokens, num_new_computed_tokens=0, \
        new_computed_blocks=None, num_lookahead_tokens=0, num_external_computed_tokens=0, \
        delay_cache_blocks=False, num_encoder_tokens=0, full_sequence_must_fit=False, \
        reserved_blocks=0, has_scheduled_reqs=True, skip_zeroing_group_ids=None)")]
    fn vllm_allocate_slots<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        num_new_tokens: SatCount,
        num_new_computed_tokens: SatCount,
        new_computed_blocks: Option<Bound<'py, PyAny>>,
        num_lookahead_tokens: SatCount,
        num_external_computed_tokens: SatCount,
        delay_cache_blocks: Flag,
        num_encoder_tokens: SatCount,
        full_sequence_must_fit: Flag,
        reserved_blocks: SatCount,
        has_scheduled_reqs: Flag,
        skip_zeroing_group_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = skip_zeroing_group_ids;
        let a = SlotArgs {
            num_new_tokens: num_new_tokens.0,
            num_new_computed_tokens: num_new_computed_tokens.0,
            new_computed_blocks,
            num_lookahead_tokens: num_lookahead_tokens.0,
            num_external_computed_tokens: num_external_computed_tokens.0,
            delay_cache_blocks: delay_cache_blocks.0,
            num_encoder_tokens: num_encoder_tokens.0,
            full_sequence_must_fit: full_sequence_must_fit.0,
            reserved_blocks: reserved_blocks.0,
            has_scheduled_reqs: has_scheduled_reqs.0,
        };
        self.allocate_for_vllm(py, request, &a)
    }

    /// vLLM's `allocate_slots` with the request's fields spelled out: the new block ids, or
    /// `None` when they do not fit.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (request_id, num_computed_tokens, num_tokens, waiting_or_preempted,
        num_new_tokens, num_new_computed_tokens, new_computed, num_lookahead_tokens,
        delay_cache_blocks, full_sequence_must_fit, reserved_blocks, has_scheduled_reqs,
        block_hashes, num_external_computed_tokens=SatCount(0)),
        text_signature = "($self, request_id, num_computed_tokens, num_tokens, \
        waiting_or_preempted, num_new_tokens, num_new_computed_tokens, new_computed, \
        num_lookahead_tokens, delay_cache_blocks, full_sequence_must_fit, reserved_blocks, \
        has_scheduled_reqs, block_hashes, num_external_computed_tokens=0)")]
    fn allocate_slots(
        &self,
        request_id: &str,
        num_computed_tokens: SatCount,
        num_tokens: SatCount,
        waiting_or_preempted: bool,
        num_new_tokens: SatCount,
        num_new_computed_tokens: SatCount,
        new_computed: Option<Vec<Int64>>,
        num_lookahead_tokens: SatCount,
        delay_cache_blocks: Flag,
        full_sequence_must_fit: Flag,
        reserved_blocks: SatCount,
        has_scheduled_reqs: Flag,
        block_hashes: &Bound<'_, PyAny>,
        num_external_computed_tokens: SatCount,
    ) -> PyResult<Option<Vec<u32>>> {
        let mut hashes = PyHashes::new(block_hashes)?;
        let new_computed = new_computed.map(|v| block_ids(&v)).transpose()?;
        let a = SlotRequest {
            num_computed_tokens: num_computed_tokens.0,
            num_tokens: num_tokens.0,
            waiting_or_preempted,
            num_new_tokens: num_new_tokens.0,
            num_new_computed_tokens: num_new_computed_tokens.0,
            new_computed: new_computed.as_deref(),
            num_lookahead_tokens: num_lookahead_tokens.0,
            num_external_computed_tokens: num_external_computed_tokens.0,
            delay_cache_blocks: delay_cache_blocks.0,
            full_sequence_must_fit: full_sequence_must_fit.0,
            reserved_blocks: reserved_blocks.0,
            has_scheduled_reqs: has_scheduled_reqs.0,
        };
        self.lock()?
            .allocate_slots(request_id, &a, &mut hashes)
            .py()
    }

    /// The longest cached prefix of `block_hashes`, at most `max_blocks` blocks.
    fn longest_cache_hit(
        &self,
        block_hashes: &Bound<'_, PyAny>,
        max_blocks: SatCount,
    ) -> PyResult<Vec<u32>> {
        let mut hashes = PyHashes::new(block_hashes)?;
        self.lock()?
            .longest_cache_hit(&mut hashes, max_blocks.usize())
            .py()
    }

    /// vLLM's `get_num_blocks_to_allocate` for the request (adopting `new_computed`).
    fn num_blocks_to_allocate(
        &self,
        request_id: &str,
        num_tokens: Count,
        new_computed: Vec<Int64>,
    ) -> PyResult<u64> {
        let new_computed = block_ids(&new_computed)?;
        self.lock()?
            .num_blocks_to_allocate(request_id, num_tokens.0, &new_computed)
            .py()
    }

    /// vLLM's `cache_blocks`: cache the request's blocks that are full within `num_tokens`.
    fn cache_blocks(
        &self,
        request_id: &str,
        num_tokens: SatCount,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let mut hashes = PyHashes::new(block_hashes)?;
        self.lock()?
            .cache_blocks(request_id, num_tokens.0, &mut hashes)
            .py()
    }

    /// vLLM's `free(request)`: the request's blocks go back, tail first.
    fn free(&self, request_id: &Bound<'_, PyString>) -> PyResult<()> {
        self.lock()?.free(request_id.to_str()?).py()
    }

    /// Forget the request; its block ids (allocation order), still referenced.
    fn pop_blocks_for_free(&self, request_id: &Bound<'_, PyString>) -> PyResult<Vec<u32>> {
        Ok(self.lock()?.pop_blocks_for_free(request_id.to_str()?))
    }

    /// Drop one reference per block, in eviction-priority order (all or nothing).
    fn free_blocks(&self, block_ids: Vec<Int64>) -> PyResult<()> {
        let block_ids = self::block_ids(&block_ids)?;
        self.lock()?
            .pool_mut()
            .free_blocks(block_ids.iter().copied())
            .py()
    }

    /// Drop the cached hash of each listed block (all ids checked first).
    fn evict_blocks(&self, block_ids: Vec<Int64>) -> PyResult<()> {
        let ids: Vec<i64> = block_ids.iter().map(|b| b.0).collect();
        self.lock()?.evict_blocks(&ids).py()
    }

    /// The request's block table (empty for an unknown request).
    fn block_ids(&self, request_id: &str) -> PyResult<Vec<u32>> {
        Ok(self.lock()?.blocks(request_id).to_vec())
    }

    /// How many leading blocks of the request are cached (`None`: not tracked).
    fn num_cached_blocks(&self, request_id: &str) -> PyResult<Option<u32>> {
        Ok(self.lock()?.num_cached_blocks(request_id))
    }

    /// Lower `max_model_len` to `cap` before any request is held (the native loop's length
    /// cap where the KV cache holds fewer tokens than `max_model_len`).
    fn cap_max_model_len(&self, cap: SatCount) -> PyResult<()> {
        self.lock()?.cap_max_model_len(cap.0).py()
    }

    /// vLLM's `reset_prefix_cache`: only when every block but the null block is free.
    fn reset_prefix_cache(&self) -> PyResult<bool> {
        Ok(self.lock()?.reset_prefix_cache())
    }

    /// Free blocks (evictable cached ones included), the null block excluded.
    fn num_free_blocks(&self) -> PyResult<usize> {
        Ok(self.lock()?.pool().num_free())
    }

    /// vLLM's KV cache usage: the used share of the blocks other than the null block.
    fn usage(&self) -> PyResult<f64> {
        Ok(self.lock()?.pool().usage())
    }

    /// The block's reference count.
    fn ref_cnt(&self, block_id: Int64) -> PyResult<u32> {
        let m = self.lock()?;
        let b = m.pool().check_block(block_id.0).py()?;
        Ok(m.pool().ref_cnt(b))
    }

    /// The hash block `block_id` is cached under (`None` when it is not cached).
    fn block_hash<'py>(
        &self,
        py: Python<'py>,
        block_id: Int64,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let m = self.lock()?;
        let b = m.pool().check_block(block_id.0).py()?;
        Ok(m.pool().hash_of(b).map(|k| PyBytes::new(py, k.as_bytes())))
    }

    /// Tokens the block's hash covers (vLLM's `block_hash_num_tokens`); `None` if uncached.
    fn hashed_tokens(&self, block_id: Int64) -> PyResult<Option<u32>> {
        let m = self.lock()?;
        let b = m.pool().check_block(block_id.0).py()?;
        Ok(m.pool().hashed_tokens(b))
    }

    /// vLLM's `estimate_cached_tokens`: the most tokens a hash of the request's blocks covers.
    fn estimate_cached_tokens(&self, request_id: &str) -> PyResult<u32> {
        Ok(self.lock()?.estimate_cached_tokens(request_id))
    }

    /// Whether the block is in the free-block queue.
    fn is_free(&self, block_id: Int64) -> PyResult<bool> {
        let m = self.lock()?;
        let b = m.pool().check_block(block_id.0).py()?;
        Ok(m.pool().is_free(b))
    }

    /// The free-block queue, head (handed out next) first.
    fn free_queue(&self) -> PyResult<Vec<u32>> {
        Ok(self.lock()?.pool().free_queue())
    }

    /// Hashes in the prefix-cache map.
    fn num_cached_hashes(&self) -> PyResult<usize> {
        Ok(self.lock()?.pool().num_cached_hashes())
    }

    /// Events since the last call: `("stored", first, end)` (blocks of the request the last
    /// call concerned), `("removed", hash, 0)`, `("cleared", 0, 0)`; an event built natively
    /// (after `bind_removed_events` / `bind_stored_events`; a `BlockStored` needs `request`,
    /// the request the last call concerned) comes as `("event", object, 0)`.
    #[pyo3(signature = (request=None))]
    fn take_events<'py>(
        &self,
        py: Python<'py>,
        request: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        let events = self.lock()?.pool_mut().take_events();
        let built = EventObjects {
            removed: self.removed_events.get(),
            stored: self.stored_events.get().zip(request),
        };
        events.iter().map(|e| built.tuple(py, e)).collect()
    }

    /// Have `take_events` build vLLM's `BlockRemoved(block_hashes=[hash], medium, 0)` itself
    /// (`cls`'s first fields must be those three, in that order; the caller checks).
    fn bind_removed_events(
        &self,
        cls: Py<PyAny>,
        medium: Py<PyAny>,
        int_hashes: bool,
    ) -> PyResult<()> {
        self.removed_events
            .set(RemovedEvents {
                cls,
                medium,
                int_hashes,
            })
            .map_err(|_| crate::errors::invalid("bind_removed_events was already called"))
    }

    /// Have calls that log KV events append vLLM's event objects to `events` themselves (no
    /// Python call unless an event is of a kind built in Python: then `build(raw_events,
    /// request)` builds it, `raw_events` as `take_events` gives them).
    fn bind_event_sink(&self, events: Py<PyList>, build: Py<PyAny>) -> PyResult<()> {
        self.event_sink
            .set(EventSink { events, build })
            .map_err(|_| crate::errors::invalid("bind_event_sink was already called"))
    }

    /// Have `take_events(request)` build vLLM's `BlockStored` itself for a plain request
    /// (see [`StoredEvents`]; `cls`'s first 14 fields must be `BlockStored`'s of vLLM 0.32 and
    /// 0.33, in that order; the caller checks; `lookahead`: vLLM 0.33's
    /// `num_hash_lookahead_tokens`, whose `lookahead_token_ids` follow them). `groups`:
    /// `[(spec_kind, sliding_window, block_size)]`, this manager's one group.
    #[pyo3(signature = (
        cls, medium, int_hashes, groups, hash_block_size, request_cls, lookahead=0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn bind_stored_events(
        &self,
        cls: Py<PyAny>,
        medium: Py<PyAny>,
        int_hashes: bool,
        groups: Vec<(Py<PyAny>, Py<PyAny>, usize)>,
        hash_block_size: usize,
        request_cls: Py<PyAny>,
        lookahead: usize,
    ) -> PyResult<()> {
        let stored = StoredEvents::new(
            cls,
            medium,
            int_hashes,
            groups,
            hash_block_size,
            request_cls,
        )?
        .with_lookahead(lookahead);
        self.stored_events
            .set(stored)
            .map_err(|_| crate::errors::invalid("bind_stored_events was already called"))
    }

    /// Blocks in the pool, the null block included.
    #[getter]
    fn num_blocks(&self) -> PyResult<u32> {
        Ok(self.lock()?.pool().num_blocks())
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> PyResult<u32> {
        Ok(self.lock()?.config().block_size)
    }

    /// Requests holding a block table.
    #[getter]
    fn num_requests(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_requests())
    }

    /// Requests whose cached blocks are tracked (vLLM's `len(num_cached_block)`).
    #[getter]
    fn num_tracked_requests(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_tracked_requests())
    }

    /// Whether a prefix-cache hit drops its last block (EAGLE/MTP, per the release's rule).
    #[getter]
    fn drops_eagle_block(&self) -> PyResult<bool> {
        Ok(self.lock()?.drops_eagle_block())
    }

    /// Heap bytes the manager holds.
    fn heap_bytes(&self) -> PyResult<usize> {
        Ok(self.lock()?.heap_bytes())
    }

    /// Check every invariant; `extra_refs` maps block ids to references held outside tables.
    #[pyo3(signature = (extra_refs=None))]
    fn check(&self, extra_refs: Option<std::collections::HashMap<u32, u32>>) -> PyResult<()> {
        let extra = extra_refs.unwrap_or_default();
        self.lock()?
            .check(|b| extra.get(&b).copied().unwrap_or(0))
            .map_err(crate::errors::invalid)
    }
}
