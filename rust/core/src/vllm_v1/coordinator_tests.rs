//! Unit tests of the hybrid coordinator, each expected value worked out by hand from the vLLM
//! function named in the comment (`kv_cache_coordinator.py`'s `HybridKVCacheCoordinator`,
//! `kv_cache_manager.py`'s `allocate_slots` / `free`; 0.32 and 0.33 alike unless stated).

use super::coordinator::{Count, Hit, Hybrid, HybridConfig, HybridSlots};
use super::engine::Release;
use super::manager::HashSource;
use super::pool::{Event, HashKey, NULL_BLOCK};
use super::retention::{Boundaries, BoundarySource, Retention};
use super::single_type::{AttentionKind, GroupSpec};
use super::single_type_tests::{chunked, full, key, keys, swa};

const N: u32 = NULL_BLOCK;

fn hybrid(groups: Vec<GroupSpec>, scheduler_block_size: u32) -> Hybrid {
    hybrid_cached(groups, scheduler_block_size, true)
}

fn hybrid_cached(groups: Vec<GroupSpec>, scheduler_block_size: u32, caching: bool) -> Hybrid {
    hybrid_retaining(groups, scheduler_block_size, caching, Retention::Dense)
}

fn hybrid_retaining(
    groups: Vec<GroupSpec>,
    scheduler_block_size: u32,
    caching: bool,
    retention: Retention,
) -> Hybrid {
    Hybrid::new(HybridConfig {
        num_blocks: 20,
        groups,
        hash_block_size: 4,
        scheduler_block_size,
        max_model_len: 1000,
        max_in_flight_tokens: 16,
        enable_caching: caching,
        enable_events: true,
        watermark_blocks: 0,
        release: Release::V033,
        retention,
        use_eagle: false,
        eagle_groups: Vec::new(),
        hash_lookahead_tokens: 0,
    })
    .unwrap()
}

fn prefill(num_tokens: u64) -> HybridSlots<'static> {
    HybridSlots {
        num_tokens,
        num_new_tokens: num_tokens,
        waiting_or_preempted: true,
        ..Default::default()
    }
}

/// GPT-OSS-like: group 0 full attention, group 1 a window of 8; block 4. Request "a" of 17
/// tokens allocated, cached and freed.
fn gpt_oss_after_a() -> Hybrid {
    let mut h = hybrid(vec![full(4), swa(8, 4)], 4);
    let ks = keys(4);
    // allocate_slots: 5 blocks per group, group 0 first; cache_blocks: round_down(17, 4) =
    // 16 tokens, 4 blocks per group (a window of 8 over 4-token blocks: every block cached).
    let new = h.allocate_slots("a", &prefill(17), &mut &ks[..]).unwrap();
    assert_eq!(new, Some(vec![vec![1, 2, 3, 4, 5], vec![6, 7, 8, 9, 10]]));
    assert_eq!(
        h.pool_mut().take_events(),
        [
            Event::StoredIn {
                group: 0,
                first: 0,
                end: 4,
                cached: vec![0, 1, 2, 3]
            },
            Event::StoredIn {
                group: 1,
                first: 0,
                end: 4,
                cached: vec![0, 1, 2, 3]
            }
        ]
    );
    h.check().unwrap();
    h.free("a").unwrap();
    h
}

#[test]
fn free_goes_group_by_group_each_last_block_first() {
    // KVCacheCoordinator.free: each manager's free in group order; BlockPool.free_blocks
    // puts the uncached tail block at the head, the cached ones at the tail, per call:
    // group 0 -> [5] + rest + [4, 3, 2, 1]; then group 1 -> [10] + that + [9, 8, 7, 6].
    let h = gpt_oss_after_a();
    let want: Vec<u32> = [10, 5]
        .into_iter()
        .chain(11..20)
        .chain([4, 3, 2, 1, 9, 8, 7, 6])
        .collect();
    assert_eq!(h.pool().free_queue(), want);
    assert_eq!(h.blocks("a"), [Vec::<u32>::new(), Vec::new()]);
    h.check().unwrap();
}

#[test]
fn simple_hybrid_hit_is_full_then_window() {
    // find_longest_cache_hit, one full + one other group (one pass): full finds 4 blocks
    // (16 tokens); the window (2 blocks in a row) then finds [N, N, 8, 9] within 16.
    let mut h = gpt_oss_after_a();
    let ks = keys(5);
    let hit = h.find_longest_cache_hit(&mut &ks[..], 16).unwrap();
    assert_eq!(
        hit,
        Hit {
            blocks: vec![vec![1, 2, 3, 4], vec![N, N, 8, 9]],
            num_tokens: 16,
            num_uncached_common_prefix_tokens: 0,
        }
    );
    // The window's block for hash 3 evicted: its run ends at block 2 -> [N, 7, 8], 12
    // tokens; full attention is cut to 3 blocks; 16 - 12 = 4 tokens were a longer (full)
    // hit: num_uncached_common_prefix_tokens.
    assert!(h.pool_mut().evict(9));
    let hit = h.find_longest_cache_hit(&mut &ks[..], 16).unwrap();
    assert_eq!(
        hit,
        Hit {
            blocks: vec![vec![1, 2, 3], vec![N, 7, 8]],
            num_tokens: 12,
            num_uncached_common_prefix_tokens: 4,
        }
    );
}

#[test]
fn allocate_adopts_every_groups_hit_then_allocates_in_group_order() {
    // allocate_slots with the hit of 16 tokens, 21 tokens in all (one new block each):
    // counts: full 6 - 4 + 4 evictable = 6; window 6 - max(2 skipped, 4) + 2 evictable
    // (the skipped nulls do not count) = 4. The hits leave the queue ([10, 5, 11.., 7, 6]
    // remain), then group 0 takes 10, 5 and group 1 takes 11, 12.
    let mut h = gpt_oss_after_a();
    let ks = keys(5);
    let hit = h.find_longest_cache_hit(&mut &ks[..], 20).unwrap();
    assert_eq!(hit.num_tokens, 16);
    assert_eq!(
        h.num_blocks_to_allocate("b", &Count::new(21, 16), Some(&hit.blocks))
            .unwrap(),
        10
    );
    let a = HybridSlots {
        num_tokens: 21,
        num_new_tokens: 5,
        num_new_computed_tokens: 16,
        new_computed: Some(&hit.blocks),
        waiting_or_preempted: true,
        ..Default::default()
    };
    let new = h.allocate_slots("b", &a, &mut &ks[..]).unwrap();
    assert_eq!(new, Some(vec![vec![10, 5], vec![11, 12]]));
    assert_eq!(
        h.blocks("b"),
        [vec![1, 2, 3, 4, 10, 5], vec![N, N, 8, 9, 11, 12]]
    );
    // Caching resumes after the adopted blocks: block 4 (hash 4) in both groups.
    assert_eq!(h.pool().get_cached_in(&key(4), 0), Some(10));
    assert_eq!(h.pool().get_cached_in(&key(4), 1), Some(11));
    let rest: Vec<u32> = (13..20).chain([7, 6]).collect();
    assert_eq!(h.pool().free_queue(), rest);
    h.check().unwrap();

    // A decode step at 21 computed: the window skips 21 - 8 + 1 = 14 tokens, 3 blocks;
    // block 8 (position 2) leaves, the walk back stopping at the null at position 1, and
    // joins the tail, still cached; nothing new is needed.
    let step = HybridSlots {
        num_computed_tokens: 21,
        num_tokens: 22,
        num_new_tokens: 1,
        ..Default::default()
    };
    let new = h.allocate_slots("b", &step, &mut &ks[..]).unwrap();
    assert_eq!(new, Some(vec![vec![], vec![]]));
    assert_eq!(h.blocks("b")[1], [N, N, N, 9, 11, 12]);
    assert_eq!(h.pool().free_queue().last(), Some(&8));
    assert_eq!(h.pool().get_cached_in(&key(2), 1), Some(8));
    h.check().unwrap();

    // A refused call still removed the blocks that left the window first (vLLM calls
    // remove_skipped_blocks before its fit check): 25 computed -> block 9 freed.
    let big = HybridSlots {
        num_computed_tokens: 25,
        num_tokens: 1000,
        num_new_tokens: 900,
        ..Default::default()
    };
    assert_eq!(h.allocate_slots("b", &big, &mut &ks[..]).unwrap(), None);
    assert_eq!(h.blocks("b")[1], [N, N, N, N, 11, 12]);
    assert_eq!(h.pool().free_queue().last(), Some(&9));
    h.check().unwrap();
    // Freeing: 0.33 pops group 1 without its null prefix.
    assert_eq!(h.pop_blocks_for_free("b"), [1, 2, 3, 4, 10, 5, 11, 12]);
}

/// Every hit `find_longest_cache_hit` cannot make is refused before anything changes: the
/// pool's queue, every table and every invariant stay as they were.
#[test]
fn a_hit_vllm_cannot_make_is_refused_unchanged() {
    let mut h = gpt_oss_after_a();
    let ks = keys(5);
    let before = h.pool().free_queue();
    let bad: [(Vec<Vec<u32>>, u64); 8] = [
        (vec![vec![1], vec![7, 8]], 4), // group 1's list does not cover 4 tokens
        (vec![vec![1, 2], vec![N, 8]], 4), // group 0's list does not cover 4 tokens
        (vec![vec![N, 2], vec![N, 7]], 8), // a null block in full attention
        (vec![vec![1, 2], vec![7, N]], 8), // a null block after a real one
        (vec![vec![1, 7], vec![N, 8]], 8), // block 7 is cached for group 1, not 0
        (vec![vec![1, 2], vec![N, 2]], 8), // block 2 is cached for group 0, not 1
        (vec![vec![1, 11], vec![N, 8]], 8), // block 11 is free and uncached
        (vec![vec![1, 2], vec![N, 8], vec![]], 8), // three lists for two groups
    ];
    for (blocks, tokens) in &bad {
        let a = HybridSlots {
            num_tokens: 12,
            num_new_tokens: 12 - tokens,
            num_new_computed_tokens: *tokens,
            new_computed: Some(blocks),
            waiting_or_preempted: true,
            ..Default::default()
        };
        let got = h.allocate_slots("b", &a, &mut &ks[..]);
        assert!(got.is_err(), "{blocks:?} over {tokens} tokens was adopted");
        assert_eq!(h.pool().free_queue(), before);
        assert_eq!(h.blocks("b"), [Vec::<u32>::new(), Vec::new()]);
        h.check().unwrap();
    }
    // A request holding blocks cannot adopt a hit, nor can a running one.
    let step = prefill(4);
    h.allocate_slots("c", &step, &mut &ks[..]).unwrap().unwrap();
    let hit = vec![vec![1], vec![6]];
    let a = HybridSlots {
        num_tokens: 8,
        num_new_tokens: 4,
        num_new_computed_tokens: 4,
        new_computed: Some(&hit),
        ..Default::default()
    };
    let held = h.blocks("c");
    assert!(h.allocate_slots("c", &a, &mut &ks[..]).is_err());
    assert_eq!(h.blocks("c"), held);
    h.check().unwrap();
}

#[test]
fn full_sequence_gate_caps_the_window_group() {
    // allocate_slots(full_sequence_must_fit): get_num_blocks_to_allocate with
    // apply_admission_cap; the window's cap is ceil(min(8 - 1 + 16, 1000) / 4) + 1 = 7.
    // 100 tokens: 25 + 7 = 32 > 19 free -> refused; 40 tokens: 10 + 7 = 17 fits, and the
    // first chunk of 16 takes 4 + 4.
    let mut h = hybrid(vec![full(4), swa(8, 4)], 4);
    let ks = keys(10);
    let gate = |num_tokens| HybridSlots {
        num_tokens,
        num_new_tokens: 16,
        full_sequence_must_fit: true,
        waiting_or_preempted: true,
        ..Default::default()
    };
    assert_eq!(
        h.allocate_slots("a", &gate(100), &mut &ks[..]).unwrap(),
        None
    );
    let new = h.allocate_slots("a", &gate(40), &mut &ks[..]).unwrap();
    assert_eq!(new, Some(vec![vec![1, 2, 3, 4], vec![5, 6, 7, 8]]));
    h.check().unwrap();
}

#[test]
fn three_kinds_repeat_until_the_hit_is_stable() {
    // find_longest_cache_hit with three attention groups (not "simple"): lookup order full
    // (group 1), window (group 0), chunked (group 2). Hashes 0..6 (24 tokens), max 24.
    // Cached: full at 0..5; the window at 0, 1, 3, 4; chunked nowhere.
    // Pass 1: full 24; window from the right: 4, 3 -> [N, N, N, w3, w4] = 20; chunked at
    //   20: chunk 16..24, block 4 missing -> 16.
    // Pass 2 (16): full 16; window within 4 blocks: 3, then 2 misses, 1, 0 -> [w0, w1] = 8;
    //   chunked at 8: [N, N] = 8.
    // Pass 3 (8): full 8, window 8, chunked 8: stable. Full cut to 2 blocks; the longest
    // lookup (full, 24) less 8 = 16 uncached common-prefix tokens.
    let mut h = hybrid(vec![swa(8, 4), full(4), chunked(8, 4)], 4);
    assert_eq!(h.lookup_order(), [vec![1], vec![0], vec![2]]);
    let p = h.pool_mut();
    let mut f = Vec::new();
    p.get_new_blocks(6, &mut f).unwrap();
    for (i, &b) in f.iter().enumerate() {
        p.insert_hash_in(b, key(i as u32), 1, 4 * (i as u32 + 1))
            .unwrap();
    }
    let mut w = Vec::new();
    p.get_new_blocks(4, &mut w).unwrap();
    for (&b, i) in w.iter().zip([0u32, 1, 3, 4]) {
        p.insert_hash_in(b, key(i), 0, 4 * (i + 1)).unwrap();
    }
    let ks = keys(6);
    let hit = h.find_longest_cache_hit(&mut &ks[..], 24).unwrap();
    assert_eq!(
        hit,
        Hit {
            blocks: vec![vec![w[0], w[1]], vec![f[0], f[1]], vec![N, N]],
            num_tokens: 8,
            num_uncached_common_prefix_tokens: 16,
        }
    );
}

#[test]
fn equal_specs_share_one_lookup_full_first() {
    // verify_and_split_kv_cache_groups: equal specs form one attention group; full
    // attention sorted first, the rest in group order.
    let h = hybrid(vec![swa(8, 4), full(4), swa(8, 4), chunked(8, 4)], 4);
    assert_eq!(h.lookup_order(), [vec![1], vec![0, 2], vec![3]]);
    // A different layout tag (another head count, say) is another spec.
    let mut other = swa(8, 4);
    other.layout = 1;
    let h = hybrid(vec![swa(8, 4), full(4), other], 4);
    assert_eq!(h.lookup_order(), [vec![1], vec![0], vec![2]]);
}

#[test]
fn groups_with_different_block_sizes() {
    // vLLM allows block sizes that differ (each a multiple of the hash block size, the
    // scheduler block size their lcm): full attention over 4-token blocks, a window of 8
    // over 8-token blocks (one block makes a hit: ceil(7 / 8)), scheduler block 8. 17
    // tokens: 5 + 3 blocks; cached up to round_down(17, 8) = 16 tokens: 4 full-attention
    // blocks, 2 window blocks under hashes 1 and 3 (BlockHashListWithBlockSize).
    let mut h = hybrid(vec![full(4), swa(8, 8)], 8);
    let ks = keys(4);
    let new = h.allocate_slots("a", &prefill(17), &mut &ks[..]).unwrap();
    assert_eq!(new, Some(vec![vec![1, 2, 3, 4, 5], vec![6, 7, 8]]));
    assert_eq!(h.pool().get_cached_in(&key(1), 1), Some(6));
    assert_eq!(h.pool().get_cached_in(&key(3), 1), Some(7));
    assert_eq!(h.pool().get_cached_in(&key(0), 1), None);
    h.free("a").unwrap();
    let want: Vec<u32> = [8, 5]
        .into_iter()
        .chain(9..20)
        .chain([4, 3, 2, 1, 7, 6])
        .collect();
    assert_eq!(h.pool().free_queue(), want);
    // Within 16: full 16 (aligned), the window's last block -> [N, 7].
    let hit = h.find_longest_cache_hit(&mut &ks[..], 16).unwrap();
    assert_eq!(hit.blocks, [vec![1, 2, 3, 4], vec![N, 7]]);
    assert_eq!(hit.num_tokens, 16);
    // Within 12: full 12 rounds down to 8; the window within 8 -> [6].
    let hit = h.find_longest_cache_hit(&mut &ks[..], 12).unwrap();
    assert_eq!(hit.blocks, [vec![1, 2], vec![6]]);
    assert_eq!(hit.num_tokens, 8);
    h.check().unwrap();
    // Full attention over blocks larger than the hash block is refused (vLLM would also
    // cache partial prompt-tail entries there).
    let cfg = HybridConfig {
        groups: vec![full(8), swa(8, 4)],
        ..h.config().clone()
    };
    assert!(Hybrid::new(cfg).is_err());
}

#[test]
fn caching_off_finds_no_hit_and_config_is_checked() {
    // KVCacheCoordinatorNoPrefixCache: no hit, per group.
    let mut cfg = HybridConfig {
        num_blocks: 20,
        groups: vec![full(4), swa(8, 4)],
        hash_block_size: 4,
        scheduler_block_size: 4,
        max_model_len: 1000,
        max_in_flight_tokens: 16,
        enable_caching: false,
        enable_events: false,
        watermark_blocks: 0,
        release: Release::V032,
        retention: Retention::Dense,
        use_eagle: false,
        eagle_groups: Vec::new(),
        hash_lookahead_tokens: 0,
    };
    let h = Hybrid::new(cfg.clone()).unwrap();
    let ks = keys(4);
    let hit = h.find_longest_cache_hit(&mut &ks[..], 16).unwrap();
    assert_eq!(hit.blocks, [Vec::<u32>::new(), Vec::new()]);
    // The scheduler block size must be a multiple of every block size (vLLM asserts it).
    cfg.groups = vec![full(8), swa(8, 4)];
    assert!(Hybrid::new(cfg.clone()).is_err());
    // More computed tokens than max_model_len is refused before anything changes.
    cfg.groups = vec![full(4), swa(8, 4)];
    let mut h = Hybrid::new(cfg.clone()).unwrap();
    let a = HybridSlots {
        num_computed_tokens: 1001,
        num_tokens: 1002,
        num_new_tokens: 1,
        ..Default::default()
    };
    assert!(h.allocate_slots("a", &a, &mut &ks[..]).is_err());
    assert_eq!(h.pool().num_free(), 19);
    // No group at all is refused; one group is the unitary coordinator.
    cfg.groups = vec![];
    assert!(Hybrid::new(cfg.clone()).is_err());
    cfg.groups = vec![swa(8, 4)];
    assert!(Hybrid::new(cfg).is_ok());
}

/// A request's hashes: `key(i)` for the first `shared` blocks, then `key(base + i)`.
fn sibling_keys(shared: u32, base: u32, n: u32) -> Vec<HashKey> {
    (0..n)
        .map(|i| if i < shared { key(i) } else { key(base + i) })
        .collect()
}

/// The request's boundaries are read only by a call that caches a block (no Mamba align
/// group): a decode step inside a block reads neither them nor a hash.
#[test]
fn boundaries_are_read_only_by_a_call_that_caches() {
    let mut h = hybrid_retaining(vec![full(4), swa(8, 4)], 4, true, sparse(0));
    let ks = keys(4);
    let reads = std::cell::Cell::new(0);
    let read = || {
        reads.set(reads.get() + 1);
        Ok(Boundaries {
            num_prompt_tokens: 5,
            shared_prefix_boundary: 0,
        })
    };
    let step = |computed: u64, tokens: u64| HybridSlots {
        num_computed_tokens: computed,
        num_tokens: tokens,
        num_new_tokens: tokens - computed,
        waiting_or_preempted: computed == 0,
        boundaries: BoundarySource::Read(&read),
        ..Default::default()
    };
    // 5 tokens: block 0 of each group becomes full and is cached.
    assert!(h
        .allocate_slots("a", &step(0, 5), &mut &ks[..])
        .unwrap()
        .is_some());
    let after_prefill = reads.get();
    assert!(after_prefill > 0);
    // The sixth token: block 1 is not full yet, nothing is read.
    assert!(h
        .allocate_slots("a", &step(5, 6), &mut &ks[..])
        .unwrap()
        .is_some());
    assert_eq!(reads.get(), after_prefill);
    // Up to 8 tokens: block 1 becomes full, the boundaries are read again.
    assert!(h
        .allocate_slots("a", &step(6, 8), &mut &ks[..])
        .unwrap()
        .is_some());
    assert!(reads.get() > after_prefill);
    h.check().unwrap();
}

#[test]
fn zero_retention_caches_the_replay_tail_and_the_junction_tail() {
    // prefix_cache_retention_interval=0, GPT-OSS-like (full + window 8 over 4-token blocks:
    // a hit needs 2 window blocks). "a" (17 tokens) caches 16: full attention all 4 blocks;
    // the window only the tail ending on the replay boundary 16 (positions 2, 3).
    let mut h = hybrid_retaining(vec![full(4), swa(8, 4)], 4, true, sparse(0));
    let ks = keys(4);
    let a = HybridSlots {
        boundaries: Boundaries {
            num_prompt_tokens: 17,
            shared_prefix_boundary: 0,
        }
        .into(),
        ..prefill(17)
    };
    let new = h.allocate_slots("a", &a, &mut &ks[..]).unwrap();
    assert_eq!(new, Some(vec![vec![1, 2, 3, 4, 5], vec![6, 7, 8, 9, 10]]));
    let stored = h.pool_mut().take_events();
    assert_eq!(
        stored[1],
        Event::StoredIn {
            group: 1,
            first: 0,
            end: 4,
            cached: vec![2, 3]
        }
    );
    // free: the uncached window blocks 10, 7, 6 go to the head (in freeing order), the
    // cached 9, 8 to the tail.
    h.free("a").unwrap();
    let want: Vec<u32> = [10, 7, 6, 5]
        .into_iter()
        .chain(11..20)
        .chain([4, 3, 2, 1, 9, 8])
        .collect();
    assert_eq!(h.pool().free_queue(), want);
    // A resend of "a" hits at its replay boundary in both groups.
    let hit = h.find_longest_cache_hit(&mut &ks[..], 16).unwrap();
    assert_eq!(hit.blocks, [vec![1, 2, 3, 4], vec![N, N, 8, 9]]);
    // "c" shares 3 blocks: full attention hits 12 tokens, the window nothing (its 12-token
    // tail was not kept): 12 uncached common-prefix tokens, the junction at 12.
    let kc = sibling_keys(3, 50, 5);
    let hit = h.find_longest_cache_hit(&mut &kc[..], 19).unwrap();
    assert_eq!((hit.num_tokens, hit.shared_prefix_boundary()), (0, 12));
    // "c" (20 tokens, no hit) then keeps the tails ending on 16 (replay: 19 -> 16) and on its
    // junction 12: window positions 1, 2, 3 (blocks 13, 14, 15).
    let c = HybridSlots {
        new_computed: Some(&hit.blocks),
        boundaries: Boundaries {
            num_prompt_tokens: 20,
            shared_prefix_boundary: 12,
        }
        .into(),
        ..prefill(20)
    };
    let new = h.allocate_slots("c", &c, &mut &kc[..]).unwrap();
    assert_eq!(
        new,
        Some(vec![vec![10, 7, 6, 5, 11], vec![12, 13, 14, 15, 16]])
    );
    // A third sibling now hits the junction in both groups (the window run: position 1 from
    // "c", position 2 from "a", the first block cached under that hash).
    let kd = sibling_keys(3, 60, 5);
    let hit = h.find_longest_cache_hit(&mut &kd[..], 19).unwrap();
    assert_eq!(hit.blocks, [vec![1, 2, 3], vec![N, 13, 8]]);
    assert_eq!((hit.num_tokens, hit.shared_prefix_boundary()), (12, 0));
    h.check().unwrap();
}

#[test]
fn retention_is_checked_as_vllms_coordinator_checks_it() {
    // _validate_prefix_cache_retention_interval runs for every coordinator, caching on or
    // off: 0 is allowed without a window (Llama 4: full + chunked), a positive interval is
    // not; with a window the interval must be a multiple of the scheduler block size.
    let cfg = |groups, retention, caching| HybridConfig {
        num_blocks: 20,
        groups,
        hash_block_size: 4,
        scheduler_block_size: 8,
        max_model_len: 1000,
        max_in_flight_tokens: 16,
        enable_caching: caching,
        enable_events: false,
        watermark_blocks: 0,
        release: Release::V033,
        retention,
        use_eagle: false,
        eagle_groups: Vec::new(),
        hash_lookahead_tokens: 0,
    };
    let llama4 = || vec![full(4), chunked(8, 8)];
    assert!(Hybrid::new(cfg(llama4(), sparse(0), true)).is_ok());
    let err = Hybrid::new(cfg(llama4(), sparse(16), false)).unwrap_err();
    assert!(err.to_string().contains("no sliding-window"), "{err}");
    let gpt_oss = || vec![full(4), swa(8, 4)];
    assert!(Hybrid::new(cfg(gpt_oss(), sparse(16), true)).is_ok());
    let err = Hybrid::new(cfg(gpt_oss(), sparse(12), false)).unwrap_err();
    assert!(
        err.to_string()
            .contains("multiple of scheduler_block_size (8)"),
        "{err}"
    );
}

/// The hashes of a request of family `f` with `n` tokens: families share their first three
/// blocks, then differ (chained hashes: different from there on).
fn family_keys(f: u32, n: u64) -> Vec<HashKey> {
    (0..(n / 4) as u32)
        .map(|i| {
            if i < 3 {
                key(i)
            } else {
                key(100 * (f + 1) + i)
            }
        })
        .collect()
}

/// `Retention::Sparse` with an interval.
const fn sparse(interval: u64) -> Retention {
    Retention::Sparse { interval }
}

#[test]
fn randomized_runs_keep_every_invariant() {
    // Seeded runs over sixteen layouts (dense retention, then sparse: 0 and periodic):
    // prefix hits (resends stop at the replay boundary, families share a junction), chunked
    // prefill (some admissions gated on the full sequence), decode (some with tokens still in
    // flight), preemption, eviction and frees, checking the pool's and every table's
    // invariants after each call and that each hit is aligned, within its bound and every
    // group's share of it.
    use crate::rng::Rng;
    use std::fmt::Write as _;
    // With PAGEDKV_HYBRID_TRACE=path, every call and its outcome is written there (one
    // Python literal a line) for a replay on vLLM's own coordinator.
    let trace_path = std::env::var("PAGEDKV_HYBRID_TRACE").ok();
    let mut trace = String::new();
    let opt =
        |o: &Option<Vec<Vec<u32>>>| o.as_ref().map_or("None".to_string(), |v| format!("{v:?}"));
    // (groups, scheduler block size, prefix caching, retention); scripts/hybrid_replay.py
    // has the same.
    let dense = Retention::Dense;
    let layouts: [(Vec<GroupSpec>, u32, bool, Retention); 16] = [
        (vec![full(4), swa(8, 4)], 4, true, dense),
        (vec![swa(8, 4), full(4), chunked(8, 4)], 4, true, dense),
        (vec![full(4), swa(8, 8)], 8, true, dense),
        (vec![full(4), swa(5, 4)], 8, true, dense),
        (vec![full(4), swa(8, 4), swa(16, 4)], 4, true, dense),
        (vec![swa(8, 4), swa(8, 4), full(4)], 4, true, dense),
        (vec![full(4), swa(8, 4), chunked(8, 4)], 4, false, dense),
        (vec![full(4), swa(8, 4)], 4, true, sparse(0)),
        (vec![full(4), swa(8, 4)], 4, true, sparse(16)),
        (vec![swa(8, 4), full(4), chunked(8, 4)], 4, true, sparse(0)),
        (vec![full(4), swa(8, 8)], 8, true, sparse(0)),
        (vec![full(4), swa(5, 4)], 8, true, sparse(0)),
        (vec![full(4), swa(5, 4)], 8, true, sparse(16)),
        (vec![full(4), swa(8, 4), swa(16, 4)], 4, true, sparse(0)),
        (vec![swa(5, 4), swa(5, 4), full(4)], 4, true, sparse(12)),
        (vec![full(4), swa(8, 4), chunked(8, 4)], 4, false, sparse(0)),
    ];
    for (li, (layout, sbs, caching, retention)) in layouts.into_iter().enumerate() {
        let mut rng = Rng::new(0x1d5eed);
        let mut h = hybrid_retaining(layout, sbs, caching, retention);
        // (id, family, tokens, computed, the prompt and junction it caches around)
        let mut live: Vec<(String, u32, u64, u64, Boundaries)> = Vec::new();
        for step in 0..3000 {
            let traced = trace.len();
            match rng.below(10) {
                0..=2 if live.len() < 4 => {
                    let (f, n) = (rng.below(3) as u32, 1 + rng.below(40) as u64);
                    let ks = family_keys(f, n);
                    let hit = h.find_longest_cache_hit(&mut &ks[..], n - 1).unwrap();
                    assert!(hit.num_tokens < n && hit.num_tokens % u64::from(sbs) == 0);
                    for (g, blocks) in hit.blocks.iter().enumerate() {
                        let bs = u64::from(h.group(g).block_size());
                        assert!(blocks.len() as u64 * bs >= hit.num_tokens, "{hit:?}");
                    }
                    let id = format!("r{step}");
                    let chunk = 1 + rng.below((n - hit.num_tokens) as usize) as u64;
                    let gate = rng.chance(30);
                    let boundaries = Boundaries {
                        num_prompt_tokens: n,
                        shared_prefix_boundary: hit.shared_prefix_boundary(),
                    };
                    let a = HybridSlots {
                        num_tokens: n,
                        num_new_tokens: chunk,
                        num_new_computed_tokens: hit.num_tokens,
                        new_computed: Some(&hit.blocks),
                        waiting_or_preempted: true,
                        full_sequence_must_fit: gate,
                        boundaries: boundaries.into(),
                        ..Default::default()
                    };
                    let new = h.allocate_slots(&id, &a, &mut &ks[..]).unwrap();
                    let _ = write!(
                        trace,
                        "('new', {li}, '{id}', {f}, {n}, {chunk}, {}, {:?}, {}, {}, {}",
                        hit.num_tokens,
                        hit.blocks,
                        if gate { "True" } else { "False" },
                        opt(&new),
                        boundaries.shared_prefix_boundary,
                    );
                    if new.is_some() {
                        live.push((id, f, n, hit.num_tokens + chunk, boundaries));
                    }
                }
                0..=6 if !live.is_empty() => {
                    let i = rng.below(live.len());
                    let (id, f, n, c, boundaries) = live[i].clone();
                    let (tokens, new) = if c < n {
                        (n, 1 + rng.below((n - c) as usize) as u64)
                    } else {
                        (n + 1, 1)
                    };
                    let ks = family_keys(f, tokens);
                    let in_flight = if rng.chance(30) {
                        rng.below(c as usize + 1) as u64
                    } else {
                        0
                    };
                    let a = HybridSlots {
                        num_computed_tokens: c,
                        num_tokens: tokens,
                        num_new_tokens: new,
                        num_in_flight_tokens: in_flight,
                        boundaries: boundaries.into(),
                        ..Default::default()
                    };
                    let out = h.allocate_slots(&id, &a, &mut &ks[..]).unwrap();
                    let _ = write!(
                        trace,
                        "('step', {li}, '{id}', {f}, {tokens}, {c}, {in_flight}, {new}, {}",
                        opt(&out)
                    );
                    if out.is_some() {
                        live[i] = (id, f, tokens, c + new, boundaries);
                    } else {
                        h.free(&id).unwrap();
                        live.swap_remove(i);
                    }
                }
                7 if !live.is_empty() => {
                    let (id, ..) = live.swap_remove(rng.below(live.len()));
                    h.free(&id).unwrap();
                    let _ = write!(trace, "('free', {li}, '{id}'");
                }
                _ => {
                    let b = 1 + rng.below(19) as u32;
                    h.pool_mut().evict(b);
                    let _ = write!(trace, "('evict', {li}, {b}");
                }
            }
            if trace.len() > traced {
                let tables: Vec<_> = live
                    .iter()
                    .map(|(id, ..)| (id.clone(), h.blocks(id)))
                    .collect();
                let _ = writeln!(trace, ", {:?}, {:?})", h.pool().free_queue(), tables);
            }
            h.check().unwrap_or_else(|e| panic!("step {step}: {e}"));
        }
        for (id, ..) in live {
            h.free(&id).unwrap();
        }
        h.check().unwrap();
        assert_eq!(h.pool().num_free(), 19);
    }
    if let Some(p) = trace_path {
        std::fs::write(p, trace).unwrap();
    }
}

/// What a failed `allocate_slots` must leave as it was: the free queue, every block's ref
/// count and cached hash (with its group), and each request's table and cached count in
/// every group. (Pending KV events are drained before the call and checked empty after.)
type Snapshot = (Vec<u32>, Vec<(u32, Option<HashKey>, u32)>, Vec<Vec<u32>>);

fn snapshot(h: &Hybrid, reqs: &[&str]) -> Snapshot {
    let p = h.pool();
    let blocks = (0..p.num_blocks())
        .map(|b| (p.ref_cnt(b), p.hash_of(b).copied(), p.group_of(b)))
        .collect();
    let mut tables = Vec::new();
    for req in reqs {
        let slot = h.slot(req);
        for g in 0..h.num_groups() {
            let m = h.group(g);
            tables.push(m.blocks(slot).to_vec());
            tables.push(m.num_cached_blocks(slot).into_iter().collect());
        }
    }
    (p.free_queue(), blocks, tables)
}

/// `allocate_slots` fails with `a`, and the snapshot of `reqs`, the events and every
/// invariant are as before the call.
fn fails_unchanged(h: &mut Hybrid, req: &str, a: &HybridSlots, ks: &[HashKey], reqs: &[&str]) {
    h.pool_mut().take_events();
    let before = snapshot(h, reqs);
    let got = h.allocate_slots(req, a, &mut &ks[..]);
    assert!(got.is_err(), "{a:?} was accepted: {got:?}");
    assert_eq!(snapshot(h, reqs), before, "{a:?} changed the state");
    assert_eq!(h.pool_mut().take_events(), []);
    h.check().unwrap();
}

/// A window group may need more blocks than vLLM's count says: a request whose table is
/// shorter than the window skips (not tracked in `num_cached_block`, its first allocation
/// had its caching delayed) counts its new blocks past the skipped ones but allocates them
/// past its table. vLLM then raises in `get_new_blocks`, group 0 having allocated already;
/// here the call fails with the same error before anything changes.
#[test]
fn a_window_needing_more_than_counted_fails_before_any_group_allocates() {
    let mut h = hybrid(vec![full(4), swa(8, 4)], 4);
    let ks = keys(11);
    let first = HybridSlots {
        delay_cache_blocks: true,
        ..prefill(8)
    };
    let new = h.allocate_slots("a", &first, &mut &ks[..]).unwrap();
    assert_eq!(new, Some(vec![vec![1, 2], vec![3, 4]]));
    // 40 computed (all in flight: nothing freed), 4 new: 11 blocks per group. Counted:
    // full 11 - 2 = 9, window 11 - max(8 skipped, 2) = 3; 12 <= 15 free, admitted. Allocated:
    // full 9 (6 left), window 11 - 2 = 9 > 6.
    let a = HybridSlots {
        num_computed_tokens: 40,
        num_tokens: 44,
        num_new_tokens: 4,
        num_in_flight_tokens: 40,
        ..Default::default()
    };
    let c = Count::new(44, 40);
    assert_eq!(h.num_blocks_to_allocate("a", &c, None).unwrap(), 12);
    fails_unchanged(&mut h, "a", &a, &ks, &["a"]);
    let e = h.allocate_slots("a", &a, &mut &ks[..]).unwrap_err();
    assert_eq!(e.to_string(), "out of gpu blocks: 9 needed, 6 free");
    // With enough free blocks the same call goes through, in group order.
    h.pool_mut().take_events();
    let a = HybridSlots {
        num_computed_tokens: 12,
        num_tokens: 16,
        num_in_flight_tokens: 12,
        ..a
    };
    let new = h.allocate_slots("a", &a, &mut &ks[..]).unwrap();
    assert_eq!(new, Some(vec![vec![5, 6], vec![7, 8]]));
    h.check().unwrap();
}

/// Hashes that fail to read past the first `n` (a request's `block_hashes` raising).
struct FailingHashes(Vec<HashKey>, usize);

impl HashSource for FailingHashes {
    fn count(&mut self) -> crate::error::Result<usize> {
        Ok(self.0.len())
    }
    fn key(&mut self, i: usize) -> crate::error::Result<HashKey> {
        match i < self.1 {
            true => Ok(self.0[i]),
            false => Err(crate::error::Error::invalid(format!("hash {i} unreadable"))),
        }
    }
}

/// Every hash a call caches under is read before the hit is adopted or any group allocates:
/// a hash that fails to read fails the call with nothing changed.
#[test]
fn an_unreadable_hash_fails_before_the_hit_is_adopted() {
    let mut h = gpt_oss_after_a();
    let ks = keys(6);
    let hit = h.find_longest_cache_hit(&mut &ks[..], 16).unwrap();
    assert_eq!(hit.blocks, vec![vec![1, 2, 3, 4], vec![N, N, 8, 9]]);
    // 16 hit + 8 new: blocks 4 and 5 become full, their hashes read (the fifth fails).
    let a = HybridSlots {
        num_tokens: 24,
        num_new_tokens: 8,
        num_new_computed_tokens: 16,
        new_computed: Some(&hit.blocks),
        waiting_or_preempted: true,
        ..Default::default()
    };
    h.pool_mut().take_events();
    let before = snapshot(&h, &["b"]);
    let got = h.allocate_slots("b", &a, &mut FailingHashes(ks.clone(), 5));
    assert!(got.unwrap_err().to_string().contains("hash 5 unreadable"));
    assert_eq!(snapshot(&h, &["b"]), before);
    assert_eq!(h.pool_mut().take_events(), []);
    h.check().unwrap();
    // Readable, the same call adopts, allocates and caches.
    let new = h.allocate_slots("b", &a, &mut &ks[..]).unwrap();
    assert_eq!(
        new.map(|n| n.iter().map(Vec::len).collect::<Vec<_>>()),
        Some(vec![2, 2])
    );
    h.check().unwrap();
}

/// Arguments no scheduler passes (out of range, inconsistent with the request's state) fail
/// before anything changes, the window's skipped blocks included.
#[test]
fn arguments_out_of_range_or_inconsistent_fail_unchanged() {
    let mut h = hybrid(vec![full(4), swa(8, 4)], 4);
    let ks = keys(20);
    h.allocate_slots("a", &prefill(16), &mut &ks[..])
        .unwrap()
        .unwrap();
    let step = HybridSlots {
        num_computed_tokens: 16,
        num_tokens: 17,
        num_new_tokens: 1,
        ..Default::default()
    };
    let hit = vec![vec![1], vec![5]];
    let bad = [
        // Nothing to compute and nothing to adopt.
        HybridSlots {
            num_new_tokens: 0,
            ..step
        },
        // Computed tokens past max_model_len (1000).
        HybridSlots {
            num_computed_tokens: 1001,
            num_tokens: 1002,
            ..step
        },
        HybridSlots {
            num_computed_tokens: u64::MAX,
            num_new_computed_tokens: u64::MAX,
            ..step
        },
        // A running request offered a hit.
        HybridSlots {
            num_new_computed_tokens: 4,
            new_computed: Some(&hit),
            ..step
        },
        // A hit for one group of two.
        HybridSlots {
            num_new_computed_tokens: 4,
            new_computed: Some(&hit[..1]),
            ..step
        },
    ];
    for a in &bad {
        fails_unchanged(&mut h, "a", a, &ks, &["a"]);
    }
    // A Mamba align group bounds the main-model tokens too (its table grows with them).
    let kind = AttentionKind::MambaAlign {
        num_speculative_blocks: 0,
        checkpoint_alignment: 0,
    };
    let mut h = hybrid(vec![full(4), GroupSpec::new(kind, 4)], 4);
    h.allocate_slots("a", &prefill(16), &mut &ks[..])
        .unwrap()
        .unwrap();
    let a = HybridSlots {
        num_computed_tokens: 996,
        num_tokens: 1001,
        num_new_tokens: 5,
        ..step
    };
    fails_unchanged(&mut h, "a", &a, &ks, &["a"]);
}

/// vLLM's `allocate_new_computed_blocks` with external (connector) tokens and no local hit:
/// every group pads the blocks its window skips with null blocks, then takes blocks up to
/// the computed tokens (group 0, then 1), before the call's own blocks (group 0, then 1);
/// only the call's own are returned.
#[test]
fn external_tokens_take_blocks_inside_each_window_first() {
    let mut h = hybrid(vec![full(4), swa(8, 4)], 4);
    let load = HybridSlots {
        num_tokens: 22,
        num_new_tokens: 3,
        num_external_computed_tokens: 18,
        waiting_or_preempted: true,
        ..Default::default()
    };
    let ks = keys(5);
    let new = h.allocate_slots("a", &load, &mut &ks[..]).unwrap();
    // Group 0: 5 blocks for 18 tokens (1-5); group 1: a window of 8 at 18 computed tokens
    // skips 11 tokens, 2 whole blocks (nulls), then blocks 6-8 up to 18 tokens; then the
    // 6th block for 21 tokens in group 0 (9) and group 1 (10).
    assert_eq!(new, Some(vec![vec![9], vec![10]]));
    assert_eq!(
        h.blocks("a"),
        [vec![1, 2, 3, 4, 5, 9], vec![N, N, 6, 7, 8, 10]]
    );
}

/// External tokens beside a Mamba group, or for a request holding blocks no group tracks,
/// are refused before anything changes.
#[test]
fn external_tokens_vllm_cannot_take_are_refused() {
    let mut h = hybrid_cached(vec![full(4), swa(8, 4)], 4, false);
    let ks = keys(4);
    h.allocate_slots("a", &prefill(6), &mut &ks[..]).unwrap();
    let free = h.pool().num_free();
    let later = HybridSlots {
        num_computed_tokens: 6,
        num_external_computed_tokens: 4,
        ..prefill(12)
    };
    assert!(h.allocate_slots("a", &later, &mut &ks[..]).is_err());
    assert_eq!(h.pool().num_free(), free);
    let past = HybridSlots {
        num_external_computed_tokens: 1001,
        ..prefill(2)
    };
    assert!(h.allocate_slots("b", &past, &mut &ks[..]).is_err());
    assert_eq!(h.pool().num_free(), free);
}
