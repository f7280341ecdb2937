"""pagedkv's native block hash against vLLM's own, for every ``prefix_caching_hash_algo``:
the native loop hashes the blocks a request fills while decoding itself, and KV events,
connectors and routers key on those bytes, so they must be vLLM's exactly."""

from __future__ import annotations

import collections
import random

import pytest
from v1_harness import HASH_ALGOS
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, hash_block_tokens

from pagedkv import _native
from pagedkv.vllm_v1._hashing import hash_name_of

#: vLLM 0.33's lookahead block hashes (``num_hash_lookahead_tokens``); 0.32 has none.
HAS_LOOKAHEAD = "num_hash_lookahead_tokens" in get_request_block_hasher.__code__.co_varnames
LOOKAHEAD = pytest.mark.lookahead_hashes  # deselected where vLLM has none (conftest.py)

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
    name_of = hash_name_of(16)
    for algo in HASH_ALGOS:
        assert name_of(get_request_block_hasher(16, get_hash_fn_by_name(algo))) == algo
    sha = get_hash_fn_by_name("sha256")
    assert name_of(get_request_block_hasher(32, sha)) is None  # another block size
    assert name_of(get_request_block_hasher(16, lambda x: sha(x))) is None  # another function
    assert name_of(lambda request: []) is None
    assert name_of(None) is None
    if not HAS_LOOKAHEAD:
        return
    lookahead = get_request_block_hasher(16, sha, num_hash_lookahead_tokens=1)
    assert name_of(lookahead) is None  # another lookahead than the scheduler's
    assert hash_name_of(16, 1)(lookahead) == "sha256"
    assert hash_name_of(16, 2)(lookahead) is None
    stand_in = _native.VllmBlockHasher("sha256", 16, lookahead, 1)
    assert hash_name_of(16, 1)(stand_in) == "sha256" and name_of(stand_in) is None


def _request(prompt: list, hasher: object, **kwargs: object) -> object:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id="r",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=10_000),
        pooling_params=None,
        arrival_time=0.0,
        block_hasher=hasher,
        **kwargs,
    )


def _appended_in_step(
    vllm_hasher: object, stand_in: object, block_size: int, rng: random.Random, **kwargs: object
) -> list:
    """Three prompts (short, several blocks, a salted first block), each as two requests, one
    hashed by vLLM's hasher and one by the stand-in, the same tokens appended one by one (wide
    ones among them): the block hashes are equal at the start and after every token. Returns
    the reference requests. ``kwargs``: more of the requests' fields (a LoRA adapter)."""
    refs = []
    for prompt_len, salt in ((3, None), (block_size * 3 + 1, None), (block_size + 2, "salt")):
        prompt = [rng.randrange(1000) for _ in range(prompt_len)]
        ref = _request(prompt, vllm_hasher, cache_salt=salt, **kwargs)
        test = _request(prompt, stand_in, cache_salt=salt, **kwargs)
        assert test.block_hashes == ref.block_hashes
        for _ in range(12 * block_size):
            t = rng.choice(EDGE_TOKENS) if rng.random() < 0.02 else rng.randrange(50_000)
            ref.append_output_token_ids(t)
            test.append_output_token_ids(t)
            assert test.block_hashes == ref.block_hashes
        refs.append(ref)
    return refs


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_native_stand_in_hashes_as_vllms_hasher(algo: str, block_size: int) -> None:
    """vLLM's Request with vLLM's hasher and with pagedkv's stand-in, the same tokens
    appended one by one (wide ones among them, so the stand-in hands some calls back):
    the block hashes are equal after every token."""
    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    vllm_hasher = get_request_block_hasher(block_size, hash_fn)
    stand_in = _native.VllmBlockHasher(algo, block_size, vllm_hasher)
    for ref in _appended_in_step(vllm_hasher, stand_in, block_size, random.Random(block_size)):
        assert len(ref.block_hashes) >= 12


def test_schedulers_hand_in_scope_requests_the_native_stand_in() -> None:
    """pagedkv's scheduler swaps vLLM's hasher for the stand-in on in-scope requests only."""
    from pagedkv.vllm_v1._hashing import NativeHashers

    sha = get_hash_fn_by_name("sha256")
    hashers = NativeHashers(16)
    vllm_hasher = get_request_block_hasher(16, sha)
    plain = _request(range(40), vllm_hasher)
    assert hashers.hash_natively(plain)
    assert isinstance(plain._block_hasher, _native.VllmBlockHasher)
    assert plain._block_hasher.original is vllm_hasher
    assert hashers.hash_natively(_request(range(40), vllm_hasher, lora_request=_lora("a", "/a")))
    assert not hashers.hash_natively(_request(range(40), get_request_block_hasher(32, sha)))
    assert not hashers.hash_natively(_request(range(40), None))
    assert not hashers.hash_natively(_request(range(40), lambda r: []))


@LOOKAHEAD
@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_native_lookahead_block_hash_is_vllms(algo: str) -> None:
    """``hash_fn((parent, tokens, (None, *ahead)))``, the hash vLLM 0.33's hasher gives a
    block of a request without extra keys when its next tokens are ``ahead``."""
    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    rng = random.Random(algo + "ahead")
    parent = hash_block_tokens(hash_fn, None, [1, 2, 3, 4], None)
    native = 0
    for case in range(300):
        tokens = [rng.randrange(2**17) for _ in range(rng.choice((4, 16)))]
        ahead = [
            rng.choice(EDGE_TOKENS) if rng.random() < 0.05 else rng.randrange(2**17)
            for _ in range(rng.choice((1, 1, 2, 3, 5)))
        ]
        want = hash_block_tokens(hash_fn, parent, tokens, (None, *ahead))
        got = _native.vllm_block_hash(algo, parent, tokens, ahead)
        if got is None:
            assert "cbor" not in algo and any(not -(2**31) <= t < 2**31 for t in ahead)
        else:
            assert got == want, (case, tokens, ahead)
            native += 1
        parent = want
    assert native > 250


@LOOKAHEAD
@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize("lookahead", [1, 2, 4])
def test_native_stand_in_hashes_as_vllms_lookahead_hasher(algo: str, lookahead: int) -> None:
    """vLLM 0.33's lookahead hasher and pagedkv's stand-in for it, the same tokens appended
    one by one (a block is hashed only once its lookahead tokens exist): equal hashes after
    every token, a salted first block included."""
    block_size = 4
    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    vllm_hasher = get_request_block_hasher(block_size, hash_fn, num_hash_lookahead_tokens=lookahead)
    handed_back = []

    def original(request: object) -> object:
        handed_back.append(1)
        return vllm_hasher(request)

    stand_in = _native.VllmBlockHasher(algo, block_size, original, lookahead)
    assert stand_in.lookahead == lookahead
    rng = random.Random(algo + str(lookahead))
    for ref in _appended_in_step(vllm_hasher, stand_in, block_size, rng):
        assert len(ref.block_hashes) == (ref.num_tokens - lookahead) // block_size >= 11
    # Handed back: calls before the first hash exists, and the few with a wide token.
    assert len(handed_back) < 40, len(handed_back)


def _lora(name: str, path: str, int_id: int = 1) -> object:
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, int_id, path)


#: LoRA names and paths: non-ASCII, at and past the 255-byte limit (pickle's short string),
#: the tag's own text (memoized by identity in the pickle: vLLM's hasher keeps those).
LORA_STRINGS = ("sql", "/adapters/sql-v2", "é-adapter", "x" * 255, "y" * 256, "lora", "ö" * 128)


def _lora_key(rng: random.Random) -> tuple:
    """A name and a path, distinct objects (equal text or not), as a request's would be."""
    return (rng.choice(LORA_STRINGS), rng.choice(LORA_STRINGS[:-1] + ("/p",)).encode().decode())


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_native_lora_block_hash_is_vllms(algo: str) -> None:
    """A LoRA request's block past its first: ``hash_fn((parent, tokens, E))``, ``E`` vLLM's
    ``(("lora", name, path),)``, and with lookahead tokens (vLLM 0.33) ``(E, *ahead)``;
    declined only for strings the encoding does not cover (``"lora"``, over 255 bytes)."""
    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    rng = random.Random(algo + "lora")
    parent = hash_block_tokens(hash_fn, None, [1, 2, 3, 4], None)
    native = 0
    for case in range(300):
        tokens = [rng.randrange(2**17) for _ in range(rng.choice((4, 16)))]
        name, path = _lora_key(rng)
        keys = (("lora", name, path),)
        ahead = [rng.randrange(2**17) for _ in range(rng.choice((0, 1, 2, 3)))]
        if ahead and not HAS_LOOKAHEAD:
            ahead = []
        want = hash_block_tokens(hash_fn, parent, tokens, (keys, *ahead) if ahead else keys)
        got = _native.vllm_block_hash(algo, parent, tokens, ahead, (name, path))
        if got is None:
            assert {name, path} & {"lora"} or max(len(s.encode()) for s in (name, path)) > 255
        else:
            assert got == want, (case, name, path, ahead)
            native += 1
        parent = want
    assert native > 100


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_native_stand_in_hashes_lora_requests_as_vllms_hasher(algo: str) -> None:
    """LoRA requests (every string of :data:`LORA_STRINGS`, and a name that is the path's
    very object, which the pickle memoizes) hashed by vLLM's hasher and by the stand-in, the
    same tokens appended one by one: equal hashes after every token; the stand-in hands back
    only what its encoding does not cover."""
    block_size = 4
    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    vllm_hasher = get_request_block_hasher(block_size, hash_fn)
    handed_back: list = []

    def original(request: object) -> object:
        handed_back.append(request.lora_request.lora_name)
        return vllm_hasher(request)

    stand_in = _native.VllmBlockHasher(algo, block_size, original)
    rng = random.Random(algo)
    same = "/shared/" + str(rng.random())
    for name, path in [(n, "/p") for n in LORA_STRINGS] + [(same, same), ("a", "lora")]:
        _appended_in_step(vllm_hasher, stand_in, block_size, rng, lora_request=_lora(name, path))
    counts = collections.Counter(handed_back)
    covered = [n for n in LORA_STRINGS if n != "lora" and len(n.encode()) <= 255]
    assert min(counts[n] for n in ("lora", "y" * 256, "ö" * 128, same, "a")) > 30
    assert max(counts[n] for n in covered) < 10  # first blocks, wide tokens
