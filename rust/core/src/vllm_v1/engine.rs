//! What the v1 scheduling walk ([`super::walk`]) reads and writes of the engine: vLLM's
//! `Scheduler` (its `running` list, `waiting` queue and side sets), its `Request`s, its KV
//! cache manager, and the objects that leave the scheduler. The bindings implement
//! [`Engine`] over vLLM's own Python objects; the core's tests over plain Rust structs.
//!
//! Invariants the walk relies on (an implementation must keep them):
//! * `Req` names one request; `==` is identity (two handles of one request are equal).
//! * `running_at(i)` for `i < running_len()` is the `i`-th running request; `running_remove`
//!   and `running_push` change that list and nothing else.
//! * `waiting_peek` is the request `waiting_pop` returns next (vLLM's queue order: FCFS or
//!   PRIORITY, the queue's own).
//! * `num_tokens` is the request's token count (prompt + outputs; no drafts in scope), and
//!   `append_output_token` grows it and `num_output_tokens` by one.
//! * Field writes (`set_*`) are seen by the next read of that field.
//! * The rare events (`preempt`, `free_request`, `prefix_hit`, ...) do what vLLM's methods
//!   of those names do (the bindings call those methods).
//!
//! Costs: the walk calls the per-request accessors O(1) times per scheduled request and step,
//! `running_priority_keys` once per PRIORITY preemption (O(running)), the rare events once per
//! admitted, preempted or finished request; with a LoRA limit, `lora_id` of every running
//! request once per step; `unblock` once per blocked request the waiting pass reaches;
//! `repeats` once per appended token of a request with repetition detection (O(its pattern
//! sizes)); `accept_tokens` once per structured-output row with tokens.

use super::policy::{Limits, Repetition, Stop, StopRule};
use super::SlotRequest;

/// vLLM's release: where 0.32 and 0.33 schedule differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    V032,
    /// A PRIORITY request that preempted itself lets the running pass go on (0.32 breaks);
    /// a stop trims the unkept tokens off `num_computed_tokens`; `num_executed_steps` counts
    /// steps; placeholders resolve by every returned token.
    V033,
}

/// The model runner vLLM's scheduler serves (`use_v2_model_runner`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runner {
    V1,
    /// Decodes wait for `next_decode_eligible_step`; resumed requests are sent as new.
    V2,
}

/// The engine's release and scheduler kind, decided when the loop is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mode {
    pub release: Release,
    /// vLLM's `AsyncScheduler`: output placeholders, stale outputs resolved on arrival.
    pub asynchronous: bool,
    /// `decode_stagger` (the v2 runner's steps between a request's decodes, async only).
    pub decode_stagger: u64,
}

/// The scheduler's settings, read at each call's start (vLLM's loop reads them each step;
/// vLLM's own tests change some after construction, the runner among them).
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// The rules' limits (`max_model_len` is already the cache's length cap).
    pub limits: Limits,
    pub max_num_scheduled_tokens: u64,
    pub max_num_batched_tokens: u64,
    pub max_num_active_reqs: usize,
    pub max_num_running_reqs: usize,
    /// `policy == SchedulingPolicy.PRIORITY`.
    pub priority: bool,
    /// `scheduler_reserve_full_isl`: admission needs room for the whole prompt.
    pub reserve_full_isl: bool,
    pub runner: Runner,
    /// `lora_config.max_loras` (`None`: no LoRA config, no limit).
    pub max_loras: Option<usize>,
}

/// A request's `status` as the walk distinguishes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Waiting,
    Running,
    Preempted,
    /// Any finished status.
    Finished,
    /// A blocked waiting status (structured-output grammar, remote KV, streaming): the
    /// waiting pass asks [`Engine::unblock`] before it looks further.
    OtherWaiting,
}

impl Status {
    /// The statuses `allocate_slots`' watermark applies to.
    pub fn waiting_or_preempted(self) -> bool {
        matches!(self, Status::Waiting | Status::Preempted)
    }
}

/// What `schedule()` reads of the scheduler before it writes anything.
#[derive(Clone, Copy, Debug)]
pub struct Start {
    pub current_step: u64,
    /// `num_executed_steps` (0.33; `None` on 0.32).
    pub num_executed_steps: Option<u64>,
    /// `len(running) + len(waiting) + len(kv_holding_waiting)`.
    pub num_eligible: u64,
}

/// One scheduled row of a step.
#[derive(Clone, Debug)]
pub struct Row<R> {
    pub req: R,
    pub tokens: u64,
    /// The request's new blocks (`None`: none new); an admitted one carries its whole table.
    pub blocks: Option<Vec<u32>>,
    /// Admitted from any status but `WAITING` (a resumed request).
    pub resumed: bool,
    /// `num_computed_tokens` before this step's advance.
    pub num_computed_tokens: u64,
    pub num_tokens: u64,
    pub placeholders: u64,
}

/// One `schedule()`'s rows: the running pass's rows first, then the admitted ones.
#[derive(Clone, Debug)]
pub struct Step<R> {
    pub rows: Vec<Row<R>>,
    pub num_running_rows: usize,
    pub total: u64,
    pub runner: Runner,
}

/// The engine the walk runs over. Every method may fail with the engine's error (a Python
/// exception in the bindings); the walk stops at the first and returns it.
pub trait Engine {
    type Req: Clone + PartialEq;
    type Error;
    /// One row's sampled tokens (the model runner's list for the request).
    type Sampled;
    /// An output being built (what is taken before the request is freed).
    type Pending;
    /// What `schedule()` returns (the bindings: the parts of vLLM's `SchedulerOutput`).
    type Scheduled;

    fn error(&self, e: crate::Error) -> Self::Error;

    // The scheduler.
    fn settings(&mut self) -> Result<Settings, Self::Error>;
    /// Reads what [`Start`] holds (and anything else the engine must read before a write).
    fn begin_schedule(&mut self, mode: &Mode) -> Result<Start, Self::Error>;
    fn set_current_step(&mut self, step: u64) -> Result<(), Self::Error>;
    fn set_num_executed_steps(&mut self, n: u64) -> Result<(), Self::Error>;
    fn running_len(&self) -> usize;
    fn running_at(&mut self, i: usize) -> Result<Self::Req, Self::Error>;
    fn running_remove(&mut self, i: usize) -> Result<Self::Req, Self::Error>;
    fn running_push(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    /// `(priority, arrival_time)` of every running request, in order.
    fn running_priority_keys(&self) -> Result<Vec<(i64, f64)>, Self::Error>;
    fn waiting_len(&self) -> Result<usize, Self::Error>;
    fn waiting_peek(&mut self) -> Result<Self::Req, Self::Error>;
    fn waiting_pop(&mut self) -> Result<Self::Req, Self::Error>;
    /// `waiting.prepend_requests(deque(skipped))`.
    fn waiting_prepend(&mut self, skipped: Vec<Self::Req>) -> Result<(), Self::Error>;
    fn kv_holding_len(&self) -> Result<usize, Self::Error>;
    fn deferred_len(&self) -> Result<usize, Self::Error>;
    fn deferred_add(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    fn deferred_discard(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    fn set_prefill_capacity_bound(&mut self, bound: bool) -> Result<(), Self::Error>;
    fn inflight_prefills_len(&self) -> Result<usize, Self::Error>;
    fn inflight_prefills_add(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    fn inflight_prefills_discard(&mut self, r: &Self::Req) -> Result<(), Self::Error>;

    // A request's fields.
    fn status(&self, r: &Self::Req) -> Result<Status, Self::Error>;
    fn set_running(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    /// `check_stop`'s writes: the finished status and, for a stop token, `stop_reason`.
    fn set_stopped(&mut self, r: &Self::Req, stop: Stop) -> Result<(), Self::Error>;
    fn num_tokens(&self, r: &Self::Req) -> u64;
    fn num_prompt_tokens(&self, r: &Self::Req) -> u64;
    fn num_output_tokens(&self, r: &Self::Req) -> Result<u64, Self::Error>;
    fn max_tokens(&self, r: &Self::Req) -> u64;
    fn stop_rule(&self, r: &Self::Req) -> StopRule;
    fn num_computed_tokens(&self, r: &Self::Req) -> Result<u64, Self::Error>;
    fn set_num_computed_tokens(&mut self, r: &Self::Req, n: u64) -> Result<(), Self::Error>;
    fn num_output_placeholders(&self, r: &Self::Req) -> Result<u64, Self::Error>;
    fn set_num_output_placeholders(&mut self, r: &Self::Req, n: u64) -> Result<(), Self::Error>;
    fn num_in_flight_tokens(&self, r: &Self::Req) -> Result<u64, Self::Error>;
    fn set_num_in_flight_tokens(&mut self, r: &Self::Req, n: u64) -> Result<(), Self::Error>;
    fn num_stale_output_tokens(&self, r: &Self::Req) -> Result<u64, Self::Error>;
    fn set_num_stale_output_tokens(&mut self, r: &Self::Req, n: u64) -> Result<(), Self::Error>;
    fn drop_stale_output(&self, r: &Self::Req) -> Result<bool, Self::Error>;
    fn set_is_prefill_chunk(&mut self, r: &Self::Req, chunk: bool) -> Result<(), Self::Error>;
    fn next_decode_eligible_step(&self, r: &Self::Req) -> Result<u64, Self::Error>;
    /// `AsyncScheduler._update_after_schedule` for a request that is not a prefill chunk:
    /// its (empty) draft placeholders and, with the v2 runner, `next_decode_eligible_step`.
    fn set_async_decode(&mut self, r: &Self::Req, eligible: Option<u64>)
        -> Result<(), Self::Error>;
    /// `lora_request.lora_int_id` (`None`: no LoRA).
    fn lora_id(&self, r: &Self::Req) -> Option<i64>;
    /// `use_structured_output`.
    fn uses_structured_output(&self, r: &Self::Req) -> bool;

    // vLLM's rare events.
    /// `_handle_blocked_waiting_request` for a request in a blocked waiting status: whether
    /// it may be scheduled now (it may have become `WAITING`; a grammar that failed to
    /// compile is recorded for vLLM to report).
    fn unblock(&mut self, r: &Self::Req) -> Result<bool, Self::Error>;
    /// `check_sequence_repetition(output_token_ids, repetition_detection)` (the rule is
    /// `policy::has_repetition`).
    fn repeats(&mut self, r: &Self::Req, rep: &Repetition) -> Result<bool, Self::Error>;
    /// `structured_output_manager.accept_tokens(request, kept_tokens)`: false when the
    /// grammar rejects them.
    fn accept_tokens(&mut self, r: &Self::Req, s: &Self::Sampled) -> Result<bool, Self::Error>;
    /// `_preempt_request(request, timestamp)` (the request is already out of `running`).
    fn preempt(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    /// `_get_local_prefix_cache_hit`: the hit's block ids (`None`: vLLM's shared empty
    /// blocks) and its token count; also the first admission's prefill stats.
    fn prefix_hit(&mut self, r: &Self::Req) -> Result<(Option<Vec<u32>>, u64), Self::Error>;
    fn record_prefix_cache_stats(&mut self, r: &Self::Req, hit: u64) -> Result<(), Self::Error>;
    /// `record_event(SCHEDULED, timestamp)` when stats are on.
    fn record_scheduled(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    fn free_request(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    /// Out of `running` (the running ones), the waiting queues (the others).
    fn remove_stopped(
        &mut self,
        running: &[Self::Req],
        other: &[Self::Req],
    ) -> Result<(), Self::Error>;

    // The KV cache manager.
    /// `allocate_slots`: the new block ids (empty: none new), `None` when they do not fit.
    fn allocate(
        &mut self,
        r: &Self::Req,
        a: &SlotRequest<'_>,
    ) -> Result<Option<Vec<u32>>, Self::Error>;
    /// `cache_blocks(request, num_tokens)` (nothing with caching off).
    fn cache_blocks(&mut self, r: &Self::Req, num_tokens: u64) -> Result<(), Self::Error>;
    fn block_table(&self, r: &Self::Req) -> Result<Vec<u32>, Self::Error>;

    // What leaves the scheduler.
    /// The step's output, built before `_update_after_schedule` writes the requests.
    fn scheduler_output(&mut self, step: &Step<Self::Req>) -> Result<Self::Scheduled, Self::Error>;
    /// `_update_after_schedule` found a structured-output row past its prefill: the output's
    /// `has_structured_output_requests` becomes true.
    fn mark_structured_output(&mut self, out: &mut Self::Scheduled) -> Result<(), Self::Error>;
    /// The rows `update_from_output` walks: `(request, num_scheduled_tokens)` in the
    /// scheduler output's order, requests no longer in the scheduler left out.
    fn scheduled_rows(&mut self) -> Result<Vec<(Self::Req, u64)>, Self::Error>;
    /// The model runner's sampled tokens for the row (an error when it has none).
    fn sampled(&mut self, r: &Self::Req) -> Result<Self::Sampled, Self::Error>;
    fn sampled_len(&self, s: &Self::Sampled) -> usize;
    fn truncate_sampled(&mut self, s: &mut Self::Sampled, kept: usize) -> Result<(), Self::Error>;
    /// `append_output_token_ids(s[k])` (block hashes extended as blocks fill): the token, or
    /// `None` for an id outside i64 (it equals no EOS or stop id: only the length rules apply).
    fn append_output_token(
        &mut self,
        r: &Self::Req,
        s: &Self::Sampled,
        k: usize,
    ) -> Result<Option<i64>, Self::Error>;
    /// Before the request is freed: its prefill stats (when `emit`) and logprobs.
    fn begin_output(
        &mut self,
        r: &Self::Req,
        s: &Self::Sampled,
        emit: bool,
    ) -> Result<Self::Pending, Self::Error>;
    /// After: `num_nans_in_logits`, and the request's output when `emit`.
    fn emit_output(
        &mut self,
        r: &Self::Req,
        p: Self::Pending,
        s: Self::Sampled,
        stop: Option<Stop>,
        emit: bool,
    ) -> Result<(), Self::Error>;
}
