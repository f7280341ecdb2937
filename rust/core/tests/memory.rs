//! Memory per cached block and per running sequence, measured with a counting allocator and
//! checked against the structures' own accounting (`heap_bytes`), which the Python bindings
//! report (`BlockSpaceManager.native_bytes()`, `Scheduler.state_bytes()`) and CI compares
//! with vLLM v1's `KVCacheBlock` (tests/test_memory.py). Run with `--nocapture` for the
//! numbers. One test only: the counter is process-wide.

use pagedkv_core::vllm_042::hash::{HashAlgo, HashExtra, Hasher};
use pagedkv_core::vllm_042::scheduler::{Group, Scheduler, SchedulerConfig, SeqState, Status};
use pagedkv_core::vllm_042::{Manager, ManagerConfig, TokenSeq};

mod common;

#[global_allocator]
static ALLOC: common::Counting = common::Counting;

const H: Hasher = Hasher {
    algo: HashAlgo::Xxh3,
    seed: 7,
};

fn manager(gpu: u32, caching: bool) -> Manager {
    Manager::new(ManagerConfig {
        block_size: 16,
        num_gpu_blocks: gpu,
        num_cpu_blocks: 0,
        watermark: 0.0,
        sliding_window: None,
        enable_caching: caching,
        strict: false,
        hasher: H,
    })
    .unwrap()
}

fn close(measured: usize, accounted: usize) -> bool {
    measured.abs_diff(accounted) * 100 <= measured.max(1) // within 1%
}

#[test]
fn bytes_per_cached_block_and_per_running_sequence() {
    for (gpu, caching) in [
        (24_576, true),
        (65_536, true),
        (262_144, true),
        (65_536, false),
    ] {
        let before = common::live_bytes();
        let m = manager(gpu, caching);
        let measured = common::live_bytes() - before;
        let accounted = m.pool_heap_bytes();
        println!(
            "pool of {gpu} blocks, caching {caching}: {:.1} B/block measured, {:.1} accounted",
            measured as f64 / gpu as f64,
            accounted as f64 / gpu as f64
        );
        assert!(close(measured, accounted), "{measured} vs {accounted}");
        drop(m);
    }

    // Per running sequence: the manager's table (2,048-token prompts: 128 blocks) and the
    // scheduler's group, for 1,000 single-sequence requests.
    let n = 1_000u64;
    let seqs: Vec<TokenSeq> = (0..n)
        .map(|i| {
            let toks: Vec<u32> = (0..2048).map(|t| (t * 7 + i as u32) % 32_000).collect();
            TokenSeq::new(16, &toks, HashExtra::default(), H).unwrap()
        })
        .collect();
    let mut m = manager(200_000, true);
    let mut s = Scheduler::new(SchedulerConfig {
        max_num_batched_tokens: 4096,
        max_num_seqs: 1024,
        max_model_len: 4096,
        num_lookahead_slots: 0,
        delay_factor: 0.0,
        chunked_prefill: false,
        max_loras: None,
        preemption_mode: None,
    })
    .unwrap();
    let before = common::live_bytes();
    for (i, seq) in seqs.iter().enumerate() {
        m.allocate(&[(i as u64, seq)]).unwrap();
    }
    let tables = common::live_bytes() - before;
    assert!(
        close(tables, m.tables_heap_bytes()),
        "{tables} vs {}",
        m.tables_heap_bytes()
    );
    let before = common::live_bytes();
    for i in 0..n {
        let mut g = Group::new(&format!("request-{i}"), i as f64, 0, 1, false);
        g.seqs.push(SeqState {
            id: i,
            status: Status::Waiting, // queued as a new request; the state is the same size
            decode: false,
            num_computed: 0,
        });
        g.num_seqs = 1;
        s.add_group(g).unwrap();
    }
    let sched = common::live_bytes() - before;
    println!(
        "per running sequence: manager table {:.1} B ({} blocks of 4 B + entry), scheduler {:.1} B \
         (accounted {:.1})",
        tables as f64 / n as f64,
        seqs[0].num_blocks(),
        sched as f64 / n as f64,
        s.heap_bytes() as f64 / n as f64
    );
    // the scheduler's queues and index grow by doubling: within 2x of what they hold
    assert!(s.heap_bytes() <= sched * 2 && sched <= s.heap_bytes() * 2);
}
