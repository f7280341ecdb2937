"""The ``KVCacheBlocks`` pagedkv's managers hand vLLM's scheduler (block ids per group,
``pagedkv.vllm_v1._blocks.make_blocks_class``: the one-group manager's, ``""``, and the hybrid
manager's, several groups or one) against vLLM's own, method by method: ids with every
``allow_none`` / ``group_ids`` combination, ``+``, ``new_empty``, the views' fields, the
unhashed ids, and what the manager reads back as an adopted hit."""

from __future__ import annotations

from typing import Any, List, Tuple

import pytest
from manager_driver import manager_pair
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.request import Request

BS = 4


def request(rid: str, n: int, hasher: Any) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(n)),
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        block_hasher=hasher,
    )


def hits(layout: str) -> Tuple[Any, Any, Any, Any]:
    """vLLM's and pagedkv's managers after request ``a`` (20 tokens) is allocated and cached:
    each one's prefix hit for ``b`` (the same 20 tokens, so a hit of 16), then ``b``'s new
    blocks for its last 4 tokens."""
    kv_cache_utils.init_none_hash(sha256)
    hasher = kv_cache_utils.get_request_block_hasher(BS, sha256)
    vllm, ours = manager_pair(64, BS, layout, None, (), enable_caching=True)
    out: List[Any] = []
    for m in (vllm, ours):
        a = request("a", 20, hasher)
        hit, n, _ = m.get_computed_blocks(a)
        assert m.allocate_slots(a, 20, num_new_computed_tokens=n, new_computed_blocks=hit)
        b = request("b", 20, hasher)
        hit, n, _ = m.get_computed_blocks(b)
        assert n == 16
        new = m.allocate_slots(b, 20 - n, num_new_computed_tokens=n, new_computed_blocks=hit)
        out += [hit, new]
    return out[0], out[1], out[2], out[3]


@pytest.mark.parametrize("layout", ["", "swa-only", "gpt-oss", "gemma3", "two-windows"])
def test_the_blocks_answer_as_vllms(layout: str) -> None:
    v_hit, v_new, o_hit, o_new = hits(layout)
    assert isinstance(o_hit, KVCacheBlocks) and type(o_hit) is not KVCacheBlocks
    groups = len(v_hit.blocks)
    for allow_none in (False, True):
        for group_ids in (None, [0], [groups - 1], list(range(groups))[::-1]):
            kw = dict(allow_none=allow_none, group_ids=group_ids)
            for v, o in ((v_hit, o_hit), (v_new, o_new)):
                assert o.get_block_ids(**kw) == v.get_block_ids(**kw), kw
    assert (o_hit + o_new).get_block_ids() == (v_hit + v_new).get_block_ids()
    assert o_hit.new_empty().get_block_ids() == v_hit.new_empty().get_block_ids()
    assert o_hit.new_empty().get_block_ids(allow_none=True) is None
    assert o_hit.get_unhashed_block_ids_all_groups() == v_hit.get_unhashed_block_ids_all_groups()
    assert o_new.get_unhashed_block_ids_all_groups() == v_new.get_unhashed_block_ids_all_groups()
    for v, o in ((v_hit, o_hit), (v_new, o_new)):
        if groups == 1:
            assert o.get_unhashed_block_ids() == v.get_unhashed_block_ids()
        else:
            with pytest.raises(AssertionError, match="Only one group is supported"):
                o.get_unhashed_block_ids()
    assert repr(o_hit) == f"KVCacheBlocks(block_ids={o_hit.get_block_ids()}, native=pagedkv)"
    for vg, og in zip(v_hit.blocks, o_hit.blocks):
        fields = ("block_id", "ref_cnt", "block_hash", "block_hash_num_tokens", "is_null")
        for field in fields:
            assert [getattr(b, field) for b in og] == [getattr(b, field) for b in vg], field


@pytest.mark.parametrize("layout", ["", "gpt-oss"])
def test_a_returned_list_is_a_copy(layout: str) -> None:
    """Changing what ``get_block_ids`` returned leaves the blocks object as it was."""
    _, _, o_hit, _ = hits(layout)
    ids = o_hit.get_block_ids()
    before = [list(g) for g in ids]
    ids[0].append(999)
    assert [list(g) for g in o_hit.get_block_ids()] == before


@pytest.mark.parametrize("layout", ["", "swa-only", "gpt-oss", "gemma3", "two-windows"])
def test_the_empty_blocks_answer_as_vllms(layout: str) -> None:
    """Each manager's shared empty ``KVCacheBlocks`` (``make_empty_blocks``, one list per
    group) answers as vLLM's manager's own, every ``allow_none`` / ``group_ids`` combination,
    and each call returns fresh lists."""
    vllm, ours = manager_pair(64, BS, layout, None, (), enable_caching=True)
    v, o = vllm.empty_kv_cache_blocks, ours.empty_kv_cache_blocks
    groups = len(v.blocks)
    assert o == v and len(o.blocks) == groups
    for allow_none in (False, True):
        for group_ids in (None, [0], [groups - 1], list(range(groups))[::-1]):
            kw = dict(allow_none=allow_none, group_ids=group_ids)
            assert o.get_block_ids(**kw) == v.get_block_ids(**kw), kw
    first = o.get_block_ids()
    first[0].append(7)
    assert o.get_block_ids() == v.get_block_ids()


def test_the_pool_and_group_views_read_as_vllms() -> None:
    """The read-only views vLLM's tests inspect (``block_pool.blocks``, ``free_block_queue``,
    ``cached_block_hash_to_block``, a group's ``req_to_blocks`` / ``num_cached_block``) show
    what vLLM's own objects show after the same calls; out-of-range reads raise as vLLM's
    list and dicts do."""
    kv_cache_utils.init_none_hash(sha256)
    hasher = kv_cache_utils.get_request_block_hasher(BS, sha256)
    vllm, ours = manager_pair(16, BS, "", None, (), enable_caching=True)
    for m in (vllm, ours):
        for rid, n in (("a", 10), ("b", 6)):
            m.allocate_slots(request(rid, n, hasher), n)
        m.free(request("b", 6, hasher))
    views = []
    for m in (vllm, ours):
        pool, group = m.block_pool, m.coordinator.single_type_managers[0]
        cached = pool.cached_block_hash_to_block
        views.append(
            (
                len(pool.blocks),
                [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
                pool.free_block_queue.num_free_blocks,
                [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
                len(cached),
                {k: getattr(v, "block_id", None) for k, v in cached._cache.items()},
                len(group.req_to_blocks),
                len(group.num_cached_block),
                group.num_cached_block["a"],
                "b" in group.num_cached_block,
                group.num_cached_block.get("b", -1),
            )
        )
    assert views[0] == views[1]
    pool, group = ours.block_pool, ours.coordinator.single_type_managers[0]
    assert pool.blocks[-1].block_id == 15 and pool.blocks[0] is pool.null_block
    for bad, error in ((16, IndexError), (-17, IndexError), ("1", TypeError)):
        with pytest.raises(error):
            pool.blocks[bad]
        with pytest.raises(error):
            vllm.block_pool.blocks[bad]
    with pytest.raises(KeyError):
        group.num_cached_block["b"]
