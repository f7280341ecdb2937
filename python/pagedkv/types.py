"""Re-exports :mod:`pagedkv.vllm_042.types`, where the code now lives."""

from pagedkv.vllm_042.types import (
    Logprob,
    LoRARequest,
    MultiModalData,
    SamplingParams,
    SamplingType,
)

__all__ = [
    "SamplingParams",
    "SamplingType",
    "Logprob",
    "LoRARequest",
    "MultiModalData",
]
