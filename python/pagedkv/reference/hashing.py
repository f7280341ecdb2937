"""Re-exports :mod:`pagedkv.vllm_042.reference.hashing`, where the code now lives."""

from pagedkv.vllm_042.reference.hashing import (
    ChainHasher,
    hash_block,
    hash_blocks,
)

__all__ = [
    "hash_block",
    "hash_blocks",
    "ChainHasher",
]
