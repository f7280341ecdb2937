"""Re-exports :mod:`pagedkv.vllm_042.demo_paths`, where the code now lives."""

from pagedkv.vllm_042.demo_paths import (
    PATHS,
    BatchEngine,
    BatchPath,
    CompatPath,
    Logprob,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceGroup,
    SequenceStatus,
    StepPlan,
)

__all__ = [
    "PATHS",
    "BatchPath",
    "CompatPath",
    "StepPlan",
    # not in the module's __all__, importable from this path before the move
    "BatchEngine",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "SequenceGroup",
    "SequenceStatus",
    "Logprob",
    "SamplingParams",
]
