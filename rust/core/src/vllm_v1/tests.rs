//! Unit tests of the v1 pool and manager, with vLLM's behaviour written out by hand, and a
//! seeded randomized run checking every invariant after each operation.

use super::*;
use crate::error::Error;
use crate::rng::Rng;

fn key(i: u32) -> HashKey {
    HashKey::new(&[
        (i >> 24) as u8,
        (i >> 16) as u8,
        (i >> 8) as u8,
        i as u8,
        7,
        7,
        7,
        7,
    ])
    .unwrap()
}

fn mgr(num_blocks: u32, caching: bool) -> Manager {
    Manager::new(Config {
        num_blocks,
        block_size: 4,
        max_model_len: 1 << 20,
        enable_caching: caching,
        enable_events: true,
        watermark_blocks: 0,
    })
    .unwrap()
}

fn prefill(n_tokens: u64) -> SlotRequest<'static> {
    SlotRequest {
        num_tokens: n_tokens,
        num_new_tokens: n_tokens,
        waiting_or_preempted: true,
        ..Default::default()
    }
}

#[test]
fn free_queue_orders_like_vllm() {
    let mut q = free_queue::FreeQueue::new(6).unwrap();
    assert_eq!(q.popleft(), Some(0));
    let mut out = vec![];
    q.popleft_n(3, &mut out);
    assert_eq!(out, [1, 2, 3]);
    q.prepend_n(&[2, 1]);
    q.append_n(&[3]);
    assert_eq!(q.to_vec(), [2, 1, 4, 5, 3]);
    q.remove(4);
    assert_eq!(q.to_vec(), [2, 1, 5, 3]);
    assert_eq!(q.len(), 4);
}

#[test]
fn null_block_is_never_handed_out() {
    let mut p = Pool::new(3, true, false).unwrap();
    assert_eq!(p.num_free(), 2);
    let mut out = vec![];
    p.get_new_blocks(2, &mut out).unwrap();
    assert_eq!(out, [1, 2]);
    assert!(matches!(
        p.get_new_blocks(1, &mut out),
        Err(Error::OutOfBlocks { .. })
    ));
    assert_eq!(p.usage(), 1.0);
}

#[test]
fn freed_uncached_blocks_go_first_cached_ones_last() {
    let mut p = Pool::new(6, true, false).unwrap();
    let mut out = vec![];
    p.get_new_blocks(4, &mut out).unwrap(); // 1 2 3 4; queue: 5
    p.insert_hash(1, key(1), 4).unwrap();
    p.insert_hash(2, key(2), 4).unwrap();
    p.free_blocks([4, 3, 2, 1].into_iter()).unwrap();
    assert_eq!(p.free_queue(), [4, 3, 5, 2, 1]);
    p.check().unwrap();
}

#[test]
fn caching_off_frees_everything_to_the_head() {
    let mut p = Pool::new(4, false, false).unwrap();
    let mut out = vec![];
    p.get_new_blocks(2, &mut out).unwrap();
    p.free_blocks([2, 1].into_iter()).unwrap();
    assert_eq!(p.free_queue(), [2, 1, 3]);
}

#[test]
fn a_failed_free_changes_nothing() {
    let mut p = Pool::new(5, true, false).unwrap();
    let mut out = vec![];
    p.get_new_blocks(2, &mut out).unwrap();
    let before = (p.free_queue(), p.ref_cnt(1), p.ref_cnt(2));
    assert_eq!(
        p.free_blocks([1, 2, 2].into_iter()),
        Err(Error::DoubleFree(2))
    );
    assert!(matches!(
        p.free_blocks([1, 9].into_iter()),
        Err(Error::BlockOutOfRange { .. })
    ));
    assert_eq!(before, (p.free_queue(), p.ref_cnt(1), p.ref_cnt(2)));
    p.check().unwrap();
}

#[test]
fn eviction_on_reuse_emits_removed() {
    let mut p = Pool::new(3, true, true).unwrap();
    let mut out = vec![];
    p.get_new_blocks(2, &mut out).unwrap();
    p.insert_hash(1, key(1), 4).unwrap();
    p.free_blocks([1].into_iter()).unwrap();
    p.free_blocks([2].into_iter()).unwrap();
    assert_eq!(p.free_queue(), [2, 1]);
    out.clear();
    p.get_new_blocks(2, &mut out).unwrap();
    assert_eq!(out, [2, 1]);
    assert_eq!(p.take_events(), [Event::Removed(key(1))]);
    assert_eq!(p.get_cached(&key(1)), None);
}

#[test]
fn duplicate_hashes_keep_insertion_order() {
    let mut p = Pool::new(4, true, true).unwrap();
    let mut out = vec![];
    p.get_new_blocks(3, &mut out).unwrap();
    p.insert_hash(2, key(9), 4).unwrap();
    p.insert_hash(1, key(9), 4).unwrap();
    assert_eq!(p.get_cached(&key(9)), Some(2));
    assert!(p.evict(2));
    assert_eq!(p.get_cached(&key(9)), Some(1));
    p.check().unwrap();
}

#[test]
fn allocate_caches_full_blocks_and_hits_them() {
    let mut m = mgr(10, true);
    let keys: Vec<HashKey> = (0..3).map(key).collect();
    let new = m
        .allocate_slots("a", &prefill(10), &mut &keys[..2])
        .unwrap()
        .unwrap();
    assert_eq!(new, [1, 2, 3]);
    assert_eq!(m.num_cached_blocks("a"), Some(2));
    assert_eq!(
        m.pool_mut().take_events(),
        [Event::Stored { first: 0, end: 2 }]
    );
    let hit = m.longest_cache_hit(&mut &keys[..], 3).unwrap();
    assert_eq!(hit, [1, 2]);
    let b = SlotRequest {
        num_new_computed_tokens: 8,
        new_computed: Some(&hit),
        num_new_tokens: 3,
        num_tokens: 11,
        waiting_or_preempted: true,
        ..Default::default()
    };
    let new_b = m.allocate_slots("b", &b, &mut &keys[..2]).unwrap().unwrap();
    assert_eq!(new_b, [4]);
    assert_eq!(m.blocks("b"), [1, 2, 4]);
    assert_eq!(m.pool().ref_cnt(1), 2);
    m.check(|_| 0).unwrap();
    m.free("a").unwrap();
    m.free("b").unwrap();
    assert_eq!(m.pool().free_queue(), [4, 3, 5, 6, 7, 8, 9, 2, 1]);
    m.check(|_| 0).unwrap();
}

#[test]
fn adopting_evictable_blocks_counts_them() {
    let mut m = mgr(5, true);
    let keys: Vec<HashKey> = (0..2).map(key).collect();
    m.allocate_slots("a", &prefill(8), &mut &keys[..])
        .unwrap()
        .unwrap();
    m.free("a").unwrap(); // 1, 2 cached and evictable; queue 3 4 2 1
    let hit = m.longest_cache_hit(&mut &keys[..], 1).unwrap();
    assert_eq!(hit, [1]);
    assert_eq!(m.num_blocks_to_allocate("b", 8, &hit).unwrap(), 2);
}

#[test]
fn a_refused_allocation_changes_nothing() {
    let mut m = mgr(3, true);
    let before = m.pool().free_queue();
    assert_eq!(
        m.allocate_slots("a", &prefill(12), &mut &[][..]).unwrap(),
        None
    );
    assert_eq!(m.pool().free_queue(), before);
    assert_eq!(m.num_requests(), 0);
    let bad = SlotRequest {
        num_new_tokens: 0,
        ..prefill(4)
    };
    assert!(matches!(
        m.allocate_slots("a", &bad, &mut &[][..]),
        Err(Error::InvalidArgument(_))
    ));
    let stale = SlotRequest {
        num_new_computed_tokens: 4,
        new_computed: Some(&[2][..]),
        ..prefill(8)
    };
    assert!(m.allocate_slots("a", &stale, &mut &[][..]).is_err());
    assert_eq!(m.pool().free_queue(), before);
}

#[test]
fn only_a_cached_block_is_adopted_and_only_on_arrival() {
    // "a" holds 1 (cached) and 2 (uncached: no hash for its tokens yet).
    let mut m = mgr(6, true);
    let keys = [key(1)];
    m.allocate_slots("a", &prefill(8), &mut &keys[..])
        .unwrap()
        .unwrap();
    let before = (
        m.pool().free_queue(),
        m.pool().ref_cnt(1),
        m.pool().ref_cnt(2),
    );
    let adopt = |blocks: &'static [u32]| SlotRequest {
        num_new_computed_tokens: 4 * blocks.len() as u64,
        new_computed: Some(blocks),
        ..prefill(12)
    };
    // another request's uncached block is not a hit vLLM's lookup can return
    let err = m.allocate_slots("b", &adopt(&[2]), &mut &keys[..]);
    assert!(matches!(err, Err(Error::InvalidArgument(_))));
    // a running request (vLLM asserts it has no new hits) adopts nothing
    let err = m.allocate_slots("a", &adopt(&[1]), &mut &keys[..]);
    assert!(matches!(err, Err(Error::InvalidArgument(_))));
    let after = (
        m.pool().free_queue(),
        m.pool().ref_cnt(1),
        m.pool().ref_cnt(2),
    );
    assert_eq!(after, before);
    assert_eq!(m.num_requests(), 1);
    // the real hit is still adopted
    assert!(m
        .allocate_slots("b", &adopt(&[1]), &mut &keys[..])
        .unwrap()
        .is_some());
    assert_eq!(m.pool().ref_cnt(1), 2);
}

#[test]
fn watermark_and_reserved_blocks_gate_admission() {
    let mut m = Manager::new(Config {
        num_blocks: 5,
        block_size: 4,
        max_model_len: 1 << 20,
        enable_caching: false,
        enable_events: false,
        watermark_blocks: 1,
    })
    .unwrap();
    let mut a = prefill(16);
    a.has_scheduled_reqs = true;
    assert_eq!(m.allocate_slots("a", &a, &mut &[][..]).unwrap(), None);
    a.has_scheduled_reqs = false;
    assert!(m.allocate_slots("a", &a, &mut &[][..]).unwrap().is_some());
    m.free("a").unwrap();
    let mut r = prefill(4);
    r.reserved_blocks = 5;
    assert_eq!(m.allocate_slots("r", &r, &mut &[][..]).unwrap(), None);
}

#[test]
fn reset_prefix_cache_needs_every_block_free() {
    let mut m = mgr(4, true);
    let keys = [key(1)];
    m.allocate_slots("a", &prefill(4), &mut &keys[..])
        .unwrap()
        .unwrap();
    assert!(!m.reset_prefix_cache());
    m.free("a").unwrap();
    m.pool_mut().take_events();
    assert!(m.reset_prefix_cache());
    assert_eq!(m.pool_mut().take_events(), [Event::Cleared]);
    assert_eq!(
        m.longest_cache_hit(&mut &keys[..], 1).unwrap(),
        Vec::<u32>::new()
    );
}

/// Random requests through allocate/free/hit/evict; invariants after every operation.
#[test]
fn randomized_invariants() {
    let mut rng = Rng::new(0x5eed);
    for caching in [true, false] {
        let mut m = mgr(40, caching);
        let mut live: Vec<(String, u64, Vec<HashKey>)> = vec![];
        for step in 0..20_000u32 {
            match rng.below(5) {
                0 | 1 => {
                    let id = format!("r{step}");
                    let n = 1 + rng.below(30) as u64;
                    let prefix = rng.below(3) as u32;
                    let keys: Vec<HashKey> =
                        (0..n / 4).map(|i| key(prefix * 1000 + i as u32)).collect();
                    let hit = if caching {
                        m.longest_cache_hit(&mut &keys[..], ((n - 1) / 4) as usize)
                            .unwrap()
                    } else {
                        vec![]
                    };
                    let a = SlotRequest {
                        num_tokens: n,
                        num_new_tokens: n - hit.len() as u64 * 4,
                        num_new_computed_tokens: hit.len() as u64 * 4,
                        new_computed: (!hit.is_empty()).then_some(&hit[..]),
                        waiting_or_preempted: true,
                        ..Default::default()
                    };
                    if m.allocate_slots(&id, &a, &mut &keys[..]).unwrap().is_some() {
                        live.push((id, n, keys));
                    }
                }
                2 if !live.is_empty() => {
                    let i = rng.below(live.len());
                    let (id, n, keys) = &mut live[i];
                    let a: SlotRequest = SlotRequest {
                        num_computed_tokens: *n,
                        num_tokens: *n + 1,
                        num_new_tokens: 1,
                        ..Default::default()
                    };
                    *n += 1;
                    if *n % 4 == 0 {
                        keys.push(key(50_000 + step));
                    }
                    if m.allocate_slots(id, &a, &mut &keys[..]).unwrap().is_none() {
                        *n -= 1;
                        if *n % 4 == 3 {
                            keys.pop();
                        }
                    }
                }
                3 if !live.is_empty() => {
                    let i = rng.below(live.len());
                    m.free(&live.swap_remove(i).0).unwrap();
                }
                4 => {
                    let b = rng.below(40) as i64;
                    m.evict_blocks(&[b]).unwrap();
                }
                _ => {}
            }
            m.check(|_| 0)
                .unwrap_or_else(|e| panic!("step {step}: {e}"));
        }
        for (id, _, _) in live.drain(..) {
            m.free(&id).unwrap();
        }
        assert_eq!(m.pool().num_free(), 39);
    }
}

/// A request longer than `max_model_len` (a streaming session's prompt grew past it): the
/// slots stop at `max_model_len`, but the tokens to cache do not. vLLM slices its block list,
/// so it caches the blocks the request holds; with KV events on it then raises IndexError,
/// where pagedkv refuses before anything changes.
fn over_max_model_len(events: bool) -> (Manager, crate::error::Result<Option<Vec<u32>>>) {
    let mut m = Manager::new(Config {
        num_blocks: 16,
        block_size: 4,
        max_model_len: 8,
        enable_caching: true,
        enable_events: events,
        watermark_blocks: 0,
    })
    .unwrap();
    let keys: Vec<HashKey> = (0..5).map(key).collect();
    let got = m.allocate_slots("r", &prefill(20), &mut keys.as_slice());
    (m, got)
}

#[test]
fn a_request_past_max_model_len_caches_the_blocks_it_holds() {
    let (m, got) = over_max_model_len(false);
    assert_eq!(got, Ok(Some(vec![1, 2])));
    assert_eq!(m.blocks("r"), [1, 2]);
    assert_eq!(m.num_cached_blocks("r"), Some(2));
    assert_eq!(m.pool().hashed_tokens(2), Some(8));
    assert_eq!(m.pool().num_free(), 13);
    m.check(|_| 0).unwrap();
}

#[test]
fn with_events_a_request_past_max_model_len_is_refused_unchanged() {
    let (m, got) = over_max_model_len(true);
    assert!(matches!(got, Err(Error::InvalidArgument(_))), "{got:?}");
    assert_eq!(m.blocks("r"), [] as [u32; 0]);
    assert_eq!(m.pool().num_free(), 15);
    assert_eq!(m.num_requests(), 0);
    assert!(!m.pool().has_events());
}

#[test]
fn token_counts_near_u64_max_saturate_like_python_ints() {
    let mut m = mgr(8, true);
    let a = SlotRequest {
        num_computed_tokens: u64::MAX,
        num_lookahead_tokens: u64::MAX,
        ..prefill(u64::MAX)
    };
    let none: &[HashKey] = &[];
    // needs cdiv(max_model_len, 4) blocks: far more than the pool has
    assert_eq!(m.allocate_slots("r", &a, &mut { none }), Ok(None));
    assert_eq!(m.pool().num_free(), 7);
}
