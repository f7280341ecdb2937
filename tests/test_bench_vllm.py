"""``pagedkv bench --compare vllm==VERSION``: vLLM's own block manager and sequences, fetched
by pagedkv.vllm_release (the package index, as the README's test command needs anyway; a failed
fetch fails, it never skips), timed on the same workload and checked for provenance."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedkv import cli, vllm_release
from pagedkv.bench.backends import vllm_backend, vllm_provenance

QUICK = ["bench", "--quick", "--no-micro", "--no-progress", "--backends", "native"]


@pytest.mark.parametrize("version", vllm_release.SUPPORTED)
def test_compare_runs_vllms_own_manager_on_the_same_workload(version, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = [*QUICK, "--workloads", "w2", "--caching", "off", "--compare", f"vllm=={version}"]
    args.append("--no-scheduler")  # timed by test_scheduler_section_calls_the_whole_step_timing
    assert cli.main([*args, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"vllm-{version}: the files it runs" in text
    assert f"vs vLLM {version}" in text
    doc = json.loads(out.read_text())
    prov = doc["vllm"][f"vllm-{version}"]
    for f in ("vllm/core/block_manager_v1.py", "vllm/sequence.py", "vllm/block.py"):
        assert f in prov["vllm"]
    assert "vllm/_standins.py" in prov["stand-in"] and "vllm/config.py" in prov["extracted"]
    runs = {r["backend"]: r for r in doc["w2"]["runs"]}
    ours, theirs = runs["native"], runs[f"vllm-{version}"]
    assert theirs["step_us"]["mean"] > 0 and f"vllm-{version}" in ours["speedup_vs"]
    # W2 without caching: vLLM's manager and pagedkv's make the very same schedule, step by
    # step (free blocks, preemptions, copy-on-write, chunks)
    assert theirs["preempt_recompute"] > 0 and theirs["preempt_swap"] > 0
    for key in ("schedule_digest", "steps", "preempt_recompute", "preempt_swap", "cow_copies"):
        assert theirs[key] == ours[key], key
    assert doc["w2"]["cross_check"]["informational"]["caching_off"] == {
        f"vllm-{version}": "same schedule"
    }
    assert doc["scheduler"]["status"] == "not run (--no-scheduler)"


def test_backend_is_vllms_class():
    b = vllm_backend("0.4.2")
    mgr = b.make_manager(16, 8, 8, 0.01, False)
    assert type(mgr).__name__ == "BlockSpaceManagerV1"
    assert type(mgr).__module__.startswith("_vllm_0_4_2")
    seq = b.make_sequence(1, [1, 2, 3], 16)
    assert type(seq).__module__.startswith("_vllm_0_4_2") and seq.get_len() == 3


def test_provenance_is_checked_not_declared(tmp_path):
    """A file that no longer matches the release is no longer called vLLM's."""
    loaded = vllm_release.load("0.4.2", "vllm")
    copy = tmp_path / "release"
    shutil.copytree(vllm_release.fetch("0.4.2") / "vllm", copy / "vllm")
    target = copy / "vllm" / "core" / "block_manager_v1.py"
    target.write_text(target.read_text().replace("return", "return  # edited", 1))
    prov = vllm_provenance(loaded, copy)
    assert "vllm/core/block_manager_v1.py" not in prov["vllm"]
    assert "vllm/core/block_manager_v1.py" in prov["extracted"]
    assert "vllm/core/scheduler.py" in prov["vllm"]


def test_unsupported_version_is_an_error(capsys):
    assert cli.main([*QUICK, "--compare", "vllm==0.3.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "pagedkv bench: vllm==0.3.0 is not supported; choose from 0.4.2, 0.5.0"


def test_scheduler_section_calls_the_whole_step_timing(monkeypatch, tmp_path, capsys):
    """The hook for pagedkv.bench.vllm_scheduler (issue 8): called once per compared release
    and caching setting with the run's options, its result reported and saved."""
    import sys
    import types

    calls = []

    def compare_scheduler_step(version, caching=True, quick=False, seed=0):
        calls.append((version, caching, quick, seed))
        return {
            "version": version,
            "caching": caching,
            "workload": "W1_QUICK",
            "steps": 10,
            "backends": {
                "vllm": {"mean_step_us": 200.0, "median_step_us": 190.0, "total_s": 0.002},
                "pagedkv-dropin": {"mean_step_us": 50.0, "median_step_us": 45.0, "total_s": 5e-4},
            },
            "speedup": {"vllm": 1.0, "pagedkv-dropin": 4.0},
        }

    fake = types.ModuleType("pagedkv.bench.vllm_scheduler")
    fake.compare_scheduler_step = compare_scheduler_step
    monkeypatch.setitem(sys.modules, "pagedkv.bench.vllm_scheduler", fake)
    out = tmp_path / "r.json"
    args = [*QUICK, "--workloads", "", "--caching", "on", "--seed", "3", "--json", str(out)]
    assert cli.main([*args, "--compare", "vllm==0.4.2"]) == 0
    assert calls == [("0.4.2", True, True, 3)]
    assert "pagedkv-dropin   mean      50.0 us/step" in capsys.readouterr().out
    section = json.loads(out.read_text())["scheduler"]
    assert section["status"] == "ok" and section["runs"][0]["speedup"]["pagedkv-dropin"] == 4.0
    calls.clear()
    assert cli.main([*args, "--compare", "vllm==0.4.2", "--no-scheduler"]) == 0
    assert calls == [] and json.loads(out.read_text())["scheduler"]["status"].startswith("not run")


def test_a_release_that_cannot_be_fetched_is_a_one_line_error(tmp_path):
    """An empty cache and an index that refuses connections: exit status 2, one line."""
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "PAGEDKV_VLLM_CACHE": str(tmp_path / "cache"),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", *QUICK, "--compare", "vllm==0.4.2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert err.startswith("pagedkv bench: vllm==0.4.2: cannot fetch the release: ")
    assert "\n" not in err and proc.stdout == ""
