"""Chained hashing of a 4,096-token prompt (block 16): native vs the vLLM-v1-style reference.

Run: ``pytest benches/bench_hashing.py --benchmark-only --benchmark-group-by=group``; compare
rows within a group (same run, same machine)."""

from __future__ import annotations

import random

import numpy as np
import pytest

import pagedkv
from pagedkv.reference import hashing as ref

PROMPT = [random.Random(0).randrange(32000) for _ in range(4096)]
ARRAY = np.array(PROMPT, dtype=np.int32)


@pytest.mark.benchmark(group="hash-4096")
def test_native_from_list(benchmark):
    out = benchmark(pagedkv.hash_blocks, PROMPT, 16)
    assert len(out) == 256


@pytest.mark.benchmark(group="hash-4096")
def test_native_from_int32_array(benchmark):
    out = benchmark(pagedkv.hash_blocks, ARRAY, 16)
    assert len(out) == 256


@pytest.mark.benchmark(group="hash-4096")
def test_native_sha256_from_list(benchmark):
    out = benchmark(pagedkv.hash_blocks, PROMPT, 16, hash_algo="sha256", hash_seed=0)
    assert len(out) == 256


@pytest.mark.benchmark(group="hash-4096")
def test_reference_vllm_v1_style(benchmark):
    out = benchmark(ref.hash_blocks, PROMPT, 16)
    assert len(out) == 256
