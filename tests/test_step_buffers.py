"""StepBuffers: persistent decode-step metadata fed by the manager's batch API."""

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from pagedkv import (  # noqa: E402
    BlockSpaceManager,
    Logprob,
    SamplingParams,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from pagedkv.attention import DeviceView, StepBuffers  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402

BS = 4
MAX_BLOCKS = 8


def make_group(seq_id, prompt_len, *, offset=0):
    seq = Sequence(seq_id, "p", [(offset + i) % 97 for i in range(prompt_len)], BS)
    return seq, SequenceGroup(f"r{seq_id}", [seq], SamplingParams(), 0.0)


def running(manager, *lens):
    seqs = []
    for i, n in enumerate(lens):
        seq, group = make_group(i, n, offset=31 * i)
        manager.allocate(group)
        seq.status = SequenceStatus.RUNNING
        seqs.append(seq)
    return seqs


def grow(seqs, step):
    for seq in seqs:
        token = (seq.seq_id * 7 + step) % 97
        seq.append_token_id(token, {token: Logprob(0.0)})


def expected_rows(manager, seqs, pad):
    tables = np.full((len(seqs), MAX_BLOCKS), pad, dtype=np.int32)
    slots, ctx = [], []
    for i, seq in enumerate(seqs):
        table = manager.get_block_table(seq)
        tables[i, : len(table)] = table
        p = seq.get_len() - 1
        slots.append(table[p // BS] * BS + p % BS)
        ctx.append(seq.get_len())
    return tables, np.array(slots, np.int32), np.array(ctx, np.int32)


@pytest.mark.parametrize("pad", [0, -1])
def test_decode_steps_reuse_buffers_and_match_the_manager(pad):
    manager = BlockSpaceManager(BS, 64, 8, enable_caching=True)
    seqs = running(manager, 5, 9, 3)
    bufs = StepBuffers(4, MAX_BLOCKS, device="cpu", pad_value=pad)
    assert not bufs.pinned and bufs.device.type == "cpu"
    ptrs = None
    for step in range(10):
        grow(seqs, step)
        cow, view = bufs.decode_step(manager, seqs)
        assert cow == {}
        assert isinstance(view, DeviceView) and view.num_seqs == 3
        tables, slots, ctx = expected_rows(manager, seqs, pad)
        np.testing.assert_array_equal(view.block_tables.numpy(), tables)
        np.testing.assert_array_equal(view.slot_mapping.numpy(), slots)
        np.testing.assert_array_equal(view.context_lens.numpy(), ctx)
        np.testing.assert_array_equal(view.positions.numpy(), ctx - 1)
        np.testing.assert_array_equal(view.input_ids.numpy(), [s.get_last_token_id() for s in seqs])
        for t in (view.block_tables, view.slot_mapping, view.context_lens):
            assert t.dtype == torch.int32
        # host side equals the device side
        host = bufs.host_view()
        for name in ("block_tables", "slot_mapping", "context_lens", "positions", "input_ids"):
            assert torch.equal(getattr(host, name), getattr(view, name)), name
        # the same memory every step: host buffers, their numpy views and device views
        now = (
            bufs.block_tables.data_ptr(),
            bufs.slot_mapping.data_ptr(),
            bufs.context_lens.data_ptr(),
            view.block_tables.data_ptr(),
            view.slot_mapping.data_ptr(),
            view.context_lens.data_ptr(),
            view.positions.data_ptr(),
            view.input_ids.data_ptr(),
        )
        assert ptrs is None or now == ptrs
        ptrs = now
        assert bufs.block_tables_np.ctypes.data == bufs.block_tables.data_ptr()
        assert bufs.slot_mapping_np.ctypes.data == bufs.slot_mapping.data_ptr()
        assert bufs.context_lens_np.ctypes.data == bufs.context_lens.data_ptr()


def test_fewer_sequences_slice_the_views():
    manager = BlockSpaceManager(BS, 64, 8)
    seqs = running(manager, 6, 6, 6)
    bufs = StepBuffers(3, MAX_BLOCKS, device="cpu")
    grow(seqs, 0)
    _, view3 = bufs.decode_step(manager, seqs)
    grow(seqs[:1], 1)
    _, view1 = bufs.decode_step(manager, seqs[:1])
    assert view1.num_seqs == 1 and view1.block_tables.shape == (1, MAX_BLOCKS)
    assert view1.block_tables.data_ptr() == view3.block_tables.data_ptr()
    tables, slots, ctx = expected_rows(manager, seqs[:1], 0)
    np.testing.assert_array_equal(view1.block_tables.numpy(), tables)
    np.testing.assert_array_equal(view1.slot_mapping.numpy(), slots)
    np.testing.assert_array_equal(view1.context_lens.numpy(), ctx)


def test_append_in_parts_and_copy_on_write():
    """Rows accumulate over several ``append`` calls (one per group); a fork's shared
    partial block is copied on write."""
    manager = BlockSpaceManager(BS, 64, 8)
    (a,) = running(manager, 6)
    seq, group = make_group(10, 7, offset=50)
    manager.allocate(group)
    seq.status = SequenceStatus.RUNNING
    child = seq.fork(11)
    group.add(child)
    manager.fork(seq, child)
    grow([a, seq, child], 0)
    shared_last = manager.get_block_table(seq)[-1]

    bufs = StepBuffers(4, MAX_BLOCKS, device="cpu")
    bufs.begin_step()
    assert bufs.append(manager, [a]) == {}
    cow = bufs.append(manager, [seq, child])
    assert bufs.num_seqs == 3
    assert list(cow.keys()) == [shared_last] and len(cow[shared_last]) == 1
    assert manager.get_block_table(seq)[-1] == cow[shared_last][0]
    assert manager.get_block_table(child)[-1] == shared_last
    view = bufs.to_device()
    tables, slots, ctx = expected_rows(manager, [a, seq, child], 0)
    np.testing.assert_array_equal(view.block_tables.numpy(), tables)
    np.testing.assert_array_equal(view.slot_mapping.numpy(), slots)
    np.testing.assert_array_equal(view.context_lens.numpy(), ctx)
    bufs.begin_step()
    assert bufs.num_seqs == 0


def test_too_many_sequences_changes_nothing():
    manager = BlockSpaceManager(BS, 64, 8)
    seqs = running(manager, 4, 4, 4)
    grow(seqs, 0)
    bufs = StepBuffers(2, MAX_BLOCKS, device="cpu")
    free = manager.get_num_free_gpu_blocks()
    with pytest.raises(InvalidArgumentError):
        bufs.decode_step(manager, seqs)
    assert manager.get_num_free_gpu_blocks() == free
    assert bufs.num_seqs == 0
    # the sequences still get their slots afterwards
    bufs.begin_step()
    bufs.append(manager, seqs[:2])
    assert bufs.num_seqs == 2
    with pytest.raises(InvalidArgumentError):
        bufs.append(manager, seqs[2:])
    assert bufs.num_seqs == 2
    tables, slots, ctx = expected_rows(manager, seqs[:2], 0)
    np.testing.assert_array_equal(bufs.to_device().slot_mapping.numpy(), slots)


def test_table_too_narrow_is_rejected_without_changes():
    manager = BlockSpaceManager(BS, 64, 8)
    seqs = running(manager, 4 * MAX_BLOCKS)
    grow(seqs, 0)  # needs MAX_BLOCKS + 1 blocks
    bufs = StepBuffers(2, MAX_BLOCKS, device="cpu")
    free = manager.get_num_free_gpu_blocks()
    with pytest.raises(InvalidArgumentError):
        bufs.decode_step(manager, seqs)
    assert manager.get_num_free_gpu_blocks() == free
    assert bufs.num_seqs == 0


def test_bad_sizes():
    for args in [(0, 4), (4, 0), (True, 4), (2.0, 4)]:
        with pytest.raises(InvalidArgumentError):
            StepBuffers(*args, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_buffers_are_pinned_and_copied():
    manager = BlockSpaceManager(BS, 64, 8)
    seqs = running(manager, 5, 9)
    bufs = StepBuffers(4, MAX_BLOCKS)
    assert bufs.pinned and bufs.block_tables.is_pinned() and bufs.device.type == "cuda"
    grow(seqs, 0)
    _, view = bufs.decode_step(manager, seqs)
    assert view.block_tables.is_cuda
    tables, slots, ctx = expected_rows(manager, seqs, 0)
    np.testing.assert_array_equal(view.block_tables.cpu().numpy(), tables)
    np.testing.assert_array_equal(view.slot_mapping.cpu().numpy(), slots)
    np.testing.assert_array_equal(view.context_lens.cpu().numpy(), ctx)


def test_explicit_input_ids():
    manager = BlockSpaceManager(BS, 64, 8)
    seqs = running(manager, 5, 6)
    grow(seqs, 0)
    bufs = StepBuffers(2, MAX_BLOCKS, device="cpu")
    free = manager.get_num_free_gpu_blocks()
    with pytest.raises(InvalidArgumentError):
        bufs.decode_step(manager, seqs, input_ids=[1])
    assert manager.get_num_free_gpu_blocks() == free and bufs.num_seqs == 0
    last = [s.get_last_token_id() for s in seqs]
    _, view = bufs.decode_step(manager, seqs, input_ids=np.array(last))
    assert view.input_ids.tolist() == last
    _, slots, _ = expected_rows(manager, seqs, 0)
    np.testing.assert_array_equal(view.slot_mapping.numpy(), slots)
