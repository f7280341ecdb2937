"""Every script in ``benches/`` that the README or docs cite runs to completion.

The scripts are not imported by the package, so nothing else would notice when a refactor of
``pagedkv.bench`` breaks one (``benches/bench_engine_step.py`` once imported an engine class
that had moved). Each runs here on its smallest setting, in a subprocess, and must exit 0 and
print the line that carries its result.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"

# (script and arguments, a pattern its output must contain)
CASES = [
    (
        ["bench_engine_step.py", "--quick", "--steps", "30", "--caching", "on"],
        r"batch\s+\d+\s",
    ),
    (
        ["bench_scheduler_step.py", "--quick", "--steps", "30", "--caching", "on"],
        r"pagedkv-scheduler\s+step\s+[\d.]+ us",
    ),
    (
        ["vllm_scheduler_compare.py", "--requests", "20"],
        r"made identical decisions",
    ),
    (["vllm_scheduler_compare.py", "--time", "--quick"], r'"pagedkv-dropin": [\d.]+'),
    (["rss_growth.py", "--ops", "20000", "--every", "10000"], r"growth after warm-up"),
    (["release_order.py"], r"released out of access order: +[\d.]+ ms per round"),
]


@pytest.mark.parametrize(("argv", "expect"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bench_script_runs(argv: list, expect: str) -> None:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(BENCHES / argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert re.search(expect, proc.stdout), proc.stdout[-2000:]
