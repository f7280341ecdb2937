//! Unit tests and a seeded randomized driver for `Manager`.

use crate::rng::Rng;
use crate::vllm_042::hash::{HashAlgo, HashExtra, Hasher};
use crate::vllm_042::manager::{AllocStatus, Device, Manager, ManagerConfig};
use crate::vllm_042::token_seq::TokenSeq;
use crate::Error;
use std::collections::BTreeMap;

const H: Hasher = Hasher {
    algo: HashAlgo::Xxh3,
    seed: 1,
};

fn cfg(bs: usize, gpu: u32, cpu: u32, caching: bool, window: Option<usize>) -> ManagerConfig {
    ManagerConfig {
        block_size: bs,
        num_gpu_blocks: gpu,
        num_cpu_blocks: cpu,
        watermark: 0.0,
        sliding_window: window,
        enable_caching: caching,
        strict: false,
        hasher: H,
    }
}

fn seq(tokens: &[u32], bs: usize) -> TokenSeq {
    TokenSeq::new(bs, tokens, HashExtra::default(), H).unwrap()
}

#[test]
fn allocate_shares_one_table_between_waiting_seqs() {
    let mut m = Manager::new(cfg(4, 8, 4, false, None)).unwrap();
    let s = seq(&[1, 2, 3, 4, 5], 4);
    m.allocate(&[(1, &s), (2, &s)]).unwrap();
    assert_eq!(m.block_table(1).unwrap(), &[7, 6]);
    assert_eq!(m.block_table(2).unwrap(), &[7, 6]);
    assert_eq!(m.pool(Device::Gpu).ref_count(7), 2);
    // vLLM's own tests allocate a new group under a sequence id that holds a table: the new
    // table is built first (vLLM's block choice), then the old references are released.
    m.allocate(&[(1, &s)]).unwrap();
    assert_eq!(m.block_table(1).unwrap(), &[5, 4]);
    assert_eq!(m.pool(Device::Gpu).ref_count(7), 1);
    assert_eq!(m.num_free_gpu_blocks(), 4);
    m.check_invariants().unwrap();
}

#[test]
fn append_crosses_blocks_and_copies_on_write_after_fork() {
    let mut m = Manager::new(cfg(4, 8, 4, false, None)).unwrap();
    let mut a = seq(&[1, 2, 3], 4);
    m.allocate(&[(1, &a)]).unwrap();
    m.fork(1, 2).unwrap();
    let mut b = a.clone();
    a.push(9);
    let mut copies = vec![];
    m.append_slots(1, &a, 0, &mut copies).unwrap();
    assert_eq!(
        copies,
        vec![(7, 6)],
        "shared partial block is copied before it is written"
    );
    copies.clear();
    b.push(8);
    m.append_slots(2, &b, 0, &mut copies).unwrap();
    assert!(
        copies.is_empty(),
        "the other sibling now owns the original block"
    );
    // six tokens at once: two new blocks in one call
    for t in 0..6 {
        a.push(t);
    }
    m.append_slots(1, &a, 0, &mut copies).unwrap();
    assert_eq!(m.block_table(1).unwrap().len(), 3);
    m.check_invariants().unwrap();
    m.free(1).unwrap();
    m.free(2).unwrap();
    assert_eq!(m.num_free_gpu_blocks(), 8);
}

#[test]
fn out_of_blocks_changes_nothing() {
    let mut m = Manager::new(cfg(4, 2, 1, false, None)).unwrap();
    let s = seq(&[0; 9], 4);
    assert_eq!(m.can_allocate(&s).unwrap(), AllocStatus::Never);
    assert!(matches!(
        m.allocate(&[(1, &s)]),
        Err(Error::OutOfBlocks { .. })
    ));
    assert_eq!(m.num_free_gpu_blocks(), 2);
    assert!(!m.has_table(1));
}

/// A cached prefix that would be hit, a sequence id whose old table would be replaced, and
/// too few free blocks: the call fails before any lookup is counted, any cached block is
/// revived or evicted, or the old table is released.
#[test]
fn out_of_blocks_with_hits_and_a_replaced_table_changes_nothing() {
    let mut m = Manager::new(cfg(4, 4, 1, true, None)).unwrap();
    let prompt: Vec<u32> = (0..8).collect();
    m.allocate(&[(1, &seq(&prompt, 4))]).unwrap();
    m.free(1).unwrap(); // two cached blocks, evictable
    m.allocate(&[(2, &seq(&[50, 51, 52], 4))]).unwrap(); // one held block
    let state = |m: &Manager| {
        let gpu = m.pool(Device::Gpu);
        let blocks: Vec<_> = (0..4)
            .map(|b| (gpu.ref_count(b), gpu.block_hash(b), gpu.is_evictable(b)))
            .collect();
        let table = m.block_table(2).unwrap().to_vec();
        (
            m.num_free_gpu_blocks(),
            m.prefix_cache_stats(),
            gpu.stats(),
            blocks,
            table,
        )
    };
    let before = state(&m);
    assert_eq!(before.0, 3);
    // 2 hits on evictable blocks + 3 new = 5 free blocks needed, 3 free.
    let long: Vec<u32> = (0..17).collect();
    let s = seq(&long, 4);
    let got = m.allocate(&[(3, &s), (2, &s)]);
    assert!(
        matches!(
            got,
            Err(Error::OutOfBlocks {
                needed: 5,
                free: 3,
                ..
            })
        ),
        "{got:?}"
    );
    assert_eq!(state(&m), before);
    assert!(!m.has_table(3));
    m.check_invariants().unwrap();
    // Fewer tokens fit: both hits reused, sequence 2's old block released.
    let s = seq(&long[..12], 4);
    m.allocate(&[(3, &s), (2, &s)]).unwrap();
    assert_eq!(m.block_table(3).unwrap(), m.block_table(2).unwrap());
    assert_eq!(m.prefix_cache_stats(), (before.1 .0 + 3, before.1 .1 + 2));
    m.check_invariants().unwrap();
}

#[test]
fn strict_mode_refuses_what_the_default_replaces_and_changes_nothing() {
    let strict = |caching| ManagerConfig {
        strict: true,
        ..cfg(4, 8, 4, caching, None)
    };
    for caching in [false, true] {
        let mut m = Manager::new(strict(caching)).unwrap();
        let s = seq(&[1, 2, 3, 4, 5], 4);
        m.allocate(&[(1, &s)]).unwrap();
        m.allocate(&[(2, &s)]).unwrap();
        let before = (m.num_free_gpu_blocks(), m.block_table(1).unwrap().to_vec());
        let refused = |r: crate::Result<()>| matches!(r, Err(Error::InvalidArgument(_)));
        // allocate onto an id that holds a table (in any position of the group)
        assert!(refused(m.allocate(&[(1, &s)])));
        assert!(refused(m.allocate(&[(3, &s), (2, &s)])));
        assert!(!m.has_table(3));
        // fork onto a child that holds a table
        assert!(refused(m.fork(1, 2)));
        // a sequence counted in other units, in every call that takes one
        let other = seq(&[1, 2, 3, 4, 5], 2);
        assert!(m.can_allocate(&other).is_err());
        assert!(refused(m.allocate(&[(4, &other)])));
        assert!(m.append_need(1, &other, 0).is_err());
        assert!(m.can_append_slots(&[(1, &other)], 0).is_err());
        assert!(refused(m.append_slots(1, &other, 0, &mut vec![])));
        assert_eq!(
            (m.num_free_gpu_blocks(), m.block_table(1).unwrap().to_vec()),
            before
        );
        assert!(!m.has_table(4));
        m.check_invariants().unwrap();
        // the same calls in the default mode: replaced / counted in the sequence's units
        let mut d = Manager::new(cfg(4, 8, 4, caching, None)).unwrap();
        d.allocate(&[(1, &s)]).unwrap();
        d.allocate(&[(2, &s)]).unwrap();
        d.allocate(&[(1, &s)]).unwrap();
        d.fork(1, 2).unwrap();
        d.allocate(&[(4, &other)]).unwrap();
        assert_eq!(d.block_table(4).unwrap().len(), 3);
        d.check_invariants().unwrap();
    }
}

#[test]
fn prefix_is_shared_and_revived_from_cache() {
    let mut m = Manager::new(cfg(4, 16, 4, true, None)).unwrap();
    let prefix: Vec<u32> = (0..12).collect();
    let mut a_toks = prefix.clone();
    a_toks.extend([100, 101]);
    let mut b_toks = prefix.clone();
    b_toks.extend([200, 201, 202, 203, 204]);
    let a = seq(&a_toks, 4);
    let b = seq(&b_toks, 4);
    m.allocate(&[(1, &a)]).unwrap();
    m.allocate(&[(2, &b)]).unwrap();
    let (ta, tb) = (
        m.block_table(1).unwrap().to_vec(),
        m.block_table(2).unwrap().to_vec(),
    );
    assert_eq!(ta[..3], tb[..3], "full prefix blocks are shared");
    assert_ne!(ta[3], tb[3], "partial / differing blocks are not");
    m.free(1).unwrap();
    m.free(2).unwrap();
    assert_eq!(m.num_free_gpu_blocks(), 16);
    let c = seq(&prefix, 4);
    m.allocate(&[(3, &c)]).unwrap();
    assert_eq!(
        m.block_table(3).unwrap(),
        &ta[..3],
        "freed prefix blocks are revived"
    );
    assert_eq!(m.prefix_cache_stats(), (3 + 4 + 3, 3 + 3));
    m.check_invariants().unwrap();
}

#[test]
fn window_table_is_periodic_and_cow_keeps_it_so() {
    let mut m = Manager::new(cfg(2, 8, 8, false, Some(4))).unwrap();
    let mut a = seq(&[1, 2, 3, 4, 5], 2); // 3 blocks, window 2 blocks
    m.allocate(&[(1, &a)]).unwrap();
    let t = m.block_table(1).unwrap().to_vec();
    assert_eq!(t[2], t[0]);
    assert_eq!(m.num_free_gpu_blocks(), 6);
    m.fork(1, 2).unwrap();
    a.push(6); // writes into block 2 == block 0, shared -> CoW
    let mut copies = vec![];
    m.append_slots(1, &a, 0, &mut copies).unwrap();
    assert_eq!(copies.len(), 1);
    let t1 = m.block_table(1).unwrap().to_vec();
    assert_eq!(t1[0], t1[2]);
    assert_ne!(t1[0], t[0]);
    m.check_invariants().unwrap();
    // swap both out and in: each distinct block moves once
    let mapping = m.swap(&[1, 2], Device::Gpu).unwrap();
    assert_eq!(mapping.len(), 3);
    m.check_invariants().unwrap();
    m.swap(&[1, 2], Device::Cpu).unwrap();
    m.check_invariants().unwrap();
    m.reset().unwrap();
    assert_eq!(m.num_free_gpu_blocks(), 8);
    assert_eq!(m.num_free_cpu_blocks(), 8);
}

#[test]
fn swap_errors_change_nothing() {
    let mut m = Manager::new(cfg(4, 8, 1, false, None)).unwrap();
    let s = seq(&[0; 8], 4);
    m.allocate(&[(1, &s)]).unwrap();
    assert!(matches!(
        m.swap(&[1], Device::Cpu),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        m.swap(&[1], Device::Gpu),
        Err(Error::OutOfBlocks { .. })
    ));
    assert_eq!(m.device_of(1).unwrap(), Device::Gpu);
    assert!(matches!(
        m.swap(&[9], Device::Gpu),
        Err(Error::UnknownSequence(9))
    ));
    m.check_invariants().unwrap();
}

#[test]
fn computed_blocks_follow_vllm_rule() {
    let mut m = Manager::new(cfg(4, 8, 1, true, None)).unwrap();
    let s = seq(&(0..17).collect::<Vec<u32>>(), 4); // 4 full blocks + 1 token
    m.allocate(&[(1, &s)]).unwrap();
    m.compute_full_blocks_in_seq(1, s.len());
    let t = m.block_table(1).unwrap().to_vec();
    // blocks 0..=2 marked (the last full block, 3, is not: vLLM's rule), table[:-1] excludes 4
    assert_eq!(m.get_all_computed_blocks(1), t[..3].to_vec());
    assert_eq!(m.get_common_computed_block_ids(&[1, 99]), t[..3].to_vec());
}

#[test]
fn computed_prefix_query_follows_later_marks_and_table_changes() {
    // The query continues from what it found last time for the same table: it must still see
    // blocks marked since, and start over when the table changes (a fork's copy-on-write).
    let mut m = Manager::new(cfg(4, 16, 1, true, None)).unwrap();
    let mut s = seq(&(0..9).collect::<Vec<u32>>(), 4); // 2 full blocks + 1 token
    m.allocate(&[(1, &s)]).unwrap();
    assert!(m.get_all_computed_blocks(1).is_empty());
    m.compute_full_blocks_in_seq(1, s.len());
    let t = m.block_table(1).unwrap().to_vec();
    assert_eq!(m.get_all_computed_blocks(1), t[..1].to_vec());
    for tok in 9..13 {
        s.push(tok);
    }
    let mut cows = Vec::new();
    m.append_slots(1, &s, 0, &mut cows).unwrap(); // table grows: 4 blocks
    m.compute_full_blocks_in_seq(1, s.len());
    let t = m.block_table(1).unwrap().to_vec();
    assert_eq!(m.get_all_computed_blocks(1), t[..2].to_vec());
    m.fork(1, 2).unwrap();
    assert_eq!(m.get_common_computed_block_ids(&[1, 2]), t[..2].to_vec());
    m.free(1).unwrap();
    m.free(2).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn common_computed_prefix_names_the_blocks_and_changes_with_the_table() {
    // Where the common computed blocks lie (seq, table version, length): the same place means
    // the same blocks; a table change gives a new version, never one seen before.
    let mut m = Manager::new(cfg(4, 16, 1, true, None)).unwrap();
    assert_eq!(m.common_computed_prefix(&[1]), None); // unknown: empty
    let mut s = seq(&(0..13).collect::<Vec<u32>>(), 4); // 3 full blocks + 1 token
    m.allocate(&[(1, &s)]).unwrap();
    assert_eq!(m.common_computed_prefix(&[1]), None);
    m.compute_full_blocks_in_seq(1, s.len());
    let p = m.common_computed_prefix(&[1]).unwrap();
    assert_eq!((p.seq, p.len), (1, 2));
    let t = m.block_table(1).unwrap().to_vec();
    assert_eq!(m.get_common_computed_block_ids(&[1]), t[..p.len].to_vec());
    assert_eq!(m.common_computed_prefix(&[1]), Some(p)); // unchanged: the same place
    m.fork(1, 2).unwrap();
    let both = m.common_computed_prefix(&[2, 1]).unwrap();
    assert_eq!(both.len, 2);
    for tok in 13..17 {
        s.push(tok);
    }
    let mut cows = Vec::new();
    m.append_slots(1, &s, 0, &mut cows).unwrap(); // copy-on-write: seq 1's table changes
    let q = m.common_computed_prefix(&[1]).unwrap();
    assert!(q.version > p.version && q.seq == 1);
    let t = m.block_table(1).unwrap().to_vec();
    assert_eq!(m.get_common_computed_block_ids(&[1]), t[..q.len].to_vec());
    m.free(1).unwrap();
    m.free(2).unwrap();
    m.check_invariants().unwrap();
}

/// Seeded random operations; invariants after every one; everything free at the end.
fn random_run(seed: u64, steps: usize, caching: bool, window: Option<usize>) {
    let bs = 4;
    let mut m = Manager::new(cfg(bs, 48, 24, caching, window)).unwrap();
    let mut rng = Rng::new(seed);
    let mut seqs: BTreeMap<u64, TokenSeq> = BTreeMap::new();
    let mut next_id = 0u64;
    let prefixes: Vec<Vec<u32>> = (0..3)
        .map(|p| (0..10).map(|i| p * 100 + i).collect())
        .collect();
    for step in 0..steps {
        let ids: Vec<u64> = seqs.keys().copied().collect();
        let seen: Vec<(u64, u64, Vec<u32>)> = ids
            .iter()
            .map(|&id| {
                (
                    id,
                    m.table_version(id).unwrap(),
                    m.block_table(id).unwrap().to_vec(),
                )
            })
            .collect();
        let pick = |rng: &mut Rng| ids.get(rng.below(ids.len().max(1))).copied();
        match rng.below(9) {
            0 | 1 => {
                let mut toks = prefixes[rng.below(3)][..rng.below(10) + 1].to_vec();
                for _ in 0..rng.below(8) {
                    toks.push(rng.below(5) as u32);
                }
                let s = seq(&toks, bs);
                let id = next_id;
                next_id += 1;
                let before = m.num_free_gpu_blocks();
                match m.allocate(&[(id, &s)]) {
                    Ok(()) => {
                        seqs.insert(id, s);
                    }
                    Err(Error::OutOfBlocks { .. }) => assert_eq!(m.num_free_gpu_blocks(), before),
                    Err(e) => panic!("{e}"),
                }
            }
            2..=4 => {
                if let Some(id) = pick(&mut rng) {
                    let s = seqs.get_mut(&id).unwrap();
                    for _ in 0..rng.below(3) + 1 {
                        s.push(rng.below(3) as u32);
                    }
                    let mut copies = vec![];
                    let before = (m.num_free_gpu_blocks(), m.block_table(id).unwrap().to_vec());
                    let far = rng.below(40);
                    if m.device_of(id) == Ok(Device::Gpu) {
                        let counted = m.append_need(id, s, far).unwrap();
                        assert_eq!(counted, m.need_by_walk(id, s, far), "lookahead {far}");
                    }
                    match m.append_slots(id, s, rng.below(2), &mut copies) {
                        Ok(()) | Err(Error::InvalidArgument(_)) => {}
                        Err(Error::OutOfBlocks { .. }) => {
                            assert_eq!(
                                (m.num_free_gpu_blocks(), m.block_table(id).unwrap().to_vec()),
                                before
                            )
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
            }
            5 => {
                if let Some(id) = pick(&mut rng) {
                    let child = next_id;
                    next_id += 1;
                    m.fork(id, child).unwrap();
                    let c = seqs[&id].clone();
                    seqs.insert(child, c);
                }
            }
            6 => {
                if let Some(id) = pick(&mut rng) {
                    m.free(id).unwrap();
                    seqs.remove(&id);
                    m.free(id).unwrap(); // a second free is a no-op (vLLM)
                }
            }
            7 => {
                if let Some(id) = pick(&mut rng) {
                    let from = m.device_of(id).unwrap();
                    match m.swap(&[id], from) {
                        Ok(_) | Err(Error::OutOfBlocks { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
            }
            _ => {
                if rng.chance(5) {
                    m.reset().unwrap();
                    seqs.clear();
                } else if let Some(id) = pick(&mut rng) {
                    m.access_all_blocks_in_seq(id, step as f64).unwrap();
                    m.compute_full_blocks_in_seq(id, seqs[&id].len());
                }
            }
        }
        m.check_invariants()
            .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
        for (id, version, table) in &seen {
            if m.has_table(*id) && m.table_version(*id).unwrap() == *version {
                assert_eq!(
                    m.block_table(*id).unwrap(),
                    &table[..],
                    "table changed, version did not"
                );
            }
        }
    }
    for id in seqs.keys() {
        m.free(*id).unwrap();
    }
    assert_eq!(m.num_free_gpu_blocks(), 48);
    assert_eq!(m.num_free_cpu_blocks(), 24);
}

#[test]
fn randomized_manager_without_caching() {
    random_run(1, 20_000, false, None);
}

#[test]
fn randomized_manager_with_caching() {
    random_run(2, 20_000, true, None);
}

#[test]
fn randomized_manager_with_window() {
    random_run(3, 20_000, false, Some(8));
}

/// With a 3-bit hash nearly every lookup collides; a block may still only be shared by
/// sequences whose whole prefix up to it is equal.
#[test]
fn collisions_never_share_blocks_with_different_prefixes() {
    let weak = Hasher {
        algo: HashAlgo::WeakForTesting,
        seed: 1,
    };
    let mut c = cfg(4, 256, 4, true, None);
    c.hasher = weak;
    let mut m = Manager::new(c).unwrap();
    let mut rng = Rng::new(9);
    let mut owner: std::collections::HashMap<u32, Vec<u32>> = Default::default();
    for id in 0..40u64 {
        let toks: Vec<u32> = (0..12).map(|_| rng.below(2) as u32).collect();
        let s = TokenSeq::new(4, &toks, HashExtra::default(), weak).unwrap();
        m.allocate(&[(id, &s)]).unwrap();
        for (i, &b) in m.block_table(id).unwrap().iter().enumerate() {
            let prefix = toks[..(i + 1) * 4].to_vec();
            assert_eq!(owner.entry(b).or_insert_with(|| prefix.clone()), &prefix);
        }
    }
    let (lookups, hits) = m.prefix_cache_stats();
    assert!(
        hits > 0 && hits < lookups,
        "some real sharing, some rejected collisions"
    );
}

#[test]
fn per_sequence_calls_count_blocks_in_the_sequences_own_units() {
    // vLLM's own scheduler tests: a sequence whose block size is its prompt length on a
    // manager with block size 4 takes one block per `seq.block_size` tokens.
    let mut m = Manager::new(cfg(4, 8, 4, false, None)).unwrap();
    let mut s = seq(&(0..60).collect::<Vec<u32>>(), 60);
    assert_eq!(m.can_allocate(&s).unwrap(), AllocStatus::Ok);
    m.allocate(&[(1, &s)]).unwrap();
    assert_eq!(m.block_table(1).unwrap().len(), 1);
    let mut copies = vec![];
    s.push(60);
    assert!(m.can_append_slots(&[(1, &s)], 0).unwrap());
    m.append_slots(1, &s, 0, &mut copies).unwrap();
    assert_eq!(
        m.block_table(1).unwrap().len(),
        2,
        "token 61 opens the second 60-token block"
    );
    assert_eq!(m.num_free_gpu_blocks(), 6);
    m.check_invariants().unwrap();
    m.free(1).unwrap();
    assert_eq!(m.num_free_gpu_blocks(), 8);
}

#[test]
fn batch_and_slot_calls_refuse_other_units_and_change_nothing() {
    let mut m = Manager::new(cfg(4, 8, 4, false, None)).unwrap();
    let mut s = seq(&[1, 2, 3], 8);
    m.allocate(&[(1, &s)]).unwrap();
    s.push(4);
    let mut copies = vec![];
    let err = m.append_slots_batch(&[(1, &s)], 0, &mut copies);
    assert!(matches!(err, Err(Error::InvalidArgument(ref msg)) if msg.contains("block_size 8")));
    assert_eq!(m.reserved_tokens(1).unwrap(), 3);
    assert!(m.check_slot_units(&s).is_err());
    assert!(m.check_slot_units(&seq(&[1], 4)).is_ok());
}

#[test]
fn cache_entries_in_other_units_are_never_shared() {
    // Block 1 of a 4-token-block sequence and block 0 of an 8-token-block sequence cover the
    // same 8 tokens; they must not meet in the cache, in either order.
    let toks: Vec<u32> = (0..8).collect();
    for first_small in [true, false] {
        let mut m = Manager::new(cfg(4, 16, 4, true, None)).unwrap();
        let small = seq(&toks, 4);
        let big = seq(&toks, 8);
        let (a, b) = if first_small {
            (&small, &big)
        } else {
            (&big, &small)
        };
        m.allocate(&[(1, a)]).unwrap();
        m.allocate(&[(2, b)]).unwrap();
        let t1 = m.block_table(1).unwrap().to_vec();
        let t2 = m.block_table(2).unwrap().to_vec();
        assert!(t1.iter().all(|x| !t2.contains(x)), "{t1:?} vs {t2:?}");
        let big2 = seq(&toks, 8);
        m.allocate(&[(3, &big2)]).unwrap();
        let t3 = m.block_table(3).unwrap().to_vec();
        assert!(t3.iter().all(|x| !t1.contains(x) && !t2.contains(x)));
        m.check_invariants().unwrap();
        // the same units still share
        let small2 = seq(&toks, 4);
        m.allocate(&[(4, &small2)]).unwrap();
        let st = if first_small { &t1 } else { &t2 };
        assert_eq!(m.block_table(4).unwrap(), &st[..]);
    }
}

#[test]
fn fork_without_parent_table_is_unknown_even_when_not_strict() {
    let mut m = Manager::new(cfg(4, 8, 4, false, None)).unwrap();
    let s = seq(&[1, 2, 3], 4);
    m.allocate(&[(2, &s)]).unwrap();
    let before = m.block_table(2).unwrap().to_vec();
    assert!(matches!(m.fork(1, 2), Err(Error::UnknownSequence(1))));
    assert!(matches!(m.fork(1, 3), Err(Error::UnknownSequence(1))));
    assert_eq!(m.block_table(2).unwrap(), &before[..]);
    assert!(!m.has_table(3));
    assert_eq!(m.num_free_gpu_blocks(), 7);
    assert!(matches!(m.fork(2, 2), Err(Error::InvalidArgument(_))));
    m.free(9).unwrap(); // free of an unknown sequence stays a no-op
}

#[test]
fn fork_onto_a_child_with_a_table_replaces_it_without_leaking() {
    let mut m = Manager::new(cfg(4, 8, 4, false, None)).unwrap();
    let p = seq(&[1, 2, 3, 4, 5], 4);
    let c = seq(&[9, 9, 9, 9, 9, 9, 9, 9, 9], 4);
    m.allocate(&[(1, &p)]).unwrap();
    m.allocate(&[(2, &c)]).unwrap();
    assert_eq!(m.num_free_gpu_blocks(), 3);
    m.fork(1, 2).unwrap();
    assert_eq!(m.block_table(2).unwrap(), m.block_table(1).unwrap());
    assert_eq!(
        m.num_free_gpu_blocks(),
        6,
        "the child's three old blocks came back"
    );
    m.check_invariants().unwrap();
    // forking again onto a child that already shares the parent's table changes nothing
    m.fork(1, 2).unwrap();
    assert_eq!(m.num_free_gpu_blocks(), 6);
    assert_eq!(
        m.pool(Device::Gpu).ref_count(m.block_table(1).unwrap()[0]),
        2
    );
    m.check_invariants().unwrap();
    m.free(1).unwrap();
    m.free(2).unwrap();
    assert_eq!(m.num_free_gpu_blocks(), 8);
}

/// Huge lookahead counts are answered in constant time (the need is counted, never walked)
/// and refused with nothing changed; `usize::MAX` does not overflow the target.
#[test]
fn huge_lookahead_is_refused_at_once() {
    for window in [None, Some(8)] {
        let mut m = Manager::new(cfg(4, 8, 4, window.is_none(), window)).unwrap();
        let s = seq(&[1, 2, 3, 4, 5, 6], 4);
        m.allocate(&[(1, &s)]).unwrap();
        let table = m.block_table(1).unwrap().to_vec();
        for la in [1 << 40, (1 << 62) - 1, usize::MAX] {
            let mut copies = vec![];
            assert!(matches!(
                m.append_slots(1, &s, la, &mut copies),
                Err(Error::InvalidArgument(_))
            ));
            assert_eq!(m.block_table(1).unwrap(), &table[..]);
            assert_eq!(m.num_free_gpu_blocks(), 6);
            assert!(copies.is_empty());
            if window.is_none() {
                assert!(!m.can_append_slots(&[(1, &s)], la).unwrap());
                let past = 6usize.saturating_add(la).div_ceil(4) - 2; // positions past the table
                assert_eq!(m.append_need(1, &s, la).unwrap(), past);
            }
        }
        // Within the pool's tokens a lookahead is reserved as before.
        let mut copies = vec![];
        m.append_slots(1, &s, 10, &mut copies).unwrap();
        assert_eq!(m.block_table(1).unwrap().len(), 4);
        m.swap(&[1], Device::Gpu).unwrap();
        let base = m.swap_in_need(&[(1, 6, 4)]).unwrap(); // the swap alone
        for la in [1 << 40, usize::MAX] {
            assert_eq!(m.can_swap_in(&[1], 1, la).unwrap(), AllocStatus::Never);
            let past = 6usize.saturating_add(la).div_ceil(4) - 4; // past the table of 4
            let target = 6usize.saturating_add(la);
            assert_eq!(m.swap_in_need(&[(1, target, 4)]), Ok(base + past));
        }
    }
}
