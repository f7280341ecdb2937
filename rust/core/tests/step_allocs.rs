//! Heap allocations of a steady decode step of the batch path (apply the sampled tokens,
//! schedule, metadata, rows, table delta, model inputs), counted with a counting
//! allocator. Scratch buffers are kept across steps, so a step that only decodes makes a
//! number of allocations that does not grow with the running sequences. One test only:
//! the counter is process-wide.

use pagedkv_core::vllm_042::hash::{HashAlgo, HashExtra, Hasher};
use pagedkv_core::vllm_042::scheduler::{
    Batch, GroupKey, HeldTables, IdMap, ModelInputs, Outputs, Scheduler, SchedulerConfig,
    SentTables, StableRows, StopRules, TableDelta, Tokens, TokensMut,
};
use pagedkv_core::vllm_042::scheduler::{Group, SeqState, Status};
use pagedkv_core::vllm_042::{Manager, ManagerConfig, SeqId, TokenSeq};
use pagedkv_core::Result;
use std::cell::RefCell;

mod common;

#[global_allocator]
static ALLOC: common::Counting = common::Counting;

const H: Hasher = Hasher {
    algo: HashAlgo::Xxh3,
    seed: 3,
};

/// Token stores, pre-sized so that appending a token never grows them (`TokenSeq` growth is
/// amortised and the caller's; here it would hide the step's own allocations).
struct Store(RefCell<IdMap<SeqId, TokenSeq>>);

impl Tokens for Store {
    fn with<R>(&self, id: SeqId, f: impl FnOnce(&TokenSeq) -> R) -> Result<R> {
        let m = self.0.borrow();
        m.get(&id)
            .map(f)
            .ok_or(pagedkv_core::Error::UnknownSequence(id))
    }
}

impl TokensMut for Store {
    fn with_mut<R>(&self, id: SeqId, f: impl FnOnce(&mut TokenSeq) -> R) -> Result<R> {
        let mut m = self.0.borrow_mut();
        m.get_mut(&id)
            .map(f)
            .ok_or(pagedkv_core::Error::UnknownSequence(id))
    }
}

struct Engine {
    sched: Scheduler,
    mgr: Manager,
    toks: Store,
    rules: IdMap<GroupKey, StopRules>,
    prev: Batch,
    sampled: Vec<i32>,
    order: Vec<usize>,
    sent: SentTables,
    stable: Option<StableRows>,
    delta: TableDelta,
    held: HeldTables,
    bufs: Vec<Vec<i32>>,
    ids: Vec<i64>,
    bt: Vec<i32>,
    cols: usize,
    now: f64,
}

const BS: usize = 16;
/// Prompts fill 4 blocks but the last (49 tokens); the measured decode steps stay inside it
/// (no block appended, no block hash, no token store growth: those are the caller's or
/// amortised over 16 steps).
const PROMPT: usize = 49;

fn engine(running: usize, stable: bool) -> Engine {
    let sched = Scheduler::new(SchedulerConfig {
        max_num_batched_tokens: running * PROMPT,
        max_num_seqs: running,
        max_model_len: 4096,
        num_lookahead_slots: 0,
        delay_factor: 0.0,
        chunked_prefill: false,
        max_loras: None,
        preemption_mode: None,
    })
    .unwrap();
    let mgr = Manager::new(ManagerConfig {
        block_size: BS,
        num_gpu_blocks: (running * 64) as u32,
        num_cpu_blocks: 0,
        watermark: 0.0,
        sliding_window: None,
        enable_caching: false,
        strict: false,
        hasher: H,
    })
    .unwrap();
    let mut e = Engine {
        sched,
        mgr,
        toks: Store(RefCell::new(IdMap::default())),
        rules: IdMap::default(),
        prev: Batch::default(),
        sampled: Vec::with_capacity(running),
        order: Vec::with_capacity(running),
        sent: SentTables::default(),
        stable: stable.then(StableRows::default),
        delta: TableDelta::default(),
        held: HeldTables::default(),
        bufs: vec![vec![0; running * PROMPT + 1]; 10],
        ids: vec![0; running],
        bt: Vec::new(),
        cols: 64,
        now: 0.0,
    };
    e.bt = vec![0; running * e.cols];
    for id in 0..running as SeqId {
        let prompt: Vec<u32> = (0..PROMPT as u32).map(|t| t + id as u32).collect();
        let t = TokenSeq::new(BS, &prompt, HashExtra::default(), H).unwrap();
        e.toks.0.borrow_mut().insert(id, t);
        let mut g = Group::new(&format!("r{id}"), id as f64, 0, 1, false);
        g.seqs.push(SeqState {
            id,
            status: Status::Waiting,
            decode: false,
            num_computed: 0,
        });
        g.num_seqs = 1;
        let key = e.sched.add_group(g).unwrap();
        let rules = StopRules {
            prompt_len: PROMPT,
            max_tokens: Some(1000),
            ..StopRules::default()
        };
        e.rules.insert(key, rules);
    }
    e
}

impl Engine {
    /// One batch step; returns the rows scheduled.
    fn step(&mut self) -> usize {
        self.sampled.clear();
        self.sampled.resize(self.prev.num_samples(), 1);
        self.sched
            .apply_sampled(
                &mut self.mgr,
                &self.toks,
                &self.prev,
                &self.rules,
                &self.sampled,
                &[],
            )
            .unwrap();
        self.now += 1.0;
        let out: Outputs = self
            .sched
            .schedule(&mut self.mgr, &self.toks, self.now)
            .unwrap();
        let metas = self
            .sched
            .build_meta(&mut self.mgr, &self.toks, &out, self.now, false)
            .unwrap();
        self.order.clear();
        self.order.extend(0..out.scheduled.len());
        self.sched
            .batch_rows_into(&out, &metas, &self.order, &mut self.prev);
        if let Some(s) = &mut self.stable {
            s.arrange(&mut self.prev);
        }
        self.mgr
            .table_delta_into(&self.prev, &mut self.sent, &mut self.delta)
            .unwrap();
        let [it, pos, slot, qs, cl, ns, ct, cp, si, so] = &mut self.bufs[..] else {
            unreachable!()
        };
        let buf = ModelInputs {
            input_tokens: it,
            positions: pos,
            slot_mapping: slot,
            query_start_loc: qs,
            context_lens: cl,
            num_samples: ns,
            cached_tokens: ct,
            seq_ids: &mut self.ids,
            block_tables: &mut self.bt,
            cols: self.cols,
            held: Some((&self.delta, &mut self.held)),
            copies: cp,
            swap_in: si,
            swap_out: so,
        };
        let w = self
            .mgr
            .write_model_inputs(&self.sched, &self.toks, &self.prev, &out, buf)
            .unwrap();
        self.sched.take_changes();
        w.rows
    }
}

/// Allocations of the steady decode steps (after warm-up) of `running` sequences.
fn decode_allocs(running: usize, stable: bool) -> Vec<usize> {
    let mut e = engine(running, stable);
    assert_eq!(e.step(), running, "one prefill step admits every prompt");
    for _ in 0..2 {
        assert_eq!(e.step(), running);
    }
    (0..12)
        .map(|_| {
            let before = common::allocations();
            assert_eq!(e.step(), running);
            common::allocations() - before
        })
        .collect()
}

#[test]
fn a_steady_decode_step_allocates_independently_of_the_batch() {
    for stable in [false, true] {
        let small = decode_allocs(64, stable);
        let large = decode_allocs(1024, stable);
        println!(
            "allocations per decode step (stable rows {stable}): 64 running {small:?}, \
             1024 running {large:?}"
        );
        // the step's outputs (scheduled groups, their metadata) are new lists; every other
        // buffer is kept across steps
        assert!(
            small.iter().chain(&large).all(|&n| n <= 2),
            "{small:?} {large:?}"
        );
    }
}
