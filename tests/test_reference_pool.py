"""The plain-Python BlockPool (pagedkv.reference.pool): refs, LIFO stack, prefix cache, LRU."""

from __future__ import annotations

import random

import pytest

from pagedkv.errors import DoubleFreeError, InvalidArgumentError, OutOfBlocksError
from pagedkv.reference.pool import BlockPool

BS = 4


def toks(seed: int) -> list:
    return [seed * 100 + j for j in range(BS)]


def snapshot(p: BlockPool) -> tuple:
    return (
        [p.ref_count(b) for b in range(p.num_blocks)],
        [p.block_hash(b) for b in range(p.num_blocks)],
        p.num_free,
        p.num_evictable,
        p.num_cached,
        p.eviction_order(),
        list(p._free),
    )


def cached_block(p: BlockPool, h: int, seed: int, nht: int = BS, t: float = -1.0) -> int:
    b = p.allocate()
    assert p.register(b, h, toks(seed), nht)
    if t != -1.0:
        p.touch(b, t)
    return b


def test_allocation_order_mirrors_vllm():
    p = BlockPool(4, BS, enable_caching=False)
    assert [p.allocate() for _ in range(4)] == [3, 2, 1, 0]
    c = BlockPool(4, BS, enable_caching=True)
    assert c.allocate_many(4) == [0, 1, 2, 3]


def test_free_stack_is_lifo():
    p = BlockPool(8, BS, enable_caching=False)
    a, b, c = p.allocate(), p.allocate(), p.allocate()
    p.free(b)
    p.free(a)
    assert p.allocate() == a
    assert p.allocate() == b
    assert p.ref_count(c) == 1


def test_refcounts_double_free_and_sharing_a_free_block():
    p = BlockPool(2, BS, enable_caching=False)
    b = p.allocate()
    p.incref(b, 2)
    assert p.ref_count(b) == 3
    for _ in range(3):
        p.free(b)
    before = snapshot(p)
    with pytest.raises(DoubleFreeError):
        p.free(b)
    with pytest.raises(InvalidArgumentError):
        p.incref(b)  # sharing a FREE block
    with pytest.raises(InvalidArgumentError):
        p.free(7)
    assert snapshot(p) == before  # the failed calls changed nothing
    with pytest.raises(InvalidArgumentError):
        p.incref(p.allocate(), 0)
    p.check_invariants()


def test_out_of_blocks_and_all_or_nothing_batches():
    p = BlockPool(3, BS, enable_caching=False)
    a = p.allocate()
    before = snapshot(p)
    with pytest.raises(OutOfBlocksError):
        p.allocate_many(3)
    assert snapshot(p) == before
    with pytest.raises(DoubleFreeError):
        p.free_many([a, a])  # only one reference to drop
    assert snapshot(p) == before
    p.allocate_many(2)
    with pytest.raises(OutOfBlocksError):
        p.allocate()
    with pytest.raises(MemoryError):  # OutOfBlocksError is also a MemoryError
        p.allocate()


def test_cached_block_becomes_evictable_then_revives():
    p = BlockPool(2, BS)
    b = cached_block(p, 99, 1)
    assert p.num_cached == 1
    p.free(b)
    assert (p.num_free, p.num_evictable, p.is_evictable(b)) == (2, 1, True)
    assert p.lookup(99, toks(1)) == b
    p.incref(b)
    assert (p.num_evictable, p.ref_count(b), p.hits, p.lookups) == (0, 1, 1, 1)
    p.check_invariants()


def test_collision_never_hits_and_register_refuses_a_taken_hash():
    p = BlockPool(3, BS)
    b = cached_block(p, 5, 1)
    assert p.lookup(5, toks(2)) is None  # same hash, other tokens
    assert p.peek(5, toks(1), meta=("other parent",)) is None  # same hash+tokens, other meta
    c = p.allocate()
    assert p.register(c, 5, toks(2)) is False
    assert p.block_hash(c) is None
    assert p.lookup(5, toks(1)) == b
    with pytest.raises(InvalidArgumentError):
        p.register(b, 6, toks(1))  # already cached
    with pytest.raises(InvalidArgumentError):
        p.register(c, 6, toks(1)[:2])  # not a full block
    with pytest.raises(InvalidArgumentError):
        p.lookup(5, toks(1)[:3])
    nocache = BlockPool(1, BS, enable_caching=False)
    with pytest.raises(InvalidArgumentError):
        nocache.register(nocache.allocate(), 1, toks(1))


def test_eviction_order_lru_then_most_hashed_then_fifo():
    p = BlockPool(6, BS)
    a = cached_block(p, 1, 1, nht=4, t=5.0)
    b = cached_block(p, 2, 2, nht=8, t=5.0)
    c = cached_block(p, 3, 3, nht=4, t=1.0)
    d = cached_block(p, 4, 4, nht=8, t=5.0)
    e = cached_block(p, 5, 5, nht=4, t=9.0)
    for x in (a, b, c, d, e):
        p.free(x)
    # c (oldest access), then nht 8 at t=5 in FIFO order (b, d), then a, then e
    assert p.eviction_order() == [c, b, d, a, e]
    with pytest.raises(InvalidArgumentError):
        p.touch(a, 0.0)  # the key is fixed while evictable
    assert p.allocate() == 5  # the free stack goes first
    assert p.allocate() == c  # then the LRU victim, which loses its hash
    assert (p.block_hash(c), p.num_hashed_tokens(c), p.evictions) == (None, 0, 1)
    assert p.lookup(3, toks(3)) is None
    assert p.last_accessed(c) == 1.0  # kept across reuse (as vLLM)
    p.incref(d)  # revive: leaves the order
    assert p.eviction_order() == [b, a, e]
    p.check_invariants()


def test_revive_churn_keeps_the_eviction_list_exact():
    p = BlockPool(4, BS)
    blocks = [cached_block(p, 10 + i, i) for i in range(4)]
    for x in blocks:
        p.free(x)
    for _ in range(1000):
        p.incref(blocks[1])
        p.free(blocks[1])
    assert p.num_evictable == 4
    assert p.eviction_order() == [blocks[0], blocks[2], blocks[3], blocks[1]]
    p.check_invariants()


def _run(fn, *args):
    try:
        return ("ok", fn(*args))
    except (OutOfBlocksError, DoubleFreeError, InvalidArgumentError) as exc:
        return ("err", type(exc).__name__)


@pytest.mark.parametrize("caching", [True, False])
def test_matches_native_block_pool(caching):
    """Same random micro-API calls on the native pool and this one: same answers."""
    pagedkv = pytest.importorskip("pagedkv")
    rng = random.Random(1234 + caching)
    n = 12
    ours = BlockPool(n, BS, enable_caching=caching)
    native = pagedkv.BlockPool(n, BS, enable_caching=caching)
    clock = 0.0
    for _ in range(3000):
        op = rng.choice([0, 0, 1, 1, 1, 1, 2, 3, 3, 4, 4, 5, 6])
        b = rng.randrange(n + 1)  # n is out of range
        low = rng.randrange(6)
        h = low | rng.choice([0, 0, 1]) << 100  # hashes that share their low 64 bits too
        t = toks(low if rng.random() < 0.8 else low + 1)
        if op == 0:
            call = ("allocate",)
        elif op == 1:
            call = ("free", b)
        elif op == 2:
            call = ("incref", b, rng.randrange(1, 3))
        elif op == 3 and caching:
            call = ("register", b, h, t, rng.choice([4, 8, 12]))
        elif op == 4 and caching:
            call = ("lookup", h, t)
        elif op == 5:
            clock += rng.choice([0.0, 1.0])
            call = ("touch", b, clock)
        else:
            call = ("allocate_many", rng.randrange(3))
        got = _run(getattr(ours, call[0]), *call[1:])
        want = _run(getattr(native, call[0]), *call[1:])
        assert got == want, call
        assert ours.num_free == native.num_free
        assert ours.num_evictable == native.num_evictable
        assert ours.eviction_order() == native.eviction_order()
    if caching:
        assert ours.evictions > 50 and ours.hits > 50  # the interesting paths ran
    assert (ours.lookups, ours.hits, ours.evictions) == (
        native.lookups,
        native.hits,
        native.evictions,
    )
    ours.check_invariants()
