"""Re-exports :mod:`pagedkv.vllm_042.reference.block_manager`, where the code now lives."""

from pagedkv.vllm_042.reference.block_manager import (
    AllocStatus,
    BlockMapping,
    BlockPool,
    BlockSpaceManager,
    Device,
    InvalidArgumentError,
    OutOfBlocksError,
    PhysicalTokenBlock,
    UnknownSequenceError,
    check_mapping_format,
)

__all__ = [
    "AllocStatus",
    "BlockSpaceManager",
    # not in the module's __all__, importable from this path before the move
    "InvalidArgumentError",
    "OutOfBlocksError",
    "UnknownSequenceError",
    "Device",
    "PhysicalTokenBlock",
    "BlockMapping",
    "check_mapping_format",
    "BlockPool",
]
