"""``HybridKVCacheManager``: vLLM v1's ``KVCacheManager`` for hybrid models (several KV cache
groups, each full attention, sliding window, chunked local attention or Mamba in
``mamba_cache_mode`` "none" or "align"), or for one group of those kinds other than full
attention, on pagedkv's native coordinator (``_native.V1Hybrid``, the core's
``coordinator::Hybrid``).

:class:`pagedkv.vllm_v1.KVCacheManager` returns one when the configuration has two or more
groups in scope, or one such group (:func:`pagedkv.vllm_v1._scope.needs_group_managers`).
What the scheduler, connectors and tests read back behaves as vLLM's ``KVCacheManager`` over
its ``HybridKVCacheCoordinator`` (``UnitaryKVCacheCoordinator`` for one group;
``KVCacheCoordinatorNoPrefixCache`` with caching off): ``KVCacheBlocks`` of one list per
group (skipped positions as the null block), the same block ids in the same order, KV events
with their ``group_idx`` (a ``BlockStored`` lists the hashes of the blocks really cached: null
and unreachable ones skipped), prefix-cache stats. Sliding windows cache what the config's
``prefix_cache_retention_interval`` keeps (dense ``None``; ``0``, vLLM's engine default: the
tails at the request's replay boundary and shared-prefix junction; positive: those and one per
interval), reading ``request.num_prompt_tokens`` and ``request.shared_prefix_boundary`` at
each caching call. A Mamba "align" group (prefix caching on) counts, allocates and caches its
per-step state blocks as vLLM's ``MambaManager`` does, and
:meth:`HybridKVCacheManager.new_step_starts` clears the states it cached this step. With Mamba
layers the attention groups' new blocks are recorded for zeroing and drained by
:meth:`HybridKVCacheManager.take_new_block_ids` into
the step's ``new_block_ids_to_zero``, as vLLM's managers do.

Invariants: each method crosses into Rust once (plus one call to drain events when events
are on); a call that raises has changed nothing (the core plans, then applies). Costs: the
core's, plus one id list per group handed back; block views are made only when ``blocks`` is
read or ``pop_blocks_for_free`` returns them, never kept.
pagedkv's native loop runs over it through ``_native`` (``rust/py/src/vllm_v1/loop_kv.rs``: its
``allocate_slots`` and ``cache_blocks`` in Rust, its ``_drain_events`` and ``_computed_ids``
called back), vLLM's own loop through these methods.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from pagedkv.errors import InvalidArgumentError

from . import _blocks, _events
from ._blocks import BlockView, RequestBlocksView
from ._manager import PrefixCacheStatsMixin, hash_lookahead_tokens


class HybridBlockView(BlockView):
    """A block of the native hybrid pool, read live, as vLLM's ``KVCacheBlock`` shows it: a
    :class:`~pagedkv.vllm_v1._blocks.BlockView` whose hash carries its own group."""

    __slots__ = ()

    @property
    def block_hash(self) -> Optional[bytes]:
        """vLLM's ``BlockHashWithGroupId``: the hash and its group (4 bytes, big endian)."""
        cached = self._native.block_hash(self.block_id)
        if cached is None:
            return None
        h, group = cached
        return h + group.to_bytes(4, "big")


def checkpoint_alignments(kv_cache_config: Any) -> List[int]:
    """Each group's prefill checkpoint alignment as the native manager takes it: a Mamba
    spec's ``prefill_checkpoint_alignment`` when it has prefill checkpoint blocks, else 0 (no
    checkpoint: vLLM's ``has_prefill_checkpoint_blocks`` false or the alignment ``None``)."""
    out = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        blocks = getattr(spec, "num_prefill_checkpoint_blocks", 0)
        alignment = getattr(spec, "prefill_checkpoint_alignment", None)
        out.append(int(alignment) if blocks > 0 and alignment else 0)
    return out


def extra_retained_tokens(kv_cache_config: Any) -> List[int]:
    """Each group's ``extra_retained_tokens`` as the native manager takes it: a
    sliding-window spec's (vLLM tags every window with ``num_prefill_lookahead_tokens - 1``
    under multi-module MTP), 0 for every other kind."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return [
        int(getattr(g.kv_cache_spec, "extra_retained_tokens", 0))
        if isinstance(g.kv_cache_spec, SlidingWindowSpec)
        else 0
        for g in kv_cache_config.kv_cache_groups
    ]


def group_kinds(kv_cache_config: Any) -> List[Tuple[str, int, int, int]]:
    """The native description of each group: ``(kind, block_size, size, layout)``, ``size``
    the window, the chunk or a Mamba group's ``num_speculative_blocks``; ``layout`` numbers
    the distinct specs, so groups share a lookup exactly when vLLM's specs are equal (as
    vLLM's coordinator compares them)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    distinct: List[Any] = []
    out = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if spec not in distinct:
            distinct.append(spec)
        layout = distinct.index(spec)
        if isinstance(spec, SlidingWindowSpec):
            out.append(("sliding_window", spec.block_size, spec.sliding_window, layout))
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            out.append(("chunked_local", spec.block_size, spec.attention_chunk_size, layout))
        elif isinstance(spec, MambaSpec):
            kind = "mamba_align" if spec.mamba_cache_mode == "align" else "mamba"
            out.append((kind, spec.block_size, spec.num_speculative_blocks, layout))
        else:
            out.append(("full", spec.block_size, 0, layout))
    return out


class _GroupView:
    """One single-type manager as vLLM's engine inspects it (block size, spec, group id), and
    as vLLM's own tests read it (``req_to_blocks``, ``_null_block``)."""

    def __init__(self, manager: HybridKVCacheManager, spec: Any, group_id: int) -> None:
        self.kv_cache_spec = spec
        self.block_size = spec.block_size
        self.kv_cache_group_id = group_id
        self.enable_caching = manager.enable_caching
        self.block_pool = manager.block_pool
        self._null_block = manager.block_pool.null_block
        native = manager._native
        self.req_to_blocks = RequestBlocksView(
            native.block_ids,
            group_id,
            lambda block_id: HybridBlockView(native, block_id),
            self._null_block,
        )


def _eagle_flag(group: Any) -> bool:
    """The group's ``is_eagle_group`` (draft-model layers: EAGLE's drop applies to it)."""
    return bool(getattr(group, "is_eagle_group", False))


class _BlockList:
    """``block_pool.blocks``: every block of the pool as a live view, made when indexed."""

    def __init__(self, native: Any) -> None:
        self._native = native

    def __len__(self) -> int:
        return self._native.num_blocks

    def __getitem__(self, block_id: int) -> HybridBlockView:
        if not 0 <= block_id < self._native.num_blocks:
            raise IndexError(f"block {block_id} of {self._native.num_blocks}")
        return HybridBlockView(self._native, block_id)


class _PoolView:
    """What vLLM's scheduler reaches through ``kv_cache_manager.block_pool``."""

    def __init__(self, manager: HybridKVCacheManager) -> None:
        self._manager = manager
        self._native = manager._native
        self.num_gpu_blocks = self._native.num_blocks
        self.enable_caching = manager.enable_caching
        self.hash_block_size = manager.hash_block_size
        self.num_hash_lookahead_tokens = manager.num_hash_lookahead_tokens
        self.null_block = HybridBlockView(self._native, 0)
        self.blocks = _BlockList(self._native)

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        self._native.free_blocks([b.block_id for b in ordered_blocks])

    def get_num_free_blocks(self) -> int:
        return self._native.num_free_blocks()

    def get_usage(self) -> float:
        return self._native.usage()

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self._manager.evict_blocks(block_ids)

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> Optional[List[Any]]:
        """vLLM's ``BlockPool.get_cached_block``: the first block cached under the hash in
        each group (views of pagedkv's blocks), or ``None`` if any group misses."""
        found = []
        for group_id in kv_cache_group_ids:
            block_id = self._native.cached_block(block_hash, group_id)
            if block_id is None:
                return None
            found.append(self.blocks[block_id])
        return found


class _CoordinatorView:
    """What vLLM's scheduler reaches through ``kv_cache_manager.coordinator``."""

    enable_partial_hash_hits = False

    def __init__(self, manager: HybridKVCacheManager, kv_cache_config: Any) -> None:
        self._manager = manager
        self.block_pool = manager.block_pool
        self.kv_cache_config = kv_cache_config
        self.single_type_managers = tuple(
            _GroupView(manager, g.kv_cache_spec, i)
            for i, g in enumerate(kv_cache_config.kv_cache_groups)
        )
        flagged = {i for i, g in enumerate(kv_cache_config.kv_cache_groups) if _eagle_flag(g)}
        if manager.use_eagle and not flagged:
            flagged = set(range(len(kv_cache_config.kv_cache_groups)))
        self.eagle_group_ids: set = flagged
        drops = manager._native.eagle_groups
        self.drop_eagle_group_ids: set = {i for i in flagged if drops[i]}
        self.num_reprefillable_tokens = 0

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Any],
        num_encoder_tokens: int = 0,
        total_computed_tokens: int = 0,
        num_local_computed_tokens: int = 0,
        num_tokens_main_model: int = 0,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        if num_encoder_tokens:
            raise InvalidArgumentError("encoder tokens are outside pagedkv's hybrid manager")
        ids = [[b.block_id for b in g] for g in new_computed_blocks]
        return self._manager._native.num_blocks_to_allocate(
            request_id,
            num_tokens,
            ids,
            total_computed_tokens,
            apply_admission_cap,
            num_tokens_main_model,
            prefill_end,
        )


class HybridKVCacheManager(PrefixCacheStatsMixin):
    """vLLM v1's ``KVCacheManager`` for several KV cache groups, native (see the module)."""

    def __init__(self, kv_cache_config: Any, a: Dict[str, Any], release: str) -> None:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.metrics.stats import PrefixCacheStats
        from vllm.v1.request import RequestStatus

        self._KVCacheBlocks = KVCacheBlocks
        self._PrefixCacheStats = PrefixCacheStats
        self._admitting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        self.kv_cache_config = kv_cache_config
        self._read_settings(kv_cache_config, a)
        self._native = self._make_native(kv_cache_config, a, release)
        self._make_views(kv_cache_config)
        self._events: List[Any] = []
        self._int_hashes = False
        if self.enable_kv_cache_events:
            self._bind_events()

    def _read_settings(self, kv_cache_config: Any, a: Dict[str, Any]) -> None:
        """The manager's settings from vLLM's arguments ``a`` (read in the order vLLM's
        manager reads them; a negative watermark raises before anything native is built)."""
        groups = kv_cache_config.kv_cache_groups
        self.max_model_len = a["max_model_len"]
        self.block_size = a["scheduler_block_size"]
        self.hash_block_size = a["hash_block_size"]
        self.enable_caching = a["enable_caching"]
        self.enable_kv_cache_events = a["enable_kv_cache_events"]
        self.use_eagle = a["use_eagle"]
        self.num_hash_lookahead_tokens = hash_lookahead_tokens(a)
        self.log_stats = a["log_stats"]
        self.metrics_collector = None
        self.prefix_cache_stats = self._PrefixCacheStats() if self.log_stats else None
        self.num_kv_cache_groups = len(groups)
        self.retained_hit_group_ids: Tuple[int, ...] = ()
        self.mamba_shared_prefix_checkpoint = False
        if a["watermark"] < 0:
            raise InvalidArgumentError("watermark must be non-negative")
        self.watermark_blocks = int(a["watermark"] * kv_cache_config.num_blocks)
        self._max_in_flight_tokens = a["max_in_flight_tokens"]

    def _make_native(self, kv_cache_config: Any, a: Dict[str, Any], release: str) -> Any:
        """The native coordinator (``_native.V1Hybrid``) over the settings read."""
        from pagedkv import _native

        groups = kv_cache_config.kv_cache_groups
        in_flight = self._max_in_flight_tokens
        return _native.V1Hybrid(
            kv_cache_config.num_blocks,
            group_kinds(kv_cache_config),
            self.hash_block_size,
            self.block_size,
            self.max_model_len,
            self.max_model_len if in_flight is None else in_flight,
            self.enable_caching,
            self.enable_kv_cache_events,
            self.watermark_blocks,
            "0.32" if release == "0.32.0" else "0.33",
            getattr(kv_cache_config, "prefix_cache_retention_interval", None),
            use_eagle=bool(self.use_eagle),
            eagle_groups=[_eagle_flag(g) for g in groups],
            zero_new_blocks=bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False)),
            checkpoint_alignments=checkpoint_alignments(kv_cache_config),
            hash_lookahead_tokens=self.num_hash_lookahead_tokens,
            prefill_lookahead=a["num_prefill_lookahead"],
            extra_retained_tokens=extra_retained_tokens(kv_cache_config),
        )

    def _make_views(self, kv_cache_config: Any) -> None:
        """What vLLM's scheduler and engine read besides the methods: per-group facts, the
        event metadata, ``block_pool``, ``coordinator``, the empty blocks and the blocks
        class."""
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

        groups = kv_cache_config.kv_cache_groups
        self._group_block_sizes = [g.kv_cache_spec.block_size for g in groups]
        # vLLM clips to the computed tokens only the attention groups' tables.
        self._clipped = [_is_attention(g.kv_cache_spec) for g in groups]
        self.kv_cache_event_metadata = tuple(
            (get_kv_cache_spec_kind(g.kv_cache_spec).value, _window(g.kv_cache_spec))
            for g in groups
        )
        self.block_pool = _PoolView(self)
        self.coordinator = _CoordinatorView(self, kv_cache_config)
        self.empty_kv_cache_blocks = _blocks.make_empty_blocks(self._KVCacheBlocks, len(groups))
        self._Blocks = _blocks.make_blocks_class(self._KVCacheBlocks, self._native, HybridBlockView)

    def _bind_events(self) -> None:
        """Events on: the native side builds the stored/removed events (with caching on) and
        appends them to ``self._events``."""
        self._int_hashes = _events.int_hashes_enabled()
        metadata = zip(self.kv_cache_event_metadata, self._group_block_sizes)
        if self.enable_caching:
            # Without caching no block is stored or removed (and the hash block size,
            # then the scheduler's, need not divide every group's block size).
            _events.bind_native(
                self._native,
                [(kind, window, bs) for (kind, window), bs in metadata],
                self.hash_block_size,
                self._int_hashes,
                self.num_hash_lookahead_tokens,
            )
        # `_drain_events` appends to this list natively (the list object stays the same:
        # `take_events` copies and clears it); `_build_events` builds what it leaves.
        self._native.bind_event_sink(self._events, self._build_events)

    def cap_max_model_len(self, cap: int) -> None:
        """Decide from now on as vLLM's manager built at ``max_model_len`` = ``cap`` (the
        native loop's length cap, where the KV cache holds fewer tokens): slot counts and the
        window and chunk admission caps, with ``max_in_flight_tokens`` at ``cap`` too where
        vLLM's config left it unset. Only before any request is held."""
        in_flight = self._max_in_flight_tokens
        self._native.cap_max_model_len(cap, cap if in_flight is None else in_flight)
        self.max_model_len = min(self.max_model_len, cap)

    # --- blocks ------------------------------------------------------------------------
    def create_kv_cache_blocks(self, blocks: Sequence[Sequence[Any]]) -> Any:
        return self._KVCacheBlocks(tuple(blocks)) if any(blocks) else self.empty_kv_cache_blocks

    def _wrap(self, ids: Sequence[Sequence[int]]) -> Any:
        """Block ids per group as vLLM's ``KVCacheBlocks`` (ids kept; views made when read)."""
        if not any(ids):
            return self.empty_kv_cache_blocks
        return self._Blocks(tuple(list(g) for g in ids))

    def _computed_ids(self, blocks: Any) -> Optional[List[List[int]]]:
        """The adopted hit's ids per group; ``None`` for vLLM's shared empty blocks."""
        if blocks is None:
            return None
        if isinstance(blocks, self._Blocks):
            return [list(g) for g in blocks.ids]
        groups = blocks.blocks
        if groups is self.empty_kv_cache_blocks.blocks:
            return None
        if len(groups) != self.num_kv_cache_groups:
            raise InvalidArgumentError(
                f"blocks for {len(groups)} groups, the manager has {self.num_kv_cache_groups}"
            )
        return [[b.block_id for b in g] for g in groups]

    # --- the scheduler's calls ---------------------------------------------------------------
    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: Optional[int] = None
    ) -> Tuple[Any, int, int]:
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        if max_cache_hit_length < 0:
            raise InvalidArgumentError(
                f"max_cache_hit_length must be non-negative, got {max_cache_hit_length}"
            )
        ids, num_tokens, boundary = self._native.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        if (
            num_tokens > 0
            and self.enable_kv_cache_events
            and getattr(request, "kv_cache_report_mode", "incremental") == "full"
        ):
            for group, group_ids in enumerate(ids):
                if group_ids:
                    n = len(group_ids)
                    self._events.append(self._stored(request, group, 0, n, range(n)))
        return self._wrap(ids), num_tokens, boundary

    def get_computed_blocks_for_connector(
        self, request: Any, max_cache_hit_length: Optional[int] = None
    ) -> Tuple[Any, int, int, bool]:
        return (*self.get_computed_blocks(request, max_cache_hit_length), False)

    def allocate_slots(
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
        skip_zeroing_group_ids: Tuple[int, ...] = (),
    ) -> Any:
        """vLLM's ``allocate_slots`` (same arguments and result): the new blocks per group,
        ``None`` when they do not fit. A KV connector's external tokens get blocks as in vLLM
        (beside attention groups; beside a Mamba group an error); encoder tokens are outside
        the scope: 0 or an error."""
        if num_encoder_tokens:
            raise InvalidArgumentError("encoder tokens are outside pagedkv's manager")
        ids = self._native.allocate_slots(
            request.request_id,
            request.num_computed_tokens,
            request.num_tokens,
            getattr(request, "num_in_flight_tokens", 0),
            request.status in self._admitting,
            num_new_tokens,
            num_new_computed_tokens,
            self._computed_ids(new_computed_blocks),
            num_lookahead_tokens,
            delay_cache_blocks,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            request.block_hashes,
            request.num_prompt_tokens,
            request.shared_prefix_boundary,
            num_external_computed_tokens,
        )
        self._drain_events(request)
        return None if ids is None else self._wrap(ids)

    def free(self, request: Any) -> None:
        self._native.free(request.request_id)

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: Any = None
    ) -> None:
        self._native.remove_skipped_blocks(request_id, processed_computed_tokens)

    def pop_blocks_for_free(self, request: Any) -> List[HybridBlockView]:
        n = self._native
        return [HybridBlockView(n, b) for b in n.pop_blocks_for_free(request.request_id)]

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self._native.evict_blocks(list(block_ids))
        self._drain_events()

    def reset_prefix_cache(self) -> bool:
        if not self._native.reset_prefix_cache():
            return False
        self._drain_events()
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> List[int]:
        return [0] * self.num_kv_cache_groups

    def take_events(self) -> List[Any]:
        events = self._events[:]
        self._events.clear()
        return events

    def get_blocks(self, request_id: str) -> Any:
        return self._wrap(self._native.block_ids(request_id))

    def get_block_ids(self, request_id: str) -> Tuple[List[int], ...]:
        return tuple(self._native.block_ids(request_id))

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> Tuple[List[int], ...]:
        ids = self._native.block_ids(request_id)
        return tuple(
            g[: -(-num_computed_tokens // bs)] if clip else g
            for g, bs, clip in zip(ids, self._group_block_sizes, self._clipped)
        )

    def estimate_cached_tokens(self, request: Any) -> int:
        """vLLM's estimate: per group the most tokens a hash of its blocks covers, the least
        over groups (every group in scope is prefix-cacheable); one native call."""
        return self._native.estimate_cached_tokens(request.request_id)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """vLLM's ``cache_blocks``; a count of 0 or less caches nothing, as vLLM's manager
        reads it (see the one-group manager's)."""
        if self.enable_caching and num_computed_tokens > 0:
            self._native.cache_blocks(
                request.request_id,
                num_computed_tokens,
                request.block_hashes,
                request.num_prompt_tokens,
                request.shared_prefix_boundary,
            )
            self._drain_events(request)

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        """vLLM's: each group's hit cut at ``num_computed_tokens`` (block-aligned); a Mamba
        group's may be shorter (vLLM keeps what it has), an attention group's may not."""
        groups = self._computed_ids(blocks) or [[] for _ in self._group_block_sizes]
        out = []
        for g, bs, attention in zip(groups, self._group_block_sizes, self._clipped):
            too_short = attention and num_computed_tokens // bs > len(g)
            if num_computed_tokens % bs or too_short:
                raise InvalidArgumentError(
                    f"cannot truncate a hit to {num_computed_tokens} tokens at block size {bs}"
                )
            out.append(g[: num_computed_tokens // bs])
        return self._wrap(out)

    def take_new_block_ids(self) -> List[int]:
        """vLLM's: the attention groups' blocks handed out since the last call, group by
        group, for the worker to zero (none unless the config needs zeroing: Mamba layers)."""
        return self._native.take_new_block_ids()

    # --- features outside the scope: nothing to hand out ------------------------------------
    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """vLLM calls it only after a failed KV connector load when its cache needs zeroing
        (Mamba layers), and beside Mamba layers a connector keeps vLLM's manager: never
        reached."""

    def take_kv_cache_block_copies(self) -> Tuple[List[Any], List[Any]]:
        return [], []

    def take_boundary_state_offloads(self) -> Dict[str, List[Tuple[int, int, int]]]:
        return {}

    def finalize_partial_tail_offloads(self, request: Any) -> List[Tuple[int, int, int]]:
        return []

    def new_step_starts(self) -> None:
        """vLLM's: a Mamba "align" group forgets the states it cached during the last step
        (a hit on one defers its request a step); nothing for the other kinds."""
        self._native.new_step_starts()

    # --- KV events ---------------------------------------------------------------------------
    def _drain_events(self, request: Any = None) -> None:
        """The logged events as vLLM's objects into ``_events``: built natively (``BlockRemoved``;
        ``BlockStored`` of a plain ``Request``), the rest by :meth:`_build_events`."""
        if self.enable_kv_cache_events:
            self._native.drain_events(request)

    def _build_events(self, native_events: List[Tuple[Any, ...]], request: Any) -> List[Any]:
        """vLLM's objects for raw native events (``V1Hybrid.take_events``' tuples)."""
        out = []
        for event in native_events:
            if event[0] == "event":
                out.append(event[1])
            elif event[0] == "stored":
                _, group, first, end, cached = event
                out.append(self._stored(request, group, first, end, cached))
            elif event[0] == "removed":
                out.append(self._removed(event[1], event[2]))
            else:
                from vllm.distributed.kv_events import AllBlocksCleared

                out.append(AllBlocksCleared())
        return out

    def _removed(self, block_hash: bytes, group: int) -> Any:
        from vllm.distributed.kv_events import MEDIUM_GPU, BlockRemoved

        return BlockRemoved(
            block_hashes=[_events.published(block_hash, self._int_hashes)],
            medium=MEDIUM_GPU,
            group_idx=group,
        )

    def _stored(self, request: Any, group: int, first: int, end: int, cached: Iterable[int]) -> Any:
        """vLLM's ``BlockStored`` for blocks ``first..end`` of ``group``, listing the hashes
        (and extra keys) of the positions in ``cached``, as its block pool builds it; the
        spec's kind and window as vLLM's ``take_events`` sets them. The Python builder: for
        requests with extra hash keys or not of vLLM's ``Request`` class, and vLLM's "full"
        report mode (``events.rs`` builds the others)."""
        from vllm.distributed.kv_events import MEDIUM_GPU, BlockStored

        bs = self._group_block_sizes[group]
        scale = bs // self.hash_block_size
        hashes = request.block_hashes
        publish = self._int_hashes
        cached = list(cached)
        extra_keys, ahead = _events.stored_keys(request, bs, cached, self.num_hash_lookahead_tokens)
        lora = request.lora_request
        event = BlockStored(
            block_hashes=[_events.published(hashes[(i + 1) * scale - 1], publish) for i in cached],
            parent_block_hash=(
                _events.published(hashes[first * scale - 1], publish) if first else None
            ),
            token_ids=request.all_token_ids[first * bs : end * bs],
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM_GPU,
            lora_name=lora.name if lora else None,
            extra_keys=extra_keys,
            group_idx=group,
            session_id=request.session_id,
        )
        if ahead is not None:
            event.lookahead_token_ids = ahead
        event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = self.kv_cache_event_metadata[
            group
        ]
        return event


def _is_attention(spec: Any) -> bool:
    """vLLM's ``AttentionSpec`` (every kind in scope but Mamba)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    return isinstance(spec, AttentionSpec)


def _window(spec: Any) -> Any:
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_sliding_window

    return get_kv_cache_spec_sliding_window(spec)
