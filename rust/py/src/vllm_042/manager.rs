//! `_native.BlockSpaceManager`: the native base class of `pagedkv.BlockSpaceManager` (same
//! name, so type checkers and tracebacks name the class users know). Each method reads its
//! arguments (sequences, groups, buffers) off the Python objects and makes one core call.
//!
//! Concurrency: the manager's state sits behind a lock that is only ever *tried*: a call made
//! while another is in progress (another thread's, or a Python callback's re-entering the
//! manager: a foreign sequence's `get_token_ids`, say) raises `InUseError` and changes nothing.
//! Nothing ever waits for the lock, so no callback can deadlock against it.//!
//! The pieces live by job beside this file: the state behind the lock and its Python views in
//! `manager/state.rs`, argument readers in `manager/args.rs`, the bodies several methods
//! share (the batch step, swaps, marking blocks computed) in `manager/shared.rs`, and the
//! native scheduler's hooks ([`Locked`]) in `manager/locked.rs`. The `#[pymethods]` block
//! stays whole here (PyO3 allows one per class).

mod args;
mod locked;
mod shared;
mod state;

pub(crate) use locked::Locked;

use crate::args::{device_arg, int_arg, Count, Int32, Real, Text};
use crate::errors::{busy, invalid, IntoPyResult};
use crate::vllm_042::buffers::OutputArg;
use crate::vllm_042::hashing::resolve_hasher;
use crate::vllm_042::registry::{borrow_adopted, Registry};
use crate::vllm_042::results::{alloc_status, copies_dict};
use crate::vllm_042::seqs::{group_seqs, items, seq_id_of, status_of, Status};
use args::{count_arg, window_arg, with_status};
use pagedkv_core::vllm_042::{Copies, Device, Manager, ManagerConfig};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use pyo3::{PyTraverseError, PyVisit};
use state::{block_ints, State};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, TryLockError};

/// Native base of `pagedkv.BlockSpaceManager`: vLLM's block manager API (BlockSpaceManagerV1
/// semantics) over the core manager. Use `pagedkv.BlockSpaceManager`.
#[pyclass(
    module = "pagedkv._native",
    name = "BlockSpaceManager",
    subclass,
    frozen
)]
pub struct PyManager {
    /// Fixed at construction (read without the lock).
    cfg: ManagerConfig,
    window: Option<usize>,
    watermark_blocks: usize,
    state: Mutex<State>,
}

impl PyManager {
    /// The state, or `InUseError` if another call holds it (never waits).
    fn lock(&self) -> PyResult<MutexGuard<'_, State>> {
        match self.state.try_lock() {
            Ok(g) => Ok(g),
            // The core does not panic on any input; if it ever did, its calls check before
            // they mutate, so the state is still consistent.
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(busy("this BlockSpaceManager")),
        }
    }
}

#[pymethods]
impl PyManager {
    #[new]
    #[pyo3(signature = (block_size, num_gpu_blocks, num_cpu_blocks, watermark = Real(0.01), sliding_window = None,
                        enable_caching = false, *, hash_algo = None, hash_seed = None, strict = false),
           text_signature = "(block_size, num_gpu_blocks, num_cpu_blocks, watermark=0.01, sliding_window=None, enable_caching=False, *, hash_algo=None, hash_seed=None, strict=False)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        block_size: &Bound<'_, PyAny>,
        num_gpu_blocks: &Bound<'_, PyAny>,
        num_cpu_blocks: &Bound<'_, PyAny>,
        watermark: Real,
        sliding_window: Option<&Bound<'_, PyAny>>,
        enable_caching: bool,
        hash_algo: Option<&str>,
        hash_seed: Option<Count>,
        strict: bool,
    ) -> PyResult<Self> {
        let bs = pagedkv_core::check_block_size(int_arg(block_size, "block_size")?).py()?;
        let cfg = ManagerConfig {
            block_size: bs,
            num_gpu_blocks: count_arg(num_gpu_blocks, "num_gpu_blocks")?,
            num_cpu_blocks: count_arg(num_cpu_blocks, "num_cpu_blocks")?,
            watermark: watermark.0,
            sliding_window: window_arg(sliding_window)?,
            enable_caching,
            strict,
            hasher: resolve_hasher(hash_algo, hash_seed.map(|c| c.0))?,
        };
        let inner = Manager::new(cfg).py()?;
        Ok(PyManager {
            cfg,
            window: inner.window_blocks(),
            watermark_blocks: inner.watermark_blocks(),
            state: Mutex::new(State {
                gpu_ints: block_ints(py, cfg.num_gpu_blocks)?,
                cpu_ints: block_ints(py, cfg.num_cpu_blocks)?,
                inner,
                table_lists: HashMap::new(),
                registry: Registry::default(),
            }),
        })
    }

    // ---- garbage collection --------------------------------------------------------------
    /// The registered sequences, their stores and the cached table lists. A manager that is
    /// in a call cannot be collected (it is reachable from that call), so a busy lock means
    /// there is nothing to report right now.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        let Ok(st) = self.state.try_lock() else {
            return Ok(());
        };
        st.registry.traverse(&visit)?;
        for (_, list) in st.table_lists.values() {
            visit.call(list)?;
        }
        Ok(())
    }

    fn __clear__(&self) {
        if let Ok(mut st) = self.state.try_lock() {
            st.registry.clear();
            st.table_lists.clear();
        }
    }

    // ---- configuration -----------------------------------------------------------------
    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.cfg.block_size
    }
    /// Blocks in the GPU pool.
    #[getter]
    fn num_total_gpu_blocks(&self) -> u32 {
        self.cfg.num_gpu_blocks
    }
    /// Blocks in the CPU (swap) pool.
    #[getter]
    fn num_total_cpu_blocks(&self) -> u32 {
        self.cfg.num_cpu_blocks
    }
    /// Fraction of GPU blocks `can_allocate` keeps free.
    #[getter]
    fn watermark(&self) -> f64 {
        self.cfg.watermark
    }
    /// `watermark * num_total_gpu_blocks`, in blocks.
    #[getter]
    fn watermark_blocks(&self) -> usize {
        self.watermark_blocks
    }
    /// Whether full blocks are shared through the prefix cache.
    #[getter]
    fn enable_caching(&self) -> bool {
        self.cfg.enable_caching
    }
    /// The sliding window in blocks (None without a window).
    #[getter]
    fn block_sliding_window(&self) -> Option<usize> {
        self.window
    }
    /// Whether `free` of a sequence without a table raises `UnknownSequenceError`.
    #[getter]
    fn strict(&self) -> bool {
        self.cfg.strict
    }
    /// `(hash_algo, hash_seed)` of the block hash.
    #[getter]
    fn hasher(&self) -> (&'static str, u64) {
        (self.cfg.hasher.algo.name(), self.cfg.hasher.seed)
    }

    // ---- allocation --------------------------------------------------------------------
    /// Whether the group's WAITING prompt fits: an `AllocStatus` (OK, LATER or NEVER;
    /// the watermark counts).
    fn can_allocate(&self, py: Python<'_>, seq_group: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let waiting = with_status(seq_group, |s| s == Status::Waiting)?;
        let first = waiting
            .first()
            .ok_or_else(|| invalid("the sequence group has no WAITING sequence"))?;
        let status = {
            let st = self.lock()?;
            let (_, store) = st.resolve_one(first)?;
            let store = borrow_adopted(&store, self.cfg.hasher)?;
            st.inner.can_allocate(&store.inner).py()?
        };
        alloc_status(py, status)
    }

    /// Give the group's WAITING sequences one shared block table for the prompt (prefix-cache
    /// hits reused). `OutOfBlocksError` if it does not fit.
    fn allocate(&self, seq_group: &Bound<'_, PyAny>) -> PyResult<()> {
        let waiting = with_status(seq_group, |s| s == Status::Waiting)?;
        let mut st = self.lock()?;
        let r = st.resolve(&waiting)?;
        st.inner
            .allocate(&r.borrow_adopted(self.cfg.hasher)?.pairs())
            .py()?;
        for ((seq, &id), store) in waiting.iter().zip(&r.ids).zip(&r.stores) {
            st.registry.remember(seq, id, store);
        }
        Ok(())
    }

    /// Whether every RUNNING sequence of the group can get its next slots (plus
    /// `num_lookahead_slots`) now.
    #[pyo3(signature = (seq_group, num_lookahead_slots = Count(0)),
           text_signature = "($self, seq_group, num_lookahead_slots=0)")]
    fn can_append_slots(
        &self,
        seq_group: &Bound<'_, PyAny>,
        num_lookahead_slots: Count,
    ) -> PyResult<bool> {
        let running = with_status(seq_group, |s| s == Status::Running)?;
        let st = self.lock()?;
        let r = st.resolve(&running)?;
        let b = r.borrow_adopted(self.cfg.hasher)?;
        st.inner
            .can_append_slots(&b.pairs(), num_lookahead_slots.usize())
            .py()
    }

    /// Reserve slots for the tokens appended since the last call; returns copy-on-write pairs
    /// `{src_block: [dst_block, ...]}` (empty when nothing is copied).
    #[pyo3(signature = (seq, num_lookahead_slots = Count(0)),
           text_signature = "($self, seq, num_lookahead_slots=0)")]
    fn append_slots<'py>(
        &self,
        py: Python<'py>,
        seq: &Bound<'py, PyAny>,
        num_lookahead_slots: Count,
    ) -> PyResult<Bound<'py, PyAny>> {
        let copies = {
            let mut guard = self.lock()?;
            let st = &mut *guard;
            let (id, store) = st.resolve_one(seq)?;
            let store = borrow_adopted(&store, self.cfg.hasher)?;
            let mut copies = Copies::new();
            st.inner
                .append_slots(id, &store.inner, num_lookahead_slots.usize(), &mut copies)
                .py()?;
            copies
        };
        copies_dict(py, &copies)
    }

    /// One decode step for many sequences in one call: reserve each one's newest slot, then
    /// write row `i` of `block_tables` (int32 `[rows >= n, cols]`, the rest of the row set to
    /// `pad_value`), `context_lens[i]` (= seq length) and `slot_mapping[i]` (slot of the newest
    /// token, `block * block_size + offset`). Buffers are numpy int32 arrays (torch: `t.numpy()`),
    /// written in place; they must not overlap. Everything is checked before anything changes;
    /// out of blocks raises `OutOfBlocksError` with no sequence touched. Returns the
    /// copy-on-write pairs.
    #[pyo3(signature = (seqs, block_tables, context_lens, slot_mapping, *, pad_value = Int32(0)),
           text_signature = "($self, seqs, block_tables, context_lens, slot_mapping, *, pad_value=0)")]
    fn append_slots_batch<'py>(
        &self,
        py: Python<'py>,
        seqs: &Bound<'py, PyAny>,
        block_tables: &Bound<'py, PyAny>,
        context_lens: &Bound<'py, PyAny>,
        slot_mapping: &Bound<'py, PyAny>,
        pad_value: Int32,
    ) -> PyResult<Bound<'py, PyAny>> {
        let outputs = [
            OutputArg::table(block_tables),
            OutputArg::vec("context_lens", Some(context_lens)),
            OutputArg::vec("slot_mapping", Some(slot_mapping)),
        ];
        let copies = self.step(seqs, &outputs, pad_value.0, true)?;
        copies_dict(py, &copies)
    }

    /// Write the current block tables of `seqs` (rows padded with `pad_value`) and, if given,
    /// their lengths into caller-owned int32 buffers, without changing anything.
    #[pyo3(signature = (seqs, block_tables, *, context_lens = None, pad_value = Int32(0)),
           text_signature = "($self, seqs, block_tables, *, context_lens=None, pad_value=0)")]
    fn fill_block_tables<'py>(
        &self,
        seqs: &Bound<'py, PyAny>,
        block_tables: &Bound<'py, PyAny>,
        context_lens: Option<&Bound<'py, PyAny>>,
        pad_value: Int32,
    ) -> PyResult<()> {
        let outputs = [
            OutputArg::table(block_tables),
            OutputArg::vec("context_lens", context_lens),
            OutputArg::vec("slot_mapping", None),
        ];
        self.step(seqs, &outputs, pad_value.0, false).map(drop)
    }

    /// Share every block of `parent_seq`'s table with `child_seq` (ref counts +1).
    fn fork(&self, parent_seq: &Bound<'_, PyAny>, child_seq: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut st = self.lock()?;
        let parent = st.registry.id_of(parent_seq)?;
        let child = seq_id_of(child_seq)?;
        if parent == child {
            return Err(invalid(format!(
                "cannot fork sequence {parent} into itself"
            )));
        }
        let child_store = Registry::store_for(child_seq, self.cfg.block_size, self.cfg.hasher)?;
        st.inner.fork(parent, child).py()?;
        if st.inner.has_table(child) {
            st.registry.remember(child_seq, child, &child_store);
        }
        Ok(())
    }

    /// Release `seq`'s table. Without a table: a no-op (vLLM), or `UnknownSequenceError` with
    /// `strict=True`.
    fn free(&self, seq: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut st = self.lock()?;
        let id = st.registry.id_of(seq)?;
        st.inner.free(id).py()?;
        st.forget(id);
        Ok(())
    }

    /// Free every sequence's table, as `free` on each (cached blocks stay cached, evictable).
    fn reset(&self) -> PyResult<()> {
        let mut st = self.lock()?;
        st.inner.reset().py()?;
        st.table_lists.clear();
        st.registry.clear();
        Ok(())
    }

    // ---- swapping ----------------------------------------------------------------------
    /// Whether the group's SWAPPED sequences fit on the GPU: an `AllocStatus`.
    #[pyo3(signature = (seq_group, num_lookahead_slots = Count(0)),
           text_signature = "($self, seq_group, num_lookahead_slots=0)")]
    fn can_swap_in(
        &self,
        py: Python<'_>,
        seq_group: &Bound<'_, PyAny>,
        num_lookahead_slots: Count,
    ) -> PyResult<Py<PyAny>> {
        let mut unfinished = Vec::new();
        let mut swapped = 0;
        for s in group_seqs(seq_group)? {
            let status = status_of(&s)?;
            if status != Status::Finished {
                unfinished.push(s);
            }
            swapped += usize::from(status == Status::Swapped);
        }
        let answer = {
            let st = self.lock()?;
            let ids = st.registry.ids(&unfinished)?;
            st.inner
                .can_swap_in(&ids, swapped, num_lookahead_slots.usize())
                .py()?
        };
        alloc_status(py, answer)
    }

    /// Move the group's SWAPPED sequences to the GPU; returns `{cpu_block: gpu_block}`.
    /// `num_lookahead_slots` is accepted for vLLM's signature; slots are reserved by the next
    /// `append_slots`, as in vLLM.
    #[pyo3(signature = (seq_group, num_lookahead_slots = Count(0)),
           text_signature = "($self, seq_group, num_lookahead_slots=0)")]
    fn swap_in<'py>(
        &self,
        py: Python<'py>,
        seq_group: &Bound<'py, PyAny>,
        num_lookahead_slots: Count,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = num_lookahead_slots;
        self.swap(py, seq_group, Status::Swapped, Device::Cpu)
    }

    /// Whether the distinct blocks of the group's unfinished sequences fit in the free CPU blocks.
    fn can_swap_out(&self, seq_group: &Bound<'_, PyAny>) -> PyResult<bool> {
        let seqs = with_status(seq_group, |s| s != Status::Finished)?;
        let st = self.lock()?;
        st.inner.can_swap_out(&st.registry.ids(&seqs)?).py()
    }

    /// Move the group's RUNNING sequences to the CPU; returns `{gpu_block: cpu_block}`.
    fn swap_out<'py>(
        &self,
        py: Python<'py>,
        seq_group: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.swap(py, seq_group, Status::Running, Device::Gpu)
    }

    // ---- queries -----------------------------------------------------------------------
    /// The physical block ids of `seq`'s table, in logical order (a new list).
    fn get_block_table<'py>(
        &self,
        py: Python<'py>,
        seq: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let mut guard = self.lock()?;
        let id = guard.registry.id_of(seq)?;
        guard.table_list(py, id)
    }

    /// Native heap bytes `(pools, tables, block_ints)`: the two pools' per-block state (what
    /// a cached block costs), the sequences' block tables, and this binding's references to
    /// its per-block int objects (the int objects are Python's, not counted here).
    fn native_bytes(&self) -> PyResult<(usize, usize, usize)> {
        let st = self.lock()?;
        let ints =
            (st.gpu_ints.capacity() + st.cpu_ints.capacity()) * std::mem::size_of::<Py<PyAny>>();
        Ok((
            st.inner.pool_heap_bytes(),
            st.inner.tables_heap_bytes(),
            ints,
        ))
    }

    /// Free GPU blocks (evictable cached blocks count as free).
    fn get_num_free_gpu_blocks(&self) -> PyResult<usize> {
        Ok(self.lock()?.inner.num_free_gpu_blocks())
    }

    /// Free CPU blocks (evictable cached blocks count as free).
    fn get_num_free_cpu_blocks(&self) -> PyResult<usize> {
        Ok(self.lock()?.inner.num_free_cpu_blocks())
    }

    /// Record `access_time` as the last access of every block of `seq` (LRU eviction order).
    fn access_all_blocks_in_seq(&self, seq: &Bound<'_, PyAny>, access_time: Real) -> PyResult<()> {
        let mut st = self.lock()?;
        let id = st.registry.id_of(seq)?;
        st.inner.access_all_blocks_in_seq(id, access_time.0).py()
    }

    /// Mark every full block of `seq` as computed (prefix caching).
    fn compute_full_blocks_in_seq(&self, seq: &Bound<'_, PyAny>) -> PyResult<()> {
        self.compute_full_blocks(std::slice::from_ref(seq))
    }

    /// The computed blocks of `seq`'s table, except its last block (as vLLM).
    fn get_all_computed_blocks<'py>(
        &self,
        py: Python<'py>,
        seq: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let ints = {
            let st = self.lock()?;
            let id = st.registry.id_of(seq)?;
            st.block_ints(py, &st.inner.get_all_computed_blocks(id))
        };
        PyList::new(py, ints)
    }

    /// Longest common prefix of the computed blocks of `seqs` (those with none are skipped;
    /// empty without caching).
    fn get_common_computed_block_ids<'py>(
        &self,
        py: Python<'py>,
        seqs: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let seqs = items(seqs)?;
        let ints = {
            let st = self.lock()?;
            let ids = st.registry.ids(&seqs)?;
            st.block_ints(py, &st.inner.get_common_computed_block_ids(&ids))
        };
        PyList::new(py, ints)
    }

    /// Mark the full blocks of every sequence of the group as computed (no-op without caching).
    fn mark_blocks_as_computed(&self, seq_group: &Bound<'_, PyAny>) -> PyResult<()> {
        if !self.cfg.enable_caching {
            return Ok(());
        }
        self.compute_full_blocks(&group_seqs(seq_group)?)
    }

    /// `access_all_blocks_in_seq` for many sequences in one call (batch step API).
    fn access_all_blocks_in_seqs(
        &self,
        seqs: &Bound<'_, PyAny>,
        access_time: Real,
    ) -> PyResult<()> {
        let seqs = items(seqs)?;
        let mut st = self.lock()?;
        let ids = st.registry.ids(&seqs)?;
        st.inner.access_all_blocks_in_seqs(&ids, access_time.0).py()
    }

    /// `compute_full_blocks_in_seq` for many sequences in one call (what
    /// `mark_blocks_as_computed` does for each sequence of a group).
    fn compute_full_blocks_in_seqs(&self, seqs: &Bound<'_, PyAny>) -> PyResult<()> {
        if !self.cfg.enable_caching {
            return Ok(());
        }
        self.compute_full_blocks(&items(seqs)?)
    }

    // ---- introspection -----------------------------------------------------------------
    /// Whether `seq` holds a block table in this manager.
    fn has_table(&self, seq: &Bound<'_, PyAny>) -> PyResult<bool> {
        let st = self.lock()?;
        Ok(st.inner.has_table(st.registry.id_of(seq)?))
    }

    /// Device ("gpu"/"cpu") the sequence's table lives on.
    fn table_device(&self, seq: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        let st = self.lock()?;
        Ok(st.inner.device_of(st.registry.id_of(seq)?).py()?.name())
    }

    /// The ref count of `block` on `device` ("gpu" or "cpu").
    fn ref_count(&self, device: Text, block: &Bound<'_, PyAny>) -> PyResult<u32> {
        let dev = device_arg(&device.0)?;
        let block = int_arg(block, "block")?;
        let st = self.lock()?;
        let pool = st.inner.pool(dev);
        Ok(pool.ref_count(pool.check(block).py()?))
    }

    /// `{ref_count, block_hash, num_hashed_tokens, last_accessed, computed}` of one block.
    fn block_info<'py>(
        &self,
        py: Python<'py>,
        device: Text,
        block: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let dev = device_arg(&device.0)?;
        let block = int_arg(block, "block")?;
        let st = self.lock()?;
        let pool = st.inner.pool(dev);
        let b = pool.check(block).py()?;
        let d = PyDict::new(py);
        d.set_item("ref_count", pool.ref_count(b))?;
        d.set_item("block_hash", pool.block_hash(b))?;
        d.set_item("num_hashed_tokens", pool.num_hashed_tokens(b))?;
        d.set_item("last_accessed", st.inner.last_accessed(dev, b))?;
        d.set_item("computed", pool.is_computed(b))?;
        Ok(d)
    }

    /// `(lookups, hits)` of full prompt blocks in `allocate` (the prefix-cache hit rate).
    fn prefix_cache_stats(&self) -> PyResult<(u64, u64)> {
        Ok(self.lock()?.inner.prefix_cache_stats())
    }

    /// Blocks of `device` registered in the prefix cache (referenced or evictable).
    #[pyo3(signature = (device = Text("gpu".into())), text_signature = "($self, device='gpu')")]
    fn num_cached_blocks(&self, device: Text) -> PyResult<usize> {
        let dev = device_arg(&device.0)?;
        Ok(self.lock()?.inner.pool(dev).num_cached())
    }

    /// Cached blocks of `device` with ref count 0 (reusable after eviction).
    #[pyo3(signature = (device = Text("gpu".into())), text_signature = "($self, device='gpu')")]
    fn num_evictable_blocks(&self, device: Text) -> PyResult<usize> {
        let dev = device_arg(&device.0)?;
        Ok(self.lock()?.inner.pool(dev).num_evictable())
    }

    /// Raise AssertionError if a pool invariant is broken, a ref count disagrees with the
    /// tables, or the registry holds a sequence without a table (O(blocks); for tests).
    fn check_invariants(&self) -> PyResult<()> {
        let st = self.lock()?;
        st.inner
            .check_invariants()
            .map_err(pyo3::exceptions::PyAssertionError::new_err)?;
        if st.registry.len() > st.inner.num_tables() {
            return Err(pyo3::exceptions::PyAssertionError::new_err(
                "the registry holds more sequences than there are tables",
            ));
        }
        Ok(())
    }
}
