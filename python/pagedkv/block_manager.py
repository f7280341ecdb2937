"""Re-exports :mod:`pagedkv.vllm_042.block_manager`, where the code now lives."""

from pagedkv.vllm_042.block_manager import (
    MAPPING_FORMATS,
    AllocStatus,
    BlockMapping,
    BlockSpaceManager,
    BlockSpaceManagerPairs,
    BlockTable,
    CompatEnum,
    Device,
    InvalidArgumentError,
    PhysicalTokenBlock,
    SequenceGroupLike,
    SequenceLike,
    check_mapping_format,
)

__all__ = [
    "AllocStatus",
    "BlockMapping",
    "BlockSpaceManager",
    "BlockSpaceManagerPairs",
    "BlockTable",
    # not in the module's __all__, importable from this path before the move
    "InvalidArgumentError",
    "CompatEnum",
    "Device",
    "PhysicalTokenBlock",
    "SequenceGroupLike",
    "SequenceLike",
    "MAPPING_FORMATS",
    "check_mapping_format",
]
