"""The bench workloads: deterministic, simulated vLLM-style serving runs.

A workload is described by a :class:`WorkloadConfig` (request mix and engine limits) and expanded
by :func:`generate` into a :class:`Workload`: every prompt token, every output token and every
request's output length is fixed by the seed, so every backend replays exactly the same run.

* **W2** (:data:`W2_FULL`, the one to judge a drop-in by): memory pressure. The GPU pool holds
  about a quarter of what the running batch would need, a quarter of the requests fork (n=2) and
  outputs are long, so running groups are preempted by recompute (single-sequence groups) and by
  swap (forked groups) all through the run, and prompts are prefilled in chunks that share a
  2,048-token step budget with the decodes (vLLM's chunked-prefill scheduling).
* **W1** (:data:`W1_FULL`, kept for continuity with earlier results): a roomy pool. Its watermark
  keeps a few hundred blocks free and the pool outgrows the batch, so W1 never preempts; it
  measures allocation, prefix caching and the steady decode step.

Request mix (full size):

* ``num_requests`` requests, all arriving at t=0 in request order.
* Prompt length uniform in ``[prompt_len_min, prompt_len_max]``.
* ``num_prefixes`` shared prefixes; prefix ``k`` has ``prefix_len_min + k * step`` tokens (evenly
  spaced over ``[prefix_len_min, prefix_len_max]``, so short and long system prompts both exist)
  and fixed random tokens.
* Exactly ``round(prefix_share * num_requests)`` requests (chosen at random) start with a shared
  prefix. A request picks its prefix uniformly among the prefixes that leave at least
  ``min_own_tokens`` of its own tokens in the prompt, so the prompt-length distribution stays
  exactly uniform. The rest of every prompt is random tokens.
* Output length uniform in ``[output_len_min, output_len_max]``, predetermined per request.
* Exactly ``round(n2_share * num_requests)`` requests (chosen at random) use
  ``SamplingParams(n=2, best_of=2)``: they fork after prefill.
* Output tokens are predetermined per request and per sequence of the request (row 0 for the
  first sequence, row 1 for the forked child), indexed by output position, so a sequence's
  tokens do not depend on when it is scheduled or how often it is preempted.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

__all__ = [
    "WorkloadConfig",
    "W1Config",
    "W1_FULL",
    "W1_QUICK",
    "W2_FULL",
    "W2_QUICK",
    "WORKLOADS",
    "Request",
    "Workload",
    "generate",
    "generate_w1",
]


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of a run: the request mix and the simulated engine's limits.

    ``prefill_token_budget`` is the per-step token budget: without ``chunked_prefill`` it bounds
    the whole prompts admitted in one step; with it, it is vLLM's ``max_num_batched_tokens``
    (decodes take one token per sequence, prompts are cut into chunks to fill the rest).
    """

    name: str = "W1"
    num_requests: int = 1024
    prompt_len_min: int = 512
    prompt_len_max: int = 4096
    num_prefixes: int = 16
    prefix_len_min: int = 256
    prefix_len_max: int = 1536
    prefix_share: float = 0.80
    min_own_tokens: int = 64
    output_len_min: int = 32
    output_len_max: int = 256
    n2_share: float = 0.05
    vocab_size: int = 32000
    # engine
    block_size: int = 16
    num_gpu_blocks: int = 24576
    num_cpu_blocks: int = 4096
    watermark: float = 0.01
    max_num_seqs: int = 256
    prefill_token_budget: int = 32768
    chunked_prefill: bool = False

    def __post_init__(self) -> None:
        self._check_engine()
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if not 0 < self.prompt_len_min <= self.prompt_len_max:
            raise ValueError("need 0 < prompt_len_min <= prompt_len_max")
        if not 0 < self.prefix_len_min <= self.prefix_len_max:
            raise ValueError("need 0 < prefix_len_min <= prefix_len_max")
        if (
            self.prefix_share > 0
            and self.prefix_len_min + self.min_own_tokens > self.prompt_len_min
        ):
            raise ValueError("the shortest prefix must fit in the shortest prompt")
        if not 0 < self.output_len_min <= self.output_len_max:
            raise ValueError("need 0 < output_len_min <= output_len_max")
        if not (0.0 <= self.prefix_share <= 1.0 and 0.0 <= self.n2_share <= 1.0):
            raise ValueError("shares must be in [0, 1]")
        if self.chunked_prefill:
            if self.prefill_token_budget < self.max_num_seqs:
                # as vLLM: every running sequence's decode token must fit in one step
                raise ValueError(
                    "with chunked_prefill, prefill_token_budget must be >= max_num_seqs"
                )
        elif self.prefill_token_budget < self.prompt_len_max + self.output_len_max:
            # a recomputed sequence is prompt + outputs long and must still fit in one step
            raise ValueError("prefill_token_budget must hold the longest prompt + outputs")
        if self.max_num_seqs < 2:
            raise ValueError("max_num_seqs must be >= 2 (n=2 requests)")

    def _check_engine(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.vocab_size < 1 or self.num_prefixes < 0:
            raise ValueError("vocab_size must be >= 1 and num_prefixes >= 0")

    @property
    def max_blocks_per_seq(self) -> int:
        """Blocks in the longest possible sequence (prompt + every output token)."""
        return -(-(self.prompt_len_max + self.output_len_max) // self.block_size)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


#: The name the first workload was introduced under (kept: tests and users import it).
W1Config = WorkloadConfig

#: W1, the embedded default workload of issue 4: a roomy pool (never preempts).
W1_FULL = WorkloadConfig()

#: ``--quick`` W1: 96 requests and a pool and batch scaled down with them (3/32 of W1); shares
#: prefixes in seconds, and like W1 never preempts.
W1_QUICK = WorkloadConfig(
    num_requests=96,
    num_gpu_blocks=2304,
    num_cpu_blocks=1024,
    max_num_seqs=24,
    prefill_token_budget=8192,
)

#: W2, the pressure workload: a pool of about a quarter of the running batch's demand, a quarter
#: of the requests with n=2, long outputs and chunked prefill with a 2,048-token step budget.
W2_FULL = WorkloadConfig(
    name="W2",
    num_requests=512,
    prompt_len_min=256,
    prompt_len_max=2048,
    num_prefixes=8,
    prefix_len_min=128,
    prefix_len_max=768,
    prefix_share=0.5,
    output_len_min=128,
    output_len_max=1024,
    n2_share=0.25,
    num_gpu_blocks=4096,
    num_cpu_blocks=4096,
    watermark=0.01,
    max_num_seqs=128,
    prefill_token_budget=2048,
    chunked_prefill=True,
)

#: ``--quick`` W2: 64 requests, pool and batch scaled down by 1/8; still preempts both ways.
W2_QUICK = dataclasses.replace(
    W2_FULL,
    num_requests=64,
    num_gpu_blocks=512,
    num_cpu_blocks=512,
    max_num_seqs=16,
    prefill_token_budget=512,
)

#: name -> (full, quick) config, in the order ``pagedkv bench`` runs them.
WORKLOADS: Dict[str, Tuple[WorkloadConfig, WorkloadConfig]] = {
    "w2": (W2_FULL, W2_QUICK),
    "w1": (W1_FULL, W1_QUICK),
}


@dataclass
class Request:
    """One request of the workload (plain data, shared by every backend)."""

    index: int
    request_id: str
    prompt_token_ids: List[int]
    output_len: int
    n: int
    prefix_id: Optional[int]
    arrival_time: float
    # output_token_ids[j][p]: token generated by sequence j of the request at output position p
    output_token_ids: List[List[int]]


@dataclass
class Workload:
    config: WorkloadConfig
    seed: int
    prefixes: List[List[int]]
    requests: List[Request]

    def digest(self) -> str:
        """A short fingerprint of every token and parameter (to compare two generations)."""
        h = hashlib.sha256(repr((self.config.to_dict(), self.seed)).encode())
        for p in self.prefixes:
            h.update(np.asarray(p, dtype=np.int64).tobytes())
        for r in self.requests:
            h.update(repr((r.request_id, r.output_len, r.n, r.prefix_id, r.arrival_time)).encode())
            h.update(np.asarray(r.prompt_token_ids, dtype=np.int64).tobytes())
            for row in r.output_token_ids:
                h.update(np.asarray(row, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]

    def summary(self) -> Dict[str, Any]:
        reqs = self.requests
        prompt_lens = np.array([len(r.prompt_token_ids) for r in reqs])
        out_lens = np.array([r.output_len for r in reqs])
        return {
            "num_requests": len(reqs),
            "prefixed_requests": sum(r.prefix_id is not None for r in reqs),
            "n2_requests": sum(r.n == 2 for r in reqs),
            "prompt_tokens": int(prompt_lens.sum()),
            "prompt_len_mean": float(prompt_lens.mean()),
            "output_len_mean": float(out_lens.mean()),
            "prefix_lens": [len(p) for p in self.prefixes],
            "digest": self.digest(),
        }


def _prefix_lengths(cfg: WorkloadConfig) -> List[int]:
    k = cfg.num_prefixes
    if k == 1:
        return [cfg.prefix_len_min]
    return [int(round(x)) for x in np.linspace(cfg.prefix_len_min, cfg.prefix_len_max, k)]


def generate(config: WorkloadConfig = W1_FULL, seed: int = 0) -> Workload:
    """Expand ``config`` into the full request list; same ``(config, seed)`` -> same workload."""
    cfg = config
    rng = np.random.default_rng(np.random.SeedSequence([0x5731, seed]))
    n = cfg.num_requests
    v = cfg.vocab_size

    prefix_lens = _prefix_lengths(cfg) if cfg.num_prefixes > 0 else []
    prefixes = [rng.integers(0, v, size=length).tolist() for length in prefix_lens]

    prompt_lens = rng.integers(cfg.prompt_len_min, cfg.prompt_len_max + 1, size=n)
    output_lens = rng.integers(cfg.output_len_min, cfg.output_len_max + 1, size=n)
    num_prefixed = int(round(cfg.prefix_share * n)) if prefixes else 0
    prefixed = np.zeros(n, dtype=bool)
    prefixed[rng.permutation(n)[:num_prefixed]] = True
    num_n2 = int(round(cfg.n2_share * n))
    is_n2 = np.zeros(n, dtype=bool)
    is_n2[rng.permutation(n)[:num_n2]] = True
    prefix_choice = rng.random(n)  # uniform pick among the prefixes that fit

    requests: List[Request] = []
    for i in range(n):
        plen = int(prompt_lens[i])
        prefix_id: Optional[int] = None
        if prefixed[i]:
            fitting = [k for k, ln in enumerate(prefix_lens) if ln + cfg.min_own_tokens <= plen]
            prefix_id = fitting[int(prefix_choice[i] * len(fitting))]
            head = prefixes[prefix_id]
        else:
            head = []
        own = rng.integers(0, v, size=plen - len(head)).tolist()
        num_seqs = 2 if is_n2[i] else 1
        outputs = rng.integers(0, v, size=(num_seqs, int(output_lens[i]))).tolist()
        requests.append(
            Request(
                index=i,
                request_id=f"{cfg.name.lower()}-{i}",
                prompt_token_ids=head + own,
                output_len=int(output_lens[i]),
                n=num_seqs,
                prefix_id=prefix_id,
                arrival_time=0.0,
                output_token_ids=outputs,
            )
        )
    return Workload(config=cfg, seed=seed, prefixes=prefixes, requests=requests)


#: The name the generator was introduced under.
generate_w1 = generate
