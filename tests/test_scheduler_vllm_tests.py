"""vLLM 0.4.2's own scheduler tests, unmodified, against :class:`pagedkv.Scheduler`.

``tests/core/test_scheduler.py`` and ``test_chunked_prefill_scheduler.py`` from the vLLM 0.4.2
release run in the ``"pagedkv_scheduler"`` sandbox of :mod:`pagedkv.vllm_release`: vLLM's
``vllm.core.scheduler.Scheduler`` is ``pagedkv.Scheduler`` there, over pagedkv's Sequence
family and block manager (the other names of vLLM's scheduler module, ``SchedulingBudget``
among them, stay vLLM's). The only tests left out are those that cannot drive a scheduler whose
loop is native; each is listed in :data:`NOT_RUN` with the reason.
"""

from __future__ import annotations

from pagedkv import vllm_release

_PRIVATE = "calls vLLM's private scheduling methods ({}), which a native loop has no equivalent of"
_MOCK = (
    "replaces a block-manager method with a MagicMock ({}); pagedkv.Scheduler's native loop "
    "asks the native block manager directly, so a Python-level override is never consulted"
)

#: vLLM's tests that are not run, with why. Every other test of the two files must pass.
NOT_RUN = {
    # test_scheduler.py
    "test_scheduler.py::test_swapped_out_prioritized": _MOCK.format("can_append_slots"),
    "test_scheduler.py::test_prefill_schedule_max_prompt_len": _PRIVATE.format(
        "_schedule_prefills"
    ),
    "test_scheduler.py::test_prefill_schedule_token_budget": _PRIVATE.format("_schedule_prefills"),
    "test_scheduler.py::test_prefill_schedule_max_seqs": _PRIVATE.format("_schedule_prefills"),
    "test_scheduler.py::test_prefill_schedule_max_lora": _PRIVATE.format("_schedule_prefills"),
    "test_scheduler.py::test_prefill_schedule_no_block_manager_capacity": _PRIVATE.format(
        "_schedule_prefills; also mocks can_allocate"
    ),
    "test_scheduler.py::test_decode_schedule_preempted": _PRIVATE.format(
        "_allocate_and_set_running, _schedule_running; also mocks can_append_slots"
    ),
    "test_scheduler.py::test_decode_swap_beam_search": _PRIVATE.format(
        "_allocate_and_set_running, _schedule_running; also mocks can_append_slots, swap_out"
    ),
    "test_scheduler.py::test_schedule_decode_blocks_to_copy_update": _PRIVATE.format(
        "_allocate_and_set_running, _schedule_running; also mocks append_slots"
    ),
    "test_scheduler.py::test_schedule_swapped_simple": _PRIVATE.format(
        "_allocate_and_set_running, _swap_out, _schedule_swapped"
    ),
    "test_scheduler.py::test_schedule_swapped_max_token_budget": _PRIVATE.format(
        "_allocate_and_set_running, _swap_out, _schedule_swapped"
    ),
    "test_scheduler.py::test_schedule_swapped_max_seqs": _PRIVATE.format(
        "_allocate_and_set_running, _swap_out, _schedule_swapped"
    ),
    "test_scheduler.py::test_schedule_swapped_max_loras": _PRIVATE.format(
        "_allocate_and_set_running, _swap_out, _schedule_swapped"
    ),
    "test_scheduler.py::test_schedule_swapped_cannot_swap_in": _PRIVATE.format(
        "_allocate_and_set_running, _swap_out, _schedule_swapped; also mocks can_swap_in"
    ),
    "test_scheduler.py::test_infeasible_swap": _PRIVATE.format(
        "_allocate_and_set_running, _swap_out, _schedule_swapped; also mocks can_swap_in"
    ),
    "test_scheduler.py::test_schedule_swapped_blocks_to_copy": _PRIVATE.format(
        "_allocate_and_set_running, _swap_out, _schedule_swapped; also mocks append_slots"
    ),
    "test_scheduler.py::test_scheduling_budget": (
        "tests vLLM's own SchedulingBudget class (it stays vLLM's in the sandbox; "
        "pagedkv.Scheduler's budget is native), not the scheduler"
    ),
    # test_chunked_prefill_scheduler.py
    "test_chunked_prefill_scheduler.py::test_swap": _MOCK.format("can_append_slots"),
    "test_chunked_prefill_scheduler.py::test_running_prefill_prioritized_over_swap": _MOCK.format(
        "can_append_slots, can_swap_in"
    ),
    "test_chunked_prefill_scheduler.py::test_chunked_prefill_preempt": _MOCK.format(
        "can_append_slots"
    ),
    "test_chunked_prefill_scheduler.py::test_chunked_prefill_max_seqs": (
        "adds a second request whose sequence id is 1 (create_dummy_prompt('1', ...) twice) "
        "while the first sequence 1 runs; pagedkv.Scheduler refuses a sequence id it already "
        "schedules (InvalidArgumentError, nothing changes): its state, like the block "
        "manager's tables, is keyed by sequence id, and vLLM would overwrite the running "
        "sequence's block table if the duplicate were ever scheduled "
        "(test_duplicate_sequence_id_is_refused)"
    ),
}

FILES = ("test_scheduler.py", "test_chunked_prefill_scheduler.py")


def test_vllms_own_scheduler_tests_pass_against_pagedkv_scheduler():
    """Every test of the two files outside NOT_RUN passes; the count guards against a test
    silently not being collected (or a sandbox that is not the pagedkv_scheduler one)."""
    rc, out = vllm_release.run_own_tests(
        "0.4.2", "pagedkv_scheduler", files=FILES, deselect=NOT_RUN, extra_args=["-rA"]
    )
    assert rc == 0, out[-6000:]
    assert f"13 passed, {len(NOT_RUN)} deselected" in out, out[-1500:]
    assert "failed" not in out.split("short test summary")[-1].lower(), out[-3000:]


def test_the_sandbox_runs_pagedkv_scheduler():
    """The oracle question: in that sandbox, vLLM's tests really get pagedkv.Scheduler."""
    import pagedkv

    ns = vllm_release.load("0.4.2", "pagedkv_scheduler")
    assert ns.scheduler.Scheduler is pagedkv.Scheduler
    assert ns.scheduler.SchedulingBudget.__module__.startswith(ns.package)


def test_duplicate_sequence_id_is_refused():
    """Why test_chunked_prefill_max_seqs is not run: a second live sequence with the id of a
    scheduled one is refused at add_seq_group, and the scheduler is unchanged."""
    import pytest

    from pagedkv import CacheConfig, Scheduler, SchedulerConfig
    from pagedkv.errors import InvalidArgumentError
    from pagedkv.sequence import Sequence, SequenceGroup
    from pagedkv.types import SamplingParams

    def group(rid: str) -> SequenceGroup:
        seq = Sequence(1, "", list(range(8)), 4)
        return SequenceGroup(rid, [seq], SamplingParams(), 0.0)

    sched = Scheduler(
        SchedulerConfig(64, 2, 80, enable_chunked_prefill=True),
        CacheConfig(4, num_gpu_blocks=8, num_cpu_blocks=8),
    )
    sched.add_seq_group(group("a"))
    with pytest.raises(InvalidArgumentError, match="already scheduled"):
        sched.add_seq_group(group("b"))
    assert [g.request_id for g in sched.waiting] == ["a"]
    metas, out = sched.schedule()
    assert [m.request_id for m in metas] == ["a"]


def test_other_block_units_are_scheduled_but_refused_by_the_batch_step():
    """vLLM's tests build sequences whose block size is the prompt length: schedule() takes
    them as vLLM's (and pagedkv's) block manager does, counting blocks in the sequence's own
    units; the batch step, whose slot numbers are in the cache's units, refuses to run."""
    import numpy as np
    import pytest

    from pagedkv import CacheConfig, Scheduler, SchedulerConfig
    from pagedkv.engine_step import BatchEngine
    from pagedkv.errors import InvalidArgumentError
    from pagedkv.sequence import Sequence, SequenceGroup
    from pagedkv.types import SamplingParams

    sched = Scheduler(
        SchedulerConfig(64, 4, 64), CacheConfig(4, num_gpu_blocks=16, num_cpu_blocks=4)
    )
    engine = BatchEngine(sched)
    seq = Sequence(1, "", list(range(10)), 10)  # one block of 10 tokens
    sched.add_seq_group(SequenceGroup("a", [seq], SamplingParams(), 0.0))
    with pytest.raises(InvalidArgumentError, match="block_size"):
        engine.step(np.zeros(0, np.int32))
    assert sched.block_manager.get_num_free_gpu_blocks() == 16
    metas, out = sched.schedule()
    assert [m.request_id for m in metas] == ["a"] and out.num_batched_tokens == 10
    assert len(metas[0].block_tables[1]) == 1  # counted in the sequence's own units
    assert sched.block_manager.get_num_free_gpu_blocks() == 15


def test_the_pagedkv_scheduler_flavour_is_for_vllm_042_only():
    import pytest

    with pytest.raises(ValueError, match="0.4.2"):
        vllm_release.sandbox("0.5.0", "pagedkv_scheduler")
    with pytest.raises(ValueError, match="flavour"):
        vllm_release.sandbox("0.4.2", "no-such-flavour")
