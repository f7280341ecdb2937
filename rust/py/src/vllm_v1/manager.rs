//! `V1Manager`: vLLM v1's KV cache manager for one full-attention group (`pagedkv_core::vllm_v1`),
//! for `pagedkv.vllm_v1`. Requests are named by their `request_id` strings; block hashes are
//! read in place from `request.block_hashes` (a list of `bytes`), only those a call needs.
//! Every method reads its arguments before it takes the manager, and the core plans before it
//! mutates, so a raising call changes nothing. One call at a time: a concurrent call raises
//! `InUseError`.

use crate::args::{Count, Int64, SatCount};
use crate::errors::{busy, IntoPyResult};
use crate::vllm_v1::call::SlotArgs;
use crate::vllm_v1::events::{EventObjects, EventSink, RemovedEvents, StoredEvents};
use crate::vllm_v1::hybrid::release_of;
use pagedkv_core::vllm_v1::{self as v1, HashKey, HashSource, SlotRequest};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};
use std::sync::{Mutex, MutexGuard, TryLockError};

#[pyclass(module = "pagedkv._native", name = "V1Manager", frozen)]
pub struct PyV1Manager {
    inner: Mutex<v1::Manager>,
    /// Set once by `bind_vllm`: what the vLLM-shaped `allocate_slots` needs from Python.
    vllm: std::sync::OnceLock<VllmBinding>,
    /// Set once by `bind_removed_events` / `bind_stored_events`.
    removed_events: std::sync::OnceLock<RemovedEvents>,
    stored_events: std::sync::OnceLock<StoredEvents>,
    /// Set once by `bind_event_sink`.
    event_sink: std::sync::OnceLock<EventSink>,
}

/// The Python objects `vllm_allocate_slots` answers with or compares against.
struct VllmBinding {
    /// vLLM's shared empty `KVCacheBlocks` (returned when no block is new).
    empty: Py<PyAny>,
    /// `NativeKVCacheBlocks((ids,))`, the class built for this manager (one id list per
    /// group: here one).
    blocks_cls: Py<PyAny>,
    /// `RequestStatus.WAITING`, `RequestStatus.PREEMPTED` (the watermark applies to these).
    waiting: Py<PyAny>,
    preempted: Py<PyAny>,
    /// vLLM's `Request` class when its `num_tokens` property is `len(self._all_token_ids)`
    /// (checked by the caller): requests of exactly this class are read without running it.
    request_cls: Option<Py<PyAny>>,
}

impl VllmBinding {
    /// `request.num_tokens`, without running the property where its body is known.
    fn num_tokens(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<u64> {
        if let Some(cls) = &self.request_cls {
            if request.get_type().is(cls.bind(py)) {
                return Ok(request.getattr(intern!(py, "_all_token_ids"))?.len()? as u64);
            }
        }
        Ok(request
            .getattr(intern!(py, "num_tokens"))?
            .extract::<SatCount>()?
            .0)
    }
}

/// `request.block_hashes`, read item by item (no Python code runs for a list of bytes); from
/// a request, the attribute is read only when the core asks for a hash or the count.
pub(crate) enum PyHashes<'py> {
    Seq(Bound<'py, PyAny>),
    Of(Bound<'py, PyAny>),
}

impl<'py> PyHashes<'py> {
    pub(crate) fn new(seq: &Bound<'py, PyAny>) -> PyResult<Self> {
        Ok(PyHashes::Seq(seq.clone()))
    }

    pub(crate) fn of_request(request: &Bound<'py, PyAny>) -> Self {
        PyHashes::Of(request.clone())
    }

    fn seq(&mut self) -> pagedkv_core::Result<&Bound<'py, PyAny>> {
        if let PyHashes::Of(request) = self {
            let seq = request
                .getattr(intern!(request.py(), "block_hashes"))
                .map_err(|e| pagedkv_core::Error::invalid(format!("request.block_hashes: {e}")))?;
            *self = PyHashes::Seq(seq);
        }
        // `Of` was replaced above (never a panic: the or-pattern covers both).
        let (PyHashes::Seq(seq) | PyHashes::Of(seq)) = self;
        Ok(seq)
    }
}

fn hash_error(i: usize, what: &str) -> pagedkv_core::Error {
    pagedkv_core::Error::invalid(format!("block_hashes[{i}]: {what}"))
}

impl HashSource for PyHashes<'_> {
    fn count(&mut self) -> pagedkv_core::Result<usize> {
        let seq = self.seq()?;
        seq.len()
            .map_err(|e| pagedkv_core::Error::invalid(format!("block_hashes: {e}")))
    }

    fn key(&mut self, i: usize) -> pagedkv_core::Result<HashKey> {
        let seq = self.seq()?;
        let item = match seq.cast::<PyList>() {
            Ok(list) => list.get_item(i),
            Err(_) => seq.get_item(i),
        }
        .map_err(|e| hash_error(i, &e.to_string()))?;
        let bytes = item
            .cast::<PyBytes>()
            .map_err(|_| hash_error(i, "a block hash must be bytes"))?;
        HashKey::new(bytes.as_bytes())
    }
}

impl PyV1Manager {
    /// vLLM's `allocate_slots` for `request` (what `vllm_allocate_slots` runs).
    fn allocate_for_vllm<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        a: &SlotArgs<'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let b = self.binding()?;
        match self.allocate_ids(py, request, a)? {
            None => Ok(py.None().into_bound(py)),
            Some(ids) if ids.is_empty() => Ok(b.empty.bind(py).clone()),
            // The blocks class holds one id list per group: this manager's one.
            Some(ids) => b.blocks_cls.bind(py).call1(((ids,),)),
        }
    }

    fn binding(&self) -> PyResult<&VllmBinding> {
        self.vllm
            .get()
            .ok_or_else(|| crate::errors::invalid("bind_vllm was not called"))
    }

    /// `allocate_slots` for `request`: the new block ids (empty: none is new), `None` when
    /// they do not fit.
    fn allocate_ids<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        a: &SlotArgs<'py>,
    ) -> PyResult<Option<Vec<u32>>> {
        let b = self.binding()?;
        if a.num_external_computed_tokens != 0 || a.num_encoder_tokens != 0 {
            return Err(crate::errors::invalid(
                "external (connector) and encoder tokens are outside pagedkv's manager",
            ));
        }
        let computed = computed_ids(py, b, a.new_computed_blocks.as_ref())?;
        let slots = slot_request(py, b, request, a, computed.as_deref())?;
        let rid = request.getattr(intern!(py, "request_id"))?;
        // The id's UTF-8 as CPython caches it in the `str` (no copy).
        let rid = rid.cast::<PyString>()?.to_str()?;
        self.allocate_prepared(py, request, rid, &slots)
    }

    /// `allocate_slots` for the request named `rid`, its fields already read (`slots`): the
    /// one route into the manager's allocation (vLLM's `allocate_slots` and the native loop).
    /// KV events the call logged go to the bound sink.
    pub(crate) fn allocate_prepared<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        rid: &str,
        slots: &SlotRequest<'_>,
    ) -> PyResult<Option<Vec<u32>>> {
        self.binding()?;
        let mut hashes = PyHashes::of_request(request);
        let (ids, logged) = {
            let mut m = self.lock()?;
            let ids = m.allocate_slots(rid, slots, &mut hashes).py()?;
            (ids, m.pool().has_events())
        };
        if logged {
            self.publish_events(py, request)?;
        }
        Ok(ids)
    }

    /// vLLM's `cache_blocks(request, num_tokens)` as the manager's Python method does it
    /// (nothing when caching is off; KV events go to the bound sink).
    pub(crate) fn cache_for<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        rid: &str,
        num_tokens: u64,
    ) -> PyResult<()> {
        self.binding()?;
        let mut hashes = PyHashes::of_request(request);
        let logged = {
            let mut m = self.lock()?;
            if !m.config().enable_caching {
                return Ok(());
            }
            m.cache_blocks(rid, num_tokens, &mut hashes).py()?;
            m.pool().has_events()
        };
        if logged {
            self.publish_events(py, request)?;
        }
        Ok(())
    }

    /// The block table of the request named `rid`.
    pub(crate) fn table_of(&self, rid: &str) -> PyResult<Vec<u32>> {
        Ok(self.lock()?.blocks(rid).to_vec())
    }

    /// The block ids of a prefix-cache hit (`KVCacheBlocks`); `None` for vLLM's shared
    /// empty blocks.
    pub(crate) fn hit_ids(
        &self,
        py: Python<'_>,
        blocks: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Vec<u32>>> {
        computed_ids(py, self.binding()?, Some(blocks))
    }

    /// After an allocation or caching call that logged KV events: with a sink bound, the
    /// events go straight into its list (built here, or by its builder for the kinds built
    /// in Python), in the pool's order; without one they stay in the pool's log for
    /// `take_events` (the one other way out of the log).
    fn publish_events(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let Some(sink) = self.event_sink.get() else {
            return Ok(());
        };
        let events = self.lock()?.pool_mut().take_events();
        let built = EventObjects {
            removed: self.removed_events.get(),
            stored: self.stored_events.get().zip(Some(request)),
        };
        sink.publish(py, &built, &events, Some(request))
    }

    fn lock(&self) -> PyResult<MutexGuard<'_, v1::Manager>> {
        match self.inner.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(busy("this V1Manager")),
        }
    }
}

/// The block ids of an adopted prefix-cache hit; `None` for vLLM's shared empty blocks.
fn computed_ids(
    py: Python<'_>,
    b: &VllmBinding,
    blocks: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<Vec<u32>>> {
    let Some(blocks) = blocks else {
        return Ok(None);
    };
    if blocks.is_none() || blocks.is(b.empty.bind(py)) {
        return Ok(None);
    }
    // The manager's blocks class: its id lists per group (this manager's one first).
    if let Ok(ids) = blocks.getattr(intern!(py, "_ids")) {
        let first = ids.get_item(0)?;
        return Ok(Some(block_ids(&first.extract::<Vec<Int64>>()?)?));
    }
    let groups = blocks.getattr(intern!(py, "blocks"))?;
    if groups.is(b.empty.bind(py).getattr(intern!(py, "blocks"))?) {
        return Ok(None);
    }
    let first = groups.get_item(0)?;
    let mut ids = Vec::new();
    for blk in first.try_iter()? {
        ids.push(blk?.getattr(intern!(py, "block_id"))?.extract::<Int64>()?);
    }
    Ok(Some(block_ids(&ids)?))
}

/// Block ids given as Python ints: each must be a u32 (the pool checks its range); a
/// negative or huge id is an `InvalidArgumentError`, never an OverflowError.
pub(crate) fn block_ids(ids: &[Int64]) -> PyResult<Vec<u32>> {
    ids.iter()
        .map(|b| {
            u32::try_from(b.0)
                .map_err(|_| crate::errors::invalid(format!("block id {} is out of range", b.0)))
        })
        .collect()
}

/// The core's view of one vLLM `allocate_slots` call: its arguments and the request's fields.
fn slot_request<'a>(
    py: Python<'_>,
    b: &VllmBinding,
    request: &Bound<'_, PyAny>,
    a: &SlotArgs<'_>,
    computed: Option<&'a [u32]>,
) -> PyResult<SlotRequest<'a>> {
    let status = request.getattr(intern!(py, "status"))?;
    Ok(SlotRequest {
        num_computed_tokens: request
            .getattr(intern!(py, "num_computed_tokens"))?
            .extract::<SatCount>()?
            .0,
        num_tokens: b.num_tokens(py, request)?,
        waiting_or_preempted: status.is(b.waiting.bind(py)) || status.is(b.preempted.bind(py)),
        num_new_tokens: a.num_new_tokens,
        num_new_computed_tokens: a.num_new_computed_tokens,
        new_computed: computed,
        num_lookahead_tokens: a.num_lookahead_tokens,
        delay_cache_blocks: a.delay_cache_blocks,
        full_sequence_must_fit: a.full_sequence_must_fit,
        reserved_blocks: a.reserved_blocks,
        has_scheduled_reqs: a.has_scheduled_reqs,
    })
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
    /// logged. Connector and encoder arguments must be 0 (outside the manager's scope).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (request, num_new_tokens, num_new_computed_tokens=SatCount(0),
        new_computed_blocks=None, num_lookahead_tokens=SatCount(0),
        num_external_computed_tokens=SatCount(0), delay_cache_blocks=false,
        num_encoder_tokens=SatCount(0), full_sequence_must_fit=false,
        reserved_blocks=SatCount(0), has_scheduled_reqs=true, skip_zeroing_group_ids=None),
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
        delay_cache_blocks: bool,
        num_encoder_tokens: SatCount,
        full_sequence_must_fit: bool,
        reserved_blocks: SatCount,
        has_scheduled_reqs: bool,
        skip_zeroing_group_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = skip_zeroing_group_ids;
        let a = SlotArgs {
            num_new_tokens: num_new_tokens.0,
            num_new_computed_tokens: num_new_computed_tokens.0,
            new_computed_blocks,
            num_lookahead_tokens: num_lookahead_tokens.0,
            num_external_computed_tokens: num_external_computed_tokens.0,
            delay_cache_blocks,
            num_encoder_tokens: num_encoder_tokens.0,
            full_sequence_must_fit,
            reserved_blocks: reserved_blocks.0,
            has_scheduled_reqs,
        };
        self.allocate_for_vllm(py, request, &a)
    }

    /// vLLM's `allocate_slots` with the request's fields spelled out: the new block ids, or
    /// `None` when they do not fit.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (request_id, num_computed_tokens, num_tokens, waiting_or_preempted,
        num_new_tokens, num_new_computed_tokens, new_computed, num_lookahead_tokens,
        delay_cache_blocks, full_sequence_must_fit, reserved_blocks, has_scheduled_reqs,
        block_hashes))]
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
        delay_cache_blocks: bool,
        full_sequence_must_fit: bool,
        reserved_blocks: SatCount,
        has_scheduled_reqs: bool,
        block_hashes: &Bound<'_, PyAny>,
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
            delay_cache_blocks,
            full_sequence_must_fit,
            reserved_blocks: reserved_blocks.0,
            has_scheduled_reqs,
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
