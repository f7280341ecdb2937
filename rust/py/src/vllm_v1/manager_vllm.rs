//! `V1Manager`'s vLLM-shaped allocation path: vLLM's `allocate_slots(request, ...)` read from
//! vLLM's own objects (the request's fields, an adopted hit's `KVCacheBlocks`) and answered
//! with them (the manager's blocks class, vLLM's shared empty blocks, `None`); the one route
//! into the manager's allocation and caching for vLLM's loop and the native loop, and the
//! hand-off of the KV events such a call logged. The Python objects it needs are bound once
//! ([`VllmBinding`], `bind_vllm`).
//!
//! Invariants: every argument and request field is read before the manager is taken, so a
//! raising call changes nothing; a KV connector's external tokens go to the core (it takes their
//! blocks as vLLM's manager does), encoder tokens must be 0; events a call logged go to the
//! bound sink in the pool's order, only when it logged any.
//!
//! Costs: one crossing per call and no Python code per block: a handful of attribute reads,
//! block hashes read in place only when a block became full, one `KVCacheBlocks` built when
//! blocks are new (one tuple of one id list), an adopted hit's ids read from the blocks
//! object's own list.

use crate::args::{Int64, SatCount};
use crate::errors::IntoPyResult;
use crate::vllm_v1::call::SlotArgs;
use crate::vllm_v1::events::EventObjects;
use crate::vllm_v1::manager::PyV1Manager;
use crate::vllm_v1::manager_inputs::{block_ids, PyHashes};
use pagedkv_core::vllm_v1::SlotRequest;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyString;

/// The Python objects `vllm_allocate_slots` answers with or compares against.
pub(super) struct VllmBinding {
    /// vLLM's shared empty `KVCacheBlocks` (returned when no block is new).
    pub(super) empty: Py<PyAny>,
    /// `NativeKVCacheBlocks((ids,))`, the class built for this manager (one id list per
    /// group: here one).
    pub(super) blocks_cls: Py<PyAny>,
    /// `RequestStatus.WAITING`, `RequestStatus.PREEMPTED` (the watermark applies to these).
    pub(super) waiting: Py<PyAny>,
    pub(super) preempted: Py<PyAny>,
    /// vLLM's `Request` class when its `num_tokens` property is `len(self._all_token_ids)`
    /// (checked by the caller): requests of exactly this class are read without running it.
    pub(super) request_cls: Option<Py<PyAny>>,
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

impl PyV1Manager {
    /// vLLM's `allocate_slots` for `request` (what `vllm_allocate_slots` runs).
    pub(super) fn allocate_for_vllm<'py>(
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
        if a.num_encoder_tokens != 0 {
            return Err(crate::errors::invalid(
                "encoder (cross-attention) tokens are outside pagedkv's manager",
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
        num_external_computed_tokens: a.num_external_computed_tokens,
        delay_cache_blocks: a.delay_cache_blocks,
        full_sequence_must_fit: a.full_sequence_must_fit,
        reserved_blocks: a.reserved_blocks,
        has_scheduled_reqs: a.has_scheduled_reqs,
    })
}
