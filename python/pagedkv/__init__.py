"""pagedkv: KV-cache block management for paged-attention LLM serving, in Rust.

The public API mirrors vLLM's ``vllm/sequence.py`` and its block manager, so an engine can
switch with an import change. The native module ``pagedkv._native`` is private.
"""

from __future__ import annotations

from pagedkv._native import (
    BlockHasher,
    BlockPool,
    TokenSeq,
    __version__,
    get_default_hasher,
    hash_blocks,
    set_default_hasher,
)
from pagedkv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    OutOfBlocksError,
    PagedKVError,
    UnknownSequenceError,
)

__all__ = [
    "__version__",
    # errors
    "PagedKVError",
    "InvalidArgumentError",
    "UnknownSequenceError",
    "DoubleFreeError",
    "OutOfBlocksError",
    # native building blocks
    "BlockHasher",
    "BlockPool",
    "TokenSeq",
    "hash_blocks",
    "get_default_hasher",
    "set_default_hasher",
]
