//! The bindings' `impl pagedkv_core::vllm_v1::Engine for PyEngine`: each of the walk's hooks
//! (`pagedkv_core::vllm_v1::walk`) done where vLLM's loop does it, over vLLM's own objects:
//! the scheduler's `running` list and `waiting` queue (through their own methods), its
//! `Request`s (fields read and written in place, tokens appended to their own lists), vLLM's
//! methods for the rare events, and pagedkv's native KV manager (called in Rust). The longer
//! hooks live by job: a request's status in `crate::vllm_v1::engine_requests`,
//! `update_from_output`'s inputs and outputs in `crate::vllm_v1::engine_update`, drafts in
//! `crate::vllm_v1::drafts`, vLLM's output objects in `crate::vllm_v1::output`.

use crate::vllm_v1::engine::{get_u64, PyEngine};
use crate::vllm_v1::engine_requests::{self, PyReq};
use crate::vllm_v1::engine_update::{self, Pending, Sampled};
use crate::vllm_v1::loop_kv::PyBlocks;
use crate::vllm_v1::{drafts, grammar, output};
use pagedkv_core::vllm_v1::engine::{
    Drafts, EncoderPlan, Engine, Mode, PrefixHit, Queue, Settings, Start, Status, Step,
    StructuredFlags,
};
use pagedkv_core::vllm_v1::policy::{self, Repetition, Stop, StopRule};
use pagedkv_core::vllm_v1::SlotRequest;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

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

    fn set_last_prefill_step(&mut self, step: u64) -> PyResult<()> {
        self.sched
            .setattr(intern!(self.py(), "last_prefill_step"), step)
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
        engine_requests::status(self, r)
    }

    fn set_running(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        let py = self.py();
        r.obj
            .setattr(intern!(py, "status"), self.lp.objs.running.bind(py))
    }

    fn set_stopped(&mut self, r: &PyReq<'py>, stop: Stop) -> PyResult<()> {
        engine_requests::set_stopped(self, r, stop)
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
        grammar::accept_tokens(self, r, &s.list)
    }

    fn preempt(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        let ts = self.ts();
        self.preempt_request(r, ts)
    }

    fn prefix_hit(&mut self, r: &PyReq<'py>) -> PyResult<Option<PrefixHit<PyBlocks>>> {
        if self.lp.hash_lookahead > 0 && self.resumable(r)? {
            // vLLM 0.33: a session's kept hashes may cover a discarded token (a lookahead
            // hash reads past its block), so they are recomputed from the current tokens.
            let py = self.py();
            let hashes = r.obj.getattr(intern!(py, "block_hashes"))?;
            hashes.call_method0(intern!(py, "clear"))?;
            r.obj.call_method0(intern!(py, "update_block_hashes"))?;
        }
        if let Some(steps) = self.connector() {
            return self.connector_lookup(&steps, r);
        }
        let (blocks, num_local) = output::prefix_hit(&self.sched, &r.obj)?;
        let ids = self.lp.kv.hit_ids(&self.sched, &blocks)?;
        Ok(Some(PrefixHit::local(ids, num_local)))
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
        self.free_and_keep_params(r)
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

    fn load_failed(&self, r: &PyReq<'py>) -> PyResult<bool> {
        match self.io()?.failed.as_ref() {
            Some(failed) => failed.contains(r.f.id.bind(self.py())),
            None => Ok(false),
        }
    }

    fn holds_kv_blocks(&self, r: &PyReq<'py>) -> PyResult<bool> {
        self.holds_blocks(r)
    }

    fn connector_allocated(
        &mut self,
        r: &PyReq<'py>,
        num_external: u64,
        queries: u64,
        load_async: bool,
    ) -> PyResult<()> {
        let py = self.py();
        let args = (&r.obj, num_external, queries, load_async);
        self.connector_call(intern!(py, "allocated"), args)
            .map(drop)
    }

    fn start_remote_load(&mut self, r: &PyReq<'py>, num_computed: u64) -> PyResult<()> {
        let py = self.py();
        let args = (&r.obj, num_computed);
        match self.connector_call(intern!(py, "start_remote_load"), args)? {
            Some(_) => Ok(()),
            None => Err(crate::errors::invalid(
                "V1Loop: an asynchronous KV load without a connector",
            )),
        }
    }

    fn reserved_blocks(&mut self, r: &PyReq<'py>) -> PyResult<u64> {
        let py = self.py();
        match self.connector_call(intern!(py, "reserved_blocks"), (&r.obj,))? {
            Some(n) => n.extract(),
            None => Ok(0),
        }
    }

    fn connector_pending_frees(&mut self) -> PyResult<bool> {
        let py = self.py();
        match self.connector_call(intern!(py, "pending_frees"), ())? {
            Some(b) => b.is_truthy(),
            None => Ok(false),
        }
    }

    fn blocks_can_be_freed(&mut self, r: &PyReq<'py>) -> PyResult<bool> {
        let py = self.py();
        match self.connector_call(intern!(py, "blocks_can_be_freed"), (&r.obj,))? {
            Some(b) => b.is_truthy(),
            None => Ok(true),
        }
    }

    fn connector_step_end(
        &mut self,
        out: &mut Bound<'py, PyTuple>,
        sync_kv_loads: bool,
    ) -> PyResult<()> {
        let py = self.py();
        let args = (out.clone(), sync_kv_loads);
        self.connector_call(intern!(py, "step_end"), args).map(drop)
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
        grammar_rows: &[&PyReq<'py>],
    ) -> PyResult<()> {
        output::mark_structured_output(out, flags, grammar_rows)
    }

    fn scheduled_rows(&mut self) -> PyResult<Vec<(PyReq<'py>, u64, u64)>> {
        engine_update::scheduled_rows(self)
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
        engine_update::append_output_token(self, r, s, k)
    }

    fn begin_output(
        &mut self,
        r: &PyReq<'py>,
        s: &Sampled<'py>,
        emit: bool,
    ) -> PyResult<Pending<'py>> {
        engine_update::begin_output(self, r, s, emit)
    }

    fn emit_output(
        &mut self,
        r: &PyReq<'py>,
        p: Pending<'py>,
        s: Sampled<'py>,
        stop: Option<Stop>,
        emit: bool,
    ) -> PyResult<()> {
        engine_update::emit_output(self, r, p, s, stop, emit)
    }
}
