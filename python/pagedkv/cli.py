"""The ``pagedkv`` command line.

Subcommands are modules listed in :data:`SUBCOMMANDS`; each provides
``add_arguments(parser)`` and ``run(args) -> int`` (and optionally a one-line ``HELP``), or just
``main(argv) -> int``, which then receives the subcommand's arguments unparsed. Adding one is a
single entry here (or a call to :func:`register_subcommand`). A listed module that is
not installed still shows up, and running it prints "not available".
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
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


def _pass_through(module_main):
    def run(args: argparse.Namespace) -> int:
        argv = list(args._extra) + (["--help"] if getattr(args, "_help", False) else [])
        return module_main(argv)

    return run


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _selected(argv: List[str]) -> Optional[str]:
    """The subcommand named in ``argv`` (the first argument that is not an option)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return None


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The ``pagedkv`` parser. Only ``command``'s module is imported (all of them if None),
    so a heavy subcommand does not slow the others down."""
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
        if command is not None and name != command:
            note = "" if _installed(module) else " (not available)"
            sub.add_parser(name, help=f"{fallback_help}{note}", add_help=False)
            continue
        mod = _load(module)
        if mod is None:
            p = sub.add_parser(name, help=f"{fallback_help} (not available)")
            p.set_defaults(_run=_not_available(name, module), _any_args=True)
            continue
        help_line = getattr(mod, "HELP", fallback_help)
        if hasattr(mod, "add_arguments") and hasattr(mod, "run"):
            p = sub.add_parser(name, help=help_line)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
        elif hasattr(mod, "main"):
            # a module with its own ``main(argv)``: hand it the remaining arguments
            p = sub.add_parser(name, help=help_line, add_help=False)
            p.add_argument(
                "-h", "--help", dest="_help", action="store_true", help=argparse.SUPPRESS
            )
            p.set_defaults(_run=_pass_through(mod.main), _any_args=True)
        else:
            raise TypeError(f"{module} provides neither add_arguments/run nor main")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_selected(argv))
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "_any_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args._extra = extra
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
