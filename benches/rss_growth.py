"""Resident memory over millions of random manager operations with prefix caching on.

    python benches/rss_growth.py [--ops 3000000] [--every 250000] [--gpu-blocks 2048]
        [--backend native|foreign|vllm|vllm-seqs] [--seed 12345]

Prints, every ``--every`` operations, the resident memory (MiB) and what it is made of, and the
growth after warm-up (from the first report after 1M operations, or the first report, to the
last). The operation mix is the one of tests/test_long_run.py: admit, decode steps with access
and computed marks, swap out/in, fork, finish, with a block-table read per decode step. The
random stream is the same for both backends.

Per report: ``rss`` (all resident pages), ``anon`` (``RssAnon``: the heap, what the process
allocated) and ``file`` (``RssFile``: mapped files such as libpython and the extension, which
the kernel drops under memory pressure and faults back in later, so they move with the load of
the machine, not with the run), the native manager's heap (``native_bytes()``, exact), Python's
allocated blocks (``sys.getallocatedblocks()``) and the live workload: groups, sequences and
their tokens. The growth is reported for ``anon`` and for ``rss``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import resource
import sys


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def rss_parts_mib() -> dict:
    """``RssAnon`` and ``RssFile`` of /proc/self/status (kB), in MiB; empty where absent."""
    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                parts[key[3:].lower()] = int(value.split()[0]) / 1024
    return parts


def live_state(m, groups: list) -> dict:
    """What the run holds right now: native heap (when the manager reports it), Python's
    allocated blocks, and the live groups, sequences and tokens."""
    seqs = [s for g in groups for s in g.get_seqs()]
    state = {
        "groups": len(groups),
        "seqs": len(seqs),
        "tokens": sum(s.get_len() for s in seqs),
        "py_blocks": sys.getallocatedblocks(),
    }
    if hasattr(m, "native_bytes"):
        state["native_kib"] = round(sum(m.native_bytes()) / 1024)
    return state


def backend(name: str):
    if name == "foreign":
        # pagedkv's manager driven by the reference's pure-Python Sequence objects: the
        # foreign-sequence path (a native token store per sequence, synced on each call)
        from pagedkv import AllocStatus
        from pagedkv import BlockSpaceManager as Manager
        from pagedkv.reference.sequence import Sequence
        from pagedkv.sequence import Logprob, SamplingParams, SequenceGroup, SequenceStatus

        return (
            Manager,
            AllocStatus,
            Logprob,
            Sequence,
            SequenceGroup,
            SequenceStatus,
            SamplingParams,
        )
    if name in ("vllm", "vllm-seqs"):
        # vLLM 0.4.2's own files (pagedkv.vllm_release fetches them): its BlockSpaceManagerV1
        # ("vllm"), or pagedkv's manager driven by vLLM's Sequence objects ("vllm-seqs")
        from pagedkv import vllm_release

        v = vllm_release.load("0.4.2", "vllm")
        seq = v.sequence
        if name == "vllm":
            Manager = v.block_manager_v1.BlockSpaceManagerV1
            AllocStatus = v.interfaces.AllocStatus
        else:
            from pagedkv import AllocStatus
            from pagedkv import BlockSpaceManager as Manager
        names = (Manager, AllocStatus, seq.Logprob, seq.Sequence, seq.SequenceGroup)
        return (*names, seq.SequenceStatus, v.sampling_params.SamplingParams)
    else:
        from pagedkv import AllocStatus
        from pagedkv import BlockSpaceManager as Manager
        from pagedkv.sequence import (
            Logprob,
            SamplingParams,
            Sequence,
            SequenceGroup,
            SequenceStatus,
        )
    return Manager, AllocStatus, Logprob, Sequence, SequenceGroup, SequenceStatus, SamplingParams


def run(ops_total: int, every: int, name: str, gpu: int, seed: int = 12345) -> list:
    Manager, AllocStatus, Logprob, Sequence, SequenceGroup, Status, SamplingParams = backend(name)
    bs, cpu = 16, gpu // 4
    rng = random.Random(seed)
    m = Manager(bs, gpu, cpu, watermark=0.01, enable_caching=True)
    prefixes = [[rng.randrange(32000) for _ in range(rng.randrange(16, 400))] for _ in range(8)]
    groups: list = []
    ids = itertools.count()
    logprob = {t: Logprob(0.0) for t in range(8)}
    samples = []
    for ops in range(1, ops_total + 1):
        r = rng.random()
        if r < 0.02 or not groups:
            prompt = prefixes[rng.randrange(8)][: rng.randrange(1, 400)] + [
                rng.randrange(32000) for _ in range(rng.randrange(0, 100))
            ]
            seq = Sequence(next(ids), "", prompt, bs)
            g = SequenceGroup(str(seq.seq_id), [seq], SamplingParams(), 0.0)
            if m.can_allocate(g) == AllocStatus.OK:
                m.allocate(g)
                seq.status = Status.RUNNING
                groups.append(g)
        else:
            step(m, rng, groups, r, ops, logprob, Status, AllocStatus, ids)
        if ops % every == 0:
            gc.collect()
            parts = rss_parts_mib()
            samples.append((ops, rss_mib(), parts.get("anon", 0.0)))
            detail = " ".join(f"{k} {v:7.2f}" for k, v in parts.items())
            state = " ".join(f"{k} {v}" for k, v in live_state(m, groups).items())
            print(f"{ops:>9} ops  rss {samples[-1][1]:7.2f} MiB ({detail})  {state}", flush=True)
    return samples


def step(m, rng, groups, r, ops, logprob, Status, AllocStatus, ids):
    g = groups[rng.randrange(len(groups))]
    seqs = g.get_seqs()
    if r < 0.85:
        running = [s for s in seqs if s.status == Status.RUNNING]
        if not running:
            return
        if m.can_append_slots(g):
            for s in running:
                t = rng.randrange(8)
                s.append_token_id(t, {t: logprob[t]})
                m.append_slots(s)
                m.get_block_table(s)
                m.access_all_blocks_in_seq(s, float(ops))
            m.mark_blocks_as_computed(g)
        elif m.can_swap_out(g):
            m.swap_out(g)
            for s in running:
                s.status = Status.SWAPPED
        else:
            finish(m, groups, g, seqs, Status)
    elif r < 0.90:
        if all(s.status == Status.SWAPPED for s in seqs):
            if m.can_swap_in(g) == AllocStatus.OK:
                m.swap_in(g)
                for s in seqs:
                    s.status = Status.RUNNING
    elif r < 0.93:
        parent = seqs[0]
        if parent.status == Status.RUNNING and len(seqs) < 4:
            child = parent.fork(next(ids))
            g.add(child)
            m.fork(parent, child)
    else:
        finish(m, groups, g, seqs, Status)


def finish(m, groups, g, seqs, Status):
    for s in seqs:
        s.status = Status.FINISHED_STOPPED
        m.free(s)
    groups.remove(g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", type=int, default=3_000_000)
    p.add_argument("--every", type=int, default=250_000)
    p.add_argument(
        "--backend", choices=["native", "foreign", "vllm", "vllm-seqs"], default="native"
    )
    p.add_argument("--gpu-blocks", type=int, default=2048)
    p.add_argument("--seed", type=int, default=12345, help="the operation stream's seed")
    a = p.parse_args()
    samples = run(a.ops, a.every, a.backend, a.gpu_blocks, a.seed)
    base = next((s for s in samples if s[0] >= 1_000_000), samples[0])
    last = samples[-1]
    growth = 100 * (last[1] - base[1]) / base[1]
    print(
        f"growth after warm-up ({base[0]} -> {last[0]} ops): {growth:+.1f}% "
        f"({last[1] - base[1]:+.2f} MiB)"
    )
    if base[2]:
        anon = 100 * (last[2] - base[2]) / base[2]
        print(f"anonymous memory growth after warm-up: {anon:+.1f}% ({last[2] - base[2]:+.2f} MiB)")
    sys.exit(0)


if __name__ == "__main__":
    main()
