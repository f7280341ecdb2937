"""The core's hybrid KV cache coordinator (``rust/core/src/vllm_v1/coordinator.rs``, under
``_native.V1Hybrid``) against vLLM's own ``KVCacheManager``: the Rust test
``randomized_runs_keep_every_invariant`` writes every call it makes over sixteen layouts (full +
sliding window, + chunked local attention, different block sizes, caching off; each under
dense, zero and periodic ``prefix_cache_retention_interval``) and what came of it;
``scripts/hybrid_replay.py`` makes the same calls on this release's manager. Every hit (with
its shared-prefix junction), every new block id, every group's table of every request and the
whole free queue must agree. Needs cargo (the Rust toolchain that builds pagedkv)."""

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
    # And a junction moved in the trace (the core cached around the real one): the replay
    # reports the hit's junction as different at that line.
    lines = trace.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if _sparse_junction(line))
    call = list(ast.literal_eval(lines[at]))
    call[10] += 4
    planted = tmp_path / "junction.trace"
    planted.write_text("\n".join(lines[:at] + [repr(tuple(call))] + lines[at + 1 :]) + "\n")
    _, differences = replay(planted)
    assert differences and differences[0][:2] == (at + 1, "hit"), differences


def _sparse_junction(line: str) -> bool:
    """An admission with a junction, under zero retention (layouts 7 and up are sparse)."""
    call = ast.literal_eval(line)
    return call[0] == "new" and call[1] >= 7 and call[10] > 0 and call[9] is not None


def _admitted_with_blocks(line: str) -> bool:
    call = ast.literal_eval(line)
    return call[0] == "new" and call[9] is not None and any(call[9])
