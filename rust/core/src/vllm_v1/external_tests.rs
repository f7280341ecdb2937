//! The one-group manager with a KV connector's external tokens (vLLM's
//! `num_external_computed_tokens`), vLLM's behaviour written out by hand: a first allocation
//! adopts the local hit, takes blocks for the connector's tokens, then the call's own new
//! blocks, and returns only the last; a running request's external tokens only count.

use super::*;
use crate::error::Error;

fn key(i: u32) -> HashKey {
    HashKey::new(&[i as u8, (i >> 8) as u8, 9, 9, 9, 9, 9, 9]).unwrap()
}

fn mgr(num_blocks: u32) -> Manager {
    Manager::new(Config {
        num_blocks,
        block_size: 4,
        max_model_len: 64,
        enable_caching: true,
        enable_events: true,
        watermark_blocks: 0,
    })
    .unwrap()
}

/// A waiting request of `num_tokens` tokens adopting `hit` and `ext` external tokens, with
/// `new` tokens to compute.
fn first<'a>(num_tokens: u64, hit: &'a [u32], ext: u64, new: u64) -> SlotRequest<'a> {
    SlotRequest {
        num_tokens,
        waiting_or_preempted: true,
        num_new_tokens: new,
        num_new_computed_tokens: hit.len() as u64 * 4,
        new_computed: Some(hit),
        num_external_computed_tokens: ext,
        ..Default::default()
    }
}

#[test]
fn external_tokens_get_blocks_the_call_does_not_return() {
    let mut m = mgr(12);
    let keys: Vec<HashKey> = (0..6).map(key).collect();
    m.allocate_slots("a", &first(8, &[], 0, 8), &mut &keys[..2])
        .unwrap()
        .unwrap(); // blocks 1, 2, cached
    let hit = m.longest_cache_hit(&mut &keys[..], 5).unwrap();
    assert_eq!(hit, [1, 2]);
    // 8 local tokens, 10 from the connector, 3 to compute: 21 tokens, 6 blocks.
    let new = m
        .allocate_slots("b", &first(21, &hit, 10, 3), &mut &keys[..5])
        .unwrap()
        .unwrap();
    assert_eq!(m.blocks("b"), [1, 2, 3, 4, 5, 6]);
    assert_eq!(new, [6], "the connector's blocks 3-5 are not the call's");
    // Cached up to the local, external and new tokens: 21 tokens fill 5 blocks.
    assert_eq!(m.num_cached_blocks("b"), Some(5));
    m.check(|_| 0).unwrap();
}

#[test]
fn a_delayed_load_caches_nothing_until_cache_blocks() {
    let mut m = mgr(12);
    let keys: Vec<HashKey> = (0..4).map(key).collect();
    // An async load: the connector's 12 tokens and no token to compute.
    let a = SlotRequest {
        delay_cache_blocks: true,
        ..first(16, &[], 12, 0)
    };
    let new = m.allocate_slots("a", &a, &mut &keys[..]).unwrap().unwrap();
    assert!(new.is_empty());
    assert_eq!(m.blocks("a"), [1, 2, 3]);
    assert_eq!(
        m.num_cached_blocks("a"),
        Some(0),
        "tracked from the first allocation"
    );
    assert!(m.pool().hash_of(1).is_none());
    // The load finished: vLLM's scheduler caches the loaded tokens.
    m.cache_blocks("a", 12, &mut &keys[..]).unwrap();
    assert_eq!(m.num_cached_blocks("a"), Some(3));
    assert_eq!(m.longest_cache_hit(&mut &keys[..], 4).unwrap(), [1, 2, 3]);
    m.check(|_| 0).unwrap();
}

#[test]
fn a_running_requests_external_tokens_only_count() {
    let mut m = mgr(12);
    let keys: Vec<HashKey> = (0..4).map(key).collect();
    m.allocate_slots("a", &first(16, &[], 0, 4), &mut &keys[..1])
        .unwrap()
        .unwrap();
    let running: SlotRequest = SlotRequest {
        num_computed_tokens: 4,
        num_tokens: 16,
        num_new_tokens: 4,
        num_external_computed_tokens: 4,
        ..Default::default()
    };
    let new = m
        .allocate_slots("a", &running, &mut &keys[..3])
        .unwrap()
        .unwrap();
    assert_eq!(new, [2, 3], "12 tokens need 3 blocks, all returned");
    assert_eq!(m.num_cached_blocks("a"), Some(3));
}

#[test]
fn the_fit_check_counts_the_connectors_blocks() {
    let mut m = mgr(5); // 4 free blocks
    let keys: Vec<HashKey> = (0..5).map(key).collect();
    assert_eq!(
        m.allocate_slots("a", &first(20, &[], 16, 1), &mut &keys[..])
            .unwrap(),
        None
    );
    assert_eq!(m.num_requests(), 0);
    assert_eq!(m.pool().num_free(), 4);
    let new = m
        .allocate_slots("a", &first(16, &[], 12, 4), &mut &keys[..])
        .unwrap()
        .unwrap();
    assert_eq!(new, [4], "blocks 1-3 hold the connector's 12 tokens");
}

#[test]
fn external_tokens_vllm_cannot_take_are_refused_and_change_nothing() {
    let mut m = mgr(12);
    let keys: Vec<HashKey> = (0..4).map(key).collect();
    let before = m.pool().free_queue();
    let past_max_len = first(70, &[], 65, 4);
    assert!(matches!(
        m.allocate_slots("a", &past_max_len, &mut &keys[..]),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(m.pool().free_queue(), before);
    assert_eq!(m.num_requests(), 0);
    let mut off = Manager::new(Config {
        enable_caching: false,
        ..*m.config()
    })
    .unwrap();
    let plain = SlotRequest {
        new_computed: None,
        ..first(8, &[], 0, 4)
    };
    off.allocate_slots("a", &plain, &mut &keys[..]).unwrap();
    // Caching off: the request holds blocks vLLM never tracked; vLLM asserts.
    let later = SlotRequest {
        num_computed_tokens: 4,
        new_computed: None,
        ..first(8, &[], 2, 2)
    };
    let free = off.pool().num_free();
    assert!(matches!(
        off.allocate_slots("a", &later, &mut &keys[..]),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(off.pool().num_free(), free);
    assert_eq!(off.blocks("a"), [1]);
}

#[test]
fn only_external_tokens_are_enough_to_allocate() {
    let mut m = mgr(12);
    let load = SlotRequest {
        new_computed: None,
        ..first(8, &[], 5, 0)
    };
    let new = m.allocate_slots("a", &load, &mut &[][..]).unwrap().unwrap();
    assert!(new.is_empty());
    assert_eq!(m.blocks("a"), [1, 2]);
    let nothing = SlotRequest {
        new_computed: None,
        ..first(8, &[], 0, 0)
    };
    assert!(m.allocate_slots("b", &nothing, &mut &[][..]).is_err());
}
