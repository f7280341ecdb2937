"""The plain-Python BlockSpaceManager (pagedkv.reference.block_manager) against
docs/block_manager.md, with small duck-typed fake sequences."""

from __future__ import annotations

import enum
import random
from typing import List, Optional

import pytest

from pagedkv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    OutOfBlocksError,
    UnknownSequenceError,
)
from pagedkv.reference.block_manager import AllocStatus, BlockSpaceManager
from pagedkv.reference.hashing import hash_block

BS = 4


class Status(enum.Enum):
    """Any enum with vLLM's member names will do."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()


class FakeSeq:
    """Tokens in a list; full blocks hashed (chained) through the reference hasher."""

    def __init__(self, seq_id, tokens, block_size=BS, lora_int_id=0, cache_salt=None):
        self.seq_id = seq_id
        self.tokens = list(tokens)
        self.block_size = block_size
        self.lora_int_id = lora_int_id
        self.cache_salt = cache_salt
        self.status = Status.WAITING

    def get_len(self) -> int:
        return len(self.tokens)

    def block_token_ids(self, i: int) -> List[int]:
        return self.tokens[i * self.block_size : (i + 1) * self.block_size]

    def hash_of_block(self, i: int) -> int:
        if i < 0 or (i + 1) * self.block_size > len(self.tokens):
            raise ValueError(f"block {i} is not full")
        parent: Optional[int] = None
        for j in range(i + 1):
            parent = hash_block(parent, self.block_token_ids(j), self.lora_int_id, self.cache_salt)
        return parent

    def is_finished(self) -> bool:
        return self.status.name.startswith("FINISHED")

    def append(self, *tokens: int) -> None:
        self.tokens.extend(tokens)

    def fork(self, seq_id: int) -> FakeSeq:
        child = FakeSeq(seq_id, self.tokens, self.block_size, self.lora_int_id, self.cache_salt)
        child.status = self.status
        return child


class FixedHashSeq(FakeSeq):
    """A sequence whose block hashes are chosen by the test (forced collisions)."""

    def __init__(self, seq_id, tokens, hashes, **kw):
        super().__init__(seq_id, tokens, **kw)
        self.hashes = hashes

    def hash_of_block(self, i: int) -> int:
        if i < 0 or (i + 1) * self.block_size > len(self.tokens):
            raise ValueError(f"block {i} is not full")
        return self.hashes[i]


class FakeGroup:
    def __init__(self, request_id, seqs):
        self.request_id = request_id
        self.seqs = list(seqs)

    def get_seqs(self, status=None):
        return [s for s in self.seqs if status is None or s.status == status]


def group(*seqs, request_id="r") -> FakeGroup:
    return FakeGroup(request_id, seqs)


def run(bm: BlockSpaceManager, *seqs) -> None:
    """Allocate a group of WAITING seqs and mark them RUNNING (what the scheduler does)."""
    bm.allocate(group(*seqs))
    for s in seqs:
        s.status = Status.RUNNING


def toks(n: int, start: int = 0) -> List[int]:
    return list(range(start, start + n))


def snapshot(bm: BlockSpaceManager) -> tuple:
    tables = {sid: (list(t.blocks), t.device, t.reserved) for sid, t in bm._tables.items()}
    pools = tuple(
        (
            p.num_free,
            [p.ref_count(b) for b in range(p.num_blocks)],
            [p.block_hash(b) for b in range(p.num_blocks)],
            [p.is_computed(b) for b in range(p.num_blocks)],
            p.eviction_order(),
            list(p._free),
        )
        for p in (bm.gpu, bm.cpu)
    )
    return tables, pools, bm.prefix_cache_stats()


def unchanged(bm, exc, fn, *args):
    before = snapshot(bm)
    with pytest.raises(exc):
        fn(*args)
    assert snapshot(bm) == before


def all_free(bm: BlockSpaceManager) -> bool:
    return (
        bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
        and bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    )


# ---- allocation ----------------------------------------------------------------------------


def test_allocation_order_with_and_without_caching():
    bm = BlockSpaceManager(BS, 8, 2, watermark=0)
    a = FakeSeq(1, toks(10))
    bm.allocate(group(a))
    assert bm.get_block_table(a) == [7, 6, 5]
    cm = BlockSpaceManager(BS, 8, 2, watermark=0, enable_caching=True)
    cm.allocate(group(a))
    assert cm.get_block_table(a) == [0, 1, 2]


def test_allocate_refcounts_k_waiting_and_finished_excluded():
    bm = BlockSpaceManager(BS, 8, 2, watermark=0)
    seqs = [FakeSeq(i, toks(6)) for i in range(4)]
    seqs[3].status = Status.FINISHED_STOPPED
    bm.allocate(group(*seqs))
    table = bm.get_block_table(seqs[0])
    assert all(bm.get_block_table(s) == table for s in seqs[:3])
    assert not bm.has_table(seqs[3])
    assert [bm.ref_count("gpu", b) for b in table] == [3, 3]
    assert bm.get_num_free_gpu_blocks() == 6
    bm.allocate(group(*seqs[:3]))  # tables replaced (vLLM's tests do this); old refs released
    assert bm.get_block_table(seqs[0]) != table and bm.get_num_free_gpu_blocks() == 6
    for s in seqs:
        bm.free(s)
    assert all_free(bm)
    bm.check_invariants()


def test_allocate_without_waiting_seq_is_invalid():
    bm = BlockSpaceManager(BS, 8, 2)
    s = FakeSeq(1, toks(4))
    s.status = Status.RUNNING
    unchanged(bm, InvalidArgumentError, bm.allocate, group(s))
    with pytest.raises(InvalidArgumentError):
        bm.can_allocate(group(s))


def test_can_allocate_ok_later_never_with_watermark():
    bm = BlockSpaceManager(BS, 100, 0, watermark=0.1)  # watermark_blocks = 10
    assert bm.watermark_blocks == 10
    assert bm.can_allocate(group(FakeSeq(1, toks(91 * BS)))) is AllocStatus.NEVER
    assert bm.can_allocate(group(FakeSeq(1, toks(90 * BS)))) is AllocStatus.OK
    bm.allocate(group(FakeSeq(2, toks(50 * BS))))
    assert bm.can_allocate(group(FakeSeq(3, toks(40 * BS)))) is AllocStatus.OK
    assert bm.can_allocate(group(FakeSeq(3, toks(40 * BS + 1)))) is AllocStatus.LATER
    # a window caps the count
    wm = BlockSpaceManager(BS, 10, 0, watermark=0, sliding_window=2 * BS)
    assert wm.can_allocate(group(FakeSeq(1, toks(100 * BS)))) is AllocStatus.OK


def test_allocate_out_of_blocks_changes_nothing():
    bm = BlockSpaceManager(BS, 3, 0, watermark=0)
    run(bm, FakeSeq(1, toks(4)))
    unchanged(bm, OutOfBlocksError, bm.allocate, group(FakeSeq(2, toks(9))))
    cm = BlockSpaceManager(BS, 3, 0, watermark=0, enable_caching=True)
    run(cm, FakeSeq(1, toks(8)))
    # the two shared full blocks need nothing, the partial block needs the last free one
    cm.allocate(group(FakeSeq(2, toks(9))))
    assert cm.get_num_free_gpu_blocks() == 0
    unchanged(cm, OutOfBlocksError, cm.allocate, group(FakeSeq(3, toks(9))))


# ---- appending -----------------------------------------------------------------------------


def test_append_slots_across_block_boundaries_and_several_blocks_at_once():
    bm = BlockSpaceManager(BS, 10, 0, watermark=0)
    s = FakeSeq(1, toks(4))
    run(bm, s)
    assert bm.get_block_table(s) == [9]
    assert bm.append_slots(s) == {}  # nothing new
    s.append(4)
    assert bm.append_slots(s) == {}
    assert bm.get_block_table(s) == [9, 8]
    s.append(5, 6, 7)
    bm.append_slots(s)
    assert bm.get_block_table(s) == [9, 8]
    s.append(*toks(9, 8))  # 17 tokens: three more blocks in one call (vLLM did one)
    bm.append_slots(s)
    assert bm.get_block_table(s) == [9, 8, 7, 6, 5]
    assert bm.reserved_tokens(s) == 17
    bm.free(s)
    assert bm.get_num_free_gpu_blocks() == 10
    # released tail first: the last block of the table comes out first again
    assert bm.gpu.allocate() == 9


def test_append_slots_errors():
    bm = BlockSpaceManager(BS, 3, 2, watermark=0)
    s = FakeSeq(1, toks(4))
    unchanged(bm, UnknownSequenceError, bm.append_slots, s)
    run(bm, s)
    s.append(*toks(9))  # 13 tokens: needs 3 more blocks, 2 free
    unchanged(bm, OutOfBlocksError, bm.append_slots, s)
    assert bm.can_append_slots(group(s)) is False
    unchanged(bm, InvalidArgumentError, bm.append_slots, s, -1)
    s.tokens = s.tokens[:3]  # shorter than what was reserved
    unchanged(bm, InvalidArgumentError, bm.append_slots, s)
    s.tokens = s.tokens[:4]
    bm.swap_out(group(s))
    s.status = Status.SWAPPED
    unchanged(bm, InvalidArgumentError, bm.append_slots, s)  # lives on the CPU


def test_copy_on_write_after_fork():
    bm = BlockSpaceManager(BS, 10, 0, watermark=0)
    parent = FakeSeq(1, toks(6))
    run(bm, parent)
    a, b = bm.get_block_table(parent)
    child = parent.fork(2)
    bm.fork(parent, child)
    assert (bm.ref_count("gpu", a), bm.ref_count("gpu", b)) == (2, 2)
    child.append(100)
    copies = bm.append_slots(child)
    (new,) = copies[b]
    assert copies == {b: [new]}
    assert bm.get_block_table(child) == [a, new]
    assert (bm.ref_count("gpu", a), bm.ref_count("gpu", b), bm.ref_count("gpu", new)) == (2, 1, 1)
    parent.append(200)
    assert bm.append_slots(parent) == {}  # its block is private now
    assert bm.get_block_table(parent) == [a, b]
    bm.check_invariants()
    bm.free(parent)
    bm.free(child)
    assert all_free(bm)


def test_lookahead_reserves_and_is_not_reserved_again():
    bm = BlockSpaceManager(BS, 10, 0, watermark=0)
    s = FakeSeq(1, toks(3))
    run(bm, s)
    s.append(3)
    assert bm.can_append_slots(group(s), num_lookahead_slots=6)
    bm.append_slots(s, num_lookahead_slots=6)  # slots up to 4 + 6 = 10 -> 3 blocks
    assert bm.get_block_table(s) == [9, 8, 7]
    assert bm.reserved_tokens(s) == 4
    s.append(4, 5)
    bm.append_slots(s)
    assert bm.get_block_table(s) == [9, 8, 7]


def test_lookahead_block_shared_after_fork_is_copied():
    bm = BlockSpaceManager(BS, 10, 0, watermark=0)
    s = FakeSeq(1, toks(4))
    run(bm, s)
    bm.append_slots(s, num_lookahead_slots=2)  # reserves block 1 ahead of its tokens
    t = s.fork(2)
    bm.fork(s, t)
    s.append(50)
    ahead = bm.get_block_table(s)[1]
    copies = bm.append_slots(s)
    assert list(copies.keys()) == [ahead]
    assert bm.get_block_table(t)[1] == ahead and bm.ref_count("gpu", ahead) == 1


def test_can_append_slots_one_block_per_running_seq():
    bm = BlockSpaceManager(BS, 4, 0, watermark=0)
    a, b = FakeSeq(1, toks(4)), FakeSeq(2, toks(4))
    run(bm, a)
    run(bm, b)
    assert bm.get_num_free_gpu_blocks() == 2
    assert bm.can_append_slots(group(a, b))  # 2 free >= 2 running
    a.append(1)
    b.append(1)
    bm.append_slots(a)
    assert not bm.can_append_slots(group(a, b))  # 1 free < 2 running (vLLM's rule)


# ---- sliding window ------------------------------------------------------------------------


def window_manager(num_gpu=10, caching=False) -> BlockSpaceManager:
    return BlockSpaceManager(BS, num_gpu, 4, watermark=0, sliding_window=2 * BS)  # W = 2


def test_window_reuses_the_block_that_left_the_window():
    bm = window_manager()
    s = FakeSeq(1, toks(8))
    run(bm, s)
    a, b = bm.get_block_table(s)
    s.append(*toks(9, 8))  # 17 tokens: 5 logical blocks
    assert bm.append_slots(s) == {}
    assert bm.get_block_table(s) == [a, b, a, b, a]
    assert bm.get_num_free_gpu_blocks() == 8
    bm.check_invariants()
    bm.free(s)
    assert all_free(bm)
    # a prompt longer than the window takes W blocks and a periodic table
    t = FakeSeq(2, toks(18))
    bm.allocate(group(t))
    table = bm.get_block_table(t)
    assert len(table) == 5 and len(set(table)) == 2 and table[::2] == [table[0]] * 3
    assert bm.get_num_free_gpu_blocks() == 8


def test_window_copy_on_write_of_a_shared_reused_block():
    bm = window_manager()
    parent = FakeSeq(1, toks(8))
    run(bm, parent)
    a, b = bm.get_block_table(parent)
    child = parent.fork(2)
    bm.fork(parent, child)
    child.append(8)  # block 2 reuses block 0 = a, shared with the parent: copy
    copies = bm.append_slots(child)
    (n,) = copies[a]
    assert bm.get_block_table(child) == [n, b, n]
    assert (bm.ref_count("gpu", a), bm.ref_count("gpu", b), bm.ref_count("gpu", n)) == (1, 2, 1)
    parent.append(9)  # a is private to the parent now: plain reuse
    assert bm.append_slots(parent) == {}
    assert bm.get_block_table(parent) == [a, b, a]
    child.append(*toks(4, 20))  # block 3 reuses b, still shared: copy, periodic table
    copies = bm.append_slots(child)
    (m,) = copies[b]
    assert bm.get_block_table(child) == [n, m, n, m]
    bm.check_invariants()
    bm.free(parent)
    bm.free(child)
    assert all_free(bm)


def test_fork_of_window_tables_does_not_leak():
    bm = window_manager()
    s = FakeSeq(1, toks(22))  # 6 entries, 2 distinct blocks
    run(bm, s)
    kids = []
    for i in range(3):
        k = s.fork(10 + i)
        bm.fork(s, k)
        kids.append(k)
    assert [bm.ref_count("gpu", b) for b in bm.get_block_table(s)[:2]] == [4, 4]
    kids[0].append(1, 2, 3)
    bm.append_slots(kids[0])
    bm.check_invariants()
    for x in [s, *kids]:
        bm.free(x)
    assert all_free(bm)


def test_window_free_releases_the_last_entry_first():
    bm = window_manager(num_gpu=4)
    s = FakeSeq(1, toks(12))  # table [a, b, a]: the last entry is a
    run(bm, s)
    a, b, _ = bm.get_block_table(s)
    bm.free(s)
    assert bm.gpu.allocate() == b  # a was released first, so b sits on top of the stack


def test_window_append_need_counts_blocks_made_in_the_same_call():
    bm = window_manager(num_gpu=3)
    s = FakeSeq(1, toks(2))
    run(bm, s)
    s.append(*toks(30, 2))  # 32 tokens: block 1 new, blocks 2.. reuse
    bm.append_slots(s)
    assert len(bm.get_block_table(s)) == 8 and bm.get_num_free_gpu_blocks() == 1


def test_window_and_caching_cannot_be_combined():
    with pytest.raises(InvalidArgumentError):
        BlockSpaceManager(BS, 4, 4, sliding_window=2 * BS, enable_caching=True)
    with pytest.raises(InvalidArgumentError):
        BlockSpaceManager(BS, 4, 4, sliding_window=BS + 1)


# ---- fork and free -------------------------------------------------------------------------


@pytest.mark.parametrize("caching", [False, True])
def test_strict_refuses_a_second_table_and_other_units(caching):
    """docs/block_manager.md, "Strict mode": what the default mode replaces or counts in the
    sequence's own units, strict mode refuses, changing nothing."""
    strict = BlockSpaceManager(BS, 8, 2, watermark=0, enable_caching=caching, strict=True)
    a, b = FakeSeq(1, toks(6)), FakeSeq(2, toks(5))
    run(strict, a)
    run(strict, b)
    a.status = Status.WAITING
    unchanged(strict, InvalidArgumentError, strict.allocate, group(a))
    unchanged(strict, InvalidArgumentError, strict.fork, b, a)
    a.status = Status.RUNNING
    other = FakeSeq(3, toks(6), block_size=2)
    unchanged(strict, InvalidArgumentError, strict.can_allocate, group(other))
    unchanged(strict, InvalidArgumentError, strict.allocate, group(other))
    other.status = Status.RUNNING
    unchanged(strict, InvalidArgumentError, strict.can_append_slots, group(a, other))
    unchanged(strict, InvalidArgumentError, strict.append_slots, other)
    default = BlockSpaceManager(BS, 8, 2, watermark=0, enable_caching=caching)
    run(default, FakeSeq(1, toks(6)))
    run(default, FakeSeq(2, toks(5)))
    run(default, FakeSeq(1, toks(6)))  # replaces seq 1's table
    default.fork(FakeSeq(2, []), FakeSeq(1, []))  # replaces it again
    run(default, FakeSeq(3, toks(6), block_size=2))
    assert len(default.get_block_table(FakeSeq(3, []))) == 3


def test_free_unknown_is_noop_unless_strict_fork_unknown_raises_and_double_free():
    bm = BlockSpaceManager(BS, 4, 0)
    s = FakeSeq(1, toks(4))
    bm.free(s)  # no table: no-op
    unchanged(bm, UnknownSequenceError, bm.fork, s, FakeSeq(2, []))  # as vLLM's KeyError
    assert not bm.has_table(FakeSeq(2, []))
    run(bm, s)
    bm.free(s)
    bm.free(s)  # a second free is a no-op too
    assert all_free(bm)
    strict = BlockSpaceManager(BS, 4, 0, strict=True)
    unchanged(strict, UnknownSequenceError, strict.free, s)
    unchanged(strict, UnknownSequenceError, strict.fork, s, FakeSeq(2, []))
    run(strict, FakeSeq(1, toks(4)))
    strict.free(s)
    unchanged(strict, KeyError, strict.free, s)  # UnknownSequenceError is a KeyError
    # below zero in the pool is always an error
    b = strict.gpu.allocate()
    strict.gpu.free(b)
    with pytest.raises(DoubleFreeError):
        strict.gpu.free(b)


def test_fork_errors():
    bm = BlockSpaceManager(BS, 4, 0)
    a, b = FakeSeq(1, toks(4)), FakeSeq(2, toks(4))
    run(bm, a)
    run(bm, b)
    unchanged(bm, InvalidArgumentError, bm.fork, a, a)
    bm.fork(a, b)  # a child with a table: its table is replaced, old references released
    assert bm.get_block_table(b) == bm.get_block_table(a)
    assert bm.get_num_free_gpu_blocks() == 3
    bm.check_invariants()


def test_reset_frees_every_table_in_creation_order():
    bm = BlockSpaceManager(BS, 6, 0, watermark=0)
    a, b = FakeSeq(1, toks(4)), FakeSeq(2, toks(4))
    run(bm, a)
    run(bm, b)
    (ba,), (bb,) = bm.get_block_table(a), bm.get_block_table(b)
    bm.reset()
    assert all_free(bm) and not bm.has_table(a)
    assert [bm.gpu.allocate(), bm.gpu.allocate()] == [bb, ba]  # b's table was freed last


# ---- swapping ------------------------------------------------------------------------------


def test_swap_round_trip_keeps_sharing_between_forked_seqs():
    bm = BlockSpaceManager(BS, 10, 10, watermark=0)
    parent = FakeSeq(1, toks(6))
    run(bm, parent)
    child = parent.fork(2)
    bm.fork(parent, child)
    child.append(7, 8, 9)  # child's last block copied; block 0 shared
    bm.append_slots(child)
    g = group(parent, child)
    shared = bm.get_block_table(parent)[0]
    assert bm.can_swap_out(g)
    out = bm.swap_out(g)
    assert len(out) == 4 and shared in out  # 4 distinct blocks, the shared one moved once
    assert bm.ref_count("cpu", out[shared]) == 2
    assert bm.get_block_table(parent)[0] == bm.get_block_table(child)[0] == out[shared]
    assert bm.table_device(parent) == "cpu"
    assert bm.get_num_free_gpu_blocks() == 10 and bm.get_num_free_cpu_blocks() == 6
    for s in (parent, child):
        s.status = Status.SWAPPED
    assert bm.can_swap_in(g) is AllocStatus.OK
    back = bm.swap_in(g)
    assert set(back.keys()) == set(out.values())
    assert bm.ref_count("gpu", back[out[shared]]) == 2
    assert bm.get_block_table(parent)[0] == bm.get_block_table(child)[0]
    bm.check_invariants()
    bm.free(parent)
    bm.free(child)
    assert all_free(bm)


def test_swap_errors_leave_state_unchanged():
    bm = BlockSpaceManager(BS, 10, 2, watermark=0)
    a = FakeSeq(1, toks(12))  # 3 blocks, CPU has 2
    run(bm, a)
    g = group(a)
    assert not bm.can_swap_out(g)
    unchanged(bm, OutOfBlocksError, bm.swap_out, g)
    a.status = Status.SWAPPED
    unchanged(bm, InvalidArgumentError, bm.swap_in, g)  # the table is on the GPU
    ghost = FakeSeq(9, toks(4))
    ghost.status = Status.RUNNING
    unchanged(bm, UnknownSequenceError, bm.swap_out, group(ghost))
    with pytest.raises(UnknownSequenceError):
        bm.can_swap_out(group(ghost))


def test_can_swap_in_counts_lookahead_and_watermark():
    bm = BlockSpaceManager(BS, 6, 6, watermark=0)
    s = FakeSeq(1, toks(12))
    run(bm, s)
    bm.swap_out(group(s))
    s.status = Status.SWAPPED
    assert bm.can_swap_in(group(s)) is AllocStatus.OK  # 3 + 1
    assert bm.can_swap_in(group(s), num_lookahead_slots=12) is AllocStatus.OK  # 3 + 3
    assert bm.can_swap_in(group(s), num_lookahead_slots=13) is AllocStatus.NEVER  # 3 + 4
    filler = FakeSeq(2, toks(12))
    run(bm, filler)
    assert bm.can_swap_in(group(s)) is AllocStatus.LATER


def test_swap_with_window_moves_distinct_blocks_once():
    bm = window_manager()
    s = FakeSeq(1, toks(20))  # [a, b, a, b, a]
    run(bm, s)
    out = bm.swap_out(group(s))
    assert len(out) == 2
    t = bm.get_block_table(s)
    assert t[0::2] == [t[0]] * 3 and t[1::2] == [t[1]] * 2  # still periodic
    assert set(t) == set(out.values()) and bm.ref_count("cpu", t[0]) == 1
    assert bm.get_num_free_gpu_blocks() == 10 and bm.get_num_free_cpu_blocks() == 2
    bm.free(s)
    assert all_free(bm)


# ---- prefix caching ------------------------------------------------------------------------


def caching_manager(num_gpu=16, num_cpu=8) -> BlockSpaceManager:
    return BlockSpaceManager(BS, num_gpu, num_cpu, watermark=0, enable_caching=True)


def test_common_prefix_shares_exactly_its_full_blocks():
    bm = caching_manager()
    prefix = toks(10)  # 2 full blocks + 2 tokens
    a = FakeSeq(1, prefix + [500, 501, 502, 503])
    b = FakeSeq(2, prefix + [600, 601, 602, 603, 604])
    run(bm, a)
    run(bm, b)
    ta, tb = bm.get_block_table(a), bm.get_block_table(b)
    assert ta[:2] == tb[:2] and set(ta[2:]).isdisjoint(tb[2:])
    assert [bm.ref_count("gpu", x) for x in ta] == [2, 2, 1, 1][: len(ta)]
    assert bm.prefix_cache_stats() == (3 + 3, 2)  # full prompt blocks looked up; hits
    bm.free(a)
    bm.free(b)
    assert all_free(bm)
    bm.check_invariants()


def test_partial_blocks_are_never_shared():
    bm = caching_manager()
    a, b = FakeSeq(1, toks(6)), FakeSeq(2, toks(6))
    run(bm, a)
    run(bm, b)
    ta, tb = bm.get_block_table(a), bm.get_block_table(b)
    assert ta[0] == tb[0] and ta[1] != tb[1]
    assert bm.gpu.block_hash(ta[1]) is None
    small = caching_manager()  # block_size larger than the prompt
    c, d = FakeSeq(1, toks(3)), FakeSeq(2, toks(3))
    run(small, c)
    run(small, d)
    assert small.get_block_table(c) != small.get_block_table(d)


def test_freed_prefix_is_evictable_then_revived():
    bm = caching_manager(num_gpu=6)
    a = FakeSeq(1, toks(9))
    run(bm, a)
    table = bm.get_block_table(a)
    bm.free(a)
    assert bm.get_num_free_gpu_blocks() == 6 and bm.num_evictable_blocks() == 2
    b = FakeSeq(2, toks(8) + [77])
    run(bm, b)
    assert bm.get_block_table(b)[:2] == table[:2]
    assert bm.num_evictable_blocks() == 0
    assert [bm.ref_count("gpu", x) for x in table[:2]] == [1, 1]
    # the pre-check counts a revived block as taken from the free count
    full = caching_manager(num_gpu=3)
    run(full, FakeSeq(1, toks(8)))
    full.free(FakeSeq(1, []))
    run(full, FakeSeq(2, [9] * 4))  # takes the one FREE block
    unchanged(full, OutOfBlocksError, full.allocate, group(FakeSeq(3, toks(9))))


def test_lru_eviction_under_pressure():
    bm = caching_manager(num_gpu=4)
    a, b = FakeSeq(1, toks(8)), FakeSeq(2, toks(8, 100))
    run(bm, a)
    run(bm, b)
    (a0, a1), (b0, b1) = bm.get_block_table(a), bm.get_block_table(b)
    bm.access_all_blocks_in_seq(a, 2.0)
    bm.access_all_blocks_in_seq(b, 1.0)
    bm.free(a)
    bm.free(b)
    # b accessed first; within a sequence the tail (more hashed tokens) goes first
    assert bm.eviction_order() == [b1, b0, a1, a0]
    c = FakeSeq(3, toks(8, 200))
    run(bm, c)
    assert bm.get_block_table(c) == [b1, b0]
    assert bm.gpu.evictions == 2
    # a's prefix is still cached
    d = FakeSeq(4, toks(8))
    run(bm, d)
    assert bm.get_block_table(d) == [a0, a1]


def test_equal_keys_evict_first_freed_first():
    bm = caching_manager(num_gpu=2)
    a, b = FakeSeq(1, toks(4)), FakeSeq(2, toks(4, 50))
    run(bm, a)
    run(bm, b)
    (ba,), (bb,) = bm.get_block_table(a), bm.get_block_table(b)
    bm.free(b)
    bm.free(a)
    assert bm.eviction_order() == [bb, ba]
    c = FakeSeq(3, toks(4, 90))
    run(bm, c)
    assert bm.get_block_table(c) == [bb]


def test_forced_hash_collision_never_shares_other_contents():
    bm = caching_manager()
    x = FixedHashSeq(1, toks(8), [10, 20])
    run(bm, x)
    # same hash for block 0, other tokens
    y = FixedHashSeq(2, toks(8, 100), [10, 21])
    run(bm, y)
    assert set(bm.get_block_table(x)).isdisjoint(bm.get_block_table(y))
    # same hash and tokens for block 1, other parent hash
    z = FixedHashSeq(3, toks(4, 300) + toks(4, 4), [11, 20])
    run(bm, z)
    assert bm.get_block_table(z)[1] != bm.get_block_table(x)[1]
    # same everything but the LoRA id, or the salt
    w = FixedHashSeq(4, toks(8), [10, 20], lora_int_id=3)
    v = FixedHashSeq(5, toks(8), [10, 20], cache_salt="tenant")
    run(bm, w)
    run(bm, v)
    tables = [bm.get_block_table(s) for s in (x, w, v)]
    assert len({t[0] for t in tables}) == 3
    # a constant hash: nothing is shared but true equals
    c1 = FixedHashSeq(6, toks(12, 900), [7, 7, 7])
    c2 = FixedHashSeq(7, toks(12, 950), [7, 7, 7])
    run(bm, c1)
    run(bm, c2)
    assert set(bm.get_block_table(c1)).isdisjoint(bm.get_block_table(c2))
    u = FixedHashSeq(8, toks(8), [10, 20])  # the genuine twin of x shares both blocks
    run(bm, u)
    assert bm.get_block_table(u) == bm.get_block_table(x)
    bm.check_invariants()
    for s in (x, y, z, w, v, c1, c2, u):
        bm.free(s)
    assert all_free(bm)


def test_promotion_dedupes_identical_forks():
    bm = caching_manager()
    parent = FakeSeq(1, toks(6))
    run(bm, parent)
    b0, b1 = bm.get_block_table(parent)
    child = parent.fork(2)
    bm.fork(parent, child)
    parent.append(6, 7)
    copies = bm.append_slots(parent)  # shared partial block: copy, then cache the copy
    (n,) = copies[b1]
    assert bm.gpu.block_hash(n) is not None
    child.append(6, 7)  # the same tokens: the child's now-private block is a duplicate
    assert bm.append_slots(child) == {}
    assert bm.get_block_table(child) == bm.get_block_table(parent) == [b0, n]
    assert bm.ref_count("gpu", n) == 2 and bm.ref_count("gpu", b1) == 0
    assert bm.gpu._free[-1] == b1  # returned to the FREE stack
    child.append(1, 2)  # both write the next block: new private blocks
    bm.append_slots(child)
    bm.check_invariants()


def test_cow_of_a_full_block_switches_to_an_identical_cached_block():
    bm = caching_manager()
    parent = FakeSeq(1, toks(6))
    run(bm, parent)
    twin = FakeSeq(3, toks(8))  # caches block 1 with tokens 4..7
    run(bm, twin)
    cached = bm.get_block_table(twin)[1]
    child = parent.fork(2)
    bm.fork(parent, child)
    shared = bm.get_block_table(parent)[1]
    parent.append(6, 7)
    assert bm.append_slots(parent) == {}  # no copy: it takes the cached block
    assert bm.get_block_table(parent)[1] == cached
    assert bm.ref_count("gpu", shared) == 1 and bm.ref_count("gpu", cached) == 2


def test_new_full_block_hits_the_cache_on_append():
    bm = caching_manager()
    a = FakeSeq(1, toks(8))
    run(bm, a)
    b = FakeSeq(2, toks(3))
    run(bm, b)
    b.append(*toks(5, 3))  # fills block 0 (promote: dedupe) and block 1 (new: hit)
    bm.append_slots(b)
    assert bm.get_block_table(b) == bm.get_block_table(a)
    assert bm.prefix_cache_stats() == (2, 0)  # only allocate's lookups count
    bm.check_invariants()


def test_blocks_filled_by_one_append_are_cached():
    bm = caching_manager()
    a = FakeSeq(1, toks(2))
    run(bm, a)
    a.append(*toks(8, 2))  # fills block 0 (promoted) and block 1 (new, registered)
    bm.append_slots(a)
    t = bm.get_block_table(a)
    assert [bm.block_info("gpu", b)["num_hashed_tokens"] for b in t] == [4, 8, 0]
    b = FakeSeq(2, toks(9))
    run(bm, b)
    assert bm.get_block_table(b)[:2] == t[:2]
    views = bm.get_physical_blocks(b)
    assert [v.block_number for v in views] == bm.get_block_table(b)
    assert [v.ref_count for v in views] == [2, 2, 1] and views[0].block_hash is not None


def test_swap_with_caching_reuses_cached_cpu_blocks():
    bm = caching_manager(num_gpu=8, num_cpu=8)
    a = FakeSeq(1, toks(9))
    run(bm, a)
    out = bm.swap_out(group(a))
    assert bm.num_cached_blocks("cpu") == 2  # the two full blocks keep their keys
    a.status = Status.SWAPPED
    back = bm.swap_in(group(a))
    assert bm.get_block_table(a)[:2] == [back[out[x]] for x in list(out.keys())[:2]]
    b = FakeSeq(2, toks(9))
    b.status = Status.RUNNING
    bm.fork(a, b)
    bm.swap_out(group(a, b))
    assert bm.num_cached_blocks("cpu") == 2  # the CPU cache hits: nothing new cached
    bm.free(a)
    bm.free(b)
    assert all_free(bm)
    bm.check_invariants()


# ---- computed blocks -----------------------------------------------------------------------


def test_compute_full_blocks_off_by_one_and_get_all_computed():
    bm = caching_manager()
    s = FakeSeq(1, toks(18))  # 4 full blocks + 2 tokens
    run(bm, s)
    t = bm.get_block_table(s)
    assert bm.get_all_computed_blocks(s) == []
    bm.compute_full_blocks_in_seq(s)  # m = 3: blocks 2, 1, 0; the last full block (3) not
    assert [bm.gpu.is_computed(b) for b in t] == [True, True, True, False, False]
    assert bm.get_all_computed_blocks(s) == t[:3]
    e = FakeSeq(2, toks(16, 500))  # exactly full: table[:-1] excludes the last entry
    run(bm, e)
    bm.mark_blocks_as_computed(group(e))
    te = bm.get_block_table(e)
    assert bm.get_all_computed_blocks(e) == te[:3]
    for b in te[:3]:
        bm.gpu.set_computed(b, False)
    bm.gpu.set_computed(te[1], True)
    bm.compute_full_blocks_in_seq(e)  # walks back from block 2 and stops at block 1
    assert [bm.gpu.is_computed(b) for b in te] == [False, True, True, False]
    assert bm.get_all_computed_blocks(e) == []  # the run must start at block 0
    assert bm.get_all_computed_blocks(FakeSeq(99, [])) == []
    short = FakeSeq(3, toks(3))
    run(bm, short)
    bm.compute_full_blocks_in_seq(short)  # m = -1
    bm.compute_full_blocks_in_seq(FakeSeq(98, toks(40)))  # no table


def test_get_common_computed_block_ids():
    bm = caching_manager(num_gpu=32)
    p = toks(12)
    a, b = FakeSeq(1, p + toks(8, 100)), FakeSeq(2, p + toks(8, 200))
    c = FakeSeq(3, toks(2))
    run(bm, a)
    run(bm, b)
    run(bm, c)
    bm.mark_blocks_as_computed(group(a, b, c))
    ca, cb = bm.get_all_computed_blocks(a), bm.get_all_computed_blocks(b)
    assert len(ca) == len(cb) == 4 and ca[:3] == cb[:3] and ca[3] != cb[3]
    assert bm.get_common_computed_block_ids([a, b]) == ca[:3]
    assert bm.get_common_computed_block_ids([a, c, b]) == ca[:3]  # empty lists ignored
    assert bm.get_common_computed_block_ids([c]) == []
    d = FakeSeq(4, toks(4, 700) + toks(8, 800) + [1])
    run(bm, d)
    bm.mark_blocks_as_computed(group(d))
    assert bm.get_common_computed_block_ids([a, d]) == []
    plain = BlockSpaceManager(BS, 8, 0, watermark=0)
    x = FakeSeq(1, toks(13))
    run(plain, x)
    plain.mark_blocks_as_computed(group(x))  # no-op without caching
    assert plain.get_all_computed_blocks(x) == []
    plain.compute_full_blocks_in_seq(x)  # vLLM marks even without caching
    assert len(plain.get_all_computed_blocks(x)) == 2
    assert plain.get_common_computed_block_ids([x]) == []


def test_access_all_blocks_requires_a_table_with_caching_only():
    bm = caching_manager()
    unchanged(bm, UnknownSequenceError, bm.access_all_blocks_in_seq, FakeSeq(1, []), 1.0)
    s = FakeSeq(1, toks(5))
    run(bm, s)
    unchanged(bm, InvalidArgumentError, bm.access_all_blocks_in_seq, s, float("nan"))
    bm.access_all_blocks_in_seq(s, 3.0)
    assert [bm.block_info("gpu", b)["last_accessed"] for b in bm.get_block_table(s)] == [3.0] * 2
    plain = BlockSpaceManager(BS, 4, 0)
    plain.access_all_blocks_in_seq(FakeSeq(1, []), 1.0)  # nothing without caching


# ---- randomized invariants -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["plain", "caching", "window"])
def test_random_operations_keep_invariants_and_free_everything(mode):
    rng = random.Random({"plain": 1, "caching": 2, "window": 3}[mode])
    bm = BlockSpaceManager(
        BS,
        24,
        16,
        watermark=0,
        sliding_window=3 * BS if mode == "window" else None,
        enable_caching=mode == "caching",
    )
    seqs: dict = {}
    next_id = 0
    clock = 0.0
    vocab = [1, 2] if mode == "caching" else list(range(50))  # few tokens: many cache hits
    for _ in range(600):
        op = rng.randrange(8)
        live = [s for s in seqs.values() if bm.has_table(s)]
        s = rng.choice(live) if live else None
        before = snapshot(bm)
        try:
            if op == 0 or s is None:
                next_id += 1
                new = FakeSeq(next_id, [rng.choice(vocab) for _ in range(rng.randrange(1, 14))])
                seqs[next_id] = new
                bm.allocate(group(new))
                new.status = Status.RUNNING
            elif op == 1:
                if s.status == Status.RUNNING:
                    s.append(*[rng.choice(vocab) for _ in range(rng.randrange(1, 6))])
                    bm.append_slots(s, rng.choice([0, 0, 3]))
            elif op == 2:
                next_id += 1
                child = s.fork(next_id)
                seqs[next_id] = child
                bm.fork(s, child)
            elif op == 3:
                bm.free(s)
            elif op == 4:
                if s.status == Status.RUNNING:
                    bm.swap_out(group(s))
                    s.status = Status.SWAPPED
                else:
                    bm.swap_in(group(s))
                    s.status = Status.RUNNING
            elif op == 5:
                clock += 1.0
                bm.access_all_blocks_in_seq(s, clock)
            elif op == 6:
                bm.mark_blocks_as_computed(group(s))
                bm.get_common_computed_block_ids(live)
            else:
                bm.can_allocate(group(FakeSeq(0, toks(rng.randrange(40)))))
                bm.can_append_slots(group(*[x for x in live if x.status == Status.RUNNING]))
        except OutOfBlocksError:
            assert snapshot(bm) == before
            if op == 1:
                s.tokens = s.tokens[: bm.reserved_tokens(s)]  # undo the scheduler's append
        bm.check_invariants()
    for s in seqs.values():
        bm.free(s)
    assert all_free(bm)
    bm.check_invariants()


# ---- the real Sequence family --------------------------------------------------------------


def test_smoke_with_real_sequences():
    seqmod = pytest.importorskip("pagedkv.sequence")
    types = pytest.importorskip("pagedkv.types")
    bm = BlockSpaceManager(BS, 16, 8, watermark=0, enable_caching=True)
    prompt = toks(10)
    a = seqmod.Sequence(1, "a", prompt, BS)
    b = seqmod.Sequence(2, "b", prompt, BS)
    ga = seqmod.SequenceGroup("ra", [a], types.SamplingParams(n=1), 0.0)
    gb = seqmod.SequenceGroup("rb", [b], types.SamplingParams(n=1), 0.0)
    assert bm.can_allocate(ga) is AllocStatus.OK
    bm.allocate(ga)
    bm.allocate(gb)
    assert bm.get_block_table(a)[:2] == bm.get_block_table(b)[:2]
    a.status = seqmod.SequenceStatus.RUNNING
    a.append_token_id(7, {7: types.Logprob(0.0)})
    a.append_token_id(8, {8: types.Logprob(0.0)})
    bm.append_slots(a)
    assert len(bm.get_block_table(a)) == 3
    c = a.fork(3)
    bm.fork(a, c)
    assert bm.swap_out(ga)
    bm.free(a)
    bm.free(b)
    bm.free(c)
    assert all_free(bm)
    bm.check_invariants()
