"""Wrong uses that mypy must reject, with messages that name public classes only.

``tests/test_typing.py`` runs mypy over this file and checks each ``# E:`` comment's text
appears in the error reported for that line (and that no other line errs).
"""

from __future__ import annotations

from typing import Dict, List

from pagedkv import BlockSpaceManager, SamplingParams, Sequence, SequenceGroup

mgr = BlockSpaceManager(16, 64, 64)
seq = Sequence(0, "p", [1, 2, 3], block_size=16)
group = SequenceGroup("r0", [seq], SamplingParams(), arrival_time=0.0)

mgr.append_slots(3)  # E: "append_slots" of "BlockSpaceManager"
mgr.fork(seq, "child")  # E: "fork" of "BlockSpaceManager"
mgr.can_allocate(seq)  # E: expected "SequenceGroupLike"
swapped: Dict[int, List[int]] = mgr.swap_out(group)  # E: "BlockMapping[int]"
flag: bool = mgr.can_swap_in(group)  # E: "AllocStatus"
