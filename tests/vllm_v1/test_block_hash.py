"""pagedkv's native block hash against vLLM's own, for every ``prefix_caching_hash_algo``:
the native loop hashes the blocks a request fills while decoding itself, and KV events,
connectors and routers key on those bytes, so they must be vLLM's exactly."""

from __future__ import annotations

import random

import pytest
from v1_harness import HASH_ALGOS
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, hash_block_tokens

from pagedkv import _native
from pagedkv.vllm_v1._native_loop import _vllm_hash_name_of

EDGE_TOKENS = (0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**40, 2**63 - 1)
EDGE_TOKENS += tuple(-t for t in EDGE_TOKENS[1:-1])


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_native_block_hash_is_vllms(algo: str) -> None:
    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    rng = random.Random(algo)
    parent = hash_block_tokens(hash_fn, None, [1, 2, 3, 4], None)
    native = declined = 0
    for case in range(500):
        n = rng.choice((4, 5, 16, 32, 64))
        tokens = [
            rng.choice(EDGE_TOKENS) if rng.random() < 0.05 else rng.randrange(2**17)
            for _ in range(n)
        ]
        want = hash_block_tokens(hash_fn, parent, tokens, None)
        got = _native.vllm_block_hash(algo, parent, tokens)
        if got is None:
            # Only pickle declines, and only for a token outside 32-bit ints.
            assert "cbor" not in algo and any(not -(2**31) <= t < 2**31 for t in tokens)
            declined += 1
        else:
            assert got == want, (case, tokens)
            native += 1
        parent = want
    assert native > 300 and ("cbor" in algo or declined > 0)


def test_vllms_own_hasher_is_recognized_and_nothing_else() -> None:
    name_of = _vllm_hash_name_of(16)
    for algo in HASH_ALGOS:
        assert name_of(get_request_block_hasher(16, get_hash_fn_by_name(algo))) == algo
    sha = get_hash_fn_by_name("sha256")
    assert name_of(get_request_block_hasher(32, sha)) is None  # another block size
    assert name_of(get_request_block_hasher(16, lambda x: sha(x))) is None  # another function
    assert name_of(lambda request: []) is None
    assert name_of(None) is None
    try:
        lookahead = get_request_block_hasher(16, sha, 1)
    except TypeError:  # 0.32: no lookahead tokens
        return
    assert name_of(lookahead) is None
