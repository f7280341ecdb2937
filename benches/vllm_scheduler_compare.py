"""Run vLLM's own Scheduler twice on the same requests: once with vLLM's BlockSpaceManagerV1,
once with pagedkv.BlockSpaceManager plugged in (vLLM's code drives pagedkv, with vLLM's own
Sequence objects), and check that every step schedules the same thing.

Per step it compares the scheduled requests (and prefill/decode), the block tables handed to the
workers (after renumbering blocks in order of first appearance: vLLM's free list order after a
free depends on object addresses), the computed-block counts, swap-in/swap-out/copy sizes, the
ignored requests and the free block counts. Without caching the pool is small, so requests are
preempted by recompute and by swapping; with ``--caching`` prompts are whole blocks and the pool
is large (vLLM shares partial prompt blocks and evicts partial blocks like cached ones, which
pagedkv does not, on purpose).

Needs vLLM 0.4.x installed (its ``vllm.core.scheduler``); prints a note and exits 0 otherwise.
Run: ``python benches/vllm_scheduler_compare.py [--requests N] [--seed S] [--caching]``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for vllm_compare


def pair_count(mapping):
    """Number of (src, dst) pairs: vLLM 0.4 keeps dicts ({src: dst} / {src: [dst]}), 0.5
    lists of pairs."""
    if isinstance(mapping, dict):
        return sum(len(v) if isinstance(v, list) else 1 for v in mapping.values())
    return len(mapping)


def canonical(tables):
    names = {}
    return [[names.setdefault(b, len(names)) for b in t] for t in tables]


class Engine:
    """A model-free engine loop around vLLM's Scheduler (what LLMEngine does with outputs)."""

    def __init__(self, use_pagedkv, caching, block_size, gpu, cpu, pagedkv_sequences=False):
        from vllm.config import CacheConfig, SchedulerConfig
        from vllm.core import interfaces
        from vllm.core.scheduler import Scheduler

        import pagedkv

        sched_cfg = SchedulerConfig(
            max_num_batched_tokens=1024, max_num_seqs=24, max_model_len=1024
        )
        cache_cfg = CacheConfig(
            block_size=block_size,
            gpu_memory_utilization=0.9,
            swap_space=1,
            cache_dtype="auto",
            enable_prefix_caching=caching,
        )
        cache_cfg.num_gpu_blocks = gpu
        cache_cfg.num_cpu_blocks = cpu
        cls = interfaces.BlockSpaceManager
        original = cls.get_block_space_manager_class
        if use_pagedkv:
            cls.get_block_space_manager_class = staticmethod(
                lambda version: pagedkv.BlockSpaceManager
            )
        try:
            self.scheduler = Scheduler(sched_cfg, cache_cfg, None)
        finally:
            cls.get_block_space_manager_class = original
        self.next_child_id = 1_000_000
        # vLLM's scheduler driving pagedkv's own Sequence family too (the drop-in claim)
        self.pagedkv_sequences = pagedkv_sequences

    def add(self, request_id, seq_id, tokens, n, block_size):
        if self.pagedkv_sequences:
            from pagedkv import SamplingParams, Sequence, SequenceGroup

            seq = Sequence(seq_id, "", list(tokens), block_size)
        else:
            from vllm.sampling_params import SamplingParams
            from vllm.sequence import Sequence, SequenceGroup

            from vllm_compare import vllm_sequence

            seq = vllm_sequence(Sequence, seq_id, tokens, block_size)
        params = SamplingParams(n=n, best_of=n, max_tokens=10_000)
        group = SequenceGroup(
            request_id=request_id, seqs=[seq], sampling_params=params, arrival_time=0.0
        )
        self.scheduler.add_seq_group(group)

    def step(self, output_len):
        from vllm.sequence import SequenceStatus

        if self.pagedkv_sequences:
            from pagedkv import Logprob
        else:
            from vllm.sequence import Logprob

        metas, out = self.scheduler.schedule()
        mgr = self.scheduler.block_manager
        record = {
            "requests": [(m.request_id, m.is_prompt) for m in metas],
            "tables": canonical([t for m in metas for _, t in sorted(m.block_tables.items())]),
            "computed": [len(m.computed_block_nums or []) for m in metas],
            "swap": (pair_count(out.blocks_to_swap_in), pair_count(out.blocks_to_swap_out)),
            "copies": pair_count(out.blocks_to_copy),
            "ignored": [g.request_id for g in out.ignored_seq_groups],
            "free": (mgr.get_num_free_gpu_blocks(), mgr.get_num_free_cpu_blocks()),
        }
        for sg in out.scheduled_seq_groups:
            group = sg.seq_group
            group.update_num_computed_tokens(sg.token_chunk_size)
            if group.is_prefill():
                continue
            running = group.get_seqs(status=SequenceStatus.RUNNING)
            if group.sampling_params.n > 1 and len(group.get_seqs()) == 1:
                child = running[0].fork(self.next_child_id)
                self.next_child_id += 1
                group.add(child)
                self.scheduler.fork_seq(running[0], child)
                running.append(child)
            for k, seq in enumerate(running):
                tok = (int(group.request_id[1:]) * 31 + 7 * seq.get_output_len() + k) % 1000
                seq.append_token_id(tok, {tok: Logprob(0.0)})
                if seq.get_output_len() >= output_len[group.request_id]:
                    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                    self.scheduler.free_seq(seq)
        self.scheduler.free_finished_seq_groups()
        return record

    def busy(self):
        return self.scheduler.has_unfinished_seqs()


def run(requests: int, seed: int, caching: bool = False, pagedkv_sequences: bool = False) -> int:
    try:
        import vllm.core.scheduler  # noqa: F401
    except Exception as exc:
        print(f"vLLM's scheduler is not importable ({type(exc).__name__}: {exc}); skipped")
        return 0

    rng = random.Random(seed)
    bs = 4
    gpu, cpu = (4096, 256) if caching else (64, 48)
    prefixes = [[rng.randrange(1000) for _ in range(4 * rng.randrange(1, 8))] for _ in range(4)]
    engines = [
        Engine(False, caching, bs, gpu, cpu),
        Engine(True, caching, bs, gpu, cpu, pagedkv_sequences),
    ]
    output_len = {}
    pending = []
    for i in range(requests):
        if caching:
            toks = (rng.choice(prefixes) if rng.random() < 0.7 else []) + [
                rng.randrange(1000) for _ in range(4 * rng.randrange(1, 6))
            ]
        else:
            toks = [rng.randrange(1000) for _ in range(rng.randrange(1, 60))]
        n = 2 if rng.random() < 0.2 else 1
        output_len[f"r{i}"] = rng.randrange(1, 40)
        pending.append((rng.randrange(0, 3 * requests), f"r{i}", i, toks, n))
    pending.sort()
    step = 0
    stats = {"preempt_or_swap_steps": 0, "copies": 0, "computed": 0}
    while pending or any(e.busy() for e in engines):
        while pending and pending[0][0] <= step:
            _, rid, sid, toks, n = pending.pop(0)
            for e in engines:
                e.add(rid, sid, toks, n, bs)
        a, b = (e.step(output_len) for e in engines)
        if a != b:
            for k in a:
                if a[k] != b[k]:
                    print(f"step {step}: {k} differs:\n  vLLM    {a[k]}\n  pagedkv {b[k]}")
            return 1
        stats["preempt_or_swap_steps"] += int(any(a["swap"]))
        stats["copies"] += a["copies"]
        stats["computed"] += sum(a["computed"])
        step += 1
        if step > 100_000:
            print("did not finish")
            return 1
    print(
        f"vLLM's Scheduler made identical decisions with pagedkv and with its own manager over "
        f"{step} steps ({requests} requests, seed {seed}, caching {'on' if caching else 'off'}, "
        f"{'pagedkv' if pagedkv_sequences else 'vLLM'} Sequence objects on the pagedkv side; "
        f"steps with swaps {stats['preempt_or_swap_steps']}, CoW copies {stats['copies']}, "
        f"computed blocks reported {stats['computed']})"
    )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--caching", action="store_true")
    ap.add_argument(
        "--pagedkv-sequences",
        action="store_true",
        help="give the pagedkv-backed scheduler pagedkv's own Sequence/SequenceGroup objects",
    )
    args = ap.parse_args(argv)
    return run(args.requests, args.seed, args.caching, args.pagedkv_sequences)


if __name__ == "__main__":
    sys.exit(main())
