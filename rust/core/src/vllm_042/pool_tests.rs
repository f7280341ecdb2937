//! Unit tests and a seeded randomized invariant driver for `BlockPool`.

use crate::error::Error;
use crate::rng::Rng;
use crate::vllm_042::pool::{BlockKey, BlockPool};
use std::collections::HashMap;

fn key(hash: u128, tokens: &[u32]) -> BlockKey<'_> {
    BlockKey {
        hash,
        parent: None,
        extra: 0,
        tokens,
    }
}

fn toks(seed: u32, bs: usize) -> Vec<u32> {
    (0..bs as u32)
        .map(|i| seed.wrapping_mul(1_000_003).wrapping_add(i))
        .collect()
}

#[test]
fn allocation_order_mirrors_vllm() {
    let mut p = BlockPool::new("gpu", 4, 4, false).unwrap();
    assert_eq!(p.allocate().unwrap(), 3);
    assert_eq!(p.allocate().unwrap(), 2);
    let mut c = BlockPool::new("gpu", 4, 4, true).unwrap();
    assert_eq!(c.allocate().unwrap(), 0);
    assert_eq!(c.allocate().unwrap(), 1);
}

#[test]
fn refcounts_and_double_free() {
    let mut p = BlockPool::new("gpu", 2, 4, false).unwrap();
    let b = p.allocate().unwrap();
    p.acquire(b, 1).unwrap();
    assert_eq!(p.ref_count(b), 2);
    p.release(b).unwrap();
    p.release(b).unwrap();
    assert_eq!(p.release(b), Err(Error::DoubleFree(b)));
    assert!(p.acquire(b, 1).is_err(), "sharing a free block is an error");
    assert!(matches!(p.release(7), Err(Error::BlockOutOfRange { .. })));
    assert_eq!(p.num_free(), 2);
    p.check_invariants().unwrap();
}

#[test]
fn out_of_blocks_is_an_error() {
    let mut p = BlockPool::new("cpu", 1, 4, false).unwrap();
    p.allocate().unwrap();
    assert!(matches!(p.allocate(), Err(Error::OutOfBlocks { .. })));
}

#[test]
fn cached_block_is_evictable_then_revived() {
    let mut p = BlockPool::new("gpu", 2, 4, true).unwrap();
    let b = p.allocate().unwrap();
    let t = toks(1, 4);
    assert!(p.register(b, &key(99, &t), 4).unwrap());
    p.release(b).unwrap();
    assert_eq!(p.num_free(), 2);
    assert_eq!(p.num_evictable(), 1);
    assert_eq!(p.lookup(&key(99, &t)), Some(b));
    p.acquire(b, 1).unwrap();
    assert_eq!(p.num_evictable(), 0);
    assert_eq!(p.ref_count(b), 1);
    assert_eq!(p.stats().hits, 1);
    p.check_invariants().unwrap();
}

#[test]
fn collision_never_hits_with_other_tokens() {
    let mut p = BlockPool::new("gpu", 2, 4, true).unwrap();
    let b = p.allocate().unwrap();
    p.register(b, &key(5, &toks(1, 4)), 4).unwrap();
    assert_eq!(p.lookup(&key(5, &toks(2, 4))), None);
    let c = p.allocate().unwrap();
    // the hash is taken: the second block stays uncached rather than replacing the first
    assert!(!p.register(c, &key(5, &toks(2, 4)), 4).unwrap());
    assert_eq!(p.block_hash(c), None);
    assert_eq!(p.lookup(&key(5, &toks(1, 4))), Some(b));
}

#[test]
fn eviction_is_lru_then_longest_prefix_first() {
    let mut p = BlockPool::new("gpu", 4, 2, true).unwrap();
    let ids: Vec<u32> = (0..4).map(|_| p.allocate().unwrap()).collect();
    for (i, &b) in ids.iter().enumerate() {
        p.register(
            b,
            &key(100 + i as u128, &toks(i as u32, 2)),
            2 * (i as u32 % 2 + 1),
        )
        .unwrap();
    }
    // blocks 0,1 accessed at t=1 (nht 2 and 4); blocks 2,3 at t=0 (nht 2 and 4)
    p.set_last_accessed(ids[0], 1.0);
    p.set_last_accessed(ids[1], 1.0);
    p.set_last_accessed(ids[2], 0.0);
    p.set_last_accessed(ids[3], 0.0);
    for &b in &ids {
        p.release(b).unwrap();
    }
    assert_eq!(p.eviction_order(), vec![ids[3], ids[2], ids[1], ids[0]]);
    assert_eq!(p.allocate().unwrap(), ids[3]);
    assert_eq!(
        p.lookup(&key(103, &toks(3, 2))),
        None,
        "evicted block lost its hash"
    );
    p.check_invariants().unwrap();
}

#[test]
fn uncached_free_blocks_are_used_before_evicting() {
    let mut p = BlockPool::new("gpu", 2, 2, true).unwrap();
    let a = p.allocate().unwrap();
    let b = p.allocate().unwrap();
    p.register(a, &key(1, &toks(1, 2)), 2).unwrap();
    p.release(a).unwrap();
    p.release(b).unwrap();
    assert_eq!(p.allocate().unwrap(), b);
    assert_eq!(p.num_cached(), 1);
}

/// 100k seeded random operations; every invariant checked after each one.
#[test]
fn randomized_invariants_100k() {
    const N: u32 = 64;
    const BS: usize = 4;
    let mut rng = Rng::new(0x5eed);
    let mut p = BlockPool::new("gpu", N, BS, true).unwrap();
    // What the driver holds: block -> references held; and what it believes is cached.
    let mut held: HashMap<u32, u32> = HashMap::new();
    let mut contents: HashMap<u128, Vec<u32>> = HashMap::new();
    let mut time = 0.0;
    for step in 0..100_000u32 {
        match rng.below(6) {
            0 | 1 => match p.allocate() {
                Ok(b) => {
                    assert!(!held.contains_key(&b), "block {b} handed out twice");
                    held.insert(b, 1);
                    time += 1.0;
                    p.set_last_accessed(b, time);
                    if rng.chance(70) {
                        // few distinct hashes so that lookups hit and collide often
                        let h = rng.below(40) as u128;
                        let t = toks(rng.below(3) as u32 + h as u32 * 7, BS);
                        if p.register(b, &key(h, &t), (rng.below(4) as u32 + 1) * BS as u32)
                            .unwrap()
                        {
                            contents.insert(h, t);
                        }
                    }
                }
                Err(Error::OutOfBlocks { .. }) => assert!(p.num_free() == 0),
                Err(e) => panic!("{e}"),
            },
            2 | 3 => {
                let pick = if held.is_empty() {
                    None
                } else {
                    held.keys().nth(rng.below(held.len())).copied()
                };
                if let Some(b) = pick {
                    p.release(b).unwrap();
                    let r = held.get_mut(&b).unwrap();
                    *r -= 1;
                    if *r == 0 {
                        held.remove(&b);
                        if p.block_hash(b).is_none() {
                            assert!(p.release(b).is_err(), "double free must fail");
                        }
                    }
                } else {
                    assert!(p.release(rng.below(N as usize) as u32).is_err());
                }
            }
            4 => {
                let h = rng.below(40) as u128;
                let t = toks(rng.below(3) as u32 + h as u32 * 7, BS);
                if let Some(b) = p.lookup(&key(h, &t)) {
                    assert_eq!(
                        p.cached_tokens(b).unwrap(),
                        &t[..],
                        "hit with different tokens"
                    );
                    assert_eq!(contents.get(&h), Some(&t));
                    p.acquire(b, 1).unwrap();
                    *held.entry(b).or_insert(0) += 1;
                }
            }
            _ => {
                if let Some((&b, _)) = held.iter().next() {
                    p.acquire(b, 1).unwrap();
                    *held.get_mut(&b).unwrap() += 1;
                }
            }
        }
        p.check_invariants()
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
        for (&b, &r) in &held {
            assert_eq!(p.ref_count(b), r, "step {step}: ref count of block {b}");
        }
        assert_eq!(p.num_referenced(), held.len());
        // every block not held is either free or evictable
        for b in 0..N {
            if !held.contains_key(&b) {
                assert_eq!(p.ref_count(b), 0);
            }
        }
        if step % 997 == 0 {
            contents.retain(|h, t| p.peek(&key(*h, t)).is_some());
        }
    }
    for (b, r) in held.drain() {
        for _ in 0..r {
            p.release(b).unwrap();
        }
    }
    assert_eq!(p.num_free(), N as usize);
}

#[test]
fn allocate_many_is_all_or_nothing() {
    let mut p = BlockPool::new("gpu", 3, 4, false).unwrap();
    assert!(matches!(
        p.allocate_many(4),
        Err(Error::OutOfBlocks {
            needed: 4,
            free: 3,
            ..
        })
    ));
    assert_eq!(p.num_free(), 3);
    assert_eq!(p.allocate_many(2).unwrap(), vec![2, 1]);
    assert_eq!(p.num_free(), 1);
    p.check_invariants().unwrap();
}

#[test]
fn release_many_checks_every_block_first() {
    let mut p = BlockPool::new("gpu", 3, 4, false).unwrap();
    let b = p.allocate().unwrap();
    let c = p.allocate().unwrap();
    // b listed twice but held once: nothing is released
    assert_eq!(p.release_many(&[c, b, b]), Err(Error::DoubleFree(b)));
    assert!(matches!(
        p.release_many(&[c, 9]),
        Err(Error::BlockOutOfRange { block: 9, .. })
    ));
    assert_eq!((p.ref_count(b), p.ref_count(c)), (1, 1));
    p.acquire(b, 1).unwrap();
    p.release_many(&[b, c, b]).unwrap();
    assert_eq!(p.num_free(), 3);
    p.check_invariants().unwrap();
}

#[test]
fn touch_refuses_evictable_and_non_finite() {
    let mut p = BlockPool::new("gpu", 2, 4, true).unwrap();
    let b = p.allocate().unwrap();
    p.touch(b, 3.0).unwrap();
    assert_eq!(p.last_accessed(b), 3.0);
    assert!(p.touch(b, f64::NAN).is_err());
    assert!(p.touch(7, 1.0).is_err());
    p.register(b, &key(1, &toks(1, 4)), 4).unwrap();
    p.release(b).unwrap();
    assert!(
        p.touch(b, 1.0).is_err(),
        "an evictable block keeps its place"
    );
    assert_eq!(p.last_accessed(b), 3.0);
    p.check_invariants().unwrap();
}

#[test]
fn register_with_a_bad_parent_changes_nothing() {
    let mut p = BlockPool::new("gpu", 2, 4, true).unwrap();
    let b = p.allocate().unwrap();
    let t = toks(1, 4);
    for parent in [b, 2, 99] {
        let k = BlockKey {
            hash: 5,
            parent: Some(parent),
            extra: 0,
            tokens: &t,
        };
        assert!(matches!(
            p.register(b, &k, 4),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!((p.num_cached(), p.block_hash(b)), (0, None));
        p.check_invariants().unwrap();
    }
}

#[test]
fn acquiring_no_reference_is_refused() {
    let mut p = BlockPool::new("gpu", 2, 4, true).unwrap();
    let b = p.allocate().unwrap();
    p.register(b, &key(1, &toks(1, 4)), 4).unwrap();
    p.release(b).unwrap();
    // n = 0 on an evictable block would take it off the eviction list without holding it
    assert!(matches!(p.acquire(b, 0), Err(Error::InvalidArgument(_))));
    assert!(p.is_evictable(b));
    p.check_invariants().unwrap();
}
