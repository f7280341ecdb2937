"""Whole engine step on W1: pagedkv.Scheduler vs vLLM 0.4.2's own Scheduler, same run.

The model-free engine loop of :mod:`pagedkv.bench.vllm_scheduler` (what vLLM's LLMEngine does
around the scheduler: ``schedule()``, then the output processing of ``_process_model_outputs``)
drives three backends through the same W1 requests in one process, in lockstep (a step of each
in turn, so that machine noise falls on all three alike):

* ``vllm``: vLLM 0.4.2's Scheduler with its own classes (``pagedkv.vllm_release``);
* ``pagedkv-dropin``: vLLM 0.4.2's Scheduler code with pagedkv's Sequence family and manager;
* ``pagedkv-scheduler``: :class:`pagedkv.Scheduler` with pagedkv's Sequence family.

It reports the mean time of a whole step (schedule + output processing) and of ``schedule()``
alone, in microseconds, and the ratios to ``vllm``. Every backend must take the same number of
steps (a cheap check that they made the same decisions; tests/test_scheduler_differential.py
checks them step by step). GC is disabled while stepping, for all three alike.
(``pagedkv bench --compare vllm==0.4.2`` runs the same loop with each engine in a process of
its own: ``vllm_scheduler.compare_scheduler_step``.)

Run: ``python benches/bench_scheduler_step.py [--quick] [--caching on|off|both] [--steps N]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from typing import Any, Dict

from pagedkv.bench.vllm_scheduler import Engine, EngineConfig, make_backend
from pagedkv.bench.workload import W1_FULL, W1_QUICK, generate_w1

BACKENDS = ("vllm", "pagedkv-dropin", "pagedkv-scheduler")


def compare(cfg: Any, caching: bool, max_steps: int) -> Dict[str, Dict[str, float]]:
    """Step the three engines in lockstep (one step of each in turn), so that machine noise
    falls on all of them alike."""
    engines = {
        b: Engine(make_backend("0.4.2", b), EngineConfig.from_w1(cfg, caching)) for b in BACKENDS
    }
    requests = generate_w1(cfg).requests
    for e in engines.values():
        for req in requests:
            e.add(req)
    gc.collect()
    gc.disable()
    try:
        steps = 0
        while steps < max_steps and any(e.busy() for e in engines.values()):
            for e in engines.values():
                e.step()
            steps += 1
    finally:
        gc.enable()
    busy = {b: e.busy() for b, e in engines.items()}
    if len(set(busy.values())) != 1:
        raise AssertionError(f"backends finished at different steps: {busy}")
    return {
        b: {
            "steps": len(e.step_seconds),
            "step_us": statistics.fmean(e.step_seconds) * 1e6,
            "schedule_us": statistics.fmean(e.schedule_seconds) * 1e6,
        }
        for b, e in engines.items()
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
