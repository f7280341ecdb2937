#!/usr/bin/env python
"""Short GPU check of the torch side of pagedkv (runs in well under 2 minutes).

1. the end-to-end demo (:mod:`pagedkv.demo`: pagedkv.Scheduler through the batch step,
   and through ``schedule()`` in fp32) on the device in fp32 (tolerance 1e-5) and bf16
   (2e-2 of the row's largest logit): prefix caching, fork + copy-on-write, swap out/in
   and recompute, every logits row against ``dense_forward``;
2. :func:`pagedkv.attention.paged_attention` against per-sequence SDPA on a mixed
   batch (prefill chunks + decodes, GQA, scrambled block tables), fp32 and bf16,
   every backend that can run the inputs;
3. timing of the per-step host-to-device handoff of
   :class:`pagedkv.attention.StepBuffers` (manager batch API into pinned buffers,
   one non-blocking copy) over 1,000 decode steps of 256 sequences, with a
   fresh-tensors baseline;
4. the batch engine step (:class:`pagedkv.engine_step.BatchEngine`) into
   ``BatchBuffers(device=...)``: pinned host arena on CUDA, exactly one host-to-device
   copy per ``to_device``, and every device tensor equal to the host prefix it came from,
   over a run with forks (copy-on-write) and preemption.

Prints a compact report; exits 1 if any check fails, 2 if the device is missing.

    python scripts/device_check.py              # CUDA
    python scripts/device_check.py --device cpu # same checks on the CPU (no pinning)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback

import numpy as np
import torch
import torch.nn.functional as F

import pagedkv
from pagedkv.attention import StepBuffers, flash_attn_unavailable_reason, paged_attention
from pagedkv.demo.engine import DemoConfig, run_demo

ATTN_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- #
# 1. demo
# --------------------------------------------------------------------------- #


def check_demo(device: torch.device) -> list[str]:
    failures = []
    for path, dtype in (
        ("batch", torch.float32),
        ("batch", torch.bfloat16),
        ("compat", torch.float32),
    ):
        rep = run_demo(DemoConfig(path=path), device=device, dtype=dtype, verbose=False)
        name = f"{path} {str(dtype).replace('torch.', '')}"
        print(
            f"demo {name:14s}: {'OK ' if rep.ok else 'FAIL'} {rep.checked_rows} rows, "
            f"max|diff| {rep.max_abs_diff:.2e} (atol {rep.atol:g}), hits "
            f"{rep.prefix_hits}/{rep.prefix_lookups}, skipped {rep.prefix_cached_tokens} tok, "
            f"cow {rep.cow_copies}, swap {rep.swap_outs}/{rep.swap_ins}, "
            f"recompute {rep.recompute_preemptions}, {rep.steps} steps, {rep.seconds:.2f} s"
        )
        failures += [f"demo {name}: {f}" for f in rep.failures]
    return failures


# --------------------------------------------------------------------------- #
# 2. paged_attention vs SDPA
# --------------------------------------------------------------------------- #


def sdpa_reference(query, k_cache, v_cache, tables, ctx_lens, q_lens, scale):
    """Per-sequence SDPA over the gathered context, bottom-right causal mask."""
    out = []
    block_size = k_cache.shape[1]
    group = query.shape[1] // k_cache.shape[2]
    start = 0
    for table, ctx, q_len in zip(tables, ctx_lens, q_lens):
        n_blocks = math.ceil(ctx / block_size)
        idx = torch.tensor(table[:n_blocks], device=query.device)
        k = k_cache[idx].flatten(0, 1)[:ctx].repeat_interleave(group, dim=1)
        v = v_cache[idx].flatten(0, 1)[:ctx].repeat_interleave(group, dim=1)
        q = query[start : start + q_len]
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
        mask = torch.arange(ctx, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).float(),
            k.transpose(0, 1).float(),
            v.transpose(0, 1).float(),
            attn_mask=mask,
            scale=scale,
        )
        out.append(o.transpose(0, 1).to(query.dtype))
        start += q_len
    return torch.cat(out)


def check_attention(device: torch.device) -> list[str]:
    failures = []
    gen = torch.Generator().manual_seed(0)
    cases = [(torch.float32, 16), (torch.bfloat16, 16)]
    if device.type == "cuda":
        cases.append((torch.bfloat16, 256))  # the only block size flash-attn accepts
    for dtype, block_size in cases:
        num_heads, num_kv_heads, head_dim = 8, 2, 64
        ctx_lens = [1, 17, 100, 256, 300, 511, 64, 33]
        q_lens = [1, 17, 1, 5, 300, 1, 64, 2]  # full prefills, chunks and decodes
        blocks_per = [math.ceil(c / block_size) for c in ctx_lens]
        num_blocks = sum(blocks_per) + 3
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        tables, pos = [], 0
        for n in blocks_per:
            tables.append(perm[pos : pos + n])
            pos += n
        width = max(blocks_per) + 1
        table_t = torch.full((len(tables), width), -1, dtype=torch.int32)  # -1 = padding
        for i, t in enumerate(tables):
            table_t[i, : len(t)] = torch.tensor(t)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
        query = query.to(device=device, dtype=dtype)
        qsl = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device=device)
        scale = head_dim**-0.5
        ref = sdpa_reference(query, k_cache, v_cache, tables, ctx_lens, q_lens, scale)
        backends = ["torch"]
        if flash_attn_unavailable_reason(query, k_cache) is None:
            backends.append("flash_attn")
        for backend in backends:
            out = paged_attention(
                query,
                k_cache,
                v_cache,
                table_t.to(device),
                torch.tensor(ctx_lens, dtype=torch.int32, device=device),
                query_start_loc=qsl,
                scale=scale,
                backend=backend,
            )
            atol, rtol = ATTN_TOL[dtype]
            diff = float((out.float() - ref.float()).abs().max())
            ok = torch.allclose(out.float(), ref.float(), atol=atol, rtol=rtol)
            name = str(dtype).replace("torch.", "")
            print(
                f"attention {name:8s} bs={block_size:<3d} {backend:10s}: "
                f"{'OK ' if ok else 'FAIL'} max|diff| {diff:.2e} (atol {atol:g})"
            )
            if not ok:
                failures.append(f"paged_attention {backend} {name} bs={block_size}: {diff:.3g}")
        if device.type == "cuda" and block_size == 256 and len(backends) == 1:
            reason = flash_attn_unavailable_reason(query, k_cache)
            print(f"attention flash_attn skipped: {reason}")
    return failures


# --------------------------------------------------------------------------- #
# 3. StepBuffers handoff timing
# --------------------------------------------------------------------------- #


def time_handoff(device: torch.device, num_seqs: int = 256, steps: int = 1000) -> list[str]:
    block_size, prompt_len = 16, 32
    max_blocks = math.ceil((prompt_len + steps) / block_size) + 1
    manager = pagedkv.BlockSpaceManager(block_size, num_seqs * max_blocks + 16, 16)
    seqs = []
    for i in range(num_seqs):
        seq = pagedkv.Sequence(i, "p", [(7 * i + j) % 1000 for j in range(prompt_len)], block_size)
        group = pagedkv.SequenceGroup(str(i), [seq], pagedkv.SamplingParams(), 0.0)
        manager.allocate(group)
        seq.status = pagedkv.SequenceStatus.RUNNING
        seqs.append(seq)
    bufs = StepBuffers(num_seqs, max_blocks, device=device)
    logprob = {t: pagedkv.Logprob(0.0) for t in range(8)}
    t_fill = t_copy = t_sync = t_base = 0
    warmup = 20
    for step in range(steps):
        for seq in seqs:
            seq.append_token_id(step % 8, logprob)
        a = time.perf_counter_ns()
        bufs.begin_step()
        bufs.append(manager, seqs)
        b = time.perf_counter_ns()
        view = bufs.to_device()
        c = time.perf_counter_ns()
        sync(device)
        d = time.perf_counter_ns()
        # baseline: fresh (pageable) tensors copied one by one, as a naive engine would
        n = bufs.num_seqs
        fresh = [
            torch.from_numpy(arr[:n].copy()).to(device, non_blocking=True)
            for arr in (
                bufs.block_tables_np,
                bufs.context_lens_np,
                bufs.slot_mapping_np,
                bufs.positions_np,
                bufs.input_ids_np,
            )
        ]
        sync(device)
        e = time.perf_counter_ns()
        if step >= warmup:
            t_fill += b - a
            t_copy += c - b
            t_sync += d - c
            t_base += e - d
    timed = steps - warmup
    failures = []
    host = bufs.host_view()
    for name, dev_t, ref in zip(
        ("block_tables", "context_lens", "slot_mapping", "positions", "input_ids"),
        (view.block_tables, view.context_lens, view.slot_mapping, view.positions, view.input_ids),
        (host.block_tables, host.context_lens, host.slot_mapping, host.positions, host.input_ids),
    ):
        if not torch.equal(dev_t.cpu(), ref):
            failures.append(f"StepBuffers: device {name} differs from the host buffer")
    if not torch.equal(fresh[0].cpu(), view.block_tables.cpu()):
        failures.append("StepBuffers: baseline block tables differ")
    if int(view.context_lens[0]) != prompt_len + steps:
        failures.append("StepBuffers: wrong context length after the run")
    us = 1e-3 / timed
    print(
        f"handoff {num_seqs} seqs x {timed} steps ({device}, pinned={bufs.pinned}, "
        f"{max_blocks} blocks/row): manager batch fill {t_fill * us:.1f} us, "
        f"H2D issue {t_copy * us:.1f} us, wait {t_sync * us:.1f} us, "
        f"total {(t_fill + t_copy + t_sync) * us:.1f} us/step; "
        f"fresh-tensors copy baseline {t_base * us:.1f} us/step"
    )
    return failures


# --------------------------------------------------------------------------- #
# 4. batch step buffers: pinned arena, one copy
# --------------------------------------------------------------------------- #


def check_batch_buffers(device: torch.device, steps: int = 200) -> list[str]:
    from pagedkv.engine_step import BatchBuffers, BatchEngine
    from pagedkv.scheduler import CacheConfig, SchedulerConfig

    bs = 4
    cc = CacheConfig(bs, 0.9, 1, "auto")
    cc.num_gpu_blocks, cc.num_cpu_blocks = 40, 64
    sched = pagedkv.Scheduler(SchedulerConfig(256, 8, 64), cc, None)
    bufs = BatchBuffers.for_scheduler(sched, incremental=True, device=device)
    eng = BatchEngine(sched, bufs)
    for i in range(12):
        seq = pagedkv.Sequence(i, "", list(range(1, 8 + 3 * i)), bs, None)
        sp = pagedkv.SamplingParams(n=2, best_of=2, max_tokens=24, temperature=1.0)
        eng.add_seq_group(pagedkv.SequenceGroup(f"r{i}", [seq], sp, 0.0))
    failures: list[str] = []
    if device.type == "cuda" and not bufs.pinned:
        failures.append("BatchBuffers: host arena not pinned on CUDA")
    calls = [0]
    spied = None
    sampled, rows, copies, swaps = None, 0, 0, 0
    for _ in range(steps):
        res = eng.step(sampled, now=1.0)
        if res.buffers is not spied:  # first step or widened: a new arena
            spied, real = res.buffers, res.buffers._arena.copy_prefix
            res.buffers._arena.copy_prefix = lambda *a, _r=real, **k: (
                calls.__setitem__(0, calls[0] + 1),
                _r(*a, **k),
            )[1]
        calls[0] = 0
        dev = res.to_device()
        if calls[0] != 1:
            failures.append(f"BatchBuffers: {calls[0]} copies in one to_device")
        b, r, t = res.buffers, res.num_rows, res.num_tokens
        host = {
            "input_tokens": b.input_tokens[:t],
            "positions": b.positions[:t],
            "slot_mapping": b.slot_mapping[:t],
            "query_start_loc": b.query_start_loc[: r + 1],
            "context_lens": b.context_lens[:r],
            "num_samples": b.num_samples[:r],
            "cached_tokens": b.cached_tokens[:r],
            "seq_ids": b.seq_ids[:r],
            "moved_from": b.moved_from[:r],
            "block_tables": b.block_tables[:r],
            "copies": b.copies[: 2 * res.num_copies],
            "swap_out": b.swap_out[: 2 * res.num_swap_out],
            "swap_in": b.swap_in[: 2 * res.num_swap_in],
            "new_blocks": b.new_blocks[: res.num_new_blocks],
        }
        for name, ref in host.items():
            got = getattr(dev, name)
            if got.device.type != device.type or not np.array_equal(got.cpu().numpy(), ref):
                failures.append(f"BatchBuffers: device {name} differs from the host prefix")
        rows, copies, swaps = rows + r, copies + res.num_copies, swaps + res.num_swap_out
        sampled = np.arange(eng.num_expected_samples, dtype=np.int32) % 5 + 1
        if not eng.has_unfinished_seqs() and not r:
            break
    print(
        f"batch buffers ({device}, pinned={bufs.pinned}): {rows} rows, {copies} CoW copies, "
        f"{swaps} swap-outs, one copy per step, device == host: "
        f"{'OK' if not failures else 'FAIL'}"
    )
    return failures[:5]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seqs", type=int, default=256)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("device_check: CUDA is not available", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device_check: {name}, torch {torch.__version__}, pagedkv {pagedkv.__version__}")
    t0 = time.perf_counter()
    failures: list[str] = []
    for section in (
        lambda: check_demo(device),
        lambda: check_attention(device),
        lambda: time_handoff(device, args.seqs, args.steps),
        lambda: check_batch_buffers(device),
    ):
        try:
            failures += section()
        except Exception as exc:  # report and go on with the other sections
            traceback.print_exc()
            failures.append(f"{type(exc).__name__}: {exc}")
    print(f"device_check: {time.perf_counter() - t0:.1f} s")
    for f in failures:
        print(f"FAIL: {f}")
    print("device_check: OK" if not failures else f"device_check: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
