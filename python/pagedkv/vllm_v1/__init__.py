"""pagedkv inside vLLM's v1 engine (vLLM 0.32 and 0.33): a native scheduling loop and KV
cache manager.

Use it with vLLM's own option, no change to vLLM::

    vllm serve MODEL --scheduler-cls pagedkv.vllm_v1.Scheduler
    LLM(model=..., scheduler_cls="pagedkv.vllm_v1.Scheduler")

or set ``PAGEDKV_VLLM=1`` with pagedkv installed (its ``vllm.general_plugins`` entry point
then makes it the default). ``Scheduler`` becomes vLLM's ``AsyncScheduler`` variant when vLLM
runs with async scheduling. By default both run ``schedule()`` and ``update_from_output()``
natively (``_native.V1Loop``) on every step whose requests are all in scope, and vLLM's own
loop over the native manager on the others (``PAGEDKV_VLLM_NATIVE_LOOP=0``: always vLLM's
loop). A KV connector runs on the native loop too (attention groups, a connector that does
not bind vLLM's block pool: :mod:`pagedkv.vllm_v1._connector`). Configurations outside the native
manager's scope (a KV connector beside Mamba layers, context parallelism, Mamba "align"
blocks larger than the hash block, EAGLE/MTP beside a chunked local group, ...; hybrid and
sliding-window models and EAGLE/MTP otherwise are in it: :mod:`pagedkv.vllm_v1._scope`) run
vLLM's own manager and loop. One INFO line at start says
what runs natively and why the rest does not (:mod:`pagedkv.vllm_v1._report`).

Names (imported on first use; ``import pagedkv`` never imports vLLM): ``Scheduler``,
``AsyncScheduler``, ``KVCacheManager``, ``SUPPORTED_VLLM``, ``out_of_scope``.
"""

from __future__ import annotations

from typing import Any

from ._version import SUPPORTED_VLLM

__all__ = ["SUPPORTED_VLLM", "AsyncScheduler", "KVCacheManager", "Scheduler", "out_of_scope"]

_LAZY = {
    "Scheduler": "_scheduler",
    "AsyncScheduler": "_scheduler",
    "KVCacheManager": "_manager",
    "out_of_scope": "_scope",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv.vllm_v1' has no attribute {name!r}")
    from importlib import import_module

    from ._version import require_supported_vllm

    require_supported_vllm()
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
