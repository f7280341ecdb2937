//! What the v1 scheduling walk ([`super::walk`]) reads and writes of the engine: vLLM's
//! `Scheduler` (its `running` list, `waiting` queue and side sets), its `Request`s, its KV
//! cache manager, and the objects that leave the scheduler. The bindings implement
//! [`Engine`] over vLLM's own Python objects; the core's tests over plain Rust structs.
//!
//! Invariants the walk relies on (an implementation must keep them):
//! * `Req` names one request; `==` is identity (two handles of one request are equal).
//! * `running_at(i)` for `i < running_len()` is the `i`-th running request; `running_remove`
//!   and `running_push` change that list and nothing else.
//! * `waiting_peek(q)` is the request `waiting_pop(q)` returns next (vLLM's queue order: FCFS
//!   or PRIORITY, the queue's own), for either [`Queue`]; a request is in at most one queue.
//! * A request in [`Queue::KvHolding`] holds KV blocks (`num_computed_tokens > 0`: a streaming
//!   session between turns); no request the walk sees waits for remote KV (the bindings leave
//!   such a step to vLLM's loop).
//! * `num_tokens` is the request's token count (prompt + outputs, drafts not counted), and
//!   `append_output_token` grows it and `num_output_tokens` by one.
//! * Field writes (`set_*`) are seen by the next read of that field.
//! * The rare events (`preempt`, `free_request`, `prefix_hit`, ...) do what vLLM's methods
//!   of those names do (the bindings call those methods).
//! * `Blocks` is the KV cache manager's own shape of a request's block ids (one group, or one
//!   list per group): the walk carries them from `prefix_hit`, `allocate` and `block_table`
//!   to `scheduler_output` unchanged, whatever the number of groups.
//!
//! Costs: the walk calls the per-request accessors O(1) times per scheduled request and step,
//! `running_priority_keys` once per PRIORITY preemption (O(running)), the rare events once per
//! admitted, preempted or finished request (`resumable` once per stopped request,
//! `handle_stopped` and `enqueue_waiting` once per stopped session);
//! `num_waiting_for_streaming_input` once per waiting pass; with a LoRA limit, `lora_id` of every running
//! request once per step; `unblock` once per blocked request the waiting pass reaches;
//! `repeats` once per appended token of a request with repetition detection (O(its pattern
//! sizes)); `accept_tokens` once per row with tokens (an engine answers a row without
//! structured output itself where the manager is vLLM's own). The encoder calls
//! (`schedule_encoder_inputs`, `commit_encoder_inputs`, ...) only for requests with
//! `has_encoder_inputs`: once per such request the running or waiting pass reaches with
//! tokens, once per such row committed and once per such row updated.

use super::policy::{Limits, Repetition, Stop, StopRule};
use super::SlotRequest;

/// vLLM's release: where 0.32 and 0.33 schedule differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    V032,
    /// A PRIORITY request that preempted itself lets the running pass go on (0.32 breaks);
    /// a stop trims the unkept tokens off `num_computed_tokens`; `num_executed_steps` counts
    /// steps; placeholders resolve by every returned token; a waiting request left no token
    /// by its encoder inputs is skipped (0.32 ends the waiting pass).
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
    /// Speculative decoding (all 0 / false without it).
    pub spec: SpecSettings,
    /// `need_mamba_block_aligned_split` (a Mamba group in "align" mode): whose split runs.
    pub mamba_split: Option<MambaSplitRule>,
}

/// Whose `_mamba_block_aligned_split` ends the prefill chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MambaSplitRule {
    /// vLLM's own method: the core's arithmetic with these settings.
    Vllm(super::mamba_split::MambaSplit),
    /// Another (a platform plugin's patch, a subclass's override, a test's stand-in): the
    /// engine calls it ([`Engine::custom_mamba_split`]).
    Custom,
}

/// The scheduler's speculative decoding settings (`num_spec_tokens > 0`: drafts are
/// scheduled). Under a dynamic schedule (`dynamic_sd_lookup`) the draft count per step is the
/// bindings' to report (it depends only on the step's batch size); the walk's one change is
/// that no resumed decode is padded.
#[derive(Clone, Copy, Debug, Default)]
pub struct SpecSettings {
    /// `num_spec_tokens`: drafts per request, and the padding of a resumed decode.
    pub num_spec_tokens: u64,
    /// `num_lookahead_tokens`: slots `allocate_slots` reserves past the scheduled tokens.
    pub num_lookahead_tokens: u64,
    /// `max_num_new_slots_for_drafting`: input budget each scheduled request also takes.
    pub draft_slots: u64,
    /// `can_skip_drafts` (0.33): `skip_drafts` is set when no scheduled request can use the
    /// drafts proposed after the step.
    pub can_skip_drafts: bool,
    /// A dynamic speculative decoding schedule (`num_speculative_tokens_per_batch_size`):
    /// vLLM then never pads a resumed decode to `1 + num_spec_tokens`.
    pub dynamic: bool,
    /// `num_prefill_lookahead`: prefill tokens past a chunk the drafter reads (multi-module
    /// MTP: `num_speculative_tokens`; EAGLE: 1; else 0). No chunk ends closer than that to
    /// the prefill's end ([`super::policy::reserve_prefill_lookahead`]).
    pub prefill_lookahead: u64,
}

/// The scheduler's two waiting queues: the waiting pass drains `kv_holding_waiting` first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Queue {
    /// `waiting`: requests holding no KV blocks (new or preempted).
    Waiting,
    /// `kv_holding_waiting`: requests waiting with KV blocks (streaming sessions between
    /// turns, paused in `WAITING_FOR_STREAMING_REQ` or resumed by an update).
    KvHolding,
}

/// A request's `status` as the walk distinguishes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Waiting,
    Running,
    Preempted,
    /// Any finished status.
    Finished,
    /// A blocked waiting status (structured-output grammar, remote KV, a streaming session
    /// waiting for input): the waiting pass asks [`Engine::unblock`] before it looks further.
    OtherWaiting,
}

impl Status {
    /// The statuses `allocate_slots`' watermark applies to.
    pub fn waiting_or_preempted(self) -> bool {
        matches!(self, Status::Waiting | Status::Preempted)
    }
}

/// A waiting request's prefix lookup ([`Engine::prefix_hit`]): the local prefix-cache hit
/// and the tokens a KV connector loads past it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixHit<B> {
    /// The local hit's block ids (`None`: vLLM's shared empty blocks).
    pub blocks: Option<B>,
    pub num_local: u64,
    /// `num_external_computed_tokens`: the connector's tokens past the local hit.
    pub num_external: u64,
    /// `load_kv_async`: the connector loads them while the request waits
    /// (`WAITING_FOR_REMOTE_KVS`); else they are loaded with the request's first step.
    pub load_async: bool,
}

impl<B> PrefixHit<B> {
    /// A local hit alone (an engine without a connector).
    pub fn local(blocks: Option<B>, num_local: u64) -> Self {
        PrefixHit {
            blocks,
            num_local,
            num_external: 0,
            load_async: false,
        }
    }
}

/// The structured-output flags `_update_after_schedule` sets on the `SchedulerOutput`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StructuredFlags {
    /// `has_structured_output_requests`: a structured-output row past its prefill.
    pub has_requests: bool,
    /// `pending_structured_output_tokens` (`AsyncScheduler`): such a row whose earlier
    /// output is still in flight (placeholders before this step's).
    pub pending_tokens: bool,
}

/// What `schedule()` reads of the scheduler before it writes anything.
#[derive(Clone, Copy, Debug)]
pub struct Start {
    pub current_step: u64,
    /// `num_executed_steps` (0.33; `None` on 0.32).
    pub num_executed_steps: Option<u64>,
    /// `len(running) + len(waiting) + len(kv_holding_waiting)`.
    pub num_eligible: u64,
    /// What decides whether this step defers prefills.
    pub prefill_gate: PrefillGate,
}

/// What `schedule()` reads to decide whether it defers prefills this step (vLLM's
/// `defer_prefills`: data-parallel prefill balancing, and 0.33's local prefill cadence).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillGate {
    /// `prefill_capacity_bound`: the last step that ran the waiting pass undeferred left
    /// requests waiting that it had not deferred (no deferral then).
    pub capacity_bound: bool,
    /// 0.33's `local_prefill_interval` (`prefill_schedule_interval` without data
    /// parallelism); 1, no cadence, on 0.32.
    pub interval: u64,
    /// 0.33's `last_prefill_step`: the executed step that last carried a prefill.
    pub last_prefill_step: i64,
}

impl Default for PrefillGate {
    fn default() -> Self {
        PrefillGate {
            capacity_bound: false,
            interval: 1,
            last_prefill_step: -1,
        }
    }
}

/// A request's block ids as the engine's KV cache manager gives them (a prefix hit, an
/// allocation's new blocks, a block table): one list for one KV cache group (`Vec<u32>`), one
/// list per group for several (`Vec<Vec<u32>>`, vLLM's group order), or the engine's own
/// type. The walk only carries them from the manager to the output, and asks whether any
/// group has a block.
pub trait BlockIds {
    /// No group holds a block (vLLM's `get_block_ids(allow_none=True)` is `None`).
    fn is_empty(&self) -> bool;
}

impl BlockIds for Vec<u32> {
    fn is_empty(&self) -> bool {
        <[u32]>::is_empty(self)
    }
}

impl BlockIds for Vec<Vec<u32>> {
    fn is_empty(&self) -> bool {
        self.iter().all(|g| g.is_empty())
    }
}

/// One scheduled row of a step (`B`: the engine's [`Engine::Blocks`]).
#[derive(Clone, Debug)]
pub struct Row<R, B = Vec<u32>> {
    pub req: R,
    pub tokens: u64,
    /// The request's new blocks (`None`: none new in any group); an admitted one carries its
    /// whole table.
    pub blocks: Option<B>,
    /// Admitted from any status but `WAITING` (a resumed request).
    pub resumed: bool,
    /// `num_computed_tokens` before this step's advance.
    pub num_computed_tokens: u64,
    pub num_tokens: u64,
    pub placeholders: u64,
    /// Draft tokens scheduled with the row (`scheduled_spec_decode_tokens`, padding
    /// included).
    pub drafts: u64,
}

/// A row `update_from_output` walks: the request, its scheduled tokens and drafts.
pub type ScheduledRow<R> = (R, u64, u64);

/// A row's entry in `scheduled_spec_decode_tokens`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drafts {
    /// The first `k` of the request's proposed `spec_token_ids` (0: none scheduled).
    Proposed(u64),
    /// `k` placeholder ids (`-1`): a resumed decode padded to a uniform spec decode.
    Padding(u64),
}

/// One `schedule()`'s rows: the running pass's rows first, then the admitted ones.
#[derive(Clone, Debug)]
pub struct Step<R, B = Vec<u32>> {
    pub rows: Vec<Row<R, B>>,
    pub num_running_rows: usize,
    pub total: u64,
    pub runner: Runner,
    /// `skip_drafts`: no scheduled request can use the drafts proposed after this step.
    pub skip_drafts: bool,
}

/// What `_try_schedule_encoder_inputs` decided for one request this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncoderPlan {
    /// The tokens the request may take (capped before an encoder input that does not fit).
    pub tokens: u64,
    /// The encoder compute budget left if the row is committed.
    pub budget: u64,
    /// Some encoder input is to be computed this step (`encoder_inputs_to_schedule`).
    pub scheduled: bool,
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
    /// A request's block ids, in whatever shape the KV cache manager has (one group or
    /// several): the walk never looks inside.
    type Blocks: BlockIds;

    fn error(&self, e: crate::Error) -> Self::Error;

    // The scheduler.
    fn settings(&mut self) -> Result<Settings, Self::Error>;
    /// Reads what [`Start`] holds (and anything else the engine must read before a write),
    /// then starts the KV cache manager's step (`kv_cache_manager.new_step_starts()`).
    fn begin_schedule(&mut self, mode: &Mode) -> Result<Start, Self::Error>;
    fn set_current_step(&mut self, step: u64) -> Result<(), Self::Error>;
    fn set_num_executed_steps(&mut self, n: u64) -> Result<(), Self::Error>;
    fn running_len(&self) -> usize;
    fn running_at(&mut self, i: usize) -> Result<Self::Req, Self::Error>;
    fn running_remove(&mut self, i: usize) -> Result<Self::Req, Self::Error>;
    fn running_push(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    /// `(priority, arrival_time)` of every running request, in order.
    fn running_priority_keys(&self) -> Result<Vec<(i64, f64)>, Self::Error>;
    fn waiting_len(&self, q: Queue) -> Result<usize, Self::Error>;
    fn waiting_peek(&mut self, q: Queue) -> Result<Self::Req, Self::Error>;
    fn waiting_pop(&mut self, q: Queue) -> Result<Self::Req, Self::Error>;
    /// `queue.prepend_requests(deque(skipped))`.
    fn waiting_prepend(&mut self, q: Queue, skipped: Vec<Self::Req>) -> Result<(), Self::Error>;
    /// `num_waiting_for_streaming_input`: paused sessions, which keep a model-runner slot.
    fn num_waiting_for_streaming_input(&self) -> Result<usize, Self::Error>;
    fn deferred_len(&self) -> Result<usize, Self::Error>;
    fn deferred_add(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    fn deferred_discard(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    fn set_prefill_capacity_bound(&mut self, bound: bool) -> Result<(), Self::Error>;
    /// 0.33's `last_prefill_step` (written only under a local prefill cadence).
    fn set_last_prefill_step(&mut self, step: u64) -> Result<(), Self::Error>;
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
    /// `request.shared_prefix_boundary` (set by the prefix lookup; read by Mamba's split).
    fn shared_prefix_boundary(&self, r: &Self::Req) -> Result<u64, Self::Error>;
    /// The scheduler's own `_mamba_block_aligned_split(request, num_new_tokens)` (the running
    /// pass) or `(request, num_new_tokens, num_new_local_computed_tokens, 0)` (the waiting
    /// pass: `Some(local)`), under [`MambaSplitRule::Custom`].
    fn custom_mamba_split(
        &self,
        r: &Self::Req,
        num_new_tokens: u64,
        num_new_local_computed_tokens: Option<u64>,
    ) -> Result<u64, Self::Error>;
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
    /// `len(spec_token_ids)`: the drafts proposed for the request (read with speculative
    /// decoding only).
    fn num_drafts(&self, r: &Self::Req) -> Result<u64, Self::Error>;
    /// `is_prefill_chunk` (read with speculative decoding only).
    fn is_prefill_chunk(&self, r: &Self::Req) -> Result<bool, Self::Error>;
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
    /// A scheduled row's drafts: `Proposed(k)` puts the first `k` proposed drafts (if any) into
    /// `scheduled_spec_decode_tokens` and empties the request's `spec_token_ids`; `Padding`
    /// puts placeholders there.
    fn schedule_drafts(&mut self, r: &Self::Req, d: Drafts) -> Result<(), Self::Error>;
    /// A PRIORITY preemption took back a row scheduled this step: its drafts leave
    /// `scheduled_spec_decode_tokens`.
    fn unschedule_drafts(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    /// `update_from_output` for a row with drafts: `make_spec_decoding_stats` and the
    /// request's `spec_decode_metrics`.
    fn record_drafts(
        &mut self,
        r: &Self::Req,
        drafts: u64,
        accepted: u64,
    ) -> Result<(), Self::Error>;
    /// `structured_output_manager.accept_tokens(request, kept_tokens)` for a row with kept
    /// tokens, structured output or not: false when the grammar rejects them (vLLM's own
    /// manager accepts a row without structured output at once; an engine may answer that
    /// without asking it).
    fn accept_tokens(&mut self, r: &Self::Req, s: &Self::Sampled) -> Result<bool, Self::Error>;
    /// `_preempt_request(request, timestamp)` (the request is already out of `running`).
    fn preempt(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    /// The prefix lookup of a request with nothing computed: `_get_local_prefix_cache_hit`
    /// and, with a KV connector, what it loads past that hit (vLLM's lookup block, the
    /// connector's `get_num_new_matched_tokens` included); also the first admission's
    /// prefill stats and, with KV fetch tracking, the request's fetch stage. `None`: the
    /// connector cannot tell yet (the request is skipped this step).
    fn prefix_hit(&mut self, r: &Self::Req)
        -> Result<Option<PrefixHit<Self::Blocks>>, Self::Error>;
    fn record_prefix_cache_stats(&mut self, r: &Self::Req, hit: u64) -> Result<(), Self::Error>;
    /// `record_event(SCHEDULED, timestamp)` when stats are on.
    fn record_scheduled(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    fn free_request(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    /// `resumable`: a streaming session (a stop ends its turn, not the request).
    fn resumable(&self, r: &Self::Req) -> Result<bool, Self::Error>;
    /// `_handle_stopped_request` for a stopped resumable request: the turn's in-flight work
    /// dropped, then its next queued update applied (`_update_request_as_session`: status
    /// `WAITING`) or it waits for input (`WAITING_FOR_STREAMING_REQ`). True when a final
    /// (`None`) update ends the session (the walk then frees it). 0.32's also enqueues a
    /// continuing request (`_enqueue_waiting_request`); 0.33's leaves that to the walk.
    fn handle_stopped(&mut self, r: &Self::Req) -> Result<bool, Self::Error>;
    /// `_enqueue_waiting_request`: `kv_holding_waiting` when the request holds KV blocks,
    /// else `waiting` (and `deferred_waiting` in a blocked status).
    fn enqueue_waiting(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    /// Out of `running` (the running ones), the waiting queues (the others).
    fn remove_stopped(
        &mut self,
        running: &[Self::Req],
        other: &[Self::Req],
    ) -> Result<(), Self::Error>;

    // The KV cache manager.
    /// `allocate_slots` (the hit to adopt in `a.new_computed`): the new block ids (empty in
    /// every group: none new), `None` when they do not fit. An engine over a hybrid manager
    /// reads the request's `num_in_flight_tokens` itself, as vLLM's manager does.
    fn allocate(
        &mut self,
        r: &Self::Req,
        a: &SlotRequest<'_, Self::Blocks>,
    ) -> Result<Option<Self::Blocks>, Self::Error>;
    /// `cache_blocks(request, num_tokens)` (nothing with caching off).
    fn cache_blocks(&mut self, r: &Self::Req, num_tokens: u64) -> Result<(), Self::Error>;
    /// `get_blocks(request_id)`: the request's table in every group.
    fn block_table(&self, r: &Self::Req) -> Result<Self::Blocks, Self::Error>;

    // A KV connector (vLLM's KV transfer). The defaults are an engine without one.
    /// `_holds_kv_blocks`: where a skipped request goes back (`kv_holding_waiting` when
    /// true): it has computed tokens, or (vLLM's other case) waits for remote KV.
    fn holds_kv_blocks(&self, r: &Self::Req) -> Result<bool, Self::Error> {
        Ok(self.num_computed_tokens(r)? > 0)
    }
    /// After a waiting request's `allocate_slots`: the connector's
    /// `update_state_after_alloc(request, blocks, num_external)` and its prefix-cache stats
    /// (`queries`: the tokens past the local hit at a lookup, else 0); a request admitted
    /// now (not `load_async`) leaves KV fetch tracking.
    fn connector_allocated(
        &mut self,
        _r: &Self::Req,
        _num_external: u64,
        _queries: u64,
        _load_async: bool,
    ) -> Result<(), Self::Error> {
        Ok(())
    }
    /// An asynchronous load starts: `WAITING_FOR_REMOTE_KVS` with `num_computed` tokens (the
    /// local hit and the load), among the in-flight prefills, fetch stage "in progress".
    fn start_remote_load(&mut self, _r: &Self::Req, _num_computed: u64) -> Result<(), Self::Error> {
        Err(self.error(crate::Error::invalid(
            "an asynchronous KV load without a connector",
        )))
    }
    /// Before an asynchronous load's `allocate_slots`: the blocks it leaves to the in-flight
    /// prefills (`_inflight_prefill_reserved_blocks() + _spec_decode_step_blocks`), and the
    /// connector asked for the groups it loads (`get_loaded_kv_cache_group_ids`, vLLM's
    /// `skip_zeroing_group_ids`: no group is zeroed in the native managers' scope).
    fn reserved_blocks(&mut self, _r: &Self::Req) -> Result<u64, Self::Error> {
        Ok(0)
    }
    /// `update_from_output`: the request's KV load failed this step (vLLM's
    /// `failed_kv_load_req_ids`, from the connector's failed loads and invalid blocks): its
    /// row takes no tokens (its in-flight and stale counts still drop).
    fn load_failed(&self, _r: &Self::Req) -> Result<bool, Self::Error> {
        Ok(false)
    }
    /// `connector.has_pending_block_frees()`: a running request that does not fit waits
    /// for them instead of preempting.
    fn connector_pending_frees(&mut self) -> Result<bool, Self::Error> {
        Ok(false)
    }
    /// `_request_blocks_can_be_freed(victim)`: false while an in-flight step may still write
    /// its blocks (deferred block frees); preempting it would not help.
    fn blocks_can_be_freed(&mut self, _r: &Self::Req) -> Result<bool, Self::Error> {
        Ok(true)
    }
    /// The step's end with a connector, before `_update_after_schedule`: the output's
    /// `has_sync_kv_loads`, the connector's block state and metadata
    /// (`build_connector_meta`), the deferred-free step count.
    fn connector_step_end(
        &mut self,
        _out: &mut Self::Scheduled,
        _sync_kv_loads: bool,
    ) -> Result<(), Self::Error> {
        Ok(())
    }

    // Multimodal encoder inputs: called only for requests with `has_encoder_inputs`.
    /// `has_encoder_inputs` (fixed at construction: the request has multimodal inputs).
    fn has_encoder_inputs(&self, r: &Self::Req) -> bool;
    /// `max_num_encoder_input_tokens`: the encoder compute budget a step starts with.
    fn encoder_budget(&mut self) -> Result<u64, Self::Error>;
    /// `_try_schedule_encoder_inputs(r, num_computed, n, budget)`. The engine keeps the chosen
    /// inputs until [`Engine::commit_encoder_inputs`] for `r` (the next call replaces them).
    fn schedule_encoder_inputs(
        &mut self,
        r: &Self::Req,
        num_computed: u64,
        n: u64,
        budget: u64,
    ) -> Result<EncoderPlan, Self::Error>;
    /// The row of the last plan (one that scheduled inputs) is committed: its inputs join
    /// the step's `scheduled_encoder_inputs` and `_allocate_encoder_inputs` runs.
    fn commit_encoder_inputs(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    /// A PRIORITY preemption took back a committed row: out of `scheduled_encoder_inputs`.
    fn drop_encoder_inputs(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    /// `encoder_cache_manager.free(r)`: an admission whose blocks did not fit.
    fn free_encoder_cache(&mut self, r: &Self::Req) -> Result<(), Self::Error>;
    /// `_free_encoder_inputs(r)`: `update_from_output` frees the inputs the step consumed.
    fn free_encoder_inputs(&mut self, r: &Self::Req) -> Result<(), Self::Error>;

    // What leaves the scheduler.
    /// The step's output, built before `_update_after_schedule` writes the requests.
    fn scheduler_output(
        &mut self,
        step: &Step<Self::Req, Self::Blocks>,
    ) -> Result<Self::Scheduled, Self::Error>;
    /// `_update_after_schedule` found structured-output rows: the output's flags become
    /// those of `s` (called only when one is set). `grammar_rows` are the structured-output
    /// rows past their prefill in the output's order: the requests vLLM's
    /// `get_grammar_bitmask` gives a bitmask row each, unless one leaves the scheduler first.
    fn mark_structured_output(
        &mut self,
        out: &mut Self::Scheduled,
        s: StructuredFlags,
        grammar_rows: &[&Self::Req],
    ) -> Result<(), Self::Error>;
    /// The rows `update_from_output` walks: `(request, num_scheduled_tokens, num_drafts)` in
    /// the scheduler output's order (`num_drafts`: its `scheduled_spec_decode_tokens`),
    /// requests no longer in the scheduler left out.
    fn scheduled_rows(&mut self) -> Result<Vec<ScheduledRow<Self::Req>>, Self::Error>;
    /// The model runner's sampled tokens for the row (an error when it has none).
    fn sampled(&mut self, r: &Self::Req) -> Result<Self::Sampled, Self::Error>;
    /// A pooling request (`pooling_params`) whose pooler output arrived with this step's
    /// model output (vLLM's `request.pooling_params and pooler_output is not None`): the
    /// output carries it and the request stops.
    fn pooled(&mut self, r: &Self::Req) -> Result<bool, Self::Error>;
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
