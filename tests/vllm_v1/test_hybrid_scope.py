"""The hybrid manager's scope (what ``out_of_scope`` accepts and why it refuses the rest), the
native loop over it (its scope and length cap), and bad input: pagedkv exceptions, nothing
changed."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from manager_driver import hybrid_groups, kv_cache_config, layer_spec
from vllm.sampling_params import SamplingParams
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from pagedkv.errors import InvalidArgumentError
from pagedkv.vllm_v1 import KVCacheManager, _scope
from pagedkv.vllm_v1._hybrid import HybridKVCacheManager

ARGS = dict(max_model_len=256, scheduler_block_size=4, hash_block_size=4)


def config(groups: list) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=groups)


def group(i: int, spec: Any) -> KVCacheGroupSpec:
    return KVCacheGroupSpec([f"layer.{i}"], spec)


@pytest.mark.parametrize("layout", ["gpt-oss", "gemma3", "llama4", "two-windows"])
def test_model_layouts_are_in_scope(layout: str) -> None:
    cfg = kv_cache_config(32, 4, layout)
    assert _scope.out_of_scope(cfg, **ARGS) is None
    assert type(KVCacheManager(cfg, **ARGS)) is HybridKVCacheManager


def _reason(groups: list, **kw: Any) -> str:
    why = _scope.out_of_scope(config(groups), **{**ARGS, **kw})
    assert why is not None
    return why


def test_refusals_name_their_reason() -> None:
    full4, swa4 = layer_spec("full", 4), layer_spec(("swa", 2, 0), 4)
    kw = dict(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cross = CrossAttentionSpec(**kw)
    assert "CrossAttentionManager" in _reason([group(0, full4), group(1, cross)])
    assert "without a full-attention group" in _reason(
        [group(0, swa4), group(1, layer_spec(("swa", 3, 0), 4))]
    )
    assert "larger than the hash block" in _reason(
        [group(0, layer_spec("full", 8)), group(1, layer_spec(("swa", 2, 0), 8))],
        scheduler_block_size=8,
    )
    chunk4 = layer_spec(("chunk", 2, 0), 4)
    assert "chunked local group below" in _reason(
        [group(0, full4), group(1, chunk4), group(2, layer_spec(("swa", 2, 0), 8))],
        scheduler_block_size=8,
    )
    # Multi-module MTP's windows (extra retained tokens) are in the slice.
    retained = SlidingWindowSpec(sliding_window=8, extra_retained_tokens=2, **kw)
    assert _scope.out_of_scope(config([group(0, full4), group(1, retained)]), **ARGS) is None
    # EAGLE is native except with a chunked local group (vLLM's lookup asserts against it).
    assert "EAGLE" in _reason([group(0, full4), group(1, chunk4)], use_eagle=True)
    eagle = {**ARGS, "use_eagle": True}
    assert _scope.out_of_scope(config([group(0, full4), group(1, swa4)]), **eagle) is None
    assert "block size 4" in _reason([group(0, full4), group(1, swa4)], hash_block_size=8)


def test_the_native_loop_serves_a_hybrid_manager_and_refuses_what_it_refuses_for_one(
    tiny_model_dir: Any,
) -> None:
    """The hybrid manager is no reason for vLLM's loop; the engine's other refusals still are
    (prefix replay here)."""
    import v1_harness as h

    from pagedkv import vllm_v1 as pv

    cfg = h.with_layout(h.SchedConfig(block_size=4, num_blocks=80), "gemma3")
    sched = h.make_scheduler(cfg, tiny_model_dir, pv.KVCacheManager)
    assert _scope.engine_out_of_scope(sched) is None
    sched.prefix_replay_tokens = 8
    assert _scope.engine_out_of_scope(sched) == "prefix replay"


def _request(n: int) -> Request:
    hash_fn = kv_cache_utils.sha256 if hasattr(kv_cache_utils, "sha256") else None
    from vllm.utils.hashing import get_hash_fn_by_name

    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    return Request(
        request_id="r",
        prompt_token_ids=list(range(n)),
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        block_hasher=kv_cache_utils.get_request_block_hasher(4, hash_fn),
    )


def test_bad_input_raises_pagedkv_errors_and_changes_nothing() -> None:
    m = KVCacheManager(kv_cache_config(32, 4, "gemma3"), **ARGS)
    req = _request(20)
    free = m.block_pool.get_num_free_blocks()
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots(req, 4, num_encoder_tokens=4)
    for external in (10**6, 2**70, -1):  # past max_model_len, past 64 bits, negative
        with pytest.raises(InvalidArgumentError):
            m.allocate_slots(req, 4, num_external_computed_tokens=external)
    with pytest.raises(ValueError):
        m.allocate_slots(req, 0)
    wrong_groups = m.empty_kv_cache_blocks.new_empty()
    wrong_groups = dataclasses.replace(wrong_groups, blocks=((),))
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots(req, 4, new_computed_blocks=wrong_groups)
    with pytest.raises(InvalidArgumentError):
        m.block_pool.free_blocks([m.block_pool.null_block.__class__(m._native, 99)])
    with pytest.raises(InvalidArgumentError):
        m.evict_blocks([1, 10**6])
    with pytest.raises(InvalidArgumentError):
        m.get_computed_blocks(req, max_cache_hit_length=-1)
    assert m.block_pool.get_num_free_blocks() == free
    blocks = m.allocate_slots(req, 20)
    assert [len(g) for g in blocks.get_block_ids()] == [5] * len(hybrid_groups("gemma3", 4))
    m._native.check()


def test_pagedkv_scheduler_runs_its_native_loop_over_the_native_hybrid_manager(
    tiny_model_dir: Any, caplog: pytest.LogCaptureFixture
) -> None:
    import v1_harness as h

    from pagedkv import vllm_v1 as pv

    cfg = h.with_layout(h.SchedConfig(block_size=4, num_blocks=80), "gpt-oss")
    with caplog.at_level("INFO", logger="pagedkv.vllm_v1"):
        sched = h.make_scheduler(cfg, tiny_model_dir, pv.KVCacheManager)
    assert type(sched.kv_cache_manager) is HybridKVCacheManager
    assert sched._pagedkv_loop is not None
    line = "KV cache manager native, scheduling loop native, block hashing native"
    assert line in caplog.text
    assert sched._pagedkv_hashers is not None  # the stand-in hasher for in-scope requests


@pytest.mark.parametrize(
    ("layout", "full_groups"), [("gpt-oss", 1), ("gemma3", 1), ("llama4", 1), ("two-full", 2)]
)
def test_the_length_cap_counts_the_full_attention_groups(
    layout: str, full_groups: int, tiny_model_dir: Any
) -> None:
    """No request can hold more tokens than the full-attention groups' share of the pool (a
    block per hash block in each): the native loop's length cap. A cache that holds
    ``max_model_len`` leaves it as it is."""
    import v1_harness as h

    from pagedkv import vllm_v1 as pv
    from pagedkv.vllm_v1._native_loop import pool_tokens

    if layout == "two-full":
        groups = [group(0, layer_spec("full", 4)), group(1, layer_spec("full", 4))]
        assert pool_tokens(KVCacheManager(config(groups), **ARGS)) == 31 // 2 * 4
        return
    cfg = h.with_layout(h.SchedConfig(block_size=4, num_blocks=20, max_model_len=64), layout)
    sched = h.make_scheduler(cfg, tiny_model_dir, pv.KVCacheManager)
    m = sched.kv_cache_manager
    assert pool_tokens(m) == (cfg.num_blocks - 1) // full_groups * 4
    assert sched.max_model_len == 64  # the cache holds it
    assert not sched._pagedkv_loop.refuses_prompt(63, 64, 1)


@pytest.mark.parametrize("caching", [True, False])
def test_every_retention_runs_the_native_hybrid_manager(caching: bool) -> None:
    """``prefix_cache_retention_interval``: dense (None), vLLM's engine default (0) and
    periodic (a multiple of the scheduler block size) all run pagedkv's hybrid manager, with
    caching on or off; a layout without a window (Llama 4) takes 0 (retention applies to
    none)."""
    for layout, retention in (
        ("gpt-oss", None),
        ("gpt-oss", 0),
        ("gemma3", 0),
        ("gemma3", 32),
        ("two-windows", 8),
        ("llama4", 0),
    ):
        cfg = kv_cache_config(32, 4, layout, retention)
        assert _scope.out_of_scope(cfg, enable_caching=caching, **ARGS) is None
        manager = KVCacheManager(cfg, enable_caching=caching, **ARGS)
        assert type(manager) is HybridKVCacheManager


@pytest.mark.parametrize(
    ("layout", "retention", "match"),
    [
        ("gpt-oss", 6, "multiple of scheduler_block_size"),
        ("gemma3", -4, "non-negative"),
        ("llama4", 4, "no sliding-window or Mamba"),
        ("llama4", -4, "no sliding-window or Mamba"),
    ],
)
def test_an_invalid_retention_is_refused_as_vllm_refuses_it(
    layout: str, retention: int, match: str
) -> None:
    """vLLM's coordinator checks the interval when it is built (caching on or off), before
    anything else; pagedkv's manager, built in its place, refuses the same values with the same
    meaning (a ValueError: InvalidArgumentError)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMManager

    for caching in (True, False):
        cfg = kv_cache_config(32, 4, layout, retention)
        with pytest.raises(ValueError, match=match):
            VLLMManager(cfg, enable_caching=caching, **ARGS)
        assert _scope.out_of_scope(cfg, enable_caching=caching, **ARGS) is None
        with pytest.raises(InvalidArgumentError, match=match):
            KVCacheManager(cfg, enable_caching=caching, **ARGS)


def test_a_positive_retention_on_one_full_attention_group_stays_vllms() -> None:
    """One full-attention group: vLLM's manager refuses a positive interval, so pagedkv's
    scope hands it to vLLM's (which raises); 0 is in scope."""
    cfg = kv_cache_config(32, 4, "", 16)
    assert "positive prefix-cache retention" in _scope.out_of_scope(cfg, **ARGS)
    with pytest.raises(ValueError, match="no sliding-window or Mamba"):
        KVCacheManager(cfg, **ARGS)
    assert _scope.out_of_scope(kv_cache_config(32, 4, "", 0), **ARGS) is None
