"""Replay the core's randomized hybrid-coordinator run on vLLM's own KVCacheManager.

The Rust test ``vllm_v1::coordinator_tests::randomized_runs_keep_every_invariant`` writes, with
``PAGEDKV_HYBRID_TRACE=path``, every call it makes on ``core::vllm_v1::coordinator::Hybrid``
and what came of it (hit blocks and length, new blocks per group, the free queue, every live
request's table per group), one Python literal a line. This script makes the same calls on
vLLM's ``KVCacheManager`` (hybrid coordinator, same layouts and ``prefix_cache_retention_interval``:
dense, 0 and periodic) and reports every difference; the request's ``shared_prefix_boundary`` is
set from vLLM's own lookup, as vLLM's scheduler sets it.
It needs only vLLM (no pagedkv build); run it in the release's virtualenv
(``scripts/vllm_envs.sh``)::

    PAGEDKV_HYBRID_TRACE=/tmp/hybrid.trace cargo test -p pagedkv-core --lib randomized_runs
    ~/.cache/pagedkv/venvs/vllm-0.33/bin/python scripts/hybrid_replay.py /tmp/hybrid.trace

``tests/vllm_v1/test_hybrid_core_replay.py`` runs both steps in each release's virtualenv; the
layouts below must match the Rust test's.
"""

import ast
import sys
import types

import torch
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus


def full(bs):
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)


def swa(window, bs):
    return SlidingWindowSpec(
        block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=window
    )


def chunked(chunk, bs):
    return ChunkedLocalAttentionSpec(
        block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32, attention_chunk_size=chunk
    )


def key(i):
    """The Rust test's `key(i)`."""
    return i.to_bytes(4, "big") + b"\x05" * 28


def family_keys(f, n):
    """The Rust test's `family_keys(f, n)`."""
    return [key(i) if i < 3 else key(100 * (f + 1) + i) for i in range(n // 4)]


# (groups, scheduler block size, prefix caching, prefix_cache_retention_interval), as in the
# Rust test; hash block 4, 20 blocks.
LAYOUTS = [
    ([full(4), swa(8, 4)], 4, True, None),
    ([swa(8, 4), full(4), chunked(8, 4)], 4, True, None),
    ([full(4), swa(8, 8)], 8, True, None),
    ([full(4), swa(5, 4)], 8, True, None),
    ([full(4), swa(8, 4), swa(16, 4)], 4, True, None),
    ([swa(8, 4), swa(8, 4), full(4)], 4, True, None),
    ([full(4), swa(8, 4), chunked(8, 4)], 4, False, None),
    ([full(4), swa(8, 4)], 4, True, 0),
    ([full(4), swa(8, 4)], 4, True, 16),
    ([swa(8, 4), full(4), chunked(8, 4)], 4, True, 0),
    ([full(4), swa(8, 8)], 8, True, 0),
    ([full(4), swa(5, 4)], 8, True, 0),
    ([full(4), swa(5, 4)], 8, True, 16),
    ([full(4), swa(8, 4), swa(16, 4)], 4, True, 0),
    ([swa(5, 4), swa(5, 4), full(4)], 4, True, 12),
    ([full(4), swa(8, 4), chunked(8, 4)], 4, False, 0),
]


def manager(layout):
    specs, sbs, caching, retention = LAYOUTS[layout]
    cfg = KVCacheConfig(
        num_blocks=20,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)],
        prefix_cache_retention_interval=retention,
    )
    return KVCacheManager(
        cfg,
        max_model_len=1000,
        scheduler_block_size=sbs,
        hash_block_size=4,
        max_in_flight_tokens=16,
        enable_caching=caching,
    )


def ids(groups):
    return [[b.block_id for b in g] for g in groups]


def free_queue(m):
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def request(rid, f, n):
    return types.SimpleNamespace(
        request_id=rid,
        num_tokens=n,
        num_prompt_tokens=n,
        num_computed_tokens=0,
        status=RequestStatus.WAITING,
        block_hashes=family_keys(f, n),
        num_in_flight_tokens=0,
        shared_prefix_boundary=0,
    )


def new_ids(out):
    return None if out is None else [list(g) for g in out.get_block_ids()]


def main(path):
    calls, bad = replay(path)
    for line, what, vllm, core in bad:
        print(f"line {line}: {what}: vLLM {vllm}, pagedkv core {core}")
    print(f"{calls} calls replayed, {len(bad)} differences")
    return 1 if bad else 0


def replay(path):
    """``(calls replayed, differences)``: each difference ``(line, what, vLLM's, the core's)``;
    the replay stops after the sixth."""
    register_all_kvcache_specs(None)
    managers, reqs, bad, n = {}, {}, [], 0
    for n, line in enumerate(open(path), 1):
        t = ast.literal_eval(line)
        op, layout = t[0], t[1]
        if layout not in managers:
            managers[layout], reqs = manager(layout), {}
        m = managers[layout]
        if op == "new":
            _, _, rid, f, tokens, chunk, hit_len, hit_blocks, gate, new, junction, queue, tables = t
            r = request(rid, f, tokens)
            blocks, length, uncached = m.coordinator.find_longest_cache_hit(
                r.block_hashes, tokens - 1
            )
            # The scheduler's request.shared_prefix_boundary, as get_computed_blocks makes it.
            r.shared_prefix_boundary = length + uncached if uncached else 0
            got = (length, ids(blocks), r.shared_prefix_boundary)
            if got != (hit_len, hit_blocks, junction):
                bad.append((n, "hit", got, (hit_len, hit_blocks, junction)))
            got = new_ids(
                m.allocate_slots(
                    r,
                    chunk,
                    length,
                    KVCacheBlocks(tuple(blocks)),
                    full_sequence_must_fit=gate,
                )
            )
            if got != new:
                bad.append((n, "new blocks", got, new))
            if got is not None:
                r.status = RequestStatus.RUNNING
                reqs[rid] = r
        elif op == "step":
            _, _, rid, f, tokens, computed, in_flight, num_new, new, queue, tables = t
            r = reqs[rid]
            r.num_computed_tokens, r.num_tokens = computed, tokens
            r.num_in_flight_tokens = in_flight
            r.block_hashes = family_keys(f, tokens)
            got = new_ids(m.allocate_slots(r, num_new))
            if got != new:
                bad.append((n, "step blocks", got, new))
            if got is None:
                m.free(r)
                del reqs[rid]
        elif op == "free":
            _, _, rid, queue, tables = t
            m.free(reqs.pop(rid))
        elif op == "evict":
            _, _, block, queue, tables = t
            m.block_pool.evict_blocks({block})
        if free_queue(m) != queue:
            bad.append((n, "free queue", free_queue(m), queue))
        for rid, table in tables:
            got = ids(m.coordinator.get_blocks(rid))
            if got != table:
                bad.append((n, f"table of {rid}", got, table))
        if len(bad) > 5:
            break
    return n, bad


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
