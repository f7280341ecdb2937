"""Token blocks as vLLM 0.4.2 describes them (``vllm/block.py``).

In pagedkv neither kind of object is on a hot path: a sequence's tokens live in its native
``TokenSeq`` and the block manager keeps physical blocks in Rust. These classes are the views
that ``Sequence.logical_token_blocks`` and the manager's introspection methods hand out, so code
written against vLLM can still read them.
"""

from __future__ import annotations

import enum
from typing import List, Optional

from pagedkv.vllm_042._enum import CompatEnum

__all__ = [
    "BlockTable",
    "DEFAULT_LAST_ACCESSED_TIME",
    "Device",
    "LogicalTokenBlock",
    "PhysicalTokenBlock",
]

# Slots of a logical block that hold no token yet (vLLM's value).
_BLANK_TOKEN_ID = -1

# ``last_accessed`` of a block that was never accessed.
DEFAULT_LAST_ACCESSED_TIME = -1


class Device(CompatEnum):
    """Where a physical block lives."""

    GPU = enum.auto()
    CPU = enum.auto()


class LogicalTokenBlock:
    """A block of consecutive token slots of one sequence, filled left to right.

    ``token_ids`` always has ``block_size`` entries; unfilled slots hold ``-1``.
    """

    def __init__(self, block_number: int, block_size: int) -> None:
        self.block_number = block_number
        self.block_size = block_size
        self.token_ids: List[int] = [_BLANK_TOKEN_ID] * block_size
        self.num_tokens = 0

    def is_empty(self) -> bool:
        """Whether the block holds no token yet."""
        return self.num_tokens == 0

    def get_num_empty_slots(self) -> int:
        """Tokens the block can still take."""
        return self.block_size - self.num_tokens

    def is_full(self) -> bool:
        """Whether the block holds ``block_size`` tokens."""
        return self.num_tokens == self.block_size

    def append_tokens(self, token_ids: List[int]) -> None:
        """Fill the next ``len(token_ids)`` slots; raises ``ValueError`` if they do not fit."""
        n = len(token_ids)
        if n > self.get_num_empty_slots():
            raise ValueError(
                f"cannot append {n} tokens to logical block {self.block_number}: only "
                f"{self.get_num_empty_slots()} of {self.block_size} slots are empty"
            )
        start = self.num_tokens
        self.token_ids[start : start + n] = token_ids
        self.num_tokens = start + n

    def get_token_ids(self) -> List[int]:
        """The filled slots only."""
        return self.token_ids[: self.num_tokens]

    def get_last_token_id(self) -> int:
        """The block's last token id; ``ValueError`` if it is empty."""
        if self.num_tokens == 0:
            raise ValueError(f"logical block {self.block_number} is empty")
        return self.token_ids[self.num_tokens - 1]

    def __repr__(self) -> str:
        return (
            f"LogicalTokenBlock(block_number={self.block_number}, "
            f"num_tokens={self.num_tokens}/{self.block_size}, "
            f"token_ids={self.get_token_ids()})"
        )


class PhysicalTokenBlock:
    """The state of one KV-cache block on a device (a snapshot view of the native pool)."""

    def __init__(
        self,
        device: Device,
        block_number: int,
        block_size: int,
        block_hash: Optional[int],
        num_hashed_tokens: int,
    ) -> None:
        self.device = device
        self.block_number = block_number
        self.block_size = block_size
        self.block_hash = block_hash
        self.num_hashed_tokens = num_hashed_tokens

        self.ref_count = 0
        self.last_accessed: float = DEFAULT_LAST_ACCESSED_TIME
        self.computed = False

    def __repr__(self) -> str:
        return (
            f"PhysicalTokenBlock(device={self.device}, block_number={self.block_number}, "
            f"num_hashed_tokens={self.num_hashed_tokens}, ref_count={self.ref_count}, "
            f"last_accessed={self.last_accessed}, computed={self.computed})"
        )


# A sequence's block table: the physical block of each of its logical blocks.
BlockTable = List[PhysicalTokenBlock]
