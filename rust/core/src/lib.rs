//! pagedkv-core: KV-cache block bookkeeping for paged-attention serving engines, in plain Rust.
//!
//! * [`hash`]: the chained block hash (xxh3-128 keyed, or SHA-256).
//! * [`id_map`]: maps and sets keyed by engine-assigned integer ids (a one-multiply hasher).
//! * [`token_seq`]: one sequence's token ids and full-block hashes.
//! * [`pool`]: a device's block pool: ref counts, free stack, prefix cache, LRU eviction
//!   (`evict`: O(1) usually, O(log k) at worst).
//! * [`manager`]: vLLM's BlockSpaceManager (v1) semantics on two pools.
//! * [`vllm_v1`]: vLLM v1 (0.32, 0.33): its block pool, KV cache manager and block hash, and the
//!   scheduler's rules and walk (`schedule` / `update_from_output`, generic over an engine).
//!
//! No PyO3 here; the Python bindings live in the `pagedkv-py` crate.

pub mod error;
mod evict;
pub mod hash;
pub mod id_map;
pub mod limits;
pub mod manager;
pub mod mem;
pub mod pool;
pub mod scheduler;
pub mod step_buffers;
pub mod token_seq;
pub mod vllm_v1;

#[cfg(test)]
mod manager_tests;
#[cfg(test)]
mod pool_tests;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod rng;

pub use error::{Error, Result};
pub use hash::{BlockHash, ChainHasher, HashAlgo, HashExtra, Hasher};
pub use limits::{check_block_size, check_gpu_slots, MAX_BLOCK_SIZE};
pub use manager::{AllocStatus, ComputedPrefix, Copies, Device, Manager, ManagerConfig, SeqId};
pub use pool::{BlockId, BlockKey, BlockPool, PoolStats};
pub use step_buffers::{newest_slot, StepRows, PAD_SLOT};
pub use token_seq::TokenSeq;
