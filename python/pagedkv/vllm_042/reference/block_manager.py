"""vLLM's BlockSpaceManagerV1 semantics in plain Python: the test oracle and benchmark baseline.

The contract is ``docs/block_manager.md``; this file follows it line by line, and the native
:class:`pagedkv.BlockSpaceManager` is compared against it step by step. Data layout:

* two :class:`~pagedkv.vllm_042.reference.pool.BlockPool` objects (``"gpu"``, ``"cpu"``) own ref
  counts, the free stacks, the prefix caches and the eviction order;
* ``_tables`` maps ``seq_id -> _Table(blocks, device, reserved)`` in creation order. ``blocks``
  is a list of block numbers; with a sliding window of ``W`` blocks it is periodic
  (``blocks[i] == blocks[i % W]``), so its distinct blocks are ``blocks[:W]``. A table holds one
  reference on each of its distinct blocks.

Every method checks everything that can fail before it changes anything, so a call that raises
leaves the manager as it was. Per block the work is O(1) (dict and list operations).

Sequences and groups are duck-typed. From a sequence this reads only ``seq_id``, ``status``
(compared by ``.name``), ``get_len()``, ``block_size``, ``hash_of_block(i)``,
``block_token_ids(i)``, ``lora_int_id``, ``cache_salt`` (optional) and ``is_finished()``; from a
group only ``get_seqs()`` and ``request_id``.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Tuple

from pagedkv.errors import InvalidArgumentError, OutOfBlocksError, UnknownSequenceError
from pagedkv.vllm_042.block import Device, PhysicalTokenBlock
from pagedkv.vllm_042.block_manager import AllocStatus, BlockMapping, check_mapping_format
from pagedkv.vllm_042.reference.pool import BlockPool

__all__ = ["AllocStatus", "BlockSpaceManager"]

_DEVICES = {"gpu": "gpu", "GPU": "gpu", "cuda": "gpu", "cpu": "cpu", "CPU": "cpu"}


class _Table:
    """A sequence's block table, the device it lives on and how many token slots it reserved."""

    __slots__ = ("blocks", "device", "reserved")

    def __init__(self, blocks: List[int], device: str, reserved: int) -> None:
        self.blocks = blocks
        self.device = device
        self.reserved = reserved

    def copy(self) -> _Table:
        return _Table(list(self.blocks), self.device, self.reserved)


def _status(seq) -> str:
    return seq.status.name


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockSpaceManager:
    """Maps each sequence's logical blocks to physical KV-cache blocks (vLLM v1 semantics)."""

    def __init__(
        self,
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
    ) -> None:
        self.mapping_format = check_mapping_format(mapping_format)
        if not isinstance(block_size, int) or block_size <= 0:
            raise InvalidArgumentError(f"block_size must be a positive int, got {block_size}")
        for name, value in (("num_gpu_blocks", num_gpu_blocks), ("num_cpu_blocks", num_cpu_blocks)):
            if not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{name} must be a non-negative int, got {value}")
        if not (watermark >= 0.0 and math.isfinite(watermark)):
            raise InvalidArgumentError(f"watermark must be >= 0, got {watermark}")
        window: Optional[int] = None
        if sliding_window is not None:
            if sliding_window <= 0 or sliding_window % block_size != 0:
                raise InvalidArgumentError(
                    f"sliding_window ({sliding_window}) must be a positive multiple of "
                    f"block_size ({block_size})"
                )
            if enable_caching:
                raise InvalidArgumentError(
                    "prefix caching cannot be combined with a sliding window"
                )
            window = sliding_window // block_size

        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.watermark = watermark
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.block_sliding_window = window
        self.enable_caching = bool(enable_caching)
        self.strict = bool(strict)
        # The block hashes come from the sequences; these are kept for signature compatibility.
        self.hash_algo = hash_algo
        self.hash_seed = hash_seed

        self.gpu = BlockPool(num_gpu_blocks, block_size, enable_caching=enable_caching)
        self.cpu = BlockPool(
            num_cpu_blocks, block_size, enable_caching=enable_caching, device="cpu"
        )
        self._pools = {"gpu": self.gpu, "cpu": self.cpu}
        self._tables: Dict[int, _Table] = {}

    # ---- small helpers -----------------------------------------------------------------------

    def _distinct(self, blocks: List[int]) -> List[int]:
        w = self.block_sliding_window
        return blocks[:w] if w is not None and len(blocks) > w else blocks

    def _set_entry(self, blocks: List[int], i: int, b: int) -> None:
        """Point logical block ``i`` at ``b`` (every periodic copy of it in a window table)."""
        w = self.block_sliding_window
        if w is None:
            blocks[i] = b
        else:
            for j in range(i % w, len(blocks), w):
                blocks[j] = b

    @staticmethod
    def _meta(pool: BlockPool, parent: Optional[int], lora_id: int, salt) -> tuple:
        """A cached block's parent is confirmed by identity: the physical block holding the
        previous block of the sequence, and the generation it had (a hit then implies, by
        induction from block 0, that the whole prefix is the same data, collisions or not)."""
        gen = pool.generation(parent) if parent is not None else 0
        return (parent, gen, lora_id, salt)

    def _key(
        self, seq, i: int, parent: Optional[int], pool: BlockPool
    ) -> Tuple[int, List[int], tuple]:
        """``(hash, tokens, meta)`` of full block ``i`` whose block ``i - 1`` is held by
        ``parent`` (``None`` for block 0)."""
        meta = self._meta(pool, parent, seq.lora_int_id, getattr(seq, "cache_salt", None))
        return seq.hash_of_block(i), seq.block_token_ids(i), meta

    def _result(self, mapping: BlockMapping):
        """The manager's chosen result shape: the dict itself, or vLLM 0.5's pairs."""
        return mapping.pairs() if self.mapping_format == "pairs" else mapping

    def _caches(self, seq) -> bool:
        """Prefix caching applies only to sequences counted in the manager's own block size:
        a sequence's blocks are counted in its own ``block_size`` (as vLLM does), and cache
        entries made in different units must never be shared."""
        return self.enable_caching and seq.block_size == self.block_size

    def _table(self, seq) -> _Table:
        t = self._tables.get(seq.seq_id)
        if t is None:
            raise UnknownSequenceError(f"unknown sequence id {seq.seq_id}")
        return t

    def _table_on(self, seq, device: str) -> _Table:
        t = self._table(seq)
        if t.device != device:
            raise InvalidArgumentError(
                f"sequence {seq.seq_id} is on the {t.device}, not the {device}"
            )
        return t

    @staticmethod
    def _with_status(seq_group, name: str) -> list:
        return [s for s in seq_group.get_seqs() if _status(s) == name]

    def _distinct_blocks(self, seqs: Iterable) -> int:
        """Distinct (device, block) pairs over the tables of ``seqs`` (all must exist)."""
        seen = set()
        for seq in seqs:
            t = self._table(seq)
            for b in self._distinct(t.blocks):
                seen.add((t.device, b))
        return len(seen)

    def _check_strict_units(self, seq) -> None:
        """Strict mode refuses a sequence counted in other units than the manager's."""
        if self.strict and seq.block_size != self.block_size:
            raise InvalidArgumentError(
                f"sequence block_size {seq.block_size} does not match the manager's "
                f"{self.block_size} (strict mode)"
            )

    def _check_strict_fresh(self, seq) -> None:
        """Strict mode refuses a table for a sequence id that already holds one."""
        if self.strict and seq.seq_id in self._tables:
            raise InvalidArgumentError(
                f"sequence {seq.seq_id} already holds a block table (strict mode)"
            )

    def _fresh_gpu_block(self, refs: int) -> int:
        b = self.gpu.allocate()
        if refs > 1:
            self.gpu.incref(b, refs - 1)
        return b

    # ---- allocation --------------------------------------------------------------------------

    def can_allocate(self, seq_group) -> AllocStatus:
        waiting = self._with_status(seq_group, "WAITING")
        if not waiting:
            raise InvalidArgumentError(
                f"sequence group {seq_group.request_id!r} has no WAITING sequence"
            )
        seq = waiting[0]
        self._check_strict_units(seq)
        n = _ceil_div(seq.get_len(), seq.block_size)
        if self.block_sliding_window is not None:
            n = min(n, self.block_sliding_window)
        if self.num_total_gpu_blocks - n < self.watermark_blocks:
            return AllocStatus.NEVER
        if self.gpu.num_free - n >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq_group) -> None:
        """Give every WAITING sequence of the group one shared prompt table (ref count k); a
        sequence that already holds a table gets the new one (the old one is released; strict
        mode refuses it)."""
        waiting = self._with_status(seq_group, "WAITING")
        if not waiting:
            raise InvalidArgumentError(
                f"sequence group {seq_group.request_id!r} has no WAITING sequence"
            )
        for s in waiting:
            self._check_strict_units(s)
            self._check_strict_fresh(s)
        seq = waiting[0]
        k = len(waiting)
        bs = seq.block_size
        length = seq.get_len()
        n = _ceil_div(length, bs)
        w = self.block_sliding_window
        gpu = self.gpu
        caching = self._caches(seq)

        full = length // bs if caching else 0
        if caching:
            # Walk the chain as the loop below will: block i can only hit if block i-1 did.
            # Only hits on referenced blocks cost no free block (their parents are referenced
            # too, so no eviction in the loop can turn them into misses).
            need = n
            parent = None
            for i in range(full):
                c = gpu.peek(*self._key(seq, i, parent, gpu))
                if c is None:
                    break
                if gpu._ref[c] > 0:
                    need -= 1
                parent = c
        else:
            need = n if w is None else min(n, w)
        if need > gpu.num_free:
            raise OutOfBlocksError(f"out of gpu blocks: {need} needed, {gpu.num_free} free")

        blocks: List[int] = []
        for i in range(n):
            if w is not None and i >= w:
                b = blocks[i % w]
            elif i < full:
                h, toks, meta = self._key(seq, i, blocks[-1] if i else None, gpu)
                b = gpu.lookup(h, toks, meta)  # counted: the prefix-cache hit rate
                if b is not None:
                    gpu.incref(b, k)
                else:
                    b = self._fresh_gpu_block(k)
                    gpu.register(b, h, toks, (i + 1) * bs, meta)
            else:
                b = self._fresh_gpu_block(k)
            blocks.append(b)
        for s in waiting:
            # vLLM overwrites an existing table (leaking it); we release it, after the new
            # table is built so that the blocks chosen are vLLM's.
            old = self._tables.pop(s.seq_id, None)
            if old is not None:
                self._release(old)
            self._tables[s.seq_id] = _Table(list(blocks), "gpu", length)

    # ---- appending ---------------------------------------------------------------------------

    def _appendable(self, seq, num_lookahead_slots: int) -> _Table:
        if num_lookahead_slots < 0:
            raise InvalidArgumentError("num_lookahead_slots must be non-negative")
        self._check_strict_units(seq)
        t = self._table(seq)
        if t.device != "gpu":
            raise InvalidArgumentError(
                f"sequence {seq.seq_id} is swapped out to the cpu; swap it in first"
            )
        if seq.get_len() < t.reserved:
            raise InvalidArgumentError(
                f"sequence {seq.seq_id} has {seq.get_len()} tokens but {t.reserved} slots "
                "were already reserved"
            )
        return t

    def _append_need(self, t: _Table, target: int, bs: int) -> int:
        """Upper bound on the free GPU blocks ``append_slots`` takes (cache hits not counted
        as savings). A window block created by this same call always has ref count 1. ``bs``:
        the sequence's own block size."""
        w = self.block_sliding_window
        blocks = t.blocks
        ref = self.gpu._ref
        need = 0
        for i in range(t.reserved // bs, _ceil_div(target, bs)):
            if i < len(blocks):
                if ref[blocks[i]] > 1:
                    need += 1
            elif w is not None and i >= w:
                if i - w < len(blocks) and ref[blocks[i - w]] != 1:
                    need += 1
            else:
                need += 1
        return need

    def can_append_slots(self, seq_group, num_lookahead_slots: int = 0) -> bool:
        if num_lookahead_slots < 0:
            raise InvalidArgumentError("num_lookahead_slots must be non-negative")
        running = self._with_status(seq_group, "RUNNING")
        need = 0
        for seq in running:  # a question, not an action: only the table must exist
            self._check_strict_units(seq)
            t = self._table(seq)
            need += self._append_need(t, seq.get_len() + num_lookahead_slots, seq.block_size)
        return self.gpu.num_free >= max(len(running), need)

    def append_slots(self, seq, num_lookahead_slots: int = 0) -> Dict[int, List[int]]:
        """Reserve slots for every token appended since the last call plus the lookahead.
        Returns the copy-on-write pairs ``{src: [dst, ...]}``."""
        t = self._appendable(seq, num_lookahead_slots)
        gpu = self.gpu
        length = seq.get_len()
        target = length + num_lookahead_slots
        bs = seq.block_size
        need = self._append_need(t, target, bs)
        if need > gpu.num_free:
            raise OutOfBlocksError(f"out of gpu blocks: {need} needed, {gpu.num_free} free")

        w = self.block_sliding_window
        caching = self._caches(seq)
        blocks = t.blocks
        ref = gpu._ref
        copies: Dict[int, List[int]] = {}
        for i in range(t.reserved // bs, _ceil_div(target, bs)):
            key = (
                self._key(seq, i, blocks[i - 1] if i else None, gpu)
                if caching and length >= (i + 1) * bs
                else None
            )
            if i < len(blocks):
                b = blocks[i]
                if ref[b] > 1:  # copy on write, or switch to an identical cached block
                    c = gpu.peek(*key) if key is not None else None
                    if c is not None and c != b:
                        gpu.incref(c)
                        gpu.free(b)
                        self._set_entry(blocks, i, c)
                        continue
                    nb = gpu.allocate()
                    copies.setdefault(b, []).append(nb)
                    gpu.free(b)
                    self._set_entry(blocks, i, nb)
                    b = nb
                if key is not None and gpu._hash[b] is None:
                    self._promote(blocks, i, b, key)
            elif w is not None and i >= w:
                old = blocks[i - w]  # the block that just left the window
                if ref[old] == 1:
                    blocks.append(old)
                else:
                    nb = gpu.allocate()
                    copies.setdefault(old, []).append(nb)
                    gpu.free(old)
                    blocks.append(nb)
                    self._set_entry(blocks, i, nb)
            else:
                c = gpu.peek(*key) if key is not None else None
                if c is not None:
                    gpu.incref(c)
                    blocks.append(c)
                else:
                    nb = gpu.allocate()
                    blocks.append(nb)
                    if key is not None:
                        h, toks, meta = key
                        gpu.register(nb, h, toks, (i + 1) * bs, meta)
        t.reserved = length
        return self._result(BlockMapping(copies))

    def _promote(self, blocks: List[int], i: int, b: int, key) -> None:
        """A just-filled private block: share an identical cached block, or cache this one."""
        gpu = self.gpu
        h, toks, meta = key
        c = gpu.peek(h, toks, meta)
        if c is not None and c != b:
            gpu.incref(c)
            gpu.free(b)
            self._set_entry(blocks, i, c)
        else:
            gpu.register(b, h, toks, (i + 1) * self.block_size, meta)

    # ---- fork and free -----------------------------------------------------------------------

    def fork(self, parent_seq, child_seq) -> None:
        """The child's table becomes a copy of the parent's. A parent without a table is an
        ``UnknownSequenceError`` (vLLM's KeyError); a child's old table is released first
        (strict mode refuses it)."""
        if parent_seq.seq_id == child_seq.seq_id:
            raise InvalidArgumentError(f"cannot fork sequence {parent_seq.seq_id} into itself")
        parent = self._tables.get(parent_seq.seq_id)
        if parent is None:
            raise UnknownSequenceError(f"unknown sequence id {parent_seq.seq_id}")
        self._check_strict_fresh(child_seq)
        old = self._tables.pop(child_seq.seq_id, None)
        if old is not None:  # the parent keeps its references: nothing shared is freed here
            self._release(old)
        child = parent.copy()
        pool = self._pools[child.device]
        for b in self._distinct(child.blocks):
            pool.incref(b)
        self._tables[child_seq.seq_id] = child

    def free(self, seq) -> None:
        t = self._tables.pop(seq.seq_id, None)
        if t is None:
            if self.strict:
                raise UnknownSequenceError(f"unknown sequence id {seq.seq_id}")
            return
        self._release(t)

    def _release(self, t: _Table) -> None:
        # The tail first: walking back from the last entry, every distinct block once (a window
        # table's last W entries are its W distinct blocks).
        w = self.block_sliding_window
        blocks = t.blocks if w is None else t.blocks[-w:]
        pool = self._pools[t.device]
        for b in reversed(blocks):
            pool.free(b)

    def reset(self) -> None:
        """Free every table, in the order the tables were created."""
        tables = list(self._tables.values())
        self._tables.clear()
        for t in tables:
            self._release(t)

    # ---- swapping ----------------------------------------------------------------------------

    def can_swap_out(self, seq_group) -> bool:
        unfinished = [s for s in seq_group.get_seqs() if not s.is_finished()]
        return self._distinct_blocks(unfinished) <= self.cpu.num_free

    def swap_out(self, seq_group) -> Dict[int, int]:
        """Move the RUNNING sequences' tables to the CPU; returns ``{gpu_block: cpu_block}``."""
        return self._swap(self._with_status(seq_group, "RUNNING"), "gpu", "cpu")

    def can_swap_in(self, seq_group, num_lookahead_slots: int = 0) -> AllocStatus:
        if num_lookahead_slots < 0:
            raise InvalidArgumentError("num_lookahead_slots must be non-negative")
        seqs = seq_group.get_seqs()
        blocks = self._distinct_blocks([s for s in seqs if not s.is_finished()])
        swapped = sum(1 for s in seqs if _status(s) == "SWAPPED")
        per_seq = max(1, _ceil_div(num_lookahead_slots, self.block_size))
        required = blocks + swapped * per_seq
        if self.num_total_gpu_blocks < required:
            return AllocStatus.NEVER
        if self.gpu.num_free - required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def swap_in(self, seq_group, num_lookahead_slots: int = 0) -> Dict[int, int]:
        """Move the SWAPPED sequences' tables to the GPU; returns ``{cpu_block: gpu_block}``.
        ``num_lookahead_slots`` is accepted for vLLM's signature; the next ``append_slots``
        reserves them."""
        if num_lookahead_slots < 0:
            raise InvalidArgumentError("num_lookahead_slots must be non-negative")
        return self._swap(self._with_status(seq_group, "SWAPPED"), "cpu", "gpu")

    def _swap(self, seqs: list, src_name: str, dst_name: str) -> Dict[int, int]:
        tables = [self._table_on(s, src_name) for s in seqs]
        src, dst = self._pools[src_name], self._pools[dst_name]
        need = self._distinct_blocks(seqs)
        if need > dst.num_free:
            raise OutOfBlocksError(f"out of {dst_name} blocks: {need} needed, {dst.num_free} free")
        mapping: Dict[int, int] = {}
        for t in tables:
            for i, b in enumerate(self._distinct(t.blocks)):
                d = mapping.get(b)
                if d is not None:
                    dst.incref(d)
                else:
                    entry = src.cache_entry(b)
                    if entry is not None:
                        h, toks, src_meta, num_hashed = entry
                        # on the destination the parent is where the previous block went
                        parent = mapping.get(t.blocks[i - 1]) if i else None
                        meta = self._meta(dst, parent, src_meta[2], src_meta[3])
                        d = dst.peek(h, toks, meta)
                        if d is not None:
                            dst.incref(d)
                        else:
                            d = dst.allocate()
                            dst.register(d, h, toks, num_hashed, meta)
                    else:
                        d = dst.allocate()
                    mapping[b] = d
                src.free(b)
            t.blocks = [mapping[b] for b in t.blocks]
            t.device = dst_name
        return self._result(BlockMapping(mapping))

    # ---- prefix-caching helpers --------------------------------------------------------------

    def access_all_blocks_in_seq(self, seq, access_time: float) -> None:
        if not self.enable_caching:
            return
        if not math.isfinite(access_time):
            raise InvalidArgumentError("access_time must be a finite number")
        t = self._table(seq)
        pool = self._pools[t.device]
        for b in self._distinct(t.blocks):
            pool.touch(b, access_time)

    def compute_full_blocks_in_seq(self, seq) -> None:
        """vLLM's rule: walking back from block ``len // bs - 2``, mark blocks computed until
        one already is (the last full block stays unmarked)."""
        t = self._tables.get(seq.seq_id)
        if t is None:
            return
        m = seq.get_len() // self.block_size - 1
        if m <= 0:
            return
        pool = self._pools[t.device]
        for i in reversed(range(min(m, len(t.blocks)))):
            b = t.blocks[i]
            if pool._computed[b]:
                break
            pool._computed[b] = True

    def get_all_computed_blocks(self, seq) -> List[int]:
        """The leading computed blocks of the table, its last entry excluded."""
        t = self._tables.get(seq.seq_id)
        if t is None:
            return []
        computed = self._pools[t.device]._computed
        out = []
        for b in t.blocks[:-1]:
            if not computed[b]:
                break
            out.append(b)
        return out

    def get_common_computed_block_ids(self, seqs) -> List[int]:
        if not self.enable_caching:
            return []
        common: Optional[List[int]] = None
        for seq in seqs:
            ids = self.get_all_computed_blocks(seq)
            if not ids:
                continue
            if common is None:
                common = ids
            else:
                n = 0
                for a, b in zip(common, ids):
                    if a != b:
                        break
                    n += 1
                del common[n:]
        return common or []

    def mark_blocks_as_computed(self, seq_group) -> None:
        if self.enable_caching:
            for seq in seq_group.get_seqs():
                self.compute_full_blocks_in_seq(seq)

    # ---- queries -----------------------------------------------------------------------------

    def get_block_table(self, seq) -> List[int]:
        return list(self._table(seq).blocks)

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu.num_free

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu.num_free

    # ---- introspection (differential tests) --------------------------------------------------

    def _pool(self, device: str) -> BlockPool:
        if device not in _DEVICES:
            raise InvalidArgumentError(f"device must be 'gpu' or 'cpu', got {device!r}")
        return self._pools[_DEVICES[device]]

    def has_table(self, seq) -> bool:
        return seq.seq_id in self._tables

    def table_device(self, seq) -> str:
        """``"gpu"`` or ``"cpu"``: where the sequence's table lives."""
        return self._table(seq).device

    def reserved_tokens(self, seq) -> int:
        return self._table(seq).reserved

    def ref_count(self, device: str, block: int) -> int:
        return self._pool(device).ref_count(block)

    def block_info(self, device: str, block: int) -> dict:
        """``{ref_count, block_hash, num_hashed_tokens, last_accessed, computed}``."""
        pool = self._pool(device)
        return {
            "ref_count": pool.ref_count(block),
            "block_hash": pool.block_hash(block),
            "num_hashed_tokens": pool.num_hashed_tokens(block),
            "last_accessed": pool.last_accessed(block),
            "computed": pool.is_computed(block),
        }

    def prefix_cache_stats(self) -> Tuple[int, int]:
        """``(lookups, hits)`` of full prompt blocks in ``allocate``."""
        return self.gpu.lookups, self.gpu.hits

    def num_cached_blocks(self, device: str = "gpu") -> int:
        return self._pool(device).num_cached

    def num_evictable_blocks(self, device: str = "gpu") -> int:
        return self._pool(device).num_evictable

    def eviction_order(self, device: str = "gpu") -> List[int]:
        return self._pool(device).eviction_order()

    def get_physical_blocks(self, seq) -> List[PhysicalTokenBlock]:
        """Snapshot views of the distinct physical blocks of ``seq``'s table."""
        t = self._table(seq)
        pool = self._pools[t.device]
        device = Device.GPU if t.device == "gpu" else Device.CPU
        out = []
        for b in self._distinct(t.blocks):
            view = PhysicalTokenBlock(
                device, b, self.block_size, pool.block_hash(b), pool.num_hashed_tokens(b)
            )
            view.ref_count = pool.ref_count(b)
            view.last_accessed = pool.last_accessed(b)
            view.computed = pool.is_computed(b)
            out.append(view)
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError if a pool invariant is broken or a ref count disagrees with the
        references the tables hold (O(blocks); for tests)."""
        w = self.block_sliding_window
        for name, pool in self._pools.items():
            pool.check_invariants()
            refs = [0] * pool.num_blocks
            for sid, t in self._tables.items():
                if t.device != name:
                    continue
                distinct = self._distinct(t.blocks)
                assert len(set(distinct)) == len(distinct), f"seq {sid}: a block appears twice"
                if w is not None:
                    assert all(b == t.blocks[i % w] for i, b in enumerate(t.blocks)), (
                        f"seq {sid}: window table is not periodic"
                    )
                for b in distinct:
                    refs[b] += 1
            for b, r in enumerate(refs):
                assert pool._ref[b] == r, (
                    f"{name} block {b}: ref count {pool._ref[b]} but tables hold {r}"
                )

    def __repr__(self) -> str:
        return (
            f"reference.BlockSpaceManager(block_size={self.block_size}, "
            f"gpu={self.gpu.num_free}/{self.num_total_gpu_blocks} free, "
            f"cpu={self.cpu.num_free}/{self.num_total_cpu_blocks} free, "
            f"tables={len(self._tables)})"
        )
