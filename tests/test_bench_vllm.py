"""``pagedkv bench --compare vllm==VERSION``: vLLM's own block manager, sequences and scheduler,
fetched by pagedkv.vllm_release (the package index, as the README's test command needs anyway;
a failed fetch fails, it never skips), timed on the same workload and checked for provenance;
and the bench's recorded schedule against vLLM 0.4.2's own Scheduler."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from pagedkv import cli, vllm_release
from pagedkv.bench.vllm_042.backends import vllm_backend, vllm_provenance
from pagedkv.bench.workload import W1_QUICK, W2_QUICK, generate

QUICK = ["bench", "--quick", "--no-micro", "--no-progress", "--backends", "native"]


@pytest.mark.parametrize("version", vllm_release.SUPPORTED)
def test_compare_runs_vllms_own_manager_on_the_same_workload(version, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = [*QUICK, "--workloads", "w2", "--caching", "off", "--compare", f"vllm=={version}"]
    args.append("--no-scheduler")  # timed by test_whole_step_against_vllms_own_scheduler
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
        f"vllm-{version}": "same calls and free counts"
    }
    assert theirs["mismatch"] is None  # replayed step by step: no divergence
    assert set(doc["w2"]["whole_step"][0]["lanes"]) == {"compat", "batch"}


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
    assert err == (
        "pagedkv bench: vllm==0.3.0 is not supported; choose from 0.4.2, 0.5.0, 0.32.0, 0.33.0"
    )


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


# ------------------------------- the bench's recorded schedule against vLLM 0.4.2's own


@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
@pytest.mark.parametrize(
    "case, cfg",
    [
        ("w1", W1_QUICK),  # whole prompts, prefills and decodes in separate steps
        # chunked prefill and recompute preemption (no n=2: vLLM's chunked policy fails on
        # forked groups, docs/scheduler.md)
        ("w2-chunked", dataclasses.replace(W2_QUICK, n2_share=0.0)),
        # forks, copy-on-write, swap and recompute preemption, swap-ins
        (
            "w2-whole",
            dataclasses.replace(W2_QUICK, chunked_prefill=False, prefill_token_budget=4096),
        ),
    ],
)
def test_recorded_schedule_equals_vllms_scheduler(case, cfg, caching):
    """Every step the bench records from pagedkv.Scheduler (the calls it replays onto each
    block manager: victims and their order, appends, swap-ins, admissions, the scheduled
    groups and chunks, forks, tokens, finishes, and the free GPU/CPU blocks after the step)
    equals what the same recorder reads off vLLM 0.4.2's own Scheduler, with its own
    sequences and BlockSpaceManagerV1, on the same workload."""
    from pagedkv.bench.vllm_042.trace import record
    from pagedkv.bench.vllm_042.vllm_scheduler import make_backend

    workload = generate(cfg, seed=0)
    ours = record(workload, caching).steps
    theirs = record(workload, caching, backend=make_backend("0.4.2", "vllm")).steps
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        # vLLM's manager does not count prefix-cache hits; everything else must be equal
        assert dataclasses.replace(a, prefix=None) == b, f"step {i}"
    victims = [mode for s in ours for _, mode in s.victims]
    if case == "w2-chunked":
        assert "recompute" in victims and any(c > 1 for s in ours for _, c in s.scheduled[1:])
    if case == "w2-whole":
        assert {"recompute", "swap"} <= set(victims) and any(s.swapped_in for s in ours)
        assert any(fork for s in ours for _, fork, _ in s.outputs)


def test_whole_step_against_vllms_own_scheduler(tmp_path, capsys):
    """``--compare vllm==0.4.2`` adds vLLM's own Scheduler to the whole-step section, in the
    same run: on W1 it makes the compat step's decisions; on W2 (chunked, n=2) it hits its own
    failures, which are reported while the run goes on."""
    out = tmp_path / "r.json"
    args = [*QUICK, "--caching", "off", "--compare", "vllm==0.4.2", "--json", str(out)]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "Whole engine step" in text and "vllm-0.4.2" in text
    doc = json.loads(out.read_text())
    (w1,) = doc["w1"]["whole_step"]
    assert set(w1["lanes"]) == {"compat", "batch", "vllm-0.4.2"} and w1["ok"]
    theirs = w1["lanes"]["vllm-0.4.2"]
    assert "error" not in theirs and "decisions_differ_at_step" not in theirs
    assert theirs["steps"] == w1["lanes"]["compat"]["steps"] == w1["steps"]
    assert w1["ratios"]["batch_vs_vllm-0.4.2"] > 0 and w1["ratios"]["compat_vs_vllm-0.4.2"] > 0
    (w2,) = doc["w2"]["whole_step"]
    assert w2["ok"] and "decisions_differ_at_step" in w2["lanes"]["vllm-0.4.2"]
    assert "decisions differ from step" in text
    assert cli.main([*args, "--no-scheduler"]) == 0
    assert set(json.loads(out.read_text())["w1"]["whole_step"][0]["lanes"]) == {"compat", "batch"}
