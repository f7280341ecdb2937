//! The compat `schedule()`'s outputs: vLLM's `ScheduledSequenceGroup` and
//! `SequenceGroupMetadata` objects for the scheduled groups, in vLLM's order, with their
//! block lists; reused from the step before while nothing in them changes
//! (docs/scheduler.md, "Metadata objects are reused while nothing in them changes").

use super::PySchedulerCore;
use crate::errors::IntoPyResult;
use crate::vllm_042::manager::Locked;
use pagedkv_core::vllm_042::scheduler::{GroupKey, Outputs, Scheduled, StepMeta};
use pagedkv_core::vllm_042::{ComputedPrefix, Device, SeqId};
use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use pyo3::PyTraverseError;

/// One scheduled group's block-table lists and `computed_block_nums` list.
struct BlockLists<'py> {
    tables: Vec<(SeqId, Bound<'py, PyAny>)>,
    computed: Bound<'py, PyAny>,
}

/// What one group's metadata was built from. The objects are held (not their addresses), so
/// an identity match can never be a new object at a freed one's address.
struct MetaInputs {
    is_prompt: bool,
    do_sample: bool,
    chunk: usize,
    /// `request_id`, `sampling_params`, `lora_request`, `state`, and `multi_modal_data` (None
    /// in a step without prefills, as vLLM hands it out).
    fields: [Py<PyAny>; 5],
    /// Per running sequence: its id, `seq.data` and block-table list.
    seqs: Vec<(SeqId, Py<PyAny>, Py<PyAny>)>,
    computed: Py<PyAny>,
}

/// The same inputs, borrowed for this step (compared with [`MetaInputs`] before anything is
/// built).
struct MetaArgs<'py> {
    is_prompt: bool,
    do_sample: bool,
    chunk: usize,
    fields: [Bound<'py, PyAny>; 5],
    seqs: Vec<(SeqId, Bound<'py, PyAny>, Bound<'py, PyAny>)>,
    computed: Bound<'py, PyAny>,
}

impl MetaInputs {
    fn matches(&self, a: &MetaArgs<'_>) -> bool {
        self.is_prompt == a.is_prompt
            && self.do_sample == a.do_sample
            && self.chunk == a.chunk
            && self.computed.is(&a.computed)
            && self.fields.iter().zip(&a.fields).all(|(x, y)| x.is(y))
            && self.seqs.len() == a.seqs.len()
            && self
                .seqs
                .iter()
                .zip(&a.seqs)
                .all(|((i, d, t), (j, e, u))| i == j && d.is(e) && t.is(u))
    }
}

pub(super) struct LastOutputs {
    inputs: MetaInputs,
    metadata: Py<PyAny>,
    scheduled: Py<PyAny>,
}

impl LastOutputs {
    /// Native bytes held for a scheduled group's last outputs (the box and its sequence list;
    /// the Python objects are the engine's).
    pub(super) fn heap_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.inputs.seqs.capacity() * std::mem::size_of::<(SeqId, Py<PyAny>, Py<PyAny>)>()
    }

    /// The Python objects held, for the scheduler's `__traverse__`.
    pub(super) fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.metadata)?;
        visit.call(&self.scheduled)?;
        let i = &self.inputs;
        for f in i.fields.iter().chain([&i.computed]) {
            visit.call(f)?;
        }
        for (_, d, t) in &i.seqs {
            visit.call(d)?;
            visit.call(t)?;
        }
        Ok(())
    }
}

/// An empty `BlockList` (`cls`), to be filled through the C list API, which its read-only
/// Python methods do not intercept.
fn new_block_list<'py>(cls: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
    Ok(cls.call0()?.cast_into::<PyList>()?)
}

impl PySchedulerCore {
    /// The read-only block-table list of `id` (cached while its table is unchanged).
    fn table_of<'py>(
        &mut self,
        py: Python<'py>,
        m: &mut Locked<'_>,
        id: SeqId,
    ) -> PyResult<Bound<'py, PyAny>> {
        let version = m.core().table_version(id).py()?;
        let view = self.seqs.get_mut(&id).expect("known sequence");
        if let Some((v, list)) = &view.table {
            if *v == version {
                return Ok(list.bind(py).clone());
            }
        }
        // A scheduled sequence's table is on the GPU: its BlockList is filled in place from the
        // cached block ints, without an intermediate list.
        let list = match m.core().device_of(id).py()? {
            Device::Gpu => {
                let list = new_block_list(self.block_list.bind(py))?;
                m.extend_gpu_blocks(&list, m.core().block_table(id).py()?)?;
                list.into_any()
            }
            Device::Cpu => self.block_list.bind(py).call1((m.table_list(py, id)?,))?,
        };
        view.table = Some((version, list.clone().unbind()));
        Ok(list)
    }

    /// The read-only `computed_block_nums` list of a group (cached while it names the same
    /// blocks: comparing the prefix's place reads none of them).
    fn computed_of<'py>(
        &mut self,
        py: Python<'py>,
        m: &Locked<'_>,
        key: GroupKey,
        computed: Option<ComputedPrefix>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let view = self.groups.get_mut(&key).expect("live group");
        if let Some((c, list)) = &view.computed {
            if *c == computed {
                return Ok(list.bind(py).clone());
            }
        }
        let list = new_block_list(self.block_list.bind(py))?;
        if let Some(p) = computed {
            m.extend_gpu_blocks(&list, &m.core().block_table(p.seq).py()?[..p.len])?;
        }
        let list = list.into_any();
        view.computed = Some((computed, list.clone().unbind()));
        Ok(list)
    }

    /// The order vLLM hands scheduled groups out in: as scheduled, or by (LoRA id, request
    /// id) when any of them has a LoRA (`SchedulerOutputs.__post_init__`).
    pub(crate) fn output_order(&self, out: &Outputs) -> Vec<usize> {
        let mut order: Vec<usize> = (0..out.scheduled.len()).collect();
        let group = |i: usize| self.core.group(out.scheduled[i].key).expect("live group");
        if order.iter().any(|&i| group(i).lora > 0) {
            order.sort_by(|&a, &b| {
                let (ga, gb) = (group(a), group(b));
                (ga.lora, &ga.request_id).cmp(&(gb.lora, &gb.request_id))
            });
        }
        order
    }

    /// Distinct LoRA adapters among the scheduled groups (`SchedulerOutputs.num_loras`:
    /// vLLM's LoRARequest compares by `lora_int_id`).
    fn num_loras(&self, out: &Outputs) -> usize {
        let mut ids: Vec<u32> = out
            .scheduled
            .iter()
            .map(|s| self.core.group(s.key).expect("live group").lora)
            .filter(|&l| l > 0)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }

    /// What one scheduled group's metadata is built from (vLLM's `schedule()` loop body reads
    /// the same fields), from its block lists (taken under the manager's lock).
    fn meta_args<'py>(
        &self,
        py: Python<'py>,
        (s, meta): (&Scheduled, &StepMeta),
        lists: BlockLists<'py>,
        with_mm: bool,
    ) -> PyResult<MetaArgs<'py>> {
        let group = self.groups[&s.key].obj.bind(py);
        let mm = match with_mm {
            true => group.getattr(intern!(py, "multi_modal_data"))?,
            false => py.None().into_bound(py),
        };
        let mut seqs = Vec::with_capacity(lists.tables.len());
        for (id, table) in lists.tables {
            let data = self.seqs[&id].obj.bind(py).getattr(intern!(py, "data"))?;
            seqs.push((id, data, table));
        }
        Ok(MetaArgs {
            is_prompt: meta.is_prompt,
            do_sample: meta.do_sample,
            chunk: s.chunk,
            fields: [
                group.getattr(intern!(py, "request_id"))?,
                group.getattr(intern!(py, "sampling_params"))?,
                group.getattr(intern!(py, "lora_request"))?,
                group.getattr(intern!(py, "state"))?,
                mm,
            ],
            seqs,
            computed: lists.computed,
        })
    }

    /// One group's `SequenceGroupMetadata` and `ScheduledSequenceGroup`: last step's objects
    /// when everything they hold is the same (a decode step between block-table changes),
    /// else new ones, built by the classes' own constructors.
    fn group_outputs<'py>(
        &mut self,
        py: Python<'py>,
        key: GroupKey,
        args: MetaArgs<'py>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let view = self.groups.get_mut(&key).expect("live group");
        if let Some(last) = &view.last {
            if last.inputs.matches(&args) {
                return Ok((
                    last.metadata.bind(py).clone(),
                    last.scheduled.bind(py).clone(),
                ));
            }
        }
        let group = view.obj.bind(py);
        let seq_data = PyDict::new(py);
        let tables = PyDict::new(py);
        for (id, data, table) in &args.seqs {
            seq_data.set_item(id, data)?;
            tables.set_item(id, table)?;
        }
        let [request_id, sampling_params, lora, state, mm] = &args.fields;
        let metadata = self.metadata_cls.bind(py).call1((
            request_id,
            args.is_prompt,
            seq_data,
            sampling_params,
            tables,
            args.do_sample,
            args.chunk,
            lora,
            &args.computed,
            state,
            mm,
        ))?;
        let scheduled = self.scheduled_cls.bind(py).call1((group, args.chunk))?;
        let inputs = MetaInputs {
            is_prompt: args.is_prompt,
            do_sample: args.do_sample,
            chunk: args.chunk,
            fields: args.fields.map(Bound::unbind),
            seqs: args
                .seqs
                .into_iter()
                .map(|(id, d, t)| (id, d.unbind(), t.unbind()))
                .collect(),
            computed: args.computed.unbind(),
        };
        view.last = Some(Box::new(LastOutputs {
            inputs,
            metadata: metadata.clone().unbind(),
            scheduled: scheduled.clone().unbind(),
        }));
        Ok((metadata, scheduled))
    }

    /// The block lists of the scheduled groups, in output order (under the manager's lock;
    /// no Python code runs while it is held).
    fn block_lists<'py>(
        &mut self,
        py: Python<'py>,
        out: &Outputs,
        metas: &[StepMeta],
        order: &[usize],
    ) -> PyResult<Vec<BlockLists<'py>>> {
        let manager = self.manager.clone_ref(py);
        let mgr = manager.bind(py).get();
        let mut m = mgr.locked()?;
        let mut lists = Vec::with_capacity(order.len());
        for &i in order {
            let meta = &metas[i];
            let mut tables = Vec::with_capacity(meta.running.len());
            for &id in &meta.running {
                tables.push((id, self.table_of(py, &mut m, id)?));
            }
            let computed = self.computed_of(py, &m, out.scheduled[i].key, meta.computed)?;
            lists.push(BlockLists { tables, computed });
        }
        Ok(lists)
    }

    pub(super) fn outputs_tuple<'py>(
        &mut self,
        py: Python<'py>,
        out: &Outputs,
        metas: &[StepMeta],
        now: f64,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let order = self.output_order(out);
        let lists = self.block_lists(py, out, metas, &order)?;
        let scheduled = PyList::empty(py);
        let metadata = PyList::empty(py);
        let with_mm = out.num_prefill_groups > 0;
        for (&i, lists) in order.iter().zip(lists) {
            let (s, meta) = (&out.scheduled[i], &metas[i]);
            if meta.first_time {
                let group = self.groups[&s.key].obj.bind(py);
                group.call_method1(intern!(py, "maybe_set_first_scheduled_time"), (now,))?;
            }
            let args = self.meta_args(py, (s, meta), lists, with_mm)?;
            let (m, sg) = self.group_outputs(py, s.key, args)?;
            metadata.append(m)?;
            scheduled.append(sg)?;
        }
        let swap_in = PyDict::new(py);
        for &(a, b) in &out.swap_in {
            swap_in.set_item(a, b)?;
        }
        let swap_out = PyDict::new(py);
        for &(a, b) in &out.swap_out {
            swap_out.set_item(a, b)?;
        }
        let copies = PyDict::new(py);
        for (src, dsts) in &out.copies {
            copies.set_item(src, PyList::new(py, dsts)?)?;
        }
        let ignored = PyList::new(py, out.ignored.iter().map(|k| self.groups[k].obj.bind(py)))?;
        let items: [Bound<'py, PyAny>; 11] = [
            scheduled.into_any(),
            metadata.into_any(),
            out.num_prefill_groups.into_pyobject(py)?.into_any(),
            out.num_batched_tokens.into_pyobject(py)?.into_any(),
            swap_in.into_any(),
            swap_out.into_any(),
            copies.into_any(),
            ignored.into_any(),
            out.lookahead.into_pyobject(py)?.into_any(),
            out.running_queue_size.into_pyobject(py)?.into_any(),
            self.num_loras(out).into_pyobject(py)?.into_any(),
        ];
        PyTuple::new(py, items)
    }
}
