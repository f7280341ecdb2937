"""pagedkv's v1 KV cache manager against vLLM's own, call by call (see ``manager_driver``)."""

from __future__ import annotations

from typing import Any, Dict

import pytest
from manager_driver import (
    HASH_ALGOS,
    HYBRID_LAYOUTS,
    LONE_ATTENTION_LAYOUTS,
    MAMBA_ALIGN_LAYOUTS,
    MAMBA_LAYOUTS,
    MIXED_LAYOUTS,
    RETENTIONS,
    Driver,
    manager_pair,
    retention_interval,
)


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
def test_connector_random_calls_match_vllm(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A KV connector's external tokens (vLLM's ``num_external_computed_tokens``) beside
    local prefix-cache hits: synchronous loads, asynchronous ones (``delay_cache_blocks``,
    cached when done, some failing part way or aborted), in starved pools, caching on and
    off, events on and off."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    driver = Driver(
        seed=seed,
        num_blocks=6 + seed % 30,
        block_size=(4, 8, 16)[seed % 3],
        caching=seed % 4 != 3,
        events=seed % 2 == 0,
        watermark=(0.0, 0.1)[seed % 5 == 2],
        max_model_len=(4096, 64)[seed % 5 == 0],
        connector=True,
    )
    driver.run(300)
    assert driver.external_admissions > 0, "no admission took external tokens"


@pytest.mark.parametrize("seed", range(30))
def test_hybrid_random_calls_match_vllm(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-OSS-, Gemma-3- and Llama-4-like layouts (vLLM's own grouping of the layers), with
    prefix caching (resent prompts, shared prefixes: replay boundaries and junctions),
    chunked prefill, preemption, deferred frees, evictions and KV events, under each
    ``prefix_cache_retention_interval``: every layout meets every mode twice."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0" if seed % 5 == 1 else "1")
    hybrid_driver(seed).run(300)


@pytest.mark.parametrize("seed", range(30))
def test_hybrid_connector_random_calls_match_vllm(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KV connector's external tokens on hybrid attention layouts (GPT-OSS-, Gemma-3- and
    Llama-4-like, two windows, groups of different block sizes) and lone window / chunked
    local groups: each group's blocks for the connector's tokens inside its window (none
    where a chunk boundary skips them all), synchronous and asynchronous loads, failures,
    aborts, under every retention."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    lone = sorted(LONE_ATTENTION_LAYOUTS)
    if seed % 5 == 4:
        layout = lone[seed // 5 % len(lone)]
        driver = Driver(
            seed=seed,
            num_blocks=10 + seed % 30,
            block_size=(4, 8)[seed % 2],
            caching=True,
            events=True,
            layout=layout,
            connector=True,
        )
    else:
        driver = hybrid_driver(seed, connector=True, num_blocks=24 + seed % 40)
    driver.run(300)
    assert driver.external_admissions > 0, "no admission took external tokens"


def hybrid_driver(seed: int, **kw: Any) -> Driver:
    layouts = sorted(HYBRID_LAYOUTS) + sorted(MIXED_LAYOUTS)
    layout = layouts[seed % len(layouts)]
    block_size = (4, 8, 16)[seed % 3]
    mode = RETENTIONS[seed // len(layouts) % len(RETENTIONS)]
    args: Dict[str, Any] = dict(
        seed=seed,
        num_blocks=12 + seed % 50,
        block_size=block_size,
        caching=seed % 6 != 5,
        events=seed % 2 == 0,
        hash_algo=HASH_ALGOS[seed % len(HASH_ALGOS)],
        watermark=(0.0, 0.0, 0.1)[seed % 3],
        max_model_len=(4096, 64)[seed % 7 == 0],
        layout=layout,
        retention=retention_interval(mode, layout, block_size),
    )
    return Driver(**{**args, **kw})


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("layout", sorted(LONE_ATTENTION_LAYOUTS))
def test_lone_attention_group_random_calls_match_vllm(seed: int, layout: str) -> None:
    """A lone sliding-window group (every layer a window) or chunked local group: vLLM's
    unitary coordinator over a ``SlidingWindowManager`` / ``ChunkedLocalAttentionManager``
    (one lookup, every computed token cacheable); pagedkv's hybrid manager over that one
    group against vLLM's, call by call, under dense, sparse (0) and periodic retention,
    caching on and off, with events."""
    mode = RETENTIONS[seed % len(RETENTIONS)]
    retention = retention_interval(mode, layout, (4, 8, 16)[seed % 3])
    hybrid_driver(seed, layout=layout, retention=retention).run(300)


@pytest.mark.parametrize("seed", range(18))
def test_mamba_hybrid_random_calls_match_vllm(seed: int) -> None:
    """Granite-4- / Nemotron-H-like layouts (Mamba layers beside full attention, vLLM's own
    grouping of the layers) in ``mamba_cache_mode`` "none" (prefix caching off, the state
    block spanning max_model_len, with and without speculative state blocks) and with Mamba
    blocks at the attention block size (states freed as the request advances): pagedkv's
    hybrid manager against vLLM's ``MambaManager`` in its no-prefix-cache coordinator, call by
    call (chunked prefill, lookahead slots, preemption, deferred frees, evictions), the
    blocks to zero included."""
    layouts = sorted(MAMBA_LAYOUTS)
    block_size = (4, 8, 16)[seed % 3]
    Driver(
        seed=seed,
        num_blocks=12 + seed % 50,
        block_size=block_size,
        caching=False,
        events=seed % 2 == 0,
        watermark=(0.0, 0.0, 0.1)[seed % 3],
        max_model_len=(4096, 64, 256)[seed // 3 % 3],
        layout=layouts[seed % len(layouts)],
        retention=(None, 0)[seed % 2],
    ).run(300)


@pytest.mark.parametrize("seed", range(24))
def test_mamba_align_random_calls_match_vllm(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Granite-4-, Nemotron-H- and Qwen3-Next-like layouts in ``mamba_cache_mode`` "align"
    (prefix caching on, the Mamba block at the attention block, with and without prefill
    checkpoint blocks and speculative state blocks), prefills split as vLLM's scheduler splits
    them at block boundaries, under dense, sparse (0) and periodic retention: pagedkv's hybrid
    manager against vLLM's ``MambaManager`` call by call (prefix hits on single state blocks
    after null padding, hits deferred on states cached this step, running states retired as
    the request passes them, checkpoints, preemption, deferred frees, evictions, KV events)."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0" if seed % 5 == 1 else "1")
    align_driver(seed).run(300)


def align_driver(seed: int) -> Driver:
    layouts = sorted(MAMBA_ALIGN_LAYOUTS)
    return Driver(
        seed=seed,
        num_blocks=12 + seed % 50,
        block_size=(4, 8, 16)[seed % 3],
        caching=True,
        events=seed % 2 == 0,
        hash_algo=HASH_ALGOS[seed % len(HASH_ALGOS)],
        watermark=(0.0, 0.0, 0.1)[seed % 3],
        max_model_len=(4096, 256)[seed % 4 == 3],
        layout=layouts[seed // 3 % len(layouts)],
        # Dense, vLLM's engine default (0: the replay boundary's and junction's states) and
        # periodic (one state per three blocks).
        retention=(None, 0, 3 * (4, 8, 16)[seed % 3])[seed // 8 % 3],
    )


def test_a_planted_step_deferral_difference_is_caught() -> None:
    """pagedkv's manager never told a new step started (its states cached in earlier steps
    keep deferring hits on them): the call-by-call comparison fails."""
    failures = 0
    for seed in range(12):
        d = align_driver(seed)
        d.ours = _MissesNewSteps(d.ours)
        try:
            d.run(300)
        except AssertionError:
            failures += 1
    assert failures >= 3, failures


class _MissesNewSteps:
    """pagedkv's manager, ``new_step_starts`` a no-op."""

    def __init__(self, manager: Any) -> None:
        self._m = manager

    def __getattr__(self, name: str) -> Any:
        return getattr(self._m, name)

    def new_step_starts(self) -> None:
        pass


def test_hybrid_seeds_run_every_retention_on_every_layout() -> None:
    layouts = sorted(HYBRID_LAYOUTS) + sorted(MIXED_LAYOUTS)
    seen = set()
    for seed in range(30):
        d = hybrid_driver(seed)
        seen.add((d.layout, d.retention is None, d.retention == 0))
    assert len(seen) == 3 * len(layouts) - 1, seen  # llama4 has no window: 0 for periodic


@pytest.mark.parametrize("plant", ["dense", "no junction"])
def test_a_planted_retention_difference_is_caught(plant: str) -> None:
    """pagedkv caching densely where vLLM keeps only the boundary tails (retention 0), or
    ignoring the request's junction: the call-by-call comparison fails."""
    failures = 0
    # gemma3, gpt-oss, two-windows, gemma3: seeds whose runs reach a junction tail vLLM keeps
    # (a run need not: the junction's tail may coincide with a replay tail)
    for seed in (0, 1, 3, 10):
        d = hybrid_driver(seed, retention=0)
        if plant == "dense":
            d.ours = manager_pair(d.num_blocks, d.block_size, d.layout, None, **_same_args(d))[1]
        else:
            d.ours = _ForgetsJunction(d.ours)
        try:
            d.run(300)
        except AssertionError:
            failures += 1
    assert failures == 4


def _same_args(d: Driver) -> Dict[str, Any]:
    return dict(
        enable_caching=d.caching,
        enable_kv_cache_events=d.events,
        log_stats=True,
        watermark=d.watermark,
        max_model_len=d.max_model_len,
    )


class _ForgetsJunction:
    """pagedkv's manager, shown every request with no shared-prefix junction."""

    def __init__(self, manager: Any) -> None:
        self._m = manager

    def __getattr__(self, name: str) -> Any:
        return getattr(self._m, name)

    def allocate_slots(self, request: Any, *args: Any, **kw: Any) -> Any:
        junction, request.shared_prefix_boundary = request.shared_prefix_boundary, 0
        try:
            return self._m.allocate_slots(request, *args, **kw)
        finally:
            request.shared_prefix_boundary = junction
