# ruff: noqa: E501 - a table of vLLM's test names, one per line, some longer than a line
"""The NOT_RUN tables of test_vllm_own_tests.py: vLLM's tests/v1/core tests that are not run,
per vLLM series, each with a one-line reason. ``file::test`` names all parametrizations.

* ``ENVIRONMENT``: tests this machine cannot run whatever the manager (each fails with vLLM's
  own manager too): models whose Hugging Face files the offline run lacks, and configurations
  vLLM refuses on a CPU without Triton. Always deselected.
* ``PAGEDKV``: tests that fail against pagedkv.vllm_v1.KVCacheManager for a reason that is not
  a behaviour difference: they read vLLM's own BlockPool / coordinator internals, which
  pagedkv's views do not have, or they run a KV connector beside Mamba layers, which
  pagedkv.vllm_v1.Scheduler leaves to vLLM's manager (the swap forces pagedkv's hybrid manager
  under vLLM's Scheduler, and it refuses external tokens there; elsewhere both native managers
  take them, so vLLM's other connector tests run against them). Deselected when the manager under test is not vLLM's own. Measured:
  every other test of the files run (test_vllm_own_tests.FILES) passes against pagedkv's manager (0.33 and 0.32; out of
  scope configurations run vLLM's manager through pagedkv's fallback; hybrid full + sliding
  window / chunked local configurations, under every prefix-cache retention, run pagedkv's
  hybrid manager, and so do lone sliding-window and Mamba groups: vLLM's pure-SWA retention
  tests pass against it). The one behaviour difference this found, ``test_prefix_caching.py::test_positive_retention_rejects_full_attention``
  (vLLM refuses a positive ``prefix_cache_retention_interval`` on full attention), was fixed,
  not listed: such a configuration is out of pagedkv's scope, so vLLM's manager refuses it.
  classify_vllm_tests.py proposes entries by source patterns for a new release.
* ``ENVIRONMENT_V2_RUNNER``: with ``VLLM_USE_V2_MODEL_RUNNER=1`` (one of the loop runs),
  tests vLLM's configuration refuses with the V2 model runner. Always deselected there.
* ``LOOP``: the run of test_scheduler.py and test_async_scheduler.py against the scheduler
  class under test (``pagedkv.vllm_v1.Scheduler`` and its ``AsyncScheduler`` swapped in for
  vLLM's, the manager not swapped: the class installs pagedkv's manager in scope and keeps
  vLLM's out of scope, as in an engine): tests that fail there for a reason that is not a
  behaviour difference of the native loop: they read vLLM's manager internals as in
  ``PAGEDKV`` (the class installs pagedkv's manager). Tests that replace
  ``kv_cache_manager.allocate_slots`` run: a replaced one puts the step on vLLM's loop. A
  parametrization is named ``file::test[id]``. Deselected when the scheduler under test is
  not vLLM's own. Measured (0.33 with the V1 and the V2 model runner, 0.32 with the V1): every
  other test of LOOP_FILES passes, including the KV connector tests (the native loop over
  pagedkv's manager; beside Mamba layers vLLM's manager and loop).
"""

from __future__ import annotations

_HUB_LLAVA = (
    "builds llava-hf/llava-1.5-7b-hf, whose processor and tokenizer the offline run lacks "
    "(multimodal encoder scheduling, not the KV cache manager)"
)
_HUB_QWEN3_NEXT = (
    "builds Qwen/Qwen3-Next-80B-A3B-Instruct (not available offline; a hybrid "
    "attention/linear-attention model, out of pagedkv.vllm_v1's scope anyway)"
)
_NO_V2_RUNNER = (
    "async scheduling with pipeline parallelism needs vLLM's V2 model runner, which needs "
    "Triton (absent here): VllmConfig refuses the configuration"
)
_HYBRID_CONNECTOR = (
    "a KV connector's external tokens beside Mamba layers: pagedkv.vllm_v1.Scheduler keeps "
    "vLLM's manager there; forced under vLLM's Scheduler, pagedkv's hybrid manager refuses "
    "them (InvalidArgumentError)"
)


_COW_INTERNALS = (
    "takes blocks straight from vLLM's BlockPool (get_new_blocks) and plants a copy-on-write "
    "in a single-type manager's _pending_cow_copies, internals pagedkv's views do not have"
)
#: vLLM's deferred-free tests that plant internals (both series).
_DEFERRED = {
    "test_deferred_block_free.py::test_cow_retentions_deferred_until_copy_step_processed": _COW_INTERNALS,
}


def _pool_internal(attr: str) -> str:
    return f"reads vLLM's BlockPool internals (block_pool.{attr}), not in pagedkv's pool view"


def _group_internal(attr: str) -> str:
    return (
        f"reads vLLM's single-type manager internals (coordinator.single_type_managers[0]."
        f"{attr}), not in pagedkv's view"
    )


def _coordinator_internal(attr: str) -> str:
    return f"reads vLLM's coordinator internals (coordinator.{attr}), not in pagedkv's view"


_EXTERNAL_FREE_QUEUE = (
    _pool_internal("free_block_queue.fake_free_list_head")
    + ", walking the queue's linked list to plant uncached blocks as a hit"
)


#: The aux output connector (put in after construction: vLLM's loop runs) reads vLLM's pool.
_AUX_POOL = (
    _pool_internal("get_cached_block")
    + " (vLLM's AuxOutputSchedulerConnector reads it; pagedkv's Scheduler installs pagedkv's "
    "manager, and with the connector in place vLLM's loop runs over it)"
)

ENVIRONMENT: dict[str, dict[str, str]] = {}
PAGEDKV: dict[str, dict[str, str]] = {}

_NO_CUDA = "needs CUDA (skipped on this CPU build, or no attention backend to parametrize)"
_HUB_MODEL = (
    "starts an LLM on a hub model whose files the offline run lacks (fails with vLLM's own "
    "scheduler too)"
)
#: vLLM's KV connector tests (run with LOOP_FILES) that this machine cannot run.
_CONNECTOR_ENVIRONMENT = {
    "test_offloading_connector.py::test_cpu_offloading": _NO_CUDA,
    "test_offloading_connector.py::test_cpu_offloading_sliding_window_partial_chunk": _NO_CUDA,
    "test_offloading_connector.py::test_cpu_offloading_metrics": _NO_CUDA,
    "test_offloading_connector.py::test_mamba_cpu_offload_boundary": _NO_CUDA,
    "test_offloading_connector.py::test_tiering_offloading": _HUB_MODEL,
    "test_offloading_connector.py::test_fs_tiering_offloading": _HUB_MODEL,
    "test_offloading_connector.py::test_tiering_cache_reset_resumes_promotions_on_idle_engine": (
        "calls vLLM's compiled CPU op init_cpu_memory_env, absent from this build (fails with "
        "vLLM's own scheduler too)"
    ),
    "test_multi_connector.py::test_multi_example_connector_consistency": _HUB_MODEL,
    "test_multi_connector.py::test_multi_connector_mixed_hma_disables_hybrid_kv_cache": _NO_CUDA,
    "test_example_connector.py::test_shared_storage_connector_hashes": _NO_CUDA,
}

ENVIRONMENT["0.33"] = {
    **_CONNECTOR_ENVIRONMENT,
    "test_scheduler.py::test_async_scheduling_pp_allows_rescheduling_with_output_placeholders": _NO_V2_RUNNER,
    "test_scheduler.py::test_cpu_encoder_input_updates_preserve_shm_handles": _HUB_LLAVA,
    "test_scheduler.py::test_cpu_encoder_input_updates_restore_after_kv_load_failure": _HUB_LLAVA,
    "test_scheduler.py::test_cpu_encoder_input_updates_resume_and_abort": _HUB_LLAVA,
    "test_scheduler.py::test_cpu_encoder_input_updates_wait_for_completed_prefill": _HUB_LLAVA,
    "test_scheduler.py::test_eagle3_mm_encoder_cache_with_shift": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_allocate_encoder_tokens_with_external_load": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_cache_hit_external_load": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_cache_miss_computes_locally": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_defers_running_request_for_async_reload": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_ensure_cache_available_defers_request": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_schedule_multiple_requests": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_text_only_request": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_unable_to_allocate": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_update_connector_output_called": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_waits_for_embeddings_in_prefix_replay": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_with_partial_cache_hit_multi_round": _HUB_LLAVA,
    "test_scheduler.py::test_encoder_cache_accepts_matching_embed_count": _HUB_LLAVA,
    "test_scheduler.py::test_encoder_cache_embed_count_mismatch_restores_prior_hit_state": _HUB_LLAVA,
    "test_scheduler.py::test_encoder_cache_recomputed_when_evicted_during_preemption": _HUB_LLAVA,
    "test_scheduler.py::test_encoder_cache_rejects_mismatched_embed_count": _HUB_LLAVA,
    "test_scheduler.py::test_encoder_cache_rejects_mismatched_embed_count_within_request": _HUB_LLAVA,
    "test_scheduler.py::test_encoder_cache_retained_across_preemption_and_resume": _HUB_LLAVA,
    "test_scheduler.py::test_encoder_only_prompt_longer_than_budget_is_chunked": _HUB_LLAVA,
    "test_scheduler.py::test_free_encoder_inputs_notifies_the_ec_connector": _HUB_LLAVA,
    "test_scheduler.py::test_free_encoder_inputs_respects_unconfirmed_placeholders": _HUB_LLAVA,
    "test_scheduler.py::test_free_encoder_inputs_unchanged_without_spec_decode": _HUB_LLAVA,
    "test_scheduler.py::test_no_mm_input_chunking": _HUB_LLAVA,
    "test_scheduler.py::test_no_mm_input_chunking_at_item_boundary": _HUB_LLAVA,
    "test_scheduler.py::test_no_mm_input_chunking_for_same_step_duplicate": _HUB_LLAVA,
    "test_scheduler.py::test_priority_scheduling_ec_connector_preemption_and_resumption": _HUB_LLAVA,
    "test_scheduler.py::test_same_step_duplicate_encoder_input_stays_cached": _HUB_LLAVA,
    "test_scheduler.py::test_schedule_multimodal_requests": _HUB_LLAVA,
    "test_scheduler.py::test_schedule_partial_requests": _HUB_LLAVA,
    "test_scheduler.py::test_streaming_lookahead_hashes_follow_recomputed_kv": _HUB_QWEN3_NEXT,
    "test_scheduler.py::test_unavailable_encoder_input_fails_the_request_as_retryable": _HUB_LLAVA,
    "test_scheduler.py::test_waiting_encoder_stall_does_not_starve_later_requests": _HUB_LLAVA,
    "test_scheduler.py::test_waiting_encoder_stall_is_counted_as_deferred": _HUB_LLAVA,
    "test_scheduler.py::test_waiting_encoder_stall_kv_holder_keeps_drain_priority": _HUB_LLAVA,
}
ENVIRONMENT["0.32"] = {
    **{
        name: reason
        for name, reason in _CONNECTOR_ENVIRONMENT.items()
        if not name.endswith(("_sliding_window_partial_chunk", "_on_idle_engine"))  # 0.33's
    },
    "test_scheduler.py::test_eagle3_mm_encoder_cache_with_shift": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_allocate_encoder_tokens_with_external_load": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_cache_hit_external_load": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_cache_miss_computes_locally": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_defers_running_request_for_async_reload": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_ensure_cache_available_defers_request": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_schedule_multiple_requests": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_text_only_request": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_unable_to_allocate": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_update_connector_output_called": _HUB_LLAVA,
    "test_scheduler.py::test_ec_connector_with_partial_cache_hit_multi_round": _HUB_LLAVA,
    "test_scheduler.py::test_encoder_cache_accepts_matching_embed_count": _HUB_LLAVA,
    "test_scheduler.py::test_encoder_cache_embed_count_mismatch_restores_prior_hit_state": _HUB_LLAVA,
    "test_scheduler.py::test_encoder_cache_recomputed_when_evicted_during_preemption": _HUB_LLAVA,
    "test_scheduler.py::test_encoder_cache_rejects_mismatched_embed_count": _HUB_LLAVA,
    "test_scheduler.py::test_encoder_cache_rejects_mismatched_embed_count_within_request": _HUB_LLAVA,
    "test_scheduler.py::test_encoder_cache_retained_across_preemption_and_resume": _HUB_LLAVA,
    "test_scheduler.py::test_encoder_only_prompt_longer_than_budget_is_chunked": _HUB_LLAVA,
    "test_scheduler.py::test_free_encoder_inputs_defers_for_eagle_lookahead": _HUB_LLAVA,
    "test_scheduler.py::test_free_encoder_inputs_notifies_the_ec_connector": _HUB_LLAVA,
    "test_scheduler.py::test_free_encoder_inputs_respects_unconfirmed_placeholders": _HUB_LLAVA,
    "test_scheduler.py::test_free_encoder_inputs_unchanged_without_spec_decode": _HUB_LLAVA,
    "test_scheduler.py::test_no_mm_input_chunking": _HUB_LLAVA,
    "test_scheduler.py::test_no_mm_input_chunking_for_same_step_duplicate": _HUB_LLAVA,
    "test_scheduler.py::test_priority_scheduling_ec_connector_preemption_and_resumption": _HUB_LLAVA,
    "test_scheduler.py::test_same_step_duplicate_encoder_input_stays_cached": _HUB_LLAVA,
    "test_scheduler.py::test_schedule_multimodal_requests": _HUB_LLAVA,
    "test_scheduler.py::test_schedule_partial_requests": _HUB_LLAVA,
    "test_scheduler.py::test_unavailable_encoder_input_fails_the_request_as_retryable": _HUB_LLAVA,
}
#: Tests that reach pagedkv's manager since EAGLE is native, in both releases.
_EAGLE_NATIVE = {
    # EAGLE on a hybrid (full + two windows), native: its hits (each group's dropped block)
    # and new blocks match (checked before the read that fails).
    "test_prefix_caching.py::test_prefill_hybrid_model_eagle": _pool_internal(
        "cached_block_hash_to_block"
    ),
    # EAGLE managers (native since EAGLE is) that take blocks off vLLM's free queue by hand
    # and then allocate external (connector) tokens.
    "test_prefix_caching.py::test_cache_hit_local_and_external": _EXTERNAL_FREE_QUEUE,
    "test_prefix_caching.py::test_cache_hit_local_and_external_three_groups": _EXTERNAL_FREE_QUEUE,
    "test_prefix_caching.py::test_cache_hit_local_and_external_three_groups_preempt_and_reallocate": (
        _EXTERNAL_FREE_QUEUE
    ),
    "test_prefix_caching.py::test_cache_hit_local_and_external_two_groups_preempt_and_reallocate": (
        _EXTERNAL_FREE_QUEUE
    ),
}

#: Mamba "align" (prefix caching on) configurations build pagedkv's hybrid manager (at the
#: hash block size); these run a KV connector beside the Mamba layers. Both releases' names
#: (0.33 adds more, in its own table).
_MAMBA_ALIGN_NATIVE = {
    "test_scheduler.py::test_hybrid_per_group_hit_divergence_with_connector": _HYBRID_CONNECTOR,
    "test_scheduler.py::test_hybrid_fa_deeper_hit_respects_connector_lookup_policy": _HYBRID_CONNECTOR,
}

#: One group other than full attention (a lone window or Mamba group) builds pagedkv's hybrid
#: manager as vLLM's unitary coordinator; these read vLLM's internals. Both releases.
_LONE_GROUP_NATIVE = {
    "test_prefix_caching.py::test_pure_swa_retention_interval_caches_sparse_tails": (
        "asserts the coordinator's class name (vLLM's UnitaryKVCacheCoordinator); pagedkv's "
        "coordinator view is its own class (the rest of the test passes against pagedkv's "
        "manager: checked with that line removed)"
    ),
    "test_prefix_caching.py::test_eagle_with_sliding_window": _pool_internal(
        "cached_block_hash_to_block"
    ),
    "test_prefix_caching.py::test_mamba_boundary_handoffs_do_not_pin_obsolete_blocks": (
        "reads take_boundary_state_offloads (Mamba boundary states offered to a KV connector; "
        "pagedkv's manager offers none, and with a connector vLLM's manager runs)"
    ),
}

PAGEDKV["0.33"] = {
    **_DEFERRED,
    **_MAMBA_ALIGN_NATIVE,
    **_LONE_GROUP_NATIVE,
    "test_scheduler.py::test_hybrid_divergent_hit_fallback_is_capped_at_retained_auxiliary_outputs[kept]": _HYBRID_CONNECTOR,
    # 0.33's version reads the pool's internals (0.32's passes against pagedkv's manager).
    "test_prefix_caching.py::test_block_stored_event_group_idx": _pool_internal(
        "get_new_blocks, cache_full_blocks"
    ),
    # Hybrid (full + sliding window), native: its block ids, hashes with their group, ref
    # counts and null-block hits match (checked before the read that fails).
    "test_prefix_caching.py::test_prefill_hybrid_model": _pool_internal(
        "cached_block_hash_to_block"
    ),
    "test_prefix_caching.py::test_block_stored_event_group_idx_multiple_groups": _pool_internal(
        "get_new_blocks, cache_full_blocks"
    ),
    **_EAGLE_NATIVE,
    "test_prefix_caching.py::test_block_stored_event_group_idx_out_of_bounds": _pool_internal(
        "kv_event_queue"
    ),
    "test_prefix_caching.py::test_kv_cache_events": _pool_internal("cached_block_hash_to_block"),
    "test_prefix_caching.py::test_prefill": _pool_internal("blocks"),
    "test_prefix_caching.py::test_zero_retention_is_ignored_for_full_attention": _coordinator_internal(
        "retention_interval"
    ),
    "test_scheduler.py::test_evicted_blocks_release_their_auxiliary_outputs_past_capacity": _pool_internal(
        "get_cached_block"
    ),
    "test_scheduler.py::test_routed_experts_hashes_follow_scheduled_tokens": _pool_internal(
        "get_cached_block"
    ),
}
PAGEDKV["0.32"] = {
    **_DEFERRED,
    **_MAMBA_ALIGN_NATIVE,
    **_LONE_GROUP_NATIVE,
    # Hybrid (full + sliding window), native: its block ids, hashes with their group, ref
    # counts and null-block hits match (checked before the read that fails).
    "test_prefix_caching.py::test_prefill_hybrid_model": _pool_internal(
        "cached_block_hash_to_block"
    ),
    "test_prefix_caching.py::test_block_stored_event_group_idx_multiple_groups": _pool_internal(
        "get_new_blocks, cache_full_blocks"
    ),
    **_EAGLE_NATIVE,
    "test_prefix_caching.py::test_block_stored_event_group_idx_out_of_bounds": _pool_internal(
        "kv_event_queue"
    ),
    "test_prefix_caching.py::test_kv_cache_events": _pool_internal("cached_block_hash_to_block"),
    "test_prefix_caching.py::test_prefill": _pool_internal("blocks"),
    "test_prefix_caching.py::test_zero_retention_is_ignored_for_full_attention": _coordinator_internal(
        "retention_interval"
    ),
}

#: The loop run with VLLM_USE_V2_MODEL_RUNNER=1 (test_vllm_own_tests.RUNNER_MODES): vLLM's
#: configuration refuses these with the V2 model runner, whatever the scheduler.
ENVIRONMENT_V2_RUNNER: dict[str, dict[str, str]] = {
    "0.33": {
        "test_scheduler.py::test_block_drafters_cap_requests_instead_of_draft_slots": (
            "VllmConfig refuses it with the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1): "
            "'Model Runner V2 does not yet support parallel drafting for EAGLE' (vLLM's own "
            "scheduler alike)"
        ),
    },
    "0.32": {},
}

LOOP: dict[str, dict[str, str]] = {}
LOOP["0.33"] = {
    **_DEFERRED,
    "test_scheduler.py::test_evicted_blocks_release_their_auxiliary_outputs_past_capacity": _AUX_POOL,
    "test_scheduler.py::test_routed_experts_hashes_follow_scheduled_tokens": _AUX_POOL,
}
LOOP["0.32"] = {
    **_DEFERRED,
}
