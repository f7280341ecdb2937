"""Drop-in compatibility with vLLM's own types: the native manager accepts sequences of another
class (vLLM's ``Sequence``) and pagedkv's enums equal vLLM's same-named members. The comparisons
against vLLM's real code (its BlockSpaceManagerV1, its Scheduler, its own unit tests) are in
tests/test_vllm_dropin.py and never skip."""

from __future__ import annotations

import enum
import itertools

import pytest

import pagedkv
from pagedkv.sequence import Logprob, SamplingParams, Sequence, SequenceGroup, SequenceStatus

BS = 4


class ForeignStatus(enum.Enum):
    """Stands in for vllm.sequence.SequenceStatus (same class and member names)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()


ForeignStatus.__name__ = "SequenceStatus"


class ForeignSeq:
    """A minimal vLLM-0.4-style Sequence: token lists in Python, no native store."""

    def __init__(self, seq_id, tokens):
        self.seq_id = seq_id
        self.prompt = list(tokens)
        self.output = []
        self.status = ForeignStatus.WAITING
        self.lora_int_id = 0
        self.data = object()  # vLLM's SequenceData has no _store

    def get_token_ids(self):
        return self.prompt + self.output

    def get_len(self):
        return len(self.prompt) + len(self.output)

    def get_prompt_len(self):
        return len(self.prompt)

    def get_output_token_ids(self):
        return self.output

    def is_finished(self):
        return self.status.name.startswith("FINISHED")


class ForeignGroup:
    def __init__(self, request_id, seqs):
        self.request_id = request_id
        self.seqs_dict = {s.seq_id: s for s in seqs}

    def get_seqs(self, status=None):
        return [s for s in self.seqs_dict.values() if status is None or s.status == status]


def test_enums_equal_foreign_members_of_the_same_name():
    assert pagedkv.SequenceStatus.RUNNING == ForeignStatus.RUNNING
    assert ForeignStatus.RUNNING == pagedkv.SequenceStatus.RUNNING
    assert pagedkv.SequenceStatus.RUNNING != ForeignStatus.WAITING
    assert pagedkv.SequenceStatus.is_finished(ForeignStatus.FINISHED_STOPPED)
    assert not pagedkv.SequenceStatus.is_finished(ForeignStatus.RUNNING)
    assert {pagedkv.SequenceStatus.WAITING: 1}[ForeignStatus.WAITING] == 1

    class Other(enum.Enum):  # a different enum class name never compares equal
        RUNNING = 2

    assert pagedkv.SequenceStatus.RUNNING != Other.RUNNING
    assert pagedkv.AllocStatus.OK != 1


def test_native_manager_accepts_foreign_sequences():
    ids = itertools.count()
    prompts = [list(range(10)), list(range(10)) + [7, 7], [3] * 9]
    ours = pagedkv.BlockSpaceManager(BS, 32, 8, enable_caching=True)
    theirs = pagedkv.BlockSpaceManager(BS, 32, 8, enable_caching=True)
    native, foreign = [], []
    for p in prompts:
        n = Sequence(next(ids), "", p, BS)
        f = ForeignSeq(n.seq_id, p)
        ours.allocate(SequenceGroup(str(n.seq_id), [n], SamplingParams(), 0.0))
        theirs.allocate(ForeignGroup(str(f.seq_id), [f]))
        n.status, f.status = SequenceStatus.RUNNING, ForeignStatus.RUNNING
        native.append(n)
        foreign.append(f)
    for step in range(9):
        for n, f in zip(native, foreign):
            t = (step * 5 + n.seq_id) % 3
            n.append_token_id(t, {t: Logprob(0.0)})
            f.output.append(t)
            assert ours.append_slots(n) == theirs.append_slots(f)
            assert ours.get_block_table(n) == theirs.get_block_table(f)
    # fork a foreign sequence: the child gets its own store
    child = ForeignSeq(next(ids), foreign[0].get_token_ids())
    child.status = ForeignStatus.RUNNING
    theirs.fork(foreign[0], child)
    child.output.append(1)
    cow = theirs.append_slots(child)
    assert len(cow) == 1
    assert ours.prefix_cache_stats() == theirs.prefix_cache_stats()
    for f in foreign + [child]:
        theirs.free(f)
    assert theirs.get_num_free_gpu_blocks() == 32
    theirs.check_invariants()


def test_groups_carry_the_fields_vllm_05_reads():
    g = SequenceGroup("r", [Sequence(1, "", [1, 2], BS)], SamplingParams(), 0.0)
    assert g.pooling_params is None and g.embeddings is None


def test_foreign_sequence_without_token_access_is_a_type_error():
    m = pagedkv.BlockSpaceManager(BS, 8, 2)

    class Bare:
        seq_id = 1
        status = ForeignStatus.WAITING

    with pytest.raises(TypeError):
        m.allocate(ForeignGroup("x", [Bare()]))
