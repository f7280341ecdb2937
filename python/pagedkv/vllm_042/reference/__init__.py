"""The same semantics as pagedkv, in plain Python: the test oracle and the benchmark baseline.

* :mod:`~pagedkv.vllm_042.reference.hashing`: vLLM-v1-style chained block hash (sha256 of a pickle).
* :class:`BlockPool`: one device's blocks with ref counts, a prefix cache and LRU eviction.
* :class:`BlockSpaceManager`: ``docs/block_manager.md`` line by line.
* :class:`Sequence` / :class:`SequenceData`: tokens in Python lists, hashed incrementally.

Nothing here imports the native module's hot paths; it is meant to be read.
"""

from __future__ import annotations

from pagedkv.vllm_042.reference import hashing
from pagedkv.vllm_042.reference.block_manager import AllocStatus, BlockSpaceManager
from pagedkv.vllm_042.reference.pool import BlockPool
from pagedkv.vllm_042.reference.sequence import Sequence, SequenceData

__all__ = ["hashing", "AllocStatus", "BlockPool", "BlockSpaceManager", "Sequence", "SequenceData"]
