"""pytest plugin (``-p pagedkv_swap``): vLLM's own tests run against the KV cache manager under
test, or against the scheduler class under test, unmodified.

Before collection it replaces ``vllm.v1.core.kv_cache_manager.KVCacheManager`` and the name the
scheduler module builds its manager from (``vllm.v1.core.sched.scheduler.KVCacheManager``) with
the class named by ``$PAGEDKV_V1_MANAGER_UNDER_TEST`` (default
``pagedkv.vllm_v1.KVCacheManager``), so both the tests that build a manager themselves and
every scheduler they build get it. The header and the end of the run name the class, and the
run fails if no test built one (a swap that did not take). It also skips vLLM's per-test
global GPU/distributed cleanup (see :func:`pytest_collection_modifyitems`).

With ``$PAGEDKV_V1_SCHEDULER_UNDER_TEST`` set (``pagedkv.vllm_v1.Scheduler``: the native loop
under test) it swaps the scheduler classes instead, and leaves the manager alone: the class
picks its manager itself, as it does in an engine. ``vllm.v1.core.sched.scheduler.Scheduler``
becomes the named class and ``vllm.v1.core.sched.async_scheduler.AsyncScheduler`` the
``AsyncScheduler`` of the same module (vLLM's own where that module has none), before
collection, so every test module and vLLM's tests/v1/core/utils.py (``create_scheduler``)
import them by those names; vLLM's ``get_scheduler_cls()`` (``EngineCore``) reads them there
too. vLLM's own subclasses of its ``Scheduler`` (the diffusion schedulers) are imported first
and keep vLLM's base. ``$PAGEDKV_V1_MANAGER_UNDER_TEST`` does not apply then (an empty
``$PAGEDKV_V1_SCHEDULER_UNDER_TEST`` is unset). The run fails if a test module holds vLLM's
class under those names, if no test built the class, or, for a class with pagedkv's native
loop, if no step ran natively; the end of the run counts the schedulers built, those with the
native loop started, the ``schedule()`` / ``update_from_output()`` steps each loop ran, and
the tests with a native step (each test's counts are junit properties).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from typing import Optional

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


def _counting(cls: type, state: dict = _state) -> bool:
    """Count the instances built in ``state["built"]`` (False where the class cannot be
    patched: a native type)."""
    original_init = cls.__init__

    def __init__(self, *args, **kwargs):  # noqa: N807 - replaces the class's own __init__
        state["built"] += 1
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


SCHEDULER_ENV = "PAGEDKV_V1_SCHEDULER_UNDER_TEST"
DEFAULT_SCHEDULER = "pagedkv.vllm_v1.Scheduler"
VLLM_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
#: vLLM modules that subclass its ``Scheduler`` / ``AsyncScheduler`` by name at import: imported
#: before the swap, so vLLM's own subclasses keep vLLM's classes as their bases.
_VLLM_SUBCLASS_MODULES = ("vllm.v1.core.sched.diffusion_scheduler",)
#: The module of vLLM's tests that builds the schedulers (``create_scheduler``).
_TESTS_UTILS = "tests.v1.core.utils"

_sched: dict = {
    "cls": None,  # the Scheduler under test
    "async_cls": None,  # the AsyncScheduler under test (vLLM's own if the module has none)
    "originals": {},  # name -> vLLM's class, for the names swapped
    "built": 0,  # schedulers under test constructed (either class)
    "counted": False,
    "loop": False,  # the class has pagedkv's native loop (counted below)
    "starts": 0,  # schedulers with the native loop class constructed
    "with_loop": 0,  # of which the native loop started (engine in scope)
    "schedule": 0,  # schedule() calls on those classes, either loop
    "native_schedule": 0,  # of which ran natively
    "update": 0,
    "native_update": 0,
    "tests_native": 0,  # tests with at least one native schedule() step
    "tests_fallback": 0,  # tests with a schedule() on the class under test, none native
}


def _count_calls(owner: type, name: str, key: str, after=None, before=None) -> None:
    """Wrap ``owner.name`` to count its calls in ``_sched[key]`` (``before(self)`` first,
    ``after(self)`` last)."""
    original = getattr(owner, name)

    def wrapper(self, *args, **kwargs):
        _sched[key] += 1
        if before is not None:
            before(self)
        result = original(self, *args, **kwargs)
        if after is not None:
            after(self)
        return result

    wrapper.__name__ = wrapper.__qualname__ = name
    setattr(owner, name, wrapper)


def _count_native_loop(cls: type) -> bool:
    """Count pagedkv's native-loop steps if ``cls`` has the native loop (else False).

    ``NativeLoop.schedule`` / ``update_from_output`` run on every step of such a scheduler;
    ``_OutputBuilder.scheduler_output`` / ``engine_core_outputs`` only on the native ones.
    (The native loop reads the scheduler's ``use_v2_model_runner`` every step, as vLLM's loop
    does: vLLM's ``create_scheduler`` changes it after construction.)"""
    try:
        from pagedkv.vllm_v1 import _native_loop
    except ImportError:
        return False
    if not issubclass(cls, _native_loop.NativeLoop):
        return False

    def loop_started(sched) -> None:
        if sched._pagedkv_loop is not None:
            _sched["with_loop"] += 1

    _count_calls(_native_loop.NativeLoop, "_pagedkv_start_loop", "starts", loop_started)
    _count_calls(_native_loop.NativeLoop, "schedule", "schedule")
    _count_calls(_native_loop.NativeLoop, "update_from_output", "update")
    _count_calls(_native_loop._OutputBuilder, "scheduler_output", "native_schedule")
    _count_calls(_native_loop._OutputBuilder, "engine_core_outputs", "native_update")
    return True


def _swap_schedulers(name: str) -> None:
    """Put the scheduler class ``name`` (and its module's ``AsyncScheduler``) in place of
    vLLM's, where vLLM's tests import them from."""
    import vllm.v1.core.sched.async_scheduler as async_module
    import vllm.v1.core.sched.scheduler as scheduler_module

    for module in _VLLM_SUBCLASS_MODULES:
        importlib.import_module(module)
    cls = _resolve(name)
    async_cls = getattr(sys.modules[cls.__module__], "AsyncScheduler", async_module.AsyncScheduler)
    _sched.update(cls=cls, async_cls=async_cls)
    if cls is not scheduler_module.Scheduler:
        _sched["originals"]["Scheduler"] = scheduler_module.Scheduler
    if async_cls is not async_module.AsyncScheduler:
        _sched["originals"]["AsyncScheduler"] = async_module.AsyncScheduler
    counted = _counting(cls, _sched)
    if async_cls is not async_module.AsyncScheduler:
        counted = _counting(async_cls, _sched) and counted
    _sched["counted"] = counted
    _sched["loop"] = _count_native_loop(cls)
    scheduler_module.Scheduler = cls
    async_module.AsyncScheduler = async_cls
    utils = sys.modules.get(_TESTS_UTILS)  # imported already (by a conftest): swap there too
    if utils is not None:
        for attr, original in _sched["originals"].items():
            if getattr(utils, attr, None) is original:
                setattr(utils, attr, {"Scheduler": cls, "AsyncScheduler": async_cls}[attr])


def _check_scheduler_swap(items: list) -> None:
    """No test module (nor the tests' utils) may still hold vLLM's class under its name."""
    modules = {id(m): m for m in (getattr(i, "module", None) for i in items) if m is not None}
    utils = sys.modules.get(_TESTS_UTILS)
    if utils is not None:
        modules[id(utils)] = utils
    stale = sorted(
        f"{m.__name__}.{attr}"
        for m in modules.values()
        for attr, original in _sched["originals"].items()
        if getattr(m, attr, None) is original
    )
    if stale:
        raise pytest.UsageError(f"pagedkv_swap: vLLM's scheduler class still imported: {stale}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Per test: the native-loop steps it ran (a junit property; tallied for the summary)."""
    if not _sched["loop"]:
        yield
        return
    before = (_sched["schedule"], _sched["native_schedule"])
    yield
    steps = _sched["schedule"] - before[0]
    native = _sched["native_schedule"] - before[1]
    item.user_properties.append(("pagedkv_native_schedule_steps", native))
    item.user_properties.append(("pagedkv_vllm_loop_schedule_steps", steps - native))
    if native:
        _sched["tests_native"] += 1
    elif steps:
        _sched["tests_fallback"] += 1


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(SCHEDULER_ENV):
        _swap_schedulers(os.environ[SCHEDULER_ENV])
        return
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
    """``file::test`` names (relative to tests/v1/core; ``file::test[id]`` for one
    parametrization) from the file named by ``$PAGEDKV_DESELECT_FILE``, one a line."""
    path = os.environ.get(DESELECT_ENV)
    if not path:
        return set()
    with open(path) as f:
        return {line.strip() for line in f if line.strip()}


def _base_name(item: pytest.Item) -> str:
    """``file::test`` of an item, without its parameters."""
    return f"{item.path.name}::{item.originalname}"


def _names(item: pytest.Item) -> set[str]:
    """The names that deselect an item: ``file::test`` and ``file::test[id]``."""
    return {_base_name(item), f"{item.path.name}::{item.name}"}


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Deselects exactly the named tests (all parametrizations, or the one named with its id;
    unlike ``--deselect``, never a test whose name merely starts with a listed one), refusing
    names that match nothing.

    And: vLLM's tests/conftest.py tears torch.distributed and accelerator memory down after
    every test unless it is marked ``skip_global_cleanup`` ("a ~10x speedup for non-GPU unit
    tests", its docstring says). These run on the CPU and start nothing distributed: all are
    marked."""
    names = _deselected_names()
    keep = [item for item in items if not _names(item) & names]
    dropped = [item for item in items if _names(item) & names]
    files = {item.path.name for item in items}
    matched = set().union(*(_names(i) for i in dropped))
    stale = {n for n in names if n.partition("::")[0] in files} - matched
    if stale:
        raise pytest.UsageError(f"pagedkv_swap: deselected names match no test: {sorted(stale)}")
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    if _sched["cls"] is not None:
        _check_scheduler_swap(items)
    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)


def pytest_report_header(config: pytest.Config) -> str:
    if _sched["cls"] is not None:
        return _scheduler_names()
    return f"pagedkv_swap: KVCacheManager = {_name()}"


def _name(cls: Optional[type] = None) -> str:
    cls = cls or _state["cls"]
    return f"{cls.__module__}.{cls.__qualname__}"


def _scheduler_names() -> str:
    return (
        f"pagedkv_swap: Scheduler = {_name(_sched['cls'])}, "
        f"AsyncScheduler = {_name(_sched['async_cls'])} (KVCacheManager not swapped)"
    )


def _scheduler_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    print(f"\n{_scheduler_names()}")
    ok = exitstatus == 0 and session.testscollected
    if not _sched["counted"]:
        print("pagedkv_swap: the scheduler under test is not patchable; instances not counted")
    elif ok and _sched["built"] == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print("pagedkv_swap: no test built the scheduler under test; the swap did not take")
    print(f"pagedkv_swap: {_sched['built']} schedulers under test built")
    if not _sched["loop"]:
        return
    print(
        f"pagedkv_swap: native loop started in {_sched['with_loop']} of {_sched['starts']} "
        "schedulers; "
        f"schedule(): {_sched['native_schedule']} native steps, "
        f"{_sched['schedule'] - _sched['native_schedule']} on vLLM's loop; "
        f"update_from_output(): {_sched['native_update']} native, "
        f"{_sched['update'] - _sched['native_update']} on vLLM's loop; "
        f"tests with a native step: {_sched['tests_native']}, "
        f"with vLLM's loop only: {_sched['tests_fallback']}"
    )
    if ok and _sched["native_schedule"] == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print("pagedkv_swap: the native loop never ran a step; the swap did not take")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _sched["cls"] is not None:
        _scheduler_sessionfinish(session, exitstatus)
        return
    print(f"\npagedkv_swap: KVCacheManager = {_name()}")
    if not _state["counted"]:
        print("pagedkv_swap: the manager under test is not patchable; instances not counted")
        return
    if session.testscollected and _state["built"] == 0 and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print("pagedkv_swap: no test built the manager under test; the swap did not take")
    print(f"pagedkv_swap: {_state['built']} managers under test built")
