//! The native loop's KV cache manager: pagedkv's one-group `V1Manager` or its hybrid
//! `V1Hybrid` (several KV cache groups), and the block ids the walk carries for either
//! ([`PyBlocks`], the bindings' `Engine::Blocks`). One walk serves both: this file is the only
//! place that knows which manager runs.
//!
//! Invariants: a [`PyBlocks`] is always of its manager's kind (`One` for `V1Manager`,
//! `Groups` with one list per group, in vLLM's group order, for `V1Hybrid`); the block ids
//! that leave for vLLM are a tuple of one list per group, as vLLM's `get_block_ids()` builds
//! them. KV events a call logs are handed on as the manager's own Python path hands them on
//! (the one-group manager's bound sink; the hybrid manager's `_drain_events(request)`), in the
//! pool's order, only when the call logged any.
//!
//! Costs: one group, the manager's own calls (nothing more per row); hybrid, per
//! `allocate_slots` one attribute read (`num_in_flight_tokens`), two more (the retention
//! boundaries) and the block hashes read in place only when the call caches a block (or a
//! Mamba align group counts), per admission with a hit one Python call converting the hit's
//! blocks to ids (the manager's `_computed_ids`), and one Python call per allocation that
//! logged events.

use crate::errors::IntoPyResult;
use crate::vllm_v1::hybrid::PyV1Hybrid;
use crate::vllm_v1::manager::PyV1Manager;
use crate::vllm_v1::manager_inputs::{block_ids, PyHashes};
use pagedkv_core::vllm_v1::coordinator::HybridSlots;
use pagedkv_core::vllm_v1::engine::BlockIds;
use pagedkv_core::vllm_v1::retention::{Boundaries, BoundarySource};
use pagedkv_core::vllm_v1::SlotRequest;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

/// A request's block ids as the loop's manager gives them.
#[derive(Clone, Debug)]
pub enum PyBlocks {
    /// One KV cache group.
    One(Vec<u32>),
    /// One list per KV cache group (hybrid models).
    Groups(Vec<Vec<u32>>),
}

impl BlockIds for PyBlocks {
    fn is_empty(&self) -> bool {
        match self {
            PyBlocks::One(ids) => ids.is_empty(),
            PyBlocks::Groups(groups) => groups.iter().all(|g| g.is_empty()),
        }
    }
}

impl PyBlocks {
    /// vLLM's `get_block_ids()`: a tuple of one list per group.
    pub fn to_py<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        match self {
            PyBlocks::One(ids) => PyTuple::new(py, [PyList::new(py, ids)?]),
            PyBlocks::Groups(groups) => {
                let lists = groups
                    .iter()
                    .map(|g| PyList::new(py, g))
                    .collect::<PyResult<Vec<_>>>()?;
                PyTuple::new(py, lists)
            }
        }
    }
}

/// The manager the loop allocates from (the scheduler's `kv_cache_manager._native`).
pub enum LoopKv {
    One(Py<PyV1Manager>),
    Hybrid(Py<PyV1Hybrid>),
}

fn wrong_kind() -> PyErr {
    crate::errors::invalid("V1Loop: block ids of another KV cache manager")
}

impl LoopKv {
    /// `manager`: a `V1Manager` or a `V1Hybrid`.
    pub fn new(manager: &Bound<'_, PyAny>) -> PyResult<Self> {
        if let Ok(m) = manager.cast::<PyV1Manager>() {
            return Ok(LoopKv::One(m.clone().unbind()));
        }
        match manager.cast::<PyV1Hybrid>() {
            Ok(h) => Ok(LoopKv::Hybrid(h.clone().unbind())),
            Err(_) => Err(crate::errors::wrong_type(
                "V1Loop: the manager must be a V1Manager or a V1Hybrid",
            )),
        }
    }

    /// `new_step_starts` at `schedule()`'s start: Mamba "align" groups forget the states
    /// they cached in the last step (nothing in the one-group manager).
    pub fn new_step_starts(&self) -> PyResult<()> {
        match self {
            LoopKv::One(_) => Ok(()),
            LoopKv::Hybrid(h) => {
                h.get().lock()?.new_step_starts();
                Ok(())
            }
        }
    }

    /// The block ids of a request holding none (`get_blocks` of an unknown request).
    pub fn empty_table(&self) -> PyResult<PyBlocks> {
        Ok(match self {
            LoopKv::One(_) => PyBlocks::One(Vec::new()),
            LoopKv::Hybrid(h) => PyBlocks::Groups(vec![Vec::new(); h.get().groups()?]),
        })
    }

    /// `allocate_slots` for `request` (named `rid`): the new block ids, `None` when they do
    /// not fit; the events it logged handed on.
    pub fn allocate<'py>(
        &self,
        sched: &Bound<'py, PyAny>,
        request: &Bound<'py, PyAny>,
        rid: &str,
        a: &SlotRequest<'_, PyBlocks>,
    ) -> PyResult<Option<PyBlocks>> {
        let py = sched.py();
        match self {
            LoopKv::One(m) => {
                let hit = match a.new_computed {
                    None => None,
                    Some(PyBlocks::One(ids)) => Some(ids.as_slice()),
                    Some(PyBlocks::Groups(_)) => return Err(wrong_kind()),
                };
                let ids = m
                    .get()
                    .allocate_prepared(py, request, rid, &a.with_hit(hit))?;
                Ok(ids.map(PyBlocks::One))
            }
            LoopKv::Hybrid(h) => {
                let hit = match a.new_computed {
                    None => None,
                    Some(PyBlocks::Groups(groups)) => Some(groups.as_slice()),
                    Some(PyBlocks::One(_)) => return Err(wrong_kind()),
                };
                let in_flight = request
                    .getattr(intern!(py, "num_in_flight_tokens"))?
                    .extract()?;
                // Read only if the call caches a block or a Mamba align group counts.
                let read = || {
                    boundaries_of(request).map_err(|e| {
                        pagedkv_core::Error::invalid(format!("the request's boundaries: {e}"))
                    })
                };
                let slots = hybrid_slots(a, hit, in_flight, BoundarySource::Read(&read));
                let (ids, logged) = h.get().allocate_logged(request, rid, &slots)?;
                if logged {
                    drain_events(sched, request)?;
                }
                Ok(ids.map(PyBlocks::Groups))
            }
        }
    }

    /// `cache_blocks(request, num_tokens)` (nothing with caching off).
    pub fn cache_blocks<'py>(
        &self,
        sched: &Bound<'py, PyAny>,
        request: &Bound<'py, PyAny>,
        rid: &str,
        num_tokens: u64,
    ) -> PyResult<()> {
        let py = sched.py();
        match self {
            LoopKv::One(m) => m.get().cache_for(py, request, rid, num_tokens),
            LoopKv::Hybrid(h) => {
                if h.get().cache_logged(request, rid, num_tokens)? {
                    drain_events(sched, request)?;
                }
                Ok(())
            }
        }
    }

    /// The request's block table in every group.
    pub fn table(&self, rid: &str) -> PyResult<PyBlocks> {
        Ok(match self {
            LoopKv::One(m) => PyBlocks::One(m.get().table_of(rid)?),
            LoopKv::Hybrid(h) => PyBlocks::Groups(h.get().table_of(rid)?),
        })
    }

    /// The block ids of a prefix-cache hit (`KVCacheBlocks`); `None` for vLLM's shared empty
    /// blocks.
    pub fn hit_ids(
        &self,
        sched: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
    ) -> PyResult<Option<PyBlocks>> {
        let py = sched.py();
        match self {
            LoopKv::One(m) => Ok(m.get().hit_ids(py, blocks)?.map(PyBlocks::One)),
            LoopKv::Hybrid(_) => {
                let manager = sched.getattr(intern!(py, "kv_cache_manager"))?;
                let ids = manager.call_method1(intern!(py, "_computed_ids"), (blocks,))?;
                if ids.is_none() {
                    return Ok(None);
                }
                let groups: Vec<Vec<crate::args::Int64>> = ids.extract()?;
                let groups = groups
                    .iter()
                    .map(|g| block_ids(g))
                    .collect::<PyResult<Vec<_>>>()?;
                Ok(Some(PyBlocks::Groups(groups)))
            }
        }
    }
}

/// The hybrid coordinator's `allocate_slots` arguments for the walk's request.
fn hybrid_slots<'a>(
    a: &SlotRequest<'_, PyBlocks>,
    hit: Option<&'a [Vec<u32>]>,
    num_in_flight_tokens: u64,
    boundaries: BoundarySource<'a>,
) -> HybridSlots<'a> {
    HybridSlots {
        num_computed_tokens: a.num_computed_tokens,
        num_tokens: a.num_tokens,
        num_in_flight_tokens,
        waiting_or_preempted: a.waiting_or_preempted,
        num_new_tokens: a.num_new_tokens,
        num_new_computed_tokens: a.num_new_computed_tokens,
        new_computed: hit,
        num_lookahead_tokens: a.num_lookahead_tokens,
        num_external_computed_tokens: a.num_external_computed_tokens,
        delay_cache_blocks: a.delay_cache_blocks,
        full_sequence_must_fit: a.full_sequence_must_fit,
        reserved_blocks: a.reserved_blocks,
        has_scheduled_reqs: a.has_scheduled_reqs,
        boundaries,
    }
}

/// The request's replay boundary and shared-prefix junction, read at each caching call as
/// vLLM's sliding-window manager reads them (its retention mask).
fn boundaries_of(request: &Bound<'_, PyAny>) -> PyResult<Boundaries> {
    let py = request.py();
    Ok(Boundaries {
        num_prompt_tokens: request
            .getattr(intern!(py, "num_prompt_tokens"))?
            .extract()?,
        shared_prefix_boundary: request
            .getattr(intern!(py, "shared_prefix_boundary"))?
            .extract()?,
    })
}

/// The hybrid manager's `_drain_events(request)`: the logged events become vLLM's objects
/// in its event list, as after its own `allocate_slots` / `cache_blocks`.
fn drain_events<'py>(sched: &Bound<'py, PyAny>, request: &Bound<'py, PyAny>) -> PyResult<()> {
    let py = sched.py();
    sched
        .getattr(intern!(py, "kv_cache_manager"))?
        .call_method1(intern!(py, "_drain_events"), (request,))
        .map(drop)
}

impl PyV1Hybrid {
    /// `allocate_slots` for the loop: the new ids per group and whether events were logged.
    /// The request's `block_hashes` are read only if the call caches a block.
    pub(crate) fn allocate_logged(
        &self,
        request: &Bound<'_, PyAny>,
        rid: &str,
        slots: &HybridSlots<'_>,
    ) -> PyResult<(Option<Vec<Vec<u32>>>, bool)> {
        let mut hashes = PyHashes::of_request(request);
        let mut m = self.lock()?;
        let ids = m.allocate_slots(rid, slots, &mut hashes).py()?;
        Ok((ids, m.pool().has_events()))
    }

    /// `cache_blocks` for the loop (nothing with caching off): whether events were logged.
    pub(crate) fn cache_logged(
        &self,
        request: &Bound<'_, PyAny>,
        rid: &str,
        num_tokens: u64,
    ) -> PyResult<bool> {
        let mut hashes = PyHashes::of_request(request);
        let boundaries = boundaries_of(request)?;
        let mut m = self.lock()?;
        if !m.config().enable_caching {
            return Ok(false);
        }
        m.cache_blocks(rid, num_tokens, boundaries, &mut hashes)
            .py()?;
        Ok(m.pool().has_events())
    }

    pub(crate) fn table_of(&self, rid: &str) -> PyResult<Vec<Vec<u32>>> {
        Ok(self.lock()?.blocks(rid))
    }

    pub(crate) fn groups(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_groups())
    }
}
