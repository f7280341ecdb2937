//! What the native loop builds of vLLM's objects and reads of the model runner's: the parts
//! of `SchedulerOutput` (`NewRequestData`, `CachedRequestData`'s fields), `EngineCoreOutput`,
//! and the calls into vLLM's prefix lookup and prefill stats.

use crate::vllm_v1::encoder;
use crate::vllm_v1::engine::PyEngine;
use crate::vllm_v1::engine_requests::PyReq;
use crate::vllm_v1::engine_update::Sampled;
use crate::vllm_v1::loop_::PyV1Loop;
use crate::vllm_v1::loop_kv::PyBlocks;
use pagedkv_core::vllm_v1::engine::{Row, Runner, Step, StructuredFlags};
use pagedkv_core::vllm_v1::policy::Stop;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet, PyString, PyTuple};

/// A scheduled row with the loop's block ids.
type PyRow<'py> = Row<PyReq<'py>, PyBlocks>;

/// `schedule()`'s result: `(new_reqs_data, cached, num_scheduled_tokens, total,
/// structured, scheduled_spec_decode_tokens, skip_drafts, scheduled_encoder_inputs,
/// encoder_input_updates, num_spec_tokens_to_schedule)` where `cached` is `(req_ids,
/// resumed_req_ids, new_token_ids, all_token_ids, new_block_ids, num_computed_tokens,
/// num_output_tokens)`, `structured` is `None` here
/// ([`mark_structured_output`] sets it) and `encoder_input_updates` is computed here, before
/// `_update_after_schedule` advances the rows, as vLLM computes it (`None`: no multimodal
/// row; vLLM's would be empty); also `prev_step_scheduled_req_ids` (v1 runner).
pub fn scheduler_output<'py>(
    e: &PyEngine<'_, 'py>,
    step: &Step<PyReq<'py>, PyBlocks>,
    num_spec_tokens_to_schedule: u64,
) -> PyResult<Bound<'py, PyTuple>> {
    let py = e.sched.py();
    let v2 = step.runner == Runner::V2;
    // `num_scheduled_tokens` keeps scheduling order (running rows, then admissions).
    let scheduled = PyDict::new(py);
    for r in &step.rows {
        scheduled.set_item(r.req.f.id.bind(py), r.tokens)?;
    }
    let (running_rows, admitted) = step.rows.split_at(step.num_running_rows);
    let mut new: Vec<&PyRow<'py>> = admitted.iter().filter(|r| !r.resumed).collect();
    let mut resumed: Vec<&PyRow<'py>> = admitted.iter().filter(|r| r.resumed).collect();
    if v2 {
        new.append(&mut resumed);
    }
    let out = PyList::empty(py);
    for r in &new {
        // `get_blocks(request_id).get_block_ids()`: every group's list, empty ones included.
        let block_ids = match &r.blocks {
            Some(b) => b.to_py(py)?,
            None => e.lp.kv.empty_table()?.to_py(py)?,
        };
        let make_new = e.lp.objs.make_new.bind(py);
        out.append(make_new.call1((&r.req.obj, block_ids, v2))?)?;
    }
    let running_rows: Vec<&PyRow<'py>> = running_rows.iter().collect();
    let rows = CachedRows {
        running: &running_rows,
        resumed: &resumed,
    };
    let cached = cached_request_data(&e.sched, v2, e.sends_tokens, rows)?;
    if !v2 {
        let prev = e
            .sched
            .getattr(intern!(py, "prev_step_scheduled_req_ids"))?;
        let prev = prev.cast::<PySet>()?;
        prev.clear();
        for r in &step.rows {
            prev.add(r.req.f.id.bind(py))?;
        }
    }
    let drafts = match &e.drafts {
        Some(d) => d.clone(),
        None => PyDict::new(py),
    };
    let inputs = match &e.enc.scheduled {
        Some(d) => d.clone(),
        None => PyDict::new(py),
    };
    let any_mm = step.rows.iter().any(|r| r.req.f.mm);
    let updates = encoder::input_updates(&e.sched, any_mm, &scheduled, &out, &inputs)?;
    let items: [Bound<'py, PyAny>; 10] = [
        out.into_any(),
        cached.into_any(),
        scheduled.into_any(),
        step.total.into_pyobject(py)?.into_any(),
        py.None().into_bound(py),
        drafts.into_any(),
        pyo3::types::PyBool::new(py, step.skip_drafts)
            .to_owned()
            .into_any(),
        inputs.into_any(),
        match updates {
            Some(u) => u.into_any(),
            None => py.None().into_bound(py),
        },
        num_spec_tokens_to_schedule.into_pyobject(py)?.into_any(),
    ];
    PyTuple::new(py, items)
}

/// vLLM's `check_sequence_repetition(request.output_token_ids, repetition_detection)`.
pub fn check_sequence_repetition(request: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = request.py();
    let check = py
        .import("vllm.v1.core.sched.utils")?
        .getattr("check_sequence_repetition")?;
    let outs = request.getattr(intern!(py, "output_token_ids"))?;
    let params = request
        .getattr(intern!(py, "sampling_params"))?
        .getattr(intern!(py, "repetition_detection"))?;
    check.call1((outs, params))?.is_truthy()
}

/// The same result with `structured` = `(has_structured_output_requests,
/// pending_structured_output_tokens, grammar_req_ids)`: the ids of the grammar rows
/// (structured-output rows past their prefill) in the output's order.
pub fn mark_structured_output<'py>(
    out: &mut Bound<'py, PyTuple>,
    flags: StructuredFlags,
    grammar_rows: &[&PyReq<'py>],
) -> PyResult<()> {
    let py = out.py();
    let ids = PyList::new(py, grammar_rows.iter().map(|r| r.f.id.bind(py)))?;
    let mut items: Vec<Bound<'py, PyAny>> = out.iter().collect();
    if let Some(at) = items.get_mut(4) {
        *at = (flags.has_requests, flags.pending_tokens, ids)
            .into_pyobject(py)?
            .into_any();
    }
    *out = PyTuple::new(py, items)?;
    Ok(())
}

/// A step's rows of `CachedRequestData`: the running pass's, then the resumed admissions.
struct CachedRows<'a, 'py> {
    running: &'a [&'a PyRow<'py>],
    resumed: &'a [&'a PyRow<'py>],
}

/// `_make_cached_request_data`: running rows, then resumed ones; with `sends_tokens` each
/// row's `new_token_ids` entry is `all_token_ids[computed : computed + tokens - drafts]`
/// (a list, as vLLM's `ConstantList` slice).
fn cached_request_data<'py>(
    sched: &Bound<'py, PyAny>,
    v2: bool,
    sends_tokens: bool,
    rows: CachedRows<'_, 'py>,
) -> PyResult<Bound<'py, PyTuple>> {
    let py = sched.py();
    let prev = sched.getattr(intern!(py, "prev_step_scheduled_req_ids"))?;
    let prev = prev.cast::<PySet>()?;
    let ids = PyList::empty(py);
    let resumed_ids = PySet::empty(py)?;
    let new_tokens = PyList::empty(py);
    let all_tokens = PyDict::new(py);
    let new_blocks = PyList::empty(py);
    let computed = PyList::empty(py);
    let outputs = PyList::empty(py);
    for (k, r) in rows.running.iter().chain(rows.resumed).enumerate() {
        let id = r.req.f.id.bind(py);
        let all = r.req.f.all.bind(py);
        ids.append(id)?;
        if sends_tokens {
            let from = to_index(r.num_computed_tokens);
            let sampled = r.tokens.saturating_sub(r.drafts);
            let to = to_index(r.num_computed_tokens.saturating_add(sampled));
            new_tokens.append(all.get_slice(from, to))?;
        }
        if k >= rows.running.len() {
            resumed_ids.add(id)?;
        }
        if !v2 && !prev.contains(id)? {
            all_tokens.set_item(id, all.get_slice(0, all.len()))?;
        }
        match &r.blocks {
            None => new_blocks.append(py.None())?,
            Some(b) => new_blocks.append(b.to_py(py)?)?,
        }
        computed.append(r.num_computed_tokens)?;
        // `len(_output_token_ids)`: the tokens past the prompt (in scope, `_all_token_ids`
        // is the prompt and then the outputs), without touching the output list.
        let outs = (all.len() as u64).saturating_sub(r.req.f.num_prompt);
        outputs.append(outs + r.placeholders)?;
    }
    let lists = (
        ids,
        resumed_ids,
        new_tokens,
        all_tokens,
        new_blocks,
        computed,
        outputs,
    );
    lists.into_pyobject(py)
}

/// A token position as a list index (a slice past the end is cut at the end, as Python's).
fn to_index(position: u64) -> usize {
    usize::try_from(position).unwrap_or(usize::MAX)
}

/// vLLM's prefix lookup for a request with nothing computed (its own method, which also
/// sets `shared_prefix_boundary`) and the first admission's prefill stats: the hit's blocks
/// object and its token count.
pub fn prefix_hit<'py>(
    sched: &Bound<'py, PyAny>,
    request: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyAny>, u64)> {
    let py = sched.py();
    let hit = sched.call_method1(intern!(py, "_get_local_prefix_cache_hit"), (request,))?;
    let hit = hit.cast_into::<PyTuple>()?;
    let blocks = hit.get_item(0)?;
    let num_local: u64 = hit.get_item(1)?.extract()?;
    request.setattr(intern!(py, "shared_prefix_boundary"), hit.get_item(2)?)?;
    let stats = request.getattr(intern!(py, "prefill_stats"))?;
    let preemptions: i64 = request.getattr(intern!(py, "num_preemptions"))?.extract()?;
    if stats.is_truthy()? && preemptions <= 0 {
        let kwargs = PyDict::new(py);
        kwargs.set_item(
            "num_prompt_tokens",
            request.getattr(intern!(py, "num_prompt_tokens"))?,
        )?;
        kwargs.set_item("num_local_cached_tokens", num_local)?;
        kwargs.set_item("num_external_cached_tokens", 0)?;
        stats.call_method(intern!(py, "set"), (), Some(&kwargs))?;
    }
    Ok((blocks, num_local))
}

/// The request's prefill stats on its first emitted output, finalized with the manager's
/// cached-token estimate (`take_prefill_stats` + `finalize`).
pub fn take_prefill_stats<'py>(
    sched: &Bound<'py, PyAny>,
    request: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let py = sched.py();
    let stats = request.getattr(intern!(py, "prefill_stats"))?;
    if stats.is_none() {
        return Ok(None);
    }
    request.setattr(intern!(py, "prefill_stats"), py.None())?;
    let kv = sched.getattr(intern!(py, "kv_cache_manager"))?;
    let cached = kv.call_method1(intern!(py, "estimate_cached_tokens"), (request,))?;
    stats.call_method1(intern!(py, "finalize"), (cached,))?;
    Ok(Some(stats))
}

/// What `update_from_output` reads of the model runner's output.
pub struct ModelOutput<'py> {
    sampled: Bound<'py, PyAny>,
    has_sampled: bool,
    index: Bound<'py, PyDict>,
    logprobs: Bound<'py, PyAny>,
    /// `sampling_masks`, read when the scheduler's `return_sampling_mask` is on and it is
    /// not `None`.
    sampling_masks: Option<Bound<'py, PyAny>>,
    /// The per-request dicts, when present and not empty.
    prompt_logprobs: Option<Bound<'py, PyDict>>,
    prompt_token_id_logprobs: Option<Bound<'py, PyDict>>,
    num_nans: Option<Bound<'py, PyDict>>,
    /// `pooler_output` (a pooling model's outputs, one per row), when not empty.
    pooler: Option<Bound<'py, PyAny>>,
}

/// `obj.name` when it is a non-empty dict.
fn nonempty_dict<'py>(
    obj: &Bound<'py, PyAny>,
    name: &Bound<'py, PyString>,
) -> Option<Bound<'py, PyDict>> {
    let d = obj.getattr(name).ok()?.cast_into::<PyDict>().ok()?;
    (!d.is_empty()).then_some(d)
}

impl<'py> ModelOutput<'py> {
    /// `masks`: the scheduler's `return_sampling_mask`.
    pub fn read(mro: &Bound<'py, PyAny>, masks: bool) -> PyResult<Self> {
        let py = mro.py();
        let sampled = mro.getattr(intern!(py, "sampled_token_ids"))?;
        let sampling_masks = match masks {
            true => Some(mro.getattr(intern!(py, "sampling_masks"))?).filter(|m| !m.is_none()),
            false => None,
        };
        Ok(ModelOutput {
            sampling_masks,
            has_sampled: sampled.is_truthy()?,
            sampled,
            index: mro.getattr(intern!(py, "req_id_to_index"))?.cast_into()?,
            logprobs: mro.getattr(intern!(py, "logprobs"))?,
            prompt_logprobs: nonempty_dict(mro, intern!(py, "prompt_logprobs_dict")),
            prompt_token_id_logprobs: nonempty_dict(
                mro,
                intern!(py, "prompt_token_id_logprobs_dict"),
            ),
            num_nans: nonempty_dict(mro, intern!(py, "num_nans_in_logits")),
            pooler: Some(mro.getattr(intern!(py, "pooler_output"))?)
                .filter(|p| p.is_truthy().unwrap_or(false)),
        })
    }

    /// The row's pooler output, `None` when the model gave none (a sampling model, or a
    /// pooling request's prefill chunk).
    pub fn pooler_output(&self, id: &Bound<'py, PyString>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some(pooler) = &self.pooler else {
            return Ok(None);
        };
        let Some(index) = self.index.get_item(id)? else {
            return Ok(None);
        };
        let out = pooler.get_item(index)?;
        Ok((!out.is_none()).then_some(out))
    }

    /// The row's sampled tokens as a list the loop may trim (the runner's own list).
    pub fn sampled(&self, id: &Bound<'py, PyString>) -> PyResult<Sampled<'py>> {
        let py = id.py();
        let index = self
            .index
            .get_item(id)?
            .ok_or_else(|| crate::errors::invalid("a scheduled request has no model output"))?;
        let list = if self.has_sampled {
            match self.sampled.get_item(&index)?.cast_into::<PyList>() {
                Ok(list) => list,
                Err(e) => PyList::new(
                    py,
                    e.into_inner().try_iter()?.collect::<PyResult<Vec<_>>>()?,
                )?,
            }
        } else {
            PyList::empty(py)
        };
        Ok(Sampled {
            list,
            index: Some(index),
        })
    }

    pub fn new_logprobs(
        &self,
        request: &Bound<'py, PyAny>,
        s: &Sampled<'py>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = request.py();
        if self.logprobs.is_none() || !self.logprobs.is_truthy()? {
            return Ok(None);
        }
        let params = request.getattr(intern!(py, "sampling_params"))?;
        if params.is_none() || params.getattr(intern!(py, "num_logprobs"))?.is_none() {
            return Ok(None);
        }
        let sliced = self
            .logprobs
            .call_method1(intern!(py, "slice_request"), (&s.index, s.list.len()))?;
        Ok(Some(sliced))
    }

    /// `sampling_masks.slice_request(index, len(new_token_ids))` for a row that keeps tokens
    /// (after a stop's truncation), when masks are on: one call per such row.
    pub fn new_sampling_mask(&self, s: &Sampled<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some(masks) = &self.sampling_masks else {
            return Ok(None);
        };
        if s.list.is_empty() {
            return Ok(None);
        }
        let py = masks.py();
        let sliced = masks.call_method1(intern!(py, "slice_request"), (&s.index, s.list.len()))?;
        Ok(Some(sliced))
    }

    pub fn set_nans(&self, request: &Bound<'py, PyAny>, id: &Bound<'py, PyString>) -> PyResult<()> {
        if let Some(nans) = &self.num_nans {
            if let Some(v) = nans.get_item(id)? {
                request.setattr(intern!(request.py(), "num_nans_in_logits"), v)?;
            }
        }
        Ok(())
    }
}

pub struct OutputFields<'py> {
    /// A pooling request's pooler output (`pooling_output`).
    pub pooling: Option<Bound<'py, PyAny>>,
    pub tokens: Bound<'py, PyList>,
    pub stop: Option<Stop>,
    pub logprobs: Option<Bound<'py, PyAny>>,
    pub sampling_mask: Option<Bound<'py, PyAny>>,
    pub prefill_stats: Option<Bound<'py, PyAny>>,
    /// A KV connector's parameters for the finished request (`_free_request`'s).
    pub kv_transfer_params: Option<Bound<'py, PyAny>>,
}

/// The fields of the row's `EngineCoreOutput` that differ from their defaults.
fn output_fields<'py>(
    lp: &PyV1Loop,
    r: &PyReq<'py>,
    mro: &ModelOutput<'py>,
    f: OutputFields<'py>,
) -> PyResult<Vec<(usize, Bound<'py, PyAny>)>> {
    let py = r.obj.py();
    let (shape, objs) = (&lp.objs.output, &lp.objs);
    let id = r.f.id.bind(py);
    let mut set: Vec<(usize, Bound<'py, PyAny>)> = Vec::with_capacity(8);
    set.push((shape.request_id, id.clone().into_any()));
    set.push((shape.new_token_ids, f.tokens.into_any()));
    if let Some(stop) = f.stop {
        let reason = match stop {
            Stop::Length => &objs.reason_length,
            Stop::Eos | Stop::StopToken(_) | Stop::Pooled => &objs.reason_stop,
            Stop::Repetition => &objs.reason_repetition,
            Stop::Error => &objs.reason_error,
        };
        set.push((shape.finish_reason, reason.bind(py).clone()));
    }
    if let Some(l) = f.logprobs {
        set.push((shape.new_logprobs, l));
    }
    if let Some(p) = f.pooling {
        let at = shape.pooling_output.ok_or_else(|| {
            crate::errors::invalid("EngineCoreOutput has no field \"pooling_output\"")
        })?;
        set.push((at, p));
    }
    if let Some(m) = f.sampling_mask {
        let at = shape.new_sampling_mask.ok_or_else(|| {
            crate::errors::invalid("EngineCoreOutput has no field \"new_sampling_mask\"")
        })?;
        set.push((at, m));
    }
    if let Some(p) = &mro.prompt_logprobs {
        if let Some(p) = p.get_item(id)? {
            set.push((shape.new_prompt_logprobs_tensors, p));
        }
    }
    if let (Some(at), Some(d)) = (
        shape.prompt_token_id_logprobs,
        &mro.prompt_token_id_logprobs,
    ) {
        if let Some(p) = d.get_item(id)? {
            set.push((at, p));
        }
    }
    let request = &r.obj;
    let named = [
        (
            shape.stop_reason,
            request.getattr(intern!(py, "stop_reason"))?,
        ),
        (shape.events, take_events(request)?),
        (shape.trace_headers, r.f.trace_headers.bind(py).clone()),
        (
            shape.num_nans_in_logits,
            request.getattr(intern!(py, "num_nans_in_logits"))?,
        ),
    ];
    for (at, v) in named {
        if !v.is(shape.defaults[at].bind(py)) && !v.eq(shape.defaults[at].bind(py))? {
            set.push((at, v));
        }
    }
    if let Some(s) = f.prefill_stats {
        set.push((shape.prefill_stats, s));
    }
    if let Some(p) = f.kv_transfer_params {
        let at = shape.kv_transfer_params.ok_or_else(|| {
            crate::errors::invalid("EngineCoreOutput has no field \"kv_transfer_params\"")
        })?;
        set.push((at, p));
    }
    if let (Some(at), Some(_)) = (shape.spec_decode_metrics, f.stop) {
        // A finished request's own speculative decoding metrics (kept when the engine's
        // `per_request_spec_decode_metrics` is on).
        let metrics = request.getattr(intern!(py, "spec_decode_metrics"))?;
        if !metrics.is_none() {
            set.push((at, metrics));
        }
    }
    Ok(set)
}

/// The row's `EngineCoreOutput`, built positionally up to the last field that differs from
/// its default.
pub fn build_output<'py>(
    lp: &PyV1Loop,
    r: &PyReq<'py>,
    mro: &ModelOutput<'py>,
    f: OutputFields<'py>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = r.obj.py();
    let shape = &lp.objs.output;
    let set = output_fields(lp, r, mro, f)?;
    let last = set.iter().map(|(at, _)| *at).max().unwrap_or(0);
    let mut args: Vec<Bound<'py, PyAny>> = shape.defaults[..=last]
        .iter()
        .map(|d| d.bind(py).clone())
        .collect();
    for (at, v) in set {
        args[at] = v;
    }
    shape.cls.bind(py).call1(PyTuple::new(py, args)?)
}

/// `request.take_events()`: the events list (replaced by a new one), `None` when empty.
fn take_events<'py>(request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = request.py();
    let events = request.getattr(intern!(py, "events"))?;
    if events.len()? == 0 {
        return Ok(py.None().into_bound(py));
    }
    request.setattr(intern!(py, "events"), PyList::empty(py))?;
    Ok(events)
}
