//! vLLM v1's block hashes computed natively for the native loop (`pagedkv_core::vllm_v1::block_hash`)
//! and appended to the request's own `block_hashes` list, as its `update_block_hashes` would.
//!
//! Also `VllmBlockHasher`, the same hashing as a stand-in for vLLM's per-request hasher, for
//! the steps vLLM's own loop runs.
//!
//! Only where the result is provably vLLM's: the request's hasher is vLLM's own
//! (`get_request_block_hasher` at the scheduler's hash block size and lookahead; checked once
//! per request by `pagedkv.vllm_v1._hashing`), the block has a parent hash, and every token
//! is an exact `int` the encoding covers, and the request's extra keys past its first block
//! are none or a LoRA adapter's that the encoding covers ([`request_keys`]). Anything else
//! runs vLLM's hasher.
//!
//! With vLLM 0.33's lookahead block hashes (L > 0) a block is hashed once the L tokens after
//! it exist, those tokens in its extra keys (`pagedkv_core::vllm_v1::block_hash`).

use pagedkv_core::vllm_v1::block_hash::{block_hash, HashFn, RequestKeys};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyString};

/// A LoRA adapter, multimodal inputs or prompt embeddings: extra hash keys beyond the first
/// block (`generate_block_hash_extra_keys`; a cache salt keys the first block only, which
/// vLLM's hasher always computes). KV events publish them (built in Python).
pub fn extra_keys_past_first_block(request: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = request.py();
    Ok(!request.getattr(intern!(py, "lora_request"))?.is_none()
        || request.getattr(intern!(py, "mm_features"))?.is_truthy()?
        || !request.getattr(intern!(py, "prompt_embeds"))?.is_none())
}

/// The request's extra hash keys past its first block where the native encoding covers
/// them: none, or a LoRA adapter's `("lora", lora_name, lora_path)` (vLLM's
/// `_gen_lora_extra_hash_keys`) with both exact `str`s, distinct objects (the pickler
/// memoizes by identity) and UTF-8; `None` (vLLM's hasher runs) with multimodal inputs,
/// prompt embeddings or LoRA strings outside that.
pub fn request_keys(request: &Bound<'_, PyAny>) -> PyResult<Option<RequestKeys>> {
    let py = request.py();
    if request.getattr(intern!(py, "mm_features"))?.is_truthy()?
        || !request.getattr(intern!(py, "prompt_embeds"))?.is_none()
    {
        return Ok(None);
    }
    let lora = request.getattr(intern!(py, "lora_request"))?;
    if !lora.is_truthy()? {
        return Ok(Some(RequestKeys::Plain));
    }
    let name = lora.getattr(intern!(py, "lora_name"))?;
    let path = lora.getattr(intern!(py, "lora_path"))?;
    let (Ok(n), Ok(p)) = (name.cast_exact::<PyString>(), path.cast_exact::<PyString>()) else {
        return Ok(None);
    };
    if n.is(p) {
        return Ok(None);
    }
    Ok(match (n.to_str(), p.to_str()) {
        (Ok(name), Ok(path)) => Some(RequestKeys::Lora {
            name: name.to_owned(),
            path: path.to_owned(),
        }),
        _ => None,
    })
}

/// How a request's blocks are hashed: tokens per block and lookahead tokens past each.
#[derive(Clone, Copy, Debug)]
pub struct HashShape {
    pub block_size: usize,
    pub lookahead: usize,
}

/// `request.update_block_hashes()` after tokens were appended to `all` (the request's
/// `_all_token_ids`): every block filled (and followed by its lookahead tokens) since the
/// last hash is hashed and appended to `hashes` (its `block_hashes`), natively when `f` is
/// known (the request's extra keys `keys`, read when it entered the loop).
pub fn extend_block_hashes(
    request: &Bound<'_, PyAny>,
    hashes: &Bound<'_, PyAny>,
    all: &Bound<'_, PyList>,
    f: Option<(HashFn, &RequestKeys)>,
    shape: HashShape,
) -> PyResult<()> {
    let py = request.py();
    if let (Some((f, keys)), Ok(list)) = (f, hashes.cast::<PyList>()) {
        if let Some(new) = new_block_hashes(list, all, f, Keys::Known(keys), shape)? {
            for h in new {
                list.append(h)?;
            }
            return Ok(());
        }
    }
    request
        .call_method0(intern!(py, "update_block_hashes"))
        .map(drop)
}

/// A request's extra keys: known, or read from the request once a block is to be hashed.
enum Keys<'a, 'py> {
    Known(&'a RequestKeys),
    ReadFrom(&'a Bound<'py, PyAny>),
}

/// The hashes of the blocks of `all` filled (with their lookahead tokens) beyond the
/// `hashes` already computed, as vLLM's hasher would return them; `None` where the native
/// encoding does not apply (no parent hash yet, a parent that is not `bytes`, extra keys or
/// a token it does not encode): then vLLM's runs.
fn new_block_hashes<'py>(
    hashes: &Bound<'py, PyList>,
    all: &Bound<'py, PyList>,
    f: HashFn,
    keys: Keys<'_, 'py>,
    shape: HashShape,
) -> PyResult<Option<Vec<Bound<'py, PyBytes>>>> {
    let py = hashes.py();
    let HashShape {
        block_size,
        lookahead,
    } = shape;
    let mut n = hashes.len();
    let mut out = Vec::new();
    let fits = |n: usize| (n + 1).saturating_mul(block_size).saturating_add(lookahead) <= all.len();
    if !fits(n) {
        return Ok(Some(out));
    }
    if n == 0 {
        return Ok(None);
    }
    let Ok(last) = hashes.get_item(n - 1)?.cast_into::<PyBytes>() else {
        return Ok(None);
    };
    let read;
    let keys = match keys {
        Keys::Known(k) => k,
        Keys::ReadFrom(request) => match request_keys(request)? {
            Some(k) => {
                read = k;
                &read
            }
            None => return Ok(None),
        },
    };
    let mut parent = last.as_bytes().to_vec();
    let mut scratch = Vec::new();
    let (mut tokens, mut ahead) = (
        Vec::with_capacity(block_size),
        Vec::with_capacity(lookahead),
    );
    while fits(n) {
        let end = (n + 1) * block_size;
        if !read_tokens(all, n * block_size, block_size, &mut tokens)?
            || !read_tokens(all, end, lookahead, &mut ahead)?
        {
            return Ok(None);
        }
        let Some(h) = block_hash(f, &parent, &tokens, keys, &ahead, &mut scratch) else {
            return Ok(None);
        };
        out.push(PyBytes::new(py, &h));
        parent = h;
        n += 1;
    }
    Ok(Some(out))
}

/// vLLM's request block hasher (the closure `get_request_block_hasher` returns), native:
/// `Request.update_block_hashes` calls it after every appended token, and it returns the
/// hashes of the blocks filled since, byte for byte vLLM's. `pagedkv.vllm_v1`'s schedulers
/// put it in place of a request's hasher only where that hasher is vLLM's own with a hash
/// function this module encodes and the request has no multimodal inputs or prompt
/// embeddings; `lookahead`: the closure's `num_hash_lookahead_tokens` (vLLM 0.33). Blocks it
/// does not encode (the first, which may carry a cache salt; extra keys or a token outside
/// the encoding, [`request_keys`] read per call that has a block to hash) are left to
/// `original`, the closure it replaced, which then hashes every new block of that call.
#[pyclass(module = "pagedkv._native", name = "VllmBlockHasher", frozen)]
pub struct PyVllmBlockHasher {
    f: HashFn,
    name: String,
    shape: HashShape,
    original: Py<PyAny>,
}

#[pymethods]
impl PyVllmBlockHasher {
    #[new]
    #[pyo3(signature = (name, block_size, original, lookahead=None))]
    fn new(
        name: &str,
        block_size: crate::args::Count,
        original: Py<PyAny>,
        lookahead: Option<crate::args::Count>,
    ) -> PyResult<Self> {
        let block_size = block_size.usize();
        if block_size == 0 {
            return Err(crate::errors::invalid("block_size must be positive"));
        }
        Ok(PyVllmBlockHasher {
            f: parse_name(name)?,
            name: name.to_owned(),
            shape: HashShape {
                block_size,
                lookahead: lookahead.map_or(0, |n| n.usize()),
            },
            original,
        })
    }

    fn __call__<'py>(&self, request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let py = request.py();
        let hashes = request.getattr(intern!(py, "block_hashes"))?;
        let all = request.getattr(intern!(py, "_all_token_ids"))?;
        if let (Ok(hashes), Ok(all)) = (hashes.cast::<PyList>(), all.cast::<PyList>()) {
            if let Some(new) =
                new_block_hashes(hashes, all, self.f, Keys::ReadFrom(request), self.shape)?
            {
                return Ok(PyList::new(py, new)?.into_any());
            }
        }
        self.original.bind(py).call1((request,))
    }

    /// vLLM's name of the hash function (`prefix_caching_hash_algo`).
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The hash block size (tokens per hashed block).
    #[getter]
    fn block_size(&self) -> usize {
        self.shape.block_size
    }

    /// Tokens past each block its hash covers (vLLM 0.33's `num_hash_lookahead_tokens`).
    #[getter]
    fn lookahead(&self) -> usize {
        self.shape.lookahead
    }

    /// The hasher this one stands in for (vLLM's closure).
    #[getter]
    fn original(&self, py: Python<'_>) -> Py<PyAny> {
        self.original.clone_ref(py)
    }
}

fn parse_name(name: &str) -> PyResult<HashFn> {
    HashFn::parse(name).ok_or_else(|| {
        crate::errors::invalid(format!(
            "unknown vLLM hash function {name:?} (sha256, sha256_cbor, xxhash, xxhash_cbor)"
        ))
    })
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

/// `hash_fn((parent, tuple(tokens), E))` for vLLM's hash function `name`, `E` being `None`
/// or, with `lora = (name, path)`, `(("lora", name, path),)` (the strings pickled as distinct
/// objects); with lookahead tokens `ahead` (non-empty; `None` is none) the extra keys are
/// `(E, *ahead)`. `None` where the native encoding does not apply (the caller then uses
/// vLLM's). For tests and tools.
#[pyfunction]
#[pyo3(signature = (name, parent, tokens, ahead=None, lora=None))]
pub fn vllm_block_hash<'py>(
    py: Python<'py>,
    name: &str,
    parent: &[u8],
    tokens: Vec<Bound<'py, PyAny>>,
    ahead: Option<Vec<Bound<'py, PyAny>>>,
    lora: Option<(String, String)>,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let f = parse_name(name)?;
    // A token outside i64 is outside the native encoding too: `None` (vLLM's hash applies).
    let ints = |v: &[Bound<'py, PyAny>]| -> PyResult<Vec<i64>> {
        v.iter().map(|t| t.extract::<i64>()).collect()
    };
    let (Ok(tokens), Ok(ahead)) = (ints(&tokens), ints(&ahead.unwrap_or_default())) else {
        return Ok(None);
    };
    let keys = match lora {
        None => RequestKeys::Plain,
        Some((name, path)) => RequestKeys::Lora { name, path },
    };
    let mut scratch = Vec::new();
    let h = block_hash(f, parent, &tokens, &keys, &ahead, &mut scratch);
    Ok(h.map(|h| PyBytes::new(py, &h)))
}
