"""pytest plugin (``-p pagedkv_swap``): vLLM's own tests run against the KV cache manager under
test, unmodified.

Before collection it replaces ``vllm.v1.core.kv_cache_manager.KVCacheManager`` and the name the
scheduler module builds its manager from (``vllm.v1.core.sched.scheduler.KVCacheManager``) with
the class named by ``$PAGEDKV_V1_MANAGER_UNDER_TEST`` (default
``pagedkv.vllm_v1.KVCacheManager``), so both the tests that build a manager themselves and
every scheduler they build get it. The header of the run names the class, and the run fails if
no test built one (a swap that did not take).
"""

from __future__ import annotations

import importlib
import os

import pytest

MANAGER_ENV = "PAGEDKV_V1_MANAGER_UNDER_TEST"
DEFAULT_MANAGER = "pagedkv.vllm_v1.KVCacheManager"

_state: dict = {"cls": None, "built": 0, "counted": False}


def _resolve(dotted: str) -> type:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _counting(cls: type) -> bool:
    """Count the instances built (False where the class cannot be patched: a native type)."""
    original_init = cls.__init__

    def __init__(self, *args, **kwargs):  # noqa: N807 - replaces the class's own __init__
        _state["built"] += 1
        original_init(self, *args, **kwargs)

    try:
        cls.__init__ = __init__
    except TypeError:
        return False
    return True


def pytest_configure(config: pytest.Config) -> None:
    import vllm.v1.core.kv_cache_manager as manager_module
    import vllm.v1.core.sched.scheduler as scheduler_module

    name = os.environ.get(MANAGER_ENV) or DEFAULT_MANAGER
    cls = _resolve(name)
    _state["counted"] = _counting(cls)
    manager_module.KVCacheManager = cls
    scheduler_module.KVCacheManager = cls
    _state["cls"] = cls


def pytest_report_header(config: pytest.Config) -> str:
    return f"pagedkv_swap: KVCacheManager = {_name()}"


def _name() -> str:
    cls = _state["cls"]
    return f"{cls.__module__}.{cls.__qualname__}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    print(f"\npagedkv_swap: KVCacheManager = {_name()}")
    if not _state["counted"]:
        print("pagedkv_swap: the manager under test is not patchable; instances not counted")
        return
    if session.testscollected and _state["built"] == 0 and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print("pagedkv_swap: no test built the manager under test; the swap did not take")
    print(f"pagedkv_swap: {_state['built']} managers under test built")
