//! Unit tests of the grouped pool and the per-group managers, each expected value worked out by
//! hand from the vLLM function named in the comment (`single_type_kv_cache_manager.py`,
//! `block_pool.py`, 0.32 and 0.33 alike unless stated).

use super::engine::Release;
use super::pool::{Event, HashKey, Pool, NULL_BLOCK};
use super::retention::{Boundaries, Retention};
use super::single_type::{
    find_longest_cache_hit, AttentionKind, GroupManager, GroupParams, GroupSpec, ReqSlot,
};

const N: u32 = NULL_BLOCK;
/// Two requests' slots (the coordinator assigns them; a group indexes by them).
const A: ReqSlot = ReqSlot(0);
const B: ReqSlot = ReqSlot(1);

/// The test hash of block `i` (shared with `coordinator_tests` and `eagle_tests`).
pub(super) fn key(i: u32) -> HashKey {
    let mut b = [9u8; 32];
    b[..4].copy_from_slice(&i.to_be_bytes());
    HashKey::new(&b).unwrap()
}

pub(super) fn keys(n: u32) -> Vec<HashKey> {
    (0..n).map(key).collect()
}

/// A full-attention group spec (shared with `coordinator_tests` and `eagle_tests`).
pub(super) fn full(bs: u32) -> GroupSpec {
    GroupSpec::new(AttentionKind::Full, bs)
}

/// A sliding-window group spec (shared with `coordinator_tests`).
pub(super) fn swa(window: u32, bs: u32) -> GroupSpec {
    GroupSpec::new(
        AttentionKind::SlidingWindow {
            sliding_window: window,
            extra_retained_tokens: 0,
        },
        bs,
    )
}

/// A chunked-local-attention group spec (shared with `coordinator_tests`).
pub(super) fn chunked(chunk: u32, bs: u32) -> GroupSpec {
    GroupSpec::new(
        AttentionKind::ChunkedLocal {
            attention_chunk_size: chunk,
        },
        bs,
    )
}

fn params(scheduler_block_size: u32, caching: bool) -> GroupParams {
    GroupParams {
        hash_block_size: 4,
        scheduler_block_size,
        enable_caching: caching,
        max_in_flight_tokens: 16,
        max_model_len: 1000,
        retention: Retention::Dense,
        release: Release::V033,
        mamba_drop_eagle: false,
        hash_lookahead_tokens: 0,
    }
}

/// Blocks 1..=n handed out in order and cached under `key(i)` for the block at position
/// `i` of `at` (a position per block), in group `group`.
fn cache_at(pool: &mut Pool, at: &[u32], group: u32) -> Vec<u32> {
    let mut blocks = Vec::new();
    pool.get_new_blocks(at.len(), &mut blocks).unwrap();
    for (&b, &i) in blocks.iter().zip(at) {
        pool.insert_hash_in(b, key(i), group, (i + 1) * 4).unwrap();
    }
    blocks
}

fn lookup(
    spec: GroupSpec,
    pool: &Pool,
    n_hashes: u32,
    max_len: u64,
    align: u64,
) -> (Vec<u32>, u64) {
    let ks = keys(n_hashes);
    let (mut blocks, len) =
        find_longest_cache_hit(&spec, &[0], pool, &mut &ks[..], 4, max_len, align).unwrap();
    (blocks.remove(0), len)
}

// --- the grouped pool (BlockPool keyed by BlockHashWithGroupId) ---

#[test]
fn pool_groups_answer_only_for_their_own_blocks() {
    // get_cached_block(hash, [g]) looks up make_block_hash_with_group_id(hash, g).
    let mut p = Pool::new_grouped(8, true, true, 2).unwrap();
    let a = cache_at(&mut p, &[0], 0)[0];
    let b = cache_at(&mut p, &[0], 1)[0];
    assert_eq!((a, b), (1, 2));
    assert_eq!(p.get_cached_in(&key(0), 0), Some(1));
    assert_eq!(p.get_cached_in(&key(0), 1), Some(2));
    assert_eq!(p.group_of(2), 1);
    // Evicting group 0's block leaves group 1's cached (one BlockRemoved for the hash).
    assert!(p.evict(1));
    assert_eq!(p.take_events(), [Event::RemovedIn(key(0), 0)]);
    assert_eq!(p.get_cached_in(&key(0), 0), None);
    assert_eq!(p.get_cached_in(&key(0), 1), Some(2));
    p.check().unwrap();
    // Events carry the group (vLLM's BlockRemoved.group_idx).
    assert!(p.evict(2));
    assert_eq!(p.take_events(), [Event::RemovedIn(key(0), 1)]);
    assert_eq!(p.get_cached_in(&key(0), 1), None);
    assert!(p.insert_hash_in(3, key(5), 2, 4).is_err());
    // The one-group manager's pool keeps no group table and knows group 0 only.
    let mut one = Pool::new(8, true, false).unwrap();
    assert_eq!(one.num_groups(), 1);
    assert!(one.insert_hash_in(1, key(0), 1, 4).is_err());
}

// --- get_num_skipped_tokens ---

#[test]
fn skipped_tokens_per_kind() {
    // SlidingWindowManager.get_num_skipped_tokens: window 4, 7 computed -> 4 (its docstring).
    let w = swa(4, 4);
    assert_eq!(w.num_skipped_tokens(7), 4);
    assert_eq!(w.num_skipped_tokens(3), 0);
    assert_eq!(w.num_skipped_tokens(0), 0);
    // ChunkedLocalAttentionManager.get_num_skipped_tokens: chunk 8 -> 13: 8, 8: 8, 7: 0.
    let c = chunked(8, 4);
    assert_eq!(
        [
            c.num_skipped_tokens(13),
            c.num_skipped_tokens(8),
            c.num_skipped_tokens(7)
        ],
        [8, 8, 0]
    );
    assert_eq!(
        GroupSpec::new(AttentionKind::Full, 4).num_skipped_tokens(99),
        0
    );
}

#[test]
fn extra_retained_tokens_hold_the_window_longer_and_raise_its_cap() {
    // Multi-module MTP's window (vLLM tags it with num_prefill_lookahead - 1 = 3): the
    // skipped tokens start 3 later, the admission cap counts them, the lookup does not.
    let mtp = GroupSpec::new(
        AttentionKind::SlidingWindow {
            sliding_window: 4,
            extra_retained_tokens: 3,
        },
        4,
    );
    assert_eq!(mtp.num_skipped_tokens(7), 1); // 7 + 1 - 4 - 3
    assert_eq!(mtp.num_skipped_tokens(6), 0);
    // ceil(min(4 - 1 + 3 + 8, 100) / 4) + 1 = 5 (without the extra tokens: 4).
    assert_eq!(mtp.max_admission_blocks(8, 100), Some(5));
    assert_eq!(swa(4, 4).max_admission_blocks(8, 100), Some(4));
    let huge = AttentionKind::SlidingWindow {
        sliding_window: u32::MAX,
        extra_retained_tokens: 1,
    };
    assert!(GroupSpec::new(huge, 4).check().is_err());
}

// --- find_longest_cache_hit ---

#[test]
fn sliding_window_hit_is_the_rightmost_window_with_nulls_before() {
    // SlidingWindowManager.find_longest_cache_hit, block 4, window 8: ceil(7 / 4) = 2 blocks
    // in a row; only positions 2 and 3 cached -> [NULL, NULL, b2, b3] (its docstring example).
    let mut p = Pool::new(10, true, false).unwrap();
    let b = cache_at(&mut p, &[2, 3], 0);
    assert_eq!(
        lookup(swa(8, 4), &p, 4, 16, 4),
        (vec![N, N, b[0], b[1]], 16)
    );
    // max_length 15 -> 3 blocks at most: position 2 alone is no window, and the run from 0
    // is empty: no hit.
    assert_eq!(lookup(swa(8, 4), &p, 4, 15, 4), (vec![], 0));
}

#[test]
fn sliding_window_takes_the_first_run_from_the_right() {
    // Cached 0, 1, 3 (2 missing): from the right, 3 is a run of 1, 2 breaks it, 1-0 is a
    // run of 2 -> the hit ends after block 1 (vLLM trims past i + run).
    let mut p = Pool::new(10, true, false).unwrap();
    let b = cache_at(&mut p, &[0, 1, 3], 0);
    assert_eq!(lookup(swa(8, 4), &p, 4, 16, 4), (vec![b[0], b[1]], 8));
}

#[test]
fn sliding_window_hit_shorter_than_the_window() {
    // Cached 0 and 2 only: no run of 2; the run that reaches block 0 (length 1) is a hit
    // all the same (vLLM: "The first num_contiguous_blocks is a cache hit even if ...").
    let mut p = Pool::new(10, true, false).unwrap();
    let b = cache_at(&mut p, &[0, 2], 0);
    assert_eq!(lookup(swa(8, 4), &p, 4, 16, 4), (vec![b[0]], 4));
}

#[test]
fn sliding_window_runs_end_on_the_alignment() {
    // Alignment 8 (scheduler block size) over 4-token blocks: a run may only end where
    // (i + 1) * 4 % 8 == 0. Cached 0, 1, 2: block 2 would end at 12 -> skipped; the run
    // 1-0 ends at 8 -> hit [b0, b1].
    let mut p = Pool::new(10, true, false).unwrap();
    let b = cache_at(&mut p, &[0, 1, 2], 0);
    assert_eq!(lookup(swa(8, 4), &p, 4, 16, 8), (vec![b[0], b[1]], 8));
    // Window 16 needs 4 blocks in a row: none found; the aligned run from block 0 (2
    // blocks, 8 tokens) is the hit, shorter than the window.
    assert_eq!(lookup(swa(16, 4), &p, 4, 16, 8), (vec![b[0], b[1]], 8));
}

#[test]
fn chunked_local_hit_marks_earlier_chunks_as_null() {
    // ChunkedLocalAttentionManager.find_longest_cache_hit docstring, chunk 8, block 4:
    // max_length 15: blocks 0-1 (the chunk before) are null, block 2 looked up.
    let mut p = Pool::new(10, true, false).unwrap();
    assert_eq!(lookup(chunked(8, 4), &p, 4, 15, 4), (vec![N, N], 8));
    let b = cache_at(&mut p, &[2], 0);
    assert_eq!(lookup(chunked(8, 4), &p, 4, 15, 4), (vec![N, N, b[0]], 12));
    // max_length 16: all four blocks precede the next token's chunk: 16 tokens, no lookup.
    assert_eq!(lookup(chunked(8, 4), &p, 4, 16, 4), (vec![N; 4], 16));
    // vLLM asserts block size == alignment for chunked local attention.
    let ks = keys(4);
    assert!(find_longest_cache_hit(&chunked(8, 4), &[0], &p, &mut &ks[..], 4, 16, 8).is_err());
}

#[test]
fn full_attention_hit_rounds_down_to_the_alignment() {
    // FullAttentionManager.find_longest_cache_hit: 3 cached blocks (12 tokens) at alignment
    // 8 -> 8 tokens, 2 blocks.
    let mut p = Pool::new(10, true, false).unwrap();
    let b = cache_at(&mut p, &[0, 1, 2], 0);
    let full = GroupSpec::new(AttentionKind::Full, 4);
    assert_eq!(lookup(full, &p, 4, 16, 4), (b.clone(), 12));
    assert_eq!(lookup(full, &p, 4, 16, 8), (b[..2].to_vec(), 8));
}

#[test]
fn larger_blocks_read_every_kth_hash() {
    // BlockHashListWithBlockSize: an 8-token block's hash is the hash at its last 4-token
    // boundary (hashes 1, 3, ...).
    let mut p = Pool::new(10, true, false).unwrap();
    let mut b = Vec::new();
    p.get_new_blocks(2, &mut b).unwrap();
    p.insert_hash(b[0], key(1), 8).unwrap();
    p.insert_hash(b[1], key(3), 16).unwrap();
    let full8 = GroupSpec::new(AttentionKind::Full, 8);
    assert_eq!(lookup(full8, &p, 4, 16, 8), (b.clone(), 16));
    // A group lookup needs every member group cached at each position.
    let ks = keys(4);
    let (hit, len) = find_longest_cache_hit(&full8, &[0, 0], &p, &mut &ks[..], 4, 16, 8).unwrap();
    assert_eq!((hit, len), (vec![b.clone(), b], 16));
}

// --- remove_skipped_blocks, free order ---

/// A sliding-window (window 8, block 4) group holding `A` with 16 tokens, all cached.
fn swa_with_16_cached(caching: bool) -> (Pool, GroupManager) {
    let mut p = Pool::new(10, caching, false).unwrap();
    let mut m = GroupManager::new(swa(8, 4), 0, params(4, caching)).unwrap();
    assert_eq!(
        m.allocate_new_blocks(&mut p, A, 16, 16).unwrap(),
        [1, 2, 3, 4]
    );
    let ks = keys(4);
    m.cache_blocks(&mut p, A, 16, Boundaries::default(), &mut &ks[..])
        .unwrap();
    (p, m)
}

#[test]
fn removed_window_blocks_go_to_the_tail_and_stay_cached() {
    // remove_skipped_blocks(13): skipped = 13 - 8 + 1 = 6 tokens -> block 0 becomes the
    // null block; freed with a hash, it joins the free queue's tail (LRU) and still hits.
    let (mut p, mut m) = swa_with_16_cached(true);
    assert_eq!(m.num_cached_blocks(A), Some(4));
    m.remove_skipped_blocks(&mut p, A, 13).unwrap();
    assert_eq!(m.blocks(A), [N, 2, 3, 4]);
    assert_eq!(p.free_queue(), [5, 6, 7, 8, 9, 1]);
    assert_eq!(p.get_cached(&key(0)), Some(1));
    // remove_skipped_blocks(16): 9 skipped -> 2 blocks; the walk back stops at the null.
    m.remove_skipped_blocks(&mut p, A, 16).unwrap();
    assert_eq!(m.blocks(A), [N, N, 3, 4]);
    assert_eq!(p.free_queue(), [5, 6, 7, 8, 9, 1, 2]);
    p.check().unwrap();
}

#[test]
fn blocks_removed_together_are_freed_latest_first() {
    // _remove_blocks_in_range walks from the last skipped block back: blocks 1 then 0 are
    // freed in that order -> cached: tail [.., b1, b0]; uncached: head [b1, b0, ..].
    let (mut p, mut m) = swa_with_16_cached(true);
    m.remove_skipped_blocks(&mut p, A, 16).unwrap();
    assert_eq!(p.free_queue(), [5, 6, 7, 8, 9, 2, 1]);
    let (mut p, mut m) = swa_with_16_cached(false);
    m.remove_skipped_blocks(&mut p, A, 16).unwrap();
    assert_eq!(m.blocks(A), [N, N, 3, 4]);
    assert_eq!(p.free_queue(), [2, 1, 5, 6, 7, 8, 9]);
}

#[test]
fn free_skips_the_null_prefix_and_pop_trims_it_in_033() {
    // free(): pop_blocks_for_free, then free_blocks(reversed): 4 then 3 to the tail.
    // pop_blocks_for_free: 0.33 trim_null_head drops the nulls, 0.32 returns them.
    let (mut p, mut m) = swa_with_16_cached(true);
    m.remove_skipped_blocks(&mut p, A, 16).unwrap();
    let mut m32 = m.clone();
    assert_eq!(m32.pop_blocks_for_free(A, Release::V032), [N, N, 3, 4]);
    m.free(&mut p, A, Release::V033).unwrap();
    assert_eq!(p.free_queue(), [5, 6, 7, 8, 9, 2, 1, 4, 3]);
    assert_eq!(m.num_requests(), 0);
    p.check().unwrap();
}

// --- get_num_blocks_to_allocate, add_local_computed_blocks ---

#[test]
fn blocks_to_allocate_discounts_skipped_blocks() {
    // get_num_blocks_to_allocate, window 8, block 4, a new request.
    let (mut p, mut m) = swa_with_16_cached(true);
    m.free(&mut p, A, Release::V033).unwrap();
    // Hit [N, N, 3, 4] (both evictable), 16 computed, 20 tokens: required 5, skipped
    // blocks 9 / 4 = 2, local 4 -> 5 - max(2, 4) = 1 new, plus the 2 evictable hits = 3.
    let hit = [N, N, 3, 4];
    assert_eq!(
        m.num_blocks_to_allocate(&p, B, 20, &hit, 16, false)
            .unwrap(),
        3
    );
    // No hit, 32 tokens computed elsewhere, 40 wanted: 10 required, 25 skipped tokens ->
    // 6 blocks dominate: 4.
    assert_eq!(
        m.num_blocks_to_allocate(&p, B, 40, &[], 32, false).unwrap(),
        4
    );
    // The admission cap: ceil(min(8 - 1 + 16, 1000) / 4) + 1 = 7 of the 25 blocks wanted.
    assert_eq!(
        m.num_blocks_to_allocate(&p, B, 100, &[], 0, true).unwrap(),
        7
    );
    assert_eq!(
        m.num_blocks_to_allocate(&p, B, 100, &[], 0, false).unwrap(),
        25
    );
}

#[test]
fn adopting_a_window_hit_pads_nulls_and_touches_the_rest() {
    // add_local_computed_blocks(hit [N, N, 3, 4], 16 local): 2 skipped blocks -> nulls,
    // 3 and 4 touched (out of the free queue), the request tracked at 4 cached blocks.
    let (mut p, mut m) = swa_with_16_cached(true);
    m.free(&mut p, A, Release::V033).unwrap();
    m.add_local_computed_blocks(&mut p, B, &[N, N, 3, 4], 16)
        .unwrap();
    assert_eq!(m.blocks(B), [N, N, 3, 4]);
    assert_eq!(m.num_cached_blocks(B), Some(4));
    assert_eq!((p.ref_cnt(3), p.ref_cnt(4)), (1, 1));
    assert_eq!(p.free_queue(), [5, 6, 7, 8, 9, 2, 1]);
    // Running: a further count is required - held, no hit allowed.
    assert_eq!(
        m.num_blocks_to_allocate(&p, B, 24, &[], 16, false).unwrap(),
        2
    );
    assert!(m
        .num_blocks_to_allocate(&p, B, 24, &[1], 16, false)
        .is_err());
}

// --- cache_blocks with the sliding window's reachable_block_mask ---

#[test]
fn sliding_window_caches_only_reachable_blocks() {
    // reachable_block_mask (dense): alignment 16 over 4-token blocks -> 4 per segment;
    // window 5 needs ceil(4 / 4) = 1 block -> only blocks i % 4 == 3 are cached. One
    // BlockStored covers the range all the same.
    let mut p = Pool::new(12, true, true).unwrap();
    let mut m = GroupManager::new(swa(5, 4), 0, params(16, true)).unwrap();
    let blocks = m.allocate_new_blocks(&mut p, A, 32, 32).unwrap();
    let ks = keys(8);
    m.cache_blocks(&mut p, A, 32, Boundaries::default(), &mut &ks[..])
        .unwrap();
    let cached: Vec<u32> = blocks
        .iter()
        .filter(|&&b| p.hash_of(b).is_some())
        .copied()
        .collect();
    assert_eq!(cached, [blocks[3], blocks[7]]);
    assert_eq!(p.hashed_tokens(blocks[7]), Some(32));
    assert_eq!(m.num_cached_blocks(A), Some(8));
    assert_eq!(p.take_events(), [Event::Stored { first: 0, end: 8 }]);
    // A window that needs a whole segment caches every block: window 14 needs
    // ceil(13 / 4) = 4 blocks, the 4 of a segment.
    let mut p = Pool::new(12, true, false).unwrap();
    let mut m = GroupManager::new(swa(14, 4), 0, params(16, true)).unwrap();
    let blocks = m.allocate_new_blocks(&mut p, A, 32, 32).unwrap();
    m.cache_blocks(&mut p, A, 32, Boundaries::default(), &mut &ks[..])
        .unwrap();
    assert!(blocks.iter().all(|&b| p.hash_of(b).is_some()));
}

#[test]
fn a_grouped_pool_logs_the_positions_really_cached_with_the_group() {
    // vLLM's BlockStored for group 1 lists only the hashes it cached (blocks 3 and 7 of the
    // range 0..8), with group_idx 1.
    let mut p = Pool::new_grouped(12, true, true, 2).unwrap();
    let mut m = GroupManager::new(swa(5, 4), 1, params(16, true)).unwrap();
    m.allocate_new_blocks(&mut p, A, 32, 32).unwrap();
    let ks = keys(8);
    m.cache_blocks(&mut p, A, 32, Boundaries::default(), &mut &ks[..])
        .unwrap();
    assert_eq!(
        p.take_events(),
        [Event::StoredIn {
            group: 1,
            first: 0,
            end: 8,
            cached: vec![3, 7]
        }]
    );
}

#[test]
fn cache_blocks_skips_null_blocks_and_nothing_full_leaves_the_request_untracked() {
    // cache_blocks -> cache_full_blocks skips null blocks. Fewer tokens than a block: vLLM
    // returns before setting num_cached_block, so the request stays untracked.
    let mut p = Pool::new(10, true, false).unwrap();
    let mut m = GroupManager::new(swa(4, 4), 0, params(4, true)).unwrap();
    m.allocate_new_blocks(&mut p, A, 3, 3).unwrap();
    let ks = keys(2);
    m.cache_blocks(&mut p, A, 3, Boundaries::default(), &mut &ks[..])
        .unwrap();
    assert_eq!(m.num_cached_blocks(A), None);
    m.allocate_new_blocks(&mut p, A, 8, 8).unwrap();
    m.remove_skipped_blocks(&mut p, A, 7).unwrap(); // 7 - 4 + 1 = 4 skipped: block 0
    assert_eq!(m.blocks(A), [N, 2]);
    m.cache_blocks(&mut p, A, 8, Boundaries::default(), &mut &ks[..])
        .unwrap();
    assert_eq!(m.num_cached_blocks(A), Some(2));
    assert_eq!(p.get_cached(&key(0)), None);
    assert_eq!(p.get_cached(&key(1)), Some(2));
    p.check().unwrap();
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let p = Pool::new(4, true, false).unwrap();
    let ks = keys(4);
    let full = GroupSpec::new(AttentionKind::Full, 4);
    // Zero alignment, zero or non-dividing hash block, zero block size or window.
    assert!(find_longest_cache_hit(&full, &[0], &p, &mut &ks[..], 4, 16, 0).is_err());
    assert!(find_longest_cache_hit(&full, &[0], &p, &mut &ks[..], 0, 16, 4).is_err());
    assert!(find_longest_cache_hit(&full, &[0], &p, &mut &ks[..], 3, 16, 4).is_err());
    let zero = GroupSpec::new(AttentionKind::Full, 0);
    assert!(find_longest_cache_hit(&zero, &[0], &p, &mut &ks[..], 4, 16, 4).is_err());
    assert!(find_longest_cache_hit(&swa(0, 4), &[0], &p, &mut &ks[..], 4, 16, 4).is_err());
    assert!(GroupManager::new(chunked(0, 4), 0, params(4, true)).is_err());
    assert!(GroupManager::new(swa(8, 6), 0, params(12, true)).is_err());
    // A window group whose blocks do not divide the scheduler block.
    assert!(GroupManager::new(swa(8, 8), 0, params(4, true)).is_err());
}
