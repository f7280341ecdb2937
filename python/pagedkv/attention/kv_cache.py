"""Paged KV-cache tensors and the block-level operations an engine issues on them.

Layout
------
One cache tensor per transformer layer::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]

``kv_cache[0]`` is the key cache and ``kv_cache[1]`` the value cache.  Both are
contiguous views of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``,
which is also the paged layout ``flash_attn_with_kvcache`` expects, so no copy is
needed to hand them to a fused kernel.  A model keeps a ``list`` of these tensors,
one per layer.

Token ``t`` of a sequence lives in *slot* ``block_table[t // block_size] *
block_size + t % block_size``; a slot mapping is a 1-D integer tensor of such
slots (``-1`` marks a padding token whose K/V must not be written).

All operations are batched: index tensors are built once and each cache tensor
sees a single gather/scatter, never a Python loop over blocks.

Index arguments may be numpy integer arrays, such as the int32 ``slot_mapping`` buffer that
``BlockSpaceManager.append_slots_batch`` fills: ``torch.from_numpy`` wraps them without a copy.
Bad arguments raise :class:`pagedkv.errors.InvalidArgumentError` (a ``ValueError``);
wrongly typed ones :class:`~pagedkv.errors.ArgumentTypeError` (also a ``TypeError``).
Validation happens before anything is written.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Union

import numpy as np
import torch

from ..errors import ArgumentTypeError, InvalidArgumentError
from ._args import index_tensor, tensor

#: Block-id pairs for :func:`copy_blocks` / :func:`swap_blocks`: a mapping (``{src: [dst, ...]}``
#: or ``{src: dst}``, e.g. a ``BlockMapping`` from the manager), an iterable of ``(src, dst)``
#: pairs, or an integer ``[n, 2]`` tensor / numpy array of pairs (vLLM 0.5's format).
BlockPairs = Union[
    Mapping[int, Sequence[int]],
    Mapping[int, int],
    Iterable[Sequence[int]],
    torch.Tensor,
    np.ndarray,
]

__all__ = [
    "allocate_kv_cache",
    "copy_blocks",
    "split_kv_cache",
    "swap_blocks",
    "write_kv",
]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    pin_memory: bool = False,
) -> torch.Tensor:
    """Allocate one layer's paged KV cache, zero-filled.

    Returns a tensor of shape ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    (index 0 = K, 1 = V).  ``pin_memory=True`` is only meaningful for a CPU cache
    used as swap space (faster, truly asynchronous host<->device copies).
    """
    for name, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    device = torch.device(device)
    if pin_memory and device.type != "cpu":
        raise InvalidArgumentError("pin_memory=True requires a CPU cache")
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the ``(k_cache, v_cache)`` views, each ``[num_blocks, block_size, H_kv, D]``."""
    _check_layer_cache(kv_cache, "kv_cache")
    return kv_cache[0], kv_cache[1]


# --------------------------------------------------------------------------- #
# write_kv
# --------------------------------------------------------------------------- #


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor | np.ndarray,
    *,
    validate: bool = True,
) -> None:
    """Scatter new tokens' K/V into the paged cache, in place.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous (e.g. the views returned by :func:`split_kv_cache`).
        key, value: ``[num_tokens, num_kv_heads, head_dim]``; cast to the cache dtype.
        slot_mapping: integer ``[num_tokens]`` tensor or numpy array (shared, not copied);
            ``slot = block * block_size + offset``. Negative entries (``-1`` = padding) are
            skipped.
        validate: check that slots are in range.  On CUDA this costs a host sync;
            pass ``False`` in a hot loop once inputs are trusted.

    A slot may appear more than once: with prefix caching, two sequences admitted in the same
    step can share a cached block that neither has computed yet, and both write the same
    (identical) K/V into it, as in vLLM. Which of the equal copies lands is unspecified.
    """
    k_cache, v_cache = tensor(k_cache, "k_cache"), tensor(v_cache, "v_cache")
    key, value = tensor(key, "key"), tensor(value, "value")
    slot_mapping = index_tensor(slot_mapping, "slot_mapping")
    _check_kv_pair(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    expected = (num_kv_heads, head_dim)
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != expected:
            raise InvalidArgumentError(
                f"{name} must have shape [num_tokens, {num_kv_heads}, {head_dim}], "
                f"got {tuple(t.shape)}"
            )
        if t.device != k_cache.device:
            raise InvalidArgumentError(f"{name} is on {t.device}, cache is on {k_cache.device}")
    if key.shape[0] != value.shape[0]:
        raise InvalidArgumentError("key and value must have the same number of tokens")
    num_tokens = key.shape[0]
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise InvalidArgumentError(
            f"slot_mapping must have shape [{num_tokens}], got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in _INT_DTYPES:
        raise ArgumentTypeError(f"slot_mapping must be an integer tensor, got {slot_mapping.dtype}")
    if num_tokens == 0:
        return
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    keep = slots >= 0
    slots = slots[keep]
    if validate:
        _check_slots(slots, num_blocks * block_size)
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[keep].to(v_cache.dtype))


def _check_slots(slots: torch.Tensor, num_slots: int) -> None:
    if slots.numel() == 0:
        return
    top = int(slots.max())
    if top >= num_slots:
        raise InvalidArgumentError(f"slot {top} out of range for a cache with {num_slots} slots")


# --------------------------------------------------------------------------- #
# copy_blocks / swap_blocks
# --------------------------------------------------------------------------- #


def copy_blocks(kv_caches: Sequence[torch.Tensor], blocks_to_copy: BlockPairs) -> None:
    """Copy-on-write: copy block ``src`` to every ``dst`` it is paired with.

    ``blocks_to_copy`` is what ``append_slots`` returns (``{src: [dst, ...]}``), any iterable
    of ``(src, dst)`` pairs, or an integer ``[n, 2]`` tensor or numpy array of pairs.
    Applied to every layer cache in ``kv_caches`` (each
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, K and V together).
    All sources are read before any destination is written, so the result does
    not depend on order.  Destinations must be distinct.
    """
    src_ids, dst_ids = _block_pairs(blocks_to_copy, "blocks_to_copy")
    if not dst_ids:
        return
    caches = _check_cache_list(kv_caches, "kv_caches")
    num_blocks = caches[0].shape[1]
    src_ids = _check_block_ids(src_ids, num_blocks, "source")
    dst_ids = _check_block_ids(dst_ids, num_blocks, "destination")
    _check_unique(dst_ids, "destination")
    index_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for cache in caches:
        if cache.device not in index_cache:
            index_cache[cache.device] = (
                torch.tensor(src_ids, dtype=torch.long, device=cache.device),
                torch.tensor(dst_ids, dtype=torch.long, device=cache.device),
            )
        src_idx, dst_idx = index_cache[cache.device]
        cache.index_copy_(1, dst_idx, cache.index_select(1, src_idx))


def swap_blocks(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    mapping: BlockPairs,
) -> None:
    """Copy block ``src`` of ``src_caches`` into block ``mapping[src]`` of ``dst_caches``.

    ``mapping`` is what ``swap_in``/``swap_out`` return (``{src: dst}``), any iterable of
    ``(src, dst)`` pairs, or an integer ``[n, 2]`` tensor or numpy array of pairs.

    Used for swap-out (GPU cache -> CPU swap space) and swap-in (CPU -> GPU).
    Layer ``i`` of ``src_caches`` is copied into layer ``i`` of ``dst_caches``;
    both are ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` but may differ
    in ``num_blocks`` and device.  Per layer: one gather on the source device, one
    ``non_blocking`` transfer, one scatter on the destination device.  For a
    device->host transfer all layers are launched first, then the source stream
    is synchronised once before the host-side scatter.
    """
    if len(src_caches) != len(dst_caches):
        raise InvalidArgumentError(
            f"src_caches has {len(src_caches)} layers, dst_caches has {len(dst_caches)}"
        )
    src_ids, dst_ids = _block_pairs(mapping, "mapping")
    if not dst_ids:
        return
    srcs = _check_cache_list(src_caches, "src_caches")
    dsts = _check_cache_list(dst_caches, "dst_caches")
    if srcs[0].shape[2:] != dsts[0].shape[2:] or srcs[0].dtype != dsts[0].dtype:
        raise InvalidArgumentError(
            "src and dst caches must agree on block_size, num_kv_heads, head_dim and dtype: "
            f"{tuple(srcs[0].shape)} {srcs[0].dtype} vs {tuple(dsts[0].shape)} {dsts[0].dtype}"
        )
    src_ids = _check_block_ids(src_ids, srcs[0].shape[1], "source")
    dst_ids = _check_block_ids(dst_ids, dsts[0].shape[1], "destination")
    _check_unique(dst_ids, "destination")

    staged = [_gather_and_transfer(s, d, src_ids) for s, d in zip(srcs, dsts)]
    _sync_device_to_host(srcs, dsts)
    dst_idx: dict[torch.device, torch.Tensor] = {}
    for dst, blocks in zip(dsts, staged):
        if dst.device not in dst_idx:
            dst_idx[dst.device] = torch.tensor(dst_ids, dtype=torch.long, device=dst.device)
        dst.index_copy_(1, dst_idx[dst.device], blocks)


def _gather_and_transfer(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int]) -> torch.Tensor:
    """Gather ``src[:, src_ids]`` on its device and start moving it to ``dst.device``."""
    idx = torch.tensor(src_ids, dtype=torch.long, device=src.device)
    blocks = src.index_select(1, idx)
    if blocks.device == dst.device:
        return blocks
    if dst.device.type == "cpu" and blocks.device.type == "cuda":
        staging = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
        staging.copy_(blocks, non_blocking=True)
        return staging
    return blocks.to(dst.device, non_blocking=True)


def _sync_device_to_host(srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> None:
    """Wait for pending async device->host copies before the CPU reads them."""
    devices = {
        s.device for s, d in zip(srcs, dsts) if s.device.type == "cuda" and d.device.type == "cpu"
    }
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


# --------------------------------------------------------------------------- #
# validation helpers
# --------------------------------------------------------------------------- #


def _block_pairs(pairs: BlockPairs, name: str) -> tuple[list, list]:
    """``(sources, destinations)`` of a mapping, an iterable of pairs or an ``[n, 2]`` array.

    A mapping's values may be lists of destinations (copy-on-write) or single ones (swap).
    Ids are not checked here (see :func:`_check_block_ids`).
    """
    if isinstance(pairs, (torch.Tensor, np.ndarray)):
        arr = index_tensor(pairs, name)
        if arr.dim() != 2 or arr.shape[1] != 2:
            raise InvalidArgumentError(
                f"{name} as an array must have shape [n, 2], got {tuple(arr.shape)}"
            )
        if arr.dtype not in _INT_DTYPES:
            raise ArgumentTypeError(f"{name} must be an integer array, got {arr.dtype}")
        flat = arr.cpu().tolist()
        return [p[0] for p in flat], [p[1] for p in flat]
    srcs: list = []
    dsts: list = []
    if isinstance(pairs, Mapping):
        for src, dst in pairs.items():
            many = dst if isinstance(dst, (list, tuple)) else [dst]
            srcs.extend([src] * len(many))
            dsts.extend(many)
        return srcs, dsts
    try:
        items = list(pairs)
    except TypeError:
        raise ArgumentTypeError(
            f"{name} must be a mapping {{src: [dst, ...]}} or {{src: dst}}, an iterable of "
            f"(src, dst) pairs or an integer [n, 2] array; got {type(pairs).__name__}"
        ) from None
    for pair in items:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ArgumentTypeError(f"{name} item must be a (src, dst) pair, got {pair!r}")
        srcs.append(pair[0])
        dsts.append(pair[1])
    return srcs, dsts


def _check_layer_cache(cache: torch.Tensor, name: str) -> None:
    cache = tensor(cache, name)
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise InvalidArgumentError(
            f"{name} must have shape [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(cache.shape)}"
        )


def _check_cache_list(caches: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    caches = list(caches)
    if not caches:
        raise InvalidArgumentError(f"{name} is empty")
    for i, cache in enumerate(caches):
        _check_layer_cache(cache, f"{name}[{i}]")
        if cache.shape != caches[0].shape or cache.dtype != caches[0].dtype:
            raise InvalidArgumentError(f"{name}[{i}] differs in shape/dtype from {name}[0]")
    return caches


def _check_kv_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise InvalidArgumentError(
            "k_cache must have shape [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or v_cache.device != k_cache.device:
        raise InvalidArgumentError(
            f"v_cache {tuple(v_cache.shape)} on {v_cache.device} does not match "
            f"k_cache {tuple(k_cache.shape)} on {k_cache.device}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise InvalidArgumentError("k_cache and v_cache must be contiguous")


def _check_block_ids(ids: list, num_blocks: int, what: str) -> list[int]:
    """Convert ids with ``operator.index`` and range-check them; returns plain ints."""
    out = []
    for block in ids:
        try:
            if isinstance(block, bool):
                raise TypeError
            block = operator.index(block)
        except TypeError:
            raise ArgumentTypeError(f"{what} block id must be an int, got {block!r}") from None
        if not 0 <= block < num_blocks:
            raise InvalidArgumentError(f"{what} block id {block} out of range [0, {num_blocks})")
        out.append(block)
    return out


def _check_unique(ids: list[int], what: str) -> None:
    if len(set(ids)) != len(ids):
        raise InvalidArgumentError(f"duplicate {what} block ids: {sorted(ids)}")
