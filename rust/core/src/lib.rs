//! pagedkv-core: KV-cache block bookkeeping and scheduling for paged-attention serving engines,
//! in plain Rust (no PyO3: the Python bindings live in the `pagedkv-py` crate). Each vLLM
//! generation has its own module; they share only what means the same in both.
//!
//! * [`vllm_042`]: vLLM 0.4.2's generation: the chained block hash, two-device pools with LRU
//!   eviction, `BlockSpaceManagerV1`'s semantics, vLLM 0.4.2's scheduler and batch step.
//! * [`vllm_v1`]: vLLM's v1 engine (0.32, 0.33): its block pool, KV cache manager and block
//!   hash, and the scheduler's rules and walk (`schedule` / `update_from_output`, generic over
//!   an engine).
//! * Shared: [`error`] (typed errors), [`limits`] (size bounds), [`mem`] (fallible
//!   allocation), [`id_map`] (maps keyed by engine-assigned integer ids).

pub mod error;
pub mod id_map;
pub mod limits;
pub mod mem;
pub mod vllm_042;
pub mod vllm_v1;

#[cfg(test)]
mod rng;

pub use error::{Error, Result};
pub use limits::{check_block_size, check_gpu_slots, MAX_BLOCK_SIZE};
