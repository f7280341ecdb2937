"""The v1 measurement scripts of docs/benchmarks.md ("vLLM v1: the measurements behind the
native loop") run to completion inside a vLLM virtualenv (this interpreter) on their smallest
settings, and print what that page cites."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHES = ROOT / "benches"


def _run(argv: list) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cpu"),
        OPENBLAS_NUM_THREADS="1",
    )
    built = [*(ROOT / "python" / "pagedkv").glob("_native*.so")]  # `maturin develop`
    if built:
        env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(BENCHES / argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_profile_script_reports_the_step_split(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    proc = _run(
        [
            "profile_vllm_v1_step.py",
            "--quick",
            "--modes",
            "on,events",
            "--max-steps",
            "40",
            "--profile-steps",
            "5:20",
            "--json",
            str(out),
        ]
    )
    assert re.search(r"== on/native: 40 steps; step [\d.]+ us = schedule", proc.stdout)
    assert re.search(r"== on/vllm: 40 steps; step [\d.]+ us = schedule", proc.stdout)
    assert re.search(r"== events/vllm: 40 steps; step [\d.]+ us = schedule", proc.stdout)
    data = json.loads(out.read_text())
    for mode in ("on", "events"):
        # The printed line says what the JSON holds (the measurement itself is not judged:
        # the share moves with the machine's load), and the bound is 1 / (1 - share) exactly.
        bound = data["bounds"][mode]
        share, ratio = bound["vllm_manager_share"], bound["cost_free_manager_ratio"]
        assert ratio == pytest.approx(1 / max(1e-9, 1 - share))
        line = (
            f"vLLM's manager is {share:.0%} of its step, so a manager that cost nothing "
            f"would give {ratio:.2f}x"
        )
        assert re.search(rf"mode {mode}: vLLM step .*" + re.escape(line), proc.stdout), line
    assert data["runs"]["events/native"]["steps"] == 40
    native = data["runs"]["on/native"]
    assert native["steps"] == 40 and native["profile"]["steps_profiled"] == 15
    assert native["manager_calls_per_step"]["allocate_slots"] > 0
    assert "scheduler.py:schedule" in native["profile"]["groups_us_per_step"]


def test_outgrow_repro_shows_vllm_stalls_and_livelocks(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = _run(["vllm_v1_outgrow_repro.py", "--steps", "80", "--json", str(out)])
    by = {(r["case"], r["caching"], r["reserve_full_isl"]): r for r in json.loads(out.read_text())}
    # A prompt larger than the pool is never admitted with vLLM's default admission gate.
    assert by[("prompt>pool", True, True)]["verdict"] == "stalled"
    assert by[("prompt>pool", True, True)]["tokens_scheduled"] == 0
    # Without the gate and without caching it is prefilled, preempts itself, and starts over.
    assert by[("prompt>pool", False, False)]["verdict"] == "livelock"
    # A request that outgrows the pool while decoding is preempted and never resumes, and a
    # small request queued behind it never finishes either.
    small = by[("grow>pool+small", True, True)]
    assert small["verdict"] == "stalled" and small["finished_at"] == {}
    assert "stalled" in proc.stdout


@pytest.mark.vllm_cpu_build  # runs a model: deselected (never skipped) elsewhere, see conftest
def test_e2e_share_script_runs_a_dummy_model(tmp_path: Path) -> None:
    out = tmp_path / "e.json"
    proc = _run(["vllm_v1_e2e_share.py", "--native", "--requests", "6", "--json", str(out)])
    assert "scheduler share" in proc.stdout
    data = json.loads(out.read_text())
    assert data["manager"] == "pagedkv.vllm_v1._manager" and data["tokens"] > 0
    # Shares and seconds are measurements: their shape, not their values, is checked.
    assert isinstance(data["scheduler_share"], float) and isinstance(data["model_s"], float)


def test_the_drivers_import_no_vllm() -> None:
    """``import pagedkv``, ``pagedkv.bench`` and both generations' drivers leave vLLM unimported
    (each driver function imports it when called), here where vLLM is installed."""
    code = (
        "import sys, pagedkv, pagedkv.bench, pagedkv.bench.vllm_v1, pagedkv.bench.vllm_042.driver; "
        "sys.exit(1 if any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules) else 0)"
    )
    env = dict(os.environ)
    if [*(ROOT / "python" / "pagedkv").glob("_native*.so")]:
        env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
