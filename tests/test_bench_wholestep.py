"""The whole-step section of ``pagedkv bench``: the batch step makes the compat step's
decisions on the bench workloads, and a batch step that does not is caught."""

from __future__ import annotations

import dataclasses

import pytest

from pagedkv.bench.vllm_042 import wholestep
from pagedkv.bench.vllm_042.trace import record
from pagedkv.bench.workload import W1_QUICK, W2_QUICK, generate

SMALL_W2 = dataclasses.replace(W2_QUICK, num_requests=24)


@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
@pytest.mark.parametrize("cfg", [W1_QUICK, SMALL_W2], ids=["w1", "w2"])
def test_batch_step_makes_the_compat_steps_decisions(cfg, caching):
    workload = generate(cfg, seed=0)
    run = wholestep.run_whole_step(workload, caching)
    assert run["ok"], run
    trace = record(workload, caching)
    # the same number of steps as the recorded schedule (the batch step takes one more call
    # to apply the last step's tokens), every request finished
    assert run["steps"] == len(trace.steps) == run["lanes"]["compat"]["steps"]
    assert run["lanes"]["batch"]["steps"] == run["steps"] + 1
    assert run["finished"] == cfg.num_requests
    rows = sum(s.rows for s in trace.steps)
    assert run["rows_per_step"] == pytest.approx(rows / len(trace.steps))
    for lane in run["lanes"].values():
        assert lane["mean_us"] > 0 and lane["us_per_row"] > 0 and "error" not in lane


@pytest.mark.parametrize("turn", [1, 7, 16])
def test_a_batch_step_that_decides_otherwise_is_caught(monkeypatch, turn):
    """One request given one token less in the batch engine finishes a step early: the next
    step's groups differ from the compat step's, and the section says so (exit status 1)."""
    real_add = wholestep.BatchStepEngine.add

    def add(self, req):
        if req.index == 3:
            req = dataclasses.replace(req, output_len=req.output_len - 1)
        real_add(self, req)

    monkeypatch.setattr(wholestep.BatchStepEngine, "add", add)
    run = wholestep.run_whole_step(generate(W1_QUICK, seed=0), False, turn=turn)
    assert not run["ok"] and run["turn"] == turn
    assert "scheduled other groups" in run["lanes"]["batch"]["error"]


@pytest.mark.parametrize("turn", [1, 16])
def test_max_steps_stops_every_lane(turn):
    run = wholestep.run_whole_step(generate(W1_QUICK, seed=0), True, max_steps=40, turn=turn)
    assert run["ok"] and run["steps"] == 40
    assert run["lanes"]["compat"]["steps"] == 40 and run["lanes"]["batch"]["steps"] == 41


def test_turn_must_be_positive():
    with pytest.raises(ValueError, match="turn must be >= 1"):
        wholestep.run_whole_step(generate(W1_QUICK, seed=0), True, turn=0)
