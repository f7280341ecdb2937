//! The native loop's multimodal side over vLLM's own encoder methods: the walk
//! (`pagedkv_core::vllm_v1::walk`) asks `_try_schedule_encoder_inputs` for a request with
//! encoder inputs; the chosen inputs wait here until the row is committed, then join the
//! step's `scheduled_encoder_inputs` and `_allocate_encoder_inputs` runs, as in vLLM's
//! `schedule()`.
//!
//! Invariants: `pending` is the last plan (the next plan replaces it; a commit for another
//! request is refused); `scheduled` holds the committed rows' inputs in commit order, less
//! the rows a PRIORITY preemption took back. Requests without encoder inputs never reach this
//! file (the walk asks `has_encoder_inputs`, a field read once).
//!
//! Cost: one Python call per plan, one per commit (two dict/list operations besides).

use pagedkv_core::vllm_v1::engine::EncoderPlan;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

/// The step's encoder inputs (one `schedule()` call).
#[derive(Default)]
pub struct EncoderIo<'py> {
    pending: Option<Pending<'py>>,
    /// `scheduled_encoder_inputs` (made at the first commit).
    pub scheduled: Option<Bound<'py, PyDict>>,
}

/// What `_try_schedule_encoder_inputs` chose for a request not yet committed.
struct Pending<'py> {
    request: Bound<'py, PyAny>,
    to_schedule: Bound<'py, PyAny>,
    external: Bound<'py, PyAny>,
    duplicates: Bound<'py, PyAny>,
}

impl<'py> EncoderIo<'py> {
    /// `_try_schedule_encoder_inputs(request, num_computed, n, budget,
    /// shift_computed_tokens=sched.num_prefill_lookahead)` (a drafter's prefill lookahead:
    /// 1 with EAGLE, else 0; the keyword is only passed when nonzero).
    pub fn plan(
        &mut self,
        sched: &Bound<'py, PyAny>,
        request: &Bound<'py, PyAny>,
        num_computed: u64,
        n: u64,
        budget: u64,
    ) -> PyResult<EncoderPlan> {
        let py = sched.py();
        let name = intern!(py, "_try_schedule_encoder_inputs");
        let args = (request, num_computed, n, budget);
        let shift: u64 = sched
            .getattr(intern!(py, "num_prefill_lookahead"))?
            .extract()?;
        let got = if shift == 0 {
            sched.call_method1(name, args)?
        } else {
            let kwargs = PyDict::new(py);
            kwargs.set_item(intern!(py, "shift_computed_tokens"), shift)?;
            sched.call_method(name, args, Some(&kwargs))?
        };
        let got = got.cast_into::<PyTuple>()?;
        let to_schedule = got.get_item(0)?;
        let plan = EncoderPlan {
            tokens: got.get_item(1)?.extract()?,
            budget: got.get_item(2)?.extract()?,
            scheduled: to_schedule.is_truthy()?,
        };
        self.pending = Some(Pending {
            request: request.clone(),
            to_schedule,
            external: got.get_item(3)?,
            duplicates: got.get_item(4)?,
        });
        Ok(plan)
    }

    /// The last plan's row is committed: `scheduled_encoder_inputs[id] = inputs` and
    /// `_allocate_encoder_inputs(request, inputs + external, duplicates)`.
    pub fn commit(
        &mut self,
        sched: &Bound<'py, PyAny>,
        request: &Bound<'py, PyAny>,
        id: &Bound<'py, PyString>,
    ) -> PyResult<()> {
        let py = sched.py();
        let Some(p) = self.pending.take().filter(|p| p.request.is(request)) else {
            return Err(crate::errors::invalid(
                "V1Loop: an encoder commit without its plan",
            ));
        };
        let scheduled = match &self.scheduled {
            Some(d) => d.clone(),
            None => self.scheduled.insert(PyDict::new(py)).clone(),
        };
        scheduled.set_item(id, &p.to_schedule)?;
        let inputs = PyList::empty(py).add(&p.to_schedule)?.add(&p.external)?;
        let name = intern!(py, "_allocate_encoder_inputs");
        sched
            .call_method1(name, (request, inputs, &p.duplicates))
            .map(drop)
    }

    /// A PRIORITY preemption took the row back: out of `scheduled_encoder_inputs`.
    pub fn drop_row(&mut self, id: &Bound<'py, PyString>) -> PyResult<()> {
        match &self.scheduled {
            Some(d) if d.contains(id)? => d.del_item(id),
            _ => Ok(()),
        }
    }
}

/// `_get_encoder_input_updates(num_scheduled_tokens, new_reqs, scheduled_encoder_inputs)`
/// on releases that have it (0.33), when a multimodal request is among the rows (else
/// `None`: vLLM's result would be empty, only multimodal requests have pending inputs).
pub fn input_updates<'py>(
    sched: &Bound<'py, PyAny>,
    any_mm: bool,
    scheduled: &Bound<'py, PyDict>,
    new_reqs: &Bound<'py, PyList>,
    inputs: &Bound<'py, PyDict>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let py = sched.py();
    let name = intern!(py, "_get_encoder_input_updates");
    if !any_mm || !sched.hasattr(name)? {
        return Ok(None);
    }
    sched
        .call_method1(name, (scheduled, new_reqs, inputs))
        .map(Some)
}
