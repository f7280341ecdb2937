"""The objects vLLM's scheduler and connectors read back from the native manager.

* :class:`BlockView`: one block as vLLM's ``KVCacheBlock`` shows it (``block_id``, live
  ``ref_cnt``, ``block_hash``, ``block_hash_num_tokens``, ``is_null``), made on demand: the pool
  keeps no Python object per block.
* :func:`make_blocks_class`: a subclass of vLLM's ``KVCacheBlocks`` holding one list of block
  ids per group (one list for the one-group manager, one per group for the hybrid manager),
  with ``get_block_ids`` answered from the ids (no view is built on the scheduler's path) and
  ``blocks`` (views of the manager's block class) built only when read;
  :func:`make_empty_blocks` the managers' empty value (one group or several),
  :func:`block_ids_of` the ids of any block list.
* :class:`RequestBlocksView`: a single-type manager's ``req_to_blocks`` as vLLM's own tests
  read it (a request's blocks in one group, read-only).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

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
    def _block_hash(self) -> Optional[bytes]:
        """vLLM's ``KVCacheBlock`` slot behind ``block_hash`` (vLLM's own tests read it)."""
        return self.block_hash

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


def make_empty_blocks(kv_cache_blocks_cls: type, num_groups: int = 1) -> Any:
    """vLLM's shared empty ``KVCacheBlocks`` (``num_groups`` groups, no blocks), a plain
    instance of vLLM's class whose ``get_block_ids`` answers without vLLM's per-call
    generator: the scheduler asks it once per running request per step (``allow_none=True``:
    ``None``)."""
    empty = kv_cache_blocks_cls(tuple(() for _ in range(num_groups)))
    slow = empty.get_block_ids

    def get_block_ids(
        allow_none: bool = False, *, group_ids: Optional[Sequence[int]] = None
    ) -> Optional[Tuple[List[int], ...]]:
        if group_ids is not None:
            return slow(allow_none, group_ids=group_ids)
        return None if allow_none else tuple([] for _ in range(num_groups))

    # An instance attribute shadows the method; the dataclass's fields, equality and repr
    # are vLLM's.
    empty.get_block_ids = get_block_ids
    return empty


class RequestBlocksView:
    """A group's ``req_to_blocks``, read live and read-only: ``view[request_id]`` is the
    request's blocks in the group as block views, its null blocks the pool view's own
    ``null_block`` object (vLLM's tests count them with ``is``); a request the group holds no
    block for reads as ``[]`` and is not ``in`` it (vLLM's ``defaultdict`` may also keep an
    emptied entry: no scheduler decision reads that)."""

    def __init__(
        self,
        block_ids: Callable[[str], Sequence[Sequence[int]]],
        group: int,
        view: Callable[[int], Any],
        null_block: Any,
        count: Optional[Callable[[], int]] = None,
    ) -> None:
        self._block_ids = block_ids
        self._group = group
        self._view = view
        self._null_block = null_block
        self._count = count

    def __len__(self) -> int:
        """The requests with a block table (vLLM's entries: from a request's first allocation
        until it is freed), where the manager counts them."""
        if self._count is None:
            raise TypeError("this group's req_to_blocks view does not count its requests")
        return self._count()

    def __getitem__(self, request_id: str) -> List[Any]:
        return self._views(self._block_ids(request_id)[self._group])

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and bool(self._block_ids(request_id)[self._group])

    def get(self, request_id: str, default: Any = None) -> Any:
        ids = self._block_ids(request_id)[self._group] if isinstance(request_id, str) else ()
        return self._views(ids) if ids else default

    def _views(self, ids: Sequence[int]) -> List[Any]:
        return [self._null_block if b == 0 else self._view(b) for b in ids]


class CachedCountView:
    """A group's ``num_cached_block``, read live and read-only: ``view[request_id]`` is how
    many of the request's leading blocks the group has cached, for a request it tracks
    (vLLM's dict holds an entry from the request's first caching or adopted hit until it is
    freed); any other id is a ``KeyError`` and not ``in`` it."""

    def __init__(
        self, num_cached: Callable[[str], Optional[int]], count: Callable[[], int]
    ) -> None:
        self._num_cached = num_cached
        self._count = count

    def __len__(self) -> int:
        return self._count()

    def _lookup(self, request_id: object) -> Optional[int]:
        return self._num_cached(request_id) if isinstance(request_id, str) else None

    def __getitem__(self, request_id: str) -> int:
        n = self._lookup(request_id)
        if n is None:
            raise KeyError(request_id)
        return n

    def __contains__(self, request_id: object) -> bool:
        return self._lookup(request_id) is not None

    def get(self, request_id: str, default: Any = None) -> Any:
        n = self._lookup(request_id)
        return default if n is None else n


def make_blocks_class(kv_cache_blocks_cls: type, native: Any, view: type = BlockView) -> type:
    """A subclass of vLLM's ``KVCacheBlocks`` over ``native``'s block ids, one list per group
    (the one-group manager's: a tuple of one list; the hybrid manager's: one per group).
    ``get_block_ids``, ``get_unhashed_block_ids``, ``+`` and ``new_empty`` answer from the ids,
    so the scheduler's path (a prefix hit handed back to ``allocate_slots``, new blocks read as
    ids) builds no object per block; ``blocks`` makes ``view`` objects when read."""

    class NativeKVCacheBlocks(kv_cache_blocks_cls):  # type: ignore[misc, valid-type]
        """vLLM's ``KVCacheBlocks``, holding block ids per group; views made when read."""

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
            n = self._native
            return tuple([view(n, b) for b in g] for g in self._ids)

        def get_block_ids(
            self, allow_none: bool = False, *, group_ids: Optional[Sequence[int]] = None
        ) -> Optional[Tuple[List[int], ...]]:
            groups = self._ids if group_ids is None else tuple([self._ids[i] for i in group_ids])
            if allow_none and not any(groups):
                return None
            if len(groups) == 1:
                # The one-group manager's every call (the scheduler's, per request per step):
                # no iterator built.
                return (list(groups[0]),)
            return tuple(map(list, groups))

        def get_unhashed_block_ids(self) -> List[int]:
            assert len(self._ids) == 1, "Only one group is supported"
            n = self._native
            return [b for b in self._ids[0] if n.block_hash(b) is None]

        def __add__(self, other: Any) -> Any:
            if isinstance(other, NativeKVCacheBlocks):
                return NativeKVCacheBlocks(tuple(a + b for a, b in zip(self._ids, other._ids)))
            return super().__add__(other)

        def new_empty(self) -> Any:
            return kv_cache_blocks_cls(tuple(() for _ in self._ids))

        def __repr__(self) -> str:
            return f"KVCacheBlocks(block_ids={self._ids}, native=pagedkv)"

    NativeKVCacheBlocks.__qualname__ = "NativeKVCacheBlocks"
    return NativeKVCacheBlocks
