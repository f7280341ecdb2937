"""One device's KV-cache block pool in plain Python: the oracle for the native ``BlockPool``.

Every block is in exactly one of three states::

    FREE ──allocate──▶ REFERENCED ──last free, uncached──▶ FREE (pushed on the stack)
      ▲                  │     ▲
      │      last free,  │     │ incref (a cache hit revives it)
      │      cached      ▼     │
      └──── evict ───── EVICTABLE (ref 0, still in the prefix map)

* FREE blocks sit on a LIFO stack (a list; ``pop()`` takes the end). It starts so that blocks come
  out ``N-1, N-2, ...`` without caching and ``0, 1, 2, ...`` with caching, as vLLM's allocators.
* EVICTABLE blocks keep their hash so a later request with the same prefix can revive them.
  Eviction takes the least recently accessed first, then the one holding more hashed tokens,
  then the one that became evictable first (FIFO among equal keys). The key is fixed when the
  block becomes evictable (``touch`` refuses an evictable block). The set is a doubly linked
  list over block numbers kept in eviction order: a block is inserted by walking back from the
  tail (O(1) in the usual case: blocks are released in access order, tail first), revived or
  evicted by unlinking it in O(1).
* The prefix map goes from block hash to block. A cached block also stores its token ids and an
  opaque ``meta`` value (the manager passes ``(parent block, its generation, lora id, cache
  salt)``); a lookup hits only if all of them are equal, so a hash collision never hands out
  another prompt's KV data.

Costs: every operation is O(1) (insertion into the eviction list in the usual case, see
above) except ``eviction_order`` (O(n), introspection only). A call that raises changes nothing.
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Iterable, List, Optional, Sequence, Tuple

from pagedkv.errors import DoubleFreeError, InvalidArgumentError, OutOfBlocksError

__all__ = ["BlockPool", "NEVER_ACCESSED"]

_NIL = -1  # end of the eviction list
# The prefix map is keyed by a hash's low 64 bits (one block per such slot; a hit also needs
# the whole hash), as the native pool's table is (docs/block_manager.md).
_SLOT = (1 << 64) - 1

# ``last_accessed`` of a block that was never accessed (vLLM's DEFAULT_LAST_ACCESSED_TIME).
NEVER_ACCESSED = -1.0

_DEVICES = {"gpu": "gpu", "GPU": "gpu", "cuda": "gpu", "cpu": "cpu", "CPU": "cpu"}


class BlockPool:
    """Ref-counted blocks ``0..num_blocks-1`` of one device, with an optional prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        device: str = "gpu",
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be a non-negative int, got {num_blocks}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise InvalidArgumentError(f"block_size must be a positive int, got {block_size}")
        if device not in _DEVICES:
            raise InvalidArgumentError(f"device must be 'gpu' or 'cpu', got {device!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = _DEVICES[device]
        self.enable_caching = bool(enable_caching)

        n = num_blocks
        self._ref: List[int] = [0] * n
        self._hash: List[Optional[int]] = [None] * n  # set iff the block is in the prefix map
        self._tokens: List[Optional[List[int]]] = [None] * n
        self._meta: List[Hashable] = [None] * n
        # bumped each time a block is handed out fresh; the manager stores a parent's
        # generation in its children's meta, so a reused parent no longer vouches for them
        self._gen: List[int] = [0] * n
        self._num_hashed: List[int] = [0] * n
        self._last_accessed: List[float] = [NEVER_ACCESSED] * n
        self._computed: List[bool] = [False] * n
        # Popped from the end: caching hands out 0, 1, 2, ...; no caching N-1, N-2, ...
        self._free: List[int] = (
            list(range(n - 1, -1, -1)) if self.enable_caching else list(range(n))
        )
        self._map: dict = {}
        # Evictable blocks: a doubly linked list in eviction order (_NIL ends it).
        self._prev: List[int] = [_NIL] * n
        self._next: List[int] = [_NIL] * n
        self._head = _NIL
        self._tail = _NIL
        self._evictable: List[bool] = [False] * n
        self.num_evictable = 0
        self.lookups = 0
        self.hits = 0
        self.evictions = 0

    # ---- counters ----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Free blocks: uncached free plus evictable."""
        return len(self._free) + self.num_evictable

    @property
    def num_referenced(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._map)

    # ---- per-block views ---------------------------------------------------------------------

    def _check(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise InvalidArgumentError(
                f"block id {block} is out of range (pool has {self.num_blocks} blocks)"
            )
        return block

    def ref_count(self, block: int) -> int:
        return self._ref[self._check(block)]

    def block_hash(self, block: int) -> Optional[int]:
        return self._hash[self._check(block)]

    def num_hashed_tokens(self, block: int) -> int:
        return self._num_hashed[self._check(block)]

    def last_accessed(self, block: int) -> float:
        return self._last_accessed[self._check(block)]

    def is_evictable(self, block: int) -> bool:
        return self._evictable[self._check(block)]

    def is_computed(self, block: int) -> bool:
        return self._computed[self._check(block)]

    def set_computed(self, block: int, computed: bool = True) -> None:
        self._computed[self._check(block)] = computed

    def cache_entry(self, block: int) -> Optional[Tuple[int, List[int], Hashable, int]]:
        """``(hash, token ids, meta, num_hashed_tokens)`` of a cached block, else None."""
        h = self._hash[self._check(block)]
        if h is None:
            return None
        return h, self._tokens[block], self._meta[block], self._num_hashed[block]

    def eviction_order(self) -> List[int]:
        """Evictable blocks, next victim first (O(n), for introspection)."""
        out = []
        b = self._head
        while b != _NIL:
            out.append(b)
            b = self._next[b]
        return out

    # ---- allocation and references -----------------------------------------------------------

    def allocate(self) -> int:
        """A block with ref count 1: pop the free stack, else evict the LRU cached block."""
        if self._free:
            b = self._free.pop()
        elif self.num_evictable:
            b = self._pop_evictable()
            del self._map[self._hash[b] & _SLOT]
            self._hash[b] = None
            self._tokens[b] = None
            self._meta[b] = None
            self._num_hashed[b] = 0
            self._computed[b] = False
            self.evictions += 1
        else:
            raise OutOfBlocksError(f"out of {self.device} blocks: 1 needed, 0 free")
        self._ref[b] = 1
        self._gen[b] += 1
        return b

    def generation(self, block: int) -> int:
        """How many times ``block`` was handed out fresh (a parent-identity check)."""
        return self._gen[block]

    def allocate_many(self, n: int) -> List[int]:
        """``n`` fresh blocks in one call; all or nothing."""
        if n < 0:
            raise InvalidArgumentError(f"n must be non-negative, got {n}")
        if n > self.num_free:
            raise OutOfBlocksError(f"out of {self.device} blocks: {n} needed, {self.num_free} free")
        return [self.allocate() for _ in range(n)]

    def incref(self, block: int, n: int = 1) -> None:
        """Add ``n`` references to a referenced or evictable block (an evictable one revives)."""
        self._check(block)
        if n <= 0:
            raise InvalidArgumentError("n must be positive")
        if self._ref[block] == 0:
            if self._hash[block] is None:
                raise InvalidArgumentError(f"block {block} is free; it cannot be shared")
            self._unlink(block)
        self._ref[block] += n

    def free(self, block: int) -> None:
        """Drop one reference; at zero a cached block becomes evictable, an uncached one free."""
        self._check(block)
        r = self._ref[block]
        if r == 0:
            raise DoubleFreeError(f"block {block} freed while its ref count is already 0")
        self._ref[block] = r - 1
        if r == 1:
            if self._hash[block] is not None:
                self._push_evictable(block)
            else:
                self._computed[block] = False
                self._free.append(block)

    def free_many(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each listed block; all or nothing (checked first)."""
        blocks = list(blocks)
        counts: dict = {}
        for b in blocks:
            self._check(b)
            counts[b] = counts.get(b, 0) + 1
        for b, c in counts.items():
            if self._ref[b] < c:
                raise DoubleFreeError(f"block {b} freed while its ref count is already 0")
        for b in blocks:
            self.free(b)

    def touch(self, block: int, access_time: float) -> None:
        """Set a block's last access time (eviction takes the least recent first)."""
        self._check(block)
        if not math.isfinite(access_time):
            raise InvalidArgumentError("access_time must be finite")
        if self._evictable[block]:
            raise InvalidArgumentError(f"block {block} is evictable; revive it before touching it")
        self._last_accessed[block] = access_time

    # ---- prefix cache ------------------------------------------------------------------------

    def peek(
        self, block_hash: int, token_ids: Sequence[int], meta: Hashable = None
    ) -> Optional[int]:
        """The cached block holding exactly ``token_ids`` (and ``meta``) under ``block_hash``,
        or None. Changes nothing, not even the hit counters."""
        b = self._map.get(block_hash & _SLOT)
        if b is None or self._hash[b] != block_hash or self._meta[b] != meta:
            return None
        if type(token_ids) is not list:
            token_ids = list(token_ids)
        if self._tokens[b] != token_ids:
            return None  # a miss, or a hash collision: never share different contents
        return b

    def lookup(
        self, block_hash: int, token_ids: Sequence[int], meta: Hashable = None
    ) -> Optional[int]:
        """Like :meth:`peek`, counted in ``lookups``/``hits``. Does not take a reference."""
        if len(token_ids) != self.block_size:
            raise InvalidArgumentError(
                f"token_ids must hold block_size={self.block_size} tokens, got {len(token_ids)}"
            )
        self.lookups += 1
        b = self.peek(block_hash, token_ids, meta)
        if b is not None:
            self.hits += 1
        return b

    def register(
        self,
        block: int,
        block_hash: int,
        token_ids: Sequence[int],
        num_hashed_tokens: Optional[int] = None,
        meta: Hashable = None,
    ) -> bool:
        """Cache a referenced, full, uncached block under ``block_hash``. Returns False (and
        changes nothing) when another block already holds that hash."""
        self._check(block)
        if len(token_ids) != self.block_size:
            raise InvalidArgumentError(
                f"a cached block holds exactly block_size={self.block_size} tokens, "
                f"got {len(token_ids)}"
            )
        if not self.enable_caching:
            raise InvalidArgumentError("prefix caching is disabled on this pool")
        if self._ref[block] == 0:
            raise InvalidArgumentError(f"block {block} is not allocated")
        if self._hash[block] is not None:
            raise InvalidArgumentError(f"block {block} is already cached")
        if block_hash & _SLOT in self._map:
            return False
        self._map[block_hash & _SLOT] = block
        self._hash[block] = block_hash
        self._tokens[block] = list(token_ids)
        self._meta[block] = meta
        self._num_hashed[block] = (
            self.block_size if num_hashed_tokens is None else num_hashed_tokens
        )
        return True

    # ---- eviction list ----------------------------------------------------------------------

    def _evicts_before(self, a: int, b: int) -> bool:
        ta, tb = self._last_accessed[a], self._last_accessed[b]
        return ta < tb or (ta == tb and self._num_hashed[a] > self._num_hashed[b])

    def _push_evictable(self, block: int) -> None:
        # Walk back from the tail past every block that must be evicted after this one.
        after = self._tail
        while after != _NIL and self._evicts_before(block, after):
            after = self._prev[after]
        before = self._head if after == _NIL else self._next[after]
        self._prev[block], self._next[block] = after, before
        if after == _NIL:
            self._head = block
        else:
            self._next[after] = block
        if before == _NIL:
            self._tail = block
        else:
            self._prev[before] = block
        self._evictable[block] = True
        self.num_evictable += 1

    def _unlink(self, block: int) -> None:
        p, nx = self._prev[block], self._next[block]
        if p == _NIL:
            self._head = nx
        else:
            self._next[p] = nx
        if nx == _NIL:
            self._tail = p
        else:
            self._prev[nx] = p
        self._prev[block] = self._next[block] = _NIL
        self._evictable[block] = False
        self.num_evictable -= 1

    def _pop_evictable(self) -> int:
        b = self._head
        self._unlink(b)
        return b

    # ---- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if a structural invariant is broken (O(n), for tests)."""
        state: List[Any] = [None] * self.num_blocks
        for b in self._free:
            assert state[b] is None, f"block {b} is on the free stack twice"
            assert self._ref[b] == 0 and self._hash[b] is None, f"free block {b} has refs/hash"
            state[b] = "free"
        order = self.eviction_order()
        assert len(order) == self.num_evictable, "evictable count mismatch"
        for b in order:
            assert state[b] is None, f"block {b} is both free and evictable"
            assert self._ref[b] == 0 and self._hash[b] is not None, f"{b} is not evictable"
            state[b] = "evictable"
        for b in range(self.num_blocks):
            if state[b] is None:
                assert self._ref[b] > 0, f"block {b} is lost: ref 0, not free, not evictable"
            h = self._hash[b]
            if h is not None:
                assert self._map.get(h & _SLOT) == b, f"block {b}'s hash is not in the prefix map"
        assert len(self._map) == sum(h is not None for h in self._hash), "prefix map size"

    def __repr__(self) -> str:
        return (
            f"BlockPool(device={self.device!r}, num_blocks={self.num_blocks}, "
            f"free={self.num_free}, cached={self.num_cached}, evictable={self.num_evictable})"
        )
