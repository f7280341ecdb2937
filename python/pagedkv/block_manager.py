"""``BlockSpaceManager``: vLLM's block manager API (BlockSpaceManagerV1 semantics) in Rust.

The exact contract, shared with the pure-Python reference in :mod:`pagedkv.reference`, is in
``docs/block_manager.md``. All the work happens in the native base class this class extends
(``pagedkv._native.BlockSpaceManager``): each call reads the sequence's id, status and native
token store (``seq.data._store``) straight from the Python objects, crossing the boundary once
per call.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Tuple
from typing import Sequence as Seq

from pagedkv._enum import CompatEnum
from pagedkv._native import BlockSpaceManager as _NativeBlockManager
from pagedkv.block import Device, PhysicalTokenBlock
from pagedkv.protocols import SequenceLike

__all__ = ["AllocStatus", "BlockMapping", "BlockSpaceManager", "BlockTable"]

BlockTable = List[int]

if TYPE_CHECKING:
    # PEP 696 default: a bare ``BlockMapping`` annotation means ``BlockMapping[Any]``, even
    # under ``mypy --strict`` (typing_extensions is only needed by the type checker).
    from typing_extensions import TypeVar

    _V = TypeVar("_V", default=Any)
else:
    from typing import TypeVar

    _V = TypeVar("_V")


class BlockMapping(Dict[int, _V]):
    """What ``append_slots`` (``{src: [dst, ...]}``), ``swap_in`` and ``swap_out``
    (``{src: dst}``) return: a read-only dict, as vLLM 0.4 and the seed use it (``.items()``,
    ``[]``, ``update`` into the scheduler's dicts), whose *iteration* yields ``(src, dst)``
    pairs, as vLLM 0.5 uses the list it returns (``blocks_to_copy.extend(cows)``). So both
    schedulers work unchanged. ``list(mapping.keys())`` gives the keys; ``dict(mapping)`` or
    ``mapping.copy()`` a plain, mutable dict.

    Typed ``BlockMapping[List[int]]`` (copy-on-write) or ``BlockMapping[int]`` (swaps); a bare
    ``BlockMapping`` annotation accepts both.
    """

    __slots__ = ()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        for src, dst in dict.items(self):
            if isinstance(dst, list):
                for d in dst:
                    yield (src, d)
            else:
                yield (src, dst)

    def pairs(self) -> List[Tuple[int, int]]:
        """The ``(src, dst)`` pairs as a list (vLLM 0.5's format)."""
        return list(iter(self))

    def copy(self) -> Dict[int, _V]:
        """A plain, mutable ``dict`` with the same items."""
        return dict(dict.items(self))

    def _read_only(self, *args, **kwargs):
        """Refused: a ``BlockMapping`` is read-only (``copy()`` it first)."""
        raise TypeError("a BlockMapping returned by the manager is read-only; copy() it first")

    __setitem__ = __delitem__ = __ior__ = _read_only  # type: ignore[assignment]
    update = pop = popitem = clear = setdefault = _read_only  # type: ignore[assignment]

    def __reduce__(self):
        return (dict, (dict(dict.items(self)),))

    def __repr__(self) -> str:
        return f"BlockMapping({dict.__repr__(self)})"


class AllocStatus(CompatEnum):
    """Answer of ``can_allocate`` / ``can_swap_in``.

    OK: it fits now. LATER: not now, but it will once blocks are freed (the watermark counts).
    NEVER: it can never fit on this GPU pool.
    """

    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


class BlockSpaceManager(_NativeBlockManager):
    """Manages the mapping between logical and physical KV-cache blocks (vLLM v1 semantics).

    ``BlockSpaceManager(block_size, num_gpu_blocks, num_cpu_blocks, watermark=0.01,
    sliding_window=None, enable_caching=False, *, hash_algo=None, hash_seed=None,
    strict=False)``

    * ``hash_algo`` (``"xxh3"`` or ``"sha256"``) and ``hash_seed`` choose the block hash; by
      default the process default (:func:`pagedkv.set_default_hasher`). A sequence hashed with
      another function is rehashed once when the manager first sees it.
    * ``strict=True`` makes ``free``/``fork`` of a sequence without a table raise
      :class:`~pagedkv.errors.UnknownSequenceError` instead of doing nothing (vLLM's behaviour).

    Methods mirror vLLM: ``can_allocate``, ``allocate``, ``can_append_slots``, ``append_slots``
    (returns ``{src_block: [dst_block, ...]}`` copy-on-write pairs), ``fork``, ``free``,
    ``reset``, ``can_swap_in``/``swap_in`` (``{cpu_block: gpu_block}``),
    ``can_swap_out``/``swap_out`` (``{gpu_block: cpu_block}``), ``get_block_table``,
    ``get_num_free_gpu_blocks``, ``get_num_free_cpu_blocks``, ``access_all_blocks_in_seq``,
    ``compute_full_blocks_in_seq``, ``get_all_computed_blocks``,
    ``get_common_computed_block_ids``, ``mark_blocks_as_computed``. The batch step API
    ``append_slots_batch`` and ``fill_block_tables`` write into caller-owned int32 buffers.
    """

    def get_physical_blocks(self, seq: SequenceLike) -> List[PhysicalTokenBlock]:
        """Snapshot views of the distinct physical blocks of ``seq``'s table (introspection;
        not for hot paths)."""
        device_name = self.table_device(seq)
        device = Device.GPU if device_name == "gpu" else Device.CPU
        table = self.get_block_table(seq)
        window = self.block_sliding_window
        distinct = table[:window] if window is not None else table
        return [self._physical_block(device, device_name, b) for b in distinct]

    def _physical_block(self, device: Device, device_name: str, block: int) -> PhysicalTokenBlock:
        info = self.block_info(device_name, block)
        blk = PhysicalTokenBlock(
            device=device,
            block_number=block,
            block_size=self.block_size,
            block_hash=info["block_hash"],
            num_hashed_tokens=info["num_hashed_tokens"],
        )
        blk.ref_count = info["ref_count"]
        blk.last_accessed = info["last_accessed"]
        blk.computed = info["computed"]
        return blk

    def get_block_tables(self, seqs: Seq[SequenceLike]) -> Dict[int, BlockTable]:
        """``{seq_id: block_table}`` for several sequences (convenience for metadata)."""
        return {seq.seq_id: self.get_block_table(seq) for seq in seqs}
