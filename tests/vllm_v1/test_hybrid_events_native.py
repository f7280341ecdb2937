"""The hybrid manager's KV events are built natively (``rust/py/src/vllm_v1/events.rs``) for
plain requests, and by the Python builder (``HybridKVCacheManager._stored``) for requests
with extra hash keys (LoRA, cache salt), with vLLM's contents either way: the events of
pagedkv's hybrid manager and vLLM's own are compared object by object, on a GPT-OSS-like
layout and on one whose groups have different block sizes."""

from __future__ import annotations

from typing import Any, List, Optional

import pytest
from manager_driver import event_repr, manager_pair, scheduler_scale
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from pagedkv.vllm_v1._hybrid import HybridKVCacheManager

BLOCK_SIZE = 4


def _requests(salted: bool) -> List[Request]:
    """Prompts sharing a prefix (hits), long enough to fill the pool (evictions); with
    ``salted`` every other one has a cache salt or a LoRA adapter."""
    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, hash_fn)
    prefix = list(range(1, 17))
    out = []
    for n in range(8):
        salt: Optional[str] = None
        lora: Optional[LoRARequest] = None
        if salted and n % 2:
            if n % 4 == 1:
                salt = "tenant-a"
            else:
                lora = LoRARequest("adapter", 1, "/nonexistent")
        out.append(
            Request(
                request_id=f"r{n}",
                prompt_token_ids=prefix + [100 + n] * (8 + 4 * n),
                sampling_params=SamplingParams(max_tokens=8),
                pooling_params=None,
                cache_salt=salt,
                lora_request=lora,
                block_hasher=hasher,
            )
        )
    return out


def _run(layout: str, requests: List[Request]) -> List[tuple]:
    """Admit, allocate and free each request on both managers, comparing every step's
    events; the events seen, as ``event_repr`` shows them."""
    vllm, ours = manager_pair(
        48,
        BLOCK_SIZE,
        layout,
        enable_caching=True,
        enable_kv_cache_events=True,
        log_stats=False,
    )
    step = BLOCK_SIZE * scheduler_scale(layout)
    seen: List[tuple] = []
    for req in requests:
        computed = []
        for m in (vllm, ours):
            hit, n, junction = m.get_computed_blocks(req)
            computed.append((m, hit, n))
        assert computed[0][2] == computed[1][2], "prefix-cache hits differ"
        req.shared_prefix_boundary = junction
        for m, hit, n in computed:
            new = (req.num_tokens - n) // step * step
            assert m.allocate_slots(req, new, n, hit) is not None
        for m, _, _ in computed:
            m.free(req)
        ev_vllm = [event_repr(e) for e in vllm.take_events()]
        assert [event_repr(e) for e in ours.take_events()] == ev_vllm, req.request_id
        seen += ev_vllm
    assert vllm.reset_prefix_cache() and ours.reset_prefix_cache()
    ev_vllm = [event_repr(e) for e in vllm.take_events()]
    assert [event_repr(e) for e in ours.take_events()] == ev_vllm
    return seen + ev_vllm


def _groups(events: List[tuple], kind: str) -> set:
    """The `group_idx` reprs of the events of `kind`."""
    return {dict(e[1:])["group_idx"] for e in events if e[0] == kind}


@pytest.mark.parametrize("layout", ["gpt-oss", "mixed-blocks"])
@pytest.mark.parametrize("int_hashes", ["0", "1"])
def test_plain_requests_take_the_native_path(
    layout: str, int_hashes: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", int_hashes)

    def python_builder(*args: Any) -> Any:
        raise AssertionError("the Python event builder was called for a plain request")

    monkeypatch.setattr(HybridKVCacheManager, "_stored", python_builder)
    monkeypatch.setattr(HybridKVCacheManager, "_removed", python_builder)
    events = _run(layout, _requests(salted=False))
    num_groups = 3 if layout == "mixed-blocks" else 2
    assert _groups(events, "BlockStored") == {repr(g) for g in range(num_groups)}, events
    assert _groups(events, "BlockRemoved"), "no eviction: the pool is too large"
    assert events[-1][0] == "AllBlocksCleared"


@pytest.mark.parametrize("layout", ["gpt-oss", "mixed-blocks"])
def test_lora_and_salted_requests_fall_back_to_vllms_event(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    built_in_python: List[str] = []
    stored = HybridKVCacheManager._stored

    def spy(self: Any, request: Any, *args: Any) -> Any:
        built_in_python.append(request.request_id)
        return stored(self, request, *args)

    monkeypatch.setattr(HybridKVCacheManager, "_stored", spy)
    requests = _requests(salted=True)
    events = _run(layout, requests)
    extra = {r.request_id for r in requests if r.cache_salt or r.lora_request}
    assert set(built_in_python) == extra
    lora = [e for e in events if e[0] == "BlockStored" and dict(e[1:])["lora_name"] != "None"]
    assert lora, "no LoRA event"
