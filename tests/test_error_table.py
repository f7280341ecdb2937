"""The table "Errors, method by method" of docs/vllm_042.md, row by row, in both modes
(``strict=False``, the default, and ``strict=True``). Keep the two in step: each test names
its row."""

from __future__ import annotations

import pytest

from pagedkv import (
    AllocStatus,
    BlockPool,
    BlockSpaceManager,
    SamplingParams,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from pagedkv.errors import (
    ArgumentTypeError,
    DoubleFreeError,
    InvalidArgumentError,
    OutOfBlocksError,
    UnknownSequenceError,
)

BLOCK = 4


@pytest.fixture(params=[False, True], ids=["default", "strict"])
def strict(request):
    return request.param


def _mgr(strict, *, gpu=8, cpu=4, caching=False):
    return BlockSpaceManager(BLOCK, gpu, cpu, watermark=0.0, enable_caching=caching, strict=strict)


def _group(seq_id, num_tokens=6):
    seq = Sequence(seq_id, "p", list(range(num_tokens)), block_size=BLOCK)
    return seq, SequenceGroup(f"r{seq_id}", [seq], SamplingParams(), arrival_time=0.0)


def _running(mgr, seq_id, num_tokens=6):
    seq, group = _group(seq_id, num_tokens)
    mgr.allocate(group)
    seq.status = SequenceStatus.RUNNING
    return seq, group


def _unchanged(mgr):
    """What a failed call must leave as it was."""
    return (mgr.get_num_free_gpu_blocks(), mgr.get_num_free_cpu_blocks())


# ---- free -------------------------------------------------------------------------------------
def test_free_without_a_table(strict):
    mgr = _mgr(strict)
    seq, _ = _group(0)
    if strict:
        with pytest.raises(UnknownSequenceError):
            mgr.free(seq)
    else:
        mgr.free(seq)  # no-op, as vLLM (its scheduler frees aborted sequences)


def test_free_twice(strict):
    mgr = _mgr(strict)
    seq, _ = _running(mgr, 0)
    mgr.free(seq)
    before = _unchanged(mgr)
    if strict:
        with pytest.raises(UnknownSequenceError):
            mgr.free(seq)
    else:
        mgr.free(seq)
    assert _unchanged(mgr) == before == (8, 4)


def test_a_reference_dropped_below_zero_is_double_free_in_both_modes():
    pool = BlockPool(4, BLOCK)
    block = pool.allocate()
    pool.free(block)
    with pytest.raises(DoubleFreeError):
        pool.free(block)
    assert issubclass(DoubleFreeError, ValueError)


# ---- fork -------------------------------------------------------------------------------------
def test_fork_from_a_parent_without_a_table(strict):
    """Raises in both modes, as vLLM (KeyError): the child would get nothing to share."""
    mgr = _mgr(strict)
    parent, _ = _group(0)
    child, _ = _group(1)
    with pytest.raises(UnknownSequenceError):
        mgr.fork(parent, child)


def test_fork_onto_a_child_with_a_table_replaces_it(strict):
    mgr = _mgr(strict)
    parent, _ = _running(mgr, 0)
    child, _ = _running(mgr, 1, num_tokens=5)
    if strict:
        before = (_unchanged(mgr), mgr.get_block_table(child))
        with pytest.raises(InvalidArgumentError, match="already holds a block table"):
            mgr.fork(parent, child)
        assert (_unchanged(mgr), mgr.get_block_table(child)) == before
        return
    mgr.fork(parent, child)
    assert mgr.get_block_table(child) == mgr.get_block_table(parent)
    assert mgr.get_num_free_gpu_blocks() == 8 - 2  # the child's old blocks came back


def test_fork_into_itself(strict):
    mgr = _mgr(strict)
    seq, _ = _running(mgr, 0)
    with pytest.raises(InvalidArgumentError):
        mgr.fork(seq, seq)


# ---- allocate ---------------------------------------------------------------------------------
def test_allocate_without_a_waiting_sequence(strict):
    mgr = _mgr(strict)
    _, group = _running(mgr, 0)
    with pytest.raises(InvalidArgumentError):
        mgr.can_allocate(group)
    with pytest.raises(InvalidArgumentError):
        mgr.allocate(group)


def test_allocate_that_does_not_fit(strict):
    mgr = _mgr(strict)
    _running(mgr, 0, num_tokens=24)  # 6 of 8 blocks
    _, later = _group(1, num_tokens=12)
    _, never = _group(2, num_tokens=40)
    assert mgr.can_allocate(later) == AllocStatus.LATER
    assert mgr.can_allocate(never) == AllocStatus.NEVER
    for group in (later, never):
        with pytest.raises(OutOfBlocksError):
            mgr.allocate(group)
        assert _unchanged(mgr) == (2, 4)


def test_allocate_onto_a_sequence_with_a_table_replaces_it(strict):
    mgr = _mgr(strict)
    seq, group = _running(mgr, 0)
    seq.status = SequenceStatus.WAITING
    if strict:
        before = (_unchanged(mgr), mgr.get_block_table(seq))
        with pytest.raises(InvalidArgumentError, match="already holds a block table"):
            mgr.allocate(group)
        assert (_unchanged(mgr), mgr.get_block_table(seq)) == before
        return
    mgr.allocate(group)
    assert mgr.get_num_free_gpu_blocks() == 8 - 2


def test_a_sequence_in_other_block_units(strict):
    """The default mode counts a sequence's blocks in its own block_size, as vLLM does;
    strict mode refuses it in every call that takes its tokens."""
    mgr = _mgr(strict)
    seq = Sequence(0, "p", list(range(6)), block_size=2)
    group = SequenceGroup("r0", [seq], SamplingParams(), arrival_time=0.0)
    if not strict:
        mgr.allocate(group)
        assert len(mgr.get_block_table(seq)) == 3  # 6 tokens in blocks of 2
        return
    for call in (mgr.can_allocate, mgr.allocate):
        with pytest.raises(InvalidArgumentError, match="does not match the manager's 4"):
            call(group)
    assert _unchanged(mgr) == (8, 4) and not mgr.has_table(seq)
    # one allocated by a default-mode manager's rules cannot reach a strict one; a running
    # sequence of the manager's units appends, one in other units is refused
    ok, ok_group = _running(mgr, 1)
    seq.status = SequenceStatus.RUNNING
    with pytest.raises(InvalidArgumentError):
        mgr.can_append_slots(SequenceGroup("r", [ok, seq], SamplingParams(), arrival_time=0.0))
    mgr.can_append_slots(ok_group)


# ---- append -----------------------------------------------------------------------------------
def test_append_without_a_table(strict):
    mgr = _mgr(strict)
    seq, group = _group(0)
    seq.status = SequenceStatus.RUNNING
    with pytest.raises(UnknownSequenceError):
        mgr.append_slots(seq)
    with pytest.raises(UnknownSequenceError):
        mgr.can_append_slots(group)


def test_append_to_a_swapped_out_sequence(strict):
    mgr = _mgr(strict)
    seq, group = _running(mgr, 0)
    mgr.swap_out(group)
    seq.status = SequenceStatus.SWAPPED
    with pytest.raises(InvalidArgumentError, match="swap it in"):
        mgr.append_slots(seq)


def test_append_out_of_blocks(strict):
    mgr = _mgr(strict, gpu=2)
    seq, group = _running(mgr, 0, num_tokens=8)  # both blocks, full
    seq.data._store.append(1)  # one more token needs a third block
    assert not mgr.can_append_slots(group)
    table = mgr.get_block_table(seq)
    with pytest.raises(OutOfBlocksError):
        mgr.append_slots(seq)
    assert mgr.get_block_table(seq) == table and _unchanged(mgr) == (0, 4)


# ---- swap -------------------------------------------------------------------------------------
def test_swap_without_a_table(strict):
    mgr = _mgr(strict)
    seq, group = _group(0)
    seq.status = SequenceStatus.RUNNING
    for call in (mgr.can_swap_out, mgr.swap_out):
        with pytest.raises(UnknownSequenceError):
            call(group)
    seq.status = SequenceStatus.SWAPPED
    for call in (mgr.can_swap_in, mgr.swap_in):
        with pytest.raises(UnknownSequenceError):
            call(group)


def test_swap_out_without_room(strict):
    mgr = _mgr(strict, cpu=1)
    _, group = _running(mgr, 0)  # 2 blocks, 1 free on the CPU
    assert mgr.can_swap_out(group) is False
    with pytest.raises(OutOfBlocksError):
        mgr.swap_out(group)
    assert _unchanged(mgr) == (6, 1)


def test_swap_in_without_room(strict):
    mgr = _mgr(strict, gpu=4)
    seq, group = _running(mgr, 0)
    mgr.swap_out(group)
    seq.status = SequenceStatus.SWAPPED
    _running(mgr, 1, num_tokens=16)  # takes the whole GPU pool
    assert mgr.can_swap_in(group) == AllocStatus.LATER
    with pytest.raises(OutOfBlocksError):
        mgr.swap_in(group)
    assert _unchanged(mgr) == (0, 2)


# ---- queries ----------------------------------------------------------------------------------
def test_queries_without_a_table(strict):
    mgr = _mgr(strict)
    seq, group = _group(0)
    with pytest.raises(UnknownSequenceError):
        mgr.get_block_table(seq)
    assert mgr.get_all_computed_blocks(seq) == []
    mgr.compute_full_blocks_in_seq(seq)  # no-op
    mgr.access_all_blocks_in_seq(seq, 1.0)  # no-op without caching
    with pytest.raises(UnknownSequenceError):
        _mgr(strict, caching=True).access_all_blocks_in_seq(seq, 1.0)


def test_wrong_argument_types(strict):
    mgr = _mgr(strict)
    with pytest.raises(ArgumentTypeError):
        mgr.append_slots(3)
    with pytest.raises(ArgumentTypeError):
        mgr.allocate("group")
    seq, _ = _running(mgr, 0)
    with pytest.raises(ArgumentTypeError):
        mgr.fork(seq, None)
    assert issubclass(ArgumentTypeError, TypeError)
    assert issubclass(UnknownSequenceError, KeyError)
    assert issubclass(OutOfBlocksError, ValueError) and issubclass(OutOfBlocksError, MemoryError)
