//! `BatchStep`: issue 10's one-call engine step over a `SchedulerCore` (docs/scheduler.md,
//! "Batch step"). Per step it crosses into Python only for what is per step or per event:
//! forks (a child `Sequence` object), the status of sequences that finished or were
//! preempted, first-scheduled times of new groups, the stop rules of new groups and the
//! views of finished groups. Running sequences' Python views (output token list, computed
//! tokens, stage) are written back on demand (`sync_views`) or when their group finishes.

use super::{PySchedulerCore, Stores};
use crate::errors::{busy, invalid, IntoPyResult};
use crate::vllm_042::buffers::{writable_1d, writable_2d_i32};
use crate::vllm_042::manager::PyManager;
use numpy::{PyReadonlyArray1, PyReadwriteArray1, PyUntypedArrayMethods};
use pagedkv_core::vllm_042::scheduler::{
    Batch, GroupKey, HeldTables, IdMap, ModelInputs, Outputs, SentTables, StableRows, StopRules,
    TableDelta, TokensMut, NO_ROW,
};
use pagedkv_core::vllm_042::{SeqId, TokenSeq};
use pagedkv_core::Error;
use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use pyo3::PyTraverseError;

impl TokensMut for Stores<'_, '_> {
    fn with_mut<R>(
        &self,
        id: SeqId,
        f: impl FnOnce(&mut TokenSeq) -> R,
    ) -> pagedkv_core::Result<R> {
        let v = self.seqs.get(&id).ok_or(Error::UnknownSequence(id))?;
        let mut s =
            v.store.bind(self.py).try_borrow_mut().map_err(|_| {
                Error::invalid(format!("the token store of sequence {id} is in use"))
            })?;
        Ok(f(&mut s.inner))
    }
}

#[pyclass(module = "pagedkv._native", name = "BatchStep")]
pub struct PyBatchStep {
    core: Py<PySchedulerCore>,
    /// Returns a fresh sequence id per call (the engine's counter), for forks.
    new_seq_id: Py<PyAny>,
    prev: Batch,
    /// Buffers kept across steps: the batch consumed by the last step (refilled as the next
    /// one) and a copy of the sampled tokens (taken before any Python callback runs).
    spare_batch: Batch,
    sampled: Vec<i32>,
    /// The last step's decisions (copy and swap lists), for `rewrite`.
    last_out: Outputs,
    /// Incremental block tables (when the buffers have `row_state`): what the caller was
    /// sent, and the last step's changes.
    sent: SentTables,
    last_delta: Option<TableDelta>,
    /// Incremental mode keeps `block_tables` as a persistent buffer: what it holds, and the
    /// array it is (held, so that its memory cannot be reused by another array while we
    /// compare identities).
    held: HeldTables,
    held_array: Option<Py<PyAny>>,
    rules: IdMap<GroupKey, StopRules>,
    prefill: Py<PyAny>,
    /// Stable rows (opt-in): where each running sequence's row is kept.
    stable: Option<StableRows>,
}

/// The output arrays of one step, by keyword.
const OUTPUTS: [&str; 12] = [
    "input_tokens",
    "positions",
    "slot_mapping",
    "query_start_loc",
    "context_lens",
    "num_samples",
    "seq_ids",
    "block_tables",
    "copies",
    "swap_in",
    "swap_out",
    "cached_tokens",
];

#[pymethods]
impl PyBatchStep {
    #[new]
    #[pyo3(signature = (core, new_seq_id, stable_rows = false))]
    fn new(
        core: &Bound<'_, PyAny>,
        new_seq_id: &Bound<'_, PyAny>,
        stable_rows: bool,
    ) -> PyResult<Self> {
        let py = core.py();
        let core = core
            .cast::<PySchedulerCore>()
            .map_err(|_| crate::errors::wrong_type("core must be a SchedulerCore"))?
            .clone()
            .unbind();
        if !new_seq_id.is_callable() {
            return Err(crate::errors::wrong_type("new_seq_id must be callable"));
        }
        let prefill = py
            .import("pagedkv.vllm_042.sequence")?
            .getattr("SequenceStage")?
            .getattr("PREFILL")?
            .unbind();
        Ok(PyBatchStep {
            core,
            new_seq_id: new_seq_id.clone().unbind(),
            prev: Batch::default(),
            spare_batch: Batch::default(),
            sampled: Vec::new(),
            last_out: Outputs::default(),
            sent: SentTables::default(),
            last_delta: None,
            held: HeldTables::default(),
            held_array: None,
            rules: IdMap::default(),
            prefill,
            stable: stable_rows.then(StableRows::default),
        })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.core)?;
        visit.call(&self.new_seq_id)?;
        visit.call(&self.held_array)?;
        visit.call(&self.prefill)
    }

    /// Whether rows are stable (a running sequence keeps its row) rather than in schedule order.
    #[getter]
    fn stable_rows(&self) -> bool {
        self.stable.is_some()
    }

    /// Tokens the caller must pass to the next `step` (the previous batch's samples).
    #[getter]
    fn num_expected_samples(&self) -> usize {
        self.prev.num_samples()
    }

    /// One engine step; see `pagedkv.engine_step.BatchEngine.step`. Returns `(counts,
    /// num_prefill_groups, scheduled, finished, ignored, needed_cols)` with `counts` as
    /// `rewrite` returns it.
    #[pyo3(signature = (sampled, now, buffers))]
    fn step<'py>(
        &mut self,
        py: Python<'py>,
        sampled: PyReadonlyArray1<'py, i32>,
        now: f64,
        buffers: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let mut sampled_copy = std::mem::take(&mut self.sampled);
        sampled_copy.clear();
        sampled_copy.extend_from_slice(
            sampled
                .as_slice()
                .map_err(|_| invalid("sampled must be C-contiguous"))?,
        );
        let res = self.step_with(py, &sampled_copy, now, buffers);
        self.sampled = sampled_copy;
        res
    }

    /// (Re)write the model inputs of the last step into `buffers`: `(rows, tokens, copies,
    /// swap_in, swap_out, new_blocks)`, or `None` when a block-table row of `buffers` is narrower than
    /// the widest table of the batch (`needed_cols`; nothing is written). A sequence can
    /// outgrow `max_model_len` (vLLM's `min_tokens`, and chunked prefill does not limit the
    /// prompt length), so callers widen their buffers and call this again.
    fn rewrite<'py>(
        &mut self,
        py: Python<'py>,
        buffers: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let core = self.core.clone_ref(py);
        let c = core
            .bind(py)
            .try_borrow()
            .map_err(|_| busy("the scheduler"))?;
        let shape: Vec<usize> = buffers
            .getattr("block_tables")?
            .getattr(intern!(py, "shape"))?
            .extract()?;
        if shape.get(1).copied().unwrap_or(0) < self.needed_cols(py)? {
            return Ok(py.None().into_bound(py));
        }
        let mut n_new = 0;
        if let Some(d) = &self.last_delta {
            match write_delta(buffers, d)? {
                Some(n) => n_new = n,
                None => return Ok(py.None().into_bound(py)),
            }
        }
        let w = self.write(py, &c, buffers)?;
        Ok((w.rows, w.tokens, w.copies, w.swap_in, w.swap_out, n_new)
            .into_pyobject(py)?
            .into_any())
    }

    /// Write the native progress and tokens of every known sequence back to its Python
    /// view (`Sequence.data`): output token list, computed tokens, stage.
    fn sync_views(&self, py: Python<'_>) -> PyResult<()> {
        let c = self
            .core
            .bind(py)
            .try_borrow()
            .map_err(|_| busy("the scheduler"))?;
        let ids: Vec<SeqId> = c.seqs.keys().copied().collect();
        for id in ids {
            self.sync_seq(py, &c, id)?;
        }
        Ok(())
    }

    /// Abort requests (vLLM's `abort_seq_group`), keeping the batch state consistent: the
    /// aborted groups' rows of the previous batch take their samples but apply nothing.
    fn abort(&mut self, py: Python<'_>, request_ids: Vec<String>) -> PyResult<()> {
        self.sync_views(py)?;
        let mut c = self
            .core
            .bind(py)
            .try_borrow_mut()
            .map_err(|_| busy("the scheduler"))?;
        c.abort(py, request_ids)?;
        let gone: Vec<GroupKey> = self
            .prev
            .groups
            .iter()
            .map(|s| s.key)
            .filter(|&k| c.core.group(k).is_none())
            .collect();
        self.prev.drop_groups(&gone);
        self.rules.retain(|k, _| c.core.group(*k).is_some());
        Ok(())
    }
}

impl PyBatchStep {
    /// The body of `step`, with the sampled tokens copied out of the caller's array.
    fn step_with<'py>(
        &mut self,
        py: Python<'py>,
        sampled: &[i32],
        now: f64,
        buffers: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        // Checked before the samples are applied (the schedule checks it again, too late to
        // leave the step unchanged).
        if !now.is_finite() {
            return Err(invalid("the step time must be a finite number"));
        }
        let core = self.core.clone_ref(py);
        let mut c = core
            .bind(py)
            .try_borrow_mut()
            .map_err(|_| busy("the scheduler"))?;
        self.check_buffers(py, &c, buffers)?;
        c.check_batch_units()?;
        c.core
            .check_sampled(&self.prev, &self.rules, sampled)
            .py()?;
        let children = self.fork_views(py, &mut c)?;
        let finished = self.apply(py, &mut c, sampled, &children)?;
        let (out, metas) = c.schedule_step(py, now, false)?;
        let order = c.output_order(&out);
        let mut batch = std::mem::take(&mut self.spare_batch);
        c.core.batch_rows_into(&out, &metas, &order, &mut batch);
        if let Some(stable) = &mut self.stable {
            stable.arrange(&mut batch);
        }
        for (s, m) in batch.groups.iter().zip(order.iter().map(|&i| &metas[i])) {
            let group = c.groups[&s.key].obj.bind(py).clone();
            if m.first_time {
                group.call_method1(intern!(py, "maybe_set_first_scheduled_time"), (now,))?;
            }
            if !self.rules.contains_key(&s.key) {
                let rules = self.read_rules(py, &c, s.key)?;
                self.rules.insert(s.key, rules);
            }
        }
        let scheduled = PyList::new(
            py,
            batch.groups.iter().map(|s| c.groups[&s.key].obj.bind(py)),
        )?;
        let ignored = self.finish_groups(py, &mut c, &out.ignored)?;
        self.prev = batch;
        self.last_out = out;
        let mut delta = self.last_delta.take().unwrap_or_default();
        if buffers.getattr(intern!(py, "row_state"))?.is_none() {
            self.sent.clear();
        } else {
            let m = c.manager.bind(py).get().locked()?;
            m.core()
                .table_delta_into(&self.prev, &mut self.sent, &mut delta)
                .py()?;
            self.last_delta = Some(delta);
        }
        drop(c);
        let counts = self.rewrite(py, buffers)?;
        let items: [Bound<'py, PyAny>; 6] = [
            counts.into_any(),
            self.last_out
                .num_prefill_groups
                .into_pyobject(py)?
                .into_any(),
            scheduled.into_any(),
            finished.into_any(),
            ignored.into_any(),
            self.needed_cols(py)?.into_pyobject(py)?.into_any(),
        ];
        PyTuple::new(py, items)
    }

    /// Block-table columns the last step's batch needs.
    fn needed_cols(&self, py: Python<'_>) -> PyResult<usize> {
        let c = self
            .core
            .bind(py)
            .try_borrow()
            .map_err(|_| busy("the scheduler"))?;
        let m = c.manager.bind(py).get().locked()?;
        m.core().batch_cols(&self.prev).py()
    }

    /// Python half of the forks: a child `Sequence` per extra sample, added to its group.
    /// All or nothing: every id is drawn and checked and every child made (`parent.fork`,
    /// engine code that may raise) before any group or view changes; a failing
    /// `group.add` takes back the children already added.
    fn fork_views(&self, py: Python<'_>, c: &mut PySchedulerCore) -> PyResult<Vec<SeqId>> {
        // children are drawn in schedule order, as vLLM's output processor draws them
        let prev = &self.prev;
        let live = || {
            prev.schedule_order()
                .map(|i| &prev.rows[i])
                .filter(|r| r.key != GroupKey::MAX)
        };
        let mut children: Vec<SeqId> = Vec::with_capacity(self.prev.num_children());
        for _ in live().flat_map(|r| 1..r.samples) {
            let id: SeqId = self
                .new_seq_id
                .bind(py)
                .call0()?
                .extract()
                .map_err(|_| crate::errors::wrong_type("new_seq_id must return an int >= 0"))?;
            if children.contains(&id) || c.seqs.contains_key(&id) {
                return Err(invalid(format!("new_seq_id returned {id}, already in use")));
            }
            children.push(id);
        }
        let mut made = Vec::with_capacity(children.len());
        let mut ids = children.iter();
        for r in live() {
            for _ in 1..r.samples {
                let id = *ids.next().expect("one id per child");
                let parent = c.seqs[&r.seq].obj.bind(py);
                let child = parent.call_method1(intern!(py, "fork"), (id,))?;
                let (state, view) = c.read_new_seq(&child)?;
                if state.id != id {
                    return Err(invalid(format!(
                        "fork({id}) returned a sequence with id {}",
                        state.id
                    )));
                }
                made.push((r.key, id, child, view));
            }
        }
        for (i, (key, _, child, _)) in made.iter().enumerate() {
            let group = c.groups[key].obj.bind(py);
            if let Err(e) = group.call_method1(intern!(py, "add"), (child,)) {
                for (key, id, _, _) in &made[..i] {
                    // best effort: the group accepted it a moment ago
                    let _ = c.groups[key]
                        .obj
                        .bind(py)
                        .call_method1(intern!(py, "remove"), (*id,));
                }
                return Err(e);
            }
        }
        for (_, id, _, view) in made {
            c.seqs.insert(id, view);
        }
        Ok(children)
    }

    /// Native half: computed tokens, sampled tokens, stop checks, forks, frees. Returns the
    /// finished groups (views written back, released).
    fn apply<'py>(
        &mut self,
        py: Python<'py>,
        c: &mut PySchedulerCore,
        sampled: &[i32],
        children: &[SeqId],
    ) -> PyResult<Bound<'py, PyList>> {
        let manager = c.manager.clone_ref(py);
        let mgr: &PyManager = manager.bind(py).get();
        let mut m = mgr.locked()?;
        let stores = Stores { py, seqs: &c.seqs };
        let res = c.core.apply_sampled(
            m.core_mut(),
            &stores,
            &self.prev,
            &self.rules,
            sampled,
            children,
        );
        if let Ok(a) = &res {
            for &id in &a.freed {
                m.dropped(id);
            }
        }
        drop(m);
        c.write_back(py)?;
        let applied = res.py()?;
        self.spare_batch = std::mem::take(&mut self.prev);
        self.finish_groups(py, c, &applied.finished)
    }

    /// Write back and release finished (or ignored) groups; their Python objects, in order.
    fn finish_groups<'py>(
        &mut self,
        py: Python<'py>,
        c: &mut PySchedulerCore,
        keys: &[GroupKey],
    ) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for &k in keys {
            let ids: Vec<SeqId> = match c.core.group(k) {
                Some(g) => g.seqs.iter().map(|s| s.id).collect(),
                None => Vec::new(),
            };
            for id in ids {
                self.sync_seq(py, c, id)?;
            }
            if let Some(v) = c.groups.get(&k) {
                list.append(v.obj.bind(py))?;
            }
            self.rules.remove(&k);
            c.release(k);
        }
        Ok(list)
    }

    /// Bring one sequence's Python view up to the native state.
    fn sync_seq(&self, py: Python<'_>, c: &PySchedulerCore, id: SeqId) -> PyResult<()> {
        let Some(view) = c.seqs.get(&id) else {
            return Ok(());
        };
        let data = view.obj.bind(py).getattr(intern!(py, "data"))?;
        let out = data.getattr(intern!(py, "_output"))?;
        let out = out.cast::<PyList>()?;
        let from = data.getattr(intern!(py, "_prompt"))?.len()? + out.len();
        let fresh: Vec<u32> = {
            let s = view
                .store
                .bind(py)
                .try_borrow()
                .map_err(|_| busy("a token store"))?;
            s.inner.tokens().get(from..).unwrap_or_default().to_vec()
        };
        for t in fresh {
            out.append(t)?;
        }
        if let Some((n, decode)) = c.core.progress(id) {
            data.setattr(intern!(py, "_num_computed_tokens"), n)?;
            let stage = if decode { &c.decode } else { &self.prefill };
            data.setattr(intern!(py, "_stage"), stage.bind(py))?;
        }
        Ok(())
    }

    /// vLLM's `StopChecker` inputs of a group, read once when it is first scheduled.
    fn read_rules(
        &self,
        py: Python<'_>,
        c: &PySchedulerCore,
        key: GroupKey,
    ) -> PyResult<StopRules> {
        let g = c.groups[&key].obj.bind(py);
        let sp = g.getattr(intern!(py, "sampling_params"))?;
        let first = c.core.group(key).and_then(|g| g.seqs.first()).map(|s| s.id);
        let seq = c.seqs[&first.expect("a group has a sequence")].obj.bind(py);
        let eos: Option<u32> = seq.getattr(intern!(py, "eos_token_id"))?.extract()?;
        let prompt_len = seq.call_method0(intern!(py, "get_prompt_len"))?.extract()?;
        Ok(StopRules {
            prompt_len,
            max_tokens: sp.getattr(intern!(py, "max_tokens"))?.extract()?,
            min_tokens: sp
                .getattr(intern!(py, "min_tokens"))
                .and_then(|v| v.extract())
                .unwrap_or(0),
            ignore_eos: sp.getattr(intern!(py, "ignore_eos"))?.is_truthy()?,
            eos,
            stop_ids: sp
                .getattr(intern!(py, "stop_token_ids"))
                .and_then(|v| v.extract::<Option<Vec<u32>>>())
                .map_err(|_| invalid("stop_token_ids must be non-negative ints"))?
                .unwrap_or_default(),
        })
    }

    /// Before anything changes: the buffers are there, of the right types, and big enough
    /// for any step this scheduler can make.
    fn check_buffers(
        &self,
        py: Python<'_>,
        c: &PySchedulerCore,
        b: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        drop(take_views(b)?); // types, writability, contiguity, overlap
        if !b.getattr(intern!(py, "row_state"))?.is_none() {
            let rows = c.core.config().max_num_seqs;
            let st = writable_1d::<i32>(&b.getattr("row_state")?, "row_state")?;
            let from = writable_1d::<i32>(&b.getattr("moved_from")?, "moved_from")?;
            let loc = writable_1d::<i32>(&b.getattr("new_block_loc")?, "new_block_loc")?;
            let nb = writable_1d::<i32>(&b.getattr("new_blocks")?, "new_blocks")?;
            if st.len() < rows || from.len() < rows || loc.len() < rows + 1 {
                return Err(invalid(format!(
                    "buffers.row_state / moved_from / new_block_loc must hold {rows} / {rows} / \
                     {} entries",
                    rows + 1
                )));
            }
            drop((st, from, loc, nb));
        }
        let cfg = c.core.config();
        let mgr = c.manager.bind(py).get().locked()?;
        let mc = mgr.core().config();
        let bs = mc.block_size;
        let rows = cfg.max_num_seqs;
        let tokens = cfg.max_num_batched_tokens.max(cfg.max_num_seqs);
        let cols = (cfg.max_model_len + cfg.num_lookahead_slots).div_ceil(bs);
        let gpu = mc.num_gpu_blocks as usize;
        let need = [
            tokens,
            tokens,
            tokens,
            rows + 1,
            rows,
            rows,
            rows,
            rows * cols,
            2 * rows,
            2 * gpu,
            2 * gpu,
            rows,
        ];
        drop(mgr);
        for (name, need) in OUTPUTS.iter().zip(need) {
            let arr = b.getattr(*name)?;
            let len: usize = arr.getattr(intern!(py, "size"))?.extract()?;
            if len < need {
                return Err(invalid(format!(
                    "buffers.{name} holds {len} entries; this scheduler may need {need}"
                )));
            }
        }
        let bt = b.getattr("block_tables")?;
        let shape: Vec<usize> = bt.getattr(intern!(py, "shape"))?.extract()?;
        if shape.len() != 2 || shape[1] < cols {
            return Err(invalid(format!(
                "buffers.block_tables must be 2-D with at least {cols} columns, got {shape:?}"
            )));
        }
        Ok(())
    }

    fn write(
        &mut self,
        py: Python<'_>,
        c: &PySchedulerCore,
        b: &Bound<'_, PyAny>,
    ) -> PyResult<pagedkv_core::vllm_042::scheduler::Written> {
        let held = match &self.last_delta {
            Some(d) => {
                let arr = b.getattr(intern!(py, "block_tables"))?;
                if !self
                    .held_array
                    .as_ref()
                    .is_some_and(|h| h.bind(py).is(&arr))
                {
                    self.held.forget();
                    self.held_array = Some(arr.unbind());
                }
                Some((d, &mut self.held))
            }
            None => {
                self.held_array = None;
                None
            }
        };
        let (mut v, mut ids, mut bt) = take_views(b)?;
        let cols = bt.shape()[1];
        let nc = |_| invalid("an output buffer is not contiguous");
        let mut sl = v
            .iter_mut()
            .map(|a| a.as_slice_mut())
            .collect::<Result<Vec<_>, _>>()
            .map_err(nc)?;
        let [it, pos, slot, qs, cl, ns, cp, si, so, ct]: [&mut [i32]; 10] = std::mem::take(&mut sl)
            .try_into()
            .map_err(|_| invalid("outputs"))?;
        let buf = ModelInputs {
            input_tokens: it,
            positions: pos,
            slot_mapping: slot,
            query_start_loc: qs,
            context_lens: cl,
            num_samples: ns,
            cached_tokens: ct,
            seq_ids: ids.as_slice_mut().map_err(nc)?,
            block_tables: bt.as_slice_mut().map_err(nc)?,
            cols,
            copies: cp,
            swap_in: si,
            swap_out: so,
            held,
        };
        let mgr = c.manager.bind(py).get().locked()?;
        let stores = Stores { py, seqs: &c.seqs };
        mgr.core()
            .write_model_inputs(&c.core, &stores, &self.prev, &self.last_out, buf)
            .py()
    }
}

/// Write the incremental block-table changes into `row_state`, `moved_from`,
/// `new_block_loc` and `new_blocks`; `None` (nothing written) when `new_blocks` is too short.
fn write_delta(b: &Bound<'_, PyAny>, d: &TableDelta) -> PyResult<Option<usize>> {
    let mut st = writable_1d::<i32>(&b.getattr("row_state")?, "row_state")?;
    let mut from = writable_1d::<i32>(&b.getattr("moved_from")?, "moved_from")?;
    let mut loc = writable_1d::<i32>(&b.getattr("new_block_loc")?, "new_block_loc")?;
    let mut blocks = writable_1d::<i32>(&b.getattr("new_blocks")?, "new_blocks")?;
    let nc = |_| invalid("an output buffer is not contiguous");
    let (st, from, loc, blocks) = (
        st.as_slice_mut().map_err(nc)?,
        from.as_slice_mut().map_err(nc)?,
        loc.as_slice_mut().map_err(nc)?,
        blocks.as_slice_mut().map_err(nc)?,
    );
    if st.len() < d.state.len() || from.len() < d.from.len() || loc.len() < d.loc.len() {
        return Err(invalid(
            "row_state / moved_from / new_block_loc are shorter than the batch",
        ));
    }
    if blocks.len() < d.blocks.len() {
        return Ok(None);
    }
    for (dst, &x) in st.iter_mut().zip(&d.state) {
        *dst = i32::from(x);
    }
    for (dst, &x) in from.iter_mut().zip(&d.from) {
        *dst = if x == NO_ROW { -1 } else { as_row(x)? };
    }
    for (dst, &x) in loc.iter_mut().zip(&d.loc) {
        *dst = i32::try_from(x).map_err(|_| invalid("new_block_loc overflows int32"))?;
    }
    for (dst, &x) in blocks.iter_mut().zip(&d.blocks) {
        *dst = x as i32;
    }
    Ok(Some(d.blocks.len()))
}

fn as_row(x: usize) -> PyResult<i32> {
    i32::try_from(x).map_err(|_| invalid("a row index overflows int32"))
}

type Views<'py> = (
    Vec<PyReadwriteArray1<'py, i32>>,
    PyReadwriteArray1<'py, i64>,
    numpy::PyReadwriteArray2<'py, i32>,
);

/// Writable views of every output array of `b`, taken together (numpy's borrow tracking
/// refuses overlapping arrays). Taken only after every Python callback of the call
/// (buffers.rs), and once before anything changes, to refuse bad buffers early.
fn take_views<'py>(b: &Bound<'py, PyAny>) -> PyResult<Views<'py>> {
    let objs: Vec<Bound<'py, PyAny>> = OUTPUTS
        .iter()
        .map(|n| b.getattr(*n))
        .collect::<PyResult<_>>()?;
    let mut v = Vec::with_capacity(OUTPUTS.len() - 2);
    for (i, name) in OUTPUTS.iter().enumerate() {
        if i != 6 && i != 7 {
            v.push(writable_1d::<i32>(&objs[i], name)?);
        }
    }
    let ids = writable_1d::<i64>(&objs[6], "seq_ids")?;
    let bt = writable_2d_i32(&objs[7], "block_tables")?;
    Ok((v, ids, bt))
}
