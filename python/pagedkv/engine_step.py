"""Re-exports :mod:`pagedkv.vllm_042.engine_step`, where the code now lives."""

from pagedkv.vllm_042.engine_step import (
    ROW_APPENDED,
    ROW_MOVED,
    ROW_REWRITTEN,
    ROW_SAME,
    ArgumentTypeError,
    BatchBuffers,
    BatchEngine,
    BatchStep,
    DeviceBatch,
    InvalidArgumentError,
    StepResult,
)

__all__ = [
    "BatchBuffers",
    "DeviceBatch",
    "BatchEngine",
    "StepResult",
    "ROW_SAME",
    "ROW_APPENDED",
    "ROW_REWRITTEN",
    "ROW_MOVED",
    # not in the module's __all__, importable from this path before the move
    "BatchStep",
    "ArgumentTypeError",
    "InvalidArgumentError",
]
