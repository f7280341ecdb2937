"""The ``pagedkv`` command line: ``pagedkv bench`` and ``pagedkv demo``.

Building the parser imports neither torch nor the benchmark's drivers, so ``pagedkv --help``,
``pagedkv demo --help`` and ``pagedkv bench --help`` work on a plain ``pip install pagedkv``.
``pagedkv demo`` needs torch; without it, it says how to get it and exits with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

__all__ = [
    "DEMO_DTYPES",
    "DEMO_PATHS",
    "TORCH_HINT",
    "add_demo_arguments",
    "build_parser",
    "main",
]

#: What to install when a subcommand needs torch.
TORCH_HINT = "pip install 'pagedkv[torch]'"

#: ``pagedkv demo --dtype`` choices (pagedkv.demo maps each to a torch dtype).
DEMO_DTYPES = ("bf16", "bfloat16", "float16", "float32", "fp16", "fp32")

#: ``pagedkv demo --path`` choices: how the demo engine drives pagedkv.Scheduler (the batch
#: step, ``BatchEngine.step``, or the vLLM-compatible ``schedule()`` and its metadata).
DEMO_PATHS = ("batch", "compat")

#: ``pagedkv demo``: the default and the least number of requests (fewer cannot show both a
#: swap and a recompute preemption); pagedkv.demo checks its DemoConfig against these.
DEMO_DEFAULT_REQUESTS = 6
DEMO_MIN_REQUESTS = 5

BENCH_HELP = "benchmark the native block manager against the pure-Python reference (and vLLM)"
DEMO_HELP = "serve requests through a paged engine and check every logit against a dense forward"


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pagedkv demo`` (torch-free, so that help works without torch)."""
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=DEMO_DTYPES, help="model/cache dtype")
    parser.add_argument(
        "--requests",
        type=int,
        default=DEMO_DEFAULT_REQUESTS,
        help=f"number of requests (>= {DEMO_MIN_REQUESTS}, default {DEMO_DEFAULT_REQUESTS})",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload and model seed")
    parser.add_argument(
        "--path",
        default="batch",
        choices=DEMO_PATHS,
        help="drive pagedkv.Scheduler through the batch step (default) or schedule()",
    )
    parser.add_argument("--quiet", action="store_true", help="print only failures")


def _run_demo(args: argparse.Namespace) -> int:
    try:
        from pagedkv import demo
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "torch":
            raise
        print(f"pagedkv demo needs torch, which is not installed: {TORCH_HINT}", file=sys.stderr)
        return 1
    return demo.run(args)


def _run_bench(args: argparse.Namespace) -> int:
    from pagedkv import bench

    return bench.run(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``pagedkv`` parser with its subcommands (imports nothing heavy)."""
    from pagedkv import bench

    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="pagedkv: Rust-accelerated KV-cache block management (vLLM-compatible).",
    )
    parser.add_argument("--version", action="version", version=f"pagedkv {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("bench", help=BENCH_HELP, description=bench.DESCRIPTION)
    bench.add_arguments(p)
    p.set_defaults(handler=_run_bench)
    p = sub.add_parser("demo", help=DEMO_HELP, description=f"{DEMO_HELP} (needs {TORCH_HINT}).")
    add_demo_arguments(p)
    p.set_defaults(handler=_run_demo)
    return parser


def _version() -> str:
    try:
        from pagedkv import __version__
    except ImportError:  # the native module is missing (a broken install)
        return "unknown (native module not importable)"
    return __version__


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:  # bare ``pagedkv``: say what there is
        parser.print_help()
        return 0
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (``pagedkv bench | head``): stop quietly, as other CLI tools do;
        # stdout is pointed at devnull so the interpreter's final flush cannot fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
