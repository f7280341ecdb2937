"""``pagedkv bench --compare vllm==VERSION``: vLLM's own block manager and sequences, fetched
by pagedkv.vllm_release (the package index, as the README's test command needs anyway; a failed
fetch fails, it never skips), timed on the same workload and checked for provenance."""

from __future__ import annotations

import dataclasses
import json
import shutil
import types

import pytest

from pagedkv import cli, vllm_release
from pagedkv.bench.backends import Backend, vllm_backend, vllm_provenance
from pagedkv.bench.workload import WorkloadConfig, generate

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

    def compare_scheduler_step(
        version, caching=True, quick=False, seed=0, backends=("vllm", "pagedkv-dropin")
    ):
        calls.append((version, caching, quick, seed, tuple(backends)))
        return {
            "version": version,
            "caching": caching,
            "workload": "W1_QUICK",
            "backends": {
                name: {"steps": 10, "mean_step_us": us, "median_step_us": us, "total_s": us / 1e5}
                for name, us in (("vllm", 200.0), ("pagedkv-dropin", 50.0))
            },
            "speedup": {"vllm": 1.0, "pagedkv-dropin": 4.0},
        }

    fake = types.ModuleType("pagedkv.bench.vllm_scheduler")
    fake.compare_scheduler_step = compare_scheduler_step
    monkeypatch.setitem(sys.modules, "pagedkv.bench.vllm_scheduler", fake)
    out = tmp_path / "r.json"
    args = [*QUICK, "--workloads", "", "--caching", "on", "--seed", "3", "--json", str(out)]
    assert cli.main([*args, "--compare", "vllm==0.4.2"]) == 0
    # Against 0.4.2 the section also times pagedkv.Scheduler on the same engine loop.
    assert calls == [("0.4.2", True, True, 3, ("vllm", "pagedkv-dropin", "pagedkv-scheduler"))]
    assert "pagedkv-dropin        10 steps, mean      50.0 us/step" in capsys.readouterr().out
    section = json.loads(out.read_text())["scheduler"]
    assert section["status"] == "ok" and section["runs"][0]["speedup"]["pagedkv-dropin"] == 4.0
    calls.clear()
    disagreeing = compare_scheduler_step

    def compare_scheduler_step_disagreeing(*a, **kw):  # backends that differ: exit status 1
        return {**disagreeing(*a, **kw), "error": "the backends took different numbers of steps"}

    fake.compare_scheduler_step = compare_scheduler_step_disagreeing
    assert cli.main([*args, "--compare", "vllm==0.4.2"]) == 1
    assert "DECISIONS DIFFERED" in capsys.readouterr().out
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


# ------------------------------------------- the driver's chunked prefill against vLLM's own


class _Timeline:
    """Wraps a manager's allocate / fork / free / swap_out / swap_in to record, per step,
    ``(step, event, request_id)``; events are keyed by request (child sequence ids may be
    handed out in a different order)."""

    def __init__(self):
        self.step = 0
        self.events = []
        self.request_of = {}

    def wrap(self, mgr, setter):
        def allocate(group):
            for seq in group.get_seqs():
                self.request_of[seq.seq_id] = group.request_id
            self._log("alloc", group.request_id)
            return mgr.allocate(group)

        def fork(parent, child):
            self.request_of[child.seq_id] = self.request_of[parent.seq_id]
            self._log("fork", self.request_of[parent.seq_id])
            return mgr.fork(parent, child)

        def free(seq):
            self._log("free", self.request_of[seq.seq_id])
            return mgr.free(seq)

        def swap_out(group):
            self._log("swap_out", group.request_id)
            return mgr.swap_out(group)

        def swap_in(group, *args, **kwargs):
            self._log("swap_in", group.request_id)
            return mgr.swap_in(group, *args, **kwargs)

        for name, fn in (("allocate", allocate), ("fork", fork), ("free", free)):
            setter(name, fn)
        setter("swap_out", swap_out)
        setter("swap_in", swap_in)

    def _log(self, event, request_id):
        self.events.append((self.step, event, request_id))

    def by_step(self):
        return sorted(self.events)


def _vllm_timeline(version, cfg, workload):
    """The timeline of vLLM ``version``'s own Scheduler (chunked prefill) serving ``workload``
    through a model-free engine loop that samples the workload's predetermined tokens and forks
    n=2 requests after their prefill, as vLLM's output processor does."""
    v = vllm_release.load(version, "vllm")
    sched_cfg = v.config.SchedulerConfig(
        cfg.prefill_token_budget,
        cfg.max_num_seqs,
        cfg.prompt_len_max + cfg.output_len_max,
        enable_chunked_prefill=True,
    )
    cache_cfg = v.config.CacheConfig(cfg.block_size, 0.9, 0, "auto")
    cache_cfg.num_gpu_blocks, cache_cfg.num_cpu_blocks = cfg.num_gpu_blocks, cfg.num_cpu_blocks
    sched = v.scheduler.Scheduler(sched_cfg, cache_cfg, None)
    timeline = _Timeline()
    mgr = sched.block_manager
    real = {n: getattr(mgr, n) for n in ("allocate", "fork", "free", "swap_out", "swap_in")}
    timeline.wrap(types.SimpleNamespace(**real), lambda n, fn: setattr(mgr, n, fn))
    backend = vllm_backend(version)
    status, logprob = v.sequence.SequenceStatus, v.sequence.Logprob
    params = {n: v.sampling_params.SamplingParams(n=n, best_of=n) for n in (1, 2)}
    for r in workload.requests:  # arrival times in request order: FCFS is request order
        seq = backend.make_sequence(r.index, r.prompt_token_ids, cfg.block_size)
        sched.add_seq_group(backend.make_group(r.request_id, [seq], params[r.n], float(r.index)))
    requests = {r.request_id: r for r in workload.requests}
    next_id = len(workload.requests)
    while sched.has_unfinished_seqs():
        _, out = sched.schedule()
        for scheduled in out.scheduled_seq_groups:
            group = scheduled.seq_group
            group.update_num_computed_tokens(scheduled.token_chunk_size)
            if group.is_prefill():
                continue  # a chunk of the prompt: nothing sampled
            req = requests[group.request_id]
            seqs = group.get_seqs(status=status.RUNNING)
            if req.n == 2 and len(group.get_seqs()) == 1:
                child = seqs[0].fork(next_id)
                next_id += 1
                group.add(child)
                sched.fork_seq(seqs[0], child)
                seqs = [seqs[0], child]
            for row, seq in zip(req.output_token_ids, seqs):
                token = row[seq.get_output_len()]
                seq.append_token_id(token, {token: logprob(0.0)})
                if seq.get_output_len() >= req.output_len:
                    seq.status = status.FINISHED_LENGTH_CAPPED
                    sched.free_seq(seq)
        sched.free_finished_seq_groups()
        timeline.step += 1
        assert timeline.step < 20_000
    return timeline.by_step()


def _driver_timeline(cfg, workload):
    """The same timeline from the bench driver (per-sequence native backend)."""
    from pagedkv.bench.backends import resolve_backends
    from pagedkv.bench.driver import run

    (native,), _ = resolve_backends(["native"])
    timeline = _Timeline()

    def make_manager(*args):
        mgr = native.make_manager(*args)
        methods = {n: getattr(mgr, n) for n in dir(mgr) if not n.startswith("_")}
        timeline.wrap(mgr, methods.__setitem__)

        def get_num_free_gpu_blocks():  # the per-sequence driver asks once, ending each step
            timeline.step += 1
            return mgr.get_num_free_gpu_blocks()

        methods["get_num_free_gpu_blocks"] = get_num_free_gpu_blocks
        return types.SimpleNamespace(**methods)

    result = run(workload, Backend(**{**native.__dict__, "make_manager": make_manager}), False)
    return timeline.by_step(), result


CHUNKED = WorkloadConfig(
    name="C",
    num_requests=12,
    prompt_len_min=20,
    prompt_len_max=150,
    num_prefixes=0,
    prefix_share=0.0,
    output_len_min=1,
    output_len_max=40,
    n2_share=0.0,
    num_gpu_blocks=1024,
    num_cpu_blocks=64,
    watermark=0.0,
    max_num_seqs=5,
    prefill_token_budget=40,
    chunked_prefill=True,
)


@pytest.mark.parametrize("version", vllm_release.SUPPORTED)
@pytest.mark.parametrize(
    "case, changes",
    [
        ("roomy", {}),  # decodes, running chunks and new prompts compete for the budget
        ("recompute", {"num_gpu_blocks": 24}),  # ... and single-sequence groups are recomputed
        ("swap", {"num_gpu_blocks": 20, "n2_share": 0.5}),  # ... and forked groups swapped
    ],
)
def test_chunked_prefill_timeline_matches_vllms_scheduler(version, case, changes):
    """Step by step, the bench driver admits, forks, preempts (recompute or swap), swaps in and
    frees the same requests as vLLM's own chunked-prefill Scheduler with vLLM's own manager."""
    cfg = dataclasses.replace(CHUNKED, **changes)
    workload = generate(cfg, seed=1)
    ours, result = _driver_timeline(cfg, workload)
    assert result.partial_prefills > 5 and result.finished == cfg.num_requests
    if case == "recompute":
        assert result.preempt_recompute > 5
    if case == "swap":
        assert result.preempt_swap > 0
    assert ours == _vllm_timeline(version, cfg, workload)
