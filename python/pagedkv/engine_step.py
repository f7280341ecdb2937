"""The batch engine step (issue 10): one native call per step on top of
:class:`pagedkv.Scheduler`.

:meth:`BatchEngine.step` takes the tokens the model sampled for the previous step's batch (an
int32 array in the order of that batch's rows), and in one call into Rust

1. marks the previous step's tokens as computed, appends the sampled tokens, runs vLLM
   0.4.2's stop checks (``min_tokens``, EOS unless ``ignore_eos``, ``stop_token_ids``,
   ``max_model_len``, ``max_tokens``; stop *strings* need a detokenizer and stay with the
   caller), forks children for ``best_of > 1`` (copy-on-write: they share the parent's
   blocks), frees finished sequences and groups;
2. schedules the next batch with the same policy as :meth:`pagedkv.Scheduler.schedule`;
3. writes the model runner's inputs into the caller-owned arrays of :class:`BatchBuffers`.

Rows: one per running sequence of each scheduled group, in the order
:meth:`Scheduler.schedule` returns the groups. ``num_samples[i]`` tokens are sampled for row
``i`` (0 for a prefill chunk that does not end the prompt, ``best_of`` for the first sample
of a group with one sequence, else 1); the next ``step`` takes them in row order. Of a row's
``k`` samples the first ``k - 1`` go to new child sequences (ids from ``seq_counter``), the
last to the row's own sequence, as vLLM's output processor does.

Prefix caching: a prompt row holds only the tokens the model must compute. Its leading
tokens whose blocks are already computed (vLLM's ``computed_block_nums``) are left out of
``input_tokens``, ``positions`` and ``slot_mapping``, as vLLM 0.4.2's model runner leaves
them out; ``cached_tokens[i]`` says how many, ``positions[q[i]]`` is the first computed
position and ``context_lens[i]`` still counts the whole context. The model reads the cached
prefix from the KV cache through the block table; a row's last token is always computed.
With chunked prefill nothing is left out (vLLM 0.4.2 refuses prefix caching there).

Python views: running sequences' ``Sequence``/``SequenceData`` objects are not written every
step. Their status is (when it changes), and finished groups come back fully written; call
:meth:`BatchEngine.sync_views` before reading a running sequence's tokens or progress. The
batch step carries no logprobs (``output_logprobs`` and ``cumulative_logprob`` are not
updated). Beam search is not supported by the batch step.

Do not mix the batch step with :meth:`Scheduler.schedule`, ``free_finished_seq_groups`` or
``abort_seq_group`` on the same scheduler: use :meth:`BatchEngine.abort_seq_group`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Union

import numpy as np

from ._native import BatchStep
from .errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "BatchBuffers",
    "BatchEngine",
    "StepResult",
    "ROW_SAME",
    "ROW_APPENDED",
    "ROW_REWRITTEN",
]

_INT32 = np.iinfo(np.int32)

ROW_SAME, ROW_APPENDED, ROW_REWRITTEN = 0, 1, 2


class BatchBuffers:
    """Caller-owned model inputs of one batch step (host memory, reused every step).

    All int32 but ``seq_ids`` (int64). Per token (``max_tokens``): ``input_tokens``,
    ``positions``, ``slot_mapping``. Per row (``max_rows``): ``context_lens`` (tokens in the
    sequence's context after this step), ``num_samples``, ``seq_ids``, ``block_tables``
    (``[max_rows, max_blocks_per_seq]``, rows padded with 0) and ``query_start_loc``
    (``max_rows + 1``: row ``i``'s tokens are ``[q[i], q[i+1])``) and ``cached_tokens``
    (leading tokens of a prompt row left out because the prefix cache holds them; 0 for
    other rows). Flattened ``(src, dst)``
    pairs: ``copies`` (copy-on-write), ``swap_in`` (CPU -> GPU), ``swap_out`` (GPU -> CPU).
    A step writes only the prefixes it reports in its :class:`StepResult`.

    ``incremental=True`` adds block-table changes since the previous step, the way vLLM v1
    hands its workers only new block ids: ``row_state[i]`` is ``ROW_SAME`` (0: same sequence
    in the same row, table unchanged), ``ROW_APPENDED`` (1: blocks appended; the new ids are
    ``new_blocks[new_block_loc[i]:new_block_loc[i + 1]]``) or ``ROW_REWRITTEN`` (2: a new or
    moved row, or blocks replaced by copy-on-write, swap or recompute; that slice is the whole
    table). A caller keeping its own persistent table applies these and need not read
    ``block_tables`` (still written whole, for simple callers).
    """

    def __init__(
        self,
        max_tokens: int,
        max_rows: int,
        max_blocks_per_seq: int,
        max_swap_blocks: int,
        incremental: bool = False,
    ) -> None:
        for name, v in (
            ("max_tokens", max_tokens),
            ("max_rows", max_rows),
            ("max_blocks_per_seq", max_blocks_per_seq),
            ("max_swap_blocks", max_swap_blocks),
        ):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ArgumentTypeError(f"{name} must be an int, got {type(v).__name__}")
            if v < 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {v}")
        i32 = np.int32
        self.input_tokens = np.zeros(max_tokens, i32)
        self.positions = np.zeros(max_tokens, i32)
        self.slot_mapping = np.zeros(max_tokens, i32)
        self.query_start_loc = np.zeros(max_rows + 1, i32)
        self.context_lens = np.zeros(max_rows, i32)
        self.num_samples = np.zeros(max_rows, i32)
        self.cached_tokens = np.zeros(max_rows, i32)
        self.seq_ids = np.zeros(max_rows, np.int64)
        self.block_tables = np.zeros((max_rows, max_blocks_per_seq), i32)
        self.copies = np.zeros(2 * max_rows, i32)
        self.swap_in = np.zeros(2 * max_swap_blocks, i32)
        self.swap_out = np.zeros(2 * max_swap_blocks, i32)
        self.row_state: Optional[np.ndarray] = None
        self.new_block_loc: Optional[np.ndarray] = None
        self.new_blocks: Optional[np.ndarray] = None
        if incremental:
            self.row_state = np.zeros(max_rows, i32)
            self.new_block_loc = np.zeros(max_rows + 1, i32)
            self.new_blocks = np.zeros(max_rows * max_blocks_per_seq, i32)

    def widened(self, max_blocks_per_seq: int) -> BatchBuffers:
        """A copy with block-table rows of at least ``max_blocks_per_seq`` (doubling)."""
        rows, cols = self.block_tables.shape
        new = BatchBuffers.__new__(BatchBuffers)
        new.__dict__.update(self.__dict__)
        cols = max(max_blocks_per_seq, 2 * cols)
        new.block_tables = np.zeros((rows, cols), np.int32)
        if self.new_blocks is not None:
            new.new_blocks = np.zeros(rows * cols, np.int32)
        return new

    @classmethod
    def for_scheduler(
        cls, scheduler: Any, extra_tokens: int = 0, incremental: bool = False
    ) -> BatchBuffers:
        """Buffers for any step of ``scheduler`` (a :class:`pagedkv.Scheduler`) whose
        sequences stay within ``max_model_len + extra_tokens`` tokens. A sequence can outgrow
        ``max_model_len`` (vLLM's ``min_tokens``; chunked prefill does not limit the prompt
        length): :meth:`BatchEngine.step` then widens ``block_tables`` itself."""
        sc, cc = scheduler.scheduler_config, scheduler.cache_config
        lookahead = getattr(sc, "num_lookahead_slots", 0) or 0
        blocks = -(-(sc.max_model_len + lookahead + extra_tokens) // cc.block_size)
        return cls(
            max(sc.max_num_batched_tokens, sc.max_num_seqs),
            sc.max_num_seqs,
            blocks,
            int(cc.num_gpu_blocks),
            incremental,
        )


@dataclass
class StepResult:
    """What one :meth:`BatchEngine.step` wrote and decided."""

    num_rows: int
    #: Tokens written (prompt rows without their cached prefix).
    num_tokens: int
    num_prefill_groups: int
    num_copies: int
    num_swap_in: int
    num_swap_out: int
    #: Entries of ``new_blocks`` written (incremental buffers only).
    num_new_blocks: int
    #: The scheduled groups, in row order (a group has one row per running sequence).
    scheduled: List[Any]
    #: Groups that finished applying the sampled tokens (views fully written back).
    finished: List[Any]
    #: Groups the scheduler refused (prompt too long or never fits): FINISHED_IGNORED.
    ignored: List[Any]
    buffers: BatchBuffers

    def is_empty(self) -> bool:
        """Whether the step scheduled no rows and moved or copied no block."""
        return self.num_rows == 0 and not (self.num_copies or self.num_swap_in or self.num_swap_out)

    @property
    def block_tables(self) -> np.ndarray:
        """The block-table rows of this step's batch (a view of the buffer)."""
        return self.buffers.block_tables[: self.num_rows]

    def pairs(self, which: str) -> np.ndarray:
        """``copies``, ``swap_in`` or ``swap_out`` as an ``[n, 2]`` view."""
        n = {"copies": self.num_copies, "swap_in": self.num_swap_in, "swap_out": self.num_swap_out}
        if which not in n:
            raise InvalidArgumentError(f"no pair list named {which!r}")
        return getattr(self.buffers, which)[: 2 * n[which]].reshape(-1, 2)


class BatchEngine:
    """Drive a :class:`pagedkv.Scheduler` with the one-call batch step (module docstring)."""

    def __init__(
        self,
        scheduler: Any,
        buffers: Optional[BatchBuffers] = None,
        seq_counter: Optional[Callable[[], int]] = None,
    ) -> None:
        core = getattr(scheduler, "_core", None)
        if core is None:
            raise ArgumentTypeError("BatchEngine drives a pagedkv.Scheduler")
        self.scheduler = scheduler
        self.buffers = buffers if buffers is not None else BatchBuffers.for_scheduler(scheduler)
        if seq_counter is None:
            seq_counter = itertools.count(1 << 40).__next__
        self._step = BatchStep(core, seq_counter)

    @property
    def num_expected_samples(self) -> int:
        """How many sampled tokens the next :meth:`step` takes."""
        return self._step.num_expected_samples

    def add_seq_group(self, seq_group: Any) -> None:
        """Queue a new request (as :meth:`pagedkv.Scheduler.add_seq_group`)."""
        self.scheduler.add_seq_group(seq_group)

    def abort_seq_group(self, request_id: Union[str, Iterable[str]]) -> None:
        """Abort one request id or an iterable of them (native state first, then views)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._step.abort(ids)

    def has_unfinished_seqs(self) -> bool:
        """Whether any request is waiting, running or swapped."""
        return self.scheduler.has_unfinished_seqs()

    def sync_views(self) -> None:
        """Write every scheduled sequence's native tokens and progress to its Python view."""
        self._step.sync_views()

    def step(self, sampled: Any = None, now: Optional[float] = None) -> StepResult:
        """Apply ``sampled`` (the previous batch's tokens; ``None`` for none), schedule and
        write the next batch's inputs. Bad input raises before anything changes."""
        arr = _as_tokens(sampled)
        t = time.time() if now is None else float(now)
        counts, prefills, scheduled, finished, ignored, cols = self._step.step(arr, t, self.buffers)
        if counts is None:  # a sequence outgrew the block-table width: widen, write again
            self.buffers = self.buffers.widened(cols)
            counts = self._step.rewrite(self.buffers)
        rows, tokens, copies, swap_in, swap_out, new_blocks = counts
        return StepResult(
            rows,
            tokens,
            prefills,
            copies,
            swap_in,
            swap_out,
            new_blocks,
            scheduled,
            finished,
            ignored,
            self.buffers,
        )


def _as_tokens(sampled: Any) -> np.ndarray:
    if sampled is None:
        return np.zeros(0, np.int32)
    arr = np.asarray(sampled)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"sampled must be 1-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, np.int32)
    if arr.dtype.kind not in "iu":
        raise ArgumentTypeError(f"sampled must hold integer token ids, got dtype {arr.dtype}")
    if arr.dtype != np.int32:
        if arr.min() < 0 or arr.max() > _INT32.max:
            raise InvalidArgumentError("sampled token ids must be in [0, 2**31)")
        arr = arr.astype(np.int32)
    return np.ascontiguousarray(arr)
