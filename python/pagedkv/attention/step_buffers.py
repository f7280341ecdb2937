"""Persistent host/device buffers for the per-step decode metadata.

A decode step needs, for each running sequence ``i``: its block table row, its
context length, the slot of its newest token, that token's position and id.  An
engine that builds these as fresh tensors every step pays allocations, Python
list building and one pageable (synchronous) copy per tensor.  :class:`StepBuffers`
instead owns

* one **host** int32 buffer, pinned (``pin_memory=True``) when the target device
  is CUDA, plain CPU memory otherwise, allocated once;
* one **device** int32 buffer of the same size, allocated once;

and per step:

1. :meth:`StepBuffers.append` hands zero-copy numpy views of the host buffer to
   :meth:`pagedkv.BlockSpaceManager.append_slots_batch`, which reserves the
   sequences' new slots and writes block tables, context lengths and slot
   mapping in place; positions (``context_len - 1``) and input ids (the newest
   token) are filled next to them.  It may be called several times per step
   (e.g. once per sequence group, after that group's ``can_append_slots``
   check); rows are appended.
2. :meth:`StepBuffers.to_device` issues **one** ``non_blocking`` host-to-device
   copy of the rows used this step and returns a :class:`DeviceView` of device
   tensors sliced to the batch size.

:meth:`StepBuffers.decode_step` does both for one batch.

Layout (all int32, ``S = max_seqs``, ``B = max_blocks_per_seq``)::

    [ context_lens (S) | slot_mapping (S) | positions (S) | input_ids (S) | block_tables (S*B) ]

so the data of an ``n``-sequence step is the single contiguous prefix
``[0, 4*S + n*B)`` and moves with one copy (the four short vectors are copied
whole, at most ``16*S`` bytes).  Every region is C-contiguous, as the manager's
batch API requires.

dtypes: everything is int32 — the manager writes int32; the model accepts int32
``input_ids`` (``nn.Embedding``), ``positions`` (RoPE casts them to float32),
``slot_mapping`` (:func:`~pagedkv.attention.kv_cache.write_kv` widens it) and
``block_tables``/``context_lens`` (:func:`~pagedkv.attention.paged_attention`).

Lifetime: the device views are overwritten by the next step's copy (issued on
the current CUDA stream, so kernels already queued that read them run first).
Before the host buffer is rewritten, the previous copy is waited for (a CUDA
event), so a copy still in flight never sees half-written data.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..errors import InvalidArgumentError

__all__ = ["DeviceView", "HostDeviceArena", "StepBuffers"]

_NUM_VECTORS = 4  # context_lens, slot_mapping, positions, input_ids
_CTX, _SLOT, _POS, _IDS = range(_NUM_VECTORS)


class HostDeviceArena:
    """A host buffer (pinned when the device is CUDA) and a device buffer of the same size,
    allocated once, and one ``non_blocking`` host-to-device copy of a prefix per step.

    The copy is issued on the device's current stream and followed by a CUDA event:
    :meth:`wait` blocks until it has read the host buffer, so the host side is rewritten only
    after the copy in flight is done. The device buffer is overwritten by the next copy, which
    is queued behind the kernels already queued on that stream. Shared by
    :class:`StepBuffers` and :class:`pagedkv.vllm_042.engine_step.BatchBuffers`.

    ``pin_memory=True`` without CUDA is refused (``InvalidArgumentError``): pinning needs the
    CUDA driver, and unpinned memory would silently make every copy synchronous.
    """

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device | str | None,
        pin_memory: Optional[bool],
        dev_numel: Optional[int] = None,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if pin_memory is None:
            pin_memory = self.device.type == "cuda"
        if pin_memory and not torch.cuda.is_available():
            raise InvalidArgumentError("pin_memory=True needs CUDA (torch.cuda is not available)")
        self.pinned = bool(pin_memory)
        self.host = torch.zeros(numel, dtype=dtype, pin_memory=self.pinned)
        self.dev = torch.zeros(
            numel if dev_numel is None else dev_numel, dtype=dtype, device=self.device
        )
        # recorded after each copy (reused, never reallocated)
        self._event: Any = torch.cuda.Event() if self.device.type == "cuda" else None
        self._pending = False

    def wait(self) -> None:
        """Block until the last copy has read the host buffer."""
        if self._pending:
            self._event.synchronize()
            self._pending = False

    def copy_prefix(self, n: int, non_blocking: bool = True, src: int = 0) -> None:
        """One copy of host ``[src, src + n)`` into device ``[0, n)``."""
        self.dev[:n].copy_(self.host[src : src + n], non_blocking=non_blocking)
        if self._event is not None:
            self._event.record(torch.cuda.current_stream(self.device))
            self._pending = True


@dataclass(frozen=True)
class DeviceView:
    """Device tensors of one step, each a view of :class:`StepBuffers`' device buffer.

    ``block_tables``: int32 ``[n, max_blocks_per_seq]`` (padded with the pad value);
    ``context_lens``, ``slot_mapping``, ``positions``, ``input_ids``: int32 ``[n]``.
    Valid until the next :meth:`StepBuffers.to_device`.
    """

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    input_ids: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


class StepBuffers:
    """Reusable decode-step metadata buffers (see the module docstring).

    Args:
        max_seqs: most sequences in one step.
        max_blocks_per_seq: block table width (blocks of the longest sequence).
        device: where the model runs; default CUDA if available, else CPU.
        pad_value: block table padding written by the manager (default 0).
        pin_memory: pin the host buffer; default: when ``device`` is CUDA (``True``
            without CUDA is refused).
    """

    def __init__(
        self,
        max_seqs: int,
        max_blocks_per_seq: int,
        *,
        device: torch.device | str | None = None,
        pad_value: int = 0,
        pin_memory: Optional[bool] = None,
    ) -> None:
        for name, value in (("max_seqs", max_seqs), ("max_blocks_per_seq", max_blocks_per_seq)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.pad_value = int(pad_value)
        size = _NUM_VECTORS * max_seqs + max_seqs * max_blocks_per_seq
        self._arena = HostDeviceArena(size, torch.int32, device, pin_memory)
        self.device, self.pinned = self._arena.device, self._arena.pinned
        self._host, self._dev = self._arena.host, self._arena.dev
        vec = self._host[: _NUM_VECTORS * max_seqs].view(_NUM_VECTORS, max_seqs)
        tables = self._host[_NUM_VECTORS * max_seqs :].view(max_seqs, max_blocks_per_seq)
        # host tensors (views of self._host) and their zero-copy numpy views
        self.context_lens = vec[_CTX]
        self.slot_mapping = vec[_SLOT]
        self.positions = vec[_POS]
        self.input_ids = vec[_IDS]
        self.block_tables = tables
        self.context_lens_np = self.context_lens.numpy()
        self.slot_mapping_np = self.slot_mapping.numpy()
        self.positions_np = self.positions.numpy()
        self.input_ids_np = self.input_ids.numpy()
        self.block_tables_np = self.block_tables.numpy()
        # device views
        dvec = self._dev[: _NUM_VECTORS * max_seqs].view(_NUM_VECTORS, max_seqs)
        self._dev_vectors = dvec
        self._dev_tables = self._dev[_NUM_VECTORS * max_seqs :].view(max_seqs, max_blocks_per_seq)

        self.num_seqs = 0  # rows filled in the current step

    # ------------------------------------------------------------------ #

    def begin_step(self) -> None:
        """Start a new step: rows are filled from 0 again.

        Waits for the previous step's host->device copy (if still in flight) so
        the host buffer can be rewritten safely.
        """
        self._wait_copy()
        self.num_seqs = 0

    def _wait_copy(self) -> None:
        self._arena.wait()

    def append(
        self, manager: Any, seqs: Seq[Any], input_ids: Optional[Seq[int]] = None
    ) -> Dict[int, List[int]]:
        """Reserve the newest slot of each of ``seqs`` and fill their rows.

        Calls ``manager.append_slots_batch`` on the next ``len(seqs)`` rows of the
        host buffers, then writes positions (``context_len - 1``) and input ids:
        ``input_ids`` if given (the tokens just sampled, one per sequence: saves a
        Python call per sequence), else ``seq.get_last_token_id()``.  Returns the
        copy-on-write pairs ``{src_block: [dst_block, ...]}``.  On error nothing
        changes (neither the manager nor the rows filled so far).
        """
        seqs = list(seqs)
        start, n = self.num_seqs, len(seqs)
        end = start + n
        if end > self.max_seqs:
            raise InvalidArgumentError(
                f"step has {end} sequences but StepBuffers holds at most {self.max_seqs}"
            )
        if input_ids is not None:
            input_ids = np.asarray(input_ids, dtype=np.int32)  # checked before anything changes
            if input_ids.shape != (n,):
                raise InvalidArgumentError(
                    f"input_ids must have shape ({n},), got {input_ids.shape}"
                )
        if n == 0:
            return {}
        self._wait_copy()  # the host rows may still be the source of an in-flight copy
        cow = manager.append_slots_batch(
            seqs,
            self.block_tables_np[start:end],
            self.context_lens_np[start:end],
            self.slot_mapping_np[start:end],
            pad_value=self.pad_value,
        )
        np.subtract(self.context_lens_np[start:end], 1, out=self.positions_np[start:end])
        if input_ids is None:
            input_ids = [seq.get_last_token_id() for seq in seqs]
        self.input_ids_np[start:end] = input_ids
        self.num_seqs = end
        return cow

    def to_device(self) -> DeviceView:
        """Copy this step's rows to the device (one ``non_blocking`` copy) and return views.

        Nothing is allocated: the copy lands in the persistent device buffer.
        """
        n = self.num_seqs
        used = _NUM_VECTORS * self.max_seqs + n * self.max_blocks_per_seq
        self._arena.copy_prefix(used)
        v = self._dev_vectors
        return DeviceView(
            block_tables=self._dev_tables[:n],
            context_lens=v[_CTX, :n],
            slot_mapping=v[_SLOT, :n],
            positions=v[_POS, :n],
            input_ids=v[_IDS, :n],
        )

    def decode_step(
        self, manager: Any, seqs: Seq[Any], input_ids: Optional[Seq[int]] = None
    ) -> Tuple[Dict[int, List[int]], DeviceView]:
        """One decode step for ``seqs``: :meth:`begin_step`, :meth:`append`, :meth:`to_device`.

        Returns ``(copy_on_write_pairs, device_view)``.
        """
        self.begin_step()
        cow = self.append(manager, seqs, input_ids)
        return cow, self.to_device()

    def host_view(self) -> DeviceView:
        """The host tensors of the rows filled so far (for inspection and tests)."""
        n = self.num_seqs
        return DeviceView(
            block_tables=self.block_tables[:n],
            context_lens=self.context_lens[:n],
            slot_mapping=self.slot_mapping[:n],
            positions=self.positions[:n],
            input_ids=self.input_ids[:n],
        )

    def __repr__(self) -> str:
        return (
            f"StepBuffers(max_seqs={self.max_seqs}, max_blocks_per_seq={self.max_blocks_per_seq}, "
            f"device={self.device}, pinned={self.pinned}, num_seqs={self.num_seqs})"
        )
