"""Re-exports :mod:`pagedkv.vllm_042.reference.pool`, where the code now lives."""

from pagedkv.vllm_042.reference.pool import (
    NEVER_ACCESSED,
    BlockPool,
    DoubleFreeError,
    InvalidArgumentError,
    OutOfBlocksError,
)

__all__ = [
    "BlockPool",
    "NEVER_ACCESSED",
    # not in the module's __all__, importable from this path before the move
    "DoubleFreeError",
    "InvalidArgumentError",
    "OutOfBlocksError",
]
