"""A seeded run of 1,000,000 random manager operations (slow: run with --runslow, as the README's
full test command and CI do). Invariants are checked along the way; at the end every sequence is
freed and every block is free again."""

from __future__ import annotations

import random

import pytest

import pagedkv
from pagedkv.sequence import Logprob, SamplingParams, Sequence, SequenceGroup, SequenceStatus

BS = 16
OPS = 1_000_000


@pytest.mark.slow
@pytest.mark.parametrize("caching,window", [(True, None), (False, 256)])
def test_million_operations(caching, window):
    rng = random.Random(12345)
    gpu, cpu = 2048, 512
    m = pagedkv.BlockSpaceManager(
        BS, gpu, cpu, watermark=0.01, sliding_window=window, enable_caching=caching
    )
    prefixes = [[rng.randrange(32000) for _ in range(rng.randrange(16, 400))] for _ in range(8)]
    groups: list = []
    next_id = 0
    logprob = {t: Logprob(0.0) for t in range(8)}
    ops = 0
    while ops < OPS:
        r = rng.random()
        ops += 1
        if r < 0.02 or not groups:
            prompt = prefixes[rng.randrange(8)][: rng.randrange(1, 400)] + [
                rng.randrange(32000) for _ in range(rng.randrange(0, 100))
            ]
            seq = Sequence(next_id, "", prompt, BS)
            next_id += 1
            g = SequenceGroup(str(seq.seq_id), [seq], SamplingParams(), 0.0)
            if m.can_allocate(g) == pagedkv.AllocStatus.OK:
                m.allocate(g)
                seq.status = SequenceStatus.RUNNING
                groups.append(g)
            continue
        g = groups[rng.randrange(len(groups))]
        seqs = g.get_seqs()
        if r < 0.85:
            running = [s for s in seqs if s.status == SequenceStatus.RUNNING]
            if not running:
                continue
            if m.can_append_slots(g):
                for s in running:
                    t = rng.randrange(8)
                    s.append_token_id(t, logprob)
                    m.append_slots(s)
                    m.access_all_blocks_in_seq(s, float(ops))
                m.mark_blocks_as_computed(g)
            elif m.can_swap_out(g):
                m.swap_out(g)
                for s in running:
                    s.status = SequenceStatus.SWAPPED
            else:
                for s in seqs:
                    m.free(s)
                groups.remove(g)
        elif r < 0.90:
            if all(s.status == SequenceStatus.SWAPPED for s in seqs):
                if m.can_swap_in(g) == pagedkv.AllocStatus.OK:
                    m.swap_in(g)
                    for s in seqs:
                        s.status = SequenceStatus.RUNNING
        elif r < 0.93:
            parent = seqs[0]
            if parent.status == SequenceStatus.RUNNING and len(seqs) < 4:
                child = parent.fork(next_id)
                next_id += 1
                g.add(child)
                m.fork(parent, child)
        else:
            for s in seqs:
                s.status = SequenceStatus.FINISHED_STOPPED
                m.free(s)
            groups.remove(g)
        if ops % 100_000 == 0:
            m.check_invariants()
    m.check_invariants()
    for g in groups:
        for s in g.get_seqs():
            m.free(s)
    assert m.get_num_free_gpu_blocks() == gpu
    assert m.get_num_free_cpu_blocks() == cpu
    m.check_invariants()
