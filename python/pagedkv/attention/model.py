"""A tiny decoder-only transformer that runs on the paged KV cache.

Llama-shaped (RMSNorm, rotary positions, GQA attention, SiLU-gated MLP), random
weights from a fixed seed, no downloads.  It exists to exercise the paged
machinery end to end: :meth:`TinyDecoder.paged_forward` (cache + block tables)
must reproduce :meth:`TinyDecoder.dense_forward` (plain causal attention).

Engine usage, one step::

    batch = build_paged_batch(
        [SeqChunk(token_ids=new_tokens, num_cached=n_done, block_table=blocks), ...],
        block_size=block_size,
    )
    logits = model.paged_forward_batch(batch, kv_caches)   # [total_new_tokens, vocab]
    next_tokens = logits[batch.last_token_indices()].argmax(-1)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidArgumentError
from .kv_cache import allocate_kv_cache, split_kv_cache, write_kv
from .paged_attention import paged_attention

__all__ = ["PagedBatch", "SeqChunk", "TinyConfig", "TinyDecoder", "build_paged_batch"]


@dataclass(frozen=True)
class TinyConfig:
    """Model hyper-parameters; the defaults make a ~60k-parameter model."""

    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise InvalidArgumentError("head_dim must be even for rotary embeddings")


# --------------------------------------------------------------------------- #
# batch metadata
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class SeqChunk:
    """The tokens one sequence feeds in this step.

    ``token_ids``: the new tokens (a prompt chunk, the uncached suffix of a prompt,
    or one decode token).  ``num_cached``: tokens of the sequence already in the
    cache, i.e. the position of ``token_ids[0]``.  ``block_table``: the
    sequence's physical block ids in logical order, covering at least
    ``num_cached + len(token_ids)`` tokens.
    """

    token_ids: Sequence[int]
    num_cached: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class PagedBatch:
    """Tensors for one :meth:`TinyDecoder.paged_forward` call (``T`` tokens, ``B`` seqs).

    ``input_ids``, ``positions``, ``slot_mapping``: long ``[T]``.
    ``block_tables``: int32 ``[B, max_blocks]`` padded with 0.
    ``context_lens``: int32 ``[B]`` (cached + new tokens).
    ``query_start_loc``: int32 ``[B + 1]``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor

    def last_token_indices(self) -> torch.Tensor:
        """Long ``[B]``: row of each sequence's last new token (where to sample)."""
        return self.query_start_loc[1:].long() - 1


def build_paged_batch(
    chunks: Sequence[SeqChunk], block_size: int, device: torch.device | str = "cpu"
) -> PagedBatch:
    """Pack per-sequence chunks into the flat tensors paged attention consumes."""
    if not chunks:
        raise InvalidArgumentError("build_paged_batch needs at least one chunk")
    q_lens = [len(c.token_ids) for c in chunks]
    ctx_lens = [c.num_cached + n for c, n in zip(chunks, q_lens)]
    for i, (c, ctx) in enumerate(zip(chunks, ctx_lens)):
        if c.num_cached < 0:
            raise InvalidArgumentError(f"chunk {i}: num_cached must be >= 0")
        if len(c.block_table) * block_size < ctx:
            raise InvalidArgumentError(
                f"chunk {i}: {len(c.block_table)} blocks of {block_size} cannot hold {ctx} tokens"
            )
    max_blocks = max(len(c.block_table) for c in chunks)
    tables = torch.zeros((len(chunks), max_blocks), dtype=torch.long)
    for i, c in enumerate(chunks):
        tables[i, : len(c.block_table)] = torch.tensor(list(c.block_table), dtype=torch.long)

    q_lens_t = torch.tensor(q_lens, dtype=torch.long)
    total = int(q_lens_t.sum())
    seq_ids = torch.repeat_interleave(torch.arange(len(chunks)), q_lens_t, output_size=total)
    starts = torch.cumsum(q_lens_t, 0) - q_lens_t
    cached = torch.tensor([c.num_cached for c in chunks], dtype=torch.long)
    positions = cached[seq_ids] + torch.arange(total) - starts[seq_ids]
    slots = tables[seq_ids, positions // block_size] * block_size + positions % block_size
    input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(q_lens_t, 0)])
    return PagedBatch(
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        block_tables=tables.to(device=device, dtype=torch.int32),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
    )


# --------------------------------------------------------------------------- #
# model
# --------------------------------------------------------------------------- #


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension, computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate-half RoPE.  ``x``: ``[T, heads, head_dim]``; ``positions``: ``[T]``."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, half]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + rotated * sin).to(x.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SiLU-gated MLP block; attention itself is supplied by the caller."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.attn_norm = RMSNorm(h, cfg.rms_eps)
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def qkv(self, hidden: torch.Tensor, positions: torch.Tensor):
        """``hidden [T, hidden]`` -> q ``[T, H, D]``, k/v ``[T, H_kv, D]`` (RoPE applied)."""
        cfg, n = self.cfg, hidden.shape[0]
        x = self.attn_norm(hidden)
        q = self.q_proj(x).view(n, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(n, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(n, cfg.num_kv_heads, cfg.head_dim)
        return apply_rope(q, positions, cfg.rope_base), apply_rope(k, positions, cfg.rope_base), v

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual add of ``attn [T, H, D]`` projected, then the MLP residual."""
        hidden = hidden + self.o_proj(attn.reshape(hidden.shape[0], -1))
        x = self.mlp_norm(hidden)
        return hidden + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TinyDecoder(nn.Module):
    """Tiny Llama-style LM with a dense reference path and a paged-cache path."""

    def __init__(
        self,
        config: TinyConfig | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = cfg = config or TinyConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._init_weights(cfg.seed)
        self.to(device=device, dtype=dtype)
        self.eval()

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """Deterministic (CPU generator) init, independent of the global RNG."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif param.dim() == 2 and not name.startswith("embed"):
                param.copy_(noise / math.sqrt(param.shape[1]))
            else:
                param.copy_(noise)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def allocate_kv_caches(
        self, num_blocks: int, block_size: int, *, device=None, dtype=None
    ) -> list[torch.Tensor]:
        """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` cache per layer."""
        cfg = self.config
        return [
            allocate_kv_cache(
                num_blocks,
                block_size,
                cfg.num_kv_heads,
                cfg.head_dim,
                dtype=dtype or self.dtype,
                device=device or self.device,
            )
            for _ in range(cfg.num_layers)
        ]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final_norm(hidden))

    @torch.no_grad()
    def dense_forward(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Reference: full causal attention over one sequence, no cache.

        ``token_ids``: ``[T]``.  Returns logits ``[T, vocab_size]``.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(ids.shape[0], device=self.device)
        group = self.config.num_heads // self.config.num_kv_heads
        hidden = self.embed(ids)
        for layer in self.layers:
            q, k, v = layer.qkv(hidden, positions)
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
            ).transpose(0, 1)
            hidden = layer.finish(hidden, attn)
        return self._logits(hidden)

    @torch.no_grad()
    def paged_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_start_loc: torch.Tensor | None = None,
        *,
        backend: str = "auto",
        validate: bool = True,
    ) -> torch.Tensor:
        """Run the new tokens of a batch against (and into) the paged cache.

        Args:
            input_ids, positions, slot_mapping: ``[T]`` for the packed new tokens;
                ``positions`` are absolute (RoPE), ``slot_mapping`` says where each
                token's K/V goes (``-1`` = don't store).
            kv_caches: one ``[2, num_blocks, block_size, H_kv, D]`` tensor per layer.
            block_tables, context_lens, query_start_loc: as in
                :func:`~pagedkv.attention.paged_attention.paged_attention`
                (``query_start_loc=None``: decode, one token per sequence).

        Returns:
            logits ``[T, vocab_size]``.
        """
        if len(kv_caches) != len(self.layers):
            raise InvalidArgumentError(
                f"need {len(self.layers)} layer caches, got {len(kv_caches)}"
            )
        hidden = self.embed(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            q, k, v = layer.qkv(hidden, positions)
            k_cache, v_cache = split_kv_cache(kv_cache)
            write_kv(k_cache, v_cache, k, v, slot_mapping, validate=validate)
            attn = paged_attention(
                q,
                k_cache,
                v_cache,
                block_tables,
                context_lens,
                query_start_loc=query_start_loc,
                backend=backend,
                validate=validate,
            )
            hidden = layer.finish(hidden, attn)
        return self._logits(hidden)

    def paged_forward_batch(
        self, batch: PagedBatch, kv_caches: Sequence[torch.Tensor], **kwargs
    ) -> torch.Tensor:
        """:meth:`paged_forward` on a :class:`PagedBatch`; returns logits ``[T, vocab]``."""
        return self.paged_forward(
            batch.input_ids,
            batch.positions,
            batch.slot_mapping,
            kv_caches,
            batch.block_tables,
            batch.context_lens,
            batch.query_start_loc,
            **kwargs,
        )
