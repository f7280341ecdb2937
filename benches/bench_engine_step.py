"""W1 whole engine step: the batch step (pagedkv.engine_step.BatchEngine) and the compat step
(pagedkv.Scheduler) vs vLLM 0.4.2's own Scheduler, same run; and the batch step's scaling.

The engines and the lockstep are :mod:`pagedkv.bench.vllm_042.wholestep` (the whole-step section of
``pagedkv bench --compare vllm==0.4.2``); this script runs only that section, on W1, and
reports µs per step, µs per running sequence (batch row) per step, and the ratios.

``--scale`` runs the sweeps of ``pagedkv bench --scale`` (:mod:`pagedkv.bench.scaling`) with
the batch step alone (no manager replay, no vLLM): W1 scaled x1, x4, x16 (requests, running
limit, GPU and CPU pools, token budget; x4 is the issue's 4,096 requests, 1,024 running,
262,144 GPU blocks, so the base pool is 65,536 GPU blocks rather than W1's 24,576) and the
pool alone (the x1 batch with x1, x4, x16 GPU blocks), with plain buffers, incremental ones
and incremental ones with stable rows (``--buffers``); µs per running sequence per step over
the decode-only steps (no prefill in the step: the steady state). ``--scale-steps N`` caps
each run (default: to completion).

Run: ``python benches/bench_engine_step.py [--quick] [--caching on|off|both] [--steps N]
[--turn N] [--buffers plain|incremental|stable]`` (the whole step's batch buffers; default
``all`` means plain there) or ``python benches/bench_engine_step.py --scale
[--buffers plain|incremental|stable|both|all] [--scale-steps N]``.
"""

from __future__ import annotations

import os

# numpy's BLAS threads spin after start-up; on a small shared machine they steal a core from
# whichever loop runs next. Nothing here uses BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402

from pagedkv.bench.report import format_whole_step  # noqa: E402
from pagedkv.bench.scaling import format_scaling, run_scaling  # noqa: E402
from pagedkv.bench.vllm_042.wholestep import TURN, run_whole_step  # noqa: E402
from pagedkv.bench.workload import W1_FULL, W1_QUICK, generate  # noqa: E402

CACHING = {"on": [True], "off": [False], "both": [True, False]}
BUFFERS = {
    "plain": ("plain",),
    "incremental": ("incremental",),
    "stable": ("stable",),
    "both": ("plain", "incremental"),
    "all": ("plain", "incremental", "stable"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="W1 quick (96 requests)")
    ap.add_argument("--caching", choices=("on", "off", "both"), default="both")
    ap.add_argument("--steps", type=int, default=None, help="stop after N steps")
    ap.add_argument(
        "--turn",
        type=int,
        default=TURN,
        help=f"steps of one engine before the next one's (default {TURN}; 1: strict alternation)",
    )
    ap.add_argument("--scale", action="store_true", help="the scaling sweeps (batch step only)")
    ap.add_argument(
        "--buffers",
        choices=tuple(BUFFERS),
        default="all",
        help="--scale: the batch step's buffers (stable: incremental with stable rows); "
        "whole step: plain, or incremental / stable",
    )
    ap.add_argument("--scale-steps", type=int, default=1_000_000, help="cap each scale run")
    args = ap.parse_args(argv)
    if args.scale:
        for caching in CACHING[args.caching]:
            doc = run_scaling(
                [],
                args.quick,
                max_steps=args.scale_steps,
                buffers=BUFFERS[args.buffers],
                caching=caching,
            )
            print(format_scaling(doc), flush=True)
        return 0
    workload = generate(W1_QUICK if args.quick else W1_FULL)
    runs = [
        run_whole_step(
            workload,
            caching,
            vllm=["0.4.2"],
            max_steps=args.steps,
            turn=args.turn,
            incremental=args.buffers in ("incremental", "stable"),
            stable_rows=args.buffers == "stable",
        )
        for caching in CACHING[args.caching]
    ]
    print(format_whole_step(runs))
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
