//! vLLM v1 hybrid coordinator (`pagedkv_core::vllm_v1::coordinator::Hybrid`): memory per block
//! with every block cached, measured with a counting allocator and checked against
//! `Hybrid::heap_bytes` (what `V1Hybrid.heap_bytes()` reports and the bench's hybrid memory
//! line, `pagedkv.bench.vllm_v1.manager_costs.memory_per_cached_block`, compares with vLLM's
//! `KVCacheBlock`). One test only: the counter is process-wide. `--nocapture` prints the
//! numbers.

use pagedkv_core::vllm_v1::coordinator::{Hybrid, HybridConfig, HybridSlots};
use pagedkv_core::vllm_v1::single_type::{AttentionKind, GroupSpec};
use pagedkv_core::vllm_v1::{HashKey, Release};

mod common;

#[global_allocator]
static ALLOC: common::Counting = common::Counting;

const BLOCK: u32 = 16;
const PER_REQ: u32 = 256;

fn key(i: u32) -> HashKey {
    let mut b = [0u8; 32];
    b[..4].copy_from_slice(&i.to_le_bytes());
    b[31] = 1;
    HashKey::new(&b).unwrap()
}

/// GPT-OSS-like (a 128-token window, full attention) and Gemma-3-like (five 1,024-token
/// windows to one full group) groups, as the bench's layouts group them.
fn layouts() -> Vec<(&'static str, Vec<GroupSpec>)> {
    let full = GroupSpec::new(AttentionKind::Full, BLOCK);
    let swa = |w| {
        GroupSpec::new(
            AttentionKind::SlidingWindow {
                sliding_window: w,
                extra_retained_tokens: 0,
            },
            BLOCK,
        )
    };
    vec![
        ("gptoss", vec![swa(128), full]),
        ("gemma3", [vec![swa(1024); 5], vec![full]].concat()),
    ]
}

/// Every block but the null block and a remainder cached in every group, then freed.
fn fill_with_cached_blocks(h: &mut Hybrid, num_blocks: u32, groups: u32) -> u32 {
    let reqs = (num_blocks - 1) / (PER_REQ * groups);
    for r in 0..reqs {
        let keys: Vec<HashKey> = (0..PER_REQ).map(|i| key(r * PER_REQ + i)).collect();
        let n = u64::from(PER_REQ * BLOCK);
        let a = HybridSlots {
            num_tokens: n,
            num_new_tokens: n,
            waiting_or_preempted: true,
            has_scheduled_reqs: true,
            ..Default::default()
        };
        let id = format!("r{r}");
        h.allocate_slots(&id, &a, &mut keys.as_slice())
            .unwrap()
            .unwrap();
        h.free(&id).unwrap();
    }
    reqs * PER_REQ * groups
}

#[test]
fn bytes_per_cached_block() {
    for (name, groups) in layouts() {
        let n = groups.len() as u32;
        let num_blocks = 24_576 * n;
        let before = common::live_bytes();
        let mut h = Hybrid::new(HybridConfig {
            num_blocks,
            groups,
            hash_block_size: BLOCK,
            scheduler_block_size: BLOCK,
            max_model_len: 1 << 20,
            max_in_flight_tokens: 1 << 20,
            enable_caching: true,
            enable_events: false,
            watermark_blocks: 0,
            release: Release::V033,
            // dense: every full block cached, the most memory per request
            retention: pagedkv_core::vllm_v1::retention::Retention::Dense,
            use_eagle: false,
            eagle_groups: Vec::new(),
            hash_lookahead_tokens: 0,
        })
        .unwrap();
        let cached = fill_with_cached_blocks(&mut h, num_blocks, n);
        assert_eq!(h.pool().num_cached_hashes(), cached as usize, "{name}");
        let measured = common::live_bytes() - before;
        let accounted = h.heap_bytes();
        let per_block = measured as f64 / f64::from(num_blocks);
        println!(
            "{name}: v1 hybrid pool of {num_blocks} blocks ({n} groups), {cached} cached: \
             {per_block:.1} B/block measured, {:.1} accounted",
            accounted as f64 / f64::from(num_blocks)
        );
        assert!(
            measured.abs_diff(accounted) * 100 <= measured,
            "{name}: {measured} vs {accounted}"
        );
        assert!(per_block <= 80.0, "{name}: {per_block} B per block");
    }
}
