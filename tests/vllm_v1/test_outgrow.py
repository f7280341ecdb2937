"""Requests that fit ``max_model_len`` but not the KV cache (docs/vllm_v1_scheduler_plan.md,
section 4): vLLM's own scheduler stalls or livelocks; pagedkv's native loop finishes every
request (a documented difference: docs/vllm_v1.md, "The native scheduling loop")."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benches"))
import vllm_v1_outgrow_repro as repro  # noqa: E402

SETTINGS = [(full, caching) for full in (True, False) for caching in (True, False)]


@pytest.mark.parametrize("case", list(repro.CASES))
@pytest.mark.parametrize(("reserve_full_isl", "caching"), SETTINGS)
def test_vllm_never_finishes_the_outgrowing_request(
    case: str, reserve_full_isl: bool, caching: bool
) -> None:
    r = repro.run_case(case, reserve_full_isl, 60, manager=False, caching=caching)
    assert r["verdict"] in ("stalled", "livelock"), r["verdict"]
    assert "r0" not in r["finished_at"]


@pytest.mark.parametrize("case", list(repro.CASES))
@pytest.mark.parametrize(("reserve_full_isl", "caching"), SETTINGS)
def test_native_loop_finishes_every_request(
    case: str, reserve_full_isl: bool, caching: bool
) -> None:
    r = repro.run_case(case, reserve_full_isl, 120, manager=False, caching=caching, loop=True)
    assert r["verdict"] == "finished", (r["verdict"], r["final"])
    pool_tokens = r["pool_blocks"] * repro.BLOCK
    prompt = r["requests"][0]["prompt"]
    if prompt > pool_tokens:
        # Refused at arrival: no token scheduled for it, reported with reason "error".
        assert r["finish_reasons"]["r0"] == "error"
        assert all("r0" not in t["scheduled"] for t in r["trace"])
    else:
        # Decoded until the request fills the cache, then finished with reason "length".
        assert r["finish_reasons"]["r0"] == "length"
        status, computed, outputs, _ = r["final"]["r0"]
        assert prompt + outputs == pool_tokens, r["final"]
    if "r1" in r["finish_reasons"]:
        assert r["finish_reasons"]["r1"] == "length"  # the small request behind it finishes
