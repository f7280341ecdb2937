"""The scaling sweep of ``pagedkv bench --scale``: per-step cost as the batch and the pool grow.

Two sweeps over the factors 1, 4 and 16, prefix caching on:

* **batch**: W1's request mix with the requests, the running-sequence limit, the GPU and CPU
  pools and the step's token budget multiplied by the factor: x1 is 1,024 requests, 256
  running and 65,536 GPU blocks; x4 is 4,096 requests, 1,024 running and 262,144 GPU blocks;
  x16 is 16,384 requests, 4,096 running and 1,048,576 GPU blocks;
* **pool**: the x1 run with only the GPU pool multiplied, so the batch stays the same and any
  growth of the per-step cost is a cost of the pool's size (there should be none).

Each point runs the first :data:`MAX_STEPS` steps of the workload (the batch is full after a
few dozen) with the batch step (:class:`pagedkv.vllm_042.engine_step.BatchEngine`, whole step, with
plain and with incremental :class:`~pagedkv.vllm_042.engine_step.BatchBuffers`, the latter with
rows in schedule order and with stable rows) and replays the same
steps, recorded from :class:`pagedkv.Scheduler`, onto the native block manager backends
(manager time only). vLLM's default policy does not mix prompts and decodes:
a prefill step costs what its prompts cost (allocation and hashing of every prompt token, the
"changed entries"), a decode step what its running sequences cost. A point is the median time
of the decode-only steps and the median of their time per running sequence (on a shared
machine one descheduled step would move a mean by more than the effect measured); the JSON
also has the median over every step and the total time over the total rows.

``--quick`` scales down from W1's quick configuration (24 running sequences) so that the whole
sweep stays within seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, List, Optional, TextIO, Tuple

import numpy as np

from pagedkv.bench.workload import W1_FULL, W1_QUICK, WorkloadConfig, generate

__all__ = ["FACTORS", "MAX_STEPS", "base_config", "sweep_configs", "run_scaling", "format_scaling"]

FACTORS = (1, 4, 16)

#: Steps run per point (full, quick).
MAX_STEPS = {False: 200, True: 60}

#: Buffers the batch step is timed with, and their column names: plain (every row whole),
#: incremental (block-table increments; rows in schedule order) and stable (incremental
#: buffers with stable rows: a running sequence keeps its row).
BUFFERS = ("plain", "incremental", "stable")
_BATCH_LANES = {
    "plain": "batch-step",
    "incremental": "batch-step-inc",
    "stable": "batch-step-stable",
}

#: Backends whose manager replay is part of the sweep (the pure-Python ones are too slow at x16).
SCALING_BACKENDS = ("native", "native-batch")


def base_config(quick: bool) -> WorkloadConfig:
    """The x1 run of the sweep."""
    if quick:
        return dataclasses.replace(
            W1_QUICK, name="W1-scale", num_requests=48, num_gpu_blocks=4096, output_len_max=64
        )
    return dataclasses.replace(W1_FULL, name="W1-scale", num_gpu_blocks=65536)


def sweep_configs(quick: bool) -> Dict[str, List[WorkloadConfig]]:
    """``{"batch": [x1, x4, x16], "pool": [x1, x4, x16]}``."""
    base = base_config(quick)
    batch = [
        dataclasses.replace(
            base,
            num_requests=base.num_requests * k,
            max_num_seqs=base.max_num_seqs * k,
            num_gpu_blocks=base.num_gpu_blocks * k,
            num_cpu_blocks=base.num_cpu_blocks * k,
            prefill_token_budget=base.prefill_token_budget * k,
        )
        for k in FACTORS
    ]
    pool = [dataclasses.replace(base, num_gpu_blocks=base.num_gpu_blocks * k) for k in FACTORS]
    return {"batch": batch, "pool": pool}


def run_scaling(
    backends: List[Any],
    quick: bool,
    seed: int = 0,
    progress: Optional[Any] = None,
    out: Optional[TextIO] = None,
    max_steps: Optional[int] = None,
    buffers: Tuple[str, ...] = BUFFERS,
    caching: bool = True,
) -> Dict[str, Any]:
    """Run both sweeps (``max_steps`` steps per point, default :data:`MAX_STEPS`; the batch
    step with each of ``buffers``: ``"plain"``, ``"incremental"``, ``"stable"``); the JSON
    section (and the table, to ``out``)."""
    replayed = [b for b in backends if b.name in SCALING_BACKENDS]
    steps = MAX_STEPS[quick] if max_steps is None else max_steps
    doc: Dict[str, Any] = {
        "factors": list(FACTORS),
        "enable_caching": caching,
        "max_steps": steps,
        "timed": [_BATCH_LANES[b] for b in buffers] + [b.name for b in replayed],
    }
    for sweep, configs in sweep_configs(quick).items():
        doc[sweep] = [
            _point(k, cfg, replayed, buffers, (steps, seed, caching), progress)
            for k, cfg in zip(FACTORS, configs)
        ]
    if out is not None:
        print(file=out)
        print(format_scaling(doc), file=out, flush=True)
    return doc


def _point(
    k: int,
    cfg: WorkloadConfig,
    backends: List[Any],
    buffers: Tuple[str, ...],
    run: Tuple[int, int, bool],
    progress: Any,
) -> Dict[str, Any]:
    """One point of a sweep: ``run`` is (steps, seed, caching)."""
    from pagedkv.bench.vllm_042.replay import replay
    from pagedkv.bench.vllm_042.trace import record

    steps, seed, caching = run
    workload = generate(cfg, seed=seed)
    point: Dict[str, Any] = {
        "factor": k,
        "max_num_seqs": cfg.max_num_seqs,
        "num_gpu_blocks": cfg.num_gpu_blocks,
        "num_requests": cfg.num_requests,
        "us_per_step": {},  # median over every step
        "decode_us_per_step": {},  # median over decode-only steps
        "us_per_row": {},  # median over decode-only steps of us / running sequences
        "mean_us_per_row": {},  # every step: total us / total running sequences
    }
    desc = f"scale x{k}: {cfg.max_num_seqs} seqs, {cfg.num_gpu_blocks} blocks"
    total = len(buffers) + len(backends)
    with progress.bar(total, desc) if progress else contextlib.nullcontext() as bar:
        for kind in buffers:
            seconds, rows, decode = _batch_steps(workload, steps, caching, kind)
            _store(point, _BATCH_LANES[kind], seconds * 1e6, rows, decode)
            point["mean_batch_seqs"] = float(rows.mean())
            point["decode_steps"] = int(decode.sum())
            if bar is not None:
                bar.update(1)
        if not backends:
            return point
        trace = record(workload, caching, max_steps=steps)
        trace_rows = np.asarray([s.rows for s in trace.steps], dtype=float)
        decode = np.asarray([_decode_only(s) for s in trace.steps])
        for b in backends:
            r = replay(trace, b)
            if r.mismatch:
                point.setdefault("mismatch", {})[b.name] = r.mismatch
            _store(point, b.name, r.step_times_us, trace_rows, decode)
            if bar is not None:
                bar.update(1)
    return point


def _batch_steps(workload: Any, steps: int, caching: bool, kind: str) -> Any:
    """The first ``steps`` batch steps of ``workload`` (fewer if it ends) with ``kind`` of
    :data:`BUFFERS`: seconds and rows per step, and which steps only decode."""
    from pagedkv.bench.harness import EngineConfig, run_lockstep
    from pagedkv.bench.vllm_042.wholestep import batch_engine

    engine = batch_engine(incremental=kind != "plain", stable_rows=kind == "stable")
    cfg = EngineConfig.from_workload(workload.config, caching)
    run = run_lockstep([engine], cfg, workload.requests, turn=None, max_steps=steps)
    lane = run.lanes[0]
    n = run.steps  # the lane's last call (applying the last tokens) is not one of the steps
    rows = np.asarray(lane.rows[:n], dtype=float)
    decode = (np.asarray(lane.prefills[:n]) == 0) & (rows > 0)
    return np.asarray(lane.seconds[:n]), rows, decode


def _decode_only(step: Any) -> bool:
    """A step that only decodes: nothing admitted, no prompt chunk."""
    return step.rows > 0 and not step.admitted and all(c == 1 for _, c in step.scheduled)


def _store(
    point: Dict[str, Any], name: str, us: np.ndarray, rows: np.ndarray, decode: np.ndarray
) -> None:
    """Step statistics of one timed engine. Prefill steps cost what their prompts cost
    (allocation, hashing): the per-sequence figure is taken over decode-only steps."""
    point["us_per_step"][name] = float(np.median(us))
    point["mean_us_per_row"][name] = float(us.sum() / max(1.0, rows.sum()))
    if decode.any():
        point["decode_us_per_step"][name] = float(np.median(us[decode]))
        point["us_per_row"][name] = float(np.median(us[decode] / rows[decode]))
    else:
        point["decode_us_per_step"][name] = point["us_per_row"][name] = float("nan")


def format_scaling(doc: Dict[str, Any]) -> str:
    """The sweeps as a table: median µs per step and per batch row, per timed engine."""
    names = doc.get("timed", [])
    lines = [
        f"== Scaling (W1 mix, caching {'on' if doc.get('enable_caching') else 'off'}, at most "
        f"{doc.get('max_steps')} steps): median us per decode step (and per running sequence); "
        "batch-step(-inc/-stable) = the whole batch step (plain / incremental buffers / "
        "incremental with stable rows), the others = "
        "manager time of the replayed schedule =="
    ]
    header = f"{'sweep':<6} {'x':>3} {'running':>7} {'rows/step':>9} {'GPU blocks':>10}  "
    lines.append(header + "  ".join(f"{n:>24}" for n in names))
    for sweep in ("batch", "pool"):
        for p in doc.get(sweep, []):
            cells = "  ".join(
                f"{p['decode_us_per_step'][n]:>11.1f} ({p['us_per_row'][n]:>6.3f}/seq)"
                for n in names
            )
            lines.append(
                f"{sweep:<6} {p['factor']:>3} {p['max_num_seqs']:>7} {p['mean_batch_seqs']:>9.1f} "
                f"{p['num_gpu_blocks']:>10}  {cells}"
            )
            for name, why in p.get("mismatch", {}).items():
                lines.append(f"  MISMATCH {name}: {why}")
    return "\n".join(lines)
