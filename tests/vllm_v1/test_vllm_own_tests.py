"""vLLM's own tests/v1/core tests, unmodified, against the KV cache manager under test
(vllm_own_tests.py fetches them from the release's sdist; pagedkv_swap.py swaps the manager in
before collection), and vLLM's scheduler tests against the scheduler class under test, the
native loop (pagedkv_swap.py swaps ``Scheduler`` / ``AsyncScheduler`` in instead).

Every test of :data:`FILES` runs except those in the NOT_RUN table (vllm_not_run.py), each
with its reason: ENVIRONMENT entries always (this machine cannot run them, whatever the
manager), PAGEDKV entries when the manager under test is not vLLM's own. Every test of
:data:`LOOP_FILES` runs again with ``$PAGEDKV_V1_SCHEDULER_UNDER_TEST`` (default
``pagedkv.vllm_v1.Scheduler``) swapped in, except the ENVIRONMENT entries and, for a class
other than vLLM's own, the LOOP entries, once per model runner (:data:`RUNNER_MODES`; with
the V2 runner also the ENVIRONMENT_V2_RUNNER entries). A skip inside fails as a failure does.
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
    "test_swa_inflight_window_free.py",
    "test_deferred_block_free.py",
    "test_priority_preemption_bug.py",
    "test_worker_slot_overflow.py",
    "test_prefix_replay.py",
)
#: The files run against the scheduler class under test (the native loop); paths relative to
#: ``tests/v1/core`` (vLLM's streaming-session scheduler tests live beside it; on 0.32 their
#: schedulers are out of the native loop's scope, an encoder-only instance, and still pass;
#: its dynamic speculative decoding tests, in ``spec_decode``, build schedulers too).
LOOP_FILES = (
    "test_scheduler.py",
    "test_async_scheduler.py",
    "test_swa_inflight_window_free.py",
    "test_deferred_block_free.py",
    "test_priority_preemption_bug.py",
    "test_worker_slot_overflow.py",
    "test_prefix_replay.py",
    "../streaming_input/test_scheduler_streaming.py",
    "../spec_decode/test_dynamic_sd.py",
    # vLLM's KV connector tests that build schedulers (its loop over pagedkv's manager with one
    # full-attention group): P/D lifecycles, failed and invalid loads, offloading, ...
    *(
        f"../kv_connector/unit/test_{name}.py"
        for name in (
            "remote_prefill_lifecycle",
            "remote_decode_lifecycle",
            "invalid_blocks_correctness",
            "kv_load_failure_recovery",
            "kv_connector_lifecycle",
            "error_propagation",
            "cache_pollution_prevention",
            "scheduler_kv_connector_override",
            "offloading_connector",
            "multi_connector",
            "example_connector",
            "decode_bench_connector",
        )
    ),
)
#: ``VLLM_USE_V2_MODEL_RUNNER`` of each loop run, per series: both model runners' output
#: shapes are exercised. "1" (V2, the GPU default) where the release's configuration accepts it
#: without Triton (0.33; 0.32 refuses). (vLLM's ``create_scheduler`` also sets
#: ``scheduler.use_v2_model_runner`` after construction; the native loop reads it every step.)
RUNNER_MODES = {"0.33": ("0", "1"), "0.32": ("0",)}


def _in_files(name: str, files: tuple[str, ...]) -> bool:
    """Whether a table entry (``file::test``, the file's base name) names a test of ``files``."""
    return name.partition("::")[0] in {Path(f).name for f in files}


def not_run(series: str, manager_name: str) -> dict[str, str]:
    """The NOT_RUN table for this vLLM series and manager under test."""
    table = {
        name: reason
        for name, reason in vllm_not_run.ENVIRONMENT[series].items()
        if _in_files(name, FILES)
    }
    if manager_name != h.VLLM_MANAGER:
        table.update(vllm_not_run.PAGEDKV[series])
    return table


def scheduler_under_test_name() -> str:
    return os.environ.get(swap.SCHEDULER_ENV) or swap.DEFAULT_SCHEDULER


def loop_not_run(series: str, scheduler_name: str, runner: str = "0") -> dict[str, str]:
    """The NOT_RUN table of the run of :data:`LOOP_FILES` against ``scheduler_name`` with
    ``VLLM_USE_V2_MODEL_RUNNER=runner``."""
    table = {
        name: reason
        for name, reason in vllm_not_run.ENVIRONMENT[series].items()
        if _in_files(name, LOOP_FILES)
    }
    if runner == "1":
        table.update(vllm_not_run.ENVIRONMENT_V2_RUNNER[series])
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
    AsyncScheduler, once per model runner of :data:`RUNNER_MODES`; the plugin fails a run in
    which no step ran natively."""
    series = own.installed_series()
    name = scheduler_under_test_name()
    cls = swap._resolve(name)
    for runner in RUNNER_MODES[series]:
        junit = tmp_path / f"loop-runner-{runner}.xml"
        rc, out = own.run(
            LOOP_FILES,
            deselect=loop_not_run(series, name, runner),
            extra_args=["-q", "-rfEs", f"--junitxml={junit}"],
            env={swap.SCHEDULER_ENV: name, "VLLM_USE_V2_MODEL_RUNNER": runner},
        )
        run = f"VLLM_USE_V2_MODEL_RUNNER={runner}"
        assert f"pagedkv_swap: Scheduler = {cls.__module__}.{cls.__qualname__}," in out, out
        assert rc == 0, f"{run}:\n{out[-8000:]}"
        names, skipped = junit_cases(junit)
        assert not skipped, f"{run}: skipped (list them in vllm_not_run.py): {skipped}"
        assert len(names) > 150, f"{run}: only {len(names)} tests ran:\n{out[-3000:]}"
        assert "schedulers under test built" in out or "not counted" in out, out[-2000:]
        if name == swap.DEFAULT_SCHEDULER:
            native = re.search(r"schedule\(\): (\d+) native steps", out)
            assert native and int(native.group(1)) > 0, f"{run}:\n{out[-2000:]}"


def test_not_run_tables_name_tests_of_the_files_run() -> None:
    """Each entry names a test function of one of FILES in that series' sdist (LOOP: of
    LOOP_FILES; ENVIRONMENT: of either), by the file's base name, with a reason."""
    series = own.installed_series()
    core = own.tests_tree(series) / "tests" / "v1" / "core"
    sources = {Path(f).name: (core / f).read_text() for f in FILES + LOOP_FILES}
    tables = (
        (vllm_not_run.ENVIRONMENT[series], FILES + LOOP_FILES),
        (vllm_not_run.PAGEDKV[series], FILES),
        (vllm_not_run.LOOP[series], LOOP_FILES),
        (vllm_not_run.ENVIRONMENT_V2_RUNNER[series], LOOP_FILES),
    )
    for table, files in tables:
        for entry, reason in table.items():
            file, _, name = entry.partition("::")
            name = name.partition("[")[0]  # one parametrization: file::test[id]
            assert reason and _in_files(entry, files) and f"def {name}(" in sources[file], entry


def test_vllms_own_scheduler_runs_more_than_the_loop_table_allows() -> None:
    """vLLM's own Scheduler swapped in has only the ENVIRONMENT entries deselected."""
    series = own.installed_series()
    with_vllm = loop_not_run(series, swap.VLLM_SCHEDULER)
    with_pagedkv = loop_not_run(series, swap.DEFAULT_SCHEDULER)
    assert set(with_vllm) < set(with_pagedkv)
    assert not set(vllm_not_run.LOOP[series]) & set(vllm_not_run.ENVIRONMENT[series])
    assert set(vllm_not_run.ENVIRONMENT_V2_RUNNER[series]) <= set(
        loop_not_run(series, swap.VLLM_SCHEDULER, "1")
    )
    assert not vllm_not_run.ENVIRONMENT_V2_RUNNER[series] or "1" in RUNNER_MODES[series]


def test_vllms_own_manager_runs_more_than_the_pagedkv_table_allows() -> None:
    series = own.installed_series()
    with_vllm = not_run(series, h.VLLM_MANAGER)
    with_pagedkv = not_run(series, h.DEFAULT_MANAGER)
    assert set(with_vllm) < set(with_pagedkv)
    assert set(with_vllm) == {n for n in vllm_not_run.ENVIRONMENT[series] if _in_files(n, FILES)}
