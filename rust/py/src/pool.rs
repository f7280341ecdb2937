//! `BlockPool`: one device's block pool (ref counts, prefix cache, LRU eviction) for Python.
//! Every method validates its arguments before touching the pool, so a raising call changes
//! nothing.

use crate::arrays::{extract_tokens, hash_arg, int_arg, Count, Int64, Real};
use crate::errors::{invalid, IntoPyResult};
use pagedkv_core::{BlockHash, BlockId, BlockKey, BlockPool};
use pyo3::prelude::*;
use pyo3::types::PyList;

#[pyclass(module = "pagedkv._native", name = "BlockPool")]
pub struct PyBlockPool {
    inner: BlockPool,
}

impl PyBlockPool {
    fn id(&self, block: &Bound<'_, PyAny>) -> PyResult<BlockId> {
        self.inner.check(int_arg(block, "block")?).py()
    }

    fn parent_arg(&self, parent: Option<&Bound<'_, PyAny>>) -> PyResult<Option<BlockId>> {
        match parent {
            Some(p) if !p.is_none() => Ok(Some(self.id(p)?)),
            _ => Ok(None),
        }
    }
}

#[pymethods]
impl PyBlockPool {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, *, enable_caching = true, device = "gpu"))]
    fn new(
        num_blocks: Int64,
        block_size: Int64,
        enable_caching: bool,
        device: &str,
    ) -> PyResult<Self> {
        let (num_blocks, block_size) = (num_blocks.0, block_size.0);
        if !(0..u32::MAX as i64).contains(&num_blocks) {
            return Err(invalid(format!(
                "num_blocks must be in 0..2**32-1, got {num_blocks}"
            )));
        }
        let block_size = crate::hashing::check_block_size(block_size)?;
        let device: &'static str = match device {
            "gpu" | "GPU" | "cuda" => "gpu",
            "cpu" | "CPU" => "cpu",
            other => {
                return Err(invalid(format!(
                    "device must be 'gpu' or 'cpu', got {other:?}"
                )))
            }
        };
        Ok(PyBlockPool {
            inner: BlockPool::new(device, num_blocks as u32, block_size, enable_caching).py()?,
        })
    }

    /// Blocks in the pool.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.num_blocks()
    }
    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    /// "gpu" or "cpu".
    #[getter]
    fn device(&self) -> &'static str {
        self.inner.device()
    }
    /// Free blocks: uncached free plus evictable.
    #[getter]
    fn num_free(&self) -> usize {
        self.inner.num_free()
    }
    /// Blocks with ref count > 0.
    #[getter]
    fn num_referenced(&self) -> usize {
        self.inner.num_referenced()
    }
    /// Blocks registered in the prefix cache (referenced or evictable).
    #[getter]
    fn num_cached(&self) -> usize {
        self.inner.num_cached()
    }
    /// Cached blocks with ref count 0.
    #[getter]
    fn num_evictable(&self) -> usize {
        self.inner.num_evictable()
    }
    /// Prefix-cache lookups so far.
    #[getter]
    fn lookups(&self) -> u64 {
        self.inner.stats().lookups
    }
    /// Prefix-cache lookups that found a block.
    #[getter]
    fn hits(&self) -> u64 {
        self.inner.stats().hits
    }
    /// Cached blocks evicted to make room so far.
    #[getter]
    fn evictions(&self) -> u64 {
        self.inner.stats().evictions
    }

    /// A fresh block with ref count 1 (evicts the LRU cached block if nothing else is free).
    fn allocate(&mut self) -> PyResult<BlockId> {
        self.inner.allocate().py()
    }

    /// `n` fresh blocks in one call; all or nothing.
    fn allocate_many<'py>(&mut self, py: Python<'py>, n: Count) -> PyResult<Bound<'py, PyList>> {
        let n = n.usize();
        if n > self.inner.num_free() {
            return Err(crate::errors::to_py(pagedkv_core::Error::OutOfBlocks {
                device: self.inner.device(),
                needed: n,
                free: self.inner.num_free(),
            }));
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.inner.allocate().py()?);
        }
        PyList::new(py, out)
    }

    /// Add `n` references to a referenced or evictable (cached) block; revives an evictable one.
    #[pyo3(signature = (block, n = Count(1)), text_signature = "($self, block, n=1)")]
    fn incref(&mut self, block: &Bound<'_, PyAny>, n: Count) -> PyResult<()> {
        let b = self.id(block)?;
        let n = n.u32("n")?;
        if n == 0 {
            return Err(invalid("n must be positive"));
        }
        self.inner.acquire(b, n).py()
    }

    /// Drop one reference; at zero a cached block becomes evictable, an uncached one free.
    fn free(&mut self, block: &Bound<'_, PyAny>) -> PyResult<()> {
        let b = self.id(block)?;
        self.inner.release(b).py()
    }

    /// Drop one reference from each listed block; all or nothing (checked first).
    fn free_many(&mut self, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ids = Vec::new();
        for b in blocks.try_iter()? {
            ids.push(self.id(&b?)?);
        }
        let blocks = ids.clone();
        ids.sort_unstable();
        for run in ids.chunk_by(|a, b| a == b) {
            if (self.inner.ref_count(run[0]) as usize) < run.len() {
                return Err(crate::errors::to_py(pagedkv_core::Error::DoubleFree(
                    run[0],
                )));
            }
        }
        for &b in &blocks {
            self.inner.release(b).py()?;
        }
        Ok(())
    }

    /// The cached block holding exactly `token_ids` under `block_hash` (registered with the same
    /// `parent_block`, still holding the same data, and the same `extra_key`), or None. Does not change ref counts
    /// (call `incref` to take it).
    #[pyo3(signature = (block_hash, token_ids, *, parent_block = None, extra_key = None))]
    fn lookup(
        &mut self,
        block_hash: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        parent_block: Option<&Bound<'_, PyAny>>,
        extra_key: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<BlockId>> {
        let parent_block = self.parent_arg(parent_block)?;
        let extra_key = extra_key.map(hash_arg).transpose()?.unwrap_or(0);
        let t = extract_tokens(token_ids)?;
        if t.len() != self.inner.block_size() {
            return Err(invalid(format!(
                "token_ids must hold block_size={} tokens, got {}",
                self.inner.block_size(),
                t.len()
            )));
        }
        let key = BlockKey {
            hash: hash_arg(block_hash)?,
            parent: parent_block,
            extra: extra_key,
            tokens: &t,
        };
        Ok(self.inner.lookup(&key))
    }

    /// Register a referenced, full, uncached block under its hash. Returns False when another
    /// block already holds that hash (the block then stays uncached).
    #[pyo3(signature = (block, block_hash, token_ids, num_hashed_tokens = None, *, parent_block = None, extra_key = None))]
    fn register(
        &mut self,
        block: &Bound<'_, PyAny>,
        block_hash: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        num_hashed_tokens: Option<Count>,
        parent_block: Option<&Bound<'_, PyAny>>,
        extra_key: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let b = self.id(block)?;
        let parent_block = self.parent_arg(parent_block)?;
        let extra_key = extra_key.map(hash_arg).transpose()?.unwrap_or(0);
        let t = extract_tokens(token_ids)?;
        let nht = match num_hashed_tokens {
            Some(n) => n.u32("num_hashed_tokens")?,
            None => self.inner.block_size() as u32,
        };
        let key = BlockKey {
            hash: hash_arg(block_hash)?,
            parent: parent_block,
            extra: extra_key,
            tokens: &t,
        };
        self.inner.register(b, &key, nht).py()
    }

    /// The ref count of `block`.
    fn ref_count(&self, block: &Bound<'_, PyAny>) -> PyResult<u32> {
        Ok(self.inner.ref_count(self.id(block)?))
    }
    /// The hash `block` is cached under, or None.
    fn block_hash(&self, block: &Bound<'_, PyAny>) -> PyResult<Option<BlockHash>> {
        Ok(self.inner.block_hash(self.id(block)?))
    }
    /// Whether `block` is cached with ref count 0.
    fn is_evictable(&self, block: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.inner.is_evictable(self.id(block)?))
    }
    /// Set a block's last access time (eviction takes the least recent first).
    fn touch(&mut self, block: &Bound<'_, PyAny>, access_time: Real) -> PyResult<()> {
        let b = self.id(block)?;
        let access_time = access_time.0;
        if !access_time.is_finite() {
            return Err(invalid("access_time must be finite"));
        }
        if self.inner.is_evictable(b) {
            return Err(invalid(format!(
                "block {b} is evictable; revive it before touching it"
            )));
        }
        self.inner.set_last_accessed(b, access_time);
        Ok(())
    }
    /// The last access time set by `touch` (-1.0 if never touched).
    fn last_accessed(&self, block: &Bound<'_, PyAny>) -> PyResult<f64> {
        Ok(self.inner.last_accessed(self.id(block)?))
    }
    /// Evictable blocks, next victim first (O(n), for introspection).
    fn eviction_order<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.inner.eviction_order())
    }
    /// Raise AssertionError if any structural invariant is broken (O(n), for tests).
    fn check_invariants(&self) -> PyResult<()> {
        self.inner
            .check_invariants()
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }
    fn __repr__(&self) -> String {
        format!(
            "BlockPool(device={:?}, num_blocks={}, free={}, cached={}, evictable={})",
            self.inner.device(),
            self.inner.num_blocks(),
            self.inner.num_free(),
            self.inner.num_cached(),
            self.inner.num_evictable()
        )
    }
}
