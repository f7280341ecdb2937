"""The cost of vLLM's v1 KV cache manager and pagedkv's, call by call and byte by byte, on real
``Request`` objects (``python -m pagedkv.bench.vllm_v1 --memory --calls``)."""

from __future__ import annotations

import time
from typing import Any, Dict, List, Tuple

from pagedkv.bench.vllm_v1 import driver, hybrid


def _distinct_requests(count: int, block_size: int, prompt_len: int) -> List[Any]:
    """``count`` vLLM requests with random ``prompt_len``-token prompts (block hashes for
    ``block_size``)."""
    import random

    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request as VRequest

    hasher = driver.request_block_hasher(block_size)
    rng = random.Random(0)
    return [
        VRequest(
            request_id=f"fill-{i}",
            prompt_token_ids=[rng.randrange(32000) for _ in range(prompt_len)],
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=hasher,
        )
        for i in range(count)
    ]


def memory_per_cached_block(
    num_blocks: int = 24_576, block_size: int = 16, per_request: int = 256, layout: str = ""
) -> Dict[str, Any]:
    """Bytes per block of a KV cache manager whose pool is full of cached (free, evictable)
    blocks, vLLM's and pagedkv's, after the same calls (each request allocated, its full blocks
    cached in every group, then freed). ``layout``: a hybrid layout's KV cache groups
    (:mod:`.hybrid`; attention layers only, a Mamba layout is refused) under dense retention
    (``prefix_cache_retention_interval`` ``None``: every full block of every group stays
    cached; under vLLM's default 0 a sliding-window group keeps only its boundary blocks, so
    the pool would not fill with cached blocks), else one full-attention group. vLLM's:
    everything its manager allocated, by ``tracemalloc`` (per block a ``KVCacheBlock``, its
    ``BlockHashWithGroupId`` bytes, its ``BlockHashToBlockMap`` entry, the block list).
    pagedkv's: the native manager's ``heap_bytes()`` (every buffer's capacity; checked against
    a counting allocator in rust/core/tests/v1_memory.rs)."""
    import gc
    import tracemalloc

    from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMManager

    from pagedkv.vllm_v1 import KVCacheManager as PagedManager

    if layout and hybrid.is_mamba(layout):
        raise ValueError(
            f"{layout}: a Mamba group holds a state per request, not a block per block of "
            "tokens: its pool never fills with cached blocks"
        )

    def config() -> Any:
        if not layout:
            return driver.kv_cache_config(num_blocks, block_size)
        dense = None
        return driver.kv_cache_config(
            num_blocks, block_size, hybrid.groups(layout, block_size), dense
        )

    num_groups = len(config().kv_cache_groups)
    # every block but the null block and a remainder
    count = (num_blocks - 1) // (per_request * num_groups)
    requests = _distinct_requests(count, block_size, per_request * block_size)
    args = dict(max_model_len=per_request * block_size + 1, scheduler_block_size=block_size)
    args.update(hash_block_size=block_size, enable_caching=True)

    def build_and_fill(cls: Any) -> Any:
        m = cls(config(), **args)
        for r in requests:
            if m.allocate_slots(r, r.num_tokens) is None:
                raise RuntimeError("the fill does not fit")
            m.free(r)
        return m

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        theirs = build_and_fill(VLLMManager)
        gc.collect()
        vllm_bytes = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del theirs
    ours = build_and_fill(PagedManager)
    cached = len(requests) * per_request * num_groups
    if _num_cached(ours, layout) != cached:
        raise RuntimeError("pagedkv's pool is not full of cached blocks")
    return {
        "layout": layout,
        "num_groups": num_groups,
        "num_blocks": num_blocks,
        "cached_blocks": cached,
        "vllm_bytes_per_block": vllm_bytes / num_blocks,
        "pagedkv_bytes_per_block": ours._native.heap_bytes() / num_blocks,
    }


def _num_cached(manager: Any, layout: str) -> int:
    """The blocks of pagedkv's native ``manager`` that hold a hash (a check, not timed)."""
    native = manager._native
    if not layout:
        return native.num_cached_hashes()
    from pagedkv.vllm_v1._hybrid import HybridKVCacheManager

    if type(manager) is not HybridKVCacheManager:
        raise RuntimeError(f"pagedkv's manager is {type(manager).__name__}, not the native one")
    return sum(native.block_hash(b) is not None for b in range(native.num_blocks))


def decode_call_cost(
    num_requests: int = 256, prompt_len: int = 500, steps: int = 200, block_size: int = 16
) -> Dict[str, float]:
    """Nanoseconds per decode call of the scheduler's hottest manager pair,
    ``allocate_slots(request, 1, num_lookahead_tokens=0).get_block_ids(allow_none=True)``,
    vLLM's manager and pagedkv's, on real ``Request`` objects: ``num_requests`` running
    requests (their prompts computed) advanced one token per step, both managers timed in the
    same step (the requests' own updates between steps are not timed)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMManager
    from vllm.v1.request import RequestStatus

    from pagedkv.vllm_v1 import KVCacheManager as PagedManager

    num_blocks = num_requests * ((prompt_len + steps) // block_size + 2) + 1
    args = dict(max_model_len=prompt_len + steps + 1, scheduler_block_size=block_size)
    args.update(hash_block_size=block_size, enable_caching=True)

    def running(cls: Any) -> Tuple[Any, List[Any]]:
        m = cls(driver.kv_cache_config(num_blocks, block_size), **args)
        reqs = _distinct_requests(num_requests, block_size, prompt_len)
        for r in reqs:
            blocks, hit, _ = m.get_computed_blocks(r)
            if m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is None:
                raise RuntimeError("the running requests do not fit")
            r.num_computed_tokens = r.num_tokens
            r.status = RequestStatus.RUNNING
            r.append_output_token_ids(7)
        return m, reqs

    lanes = {"vllm": running(VLLMManager), "pagedkv": running(PagedManager)}
    total = dict.fromkeys(lanes, 0.0)
    for _ in range(steps):
        for name, (m, reqs) in lanes.items():
            alloc = m.allocate_slots
            t0 = time.perf_counter()
            for r in reqs:
                alloc(r, 1, num_lookahead_tokens=0).get_block_ids(allow_none=True)
            total[name] += time.perf_counter() - t0
            for r in reqs:
                r.num_computed_tokens += 1
                r.append_output_token_ids(7)
    calls = num_requests * steps
    return {f"{name}_ns": t / calls * 1e9 for name, t in total.items()}


def format_call_cost(cost: Dict[str, float]) -> str:
    return (
        f"decode allocate_slots + get_block_ids(allow_none=True): vLLM {cost['vllm_ns']:.0f} ns,"
        f" pagedkv {cost['pagedkv_ns']:.0f} ns -> {cost['vllm_ns'] / cost['pagedkv_ns']:.1f}x"
    )


def format_memory(mem: Dict[str, Any]) -> str:
    """``memory[, LAYOUT (K groups)], pool of N blocks (C cached): vLLM X B/block, pagedkv Y
    B/block -> R of vLLM's``."""
    ratio = mem["pagedkv_bytes_per_block"] / mem["vllm_bytes_per_block"]
    where = f", {mem['layout']} ({mem['num_groups']} groups)" if mem.get("layout") else ""
    return (
        f"memory{where}, pool of {mem['num_blocks']} blocks ({mem['cached_blocks']} cached): "
        f"vLLM {mem['vllm_bytes_per_block']:.0f} B/block, pagedkv "
        f"{mem['pagedkv_bytes_per_block']:.0f} B/block -> {ratio:.2f} of vLLM's"
    )
