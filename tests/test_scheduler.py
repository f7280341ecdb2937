"""pagedkv.Scheduler: vLLM 0.4.2's public API, views, errors (decisions: the differential test)."""

from __future__ import annotations

import gc
import weakref

import pytest

import pagedkv
from pagedkv import (
    ArgumentTypeError,
    CacheConfig,
    InvalidArgumentError,
    LoRAConfig,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceGroup,
    SequenceStatus,
    UnknownSequenceError,
)


def make(max_tokens=64, max_seqs=8, max_len=64, bs=4, gpu=32, cpu=16, **kw):
    chunked = kw.pop("enable_chunked_prefill", False)
    caching = kw.pop("enable_prefix_caching", False)
    scfg = SchedulerConfig(max_tokens, max_seqs, max_len, enable_chunked_prefill=chunked, **kw)
    ccfg = CacheConfig(bs, enable_prefix_caching=caching, num_gpu_blocks=gpu, num_cpu_blocks=cpu)
    return Scheduler(scfg, ccfg)


def group(i, n_tokens, bs=4, best_of=1, arrival=None, tokens=None):
    seq = Sequence(i, "", tokens or list(range(100 * i, 100 * i + n_tokens)), bs)
    params = SamplingParams(n=1, best_of=best_of, max_tokens=8)
    return SequenceGroup(f"r{i}", [seq], params, float(i if arrival is None else arrival))


def ids(q):
    return [g.request_id for g in q]


def test_config_defaults_follow_vllm():
    assert SchedulerConfig(None, 8, 100).max_num_batched_tokens == 2048
    assert SchedulerConfig(None, 8, 4096).max_num_batched_tokens == 4096
    chunked = SchedulerConfig(None, 8, 4096, enable_chunked_prefill=True)
    assert chunked.max_num_batched_tokens == 512 and chunked.chunked_prefill_enabled
    with pytest.raises(InvalidArgumentError):
        SchedulerConfig(32, 8, 64)  # a 64-token sequence could never run
    assert LoRAConfig(max_lora_rank=8, max_loras=2).max_loras == 2


def test_vllm_config_objects_are_read_by_field_name():
    from pagedkv import vllm_release

    v = vllm_release.load("0.4.2", "vllm")
    scfg = v.config.SchedulerConfig(16, 4, 64, enable_chunked_prefill=True)
    ccfg = v.config.CacheConfig(4, 0.9, 1, "auto", enable_prefix_caching=True)
    ccfg.num_gpu_blocks, ccfg.num_cpu_blocks = 32, 4
    s = Scheduler(scfg, ccfg, None)
    assert s.prompt_limit == 64  # chunked: max_model_len
    s.add_seq_group(group(1, 60))
    metas, out = s.schedule()
    assert [g.token_chunk_size for g in out.scheduled_seq_groups] == [16]
    assert metas[0].do_sample is False  # an intermediate chunk samples nothing


def test_schedule_writes_statuses_and_keeps_fcfs_views():
    s = make()
    groups = [group(i, 6) for i in range(3)]
    for g in groups:
        s.add_seq_group(g)
    assert ids(s.waiting) == ["r0", "r1", "r2"] and s.get_num_unfinished_seq_groups() == 3
    snapshot = s.waiting
    snapshot.clear()  # a snapshot: the scheduler's queue is untouched
    assert len(s.waiting) == 3
    metas, out = s.schedule()
    assert [m.request_id for m in metas] == ["r0", "r1", "r2"]
    assert out.num_prefill_groups == 3 and out.num_batched_tokens == 18
    assert all(g.get_seqs()[0].status == SequenceStatus.RUNNING for g in groups)
    assert ids(s.running) == ["r0", "r1", "r2"] and not s.waiting
    assert groups[0].metrics.first_scheduled_time is not None
    seq = groups[0].get_seqs()[0]
    assert metas[0].block_tables == {0: s.block_manager.get_block_table(seq)}
    assert metas[0].seq_data[0] is seq.data


def test_prompts_over_the_limit_are_ignored():
    s = make(max_len=16, max_tokens=16)
    s.add_seq_group(group(1, 17))
    _, out = s.schedule()
    assert ids(out.ignored_seq_groups) == ["r1"]
    assert out.ignored_seq_groups[0].get_seqs()[0].status == SequenceStatus.FINISHED_IGNORED
    assert not s.has_unfinished_seqs()


def test_abort_by_id_or_iterable_frees_blocks():
    s = make()
    gs = [group(i, 6) for i in range(4)]
    for g in gs:
        s.add_seq_group(g)
    s.schedule()
    free = s.block_manager.get_num_free_gpu_blocks()
    s.abort_seq_group("r1")
    s.abort_seq_group(iter(["r2", "nope"]))
    assert ids(s.running) == ["r0", "r3"]
    assert s.block_manager.get_num_free_gpu_blocks() == free + 4
    assert gs[1].get_seqs()[0].status == SequenceStatus.FINISHED_ABORTED
    assert not s.block_manager.has_table(gs[1].get_seqs()[0])


def test_recompute_preemption_resets_the_sequence_view():
    s = make(gpu=2, cpu=4)
    a, b = group(1, 4), group(2, 4)
    s.add_seq_group(a)
    s.add_seq_group(b)
    _, out = s.schedule()
    for sg in out.scheduled_seq_groups:
        sg.seq_group.update_num_computed_tokens(sg.token_chunk_size)
        sg.seq_group.get_seqs()[0].append_token_id(1, {1: pagedkv.Logprob(0.0)})
    _, out = s.schedule()  # both need a new block; one is free: b is preempted
    assert ids(g.seq_group for g in out.scheduled_seq_groups) == ["r1"]
    seq = b.get_seqs()[0]
    assert seq.status == SequenceStatus.WAITING and seq.data.get_num_computed_tokens() == 0
    assert seq.is_prefill() and ids(s.waiting) == ["r2"]


def test_fork_free_and_finished_groups():
    s = make()
    g = group(1, 6, best_of=2)
    s.add_seq_group(g)
    _, out = s.schedule()
    g.update_num_computed_tokens(6)
    parent = g.get_seqs()[0]
    child = parent.fork(99)
    g.add(child)
    s.fork_seq(parent, child)
    assert s.block_manager.get_block_table(child) == s.block_manager.get_block_table(parent)
    with pytest.raises(UnknownSequenceError):
        s.fork_seq(Sequence(50, "", [1], 4), Sequence(51, "", [1], 4))
    for seq in (parent, child):
        seq.status = SequenceStatus.FINISHED_STOPPED
        s.free_seq(seq)
    s.free_finished_seq_groups()
    assert not s.has_unfinished_seqs()
    assert s.block_manager.get_num_free_gpu_blocks() == 32


def test_bad_input_is_refused_and_changes_nothing():
    s = make()
    s.add_seq_group(group(1, 4))
    with pytest.raises(InvalidArgumentError):
        s.add_seq_group(group(1, 4))  # sequence id already scheduled
    # A sequence in other block units is taken, as vLLM's manager takes it (only the batch
    # step refuses it): tests/test_scheduler_vllm_tests.py.

    class Foreign:
        request_id = "x"
        lora_int_id = 0
        sampling_params = SamplingParams()

        class metrics:
            arrival_time = 0.0

        def get_seqs(self):
            class S:
                seq_id = 7

            return [S()]

    with pytest.raises(ArgumentTypeError):
        s.add_seq_group(Foreign())
    assert ids(s.waiting) == ["r1"]
    with pytest.raises(InvalidArgumentError):
        Scheduler(
            SchedulerConfig(64, 8, 64, use_v2_block_manager=True),
            CacheConfig(4, num_gpu_blocks=8, num_cpu_blocks=8),
        )
    with pytest.raises(InvalidArgumentError):
        Scheduler(SchedulerConfig(64, 8, 64), CacheConfig(4))  # block counts not set
    with pytest.raises(InvalidArgumentError):
        make(preemption_mode="sometimes")
    bad = SchedulerConfig(64, 8, 64)
    bad.max_num_seqs = -1
    with pytest.raises(InvalidArgumentError):
        Scheduler(bad, CacheConfig(4, num_gpu_blocks=8, num_cpu_blocks=8))
    with pytest.raises(InvalidArgumentError):
        Scheduler(
            SchedulerConfig(64, 8, 64),
            CacheConfig(4, num_gpu_blocks=8, num_cpu_blocks=8),
            LoRAConfig(max_lora_rank=8, max_loras=0),
        )


def test_prefix_caching_reports_common_computed_blocks():
    s = make(enable_prefix_caching=True)
    prompt = list(range(12))
    s.add_seq_group(group(1, 12, tokens=prompt))
    _, out = s.schedule()
    out.scheduled_seq_groups[0].seq_group.update_num_computed_tokens(12)
    s.add_seq_group(group(2, 12, tokens=prompt))
    metas, _ = s.schedule()
    m2 = [m for m in metas if m.request_id == "r2"][0]
    assert len(m2.computed_block_nums) == 2  # blocks 0 and 1 of the shared prompt (not the last)
    assert m2.block_tables[2][:2] == m2.computed_block_nums


def test_scheduler_takes_part_in_gc():
    s = make()
    g = group(1, 4)
    g.owner = s  # a cycle through the native core
    s.add_seq_group(g)
    s.schedule()
    ref = weakref.ref(s)
    del s, g
    gc.collect()
    assert ref() is None


def test_state_bytes_per_request():
    s = make()
    base = s.state_bytes()
    for i in range(10):
        s.add_seq_group(group(i, 4))
    per_request = (s.state_bytes() - base) / 10
    assert 0 < per_request <= 256
    waiting = s.state_bytes()
    s.schedule()  # each scheduled group keeps its metadata-reuse record
    assert 0 < (s.state_bytes() - waiting) / 10 <= 128


def test_metadata_block_lists_are_read_only_and_follow_table_changes():
    s = make(bs=4)
    g = group(1, 3)
    s.add_seq_group(g)
    metas, _ = s.schedule()
    seq = g.get_seqs()[0]
    first = metas[0].block_tables[1]
    with pytest.raises(TypeError):
        first.append(7)
    assert first.copy() == list(first) == s.block_manager.get_block_table(seq)
    g.update_num_computed_tokens(3)
    seq.append_token_id(5, {5: pagedkv.Logprob(0.0)})  # 4 tokens: still one block
    metas, _ = s.schedule()
    assert metas[0].block_tables[1] is first  # unchanged table: the same list
    g.update_num_computed_tokens(1)
    seq.append_token_id(6, {6: pagedkv.Logprob(0.0)})  # 5 tokens: a second block
    metas, _ = s.schedule()
    grown = metas[0].block_tables[1]
    assert len(grown) == 2 and list(first) == grown[:1]
    assert grown == s.block_manager.get_block_table(seq)


def test_forked_group_without_swap_space_is_aborted():
    # r2 runs two forks, the CPU has no swap space and forks cannot be recomputed: vLLM raises
    # RuntimeError (the engine dies); the step aborts r2 alone and reports it ignored
    # (docs/scheduler.md, fix 7), and r1 gets its new block.
    s = make(gpu=4, cpu=0)
    a, b = group(1, 4), group(2, 3, best_of=2)
    s.add_seq_group(a)
    s.add_seq_group(b)
    _, out = s.schedule()
    for sg in out.scheduled_seq_groups:
        sg.seq_group.update_num_computed_tokens(sg.token_chunk_size)
        sg.seq_group.get_seqs()[0].append_token_id(1, {1: pagedkv.Logprob(0.0)})
    parent = b.get_seqs()[0]
    child = parent.fork(20)
    b.add(child)
    s.fork_seq(parent, child)
    metas, out = s.schedule()
    assert ids(g.seq_group for g in out.scheduled_seq_groups) == ["r1"]
    assert out.ignored_seq_groups == [b] and not out.blocks_to_swap_out
    assert [q.status for q in b.get_seqs()] == [SequenceStatus.FINISHED_ABORTED] * 2
    assert b.is_finished()
    assert (ids(s.waiting), ids(s.running), ids(s.swapped)) == ([], ["r1"], [])
    mgr = s.block_manager
    assert not mgr.has_table(parent) and not mgr.has_table(child)
    assert (mgr.get_num_free_gpu_blocks(), mgr.get_num_free_cpu_blocks()) == (2, 0)
    mgr.check_invariants()
    _, out = s.schedule()  # the next step goes on without it
    assert ids(g.seq_group for g in out.scheduled_seq_groups) == ["r1"]


def test_sequences_removed_from_a_running_group_leave_it():
    # Beam search drops the parents it does not keep with SequenceGroup.remove (their status
    # stays RUNNING) and frees them; the scheduler must stop counting them, and the group
    # finishes when what is left of it has.
    s = make()
    g = group(1, 6, best_of=2)
    s.add_seq_group(g)
    _, out = s.schedule()
    g.update_num_computed_tokens(6)
    parent = g.get_seqs()[0]
    child = parent.fork(99)
    g.add(child)
    s.fork_seq(parent, child)
    for seq in (parent, child):
        seq.append_token_id(1, {1: pagedkv.Logprob(0.0)})
    g.remove(parent.seq_id)
    s.free_seq(parent)
    assert parent.status == SequenceStatus.RUNNING
    metas, out = s.schedule()
    assert [list(m.block_tables) for m in metas] == [[99]]
    child.status = SequenceStatus.FINISHED_STOPPED
    s.free_seq(child)
    s.free_finished_seq_groups()
    assert not s.has_unfinished_seqs()
    assert s.block_manager.get_num_free_gpu_blocks() == 32


def _decode(s, groups, token=7):
    """One model-free engine step after a schedule(): computed tokens, one sampled token."""
    metas, out = s.schedule()
    for sg in out.scheduled_seq_groups:
        sg.seq_group.update_num_computed_tokens(sg.token_chunk_size)
        for seq in sg.seq_group.get_seqs(status=SequenceStatus.RUNNING):
            seq.append_token_id(token, {token: pagedkv.Logprob(0.0)})
    return metas, out


def _fields(m):
    return (
        m.request_id,
        m.is_prompt,
        dict(m.seq_data),
        m.sampling_params,
        {k: list(v) for k, v in m.block_tables.items()},
        m.do_sample,
        m.token_chunk_size,
        m.lora_request,
        list(m.computed_block_nums or []),
        m.state,
        m.multi_modal_data,
    )


@pytest.mark.parametrize("caching", [False, True], ids=["plain", "caching"])
def test_metadata_is_reused_only_while_nothing_in_it_changes(caching):
    """A decode group's SequenceGroupMetadata and ScheduledSequenceGroup are last step's objects
    while everything they hold is the same; when anything changes (a new block, the computed
    blocks, the group's sampling params) they are new, and the ones handed out before keep
    what they held."""
    s = make(bs=4, gpu=64, enable_prefix_caching=caching)
    g = group(1, 6, bs=4)
    s.add_seq_group(g)
    history = []
    for _ in range(9):
        metas, out = _decode(s, [g])
        history.append((metas[0], out.scheduled_seq_groups[0], _fields(metas[0])))
    for (m0, sg0, f0), (m1, sg1, f1) in zip(history, history[1:]):
        assert (m1 is m0) == (f1 == f0 and f1[1] is False), (f0, f1)
        assert (sg1 is sg0) == (m1 is m0)
    # every object still holds what it held when it was handed out
    assert all(_fields(m) == f for m, _, f in history)
    reused = sum(m1 is m0 for (m0, _, _), (m1, _, _) in zip(history, history[1:]))
    assert 3 <= reused < 8  # 6 prompt tokens, block size 4: tables change every 4 decodes
    # a field of the group read by vLLM's metadata changes: a new object, with the new value
    last = history[-1][0]
    g.sampling_params = SamplingParams(n=1, best_of=1, max_tokens=9)
    metas, _ = _decode(s, [g])
    assert metas[0] is not last and metas[0].sampling_params is g.sampling_params
    assert isinstance(metas[0], pagedkv.SequenceGroupMetadata)


def test_num_loras_counts_distinct_adapters_as_vllm():
    s = Scheduler(
        SchedulerConfig(64, 8, 64),
        CacheConfig(4, num_gpu_blocks=32, num_cpu_blocks=4),
        LoRAConfig(max_lora_rank=8, max_loras=4),
    )
    for i, lora in enumerate([2, 2, 5, None]):
        seq = Sequence(i, "", list(range(4)), 4)
        req = pagedkv.LoRARequest(f"l{lora}", lora, "/p") if lora else None
        s.add_seq_group(SequenceGroup(f"r{i}", [seq], SamplingParams(), float(i), req))
    _, out = s.schedule()
    assert out.num_loras == 2 == len(out.lora_requests)
    assert [sg.seq_group.request_id for sg in out.scheduled_seq_groups] == ["r3", "r0", "r1", "r2"]


def test_free_finished_drops_exactly_the_groups_the_engine_finished():
    """Only groups whose sequences (in seqs_dict) all finished leave; a group with one of two
    sequences finished stays, and a group whose seqs_dict was rebuilt with equal (not
    identical) keys is still matched."""
    s = make()
    groups = [group(i, 4, best_of=2 if i == 1 else 1) for i in range(3)]
    for g in groups:
        s.add_seq_group(g)
    _decode(s, groups)
    parent = groups[1].get_seqs()[0]
    child = parent.fork(50)
    groups[1].add(child)
    s.fork_seq(parent, child)
    groups[2].seqs_dict = {int(str(k)): v for k, v in groups[2].seqs_dict.items()}
    groups[0].get_seqs()[0].status = SequenceStatus.FINISHED_STOPPED
    child.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    s.free_finished_seq_groups()
    assert ids(s.running) == ["r1", "r2"]
    parent.status = SequenceStatus.FINISHED_STOPPED
    s.free_finished_seq_groups()
    assert ids(s.running) == ["r2"]
    metas, out = _decode(s, groups)
    assert [m.request_id for m in metas] == ["r2"] and out.num_batched_tokens == 1


def test_sliding_window_is_rounded_up_to_whole_blocks_as_vllm():
    """vLLM 0.4.2's manager uses ceil(sliding_window / block_size) blocks; pagedkv's manager
    takes whole blocks, so the Scheduler rounds up (a 6-token window on 4-token blocks: 2)."""
    s = Scheduler(
        SchedulerConfig(64, 8, 64),
        CacheConfig(4, sliding_window=6, num_gpu_blocks=32, num_cpu_blocks=4),
    )
    assert s.block_manager.block_sliding_window == 2
    assert s.cache_config.sliding_window == 6  # the caller's config is not changed
    s.add_seq_group(group(1, 14))  # 4 blocks of tokens, 2 in the window
    metas, _ = s.schedule()
    table = metas[0].block_tables[1]
    assert len(table) == 4 and table[2:] == table[:2] and len(set(table)) == 2
    for bad in (0, -4, 2.5, True):
        with pytest.raises(InvalidArgumentError):
            Scheduler(
                SchedulerConfig(64, 8, 64),
                CacheConfig(4, sliding_window=bad, num_gpu_blocks=32, num_cpu_blocks=4),
            )
