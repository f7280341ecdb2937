//! `V1Manager`: vLLM v1's KV cache manager for one full-attention group (`pagedkv_core::v1`),
//! for `pagedkv.vllm_v1`. Requests are named by their `request_id` strings; block hashes are
//! read in place from `request.block_hashes` (a list of `bytes`), only those a call needs.
//! Every method reads its arguments before it takes the manager, and the core plans before it
//! mutates, so a raising call changes nothing. One call at a time: a concurrent call raises
//! `InUseError`.

use crate::errors::{busy, IntoPyResult};
use pagedkv_core::v1::{self, Event, HashKey, HashSource, SlotRequest};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use std::sync::{Mutex, MutexGuard, TryLockError};

#[pyclass(module = "pagedkv._native", name = "V1Manager", frozen)]
pub struct PyV1Manager {
    inner: Mutex<v1::Manager>,
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
        })
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
        self.lock()?.allocate_slots(request_id, &a, &mut hashes).py()
    }

    /// The longest cached prefix of `block_hashes`, at most `max_blocks` blocks.
    fn longest_cache_hit(&self, block_hashes: &Bound<'_, PyAny>, max_blocks: usize) -> PyResult<Vec<u32>> {
        let mut hashes = PyHashes::new(block_hashes)?;
        self.lock()?.longest_cache_hit(&mut hashes, max_blocks).py()
    }

    fn num_blocks_to_allocate(&self, request_id: &str, num_tokens: u64, new_computed: Vec<u32>) -> PyResult<u64> {
        self.lock()?.num_blocks_to_allocate(request_id, num_tokens, &new_computed).py()
    }

    fn cache_blocks(&self, request_id: &str, num_tokens: u64, block_hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut hashes = PyHashes::new(block_hashes)?;
        self.lock()?.cache_blocks(request_id, num_tokens, &mut hashes).py()
    }

    fn free(&self, request_id: &str) -> PyResult<()> {
        self.lock()?.free(request_id).py()
    }

    fn pop_blocks_for_free(&self, request_id: &str) -> PyResult<Vec<u32>> {
        Ok(self.lock()?.pop_blocks_for_free(request_id))
    }

    /// Drop one reference per block, in eviction-priority order (all or nothing).
    fn free_blocks(&self, block_ids: Vec<u32>) -> PyResult<()> {
        self.lock()?.pool_mut().free_blocks(block_ids.iter().copied()).py()
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
    fn block_hash<'py>(&self, py: Python<'py>, block_id: i64) -> PyResult<Option<Bound<'py, PyBytes>>> {
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
