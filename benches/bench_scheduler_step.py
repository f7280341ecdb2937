"""Whole engine step on W1: pagedkv.Scheduler vs vLLM 0.4.2's own Scheduler, same run.

A model-free engine loop (what vLLM's LLMEngine does around the scheduler: ``schedule()``, then
the output processing of ``_process_model_outputs``: advance computed tokens, fork ``n > 1``
requests after their prefill, append one sampled token per running sequence, finish and free
sequences at their output length, ``free_finished_seq_groups``) drives three backends through
the same W1 requests in one process, in lockstep (a step of each in turn, so that machine
noise falls on all three alike):

* ``vllm``: vLLM 0.4.2's Scheduler with its own classes (``pagedkv.vllm_release``);
* ``dropin``: vLLM 0.4.2's Scheduler code with pagedkv's Sequence family and block manager;
* ``pagedkv``: :class:`pagedkv.Scheduler` with pagedkv's Sequence family.

The loop is the same code for all three; only the classes differ. It reports the mean time of a
whole step (schedule + output processing) and of ``schedule()`` alone, in microseconds, and the
ratios to ``vllm``. Every backend must take the same number of steps (a cheap check that they
made the same decisions; tests/test_scheduler_differential.py checks them step by step).
GC is disabled while stepping (as in the issue's measurements), for all three alike.

Run: ``python benches/bench_scheduler_step.py [--quick] [--caching on|off|both] [--steps N]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any, Dict, List

from pagedkv.bench.workload import W1_FULL, W1_QUICK, generate_w1

BACKENDS = ("vllm", "dropin", "pagedkv")


class Engine:
    def __init__(self, backend: str, cfg: Any, caching: bool) -> None:
        if backend == "pagedkv":
            import pagedkv
            import pagedkv.scheduler as conf
            from pagedkv import sequence as seq_mod

            make = pagedkv.Scheduler
            self.SamplingParams = pagedkv.SamplingParams
        else:
            from pagedkv import vllm_release

            ns = vllm_release.load("0.4.2", "vllm" if backend == "vllm" else "pagedkv")
            conf, seq_mod, make = ns.config, ns.sequence, ns.scheduler.Scheduler
            self.SamplingParams = ns.sampling_params.SamplingParams
        self.seq_mod = seq_mod
        sched_cfg = conf.SchedulerConfig(
            cfg.prefill_token_budget, cfg.max_num_seqs, cfg.prompt_len_max + cfg.output_len_max
        )
        cache_cfg = conf.CacheConfig(cfg.block_size, 0.9, 1, "auto", enable_prefix_caching=caching)
        cache_cfg.num_gpu_blocks = cfg.num_gpu_blocks
        cache_cfg.num_cpu_blocks = cfg.num_cpu_blocks
        self.sched = make(sched_cfg, cache_cfg, None)
        self.block_size = cfg.block_size
        self.running = seq_mod.SequenceStatus.RUNNING
        self.capped = seq_mod.SequenceStatus.FINISHED_LENGTH_CAPPED
        self.Logprob = seq_mod.Logprob
        self.requests: Dict[str, Any] = {}
        self.next_child = 1 << 40
        self.step_s: List[float] = []
        self.schedule_s: List[float] = []

    def add(self, req: Any) -> None:
        seq = self.seq_mod.Sequence(req.index, "", list(req.prompt_token_ids), self.block_size)
        params = self.SamplingParams(n=req.n, best_of=req.n, max_tokens=req.output_len)
        group = self.seq_mod.SequenceGroup(req.request_id, [seq], params, req.arrival_time)
        self.requests[req.request_id] = req
        self.sched.add_seq_group(group)

    def step(self) -> None:
        t0 = time.perf_counter()
        metas, out = self.sched.schedule()
        t1 = time.perf_counter()
        self.process(out)
        t2 = time.perf_counter()
        self.schedule_s.append(t1 - t0)
        self.step_s.append(t2 - t0)

    def process(self, out: Any) -> None:
        sched = self.sched
        for sg in out.scheduled_seq_groups:
            group = sg.seq_group
            group.update_num_computed_tokens(sg.token_chunk_size)
            if group.is_prefill():
                continue
            req = self.requests[group.request_id]
            running = group.get_seqs(status=self.running)
            if req.n > 1 and len(group.get_seqs()) == 1:
                child = running[0].fork(self.next_child)
                self.next_child += 1
                group.add(child)
                sched.fork_seq(running[0], child)
                running.append(child)
            for row, seq in enumerate(running):
                pos = seq.get_output_len()
                tok = req.output_token_ids[row % len(req.output_token_ids)][pos]
                seq.append_token_id(tok, {tok: self.Logprob(0.0)})
                if pos + 1 >= req.output_len:
                    seq.status = self.capped
                    sched.free_seq(seq)
        sched.free_finished_seq_groups()


def compare(cfg: Any, caching: bool, max_steps: int) -> Dict[str, Dict[str, float]]:
    """Step the three engines in lockstep (one step of each in turn), so that machine noise
    falls on all of them alike."""
    engines = {b: Engine(b, cfg, caching) for b in BACKENDS}
    requests = generate_w1(cfg).requests
    for e in engines.values():
        for req in requests:
            e.add(req)
    gc.collect()
    gc.disable()
    try:
        steps = 0
        while steps < max_steps and any(e.sched.has_unfinished_seqs() for e in engines.values()):
            for e in engines.values():
                e.step()
            steps += 1
    finally:
        gc.enable()
    busy = {b: e.sched.has_unfinished_seqs() for b, e in engines.items()}
    if len(set(busy.values())) != 1:
        raise AssertionError(f"backends finished at different steps: {busy}")
    return {
        b: {
            "steps": len(e.step_s),
            "step_us": statistics.fmean(e.step_s) * 1e6,
            "schedule_us": statistics.fmean(e.schedule_s) * 1e6,
        }
        for b, e in engines.items()
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="W1 quick (96 requests)")
    ap.add_argument("--caching", choices=("on", "off", "both"), default="both")
    ap.add_argument("--steps", type=int, default=1_000_000, help="stop after N steps")
    args = ap.parse_args(argv)
    cfg = W1_QUICK if args.quick else W1_FULL
    for caching in {"on": [True], "off": [False], "both": [True, False]}[args.caching]:
        res = compare(cfg, caching, args.steps)
        base = res["vllm"]
        print(f"caching {'on' if caching else 'off'}: {base['steps']} steps")
        for b, r in res.items():
            print(
                f"  {b:8s} step {r['step_us']:9.1f} us  schedule {r['schedule_us']:9.1f} us"
                f"  whole-step speedup x{base['step_us'] / r['step_us']:.2f}"
                f"  schedule speedup x{base['schedule_us'] / r['schedule_us']:.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
