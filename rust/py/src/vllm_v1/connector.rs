//! A KV connector in the native loop: the walk's connector hooks
//! (`pagedkv_core::vllm_v1::Engine::prefix_hit` with a connector, `connector_allocated`,
//! `start_remote_load`, `reserved_blocks`, `connector_pending_frees`, `blocks_can_be_freed`,
//! `connector_step_end`, `holds_kv_blocks`) as calls of the scheduler's `ConnectorSteps`
//! (`pagedkv.vllm_v1._connector`), which runs vLLM's own lines around the connector, and
//! the `kv_transfer_params` `_free_request` returns, kept for the row's output.
//!
//! Without a connector (`Objects::connector` is `None`) none of these calls Python.
//!
//! Cost: one Python call per waiting request looked up and one per request allocated in the
//! waiting pass; one per asynchronous load and per failed allocation of a running request;
//! one per step.

use crate::vllm_v1::engine::PyEngine;
use crate::vllm_v1::engine_requests::PyReq;
use crate::vllm_v1::loop_kv::PyBlocks;
use pagedkv_core::vllm_v1::engine::PrefixHit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

impl<'py> PyEngine<'_, 'py> {
    /// The scheduler's `ConnectorSteps` (`None`: no KV connector).
    pub(super) fn connector(&self) -> Option<Bound<'py, PyAny>> {
        let py = self.py();
        self.lp.objs.connector.as_ref().map(|c| c.bind(py).clone())
    }

    /// The prefix lookup with a connector (`ConnectorSteps.lookup`): `None` when the
    /// connector cannot tell yet.
    pub(super) fn connector_lookup(
        &mut self,
        steps: &Bound<'py, PyAny>,
        r: &PyReq<'py>,
    ) -> PyResult<Option<PrefixHit<PyBlocks>>> {
        let py = self.py();
        let found = steps.call_method1(intern!(py, "lookup"), (&r.obj,))?;
        if found.is_none() {
            return Ok(None);
        }
        let found = found.cast_into::<PyTuple>()?;
        let blocks = found.get_item(0)?;
        Ok(Some(PrefixHit {
            blocks: self.lp.kv.hit_ids(&self.sched, &blocks)?,
            num_local: found.get_item(1)?.extract()?,
            num_external: found.get_item(2)?.extract()?,
            load_async: found.get_item(3)?.is_truthy()?,
        }))
    }

    /// `_holds_kv_blocks`: computed tokens, or a request waiting for remote KV.
    pub(super) fn holds_blocks(&self, r: &PyReq<'py>) -> PyResult<bool> {
        let py = self.py();
        if self.get(r, intern!(py, "num_computed_tokens"))? > 0 {
            return Ok(true);
        }
        match self.connector() {
            Some(steps) => {
                let remote = steps.getattr(intern!(py, "WAITING_FOR_REMOTE_KVS"))?;
                Ok(r.obj.getattr(intern!(py, "status"))?.is(&remote))
            }
            None => Ok(false),
        }
    }

    /// Calls `ConnectorSteps.<name>(*args)` when there is a connector; `None` without one.
    pub(super) fn connector_call<A>(
        &self,
        name: &Bound<'py, pyo3::types::PyString>,
        args: A,
    ) -> PyResult<Option<Bound<'py, PyAny>>>
    where
        A: pyo3::call::PyCallArgs<'py>,
    {
        match self.connector() {
            Some(steps) => steps.call_method1(name, args).map(Some),
            None => Ok(None),
        }
    }

    /// `_preempt_request(request, timestamp)`, dropping the in-flight output when the
    /// connector needs its KV delivered (`requires_kv_delivery`).
    pub(super) fn preempt_request(&self, r: &PyReq<'py>, ts: Bound<'py, PyAny>) -> PyResult<()> {
        let py = self.py();
        let kwargs = match self.connector() {
            Some(_) => {
                let drop = self.sched.getattr(intern!(py, "requires_kv_delivery"))?;
                match drop.is_truthy()? {
                    true => {
                        let d = PyDict::new(py);
                        d.set_item(intern!(py, "drop_stale_output"), true)?;
                        Some(d)
                    }
                    false => None,
                }
            }
            None => None,
        };
        self.sched
            .call_method(
                intern!(py, "_preempt_request"),
                (&r.obj, ts),
                kwargs.as_ref(),
            )
            .map(drop)
    }

    /// `_free_request(request)`; its `kv_transfer_params` (a connector's) kept for the row's
    /// output.
    pub(super) fn free_and_keep_params(&mut self, r: &PyReq<'py>) -> PyResult<()> {
        let py = self.py();
        let freed = self
            .sched
            .call_method1(intern!(py, "_free_request"), (&r.obj,))?;
        if self.lp.objs.connector.is_none() {
            return Ok(());
        }
        // vLLM 0.32 and 0.33 return `(kv_transfer_params, ec_transfer_params)`.
        let params = freed.cast_into::<PyTuple>()?.get_item(0)?;
        self.kv_params = (!params.is_none()).then_some(params);
        Ok(())
    }

    /// The kept `kv_transfer_params` for the row being emitted; a remote prefill's gets the
    /// prefill instance's cached tokens (`remote_prefill_cached_tokens`) from the row's
    /// prefill stats, as vLLM's `update_from_output` sets them.
    pub(super) fn take_kv_params(
        &mut self,
        prefill_stats: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some(params) = self.kv_params.take() else {
            return Ok(None);
        };
        let py = self.py();
        if let Some(stats) = prefill_stats {
            let remote = params.call_method1(intern!(py, "get"), ("do_remote_prefill",))?;
            if remote.is_truthy()? {
                let cached = stats.getattr(intern!(py, "num_cached_tokens"))?;
                params.set_item("remote_prefill_cached_tokens", cached)?;
            }
        }
        Ok(Some(params))
    }
}
