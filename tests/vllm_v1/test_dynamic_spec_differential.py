"""Dynamic speculative decoding (``num_speculative_tokens_per_batch_size``): vLLM looks the
step's draft count up by its batch size (``dynamic_sd_lookup[len(num_scheduled_tokens)]``,
``SchedulerOutput.num_spec_tokens_to_schedule``, the async placeholders' length) and pads no
resumed decode to a uniform spec decode. pagedkv's native loop against vLLM's scheduler in
lockstep (``v1_harness.Lockstep``), every step compared and native, sync (vLLM's n-gram
drafter: the schedule comes through ``SpeculativeConfig``) and async (the V2 runner's
placeholders; vLLM's config keeps the schedule only on that runner, so the harness sets the
lookup the scheduler would hold), with preemption, aborts, prefix caching and a drafter that
proposes at most the step's count."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import v1_harness as h
from test_differential import assert_native_loop


def dynamic_config(seed: int) -> h.SchedConfig:
    """``v1_harness.random_config`` with drafts and a dynamic schedule; async for odd seeds."""
    rng = random.Random(seed)
    cfg = dataclasses.replace(
        h.random_config(rng), num_spec_tokens=(2, 4)[seed % 4 // 2], async_scheduling=seed % 2 == 1
    )
    return dataclasses.replace(cfg, dynamic_sd=h.dynamic_schedule(rng, cfg))


@pytest.mark.parametrize("seed", range(24))
def test_dynamic_spec_lockstep(seed: int, tiny_model_dir: Path, manager_cls: type) -> None:
    cfg = dynamic_config(seed)
    rng = random.Random(f"dynamic{seed}")
    specs = h.random_workload(rng, cfg)
    lockstep = h.Lockstep(cfg, specs, seed, tiny_model_dir, manager_cls)
    assert lockstep.ref.dynamic_sd_lookup is not None
    stats = lockstep.run()
    assert stats["steps"] > 0
    assert_native_loop(stats, manager_cls)


def test_the_step_count_follows_the_batch_size(tiny_model_dir: Path, manager_cls: type) -> None:
    """One request alone gets the first range's count, four together the second's."""
    cfg = dataclasses.replace(
        h.SchedConfig(), num_spec_tokens=4, max_num_seqs=8, dynamic_sd=((1, 2, 3), (3, 8, 1))
    )
    sched = h.make_scheduler(cfg, tiny_model_dir, manager_cls)
    hasher = h.request_block_hasher(cfg)
    counts = []
    for n in (1, 4):
        for i in range(n):
            spec = h.RequestSpec(f"r{n}-{i}", tuple(range(1, 9)), 4, True, 0)
            sched.add_request(h.build_request(spec, hasher))
        counts.append(sched.schedule().num_spec_tokens_to_schedule)
    assert counts == [3, 1]
