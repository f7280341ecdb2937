"""vLLM's own tests/v1/core tests, unmodified, against the KV cache manager under test
(vllm_own_tests.py fetches them; pagedkv_swap.py swaps the manager in before collection).

Every test of :data:`FILES` runs except those in :data:`NOT_RUN`, each with its reason: tests
of vLLM's private internals that pagedkv replaces, configurations outside pagedkv.vllm_v1's
scope (its Scheduler keeps vLLM's manager there), and tests that need what this machine lacks.
A skip inside fails the run as a failure does.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

import v1_harness as h
import vllm_own_tests as own

FILES = (
    "test_prefix_caching.py",
    "test_kv_cache_utils.py",
    "test_scheduler.py",
    "test_async_scheduler.py",
)

_MULTIMODAL = (
    "builds llava-hf/llava-1.5-7b-hf (processor, tokenizer) from the Hugging Face hub, "
    "unreachable here; multimodal encoder scheduling, not the KV cache manager"
)

#: vLLM's tests that are not run, with why (``file::test``; a test name without parameters
#: deselects all of its parametrizations). Finalized once pagedkv.vllm_v1 lands.
NOT_RUN: dict[str, str] = {}


def _run(tmp_path: Path) -> tuple[int, str, ET.Element]:
    junit = tmp_path / "own.xml"
    rc, out = own.run(
        FILES, deselect=NOT_RUN, extra_args=["-q", "-rs", f"--junitxml={junit}", "-x"]
    )
    assert junit.exists(), out[-6000:]
    return rc, out, ET.parse(junit).getroot()


def test_vllms_own_v1_core_tests_pass(tmp_path: Path) -> None:
    rc, out, junit = _run(tmp_path)
    cls = h.manager_under_test()
    assert f"pagedkv_swap: KVCacheManager = {cls.__module__}.{cls.__qualname__}" in out
    assert rc == 0, out[-8000:]
    skipped = [
        f"{c.get('classname')}::{c.get('name')}"
        for c in junit.iter("testcase")
        if c.find("skipped") is not None
    ]
    assert not skipped, f"skipped (list them in NOT_RUN with a reason instead): {skipped}"
    ran = sum(1 for _ in junit.iter("testcase"))
    assert ran > 500, f"only {ran} tests ran: {out[-3000:]}"
    assert "managers under test built" in out or "not counted" in out, out[-2000:]


def test_not_run_entries_name_real_tests() -> None:
    """Every NOT_RUN entry names a test function that exists in its file (no stale entries)."""
    tree = own.tests_tree(own.installed_series()) / "tests" / "v1" / "core"
    for entry, reason in NOT_RUN.items():
        file, _, name = entry.partition("::")
        assert file in FILES and reason, entry
        base = name.split("[")[0]
        text = (tree / file).read_text()
        assert f"def {base}(" in text, entry
    assert os.environ.get(h.MANAGER_ENV, h.DEFAULT_MANAGER)
