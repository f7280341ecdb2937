"""Type stubs for the private native module ``pagedkv._native`` (Rust, PyO3).

Import these names from :mod:`pagedkv`. ``tests/test_typing.py`` checks this file against the
compiled module with ``mypy.stubtest`` (names, signatures, defaults, properties) and type-checks
usage examples against it. Errors are the classes of :mod:`pagedkv.errors`.
"""

from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, disjoint_base

from pagedkv.vllm_042.block_manager import AllocStatus, BlockMapping
from pagedkv.vllm_042.protocols import SequenceGroupLike, SequenceLike

__all__ = [
    "__version__",
    "TokenSeq",
    "BlockHasher",
    "BlockPool",
    "BlockSpaceManager",
    "CompatEnumBase",
    "SchedulerCore",
    "BatchStep",
    "V1Manager",
    "V1Hybrid",
    "V1Loop",
    "VllmBlockHasher",
    "hash_blocks",
    "vllm_block_hash",
    "fill_plain_grammar_rows",
    "set_default_hasher",
    "get_default_hasher",
    "_set_weak_test_hasher",
]

__version__: str

# Token ids: a sequence of ints or a numpy integer array (no copy for int32/int64/uint32).
_TokenIds = Union[
    Sequence[int], npt.NDArray[np.int32], npt.NDArray[np.int64], npt.NDArray[np.uint32]
]
_Salt = Union[str, bytes, None]

def set_default_hasher(hash_algo: str = "xxh3", hash_seed: Optional[int] = None) -> None:
    """Hash function for new sequences and for managers built without ``hash_algo``.
    ``hash_algo``: ``"xxh3"`` (128-bit, keyed; a random per-process seed unless
    ``hash_seed`` is given) or ``"sha256"`` (stable across processes for a fixed seed)."""

def get_default_hasher() -> Tuple[str, int]:
    """``(hash_algo, hash_seed)`` of the process default."""

def _set_weak_test_hasher(hash_seed: Optional[int] = None) -> None:
    """Make the 3-bit test hash the process default (tests only: it makes hash collisions
    common, to show that the prefix cache never shares a block whose stored key differs)."""

def vllm_block_hash(
    name: str,
    parent: bytes,
    tokens: List[int],
    ahead: Optional[List[int]] = None,
    lora: Optional[Tuple[str, str]] = None,
) -> Optional[bytes]:
    """vLLM's ``hash_fn((parent, tuple(tokens), E))`` for hash function ``name``
    (``sha256``, ``sha256_cbor``, ``xxhash``, ``xxhash_cbor``), ``E`` being ``None`` or, with
    ``lora = (lora_name, lora_path)``, ``(("lora", lora_name, lora_path),)`` (the strings as
    distinct objects); with lookahead tokens ``ahead`` (vLLM 0.33; ``None`` or empty: none)
    the extra keys are ``(E, *ahead)``. ``None`` where the native encoding does not apply (a
    pickled token outside 32 bits, fewer than 4 tokens, a parent over 255 bytes, a LoRA
    string over 255 bytes or equal to ``"lora"``)."""

def fill_plain_grammar_rows(
    bitmask: Any,
    full_mask: Any,
    requests: Dict[str, Any],
    req_ids: List[str],
    drafts: Dict[str, List[int]],
    stride: Optional[int],
) -> int:
    """vLLM's serial structured-output bitmask fill for vLLM's own manager without a
    reasoning parser: each request's draft rows and bonus row written into ``bitmask`` with
    its grammar (``full_mask`` where it does not constrain), request ``k`` from row
    ``k * stride`` on (``None``: packed); the row after the last request's rows
    (``pagedkv.vllm_v1._grammar.fill_plain_bitmask``)."""

def hash_blocks(
    token_ids: _TokenIds,
    block_size: int,
    *,
    lora_id: int = 0,
    cache_salt: _Salt = None,
    hash_algo: Optional[str] = None,
    hash_seed: Optional[int] = None,
) -> List[int]:
    """Chained 128-bit hashes of every full block of ``token_ids``."""

class CompatEnumBase:
    """Native base of ``pagedkv.vllm_042._enum.CompatEnum``: C-level ``==``/``!=`` (identity
    within one enum; equal to a foreign enum member of the same class name and member name) and
    ``hash(self._name_)``. Holds no data."""

    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class TokenSeq:
    """Token ids of one sequence and the chained hashes of its full blocks (each full block is
    hashed exactly once, when its last token arrives)."""

    def __new__(
        cls,
        block_size: int,
        token_ids: _TokenIds,
        *,
        lora_id: int = 0,
        cache_salt: _Salt = None,
        hash_algo: Optional[str] = None,
        hash_seed: Optional[int] = None,
    ) -> Self: ...
    def __len__(self) -> int: ...
    @property
    def block_size(self) -> int:
        """Tokens per block."""
    @property
    def lora_id(self) -> int:
        """The LoRA id that enters every block hash (0: none)."""
    def append(self, token_id: int) -> None:
        """Append one token id; hashes the block it completes, if any. O(1) amortised."""
    def extend(self, token_ids: _TokenIds) -> None:
        """Append many token ids (list, tuple or int array)."""
    def tokens(self) -> List[int]:
        """All token ids as a new list (O(L))."""
    def token_slice(self, start: int, end: Optional[int] = None) -> List[int]:
        """Token ids in ``[start, end)`` (clamped like a slice with non-negative bounds)."""
    def last_token(self) -> int:
        """The last token id; ``InvalidArgumentError`` if the sequence is empty."""
    @property
    def num_blocks(self) -> int:
        """Blocks the tokens occupy (the last one may be partial)."""
    @property
    def num_full_blocks(self) -> int:
        """Full blocks (each hashed once, when it filled)."""
    def block_tokens(self, i: int) -> List[int]:
        """Token ids of logical block ``i`` (the last block may be partial)."""
    def hash_of_block(self, i: int) -> int:
        """Stored hash of full block ``i``; ``InvalidArgumentError`` (a ValueError) if block
        ``i`` is not full."""
    def block_hashes(self) -> List[int]:
        """Hashes of every full block."""
    @property
    def hash_calls(self) -> int:
        """Block hashes computed so far (a test hook for 'each block exactly once')."""
    @property
    def hasher(self) -> Tuple[str, int]:
        """``(hash_algo, hash_seed)`` this sequence hashes with."""
    def copy(self) -> TokenSeq:
        """An independent copy (appending to one leaves the other unchanged). O(L) memcpy."""
    def __copy__(self) -> TokenSeq: ...
    def __deepcopy__(self, memo: Any) -> TokenSeq: ...

@final
class BlockHasher:
    """Incremental chained hasher: ``feed`` returns the hashes of blocks that became full."""

    def __new__(
        cls,
        block_size: int,
        *,
        lora_id: int = 0,
        cache_salt: _Salt = None,
        hash_algo: Optional[str] = None,
        hash_seed: Optional[int] = None,
    ) -> Self: ...
    def feed(self, token_ids: _TokenIds) -> List[int]:
        """Feed token ids; returns the hashes of blocks completed by them (often empty)."""
    @property
    def num_blocks(self) -> int:
        """Full blocks hashed so far."""
    @property
    def num_pending_tokens(self) -> int:
        """Tokens of the unfinished block, waiting for it to fill."""

@final
class BlockPool:
    """One device's blocks: ref counts, a prefix cache confirmed by token ids, and LRU eviction
    of unreferenced cached blocks (least recently accessed first; ties: more hashed tokens
    first): O(1) when blocks are released in access order, O(log k) at worst (k evictable
    blocks). One call at a time: a concurrent call raises ``InUseError``. A GPU pool has at most
    2**31 slots."""

    def __new__(
        cls, num_blocks: int, block_size: int, *, enable_caching: bool = True, device: str = "gpu"
    ) -> Self: ...
    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
    @property
    def block_size(self) -> int:
        """Tokens per block."""
    @property
    def device(self) -> str:
        """``"gpu"`` or ``"cpu"``."""
    @property
    def num_free(self) -> int:
        """Uncached free plus evictable blocks."""
    @property
    def num_referenced(self) -> int:
        """Blocks with ref count > 0."""
    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (referenced or evictable)."""
    @property
    def num_evictable(self) -> int:
        """Cached blocks with ref count 0."""
    @property
    def lookups(self) -> int:
        """Prefix-cache lookups so far."""
    @property
    def hits(self) -> int:
        """Prefix-cache lookups that found a block."""
    @property
    def evictions(self) -> int:
        """Cached blocks evicted to make room so far."""
    def allocate(self) -> int:
        """A fresh block with ref count 1 (evicts the LRU cached block if nothing else is
        free)."""
    def allocate_many(self, n: int) -> List[int]:
        """``n`` fresh blocks in one call; all or nothing."""
    def incref(self, block: int, n: int = 1) -> None:
        """Add ``n`` references to a referenced or evictable (cached) block; revives an
        evictable one."""
    def free(self, block: int) -> None:
        """Drop one reference; at zero a cached block becomes evictable, an uncached one
        free."""
    def free_many(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each listed block; all or nothing (checked first)."""
    def lookup(
        self,
        block_hash: int,
        token_ids: _TokenIds,
        *,
        parent_block: Optional[int] = None,
        extra_key: Optional[int] = None,
    ) -> Optional[int]:
        """The cached block holding exactly ``token_ids`` under ``block_hash`` (registered with
        the same ``parent_block``, still holding the same data, and the same ``extra_key``), or
        None. Does not change ref counts (call ``incref`` to take it)."""
    def register(
        self,
        block: int,
        block_hash: int,
        token_ids: _TokenIds,
        num_hashed_tokens: Optional[int] = None,
        *,
        parent_block: Optional[int] = None,
        extra_key: Optional[int] = None,
    ) -> bool:
        """Register a referenced, full, uncached block under its hash. Returns False when
        another block already holds that hash (the block then stays uncached)."""
    def ref_count(self, block: int) -> int:
        """The ref count of ``block``."""
    def block_hash(self, block: int) -> Optional[int]:
        """The hash ``block`` is cached under, or None."""
    def is_evictable(self, block: int) -> bool:
        """Whether ``block`` is cached with ref count 0."""
    def touch(self, block: int, access_time: float) -> None:
        """Set a block's last access time (eviction takes the least recent first)."""
    def last_accessed(self, block: int) -> float:
        """The last access time set by ``touch`` (-1.0 if never touched)."""
    def eviction_order(self) -> List[int]:
        """Evictable blocks, next victim first (O(n), for introspection)."""
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any structural invariant is broken (O(n), for tests)."""

@disjoint_base
class BlockSpaceManager:
    """Native base of :class:`pagedkv.BlockSpaceManager` (see ``docs/block_manager.md``); use
    that class.

    Sequences and groups are anything shaped like
    :class:`pagedkv.vllm_042.protocols.SequenceLike` /
    :class:`~pagedkv.vllm_042.protocols.SequenceGroupLike` (pagedkv's own, or vLLM's). Buffers are
    numpy int32 arrays (real ``ndarray``s: C-contiguous, aligned, writable, no two overlapping)
    written in place (for a torch CPU tensor pass ``tensor.numpy()``, which shares its memory).
    One call at a time: a call made while another is in progress (another thread's, or a callback's)
    raises ``InUseError`` without waiting."""

    def __new__(
        cls,
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
    ) -> Self: ...
    @property
    def block_size(self) -> int:
        """Tokens per block."""
    @property
    def num_total_gpu_blocks(self) -> int:
        """Blocks in the GPU pool."""
    @property
    def num_total_cpu_blocks(self) -> int:
        """Blocks in the CPU (swap) pool."""
    @property
    def watermark(self) -> float:
        """Fraction of GPU blocks ``can_allocate`` keeps free."""
    @property
    def watermark_blocks(self) -> int:
        """``watermark * num_total_gpu_blocks``, in blocks."""
    @property
    def enable_caching(self) -> bool:
        """Whether full blocks are shared through the prefix cache."""
    @property
    def block_sliding_window(self) -> Optional[int]:
        """The sliding window in blocks (None without a window)."""
    @property
    def strict(self) -> bool:
        """Whether ``free`` of a sequence without a table raises ``UnknownSequenceError``."""
    @property
    def hasher(self) -> Tuple[str, int]:
        """``(hash_algo, hash_seed)`` of the block hash."""
    def can_allocate(self, seq_group: SequenceGroupLike) -> AllocStatus:
        """Whether the group's WAITING prompt fits: ``OK``, ``LATER`` or ``NEVER`` (the
        watermark counts)."""
    def allocate(self, seq_group: SequenceGroupLike) -> None:
        """Give the group's WAITING sequences one shared block table for the prompt
        (prefix-cache hits reused). ``OutOfBlocksError`` if it does not fit."""
    def can_append_slots(self, seq_group: SequenceGroupLike, num_lookahead_slots: int = 0) -> bool:
        """Whether every RUNNING sequence of the group can get its next slots (plus
        ``num_lookahead_slots``) now."""
    def append_slots(
        self, seq: SequenceLike, num_lookahead_slots: int = 0
    ) -> BlockMapping[List[int]]:
        """Reserve slots for the tokens appended since the last call; returns the copy-on-write
        pairs ``{src_block: [dst_block, ...]}`` (empty when nothing is copied)."""
    def append_slots_batch(
        self,
        seqs: Iterable[SequenceLike],
        block_tables: npt.NDArray[np.int32],
        context_lens: npt.NDArray[np.int32],
        slot_mapping: npt.NDArray[np.int32],
        *,
        pad_value: int = 0,
    ) -> BlockMapping[List[int]]:
        """One decode step for many sequences: reserve each one's newest slot and write row
        ``i`` of ``block_tables`` (``[rows >= n, cols]``, padded with ``pad_value``),
        ``context_lens[i]`` (sequence length) and ``slot_mapping[i]`` (slot of the newest token,
        ``block * block_size + offset``). All checked first: on error nothing changed."""
    def fill_block_tables(
        self,
        seqs: Iterable[SequenceLike],
        block_tables: npt.NDArray[np.int32],
        *,
        context_lens: Optional[npt.NDArray[np.int32]] = None,
        pad_value: int = 0,
    ) -> None:
        """Write the current block tables of ``seqs`` (rows padded with ``pad_value``) and, if
        given, their lengths into caller-owned int32 buffers, without changing anything."""
    def fork(self, parent_seq: SequenceLike, child_seq: SequenceLike) -> None:
        """Share every block of ``parent_seq``'s table with ``child_seq`` (ref counts +1)."""
    def free(self, seq: SequenceLike) -> None:
        """Release ``seq``'s table. Without a table: a no-op (vLLM), or
        ``UnknownSequenceError`` with ``strict=True``."""
    def reset(self) -> None:
        """Free every sequence's table, as ``free`` on each (cached blocks stay cached,
        evictable)."""
    def can_swap_in(
        self, seq_group: SequenceGroupLike, num_lookahead_slots: int = 0
    ) -> AllocStatus:
        """Whether the group's SWAPPED sequences fit on the GPU."""
    def swap_in(
        self, seq_group: SequenceGroupLike, num_lookahead_slots: int = 0
    ) -> BlockMapping[int]:
        """Move the group's SWAPPED sequences to the GPU; returns ``{cpu_block: gpu_block}``.
        ``num_lookahead_slots`` is accepted for vLLM's signature; slots are reserved by the
        next ``append_slots``, as in vLLM."""
    def can_swap_out(self, seq_group: SequenceGroupLike) -> bool:
        """Whether the distinct blocks of the group's unfinished sequences fit in the free CPU
        blocks."""
    def swap_out(self, seq_group: SequenceGroupLike) -> BlockMapping[int]:
        """Move the group's RUNNING sequences to the CPU; returns ``{gpu_block: cpu_block}``."""
    def get_block_table(self, seq: SequenceLike) -> List[int]:
        """The physical block ids of ``seq``'s table, in logical order (a new list)."""
    def native_bytes(self) -> Tuple[int, int, int]:
        """Native heap bytes ``(pools, tables, block_ints)``: the pools' per-block state,
        the sequences' block tables, this binding's references to its per-block ints."""
    def get_num_free_gpu_blocks(self) -> int:
        """Free GPU blocks (evictable cached blocks count as free)."""
    def get_num_free_cpu_blocks(self) -> int:
        """Free CPU blocks (evictable cached blocks count as free)."""
    def access_all_blocks_in_seq(self, seq: SequenceLike, access_time: float) -> None:
        """Record ``access_time`` as the last access of every block of ``seq`` (LRU eviction
        order)."""
    def compute_full_blocks_in_seq(self, seq: SequenceLike) -> None:
        """Mark every full block of ``seq`` as computed (prefix caching)."""
    def get_all_computed_blocks(self, seq: SequenceLike) -> List[int]:
        """The computed blocks of ``seq``'s table, except its last block (as vLLM)."""
    def get_common_computed_block_ids(self, seqs: Iterable[SequenceLike]) -> List[int]:
        """Longest common prefix of the computed blocks of ``seqs`` (those with none are
        skipped; empty without caching)."""
    def mark_blocks_as_computed(self, seq_group: SequenceGroupLike) -> None:
        """Mark the full blocks of every sequence of the group as computed (no-op without
        caching)."""
    def access_all_blocks_in_seqs(self, seqs: Iterable[SequenceLike], access_time: float) -> None:
        """Batch form of ``access_all_blocks_in_seq`` (all checked before any change)."""
    def compute_full_blocks_in_seqs(self, seqs: Iterable[SequenceLike]) -> None:
        """Batch form of ``compute_full_blocks_in_seq``."""
    def has_table(self, seq: SequenceLike) -> bool:
        """Whether ``seq`` holds a block table in this manager."""
    def table_device(self, seq: SequenceLike) -> str:
        """Device (``"gpu"``/``"cpu"``) the sequence's table lives on."""
    def ref_count(self, device: str, block: int) -> int:
        """The ref count of ``block`` on ``device`` (``"gpu"`` or ``"cpu"``)."""
    def block_info(self, device: str, block: int) -> Dict[str, Any]:
        """``{ref_count, block_hash, num_hashed_tokens, last_accessed, computed}`` of one
        block."""
    def prefix_cache_stats(self) -> Tuple[int, int]:
        """``(lookups, hits)`` of full prompt blocks in ``allocate``."""
    def num_cached_blocks(self, device: str = "gpu") -> int:
        """Blocks of ``device`` registered in the prefix cache (referenced or evictable)."""
    def num_evictable_blocks(self, device: str = "gpu") -> int:
        """Cached blocks of ``device`` with ref count 0 (reusable after eviction)."""
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if a pool invariant is broken or a ref count disagrees
        with the tables (O(blocks); for tests)."""

@final
class SchedulerCore:
    """Native half of :class:`pagedkv.Scheduler` (see ``docs/scheduler.md``): vLLM 0.4.2's
    scheduling policy over the core of ``manager`` (a ``BlockSpaceManager``)."""

    def __new__(
        cls,
        manager: BlockSpaceManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        *,
        num_lookahead_slots: int = 0,
        delay_factor: float = 0.0,
        chunked_prefill: bool = False,
        max_loras: Optional[int] = None,
        preemption_mode: Optional[str] = None,
    ) -> SchedulerCore:
        """See :class:`pagedkv.Scheduler` for the arguments."""
    @property
    def manager(self) -> BlockSpaceManager:
        """The block manager the scheduler drives."""
    def add_seq_group(self, group: Any) -> None:
        """Queue a new ``SequenceGroup`` (its sequences WAITING) at the end of waiting."""
    def abort(self, request_ids: List[str]) -> None:
        """Finish (FINISHED_ABORTED) and free every group whose request id is listed."""
    def num_unfinished(self) -> int:
        """Groups in waiting, running and swapped together."""
    def queue(self, which: str) -> List[Any]:
        """The groups of ``"waiting"``, ``"running"`` or ``"swapped"``, in order."""
    def schedule(self, now: float) -> Tuple[Any, ...]:
        """``(scheduled, metadata, num_prefill_groups, num_batched_tokens, swap_in,
        swap_out, copies, ignored, num_lookahead_slots, running_queue_size, num_loras)``: the
        ``ScheduledSequenceGroup`` and ``SequenceGroupMetadata`` lists in vLLM's order (a group's
        objects are last step's while nothing they hold changed)."""
    def fork(self, parent: Any, child: Any) -> None:
        """Register ``child`` in ``parent``'s group and share its blocks (copy-on-write)."""
    def free_finished(self) -> None:
        """Drop running groups whose sequences have all finished."""
    def state_bytes(self) -> int:
        """Bytes of native scheduler state (queues, groups, sequences, references)."""

@final
class BatchStep:
    """Native half of :class:`pagedkv.vllm_042.engine_step.BatchEngine`: issue 10's one-call engine
    step over a ``SchedulerCore`` (see ``docs/scheduler.md``)."""

    def __new__(cls, core: SchedulerCore, new_seq_id: Any, stable_rows: bool = False) -> BatchStep:
        """``new_seq_id``: a callable returning a fresh sequence id per call (forks);
        ``stable_rows``: a running sequence keeps its row (``docs/scheduler.md``)."""
    @property
    def stable_rows(self) -> bool:
        """Whether rows are stable rather than in schedule order."""
    @property
    def num_expected_samples(self) -> int:
        """Tokens the next ``step`` takes (the previous batch's samples)."""
    def step(self, sampled: npt.NDArray[np.int32], now: float, buffers: Any) -> Tuple[Any, ...]:
        """``(counts, num_prefill_groups, scheduled, finished, ignored, needed_cols)``; see
        :meth:`pagedkv.vllm_042.engine_step.BatchEngine.step`."""
    def rewrite(self, buffers: Any) -> Optional[Tuple[int, int, int, int, int, int]]:
        """Write the last step's inputs again (into wider buffers): ``(rows, tokens, copies,
        swap_in, swap_out, new_blocks)``, or ``None`` if a block-table row is still too narrow."""
    def sync_views(self) -> None:
        """Write native tokens and progress back to every scheduled ``Sequence``."""
    def abort(self, request_ids: List[str]) -> None:
        """vLLM's ``abort_seq_group``, keeping the previous batch consistent."""

@final
class V1Manager:
    """vLLM v1's KV cache manager for one full-attention group (``pagedkv.vllm_v1`` wraps it):
    a pool with vLLM's free-block order, ref counts, a prefix-cache map keyed by vLLM's own
    block hashes, per-request block tables and a KV-event log. Block 0 is the null block. A
    failed call changes nothing; one call at a time (``InUseError``)."""

    def __new__(
        cls,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool,
        enable_events: bool,
        watermark_blocks: int,
        use_eagle: bool = False,
        eagle_group: bool = False,
        release: str = "0.33",
        prefill_lookahead: Optional[int] = None,
    ) -> Self:
        """``use_eagle``: the manager's (EAGLE/MTP); ``eagle_group``: the group's
        ``is_eagle_group``; with ``release`` (``"0.32"`` or ``"0.33"``) they decide whether a
        prefix-cache hit drops its last block (``drops_eagle_block``); ``prefill_lookahead``:
        vLLM's ``num_prefill_lookahead`` (``None``: 0; multi-module MTP: the last ``n - 1``
        computed tokens are not cached; with caching and EAGLE, above ``block_size`` it is
        ``InvalidArgumentError`` as vLLM's ``ValueError``)."""
    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block included."""
    @property
    def block_size(self) -> int:
        """Tokens per block."""
    @property
    def num_requests(self) -> int:
        """Requests holding a block table."""
    @property
    def num_tracked_requests(self) -> int:
        """Requests whose cached blocks are tracked (vLLM's ``len(num_cached_block)``)."""
    @property
    def drops_eagle_block(self) -> bool:
        """Whether a prefix-cache hit drops its last block (EAGLE/MTP, per the release's
        rule)."""
    def bind_vllm(
        self,
        empty: Any,
        blocks_cls: Any,
        waiting: Any,
        preempted: Any,
        request_cls: Any = None,
    ) -> None:
        """Give ``vllm_allocate_slots`` its Python objects (once)."""
    def bind_removed_events(self, cls: Any, medium: Any, int_hashes: bool) -> None:
        """Have ``take_events`` build vLLM's ``BlockRemoved`` itself."""
    def bind_event_sink(self, events: List[Any], build: Any) -> None:
        """Have calls that log KV events append vLLM's event objects to ``events`` (``build``
        builds the kinds not built natively)."""
    def bind_stored_events(
        self,
        cls: Any,
        medium: Any,
        int_hashes: bool,
        groups: List[Tuple[Any, Any, int]],
        hash_block_size: int,
        request_cls: Any,
        lookahead: int = 0,
    ) -> None:
        """Have ``take_events(request)`` build vLLM's ``BlockStored`` itself for a request
        without extra hash keys; ``groups``: ``[(spec_kind, sliding_window, block_size)]``;
        ``lookahead``: vLLM 0.33's ``num_hash_lookahead_tokens`` (``lookahead_token_ids``)."""
    def vllm_allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: Any = None,
    ) -> Any:
        """vLLM's ``KVCacheManager.allocate_slots``, signature and result included."""
    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_tokens: int,
        waiting_or_preempted: bool,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed: Optional[List[int]],
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
        full_sequence_must_fit: bool,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
        block_hashes: Sequence[bytes],
        num_external_computed_tokens: int = 0,
    ) -> Optional[List[int]]:
        """``allocate_slots`` with the request's fields spelled out: the new block ids, or
        ``None`` when they do not fit. A KV connector's external tokens get blocks of their
        own on a first allocation, not among those returned."""
    def longest_cache_hit(self, block_hashes: Sequence[bytes], max_blocks: int) -> List[int]:
        """The longest cached prefix of ``block_hashes``, at most ``max_blocks`` blocks."""
    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed: List[int]
    ) -> int:
        """vLLM's ``get_num_blocks_to_allocate`` for the request."""
    def cache_blocks(self, request_id: str, num_tokens: int, block_hashes: Sequence[bytes]) -> None:
        """Cache the request's blocks that are full within ``num_tokens`` and that it holds
        (vLLM slices its blocks the same way); with KV events on, a ``num_tokens`` that fills
        blocks past the request's last is ``InvalidArgumentError`` (vLLM: ``IndexError``)."""
    def free(self, request_id: str) -> None:
        """The request's blocks go back, tail first."""
    def pop_blocks_for_free(self, request_id: str) -> List[int]:
        """Forget the request; its block ids (allocation order), still referenced."""
    def free_blocks(self, block_ids: List[int]) -> None:
        """Drop one reference per block, in eviction-priority order (all or nothing)."""
    def evict_blocks(self, block_ids: List[int]) -> None:
        """Drop the cached hash of each listed block."""
    def block_ids(self, request_id: str) -> List[int]:
        """The request's block table (empty for an unknown request)."""
    def num_cached_blocks(self, request_id: str) -> Optional[int]:
        """Leading blocks of the request that are cached (``None``: not tracked)."""
    def cap_max_model_len(self, cap: int) -> None:
        """Lower ``max_model_len`` to ``cap`` before any request is held."""
    def reset_prefix_cache(self) -> bool:
        """Only when every block but the null block is free."""
    def num_free_blocks(self) -> int:
        """Free blocks (evictable cached ones included)."""
    def usage(self) -> float:
        """The used share of the blocks other than the null block."""
    def ref_cnt(self, block_id: int) -> int:
        """The block's reference count."""
    def block_hash(self, block_id: int) -> Optional[bytes]:
        """The hash the block is cached under (``None`` when it is not cached)."""
    def hashed_tokens(self, block_id: int) -> Optional[int]:
        """Tokens the block's hash covers; ``None`` if uncached."""
    def estimate_cached_tokens(self, request_id: str) -> int:
        """The most tokens a hash of the request's blocks covers."""
    def is_free(self, block_id: int) -> bool:
        """Whether the block is in the free-block queue."""
    def free_queue(self) -> List[int]:
        """The free-block queue, head (handed out next) first."""
    def num_cached_hashes(self) -> int:
        """Hashes in the prefix-cache map."""
    def take_events(self, request: Any = None) -> List[Tuple[str, Any, int]]:
        """Events since the last call, oldest first (``request``: the one the last call
        concerned, for building ``BlockStored`` natively)."""
    def heap_bytes(self) -> int:
        """Heap bytes the manager holds."""
    def check(self, extra_refs: Optional[Dict[int, int]] = None) -> None:
        """Check every invariant (``InvalidArgumentError`` naming the first broken one)."""

@final
class V1Hybrid:
    """vLLM v1's KV cache manager for several KV cache groups (full, sliding-window, chunked
    local attention, Mamba in ``mamba_cache_mode`` "none" or "align") over one pool
    (``pagedkv.vllm_v1._hybrid`` wraps it). Block ids come per group, in vLLM's group order;
    block 0 is the null block. A failed call changes nothing; one call at a time
    (``InUseError``)."""

    def __new__(
        cls,
        num_blocks: int,
        groups: Sequence[Tuple[str, int, int, int]],
        hash_block_size: int,
        scheduler_block_size: int,
        max_model_len: int,
        max_in_flight_tokens: int,
        enable_caching: bool,
        enable_events: bool,
        watermark_blocks: int,
        release: str,
        prefix_cache_retention_interval: Optional[int] = None,
        use_eagle: bool = False,
        eagle_groups: Optional[Sequence[bool]] = None,
        zero_new_blocks: bool = False,
        checkpoint_alignments: Optional[Sequence[int]] = None,
        hash_lookahead_tokens: Optional[int] = None,
        prefill_lookahead: Optional[int] = None,
        extra_retained_tokens: Optional[Sequence[int]] = None,
    ) -> V1Hybrid:
        """``groups``: ``(kind, block_size, size, layout)`` per group, kind ``"full"``,
        ``"sliding_window"`` (``size``: the window), ``"chunked_local"`` (the chunk),
        ``"mamba"`` (mode "none", prefix caching off; ``size``: its ``num_speculative_blocks``)
        or ``"mamba_align"`` (mode "align", prefix caching on, its block the hash block;
        likewise); ``release``: ``"0.32"`` or ``"0.33"``;
        ``prefix_cache_retention_interval``: vLLM's (``None`` dense, ``0`` replay boundaries and
        junctions only, a positive multiple of ``scheduler_block_size`` those and one tail per
        interval; ``InvalidArgumentError`` as vLLM's ``ValueError`` otherwise); ``use_eagle``:
        the manager's (EAGLE/MTP), ``eagle_groups``: each group's ``is_eagle_group`` (``None``:
        none flagged; else one per group); ``zero_new_blocks``: vLLM's
        ``needs_kv_cache_zeroing`` (the attention groups record their new blocks,
        :meth:`take_new_block_ids`); ``checkpoint_alignments``: per group, a Mamba align
        spec's ``prefill_checkpoint_alignment`` when it has prefill checkpoint blocks, else 0
        (``None``: all 0); ``hash_lookahead_tokens``: vLLM 0.33's ``num_hash_lookahead_tokens``
        (align mode's checkpoint positions read it; ``None``: 0); ``prefill_lookahead``: vLLM's
        ``num_prefill_lookahead`` (multi-module MTP, as ``V1Manager``'s);
        ``extra_retained_tokens``: per group, a sliding-window spec's ``extra_retained_tokens``
        (held below the window, never attended; 0 for every other kind; ``None``: all 0)."""
    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> Tuple[List[List[int]], int, int]:
        """The hit's blocks per group, its tokens, and the ``shared_prefix_boundary``
        (``get_computed_blocks``': the longest single-group hit when longer, else 0)."""
    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_tokens: int,
        num_in_flight_tokens: int,
        waiting_or_preempted: bool,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed: Optional[Sequence[Sequence[int]]],
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
        full_sequence_must_fit: bool,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
        block_hashes: Sequence[bytes],
        num_prompt_tokens: int = 0,
        shared_prefix_boundary: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> Optional[List[List[int]]]:
        """vLLM's ``allocate_slots``: the new block ids per group, ``None`` when they do not fit
        (``num_prompt_tokens`` and ``shared_prefix_boundary``: the request's, for sparse
        retention; a KV connector's external tokens get blocks of their own, not returned)."""
    def num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed: Optional[Sequence[Sequence[int]]],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
        num_tokens_main_model: Optional[int] = None,
        prefill_end: int = 0,
    ) -> int:
        """vLLM's ``get_num_blocks_to_allocate``, summed over groups (a Mamba align group's
        count reads ``num_tokens_main_model``, default ``num_tokens``, and ``prefill_end``, may
        be negative, is ``num_blocks + 1`` to defer a hit on a state cached this step, and
        records the chunk's checkpoint unless ``apply_admission_cap``)."""
    def new_step_starts(self) -> None:
        """vLLM's: Mamba align groups forget the states they cached during the last step."""
    def remove_skipped_blocks(self, request_id: str, processed: int) -> None:
        """Blocks that left a window or chunk become the null block (freed)."""
    def cache_blocks(
        self,
        request_id: str,
        num_tokens: int,
        block_hashes: Sequence[bytes],
        num_prompt_tokens: int = 0,
        shared_prefix_boundary: int = 0,
    ) -> None:
        """vLLM's ``cache_blocks`` in every group (the request's prompt length and junction,
        for sparse retention)."""
    def free(self, request_id: str) -> None:
        """The request's blocks go back, group by group, each table tail first."""
    def pop_blocks_for_free(self, request_id: str) -> List[int]:
        """Forget the request; its block ids, still referenced."""
    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block, in eviction-priority order (all or nothing)."""
    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop the cached hash of each listed block (all ids checked first)."""
    def estimate_cached_tokens(self, request_id: str) -> int:
        """vLLM's ``estimate_cached_tokens``: per group the most tokens a hash of the
        request's blocks covers, the least over groups (0 for an unknown request)."""
    def take_new_block_ids(self) -> List[int]:
        """vLLM's ``take_new_block_ids``: the attention groups' blocks handed out since the
        last call, group by group, for the worker to zero (empty unless ``zero_new_blocks``)."""
    def block_ids(self, request_id: str) -> List[List[int]]:
        """The request's table in every group."""
    def cap_max_model_len(self, cap: int, in_flight: int) -> None:
        """Lower ``max_model_len`` to ``cap`` and ``max_in_flight_tokens`` to
        ``in_flight`` before any request is held."""
    def reset_prefix_cache(self) -> bool:
        """Only when every block but the null block is free."""
    def num_free_blocks(self) -> int:
        """Free blocks (evictable cached ones included), the null block excluded."""
    def usage(self) -> float:
        """The used share of the blocks other than the null block."""
    def ref_cnt(self, block_id: int) -> int:
        """The block's reference count."""
    def block_hash(self, block_id: int) -> Optional[Tuple[bytes, int]]:
        """The hash and group the block is cached under (``None``: not cached)."""
    def hashed_tokens(self, block_id: int) -> Optional[int]:
        """Tokens the block's hash covers (``None``: not cached)."""
    def cached_block(self, block_hash: bytes, group: int) -> Optional[int]:
        """The first block cached under the hash for the group, or ``None``."""
    def is_free(self, block_id: int) -> bool:
        """Whether the block is in the free-block queue."""
    def free_queue(self) -> List[int]:
        """The free-block queue, head (handed out next) first."""
    def take_events(self, request: Any = None) -> List[Tuple[Any, ...]]:
        """``("stored", group, first, end, cached_positions)``, ``("removed", hash, group)``,
        ``("cleared", 0, 0)``, oldest first; one built natively (after the ``bind_*_events``
        calls; a ``BlockStored`` needs ``request``) as ``("event", object, 0)``."""
    def drain_events(self, request: Any = None) -> None:
        """The logged events as vLLM's objects appended to the bound sink's list (built
        natively where bound, else by the sink's builder)."""
    def bind_removed_events(self, cls: Any, medium: Any, int_hashes: bool) -> None:
        """Have events build vLLM's ``BlockRemoved`` natively."""
    def bind_stored_events(
        self,
        cls: Any,
        medium: Any,
        int_hashes: bool,
        groups: List[Tuple[Any, Any, int]],
        hash_block_size: int,
        request_cls: Any,
        lookahead: int = 0,
    ) -> None:
        """Have events build vLLM's ``BlockStored`` natively for a request without extra hash
        keys; ``groups``: ``(spec_kind, sliding_window, block_size)`` per group; ``lookahead``:
        vLLM 0.33's ``num_hash_lookahead_tokens`` (``lookahead_token_ids``)."""
    def bind_event_sink(self, events: List[Any], build: Any) -> None:
        """Have ``drain_events`` append vLLM's event objects to ``events`` (``build`` builds
        the ones not built natively)."""
    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block included."""
    @property
    def num_groups(self) -> int:
        """KV cache groups."""
    @property
    def eagle_groups(self) -> List[bool]:
        """Per group, its ``use_eagle``: it drops EAGLE/MTP's block (every member of an
        attention group holding a dropping group)."""
    def heap_bytes(self) -> int:
        """Heap bytes the manager holds."""
    def check(self) -> None:
        """Check every invariant (``InvalidArgumentError`` naming the first broken one)."""

@final
class V1Loop:
    """vLLM v1's ``Scheduler.schedule()`` / ``update_from_output()`` for the in-scope path,
    walking a vLLM scheduler's own queues and requests (``pagedkv.vllm_v1._native_loop`` builds
    and drives it), over the native manager of one KV cache group or of several (hybrid).
    ``config`` holds the release switches and vLLM's objects the walk compares against or
    builds with. A call while another runs raises ``InUseError``."""

    def __new__(cls, manager: Union[V1Manager, V1Hybrid], config: Dict[str, Any]) -> V1Loop: ...
    def schedule(
        self, sched: Any, throttle_prefills: bool = False
    ) -> Tuple[
        List[Any],
        Tuple[Any, ...],
        Dict[str, int],
        int,
        Optional[Tuple[bool, bool]],
        Dict[str, List[int]],
        bool,
        Dict[str, List[int]],
        Optional[Dict[str, Any]],
    ]:
        """``(new_reqs_data, cached, num_scheduled_tokens, total, structured,
        scheduled_spec_decode_tokens, skip_drafts, scheduled_encoder_inputs,
        encoder_input_updates)``; ``cached`` is ``(req_ids, resumed_req_ids, all_token_ids,
        new_block_ids, num_computed_tokens, num_output_tokens)``; ``structured`` is
        ``(has_structured_output_requests, pending_structured_output_tokens)`` or ``None``
        (both false); ``encoder_input_updates`` is ``None`` without a multimodal row. The
        request updates of ``_update_after_schedule`` are applied."""
    def update(
        self,
        sched: Any,
        scheduler_output: Any,
        model_runner_output: Any,
        failed: Optional[Set[str]] = None,
    ) -> Tuple[List[Tuple[int, List[Any]]], Any]:
        """``([(client_index, [EngineCoreOutput, ...]), ...], spec_decoding_stats)`` in
        vLLM's order (``spec_decoding_stats``: ``None`` without drafts or stats); ``failed``:
        the requests whose KV load failed this step (their rows take nothing)."""
    def update_draft_token_ids(self, sched: Any, req_ids: Any, draft_token_ids: Any) -> None:
        """vLLM's ``Scheduler.update_draft_token_ids`` over the scheduler's own requests."""
    def refuses_prompt(self, num_prompt: int, max_model_len: int, sampled_per_step: int) -> bool:
        """A prompt of ``num_prompt`` tokens plus the ``sampled_per_step`` tokens a step
        samples (0 for a pooling model) passes the length cap (``min(max_model_len, cache
        tokens)``): it can never be prefilled and sampled, ``add_request`` refuses it."""
    def length_cap(self, max_model_len: int) -> int:
        """``min(max_model_len, cache tokens)``: the scheduler's ``max_model_len`` with this
        loop (vLLM's own loop then applies it too)."""

@final
class VllmBlockHasher:
    """vLLM's request block hasher (``get_request_block_hasher``'s closure ``original``) for
    hash function ``name`` at ``block_size`` with ``lookahead`` tokens past each block (vLLM
    0.33's ``num_hash_lookahead_tokens``; ``None``: 0), natively: ``hasher(request)``
    returns the hashes of the blocks filled (and followed by their lookahead tokens) since
    the last call, byte for byte vLLM's; what it does not encode (the first block, a token
    outside the encoding) it hands to ``original``."""

    def __new__(
        cls, name: str, block_size: int, original: Any, lookahead: Optional[int] = None
    ) -> VllmBlockHasher: ...
    def __call__(self, request: Any) -> List[bytes]: ...
    @property
    def name(self) -> str:
        """vLLM's name of the hash function (``prefix_caching_hash_algo``)."""
    @property
    def block_size(self) -> int:
        """The hash block size (tokens per hashed block)."""
    @property
    def lookahead(self) -> int:
        """Tokens past each block its hash covers (0: none)."""
    @property
    def original(self) -> Any:
        """The hasher this one stands in for (vLLM's closure)."""
