//! Speculative decoding in the bindings: a row's entry in `scheduled_spec_decode_tokens`
//! (the request's proposed `spec_token_ids` cut to what was scheduled, or placeholder ids), the
//! request's list emptied as vLLM's `schedule()` empties it, a PRIORITY victim's entry taken
//! back, and in `update_from_output` vLLM's `make_spec_decoding_stats` tallied natively
//! (`pagedkv_core::vllm_v1::spec_stats`, vLLM's object built once per step) and the
//! per-request metrics vLLM keeps where a request has them; the step's
//! `num_spec_tokens_to_schedule` (a dynamic schedule's count for the step's batch size) and,
//! under `AsyncScheduler`, the placeholder list of that length. Cost: one dict write and one
//! attribute write per scheduled row with drafts; per row with drafts in `update_from_output`
//! an attribute read (and a Python call where the request keeps metrics).

use crate::vllm_v1::engine::PyEngine;
use crate::vllm_v1::engine_requests::PyReq;
use crate::vllm_v1::grammar;
use pagedkv_core::vllm_v1::engine::Drafts;
use pagedkv_core::vllm_v1::spec_stats::SpecTally;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// vLLM's `num_spec_tokens_to_schedule` for a step of `rows` scheduled requests:
/// `dynamic_sd_lookup[rows]` under a dynamic schedule with a row scheduled, else
/// `num_spec_tokens`. Under `AsyncScheduler` the step's placeholder list
/// (`_spec_token_placeholders`, each decoding row's `spec_token_ids`) takes that length, as
/// vLLM's `_update_after_schedule` makes it.
pub fn spec_tokens_to_schedule<'py>(e: &mut PyEngine<'_, 'py>, rows: usize) -> PyResult<u64> {
    let py = e.sched.py();
    let k: u64 = e.sched.getattr(intern!(py, "num_spec_tokens"))?.extract()?;
    let lookup = match e.sched.getattr(intern!(py, "dynamic_sd_lookup")) {
        Ok(l) if !l.is_none() && rows > 0 => l,
        _ => return Ok(k),
    };
    let n: u64 = lookup.get_item(rows)?.extract()?;
    if let Some(spec) = &e.spec {
        if spec.len() as u64 != n {
            let len = usize::try_from(n).unwrap_or(usize::MAX);
            let list = PyList::new(py, std::iter::repeat_n(-1i64, len))?;
            e.sched
                .setattr(intern!(py, "_spec_token_placeholders"), &list)?;
            e.spec = Some(list);
        }
    }
    Ok(n)
}

/// `Drafts::Proposed`: the first `k` proposed drafts go into the step's
/// `scheduled_spec_decode_tokens` and the request's list is emptied; `Drafts::Padding`:
/// placeholders.
pub fn schedule<'py>(e: &mut PyEngine<'_, 'py>, r: &PyReq<'py>, d: Drafts) -> PyResult<()> {
    let py = r.obj.py();
    let list = scheduled_drafts(&r.obj, d)?;
    if let Drafts::Proposed(_) = d {
        r.obj
            .setattr(intern!(py, "spec_token_ids"), PyList::empty(py))?;
    }
    if let Some(list) = list {
        let drafts = e.drafts.get_or_insert_with(|| PyDict::new(py));
        drafts.set_item(r.f.id.bind(py), list)?;
    }
    Ok(())
}

/// A PRIORITY victim scheduled earlier in the step: its entry leaves the step's drafts.
pub fn unschedule<'py>(e: &mut PyEngine<'_, 'py>, r: &PyReq<'py>) -> PyResult<()> {
    let id = r.f.id.bind(r.obj.py());
    if let Some(d) = &e.drafts {
        if d.contains(id)? {
            d.del_item(id)?;
        }
    }
    Ok(())
}

/// `update_from_output` for a row's drafts: `make_spec_decoding_stats` tallied natively
/// (with `log_stats`; the grammar-invalidated drafts of `num_invalid_spec_tokens` not counted
/// as proposed), and the request's own `spec_decode_metrics`, where it has them, observed by
/// vLLM's method (one Python call).
pub fn record<'py>(
    e: &mut PyEngine<'_, 'py>,
    r: &PyReq<'py>,
    drafts: u64,
    accepted: u64,
) -> PyResult<()> {
    let py = r.obj.py();
    let (lp, sched) = (e.lp, e.sched.clone());
    let Some(io) = e.io.as_mut() else {
        return Err(crate::errors::invalid(
            "V1Loop: no model output in this call",
        ));
    };
    if io.spec.is_none() {
        io.spec = Some(SpecIo::read(&sched, &io.scheduler_output)?);
    }
    let Some(spec) = io.spec.as_mut() else {
        return Ok(());
    };
    let invalid = match &spec.invalid {
        Some(d) => d
            .get_item(r.f.id.bind(py))?
            .map_or(Ok(0), |v| v.extract())?,
        None => 0,
    };
    if let Some(tally) = spec.tally.as_mut() {
        tally
            .observe(drafts, accepted, invalid)
            .map_err(crate::errors::to_py)?;
    }
    let metrics = r.obj.getattr(intern!(py, "spec_decode_metrics"))?;
    if !metrics.is_none() {
        let args = (&sched, metrics, drafts.saturating_sub(invalid), accepted);
        lp.objs.observe_spec_metrics.bind(py).call1(args)?;
    }
    Ok(())
}

/// What `update_from_output` reads once for the step's drafts: `num_invalid_spec_tokens`
/// and, with `log_stats`, the tally of `SpecDecodingStats` (`num_spec_tokens` positions).
pub struct SpecIo<'py> {
    invalid: Option<Bound<'py, PyDict>>,
    pub tally: Option<SpecTally>,
}

impl<'py> SpecIo<'py> {
    fn read(sched: &Bound<'py, PyAny>, so: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = sched.py();
        let invalid = so.getattr(intern!(py, "num_invalid_spec_tokens"))?;
        let tally = match sched.getattr(intern!(py, "log_stats"))?.is_truthy()? {
            true => {
                let k: crate::args::SatCount =
                    sched.getattr(intern!(py, "num_spec_tokens"))?.extract()?;
                Some(SpecTally::new(k.usize().min(1 << 16)))
            }
            false => None,
        };
        Ok(SpecIo {
            invalid: (!invalid.is_none())
                .then(|| invalid.cast_into::<PyDict>())
                .transpose()?,
            tally,
        })
    }
}

/// vLLM's `SpecDecodingStats` of the step (`None` when nothing was observed).
pub fn stats_object<'py>(
    py: Python<'py>,
    lp: &crate::vllm_v1::loop_::PyV1Loop,
    spec: Option<SpecIo<'py>>,
) -> PyResult<Bound<'py, PyAny>> {
    match spec.and_then(|s| s.tally).filter(|t| t.observed()) {
        Some(t) => lp.objs.spec_decoding_stats.bind(py).call1((
            t.draft_per_pos.len(),
            t.num_drafts,
            t.num_draft_tokens,
            t.num_accepted_tokens,
            t.accepted_per_pos,
            t.draft_per_pos,
        )),
        None => Ok(py.None().into_bound(py)),
    }
}

/// A row's `scheduled_spec_decode_tokens` entry: the request's proposed drafts cut to `k`
/// (the same list when all fit, as vLLM keeps it), or `k` placeholders; `None` for none.
pub fn scheduled_drafts<'py>(
    request: &Bound<'py, PyAny>,
    d: Drafts,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let py = request.py();
    match d {
        Drafts::Proposed(0) | Drafts::Padding(0) => Ok(None),
        Drafts::Proposed(k) => {
            let spec = request.getattr(intern!(py, "spec_token_ids"))?;
            let k = usize::try_from(k).unwrap_or(usize::MAX);
            if spec.len()? > k {
                return Ok(Some(
                    spec.get_item(pyo3::types::PySlice::new(py, 0, k as isize, 1))?,
                ));
            }
            Ok(Some(spec))
        }
        Drafts::Padding(k) => {
            let list = PyList::new(py, std::iter::repeat_n(-1i64, k as usize))?;
            Ok(Some(list.into_any()))
        }
    }
}

/// vLLM's `update_draft_token_ids(DraftTokenIds(req_ids, draft_token_ids))`, pairwise as
/// `zip` pairs them: a finished or unknown request is skipped, a prefill chunk's drafts are
/// dropped (its list emptied), any other request takes the drafts as the structured-output
/// manager's `validate_tokens` returns them. vLLM's own manager returns a request's list
/// itself unless it has structured output, so only those rows ask it; a manager that is not
/// vLLM's own code (`_grammar.manager_kind`, asked once per call) is asked for every row, as
/// vLLM's method asks it. The lists are vLLM's objects, kept.
pub fn update_draft_token_ids(
    objs: &crate::vllm_v1::loop_::Objects,
    sched: &Bound<'_, PyAny>,
    req_ids: &Bound<'_, PyAny>,
    drafts: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let py = sched.py();
    let preempted_value = objs.preempted_value;
    let requests = sched
        .getattr(intern!(py, "requests"))?
        .cast_into::<PyDict>()?;
    let manager = sched.getattr(intern!(py, "structured_output_manager"))?;
    let ask_every_row = grammar::manager_kind(objs, &manager)? == grammar::FOREIGN;
    for (rid, spec) in req_ids.try_iter()?.zip(drafts.try_iter()?) {
        let (rid, mut spec) = (rid?, spec?);
        let Some(request) = requests.get_item(&rid)? else {
            continue;
        };
        let status: i64 = request.getattr(intern!(py, "status"))?.extract()?;
        if status > preempted_value {
            continue; // `is_finished()`
        }
        if request
            .getattr(intern!(py, "is_prefill_chunk"))?
            .is_truthy()?
        {
            if request
                .getattr(intern!(py, "spec_token_ids"))?
                .is_truthy()?
            {
                request.setattr(intern!(py, "spec_token_ids"), PyList::empty(py))?;
            }
            continue;
        }
        if ask_every_row
            || !request
                .getattr(intern!(py, "structured_output_request"))?
                .is_none()
        {
            spec = manager.call_method1(intern!(py, "validate_tokens"), (&request, spec))?;
        }
        request.setattr(intern!(py, "spec_token_ids"), spec)?;
    }
    Ok(())
}
