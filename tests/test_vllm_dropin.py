"""The independent oracle: vLLM's own code (0.4.2 and 0.5.0), fetched and loaded by
``pagedkv.vllm_release`` (a failed fetch fails these tests; nothing here skips).

* vLLM's BlockSpaceManagerV1 and pagedkv's manager, driven through the same random operations
  (benches/vllm_compare.py), with vLLM's and with pagedkv's Sequence family;
* vLLM's real Scheduler driving vLLM's classes and pagedkv's (dropped in, or only the manager)
  makes the same decisions at every step, with prefix caching on and off, and with chunked
  prefill where vLLM 0.4.2 hands out negative chunks;
* vLLM 0.4.2's own unit tests (tests/core) pass with pagedkv swapped in, unmodified;
* every Sequence/SequenceGroup method that vLLM's scheduler calls answers as vLLM's own (their
  speed is compared by benches/bench_vllm_sequence.py, not here: no verdict depends on a timing).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

import pagedkv.sequence
from pagedkv import vllm_release
from pagedkv.bench.harness import EngineConfig
from pagedkv.bench.vllm_042 import vllm_scheduler
from pagedkv.bench.vllm_042.vllm_sequence_cases import CASES, build_pair, interleaved_ratio

VERSIONS = vllm_release.SUPPORTED


@pytest.fixture(autouse=True)
def _quiet_vllm_logger():
    logging.disable(logging.WARNING)  # vLLM's preemption warnings
    yield
    logging.disable(logging.NOTSET)


def _benches():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))
    try:
        import vllm_compare
    finally:
        sys.path.pop(0)
    return vllm_compare


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "caching"])
@pytest.mark.parametrize("sequences", ["vllm-seqs", "pagedkv-seqs"])
def test_manager_agrees_with_vllms_block_manager_v1(version, caching, sequences):
    run = _benches().run
    assert run(1500, 7, caching, version, pagedkv_sequences=sequences == "pagedkv-seqs") == 0


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "caching"])
@pytest.mark.parametrize("backend", ["pagedkv-dropin", "pagedkv-manager"])
def test_vllm_scheduler_makes_the_same_decisions(version, caching, backend):
    steps, problem = vllm_scheduler.compare_decisions(
        version, ("vllm", backend), requests=60, seed=3, caching=caching
    )
    assert problem is None, problem
    assert steps > 50


@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "caching"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_native_scheduler_backend_decides_as_vllm(caching, chunked):
    """The bench's ``pagedkv-scheduler`` backend (pagedkv.Scheduler on vLLM's config objects, the
    same engine loop) makes vLLM 0.4.2's decisions at every step (the policy's own randomized
    differential: tests/test_scheduler_differential.py)."""
    steps, problem = vllm_scheduler.compare_decisions(
        "0.4.2",
        ("vllm", "pagedkv-scheduler"),
        requests=60,
        seed=5,
        caching=caching,
        chunked_prefill=chunked,
    )
    assert problem is None, problem
    assert steps > 50


def test_native_scheduler_backend_is_only_for_0_4_2():
    with pytest.raises(ValueError, match="0.4.2"):
        vllm_scheduler.make_backend("0.5.0", "pagedkv-scheduler")


# Seeds whose run hands out a negative chunk under vLLM 0.4.2's chunked-prefill scheduler (a
# decoding n>1 group overran the token budget; the next prompt got min(len, remaining) < 0).
NEGATIVE_CHUNK_SEEDS = (12, 28)


@pytest.mark.parametrize("seed", NEGATIVE_CHUNK_SEEDS)
def test_negative_chunks_under_chunked_prefill_behave_as_vllm(seed, monkeypatch):
    negative = []
    original = pagedkv.sequence.SequenceData.update_num_computed_tokens

    def spy(self, n):
        negative.extend([n] if n < 0 else [])
        return original(self, n)

    monkeypatch.setattr(pagedkv.sequence.SequenceData, "update_num_computed_tokens", spy)
    config = EngineConfig(
        block_size=4,
        num_gpu_blocks=24,
        num_cpu_blocks=512,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        max_model_len=24,
        chunked_prefill=True,
    )
    steps, problem = vllm_scheduler.compare_decisions(
        "0.4.2", requests=30, seed=seed, config=config, max_n=3, prompt_blocks=(1, 4)
    )
    assert problem is None, problem
    assert negative, "the run no longer produces a negative chunk: pick another seed"


def test_vllms_own_core_tests_pass_with_pagedkv_swapped_in():
    """vLLM 0.4.2's tests/core/test_scheduler.py, test_chunked_prefill_scheduler.py and
    test_block_manager.py, unmodified, against vLLM's scheduler with pagedkv's Sequence family
    and BlockSpaceManager (only vLLM's two tests of its own allocator classes are left out).
    The same tests on vLLM's own classes: tests/test_vllm_release.py."""
    rc, out = vllm_release.run_own_tests(
        "0.4.2", "pagedkv", deselect=vllm_release.OWN_ALLOCATOR_TESTS
    )
    assert rc == 0, out[-4000:]
    assert "failed" not in out and "error" not in out.lower().split("passed")[-1]
    assert "42 passed, 2 deselected" in out, out[-500:]


@pytest.fixture(scope="module")
def sequence_pair():
    return build_pair("0.4.2")


def _comparable(value):
    """A call's answer in terms both sides share: sequences by id, enums by name."""
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    if hasattr(value, "seq_id"):
        return ("seq", value.seq_id)
    if hasattr(value, "name") and hasattr(value, "value"):
        return ("enum", value.name)
    return value


@pytest.mark.parametrize("case", list(CASES))
def test_timed_scheduler_calls_answer_as_vllms(sequence_pair, case):
    """The calls benches/bench_vllm_sequence.py times (pagedkv's against vLLM's; speed lives in
    that benchmark, never in a test's verdict) give vLLM's answers, so the timing compares
    like with like. The smallest timing run also returns a usable ratio."""
    answers = {name: _comparable(CASES[case](side)()) for name, side in sequence_pair.items()}
    assert answers["pagedkv"] == answers["vllm"], answers
    ratio = interleaved_ratio(sequence_pair, case, number=3, rounds=1)
    assert ratio == ratio and ratio != float("inf")  # a number, whatever the machine's load


@pytest.mark.slow
def test_scheduler_step_timing_runs_both_backends_to_the_same_end():
    """The function `pagedkv bench` calls: vLLM's real scheduler on W1_QUICK with vLLM's classes
    and with pagedkv's, each engine in its own process, stepping in lockstep."""
    result = vllm_scheduler.compare_scheduler_step("0.4.2", caching=True, quick=True)
    assert "error" not in result, result
    stats = result["backends"]
    assert set(stats) == {"vllm", "pagedkv-dropin"}
    assert stats["vllm"]["steps"] == stats["pagedkv-dropin"]["steps"] > 100
    assert result["speedup"]["vllm"] == 1.0 and result["speedup"]["pagedkv-dropin"] > 0


def test_vllms_own_sequences_count_blocks_in_their_own_block_size():
    """A vLLM Sequence whose block size differs from the manager's, on pagedkv's manager (the
    manager keeps a native token store for it, in the sequence's units)."""
    import pagedkv

    v = vllm_release.load("0.4.2", "vllm")
    seq = v.sequence.Sequence(7, "", list(range(60)), 60)
    group = v.sequence.SequenceGroup("r7", [seq], v.sampling_params.SamplingParams(), 0.0)
    ours = pagedkv.BlockSpaceManager(4, 8, 4, watermark=0.0)
    theirs = v.block_manager_v1.BlockSpaceManagerV1(4, 8, 4, watermark=0.0)
    for mgr in (ours, theirs):
        mgr.allocate(group)
    seq.status = v.sequence.SequenceStatus.RUNNING
    seq.append_token_id(1, {1: v.sequence.Logprob(0.0)})
    for mgr in (ours, theirs):
        assert mgr.append_slots(seq) == {}
        assert len(mgr.get_block_table(seq)) == len(seq.logical_token_blocks) == 2
        assert mgr.get_num_free_gpu_blocks() == 6
