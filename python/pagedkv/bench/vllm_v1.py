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
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from pagedkv.bench.workload import WORKLOADS, Workload, WorkloadConfig, generate

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
    """What both engines share: the workload and vLLM's configuration knobs."""

    workload: WorkloadConfig
    caching: bool = True
    kv_events: bool = False
    async_scheduling: bool = False
    hash_algo: str = "sha256"


def build_scheduler(spec: EngineSpec, model_dir: str, native: bool, cls: Any = None) -> Any:
    """vLLM's scheduler (``native=False``) or pagedkv's, over the same fresh configuration
    (``cls`` overrides the class). ``async_scheduling`` picks the async variant explicitly:
    vLLM's CPU platform turns the config's flag off, and the bench measures both variants."""
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

    w = spec.workload
    max_len = w.prompt_len_max + w.output_len_max
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=max_len, seed=0)
    sched = SchedulerConfig(
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.prefill_token_budget,
        max_model_len=max_len,
        enable_chunked_prefill=True,
        async_scheduling=spec.async_scheduling,
        is_encoder_decoder=False,
        watermark=w.watermark,
    )
    cache = CacheConfig(
        block_size=w.block_size,
        enable_prefix_caching=spec.caching,
        prefix_caching_hash_algo=spec.hash_algo,
    )
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if spec.kv_events else None
    vllm_config = VllmConfig(
        model_config=model, scheduler_config=sched, cache_config=cache, kv_events_config=events
    )
    kv_spec = FullAttentionSpec(block_size=w.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=w.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], kv_spec)],
    )
    cache.num_gpu_blocks = w.num_gpu_blocks
    register_all_kvcache_specs(vllm_config)
    if cls is None and native:
        from pagedkv import vllm_v1

        cls = vllm_v1.AsyncScheduler if spec.async_scheduling else vllm_v1.Scheduler
    elif cls is None:
        cls = AsyncScheduler if spec.async_scheduling else Scheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=w.block_size,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )


def make_requests(workload: Workload, block_size: int, hash_algo: str) -> List[Tuple[Any, List[int]]]:
    """vLLM ``Request`` objects for the workload, each with its predetermined output tokens."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(block_size, hash_fn)
    out = []
    for r in workload.requests:
        for j in range(r.n):
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
            req = Request(
                request_id=f"{r.request_id}-{j}",
                prompt_token_ids=list(r.prompt_token_ids),
                sampling_params=params,
                pooling_params=None,
                arrival_time=0.0,
                block_hasher=hasher,
            )
            out.append((req, r.output_token_ids[j]))
    return out


@dataclass
class Engine:
    """One scheduler under test and its requests."""

    name: str
    scheduler: Any
    outputs: Dict[str, List[int]] = field(default_factory=dict)
    requests: Dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    steps: int = 0

    def add(self, reqs: List[Tuple[Any, List[int]]]) -> None:
        for req, toks in reqs:
            self.requests[req.request_id] = req
            self.outputs[req.request_id] = toks
            self.scheduler.add_request(req)

    def step(self) -> Any:
        """One engine step; returns the ``SchedulerOutput`` (timing excludes the model)."""
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        t1 = time.perf_counter()
        mro = self.model_output(so)
        t2 = time.perf_counter()
        self.scheduler.update_from_output(so, mro)
        t3 = time.perf_counter()
        self.seconds += (t1 - t0) + (t3 - t2)
        self.steps += 1
        return so

    def model_output(self, so: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.requests[rid]
            done = req.num_computed_tokens + so.num_scheduled_tokens[rid] >= req.num_tokens
            pos = len(req.output_token_ids)
            sampled.append([self.outputs[rid][pos]] if done else [])
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )

    def unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()


def decisions(so: Any) -> tuple:
    """What both engines must agree on each step."""
    new = tuple((r.req_id, tuple(map(tuple, r.block_ids))) for r in so.scheduled_new_reqs)
    cached = so.scheduled_cached_reqs
    cached_ids = tuple(
        (rid, None if b is None else tuple(map(tuple, b)))
        for rid, b in zip(cached.req_ids, cached.new_block_ids)
    )
    return (
        tuple(sorted(so.num_scheduled_tokens.items())),
        new,
        cached_ids,
        tuple(sorted(getattr(so, "preempted_req_ids", None) or ())),
        tuple(sorted(so.finished_req_ids)),
    )


def run(spec: EngineSpec, seed: int = 0, max_steps: Optional[int] = None) -> Dict[str, Any]:
    """Both engines through the workload in lockstep; per-engine seconds and the ratio."""
    workload = generate(spec.workload, seed=seed)
    w = spec.workload
    with tempfile.TemporaryDirectory() as d:
        model_dir = write_model_dir(d, w.prompt_len_max + w.output_len_max)
        engines = [
            Engine("vllm", build_scheduler(spec, model_dir, native=False)),
            Engine("pagedkv", build_scheduler(spec, model_dir, native=True)),
        ]
    for e in engines:
        e.add(make_requests(workload, w.block_size, spec.hash_algo))
    steps = 0
    while any(e.unfinished() for e in engines):
        outs = [decisions(e.step()) for e in engines]
        if outs[0] != outs[1]:
            raise AssertionError(f"step {steps}: the engines' decisions differ")
        steps += 1
        if max_steps is not None and steps >= max_steps:
            break
    base, ours = engines
    return {
        "workload": w.name,
        "caching": spec.caching,
        "kv_events": spec.kv_events,
        "async": spec.async_scheduling,
        "steps": steps,
        "vllm_us_per_step": 1e6 * base.seconds / steps,
        "pagedkv_us_per_step": 1e6 * ours.seconds / steps,
        "ratio": base.seconds / ours.seconds,
        "manager": type(ours.scheduler.kv_cache_manager).__module__,
    }


def use_cpu_platform_without_gpu() -> None:
    """vLLM's CUDA build finds no platform on a machine without a GPU; the scheduler runs on
    any, so point it at vLLM's CPU platform unless the caller chose one."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main(argv: Optional[List[str]] = None) -> int:
    use_cpu_platform_without_gpu()
    import vllm

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="w1")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--modes", default="on,off,events", help="caching on/off, events (on+events)")
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    config = WORKLOADS[a.workload][1 if a.quick else 0]
    results = []
    for mode in a.modes.split(","):
        spec = EngineSpec(
            config,
            caching=mode != "off",
            kv_events=mode == "events",
            async_scheduling=a.async_scheduling,
        )
        r = run(spec, max_steps=a.max_steps)
        r["vllm_version"] = vllm.__version__
        results.append(r)
        print(
            f"vLLM {vllm.__version__} {r['workload']} {mode:>6}: vLLM {r['vllm_us_per_step']:8.0f} us/step,"
            f" pagedkv {r['pagedkv_us_per_step']:8.0f} us/step -> {r['ratio']:.2f}x  ({r['steps']} steps)",
            flush=True,
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
