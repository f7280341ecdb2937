//! `V1Loop`: vLLM v1's `Scheduler.schedule()` and `update_from_output()` for the in-scope
//! path, walking vLLM's own objects: the scheduler's `running` list and `waiting` queue, its
//! `Request`s (fields read and written in place, tokens appended to their own lists) and
//! pagedkv's native KV manager (called in Rust, no Python frame per request).
//!
//! There is no second copy of any state: everything the loop decides is written where vLLM's
//! loop writes it, so vLLM's Python loop can run the next step (the per-step switch in
//! `pagedkv.vllm_v1._native_loop`). The rules are `pagedkv_core::v1::policy`; this file reads
//! their inputs, applies their answers, and builds what leaves the scheduler. Rare events run
//! vLLM's own methods: `_preempt_request`, `_free_request`, the prefix lookup
//! (`_get_local_prefix_cache_hit`), `record_prefix_cache_stats`, `NewRequestData.from_request`.
//!
//! Cost per step: O(scheduled requests) attribute reads and writes plus one list append per
//! sampled token; one Python call per admitted, preempted or finished request.

use crate::v1_call::SlotArgs;
use crate::v1_hash::extend_block_hashes;
use crate::v1_manager::PyV1Manager;
use pagedkv_core::v1::block_hash::HashFn;
use pagedkv_core::v1::policy::{self, Budget, Limits, RunningRow, Stop, StopRule};
use pagedkv_core::v1::SlotRequest;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet, PyString, PyTuple};

/// The Python objects the loop compares against or builds with (bound once).
struct Objects {
    waiting: Py<PyAny>,
    running: Py<PyAny>,
    preempted: Py<PyAny>,
    stopped: Py<PyAny>,
    length_capped: Py<PyAny>,
    /// `RequestStatus.PREEMPTED`'s integer value: statuses above it are finished.
    preempted_value: i64,
    reason_stop: Py<PyAny>,
    reason_length: Py<PyAny>,
    /// `EngineCoreEventType.SCHEDULED` (`None`: stats off, no request events).
    event_scheduled: Option<Py<PyAny>>,
    /// `make_new(request, block_ids, v2) -> NewRequestData` (vLLM's `from_request` for the
    /// v1 or v2 model runner).
    make_new: Py<PyAny>,
    /// `time.monotonic`.
    monotonic: Py<PyAny>,
    /// `hash_name_of(block_hasher) -> str | None`: vLLM's hash function's name when the
    /// request's hasher is vLLM's own at this hash block size (then the loop hashes natively).
    hash_name_of: Py<PyAny>,
    /// `SchedulingPolicy.PRIORITY`.
    priority: Py<PyAny>,
    output: OutputShape,
}

/// `EngineCoreOutput`, built positionally: its defaults, and where each field vLLM sets is.
struct OutputShape {
    cls: Py<PyAny>,
    defaults: Vec<Py<PyAny>>,
    request_id: usize,
    new_token_ids: usize,
    finish_reason: usize,
    new_logprobs: usize,
    new_prompt_logprobs_tensors: usize,
    prompt_token_id_logprobs: Option<usize>,
    stop_reason: usize,
    events: usize,
    prefill_stats: usize,
    trace_headers: usize,
    num_nans_in_logits: usize,
}

/// Release switches (vLLM 0.32 vs 0.33) and engine settings the walk needs.
#[derive(Clone, Copy)]
struct Settings {
    limits: Limits,
    max_num_scheduled_tokens: u64,
    max_num_batched_tokens: u64,
    max_num_active_reqs: usize,
    max_num_running_reqs: usize,
    priority: bool,
    /// 0.33: a PRIORITY request that preempted itself lets the loop go on (0.32 breaks);
    /// a stop trims `num_computed_tokens`; `num_executed_steps` counts steps.
    release_033: bool,
    reserve_full_isl: bool,
    v2_model_runner: bool,
    hash_block_size: u64,
}

#[pyclass(module = "pagedkv._native", name = "V1Loop", frozen)]
pub struct PyV1Loop {
    manager: Py<PyV1Manager>,
    objs: Objects,
    /// Release switches and what cannot change after construction.
    release_033: bool,
    hash_block_size: u64,
    /// `AsyncScheduler`: output placeholders; `decode_stagger` (v2 model runner) with it.
    async_scheduling: bool,
    decode_stagger: u64,
    /// Tokens the KV cache holds (null block excluded): the length cap is
    /// `policy::length_cap(max_model_len, pool_tokens)`, so no request outgrows the cache.
    pool_tokens: u64,
    /// The fixed fields of the requests the last call saw (see [`Fixed`]).
    fixed: std::sync::Mutex<FixedMap>,
    /// A call is running (a callback into Python that calls the loop again is refused).
    busy: std::sync::atomic::AtomicBool,
}

/// One call's walk: the loop, the scheduler's settings read at the call's start (vLLM's
/// loop reads them from the scheduler each step too), and the fixed fields of the requests.
struct Walk<'a> {
    lp: &'a PyV1Loop,
    set: Settings,
    /// The loop's fixed-field entries, taken for the call and stored back at its end.
    map: std::cell::RefCell<FixedMap>,
}

/// Keyed by object address, hashed with foldhash (an address needs its high bits mixed down:
/// objects are aligned and share a heap region).
type FixedMap = std::collections::HashMap<usize, Fixed, foldhash::fast::RandomState>;

/// What the loop reads of a request that does not change while the request is in scope
/// (vLLM sets these at construction; only streaming sessions, outside the native path,
/// replace them). Kept for the requests of the last call only, keyed by the request's
/// address; the entry holds the request, so the address cannot be reused while it exists.
struct Fixed {
    _request: Py<PyAny>,
    id: Py<PyString>,
    /// The id's text (the manager's key).
    rid: Box<str>,
    all: Py<PyList>,
    outs: Py<PyList>,
    num_prompt: u64,
    max_tokens: u64,
    /// `block_hashes` when the request has a block hasher.
    hashes: Option<Py<PyAny>>,
    /// The hash function when that hasher is vLLM's own (see `crate::v1_hash`).
    hash_fn: Option<HashFn>,
    rule: StopRule,
    client: i64,
    /// `trace_headers` (set at construction, never replaced in scope).
    trace_headers: Py<PyAny>,
}

impl Fixed {
    fn read(request: &Bound<'_, PyAny>, objs: &Objects) -> PyResult<Self> {
        let py = request.py();
        let hasher = request.getattr(intern!(py, "_block_hasher"))?;
        let hashing = !hasher.is_none();
        let hash_fn = if hashing {
            let name = objs.hash_name_of.bind(py).call1((&hasher,))?;
            match name.is_none() {
                true => None,
                false => HashFn::parse(&name.extract::<String>()?),
            }
        } else {
            None
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
            trace_headers: request.getattr(intern!(py, "trace_headers"))?.unbind(),
        })
    }
}

impl Walk<'_> {
    /// The request's fixed fields (read now if the last call did not see it), kept for the
    /// next call when `keep`.
    fn fixed<R>(&self, request: &Bound<'_, PyAny>, f: impl FnOnce(&Fixed) -> R) -> PyResult<R> {
        let key = request.as_ptr() as usize;
        if let Some(e) = self.map.borrow().get(&key) {
            return Ok(f(e));
        }
        let entry = Fixed::read(request, &self.lp.objs)?;
        let out = f(&entry);
        self.map.borrow_mut().insert(key, entry);
        Ok(out)
    }

    /// Drop the entry of a request that left the scheduler.
    fn forget(&self, request: &Bound<'_, PyAny>) {
        self.map.borrow_mut().remove(&(request.as_ptr() as usize));
    }

    /// Entries outlive requests only when they leave outside the loop (aborts, vLLM's
    /// loop): beyond twice the live requests (plus slack) the map starts afresh.
    fn prune(&self, live: usize) {
        let mut m = self.map.borrow_mut();
        if m.len() > 2 * live + 256 {
            m.clear();
        }
    }
}

impl Drop for Walk<'_> {
    /// Hand the entries this call saw to the next call; the loop is free again.
    fn drop(&mut self) {
        if let Ok(mut m) = self.lp.fixed.try_lock() {
            *m = self.map.take();
        }
        self.lp
            .busy
            .store(false, std::sync::atomic::Ordering::Release);
    }
}

impl PyV1Loop {
    fn walk<'py>(&self, sched: &Bound<'py, PyAny>) -> PyResult<Walk<'_>> {
        let py = sched.py();
        let cfg = sched.getattr(intern!(py, "scheduler_config"))?;
        let u = |o: &Bound<'py, PyAny>, name: &Bound<'py, PyString>| -> PyResult<u64> {
            o.getattr(name)?.extract()
        };
        let flag = |o: &Bound<'py, PyAny>, name: &Bound<'py, PyString>| -> PyResult<bool> {
            match o.getattr(name) {
                Ok(v) => v.is_truthy(),
                Err(_) => Ok(false),
            }
        };
        let limits = Limits {
            max_model_len: policy::length_cap(
                u(sched, intern!(py, "max_model_len"))?,
                self.pool_tokens,
            ),
            long_prefill_token_threshold: u(&cfg, intern!(py, "long_prefill_token_threshold"))?,
            adaptive_threshold: flag(sched, intern!(py, "adaptive_long_prefill_threshold"))?,
            chunked_prefill: flag(&cfg, intern!(py, "enable_chunked_prefill"))?,
            sampled_per_step: 1,
        };
        let running = u(sched, intern!(py, "max_num_running_reqs"))?;
        let active = match sched.getattr(intern!(py, "max_num_active_reqs")) {
            Ok(v) => v.extract()?,
            Err(_) => running,
        };
        let policy = sched.getattr(intern!(py, "policy"))?;
        let set = Settings {
            limits,
            max_num_scheduled_tokens: u(sched, intern!(py, "max_num_scheduled_tokens"))?,
            max_num_batched_tokens: u(&cfg, intern!(py, "max_num_batched_tokens"))?,
            max_num_active_reqs: active as usize,
            max_num_running_reqs: running as usize,
            priority: policy.eq(self.objs.priority.bind(py))?,
            release_033: self.release_033,
            reserve_full_isl: flag(sched, intern!(py, "scheduler_reserve_full_isl"))?,
            v2_model_runner: flag(sched, intern!(py, "use_v2_model_runner"))?,
            hash_block_size: self.hash_block_size,
        };
        if self.busy.swap(true, std::sync::atomic::Ordering::Acquire) {
            return Err(crate::errors::busy("this V1Loop"));
        }
        let old = match self.fixed.try_lock() {
            Ok(mut m) => std::mem::take(&mut *m),
            Err(_) => FixedMap::default(),
        };
        Ok(Walk {
            lp: self,
            set,
            map: std::cell::RefCell::new(old),
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
            new_prompt_logprobs_tensors: at("new_prompt_logprobs_tensors")?,
            prompt_token_id_logprobs: at("prompt_token_id_logprobs").ok(),
            stop_reason: at("stop_reason")?,
            events: at("events")?,
            prefill_stats: at("prefill_stats")?,
            trace_headers: at("trace_headers")?,
            num_nans_in_logits: at("num_nans_in_logits")?,
            defaults,
        })
    }
}

/// One scheduled row of this step: the request, its id, its tokens and its new blocks
/// (`None`: none new; a resumed or new request carries its whole table).
struct Row<'py> {
    request: Bound<'py, PyAny>,
    id: Bound<'py, PyString>,
    tokens: u64,
    blocks: Option<Vec<u32>>,
    /// Admitted from `PREEMPTED` (a resumed request) rather than `WAITING`.
    resumed: bool,
    /// `_all_token_ids` (the request's own list).
    all: Bound<'py, PyList>,
    /// `num_computed_tokens` before this step's advance.
    computed: u64,
    placeholders: u64,
}

#[pymethods]
impl PyV1Loop {
    /// `config`: the scheduler's settings and vLLM's objects (see `_native_loop.py`).
    #[new]
    fn new(manager: Py<PyV1Manager>, config: &Bound<'_, PyDict>) -> PyResult<Self> {
        let d = config;
        let get_bool = |k: &str| -> PyResult<bool> {
            item(d, k)?
                .extract()
                .map_err(|_| crate::errors::wrong_type(format!("V1Loop: {k:?} must be a bool")))
        };
        let release_033 = get_bool("release_033")?;
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
        let event = item(d, "event_scheduled")?;
        let objs = Objects {
            waiting: item(d, "WAITING")?.unbind(),
            running: item(d, "RUNNING")?.unbind(),
            preempted_value: item(d, "PREEMPTED")?.extract()?,
            preempted: item(d, "PREEMPTED")?.unbind(),
            stopped: item(d, "FINISHED_STOPPED")?.unbind(),
            length_capped: item(d, "FINISHED_LENGTH_CAPPED")?.unbind(),
            reason_stop: item(d, "reason_stop")?.unbind(),
            reason_length: item(d, "reason_length")?.unbind(),
            event_scheduled: (!event.is_none()).then(|| event.unbind()),
            make_new: item(d, "make_new")?.unbind(),
            priority: item(d, "PRIORITY")?.unbind(),
            monotonic: item(d, "monotonic")?.unbind(),
            hash_name_of: item(d, "hash_name_of")?.unbind(),
            output: OutputShape::new(d)?,
        };
        Ok(PyV1Loop {
            manager,
            objs,
            release_033,
            hash_block_size,
            async_scheduling,
            decode_stagger,
            pool_tokens,
            fixed: std::sync::Mutex::new(FixedMap::default()),
            busy: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// `Scheduler.schedule()` up to the `SchedulerOutput` constructor: returns
    /// `(new_reqs_data, cached, num_scheduled_tokens, total)` where `cached` is
    /// `(req_ids, resumed_req_ids, all_token_ids, new_block_ids, num_computed_tokens,
    /// num_output_tokens)`, after applying `_update_after_schedule`'s request updates. The
    /// caller builds the output and replaces the finished and preempted id sets.
    fn schedule<'py>(&self, sched: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyTuple>> {
        self.walk(sched)?.schedule(sched)
    }

    /// `Scheduler.update_from_output()`'s per-request part: returns `[(client_index,
    /// [EngineCoreOutput, ...]), ...]` in vLLM's order, after appending tokens, stopping and
    /// freeing finished requests and removing them from `running`. The caller publishes KV
    /// events and builds `EngineCoreOutputs` with the stats.
    fn update<'py>(
        &self,
        sched: &Bound<'py, PyAny>,
        scheduler_output: &Bound<'py, PyAny>,
        model_runner_output: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        self.walk(sched)?
            .update(sched, scheduler_output, model_runner_output)
    }

    /// `policy::refuses_prompt` at this cache's length cap: a prompt of `num_prompt` tokens
    /// that `add_request` finishes with an error.
    fn refuses_prompt(&self, num_prompt: u64, max_model_len: u64) -> bool {
        policy::refuses_prompt(
            num_prompt,
            policy::length_cap(max_model_len, self.pool_tokens),
        )
    }

    /// `policy::length_cap` for this cache: what the scheduler's `max_model_len` becomes, so
    /// that vLLM's own loop (its running room and `check_stop`) applies it too.
    fn length_cap(&self, max_model_len: u64) -> u64 {
        policy::length_cap(max_model_len, self.pool_tokens)
    }
}

/// What the running and waiting passes of one `schedule()` share: the scheduler, its queues,
/// the step's timestamp and its long-prefill threshold.
struct Queues<'py> {
    sched: Bound<'py, PyAny>,
    running: Bound<'py, PyList>,
    waiting: Bound<'py, PyAny>,
    ts: Bound<'py, PyAny>,
    threshold: u64,
}

/// A running request's objects read once per step.
struct Read<'py> {
    id: Bound<'py, PyString>,
    all: Bound<'py, PyList>,
    waiting_or_preempted: bool,
}

/// What `update_from_output` reads of the model runner's output.
struct ModelOutput<'py> {
    sampled: Bound<'py, PyAny>,
    has_sampled: bool,
    index: Bound<'py, PyDict>,
    logprobs: Bound<'py, PyAny>,
    /// The per-request dicts, when present and not empty.
    prompt_logprobs: Option<Bound<'py, PyDict>>,
    prompt_token_id_logprobs: Option<Bound<'py, PyDict>>,
    num_nans: Option<Bound<'py, PyDict>>,
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
    fn read(mro: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = mro.py();
        let sampled = mro.getattr(intern!(py, "sampled_token_ids"))?;
        Ok(ModelOutput {
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
        })
    }
}

/// One row's result: its output (if any is emitted) and, when it stopped, whether it was
/// running before.
struct RowUpdate<'py> {
    output: Option<Bound<'py, PyAny>>,
    stopped: Option<bool>,
}

fn get_u64(obj: &Bound<'_, PyAny>, name: &Bound<'_, PyString>) -> PyResult<u64> {
    obj.getattr(name)?.extract()
}

impl Walk<'_> {
    fn schedule<'py>(&self, sched: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyTuple>> {
        let py = sched.py();
        // Everything of the scheduler's the walk needs is read before anything is written.
        let step: u64 = sched.getattr(intern!(py, "current_step"))?.extract()?;
        let executed: Option<u64> = if self.set.release_033 {
            Some(get_u64(sched, intern!(py, "num_executed_steps"))?)
        } else {
            None
        };
        for name in [
            intern!(py, "deferred_waiting"),
            intern!(py, "_inflight_prefills"),
            intern!(py, "prev_step_scheduled_req_ids"),
        ] {
            sched.getattr(name)?;
        }
        let running = sched
            .getattr(intern!(py, "running"))?
            .cast_into::<PyList>()?;
        let waiting = sched.getattr(intern!(py, "waiting"))?;
        let kv_holding = sched.getattr(intern!(py, "kv_holding_waiting"))?.len()?;
        let num_eligible = (running.len() + waiting.len()? + kv_holding) as u64;
        self.prune(num_eligible as usize);
        let ts = self.lp.objs.monotonic.bind(py).call0()?;
        sched.setattr(intern!(py, "current_step"), step + 1)?;
        let mut budget = Budget {
            tokens: self.set.max_num_scheduled_tokens,
            input: self.set.max_num_batched_tokens,
        };
        let threshold =
            policy::long_prefill_threshold(&self.set.limits, num_eligible, budget.input);
        let mut rows: Vec<Row<'py>> = Vec::with_capacity(running.len());
        let queues = Queues {
            sched: sched.clone(),
            running: running.clone(),
            waiting,
            ts,
            threshold,
        };
        let preempted = self.running_pass(&queues, &mut budget, &mut rows)?;
        let num_running_rows = rows.len();
        if !preempted {
            self.waiting_pass(&queues, &mut budget, &mut rows)?;
        }
        let total: u64 = rows.iter().map(|r| r.tokens).sum();
        if let (Some(n), true) = (executed, total > 0) {
            sched.setattr(intern!(py, "num_executed_steps"), n + 1)?;
        }
        if running.len() > self.set.max_num_running_reqs {
            return Err(crate::errors::invalid(
                "more running requests than max_num_seqs",
            ));
        }
        // `num_scheduled_tokens` keeps scheduling order (running rows, then admissions).
        let scheduled = PyDict::new(py);
        for r in &rows {
            scheduled.set_item(&r.id, r.tokens)?;
        }
        let (running_rows, admitted) = rows.split_at(num_running_rows);
        let mut new: Vec<&Row<'py>> = admitted.iter().filter(|r| !r.resumed).collect();
        let mut resumed: Vec<&Row<'py>> = admitted.iter().filter(|r| r.resumed).collect();
        if self.set.v2_model_runner {
            new.append(&mut resumed);
        }
        let new_data = self.new_requests_data(py, &new)?;
        let cached_rows: Vec<&Row<'py>> = running_rows.iter().collect();
        let cached = self.cached_request_data(sched, &cached_rows, &resumed)?;
        if !self.set.v2_model_runner {
            let prev = sched.getattr(intern!(py, "prev_step_scheduled_req_ids"))?;
            let prev = prev.cast::<PySet>()?;
            prev.clear();
            for r in &rows {
                prev.add(&r.id)?;
            }
        }
        self.after_schedule(sched, &rows)?;
        (new_data, cached, scheduled, total).into_pyobject(py)
    }

    fn update<'py>(
        &self,
        sched: &Bound<'py, PyAny>,
        scheduler_output: &Bound<'py, PyAny>,
        model_runner_output: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = sched.py();
        let mro = ModelOutput::read(model_runner_output)?;
        let requests = sched
            .getattr(intern!(py, "requests"))?
            .cast_into::<PyDict>()?;
        let scheduled = scheduler_output
            .getattr(intern!(py, "num_scheduled_tokens"))?
            .cast_into::<PyDict>()?;
        let mut outputs: Vec<(i64, Bound<'py, PyList>)> = Vec::new();
        let mut stopped_running: Vec<Bound<'py, PyAny>> = Vec::new();
        let mut stopped_other: Vec<Bound<'py, PyAny>> = Vec::new();
        for (id, n) in scheduled.iter() {
            let n: u64 = n.extract()?;
            let Some(request) = requests.get_item(&id)? else {
                continue;
            };
            let Some(out) = self.update_row(sched, &request, &id, n, &mro)? else {
                continue;
            };
            if let Some(output) = out.output {
                let client = self.fixed(&request, |f| f.client)?;
                match outputs.iter().find(|(c, _)| *c == client) {
                    Some((_, list)) => list.append(output)?,
                    None => outputs.push((client, PyList::new(py, [output])?)),
                }
            }
            if let Some(was_running) = out.stopped {
                self.forget(&request);
                if was_running {
                    stopped_running.push(request.clone());
                } else {
                    stopped_other.push(request.clone());
                }
            }
        }
        remove_stopped(sched, &stopped_running, &stopped_other)?;
        PyList::new(py, outputs)
    }

    /// The running loop: schedules running requests in order, preempting on allocation
    /// failure. Returns whether anything was preempted (then no waiting request is admitted).
    fn running_pass<'py>(
        &self,
        q: &Queues<'py>,
        budget: &mut Budget,
        rows: &mut Vec<Row<'py>>,
    ) -> PyResult<bool> {
        let (sched, running, ts, threshold) = (&q.sched, &q.running, &q.ts, q.threshold);
        let py = sched.py();
        let mut preempted_any = false;
        let mut i = 0;
        while i < running.len() && budget.tokens > 0 {
            if budget.input == 0 {
                break;
            }
            let request = running.get_item(i)?;
            let (row, read) = self.running_row(&request)?;
            let mut n = policy::running_tokens(&self.set.limits, &row, threshold, budget);
            if n > 0 && self.set.v2_model_runner && self.waits_for_decode_slot(sched, &request)? {
                n = 0;
            }
            if n == 0 {
                i += 1;
                continue;
            }
            let slots = SlotRequest {
                num_computed_tokens: row.num_computed_tokens,
                num_tokens: read.all.len() as u64,
                waiting_or_preempted: read.waiting_or_preempted,
                num_new_tokens: n,
                has_scheduled_reqs: true,
                ..SlotRequest::default()
            };
            let mut blocks = None;
            loop {
                let mgr = self.lp.manager.get();
                let got = self.fixed(&request, |f| {
                    mgr.allocate_prepared(py, &request, &f.rid, &slots)
                })?;
                if let Some(ids) = got? {
                    blocks = Some(ids);
                    break;
                }
                let victim = self.pick_victim(running, &mut i, rows, budget)?;
                sched.call_method1(intern!(py, "_preempt_request"), (&victim, ts))?;
                preempted_any = true;
                if victim.is(&request) {
                    break;
                }
            }
            let Some(ids) = blocks else {
                let status = request.getattr(intern!(py, "status"))?;
                if self.set.priority
                    && self.set.release_033
                    && status.is(self.lp.objs.preempted.bind(py))
                {
                    continue;
                }
                break;
            };
            budget.take(n);
            rows.push(Row {
                request,
                id: read.id,
                tokens: n,
                blocks: (!ids.is_empty()).then_some(ids),
                resumed: false,
                all: read.all,
                computed: row.num_computed_tokens,
                placeholders: row.num_output_placeholders,
            });
            i += 1;
        }
        Ok(preempted_any)
    }

    /// `request.num_output_placeholders`: always 0 under the synchronous scheduler (only
    /// vLLM's `AsyncScheduler` adds placeholders), so only the async one reads it.
    fn placeholders(&self, request: &Bound<'_, PyAny>) -> PyResult<u64> {
        if !self.lp.async_scheduling {
            return Ok(0);
        }
        get_u64(request, intern!(request.py(), "num_output_placeholders"))
    }

    /// v2 model runner with pipeline stagger: `current_step < next_decode_eligible_step`.
    fn waits_for_decode_slot(
        &self,
        sched: &Bound<'_, PyAny>,
        request: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let py = sched.py();
        let step = get_u64(sched, intern!(py, "current_step"))?;
        Ok(step < get_u64(request, intern!(py, "next_decode_eligible_step"))?)
    }

    fn running_row<'py>(&self, request: &Bound<'py, PyAny>) -> PyResult<(RunningRow, Read<'py>)> {
        let py = request.py();
        let (id, all, num_prompt, max_tokens) = self.fixed(request, |f| {
            (
                f.id.bind(py).clone(),
                f.all.bind(py).clone(),
                f.num_prompt,
                f.max_tokens,
            )
        })?;
        let status = request.getattr(intern!(py, "status"))?;
        let row = RunningRow {
            num_computed_tokens: get_u64(request, intern!(py, "num_computed_tokens"))?,
            // No drafts in scope (no speculative decoding: `engine_out_of_scope`), so
            // `spec_token_ids` is empty (the async scheduler's placeholder list included).
            num_tokens_with_spec: all.len() as u64,
            num_output_placeholders: self.placeholders(request)?,
            num_prompt_tokens: num_prompt,
            max_tokens,
        };
        let read = Read {
            id,
            all,
            waiting_or_preempted: status.is(self.lp.objs.waiting.bind(py))
                || status.is(self.lp.objs.preempted.bind(py)),
        };
        Ok((row, read))
    }

    /// Take the preemption victim out of `running` (FCFS: the last; PRIORITY: the first
    /// maximum of `(priority, arrival_time)`, giving back what it was scheduled this step).
    fn pick_victim<'py>(
        &self,
        running: &Bound<'py, PyList>,
        i: &mut usize,
        rows: &mut Vec<Row<'py>>,
        budget: &mut Budget,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = running.py();
        if !self.set.priority {
            let last = running.len() - 1;
            let victim = running.get_item(last)?;
            running.del_item(last)?;
            return Ok(victim);
        }
        let mut keys = Vec::with_capacity(running.len());
        for r in running.iter() {
            let p: i64 = r.getattr(intern!(py, "priority"))?.extract()?;
            let t: f64 = r.getattr(intern!(py, "arrival_time"))?.extract()?;
            keys.push((p, t));
        }
        let at = policy::priority_victim(keys).unwrap_or(0);
        let victim = running.get_item(at)?;
        running.del_item(at)?;
        if at < *i {
            *i -= 1;
        }
        if let Some(k) = rows.iter().position(|r| r.request.is(&victim)) {
            let row = rows.remove(k);
            budget.give_back(row.tokens);
        }
        Ok(victim)
    }

    /// The native manager's `allocate_slots` for `request` (block ids; `None`: no room).
    fn allocate<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        n: u64,
        num_computed: u64,
        computed: Option<Bound<'py, PyAny>>,
        full_sequence_must_fit: bool,
        has_scheduled_reqs: bool,
    ) -> PyResult<Option<Vec<u32>>> {
        let args = SlotArgs {
            num_new_tokens: n,
            num_new_computed_tokens: num_computed,
            new_computed_blocks: computed,
            num_lookahead_tokens: 0,
            num_external_computed_tokens: 0,
            delay_cache_blocks: false,
            num_encoder_tokens: 0,
            full_sequence_must_fit,
            reserved_blocks: 0,
            has_scheduled_reqs,
        };
        self.lp
            .manager
            .get()
            .allocate_ids(request.py(), request, &args)
    }

    /// The waiting loop: admits requests from the head of `waiting` while they fit.
    fn waiting_pass<'py>(
        &self,
        q: &Queues<'py>,
        budget: &mut Budget,
        rows: &mut Vec<Row<'py>>,
    ) -> PyResult<()> {
        let (sched, running, waiting) = (&q.sched, &q.running, &q.waiting);
        let py = sched.py();
        let deferred = sched.getattr(intern!(py, "deferred_waiting"))?;
        let skipped = PyList::empty(py);
        while budget.tokens > 0 {
            if waiting.len()? == 0 || budget.input == 0 {
                break;
            }
            if running.len() >= self.set.max_num_active_reqs {
                break;
            }
            let request = waiting.call_method0(intern!(py, "peek_request"))?;
            if self.has_deliverable_stale_output(&request)? {
                let r = waiting.call_method0(intern!(py, "pop_request"))?;
                deferred.call_method1(intern!(py, "add"), (&r,))?;
                skipped.insert(0, r)?;
                continue;
            }
            if !self.admit(q, &request, budget, rows)? {
                break;
            }
        }
        if !skipped.is_empty() {
            let deque = py
                .import("collections")?
                .getattr("deque")?
                .call1((skipped,))?;
            waiting.call_method1(intern!(py, "prepend_requests"), (deque,))?;
        }
        let kv_holding = sched.getattr(intern!(py, "kv_holding_waiting"))?.len()?;
        let bound = waiting.len()? + kv_holding > deferred.len()?;
        sched.setattr(intern!(py, "prefill_capacity_bound"), bound)
    }

    fn has_deliverable_stale_output(&self, request: &Bound<'_, PyAny>) -> PyResult<bool> {
        let py = request.py();
        let stale = get_u64(request, intern!(py, "num_stale_output_tokens"))?;
        Ok(stale > 0
            && !request
                .getattr(intern!(py, "drop_stale_output"))?
                .is_truthy()?)
    }

    /// Try to admit the head of `waiting`; false ends the waiting loop.
    fn admit<'py>(
        &self,
        q: &Queues<'py>,
        request: &Bound<'py, PyAny>,
        budget: &mut Budget,
        rows: &mut Vec<Row<'py>>,
    ) -> PyResult<bool> {
        let (sched, running, waiting) = (&q.sched, &q.running, &q.waiting);
        let (ts, threshold) = (&q.ts, q.threshold);
        let py = sched.py();
        let computed_before = get_u64(request, intern!(py, "num_computed_tokens"))?;
        let lookup = computed_before == 0;
        let (hit, num_local) = if lookup {
            self.prefix_hit(sched, request)?
        } else {
            (None, 0)
        };
        let num_computed = if lookup { num_local } else { computed_before };
        let (id, all) = self.fixed(request, |f| (f.id.bind(py).clone(), f.all.bind(py).clone()))?;
        let num_tokens = all.len() as u64;
        let Some(n) = policy::waiting_tokens(
            &self.set.limits,
            num_tokens,
            num_computed,
            threshold,
            budget,
        ) else {
            return Ok(false);
        };
        if n == 0 {
            return Err(crate::errors::invalid(
                "a waiting request with nothing to schedule",
            ));
        }
        let has_running = !running.is_empty();
        let full = self.set.reserve_full_isl;
        if self
            .allocate(request, n, num_local, hit, full, has_running)?
            .is_none()
        {
            return Ok(false);
        }
        if lookup {
            let kv = sched.getattr(intern!(py, "kv_cache_manager"))?;
            kv.call_method1(
                intern!(py, "record_prefix_cache_stats"),
                (request, num_local),
            )?;
        }
        let request = waiting.call_method0(intern!(py, "pop_request"))?;
        sched
            .getattr(intern!(py, "deferred_waiting"))?
            .call_method1(intern!(py, "discard"), (&request,))?;
        running.append(&request)?;
        if let Some(event) = &self.lp.objs.event_scheduled {
            request.call_method1(intern!(py, "record_event"), (event.bind(py), ts))?;
        }
        let status = request.getattr(intern!(py, "status"))?;
        let table = self.lp.manager.get().table_of(&id)?;
        budget.take(n);
        request.setattr(intern!(py, "status"), self.lp.objs.running.bind(py))?;
        request.setattr(intern!(py, "num_computed_tokens"), num_computed)?;
        if num_computed + n < num_tokens {
            sched
                .getattr(intern!(py, "_inflight_prefills"))?
                .call_method1(intern!(py, "add"), (&request,))?;
        }
        let placeholders = self.placeholders(&request)?;
        rows.push(Row {
            request,
            id,
            tokens: n,
            blocks: (!table.is_empty()).then_some(table),
            resumed: !status.is(self.lp.objs.waiting.bind(py)),
            all,
            computed: num_computed,
            placeholders,
        });
        Ok(true)
    }

    /// vLLM's prefix lookup for a request with nothing computed (its own method, which also
    /// sets `shared_prefix_boundary`) and the first admission's prefill stats.
    fn prefix_hit<'py>(
        &self,
        sched: &Bound<'py, PyAny>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<(Option<Bound<'py, PyAny>>, u64)> {
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
        Ok((Some(blocks), num_local))
    }

    fn new_requests_data<'py>(
        &self,
        py: Python<'py>,
        new: &[&Row<'py>],
    ) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for r in new {
            let ids = r.blocks.clone().unwrap_or_default();
            let block_ids = (PyList::new(py, ids)?,).into_pyobject(py)?;
            let make_new = self.lp.objs.make_new.bind(py);
            out.append(make_new.call1((&r.request, block_ids, self.set.v2_model_runner))?)?;
        }
        Ok(out)
    }

    /// `_make_cached_request_data`: running rows, then resumed ones.
    fn cached_request_data<'py>(
        &self,
        sched: &Bound<'py, PyAny>,
        running: &[&Row<'py>],
        resumed: &[&Row<'py>],
    ) -> PyResult<Bound<'py, PyTuple>> {
        let py = sched.py();
        let prev = sched.getattr(intern!(py, "prev_step_scheduled_req_ids"))?;
        let prev = prev.cast::<PySet>()?;
        let ids = PyList::empty(py);
        let resumed_ids = PySet::empty(py)?;
        let all_tokens = PyDict::new(py);
        let new_blocks = PyList::empty(py);
        let computed = PyList::empty(py);
        let outputs = PyList::empty(py);
        for (k, r) in running.iter().chain(resumed).enumerate() {
            ids.append(&r.id)?;
            if k >= running.len() {
                resumed_ids.add(&r.id)?;
            }
            if !self.set.v2_model_runner && !prev.contains(&r.id)? {
                all_tokens.set_item(&r.id, r.all.get_slice(0, r.all.len()))?;
            }
            match &r.blocks {
                None => new_blocks.append(py.None())?,
                Some(b) => new_blocks.append((PyList::new(py, b)?,))?,
            }
            computed.append(r.computed)?;
            // `len(_output_token_ids)`: the tokens past the prompt (in scope, `_all_token_ids`
            // is the prompt and then the outputs), without touching the output list.
            let prompt = self.fixed(&r.request, |f| f.num_prompt)?;
            let outs = (r.all.len() as u64).saturating_sub(prompt);
            outputs.append(outs + r.placeholders)?;
        }
        (ids, resumed_ids, all_tokens, new_blocks, computed, outputs).into_pyobject(py)
    }

    /// `_update_after_schedule`'s request updates.
    fn after_schedule<'py>(&self, sched: &Bound<'py, PyAny>, rows: &[Row<'py>]) -> PyResult<()> {
        let py = sched.py();
        let inflight = sched.getattr(intern!(py, "_inflight_prefills"))?;
        let any_inflight = inflight.len()? > 0;
        let asynchronous = self.async_placeholders(sched)?;
        for r in rows {
            let q = &r.request;
            let computed = r.computed + r.tokens;
            q.setattr(intern!(py, "num_computed_tokens"), computed)?;
            let in_flight = get_u64(q, intern!(py, "num_in_flight_tokens"))? + r.tokens;
            q.setattr(intern!(py, "num_in_flight_tokens"), in_flight)?;
            let chunk = computed < r.all.len() as u64 + r.placeholders;
            q.setattr(intern!(py, "is_prefill_chunk"), chunk)?;
            if !chunk && any_inflight {
                inflight.call_method1(intern!(py, "discard"), (q,))?;
            }
            if let (Some((spec, eligible)), false) = (&asynchronous, chunk) {
                q.setattr(intern!(py, "num_output_placeholders"), r.placeholders + 1)?;
                q.setattr(intern!(py, "spec_token_ids"), spec)?;
                if let Some(step) = eligible {
                    q.setattr(intern!(py, "next_decode_eligible_step"), step)?;
                }
            }
        }
        Ok(())
    }

    /// `AsyncScheduler._update_after_schedule`'s shared objects: the step's (empty) draft
    /// placeholder list, set on the scheduler, and with the v2 model runner the step from
    /// which a request may decode again. `None` for the synchronous scheduler.
    #[allow(clippy::type_complexity)]
    fn async_placeholders<'py>(
        &self,
        sched: &Bound<'py, PyAny>,
    ) -> PyResult<Option<(Bound<'py, PyList>, Option<u64>)>> {
        if !self.lp.async_scheduling {
            return Ok(None);
        }
        let py = sched.py();
        let spec = PyList::empty(py);
        sched.setattr(intern!(py, "_spec_token_placeholders"), &spec)?;
        let eligible = if self.set.v2_model_runner {
            let step = get_u64(sched, intern!(py, "current_step"))?;
            Some(step + self.lp.decode_stagger)
        } else {
            None
        };
        Ok(Some((spec, eligible)))
    }

    /// One row of `update_from_output`; `None` when the row is skipped (aborted in flight,
    /// finished, or drop-mode stale output).
    fn update_row<'py>(
        &self,
        sched: &Bound<'py, PyAny>,
        request: &Bound<'py, PyAny>,
        id: &Bound<'py, PyAny>,
        n: u64,
        mro: &ModelOutput<'py>,
    ) -> PyResult<Option<RowUpdate<'py>>> {
        let py = sched.py();
        let in_flight = get_u64(request, intern!(py, "num_in_flight_tokens"))?;
        request.setattr(
            intern!(py, "num_in_flight_tokens"),
            in_flight.saturating_sub(n),
        )?;
        let stale_tokens = get_u64(request, intern!(py, "num_stale_output_tokens"))?;
        let stale = stale_tokens > 0;
        if stale {
            request.setattr(
                intern!(py, "num_stale_output_tokens"),
                stale_tokens.saturating_sub(n),
            )?;
        }
        let status = request.getattr(intern!(py, "status"))?;
        let was_running = status.is(self.lp.objs.running.bind(py));
        if !was_running && status.extract::<i64>()? > self.lp.objs.preempted_value {
            return Ok(None);
        }
        if stale
            && request
                .getattr(intern!(py, "drop_stale_output"))?
                .is_truthy()?
        {
            return Ok(None);
        }
        let index = mro
            .index
            .get_item(id)?
            .ok_or_else(|| crate::errors::invalid("a scheduled request has no model output"))?;
        let tokens = if mro.has_sampled {
            let t = mro.sampled.get_item(&index)?;
            match t.cast_into::<PyList>() {
                Ok(list) => list,
                Err(e) => PyList::new(
                    py,
                    e.into_inner().try_iter()?.collect::<PyResult<Vec<_>>>()?,
                )?,
            }
        } else {
            PyList::empty(py)
        };
        let mut stop = None;
        if !tokens.is_empty() {
            let returned = tokens.len();
            stop = self.append_tokens(request, &tokens, stale)?;
            self.resolve_placeholders(request, stale, was_running, returned, tokens.len())?;
        }
        let stopped = stop.is_some();
        let emit = !tokens.is_empty() || stopped;
        let prefill_stats = if emit {
            self.take_prefill_stats(sched, request)?
        } else {
            None
        };
        let logprobs = self.new_logprobs(request, mro, &index, tokens.len())?;
        let mut finish_reason = None;
        if let Some(stop) = stop {
            finish_reason = Some(match stop {
                Stop::Length => self.lp.objs.reason_length.bind(py).clone(),
                _ => self.lp.objs.reason_stop.bind(py).clone(),
            });
            sched.call_method1(intern!(py, "_free_request"), (request,))?;
        }
        if let Some(nans) = &mro.num_nans {
            if let Some(v) = nans.get_item(id)? {
                request.setattr(intern!(py, "num_nans_in_logits"), v)?;
            }
        }
        let output = if emit {
            let fields = OutputFields {
                id,
                tokens: &tokens,
                finish_reason,
                logprobs,
                prefill_stats,
            };
            Some(self.build_output(request, mro, fields)?)
        } else {
            None
        };
        Ok(Some(RowUpdate {
            output,
            stopped: stopped.then_some(was_running),
        }))
    }

    /// `_update_request_with_output`: append the sampled tokens one by one (the request's
    /// hasher runs when a block fills), stop at the first that `check_stop` stops on, trim
    /// the rest from the output list (in place, as vLLM does).
    fn append_tokens(
        &self,
        request: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyList>,
        stale: bool,
    ) -> PyResult<Option<Stop>> {
        let py = request.py();
        let (outs, all, hashes, hash_fn, rule) = self.fixed(request, |f| {
            (
                f.outs.bind(py).clone(),
                f.all.bind(py).clone(),
                f.hashes.as_ref().map(|h| h.bind(py).clone()),
                f.hash_fn,
                f.rule.clone(),
            )
        })?;
        let count = tokens.len();
        let mut stop = None;
        for (k, tok) in tokens.iter().enumerate() {
            outs.append(&tok)?;
            all.append(&tok)?;
            let num_tokens = all.len() as u64;
            if let Some(h) = &hashes {
                if (h.len()? as u64 + 1) * self.set.hash_block_size <= num_tokens {
                    let size = self.set.hash_block_size as usize;
                    extend_block_hashes(request, h, &all, hash_fn, size)?;
                }
            }
            // A sampled id outside i64 matches no EOS or stop id (those are within i64: the
            // scope rule), so only the length rules apply to it.
            let last: Option<i64> = tok.extract().ok();
            stop = policy::check_stop(
                &rule,
                last,
                num_tokens,
                outs.len() as u64,
                self.set.limits.max_model_len,
            );
            if let Some(s) = stop {
                self.mark_stopped(request, s)?;
                let kept = k + 1;
                if self.set.release_033 && !stale && kept < count {
                    let c = get_u64(request, intern!(py, "num_computed_tokens"))?;
                    let trimmed = (count - kept) as u64;
                    request.setattr(
                        intern!(py, "num_computed_tokens"),
                        c.saturating_sub(trimmed),
                    )?;
                }
                if kept < count {
                    tokens.del_slice(kept, count)?;
                }
                break;
            }
        }
        Ok(stop)
    }

    /// The placeholder and caching bookkeeping after a row's tokens (async scheduling):
    /// 0.33 resolves placeholders by every returned token and caches up to the computed
    /// tokens not in flight; 0.32's `AsyncScheduler` resolves them by the kept tokens and
    /// caches up to the computed tokens not placeholders.
    fn resolve_placeholders(
        &self,
        request: &Bound<'_, PyAny>,
        stale: bool,
        was_running: bool,
        returned: usize,
        kept: usize,
    ) -> PyResult<()> {
        let py = request.py();
        let name = intern!(py, "num_output_placeholders");
        if !self.lp.async_scheduling {
            return Ok(()); // no placeholders (see `placeholders`)
        }
        let before = get_u64(request, name)?;
        let cache_upto = if self.set.release_033 {
            if !stale && before > 0 {
                request.setattr(name, before.saturating_sub(returned as u64))?;
            }
            if stale || !was_running || before == 0 {
                return Ok(());
            }
            let in_flight = get_u64(request, intern!(py, "num_in_flight_tokens"))?;
            get_u64(request, intern!(py, "num_computed_tokens"))?.saturating_sub(in_flight)
        } else {
            let left = if stale {
                before
            } else {
                before.saturating_sub(kept as u64)
            };
            if !stale {
                request.setattr(name, left)?;
            }
            if !was_running {
                return Ok(());
            }
            get_u64(request, intern!(py, "num_computed_tokens"))?.saturating_sub(left)
        };
        let mgr = self.lp.manager.get();
        self.fixed(request, |f| mgr.cache_for(py, request, &f.rid, cache_upto))?
    }

    fn mark_stopped(&self, request: &Bound<'_, PyAny>, stop: Stop) -> PyResult<()> {
        let py = request.py();
        let status = match stop {
            Stop::Length => &self.lp.objs.length_capped,
            _ => &self.lp.objs.stopped,
        };
        request.setattr(intern!(py, "status"), status.bind(py))?;
        if let Stop::StopToken(t) = stop {
            request.setattr(intern!(py, "stop_reason"), t)?;
        }
        Ok(())
    }

    /// The request's prefill stats on its first emitted output, finalized with the
    /// manager's cached-token estimate (`take_prefill_stats` + `finalize`).
    fn take_prefill_stats<'py>(
        &self,
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

    fn new_logprobs<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        mro: &ModelOutput<'py>,
        index: &Bound<'py, PyAny>,
        num_tokens: usize,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = request.py();
        if mro.logprobs.is_none() || !mro.logprobs.is_truthy()? {
            return Ok(None);
        }
        let params = request.getattr(intern!(py, "sampling_params"))?;
        if params.is_none() || params.getattr(intern!(py, "num_logprobs"))?.is_none() {
            return Ok(None);
        }
        let sliced = mro
            .logprobs
            .call_method1(intern!(py, "slice_request"), (index, num_tokens))?;
        Ok(Some(sliced))
    }

    fn build_output<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        mro: &ModelOutput<'py>,
        f: OutputFields<'_, 'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = request.py();
        let shape = &self.lp.objs.output;
        // Positional arguments up to the last field that differs from its default.
        let mut set: Vec<(usize, Bound<'py, PyAny>)> = Vec::with_capacity(8);
        set.push((shape.request_id, f.id.clone()));
        set.push((shape.new_token_ids, f.tokens.clone().into_any()));
        if let Some(r) = f.finish_reason {
            set.push((shape.finish_reason, r));
        }
        if let Some(l) = f.logprobs {
            set.push((shape.new_logprobs, l));
        }
        if let Some(p) = &mro.prompt_logprobs {
            if let Some(p) = p.get_item(f.id)? {
                set.push((shape.new_prompt_logprobs_tensors, p));
            }
        }
        if let (Some(at), Some(d)) = (
            shape.prompt_token_id_logprobs,
            &mro.prompt_token_id_logprobs,
        ) {
            if let Some(p) = d.get_item(f.id)? {
                set.push((at, p));
            }
        }
        let named = [
            (
                shape.stop_reason,
                request.getattr(intern!(py, "stop_reason"))?,
            ),
            (shape.events, take_events(request)?),
            (
                shape.trace_headers,
                self.fixed(request, |f| f.trace_headers.bind(py).clone())?,
            ),
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
}

struct OutputFields<'a, 'py> {
    id: &'a Bound<'py, PyAny>,
    tokens: &'a Bound<'py, PyList>,
    finish_reason: Option<Bound<'py, PyAny>>,
    logprobs: Option<Bound<'py, PyAny>>,
    prefill_stats: Option<Bound<'py, PyAny>>,
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

fn stop_rule(request: &Bound<'_, PyAny>) -> PyResult<StopRule> {
    let py = request.py();
    let params = request.getattr(intern!(py, "sampling_params"))?;
    let eos = params.getattr(intern!(py, "eos_token_id"))?;
    let stops = params.getattr(intern!(py, "stop_token_ids"))?;
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
    })
}

/// `remove_all` for stopped running requests (one: in place; several: a new list, as vLLM
/// does), and the queues for stopped requests that were not running.
fn remove_stopped<'py>(
    sched: &Bound<'py, PyAny>,
    running_stopped: &[Bound<'py, PyAny>],
    other: &[Bound<'py, PyAny>],
) -> PyResult<()> {
    let py = sched.py();
    let running = sched
        .getattr(intern!(py, "running"))?
        .cast_into::<PyList>()?;
    match running_stopped {
        [] => {}
        [one] => {
            if let Ok(k) = running.index(one) {
                running.del_item(k)?;
            }
        }
        many => {
            let kept = PyList::empty(py);
            for r in running.iter() {
                if !many.iter().any(|m| m.is(&r)) {
                    kept.append(r)?;
                }
            }
            sched.setattr(intern!(py, "running"), kept)?;
        }
    }
    if !other.is_empty() {
        let set = PySet::new(py, other)?;
        for queue in ["waiting", "kv_holding_waiting"] {
            sched
                .getattr(queue)?
                .call_method1(intern!(py, "remove_requests"), (&set,))?;
        }
        sched
            .getattr(intern!(py, "deferred_waiting"))?
            .call_method1(intern!(py, "difference_update"), (&set,))?;
    }
    Ok(())
}
