"""pagedkv's v1 KV cache manager against vLLM's own, call by call (see ``manager_driver``)."""

from __future__ import annotations

import pytest
from manager_driver import HASH_ALGOS, Driver


@pytest.mark.parametrize("seed", range(40))
def test_random_calls_match_vllm(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # KV events publish hashes as integers by default; every fifth seed as bytes.
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0" if seed % 5 == 1 else "1")
    block_size = (4, 8, 16)[seed % 3]
    Driver(
        seed=seed,
        num_blocks=8 + seed % 40,
        block_size=block_size,
        caching=seed % 4 != 3,
        events=seed % 2 == 0,
        hash_algo=HASH_ALGOS[seed % len(HASH_ALGOS)],
        watermark=(0.0, 0.0, 0.1)[seed % 3],
        max_model_len=(4096, 64)[seed % 5 == 0],
    ).run(300)
