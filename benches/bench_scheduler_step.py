"""Whole engine step on W1: pagedkv.Scheduler vs vLLM 0.4.2's own Scheduler, same run.

The model-free engine loop of :mod:`pagedkv.bench.vllm_042.vllm_scheduler` (what vLLM's
LLMEngine does around the scheduler: ``schedule()``, then the output processing of
``_process_model_outputs``) drives three backends through the same W1 requests in one
process, in lockstep (a step of each in turn, so that machine noise falls on all three alike):

* ``vllm``: vLLM 0.4.2's Scheduler with its own classes (``pagedkv.vllm_release``);
* ``pagedkv-dropin``: vLLM 0.4.2's Scheduler code with pagedkv's Sequence family and manager;
* ``pagedkv-scheduler``: :class:`pagedkv.Scheduler` with pagedkv's Sequence family.

It reports the mean time of a whole step (schedule + output processing) and of ``schedule()``
alone, in microseconds, and the ratios to ``vllm``. The engines are
:class:`pagedkv.bench.vllm_042.vllm_scheduler.V0Engine` adapters stepped by
:func:`pagedkv.bench.harness.run_lockstep`, one step of each in turn, which checks that every
step schedules the same groups (tests/test_scheduler_differential.py checks the decisions in
full). GC is disabled while stepping, for all three alike.
``vllm_scheduler.compare_scheduler_step`` runs the same loop with each engine in a process of
its own.

Run: ``python benches/bench_scheduler_step.py [--quick] [--caching on|off|both] [--steps N]``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Dict

from pagedkv.bench.harness import EngineConfig, run_lockstep
from pagedkv.bench.vllm_042.vllm_scheduler import V0Engine, make_backend
from pagedkv.bench.workload import W1_FULL, W1_QUICK, generate

BACKENDS = ("vllm", "pagedkv-dropin", "pagedkv-scheduler")


def compare(cfg: Any, caching: bool, max_steps: int) -> Dict[str, Dict[str, float]]:
    """Step the three engines in lockstep (one step of each in turn), so that machine noise
    falls on all of them alike."""
    engines = [V0Engine(make_backend("0.4.2", b)) for b in BACKENDS]
    config = EngineConfig.from_workload(cfg, caching)
    run = run_lockstep(engines, config, generate(cfg).requests, max_steps=max_steps)
    if not run.ok:
        raise AssertionError(f"the backends decided otherwise: {run.first_difference()}")
    return {
        lane.name: {
            "steps": len(lane.seconds),
            "step_us": statistics.fmean(lane.seconds) * 1e6,
            "schedule_us": statistics.fmean(lane.schedule_seconds) * 1e6,
        }
        for lane in run.lanes
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="W1 quick (96 requests)")
    ap.add_argument("--caching", choices=("on", "off", "both"), default="both")
    ap.add_argument("--steps", type=int, default=1_000_000, help="stop after N steps")
    args = ap.parse_args(argv)
    cfg = W1_QUICK if args.quick else W1_FULL
    for caching in {"on": [True], "off": [False], "both": [True, False]}[args.caching]:
        res = compare(cfg, caching, args.steps)
        base = res["vllm"]
        print(f"caching {'on' if caching else 'off'}: {base['steps']} steps")
        for b, r in res.items():
            print(
                f"  {b:17s} step {r['step_us']:9.1f} us  schedule {r['schedule_us']:9.1f} us"
                f"  whole-step speedup x{base['step_us'] / r['step_us']:.2f}"
                f"  schedule speedup x{base['schedule_us'] / r['schedule_us']:.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
