"""End to end: TinyDecoder.paged_forward over a scrambled paged cache == dense_forward."""

import pytest

torch = pytest.importorskip("torch")

from pagedkv.attention import (  # noqa: E402
    SeqChunk,
    TinyConfig,
    TinyDecoder,
    build_paged_batch,
    copy_blocks,
    swap_blocks,
)

BLOCK_SIZE = 8
NUM_BLOCKS = 24
ATOL = RTOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return TinyDecoder()


def scrambled_blocks(seed, n=NUM_BLOCKS):
    """A pool of physical block ids in random order, to hand out like an allocator."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def prompt(seed, length, vocab=128):
    return torch.randint(vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def blocks_for(num_tokens):
    return -(-num_tokens // BLOCK_SIZE)


def step(model, caches, chunks, *, decode=False):
    """One engine step; returns logits ``[total_new_tokens, vocab]``."""
    batch = build_paged_batch(chunks, BLOCK_SIZE)
    if not decode:
        return model.paged_forward_batch(batch, caches, backend="torch")
    return model.paged_forward(
        batch.input_ids,
        batch.positions,
        batch.slot_mapping,
        caches,
        batch.block_tables,
        batch.context_lens,
        query_start_loc=None,
        backend="torch",
    )


def test_weights_are_deterministic():
    a, b = TinyDecoder(), TinyDecoder()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    c = TinyDecoder(TinyConfig(seed=1))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_chunked_prefill_then_decode_matches_dense(model):
    caches = model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    pool = scrambled_blocks(0)
    tokens = prompt(0, 21)
    table: list[int] = []
    logits_per_pos: list[torch.Tensor] = []

    def feed(new_tokens, num_cached, decode=False):
        while len(table) < blocks_for(num_cached + len(new_tokens)):
            table.append(pool.pop())  # grow the table like a block manager would
        out = step(model, caches, [SeqChunk(new_tokens, num_cached, list(table))], decode=decode)
        logits_per_pos.extend(out)
        return out

    feed(tokens[:13], 0)  # chunk 1: crosses a block boundary, ends mid-block
    out = feed(tokens[13:], 13)  # chunk 2: continues in the partially filled block
    for _ in range(6):  # greedy decode, crossing into the 4th block
        tokens.append(int(out[-1].argmax()))
        out = feed(tokens[-1:], len(tokens) - 1, decode=True)

    dense = model.dense_forward(tokens)
    assert len(logits_per_pos) == len(tokens) == 27
    torch.testing.assert_close(torch.stack(logits_per_pos), dense, atol=ATOL, rtol=RTOL)


def test_mixed_batch_with_shared_prefix(model):
    """A decodes while B prefills only its uncached suffix on top of A's first two blocks."""
    caches = model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    pool = scrambled_blocks(1)
    tokens_a = prompt(1, 19)
    tokens_b = tokens_a[:16] + prompt(2, 7)  # shares 2 full blocks with A
    table_a = [pool.pop() for _ in range(blocks_for(19))]
    table_b = table_a[:2] + [pool.pop()]

    out = step(model, caches, [SeqChunk(tokens_a, 0, table_a)])
    tokens_a.append(int(out[-1].argmax()))

    out = step(
        model,
        caches,
        [SeqChunk(tokens_b[16:], 16, table_b), SeqChunk(tokens_a[-1:], 19, table_a)],
    )
    torch.testing.assert_close(out[:7], model.dense_forward(tokens_b)[16:], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out[7], model.dense_forward(tokens_a)[-1], atol=ATOL, rtol=RTOL)


def test_fork_with_copy_on_write(model):
    """Parallel sampling: B forks A mid-block; the shared last block is copied before writes."""
    caches = model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    pool = scrambled_blocks(2)
    tokens = prompt(3, 19)
    table_a = [pool.pop() for _ in range(blocks_for(19))]
    step(model, caches, [SeqChunk(tokens, 0, table_a)])

    table_b = table_a[:-1] + [pool.pop()]
    copy_blocks(caches, {table_a[-1]: [table_b[-1]]})
    tokens_a, tokens_b = tokens + [5], tokens + [77]
    out = step(
        model,
        caches,
        [SeqChunk([5], 19, table_a), SeqChunk([77], 19, table_b)],
        decode=True,
    )
    torch.testing.assert_close(out[0], model.dense_forward(tokens_a)[-1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out[1], model.dense_forward(tokens_b)[-1], atol=ATOL, rtol=RTOL)


def test_swap_out_and_back_in_elsewhere(model):
    caches = model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    swap_space = model.allocate_kv_caches(4, BLOCK_SIZE, device="cpu")
    pool = scrambled_blocks(3)
    tokens = prompt(4, 20)
    table = [pool.pop() for _ in range(blocks_for(20))]
    step(model, caches, [SeqChunk(tokens, 0, table)])

    swap_blocks(caches, swap_space, {block: i for i, block in enumerate(table)})
    for cache in caches:
        cache[:, table] = float("nan")  # freed blocks get reused by someone else
    new_table = [pool.pop() for _ in table]
    swap_blocks(swap_space, caches, {i: block for i, block in enumerate(new_table)})

    tokens.append(3)
    out = step(model, caches, [SeqChunk([3], 20, new_table)], decode=True)
    torch.testing.assert_close(out[0], model.dense_forward(tokens)[-1], atol=ATOL, rtol=RTOL)


def test_float64_model():
    model = TinyDecoder(dtype=torch.float64)
    caches = model.allocate_kv_caches(8, BLOCK_SIZE)
    assert caches[0].dtype == torch.float64
    tokens = prompt(5, 11)
    out = step(model, caches, [SeqChunk(tokens, 0, [6, 2])])
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, model.dense_forward(tokens), atol=1e-10, rtol=1e-10)


def test_build_paged_batch_layout():
    batch = build_paged_batch(
        [SeqChunk([7, 8, 9], 6, [4, 1, 5]), SeqChunk([3], 2, [0])], block_size=4
    )
    assert batch.input_ids.tolist() == [7, 8, 9, 3]
    assert batch.positions.tolist() == [6, 7, 8, 2]
    # position p -> block_table[p // 4] * 4 + p % 4
    assert batch.slot_mapping.tolist() == [1 * 4 + 2, 1 * 4 + 3, 5 * 4 + 0, 0 * 4 + 2]
    assert batch.block_tables.tolist() == [[4, 1, 5], [0, 0, 0]]
    assert batch.block_tables.dtype == torch.int32
    assert batch.context_lens.tolist() == [9, 3]
    assert batch.query_start_loc.tolist() == [0, 3, 4]
    assert batch.last_token_indices().tolist() == [2, 3]
    with pytest.raises(ValueError, match="cannot hold"):
        build_paged_batch([SeqChunk([1, 2], 7, [0, 1])], block_size=4)
