//! Unit tests of the scheduling policy: budgets, FCFS, ignoring, preemption, swapping,
//! chunked prefill, LoRA limits and the vLLM failures we fix.

use super::*;
use crate::vllm_042::hash::{HashAlgo, HashExtra, Hasher};
use crate::vllm_042::manager::{Device, ManagerConfig};
use std::cell::RefCell;
use std::collections::HashMap;

const H: Hasher = Hasher {
    algo: HashAlgo::Xxh3,
    seed: 1,
};
const BS: usize = 4;

#[derive(Default)]
struct Store(RefCell<HashMap<SeqId, TokenSeq>>);

impl Tokens for Store {
    fn with<R>(&self, id: SeqId, f: impl FnOnce(&TokenSeq) -> R) -> Result<R> {
        let m = self.0.borrow();
        m.get(&id).map(f).ok_or(Error::UnknownSequence(id))
    }
}

impl Store {
    fn put(&self, id: SeqId, len: usize) {
        let toks: Vec<u32> = (0..len as u32).map(|t| t + 100 * id as u32).collect();
        let s = TokenSeq::new(BS, &toks, HashExtra::default(), H).unwrap();
        self.0.borrow_mut().insert(id, s);
    }
    fn push(&self, id: SeqId) {
        self.0.borrow_mut().get_mut(&id).unwrap().push(7);
    }
    fn fork(&self, p: SeqId, c: SeqId) {
        let s = self.0.borrow()[&p].clone();
        self.0.borrow_mut().insert(c, s);
    }
}

fn sched(tokens: usize, seqs: usize, len: usize, chunked: bool) -> Scheduler {
    Scheduler::new(SchedulerConfig {
        max_num_batched_tokens: tokens,
        max_num_seqs: seqs,
        max_model_len: len,
        num_lookahead_slots: 0,
        delay_factor: 0.0,
        chunked_prefill: chunked,
        max_loras: None,
        preemption_mode: None,
    })
    .unwrap()
}

fn mgr(gpu: u32, cpu: u32) -> Manager {
    Manager::new(ManagerConfig {
        block_size: BS,
        num_gpu_blocks: gpu,
        num_cpu_blocks: cpu,
        watermark: 0.0,
        sliding_window: None,
        enable_caching: false,
        strict: false,
        hasher: H,
    })
    .unwrap()
}

fn add(
    s: &mut Scheduler,
    st: &Store,
    id: SeqId,
    len: usize,
    arrival: f64,
    best_of: usize,
) -> GroupKey {
    st.put(id, len);
    let mut g = Group::new(&format!("r{id}"), arrival, 0, best_of, false);
    g.seqs.push(SeqState {
        id,
        status: Status::Waiting,
        decode: false,
        num_computed: 0,
    });
    g.num_seqs = 1;
    s.add_group(g).unwrap()
}

/// What the engine does after a step: every scheduled sequence computed its chunk; a
/// finished prefill or a decode samples one token.
fn engine_step(s: &mut Scheduler, st: &Store, out: &Outputs) {
    for sc in &out.scheduled {
        let g = s.group_mut(sc.key).unwrap();
        for q in g.seqs.iter_mut().filter(|q| q.status == Status::Running) {
            let len = st.with(q.id, |t| t.len()).unwrap();
            q.num_computed += if q.decode { 1 } else { sc.chunk };
            if q.num_computed == len {
                q.decode = true;
                st.push(q.id);
            }
        }
    }
}

fn keys(v: &[Scheduled]) -> Vec<(GroupKey, usize)> {
    v.iter().map(|s| (s.key, s.chunk)).collect()
}

#[test]
fn fcfs_prefills_then_decodes_within_budget() {
    let (mut s, st, mut m) = (sched(10, 4, 10, false), Store::default(), mgr(64, 16));
    let a = add(&mut s, &st, 1, 4, 1.0, 1);
    let b = add(&mut s, &st, 2, 5, 2.0, 1);
    let c = add(&mut s, &st, 3, 3, 3.0, 1);
    let out = s.schedule(&mut m, &st, 10.0).unwrap();
    // a and b fit the 10-token budget; c (3 more) does not.
    assert_eq!(keys(&out.scheduled), vec![(a, 4), (b, 5)]);
    assert_eq!((out.num_prefill_groups, out.num_batched_tokens), (2, 9));
    assert_eq!(s.waiting().iter().copied().collect::<Vec<_>>(), vec![c]);
    engine_step(&mut s, &st, &out);
    // Next step: c is prefilled alone (prefills first), then a and b decode.
    let out = s.schedule(&mut m, &st, 11.0).unwrap();
    assert_eq!(keys(&out.scheduled), vec![(c, 3)]);
    engine_step(&mut s, &st, &out);
    let out = s.schedule(&mut m, &st, 12.0).unwrap();
    assert_eq!(keys(&out.scheduled), vec![(a, 1), (b, 1), (c, 1)]);
    assert_eq!((out.num_prefill_groups, out.num_batched_tokens), (0, 3));
}

#[test]
fn max_num_seqs_and_prompt_limit() {
    let (mut s, st, mut m) = (sched(100, 2, 8, false), Store::default(), mgr(64, 16));
    let a = add(&mut s, &st, 1, 9, 1.0, 1); // over max_model_len: ignored
    let b = add(&mut s, &st, 2, 2, 2.0, 1);
    let c = add(&mut s, &st, 3, 2, 3.0, 2); // best_of 2 needs two seq slots
    let out = s.schedule(&mut m, &st, 5.0).unwrap();
    assert_eq!(out.ignored, vec![a]);
    assert_eq!(
        s.group(a).unwrap().seqs[0].status,
        Status::Finished(Finish::Ignored)
    );
    assert_eq!(keys(&out.scheduled), vec![(b, 2)]);
    assert_eq!(s.waiting().iter().copied().collect::<Vec<_>>(), vec![c]);
    let ch = s.take_changes();
    assert_eq!(ch.len(), 2, "ignored a + b running: {ch:?}");
}

#[test]
fn alloc_never_is_ignored_and_later_waits() {
    let (mut s, st, mut m) = (sched(100, 8, 100, false), Store::default(), mgr(4, 4));
    let a = add(&mut s, &st, 1, 17, 1.0, 1); // 5 blocks > 4 in the pool: NEVER
    let b = add(&mut s, &st, 2, 12, 2.0, 1); // 3 blocks
    let c = add(&mut s, &st, 3, 8, 3.0, 1); // 2 blocks: LATER (1 left)
    let out = s.schedule(&mut m, &st, 5.0).unwrap();
    assert_eq!(out.ignored, vec![a]);
    assert_eq!(keys(&out.scheduled), vec![(b, 12)]);
    assert_eq!(s.waiting().iter().copied().collect::<Vec<_>>(), vec![c]);
}

#[test]
fn preempts_lowest_priority_by_recompute_then_swap() {
    // 4 GPU blocks; two groups of 4 tokens each fill one block; decodes need one more each.
    let (mut s, st, mut m) = (sched(100, 8, 100, false), Store::default(), mgr(3, 8));
    let a = add(&mut s, &st, 1, 4, 1.0, 1);
    let b = add(&mut s, &st, 2, 4, 2.0, 1);
    let out = s.schedule(&mut m, &st, 5.0).unwrap();
    engine_step(&mut s, &st, &out);
    // a appends into a new block (1 free left -> 0), b cannot: b is the victim (latest arrival)
    // Running queue a, b: a needs 1 block (free 1): ok. b needs 1 (free 0): preempt b itself.
    let out = s.schedule(&mut m, &st, 6.0).unwrap();
    assert_eq!(keys(&out.scheduled), vec![(a, 1)]);
    assert_eq!(out.preempted, vec![b]);
    assert_eq!(s.waiting().iter().copied().collect::<Vec<_>>(), vec![b]);
    let q = &s.group(b).unwrap().seqs[0];
    assert_eq!(
        (q.status, q.num_computed, q.decode),
        (Status::Waiting, 0, false)
    );
    assert!(!m.has_table(2));
    assert!(s.take_changes().iter().any(|c| c.seq == 2 && c.reset));
}

#[test]
fn multi_sequence_group_is_swapped_and_swapped_in_first() {
    let (mut s, st, mut m) = (sched(100, 8, 100, false), Store::default(), mgr(4, 8));
    let a = add(&mut s, &st, 1, 4, 1.0, 1);
    let b = add(&mut s, &st, 2, 3, 2.0, 2);
    let out = s.schedule(&mut m, &st, 5.0).unwrap();
    engine_step(&mut s, &st, &out);
    st.fork(2, 3);
    s.fork(2, 3, &mut m).unwrap();
    assert_eq!(s.group(b).unwrap().max_running_seqs(), 2);
    // a needs a new block (2 free: ok -> 1), b's two seqs share block 1 (len 4 now): both
    // need a new block: 1 free < 2: b is swapped out (several sequences).
    let out = s.schedule(&mut m, &st, 6.0).unwrap();
    assert_eq!(keys(&out.scheduled), vec![(a, 1)]);
    assert_eq!(out.swapped_out, vec![b]);
    assert_eq!(out.swap_out.len(), 1, "the shared block moves once");
    assert_eq!(m.device_of(2).unwrap(), Device::Cpu);
    assert_eq!(s.swapped().iter().copied().collect::<Vec<_>>(), vec![b]);
    // A new request waits while anything is swapped; free a and b comes back first.
    let c = add(&mut s, &st, 9, 2, 7.0, 1);
    engine_step(&mut s, &st, &out);
    s.group_mut(a).unwrap().seqs[0].status = Status::Finished(Finish::Stopped);
    m.free(1).unwrap();
    assert_eq!(
        s.free_finished_among(&[b]),
        vec![],
        "b is swapped, not running"
    );
    assert_eq!(s.free_finished_among(&[]), vec![]);
    assert_eq!(s.free_finished_among(&[c, a]), vec![a]);
    let out = s.schedule(&mut m, &st, 8.0).unwrap();
    assert_eq!(keys(&out.scheduled), vec![(b, 1)]);
    assert_eq!(out.swap_in.len(), 1);
    assert_eq!(
        out.copies.len(),
        1,
        "the two forks copy-on-write their shared block"
    );
    assert!(s.waiting().contains(&c));
}

#[test]
fn chunked_prefill_is_decode_first_and_chunks_prompts() {
    let (mut s, st, mut m) = (sched(8, 8, 100, true), Store::default(), mgr(64, 8));
    let a = add(&mut s, &st, 1, 6, 1.0, 1);
    let b = add(&mut s, &st, 2, 20, 2.0, 1);
    let out = s.schedule(&mut m, &st, 5.0).unwrap();
    assert_eq!(keys(&out.scheduled), vec![(a, 6), (b, 2)]);
    assert_eq!(out.num_prefill_groups, 2);
    engine_step(&mut s, &st, &out);
    let out = s.schedule(&mut m, &st, 6.0).unwrap();
    // a decodes first (1 token); b's prefill chunk takes the other 7.
    assert_eq!(keys(&out.scheduled), vec![(b, 7), (a, 1)]);
    assert_eq!(out.num_batched_tokens, 8);
}

#[test]
fn fix1_unchunkable_group_waits_for_budget() {
    // vLLM adds a 3-sequence decode to a budget of 2 regardless.
    let (mut s, st, mut m) = (sched(2, 8, 100, true), Store::default(), mgr(64, 8));
    let a = add(&mut s, &st, 1, 2, 1.0, 3);
    let out = s.schedule(&mut m, &st, 5.0).unwrap();
    engine_step(&mut s, &st, &out);
    for c in [2, 3] {
        st.fork(1, c);
        s.fork(1, c, &mut m).unwrap();
    }
    let out = s.schedule(&mut m, &st, 6.0).unwrap();
    assert!(out.scheduled.is_empty());
    assert!(out.num_batched_tokens <= 2);
    assert_eq!(s.running().iter().copied().collect::<Vec<_>>(), vec![a]);
}

#[test]
fn lora_limit_leaves_requests_in_order() {
    let mut s = Scheduler::new(SchedulerConfig {
        max_loras: Some(1),
        ..sched(100, 8, 100, false).cfg
    })
    .unwrap();
    let (st, mut m) = (Store::default(), mgr(64, 8));
    let mut ks = Vec::new();
    for (id, lora) in [(1, 1), (2, 2), (3, 1), (4, 3)] {
        let k = add(&mut s, &st, id, 2, id as f64, 1);
        s.group_mut(k).unwrap().lora = lora;
        ks.push(k);
    }
    let out = s.schedule(&mut m, &st, 9.0).unwrap();
    assert_eq!(keys(&out.scheduled), vec![(ks[0], 2), (ks[2], 2)]);
    assert_eq!(
        s.waiting().iter().copied().collect::<Vec<_>>(),
        vec![ks[1], ks[3]]
    );
}

#[test]
fn abort_frees_and_marks_aborted() {
    let (mut s, st, mut m) = (sched(100, 8, 100, false), Store::default(), mgr(64, 8));
    let a = add(&mut s, &st, 1, 5, 1.0, 1);
    let b = add(&mut s, &st, 2, 5, 2.0, 1);
    let out = s.schedule(&mut m, &st, 5.0).unwrap();
    assert_eq!(out.scheduled.len(), 2);
    let free = m.num_free_gpu_blocks();
    let gone = s.abort(&["r1", "nope"], &mut m).unwrap();
    assert_eq!(gone, vec![a]);
    assert_eq!(m.num_free_gpu_blocks(), free + 2);
    assert_eq!(s.running().iter().copied().collect::<Vec<_>>(), vec![b]);
    assert_eq!(
        s.group(a).unwrap().seqs[0].status,
        Status::Finished(Finish::Aborted)
    );
    s.release(a);
    assert!(s.group(a).is_none() && s.group_of_seq(1).is_none());
}

#[test]
fn bad_input_is_refused_without_change() {
    let (mut s, st) = (sched(100, 8, 100, false), Store::default());
    add(&mut s, &st, 1, 5, 1.0, 1);
    let mut g = Group::new("dup", 0.0, 0, 1, false);
    g.seqs.push(SeqState {
        id: 1,
        status: Status::Waiting,
        decode: false,
        num_computed: 0,
    });
    assert!(s.add_group(g).is_err());
    assert!(s.add_group(Group::new("empty", 0.0, 0, 1, false)).is_err());
    assert_eq!(s.num_unfinished_groups(), 1);
    let mut cfg = s.cfg.clone();
    cfg.max_num_seqs = 0;
    assert!(Scheduler::new(cfg).is_err());
}

#[test]
fn state_sizes() {
    // The native state per waiting request: one Group + one SeqState + a queue slot.
    let per_request = std::mem::size_of::<Group>()
        + std::mem::size_of::<SeqState>()
        + std::mem::size_of::<GroupKey>();
    println!(
        "Group {} B, SeqState {} B, per waiting request {} B (+ request id string)",
        std::mem::size_of::<Group>(),
        std::mem::size_of::<SeqState>(),
        per_request
    );
    assert!(per_request <= 160);
}

fn finish(s: &mut Scheduler, m: &mut Manager, key: GroupKey, id: SeqId) {
    let g = s.group_mut(key).unwrap();
    g.seqs.iter_mut().find(|q| q.id == id).unwrap().status = Status::Finished(Finish::Stopped);
    m.free(id).unwrap();
}

#[test]
fn fix2_recomputed_group_with_finished_sequences_is_a_prompt_again() {
    // vLLM asserts that a prefilling group has exactly one sequence (finished ones included).
    let (mut s, st, mut m) = (sched(100, 8, 100, false), Store::default(), mgr(3, 8));
    let a = add(&mut s, &st, 1, 4, 1.0, 1);
    let b = add(&mut s, &st, 2, 4, 2.0, 2);
    let out = s.schedule(&mut m, &st, 5.0).unwrap();
    engine_step(&mut s, &st, &out);
    st.fork(2, 3);
    s.fork(2, 3, &mut m).unwrap();
    finish(&mut s, &mut m, b, 2); // the first sequence of the group finishes
    let out = s.schedule(&mut m, &st, 6.0).unwrap();
    assert_eq!(out.preempted, vec![b], "one unfinished sequence: recompute");
    engine_step(&mut s, &st, &out);
    finish(&mut s, &mut m, a, 1);
    assert_eq!(s.free_finished(), vec![a]);
    let out = s.schedule(&mut m, &st, 7.0).unwrap();
    assert_eq!(keys(&out.scheduled), vec![(b, 5)]);
    let metas = s.step_meta(&mut m, &st, &out, 7.0).unwrap();
    assert!(metas[0].is_prompt && metas[0].do_sample);
    assert_eq!(metas[0].running, vec![3]);
}

#[test]
fn fix3_group_swapped_mid_prefill_comes_back_in_chunks() {
    // vLLM swaps in a prefill unchunked: a prompt longer than the budget never returns.
    let (mut s, st, mut m) = (sched(8, 8, 100, true), Store::default(), mgr(7, 8));
    let a = add(&mut s, &st, 1, 4, 1.0, 1);
    let b = add(&mut s, &st, 2, 20, 2.0, 2);
    let mut swapped_once = false;
    for step in 0..30 {
        let out = s.schedule(&mut m, &st, 10.0 + step as f64).unwrap();
        swapped_once |= out.swapped_out.contains(&b);
        assert!(out.num_batched_tokens <= 8);
        engine_step(&mut s, &st, &out);
        if let Some(g) = s.group(a) {
            let len = st.with(1, |t| t.len()).unwrap();
            if len >= 7 && g.seqs[0].status == Status::Running {
                finish(&mut s, &mut m, a, 1);
                s.free_finished();
            }
        }
        if s.group(b).unwrap().seqs[0].decode {
            assert!(swapped_once, "the test must swap b out mid-prefill");
            return;
        }
    }
    panic!("b never finished its prefill after being swapped out");
}

#[test]
fn fix4_no_swap_space_falls_back_to_recompute() {
    let mut cfg = sched(100, 8, 100, false).cfg;
    cfg.preemption_mode = Some(PreemptionMode::Swap);
    let (mut s, st, mut m) = (Scheduler::new(cfg).unwrap(), Store::default(), mgr(2, 0));
    let a = add(&mut s, &st, 1, 4, 1.0, 1);
    let b = add(&mut s, &st, 2, 4, 2.0, 1);
    let out = s.schedule(&mut m, &st, 5.0).unwrap();
    engine_step(&mut s, &st, &out);
    let out = s.schedule(&mut m, &st, 6.0).unwrap(); // vLLM: RuntimeError (no CPU space)
    assert_eq!(keys(&out.scheduled), vec![(a, 1)]);
    assert_eq!(out.preempted, vec![b]);
    assert!(out.swap_out.is_empty());
}

#[test]
fn fix5_preempting_a_lora_group_in_chunked_mode() {
    // vLLM removes the group's LoRA from a set it was never added to (KeyError).
    let mut cfg = sched(100, 8, 100, true).cfg;
    cfg.max_loras = Some(1);
    let (mut s, st, mut m) = (Scheduler::new(cfg).unwrap(), Store::default(), mgr(3, 8));
    let a = add(&mut s, &st, 1, 4, 1.0, 1);
    let b = add(&mut s, &st, 2, 4, 2.0, 1);
    for k in [a, b] {
        s.group_mut(k).unwrap().lora = 7;
    }
    let out = s.schedule(&mut m, &st, 5.0).unwrap();
    engine_step(&mut s, &st, &out);
    let out = s.schedule(&mut m, &st, 6.0).unwrap();
    assert_eq!(keys(&out.scheduled), vec![(a, 1)]);
    assert_eq!(out.preempted, vec![b]);
}

#[test]
fn fix6_group_that_can_never_swap_in_is_ignored_and_freed() {
    // vLLM marks it ignored but keeps its CPU blocks (and drops it unreported when chunked).
    for chunked in [false, true] {
        let (mut s, st, mut m) = (sched(100, 8, 100, chunked), Store::default(), mgr(6, 8));
        let a = add(&mut s, &st, 1, 4, 1.0, 1);
        let b = add(&mut s, &st, 2, 4, 2.0, 3);
        let out = s.schedule(&mut m, &st, 5.0).unwrap();
        engine_step(&mut s, &st, &out);
        for c in [3, 4] {
            st.fork(2, c);
            s.fork(2, c, &mut m).unwrap();
        }
        // Each of b's three sequences takes a block of its own: b holds 4 blocks, a 2.
        let out = s.schedule(&mut m, &st, 6.0).unwrap();
        assert_eq!(m.num_free_gpu_blocks(), 0);
        engine_step(&mut s, &st, &out);
        let out = s.schedule(&mut m, &st, 7.0).unwrap();
        assert_eq!(out.swapped_out, vec![b]);
        assert_eq!(m.num_free_cpu_blocks(), 4);
        engine_step(&mut s, &st, &out);
        // 4 blocks + one per sequence > 6 blocks in the pool: it can never come back.
        let out = s.schedule(&mut m, &st, 8.0).unwrap();
        assert_eq!(out.ignored, vec![b], "chunked={chunked}");
        assert_eq!(m.num_free_cpu_blocks(), 8);
        assert!(s
            .group(b)
            .unwrap()
            .seqs
            .iter()
            .all(|q| q.status == Status::Finished(Finish::Ignored)));
        assert!(s.swapped().is_empty() && s.running().contains(&a));
    }
}

/// a (one sequence, 4 tokens) and b (two forks of 11 tokens, 3 shared blocks) on a 5-block
/// GPU with `cpu` CPU blocks, all decoding: the next step needs a new block for a and a copy
/// on write for b's forks, with 1 block free.
fn forked_group_to_preempt(chunked: bool, cpu: u32) -> (Scheduler, Store, Manager, [GroupKey; 2]) {
    let (mut s, st, mut m) = (sched(100, 8, 100, chunked), Store::default(), mgr(5, cpu));
    let a = add(&mut s, &st, 1, 4, 1.0, 1);
    let b = add(&mut s, &st, 2, 11, 2.0, 2);
    let out = s.schedule(&mut m, &st, 5.0).unwrap();
    engine_step(&mut s, &st, &out);
    st.fork(2, 3);
    s.fork(2, 3, &mut m).unwrap();
    (s, st, m, [a, b])
}

#[test]
fn fix7_forked_group_without_swap_space_is_aborted() {
    // b has two running sequences, so it is swapped; the CPU cannot hold its 3 blocks (2 free
    // is enough for one per sequence, not for the group) and forks cannot be recomputed.
    // vLLM raises RuntimeError (the engine dies); we abort b alone.
    for (chunked, cpu) in [(false, 0), (true, 0), (false, 2), (true, 2)] {
        let (mut s, st, mut m, [a, b]) = forked_group_to_preempt(chunked, cpu);
        s.take_changes();
        let out = s.schedule(&mut m, &st, 6.0).unwrap();
        assert_eq!(keys(&out.scheduled), vec![(a, 1)], "chunked={chunked}");
        assert_eq!(
            (out.aborted.clone(), out.ignored.clone()),
            (vec![b], vec![b])
        );
        assert!(out.preempted.is_empty() && out.swapped_out.is_empty() && out.swap_out.is_empty());
        let aborted = Status::Finished(Finish::Aborted);
        assert!(s.group(b).unwrap().seqs.iter().all(|q| q.status == aborted));
        let changed: Vec<SeqId> = s.take_changes().iter().map(|c| c.seq).collect();
        assert_eq!(changed, vec![2, 3]);
        assert!(!m.has_table(2) && !m.has_table(3));
        assert_eq!(s.running().iter().copied().collect::<Vec<_>>(), vec![a]);
        assert_eq!(
            (m.num_free_gpu_blocks(), m.num_free_cpu_blocks()),
            (3, cpu as usize)
        );
        m.check_invariants().unwrap();
        assert!(s.release(b).is_some());
    }
}

#[test]
fn fix7_forked_group_swaps_out_when_the_cpu_holds_its_distinct_blocks() {
    // The forks share their 3 blocks: 3 CPU blocks hold the group (not 3 per fork).
    let (mut s, st, mut m, [a, b]) = forked_group_to_preempt(false, 3);
    let out = s.schedule(&mut m, &st, 6.0).unwrap();
    assert_eq!(keys(&out.scheduled), vec![(a, 1)]);
    assert_eq!(out.swapped_out, vec![b]);
    assert_eq!(out.swap_out.len(), 3, "a shared block moves once");
    assert!(out.aborted.is_empty() && out.ignored.is_empty());
    assert_eq!(m.num_free_cpu_blocks(), 0);
}

/// Lookahead 3 on a `gpu`-block pool: a (4 tokens) and b (two forks of 5 tokens sharing a
/// partly filled block) decode; b is swapped out for a's lookahead, then a finishes.
fn forks_swapped_with_lookahead(gpu: u32) -> (Scheduler, Store, Manager, GroupKey) {
    let mut cfg = sched(100, 8, 100, false).cfg;
    cfg.num_lookahead_slots = 3;
    let (mut s, st, mut m) = (Scheduler::new(cfg).unwrap(), Store::default(), mgr(gpu, 8));
    let a = add(&mut s, &st, 1, 4, 1.0, 1);
    let b = add(&mut s, &st, 2, 5, 2.0, 2);
    let out = s.schedule(&mut m, &st, 5.0).unwrap();
    engine_step(&mut s, &st, &out);
    st.fork(2, 3);
    s.fork(2, 3, &mut m).unwrap();
    let out = s.schedule(&mut m, &st, 6.0).unwrap();
    assert_eq!(
        (keys(&out.scheduled), out.swapped_out),
        (vec![(a, 1)], vec![b])
    );
    finish(&mut s, &mut m, a, 1);
    s.free_finished();
    (s, st, m, b)
}

#[test]
fn swap_in_reserves_what_the_lookahead_appends_take() {
    // After the swap-in (2 blocks) each fork's append visits 2 positions: the shared block
    // (copied once: the second fork writes in place) and a new one, 5 blocks in all; vLLM's
    // check reserves one per sequence (4).
    let (mut s, st, mut m, b) = forks_swapped_with_lookahead(5);
    let out = s.schedule(&mut m, &st, 7.0).unwrap();
    assert_eq!(keys(&out.scheduled), vec![(b, 1)]);
    assert_eq!((out.swap_in.len(), out.copies.len()), (2, 1));
    assert_eq!(m.num_free_gpu_blocks(), 0);
    // With 4 blocks it can never run (vLLM's check says yes, then the append fails): it is
    // ignored and its CPU blocks freed, as a group that can never swap in (fix 6).
    let (mut s, st, mut m, b) = forks_swapped_with_lookahead(4);
    let out = s.schedule(&mut m, &st, 7.0).unwrap();
    assert_eq!((out.ignored, out.swap_in.len()), (vec![b], 0));
    assert_eq!((m.num_free_gpu_blocks(), m.num_free_cpu_blocks()), (4, 8));
    m.check_invariants().unwrap();
}

#[test]
fn bad_step_time_changes_nothing_and_waiting_groups_stay_valid() {
    let (mut s, st, mut m) = (sched(100, 8, 100, false), Store::default(), mgr(8, 8));
    let a = add(&mut s, &st, 1, 4, 1.0, 1);
    let b = add(&mut s, &st, 2, 4, 2.0, 1);
    assert!(s.schedule(&mut m, &st, f64::NAN).is_err());
    assert_eq!(m.num_free_gpu_blocks(), 8);
    assert_eq!(s.waiting().iter().copied().collect::<Vec<_>>(), vec![a, b]);
    assert!(s.take_changes().is_empty());
    // A waiting group's sequence cannot be forked (it holds no blocks): the group keeps its
    // one WAITING sequence, which the step relies on.
    st.put(5, 4);
    assert!(s.fork(2, 5, &mut m).is_err());
    assert_eq!(s.group(b).unwrap().seqs.len(), 1);
    assert!(s.check_waiting().is_ok());
}

fn caching_mgr(gpu: u32) -> Manager {
    let cfg = ManagerConfig {
        enable_caching: true,
        ..*mgr(gpu, 4).config()
    };
    Manager::new(cfg).unwrap()
}

/// The model inputs of the scheduled batch (batch step), written into fresh buffers.
fn batch_inputs(s: &mut Scheduler, m: &mut Manager, st: &Store, now: f64) -> (Written, Vec<i32>) {
    let out = s.schedule(m, st, now).unwrap();
    let metas = s.build_meta(m, st, &out, now, false).unwrap();
    let order: Vec<usize> = (0..out.scheduled.len()).collect();
    let batch = s.batch_rows(&out, &metas, &order);
    let (rows, tokens, cols) = (8, 64, 8);
    let (mut it, mut pos, mut slot) = (vec![0; tokens], vec![0; tokens], vec![0; tokens]);
    let (mut qs, mut cl, mut ns, mut ct) = (
        vec![0; rows + 1],
        vec![0; rows],
        vec![0; rows],
        vec![0; rows],
    );
    let (mut ids, mut bt) = (vec![0i64; rows], vec![0; rows * cols]);
    let (mut cp, mut si, mut so) = (vec![0; 2 * rows], vec![0; 16], vec![0; 16]);
    let buf = ModelInputs {
        input_tokens: &mut it,
        positions: &mut pos,
        slot_mapping: &mut slot,
        query_start_loc: &mut qs,
        context_lens: &mut cl,
        num_samples: &mut ns,
        cached_tokens: &mut ct,
        seq_ids: &mut ids,
        block_tables: &mut bt,
        cols,
        held: None,
        copies: &mut cp,
        swap_in: &mut si,
        swap_out: &mut so,
    };
    let w = m.write_model_inputs(s, st, &batch, &out, buf).unwrap();
    engine_step(s, st, &out);
    let mut summary = ct[..w.rows].to_vec();
    summary.extend_from_slice(&pos[..w.tokens]);
    summary.extend_from_slice(&cl[..w.rows]);
    (w, summary)
}

#[test]
fn cached_skip_follows_vllm_model_runner() {
    // Whole prompts (vLLM 0.4.2): start 0, the computed blocks exclude the last one.
    assert_eq!(cached_skip(8, 0, 10), 8);
    assert_eq!(cached_skip(0, 0, 10), 0);
    // A chunk past the cached prefix, partly inside it, or wholly inside it (its last
    // token is still computed).
    assert_eq!(cached_skip(8, 8, 4), 0);
    assert_eq!(cached_skip(8, 4, 8), 4);
    assert_eq!(cached_skip(12, 4, 4), 3);
}

#[test]
fn batch_step_leaves_the_cached_prefix_out_of_prompt_rows() {
    let (mut s, st, mut m) = (sched(100, 8, 100, false), Store::default(), caching_mgr(32));
    let prompt: Vec<u32> = (0..10).collect();
    for id in [1, 2] {
        let seq = TokenSeq::new(BS, &prompt, HashExtra::default(), H).unwrap();
        st.0.borrow_mut().insert(id, seq);
    }
    add_waiting(&mut s, 1, 1.0);
    let (w, got) = batch_inputs(&mut s, &mut m, &st, 1.0);
    // Nothing cached yet: the whole prompt, positions 0..10, context 10.
    assert_eq!((w.rows, w.tokens), (1, 10));
    let want: Vec<i32> = [vec![0], (0..10).collect(), vec![10]].concat();
    assert_eq!(got, want);
    // Same prompt next step: vLLM marks a scheduled sequence's full blocks but the last
    // full one computed, so block 0 is: its 4 tokens are left out, positions start at 4,
    // the context is still the whole prompt.
    add_waiting(&mut s, 2, 2.0);
    let (w, got) = batch_inputs(&mut s, &mut m, &st, 2.0);
    assert_eq!((w.rows, w.tokens), (1, 6));
    assert_eq!(got, [vec![4], (4..10).collect(), vec![10]].concat());
    // Decode rows never skip.
    let (w, got) = batch_inputs(&mut s, &mut m, &st, 3.0);
    assert_eq!((w.rows, w.tokens), (2, 2));
    assert_eq!(got, vec![0, 0, 10, 10, 11, 11]);
}

#[test]
fn chunked_prefill_rows_keep_their_cached_prefix() {
    // vLLM 0.4.2's model runner refuses prefix caching with chunked prefill: the whole
    // prompt's blocks are marked computed when its first chunk is scheduled.
    let (mut s, st, mut m) = (sched(6, 8, 100, true), Store::default(), caching_mgr(32));
    let prompt: Vec<u32> = (0..10).collect();
    for id in [1, 2] {
        let seq = TokenSeq::new(BS, &prompt, HashExtra::default(), H).unwrap();
        st.0.borrow_mut().insert(id, seq);
    }
    add_waiting(&mut s, 1, 1.0);
    let (w, got) = batch_inputs(&mut s, &mut m, &st, 1.0);
    assert_eq!((w.rows, w.tokens), (1, 6));
    assert_eq!(got, [vec![0], (0..6).collect(), vec![6]].concat());
    add_waiting(&mut s, 2, 2.0);
    let (_, got) = batch_inputs(&mut s, &mut m, &st, 2.0);
    assert!(got.iter().take(2).all(|&c| c == 0), "no row skips: {got:?}");
}

fn add_waiting(s: &mut Scheduler, id: SeqId, arrival: f64) {
    let mut g = Group::new(&format!("r{id}"), arrival, 0, 1, false);
    g.seqs.push(SeqState {
        id,
        status: Status::Waiting,
        decode: false,
        num_computed: 0,
    });
    g.num_seqs = 1;
    s.add_group(g).unwrap();
}
