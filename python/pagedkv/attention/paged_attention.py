"""Attention over a paged KV cache (decode, prefill, chunked prefill, mixed batches).

One entry point, :func:`paged_attention`.  The batch is described vLLM-style:

* ``query``: packed ``[total_q, num_heads, head_dim]`` — the query tokens of all
  sequences, concatenated in sequence order.
* ``query_start_loc``: ``[num_seqs + 1]`` cumulative offsets into ``query``
  (sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``).
  ``None`` means *decode*: exactly one query token per sequence
  (``total_q == num_seqs``).  A mixed batch (some sequences prefilling a chunk,
  others decoding one token) is just a ``query_start_loc`` where some sequences
  have length 1.
* ``context_lens``: ``[num_seqs]`` number of tokens of sequence ``i`` in the cache,
  *including* the current query tokens (their K/V must already have been written
  with :func:`~pagedkv.attention.kv_cache.write_kv`, as in vLLM).
* ``block_tables``: integer ``[num_seqs, max_blocks]``; row ``i`` lists the physical
  blocks of sequence ``i`` in logical order.  Entries past
  ``ceil(context_lens[i] / block_size)`` are padding (0 by convention, but any
  value is accepted) and never influence the result.

Query token ``j`` of sequence ``i`` (``q_len_i`` tokens) sits at absolute position
``context_lens[i] - q_len_i + j`` and attends causally to cached positions
``<= `` that position.  GQA/MQA: ``num_heads`` must be a multiple of
``num_kv_heads``; query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``.

Backends (``backend=``):

* ``"torch"``: portable reference path (CPU or CUDA).  Gathers the used blocks
  of every sequence with one advanced-indexing op, pads queries to
  ``[num_seqs, max_q_len]``, masks lengths/causality and computes
  ``softmax(Q K^T * scale) V`` with fp32 (or wider) accumulation.  Fully
  vectorised, no Python loop over sequences or tokens; memory is
  ``O(num_seqs * num_heads * max_q_len * max_context_len)``.
* ``"flash_attn"``: ``flash_attn.flash_attn_with_kvcache`` on CUDA.  Upstream
  flash-attn 2.x requires fp16/bf16, ``head_dim <= 256`` and a *page* size
  (``block_size``) that is a multiple of 256; otherwise forcing this backend
  raises :class:`~pagedkv.errors.InvalidArgumentError`.
* ``"auto"`` (default): ``"flash_attn"`` when all of its requirements hold,
  else ``"torch"``.

Index arguments (``block_tables``, ``context_lens``, ``query_start_loc``) may be numpy
integer arrays, such as the int32 buffers ``BlockSpaceManager.append_slots_batch`` fills: they
are wrapped with ``torch.from_numpy`` (no copy) and moved to the query's device.

Invalid shapes, lengths or block ids raise
:class:`~pagedkv.errors.InvalidArgumentError` (a ``ValueError``); arguments of the wrong type
:class:`~pagedkv.errors.ArgumentTypeError` (a ``TypeError``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ._args import index_tensor, tensor

__all__ = ["FLASH_ATTN_BLOCK_MULTIPLE", "flash_attn_unavailable_reason", "paged_attention"]

#: Upstream flash-attn 2.x rejects paged caches whose block size is not a multiple of this.
FLASH_ATTN_BLOCK_MULTIPLE = 256

_BACKENDS = ("auto", "torch", "flash_attn")
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor | np.ndarray,
    context_lens: torch.Tensor | np.ndarray,
    *,
    query_start_loc: torch.Tensor | np.ndarray | None = None,
    scale: float | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Attention of packed query tokens over their sequences' paged K/V.

    Args:
        query: ``[total_q, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: integer ``[num_seqs, max_blocks]`` (padding past the context).
        context_lens: integer ``[num_seqs]``, cached tokens incl. the query tokens.
        query_start_loc: integer ``[num_seqs + 1]`` cumulative query offsets, or
            ``None`` for decode (one query token per sequence).
        The three index arguments are tensors or numpy integer arrays (shared, not copied).
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        backend: ``"auto"``, ``"torch"`` or ``"flash_attn"`` (see module docs).
        validate: check index values (lengths, block ids).  Costs host syncs on CUDA.

    Returns:
        ``[total_q, num_heads, head_dim]`` in ``query.dtype``.
    """
    if backend not in _BACKENDS:
        raise InvalidArgumentError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    query, k_cache, v_cache = (
        tensor(query, "query"),
        tensor(k_cache, "k_cache"),
        tensor(v_cache, "v_cache"),
    )
    block_tables = index_tensor(block_tables, "block_tables")
    context_lens = index_tensor(context_lens, "context_lens")
    if query_start_loc is not None:
        query_start_loc = index_tensor(query_start_loc, "query_start_loc")
    _check_shapes(query, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    layout = _QueryLayout.build(query_start_loc, block_tables.shape[0], query.shape[0])
    if validate:
        _check_values(layout, context_lens, block_tables, k_cache.shape)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if query.shape[0] == 0:
        return query.new_empty(query.shape)

    if backend == "auto":
        backend = "torch" if flash_attn_unavailable_reason(query, k_cache) else "flash_attn"
    if backend == "flash_attn":
        reason = flash_attn_unavailable_reason(query, k_cache)
        if reason is not None:
            raise InvalidArgumentError(f"flash_attn backend cannot run these inputs: {reason}")
        impl = _flash_paged_attention
    else:
        impl = _torch_paged_attention
    return impl(query, k_cache, v_cache, block_tables, context_lens, layout, scale)


# --------------------------------------------------------------------------- #
# query layout
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class _QueryLayout:
    """Where each packed query row belongs.

    ``seq_ids[t]`` is the sequence of row ``t``, ``local[t]`` its index within the
    sequence's query chunk, ``q_lens[i]`` the chunk length of sequence ``i``
    (all ``[total_q]`` / ``[num_seqs]`` long tensors) and ``max_q`` its maximum.
    """

    seq_ids: torch.Tensor
    local: torch.Tensor
    q_lens: torch.Tensor
    max_q: int

    @staticmethod
    def build(query_start_loc: torch.Tensor | None, num_seqs: int, total_q: int) -> _QueryLayout:
        device = query_start_loc.device if query_start_loc is not None else None
        if query_start_loc is None:
            seq_ids = torch.arange(num_seqs)
            zeros = torch.zeros(num_seqs, dtype=torch.long)
            return _QueryLayout(seq_ids, zeros, torch.ones(num_seqs, dtype=torch.long), 1)
        starts = query_start_loc.to(torch.long)
        q_lens = starts[1:] - starts[:-1]
        if bool((q_lens < 0).any()) or int(starts[0]) != 0 or int(starts[-1]) != total_q:
            raise InvalidArgumentError(
                "query_start_loc must start at 0, be non-decreasing and end at "
                f"total_q={total_q}, got {query_start_loc.tolist()}"
            )
        seq_ids = torch.repeat_interleave(
            torch.arange(num_seqs, device=device), q_lens, output_size=total_q
        )
        local = torch.arange(total_q, device=device) - starts[seq_ids]
        max_q = int(q_lens.max()) if num_seqs else 0
        return _QueryLayout(seq_ids, local, q_lens, max_q)

    def to(self, device: torch.device) -> _QueryLayout:
        return _QueryLayout(
            self.seq_ids.to(device), self.local.to(device), self.q_lens.to(device), self.max_q
        )


# --------------------------------------------------------------------------- #
# torch backend
# --------------------------------------------------------------------------- #


def _torch_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    layout: _QueryLayout,
    scale: float,
) -> torch.Tensor:
    """Gather-then-attend reference implementation; see :func:`paged_attention`."""
    device = query.device
    layout = layout.to(device)
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    ctx = context_lens.to(device=device, dtype=torch.long)
    acc = torch.promote_types(query.dtype, torch.float32)

    num_used_blocks = -(-int(ctx.max()) // block_size)  # ceil
    tables = _sanitize_block_tables(block_tables[:, :num_used_blocks], ctx, block_size)
    kv_len = num_used_blocks * block_size
    keys = k_cache[tables].reshape(num_seqs, kv_len, num_kv_heads, head_dim).to(acc)
    values = v_cache[tables].reshape(num_seqs, kv_len, num_kv_heads, head_dim).to(acc)

    key_pos = torch.arange(kv_len, device=device)
    key_valid = key_pos[None, :] < ctx[:, None]  # [num_seqs, kv_len]
    values = values.masked_fill(~key_valid[:, :, None, None], 0.0)  # garbage*0 may be NaN

    q_pad = query.new_zeros((num_seqs, layout.max_q, num_heads, head_dim), dtype=acc)
    q_pad[layout.seq_ids, layout.local] = query.to(acc)
    q_pad = q_pad.view(num_seqs, layout.max_q, num_kv_heads, group, head_dim)

    scores = torch.einsum("bqhgd,bkhd->bhgqk", q_pad, keys) * scale
    mask = _causal_mask(ctx, layout.q_lens, layout.max_q, key_pos, key_valid)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, values)
    out = out.reshape(num_seqs, layout.max_q, num_heads, head_dim)
    return out[layout.seq_ids, layout.local].to(query.dtype)


def _sanitize_block_tables(
    tables: torch.Tensor, ctx: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Long copy of ``tables`` with entries past each context replaced by block 0.

    ``tables``: ``[num_seqs, n]``; ``ctx``: ``[num_seqs]`` long.  Padding may hold any
    value (e.g. -1); after this it is a valid index whose data is masked out.
    """
    tables = tables.to(device=ctx.device, dtype=torch.long)
    used = -(-ctx // block_size)  # ceil, [num_seqs]
    col = torch.arange(tables.shape[1], device=ctx.device)
    return torch.where(col[None, :] < used[:, None], tables, torch.zeros_like(tables))


def _causal_mask(
    ctx: torch.Tensor,
    q_lens: torch.Tensor,
    max_q: int,
    key_pos: torch.Tensor,
    key_valid: torch.Tensor,
) -> torch.Tensor:
    """Bool ``[num_seqs, max_q, kv_len]``: may query row ``j`` see key position ``k``.

    Row ``j`` of sequence ``i`` is at position ``ctx[i] - q_lens[i] + j``.  Padding
    rows (``j >= q_lens[i]``) land at positions ``>= ctx[i]`` and so see the whole
    context; they are discarded, but this keeps them free of NaNs.
    """
    rows = torch.arange(max_q, device=ctx.device)
    q_pos = (ctx - q_lens)[:, None] + rows[None, :]  # [num_seqs, max_q]
    return (key_pos[None, None, :] <= q_pos[:, :, None]) & key_valid[:, None, :]


# --------------------------------------------------------------------------- #
# flash-attn backend
# --------------------------------------------------------------------------- #


def flash_attn_unavailable_reason(query: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """``None`` if the flash-attn backend can run these inputs, else why not."""
    if not query.is_cuda:
        return "tensors are not on CUDA"
    if query.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != query.dtype:
        return f"needs fp16/bf16 query and cache of one dtype, got {query.dtype}/{k_cache.dtype}"
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        return f"block_size {block_size} is not a multiple of {FLASH_ATTN_BLOCK_MULTIPLE}"
    if head_dim > 256 or head_dim % 8:
        return f"head_dim {head_dim} unsupported (needs <= 256 and a multiple of 8)"
    if not _flash_attn_installed():
        return "flash_attn is not installed"
    return None


@functools.cache
def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _flash_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    layout: _QueryLayout,
    scale: float,
) -> torch.Tensor:
    """``flash_attn_with_kvcache`` over the paged cache.

    flash-attn aligns its causal mask bottom-right (query row ``r`` of
    ``seqlen_q`` sees keys ``<= cache_seqlen - seqlen_q + r``), so ragged query
    chunks are *left*-padded to ``max_q``: the real tokens then sit at exactly
    their absolute positions.  Padding rows are discarded.
    """
    from flash_attn import flash_attn_with_kvcache

    device = query.device
    layout = layout.to(device)
    num_seqs = block_tables.shape[0]
    ctx = context_lens.to(device=device, dtype=torch.long)
    tables = _sanitize_block_tables(block_tables, ctx, k_cache.shape[1]).to(torch.int32)
    rows = layout.max_q - layout.q_lens[layout.seq_ids] + layout.local
    q_pad = query.new_zeros((num_seqs, layout.max_q, *query.shape[1:]))
    q_pad[layout.seq_ids, rows] = query
    out = flash_attn_with_kvcache(
        q_pad,
        k_cache,
        v_cache,
        cache_seqlens=ctx.to(torch.int32),
        block_table=tables.contiguous(),
        softmax_scale=scale,
        causal=True,
    )
    return out[layout.seq_ids, rows]


# --------------------------------------------------------------------------- #
# validation
# --------------------------------------------------------------------------- #


def _check_shapes(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise InvalidArgumentError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    _, _, num_kv_heads, head_dim = k_cache.shape
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise InvalidArgumentError(
            f"query must be [total_q, num_heads, {head_dim}], got {tuple(query.shape)}"
        )
    if query.shape[1] % num_kv_heads:
        raise InvalidArgumentError(
            f"num_heads={query.shape[1]} is not a multiple of num_kv_heads={num_kv_heads}"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != query.device:
            raise InvalidArgumentError(f"{name} is on {t.device}, query is on {query.device}")
    if block_tables.dim() != 2 or block_tables.dtype not in _INT_DTYPES:
        raise InvalidArgumentError(
            "block_tables must be an integer [num_seqs, max_blocks] tensor, "
            f"got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    num_seqs = block_tables.shape[0]
    if context_lens.shape != (num_seqs,) or context_lens.dtype not in _INT_DTYPES:
        raise InvalidArgumentError(
            f"context_lens must be an integer [{num_seqs}] tensor, "
            f"got {context_lens.dtype} {tuple(context_lens.shape)}"
        )
    if query_start_loc is None:
        if query.shape[0] != num_seqs:
            raise InvalidArgumentError(
                f"decode (query_start_loc=None) needs one query per sequence: "
                f"{query.shape[0]} queries for {num_seqs} sequences"
            )
    elif query_start_loc.shape != (num_seqs + 1,) or query_start_loc.dtype not in _INT_DTYPES:
        raise InvalidArgumentError(
            f"query_start_loc must be an integer [{num_seqs + 1}] tensor, "
            f"got {query_start_loc.dtype} {tuple(query_start_loc.shape)}"
        )


def _check_values(
    layout: _QueryLayout,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    cache_shape: torch.Size,
) -> None:
    num_blocks, block_size = cache_shape[0], cache_shape[1]
    ctx = context_lens.to(device="cpu", dtype=torch.long)
    q_lens = layout.q_lens.cpu()
    if bool((ctx < q_lens).any()):
        raise InvalidArgumentError(
            f"context_lens {ctx.tolist()} must be >= query lengths {q_lens.tolist()} "
            "(write the query tokens' K/V before attention)"
        )
    capacity = block_tables.shape[1] * block_size
    if ctx.numel() and int(ctx.max()) > capacity:
        raise InvalidArgumentError(
            f"context length {int(ctx.max())} exceeds block table capacity "
            f"{block_tables.shape[1]} blocks x {block_size}"
        )
    tables = block_tables.to(device="cpu", dtype=torch.long)
    used = torch.arange(tables.shape[1])[None, :] < (-(-ctx // block_size))[:, None]
    ids = tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise InvalidArgumentError(
            f"block_tables reference block ids outside [0, {num_blocks}): "
            f"min {int(ids.min())}, max {int(ids.max())}"
        )
