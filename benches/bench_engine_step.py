"""W1 whole engine step: the batch step (pagedkv.engine_step.BatchEngine) and the compat step
(pagedkv.Scheduler) vs vLLM 0.4.2's own Scheduler, same run.

The engines and the lockstep are :mod:`pagedkv.bench.wholestep` (the whole-step section of
``pagedkv bench --compare vllm==0.4.2``); this script runs only that section, on W1.

Reports µs per step, µs per running sequence (batch row) per step, and the ratios.
Run: ``python benches/bench_engine_step.py [--quick] [--caching on|off|both] [--steps N]``.
"""

from __future__ import annotations

import os

# numpy's BLAS threads spin after start-up; on a small shared machine they steal a core from
# whichever loop runs next. Nothing here uses BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402

from pagedkv.bench.report import format_whole_step  # noqa: E402
from pagedkv.bench.wholestep import TURN, run_whole_step  # noqa: E402
from pagedkv.bench.workload import W1_FULL, W1_QUICK, generate  # noqa: E402


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
    args = ap.parse_args(argv)
    workload = generate(W1_QUICK if args.quick else W1_FULL)
    runs = [
        run_whole_step(workload, caching, vllm=["0.4.2"], max_steps=args.steps, turn=args.turn)
        for caching in {"on": [True], "off": [False], "both": [True, False]}[args.caching]
    ]
    print(format_whole_step(runs))
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
