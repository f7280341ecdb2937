//! The walk's waiting pass (the second loop of vLLM's `Scheduler.schedule()`, `while
//! token_budget > 0` over `kv_holding_waiting` then `waiting`): the admission of each head (the
//! prefix lookup, `get_computed_blocks`, when nothing is computed; the token count, Mamba's
//! split, the encoder and prefill-lookahead caps; `allocate_slots`) and its move into
//! `running`; `skip_request` and the put-back of the skipped requests after the pass; the
//! LoRA limit (`max_loras`).
//!
//! Release differences: a request whose encoder inputs or the drafter's prefill lookahead
//! leave it no token is skipped on 0.33 and ends the pass on 0.32; the adapters counted
//! against `max_loras` start from all of `running` on 0.33 and from the running pass's rows on
//! 0.32. A padded one-token decode (`1 + num_spec_tokens`) that Mamba's "align" split would
//! shorten loses its padding instead. The steps both passes share
//! (`_mamba_block_aligned_split`, `_reserve_prefill_lookahead`) stay in the parent module.
//!
//! Invariants: the pass runs only when the running pass preempted nothing; it pops only the
//! head it peeked; a skipped request is deferred, and goes back after the pass at the head of
//! the queue its KV blocks say, the last skipped first.
//!
//! Cost: O(1) engine calls per admitted or skipped request (a skip also shifts the list of
//! those skipped before it), plus, with a LoRA limit, O(running) once per step.

use super::{Rows, Walk};
use crate::vllm_v1::engine::{BlockIds, Drafts, Engine, PrefixHit, Queue, Release, Row, Status};
use crate::vllm_v1::policy::{self, Budget};
use crate::vllm_v1::SlotRequest;
use std::collections::HashSet;

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

impl<E: Engine> Walk<'_, E> {
    /// The waiting pass: admit from the head of `kv_holding_waiting` while it has requests,
    /// then of `waiting`, while requests fit and `running` plus the sessions waiting for input
    /// stay under the active limit; a skipped request (deferred) goes back at the head of the
    /// queue its KV blocks say (`_holds_kv_blocks`) after the pass.
    pub(super) fn waiting_pass(
        &mut self,
        threshold: u64,
        budget: &mut Budget,
        rows: &mut Rows<E>,
        mut loras: Option<HashSet<i64>>,
    ) -> Result<(), E::Error> {
        let mut skipped = Skipped::default();
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
        if self.defer_prefills {
            return Ok(());
        }
        // A releasing step records whether it was capacity-bound.
        let waiting = self.e.waiting_len(Queue::Waiting)? + self.e.waiting_len(Queue::KvHolding)?;
        let bound = waiting > self.e.deferred_len()?;
        self.e.set_prefill_capacity_bound(bound)
    }

    /// vLLM's `skip_request`: the head of `q` leaves it, deferred, to be put back after the
    /// pass ahead of the requests skipped before it: into `kv_holding_waiting` when it holds
    /// KV blocks (`_holds_kv_blocks`), else into `waiting`.
    fn skip(&mut self, q: Queue, skipped: &mut Skipped<E::Req>) -> Result<(), E::Error> {
        let r = self.e.waiting_pop(q)?;
        self.e.deferred_add(&r)?;
        match self.e.holds_kv_blocks(&r)? {
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
    /// waiting pass grows by each admitted request's adapter. More than `max_loras` is
    /// refused as vLLM asserts: only 0.32 reaches it (its waiting pass admits another
    /// adapter while a running LoRA request goes unscheduled, and a later step schedules
    /// both).
    pub(super) fn running_loras(
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
        let set: HashSet<i64> = ids.filter(|&id| id > 0).collect();
        if self.set.max_loras.is_some_and(|max| set.len() > max) {
            return Err(self.invalid("more LoRA adapters scheduled than max_loras"));
        }
        Ok(Some(set))
    }

    /// Admit the head of `q` (a prefix lookup when nothing is computed, then
    /// `allocate_slots`); a request whose encoder inputs leave it no token is skipped, as is
    /// one whose KV connector cannot tell its hit yet or starts an asynchronous load.
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
        let hit = match lookup {
            true => match self.e.prefix_hit(req)? {
                Some(hit) => hit,
                None => return Ok(Admit::Skip), // the connector cannot tell yet
            },
            false => PrefixHit::local(None, 0),
        };
        let num_tokens = self.e.num_tokens(req);
        let num_computed = match lookup {
            true => hit.num_local.saturating_add(hit.num_external),
            false => computed_before,
        };
        if num_computed > num_tokens || (hit.load_async && hit.num_external == 0) {
            return Err(self.invalid("a prefix hit past the request's tokens, or an empty load"));
        }
        let (n, padded) = match hit.load_async {
            true => (0, false), // nothing runs until the load is done
            false => match self.new_tokens(req, &hit, num_computed, threshold, budget)? {
                Ok(tokens) => tokens,
                Err(stop) => return Ok(stop),
            },
        };
        if !self.allocate_admitted(req, &hit, computed_before, n)? {
            self.encoder_unfit(req)?;
            return Ok(Admit::Full);
        }
        let queries = match lookup {
            true => num_tokens - hit.num_local,
            false => 0,
        };
        self.e
            .connector_allocated(req, hit.num_external, queries, hit.load_async)?;
        if lookup {
            self.e.record_prefix_cache_stats(req, hit.num_local)?;
        }
        if hit.load_async {
            self.e.start_remote_load(req, num_computed)?;
            return Ok(Admit::Skip); // back to `kv_holding_waiting` until the load is done
        }
        self.sync_kv_loads |= hit.num_external > 0;
        let drafts = match padded {
            true => self.set.spec.num_spec_tokens,
            false => 0,
        };
        self.start_running(q, req, (n, drafts), num_computed, budget, rows)?;
        Ok(Admit::Scheduled)
    }

    /// The tokens a waiting request (not loading asynchronously) is scheduled, and whether
    /// they are padded with draft slots; `Err`: what the pass does instead (prefills held
    /// back, no room, or no token left before an encoder input or the prefill lookahead:
    /// 0.33 skips the request, 0.32 ends the pass).
    fn new_tokens(
        &mut self,
        req: &E::Req,
        hit: &PrefixHit<E::Blocks>,
        num_computed: u64,
        threshold: u64,
        budget: &Budget,
    ) -> Result<Result<(u64, bool), Admit>, E::Error> {
        let num_tokens = self.e.num_tokens(req);
        if self.defer_prefills && num_computed + 1 < num_tokens {
            return Ok(Err(Admit::Full)); // prefill compute waits for a releasing step
        }
        let lim = &self.set.limits;
        let pad = self.draft_padding(num_computed);
        let Some((n, padded)) =
            policy::waiting_tokens(lim, num_tokens, num_computed, threshold, budget, pad)
        else {
            return Ok(Err(Admit::Full));
        };
        if n == 0 {
            return Err(self.invalid("a waiting request with nothing to schedule"));
        }
        // A Mamba split never meets a connector's tokens (vLLM's manager keeps them).
        let local = (num_computed, hit.num_local);
        let Some((n, padded)) = self.mamba_split_admitted(req, local, n, padded)? else {
            return Ok(Err(Admit::Full));
        };
        let n = self.encoder_tokens(req, num_computed, n)?;
        let n = self.reserve_prefill_lookahead(num_tokens, num_computed, n);
        if n == 0 {
            return Ok(Err(match self.mode.release {
                Release::V033 => Admit::Skip,
                Release::V032 => Admit::Full,
            }));
        }
        Ok(Ok((n, padded)))
    }

    /// `allocate_slots` for an admitted request: `n` new tokens past the hit it adopts and
    /// the connector's tokens (an asynchronous load: no lookahead slots, its cached blocks
    /// delayed, the in-flight prefills' blocks kept free). False when they do not fit.
    fn allocate_admitted(
        &mut self,
        req: &E::Req,
        hit: &PrefixHit<E::Blocks>,
        computed_before: u64,
        n: u64,
    ) -> Result<bool, E::Error> {
        let status = self.e.status(req)?;
        let (lookahead, reserved_blocks) = match hit.load_async {
            true => (0, self.e.reserved_blocks(req)?),
            false => (self.set.spec.num_lookahead_tokens, 0),
        };
        let slots = SlotRequest {
            num_computed_tokens: computed_before,
            num_tokens: self.e.num_tokens(req),
            waiting_or_preempted: status.waiting_or_preempted(),
            num_new_tokens: n,
            num_new_computed_tokens: hit.num_local,
            new_computed: hit.blocks.as_ref(),
            num_lookahead_tokens: lookahead,
            num_external_computed_tokens: hit.num_external,
            delay_cache_blocks: hit.load_async,
            full_sequence_must_fit: self.set.reserve_full_isl,
            reserved_blocks,
            has_scheduled_reqs: self.e.running_len() > 0,
        };
        Ok(self.e.allocate(req, &slots)?.is_some())
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
        self.prefill_admitted |= num_computed + 1 < num_tokens;
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
}
