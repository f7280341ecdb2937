"""W1 whole engine step: the batch step (pagedkv.engine_step.BatchEngine) vs vLLM 0.4.2's own
Scheduler, same run.

``vllm`` is the engine loop of :mod:`pagedkv.bench.vllm_scheduler` over vLLM 0.4.2's Scheduler
with its own classes: ``schedule()`` plus the output processing (advance computed tokens, fork
``n > 1`` requests, append one token per running sequence, finish and free at the output
length, ``free_finished_seq_groups``). ``batch`` is one ``BatchEngine.step(sampled)`` per step:
it applies the previous step's tokens (stop checks, forks, frees), schedules, and writes the
model inputs (tokens, positions, slots, block tables, context lengths, query offsets, CoW and
swap pairs) into caller-owned buffers. The two run in lockstep and get the same tokens
(the workload's ``output_token_ids``); both must take the same number of steps.

The sampled-token array is what the model would hand back; building it is not timed (it is
the model's output, not engine work). GC is disabled while stepping, for both alike.

Reports µs per step, the ratio, and µs per running sequence (row) per step.
Run: ``python benches/bench_engine_step.py [--quick] [--caching on|off|both] [--steps N]``.

``--scale`` runs the batch step alone (no vLLM) on W1 scaled x1, x4, x16 (requests, running
limit, GPU and CPU pools, token budget; x4 is the issue's 4,096 requests, 1,024 running,
262,144 GPU blocks, so the base pool is 65,536 GPU blocks rather than W1's 24,576) and on a
pool-only sweep (the x1 batch with x1, x4, x16 GPU blocks), with plain and incremental buffers
(``--buffers``), and reports µs per running sequence per step, over every step and over the
decode-only steps (no prefill: the steady state, where a step's inputs are one token per row).
``--scale-steps N`` caps each run (default: to completion).
"""

from __future__ import annotations

import os

# numpy's BLAS threads spin after start-up; on a small shared machine they steal a core from
# whichever loop runs next. Nothing here uses BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Dict, List, Tuple  # noqa: E402

import numpy as np  # noqa: E402

from pagedkv.bench.vllm_scheduler import Engine, EngineConfig, make_backend  # noqa: E402
from pagedkv.bench.workload import W1_FULL, W1_QUICK, generate_w1  # noqa: E402


class BatchDriver:
    """The W1 requests through ``BatchEngine``."""

    def __init__(self, cfg: Any, caching: bool, incremental: bool = False) -> None:
        import pagedkv
        import pagedkv.scheduler as conf
        from pagedkv.engine_step import BatchBuffers, BatchEngine

        sched_cfg = conf.SchedulerConfig(
            cfg.prefill_token_budget, cfg.max_num_seqs, cfg.prompt_len_max + cfg.output_len_max
        )
        cache_cfg = conf.CacheConfig(cfg.block_size, 0.9, 1, "auto", enable_prefix_caching=caching)
        cache_cfg.num_gpu_blocks = cfg.num_gpu_blocks
        cache_cfg.num_cpu_blocks = cfg.num_cpu_blocks
        self.sched = pagedkv.Scheduler(sched_cfg, cache_cfg, None)
        self.next_child = 1 << 40
        bufs = BatchBuffers.for_scheduler(self.sched, incremental=incremental)
        self.engine = BatchEngine(self.sched, bufs, seq_counter=self._new_id)
        self.pagedkv = pagedkv
        self.block_size = cfg.block_size
        # seq id -> (request, row of the request's output_token_ids, prompt length)
        self.owner: Dict[int, Tuple[Any, int, int]] = {}
        self.sampled = np.zeros(0, np.int32)
        self.step_s: List[float] = []
        self.rows: List[int] = []
        self.prefill_steps: List[bool] = []

    def _new_id(self) -> int:
        self.next_child += 1
        return self.next_child - 1

    def add(self, req: Any) -> None:
        p = self.pagedkv
        seq = p.Sequence(req.index, "", list(req.prompt_token_ids), self.block_size)
        params = p.SamplingParams(n=req.n, best_of=req.n, max_tokens=req.output_len)
        self.owner[req.index] = (req, 0, len(req.prompt_token_ids))
        self.engine.add_seq_group(p.SequenceGroup(req.request_id, [seq], params, req.arrival_time))

    def step(self) -> None:
        t0 = time.perf_counter()
        res = self.engine.step(self.sampled, now=time.time())
        self.step_s.append(time.perf_counter() - t0)
        self.rows.append(res.num_rows)
        self.prefill_steps.append(res.num_prefill_groups > 0)
        self.sampled = self._model(res)

    def _model(self, res: Any) -> np.ndarray:
        """The tokens the engine loop of bench_scheduler_step.py appends, for res's rows."""
        b, out, child = res.buffers, [], self.next_child
        for i in range(res.num_rows):
            k = int(b.num_samples[i])
            if not k:
                continue
            req, row, plen = self.owner[int(b.seq_ids[i])]
            pos = int(b.context_lens[i]) - plen
            rows = req.output_token_ids
            for _ in range(k - 1):  # children take rows 1.. (the parent keeps row 0)
                self.owner[child] = (req, row + 1, plen)
                out.append(rows[(row + 1) % len(rows)][pos])
                child += 1
            out.append(rows[row % len(rows)][pos])
        return np.array(out, dtype=np.int32)


def compare(cfg: Any, caching: bool, max_steps: int, turn: int = 1) -> Dict[str, Dict[str, float]]:
    """Step both in lockstep, ``turn`` steps of one, then ``turn`` of the other (1: strict
    alternation, as benches/bench_scheduler_step.py; each step then starts with caches full of
    the other loop's data, which costs the native step far more than vLLM's Python loop)."""
    vllm = Engine(make_backend("0.4.2", "vllm"), EngineConfig.from_w1(cfg, caching))
    batch = BatchDriver(cfg, caching)
    for req in generate_w1(cfg).requests:
        vllm.add(req)
        batch.add(req)
    gc.collect()
    gc.disable()
    try:
        steps = 0
        while steps < max_steps and vllm.busy():
            n = 0
            while n < turn and steps + n < max_steps and vllm.busy():
                vllm.step()
                n += 1
            for _ in range(n):
                batch.step()
            steps += n
        # The batch step applies a step's tokens at the next call: one more call applies
        # the last ones (timed, and counted against the same number of steps).
        batch.step()
    finally:
        gc.enable()
    if steps < max_steps and (batch.sched.has_unfinished_seqs() or batch.rows[-1]):
        raise AssertionError("the batch step did not finish with vLLM")
    rows = sum(batch.rows)
    return {
        "vllm": {"steps": steps, "step_us": statistics.fmean(vllm.step_seconds) * 1e6},
        "batch": {
            "steps": steps,
            "step_us": sum(batch.step_s) * 1e6 / steps,
            "rows_per_step": rows / steps,
            "us_per_row": sum(batch.step_s) * 1e6 / max(1, rows),
            "vllm_us_per_row": sum(vllm.step_seconds) * 1e6 / max(1, rows),
        },
    }


#: GPU blocks per x of the scaling sweep (the issue's x4: 262,144 blocks).
SCALE_GPU_BLOCKS = 65_536
SCALE_FACTORS = (1, 4, 16)


def scale_configs(quick: bool) -> Dict[str, List[Any]]:
    """``{"batch": [x1, x4, x16], "pool": [x1, x4, x16]}`` over W1 (W1 quick: 1/4 of it)."""
    base = dataclasses.replace(W1_FULL, name="W1-scale", num_gpu_blocks=SCALE_GPU_BLOCKS)
    if quick:
        base = dataclasses.replace(
            W1_QUICK, name="W1-scale", num_gpu_blocks=SCALE_GPU_BLOCKS // 4, num_cpu_blocks=1024
        )
    batch = [
        dataclasses.replace(
            base,
            num_requests=base.num_requests * k,
            max_num_seqs=base.max_num_seqs * k,
            num_gpu_blocks=base.num_gpu_blocks * k,
            num_cpu_blocks=base.num_cpu_blocks * k,
            prefill_token_budget=base.prefill_token_budget * k,
        )
        for k in SCALE_FACTORS
    ]
    pool = [
        dataclasses.replace(base, num_gpu_blocks=base.num_gpu_blocks * k) for k in SCALE_FACTORS
    ]
    return {"batch": batch, "pool": pool}


def run_batch(cfg: Any, caching: bool, incremental: bool, max_steps: int) -> Dict[str, float]:
    """The batch step alone over ``cfg``'s requests: µs per running sequence per step."""
    drv = BatchDriver(cfg, caching, incremental)
    for req in generate_w1(cfg).requests:
        drv.add(req)
    gc.collect()
    gc.disable()
    try:
        while len(drv.step_s) < max_steps and (drv.sched.has_unfinished_seqs() or drv.rows[-1:]):
            drv.step()
            if not drv.rows[-1] and not drv.sched.has_unfinished_seqs():
                break
    finally:
        gc.enable()
    t, rows = np.array(drv.step_s) * 1e6, np.array(drv.rows)
    dec = ~np.array(drv.prefill_steps) & (rows > 0)
    return {
        "steps": len(t),
        "rows_per_step": float(rows.mean()),
        "us_per_row": float(t.sum() / max(1, rows.sum())),
        "decode_steps": int(dec.sum()),
        "decode_rows_per_step": float(rows[dec].mean()) if dec.any() else 0.0,
        "decode_us_per_row": float(t[dec].sum() / max(1, rows[dec].sum())),
        "decode_median_us": float(np.median(t[dec])) if dec.any() else 0.0,
    }


def scale(quick: bool, caching: bool, buffers: List[bool], max_steps: int) -> None:
    for sweep, configs in scale_configs(quick).items():
        for k, cfg in zip(SCALE_FACTORS, configs):
            for inc in buffers:
                r = run_batch(cfg, caching, inc, max_steps)
                print(
                    f"{sweep:5} x{k:<2} {cfg.num_requests:6} req {cfg.max_num_seqs:5} max running "
                    f"{cfg.num_gpu_blocks:8} GPU blocks {'incremental' if inc else 'plain':11}: "
                    f"{r['steps']:5} steps, {r['rows_per_step']:7.1f} rows/step, "
                    f"{r['us_per_row']:.3f} us/row; decode steps {r['decode_steps']:5} "
                    f"({r['decode_rows_per_step']:7.1f} rows): {r['decode_us_per_row']:.3f} us/row,"
                    f" median step {r['decode_median_us']:8.1f} us",
                    flush=True,
                )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="W1 quick (96 requests)")
    ap.add_argument("--caching", choices=("on", "off", "both"), default="both")
    ap.add_argument("--steps", type=int, default=1_000_000, help="stop after N steps")
    ap.add_argument(
        "--turn", type=int, default=1, help="steps of one loop before the other's (default 1)"
    )
    ap.add_argument("--scale", action="store_true", help="the scaling sweeps (batch step only)")
    ap.add_argument("--buffers", choices=("plain", "incremental", "both"), default="both")
    ap.add_argument("--scale-steps", type=int, default=1_000_000, help="cap each scale run")
    args = ap.parse_args(argv)
    if args.scale:
        bufs = {"plain": [False], "incremental": [True], "both": [False, True]}[args.buffers]
        for caching in {"on": [True], "off": [False], "both": [True, False]}[args.caching]:
            print(f"== scaling, caching {'on' if caching else 'off'} ==", flush=True)
            scale(args.quick, caching, bufs, args.scale_steps)
        return 0
    cfg = W1_QUICK if args.quick else W1_FULL
    for caching in {"on": [True], "off": [False], "both": [True, False]}[args.caching]:
        res = compare(cfg, caching, args.steps, args.turn)
        v, b = res["vllm"], res["batch"]
        print(
            f"caching {'on' if caching else 'off'}, turns of {args.turn}: {v['steps']} steps, "
            f"{b['rows_per_step']:.1f} running sequences per step on average\n"
            f"  vllm   step {v['step_us']:9.1f} us  ({b['vllm_us_per_row']:.2f} us per sequence)\n"
            f"  batch  step {b['step_us']:9.1f} us  ({b['us_per_row']:.3f} us per sequence)"
            f"  speedup x{v['step_us'] / b['step_us']:.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
