//! The walk's behaviours over a plain Rust engine ([`TestEngine`]: requests, queues and the
//! core's own v1 manager), each test written from vLLM's scheduler semantics (0.32 / 0.33
//! `scheduler.py`, `async_scheduler.py`, `utils.check_stop`, `_preempt_request`).

use super::coordinator::{Hybrid, HybridSlots};
use super::engine::{
    BlockIds, Drafts, EncoderPlan, Engine, MambaSplitRule, Mode, PrefillGate, PrefixHit, Queue,
    Release, Runner, Settings, SpecSettings, Start, Status, Step, StructuredFlags,
};
use super::policy::{self, Limits, Stop, StopRule};
use super::{Config, HashKey, Manager, SlotRequest, Walk};
use crate::{Error, Result};
use std::collections::{BTreeSet, HashMap, VecDeque};

#[derive(Clone, Debug)]
struct TReq {
    id: String,
    prompt: u64,
    all: Vec<i64>,
    outs: Vec<i64>,
    rule: StopRule,
    status: Status,
    stop: Option<Stop>,
    computed: u64,
    placeholders: u64,
    in_flight: u64,
    stale: u64,
    drop_stale: bool,
    chunk: bool,
    priority: i64,
    arrival: f64,
    next_eligible: u64,
    preemptions: u32,
    lora: Option<i64>,
    /// Structured output: the steps `unblock` answers false before the grammar is ready
    /// (`None`: no structured output), and a token the grammar rejects.
    grammar_wait: Option<u32>,
    grammar_rejects: Option<i64>,
    /// The tokens the grammar accepted.
    accepted: Vec<i64>,
    /// `spec_token_ids`: the drafts proposed for the next step.
    spec: Vec<i64>,
    /// A streaming session (`resumable`), its queued updates (`None`: the final one) and
    /// whether it waits for input (`WAITING_FOR_STREAMING_REQ`).
    resumable: bool,
    updates: VecDeque<Option<Update>>,
    waiting_input: bool,
}

/// A streaming update: the next chunk's prompt tokens and `max_tokens`.
#[derive(Clone, Debug)]
struct Update {
    prompt: Vec<i64>,
    max_tokens: u64,
}

/// The KV cache manager under the test engine: the core's one-group [`Manager`], or its
/// hybrid coordinator ([`Hybrid`], block ids per group), each with the walk's block ids.
trait TestKv {
    type Blocks: BlockIds + Clone + std::fmt::Debug;
    fn allocate(
        &mut self,
        id: &str,
        in_flight: u64,
        a: &SlotRequest<'_, Self::Blocks>,
    ) -> Result<Option<Self::Blocks>>;
    fn free(&mut self, id: &str) -> Result<()>;
    fn table(&self, id: &str) -> Self::Blocks;
}

impl TestKv for Manager {
    type Blocks = Vec<u32>;
    fn allocate(
        &mut self,
        id: &str,
        _: u64,
        a: &SlotRequest<'_, Vec<u32>>,
    ) -> Result<Option<Vec<u32>>> {
        let mut none: &[HashKey] = &[];
        self.allocate_slots(id, a, &mut none)
    }
    fn free(&mut self, id: &str) -> Result<()> {
        Manager::free(self, id)
    }
    fn table(&self, id: &str) -> Vec<u32> {
        self.blocks(id).to_vec()
    }
}

impl TestKv for Hybrid {
    type Blocks = Vec<Vec<u32>>;
    fn allocate(
        &mut self,
        id: &str,
        in_flight: u64,
        a: &SlotRequest<'_, Vec<Vec<u32>>>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        let slots = HybridSlots {
            num_computed_tokens: a.num_computed_tokens,
            num_tokens: a.num_tokens,
            num_in_flight_tokens: in_flight,
            waiting_or_preempted: a.waiting_or_preempted,
            num_new_tokens: a.num_new_tokens,
            num_new_computed_tokens: a.num_new_computed_tokens,
            new_computed: a.new_computed.map(Vec::as_slice),
            num_lookahead_tokens: a.num_lookahead_tokens,
            num_external_computed_tokens: a.num_external_computed_tokens,
            delay_cache_blocks: a.delay_cache_blocks,
            full_sequence_must_fit: a.full_sequence_must_fit,
            reserved_blocks: a.reserved_blocks,
            has_scheduled_reqs: a.has_scheduled_reqs,
            // caching is off in these tests: retention never reads the request's boundaries
            boundaries: Default::default(),
        };
        let mut none: &[HashKey] = &[];
        self.allocate_slots(id, &slots, &mut none)
    }
    fn free(&mut self, id: &str) -> Result<()> {
        Hybrid::free(self, id)
    }
    fn table(&self, id: &str) -> Vec<Vec<u32>> {
        self.blocks(id)
    }
}

struct TestEngine<K: TestKv = Manager> {
    reqs: Vec<TReq>,
    /// Requests still in the scheduler's `requests` dict (an abort removes one).
    known: BTreeSet<usize>,
    running: Vec<usize>,
    waiting: VecDeque<usize>,
    kv_holding: VecDeque<usize>,
    /// `num_waiting_for_streaming_input`.
    paused: usize,
    /// The release whose `_handle_stopped_request` / `_update_request_as_session` it mirrors.
    release: Release,
    deferred: BTreeSet<usize>,
    inflight: BTreeSet<usize>,
    mgr: K,
    /// The last `schedule()`'s rows with their block ids (`Row::blocks`).
    tables: Vec<(usize, Option<K::Blocks>)>,
    set: Settings,
    step: u64,
    executed: u64,
    /// The prefill gate's state (`prefill_capacity_bound`, 0.33's cadence) and the next
    /// `schedule()`'s `throttle_prefills`.
    gate: PrefillGate,
    throttle: bool,
    /// The last `schedule()`'s rows (what `update_from_output` walks).
    scheduled: Vec<(usize, u64)>,
    /// The tokens the model returns for each request at the next update.
    next: HashMap<usize, Vec<i64>>,
    /// Pooling requests whose pooler output arrives at the next update.
    pooled: BTreeSet<usize>,
    /// Emitted outputs: (request, tokens, finish).
    outputs: Vec<(usize, Vec<i64>, Option<Stop>)>,
    freed: Vec<usize>,
    /// The last `schedule()`'s structured-output flags.
    structured_step: StructuredFlags,
    /// The last `mark_structured_output`'s grammar rows (empty when it was not called).
    grammar_rows: Vec<usize>,
    /// `scheduled_spec_decode_tokens` being built, and the last `schedule()`'s.
    drafts_building: HashMap<usize, Vec<i64>>,
    drafts: HashMap<usize, Vec<i64>>,
    skip_drafts: bool,
    /// `record_drafts` calls: (request, drafts, accepted); `cache_blocks` calls.
    recorded: Vec<(usize, u64, u64)>,
    cached: Vec<(usize, u64)>,
    /// Multimodal requests and the encoder cache (`walk_mm_tests`).
    mm: walk_mm_tests::MmSim,
    /// A KV connector (`walk_connector_tests`; answers nothing unless told).
    kv: connector::ConnectorSim,
}

const EOS: i64 = 2;

impl TestEngine<Manager> {
    /// `num_blocks` blocks of 4 tokens (one is the null block), caching off.
    fn new(num_blocks: u32, budget: u64) -> Self {
        let cfg = Config {
            num_blocks,
            block_size: 4,
            max_model_len: 1 << 20,
            enable_caching: false,
            enable_events: false,
            watermark_blocks: 0,
        };
        TestEngine::with_kv(Manager::new(cfg).unwrap(), budget)
    }
}

impl<K: TestKv> TestEngine<K> {
    /// An engine over `mgr` with a token budget of `budget`.
    fn with_kv(mgr: K, budget: u64) -> Self {
        let limits = Limits {
            max_model_len: 1 << 20,
            long_prefill_token_threshold: 0,
            adaptive_threshold: false,
            chunked_prefill: true,
            sampled_per_step: 1,
        };
        TestEngine {
            reqs: Vec::new(),
            known: BTreeSet::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            kv_holding: VecDeque::new(),
            paused: 0,
            release: V33,
            deferred: BTreeSet::new(),
            inflight: BTreeSet::new(),
            mgr,
            tables: Vec::new(),
            set: Settings {
                limits,
                max_num_scheduled_tokens: budget,
                max_num_batched_tokens: budget,
                max_num_active_reqs: 16,
                max_num_running_reqs: 16,
                priority: false,
                reserve_full_isl: false,
                runner: Runner::V1,
                max_loras: None,
                spec: SpecSettings::default(),
                mamba_split: None,
            },
            step: 0,
            executed: 0,
            gate: PrefillGate::default(),
            throttle: false,
            scheduled: Vec::new(),
            next: HashMap::new(),
            pooled: BTreeSet::new(),
            outputs: Vec::new(),
            freed: Vec::new(),
            structured_step: StructuredFlags::default(),
            grammar_rows: Vec::new(),
            drafts_building: HashMap::new(),
            drafts: HashMap::new(),
            skip_drafts: false,
            recorded: Vec::new(),
            cached: Vec::new(),
            mm: walk_mm_tests::MmSim::default(),
            kv: connector::ConnectorSim::default(),
        }
    }

    /// `add_request`: a prompt of `prompt` tokens, `max_tokens`, queued at the tail.
    fn add(&mut self, prompt: u64, max_tokens: u64) -> usize {
        let i = self.reqs.len();
        self.reqs.push(TReq {
            id: format!("r{i}"),
            prompt,
            all: (0..prompt as i64).map(|t| 100 + t).collect(),
            outs: Vec::new(),
            rule: StopRule {
                eos_token_id: Some(EOS),
                stop_token_ids: vec![7],
                max_tokens,
                ..StopRule::default()
            },
            status: Status::Waiting,
            stop: None,
            computed: 0,
            placeholders: 0,
            in_flight: 0,
            stale: 0,
            drop_stale: false,
            chunk: false,
            priority: 0,
            arrival: i as f64,
            next_eligible: 0,
            preemptions: 0,
            lora: None,
            grammar_wait: None,
            grammar_rejects: None,
            accepted: Vec::new(),
            spec: Vec::new(),
            resumable: false,
            updates: VecDeque::new(),
            waiting_input: false,
        });
        self.known.insert(i);
        self.waiting.push_back(i);
        i
    }

    fn schedule(&mut self, mode: Mode) -> Vec<(usize, u64)> {
        let throttle = self.throttle;
        Walk::new(self, mode).unwrap().schedule(throttle).unwrap()
    }

    /// `update_from_output` with `tokens` for every scheduled request (1 token each unless
    /// given in `next`).
    fn update(&mut self, mode: Mode) {
        Walk::new(self, mode).unwrap().update_from_output().unwrap();
    }

    fn step(&mut self, mode: Mode, token: i64) -> Vec<(usize, u64)> {
        let rows = self.schedule(mode);
        for &(r, _) in &rows {
            self.next.entry(r).or_insert_with(|| vec![token]);
        }
        self.update(mode);
        rows
    }

    /// vLLM's `finish_requests(..., FINISHED_ABORTED)`: out of its queue, freed, forgotten.
    fn abort(&mut self, r: usize) {
        if std::mem::take(&mut self.reqs[r].waiting_input) {
            self.paused -= 1;
        }
        self.running.retain(|&x| x != r);
        self.waiting.retain(|&x| x != r);
        self.kv_holding.retain(|&x| x != r);
        self.deferred.remove(&r);
        self.reqs[r].status = Status::Finished;
        self.mgr.free(&self.reqs[r].id).unwrap();
        self.known.remove(&r);
    }

    fn r(&self, r: usize) -> &TReq {
        &self.reqs[r]
    }

    fn queue(&self, q: Queue) -> &VecDeque<usize> {
        match q {
            Queue::Waiting => &self.waiting,
            Queue::KvHolding => &self.kv_holding,
        }
    }

    fn queue_mut(&mut self, q: Queue) -> &mut VecDeque<usize> {
        match q {
            Queue::Waiting => &mut self.waiting,
            Queue::KvHolding => &mut self.kv_holding,
        }
    }

    /// vLLM's `_update_request_as_session`: the turn's outputs but the last sampled one
    /// (0.33: all but the last token; 0.32: up to the computed tokens) join the prompt, then
    /// the update's tokens; its `max_tokens`; `WAITING`.
    fn update_as_session(&mut self, r: usize, u: Update) {
        let release = self.release;
        let q = &mut self.reqs[r];
        let keep_end = match release {
            Release::V033 => q.all.len() - 1,
            Release::V032 => q.computed as usize,
        };
        assert!(keep_end as u64 >= q.computed);
        q.all.truncate(keep_end);
        q.outs.clear();
        q.all.extend_from_slice(&u.prompt);
        q.prompt = q.all.len() as u64;
        q.rule.max_tokens = u.max_tokens;
        if std::mem::take(&mut q.waiting_input) {
            self.paused -= 1;
        }
        q.status = Status::Waiting;
    }

    /// vLLM's `add_request` for the id of a session: the update is applied now if the
    /// session waits for input (a final `None` aborts it), else queued.
    fn stream(&mut self, r: usize, u: Option<Update>) {
        if !self.reqs[r].waiting_input {
            self.reqs[r].updates.push_back(u);
            return;
        }
        match u {
            Some(u) => self.update_as_session(r, u),
            None => self.abort(r),
        }
    }
}

fn sync(release: Release) -> Mode {
    Mode {
        release,
        asynchronous: false,
        decode_stagger: 1,
    }
}

fn asynchronous(release: Release) -> Mode {
    Mode {
        asynchronous: true,
        ..sync(release)
    }
}

const V33: Release = Release::V033;
const V32: Release = Release::V032;

impl<K: TestKv> Engine for TestEngine<K> {
    type Req = usize;
    type Error = Error;
    type Sampled = Vec<i64>;
    type Pending = ();
    type Scheduled = Vec<(usize, u64)>;
    type Blocks = K::Blocks;

    fn error(&self, e: Error) -> Error {
        e
    }
    fn settings(&mut self) -> Result<Settings> {
        Ok(self.set)
    }
    fn begin_schedule(&mut self, mode: &Mode) -> Result<Start> {
        Ok(Start {
            current_step: self.step,
            num_executed_steps: (mode.release == V33).then_some(self.executed),
            num_eligible: (self.running.len() + self.waiting.len() + self.kv_holding.len()) as u64,
            prefill_gate: self.gate,
        })
    }
    fn set_current_step(&mut self, step: u64) -> Result<()> {
        self.step = step;
        Ok(())
    }
    fn set_num_executed_steps(&mut self, n: u64) -> Result<()> {
        self.executed = n;
        Ok(())
    }
    fn running_len(&self) -> usize {
        self.running.len()
    }
    fn running_at(&mut self, i: usize) -> Result<usize> {
        Ok(self.running[i])
    }
    fn running_remove(&mut self, i: usize) -> Result<usize> {
        Ok(self.running.remove(i))
    }
    fn running_push(&mut self, r: &usize) -> Result<()> {
        self.running.push(*r);
        Ok(())
    }
    fn running_priority_keys(&self) -> Result<Vec<(i64, f64)>> {
        Ok(self
            .running
            .iter()
            .map(|&r| (self.reqs[r].priority, self.reqs[r].arrival))
            .collect())
    }
    fn waiting_len(&self, q: Queue) -> Result<usize> {
        Ok(self.queue(q).len())
    }
    fn waiting_peek(&mut self, q: Queue) -> Result<usize> {
        Ok(self.queue(q)[0])
    }
    fn waiting_pop(&mut self, q: Queue) -> Result<usize> {
        Ok(self.queue_mut(q).pop_front().unwrap())
    }
    fn waiting_prepend(&mut self, q: Queue, skipped: Vec<usize>) -> Result<()> {
        // `prepend_requests(deque)` keeps the deque's order at the head.
        for r in skipped.into_iter().rev() {
            self.queue_mut(q).push_front(r);
        }
        Ok(())
    }
    fn num_waiting_for_streaming_input(&self) -> Result<usize> {
        Ok(self.paused)
    }
    fn deferred_len(&self) -> Result<usize> {
        Ok(self.deferred.len())
    }
    fn deferred_add(&mut self, r: &usize) -> Result<()> {
        self.deferred.insert(*r);
        Ok(())
    }
    fn deferred_discard(&mut self, r: &usize) -> Result<()> {
        self.deferred.remove(r);
        Ok(())
    }
    fn set_prefill_capacity_bound(&mut self, bound: bool) -> Result<()> {
        self.gate.capacity_bound = bound;
        Ok(())
    }
    fn set_last_prefill_step(&mut self, step: u64) -> Result<()> {
        self.gate.last_prefill_step = step as i64;
        Ok(())
    }
    fn inflight_prefills_len(&self) -> Result<usize> {
        Ok(self.inflight.len())
    }
    fn inflight_prefills_add(&mut self, r: &usize) -> Result<()> {
        self.inflight.insert(*r);
        Ok(())
    }
    fn inflight_prefills_discard(&mut self, r: &usize) -> Result<()> {
        self.inflight.remove(r);
        Ok(())
    }
    fn status(&self, r: &usize) -> Result<Status> {
        Ok(self.reqs[*r].status)
    }
    fn set_running(&mut self, r: &usize) -> Result<()> {
        self.reqs[*r].status = Status::Running;
        Ok(())
    }
    fn set_stopped(&mut self, r: &usize, stop: Stop) -> Result<()> {
        self.reqs[*r].status = Status::Finished;
        self.reqs[*r].stop = Some(stop);
        Ok(())
    }
    fn num_tokens(&self, r: &usize) -> u64 {
        self.reqs[*r].all.len() as u64
    }
    fn num_prompt_tokens(&self, r: &usize) -> u64 {
        self.reqs[*r].prompt
    }
    fn shared_prefix_boundary(&self, _r: &usize) -> Result<u64> {
        Ok(0) // caching off: no lookup sets one
    }
    /// A stand-in override: 3 tokens at most in the running pass; in the waiting pass more
    /// than asked (the walk holds it to the tokens asked).
    fn custom_mamba_split(&self, _r: &usize, n: u64, local: Option<u64>) -> Result<u64> {
        Ok(match local {
            None => n.min(3),
            Some(hit) => n + hit + 5,
        })
    }
    fn num_output_tokens(&self, r: &usize) -> Result<u64> {
        Ok(self.reqs[*r].outs.len() as u64)
    }
    fn max_tokens(&self, r: &usize) -> u64 {
        self.reqs[*r].rule.max_tokens
    }
    fn stop_rule(&self, r: &usize) -> StopRule {
        self.reqs[*r].rule.clone()
    }
    fn num_computed_tokens(&self, r: &usize) -> Result<u64> {
        Ok(self.reqs[*r].computed)
    }
    fn set_num_computed_tokens(&mut self, r: &usize, n: u64) -> Result<()> {
        self.reqs[*r].computed = n;
        Ok(())
    }
    fn num_output_placeholders(&self, r: &usize) -> Result<u64> {
        Ok(self.reqs[*r].placeholders)
    }
    fn set_num_output_placeholders(&mut self, r: &usize, n: u64) -> Result<()> {
        self.reqs[*r].placeholders = n;
        Ok(())
    }
    fn num_in_flight_tokens(&self, r: &usize) -> Result<u64> {
        Ok(self.reqs[*r].in_flight)
    }
    fn set_num_in_flight_tokens(&mut self, r: &usize, n: u64) -> Result<()> {
        self.reqs[*r].in_flight = n;
        Ok(())
    }
    fn num_stale_output_tokens(&self, r: &usize) -> Result<u64> {
        Ok(self.reqs[*r].stale)
    }
    fn set_num_stale_output_tokens(&mut self, r: &usize, n: u64) -> Result<()> {
        self.reqs[*r].stale = n;
        Ok(())
    }
    fn drop_stale_output(&self, r: &usize) -> Result<bool> {
        Ok(self.reqs[*r].drop_stale)
    }
    fn set_is_prefill_chunk(&mut self, r: &usize, chunk: bool) -> Result<()> {
        self.reqs[*r].chunk = chunk;
        Ok(())
    }
    fn next_decode_eligible_step(&self, r: &usize) -> Result<u64> {
        Ok(self.reqs[*r].next_eligible)
    }
    fn set_async_decode(&mut self, r: &usize, eligible: Option<u64>) -> Result<()> {
        if let Some(s) = eligible {
            self.reqs[*r].next_eligible = s;
        }
        Ok(())
    }
    fn num_drafts(&self, r: &usize) -> Result<u64> {
        Ok(self.reqs[*r].spec.len() as u64)
    }
    fn is_prefill_chunk(&self, r: &usize) -> Result<bool> {
        Ok(self.reqs[*r].chunk)
    }
    fn schedule_drafts(&mut self, r: &usize, d: Drafts) -> Result<()> {
        let list = match d {
            Drafts::Proposed(k) => {
                let spec = std::mem::take(&mut self.reqs[*r].spec);
                spec[..k as usize].to_vec()
            }
            Drafts::Padding(k) => vec![-1; k as usize],
        };
        if !list.is_empty() {
            self.drafts_building.insert(*r, list);
        }
        Ok(())
    }
    fn unschedule_drafts(&mut self, r: &usize) -> Result<()> {
        self.drafts_building.remove(r);
        Ok(())
    }
    fn record_drafts(&mut self, r: &usize, drafts: u64, accepted: u64) -> Result<()> {
        self.recorded.push((*r, drafts, accepted));
        Ok(())
    }
    fn lora_id(&self, r: &usize) -> Option<i64> {
        self.reqs[*r].lora
    }
    fn uses_structured_output(&self, r: &usize) -> bool {
        self.reqs[*r].grammar_wait.is_some()
    }
    /// A grammar becomes ready after `grammar_wait` asks (the request becomes `WAITING`); a
    /// session waiting for input stays blocked.
    fn unblock(&mut self, r: &usize) -> Result<bool> {
        if self.kv.loading.contains(r) {
            return Ok(self.unblock_remote(*r));
        }
        let q = &mut self.reqs[*r];
        if q.waiting_input {
            return Ok(false);
        }
        match q.grammar_wait.as_mut() {
            Some(0) | None => {
                q.status = Status::Waiting;
                Ok(true)
            }
            Some(n) => {
                *n -= 1;
                Ok(false)
            }
        }
    }
    fn repeats(&mut self, r: &usize, rep: &policy::Repetition) -> Result<bool> {
        let outs = &self.reqs[*r].outs;
        let n = outs.len().min(rep.tail_len() as usize);
        Ok(policy::has_repetition(
            &outs[outs.len() - n..],
            outs.len() as u64,
            rep,
        ))
    }
    fn accept_tokens(&mut self, r: &usize, s: &Vec<i64>) -> Result<bool> {
        // vLLM's own manager: a request without structured output is accepted at once.
        if !self.uses_structured_output(r) {
            return Ok(true);
        }
        let q = &mut self.reqs[*r];
        if s.iter().any(|t| Some(*t) == q.grammar_rejects) {
            return Ok(false);
        }
        q.accepted.extend_from_slice(s);
        Ok(true)
    }
    /// vLLM's `_preempt_request`: blocks freed, status PREEMPTED, nothing computed, the
    /// in-flight tokens become stale output, placeholders dropped, back at the queue's head.
    fn preempt(&mut self, r: &usize) -> Result<()> {
        self.mgr.free(&self.reqs[*r].id)?;
        self.inflight.remove(r);
        let q = &mut self.reqs[*r];
        q.status = Status::Preempted;
        q.computed = 0;
        q.drop_stale = q.drop_stale && q.stale > 0;
        q.stale = q.in_flight;
        q.placeholders = 0;
        q.preemptions += 1;
        q.spec.clear();
        self.waiting.push_front(*r);
        Ok(())
    }
    fn prefix_hit(&mut self, r: &usize) -> Result<Option<PrefixHit<K::Blocks>>> {
        Ok(self.connector_hit(*r)) // caching off: a connector's tokens alone
    }
    fn load_failed(&self, r: &usize) -> Result<bool> {
        Ok(self.kv.failed.contains(r))
    }
    fn holds_kv_blocks(&self, r: &usize) -> Result<bool> {
        Ok(self.reqs[*r].computed > 0 || self.kv.loading.contains(r))
    }
    fn connector_allocated(&mut self, r: &usize, ext: u64, queries: u64, load: bool) -> Result<()> {
        self.kv.allocated.push((*r, ext, queries, load));
        Ok(())
    }
    fn start_remote_load(&mut self, r: &usize, num_computed: u64) -> Result<()> {
        self.kv.loading.insert(*r);
        self.inflight.insert(*r);
        let q = &mut self.reqs[*r];
        q.status = Status::OtherWaiting;
        q.computed = num_computed;
        Ok(())
    }
    fn reserved_blocks(&mut self, _r: &usize) -> Result<u64> {
        Ok(self.kv.reserved)
    }
    fn connector_pending_frees(&mut self) -> Result<bool> {
        Ok(self.kv.pending_frees)
    }
    fn blocks_can_be_freed(&mut self, r: &usize) -> Result<bool> {
        Ok(!self.kv.pinned.contains(r))
    }
    fn connector_step_end(&mut self, _out: &mut Vec<(usize, u64)>, sync_loads: bool) -> Result<()> {
        self.kv.step_ends.push(sync_loads);
        Ok(())
    }
    fn record_prefix_cache_stats(&mut self, _r: &usize, _hit: u64) -> Result<()> {
        Ok(())
    }
    fn record_scheduled(&mut self, _r: &usize) -> Result<()> {
        Ok(())
    }
    fn free_request(&mut self, r: &usize) -> Result<()> {
        assert_eq!(self.reqs[*r].status, Status::Finished);
        self.inflight.remove(r);
        self.mgr.free(&self.reqs[*r].id)?;
        self.freed.push(*r);
        Ok(())
    }
    fn resumable(&self, r: &usize) -> Result<bool> {
        Ok(self.reqs[*r].resumable)
    }
    /// vLLM's `_handle_stopped_request` for a resumable request (0.32's enqueues it).
    fn handle_stopped(&mut self, r: &usize) -> Result<bool> {
        let q = &mut self.reqs[*r];
        q.computed -= q.placeholders;
        q.spec.clear();
        q.drop_stale = true;
        q.stale = q.in_flight;
        q.placeholders = 0;
        match q.updates.pop_front() {
            Some(None) => return Ok(true),
            Some(Some(u)) => self.update_as_session(*r, u),
            None => {
                q.status = Status::OtherWaiting;
                q.waiting_input = true;
                self.paused += 1;
            }
        }
        if self.release == V32 {
            self.enqueue_waiting(r)?;
        }
        Ok(false)
    }
    fn enqueue_waiting(&mut self, r: &usize) -> Result<()> {
        if self.reqs[*r].status == Status::OtherWaiting {
            self.deferred.insert(*r);
        }
        match self.reqs[*r].computed > 0 {
            true => self.kv_holding.push_back(*r),
            false => self.waiting.push_back(*r),
        }
        Ok(())
    }
    fn remove_stopped(&mut self, running: &[usize], other: &[usize]) -> Result<()> {
        self.running.retain(|r| !running.contains(r));
        self.waiting.retain(|r| !other.contains(r));
        self.kv_holding.retain(|r| !other.contains(r));
        self.deferred.retain(|r| !other.contains(r));
        Ok(())
    }
    fn allocate(&mut self, r: &usize, a: &SlotRequest<'_, K::Blocks>) -> Result<Option<K::Blocks>> {
        let q = &self.reqs[*r];
        self.mgr.allocate(&q.id, q.in_flight, a)
    }
    fn cache_blocks(&mut self, r: &usize, num_tokens: u64) -> Result<()> {
        self.cached.push((*r, num_tokens)); // caching off: only recorded
        Ok(())
    }
    fn block_table(&self, r: &usize) -> Result<K::Blocks> {
        Ok(self.mgr.table(&self.reqs[*r].id))
    }
    fn has_encoder_inputs(&self, r: &usize) -> bool {
        self.mm.images.contains_key(r)
    }
    fn encoder_budget(&mut self) -> Result<u64> {
        Ok(self.mm.budget)
    }
    fn schedule_encoder_inputs(
        &mut self,
        r: &usize,
        c: u64,
        n: u64,
        b: u64,
    ) -> Result<EncoderPlan> {
        Ok(self.mm.plan(*r, c, n, b))
    }
    fn commit_encoder_inputs(&mut self, r: &usize) -> Result<()> {
        self.mm.commit(*r);
        Ok(())
    }
    fn drop_encoder_inputs(&mut self, r: &usize) -> Result<()> {
        self.mm.scheduled.retain(|(x, _)| x != r);
        Ok(())
    }
    fn free_encoder_cache(&mut self, r: &usize) -> Result<()> {
        self.mm.unfit.push(*r);
        Ok(())
    }
    fn free_encoder_inputs(&mut self, r: &usize) -> Result<()> {
        self.mm.done.push((*r, self.reqs[*r].computed));
        Ok(())
    }
    fn scheduler_output(&mut self, step: &Step<usize, K::Blocks>) -> Result<Vec<(usize, u64)>> {
        self.scheduled = step.rows.iter().map(|r| (r.req, r.tokens)).collect();
        self.tables = step
            .rows
            .iter()
            .map(|r| (r.req, r.blocks.clone()))
            .collect();
        self.structured_step = StructuredFlags::default();
        self.grammar_rows.clear();
        self.drafts = std::mem::take(&mut self.drafts_building);
        self.skip_drafts = step.skip_drafts;
        Ok(self.scheduled.clone())
    }
    fn mark_structured_output(
        &mut self,
        _out: &mut Vec<(usize, u64)>,
        flags: StructuredFlags,
        grammar_rows: &[&usize],
    ) -> Result<()> {
        self.structured_step = flags;
        self.grammar_rows = grammar_rows.iter().map(|&&r| r).collect();
        Ok(())
    }
    fn scheduled_rows(&mut self) -> Result<Vec<(usize, u64, u64)>> {
        let rows = std::mem::take(&mut self.scheduled);
        let drafts = std::mem::take(&mut self.drafts);
        let count = |r: &usize| drafts.get(r).map_or(0, |d| d.len() as u64);
        Ok(rows
            .into_iter()
            .filter(|(r, _)| self.known.contains(r))
            .map(|(r, n)| (r, n, count(&r)))
            .collect())
    }
    fn sampled(&mut self, r: &usize) -> Result<Vec<i64>> {
        Ok(self.next.remove(r).unwrap_or_default())
    }
    fn pooled(&mut self, r: &usize) -> Result<bool> {
        Ok(self.pooled.remove(r))
    }
    fn sampled_len(&self, s: &Vec<i64>) -> usize {
        s.len()
    }
    fn truncate_sampled(&mut self, s: &mut Vec<i64>, kept: usize) -> Result<()> {
        s.truncate(kept);
        Ok(())
    }
    fn append_output_token(&mut self, r: &usize, s: &Vec<i64>, k: usize) -> Result<Option<i64>> {
        let q = &mut self.reqs[*r];
        q.outs.push(s[k]);
        q.all.push(s[k]);
        Ok(Some(s[k]))
    }
    fn begin_output(&mut self, _r: &usize, _s: &Vec<i64>, _emit: bool) -> Result<()> {
        Ok(())
    }
    fn emit_output(
        &mut self,
        r: &usize,
        _p: (),
        s: Vec<i64>,
        stop: Option<Stop>,
        emit: bool,
    ) -> Result<()> {
        if emit {
            self.outputs.push((*r, s, stop));
        }
        Ok(())
    }
}

// ---- admission and chunked prefill ----

/// A Mamba "align" split of `block` tokens (the scheduler may take the whole budget).
fn with_mamba_split(e: &mut TestEngine<Manager>, block: u64) {
    let split = crate::vllm_v1::mamba_split::MambaSplit {
        block_size: block,
        hash_block_size: block,
        max_prefill_tokens: e.set.max_num_scheduled_tokens,
        ..Default::default()
    };
    e.set.mamba_split = Some(MambaSplitRule::Vllm(split));
}

#[test]
fn an_overridden_mamba_split_is_called_in_both_passes_and_held_to_the_tokens_asked() {
    let mut e = TestEngine::new(64, 30);
    e.set.mamba_split = Some(MambaSplitRule::Custom);
    let (a, b) = (e.add(21, 4), e.add(12, 4));
    // The waiting pass: the override returns more than asked; each row keeps its ask.
    assert_eq!(step_chunks_silent(&mut e), vec![(a, 21), (b, 9)]);
    // The running pass: b's last 3 tokens; a's decode (1).
    assert_eq!(step_chunks_silent(&mut e), vec![(a, 1), (b, 3)]);
}

/// One step in which the chunks sample nothing and every other row one token.
fn step_chunks_silent(e: &mut TestEngine<Manager>) -> Vec<(usize, u64)> {
    let rows = e.schedule(sync(V33));
    for &(r, _) in &rows {
        let sampled = if e.r(r).chunk { vec![] } else { vec![50] };
        e.next.insert(r, sampled);
    }
    e.update(sync(V33));
    rows
}

#[test]
fn mamba_align_splits_prefills_at_block_boundaries_in_both_passes() {
    let mut e = TestEngine::new(64, 30);
    with_mamba_split(&mut e, 8);
    let (a, b) = (e.add(21, 4), e.add(12, 4));
    // a: 21 tokens asked, 30 in the budget: the chunk stops at 16 (the last multiple of 8
    // below 21); b gets the budget's rest (14), cut to a block (8).
    assert_eq!(step_chunks_silent(&mut e), vec![(a, 16), (b, 8)]);
    // a's tail (5) and b's (4) follow: the prompt's last chunk is not aligned.
    assert_eq!(step_chunks_silent(&mut e), vec![(a, 5), (b, 4)]);
    // Decodes are never split.
    assert_eq!(step_chunks_silent(&mut e), vec![(a, 1), (b, 1)]);
}

#[test]
fn mamba_align_ends_admission_below_one_block() {
    let mut e = TestEngine::new(64, 20);
    with_mamba_split(&mut e, 8);
    let (a, b) = (e.add(30, 4), e.add(30, 4));
    // a takes 16 (aligned), b's 4 tokens of budget are less than a block: the pass ends.
    assert_eq!(step_chunks_silent(&mut e), vec![(a, 16)]);
    assert_eq!(e.r(b).status, Status::Waiting);
    // a's next chunk: 14 left, 20 of budget, up to its last cacheable position (24): 8;
    // b gets 12 of budget, one block.
    assert_eq!(step_chunks_silent(&mut e), vec![(a, 8), (b, 8)]);
}

#[test]
fn admission_stops_at_the_token_budget_without_chunked_prefill() {
    let mut e = TestEngine::new(64, 10);
    e.set.limits.chunked_prefill = false;
    let (a, b) = (e.add(6, 4), e.add(6, 4));
    assert_eq!(e.schedule(sync(V33)), vec![(a, 6)]);
    assert_eq!(e.r(b).status, Status::Waiting);
    assert_eq!(e.waiting, [b]);
}

#[test]
fn chunked_prefill_admits_the_budgets_rest_as_an_inflight_chunk() {
    let mut e = TestEngine::new(64, 10);
    let (a, b) = (e.add(6, 4), e.add(6, 4));
    assert_eq!(e.schedule(sync(V33)), vec![(a, 6), (b, 4)]);
    assert!(e.r(b).chunk && !e.r(a).chunk);
    assert_eq!(e.r(b).computed, 4);
    assert!(e.inflight.contains(&b));
    // The next step finishes b's prompt (2 tokens) and decodes a (1).
    e.next.insert(a, vec![50]);
    e.next.insert(b, vec![]); // a chunk samples nothing
    e.update(sync(V33));
    assert_eq!(e.schedule(sync(V33)), vec![(a, 1), (b, 2)]);
    assert!(!e.inflight.contains(&b));
}

#[test]
fn long_prefill_threshold_caps_chunks_only_with_company() {
    let mut e = TestEngine::new(64, 100);
    e.set.limits.long_prefill_token_threshold = 4;
    let a = e.add(10, 4);
    assert_eq!(e.schedule(sync(V33)), vec![(a, 10)]); // alone: no threshold
    let mut e = TestEngine::new(64, 100);
    e.set.limits.long_prefill_token_threshold = 4;
    let (a, b) = (e.add(10, 4), e.add(10, 4));
    assert_eq!(e.schedule(sync(V33)), vec![(a, 4), (b, 4)]);
}

#[test]
fn admission_stops_at_max_num_active_reqs() {
    let mut e = TestEngine::new(64, 100);
    e.set.max_num_active_reqs = 1;
    let (a, b) = (e.add(4, 4), e.add(4, 4));
    assert_eq!(e.schedule(sync(V33)), vec![(a, 4)]);
    assert_eq!(e.waiting, [b]);
}

// ---- preemption ----

/// Two requests of 8 prompt tokens in a cache of 4 usable blocks (16 tokens): both prefill
/// (2 blocks each) and sample one token; the 9th token needs a third block.
fn full_cache(priority: bool) -> (TestEngine, usize, usize) {
    let mut e = TestEngine::new(5, 100);
    e.set.priority = priority;
    let (a, b) = (e.add(8, 50), e.add(8, 50));
    e.step(sync(V33), 50);
    (e, a, b)
}

#[test]
fn fcfs_preemption_takes_the_last_running_request_and_admits_nothing() {
    let (mut e, a, b) = full_cache(false);
    e.add(1, 5);
    let rows = e.schedule(sync(V33));
    assert_eq!(rows, vec![(a, 1)]);
    let q = e.r(b);
    assert_eq!(
        (q.status, q.computed, q.preemptions),
        (Status::Preempted, 0, 1)
    );
    assert_eq!(e.waiting.front(), Some(&b)); // back at the head
    assert_eq!(e.running, [a]);
}

#[test]
fn priority_preemption_takes_the_worst_and_returns_its_budget() {
    let (mut e, a, b) = full_cache(true);
    // a is the worse (larger priority value): b's allocation preempts a, which was
    // already scheduled this step and gives its token back.
    e.reqs[a].priority = 1;
    e.reqs[a].all.truncate(8); // a needs no new block
    e.reqs[a].outs.clear();
    e.reqs[a].computed = 7;
    let rows = e.schedule(sync(V33));
    assert_eq!(rows, vec![(b, 1)]);
    assert_eq!(e.r(a).status, Status::Preempted);
    assert_eq!(e.running, [b]);
}

#[test]
fn a_priority_request_that_preempts_itself_ends_the_pass_on_032_only() {
    for release in [V32, V33] {
        // 5 usable blocks: a and b take 2 each, c 1; a's 9th token needs a sixth.
        let mut e = TestEngine::new(6, 100);
        e.set.priority = true;
        let (a, b, c) = (e.add(8, 50), e.add(8, 50), e.add(3, 50));
        e.reqs[c].priority = -1;
        e.step(sync(release), 50);
        // a is the worst and needs a block: it preempts itself; c (3 tokens) still fits.
        e.reqs[a].priority = 5;
        e.reqs[b].all.truncate(8);
        e.reqs[b].outs.clear();
        e.reqs[b].computed = 7;
        e.running = vec![a, c, b];
        let rows = e.schedule(sync(release));
        assert_eq!(e.r(a).status, Status::Preempted);
        if release == V33 {
            assert_eq!(
                rows,
                vec![(c, 1), (b, 1)],
                "0.33 goes on past the self-preemption"
            );
        } else {
            assert_eq!(rows, vec![], "0.32 ends the running pass");
        }
    }
}

// ---- async scheduling: placeholders and stale outputs ----

#[test]
fn async_decode_gets_a_placeholder_resolved_by_its_output() {
    for release in [V32, V33] {
        let mut e = TestEngine::new(64, 100);
        let a = e.add(4, 10);
        let mode = asynchronous(release);
        e.schedule(mode);
        assert_eq!((e.r(a).placeholders, e.r(a).in_flight), (1, 4));
        e.next.insert(a, vec![50]);
        e.update(mode);
        assert_eq!((e.r(a).placeholders, e.r(a).in_flight), (0, 0));
        assert_eq!(e.r(a).outs, [50]);
    }
}

#[test]
fn a_stop_resolves_placeholders_by_returned_tokens_on_033_by_kept_on_032() {
    for (release, left, computed) in [(V33, 0, 5), (V32, 1, 6)] {
        let mut e = TestEngine::new(64, 100);
        let a = e.add(4, 10);
        let mode = asynchronous(release);
        e.schedule(mode);
        e.reqs[a].placeholders = 2;
        e.reqs[a].computed = 6;
        e.next.insert(a, vec![EOS, 9]); // stops on the first; the second is dropped
        e.update(mode);
        assert_eq!(e.r(a).outs, [EOS]);
        assert_eq!(e.r(a).placeholders, left, "{release:?}");
        assert_eq!(e.r(a).computed, computed, "0.33 trims the unkept token");
    }
}

#[test]
fn stale_output_after_preemption_is_deferred_then_delivered_without_resolving() {
    let mut e = TestEngine::new(64, 100);
    let mode = asynchronous(V33);
    let a = e.add(4, 10);
    e.schedule(mode); // a in flight: 4 tokens
    e.running.clear();
    e.preempt(&a).unwrap();
    assert_eq!((e.r(a).stale, e.r(a).placeholders), (4, 0));
    // While its stale output is due, the waiting pass skips it (deferred, kept at the head).
    let b = e.add(4, 10);
    assert_eq!(e.schedule(mode), vec![(b, 4)]);
    assert_eq!(e.waiting, [a]);
    assert!(e.deferred.contains(&a));
    // The stale output arrives: delivered, nothing resolved; then a is admitted again.
    e.scheduled = vec![(a, 4)];
    e.next.insert(a, vec![50]);
    e.update(mode);
    assert_eq!((e.r(a).stale, e.r(a).outs.clone()), (0, vec![50]));
    let rows = e.schedule(mode);
    assert_eq!(rows[1], (a, 5));
    assert!(!e.deferred.contains(&a));
}

#[test]
fn dropped_stale_output_is_not_delivered() {
    let mut e = TestEngine::new(64, 100);
    let mode = asynchronous(V33);
    let a = e.add(4, 10);
    e.schedule(mode);
    e.running.clear();
    e.preempt(&a).unwrap();
    e.reqs[a].drop_stale = true;
    e.scheduled = vec![(a, 4)];
    e.next.insert(a, vec![50]);
    e.update(mode);
    assert!(e.r(a).outs.is_empty() && e.outputs.is_empty());
    assert_eq!(e.r(a).stale, 0);
}

#[test]
fn v2_runner_decodes_wait_for_their_eligible_step() {
    let mut e = TestEngine::new(64, 100);
    e.set.runner = Runner::V2;
    let mode = Mode {
        decode_stagger: 2,
        ..asynchronous(V33)
    };
    let a = e.add(4, 10);
    e.step(mode, 50); // step 1: prefill; eligible from step 3
    assert_eq!(e.r(a).next_eligible, 3);
    assert_eq!(e.schedule(mode), vec![]); // step 2
    assert_eq!(e.schedule(mode), vec![(a, 1)]); // step 3
}

// ---- stop conditions ----

#[test]
fn eos_stops_even_before_min_tokens() {
    // `min_tokens` gates only repetition detection in `check_stop` (the sampler masks EOS).
    let mut e = TestEngine::new(64, 100);
    let a = e.add(4, 10);
    e.step(sync(V33), EOS);
    assert_eq!(e.r(a).stop, Some(Stop::Eos));
    assert_eq!(e.outputs, vec![(a, vec![EOS], Some(Stop::Eos))]);
    assert!(e.running.is_empty() && e.freed == [a]);
    assert_eq!(e.mgr.blocks("r0"), &[] as &[u32]);
}

#[test]
fn stop_token_id_stops_with_the_token_as_reason() {
    let mut e = TestEngine::new(64, 100);
    let a = e.add(4, 10);
    e.step(sync(V33), 7);
    assert_eq!(e.r(a).stop, Some(Stop::StopToken(7)));
}

#[test]
fn max_tokens_finishes_length_capped() {
    let mut e = TestEngine::new(64, 100);
    let a = e.add(4, 2);
    e.step(sync(V33), 50);
    assert_eq!(e.r(a).status, Status::Running);
    e.step(sync(V33), 51);
    assert_eq!(e.r(a).stop, Some(Stop::Length));
    assert_eq!(e.r(a).outs, [50, 51]);
}

#[test]
fn tokens_after_a_stop_are_dropped_and_033_trims_them_from_computed() {
    for (release, computed) in [(V32, 4), (V33, 3)] {
        let mut e = TestEngine::new(64, 100);
        let a = e.add(4, 10);
        e.schedule(sync(release));
        e.next.insert(a, vec![7, 8]);
        e.update(sync(release));
        assert_eq!(e.outputs, vec![(a, vec![7], Some(Stop::StopToken(7)))]);
        assert_eq!(e.r(a).computed, computed, "{release:?}");
    }
}

// ---- the outgrow cap ----

#[test]
fn a_prompt_of_the_caches_size_is_refused_and_the_cap_finishes_length() {
    // 5 blocks of 4 (one null): a 16-token cache under a larger max_model_len.
    let cap = policy::length_cap(1 << 20, 16);
    assert!(policy::refuses_prompt(16, cap, 1));
    let mut e = TestEngine::new(5, 100);
    e.set.limits.max_model_len = cap;
    let a = e.add(15, 100); // the largest prompt admitted
    e.step(sync(V33), 50);
    assert_eq!(e.r(a).stop, Some(Stop::Length));
    assert_eq!(e.r(a).all.len(), 16);
    assert!(e.freed == [a]);
}

#[test]
fn running_room_leaves_a_slot_for_the_sampled_token_at_the_cap() {
    let mut e = TestEngine::new(64, 100);
    e.set.limits.max_model_len = 10;
    let a = e.add(12, 100); // longer than the cap: only cap - 1 tokens are scheduled
    e.running.push(e.waiting.pop_front().unwrap());
    e.reqs[a].status = Status::Running;
    assert_eq!(e.schedule(sync(V33)), vec![(a, 9)]);
}

// ---- aborts ----

#[test]
fn aborts_in_every_queue_leave_nothing_scheduled_or_emitted() {
    let mut e = TestEngine::new(64, 6);
    let (a, b) = (e.add(4, 10), e.add(4, 10));
    let c = e.add(4, 10);
    e.schedule(sync(V33)); // a whole, b chunked (2); c waits
    e.abort(a); // running, in flight
    e.abort(c); // waiting
    e.update(sync(V33));
    assert!(e.outputs.iter().all(|(r, ..)| *r == b));
    assert!(e.r(a).outs.is_empty());
    assert_eq!(e.schedule(sync(V33)), vec![(b, 2)]);
    // Aborted while in flight but still known (status finished): skipped too.
    e.reqs[b].status = Status::Finished;
    e.running.clear();
    e.next.insert(b, vec![50]);
    e.update(sync(V33));
    assert!(e.r(b).outs.is_empty());
}

#[test]
fn an_aborted_preempted_request_is_never_resumed() {
    // b was preempted back to the head of `waiting` (status PREEMPTED); aborting it there
    // leaves the head to what follows it, and the walk never schedules or emits it again.
    let (mut e, _, b) = full_cache(false);
    let c = e.add(1, 5);
    e.schedule(sync(V33));
    assert_eq!(e.r(b).status, Status::Preempted);
    e.abort(b);
    let (emitted, outs) = (
        e.outputs.iter().filter(|(r, ..)| *r == b).count(),
        e.r(b).outs.len(),
    );
    e.update(sync(V33));
    let mut c_ran = false;
    for _ in 0..8 {
        let rows = e.step(sync(V33), 60);
        assert!(rows.iter().all(|(r, _)| *r != b), "{rows:?}");
        c_ran |= rows.iter().any(|(r, _)| *r == c);
    }
    assert_eq!(e.outputs.iter().filter(|(r, ..)| *r == b).count(), emitted);
    assert_eq!(e.r(b).outs.len(), outs);
    assert!(e.waiting.iter().all(|&r| r != b) && e.running.iter().all(|&r| r != b));
    assert!(c_ran, "the request behind the aborted one never ran");
}

#[test]
fn executed_steps_count_only_steps_with_tokens_on_033() {
    let mut e = TestEngine::new(64, 100);
    e.schedule(sync(V33));
    assert_eq!((e.step, e.executed), (1, 0));
    e.add(4, 10);
    e.schedule(sync(V33));
    assert_eq!((e.step, e.executed), (2, 1));
}

#[test]
fn a_throttled_step_runs_decodes_only_until_the_engine_is_capacity_bound() {
    // Data-parallel prefill balancing (`schedule(throttle_prefills=True)`), both releases.
    for release in [V32, V33] {
        let mut e = TestEngine::new(64, 8);
        let a = e.add(4, 30);
        assert_eq!(e.step(sync(release), 50), vec![(a, 4)]);
        let b = e.add(20, 5);
        e.throttle = true; // b's prefill waits; a decodes
        assert_eq!(e.step(sync(release), 50), vec![(a, 1)]);
        assert_eq!(e.waiting, [b]);
        e.throttle = false;
        assert_eq!(e.step(sync(release), 50), vec![(a, 1), (b, 7)]);
        assert!(!e.gate.capacity_bound);
        e.throttle = true; // b's next chunk waits too
        assert_eq!(e.step(sync(release), 50), vec![(a, 1)]);
        let (c, d) = (e.add(20, 5), e.add(20, 5));
        e.throttle = false; // the budget runs out with c and d waiting: capacity-bound
        assert_eq!(e.step(sync(release), 50), vec![(a, 1), (b, 7)]);
        assert!(e.gate.capacity_bound && e.waiting == [c, d]);
        e.throttle = true; // a capacity-bound engine is not throttled
        assert_eq!(e.step(sync(release), 50), vec![(a, 1), (b, 7)]);
    }
}

#[test]
fn the_033_prefill_cadence_holds_prefills_between_prefill_steps() {
    let mut e = TestEngine::new(64, 8);
    e.gate = PrefillGate {
        capacity_bound: false,
        interval: 3,
        last_prefill_step: -3,
    };
    let a = e.add(4, 30);
    assert_eq!(e.step(sync(V33), 50), vec![(a, 4)]); // the first step is never held
    assert_eq!(e.gate.last_prefill_step, 1);
    let b = e.add(4, 5);
    assert_eq!(e.step(sync(V33), 50), vec![(a, 1)]); // executed steps 2 and 3: held
    assert_eq!(e.step(sync(V33), 50), vec![(a, 1)]);
    assert_eq!(e.step(sync(V33), 50), vec![(a, 1), (b, 4)]);
    assert_eq!((e.executed, e.gate.last_prefill_step), (4, 4));
    // A step of decodes only leaves the stamp alone.
    assert_eq!(e.step(sync(V33), 50), vec![(a, 1), (b, 1)]);
    assert_eq!(e.gate.last_prefill_step, 4);
}

#[path = "walk_kinds_tests.rs"]
mod kinds;

#[path = "walk_spec_tests.rs"]
mod spec;

#[path = "walk_mm_tests.rs"]
mod walk_mm_tests;

#[path = "walk_session_tests.rs"]
mod session;

#[path = "walk_hybrid_tests.rs"]
mod hybrid;

#[path = "walk_connector_tests.rs"]
mod connector;
