"""Proposes NOT_RUN entries for vLLM's tests/v1/core tests (a maintenance aid, not a test).

Reads each test function's source (decorators included) in the cached tests tree of the
installed vLLM and reports, per test, the first rule below its text matches: what it exercises
that pagedkv.vllm_v1 replaces natively, or leaves to vLLM's own manager (out of scope). The
result is a proposal to review into test_vllm_own_tests.py's tables, never applied blindly.

Usage (inside a vLLM virtualenv): ``python tests/vllm_v1/classify_vllm_tests.py [FILE ...]``
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import vllm_own_tests as own

#: (pattern, reason): the first match wins.
RULES = (
    (
        r"\bBlockPool\(|FreeKVCacheBlockQueue|BlockHashToBlockMap",
        "tests vLLM's BlockPool / free-block queue classes, which pagedkv replaces natively",
    ),
    (
        r"SlidingWindowSpec|new_sliding_window_spec|MambaSpec|new_mamba_spec|ChunkedLocal"
        r"|CrossAttentionSpec|MLAAttentionSpec|new_mla_spec|hybrid|Hybrid",
        "not one full-attention KV cache group: Mamba, cross-attention or MLA are out of "
        "pagedkv.vllm_v1's scope (vLLM's manager); full + sliding window / chunked local "
        "run pagedkv's hybrid manager, any retention (review: may run)",
    ),
    (
        r"use_kv_connector|kv_connector|Connector|hisparse|HiSparse",
        "a KV connector: vLLM's loop runs over pagedkv's manager; beside Mamba layers "
        "pagedkv's Scheduler keeps vLLM's manager (review: may run)",
    ),
    (
        r"use_eagle=True|eagle",
        "EAGLE: out of pagedkv.vllm_v1's scope (its Scheduler keeps vLLM's manager)",
    ),
    (
        r"dcp_world_size|pcp_world_size|decode_context_parallel",
        "DCP/PCP > 1: out of pagedkv.vllm_v1's scope",
    ),
    (
        r"\.coordinator\b|single_type_managers|req_to_blocks|\.block_pool\.|free_block_queue"
        r"|cached_block_hash_to_block",
        "reads vLLM's manager internals (coordinator, block pool, per-request block maps)",
    ),
)


def test_functions(path: Path) -> dict[str, str]:
    """name -> source (with decorators) of each module-level test function."""
    text = path.read_text()
    tree = ast.parse(text)
    lines = text.splitlines()
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith(
            "test"
        ):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            out[node.name] = "\n".join(lines[start - 1 : node.end_lineno])
    return out


def classify(source: str) -> str | None:
    for pattern, reason in RULES:
        if re.search(pattern, source):
            return reason
    return None


def main(files: list[str]) -> None:
    core = own.tests_tree(own.installed_series()) / "tests" / "v1" / "core"
    for file in files:
        for name, source in test_functions(core / file).items():
            reason = classify(source)
            if reason:
                print(f"    {file + '::' + name!r}: {reason!r},")


if __name__ == "__main__":
    main(sys.argv[1:] or ["test_prefix_caching.py", "test_scheduler.py", "test_async_scheduler.py"])
