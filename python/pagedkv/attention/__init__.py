"""Torch side of pagedkv (optional extra ``pagedkv[torch]``).

Paged KV-cache tensors and block ops (:mod:`.kv_cache`), attention over a paged
cache (:mod:`.paged_attention`), a tiny reference transformer that runs on it
(:mod:`.model`) and persistent decode-step metadata buffers (:mod:`.step_buffers`).
This is the only part of pagedkv that imports torch.

Cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = K, 1 = V); slot of token ``t`` = ``block_table[t // block_size] *
block_size + t % block_size``.
"""

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "pagedkv.attention needs PyTorch; install it with `pip install pagedkv[torch]`"
    ) from exc

from .kv_cache import allocate_kv_cache, copy_blocks, split_kv_cache, swap_blocks, write_kv
from .model import PagedBatch, SeqChunk, TinyConfig, TinyDecoder, build_paged_batch
from .paged_attention import (
    FLASH_ATTN_BLOCK_MULTIPLE,
    flash_attn_unavailable_reason,
    paged_attention,
)
from .step_buffers import DeviceView, StepBuffers

__all__ = [
    "FLASH_ATTN_BLOCK_MULTIPLE",
    "DeviceView",
    "PagedBatch",
    "SeqChunk",
    "StepBuffers",
    "TinyConfig",
    "TinyDecoder",
    "allocate_kv_cache",
    "build_paged_batch",
    "copy_blocks",
    "flash_attn_unavailable_reason",
    "paged_attention",
    "split_kv_cache",
    "swap_blocks",
    "write_kv",
]
