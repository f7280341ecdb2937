"""BatchBuffers in one torch byte arena (pinned on CUDA) and the one-copy ``to_device``."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import pagedkv  # noqa: E402
from pagedkv.engine_step import BatchBuffers, BatchEngine  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402
from pagedkv.scheduler import CacheConfig, SchedulerConfig  # noqa: E402

BS = 4
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
NAMES = (
    "query_start_loc",
    "context_lens",
    "num_samples",
    "cached_tokens",
    "seq_ids",
    "input_tokens",
    "positions",
    "slot_mapping",
    "copies",
    "swap_in",
    "swap_out",
    "block_tables",
    "row_state",
    "moved_from",
    "new_block_loc",
    "new_blocks",
)


def make(device, incremental=True, max_model_len=32, gpu=24, **kw):
    cc = CacheConfig(BS, 0.9, 1, "auto")
    cc.num_gpu_blocks, cc.num_cpu_blocks = gpu, 32
    sched = pagedkv.Scheduler(SchedulerConfig(64, 4, max_model_len), cc, None)
    bufs = BatchBuffers.for_scheduler(sched, incremental=incremental, device=device, **kw)
    return sched, BatchEngine(sched, bufs, seq_counter=iter(range(100, 900)).__next__)


def add(engine, rid, seq_id, prompt, **params):
    seq = pagedkv.Sequence(seq_id, "", prompt, BS, None)
    engine.add_seq_group(pagedkv.SequenceGroup(rid, [seq], pagedkv.SamplingParams(**params), 0.0))


def host_used(res) -> dict:
    b, r, t = res.buffers, res.num_rows, res.num_tokens
    used = dict(
        query_start_loc=b.query_start_loc[: r + 1],
        context_lens=b.context_lens[:r],
        num_samples=b.num_samples[:r],
        cached_tokens=b.cached_tokens[:r],
        seq_ids=b.seq_ids[:r],
        input_tokens=b.input_tokens[:t],
        positions=b.positions[:t],
        slot_mapping=b.slot_mapping[:t],
        copies=b.copies[: 2 * res.num_copies],
        swap_in=b.swap_in[: 2 * res.num_swap_in],
        swap_out=b.swap_out[: 2 * res.num_swap_out],
        block_tables=b.block_tables[:r],
    )
    if b.row_state is not None:
        used.update(
            row_state=b.row_state[:r],
            moved_from=b.moved_from[:r],
            new_block_loc=b.new_block_loc[: r + 1],
            new_blocks=b.new_blocks[: res.num_new_blocks],
        )
    return used


def spy(buffers, calls: list) -> None:
    """Record every host-to-device copy of ``buffers``' arena."""
    real = buffers._arena.copy_prefix

    def copy_prefix(*a, **k):
        calls.append(a)
        return real(*a, **k)

    buffers._arena.copy_prefix = copy_prefix


def run_and_compare(device, steps=80):
    """A run with forks (copy-on-write), preemption by swap (a small pool) and widened
    tables (min_tokens past max_model_len): every step's device tensors equal the host."""
    sched, eng = make(device, max_model_len=16, gpu=14)
    for i in range(6):
        prompt = list(range(1, 6 + 2 * i))
        params = dict(n=2, best_of=2, max_tokens=20, min_tokens=16, temperature=1.0)
        add(eng, f"r{i}", i, prompt, **params)
    seen, calls, spied = set(), [], None
    sampled = None
    for _ in range(steps):
        res = eng.step(sampled, now=1.0)
        if res.buffers is not spied:  # the first step, or widened: a new arena
            spy(res.buffers, calls)
            spied = res.buffers
        calls.clear()
        dev = res.to_device()
        assert len(calls) == 1, "one host-to-device copy per step"
        for name, host in host_used(res).items():
            t = getattr(dev, name)
            assert t.device.type == torch.device(device).type
            assert tuple(t.shape) == host.shape, name
            np.testing.assert_array_equal(t.cpu().numpy(), host, err_msg=name)
            if host.size:
                seen.add(name)
        sampled = np.arange(eng.num_expected_samples, dtype=np.int32) % 7 + 1
        if not eng.has_unfinished_seqs() and not res.num_rows:
            break
    return eng, seen


def test_arrays_are_views_of_one_arena():
    _, eng = make("cpu")
    b = eng.buffers
    assert b.device == torch.device("cpu") and not b.pinned
    base = b._arena.host.numpy()
    lo, hi = base.ctypes.data, base.ctypes.data + base.nbytes
    spans = []
    for name in NAMES:
        a = getattr(b, name)
        assert a.flags.c_contiguous and a.flags.writeable
        assert lo <= a.ctypes.data and a.ctypes.data + a.nbytes <= hi, name
        spans.append((a.ctypes.data, a.ctypes.data + a.nbytes))
    spans.sort()
    assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:])), "arrays do not overlap"
    assert b.seq_ids.dtype == np.int64 and b.seq_ids.ctypes.data % 8 == 0


def test_to_device_is_one_copy_of_the_used_inputs():
    eng, seen = run_and_compare("cpu")
    # the run exercised every kind of input (forks copy, a small pool swaps)
    assert {"copies", "swap_out", "swap_in", "new_blocks", "input_tokens"} <= seen
    assert eng.buffers.block_tables.shape[1] > 4, "the tables were widened (a new arena)"


def test_to_device_needs_an_arena_and_its_own_result():
    sched, eng = make(None)
    add(eng, "a", 1, [1, 2, 3], max_tokens=3)
    res = eng.step(now=1.0)
    with pytest.raises(InvalidArgumentError, match="device"):
        res.to_device()
    other = BatchBuffers.for_scheduler(sched, device="cpu")
    with pytest.raises(InvalidArgumentError, match="other buffers"):
        other.to_device(res)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: pinning works")
def test_pinning_without_cuda_is_refused():
    sched, _ = make("cpu")
    with pytest.raises(InvalidArgumentError, match="pin_memory=True needs CUDA"):
        BatchBuffers.for_scheduler(sched, pin_memory=True)
    with pytest.raises(InvalidArgumentError, match="pin_memory=True needs CUDA"):
        BatchBuffers(8, 2, 4, 4, device="cpu", pin_memory=True)


def test_engine_step_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from pagedkv.engine_step import BatchBuffers\n"
        "b = BatchBuffers(8, 2, 4, 4, incremental=True)\n"
        "assert b.device is None and b.block_tables.shape == (2, 4)\n"
        "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@cuda
def test_cuda_buffers_are_pinned_and_copied_once():
    _, eng = make("cuda")
    assert eng.buffers.pinned and eng.buffers._arena.host.is_pinned()
    run_and_compare("cuda")
