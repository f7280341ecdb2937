"""Block pool cycles on a 100,000-block pool with caching on: native vs the reference pool.

* alloc/free: allocate 1,000 blocks then free them (per-call and batched native APIs);
* hit/revive: 1,000 cached blocks, all evictable; look each up, revive it (incref) and free it.
"""

from __future__ import annotations

import pytest

import pagedkv
from pagedkv import reference

N = 100_000
K = 1_000
BS = 16
POOLS = {"native": pagedkv.BlockPool, "reference": reference.BlockPool}


def make(kind):
    return POOLS[kind](N, BS, enable_caching=True)


@pytest.mark.benchmark(group="pool-alloc-free-1000")
@pytest.mark.parametrize("kind", list(POOLS))
def test_alloc_free(benchmark, kind):
    pool = make(kind)

    def cycle():
        blocks = [pool.allocate() for _ in range(K)]
        for b in blocks:
            pool.free(b)

    benchmark(cycle)
    assert pool.num_free == N


@pytest.mark.benchmark(group="pool-alloc-free-1000")
@pytest.mark.parametrize("kind", list(POOLS))
def test_alloc_free_batched(benchmark, kind):
    pool = make(kind)

    def cycle():
        pool.free_many(pool.allocate_many(K))

    benchmark(cycle)
    assert pool.num_free == N


@pytest.mark.benchmark(group="pool-hit-revive-1000")
@pytest.mark.parametrize("kind", list(POOLS))
def test_hit_revive(benchmark, kind):
    pool = make(kind)
    keys = [(10_000 + i, [i] * BS) for i in range(K)]
    for h, toks in keys:
        b = pool.allocate()
        pool.register(b, h, toks)
        pool.free(b)

    def cycle():
        for h, toks in keys:
            b = pool.lookup(h, toks)
            pool.incref(b)
            pool.free(b)

    benchmark(cycle)
    assert pool.num_evictable == K and pool.hits >= K
