//! The manager's registry of sequences that hold a block table, by object identity, and the
//! resolution of sequence objects to `(seq_id, token store)`.
//!
//! A sequence is read through three attribute lookups the first time (`allocate`/`fork`);
//! after that its id and store come from here. We hold a reference to each registered object,
//! so its address cannot be reused while it is registered; the entry goes at `free`/`reset`.
//! (A sequence's `seq_id` and `data` must not be replaced while it holds a table; vLLM never
//! does.) The registry takes part in Python's cyclic GC through the manager's `__traverse__`.

use crate::errors::busy;
use crate::vllm_042::hashing::PyTokenSeq;
use crate::vllm_042::seqs::{foreign_store, native_store_of, seq_id_of, sync_foreign};
use pagedkv_core::vllm_042::{Hasher, SeqId, TokenSeq};
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};
use std::collections::HashMap;

struct Known {
    obj: Py<PyAny>,
    id: SeqId,
    store: Py<PyTokenSeq>,
    /// Not a pagedkv Sequence: the store is ours and is synced with the sequence on each use.
    foreign: bool,
}

#[derive(Default)]
pub struct Registry {
    known: HashMap<usize, Known>,
    by_id: HashMap<SeqId, usize>,
}

/// Sequences resolved to ids and token stores. No store is borrowed yet: resolving runs Python
/// code, and borrows are taken only after it (`borrow`).
pub struct Resolved<'py> {
    pub ids: Vec<SeqId>,
    pub stores: Vec<Bound<'py, PyTokenSeq>>,
}

/// Borrowed token stores of a `Resolved`, for the duration of one core call.
pub struct Borrowed<'a, 'py> {
    ids: &'a [SeqId],
    refs: Vec<PyRef<'py, PyTokenSeq>>,
}

impl Borrowed<'_, '_> {
    pub fn pairs(&self) -> Vec<(SeqId, &TokenSeq)> {
        self.ids
            .iter()
            .zip(&self.refs)
            .map(|(&id, s)| (id, &s.inner))
            .collect()
    }
}

/// Borrow a store, first rehashing it with `hasher` if it hashes with another function (once
/// per store: a sequence the manager has seen keeps the manager's hasher).
pub fn borrow_adopted<'py>(
    store: &Bound<'py, PyTokenSeq>,
    hasher: Hasher,
) -> PyResult<PyRef<'py, PyTokenSeq>> {
    let r = store.try_borrow().map_err(|_| busy("a token store"))?;
    if r.inner.hasher() == hasher {
        return Ok(r);
    }
    drop(r);
    store
        .try_borrow_mut()
        .map_err(|_| busy("a token store"))?
        .inner
        .adopt_hasher(hasher);
    store.try_borrow().map_err(|_| busy("a token store"))
}

impl<'py> Resolved<'py> {
    /// Borrow every store as it is (for checks that do not read hashes).
    pub fn borrow(&self) -> PyResult<Borrowed<'_, 'py>> {
        let refs = self
            .stores
            .iter()
            .map(|s| s.try_borrow().map_err(|_| busy("a token store")))
            .collect::<PyResult<_>>()?;
        Ok(Borrowed {
            ids: &self.ids,
            refs,
        })
    }

    /// Borrow every store with the manager's hasher adopted. Called after the call's own
    /// checks, so a refused call leaves stores as they were.
    pub fn borrow_adopted(&self, hasher: Hasher) -> PyResult<Borrowed<'_, 'py>> {
        let refs = self
            .stores
            .iter()
            .map(|s| borrow_adopted(s, hasher))
            .collect::<PyResult<_>>()?;
        Ok(Borrowed {
            ids: &self.ids,
            refs,
        })
    }
}

impl Registry {
    pub fn id_of(&self, seq: &Bound<'_, PyAny>) -> PyResult<SeqId> {
        match self.known.get(&(seq.as_ptr() as usize)) {
            Some(k) => Ok(k.id),
            None => seq_id_of(seq),
        }
    }

    pub fn ids(&self, seqs: &[Bound<'_, PyAny>]) -> PyResult<Vec<SeqId>> {
        seqs.iter().map(|s| self.id_of(s)).collect()
    }

    pub fn remember(&mut self, seq: &Bound<'_, PyAny>, id: SeqId, store: &Bound<'_, PyTokenSeq>) {
        self.forget(id);
        let ptr = seq.as_ptr() as usize;
        if let Some(old) = self.known.remove(&ptr) {
            self.by_id.remove(&old.id);
        }
        let foreign = native_store_of(seq).is_none_or(|s| !s.is(store));
        self.known.insert(
            ptr,
            Known {
                obj: seq.clone().unbind(),
                id,
                store: store.clone().unbind(),
                foreign,
            },
        );
        self.by_id.insert(id, ptr);
    }

    pub fn forget(&mut self, id: SeqId) {
        if let Some(ptr) = self.by_id.remove(&id) {
            self.known.remove(&ptr);
        }
    }

    pub fn clear(&mut self) {
        self.known.clear();
        self.by_id.clear();
    }

    pub fn len(&self) -> usize {
        self.known.len()
    }

    /// Visit every Python object held (for `__traverse__`).
    pub fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        for k in self.known.values() {
            visit.call(&k.obj)?;
            visit.call(&k.store)?;
        }
        Ok(())
    }

    /// The token store of a sequence that is not (yet) registered: its own native store, or
    /// one built for it.
    pub fn store_for<'py>(
        seq: &Bound<'py, PyAny>,
        block_size: usize,
        hasher: Hasher,
    ) -> PyResult<Bound<'py, PyTokenSeq>> {
        match native_store_of(seq) {
            Some(s) => Ok(s),
            None => foreign_store(seq, block_size, hasher),
        }
    }

    /// `resolve` for one sequence, without the vectors.
    pub fn resolve_one<'py>(
        &self,
        seq: &Bound<'py, PyAny>,
        block_size: usize,
        hasher: Hasher,
    ) -> PyResult<(SeqId, Bound<'py, PyTokenSeq>)> {
        match self.known.get(&(seq.as_ptr() as usize)) {
            Some(k) => {
                let store = k.store.bind(seq.py()).clone();
                if k.foreign {
                    sync_foreign(seq, &store, block_size, hasher)?;
                }
                Ok((k.id, store))
            }
            None => Ok((seq_id_of(seq)?, Self::store_for(seq, block_size, hasher)?)),
        }
    }

    /// Resolve sequences to ids and stores (foreign stores synced with their sequence).
    pub fn resolve<'py>(
        &self,
        seqs: &[Bound<'py, PyAny>],
        block_size: usize,
        hasher: Hasher,
    ) -> PyResult<Resolved<'py>> {
        let mut ids = Vec::with_capacity(seqs.len());
        let mut stores = Vec::with_capacity(seqs.len());
        for seq in seqs {
            let (id, store) = self.resolve_one(seq, block_size, hasher)?;
            ids.push(id);
            stores.push(store);
        }
        Ok(Resolved { ids, stores })
    }
}
