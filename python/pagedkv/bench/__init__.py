"""``pagedkv bench``: native vs pure-Python block management.

Part A (micro, :mod:`pagedkv.bench.micro`): the chained hasher and the block pool, native vs
reference. Part B (W1, :mod:`pagedkv.bench.workload` + :mod:`pagedkv.bench.driver`): a
deterministic simulated serving run that drives each BlockSpaceManager backend through the calls
vLLM's scheduler makes every step, timing only the time spent inside the manager.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from typing import Any, Dict, List, Optional

__all__ = ["add_arguments", "apply_overrides", "run", "main"]

HELP = "benchmark the native block manager against the pure-Python reference"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedkv.bench.backends import BACKEND_NAMES

    parser.description = (
        "Micro benchmarks (hasher, block pool) and the W1 simulated serving workload, "
        "native vs pure-Python reference. Only time spent inside block-manager calls is timed."
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="scaled-down W1 (96 requests, smaller pool) and shorter micro benchmarks",
    )
    parser.add_argument("--json", metavar="PATH", help="write every result to PATH as JSON")
    parser.add_argument(
        "--backends",
        default=",".join(BACKEND_NAMES),
        help=f"comma-separated W1 backends (default: {','.join(BACKEND_NAMES)})",
    )
    caching = parser.add_mutually_exclusive_group()
    caching.add_argument(
        "--caching",
        choices=["both", "on", "off"],
        default="both",
        help="prefix caching setting(s) for W1 (default: both)",
    )
    caching.add_argument(
        "--no-caching", dest="caching", action="store_const", const="off", help="= --caching off"
    )
    caching.add_argument(
        "--caching-only", dest="caching", action="store_const", const="on", help="= --caching on"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a W1 parameter, e.g. --set num_gpu_blocks=12288 --set watermark=0 "
        "(fields of pagedkv.bench.workload.W1Config; repeatable)",
    )
    parser.add_argument("--no-micro", action="store_true", help="skip the micro benchmarks")
    parser.add_argument("--no-w1", action="store_true", help="skip the W1 workload")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (default: on a terminal)"
    )


def _progress_bar(total: int, desc: str, disable: Optional[bool]) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="req",
        file=sys.stderr,
        disable=disable,
        leave=False,
    )


def run(args: argparse.Namespace) -> int:
    import numpy as np

    import pagedkv
    from pagedkv.bench import report
    from pagedkv.bench.backends import resolve_backends
    from pagedkv.bench.driver import run_w1
    from pagedkv.bench.micro import MICRO_FULL, MICRO_QUICK, run_micro
    from pagedkv.bench.workload import W1_FULL, W1_QUICK, generate_w1

    backend_names = [b.strip() for b in args.backends.split(",") if b.strip()]
    try:
        backends, notes = resolve_backends(backend_names)
    except ValueError as exc:
        print(f"pagedkv bench: {exc}", file=sys.stderr)
        return 2
    try:
        cfg = apply_overrides(W1_QUICK if args.quick else W1_FULL, args.overrides)
    except ValueError as exc:
        print(f"pagedkv bench: {exc}", file=sys.stderr)
        return 2
    caching_settings = {"both": [False, True], "on": [True], "off": [False]}[args.caching]
    progress_disable: Optional[bool] = True if args.no_progress else None
    started = time.time()
    doc: Dict[str, Any] = {
        "pagedkv_version": pagedkv.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "numpy": np.__version__,
        "quick": bool(args.quick),
        "seed": args.seed,
    }

    out = sys.stdout
    if not args.no_micro:
        print("== Part A: micro benchmarks ==", file=out, flush=True)
        micro = run_micro(MICRO_QUICK if args.quick else MICRO_FULL, seed=args.seed)
        doc["micro"] = micro
        print(report.format_micro(micro), file=out, flush=True)

    if not args.no_w1:
        workload = generate_w1(cfg, seed=args.seed)
        summary = workload.summary()
        print(file=out)
        print(f"== Part B: workload W1{' (quick)' if args.quick else ''} ==", file=out)
        print(
            f"{summary['num_requests']} requests ({summary['prefixed_requests']} with one of "
            f"{cfg.num_prefixes} shared prefixes, {summary['n2_requests']} with n=2), "
            f"{summary['prompt_tokens']:,} prompt tokens (mean {summary['prompt_len_mean']:.0f}), "
            f"mean output {summary['output_len_mean']:.0f}; "
            f"{cfg.num_gpu_blocks} GPU / {cfg.num_cpu_blocks} CPU blocks of {cfg.block_size}, "
            f"max {cfg.max_num_seqs} seqs, {cfg.prefill_token_budget} prefill tokens/step; "
            f"seed {args.seed}, digest {summary['digest']}",
            file=out,
            flush=True,
        )
        for note in notes:
            print(f"  {note}", file=out)
        results = []
        for caching in caching_settings:
            for backend in backends:
                desc = f"W1 {backend.name} caching={'on' if caching else 'off'}"
                with _progress_bar(len(workload.requests), desc, progress_disable) as bar:
                    res = run_w1(workload, backend, caching, progress=bar.update)
                results.append(res)
        w1: Dict[str, Any] = {
            "config": dataclasses.asdict(cfg),
            "workload": summary,
            "backends": {b.name: b.description for b in backends},
            "skipped": notes,
        }
        if results:
            print(file=out)
            print(
                "Block-manager time per step (us; only time inside manager calls), "
                "speedup = reference mean / mean:",
                file=out,
            )
            print(report.format_w1(results), file=out)
            check = report.cross_check(results)
            print(file=out)
            print(report.format_cross_check(check), file=out, flush=True)
            sp = report.speedups(results)
            sp_vllm = report.speedups(results, "vllm")
            runs = []
            for i, r in enumerate(results):
                d = r.to_dict()
                d["speedup_vs_reference"] = sp[i]
                d["speedup_vs_vllm"] = sp_vllm[i]
                runs.append(d)
            w1["runs"] = runs
            w1["cross_check"] = check
        else:
            print("  no W1 backend is available", file=out)
            w1["runs"] = []
            w1["cross_check"] = {"ok": True, "groups": {}}
        doc["w1"] = w1
    doc["elapsed_s"] = time.time() - started
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2, default=_json_default)
            f.write("\n")
        print(f"\nresults written to {args.json}", file=out)
    ok = doc.get("w1", {}).get("cross_check", {}).get("ok", True)
    return 0 if ok else 1


def apply_overrides(cfg: Any, overrides: List[str]) -> Any:
    """``cfg`` with ``KEY=VALUE`` overrides applied (values converted to the field's type)."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    changes: Dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise ValueError(f"bad --set {item!r}; keys: {', '.join(fields)}")
        default = getattr(cfg, key)
        try:
            changes[key] = (
                type(default)(value)
                if not isinstance(default, bool)
                else (value.lower() in ("1", "true", "yes", "on"))
            )
        except ValueError:
            raise ValueError(f"bad value for {key}: {value!r}") from None
    return dataclasses.replace(cfg, **changes) if changes else cfg


def _json_default(obj: Any) -> Any:
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m pagedkv.bench``-style entry: parse ``argv`` and run."""
    parser = argparse.ArgumentParser(prog="pagedkv bench")
    add_arguments(parser)
    return run(parser.parse_args(argv))
