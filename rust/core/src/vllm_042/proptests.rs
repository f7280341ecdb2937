//! Property tests with shrinking: random operation lists run against a `BlockPool` and a small
//! model of it (written from the pool's documented rules, not from its code), and against a
//! `Manager` whose every refused call must leave it exactly as it was. A failure shrinks to a
//! short operation list.

use crate::error::Error;
use crate::vllm_042::hash::{HashAlgo, HashExtra, Hasher};
use crate::vllm_042::manager::{Device, Manager, ManagerConfig, SeqId};
use crate::vllm_042::pool::{BlockKey, BlockPool, NEVER_ACCESSED};
use crate::vllm_042::step_buffers::StepRows;
use crate::vllm_042::token_seq::TokenSeq;
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};

const BS: usize = 2;
const N: u32 = 6;

// ---- the pool against a model ---------------------------------------------------------------

#[derive(Clone, Debug)]
enum PoolOp {
    Allocate,
    AllocateMany(usize),
    Acquire(u32, u32),
    Release(u32),
    ReleaseMany(Vec<u32>),
    Touch(u32, f64),
    Register {
        b: u32,
        hash: u128,
        tok: u32,
        extra: u128,
        parent: Option<u32>,
    },
    Lookup {
        hash: u128,
        tok: u32,
        extra: u128,
    },
}

fn pool_op() -> impl Strategy<Value = PoolOp> {
    let block = 0..N + 1; // one past the end: out-of-range calls are part of the run
    prop_oneof![
        Just(PoolOp::Allocate),
        (0..N as usize + 2).prop_map(PoolOp::AllocateMany),
        (block.clone(), 0..3u32).prop_map(|(b, n)| PoolOp::Acquire(b, n)),
        block.clone().prop_map(PoolOp::Release),
        proptest::collection::vec(block.clone(), 0..4).prop_map(PoolOp::ReleaseMany),
        (
            block.clone(),
            prop_oneof![Just(0.0), Just(1.0), Just(2.0), Just(f64::NAN)]
        )
            .prop_map(|(b, t)| PoolOp::Touch(b, t)),
        (
            block.clone(),
            0..4u128,
            0..2u32,
            0..2u128,
            proptest::option::of(block)
        )
            .prop_map(|(b, hash, tok, extra, parent)| PoolOp::Register {
                b,
                hash,
                tok,
                extra,
                parent
            }),
        (0..4u128, 0..2u32, 0..2u128).prop_map(|(hash, tok, extra)| PoolOp::Lookup {
            hash,
            tok,
            extra
        }),
    ]
}

fn tokens(tok: u32) -> Vec<u32> {
    vec![tok; BS]
}

/// The pool's rules, kept naively: a free stack, a set of evictable blocks ordered by
/// (access time, more hashed tokens first, release order), and a map hash -> cached block.
struct Model {
    refs: Vec<u32>,
    free: Vec<u32>,
    /// evictable block -> its release number (FIFO among equal keys)
    evictable: BTreeMap<u32, u64>,
    released: u64,
    time: Vec<f64>,
    nht: Vec<u32>,
    cached: HashMap<u128, (u32, Vec<u32>, Option<u32>, u128)>,
    hash_of: Vec<Option<u128>>,
}

impl Model {
    fn new() -> Self {
        Model {
            refs: vec![0; N as usize],
            free: (0..N).rev().collect(),
            evictable: BTreeMap::new(),
            released: 0,
            time: vec![NEVER_ACCESSED; N as usize],
            nht: vec![0; N as usize],
            cached: HashMap::new(),
            hash_of: vec![None; N as usize],
        }
    }

    fn eviction_order(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.evictable.keys().copied().collect();
        v.sort_by(|&a, &b| {
            let (ta, tb) = (self.time[a as usize], self.time[b as usize]);
            ta.partial_cmp(&tb)
                .unwrap()
                .then(self.nht[b as usize].cmp(&self.nht[a as usize]))
                .then(self.evictable[&a].cmp(&self.evictable[&b]))
        });
        v
    }

    fn num_free(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    fn allocate(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let b = *self.eviction_order().first()?;
                self.evictable.remove(&b);
                let h = self.hash_of[b as usize].take().unwrap();
                self.cached.remove(&h);
                self.nht[b as usize] = 0;
                b
            }
        };
        self.refs[b as usize] = 1;
        Some(b)
    }

    fn release(&mut self, b: u32) {
        self.refs[b as usize] -= 1;
        if self.refs[b as usize] == 0 {
            if self.hash_of[b as usize].is_some() {
                self.released += 1;
                self.evictable.insert(b, self.released);
            } else {
                self.free.push(b);
            }
        }
    }

    /// What the op should return (`Err(())` for any error), applying it if it succeeds.
    fn apply(&mut self, op: &PoolOp) -> Result<Vec<u32>, ()> {
        let in_range = |b: u32| b < N;
        match op {
            PoolOp::Allocate => self.allocate().map(|b| vec![b]).ok_or(()),
            PoolOp::AllocateMany(n) => {
                if *n > self.num_free() {
                    return Err(());
                }
                Ok((0..*n).map(|_| self.allocate().unwrap()).collect())
            }
            PoolOp::Acquire(b, n) => {
                if !in_range(*b)
                    || *n == 0
                    || (self.refs[*b as usize] == 0 && self.hash_of[*b as usize].is_none())
                {
                    return Err(());
                }
                self.evictable.remove(b);
                self.refs[*b as usize] += n;
                Ok(vec![])
            }
            PoolOp::Release(b) => {
                if !in_range(*b) || self.refs[*b as usize] == 0 {
                    return Err(());
                }
                self.release(*b);
                Ok(vec![])
            }
            PoolOp::ReleaseMany(bs) => {
                let mut count: HashMap<u32, u32> = HashMap::new();
                for &b in bs {
                    if !in_range(b) {
                        return Err(());
                    }
                    *count.entry(b).or_default() += 1;
                }
                if count.iter().any(|(&b, &c)| self.refs[b as usize] < c) {
                    return Err(());
                }
                bs.iter().for_each(|&b| self.release(b));
                Ok(vec![])
            }
            PoolOp::Touch(b, t) => {
                if !in_range(*b) || !t.is_finite() || self.evictable.contains_key(b) {
                    return Err(());
                }
                self.time[*b as usize] = *t;
                Ok(vec![])
            }
            PoolOp::Register {
                b,
                hash,
                tok,
                extra,
                parent,
            } => {
                let bad_parent = parent.is_some_and(|p| !in_range(p) || p == *b);
                if !in_range(*b)
                    || self.refs[*b as usize] == 0
                    || self.hash_of[*b as usize].is_some()
                    || bad_parent
                {
                    return Err(());
                }
                if self.cached.contains_key(hash) {
                    return Ok(vec![0]);
                }
                self.cached
                    .insert(*hash, (*b, tokens(*tok), *parent, *extra));
                self.hash_of[*b as usize] = Some(*hash);
                self.nht[*b as usize] = BS as u32;
                Ok(vec![1])
            }
            PoolOp::Lookup { hash, tok, extra } => Ok(match self.cached.get(hash) {
                Some((b, t, None, e)) if *t == tokens(*tok) && e == extra => vec![*b],
                _ => vec![],
            }),
        }
    }
}

fn key(hash: u128, tokens: &[u32], extra: u128, parent: Option<u32>) -> BlockKey<'_> {
    BlockKey {
        hash,
        parent,
        extra,
        tokens,
    }
}

fn run_pool(pool: &mut BlockPool, op: &PoolOp) -> Result<Vec<u32>, ()> {
    match op {
        PoolOp::Allocate => pool.allocate().map(|b| vec![b]).map_err(drop),
        PoolOp::AllocateMany(n) => pool.allocate_many(*n).map_err(drop),
        PoolOp::Acquire(b, n) => pool.acquire(*b, *n).map(|()| vec![]).map_err(drop),
        PoolOp::Release(b) => pool.release(*b).map(|()| vec![]).map_err(drop),
        PoolOp::ReleaseMany(bs) => pool.release_many(bs).map(|()| vec![]).map_err(drop),
        PoolOp::Touch(b, time) => pool.touch(*b, *time).map(|()| vec![]).map_err(drop),
        PoolOp::Register {
            b,
            hash,
            tok,
            extra,
            parent,
        } => {
            let t = tokens(*tok);
            pool.register(*b, &key(*hash, &t, *extra, *parent), BS as u32)
                .map(|ok| vec![u32::from(ok)])
                .map_err(drop)
        }
        PoolOp::Lookup { hash, tok, extra } => {
            let t = tokens(*tok);
            Ok(pool
                .lookup(&key(*hash, &t, *extra, None))
                .into_iter()
                .collect())
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn pool_follows_its_model(ops in proptest::collection::vec(pool_op(), 1..60)) {
        let mut pool = BlockPool::new("gpu", N, BS, true).unwrap();
        let mut model = Model::new();
        for (i, op) in ops.iter().enumerate() {
            let got = run_pool(&mut pool, op);
            let want = model.apply(op);
            prop_assert_eq!(&got, &want, "op {} {:?}", i, op);
            prop_assert_eq!(pool.check_invariants(), Ok(()));
            prop_assert_eq!(pool.eviction_order(), model.eviction_order());
            prop_assert_eq!(pool.num_free(), model.num_free());
            prop_assert_eq!(pool.num_cached(), model.cached.len());
            for b in 0..N {
                prop_assert_eq!(pool.ref_count(b), model.refs[b as usize]);
                prop_assert_eq!(pool.block_hash(b), model.hash_of[b as usize]);
                prop_assert_eq!(pool.last_accessed(b), model.time[b as usize]);
            }
        }
    }
}

// ---- the manager: refused calls change nothing -----------------------------------------------

const H: Hasher = Hasher {
    algo: HashAlgo::Xxh3,
    seed: 7,
};
const MBS: usize = 2;

#[derive(Clone, Debug)]
enum ManagerOp {
    Allocate {
        prompt: Vec<u32>,
        width: usize,
    },
    Append {
        seq: usize,
        tokens: Vec<u32>,
        lookahead: usize,
    },
    AppendBatch {
        seqs: Vec<usize>,
        grow: bool,
    },
    Fork {
        seq: usize,
    },
    Free {
        seq: usize,
    },
    Swap {
        seq: usize,
    },
    Access {
        seq: usize,
    },
    Reset,
}

fn manager_op() -> impl Strategy<Value = ManagerOp> {
    let seq = 0..8usize;
    let toks = proptest::collection::vec(0..3u32, 1..6);
    prop_oneof![
        (toks.clone(), 1..3usize).prop_map(|(prompt, width)| ManagerOp::Allocate { prompt, width }),
        (seq.clone(), toks, 0..3usize).prop_map(|(seq, tokens, lookahead)| ManagerOp::Append {
            seq,
            tokens,
            lookahead
        }),
        (proptest::collection::vec(seq.clone(), 0..4), any::<bool>())
            .prop_map(|(seqs, grow)| ManagerOp::AppendBatch { seqs, grow }),
        seq.clone().prop_map(|seq| ManagerOp::Fork { seq }),
        seq.clone().prop_map(|seq| ManagerOp::Free { seq }),
        seq.clone().prop_map(|seq| ManagerOp::Swap { seq }),
        seq.prop_map(|seq| ManagerOp::Access { seq }),
        Just(ManagerOp::Reset),
    ]
}

/// Everything observable about a manager (tables, devices, versions, every block's state).
fn snapshot(m: &Manager, ids: &[SeqId]) -> String {
    let mut s = format!("{} {} ", m.num_free_gpu_blocks(), m.num_free_cpu_blocks());
    for &id in ids {
        s += &format!(
            "{id}:{:?}{:?}{:?} ",
            m.block_table(id),
            m.device_of(id),
            m.table_version(id)
        );
    }
    for d in [Device::Gpu, Device::Cpu] {
        let p = m.pool(d);
        for b in 0..p.num_blocks() {
            s += &format!(
                "{}/{:?}/{} ",
                p.ref_count(b),
                p.block_hash(b),
                m.last_accessed(d, b)
            );
        }
        s += &format!("{:?}", p.eviction_order());
    }
    s
}

struct Driver {
    m: Manager,
    seqs: BTreeMap<SeqId, TokenSeq>,
    next: SeqId,
    clock: f64,
}

impl Driver {
    fn pick(&self, i: usize) -> Option<SeqId> {
        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        (!ids.is_empty()).then(|| ids[i % ids.len()])
    }

    /// Apply one op; `Err` from the manager is returned (the caller checks nothing changed).
    fn step(&mut self, op: &ManagerOp) -> Result<(), Error> {
        match op {
            ManagerOp::Allocate { prompt, width } => {
                let s = TokenSeq::new(MBS, prompt, HashExtra::default(), H).unwrap();
                let ids: Vec<SeqId> = (0..*width as u64).map(|i| self.next + i).collect();
                let group: Vec<(SeqId, &TokenSeq)> = ids.iter().map(|&id| (id, &s)).collect();
                self.m.allocate(&group)?;
                self.next += *width as u64;
                ids.iter()
                    .for_each(|&id| drop(self.seqs.insert(id, s.clone())));
            }
            ManagerOp::Append {
                seq,
                tokens,
                lookahead,
            } => {
                let Some(id) = self.pick(*seq) else {
                    return Ok(());
                };
                self.seqs.get_mut(&id).unwrap().extend(tokens);
                let mut copies = vec![];
                self.m
                    .append_slots(id, &self.seqs[&id], *lookahead, &mut copies)?;
            }
            ManagerOp::AppendBatch { seqs, grow } => {
                let mut ids: Vec<SeqId> = seqs.iter().filter_map(|&i| self.pick(i)).collect();
                ids.sort_unstable();
                ids.dedup();
                if *grow {
                    ids.iter()
                        .for_each(|id| self.seqs.get_mut(id).unwrap().push(1));
                }
                let pairs: Vec<(SeqId, &TokenSeq)> =
                    ids.iter().map(|&id| (id, &self.seqs[&id])).collect();
                let verdict = self.m.check_append_batch(&pairs, 0);
                let mut copies = vec![];
                let done = self.m.append_slots_batch(&pairs, 0, &mut copies);
                assert_eq!(
                    verdict.is_ok(),
                    done.is_ok(),
                    "check_append_batch disagrees"
                );
                done?;
                let cols = pairs
                    .iter()
                    .map(|(id, _)| self.m.block_table(*id).unwrap().len())
                    .max()
                    .unwrap_or(0);
                let (mut t, mut cl, mut sm) = (
                    vec![0; ids.len() * cols],
                    vec![0; ids.len()],
                    vec![0; ids.len()],
                );
                self.m.write_step_rows(
                    &pairs,
                    StepRows {
                        block_tables: &mut t,
                        cols,
                        pad_value: -1,
                        context_lens: Some(&mut cl),
                        slot_mapping: Some(&mut sm),
                    },
                )?;
                for (r, (id, s)) in pairs.iter().enumerate() {
                    let table = self.m.block_table(*id).unwrap();
                    let p = s.len() - 1;
                    assert_eq!(cl[r] as usize, s.len());
                    assert_eq!(sm[r] as usize, table[p / MBS] as usize * MBS + p % MBS);
                }
            }
            ManagerOp::Fork { seq } => {
                let Some(id) = self.pick(*seq) else {
                    return Ok(());
                };
                self.m.fork(id, self.next)?;
                self.seqs.insert(self.next, self.seqs[&id].clone());
                self.next += 1;
            }
            ManagerOp::Free { seq } => {
                let Some(id) = self.pick(*seq) else {
                    return Ok(());
                };
                self.m.free(id)?;
                self.seqs.remove(&id);
            }
            ManagerOp::Swap { seq } => {
                let Some(id) = self.pick(*seq) else {
                    return Ok(());
                };
                let from = self.m.device_of(id)?;
                self.m.swap(&[id], from)?;
            }
            ManagerOp::Access { seq } => {
                let Some(id) = self.pick(*seq) else {
                    return Ok(());
                };
                self.clock += 1.0;
                self.m.access_all_blocks_in_seq(id, self.clock)?;
                self.m.compute_full_blocks_in_seq(id, self.seqs[&id].len());
            }
            ManagerOp::Reset => {
                self.m.reset()?;
                self.seqs.clear();
            }
        }
        Ok(())
    }
}

fn manager_run(
    ops: &[ManagerOp],
    caching: bool,
    window: Option<usize>,
) -> Result<(), TestCaseError> {
    let cfg = ManagerConfig {
        block_size: MBS,
        num_gpu_blocks: 10,
        num_cpu_blocks: 6,
        watermark: 0.0,
        sliding_window: window,
        enable_caching: caching,
        strict: false,
        hasher: H,
    };
    let mut d = Driver {
        m: Manager::new(cfg).unwrap(),
        seqs: BTreeMap::new(),
        next: 0,
        clock: 0.0,
    };
    for (i, op) in ops.iter().enumerate() {
        let ids: Vec<SeqId> = d.seqs.keys().copied().collect();
        let before = snapshot(&d.m, &ids);
        let seqs_before = d.seqs.clone();
        if let Err(e) = d.step(op) {
            prop_assert!(
                matches!(e, Error::OutOfBlocks { .. } | Error::InvalidArgument(_)),
                "op {} {:?}: unexpected {}",
                i,
                op,
                e
            );
            prop_assert_eq!(
                &snapshot(&d.m, &ids),
                &before,
                "op {} {:?} failed ({}) but changed the manager",
                i,
                op,
                e
            );
            // the driver's sequences keep appended tokens, as an engine's would
            let _ = seqs_before;
        }
        prop_assert_eq!(d.m.check_invariants(), Ok(()), "after op {} {:?}", i, op);
        for (&id, s) in &d.seqs {
            let table = d.m.block_table(id).unwrap();
            prop_assert!(
                table.len() * MBS >= d.m.reserved_tokens(id).unwrap(),
                "seq {} table too short",
                id
            );
            prop_assert!(d.m.reserved_tokens(id).unwrap() <= s.len() + 2);
        }
    }
    for id in d.seqs.keys().copied().collect::<Vec<_>>() {
        d.m.free(id).unwrap();
    }
    prop_assert_eq!(d.m.num_free_gpu_blocks(), 10);
    prop_assert_eq!(d.m.num_free_cpu_blocks(), 6);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn manager_refusals_change_nothing(ops in proptest::collection::vec(manager_op(), 1..50)) {
        manager_run(&ops, false, None)?;
    }

    #[test]
    fn manager_with_caching_refusals_change_nothing(ops in proptest::collection::vec(manager_op(), 1..50)) {
        manager_run(&ops, true, None)?;
    }

    #[test]
    fn manager_with_window_refusals_change_nothing(ops in proptest::collection::vec(manager_op(), 1..50)) {
        manager_run(&ops, false, Some(4))?;
    }
}
