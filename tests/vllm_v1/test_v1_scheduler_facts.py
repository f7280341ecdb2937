"""Facts about vLLM's own v1 scheduler that the native loop must reproduce (docs/vllm_v1.md,
"The native scheduling loop"), pinned per release (run inside each release's virtualenv).
With ``native=True`` pagedkv's manager is under vLLM's loop: the facts are the loop's, so they
must hold with either manager."""

from __future__ import annotations

import tempfile
from typing import Any, Dict, List

import pytest
import vllm
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
from vllm.v1.request import Request

from pagedkv.bench.harness import EngineConfig
from pagedkv.bench.vllm_v1 import (
    EngineSpec,
    build_scheduler,
    model_runner_output,
    write_model_dir,
)
from pagedkv.vllm_v1._version import release_of

RELEASE = release_of(vllm.__version__)


def _priority_scheduler(native: bool, usable_blocks: int) -> Any:
    cfg = EngineConfig(
        block_size=16,
        num_gpu_blocks=usable_blocks + 1,
        num_cpu_blocks=0,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=256,
        caching=False,
        chunked_prefill=True,
    )
    with tempfile.TemporaryDirectory() as d:
        sched = build_scheduler(
            EngineSpec(caching=False, watermark=0.0), cfg, write_model_dir(d, 256), native
        )
    # build_scheduler has no policy knob: the policy is read when scheduling.
    sched.policy = SchedulingPolicy.PRIORITY
    sched.waiting = create_request_queue(sched.policy)
    sched.kv_holding_waiting = create_request_queue(sched.policy)
    return sched


def _step(sched: Any, reqs: Dict[str, Request]) -> Any:
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[7] if reqs[i].num_computed_tokens >= reqs[i].num_tokens else [] for i in ids]
    sched.update_from_output(so, model_runner_output(ids, sampled))
    return so


@pytest.mark.parametrize("native", [False, True], ids=["vllm-manager", "native-manager"])
def test_priority_request_that_preempts_itself_ends_or_continues_the_running_loop(
    native: bool,
) -> None:
    """Pool of 6 blocks: A (prio 0) and B (prio 1) admitted at step 0, C (prio 0) at step 1, so
    running is [A, B, C] with the pool full. At step 5 B needs its third block; the victim is
    the running request with the largest (priority, arrival), B itself. 0.32 then ends the
    running loop (C is not scheduled); 0.33 continues with C."""
    sched = _priority_scheduler(native, usable_blocks=6)
    reqs: Dict[str, Request] = {}

    def add(rid: str, plen: int, prio: int, t: float) -> None:
        r = Request(
            request_id=rid,
            prompt_token_ids=list(range(1, plen + 1)),
            sampling_params=SamplingParams(max_tokens=20, ignore_eos=True),
            pooling_params=None,
            arrival_time=t,
            priority=prio,
        )
        reqs[rid] = r
        sched.add_request(r)

    add("A", 20, 0, 0.0)
    add("B", 28, 1, 1.0)
    outs: List[Any] = []
    for step in range(6):
        if step == 1:
            add("C", 20, 0, 2.0)
        outs.append(_step(sched, reqs))
    assert [r.request_id for r in sched.running] == ["A", "C"]
    step5 = outs[5]
    assert sorted(step5.preempted_req_ids) == ["B"]
    expected = {"0.32.0": {"A": 1}, "0.33.0": {"A": 1, "C": 1}}[RELEASE]
    assert dict(step5.num_scheduled_tokens) == expected


def test_check_stop_order_eos_before_min_tokens() -> None:
    """check_stop tests EOS and stop ids before min_tokens (min_tokens only gates repetition
    detection; the sampler masks EOS under min_tokens): a sampled EOS stops the request."""
    from vllm.v1.core.sched.utils import check_stop
    from vllm.v1.request import RequestStatus

    sp = SamplingParams(max_tokens=10, min_tokens=5, stop_token_ids=[9])
    sp.update_from_generation_config({}, eos_token_id=2)
    r = Request(
        request_id="r",
        prompt_token_ids=[1, 1, 1],
        sampling_params=sp,
        pooling_params=None,
        arrival_time=0.0,
    )
    r.append_output_token_ids(2)
    assert check_stop(r, max_model_len=100)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    r2 = Request(
        request_id="r2",
        prompt_token_ids=[1, 1, 1],
        sampling_params=sp,
        pooling_params=None,
        arrival_time=0.0,
    )
    r2.append_output_token_ids(9)
    assert check_stop(r2, max_model_len=100) and r2.stop_reason == 9
    ignoring = SamplingParams(max_tokens=10, ignore_eos=True)
    ignoring.update_from_generation_config({}, eos_token_id=2)
    assert ignoring.eos_token_id is None
