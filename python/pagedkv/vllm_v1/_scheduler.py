"""``Scheduler`` and ``AsyncScheduler``: vLLM's own v1 schedulers over pagedkv's KV manager.

Each subclasses vLLM's class and changes one thing: after vLLM's constructor has run, the
scheduler's ``kv_cache_manager`` is pagedkv's native one, built from the same arguments, when
the configuration is in scope (:mod:`pagedkv.vllm_v1._scope`; with a KV connector, no Mamba
layers and a connector that reads neither vLLM's block pool nor its hybrid coordinator). Out
of scope vLLM's manager stays. The choice is made once, at construction, and said in one INFO line
in vLLM's log (:mod:`pagedkv.vllm_v1._report`).
``Scheduler`` also runs ``schedule()`` / ``update_from_output()`` natively while every request
it holds is in scope (:mod:`pagedkv.vllm_v1._native_loop`).

``Scheduler`` is the class to name (``--scheduler-cls pagedkv.vllm_v1.Scheduler``): when vLLM
runs with async scheduling (its default where the executor supports it), constructing it gives
an ``AsyncScheduler``, the variant vLLM itself would have built, so turning pagedkv on never
turns async scheduling off.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VLLMAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as _VLLMScheduler

from . import _scope
from ._manager import KVCacheManager, out_of_scope_reason
from ._native_loop import NativeLoop
from ._report import log_start


def _manager_args(sched: Any, vllm_config: Any) -> Dict[str, Any]:
    """The arguments vLLM's scheduler gave its own manager (vLLM 0.32 and 0.33 alike)."""
    args = dict(
        max_model_len=sched.max_model_len,
        max_in_flight_tokens=vllm_config.max_in_flight_tokens,
        enable_caching=sched.cache_config.enable_prefix_caching,
        use_eagle=sched.use_eagle_block_drop,
        num_prefill_lookahead=sched.num_prefill_lookahead,
        log_stats=sched.log_stats,
        enable_kv_cache_events=sched.enable_kv_cache_events,
        dcp_world_size=sched.dcp_world_size,
        pcp_world_size=1,
        scheduler_block_size=sched.block_size,
        hash_block_size=sched.hash_block_size,
        metrics_collector=sched.kv_metrics_collector,
        watermark=sched.scheduler_config.watermark,
        enable_mamba_shared_prefix_checkpoint=(
            sched.cache_config.enable_mamba_shared_prefix_checkpoint
        ),
    )
    lookahead = getattr(sched, "num_hash_lookahead_tokens", 0)
    if lookahead:
        args["num_hash_lookahead_tokens"] = lookahead
    return args


def install_native_manager(sched: Any, vllm_config: Any, kv_cache_config: Any) -> Optional[str]:
    """Give ``sched`` pagedkv's manager when in scope; else keep vLLM's and say why."""
    args = _manager_args(sched, vllm_config)
    why = out_of_scope_reason(kv_cache_config, **args)
    why = why or _scope.connector_out_of_scope(sched.connector, kv_cache_config)
    if why is None:
        sched.kv_cache_manager = KVCacheManager(kv_cache_config, **args)
        if sched.connector is not None:
            # vLLM's constructor bound the connector to vLLM's manager.
            sched.connector.bind_kv_cache_manager(sched.kv_cache_manager)
    return why


def start_pagedkv(sched: Any, vllm_config: Any, kv_cache_config: Any) -> None:
    """After vLLM's constructor: pagedkv's manager, native hashing and the native loop where
    in scope, then the start line saying what runs natively and why the rest does not."""
    manager_why = install_native_manager(sched, vllm_config, kv_cache_config)
    sched._pagedkv_start_hashing()
    if not sched.native_loop:
        loop_why: Optional[str] = f"{type(sched).__name__}.native_loop is False"
    elif os.environ.get("PAGEDKV_VLLM_NATIVE_LOOP", "1") == "0":
        loop_why = "PAGEDKV_VLLM_NATIVE_LOOP=0"
    else:
        loop_why = sched._pagedkv_start_loop()
    if not sched.cache_config.enable_prefix_caching:
        hashing = "prefix caching off"
    else:
        hashing = "block hashing " + ("native" if sched._pagedkv_hashers else "vLLM's")
    log_start(type(sched).__name__, manager_why, loop_why, hashing)


class AsyncScheduler(NativeLoop, _VLLMAsyncScheduler):
    """vLLM's ``AsyncScheduler`` with pagedkv's KV cache manager and native loop (as
    :class:`Scheduler`)."""

    native_loop = True

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        start_pagedkv(self, vllm_config, kv_cache_config)


class Scheduler(NativeLoop, _VLLMScheduler):
    """vLLM's ``Scheduler`` with pagedkv's KV cache manager and, for the requests in scope,
    pagedkv's native scheduling loop (:mod:`pagedkv.vllm_v1._native_loop`); an
    ``AsyncScheduler`` when vLLM runs with async scheduling.

    ``native_loop = False`` (a subclass, or ``PAGEDKV_VLLM_NATIVE_LOOP=0``) keeps vLLM's loop
    over the native manager."""

    native_loop = True

    def __new__(cls, vllm_config: Any = None, *args: Any, **kwargs: Any) -> Any:
        if cls is Scheduler and _async_scheduling(vllm_config):
            return AsyncScheduler(vllm_config, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        start_pagedkv(self, vllm_config, kv_cache_config)


def _async_scheduling(vllm_config: Any) -> bool:
    sched_config = getattr(vllm_config, "scheduler_config", None)
    return bool(getattr(sched_config, "async_scheduling", False))
