//! vLLM's `KVCacheManager.allocate_slots(request, num_new_tokens, ...)` arguments after
//! `request`, with vLLM's defaults: what `V1Manager.vllm_allocate_slots` (vLLM's signature,
//! parsed by PyO3 through vectorcall) and the native loop hand the manager.

use pyo3::prelude::*;

/// One call's arguments after `request` (vLLM's defaults filled in).
pub struct SlotArgs<'py> {
    pub num_new_tokens: u64,
    pub num_new_computed_tokens: u64,
    pub new_computed_blocks: Option<Bound<'py, PyAny>>,
    pub num_lookahead_tokens: u64,
    pub num_external_computed_tokens: u64,
    pub delay_cache_blocks: bool,
    pub num_encoder_tokens: u64,
    pub full_sequence_must_fit: bool,
    pub reserved_blocks: u64,
    pub has_scheduled_reqs: bool,
}
