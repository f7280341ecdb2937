"""An Enum base whose members also equal the same-named members of a *foreign* enum with the
same class name (vLLM's own ``SequenceStatus``, ``SequenceStage``, ``AllocStatus``, ``Device``).

Engine code that still imports those enums from vLLM then works unchanged with pagedkv's
objects: ``mgr.can_allocate(g) == vllm.core.interfaces.AllocStatus.OK`` holds, and a status
set from vLLM's enum counts as finished in ``SequenceStatus.is_finished``. Hashes stay
``hash(name)`` (Enum's own), so such members also meet in sets and dict keys.
"""

from __future__ import annotations

import enum


class CompatEnum(enum.Enum):
    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if isinstance(other, enum.Enum) and type(other).__name__ == type(self).__name__:
            return self.name == other.name
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = enum.Enum.__hash__
