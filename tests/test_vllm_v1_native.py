"""The native half of ``pagedkv.vllm_v1`` without vLLM: ``_native.V1Manager`` (vLLM v1's
manager semantics; the comparison with vLLM itself runs in tests/vllm_v1 inside vLLM's
virtualenvs) and the lazy import (``import pagedkv`` never needs vLLM)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv import _native
from pagedkv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    PagedKVError,
    UnsupportedVLLMError,
)

H = [bytes([i]) * 32 for i in range(1, 9)]


def manager(num_blocks: int = 10, caching: bool = True, events: bool = True) -> _native.V1Manager:
    return _native.V1Manager(num_blocks, 4, 1 << 20, caching, events, 0)


def alloc(m: _native.V1Manager, rid: str, n: int, hashes=(), computed=None, n_computed=0):
    return m.allocate_slots(
        rid,
        0,
        n + n_computed,
        True,
        n,
        n_computed,
        computed,
        0,
        False,
        False,
        0,
        False,
        list(hashes),
    )


def test_blocks_come_in_vllm_order_and_null_block_is_reserved() -> None:
    m = manager()
    assert alloc(m, "a", 9, H[:2]) == [1, 2, 3]
    assert m.free_queue() == [4, 5, 6, 7, 8, 9]
    assert m.take_events() == [("stored", 0, 2)]
    assert m.block_hash(1) == H[0] and m.hashed_tokens(2) == 8 and m.block_hash(3) is None
    m.free("a")
    # uncached block 3 goes to the head, cached 2 and 1 to the tail (tail-first order)
    assert m.free_queue() == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    m.check()


def test_prefix_hit_is_adopted_and_ref_counted() -> None:
    m = manager()
    alloc(m, "a", 8, H[:2])
    hit = m.longest_cache_hit(H[:3], 2)
    assert hit == [1, 2]
    assert alloc(m, "b", 3, H[:2], computed=hit, n_computed=8) == [3]
    assert m.block_ids("b") == [1, 2, 3] and m.ref_cnt(1) == 2
    assert m.estimate_cached_tokens("b") == 8
    m.check()


def test_refused_and_failing_calls_change_nothing() -> None:
    m = manager(num_blocks=4)
    before = m.free_queue()
    assert alloc(m, "a", 100) is None
    with pytest.raises(InvalidArgumentError):
        alloc(m, "a", 0)
    with pytest.raises(InvalidArgumentError):  # a hash that is not bytes
        alloc(m, "a", 8, ["not bytes", H[1]])
    with pytest.raises(InvalidArgumentError):  # adopting a block that is not cached
        alloc(m, "a", 4, computed=[2], n_computed=4)
    assert m.free_queue() == before and m.num_requests == 0
    assert alloc(m, "a", 4) == [1]
    with pytest.raises(DoubleFreeError):
        m.free_blocks([1, 1])
    assert m.ref_cnt(1) == 1
    with pytest.raises(InvalidArgumentError):
        m.evict_blocks([0, 99])
    m.check()


def test_errors_derive_from_builtins() -> None:
    m = manager()
    with pytest.raises(ValueError):
        m.ref_cnt(-1)
    with pytest.raises(PagedKVError):
        m.block_hash(10)


def test_events_log_evictions_and_reset() -> None:
    m = manager(num_blocks=3)
    alloc(m, "a", 8, H[:2])
    m.free("a")
    m.take_events()
    assert alloc(m, "b", 4) == [2]  # the tail-first free order hands out block 2 first
    assert m.take_events() == [("removed", H[1], 0)]
    assert not m.reset_prefix_cache()
    m.free("b")
    assert m.reset_prefix_cache()
    assert m.take_events() == [("cleared", 0, 0)]
    assert m.num_cached_hashes() == 0


def test_import_pagedkv_never_imports_vllm() -> None:
    code = (
        "import sys, pagedkv, pagedkv.vllm_v1 as v\n"
        "assert 'vllm' not in sys.modules, 'vllm imported'\n"
        "print(v.SUPPORTED_VLLM)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "0.33.0" in out.stdout


def test_using_the_plugin_without_vllm_is_a_clear_error() -> None:
    code = (
        "import pagedkv.vllm_v1 as v\n"
        "try:\n    v.Scheduler\nexcept ImportError as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith(UnsupportedVLLMError.__name__)
    assert "pagedkv[vllm]" in out.stdout
