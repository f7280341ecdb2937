"""Memory per cached block: pagedkv's native manager against vLLM's ``KVCacheBlock`` pool."""

from __future__ import annotations

import pytest

from pagedkv.bench.vllm_v1 import hybrid, memory_per_cached_block


def test_a_cached_block_costs_at_most_a_quarter_of_vllms() -> None:
    # W1's pool (24,576 blocks of 16), every block but the null block and a partial request's
    # worth cached and evictable.
    mem = memory_per_cached_block(24_576, 16, 256)
    assert mem["pagedkv_bytes_per_block"] * 4 <= mem["vllm_bytes_per_block"], mem


@pytest.mark.parametrize("layout", [n for n in sorted(hybrid.LAYOUTS) if not hybrid.is_mamba(n)])
def test_a_cached_block_of_a_hybrid_pool_costs_at_most_a_third_of_vllms(layout: str) -> None:
    # The bench's attention-only hybrid pools (W1's memory: 24,576 blocks per group), every
    # group's blocks cached and evictable, pagedkv's native hybrid manager against vLLM's
    # coordinator (a Mamba group holds a state per request, not a block per block of tokens:
    # no such pool); ``swa-only`` is one sliding-window group (vLLM's unitary coordinator).
    mem = memory_per_cached_block(hybrid.num_blocks(layout, 24_576, 16), 16, 256, layout)
    assert mem["num_groups"] == len(hybrid.groups(layout, 16))
    assert (mem["num_groups"] == 1) == (layout == "swa-only"), mem
    assert mem["cached_blocks"] > 0.98 * mem["num_blocks"], mem
    assert mem["pagedkv_bytes_per_block"] * 3 <= mem["vllm_bytes_per_block"], mem


def test_a_mamba_hybrid_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="Mamba"):
        memory_per_cached_block(hybrid.num_blocks("granite4", 1024, 16), 16, 256, "granite4")
