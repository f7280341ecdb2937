"""An Enum base whose members also equal the same-named members of a *foreign* enum with the
same class name (vLLM's own ``SequenceStatus``, ``SequenceStage``, ``AllocStatus``, ``Device``).

Engine code that still imports those enums from vLLM then works unchanged with pagedkv's
objects: ``mgr.can_allocate(g) == vllm.core.interfaces.AllocStatus.OK`` holds, and a status
set from vLLM's enum counts as finished in ``SequenceStatus.is_finished``. Hashes are
``hash(name)`` (``enum.Enum``'s own), so such members also meet in sets and dict keys.

The comparison lives in the native base class: comparing two members of one of these enums
costs a C-level identity test, as for a plain ``enum.Enum`` (vLLM's scheduler compares
statuses several times per group per step); only a comparison with a foreign member looks
at names.
"""

from __future__ import annotations

import enum

from pagedkv._native import CompatEnumBase


class CompatEnum(CompatEnumBase, enum.Enum):
    def __new__(cls, value):
        # The native base holds no data: members keep their plain value (``enum.auto()`` ints).
        member = CompatEnumBase.__new__(cls)
        member._value_ = value
        return member

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self._name_}: {self._value_!r}>"

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self._name_}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __reduce_ex__(self, proto):
        return getattr, (type(self), self._name_)
