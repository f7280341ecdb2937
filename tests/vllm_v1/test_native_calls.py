"""The native ``allocate_slots`` callable: vLLM's signature (positional, keyword, errors) and
request ids remembered by object identity."""

from __future__ import annotations

import pytest
from manager_driver import manager_pair
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

BLOCK = 4


def request(rid: str, n: int = 10) -> Request:
    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(1, n + 1)),
        sampling_params=SamplingParams(max_tokens=8),
        pooling_params=None,
        block_hasher=kv_cache_utils.get_request_block_hasher(BLOCK, hash_fn),
    )


def ids(blocks: object) -> object:
    return None if blocks is None else blocks.get_block_ids()


def test_arguments_bind_as_in_vllms_signature() -> None:
    theirs, ours = manager_pair(64, BLOCK, enable_caching=True)
    positional = (0, None, 0, 0, False, 0, False, 0, True, ())
    for m in (theirs, ours):
        r = request("a")
        assert ids(m.allocate_slots(r, 10, *positional)) == ([1, 2, 3],)
        r = request("b")
        got = m.allocate_slots(request=r, num_new_tokens=5, num_lookahead_tokens=3)
        assert ids(got) == ([4, 5],)
    with pytest.raises(TypeError):
        ours.allocate_slots(request("c"), 4, bogus=1)
    with pytest.raises(TypeError):
        ours.allocate_slots(request("c"), 4, 0, num_new_computed_tokens=0)
    with pytest.raises(TypeError):
        ours.allocate_slots(request("c"))
    with pytest.raises(TypeError):
        ours.allocate_slots(request("c"), 4, *positional, 0)
    assert ours._native.num_requests == 2, "a refused call changes nothing"


def test_a_request_freed_through_an_equal_id_is_forgotten() -> None:
    theirs, ours = manager_pair(64, BLOCK, enable_caching=False)
    reqs = {m: request("same-id") for m in (theirs, ours)}
    for m, r in reqs.items():
        m.allocate_slots(r, 10)
    ours._native.free("".join(["same-", "id"]))  # equal text, another object
    theirs.free(reqs[theirs])
    for m, r in reqs.items():
        assert ids(m.allocate_slots(r, 6)) == ([3, 2],)
        assert m.get_block_ids("same-id") == ([3, 2],)
