"""The native chained block hasher: chaining, extras, algorithms and the incremental API."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError
from pagedkv.reference import hashing as ref_hashing

TOKENS = list(range(1000, 1100))


def test_one_hash_per_full_block():
    assert len(pagedkv.hash_blocks(TOKENS, 16, hash_seed=1)) == 100 // 16


def test_list_and_arrays_agree():
    expect = pagedkv.hash_blocks(TOKENS, 16, hash_seed=1)
    for dtype in (np.int32, np.int64, np.uint32):
        assert pagedkv.hash_blocks(np.array(TOKENS, dtype=dtype), 16, hash_seed=1) == expect


def test_chaining_changes_every_later_hash():
    a = pagedkv.hash_blocks(TOKENS, 16, hash_seed=1)
    changed = TOKENS.copy()
    changed[20] += 1  # block 1
    b = pagedkv.hash_blocks(changed, 16, hash_seed=1)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:]))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lora_id=1),
        dict(cache_salt="tenant-a"),
        dict(cache_salt=b"x"),
        dict(hash_seed=2),
        dict(hash_algo="sha256"),
    ],
)
def test_extras_seed_and_algorithm_change_hashes(kwargs):
    base = pagedkv.hash_blocks(TOKENS, 16, hash_seed=1)
    other = pagedkv.hash_blocks(TOKENS, 16, **{"hash_seed": 1, **kwargs})
    assert all(x != y for x, y in zip(base, other))


def test_sha256_is_reproducible_and_128_bit():
    a = pagedkv.hash_blocks(TOKENS, 16, hash_algo="sha256", hash_seed=0)
    b = pagedkv.hash_blocks(TOKENS, 16, hash_algo="sha256", hash_seed=0)
    assert a == b
    assert all(0 <= h < 2**128 for h in a)
    assert max(a) > 2**64  # uses the full width


def test_default_seed_is_per_process_and_settable():
    algo, seed = pagedkv.get_default_hasher()
    assert algo == "xxh3"
    assert pagedkv.hash_blocks(TOKENS, 16) == pagedkv.hash_blocks(TOKENS, 16, hash_seed=seed)
    try:
        pagedkv.set_default_hasher("sha256", 7)
        assert pagedkv.get_default_hasher() == ("sha256", 7)
        assert pagedkv.hash_blocks(TOKENS, 16) == pagedkv.hash_blocks(
            TOKENS, 16, hash_algo="sha256", hash_seed=7
        )
    finally:
        pagedkv.set_default_hasher(algo, seed)


def test_incremental_feed_returns_only_new_full_blocks():
    whole = pagedkv.hash_blocks(TOKENS, 16, hash_seed=3)
    h = pagedkv.BlockHasher(16, hash_seed=3)
    got = []
    for i, t in enumerate(TOKENS):
        new = h.feed([t])
        assert len(new) == (1 if (i + 1) % 16 == 0 else 0)
        got += new
    assert got == whole
    assert (h.num_blocks, h.num_pending_tokens) == (6, 4)
    h2 = pagedkv.BlockHasher(16, hash_seed=3)
    assert h2.feed(TOKENS[:40]) + h2.feed(TOKENS[40:]) == whole


def test_token_seq_hashes_each_block_once():
    s = pagedkv.TokenSeq(16, [], hash_seed=3)
    for t in TOKENS:
        s.append(t)
    assert s.hash_calls == 6
    assert s.block_hashes() == pagedkv.hash_blocks(TOKENS, 16, hash_seed=3)
    with pytest.raises(InvalidArgumentError, match="not full"):
        s.hash_of_block(6)
    c = s.copy()
    c.append(1)
    assert len(c) == len(s) + 1


def test_reference_hash_is_chained_like_vllm_v1():
    import hashlib
    import pickle

    hashes = ref_hashing.hash_blocks(TOKENS, 16)
    first = hashlib.sha256(pickle.dumps((None, tuple(TOKENS[:16]), (0,)), protocol=4)).digest()
    assert hashes[0] == int.from_bytes(first[:16], "little")
    chain = ref_hashing.ChainHasher(16)
    assert chain.feed(TOKENS) == hashes


@pytest.mark.parametrize(
    "args,exc",
    [
        (([1, -2], 16), InvalidArgumentError),
        (([1, 2**32], 16), InvalidArgumentError),
        (([1, "2"], 16), ArgumentTypeError),
        (([1, True], 16), InvalidArgumentError),
        (("hello", 16), ArgumentTypeError),
        ((42, 16), ArgumentTypeError),
        ((np.zeros((2, 2), np.int32), 16), InvalidArgumentError),
        ((np.zeros(4, np.float32), 16), InvalidArgumentError),
        (([1, 2], 0), InvalidArgumentError),
        (([1, 2], -16), InvalidArgumentError),
    ],
)
def test_bad_input(args, exc):
    with pytest.raises(exc):
        pagedkv.hash_blocks(*args)


def test_bad_algorithm_and_salt():
    with pytest.raises(InvalidArgumentError):
        pagedkv.hash_blocks(TOKENS, 16, hash_algo="md5")
    with pytest.raises(InvalidArgumentError):
        pagedkv.hash_blocks(TOKENS, 16, cache_salt=3)


def test_numpy_integer_scalars_in_a_list_are_tokens():
    ints = [np.int64(5), np.int32(6), 7, np.uint16(8)]
    assert pagedkv.TokenSeq(4, ints).tokens() == [5, 6, 7, 8]
    with pytest.raises(ArgumentTypeError):
        pagedkv.TokenSeq(4, [np.float32(1.0)])
    with pytest.raises(InvalidArgumentError):
        pagedkv.TokenSeq(4, [np.int64(-1)])
