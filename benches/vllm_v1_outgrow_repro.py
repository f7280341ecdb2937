"""What vLLM v1's real scheduler does when a request fits ``max_model_len`` but outgrows the KV
cache (docs/benchmarks.md, "vLLM v1: the measurements behind the native loop"). Nothing here is
pagedkv's policy: the scheduler is vLLM's own ``Scheduler`` (``--manager`` swaps in pagedkv's
manager only, which must behave the same). ``--loop`` runs pagedkv's ``Scheduler`` with its
native loop instead, which does not stall: a prompt of the cache's size or longer is finished
with an error at arrival, and a request that reaches the cache's size finishes with reason
"length" (docs/vllm_v1.md).

Run in a vLLM 0.32/0.33 virtualenv with this checkout's pagedkv on PYTHONPATH::

    PYTHONPATH=$PWD/python VLLM_TARGET_DEVICE=cpu ~/.cache/pagedkv/venvs/vllm-0.33/bin/python \
        benches/vllm_v1_outgrow_repro.py [--steps 60] [--manager | --loop] [--json out.json]

Cases (block size 16; ``pool`` = usable blocks, the null block excluded):

* ``prompt>pool``: one request whose prompt needs more blocks than the pool has.
* ``grow>pool``: a prompt that fits, ``max_tokens`` that make it outgrow the pool while decoding.
* ``grow>pool+small``: the same, with a small request queued behind it (head-of-line blocking).
* ``prompt=pool+small``: ``max_model_len`` 64 over vLLM's smallest cache for it (4 GPU blocks,
  48 tokens), a 48-token prompt prefilled in 32-token chunks and a small request behind it:
  the prompt fills the cache, its sampled token does not fit.

each with prefix caching on and off and ``scheduler_reserve_full_isl`` on (vLLM's default)
and off. Per step it records the
scheduled tokens, preemptions, statuses, computed tokens, output length and free blocks, and
classifies the run: ``finished``, ``stalled`` (nothing scheduled for the last steps, requests
unfinished), or ``livelock`` (work scheduled, preemptions recur, no request finishes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
_CHECKOUT = os.path.join(os.path.dirname(HERE), "python")
# The checkout's pagedkv when it is built in place (`maturin develop`), else the installed one
# (tests/test_vllm_v1.py installs this checkout's wheel into the vLLM virtualenvs).
_BUILT = (".so", ".pyd")
if any(n.endswith(_BUILT) for n in os.listdir(os.path.join(_CHECKOUT, "pagedkv"))):
    sys.path.insert(0, _CHECKOUT)

BLOCK = 16

#: name -> (pool blocks, [(prompt tokens, max_tokens)], max_num_batched_tokens)
CASES = {
    "prompt>pool": (8, [(10 * BLOCK, 4)], 64),
    "grow>pool": (8, [(6 * BLOCK, 4 * BLOCK)], 64),
    "grow>pool+small": (8, [(6 * BLOCK, 4 * BLOCK), (BLOCK, 4)], 64),
    # vLLM's smallest cache for max_model_len 64 (cdiv(64, 16) = 4 GPU blocks, one of them the
    # null block: 48 tokens) and a prompt of exactly the cache's size, prefilled in chunks.
    "prompt=pool+small": (3, [(3 * BLOCK, 4), (BLOCK, 4)], 2 * BLOCK),
}

#: max_model_len where a case sets it (else the longest request plus a block).
MAX_MODEL_LEN = {"prompt=pool+small": 4 * BLOCK}


def run_case(
    name: str,
    reserve_full_isl: bool,
    steps: int,
    manager: bool,
    caching: bool = True,
    loop: bool = False,
) -> Dict[str, Any]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from pagedkv.bench.harness import EngineConfig
    from pagedkv.bench.vllm_v1 import EngineSpec, build_scheduler, driver

    pool, reqs, budget = CASES[name]
    max_len = MAX_MODEL_LEN.get(name, max(p + m for p, m in reqs) + BLOCK)
    cfg = EngineConfig(
        block_size=BLOCK,
        num_gpu_blocks=pool + 1,  # block 0 is vLLM's null block
        num_cpu_blocks=0,
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        caching=caching,
        chunked_prefill=True,
    )
    with tempfile.TemporaryDirectory() as d:
        sched = build_scheduler(
            EngineSpec(caching=caching, watermark=0.0),
            cfg,
            driver.write_model_dir(d, max_len),
            manager or loop,
            loop=loop,
        )
    sched.scheduler_reserve_full_isl = reserve_full_isl
    hasher = driver.request_block_hasher(BLOCK)
    requests = {}
    for i, (plen, max_tokens) in enumerate(reqs):
        r = Request(
            request_id=f"r{i}",
            prompt_token_ids=[1000 + i * 7 + (j % 97) for j in range(plen)],
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            arrival_time=float(i),
            block_hasher=hasher,
        )
        requests[r.request_id] = r
        sched.add_request(r)
    trace: List[Dict[str, Any]] = []
    finished: Dict[str, int] = {}
    reasons: Dict[str, Any] = {}
    for step in range(steps):
        if not sched.has_requests():
            break
        st = driver.step(sched, requests, lambda _request: 5)
        so, outs = st.scheduler_output, st.outputs
        for eco in outs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    reasons[o.request_id] = str(o.finish_reason)
        for rid, req in requests.items():
            if req.is_finished() and rid not in finished:
                finished[rid] = step
        trace.append(
            {
                "step": step,
                "scheduled": dict(so.num_scheduled_tokens),
                "preempted": sorted(so.preempted_req_ids or ()),
                "free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
                "reqs": {
                    rid: (
                        r.status.name,
                        r.num_computed_tokens,
                        r.num_output_tokens,
                        r.num_preemptions,
                    )
                    for rid, r in requests.items()
                },
            }
        )
    tail = trace[-10:]
    unfinished = [rid for rid in requests if rid not in finished]
    if not unfinished:
        verdict = "finished"
    elif all(not t["scheduled"] for t in tail):
        verdict = "stalled"
    elif any(t["preempted"] for t in tail):
        verdict = "livelock"
    else:
        verdict = "running"
    return {
        "case": name,
        "reserve_full_isl": reserve_full_isl,
        "caching": caching,
        "pool_blocks": pool,
        "max_model_len": max_len,
        "requests": [
            {"prompt": p, "max_tokens": m, "blocks_at_end": -(-(p + m) // BLOCK)} for p, m in reqs
        ],
        "steps": len(trace),
        "verdict": verdict,
        "finished_at": finished,
        "finish_reasons": reasons,
        "preemptions": {rid: r.num_preemptions for rid, r in requests.items()},
        "tokens_scheduled": sum(sum(t["scheduled"].values()) for t in trace),
        "final": trace[-1]["reqs"] if trace else {},
        "trace": trace,
    }


def summary_line(r: Dict[str, Any]) -> str:
    return (
        f"{r['case']:16} caching={'on ' if r['caching'] else 'off'} reserve_full_isl="
        f"{str(r['reserve_full_isl']):5}: {r['verdict']:8} after"
        f" {r['steps']} steps; tokens scheduled {r['tokens_scheduled']}; preemptions"
        f" {r['preemptions']}; finished at {r['finished_at']}; final (status, computed, outputs,"
        f" preemptions) {r['final']}"
    )


def main(argv: Any = None) -> int:
    from pagedkv.bench.vllm_v1 import use_cpu_platform_without_gpu

    use_cpu_platform_without_gpu()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--manager", action="store_true", help="pagedkv's manager under vLLM's loop")
    p.add_argument("--loop", action="store_true", help="pagedkv's Scheduler (native loop)")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--trace", action="store_true", help="print every step")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    results = []
    for name in a.cases.split(","):
        for caching, full in ((True, True), (True, False), (False, True), (False, False)):
            r = run_case(name, full, a.steps, a.manager, caching, loop=a.loop)
            results.append(r)
            print(summary_line(r), flush=True)
            if a.trace:
                for t in r["trace"]:
                    print("   ", t)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
