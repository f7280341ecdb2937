"""pytest plugin (``-p pagedkv_swap``): vLLM's own tests run against the KV cache manager under
test, unmodified.

Before collection it replaces ``vllm.v1.core.kv_cache_manager.KVCacheManager`` and the name the
scheduler module builds its manager from (``vllm.v1.core.sched.scheduler.KVCacheManager``) with
the class named by ``$PAGEDKV_V1_MANAGER_UNDER_TEST`` (default
``pagedkv.vllm_v1.KVCacheManager``), so both the tests that build a manager themselves and
every scheduler they build get it. The header and the end of the run name the class, and the
run fails if no test built one (a swap that did not take). It also skips vLLM's per-test
global GPU/distributed cleanup (see :func:`pytest_collection_modifyitems`).
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import pytest

MANAGER_ENV = "PAGEDKV_V1_MANAGER_UNDER_TEST"
DEFAULT_MANAGER = "pagedkv.vllm_v1.KVCacheManager"

_state: dict = {
    "cls": None,
    "original": None,
    "own_package": None,
    "built": 0,
    "counted": False,
}


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


class _SwappedManagerModule(types.ModuleType):
    """``vllm.v1.core.kv_cache_manager`` with ``KVCacheManager`` read through a property: the
    manager under test for everyone but the manager's own package, which gets vLLM's class
    (pagedkv's manager hands an out-of-scope configuration to vLLM's own manager, imported
    from this module by name at that moment)."""

    @property
    def KVCacheManager(self) -> type:  # noqa: N802 - the attribute vLLM's module has
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith(_state["own_package"]):
            return _state["original"]
        return _state["cls"]


def pytest_configure(config: pytest.Config) -> None:
    import vllm.v1.core.kv_cache_manager as manager_module
    import vllm.v1.core.sched.scheduler as scheduler_module

    name = os.environ.get(MANAGER_ENV) or DEFAULT_MANAGER
    cls = _resolve(name)
    _state["original"] = manager_module.KVCacheManager
    _state["own_package"] = name.rpartition(".")[0] + "."
    _state["counted"] = _counting(cls)
    _state["cls"] = cls
    manager_module.__class__ = _SwappedManagerModule
    scheduler_module.KVCacheManager = cls  # a module global there: read from its __dict__


DESELECT_ENV = "PAGEDKV_DESELECT_FILE"


def _deselected_names() -> set[str]:
    """``file::test`` names (relative to tests/v1/core) from the file named by
    ``$PAGEDKV_DESELECT_FILE``, one a line."""
    path = os.environ.get(DESELECT_ENV)
    if not path:
        return set()
    with open(path) as f:
        return {line.strip() for line in f if line.strip()}


def _base_name(item: pytest.Item) -> str:
    """``file::test`` of an item, without its parameters."""
    return f"{item.path.name}::{item.originalname}"


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Deselects exactly the named tests (all parametrizations; unlike ``--deselect``, never a
    test whose name merely starts with a listed one), refusing names that match nothing.

    And: vLLM's tests/conftest.py tears torch.distributed and accelerator memory down after
    every test unless it is marked ``skip_global_cleanup`` ("a ~10x speedup for non-GPU unit
    tests", its docstring says). These run on the CPU and start nothing distributed: all are
    marked."""
    names = _deselected_names()
    keep = [item for item in items if _base_name(item) not in names]
    dropped = [item for item in items if _base_name(item) in names]
    files = {item.path.name for item in items}
    stale = {n for n in names if n.partition("::")[0] in files} - {_base_name(i) for i in dropped}
    if stale:
        raise pytest.UsageError(f"pagedkv_swap: deselected names match no test: {sorted(stale)}")
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)


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
