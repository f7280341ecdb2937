"""Sequence-family micro-benchmarks: pagedkv (native store) vs the plain-Python reference.

Every case runs the same workload on both implementations, in one ``benchmark.group``, so
pytest-benchmark prints them side by side::

    pytest benches/bench_sequence.py --benchmark-only -q

The reference is vLLM's way (Python lists, eager logical blocks, deepcopy fork) with
vLLM-v1-style sha256 block hashes computed when each block fills.
"""

from __future__ import annotations

import random

import pytest

from pagedkv.reference.sequence import Sequence as RefSequence
from pagedkv.sequence import Sequence, SequenceGroup
from pagedkv.types import Logprob, SamplingParams

BLOCK_SIZE = 16
PROMPT_LEN = 4096
NUM_APPENDS = 1000

IMPLS = {"pagedkv": Sequence, "reference": RefSequence}

_rng = random.Random(0)
PROMPT = [_rng.randrange(32_000) for _ in range(PROMPT_LEN)]
APPENDS = [
    (t, {t: Logprob(-_rng.random())}) for t in (_rng.randrange(32_000) for _ in range(NUM_APPENDS))
]
SAMPLING = SamplingParams()


@pytest.mark.parametrize("impl", list(IMPLS))
def test_build_sequence_and_group(benchmark, impl):
    """Sequence + SequenceGroup with a 4,096-token prompt (every prompt block hashed)."""
    benchmark.group = f"build seq+group, {PROMPT_LEN}-token prompt"
    cls = IMPLS[impl]

    def build():
        seq = cls(0, "prompt", PROMPT, BLOCK_SIZE)
        return SequenceGroup("req", [seq], SAMPLING, 0.0)

    group = benchmark(build)
    assert group.find(0).get_len() == PROMPT_LEN


@pytest.mark.parametrize("impl", list(IMPLS))
def test_append_tokens(benchmark, impl):
    """1,000 decode steps on one sequence, each with a one-entry logprobs dict."""
    benchmark.group = f"append {NUM_APPENDS} tokens"
    cls = IMPLS[impl]

    def setup():
        return (cls(0, "prompt", PROMPT[:100], BLOCK_SIZE),), {}

    def append(seq):
        for token_id, logprobs in APPENDS:
            seq.append_token_id(token_id, logprobs)
        return seq

    seq = benchmark.pedantic(append, setup=setup, rounds=50, warmup_rounds=2)
    assert seq.get_len() == 100 + NUM_APPENDS


@pytest.mark.parametrize("impl", list(IMPLS))
def test_fork(benchmark, impl):
    """Fork a sequence with a 4,096-token prompt and 64 generated tokens."""
    benchmark.group = f"fork a {PROMPT_LEN}-token sequence"
    seq = IMPLS[impl](0, "prompt", PROMPT, BLOCK_SIZE)
    for token_id, logprobs in APPENDS[:64]:
        seq.append_token_id(token_id, logprobs)

    child = benchmark(seq.fork, 1)
    assert child.get_token_ids() == seq.get_token_ids() and child.seq_id == 1
