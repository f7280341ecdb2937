"""The objects vLLM's scheduler and connectors read back from the native manager.

* :class:`BlockView`: one block as vLLM's ``KVCacheBlock`` shows it (``block_id``, live
  ``ref_cnt``, ``block_hash``, ``block_hash_num_tokens``, ``is_null``), made on demand: the pool
  keeps no Python object per block.
* :func:`make_blocks_class`: a subclass of vLLM's ``KVCacheBlocks`` whose one group is a list
  of block ids, with ``get_block_ids`` answered from the ids (no view is built on the
  scheduler's path) and ``blocks`` built only when read; :func:`make_empty_blocks` its empty
  value, :func:`block_ids_of` the ids of any block list;
* :func:`make_groups_blocks_class`: the same for several groups (the hybrid manager's), one id
  list per group, views of the manager's own block class built only when ``blocks`` is read.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence, Tuple

#: vLLM's ``make_block_hash_with_group_id`` suffix for group 0 (4 bytes, big endian).
_GROUP0 = b"\x00\x00\x00\x00"


class BlockView:
    """A block of a native pool, read live (``ref_cnt`` and the hash change as the pool does)."""

    __slots__ = ("_native", "block_id")

    def __init__(self, native: Any, block_id: int) -> None:
        self._native = native
        self.block_id = block_id

    @property
    def ref_cnt(self) -> int:
        return 0 if self.block_id == 0 else self._native.ref_cnt(self.block_id)

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    @property
    def block_hash(self) -> Optional[bytes]:
        """vLLM's ``BlockHashWithGroupId`` (the hash and group 0), or ``None``."""
        h = self._native.block_hash(self.block_id)
        return None if h is None else h + _GROUP0

    @property
    def block_hash_num_tokens(self) -> Optional[int]:
        return self._native.hashed_tokens(self.block_id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockView):
            return NotImplemented
        return self.block_id == other.block_id and self._native is other._native

    def __hash__(self) -> int:
        return hash(self.block_id)

    def __repr__(self) -> str:
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, native=pagedkv)"


def block_ids_of(blocks: Iterable[Any]) -> List[int]:
    """Block ids of views (or of vLLM-shaped blocks that carry ``block_id``)."""
    return [b.block_id for b in blocks]


def make_empty_blocks(kv_cache_blocks_cls: type) -> Any:
    """vLLM's shared empty ``KVCacheBlocks`` (one group, no blocks), a plain instance of vLLM's
    class whose ``get_block_ids`` answers without vLLM's per-call generator: the scheduler asks
    it once per running request per step (``allow_none=True``: ``None``)."""
    empty = kv_cache_blocks_cls(((),))
    slow = empty.get_block_ids

    def get_block_ids(
        allow_none: bool = False, *, group_ids: Optional[Sequence[int]] = None
    ) -> Optional[Tuple[List[int], ...]]:
        if group_ids is not None:
            return slow(allow_none, group_ids=group_ids)
        return None if allow_none else ([],)

    # An instance attribute shadows the method; the dataclass's fields, equality and repr
    # are vLLM's.
    empty.get_block_ids = get_block_ids
    return empty


def make_blocks_class(kv_cache_blocks_cls: type, native: Any) -> type:
    """A subclass of vLLM's ``KVCacheBlocks`` over one group of ``native``'s block ids."""

    class NativeKVCacheBlocks(kv_cache_blocks_cls):  # type: ignore[misc, valid-type]
        """vLLM's ``KVCacheBlocks`` for one group, holding block ids; views made when read."""

        __slots__ = ("_ids",)
        _native = native

        def __init__(self, ids: List[int]) -> None:
            self._ids = ids

        @property
        def blocks(self) -> Tuple[Sequence[BlockView], ...]:  # type: ignore[override]
            return ([BlockView(self._native, b) for b in self._ids],)

        def get_block_ids(
            self, allow_none: bool = False, *, group_ids: Optional[Sequence[int]] = None
        ) -> Optional[Tuple[List[int], ...]]:
            if group_ids is not None and list(group_ids) != [0]:
                return super().get_block_ids(allow_none, group_ids=group_ids)
            if allow_none and not self._ids:
                return None
            return (list(self._ids),)

        def get_unhashed_block_ids(self) -> List[int]:
            n = self._native
            return [b for b in self._ids if n.block_hash(b) is None]

        def __add__(self, other: Any) -> Any:
            if isinstance(other, NativeKVCacheBlocks):
                return NativeKVCacheBlocks(self._ids + other._ids)
            return super().__add__(other)

        def __repr__(self) -> str:
            return f"KVCacheBlocks(block_ids=({self._ids},), native=pagedkv)"

    NativeKVCacheBlocks.__qualname__ = "NativeKVCacheBlocks"
    return NativeKVCacheBlocks


def make_groups_blocks_class(kv_cache_blocks_cls: type, native: Any, view: type) -> type:
    """A subclass of vLLM's ``KVCacheBlocks`` over several groups of ``native``'s block ids:
    ``get_block_ids`` and ``+`` answer from the ids, so the scheduler's path (a prefix hit
    handed back to ``allocate_slots``, new blocks read as ids) builds no object per block;
    ``blocks`` makes ``view`` objects when read."""

    class NativeGroupsKVCacheBlocks(kv_cache_blocks_cls):  # type: ignore[misc, valid-type]
        """vLLM's ``KVCacheBlocks`` for every group, holding block ids; views made when read."""

        __slots__ = ("_ids",)
        _native = native

        def __init__(self, ids: Tuple[List[int], ...]) -> None:
            self._ids = ids

        @property
        def ids(self) -> Tuple[List[int], ...]:
            """The block ids per group (the object's own lists: not to be changed)."""
            return self._ids

        @property
        def blocks(self) -> Tuple[Sequence[Any], ...]:  # type: ignore[override]
            return tuple([view(self._native, b) for b in g] for g in self._ids)

        def get_block_ids(
            self, allow_none: bool = False, *, group_ids: Optional[Sequence[int]] = None
        ) -> Optional[Tuple[List[int], ...]]:
            groups = self._ids if group_ids is None else tuple(self._ids[i] for i in group_ids)
            if allow_none and not any(groups):
                return None
            return tuple(list(g) for g in groups)

        def __add__(self, other: Any) -> Any:
            if isinstance(other, NativeGroupsKVCacheBlocks):
                return NativeGroupsKVCacheBlocks(
                    tuple(a + b for a, b in zip(self._ids, other._ids))
                )
            return super().__add__(other)

        def new_empty(self) -> Any:
            return kv_cache_blocks_cls(tuple(() for _ in self._ids))

        def __repr__(self) -> str:
            return f"KVCacheBlocks(block_ids={self._ids}, native=pagedkv)"

    return NativeGroupsKVCacheBlocks
