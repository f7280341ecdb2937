"""Multimodal requests on the native loop: a lockstep against vLLM's own scheduler, every step
compared (``SchedulerOutput`` with ``scheduled_encoder_inputs``, ``free_encoder_mm_hashes``
and, on 0.33, ``encoder_input_updates``; ``EngineCoreOutputs``; KV events; the scheduler and
request state; the encoder cache manager's state), with the scheduler under test running
every step natively."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import mm_harness as mm
import pytest
import v1_harness as h
from vllm.v1.core.sched.output import SchedulerOutput

SMALL = h.SchedConfig(
    block_size=4, num_blocks=40, max_num_seqs=6, max_num_batched_tokens=48, max_model_len=96
)


def _run(cfg: h.SchedConfig, encoder: mm.Encoder, seed: int, model_dir: Path, manager_cls: type):
    rng = random.Random(seed)
    specs, images = mm.mm_workload(rng, cfg, encoder)
    lockstep = mm.MmLockstep(cfg, specs, images, encoder, seed, model_dir, manager_cls)
    stats = lockstep.run()
    steps = lockstep.test.pagedkv_steps
    assert set(steps) == {"native"}, steps
    return stats


@pytest.mark.parametrize("seed", range(12))
def test_multimodal_lockstep(seed: int, tiny_model_dir: Path, manager_cls: type) -> None:
    """Both policies, sync and async, a small cache (preemption) or a roomy one, caching on or
    off, a tight or loose encoder budget, chunked or whole images, aborts, either model
    runner."""
    rng = random.Random(seed * 31 + 7)
    cfg = dataclasses.replace(
        SMALL,
        num_blocks=rng.choice((12, 16, 24, 40)),
        max_num_seqs=rng.choice((2, 6)),
        enable_caching=rng.random() < 0.7,
        async_scheduling=seed % 2 == 1,
        policy="priority" if seed % 4 >= 2 else "fcfs",
        long_prefill_token_threshold=rng.choice((0, 0, 12)),
        abort_rate=rng.choice((0.0, 0.05)),
    )
    budget = rng.choice((24, 32, 64))
    encoder = mm.Encoder(
        budget=budget,
        cache_size=budget + rng.choice((0, 16, 64)),
        # Whole images need chunks as long as the longest image: no long-prefill threshold
        # (0.33 would never schedule an image longer than it: its rollback also applies at
        # the image's first token).
        no_chunking=cfg.long_prefill_token_threshold == 0 and rng.random() < 0.3,
        v2_runner=rng.random() < 0.3,
    )
    stats = _run(cfg, encoder, seed, tiny_model_dir, manager_cls)
    assert stats["encoder_inputs"] > 0, stats


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_multimodal_under_pressure_preempts_and_hits(
    async_scheduling: bool, policy: str, tiny_model_dir: Path, manager_cls: type
) -> None:
    """A small cache and a tight encoder budget: preemptions, prefix hits and images capped by
    the encoder budget all happen, and every step matches vLLM's."""
    cfg = dataclasses.replace(
        SMALL, num_blocks=16, async_scheduling=async_scheduling, policy=policy
    )
    encoder = mm.Encoder(budget=24, cache_size=32)
    rng = random.Random(3)
    specs, images = mm.mm_workload(rng, cfg, encoder, n=24)
    lockstep = mm.MmLockstep(cfg, specs, images, encoder, 3, tiny_model_dir, manager_cls)
    stats = lockstep.run()
    assert set(lockstep.test.pagedkv_steps) == {"native"}, lockstep.test.pagedkv_steps
    assert stats["preemptions"] > 0, stats
    assert stats["hits"] > 0, stats
    assert stats["encoder_inputs"] > 0, stats


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_multimodal_with_the_v2_runner(
    async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    """``use_v2_model_runner``: on 0.33 ``encoder_input_updates`` carries the images' data
    while they are being encoded, computed before the rows advance."""
    cfg = dataclasses.replace(SMALL, num_blocks=24, async_scheduling=async_scheduling)
    encoder = mm.Encoder(budget=32, cache_size=48, v2_runner=True)
    stats = _run(cfg, encoder, 5, tiny_model_dir, manager_cls)
    assert stats["encoder_inputs"] > 0, stats
    has_updates = "encoder_input_updates" in SchedulerOutput.__dataclass_fields__
    assert (stats["encoder_updates"] > 0) == has_updates, stats


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_encoder_cache_mismatch_finishes_the_request_with_an_error(
    async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    """vLLM's error case: an identifier reused with another size. The step that finds it
    runs natively (the request gets no tokens); the next ``update_from_output`` (async: of
    the step before) is vLLM's own, which finishes the request with an error; every
    ``schedule()`` is native."""
    specs, images = mm.mismatch_workload()
    encoder = mm.Encoder(budget=32, cache_size=64)
    cfg = dataclasses.replace(SMALL, async_scheduling=async_scheduling)
    lockstep = mm.MmLockstep(cfg, specs, images, encoder, 1, tiny_model_dir, manager_cls)
    lockstep.run()
    assert set(lockstep.test.pagedkv_steps) == {"native"}, lockstep.test.pagedkv_steps
    reasons = lockstep.finish_reasons
    assert reasons["b"] == "error" and reasons["a"] != "error", reasons
