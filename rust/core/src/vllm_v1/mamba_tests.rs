//! Unit tests of Mamba groups (mode "none") in the hybrid coordinator, each expected value
//! worked out by hand from vLLM's `KVCacheCoordinatorNoPrefixCache` over `MambaManager` and
//! the attention managers (`kv_cache_manager.py`'s `allocate_slots`, `free`,
//! `take_new_block_ids`; 0.32 and 0.33 alike).

use super::coordinator::{Count, Hybrid, HybridConfig, HybridSlots};
use super::engine::Release;
use super::pool::{HashKey, NULL_BLOCK};
use super::retention::Retention;
use super::single_type::{AttentionKind, GroupSpec};

const N: u32 = NULL_BLOCK;
/// Without caching no hash is read.
fn no_hashes() -> &'static [HashKey] {
    &[]
}

fn full(bs: u32) -> GroupSpec {
    GroupSpec::new(AttentionKind::Full, bs)
}

fn mamba(bs: u32, num_speculative_blocks: u32) -> GroupSpec {
    GroupSpec::new(
        AttentionKind::Mamba {
            num_speculative_blocks,
        },
        bs,
    )
}

fn config(groups: Vec<GroupSpec>, sbs: u32, caching: bool) -> HybridConfig {
    HybridConfig {
        num_blocks: 20,
        groups,
        // Without caching vLLM hashes at the scheduler block size.
        hash_block_size: sbs,
        scheduler_block_size: sbs,
        max_model_len: 32,
        max_in_flight_tokens: 16,
        enable_caching: caching,
        enable_events: false,
        watermark_blocks: 0,
        release: Release::V033,
        retention: Retention::Dense,
        use_eagle: false,
        eagle_groups: Vec::new(),
        hash_lookahead_tokens: 0,
    }
}

/// Granite-4-like: full attention at block 4 and a Mamba group whose one block spans
/// `max_model_len` (32), so the scheduler block size (their lcm) is 32; zeroing on.
fn granite() -> Hybrid {
    Hybrid::new(config(vec![full(4), mamba(32, 0)], 32, false))
        .unwrap()
        .with_zeroing(true)
}

fn step(computed: u64, new: u64, admitting: bool) -> HybridSlots<'static> {
    HybridSlots {
        num_computed_tokens: computed,
        num_tokens: computed + new,
        num_new_tokens: new,
        waiting_or_preempted: admitting,
        ..Default::default()
    }
}

fn alloc(h: &mut Hybrid, req: &str, a: &HybridSlots) -> Option<Vec<Vec<u32>>> {
    h.allocate_slots(req, a, &mut no_hashes()).unwrap()
}

#[test]
fn one_state_block_per_request_beside_attention_blocks() {
    let mut h = granite();
    // 10 tokens: ceil(10/4) = 3 full-attention blocks, ceil(10/32) = 1 state block.
    assert_eq!(
        alloc(&mut h, "a", &step(0, 10, true)),
        Some(vec![vec![1, 2, 3], vec![4]])
    );
    // Decode to 13 tokens: a fourth attention block; the state block stays (skipping 12
    // tokens of a 32-token block frees nothing).
    assert_eq!(
        alloc(&mut h, "a", &step(10, 3, false)),
        Some(vec![vec![5], vec![]])
    );
    assert_eq!(h.blocks("a"), vec![vec![1, 2, 3, 5], vec![4]]);
    h.check().unwrap();
}

#[test]
fn only_attention_blocks_are_zeroed_drained_per_step() {
    let mut h = granite();
    alloc(&mut h, "a", &step(0, 10, true));
    alloc(&mut h, "b", &step(0, 3, true));
    // Group 0's blocks in allocation order ("a" then "b"); group 1 (Mamba) records none.
    assert_eq!(h.take_new_block_ids(), vec![1, 2, 3, 5]);
    assert!(h.take_new_block_ids().is_empty());
    // Without zeroing nothing is recorded.
    let mut plain = Hybrid::new(config(vec![full(4), mamba(32, 0)], 32, false)).unwrap();
    alloc(&mut plain, "a", &step(0, 10, true));
    assert!(plain.take_new_block_ids().is_empty());
}

#[test]
fn free_returns_attention_then_state_blocks_last_first() {
    let mut h = granite();
    alloc(&mut h, "a", &step(0, 13, true));
    h.free("a").unwrap();
    // "a" held [1, 2, 3, 4] and [5]. Uncached blocks rejoin at the head, group by group,
    // each table last block first: 4, 3, 2, 1 go in front, then 5 in front of them.
    assert_eq!(
        alloc(&mut h, "b", &step(0, 4, true)),
        Some(vec![vec![5], vec![4]])
    );
    h.check().unwrap();
}

#[test]
fn speculative_blocks_add_whole_state_blocks() {
    let mut h = Hybrid::new(config(vec![full(4), mamba(32, 2)], 32, false)).unwrap();
    // The Mamba group counts 10 + 2 * 32 tokens: ceil(74 / 32) = 3 blocks.
    assert_eq!(
        h.num_blocks_to_allocate("a", &Count::new(10, 0), None)
            .unwrap(),
        3 + 3
    );
    assert_eq!(
        alloc(&mut h, "a", &step(0, 10, true)),
        Some(vec![vec![1, 2, 3], vec![4, 5, 6]])
    );
}

#[test]
fn a_small_state_block_frees_all_but_the_last_tokens_state() {
    // Block size 4 for both (as vLLM's tests build Mamba specs): after 10 computed tokens
    // 9 are skipped, blocks 0 and 1 of the Mamba table go back, the later one first.
    let mut h = Hybrid::new(config(vec![full(4), mamba(4, 0)], 4, false)).unwrap();
    alloc(&mut h, "a", &step(0, 10, true));
    assert_eq!(h.blocks("a"), vec![vec![1, 2, 3], vec![4, 5, 6]]);
    assert_eq!(
        alloc(&mut h, "a", &step(10, 1, false)),
        Some(vec![vec![], vec![]])
    );
    assert_eq!(h.blocks("a"), vec![vec![1, 2, 3], vec![N, N, 6]]);
    h.check().unwrap();
    // The freed (uncached) blocks rejoin at the head, 5 then 4: "b" gets them first.
    assert_eq!(
        alloc(&mut h, "b", &step(0, 1, true)),
        Some(vec![vec![5], vec![4]])
    );
}

#[test]
fn prefix_caching_with_a_mode_none_group_is_refused() {
    // Prefix caching needs the group in mode "align" (AttentionKind::MambaAlign).
    let err = Hybrid::new(config(vec![full(4), mamba(4, 0)], 4, true)).unwrap_err();
    assert!(err.to_string().contains("align"), "{err}");
}

#[test]
fn a_positive_retention_interval_is_allowed_beside_mamba() {
    // vLLM validates the interval when a sliding-window or Mamba group exists.
    let mut cfg = config(vec![full(4), mamba(32, 0)], 32, false);
    cfg.retention = Retention::from_interval(Some(64), 32, true).unwrap();
    assert!(Hybrid::new(cfg).is_ok());
}

#[test]
fn without_caching_no_hit_is_looked_up() {
    let h = granite();
    let hit = h.find_longest_cache_hit(&mut no_hashes(), 31).unwrap();
    assert_eq!(hit.blocks, vec![Vec::<u32>::new(), vec![]]);
    assert_eq!(hit.num_tokens, 0);
}
