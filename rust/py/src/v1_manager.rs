//! `V1Manager`: vLLM v1's KV cache manager for one full-attention group (`pagedkv_core::v1`),
//! for `pagedkv.vllm_v1`. Requests are named by their `request_id` strings; block hashes are
//! read in place from `request.block_hashes` (a list of `bytes`), only those a call needs.
//! Every method reads its arguments before it takes the manager, and the core plans before it
//! mutates, so a raising call changes nothing. One call at a time: a concurrent call raises
//! `InUseError`.

use crate::errors::{busy, IntoPyResult};
use pagedkv_core::v1::{self, Event, HashKey, HashSource, SlotRequest};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};
use std::sync::{Mutex, MutexGuard, TryLockError};

#[pyclass(module = "pagedkv._native", name = "V1Manager", frozen)]
pub struct PyV1Manager {
    inner: Mutex<v1::Manager>,
    /// Set once by `bind_vllm`: what the vLLM-shaped `allocate_slots` needs from Python.
    vllm: std::sync::OnceLock<VllmBinding>,
}

/// The Python objects `vllm_allocate_slots` answers with or compares against.
struct VllmBinding {
    /// vLLM's shared empty `KVCacheBlocks` (returned when no block is new).
    empty: Py<PyAny>,
    /// `NativeKVCacheBlocks(native, ids)`, the class built for this manager.
    blocks_cls: Py<PyAny>,
    /// `RequestStatus.WAITING`, `RequestStatus.PREEMPTED` (the watermark applies to these).
    waiting: Py<PyAny>,
    preempted: Py<PyAny>,
    /// Called with the request after a call that logged KV events (`None`: events off).
    on_events: Option<Py<PyAny>>,
}

/// `request.block_hashes`, read item by item (no Python code runs for a list of bytes).
struct PyHashes<'py> {
    seq: Bound<'py, PyAny>,
    len: usize,
}

impl<'py> PyHashes<'py> {
    fn new(seq: &Bound<'py, PyAny>) -> PyResult<Self> {
        Ok(PyHashes {
            seq: seq.clone(),
            len: seq.len()?,
        })
    }
}

fn hash_error(i: usize, what: &str) -> pagedkv_core::Error {
    pagedkv_core::Error::invalid(format!("block_hashes[{i}]: {what}"))
}

impl HashSource for PyHashes<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn key(&mut self, i: usize) -> pagedkv_core::Result<HashKey> {
        let item = match self.seq.cast::<PyList>() {
            Ok(list) => list.get_item(i),
            Err(_) => self.seq.get_item(i),
        }
        .map_err(|e| hash_error(i, &e.to_string()))?;
        let bytes = item
            .cast::<PyBytes>()
            .map_err(|_| hash_error(i, "a block hash must be bytes"))?;
        HashKey::new(bytes.as_bytes())
    }
}

impl PyV1Manager {
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
    if let Ok(ids) = blocks.getattr(intern!(py, "_ids")) {
        return Ok(Some(ids.extract()?));
    }
    let groups = blocks.getattr(intern!(py, "blocks"))?;
    if groups.is(b.empty.bind(py).getattr(intern!(py, "blocks"))?) {
        return Ok(None);
    }
    let first = groups.get_item(0)?;
    let mut ids = Vec::new();
    for blk in first.try_iter()? {
        ids.push(blk?.getattr(intern!(py, "block_id"))?.extract()?);
    }
    Ok(Some(ids))
}

fn event_tuple<'py>(py: Python<'py>, e: &Event) -> PyResult<Bound<'py, PyTuple>> {
    match e {
        Event::Stored { first, end } => ("stored", *first, *end).into_pyobject(py),
        Event::Removed(k) => ("removed", PyBytes::new(py, k.as_bytes()), 0u32).into_pyobject(py),
        Event::Cleared => ("cleared", 0u32, 0u32).into_pyobject(py),
    }
}

#[pymethods]
impl PyV1Manager {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, max_model_len, enable_caching, enable_events, watermark_blocks))]
    fn new(
        num_blocks: u32,
        block_size: u32,
        max_model_len: u64,
        enable_caching: bool,
        enable_events: bool,
        watermark_blocks: u64,
    ) -> PyResult<Self> {
        let cfg = v1::Config {
            num_blocks,
            block_size,
            max_model_len,
            enable_caching,
            enable_events,
            watermark_blocks,
        };
        Ok(PyV1Manager {
            inner: Mutex::new(v1::Manager::new(cfg).py()?),
            vllm: std::sync::OnceLock::new(),
        })
    }

    /// Give `vllm_allocate_slots` its Python objects (once).
    fn bind_vllm(
        &self,
        empty: Py<PyAny>,
        blocks_cls: Py<PyAny>,
        waiting: Py<PyAny>,
        preempted: Py<PyAny>,
        on_events: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let b = VllmBinding {
            empty,
            blocks_cls,
            waiting,
            preempted,
            on_events,
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
    #[pyo3(signature = (request, num_new_tokens, num_new_computed_tokens=0,
        new_computed_blocks=None, num_lookahead_tokens=0, num_external_computed_tokens=0,
        delay_cache_blocks=false, num_encoder_tokens=0, full_sequence_must_fit=false,
        reserved_blocks=0, has_scheduled_reqs=true, skip_zeroing_group_ids=None))]
    fn vllm_allocate_slots<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        num_new_tokens: u64,
        num_new_computed_tokens: u64,
        new_computed_blocks: Option<&Bound<'py, PyAny>>,
        num_lookahead_tokens: u64,
        num_external_computed_tokens: u64,
        delay_cache_blocks: bool,
        num_encoder_tokens: u64,
        full_sequence_must_fit: bool,
        reserved_blocks: u64,
        has_scheduled_reqs: bool,
        skip_zeroing_group_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = skip_zeroing_group_ids;
        let b = self
            .vllm
            .get()
            .ok_or_else(|| crate::errors::invalid("bind_vllm was not called"))?;
        if num_external_computed_tokens != 0 || num_encoder_tokens != 0 {
            return Err(crate::errors::invalid(
                "external (connector) and encoder tokens are outside pagedkv's manager",
            ));
        }
        let computed = computed_ids(py, b, new_computed_blocks)?;
        let status = request.getattr(intern!(py, "status"))?;
        let a = SlotRequest {
            num_computed_tokens: request
                .getattr(intern!(py, "num_computed_tokens"))?
                .extract()?,
            num_tokens: request.getattr(intern!(py, "num_tokens"))?.extract()?,
            waiting_or_preempted: status.is(b.waiting.bind(py)) || status.is(b.preempted.bind(py)),
            num_new_tokens,
            num_new_computed_tokens,
            new_computed: computed.as_deref(),
            num_lookahead_tokens,
            delay_cache_blocks,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
        };
        let rid_obj = request.getattr(intern!(py, "request_id"))?;
        let rid = rid_obj.cast::<PyString>()?.to_cow()?;
        let hashes_obj = request.getattr(intern!(py, "block_hashes"))?;
        let mut hashes = PyHashes::new(&hashes_obj)?;
        let (ids, logged) = {
            let mut m = self.lock()?;
            let ids = m.allocate_slots(&rid, &a, &mut hashes).py()?;
            (ids, m.pool().has_events())
        };
        if logged {
            if let Some(cb) = &b.on_events {
                cb.bind(py).call1((request,))?;
            }
        }
        match ids {
            None => Ok(py.None().into_bound(py)),
            Some(ids) if ids.is_empty() => Ok(b.empty.bind(py).clone()),
            Some(ids) => b.blocks_cls.bind(py).call1((ids,)),
        }
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
        num_computed_tokens: u64,
        num_tokens: u64,
        waiting_or_preempted: bool,
        num_new_tokens: u64,
        num_new_computed_tokens: u64,
        new_computed: Option<Vec<u32>>,
        num_lookahead_tokens: u64,
        delay_cache_blocks: bool,
        full_sequence_must_fit: bool,
        reserved_blocks: u64,
        has_scheduled_reqs: bool,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Vec<u32>>> {
        let mut hashes = PyHashes::new(block_hashes)?;
        let a = SlotRequest {
            num_computed_tokens,
            num_tokens,
            waiting_or_preempted,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed: new_computed.as_deref(),
            num_lookahead_tokens,
            delay_cache_blocks,
            full_sequence_must_fit,
            reserved_blocks,
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
        max_blocks: usize,
    ) -> PyResult<Vec<u32>> {
        let mut hashes = PyHashes::new(block_hashes)?;
        self.lock()?.longest_cache_hit(&mut hashes, max_blocks).py()
    }

    fn num_blocks_to_allocate(
        &self,
        request_id: &str,
        num_tokens: u64,
        new_computed: Vec<u32>,
    ) -> PyResult<u64> {
        self.lock()?
            .num_blocks_to_allocate(request_id, num_tokens, &new_computed)
            .py()
    }

    fn cache_blocks(
        &self,
        request_id: &str,
        num_tokens: u64,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let mut hashes = PyHashes::new(block_hashes)?;
        self.lock()?
            .cache_blocks(request_id, num_tokens, &mut hashes)
            .py()
    }

    fn free(&self, request_id: &str) -> PyResult<()> {
        self.lock()?.free(request_id).py()
    }

    fn pop_blocks_for_free(&self, request_id: &str) -> PyResult<Vec<u32>> {
        Ok(self.lock()?.pop_blocks_for_free(request_id))
    }

    /// Drop one reference per block, in eviction-priority order (all or nothing).
    fn free_blocks(&self, block_ids: Vec<u32>) -> PyResult<()> {
        self.lock()?
            .pool_mut()
            .free_blocks(block_ids.iter().copied())
            .py()
    }

    fn evict_blocks(&self, block_ids: Vec<i64>) -> PyResult<()> {
        self.lock()?.evict_blocks(&block_ids).py()
    }

    fn block_ids(&self, request_id: &str) -> PyResult<Vec<u32>> {
        Ok(self.lock()?.blocks(request_id).to_vec())
    }

    fn num_cached_blocks(&self, request_id: &str) -> PyResult<Option<u32>> {
        Ok(self.lock()?.num_cached_blocks(request_id))
    }

    fn reset_prefix_cache(&self) -> PyResult<bool> {
        Ok(self.lock()?.reset_prefix_cache())
    }

    fn num_free_blocks(&self) -> PyResult<usize> {
        Ok(self.lock()?.pool().num_free())
    }

    fn usage(&self) -> PyResult<f64> {
        Ok(self.lock()?.pool().usage())
    }

    fn ref_cnt(&self, block_id: i64) -> PyResult<u32> {
        let m = self.lock()?;
        let b = m.pool().check_block(block_id).py()?;
        Ok(m.pool().ref_cnt(b))
    }

    /// The hash block `block_id` is cached under (`None` when it is not cached).
    fn block_hash<'py>(
        &self,
        py: Python<'py>,
        block_id: i64,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let m = self.lock()?;
        let b = m.pool().check_block(block_id).py()?;
        Ok(m.pool().hash_of(b).map(|k| PyBytes::new(py, k.as_bytes())))
    }

    /// Tokens the block's hash covers (vLLM's `block_hash_num_tokens`); `None` if uncached.
    fn hashed_tokens(&self, block_id: i64) -> PyResult<Option<u32>> {
        let m = self.lock()?;
        let b = m.pool().check_block(block_id).py()?;
        Ok(m.pool().hashed_tokens(b))
    }

    fn estimate_cached_tokens(&self, request_id: &str) -> PyResult<u32> {
        Ok(self.lock()?.estimate_cached_tokens(request_id))
    }

    fn is_free(&self, block_id: i64) -> PyResult<bool> {
        let m = self.lock()?;
        let b = m.pool().check_block(block_id).py()?;
        Ok(m.pool().is_free(b))
    }

    /// The free-block queue, head (handed out next) first.
    fn free_queue(&self) -> PyResult<Vec<u32>> {
        Ok(self.lock()?.pool().free_queue())
    }

    fn num_cached_hashes(&self) -> PyResult<usize> {
        Ok(self.lock()?.pool().num_cached_hashes())
    }

    /// Events since the last call: `("stored", first, end)` (blocks of the request the last
    /// call concerned), `("removed", hash, 0)`, `("cleared", 0, 0)`.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        let events = self.lock()?.pool_mut().take_events();
        events.iter().map(|e| event_tuple(py, e)).collect()
    }

    #[getter]
    fn num_blocks(&self) -> PyResult<u32> {
        Ok(self.lock()?.pool().num_blocks())
    }

    #[getter]
    fn block_size(&self) -> PyResult<u32> {
        Ok(self.lock()?.config().block_size)
    }

    #[getter]
    fn num_requests(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_requests())
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
