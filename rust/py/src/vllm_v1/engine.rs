//! `PyEngine`, the bindings' `pagedkv_core::vllm_v1::Engine` for one call of the native loop:
//! its state (the loop, the scheduler and its `running` list and `waiting` queues, the
//! requests' fixed fields taken from the loop and handed back at drop), its construction and
//! the step's start (`begin_schedule`: the scheduler's counters read before anything is
//! written). The walk (`pagedkv_core::vllm_v1::walk`) decides; the trait's methods are
//! `crate::vllm_v1::engine_impl`, a request's reads and writes
//! `crate::vllm_v1::engine_requests`, `update_from_output`'s inputs and outputs
//! `crate::vllm_v1::engine_update`.

use crate::vllm_v1::engine_update::UpdateIo;
use crate::vllm_v1::loop_::{FixedMap, PyV1Loop};
use pagedkv_core::vllm_v1::engine::{Mode, PrefillGate, Queue, Release, Start};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

/// One call's engine: the loop, the scheduler and its queues, the requests' fixed fields.
pub struct PyEngine<'a, 'py> {
    pub lp: &'a PyV1Loop,
    pub sched: Bound<'py, PyAny>,
    pub(super) running: Bound<'py, PyList>,
    waiting: Bound<'py, PyAny>,
    kv_holding: Bound<'py, PyAny>,
    pub(super) map: FixedMap,
    /// This call read the fixed fields of a streaming session (not kept for the next call:
    /// a session's update replaces them between calls).
    pub(super) sessions: bool,
    /// The step's timestamp (`schedule`).
    ts: Option<Bound<'py, PyAny>>,
    /// The step's shared draft-placeholder list (`AsyncScheduler`).
    pub spec: Option<Bound<'py, PyList>>,
    /// `scheduled_spec_decode_tokens` being built (created at the first drafts).
    pub drafts: Option<Bound<'py, PyDict>>,
    /// `update_from_output`'s inputs and outputs (grouped by client, in vLLM's order).
    pub io: Option<UpdateIo<'py>>,
    /// The step's multimodal side (`crate::vllm_v1::encoder`).
    pub enc: crate::vllm_v1::encoder::EncoderIo<'py>,
    /// The `kv_transfer_params` of the request `update_from_output` freed last, for its
    /// output (`crate::vllm_v1::connector`).
    pub kv_params: Option<Bound<'py, PyAny>>,
    /// `CachedRequestData.new_token_ids` carries the rows' tokens this step
    /// ([`sends_sampled_tokens`], read by `schedule`'s [`PyEngine::begin`]).
    pub sends_tokens: bool,
}

pub(super) fn get_u64(obj: &Bound<'_, PyAny>, name: &Bound<'_, PyString>) -> PyResult<u64> {
    obj.getattr(name)?.extract()
}

/// Whether `CachedRequestData.new_token_ids` carries each row's tokens, read every step as
/// vLLM reads it: pipeline parallelism (`use_pp`) with synchronous scheduling (the last
/// stage samples, the first stage needs the tokens; with async scheduling they travel on
/// the GPU).
fn sends_sampled_tokens(sched: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = sched.py();
    if !sched.getattr(intern!(py, "use_pp"))?.is_truthy()? {
        return Ok(false);
    }
    let config = sched.getattr(intern!(py, "scheduler_config"))?;
    Ok(!config
        .getattr(intern!(py, "async_scheduling"))?
        .is_truthy()?)
}

/// The scheduler's prefill gate: `prefill_capacity_bound`, and on 0.33 the local cadence
/// (`local_prefill_interval`, `last_prefill_step`).
fn prefill_gate(sched: &Bound<'_, PyAny>, mode: &Mode) -> PyResult<PrefillGate> {
    let py = sched.py();
    let capacity_bound = sched
        .getattr(intern!(py, "prefill_capacity_bound"))?
        .is_truthy()?;
    let mut gate = PrefillGate {
        capacity_bound,
        ..PrefillGate::default()
    };
    if mode.release == Release::V033 {
        gate.interval = get_u64(sched, intern!(py, "local_prefill_interval"))?;
        gate.last_prefill_step = sched.getattr(intern!(py, "last_prefill_step"))?.extract()?;
    }
    Ok(gate)
}

impl<'a, 'py> PyEngine<'a, 'py> {
    /// Takes the loop (a second call while this one runs is refused) and its fixed fields.
    pub fn new(lp: &'a PyV1Loop, sched: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = sched.py();
        let running = sched
            .getattr(intern!(py, "running"))?
            .cast_into::<PyList>()?;
        let waiting = sched.getattr(intern!(py, "waiting"))?;
        let kv_holding = sched.getattr(intern!(py, "kv_holding_waiting"))?;
        let map = lp.take_fixed()?;
        Ok(PyEngine {
            lp,
            sched: sched.clone(),
            running,
            waiting,
            kv_holding,
            map,
            sessions: false,
            ts: None,
            spec: None,
            drafts: None,
            io: None,
            enc: Default::default(),
            kv_params: None,
            sends_tokens: false,
        })
    }

    pub(super) fn py(&self) -> Python<'py> {
        self.sched.py()
    }

    /// Entries outlive requests only when they leave outside the loop (aborts, vLLM's
    /// loop): beyond twice the live requests (plus slack) the map starts afresh.
    fn prune(&mut self, live: usize) {
        if self.map.len() > 2 * live + 256 {
            self.map.clear();
        }
    }
}

impl Drop for PyEngine<'_, '_> {
    /// Hand the entries this call saw to the next call; the loop is free again.
    fn drop(&mut self) {
        if self.sessions {
            self.map.retain(|_, f| !f.session);
        }
        self.lp.give_back_fixed(std::mem::take(&mut self.map));
    }
}

impl<'py> PyEngine<'_, 'py> {
    pub(super) fn begin(&mut self, mode: &Mode) -> PyResult<Start> {
        let py = self.py();
        let sched = &self.sched;
        // Everything of the scheduler's the walk needs is read before anything is written.
        let current_step = get_u64(sched, intern!(py, "current_step"))?;
        let num_executed_steps = match mode.release {
            Release::V033 => Some(get_u64(sched, intern!(py, "num_executed_steps"))?),
            Release::V032 => None,
        };
        let prefill_gate = prefill_gate(sched, mode)?;
        let sends_tokens = sends_sampled_tokens(sched)?;
        for name in [
            intern!(py, "deferred_waiting"),
            intern!(py, "_inflight_prefills"),
            intern!(py, "prev_step_scheduled_req_ids"),
        ] {
            sched.getattr(name)?;
        }
        let kv_holding = sched.getattr(intern!(py, "kv_holding_waiting"))?.len()?;
        self.sends_tokens = sends_tokens;
        let live = self.running.len() + self.waiting.len()? + kv_holding;
        self.prune(live);
        self.lp.kv.new_step_starts()?;
        self.ts = Some(self.lp.objs.monotonic.bind(py).call0()?);
        if mode.asynchronous {
            let k = get_u64(&self.sched, intern!(py, "num_spec_tokens"))?;
            let k = usize::try_from(k).unwrap_or(usize::MAX);
            let spec = PyList::new(py, std::iter::repeat_n(-1i64, k))?;
            self.sched
                .setattr(intern!(py, "_spec_token_placeholders"), &spec)?;
            self.spec = Some(spec);
        }
        Ok(Start {
            current_step,
            num_executed_steps,
            num_eligible: live as u64,
            prefill_gate,
        })
    }

    pub(super) fn ts(&self) -> Bound<'py, PyAny> {
        match &self.ts {
            Some(t) => t.clone(),
            None => self.py().None().into_bound(self.py()),
        }
    }

    pub(super) fn attr(&self, name: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyAny>> {
        self.sched.getattr(name)
    }

    pub(super) fn queue(&self, q: Queue) -> &Bound<'py, PyAny> {
        match q {
            Queue::Waiting => &self.waiting,
            Queue::KvHolding => &self.kv_holding,
        }
    }
}
