//! vLLM v1 manager (`pagedkv_core::vllm_v1`): memory per block with every block cached, measured
//! with a counting allocator and checked against `Manager::heap_bytes` (what
//! `V1Manager.heap_bytes()` reports and tests/vllm_v1/test_memory.py compares with vLLM's
//! `KVCacheBlock`). One test only: the counter is process-wide. `--nocapture` prints the numbers.

use pagedkv_core::vllm_v1::{Config, HashKey, Manager, SlotRequest};

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

/// Every block but the null block and a partial request's worth cached, then freed.
fn fill_with_cached_blocks(m: &mut Manager, num_blocks: u32) -> u32 {
    let reqs = (num_blocks - 1) / PER_REQ;
    for r in 0..reqs {
        let keys: Vec<HashKey> = (0..PER_REQ).map(|i| key(r * PER_REQ + i)).collect();
        let n = (PER_REQ * BLOCK) as u64;
        let a: SlotRequest = SlotRequest {
            num_tokens: n,
            num_new_tokens: n,
            has_scheduled_reqs: true,
            ..Default::default()
        };
        let id = format!("r{r}");
        m.allocate_slots(&id, &a, &mut keys.as_slice())
            .unwrap()
            .unwrap();
        m.free(&id).unwrap();
    }
    reqs * PER_REQ
}

#[test]
fn bytes_per_cached_block() {
    for num_blocks in [24_576u32, 131_072] {
        let before = common::live_bytes();
        let mut m = Manager::new(Config {
            num_blocks,
            block_size: BLOCK,
            max_model_len: 1 << 20,
            enable_caching: true,
            enable_events: false,
            watermark_blocks: 0,
        })
        .unwrap();
        let cached = fill_with_cached_blocks(&mut m, num_blocks);
        assert_eq!(m.pool().num_cached_hashes(), cached as usize);
        let measured = common::live_bytes() - before;
        let accounted = m.heap_bytes();
        let per_block = measured as f64 / num_blocks as f64;
        println!(
            "v1 pool of {num_blocks} blocks, {cached} cached: {per_block:.1} B/block measured, {:.1} accounted",
            accounted as f64 / num_blocks as f64
        );
        assert!(
            measured.abs_diff(accounted) * 100 <= measured,
            "{measured} vs {accounted}"
        );
        assert!(per_block <= 64.0, "{per_block} B per block");
    }
}
