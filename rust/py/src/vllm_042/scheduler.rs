//! `SchedulerCore`: the native half of `pagedkv.Scheduler`. It keeps the Python
//! `SequenceGroup`/`Sequence` objects (and their native token stores) beside the core
//! scheduler's state, mirrors the engine's changes to running groups into the core before a
//! step and writes the core's status changes back after it (docs/scheduler.md). The policy is
//! all in `pagedkv_core::vllm_042::scheduler`; the compat `schedule()`'s vLLM objects are built in
//! `metadata.rs`, the batch step's buffers in `batch.rs`.

pub(crate) mod batch;
mod metadata;

use crate::args::{Count, Real};
use metadata::LastOutputs;

use crate::errors::{busy, invalid, wrong_type, IntoPyResult};
use crate::vllm_042::hashing::PyTokenSeq;
use crate::vllm_042::manager::PyManager;
use crate::vllm_042::registry::borrow_adopted;
use pagedkv_core::vllm_042::scheduler::{
    Change, Finish, Group, GroupKey, IdMap, Outputs, PreemptionMode, Scheduler, SchedulerConfig,
    SeqState, Status, StepMeta, Tokens,
};
use pagedkv_core::vllm_042::{ComputedPrefix, SeqId, TokenSeq};
use pagedkv_core::Error;
use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use pyo3::PyTraverseError;

const STATUS_NAMES: [&str; 7] = [
    "WAITING",
    "RUNNING",
    "SWAPPED",
    "FINISHED_STOPPED",
    "FINISHED_LENGTH_CAPPED",
    "FINISHED_ABORTED",
    "FINISHED_IGNORED",
];

fn status_index(s: Status) -> usize {
    match s {
        Status::Waiting => 0,
        Status::Running => 1,
        Status::Swapped => 2,
        Status::Finished(Finish::Stopped) => 3,
        Status::Finished(Finish::LengthCapped) => 4,
        Status::Finished(Finish::Aborted) => 5,
        Status::Finished(Finish::Ignored) => 6,
    }
}

const STATUSES: [Status; 7] = [
    Status::Waiting,
    Status::Running,
    Status::Swapped,
    Status::Finished(Finish::Stopped),
    Status::Finished(Finish::LengthCapped),
    Status::Finished(Finish::Aborted),
    Status::Finished(Finish::Ignored),
];

struct SeqView {
    obj: Py<PyAny>,
    /// `seq.seq_id` as the engine's int object (the key of its group's `seqs_dict`).
    id_obj: Py<PyAny>,
    store: Py<PyTokenSeq>,
    /// The read-only block-table list handed out in metadata, with the table version it
    /// shows: reused until the table changes (once per `block_size` decode steps).
    table: Option<(u64, Py<PyAny>)>,
    /// Whether the sequence counts blocks in the manager's block size (vLLM's own tests use
    /// other sizes; the compat `schedule()` takes them as the manager does, the batch step
    /// does not).
    manager_units: bool,
}

struct GroupView {
    obj: Py<PyAny>,
    /// The read-only `computed_block_nums` list last handed out, reused while it names the
    /// same blocks (same prefix of the same table version).
    computed: Option<(Option<ComputedPrefix>, Py<PyAny>)>,
    /// The `SequenceGroupMetadata` and `ScheduledSequenceGroup` handed out last, reused while
    /// everything they were built from is the same (docs/scheduler.md, "Metadata objects").
    /// Boxed: only groups that were scheduled pay for it.
    last: Option<Box<LastOutputs>>,
}

/// The token stores of the known sequences, read in place (no Python code runs while the
/// core holds a borrow: the GIL is held and nothing here calls back into Python).
struct Stores<'a, 'py> {
    py: Python<'py>,
    seqs: &'a IdMap<SeqId, SeqView>,
}

impl Tokens for Stores<'_, '_> {
    fn with<R>(&self, id: SeqId, f: impl FnOnce(&TokenSeq) -> R) -> pagedkv_core::Result<R> {
        let v = self.seqs.get(&id).ok_or(Error::UnknownSequence(id))?;
        let s =
            v.store.bind(self.py).try_borrow().map_err(|_| {
                Error::invalid(format!("the token store of sequence {id} is in use"))
            })?;
        Ok(f(&s.inner))
    }
}

#[pyclass(module = "pagedkv._native", name = "SchedulerCore")]
pub struct PySchedulerCore {
    core: Scheduler,
    manager: Py<PyManager>,
    groups: IdMap<GroupKey, GroupView>,
    seqs: IdMap<SeqId, SeqView>,
    /// `pagedkv.scheduler.BlockList` (a read-only list).
    block_list: Py<PyAny>,
    /// `pagedkv.sequence.SequenceGroupMetadata` and `pagedkv.scheduler.ScheduledSequenceGroup`.
    metadata_cls: Py<PyAny>,
    scheduled_cls: Py<PyAny>,
    /// `SequenceStatus` members in `STATUS_NAMES` order, and `SequenceStage.DECODE`.
    statuses: Vec<Py<PyAny>>,
    decode: Py<PyAny>,
    /// Set once a sequence in other block units than the manager's was added: the batch step,
    /// whose slot numbers are in the manager's units, refuses to run from then on.
    mixed_units: bool,
}

fn preemption_mode(s: Option<&str>) -> PyResult<Option<PreemptionMode>> {
    Ok(match s.map(|s| s.to_ascii_lowercase()) {
        None => None,
        Some(s) if s == "swap" => Some(PreemptionMode::Swap),
        Some(s) if s == "recompute" => Some(PreemptionMode::Recompute),
        Some(s) => {
            return Err(invalid(format!(
                "preemption_mode must be 'swap' or 'recompute', got {s:?}"
            )))
        }
    })
}

#[pymethods]
impl PySchedulerCore {
    #[new]
    #[pyo3(signature = (manager, max_num_batched_tokens, max_num_seqs, max_model_len, *,
        num_lookahead_slots = Count(0), delay_factor = Real(0.0), chunked_prefill = false,
        max_loras = None, preemption_mode = None),
        text_signature = "(manager, max_num_batched_tokens, max_num_seqs, max_model_len, *, \
        num_lookahead_slots=0, delay_factor=0.0, chunked_prefill=False, max_loras=None, \
        preemption_mode=None)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        manager: &Bound<'_, PyAny>,
        max_num_batched_tokens: Count,
        max_num_seqs: Count,
        max_model_len: Count,
        num_lookahead_slots: Count,
        delay_factor: Real,
        chunked_prefill: bool,
        max_loras: Option<Count>,
        preemption_mode: Option<&str>,
    ) -> PyResult<Self> {
        let manager = manager
            .cast::<PyManager>()
            .map_err(|_| wrong_type("manager must be a pagedkv BlockSpaceManager"))?
            .clone()
            .unbind();
        let cfg = SchedulerConfig {
            max_num_batched_tokens: max_num_batched_tokens.usize(),
            max_num_seqs: max_num_seqs.usize(),
            max_model_len: max_model_len.usize(),
            num_lookahead_slots: num_lookahead_slots.usize(),
            delay_factor: delay_factor.0,
            chunked_prefill,
            max_loras: max_loras.map(Count::usize),
            preemption_mode: self::preemption_mode(preemption_mode)?,
        };
        let seq_mod = py.import("pagedkv.vllm_042.sequence")?;
        let st = seq_mod.getattr("SequenceStatus")?;
        let statuses = STATUS_NAMES
            .iter()
            .map(|n| st.getattr(*n).map(|m| m.unbind()))
            .collect::<PyResult<Vec<_>>>()?;
        let decode = seq_mod
            .getattr("SequenceStage")?
            .getattr("DECODE")?
            .unbind();
        let block_list = py
            .import("pagedkv.vllm_042.scheduler")?
            .getattr("BlockList")?
            .unbind();
        let metadata_cls = seq_mod.getattr("SequenceGroupMetadata")?.unbind();
        let scheduled_cls = py
            .import("pagedkv.vllm_042.scheduler")?
            .getattr("ScheduledSequenceGroup")?
            .unbind();
        Ok(PySchedulerCore {
            core: Scheduler::new(cfg).py()?,
            manager,
            groups: IdMap::default(),
            seqs: IdMap::default(),
            statuses,
            decode,
            block_list,
            metadata_cls,
            scheduled_cls,
            mixed_units: false,
        })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.manager)?;
        visit.call(&self.block_list)?;
        visit.call(&self.metadata_cls)?;
        visit.call(&self.scheduled_cls)?;
        for g in self.groups.values() {
            visit.call(&g.obj)?;
            if let Some((_, l)) = &g.computed {
                visit.call(l)?;
            }
            if let Some(last) = &g.last {
                last.traverse(&visit)?;
            }
        }
        for s in self.seqs.values() {
            visit.call(&s.obj)?;
            visit.call(&s.store)?;
            if let Some((_, l)) = &s.table {
                visit.call(l)?;
            }
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        // Drop the core's groups too, so that no queue names a view that is gone.
        if let Ok(empty) = Scheduler::new(self.core.config().clone()) {
            self.core = empty;
        }
        self.groups.clear();
        self.seqs.clear();
    }

    /// The block manager the scheduler drives.
    #[getter]
    fn manager(&self, py: Python<'_>) -> Py<PyManager> {
        self.manager.clone_ref(py)
    }

    /// vLLM's `add_seq_group`: a fresh request with one WAITING pagedkv `Sequence`.
    fn add_seq_group(&mut self, group: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = group.py();
        let rid = group.getattr(intern!(py, "request_id"))?;
        let rid = rid
            .cast::<PyString>()
            .map_err(|_| wrong_type("seq_group.request_id must be a str"))?
            .to_cow()?
            .into_owned();
        let arrival: f64 = group
            .getattr(intern!(py, "metrics"))?
            .getattr(intern!(py, "arrival_time"))?
            .extract()?;
        let lora: u32 = group.getattr(intern!(py, "lora_int_id"))?.extract()?;
        let sp = group.getattr(intern!(py, "sampling_params"))?;
        let best_of: usize = sp.getattr(intern!(py, "best_of"))?.extract()?;
        let beam: bool = sp.getattr(intern!(py, "use_beam_search"))?.is_truthy()?;
        let mut g = Group::new(&rid, arrival, lora, best_of, beam);
        let seqs = group.call_method0(intern!(py, "get_seqs"))?;
        let seqs = seqs.cast::<PyList>()?;
        let mut views = Vec::with_capacity(seqs.len());
        for seq in seqs.iter() {
            let (state, view) = self.read_new_seq(&seq)?;
            g.seqs.push(state);
            views.push(view);
        }
        g.num_seqs = g.seqs.len();
        let ids: Vec<SeqId> = g.seqs.iter().map(|s| s.id).collect();
        let key = self.core.add_group(g).py()?;
        self.mixed_units |= views.iter().any(|v| !v.manager_units);
        for (id, v) in ids.into_iter().zip(views) {
            self.seqs.insert(id, v);
        }
        let view = GroupView {
            obj: group.clone().unbind(),
            computed: None,
            last: None,
        };
        self.groups.insert(key, view);
        Ok(())
    }

    /// vLLM's `abort_seq_group` for the given request ids.
    fn abort(&mut self, py: Python<'_>, request_ids: Vec<String>) -> PyResult<()> {
        self.sync_running(py)?;
        let ids: Vec<&str> = request_ids.iter().map(String::as_str).collect();
        let mgr = self.manager.bind(py).get();
        let mut m = mgr.locked()?;
        let gone = self.core.abort(&ids, m.core_mut());
        drop(m);
        self.write_back(py)?;
        for k in gone.py()? {
            self.release(k);
        }
        Ok(())
    }

    /// Groups in waiting, running and swapped together.
    fn num_unfinished(&self) -> usize {
        self.core.num_unfinished_groups()
    }

    /// The groups of a queue (`"waiting"`, `"running"` or `"swapped"`), in order.
    fn queue<'py>(&self, py: Python<'py>, which: &str) -> PyResult<Bound<'py, PyList>> {
        let q = match which {
            "waiting" => self.core.waiting(),
            "running" => self.core.running(),
            "swapped" => self.core.swapped(),
            _ => return Err(invalid(format!("no queue named {which:?}"))),
        };
        PyList::new(py, q.iter().map(|k| self.groups[k].obj.bind(py)))
    }

    /// One step. Returns `(scheduled, metadata, num_prefill_groups, num_batched_tokens,
    /// swap_in, swap_out, copies, ignored, num_lookahead_slots, running_queue_size,
    /// num_loras)`: `ScheduledSequenceGroup`s and `SequenceGroupMetadata`s in vLLM's order.
    fn schedule<'py>(&mut self, py: Python<'py>, now: f64) -> PyResult<Bound<'py, PyTuple>> {
        self.sync_running(py)?;
        let (out, metas) = self.schedule_step(py, now, true)?;
        let tuple = self.outputs_tuple(py, &out, &metas, now)?;
        for &k in &out.ignored {
            self.release(k);
        }
        Ok(tuple)
    }

    /// vLLM's `fork_seq`: the child joins the parent's group and shares its blocks.
    fn fork(&mut self, parent: &Bound<'_, PyAny>, child: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = parent.py();
        let pid = seq_id(parent)?;
        let (mut state, view) = self.read_new_seq(child)?;
        if state.id == pid {
            return Err(invalid(format!("cannot fork sequence {pid} into itself")));
        }
        let key = self
            .core
            .group_of_seq(pid)
            .ok_or_else(|| crate::errors::to_py(Error::UnknownSequence(pid)))?;
        let mgr = self.manager.bind(py).get();
        let mut m = mgr.locked()?;
        self.core.fork(pid, state.id, m.core_mut()).py()?;
        drop(m);
        // The child carries its own view of status and progress (vLLM copies the parent's).
        let g = self.core.group_mut(key).expect("live group");
        state.status = g.seqs.last().expect("child").status;
        *g.seqs.last_mut().expect("child") = state.clone();
        self.mixed_units |= !view.manager_units;
        self.seqs.insert(state.id, view);
        Ok(())
    }

    /// vLLM's `free_finished_seq_groups`: the groups whose sequences (in their `seqs_dict`)
    /// all finished leave. Only those are read back here; the next `schedule()` reads every
    /// running group back anyway.
    fn free_finished(&mut self, py: Python<'_>) -> PyResult<()> {
        let mut done = Vec::new();
        for &key in self.core.running() {
            if self.finished_in_view(py, key)? {
                done.push(key);
            }
        }
        let mut fresh = Vec::new();
        for &key in &done {
            self.sync_group(py, key, false, &mut fresh)?;
        }
        for k in self.core.free_finished_among(&done) {
            self.release(k);
        }
        Ok(())
    }

    /// Native bytes held for the scheduler's state (core + this binding's references).
    fn state_bytes(&self) -> usize {
        let groups = self.core.num_unfinished_groups();
        let seqs = self.seqs.len();
        let reused: usize = self
            .groups
            .values()
            .filter_map(|g| g.last.as_ref())
            .map(|l| l.heap_bytes())
            .sum();
        groups * (std::mem::size_of::<Group>() + 4 + std::mem::size_of::<GroupView>() + 16)
            + seqs * (std::mem::size_of::<SeqState>() + std::mem::size_of::<SeqView>() + 16)
            + reused
    }
}

/// Whether `dict` (a group's `seqs_dict`) holds the key `key`. The engine's dicts are keyed by
/// the very int objects the scheduler keeps (`seq.seq_id`), so the keys are compared by
/// identity first, without hashing (which would read each cold int object); any other
/// mapping, or a key that is not found that way, is looked up normally.
fn holds_key(dict: &Bound<'_, PyAny>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
    if let Ok(d) = dict.cast::<PyDict>() {
        // PyO3's checked iterator (it refuses a dict resized under it); the keys are only
        // compared by address, so no Python code runs in the loop.
        if d.iter().any(|(k, _)| k.is(key)) {
            return Ok(true);
        }
    }
    dict.contains(key)
}

fn seq_id(seq: &Bound<'_, PyAny>) -> PyResult<SeqId> {
    seq.getattr(intern!(seq.py(), "seq_id"))?
        .extract::<SeqId>()
        .map_err(|_| wrong_type("seq.seq_id must be a non-negative int"))
}

impl PySchedulerCore {
    /// The batch step writes slot numbers in the manager's block units: refused (before
    /// anything changes) once a sequence in other units was added.
    pub(crate) fn check_batch_units(&self) -> PyResult<()> {
        match self.mixed_units {
            true => Err(invalid(
                "the batch step needs every sequence in the cache's block size; this scheduler \
                 was given a sequence with another block_size (only schedule() takes those)",
            )),
            false => Ok(()),
        }
    }

    fn status_of(&self, seq: &Bound<'_, PyAny>) -> PyResult<Status> {
        let st = seq.getattr(intern!(seq.py(), "status"))?;
        for (i, m) in self.statuses.iter().enumerate() {
            if st.is(m) {
                return Ok(STATUSES[i]);
            }
        }
        let name: String = st
            .getattr(intern!(seq.py(), "name"))
            .and_then(|n| n.extract())
            .map_err(|_| wrong_type("seq.status must be a SequenceStatus"))?;
        STATUS_NAMES
            .iter()
            .position(|n| *n == name)
            .map(|i| STATUSES[i])
            .ok_or_else(|| invalid(format!("unknown sequence status {name}")))
    }

    /// The engine-visible progress of a sequence: (decode stage, num_computed_tokens).
    fn progress_of(&self, seq: &Bound<'_, PyAny>) -> PyResult<(bool, usize)> {
        let py = seq.py();
        let data = seq.getattr(intern!(py, "data"))?;
        let computed = data
            .getattr(intern!(py, "_num_computed_tokens"))?
            .extract()?;
        let decode = data.getattr(intern!(py, "_stage"))?.is(&self.decode);
        Ok((decode, computed))
    }

    fn read_new_seq(&self, seq: &Bound<'_, PyAny>) -> PyResult<(SeqState, SeqView)> {
        let py = seq.py();
        let id = seq_id(seq)?;
        if self.seqs.contains_key(&id) {
            return Err(invalid(format!("sequence {id} is already scheduled")));
        }
        let store = seq
            .getattr(intern!(py, "data"))
            .and_then(|d| d.getattr(intern!(py, "_store")))
            .ok()
            .and_then(|s| s.cast_into::<PyTokenSeq>().ok())
            .ok_or_else(|| {
                wrong_type("pagedkv.Scheduler schedules pagedkv Sequences (seq.data._store)")
            })?;
        let (hasher, block_size) = {
            let m = self.manager.bind(py).get().locked()?;
            (m.core().config().hasher, m.core().config().block_size)
        };
        let own = store
            .try_borrow()
            .map_err(|_| busy("a token store"))?
            .inner
            .block_size();
        drop(borrow_adopted(&store, hasher)?); // hashed with the manager's hasher from now on
        let status = self.status_of(seq)?;
        let (decode, num_computed) = self.progress_of(seq)?;
        let state = SeqState {
            id,
            status,
            decode,
            num_computed,
        };
        Ok((
            state,
            SeqView {
                obj: seq.clone().unbind(),
                id_obj: seq.getattr(intern!(py, "seq_id"))?.unbind(),
                store: store.unbind(),
                table: None,
                manager_units: own == block_size,
            },
        ))
    }

    /// Read what the engine may have changed on running groups since the last step.
    fn sync_running(&mut self, py: Python<'_>) -> PyResult<()> {
        self.sync_running_with(py, true)
    }

    /// `progress`: also read each sequence's computed tokens and stage (`schedule()` needs
    /// them; `free_finished` needs only the statuses). Sequences the engine removed from a
    /// running group's `seqs_dict` (beam search drops parents that way) leave the group.
    fn sync_running_with(&mut self, py: Python<'_>, progress: bool) -> PyResult<()> {
        let mut fresh = Vec::new(); // one buffer for every group (no allocation per group)
        for i in 0..self.core.running().len() {
            let key = self.core.running()[i];
            self.sync_group(py, key, progress, &mut fresh)?;
        }
        Ok(())
    }

    /// [`Self::sync_running_with`] for one running group (`fresh`: a scratch buffer).
    fn sync_group(
        &mut self,
        py: Python<'_>,
        key: GroupKey,
        progress: bool,
        fresh: &mut Vec<(Status, bool, usize)>,
    ) -> PyResult<()> {
        let seqs_dict = self.groups[&key]
            .obj
            .bind(py)
            .getattr(intern!(py, "seqs_dict"))?;
        let n = seqs_dict.len()?;
        fresh.clear();
        let mut removed: Vec<SeqId> = Vec::new(); // allocates only when one is removed
        for s in &self.core.group(key).expect("live").seqs {
            let view = &self.seqs[&s.id];
            if !holds_key(&seqs_dict, view.id_obj.bind(py))? {
                removed.push(s.id);
                continue;
            }
            let obj = view.obj.bind(py);
            let (decode, computed) = match progress {
                true => self.progress_of(obj)?,
                false => (s.decode, s.num_computed),
            };
            fresh.push((self.status_of(obj)?, decode, computed));
        }
        if !removed.is_empty() {
            self.core.remove_seqs(key, &removed);
            for id in &removed {
                self.seqs.remove(id);
            }
        }
        let g = self.core.group_mut(key).expect("live");
        g.num_seqs = n;
        for (s, &(status, decode, computed)) in g.seqs.iter_mut().zip(fresh.iter()) {
            s.status = status;
            s.decode = decode;
            s.num_computed = computed;
        }
        Ok(())
    }

    /// Whether every sequence in a running group's `seqs_dict` has a finished status, read
    /// from the Python objects alone (the engine just wrote them, so they are in the CPU's
    /// caches; the native state is not touched).
    fn finished_in_view(&self, py: Python<'_>, key: GroupKey) -> PyResult<bool> {
        let seqs_dict = self.groups[&key]
            .obj
            .bind(py)
            .getattr(intern!(py, "seqs_dict"))?;
        if let Ok(d) = seqs_dict.cast::<PyDict>() {
            for (_, seq) in d.iter() {
                if !self.status_of(&seq)?.is_finished() {
                    return Ok(false);
                }
            }
            return Ok(true);
        }
        let values = seqs_dict.call_method0(intern!(py, "values"))?;
        for seq in values.try_iter()? {
            if !self.status_of(&seq?)?.is_finished() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The core's step under the manager's lock, then the status write-back: the decisions
    /// and each scheduled group's facts (with `computed_block_nums` when `with_computed`; the
    /// batch step does without). The compat `schedule()` reads running groups back first.
    fn schedule_step(
        &mut self,
        py: Python<'_>,
        now: f64,
        with_computed: bool,
    ) -> PyResult<(Outputs, Vec<StepMeta>)> {
        let mgr = self.manager.bind(py).get();
        let mut m = mgr.locked()?;
        let stores = Stores {
            py,
            seqs: &self.seqs,
        };
        let res = self
            .core
            .schedule(m.core_mut(), &stores, now)
            .and_then(|out| {
                let metas =
                    self.core
                        .build_meta(m.core_mut(), &stores, &out, now, with_computed)?;
                Ok((out, metas))
            });
        drop(m);
        self.write_back(py)?;
        res.py()
    }

    /// Mirror the core's status changes onto the Python sequences.
    fn write_back(&mut self, py: Python<'_>) -> PyResult<()> {
        let changes: Vec<Change> = self.core.take_changes();
        let mgr = self.manager.bind(py).get();
        let mut m = mgr.locked()?;
        for c in &changes {
            if c.reset
                || matches!(
                    c.status,
                    Status::Finished(Finish::Aborted | Finish::Ignored)
                )
            {
                m.dropped(c.seq);
            }
        }
        drop(m);
        for c in changes {
            let obj = self.seqs[&c.seq].obj.bind(py);
            obj.setattr(
                intern!(py, "status"),
                self.statuses[status_index(c.status)].bind(py),
            )?;
            if c.reset {
                obj.call_method0(intern!(py, "reset_state_for_recompute"))?;
            }
        }
        Ok(())
    }

    fn release(&mut self, key: GroupKey) {
        if let Some(g) = self.core.release(key) {
            for s in g.seqs {
                self.seqs.remove(&s.id);
            }
        }
        self.groups.remove(&key);
    }
}
