//! `BlockPool`: one device's block pool (ref counts, prefix cache, LRU eviction) for Python.
//! Every method reads its arguments (which may run Python code: `__index__`, iteration) before
//! it takes the pool, and the core checks before it mutates, so a raising call changes nothing.
//! The pool serves one call at a time: a concurrent call raises `InUseError` (never waits).

use crate::args::{hash_arg, int_arg, Count, Int64, Real};
use crate::errors::{busy, invalid, IntoPyResult};
use crate::vllm_042::tokens::extract_tokens;
use pagedkv_core::vllm_042::{BlockHash, BlockId, BlockKey, BlockPool};
use pyo3::prelude::*;
use pyo3::types::PyList;
use std::sync::{Mutex, MutexGuard, TryLockError};

#[pyclass(module = "pagedkv._native", name = "BlockPool", frozen)]
pub struct PyBlockPool {
    num_blocks: u32,
    block_size: usize,
    device: &'static str,
    inner: Mutex<BlockPool>,
}

/// A block id argument, range-checked against a pool of `num_blocks`.
fn block_arg(num_blocks: u32, block: &Bound<'_, PyAny>) -> PyResult<BlockId> {
    let b = int_arg(block, "block")?;
    if !(0..i64::from(num_blocks)).contains(&b) {
        return Err(crate::errors::to_py(pagedkv_core::Error::BlockOutOfRange {
            block: b,
            num_blocks,
        }));
    }
    Ok(b as BlockId)
}

impl PyBlockPool {
    fn lock(&self) -> PyResult<MutexGuard<'_, BlockPool>> {
        match self.inner.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(busy("this BlockPool")),
        }
    }

    fn id(&self, block: &Bound<'_, PyAny>) -> PyResult<BlockId> {
        block_arg(self.num_blocks, block)
    }

    fn parent_arg(&self, parent: Option<&Bound<'_, PyAny>>) -> PyResult<Option<BlockId>> {
        match parent {
            Some(p) if !p.is_none() => Ok(Some(self.id(p)?)),
            _ => Ok(None),
        }
    }

    /// The token ids of one block (exactly `block_size` of them).
    fn block_tokens(&self, token_ids: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let t = extract_tokens(token_ids)?.into_owned();
        if t.len() != self.block_size {
            return Err(invalid(format!(
                "token_ids must hold block_size={} tokens, got {}",
                self.block_size,
                t.len()
            )));
        }
        Ok(t)
    }
}

#[pymethods]
impl PyBlockPool {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, *, enable_caching = true,
        device = crate::args::Text("gpu".into())),
        text_signature = "(num_blocks, block_size, *, enable_caching=True, device='gpu')")]
    fn new(
        num_blocks: Int64,
        block_size: Int64,
        enable_caching: bool,
        device: crate::args::Text,
    ) -> PyResult<Self> {
        let (num_blocks, block_size) = (num_blocks.0, block_size.0);
        if !(0..u32::MAX as i64).contains(&num_blocks) {
            return Err(invalid(format!(
                "num_blocks must be in 0..2**32-1, got {num_blocks}"
            )));
        }
        let block_size = crate::vllm_042::hashing::check_block_size(block_size)?;
        let device: &'static str = match device.0.as_str() {
            "gpu" | "GPU" | "cuda" => "gpu",
            "cpu" | "CPU" => "cpu",
            other => {
                return Err(invalid(format!(
                    "device must be 'gpu' or 'cpu', got {other:?}"
                )))
            }
        };
        if device == "gpu" {
            pagedkv_core::check_gpu_slots(num_blocks as u32, block_size).py()?;
        }
        Ok(PyBlockPool {
            num_blocks: num_blocks as u32,
            block_size,
            device,
            inner: Mutex::new(
                BlockPool::new(device, num_blocks as u32, block_size, enable_caching).py()?,
            ),
        })
    }

    /// Blocks in the pool.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.num_blocks
    }
    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }
    /// "gpu" or "cpu".
    #[getter]
    fn device(&self) -> &'static str {
        self.device
    }
    /// Free blocks: uncached free plus evictable.
    #[getter]
    fn num_free(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_free())
    }
    /// Blocks with ref count > 0.
    #[getter]
    fn num_referenced(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_referenced())
    }
    /// Blocks registered in the prefix cache (referenced or evictable).
    #[getter]
    fn num_cached(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_cached())
    }
    /// Cached blocks with ref count 0.
    #[getter]
    fn num_evictable(&self) -> PyResult<usize> {
        Ok(self.lock()?.num_evictable())
    }
    /// Prefix-cache lookups so far.
    #[getter]
    fn lookups(&self) -> PyResult<u64> {
        Ok(self.lock()?.stats().lookups)
    }
    /// Prefix-cache lookups that found a block.
    #[getter]
    fn hits(&self) -> PyResult<u64> {
        Ok(self.lock()?.stats().hits)
    }
    /// Cached blocks evicted to make room so far.
    #[getter]
    fn evictions(&self) -> PyResult<u64> {
        Ok(self.lock()?.stats().evictions)
    }

    /// A fresh block with ref count 1 (evicts the LRU cached block if nothing else is free).
    fn allocate(&self) -> PyResult<BlockId> {
        self.lock()?.allocate().py()
    }

    /// `n` fresh blocks in one call; all or nothing.
    fn allocate_many<'py>(&self, py: Python<'py>, n: Count) -> PyResult<Bound<'py, PyList>> {
        let blocks = self.lock()?.allocate_many(n.usize()).py()?;
        PyList::new(py, blocks)
    }

    /// Add `n` references to a referenced or evictable (cached) block; revives an evictable one.
    #[pyo3(signature = (block, n = Count(1)), text_signature = "($self, block, n=1)")]
    fn incref(&self, block: &Bound<'_, PyAny>, n: Count) -> PyResult<()> {
        let b = self.id(block)?;
        let n = n.u32("n")?;
        self.lock()?.acquire(b, n).py()
    }

    /// Drop one reference; at zero a cached block becomes evictable, an uncached one free.
    fn free(&self, block: &Bound<'_, PyAny>) -> PyResult<()> {
        let b = self.id(block)?;
        self.lock()?.release(b).py()
    }

    /// Drop one reference from each listed block; all or nothing (checked first).
    fn free_many(&self, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ids = Vec::new();
        for b in blocks.try_iter()? {
            ids.push(self.id(&b?)?);
        }
        self.lock()?.release_many(&ids).py()
    }

    /// The cached block holding exactly `token_ids` under `block_hash` (registered with the same
    /// `parent_block`, still holding the same data, and the same `extra_key`), or None. Does not change ref counts
    /// (call `incref` to take it).
    #[pyo3(signature = (block_hash, token_ids, *, parent_block = None, extra_key = None))]
    fn lookup(
        &self,
        block_hash: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        parent_block: Option<&Bound<'_, PyAny>>,
        extra_key: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<BlockId>> {
        let parent_block = self.parent_arg(parent_block)?;
        let extra_key = extra_key.map(hash_arg).transpose()?.unwrap_or(0);
        let t = self.block_tokens(token_ids)?;
        let key = BlockKey {
            hash: hash_arg(block_hash)?,
            parent: parent_block,
            extra: extra_key,
            tokens: &t,
        };
        Ok(self.lock()?.lookup(&key))
    }

    /// Register a referenced, full, uncached block under its hash. Returns False when another
    /// block already holds that hash (the block then stays uncached).
    #[pyo3(signature = (block, block_hash, token_ids, num_hashed_tokens = None, *, parent_block = None, extra_key = None))]
    fn register(
        &self,
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
        let t = self.block_tokens(token_ids)?;
        let nht = match num_hashed_tokens {
            Some(n) => n.u32("num_hashed_tokens")?,
            None => self.block_size as u32,
        };
        let key = BlockKey {
            hash: hash_arg(block_hash)?,
            parent: parent_block,
            extra: extra_key,
            tokens: &t,
        };
        self.lock()?.register(b, &key, nht).py()
    }

    /// The ref count of `block`.
    fn ref_count(&self, block: &Bound<'_, PyAny>) -> PyResult<u32> {
        let b = self.id(block)?;
        Ok(self.lock()?.ref_count(b))
    }
    /// The hash `block` is cached under, or None.
    fn block_hash(&self, block: &Bound<'_, PyAny>) -> PyResult<Option<BlockHash>> {
        let b = self.id(block)?;
        Ok(self.lock()?.block_hash(b))
    }
    /// Whether `block` is cached with ref count 0.
    fn is_evictable(&self, block: &Bound<'_, PyAny>) -> PyResult<bool> {
        let b = self.id(block)?;
        Ok(self.lock()?.is_evictable(b))
    }
    /// Set a block's last access time (eviction takes the least recent first).
    fn touch(&self, block: &Bound<'_, PyAny>, access_time: Real) -> PyResult<()> {
        let b = self.id(block)?;
        self.lock()?.touch(b, access_time.0).py()
    }
    /// The last access time set by `touch` (-1.0 if never touched).
    fn last_accessed(&self, block: &Bound<'_, PyAny>) -> PyResult<f64> {
        let b = self.id(block)?;
        Ok(self.lock()?.last_accessed(b))
    }
    /// Evictable blocks, next victim first (O(n), for introspection).
    fn eviction_order<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let order = self.lock()?.eviction_order();
        PyList::new(py, order)
    }
    /// Raise AssertionError if any structural invariant is broken (O(n), for tests).
    fn check_invariants(&self) -> PyResult<()> {
        self.lock()?
            .check_invariants()
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }
    fn __repr__(&self) -> PyResult<String> {
        let p = self.lock()?;
        Ok(format!(
            "BlockPool(device={:?}, num_blocks={}, free={}, cached={}, evictable={})",
            p.device(),
            p.num_blocks(),
            p.num_free(),
            p.num_cached(),
            p.num_evictable()
        ))
    }
}
