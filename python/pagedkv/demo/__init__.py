"""``pagedkv demo``: a tiny paged-attention engine whose every logit matches a dense forward.

This module is the command (its options, :func:`run`, :func:`main`) and imports nothing heavy,
so that ``pagedkv demo --help`` works without torch; the engine and the check are
:mod:`pagedkv.demo.engine` (needs torch), imported when the demo runs.

CLI: ``pagedkv demo [--device D] [--dtype T] [--requests N] [--seed S] [--path P] [--quiet]``
(also ``python -m pagedkv.demo``).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

__all__ = [
    "DEFAULT_REQUESTS",
    "DTYPES",
    "HELP",
    "MIN_REQUESTS",
    "PATHS",
    "TORCH_HINT",
    "add_arguments",
    "main",
    "run",
]

HELP = "serve requests through a paged engine and check every logit against a dense forward"

#: What to install when the demo needs torch.
TORCH_HINT = "pip install 'pagedkv[torch]'"

#: ``--dtype`` choices (:mod:`pagedkv.demo.engine` maps each to a torch dtype).
DTYPES = ("bf16", "bfloat16", "float16", "float32", "fp16", "fp32")

#: ``--path`` choices: how the demo engine drives pagedkv.Scheduler (the batch step,
#: ``BatchEngine.step``, or the vLLM-compatible ``schedule()`` and its metadata).
PATHS = ("batch", "compat")

#: The default and the least number of requests (fewer cannot show both a swap and a
#: recompute preemption).
DEFAULT_REQUESTS = 6
MIN_REQUESTS = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pagedkv demo`` (torch-free, so that help works without torch)."""
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="model/cache dtype")
    parser.add_argument(
        "--requests",
        type=int,
        default=DEFAULT_REQUESTS,
        help=f"number of requests (>= {MIN_REQUESTS}, default {DEFAULT_REQUESTS})",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload and model seed")
    parser.add_argument(
        "--path",
        default="batch",
        choices=PATHS,
        help="drive pagedkv.Scheduler through the batch step (default) or schedule()",
    )
    parser.add_argument("--quiet", action="store_true", help="print only failures")


def run(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments: 0 if every check passed, 1 if one failed (or torch
    is missing), 2 for bad arguments."""
    if args.requests < MIN_REQUESTS:
        print(
            f"pagedkv demo: --requests must be >= {MIN_REQUESTS} "
            "(fewer cannot show a swap and a recompute preemption)",
            file=sys.stderr,
        )
        return 2
    try:
        from pagedkv.demo import engine
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "torch":
            raise
        print(f"pagedkv demo needs torch, which is not installed: {TORCH_HINT}", file=sys.stderr)
        return 1
    return engine.run_command(args)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m pagedkv.demo``: the same as ``pagedkv demo``."""
    parser = argparse.ArgumentParser(prog="pagedkv demo", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))
