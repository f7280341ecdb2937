"""The chained block hash the way vLLM v1 computes it, in plain Python: the baseline.

``h_i = sha256(pickle((h_{i-1}, tuple(tokens of block i), extra)))`` with ``h_{-1} = None`` and
``extra`` the LoRA id plus, on block 0 only, the cache salt. Same chaining and same inputs as
the native hasher; a different (slower, cross-process stable) function, so the values differ.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Iterable, List, Optional, Sequence, Union

Salt = Union[str, bytes, None]


def hash_block(
    parent: Optional[int], tokens: Sequence[int], lora_id: int = 0, salt: Salt = None
) -> int:
    """Hash of one full block given its parent's hash (``None`` for block 0)."""
    extra = (lora_id, salt) if parent is None and salt is not None else (lora_id,)
    digest = hashlib.sha256(pickle.dumps((parent, tuple(tokens), extra), protocol=4)).digest()
    return int.from_bytes(digest[:16], "little")


def hash_blocks(
    token_ids: Sequence[int], block_size: int, lora_id: int = 0, salt: Salt = None
) -> List[int]:
    """Chained hashes of every full block of ``token_ids``: O(L)."""
    out: List[int] = []
    parent: Optional[int] = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], lora_id, salt)
        out.append(parent)
    return out


class ChainHasher:
    """Incremental form: ``feed`` tokens, get the hashes of blocks that just became full."""

    def __init__(self, block_size: int, lora_id: int = 0, salt: Salt = None) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.lora_id = lora_id
        self.salt = salt
        self.parent: Optional[int] = None
        self.pending: List[int] = []
        self.num_blocks = 0

    def feed(self, token_ids: Iterable[int]) -> List[int]:
        out: List[int] = []
        for t in token_ids:
            self.pending.append(t)
            if len(self.pending) == self.block_size:
                self.parent = hash_block(self.parent, self.pending, self.lora_id, self.salt)
                self.pending = []
                self.num_blocks += 1
                out.append(self.parent)
        return out
