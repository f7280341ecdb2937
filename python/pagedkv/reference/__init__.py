"""Re-exports :mod:`pagedkv.vllm_042.reference`, where the code now lives."""

from pagedkv.vllm_042.reference import (
    AllocStatus,
    BlockPool,
    BlockSpaceManager,
    Sequence,
    SequenceData,
    hashing,
)

__all__ = [
    "hashing",
    "AllocStatus",
    "BlockPool",
    "BlockSpaceManager",
    "Sequence",
    "SequenceData",
]
