"""Drop-in fidelity of the block manager with vLLM's BlockSpaceManagerV1 (issue 8), against
the native manager and the reference alike: a sequence's blocks are counted in the sequence's
own block size, ``fork`` follows vLLM (unknown parent -> KeyError; an existing child table is
replaced), and the returned mappings behave as dicts (vLLM 0.5's pairs on request)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import pagedkv
from pagedkv import reference
from pagedkv.errors import InvalidArgumentError, UnknownSequenceError
from pagedkv.sequence import Logprob, SamplingParams, Sequence, SequenceGroup, SequenceStatus

BS = 4
_ids = itertools.count(1000)


@pytest.fixture(
    params=[pagedkv.BlockSpaceManager, reference.BlockSpaceManager], ids=["native", "reference"]
)
def Manager(request):
    return request.param


def admit(m, tokens, block_size=BS, width=1):
    seqs = [Sequence(next(_ids), "", list(tokens), block_size) for _ in range(width)]
    group = SequenceGroup(f"r{seqs[0].seq_id}", seqs, SamplingParams(n=width), 0.0)
    m.allocate(group)
    for s in seqs:
        s.status = SequenceStatus.RUNNING
    return group, seqs


def append(seq, *tokens):
    for t in tokens:
        seq.append_token_id(t, {t: Logprob(0.0)})


def state(m, seqs):
    return (
        m.get_num_free_gpu_blocks(),
        [m.ref_count("gpu", b) for b in range(m.num_total_gpu_blocks)],
        [m.get_block_table(s) if m.has_table(s) else None for s in seqs],
    )


# ---- item 1: the sequence's own block size -------------------------------------------------


@pytest.mark.parametrize("caching", [False, True])
def test_blocks_are_counted_in_the_sequences_own_block_size(Manager, caching):
    """vLLM's own scheduler tests build sequences whose block size is the prompt length on a
    cache of block size 4: BlockSpaceManagerV1 gives them len(seq.logical_token_blocks)."""
    m = Manager(BS, 10, 4, watermark=0.0, enable_caching=caching)
    g, (s,) = admit(m, range(60), block_size=60)
    assert len(m.get_block_table(s)) == len(s.logical_token_blocks) == 1
    assert m.get_num_free_gpu_blocks() == 9
    append(s, 60)  # token 61 opens the sequence's second logical block
    assert m.can_append_slots(g)
    assert m.append_slots(s) == {}
    assert len(m.get_block_table(s)) == len(s.logical_token_blocks) == 2
    append(s, 61, 62)
    m.append_slots(s)
    assert len(m.get_block_table(s)) == 2
    child = s.fork(next(_ids))
    m.fork(s, child)
    append(child, 63)
    cow = m.append_slots(child)
    assert list(cow) == [m.get_block_table(s)[1]]  # the shared partial block is copied
    m.check_invariants()
    m.free(s)
    m.free(child)
    assert m.get_num_free_gpu_blocks() == 10


def test_cache_entries_in_other_units_are_never_shared(Manager):
    m = Manager(BS, 32, 4, enable_caching=True)
    prefix = list(range(16))
    _, (small,) = admit(m, prefix, block_size=BS)
    _, (big,) = admit(m, prefix, block_size=8)
    _, (big2,) = admit(m, prefix, block_size=8)
    _, (small2,) = admit(m, prefix, block_size=BS)
    ts, tb, tb2 = (m.get_block_table(x) for x in (small, big, big2))
    assert set(ts).isdisjoint(tb) and set(tb).isdisjoint(tb2) and set(ts).isdisjoint(tb2)
    assert m.get_block_table(small2) == ts  # the same units still share
    m.check_invariants()


def test_batch_api_refuses_other_units_and_changes_nothing():
    m = pagedkv.BlockSpaceManager(BS, 8, 2)
    _, (a,) = admit(m, [1, 2, 3], block_size=8)
    append(a, 4)
    tables = np.zeros((1, 4), np.int32)
    lens = np.zeros(1, np.int32)
    slots = np.zeros(1, np.int32)
    before = state(m, [a])
    with pytest.raises(InvalidArgumentError, match="block_size 8"):
        m.append_slots_batch([a], tables, lens, slots)
    with pytest.raises(InvalidArgumentError, match="block_size 8"):
        m.fill_block_tables([a], tables)
    assert state(m, [a]) == before
    assert not tables.any()
    assert m.append_slots(a) == {}  # the per-sequence call accepts it
    append(a, *range(5, 10))  # 9 tokens: a second 8-token block
    m.append_slots(a)
    assert len(m.get_block_table(a)) == 2


# ---- items 3 and 7: fork -------------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True])
def test_fork_from_a_parent_without_a_table_is_unknown(Manager, strict):
    m = Manager(BS, 8, 2, strict=strict)
    _, (other,) = admit(m, [1, 2, 3, 4, 5])
    ghost = Sequence(next(_ids), "", [1, 2], BS)
    child = ghost.fork(next(_ids))
    before = state(m, [other, ghost, child])
    with pytest.raises(UnknownSequenceError):
        m.fork(ghost, child)
    with pytest.raises(KeyError):  # vLLM raises KeyError here
        m.fork(ghost, other)
    assert state(m, [other, ghost, child]) == before
    if strict:
        with pytest.raises(UnknownSequenceError):
            m.free(ghost)
    else:
        m.free(ghost)  # free of an unknown sequence stays a no-op
    m.check_invariants()


def test_fork_onto_a_child_with_a_table_replaces_it_and_releases_the_old(Manager):
    """vLLM 0.4.2's test_append_slot_cow allocates a group holding parent and child, then forks
    again: the child's table becomes the parent's (vLLM leaks the old references; we don't)."""
    m = Manager(BS, 8, 2, watermark=0.0)
    g, (parent, child) = admit(m, [1, 2, 3], width=2)
    assert m.get_block_table(child) == m.get_block_table(parent)
    m.fork(parent, child)
    (b,) = m.get_block_table(parent)
    assert m.get_block_table(child) == [b] and m.ref_count("gpu", b) == 2
    assert m.get_num_free_gpu_blocks() == 7
    _, (other,) = admit(m, [7] * 9)
    assert m.get_num_free_gpu_blocks() == 4
    m.fork(parent, other)
    assert m.get_block_table(other) == [b]
    assert m.get_num_free_gpu_blocks() == 7 and m.ref_count("gpu", b) == 3
    m.check_invariants()
    for s in (parent, child, other):
        m.free(s)
    assert m.get_num_free_gpu_blocks() == 8


# ---- item 2: BlockMapping is a dict; vLLM 0.5's pairs by choice ----------------------------


def cow_and_swaps(m):
    g, (p,) = admit(m, [1, 2, 3])
    child = p.fork(next(_ids))
    m.fork(p, child)
    g.add(child)
    append(p, 4)
    cow = m.append_slots(p)
    out = m.swap_out(g)
    for s in (p, child):
        s.status = SequenceStatus.SWAPPED
    back = m.swap_in(g)
    return cow, out, back


def test_block_mapping_is_dict_compatible_by_default(Manager):
    cow, out, back = cow_and_swaps(Manager(BS, 8, 4, watermark=0.0))
    for m in (cow, out, back):
        assert isinstance(m, dict) and isinstance(m, pagedkv.BlockMapping)
        assert list(m) == list(m.keys()) and set(m) == set(m.keys())
        assert len(m) == len(list(m))
        assert {k: m[k] for k in m} == dict(m.items())
        with pytest.raises(TypeError):
            m[99] = 1
    (src,) = cow
    assert isinstance(src, int) and len(cow[src]) == 1
    assert cow.pairs() == [(src, cow[src][0])]
    assert out.pairs() == list(out.items()) and len(out) == 2  # the copy and the original


def test_pairs_format_returns_vllm_05_lists(Manager):
    m = Manager(BS, 8, 4, watermark=0.0, mapping_format="pairs")
    assert m.mapping_format == "pairs"
    cow, out, back = cow_and_swaps(m)
    for x in (cow, out, back):
        assert type(x) is list and all(type(p) is tuple and len(p) == 2 for p in x)
    assert len(cow) == 1 and len(out) == 2 and len(back) == 2
    assert {cpu for _, cpu in out} == {cpu for cpu, _ in back}
    with pytest.raises(InvalidArgumentError):
        Manager(BS, 8, 4, mapping_format="tuples")


def test_pairs_and_dict_managers_make_the_same_moves(Manager):
    d = cow_and_swaps(Manager(BS, 8, 4, watermark=0.0))
    p = cow_and_swaps(Manager(BS, 8, 4, watermark=0.0, mapping_format="pairs"))
    assert [x.pairs() for x in d] == list(p)


def test_allocate_onto_a_sequence_with_a_table_replaces_it(Manager):
    """vLLM 0.4.2's own scheduler tests admit two groups whose sequences share id 1 (the second
    while the first is swapped out): vLLM overwrites the table; we do too, and release the old
    one after building the new (so the blocks chosen are vLLM's), leaking nothing."""
    m = Manager(BS, 8, 8, watermark=0.0)
    seqs = [Sequence(1, "", [1, 2, 3, 4, 5], BS) for _ in range(2)]
    groups = [SequenceGroup("1", [s], SamplingParams(), 0.0) for s in seqs]
    m.allocate(groups[0])
    seqs[0].status = SequenceStatus.RUNNING
    first = m.get_block_table(seqs[0])
    m.swap_out(groups[0])
    assert m.get_num_free_cpu_blocks() == 6
    m.allocate(groups[1])
    assert m.table_device(seqs[1]) == "gpu" and sorted(m.get_block_table(seqs[1])) == sorted(first)
    assert m.get_num_free_cpu_blocks() == 8 and m.get_num_free_gpu_blocks() == 6
    m.check_invariants()
