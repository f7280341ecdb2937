"""Small value types the Sequence family needs: sampling parameters, log-probabilities, LoRA
requests and multi-modal inputs.

They follow vLLM 0.4.2 (``vllm/sampling_params.py``, ``vllm/lora/request.py``,
``vllm/sequence.py``) closely enough that scheduler and block-manager code written against vLLM
keeps working. Only the checks that the sequence-group logic relies on are enforced (for example
``best_of >= n``: ``SequenceGroup.get_max_num_running_seqs`` returns ``best_of``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, List, Optional, Union

__all__ = [
    "SamplingParams",
    "SamplingType",
    "Logprob",
    "LoRARequest",
    "MultiModalData",
]

# Temperatures below this count as greedy sampling (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5


class SamplingType(enum.IntEnum):
    """How the next token is chosen; derived from :class:`SamplingParams`."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2
    BEAM = 3


@dataclass
class Logprob:
    """The log-probability of one candidate token (and, once detokenized, its text)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass(frozen=True, eq=False)
class LoRARequest:
    """A request for a LoRA adapter.

    ``lora_int_id`` is the adapter's identity: it enters every block hash of the sequences that
    use it (so KV blocks of different adapters are never shared) and it is what equality and
    hashing compare, as in vLLM. It must be >= 1 because 0 means "no LoRA" everywhere.
    """

    lora_name: str
    lora_int_id: int
    lora_local_path: str

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise TypeError(f"lora_int_id must be an int, got {type(self.lora_int_id).__name__}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_int_id == other.lora_int_id

    def __hash__(self) -> int:
        return self.lora_int_id


class MultiModalData:
    """Multi-modal input attached to a request (vLLM 0.4.2: an image tensor).

    ``data`` is whatever the model consumes (typically a ``torch.Tensor``); this package never
    looks inside it, so torch is not required.
    """

    class Type(enum.Enum):
        IMAGE = enum.auto()

    def __init__(self, type: MultiModalData.Type, data: Any) -> None:  # `type`: vLLM's name
        self.type = type
        self.data = data

    def __repr__(self) -> str:
        return f"MultiModalData(type={self.type}, data={type(self.data).__name__})"


class SamplingParams:
    """Sampling parameters of a request, with vLLM 0.4.2's argument order and validation.

    ``best_of`` defaults to ``n``. ``stop`` accepts a string or a list of strings. Greedy sampling
    (``temperature == 0``) resets ``top_p``/``top_k``/``min_p`` to their neutral values and
    requires ``best_of == 1``. Beam search requires ``best_of > 1``, ``temperature == 0``,
    ``top_p == 1`` and ``top_k == -1``; without beam search ``length_penalty`` must be 1 and
    ``early_stopping`` False. Every violation raises ``ValueError`` at construction, so the group
    logic can trust the fields.
    """

    def __init__(
        self,
        n: int = 1,
        best_of: Optional[int] = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        seed: Optional[int] = None,
        use_beam_search: bool = False,
        length_penalty: float = 1.0,
        early_stopping: Union[bool, str] = False,
        stop: Optional[Union[str, List[str]]] = None,
        stop_token_ids: Optional[List[int]] = None,
        include_stop_str_in_output: bool = False,
        ignore_eos: bool = False,
        max_tokens: Optional[int] = 16,
        min_tokens: int = 0,
        logprobs: Optional[int] = None,
        prompt_logprobs: Optional[int] = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.n = n
        self.best_of = n if best_of is None else best_of
        self.presence_penalty = presence_penalty
        self.frequency_penalty = frequency_penalty
        self.repetition_penalty = repetition_penalty
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.min_p = min_p
        self.seed = seed
        self.use_beam_search = use_beam_search
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        if stop is None:
            self.stop: List[str] = []
        elif isinstance(stop, str):
            self.stop = [stop]
        else:
            self.stop = list(stop)
        self.stop_token_ids: List[int] = [] if stop_token_ids is None else list(stop_token_ids)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.ignore_eos = ignore_eos
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens

        self._verify_args()
        if self.use_beam_search:
            self._verify_beam_search()
        else:
            self._verify_non_beam_search()
            if self.temperature < _SAMPLING_EPS:
                # Greedy: the other knobs are meaningless; normalise them like vLLM.
                self.top_p = 1.0
                self.top_k = -1
                self.min_p = 0.0
                if self.best_of > 1:
                    raise ValueError(
                        f"best_of must be 1 when using greedy sampling, got {self.best_of}"
                    )

    def _verify_args(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.best_of < self.n:
            raise ValueError(
                f"best_of must be greater than or equal to n, got n={self.n} and "
                f"best_of={self.best_of}"
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}"
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string")

    def _verify_beam_search(self) -> None:
        if self.best_of == 1:
            raise ValueError(
                f"best_of must be greater than 1 when using beam search, got {self.best_of}"
            )
        if self.temperature > _SAMPLING_EPS:
            raise ValueError("temperature must be 0 when using beam search")
        if self.top_p < 1.0 - _SAMPLING_EPS:
            raise ValueError("top_p must be 1 when using beam search")
        if self.top_k != -1:
            raise ValueError("top_k must be -1 when using beam search")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be True, False, or 'never', got {self.early_stopping!r}"
            )

    def _verify_non_beam_search(self) -> None:
        if self.early_stopping is not False:
            raise ValueError(
                "early_stopping is not effective and must be False when not using beam search"
            )
        if not 1.0 - _SAMPLING_EPS <= self.length_penalty <= 1.0 + _SAMPLING_EPS:
            raise ValueError(
                "length_penalty is not effective and must be the default value of 1.0 when not "
                "using beam search"
            )

    @property
    def sampling_type(self) -> SamplingType:
        """How the next token is chosen: beam search, greedy, seeded or plain random."""
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SamplingParams) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]  # mutable value object

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"SamplingParams({fields})"
