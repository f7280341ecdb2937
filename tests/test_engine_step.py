"""BatchEngine (the batch step): behaviour and bad input. The decisions are checked against
the compat path in tests/test_engine_step_differential.py."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
from pagedkv.engine_step import BatchBuffers, BatchEngine
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError
from pagedkv.scheduler import CacheConfig, SchedulerConfig

BS = 4


def make(num_gpu=64, max_model_len=32, **kw):
    cc = CacheConfig(BS, 0.9, 1, "auto")
    cc.num_gpu_blocks, cc.num_cpu_blocks = num_gpu, 16
    sched = pagedkv.Scheduler(SchedulerConfig(64, 8, max_model_len), cc, None)
    return sched, BatchEngine(sched, **kw)


def add(engine, rid, seq_id, prompt, eos=None, **params):
    seq = pagedkv.Sequence(seq_id, "", prompt, BS, eos)
    sp = pagedkv.SamplingParams(**params)
    group = pagedkv.SequenceGroup(rid, [seq], sp, 0.0)
    engine.add_seq_group(group)
    return group


def test_prefill_then_decode_writes_the_model_inputs():
    _, eng = make()
    g = add(eng, "a", 1, [5, 6, 7, 8, 9], max_tokens=3)
    res = eng.step(now=1.0)
    b = res.buffers
    assert (res.num_rows, res.num_tokens, res.num_prefill_groups) == (1, 5, 1)
    assert b.input_tokens[:5].tolist() == [5, 6, 7, 8, 9]
    assert b.positions[:5].tolist() == [0, 1, 2, 3, 4]
    table = b.block_tables[0, :2].tolist()
    assert b.slot_mapping[:5].tolist() == [table[p // BS] * BS + p % BS for p in range(5)]
    assert b.query_start_loc[:2].tolist() == [0, 5]
    assert (b.context_lens[0], b.num_samples[0], b.seq_ids[0]) == (5, 1, 1)
    assert res.scheduled == [g]
    res = eng.step([11], now=2.0)
    assert (res.num_rows, res.num_tokens, res.num_prefill_groups) == (1, 1, 0)
    assert (b.input_tokens[0], b.positions[0], b.context_lens[0]) == (11, 5, 6)
    seq = g.get_seqs()[0]
    assert seq.get_output_len() == 0  # not written back per step
    eng.sync_views()
    assert list(seq.data.output_token_ids) == [11]
    assert seq.data.get_num_computed_tokens() == 5 and not seq.is_prefill()
    eng.step([12], now=3.0)
    res = eng.step([13], now=4.0)  # the third token reaches max_tokens
    assert res.finished == [g] and res.num_rows == 0
    assert seq.status.name == "FINISHED_LENGTH_CAPPED"
    assert list(seq.data.output_token_ids) == [11, 12, 13]
    assert not eng.has_unfinished_seqs()


def test_prompt_rows_leave_their_cached_prefix_out():
    """vLLM 0.4.2's model runner rule: a prompt starts after its computed blocks (all full
    blocks but the last of a scheduled sequence are marked computed)."""
    cc = CacheConfig(BS, 0.9, 1, "auto", enable_prefix_caching=True)
    cc.num_gpu_blocks, cc.num_cpu_blocks = 64, 16
    sched = pagedkv.Scheduler(SchedulerConfig(64, 8, 32), cc, None)
    eng = BatchEngine(sched)
    prompt = list(range(20, 33))  # 13 tokens: blocks 0-2 full, 0-1 marked computed
    add(eng, "a", 1, prompt, max_tokens=4)
    res = eng.step(now=1.0)
    b = res.buffers
    assert (res.num_tokens, b.cached_tokens[0]) == (13, 0)
    add(eng, "b", 2, prompt[:12] + [99], max_tokens=4)  # same first 3 blocks
    res = eng.step([7], now=2.0)
    assert (res.num_rows, res.num_prefill_groups, res.num_tokens) == (1, 1, 5)
    assert b.cached_tokens[0] == 8 and b.context_lens[0] == 13
    assert b.input_tokens[:5].tolist() == prompt[8:12] + [99]
    assert b.positions[:5].tolist() == list(range(8, 13))
    table = b.block_tables[0, :4].tolist()
    assert table[:2] == sched.block_manager.get_block_table(sched.running[0].get_seqs()[0])[:2]
    assert b.slot_mapping[:5].tolist() == [table[p // BS] * BS + p % BS for p in range(8, 13)]
    assert b.query_start_loc[:2].tolist() == [0, 5]
    res = eng.step([8], now=3.0)  # decodes never skip
    assert res.num_tokens == 2 and not b.cached_tokens[:2].any()
    short = BatchBuffers.for_scheduler(sched)
    short.cached_tokens = short.cached_tokens[:1]
    eng.buffers = short
    with pytest.raises(InvalidArgumentError, match="cached_tokens"):
        eng.step([9, 9], now=4.0)


def test_stop_checks_follow_vllm_order():
    _, eng = make()
    a = add(eng, "eos", 1, [1, 2], eos=7, max_tokens=9)
    b = add(eng, "min", 2, [1, 2], eos=7, max_tokens=9, min_tokens=2)
    c = add(eng, "ign", 3, [1, 2], eos=7, max_tokens=9, ignore_eos=True, stop_token_ids=[8])
    eng.step(now=1.0)
    res = eng.step([7, 7, 7], now=2.0)
    assert res.finished == [a]
    assert a.get_seqs()[0].status.name == "FINISHED_STOPPED"
    res = eng.step([7, 8], now=3.0)  # b: min_tokens reached with EOS; c: stop token
    assert res.finished == [b, c]
    assert [s.status.name for s in (b.get_seqs()[0], c.get_seqs()[0])] == ["FINISHED_STOPPED"] * 2


def test_best_of_forks_share_blocks():
    sched, eng = make(seq_counter=iter(range(100, 200)).__next__)
    g = add(eng, "a", 1, [1, 2, 3, 4, 5, 6], n=2, best_of=2, max_tokens=4, temperature=1.0)
    res = eng.step(now=1.0)
    assert res.buffers.num_samples[0] == 2
    free = sched.block_manager.get_num_free_gpu_blocks()
    res = eng.step([20, 21], now=2.0)  # 20 to the child (id 100), 21 to the parent
    assert res.num_rows == 2 and res.buffers.seq_ids[:2].tolist() == [1, 100]
    assert sorted(s.seq_id for s in g.get_seqs()) == [1, 100]
    assert res.num_copies == 1  # both append into the shared last block: one copy-on-write
    assert sched.block_manager.get_num_free_gpu_blocks() == free - 1
    eng.sync_views()
    by_id = {s.seq_id: list(s.data.output_token_ids) for s in g.get_seqs()}
    assert by_id == {1: [21], 100: [20]}


def test_bad_sampled_input_changes_nothing():
    sched, eng = make()
    g = add(eng, "a", 1, [1, 2, 3], max_tokens=5)
    eng.step(now=1.0)
    assert eng.num_expected_samples == 1
    for bad, err in (
        ([1, 2], InvalidArgumentError),
        (None, InvalidArgumentError),
        ([-1], InvalidArgumentError),
        ([2**40], InvalidArgumentError),
        (["x"], ArgumentTypeError),
        ([[1]], InvalidArgumentError),
    ):
        with pytest.raises(err):
            eng.step(bad, now=2.0)
    assert eng.num_expected_samples == 1
    eng.step(np.array([9], np.int64), now=2.0)
    eng.sync_views()
    assert list(g.get_seqs()[0].data.output_token_ids) == [9]


def test_bad_buffers_are_refused_before_anything_changes():
    sched, eng = make()
    add(eng, "a", 1, [1, 2, 3], max_tokens=5)
    good = eng.buffers
    small = BatchBuffers(8, 2, 8, 64)
    eng.buffers = small
    with pytest.raises(InvalidArgumentError, match="may need"):
        eng.step(now=1.0)
    ro = BatchBuffers.for_scheduler(sched)
    ro.positions.setflags(write=False)
    eng.buffers = ro
    with pytest.raises(InvalidArgumentError, match="read-only"):
        eng.step(now=1.0)
    alias = BatchBuffers.for_scheduler(sched)
    alias.positions = alias.input_tokens
    eng.buffers = alias
    with pytest.raises(InvalidArgumentError, match="overlaps"):
        eng.step(now=1.0)
    wrong = BatchBuffers.for_scheduler(sched)
    wrong.slot_mapping = wrong.slot_mapping.astype(np.int64)
    eng.buffers = wrong
    with pytest.raises(InvalidArgumentError, match="dtype"):
        eng.step(now=1.0)
    eng.buffers = good
    res = eng.step(now=1.0)  # the failed calls scheduled nothing
    assert res.num_rows == 1 and res.num_tokens == 3


def test_block_tables_widen_when_a_sequence_outgrows_max_model_len():
    sched, eng = make(max_model_len=8)
    g = add(eng, "a", 1, [1] * 8, max_tokens=20, min_tokens=6)
    narrow = eng.buffers.block_tables.shape[1]
    assert narrow == 2
    eng.step(now=1.0)
    for t in range(5):  # min_tokens holds the stop checks back: 13 tokens, 4 blocks
        res = eng.step([3], now=2.0 + t)
    assert res.num_rows == 1 and eng.buffers.block_tables.shape[1] >= 4
    table = sched.block_manager.get_block_table(g.get_seqs()[0])
    assert len(table) == 4 and res.block_tables[0, :4].tolist() == list(table)
    res = eng.step([3], now=10.0)  # min_tokens reached: len > max_model_len caps it
    assert res.finished == [g]
    assert g.get_seqs()[0].status.name == "FINISHED_LENGTH_CAPPED"


def test_abort_between_steps_skips_the_rows():
    _, eng = make()
    add(eng, "a", 1, [1, 2, 3], max_tokens=5)
    b = add(eng, "b", 2, [1, 2, 3], max_tokens=5)
    eng.step(now=1.0)
    eng.abort_seq_group("a")
    res = eng.step([4, 5], now=2.0)  # both samples are passed; a's is ignored
    assert res.scheduled == [b]
    eng.sync_views()
    assert list(b.get_seqs()[0].data.output_token_ids) == [5]


def test_abort_of_a_group_whose_row_forks():
    """The aborted group's prompt row took best_of samples (a fork per extra sample): its
    samples are passed and ignored, and no child id is drawn for it."""
    ids = iter(range(100, 200))
    _, eng = make(seq_counter=lambda: next(ids))
    add(eng, "a", 1, [1, 2, 3], n=2, best_of=3, max_tokens=5, temperature=1.0)
    b = add(eng, "b", 2, [1, 2, 3], max_tokens=5)
    eng.step(now=1.0)
    eng.abort_seq_group("a")
    res = eng.step([4, 5, 6, 7], now=2.0)  # a's 3 samples, then b's
    assert res.scheduled == [b] and next(ids) == 100
    eng.sync_views()
    assert list(b.get_seqs()[0].data.output_token_ids) == [7]


def test_a_bad_seq_counter_changes_nothing():
    ids = iter([1, 100, 100])  # 1 is taken by the parent; then a good one
    sched, eng = make(seq_counter=lambda: next(ids))
    g = add(eng, "a", 1, [1, 2, 3], n=2, best_of=2, max_tokens=4, temperature=1.0)
    eng.step(now=1.0)
    free = sched.block_manager.get_num_free_gpu_blocks()
    with pytest.raises(InvalidArgumentError, match="already in use"):
        eng.step([5, 6], now=2.0)
    assert [s.seq_id for s in g.get_seqs()] == [1]
    assert sched.block_manager.get_num_free_gpu_blocks() == free
    assert eng.num_expected_samples == 2
    res = eng.step([5, 6], now=2.0)
    assert res.buffers.seq_ids[: res.num_rows].tolist() == [1, 100]


def _table(sched, group):
    return list(sched.block_manager.get_block_table(group.get_seqs()[0]))


def test_incremental_block_tables_are_kept_not_rewritten():
    """With incremental buffers ``block_tables`` is a persistent buffer: a step writes only
    the entries that changed, so a mark past every table survives; the rows stay equal to
    the manager's tables. Without incremental buffers every row is written whole."""
    sched, eng = make(max_model_len=64)
    eng.buffers = BatchBuffers.for_scheduler(sched, incremental=True)
    g = add(eng, "a", 1, [1, 2, 3], max_tokens=40)
    b = eng.buffers
    eng.step(now=1.0)
    b.block_tables[0, -1] = 777  # beyond any table of this run: a whole-row write clears it
    states = []
    for t in range(30):
        eng.step([5], now=2.0 + t)
        states.append(int(b.row_state[0]))
        table = _table(sched, g)
        assert b.block_tables[0, : len(table)].tolist() == table
        assert not b.block_tables[0, len(table) : -1].any()
    assert b.block_tables[0, -1] == 777
    assert states.count(1) >= 6 and states.count(0) >= 20  # appended / same
    # Plain buffers: the whole row, padded with 0, every step.
    eng.buffers = plain = BatchBuffers.for_scheduler(sched)
    eng.step([5], now=40.0)
    plain.block_tables[0, -1] = 777
    eng.step([5], now=41.0)
    assert plain.block_tables[0, -1] == 0


def test_new_incremental_buffers_are_written_whole():
    """A step into buffers other than the last ones (the engine widened them, or the caller
    swapped them) cannot rely on what they hold: every row is written whole."""
    sched, eng = make(max_model_len=64)
    eng.buffers = BatchBuffers.for_scheduler(sched, incremental=True)
    g = add(eng, "a", 1, [1, 2, 3, 4, 5, 6], max_tokens=20)
    eng.step(now=1.0)
    eng.step([5], now=2.0)
    fresh = BatchBuffers.for_scheduler(sched, incremental=True)
    fresh.block_tables[:] = 99
    eng.buffers = fresh
    res = eng.step([5], now=3.0)
    table = _table(sched, g)
    assert res.block_tables[0].tolist() == table + [0] * (fresh.block_tables.shape[1] - len(table))
    # the increments are relative to what the caller was sent, not to the buffer
    assert fresh.row_state[0] == 0


class _FailingFork(pagedkv.Sequence):
    fail = True

    def fork(self, new_seq_id):
        if _FailingFork.fail:
            raise RuntimeError("fork failed")
        return super().fork(new_seq_id)


def test_a_failing_fork_changes_nothing_and_the_retry_succeeds():
    """``parent.fork`` is engine code called during the step: when the second group's fork
    raises, the first group's child must not have been added (all or nothing)."""
    sched, eng = make(seq_counter=iter(range(100, 200)).__next__)
    groups = []
    for i, cls in enumerate((pagedkv.Sequence, _FailingFork)):
        seq = cls(i + 1, "", [1, 2, 3, 4, 5, 6], BS, None)
        sp = pagedkv.SamplingParams(n=2, best_of=2, max_tokens=4, temperature=1.0)
        groups.append(pagedkv.SequenceGroup(f"g{i}", [seq], sp, 0.0))
        eng.add_seq_group(groups[-1])
    eng.step(now=1.0)
    free = sched.block_manager.get_num_free_gpu_blocks()

    def state():
        eng.sync_views()
        return (
            [sorted(s.seq_id for s in g.get_seqs()) for g in groups],
            [[(s.status.name, s.get_len()) for s in g.get_seqs()] for g in groups],
            sched.block_manager.get_num_free_gpu_blocks(),
            eng.num_expected_samples,
            [g.request_id for g in sched.running],
        )

    before = state()
    with pytest.raises(RuntimeError, match="fork failed"):
        eng.step([20, 21, 30, 31], now=2.0)
    assert state() == before
    assert before[0] == [[1], [2]] and before[2] == free
    _FailingFork.fail = False
    res = eng.step([20, 21, 30, 31], now=2.0)
    assert res.num_rows == 4
    assert [sorted(s.seq_id for s in g.get_seqs()) for g in groups] == [[1, 102], [2, 103]]
    eng.sync_views()
    outs = {s.seq_id: list(s.data.output_token_ids) for g in groups for s in g.get_seqs()}
    assert outs == {102: [20], 1: [21], 103: [30], 2: [31]}


def test_stable_rows_keep_their_rows_and_samples_follow_them():
    """With stable rows a finished request's row is taken by the last row; the others keep
    theirs, and the sampled array follows the rows, not schedule order."""
    from pagedkv.engine_step import ROW_APPENDED, ROW_MOVED

    runs = {}
    for stable in (False, True):
        sched, _ = make()
        eng = BatchEngine(
            sched, BatchBuffers.for_scheduler(sched, incremental=True), stable_rows=stable
        )
        assert eng.stable_rows is stable
        reqs = [("a", 2), ("b", 5), ("c", 5)]
        groups = [add(eng, r, i, [1, 2, 3], max_tokens=t) for i, (r, t) in enumerate(reqs)]
        res = eng.step(now=1.0)
        assert res.buffers.seq_ids[:3].tolist() == [0, 1, 2]
        res = eng.step([10, 20, 30], now=2.0)
        res = eng.step([11, 21, 31], now=3.0)  # a's second token: a finishes
        b = res.buffers
        assert res.finished == [groups[0]] and res.num_rows == 2
        assert [g.request_id for g in res.scheduled] == ["b", "c"]  # schedule order
        runs[stable] = (b.seq_ids[:2].tolist(), b.row_state[:2].tolist(), b.moved_from[:2].tolist())
        tables = {int(b.seq_ids[i]): b.block_tables[i, :2].tolist() for i in range(2)}
        by_id = {s.seq_id: s for g in groups[1:] for s in g.get_seqs()}
        for sid, row in tables.items():
            assert row == sched.block_manager.get_block_table(by_id[sid])
        toks = [20 + 2 * int(sid) for sid in b.seq_ids[:2]]  # one token per row, row order
        eng.step(toks, now=4.0)
        eng.sync_views()
        for sid, tok in zip(b.seq_ids[:2].tolist(), toks):
            assert by_id[sid].get_last_token_id() == tok
    assert runs[False] == ([1, 2], [ROW_MOVED, ROW_MOVED], [1, 2])
    # c fills a's row 0; b keeps row 1 (its table grew a block this step)
    assert runs[True] == ([2, 1], [ROW_MOVED, ROW_APPENDED], [2, 1])


def test_stable_rows_must_be_a_bool():
    sched, _ = make()
    with pytest.raises(ArgumentTypeError):
        BatchEngine(sched, stable_rows=1)
