"""The ``pagedkv`` command line: ``pagedkv bench`` and ``pagedkv demo``.

The command tree is here; each subcommand's options and its run live with it
(:mod:`pagedkv.bench`, :mod:`pagedkv.demo`: ``add_arguments``, ``run``), imported when the
parser is built. Those modules import neither torch nor the benchmark's drivers until they run,
so ``pagedkv --help``, ``pagedkv demo --help`` and ``pagedkv bench --help`` work on a plain
``pip install pagedkv``. ``pagedkv demo`` needs torch; without it, it says how to get it and
exits with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

__all__ = ["build_parser", "main"]


def _run_demo(args: argparse.Namespace) -> int:
    from pagedkv import demo

    return demo.run(args)


def _run_bench(args: argparse.Namespace) -> int:
    from pagedkv import bench

    return bench.run(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``pagedkv`` parser with its subcommands. Each subcommand's package defines its
    options and imports nothing heavy until it runs (torch, the bench's drivers)."""
    from pagedkv import bench, demo

    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="pagedkv: Rust-accelerated KV-cache block management (vLLM-compatible).",
    )
    parser.add_argument("--version", action="version", version=f"pagedkv {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("bench", help=bench.HELP, description=bench.DESCRIPTION)
    bench.add_arguments(p)
    p.set_defaults(handler=_run_bench)
    p = sub.add_parser(
        "demo", help=demo.HELP, description=f"{demo.HELP} (needs {demo.TORCH_HINT})."
    )
    demo.add_arguments(p)
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
