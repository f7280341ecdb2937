"""The ``pagedkv`` command line.

Subcommands are modules listed in :data:`SUBCOMMANDS`; each provides
``add_arguments(parser)`` and ``run(args) -> int`` (and optionally a one-line ``HELP``). Adding
one is a single entry here (or a call to :func:`register_subcommand`). A listed module that is
not installed still shows up, and running it prints "not available".
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Dict, List, Optional, Tuple

__all__ = ["SUBCOMMANDS", "register_subcommand", "build_parser", "main"]

#: subcommand -> (module implementing it, fallback help line)
SUBCOMMANDS: Dict[str, Tuple[str, str]] = {
    "bench": ("pagedkv.bench", "benchmark the native block manager against the reference"),
    "demo": ("pagedkv.demo", "run the demo"),
}


def register_subcommand(name: str, module: str, help: str = "") -> None:  # noqa: A002
    """Add (or replace) a subcommand implemented by ``module``."""
    SUBCOMMANDS[name] = (module, help)


def _load(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        # only "this subcommand is not installed"; a broken import inside it must surface
        if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
            return None
        raise


def _not_available(name: str, module: str):
    def run(args: argparse.Namespace) -> int:
        print(f"pagedkv {name}: not available ({module} is not installed)", file=sys.stderr)
        return 1

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="pagedkv: Rust-accelerated KV-cache block management (vLLM-compatible).",
    )
    try:
        from pagedkv import __version__

        parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    except ImportError:  # pragma: no cover - the native module is missing
        pass
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, fallback_help) in SUBCOMMANDS.items():
        mod = _load(module)
        if mod is None:
            p = sub.add_parser(name, help=f"{fallback_help} (not available)")
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            p.set_defaults(_run=_not_available(name, module))
            continue
        p = sub.add_parser(name, help=getattr(mod, "HELP", fallback_help))
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
