"""Re-exports :mod:`pagedkv.vllm_042.scheduler`, where the code now lives."""

from pagedkv.vllm_042.scheduler import (
    BlockList,
    BlockSpaceManager,
    CacheConfig,
    InvalidArgumentError,
    LoRAConfig,
    LoRARequest,
    PreemptionMode,
    ScheduledSequenceGroup,
    Scheduler,
    SchedulerConfig,
    SchedulerCore,
    SchedulerOutputs,
    Sequence,
    SequenceGroup,
    SequenceGroupMetadata,
)

__all__ = [
    "BlockList",
    "CacheConfig",
    "LoRAConfig",
    "PreemptionMode",
    "ScheduledSequenceGroup",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutputs",
    # not in the module's __all__, importable from this path before the move
    "SchedulerCore",
    "InvalidArgumentError",
    "BlockSpaceManager",
    "Sequence",
    "SequenceGroup",
    "SequenceGroupMetadata",
    "LoRARequest",
]
