"""pagedkv's Sequence family against vLLM 0.4.2's own ``vllm/sequence.py``, method by method:
every method vLLM's scheduler (and its engine's output processing) calls per group or per
sequence each step. vLLM's file is the real one, loaded by ``pagedkv.vllm_release``. Each case
runs the same call on both, in one ``benchmark.group``, so pytest-benchmark prints them side
by side::

    pytest benches/bench_vllm_sequence.py --benchmark-only -q

``tests/test_vllm_dropin.py::test_no_scheduler_method_is_slower_than_vllms`` checks the same
list with interleaved timings.
"""

from __future__ import annotations

import pytest

from pagedkv.bench.vllm_042.vllm_sequence_cases import CASES, build_pair

PAIR = build_pair()


@pytest.mark.parametrize("impl", ["vllm", "pagedkv"])
@pytest.mark.parametrize("case", list(CASES))
def test_method(benchmark, case, impl):
    benchmark.group = case
    call = CASES[case](PAIR[impl])
    benchmark(call)
