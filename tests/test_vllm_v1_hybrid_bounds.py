"""``_native.V1Hybrid`` (pagedkv's hybrid KV cache manager, several groups over one pool) driven
with out-of-range and inconsistent arguments at every entry, without vLLM: each refusal is a
pagedkv error that also derives from the matching builtin, and a refused call changes nothing
(the free queue, every table, every reference count and the pool's invariants)."""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import pytest

from pagedkv import _native
from pagedkv.errors import PagedKVError

HUGE = (2**32, 2**63, 2**64, 2**200)
BAD_COUNTS = (-1, -(2**64), *HUGE)
HASHES = [bytes([i]) * 32 for i in range(1, 9)]
GROUPS = [("full", 4, 0, 0), ("sliding_window", 4, 8, 1)]


def hybrid(**over: Any) -> Any:
    args = dict(
        num_blocks=32,
        groups=GROUPS,
        hash_block_size=4,
        scheduler_block_size=4,
        max_model_len=64,
        max_in_flight_tokens=64,
        enable_caching=True,
        enable_events=True,
        watermark_blocks=0,
        release="0.33",
    )
    args.update(over)
    return _native.V1Hybrid(**args)


def alloc(h: Any, rid: str, n: int, computed: Any = None, n_computed: int = 0) -> Any:
    """A waiting request's prefill of ``n`` new tokens after ``n_computed`` hit tokens."""
    total = n + n_computed
    args = (rid, 0, total, 0, True, n, n_computed, computed, 0, False, False, 0, False)
    return h.allocate_slots(*args, HASHES[: total // 4], total, 0)


def with_a_cached_request() -> Any:
    """Request ``a`` (12 tokens) allocated and cached: blocks 1-3 (full) and 4-6 (window)."""
    h = hybrid()
    assert alloc(h, "a", 12) == [[1, 2, 3], [4, 5, 6]]
    h.cache_blocks("a", 12, HASHES[:3], 12, 0)
    h.take_events()
    return h


def state(h: Any) -> Tuple[Any, ...]:
    h.check()
    refs = tuple(h.ref_cnt(b) for b in range(h.num_blocks))
    hashes = tuple(h.block_hash(b) for b in range(h.num_blocks))
    return (h.free_queue(), h.num_free_blocks(), h.block_ids("a"), refs, hashes)


def bad_hits() -> List[Tuple[str, Any, int]]:
    """(what, new_computed, num_new_computed_tokens) no lookup of vLLM's can return."""
    return [
        ("too few lists", [[1]], 4),
        ("too many lists", [[1], [0], []], 4),
        ("lists not covering the tokens", [[1], [0, 5]], 4),
        ("tokens without lists covering them", [[1, 2], [0, 5]], 4),
        ("a null block in full attention", [[0, 2], [0, 5]], 8),
        ("a null block after a real one", [[1, 2], [5, 0]], 8),
        ("another group's block", [[1, 5], [0, 5]], 8),
        ("a free uncached block", [[1, 30], [0, 5]], 8),
        ("a block past the pool", [[1, 32], [0, 5]], 8),
        ("a negative block", [[1, -1], [0, 5]], 8),
        ("a huge block", [[1, 2**64], [0, 5]], 8),
    ]


@pytest.mark.parametrize("what,computed,tokens", bad_hits(), ids=[w for w, _, _ in bad_hits()])
def test_a_hit_no_lookup_makes_is_refused_unchanged(what: str, computed: Any, tokens: int) -> None:
    h = with_a_cached_request()
    before = state(h)
    with pytest.raises(PagedKVError) as err:
        alloc(h, "b", 12 - tokens, computed, tokens)
    assert isinstance(err.value, (ValueError, IndexError, OverflowError, TypeError))
    assert state(h) == before
    assert h.block_ids("b") == [[], []]


def test_the_real_hit_is_still_adopted() -> None:
    """The refusals above leave vLLM's own hits alone: the lookup's blocks are adopted."""
    h = with_a_cached_request()
    blocks, tokens, _ = h.find_longest_cache_hit(HASHES[:3], 8)
    assert (blocks, tokens) == ([[1, 2], [4, 5]], 8)
    assert alloc(h, "b", 4, blocks, tokens) == [[7], [8]]
    assert h.block_ids("b") == [[1, 2, 7], [4, 5, 8]]
    assert h.ref_cnt(1) == 2 and h.ref_cnt(5) == 2
    h.check()


def test_a_running_request_cannot_adopt_a_hit() -> None:
    h = with_a_cached_request()
    before = state(h)
    with pytest.raises(PagedKVError, match="running"):
        alloc(h, "a", 4, [[1], [4]], 4)
    assert state(h) == before


def entry_cases(h: Any) -> List[Tuple[str, Callable[[], Any]]]:
    """Every public entry of ``h`` with an out-of-range value in each count or block id."""
    cases: List[Tuple[str, Callable[[], Any]]] = []
    for v in (-1, 32, *HUGE, -(2**64)):
        cases += [
            (f"ref_cnt({v})", lambda v=v: h.ref_cnt(v)),
            (f"block_hash({v})", lambda v=v: h.block_hash(v)),
            (f"hashed_tokens({v})", lambda v=v: h.hashed_tokens(v)),
            (f"is_free({v})", lambda v=v: h.is_free(v)),
            (f"cached_block(group={v})", lambda v=v: h.cached_block(HASHES[0], v)),
            (f"free_blocks([1, {v}])", lambda v=v: h.free_blocks([1, v])),
            (f"evict_blocks([1, {v}])", lambda v=v: h.evict_blocks([1, v])),
            (
                f"num_blocks_to_allocate({v})",
                lambda v=v: h.num_blocks_to_allocate("b", 8, [[v], [v]], 4),
            ),
        ]
    for v in BAD_COUNTS:
        cases += [
            (f"allocate_slots(num_tokens={v})", lambda v=v: alloc(h, "b", v)),
            (
                f"allocate_slots(num_computed={v})",
                lambda v=v: h.allocate_slots(
                    "a", v, 16, 0, False, 4, 0, None, 0, False, False, 0, False, HASHES
                ),
            ),
            (f"cache_blocks({v})", lambda v=v: h.cache_blocks("a", v, HASHES[:3], 12, 0)),
            (f"find_longest_cache_hit({v})", lambda v=v: h.find_longest_cache_hit(HASHES, v)),
            (f"remove_skipped_blocks({v})", lambda v=v: h.remove_skipped_blocks("a", v)),
        ]
    cases += [
        ("allocate_slots(nothing new)", lambda: alloc(h, "b", 0)),
        ("allocate_slots(past max_model_len)", lambda: alloc(h, "b", 4, None, 65)),
        ("find_longest_cache_hit(bad hashes)", lambda: h.find_longest_cache_hit([1, None], 8)),
        ("cache_blocks(bad hashes)", lambda: h.cache_blocks("a", 12, [b"x", None], 12, 0)),
        ("free_blocks(a free block)", lambda: h.free_blocks([30])),
        ("free(unknown)", lambda: h.free("nobody")),
        ("cached_block(empty hash)", lambda: h.cached_block(b"", 0)),
        ("cached_block(33-byte hash)", lambda: h.cached_block(b"x" * 33, 0)),
        ("cached_block(not bytes)", lambda: h.cached_block(None, 0)),
    ]
    return cases


def test_cached_block_finds_a_hash_in_its_own_group_only() -> None:
    """vLLM's ``get_cached_block`` per group: request ``a``'s first hash is cached in both
    groups (block 1 in the full group, 4 in the window's); an unknown hash in neither."""
    h = with_a_cached_request()
    assert h.cached_block(HASHES[0], 0) == 1
    assert h.cached_block(HASHES[0], 1) == 4
    assert h.cached_block(HASHES[5], 0) is None


def test_estimate_cached_tokens_is_the_least_group_maximum() -> None:
    """vLLM's ``estimate_cached_tokens``: per group the most tokens a hash of the request's
    blocks covers, the least over groups; 0 for an unknown request, nothing changed. Once the
    window group's first block is evicted the full group still covers 12 tokens, the window
    group too (its last block); evicting the window group's blocks leaves 0."""
    h = with_a_cached_request()
    assert h.estimate_cached_tokens("a") == 12
    before = state(h)
    assert h.estimate_cached_tokens("unknown") == 0
    assert state(h) == before
    h.evict_blocks([4])
    assert h.estimate_cached_tokens("a") == 12
    h.evict_blocks([5, 6])
    assert h.estimate_cached_tokens("a") == 0


def refusal_problems(make: Callable[[], Any], extra: Callable[[Any], List[Any]]) -> List[str]:
    """Run every entry case (and ``extra``'s) on a manager from ``make``: what went wrong."""
    problems = []
    h = make()
    for name, call in entry_cases(h) + extra(h):
        before = state(h)
        try:
            call()
        except PagedKVError:
            if state(h) != before:
                problems.append(f"{name}: refused but changed the manager")
        except BaseException as e:  # noqa: BLE001 - a PanicException is a BaseException
            problems.append(f"{name}: {type(e).__module__}.{type(e).__name__}: {e}")
        else:
            h.check()
            h = make()  # an accepted call may change state: start afresh
    return problems


def test_every_entry_refuses_out_of_range_values_unchanged() -> None:
    """A refusal is a pagedkv error (never a panic or a bare builtin) and changes nothing; a
    call that is accepted (vLLM accepts some: a saturated count) keeps the invariants."""
    problems = refusal_problems(with_a_cached_request, lambda h: [])
    assert not problems, "\n".join(problems)


#: Full attention beside a Mamba group in "align" mode with prefill checkpoints (alignment 1).
ALIGN_GROUPS = [("full", 4, 0, 0), ("mamba_align", 4, 0, 1)]


def with_an_align_request() -> Any:
    """Request ``a`` (12 tokens) prefilled: blocks 1-3 (full); null, the checkpoint 4 (the
    state at 8) and the running state 5 (Mamba)."""
    h = hybrid(groups=ALIGN_GROUPS, checkpoint_alignments=[0, 1])
    assert alloc(h, "a", 12) == [[1, 2, 3], [0, 4, 5]]
    h.take_events()
    return h


def align_cases(h: Any) -> List[Tuple[str, Callable[[], Any]]]:
    """The align-only arguments out of range (and a step boundary, always accepted)."""
    cases: List[Tuple[str, Callable[[], Any]]] = [("new_step_starts()", h.new_step_starts)]
    for v in (-1, -(2**64), "x"):
        cases += [
            (
                f"num_blocks_to_allocate(main={v!r})",
                lambda v=v: h.num_blocks_to_allocate("b", 8, None, 4, False, v),
            ),
            (
                f"num_blocks_to_allocate(prefill_end={v!r})",
                lambda v=v: h.num_blocks_to_allocate("b", 8, None, 4, False, 8, v),
            ),
        ]
    return cases


def test_an_align_manager_refuses_out_of_range_values_unchanged() -> None:
    """The same over a Mamba "align" group (inner null blocks in its tables), with its own
    arguments too."""
    problems = refusal_problems(with_an_align_request, align_cases)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "over",
    [{"num_blocks": v} for v in (0, *BAD_COUNTS)]
    + [
        {"groups": g}
        for g in ([], [("mamba", 4, 0, 0)], [("full", 0, 0, 0)], [("full", 4, 0, 2**40)])
    ]
    + [{"groups": [("full", 4, 0, 0), ("sliding_window", 4, v, 1)]} for v in (0, -1, 2**40)]
    + [{"hash_block_size": v} for v in (0, 3, *BAD_COUNTS)]
    + [{"scheduler_block_size": v} for v in (0, 3, *BAD_COUNTS)]
    + [{"release": r} for r in ("0.31", "", "v0.33")]
    + [{"prefix_cache_retention_interval": v} for v in (-1, 3, 2**64)]
    + [{"groups": ALIGN_GROUPS, "checkpoint_alignments": c} for c in ([1], [0, -1], [0, 2**40])]
    # Extra retained tokens: one per group, a count, only on a window, the sum a u32.
    + [{"extra_retained_tokens": e} for e in ([1], [0, -1], [0, 2**40], [2, 0], [0, 2**32 - 8])]
    + [
        {"groups": ALIGN_GROUPS, "enable_caching": False},
        # Multi-module MTP: a prefill lookahead above the scheduler block with an EAGLE group
        # and caching (vLLM's coordinator refuses it), or not a count.
        {"use_eagle": True, "prefill_lookahead": 5},
        {"eagle_groups": [False, True], "prefill_lookahead": 5},
    ]
    + [{"prefill_lookahead": v} for v in (-1, -(2**64), "1", 1.5)]
    + [{"hash_lookahead_tokens": v} for v in (-1, -(2**64), "1", 1.5)]
    + [{"groups": [("full", 4, 0, 0), ("mamba_align", 8, 0, 1)], "scheduler_block_size": 8}],
    ids=repr,
)
def test_bad_construction_is_a_pagedkv_error(over: dict) -> None:
    with pytest.raises(PagedKVError) as err:
        hybrid(**over)
    assert isinstance(err.value, (ValueError, OverflowError, TypeError))


def test_a_capped_max_model_len_bounds_slots_and_admission() -> None:
    """``cap_max_model_len`` (the native loop's cap where the cache is smaller): slot counts
    stop at the cap, as vLLM's manager built at that length stops them."""
    h = hybrid(num_blocks=9)  # 8 blocks: a 15-token prompt takes 4 + 4 blocks at most
    args = ("a", 0, 15, 0, True, 15, 0, None, 4, False, False, 0, False)
    assert h.allocate_slots(*args, HASHES[:3], 15, 0) is None  # 19 slots: 5 + 5 blocks
    h.cap_max_model_len(16, 16)
    assert [len(g) for g in h.allocate_slots(*args, HASHES[:3], 15, 0)] == [4, 4]
    h.check()


@pytest.mark.parametrize("cap", [-1, -(2**64), "16", None])
def test_a_bad_cap_is_refused_and_a_held_request_blocks_it(cap: Any) -> None:
    h = with_a_cached_request()
    before = state(h)
    with pytest.raises(PagedKVError) as err:
        h.cap_max_model_len(cap, 16)
    assert isinstance(err.value, (ValueError, TypeError))
    with pytest.raises(PagedKVError) as err:
        h.cap_max_model_len(16, 16)  # "a" is held
    assert isinstance(err.value, ValueError)
    assert state(h) == before
