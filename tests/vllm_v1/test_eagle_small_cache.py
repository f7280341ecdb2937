"""EAGLE-style drafters (lookahead slots past the scheduled tokens) over a KV cache smaller
than ``max_model_len``: pagedkv caps every length at the cache's size (``policy::length_cap``),
its manager's lookahead slots included, as vLLM caps them at ``max_model_len``
(``num_tokens_need_slot``). The reference is vLLM at ``max_model_len`` = the cache's size
(``v1_harness.Lockstep``), matched at every step; prompts fill the cache exactly, so a
manager that reserved slots past the cache would never fit them and the runs would part."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import v1_harness as h
from test_differential import assert_native_loop
from test_eagle_loop_differential import eagle  # noqa: F401  (the fixture)


def run_small_cache_eagle_seed(seed: int, model_dir: Path, manager_cls: type) -> dict:
    """``v1_harness.run_seed(small_cache=True)`` with 2 or 4 drafts (EAGLE's lookahead slots)."""
    rng = random.Random(seed)
    cfg = h.random_config(rng, small_cache=True)
    cfg = dataclasses.replace(cfg, num_spec_tokens=(2, 4)[seed % 2])
    capped = dataclasses.replace(cfg, max_model_len=h.length_cap(cfg))
    specs = h.with_cache_filling_prompts(rng, capped, h.random_workload(rng, capped))
    return h.Lockstep(cfg, specs, seed, model_dir, manager_cls).run()


@pytest.mark.parametrize("seed", range(16))
def test_eagle_lookahead_slots_stop_at_the_cache(
    seed: int,
    tiny_model_dir: Path,
    manager_cls: type,
    eagle: None,  # noqa: F811
) -> None:
    if manager_cls.__module__.startswith("vllm."):
        return  # vLLM's own scheduler stalls on a cache smaller than max_model_len
    stats = run_small_cache_eagle_seed(seed, tiny_model_dir, manager_cls)
    assert stats["capped_at_max_model_len"] + stats["refused_at_the_cap"] > 0, stats
    assert_native_loop(stats, manager_cls)
