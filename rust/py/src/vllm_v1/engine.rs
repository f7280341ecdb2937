//! `pagedkv_core::vllm_v1::Engine` over vLLM's own objects, for one call of the native loop: the
//! scheduler's `running` list and `waiting` queue (through their own methods), its
//! `Request`s (fields read and written in place, tokens appended to their own lists), vLLM's
//! methods for the rare events, and pagedkv's native KV manager (called in Rust). The walk
//! (`pagedkv_core::vllm_v1::walk`) decides; this file reads and writes where vLLM's loop does.

use crate::vllm_v1::drafts;
use crate::vllm_v1::hash::{extend_block_hashes, HashShape};
use crate::vllm_v1::loop_::{Fixed, FixedMap, PyV1Loop};
use crate::vllm_v1::loop_kv::PyBlocks;
use crate::vllm_v1::output::{self, ModelOutput};
use pagedkv_core::vllm_v1::engine::{
    Drafts, EncoderPlan, Engine, Mode, Queue, Release, Settings, Start, Status, Step,
    StructuredFlags,
};
use pagedkv_core::vllm_v1::policy::{self, Repetition, Stop, StopRule};
use pagedkv_core::vllm_v1::SlotRequest;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use std::sync::Arc;

/// A request: the object and its fixed fields (read once, see [`Fixed`]).
#[derive(Clone)]
pub struct PyReq<'py> {
    pub obj: Bound<'py, PyAny>,
    pub f: Arc<Fixed>,
}

impl PartialEq for PyReq<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.obj.is(&other.obj)
    }
}

/// One row's sampled tokens (the model runner's list, or a list made of its sequence) and
/// the row's index in the model runner's output.
pub struct Sampled<'py> {
    pub list: Bound<'py, PyList>,
    pub index: Option<Bound<'py, PyAny>>,
}

/// What an output takes before the request is freed: its prefill stats and logprobs.
pub struct Pending<'py> {
    prefill_stats: Option<Bound<'py, PyAny>>,
    logprobs: Option<Bound<'py, PyAny>>,
}

/// One call's engine: the loop, the scheduler and its queues, the requests' fixed fields.
pub struct PyEngine<'a, 'py> {
    pub lp: &'a PyV1Loop,
    pub sched: Bound<'py, PyAny>,
    running: Bound<'py, PyList>,
    waiting: Bound<'py, PyAny>,
    kv_holding: Bound<'py, PyAny>,
    map: FixedMap,
    /// This call read the fixed fields of a streaming session (not kept for the next call:
    /// a session's update replaces them between calls).
    sessions: bool,
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
}

pub struct UpdateIo<'py> {
    pub scheduler_output: Bound<'py, PyAny>,
    pub mro: ModelOutput<'py>,
    pub outputs: Vec<(i64, Bound<'py, PyList>)>,
    /// The step's drafts bookkeeping (read at the first row with drafts).
    pub spec: Option<crate::vllm_v1::drafts::SpecIo<'py>>,
}

fn get_u64(obj: &Bound<'_, PyAny>, name: &Bound<'_, PyString>) -> PyResult<u64> {
    obj.getattr(name)?.extract()
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
        })
    }

    fn py(&self) -> Python<'py> {
        self.sched.py()
    }

    /// The request with its fixed fields (read now if the last call did not see it).
    fn req(&mut self, obj: Bound<'py, PyAny>) -> PyResult<PyReq<'py>> {
        let key = obj.as_ptr() as usize;
        if let Some(f) = self.map.get(&key) {
            return Ok(PyReq { f: f.clone(), obj });
        }
        let f = Arc::new(Fixed::read(&obj, &self.lp.objs)?);
        self.sessions |= f.session;
        self.map.insert(key, f.clone());
        Ok(PyReq { obj, f })
    }

    fn get(&self, r: &PyReq<'py>, name: &Bound<'py, PyString>) -> PyResult<u64> {
        get_u64(&r.obj, name)
    }

    fn set(&self, r: &PyReq<'py>, name: &Bound<'py, PyString>, v: u64) -> PyResult<()> {
        r.obj.setattr(name, v)
    }

    fn io(&self) -> PyResult<&UpdateIo<'py>> {
        self.io
            .as_ref()
            .ok_or_else(|| crate::errors::invalid("V1Loop: no model output in this call"))
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
    fn begin(&mut self, mode: &Mode) -> PyResult<Start> {
        let py = self.py();
        let sched = &self.sched;
        // Everything of the scheduler's the walk needs is read before anything is written.
        let current_step = get_u64(sched, intern!(py, "current_step"))?;
        let num_executed_steps = match mode.release {
            Release::V033 => Some(get_u64(sched, intern!(py, "num_executed_steps"))?),
            Release::V032 => None,
        };
        for name in [
            intern!(py, "deferred_waiting"),
            intern!(py, "_inflight_prefills"),
            intern!(py, "prev_step_scheduled_req_ids"),
        ] {
            sched.getattr(name)?;
        }
        let kv_holding = sched.getattr(intern!(py, "kv_holding_waiting"))?.len()?;
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
        })
    }

    fn ts(&self) -> Bound<'py, PyAny> {
        match &self.ts {
            Some(t) => t.clone(),
            None => self.py().None().into_bound(self.py()),
        }
    }

    fn attr(&self, name: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyAny>> {
        self.sched.getattr(name)
    }

    fn queue(&self, q: Queue) -> &Bound<'py, PyAny> {
        match q {
            Queue::Waiting => &self.waiting,
            Queue::KvHolding => &self.kv_holding,
        }
    }
}

impl<'py> Engine for PyEngine<'_, 'py> {
    type Req = PyReq<'py>;
    type Error = PyErr;
    type Sampled = Sampled<'py>;
    type Pending = Pending<'py>;
    type Scheduled = Bound<'py, PyTuple>;
    type Blocks = PyBlocks;

    fn error(&self, e: pagedkv_core::Error) -> PyErr {
        crate::errors::to_py(e)
    }

    fn settings(&mut self) -> PyResult<Settings> {
        crate::vllm_v1::settings::read_settings(&self.sched, self.lp)
    }

    fn begin_schedule(&mut self, mode: &Mode) -> PyResult<Start> {
        self.begin(mode)
    }

    fn set_current_step(&mut self, step: u64) -> PyResult<()> {
        self.sched.setattr(intern!(self.py(), "current_step"), step)
    }

    fn set_num_executed_steps(&mut self, n: u64) -> PyResult<()> {
        self.sched
            .setattr(intern!(self.py(), "num_executed_steps"), n)
    }

    fn running_len(&self) -> usize {
        self.running.len()
    }

    fn running_at(&mut self, i: usize) -> PyResult<PyReq<'py>> {
        let obj = self.running.get_item(i)?;
        self.req(obj)
    }

    fn running_remove(&mut self, i: usize) -> PyResult<PyReq<'py>> {
        let obj = self.running.get_item(i)?;
        self.running.del_item(i)?;
        self.req(obj)
    }

    fn running_push(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        self.running.append(&r.obj)
    }

    fn running_priority_keys(&self) -> PyResult<Vec<(i64, f64)>> {
        let py = self.py();
        let mut keys = Vec::with_capacity(self.running.len());
        for r in self.running.iter() {
            let p: i64 = r.getattr(intern!(py, "priority"))?.extract()?;
            let t: f64 = r.getattr(intern!(py, "arrival_time"))?.extract()?;
            keys.push((p, t));
        }
        Ok(keys)
    }

    fn waiting_len(&self, q: Queue) -> PyResult<usize> {
        self.queue(q).len()
    }

    fn waiting_peek(&mut self, q: Queue) -> PyResult<PyReq<'py>> {
        let obj = self
            .queue(q)
            .call_method0(intern!(self.py(), "peek_request"))?;
        self.req(obj)
    }

    fn waiting_pop(&mut self, q: Queue) -> PyResult<PyReq<'py>> {
        let obj = self
            .queue(q)
            .call_method0(intern!(self.py(), "pop_request"))?;
        self.req(obj)
    }

    fn waiting_prepend(&mut self, q: Queue, skipped: Vec<PyReq<'py>>) -> PyResult<()> {
        let py = self.py();
        let objs: Vec<Bound<'py, PyAny>> = skipped.into_iter().map(|r| r.obj).collect();
        let deque = py.import("collections")?.getattr("deque")?.call1((objs,))?;
        self.queue(q)
            .call_method1(intern!(py, "prepend_requests"), (deque,))
            .map(drop)
    }

    fn num_waiting_for_streaming_input(&self) -> PyResult<usize> {
        self.attr(intern!(self.py(), "num_waiting_for_streaming_input"))?
            .extract()
    }

    fn deferred_len(&self) -> PyResult<usize> {
        self.attr(intern!(self.py(), "deferred_waiting"))?.len()
    }

    fn deferred_add(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        let py = self.py();
        let d = self.attr(intern!(py, "deferred_waiting"))?;
        d.call_method1(intern!(py, "add"), (&r.obj,)).map(drop)
    }

    fn deferred_discard(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        let py = self.py();
        let d = self.attr(intern!(py, "deferred_waiting"))?;
        d.call_method1(intern!(py, "discard"), (&r.obj,)).map(drop)
    }

    fn set_prefill_capacity_bound(&mut self, bound: bool) -> PyResult<()> {
        self.sched
            .setattr(intern!(self.py(), "prefill_capacity_bound"), bound)
    }

    fn inflight_prefills_len(&self) -> PyResult<usize> {
        self.attr(intern!(self.py(), "_inflight_prefills"))?.len()
    }

    fn inflight_prefills_add(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        let py = self.py();
        let s = self.attr(intern!(py, "_inflight_prefills"))?;
        s.call_method1(intern!(py, "add"), (&r.obj,)).map(drop)
    }

    fn inflight_prefills_discard(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        let py = self.py();
        let s = self.attr(intern!(py, "_inflight_prefills"))?;
        s.call_method1(intern!(py, "discard"), (&r.obj,)).map(drop)
    }

    fn status(&self, r: &PyReq<'py>) -> PyResult<Status> {
        let py = self.py();
        let o = &self.lp.objs;
        let s = r.obj.getattr(intern!(py, "status"))?;
        Ok(if s.is(o.running.bind(py)) {
            Status::Running
        } else if s.is(o.waiting.bind(py)) {
            Status::Waiting
        } else if s.is(o.preempted.bind(py)) {
            Status::Preempted
        } else if s.extract::<i64>()? > o.preempted_value {
            Status::Finished
        } else {
            Status::OtherWaiting
        })
    }

    fn set_running(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        let py = self.py();
        r.obj
            .setattr(intern!(py, "status"), self.lp.objs.running.bind(py))
    }

    fn set_stopped(&mut self, r: &PyReq<'py>, stop: Stop) -> PyResult<()> {
        let py = self.py();
        let o = &self.lp.objs;
        let status = match stop {
            Stop::Length => &o.length_capped,
            Stop::Eos | Stop::StopToken(_) | Stop::Pooled => &o.stopped,
            Stop::Repetition => &o.finished_repetition,
            Stop::Error => &o.finished_error,
        };
        r.obj.setattr(intern!(py, "status"), status.bind(py))?;
        match stop {
            Stop::StopToken(t) => r.obj.setattr(intern!(py, "stop_reason"), t),
            Stop::Repetition => r
                .obj
                .setattr(intern!(py, "stop_reason"), "repetition_detected"),
            Stop::Error => r.obj.setattr(intern!(py, "resumable"), false),
            Stop::Eos | Stop::Length | Stop::Pooled => Ok(()),
        }
    }

    fn num_tokens(&self, r: &PyReq<'py>) -> u64 {
        r.f.all.bind(self.py()).len() as u64
    }

    fn num_prompt_tokens(&self, r: &PyReq<'py>) -> u64 {
        r.f.num_prompt
    }

    fn shared_prefix_boundary(&self, r: &PyReq<'py>) -> PyResult<u64> {
        self.get(r, intern!(self.py(), "shared_prefix_boundary"))
    }

    fn custom_mamba_split(&self, r: &PyReq<'py>, n: u64, local: Option<u64>) -> PyResult<u64> {
        let py = self.py();
        let name = intern!(py, "_mamba_block_aligned_split");
        let split = match local {
            None => self.sched.call_method1(name, (&r.obj, n))?,
            Some(hit) => self.sched.call_method1(name, (&r.obj, n, hit, 0u64))?,
        };
        Ok(split.extract::<crate::args::SatCount>()?.0)
    }

    fn num_output_tokens(&self, r: &PyReq<'py>) -> PyResult<u64> {
        Ok(r.f.outs.bind(self.py()).len() as u64)
    }

    fn max_tokens(&self, r: &PyReq<'py>) -> u64 {
        r.f.max_tokens
    }

    fn stop_rule(&self, r: &PyReq<'py>) -> StopRule {
        r.f.rule.clone()
    }

    fn num_computed_tokens(&self, r: &PyReq<'py>) -> PyResult<u64> {
        self.get(r, intern!(self.py(), "num_computed_tokens"))
    }

    fn set_num_computed_tokens(&mut self, r: &PyReq<'py>, n: u64) -> PyResult<()> {
        self.set(r, intern!(self.py(), "num_computed_tokens"), n)
    }

    fn num_output_placeholders(&self, r: &PyReq<'py>) -> PyResult<u64> {
        self.get(r, intern!(self.py(), "num_output_placeholders"))
    }

    fn set_num_output_placeholders(&mut self, r: &PyReq<'py>, n: u64) -> PyResult<()> {
        self.set(r, intern!(self.py(), "num_output_placeholders"), n)
    }

    fn num_in_flight_tokens(&self, r: &PyReq<'py>) -> PyResult<u64> {
        self.get(r, intern!(self.py(), "num_in_flight_tokens"))
    }

    fn set_num_in_flight_tokens(&mut self, r: &PyReq<'py>, n: u64) -> PyResult<()> {
        self.set(r, intern!(self.py(), "num_in_flight_tokens"), n)
    }

    fn num_stale_output_tokens(&self, r: &PyReq<'py>) -> PyResult<u64> {
        self.get(r, intern!(self.py(), "num_stale_output_tokens"))
    }

    fn set_num_stale_output_tokens(&mut self, r: &PyReq<'py>, n: u64) -> PyResult<()> {
        self.set(r, intern!(self.py(), "num_stale_output_tokens"), n)
    }

    fn drop_stale_output(&self, r: &PyReq<'py>) -> PyResult<bool> {
        r.obj
            .getattr(intern!(self.py(), "drop_stale_output"))?
            .is_truthy()
    }

    fn set_is_prefill_chunk(&mut self, r: &PyReq<'py>, chunk: bool) -> PyResult<()> {
        r.obj.setattr(intern!(self.py(), "is_prefill_chunk"), chunk)
    }

    fn next_decode_eligible_step(&self, r: &PyReq<'py>) -> PyResult<u64> {
        self.get(r, intern!(self.py(), "next_decode_eligible_step"))
    }

    fn set_async_decode(&mut self, r: &PyReq<'py>, eligible: Option<u64>) -> PyResult<()> {
        let py = self.py();
        if let Some(spec) = &self.spec {
            r.obj.setattr(intern!(py, "spec_token_ids"), spec)?;
        }
        if let Some(step) = eligible {
            self.set(r, intern!(py, "next_decode_eligible_step"), step)?;
        }
        Ok(())
    }

    fn num_drafts(&self, r: &PyReq<'py>) -> PyResult<u64> {
        Ok(r.obj.getattr(intern!(self.py(), "spec_token_ids"))?.len()? as u64)
    }

    fn is_prefill_chunk(&self, r: &PyReq<'py>) -> PyResult<bool> {
        r.obj
            .getattr(intern!(self.py(), "is_prefill_chunk"))?
            .is_truthy()
    }

    fn schedule_drafts(&mut self, r: &PyReq<'py>, d: Drafts) -> PyResult<()> {
        drafts::schedule(self, r, d)
    }

    fn unschedule_drafts(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        drafts::unschedule(self, r)
    }

    fn record_drafts(&mut self, r: &PyReq<'py>, drafts: u64, accepted: u64) -> PyResult<()> {
        drafts::record(self, r, drafts, accepted)
    }

    fn lora_id(&self, r: &PyReq<'py>) -> Option<i64> {
        r.f.lora
    }

    fn uses_structured_output(&self, r: &PyReq<'py>) -> bool {
        r.f.structured
    }

    fn unblock(&mut self, r: &PyReq<'py>) -> PyResult<bool> {
        let py = self.py();
        self.sched
            .call_method1(intern!(py, "_handle_blocked_waiting_request"), (&r.obj,))?
            .is_truthy()
    }

    fn repeats(&mut self, r: &PyReq<'py>, rep: &Repetition) -> PyResult<bool> {
        let outs = r.f.outs.bind(self.py());
        let n = outs.len();
        let from = n - n.min(usize::try_from(rep.tail_len()).unwrap_or(usize::MAX));
        let tail: Result<Vec<i64>, _> = outs.get_slice(from, n).extract();
        match tail {
            Ok(tail) => Ok(policy::has_repetition(&tail, n as u64, rep)),
            // A token outside i64: vLLM's own function compares Python ints.
            Err(_) => output::check_sequence_repetition(&r.obj),
        }
    }

    fn accept_tokens(&mut self, r: &PyReq<'py>, s: &Sampled<'py>) -> PyResult<bool> {
        output::accept_tokens(&self.sched, &r.obj, &s.list)
    }

    fn preempt(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        let py = self.py();
        let args = (&r.obj, self.ts());
        self.sched
            .call_method1(intern!(py, "_preempt_request"), args)
            .map(drop)
    }

    fn prefix_hit(&mut self, r: &PyReq<'py>) -> PyResult<(Option<PyBlocks>, u64)> {
        if self.lp.hash_lookahead > 0 && self.resumable(r)? {
            // vLLM 0.33: a session's kept hashes may cover a discarded token (a lookahead
            // hash reads past its block), so they are recomputed from the current tokens.
            let py = self.py();
            let hashes = r.obj.getattr(intern!(py, "block_hashes"))?;
            hashes.call_method0(intern!(py, "clear"))?;
            r.obj.call_method0(intern!(py, "update_block_hashes"))?;
        }
        let (blocks, num_local) = output::prefix_hit(&self.sched, &r.obj)?;
        let ids = self.lp.kv.hit_ids(&self.sched, &blocks)?;
        Ok((ids, num_local))
    }

    fn record_prefix_cache_stats(&mut self, r: &PyReq<'py>, hit: u64) -> PyResult<()> {
        let py = self.py();
        let kv = self.attr(intern!(py, "kv_cache_manager"))?;
        kv.call_method1(intern!(py, "record_prefix_cache_stats"), (&r.obj, hit))
            .map(drop)
    }

    fn record_scheduled(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        let py = self.py();
        if let Some(event) = &self.lp.objs.event_scheduled {
            let args = (event.bind(py), self.ts());
            r.obj.call_method1(intern!(py, "record_event"), args)?;
        }
        Ok(())
    }

    fn free_request(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        let py = self.py();
        self.sched
            .call_method1(intern!(py, "_free_request"), (&r.obj,))
            .map(drop)
    }

    fn resumable(&self, r: &PyReq<'py>) -> PyResult<bool> {
        r.obj.getattr(intern!(self.py(), "resumable"))?.is_truthy()
    }

    fn handle_stopped(&mut self, r: &PyReq<'py>) -> PyResult<bool> {
        let py = self.py();
        self.sched
            .call_method1(intern!(py, "_handle_stopped_request"), (&r.obj,))?
            .is_truthy()
    }

    fn enqueue_waiting(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        let py = self.py();
        self.sched
            .call_method1(intern!(py, "_enqueue_waiting_request"), (&r.obj,))
            .map(drop)
    }

    fn remove_stopped(&mut self, running: &[PyReq<'py>], other: &[PyReq<'py>]) -> PyResult<()> {
        for r in running.iter().chain(other) {
            self.map.remove(&(r.obj.as_ptr() as usize));
        }
        let running: Vec<_> = running.iter().map(|r| r.obj.clone()).collect();
        let other: Vec<_> = other.iter().map(|r| r.obj.clone()).collect();
        crate::vllm_v1::queues::remove_stopped(&self.sched, &running, &other)
    }

    fn allocate(
        &mut self,
        r: &PyReq<'py>,
        a: &SlotRequest<'_, PyBlocks>,
    ) -> PyResult<Option<PyBlocks>> {
        self.lp.kv.allocate(&self.sched, &r.obj, &r.f.rid, a)
    }

    fn cache_blocks(&mut self, r: &PyReq<'py>, num_tokens: u64) -> PyResult<()> {
        self.lp
            .kv
            .cache_blocks(&self.sched, &r.obj, &r.f.rid, num_tokens)
    }

    fn block_table(&self, r: &PyReq<'py>) -> PyResult<PyBlocks> {
        self.lp.kv.table(&r.f.rid)
    }

    fn has_encoder_inputs(&self, r: &PyReq<'py>) -> bool {
        r.f.mm
    }

    fn encoder_budget(&mut self) -> PyResult<u64> {
        get_u64(
            &self.sched,
            intern!(self.py(), "max_num_encoder_input_tokens"),
        )
    }

    fn schedule_encoder_inputs(
        &mut self,
        r: &PyReq<'py>,
        num_computed: u64,
        n: u64,
        budget: u64,
    ) -> PyResult<EncoderPlan> {
        self.enc.plan(&self.sched, &r.obj, num_computed, n, budget)
    }

    fn commit_encoder_inputs(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        self.enc
            .commit(&self.sched, &r.obj, r.f.id.bind(self.sched.py()))
    }

    fn drop_encoder_inputs(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        self.enc.drop_row(r.f.id.bind(self.sched.py()))
    }

    fn free_encoder_cache(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        let py = self.py();
        self.attr(intern!(py, "encoder_cache_manager"))?
            .call_method1(intern!(py, "free"), (&r.obj,))
            .map(drop)
    }

    fn free_encoder_inputs(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        let py = self.py();
        self.sched
            .call_method1(intern!(py, "_free_encoder_inputs"), (&r.obj,))
            .map(drop)
    }

    fn scheduler_output(
        &mut self,
        step: &Step<PyReq<'py>, PyBlocks>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let to_schedule = drafts::spec_tokens_to_schedule(self, step.rows.len())?;
        output::scheduler_output(self, step, to_schedule)
    }

    fn mark_structured_output(
        &mut self,
        out: &mut Bound<'py, PyTuple>,
        flags: StructuredFlags,
    ) -> PyResult<()> {
        output::mark_structured_output(out, flags)
    }

    fn scheduled_rows(&mut self) -> PyResult<Vec<(PyReq<'py>, u64, u64)>> {
        let py = self.py();
        let requests = self.attr(intern!(py, "requests"))?.cast_into::<PyDict>()?;
        let so = &self.io()?.scheduler_output;
        let scheduled = so
            .getattr(intern!(py, "num_scheduled_tokens"))?
            .cast_into::<PyDict>()?;
        let drafts = so
            .getattr(intern!(py, "scheduled_spec_decode_tokens"))?
            .cast_into::<PyDict>()?;
        let mut rows = Vec::with_capacity(scheduled.len());
        for (id, n) in scheduled.iter() {
            let n: u64 = n.extract()?;
            let k = match drafts.is_empty() {
                true => 0,
                false => drafts.get_item(&id)?.map_or(Ok(0), |d| d.len())? as u64,
            };
            if let Some(obj) = requests.get_item(&id)? {
                rows.push((self.req(obj)?, n, k));
            }
        }
        Ok(rows)
    }

    fn sampled(&mut self, r: &PyReq<'py>) -> PyResult<Sampled<'py>> {
        self.io()?.mro.sampled(r.f.id.bind(self.py()))
    }

    fn pooled(&mut self, r: &PyReq<'py>) -> PyResult<bool> {
        if !r.f.pooling {
            return Ok(false);
        }
        let id = r.f.id.bind(self.py());
        Ok(self.io()?.mro.pooler_output(id)?.is_some())
    }

    fn sampled_len(&self, s: &Sampled<'py>) -> usize {
        s.list.len()
    }

    fn truncate_sampled(&mut self, s: &mut Sampled<'py>, kept: usize) -> PyResult<()> {
        s.list.del_slice(kept, s.list.len())
    }

    fn append_output_token(
        &mut self,
        r: &PyReq<'py>,
        s: &Sampled<'py>,
        k: usize,
    ) -> PyResult<Option<i64>> {
        let py = self.py();
        let tok = s.list.get_item(k)?;
        let all = r.f.all.bind(py);
        r.f.outs.bind(py).append(&tok)?;
        all.append(&tok)?;
        if let Some(h) = &r.f.hashes {
            let h = h.bind(py);
            let (size, ahead) = (self.lp.hash_block_size, self.lp.hash_lookahead);
            let need = (h.len()? as u64 + 1)
                .saturating_mul(size)
                .saturating_add(ahead);
            if need <= all.len() as u64 {
                let shape = HashShape {
                    block_size: size as usize,
                    lookahead: ahead as usize,
                };
                extend_block_hashes(&r.obj, h, all, r.f.hash_fn, shape)?;
            }
        }
        // An id outside i64 (any Python int is a token to vLLM) matches no EOS or stop id.
        Ok(tok.extract().ok())
    }

    fn begin_output(
        &mut self,
        r: &PyReq<'py>,
        s: &Sampled<'py>,
        emit: bool,
    ) -> PyResult<Pending<'py>> {
        let prefill_stats = match emit {
            true => output::take_prefill_stats(&self.sched, &r.obj)?,
            false => None,
        };
        let logprobs = self.io()?.mro.new_logprobs(&r.obj, s)?;
        Ok(Pending {
            prefill_stats,
            logprobs,
        })
    }

    fn emit_output(
        &mut self,
        r: &PyReq<'py>,
        p: Pending<'py>,
        s: Sampled<'py>,
        stop: Option<Stop>,
        emit: bool,
    ) -> PyResult<()> {
        let (py, lp) = (self.py(), self.lp);
        let Some(io) = self.io.as_mut() else {
            return Err(crate::errors::invalid(
                "V1Loop: no model output in this call",
            ));
        };
        // vLLM slices the mask after the stop's frees, then reads the NaN count.
        let sampling_mask = io.mro.new_sampling_mask(&s)?;
        io.mro.set_nans(&r.obj, r.f.id.bind(py))?;
        if !emit {
            return Ok(());
        }
        let pooling = match r.f.pooling {
            true => io.mro.pooler_output(r.f.id.bind(py))?,
            false => None,
        };
        let fields = output::OutputFields {
            pooling,
            tokens: s.list,
            stop,
            logprobs: p.logprobs,
            sampling_mask,
            prefill_stats: p.prefill_stats,
        };
        let output = output::build_output(lp, r, &io.mro, fields)?;
        let client = r.f.client;
        match io.outputs.iter().find(|(c, _)| *c == client) {
            Some((_, list)) => list.append(output),
            None => {
                io.outputs.push((client, PyList::new(py, [output])?));
                Ok(())
            }
        }
    }
}
