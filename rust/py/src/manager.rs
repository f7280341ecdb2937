//! `_native.BlockSpaceManager`: the native base class of `pagedkv.BlockSpaceManager` (same
//! name, so type checkers and tracebacks name the class users know). It reads sequences and groups
//! straight off the Python objects (`seq.seq_id`, `seq.status`, `seq.data._store`,
//! `group.seqs_dict`) and hands the work to the core manager.

use crate::arrays::{int_arg, type_name, writable_i32, Count, I32Out, Int32, Real};
use crate::errors::{invalid, wrong_type, IntoPyResult};
use crate::hashing::{resolve_hasher, PyTokenSeq};
use pagedkv_core::{AllocStatus, BlockId, Copies, Device, Manager, ManagerConfig, SeqId, TokenSeq};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyString};
use std::collections::HashMap;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Status {
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
            .import("pagedkv.sequence")
            .ok()?
            .getattr("SequenceStatus")
            .ok()?;
        let get = |n: &str| cls.getattr(n).ok().map(|m| m.unbind());
        Some([get("WAITING")?, get("RUNNING")?, get("SWAPPED")?])
    })
    .as_ref()
}

fn status_of(seq: &Bound<'_, PyAny>) -> PyResult<Status> {
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

fn seq_id_of(seq: &Bound<'_, PyAny>) -> PyResult<SeqId> {
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
fn items<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
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
fn native_store_of<'py>(seq: &Bound<'py, PyAny>) -> Option<Bound<'py, PyTokenSeq>> {
    let py = seq.py();
    seq.getattr(intern!(py, "data"))
        .and_then(|d| d.getattr(intern!(py, "_store")))
        .ok()
        .and_then(|s| s.cast_into::<PyTokenSeq>().ok())
}

/// A store for a sequence of another type (vLLM's own `Sequence`, say): built from
/// `seq.get_token_ids()`, with the sequence's LoRA id and optional `cache_salt`.
fn foreign_store<'py>(
    seq: &Bound<'py, PyAny>,
    block_size: usize,
    hasher: pagedkv_core::Hasher,
) -> PyResult<Bound<'py, PyTokenSeq>> {
    let py = seq.py();
    let tokens = seq.call_method0(intern!(py, "get_token_ids")).map_err(|_| {
        wrong_type(format!(
            "expected a Sequence (pagedkv's, or one with seq_id, status and get_token_ids()), got {}",
            type_name(seq)
        ))
    })?;
    let tokens = crate::arrays::extract_tokens(&tokens)?;
    let lora_id = match seq.getattr(intern!(py, "lora_int_id")) {
        Ok(v) if !v.is_none() => int_arg(&v, "lora_int_id")?,
        _ => 0,
    };
    let salt = match seq.getattr(intern!(py, "cache_salt")) {
        Ok(v) if !v.is_none() => Some(crate::hashing::salt_bytes_of(&v)?),
        _ => None,
    };
    let extra = pagedkv_core::HashExtra { lora_id, salt };
    let inner = TokenSeq::new(block_size, &tokens, extra, hasher).py()?;
    Bound::new(py, PyTokenSeq { inner })
}

/// Bring a foreign sequence's store up to date with the tokens it has now: append what was
/// appended since (the usual case: one token per step), or rebuild if anything else changed.
fn sync_foreign(
    seq: &Bound<'_, PyAny>,
    store: &Bound<'_, PyTokenSeq>,
    block_size: usize,
    hasher: pagedkv_core::Hasher,
) -> PyResult<()> {
    let py = seq.py();
    let len: usize = seq.call_method0(intern!(py, "get_len"))?.extract()?;
    let have = store.borrow().inner.len();
    if len == have {
        return Ok(());
    }
    if len > have {
        let prompt_len: usize = seq.call_method0(intern!(py, "get_prompt_len"))?.extract()?;
        if have >= prompt_len {
            let out = seq.call_method0(intern!(py, "get_output_token_ids"))?;
            let new = out.get_item(pyo3::types::PySlice::new(
                py,
                (have - prompt_len) as isize,
                isize::MAX,
                1,
            ))?;
            let tokens = crate::arrays::extract_tokens(&new)?;
            store.borrow_mut().inner.extend(&tokens);
            if store.borrow().inner.len() == len {
                return Ok(());
            }
        }
    }
    let fresh = foreign_store(seq, block_size, hasher)?;
    let rebuilt = fresh.borrow().inner.clone();
    store.borrow_mut().inner = rebuilt;
    Ok(())
}

fn group_seqs<'py>(group: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
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

fn alloc_status(py: Python<'_>, s: AllocStatus) -> PyResult<Py<PyAny>> {
    static CELL: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let cls = CELL.get_or_try_init(py, || {
        Ok::<_, PyErr>(
            py.import("pagedkv.block_manager")?
                .getattr("AllocStatus")?
                .unbind(),
        )
    })?;
    let name = match s {
        AllocStatus::Ok => "OK",
        AllocStatus::Later => "LATER",
        AllocStatus::Never => "NEVER",
    };
    Ok(cls.bind(py).getattr(name)?.unbind())
}

fn device_arg(device: &str) -> PyResult<Device> {
    match device {
        "gpu" | "GPU" | "cuda" => Ok(Device::Gpu),
        "cpu" | "CPU" => Ok(Device::Cpu),
        other => Err(invalid(format!(
            "device must be 'gpu' or 'cpu', got {other:?}"
        ))),
    }
}

/// `pagedkv.block_manager.BlockMapping` (a read-only dict that iterates as `(src, dst)` pairs,
/// so vLLM 0.4 and 0.5 schedulers both take it), and its shared empty instance: most calls
/// copy nothing, and then cost no allocation.
fn block_mapping_class(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static CELL: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    Ok(CELL
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(
                py.import("pagedkv.block_manager")?
                    .getattr("BlockMapping")?
                    .unbind(),
            )
        })?
        .bind(py))
}

fn empty_mapping(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    static CELL: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    Ok(CELL
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(block_mapping_class(py)?.call0()?.unbind())
        })?
        .bind(py)
        .clone())
}

fn copies_dict<'py>(py: Python<'py>, copies: &Copies) -> PyResult<Bound<'py, PyAny>> {
    if copies.is_empty() {
        return empty_mapping(py);
    }
    let d = PyDict::new(py);
    for &(src, dst) in copies {
        match d.get_item(src)? {
            Some(list) => list.cast_into::<PyList>()?.append(dst)?,
            None => d.set_item(src, PyList::new(py, [dst])?)?,
        }
    }
    block_mapping_class(py)?.call1((d,))
}

fn mapping_dict<'py>(
    py: Python<'py>,
    mapping: &[(BlockId, BlockId)],
) -> PyResult<Bound<'py, PyAny>> {
    if mapping.is_empty() {
        return empty_mapping(py);
    }
    let d = PyDict::new(py);
    for &(a, b) in mapping {
        d.set_item(a, b)?;
    }
    block_mapping_class(py)?.call1((d,))
}

/// Native base of `pagedkv.BlockSpaceManager`: vLLM's block manager API (BlockSpaceManagerV1
/// semantics) over the core manager. Use `pagedkv.BlockSpaceManager`.
#[pyclass(module = "pagedkv._native", name = "BlockSpaceManager", subclass)]
pub struct PyManager {
    inner: Manager,
    copies: Copies,
    /// Python ints for every block number of each pool, made once: building a block table
    /// list then costs a reference increment per entry instead of an int allocation.
    gpu_ints: Vec<Py<PyAny>>,
    cpu_ints: Vec<Py<PyAny>>,
    /// The last block-table list built for each sequence, with the table version it shows.
    /// `get_block_table` hands out copies of it until the table changes (a table changes once
    /// per `block_size` decode steps, so most calls are a list copy).
    table_lists: HashMap<SeqId, (u64, Py<PyList>)>,
    /// Sequences that hold a table, by object identity: their id and native token store, read
    /// once at `allocate`/`fork` instead of through three attribute lookups on every call. We
    /// hold a reference to each object, so its address cannot be reused while it is here; the
    /// entry goes at `free`/`reset`. (A sequence's `seq_id` and `data` must not be replaced
    /// while it holds a table; vLLM never does.)
    known: HashMap<usize, Known>,
    known_by_id: HashMap<SeqId, usize>,
}

struct Known {
    _obj: Py<PyAny>,
    id: SeqId,
    store: Py<PyTokenSeq>,
    /// Not a pagedkv Sequence: the store is ours and is synced with the sequence on each use.
    foreign: bool,
}

/// Sequences resolved to (id, store) with their hasher aligned to the manager's.
struct Resolved<'py> {
    items: Vec<(SeqId, PyRef<'py, PyTokenSeq>)>,
    stores: Vec<Bound<'py, PyTokenSeq>>,
}

impl<'py> Resolved<'py> {
    fn refs(&self) -> Vec<(SeqId, &TokenSeq)> {
        self.items.iter().map(|(id, s)| (*id, &s.inner)).collect()
    }
}

impl PyManager {
    fn id_of(&self, seq: &Bound<'_, PyAny>) -> PyResult<SeqId> {
        match self.known.get(&(seq.as_ptr() as usize)) {
            Some(k) => Ok(k.id),
            None => seq_id_of(seq),
        }
    }

    fn remember(&mut self, seq: &Bound<'_, PyAny>, id: SeqId, store: &Bound<'_, PyTokenSeq>) {
        self.forget(id);
        let ptr = seq.as_ptr() as usize;
        if let Some(old) = self.known.remove(&ptr) {
            self.known_by_id.remove(&old.id);
        }
        let foreign = native_store_of(seq).is_none_or(|s| !s.is(store));
        self.known.insert(
            ptr,
            Known {
                _obj: seq.clone().unbind(),
                id,
                store: store.clone().unbind(),
                foreign,
            },
        );
        self.known_by_id.insert(id, ptr);
    }

    fn forget(&mut self, id: SeqId) {
        if let Some(ptr) = self.known_by_id.remove(&id) {
            self.known.remove(&ptr);
        }
    }

    /// The token store of a sequence that is not (yet) remembered: its own native store, or
    /// one built for it.
    fn store_for<'py>(&self, seq: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyTokenSeq>> {
        match native_store_of(seq) {
            Some(s) => Ok(s),
            None => foreign_store(
                seq,
                self.inner.config().block_size,
                self.inner.config().hasher,
            ),
        }
    }

    fn resolve<'py>(&self, seqs: &[Bound<'py, PyAny>]) -> PyResult<Resolved<'py>> {
        let hasher = self.inner.config().hasher;
        let mut items = Vec::with_capacity(seqs.len());
        let mut stores = Vec::with_capacity(seqs.len());
        for seq in seqs {
            let (id, store) = match self.known.get(&(seq.as_ptr() as usize)) {
                Some(k) => {
                    let store = k.store.bind(seq.py()).clone();
                    if k.foreign {
                        sync_foreign(seq, &store, self.inner.config().block_size, hasher)?;
                    }
                    (k.id, store)
                }
                None => (seq_id_of(seq)?, self.store_for(seq)?),
            };
            if store.borrow().inner.hasher() != hasher {
                store.borrow_mut().inner.adopt_hasher(hasher);
            }
            items.push((id, store.borrow()));
            stores.push(store);
        }
        Ok(Resolved { items, stores })
    }

    fn resolve_one<'py>(
        &self,
        seq: &Bound<'py, PyAny>,
    ) -> PyResult<(SeqId, PyRef<'py, PyTokenSeq>)> {
        let mut r = self.resolve(std::slice::from_ref(seq))?;
        Ok(r.items.pop().expect("one item"))
    }

    fn with_status<'py>(
        group: &Bound<'py, PyAny>,
        pred: impl Fn(Status) -> bool,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let mut out = Vec::new();
        for s in group_seqs(group)? {
            if pred(status_of(&s)?) {
                out.push(s);
            }
        }
        Ok(out)
    }

    fn ids(&self, seqs: &[Bound<'_, PyAny>]) -> PyResult<Vec<SeqId>> {
        seqs.iter().map(|s| self.id_of(s)).collect()
    }

    fn write_rows(
        &self,
        ids: &[(SeqId, &TokenSeq)],
        tables: &I32Out,
        pad_value: i32,
        context_lens: Option<&I32Out>,
        slot_mapping: Option<&I32Out>,
    ) -> PyResult<()> {
        let (rows, cols) = (tables.shape[0], tables.shape[1]);
        let bs = self.inner.config().block_size;
        // SAFETY: shapes were checked against `ids` by the caller; the arrays are alive (held by
        // the caller's references) and we are attached to the interpreter.
        let table_buf = unsafe { std::slice::from_raw_parts_mut(tables.ptr, rows * cols) };
        for (r, &(id, seq)) in ids.iter().enumerate() {
            let t = self.inner.block_table(id).py()?;
            let row = &mut table_buf[r * cols..(r + 1) * cols];
            for (dst, &b) in row.iter_mut().zip(t) {
                *dst = b as i32;
            }
            row[t.len()..].fill(pad_value);
            let len = seq.len();
            if let Some(cl) = context_lens {
                unsafe { *cl.ptr.add(r) = len as i32 };
            }
            if let Some(sm) = slot_mapping {
                let slot = if len == 0 {
                    -1
                } else {
                    let p = len - 1;
                    (t[p / bs] as usize * bs + p % bs) as i32
                };
                unsafe { *sm.ptr.add(r) = slot };
            }
        }
        Ok(())
    }

    fn check_buffers(
        &self,
        refs: &[(SeqId, &TokenSeq)],
        tables: &I32Out,
        vecs: &[(&str, Option<&I32Out>)],
        extra_blocks: bool,
    ) -> PyResult<()> {
        let n = refs.len();
        let (rows, cols) = (tables.shape[0], tables.shape[1]);
        if rows < n {
            return Err(invalid(format!(
                "block_tables has {rows} rows for {n} sequences"
            )));
        }
        for (name, v) in vecs {
            if let Some(v) = v {
                if v.shape[0] < n {
                    return Err(invalid(format!(
                        "{name} has {} entries for {n} sequences",
                        v.shape[0]
                    )));
                }
            }
        }
        let bs = self.inner.config().block_size;
        for &(id, seq) in refs {
            let cur = self.inner.block_table(id).py()?.len();
            let after = if extra_blocks {
                cur.max(seq.len().div_ceil(bs))
            } else {
                cur
            };
            if after > cols {
                return Err(invalid(format!(
                    "block_tables has {cols} columns but sequence {id} needs {after}"
                )));
            }
            if after as u64 > i32::MAX as u64 || seq.len() > i32::MAX as usize {
                return Err(invalid("sequence too long for int32 buffers"));
            }
        }
        Ok(())
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
        let bs = crate::hashing::check_block_size(int_arg(block_size, "block_size")?)?;
        let nblocks = |o: &Bound<'_, PyAny>, what: &str| -> PyResult<u32> {
            let v = int_arg(o, what)?;
            if !(0..u32::MAX as i64).contains(&v) {
                return Err(invalid(format!("{what} must be in 0..2**32-1, got {v}")));
            }
            Ok(v as u32)
        };
        let sliding_window = match sliding_window {
            Some(o) if !o.is_none() => {
                let v = int_arg(o, "sliding_window")?;
                if v <= 0 {
                    return Err(invalid(format!("sliding_window must be positive, got {v}")));
                }
                Some(v as usize)
            }
            _ => None,
        };
        let cfg = ManagerConfig {
            block_size: bs,
            num_gpu_blocks: nblocks(num_gpu_blocks, "num_gpu_blocks")?,
            num_cpu_blocks: nblocks(num_cpu_blocks, "num_cpu_blocks")?,
            watermark: watermark.0,
            sliding_window,
            enable_caching,
            strict,
            hasher: resolve_hasher(hash_algo, hash_seed.map(|c| c.0))?,
        };
        let ints = |n: u32| -> PyResult<Vec<Py<PyAny>>> {
            (0..n)
                .map(|b| Ok(b.into_pyobject(py)?.into_any().unbind()))
                .collect()
        };
        Ok(PyManager {
            gpu_ints: ints(cfg.num_gpu_blocks)?,
            cpu_ints: ints(cfg.num_cpu_blocks)?,
            inner: Manager::new(cfg).py()?,
            copies: Vec::new(),
            table_lists: HashMap::new(),
            known: HashMap::new(),
            known_by_id: HashMap::new(),
        })
    }

    // ---- configuration -----------------------------------------------------------------
    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.config().block_size
    }
    /// Blocks in the GPU pool.
    #[getter]
    fn num_total_gpu_blocks(&self) -> u32 {
        self.inner.config().num_gpu_blocks
    }
    /// Blocks in the CPU (swap) pool.
    #[getter]
    fn num_total_cpu_blocks(&self) -> u32 {
        self.inner.config().num_cpu_blocks
    }
    /// Fraction of GPU blocks `can_allocate` keeps free.
    #[getter]
    fn watermark(&self) -> f64 {
        self.inner.config().watermark
    }
    /// `watermark * num_total_gpu_blocks`, in blocks.
    #[getter]
    fn watermark_blocks(&self) -> usize {
        self.inner.watermark_blocks()
    }
    /// Whether full blocks are shared through the prefix cache.
    #[getter]
    fn enable_caching(&self) -> bool {
        self.inner.config().enable_caching
    }
    /// The sliding window in blocks (None without a window).
    #[getter]
    fn block_sliding_window(&self) -> Option<usize> {
        self.inner.window_blocks()
    }
    /// Whether `free` of a sequence without a table raises `UnknownSequenceError`.
    #[getter]
    fn strict(&self) -> bool {
        self.inner.config().strict
    }
    /// `(hash_algo, hash_seed)` of the block hash.
    #[getter]
    fn hasher(&self) -> (&'static str, u64) {
        let h = self.inner.config().hasher;
        (h.algo.name(), h.seed)
    }

    // ---- allocation --------------------------------------------------------------------
    /// Whether the group's WAITING prompt fits: an `AllocStatus` (OK, LATER or NEVER;
    /// the watermark counts).
    fn can_allocate(&self, py: Python<'_>, seq_group: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let waiting = Self::with_status(seq_group, |s| s == Status::Waiting)?;
        let first = waiting
            .first()
            .ok_or_else(|| invalid("the sequence group has no WAITING sequence"))?;
        let (_, store) = self.resolve_one(first)?;
        alloc_status(py, self.inner.can_allocate(&store.inner).py()?)
    }

    /// Give the group's WAITING sequences one shared block table for the prompt (prefix-cache
    /// hits reused). `OutOfBlocksError` if it does not fit.
    fn allocate(&mut self, seq_group: &Bound<'_, PyAny>) -> PyResult<()> {
        let waiting = Self::with_status(seq_group, |s| s == Status::Waiting)?;
        let r = self.resolve(&waiting)?;
        self.inner.allocate(&r.refs()).py()?;
        let ids: Vec<SeqId> = r.items.iter().map(|(id, _)| *id).collect();
        let stores = r.stores.clone();
        drop(r);
        for ((seq, id), store) in waiting.iter().zip(ids).zip(stores) {
            self.remember(seq, id, &store);
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
        let running = Self::with_status(seq_group, |s| s == Status::Running)?;
        let r = self.resolve(&running)?;
        self.inner
            .can_append_slots(&r.refs(), num_lookahead_slots.usize())
            .py()
    }

    /// Reserve slots for the tokens appended since the last call; returns copy-on-write pairs
    /// `{src_block: [dst_block, ...]}` (empty when nothing is copied).
    #[pyo3(signature = (seq, num_lookahead_slots = Count(0)),
           text_signature = "($self, seq, num_lookahead_slots=0)")]
    fn append_slots<'py>(
        &mut self,
        py: Python<'py>,
        seq: &Bound<'py, PyAny>,
        num_lookahead_slots: Count,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (id, store) = self.resolve_one(seq)?;
        self.copies.clear();
        self.inner
            .append_slots(
                id,
                &store.inner,
                num_lookahead_slots.usize(),
                &mut self.copies,
            )
            .py()?;
        copies_dict(py, &self.copies)
    }

    /// One decode step for many sequences in one call: reserve each one's newest slot, then
    /// write row `i` of `block_tables` (int32 `[rows >= n, cols]`, the rest of the row set to
    /// `pad_value`), `context_lens[i]` (= seq length) and `slot_mapping[i]` (slot of the newest
    /// token, `block * block_size + offset`). Buffers are numpy int32 arrays (torch: `t.numpy()`),
    /// written in place. Everything is checked before anything changes; out of blocks raises
    /// `OutOfBlocksError` with no sequence touched. Returns the copy-on-write pairs.
    #[pyo3(signature = (seqs, block_tables, context_lens, slot_mapping, *, pad_value = Int32(0)),
           text_signature = "($self, seqs, block_tables, context_lens, slot_mapping, *, pad_value=0)")]
    fn append_slots_batch<'py>(
        &mut self,
        py: Python<'py>,
        seqs: &Bound<'py, PyAny>,
        block_tables: &Bound<'py, PyAny>,
        context_lens: &Bound<'py, PyAny>,
        slot_mapping: &Bound<'py, PyAny>,
        pad_value: Int32,
    ) -> PyResult<Bound<'py, PyAny>> {
        let seqs = items(seqs)?;
        let tables = writable_i32(block_tables, "block_tables", 2)?;
        let cl = writable_i32(context_lens, "context_lens", 1)?;
        let sm = writable_i32(slot_mapping, "slot_mapping", 1)?;
        let r = self.resolve(&seqs)?;
        let refs = r.refs();
        self.check_buffers(
            &refs,
            &tables,
            &[("context_lens", Some(&cl)), ("slot_mapping", Some(&sm))],
            true,
        )?;
        self.copies.clear();
        self.inner
            .append_slots_batch(&refs, 0, &mut self.copies)
            .py()?;
        self.write_rows(&refs, &tables, pad_value.0, Some(&cl), Some(&sm))?;
        copies_dict(py, &self.copies)
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
        let seqs = items(seqs)?;
        let tables = writable_i32(block_tables, "block_tables", 2)?;
        let cl = context_lens
            .map(|c| writable_i32(c, "context_lens", 1))
            .transpose()?;
        let r = self.resolve(&seqs)?;
        let refs = r.refs();
        self.check_buffers(&refs, &tables, &[("context_lens", cl.as_ref())], false)?;
        self.write_rows(&refs, &tables, pad_value.0, cl.as_ref(), None)
    }

    /// Share every block of `parent_seq`'s table with `child_seq` (ref counts +1).
    fn fork(
        &mut self,
        parent_seq: &Bound<'_, PyAny>,
        child_seq: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let parent = self.id_of(parent_seq)?;
        let child = seq_id_of(child_seq)?;
        if parent == child {
            return Err(invalid(format!(
                "cannot fork sequence {parent} into itself"
            )));
        }
        let child_store = self.store_for(child_seq)?;
        self.inner.fork(parent, child).py()?;
        if self.inner.has_table(child) {
            self.remember(child_seq, child, &child_store);
        }
        Ok(())
    }

    /// Release `seq`'s table. Without a table: a no-op (vLLM), or `UnknownSequenceError` with
    /// `strict=True`.
    fn free(&mut self, seq: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self.id_of(seq)?;
        self.inner.free(id).py()?;
        self.table_lists.remove(&id);
        self.forget(id);
        Ok(())
    }

    /// Free every sequence's table, as `free` on each (cached blocks stay cached, evictable).
    fn reset(&mut self) -> PyResult<()> {
        self.inner.reset().py()?;
        self.table_lists.clear();
        self.known.clear();
        self.known_by_id.clear();
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
            let st = status_of(&s)?;
            if st != Status::Finished {
                unfinished.push(self.id_of(&s)?);
            }
            swapped += usize::from(st == Status::Swapped);
        }
        alloc_status(
            py,
            self.inner
                .can_swap_in(&unfinished, swapped, num_lookahead_slots.usize())
                .py()?,
        )
    }

    /// Move the group's SWAPPED sequences to the GPU; returns `{cpu_block: gpu_block}`.
    /// `num_lookahead_slots` is accepted for vLLM's signature; slots are reserved by the next
    /// `append_slots`, as in vLLM.
    #[pyo3(signature = (seq_group, num_lookahead_slots = Count(0)),
           text_signature = "($self, seq_group, num_lookahead_slots=0)")]
    fn swap_in<'py>(
        &mut self,
        py: Python<'py>,
        seq_group: &Bound<'py, PyAny>,
        num_lookahead_slots: Count,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = num_lookahead_slots;
        let seqs = Self::with_status(seq_group, |s| s == Status::Swapped)?;
        let ids = self.ids(&seqs)?;
        let m = self.inner.swap(&ids, Device::Cpu).py()?;
        mapping_dict(py, &m)
    }

    /// Whether the distinct blocks of the group's unfinished sequences fit in the free CPU blocks.
    fn can_swap_out(&self, seq_group: &Bound<'_, PyAny>) -> PyResult<bool> {
        let seqs = Self::with_status(seq_group, |s| s != Status::Finished)?;
        self.inner.can_swap_out(&self.ids(&seqs)?).py()
    }

    /// Move the group's RUNNING sequences to the CPU; returns `{gpu_block: cpu_block}`.
    fn swap_out<'py>(
        &mut self,
        py: Python<'py>,
        seq_group: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let seqs = Self::with_status(seq_group, |s| s == Status::Running)?;
        let ids = self.ids(&seqs)?;
        let m = self.inner.swap(&ids, Device::Gpu).py()?;
        mapping_dict(py, &m)
    }

    // ---- queries -----------------------------------------------------------------------
    /// The physical block ids of `seq`'s table, in logical order (a new list).
    fn get_block_table<'py>(
        &mut self,
        py: Python<'py>,
        seq: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let id = self.id_of(seq)?;
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

    /// Free GPU blocks (evictable cached blocks count as free).
    fn get_num_free_gpu_blocks(&self) -> usize {
        self.inner.num_free_gpu_blocks()
    }

    /// Free CPU blocks (evictable cached blocks count as free).
    fn get_num_free_cpu_blocks(&self) -> usize {
        self.inner.num_free_cpu_blocks()
    }

    /// Record `access_time` as the last access of every block of `seq` (LRU eviction order).
    fn access_all_blocks_in_seq(
        &mut self,
        seq: &Bound<'_, PyAny>,
        access_time: Real,
    ) -> PyResult<()> {
        let id = self.id_of(seq)?;
        self.inner.access_all_blocks_in_seq(id, access_time.0).py()
    }

    /// Mark every full block of `seq` as computed (prefix caching).
    fn compute_full_blocks_in_seq(&mut self, seq: &Bound<'_, PyAny>) -> PyResult<()> {
        let (id, store) = self.resolve_one(seq)?;
        self.inner.compute_full_blocks_in_seq(id, store.inner.len());
        Ok(())
    }

    /// The computed blocks of `seq`'s table, except its last block (as vLLM).
    fn get_all_computed_blocks<'py>(
        &self,
        py: Python<'py>,
        seq: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let id = self.id_of(seq)?;
        PyList::new(py, self.inner.get_all_computed_blocks(id))
    }

    /// Longest common prefix of the computed blocks of `seqs` (those with none are skipped;
    /// empty without caching).
    fn get_common_computed_block_ids<'py>(
        &self,
        py: Python<'py>,
        seqs: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let mut ids = Vec::new();
        for s in items(seqs)? {
            ids.push(self.id_of(&s)?);
        }
        PyList::new(py, self.inner.get_common_computed_block_ids(&ids))
    }

    /// Mark the full blocks of every sequence of the group as computed (no-op without caching).
    fn mark_blocks_as_computed(&mut self, seq_group: &Bound<'_, PyAny>) -> PyResult<()> {
        if !self.inner.config().enable_caching {
            return Ok(());
        }
        let seqs = group_seqs(seq_group)?;
        let r = self.resolve(&seqs)?;
        for (id, s) in r.refs() {
            self.inner.compute_full_blocks_in_seq(id, s.len());
        }
        Ok(())
    }

    /// `access_all_blocks_in_seq` for many sequences in one call (batch step API).
    fn access_all_blocks_in_seqs(
        &mut self,
        seqs: &Bound<'_, PyAny>,
        access_time: Real,
    ) -> PyResult<()> {
        let mut ids = Vec::new();
        for s in items(seqs)? {
            ids.push(self.id_of(&s)?);
        }
        self.inner
            .access_all_blocks_in_seqs(&ids, access_time.0)
            .py()
    }

    /// `compute_full_blocks_in_seq` for many sequences in one call (what
    /// `mark_blocks_as_computed` does for each sequence of a group).
    fn compute_full_blocks_in_seqs(&mut self, seqs: &Bound<'_, PyAny>) -> PyResult<()> {
        if !self.inner.config().enable_caching {
            return Ok(());
        }
        let seqs = items(seqs)?;
        let r = self.resolve(&seqs)?;
        for (id, s) in r.refs() {
            self.inner.compute_full_blocks_in_seq(id, s.len());
        }
        Ok(())
    }

    // ---- introspection -----------------------------------------------------------------
    /// Whether `seq` holds a block table in this manager.
    fn has_table(&self, seq: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.inner.has_table(self.id_of(seq)?))
    }

    /// Device ("gpu"/"cpu") the sequence's table lives on.
    fn table_device(&self, seq: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        Ok(self.inner.device_of(self.id_of(seq)?).py()?.name())
    }

    /// The ref count of `block` on `device` ("gpu" or "cpu").
    fn ref_count(&self, device: &str, block: &Bound<'_, PyAny>) -> PyResult<u32> {
        let pool = self.inner.pool(device_arg(device)?);
        let b = pool.check(int_arg(block, "block")?).py()?;
        Ok(pool.ref_count(b))
    }

    /// `{ref_count, block_hash, num_hashed_tokens, last_accessed, computed}` of one block.
    fn block_info<'py>(
        &self,
        py: Python<'py>,
        device: &str,
        block: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let dev = device_arg(device)?;
        let pool = self.inner.pool(dev);
        let b = pool.check(int_arg(block, "block")?).py()?;
        let d = PyDict::new(py);
        d.set_item("ref_count", pool.ref_count(b))?;
        d.set_item("block_hash", pool.block_hash(b))?;
        d.set_item("num_hashed_tokens", pool.num_hashed_tokens(b))?;
        d.set_item("last_accessed", self.inner.last_accessed(dev, b))?;
        d.set_item("computed", pool.is_computed(b))?;
        Ok(d)
    }

    /// `(lookups, hits)` of full prompt blocks in `allocate` (the prefix-cache hit rate).
    fn prefix_cache_stats(&self) -> (u64, u64) {
        self.inner.prefix_cache_stats()
    }

    /// Blocks of `device` registered in the prefix cache (referenced or evictable).
    #[pyo3(signature = (device = "gpu"))]
    fn num_cached_blocks(&self, device: &str) -> PyResult<usize> {
        Ok(self.inner.pool(device_arg(device)?).num_cached())
    }

    /// Cached blocks of `device` with ref count 0 (reusable after eviction).
    #[pyo3(signature = (device = "gpu"))]
    fn num_evictable_blocks(&self, device: &str) -> PyResult<usize> {
        Ok(self.inner.pool(device_arg(device)?).num_evictable())
    }

    /// Raise AssertionError if a pool invariant is broken or a ref count disagrees with the
    /// tables (O(blocks); for tests).
    fn check_invariants(&self) -> PyResult<()> {
        self.inner
            .check_invariants()
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }
}
