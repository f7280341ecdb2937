//! The bindings of vLLM 0.4.2's generation (the `pagedkv` package's root API), one job per
//! file:
//!
//! * `tokens`: token-id arguments; `buffers`: checked numpy views (step outputs, token
//!   arrays);
//! * `seqs`: reading sequences and groups off Python objects;
//! * `registry`: the manager's sequences by identity, and resolving sequences to token stores;
//! * `results`: `AllocStatus` and `BlockMapping` results;
//! * `compat_enum`: the native base of pagedkv's enums (C-level equality and hash);
//! * `hashing`, `pool`, `manager`: the classes `TokenSeq`/`BlockHasher`, `BlockPool`,
//!   `BlockSpaceManager`'s core;
//! * `scheduler`: vLLM 0.4.2's scheduler (`SchedulerCore`) and the batch step
//!   (`scheduler::batch`, `scheduler::metadata`).

pub(crate) mod buffers;
pub(crate) mod compat_enum;
pub(crate) mod hashing;
pub(crate) mod manager;
pub(crate) mod pool;
pub(crate) mod registry;
pub(crate) mod results;
pub(crate) mod scheduler;
pub(crate) mod seqs;
pub(crate) mod tokens;
