"""Memory per cached block: pagedkv's native manager against vLLM's ``KVCacheBlock`` pool."""

from __future__ import annotations

from pagedkv.bench.vllm_v1 import memory_per_cached_block


def test_a_cached_block_costs_at_most_a_quarter_of_vllms() -> None:
    # W1's pool (24,576 blocks of 16), every block but the null block and a partial request's
    # worth cached and evictable.
    mem = memory_per_cached_block(24_576, 16, 256)
    assert mem["pagedkv_bytes_per_block"] * 4 <= mem["vllm_bytes_per_block"], mem
