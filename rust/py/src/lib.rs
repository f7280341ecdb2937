//! `pagedkv._native`: a thin PyO3 layer over `pagedkv-core`. It converts arguments, maps
//! errors to `pagedkv.errors`, and writes into caller-owned buffers; all logic is in the core.
//! Each vLLM generation has its own folder, one job per file:
//!
//! * `vllm_042`: vLLM 0.4.2's generation (the classes behind the `pagedkv` root API; its own
//!   header lists its files);
//! * `vllm_v1`: vLLM v1 (0.32, 0.33): `manager` (its KV cache manager, one full-attention
//!   group, for `pagedkv.vllm_v1`); `events` (vLLM's KV event objects built natively from the
//!   pool's log); `hash` (vLLM v1's block hashes, natively, for blocks the native loop fills);
//!   `call` (vLLM's `allocate_slots` arguments); `loop_` (`V1Loop`, the core's v1 walk,
//!   `schedule()` / `update_from_output()`, run over vLLM's own objects); `engine` (one
//!   call's `PyEngine`), `engine_impl` (the core's `Engine` trait implemented over vLLM's
//!   objects), `engine_requests` (a request's fields and status), `engine_update`
//!   (`update_from_output`'s inputs and outputs); `output` (vLLM's output objects);
//! * shared: `args` (integer, real and device arguments), `errors` (core errors to
//!   `pagedkv.errors`).
//!
//! Thread safety: the module requires the GIL (`gil_used = true`); a free-threaded interpreter
//! re-enables the GIL when importing it. Each object serves one call at a time; a concurrent or
//! re-entrant call raises `InUseError` (see `vllm_042::manager`).

use pyo3::prelude::*;

mod args;
mod errors;
mod vllm_042;
mod vllm_v1;

use vllm_042::{compat_enum, hashing, manager, pool, scheduler};

#[pymodule(gil_used = true)]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<hashing::PyTokenSeq>()?;
    m.add("CompatEnumBase", compat_enum::make_type(m.py())?)?;
    m.add_class::<hashing::PyBlockHasher>()?;
    m.add_class::<pool::PyBlockPool>()?;
    m.add_class::<manager::PyManager>()?;
    m.add_class::<scheduler::PySchedulerCore>()?;
    m.add_class::<scheduler::batch::PyBatchStep>()?;
    m.add_class::<vllm_v1::manager::PyV1Manager>()?;
    m.add_class::<vllm_v1::hybrid::PyV1Hybrid>()?;
    m.add_class::<vllm_v1::loop_::PyV1Loop>()?;
    m.add_class::<vllm_v1::hash::PyVllmBlockHasher>()?;
    m.add_function(wrap_pyfunction!(hashing::hash_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(vllm_v1::hash::vllm_block_hash, m)?)?;
    m.add_function(wrap_pyfunction!(
        vllm_v1::grammar_rows::fill_plain_grammar_rows,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(hashing::set_default_hasher, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::get_default_hasher, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::_set_weak_test_hasher, m)?)?;
    Ok(())
}
