"""Run vLLM's own Scheduler (vLLM 0.4.2 or 0.5.0, fetched and loaded by ``pagedkv.vllm_release``;
nothing needs to be installed) over two backends on the same requests and check that every
step schedules the same thing: vLLM's own classes against pagedkv dropped in (pagedkv's
Sequence family and BlockSpaceManager), or with ``--manager-only`` against vLLM's own Sequence
objects on pagedkv's BlockSpaceManager.

Per step it compares the scheduled requests (prefill/decode, chunk sizes), the block tables
handed to the workers (after renumbering blocks in order of first appearance: vLLM's free list
order after a free depends on object addresses), the computed-block counts, swap-in/swap-out/
copy sizes, the ignored requests and the free block counts. Without caching the pool is small,
so requests are preempted by recompute and by swapping; with ``--caching`` prompts are whole
blocks and the pool is large. ``--time`` instead times the whole engine step (``schedule()`` +
output processing) of both backends on W1 (``--quick``: W1_QUICK), in the same run.

The engine loop is :mod:`pagedkv.bench.vllm_042.vllm_scheduler`.
Run: ``python benches/vllm_scheduler_compare.py [--version V] [--requests N] [--seed S]
[--caching] [--chunked-prefill] [--manager-only] [--time [--quick]]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pagedkv.bench.vllm_042 import vllm_scheduler


def run(
    requests: int,
    seed: int,
    caching: bool = False,
    pagedkv_sequences: bool = True,
    version: str = "0.4.2",
    chunked_prefill: bool = False,
) -> int:
    other = "pagedkv-dropin" if pagedkv_sequences else "pagedkv-manager"
    steps, problem = vllm_scheduler.compare_decisions(
        version,
        ("vllm", other),
        requests=requests,
        seed=seed,
        caching=caching,
        chunked_prefill=chunked_prefill,
    )
    if problem:
        print(problem)
        return 1
    print(
        f"vLLM {version}'s Scheduler made identical decisions with its own classes and with "
        f"{other} over {steps} steps ({requests} requests, seed {seed}, caching "
        f"{'on' if caching else 'off'}, chunked prefill {'on' if chunked_prefill else 'off'})"
    )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.4.2", choices=("0.4.2", "0.5.0"))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--caching", action="store_true")
    ap.add_argument("--chunked-prefill", action="store_true")
    ap.add_argument("--manager-only", action="store_true", help="vLLM's own Sequence objects")
    ap.add_argument("--time", action="store_true", help="time the whole step on W1 instead")
    ap.add_argument("--quick", action="store_true", help="with --time: W1_QUICK")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # vLLM's preemption warnings
    if args.time:
        result = vllm_scheduler.compare_scheduler_step(args.version, args.caching, args.quick)
        print(json.dumps(result, indent=2))
        return 1 if "error" in result else 0
    return run(
        args.requests,
        args.seed,
        args.caching,
        not args.manager_only,
        args.version,
        args.chunked_prefill,
    )


if __name__ == "__main__":
    sys.exit(main())
