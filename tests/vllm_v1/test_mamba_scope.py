"""Mamba hybrid groups in pagedkv's hybrid manager: what the scope accepts (``mamba_cache_mode``
"none" with prefix caching off, "align" with it on at the hash block size) and why it refuses
the rest (modes against the caching flag, align's fine-grained hits, zeroing
for mixed precision), the calls vLLM's scheduler makes that treat Mamba groups apart, and bad input:
pagedkv exceptions, nothing changed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from manager_driver import (
    LONE_GROUP_LAYOUTS,
    MAMBA_ALIGN_LAYOUTS,
    MAMBA_LAYOUTS,
    block_sizes,
    kv_cache_config,
    layer_spec,
    mamba_spec,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.request import Request

from pagedkv import _native
from pagedkv.errors import InvalidArgumentError
from pagedkv.vllm_v1 import KVCacheManager, _scope
from pagedkv.vllm_v1._hybrid import HybridKVCacheManager

MAX_LEN = 256


def args(layout: str, caching: bool = False) -> dict:
    sbs, hbs = block_sizes(layout, 4, MAX_LEN)
    return dict(
        max_model_len=MAX_LEN,
        scheduler_block_size=sbs,
        hash_block_size=hbs,
        enable_caching=caching,
    )


@pytest.mark.parametrize("layout", sorted(MAMBA_LAYOUTS))
def test_mamba_layouts_without_prefix_caching_are_in_scope(layout: str) -> None:
    cfg = kv_cache_config(32, 4, layout, None, MAX_LEN)
    assert cfg.needs_kv_cache_zeroing  # a Mamba layer: vLLM zeroes new attention blocks
    assert _scope.out_of_scope(cfg, **args(layout)) is None
    assert type(KVCacheManager(cfg, **args(layout))) is HybridKVCacheManager


def test_mamba_modes_pair_with_prefix_caching_as_vllms_config_pairs_them() -> None:
    """vLLM's model config turns prefix caching into mamba_cache_mode "align" and its absence
    into "none": a "none" spec with caching, or an "align" spec without, is refused."""
    cfg = kv_cache_config(32, 4, "mamba-block", None, MAX_LEN)
    why = _scope.out_of_scope(cfg, **args("mamba-block", caching=True))
    assert why is not None and '"none" with prefix caching' in why, why
    cfg = kv_cache_config(32, 4, "nemotron-h-align", None, MAX_LEN)
    why = _scope.out_of_scope(cfg, **args("nemotron-h-align"))
    assert why is not None and '"align" without prefix caching' in why, why


@pytest.mark.parametrize("layout", sorted(MAMBA_ALIGN_LAYOUTS))
def test_mamba_align_layouts_with_prefix_caching_are_in_scope(layout: str) -> None:
    cfg = kv_cache_config(32, 4, layout, None, MAX_LEN)
    assert _scope.out_of_scope(cfg, **args(layout, caching=True)) is None
    assert type(KVCacheManager(cfg, **args(layout, caching=True))) is HybridKVCacheManager


def test_mamba_align_outside_the_mirrored_part_keeps_vllms_manager() -> None:
    """Align mode with Mamba blocks larger than the hash block (vLLM's fine-grained partial
    hits, with copy-on-write tails) stays vLLM's."""
    full = layer_spec("full", 4)
    aligned = dataclasses.replace(mamba_spec(8, full), mamba_cache_mode="align")
    groups = [KVCacheGroupSpec(["layer.0"], full), KVCacheGroupSpec(["layer.1"], aligned)]
    cfg = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=groups)
    kw = dict(max_model_len=MAX_LEN, scheduler_block_size=8, hash_block_size=4)
    why = _scope.out_of_scope(cfg, enable_caching=True, **kw)
    assert why is not None and "larger than the hash block" in why, why


@pytest.mark.parametrize(
    "eagle",
    [
        dict(use_eagle=True),
        pytest.param(dict(num_hash_lookahead_tokens=1), marks=pytest.mark.lookahead_hashes),
    ],
)
def test_mamba_align_with_eagle_is_in_scope(eagle: dict) -> None:
    """EAGLE/MTP beside an align group: its block drop (``use_eagle``) and 0.33's lookahead
    block hashes (which the scheduler pairs with ``use_eagle=False``) both run pagedkv's
    hybrid manager; the checkpoints read either."""
    cfg = kv_cache_config(32, 4, "qwen3-next-align-spec", None, MAX_LEN)
    kw = dict(args("qwen3-next-align-spec", caching=True), **eagle)
    assert _scope.out_of_scope(cfg, **kw) is None
    assert type(KVCacheManager(cfg, **kw)) is HybridKVCacheManager


def test_zeroing_for_mixed_precision_stays_out_of_scope() -> None:
    """Block zeroing is served for Mamba layers only: a mixed-precision cache (attention
    groups of two dtypes) keeps vLLM's manager."""
    kw = dict(block_size=4, num_kv_heads=1, head_size=8)
    f32 = FullAttentionSpec(dtype=torch.float32, **kw)
    f16 = FullAttentionSpec(dtype=torch.float16, **dict(kw, head_size=16))
    groups = [
        KVCacheGroupSpec(["layer.0"], f32),
        KVCacheGroupSpec(["layer.1"], f16),
        KVCacheGroupSpec(["layer.2"], mamba_spec(MAX_LEN, f32)),
    ]
    cfg = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=groups)
    assert cfg.has_mixed_precision_kv_cache
    why = _scope.out_of_scope(
        cfg,
        max_model_len=MAX_LEN,
        scheduler_block_size=MAX_LEN,
        hash_block_size=MAX_LEN,
        enable_caching=False,
    )
    assert why is not None and "zeroing" in why, why


def _request(n: int) -> Request:
    return Request(
        request_id="r",
        prompt_token_ids=list(range(n)),
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
    )


def _pair(layout: str) -> tuple:
    a = args(layout)
    theirs = VLLMManager(kv_cache_config(32, 4, layout, None, MAX_LEN), **a)
    ours = KVCacheManager(kv_cache_config(32, 4, layout, None, MAX_LEN), **a)
    return theirs, ours


@pytest.mark.parametrize("layout", sorted(set(MAMBA_LAYOUTS) - LONE_GROUP_LAYOUTS))
def test_block_ids_for_computed_tokens_leave_mamba_tables_whole(layout: str) -> None:
    """vLLM clips only attention groups' tables to the computed tokens (a Mamba table's
    blocks are states, not token ranges); so does pagedkv. (A pure Mamba model has no
    attention group, so no blocks to zero.)"""
    theirs, ours = _pair(layout)
    req = _request(10)
    for m in (theirs, ours):
        assert m.allocate_slots(req, 10, num_lookahead_tokens=3) is not None
    for n in (0, 1, 4, 10):
        got = ours.get_block_ids_for_computed_tokens("r", n)
        assert got == theirs.get_block_ids_for_computed_tokens("r", n), (n, got)
    assert ours.take_new_block_ids() == theirs.take_new_block_ids() != []


def test_bad_mamba_input_raises_pagedkv_errors_and_changes_nothing() -> None:
    mamba = ("mamba", 4, 0, 1)
    with pytest.raises(InvalidArgumentError, match="align"):
        _native.V1Hybrid(32, [("full", 4, 0, 0), mamba], 4, 4, 64, 64, True, False, 0, "0.33")
    with pytest.raises(InvalidArgumentError):
        _native.V1Hybrid(
            32, [("full", 4, 0, 0), ("mamba", 0, 0, 1)], 4, 4, 64, 64, False, False, 0, "0.33"
        )
    theirs, ours = _pair("granite4")
    before = ours.block_pool.get_num_free_blocks()
    with pytest.raises(InvalidArgumentError):
        ours.allocate_slots(_request(10), 0)  # nothing to allocate, nothing to adopt
    assert ours.block_pool.get_num_free_blocks() == before
    assert ours.take_new_block_ids() == []


def test_the_length_cap_counts_attention_blocks_not_the_hash_block() -> None:
    """Without caching the hash block is the scheduler block (the lcm with the Mamba block,
    here 256): the native loop's length cap still counts the full-attention group's own
    blocks (31 of 4 tokens, the null block excluded)."""
    from pagedkv.vllm_v1._native_loop import pool_tokens

    ours = _pair("granite4")[1]
    assert ours.hash_block_size == MAX_LEN
    assert pool_tokens(ours) == 31 * 4


def test_a_short_mamba_hit_truncates_as_vllms() -> None:
    """``truncate_computed_blocks`` keeps what a Mamba group's hit has when the endpoint lies
    past it (vLLM's rule, for a connector's deeper endpoint); an attention group's must reach
    it."""
    kw = args("granite4-align", caching=True)
    theirs = VLLMManager(kv_cache_config(64, 4, "granite4-align", None, MAX_LEN), **kw)
    cfg = kv_cache_config(64, 4, "granite4-align", None, MAX_LEN)
    ours = KVCacheManager(cfg, **kw)
    mamba = [isinstance(g.kv_cache_spec, MambaSpec) for g in cfg.kv_cache_groups]
    ids = [
        [0, 10 * i + 5] if m else [10 * i + 1, 10 * i + 2, 10 * i + 3] for i, m in enumerate(mamba)
    ]
    pool = theirs.block_pool.blocks
    vllm_hit = theirs.create_kv_cache_blocks(tuple([pool[b] for b in g] for g in ids))
    want = theirs.truncate_computed_blocks(vllm_hit, 12).get_block_ids()
    assert ours.truncate_computed_blocks(ours._wrap(ids), 12).get_block_ids() == want
    short = [g[:2] for g in ids]
    with pytest.raises(InvalidArgumentError):
        ours.truncate_computed_blocks(ours._wrap(short), 12)
