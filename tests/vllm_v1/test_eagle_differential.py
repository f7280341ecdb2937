"""EAGLE/MTP (``use_eagle``, groups flagged ``is_eagle_group``): pagedkv's native managers
against vLLM's own, call by call (``manager_driver``), one group and hybrid, on the installed
release. The drop set differs between releases: a flagged group without ``use_eagle`` drops
in 0.32, not in 0.33; both are compared here as they are."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import pytest
from manager_driver import (
    HASH_ALGOS,
    HYBRID_LAYOUTS,
    MAMBA_ALIGN_LAYOUTS,
    MIXED_LAYOUTS,
    RETENTIONS,
    Driver,
    hybrid_groups,
    kv_cache_config,
    manager_pair,
    retention_interval,
)
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMManager

from pagedkv.vllm_v1 import KVCacheManager as PagedManager
from pagedkv.vllm_v1._version import require_supported_vllm

#: The installed vLLM has lookahead block hashes (0.33).
HAS_LOOKAHEAD = "num_hash_lookahead_tokens" in (
    kv_cache_utils.get_request_block_hasher.__code__.co_varnames
)

#: (use_eagle, which groups are flagged ``is_eagle_group``): vLLM's fallback to every group,
#: a flagged subset, and a flagged group without ``use_eagle`` (the releases differ there).
EAGLE_MODES = ((True, "none"), (True, "last"), (True, "first"), (False, "last"))

#: Hybrid layouts EAGLE runs natively on (a chunked local group stays vLLM's: its lookup
#: asserts against EAGLE).
EAGLE_LAYOUTS = sorted(k for k in HYBRID_LAYOUTS if k != "llama4") + sorted(MIXED_LAYOUTS)


def flagged(which: str, num_groups: int) -> Sequence[int]:
    return {"none": (), "last": (num_groups - 1,), "first": (0,)}[which]


def twin_requests(num_tokens: int, max_tokens: int, hasher: Any) -> List[Any]:
    """Two identical requests ``r`` (tokens 0, 1, ...), one for vLLM's manager, one for
    pagedkv's."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return [
        Request(
            request_id="r",
            prompt_token_ids=list(range(num_tokens)),
            sampling_params=SamplingParams(max_tokens=max_tokens),
            pooling_params=None,
            block_hasher=hasher,
        )
        for _ in range(2)
    ]


@pytest.mark.parametrize("seed", range(24))
def test_eagle_random_calls_match_vllm(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One full-attention group: a hit drops its last block (when the group is in the
    release's drop set), through admissions, chunked prefill, lookahead slots, preemption,
    frees, evictions and resets."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    use_eagle, which = EAGLE_MODES[seed % len(EAGLE_MODES)]
    Driver(
        seed=seed,
        num_blocks=8 + seed % 40,
        block_size=(4, 8, 16)[seed % 3],
        caching=seed % 6 != 5,
        events=seed % 2 == 0,
        hash_algo=HASH_ALGOS[seed % len(HASH_ALGOS)],
        watermark=(0.0, 0.0, 0.1)[seed % 3],
        use_eagle=use_eagle,
        eagle_groups=flagged(which, 1),
    ).run(300)


def eagle_hybrid_driver(seed: int, layouts: Sequence[str] = EAGLE_LAYOUTS) -> Driver:
    layout = layouts[seed % len(layouts)]
    block_size = (4, 8, 16)[seed % 3]
    mode = RETENTIONS[seed // len(layouts) % len(RETENTIONS)]
    use_eagle, which = EAGLE_MODES[seed // 3 % len(EAGLE_MODES)]
    num_groups = len(hybrid_groups(layout, block_size))
    args: Dict[str, Any] = dict(
        seed=seed,
        num_blocks=12 + seed % 50,
        block_size=block_size,
        caching=seed % 8 != 7,
        events=seed % 2 == 0,
        hash_algo=HASH_ALGOS[seed % len(HASH_ALGOS)],
        watermark=(0.0, 0.0, 0.1)[seed % 3],
        layout=layout,
        retention=retention_interval(mode, layout, block_size),
        use_eagle=use_eagle,
        eagle_groups=flagged(which, num_groups),
    )
    return Driver(**args)


@pytest.mark.parametrize("seed", range(60))
def test_eagle_hybrid_random_calls_match_vllm(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-OSS-, Gemma-3-like, two-window and mixed-block layouts under each retention mode:
    the coordinator's EAGLE margin and once-per-length drop, the sliding window's extra
    block, caching one block past the boundary, the peek block and EAGLE's replay
    boundaries (and, 0.33, the junction one block lower) in sparse retention."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0" if seed % 5 == 1 else "1")
    eagle_hybrid_driver(seed).run(300)


@pytest.mark.parametrize("seed", range(24))
def test_eagle_lone_window_random_calls_match_vllm(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone sliding-window group (every layer a window) under EAGLE: vLLM's unitary
    coordinator looks up once, dropping the last block without the hybrid coordinator's
    margin past the candidate; every drop mode and retention, call by call."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    eagle_hybrid_driver(seed, ["swa-only"]).run(300)


def eagle_align_driver(seed: int) -> Driver:
    """A Mamba "align" layout (Qwen3-Next with MTP, Nemotron-H or Granite 4 with an EAGLE
    drafter, pure Mamba-2) under one of EAGLE's drop modes and a retention mode."""
    layouts = sorted(MAMBA_ALIGN_LAYOUTS)
    layout = layouts[seed % len(layouts)]
    block_size = (4, 8, 16)[seed % 3]
    use_eagle, which = EAGLE_MODES[seed // len(layouts) % len(EAGLE_MODES)]
    return Driver(
        seed=seed,
        num_blocks=12 + seed % 50,
        block_size=block_size,
        caching=True,
        events=seed % 2 == 0,
        hash_algo=HASH_ALGOS[seed % len(HASH_ALGOS)],
        watermark=(0.0, 0.0, 0.1)[seed % 3],
        max_model_len=(4096, 256)[seed % 4 == 3],
        layout=layout,
        retention=(None, 0, 3 * block_size)[seed % 3],
        use_eagle=use_eagle,
        eagle_groups=flagged(which, len(hybrid_groups(layout, block_size))),
    )


@pytest.mark.parametrize("seed", range(36))
def test_eagle_mamba_align_random_calls_match_vllm(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EAGLE/MTP beside Mamba groups in "align" mode, prefills split as vLLM's scheduler
    splits them with EAGLE's drop: the checkpoints one block below the replay boundary
    (``drop_eagle_checkpoint_block``), the Mamba lookup without the coordinator's margin
    (its finder never drops), caching one block past the boundary in a dropping group,
    retention's replay boundaries and junctions without the window's peek shift; hybrid
    layouts and the lone Mamba-2 group, every drop mode, call by call."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0" if seed % 5 == 1 else "1")
    eagle_align_driver(seed).run(300)


def test_eagle_align_seeds_cover_every_layout_mode_and_retention() -> None:
    seen = set()
    for seed in range(36):
        d = eagle_align_driver(seed)
        seen.add((d.layout, d.use_eagle, bool(d.eagle_groups)))
        seen.add((d.layout, d.retention))
    for layout in MAMBA_ALIGN_LAYOUTS:
        for mode in ((True, False), (True, True), (False, True)):
            assert (layout, *mode) in seen, (layout, mode)
        assert (layout, None) in seen and (layout, 0) in seen, layout


def mtp_driver(seed: int) -> Driver:
    """Multi-module MTP (a prefill lookahead of 2 to 4, at most the block size, as vLLM's
    coordinator requires with EAGLE and caching): one group and hybrid layouts (Mamba "align"
    ones included), each drop mode, each retention, on 0.33 with or without lookahead hashes
    of the same length (its default: ``num_hash_lookahead_tokens`` = the prefill lookahead)."""
    layouts = [""] + EAGLE_LAYOUTS + sorted(MAMBA_ALIGN_LAYOUTS)
    layout = layouts[seed % len(layouts)]
    block_size = (4, 8, 16)[seed % 3]
    use_eagle, which = EAGLE_MODES[seed // 3 % len(EAGLE_MODES)]
    num_groups = len(hybrid_groups(layout, block_size)) if layout else 1
    prefill_lookahead = (2, 3, 4)[seed // 2 % 3]
    # vLLM's own lookup over a lone Mamba "align" group indexes past the hashes when they
    # look more than one token ahead (test_vllms_lone_align_lookup_past_lookahead_hashes).
    hashes_ahead = HAS_LOOKAHEAD and seed % 4 == 1 and layout != "mamba2-align"
    return Driver(
        seed=seed,
        num_blocks=12 + seed % 50,
        block_size=block_size,
        # Align mode comes only with prefix caching (vLLM's model config pairs them).
        caching=seed % 8 != 7 or layout in MAMBA_ALIGN_LAYOUTS,
        events=seed % 2 == 0,
        hash_algo=HASH_ALGOS[seed % len(HASH_ALGOS)],
        watermark=(0.0, 0.0, 0.1)[seed % 3],
        layout=layout,
        retention=retention_interval(RETENTIONS[seed % len(RETENTIONS)], layout, block_size)
        if layout
        else None,
        # vLLM's scheduler passes use_eagle=False with lookahead hashes (no drop).
        use_eagle=use_eagle and not hashes_ahead,
        eagle_groups=flagged(which, num_groups),
        lookahead=prefill_lookahead if hashes_ahead else 0,
        prefill_lookahead=prefill_lookahead,
    )


@pytest.mark.parametrize("seed", range(48))
def test_multi_module_mtp_random_calls_match_vllm(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Multi-module MTP's re-prefillable tokens (``num_prefill_lookahead - 1``): the unitary
    coordinator caches only the finalized tokens, the hybrid one only in EAGLE groups (the
    others round the computed tokens down as before), through admissions, chunked prefill,
    preemption, frees, evictions and resets, call by call, events compared."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    mtp_driver(seed).run(300)


@pytest.mark.parametrize("layout", ["", "gpt-oss"])
def test_a_prefill_lookahead_above_the_block_is_refused_as_vllm_refuses_it(layout: str) -> None:
    """With prefix caching and an EAGLE group, vLLM's coordinator refuses a prefill lookahead
    above the scheduler block size (a ``ValueError``); pagedkv's managers refuse it the same
    way (``InvalidArgumentError``, a ``ValueError``); without caching both accept it."""
    from pagedkv.errors import InvalidArgumentError

    for caching in (True, False):
        cfg = kv_cache_config(16, 4, layout, None, 256, ())
        kw = dict(max_model_len=256, enable_caching=caching, use_eagle=True)
        kw.update(scheduler_block_size=4, hash_block_size=4, num_prefill_lookahead=5)
        if not caching:
            assert PagedManager(cfg, **kw).block_size == 4
            continue
        with pytest.raises(ValueError, match="scheduler_block_size") as vllms:
            VLLMManager(cfg, **kw)
        with pytest.raises(InvalidArgumentError, match="scheduler_block_size") as ours:
            PagedManager(cfg, **kw)
        assert "(=4)" in str(vllms.value) and "(=4)" in str(ours.value)


def test_eagle_seeds_cover_every_layout_mode_and_retention() -> None:
    seen = set()
    for seed in range(60):
        d = eagle_hybrid_driver(seed)
        seen.add((d.layout, d.use_eagle, bool(d.eagle_groups)))
        seen.add((d.layout, d.retention is None, d.retention == 0))
    for layout in EAGLE_LAYOUTS:
        assert (layout, True, False) in seen and (layout, True, True) in seen, layout
        assert (layout, False, True) in seen, layout


@pytest.mark.parametrize("use_eagle,which", EAGLE_MODES)
def test_the_native_manager_takes_each_releases_drop_set(use_eagle: bool, which: str) -> None:
    """The native manager serves EAGLE (no fallback) and drops for the groups vLLM's
    coordinator drops for, on the installed release."""
    v032 = require_supported_vllm() == "0.32.0"
    vllm, ours = manager_pair(16, 4, eagle_groups=flagged(which, 1), use_eagle=use_eagle)
    expected = use_eagle or v032
    assert ours._native.drops_eagle_block is expected
    assert ours.coordinator.drop_eagle_group_ids == ({0} if expected else set())
    assert vllm.coordinator.single_type_managers[0].use_eagle == (
        expected if not v032 else vllm.coordinator.single_type_managers[0].use_eagle
    )
    vllm, ours = manager_pair(
        24, 4, "gpt-oss", 0, eagle_groups=flagged(which, 2), use_eagle=use_eagle
    )
    drops = [vllm.coordinator.single_type_managers[i].use_eagle for i in range(2)]
    assert ours._native.eagle_groups == drops
    assert ours.coordinator.eagle_group_ids == vllm.coordinator.eagle_group_ids


def test_eagle_with_a_chunked_local_group_stays_vllms() -> None:
    """vLLM's chunked local lookup asserts against EAGLE: that layout keeps vLLM's manager."""
    cfg = kv_cache_config(24, 4, "llama4", 0)
    m = PagedManager(
        cfg, max_model_len=4096, scheduler_block_size=4, hash_block_size=4, use_eagle=True
    )
    assert type(m) is VLLMManager


@pytest.mark.parametrize("layout", ["", "gpt-oss", "gemma3"])
def test_a_planted_eagle_difference_is_caught(layout: str) -> None:
    """pagedkv built without EAGLE while vLLM drops: the call-by-call comparison fails."""
    failures = 0
    for seed in range(6):
        d = Driver(
            seed=seed,
            num_blocks=40,
            block_size=4,
            caching=True,
            events=False,
            layout=layout,
            retention=0 if layout else None,
            use_eagle=True,
        )
        _, d.ours = manager_pair(
            40,
            4,
            layout,
            d.retention,
            enable_caching=True,
            enable_kv_cache_events=False,
            log_stats=True,
            max_model_len=4096,
        )
        try:
            d.run(150)
        except AssertionError:
            failures += 1
    assert failures >= 4, failures


#: vLLM 0.33's lookahead block hashes (``num_hash_lookahead_tokens``); 0.32 has none.
LOOKAHEAD = pytest.mark.lookahead_hashes  # deselected where vLLM has none (conftest.py)


@LOOKAHEAD
@pytest.mark.parametrize("seed", range(16))
def test_lookahead_hashes_with_mamba_align_match_vllm(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0.33's lookahead block hashes beside Mamba "align" groups (EAGLE with prefix caching
    by default: no drop): the checkpoints read the lookahead (one token or, as multi-module
    MTP would, three), prefills split as vLLM's scheduler splits them; blocks, hits and
    events call by call."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if seed % 3 else "0")
    lookahead_driver(seed, sorted(MAMBA_ALIGN_LAYOUTS)).run(300)


@LOOKAHEAD
@pytest.mark.parametrize("seed", range(16))
def test_lookahead_hashes_match_vllm(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """EAGLE with prefix caching on 0.33: the scheduler turns the drop off and the requests'
    hashes cover the next token (or, with 3, three): blocks, hits and events (extra keys over
    the block and its lookahead tokens, ``lookahead_token_ids``) as vLLM's, call by call, one
    group and hybrid layouts; a quarter of the requests carry a cache salt (the Python
    builder's events), the rest are built natively."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if seed % 3 else "0")
    lookahead_driver(seed, [""] + EAGLE_LAYOUTS).run(300)


def lookahead_driver(seed: int, layouts: Sequence[str]) -> Driver:
    """Lookahead hashes of one token (three for one seed in four: multi-module MTP's; not over
    a lone Mamba "align" group, whose lookup in vLLM then fails,
    :func:`test_vllms_lone_align_lookup_past_lookahead_hashes`), the last group flagged, no
    drop, events on, one of ``layouts`` under one of the retention modes."""
    layout = layouts[seed % len(layouts)]
    block_size = (4, 8, 16)[seed % 3]
    num_groups = len(hybrid_groups(layout, block_size)) if layout else 1
    return Driver(
        seed=seed,
        num_blocks=16 + seed % 40,
        block_size=block_size,
        caching=True,
        events=True,
        hash_algo=HASH_ALGOS[seed % len(HASH_ALGOS)],
        layout=layout,
        retention=retention_interval(RETENTIONS[seed % len(RETENTIONS)], layout, block_size)
        if layout
        else None,
        eagle_groups=flagged("last", num_groups),
        lookahead=3 if seed % 4 == 3 and layout != "mamba2-align" else 1,
    )


@LOOKAHEAD
def test_lookahead_events_carry_the_next_tokens() -> None:
    """A prompt of two full blocks: its first block is hashed (the next token exists), its
    second is not (none follows it); the native manager's ``BlockStored`` lists that next
    token and equals vLLM's."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    kv_cache_utils.init_none_hash(sha256)
    hasher = kv_cache_utils.get_request_block_hasher(4, sha256, num_hash_lookahead_tokens=1)
    vllm, ours = manager_pair(
        16, 4, enable_caching=True, enable_kv_cache_events=True, num_hash_lookahead_tokens=1
    )
    assert ours.block_pool.num_hash_lookahead_tokens == 1
    events = []
    for m in (vllm, ours):
        req = Request(
            request_id="r",
            prompt_token_ids=list(range(8)),
            sampling_params=SamplingParams(max_tokens=4),
            pooling_params=None,
            block_hasher=hasher,
        )
        assert len(req.block_hashes) == 1
        hit, n, _ = m.get_computed_blocks(req)
        assert m.allocate_slots(req, 8, num_new_computed_tokens=n, new_computed_blocks=hit)
        events.append(m.take_events())
    (theirs,), (mine,) = events
    assert mine.lookahead_token_ids == [[4]] and mine.token_ids == [0, 1, 2, 3]
    assert repr(mine) == repr(theirs)


@LOOKAHEAD
def test_vllms_lone_align_lookup_past_lookahead_hashes() -> None:
    """A vLLM bug pagedkv does not copy: over a lone Mamba "align" group (a pure Mamba-2 model
    with prefix caching) with hashes two tokens ahead (multi-module MTP's default on 0.33),
    vLLM's unitary lookup scans ``(num_tokens - 1) // block_size`` blocks, more than the
    request has hashes, and raises ``IndexError`` even on an empty cache. pagedkv's lookup
    stops at the hashes: no hit, nothing changed."""
    from vllm.utils.hashing import sha256

    kv_cache_utils.init_none_hash(sha256)
    hasher = kv_cache_utils.get_request_block_hasher(4, sha256, num_hash_lookahead_tokens=2)
    kw = dict(enable_caching=True, num_hash_lookahead_tokens=2, num_prefill_lookahead=2)
    vllm, ours = manager_pair(16, 4, "mamba2-align", None, (0,), use_eagle=False, **kw)
    reqs = twin_requests(9, 4, hasher)
    assert len(reqs[0].block_hashes) == 1  # the block ending at 8 needs tokens 8 and 9
    with pytest.raises(IndexError):
        vllm.get_computed_blocks(reqs[0])
    free = ours.block_pool.get_num_free_blocks()
    hit, n, _ = ours.get_computed_blocks(reqs[1])
    assert n == 0 and hit.get_block_ids() == ([],)
    assert ours.block_pool.get_num_free_blocks() == free


@LOOKAHEAD
@pytest.mark.parametrize("bad", [-1, 1.5, "1"])
def test_a_bad_lookahead_count_is_refused(bad: Any) -> None:
    from pagedkv.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        PagedManager(
            kv_cache_config(16, 4),
            max_model_len=4096,
            scheduler_block_size=4,
            hash_block_size=4,
            num_hash_lookahead_tokens=bad,
        )


@LOOKAHEAD
def test_a_planted_lookahead_difference_is_caught() -> None:
    """pagedkv's manager built without the lookahead while vLLM's has it: the events differ
    (no ``lookahead_token_ids``) and the comparison fails."""
    failures = 0
    for seed in range(4):
        d = Driver(seed=seed, num_blocks=40, block_size=4, caching=True, events=True, lookahead=1)
        _, d.ours = manager_pair(
            40, 4, enable_caching=True, enable_kv_cache_events=True, log_stats=True
        )
        try:
            d.run(100)
        except AssertionError:
            failures += 1
    assert failures == 4, failures


@pytest.mark.parametrize("prefill_lookahead", [1, 2, 4])
def test_mtp_windows_hold_their_extra_retained_tokens_as_vllm(prefill_lookahead: int) -> None:
    """Multi-module MTP tags every sliding window with ``num_prefill_lookahead - 1`` extra
    retained tokens (vLLM's planner): blocks leave the window that much later, and the
    full-sequence admission cap (``max_admission_blocks_per_request``) counts them. A
    GPT-OSS-like layout (window 8, blocks of 4) with 8 tokens in flight, a 40-token prompt
    admitted 3 tokens at a time: both managers agree on every refusal, every
    table (null blocks where the window let go) and every free count, and the window's
    first block stays held until the extra tokens have passed."""
    from vllm.utils.hashing import sha256

    kv_cache_utils.init_none_hash(sha256)
    hasher = kv_cache_utils.get_request_block_hasher(4, sha256)
    extra = prefill_lookahead - 1
    groups = hybrid_groups("gpt-oss", 4, 256, prefill_lookahead)
    assert [getattr(g.kv_cache_spec, "extra_retained_tokens", 0) for g in groups] == [0, extra]
    # 15 free blocks: the full sequence needs 10 full blocks and the window's cap, 5 blocks
    # (ceil((8 - 1 + 8) / 4) + 1), or 6 with 3 extra tokens: the 40-token prompt is refused
    # exactly when the cap counts them.
    kw = dict(enable_caching=True, use_eagle=True, max_in_flight_tokens=8)
    pair = manager_pair(16, 4, "gpt-oss", None, (), num_prefill_lookahead=prefill_lookahead, **kw)
    req = twin_requests(40, 16, hasher)
    fits = [m.allocate_slots(r, 3, full_sequence_must_fit=True) for m, r in zip(pair, req)]
    assert (fits[0] is None) == (fits[1] is None) == (extra >= 3)
    for computed in range(0, 39, 3):
        for r in req:
            r.num_computed_tokens = computed
        got = [m.allocate_slots(r, 3) for m, r in zip(pair, req)]
        assert got[0] is not None and got[1] is not None
        tables = [m.get_block_ids("r") for m in pair]
        assert tables[0] == tables[1]
        frees = [m.block_pool.get_num_free_blocks() for m in pair]
        assert frees[0] == frees[1]
        # Before this chunk the window let go of the blocks wholly below token
        # computed + 1 - 8 - extra (vLLM's get_num_skipped_tokens); the rest stay held.
        first_held = max(0, computed + 1 - 8 - extra) // 4
        window = tables[1][1]
        assert all(b == 0 for b in window[:first_held])
        assert all(b != 0 for b in window[first_held:])
