"""Re-exports :mod:`pagedkv.vllm_042.protocols`, where the code now lives."""

from pagedkv.vllm_042.protocols import (
    SequenceGroupLike,
    SequenceLike,
    StatusLike,
)

__all__ = [
    "SequenceGroupLike",
    "SequenceLike",
    "StatusLike",
]
