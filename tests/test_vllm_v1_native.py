"""The native half of ``pagedkv.vllm_v1`` without vLLM: ``_native.V1Manager`` (vLLM v1's
manager semantics; the comparison with vLLM itself runs in tests/vllm_v1 inside vLLM's
virtualenvs) and the lazy import (``import pagedkv`` never needs vLLM)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv import _native
from pagedkv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    PagedKVError,
    UnsupportedVLLMError,
)

H = [bytes([i]) * 32 for i in range(1, 9)]


def manager(num_blocks: int = 10, caching: bool = True, events: bool = True) -> _native.V1Manager:
    return _native.V1Manager(num_blocks, 4, 1 << 20, caching, events, 0)


def alloc(m: _native.V1Manager, rid: str, n: int, hashes=(), computed=None, n_computed=0):
    return m.allocate_slots(
        rid,
        0,
        n + n_computed,
        True,
        n,
        n_computed,
        computed,
        0,
        False,
        False,
        0,
        False,
        list(hashes),
    )


def test_blocks_come_in_vllm_order_and_null_block_is_reserved() -> None:
    m = manager()
    assert alloc(m, "a", 9, H[:2]) == [1, 2, 3]
    assert m.free_queue() == [4, 5, 6, 7, 8, 9]
    assert m.take_events() == [("stored", 0, 2)]
    assert m.block_hash(1) == H[0] and m.hashed_tokens(2) == 8 and m.block_hash(3) is None
    m.free("a")
    # uncached block 3 goes to the head, cached 2 and 1 to the tail (tail-first order)
    assert m.free_queue() == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    m.check()


def test_prefix_hit_is_adopted_and_ref_counted() -> None:
    m = manager()
    alloc(m, "a", 8, H[:2])
    hit = m.longest_cache_hit(H[:3], 2)
    assert hit == [1, 2]
    assert alloc(m, "b", 3, H[:2], computed=hit, n_computed=8) == [3]
    assert m.block_ids("b") == [1, 2, 3] and m.ref_cnt(1) == 2
    assert m.estimate_cached_tokens("b") == 8
    m.check()


def test_refused_and_failing_calls_change_nothing() -> None:
    m = manager(num_blocks=4)
    before = m.free_queue()
    assert alloc(m, "a", 100) is None
    with pytest.raises(InvalidArgumentError):
        alloc(m, "a", 0)
    with pytest.raises(InvalidArgumentError):  # a hash that is not bytes
        alloc(m, "a", 8, ["not bytes", H[1]])
    with pytest.raises(InvalidArgumentError):  # adopting a block that is not cached
        alloc(m, "a", 4, computed=[2], n_computed=4)
    assert m.free_queue() == before and m.num_requests == 0
    assert alloc(m, "a", 4) == [1]
    with pytest.raises(DoubleFreeError):
        m.free_blocks([1, 1])
    assert m.ref_cnt(1) == 1
    with pytest.raises(InvalidArgumentError):
        m.evict_blocks([0, 99])
    m.check()


def test_only_cached_blocks_are_adopted_and_only_on_arrival() -> None:
    """What vLLM's lookup can hand over: a cached block, to a request that holds none. Another
    request's uncached block, or any hit for a running request (vLLM asserts it has none), is
    refused with nothing changed."""
    m = manager()
    alloc(m, "a", 8, H[:1])  # block 1 cached, block 2 held uncached
    before = (m.free_queue(), m.ref_cnt(1), m.ref_cnt(2))
    with pytest.raises(InvalidArgumentError):
        alloc(m, "b", 4, H[:1], computed=[2], n_computed=4)
    with pytest.raises(InvalidArgumentError):
        alloc(m, "a", 4, H[:1], computed=[1], n_computed=4)
    assert (m.free_queue(), m.ref_cnt(1), m.ref_cnt(2)) == before and m.num_requests == 1
    assert alloc(m, "b", 4, H[:1], computed=[1], n_computed=4) == [3]
    assert m.ref_cnt(1) == 2
    m.check()


def _prefill_with_lookahead(m: _native.V1Manager, rid: str, n: int, lookahead: int) -> object:
    return m.allocate_slots(rid, 0, n, True, n, 0, None, lookahead, False, False, 0, False, [])


def test_a_capped_max_model_len_bounds_the_lookahead_slots() -> None:
    """vLLM caps the slots a request needs (lookahead included) at ``max_model_len``; the
    native loop lowers the manager's to the cache's size (16 tokens here), so a 15-token
    prompt with 4 lookahead slots takes the 4 blocks there are instead of asking for 5."""
    m = manager(num_blocks=5)
    assert _prefill_with_lookahead(m, "a", 15, 4) is None  # 19 slots at max_model_len 2**20
    m.cap_max_model_len(16)
    assert _prefill_with_lookahead(m, "a", 15, 4) == [1, 2, 3, 4]
    m.check()


@pytest.mark.parametrize("cap", [-1, -(2**64), "16", 1.5, None])
def test_a_bad_cap_is_refused_unchanged(cap: object) -> None:
    m = manager(num_blocks=5)
    with pytest.raises(PagedKVError) as err:
        m.cap_max_model_len(cap)
    assert isinstance(err.value, (ValueError, TypeError))
    assert _prefill_with_lookahead(m, "a", 15, 4) is None  # still 2**20


def test_the_cap_is_refused_once_a_request_is_held() -> None:
    m = manager(num_blocks=5)
    assert alloc(m, "a", 4) == [1]
    with pytest.raises(InvalidArgumentError):
        m.cap_max_model_len(8)
    m.free("a")
    m.cap_max_model_len(2**70)  # above the current length: nothing changes
    assert _prefill_with_lookahead(m, "b", 15, 4) is None
    m.check()


def test_errors_derive_from_builtins() -> None:
    m = manager()
    with pytest.raises(ValueError):
        m.ref_cnt(-1)
    with pytest.raises(PagedKVError):
        m.block_hash(10)


def test_events_log_evictions_and_reset() -> None:
    m = manager(num_blocks=3)
    alloc(m, "a", 8, H[:2])
    m.free("a")
    m.take_events()
    assert alloc(m, "b", 4) == [2]  # the tail-first free order hands out block 2 first
    assert m.take_events() == [("removed", H[1], 0)]
    assert not m.reset_prefix_cache()
    m.free("b")
    assert m.reset_prefix_cache()
    assert m.take_events() == [("cleared", 0, 0)]
    assert m.num_cached_hashes() == 0


def test_import_pagedkv_never_imports_vllm() -> None:
    code = (
        "import sys, pagedkv, pagedkv.vllm_v1 as v\n"
        "assert 'vllm' not in sys.modules, 'vllm imported'\n"
        "print(v.SUPPORTED_VLLM)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "0.33.0" in out.stdout


def test_using_the_plugin_without_vllm_is_a_clear_error() -> None:
    code = (
        "import pagedkv.vllm_v1 as v\n"
        "try:\n    v.Scheduler\nexcept ImportError as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith(UnsupportedVLLMError.__name__)
    assert "pagedkv[vllm]" in out.stdout


# --- V1Loop: vLLM v1's scheduling walk, here over stand-ins for vLLM's objects -----------------

WAITING, RUNNING, PREEMPTED, STOPPED, CAPPED = 1, 5, 6, 7, 8


class FakeRequest:
    """The plain fields of vLLM's ``Request`` the loop reads and writes."""

    def __init__(self, rid: str, prompt: list, max_tokens: int, eos=None) -> None:
        self.request_id = rid
        self.client_index = 0
        self.priority = 0
        self.arrival_time = 0.0
        self.status = WAITING
        self.prompt_token_ids = list(prompt)
        self._all_token_ids = list(prompt)
        self._output_token_ids: list = []
        self.num_prompt_tokens = len(prompt)
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_in_flight_tokens = 0
        self.num_stale_output_tokens = 0
        self.drop_stale_output = False
        self.resumable = False
        self.pooling_params = None
        self.is_prefill_chunk = False
        self.num_preemptions = 0
        self.stop_reason = None
        self.spec_token_ids: list = []
        self.events: list = []
        self.prefill_stats = None
        self.trace_headers = None
        self.num_nans_in_logits = 0
        self.block_hashes: list = []
        self._block_hasher = None
        self.sampling_params = type(
            "P",
            (),
            {
                "eos_token_id": eos,
                "stop_token_ids": [],
                "min_tokens": 0,
                "repetition_detection": None,
            },
        )()
        self.lora_request = self.structured_output_request = self.prompt_embeds = None
        self.mm_features: list = []
        self.has_encoder_inputs = False


class FakeQueue(list):
    def peek_request(self):
        return self[0]

    def pop_request(self):
        return self.pop(0)

    def prepend_requests(self, reqs):
        self[:0] = list(reqs)


class FakeScheduler:
    def __init__(self, manager: _native.V1Manager) -> None:
        self.kv_cache_manager = self
        self.native = manager
        self.structured_output_manager = None  # the loop config calls it plain
        self.scheduler_config = type(
            "C",
            (),
            {
                "long_prefill_token_threshold": 0,
                "enable_chunked_prefill": True,
                "max_num_batched_tokens": 64,
            },
        )()
        self.max_model_len, self.max_num_scheduled_tokens = 64, 64
        self.max_num_running_reqs = self.max_num_active_reqs = 4
        self.policy, self.scheduler_reserve_full_isl = "fcfs", False
        self.use_v2_model_runner = False
        self.use_pp = False  # no pipeline parallelism: no tokens sent back
        self.return_sampling_mask = False
        self.num_spec_tokens = self.num_lookahead_tokens = self.num_prefill_lookahead = 0
        self.lora_config = None
        self.current_step = self.num_executed_steps = 0
        # The prefill gate (data-parallel throttling, 0.33's cadence of 1: none).
        self.prefill_capacity_bound = False
        self.local_prefill_interval, self.last_prefill_step = 1, -1
        self.running: list = []
        self.waiting = FakeQueue()
        self.kv_holding_waiting = FakeQueue()
        self.num_waiting_for_streaming_input = 0
        self.deferred_waiting: set = set()
        self._inflight_prefills: set = set()
        self.prev_step_scheduled_req_ids: set = set()
        self.requests: dict = {}
        self.freed: list = []

    def _get_local_prefix_cache_hit(self, request):
        return None, 0, 0, False

    def record_prefix_cache_stats(self, request, hits):
        pass

    def estimate_cached_tokens(self, request):
        return 0

    def _preempt_request(self, request, ts):
        raise AssertionError("no preemption expected")

    def _free_request(self, request):
        self.freed.append(request.request_id)
        self.native.free(request.request_id)
        del self.requests[request.request_id]


class Output(tuple):
    def __new__(cls, *args):
        return super().__new__(cls, args)


FIELDS = [
    "request_id",
    "new_token_ids",
    "new_logprobs",
    "new_prompt_logprobs_tensors",
    "finish_reason",
    "stop_reason",
    "events",
    "trace_headers",
    "prefill_stats",
    "num_nans_in_logits",
]


def loop_config(**overrides) -> dict:
    config = {
        "release_033": True,
        "hash_block_size": 4,
        "num_hash_lookahead_tokens": 0,
        "async_scheduling": False,
        "decode_stagger": 1,
        "pool_tokens": 1 << 20,
        "PRIORITY": "priority",
        "event_scheduled": None,
        "WAITING": WAITING,
        "RUNNING": RUNNING,
        "PREEMPTED": PREEMPTED,
        "FINISHED_STOPPED": STOPPED,
        "FINISHED_LENGTH_CAPPED": CAPPED,
        "FINISHED_ERROR": 9,
        "FINISHED_REPETITION": 10,
        "reason_stop": "stop",
        "reason_length": "length",
        "reason_error": "error",
        "reason_repetition": "repetition",
        "draft_slots": 0,
        "observe_spec_metrics": lambda *args: None,
        "spec_decoding_stats": lambda *args: args,
        "vllm_mamba_split_code": None,
        "grammar_manager_kind": lambda manager: 0,
        "make_new": lambda req, ids, v2: ("new", req.request_id, ids),
        "monotonic": lambda: 0.0,
        "hash_name_of": lambda hasher: "sha256" if hasher == "vllm-sha256" else None,
        "output_cls": Output,
        "output_fields": FIELDS,
        "output_defaults": [None, None, None, None, None, None, None, None, None, 0],
    }
    config.update(overrides)
    return config


def scheduler_output_of(scheduled: dict) -> object:
    """The fields of vLLM's ``SchedulerOutput`` ``update`` reads: no drafts."""
    fields = {"num_scheduled_tokens": scheduled, "scheduled_spec_decode_tokens": {}}
    return type("SO", (), fields)()


def bound_manager() -> _native.V1Manager:
    m = manager(num_blocks=16, events=False)
    m.bind_vllm("EMPTY", lambda ids: ("blocks", ids), WAITING, PREEMPTED, FakeRequest)
    return m


class FakeOutput:
    def __init__(self, ids: list, sampled: list) -> None:
        self.sampled_token_ids = sampled
        self.req_id_to_index = {r: i for i, r in enumerate(ids)}
        self.logprobs = None
        self.prompt_logprobs_dict = {}
        self.num_nans_in_logits = None
        self.pooler_output: list = []


def test_v1_loop_admits_decodes_and_stops_over_the_schedulers_own_objects() -> None:
    m = bound_manager()
    sched = FakeScheduler(m)
    loop = _native.V1Loop(m, loop_config())
    a, b = FakeRequest("a", [5] * 6, 3, eos=2), FakeRequest("b", [6] * 9, 2)
    for r in (a, b):
        sched.waiting.append(r)
        sched.requests[r.request_id] = r
    new, cached, scheduled, total, *_ = loop.schedule(sched)
    assert [n[1] for n in new] == ["a", "b"] and dict(scheduled) == {"a": 6, "b": 9}
    assert total == 15 and sched.running == [a, b] and not sched.waiting
    assert a.status == RUNNING and a.num_computed_tokens == 6 and a.num_in_flight_tokens == 6
    assert sched.prev_step_scheduled_req_ids == {"a", "b"}
    outs, spec_stats = loop.update(
        sched, scheduler_output_of(scheduled), FakeOutput(["a", "b"], [[7], [2]])
    )
    ((client, rows),) = outs
    assert spec_stats is None
    assert client == 0 and [(o[0], list(o[1])) for o in rows] == [("a", [7]), ("b", [2])]
    assert a._all_token_ids[-1] == 7 and a._output_token_ids == [7] and a.status == RUNNING
    # b ignores EOS (eos None): its second token reaches max_tokens and caps it.
    so = scheduler_output_of(loop.schedule(sched)[2])
    assert dict(so.num_scheduled_tokens) == {"a": 1, "b": 1}
    ((_, rows),), _ = loop.update(sched, so, FakeOutput(["a", "b"], [[2], [9]]))
    assert a.status == STOPPED and b.status == CAPPED
    assert [o[4] for o in rows] == ["stop", "length"] and sched.freed == ["a", "b"]
    assert sched.running == [] and m.num_requests == 0


@pytest.mark.parametrize("asynchronous", [False, True])
def test_v1_loop_sends_tokens_back_under_pipeline_parallelism(asynchronous: bool) -> None:
    """``use_pp`` with synchronous scheduling: each cached row's ``new_token_ids`` entry is
    its tokens from ``num_computed_tokens`` on, as many as it is scheduled for (vLLM's
    ``_make_cached_request_data``); with async scheduling, or without ``use_pp``, none."""
    m = bound_manager()
    sched = FakeScheduler(m)
    sched.scheduler_config.async_scheduling = asynchronous
    loop = _native.V1Loop(m, loop_config())
    a = FakeRequest("a", [5] * 6, 3)
    sched.waiting.append(a)
    sched.requests["a"] = a
    scheduled = loop.schedule(sched)[2]
    loop.update(sched, scheduler_output_of(scheduled), FakeOutput(["a"], [[7]]))
    sched.use_pp = True
    (ids, _, new_tokens, *_) = loop.schedule(sched)[1]
    assert ids == ["a"] and new_tokens == ([] if asynchronous else [[7]])
    sched.use_pp = False
    loop.update(sched, scheduler_output_of({"a": 1}), FakeOutput(["a"], [[8]]))
    assert loop.schedule(sched)[1][2] == []


class RecordingMasks:
    """A model output's ``sampling_masks``: records each ``slice_request`` call."""

    def __init__(self) -> None:
        self.calls: list = []

    def slice_request(self, index: int, num_positions: int) -> tuple:
        self.calls.append((index, num_positions))
        return ("mask", index, num_positions)


def test_v1_loop_slices_sampling_masks_once_per_row_by_the_kept_tokens() -> None:
    """With ``return_sampling_mask`` on, each row that keeps tokens gets
    ``sampling_masks.slice_request(row index, kept tokens)`` once, in its output's
    ``new_sampling_mask``: a stop keeps the tokens up to it (here EOS second of three), a row
    with no tokens gets no call; off, the masks are never read."""
    m = bound_manager()
    sched = FakeScheduler(m)
    defaults = [None, *loop_config()["output_defaults"]]
    config = loop_config(output_fields=["new_sampling_mask", *FIELDS], output_defaults=defaults)
    loop = _native.V1Loop(m, config)
    a, b, c = (FakeRequest(rid, [5] * 6, 8, eos=2) for rid in "abc")
    for r in (a, b, c):
        sched.waiting.append(r)
        sched.requests[r.request_id] = r
    so = scheduler_output_of(loop.schedule(sched)[2])
    out = FakeOutput(["c", "b", "a"], [[4], [], [7, 2, 9]])
    out.sampling_masks = masks = RecordingMasks()
    sched.return_sampling_mask = True
    ((_, rows),), _ = loop.update(sched, so, out)
    assert masks.calls == [(2, 2), (0, 1)] and a.status == STOPPED
    assert [(o[1], list(o[2])) for o in rows] == [("a", [7, 2]), ("c", [4])]
    assert [o[0] for o in rows] == [("mask", 2, 2), ("mask", 0, 1)]
    sched.return_sampling_mask = False
    so = scheduler_output_of(loop.schedule(sched)[2])
    out = FakeOutput(["c"], [[9]])
    out.sampling_masks = masks = RecordingMasks()
    ((_, rows),), _ = loop.update(sched, so, out)
    assert masks.calls == [] and rows[0][0] is None and list(rows[0][2]) == [9]


def test_v1_loop_hashes_the_blocks_it_fills_as_vllm_would() -> None:
    """A request whose hasher is vLLM's own (here: a marker the configuration's
    ``hash_name_of`` names "sha256") gets each block it fills while decoding hashed natively:
    SHA-256 of the pickle of ``(parent, tuple(block), None)``, chained."""
    import hashlib
    import pickle

    m = bound_manager()
    sched = FakeScheduler(m)
    loop = _native.V1Loop(m, loop_config())
    r = FakeRequest("r", [5, 6, 7, 8, 9], 9)
    r._block_hasher = "vllm-sha256"
    r.block_hashes.append(b"\x11" * 32)  # the prompt's block, hashed by vLLM at arrival
    sched.waiting.append(r)
    sched.requests["r"] = r
    so = scheduler_output_of(loop.schedule(sched)[2])
    for t in (300, 70_000, 1, 2, 3, 4, 5):
        loop.update(sched, so, FakeOutput(["r"], [[t]]))
        so = scheduler_output_of(loop.schedule(sched)[2])
    want = [b"\x11" * 32]
    for k in range(1, len(r._all_token_ids) // 4):
        block = tuple(r._all_token_ids[4 * k : 4 * k + 4])
        want.append(hashlib.sha256(pickle.dumps((want[-1], block, None), protocol=5)).digest())
    assert len(want) == 3 and r.block_hashes == want


def test_v1_loop_refuses_bad_configuration_and_reentry() -> None:
    m = bound_manager()
    with pytest.raises(InvalidArgumentError):
        _native.V1Loop(m, {k: v for k, v in loop_config().items() if k != "WAITING"})
    with pytest.raises(ValueError):
        _native.V1Loop(m, loop_config(output_defaults=[None]))
    with pytest.raises(InvalidArgumentError, match="no field"):
        _native.V1Loop(m, loop_config(output_fields=FIELDS[:-1], output_defaults=[None] * 9))
    with pytest.raises(TypeError, match="V1Manager or a V1Hybrid"):
        _native.V1Loop(object(), loop_config())
    sched = FakeScheduler(m)
    loop = _native.V1Loop(m, loop_config())
    r = FakeRequest("r", [5] * 4, 1)
    sched.waiting.append(r)
    sched.requests["r"] = r
    scheduled = loop.schedule(sched)[2]

    def reenter(request):  # a callback into the loop while it runs: refused, not a crash
        loop.schedule(sched)

    sched._free_request = reenter
    so = scheduler_output_of(scheduled)
    with pytest.raises(PagedKVError):
        loop.update(sched, so, FakeOutput(["r"], [[9]]))


@pytest.mark.parametrize("field", ["prev_step_scheduled_req_ids", "use_pp"])
def test_v1_loop_on_a_scheduler_missing_a_field_changes_nothing(field: str) -> None:
    """Fields read while the step's output is built are read before anything is written."""
    m = bound_manager()
    sched = FakeScheduler(m)
    delattr(sched, field)
    r = FakeRequest("r", [5] * 4, 1)
    sched.waiting.append(r)
    sched.requests["r"] = r
    with pytest.raises(AttributeError):
        _native.V1Loop(m, loop_config()).schedule(sched)
    assert sched.current_step == 0 and sched.waiting == [r] and r.status == WAITING
    assert m.num_requests == 0 and m.num_free_blocks() == 15


# vLLM's block hash, natively (pagedkv_core::v1::block_hash): the pickle-based "sha256" is
# checked here against pickle + hashlib; all four functions against vLLM's own in
# tests/vllm_v1/test_block_hash.py.
EDGE_TOKENS = (0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, -1, -256, -(2**31))


def test_native_sha256_block_hash_is_the_pickle_digest() -> None:
    import hashlib
    import pickle
    import random

    rng = random.Random(7)
    for case in range(400):
        parent = bytes(rng.randrange(256) for _ in range(rng.choice((16, 32, 255))))
        n = rng.choice((4, 5, 16, 33, 256))
        tokens = [
            rng.choice(EDGE_TOKENS) if rng.random() < 0.3 else rng.randrange(2**17)
            for _ in range(n)
        ]
        want = hashlib.sha256(
            pickle.dumps((parent, tuple(tokens), None), protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()
        assert _native.vllm_block_hash("sha256", parent, tokens) == want, case


def test_native_lora_block_hash_is_the_pickle_digest() -> None:
    """A LoRA request's block: ``E = (("lora", name, path),)`` as vLLM's extra keys, alone
    and before lookahead tokens, against CPython's own pickle (name and path distinct
    objects, as a request's are)."""
    import hashlib
    import pickle
    import random

    rng = random.Random(11)
    strings = ("sql", "/adapters/sql", "é", "ü-adapter", "x" * 255, "adapter-" * 20)
    for case in range(300):
        parent = bytes(rng.randrange(256) for _ in range(32))
        tokens = [rng.randrange(2**17) for _ in range(rng.choice((4, 16, 33)))]
        name = "".join(rng.choice(strings))[:200] + str(case)
        path = rng.choice(strings).encode().decode()
        ahead = [rng.randrange(2**17) for _ in range(rng.choice((0, 1, 2, 3, 5)))]
        keys = (("lora", name, path),)
        extra = (keys, *ahead) if ahead else keys
        want = hashlib.sha256(
            pickle.dumps((parent, tuple(tokens), extra), protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()
        got = _native.vllm_block_hash("sha256", parent, tokens, ahead, (name, path))
        assert got == want, (case, name, path, ahead)
    assert _native.vllm_block_hash("sha256", parent, tokens, None, ("lora", "/p")) is None
    assert _native.vllm_block_hash("sha256", parent, tokens, None, ("a", "p" * 256)) is None


class _Row:
    def __init__(self, rows: list, i: int) -> None:
        self.rows, self.i = rows, i

    def fill_(self, value: int) -> None:
        self.rows[self.i] = ("full", value)

    def copy_(self, other: _Row) -> None:
        self.rows[self.i] = other.rows[other.i]


class _Bitmask:
    """A stand-in for vLLM's bitmask tensor: rows a grammar or a fill writes."""

    def __init__(self, n: int) -> None:
        self.rows: list = ["stale"] * n

    def __getitem__(self, i: int) -> _Row:
        if not 0 <= i < len(self.rows):
            raise IndexError(i)
        return _Row(self.rows, i)


class _Grammar:
    """Accepts tokens below 100 and rejects the rest; records its position in its rows."""

    def __init__(self) -> None:
        self.position = 0
        self.rolled_back = 0

    def is_terminated(self) -> bool:
        return False

    def fill_bitmask(self, bitmask: _Bitmask, row: int) -> None:
        bitmask.rows[row] = ("grammar", self.position)

    def accept_tokens(self, request_id: str, tokens: list) -> bool:
        if any(t >= 100 for t in tokens):
            return False
        self.position += len(tokens)
        return True

    def rollback(self, n: int) -> None:
        self.position -= n
        self.rolled_back += n


def test_fill_plain_grammar_rows_fills_as_vllms_serial_fill_without_vllm() -> None:
    """The bitmask rows of ``_native.fill_plain_grammar_rows`` (vLLM absent: each grammar
    read through its holder's ``grammar`` attribute, no log): per request its draft rows and
    a bonus row, the full mask from a padding draft on, the failed row repeated after a
    rejected draft, the advances rolled back; fixed stride or packed. Bad input raises a
    Python exception and writes nothing past the request that raised."""
    from types import SimpleNamespace

    def requests(n: int) -> dict:
        return {
            f"r{k}": SimpleNamespace(structured_output_request=SimpleNamespace(grammar=_Grammar()))
            for k in range(n)
        }

    reqs = requests(3)
    drafts = {"r0": [5, 6], "r1": [7, -1], "r2": [200, 8]}
    bitmask = _Bitmask(9)
    end = _native.fill_plain_grammar_rows(bitmask, -1, reqs, ["r0", "r1", "r2"], drafts, 3)
    g, f = "grammar", "full"
    assert end == 9 and bitmask.rows == [
        (g, 0), (g, 1), (g, 2),  # r0: before each draft, then the bonus row
        (g, 0), (g, 1), (f, -1),  # r1: a padding draft, then the full mask
        (g, 0), (g, 0), (g, 0),  # r2: its first draft rejected, that row repeated
    ]  # fmt: skip
    assert [r.structured_output_request.grammar.position for r in reqs.values()] == [0, 0, 0]
    assert [r.structured_output_request.grammar.rolled_back for r in reqs.values()] == [2, 1, 0]
    packed = _Bitmask(9)
    end = _native.fill_plain_grammar_rows(packed, -1, requests(2), ["r1", "r0"], {"r0": [1]}, None)
    assert end == 3 and packed.rows[:4] == [(g, 0), (g, 0), (g, 1), "stale"]
    with pytest.raises(KeyError):
        _native.fill_plain_grammar_rows(_Bitmask(4), -1, requests(1), ["nope"], {}, 1)
    with pytest.raises(TypeError):
        _native.fill_plain_grammar_rows(_Bitmask(4), -1, requests(1), ["r0"], {"r0": ["x"]}, 1)
    with pytest.raises((IndexError, OverflowError)):
        _native.fill_plain_grammar_rows(_Bitmask(4), -1, requests(2), ["r0", "r1"], {}, 2**64 - 1)
    short = _Bitmask(2)
    with pytest.raises(IndexError):
        _native.fill_plain_grammar_rows(short, -1, requests(2), ["r0", "r1"], {}, 2)
    assert short.rows == [(g, 0), "stale"]


def test_native_block_hash_declines_what_it_does_not_encode() -> None:
    parent = b"\x01" * 32
    assert _native.vllm_block_hash("sha256", parent, [2**31, 1, 2, 3]) is None
    assert _native.vllm_block_hash("sha256", parent, [1, 2, 3]) is None  # a TUPLE3 block
    assert _native.vllm_block_hash("sha256", b"\x01" * 256, [1, 2, 3, 4]) is None
    assert len(_native.vllm_block_hash("sha256_cbor", parent, [2**40, 1, 2, 3])) == 32
    assert len(_native.vllm_block_hash("xxhash", parent, [1, 2, 3, 4])) == 16
    with pytest.raises(InvalidArgumentError, match="unknown vLLM hash function"):
        _native.vllm_block_hash("md5", parent, [1, 2, 3, 4])


def test_v1_loop_length_rules_saturate_and_refuse_negative_counts() -> None:
    """``refuses_prompt`` / ``length_cap`` at the loop's cache size: a prompt plus the tokens a
    step samples must fit (a pooling model's, sampling none, may fill it); counts past u64
    saturate as Python's unbounded ints compare, a negative one is a pagedkv error that is
    also a ``ValueError``."""
    loop = _native.V1Loop(bound_manager(), loop_config(pool_tokens=64))
    assert loop.length_cap(100) == 64 and loop.length_cap(2**70) == 64
    assert loop.refuses_prompt(64, 100, 1) and not loop.refuses_prompt(63, 100, 1)
    assert not loop.refuses_prompt(64, 100, 0) and loop.refuses_prompt(65, 100, 0)
    assert loop.refuses_prompt(2**70, 2**70, 0)
    for bad in ((-1, 100, 1), (64, -1, 1), (64, 100, -(2**70))):
        with pytest.raises(PagedKVError) as err:
            loop.refuses_prompt(*bad)
        assert isinstance(err.value, ValueError)
    with pytest.raises(PagedKVError):
        loop.length_cap(-5)
