//! vLLM v1's scheduling step for the path pagedkv runs natively: `Scheduler.schedule()` (the
//! running pass, preemption, the waiting pass, `_update_after_schedule`) and
//! `update_from_output()` (`_update_request_with_output`, `check_stop`, freeing finished
//! requests), over any [`Engine`]. The numbers are [`super::policy`]'s rules; this module is
//! the order vLLM applies them in, with the release and scheduler switches of [`Mode`].
//!
//! This file holds the step's frame (`schedule()`, `_update_after_schedule`), the running pass
//! with preemption (`_preempt_request`), and the steps both passes share (Mamba's split, the
//! prefill lookahead); its children hold the rest, each method of the one [`Walk`]:
//! * `waiting`: the waiting pass, admission and `skip_request`;
//! * `update`: `update_from_output()`;
//! * `drafts`: speculative decoding's drafts (scheduled, padded, rolled back);
//! * `encoder`: the multimodal encoder budget and cache calls.
//!
//! Sources: `vllm/v1/core/sched/scheduler.py` and `async_scheduler.py` (0.32, 0.33). Cost per
//! step: O(scheduled requests) engine calls, plus O(running) per PRIORITY preemption.
//!
//! Invariants kept between calls (as vLLM's loop keeps them): a live request is in exactly
//! one of `running`, `waiting` and `kv_holding_waiting` (0.32 alone drops a stopped session
//! that was not running from its queue, as vLLM 0.32 does); a request in `kv_holding_waiting`
//! holds KV blocks; `num_waiting_for_streaming_input` counts the sessions there in
//! `WAITING_FOR_STREAMING_REQ` (the walk changes it only through `handle_stopped`).

use super::engine::{
    BlockIds, Engine, MambaSplitRule, Mode, Release, Row, Runner, Settings, Start, Status, Step,
    StructuredFlags,
};
use super::mamba_split::SplitRow;
use super::policy::{self, Budget, RunningRow};
use super::SlotRequest;
use crate::Error;

mod drafts;
mod encoder;
mod update;
mod waiting;

/// A running request's allocation: its new block ids (`None`: it was preempted itself) and
/// whether anything was preempted for it.
struct Allocated<B> {
    ids: Option<B>,
    preempted: bool,
}

/// The rows of a step being built, with the engine's block ids.
type Rows<E> = Vec<Row<<E as Engine>::Req, <E as Engine>::Blocks>>;

/// One call of the walk: the engine, its mode and the settings read at the call's start.
pub struct Walk<'e, E: Engine> {
    e: &'e mut E,
    mode: Mode,
    set: Settings,
    /// `schedule()`'s flags: a scheduled request can use the drafts proposed after the step
    /// (`not skip_drafts`); a running row was a prefill chunk (no draft padding then).
    drafts_needed: bool,
    prefill_scheduled: bool,
    /// `defer_prefills`: no prefill chunk runs and no prefill is admitted this step.
    defer_prefills: bool,
    /// Whether the step stamps `last_prefill_step` (0.33's local prefill cadence), which
    /// then needs `prefill_scheduled` and `prefill_admitted`.
    stamps_prefills: bool,
    /// `prefill_admitted`: a waiting request was admitted with more than a token left.
    prefill_admitted: bool,
    /// Rows the running pass scheduled (`scheduled_running_reqs`).
    running_rows: usize,
    /// `has_sync_kv_loads`: an admitted request loads a connector's tokens with this step.
    sync_kv_loads: bool,
    enc: encoder::EncoderStep<E::Req>,
}

impl<'e, E: Engine> Walk<'e, E> {
    pub fn new(e: &'e mut E, mode: Mode) -> Result<Self, E::Error> {
        let set = e.settings()?;
        Ok(Walk {
            e,
            mode,
            drafts_needed: !set.spec.can_skip_drafts,
            prefill_scheduled: false,
            defer_prefills: false,
            stamps_prefills: false,
            prefill_admitted: false,
            running_rows: 0,
            sync_kv_loads: false,
            set,
            enc: encoder::EncoderStep::new(),
        })
    }

    fn invalid(&self, what: &str) -> E::Error {
        self.e.error(Error::invalid(what))
    }

    /// `Scheduler.schedule(throttle_prefills)`: the running pass, then (when it preempted
    /// nothing) the waiting pass, prefills held back on a deferring step; the engine builds
    /// the output before `_update_after_schedule` advances the rows.
    pub fn schedule(mut self, throttle_prefills: bool) -> Result<E::Scheduled, E::Error> {
        let start = self.e.begin_schedule(&self.mode)?;
        let step = start.current_step + 1;
        self.e.set_current_step(step)?;
        self.defer_prefills = self.prefills_deferred(throttle_prefills, &start)?;
        self.stamps_prefills = start.prefill_gate.interval > 1;
        let mut budget = Budget {
            tokens: self.set.max_num_scheduled_tokens,
            input: self.set.max_num_batched_tokens,
            draft_slots: self.set.spec.draft_slots,
        };
        let threshold =
            policy::long_prefill_threshold(&self.set.limits, start.num_eligible, budget.input);
        let mut rows = Vec::with_capacity(self.e.running_len());
        let preempted = self.running_pass(step, threshold, &mut budget, &mut rows)?;
        let num_running_rows = rows.len();
        self.running_rows = num_running_rows;
        let loras = self.running_loras(&rows)?;
        if !preempted {
            self.waiting_pass(threshold, &mut budget, &mut rows, loras)?;
        }
        let total: u64 = rows.iter().map(|r| r.tokens).sum();
        if let (Some(n), true) = (start.num_executed_steps, total > 0) {
            self.e.set_num_executed_steps(n + 1)?;
        }
        if self.stamps_prefills && (self.prefill_scheduled || self.prefill_admitted) {
            let executed = start.num_executed_steps.unwrap_or(0) + u64::from(total > 0);
            self.e.set_last_prefill_step(executed)?;
        }
        if self.e.running_len() > self.set.max_num_running_reqs {
            return Err(self.invalid("more running requests than max_num_seqs"));
        }
        let out = Step {
            rows,
            num_running_rows,
            total,
            runner: self.set.runner,
            skip_drafts: !self.drafts_needed,
        };
        let mut scheduled = self.e.scheduler_output(&out)?;
        self.e
            .connector_step_end(&mut scheduled, self.sync_kv_loads)?;
        let (flags, grammar_rows) = self.update_after_schedule(step, &out.rows)?;
        if flags != StructuredFlags::default() {
            self.e
                .mark_structured_output(&mut scheduled, flags, &grammar_rows)?;
        }
        Ok(scheduled)
    }

    /// vLLM's `defer_prefills`: [`policy::prefills_may_defer`], and some running request is
    /// decoding (not `is_prefill_chunk`; read only when the rest holds).
    fn prefills_deferred(&mut self, throttle: bool, start: &Start) -> Result<bool, E::Error> {
        let executed = start.num_executed_steps.unwrap_or(0);
        if !policy::prefills_may_defer(throttle, &start.prefill_gate, executed) {
            return Ok(false);
        }
        for i in 0..self.e.running_len() {
            let req = self.e.running_at(i)?;
            if !self.e.is_prefill_chunk(&req)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The running pass: each running request in order gets `policy::running_tokens`; when
    /// its blocks do not fit, `_preempt_request` frees a victim and the allocation is retried.
    /// Returns whether anything was preempted.
    fn running_pass(
        &mut self,
        step: u64,
        threshold: u64,
        budget: &mut Budget,
        rows: &mut Rows<E>,
    ) -> Result<bool, E::Error> {
        let mut preempted_any = false;
        let mut i = 0;
        while i < self.e.running_len() && budget.tokens > 0 && budget.has_input() {
            let req = self.e.running_at(i)?;
            let (row, num_tokens) = self.running_row(&req)?;
            let mut n = policy::running_tokens(&self.set.limits, &row, threshold, budget);
            if n > 0 && self.set.runner == Runner::V2 {
                // The v2 runner's pipeline stagger: `current_step < next_decode_eligible_step`.
                if step < self.e.next_decode_eligible_step(&req)? {
                    n = 0;
                }
            }
            if n > 0 && self.defer_prefills && self.e.is_prefill_chunk(&req)? {
                n = 0; // the chunk waits for a step that runs prefills
            }
            n = self.mamba_split(&req, row.num_computed_tokens, n, None)?;
            n = self.encoder_tokens(&req, row.num_computed_tokens, n)?;
            n = self.reserve_prefill_lookahead(num_tokens, row.num_computed_tokens, n);
            if n == 0 {
                i += 1;
                continue;
            }
            let slots = SlotRequest {
                num_computed_tokens: row.num_computed_tokens,
                num_tokens,
                waiting_or_preempted: self.e.status(&req)?.waiting_or_preempted(),
                num_new_tokens: n,
                num_lookahead_tokens: self.set.spec.num_lookahead_tokens,
                has_scheduled_reqs: true,
                ..SlotRequest::default()
            };
            let blocks = self.allocate_or_preempt(&req, &slots, &mut i, rows, budget)?;
            preempted_any |= blocks.preempted;
            let Some(ids) = blocks.ids else {
                // The request preempted itself: 0.33 goes on under PRIORITY, else the pass ends.
                let priority_033 = self.set.priority && self.mode.release == Release::V033;
                if priority_033 && self.e.status(&req)? == Status::Preempted {
                    continue;
                }
                break;
            };
            budget.take(n);
            if self.set.spec.num_spec_tokens > 0 || self.stamps_prefills {
                // `prefill_scheduled`: read for draft padding and the prefill cadence.
                self.prefill_scheduled |= self.e.is_prefill_chunk(&req)?;
            }
            let drafts = self.running_row_drafts(&req, &row, num_tokens, n)?;
            self.commit_encoder(&req)?;
            rows.push(Row {
                req,
                tokens: n,
                blocks: (!ids.is_empty()).then_some(ids),
                resumed: false,
                num_computed_tokens: row.num_computed_tokens,
                num_tokens,
                placeholders: row.num_output_placeholders,
                drafts,
            });
            i += 1;
        }
        Ok(preempted_any)
    }

    /// `allocate_slots` for a running request, preempting a victim (`_preempt_request`) and
    /// retrying until it fits or the request itself was the victim (then `ids` is `None`).
    fn allocate_or_preempt(
        &mut self,
        req: &E::Req,
        slots: &SlotRequest<'_, E::Blocks>,
        i: &mut usize,
        rows: &mut Rows<E>,
        budget: &mut Budget,
    ) -> Result<Allocated<E::Blocks>, E::Error> {
        let mut preempted = false;
        loop {
            if let Some(ids) = self.e.allocate(req, slots)? {
                return Ok(Allocated {
                    ids: Some(ids),
                    preempted,
                });
            }
            // A connector's pending frees, or a victim whose blocks an in-flight step may
            // still write, would not help now: the request waits (the pass ends).
            let waits = Allocated {
                ids: None,
                preempted,
            };
            if self.e.connector_pending_frees()? {
                return Ok(waits);
            }
            let at = self.victim_index()?;
            if !self.victim_frees_blocks(at)? {
                return Ok(waits);
            }
            let victim = self.take_victim(at, i, rows, budget)?;
            self.e.preempt(&victim)?;
            preempted = true;
            if victim == *req {
                return Ok(Allocated {
                    ids: None,
                    preempted,
                });
            }
        }
    }

    /// The running request's fields the rules read, and its `num_tokens` (without drafts).
    fn running_row(&mut self, req: &E::Req) -> Result<(RunningRow, u64), E::Error> {
        let num_tokens = self.e.num_tokens(req);
        let proposed = match self.set.spec.num_spec_tokens {
            0 => 0,
            _ => self.e.num_drafts(req)?,
        };
        let row = RunningRow {
            num_computed_tokens: self.e.num_computed_tokens(req)?,
            num_tokens_with_spec: num_tokens + proposed,
            num_output_placeholders: self.placeholders(req)?,
            num_prompt_tokens: self.e.num_prompt_tokens(req),
            max_tokens: self.e.max_tokens(req),
        };
        Ok((row, num_tokens))
    }

    /// `num_output_placeholders`: only vLLM's `AsyncScheduler` adds any.
    fn placeholders(&self, req: &E::Req) -> Result<u64, E::Error> {
        match self.mode.asynchronous {
            true => self.e.num_output_placeholders(req),
            false => Ok(0),
        }
    }

    /// The preemption victim's index in `running`: FCFS, the last; PRIORITY, the first
    /// maximum of `(priority, arrival_time)`.
    fn victim_index(&mut self) -> Result<usize, E::Error> {
        if !self.set.priority {
            // The request that needs the blocks is running, so `running` is not empty; an
            // engine whose list changed under the walk gets an error, not an underflow.
            let Some(last) = self.e.running_len().checked_sub(1) else {
                return Err(self.invalid("a preemption found no running request"));
            };
            return Ok(last);
        }
        let keys = self.e.running_priority_keys()?;
        Ok(policy::priority_victim(keys).unwrap_or(0))
    }

    /// `_request_blocks_can_be_freed` for the victim at `at` (asked only of an engine that
    /// defers block frees: `blocks_can_be_freed` answers true otherwise).
    fn victim_frees_blocks(&mut self, at: usize) -> Result<bool, E::Error> {
        let victim = self.e.running_at(at)?;
        self.e.blocks_can_be_freed(&victim)
    }

    /// Take the victim at `at` out of `running`; under PRIORITY it gives back what it was
    /// scheduled this step.
    fn take_victim(
        &mut self,
        at: usize,
        i: &mut usize,
        rows: &mut Rows<E>,
        budget: &mut Budget,
    ) -> Result<E::Req, E::Error> {
        let victim = self.e.running_remove(at)?;
        if !self.set.priority {
            return Ok(victim);
        }
        if at < *i {
            *i -= 1;
        }
        if let Some(k) = rows.iter().position(|r| r.req == victim) {
            let taken = rows.remove(k);
            budget.give_back(taken.tokens);
            if self.set.spec.num_spec_tokens > 0 {
                self.e.unschedule_drafts(&victim)?;
            }
            self.encoder_give_back(&victim)?;
        }
        Ok(victim)
    }

    /// `_reserve_prefill_lookahead` where vLLM applies it, after the encoder caps.
    fn reserve_prefill_lookahead(&self, num_tokens: u64, num_computed: u64, n: u64) -> u64 {
        let lookahead = self.set.spec.prefill_lookahead;
        policy::reserve_prefill_lookahead(num_tokens, num_computed, n, lookahead)
    }

    /// `_mamba_block_aligned_split` where vLLM applies it, before the encoder caps (no-op
    /// without a Mamba group in "align" mode); `start`: the computed tokens, a prefix hit
    /// found this step included (`local`: that hit, in the waiting pass). A split that
    /// returns more than it was asked is held to the tokens asked.
    fn mamba_split(
        &self,
        req: &E::Req,
        start: u64,
        n: u64,
        local: Option<u64>,
    ) -> Result<u64, E::Error> {
        let split = match self.set.mamba_split {
            None => return Ok(n),
            Some(MambaSplitRule::Custom) => self.e.custom_mamba_split(req, n, local)?,
            Some(MambaSplitRule::Vllm(split)) => {
                let row = SplitRow {
                    start,
                    num_prompt_tokens: self.e.num_prompt_tokens(req),
                    num_tokens: self.e.num_tokens(req),
                    shared_prefix_boundary: self.e.shared_prefix_boundary(req)?,
                };
                split.tokens(&row, n)
            }
        };
        Ok(split.min(n))
    }

    /// `_update_after_schedule`: each row advances by its tokens; under `AsyncScheduler` a
    /// row that completes its prefill (or decodes) gets an output placeholder.
    /// Returns the output's structured-output flags and its grammar rows: the
    /// structured-output rows past their prefill, in the output's order (the rows
    /// `get_grammar_bitmask` gives a bitmask row each).
    fn update_after_schedule<'r>(
        &mut self,
        step: u64,
        rows: &'r [Row<E::Req, E::Blocks>],
    ) -> Result<(StructuredFlags, Vec<&'r E::Req>), E::Error> {
        let any_inflight = self.e.inflight_prefills_len()? > 0;
        let mut flags = StructuredFlags::default();
        let mut grammar_rows = Vec::new();
        let eligible = match self.set.runner {
            Runner::V2 => Some(step + self.mode.decode_stagger),
            Runner::V1 => None,
        };
        for r in rows {
            let computed = r.num_computed_tokens + r.tokens;
            self.e.set_num_computed_tokens(&r.req, computed)?;
            let in_flight = self.e.num_in_flight_tokens(&r.req)? + r.tokens;
            self.e.set_num_in_flight_tokens(&r.req, in_flight)?;
            let chunk = computed < r.num_tokens + r.placeholders;
            self.e.set_is_prefill_chunk(&r.req, chunk)?;
            if !chunk && self.e.uses_structured_output(&r.req) {
                grammar_rows.push(&r.req);
                flags.has_requests = true;
                flags.pending_tokens |= self.mode.asynchronous && r.placeholders > 0;
            }
            if !chunk && any_inflight {
                self.e.inflight_prefills_discard(&r.req)?;
            }
            if self.mode.asynchronous && !chunk {
                // The tokens the step samples (none for a pooling model) and its drafts.
                let sampled = self.set.limits.sampled_per_step;
                let placeholders = r.placeholders + sampled + r.drafts;
                self.e.set_num_output_placeholders(&r.req, placeholders)?;
                self.e.set_async_decode(&r.req, eligible)?;
            }
        }
        Ok((flags, grammar_rows))
    }
}
