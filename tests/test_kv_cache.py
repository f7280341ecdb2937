"""Paged KV-cache tensor ops: allocation, slot-mapping writes, copy-on-write, swapping."""

import pytest

torch = pytest.importorskip("torch")

from pagedkv.attention import (  # noqa: E402
    allocate_kv_cache,
    copy_blocks,
    split_kv_cache,
    swap_blocks,
    write_kv,
)
from pagedkv.errors import ArgumentTypeError  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM = 6, 4, 2, 3


def random_cache(seed, num_blocks=NUM_BLOCKS):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, BLOCK_SIZE, HEADS, DIM, generator=gen)


def test_allocate_layout_and_views():
    cache = allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, dtype=torch.float16)
    assert cache.shape == (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM)
    assert cache.dtype == torch.float16 and cache.device.type == "cpu"
    assert not cache.any()
    k_cache, v_cache = split_kv_cache(cache)
    assert k_cache.shape == (NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    k_cache.fill_(1)
    assert cache[0].eq(1).all() and not cache[1].any()  # views share storage


@pytest.mark.parametrize("bad", [{"num_blocks": 0}, {"block_size": -4}, {"head_dim": 2.0}])
def test_allocate_rejects_bad_sizes(bad):
    sizes = {"num_blocks": 2, "block_size": 4, "num_kv_heads": 1, "head_dim": 8} | bad
    with pytest.raises(ValueError):
        allocate_kv_cache(**sizes)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_scatters_and_skips_padding(slot_dtype):
    cache = allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM)
    k_cache, v_cache = split_kv_cache(cache)
    key = torch.arange(5 * HEADS * DIM, dtype=torch.float32).view(5, HEADS, DIM) + 1
    value = -key
    slots = torch.tensor([9, -1, 0, 23, 4], dtype=slot_dtype)  # -1: padding token
    write_kv(k_cache, v_cache, key, value, slots)

    expected_k = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, HEADS, DIM)
    for token, slot in [(0, 9), (2, 0), (3, 23), (4, 4)]:
        expected_k[slot] = key[token]
    expected_k = expected_k.view(NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, -expected_k)
    assert torch.equal(k_cache[2, 1], key[0])  # slot 9 = block 2, offset 1


def test_write_kv_casts_to_cache_dtype():
    cache = allocate_kv_cache(2, BLOCK_SIZE, HEADS, DIM, dtype=torch.bfloat16)
    k_cache, v_cache = split_kv_cache(cache)
    key = torch.ones(1, HEADS, DIM)
    write_kv(k_cache, v_cache, key, 2 * key, torch.tensor([5]))
    assert k_cache.dtype == torch.bfloat16 and k_cache[1, 1].eq(1).all()
    assert v_cache[1, 1].eq(2).all()


def _strided_cache():
    """Right shape, not contiguous."""
    return torch.zeros(BLOCK_SIZE, NUM_BLOCKS, HEADS, DIM).transpose(0, 1)


def _write_args():
    k_cache, v_cache = split_kv_cache(allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM))
    key = torch.ones(3, HEADS, DIM)
    return {
        "k_cache": k_cache,
        "v_cache": v_cache,
        "key": key,
        "value": key.clone(),
        "slot_mapping": torch.tensor([0, 1, 2]),
    }


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.update(slot_mapping=torch.tensor([0, 1, 24])), "out of range"),
        (lambda a: a.update(slot_mapping=torch.tensor([0, 1])), "slot_mapping must have shape"),
        (lambda a: a.update(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), "integer"),
        (lambda a: a.update(key=torch.ones(3, HEADS + 1, DIM)), "key must have shape"),
        (lambda a: a.update(value=torch.ones(2, HEADS, DIM)), "same number of tokens"),
        (lambda a: a.update(v_cache=a["v_cache"][:2]), "does not match"),
        (lambda a: a.update(k_cache=a["k_cache"][0]), "k_cache must have shape"),
        (lambda a: a.update(k_cache=_strided_cache(), v_cache=_strided_cache()), "contiguous"),
    ],
)
def test_write_kv_rejects_bad_arguments(change, match):
    args = _write_args()
    change(args)
    with pytest.raises(ValueError, match=match):
        write_kv(**args)


def test_copy_blocks_one_source_to_many_destinations():
    caches = [random_cache(1), random_cache(2)]
    before = [c.clone() for c in caches]
    copy_blocks(caches, {1: [3, 5], 2: [0]})
    for cache, old in zip(caches, before):
        expected = old.clone()
        expected[:, 3] = old[:, 1]
        expected[:, 5] = old[:, 1]
        expected[:, 0] = old[:, 2]
        assert torch.equal(cache, expected)


def test_copy_blocks_reads_all_sources_before_writing():
    cache = random_cache(3)
    old = cache.clone()
    copy_blocks([cache], {0: [1], 1: [2]})  # block 1 is both a destination and a source
    assert torch.equal(cache[:, 1], old[:, 0])
    assert torch.equal(cache[:, 2], old[:, 1])


def test_copy_blocks_empty_is_noop():
    cache = random_cache(4)
    old = cache.clone()
    copy_blocks([cache], {})
    copy_blocks([cache], {1: []})
    assert torch.equal(cache, old)


@pytest.mark.parametrize(
    "mapping, match",
    [
        ({1: [6]}, "out of range"),
        ({-1: [2]}, "out of range"),
        ({1: [2], 3: [2]}, "duplicate"),
        ({1: ["2"]}, "must be an int"),
    ],
)
def test_copy_blocks_rejects_bad_ids(mapping, match):
    with pytest.raises(ValueError, match=match):
        copy_blocks([random_cache(5)], mapping)


def test_type_errors_are_argument_type_errors():
    with pytest.raises(ArgumentTypeError):
        copy_blocks([random_cache(5)], {1: [2.0]})
    args = _write_args()
    args["slot_mapping"] = args["slot_mapping"].float()
    with pytest.raises(TypeError):
        write_kv(**args)
    copy_blocks([random_cache(5)], {1: [np_int(2)]})  # any __index__ int is fine


def np_int(value):
    """An int-like that is not an int (like numpy.int64)."""

    class IntLike:
        def __index__(self):
            return value

    return IntLike()


def test_copy_blocks_rejects_bad_caches():
    with pytest.raises(ValueError, match="kv_caches"):
        copy_blocks([random_cache(5)[0]], {0: [1]})
    with pytest.raises(ValueError, match="differs"):
        copy_blocks([random_cache(5), random_cache(5, num_blocks=3)], {0: [1]})


def test_swap_round_trip():
    device_caches = [random_cache(10), random_cache(11)]
    swap_space = [torch.zeros(2, 3, BLOCK_SIZE, HEADS, DIM) for _ in range(2)]
    originals = [c.clone() for c in device_caches]

    swap_blocks(device_caches, swap_space, {4: 0, 1: 2})  # swap out
    for cpu, dev in zip(swap_space, originals):
        assert torch.equal(cpu[:, 0], dev[:, 4])
        assert torch.equal(cpu[:, 2], dev[:, 1])
        assert not cpu[:, 1].any()

    for cache in device_caches:
        cache[:, [1, 4, 5]] = 0  # blocks freed and reused
    swap_blocks(swap_space, device_caches, {0: 5, 2: 1})  # swap in elsewhere
    for dev, old in zip(device_caches, originals):
        assert torch.equal(dev[:, 5], old[:, 4])
        assert torch.equal(dev[:, 1], old[:, 1])
        assert torch.equal(dev[:, [0, 2, 3]], old[:, [0, 2, 3]])


@pytest.mark.parametrize(
    "mapping, match",
    [
        ({6: 0}, "source block id 6"),
        ({0: 3}, "destination block id 3"),
        ({0: 1, 2: 1}, "duplicate"),
    ],
)
def test_swap_rejects_bad_ids(mapping, match):
    src = [random_cache(12)]
    dst = [torch.zeros(2, 3, BLOCK_SIZE, HEADS, DIM)]
    with pytest.raises(ValueError, match=match):
        swap_blocks(src, dst, mapping)


def test_swap_rejects_mismatched_caches():
    src = [random_cache(13)]
    with pytest.raises(ValueError, match="layers"):
        swap_blocks(src, [], {0: 0})
    with pytest.raises(ValueError, match="agree"):
        swap_blocks(src, [torch.zeros(2, 3, BLOCK_SIZE, HEADS, DIM + 1)], {0: 0})
    with pytest.raises(ValueError, match="agree"):
        swap_blocks(src, [torch.zeros(2, 3, BLOCK_SIZE, HEADS, DIM, dtype=torch.float16)], {0: 0})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swap_between_gpu_and_pinned_cpu():
    gpu = [random_cache(14).cuda() for _ in range(2)]
    cpu = [
        allocate_kv_cache(4, BLOCK_SIZE, HEADS, DIM, pin_memory=True),
        allocate_kv_cache(4, BLOCK_SIZE, HEADS, DIM, pin_memory=True),
    ]
    swap_blocks(gpu, cpu, {2: 3, 5: 0})
    assert torch.equal(cpu[1][:, 3], gpu[1][:, 2].cpu())
    assert torch.equal(cpu[0][:, 0], gpu[0][:, 5].cpu())
    old = [g.clone() for g in gpu]
    swap_blocks(cpu, gpu, {3: 0, 0: 1})
    torch.cuda.synchronize()
    assert torch.equal(gpu[0][:, 0], old[0][:, 2])
    assert torch.equal(gpu[1][:, 1], old[1][:, 5])
    copy_blocks(gpu, {0: [4]})
    assert torch.equal(gpu[0][:, 4], gpu[0][:, 0])


def test_write_kv_accepts_repeated_slots_with_identical_values():
    """Two sequences sharing a not-yet-computed cached block write the same K/V to one slot."""
    k_cache = torch.zeros(2, 4, HEADS, DIM)
    v_cache = torch.zeros(2, 4, HEADS, DIM)
    row = torch.randn(1, HEADS, DIM)
    key = torch.cat([row, row, torch.randn(1, HEADS, DIM)])
    write_kv(k_cache, v_cache, key, key.clone(), torch.tensor([5, 5, 6]))
    assert torch.equal(k_cache.view(-1, HEADS, DIM)[5], row[0])
    assert torch.equal(v_cache.view(-1, HEADS, DIM)[6], key[2])
