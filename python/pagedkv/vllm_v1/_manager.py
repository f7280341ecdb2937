"""``KVCacheManager``: vLLM v1's KV cache manager API on pagedkv's native core.

Constructed with vLLM's own arguments. In scope (see :mod:`pagedkv.vllm_v1._scope`) it is the
native manager (for two or more KV cache groups, or one that is not full attention, a
:class:`pagedkv.vllm_v1._hybrid.HybridKVCacheManager`); out of scope ``KVCacheManager(...)``
returns vLLM's own manager instead and logs why, once per reason. What the scheduler,
connectors and tests read back behaves as vLLM's: ``KVCacheBlocks`` (a subclass, answering
``get_block_ids`` from ids), blocks with ``block_id``, ``ref_cnt``, ``block_hash``, the same
block ids in the same order, the same KV events and prefix-cache stats. The manager crosses
into Rust once per call, never per block.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any, Dict, Iterable, List, Optional, Tuple

from pagedkv.errors import ArgumentTypeError, InvalidArgumentError

from . import _blocks, _events, _scope
from ._version import require_supported_vllm

logger = logging.getLogger("pagedkv.vllm_v1")
_LOGGED: set = set()


def log_once(message: str, *args: Any, level: int = logging.INFO) -> None:
    """Log a line once per distinct text."""
    key = message % args
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, message, *args)


def out_of_scope_reason(kv_cache_config: Any, *args: Any, **kwargs: Any) -> Optional[str]:
    """Why ``KVCacheManager(kv_cache_config, *args, **kwargs)`` gives vLLM's own manager
    (``None``: it gives pagedkv's)."""
    return _scope.out_of_scope(kv_cache_config, **_named_args(args, kwargs))


class _PoolView:
    """What vLLM's scheduler reaches through ``kv_cache_manager.block_pool``."""

    def __init__(self, manager: KVCacheManager) -> None:
        self._manager = manager
        self._native = manager._native
        self.num_gpu_blocks = self._native.num_blocks
        self.enable_caching = manager.enable_caching
        self.hash_block_size = manager.block_size
        self.num_hash_lookahead_tokens = manager.num_hash_lookahead_tokens
        self.null_block = _blocks.BlockView(self._native, 0)

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        self._native.free_blocks(_blocks.block_ids_of(ordered_blocks))

    def get_num_free_blocks(self) -> int:
        return self._native.num_free_blocks()

    def get_usage(self) -> float:
        return self._native.usage()

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """The manager's ``evict_blocks`` (one path: its ``BlockRemoved`` events are collected
        at once, in order)."""
        self._manager.evict_blocks(block_ids)

    @property
    def blocks(self) -> _PoolBlocks:
        """Every block by id, as vLLM's ``block_pool.blocks`` list (read by vLLM's tests)."""
        return _PoolBlocks(self)

    @property
    def cached_block_hash_to_block(self) -> _CachedHashesView:
        """vLLM's hash -> cached blocks map, read-only (read by vLLM's tests)."""
        return _CachedHashesView(self)

    @property
    def free_block_queue(self) -> _FreeQueueView:
        """vLLM's free-block queue, read-only (read by vLLM's tests)."""
        return _FreeQueueView(self)


class _PoolBlocks(Sequence):
    """``block_pool.blocks``: block ``i`` is a live view of block ``i`` (0: the pool's
    ``null_block`` object), built when read."""

    def __init__(self, pool: _PoolView) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_gpu_blocks

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not isinstance(i, int):
            raise TypeError(f"block indices must be integers or slices, not {type(i).__name__}")
        n = len(self)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError("block index out of range")
        return self._pool.null_block if j == 0 else _blocks.BlockView(self._pool._native, j)


class _CachedHashesView:
    """vLLM's ``BlockHashToBlockMap`` as its tests read it: ``len`` (the distinct hashes
    cached), ``get_one_block`` and ``_cache`` (each ``BlockHashWithGroupId`` to its block, or
    to ``{block_id: block}`` when several blocks hold it), built from every block's hash when
    read: O(blocks), for inspection only."""

    def __init__(self, pool: _PoolView) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool._native.num_cached_hashes()

    @property
    def _cache(self) -> Dict[bytes, Any]:
        by_hash: Dict[bytes, Dict[int, Any]] = {}
        for view in self._pool.blocks[1:]:
            key = view.block_hash
            if key is not None:
                by_hash.setdefault(key, {})[view.block_id] = view
        return {k: next(iter(v.values())) if len(v) == 1 else v for k, v in by_hash.items()}

    def get_one_block(self, key: bytes) -> Any:
        found = self._cache.get(key)
        return next(iter(found.values())) if isinstance(found, dict) else found


class _FreeQueueView:
    """vLLM's ``FreeKVCacheBlockQueue`` as its tests read it: the free count and the free
    blocks in eviction order."""

    def __init__(self, pool: _PoolView) -> None:
        self._pool = pool

    @property
    def num_free_blocks(self) -> int:
        return self._pool.get_num_free_blocks()

    def get_all_free_blocks(self) -> List[Any]:
        return [self._pool.blocks[b] for b in self._pool._native.free_queue()]


class _GroupView:
    """The one single-type manager vLLM's engine inspects (block size and spec), and as
    vLLM's own tests read it (``req_to_blocks``, ``num_cached_block``, ``_null_block``)."""

    def __init__(self, manager: KVCacheManager, spec: Any) -> None:
        self.kv_cache_spec = spec
        self.block_size = manager.block_size
        self.kv_cache_group_id = 0
        self.enable_caching = manager.enable_caching
        self.block_pool = manager.block_pool
        self._null_block = manager.block_pool.null_block
        native = manager._native
        self.req_to_blocks = _blocks.RequestBlocksView(
            lambda request_id: (native.block_ids(request_id),),
            0,
            lambda block_id: _blocks.BlockView(native, block_id),
            self._null_block,
            lambda: native.num_requests,
        )
        self.num_cached_block = _blocks.CachedCountView(
            native.num_cached_blocks, lambda: native.num_tracked_requests
        )


class _CoordinatorView:
    """What vLLM's scheduler reaches through ``kv_cache_manager.coordinator``."""

    enable_partial_hash_hits = False

    def __init__(self, manager: KVCacheManager, spec: Any) -> None:
        self._manager = manager
        self.block_pool = manager.block_pool
        self.single_type_managers = (_GroupView(manager, spec),)
        group = manager.kv_cache_config.kv_cache_groups[0]
        flagged = bool(getattr(group, "is_eagle_group", False))
        self.eagle_group_ids: set = {0} if flagged or manager.use_eagle else set()
        self.drop_eagle_group_ids: set = {0} if manager._native.drops_eagle_block else set()
        self.num_reprefillable_tokens = 0

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Tuple[Any, ...],
        num_encoder_tokens: int = 0,
        total_computed_tokens: int = 0,
        num_local_computed_tokens: int = 0,
        num_tokens_main_model: int = 0,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        ids = _blocks.block_ids_of(new_computed_blocks[0])
        return self._manager._native.num_blocks_to_allocate(request_id, num_tokens, ids)


class PrefixCacheStatsMixin:
    """vLLM's ``KVCacheManager`` usage and prefix-cache stats, shared by the single-group and
    the hybrid native managers (each sets ``_native``, ``log_stats``, ``enable_caching``,
    ``prefix_cache_stats`` and ``_PrefixCacheStats``, vLLM's class)."""

    _native: Any
    log_stats: bool
    enable_caching: bool
    prefix_cache_stats: Any
    _PrefixCacheStats: Any

    @property
    def usage(self) -> float:
        return self._native.usage()

    def make_prefix_cache_stats(self) -> Any:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = self._PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )


class KVCacheManager(PrefixCacheStatsMixin):
    """vLLM v1's ``KVCacheManager`` (same constructor), native when the config is in scope."""

    def __new__(cls, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        release = require_supported_vllm()
        reason = out_of_scope_reason(kv_cache_config, *args, **kwargs)
        # The scheduler's start line (pagedkv.vllm_v1._report) is what operators read; these
        # are for a manager built on its own.
        if reason is None:
            log_once("pagedkv: native KV cache manager (vLLM %s)", release, level=logging.DEBUG)
            if _scope.needs_group_managers(kv_cache_config):
                from ._hybrid import HybridKVCacheManager

                return HybridKVCacheManager(kv_cache_config, _named_args(args, kwargs), release)
            return super().__new__(cls)
        log_once("pagedkv: vLLM's own KV cache manager runs: %s", reason, level=logging.DEBUG)
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMManager

        return VLLMManager(kv_cache_config, *args, **kwargs)

    def __init__(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        a = _named_args(args, kwargs)
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.metrics.stats import PrefixCacheStats
        from vllm.v1.request import RequestStatus

        from pagedkv import _native

        self._PrefixCacheStats = PrefixCacheStats
        self._admitting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        self.kv_cache_config = kv_cache_config
        self.max_model_len = a["max_model_len"]
        self.block_size = a["scheduler_block_size"]
        self.enable_caching = a["enable_caching"]
        self.enable_kv_cache_events = a["enable_kv_cache_events"]
        self.use_eagle = a["use_eagle"]
        self.num_hash_lookahead_tokens = hash_lookahead_tokens(a)
        self.log_stats = a["log_stats"]
        self.metrics_collector = None
        self.prefix_cache_stats = PrefixCacheStats() if self.log_stats else None
        self.num_kv_cache_groups = 1
        self.retained_hit_group_ids: Tuple[int, ...] = ()
        self.mamba_shared_prefix_checkpoint = False
        watermark = a["watermark"]
        if watermark < 0:
            raise InvalidArgumentError("watermark must be non-negative")
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        group = kv_cache_config.kv_cache_groups[0]
        self._native = _native.V1Manager(
            kv_cache_config.num_blocks,
            self.block_size,
            self.max_model_len,
            self.enable_caching,
            self.enable_kv_cache_events,
            self.watermark_blocks,
            use_eagle=bool(self.use_eagle),
            eagle_group=bool(getattr(group, "is_eagle_group", False)),
            release="0.32" if require_supported_vllm() == "0.32.0" else "0.33",
            prefill_lookahead=a["num_prefill_lookahead"],
        )
        spec = group.kv_cache_spec
        self._init_metadata(spec)
        self.block_pool = _PoolView(self)
        self.coordinator = _CoordinatorView(self, spec)
        self.empty_kv_cache_blocks = _blocks.make_empty_blocks(KVCacheBlocks)
        self._Blocks = _blocks.make_blocks_class(KVCacheBlocks, self._native)
        self._events: List[Any] = []
        if self._builder is not None:
            self._builder.bind_native(self._native)
            # Allocations append their events to this list natively (the list object stays
            # the same: `take_events` copies and clears it).
            self._native.bind_event_sink(self._events, self._builder.build)
        self._native.bind_vllm(
            self.empty_kv_cache_blocks,
            self._Blocks,
            *self._admitting,
            _request_cls_with_plain_num_tokens(),
        )
        # The scheduler's hottest call goes straight to Rust (same signature and result as
        # the method below, which stays for class-level access).
        self.allocate_slots = self._native.vllm_allocate_slots

    def cap_max_model_len(self, cap: int) -> None:
        """Decide from now on as vLLM's manager built at ``max_model_len`` = ``cap`` (the
        native loop's length cap, where the KV cache holds fewer tokens): slot counts,
        lookahead slots included, stop at ``cap``. Only before any request is held."""
        self._native.cap_max_model_len(cap)
        self.max_model_len = min(self.max_model_len, cap)

    def _init_metadata(self, spec: Any) -> None:
        from vllm.v1.kv_cache_interface import (
            get_kv_cache_spec_kind,
            get_kv_cache_spec_sliding_window,
        )

        kind = get_kv_cache_spec_kind(spec).value
        window = get_kv_cache_spec_sliding_window(spec)
        self.kv_cache_event_metadata = ((kind, window),)
        self._builder = (
            _events.EventBuilder(self.block_size, kind, window, self.num_hash_lookahead_tokens)
            if self.enable_kv_cache_events
            else None
        )

    # --- the scheduler's calls ---------------------------------------------------------------
    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: Optional[int] = None
    ) -> Tuple[Any, int, int]:
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        max_blocks = max_cache_hit_length // self.block_size
        # vLLM's lookup slices the hashes with islice(): a bound past sys.maxsize blocks is
        # its ValueError, here an InvalidArgumentError (a ValueError too).
        if max_cache_hit_length < 0 or max_blocks > sys.maxsize:
            raise InvalidArgumentError(
                f"max_cache_hit_length must be in [0, {self.block_size} * sys.maxsize], "
                f"got {max_cache_hit_length}"
            )
        ids = self._native.longest_cache_hit(request.block_hashes, max_blocks)
        if (
            ids
            and self._builder is not None
            and getattr(request, "kv_cache_report_mode", "incremental") == "full"
        ):
            self._events.append(self._builder.stored(request, 0, len(ids)))
        return self._wrap(ids), len(ids) * self.block_size, 0

    def get_computed_blocks_for_connector(
        self, request: Any, max_cache_hit_length: Optional[int] = None
    ) -> Tuple[Any, int, int, bool]:
        return (*self.get_computed_blocks(request, max_cache_hit_length), False)

    def allocate_slots(self, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``allocate_slots`` (same arguments and result), in Rust: the new blocks as
        ``KVCacheBlocks`` (vLLM's shared empty one when none is new), ``None`` when they do not
        fit. A KV connector's external tokens get blocks as in vLLM (taken after the hit's,
        before the new ones, and not returned); encoder tokens are outside the scope: 0 or an
        error."""
        return self._native.vllm_allocate_slots(request, num_new_tokens, *args, **kwargs)

    def _computed_ids(self, blocks: Any) -> Optional[List[int]]:
        """The adopted hit's ids; ``None`` for vLLM's shared empty ``KVCacheBlocks``."""
        if blocks is None or blocks is self.empty_kv_cache_blocks:
            return None
        if isinstance(blocks, self._Blocks):
            return blocks.ids[0]
        groups = blocks.blocks
        if groups is self.empty_kv_cache_blocks.blocks:
            return None
        return _blocks.block_ids_of(groups[0])

    def _wrap(self, ids: List[int]) -> Any:
        return self._Blocks((ids,)) if ids else self.empty_kv_cache_blocks

    def _drain_events(self, request: Any = None) -> None:
        if self._builder is not None:
            native = self._native.take_events(request)
            if native:
                self._events.extend(self._builder.build(native, request))

    def free(self, request: Any) -> None:
        self._native.free(request.request_id)

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: Any = None
    ) -> None:
        """Full attention skips no tokens: nothing to remove."""

    def pop_blocks_for_free(self, request: Any) -> List[_blocks.BlockView]:
        native = self._native
        return [
            _blocks.BlockView(native, b) for b in native.pop_blocks_for_free(request.request_id)
        ]

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self._native.evict_blocks(list(block_ids))
        self._drain_events()

    def reset_prefix_cache(self) -> bool:
        if not self._native.reset_prefix_cache():
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                self._native.num_blocks - self._native.num_free_blocks() - 1,
            )
            return False
        self._drain_events()
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> List[int]:
        return [0]

    def take_events(self) -> List[Any]:
        events = self._events[:]
        self._events.clear()
        return events

    def get_blocks(self, request_id: str) -> Any:
        return self._wrap(self._native.block_ids(request_id))

    def get_block_ids(self, request_id: str) -> Tuple[List[int], ...]:
        return (self._native.block_ids(request_id),)

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> Tuple[List[int], ...]:
        ids = self._native.block_ids(request_id)
        return (ids[: -(-num_computed_tokens // self.block_size)],)

    def estimate_cached_tokens(self, request: Any) -> int:
        return self._native.estimate_cached_tokens(request.request_id)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """vLLM's ``cache_blocks``. A count of 0 or less caches nothing, as vLLM's manager
        reads it: vLLM's own ``update_from_output`` passes ``num_computed_tokens -
        num_in_flight_tokens``, below 0 once a failed KV load took computed tokens back."""
        if self.enable_caching and num_computed_tokens > 0:
            self._native.cache_blocks(request.request_id, num_computed_tokens, request.block_hashes)
            self._drain_events(request)

    def create_kv_cache_blocks(self, blocks: Tuple[Any, ...]) -> Any:
        return (
            self._wrap(_blocks.block_ids_of(blocks[0]))
            if any(blocks)
            else self.empty_kv_cache_blocks
        )

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        if num_computed_tokens % self.block_size:
            raise InvalidArgumentError("num_computed_tokens must be block-aligned")
        ids = self._computed_ids(blocks) or []
        n = num_computed_tokens // self.block_size
        if n > len(ids):
            raise InvalidArgumentError("cannot truncate past the hit")
        return self._wrap(ids[:n])

    # --- features outside the scope: nothing to hand out ------------------------------------
    def take_new_block_ids(self) -> List[int]:
        return []

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """No zeroing in scope (no Mamba, uniform precision)."""

    def take_kv_cache_block_copies(self) -> Tuple[List[Any], List[Any]]:
        return [], []

    def take_boundary_state_offloads(self) -> Dict[str, List[Tuple[int, int, int]]]:
        return {}

    def finalize_partial_tail_offloads(self, request: Any) -> List[Tuple[int, int, int]]:
        return []

    def new_step_starts(self) -> None:
        """Nothing per step for full attention."""


def _request_cls_with_plain_num_tokens() -> Any:
    """vLLM's ``Request`` when its ``num_tokens`` property is ``len(self._all_token_ids)`` (as
    in 0.32 and 0.33), so the native ``allocate_slots`` may read that length itself; else
    ``None`` (the property is called)."""
    from vllm.v1.request import Request

    def plain(self: Any) -> int:
        return len(self._all_token_ids)

    code = getattr(getattr(Request.__dict__.get("num_tokens"), "fget", None), "__code__", None)
    ref = plain.__code__
    if code is None or (code.co_code, code.co_names) != (ref.co_code, ref.co_names):
        return None
    return Request


_PARAMS = (
    "max_model_len",
    "scheduler_block_size",
    "hash_block_size",
    "max_in_flight_tokens",
    "enable_caching",
    "use_eagle",
    "num_hash_lookahead_tokens",
    "num_prefill_lookahead",
    "log_stats",
    "enable_kv_cache_events",
    "dcp_world_size",
    "pcp_world_size",
    "metrics_collector",
    "watermark",
    "enable_mamba_shared_prefix_checkpoint",
)
_DEFAULTS = dict(
    max_in_flight_tokens=None,
    enable_caching=True,
    use_eagle=False,
    num_hash_lookahead_tokens=0,
    num_prefill_lookahead=0,
    log_stats=False,
    enable_kv_cache_events=False,
    dcp_world_size=1,
    pcp_world_size=1,
    metrics_collector=None,
    watermark=0.0,
    enable_mamba_shared_prefix_checkpoint=False,
)


def hash_lookahead_tokens(a: Dict[str, Any]) -> int:
    """vLLM 0.33's ``num_hash_lookahead_tokens`` (0 on 0.32, which has none): the tokens past
    each block its hash covers. Only the KV events' contents depend on it here (the requests'
    hashers compute the hashes); a non-integer or negative count is refused (a ``bool`` is
    an int, as vLLM's own tests pass it)."""
    n = a["num_hash_lookahead_tokens"]
    if not isinstance(n, int) or n < 0:
        raise InvalidArgumentError(
            f"num_hash_lookahead_tokens must be a non-negative int, got {n!r}"
        )
    return int(n)


def param_names() -> Tuple[str, ...]:
    """The installed vLLM's ``KVCacheManager.__init__`` parameters after ``kv_cache_config``,
    in order: 0.33's :data:`_PARAMS`; 0.32 has no ``num_hash_lookahead_tokens``."""
    if require_supported_vllm() == "0.32.0":
        return tuple(n for n in _PARAMS if n != "num_hash_lookahead_tokens")
    return _PARAMS


def _named_args(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """vLLM's constructor arguments (after ``kv_cache_config``) by name, defaults filled in.

    Bound as the installed vLLM's signature binds them (:func:`param_names`): what it refuses
    raises :class:`ArgumentTypeError`, a ``TypeError`` as vLLM's constructor raises (and an
    :class:`InvalidArgumentError`); on 0.32 that includes ``num_hash_lookahead_tokens``.
    """
    names = param_names()
    call = "KVCacheManager.__init__()"
    if len(args) > len(names):
        raise ArgumentTypeError(
            f"{call} takes at most {len(names)} positional arguments after kv_cache_config "
            f"({len(args)} given)"
        )
    for name in kwargs:
        if name not in names:
            raise ArgumentTypeError(f"{call} got an unexpected keyword argument {name!r}")
        if name in names[: len(args)]:
            raise ArgumentTypeError(f"{call} got multiple values for argument {name!r}")
    named = dict(_DEFAULTS)
    named.update(zip(names, args))
    named.update(kwargs)
    for required in ("max_model_len", "scheduler_block_size", "hash_block_size"):
        if required not in named:
            raise ArgumentTypeError(f"{call} missing required argument: {required!r}")
    return named
