//! vLLM v1's scheduling step for the path pagedkv runs natively: `Scheduler.schedule()` (the
//! running pass, preemption, the waiting pass, `_update_after_schedule`) and
//! `update_from_output()` (`_update_request_with_output`, `check_stop`, freeing finished
//! requests), over any [`Engine`]. The numbers are [`super::policy`]'s rules; this file is the
//! order vLLM applies them in, with the release and scheduler switches of [`Mode`].
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
    BlockIds, Drafts, Engine, MambaSplitRule, Mode, Queue, Release, Row, Runner, Settings, Status,
    Step, StructuredFlags,
};
use super::mamba_split::SplitRow;
use super::policy::{self, Budget, RunningRow, Stop};
use super::SlotRequest;
use crate::Error;
use std::collections::HashSet;

mod drafts;
mod encoder;

/// What the waiting pass does with the head of `waiting`.
enum Admit {
    Scheduled,
    /// Nothing more is admitted this step.
    Full,
    /// Skipped this step (deferred), the pass goes on.
    Skip,
}

/// The requests the waiting pass skipped, by the queue each goes back to (each list in
/// the order it is put back: the last skipped first).
struct Skipped<R> {
    waiting: Vec<R>,
    kv_holding: Vec<R>,
}

impl<R> Default for Skipped<R> {
    fn default() -> Self {
        Skipped {
            waiting: Vec::new(),
            kv_holding: Vec::new(),
        }
    }
}

/// A row whose request stopped: whether it was running, and whether it goes on (a
/// streaming session's next turn).
struct Stopped {
    was_running: bool,
    continues: bool,
}

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
    /// Rows the running pass scheduled (`scheduled_running_reqs`).
    running_rows: usize,
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
            running_rows: 0,
            set,
            enc: encoder::EncoderStep::new(),
        })
    }

    fn invalid(&self, what: &str) -> E::Error {
        self.e.error(Error::invalid(what))
    }

    /// `Scheduler.schedule()`: the running pass, then (when it preempted nothing) the waiting
    /// pass; the engine builds the output before `_update_after_schedule` advances the rows.
    pub fn schedule(mut self) -> Result<E::Scheduled, E::Error> {
        let start = self.e.begin_schedule(&self.mode)?;
        let step = start.current_step + 1;
        self.e.set_current_step(step)?;
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
        if !preempted {
            self.waiting_pass(threshold, &mut budget, &mut rows)?;
        }
        let total: u64 = rows.iter().map(|r| r.tokens).sum();
        if let (Some(n), true) = (start.num_executed_steps, total > 0) {
            self.e.set_num_executed_steps(n + 1)?;
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
        let flags = self.update_after_schedule(step, &out.rows)?;
        if flags != StructuredFlags::default() {
            self.e.mark_structured_output(&mut scheduled, flags)?;
        }
        Ok(scheduled)
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
            let victim = self.pick_victim(i, rows, budget)?;
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

    /// Take the preemption victim out of `running`: FCFS, the last; PRIORITY, the first
    /// maximum of `(priority, arrival_time)`, giving back what it was scheduled this step.
    fn pick_victim(
        &mut self,
        i: &mut usize,
        rows: &mut Rows<E>,
        budget: &mut Budget,
    ) -> Result<E::Req, E::Error> {
        if !self.set.priority {
            // The request that needs the blocks is running, so `running` is not empty; an
            // engine whose list changed under the walk gets an error, not an underflow.
            let Some(last) = self.e.running_len().checked_sub(1) else {
                return Err(self.invalid("a preemption found no running request"));
            };
            return self.e.running_remove(last);
        }
        let keys = self.e.running_priority_keys()?;
        let at = policy::priority_victim(keys).unwrap_or(0);
        let victim = self.e.running_remove(at)?;
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

    /// The waiting pass: admit from the head of `kv_holding_waiting` while it has requests,
    /// then of `waiting`, while requests fit and `running` plus the sessions waiting for input
    /// stay under the active limit; a skipped request (deferred) goes back at the head of the
    /// queue its KV blocks say (`_holds_kv_blocks`) after the pass.
    fn waiting_pass(
        &mut self,
        threshold: u64,
        budget: &mut Budget,
        rows: &mut Rows<E>,
    ) -> Result<(), E::Error> {
        let mut skipped = Skipped::default();
        let mut loras = self.running_loras(rows)?;
        // Paused sessions are not in `running` but keep a model-runner slot; the count
        // changes only outside `schedule()`.
        let paused = self.e.num_waiting_for_streaming_input()?;
        while budget.tokens > 0 {
            let q = match self.e.waiting_len(Queue::KvHolding)? {
                0 => Queue::Waiting,
                _ => Queue::KvHolding,
            };
            if self.e.waiting_len(q)? == 0 || !budget.has_input() {
                break;
            }
            if self.e.running_len() + paused >= self.set.max_num_active_reqs {
                break;
            }
            let req = self.e.waiting_peek(q)?;
            let admitted = match self.must_skip(&req, loras.as_ref())? {
                true => Admit::Skip,
                false => self.admit(q, &req, threshold, budget, rows)?,
            };
            match admitted {
                Admit::Scheduled => {}
                Admit::Full => break,
                Admit::Skip => {
                    self.skip(q, &mut skipped)?;
                    continue;
                }
            }
            if let (Some(set), Some(id)) = (loras.as_mut(), self.e.lora_id(&req)) {
                set.insert(id);
            }
        }
        self.requeue_skipped(skipped)?;
        let waiting = self.e.waiting_len(Queue::Waiting)? + self.e.waiting_len(Queue::KvHolding)?;
        let bound = waiting > self.e.deferred_len()?;
        self.e.set_prefill_capacity_bound(bound)
    }

    /// vLLM's `skip_request`: the head of `q` leaves it, deferred, to be put back after the
    /// pass ahead of the requests skipped before it: into `kv_holding_waiting` when it holds
    /// KV blocks (`num_computed_tokens > 0`), else into `waiting`.
    fn skip(&mut self, q: Queue, skipped: &mut Skipped<E::Req>) -> Result<(), E::Error> {
        let r = self.e.waiting_pop(q)?;
        self.e.deferred_add(&r)?;
        match self.e.num_computed_tokens(&r)? > 0 {
            true => skipped.kv_holding.insert(0, r),
            false => skipped.waiting.insert(0, r),
        }
        Ok(())
    }

    /// The skipped requests back at the heads of their queues (`kv_holding_waiting` first).
    fn requeue_skipped(&mut self, skipped: Skipped<E::Req>) -> Result<(), E::Error> {
        if !skipped.kv_holding.is_empty() {
            self.e
                .waiting_prepend(Queue::KvHolding, skipped.kv_holding)?;
        }
        if !skipped.waiting.is_empty() {
            self.e.waiting_prepend(Queue::Waiting, skipped.waiting)?;
        }
        Ok(())
    }

    /// Whether the waiting pass skips the head of `waiting` this step (vLLM's `skip_request`):
    /// blocked (a grammar not compiled yet), deliverable stale output still in flight, or a
    /// LoRA adapter that would exceed `max_loras`; in that order.
    fn must_skip(&mut self, req: &E::Req, loras: Option<&HashSet<i64>>) -> Result<bool, E::Error> {
        if self.e.status(req)? == Status::OtherWaiting && !self.e.unblock(req)? {
            return Ok(true);
        }
        if self.e.num_stale_output_tokens(req)? > 0 && !self.e.drop_stale_output(req)? {
            return Ok(true);
        }
        Ok(match (loras, self.e.lora_id(req), self.set.max_loras) {
            (Some(set), Some(id), Some(max)) => set.len() == max && !set.contains(&id),
            _ => false,
        })
    }

    /// With a LoRA limit: the adapters (ids above 0) of the running requests (0.33: all of
    /// `running`, scheduled this step or not; 0.32: the running pass's rows), which the
    /// waiting pass grows by each admitted request's adapter.
    fn running_loras(
        &mut self,
        rows: &[Row<E::Req, E::Blocks>],
    ) -> Result<Option<HashSet<i64>>, E::Error> {
        if self.set.max_loras.is_none() {
            return Ok(None);
        }
        let running = match self.mode.release {
            Release::V033 => (0..self.e.running_len())
                .map(|i| self.e.running_at(i))
                .collect::<Result<Vec<_>, _>>()?,
            Release::V032 => rows[..self.running_rows]
                .iter()
                .map(|r| r.req.clone())
                .collect(),
        };
        let ids = running.iter().filter_map(|r| self.e.lora_id(r));
        Ok(Some(ids.filter(|&id| id > 0).collect()))
    }

    /// Admit the head of `q` (a prefix lookup when nothing is computed, then
    /// `allocate_slots`); a request whose encoder inputs leave it no token is skipped.
    fn admit(
        &mut self,
        q: Queue,
        req: &E::Req,
        threshold: u64,
        budget: &mut Budget,
        rows: &mut Rows<E>,
    ) -> Result<Admit, E::Error> {
        let computed_before = self.e.num_computed_tokens(req)?;
        let lookup = computed_before == 0;
        let (hit, num_local) = match lookup {
            true => self.e.prefix_hit(req)?,
            false => (None, 0),
        };
        let num_computed = if lookup { num_local } else { computed_before };
        let num_tokens = self.e.num_tokens(req);
        let lim = &self.set.limits;
        let pad = self.draft_padding(num_computed);
        let Some((n, padded)) =
            policy::waiting_tokens(lim, num_tokens, num_computed, threshold, budget, pad)
        else {
            return Ok(Admit::Full);
        };
        if n == 0 {
            return Err(self.invalid("a waiting request with nothing to schedule"));
        }
        let split = self.mamba_split_admitted(req, (num_computed, num_local), n, padded)?;
        let Some((n, padded)) = split else {
            return Ok(Admit::Full);
        };
        let n = self.encoder_tokens(req, num_computed, n)?;
        let n = self.reserve_prefill_lookahead(num_tokens, num_computed, n);
        if n == 0 {
            // No token before an encoder input that does not fit, or none left out of the
            // drafter's prefill lookahead: 0.33 skips the request, 0.32 ends the waiting pass.
            return Ok(match self.mode.release {
                Release::V033 => Admit::Skip,
                Release::V032 => Admit::Full,
            });
        }
        let status = self.e.status(req)?;
        let slots = SlotRequest {
            num_computed_tokens: computed_before,
            num_tokens,
            waiting_or_preempted: status.waiting_or_preempted(),
            num_new_tokens: n,
            num_new_computed_tokens: num_local,
            new_computed: hit.as_ref(),
            num_lookahead_tokens: self.set.spec.num_lookahead_tokens,
            full_sequence_must_fit: self.set.reserve_full_isl,
            has_scheduled_reqs: self.e.running_len() > 0,
            ..SlotRequest::default()
        };
        if self.e.allocate(req, &slots)?.is_none() {
            self.encoder_unfit(req)?;
            return Ok(Admit::Full);
        }
        if lookup {
            self.e.record_prefix_cache_stats(req, num_local)?;
        }
        let drafts = match padded {
            true => self.set.spec.num_spec_tokens,
            false => 0,
        };
        self.start_running(q, req, (n, drafts), num_computed, budget, rows)?;
        Ok(Admit::Scheduled)
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

    /// The waiting pass's split: `None` when it leaves no token (the pass ends, as vLLM's
    /// `break`); a padded decode the split would shorten loses its padding instead.
    fn mamba_split_admitted(
        &self,
        req: &E::Req,
        (start, local): (u64, u64),
        n: u64,
        padded: bool,
    ) -> Result<Option<(u64, bool)>, E::Error> {
        let split = self.mamba_split(req, start, n, Some(local))?;
        Ok(match split {
            0 => None,
            s if padded && s != 1 + self.set.spec.num_spec_tokens => Some((1, false)),
            s => Some((s, padded)),
        })
    }

    /// `scheduled`: the tokens and the padding drafts (0: not padded).
    fn start_running(
        &mut self,
        q: Queue,
        peeked: &E::Req,
        scheduled: (u64, u64),
        num_computed: u64,
        budget: &mut Budget,
        rows: &mut Rows<E>,
    ) -> Result<(), E::Error> {
        let (n, drafts) = scheduled;
        let req = self.e.waiting_pop(q)?;
        debug_assert!(req == *peeked);
        self.e.deferred_discard(&req)?;
        self.e.running_push(&req)?;
        self.e.record_scheduled(&req)?;
        let resumed = self.e.status(&req)? != Status::Waiting;
        let table = self.e.block_table(&req)?;
        budget.take(n);
        self.e.set_running(&req)?;
        self.e.set_num_computed_tokens(&req, num_computed)?;
        let num_tokens = self.e.num_tokens(&req);
        if num_computed + n < num_tokens {
            self.e.inflight_prefills_add(&req)?;
        }
        let placeholders = self.placeholders(&req)?;
        if self.set.spec.num_spec_tokens > 0 {
            self.note_drafts_needed(&req, num_computed, n, num_tokens, placeholders)?;
        }
        if drafts > 0 {
            self.e.schedule_drafts(&req, Drafts::Padding(drafts))?;
        }
        self.commit_encoder(&req)?;
        rows.push(Row {
            req,
            tokens: n,
            blocks: (!table.is_empty()).then_some(table),
            resumed,
            num_computed_tokens: num_computed,
            num_tokens,
            placeholders,
            drafts,
        });
        Ok(())
    }

    /// `_update_after_schedule`: each row advances by its tokens; under `AsyncScheduler` a
    /// row that completes its prefill (or decodes) gets an output placeholder.
    /// Returns the output's structured-output flags.
    fn update_after_schedule(
        &mut self,
        step: u64,
        rows: &[Row<E::Req, E::Blocks>],
    ) -> Result<StructuredFlags, E::Error> {
        let any_inflight = self.e.inflight_prefills_len()? > 0;
        let mut flags = StructuredFlags::default();
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
        Ok(flags)
    }

    /// `Scheduler.update_from_output()`: each scheduled row takes its sampled tokens; the
    /// stopped requests are freed (a streaming session's turn ends instead), then removed from
    /// their queues together; 0.33 then enqueues the continuing sessions in output order
    /// (0.32's `_handle_stopped_request` enqueued each already, so one that was not running
    /// leaves its queue again with the removal, as in vLLM 0.32).
    pub fn update_from_output(mut self) -> Result<(), E::Error> {
        let mut stopped_running = Vec::new();
        let mut stopped_other = Vec::new();
        let mut continuing = Vec::new();
        for (req, n, drafts) in self.e.scheduled_rows()? {
            let Some(stopped) = self.update_row(&req, n, drafts)? else {
                continue;
            };
            if stopped.continues {
                continuing.push(req.clone());
            }
            match stopped.was_running {
                true => stopped_running.push(req),
                false => stopped_other.push(req),
            }
        }
        self.e.remove_stopped(&stopped_running, &stopped_other)?;
        if self.mode.release == Release::V033 {
            for req in &continuing {
                self.e.enqueue_waiting(req)?;
            }
        }
        Ok(())
    }

    /// One row of `update_from_output`; `Some` when the request stopped.
    fn update_row(
        &mut self,
        req: &E::Req,
        n: u64,
        drafts: u64,
    ) -> Result<Option<Stopped>, E::Error> {
        let in_flight = self.e.num_in_flight_tokens(req)?;
        self.e
            .set_num_in_flight_tokens(req, in_flight.saturating_sub(n))?;
        let stale_tokens = self.e.num_stale_output_tokens(req)?;
        let stale = stale_tokens > 0;
        if stale {
            self.e
                .set_num_stale_output_tokens(req, stale_tokens.saturating_sub(n))?;
        }
        let status = self.e.status(req)?;
        let was_running = status == Status::Running;
        // Aborted or finished while in flight; or stale output the request drops.
        if status == Status::Finished || (stale && self.e.drop_stale_output(req)?) {
            return Ok(None);
        }
        let mut sampled = self.e.sampled(req)?;
        let returned = self.e.sampled_len(&sampled);
        if drafts > 0 && returned > 0 {
            self.reject_drafts(req, drafts, returned as u64, stale)?;
        }
        // After the rollback, as in vLLM: the inputs freed are those behind the computed
        // tokens that remain.
        self.encoder_done(req)?;
        let mut stop = None;
        if returned > 0 {
            stop = self.update_request_with_output(req, &mut sampled, stale)?;
            let kept = self.e.sampled_len(&sampled);
            self.resolve_placeholders(req, stale, was_running, returned, kept)?;
            if self.e.uses_structured_output(req) && !self.e.accept_tokens(req, &sampled)? {
                // vLLM logs the rejection and finishes the request with an error.
                self.e.set_stopped(req, Stop::Error)?;
                stop = Some(Stop::Error);
            }
        } else if self.e.pooled(req)? {
            self.e.set_stopped(req, Stop::Pooled)?;
            stop = Some(Stop::Pooled);
        }
        let emit = returned > 0 || stop.is_some();
        let pending = self.e.begin_output(req, &sampled, emit)?;
        let continues = match stop {
            Some(_) => self.handle_stopped(req)?,
            None => false,
        };
        self.e.emit_output(req, pending, sampled, stop, emit)?;
        Ok(stop.map(|_| Stopped {
            was_running,
            continues,
        }))
    }

    /// A stopped request is freed, unless it is a streaming session whose turn ended and
    /// that goes on (then true: it is to be enqueued again).
    fn handle_stopped(&mut self, req: &E::Req) -> Result<bool, E::Error> {
        if self.e.resumable(req)? && !self.e.handle_stopped(req)? {
            return Ok(true);
        }
        self.e.free_request(req)?;
        Ok(false)
    }

    /// `_update_request_with_output`: append the sampled tokens one by one, stop at the first
    /// `check_stop` stops on and drop the rest (0.33 also takes them off the computed tokens).
    fn update_request_with_output(
        &mut self,
        req: &E::Req,
        sampled: &mut E::Sampled,
        stale: bool,
    ) -> Result<Option<Stop>, E::Error> {
        let rule = self.e.stop_rule(req);
        let count = self.e.sampled_len(sampled);
        let cap = self.set.limits.max_model_len;
        for k in 0..count {
            let last = self.e.append_output_token(req, sampled, k)?;
            let num_tokens = self.e.num_tokens(req);
            let num_out = self.e.num_output_tokens(req)?;
            let mut stop = policy::check_stop(&rule, last, num_tokens, num_out, cap);
            if let (None, Some(rep)) = (stop, policy::repetition_due(&rule, num_out)) {
                if self.e.repeats(req, rep)? {
                    stop = Some(Stop::Repetition);
                }
            }
            let Some(stop) = stop else {
                continue;
            };
            self.e.set_stopped(req, stop)?;
            let kept = k + 1;
            if kept < count {
                if self.mode.release == Release::V033 && !stale {
                    let c = self.e.num_computed_tokens(req)?;
                    let trimmed = (count - kept) as u64;
                    self.e
                        .set_num_computed_tokens(req, c.saturating_sub(trimmed))?;
                }
                self.e.truncate_sampled(sampled, kept)?;
            }
            return Ok(Some(stop));
        }
        Ok(None)
    }

    /// The async placeholders a row's output resolves, and the blocks it lets be cached: 0.33
    /// resolves by every returned token and caches up to the computed tokens not in flight;
    /// 0.32 resolves by the kept tokens and caches up to the computed tokens not placeholders.
    /// Stale output (from before a preemption) resolves nothing.
    fn resolve_placeholders(
        &mut self,
        req: &E::Req,
        stale: bool,
        was_running: bool,
        returned: usize,
        kept: usize,
    ) -> Result<(), E::Error> {
        let spec_033 = self.set.spec.num_spec_tokens > 0 && self.mode.release == Release::V033;
        if !self.mode.asynchronous && !spec_033 {
            return Ok(());
        }
        let before = self.placeholders(req)?;
        let cache_upto = match self.mode.release {
            Release::V033 => {
                if !stale && before > 0 {
                    let left = before.saturating_sub(returned as u64);
                    self.e.set_num_output_placeholders(req, left)?;
                }
                // 0.33 also caches after every step with speculative decoding.
                if stale || !was_running || (before == 0 && !spec_033) {
                    return Ok(());
                }
                let in_flight = self.e.num_in_flight_tokens(req)?;
                self.e.num_computed_tokens(req)?.saturating_sub(in_flight)
            }
            Release::V032 => {
                let left = match stale {
                    true => before,
                    false => before.saturating_sub(kept as u64),
                };
                if !stale {
                    self.e.set_num_output_placeholders(req, left)?;
                }
                if !was_running {
                    return Ok(());
                }
                self.e.num_computed_tokens(req)?.saturating_sub(left)
            }
        };
        self.e.cache_blocks(req, cache_upto)
    }
}
