//! `TokenSeq` (a sequence's native token store) and `BlockHasher` (the incremental chained
//! hasher), plus the process-wide default hash function.

use crate::args::{Count, Int64};
use crate::errors::invalid;
use crate::vllm_042::tokens::{extract_tokens, token_from_item};
use pagedkv_core::vllm_042::{BlockHash, ChainHasher, HashAlgo, HashExtra, Hasher, TokenSeq};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};
use std::sync::Mutex;

static DEFAULT_HASHER: Mutex<Option<Hasher>> = Mutex::new(None);

pub fn default_hasher() -> Hasher {
    let mut g = DEFAULT_HASHER.lock().unwrap_or_else(|e| e.into_inner());
    *g.get_or_insert_with(|| Hasher::new(HashAlgo::Xxh3, None))
}

/// Resolve `(hash_algo, hash_seed)` arguments; `None` for both means the process default.
pub fn resolve_hasher(algo: Option<&str>, seed: Option<u64>) -> PyResult<Hasher> {
    let base = default_hasher();
    let algo = match algo {
        None => base.algo,
        Some(name) => HashAlgo::parse(name).ok_or_else(|| {
            invalid(format!(
                "unknown hash_algo {name:?} (use 'xxh3' or 'sha256')"
            ))
        })?,
    };
    Ok(Hasher {
        algo,
        seed: seed.unwrap_or(base.seed),
    })
}

/// Set the hash function that new sequences use (and managers built without `hash_algo`).
#[pyfunction]
#[pyo3(signature = (hash_algo = "xxh3", hash_seed = None))]
pub fn set_default_hasher(hash_algo: &str, hash_seed: Option<Count>) -> PyResult<()> {
    let algo = HashAlgo::parse(hash_algo).ok_or_else(|| {
        invalid(format!(
            "unknown hash_algo {hash_algo:?} (use 'xxh3' or 'sha256')"
        ))
    })?;
    let h = Hasher::new(algo, hash_seed.map(|c| c.0));
    *DEFAULT_HASHER.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
    Ok(())
}

/// `(hash_algo, hash_seed)` of the process default hasher.
#[pyfunction]
pub fn get_default_hasher() -> (&'static str, u64) {
    let h = default_hasher();
    (h.algo.name(), h.seed)
}

/// A salt (str or bytes) as bytes.
pub fn salt_bytes_of(s: &Bound<'_, PyAny>) -> PyResult<Box<[u8]>> {
    salt_bytes(Some(s))?.ok_or_else(|| invalid("cache_salt must be str or bytes"))
}

fn salt_bytes(salt: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Box<[u8]>>> {
    let Some(s) = salt else { return Ok(None) };
    if s.is_none() {
        return Ok(None);
    }
    if let Ok(st) = s.cast::<PyString>() {
        return Ok(Some(st.to_cow()?.as_bytes().into()));
    }
    if let Ok(b) = s.cast::<PyBytes>() {
        return Ok(Some(b.as_bytes().into()));
    }
    Err(invalid("cache_salt must be str or bytes"))
}

/// The arguments every hashing entry point shares, checked: block size, extras, hasher.
fn chain_params(
    block_size: i64,
    lora_id: i64,
    cache_salt: Option<&Bound<'_, PyAny>>,
    hash_algo: Option<&str>,
    hash_seed: Option<u64>,
) -> PyResult<(usize, HashExtra, Hasher)> {
    let bs = check_block_size(block_size)?;
    let extra = HashExtra {
        lora_id,
        salt: salt_bytes(cache_salt)?,
    };
    Ok((bs, extra, resolve_hasher(hash_algo, hash_seed)?))
}

/// The one block-size bound (the core's), as a Python error.
pub fn check_block_size(block_size: i64) -> PyResult<usize> {
    pagedkv_core::check_block_size(block_size).map_err(crate::errors::to_py)
}

/// Make the 3-bit test hash the process default (tests only: it makes hash collisions common,
/// to show that the prefix cache never shares a block whose stored key differs). Private: no
/// public argument accepts this hash.
#[pyfunction]
#[pyo3(signature = (hash_seed = None))]
pub fn _set_weak_test_hasher(hash_seed: Option<Count>) {
    let h = Hasher::new(HashAlgo::WeakForTesting, hash_seed.map(|c| c.0));
    *DEFAULT_HASHER.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
}

/// Borrow a native object for a mutating call, or `InUseError` if another call has it.
fn borrow_mut<'py, T: pyo3::PyClass<Frozen = pyo3::pyclass::boolean_struct::False>>(
    slf: &Bound<'py, T>,
) -> PyResult<PyRefMut<'py, T>> {
    slf.try_borrow_mut()
        .map_err(|_| crate::errors::busy("this object"))
}

/// Token ids of one sequence and the chained hashes of its full blocks.
#[pyclass(module = "pagedkv._native", name = "TokenSeq")]
pub struct PyTokenSeq {
    pub inner: TokenSeq,
}

#[pymethods]
impl PyTokenSeq {
    #[new]
    #[pyo3(signature = (block_size, token_ids, *, lora_id = Int64(0), cache_salt = None, hash_algo = None, hash_seed = None),
           text_signature = "(block_size, token_ids, *, lora_id=0, cache_salt=None, hash_algo=None, hash_seed=None)")]
    fn new(
        block_size: Int64,
        token_ids: &Bound<'_, PyAny>,
        lora_id: Int64,
        cache_salt: Option<&Bound<'_, PyAny>>,
        hash_algo: Option<&str>,
        hash_seed: Option<Count>,
    ) -> PyResult<Self> {
        let (bs, extra, hasher) = chain_params(
            block_size.0,
            lora_id.0,
            cache_salt,
            hash_algo,
            hash_seed.map(|c| c.0),
        )?;
        let tokens = extract_tokens(token_ids)?;
        let inner = TokenSeq::new(bs, &tokens, extra, hasher).map_err(crate::errors::to_py)?;
        Ok(PyTokenSeq { inner })
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    /// The LoRA id that enters every block hash (0: none).
    #[getter]
    fn lora_id(&self) -> i64 {
        self.inner.extra().lora_id
    }

    /// Append one token id; hashes the block it completes, if any. O(1) amortised. (The
    /// argument is read before the store is borrowed: its `__index__` may use the store.)
    fn append(slf: &Bound<'_, Self>, token_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let t = token_from_item(token_id)?;
        borrow_mut(slf)?.inner.push(t);
        Ok(())
    }

    /// Append many token ids (list, tuple or int array).
    fn extend(slf: &Bound<'_, Self>, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let t = extract_tokens(token_ids)?;
        borrow_mut(slf)?.inner.extend(&t);
        Ok(())
    }

    /// All token ids as a new list (O(L)).
    fn tokens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.inner.tokens())
    }

    /// Token ids in `[start, end)` (clamped like a slice with non-negative bounds).
    #[pyo3(signature = (start, end = None))]
    fn token_slice<'py>(
        &self,
        py: Python<'py>,
        start: Count,
        end: Option<Count>,
    ) -> PyResult<Bound<'py, PyList>> {
        let t = self.inner.tokens();
        let (start, end) = (
            start.usize(),
            end.map_or(t.len(), Count::usize).min(t.len()),
        );
        PyList::new(py, &t[start.min(end)..end])
    }

    /// The last token id; `InvalidArgumentError` if the sequence is empty.
    fn last_token(&self) -> PyResult<u32> {
        self.inner
            .tokens()
            .last()
            .copied()
            .ok_or_else(|| invalid("the sequence has no tokens"))
    }

    /// Blocks the tokens occupy (the last one may be partial).
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    /// Full blocks (each hashed once, when it filled).
    #[getter]
    fn num_full_blocks(&self) -> usize {
        self.inner.num_full_blocks()
    }

    /// Token ids of logical block `i` (the last block may be partial).
    fn block_tokens<'py>(&self, py: Python<'py>, i: Count) -> PyResult<Bound<'py, PyList>> {
        let i = i.usize();
        if i >= self.inner.num_blocks() {
            return Err(invalid(format!(
                "block {i} does not exist (sequence has {} blocks)",
                self.inner.num_blocks()
            )));
        }
        PyList::new(py, self.inner.block_tokens(i))
    }

    /// The chained hash of full block `i`. Raises ValueError if block `i` is not full.
    fn hash_of_block(&self, i: Int64) -> PyResult<BlockHash> {
        let i = i.0;
        if i < 0 {
            return Err(invalid(format!(
                "block index must be non-negative, got {i}"
            )));
        }
        self.inner.block_hash(i as usize).ok_or_else(|| {
            invalid(format!(
                "block {i} is not full ({} of {} tokens): only full blocks have a hash",
                self.inner.block_tokens(i as usize).len(),
                self.inner.block_size()
            ))
        })
    }

    /// Hashes of every full block.
    fn block_hashes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.inner.hashes())
    }

    /// How many block hashes this sequence has computed (each full block exactly once).
    #[getter]
    fn hash_calls(&self) -> u64 {
        self.inner.hash_calls()
    }

    /// `(hash_algo, hash_seed)` this sequence hashes with.
    #[getter]
    fn hasher(&self) -> (&'static str, u64) {
        let h = self.inner.hasher();
        (h.algo.name(), h.seed)
    }

    /// An independent copy (appending to one leaves the other unchanged). O(L) memcpy.
    fn copy(&self) -> Self {
        PyTokenSeq {
            inner: self.inner.clone(),
        }
    }

    /// Same as `copy()`.
    fn __copy__(&self) -> Self {
        self.copy()
    }

    /// Same as `copy()` (token ids hold no references to share).
    fn __deepcopy__(&self, _memo: &Bound<'_, PyAny>) -> Self {
        self.copy()
    }

    fn __repr__(&self) -> String {
        format!(
            "TokenSeq(len={}, block_size={}, full_blocks={})",
            self.inner.len(),
            self.inner.block_size(),
            self.inner.num_full_blocks()
        )
    }
}

/// Incremental chained block hasher: `feed` tokens as they arrive; it returns the hashes of
/// the blocks that just became full. Keeps only the unfinished block's tokens.
#[pyclass(module = "pagedkv._native", name = "BlockHasher")]
pub struct PyBlockHasher {
    inner: ChainHasher,
    out: Vec<BlockHash>,
}

#[pymethods]
impl PyBlockHasher {
    #[new]
    #[pyo3(signature = (block_size, *, lora_id = Int64(0), cache_salt = None, hash_algo = None, hash_seed = None),
           text_signature = "(block_size, *, lora_id=0, cache_salt=None, hash_algo=None, hash_seed=None)")]
    fn new(
        block_size: Int64,
        lora_id: Int64,
        cache_salt: Option<&Bound<'_, PyAny>>,
        hash_algo: Option<&str>,
        hash_seed: Option<Count>,
    ) -> PyResult<Self> {
        let (bs, extra, hasher) = chain_params(
            block_size.0,
            lora_id.0,
            cache_salt,
            hash_algo,
            hash_seed.map(|c| c.0),
        )?;
        Ok(PyBlockHasher {
            inner: ChainHasher::new(hasher, bs, extra),
            out: Vec::new(),
        })
    }

    /// Feed token ids; returns the hashes of blocks completed by them (often empty).
    fn feed<'py>(
        slf: &Bound<'py, Self>,
        token_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let t = extract_tokens(token_ids)?;
        let mut this = borrow_mut(slf)?;
        let this = &mut *this;
        this.out.clear();
        this.inner.feed(&t, &mut this.out);
        PyList::new(slf.py(), &this.out)
    }

    /// Full blocks hashed so far.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    /// Tokens of the unfinished block, waiting for it to fill.
    #[getter]
    fn num_pending_tokens(&self) -> usize {
        self.inner.num_pending_tokens()
    }
}

/// Chained hashes of every full block of `token_ids` in one call.
#[pyfunction]
#[pyo3(signature = (token_ids, block_size, *, lora_id = Int64(0), cache_salt = None, hash_algo = None, hash_seed = None),
       text_signature = "(token_ids, block_size, *, lora_id=0, cache_salt=None, hash_algo=None, hash_seed=None)")]
pub fn hash_blocks<'py>(
    py: Python<'py>,
    token_ids: &Bound<'py, PyAny>,
    block_size: Int64,
    lora_id: Int64,
    cache_salt: Option<&Bound<'py, PyAny>>,
    hash_algo: Option<&str>,
    hash_seed: Option<Count>,
) -> PyResult<Bound<'py, PyList>> {
    let (bs, extra, hasher) = chain_params(
        block_size.0,
        lora_id.0,
        cache_salt,
        hash_algo,
        hash_seed.map(|c| c.0),
    )?;
    let t = extract_tokens(token_ids)?;
    let mut c = ChainHasher::new(hasher, bs, extra);
    let mut out = Vec::with_capacity(t.len() / bs);
    c.feed(&t, &mut out);
    PyList::new(py, &out)
}
