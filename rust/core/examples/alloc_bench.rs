use pagedkv_core::*;
use std::time::Instant;
fn main() {
    let h = Hasher::new(HashAlgo::Xxh3, Some(1));
    let cfg = ManagerConfig { block_size: 16, num_gpu_blocks: 24576, num_cpu_blocks: 100, watermark: 0.01, sliding_window: None, enable_caching: true, strict: false, hasher: h };
    let mut m = Manager::new(cfg).unwrap();
    let mut x: u64 = 1;
    let mut total = 0.0;
    for i in 0..100u64 {
        let toks: Vec<u32> = (0..2262).map(|_| { x = x.wrapping_mul(6364136223846793005).wrapping_add(1); (x >> 40) as u32 }).collect();
        let s = TokenSeq::new(16, &toks, HashExtra::default(), h).unwrap();
        let t0 = Instant::now();
        m.allocate(&[(i, &s)]).unwrap();
        total += t0.elapsed().as_secs_f64();
        m.free(i).unwrap();
    }
    println!("allocate miss: {:.1} us", total / 100.0 * 1e6);
}
