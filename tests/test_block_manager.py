"""BlockSpaceManager behaviour (docs/block_manager.md), run against the native manager and the
pure-Python reference alike: prefix caching, LRU, copy-on-write, swapping, errors that change
nothing, and the batch step API (native only)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import pagedkv
from pagedkv import reference
from pagedkv.errors import (
    InvalidArgumentError,
    OutOfBlocksError,
    UnknownSequenceError,
)
from pagedkv.sequence import Logprob, SamplingParams, Sequence, SequenceGroup, SequenceStatus

BS = 4
MANAGERS = [pagedkv.BlockSpaceManager, reference.BlockSpaceManager]
_ids = itertools.count()


@pytest.fixture(params=MANAGERS, ids=["native", "reference"])
def Manager(request):
    return request.param


def request_of(tokens, width=1, **seq_kwargs):
    seqs = [Sequence(next(_ids), "", list(tokens), BS, **seq_kwargs) for _ in range(width)]
    return SequenceGroup(f"r{seqs[0].seq_id}", seqs, SamplingParams(n=width), 0.0), seqs


def admit(m, tokens, **kw):
    group, seqs = request_of(tokens, **kw)
    m.allocate(group)
    for s in seqs:
        s.status = SequenceStatus.RUNNING
    return group, seqs


def append(seq, *tokens):
    for t in tokens:
        seq.append_token_id(t, {t: Logprob(0.0)})


def snapshot(m, seqs, gpu, cpu):
    return (
        m.get_num_free_gpu_blocks(),
        m.get_num_free_cpu_blocks(),
        [m.ref_count("gpu", b) for b in range(gpu)],
        [m.ref_count("cpu", b) for b in range(cpu)],
        [m.get_block_table(s) if m.has_table(s) else None for s in seqs],
    )


PREFIX = list(range(100, 124))  # 6 full blocks


def test_shared_prefix_shares_exactly_its_full_blocks(Manager):
    m = Manager(BS, 32, 8, enable_caching=True)
    _, (a,) = admit(m, PREFIX + [1, 2])
    _, (b,) = admit(m, PREFIX + [3, 4, 5, 6, 7])
    ta, tb = m.get_block_table(a), m.get_block_table(b)
    assert ta[:6] == tb[:6]
    assert set(ta[6:]).isdisjoint(tb[6:])
    assert all(m.ref_count("gpu", blk) == 2 for blk in ta[:6])
    assert m.prefix_cache_stats() == (6 + 7, 6)


def test_partial_blocks_are_never_shared(Manager):
    m = Manager(BS, 16, 4, enable_caching=True)
    _, (a,) = admit(m, [1, 2, 3, 4, 5, 6])
    _, (b,) = admit(m, [1, 2, 3, 4, 5, 6])
    ta, tb = m.get_block_table(a), m.get_block_table(b)
    assert ta[0] == tb[0] and ta[1] != tb[1]
    # the partial block becomes shareable once it is full (promotion at append time)
    append(a, 7, 8)
    m.append_slots(a)
    _, (c,) = admit(m, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert m.get_block_table(c)[:2] == ta[:2]


def test_freed_prefix_is_reused_later(Manager):
    m = Manager(BS, 16, 4, enable_caching=True)
    _, (a,) = admit(m, PREFIX[:12])
    table = m.get_block_table(a)
    m.free(a)
    assert m.get_num_free_gpu_blocks() == 16
    assert m.num_evictable_blocks() == 3
    _, (b,) = admit(m, PREFIX[:12] + [9])
    assert m.get_block_table(b)[:3] == table
    assert m.num_evictable_blocks() == 0


def test_lru_order_under_pressure(Manager):
    m = Manager(BS, 8, 4, watermark=0.0, enable_caching=True)
    _, (old,) = admit(m, list(range(0, 8)))
    _, (new,) = admit(m, list(range(50, 58)))
    m.access_all_blocks_in_seq(old, 1.0)
    m.access_all_blocks_in_seq(new, 2.0)
    old_t, new_t = m.get_block_table(old), m.get_block_table(new)
    m.free(new)
    m.free(old)
    # 4 never-used blocks first, then evict: least recent first, its tail block first
    _, (x,) = admit(m, list(range(200, 224)))
    assert m.get_block_table(x)[4:] == [old_t[1], old_t[0]]
    assert m.num_evictable_blocks() == 2
    _, (y,) = admit(m, list(range(50, 58)))
    assert m.get_block_table(y) == new_t  # the recently used prefix survived


@pytest.fixture
def weak_hash():
    """Every new sequence hashes with a 3-bit test hash: almost every lookup collides."""
    saved = pagedkv.get_default_hasher()
    pagedkv._native._set_weak_test_hasher(1)
    yield
    pagedkv.set_default_hasher(*saved)


def test_forced_hash_collisions_never_share_different_blocks(Manager, weak_hash):
    m = Manager(BS, 64, 4, enable_caching=True)
    seqs = []
    for i in range(12):
        toks = [i % 3, i % 2, 7, 7] + [i, i + 1, i + 2, i + 3] + [5, 5, 5, 5]
        _, (s,) = admit(m, toks)
        assert s.data._store.hasher == ("weak-for-testing", 1)
        seqs.append((s, toks))
    owner = {}
    for s, toks in seqs:
        for i, blk in enumerate(m.get_block_table(s)):
            prefix = tuple(toks[: (i + 1) * BS])
            assert owner.setdefault(blk, prefix) == prefix, "a block holds two different prefixes"
    lookups, hits = m.prefix_cache_stats()
    assert 0 < hits < lookups  # real sharing happened, colliding lookups were rejected


def test_fork_then_copy_on_write(Manager):
    m = Manager(BS, 16, 4, enable_caching=False)
    group, (p,) = admit(m, [1, 2, 3, 4, 5, 6])
    child = p.fork(next(_ids))
    group.add(child)
    m.fork(p, child)
    last = m.get_block_table(p)[-1]
    assert m.ref_count("gpu", last) == 2
    append(p, 9)
    cow = m.append_slots(p)
    assert list(cow.keys()) == [last] and len(cow[last]) == 1
    assert list(cow) == [last]  # a dict: iteration yields keys
    assert cow.pairs() == [(last, cow[last][0])]  # vLLM 0.5's (src, dst) pairs
    assert m.get_block_table(p)[-1] == cow[last][0]
    append(child, 8)
    assert m.append_slots(child) == {}
    assert m.ref_count("gpu", last) == 1


def test_swap_round_trip_keeps_sharing(Manager):
    m = Manager(BS, 16, 16, enable_caching=False)
    group, (p,) = admit(m, list(range(10)))
    child = p.fork(next(_ids))
    group.add(child)
    m.fork(p, child)
    append(child, 1)
    m.append_slots(child)
    shared = m.get_block_table(p)[:2]
    assert m.can_swap_out(group)
    out = m.swap_out(group)
    assert len(out) == 4  # 3 shared blocks... of which 2 full + 1 CoW'd pair => distinct blocks
    for s in group.get_seqs():
        s.status = SequenceStatus.SWAPPED
    assert m.ref_count("cpu", out[shared[0]]) == 2
    assert m.get_num_free_gpu_blocks() == 16
    back = m.swap_in(group)
    assert len(back) == 4
    assert m.get_block_table(p)[:2] == m.get_block_table(child)[:2]


def test_sliding_window_reuses_blocks(Manager):
    m = Manager(BS, 16, 4, sliding_window=8)
    _, (s,) = admit(m, list(range(20)))  # 5 blocks, window of 2
    t = m.get_block_table(s)
    assert len(t) == 5 and len(set(t)) == 2 and t[2] == t[0]
    assert m.get_num_free_gpu_blocks() == 14


def test_errors_change_nothing(Manager):
    m = Manager(BS, 6, 2, watermark=0.0, enable_caching=True)
    group, (a,) = admit(m, list(range(10)))
    ghost = Sequence(next(_ids), "", [1, 2, 3], BS)
    big_group, (big,) = request_of(list(range(100, 130)))
    everything = [a, ghost, big]
    before = snapshot(m, everything, 6, 2)
    with pytest.raises(UnknownSequenceError):
        m.get_block_table(ghost)
    with pytest.raises(UnknownSequenceError):
        m.append_slots(ghost)
    with pytest.raises(InvalidArgumentError):
        m.allocate(group)  # no WAITING sequence left
    with pytest.raises(OutOfBlocksError):
        m.allocate(big_group)
    with pytest.raises(OutOfBlocksError):
        m.swap_out(group)  # 3 blocks, 2 CPU blocks
    for s in group.get_seqs():
        s.status = SequenceStatus.SWAPPED
    with pytest.raises(InvalidArgumentError):
        m.swap_in(group)  # not on the CPU
    a.status = SequenceStatus.RUNNING
    with pytest.raises(UnknownSequenceError):
        m.access_all_blocks_in_seq(ghost, 1.0)
    assert snapshot(m, everything, 6, 2) == before
    m.free(ghost)  # vLLM: no-op
    strict = Manager(BS, 6, 2, strict=True)
    with pytest.raises(UnknownSequenceError):
        strict.free(ghost)


def test_append_out_of_blocks_changes_nothing(Manager):
    m = Manager(BS, 2, 2, watermark=0.0)
    _, (a,) = admit(m, [1, 2, 3, 4])
    _, (b,) = admit(m, [1, 2, 3, 4])
    append(a, *range(4))
    before = snapshot(m, [a, b], 2, 2)
    with pytest.raises(OutOfBlocksError):
        m.append_slots(a)
    assert snapshot(m, [a, b], 2, 2) == before
    m.free(b)
    assert m.append_slots(a) == {}
    assert len(m.get_block_table(a)) == 2


def test_everything_free_after_freeing_all(Manager):
    m = Manager(BS, 32, 8, enable_caching=True)
    seqs = []
    for k in range(5):
        g, (s,) = admit(m, PREFIX[: 8 + k * 3])
        child = s.fork(next(_ids))
        g.add(child)
        m.fork(s, child)
        append(child, k)
        m.append_slots(child)
        seqs += [s, child]
    for s in seqs:
        m.free(s)
    assert m.get_num_free_gpu_blocks() == 32
    assert m.get_num_free_cpu_blocks() == 8


def test_batch_step_writes_caller_buffers():
    m = pagedkv.BlockSpaceManager(BS, 32, 4, enable_caching=True)
    seqs = [admit(m, list(range(k, k + 5 + k)))[1][0] for k in range(3)]
    for s in seqs:
        append(s, 1)
    tables = np.full((4, 8), 99, np.int32)
    lens = np.zeros(4, np.int32)
    slots = np.zeros(4, np.int32)
    cow = m.append_slots_batch(seqs, tables, lens, slots, pad_value=-1)
    assert cow == {}
    for r, s in enumerate(seqs):
        t = m.get_block_table(s)
        assert tables[r, : len(t)].tolist() == t
        assert (tables[r, len(t) :] == -1).all()
        assert lens[r] == s.get_len()
        p = s.get_len() - 1
        assert slots[r] == t[p // BS] * BS + p % BS
    assert (tables[3] == 99).all()  # rows past the batch are left alone


def test_batch_step_checks_before_changing_anything():
    m = pagedkv.BlockSpaceManager(BS, 3, 2, watermark=0.0)
    a = admit(m, [1, 2, 3, 4])[1][0]
    b = admit(m, [1, 2, 3, 4])[1][0]
    append(a, 5)
    append(b, 5)
    tables, lens, slots = np.zeros((2, 4), np.int32), np.zeros(2, np.int32), np.zeros(2, np.int32)
    before = snapshot(m, [a, b], 3, 2)
    with pytest.raises(OutOfBlocksError):  # needs 2 new blocks, 1 free
        m.append_slots_batch([a, b], tables, lens, slots)
    with pytest.raises(InvalidArgumentError):  # too few columns
        m.append_slots_batch([a], np.zeros((1, 1), np.int32), lens, slots)
    with pytest.raises(InvalidArgumentError):  # wrong dtype
        m.append_slots_batch([a], tables.astype(np.int64), lens, slots)
    ro = tables.copy()
    ro.setflags(write=False)
    with pytest.raises(InvalidArgumentError):
        m.append_slots_batch([a], ro, lens, slots)
    with pytest.raises(InvalidArgumentError):  # not C-contiguous
        m.append_slots_batch([a], np.zeros((2, 8), np.int32)[:, ::2], lens, slots)
    with pytest.raises(InvalidArgumentError):  # byte-swapped
        m.append_slots_batch([a], tables.astype(">i4"), lens, slots)
    with pytest.raises(InvalidArgumentError):  # not an array
        m.append_slots_batch([a], [[0] * 4], lens, slots)
    assert snapshot(m, [a, b], 3, 2) == before


def test_batch_step_accepts_torch_cpu_tensors_zero_copy():
    torch = pytest.importorskip("torch")
    m = pagedkv.BlockSpaceManager(BS, 8, 2)
    s = admit(m, [1, 2, 3])[1][0]
    append(s, 4, 5)
    tables = torch.zeros((1, 4), dtype=torch.int32)
    lens, slots = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    m.append_slots_batch([s], tables.numpy(), lens.numpy(), slots.numpy())
    assert tables[0, :2].tolist() == m.get_block_table(s)
    assert int(lens[0]) == 5


def test_sequences_adopt_the_managers_hasher():
    m = pagedkv.BlockSpaceManager(BS, 16, 4, enable_caching=True, hash_algo="sha256", hash_seed=3)
    _, (s,) = admit(m, PREFIX[:8])
    assert s.data._store.hasher == ("sha256", 3)
    assert (
        s.hash_of_block(0)
        == pagedkv.hash_blocks(PREFIX[:8], BS, hash_algo="sha256", hash_seed=3)[0]
    )


def test_block_mapping_serves_vllm_04_and_05_schedulers(Manager):
    """vLLM 0.4 reads the result as a dict (items / update); vLLM 0.5 extends a list with it,
    which a manager built with ``mapping_format="pairs"`` returns."""
    results = {}
    for fmt in ("dict", "pairs"):
        m = Manager(BS, 16, 16, mapping_format=fmt)
        group, (p,) = admit(m, [1, 2, 3])
        child = p.fork(next(_ids))
        group.add(child)
        m.fork(p, child)
        append(p, 4)
        results[fmt] = (m.append_slots(p), m.append_slots(child), m, group)
    cow, child_cow, m, group = results["dict"]
    as_dict = {}
    for src, dests in cow.items():
        as_dict.setdefault(src, []).extend(dests)
    as_list = []
    as_list.extend(results["pairs"][0])
    assert as_list == [(src, d) for src, ds in as_dict.items() for d in ds] and len(as_list) == 1
    with pytest.raises(TypeError):
        cow[99] = [1]
    assert dict(cow) == as_dict and cow.copy() == as_dict
    assert child_cow == {} and results["pairs"][1] == []
    for s in group.get_seqs():
        s.status = SequenceStatus.RUNNING
    out = m.swap_out(group)
    swapped_in_dict = {}
    swapped_in_dict.update(out)
    assert list(out.items()) == list(swapped_in_dict.items()) and list(out) == list(out.keys())
