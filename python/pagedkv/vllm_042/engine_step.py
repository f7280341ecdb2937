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

Stable rows (``BatchEngine(..., stable_rows=True)``): the decisions are the same, only the
rows are placed differently, the way vLLM v1's persistent batch keeps them. A sequence keeps
its row; a row belongs to its sequence until another one takes it, so a sequence that sits a
step out (vLLM 0.4.2's default policy runs prompts in steps of their own; a chunked prefill can
run out of token budget) finds its row again when the batch reaches it. Rows stay dense
``0..n-1``: rows whose sequence left (finished, preempted, or not in this step) are filled
first by the sequences whose rows lie past the batch (the last rows first: they move,
``ROW_MOVED`` with incremental buffers; at most as many as rows were left free), then by
sequences new to the buffer (admitted, swapped in, forked, or whose row was taken), in schedule
order. A group's rows need not be adjacent; ``seq_ids`` names each row's sequence,
``query_start_loc`` its token span (any row order is valid), ``StepResult.scheduled`` stays in
schedule order, and the sampled array still follows the rows. Samples are applied in schedule
order: children's ids are drawn from ``seq_counter`` group by group as vLLM draws them, not
in row order.

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

from pagedkv._native import BatchStep
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "BatchBuffers",
    "DeviceBatch",
    "BatchEngine",
    "StepResult",
    "ROW_SAME",
    "ROW_APPENDED",
    "ROW_REWRITTEN",
    "ROW_MOVED",
]

_INT32 = np.iinfo(np.int32)

ROW_SAME, ROW_APPENDED, ROW_REWRITTEN, ROW_MOVED = 0, 1, 2, 3


#: The per-step arrays other than ``block_tables``, in the order a device copy packs them.
_SMALL = (
    "query_start_loc",
    "context_lens",
    "num_samples",
    "cached_tokens",
    "seq_ids",
    "input_tokens",
    "positions",
    "slot_mapping",
    "copies",
    "swap_in",
    "swap_out",
    "row_state",
    "moved_from",
    "new_block_loc",
    "new_blocks",
)


def _align(n: int, to: int = 64) -> int:
    return -(-n // to) * to


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
    hands its workers only new block ids. They are relative to a persistent table of
    ``max_rows`` rows in which a row keeps what it was last sent, also while it lies past the
    batch (a sequence may sit some steps out and come back to its row): ``row_state[i]`` is
    ``ROW_SAME`` (0: row ``i`` holds this sequence's table, unchanged), ``ROW_APPENDED`` (1:
    row ``i`` holds it, blocks appended; the new ids are
    ``new_blocks[new_block_loc[i]:new_block_loc[i + 1]]``), ``ROW_MOVED`` (3: row
    ``moved_from[i]`` holds it; that row plus the slice) or ``ROW_REWRITTEN`` (2: no row
    holds it, or blocks were replaced by copy-on-write, swap or recompute; the slice is the
    whole table, ``moved_from[i]`` is -1). ``moved_from[i]`` is ``i`` for the first two. A
    caller keeping its own persistent table applies these to rows ``0..num_rows`` and leaves
    the others alone (moves read the rows as they were before the step). ``block_tables`` then
    becomes a persistent buffer the step keeps: each step writes only what changed (the
    appended entries; a rewritten row, padded with 0 up to its previous length), so it stays
    equal to the batch's tables only if nobody else writes it. New buffers (another object,
    or the engine's widened copy) are written whole once.

    ``device`` / ``pin_memory`` (needs torch): every array is a numpy view of one torch byte
    arena on the host, pinned when ``device`` is CUDA (``pin_memory`` defaults to that;
    ``pin_memory=True`` without CUDA is refused), and :meth:`to_device` moves a step's inputs
    with one host-to-device copy into a persistent device arena. Without them the arrays are
    plain numpy and torch is not imported.
    """

    def __init__(
        self,
        max_tokens: int,
        max_rows: int,
        max_blocks_per_seq: int,
        max_swap_blocks: int,
        incremental: bool = False,
        *,
        device: Any = None,
        pin_memory: Optional[bool] = None,
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
        self._dims = (max_tokens, max_rows, max_blocks_per_seq, max_swap_blocks, incremental)
        shapes = {
            "input_tokens": (max_tokens,),
            "positions": (max_tokens,),
            "slot_mapping": (max_tokens,),
            "query_start_loc": (max_rows + 1,),
            "context_lens": (max_rows,),
            "num_samples": (max_rows,),
            "cached_tokens": (max_rows,),
            "seq_ids": (max_rows,),
            "block_tables": (max_rows, max_blocks_per_seq),
            "copies": (2 * max_rows,),
            "swap_in": (2 * max_swap_blocks,),
            "swap_out": (2 * max_swap_blocks,),
        }
        if incremental:
            shapes["row_state"] = (max_rows,)
            shapes["moved_from"] = (max_rows,)
            shapes["new_block_loc"] = (max_rows + 1,)
            shapes["new_blocks"] = (max_rows * max_blocks_per_seq,)
        self.row_state: Optional[np.ndarray] = None
        self.moved_from: Optional[np.ndarray] = None
        self.new_block_loc: Optional[np.ndarray] = None
        self.new_blocks: Optional[np.ndarray] = None
        self._arena: Any = None
        if device is None and not pin_memory:
            for name, shape in shapes.items():
                setattr(self, name, np.zeros(shape, np.int64 if name == "seq_ids" else np.int32))
        else:
            self._carve(shapes, device, pin_memory)

    def _carve(self, shapes: dict, device: Any, pin_memory: Optional[bool]) -> None:
        """Every array as a view of one torch byte arena: ``[arrays | staging | block_tables]``.
        :meth:`to_device` packs the used prefixes of the arrays into the end of the staging
        region, right before ``block_tables``, so that they and the used block-table rows are
        one contiguous host range: one copy, and no host copy of the block tables."""
        import torch

        from pagedkv.attention.step_buffers import HostDeviceArena

        offsets, at = {}, 0
        for name in _SMALL:
            if name in shapes:
                offsets[name] = at
                itemsize = 8 if name == "seq_ids" else 4
                at = _align(at + itemsize * int(np.prod(shapes[name])))
        small = at  # arrays region; the staging region is as large (a step may use it all)
        table_bytes = 4 * int(np.prod(shapes["block_tables"]))
        arena = HostDeviceArena(
            2 * small + table_bytes, torch.uint8, device, pin_memory, dev_numel=small + table_bytes
        )
        host = arena.host.numpy()
        for name, off in offsets.items():
            dtype = np.int64 if name == "seq_ids" else np.int32
            n = int(np.prod(shapes[name]))
            setattr(self, name, host[off : off + n * dtype().itemsize].view(dtype))
        self.block_tables = host[2 * small :].view(np.int32).reshape(shapes["block_tables"])
        self._arena, self._stage_end = arena, 2 * small

    def wait_copy(self) -> None:
        """Block until the last :meth:`to_device` copy has read the host memory (the step
        calls this before it writes: that copy reads ``block_tables`` in place)."""
        if self._arena is not None:
            self._arena.wait()

    @property
    def device(self) -> Any:
        """The device of :meth:`to_device` (``None``: plain numpy buffers)."""
        return None if self._arena is None else self._arena.device

    @property
    def pinned(self) -> bool:
        """Whether the host arena is pinned (page-locked) memory."""
        return self._arena is not None and self._arena.pinned

    def to_device(self, res: StepResult, non_blocking: bool = True) -> DeviceBatch:
        """Move the inputs ``res`` wrote to the device: the used prefix of every array,
        packed next to the used block-table rows in host memory (small copies, O(used)),
        then ONE host-to-device copy (``non_blocking``: asynchronous from pinned memory) into
        the persistent device arena. Returns device tensors with the arrays' names, sized to
        the step; they stay valid until the next ``to_device`` (whose copy is queued behind
        the kernels already queued on the stream). Waits first for the previous copy to have
        read the staging region."""
        if self._arena is None:
            raise InvalidArgumentError("to_device needs BatchBuffers(..., device=...)")
        if res.buffers is not self:
            raise InvalidArgumentError("res was written into other buffers")
        import torch

        used = self._used(res)
        sizes = [(name, used[name] * getattr(self, name).itemsize) for name in used]
        packed = sum(_align(nb, 8) for _, nb in sizes)
        base = self._stage_end - packed
        host = self._arena.host.numpy()
        self._arena.wait()
        views, at = {}, base
        for name, nb in sizes:
            host[at : at + nb] = getattr(self, name)[: used[name]].view(np.uint8)
            views[name] = (at - base, nb)
            at += _align(nb, 8)
        rows, cols = res.num_rows, self.block_tables.shape[1]
        self._arena.copy_prefix(packed + 4 * rows * cols, non_blocking, src=base)
        dev = self._arena.dev
        out = {}
        for name, (off, nb) in views.items():
            dtype = torch.int64 if name == "seq_ids" else torch.int32
            out[name] = dev[off : off + nb].view(dtype)
        out["block_tables"] = dev[packed : packed + 4 * rows * cols].view(torch.int32)
        out["block_tables"] = out["block_tables"].view(rows, cols)
        return DeviceBatch(**out)

    def _used(self, res: StepResult) -> dict:
        r, t = res.num_rows, res.num_tokens
        used = {
            "query_start_loc": r + 1,
            "context_lens": r,
            "num_samples": r,
            "cached_tokens": r,
            "seq_ids": r,
            "input_tokens": t,
            "positions": t,
            "slot_mapping": t,
            "copies": 2 * res.num_copies,
            "swap_in": 2 * res.num_swap_in,
            "swap_out": 2 * res.num_swap_out,
        }
        if self.row_state is not None:
            used.update(
                row_state=r, moved_from=r, new_block_loc=r + 1, new_blocks=res.num_new_blocks
            )
        return used

    def widened(self, max_blocks_per_seq: int) -> BatchBuffers:
        """A copy with block-table rows of at least ``max_blocks_per_seq`` (doubling)."""
        rows, cols = self.block_tables.shape
        cols = max(max_blocks_per_seq, 2 * cols)
        if self._arena is not None:  # a new arena (the step writes everything again)
            tokens, rows, _, swaps, inc = self._dims
            return BatchBuffers(
                tokens, rows, cols, swaps, inc, device=self.device, pin_memory=self.pinned
            )
        new = BatchBuffers.__new__(BatchBuffers)
        new.__dict__.update(self.__dict__)
        new._dims = self._dims[:2] + (cols,) + self._dims[3:]
        new.block_tables = np.zeros((rows, cols), np.int32)
        if self.new_blocks is not None:
            new.new_blocks = np.zeros(rows * cols, np.int32)
        return new

    @classmethod
    def for_scheduler(
        cls,
        scheduler: Any,
        extra_tokens: int = 0,
        incremental: bool = False,
        *,
        device: Any = None,
        pin_memory: Optional[bool] = None,
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
            device=device,
            pin_memory=pin_memory,
        )


@dataclass
class DeviceBatch:
    """One step's inputs on the device (:meth:`BatchBuffers.to_device`): tensors with the
    names of :class:`BatchBuffers`' arrays, sized to the step (rows, tokens, pairs as flat
    ``(src, dst)`` lists); the incremental ones only with incremental buffers."""

    query_start_loc: Any
    context_lens: Any
    num_samples: Any
    cached_tokens: Any
    seq_ids: Any
    input_tokens: Any
    positions: Any
    slot_mapping: Any
    copies: Any
    swap_in: Any
    swap_out: Any
    block_tables: Any
    row_state: Any = None
    moved_from: Any = None
    new_block_loc: Any = None
    new_blocks: Any = None


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
    #: The scheduled groups, in schedule order (a group has one row per running sequence;
    #: the rows follow this order unless the engine has stable rows).
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

    def to_device(self, non_blocking: bool = True) -> DeviceBatch:
        """This step's inputs on the device, in one copy (:meth:`BatchBuffers.to_device`)."""
        return self.buffers.to_device(self, non_blocking)

    def pairs(self, which: str) -> np.ndarray:
        """``copies``, ``swap_in`` or ``swap_out`` as an ``[n, 2]`` view."""
        n = {"copies": self.num_copies, "swap_in": self.num_swap_in, "swap_out": self.num_swap_out}
        if which not in n:
            raise InvalidArgumentError(f"no pair list named {which!r}")
        return getattr(self.buffers, which)[: 2 * n[which]].reshape(-1, 2)


class BatchEngine:
    """Drive a :class:`pagedkv.Scheduler` with the one-call batch step (module docstring).

    ``stable_rows=True``: a running sequence keeps its row while it stays in the batch (the
    module docstring, "Stable rows"); with ``incremental`` buffers a step then costs the
    running sequences and the changed entries, not the tables' length."""

    def __init__(
        self,
        scheduler: Any,
        buffers: Optional[BatchBuffers] = None,
        seq_counter: Optional[Callable[[], int]] = None,
        stable_rows: bool = False,
    ) -> None:
        if not isinstance(stable_rows, bool):
            raise ArgumentTypeError("stable_rows must be a bool")
        core = getattr(scheduler, "_core", None)
        if core is None:
            raise ArgumentTypeError("BatchEngine drives a pagedkv.Scheduler")
        self.scheduler = scheduler
        self.buffers = buffers if buffers is not None else BatchBuffers.for_scheduler(scheduler)
        if seq_counter is None:
            seq_counter = itertools.count(1 << 40).__next__
        self._step = BatchStep(core, seq_counter, stable_rows)

    @property
    def stable_rows(self) -> bool:
        """Whether a running sequence keeps its row from step to step (see the module
        docstring) rather than rows following :meth:`Scheduler.schedule`'s order."""
        return self._step.stable_rows

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
        self.buffers.wait_copy()
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
