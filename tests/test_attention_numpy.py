"""The attention ops take the numpy int32 buffers the batch API fills, without a copy, and
answer any other non-tensor argument with ArgumentTypeError and a hint (never AttributeError)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv import (  # noqa: E402
    BlockSpaceManager,
    Logprob,
    SamplingParams,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from pagedkv.attention import (  # noqa: E402
    allocate_kv_cache,
    copy_blocks,
    paged_attention,
    split_kv_cache,
    swap_blocks,
    write_kv,
)
from pagedkv.attention._args import index_tensor  # noqa: E402
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError  # noqa: E402

BLOCK, HEADS, DIM, NUM_BLOCKS = 4, 2, 8, 32


def _decode_step(prompt_lens):
    """A manager with running sequences after one decode step through ``append_slots_batch``;
    returns ``(mgr, seqs, block_tables, context_lens, slot_mapping)`` (numpy int32)."""
    mgr = BlockSpaceManager(BLOCK, NUM_BLOCKS, 8, watermark=0.0)
    seqs = []
    for i, n in enumerate(prompt_lens):
        seq = Sequence(i, "p", list(range(100 * i, 100 * i + n)), block_size=BLOCK)
        mgr.allocate(SequenceGroup(f"r{i}", [seq], SamplingParams(), arrival_time=0.0))
        seq.status = SequenceStatus.RUNNING
        seq.append_token_id(7, {7: Logprob(0.0)})
        seqs.append(seq)
    tables = np.zeros((len(seqs), 4), dtype=np.int32)
    lens = np.zeros(len(seqs), dtype=np.int32)
    slots = np.zeros(len(seqs), dtype=np.int32)
    assert not mgr.append_slots_batch(seqs, tables, lens, slots)
    return mgr, seqs, tables, lens, slots


def test_index_tensor_shares_the_numpy_buffer():
    buf = np.arange(6, dtype=np.int32).reshape(2, 3)
    t = index_tensor(buf, "block_tables")
    assert t.dtype == torch.int32 and t.data_ptr() == buf.ctypes.data
    buf[1, 2] = 99  # the next step's writes are seen without re-wrapping
    assert int(t[1, 2]) == 99


@pytest.mark.parametrize(
    "array",
    [
        np.arange(6, dtype=np.int32)[::-1],  # negative stride
        np.arange(6, dtype=">i4"),  # foreign byte order
        np.frombuffer(np.arange(6, dtype=np.int32).tobytes(), dtype=np.int32),  # read-only
    ],
    ids=["reversed", "big-endian", "read-only"],
)
def test_index_tensor_copies_layouts_torch_cannot_share(array):
    assert index_tensor(array, "x").tolist() == array.tolist()


def test_write_kv_and_attention_take_the_batch_buffers():
    mgr, seqs, tables, lens, slots = _decode_step([5, 8, 3])
    k_cache, v_cache = split_kv_cache(allocate_kv_cache(NUM_BLOCKS, BLOCK, HEADS, DIM))
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(len(seqs), HEADS, DIM, generator=gen)
    write_kv(k_cache, v_cache, key, -key, slots)
    write_kv(k_cache.clone(), v_cache.clone(), key, -key, torch.from_numpy(slots))
    flat = k_cache.view(-1, HEADS, DIM)
    assert torch.equal(flat[torch.from_numpy(slots).long()], key)

    query = torch.randn(len(seqs), HEADS, DIM, generator=gen)
    out_np = paged_attention(query, k_cache, v_cache, tables, lens, backend="torch")
    out_t = paged_attention(
        query, k_cache, v_cache, torch.from_numpy(tables), torch.from_numpy(lens), backend="torch"
    )
    assert torch.equal(out_np, out_t)
    qsl = np.arange(len(seqs) + 1, dtype=np.int32)
    out_qsl = paged_attention(
        query, k_cache, v_cache, tables, lens, query_start_loc=qsl, backend="torch"
    )
    assert torch.equal(out_qsl, out_t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_numpy_buffers_drive_cuda_caches():
    """Host buffers, device caches: the ops move the wrapped indices to the cache's device."""
    mgr, seqs, tables, lens, slots = _decode_step([5, 8, 3])
    cuda = torch.device("cuda")
    cache = allocate_kv_cache(NUM_BLOCKS, BLOCK, HEADS, DIM, device=cuda)
    k_cache, v_cache = split_kv_cache(cache)
    key = torch.randn(len(seqs), HEADS, DIM, device=cuda)
    write_kv(k_cache, v_cache, key, -key, slots)
    query = torch.randn(len(seqs), HEADS, DIM, device=cuda)
    out = paged_attention(query, k_cache, v_cache, tables, lens, backend="torch")
    ref = paged_attention(query.cpu(), k_cache.cpu(), v_cache.cpu(), tables, lens, backend="torch")
    torch.testing.assert_close(out.cpu(), ref)


def test_copy_blocks_takes_a_block_mapping_pairs_and_arrays():
    mgr, seqs, *_ = _decode_step([6])
    child = seqs[0].fork(1)
    mgr.fork(seqs[0], child)
    child.append_token_id(9, {9: Logprob(0.0)})
    cow = mgr.append_slots(child)  # the shared last block is copied
    ((src, (dst,)),) = cow.items()
    gen = torch.Generator().manual_seed(1)
    for pairs in (cow, [(src, dst)], np.array([[src, dst]], dtype=np.int32)):
        cache = torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, DIM, generator=gen)
        copy_blocks([cache], pairs)
        assert torch.equal(cache[:, dst], cache[:, src]), type(pairs)


def test_swap_blocks_takes_a_block_mapping():
    gpu = torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, DIM)
    cpu = torch.zeros(2, 8, BLOCK, HEADS, DIM)
    mgr, seqs, *_ = _decode_step([6])
    group_mapping = mgr.swap_out(SequenceGroup("g", seqs, SamplingParams(), arrival_time=0.0))
    swap_blocks([gpu], [cpu], group_mapping)
    for g, c in group_mapping.items():
        assert torch.equal(cpu[:, c], gpu[:, g])
    swap_blocks([gpu], [cpu], np.array([[0, 7]], dtype=np.int64))
    assert torch.equal(cpu[:, 7], gpu[:, 0])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda a: write_kv(*a["kv"], a["key"], a["key"], [0, 1]), "append_slots_batch"),
        (lambda a: write_kv(*a["kv"], a["key"].numpy(), a["key"], a["slots"]), "from_numpy"),
        (lambda a: write_kv(*a["kv"], a["key"], a["key"], a["slots"].astype(np.float32)), "int32"),
        (lambda a: write_kv(*a["kv"], a["key"], a["key"], a["slots"].astype(np.uint32)), "int32"),
        (lambda a: paged_attention(a["q"], *a["kv"], a["tables"].tolist(), a["lens"]), "tables: "),
        (lambda a: paged_attention(a["q"], *a["kv"], a["tables"], None), "context_lens"),
        (lambda a: copy_blocks([a["cache"]], 5), "mapping"),
        (lambda a: copy_blocks([a["cache"]], [(1, 2, 3)]), "pair"),
        (lambda a: copy_blocks([a["cache"].numpy()], {0: [1]}), "kv_caches"),
    ],
)
def test_wrong_types_raise_argument_type_error_with_a_hint(call, match):
    args = {
        "kv": split_kv_cache(allocate_kv_cache(NUM_BLOCKS, BLOCK, HEADS, DIM)),
        "key": torch.ones(2, HEADS, DIM),
        "slots": np.array([0, 1], dtype=np.int32),
        "q": torch.ones(2, HEADS, DIM),
        "tables": np.zeros((2, 3), dtype=np.int32),
        "lens": np.ones(2, dtype=np.int32),
        "cache": torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM),
    }
    with pytest.raises(ArgumentTypeError, match=match):
        call(args)


def test_bad_numpy_shapes_are_invalid_arguments():
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM)
    with pytest.raises(InvalidArgumentError, match=r"\[n, 2\]"):
        copy_blocks([cache], np.zeros((2, 3), dtype=np.int32))
    k_cache, v_cache = split_kv_cache(cache)
    with pytest.raises(InvalidArgumentError, match="slot_mapping must have shape"):
        write_kv(
            k_cache,
            v_cache,
            torch.ones(2, HEADS, DIM),
            torch.ones(2, HEADS, DIM),
            np.zeros(3, dtype=np.int32),
        )
