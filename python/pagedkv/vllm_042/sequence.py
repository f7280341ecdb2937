"""Sequences and sequence groups with vLLM 0.4.2's API (``vllm/sequence.py``), backed by a
native token store.

What differs from vLLM is where the data lives, not what the methods return:

* ``SequenceData._store`` is a native :class:`pagedkv.TokenSeq` that always holds exactly the
  prompt followed by the output tokens. It hashes each block once, when the block fills, so
  ``Sequence.hash_of_block`` is an O(1) lookup (vLLM 0.4.2 re-hashed the whole prefix on every
  call: O(L) per block, O(L^2) per sequence). The native block manager reads ``_store``,
  ``seq_id`` and ``status`` directly, without calling back into Python.
* The token id lists are read-only views kept next to the store (so reads such as
  ``get_token_ids`` or ``get_last_token_id`` stay as cheap as in vLLM); the only way to add a
  token is ``append_token_id``, which updates both, so they can never disagree.
* ``Sequence.logical_token_blocks`` is built on demand from the tokens and cached; appending a
  token creates no per-block Python object.
* ``Sequence.fork`` copies the store natively and shares what is immutable (the prompt list),
  instead of ``copy.deepcopy``-ing every list and logprob dict.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

from pagedkv._native import TokenSeq
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError
from pagedkv.vllm_042._enum import CompatEnum
from pagedkv.vllm_042.block import LogicalTokenBlock
from pagedkv.vllm_042.outputs import (
    CompletionSequenceGroupOutput,
    EmbeddingSequenceGroupOutput,
    PoolerOutput,
    SamplerOutput,
    SequenceGroupOutput,
    SequenceOutput,
)
from pagedkv.vllm_042.types import Logprob, LoRARequest, MultiModalData, SamplingParams

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "CompletionSequenceGroupOutput",
    "EmbeddingSequenceGroupOutput",
    "ExecuteModelRequest",
    "Logprob",
    "MultiModalData",
    "PoolerOutput",
    "PromptLogprobs",
    "RequestMetrics",
    "SampleLogprobs",
    "SamplerOutput",
    "Sequence",
    "SequenceData",
    "SequenceGroup",
    "SequenceGroupMetadata",
    "SequenceGroupOutput",
    "SequenceGroupState",
    "SequenceOutput",
    "SequenceStage",
    "SequenceStatus",
    "TokenIdList",
]

# Logprobs of the prompt tokens (None for the first token) and of each sampled token.
PromptLogprobs = List[Optional[Dict[int, Logprob]]]
SampleLogprobs = List[Dict[int, Logprob]]

# Block size of the token store of a SequenceData built on its own (as vLLM's tests and
# workers do). ``Sequence`` always passes its own block size. 16 is vLLM's default.
DEFAULT_BLOCK_SIZE = 16


class SequenceStatus(CompatEnum):
    """Status of a sequence."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: SequenceStatus) -> bool:
        """Whether ``status`` is one of the FINISHED_* statuses."""
        return status in _FINISHED_STATUSES

    @staticmethod
    def get_finished_reason(status: SequenceStatus) -> Union[str, None]:
        """The OpenAI-style finish reason; ``None`` while the sequence is not finished.

        FINISHED_IGNORED (prompt too long) reads as "length" to the user, like a length cap.
        """
        return _FINISH_REASONS.get(status)


_FINISHED_STATUSES = frozenset(
    (
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH_CAPPED,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_IGNORED,
    )
)
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
}


class SequenceStage(CompatEnum):
    PREFILL = enum.auto()
    DECODE = enum.auto()


@dataclass
class RequestMetrics:
    """Request-level timings (seconds, as given by the caller's clock)."""

    arrival_time: float
    last_token_time: float
    first_scheduled_time: Optional[float]
    first_token_time: Optional[float]
    time_in_queue: Optional[float]
    finished_time: Optional[float] = None


class TokenIdList(list):
    """A list of token ids that cannot be modified in place.

    ``SequenceData.prompt_token_ids`` and ``output_token_ids`` are these: reading works exactly
    like a list (indexing, slicing, ``len``, iteration, ``==`` with a list), but mutation raises
    ``TypeError``, because the native token store must always hold the same tokens. Copies
    (``list(x)``, ``x[:]``, ``copy.copy(x)``) are ordinary mutable lists.
    """

    __slots__ = ()

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: the list mirrors the native token store (raises ``TypeError``)."""
        raise TypeError(
            "token id lists of a SequenceData are read-only: append tokens with "
            "Sequence.append_token_id (or SequenceData.append_token_id) so that the native "
            "token store stays in sync"
        )

    append = extend = insert = pop = remove = clear = sort = reverse = _read_only
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only

    def __copy__(self) -> List[int]:
        return list(self)

    def __deepcopy__(self, memo: Dict[int, Any]) -> List[int]:
        return list(self)

    def __reduce__(self) -> Any:
        return (list, (list(self),))


# Unbound ``list.append``: the one way this module grows a TokenIdList (bypasses _read_only).
_list_append = list.append


def _as_token_list(token_ids: Any, store: TokenSeq, start: int, end: int) -> TokenIdList:
    """A TokenIdList of ``token_ids``, which ``store`` has already validated as ``[start, end)``.

    Lists and tuples of exact ints are copied as they are; anything else (numpy arrays or
    numpy integer items, iterators) is read back from the store as Python ints.
    """
    if isinstance(token_ids, (list, tuple)) and set(map(type, token_ids)) <= {int}:
        return TokenIdList(token_ids)
    return TokenIdList(store.token_slice(start, end))


class SequenceData:
    """Token ids, cumulative logprob and prefill progress of one sequence.

    Invariant: ``_store.tokens() == prompt_token_ids + output_token_ids``. Each token crosses
    into Rust once: the prompt when the store is built, each output token in
    ``append_token_id`` (O(1) amortised, plus one block hash when the token fills a block).

    The keyword-only arguments configure the store: ``block_size`` (the block size of the
    hashes; ``Sequence`` passes its own), ``lora_int_id`` and ``cache_salt`` (both enter the
    hashes), and ``hash_algo``/``hash_seed`` (default: the process default hasher).
    ``strict=True`` also refuses a negative computed-token count (see
    :meth:`update_num_computed_tokens`).
    """

    __slots__ = (
        "_prompt",
        "_output",
        "_store",
        "cumulative_logprob",
        "_num_computed_tokens",
        "_stage",
        "_cache_salt",
        "_strict",
    )

    def __init__(
        self,
        prompt_token_ids: Iterable[int],
        output_token_ids: Optional[Iterable[int]] = None,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        lora_int_id: int = 0,
        cache_salt: Union[str, bytes, None] = None,
        hash_algo: Optional[str] = None,
        hash_seed: Optional[int] = None,
        strict: bool = False,
    ) -> None:
        # The store validates every token (type and range) before anything is kept.
        store = TokenSeq(
            block_size,
            prompt_token_ids,
            lora_id=lora_int_id,
            cache_salt=cache_salt,
            hash_algo=hash_algo,
            hash_seed=hash_seed,
        )
        prompt_len = len(store)
        self._prompt = _as_token_list(prompt_token_ids, store, 0, prompt_len)
        if output_token_ids is None:
            self._output = TokenIdList()
        else:
            store.extend(output_token_ids)
            self._output = _as_token_list(output_token_ids, store, prompt_len, len(store))
        self._store = store
        self.cumulative_logprob = 0.0
        self._num_computed_tokens = 0
        self._stage = SequenceStage.PREFILL
        self._cache_salt = cache_salt
        self._strict = bool(strict)

    # -- token ids ---------------------------------------------------------------------------

    @property
    def prompt_token_ids(self) -> TokenIdList:
        """The prompt's token ids (a read-only list)."""
        return self._prompt

    @property
    def output_token_ids(self) -> TokenIdList:
        """The generated token ids so far (a read-only list; grows with append_token_id)."""
        return self._output

    def append_token_id(self, token_id: int, logprob: float) -> None:
        """Append a generated token and add its logprob. All or nothing: a bad token id
        (``ArgumentTypeError``/``InvalidArgumentError``) or logprob changes nothing."""
        cumulative = self.cumulative_logprob + logprob
        self._store.append(token_id)
        _list_append(self._output, token_id)
        self.cumulative_logprob = cumulative

    def get_len(self) -> int:
        """Prompt plus output length, in tokens."""
        return len(self._prompt) + len(self._output)

    def get_prompt_len(self) -> int:
        """Number of prompt tokens."""
        return len(self._prompt)

    def get_output_len(self) -> int:
        """Number of output tokens."""
        return len(self._output)

    def get_token_ids(self) -> List[int]:
        """Prompt + output as a new (mutable) list: O(L), like vLLM."""
        return self._prompt + self._output

    def get_output_token_ids(self) -> TokenIdList:
        """The output token ids (read-only list)."""
        return self._output

    def get_prompt_token_ids(self) -> TokenIdList:
        """The prompt token ids (read-only list; vLLM 0.5's name)."""
        return self._prompt

    def get_prefix_token_ids(
        self, num_tokens: int
    ) -> Tuple[Tuple[int, ...], Optional[Tuple[int, ...]]]:
        """The first ``num_tokens`` tokens as hashable tuples (vLLM 0.5): ``(prompt part,
        output part or None when the prefix lies within the prompt)``."""
        prompt_len = len(self._prompt)
        if num_tokens > prompt_len:
            return tuple(self._prompt), tuple(self._output[: num_tokens - prompt_len])
        return tuple(self._prompt[:num_tokens]), None

    def get_last_token_id(self) -> int:
        """The last token (IndexError for an empty sequence, like vLLM)."""
        if not self._output:
            return self._prompt[-1]
        return self._output[-1]

    def token_ids_from(self, start: int) -> List[int]:
        """Tokens ``[start, len)`` as a new list, without building the whole token list."""
        prompt_len = len(self._prompt)
        if start >= prompt_len:
            return self._output[start - prompt_len :]
        return self._prompt[start:] + self._output

    # -- prefill progress --------------------------------------------------------------------

    def get_num_computed_tokens(self) -> int:
        """How many tokens the model has processed (the prefill progress)."""
        return self._num_computed_tokens

    def update_num_computed_tokens(self, num_new_computed_tokens: int) -> None:
        """Record that a (chunk of) prefill or a decode step computed more tokens.

        Once every token is computed the sequence moves to the DECODE stage. Computing more
        tokens than the sequence holds is a scheduler bug: ``InvalidArgumentError`` (a
        ValueError; vLLM asserts), state unchanged. A negative count is accepted and stored as
        vLLM's ``SequenceData`` does: vLLM 0.4.2's chunked-prefill scheduler can hand out a
        negative ``token_chunk_size`` when a decoding group overran the token budget, and its
        next step reschedules those tokens. ``strict=True`` refuses a total below zero.
        """
        total = self._num_computed_tokens + num_new_computed_tokens
        length = len(self._prompt) + len(self._output)
        if total > length or (total < 0 and self._strict):
            raise InvalidArgumentError(
                f"cannot mark {num_new_computed_tokens} more tokens as computed: "
                f"{self._num_computed_tokens} of {length} are computed already"
            )
        self._num_computed_tokens = total
        if total == length:
            self._stage = SequenceStage.DECODE

    def reset_state_for_recompute(self) -> None:
        """After preemption by recomputation: nothing is computed, back to PREFILL."""
        self._num_computed_tokens = 0
        self._stage = SequenceStage.PREFILL

    def get_num_uncomputed_tokens(self) -> int:
        """Tokens not yet computed (prompt and output together)."""
        # get_len(), not the prompt length: a recomputed sequence re-prefills its outputs too.
        return len(self._prompt) + len(self._output) - self._num_computed_tokens

    @property
    def stage(self) -> SequenceStage:
        """PREFILL until every prompt token is computed, then DECODE."""
        return self._stage

    # -- store configuration -----------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """Block size of the store's hashes."""
        return self._store.block_size

    @property
    def lora_int_id(self) -> int:
        """The LoRA id that enters the block hashes (0: none)."""
        return self._store.lora_id

    @property
    def cache_salt(self) -> Union[str, bytes, None]:
        """The tenant salt that enters the first block's hash (None: none)."""
        return self._cache_salt

    # -- copies ------------------------------------------------------------------------------

    def copy(self) -> SequenceData:
        """An independent copy: O(L) memcpy for the store, O(output) for the output list.

        The prompt list is shared: it is read-only and never grows, so sharing is safe.
        """
        new = SequenceData.__new__(SequenceData)
        new._prompt = self._prompt
        new._output = TokenIdList(self._output)
        new._store = self._store.copy()
        new.cumulative_logprob = self.cumulative_logprob
        new._num_computed_tokens = self._num_computed_tokens
        new._stage = self._stage
        new._cache_salt = self._cache_salt
        new._strict = self._strict
        return new

    def __copy__(self) -> SequenceData:
        # Two SequenceData sharing one store would see each other's appends: always copy.
        return self.copy()

    def __deepcopy__(self, memo: Dict[int, Any]) -> SequenceData:
        return self.copy()

    def __reduce__(self) -> Any:
        # The native store is not picklable; rebuild it (same hasher, so equal hashes).
        hash_algo, hash_seed = self._store.hasher
        config = (
            self.block_size,
            self.lora_int_id,
            self._cache_salt,
            hash_algo,
            hash_seed,
            self._strict,
        )
        progress = (self.cumulative_logprob, self._num_computed_tokens, self._stage)
        return (_rebuild_sequence_data, (list(self._prompt), list(self._output), config, progress))

    def __repr__(self) -> str:
        return (
            f"SequenceData(prompt_token_ids={list(self._prompt)}, "
            f"output_token_ids={list(self._output)}, "
            f"cumulative_logprob={self.cumulative_logprob})"
        )


def _rebuild_sequence_data(
    prompt: List[int], output: List[int], config: tuple, progress: tuple
) -> SequenceData:
    block_size, lora_int_id, cache_salt, hash_algo, hash_seed, strict = config
    data = SequenceData(
        prompt,
        output,
        block_size=block_size,
        lora_int_id=lora_int_id,
        cache_salt=cache_salt,
        hash_algo=hash_algo,
        hash_seed=hash_seed,
        strict=strict,
    )
    data.cumulative_logprob, data._num_computed_tokens, data._stage = progress
    return data


def _check_seq_id(seq_id: Any) -> int:
    # The native block manager reads seq_id as an integer key.
    if isinstance(seq_id, bool) or not isinstance(seq_id, int):
        raise ArgumentTypeError(f"seq_id must be an int, got {type(seq_id).__name__}")
    return seq_id


def _copy_logprob(lp: Any) -> Any:
    if type(lp) is Logprob:
        return Logprob(lp.logprob, lp.rank, lp.decoded_token)
    return copy.deepcopy(lp)


def _copy_sample_logprobs(logprobs: List[Dict[int, Any]]) -> List[Dict[int, Any]]:
    """What ``copy.deepcopy`` makes of a sequence's per-token logprob dicts, without its memo
    bookkeeping (a fork copies a handful of small dicts per output token)."""
    return [{tok: _copy_logprob(lp) for tok, lp in d.items()} for d in logprobs]


# Attributes of a Sequence that cache its logical blocks; never copied, rebuilt on demand.
_LOGICAL_CACHE = ("_logical_blocks", "_logical_len", "_logical_data")


_PREFILL = SequenceStage.PREFILL
_DECODE = SequenceStage.DECODE


class SequenceAccessors:
    """The accessors both sequence classes share (this one and the plain-Python reference in
    :mod:`pagedkv.vllm_042.reference.sequence`): everything that only reads ``self.data``,
    ``self.status``, ``self.block_size``, ``self.lora_request`` and ``self.output_text``."""

    data: Any
    status: SequenceStatus
    block_size: int
    lora_request: Optional[LoRARequest]
    output_text: str

    @property
    def lora_int_id(self) -> int:
        """The request's LoRA id (0 without a LoRA request)."""
        return self.lora_request.lora_int_id if self.lora_request else 0

    def num_hashed_tokens_of_block(self, logical_idx: int) -> int:
        """Tokens hashed up to and including logical block ``logical_idx`` (vLLM's cache key)."""
        return logical_idx * self.block_size + self.block_size

    def get_len(self) -> int:
        """Prompt plus output length, in tokens."""
        return self.data.get_len()

    def get_prompt_len(self) -> int:
        """Number of prompt tokens."""
        return self.data.get_prompt_len()

    def get_output_len(self) -> int:
        """Number of output tokens."""
        return self.data.get_output_len()

    def get_token_ids(self) -> List[int]:
        """Prompt followed by output token ids (a new list)."""
        return self.data.get_token_ids()

    def get_last_token_id(self) -> int:
        """The newest token id."""
        return self.data.get_last_token_id()

    def get_output_token_ids(self) -> List[int]:
        """The output token ids."""
        return self.data.get_output_token_ids()

    def get_prompt_token_ids(self) -> List[int]:
        """The prompt token ids."""
        return self.data.get_prompt_token_ids()

    @property
    def prompt_token_ids(self) -> List[int]:
        """The prompt's token ids (vLLM 0.5 reads them from the sequence)."""
        return self.data.get_prompt_token_ids()

    def get_cumulative_logprob(self) -> float:
        """Sum of the logprobs of the sampled tokens."""
        return self.data.cumulative_logprob

    def get_output_text_to_return(self, buffer_length: int) -> str:
        """Output text minus the last ``buffer_length`` characters while still generating
        (they may change as detokenization proceeds)."""
        truncate = buffer_length and not self.is_finished()
        return self.output_text[:-buffer_length] if truncate else self.output_text

    def get_beam_search_score(
        self,
        length_penalty: float = 1.0,
        seq_len: Optional[int] = None,
        eos_token_id: Optional[int] = None,
    ) -> float:
        """Cumulative logprob / seq_len ** length_penalty (HuggingFace's beam score).

        Without ``seq_len`` the sequence length is used, minus one if the sequence ends with
        ``eos_token_id`` (HuggingFace does not count the EOS token).
        """
        if seq_len is None:
            seq_len = self.get_len()
            if eos_token_id is not None and self.get_last_token_id() == eos_token_id:
                seq_len -= 1
        return self.get_cumulative_logprob() / (seq_len**length_penalty)

    def is_finished(self) -> bool:
        """Whether the sequence's status is one of the FINISHED_* statuses."""
        return self.status in _FINISHED_STATUSES

    def get_num_new_tokens(self) -> int:
        """Tokens to compute in the next step: 1 when decoding, else the uncomputed rest
        (chunked prefill computes it over several steps)."""
        data = self.data
        if data._stage == _DECODE:
            return 1
        return data.get_num_uncomputed_tokens()

    def is_prefill(self) -> bool:
        """Whether the sequence is still in its prefill stage."""
        # ``_stage``, not the ``stage`` property: vLLM's scheduler asks several times per
        # group per step (both SequenceData classes keep the stage there).
        return self.data._stage == _PREFILL

    def reset_state_for_recompute(self) -> None:
        """Recompute preemption: back to the prefill stage with nothing computed."""
        self.data.reset_state_for_recompute()


class Sequence(SequenceAccessors):
    """One sequence (prompt + generated tokens) of a request.

    Args:
        seq_id: The sequence id (an int, unique within the engine).
        prompt: The prompt text.
        prompt_token_ids: The prompt's token ids (list, tuple or 1-D int array).
        block_size: Tokens per KV-cache block.
        eos_token_id: The end-of-sequence token id, if any.
        lora_request: The LoRA adapter; its ``lora_int_id`` enters the block hashes.
        cache_salt: Optional salt mixed into the first block's hash (and so into every later
            one): sequences with different salts never share cached blocks.
        strict: Refuse a negative computed-token count (vLLM stores it; see
            :meth:`SequenceData.update_num_computed_tokens`).
    """

    def __init__(
        self,
        seq_id: int,
        prompt: str,
        prompt_token_ids: List[int],
        block_size: int,
        eos_token_id: Optional[int] = None,
        lora_request: Optional[LoRARequest] = None,
        *,
        cache_salt: Union[str, bytes, None] = None,
        strict: bool = False,
    ) -> None:
        self.seq_id = _check_seq_id(seq_id)
        self.prompt = prompt
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.lora_request = lora_request
        self.cache_salt = cache_salt

        self.data: SequenceData = SequenceData(
            prompt_token_ids,
            block_size=block_size,
            lora_int_id=self.lora_int_id,
            cache_salt=cache_salt,
            strict=strict,
        )
        self.output_logprobs: SampleLogprobs = []
        self.output_text = ""

        self.status = SequenceStatus.WAITING
        self.stop_reason: Union[int, str, None] = None

        # Incremental detokenization state.
        self.prefix_offset = 0
        self.read_offset = 0
        self.tokens: Optional[List[str]] = None

        self._logical_blocks: Optional[List[LogicalTokenBlock]] = None
        self._logical_len = 0
        self._logical_data: Optional[SequenceData] = None

    # vLLM 0.5 reads the multi-modal input from the sequence (0.4.2 from the group only).
    multi_modal_data: Optional[MultiModalData] = None

    # The length accessors read the SequenceData's slots directly: vLLM's scheduler and
    # engine call them for every sequence every step (``self.data`` is always ours).
    def get_len(self) -> int:
        """Prompt plus output length, in tokens."""
        data = self.data
        return len(data._prompt) + len(data._output)

    def get_output_len(self) -> int:
        """Number of output tokens."""
        return len(self.data._output)

    def get_prompt_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.data._prompt)

    @property
    def n_blocks(self) -> int:
        """Number of logical blocks: ceil(len / block_size)."""
        return -(-self.data.get_len() // self.block_size)

    # -- logical blocks (compatibility view) -------------------------------------------------

    @property
    def logical_token_blocks(self) -> List[LogicalTokenBlock]:
        """vLLM's logical blocks, built from the tokens on first access and cached.

        Appending a token does not touch this list; the next access extends it with the tokens
        appended since (O(new tokens)). Hold on to the list only as long as you append nothing.
        """
        data = self.data
        blocks = self._logical_blocks
        if blocks is None or self._logical_data is not data:
            blocks = []
            self._logical_blocks = blocks
            self._logical_data = data
            self._logical_len = 0
        length = data.get_len()
        if self._logical_len < length:
            self._fill_logical_blocks(blocks, data.token_ids_from(self._logical_len))
            self._logical_len = length
        return blocks

    def _fill_logical_blocks(self, blocks: List[LogicalTokenBlock], token_ids: List[int]) -> None:
        bs = self.block_size
        cursor = 0
        if blocks and not blocks[-1].is_full():
            last = blocks[-1]
            cursor = min(last.get_num_empty_slots(), len(token_ids))
            last.append_tokens(token_ids[:cursor])
        while cursor < len(token_ids):
            block = LogicalTokenBlock(block_number=len(blocks), block_size=bs)
            block.append_tokens(token_ids[cursor : cursor + bs])
            blocks.append(block)
            cursor += bs

    def block_token_ids(self, logical_idx: int) -> List[int]:
        """Token ids of logical block ``logical_idx`` (the last block may be partial)."""
        if not 0 <= logical_idx < self.n_blocks:
            raise InvalidArgumentError(
                f"sequence {self.seq_id}: block {logical_idx} does not exist "
                f"(the sequence has {self.n_blocks} blocks)"
            )
        return self.data._store.block_tokens(logical_idx)

    # -- hashing -----------------------------------------------------------------------------

    def hash_of_block(self, logical_idx: int) -> int:
        """The chained hash of full block ``logical_idx``, computed when the block filled: O(1).

        Covers tokens ``[0, (logical_idx + 1) * block_size)``, the LoRA id and the cache salt.
        A block that is not full has no hash: ``ValueError`` (also when block_size exceeds the
        prompt length, where vLLM 0.4.2 returned a hash of the partial prefix).
        """
        try:
            return self.data._store.hash_of_block(logical_idx)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"sequence {self.seq_id}: {exc}") from None
        except OverflowError:  # an index beyond i64: no such block either
            raise InvalidArgumentError(
                f"sequence {self.seq_id}: block {logical_idx} is not full: only full blocks "
                "have a hash"
            ) from None

    # -- appending ---------------------------------------------------------------------------

    def append_token_id(self, token_id: int, logprobs: Dict[int, Logprob]) -> None:
        """Append a sampled token; ``logprobs`` maps candidate token ids to their Logprob and
        must contain ``token_id``. All or nothing: on error the sequence is unchanged."""
        try:
            logprob = logprobs[token_id].logprob
        except KeyError:
            raise InvalidArgumentError(
                f"sequence {self.seq_id}: token {token_id!r} is missing from its logprobs dict"
            ) from None
        except (TypeError, AttributeError):
            raise ArgumentTypeError(
                f"sequence {self.seq_id}: logprobs must map token ids to Logprob objects, got "
                f"{type(logprobs).__name__}"
            ) from None
        # SequenceData.append_token_id, inlined: this runs once per sequence per decode step
        # and the extra Python call cost about a third of it. Same order: the store validates
        # the token before anything changes.
        data = self.data
        cumulative = data.cumulative_logprob + logprob
        data._store.append(token_id)
        _list_append(data._output, token_id)
        data.cumulative_logprob = cumulative
        self.output_logprobs.append(logprobs)

    # -- accessors ---------------------------------------------------------------------------

    # -- copies ------------------------------------------------------------------------------

    def fork(self, new_seq_id: int) -> Sequence:
        """An independent copy with id ``new_seq_id`` (beam search / parallel sampling).

        O(L) native memcpy for the tokens; the logprob containers (a dict and its ``Logprob``
        objects per output token) are copied, as vLLM's ``copy.deepcopy`` does, so that writing
        into the child's (detokenization sets ``decoded_token``) never changes the parent.
        """
        new_seq_id = _check_seq_id(new_seq_id)
        child = self._clone()
        child.seq_id = new_seq_id
        return child

    def _clone(self) -> Sequence:
        cls = type(self)
        child = cls.__new__(cls)
        state = self.__dict__.copy()
        state["data"] = self.data.copy()
        state["output_logprobs"] = _copy_sample_logprobs(self.output_logprobs)
        if self.tokens is not None:
            state["tokens"] = self.tokens.copy()
        state["_logical_blocks"] = None
        state["_logical_len"] = 0
        state["_logical_data"] = None
        child.__dict__.update(state)
        return child

    def __copy__(self) -> Sequence:
        # A shallow copy sharing the token store would let two sequences append to one store;
        # a copy is as cheap as a fork, so copy.copy returns an independent sequence.
        return self._clone()

    def __deepcopy__(self, memo: Dict[int, Any]) -> Sequence:
        cls = type(self)
        child = cls.__new__(cls)
        memo[id(self)] = child
        state = {k: v for k, v in self.__dict__.items() if k not in _LOGICAL_CACHE}
        child.__dict__.update(copy.deepcopy(state, memo))
        child._logical_blocks = None
        child._logical_len = 0
        child._logical_data = None
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.name}, num_blocks={self.n_blocks})"
        )


@dataclass
class SequenceGroupState:
    """Mutable state tied to a request (beam search / seeded sampling RNG)."""

    generator: Optional[Any] = None


class SequenceGroup:
    """The sequences generated from one prompt (one request).

    Args:
        request_id: The request id.
        seqs: The sequences (ids must be unique).
        sampling_params: The sampling parameters.
        arrival_time: When the request arrived.
        lora_request: The LoRA adapter, if any.
        multi_modal_data: Multi-modal input, if any.
    """

    def __init__(
        self,
        request_id: str,
        seqs: List[Sequence],
        sampling_params: SamplingParams,
        arrival_time: float,
        lora_request: Optional[LoRARequest] = None,
        multi_modal_data: Optional[MultiModalData] = None,
        *,
        embeddings: Optional[Any] = None,
        pooling_params: Optional[Any] = None,
        encoder_seq: Optional[Sequence] = None,
    ) -> None:
        self.request_id = request_id
        self.encoder_seq = encoder_seq  # vLLM 0.5: encoder/decoder models
        self.seqs_dict: Dict[int, Sequence] = {}
        # vLLM 0.5 reads these (embedding models); None for generation requests.
        self.embeddings = embeddings
        self.pooling_params = pooling_params
        for seq in seqs:
            self.add(seq)
        self.sampling_params = sampling_params
        self.metrics = RequestMetrics(
            arrival_time=arrival_time,
            last_token_time=arrival_time,
            first_scheduled_time=None,
            first_token_time=None,
            time_in_queue=None,
        )
        self.lora_request = lora_request
        self.prompt_logprobs: Optional[PromptLogprobs] = None
        self.state = SequenceGroupState()
        self.multi_modal_data = multi_modal_data

    def _first_seq(self) -> Sequence:
        for seq in self.seqs_dict.values():
            return seq
        raise ValueError(f"sequence group {self.request_id!r} has no sequences")

    @property
    def prompt(self) -> str:
        """The prompt text (shared by every sequence of the group)."""
        # Every sequence of a group has the same prompt.
        return self._first_seq().prompt

    @property
    def prompt_token_ids(self) -> List[int]:
        """The prompt token ids (shared by every sequence of the group)."""
        return self._first_seq().data.prompt_token_ids

    @property
    def lora_int_id(self) -> int:
        """The request's LoRA id (0 without a LoRA request)."""
        return self.lora_request.lora_int_id if self.lora_request else 0

    # -- metrics -----------------------------------------------------------------------------

    def get_last_latency(self, now: float) -> float:
        """Time since the previous token (or arrival); records ``now`` as the latest token."""
        latency = now - self.metrics.last_token_time
        self.metrics.last_token_time = now
        return latency

    def maybe_set_first_token_time(self, time: float) -> None:
        """Record the time of the first generated token (the first call wins)."""
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time

    def maybe_set_first_scheduled_time(self, time: float) -> None:
        """Record when the request was first scheduled and how long it queued (first call)."""
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = time
            self.metrics.time_in_queue = time - self.metrics.arrival_time

    def set_finished_time(self, time: Optional[float]) -> None:
        """Set the request's finished time in ``metrics`` (once; later calls keep the first)."""
        self.metrics.finished_time = time

    # -- sequences ---------------------------------------------------------------------------

    # The methods vLLM's scheduler calls for every group every step have a fast path for the
    # common one-sequence group and no nested calls (each must cost no more than vLLM's own).

    def get_max_num_running_seqs(self) -> int:
        """The most sequences this request will run in parallel for the rest of its life
        (the scheduler reserves room for them)."""
        params = self.sampling_params
        if params.use_beam_search:
            # Beam search always keeps best_of candidates alive.
            return params.best_of
        seqs = self.seqs_dict
        if params.best_of > len(seqs):
            # Still in the prompt stage with one sequence: it forks into best_of.
            return params.best_of
        n = 0  # num_unfinished_seqs(), inlined
        for seq in seqs.values():
            if seq.status not in _FINISHED_STATUSES:
                n += 1
        return n

    def get_seqs(self, status: Optional[SequenceStatus] = None) -> List[Sequence]:
        """The group's sequences, or only those with ``status``."""
        seqs = self.seqs_dict
        if status is None:
            return [*seqs.values()]  # no global lookup and call of ``list``
        if len(seqs) == 1:
            for seq in seqs.values():  # cheaper than unpacking the view
                return [seq] if seq.status == status else []
        # a plain loop: in CPython 3.11 a list comprehension pays a function call, more than
        # the appends of a few-sequence group cost
        out = []
        for seq in seqs.values():
            if seq.status == status:
                out.append(seq)
        return out

    def get_unfinished_seqs(self) -> List[Sequence]:
        """The sequences that have not finished."""
        out = []
        for seq in self.seqs_dict.values():
            if seq.status not in _FINISHED_STATUSES:
                out.append(seq)
        return out

    def get_finished_seqs(self) -> List[Sequence]:
        """The sequences that have finished."""
        out = []
        for seq in self.seqs_dict.values():
            if seq.status in _FINISHED_STATUSES:
                out.append(seq)
        return out

    def update_num_computed_tokens(self, num_new_computed_tokens: int) -> None:
        """Advance the prefill progress of every unfinished sequence."""
        # The engine runs this for every scheduled group every step: our SequenceData's
        # accepted case is inlined (same result as its method); the method handles the rest
        # (errors, negative totals, other SequenceData classes).
        for seq in self.seqs_dict.values():
            if seq.status in _FINISHED_STATUSES:
                continue
            data = seq.data
            if type(data) is SequenceData:
                total = data._num_computed_tokens + num_new_computed_tokens
                length = len(data._prompt) + len(data._output)
                if 0 <= total <= length:
                    data._num_computed_tokens = total
                    if total == length:
                        data._stage = _DECODE
                    continue
            data.update_num_computed_tokens(num_new_computed_tokens)

    def get_num_uncomputed_tokens(self) -> int:
        """Tokens not yet computed, over the unfinished sequences."""
        n = 0
        for seq in self.seqs_dict.values():
            if seq.status not in _FINISHED_STATUSES:
                n += seq.data.get_num_uncomputed_tokens()
        return n

    def num_seqs(self, status: Optional[SequenceStatus] = None) -> int:
        """Number of sequences, or of those with ``status``."""
        if status is None:
            return len(self.seqs_dict)
        n = 0
        for seq in self.seqs_dict.values():
            if seq.status == status:
                n += 1
        return n

    def num_unfinished_seqs(self) -> int:
        """Number of unfinished sequences."""
        n = 0
        for seq in self.seqs_dict.values():
            if seq.status not in _FINISHED_STATUSES:
                n += 1
        return n

    def num_finished_seqs(self) -> int:
        """Number of finished sequences."""
        return len(self.seqs_dict) - self.num_unfinished_seqs()

    def find(self, seq_id: int) -> Sequence:
        """The sequence with ``seq_id`` (``UnknownSequenceError`` if absent)."""
        try:
            return self.seqs_dict[seq_id]
        except KeyError:
            raise ValueError(f"Sequence {seq_id} not found.") from None

    def add(self, seq: Sequence) -> None:
        """Add a forked sequence to the group (its id must be new)."""
        try:
            seq_id = seq.seq_id
        except AttributeError:
            raise ArgumentTypeError(
                f"sequence group {self.request_id!r}: expected a Sequence, got {type(seq).__name__}"
            ) from None
        if seq_id in self.seqs_dict:
            raise ValueError(f"Sequence {seq_id} already exists.")
        self.seqs_dict[seq_id] = seq

    def remove(self, seq_id: int) -> None:
        """Remove the sequence with ``seq_id`` from the group."""
        if seq_id not in self.seqs_dict:
            raise ValueError(f"Sequence {seq_id} not found.")
        del self.seqs_dict[seq_id]

    def is_finished(self) -> bool:
        """Whether every sequence of the group has finished."""
        for seq in self.seqs_dict.values():
            if seq.status not in _FINISHED_STATUSES:
                return False
        return True

    def is_encoder_decoder(self) -> bool:
        """Whether the group has an encoder sequence (never: decoder-only)."""
        return self.encoder_seq is not None

    def get_encoder_seq(self) -> Optional[Sequence]:
        """The encoder sequence (None: decoder-only)."""
        return self.encoder_seq

    def is_prefill(self) -> bool:
        """Whether the group is still in its prefill stage."""
        # Every sequence of a group is in the same stage: ask the first one (inlined).
        for seq in self.seqs_dict.values():
            return seq.data._stage == _PREFILL
        raise ValueError(f"sequence group {self.request_id!r} has no sequences")

    def __repr__(self) -> str:
        return (
            f"SequenceGroup(request_id={self.request_id}, "
            f"sampling_params={self.sampling_params}, num_seqs={len(self.seqs_dict)})"
        )


class SequenceGroupMetadata:
    """What the workers need to run one sequence group for one step.

    Args:
        request_id: The request id.
        is_prompt: Whether this step is (a chunk of) the prefill.
        seq_data: seq_id -> SequenceData.
        sampling_params: The sampling parameters.
        block_tables: seq_id -> physical block numbers.
        do_sample: False skips sampling (an intermediate chunk of a chunked prefill).
        token_chunk_size: Tokens to process this step; default: the whole sequence for a
            prompt step, 1 for a decode step.
        lora_request: The LoRA adapter, if any.
        computed_block_nums: Blocks already computed (prefix caching).
        state: Request-level mutable state (RNG); a fresh one by default.
        multi_modal_data: Multi-modal input, if any.
        const_block_idx: Extra block index map for models with a constant-size cache.
    """

    def __init__(
        self,
        request_id: str,
        is_prompt: bool,
        seq_data: Dict[int, SequenceData],
        sampling_params: SamplingParams,
        block_tables: Dict[int, List[int]],
        do_sample: bool = True,
        token_chunk_size: Optional[int] = None,
        lora_request: Optional[LoRARequest] = None,
        computed_block_nums: Optional[List[int]] = None,
        state: Optional[SequenceGroupState] = None,
        multi_modal_data: Optional[MultiModalData] = None,
        const_block_idx: Optional[Dict[int, int]] = None,
        *,
        pooling_params: Optional[Any] = None,
        encoder_seq_data: Optional[SequenceData] = None,
        cross_block_table: Optional[List[int]] = None,
    ) -> None:
        self.request_id = request_id
        self.is_prompt = is_prompt
        # vLLM 0.5's fields (embedding models, encoder/decoder models); keyword-only here
        # because 0.5 inserted pooling_params positionally before token_chunk_size.
        self.pooling_params = pooling_params
        self.encoder_seq_data = encoder_seq_data
        self.cross_block_table = cross_block_table
        self.num_speculative_tokens = None
        self.seq_data = seq_data
        self.sampling_params = sampling_params
        self.block_tables = block_tables
        self.do_sample = do_sample
        self.lora_request = lora_request
        self.computed_block_nums = computed_block_nums
        self.state = SequenceGroupState() if state is None else state
        self.multi_modal_data = multi_modal_data
        self.const_block_idx = const_block_idx

        if token_chunk_size is None:
            if is_prompt:
                if not seq_data:
                    raise ValueError("a prompt step needs seq_data to size its token chunk")
                token_chunk_size = next(iter(seq_data.values())).get_len()
            else:
                token_chunk_size = 1  # a decode step computes one token per sequence
        self._token_chunk_size = token_chunk_size

    @property
    def lora_int_id(self) -> int:
        """The request's LoRA id (0 without a LoRA request)."""
        return self.lora_request.lora_int_id if self.lora_request else 0

    @property
    def token_chunk_size(self) -> int:
        """Tokens to process in this step."""
        return self._token_chunk_size

    def __repr__(self) -> str:
        return (
            f"SequenceGroupMetadata(request_id={self.request_id}, is_prompt={self.is_prompt}, "
            f"seq_ids={list(self.seq_data)}, token_chunk_size={self._token_chunk_size})"
        )


@dataclass
class ExecuteModelRequest:
    """One model step, from the scheduler to the executor/workers."""

    seq_group_metadata_list: List[SequenceGroupMetadata]
    # cpu block -> gpu block to swap in.
    blocks_to_swap_in: Dict[int, int] = field(default_factory=dict)
    # gpu block -> cpu block to swap out.
    blocks_to_swap_out: Dict[int, int] = field(default_factory=dict)
    # copy-on-write: source block -> destination blocks.
    blocks_to_copy: Dict[int, List[int]] = field(default_factory=dict)
    num_lookahead_slots: int = 0
    running_queue_size: int = 0

    def clone(self, seq_group_metadata_list: List[SequenceGroupMetadata]) -> ExecuteModelRequest:
        """The same request for other sequence groups (the block maps are copied)."""
        return ExecuteModelRequest(
            seq_group_metadata_list=seq_group_metadata_list,
            blocks_to_swap_in=self.blocks_to_swap_in.copy(),
            blocks_to_swap_out=self.blocks_to_swap_out.copy(),
            blocks_to_copy={src: list(dst) for src, dst in self.blocks_to_copy.items()},
            num_lookahead_slots=self.num_lookahead_slots,
            running_queue_size=self.running_queue_size,
        )
