"""Plain-Python ``Sequence``/``SequenceData``: the test oracle and benchmark baseline.

This is how vLLM keeps a sequence, with one modernisation: tokens live in Python lists, every
token is appended to an eagerly maintained list of ``LogicalTokenBlock`` objects, ``fork`` is
``copy.deepcopy``, and each block is hashed vLLM-v1-style (sha256 over pickle, chained, see
:mod:`pagedkv.vllm_042.reference.hashing`) when it fills, instead of vLLM 0.4.2's O(L) re-hash per
call.

The method names and semantics are those of :class:`pagedkv.vllm_042.sequence.Sequence`, so the same
tests, block managers and benchmarks run on either. Sequence groups, metadata and statuses hold
no token data and are shared with :mod:`pagedkv.vllm_042.sequence`.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Union

from pagedkv.errors import InvalidArgumentError
from pagedkv.vllm_042.block import LogicalTokenBlock
from pagedkv.vllm_042.reference.hashing import hash_block
from pagedkv.vllm_042.sequence import (
    ExecuteModelRequest,
    RequestMetrics,
    SampleLogprobs,
    SequenceAccessors,
    SequenceGroup,
    SequenceGroupMetadata,
    SequenceGroupState,
    SequenceStage,
    SequenceStatus,
)
from pagedkv.vllm_042.types import Logprob, LoRARequest

__all__ = [
    "ExecuteModelRequest",
    "RequestMetrics",
    "Sequence",
    "SequenceData",
    "SequenceGroup",
    "SequenceGroupMetadata",
    "SequenceGroupState",
    "SequenceStage",
    "SequenceStatus",
]


class SequenceData:
    """Token ids (two Python lists), cumulative logprob and prefill progress."""

    def __init__(
        self, prompt_token_ids: List[int], output_token_ids: Optional[List[int]] = None
    ) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = [] if output_token_ids is None else output_token_ids
        self.cumulative_logprob = 0.0
        self._num_computed_tokens = 0
        self._stage = SequenceStage.PREFILL

    def append_token_id(self, token_id: int, logprob: float) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def get_len(self) -> int:
        return len(self.output_token_ids) + len(self.prompt_token_ids)

    def get_prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> List[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_prompt_token_ids(self) -> List[int]:
        return self.prompt_token_ids

    def get_output_token_ids(self) -> List[int]:
        return self.output_token_ids

    def get_last_token_id(self) -> int:
        if not self.output_token_ids:
            return self.prompt_token_ids[-1]
        return self.output_token_ids[-1]

    def get_num_computed_tokens(self) -> int:
        return self._num_computed_tokens

    def update_num_computed_tokens(self, num_new_computed_tokens: int) -> None:
        # vLLM's rule: only the upper bound is checked (a negative chunk from vLLM 0.4.2's
        # chunked-prefill scheduler is stored and rescheduled next step).
        total = self._num_computed_tokens + num_new_computed_tokens
        if total > self.get_len():
            raise InvalidArgumentError(
                f"cannot mark {num_new_computed_tokens} more tokens as computed: "
                f"{self._num_computed_tokens} of {self.get_len()} are computed already"
            )
        self._num_computed_tokens = total
        if self.get_num_uncomputed_tokens() == 0:
            self._stage = SequenceStage.DECODE

    def reset_state_for_recompute(self) -> None:
        self._num_computed_tokens = 0
        self._stage = SequenceStage.PREFILL

    def get_num_uncomputed_tokens(self) -> int:
        return self.get_len() - self.get_num_computed_tokens()

    @property
    def stage(self) -> SequenceStage:
        return self._stage

    def __repr__(self) -> str:
        return (
            f"SequenceData(prompt_token_ids={self.prompt_token_ids}, "
            f"output_token_ids={self.output_token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob})"
        )


class Sequence(SequenceAccessors):
    """A sequence with eager logical blocks and per-block sha256 hashes (see module doc)."""

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
    ) -> None:
        self.seq_id = seq_id
        self.prompt = prompt
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.lora_request = lora_request
        self.cache_salt = cache_salt

        self.data = SequenceData(list(prompt_token_ids))
        self.output_logprobs: SampleLogprobs = []
        self.output_text = ""

        self.logical_token_blocks: List[LogicalTokenBlock] = []
        # _block_hashes[i] is the chained hash of logical block i, set when the block fills.
        self._block_hashes: List[int] = []
        self._append_tokens_to_blocks(self.data.prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.stop_reason: Union[int, str, None] = None

        self.prefix_offset = 0
        self.read_offset = 0
        self.tokens: Optional[List[str]] = None

    @property
    def n_blocks(self) -> int:
        return len(self.logical_token_blocks)

    def _append_tokens_to_blocks(self, token_ids: List[int]) -> None:
        cursor = 0
        while cursor < len(token_ids):
            if not self.logical_token_blocks or self.logical_token_blocks[-1].is_full():
                self.logical_token_blocks.append(
                    LogicalTokenBlock(len(self.logical_token_blocks), self.block_size)
                )
            last = self.logical_token_blocks[-1]
            take = last.get_num_empty_slots()
            last.append_tokens(token_ids[cursor : cursor + take])
            cursor += take
            if last.is_full():
                parent = self._block_hashes[-1] if self._block_hashes else None
                self._block_hashes.append(
                    hash_block(parent, last.token_ids, self.lora_int_id, self.cache_salt)
                )

    def block_token_ids(self, logical_idx: int) -> List[int]:
        if not 0 <= logical_idx < len(self.logical_token_blocks):
            raise InvalidArgumentError(
                f"block {logical_idx} does not exist "
                f"(sequence has {len(self.logical_token_blocks)} blocks)"
            )
        return self.logical_token_blocks[logical_idx].get_token_ids()

    def hash_of_block(self, logical_idx: int) -> int:
        if not 0 <= logical_idx < len(self._block_hashes):
            raise InvalidArgumentError(
                f"sequence {self.seq_id}: block {logical_idx} is not full: "
                "only full blocks have a hash"
            )
        return self._block_hashes[logical_idx]

    def append_token_id(self, token_id: int, logprobs: Dict[int, Logprob]) -> None:
        if token_id not in logprobs:
            raise ValueError(
                f"sequence {self.seq_id}: token {token_id!r} is missing from its logprobs dict"
            )
        self._append_tokens_to_blocks([token_id])
        self.output_logprobs.append(logprobs)
        self.data.append_token_id(token_id, logprobs[token_id].logprob)

    def fork(self, new_seq_id: int) -> Sequence:
        new_seq = copy.deepcopy(self)
        new_seq.seq_id = new_seq_id
        return new_seq

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
            f"num_blocks={len(self.logical_token_blocks)})"
        )
