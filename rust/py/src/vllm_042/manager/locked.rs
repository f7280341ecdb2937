//! The crate-internal hooks of the native scheduler (`crate::vllm_042::scheduler`) into the
//! `BlockSpaceManager` it owns: [`Locked`] holds the manager's lock for one scheduler call and
//! gives the core manager directly, keeping this binding's caches (table lists, block ints)
//! current.
//!
//! Invariants: while a `Locked` lives every other call on the manager raises `InUseError`;
//! a sequence the scheduler frees through the core is dropped from the caches
//! (`Locked::dropped`).
//!
//! Costs: taking the lock (tried, never waited for); block numbers appended as the prebuilt
//! int objects (a reference increment each).

use super::state::State;
use super::PyManager;
use pagedkv_core::vllm_042::{Manager, SeqId};
use pyo3::prelude::*;
use pyo3::types::PyList;
use std::sync::MutexGuard;

/// Crate-internal hooks for `scheduler.rs`: the native scheduler drives the core manager of the
/// `BlockSpaceManager` it owns directly (holding its lock for the call), and keeps this
/// binding's caches current.
pub(crate) struct Locked<'a>(MutexGuard<'a, State>);

impl PyManager {
    /// The manager's state for one native scheduler call (`InUseError` if another call
    /// holds it).
    pub(crate) fn locked(&self) -> PyResult<Locked<'_>> {
        Ok(Locked(self.lock()?))
    }
}

impl Locked<'_> {
    pub(crate) fn core(&self) -> &Manager {
        &self.0.inner
    }

    pub(crate) fn core_mut(&mut self) -> &mut Manager {
        &mut self.0.inner
    }

    /// A sequence's table was freed behind this binding's back: drop what it caches for it.
    pub(crate) fn dropped(&mut self, id: SeqId) {
        self.0.forget(id);
    }

    /// Append GPU block numbers (the cached int objects) to `list`, through the C list API
    /// (so also to a read-only list subclass such as the scheduler's `BlockList`).
    pub(crate) fn extend_gpu_blocks(
        &self,
        list: &Bound<'_, PyList>,
        blocks: &[pagedkv_core::vllm_042::BlockId],
    ) -> PyResult<()> {
        let py = list.py();
        for &b in blocks {
            list.append(self.0.gpu_ints[b as usize].bind(py))?;
        }
        Ok(())
    }

    /// The block table of `id` as a fresh Python list (from the cached list when current).
    pub(crate) fn table_list<'py>(
        &mut self,
        py: Python<'py>,
        id: SeqId,
    ) -> PyResult<Bound<'py, PyList>> {
        self.0.table_list(py, id)
    }
}
