//! `V1Hybrid`: vLLM v1's KV cache manager for several KV cache groups (hybrid models: full
//! attention, sliding window, chunked local attention, Mamba in mode "none" or "align"), over the core's
//! [`pagedkv_core::vllm_v1::coordinator::Hybrid`], for `pagedkv.vllm_v1._hybrid`. Requests are
//! named by their `request_id`; the Python caller reads the request's fields and passes them
//! (one crossing per call, never per block); block hashes are read in place from
//! `request.block_hashes`, only those a call needs.
//!
//! Invariants: every method reads and checks its arguments before it takes the manager, and
//! the core plans before it mutates, so a raising call changes nothing (except, as in vLLM,
//! an `allocate_slots` refused for lack of blocks may have freed blocks that left a window).
//! One call at a time: a concurrent call raises `InUseError`. Block ids are per group,
//! `list[list[int]]` in vLLM's group order.
//!
//! Costs: each call is the core's (O(groups + blocks moved); a lookup a few passes over the
//! hashes it reads) plus building the per-group id lists it returns.

use crate::args::{Count, Flag, Int64, SatCount};
use crate::errors::{busy, IntoPyResult};
use crate::vllm_v1::events::{EventObjects, EventSink, RemovedEvents, StoredEvents};
use crate::vllm_v1::manager_inputs::{block_ids, PyHashes};
use pagedkv_core::vllm_v1::coordinator::{Count as BlockCount, Hybrid, HybridConfig, HybridSlots};
use pagedkv_core::vllm_v1::retention::{Boundaries, Retention};
use pagedkv_core::vllm_v1::single_type::{AttentionKind, GroupSpec};
use pagedkv_core::vllm_v1::Release;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};
use std::sync::{Mutex, MutexGuard, OnceLock, TryLockError};

/// vLLM v1's KV cache manager for several KV cache groups (full, sliding-window, chunked local
/// attention) over one pool; block ids per group. A failed call changes nothing.
#[pyclass(module = "pagedkv._native", name = "V1Hybrid", frozen)]
pub struct PyV1Hybrid {
    inner: Mutex<Hybrid>,
    /// Set once by `bind_removed_events` / `bind_stored_events` / `bind_event_sink`.
    removed_events: OnceLock<RemovedEvents>,
    stored_events: OnceLock<StoredEvents>,
    event_sink: OnceLock<EventSink>,
}

/// One group as Python describes it: `(kind, block_size, size, layout)` with `kind` one of
/// `"full"`, `"sliding_window"` (`size`: the window), `"chunked_local"` (`size`: the chunk),
/// `"mamba"` (mode "none"; `size`: its `num_speculative_blocks`), `"mamba_align"` (mode
/// "align"; likewise, `checkpoint` its prefill checkpoint alignment, 0 for none); `retained`
/// a window's `extra_retained_tokens` (0 for every other kind).
fn group_spec(
    kind: &str,
    block_size: u32,
    size: u32,
    layout: u32,
    (checkpoint, retained): (u32, u32),
) -> PyResult<GroupSpec> {
    if retained != 0 && kind != "sliding_window" {
        return Err(crate::errors::invalid(format!(
            "extra_retained_tokens apply to sliding-window groups only, got {retained} for a \
             {kind:?} group"
        )));
    }
    let kind = match kind {
        "full" => AttentionKind::Full,
        "sliding_window" => AttentionKind::SlidingWindow {
            sliding_window: size,
            extra_retained_tokens: retained,
        },
        "chunked_local" => AttentionKind::ChunkedLocal {
            attention_chunk_size: size,
        },
        "mamba" => AttentionKind::Mamba {
            num_speculative_blocks: size,
        },
        "mamba_align" => AttentionKind::MambaAlign {
            num_speculative_blocks: size,
            checkpoint_alignment: checkpoint,
        },
        other => {
            return Err(crate::errors::invalid(format!(
                "unknown KV cache group kind {other:?}"
            )))
        }
    };
    Ok(GroupSpec {
        kind,
        block_size,
        layout,
    })
}

pub(crate) fn release_of(release: &str) -> PyResult<Release> {
    match release {
        "0.32" => Ok(Release::V032),
        "0.33" => Ok(Release::V033),
        other => Err(crate::errors::invalid(format!(
            "unknown vLLM release {other:?}"
        ))),
    }
}

/// A per-group list of counts (`None` or empty: 0 for every group), each a u32.
fn per_group(values: Option<Vec<Count>>, num_groups: usize, what: &str) -> PyResult<Vec<u32>> {
    let values = values.unwrap_or_default();
    if values.is_empty() {
        return Ok(vec![0; num_groups]);
    }
    if values.len() != num_groups {
        return Err(crate::errors::invalid(format!(
            "{} {what} values for {num_groups} KV cache groups",
            values.len()
        )));
    }
    values.iter().map(|v| v.u32(what)).collect()
}

/// Per-group block ids from Python (each id checked to be a u32; the pool checks the range).
fn group_ids(groups: &[Vec<Int64>]) -> PyResult<Vec<Vec<u32>>> {
    groups.iter().map(|g| block_ids(g)).collect()
}

impl PyV1Hybrid {
    /// What this manager's events can be built with natively (`request`: the one the
    /// logged calls concerned).
    fn event_objects<'a, 'py>(
        &'a self,
        request: Option<&'a Bound<'py, PyAny>>,
    ) -> EventObjects<'a, 'py> {
        EventObjects {
            removed: self.removed_events.get(),
            stored: self.stored_events.get().zip(request),
        }
    }

    pub(crate) fn lock(&self) -> PyResult<MutexGuard<'_, Hybrid>> {
        match self.inner.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(busy("this V1Hybrid")),
        }
    }
}

#[pymethods]
impl PyV1Hybrid {
    /// `groups`: `(kind, block_size, size, layout)` per group (`size`: the window, the chunk
    /// or a Mamba group's speculative blocks); `prefix_cache_retention_interval` as vLLM's `KVCacheConfig` holds it (checked as
    /// vLLM's coordinator checks it); `zero_new_blocks`: vLLM's `needs_kv_cache_zeroing`;
    /// `hash_lookahead_tokens`: vLLM 0.33's `num_hash_lookahead_tokens`; `prefill_lookahead`:
    /// vLLM's `num_prefill_lookahead` (multi-module MTP); `checkpoint_alignments` and
    /// `extra_retained_tokens`: per group (`None`: 0 each), a Mamba "align" group's prefill
    /// checkpoint alignment and a sliding window's `extra_retained_tokens`.
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (num_blocks, groups, hash_block_size, scheduler_block_size,
        max_model_len, max_in_flight_tokens, enable_caching, enable_events, watermark_blocks,
        release, prefix_cache_retention_interval=None, use_eagle=false, eagle_groups=None,
        zero_new_blocks=false, checkpoint_alignments=None, hash_lookahead_tokens=None,
        prefill_lookahead=None, extra_retained_tokens=None))]
    fn new(
        num_blocks: Count,
        groups: Vec<(String, Count, Count, Count)>,
        hash_block_size: Count,
        scheduler_block_size: Count,
        max_model_len: SatCount,
        max_in_flight_tokens: SatCount,
        enable_caching: bool,
        enable_events: bool,
        watermark_blocks: SatCount,
        release: &str,
        prefix_cache_retention_interval: Option<Int64>,
        use_eagle: bool,
        eagle_groups: Option<Vec<bool>>,
        zero_new_blocks: bool,
        checkpoint_alignments: Option<Vec<Count>>,
        hash_lookahead_tokens: Option<SatCount>,
        prefill_lookahead: Option<SatCount>,
        extra_retained_tokens: Option<Vec<Count>>,
    ) -> PyResult<Self> {
        let checkpoints = per_group(checkpoint_alignments, groups.len(), "checkpoint alignment")?;
        let retained = per_group(extra_retained_tokens, groups.len(), "extra_retained_tokens")?;
        let groups = groups
            .iter()
            .zip(checkpoints.into_iter().zip(retained))
            .map(|((k, bs, size, layout), extras)| {
                group_spec(
                    k,
                    bs.u32("block_size")?,
                    size.u32("window or chunk size")?,
                    layout.u32("layout")?,
                    extras,
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        let scheduler_block_size = scheduler_block_size.u32("scheduler_block_size")?;
        let has_window = groups.iter().any(|g| g.kind.retention_applies());
        let retention = Retention::from_interval(
            prefix_cache_retention_interval.map(|i| i.0),
            scheduler_block_size,
            has_window,
        )
        .py()?;
        let cfg = HybridConfig {
            num_blocks: num_blocks.u32("num_blocks")?,
            groups,
            hash_block_size: hash_block_size.u32("hash_block_size")?,
            scheduler_block_size,
            max_model_len: max_model_len.0,
            max_in_flight_tokens: max_in_flight_tokens.0,
            enable_caching,
            enable_events,
            watermark_blocks: watermark_blocks.0,
            release: release_of(release)?,
            retention,
            use_eagle,
            eagle_groups: eagle_groups.unwrap_or_default(),
            hash_lookahead_tokens: hash_lookahead_tokens.unwrap_or_default().0,
        };
        let mut hybrid = Hybrid::new(cfg).py()?.with_zeroing(zero_new_blocks);
        hybrid
            .set_prefill_lookahead(prefill_lookahead.unwrap_or_default().0)
            .py()?;
        Ok(PyV1Hybrid {
            inner: Mutex::new(hybrid),
            removed_events: OnceLock::new(),
            stored_events: OnceLock::new(),
            event_sink: OnceLock::new(),
        })
    }

    /// vLLM's `coordinator.find_longest_cache_hit(block_hashes, max_cache_hit_length)`: the
    /// hit's blocks per group, its length in tokens and the `shared_prefix_boundary`
    /// `get_computed_blocks` makes of it.
    fn find_longest_cache_hit(
        &self,
        block_hashes: &Bound<'_, PyAny>,
        max_cache_hit_length: SatCount,
    ) -> PyResult<(Vec<Vec<u32>>, u64, u64)> {
        let mut hashes = PyHashes::new(block_hashes)?;
        let hit = self
            .lock()?
            .find_longest_cache_hit(&mut hashes, max_cache_hit_length.0)
            .py()?;
        let boundary = hit.shared_prefix_boundary();
        Ok((hit.blocks, hit.num_tokens, boundary))
    }

    /// vLLM's `KVCacheManager.allocate_slots` with the request's fields spelled out (a KV
    /// connector's external tokens taken beside attention groups; no encoder tokens): the new
    /// block ids per group, `None` when they do not fit.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (request_id, num_computed_tokens, num_tokens, num_in_flight_tokens,
        waiting_or_preempted, num_new_tokens, num_new_computed_tokens, new_computed,
        num_lookahead_tokens, delay_cache_blocks, full_sequence_must_fit, reserved_blocks,
        has_scheduled_reqs, block_hashes, num_prompt_tokens=SatCount(0),
        shared_prefix_boundary=SatCount(0), num_external_computed_tokens=SatCount(0)),
        text_signature = "($self, request_id, num_computed_tokens, num_tokens, \
        num_in_flight_tokens, waiting_or_preempted, num_new_tokens, num_new_computed_tokens, \
        new_computed, num_lookahead_tokens, delay_cache_blocks, full_sequence_must_fit, \
        reserved_blocks, has_scheduled_reqs, block_hashes, num_prompt_tokens=0, \
        shared_prefix_boundary=0, num_external_computed_tokens=0)")]
    fn allocate_slots(
        &self,
        request_id: &str,
        num_computed_tokens: SatCount,
        num_tokens: SatCount,
        num_in_flight_tokens: SatCount,
        waiting_or_preempted: bool,
        num_new_tokens: SatCount,
        num_new_computed_tokens: SatCount,
        new_computed: Option<Vec<Vec<Int64>>>,
        num_lookahead_tokens: SatCount,
        delay_cache_blocks: Flag,
        full_sequence_must_fit: Flag,
        reserved_blocks: SatCount,
        has_scheduled_reqs: Flag,
        block_hashes: &Bound<'_, PyAny>,
        num_prompt_tokens: SatCount,
        shared_prefix_boundary: SatCount,
        num_external_computed_tokens: SatCount,
    ) -> PyResult<Option<Vec<Vec<u32>>>> {
        let mut hashes = PyHashes::new(block_hashes)?;
        let new_computed = new_computed.map(|g| group_ids(&g)).transpose()?;
        let a = HybridSlots {
            num_computed_tokens: num_computed_tokens.0,
            num_tokens: num_tokens.0,
            num_in_flight_tokens: num_in_flight_tokens.0,
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
            boundaries: Boundaries {
                num_prompt_tokens: num_prompt_tokens.0,
                shared_prefix_boundary: shared_prefix_boundary.0,
            }
            .into(),
        };
        self.lock()?
            .allocate_slots(request_id, &a, &mut hashes)
            .py()
    }

    /// vLLM's `coordinator.get_num_blocks_to_allocate` (no encoder tokens); a Mamba align
    /// group also reads `num_tokens_main_model` (default: `num_tokens`) and `prefill_end`, and
    /// records the chunk's checkpoint (uncapped counts), as vLLM does.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (request_id, num_tokens, new_computed, total_computed_tokens,
        apply_admission_cap=false, num_tokens_main_model=None, prefill_end=SatCount(0)),
        text_signature = "($self, request_id, num_tokens, new_computed, total_computed_tokens, \
        apply_admission_cap=False, num_tokens_main_model=None, prefill_end=0)")]
    fn num_blocks_to_allocate(
        &self,
        request_id: &str,
        num_tokens: SatCount,
        new_computed: Option<Vec<Vec<Int64>>>,
        total_computed_tokens: SatCount,
        apply_admission_cap: bool,
        num_tokens_main_model: Option<SatCount>,
        prefill_end: SatCount,
    ) -> PyResult<i64> {
        let new_computed = new_computed.map(|g| group_ids(&g)).transpose()?;
        let mut m = self.lock()?;
        if let Some(nc) = &new_computed {
            if nc.len() != m.num_groups() {
                return Err(crate::errors::invalid(format!(
                    "blocks for {} groups, the manager has {}",
                    nc.len(),
                    m.num_groups()
                )));
            }
            for &b in nc.iter().flatten() {
                m.pool().check_block(i64::from(b)).py()?;
            }
        }
        let c = BlockCount {
            num_tokens: num_tokens.0,
            num_tokens_main: num_tokens_main_model.map_or(num_tokens.0, |n| n.0),
            total_computed: total_computed_tokens.0,
            prefill_end: prefill_end.0,
            apply_admission_cap,
        };
        m.num_blocks_to_allocate(request_id, &c, new_computed.as_deref())
            .py()
    }

    /// vLLM's `new_step_starts`: Mamba align groups forget the states cached this step.
    fn new_step_starts(&self) -> PyResult<()> {
        self.lock()?.new_step_starts();
        Ok(())
    }

    /// vLLM's `remove_skipped_blocks(request_id, processed_computed_tokens)`.
    fn remove_skipped_blocks(&self, request_id: &str, processed: SatCount) -> PyResult<()> {
        self.lock()?
            .remove_skipped_blocks(request_id, processed.0)
            .py()
    }

    /// vLLM's `cache_blocks(request, num_computed_tokens)` (the caller checks caching is on),
    /// the request's `num_prompt_tokens` and `shared_prefix_boundary` spelled out.
    #[pyo3(signature = (request_id, num_tokens, block_hashes, num_prompt_tokens=SatCount(0),
        shared_prefix_boundary=SatCount(0)),
        text_signature = "($self, request_id, num_tokens, block_hashes, num_prompt_tokens=0, \
        shared_prefix_boundary=0)")]
    fn cache_blocks(
        &self,
        request_id: &str,
        num_tokens: SatCount,
        block_hashes: &Bound<'_, PyAny>,
        num_prompt_tokens: SatCount,
        shared_prefix_boundary: SatCount,
    ) -> PyResult<()> {
        let mut hashes = PyHashes::new(block_hashes)?;
        let boundaries = Boundaries {
            num_prompt_tokens: num_prompt_tokens.0,
            shared_prefix_boundary: shared_prefix_boundary.0,
        };
        self.lock()?
            .cache_blocks(request_id, num_tokens.0, boundaries, &mut hashes)
            .py()
    }

    /// vLLM's `free(request)`: group by group, each table last block first.
    fn free(&self, request_id: &Bound<'_, PyString>) -> PyResult<()> {
        self.lock()?.free(request_id.to_str()?).py()
    }

    /// vLLM's `pop_blocks_for_free`: the request forgotten, its blocks (group order, each
    /// group's in allocation order) still referenced.
    fn pop_blocks_for_free(&self, request_id: &Bound<'_, PyString>) -> PyResult<Vec<u32>> {
        Ok(self.lock()?.pop_blocks_for_free(request_id.to_str()?))
    }

    /// Drop one reference per block, in eviction-priority order (all or nothing).
    fn free_blocks(&self, block_ids: Vec<Int64>) -> PyResult<()> {
        let ids = self::block_ids(&block_ids)?;
        self.lock()?
            .pool_mut()
            .free_blocks(ids.iter().copied())
            .py()
    }

    /// vLLM's `evict_blocks`: drop the cached hash of each listed block (all ids checked
    /// first).
    fn evict_blocks(&self, block_ids: Vec<Int64>) -> PyResult<()> {
        let mut m = self.lock()?;
        for b in &block_ids {
            m.pool().check_block(b.0).py()?;
        }
        for b in &block_ids {
            m.pool_mut().evict(b.0 as u32);
        }
        Ok(())
    }

    /// The request's block table in every group (empty lists for an unknown request).
    fn block_ids(&self, request_id: &str) -> PyResult<Vec<Vec<u32>>> {
        Ok(self.lock()?.blocks(request_id))
    }

    /// vLLM's `estimate_cached_tokens` (one call per finished request, in Rust).
    fn estimate_cached_tokens(&self, request_id: &str) -> PyResult<u32> {
        Ok(self.lock()?.estimate_cached_tokens(request_id))
    }

    /// vLLM's `take_new_block_ids`: the attention groups' blocks handed out since the last
    /// call, group by group, for the worker to zero (empty unless `zero_new_blocks`).
    fn take_new_block_ids(&self) -> PyResult<Vec<u32>> {
        Ok(self.lock()?.take_new_block_ids())
    }

    /// Lower `max_model_len` to `cap` and `max_in_flight_tokens` to `in_flight` before any
    /// request is held (the native loop's length cap where the KV cache holds fewer tokens).
    fn cap_max_model_len(&self, cap: SatCount, in_flight: SatCount) -> PyResult<()> {
        self.lock()?.cap_max_model_len(cap.0, in_flight.0).py()
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

    /// The hash and group block `block_id` is cached under (`None` when it is not cached).
    fn block_hash<'py>(
        &self,
        py: Python<'py>,
        block_id: Int64,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, u32)>> {
        let m = self.lock()?;
        let b = m.pool().check_block(block_id.0).py()?;
        let group = m.pool().group_of(b);
        Ok(m.pool()
            .hash_of(b)
            .map(|k| (PyBytes::new(py, k.as_bytes()), group)))
    }

    /// Tokens the block's hash covers (vLLM's `block_hash_num_tokens`); `None` if uncached.
    fn hashed_tokens(&self, block_id: Int64) -> PyResult<Option<u32>> {
        let m = self.lock()?;
        let b = m.pool().check_block(block_id.0).py()?;
        Ok(m.pool().hashed_tokens(b))
    }

    /// The first block cached under `block_hash` for group `group` (vLLM's
    /// `cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(...))`), or
    /// `None`; a group out of range is refused.
    fn cached_block(&self, block_hash: &Bound<'_, PyAny>, group: Int64) -> PyResult<Option<u32>> {
        let bytes = block_hash
            .cast::<PyBytes>()
            .map_err(|_| crate::errors::wrong_type("a block hash must be bytes"))?;
        let key = pagedkv_core::vllm_v1::pool::HashKey::new(bytes.as_bytes()).py()?;
        let m = self.lock()?;
        let groups = m.num_groups();
        let g = u32::try_from(group.0)
            .ok()
            .filter(|&g| (g as usize) < groups)
            .ok_or_else(|| {
                crate::errors::invalid(format!("kv_cache_group_id {} outside 0..{groups}", group.0))
            })?;
        Ok(m.pool().get_cached_in(&key, g))
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

    /// Events since the last call: `("stored", group, first, end, cached_positions)`,
    /// `("removed", hash, group)`, `("cleared", 0, 0)`; an event built natively (after
    /// `bind_removed_events` / `bind_stored_events`; a `BlockStored` needs `request`, the
    /// request the last call concerned) comes as `("event", object, 0)`.
    #[pyo3(signature = (request=None))]
    fn take_events<'py>(
        &self,
        py: Python<'py>,
        request: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        let events = self.lock()?.pool_mut().take_events();
        let built = self.event_objects(request);
        events.iter().map(|e| built.tuple(py, e)).collect()
    }

    /// The events since the last call, as vLLM's objects, appended to the bound sink's list
    /// (see `bind_event_sink`; `request`: the request the last call concerned, `None` after
    /// an eviction or reset).
    #[pyo3(signature = (request=None))]
    fn drain_events<'py>(
        &self,
        py: Python<'py>,
        request: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<()> {
        let sink = self
            .event_sink
            .get()
            .ok_or_else(|| crate::errors::invalid("drain_events needs bind_event_sink first"))?;
        let events = self.lock()?.pool_mut().take_events();
        sink.publish(py, &self.event_objects(request), &events, request)
    }

    /// Have events build vLLM's `BlockRemoved(block_hashes=[hash], medium, group)` natively
    /// (`cls`'s first fields must be those three, in that order; the caller checks).
    fn bind_removed_events(
        &self,
        cls: Py<PyAny>,
        medium: Py<PyAny>,
        int_hashes: bool,
    ) -> PyResult<()> {
        let removed = RemovedEvents {
            cls,
            medium,
            int_hashes,
        };
        self.removed_events
            .set(removed)
            .map_err(|_| crate::errors::invalid("bind_removed_events was already called"))
    }

    /// Have events build vLLM's `BlockStored` natively for a plain request (see
    /// [`StoredEvents`]; `cls`'s first 14 fields must be `BlockStored`'s of vLLM 0.32 and 0.33,
    /// in that order; the caller checks; `lookahead`: vLLM 0.33's
    /// `num_hash_lookahead_tokens`, whose `lookahead_token_ids` follow them). `groups`:
    /// `(spec_kind, sliding_window, block_size)` per group, in vLLM's group order.
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
        let n = self.lock()?.num_groups();
        if groups.len() != n {
            return Err(crate::errors::invalid(format!(
                "stored events for {} groups, the manager has {n}",
                groups.len()
            )));
        }
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

    /// Have `drain_events` append vLLM's event objects to `events` (no Python call unless an
    /// event is built in Python: then `build(raw_events, request)` builds it, `raw_events` as
    /// `take_events` gives them).
    fn bind_event_sink(&self, events: Py<PyList>, build: Py<PyAny>) -> PyResult<()> {
        self.event_sink
            .set(EventSink { events, build })
            .map_err(|_| crate::errors::invalid("bind_event_sink was already called"))
    }

    /// Blocks in the pool, the null block included.
    #[getter]
    fn num_blocks(&self) -> PyResult<u32> {
        Ok(self.lock()?.pool().num_blocks())
    }

    /// KV cache groups.
    #[getter]
    fn num_groups(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_groups())
    }

    /// Per group, its `use_eagle` (it drops EAGLE/MTP's block: every member of an attention
    /// group that holds a dropping group).
    #[getter]
    fn eagle_groups(&self) -> PyResult<Vec<bool>> {
        let h = self.lock()?;
        Ok((0..h.num_groups())
            .map(|i| h.group(i).use_eagle())
            .collect())
    }

    /// Heap bytes the manager holds.
    fn heap_bytes(&self) -> PyResult<usize> {
        Ok(self.lock()?.heap_bytes())
    }

    /// Check every invariant (tests).
    fn check(&self) -> PyResult<()> {
        self.lock()?.check().map_err(crate::errors::invalid)
    }
}
