//! What pagedkv's vLLM v1 managers (`V1Manager`, `V1Hybrid`) and the native loop read from
//! Python arguments: a request's block hashes, read in place ([`PyHashes`], the core's
//! `HashSource`), and block ids given as Python ints ([`block_ids`]).
//!
//! Invariants: a hash is read only when the core asks for it (a request's `block_hashes`
//! attribute only when the core first asks for a hash or the count; the core reads hashes
//! while it plans, before it mutates); an item that is not `bytes` of a hash's length, or a
//! block id that is not a u32, is an `InvalidArgumentError` naming it.
//!
//! Costs: a hash is one list item read (no Python code runs for a list of `bytes`) and one
//! copy into a fixed-size key; block ids one pass over the list.

use crate::args::Int64;
use pagedkv_core::vllm_v1::{HashKey, HashSource};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

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
