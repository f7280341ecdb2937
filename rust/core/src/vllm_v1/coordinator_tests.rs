//! Unit tests of the hybrid coordinator, each expected value worked out by hand from the vLLM
//! function named in the comment (`kv_cache_coordinator.py`'s `HybridKVCacheCoordinator`,
//! `kv_cache_manager.py`'s `allocate_slots` / `free`; 0.32 and 0.33 alike unless stated).

use super::coordinator::{Hit, Hybrid, HybridConfig, HybridSlots};
use super::engine::Release;
use super::pool::{Event, HashKey, NULL_BLOCK};
use super::single_type::{AttentionKind, GroupSpec};

const N: u32 = NULL_BLOCK;

fn key(i: u32) -> HashKey {
    let mut b = [5u8; 32];
    b[..4].copy_from_slice(&i.to_be_bytes());
    HashKey::new(&b).unwrap()
}

fn keys(n: u32) -> Vec<HashKey> {
    (0..n).map(key).collect()
}

fn full(bs: u32) -> GroupSpec {
    GroupSpec::new(AttentionKind::Full, bs)
}

fn swa(window: u32, bs: u32) -> GroupSpec {
    GroupSpec::new(
        AttentionKind::SlidingWindow {
            sliding_window: window,
        },
        bs,
    )
}

fn chunked(chunk: u32, bs: u32) -> GroupSpec {
    GroupSpec::new(
        AttentionKind::ChunkedLocal {
            attention_chunk_size: chunk,
        },
        bs,
    )
}

fn hybrid(groups: Vec<GroupSpec>, scheduler_block_size: u32) -> Hybrid {
    Hybrid::new(HybridConfig {
        num_blocks: 20,
        groups,
        hash_block_size: 4,
        scheduler_block_size,
        max_model_len: 1000,
        max_in_flight_tokens: 16,
        enable_caching: true,
        enable_events: true,
        watermark_blocks: 0,
        release: Release::V033,
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
            Event::Stored { first: 0, end: 4 },
            Event::Stored { first: 0, end: 4 }
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
        h.num_blocks_to_allocate("b", 21, Some(&hit.blocks), 16, false)
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
    // scheduler block size their lcm): full attention over 8-token blocks, a window of 8
    // over 4-token blocks, scheduler block 8. 17 tokens: 3 + 5 blocks; cached up to
    // round_down(17, 8) = 16 tokens: 2 full blocks (hashes 1 and 3), 4 window blocks
    // (window 8 needs 2 blocks, a segment has 2: all reachable).
    let mut h = hybrid(vec![full(8), swa(8, 4)], 8);
    let ks = keys(4);
    let new = h.allocate_slots("a", &prefill(17), &mut &ks[..]).unwrap();
    assert_eq!(new, Some(vec![vec![1, 2, 3], vec![4, 5, 6, 7, 8]]));
    assert_eq!(h.pool().get_cached_in(&key(1), 0), Some(1));
    assert_eq!(h.pool().get_cached_in(&key(3), 0), Some(2));
    assert_eq!(h.pool().get_cached_in(&key(0), 0), None);
    h.free("a").unwrap();
    let hit = h.find_longest_cache_hit(&mut &ks[..], 16).unwrap();
    assert_eq!(hit.blocks, [vec![1, 2], vec![N, N, 6, 7]]);
    assert_eq!(hit.num_tokens, 16);
    h.check().unwrap();
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
    };
    let h = Hybrid::new(cfg.clone()).unwrap();
    let ks = keys(4);
    let hit = h.find_longest_cache_hit(&mut &ks[..], 16).unwrap();
    assert_eq!(hit.blocks, [Vec::<u32>::new(), Vec::new()]);
    // The scheduler block size must be a multiple of every block size (vLLM asserts it).
    cfg.groups = vec![full(8), swa(8, 4)];
    assert!(Hybrid::new(cfg.clone()).is_err());
    // One group is the unitary coordinator's, not this one.
    cfg.groups = vec![full(4)];
    assert!(Hybrid::new(cfg).is_err());
}
