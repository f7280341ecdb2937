"""What pagedkv serves natively, in one place: the KV cache manager (:func:`out_of_scope`, decided
once at construction), the scheduling loop for an engine (:func:`engine_out_of_scope`, once at
construction) and for a request (:func:`request_out_of_scope`, once at ``add_request``). Each
returns ``None`` when in scope, else the reason (for the start line and the fallback counts,
:mod:`pagedkv.vllm_v1._report`).

The native manager mirrors vLLM's manager for one KV cache group handled by vLLM's plain
``FullAttentionManager`` (dense decoders: Llama, Qwen, Mistral...), with the hash block size
equal to the block size, or for several groups (hybrid models: GPT-OSS, Gemma 3, Llama 4;
Granite 4, Nemotron-H, Jamba, Qwen3-Next) or one group of another kind (a lone sliding window,
chunked local or Mamba group: vLLM's unitary coordinator) each handled by vLLM's
``FullAttentionManager``,
``SlidingWindowManager``, ``ChunkedLocalAttentionManager`` or ``MambaManager`` in
``mamba_cache_mode`` "none" (prefix caching off) or "align" (prefix caching on, the Mamba block
at the hash block size) (:func:`hybrid_out_of_scope`); in both cases
none of: decode or prefill context parallelism, block zeroing other than Mamba's
(mixed-precision caches), a KV cache metrics collector. EAGLE/MTP (``use_eagle``, groups
flagged ``is_eagle_group``; multi-module MTP's prefill lookahead too) is served natively, its
last-block drop under each release's rule (``pagedkv_core::vllm_v1::eagle``), except with
a chunked local group, whose lookup vLLM asserts against; so are vLLM 0.33's lookahead block
hashes (``num_hash_lookahead_tokens``, EAGLE with prefix caching by default), which change
only the KV events' contents in the manager (:mod:`pagedkv.vllm_v1._events`) and, beside a
Mamba group in "align" mode, its checkpoint positions (as EAGLE's drop does). Align mode
with Mamba blocks larger than the hash block (fine-grained partial hits with copy-on-write)
runs vLLM's own manager; under pagedkv's manager the native loop splits align prefills at
block boundaries as vLLM's scheduler does (``pagedkv_core::vllm_v1::mamba_split``).
Anything else runs vLLM's own manager; :func:`out_of_scope` says why.
"""

from __future__ import annotations

from typing import Any, Optional


def out_of_scope(kv_cache_config: Any, **args: Any) -> Optional[str]:
    """``None`` when the native manager applies; otherwise the reason, for the log line."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        return "no KV cache group; pagedkv handles one or more"
    if needs_group_managers(kv_cache_config):
        return hybrid_out_of_scope(kv_cache_config, **args)
    return (
        _common_reason(kv_cache_config, args)
        or _reason(
            (getattr(kv_cache_config, "prefix_cache_retention_interval", None) or 0) > 0,
            "a positive prefix-cache retention interval (vLLM's manager refuses it for full "
            "attention)",
        )
        or _reason(
            args.get("hash_block_size") != args.get("scheduler_block_size"),
            "a hash block size other than the block size",
        )
    )


def _reason(failed: Any, what: str) -> Optional[str]:
    return f"{what} is not supported by pagedkv's manager" if failed else None


def _common_reason(kv_cache_config: Any, args: Any, mamba_zeroing: bool = False) -> Optional[str]:
    """What neither the one-group nor the hybrid manager serves; ``mamba_zeroing``: the
    hybrid manager zeroes as vLLM does for Mamba layers (not for mixed precision)."""
    zeroing = getattr(kv_cache_config, "needs_kv_cache_zeroing", False) and not (
        mamba_zeroing and not getattr(kv_cache_config, "has_mixed_precision_kv_cache", False)
    )
    checks = (
        (args.get("dcp_world_size", 1) != 1, "decode context parallelism"),
        (args.get("pcp_world_size", 1) != 1, "prefill context parallelism"),
        (args.get("metrics_collector") is not None, "KV cache residency metrics"),
        (zeroing, "KV block zeroing other than for Mamba layers"),
    )
    return next((_reason(True, what) for failed, what in checks if failed), None)


def hybrid_out_of_scope(kv_cache_config: Any, **args: Any) -> Optional[str]:
    """``None`` when pagedkv's hybrid manager (:mod:`pagedkv.vllm_v1._hybrid`) serves these
    KV cache groups: every group full attention, sliding window, chunked local attention
    (vLLM's plain managers for them) or Mamba (``MambaManager``) in ``mamba_cache_mode``
    "none" with prefix caching off or "align" with it on (:func:`_mamba_reason`), with
    several groups at least one full-attention group, chunked local groups at the scheduler
    block size (vLLM asserts it), every block size dividing the scheduler block size and,
    with prefix caching on, a multiple of the hash block size, full-attention groups at the
    hash block size (vLLM adds partial prompt-tail entries to larger blocks), and none of the
    features the one-group manager refuses (block zeroing only for Mamba layers). Otherwise
    the reason. Every ``prefix_cache_retention_interval`` is in scope (dense ``None``, sparse
    ``0`` as vLLM's engines default, periodic); the native manager refuses an invalid one as
    vLLM's coordinator does (a ``ValueError``)."""
    from vllm.v1.core.single_type_kv_cache_manager import (
        ChunkedLocalAttentionManager,
        FullAttentionManager,
        MambaManager,
        SlidingWindowManager,
    )

    hbs, sbs = args.get("hash_block_size"), args.get("scheduler_block_size")
    groups = kv_cache_config.kv_cache_groups
    eagle = args.get("use_eagle") or any(getattr(g, "is_eagle_group", False) for g in groups)
    caching = bool(args.get("enable_caching", True))
    served = (FullAttentionManager, SlidingWindowManager, ChunkedLocalAttentionManager)
    kinds = []
    for group in kv_cache_config.kv_cache_groups:
        cls = _manager_class(group)
        spec = group.kv_cache_spec
        if cls not in (*served, MambaManager):
            name = getattr(cls, "__name__", cls)
            return (
                f"a hybrid KV cache group needs vLLM's {name}; pagedkv's hybrid manager "
                "handles full, sliding-window and chunked local attention and Mamba"
            )
        reason = _mamba_reason(spec, caching, hbs) if cls is MambaManager else None
        if reason:
            return reason
        bs = spec.block_size
        if not hbs or not sbs or sbs % bs or (caching and bs % hbs):
            return _reason(True, f"a group block size {bs} (hash block {hbs}, scheduler {sbs})")
        if caching and cls is FullAttentionManager and bs != hbs:
            return _reason(True, "a full-attention group with blocks larger than the hash block")
        if cls is ChunkedLocalAttentionManager and bs != sbs:
            return _reason(True, "a chunked local group below the scheduler block size")
        if cls is ChunkedLocalAttentionManager and eagle:
            return (
                "EAGLE/MTP with a chunked local group runs vLLM's manager (its lookup asserts "
                "against the combination)"
            )
        kinds.append(cls)
    if len(kinds) > 1 and FullAttentionManager not in kinds:
        return _reason(True, "a hybrid configuration without a full-attention group")
    return _common_reason(kv_cache_config, args, mamba_zeroing=MambaManager in kinds)


def _mamba_reason(spec: Any, caching: bool, hbs: Any) -> Optional[str]:
    """What a Mamba group needs beyond the other kinds: mode "none" with prefix caching off,
    or mode "align" with it on, and its block at the hash block size (no fine-grained partial
    hits, whose copy-on-write tails pagedkv does not mirror). EAGLE/MTP's block drop and 0.33's
    lookahead block hashes are mirrored (align's checkpoint positions read both)."""
    mode = spec.mamba_cache_mode
    if mode not in ("none", "align"):
        return _reason(True, f'Mamba mamba_cache_mode "{mode}"')
    if (mode == "align") != caching:
        with_caching = "with" if caching else "without"
        return _reason(
            True,
            f'Mamba mamba_cache_mode "{mode}" {with_caching} prefix caching (vLLM pairs '
            '"align" with prefix caching, "none" without)',
        )
    if mode == "align" and spec.block_size != hbs:
        return _reason(
            True,
            'Mamba "align" blocks larger than the hash block (fine-grained partial hits with '
            "copy-on-write)",
        )
    return None


def needs_group_managers(kv_cache_config: Any) -> bool:
    """Whether pagedkv's hybrid manager (one manager per group) serves this configuration:
    several groups, or one group that is not plain full attention (a lone sliding-window,
    chunked local or Mamba group: vLLM's unitary coordinator over that group's manager).
    A lone full-attention group is the one-group manager's."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    groups = kv_cache_config.kv_cache_groups
    return len(groups) > 1 or _manager_class(groups[0]) is not FullAttentionManager


def connector_out_of_scope(connector: Any, kv_cache_config: Any) -> Optional[str]:
    """Why pagedkv's manager cannot serve beside this KV connector (``None``: it can, or
    there is none). Both native managers take a connector's external tokens as vLLM's do,
    except beside Mamba layers; a connector that binds vLLM's block pool (it overrides
    ``bind_gpu_block_pool`` or ``bind_kv_cache_manager``: it reads or changes the pool's
    blocks) needs vLLM's pool, and one that looks up hits per group (the offloading
    connector bounding its loads by groups it does not offload) needs vLLM's hybrid
    coordinator."""
    if connector is None:
        return None
    from vllm.v1.kv_cache_interface import MambaSpec

    if any(isinstance(g.kv_cache_spec, MambaSpec) for g in kv_cache_config.kv_cache_groups):
        return "a KV connector beside Mamba layers (external tokens there are vLLM's)"
    reader = _pool_binding_connector(connector)
    if reader is not None:
        return f"a KV connector that binds vLLM's block pool ({reader})"
    if any(getattr(c, "_bounding_group_ids", ()) for c in _members(connector)):
        return "a KV connector that reads vLLM's hybrid coordinator (offloading bounded by groups)"
    return None


def _members(connector: Any) -> list:
    """The connector, or a ``MultiConnector``'s members (recursively)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    if isinstance(connector, MultiConnector):
        return [m for c in connector._connectors for m in _members(c)]
    return [connector]


def _pool_binding_connector(connector: Any) -> Optional[str]:
    """The class name of the first connector (a ``MultiConnector``'s members in turn) that
    overrides the base class's pool binding, or is no ``KVConnectorBase_V1`` at all (its
    binding unknown), else ``None``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as Base

    binds = ("bind_gpu_block_pool", "bind_kv_cache_manager")
    for c in _members(connector):
        if not isinstance(c, Base) or any(
            getattr(type(c), name) is not getattr(Base, name) for name in binds
        ):
            return type(c).__name__
    return None


def _manager_class(group: Any) -> Any:
    """The single-type manager class vLLM would build for this group."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    return KVCacheSpecRegistry.get_manager_class(group.kv_cache_spec, getattr(group, "role", None))


def engine_out_of_scope(sched: Any) -> Optional[str]:
    """Why the native loop cannot run this engine (``None``: it can)."""
    from ._hybrid import HybridKVCacheManager
    from ._manager import KVCacheManager

    native = isinstance(sched.kv_cache_manager, (KVCacheManager, HybridKVCacheManager))
    # A connector beside vLLM's manager first: the operator should read the cause (the start
    # line says why the manager is vLLM's).
    checks = (
        (sched.connector is not None and not native, "a KV connector"),
        (bool(getattr(sched, "defer_async_loads", False)), "deferred KV loads"),
        (getattr(sched, "ec_connector", None) is not None, "an EC connector"),
        (getattr(sched, "aux_output_connector", None) is not None, "an aux output connector"),
        (not native, "vLLM's KV cache manager runs"),
        (
            bool(sched.num_lookahead_tokens) and not sched.num_spec_tokens,
            "lookahead without drafts",
        ),
        (bool(getattr(sched, "prefix_replay_tokens", 0)), "prefix replay"),
        (bool(getattr(sched, "is_encoder_decoder", False)), "an encoder-decoder model"),
        (bool(getattr(sched, "is_mm_encoder_only", False)), "an encoder-only instance"),
        (_sampled_per_step(sched) != (0 if is_pooling_model(sched) else 1), "a diffusion model"),
    )
    return next((why for out, why in checks if out), None)


def _sampled_per_step(sched: Any) -> int:
    return getattr(sched, "num_sampled_tokens_per_step", 1)


def is_pooling_model(sched: Any) -> bool:
    """A pooling model (``runner_type`` "pooling", not a diffusion model): vLLM samples no
    token after its prefill (``num_sampled_tokens_per_step`` 0) and each request stops at its
    pooler output; the native loop serves it."""
    model = sched.vllm_config.model_config
    return getattr(model, "runner_type", None) == "pooling" and not getattr(
        model, "is_diffusion", False
    )


def request_out_of_scope(request: Any) -> Optional[str]:
    """Why vLLM's own loop must schedule while ``request`` is held (``None``: in scope).
    KV transfer parameters are in scope (with a KV connector the native loop calls it as vLLM
    does; without one they are inert: vLLM's engine warns and disables KV transfer for the
    request).
    Structured output, LoRA, multimodal inputs (vLLM's encoder cache manager decides their
    encoder inputs, called by the loop), prompt embeddings, repetition detection, streaming
    sessions (``resumable``; each later update is checked by :func:`update_out_of_scope`) and
    pooling requests (``pooling_params``, no sampling parameters: a pooling model's) are in
    scope."""
    from vllm.v1.request import RequestStatus

    params = request.sampling_params
    arrival_statuses = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)
    checks = (
        ((params is None) == (request.pooling_params is None), "sampling and pooling parameters"),
        (request.status not in arrival_statuses, "not waiting on arrival"),
        (type(request.priority) is not int or abs(request.priority) >= 2**63, "priority"),
        (not _stop_ids_fit_i64(params), "stop token ids beyond 64 bits"),
        (not _repetition_fits_i64(params), "repetition detection beyond 64 bits"),
        (not _lora_id_fits_i64(request), "a LoRA id beyond 64 bits"),
        (not isinstance(request.arrival_time, (int, float)), "arrival time"),
    )
    return next((why for out, why in checks if out), None)


def update_out_of_scope(update: Any) -> Optional[str]:
    """Why vLLM's own loop must schedule the session a streaming update (a request for the id
    of a live session, vLLM's ``StreamingUpdate.from_request``) goes to (``None``: in scope).
    Only what the update carries into the session counts (``_update_request_as_session``:
    prompt tokens, multimodal inputs, ``max_tokens``, arrival time, sampling parameters); a
    final update (not ``resumable``) carries nothing."""
    if not getattr(update, "resumable", False):
        return None
    params = update.sampling_params
    checks = (
        (params is None, "pooling"),
        (not _stop_ids_fit_i64(params), "stop token ids beyond 64 bits"),
        (not _repetition_fits_i64(params), "repetition detection beyond 64 bits"),
        (not isinstance(update.arrival_time, (int, float)), "arrival time"),
    )
    return next((why for out, why in checks if out), None)


def hashes_natively(request: Any, why: Optional[str]) -> bool:
    """Whether pagedkv may give ``request`` its native block hasher: in scope and without
    multimodal inputs or prompt embeddings (their extra hash keys stay vLLM's hasher's; a
    LoRA adapter's key is encoded natively, :mod:`pagedkv.vllm_v1._hashing`). Not a
    streaming session: a later update may bring multimodal inputs (the native loop still
    hashes the blocks it fills for one, checking its extra keys every step)."""
    return (
        why is None
        and not getattr(request, "resumable", False)
        and not request.mm_features
        and request.prompt_embeds is None
    )


def _fits_i64(value: Any) -> bool:
    return type(value) is int and -(2**63) <= value < 2**63


def _repetition_fits_i64(params: Any) -> bool:
    rep = getattr(params, "repetition_detection", None)
    if rep is None:
        return True
    fields = (rep.min_pattern_size, rep.max_pattern_size, rep.min_count)
    return all(_fits_i64(v) for v in fields)


def _lora_id_fits_i64(request: Any) -> bool:
    lora = request.lora_request
    return lora is None or _fits_i64(lora.lora_int_id)


def _stop_ids_fit_i64(params: Any) -> bool:
    """The native stop check holds the EOS and stop ids as i64 (a sampled id outside i64
    matches none of them); a request asking to stop on an id outside i64 stays vLLM's."""
    ids = list(getattr(params, "stop_token_ids", None) or ())
    eos = getattr(params, "eos_token_id", None)
    if eos is not None:
        ids.append(eos)
    return all(_fits_i64(i) for i in ids)
