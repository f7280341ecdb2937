//! vLLM v1's block hashes computed natively for the native loop (`pagedkv_core::v1::block_hash`)
//! and appended to the request's own `block_hashes` list, as its `update_block_hashes` would.
//!
//! Only where the result is provably vLLM's: the request's hasher is vLLM's own
//! (`get_request_block_hasher` at the scheduler's hash block size, no lookahead; checked once
//! per request by `pagedkv.vllm_v1._native_loop`), the block has a parent hash, and every
//! token is an exact `int` the encoding covers. Anything else runs the request's own method.

use pagedkv_core::v1::block_hash::{block_hash, HashFn};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList};

/// `request.update_block_hashes()` after tokens were appended to `all` (the request's
/// `_all_token_ids`): every block filled since the last hash is hashed and appended to
/// `hashes` (its `block_hashes`), natively when `f` is known.
pub fn extend_block_hashes(
    request: &Bound<'_, PyAny>,
    hashes: &Bound<'_, PyAny>,
    all: &Bound<'_, PyList>,
    f: Option<HashFn>,
    block_size: usize,
) -> PyResult<()> {
    let py = request.py();
    let own = || {
        request
            .call_method0(intern!(py, "update_block_hashes"))
            .map(drop)
    };
    let (Some(f), Ok(list)) = (f, hashes.cast::<PyList>()) else {
        return own();
    };
    let mut scratch = Vec::new();
    let mut tokens = Vec::with_capacity(block_size);
    loop {
        let n = list.len();
        let start = n * block_size;
        if n == 0 || start + block_size > all.len() {
            return if n == 0 { own() } else { Ok(()) };
        }
        let parent = list.get_item(n - 1)?;
        let Ok(parent) = parent.cast::<PyBytes>() else {
            return own();
        };
        if !read_tokens(all, start, block_size, &mut tokens)? {
            return own();
        }
        match block_hash(f, parent.as_bytes(), &tokens, &mut scratch) {
            Some(h) => list.append(PyBytes::new(py, &h))?,
            None => return own(),
        }
    }
}

/// `all[start:start + len]` as integers; false if an item is not an exact `int` in `i64`.
fn read_tokens(
    all: &Bound<'_, PyList>,
    start: usize,
    len: usize,
    out: &mut Vec<i64>,
) -> PyResult<bool> {
    out.clear();
    for k in start..start + len {
        let item = all.get_item(k)?;
        if !item.is_exact_instance_of::<PyInt>() {
            return Ok(false);
        }
        match item.extract::<i64>() {
            Ok(t) => out.push(t),
            Err(_) => return Ok(false),
        }
    }
    Ok(true)
}

/// `hash_fn((parent, tuple(tokens), None))` for vLLM's hash function `name`; `None` where the
/// native encoding does not apply (the caller then uses vLLM's). For tests and tools.
#[pyfunction]
pub fn vllm_block_hash<'py>(
    py: Python<'py>,
    name: &str,
    parent: &[u8],
    tokens: Vec<i64>,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let f = HashFn::parse(name).ok_or_else(|| {
        crate::errors::invalid(format!(
            "unknown vLLM hash function {name:?} (sha256, sha256_cbor, xxhash, xxhash_cbor)"
        ))
    })?;
    let mut scratch = Vec::new();
    Ok(block_hash(f, parent, &tokens, &mut scratch).map(|h| PyBytes::new(py, &h)))
}
