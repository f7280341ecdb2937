//! `update_from_output`'s inputs and outputs in the native loop: the scheduler output and
//! model runner output it reads ([`UpdateIo`]), a row's sampled tokens ([`Sampled`]) appended
//! to the request's own token lists (a block that fills hashed natively, `crate::vllm_v1::hash`),
//! and the row's `EngineCoreOutput` (`crate::vllm_v1::output`) grouped by client, in vLLM's
//! order, for `crate::vllm_v1::engine_impl`.

use crate::vllm_v1::engine::PyEngine;
use crate::vllm_v1::engine_requests::PyReq;
use crate::vllm_v1::hash::{extend_block_hashes, HashShape};
use crate::vllm_v1::output::{self, ModelOutput};
use pagedkv_core::vllm_v1::policy::Stop;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet};

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

/// `update_from_output`'s scheduler output and model runner output, and the outputs built
/// so far.
pub struct UpdateIo<'py> {
    pub scheduler_output: Bound<'py, PyAny>,
    pub mro: ModelOutput<'py>,
    pub outputs: Vec<(i64, Bound<'py, PyList>)>,
    /// The step's drafts bookkeeping (read at the first row with drafts).
    pub spec: Option<crate::vllm_v1::drafts::SpecIo<'py>>,
    /// How the step's structured-output rows advance their grammar (read at the first).
    pub grammar: Option<crate::vllm_v1::grammar::Acceptor<'py>>,
    /// The requests whose KV load failed this step (a connector's; `None`: none).
    pub failed: Option<Bound<'py, PySet>>,
}

impl<'py> PyEngine<'_, 'py> {
    pub(super) fn io(&self) -> PyResult<&UpdateIo<'py>> {
        self.io
            .as_ref()
            .ok_or_else(|| crate::errors::invalid("V1Loop: no model output in this call"))
    }
}

/// The scheduled rows of the scheduler output with their scheduled tokens and drafts, in
/// its order (a request no longer in `requests` is skipped).
pub fn scheduled_rows<'py>(e: &mut PyEngine<'_, 'py>) -> PyResult<Vec<(PyReq<'py>, u64, u64)>> {
    let py = e.py();
    let requests = e.attr(intern!(py, "requests"))?.cast_into::<PyDict>()?;
    let so = &e.io()?.scheduler_output;
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
            rows.push((e.req(obj)?, n, k));
        }
    }
    Ok(rows)
}

/// Appends the row's `k`-th sampled token to the request's output and token lists (hashing
/// a block that fills); the token as an `i64` for the stop check.
pub fn append_output_token<'py>(
    e: &PyEngine<'_, 'py>,
    r: &PyReq<'py>,
    s: &Sampled<'py>,
    k: usize,
) -> PyResult<Option<i64>> {
    let py = e.py();
    let tok = s.list.get_item(k)?;
    let all = r.f.all.bind(py);
    r.f.outs.bind(py).append(&tok)?;
    all.append(&tok)?;
    if let Some(h) = &r.f.hashes {
        let h = h.bind(py);
        let (size, ahead) = (e.lp.hash_block_size, e.lp.hash_lookahead);
        let need = (h.len()? as u64 + 1)
            .saturating_mul(size)
            .saturating_add(ahead);
        if need <= all.len() as u64 {
            let shape = HashShape {
                block_size: size as usize,
                lookahead: ahead as usize,
            };
            let f = r.f.hash_fn.as_ref().map(|(f, keys)| (*f, keys));
            extend_block_hashes(&r.obj, h, all, f, shape)?;
        }
    }
    // An id outside i64 (any Python int is a token to vLLM) matches no EOS or stop id.
    Ok(tok.extract().ok())
}

/// What the row's output takes before the request is freed (prefill stats only when it is
/// emitted).
pub fn begin_output<'py>(
    e: &PyEngine<'_, 'py>,
    r: &PyReq<'py>,
    s: &Sampled<'py>,
    emit: bool,
) -> PyResult<Pending<'py>> {
    let prefill_stats = match emit {
        true => output::take_prefill_stats(&e.sched, &r.obj)?,
        false => None,
    };
    let logprobs = e.io()?.mro.new_logprobs(&r.obj, s)?;
    Ok(Pending {
        prefill_stats,
        logprobs,
    })
}

/// The row's sampling mask and NaN count, then (when emitted) its `EngineCoreOutput`
/// appended to its client's list.
pub fn emit_output<'py>(
    e: &mut PyEngine<'_, 'py>,
    r: &PyReq<'py>,
    p: Pending<'py>,
    s: Sampled<'py>,
    stop: Option<Stop>,
    emit: bool,
) -> PyResult<()> {
    let kv_transfer_params = e.take_kv_params(p.prefill_stats.as_ref())?;
    let (py, lp) = (e.py(), e.lp);
    let Some(io) = e.io.as_mut() else {
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
        kv_transfer_params,
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
