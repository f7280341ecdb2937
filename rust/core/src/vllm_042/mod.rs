//! vLLM 0.4.2's generation (the V0 engine): BlockSpaceManagerV1's semantics on two pools and
//! vLLM 0.4.2's scheduler, for the `pagedkv` package's root API.
//!
//! * [`hash`]: the chained block hash (xxh3-128 keyed, or SHA-256).
//! * [`token_seq`]: one sequence's token ids and full-block hashes.
//! * [`pool`]: a device's block pool: ref counts, free stack, prefix cache, LRU eviction
//!   (`evict`: O(1) usually, O(log k) at worst).
//! * [`manager`]: vLLM 0.4.2's `BlockSpaceManagerV1` semantics on a GPU and a CPU pool (swap).
//! * [`scheduler`]: vLLM 0.4.2's scheduling policy and the one-call batch step.
//! * [`step_buffers`]: the batch step's model inputs (block tables, slot mappings) written
//!   into caller-owned buffers.

mod evict;
pub mod hash;
pub mod manager;
pub mod pool;
pub mod scheduler;
pub mod step_buffers;
pub mod token_seq;

#[cfg(test)]
mod manager_tests;
#[cfg(test)]
mod pool_tests;
#[cfg(test)]
mod proptests;

pub use hash::{BlockHash, ChainHasher, HashAlgo, HashExtra, Hasher};
pub use manager::{AllocStatus, ComputedPrefix, Copies, Device, Manager, ManagerConfig, SeqId};
pub use pool::{BlockId, BlockKey, BlockPool, PoolStats};
pub use step_buffers::{newest_slot, StepRows, PAD_SLOT};
pub use token_seq::TokenSeq;
