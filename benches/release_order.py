"""Allocate-and-free rounds of cached sequences, with blocks released in access order or out of
it (the eviction order's usual and worst case).

    python benches/release_order.py

Prints the best time of one round (128 sequences of 25 blocks, prefix caching on) for both
orders; compare builds by running it under each.
"""

from __future__ import annotations

import time

from pagedkv import BlockSpaceManager, SamplingParams, Sequence, SequenceGroup


def best_round(access_time) -> float:
    m = BlockSpaceManager(16, 4096, 0, watermark=0.0, enable_caching=True)
    groups = []
    for i in range(128):
        s = Sequence(i, "", [(i * 7919 + j) % 32000 for j in range(400)], 16)
        groups.append((s, SequenceGroup(str(i), [s], SamplingParams(), 0.0)))
    best = float("inf")
    for rep in range(7):
        t0 = time.perf_counter()
        for k in range(20):
            for _, g in groups:
                m.allocate(g)
            for j, (s, _) in enumerate(groups):
                m.access_all_blocks_in_seq(s, access_time(rep, k, j))
            for s, _ in groups:
                m.free(s)
        best = min(best, (time.perf_counter() - t0) / 20)
    return best


def main() -> None:
    in_order = best_round(lambda rep, k, j: float(rep * 100_000 + k * 1000 + j))
    out_of_order = best_round(lambda rep, k, j: float(rep * 100 + k + j % 3))
    print(f"released in access order:     {in_order * 1e3:.2f} ms per round")
    print(f"released out of access order: {out_of_order * 1e3:.2f} ms per round")


if __name__ == "__main__":
    main()
