//! Unit tests of EAGLE/MTP's rules ([`super::eagle`]) where they act: the one-group manager,
//! the per-kind lookups, the hybrid coordinator and sliding-window retention. Each expected
//! value is worked out by hand from the vLLM function named in the comment
//! (`kv_cache_coordinator.py`, `single_type_kv_cache_manager.py`), per release where they
//! differ.

use super::coordinator::{Hit, Hybrid, HybridConfig, HybridSlots};
use super::engine::Release;
use super::pool::{Event, Pool, NULL_BLOCK};
use super::retention::{Boundaries, Retained, Retention};
use super::single_type::{find_longest_cache_hit_eagle, GroupSpec};
use super::single_type_tests::{chunked, full, key, keys, swa};
use super::{eagle::GroupEagle, Config, Manager};

const N: u32 = NULL_BLOCK;

/// Blocks 1..=n handed out in order, block `i` cached under `key(i)` in `group` (4 tokens
/// per hash).
fn cache_prefix(pool: &mut Pool, n: u32, group: u32) -> Vec<u32> {
    let mut blocks = Vec::new();
    pool.get_new_blocks(n as usize, &mut blocks).unwrap();
    for (i, &b) in blocks.iter().enumerate() {
        pool.insert_hash_in(b, key(i as u32), group, (i as u32 + 1) * 4)
            .unwrap();
    }
    blocks
}

#[test]
fn one_group_drops_the_last_block_per_release() {
    // UnitaryKVCacheCoordinator: drop_eagle_block = 0 in the drop set (0.32: eagle_group_ids
    // whatever use_eagle says; 0.33: drop_eagle_group_ids, empty without use_eagle).
    let mut m = Manager::new(Config {
        num_blocks: 10,
        block_size: 4,
        max_model_len: 100,
        enable_caching: true,
        enable_events: false,
        watermark_blocks: 0,
    })
    .unwrap();
    assert_eq!(cache_prefix(m.pool_mut(), 4, 0), [1, 2, 3, 4]);
    let ks = keys(4);
    let cases = [
        (Release::V032, false, false, false),
        (Release::V032, false, true, true),
        (Release::V032, true, false, true),
        (Release::V033, false, true, false),
        (Release::V033, true, false, true),
        (Release::V033, true, true, true),
    ];
    for (release, use_eagle, flagged, drops) in cases {
        m.set_eagle(release, use_eagle, flagged);
        assert_eq!(
            m.drops_eagle_block(),
            drops,
            "{release:?} {use_eagle} {flagged}"
        );
        let hit = m.longest_cache_hit(&mut &ks[..], 3).unwrap();
        assert_eq!(hit, if drops { vec![1, 2] } else { vec![1, 2, 3] });
        // FullAttentionManager: nothing to drop from an empty hit.
        assert!(m.longest_cache_hit(&mut &ks[..], 0).unwrap().is_empty());
    }
}

fn lookup(spec: GroupSpec, pool: &Pool, max_len: u64, align: u64, drop: bool) -> (Vec<u32>, u64) {
    let ks = keys(5);
    let args = (4, max_len, align);
    let (mut b, len) =
        find_longest_cache_hit_eagle(&spec, &[0], pool, &mut &ks[..], args, drop).unwrap();
    (b.remove(0), len)
}

#[test]
fn full_attention_drops_one_block_then_realigns() {
    // FullAttentionManager.find_longest_cache_hit: 4 blocks (16 tokens) hit; EAGLE takes
    // min(alignment, block) = 4 off, then rounds down to the alignment.
    let mut p = Pool::new_grouped(10, true, false, 2).unwrap();
    cache_prefix(&mut p, 4, 0);
    assert_eq!(lookup(full(4), &p, 20, 4, false), (vec![1, 2, 3, 4], 16));
    assert_eq!(lookup(full(4), &p, 20, 4, true), (vec![1, 2, 3], 12));
    assert_eq!(lookup(full(4), &p, 20, 8, true), (vec![1, 2], 8));
}

#[test]
fn a_window_needs_one_more_block_and_pops_it() {
    // SlidingWindowManager: a window of 8 over 4-token blocks needs 2 blocks in a row, 3
    // with EAGLE (_contiguous_blocks_for_hit), then pops the last.
    let mut p = Pool::new_grouped(10, true, false, 2).unwrap();
    cache_prefix(&mut p, 5, 0);
    assert_eq!(
        lookup(swa(8, 4), &p, 20, 4, false),
        (vec![N, N, N, 4, 5], 20)
    );
    assert_eq!(lookup(swa(8, 4), &p, 20, 4, true), (vec![N, N, 3, 4], 16));
    // Alignment 8: without EAGLE the run may not end at block 4 (20 tokens), with EAGLE it
    // may (the pop leaves 16).
    assert_eq!(lookup(swa(8, 4), &p, 20, 8, false), (vec![N, N, 3, 4], 16));
    assert_eq!(lookup(swa(8, 4), &p, 20, 8, true), (vec![N, N, 3, 4], 16));
    // ChunkedLocalAttentionManager asserts drop_eagle_block is False.
    let ks = keys(5);
    let args = (4, 16, 4);
    assert!(
        find_longest_cache_hit_eagle(&chunked(8, 4), &[0], &p, &mut &ks[..], args, true).is_err()
    );
}

fn gpt_oss(release: Release, use_eagle: bool, flagged: Vec<bool>) -> Hybrid {
    let mut h = Hybrid::new(HybridConfig {
        num_blocks: 20,
        groups: vec![full(4), swa(8, 4)],
        hash_block_size: 4,
        scheduler_block_size: 4,
        max_model_len: 1000,
        max_in_flight_tokens: 16,
        enable_caching: true,
        enable_events: true,
        watermark_blocks: 0,
        release,
        retention: Retention::Dense,
        use_eagle,
        eagle_groups: flagged,
        hash_lookahead_tokens: 0,
    })
    .unwrap();
    // 17 tokens: blocks 1..=5 (full) and 6..=10 (window); 4 cached per group (an EAGLE group
    // caches min(17, 16 + 4) tokens: the same 4 blocks).
    let ks = keys(4);
    let a = HybridSlots {
        num_tokens: 17,
        num_new_tokens: 17,
        waiting_or_preempted: true,
        ..Default::default()
    };
    assert!(h.allocate_slots("a", &a, &mut &ks[..]).unwrap().is_some());
    h.free("a").unwrap();
    h
}

#[test]
fn the_coordinator_looks_one_block_further_and_drops_once() {
    // HybridKVCacheCoordinator.find_longest_cache_hit, max 16 over 5 hashes, every group
    // dropping: full looks up min(16 + 4, 20) -> 16 tokens, drops to 12; the window looks
    // up min(12 + 4, 20) = 16, finds [N, 7, 8, 9] (3 in a row), pops to 12.
    let h = gpt_oss(Release::V033, true, vec![]);
    let ks = keys(5);
    let hit = h.find_longest_cache_hit(&mut &ks[..], 16).unwrap();
    let want = Hit {
        blocks: vec![vec![1, 2, 3], vec![N, 7, 8]],
        num_tokens: 12,
        num_uncached_common_prefix_tokens: 0,
    };
    assert_eq!(hit, want);
    assert!(h.group(0).use_eagle() && h.group(1).use_eagle());
}

#[test]
fn a_flagged_group_without_use_eagle_drops_in_032_only() {
    // Only the window flagged is_eagle_group, use_eagle False. 0.32 (drop set =
    // eagle_group_ids): full finds 16 undropped; the window looks up min(16 + 4, 20) = 20,
    // its run [N, 7, 8, 9] pops to 12; full is cut to 3 blocks; 16 - 12 = 4 uncached.
    let ks = keys(5);
    let h = gpt_oss(Release::V032, false, vec![false, true]);
    let hit = h.find_longest_cache_hit(&mut &ks[..], 16).unwrap();
    let want = Hit {
        blocks: vec![vec![1, 2, 3], vec![N, 7, 8]],
        num_tokens: 12,
        num_uncached_common_prefix_tokens: 4,
    };
    assert_eq!(hit, want);
    assert_eq!(
        (h.group(0).use_eagle(), h.group(1).use_eagle()),
        (false, true)
    );
    // 0.33 (drop_eagle_group_ids empty without use_eagle): the plain hit.
    let h = gpt_oss(Release::V033, false, vec![false, true]);
    let hit = h.find_longest_cache_hit(&mut &ks[..], 16).unwrap();
    assert_eq!(hit.blocks, [vec![1, 2, 3, 4], vec![N, N, 8, 9]]);
    assert_eq!(hit.num_tokens, 16);
    assert!(!h.group(1).use_eagle());
    // Flags for another number of groups are refused.
    let mut cfg = h.config().clone();
    cfg.eagle_groups = vec![true];
    assert!(Hybrid::new(cfg).is_err());
}

#[test]
fn an_eagle_group_caches_one_block_past_the_scheduler_boundary() {
    // get_num_cacheable_tokens: scheduler block 8; 20 tokens round down to 16; the EAGLE
    // full group (block 4) caches min(20, 16 + 4) = 20 tokens: 5 blocks, not 4.
    for (use_eagle, end) in [(false, 4), (true, 5)] {
        let mut h = Hybrid::new(HybridConfig {
            num_blocks: 20,
            groups: vec![full(4), swa(8, 8)],
            hash_block_size: 4,
            scheduler_block_size: 8,
            max_model_len: 1000,
            max_in_flight_tokens: 16,
            enable_caching: true,
            enable_events: true,
            watermark_blocks: 0,
            release: Release::V033,
            retention: Retention::Dense,
            use_eagle,
            eagle_groups: vec![],
            hash_lookahead_tokens: 0,
        })
        .unwrap();
        let ks = keys(5);
        let a = HybridSlots {
            num_tokens: 20,
            num_new_tokens: 20,
            waiting_or_preempted: true,
            ..Default::default()
        };
        assert!(h.allocate_slots("a", &a, &mut &ks[..]).unwrap().is_some());
        let events = h.pool_mut().take_events();
        let Event::StoredIn {
            group,
            first,
            end: e,
            ..
        } = &events[0]
        else {
            panic!("{events:?}")
        };
        assert_eq!((*group, *first, *e), (0, 0, end));
        h.check().unwrap();
    }
}

fn cached(r: Retained, n: usize) -> Vec<usize> {
    (0..n).filter(|&i| r.contains(i)).collect()
}

#[test]
fn retention_keeps_the_peek_block_and_eagles_boundaries() {
    // reachable_block_mask, a window of 5 over 4-token blocks (need 1; 2 with EAGLE, shift 1).
    let spec = swa(5, 4);
    let at = |prompt, junction| Boundaries {
        num_prompt_tokens: prompt,
        shared_prefix_boundary: junction,
    };
    let eagle = |release| GroupEagle::new(release, true, true);
    let plain = GroupEagle::default();
    // Dense, alignment 16 (4 blocks a segment): tails at (i - 1) % 4 >= 2 with EAGLE.
    let dense = |e| Retained::new(&spec, Retention::Dense, 16, at(43, 0), e);
    assert_eq!(cached(dense(plain), 10), [3, 7]);
    assert_eq!(cached(dense(eagle(Release::V033)), 10), [3, 4, 7, 8]);
    // Sparse 0, alignment 8, prompt 43: without EAGLE the replay boundary 42 -> 40 (end
    // block 10); with it replay_boundaries gives {32} (end block 8 + 1).
    let sparse = Retention::Sparse { interval: 0 };
    let r = |b, e| Retained::new(&spec, sparse, 8, b, e);
    assert_eq!(cached(r(at(43, 0), plain), 12), [9]);
    assert_eq!(cached(r(at(43, 0), eagle(Release::V033)), 12), [7, 8]);
    // A junction at 24: its tail [5, 6]; 0.33 adds the junction one block lower (20 -> 16:
    // [3, 4]); 0.32 does not.
    assert_eq!(
        cached(r(at(43, 24), eagle(Release::V032)), 12),
        [5, 6, 7, 8]
    );
    assert_eq!(
        cached(r(at(43, 24), eagle(Release::V033)), 12),
        [3, 4, 5, 6, 7, 8]
    );
}
