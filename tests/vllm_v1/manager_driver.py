"""Drives vLLM's own v1 ``KVCacheManager`` and pagedkv's side by side with the same calls.

The managers only *read* requests (the scheduler is what mutates them), so both get the same
``Request`` objects; this driver plays the scheduler's part: admissions with prefix-cache hits
and chunked prefill, decode steps with lookahead slots, preemption, finishing (direct and
deferred frees), connector-style evictions, a KV connector's external tokens (loaded
synchronously or asynchronously, some loads failing) and prefix-cache resets. After every
operation it compares everything either manager shows: the returned block ids, every live
request's table, free-block counts, usage, KV events, prefix-cache stats and cached-token
estimates.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request, RequestStatus

from pagedkv.bench.vllm_v1 import driver
from pagedkv.vllm_v1 import KVCacheManager as PagedManager

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


#: Hybrid layouts, as models lay their layers out: (name, per-layer kinds), a kind being
#: ``"full"``, ``("swa", window in blocks + extra tokens)`` or ``("chunk", chunk in blocks)``.
HYBRID_LAYOUTS = {
    # GPT-OSS: full attention and a sliding window (128 tokens), alternating.
    "gpt-oss": ["full", ("swa", 2, 0)] * 2,
    # Gemma 3: five sliding-window layers to one full-attention layer.
    "gemma3": [("swa", 1, 3)] * 5 + ["full"],
    # Llama 4: chunked local attention, every fourth layer full.
    "llama4": [("chunk", 2, 0)] * 3 + ["full"],
    # Two windows and full attention (vLLM's lookup iterates to a fixed point).
    "two-windows": ["full", ("swa", 1, 1), ("swa", 3, 0)],
}

#: Attention layouts vLLM builds one group for, not full attention (its unitary coordinator
#: over that group's manager).
LONE_ATTENTION_LAYOUTS = {
    # Every layer a sliding window (a config whose `layer_types` are all "sliding_attention").
    "swa-only": [("swa", 2, 0)] * 2,
    # Every layer chunked local attention (no full layer).
    "chunked-local": [("chunk", 2, 0)] * 2,
}


def layer_spec(kind: Any, block_size: int) -> Any:
    """The driver's spec of a layer of ``kind`` (sizes here in blocks, there in tokens)."""
    if kind != "full":
        kind = (kind[0], kind[1] * block_size + (kind[2] if kind[0] == "swa" else 0))
    return driver.layer_spec(kind, block_size)


#: Layouts whose groups have different block sizes (as vLLM's page-size unification makes
#: them for layers of different sizes): (kind, block size in hash blocks) per group; the
#: scheduler block size is the largest. A window below the scheduler block size leaves
#: blocks out of the prefix cache (vLLM's ``reachable_block_mask``), so a ``BlockStored``
#: lists fewer hashes than its range has blocks.
MIXED_LAYOUTS = {
    "mixed-blocks": [("full", 1), (("swa", 1, 1), 1), (("swa", 2, 0), 2)],
}


#: Mamba hybrids in ``mamba_cache_mode`` "none" (prefix caching off, vLLM's default): the
#: per-layer kinds (``"mamba"`` or ``"full"``), the Mamba block size (``None``: max_model_len,
#: as vLLM's model config sets it without prefix caching; else in attention blocks, as vLLM's
#: own tests build Mamba specs) and ``num_speculative_blocks`` (vLLM sets it to the draft
#: tokens per step).
MAMBA_LAYOUTS = {
    # Granite 4 / Nemotron-H: mostly Mamba layers, every fourth one full attention.
    "granite4": (["mamba"] * 3 + ["full"], None, 0),
    # The same with two draft tokens per step (two speculative state blocks per request).
    "nemotron-h-spec": (["mamba", "full", "mamba", "mamba"], None, 2),
    # Mamba state blocks at the attention block size: the state of all but the last computed
    # token is freed as the request advances (get_num_skipped_tokens = n - 1).
    "mamba-block": (["mamba", "full"], 1, 0),
    # Mamba-2 / Codestral-Mamba-like: every layer Mamba, one group (vLLM's unitary
    # coordinator without prefix caching, over a MambaManager).
    "mamba2": (["mamba"] * 2, None, 0),
}


#: Mamba hybrids in ``mamba_cache_mode`` "align" (prefix caching on, as vLLM's model config
#: forces it for them): the per-layer kinds, ``num_speculative_blocks`` and the prefill
#: checkpoint alignment (0: no checkpoint blocks; Mamba2 layers declare one block at alignment
#: 1). The Mamba block is the attention block, as vLLM's config aligns them.
MAMBA_ALIGN_LAYOUTS = {
    # Granite 4: mostly Mamba layers, every fourth one full attention, no checkpoints.
    "granite4-align": (["mamba"] * 3 + ["full"], 0, 0),
    # Nemotron-H (Mamba2): a prefill checkpoint block per chunk that reaches the prefill end.
    "nemotron-h-align": (["mamba", "full", "mamba", "mamba"], 0, 1),
    # Two speculative state blocks per request (MTP-style drafts), with checkpoints.
    "qwen3-next-align-spec": (["mamba"] * 3 + ["full"], 2, 1),
    # Every layer Mamba2, with prefix caching: one group, vLLM's unitary coordinator.
    "mamba2-align": (["mamba"] * 2, 0, 1),
}

#: The layouts vLLM builds one KV cache group for (its unitary coordinator with prefix
#: caching; a lone full-attention group is pagedkv's one-group manager's).
LONE_GROUP_LAYOUTS = {"swa-only", "chunked-local", "mamba2", "mamba2-align"}


def scheduler_scale(layout: str) -> int:
    return max((k[1] for k in MIXED_LAYOUTS.get(layout, ())), default=1)


def mamba_spec(
    block_size: int,
    attention: Any,
    num_speculative_blocks: int = 0,
    mode: str = "none",
    checkpoint_alignment: int = 0,
) -> MambaSpec:
    """A Mamba layer's spec in ``mode``, its page padded to the attention layers' (as vLLM's
    page-size unification pads it, so that vLLM's grouping accepts the layers); a positive
    ``checkpoint_alignment`` gives it one prefill checkpoint block at that alignment."""
    checkpoint = (
        dict(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=checkpoint_alignment)
        if checkpoint_alignment
        else {}
    )
    return MambaSpec(
        block_size=block_size,
        shapes=((2,),),
        dtypes=(torch.float32,),
        page_size_padded=attention.page_size_bytes,
        mamba_cache_mode=mode,
        num_speculative_blocks=num_speculative_blocks,
        **checkpoint,
    )


def block_sizes(layout: str, block_size: int, max_model_len: int) -> tuple:
    """``(scheduler_block_size, hash_block_size)`` as vLLM resolves them for the layout: the
    least common multiple of the group block sizes; without prefix caching (every Mamba
    layout) the hash block size is the scheduler block size."""
    if layout in MAMBA_LAYOUTS or layout in MAMBA_ALIGN_LAYOUTS:
        sizes = [
            g.kv_cache_spec.block_size for g in hybrid_groups(layout, block_size, max_model_len)
        ]
        sbs = math.lcm(*sizes)
        return sbs, sbs
    return block_size * scheduler_scale(layout), block_size


def has_window(layout: str) -> bool:
    """Whether the layout has a sliding-window group (what retention applies to)."""
    kinds = (
        HYBRID_LAYOUTS.get(layout)
        or LONE_ATTENTION_LAYOUTS.get(layout)
        or [k for k, _ in MIXED_LAYOUTS.get(layout, ())]
    )
    if layout in MAMBA_LAYOUTS or layout in MAMBA_ALIGN_LAYOUTS:
        return False
    return any(k != "full" and k[0] == "swa" for k in kinds)


#: ``prefix_cache_retention_interval`` modes: dense (``None``), vLLM's engine default (``0``:
#: the tails at replay boundaries and junctions) and periodic (this many scheduler blocks).
RETENTIONS = (None, 0, 3)


def retention_interval(mode: Optional[int], layout: str, block_size: int) -> Optional[int]:
    """The interval for retention ``mode`` (an entry of :data:`RETENTIONS`) on the layout: a
    periodic mode is that many scheduler blocks, or 0 without a window (vLLM refuses a
    positive interval there)."""
    if not mode:
        return mode
    return mode * block_size * scheduler_scale(layout) if has_window(layout) else 0


def hybrid_groups(
    layout: str, block_size: int, max_model_len: int = 4096, prefill_lookahead: int = 0
) -> List[KVCacheGroupSpec]:
    """The KV cache groups vLLM builds for the layout's layers (vLLM's own grouping; its
    windows tagged with multi-module MTP's extra retained tokens for ``prefill_lookahead``,
    as vLLM's planner tags them)."""
    if layout in MAMBA_LAYOUTS:
        kinds, mamba_blocks, spec_blocks = MAMBA_LAYOUTS[layout]
        attention = layer_spec("full", block_size)
        mbs = max_model_len if mamba_blocks is None else mamba_blocks * block_size
        mamba = mamba_spec(mbs, attention, spec_blocks)
        layers = {f"layer.{i}": mamba if k == "mamba" else attention for i, k in enumerate(kinds)}
        return driver.kv_cache_groups(layers)
    if layout in MAMBA_ALIGN_LAYOUTS:
        kinds, spec_blocks, checkpoint = MAMBA_ALIGN_LAYOUTS[layout]
        attention = layer_spec("full", block_size)
        mamba = mamba_spec(block_size, attention, spec_blocks, "align", checkpoint)
        layers = {f"layer.{i}": mamba if k == "mamba" else attention for i, k in enumerate(kinds)}
        return driver.kv_cache_groups(layers)
    if layout in MIXED_LAYOUTS:
        layers = {
            f"layer.{i}": layer_spec(k, block_size * scale)
            for i, (k, scale) in enumerate(MIXED_LAYOUTS[layout])
        }
        tagged = driver.with_extra_retained_tokens(layers, prefill_lookahead)
        return [KVCacheGroupSpec([name], spec) for name, spec in tagged.items()]
    kinds = LONE_ATTENTION_LAYOUTS.get(layout) or HYBRID_LAYOUTS[layout]
    specs = {f"layer.{i}": layer_spec(k, block_size) for i, k in enumerate(kinds)}
    groups = driver.kv_cache_groups(specs, prefill_lookahead)
    assert len(groups) > 1 or layout in LONE_GROUP_LAYOUTS, layout
    return groups


def kv_cache_config(
    num_blocks: int,
    block_size: int,
    layout: str = "",
    retention: Optional[int] = None,
    max_model_len: int = 4096,
    eagle_groups: Sequence[int] = (),
    prefill_lookahead: int = 0,
) -> KVCacheConfig:
    """``retention``: ``prefix_cache_retention_interval`` (``None``, dense, is
    ``KVCacheConfig``'s default; vLLM's engines default to 0). ``eagle_groups``: the groups
    flagged ``is_eagle_group`` (an EAGLE drafter's layers). ``prefill_lookahead``: vLLM's
    ``num_prefill_lookahead_tokens`` (multi-module MTP tags the windows)."""
    if layout:
        groups = hybrid_groups(layout, block_size, max_model_len, prefill_lookahead)
    else:
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32
        )
        groups = [KVCacheGroupSpec(["layer.0"], spec)]
    for i in eagle_groups:
        groups[i].is_eagle_group = True
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=retention,
    )


def manager_pair(
    num_blocks: int,
    block_size: int,
    layout: str = "",
    retention: Optional[int] = None,
    eagle_groups: Sequence[int] = (),
    **kw: Any,
) -> tuple:
    max_model_len = kw.pop("max_model_len", 4096)
    sbs, hbs = block_sizes(layout, block_size, max_model_len)
    args = dict(max_model_len=max_model_len, scheduler_block_size=sbs, hash_block_size=hbs, **kw)
    shape = (layout, retention, max_model_len, eagle_groups, kw.get("num_prefill_lookahead") or 0)
    cfg = kv_cache_config(num_blocks, block_size, *shape)
    ours = PagedManager(cfg, **args)
    if layout:
        from pagedkv.vllm_v1._hybrid import HybridKVCacheManager

        assert type(ours) is HybridKVCacheManager, "expected the native hybrid manager"
    else:
        assert type(ours) is PagedManager, "expected the native manager in scope"
    theirs = kv_cache_config(num_blocks, block_size, *shape)
    return VLLMManager(theirs, **args), ours


def mamba_splitter(
    layout: str, block_size: int, eagle_drop: bool = False, lookahead: int = 0
) -> Any:
    """For a Mamba "align" layout, what vLLM's scheduler reads when it splits a prefill at
    block boundaries (``need_mamba_block_aligned_split``), for its own split method (with
    EAGLE's block drop, ``use_eagle_block_drop``, or 0.33's lookahead hashes); else
    ``None``."""
    if layout not in MAMBA_ALIGN_LAYOUTS:
        return None
    checkpoint = MAMBA_ALIGN_LAYOUTS[layout][2]
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block_size),
        block_size=block_size,
        hash_block_size=block_size,
        mamba_partial_cache_hit=False,
        use_eagle_block_drop=eagle_drop,
        num_hash_lookahead_tokens=lookahead,
        mamba_has_prefill_checkpoint_blocks=checkpoint > 0,
        mamba_prefill_checkpoint_alignment=checkpoint or None,
        max_num_scheduled_tokens=8192,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        mamba_shared_prefix_checkpoint=False,
    )


def event_repr(e: Any) -> tuple:
    fields = getattr(type(e), "__struct_fields__", ())
    return (
        (type(e).__name__,)
        + tuple((f, repr(getattr(e, f))) for f in fields)
        + (
            ("kind", getattr(e, "kv_cache_spec_kind", None)),
            ("window", getattr(e, "kv_cache_spec_sliding_window", None)),
        )
    )


def stats_repr(s: Any) -> Any:
    return None if s is None else repr(vars(s))


@dataclass
class Driver:
    seed: int
    num_blocks: int
    block_size: int
    caching: bool
    events: bool
    hash_algo: str = "sha256"
    watermark: float = 0.0
    max_model_len: int = 4096
    layout: str = ""
    #: ``prefix_cache_retention_interval`` of both managers.
    retention: Optional[int] = None
    #: The managers' ``use_eagle`` and the groups flagged ``is_eagle_group``.
    use_eagle: bool = False
    eagle_groups: Sequence[int] = ()
    #: vLLM 0.33's ``num_hash_lookahead_tokens``: the requests' hasher and both managers.
    lookahead: int = 0
    #: Both managers' ``num_prefill_lookahead`` (multi-module MTP: its draft tokens).
    prefill_lookahead: int = 0
    #: A KV connector's part: admissions with external tokens, loaded synchronously or
    #: asynchronously (blocks cached when the load finishes; some loads fail part way).
    connector: bool = False
    rng: random.Random = field(init=False)
    live: Dict[str, Request] = field(default_factory=dict)
    #: Requests waiting for an asynchronous KV load (``WAITING_FOR_REMOTE_KVS``).
    loading: Dict[str, Request] = field(default_factory=dict)
    #: Admissions that took external tokens (a connector run asserts some did).
    external_admissions: int = 0
    deferred: List[tuple] = field(default_factory=list)
    counter: int = 0
    ops: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        hash_fn = get_hash_fn_by_name(self.hash_algo)
        kv_cache_utils.init_none_hash(hash_fn)
        ahead = dict(num_hash_lookahead_tokens=self.lookahead) if self.lookahead else {}
        self.hasher = kv_cache_utils.get_request_block_hasher(self.block_size, hash_fn, **ahead)
        self.vllm, self.ours = manager_pair(
            self.num_blocks,
            self.block_size,
            self.layout,
            self.retention,
            self.eagle_groups,
            use_eagle=self.use_eagle,
            enable_caching=self.caching,
            enable_kv_cache_events=self.events,
            log_stats=True,
            watermark=self.watermark,
            max_model_len=self.max_model_len,
            num_prefill_lookahead=self.prefill_lookahead,
            **ahead,
        )
        self.splitter = mamba_splitter(self.layout, self.block_size, self.use_eagle, self.lookahead)
        self.prefixes = [
            [self.rng.randrange(50) for _ in range(self.rng.randrange(1, 4 * self.block_size))]
            for _ in range(3)
        ]
        self.sent: List[List[int]] = []

    # --- operations ------------------------------------------------------------------------
    def new_request(self) -> Request:
        self.counter += 1
        prompt = list(self.rng.choice(self.prefixes)) if self.rng.random() < 0.7 else []
        prompt += [
            self.rng.randrange(50) for _ in range(self.rng.randrange(1, 3 * self.block_size))
        ]
        prompt = prompt[: self.max_model_len - 8]
        if self.layout:
            # Hybrid: some prompts are resent as they were (hits end at a replay boundary).
            if self.sent and self.rng.random() < 0.2:
                prompt = list(self.rng.choice(self.sent))
            self.sent = (self.sent + [prompt])[-8:]
        extra = None
        if self.layout and self.rng.random() < 0.2:
            # vLLM's "full" report mode: BlockStored events for the prefix-cache hits too.
            extra = {"kv_cache_report_mode": "full"}
        return Request(
            request_id=f"r{self.counter}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=64, extra_args=extra),
            pooling_params=None,
            cache_salt=self.rng.choice([None, None, None, "tenant-a"]),
            block_hasher=self.hasher,
        )

    def both(self, name: str, *args: Any, **kw: Any) -> Any:
        a = getattr(self.vllm, name)(*args, **kw)
        b = getattr(self.ours, name)(*args, **kw)
        return a, b

    def admit(self, req: Request) -> None:
        (hit_a, n_a, junction_a), (hit_b, n_b, junction_b) = self.both("get_computed_blocks", req)
        assert hit_a.get_block_ids() == hit_b.get_block_ids(), "prefix-cache hits differ"
        assert (n_a, junction_a) == (n_b, junction_b)
        # The scheduler keeps the junction on the request (sparse retention caches around it).
        req.shared_prefix_boundary = junction_a
        if self.layout and n_a and self.rng.random() < 0.3:
            step = self.block_size * scheduler_scale(self.layout)
            k = self.rng.randrange(n_a // step + 1) * step
            a, b = (
                m.truncate_computed_blocks(h, k)
                for m, h in ((self.vllm, hit_a), (self.ours, hit_b))
            )
            assert a.get_block_ids() == b.get_block_ids(), "truncated hits differ"
        remaining = req.num_tokens - req.num_computed_tokens - n_a
        ext, load_async = self.connector_tokens(remaining, req.num_computed_tokens + n_a)
        rest = remaining - ext
        chunk = max(1, min(rest, self.rng.choice([rest, self.block_size, 7, 1])))
        chunk = 0 if load_async else self.split(req, chunk, rest, n_a)
        kw = dict(
            num_external_computed_tokens=ext,
            delay_cache_blocks=load_async,
            num_new_computed_tokens=n_a,
            num_lookahead_tokens=self.rng.choice([0, 0, 2]),
            full_sequence_must_fit=self.rng.random() < 0.2,
            reserved_blocks=self.rng.choice([0, 0, 0, 1, 3]),
            has_scheduled_reqs=bool(self.live) or self.rng.random() < 0.3,
        )
        a = self.vllm.allocate_slots(req, chunk, new_computed_blocks=hit_a, **kw)
        b = self.ours.allocate_slots(req, chunk, new_computed_blocks=hit_b, **kw)
        self.same_result(a, b)
        if a is not None:
            for m in (self.vllm, self.ours):
                m.record_prefix_cache_stats(req, n_a)
            req.num_computed_tokens += n_a + ext + chunk
            self.external_admissions += ext > 0
            if load_async:
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.loading[req.request_id] = req
            else:
                req.status = RequestStatus.RUNNING
                self.live[req.request_id] = req

    def admitted(self, req: Request) -> bool:
        """Whether the request holds blocks now (running, or waiting for its KV load)."""
        return req.request_id in self.live or req.request_id in self.loading

    def connector_tokens(self, remaining: int, local: int) -> tuple:
        """(external tokens, loaded asynchronously) a connector offers for ``remaining``
        uncomputed tokens past ``local`` computed ones: none half the time; an asynchronous
        load may cover every token (a decode instance's prefill done remotely), a synchronous
        one leaves at least one to compute. A third of the offers end on a boundary of two
        blocks (a chunked local layout's chunk then skips every external token)."""
        if not self.connector or remaining < 2 or self.rng.random() < 0.5:
            return 0, False
        load_async = self.rng.random() < 0.4
        most = remaining if load_async else remaining - 1
        chunk = 2 * self.block_size
        boundaries = [e for e in range(1, most + 1) if (local + e) % chunk == 0]
        if boundaries and self.rng.random() < 0.33:
            return self.rng.choice(boundaries), load_async
        return self.rng.randrange(1, most + 1), load_async

    def finish_load(self, req: Request) -> None:
        """An asynchronous load ends as vLLM's scheduler ends it: aborted (freed), failed
        from some block on (its valid prefix cached, or freed and readmitted when nothing
        is valid), or done (the loaded blocks cached); then the request runs."""
        del self.loading[req.request_id]
        r = self.rng.random()
        if r < 0.1:
            self.both("free", req)
            return
        if r < 0.3:
            step = self.block_size * scheduler_scale(self.layout)  # the scheduler's block
            valid_blocks = self.rng.randrange(req.num_computed_tokens // step + 1)
            req.num_computed_tokens = valid_blocks * step
            if not req.num_computed_tokens:
                self.both("free", req)
                req.status = RequestStatus.WAITING
                self.waiting.append(req)
                return
        self.both("cache_blocks", req, req.num_computed_tokens)
        req.status = RequestStatus.RUNNING
        self.live[req.request_id] = req

    def step(self, req: Request) -> None:
        """One scheduled step of a running request: the rest of its prefill or one decode."""
        remaining = req.num_tokens - req.num_computed_tokens
        if self.layout and req.num_tokens >= self.max_model_len:
            # vLLM's scheduler stops a request at max_model_len (the hybrid core refuses
            # computed tokens past it; the one-group manager caps them).
            self.finish(req)
            return
        if remaining <= 0:
            req.append_output_token_ids(self.rng.randrange(50))
            remaining = 1
        n = min(remaining, self.rng.choice([remaining, self.block_size, 1]))
        n = self.split(req, n, remaining)
        look = self.rng.choice([0, 0, 1, 3])
        a, b = self.both("allocate_slots", req, n, num_lookahead_tokens=look)
        self.same_result(a, b)
        if a is None:
            self.preempt(req)
        else:
            req.num_computed_tokens += n

    def split(self, req: Request, n: int, remaining: int, hit: int = 0) -> int:
        """Mamba "align" layouts: the chunk vLLM's scheduler makes of ``n`` new tokens
        (its own ``_mamba_block_aligned_split``); one it would put off (0 tokens) becomes the
        split of the whole rest."""
        if self.splitter is None:
            return n
        from vllm.v1.core.sched.scheduler import Scheduler

        split = Scheduler._mamba_block_aligned_split
        return split(self.splitter, req, n, hit) or split(self.splitter, req, remaining, hit)

    def preempt(self, req: Request) -> None:
        self.both("free", req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        del self.live[req.request_id]
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        del self.live[req.request_id]
        if self.rng.random() < 0.3:
            pa, pb = self.both("pop_blocks_for_free", req)
            assert [x.block_id for x in pa] == [x.block_id for x in pb]
            self.deferred.append((pa, pb))
        else:
            self.both("free", req)

    def drain_deferred(self) -> None:
        for pa, pb in self.deferred:
            self.vllm.block_pool.free_blocks(reversed(pa))
            self.ours.block_pool.free_blocks(reversed(pb))
        self.deferred.clear()

    # --- checks ----------------------------------------------------------------------------
    def same_result(self, a: Any, b: Any) -> None:
        assert (a is None) == (b is None), f"allocate_slots: vLLM {a!r}, pagedkv {b!r}"
        if a is not None:
            assert a.get_block_ids() == b.get_block_ids(), "new blocks differ"
            assert (a is self.vllm.empty_kv_cache_blocks) == (b is self.ours.empty_kv_cache_blocks)

    def compare(self) -> None:
        v, o = self.vllm, self.ours
        assert v.block_pool.get_num_free_blocks() == o.block_pool.get_num_free_blocks()
        assert v.usage == o.usage
        # The blocks to zero (Mamba layouts: every attention block handed out; else none).
        assert v.take_new_block_ids() == o.take_new_block_ids(), "blocks to zero differ"
        for rid, req in {**self.live, **self.loading}.items():
            assert v.get_block_ids(rid) == o.get_block_ids(rid), f"table of {rid}"
            assert v.get_blocks(rid).get_block_ids() == o.get_blocks(rid).get_block_ids()
            assert v.estimate_cached_tokens(req) == o.estimate_cached_tokens(req)
        ev_a, ev_b = (
            [event_repr(e) for e in v.take_events()],
            [event_repr(e) for e in o.take_events()],
        )
        assert ev_a == ev_b, f"events differ:\n{ev_a}\n{ev_b}"
        if self.rng.random() < 0.1:
            assert stats_repr(v.make_prefix_cache_stats()) == stats_repr(
                o.make_prefix_cache_stats()
            )

    def check_views(self) -> None:
        """Blocks read through ``get_blocks`` show vLLM's ref counts and hashes."""
        for rid in list(self.live)[:3]:
            pairs = zip(self.vllm.get_blocks(rid).blocks, self.ours.get_blocks(rid).blocks)
            for x, y in (p for ga, gb in pairs for p in zip(ga, gb)):
                if x.is_null:  # vLLM does not maintain the null block's ref count (0.32: < 0)
                    assert y.is_null and y.block_id == x.block_id
                    continue
                assert (x.block_id, x.ref_cnt, x.block_hash, x.block_hash_num_tokens) == (
                    y.block_id,
                    y.ref_cnt,
                    y.block_hash,
                    y.block_hash_num_tokens,
                )

    def run(self, n_ops: int) -> None:
        self.waiting: List[Request] = []
        for _ in range(n_ops):
            self.one_op()
            self.compare()
        self.check_views()
        for req in list(self.loading.values()):
            self.finish_load(req)
        for req in list(self.live.values()):
            self.finish(req)
        self.drain_deferred()
        self.compare()
        assert self.vllm.block_pool.get_num_free_blocks() == self.num_blocks - 1

    def one_op(self) -> None:
        if self.splitter is not None and self.rng.random() < 0.4:
            # A new scheduler step: Mamba forgets the states it cached during the last one.
            self.both("new_step_starts")
        if self.loading and self.rng.random() < 0.15:
            self.finish_load(self.rng.choice(list(self.loading.values())))
            return
        r = self.rng.random()
        if r < 0.3 or not self.live:
            if self.waiting and self.rng.random() < 0.5:
                req = self.waiting.pop(0)
                self.admit(req)
                if not self.admitted(req):
                    self.waiting.insert(0, req)
            else:
                req = self.new_request()
                self.admit(req)
                if not self.admitted(req):
                    self.waiting.append(req)
        elif r < 0.75:
            self.step(self.rng.choice(list(self.live.values())))
        elif r < 0.88:
            self.finish(self.rng.choice(list(self.live.values())))
        elif r < 0.93:
            self.drain_deferred()
        elif r < 0.97:
            ids = {self.rng.randrange(self.num_blocks) for _ in range(3)}
            if self.rng.random() < 0.5:
                self.both("evict_blocks", ids)
            else:  # a connector's path: through the block pool, same events
                self.vllm.block_pool.evict_blocks(ids)
                self.ours.block_pool.evict_blocks(ids)
        elif r < 0.985 or not self.layout:
            a, b = self.both("reset_prefix_cache")
            assert a == b
        else:
            self.hybrid_reads()

    def hybrid_reads(self) -> None:
        """Calls vLLM's scheduler makes on a hybrid manager besides allocation."""
        req = self.rng.choice(list(self.live.values()))
        n = req.num_computed_tokens
        a, b = self.both("get_block_ids_for_computed_tokens", req.request_id, n)
        assert a == b
        k = self.rng.randrange(n + 1)
        self.both("remove_skipped_blocks", req.request_id, k)
        assert self.vllm.get_num_common_prefix_blocks(req.request_id) == (
            self.ours.get_num_common_prefix_blocks(req.request_id)
        )
