"""Numeric arguments of every native entry point: wrong types raise ArgumentTypeError (also a
TypeError), out-of-range values InvalidArgumentError (a ValueError), never a bare OverflowError,
and the object is left unchanged."""

from __future__ import annotations

import pytest

import pagedkv
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError
from pagedkv.sequence import SamplingParams, Sequence, SequenceGroup

m = pagedkv.BlockSpaceManager(4, 8, 2, enable_caching=True)
seq = Sequence(0, "", [1, 2, 3], 4)
group = SequenceGroup("g", [seq], SamplingParams(), 0.0)
m.allocate(group)
pool = pagedkv.BlockPool(4, 4)
store = pagedkv.TokenSeq(4, [1, 2, 3, 4, 5])

CASES = [
    ("append_slots lookahead", lambda: m.append_slots(seq, -1), InvalidArgumentError),
    ("can_append_slots lookahead", lambda: m.can_append_slots(group, 2**70), InvalidArgumentError),
    ("can_swap_in lookahead", lambda: m.can_swap_in(group, "1"), ArgumentTypeError),
    ("access time type", lambda: m.access_all_blocks_in_seq(seq, "now"), ArgumentTypeError),
    (
        "access time nan",
        lambda: m.access_all_blocks_in_seq(seq, float("nan")),
        InvalidArgumentError,
    ),
    (
        "manager hash_seed",
        lambda: pagedkv.BlockSpaceManager(4, 8, 2, hash_seed=-1),
        InvalidArgumentError,
    ),
    (
        "manager watermark",
        lambda: pagedkv.BlockSpaceManager(4, 8, 2, watermark="x"),
        ArgumentTypeError,
    ),
    (
        "manager watermark<0",
        lambda: pagedkv.BlockSpaceManager(4, 8, 2, watermark=-0.5),
        InvalidArgumentError,
    ),
    ("manager blocks", lambda: pagedkv.BlockSpaceManager(4, -8, 2), InvalidArgumentError),
    ("manager block_size", lambda: pagedkv.BlockSpaceManager(4.0, 8, 2), ArgumentTypeError),
    (
        "manager window",
        lambda: pagedkv.BlockSpaceManager(4, 8, 2, sliding_window=6),
        InvalidArgumentError,
    ),
    ("pool allocate_many", lambda: pool.allocate_many(-1), InvalidArgumentError),
    ("pool incref n", lambda: pool.incref(0, -1), InvalidArgumentError),
    ("pool touch", lambda: pool.touch(0, None), ArgumentTypeError),
    ("pool lookup parent", lambda: pool.lookup(1, [1] * 4, parent_block=-3), InvalidArgumentError),
    ("pool lookup extra", lambda: pool.lookup(1, [1] * 4, extra_key=-3), InvalidArgumentError),
    ("pool constructor", lambda: pagedkv.BlockPool(2**70, 4), InvalidArgumentError),
    ("store block_tokens", lambda: store.block_tokens(-1), InvalidArgumentError),
    ("store token_slice", lambda: store.token_slice(-1), InvalidArgumentError),
    ("store hash_of_block", lambda: store.hash_of_block(2**70), InvalidArgumentError),
    ("store block_size", lambda: pagedkv.TokenSeq("4", [1]), ArgumentTypeError),
    ("store lora_id", lambda: pagedkv.TokenSeq(4, [1], lora_id=2**70), InvalidArgumentError),
    ("hash seed", lambda: pagedkv.hash_blocks([1], 4, hash_seed=2**70), InvalidArgumentError),
    ("default hasher seed", lambda: pagedkv.set_default_hasher("xxh3", -5), InvalidArgumentError),
]


@pytest.mark.parametrize("name,call,exc", CASES, ids=[c[0] for c in CASES])
def test_typed_errors_and_no_change(name, call, exc):
    before = (
        m.get_block_table(seq),
        m.get_num_free_gpu_blocks(),
        pool.num_free,
        len(store),
        pagedkv.get_default_hasher(),
    )
    with pytest.raises(exc):
        call()
    after = (
        m.get_block_table(seq),
        m.get_num_free_gpu_blocks(),
        pool.num_free,
        len(store),
        pagedkv.get_default_hasher(),
    )
    assert before == after


def test_hash_seeds_use_the_whole_u64_range():
    top = 2**64 - 1
    assert pagedkv.hash_blocks([1, 2, 3, 4], 4, hash_seed=top) != pagedkv.hash_blocks(
        [1, 2, 3, 4], 4, hash_seed=0
    )
    assert pagedkv.BlockSpaceManager(4, 8, 2, hash_seed=top).hasher == ("xxh3", top)
    with pytest.raises(InvalidArgumentError):
        pagedkv.TokenSeq(4, [1], hash_seed=2**64)
