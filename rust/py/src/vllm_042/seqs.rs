//! Reading sequences and groups off Python objects: a sequence's id, status and token store
//! (`seq.seq_id`, `seq.status`, `seq.data._store`), a group's sequences (`group.seqs_dict`),
//! and token stores built for sequences of other types (vLLM's own `Sequence`).
//!
//! Everything here may run Python code (attribute lookups, `get_token_ids()`, `__index__`).

use crate::args::{int_arg, type_name};
use crate::errors::{busy, invalid, wrong_type, IntoPyResult};
use crate::vllm_042::hashing::PyTokenSeq;
use pagedkv_core::vllm_042::{SeqId, TokenSeq};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyString};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Status {
    Waiting,
    Running,
    Swapped,
    Finished,
}

/// The members WAITING, RUNNING, SWAPPED of `pagedkv.sequence.SequenceStatus`, for identity checks.
fn status_members(py: Python<'_>) -> Option<&'static [Py<PyAny>; 3]> {
    static CELL: PyOnceLock<Option<[Py<PyAny>; 3]>> = PyOnceLock::new();
    CELL.get_or_init(py, || {
        let cls = py
            .import("pagedkv.vllm_042.sequence")
            .ok()?
            .getattr("SequenceStatus")
            .ok()?;
        let get = |n: &str| cls.getattr(n).ok().map(|m| m.unbind());
        Some([get("WAITING")?, get("RUNNING")?, get("SWAPPED")?])
    })
    .as_ref()
}

pub fn status_of(seq: &Bound<'_, PyAny>) -> PyResult<Status> {
    let py = seq.py();
    let st = seq.getattr(intern!(py, "status"))?;
    if let Some([w, r, s]) = status_members(py) {
        if st.is(w) {
            return Ok(Status::Waiting);
        }
        if st.is(r) {
            return Ok(Status::Running);
        }
        if st.is(s) {
            return Ok(Status::Swapped);
        }
    }
    // Any enum with vLLM's member names works too.
    let name = st
        .getattr(intern!(py, "name"))
        .map_err(|_| wrong_type("seq.status must be a SequenceStatus"))?;
    let name = name
        .cast::<PyString>()
        .map_err(|_| wrong_type("seq.status must be a SequenceStatus"))?
        .to_cow()?
        .into_owned();
    Ok(match name.as_str() {
        "WAITING" => Status::Waiting,
        "RUNNING" => Status::Running,
        "SWAPPED" => Status::Swapped,
        n if n.starts_with("FINISHED") => Status::Finished,
        other => return Err(invalid(format!("unknown sequence status {other}"))),
    })
}

pub fn seq_id_of(seq: &Bound<'_, PyAny>) -> PyResult<SeqId> {
    let id = seq.getattr(intern!(seq.py(), "seq_id")).map_err(|_| {
        wrong_type(format!(
            "expected a pagedkv Sequence, got {}",
            type_name(seq)
        ))
    })?;
    if id.is_exact_instance_of::<pyo3::types::PyInt>() {
        if let Ok(v) = id.extract::<u64>() {
            return Ok(v); // the common case, without the general checks
        }
    }
    let id = int_arg(&id, "seq_id")?;
    u64::try_from(id).map_err(|_| invalid(format!("seq_id must be non-negative, got {id}")))
}

/// The items of a list or tuple (fast paths) or any iterable.
pub fn items<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if let Ok(list) = obj.cast::<PyList>() {
        return Ok(list.iter().collect());
    }
    if let Ok(tuple) = obj.cast::<pyo3::types::PyTuple>() {
        return Ok(tuple.iter().collect());
    }
    obj.try_iter()
        .map_err(|_| {
            wrong_type(format!(
                "expected a list of sequences, got {}",
                type_name(obj)
            ))
        })?
        .collect()
}

/// The native token store of a pagedkv `Sequence` (`seq.data._store`), or `None` for any other
/// sequence type.
pub fn native_store_of<'py>(seq: &Bound<'py, PyAny>) -> Option<Bound<'py, PyTokenSeq>> {
    let py = seq.py();
    seq.getattr(intern!(py, "data"))
        .and_then(|d| d.getattr(intern!(py, "_store")))
        .ok()
        .and_then(|s| s.cast_into::<PyTokenSeq>().ok())
}

/// A store for a sequence of another type (vLLM's own `Sequence`, say): built from
/// `seq.get_token_ids()`, with the sequence's LoRA id and optional `cache_salt`.
pub fn foreign_store<'py>(
    seq: &Bound<'py, PyAny>,
    block_size: usize,
    hasher: pagedkv_core::vllm_042::Hasher,
) -> PyResult<Bound<'py, PyTokenSeq>> {
    let py = seq.py();
    let tokens = seq.call_method0(intern!(py, "get_token_ids")).map_err(|_| {
        wrong_type(format!(
            "expected a Sequence (pagedkv's, or one with seq_id, status and get_token_ids()), got {}",
            type_name(seq)
        ))
    })?;
    let tokens = crate::vllm_042::tokens::extract_tokens(&tokens)?;
    let lora_id = match seq.getattr(intern!(py, "lora_int_id")) {
        Ok(v) if !v.is_none() => int_arg(&v, "lora_int_id")?,
        _ => 0,
    };
    let salt = match seq.getattr(intern!(py, "cache_salt")) {
        Ok(v) if !v.is_none() => Some(crate::vllm_042::hashing::salt_bytes_of(&v)?),
        _ => None,
    };
    // vLLM counts a sequence's blocks in its own block size (it may differ from the manager's)
    let block_size = match seq.getattr(intern!(py, "block_size")) {
        Ok(v) if !v.is_none() => {
            crate::vllm_042::hashing::check_block_size(int_arg(&v, "block_size")?)?
        }
        _ => block_size,
    };
    let extra = pagedkv_core::vllm_042::HashExtra { lora_id, salt };
    let inner = TokenSeq::new(block_size, &tokens, extra, hasher).py()?;
    Bound::new(py, PyTokenSeq { inner })
}

/// Bring a foreign sequence's store up to date with the tokens it has now: append what was
/// appended since (the usual case: one token per step), or rebuild if anything else changed.
pub fn sync_foreign(
    seq: &Bound<'_, PyAny>,
    store: &Bound<'_, PyTokenSeq>,
    block_size: usize,
    hasher: pagedkv_core::vllm_042::Hasher,
) -> PyResult<()> {
    let py = seq.py();
    let len: usize = seq.call_method0(intern!(py, "get_len"))?.extract()?;
    let have = store
        .try_borrow()
        .map_err(|_| busy("a token store"))?
        .inner
        .len();
    if len == have {
        return Ok(());
    }
    if len > have {
        let prompt_len: usize = seq.call_method0(intern!(py, "get_prompt_len"))?.extract()?;
        if have >= prompt_len {
            let out = seq.call_method0(intern!(py, "get_output_token_ids"))?;
            let new = tail_of(&out, have - prompt_len)?;
            let tokens = crate::vllm_042::tokens::extract_tokens(&new)?;
            store
                .try_borrow_mut()
                .map_err(|_| busy("a token store"))?
                .inner
                .extend(&tokens);
            if store
                .try_borrow()
                .map_err(|_| busy("a token store"))?
                .inner
                .len()
                == len
            {
                return Ok(());
            }
        }
    }
    let fresh = foreign_store(seq, block_size, hasher)?;
    let rebuilt = fresh
        .try_borrow()
        .map_err(|_| busy("a token store"))?
        .inner
        .clone();
    store
        .try_borrow_mut()
        .map_err(|_| busy("a token store"))?
        .inner = rebuilt;
    Ok(())
}

pub fn group_seqs<'py>(group: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let py = group.py();
    let seqs = match group.getattr(intern!(py, "seqs_dict")) {
        // a plain dict: walk it directly (insertion order, like `get_seqs()`)
        Ok(d) if d.is_exact_instance_of::<PyDict>() => {
            return Ok(d.cast_into::<PyDict>()?.iter().map(|(_, v)| v).collect());
        }
        Ok(d) => d.call_method0(intern!(py, "values"))?,
        Err(_) => group.call_method0(intern!(py, "get_seqs")).map_err(|_| {
            wrong_type(format!(
                "expected a SequenceGroup, got {}",
                type_name(group)
            ))
        })?,
    };
    seqs.try_iter()?.collect()
}

/// `items[start:]` of a list (or any sequence). Not through `PySlice::new`: in PyO3 0.30 it
/// leaks its three index objects (two allocated ints per call here: a steady leak over a long run).
fn tail_of<'py>(items: &Bound<'py, PyAny>, start: usize) -> PyResult<Bound<'py, PyAny>> {
    if let Ok(list) = items.cast::<PyList>() {
        return Ok(list.get_slice(start, list.len()).into_any());
    }
    let py = items.py();
    let slice = py
        .get_type::<pyo3::types::PySlice>()
        .call1((start, py.None()))?;
    items.get_item(slice)
}
