//! vLLM v1 (0.32, 0.33) KV-cache semantics, separate from the 0.4.2-era [`crate::vllm_042::manager`]:
//! v1 has no swap, a deterministic free-block order (block ids are part of what vLLM's model
//! runner and KV-event consumers see), and caches by the hashes vLLM computes itself.
//!
//! * [`block_hash`]: vLLM's block hash (pickle/CBOR, SHA-256/xxh3) for decode-filled blocks;
//! * [`free_queue`]: the free-block queue (intrusive doubly linked list, vLLM's order);
//! * [`pool`]: ref counts, the queue and the hash -> blocks map, with KV cache events;
//! * [`manager`]: per-request block tables and `allocate_slots` for one full-attention group;
//! * [`single_type`]: one manager per KV cache group (full, sliding window, chunked local) over
//!   one shared pool, for hybrid models (the bindings' `V1Hybrid`);
//! * [`mamba`]: the Mamba group kind's rules (mode "none") and block zeroing;
//! * [`mamba_align`]: Mamba groups with prefix caching (mode "align"): per-step state blocks,
//!   checkpoints, the right-to-left lookup and the prompt-tail caching;
//! * [`mamba_split`]: where the scheduler ends a prefill chunk in "align" mode (the
//!   block-aligned split, O(1));
//! * [`coordinator`]: vLLM's hybrid coordinator over those group managers (likewise);
//! * [`eagle`]: EAGLE/MTP's last-block drop (which groups drop, per release) and what it
//!   changes in lookups and caching;
//! * [`retention`]: which blocks a sliding-window group caches under each
//!   `prefix_cache_retention_interval` (dense, replay boundaries and junctions, periodic);
//! * [`policy`]: the scheduling rules of vLLM's v1 `Scheduler` (O(1) each);
//! * [`engine`]: the [`Engine`] trait the walk reads and writes the engine through, and the
//!   [`Mode`] (release, async) it runs in;
//! * [`spec_stats`]: the step's speculative decoding stats (`SpecDecodingStats`), tallied;
//! * [`walk`]: vLLM v1's `schedule()` and `update_from_output()`, generic over [`Engine`].

pub mod block_hash;
pub mod chunked_local;
pub mod coordinator;
pub mod eagle;
pub mod engine;
pub mod free_queue;
pub mod full_attention;
pub mod mamba;
pub mod mamba_align;
pub mod mamba_split;
pub mod manager;
pub mod policy;
pub mod pool;
pub mod retention;
pub mod single_type;
pub mod sliding_window;
pub mod spec_stats;
pub mod walk;

#[cfg(test)]
mod coordinator_tests;
#[cfg(test)]
mod eagle_tests;
#[cfg(test)]
mod external_tests;
#[cfg(test)]
mod mamba_align_tests;
#[cfg(test)]
mod mamba_tests;
#[cfg(test)]
mod single_type_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod walk_tests;

pub use engine::{Engine, Mode, Queue, Release, Runner, Settings, Status};
pub use manager::{Config, HashSource, Manager, SlotRequest};
pub use pool::{Event, HashKey, Pool, NULL_BLOCK};
pub use walk::Walk;
