"""The native BlockPool through its bindings: behaviour, and bad input that must raise the typed
exceptions while leaving every counter unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
from pagedkv.errors import (
    ArgumentTypeError,
    DoubleFreeError,
    InvalidArgumentError,
    OutOfBlocksError,
    PagedKVError,
)

BS = 4


def toks(seed: int) -> list:
    return [seed * 10 + i for i in range(BS)]


def counters(pool: pagedkv.BlockPool) -> tuple:
    return (
        pool.num_free,
        pool.num_referenced,
        pool.num_cached,
        pool.num_evictable,
        pool.lookups,
        pool.hits,
        tuple(pool.ref_count(b) for b in range(pool.num_blocks)),
    )


def test_allocation_order_and_counters():
    pool = pagedkv.BlockPool(4, BS, enable_caching=False)
    assert [pool.allocate() for _ in range(2)] == [3, 2]
    assert (pool.num_free, pool.num_referenced) == (2, 2)
    cached = pagedkv.BlockPool(4, BS)
    assert cached.allocate_many(3) == [0, 1, 2]


def test_refcount_share_and_free():
    pool = pagedkv.BlockPool(2, BS)
    b = pool.allocate()
    pool.incref(b, 2)
    assert pool.ref_count(b) == 3
    pool.free_many([b, b])
    assert pool.ref_count(b) == 1
    pool.free(b)
    assert pool.num_free == 2
    pool.check_invariants()


def test_cache_hit_revives_an_evictable_block():
    pool = pagedkv.BlockPool(3, BS)
    b = pool.allocate()
    assert pool.register(b, 1234, toks(1), 4)
    pool.free(b)
    assert (pool.num_evictable, pool.num_cached, pool.num_free) == (1, 1, 3)
    assert pool.lookup(1234, toks(1)) == b
    pool.incref(b)
    assert (pool.num_evictable, pool.ref_count(b)) == (0, 1)
    assert (pool.lookups, pool.hits) == (1, 1)


def test_lookup_confirms_tokens_parent_block_and_extra():
    pool = pagedkv.BlockPool(4, BS)
    parent = pool.allocate()
    b = pool.allocate()
    pool.register(b, 7, toks(1), parent_block=parent, extra_key=9)
    assert pool.lookup(7, toks(1), parent_block=parent, extra_key=9) == b
    assert pool.lookup(7, toks(2), parent_block=parent, extra_key=9) is None  # forced collision
    assert pool.lookup(7, toks(1), parent_block=None, extra_key=9) is None
    assert pool.lookup(7, toks(1), parent_block=parent, extra_key=8) is None
    c = pool.allocate()
    assert not pool.register(c, 7, toks(2))  # hash taken: stays uncached
    assert pool.block_hash(c) is None
    # the parent is freed and handed out again: it no longer vouches for its old child
    pool.free(parent)
    assert pool.allocate() == parent
    assert pool.lookup(7, toks(1), parent_block=parent, extra_key=9) is None


def test_lru_eviction_order_with_tail_first_ties():
    pool = pagedkv.BlockPool(4, BS)
    blocks = pool.allocate_many(4)
    for i, b in enumerate(blocks):
        pool.register(b, 100 + i, toks(i), num_hashed_tokens=(i % 2 + 1) * BS)
        pool.touch(b, 1.0 if i < 2 else 0.0)
    pool.free_many(blocks)
    # t=0 first (block 3 holds more hashed tokens than block 2), then t=1
    assert pool.eviction_order() == [blocks[3], blocks[2], blocks[1], blocks[0]]
    assert pool.allocate() == blocks[3]
    assert pool.evictions == 1
    assert pool.lookup(103, toks(3)) is None


def test_int32_array_tokens_are_accepted():
    pool = pagedkv.BlockPool(2, BS)
    b = pool.allocate()
    pool.register(b, 1, np.array(toks(1), dtype=np.int32))
    assert pool.lookup(1, np.array(toks(1), dtype=np.int64)) == b


BAD_CALLS = [
    ("free", (-1,), InvalidArgumentError),
    ("free", (2**70,), InvalidArgumentError),
    ("free", (5,), InvalidArgumentError),
    ("free", ("1",), ArgumentTypeError),
    ("free", (1.5,), ArgumentTypeError),
    ("free", (None,), ArgumentTypeError),
    ("incref", (3,), InvalidArgumentError),  # free block: cannot be shared
    ("incref", (-5,), InvalidArgumentError),
    ("free_many", ([0, 99],), InvalidArgumentError),
    ("lookup", (1, [1, 2]), InvalidArgumentError),  # wrong token length
    ("lookup", (1, "abcd"), ArgumentTypeError),
    ("lookup", (-1, toks(0)), InvalidArgumentError),
    ("lookup", (2**130, toks(0)), InvalidArgumentError),
    ("lookup", (1, [1, 2, 3, -4]), InvalidArgumentError),
    ("lookup", (1, [1, 2, 3, 2**40]), InvalidArgumentError),
    ("lookup", (1, [1, 2, 3, "x"]), ArgumentTypeError),
    ("register", (0, 1, [1, 2, 3]), InvalidArgumentError),
    ("register", (3, 1, toks(0)), InvalidArgumentError),  # not allocated
    ("touch", (0, float("nan")), InvalidArgumentError),
]


@pytest.mark.parametrize(
    "method,args,exc", BAD_CALLS, ids=[f"{m}{a}"[:40] for m, a, _ in BAD_CALLS]
)
def test_bad_input_raises_typed_error_and_changes_nothing(method, args, exc):
    pool = pagedkv.BlockPool(4, BS)
    b = pool.allocate()
    pool.register(b, 55, toks(5))
    pool.allocate()
    before = counters(pool)
    with pytest.raises(exc) as info:
        getattr(pool, method)(*args)
    assert isinstance(info.value, PagedKVError)
    assert counters(pool) == before
    pool.check_invariants()


def test_double_free_is_typed_and_changes_nothing():
    pool = pagedkv.BlockPool(2, BS, enable_caching=False)
    b = pool.allocate()
    pool.free(b)
    before = counters(pool)
    with pytest.raises(DoubleFreeError):
        pool.free(b)
    with pytest.raises(ValueError):  # also a ValueError for vLLM-style handlers
        pool.free_many([pool.allocate(), b, b])
    assert pool.num_referenced == 1  # free_many checked before freeing anything
    assert counters(pool)[0] == before[0] - 1


def test_out_of_blocks_is_value_and_memory_error():
    pool = pagedkv.BlockPool(1, BS)
    pool.allocate()
    with pytest.raises(OutOfBlocksError) as info:
        pool.allocate()
    assert isinstance(info.value, ValueError) and isinstance(info.value, MemoryError)
    with pytest.raises(OutOfBlocksError):
        pool.allocate_many(1)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_blocks=-1, block_size=4),
        dict(num_blocks=4, block_size=0),
        dict(num_blocks=4, block_size=4, device="tpu"),
    ],
)
def test_bad_constructor_arguments(kwargs):
    with pytest.raises(InvalidArgumentError):
        pagedkv.BlockPool(**kwargs)


def test_randomized_against_a_model():
    """A small seeded run checked against a dict model of ref counts."""
    rng = np.random.default_rng(0)
    pool = pagedkv.BlockPool(16, BS)
    held: dict = {}
    for _ in range(3000):
        op = rng.integers(4)
        if op == 0 and pool.num_free:
            b = pool.allocate()
            assert b not in held
            held[b] = 1
            if rng.random() < 0.5:
                h = int(rng.integers(8))
                pool.register(b, h, toks(h))
        elif op == 1 and held:
            b = list(held)[rng.integers(len(held))]
            pool.free(b)
            held[b] -= 1
            if held[b] == 0:
                del held[b]
        elif op == 2:
            h = int(rng.integers(8))
            hit = pool.lookup(h, toks(h))
            if hit is not None:
                pool.incref(hit)
                held[hit] = held.get(hit, 0) + 1
        for b in range(16):
            assert pool.ref_count(b) == held.get(b, 0)
        assert pool.num_referenced == len(held)
    pool.check_invariants()
