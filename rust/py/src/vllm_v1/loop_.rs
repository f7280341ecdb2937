//! `V1Loop`: vLLM v1's `Scheduler.schedule()` and `update_from_output()` for the in-scope
//! path, run by the core's walk (`pagedkv_core::vllm_v1::walk`) over vLLM's own objects through
//! `crate::vllm_v1::engine`'s `PyEngine` (`crate::vllm_v1::engine_impl`: the scheduler's
//! `running` list and `waiting` queue, its `Request`s, pagedkv's native KV manager called in
//! Rust).
//!
//! There is no second copy of any state: everything the walk decides is written where vLLM's
//! loop writes it, so vLLM's Python loop can run the next step (the per-step switch in
//! `pagedkv.vllm_v1._native_loop`). This file holds the class, the objects it is built with
//! and the [`Mode`] decided then; `crate::vllm_v1::output` builds what leaves the scheduler.
//!
//! Errors: a call that raises stops where the exception arose; what the walk wrote before
//! (request fields, queue moves, blocks allocated or freed, the step counter) stays written,
//! as it would in vLLM's own loop.
//!
//! Cost per step: O(scheduled requests) attribute reads and writes plus one list append per
//! sampled token; one Python call per admitted, preempted or finished request, and a few per
//! multimodal row (`crate::vllm_v1::encoder`).

use crate::args::SatCount;
use crate::vllm_v1::engine::PyEngine;
use crate::vllm_v1::engine_update::UpdateIo;
use crate::vllm_v1::loop_kv::LoopKv;
use crate::vllm_v1::output::ModelOutput;
use pagedkv_core::vllm_v1::block_hash::{HashFn, RequestKeys};
use pagedkv_core::vllm_v1::policy::{self, Repetition, StopRule};
use pagedkv_core::vllm_v1::{Mode, Release, Walk};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use std::sync::Arc;

/// The Python objects the loop compares against or builds with (bound once).
pub struct Objects {
    pub waiting: Py<PyAny>,
    pub running: Py<PyAny>,
    pub preempted: Py<PyAny>,
    pub stopped: Py<PyAny>,
    pub length_capped: Py<PyAny>,
    pub finished_error: Py<PyAny>,
    pub finished_repetition: Py<PyAny>,
    /// `RequestStatus.PREEMPTED`'s integer value: statuses above it are finished.
    pub preempted_value: i64,
    pub reason_stop: Py<PyAny>,
    pub reason_length: Py<PyAny>,
    pub reason_error: Py<PyAny>,
    pub reason_repetition: Py<PyAny>,
    /// `EngineCoreEventType.SCHEDULED` (`None`: stats off, no request events).
    pub event_scheduled: Option<Py<PyAny>>,
    /// `make_new(request, block_ids, v2) -> NewRequestData` (vLLM's `from_request` for the
    /// v1 or v2 model runner).
    pub make_new: Py<PyAny>,
    /// `time.monotonic`.
    pub monotonic: Py<PyAny>,
    /// `hash_name_of(block_hasher) -> str | None`: vLLM's hash function's name when the
    /// request's hasher is vLLM's own at this hash block size (then the loop hashes natively).
    pub hash_name_of: Py<PyAny>,
    /// `SchedulingPolicy.PRIORITY`.
    pub priority: Py<PyAny>,
    /// `observe_spec_metrics(sched, metrics, proposed, accepted)`: a request's own
    /// `spec_decode_metrics.observe`, as vLLM's `update_from_output` calls it.
    pub observe_spec_metrics: Py<PyAny>,
    /// `spec_decoding_stats(num_spec_tokens, drafts, draft_tokens, accepted, accepted_per_pos,
    /// draft_per_pos)`: vLLM's `SpecDecodingStats` with those fields.
    pub spec_decoding_stats: Py<PyAny>,
    /// The code of vLLM's own `Scheduler._mamba_block_aligned_split` (`None`: the class
    /// holds another's; every split is then the scheduler's own call).
    pub vllm_mamba_split_code: Option<Py<PyAny>>,
    /// `grammar_manager_kind(manager) -> 0 | 1 | 2`: how a step advances grammars with the
    /// structured-output manager (`crate::vllm_v1::grammar::Acceptor`).
    pub grammar_manager_kind: Py<PyAny>,
    /// The scheduler's `ConnectorSteps` (`pagedkv.vllm_v1._connector`; `None`: no KV
    /// connector), called by `crate::vllm_v1::connector`.
    pub connector: Option<Py<PyAny>>,
    pub output: OutputShape,
}

/// `EngineCoreOutput`, built positionally: its defaults, and where each field vLLM sets is.
pub struct OutputShape {
    pub cls: Py<PyAny>,
    pub defaults: Vec<Py<PyAny>>,
    pub request_id: usize,
    pub new_token_ids: usize,
    pub finish_reason: usize,
    pub new_logprobs: usize,
    /// Absent from a class without sampling masks (then a mask cannot be returned).
    pub new_sampling_mask: Option<usize>,
    pub new_prompt_logprobs_tensors: usize,
    pub prompt_token_id_logprobs: Option<usize>,
    /// `spec_decode_metrics` (a finished request's own metrics, where it keeps them).
    pub spec_decode_metrics: Option<usize>,
    pub stop_reason: usize,
    pub events: usize,
    pub prefill_stats: usize,
    /// Absent from a class without KV transfer (then no connector's parameters can be
    /// returned).
    pub kv_transfer_params: Option<usize>,
    pub trace_headers: usize,
    pub num_nans_in_logits: usize,
    /// Absent from a class without pooling (then no pooler output can be returned).
    pub pooling_output: Option<usize>,
}

#[pyclass(module = "pagedkv._native", name = "V1Loop", frozen)]
pub struct PyV1Loop {
    /// The KV cache manager: one group or hybrid (`crate::vllm_v1::loop_kv`).
    pub kv: LoopKv,
    pub objs: Objects,
    /// The release and scheduler kind (decided at construction).
    mode: Mode,
    pub hash_block_size: u64,
    /// vLLM 0.33's `num_hash_lookahead_tokens` (0 on 0.32): a streaming session's hashes are
    /// recomputed at its prefix lookup when it is nonzero (see `PyEngine::prefix_hit`).
    pub hash_lookahead: u64,
    /// Tokens the KV cache holds (null block excluded): the length cap is
    /// `policy::length_cap(max_model_len, pool_tokens)`, so no request outgrows the cache.
    pub pool_tokens: u64,
    /// `speculative_config.max_num_new_slots_for_drafting` (0 without speculative decoding).
    pub draft_slots: u64,
    /// The fixed fields of the requests the last call saw (see [`Fixed`]).
    fixed: std::sync::Mutex<FixedMap>,
    /// A call is running (a callback into Python that calls the loop again is refused).
    busy: std::sync::atomic::AtomicBool,
}

impl PyV1Loop {
    /// Mark the loop busy and take the fixed fields the last call saw.
    pub fn take_fixed(&self) -> PyResult<FixedMap> {
        if self.busy.swap(true, std::sync::atomic::Ordering::Acquire) {
            return Err(crate::errors::busy("this V1Loop"));
        }
        Ok(match self.fixed.try_lock() {
            Ok(mut m) => std::mem::take(&mut *m),
            Err(_) => FixedMap::default(),
        })
    }

    /// Store the fixed fields for the next call; the loop is free again.
    pub fn give_back_fixed(&self, map: FixedMap) {
        if let Ok(mut m) = self.fixed.try_lock() {
            *m = map;
        }
        self.busy.store(false, std::sync::atomic::Ordering::Release);
    }
}

/// Keyed by object address, hashed with foldhash (an address needs its high bits mixed down:
/// objects are aligned and share a heap region).
pub type FixedMap = std::collections::HashMap<usize, Arc<Fixed>, foldhash::fast::RandomState>;

/// What the loop reads of a request that does not change while the request is in scope
/// (vLLM sets these at construction). A streaming session's update replaces them
/// (`_update_request_as_session`: prompt, `max_tokens`, sampling parameters, multimodal
/// inputs), between calls or within `update_from_output` after the session's last read there:
/// a session's entry is read afresh by every call (`session`). Kept for the requests of the
/// last call only, keyed by the request's address; the entry holds the request, so the address
/// cannot be reused while it exists.
pub struct Fixed {
    _request: Py<PyAny>,
    pub id: Py<PyString>,
    /// The id's text (the manager's key).
    pub rid: Box<str>,
    pub all: Py<PyList>,
    pub outs: Py<PyList>,
    pub num_prompt: u64,
    pub max_tokens: u64,
    /// `block_hashes` when the request has a block hasher.
    pub hashes: Option<Py<PyAny>>,
    /// The hash function when that hasher is vLLM's own, with the request's extra keys,
    /// where the native encoding covers them (see `crate::vllm_v1::hash`).
    pub hash_fn: Option<(HashFn, RequestKeys)>,
    pub rule: StopRule,
    pub client: i64,
    /// `lora_request.lora_int_id` (`None`: no LoRA).
    pub lora: Option<i64>,
    /// `use_structured_output`.
    pub structured: bool,
    /// `has_encoder_inputs` (multimodal inputs).
    pub mm: bool,
    /// `trace_headers` (set at construction, never replaced in scope).
    pub trace_headers: Py<PyAny>,
    /// `resumable` when read: a streaming session, whose entry no later call reuses.
    pub session: bool,
    /// `pooling_params` is set: a pooling request (no sampling parameters).
    pub pooling: bool,
}

impl Fixed {
    pub fn read(request: &Bound<'_, PyAny>, objs: &Objects) -> PyResult<Self> {
        let py = request.py();
        let hasher = request.getattr(intern!(py, "_block_hasher"))?;
        let hashing = !hasher.is_none();
        let lora = request.getattr(intern!(py, "lora_request"))?;
        // Extra keys past the first block the native encoding does not cover (multimodal
        // inputs, prompt embeddings, unusual LoRA strings): vLLM's hasher runs.
        let keys = match hashing {
            true => crate::vllm_v1::hash::request_keys(request)?,
            false => None,
        };
        let hash_fn = match keys {
            Some(keys) => {
                let name = objs.hash_name_of.bind(py).call1((&hasher,))?;
                match name.is_none() {
                    true => None,
                    false => HashFn::parse(&name.extract::<String>()?).map(|f| (f, keys)),
                }
            }
            None => None,
        };
        let id = request
            .getattr(intern!(py, "request_id"))?
            .cast_into::<PyString>()?;
        Ok(Fixed {
            _request: request.clone().unbind(),
            rid: id.to_cow()?.into(),
            id: id.unbind(),
            all: request
                .getattr(intern!(py, "_all_token_ids"))?
                .cast_into::<PyList>()?
                .unbind(),
            outs: request
                .getattr(intern!(py, "_output_token_ids"))?
                .cast_into::<PyList>()?
                .unbind(),
            num_prompt: get_u64(request, intern!(py, "num_prompt_tokens"))?,
            max_tokens: get_u64(request, intern!(py, "max_tokens"))?,
            hashes: if hashing {
                Some(request.getattr(intern!(py, "block_hashes"))?.unbind())
            } else {
                None
            },
            hash_fn,
            rule: stop_rule(request)?,
            client: request.getattr(intern!(py, "client_index"))?.extract()?,
            lora: match lora.is_none() {
                true => None,
                false => Some(lora.getattr(intern!(py, "lora_int_id"))?.extract()?),
            },
            structured: !request
                .getattr(intern!(py, "structured_output_request"))?
                .is_none(),
            mm: request
                .getattr(intern!(py, "has_encoder_inputs"))?
                .is_truthy()?,
            trace_headers: request.getattr(intern!(py, "trace_headers"))?.unbind(),
            session: request.getattr(intern!(py, "resumable"))?.is_truthy()?,
            pooling: !request.getattr(intern!(py, "pooling_params"))?.is_none(),
        })
    }
}

fn item<'py>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Bound<'py, PyAny>> {
    d.get_item(key)?
        .ok_or_else(|| crate::errors::invalid(format!("V1Loop: missing {key:?}")))
}

fn field_index(fields: &[String], name: &str) -> PyResult<usize> {
    fields
        .iter()
        .position(|f| f == name)
        .ok_or_else(|| crate::errors::invalid(format!("EngineCoreOutput has no field {name:?}")))
}

impl OutputShape {
    fn new(d: &Bound<'_, PyDict>) -> PyResult<Self> {
        let fields: Vec<String> = item(d, "output_fields")?.extract()?;
        let defaults: Vec<Py<PyAny>> = item(d, "output_defaults")?.extract()?;
        if defaults.len() != fields.len() {
            return Err(crate::errors::invalid(
                "output_defaults must match output_fields",
            ));
        }
        let at = |n: &str| field_index(&fields, n);
        Ok(OutputShape {
            cls: item(d, "output_cls")?.unbind(),
            request_id: at("request_id")?,
            new_token_ids: at("new_token_ids")?,
            finish_reason: at("finish_reason")?,
            new_logprobs: at("new_logprobs")?,
            new_sampling_mask: at("new_sampling_mask").ok(),
            new_prompt_logprobs_tensors: at("new_prompt_logprobs_tensors")?,
            prompt_token_id_logprobs: at("prompt_token_id_logprobs").ok(),
            spec_decode_metrics: at("spec_decode_metrics").ok(),
            stop_reason: at("stop_reason")?,
            events: at("events")?,
            prefill_stats: at("prefill_stats")?,
            kv_transfer_params: at("kv_transfer_params").ok(),
            trace_headers: at("trace_headers")?,
            num_nans_in_logits: at("num_nans_in_logits")?,
            pooling_output: at("pooling_output").ok(),
            defaults,
        })
    }
}

#[pymethods]
impl PyV1Loop {
    /// `manager`: the native manager (`V1Manager`, or `V1Hybrid` for several KV cache
    /// groups); `config`: the scheduler's settings and vLLM's objects (see `_native_loop.py`).
    #[new]
    fn new(manager: &Bound<'_, PyAny>, config: &Bound<'_, PyDict>) -> PyResult<Self> {
        let kv = LoopKv::new(manager)?;
        let d = config;
        let get_bool = |k: &str| -> PyResult<bool> {
            item(d, k)?
                .extract()
                .map_err(|_| crate::errors::wrong_type(format!("V1Loop: {k:?} must be a bool")))
        };
        let release = match get_bool("release_033")? {
            true => Release::V033,
            false => Release::V032,
        };
        let hash_block_size = item(d, "hash_block_size")?
            .extract::<crate::args::SatCount>()?
            .0
            .max(1);
        let async_scheduling = get_bool("async_scheduling")?;
        let decode_stagger = item(d, "decode_stagger")?
            .extract::<crate::args::SatCount>()?
            .0;
        let pool_tokens = item(d, "pool_tokens")?
            .extract::<crate::args::SatCount>()?
            .0;
        let draft_slots = item(d, "draft_slots")?
            .extract::<crate::args::SatCount>()?
            .0;
        let hash_lookahead = item(d, "num_hash_lookahead_tokens")?
            .extract::<crate::args::SatCount>()?
            .0;
        let event = item(d, "event_scheduled")?;
        let objs = Objects {
            waiting: item(d, "WAITING")?.unbind(),
            running: item(d, "RUNNING")?.unbind(),
            preempted_value: item(d, "PREEMPTED")?.extract()?,
            preempted: item(d, "PREEMPTED")?.unbind(),
            stopped: item(d, "FINISHED_STOPPED")?.unbind(),
            length_capped: item(d, "FINISHED_LENGTH_CAPPED")?.unbind(),
            finished_error: item(d, "FINISHED_ERROR")?.unbind(),
            finished_repetition: item(d, "FINISHED_REPETITION")?.unbind(),
            reason_stop: item(d, "reason_stop")?.unbind(),
            reason_length: item(d, "reason_length")?.unbind(),
            reason_error: item(d, "reason_error")?.unbind(),
            reason_repetition: item(d, "reason_repetition")?.unbind(),
            event_scheduled: (!event.is_none()).then(|| event.unbind()),
            make_new: item(d, "make_new")?.unbind(),
            priority: item(d, "PRIORITY")?.unbind(),
            monotonic: item(d, "monotonic")?.unbind(),
            hash_name_of: item(d, "hash_name_of")?.unbind(),
            observe_spec_metrics: item(d, "observe_spec_metrics")?.unbind(),
            spec_decoding_stats: item(d, "spec_decoding_stats")?.unbind(),
            vllm_mamba_split_code: {
                let code = item(d, "vllm_mamba_split_code")?;
                (!code.is_none()).then(|| code.unbind())
            },
            grammar_manager_kind: item(d, "grammar_manager_kind")?.unbind(),
            connector: match d.get_item("connector_steps")? {
                Some(c) if !c.is_none() => Some(c.unbind()),
                _ => None,
            },
            output: OutputShape::new(d)?,
        };
        let mode = Mode {
            release,
            asynchronous: async_scheduling,
            decode_stagger,
        };
        Ok(PyV1Loop {
            kv,
            objs,
            mode,
            hash_block_size,
            hash_lookahead,
            pool_tokens,
            draft_slots,
            fixed: std::sync::Mutex::new(FixedMap::default()),
            busy: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// `Scheduler.schedule()` up to the `SchedulerOutput` constructor: returns
    /// `(new_reqs_data, cached, num_scheduled_tokens, total, scheduled_encoder_inputs,
    /// encoder_input_updates, has_structured_output_requests)` where `cached` is
    /// `(req_ids, resumed_req_ids, all_token_ids, new_block_ids, num_computed_tokens,
    /// num_output_tokens)` and `encoder_input_updates` is `None` when no multimodal request
    /// was scheduled (vLLM's would be empty), after applying `_update_after_schedule`'s
    /// request updates. The caller builds the output and replaces the finished and preempted
    /// id sets. `throttle_prefills`: `schedule()`'s (a data-parallel rank's off-cadence step).
    #[pyo3(signature = (sched, throttle_prefills=false))]
    fn schedule<'py>(
        &self,
        sched: &Bound<'py, PyAny>,
        throttle_prefills: bool,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let mut e = PyEngine::new(self, sched)?;
        Walk::new(&mut e, self.mode)?.schedule(throttle_prefills)
    }

    /// `Scheduler.update_from_output()`'s per-request part: returns `([(client_index,
    /// [EngineCoreOutput, ...]), ...], spec_decoding_stats)` in vLLM's order, after appending tokens, stopping and
    /// freeing finished requests and removing them from `running`. The caller publishes KV
    /// events and builds `EngineCoreOutputs` with the stats. `failed`: the requests whose KV
    /// load failed this step (vLLM's `failed_kv_load_req_ids`; their rows take nothing).
    #[pyo3(signature = (sched, scheduler_output, model_runner_output, failed=None))]
    fn update<'py>(
        &self,
        sched: &Bound<'py, PyAny>,
        scheduler_output: &Bound<'py, PyAny>,
        model_runner_output: &Bound<'py, PyAny>,
        failed: Option<Bound<'py, pyo3::types::PySet>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let masks = sched
            .getattr(intern!(sched.py(), "return_sampling_mask"))?
            .is_truthy()?;
        let mut e = PyEngine::new(self, sched)?;
        e.io = Some(UpdateIo {
            scheduler_output: scheduler_output.clone(),
            mro: ModelOutput::read(model_runner_output, masks)?,
            outputs: Vec::new(),
            spec: None,
            grammar: None,
            failed: failed.filter(|f| !f.is_empty()),
        });
        Walk::new(&mut e, self.mode)?.update_from_output()?;
        let py = sched.py();
        let (outputs, spec) = match e.io.take() {
            Some(io) => (io.outputs, io.spec),
            None => (Vec::new(), None),
        };
        let stats = crate::vllm_v1::drafts::stats_object(py, self, spec)?;
        PyTuple::new(py, [PyList::new(py, outputs)?.into_any(), stats])
    }

    /// `Scheduler.update_draft_token_ids` (`crate::vllm_v1::drafts::update_draft_token_ids`).
    fn update_draft_token_ids(
        &self,
        sched: &Bound<'_, PyAny>,
        req_ids: &Bound<'_, PyAny>,
        draft_token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        crate::vllm_v1::drafts::update_draft_token_ids(&self.objs, sched, req_ids, draft_token_ids)
    }

    /// `policy::refuses_prompt` at this cache's length cap: a prompt of `num_prompt` tokens
    /// that `add_request` finishes with an error (`sampled_per_step`: 0 for a pooling model).
    /// Counts saturate past u64 (Python ints are unbounded); a negative one is refused.
    fn refuses_prompt(
        &self,
        num_prompt: SatCount,
        max_model_len: SatCount,
        sampled_per_step: SatCount,
    ) -> bool {
        policy::refuses_prompt(
            num_prompt.0,
            policy::length_cap(max_model_len.0, self.pool_tokens),
            sampled_per_step.0,
        )
    }

    /// `policy::length_cap` for this cache: what the scheduler's `max_model_len` becomes, so
    /// that vLLM's own loop (its running room and `check_stop`) applies it too.
    fn length_cap(&self, max_model_len: SatCount) -> u64 {
        policy::length_cap(max_model_len.0, self.pool_tokens)
    }
}

fn stop_rule(request: &Bound<'_, PyAny>) -> PyResult<StopRule> {
    let py = request.py();
    let params = request.getattr(intern!(py, "sampling_params"))?;
    if params.is_none() {
        // A pooling request: `max_tokens` (1) is its only rule; it stops at its pooler output.
        return Ok(StopRule {
            eos_token_id: None,
            stop_token_ids: Vec::new(),
            max_tokens: get_u64(request, intern!(py, "max_tokens"))?,
            min_tokens: 0,
            repetition: None,
        });
    }
    let eos = params.getattr(intern!(py, "eos_token_id"))?;
    let stops = params.getattr(intern!(py, "stop_token_ids"))?;
    let rep = params.getattr(intern!(py, "repetition_detection"))?;
    Ok(StopRule {
        eos_token_id: if eos.is_none() {
            None
        } else {
            Some(eos.extract()?)
        },
        stop_token_ids: if stops.is_none() {
            Vec::new()
        } else {
            stops.extract()?
        },
        max_tokens: get_u64(request, intern!(py, "max_tokens"))?,
        min_tokens: get_u64(&params, intern!(py, "min_tokens"))?,
        repetition: match rep.is_none() {
            true => None,
            false => Some(repetition(&rep)?),
        },
    })
}

/// `RepetitionDetectionParams` (a request whose fields do not fit i64 stays vLLM's:
/// `pagedkv.vllm_v1._scope.request_out_of_scope`).
fn repetition(rep: &Bound<'_, PyAny>) -> PyResult<Repetition> {
    let field = |name: &Bound<'_, PyString>| -> PyResult<i64> { rep.getattr(name)?.extract() };
    let py = rep.py();
    Ok(Repetition {
        min_pattern_size: field(intern!(py, "min_pattern_size"))?,
        max_pattern_size: field(intern!(py, "max_pattern_size"))?,
        min_count: field(intern!(py, "min_count"))?,
    })
}

fn get_u64(obj: &Bound<'_, PyAny>, name: &Bound<'_, PyString>) -> PyResult<u64> {
    obj.getattr(name)?.extract()
}
