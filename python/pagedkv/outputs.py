"""Re-exports :mod:`pagedkv.vllm_042.outputs`, where the code now lives."""

from pagedkv.vllm_042.outputs import (
    CompletionSequenceGroupOutput,
    EmbeddingSequenceGroupOutput,
    Logprob,
    PoolerOutput,
    PromptLogprobs,
    SamplerOutput,
    SequenceGroupOutput,
    SequenceOutput,
)

__all__ = [
    "CompletionSequenceGroupOutput",
    "EmbeddingSequenceGroupOutput",
    "PoolerOutput",
    "SamplerOutput",
    "SequenceGroupOutput",
    "SequenceOutput",
    # not in the module's __all__, importable from this path before the move
    "Logprob",
    "PromptLogprobs",
]
