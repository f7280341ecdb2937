"""Re-exports :mod:`pagedkv.vllm_042.reference.sequence`, where the code now lives."""

from pagedkv.vllm_042.reference.sequence import (
    ExecuteModelRequest,
    InvalidArgumentError,
    LogicalTokenBlock,
    Logprob,
    LoRARequest,
    RequestMetrics,
    Sequence,
    SequenceAccessors,
    SequenceData,
    SequenceGroup,
    SequenceGroupMetadata,
    SequenceGroupState,
    SequenceStage,
    SequenceStatus,
    hash_block,
)

__all__ = [
    "ExecuteModelRequest",
    "RequestMetrics",
    "Sequence",
    "SequenceData",
    "SequenceGroup",
    "SequenceGroupMetadata",
    "SequenceGroupState",
    "SequenceStage",
    "SequenceStatus",
    # not in the module's __all__, importable from this path before the move
    "InvalidArgumentError",
    "LogicalTokenBlock",
    "hash_block",
    "SequenceAccessors",
    "Logprob",
    "LoRARequest",
]
