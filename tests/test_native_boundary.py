"""The native boundary under hostile or careless Python: fake arrays, aliased and resized
buffers, re-entrant and concurrent calls, reference cycles, and refused calls that must change
nothing. Each test here reproduces a way ordinary Python code could once corrupt memory or state.
"""

from __future__ import annotations

import gc
import sys
import sysconfig
import threading
import tracemalloc
import weakref

import numpy as np
import pytest

import pagedkv
from pagedkv import (
    BlockPool,
    BlockSpaceManager,
    Logprob,
    SamplingParams,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from pagedkv.errors import (
    ArgumentTypeError,
    InUseError,
    InvalidArgumentError,
    PagedKVError,
    UnknownSequenceError,
)

BS = 4


class ForeignSeq:
    """A sequence of another type (the manager builds and syncs a token store for it). `hook`
    runs inside `get_len`, which the manager calls on every use: arbitrary Python in the middle
    of a manager call."""

    def __init__(self, seq_id, tokens, status=SequenceStatus.WAITING):
        self.seq_id = seq_id
        self.tokens = list(tokens)
        self.prompt_len = len(self.tokens)
        self.status = status
        self.lora_int_id = 0
        self.hook = None
        self.engine = None

    def get_token_ids(self):
        return list(self.tokens)

    def get_len(self):
        if self.hook is not None:
            self.hook()
        return len(self.tokens)

    def get_prompt_len(self):
        return self.prompt_len

    def get_output_token_ids(self):
        return self.tokens[self.prompt_len :]


class Group:
    def __init__(self, *seqs):
        self.seqs_dict = {s.seq_id: s for s in seqs}


def running(manager, seq):
    manager.allocate(Group(seq) if isinstance(seq, ForeignSeq) else _group(seq))
    seq.status = SequenceStatus.RUNNING
    return seq


def _group(seq):
    return SequenceGroup(str(seq.seq_id), [seq], SamplingParams(), 0.0)


def outputs(rows=2, cols=4):
    return (
        np.zeros((rows, cols), np.int32),
        np.zeros(rows, np.int32),
        np.zeros(rows, np.int32),
    )


def snapshot(manager, seqs):
    return (
        manager.get_num_free_gpu_blocks(),
        [manager.get_block_table(s) for s in seqs],
    )


# ---- 1. only real numpy arrays ------------------------------------------------------------


class FakeArray:
    """Claims to be an int32 array at a chosen address."""

    def __init__(self, address, n=2):
        self.__array_interface__ = {
            "data": (address, False),
            "shape": (n,),
            "typestr": "<i4",
            "version": 3,
        }


def test_fake_array_interface_is_refused_not_written():
    m = BlockSpaceManager(BS, 8, 0)
    seq = running(m, Sequence(1, "", [1, 2, 3], BS))
    tables, cl, _ = outputs()
    before = snapshot(m, [seq])
    with pytest.raises(ArgumentTypeError, match="numpy int32 array"):
        m.append_slots_batch([seq], tables, cl, FakeArray(0x10))
    with pytest.raises(ArgumentTypeError):
        m.fill_block_tables([seq], FakeArray(0x10))
    assert snapshot(m, [seq]) == before
    m.check_invariants()


def test_fake_array_interface_is_not_read_as_tokens():
    # not iterable and not an ndarray: a type error, not a read of address 0x10
    with pytest.raises(ArgumentTypeError):
        pagedkv.TokenSeq(BS, FakeArray(0x10))
    with pytest.raises(ArgumentTypeError):
        pagedkv.hash_blocks(FakeArray(0x10), BS)


def test_unaligned_and_fortran_outputs_are_refused():
    m = BlockSpaceManager(BS, 8, 0)
    seq = running(m, Sequence(1, "", [1, 2, 3], BS))
    raw = np.zeros(64, np.uint8)
    unaligned = raw[1:9].view(np.int32)
    assert not unaligned.flags.aligned
    tables, cl, sm = outputs()
    with pytest.raises(InvalidArgumentError, match="aligned"):
        m.append_slots_batch([seq], tables, unaligned, sm)
    with pytest.raises(InvalidArgumentError, match="C-contiguous"):
        m.fill_block_tables([seq], np.zeros((2, 4), np.int32, order="F"))
    with pytest.raises(InvalidArgumentError, match="read-only"):
        ro = np.zeros(2, np.int32)
        ro.flags.writeable = False
        m.append_slots_batch([seq], tables, cl, ro)
    assert m.get_block_table(seq) == [7] and (tables == 0).all()


def test_empty_outputs_are_fine():
    m = BlockSpaceManager(BS, 8, 0)
    empty2, cl, sm = np.zeros((0, 0), np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32)
    assert m.append_slots_batch([], empty2, cl, sm) == {}
    m.fill_block_tables([], empty2, context_lens=cl)


def test_token_arrays_of_any_stride_are_read():
    t = np.arange(20, dtype=np.int64)[::2]
    assert pagedkv.TokenSeq(BS, t).tokens() == list(range(0, 20, 2))
    raw = np.zeros(44, np.uint8)
    unaligned = raw[1:41].view(np.int32)
    unaligned[:] = np.arange(10)
    assert pagedkv.TokenSeq(BS, unaligned).tokens() == list(range(10))


# ---- 2. aliased outputs -------------------------------------------------------------------


def test_same_array_twice_is_refused_before_any_change():
    m = BlockSpaceManager(BS, 8, 0)
    seq = running(m, Sequence(1, "", [1, 2, 3, 4], BS))
    seq.append_token_id(5, {5: Logprob(0.0)})  # the step needs a new block
    tables, cl, _ = outputs()
    before = snapshot(m, [seq])
    with pytest.raises(InvalidArgumentError, match="overlaps"):
        m.append_slots_batch([seq], tables, cl, cl)
    assert snapshot(m, [seq]) == before, "refused before the slot was reserved"
    assert (cl == 0).all() and (tables == 0).all()


def test_overlapping_views_of_one_allocation_are_refused():
    m = BlockSpaceManager(BS, 8, 0)
    seq = running(m, Sequence(1, "", [1, 2, 3], BS))
    buf = np.zeros(32, np.int32)
    tables = buf[:8].reshape(2, 4)
    with pytest.raises(InvalidArgumentError, match="overlaps"):
        m.append_slots_batch([seq], tables, buf[6:8], buf[16:18])
    with pytest.raises(InvalidArgumentError, match="overlaps"):
        m.fill_block_tables([seq], tables, context_lens=buf[7:9])
    assert (buf == 0).all()
    # disjoint views of one allocation are fine
    m.append_slots_batch([seq], tables, buf[8:10], buf[10:12])
    assert list(buf[:4]) == [7, 0, 0, 0] and buf[8] == 3 and buf[10] == 7 * BS + 2


# ---- 3. views taken after every Python callback -------------------------------------------


def test_buffer_resized_by_a_callback_is_seen_resized():
    m = BlockSpaceManager(BS, 8, 0)
    seq = running(m, ForeignSeq(1, [1, 2, 3]))
    tables, cl, sm = outputs()

    def shrink():
        # frees the old data buffer; a pointer taken before this would dangle
        sm.resize(0, refcheck=False)

    seq.hook = shrink
    before = snapshot(m, [seq])
    with pytest.raises(InvalidArgumentError, match="slot_mapping has 0 entries"):
        m.append_slots_batch([seq], tables, cl, sm)
    assert snapshot(m, [seq]) == before
    m.check_invariants()


# ---- 4. int32 slots -----------------------------------------------------------------------


def test_pool_with_slots_beyond_int32_is_refused():
    with pytest.raises(InvalidArgumentError, match="int32"):
        BlockSpaceManager(2**20, 2**11 + 1, 0)
    with pytest.raises(InvalidArgumentError, match="int32"):
        BlockPool(2**11 + 1, 2**20, device="gpu")
    BlockPool(2**11 + 1, 2**20, device="cpu")  # CPU blocks have no slot numbers


def test_largest_pool_writes_positive_slots():
    m = BlockSpaceManager(2**20, 2**11, 0)  # exactly 2**31 slots
    seq = running(m, Sequence(1, "", [1], 2**20))
    tables, cl, sm = outputs(1, 1)
    m.fill_block_tables([seq], tables)
    m.append_slots_batch([seq], tables, cl, sm)
    assert tables[0, 0] == 2**11 - 1 and sm[0] == (2**11 - 1) * 2**20 > 0


# ---- 5. free-threaded Python --------------------------------------------------------------


@pytest.mark.skipif(
    not sysconfig.get_config_var("Py_GIL_DISABLED"),
    reason="needs a free-threaded (3.13t+) interpreter",
)
def test_module_keeps_the_gil_on_free_threaded_python():
    assert sys._is_gil_enabled(), "pagedkv._native declares gil_used: importing it enables the GIL"


# ---- 6. concurrent and re-entrant calls ---------------------------------------------------


def test_reentrant_call_from_a_callback_raises_in_use():
    m = BlockSpaceManager(BS, 8, 0)
    seq = running(m, ForeignSeq(1, [1, 2, 3]))
    seen = []

    def reenter():
        try:
            m.get_num_free_gpu_blocks()
        except Exception as e:  # noqa: BLE001 - the test inspects it
            seen.append(e)

    seq.hook = reenter
    seq.tokens.append(4)
    m.append_slots(seq)
    assert len(seen) == 1 and isinstance(seen[0], InUseError)
    assert isinstance(seen[0], RuntimeError) and isinstance(seen[0], PagedKVError)
    seq.hook = None
    assert m.get_num_free_gpu_blocks() == 7
    m.check_invariants()


def test_second_thread_during_a_callback_raises_in_use():
    m = BlockSpaceManager(BS, 8, 0)
    seq = running(m, ForeignSeq(1, [1, 2, 3]))
    seen = []

    def other_thread():
        try:
            seen.append(m.get_num_free_gpu_blocks())
        except Exception as e:  # noqa: BLE001
            seen.append(e)

    def run_thread():
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()

    seq.hook = run_thread
    m.append_slots(seq)
    assert len(seen) == 1 and isinstance(seen[0], InUseError), seen
    seq.hook = None
    other_thread()
    assert seen[-1] == 7


def test_pool_reads_arguments_before_taking_the_pool():
    pool = BlockPool(4, BS, enable_caching=False)
    b = pool.allocate()

    class Index:
        def __index__(self):
            assert pool.num_free == 3  # a callback may use the pool
            return b

    pool.free(Index())
    assert pool.num_free == 4
    pool.check_invariants()


def test_token_store_reads_arguments_before_borrowing():
    store = pagedkv.TokenSeq(BS, [1, 2])

    def tokens():
        yield len(store)  # the store is used while extend converts its argument
        yield 5

    store.extend(tokens())
    assert store.tokens() == [1, 2, 2, 5]

    class Index:
        def __index__(self):
            return len(store)

    store.append(Index())
    assert store.tokens() == [1, 2, 2, 5, 4]
    hasher = pagedkv.BlockHasher(2)

    def fed():
        yield hasher.num_pending_tokens
        yield 7

    assert len(hasher.feed(fed())) == 1


def test_threads_hammering_one_manager_get_in_use_or_succeed():
    m = BlockSpaceManager(BS, 64, 0)
    seqs = [running(m, ForeignSeq(i, [1, 2, 3])) for i in range(8)]
    errors = []

    def worker(k):
        for i in range(300):
            s = seqs[(k + i) % len(seqs)]
            try:
                m.get_block_table(s)
                m.get_num_free_gpu_blocks()
            except InUseError:
                pass
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    m.check_invariants()


# ---- 7. reference cycles through the manager ----------------------------------------------


class Engine:
    def __init__(self, manager):
        self.manager = manager


@pytest.mark.parametrize("foreign", [False, True])
def test_cycle_seq_engine_manager_is_collected(foreign):
    m = BlockSpaceManager(BS, 8, 0)
    if foreign:
        seq = ForeignSeq(1, [1, 2, 3, 4, 5])
    else:

        class MySeq(Sequence):
            pass

        seq = MySeq(1, "", [1, 2, 3, 4, 5], BS)
    running(m, seq)
    m.get_block_table(seq)  # caches a table list too
    seq.engine = Engine(m)
    dead_seq, dead_manager = weakref.ref(seq), weakref.ref(m)
    del seq, m
    gc.collect()
    assert dead_seq() is None and dead_manager() is None


# ---- 8. refused calls change nothing ------------------------------------------------------


def test_register_with_a_bad_parent_caches_nothing():
    pool = BlockPool(4, BS, enable_caching=True)
    b = pool.allocate()
    for parent in (b, 7):
        with pytest.raises(InvalidArgumentError):
            pool.register(b, 1234, [1, 2, 3, 4], parent_block=parent)
        assert pool.num_cached == 0 and pool.block_hash(b) is None
        pool.check_invariants()
    assert pool.register(b, 1234, [1, 2, 3, 4])
    assert pool.num_cached == 1


def test_refused_batch_does_not_rehash_the_sequence():
    saved = pagedkv.get_default_hasher()
    try:
        pagedkv.set_default_hasher("sha256", 3)
        stranger = Sequence(9, "", [1, 2, 3, 4, 5], BS)
    finally:
        pagedkv.set_default_hasher(*saved)
    m = BlockSpaceManager(BS, 8, 0, hash_algo="xxh3", hash_seed=1)
    known = running(m, Sequence(1, "", [1, 2], BS))
    tables, cl, sm = outputs()
    with pytest.raises(UnknownSequenceError):
        m.append_slots_batch([known, stranger], tables, cl, sm)
    with pytest.raises(UnknownSequenceError):
        m.fill_block_tables([stranger], tables)
    assert stranger.data._store.hasher == ("sha256", 3)
    assert (tables == 0).all() and (cl == 0).all()


def test_out_of_blocks_batch_changes_nothing():
    m = BlockSpaceManager(BS, 2, 0, watermark=0.0)
    a = running(m, Sequence(1, "", [1, 2, 3, 4], BS))
    b = running(m, Sequence(2, "", [5, 6, 7, 8], BS))
    for s, t in ((a, 9), (b, 10)):
        s.append_token_id(t, {t: Logprob(0.0)})
    tables, cl, sm = outputs()
    before = snapshot(m, [a, b])
    with pytest.raises(pagedkv.OutOfBlocksError):
        m.append_slots_batch([a, b], tables, cl, sm)
    assert snapshot(m, [a, b]) == before and (tables == 0).all()
    m.check_invariants()


# ---- 9. the 3-bit test hash is private ----------------------------------------------------


def test_weak_test_hash_is_not_a_public_option():
    with pytest.raises(InvalidArgumentError):
        BlockSpaceManager(BS, 8, 0, hash_algo="weak-for-testing")
    with pytest.raises(InvalidArgumentError):
        pagedkv.set_default_hasher("weak-for-testing", 1)
    with pytest.raises(InvalidArgumentError):
        pagedkv.hash_blocks([1, 2, 3, 4], BS, hash_algo="weak-for-testing")


# ---- 10. nothing grows per call --------------------------------------------------------------


def _append(manager, seq):
    manager.append_slots(seq)


def test_foreign_append_slots_keeps_no_python_objects():
    """Each decode step of a foreign sequence reads its new output tokens; that read once leaked
    two int objects per call (a steady RSS climb over a long run)."""
    m = BlockSpaceManager(BS, 4096, 0, enable_caching=True)
    seq = running(m, ForeignSeq(1, list(range(300, 310))))
    for t in range(50):  # warm up caches and interned objects
        seq.tokens.append(1000 + t)
        _append(m, seq)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for t in range(2000):
            seq.tokens.append(2000 + t)  # ints above the small-int cache: new objects
            _append(m, seq)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    line = _append.__code__.co_firstlineno + 1
    kept = sum(
        stat.count_diff
        for stat in after.compare_to(before, "lineno")
        if stat.traceback[0].filename == __file__ and stat.traceback[0].lineno == line
    )
    assert kept < 50, f"{kept} objects allocated by append_slots are still alive"


# ---- 11. numpy scalar tokens are stored as ints -------------------------------------------


@pytest.mark.parametrize("container", [list, tuple])
def test_numpy_scalar_tokens_become_ints(container):
    prompt = container([np.int64(3), 4, np.int32(5)])
    seq = Sequence(1, "", prompt, BS)
    assert list(seq.data.prompt_token_ids) == [3, 4, 5]
    assert all(type(t) is int for t in seq.data.prompt_token_ids)
    assert all(type(t) is int for t in seq.get_token_ids())
    data = pagedkv.SequenceData([1], output_token_ids=[np.uint32(7)])
    assert all(type(t) is int for t in data.output_token_ids)
