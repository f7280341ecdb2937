"""The bench's one harness (pagedkv.bench.harness.run_lockstep) and its adapters: the same
requests and step count for every engine, the timings each engine measured itself, and a
cross-check that catches an engine deciding otherwise (and reports, without failing, vLLM's)."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import pytest

from pagedkv.bench import harness, plot
from pagedkv.bench.harness import (
    EngineConfig,
    EngineUnderTest,
    InOwnProcess,
    StepRecord,
    run_lockstep,
)
from pagedkv.bench.workload import W1_QUICK, Request, generate

CONFIG = EngineConfig(16, 64, 16, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)


def _requests(n: int = 5) -> List[Request]:
    return [Request(i, f"r{i}", [1, 2, 3], 2 + i % 3, 1, None, 0.0, [[7] * 5]) for i in range(n)]


class Fifo(EngineUnderTest):
    """A toy engine: runs up to ``max_num_seqs`` requests, one token each per step, first come
    first served. ``shorten`` gives that request one token less (it decides otherwise);
    ``fail_at`` raises at that step; ``seconds`` is what every step reports having taken."""

    def __init__(self, name, baseline=False, shorten=None, fail_at=None, seconds=1.0):
        self.name, self.release, self.baseline = name, "0.4.2", baseline
        self.shorten, self.fail_at, self.seconds = shorten, fail_at, seconds
        self.setups: List[EngineConfig] = []
        self.closed = False

    def setup(self, config: EngineConfig) -> None:
        self.setups.append(config)
        self.limit, self.waiting, self.left, self.steps = config.max_num_seqs, [], {}, 0

    def add(self, request: Request) -> None:
        cut = request.index == self.shorten
        self.waiting.append(request.request_id)
        self.left[request.request_id] = request.output_len - cut

    def busy(self) -> bool:
        return bool(self.waiting)

    def step(self) -> StepRecord:
        if self.steps == self.fail_at:
            raise RuntimeError("boom")
        self.steps += 1
        running = self.waiting[: self.limit]
        done = []
        for rid in running:
            self.left[rid] -= 1
            if self.left[rid] == 0:
                done.append(rid)
                self.waiting.remove(rid)
        return StepRecord(self.seconds, tuple(running), tuple(done), rows=len(running))

    def close(self) -> None:
        self.closed = True


def test_same_requests_same_steps_and_the_engines_own_timings():
    a, b, c = Fifo("a", seconds=2.0), Fifo("b", seconds=0.5), Fifo("c", baseline=True)
    run = run_lockstep([a, b, c], CONFIG, _requests(), turn=3)
    assert run.ok and run.first_difference() is None
    assert a.setups == b.setups == c.setups == [CONFIG]
    assert all(e.closed for e in (a, b, c))
    assert run.steps == a.steps == b.steps == c.steps > 3
    # what the harness kept is what each engine said its steps took, not a time of its own
    assert run.lane("a").seconds == [2.0] * run.steps
    assert run.lane("b").seconds == [0.5] * run.steps
    assert sorted(run.lane("b").finished) == [f"r{i}" for i in range(5)]
    assert run.lane("a").rows[0] == 2


def test_arrivals_per_step_reach_every_engine_at_the_same_step():
    a, b = Fifo("a"), Fifo("b")
    run = run_lockstep([a, b], CONFIG, _requests(6), per_step=1, turn=2)
    assert run.ok
    # a request arrives each step: the first step saw only r0
    assert run.lane("a").rows[0] == run.lane("b").rows[0] == 1


@pytest.mark.parametrize("turn", [1, 4, None])
def test_an_engine_that_decides_otherwise_fails_the_run(turn):
    """One adapter given a wrong decision (a request a token short): the harness marks the
    first step its scheduled requests differ and the run is not ok."""
    a, b = Fifo("a"), Fifo("b", shorten=1)
    run = run_lockstep([a, b], CONFIG, _requests(), turn=turn)
    lane = run.lane("b")
    assert not run.ok
    assert lane.differs_at is not None and "scheduled other groups than a" in lane.error
    step, what = run.first_difference()
    assert step == lane.differs_at and "scheduled" in what


def test_a_baseline_that_decides_otherwise_is_reported_not_failed():
    a, vllm = Fifo("a"), Fifo("vllm-x", baseline=True, shorten=1)
    run = run_lockstep([a, vllm], CONFIG, _requests())
    assert run.ok
    assert run.lane("vllm-x").differs_at is not None and run.lane("vllm-x").error is None


def test_an_engine_that_raises_stops_alone():
    a, b, c = Fifo("a"), Fifo("b", baseline=True, fail_at=2), Fifo("c")
    run = run_lockstep([a, b, c], CONFIG, _requests())
    assert run.ok  # the baseline failed: reported
    assert run.lane("b").error == "step 2: RuntimeError: boom"
    assert len(run.lane("b").seconds) == 2 and len(run.lane("c").seconds) == run.steps
    bad = run_lockstep([Fifo("a"), Fifo("c", fail_at=1)], CONFIG, _requests())
    assert not bad.ok and bad.first_difference()[0] == 1


def test_an_engine_that_ends_busy_or_finishes_others_fails():
    class Lazy(Fifo):
        def step(self) -> StepRecord:
            rec = super().step()
            return dataclasses.replace(rec, finished=())

    run = run_lockstep([Fifo("a"), Lazy("b")], CONFIG, _requests())
    assert not run.ok and run.lane("b").error == "finished other requests than a"


def test_max_steps_and_turn_checks():
    run = run_lockstep([Fifo("a"), Fifo("b")], CONFIG, _requests(), max_steps=3)
    assert run.ok and run.steps == 3 and len(run.lane("b").seconds) == 3
    with pytest.raises(ValueError, match="turn must be >= 1"):
        run_lockstep([Fifo("a")], CONFIG, _requests(), turn=0)


def test_an_engine_in_its_own_process_steps_as_in_this_one():
    here = run_lockstep([Fifo("a"), Fifo("b", seconds=3.0)], CONFIG, _requests(), turn=2)
    there = run_lockstep(
        [Fifo("a"), InOwnProcess(Fifo("b", seconds=3.0))], CONFIG, _requests(), turn=2
    )
    assert there.ok and there.steps == here.steps
    assert there.lane("b").seconds == here.lane("b").seconds
    assert there.lane("b").finished == here.lane("b").finished
    failing = run_lockstep(
        [Fifo("a"), InOwnProcess(Fifo("b", fail_at=1))], CONFIG, _requests(), turn=2
    )
    assert "RuntimeError: boom" in failing.lane("b").error


# ------------------------------------------------------------------- the real adapters


SMALL_W1 = dataclasses.replace(W1_QUICK, num_requests=12)


@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
def test_compat_and_batch_paths_agree_through_the_harness(caching):
    workload = generate(SMALL_W1, seed=0)
    engines = [harness.make_path("compat"), harness.make_path("batch", stable_rows=True)]
    run = run_lockstep(
        engines, EngineConfig.from_workload(SMALL_W1, caching), workload.requests, turn=4
    )
    assert run.ok, run.first_difference()
    compat, batch = run.lanes
    assert len(compat.seconds) == run.steps and len(batch.seconds) == run.steps + 1
    assert len(compat.schedule_seconds) == run.steps and not batch.schedule_seconds
    assert (
        sorted(batch.finished)
        == sorted(compat.finished)
        == sorted(r.request_id for r in workload.requests)
    )
    assert all(s > 0 for s in compat.seconds + batch.seconds)


def test_the_detail_cross_check_catches_a_wrong_decision():
    """Two compat engines with the full per-step decisions (chunks, block tables, free
    blocks): one given a request a token short is caught at the step it differs."""
    from pagedkv.bench.vllm_042.vllm_scheduler import V0Engine, random_requests, scheduler_backend

    class Short(V0Engine):
        def add(self, request: Request) -> None:
            if request.index == 2:
                request = dataclasses.replace(request, output_len=request.output_len - 1)
            super().add(request)

    config = EngineConfig(
        4, 64, 48, max_num_seqs=24, max_num_batched_tokens=1024, max_model_len=1024
    )
    reqs = random_requests(20, seed=3, caching=False, block_size=4)
    good = [V0Engine(scheduler_backend(), name=n, detail=True) for n in ("a", "b")]
    assert run_lockstep(good, config, reqs, per_step=1).ok
    bad = [V0Engine(scheduler_backend(), name="a", detail=True)]
    bad.append(Short(scheduler_backend(), name="b", detail=True))
    run = run_lockstep(bad, config, reqs, per_step=1, stop_at_difference=True)
    step, what = run.first_difference()
    assert not run.ok and run.steps == step + 1 and "(a: " in what


def test_the_manager_replay_is_an_engine_under_test():
    from pagedkv.bench.vllm_042.backends import resolve_backends
    from pagedkv.bench.vllm_042.replay import ManagerReplay
    from pagedkv.bench.vllm_042.trace import record

    workload = generate(SMALL_W1, seed=0)
    trace = record(workload, True)
    (native,), _ = resolve_backends(["native"])
    engine = ManagerReplay(trace, native)
    run = run_lockstep([engine], EngineConfig.from_workload(SMALL_W1, True), workload.requests)
    assert run.ok and run.steps == len(trace.steps)
    assert run.lane("native").seconds == engine.step_times
    assert sorted(run.lane("native").finished) == sorted(r.request_id for r in workload.requests)


def test_registries_name_the_adapters():
    assert set(harness.PAGEDKV_PATHS) == {"compat", "batch"}
    assert harness.make_path("batch", incremental=True).incremental
    assert harness.make_path("compat").name == "compat"
    with pytest.raises(ValueError, match="no engine for vLLM 0.1"):
        harness.make_vllm("0.1")


# --------------------------------------------------------------------------- the headline


def _section(caching: bool, release: str, error: Optional[str] = None) -> dict:
    vllm = {"steps": 10, "release": release, "baseline": True}
    if error:
        vllm["error"] = error
    return {
        "caching": caching,
        "steps": 10,
        "lanes": {
            "compat": {"steps": 10, "release": "0.4.2", "baseline": False},
            "batch": {"steps": 11, "release": "0.4.2", "baseline": False},
            f"vllm-{release}": vllm,
        },
        "ratios": {f"compat_vs_vllm-{release}": 3.0, f"batch_vs_vllm-{release}": 30.0},
    }


def test_whole_step_bars_group_by_vllm_generation_with_a_bar_per_path():
    groups, bars = plot.whole_step_bars([_section(False, "0.4.2"), _section(True, "0.5.0", "x")])
    assert groups[0] == "vLLM 0.4.2\ncache off"
    assert groups[1] == "vLLM 0.5.0\ncache on\nfailed at step 10"
    assert bars == {"compat": [3.0, 3.0], "batch": [30.0, 30.0]}
    assert plot.whole_step_bars([]) == ([], {})


class FailsToStart(Fifo):
    """Takes a resource, then fails in ``setup`` (as a vLLM engine whose environment cannot
    import torchaudio does); its ``close`` needs nothing ``setup`` did not reach, and may
    itself fail (``close_fails``)."""

    def __init__(self, name, close_fails=False):
        super().__init__(name)
        self.close_fails = close_fails

    def setup(self, config: EngineConfig) -> None:
        self.taken = True
        raise RuntimeError(
            "Detected that PyTorch and TorchAudio were compiled\nwith different CUDA"
        )

    def close(self) -> None:
        self.closed = True
        if self.close_fails:
            raise OSError("cleanup failed too")


@pytest.mark.parametrize("close_fails", [False, True], ids=["clean-close", "close-raises"])
def test_an_engine_that_fails_to_start_is_one_error_naming_it_and_the_cause(close_fails):
    first, broken, never = Fifo("first"), FailsToStart("broken", close_fails), Fifo("never")
    with pytest.raises(harness.EngineStartError) as info:
        run_lockstep([first, broken, never], CONFIG, _requests())
    assert str(info.value) == (
        "engine broken failed to start: RuntimeError: Detected that PyTorch and TorchAudio were "
        "compiled with different CUDA"
    ), str(info.value)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value.__cause__, RuntimeError)
    # Every engine whose setup ran (even part-way) is closed; one never started is not; a
    # failing close does not replace the start error.
    assert first.closed and broken.closed and not never.closed and never.setups == []
