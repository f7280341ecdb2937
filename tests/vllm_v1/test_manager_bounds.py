"""Out-of-range arguments against ``pagedkv.vllm_v1``'s manager and the native v1 classes
behind it: every call either does what vLLM's own manager does with the same call, or raises a
pagedkv error (never ``pyo3_runtime.PanicException``, a ``BaseException``) and changes nothing
anyone can observe: free blocks, usage, every request's blocks, prefix-cache stats, events.

Each case runs on a fresh pair of managers (vLLM's and pagedkv's) in the same state: two
running requests, one finished whose blocks stay cached, one waiting request not yet seen.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import pytest
from manager_driver import event_repr, kv_cache_config, manager_pair, stats_repr
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request, RequestStatus

from pagedkv import _native
from pagedkv.errors import PagedKVError
from pagedkv.vllm_v1 import KVCacheManager as PagedManager

BLOCK = 4
NUM_BLOCKS = 16
MAX_MODEL_LEN = 32
HUGE = (2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**200)
BAD_COUNTS = (-1, -(2**64), *HUGE)


def _hasher(block_size: int = BLOCK) -> Any:
    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    return kv_cache_utils.get_request_block_hasher(block_size, hash_fn)


def make_request(rid: str, n: int, block_size: int = BLOCK) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=[(7 * i) % 50 for i in range(n)],
        sampling_params=SamplingParams(max_tokens=8),
        pooling_params=None,
        block_hasher=_hasher(block_size),
    )


# ---- the streaming-session regression (issue 23, item 4) -------------------------------------
def _past_max_model_len(events: bool) -> Tuple[Any, Any, dict]:
    """vLLM's and pagedkv's manager (prefix caching on, 664 free blocks of 16 tokens,
    ``max_model_len`` 32) and a request each, whose prompt (50 tokens) is past
    ``max_model_len``, as a streaming session's prompt grows past it."""
    vllm, ours = manager_pair(
        665, 16, max_model_len=32, enable_caching=True, enable_kv_cache_events=events
    )
    reqs = {m: make_request("session", 50, block_size=16) for m in (vllm, ours)}
    return vllm, ours, reqs


def test_a_prompt_past_max_model_len_gets_vllms_blocks() -> None:
    vllm, ours, reqs = _past_max_model_len(events=False)
    got = {m: m.allocate_slots(reqs[m], 50) for m in (vllm, ours)}
    assert got[vllm].get_block_ids() == got[ours].get_block_ids() == ([1, 2],)
    for m in (vllm, ours):
        assert m.block_pool.get_num_free_blocks() == 662
        assert m.get_block_ids("session") == ([1, 2],)
        assert m.estimate_cached_tokens(reqs[m]) == 32  # both held blocks are cached
    # The session goes on: more tokens, more calls; both managers stay in step.
    for r in reqs.values():
        r.num_computed_tokens = 32
        r.status = RequestStatus.RUNNING
        r.append_output_token_ids([1] * 20)
    got = {m: m.allocate_slots(reqs[m], 38) for m in (vllm, ours)}
    assert got[vllm].get_block_ids() == got[ours].get_block_ids() == ([],)
    for m in (vllm, ours):
        m.free(reqs[m])
    assert [m.block_pool.get_num_free_blocks() for m in (vllm, ours)] == [664, 664]
    again = {m: make_request("again", 40, block_size=16) for m in (vllm, ours)}
    hits = {m: m.get_computed_blocks(again[m]) for m in (vllm, ours)}
    assert hits[vllm][0].get_block_ids() == hits[ours][0].get_block_ids() == ([1, 2],)


def test_a_prompt_growing_past_max_model_len_gets_vllms_blocks() -> None:
    """The scenario as production reaches it: the session's request fits at first, then its
    prompt grows past ``max_model_len`` between two calls."""
    vllm, ours = manager_pair(665, 16, max_model_len=32, enable_caching=True)
    reqs = {m: make_request("session", 20, block_size=16) for m in (vllm, ours)}
    for m, r in reqs.items():
        assert m.allocate_slots(r, 20).get_block_ids() == ([1, 2],)
        r.num_computed_tokens = 20
        r.status = RequestStatus.RUNNING
        r.append_output_token_ids(list(range(30)))
    got = {m: m.allocate_slots(reqs[m], 30) for m in (vllm, ours)}
    assert got[vllm].get_block_ids() == got[ours].get_block_ids() == ([],)
    assert [m.estimate_cached_tokens(reqs[m]) for m in (vllm, ours)] == [32, 32]
    assert vllm.block_pool.get_num_free_blocks() == ours.block_pool.get_num_free_blocks() == 662


def test_with_kv_events_a_prompt_past_max_model_len_is_refused_unchanged() -> None:
    """With KV events on, vLLM's own manager fails this call (IndexError, after taking two
    blocks): pagedkv raises its error before taking any."""
    vllm, ours, reqs = _past_max_model_len(events=True)
    with pytest.raises(IndexError):
        vllm.allocate_slots(reqs[vllm], 50)
    with pytest.raises(PagedKVError, match="max_model_len"):
        ours.allocate_slots(reqs[ours], 50)
    assert ours.block_pool.get_num_free_blocks() == 664
    assert ours.get_block_ids("session") == ([],)
    assert ours.take_events() == []


# ---- every public entry, out-of-range arguments ----------------------------------------------
class Pair:
    """vLLM's manager and pagedkv's in the same state (see the module docstring)."""

    def __init__(self, events: bool) -> None:
        self.vllm, self.ours = manager_pair(
            NUM_BLOCKS,
            BLOCK,
            max_model_len=MAX_MODEL_LEN,
            enable_caching=True,
            enable_kv_cache_events=events,
            log_stats=True,
        )
        self.reqs = {m: self._populate(m) for m in (self.vllm, self.ours)}

    @staticmethod
    def _populate(m: Any) -> dict:
        reqs = {rid: make_request(rid, n) for rid, n in (("a", 10), ("b", 6), ("done", 8))}
        reqs["new"] = make_request("new", 9)
        reqs["long"] = make_request("long", 50)  # past max_model_len
        reqs["big"] = make_request("big", 30 * BLOCK)  # past the cache
        for rid in ("a", "b", "done"):
            r = reqs[rid]
            hit, n_hit, _ = m.get_computed_blocks(r)
            m.allocate_slots(r, r.num_tokens - n_hit, n_hit, hit)
            m.record_prefix_cache_stats(r, n_hit)
            r.num_computed_tokens = r.num_tokens
            r.status = RequestStatus.RUNNING
        m.free(reqs["done"])
        m.take_events()
        return reqs

    def observed(self, m: Any) -> tuple:
        """Everything a failed call must leave as it was."""
        return (
            m.block_pool.get_num_free_blocks(),
            m.usage,
            tuple((rid, m.get_block_ids(rid)) for rid in ("a", "b", "done", "new", "long", "big")),
            stats_repr(m.prefix_cache_stats),
            tuple(event_repr(e) for e in m.take_events()),
        )


def _ids(x: Any) -> Any:
    """A comparable form of what a manager call returned."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if hasattr(x, "get_block_ids"):
        return ("blocks", x.get_block_ids())
    if isinstance(x, (list, tuple)):
        return tuple(_ids(y) for y in x)
    if hasattr(x, "block_id"):
        return ("block", x.block_id)
    return repr(x)


Call = Callable[[Any, dict], Any]


def _slots(rid: str, n: Any, **kw: Any) -> Call:
    return lambda m, r: m.allocate_slots(r[rid], n, **kw)


def _with_field(rid: str, field: str, value: Any, n: int = 1) -> Call:
    def call(m: Any, r: dict) -> Any:
        setattr(r[rid], field, value)
        return m.allocate_slots(r[rid], n)

    return call


def _cases() -> List[Tuple[str, Call]]:
    cases: List[Tuple[str, Call]] = []
    add = cases.append
    for v in (0, *BAD_COUNTS):
        for rid in ("a", "new", "long"):
            add((f"allocate_slots({rid}, {v})", _slots(rid, v)))
            for kw in (
                "num_lookahead_tokens",
                "reserved_blocks",
                "num_new_computed_tokens",
                "num_external_computed_tokens",
            ):
                add((f"allocate_slots({rid}, 1, {kw}={v})", _slots(rid, 1, **{kw: v})))
        add((f"allocate_slots(a, 1, num_encoder_tokens={v})", _slots("a", 1, num_encoder_tokens=v)))
        add((f"num_computed_tokens={v}", _with_field("a", "num_computed_tokens", v)))
        add((f"new num_computed_tokens={v}", _with_field("new", "num_computed_tokens", v)))
        add((f"get_computed_blocks(max={v})", lambda m, r, v=v: _hit(m, r["new"], v)))
        add((f"cache_blocks(a, {v})", lambda m, r, v=v: m.cache_blocks(r["a"], v)))
        add((f"cache_blocks(new, {v})", lambda m, r, v=v: m.cache_blocks(r["new"], v)))
        add((f"evict_blocks([{v}])", lambda m, r, v=v: m.evict_blocks([v])))
        add((f"pool.evict_blocks([{v}])", lambda m, r, v=v: m.block_pool.evict_blocks([v])))
        add((f"blocks_to_allocate({v})", lambda m, r, v=v: _to_allocate(m, "a", v)))
        add((f"computed_ids({v})", lambda m, r, v=v: m.get_block_ids_for_computed_tokens("a", v)))
    for rid in ("long", "big"):
        add((f"allocate_slots({rid}, whole prompt)", lambda m, r, rid=rid: _prompt(m, r[rid])))
        add((f"must fit {rid}", lambda m, r, rid=rid: _prompt(m, r[rid], fit=True)))
    add(("allocate_slots(a twin of a)", lambda m, r: m.allocate_slots(make_request("a", 10), 4)))
    add(("free(unknown)", lambda m, r: m.free(r["new"])))
    add(("free(a) twice", lambda m, r: (m.free(r["a"]), m.free(r["a"]))))
    add(("pop_blocks_for_free(unknown)", lambda m, r: m.pop_blocks_for_free(r["new"])))
    add(("evict_blocks(num_blocks)", lambda m, r: m.evict_blocks([NUM_BLOCKS, 0])))
    add(("reset_prefix_cache(in use)", lambda m, r: m.reset_prefix_cache()))
    add(("get_blocks(unknown)", lambda m, r: m.get_blocks("nobody")))
    add(("get_block_ids(unknown)", lambda m, r: m.get_block_ids("nobody")))
    add(("estimate_cached_tokens(unknown)", lambda m, r: m.estimate_cached_tokens(r["new"])))
    add(("free_blocks(free block)", lambda m, r: _free_free_block(m)))
    add(("adopt a hit twice", lambda m, r: _adopt_again(m, r["new"])))
    return cases


class Incomparable(Exception):
    """vLLM's manager has no such call (0.32's ``get_computed_blocks`` takes no bound)."""


def _hit(m: Any, r: Request, v: int) -> Any:
    if isinstance(m, PagedManager) or "max_cache_hit_length" in _params(m.get_computed_blocks):
        return m.get_computed_blocks(r, v)
    raise Incomparable


def _params(f: Any) -> Any:
    import inspect

    return inspect.signature(f).parameters


def _to_allocate(m: Any, rid: str, n: int) -> Any:
    kw = {}
    if isinstance(m, PagedManager):
        return m.coordinator.get_num_blocks_to_allocate(rid, n, ((),))
    if "total_computed_tokens" in _params(m.coordinator.get_num_blocks_to_allocate):
        kw = dict(total_computed_tokens=0, num_local_computed_tokens=0, num_tokens_main_model=n)
    return m.coordinator.get_num_blocks_to_allocate(rid, n, ((),), 0, **kw)


def _prompt(m: Any, r: Request, fit: bool = False) -> Any:
    hit, n_hit, _ = m.get_computed_blocks(r)
    return m.allocate_slots(r, r.num_tokens - n_hit, n_hit, hit, full_sequence_must_fit=fit)


def _free_free_block(m: Any) -> Any:
    blocks = m.get_blocks("a").blocks[0]
    return m.block_pool.free_blocks([blocks[0], blocks[0], blocks[0]])


def _adopt(m: Any, reqs: dict) -> None:
    """Setup: the new request adopts its hit and runs."""
    r = reqs["new"]
    hit, n_hit, _ = m.get_computed_blocks(r)
    m.allocate_slots(r, 1, n_hit, hit)
    r.num_computed_tokens = n_hit + 1
    r.status = RequestStatus.RUNNING


def _adopt_again(m: Any, r: Request) -> Any:
    hit, n_hit, _ = m.get_computed_blocks(r)
    return m.allocate_slots(r, 1, n_hit, hit)


#: Cases whose state is set up by a call of its own first (same on both managers, unchecked).
SETUPS = {"adopt a hit twice": _adopt}


CASES = _cases()


@pytest.mark.parametrize("events", [False, True], ids=["plain", "events"])
def test_out_of_range_calls_match_vllm_or_raise_unchanged(events: bool) -> None:
    """All cases in one test per setting (one pair per case; about 300 cases)."""
    problems = []
    for name, call in CASES:
        problem = _run_case(Pair(events), name, call)
        if problem:
            problems.append(problem)
    assert not problems, "\n".join(problems)


def _outcome(m: Any, reqs: dict, call: Call) -> Tuple[str, Any]:
    try:
        return "ok", _ids(call(m, reqs))
    except Incomparable:
        return "incomparable", None
    except BaseException as e:  # noqa: BLE001 - a PanicException is a BaseException
        return "raised", e


def _run_case(pair: Pair, name: str, call: Call) -> str:
    setup = SETUPS.get(name)
    if setup is not None:
        for m in (pair.vllm, pair.ours):
            setup(m, pair.reqs[m])
            m.take_events()
    return _checked(pair, name, call)


def _vllm_032_indexes_past_the_hashes(name: str) -> bool:
    """vLLM 0.32's ``cache_blocks`` reads ``request.block_hashes[i]`` for every full block the
    request holds, past the hashes it has (IndexError, some blocks already cached); 0.33 caps
    the blocks at the hashes, as pagedkv does on both."""
    from vllm import __version__

    return __version__.startswith("0.32") and name.startswith("cache_blocks(a,")


def _checked(pair: Pair, name: str, call: Call) -> str:
    before = pair.observed(pair.ours)
    ours = _outcome(pair.ours, pair.reqs[pair.ours], call)
    if ours[0] == "raised":
        e = ours[1]
        if not isinstance(e, PagedKVError):
            return f"{name}: raised {type(e).__module__}.{type(e).__name__}: {e}"
        # A raising call may have set the request's field before the call (the case's
        # setup): the manager's own state is what must not change.
        after = pair.observed(pair.ours)
        return "" if after == before else f"{name}: raised {e!r} but changed {before} -> {after}"
    theirs = _outcome(pair.vllm, pair.reqs[pair.vllm], call)
    if theirs[0] == "incomparable":
        return ""
    if theirs[0] == "raised" and _vllm_032_indexes_past_the_hashes(name):
        return ""
    if theirs[0] == "raised":
        return f"{name}: vLLM raised {theirs[1]!r}, pagedkv returned {ours[1]!r}"
    if theirs[1] != ours[1]:
        return f"{name}: vLLM returned {theirs[1]!r}, pagedkv {ours[1]!r}"
    if pair.observed(pair.vllm) != pair.observed(pair.ours):
        return f"{name}: state differs from vLLM's after the call"
    return ""


# ---- the native v1 classes reachable from pagedkv.vllm_v1 ----------------------------------
def _native_cases() -> List[Tuple[str, Callable[[], Any]]]:
    cases: List[Tuple[str, Callable[[], Any]]] = []
    good = dict(
        num_blocks=8,
        block_size=4,
        max_model_len=32,
        enable_caching=True,
        enable_events=False,
        watermark_blocks=0,
    )
    for field in ("num_blocks", "block_size", "max_model_len", "watermark_blocks"):
        for v in (0, *BAD_COUNTS, "4", 1.5, None):
            kw = dict(good, **{field: v})
            cases.append((f"V1Manager({field}={v!r})", lambda kw=kw: _native.V1Manager(**kw)))
    # Multi-module MTP's prefill lookahead: not a count, or above the block with EAGLE.
    for v in (-1, -(2**64), "4", 1.5, None):
        kw = dict(good, prefill_lookahead=v)
        cases.append((f"V1Manager(prefill_lookahead={v!r})", lambda kw=kw: _native.V1Manager(**kw)))
    for eagle in (dict(use_eagle=True), dict(eagle_group=True)):
        kw = dict(good, prefill_lookahead=5, **eagle)
        cases.append((f"V1Manager({eagle}, lookahead 5)", lambda kw=kw: _native.V1Manager(**kw)))
    m = _native.V1Manager(**good)
    for v in (-1, 0, 8, 2**31, 2**32, 2**64, 2**200):
        cases.append((f"ref_cnt({v})", lambda v=v: m.ref_cnt(v)))
        cases.append((f"block_hash({v})", lambda v=v: m.block_hash(v)))
        cases.append((f"hashed_tokens({v})", lambda v=v: m.hashed_tokens(v)))
        cases.append((f"is_free({v})", lambda v=v: m.is_free(v)))
        cases.append((f"free_blocks([{v}])", lambda v=v: m.free_blocks([v])))
        cases.append((f"evict_blocks([{v}])", lambda v=v: m.evict_blocks([v])))
        cases.append((f"longest_cache_hit({v})", lambda v=v: m.longest_cache_hit([b"x"], v)))
        cases.append((f"num_blocks_to_allocate({v})", lambda v=v: _nba(m, v)))
        cases.append((f"cache_blocks({v})", lambda v=v: m.cache_blocks("r", v, [b"x"] * 3)))
        cases.append((f"allocate_slots({v})", lambda v=v: _native_slots(m, v)))
        cases.append((f"vllm_allocate_slots({v})", lambda v=v: m.vllm_allocate_slots(None, v)))
    cases.append(("longest_cache_hit(bad hashes)", lambda: m.longest_cache_hit([1, None], 5)))
    cases.append(("free(unknown)", lambda: m.free("nobody")))
    for v in (0, -1, 2**64, 2**200):
        cases.append(
            (f"VllmBlockHasher({v})", lambda v=v: _native.VllmBlockHasher("sha256", v, id))
        )
        cases.append(
            (f"vllm_block_hash([{v}])", lambda v=v: _native.vllm_block_hash("sha256", b"", [v] * 4))
        )
    cases.append(("VllmBlockHasher(bogus)", lambda: _native.VllmBlockHasher("bogus", 4, id)))
    cases.append(("vllm_block_hash(bogus)", lambda: _native.vllm_block_hash("bogus", b"", [1])))
    for cfg in ({}, {"release_033": True}, {"release_033": 3}):
        cases.append((f"V1Loop({cfg})", lambda cfg=cfg: _native.V1Loop(m, cfg)))
    return cases


def _nba(m: Any, v: int) -> Any:
    return m.num_blocks_to_allocate("r", v, [v])


def _native_slots(m: Any, v: int) -> Any:
    return m.allocate_slots("r", v, v, True, v, v, [v], v, False, True, v, True, [b"x"])


def test_native_v1_entries_raise_pagedkv_errors_only() -> None:
    problems = []
    for name, call in _native_cases():
        try:
            call()
        except PagedKVError:
            pass
        except BaseException as e:  # noqa: BLE001 - a PanicException is a BaseException
            problems.append(f"{name}: {type(e).__module__}.{type(e).__name__}: {e}")
    assert not problems, "\n".join(problems)


def test_kv_cache_manager_construction_with_bad_config() -> None:
    """Bad sizes reach the native constructor: each raises a pagedkv error."""
    problems = []
    for field, values in (
        ("num_blocks", (0, -1, 2**32, 2**64)),
        ("max_model_len", (-1, -(2**64))),
        ("watermark", (-1.0, -0.5)),
    ):
        for v in values:
            nb = v if field == "num_blocks" else 8
            bs = v if field == "scheduler_block_size" else BLOCK
            kw = dict(max_model_len=MAX_MODEL_LEN, scheduler_block_size=bs, hash_block_size=BLOCK)
            if field in ("max_model_len", "watermark"):
                kw[field] = v
            cfg = kv_cache_config(8, BLOCK)
            cfg.num_blocks = nb
            try:
                got = PagedManager(cfg, **kw)
            except PagedKVError:
                continue
            except BaseException as e:  # noqa: BLE001
                problems.append(f"{field}={v}: {type(e).__module__}.{type(e).__name__}: {e}")
            else:
                if type(got) is PagedManager:  # out of scope: vLLM's own manager serves it
                    problems.append(f"{field}={v}: accepted")
    assert not problems, "\n".join(problems)
