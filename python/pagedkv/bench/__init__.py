"""``pagedkv bench``: pagedkv's paths against vLLM's own, on deterministic serving workloads.

Part A (micro, :mod:`pagedkv.bench.micro`): the chained hasher and the block pool, native vs
reference. Then per workload (:mod:`pagedkv.bench.workload`: W2, memory pressure with recompute
and swap preemption and chunked prefill; W1, a roomy pool that never preempts):

* the block manager alone: the schedule recorded from :class:`pagedkv.Scheduler`
  (:mod:`pagedkv.bench.vllm_042.trace`) replayed onto each block-manager backend, timing only
  the manager's calls (:mod:`pagedkv.bench.vllm_042.replay`; ``--compare vllm==0.4.2`` adds that
  release's own manager, fetched, not installed);
* the whole engine step (:mod:`pagedkv.bench.vllm_042.wholestep`): pagedkv's paths (``compat``,
  ``batch``) and, with ``--compare``, vLLM's own engine, in lockstep in the same run.

``--scale`` adds a scaling sweep, ``--plot`` draws everything (``pagedkv[plot]``; the whole step
against vLLM first), ``--json`` saves every number.

**Engines under test** (``docs/bench.md``). Everything timed is an
:class:`~pagedkv.bench.harness.EngineUnderTest`: ``name``, ``release`` (the vLLM release whose
API it speaks), ``baseline`` (vLLM's own code: its disagreements are reported, not failed),
``setup(config: EngineConfig)``, ``add(request: Request)``, ``busy() -> bool``,
``step() -> StepRecord`` (one whole step: schedule + the engine's processing of the sampled
tokens, which the request predetermines; the record carries the step's own timed ``seconds``,
the ``scheduled`` and ``finished`` request ids, the batch ``rows`` and optional ``detail``),
``finish()`` (a last timed call, for an engine that applies tokens at its next call) and
``close()``. :func:`~pagedkv.bench.harness.run_lockstep` gives every engine the same requests
at the same steps, steps them the same number of times in turns, keeps what each measured and
compares every follower's decisions with the leader's step by step. The adapters:
:mod:`~pagedkv.bench.vllm_042.vllm_scheduler` (vLLM V0's scheduler API, 0.4.2 and 0.5.0:
vLLM's own classes, pagedkv's dropped in, :class:`pagedkv.Scheduler`),
:mod:`~pagedkv.bench.vllm_042.wholestep` (the batch step), :mod:`~pagedkv.bench.vllm_042.replay`
(the manager-only replay); vLLM's v1 engine is :mod:`~pagedkv.bench.vllm_v1`. A new vLLM generation
is one adapter module registered in :data:`pagedkv.bench.harness.VLLM_GENERATIONS`.

Building the parser (:func:`add_arguments`) imports nothing heavy; :func:`run` does the work.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "apply_overrides", "run", "main"]

HELP = "benchmark the native block manager against the pure-Python reference (and vLLM)"

DESCRIPTION = (
    "Micro benchmarks (hasher, block pool) and two simulated serving workloads, W2 (memory "
    "pressure: recompute and swap preemption, chunked prefill) and W1 (roomy: no preemption), "
    "native vs the pure-Python reference, and with --compare vLLM's own block manager. Only "
    "time spent inside block-manager calls is timed. Exit status: 0 ok, 1 backends disagreed, "
    "2 bad arguments or a requested backend that cannot run."
)

_DEFAULT_BACKENDS = ("reference", "native", "native-batch")
_WORKLOAD_NAMES = ("w2", "w1")


class UsageError(Exception):
    """Bad arguments or an unavailable requested backend: one line, exit status 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pagedkv bench`` (no heavy imports: help must work on any install)."""
    _add_selection_arguments(parser)
    _add_workload_arguments(parser)
    _add_section_arguments(parser)


def _add_selection_arguments(parser: argparse.ArgumentParser) -> None:
    """What runs (``--quick``, ``--backends``, ``--compare``, ``--workloads``) and ``--json``."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="scaled-down workloads (W2: 64 requests, W1: 96) and shorter micro benchmarks",
    )
    parser.add_argument("--json", metavar="PATH", help="write every result to PATH as JSON")
    parser.add_argument(
        "--backends",
        default=None,
        help=f"comma-separated backends (default: {','.join(_DEFAULT_BACKENDS)}); "
        "naming one that cannot run is an error",
    )
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="vllm==VERSION",
        help="also run that vLLM release's own BlockSpaceManagerV1 and Sequence on the same "
        "workloads (0.4.2 or 0.5.0; downloaded once from PyPI and cached, vLLM need not be "
        "installed); repeatable or comma-separated",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(_WORKLOAD_NAMES),
        help="comma-separated workloads to run, of w2 (pressure) and w1 (roomy) (default: w2,w1)",
    )


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workloads' settings: prefix caching, seed, ``--set`` overrides."""
    caching = parser.add_mutually_exclusive_group()
    caching.add_argument(
        "--caching",
        choices=["both", "on", "off"],
        default="both",
        help="prefix caching setting(s) (default: both)",
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
        help="override a workload parameter, e.g. --set num_gpu_blocks=12288 --set watermark=0 "
        "(fields of pagedkv.bench.workload.WorkloadConfig; w1.KEY or w2.KEY for one workload; "
        "repeatable)",
    )


def _add_section_arguments(parser: argparse.ArgumentParser) -> None:
    """Which sections run (scaling sweep, plot, micro, vLLM's engines, W1/W2) and progress."""
    parser.add_argument(
        "--scale",
        action="store_true",
        help="also run the scaling sweep: per-step cost vs running sequences (W1 x1, x4, x16) "
        "and vs pool size (x1, x4, x16 blocks)",
    )
    parser.add_argument(
        "--plot",
        metavar="PNG",
        help="draw the whole step vs vLLM (--compare), the managers' speedups and step times "
        "and the scaling sweep (implies --scale) into PNG (pip install 'pagedkv[plot]')",
    )
    parser.add_argument("--no-micro", action="store_true", help="skip the micro benchmarks")
    parser.add_argument(
        "--no-scheduler",
        action="store_true",
        help="with --compare, leave vLLM's own engines out of the whole-step section (its block "
        "manager is still replayed; vLLM's whole step takes minutes without --quick)",
    )
    parser.add_argument(
        "--no-w1", action="store_true", help="skip W1 (= without w1 in --workloads)"
    )
    parser.add_argument(
        "--no-w2", action="store_true", help="skip W2 (= without w2 in --workloads)"
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is drawn on stderr only when stderr is a terminal)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``pagedkv bench``; the exit status (see :data:`DESCRIPTION`)."""
    try:
        return _execute(args, _plan(args))
    except UsageError as exc:  # bad arguments, or a requested engine that cannot run
        print(f"pagedkv bench: {exc}", file=sys.stderr)
        return 2


@dataclasses.dataclass
class _Plan:
    backends: List[Any]
    notes: List[str]
    workloads: List[Tuple[str, Any]]  # (name, WorkloadConfig)
    caching: List[bool]
    vllm_versions: List[str]


def _plan(args: argparse.Namespace) -> _Plan:
    """Everything checked before anything runs: backends, configs, the plot dependency."""
    from pagedkv import vllm_release
    from pagedkv.bench.harness import VLLM_GENERATIONS
    from pagedkv.bench.vllm_042.backends import (
        BackendError,
        parse_compare,
        resolve_backends,
        vllm_backend,
    )

    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path and not os.path.isdir(folder):
            raise UsageError(f"{flag} {path}: no such directory {folder}")
    explicit = args.backends is not None
    names = _split(args.backends) if explicit else list(_DEFAULT_BACKENDS)
    try:
        versions = [parse_compare(v) for item in args.compare for v in _split(item)]
        backends, notes = resolve_backends(names)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if explicit and notes:
        raise UsageError("; ".join(notes))
    workloads = _workloads(args)
    if args.plot:
        from pagedkv.bench import plot

        try:
            plot.require_matplotlib()
        except ImportError as exc:
            raise UsageError(str(exc)) from None
    from pagedkv.bench.vllm_v1 import RELEASES as V1_RELEASES

    for version in dict.fromkeys(versions):  # last: this may download a release
        if version in V1_RELEASES:
            continue  # vLLM's v1 engine: its own section (pagedkv.bench.vllm_v1)
        if version not in VLLM_GENERATIONS:
            choices = ", ".join([*VLLM_GENERATIONS, *V1_RELEASES])
            raise UsageError(f"vllm=={version} is not supported; choose from {choices}")
        if version not in vllm_release.SUPPORTED:
            continue  # a generation without a V0 block manager: whole step only
        try:
            backends.append(vllm_backend(version))
        except BackendError as exc:
            raise UsageError(str(exc)) from None
    if not backends:
        raise UsageError("no backend to run")
    for _, cfg in workloads:
        _check_backends_accept(backends, cfg)
    caching = {"both": [False, True], "on": [True], "off": [False]}[args.caching]
    return _Plan(backends, notes, workloads, caching, list(dict.fromkeys(versions)))


def _split(text: str) -> List[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _workloads(args: argparse.Namespace) -> List[Tuple[str, Any]]:
    from pagedkv.bench.vllm_042.trace import SCHEDULER_WATERMARK
    from pagedkv.bench.workload import WORKLOADS

    wanted = _split(args.workloads)
    unknown = [w for w in wanted if w.lower() not in WORKLOADS]
    if unknown:
        raise UsageError(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    scopes = {_scope(o) for o in args.overrides} - {""}
    if scopes - set(WORKLOADS):
        bad = sorted(scopes - set(WORKLOADS))
        raise UsageError(f"--set for unknown workload(s) {bad}; choose from {list(WORKLOADS)}")
    skip = {"w1"} if args.no_w1 else set()
    skip |= {"w2"} if args.no_w2 else set()
    chosen = [w for w in WORKLOADS if w in {x.lower() for x in wanted} and w not in skip]
    out = []
    for name in chosen:
        full, quick = WORKLOADS[name]
        mine = [o for o in args.overrides if not _targets_other(o, name)]
        try:
            cfg = apply_overrides(quick if args.quick else full, mine)
        except ValueError as exc:
            raise UsageError(f"{name}: {exc}") from None
        if cfg.watermark != SCHEDULER_WATERMARK:
            raise UsageError(
                f"{name}: watermark must be {SCHEDULER_WATERMARK}, the block-manager watermark "
                "vLLM 0.4.2's Scheduler (and pagedkv.Scheduler) always uses"
            )
        out.append((name, cfg))
    return out


def _scope(override: str) -> str:
    """``w1`` of ``w1.KEY=VALUE``; empty for an override of every workload."""
    key = override.partition("=")[0].strip().lower()
    scope, dot, _ = key.rpartition(".")
    return scope if dot else ""


def _targets_other(override: str, name: str) -> bool:
    return _scope(override) not in ("", name)


def _check_backends_accept(backends: List[Any], cfg: Any) -> None:
    """Build each backend's manager once with ``cfg``'s engine limits, so that a value the
    manager refuses ends in one line here, not in a traceback mid-run."""
    for b in backends:
        try:
            b.make_manager(
                cfg.block_size, cfg.num_gpu_blocks, cfg.num_cpu_blocks, cfg.watermark, True
            )
        except (ValueError, TypeError, OverflowError) as exc:
            raise UsageError(f"{cfg.name}: {b.name} refuses the engine limits: {exc}") from None


def apply_overrides(cfg: Any, overrides: List[str]) -> Any:
    """``cfg`` with ``KEY=VALUE`` overrides applied (values converted to the field's type, an
    optional ``w1.``/``w2.`` scope dropped); ValueError with a one-line message if one is bad."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    changes: Dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_").rpartition(".")[2]
        if not sep or key not in fields or key == "name":
            settable = ", ".join(f for f in fields if f != "name")
            raise ValueError(f"bad --set {item!r}; keys: {settable}")
        changes[key] = _convert(key, getattr(cfg, key), value.strip())
    try:
        return dataclasses.replace(cfg, **changes) if changes else cfg
    except ValueError as exc:
        raise ValueError(f"bad --set: {exc}") from None


def _convert(key: str, default: Any, value: str) -> Any:
    if isinstance(default, bool):
        truth = {"1": True, "true": True, "yes": True, "on": True}
        truth.update({"0": False, "false": False, "no": False, "off": False})
        if value.lower() not in truth:
            raise ValueError(f"bad value for {key}: {value!r} (expected true or false)")
        return truth[value.lower()]
    try:
        return type(default)(value)
    except ValueError:
        kind = type(default).__name__
        raise ValueError(f"bad value for {key}: {value!r} (expected {kind})") from None


def _execute(args: argparse.Namespace, plan: _Plan) -> int:
    import numpy as np

    import pagedkv
    from pagedkv.bench import progress, report

    started = time.time()
    doc: Dict[str, Any] = {
        "pagedkv_version": pagedkv.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "numpy": np.__version__,
        "quick": bool(args.quick),
        "seed": args.seed,
        "backends": {b.name: b.description for b in plan.backends},
    }
    out = sys.stdout
    bars = progress.Progress(enabled=not args.no_progress)
    if plan.vllm_versions:
        doc["vllm"] = _report_vllm(plan, out)
    if not args.no_micro:
        from pagedkv.bench.micro import MICRO_FULL, MICRO_QUICK, run_micro

        print("== Part A: micro benchmarks ==", file=out, flush=True)
        micro = run_micro(MICRO_QUICK if args.quick else MICRO_FULL, seed=args.seed)
        doc["micro"] = micro
        print(report.format_micro(micro), file=out, flush=True)
    results: Dict[str, List[Any]] = {}
    for part, (name, cfg) in enumerate(plan.workloads):
        section, runs = _run_workload(name, cfg, plan, args, bars, out, part)
        doc[name] = section
        results[name] = runs
    whole_step = {name: doc[name]["whole_step"] for name, _ in plan.workloads}
    v1 = _vllm_v1(plan, args, out)
    if v1:
        doc["vllm_v1"] = v1
        for sections in v1.values():
            for name, secs in sections.items():
                whole_step.setdefault(name, []).extend(secs)
    scaling = None
    if args.scale or args.plot:
        from pagedkv.bench import scaling as scaling_mod

        scaling = scaling_mod.run_scaling(
            plan.backends, quick=args.quick, seed=args.seed, progress=bars, out=out
        )
        doc["scaling"] = scaling
    doc["elapsed_s"] = time.time() - started
    if args.plot:
        from pagedkv.bench import plot

        plot.write_plot(args.plot, results, scaling, _plot_title(doc), whole_step)
        print(f"\nplot written to {args.plot}", file=out)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2, default=_json_default)
            f.write("\n")
        print(f"\nresults written to {args.json}", file=out)
    ok = all(doc[name]["cross_check"]["ok"] for name, _ in plan.workloads)
    ok = ok and all(r["ok"] for name, _ in plan.workloads for r in doc[name]["whole_step"])
    ok = ok and all(s["ok"] for secs in v1.values() for ss in secs.values() for s in ss)
    return 0 if ok else 1


def _vllm_v1(plan: _Plan, args: argparse.Namespace, out: Any) -> Dict[str, Any]:
    """Part C: for each ``--compare`` release of vLLM's v1 engine, its whole step with vLLM's
    own KV cache manager against pagedkv's (in that release's virtualenv if need be)."""
    from pagedkv.bench.vllm_v1 import RELEASES, run_release

    results: Dict[str, Any] = {}
    for release in (v for v in plan.vllm_versions if v in RELEASES):
        print(file=out)
        try:
            results[release] = run_release(release, plan.workloads, args.quick, args.seed, out)
        except (OSError, RuntimeError) as exc:
            raise UsageError(f"vllm=={release}: {exc}") from None
    return results


def _report_vllm(plan: _Plan, out: Any) -> Dict[str, Any]:
    """Which loaded files are vLLM's own and which are stand-ins, per compared release."""
    section: Dict[str, Any] = {}
    for b in plan.backends:
        prov = getattr(b, "provenance", None)
        if prov is None:
            continue
        section[b.name] = prov
        print(f"== {b.name}: the files it runs (checked against the release's sdist) ==", file=out)
        print(f"  vLLM's own (identical but for import lines): {', '.join(prov['vllm'])}", file=out)
        extracted = ", ".join(prov["extracted"]) or "none"
        print(f"  vLLM's definitions under pagedkv's module header: {extracted}", file=out)
        standins = ", ".join(prov["stand-in"]) or "none"
        print(
            f"  pagedkv's stand-ins (any file of the release's there unused): {standins}", file=out
        )
    print(file=out, flush=True)
    return section


def _run_workload(
    name: str, cfg: Any, plan: _Plan, args: argparse.Namespace, bars: Any, out: Any, part: int
) -> Tuple[Dict[str, Any], List[Any]]:
    """One workload: its schedule recorded from pagedkv.Scheduler and replayed onto every
    block-manager backend, then the whole-step section."""
    from pagedkv.bench import report
    from pagedkv.bench.workload import generate

    workload = generate(cfg, seed=args.seed)
    summary = workload.summary()
    print(file=out)
    label = f"Part {chr(ord('B') + part)}: workload {cfg.name}{' (quick)' if args.quick else ''}"
    print(f"== {label} ==", file=out)
    print(report.describe_workload(cfg, summary, args.seed), file=out, flush=True)
    for note in plan.notes:
        print(f"  {note}", file=out)
    results = _replays(workload, plan, bars)
    section: Dict[str, Any] = {
        "config": dataclasses.asdict(cfg),
        "workload": summary,
        "backends": {b.name: b.description for b in plan.backends},
        "skipped": plan.notes,
    }
    print(file=out)
    print(report.format_runs(results), file=out)
    check = report.cross_check(results)
    print(file=out)
    print(report.format_cross_check(check), file=out, flush=True)
    section["runs"] = report.run_dicts(results)
    section["cross_check"] = check
    section["whole_step"] = _whole_step(workload, plan, args, bars, out)
    return section, results


def _replays(workload: Any, plan: _Plan, bars: Any) -> List[Any]:
    """Per caching setting: record the schedule once, replay it onto every backend."""
    from pagedkv.bench.vllm_042.replay import replay
    from pagedkv.bench.vllm_042.trace import record

    results = []
    n = len(workload.requests)
    for caching in plan.caching:
        on = "on" if caching else "off"
        with bars.bar(n, f"{workload.config.name} pagedkv.Scheduler caching={on}") as bar:
            trace = record(workload, caching, progress=bar.update)
        for backend in plan.backends:
            with bars.bar(n, f"{workload.config.name} {backend.name} caching={on}") as bar:
                results.append(replay(trace, backend, progress=bar.update))
    return results


def _whole_step(
    workload: Any, plan: _Plan, args: argparse.Namespace, bars: Any, out: Any
) -> List[Dict[str, Any]]:
    """The compat step, the batch step and (with --compare, unless --no-scheduler) vLLM's own
    Scheduler, whole step, in lockstep on the same workload."""
    from pagedkv.bench import report
    from pagedkv.bench.harness import VLLM_GENERATIONS
    from pagedkv.bench.vllm_042.wholestep import run_whole_step

    v0 = [v for v in plan.vllm_versions if v in VLLM_GENERATIONS]  # v1's: its own section
    versions = [] if args.no_scheduler else v0
    runs = []
    for caching in plan.caching:
        desc = f"{workload.config.name} whole step caching={'on' if caching else 'off'}"
        with bars.bar(len(workload.requests), desc) as bar:
            runs.append(run_whole_step(workload, caching, vllm=versions, progress=bar.update))
    print(file=out)
    print(report.format_whole_step(runs), file=out, flush=True)
    return runs


def _plot_title(doc: Dict[str, Any]) -> str:
    quick = " --quick" if doc["quick"] else ""
    return (
        f"pagedkv {doc['pagedkv_version']} bench{quick}, Python {doc['python']}, seed {doc['seed']}"
    )


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
    """``python -m pagedkv.bench``: the same as ``pagedkv bench``."""
    parser = argparse.ArgumentParser(prog="pagedkv bench", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
