"""Requests that fit ``max_model_len`` but not the KV cache (docs/benchmarks.md, "vLLM v1: the
measurements behind the native loop"): vLLM's own scheduler stalls or livelocks; pagedkv's
native loop finishes every request (a documented difference: docs/vllm_v1.md, "The native
scheduling loop")."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
from vllm.v1.request import RequestStatus

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
    cap = min(r["max_model_len"], r["pool_blocks"] * repro.BLOCK)
    prompt = r["requests"][0]["prompt"]
    if prompt >= cap:
        # Refused at arrival (no room for the prompt and one sampled token, as vLLM's input
        # processor refuses a prompt of max_model_len tokens): no token scheduled for it,
        # reported with reason "error".
        assert r["finish_reasons"]["r0"] == "error"
        assert all("r0" not in t["scheduled"] for t in r["trace"])
    else:
        # Decoded until the request fills the cache, then finished with reason "length".
        assert r["finish_reasons"]["r0"] == "length"
        status, computed, outputs, _ = r["final"]["r0"]
        assert prompt + outputs == cap, r["final"]
    # The small request behind it finishes (all of its max_tokens).
    if len(r["requests"]) > 1:
        assert r["finish_reasons"]["r1"] == "length"
        assert r["final"]["r1"][2] == r["requests"][1]["max_tokens"]


@pytest.mark.parametrize("caching", [True, False])
def test_a_prompt_of_exactly_the_caches_size_is_refused_and_the_queue_moves(
    caching: bool,
) -> None:
    """Issue 23, item 3: block 16, max_model_len 64, 4 GPU blocks (a 48-token cache: vLLM's
    own minimum for max_model_len 64), chunked prefill, a 48-token prompt and a small request
    behind it. The prompt is refused at arrival; the small request runs at once."""
    r = repro.run_case("prompt=pool+small", True, 40, manager=False, caching=caching, loop=True)
    assert (r["max_model_len"], r["pool_blocks"] * repro.BLOCK) == (64, 48)
    assert r["verdict"] == "finished", (r["verdict"], r["final"])
    assert r["finish_reasons"] == {"r0": "error", "r1": "length"}
    assert r["trace"][0]["scheduled"] == {"r1": repro.BLOCK}


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_reaches_the_caches_size_on_vllms_loop_finishes(
    caching: bool, async_scheduling: bool, tiny_model_dir: Path, manager_cls: type
) -> None:
    """The same 48-token cache under max_model_len 64: a 40-token prompt decodes to the
    cache's size while a held request (outside the native loop) waits, so
    those steps are vLLM's own loop; it stops with "length" at 48 tokens there, the held
    request runs, and a small request arriving later runs on the native loop. Lockstep against
    vLLM at max_model_len 48 (the cache's size) at every step."""
    import v1_harness as h

    if manager_cls.__module__.startswith("vllm."):
        return  # vLLM's own scheduler: no length cap at the cache (it stalls)
    cfg = h.SchedConfig(
        block_size=16,
        num_blocks=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        enable_caching=caching,
        async_scheduling=async_scheduling,
    )
    rng = random.Random(5)
    specs = [
        h.RequestSpec("r0", tuple(h._tokens(rng, 40)), 100, True, 0),
        h.RequestSpec("rep", tuple(h._tokens(rng, 8)), 4, True, 1, held=True),
        h.RequestSpec("r1", tuple(h._tokens(rng, 47)), 3, True, 30),
    ]
    run = h.Lockstep(cfg, specs, 5, tiny_model_dir, manager_cls)
    loops: list[str] = []  # per schedule() call: which loop ran it
    r0_live: list[bool] = []  # per schedule() call: r0 still held before it
    seen: dict[str, object] = {}
    schedule = run.test.schedule

    def recording_schedule(*args: object, **kwargs: object) -> object:
        r0_live.append("r0" in run.test.requests)
        if "r0" in run.test.requests:
            seen["r0"] = run.test.requests["r0"]
        before = run.test.pagedkv_native_steps
        out = schedule(*args, **kwargs)
        loops.append("native" if run.test.pagedkv_native_steps > before else "vllm")
        return out

    run.test.schedule = recording_schedule  # type: ignore[method-assign]
    stats = run.run()
    r0 = seen["r0"]
    assert r0.status == RequestStatus.FINISHED_LENGTH_CAPPED  # type: ignore[attr-defined]
    assert r0.num_tokens == 48  # type: ignore[attr-defined]
    # r0's last token was scheduled (and reported) by vLLM's loop: rep was held then.
    gone = r0_live.index(False)
    assert loops[0] == "native" and loops[gone - 1] == "vllm", loops
    # r0 and r1 both end at the cache's size; r1 (after rep left) on the native loop.
    assert stats["capped_at_max_model_len"] == 2, stats
    assert loops[-1] == "native", loops
