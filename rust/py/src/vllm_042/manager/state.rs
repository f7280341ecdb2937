//! The manager's state behind its lock ([`State`]): the core manager, the sequence registry,
//! and the Python views this binding keeps current beside them (one prebuilt int object per
//! block of each pool, and the last block-table list built per sequence with its table
//! version).
//!
//! Invariants: `gpu_ints[b]`/`cpu_ints[b]` is the int `b` for every block of that pool;
//! a cached table list is handed out (as a copy) only while its version is the table's
//! current one, and is dropped with the sequence (`State::forget`). Everything here runs
//! under the manager's lock.
//!
//! Costs: one int reference per block of each pool, made once at construction; a table list
//! is rebuilt only when the table changed (once per `block_size` decode steps), otherwise a
//! `get_block_table` is one list copy.

use crate::errors::IntoPyResult;
use crate::vllm_042::hashing::PyTokenSeq;
use crate::vllm_042::registry::{Registry, Resolved};
use pagedkv_core::vllm_042::{BlockId, Device, Manager, SeqId};
use pyo3::prelude::*;
use pyo3::types::PyList;
use std::collections::HashMap;

pub(super) struct State {
    pub(super) inner: Manager,
    /// Python ints for every block number of each pool, made once: building a block table
    /// list then costs a reference increment per entry instead of an int allocation.
    pub(super) gpu_ints: Vec<Py<PyAny>>,
    pub(super) cpu_ints: Vec<Py<PyAny>>,
    /// The last block-table list built for each sequence, with the table version it shows.
    /// `get_block_table` hands out copies of it until the table changes (a table changes once
    /// per `block_size` decode steps, so most calls are a list copy).
    pub(super) table_lists: HashMap<SeqId, (u64, Py<PyList>)>,
    pub(super) registry: Registry,
}

impl State {
    /// The block table of `id` as a fresh Python list, copied from a list cached per table
    /// version (built from the prebuilt block ints when the table changed).
    pub(super) fn table_list<'py>(
        &mut self,
        py: Python<'py>,
        id: SeqId,
    ) -> PyResult<Bound<'py, PyList>> {
        let version = self.inner.table_version(id).py()?;
        if let Some((v, list)) = self.table_lists.get(&id) {
            if *v == version {
                let list = list.bind(py);
                return Ok(list.get_slice(0, list.len()));
            }
        }
        let ints = match self.inner.device_of(id).py()? {
            Device::Gpu => &self.gpu_ints,
            Device::Cpu => &self.cpu_ints,
        };
        let table = self.inner.block_table(id).py()?;
        let list = PyList::new(py, table.iter().map(|&b| ints[b as usize].bind(py)))?;
        let copy = list.get_slice(0, list.len());
        self.table_lists.insert(id, (version, list.unbind()));
        Ok(copy)
    }

    /// The prebuilt Python ints of `blocks` (a block number is a plain int: either pool's
    /// table serves, whichever device the block is on). Only reference increments happen
    /// here, so it is safe under the lock; the caller builds the list after releasing it.
    pub(super) fn block_ints<'py>(
        &self,
        py: Python<'py>,
        blocks: &[BlockId],
    ) -> Vec<Bound<'py, PyAny>> {
        let ints = if self.gpu_ints.len() >= self.cpu_ints.len() {
            &self.gpu_ints
        } else {
            &self.cpu_ints
        };
        blocks
            .iter()
            .map(|&b| match ints.get(b as usize) {
                Some(i) => i.clone_ref(py).into_bound(py),
                None => match b.into_pyobject(py) {
                    Ok(int) => int.into_any(),
                    Err(never) => match never {},
                },
            })
            .collect()
    }

    pub(super) fn resolve<'py>(&self, seqs: &[Bound<'py, PyAny>]) -> PyResult<Resolved<'py>> {
        let cfg = self.inner.config();
        self.registry.resolve(seqs, cfg.block_size, cfg.hasher)
    }

    pub(super) fn resolve_one<'py>(
        &self,
        seq: &Bound<'py, PyAny>,
    ) -> PyResult<(SeqId, Bound<'py, PyTokenSeq>)> {
        let cfg = self.inner.config();
        self.registry.resolve_one(seq, cfg.block_size, cfg.hasher)
    }

    pub(super) fn forget(&mut self, id: SeqId) {
        self.table_lists.remove(&id);
        self.registry.forget(id);
    }
}

/// The Python ints `0..n`, one object per block number (the pools' prebuilt ints).
pub(super) fn block_ints(py: Python<'_>, n: u32) -> PyResult<Vec<Py<PyAny>>> {
    (0..n)
        .map(|b| Ok(b.into_pyobject(py)?.into_any().unbind()))
        .collect()
}
