"""An Enum base whose members also equal the same-named members of a *foreign* enum with the
same class name (vLLM's own ``SequenceStatus``, ``SequenceStage``, ``AllocStatus``, ``Device``).

Engine code that still imports those enums from vLLM then works unchanged with pagedkv's
objects: ``mgr.can_allocate(g) == vllm.core.interfaces.AllocStatus.OK`` holds, and a status
set from vLLM's enum counts as finished in ``SequenceStatus.is_finished``. Hashes are
``hash(name)`` (``enum.Enum``'s own), so such members also meet in sets and dict keys.

The comparison and the hash live in the native base class (``rust/py/src/vllm_042/compat_enum.rs``):
comparing two members of one of these enums is a C-level identity test, as cheap as for a
plain ``enum.Enum`` (vLLM's scheduler compares statuses several times per group per step);
only a comparison with an object of another type looks at names.
"""

from __future__ import annotations

import enum

from pagedkv._native import CompatEnumBase


class CompatEnum(CompatEnumBase, enum.Enum):
    pass
