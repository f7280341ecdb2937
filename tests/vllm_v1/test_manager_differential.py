"""pagedkv's v1 KV cache manager against vLLM's own, call by call (see ``manager_driver``)."""

from __future__ import annotations

import pytest
from manager_driver import HASH_ALGOS, HYBRID_LAYOUTS, MIXED_LAYOUTS, Driver


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


@pytest.mark.parametrize("seed", range(30))
def test_hybrid_random_calls_match_vllm(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-OSS-, Gemma-3- and Llama-4-like layouts (vLLM's own grouping of the layers), with
    prefix caching, chunked prefill, preemption, deferred frees, evictions and KV events."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0" if seed % 5 == 1 else "1")
    layouts = sorted(HYBRID_LAYOUTS) + sorted(MIXED_LAYOUTS)
    Driver(
        seed=seed,
        num_blocks=12 + seed % 50,
        block_size=(4, 8, 16)[seed % 3],
        caching=seed % 6 != 5,
        events=seed % 2 == 0,
        hash_algo=HASH_ALGOS[seed % len(HASH_ALGOS)],
        watermark=(0.0, 0.0, 0.1)[seed % 3],
        max_model_len=(4096, 64)[seed % 7 == 0],
        layout=layouts[seed % len(layouts)],
    ).run(300)
