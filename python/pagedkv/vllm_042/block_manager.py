"""``BlockSpaceManager``: vLLM's block manager API (BlockSpaceManagerV1 semantics) in Rust.

The exact contract, shared with the pure-Python reference in :mod:`pagedkv.vllm_042.reference`,
is in ``docs/block_manager.md``. All the work happens in the native base class this class extends
(``pagedkv._native.BlockSpaceManager``): each call reads the sequence's id, status and native
token store (``seq.data._store``) straight from the Python objects, crossing the boundary once
per call.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Type
from typing import Sequence as Seq

from pagedkv._native import BlockSpaceManager as _NativeBlockManager
from pagedkv.errors import InvalidArgumentError
from pagedkv.vllm_042._enum import CompatEnum
from pagedkv.vllm_042.block import Device, PhysicalTokenBlock
from pagedkv.vllm_042.protocols import SequenceGroupLike, SequenceLike

__all__ = [
    "AllocStatus",
    "BlockMapping",
    "BlockSpaceManager",
    "BlockSpaceManagerPairs",
    "BlockTable",
]

BlockTable = List[int]

if TYPE_CHECKING:
    # PEP 696 default: a bare ``BlockMapping`` annotation means ``BlockMapping[Any]``, even
    # under ``mypy --strict`` (typing_extensions is only needed by the type checker).
    from typing_extensions import TypeVar

    _V = TypeVar("_V", default=Any)
else:
    from typing import TypeVar

    _V = TypeVar("_V")

_M = TypeVar("_M", bound="BlockSpaceManager")


class BlockMapping(Dict[int, _V]):
    """What ``append_slots`` (``{src: [dst, ...]}``), ``swap_in`` and ``swap_out``
    (``{src: dst}``) return by default: a read-only ``dict`` in every respect (iteration,
    ``len``, ``in``, ``[]``, ``.items()``), as vLLM 0.4 and the seed return ``Dict``.
    ``pairs()`` lists the ``(src, dst)`` pairs (vLLM 0.5's format); a manager built with
    ``mapping_format="pairs"`` returns such lists directly. ``dict(mapping)`` or
    ``mapping.copy()`` gives a plain, mutable dict.

    Typed ``BlockMapping[List[int]]`` (copy-on-write) or ``BlockMapping[int]`` (swaps); a bare
    ``BlockMapping`` annotation accepts both.
    """

    __slots__ = ()

    def pairs(self) -> List[Tuple[int, int]]:
        """The ``(src, dst)`` pairs, in order, one per destination (vLLM 0.5's format)."""
        out: List[Tuple[int, int]] = []
        items: Any = dict.items(self)  # values: lists of block ids or block ids
        for src, dst in items:
            if isinstance(dst, list):
                out.extend((src, d) for d in dst)
            else:
                out.append((src, dst))
        return out

    def copy(self) -> Dict[int, _V]:
        """A plain, mutable ``dict`` with the same items."""
        return dict(dict.items(self))

    def _read_only(self, *args, **kwargs):
        """Refused: a ``BlockMapping`` is read-only (``copy()`` it first)."""
        raise TypeError("a BlockMapping returned by the manager is read-only; copy() it first")

    __setitem__ = __delitem__ = __ior__ = _read_only
    update = pop = popitem = clear = setdefault = _read_only

    def __reduce__(self):
        return (dict, (dict(dict.items(self)),))

    def __repr__(self) -> str:
        return f"BlockMapping({dict.__repr__(self)})"


MAPPING_FORMATS = ("dict", "pairs")


def check_mapping_format(mapping_format: str) -> str:
    if mapping_format not in MAPPING_FORMATS:
        raise InvalidArgumentError(
            f"mapping_format must be one of {MAPPING_FORMATS}, got {mapping_format!r}"
        )
    return mapping_format


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
    strict=False, mapping_format="dict")``

    * ``hash_algo`` (``"xxh3"`` or ``"sha256"``) and ``hash_seed`` choose the block hash; by
      default the process default (:func:`pagedkv.set_default_hasher`). A sequence hashed with
      another function is rehashed once when the manager first sees it.
    * ``strict=True`` refuses what the default mode accepts for vLLM's sake: ``free`` of a
      sequence without a table (:class:`~pagedkv.errors.UnknownSequenceError`; by default a
      no-op, as vLLM), ``allocate``/``fork`` onto a sequence id that already holds a table and a
      sequence whose ``block_size`` differs from the manager's
      (:class:`~pagedkv.errors.InvalidArgumentError`). The rules: docs/block_manager.md,
      "Strict mode". ``fork`` from a parent without a table always raises (as vLLM).
    * ``mapping_format``: what ``append_slots``/``swap_in``/``swap_out`` return. ``"dict"``
      (default): a read-only :class:`BlockMapping` dict, as vLLM 0.4.2 (``Dict``);
      ``"pairs"``: a ``list`` of ``(src, dst)`` tuples, as vLLM 0.5
      (``blocks_to_copy.extend(cows)``).

    Methods mirror vLLM: ``can_allocate``, ``allocate``, ``can_append_slots``, ``append_slots``
    (returns ``{src_block: [dst_block, ...]}`` copy-on-write pairs), ``fork``, ``free``,
    ``reset``, ``can_swap_in``/``swap_in`` (``{cpu_block: gpu_block}``),
    ``can_swap_out``/``swap_out`` (``{gpu_block: cpu_block}``), ``get_block_table``,
    ``get_num_free_gpu_blocks``, ``get_num_free_cpu_blocks``, ``access_all_blocks_in_seq``,
    ``compute_full_blocks_in_seq``, ``get_all_computed_blocks``,
    ``get_common_computed_block_ids``, ``mark_blocks_as_computed``. The batch step API
    ``append_slots_batch`` and ``fill_block_tables`` write into caller-owned int32 buffers.
    """

    mapping_format = "dict"

    def __new__(
        cls: Type[_M],
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
        sliding_window: Optional[int] = None,
        enable_caching: bool = False,
        *,
        hash_algo: Optional[str] = None,
        hash_seed: Optional[int] = None,
        strict: bool = False,
        mapping_format: str = "dict",
    ) -> _M:
        # The parameters are spelled out (not *args) so that signatures and type checkers show
        # them.
        if check_mapping_format(mapping_format) == "pairs" and cls.mapping_format != "pairs":
            cls = _pairs_class(cls)
        return super().__new__(
            cls,
            block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            watermark,
            sliding_window,
            enable_caching,
            hash_algo=hash_algo,
            hash_seed=hash_seed,
            strict=strict,
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # everything happens in __new__ (the native constructor)

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


_PAIRS_CLASSES: Dict[type, type] = {}


def _pairs_class(cls: type) -> type:
    """``cls`` with ``append_slots``/``swap_in``/``swap_out`` returning vLLM 0.5's lists of
    ``(src, dst)`` pairs (one subclass per manager class, made once)."""
    made = _PAIRS_CLASSES.get(cls)
    if made is None:

        def append_slots(self, seq, num_lookahead_slots=0):
            """``append_slots`` of the base class as a list of ``(src, dst)`` pairs."""
            return cls.append_slots(self, seq, num_lookahead_slots).pairs()

        def swap_in(self, seq_group, *args, **kwargs):
            """``swap_in`` of the base class as a list of ``(src, dst)`` pairs."""
            return cls.swap_in(self, seq_group, *args, **kwargs).pairs()

        def swap_out(self, seq_group):
            """``swap_out`` of the base class as a list of ``(src, dst)`` pairs."""
            return cls.swap_out(self, seq_group).pairs()

        namespace = {
            "mapping_format": "pairs",
            "append_slots": append_slots,
            "swap_in": swap_in,
            "swap_out": swap_out,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        made = _PAIRS_CLASSES[cls] = type(cls.__name__, (cls,), namespace)
    return made


if TYPE_CHECKING:

    class BlockSpaceManagerPairs(BlockSpaceManager):
        """``BlockSpaceManager`` returning lists of ``(src, dst)`` pairs (for type checkers)."""

        def append_slots(  # type: ignore[override]
            self, seq: SequenceLike, num_lookahead_slots: int = 0
        ) -> List[Tuple[int, int]]: ...
        def swap_in(  # type: ignore[override]
            self, seq_group: SequenceGroupLike, num_lookahead_slots: int = 0
        ) -> List[Tuple[int, int]]: ...
        def swap_out(  # type: ignore[override]
            self, seq_group: SequenceGroupLike
        ) -> List[Tuple[int, int]]: ...

else:
    #: ``BlockSpaceManager`` with ``mapping_format="pairs"`` fixed: a drop-in for vLLM 0.5's
    #: ``BlockSpaceManagerV1``, whose scheduler ``extend``s lists with the results.
    BlockSpaceManagerPairs = _pairs_class(BlockSpaceManager)
