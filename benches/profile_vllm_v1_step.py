"""Where vLLM v1's engine step goes, with pagedkv's native KV cache manager in it (and, for
comparison, with vLLM's own): docs/benchmarks.md, "vLLM v1: the measurements behind the native
loop".

Runs in a vLLM 0.32/0.33 virtualenv (nothing is installed into it; this checkout's pagedkv on
PYTHONPATH, its extension built here)::

    PYTHONPATH=$PWD/python VLLM_TARGET_DEVICE=cpu ~/.cache/pagedkv/venvs/vllm-0.33/bin/python \
        benches/profile_vllm_v1_step.py [--quick] [--modes on,off] [--engines native,vllm]

For each (caching mode, engine) it drives the bench's ``V1Engine`` (python/pagedkv/bench/
vllm_v1.py: vLLM's real ``Scheduler``; W1's requests all arrive at step 0, a model stand-in
samples the workload's tokens) through the whole workload three times, GC off while stepping:

1. **timed**: ``schedule()`` and ``update_from_output()`` per step, nothing wrapped;
2. **manager**: the same with every public KV-cache-manager method wrapped in a timer (the
   wrapper's own cost, measured, is subtracted), giving the manager's share of each call;
3. **cProfile** over a window of steps (``--profile-steps A:B``), reported by function and
   grouped into the parts the plan names (policy loop, SchedulerOutput building, output
   processing, EngineCoreOutput building, stats, manager).

Per step it also records what the step built: ``NewRequestData`` objects, ``CachedRequestData``
rows, ``all_token_ids`` copies (requests not scheduled in the step before) and their tokens,
``EngineCoreOutput`` objects, and the running/waiting counts, and fits the decode-only steps'
time against the number of scheduled requests (per-running-request cost, fixed cost).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
_CHECKOUT = os.path.join(os.path.dirname(HERE), "python")
# The checkout's pagedkv when it is built in place (`maturin develop`), else the installed one
# (tests/test_vllm_v1.py installs this checkout's wheel into the vLLM virtualenvs).
_BUILT = (".so", ".pyd")
if any(n.endswith(_BUILT) for n in os.listdir(os.path.join(_CHECKOUT, "pagedkv"))):
    sys.path.insert(0, _CHECKOUT)

#: KV cache manager methods vLLM's scheduler calls (timed in the ``manager`` pass).
MANAGER_METHODS = (
    "allocate_slots",
    "get_computed_blocks",
    "free",
    "get_blocks",
    "get_block_ids",
    "cache_blocks",
    "take_events",
    "make_prefix_cache_stats",
    "record_prefix_cache_stats",
    "new_step_starts",
    "estimate_cached_tokens",
    "take_kv_cache_block_copies",
    "take_boundary_state_offloads",
    "get_num_common_prefix_blocks",
)


def _engine(kind: Any, mode: str, release: str) -> Any:
    """``"vllm"`` (or False): vLLM's scheduler and manager; ``"native"`` (or True): vLLM's
    loop over pagedkv's manager; ``"loop"``: pagedkv's Scheduler with its native loop."""
    from pagedkv.bench.vllm_v1 import MODES, EngineSpec, V1Engine

    kind = {False: "vllm", True: "native"}.get(kind, kind)
    caching, events = MODES[mode]
    spec = EngineSpec(caching=caching, kv_events=events)
    return V1Engine(release, kind != "vllm", spec, loop=kind == "loop")


def _caching(mode: str) -> bool:
    from pagedkv.bench.vllm_v1 import MODES

    return MODES[mode][0]


def _record(st: Any, sched: Any) -> Dict[str, Any]:
    """One step's times and what it built (``st``: the driver's ``V1Step``)."""
    so, eco = st.scheduler_output, st.outputs
    cached = so.scheduled_cached_reqs
    return {
        "schedule_s": st.schedule_seconds,
        "update_s": st.update_seconds,
        "scheduled": len(so.num_scheduled_tokens),
        "tokens": so.total_num_scheduled_tokens,
        "decode_only": all(n == 1 for n in so.num_scheduled_tokens.values()),
        "new_reqs": len(so.scheduled_new_reqs),
        "cached_rows": len(cached.req_ids),
        "all_token_copies": len(cached.all_token_ids),
        "all_token_copy_tokens": sum(len(v) for v in cached.all_token_ids.values()),
        "new_req_tokens": sum(len(r.prompt_token_ids or ()) for r in so.scheduled_new_reqs),
        "outputs": sum(len(e.outputs) for e in eco.values()),
        "finished": len(so.finished_req_ids),
        "preempted": len(so.preempted_req_ids or ()),
        "running": len(sched.running),
        "waiting": len(sched.waiting),
    }


def _drive_many(
    workload: Any,
    mode: str,
    natives: List[Any],
    release: str,
    max_steps: Optional[int],
    step_hook: Any = None,
    setup_hook: Any = None,
) -> Tuple[List[List[Dict[str, Any]]], List[Any]]:
    """Run the workload through several engines in lockstep (step i of each engine, in an
    order that alternates every step, so load on a shared machine hits all alike); per engine
    one dict per step (times and what was built)."""
    from pagedkv.bench.harness import EngineConfig
    from pagedkv.bench.vllm_v1 import driver

    engines = []
    for native in natives:
        eng = _engine(native, mode, release)
        eng.setup(EngineConfig.from_workload(workload.config, _caching(mode)))
        for r in workload.requests:
            eng.add(r)
        if setup_hook is not None:
            setup_hook(eng)
        engines.append(eng)
    steps: List[List[Dict[str, Any]]] = [[] for _ in engines]
    gc.collect()
    gc.disable()
    try:
        i = 0
        while max_steps is None or i < max_steps:
            order = list(range(len(engines)))
            if i % 2:
                order.reverse()
            busy = False
            for j in order:
                eng = engines[j]
                sched = eng.scheduler
                if not sched.has_unfinished_requests():
                    continue
                busy = True
                if step_hook is not None:
                    step_hook(i, "before")
                st = driver.step(sched, eng.requests, eng.next_token)
                if step_hook is not None:
                    step_hook(i, "after")
                steps[j].append(_record(st, sched))
            if not busy:
                break
            i += 1
    finally:
        gc.enable()
    return steps, engines


def _drive(
    workload: Any,
    mode: str,
    native: bool,
    release: str,
    max_steps: Optional[int],
    step_hook: Any = None,
    setup_hook: Any = None,
) -> Tuple[List[Dict[str, Any]], Any]:
    """One engine alone (see :func:`_drive_many`)."""
    steps, engines = _drive_many(
        workload, mode, [native], release, max_steps, step_hook, setup_hook
    )
    return steps[0], engines[0]


class _ManagerTimer:
    """Wraps the scheduler's KV cache manager methods in perf_counter timers."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}
        self.calls: Dict[str, int] = {}
        self.in_schedule = 0.0
        self.in_update = 0.0
        self.phase = "schedule"

    def install(self, eng: Any) -> None:
        mgr = eng.scheduler.kv_cache_manager
        for name in MANAGER_METHODS:
            fn = getattr(mgr, name, None)
            if fn is None:
                continue
            setattr(mgr, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Any) -> Any:
        pc = time.perf_counter
        secs, calls = self.seconds, self.calls

        def timed(*a: Any, **k: Any) -> Any:
            t = pc()
            try:
                return fn(*a, **k)
            finally:
                dt = pc() - t
                secs[name] = secs.get(name, 0.0) + dt
                calls[name] = calls.get(name, 0) + 1
                if self.phase == "schedule":
                    self.in_schedule += dt
                else:
                    self.in_update += dt

        return timed


def _timer_setup(timers: List[_ManagerTimer]) -> Any:
    """A setup hook giving each engine built (in order) its timer, with the phase switched
    to ``update`` inside ``update_from_output``."""
    it = iter(timers)

    def setup(e: Any) -> None:
        timer = next(it)
        timer.install(e)
        orig = e.scheduler.update_from_output

        def upd(*x: Any, **k: Any) -> Any:
            timer.phase = "update"
            try:
                return orig(*x, **k)
            finally:
                timer.phase = "schedule"

        e.scheduler.update_from_output = upd

    return setup


def _wrapper_overhead_s() -> float:
    """What one timed wrapper call adds (around a no-op), to subtract per call."""
    t = _ManagerTimer()

    def noop(*a: Any, **k: Any) -> None:
        return None

    w = t._wrap("noop", noop)
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        noop(1, 2)
    base = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n):
        w(1, 2)
    return max(0.0, (time.perf_counter() - t0 - base) / n)


def _summ(steps: List[Dict[str, Any]]) -> Dict[str, Any]:
    import numpy as np

    n = len(steps)
    sch = np.array([s["schedule_s"] for s in steps])
    upd = np.array([s["update_s"] for s in steps])
    out: Dict[str, Any] = {
        "steps": n,
        "schedule_us": float(sch.mean() * 1e6),
        "update_us": float(upd.mean() * 1e6),
        "step_us": float((sch + upd).mean() * 1e6),
        "schedule_median_us": float(np.median(sch) * 1e6),
        "update_median_us": float(np.median(upd) * 1e6),
    }
    for key in (
        "scheduled",
        "new_reqs",
        "cached_rows",
        "all_token_copies",
        "all_token_copy_tokens",
        "new_req_tokens",
        "outputs",
        "finished",
        "preempted",
        "running",
    ):
        out[f"mean_{key}"] = float(np.mean([s[key] for s in steps]))
    dec = [s for s in steps if s["decode_only"] and s["new_reqs"] == 0 and s["scheduled"] > 0]
    out["decode_steps"] = len(dec)
    # Per scheduled request in decode-only steps, by batch size (a fit over a whole run is
    # not meaningful: the batch and the cache pressure change together).
    bins = {}
    for s in dec:
        b = 1 << max(0, int(s["scheduled"]).bit_length() - 1)
        bins.setdefault(b, []).append(s)
    out["decode_us_per_req_by_batch"] = {
        str(b): {
            "steps": len(v),
            "schedule": float(np.mean([x["schedule_s"] / x["scheduled"] for x in v]) * 1e6),
            "update": float(np.mean([x["update_s"] / x["scheduled"] for x in v]) * 1e6),
        }
        for b, v in sorted(bins.items())
    }
    return out


#: cProfile function groups: (label, predicate on (file, function name)).
def _group(path: str, func: str) -> str:
    p = path.replace("\\", "/")
    stand_in = ("sampled_tokens", "model_runner_output", "next_token", "model_output")
    if (
        p.endswith(("bench/vllm_v1/driver.py", "bench/vllm_v1/section.py")) and func in stand_in
    ) or p.endswith("v1/outputs.py"):
        return "model stand-in (not timed in the step)"
    if "pagedkv/vllm_v1" in p or "pagedkv._native" in p or "V1Manager" in func:
        return "manager (pagedkv Python + native)"
    if p.endswith("core/kv_cache_utils.py") and "hash" in func:
        return "block hashing (vLLM's hasher, per appended token)"
    if (
        p.endswith("core/kv_cache_manager.py")
        or "kv_cache_coordinator" in p
        or "block_pool" in p
        or "single_type_kv_cache_manager" in p
        or "kv_cache_utils" in p
    ):
        return "manager (vLLM)"
    if p.endswith("sched/output.py"):
        return "SchedulerOutput objects (output.py)"
    if p.endswith("v1/engine/__init__.py") or "msgspec" in p:
        return "EngineCoreOutput(s) objects"
    if p.endswith("v1/metrics/stats.py"):
        return "stats objects"
    if p.endswith("v1/request.py"):
        return "Request methods/properties"
    if p.endswith("sched/utils.py"):
        return "check_stop / remove_all"
    if p.endswith("sched/request_queue.py"):
        return "request queues"
    if p.endswith("sched/scheduler.py") or p.endswith("sched/async_scheduler.py"):
        return f"scheduler.py:{func}"
    if "structured_output" in p:
        return "structured output manager"
    if "encoder_cache_manager" in p:
        return "encoder cache manager"
    if p == "~":
        return f"builtin:{func}"
    return f"other:{os.path.basename(p)}:{func}"


def _profile(
    workload: Any, mode: str, native: bool, release: str, window: Tuple[int, int], top: int
) -> Dict[str, Any]:
    prof = cProfile.Profile()
    a, b = window

    def hook(i: int, when: str) -> None:
        if when == "before" and i == a:
            prof.enable()
        if when == "after" and i == b - 1:
            prof.disable()

    steps, eng = _drive(workload, mode, native, release, b, step_hook=hook)
    eng.close()
    n = max(1, min(b, len(steps)) - a)
    st = pstats.Stats(prof)
    groups: Dict[str, float] = {}
    rows = []
    for (path, _line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        g = _group(path, func)
        groups[g] = groups.get(g, 0.0) + tt
        rows.append((tt, ct, nc, f"{os.path.basename(path)}:{func}"))
    rows.sort(reverse=True)
    total = sum(groups.values())
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
    return {
        "window": [a, b],
        "steps_profiled": n,
        "total_us_per_step_profiled": total / n * 1e6,
        "groups_us_per_step": {
            k: v / n * 1e6 for k, v in sorted(groups.items(), key=lambda kv: -kv[1])
        },
        "top_tottime": [
            {
                "us_per_step": tt / n * 1e6,
                "cum_us_per_step": ct / n * 1e6,
                "calls_per_step": nc / n,
                "fn": name,
            }
            for tt, ct, nc, name in rows[:top]
        ],
        "cumulative_text": s.getvalue(),
    }


def _object_floor(
    workload: Any, mode: str, release: str, max_steps: Optional[int]
) -> Dict[str, Any]:
    """What building this step's output objects costs from Python, alone: for each step (of a
    native-manager run) rebuild ``NewRequestData``s, the ``CachedRequestData``, the
    ``EngineCoreOutput``s and ``EngineCoreOutputs`` with the same contents, timed. A lower
    bound on the Python-object work any scheduler emitting vLLM's objects does."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    times = {
        "new_request_data": 0.0,
        "cached_request_data": 0.0,
        "scheduler_output": 0.0,
        "engine_core_outputs": 0.0,
    }
    counts = {"steps": 0}
    # Drive manually to keep hold of each step's SchedulerOutput and outputs.
    from pagedkv.bench.harness import EngineConfig

    eng = _engine(True, mode, release)
    eng.setup(EngineConfig.from_workload(workload.config, _caching(mode)))
    for r in workload.requests:
        eng.add(r)
    sched = eng.scheduler
    pc = time.perf_counter
    gc.collect()
    gc.disable()
    try:
        i = 0
        while sched.has_unfinished_requests() and (max_steps is None or i < max_steps):
            so = sched.schedule()
            # Objects as vLLM builds them (NewRequestData.from_request needs the Request).
            reqs = [sched.requests[r.req_id] for r in so.scheduled_new_reqs]
            blocks = [r.block_ids for r in so.scheduled_new_reqs]
            t = pc()
            for req, b in zip(reqs, blocks):
                NewRequestData.from_request(req, b)
            times["new_request_data"] += pc() - t
            c = so.scheduled_cached_reqs
            t = pc()
            req_ids = list(c.req_ids)
            new_block_ids = list(c.new_block_ids)
            nct = list(c.num_computed_tokens)
            nout = list(c.num_output_tokens)
            all_tok = {k: list(v) for k, v in c.all_token_ids.items()}
            CachedRequestData(
                req_ids=req_ids,
                resumed_req_ids=set(c.resumed_req_ids),
                new_token_ids=[],
                all_token_ids=all_tok,
                new_block_ids=new_block_ids,
                num_computed_tokens=nct,
                num_output_tokens=nout,
            )
            times["cached_request_data"] += pc() - t
            t = pc()
            SchedulerOutput(
                scheduled_new_reqs=list(so.scheduled_new_reqs),
                scheduled_cached_reqs=c,
                num_scheduled_tokens=dict(so.num_scheduled_tokens),
                total_num_scheduled_tokens=so.total_num_scheduled_tokens,
                scheduled_spec_decode_tokens={},
                scheduled_encoder_inputs={},
                preempted_req_ids=set(),
                finished_req_ids=set(so.finished_req_ids),
                free_encoder_mm_hashes=[],
            )
            times["scheduler_output"] += pc() - t
            mro = eng.model_output(so)
            eco = sched.update_from_output(so, mro)
            outs = [o for e in eco.values() for o in e.outputs]
            t = pc()
            rebuilt = [
                EngineCoreOutput(
                    request_id=o.request_id,
                    new_token_ids=list(o.new_token_ids),
                    finish_reason=o.finish_reason,
                    stop_reason=o.stop_reason,
                    events=o.events,
                    prefill_stats=o.prefill_stats,
                )
                for o in outs
            ]
            EngineCoreOutputs(outputs=rebuilt)
            times["engine_core_outputs"] += pc() - t
            counts["steps"] += 1
            i += 1
    finally:
        gc.enable()
    eng.close()
    n = max(1, counts["steps"])
    return {k + "_us": v / n * 1e6 for k, v in times.items()} | {"steps": counts["steps"]}


def _scale(release: str, steps: int, quick: bool, engines: List[str], seed: int) -> Dict[str, Any]:
    """Per-running-request cost at the scaling sweep's x1/x4/x16 batch points
    (python/pagedkv/bench/scaling.py: requests, running limit, pool and budget times k),
    caching on, the first ``steps`` steps: the median over decode-only steps of the step's
    time per scheduled request, per engine."""
    import numpy as np

    from pagedkv.bench.scaling import FACTORS, sweep_configs
    from pagedkv.bench.workload import generate

    doc: Dict[str, Any] = {"steps": steps, "points": []}
    for k, cfg in zip(FACTORS, sweep_configs(quick)["batch"]):
        workload = generate(cfg, seed=seed)
        point: Dict[str, Any] = {"factor": k, "max_num_seqs": cfg.max_num_seqs}
        runs, engs = _drive_many(workload, "on", list(engines), release, steps)
        for e in engs:
            e.close()
        for engine, st in zip(engines, runs):
            dec = [x for x in st if x["decode_only"] and x["new_reqs"] == 0 and x["scheduled"]]
            if not dec:
                continue
            point[engine] = {
                "decode_steps": len(dec),
                "median_batch": float(np.median([x["scheduled"] for x in dec])),
                "us_per_req": float(
                    np.median([(x["schedule_s"] + x["update_s"]) / x["scheduled"] for x in dec])
                    * 1e6
                ),
                "schedule_us_per_req": float(
                    np.median([x["schedule_s"] / x["scheduled"] for x in dec]) * 1e6
                ),
                "update_us_per_req": float(
                    np.median([x["update_s"] / x["scheduled"] for x in dec]) * 1e6
                ),
            }
            print(
                f"scale x{k:<2} {engine:6}: {len(dec)} decode-only steps, median batch"
                f" {point[engine]['median_batch']:.0f}: {point[engine]['us_per_req']:.2f} us per"
                f" running request (schedule {point[engine]['schedule_us_per_req']:.2f},"
                f" update {point[engine]['update_us_per_req']:.2f})",
                flush=True,
            )
        doc["points"].append(point)
    return doc


def main(argv: Optional[List[str]] = None) -> int:
    from pagedkv.bench.vllm_v1 import use_cpu_platform_without_gpu

    use_cpu_platform_without_gpu()
    import vllm

    from pagedkv.bench.workload import WORKLOADS, generate
    from pagedkv.vllm_v1._version import release_of

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="w1")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--modes", default="on,off", help="on, off, events (caching on + KV events)")
    p.add_argument("--engines", default="native,vllm", help="loop, native (manager), vllm")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--profile-steps", default="100:400", help="A:B, the cProfile window")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--no-floor", action="store_true")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--scale",
        type=int,
        metavar="STEPS",
        help="instead: per-running-request cost at the x1/x4/x16 batch points, STEPS steps each",
    )
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    release = release_of(vllm.__version__)
    if a.scale:
        doc = _scale(release, a.scale, a.quick, a.engines.split(","), a.seed)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"release": release, "scale": doc}, f, indent=1)
        return 0
    cfg = WORKLOADS[a.workload][1 if a.quick else 0]
    workload = generate(cfg, seed=a.seed)
    win = tuple(int(x) for x in a.profile_steps.split(":"))
    result: Dict[str, Any] = {
        "release": release,
        "workload": a.workload,
        "quick": a.quick,
        "runs": {},
    }
    overhead = _wrapper_overhead_s()
    result["timer_wrapper_overhead_us"] = overhead * 1e6
    engines = a.engines.split(",")
    natives = list(engines)
    for mode in a.modes.split(","):
        timed, engs = _drive_many(workload, mode, natives, release, a.max_steps)
        for e in engs:
            e.close()
        timers = {engine: _ManagerTimer() for engine in engines}
        setup = _timer_setup([timers[e] for e in engines])
        mtimed, mengs = _drive_many(workload, mode, natives, release, a.max_steps, None, setup)
        for e in mengs:
            e.close()
        for j, engine in enumerate(engines):
            native = natives[j] == "native"
            key = f"{mode}/{engine}"
            summary = _summ(timed[j])
            timer = timers[engine]
            msteps = mtimed[j]
            ncalls = sum(timer.calls.values())
            n = max(1, len(msteps))
            summary["manager_us_per_step"] = {
                k: max(0.0, timer.seconds[k] - timer.calls[k] * overhead) / n * 1e6
                for k in timer.seconds
            }
            summary["manager_calls_per_step"] = {k: v / n for k, v in timer.calls.items()}
            # The wrapper's cost is subtracted per call (split by phase in proportion).
            sub = ncalls * overhead
            tot = max(1e-12, timer.in_schedule + timer.in_update)
            summary["manager_in_schedule_us"] = (
                max(0.0, timer.in_schedule - sub * timer.in_schedule / tot) / n * 1e6
            )
            summary["manager_in_update_us"] = (
                max(0.0, timer.in_update - sub * timer.in_update / tot) / n * 1e6
            )
            summary["manager_wrapper_overhead_us_per_step"] = ncalls * overhead / n * 1e6
            summary["instrumented_step_us"] = _summ(msteps)["step_us"]
            # The share within the instrumented pass itself (load moves between passes).
            own = summary["instrumented_step_us"] - summary["manager_wrapper_overhead_us_per_step"]
            summary["manager_share_of_instrumented_step"] = (
                summary["manager_in_schedule_us"] + summary["manager_in_update_us"]
            ) / max(1e-9, own)
            if not a.no_profile and native:
                summary["profile"] = _profile(workload, mode, native, release, win, a.top)
            if not a.no_floor and native:
                summary["object_floor"] = _object_floor(workload, mode, release, a.max_steps)
            result["runs"][key] = summary
            print(_format(key, summary), flush=True)
    for mode in a.modes.split(","):
        ours, theirs = result["runs"].get(f"{mode}/native"), result["runs"].get(f"{mode}/vllm")
        if ours and theirs:
            # What a manager that cost nothing would give: vLLM's step less its manager's
            # share (measured in vLLM's instrumented pass).
            share = theirs["manager_share_of_instrumented_step"]
            result.setdefault("bounds", {})[mode] = {
                "vllm_manager_share": share,
                "cost_free_manager_ratio": 1 / max(1e-9, 1 - share),
            }
            print(
                f"mode {mode}: vLLM step {theirs['step_us']:.0f} us, with native manager "
                f"{ours['step_us']:.0f} us ({theirs['step_us'] / ours['step_us']:.2f}x); "
                f"vLLM's manager is {share:.0%} of its step, so a manager that cost nothing "
                f"would give {1 / max(1e-9, 1 - share):.2f}x"
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _format(key: str, s: Dict[str, Any]) -> str:
    lines = [
        f"== {key}: {s['steps']} steps; step {s['step_us']:.0f} us ="
        f" schedule {s['schedule_us']:.0f}"
        f" + update_from_output {s['update_us']:.0f} (medians {s['schedule_median_us']:.0f} /"
        f" {s['update_median_us']:.0f})",
        f"   manager (wrapped, overhead subtracted): {s['manager_in_schedule_us']:.0f} us in"
        f" schedule, {s['manager_in_update_us']:.0f} us in update; instrumented step"
        f" {s['instrumented_step_us']:.0f} us (manager"
        f" {100 * s['manager_share_of_instrumented_step']:.0f}% of it)",
        "   manager per step: "
        + ", ".join(
            f"{k} {v:.0f}us/{s['manager_calls_per_step'][k]:.1f}"
            for k, v in sorted(s["manager_us_per_step"].items(), key=lambda kv: -kv[1])
            if s["manager_calls_per_step"][k] > 0
        ),
        f"   per step: scheduled {s['mean_scheduled']:.1f} (running {s['mean_running']:.1f}),"
        f" NewRequestData {s['mean_new_reqs']:.2f} ({s['mean_new_req_tokens']:.0f} prompt tokens),"
        f" cached rows {s['mean_cached_rows']:.1f},"
        f" all_token_ids copies {s['mean_all_token_copies']:.2f}"
        f" ({s['mean_all_token_copy_tokens']:.0f} tokens),"
        f" EngineCoreOutput {s['mean_outputs']:.1f},"
        f" finished {s['mean_finished']:.2f}, preempted {s['mean_preempted']:.2f}",
    ]
    if s.get("decode_us_per_req_by_batch"):
        lines.append(
            f"   decode-only steps ({s['decode_steps']}), us per scheduled request"
            " (schedule / update) by batch size:"
        )
        lines.append(
            "     "
            + "; ".join(
                f"{b}+: {v['schedule']:.1f} / {v['update']:.1f} ({v['steps']} steps)"
                for b, v in s["decode_us_per_req_by_batch"].items()
            )
        )
    if "profile" in s:
        pr = s["profile"]
        lines.append(
            f"   cProfile steps {pr['window'][0]}:{pr['window'][1]}"
            " (tottime, us/step under the profiler,"
            f" total {pr['total_us_per_step_profiled']:.0f}):"
        )
        for g, v in list(pr["groups_us_per_step"].items())[:18]:
            lines.append(f"     {v:8.0f}  {g}")
        lines.append("   top functions by own time (us/step, calls/step):")
        for r in pr["top_tottime"][:15]:
            lines.append(f"     {r['us_per_step']:8.0f} {r['calls_per_step']:8.1f}  {r['fn']}")
    if "object_floor" in s:
        f = s["object_floor"]
        lines.append(
            "   output objects rebuilt alone (us/step): "
            + ", ".join(f"{k[:-3]} {v:.0f}" for k, v in f.items() if k.endswith("_us"))
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
