"""``Scheduler``: vLLM 0.4.2's scheduler (``vllm/core/scheduler.py``), its loop in Rust.

Same public API and the same decisions as vLLM 0.4.2's ``Scheduler``; the queues, budgets,
preemption and per-sequence scheduling state live in the native core
(``rust/core/src/vllm_042/scheduler``), which drives the core of :attr:`Scheduler.block_manager`
directly. The Python ``Sequence``/``SequenceGroup`` objects stay correct views: the statuses the
scheduler changes are written back to them after each call, and what vLLM's engine changes on
running groups (finished statuses, computed tokens) is read back before the next step. The
design, and the vLLM failures this does not copy, are in ``docs/scheduler.md``.

Configuration objects are read by field name, so vLLM's own ``SchedulerConfig``,
``CacheConfig`` and ``LoRAConfig`` work, and so do the small ones defined here (vLLM's field
names and defaults, without vLLM's imports).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterable, List, Optional, Set, Tuple, Union

from pagedkv._native import SchedulerCore
from pagedkv.errors import InvalidArgumentError
from pagedkv.vllm_042.block_manager import BlockSpaceManager
from pagedkv.vllm_042.sequence import Sequence, SequenceGroup, SequenceGroupMetadata
from pagedkv.vllm_042.types import LoRARequest

__all__ = [
    "BlockList",
    "CacheConfig",
    "LoRAConfig",
    "PreemptionMode",
    "ScheduledSequenceGroup",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutputs",
]


class BlockList(list):
    """Block numbers in the scheduler's metadata (``block_tables`` values and
    ``computed_block_nums``): a list that cannot be modified in place.

    The scheduler hands out the same object for a sequence until its table changes (once per
    ``block_size`` decode steps) instead of building a new list every step. Reading works as
    for a list; ``list(x)``, ``x[:]`` or ``x.copy()`` give an ordinary mutable list.
    """

    __slots__ = ()

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: metadata block lists are shared between steps (raises ``TypeError``)."""
        raise TypeError("block lists in scheduler metadata are read-only; copy() them first")

    append = extend = insert = pop = remove = clear = sort = reverse = _read_only
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only  # type: ignore[assignment]

    def copy(self) -> List[int]:  # type: ignore[override]
        """An ordinary, mutable copy."""
        return list(self)

    def __copy__(self) -> List[int]:
        return list(self)

    def __deepcopy__(self, memo: Dict[int, Any]) -> List[int]:
        return list(self)

    def __reduce__(self) -> Any:
        return (list, (list(self),))


class PreemptionMode(enum.Enum):
    """SWAP moves a preempted group's blocks to the CPU; RECOMPUTE frees them and prefills
    the group again later."""

    SWAP = enum.auto()
    RECOMPUTE = enum.auto()


class SchedulerConfig:
    """vLLM 0.4.2's ``SchedulerConfig`` fields and defaults (``max_num_batched_tokens=None``:
    512 with chunked prefill, else ``max(max_model_len, 2048)``), plus ``preemption_mode``
    (``None``, ``"swap"`` or ``"recompute"``: force one mode, as vLLM 0.5's config does)."""

    def __init__(
        self,
        max_num_batched_tokens: Optional[int],
        max_num_seqs: int,
        max_model_len: int,
        use_v2_block_manager: bool = False,
        num_lookahead_slots: int = 0,
        delay_factor: float = 0.0,
        enable_chunked_prefill: bool = False,
        preemption_mode: Optional[str] = None,
    ) -> None:
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 512 if enable_chunked_prefill else max(max_model_len, 2048)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.use_v2_block_manager = use_v2_block_manager
        self.num_lookahead_slots = num_lookahead_slots
        self.delay_factor = delay_factor
        self.chunked_prefill_enabled = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self._verify_args()

    def _verify_args(self) -> None:
        if self.max_num_batched_tokens < self.max_model_len and not self.chunked_prefill_enabled:
            raise InvalidArgumentError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}): the longest sequence could never be "
                "scheduled; raise max_num_batched_tokens or enable chunked prefill"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidArgumentError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if self.num_lookahead_slots < 0:
            raise InvalidArgumentError("num_lookahead_slots must be >= 0")


class CacheConfig:
    """vLLM 0.4.2's ``CacheConfig`` fields and defaults; ``num_gpu_blocks`` and
    ``num_cpu_blocks`` are set after construction (vLLM sets them after profiling) or given
    here as keywords."""

    def __init__(
        self,
        block_size: int,
        gpu_memory_utilization: float = 0.9,
        swap_space: int = 4,
        cache_dtype: str = "auto",
        num_gpu_blocks_override: Optional[int] = None,
        sliding_window: Optional[int] = None,
        enable_prefix_caching: bool = False,
        *,
        num_gpu_blocks: Optional[int] = None,
        num_cpu_blocks: Optional[int] = None,
    ) -> None:
        self.block_size = block_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.swap_space_bytes = swap_space * (1 << 30)
        self.num_gpu_blocks_override = num_gpu_blocks_override
        self.cache_dtype = cache_dtype
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks


@dataclass
class LoRAConfig:
    """vLLM 0.4.2's ``LoRAConfig`` fields (the scheduler reads ``max_loras``)."""

    max_lora_rank: int
    max_loras: int
    fully_sharded_loras: bool = False
    max_cpu_loras: Optional[int] = None
    lora_dtype: Any = None
    lora_extra_vocab_size: int = 256


class ScheduledSequenceGroup:
    """A group scheduled this step and the number of tokens it computes."""

    __slots__ = ("seq_group", "token_chunk_size")

    def __init__(self, seq_group: SequenceGroup, token_chunk_size: int) -> None:
        self.seq_group = seq_group
        self.token_chunk_size = token_chunk_size

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ScheduledSequenceGroup):
            return NotImplemented
        return (self.seq_group, self.token_chunk_size) == (
            other.seq_group,
            other.token_chunk_size,
        )

    def __repr__(self) -> str:
        return (
            f"ScheduledSequenceGroup(seq_group={self.seq_group!r}, "
            f"token_chunk_size={self.token_chunk_size})"
        )


@dataclass
class SchedulerOutputs:
    """The decisions of one step (vLLM's fields). Groups are sorted by LoRA id when any
    scheduled group has a LoRA, as vLLM does."""

    scheduled_seq_groups: List[ScheduledSequenceGroup]
    num_prefill_groups: int
    num_batched_tokens: int
    blocks_to_swap_in: Dict[int, int]
    blocks_to_swap_out: Dict[int, int]
    blocks_to_copy: Dict[int, List[int]]
    ignored_seq_groups: List[SequenceGroup]
    num_lookahead_slots: int
    running_queue_size: int
    num_loras: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.blocks_to_swap_in and self.blocks_to_swap_out:
            raise AssertionError("a step cannot both swap in and swap out")
        self.num_loras = len(self.lora_requests)
        if self.num_loras > 0:
            self.scheduled_seq_groups = sorted(
                self.scheduled_seq_groups,
                key=lambda g: (g.seq_group.lora_int_id, g.seq_group.request_id),
            )

    @classmethod
    def _decided(cls, num_loras: int, **fields: Any) -> SchedulerOutputs:
        """The outputs of :meth:`Scheduler.schedule`, whose groups are already in vLLM's order
        and whose ``num_loras`` the native step counted: the same object the constructor
        builds, without ``__post_init__``'s pass over the groups."""
        if fields["blocks_to_swap_in"] and fields["blocks_to_swap_out"]:
            raise AssertionError("a step cannot both swap in and swap out")
        out = cls.__new__(cls)
        out.__dict__.update(fields)
        out.num_loras = num_loras
        return out

    def is_empty(self) -> bool:
        """Whether nothing was scheduled and nothing is to be swapped or copied."""
        return not (
            self.scheduled_seq_groups
            or self.blocks_to_swap_in
            or self.blocks_to_swap_out
            or self.blocks_to_copy
        )

    @property
    def lora_requests(self) -> Set[LoRARequest]:
        """The LoRA requests of the scheduled groups."""
        return {
            g.seq_group.lora_request
            for g in self.scheduled_seq_groups
            if g.seq_group.lora_request is not None
        }


def _preemption_mode_name(mode: Any) -> Optional[str]:
    if mode is None:
        return None
    name = getattr(mode, "name", mode)
    if not isinstance(name, str):
        raise InvalidArgumentError(f"preemption_mode must be 'swap' or 'recompute', got {mode!r}")
    return name.lower()


class Scheduler:
    """vLLM 0.4.2's ``Scheduler``: ``Scheduler(scheduler_config, cache_config,
    lora_config=None)``.

    ``waiting``, ``running`` and ``swapped`` are read-only snapshots (deques of the
    ``SequenceGroup`` objects in vLLM's order); change them through the methods.
    """

    def __init__(
        self,
        scheduler_config: Any,
        cache_config: Any,
        lora_config: Any = None,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.lora_config = lora_config
        chunked = bool(_field(scheduler_config, "chunked_prefill_enabled", False))
        max_tokens = _count(scheduler_config, "max_num_batched_tokens", 1)
        max_len = _count(scheduler_config, "max_model_len", 1)
        max_seqs = _count(scheduler_config, "max_num_seqs", 1)
        lookahead = _count(scheduler_config, "num_lookahead_slots", 0, default=0)
        max_loras = _count(lora_config, "max_loras", 1) if lora_config else None
        self.prompt_limit = max_len if chunked else min(max_len, max_tokens)
        if _field(scheduler_config, "use_v2_block_manager", False):
            raise InvalidArgumentError(
                "pagedkv.Scheduler implements vLLM's v1 block manager; "
                "use_v2_block_manager must be False"
            )
        for name in ("num_gpu_blocks", "num_cpu_blocks"):
            if getattr(cache_config, name, None) is None:
                raise InvalidArgumentError(f"cache_config.{name} must be set")
        self.block_manager = BlockSpaceManager(
            block_size=cache_config.block_size,
            num_gpu_blocks=cache_config.num_gpu_blocks,
            num_cpu_blocks=cache_config.num_cpu_blocks,
            sliding_window=_window_in_whole_blocks(cache_config),
            enable_caching=bool(getattr(cache_config, "enable_prefix_caching", False)),
        )
        self._core = SchedulerCore(
            self.block_manager,
            max_tokens,
            max_seqs,
            max_len,
            num_lookahead_slots=lookahead,
            delay_factor=float(_field(scheduler_config, "delay_factor", 0.0)),
            chunked_prefill=chunked,
            max_loras=max_loras,
            preemption_mode=_preemption_mode_name(_field(scheduler_config, "preemption_mode")),
        )

    # -- vLLM's public API ---------------------------------------------------------------------

    @property
    def lora_enabled(self) -> bool:
        """Whether a ``LoRAConfig`` was given."""
        return bool(self.lora_config)

    @property
    def num_decoding_tokens_per_seq(self) -> int:
        """Decode tokens per sequence per step: 1 (vLLM 0.4.2 without speculative decoding)."""
        return 1

    @property
    def waiting(self) -> Deque[SequenceGroup]:
        """The waiting groups in vLLM's order (a snapshot; change it through the API)."""
        return deque(self._core.queue("waiting"))

    @property
    def running(self) -> Deque[SequenceGroup]:
        """The running groups in vLLM's order (a snapshot; change it through the API)."""
        return deque(self._core.queue("running"))

    @property
    def swapped(self) -> Deque[SequenceGroup]:
        """The swapped groups in vLLM's order (a snapshot; change it through the API)."""
        return deque(self._core.queue("swapped"))

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        """Queue a new request (one WAITING sequence) at the back of the waiting queue."""
        self._core.add_seq_group(seq_group)

    def abort_seq_group(self, request_id: Union[str, Iterable[str]]) -> None:
        """Remove the requests with these ids from whichever queue holds them; their
        unfinished sequences become FINISHED_ABORTED and are freed. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._core.abort(ids)

    def has_unfinished_seqs(self) -> bool:
        """Whether any group is waiting, running or swapped."""
        return self._core.num_unfinished() != 0

    def get_num_unfinished_seq_groups(self) -> int:
        """Number of groups waiting, running or swapped."""
        return self._core.num_unfinished()

    def schedule(self) -> Tuple[List[SequenceGroupMetadata], SchedulerOutputs]:
        """Decide one step; return the workers' metadata and the scheduler outputs."""
        now = time.time()
        (
            scheduled,
            metadata,
            num_prefill_groups,
            num_batched_tokens,
            swap_in,
            swap_out,
            copies,
            ignored,
            num_lookahead_slots,
            running_queue_size,
            num_loras,
        ) = self._core.schedule(now)
        # `scheduled` and `metadata` are built natively, already in vLLM's order (sorted by
        # LoRA when any group has one, as SchedulerOutputs.__post_init__ does).
        outputs = SchedulerOutputs._decided(
            num_loras,
            scheduled_seq_groups=scheduled,
            num_prefill_groups=num_prefill_groups,
            num_batched_tokens=num_batched_tokens,
            blocks_to_swap_in=swap_in,
            blocks_to_swap_out=swap_out,
            blocks_to_copy=copies,
            ignored_seq_groups=ignored,
            num_lookahead_slots=num_lookahead_slots,
            running_queue_size=running_queue_size,
        )
        return metadata, outputs

    def fork_seq(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """The child (already added to the parent's group) shares the parent's blocks."""
        self._core.fork(parent_seq, child_seq)

    def free_seq(self, seq: Sequence) -> None:
        """Free a sequence's blocks (the engine calls this for finished sequences)."""
        self.block_manager.free(seq)

    def free_finished_seq_groups(self) -> None:
        """Drop finished groups from the running queue."""
        self._core.free_finished()

    def mark_blocks_as_computed(self, seq_group: SequenceGroup) -> None:
        """Mark the full blocks of the group's sequences as computed (prefix caching)."""
        self.block_manager.mark_blocks_as_computed(seq_group)

    def state_bytes(self) -> int:
        """Bytes of native state the scheduler holds for its requests (excluding the Python
        objects the engine owns and the block manager)."""
        return self._core.state_bytes()


def _window_in_whole_blocks(cache_config: Any) -> Optional[int]:
    """``cache_config.sliding_window`` rounded up to whole blocks, as vLLM 0.4.2's block
    manager rounds it (``ceil(sliding_window / block_size)`` blocks); pagedkv's
    BlockSpaceManager takes whole blocks only. The tokens outside the window but inside its
    last block are the attention kernel's business, not the scheduler's."""
    window = getattr(cache_config, "sliding_window", None)
    if window is None:
        return None
    bs = cache_config.block_size
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InvalidArgumentError(f"sliding_window must be a positive int, got {window!r}")
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise InvalidArgumentError(f"block_size must be a positive int, got {bs!r}")
    return -(-window // bs) * bs


def _count(obj: Any, name: str, least: int, default: Any = None) -> int:
    """An integer config field that must be at least ``least`` (InvalidArgumentError)."""
    value = getattr(obj, name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidArgumentError(f"{name} must be an int >= {least}, got {value!r}")
    return value


def _field(obj: Any, name: str, default: Any = None) -> Any:
    """A config field by vLLM's name; ``enable_chunked_prefill`` is accepted for
    ``chunked_prefill_enabled``."""
    if name == "chunked_prefill_enabled" and not hasattr(obj, name):
        return getattr(obj, "enable_chunked_prefill", default)
    return getattr(obj, name, default)
