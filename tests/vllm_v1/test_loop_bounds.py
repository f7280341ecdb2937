"""The native loop's public surface driven with out-of-range values, in lockstep with vLLM's own
scheduler (tests/vllm_v1/v1_harness.py compares everything both engines would see, every
step): sampled and prompt token ids past every integer width and negative, lengths and limits
at Python's largest ints, priorities at i64's edges, stop ids beyond i64 (those requests
run on vLLM's loop), unknown and repeated request ids. Each
step must match vLLM's; never a Rust panic (``pyo3_runtime.PanicException``, a
``BaseException``) and never a crash."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import v1_harness as h

#: Token ids no vocabulary has: negative, at and past the 32/63/64-bit edges, and beyond.
EXTREME_TOKENS = (-1, -(2**63), 2**31, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 2**100)


class ExtremeSampling(h.Lockstep):
    """The harness, sampling an extreme token id one step in three (both engines alike)."""

    def _sample(self, masked: bool = False) -> int:
        if not masked and self.rng.random() < 1 / 3:
            return self.rng.choice(EXTREME_TOKENS)
        return super()._sample(masked)


def _config(caching: bool, async_scheduling: bool) -> h.SchedConfig:
    return h.SchedConfig(
        block_size=16,
        num_blocks=40,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enable_caching=caching,
        async_scheduling=async_scheduling,
        kv_events=True,
    )


def _specs(rng: random.Random) -> list[h.RequestSpec]:
    wide = tuple(rng.choice(EXTREME_TOKENS) for _ in range(20))
    plain = tuple(h._tokens(rng, 40))
    return [
        h.RequestSpec("wide-prompt", wide + plain, 8, True, 0),
        h.RequestSpec("huge-max-tokens", plain, 2**62, True, 0),  # capped by max_model_len
        h.RequestSpec("huge-stop-ids", plain[:20], 6, False, 1, stop_token_ids=(2**63, -1)),
        h.RequestSpec("min-tokens", plain[:10], 12, False, 1, min_tokens=12),
        h.RequestSpec("top-priority", plain[:30], 5, True, 2, priority=-(2**63) + 1),
        h.RequestSpec("last-priority", plain[:30], 5, True, 2, priority=2**63 - 1),
    ]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
def test_out_of_range_requests_and_tokens_match_vllm(
    caching: bool, async_scheduling: bool, policy: str, tiny_model_dir: Path, manager_cls: type
) -> None:
    cfg = dataclasses.replace(_config(caching, async_scheduling), policy=policy)
    run = ExtremeSampling(cfg, _specs(random.Random(11)), 11, tiny_model_dir, manager_cls)
    run.run()  # raises Divergence at the first difference; a panic is not an Exception
    assert run.step > 0 and "wide-prompt" in run.finished and "huge-max-tokens" in run.finished


def test_finishing_unknown_and_repeated_ids_matches_vllm(
    tiny_model_dir: Path, manager_cls: type
) -> None:
    """vLLM's ``finish_requests`` with ids it does not hold (never added, already finished,
    given twice) changes nothing on either engine, and the next steps still match."""
    from vllm.v1.request import RequestStatus

    cfg = _config(True, False)
    rng = random.Random(3)
    specs = [h.RequestSpec(f"r{i}", tuple(h._tokens(rng, 30)), 6, True, 0) for i in range(3)]
    run = h.Lockstep(cfg, specs, 3, tiny_model_dir, manager_cls)
    for sched in (run.ref, run.test):
        sched.finish_requests(["never-added", "never-added"], RequestStatus.FINISHED_ABORTED)
    run.run()
    for sched in (run.ref, run.test):
        sched.finish_requests(["r0", "r0", "nope"], RequestStatus.FINISHED_ABORTED)
        assert not sched.has_unfinished_requests()
    assert run.finished == {"r0", "r1", "r2"}
