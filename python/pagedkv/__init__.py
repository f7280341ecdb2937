"""pagedkv: KV-cache block management for paged-attention LLM serving, in Rust.

The public API mirrors vLLM's ``vllm/sequence.py`` and its block manager, so an engine can
switch with an import change::

    from pagedkv import BlockSpaceManager, Sequence, SequenceGroup, SamplingParams

The native module ``pagedkv._native`` is private. The torch side (KV-cache ops, paged attention)
lives in :mod:`pagedkv.attention` and needs the ``pagedkv[torch]`` extra; the pure-Python
reference implementation lives in :mod:`pagedkv.vllm_042.reference`.
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
    ArgumentTypeError,
    DoubleFreeError,
    InUseError,
    InvalidArgumentError,
    OutOfBlocksError,
    PagedKVError,
    UnknownSequenceError,
)
from pagedkv.vllm_042.block import Device, LogicalTokenBlock, PhysicalTokenBlock
from pagedkv.vllm_042.block_manager import AllocStatus, BlockMapping, BlockSpaceManager
from pagedkv.vllm_042.scheduler import (
    CacheConfig,
    LoRAConfig,
    ScheduledSequenceGroup,
    Scheduler,
    SchedulerConfig,
    SchedulerOutputs,
)
from pagedkv.vllm_042.sequence import (
    ExecuteModelRequest,
    RequestMetrics,
    Sequence,
    SequenceData,
    SequenceGroup,
    SequenceGroupMetadata,
    SequenceGroupState,
    SequenceStage,
    SequenceStatus,
)
from pagedkv.vllm_042.types import Logprob, LoRARequest, MultiModalData, SamplingParams

__all__ = [
    "__version__",
    # sequences (vllm/sequence.py)
    "SequenceStatus",
    "SequenceStage",
    "SequenceData",
    "Sequence",
    "SequenceGroup",
    "SequenceGroupState",
    "RequestMetrics",
    "SequenceGroupMetadata",
    "ExecuteModelRequest",
    "SamplingParams",
    "Logprob",
    "LoRARequest",
    "MultiModalData",
    # blocks and the manager
    "Device",
    "LogicalTokenBlock",
    "PhysicalTokenBlock",
    "AllocStatus",
    "BlockMapping",
    "BlockSpaceManager",
    # the scheduler (vllm/core/scheduler.py)
    "Scheduler",
    "SchedulerConfig",
    "CacheConfig",
    "LoRAConfig",
    "SchedulerOutputs",
    "ScheduledSequenceGroup",
    # errors
    "PagedKVError",
    "InvalidArgumentError",
    "InUseError",
    "ArgumentTypeError",
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
