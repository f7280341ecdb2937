"""Re-exports :mod:`pagedkv.vllm_042.block`, where the code now lives."""

from pagedkv.vllm_042.block import (
    DEFAULT_LAST_ACCESSED_TIME,
    BlockTable,
    CompatEnum,
    Device,
    LogicalTokenBlock,
    PhysicalTokenBlock,
)

__all__ = [
    "BlockTable",
    "DEFAULT_LAST_ACCESSED_TIME",
    "Device",
    "LogicalTokenBlock",
    "PhysicalTokenBlock",
    # not in the module's __all__, importable from this path before the move
    "CompatEnum",
]
