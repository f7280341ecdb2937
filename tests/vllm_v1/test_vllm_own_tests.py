"""vLLM's own tests/v1/core tests, unmodified, against the KV cache manager under test
(vllm_own_tests.py fetches them from the release's sdist; pagedkv_swap.py swaps the manager in
before collection), and vLLM's scheduler tests against the scheduler class under test, the
native loop (pagedkv_swap.py swaps ``Scheduler`` / ``AsyncScheduler`` in instead).

Every test of :data:`FILES` runs except those in the NOT_RUN table (vllm_not_run.py), each
with its reason: ENVIRONMENT entries always (this machine cannot run them, whatever the
manager), PAGEDKV entries when the manager under test is not vLLM's own. Every test of
:data:`LOOP_FILES` runs again with ``$PAGEDKV_V1_SCHEDULER_UNDER_TEST`` (default
``pagedkv.vllm_v1.Scheduler``) swapped in, except the ENVIRONMENT entries and, for a class
other than vLLM's own, the LOOP entries. A skip inside fails as a failure does.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pagedkv_swap as swap
import v1_harness as h
import vllm_not_run
import vllm_own_tests as own

FILES = (
    "test_prefix_caching.py",
    "test_kv_cache_utils.py",
    "test_scheduler.py",
    "test_async_scheduler.py",
)
#: The files run against the scheduler class under test (the native loop).
LOOP_FILES = ("test_scheduler.py", "test_async_scheduler.py")


def not_run(series: str, manager_name: str) -> dict[str, str]:
    """The NOT_RUN table for this vLLM series and manager under test."""
    table = dict(vllm_not_run.ENVIRONMENT[series])
    if manager_name != h.VLLM_MANAGER:
        table.update(vllm_not_run.PAGEDKV[series])
    return table


def scheduler_under_test_name() -> str:
    return os.environ.get(swap.SCHEDULER_ENV) or swap.DEFAULT_SCHEDULER


def loop_not_run(series: str, scheduler_name: str) -> dict[str, str]:
    """The NOT_RUN table of the run of :data:`LOOP_FILES` against ``scheduler_name``."""
    table = {
        name: reason
        for name, reason in vllm_not_run.ENVIRONMENT[series].items()
        if name.partition("::")[0] in LOOP_FILES
    }
    if scheduler_name != swap.VLLM_SCHEDULER:
        table.update(vllm_not_run.LOOP[series])
    return table


def junit_cases(junit: Path) -> tuple[list[str], list[str]]:
    """(all test names, skipped test names) of a pytest junit XML file."""
    names, skipped = [], []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        names.append(name)
        if case.find("skipped") is not None:
            skipped.append(name)
    return names, skipped


def test_vllms_own_v1_core_tests_pass(tmp_path: Path) -> None:
    series = own.installed_series()
    table = not_run(series, h.manager_under_test_name())
    junit = tmp_path / "own.xml"
    args = ["-q", "-rfEs", f"--junitxml={junit}"]
    rc, out = own.run(FILES, deselect=table, extra_args=args, env={swap.SCHEDULER_ENV: ""})
    cls = h.manager_under_test()
    assert f"pagedkv_swap: KVCacheManager = {cls.__module__}.{cls.__qualname__}" in out, out
    assert rc == 0, out[-8000:]
    names, skipped = junit_cases(junit)
    assert not skipped, f"skipped (list them in vllm_not_run.py with a reason): {skipped}"
    assert len(names) > 300, f"only {len(names)} tests ran:\n{out[-3000:]}"
    assert "managers under test built" in out or "not counted" in out, out[-2000:]


def test_vllms_own_scheduler_tests_pass_against_the_native_loop(tmp_path: Path) -> None:
    """vLLM's scheduler tests against pagedkv.vllm_v1.Scheduler (sync: the native loop where
    the engine and its requests are in scope, vLLM's loop per step otherwise) and its
    AsyncScheduler; the plugin fails the run if no step ran natively."""
    series = own.installed_series()
    name = scheduler_under_test_name()
    junit = tmp_path / "loop.xml"
    rc, out = own.run(
        LOOP_FILES,
        deselect=loop_not_run(series, name),
        extra_args=["-q", "-rfEs", f"--junitxml={junit}"],
        env={swap.SCHEDULER_ENV: name},
    )
    cls = swap._resolve(name)
    assert f"pagedkv_swap: Scheduler = {cls.__module__}.{cls.__qualname__}," in out, out
    assert rc == 0, out[-8000:]
    names, skipped = junit_cases(junit)
    assert not skipped, f"skipped (list them in vllm_not_run.py with a reason): {skipped}"
    assert len(names) > 150, f"only {len(names)} tests ran:\n{out[-3000:]}"
    assert "schedulers under test built" in out or "not counted" in out, out[-2000:]
    if name == swap.DEFAULT_SCHEDULER:
        native = re.search(r"schedule\(\): (\d+) native steps", out)
        assert native and int(native.group(1)) > 0, out[-2000:]


def test_not_run_tables_name_tests_of_the_files_run() -> None:
    """Each entry names a test function of one of FILES in that series' sdist (LOOP: of
    LOOP_FILES), with a reason."""
    series = own.installed_series()
    core = own.tests_tree(series) / "tests" / "v1" / "core"
    sources = {f: (core / f).read_text() for f in FILES}
    tables = (
        (vllm_not_run.ENVIRONMENT[series], FILES),
        (vllm_not_run.PAGEDKV[series], FILES),
        (vllm_not_run.LOOP[series], LOOP_FILES),
    )
    for table, files in tables:
        for entry, reason in table.items():
            file, _, name = entry.partition("::")
            name = name.partition("[")[0]  # one parametrization: file::test[id]
            assert reason and file in files and f"def {name}(" in sources[file], entry


def test_vllms_own_scheduler_runs_more_than_the_loop_table_allows() -> None:
    """vLLM's own Scheduler swapped in has only the ENVIRONMENT entries deselected."""
    series = own.installed_series()
    with_vllm = loop_not_run(series, swap.VLLM_SCHEDULER)
    with_pagedkv = loop_not_run(series, swap.DEFAULT_SCHEDULER)
    assert set(with_vllm) < set(with_pagedkv)
    assert not set(vllm_not_run.LOOP[series]) & set(vllm_not_run.ENVIRONMENT[series])


def test_vllms_own_manager_runs_more_than_the_pagedkv_table_allows() -> None:
    series = own.installed_series()
    with_vllm = not_run(series, h.VLLM_MANAGER)
    with_pagedkv = not_run(series, h.DEFAULT_MANAGER)
    assert set(with_vllm) < set(with_pagedkv)
    assert set(with_vllm) == set(vllm_not_run.ENVIRONMENT[series])
