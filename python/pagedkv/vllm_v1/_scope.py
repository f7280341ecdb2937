"""When the native KV cache manager may stand in for vLLM's: the scope check.

The native manager mirrors vLLM's manager for one KV cache group handled by vLLM's plain
``FullAttentionManager`` (dense decoders: Llama, Qwen, Mistral...), with the hash block size
equal to the block size, and none of: EAGLE/MTP block dropping, hash lookahead tokens, decode
or prefill context parallelism, block zeroing (Mamba or mixed-precision caches), a KV cache
metrics collector. Anything else runs vLLM's own manager; :func:`out_of_scope` says why.
"""

from __future__ import annotations

from typing import Any, Optional


def out_of_scope(kv_cache_config: Any, **args: Any) -> Optional[str]:
    """``None`` when the native manager applies; otherwise the reason, for the log line."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return f"{len(groups)} KV cache groups (hybrid model); pagedkv handles one"
    reason = _group_reason(groups[0])
    if reason:
        return reason
    checks = (
        (args.get("use_eagle"), "EAGLE/MTP block dropping"),
        (args.get("num_hash_lookahead_tokens"), "hash lookahead tokens"),
        (args.get("num_prefill_lookahead"), "multi-module MTP prefill lookahead"),
        (args.get("dcp_world_size", 1) != 1, "decode context parallelism"),
        (args.get("pcp_world_size", 1) != 1, "prefill context parallelism"),
        (args.get("metrics_collector") is not None, "KV cache residency metrics"),
        (getattr(kv_cache_config, "needs_kv_cache_zeroing", False), "KV block zeroing"),
        (
            (getattr(kv_cache_config, "prefix_cache_retention_interval", None) or 0) > 0,
            "a positive prefix-cache retention interval (vLLM's manager refuses it for full "
            "attention)",
        ),
        (
            args.get("hash_block_size") != args.get("scheduler_block_size"),
            "a hash block size other than the block size",
        ),
    )
    for failed, what in checks:
        if failed:
            return f"{what} is not supported by pagedkv's manager"
    return None


def _group_reason(group: Any) -> Optional[str]:
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    manager_cls = _manager_class(group)
    if manager_cls is not FullAttentionManager:
        name = getattr(manager_cls, "__name__", manager_cls)
        return f"the KV cache group needs vLLM's {name}; pagedkv handles full attention"
    return None


def _manager_class(group: Any) -> Any:
    """The single-type manager class vLLM would build for this group."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    return KVCacheSpecRegistry.get_manager_class(group.kv_cache_spec, getattr(group, "role", None))
