//! vLLM 0.4.2's scheduler (`vllm/core/scheduler.py`) over the core [`Manager`].
//!
//! The design, and the vLLM failures we fix instead of copying, are in `docs/scheduler.md`.
//! State: a slab of [`Group`]s addressed by [`GroupKey`] and three FCFS queues of keys
//! (`waiting`, `running`, `swapped`). The policy in [`policy`] decides one step; every status
//! change it makes is also pushed onto a change list so that a caller holding views of the
//! sequences (the Python bindings) writes back exactly what changed.
//!
//! Invariants: a key is in at most one queue; a queued key names a live slab entry; a sequence
//! id belongs to at most one live group; a sequence holds a block table iff it is RUNNING or
//! SWAPPED (or finished but not yet freed by the engine).

mod policy;
mod rows;
mod seq_ids;
mod step;
#[cfg(test)]
mod tests;

use crate::error::{Error, Result};
use crate::vllm_042::manager::{Manager, SeqId};
use crate::vllm_042::token_seq::TokenSeq;
use std::collections::VecDeque;

pub use policy::{Outputs, Scheduled, StepMeta};
pub use rows::StableRows;
pub use seq_ids::SeqIds;
pub use step::{
    cached_skip, Applied, Batch, HeldTables, ModelInputs, Row, SentTables, StopRules, TableDelta,
    TokensMut, Written, NO_ROW, ROW_APPENDED, ROW_MOVED, ROW_REWRITTEN, ROW_SAME,
};

pub type GroupKey = u32;

pub use crate::id_map::{IdHasher, IdMap, IdSet};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreemptionMode {
    Swap,
    Recompute,
}

/// vLLM's `SchedulerConfig` fields that steer the policy, plus `max_loras` from `LoRAConfig`
/// (`None`: LoRA disabled) and an optional forced preemption mode.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    pub num_lookahead_slots: usize,
    pub delay_factor: f64,
    pub chunked_prefill: bool,
    pub max_loras: Option<usize>,
    pub preemption_mode: Option<PreemptionMode>,
}

impl SchedulerConfig {
    /// The longest prompt that can be scheduled at all.
    pub fn prompt_limit(&self) -> usize {
        if self.chunked_prefill {
            self.max_model_len
        } else {
            self.max_model_len.min(self.max_num_batched_tokens)
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stopped,
    LengthCapped,
    Aborted,
    Ignored,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Waiting,
    Running,
    Swapped,
    Finished(Finish),
}

impl Status {
    pub fn is_finished(self) -> bool {
        matches!(self, Status::Finished(_))
    }
}

/// One sequence's scheduling state (tokens live in its `TokenSeq`).
#[derive(Clone, Debug)]
pub struct SeqState {
    pub id: SeqId,
    pub status: Status,
    /// Past the prefill (vLLM's `SequenceStage.DECODE`).
    pub decode: bool,
    pub num_computed: usize,
}

/// One request (vLLM's `SequenceGroup`).
#[derive(Clone, Debug)]
pub struct Group {
    pub request_id: String,
    pub arrival: f64,
    pub lora: u32,
    pub best_of: usize,
    pub beam: bool,
    pub seqs: Vec<SeqState>,
    /// Sequences the engine's group object holds (it may have removed finished ones).
    pub num_seqs: usize,
    /// Set the first time the group is scheduled.
    pub scheduled_before: bool,
}

impl Group {
    pub fn new(request_id: &str, arrival: f64, lora: u32, best_of: usize, beam: bool) -> Self {
        Group {
            request_id: request_id.to_owned(),
            arrival,
            lora,
            best_of: best_of.max(1),
            beam,
            seqs: Vec::new(),
            num_seqs: 0,
            scheduled_before: false,
        }
    }

    pub fn num_unfinished(&self) -> usize {
        self.seqs.iter().filter(|s| !s.status.is_finished()).count()
    }

    /// vLLM's `get_max_num_running_seqs`: the most sequences this request will run at once.
    pub fn max_running_seqs(&self) -> usize {
        if self.beam || self.best_of > self.num_seqs {
            self.best_of
        } else {
            self.num_unfinished()
        }
    }

    pub fn is_finished(&self) -> bool {
        self.seqs.iter().all(|s| s.status.is_finished())
    }

    /// The group's stage: that of its first unfinished sequence (docs/scheduler.md, fix 2).
    pub fn is_prefill(&self) -> bool {
        let s = self.seqs.iter().find(|s| !s.status.is_finished());
        s.or(self.seqs.first()).is_some_and(|s| !s.decode)
    }

    pub fn ids_with(&self, status: Status) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs
            .iter()
            .filter(move |s| s.status == status)
            .map(|s| s.id)
    }
}

/// Read access to the token store of a sequence, wherever the caller keeps it.
pub trait Tokens {
    fn with<R>(&self, id: SeqId, f: impl FnOnce(&TokenSeq) -> R) -> Result<R>;
}

/// A status change made by the scheduler, to be mirrored onto the caller's views.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Change {
    pub key: GroupKey,
    pub seq: SeqId,
    pub status: Status,
    /// The sequence was preempted by recomputation: its computed tokens were reset.
    pub reset: bool,
}

/// Buffers a step needs and that are kept across steps so that a steady step does not
/// allocate (their contents mean nothing between steps).
#[derive(Clone, Default)]
struct StepScratch {
    /// Per row of the previous batch, where its samples start (`apply_sampled`).
    sample_starts: Vec<usize>,
    /// The budget's sets of groups counted for tokens and for sequences.
    token_keys: IdSet<GroupKey>,
    seq_keys: IdSet<GroupKey>,
    /// Emptied queues from earlier steps, refilled as this step's working queues.
    spare_queues: Vec<VecDeque<GroupKey>>,
}

/// A step makes at most this many working queues at once; more spares are dropped.
const SPARE_QUEUES: usize = 4;

impl StepScratch {
    fn heap_bytes(&self) -> usize {
        use crate::mem::{table_bytes, vec_bytes};
        let key = std::mem::size_of::<GroupKey>();
        let queues: usize = self.spare_queues.iter().map(|q| q.capacity() * key).sum();
        vec_bytes(&self.sample_starts)
            + table_bytes(self.token_keys.capacity(), key)
            + table_bytes(self.seq_keys.capacity(), key)
            + vec_bytes(&self.spare_queues)
            + queues
    }

    /// An empty queue holding `q`'s keys, from a spare one when there is one.
    fn copy_queue(&mut self, q: &VecDeque<GroupKey>) -> VecDeque<GroupKey> {
        let mut copy = self.spare_queues.pop().unwrap_or_default();
        copy.extend(q.iter().copied());
        copy
    }

    /// Keep `q`'s buffer for a later step.
    fn recycle(&mut self, mut q: VecDeque<GroupKey>) {
        if self.spare_queues.len() < SPARE_QUEUES {
            q.clear();
            self.spare_queues.push(q);
        }
    }
}

#[derive(Clone)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    groups: Vec<Option<Group>>,
    free_keys: Vec<GroupKey>,
    by_seq: IdMap<SeqId, GroupKey>,
    pub(crate) waiting: VecDeque<GroupKey>,
    pub(crate) running: VecDeque<GroupKey>,
    pub(crate) swapped: VecDeque<GroupKey>,
    prev_time: f64,
    prev_prompt: bool,
    last_prompt_latency: f64,
    changes: Vec<Change>,
    scratch: StepScratch,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Result<Self> {
        if cfg.max_num_seqs == 0 || cfg.max_num_batched_tokens == 0 || cfg.max_model_len == 0 {
            return Err(Error::invalid(
                "max_num_seqs, max_num_batched_tokens and max_model_len must be positive",
            ));
        }
        if !(cfg.delay_factor >= 0.0 && cfg.delay_factor.is_finite()) {
            return Err(Error::invalid("delay_factor must be a finite number >= 0"));
        }
        if cfg.max_loras == Some(0) {
            return Err(Error::invalid("max_loras must be positive"));
        }
        // A sequence's slots (its tokens plus the lookahead) are numbered in int32 buffers.
        let slots = cfg.max_model_len.saturating_add(cfg.num_lookahead_slots);
        if slots as u64 > crate::limits::MAX_GPU_SLOTS {
            return Err(Error::invalid(format!(
                "max_model_len + num_lookahead_slots is {slots}; at most 2**31 slots fit int32"
            )));
        }
        Ok(Scheduler {
            cfg,
            groups: Vec::new(),
            free_keys: Vec::new(),
            by_seq: IdMap::default(),
            waiting: VecDeque::new(),
            running: VecDeque::new(),
            swapped: VecDeque::new(),
            prev_time: 0.0,
            prev_prompt: false,
            last_prompt_latency: 0.0,
            changes: Vec::new(),
            scratch: StepScratch::default(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Heap bytes of the scheduler's state: the group slab (each group's sequences and
    /// request id), the sequence index and the queues.
    pub fn heap_bytes(&self) -> usize {
        use crate::mem::{map_bytes, vec_bytes};
        let deque = |q: &VecDeque<GroupKey>| q.capacity() * std::mem::size_of::<GroupKey>();
        let groups: usize = self
            .groups
            .iter()
            .flatten()
            .map(|g| vec_bytes(&g.seqs) + g.request_id.capacity())
            .sum();
        vec_bytes(&self.groups)
            + groups
            + vec_bytes(&self.free_keys)
            + map_bytes(&self.by_seq)
            + deque(&self.waiting)
            + deque(&self.running)
            + deque(&self.swapped)
            + vec_bytes(&self.changes)
            + self.scratch.heap_bytes()
    }

    pub fn group(&self, key: GroupKey) -> Option<&Group> {
        self.groups.get(key as usize).and_then(|g| g.as_ref())
    }

    pub fn group_mut(&mut self, key: GroupKey) -> Option<&mut Group> {
        self.groups.get_mut(key as usize).and_then(|g| g.as_mut())
    }

    fn g(&self, key: GroupKey) -> &Group {
        self.groups[key as usize]
            .as_ref()
            .expect("queued key is live")
    }

    fn gm(&mut self, key: GroupKey) -> &mut Group {
        self.groups[key as usize]
            .as_mut()
            .expect("queued key is live")
    }

    pub fn waiting(&self) -> &VecDeque<GroupKey> {
        &self.waiting
    }
    pub fn running(&self) -> &VecDeque<GroupKey> {
        &self.running
    }
    pub fn swapped(&self) -> &VecDeque<GroupKey> {
        &self.swapped
    }

    pub fn num_unfinished_groups(&self) -> usize {
        self.waiting.len() + self.running.len() + self.swapped.len()
    }

    pub fn group_of_seq(&self, id: SeqId) -> Option<GroupKey> {
        self.by_seq.get(&id).copied()
    }

    /// The status changes since the last call.
    pub fn take_changes(&mut self) -> Vec<Change> {
        std::mem::take(&mut self.changes)
    }

    /// Queue a new request (vLLM's `add_seq_group`). Every sequence must be new to the
    /// scheduler and the group must have exactly one sequence, WAITING (a fresh request).
    pub fn add_group(&mut self, group: Group) -> Result<GroupKey> {
        let mut ids: Vec<SeqId> = group.seqs.iter().map(|s| s.id).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::invalid("a sequence id appears twice in the group"));
        }
        if let Some(id) = ids.iter().find(|id| self.by_seq.contains_key(id)) {
            return Err(Error::invalid(format!(
                "sequence {id} already belongs to a scheduled group"
            )));
        }
        if group
            .seqs
            .iter()
            .filter(|s| s.status == Status::Waiting)
            .count()
            != 1
        {
            return Err(Error::invalid(
                "a new sequence group must have exactly one WAITING sequence",
            ));
        }
        let key = match self.free_keys.pop() {
            Some(k) => k,
            None => {
                let k = u32::try_from(self.groups.len())
                    .map_err(|_| Error::invalid("too many sequence groups"))?;
                self.groups.push(None);
                k
            }
        };
        for s in &group.seqs {
            self.by_seq.insert(s.id, key);
        }
        self.groups[key as usize] = Some(group);
        self.waiting.push_back(key);
        Ok(key)
    }

    /// Drop a group that is in no queue (finished, ignored or aborted).
    pub fn release(&mut self, key: GroupKey) -> Option<Group> {
        let g = self.groups.get_mut(key as usize)?.take()?;
        for s in &g.seqs {
            if self.by_seq.get(&s.id) == Some(&key) {
                self.by_seq.remove(&s.id);
            }
        }
        self.free_keys.push(key);
        Some(g)
    }

    /// The engine removed these sequences from a running group (vLLM's `SequenceGroup.remove`,
    /// as beam search does with the parents it drops): they no longer count for the group.
    /// Their blocks are the engine's to free (`free_seq`), as in vLLM.
    pub fn remove_seqs(&mut self, key: GroupKey, ids: &[SeqId]) {
        let Some(g) = self.group_mut(key) else {
            return;
        };
        g.seqs.retain(|s| !ids.contains(&s.id));
        for id in ids {
            if self.by_seq.get(id) == Some(&key) {
                self.by_seq.remove(id);
            }
        }
    }

    fn set_status(&mut self, key: GroupKey, idx: usize, status: Status, reset: bool) {
        let s = &mut self.gm(key).seqs[idx];
        s.status = status;
        if reset {
            s.num_computed = 0;
            s.decode = false;
        }
        let seq = s.id;
        self.changes.push(Change {
            key,
            seq,
            status,
            reset,
        });
    }

    /// Set every sequence of `key` in `from` (any unfinished one if `None`) to `to`.
    fn move_seqs(&mut self, key: GroupKey, from: Option<Status>, to: Status, reset: bool) {
        for i in 0..self.g(key).seqs.len() {
            let st = self.g(key).seqs[i].status;
            let hit = match from {
                Some(f) => st == f,
                None => !st.is_finished(),
            };
            if hit {
                self.set_status(key, i, to, reset);
            }
        }
    }

    /// vLLM's `abort_seq_group`: in each queue, the first group with each request id is
    /// removed; its unfinished sequences become FINISHED_ABORTED and are freed. Returns the
    /// removed groups' keys (still live: the caller releases them after reading them).
    pub fn abort(&mut self, request_ids: &[&str], mgr: &mut Manager) -> Result<Vec<GroupKey>> {
        let mut left: Vec<&str> = request_ids.to_vec();
        left.sort_unstable();
        left.dedup();
        let mut out = Vec::new();
        for q in 0..3 {
            let queue = match q {
                0 => &self.waiting,
                1 => &self.running,
                _ => &self.swapped,
            };
            let mut hits = Vec::new();
            for &key in queue {
                if left.is_empty() {
                    break;
                }
                let rid = self.g(key).request_id.as_str();
                if let Ok(pos) = left.binary_search(&rid) {
                    left.remove(pos);
                    hits.push(key);
                }
            }
            let queue = match q {
                0 => &mut self.waiting,
                1 => &mut self.running,
                _ => &mut self.swapped,
            };
            queue.retain(|k| !hits.contains(k));
            for &key in &hits {
                self.abort_group(key, mgr)?;
            }
            out.extend(hits);
        }
        Ok(out)
    }

    /// The unfinished sequences of `key` become FINISHED_ABORTED and are freed (the group
    /// stays live and queued: the caller takes it out).
    fn abort_group(&mut self, key: GroupKey, mgr: &mut Manager) -> Result<()> {
        for i in 0..self.g(key).seqs.len() {
            let s = &self.g(key).seqs[i];
            if s.status.is_finished() {
                continue;
            }
            let id = s.id;
            self.set_status(key, i, Status::Finished(Finish::Aborted), false);
            mgr.free(id)?;
        }
        Ok(())
    }

    /// vLLM's `fork_seq`: the child joins the parent's group with the parent's state and
    /// shares its blocks.
    pub fn fork(&mut self, parent: SeqId, child: SeqId, mgr: &mut Manager) -> Result<()> {
        let key = self
            .by_seq
            .get(&parent)
            .copied()
            .ok_or(Error::UnknownSequence(parent))?;
        if self.by_seq.contains_key(&child) {
            return Err(Error::invalid(format!(
                "sequence {child} already belongs to a scheduled group"
            )));
        }
        let st = self.g(key).seqs.iter().find(|s| s.id == parent).cloned();
        let st = st.ok_or(Error::UnknownSequence(parent))?;
        mgr.fork(parent, child)?;
        let g = self.gm(key);
        g.seqs.push(SeqState { id: child, ..st });
        g.num_seqs += 1;
        self.by_seq.insert(child, key);
        Ok(())
    }

    /// [`Self::free_finished`] for the running groups among `keys` only (the bindings read
    /// back just the groups the engine finished). Returns the keys dropped.
    pub fn free_finished_among(&mut self, keys: &[GroupKey]) -> Vec<GroupKey> {
        if keys.is_empty() {
            return Vec::new();
        }
        let mut wanted = keys.to_vec();
        wanted.sort_unstable();
        let mut done = Vec::new();
        let groups = &self.groups;
        self.running.retain(|&k| {
            let fin = wanted.binary_search(&k).is_ok()
                && groups[k as usize].as_ref().is_none_or(|g| g.is_finished());
            if fin {
                done.push(k);
            }
            !fin
        });
        done
    }

    /// vLLM's `free_finished_seq_groups`: drop finished groups from the running queue.
    /// Returns their keys (the caller releases them).
    pub fn free_finished(&mut self) -> Vec<GroupKey> {
        let mut done = Vec::new();
        let groups = &self.groups;
        self.running.retain(|&k| {
            let fin = groups[k as usize].as_ref().is_none_or(|g| g.is_finished());
            if fin {
                done.push(k);
            }
            !fin
        });
        done
    }
}
