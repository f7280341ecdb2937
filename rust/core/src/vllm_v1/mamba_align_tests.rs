//! Unit tests of Mamba groups in mode "align" (prefix caching on) in the hybrid coordinator,
//! each expected value worked out by hand from vLLM's `MambaManager` align branches under its
//! `HybridKVCacheCoordinator` (0.32 and 0.33 alike unless said). Full attention at block 4
//! beside a Mamba group at block 4 (hash and scheduler block 4), 20 blocks.

use super::coordinator::{Count, Hybrid, HybridConfig, HybridSlots};
use super::engine::Release;
use super::mamba_align::{checkpoint_position, checkpoint_valid, AlignRules};
use super::pool::{HashKey, NULL_BLOCK};
use super::retention::{Boundaries, Retention};
use super::single_type::{AttentionKind, GroupSpec};
use super::single_type_tests::{full, keys};

const N: u32 = NULL_BLOCK;

fn align(num_speculative_blocks: u32, checkpoint_alignment: u32) -> GroupSpec {
    let kind = AttentionKind::MambaAlign {
        num_speculative_blocks,
        checkpoint_alignment,
    };
    GroupSpec::new(kind, 4)
}

fn config(mamba: GroupSpec) -> HybridConfig {
    HybridConfig {
        num_blocks: 20,
        groups: vec![full(4), mamba],
        hash_block_size: 4,
        scheduler_block_size: 4,
        max_model_len: 64,
        max_in_flight_tokens: 64,
        enable_caching: true,
        enable_events: false,
        watermark_blocks: 0,
        release: Release::V033,
        retention: Retention::Dense,
        use_eagle: false,
        eagle_groups: Vec::new(),
        hash_lookahead_tokens: 0,
    }
}

/// `new` tokens of a request with `computed` done and `total` in all, a 10-token prompt.
fn slots(computed: u64, new: u64, total: u64) -> HybridSlots<'static> {
    HybridSlots {
        num_computed_tokens: computed,
        num_tokens: total,
        num_new_tokens: new,
        waiting_or_preempted: computed == 0,
        boundaries: Boundaries {
            num_prompt_tokens: 10,
            shared_prefix_boundary: 0,
        }
        .into(),
        ..Default::default()
    }
}

fn alloc(h: &mut Hybrid, req: &str, a: &HybridSlots, ks: &[HashKey]) -> Option<Vec<Vec<u32>>> {
    h.allocate_slots(req, a, &mut &ks[..]).unwrap()
}

#[test]
fn checkpoint_positions_and_validity_follow_vllms_arithmetic() {
    assert_eq!(checkpoint_position(10, 4, false, 0), 8);
    assert_eq!(checkpoint_position(8, 4, false, 0), 4);
    assert_eq!(checkpoint_position(0, 4, false, 0), 0);
    // The whole prompt in one chunk: the state at 8 is exported inside the chunk.
    assert!(checkpoint_valid(0, 10, 8, 4, 4, 1));
    // A chunk starting off the hash grid, or too short to hold a hash block past its start.
    assert!(!checkpoint_valid(2, 10, 8, 4, 4, 1));
    assert!(checkpoint_valid(4, 9, 8, 4, 4, 1));
    assert!(!checkpoint_valid(4, 8, 4, 4, 4, 1));
    // No alignment (the backend cannot export): never.
    assert!(!checkpoint_valid(0, 10, 8, 4, 4, 0));
}

#[test]
fn a_prefill_reserves_its_checkpoint_then_states_retire_as_decode_passes_them() {
    let ks = keys(4);
    let mut h = Hybrid::new(config(align(0, 1))).unwrap();
    // Full: 3 blocks. Mamba: 3 required, capped at the running state plus the checkpoint.
    assert_eq!(
        h.num_blocks_to_allocate("a", &Count::new(10, 0), None)
            .unwrap(),
        5
    );
    let new = alloc(&mut h, "a", &slots(0, 10, 10), &ks).unwrap();
    // Position 0 is null; 4 is the checkpoint (the state at 8), 5 the running state.
    assert_eq!(new, vec![vec![1, 2, 3], vec![N, 4, 5]]);
    assert_eq!(h.pool().hashed_tokens(4), Some(8));
    // Decode: 10 processed retires positions 0 and 1 (the checkpoint goes back, cached).
    assert_eq!(
        alloc(&mut h, "a", &slots(10, 1, 11), &ks),
        Some(vec![vec![], vec![]])
    );
    assert_eq!(h.blocks("a")[1], vec![N, N, 5]);
    assert!(h.pool().is_free(4) && h.pool().hashed_tokens(4) == Some(8));
    // Token 13 needs a fourth state block; the third is retired one step later.
    alloc(&mut h, "a", &slots(11, 1, 12), &ks).unwrap();
    assert_eq!(
        alloc(&mut h, "a", &slots(12, 1, 13), &ks),
        Some(vec![vec![6], vec![7]])
    );
    alloc(&mut h, "a", &slots(13, 1, 14), &ks).unwrap();
    assert_eq!(h.blocks("a")[1], vec![N, N, N, 7]);
    h.check().unwrap();
}

#[test]
fn a_hit_is_one_state_block_after_nulls_and_waits_a_step_when_cached_this_step() {
    let ks = keys(4);
    let mut h = Hybrid::new(config(align(0, 0))).unwrap();
    alloc(&mut h, "a", &slots(0, 10, 10), &ks).unwrap();
    // Without checkpoints the state at 8 is not kept: only the running state (10) is, and
    // full blocks of the Mamba table at positions 0 and 1 are null, so no Mamba hit.
    let hit = h.find_longest_cache_hit(&mut &ks[..], 9).unwrap();
    assert_eq!(hit.num_tokens, 0);
    // A prompt that is a whole block past a split at 8: "b" computes 0..8 then 8..10.
    let mut h = Hybrid::new(config(align(0, 0))).unwrap();
    alloc(&mut h, "b", &slots(0, 8, 10), &ks).unwrap();
    assert_eq!(h.blocks("b")[1], vec![N, 3]);
    let hit = h.find_longest_cache_hit(&mut &ks[..], 9).unwrap();
    assert_eq!(
        (hit.num_tokens, hit.blocks.clone()),
        (8, vec![vec![1, 2], vec![N, 3]])
    );
    // The state at 8 was cached this step: a request hitting it is put off a step.
    let mut c = slots(0, 2, 10);
    c.num_new_computed_tokens = 8;
    c.new_computed = Some(&hit.blocks);
    assert_eq!(alloc(&mut h, "c", &c, &ks), None);
    h.new_step_starts();
    assert_eq!(alloc(&mut h, "c", &c, &ks), Some(vec![vec![4], vec![5]]));
    assert_eq!(h.blocks("c")[1], vec![N, 3, 5]);
    h.check().unwrap();
}

#[test]
fn speculative_state_blocks_move_to_the_end_when_left_behind() {
    let ks = keys(4);
    let mut h = Hybrid::new(config(align(2, 0))).unwrap();
    // 4 tokens: 1 state block + 2 speculative ones on the first allocation.
    alloc(&mut h, "a", &slots(0, 4, 6), &ks).unwrap();
    assert_eq!(h.blocks("a")[1], vec![2, 3, 4]);
    // 8 tokens: the running state is the block at position 1 (a speculative one until now),
    // and one new block keeps two speculative ones past it.
    alloc(&mut h, "a", &slots(4, 4, 8), &ks).unwrap();
    assert_eq!(h.blocks("a")[1], vec![2, 3, 4, 6]);
    // 16 tokens: position 0 is retired (4 processed); the state jumps to position 3, so the
    // speculative block at 2 (4) is left behind: it moves to the end, position 2 nulled.
    let mut a = slots(8, 8, 16);
    a.num_computed_tokens = 8;
    alloc(&mut h, "a", &a, &ks).unwrap();
    assert_eq!(h.blocks("a")[1], vec![N, 3, N, 6, 4, 9]);
    h.check().unwrap();
}

#[test]
fn align_mode_outside_the_mirrored_scope_is_refused() {
    let mut cfg = config(GroupSpec::new(
        AttentionKind::MambaAlign {
            num_speculative_blocks: 0,
            checkpoint_alignment: 0,
        },
        8,
    ));
    cfg.scheduler_block_size = 8;
    let e = Hybrid::new(cfg).unwrap_err().to_string();
    assert!(e.contains("fine-grained"), "{e}");
    let mut cfg = config(align(0, 0));
    cfg.enable_caching = false;
    assert!(Hybrid::new(cfg).is_err());
}

#[test]
fn checkpoints_follow_eagles_drop_and_the_lookahead_hashes() {
    // vLLM's get_mamba_prefill_checkpoint_position: one token left to recompute (or the
    // lookahead's tokens for the hash); EAGLE's drop sits one unit below the aligned end.
    let rules = |drop_eagle, lookahead| {
        AlignRules::new(&align(0, 1), 4, 4, (drop_eagle, lookahead)).unwrap()
    };
    assert_eq!(rules(false, 0).checkpoint_at(10, 4), 8);
    assert_eq!(rules(false, 1).checkpoint_at(10, 4), 8);
    assert_eq!(rules(false, 3).checkpoint_at(10, 4), 4);
    assert_eq!(rules(true, 0).checkpoint_at(10, 4), 4);
    assert_eq!(rules(true, 0).checkpoint_at(8, 4), 4);
    assert_eq!(rules(false, 0).checkpoint_at(8, 4), 4);
    assert_eq!(rules(true, 0).checkpoint_at(4, 4), 0);
    assert_eq!(rules(false, u64::MAX).checkpoint_at(4, 4), 0);
    // EAGLE beside an align group is served (vLLM sets drop_eagle_checkpoint_block).
    let mut cfg = config(align(0, 1));
    cfg.use_eagle = true;
    Hybrid::new(cfg).unwrap().check().unwrap();
}
