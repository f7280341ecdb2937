//! The walk over two KV cache groups (the test engine over the core's hybrid coordinator,
//! [`Hybrid`]: a full-attention group of 4-token blocks and a sliding window of 8 tokens in
//! 8-token blocks): the rows carry each group's block ids as vLLM's `schedule()` reads them
//! (`get_blocks(...).get_block_ids()` for an admission, `allocate_slots(...)
//! .get_block_ids(allow_none=True)` for a running row), worked out by hand from vLLM's
//! `HybridKVCacheCoordinator` (group by group, blocks that left the window freed first).

use super::*;
use crate::vllm_v1::coordinator::HybridConfig;
use crate::vllm_v1::single_type::{AttentionKind, GroupSpec};
use crate::vllm_v1::single_type_tests::swa;

/// `num_blocks` blocks (block 0 is the null block), caching off.
fn two_groups(num_blocks: u32, budget: u64) -> TestEngine<Hybrid> {
    let cfg = HybridConfig {
        num_blocks,
        groups: vec![GroupSpec::new(AttentionKind::Full, 4), swa(8, 8)],
        hash_block_size: 4,
        scheduler_block_size: 8,
        max_model_len: 1 << 20,
        max_in_flight_tokens: 1 << 20,
        enable_caching: false,
        enable_events: false,
        watermark_blocks: 0,
        release: V33,
        retention: crate::vllm_v1::retention::Retention::Dense,
        use_eagle: false,
        eagle_groups: Vec::new(),
        hash_lookahead_tokens: 0,
    };
    TestEngine::with_kv(Hybrid::new(cfg).unwrap(), budget)
}

/// The block ids the last `schedule()` gave request `r`'s row.
fn row_blocks<K: TestKv>(e: &TestEngine<K>, r: usize) -> Option<K::Blocks> {
    let row = e
        .tables
        .iter()
        .find(|(x, _)| *x == r)
        .expect("a scheduled row");
    row.1.clone()
}

#[test]
fn an_admission_carries_every_groups_table() {
    let mut e = two_groups(40, 100);
    let a = e.add(10, 20);
    assert_eq!(e.schedule(sync(V33)), vec![(a, 10)]);
    // 10 tokens: 3 blocks of 4 in the full group, then 2 of 8 in the window's.
    assert_eq!(row_blocks(&e, a), Some(vec![vec![1, 2, 3], vec![4, 5]]));
}

#[test]
fn a_running_row_carries_each_groups_new_blocks_none_when_no_group_has_one() {
    let mut e = two_groups(40, 100);
    let a = e.add(10, 20);
    e.step(sync(V33), 50);
    let mut seen = Vec::new();
    for _ in 0..6 {
        e.step(sync(V33), 50);
        seen.push(row_blocks(&e, a));
    }
    // Slots for 11, 12, 13, ... 16 tokens: the full group grows at 13 (block 6), the
    // window's group (8-token blocks) not before 17; an empty group stays in the row.
    let grows = Some(vec![vec![6], vec![]]);
    assert_eq!(seen, [None, None, grows, None, None, None]);
    // 17 slots: the window's first block (tokens 0-7) left the window (vLLM frees it,
    // uncached, at the queue's head, before allocating): the full group takes it back.
    e.step(sync(V33), 50);
    assert_eq!(row_blocks(&e, a), Some(vec![vec![4], vec![7]]));
    assert_eq!(e.mgr.blocks("r0"), [vec![1, 2, 3, 6, 4], vec![0, 5, 7]]);
}

#[test]
fn a_preempted_request_resumes_with_every_groups_table() {
    // 6 usable blocks: two prompts of 8 take 2 + 1 each; the first decode needs 2 more.
    let mut e = two_groups(7, 100);
    let a = e.add(8, 3);
    let b = e.add(8, 20);
    e.step(sync(V33), 50);
    assert_eq!(e.schedule(sync(V33)), vec![(a, 1)]);
    assert_eq!(e.r(b).status, Status::Preempted);
    assert_eq!(e.mgr.blocks("r1"), [Vec::<u32>::new(), vec![]]);
    e.next.insert(a, vec![50]);
    e.update(sync(V33));
    for _ in 0..3 {
        if e.r(a).status != Status::Finished {
            e.step(sync(V33), 50);
        }
    }
    assert_eq!(e.r(a).status, Status::Finished);
    assert_eq!(e.schedule(sync(V33)), vec![(b, 9)]);
    // Resumed with its 9 tokens (8 prompt, 1 output): 3 blocks of 4 and 2 of 8.
    let table = row_blocks(&e, b).expect("a resumed row carries its table");
    assert_eq!(table.iter().map(Vec::len).collect::<Vec<_>>(), [3, 2]);
    assert_eq!(Some(table), Some(e.mgr.blocks("r1")));
}
