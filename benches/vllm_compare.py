"""Compare pagedkv.BlockSpaceManager with vLLM's own BlockSpaceManagerV1 (vLLM 0.4.2 or 0.5.0,
fetched and loaded by ``pagedkv.vllm_release``; nothing needs to be installed). Both managers
are driven by the *same* ``Sequence`` / ``SequenceGroup`` objects (vLLM's own, or with
``--pagedkv-sequences`` pagedkv's: vLLM's manager reads them through the same API), through the
same random operations, and must agree after every step on: free GPU/CPU blocks, the sharing
structure of every block table (tables are compared after renumbering blocks in order of first
appearance, because vLLM's free list order after ``free`` depends on object addresses), the
number of copy-on-write pairs and swapped blocks, and every ``can_*`` answer.
Scope: no sliding window, and one token per ``append_slots`` (vLLM v1 supports no more). With
``--caching`` prompts are whole blocks and the GPU pool is large enough that nothing is evicted:
vLLM shares partial prompt blocks through the cache and evicts partial blocks like cached ones,
which pagedkv does not do on purpose (docs/block_manager.md, "vLLM 0.5 bugs this does not copy").
For vLLM 0.5 pagedkv's manager returns its results in ``mapping_format="pairs"`` (0.5's shape).
A failed fetch of vLLM's files is an error, never a skip.
Run: ``python benches/vllm_compare.py [--version 0.4.2] [--steps N] [--seed S] [--caching]
[--pagedkv-sequences]`` (exits 0 when they agree).
"""

from __future__ import annotations

import argparse
import random
import sys
import time


def vllm_sequence(Sequence, seq_id, tokens, block_size):
    """Build a vLLM Sequence: 0.4.x takes (seq_id, prompt, prompt_token_ids, block_size), 0.5.x
    (seq_id, inputs, block_size) with an inputs dict."""
    import inspect

    params = list(inspect.signature(Sequence.__init__).parameters)
    if len(params) > 2 and params[2] == "inputs":
        inputs = {"prompt": "", "prompt_token_ids": list(tokens), "multi_modal_data": None}
        return Sequence(seq_id, inputs, block_size)
    return Sequence(seq_id, "", list(tokens), block_size)


def canonical(tables):
    """Renumber blocks by first appearance so that two tables with the same sharing compare
    equal whatever the physical numbers."""
    names = {}
    return [[names.setdefault(b, len(names)) for b in t] for t in tables]


def run(
    steps: int,
    seed: int,
    caching: bool = False,
    version: str = "0.4.2",
    pagedkv_sequences: bool = False,
) -> int:
    import pagedkv
    import pagedkv.sequence
    from pagedkv import vllm_release

    v = vllm_release.load(version, "vllm")
    vllm_manager = v.block_manager_v1.BlockSpaceManagerV1
    family = pagedkv.sequence if pagedkv_sequences else v.sequence
    params = pagedkv.SamplingParams if pagedkv_sequences else v.sampling_params.SamplingParams
    logprob, seq_cls, group_cls = family.Logprob, family.Sequence, family.SequenceGroup
    status = family.SequenceStatus
    mapping_format = "dict" if version == "0.4.2" else "pairs"

    rng = random.Random(seed)
    bs, gpu, cpu = 4, (100_000 if caching else 64), 32
    theirs = vllm_manager(bs, gpu, cpu, watermark=0.01, enable_caching=caching)
    ours = pagedkv.BlockSpaceManager(
        bs, gpu, cpu, watermark=0.01, enable_caching=caching, mapping_format=mapping_format
    )
    prefixes = [[rng.randrange(100) for _ in range(4 * rng.randrange(1, 6))] for _ in range(4)]
    groups = []
    next_id = 0
    t_theirs = t_ours = 0.0

    def both(method, *args):
        nonlocal t_theirs, t_ours
        t0 = time.perf_counter()
        try:
            a = ("ok", getattr(theirs, method)(*args))
        except Exception as e:  # vLLM raises ValueError/KeyError/AssertionError
            a = ("err", type(e).__name__)
        t1 = time.perf_counter()
        try:
            b = ("ok", getattr(ours, method)(*args))
        except Exception as e:
            b = ("err", type(e).__name__)
        t2 = time.perf_counter()
        t_theirs += t1 - t0
        t_ours += t2 - t1
        return a, b

    def check(step, what):
        seqs = [s for g in groups for s in g.get_seqs() if not s.is_finished()]
        with_tables = [s for s in seqs if s.seq_id in theirs.block_tables]
        mine = [s for s in seqs if ours.has_table(s)]
        assert [s.seq_id for s in with_tables] == [s.seq_id for s in mine], (step, what)
        assert theirs.get_num_free_gpu_blocks() == ours.get_num_free_gpu_blocks(), (step, what)
        assert theirs.get_num_free_cpu_blocks() == ours.get_num_free_cpu_blocks(), (step, what)
        for dev in ("gpu", "cpu"):
            a = canonical(
                [theirs.get_block_table(s) for s in with_tables if ours.table_device(s) == dev]
            )
            b = canonical([ours.get_block_table(s) for s in mine if ours.table_device(s) == dev])
            assert a == b, (step, what, dev)

    for step in range(steps):
        g = None
        r = rng.random()
        if r < 0.15 or not groups:
            if caching:  # whole blocks, often starting with a shared prefix
                toks = rng.choice(prefixes) if rng.random() < 0.7 else []
                toks = toks + [rng.randrange(100) for _ in range(4 * rng.randrange(1, 4))]
            else:
                toks = [rng.randrange(100) for _ in range(rng.randrange(1, 30))]
            seq = vllm_sequence(seq_cls, next_id, toks, bs)
            next_id += 1
            g = group_cls(
                request_id=str(seq.seq_id),
                seqs=[seq],
                sampling_params=params(),
                arrival_time=0.0,
            )
            a, b = both("can_allocate", g)
            assert a[1].name == b[1].name, (step, a, b)
            if b[1] == pagedkv.AllocStatus.OK:
                both("allocate", g)
                seq.status = status.RUNNING
                groups.append(g)
            what = "allocate"
        else:
            g = rng.choice(groups)
            running = g.get_seqs(status=status.RUNNING)
            swapped = g.get_seqs(status=status.SWAPPED)
            if r < 0.70 and running:
                a, b = both("can_append_slots", g)
                assert a == b, (step, a, b)
                if b[1]:
                    for s in running:
                        t = rng.randrange(100)
                        s.append_token_id(t, {t: logprob(0.0)})
                        a, b = both("append_slots", s)
                        assert a[0] == b[0] == "ok", (step, a, b)
                        assert len(list(a[1])) == len(list(b[1])), (step, a, b)
                what = "append"
            elif r < 0.80 and running:
                parent = running[0]
                child = parent.fork(next_id)
                next_id += 1
                g.add(child)
                both("fork", parent, child)
                what = "fork"
            elif r < 0.88 and running and not swapped:
                a, b = both("can_swap_out", g)
                assert a == b, (step, a, b)
                if b[1]:
                    a, b = both("swap_out", g)
                    assert len(list(a[1])) == len(list(b[1])), (step, a, b)
                    for s in running:
                        s.status = status.SWAPPED
                what = "swap_out"
            elif r < 0.94 and swapped and not running:
                a, b = both("can_swap_in", g)
                assert a[1].name == b[1].name, (step, a, b)
                if b[1] == pagedkv.AllocStatus.OK:
                    a, b = both("swap_in", g)
                    assert len(list(a[1])) == len(list(b[1])), (step, a, b)
                    for s in swapped:
                        s.status = status.RUNNING
                what = "swap_in"
            else:
                for s in g.get_seqs():
                    s.status = status.FINISHED_STOPPED
                    both("free", s)
                groups.remove(g)
                what = "free"
        if caching and g is not None and what in ("append", "allocate"):
            seqs = g.get_seqs(status=status.RUNNING)
            a, b = both("get_common_computed_block_ids", seqs)
            assert canonical([a[1]]) == canonical([b[1]]) and len(a[1]) == len(b[1]), (step, a, b)
            both("mark_blocks_as_computed", g)
            for s in seqs:
                both("access_all_blocks_in_seq", s, float(step))
        check(step, what)
    print(
        f"pagedkv agrees with vLLM {version}'s BlockSpaceManagerV1 on {steps} random steps "
        f"(seed {seed}, caching {'on' if caching else 'off'}, "
        f"{'pagedkv' if pagedkv_sequences else 'vLLM'} sequences; pagedkv prefix-cache "
        f"lookups/hits {ours.prefix_cache_stats()}); manager time: vLLM {t_theirs * 1e3:.1f} ms, "
        f"pagedkv {t_ours * 1e3:.1f} ms ({t_theirs / t_ours:.1f}x)"
    )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--caching", action="store_true", help="compare with prefix caching on")
    ap.add_argument("--version", default="0.4.2", choices=("0.4.2", "0.5.0"))
    ap.add_argument("--pagedkv-sequences", action="store_true")
    args = ap.parse_args(argv)
    return run(args.steps, args.seed, args.caching, args.version, args.pagedkv_sequences)


if __name__ == "__main__":
    sys.exit(main())
