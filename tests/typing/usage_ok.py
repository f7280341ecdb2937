"""Typed usage of the public API; ``tests/test_typing.py`` runs mypy over it and wants no error.

Not collected by pytest (it is not a ``test_*.py`` file), but it runs: the typing test also
executes it, so the example is known to work as well as to type-check.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

from pagedkv import (
    AllocStatus,
    BlockMapping,
    BlockSpaceManager,
    Logprob,
    SamplingParams,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from pagedkv.block_manager import BlockSpaceManagerPairs
from pagedkv.protocols import SequenceGroupLike, SequenceLike


def step(mgr: BlockSpaceManager, seq: SequenceLike) -> Dict[int, List[int]]:
    m: BlockMapping = mgr.append_slots(seq)
    cow: BlockMapping[List[int]] = mgr.append_slots(seq, num_lookahead_slots=0)
    out: Dict[int, List[int]] = {src: list(dsts) for src, dsts in cow.items()}
    assert len(m) == 0
    return out


def admit(mgr: BlockSpaceManager, group: SequenceGroupLike) -> bool:
    status: AllocStatus = mgr.can_allocate(group)
    if status is not AllocStatus.OK:
        return False
    mgr.allocate(group)
    return True


def preempt_and_resume(mgr: BlockSpaceManager, group: SequenceGroup) -> int:
    out: BlockMapping[int] = mgr.swap_out(group)
    for seq in group.get_seqs():
        seq.status = SequenceStatus.SWAPPED
    can: AllocStatus = mgr.can_swap_in(group)
    assert can == AllocStatus.OK
    back: BlockMapping = mgr.swap_in(group)
    for seq in group.get_seqs():
        seq.status = SequenceStatus.RUNNING
    gpu_blocks: List[int] = sorted(dict(back).values())
    assert len(gpu_blocks) == len(out)
    return len(out)


def main() -> None:
    mgr = BlockSpaceManager(16, 64, 64, enable_caching=True)
    seq = Sequence(0, "p", list(range(40)), block_size=16)
    group = SequenceGroup("r0", [seq], SamplingParams(), arrival_time=0.0)
    assert admit(mgr, group)
    seq.status = SequenceStatus.RUNNING
    seq.append_token_id(7, {7: Logprob(0.0)})
    assert step(mgr, seq) == {}
    tables = np.zeros((4, 8), dtype=np.int32)
    lens = np.zeros(4, dtype=np.int32)
    slots = np.zeros(4, dtype=np.int32)
    seq.append_token_id(8, {8: Logprob(0.0)})
    batch: BlockMapping = mgr.append_slots_batch([seq], tables, lens, slots)
    assert not batch and int(lens[0]) == 42
    assert preempt_and_resume(mgr, group) == 3
    vllm05 = BlockSpaceManagerPairs(16, 8, 8, strict=True)
    other = Sequence(1, "p", list(range(20)), block_size=16)
    assert admit(vllm05, SequenceGroup("r1", [other], SamplingParams(), arrival_time=0.0))
    other.status = SequenceStatus.RUNNING
    other.append_token_id(9, {9: Logprob(0.0)})
    pairs: List[Tuple[int, int]] = vllm05.append_slots(other)
    assert pairs == [] and vllm05.strict
    table: List[int] = mgr.get_block_table(seq)
    free: int = mgr.get_num_free_gpu_blocks()
    assert len(table) == 3 and free == 61
    mgr.free(seq)


if __name__ == "__main__":
    main()
