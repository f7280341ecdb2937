"""The core's hybrid KV cache coordinator (``rust/core/src/vllm_v1/coordinator.rs``, not yet
used by the bindings: hybrid models still get vLLM's manager) against vLLM's own
``KVCacheManager``: the Rust test ``randomized_runs_keep_every_invariant`` writes every call it
makes over seven layouts (full + sliding window, + chunked local attention, different block
sizes, caching off) and what came of it; ``scripts/hybrid_replay.py`` makes the same calls on
this release's manager. Every hit, every new block id, every group's table of every request
and the whole free queue must agree. Needs cargo (the Rust toolchain that builds pagedkv)."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_replay():
    spec = importlib.util.spec_from_file_location(
        "hybrid_replay", REPO / "scripts" / "hybrid_replay.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_core_hybrid_coordinator_matches_vllms_manager_call_by_call(tmp_path: Path) -> None:
    cargo = shutil.which("cargo")
    assert cargo, "cargo is needed to run the core's randomized hybrid run"
    trace = tmp_path / "hybrid.trace"
    env = {**os.environ, "PAGEDKV_HYBRID_TRACE": str(trace)}
    test = "vllm_v1::coordinator_tests::randomized_runs_keep_every_invariant"
    cmd = [cargo, "test", "-q", "-p", "pagedkv-core", "--lib", test, "--", "--exact"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    replay = load_replay().replay
    calls, differences = replay(trace)
    assert calls > 10_000, calls
    assert differences == [], differences
    # The replay sees a planted difference: one admission's new block ids changed.
    lines = trace.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if _admitted_with_blocks(line))
    call = list(ast.literal_eval(lines[at]))
    call[9] = [[b + 1 for b in group] for group in call[9]]
    lines[at] = repr(tuple(call))
    planted = tmp_path / "planted.trace"
    planted.write_text("\n".join(lines) + "\n")
    _, differences = replay(planted)
    assert any(line == at + 1 and what == "new blocks" for line, what, *_ in differences)


def _admitted_with_blocks(line: str) -> bool:
    call = ast.literal_eval(line)
    return call[0] == "new" and call[9] is not None and any(call[9])
