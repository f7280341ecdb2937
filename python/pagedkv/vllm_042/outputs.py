"""The model-output containers of vLLM's ``vllm/sequence.py`` (0.4.2, plus 0.5's names), so an
engine that imports its whole sequence module from :mod:`pagedkv.vllm_042.sequence` finds them.

They hold no token state: the sampler builds them, the engine's output processing reads them.
Where 0.4.2 and 0.5 differ, 0.4.2's shape is kept and 0.5's is added beside it:
``SequenceGroupOutput`` is 0.4.2's concrete class (``samples``, ``prompt_logprobs``), and 0.5's
``CompletionSequenceGroupOutput`` is a subclass of it; ``EmbeddingSequenceGroupOutput`` is also
a ``SequenceGroupOutput`` (0.5's abstract base) with only ``embeddings``.
Comparing with an object of another type returns ``NotImplemented`` (vLLM raises
NotImplementedError).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from pagedkv.vllm_042.types import Logprob

__all__ = [
    "CompletionSequenceGroupOutput",
    "EmbeddingSequenceGroupOutput",
    "PoolerOutput",
    "SamplerOutput",
    "SequenceGroupOutput",
    "SequenceOutput",
]

PromptLogprobs = List[Optional[Dict[int, Logprob]]]


class SequenceOutput:
    """One sampled candidate: the parent sequence it extends (beam search forks), the token
    and the logprobs of the candidates (token id -> Logprob)."""

    __slots__ = ("parent_seq_id", "output_token", "logprobs")

    def __init__(self, parent_seq_id: int, output_token: int, logprobs: Dict[int, Logprob]):
        self.parent_seq_id = parent_seq_id
        self.output_token = output_token
        self.logprobs = logprobs

    def __repr__(self) -> str:
        return (
            f"SequenceOutput(parent_seq_id={self.parent_seq_id}, "
            f"output_token={self.output_token}, logprobs={self.logprobs})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SequenceOutput):
            return NotImplemented
        return (
            self.parent_seq_id == other.parent_seq_id
            and self.output_token == other.output_token
            and self.logprobs == other.logprobs
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value


class SequenceGroupOutput:
    """The sampled candidates of one sequence group and its prompt logprobs (vLLM 0.4.2)."""

    def __init__(self, samples: List[SequenceOutput], prompt_logprobs: Optional[PromptLogprobs]):
        self.samples = samples
        self.prompt_logprobs = prompt_logprobs

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(samples={self.samples}, prompt_logprobs={self.prompt_logprobs})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SequenceGroupOutput) or isinstance(
            other, EmbeddingSequenceGroupOutput
        ):
            return NotImplemented
        return self.samples == other.samples and self.prompt_logprobs == other.prompt_logprobs

    __hash__ = None  # type: ignore[assignment]


class CompletionSequenceGroupOutput(SequenceGroupOutput):
    """vLLM 0.5's name for a completion group's output (the same fields)."""


class EmbeddingSequenceGroupOutput(SequenceGroupOutput):
    """vLLM 0.5: the output of an embedding request (a vector, no samples)."""

    def __init__(self, embeddings: List[float]):  # no samples: the base __init__ is not called
        self.embeddings = embeddings

    def __repr__(self) -> str:
        return f"EmbeddingSequenceGroupOutput(embeddings_shape={len(self.embeddings)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EmbeddingSequenceGroupOutput):
            return NotImplemented
        return self.embeddings == other.embeddings

    __hash__ = None  # type: ignore[assignment]


class _OutputList:
    """List-like access to ``outputs`` (vLLM's SamplerOutput/PoolerOutput behave so)."""

    outputs: list

    def __getitem__(self, idx: int) -> Any:
        return self.outputs[idx]

    def __setitem__(self, idx: int, value: Any) -> None:
        self.outputs[idx] = value

    def __len__(self) -> int:
        return len(self.outputs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, type(self)) and self.outputs == other.outputs

    __hash__ = None  # type: ignore[assignment]


@dataclass(eq=False)
class SamplerOutput(_OutputList):
    """One step's sampler output: a ``SequenceGroupOutput`` per scheduled group, plus optional
    device tensors (any array type; pagedkv never reads them)."""

    outputs: List[SequenceGroupOutput]
    sampled_token_probs: Optional[Any] = None
    logprobs: Optional[Any] = None
    sampled_token_ids: Optional[Any] = None
    spec_decode_worker_metrics: Optional[Any] = None

    def __repr__(self) -> str:
        def shape(t: Any) -> Any:
            return "None" if t is None else getattr(t, "shape", t)

        return (
            f"SamplerOutput(outputs={self.outputs}, "
            f"sampled_token_probs={shape(self.sampled_token_probs)}, "
            f"sampled_token_ids={shape(self.sampled_token_ids)}, "
            f"spec_decode_worker_metrics={self.spec_decode_worker_metrics})"
        )


@dataclass(eq=False)
class PoolerOutput(_OutputList):
    """vLLM 0.5: an embedding model's step output."""

    outputs: List[EmbeddingSequenceGroupOutput]
    spec_decode_worker_metrics: Optional[Any] = None
