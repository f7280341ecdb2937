//! One scheduling step: vLLM 0.4.2's `_schedule_default` and `_schedule_chunked_prefill`
//! with their three sub-policies (running, swapped, prefills), over the core manager.
//!
//! Every decision mirrors vLLM's code path for path; the places where we deliberately differ
//! are the vLLM failures listed in `docs/scheduler.md` and are marked `fix N` below.

use super::{Finish, GroupKey, IdMap, IdSet, PreemptionMode, Scheduler, SeqIds, Status, Tokens};
use crate::error::{Error, Result};
use crate::vllm_042::manager::{AllocStatus, ComputedPrefix, Copies, Device, Manager, SeqId};
use crate::vllm_042::pool::BlockId;
use std::collections::VecDeque;

/// A group scheduled this step and how many tokens it computes (1 for a decode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduled {
    pub key: GroupKey,
    pub chunk: usize,
}

/// vLLM's `SchedulerOutputs`, with group keys for groups and block-number pairs for maps
/// (in the order vLLM's dicts would hold them).
#[derive(Clone, Debug, Default)]
pub struct Outputs {
    pub scheduled: Vec<Scheduled>,
    pub num_prefill_groups: usize,
    pub num_batched_tokens: usize,
    pub swap_in: Vec<(BlockId, BlockId)>,
    pub swap_out: Vec<(BlockId, BlockId)>,
    pub copies: Vec<(BlockId, Vec<BlockId>)>,
    pub ignored: Vec<GroupKey>,
    pub lookahead: usize,
    pub running_queue_size: usize,
    /// Preempted this step by recomputation / by swapping (for metrics and tests).
    pub preempted: Vec<GroupKey>,
    pub swapped_out: Vec<GroupKey>,
    /// Running groups with several running sequences that had to be preempted when the CPU
    /// could not hold them (fix 7): finished as aborted, their blocks freed; also in `ignored`.
    pub aborted: Vec<GroupKey>,
}

impl Outputs {
    /// Whether the running groups' pass preempted any group (by recompute, swap or abort).
    fn any_preempted(&self) -> bool {
        !(self.preempted.is_empty() && self.swapped_out.is_empty() && self.aborted.is_empty())
    }
}

/// What `SequenceGroupMetadata` needs for one scheduled group.
#[derive(Clone, Debug)]
pub struct StepMeta {
    pub key: GroupKey,
    pub is_prompt: bool,
    pub do_sample: bool,
    pub running: SeqIds,
    /// Where `computed_block_nums` lies (vLLM's common computed block ids; None: empty, and
    /// always None without `with_computed`).
    pub computed: Option<ComputedPrefix>,
    /// First time this group is scheduled (the caller sets its first-scheduled time).
    pub first_time: bool,
}

/// vLLM's `SchedulingBudget` (group-aware: a group is counted at most once).
struct Budget {
    token_budget: usize,
    max_num_seqs: usize,
    tokens: usize,
    seqs: usize,
    token_keys: IdSet<GroupKey>,
    seq_keys: IdSet<GroupKey>,
}

impl Budget {
    /// `groups`: about how many groups the step will count (sizes the sets, which are
    /// emptied: the scheduler keeps them across steps).
    fn new(
        token_budget: usize,
        max_num_seqs: usize,
        groups: usize,
        sets: [IdSet<GroupKey>; 2],
    ) -> Self {
        let [mut token_keys, mut seq_keys] = sets;
        for set in [&mut token_keys, &mut seq_keys] {
            set.clear();
            set.reserve(groups);
        }
        Budget {
            token_budget,
            max_num_seqs,
            tokens: 0,
            seqs: 0,
            token_keys,
            seq_keys,
        }
    }
    fn can_schedule(&self, tokens: usize, seqs: usize) -> bool {
        self.tokens + tokens <= self.token_budget && self.seqs + seqs <= self.max_num_seqs
    }
    fn remaining(&self) -> usize {
        self.token_budget.saturating_sub(self.tokens)
    }
    fn add_tokens(&mut self, k: GroupKey, n: usize) {
        if self.token_keys.insert(k) {
            self.tokens += n;
        }
    }
    fn sub_tokens(&mut self, k: GroupKey, n: usize) {
        if self.token_keys.remove(&k) {
            self.tokens -= n;
        }
    }
    fn add_seqs(&mut self, k: GroupKey, n: usize) {
        if self.seq_keys.insert(k) {
            self.seqs += n;
        }
    }
    fn sub_seqs(&mut self, k: GroupKey, n: usize) {
        if self.seq_keys.remove(&k) {
            self.seqs -= n;
        }
    }
}

/// The LoRA ids in the batch (`None`: not tracked, as vLLM without a LoRA config in the
/// default policy).
type Loras = Option<IdSet<u32>>;

#[derive(Default)]
struct Part {
    prefill: Vec<Scheduled>,
    decode: Vec<Scheduled>,
}

/// The parts in order, as one list (a lone non-empty part is moved, not copied).
fn join<const N: usize>(parts: [Vec<Scheduled>; N]) -> Vec<Scheduled> {
    if parts.iter().filter(|p| !p.is_empty()).count() <= 1 {
        return parts
            .into_iter()
            .find(|p| !p.is_empty())
            .unwrap_or_default();
    }
    parts.concat()
}

/// A queue of the scheduler that a step works on in arrival order.
#[derive(Clone, Copy)]
enum Queue {
    Running,
    Swapped,
}

struct Step<'a, T: Tokens> {
    mgr: &'a mut Manager,
    toks: &'a T,
    copies: Vec<(BlockId, Vec<BlockId>)>,
    copy_index: IdMap<BlockId, usize>,
    cows: Copies,
}

impl<T: Tokens> Step<'_, T> {
    fn add_copies(&mut self) {
        for &(src, dst) in &self.cows {
            match self.copy_index.get(&src) {
                Some(&i) => self.copies[i].1.push(dst),
                None => {
                    self.copy_index.insert(src, self.copies.len());
                    self.copies.push((src, vec![dst]));
                }
            }
        }
        self.cows.clear();
    }
}

impl Scheduler {
    /// Decide one step (vLLM's `_schedule`). `now` is the wall-clock time vLLM would read.
    ///
    /// A step never fails for lack of blocks: every allocation it makes is preceded by the
    /// `can_*` check that bounds it (docs/scheduler.md, fixes 4 and 7 for preemption). The
    /// errors left (a non-finite time; a sequence without its token store) are checked before
    /// anything changes or excluded by the invariants (`check_waiting`).
    pub fn schedule<T: Tokens>(
        &mut self,
        mgr: &mut Manager,
        toks: &T,
        now: f64,
    ) -> Result<Outputs> {
        if !now.is_finite() {
            return Err(Error::invalid("the step time must be a finite number"));
        }
        debug_assert!(self.check_waiting().is_ok());
        self.schedule_step(mgr, toks, now)
    }

    /// Every waiting request has exactly one WAITING sequence: `add_group` admits only such
    /// groups and recompute preemption makes only such groups, and `fork` needs a parent with
    /// blocks (so never a waiting one); the step relies on it before any decision.
    pub(crate) fn check_waiting(&self) -> Result<()> {
        for &key in &self.waiting {
            let g = self.g(key);
            if g.ids_with(Status::Waiting).count() != 1 {
                return Err(Error::invalid(format!(
                    "waiting request {} must have exactly one WAITING sequence",
                    g.request_id
                )));
            }
        }
        Ok(())
    }

    fn schedule_step<T: Tokens>(
        &mut self,
        mgr: &mut Manager,
        toks: &T,
        now: f64,
    ) -> Result<Outputs> {
        let mut st = Step {
            mgr,
            toks,
            copies: Vec::new(),
            copy_index: IdMap::default(),
            cows: Vec::new(),
        };
        let mut out = if self.cfg.chunked_prefill {
            self.schedule_chunked(&mut st, now)?
        } else {
            self.schedule_default(&mut st, now)?
        };
        out.copies = st.copies;
        out.running_queue_size = self.running.len();
        Ok(out)
    }

    fn schedule_default<T: Tokens>(&mut self, st: &mut Step<T>, now: f64) -> Result<Outputs> {
        let mut budget = self.budget();
        for i in 0..self.running.len() {
            let k = self.running[i];
            budget.add_seqs(k, self.g(k).max_running_seqs());
        }
        let mut loras: Loras = self
            .cfg
            .max_loras
            .map(|_| self.running.iter().map(|&k| self.g(k).lora).collect());
        let (mut prefills, mut ignored) = (Vec::new(), Vec::new());
        // each queue a step leaves alone is copied as it is (once the step is decided)
        let mut waiting = None;
        if self.swapped.is_empty() {
            let (w, p, i) = self.schedule_prefills(st, &mut budget, &mut loras, false, now)?;
            (waiting, prefills, ignored) = (Some(w), p, i);
        }
        let mut out = Outputs::default();
        let (mut running, mut swapped) = (None, None);
        let (mut run, mut swap) = (Part::default(), Part::default());
        if prefills.is_empty() {
            let r;
            (r, run) = self.schedule_running(st, &mut budget, &mut loras, false, &mut out)?;
            running = Some(r);
            out.lookahead = self.cfg.num_lookahead_slots;
            if !out.any_preempted() {
                let s;
                (s, swap) = self.schedule_swapped(
                    st,
                    &mut budget,
                    &mut loras,
                    false,
                    &mut out,
                    &mut ignored,
                )?;
                swapped = Some(s);
            }
        }
        debug_assert!(run.prefill.is_empty() && swap.prefill.is_empty());
        let waiting = waiting.unwrap_or_else(|| self.scratch.copy_queue(&self.waiting));
        let running = running.unwrap_or_else(|| self.scratch.copy_queue(&self.running));
        let swapped = swapped.unwrap_or_else(|| self.scratch.copy_queue(&self.swapped));
        self.finish_queues(
            waiting,
            running,
            swapped,
            &out,
            [&prefills, &run.decode, &swap.decode],
        );
        out.num_prefill_groups = prefills.len();
        out.scheduled = join([prefills, run.decode, swap.decode]);
        out.num_batched_tokens = budget.tokens;
        ignored.extend_from_slice(&out.aborted);
        out.ignored = ignored;
        self.keep_budget(budget);
        Ok(out)
    }

    fn schedule_chunked<T: Tokens>(&mut self, st: &mut Step<T>, now: f64) -> Result<Outputs> {
        let mut budget = self.budget();
        let mut loras: Loras = Some(IdSet::default());
        let mut out = Outputs::default();
        let mut ignored = Vec::new();
        let (running, run) = self.schedule_running(st, &mut budget, &mut loras, true, &mut out)?;
        out.lookahead = self.cfg.num_lookahead_slots;
        let (mut swapped, mut swap) = (None, Part::default());
        if !out.any_preempted() {
            // fix 3: swapped-in prefills are chunked like running ones.
            let s;
            (s, swap) =
                self.schedule_swapped(st, &mut budget, &mut loras, true, &mut out, &mut ignored)?;
            swapped = Some(s);
        }
        let swapped = swapped.unwrap_or_else(|| self.scratch.copy_queue(&self.swapped));
        let (waiting, prefills, mut prefill_ignored) =
            self.schedule_prefills(st, &mut budget, &mut loras, true, now)?;
        let new_running = [
            &prefills,
            &run.decode,
            &run.prefill,
            &swap.decode,
            &swap.prefill,
        ];
        self.finish_queues(waiting, running, swapped, &out, new_running);
        out.num_prefill_groups = prefills.len() + run.prefill.len() + swap.prefill.len();
        out.scheduled = join([prefills, run.prefill, swap.prefill, run.decode, swap.decode]);
        out.num_batched_tokens = budget.tokens;
        prefill_ignored.extend(ignored);
        prefill_ignored.extend_from_slice(&out.aborted);
        out.ignored = prefill_ignored;
        self.keep_budget(budget);
        Ok(out)
    }

    fn budget(&mut self) -> Budget {
        let groups = self.running.len() + self.swapped.len() + 16;
        let sets = [
            std::mem::take(&mut self.scratch.token_keys),
            std::mem::take(&mut self.scratch.seq_keys),
        ];
        Budget::new(
            self.cfg.max_num_batched_tokens,
            self.cfg.max_num_seqs,
            groups,
            sets,
        )
    }

    /// Keep the budget's sets for the next step.
    fn keep_budget(&mut self, budget: Budget) {
        self.scratch.token_keys = budget.token_keys;
        self.scratch.seq_keys = budget.seq_keys;
    }

    /// Install the queues after a step, in vLLM's order.
    fn finish_queues<const N: usize>(
        &mut self,
        mut waiting: VecDeque<GroupKey>,
        mut running: VecDeque<GroupKey>,
        mut swapped: VecDeque<GroupKey>,
        out: &Outputs,
        new_running: [&Vec<Scheduled>; N],
    ) {
        for &k in &out.preempted {
            waiting.push_front(k); // deque.extendleft: the last preempted ends up first
        }
        for part in new_running {
            running.extend(part.iter().map(|s| s.key));
        }
        swapped.extend(out.swapped_out.iter().copied());
        let old = [
            std::mem::replace(&mut self.waiting, waiting),
            std::mem::replace(&mut self.running, running),
            std::mem::replace(&mut self.swapped, swapped),
        ];
        for q in old {
            self.scratch.recycle(q);
        }
    }

    /// FCFS: vLLM sorts by `now - arrival`, descending, stably.
    /// The queue is usually in order already (one pass to check instead of a sort).
    fn by_arrival(&mut self, which: Queue) -> VecDeque<GroupKey> {
        let q = match which {
            Queue::Running => &self.running,
            Queue::Swapped => &self.swapped,
        };
        let mut v = self.scratch.copy_queue(q);
        let arrival = |k: &GroupKey| self.g(*k).arrival;
        if !v
            .iter()
            .map(arrival)
            .is_sorted_by(|a, b| a.total_cmp(b).is_le())
        {
            // stable, like Python's sort
            v.make_contiguous()
                .sort_by(|a, b| arrival(a).total_cmp(&arrival(b)));
        }
        v
    }

    fn seq_len<T: Tokens>(&self, st: &Step<T>, id: SeqId) -> Result<usize> {
        st.toks.with(id, |t| t.len())
    }

    /// vLLM's `_get_num_new_tokens` for the sequences of `key` in `status`.
    fn num_new_tokens<T: Tokens>(
        &self,
        st: &Step<T>,
        key: GroupKey,
        status: Status,
        chunking: bool,
        budget: &Budget,
    ) -> Result<usize> {
        let mut n = 0;
        let mut count = 0;
        for s in self.g(key).seqs.iter().filter(|s| s.status == status) {
            count += 1;
            n += if s.decode {
                1
            } else {
                self.seq_len(st, s.id)?.saturating_sub(s.num_computed)
            };
        }
        if chunking && count == 1 {
            n = n.min(budget.remaining());
        }
        Ok(n)
    }

    fn schedule_running<T: Tokens>(
        &mut self,
        st: &mut Step<T>,
        budget: &mut Budget,
        loras: &mut Loras,
        chunking: bool,
        out: &mut Outputs,
    ) -> Result<(VecDeque<GroupKey>, Part)> {
        let mut queue = self.by_arrival(Queue::Running);
        let mut part = Part {
            prefill: Vec::new(),
            decode: Vec::with_capacity(queue.len()),
        };
        while let Some(&key) = queue.front() {
            let n = self.num_new_tokens(st, key, Status::Running, chunking, budget)?;
            // fix 1: a group that cannot be chunked (several sequences) must fit the budget.
            if n == 0 || (chunking && n > budget.remaining()) {
                break;
            }
            queue.pop_front();
            loop {
                if self.can_append_slots(st, key)? {
                    self.append_slots(st, key)?;
                    let chunk = Scheduled { key, chunk: n };
                    if self.g(key).is_prefill() {
                        part.prefill.push(chunk);
                    } else {
                        part.decode.push(Scheduled { key, chunk: 1 });
                    }
                    budget.add_tokens(key, n);
                    if chunking {
                        budget.add_seqs(key, self.g(key).max_running_seqs());
                    }
                    let lora = self.g(key).lora;
                    if let (Some(l), true) = (loras.as_mut(), lora > 0) {
                        l.insert(lora);
                    }
                    break;
                }
                budget.sub_tokens(key, n);
                budget.sub_seqs(key, self.g(key).max_running_seqs());
                let lora = self.g(key).lora;
                if let (Some(l), true) = (loras.as_mut(), lora > 0) {
                    l.remove(&lora); // fix 5: vLLM's set.remove raises when absent
                }
                let victim = queue.pop_back();
                self.preempt(st, victim.unwrap_or(key), out)?;
                if victim.is_none() {
                    break;
                }
            }
        }
        Ok((queue, part))
    }

    fn running_ids(&self, key: GroupKey) -> SeqIds {
        self.g(key).ids_with(Status::Running).collect()
    }

    /// vLLM's `can_append_slots` for the running sequences of a group: one free block per
    /// sequence, or the exact need if larger (the manager's rule).
    fn can_append_slots<T: Tokens>(&self, st: &Step<T>, key: GroupKey) -> Result<bool> {
        let la = self.cfg.num_lookahead_slots;
        let (mut need, mut count) = (0, 0);
        for id in self.g(key).ids_with(Status::Running) {
            need += st.toks.with(id, |t| st.mgr.append_need(id, t, la))??;
            count += 1;
        }
        Ok(st.mgr.num_free_gpu_blocks() >= need.max(count))
    }

    fn append_slots<T: Tokens>(&self, st: &mut Step<T>, key: GroupKey) -> Result<()> {
        let la = self.cfg.num_lookahead_slots;
        for id in self.g(key).ids_with(Status::Running) {
            let Step {
                mgr, toks, cows, ..
            } = st;
            toks.with(id, |t| mgr.append_slots(id, t, la, cows))??;
            st.add_copies();
        }
        Ok(())
    }

    /// Preempt `key` (vLLM's `_preempt`): recompute single-sequence groups, swap others,
    /// unless the config forces a mode. When the CPU cannot hold the group's blocks, a group
    /// with one running sequence is recomputed instead (fix 4) and one with several, which
    /// cannot be recomputed, is aborted (fix 7).
    fn preempt<T: Tokens>(
        &mut self,
        st: &mut Step<T>,
        key: GroupKey,
        out: &mut Outputs,
    ) -> Result<()> {
        let g = self.g(key);
        let auto = if g.max_running_seqs() == 1 {
            PreemptionMode::Recompute
        } else {
            PreemptionMode::Swap
        };
        let running = self.running_ids(key);
        let mut mode = self.cfg.preemption_mode.unwrap_or(auto);
        if mode == PreemptionMode::Recompute && running.len() > 1 {
            // Forked sequences cannot be re-prefilled from one shared prompt table.
            mode = PreemptionMode::Swap;
        }
        // The blocks `swap` moves: those of the running sequences (a running group's
        // unfinished sequences, which vLLM's `can_swap_out` counts, are its running ones).
        if mode == PreemptionMode::Swap && !st.mgr.can_swap_out(&running)? {
            if running.len() > 1 {
                self.abort_group(key, st.mgr)?; // fix 7: vLLM raises RuntimeError
                out.aborted.push(key);
                return Ok(());
            }
            mode = PreemptionMode::Recompute; // fix 4: no swap space -> recompute
        }
        match mode {
            PreemptionMode::Recompute => {
                for &id in &running {
                    st.mgr.free(id)?;
                }
                self.move_seqs(key, Some(Status::Running), Status::Waiting, true);
                out.preempted.push(key);
            }
            PreemptionMode::Swap => {
                let m = st.mgr.swap(&running, Device::Gpu)?;
                out.swap_out.extend(m);
                self.move_seqs(key, Some(Status::Running), Status::Swapped, false);
                out.swapped_out.push(key);
            }
        }
        Ok(())
    }

    fn lora_blocked(&self, key: GroupKey, loras: &Loras) -> bool {
        let (Some(max), Some(l)) = (self.cfg.max_loras, loras.as_ref()) else {
            return false;
        };
        let lora = self.g(key).lora;
        lora > 0 && !l.contains(&lora) && l.len() >= max
    }

    fn schedule_swapped<T: Tokens>(
        &mut self,
        st: &mut Step<T>,
        budget: &mut Budget,
        loras: &mut Loras,
        chunking: bool,
        out: &mut Outputs,
        ignored: &mut Vec<GroupKey>,
    ) -> Result<(VecDeque<GroupKey>, Part)> {
        let mut queue = self.by_arrival(Queue::Swapped);
        let mut part = Part::default();
        let mut leftover = Vec::new();
        while let Some(&key) = queue.front() {
            let g = self.g(key);
            let unfinished: Vec<SeqId> = g
                .seqs
                .iter()
                .filter(|s| !s.status.is_finished())
                .map(|s| s.id)
                .collect();
            let ids: Vec<SeqId> = g.ids_with(Status::Swapped).collect();
            match self.can_swap_in(st, &unfinished, &ids)? {
                AllocStatus::Later => break,
                AllocStatus::Never => {
                    // fix 6: vLLM marks every sequence ignored (finished ones too) but never
                    // frees their CPU blocks. A finished sequence keeps its finish (the
                    // engine may not even have forked it into the scheduler).
                    for &id in &unfinished {
                        st.mgr.free(id)?;
                    }
                    self.move_seqs(key, None, Status::Finished(Finish::Ignored), false);
                    ignored.push(key);
                    queue.pop_front();
                    continue;
                }
                AllocStatus::Ok => {}
            }
            if self.lora_blocked(key, loras) {
                leftover.push(key);
                queue.pop_front();
                continue;
            }
            let seqs = self.g(key).max_running_seqs();
            let n = self.num_new_tokens(st, key, Status::Swapped, chunking, budget)?;
            if n == 0 || !budget.can_schedule(n, seqs) {
                break;
            }
            let lora = self.g(key).lora;
            if let (Some(l), true) = (loras.as_mut(), lora > 0) {
                l.insert(lora);
            }
            queue.pop_front();
            out.swap_in.extend(st.mgr.swap(&ids, Device::Cpu)?);
            self.move_seqs(key, Some(Status::Swapped), Status::Running, false);
            self.append_slots(st, key)?;
            if self.g(key).is_prefill() {
                part.prefill.push(Scheduled { key, chunk: n });
            } else {
                part.decode.push(Scheduled { key, chunk: 1 });
            }
            budget.add_tokens(key, n);
            budget.add_seqs(key, seqs);
        }
        for &k in leftover.iter().rev() {
            queue.push_front(k);
        }
        Ok((queue, part))
    }

    /// vLLM's `can_swap_in` for a swapped group (`unfinished`: its unfinished sequences,
    /// `ids`: its swapped ones), then the bound of what the swap-in and the appends after it
    /// take (`swap_in_need`), which only lookahead slots can raise above vLLM's reserve.
    fn can_swap_in<T: Tokens>(
        &self,
        st: &Step<T>,
        unfinished: &[SeqId],
        ids: &[SeqId],
    ) -> Result<AllocStatus> {
        let status = st.mgr.can_swap_in(unfinished, ids.len(), 0)?;
        if status != AllocStatus::Ok {
            return Ok(status);
        }
        let need = self.swap_in_need(st, ids)?;
        Ok(if need > st.mgr.config().num_gpu_blocks as usize {
            AllocStatus::Never
        } else if need > st.mgr.num_free_gpu_blocks() {
            AllocStatus::Later
        } else {
            AllocStatus::Ok
        })
    }

    /// The free GPU blocks swapping `ids` in and appending their slots takes at most
    /// (`Manager::swap_in_need`). vLLM's `can_swap_in` reserves one block per sequence for
    /// the appends, which covers them without lookahead slots (an append then visits one
    /// table position); with them, forks that share their lookahead blocks can need more
    /// (vLLM 0.4.2's v1 manager refuses lookahead slots).
    fn swap_in_need<T: Tokens>(&self, st: &Step<T>, ids: &[SeqId]) -> Result<usize> {
        let la = self.cfg.num_lookahead_slots;
        let mut seqs = Vec::with_capacity(ids.len());
        for &id in ids {
            seqs.push(
                st.toks
                    .with(id, |t| (id, t.len().saturating_add(la), t.block_size()))?,
            );
        }
        st.mgr.swap_in_need(&seqs)
    }

    /// vLLM's `_passed_delay` (called once per loop turn, as vLLM does).
    fn passed_delay(&mut self, now: f64) -> bool {
        if self.prev_prompt {
            self.last_prompt_latency = now - self.prev_time;
        }
        self.prev_time = now;
        self.prev_prompt = false;
        if self.cfg.delay_factor > 0.0 && !self.waiting.is_empty() {
            let earliest = self
                .waiting
                .iter()
                .map(|&k| self.g(k).arrival)
                .fold(f64::INFINITY, f64::min);
            now - earliest > self.cfg.delay_factor * self.last_prompt_latency
                || self.running.is_empty()
        } else {
            true
        }
    }

    #[allow(clippy::type_complexity)]
    fn schedule_prefills<T: Tokens>(
        &mut self,
        st: &mut Step<T>,
        budget: &mut Budget,
        loras: &mut Loras,
        chunking: bool,
        now: f64,
    ) -> Result<(VecDeque<GroupKey>, Vec<Scheduled>, Vec<GroupKey>)> {
        let mut queue = self.scratch.copy_queue(&self.waiting);
        let (mut scheduled, mut ignored, mut leftover) = (Vec::new(), Vec::new(), Vec::new());
        while self.passed_delay(now) {
            let Some(&key) = queue.front() else { break };
            // One WAITING sequence: checked for every waiting group before the step.
            let Some(id) = self.g(key).ids_with(Status::Waiting).next() else {
                return Err(Error::invalid("a waiting request has no WAITING sequence"));
            };
            let n = self.num_new_tokens(st, key, Status::Waiting, chunking, budget)?;
            let never = n > self.cfg.prompt_limit()
                || st.toks.with(id, |t| st.mgr.can_allocate(t))?? == AllocStatus::Never;
            if never {
                self.move_seqs(
                    key,
                    Some(Status::Waiting),
                    Status::Finished(Finish::Ignored),
                    false,
                );
                ignored.push(key);
                queue.pop_front();
                continue;
            }
            if st.toks.with(id, |t| st.mgr.can_allocate(t))?? == AllocStatus::Later {
                break;
            }
            if self.lora_blocked(key, loras) {
                leftover.push(key);
                queue.pop_front();
                continue;
            }
            let seqs = self.g(key).max_running_seqs();
            if n == 0 || !budget.can_schedule(n, seqs) {
                break;
            }
            let lora = self.g(key).lora;
            if let (Some(l), true) = (loras.as_mut(), lora > 0) {
                l.insert(lora);
            }
            queue.pop_front();
            let Step { mgr, toks, .. } = st;
            toks.with(id, |t| mgr.allocate(&[(id, t)]))??;
            self.move_seqs(key, Some(Status::Waiting), Status::Running, false);
            scheduled.push(Scheduled { key, chunk: n });
            budget.add_tokens(key, n);
            budget.add_seqs(key, seqs);
        }
        for &k in leftover.iter().rev() {
            queue.push_front(k);
        }
        if !scheduled.is_empty() {
            self.prev_prompt = true;
        }
        Ok((queue, scheduled, ignored))
    }

    /// After `schedule`: the per-group metadata vLLM's `schedule()` builds, with the block
    /// accesses and computed marks it makes (in its order: all metadata, then the marks).
    pub fn step_meta<T: Tokens>(
        &mut self,
        mgr: &mut Manager,
        toks: &T,
        out: &Outputs,
        now: f64,
    ) -> Result<Vec<StepMeta>> {
        self.build_meta(mgr, toks, out, now, true)
    }

    /// `step_meta`, with `computed_block_nums` gathered for every group only when
    /// `with_computed`. The batch step needs them only for prompt groups without chunked
    /// prefill (its rows skip the cached prefix, as vLLM 0.4.2's model runner does): elsewhere
    /// they are an O(table) walk per sequence nobody reads.
    pub fn build_meta<T: Tokens>(
        &mut self,
        mgr: &mut Manager,
        toks: &T,
        out: &Outputs,
        now: f64,
        with_computed: bool,
    ) -> Result<Vec<StepMeta>> {
        let mut metas = Vec::with_capacity(out.scheduled.len());
        for s in &out.scheduled {
            let running = self.running_ids(s.key);
            for &id in &running {
                mgr.access_all_blocks_in_seq(id, now)?;
            }
            let is_prompt = self.g(s.key).is_prefill();
            let computed = match with_computed || (is_prompt && !self.cfg.chunked_prefill) {
                true => mgr.common_computed_prefix(&running),
                false => None,
            };
            let g = self.gm(s.key);
            let first_time = !g.scheduled_before;
            g.scheduled_before = true;
            let mut do_sample = true;
            if is_prompt {
                // fix 2: the unfinished sequence, not "the only sequence" of the group.
                if let Some(q) = self.g(s.key).seqs.iter().find(|q| !q.status.is_finished()) {
                    let len = toks.with(q.id, |t| t.len())?;
                    do_sample = s.chunk + q.num_computed >= len;
                }
            }
            metas.push(StepMeta {
                key: s.key,
                is_prompt,
                do_sample,
                running,
                computed,
                first_time,
            });
        }
        if mgr.config().enable_caching {
            for s in &out.scheduled {
                for q in &self.g(s.key).seqs {
                    let len = toks.with(q.id, |t| t.len())?;
                    mgr.compute_full_blocks_in_seq(q.id, len);
                }
            }
        }
        Ok(metas)
    }
}
