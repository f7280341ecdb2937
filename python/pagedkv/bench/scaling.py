"""The scaling sweep of ``pagedkv bench --scale``: per-step manager cost as the batch and the
pool grow.

Two sweeps over the factors 1, 4 and 16, every backend on the same runs, prefix caching on:

* **batch**: W1's request mix with the running-sequence limit, the GPU and CPU pools and the
  prefill budget all multiplied by the factor (two waves of requests: ``2 * max_num_seqs``), so
  the per-step cost is measured at x1, x4 and x16 as many running sequences;
* **pool**: the x1 run with only the GPU pool multiplied, so the batch stays the same and any
  growth of the per-step cost is a cost of the pool's size (a good manager shows none).

A point is the median per-step time: a sweep run has a few hundred steps, and on a shared
machine one descheduled step would move the mean by more than the effect measured.

The base is the quick W1 (24 running sequences, 2,304 blocks); ``--quick`` halves it and
shortens the outputs so that the whole sweep stays within seconds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, TextIO

from pagedkv.bench.workload import W1_QUICK, WorkloadConfig, generate

__all__ = ["FACTORS", "base_config", "sweep_configs", "run_scaling", "format_scaling"]

FACTORS = (1, 4, 16)


def base_config(quick: bool) -> WorkloadConfig:
    """The x1 run of the sweep."""
    base = dataclasses.replace(W1_QUICK, name="W1-scale", num_requests=2 * W1_QUICK.max_num_seqs)
    if not quick:
        return base
    return dataclasses.replace(
        base,
        num_requests=24,
        max_num_seqs=12,
        num_gpu_blocks=1152,
        num_cpu_blocks=512,
        output_len_min=16,
        output_len_max=48,
    )


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
) -> Dict[str, Any]:
    """Run both sweeps on every backend; the JSON section (and the table, to ``out``)."""
    from pagedkv.bench.driver import run as run_driver

    doc: Dict[str, Any] = {"factors": list(FACTORS), "enable_caching": True}
    for sweep, configs in sweep_configs(quick).items():
        points = []
        for k, cfg in zip(FACTORS, configs):
            workload = generate(cfg, seed=seed)
            point: Dict[str, Any] = {
                "factor": k,
                "max_num_seqs": cfg.max_num_seqs,
                "num_gpu_blocks": cfg.num_gpu_blocks,
                "num_requests": cfg.num_requests,
                "us_per_step": {},  # median: a sweep point has few steps, the median is robust
                "mean_us": {},
                "p99_us": {},
            }
            for b in backends:
                desc = f"scale {sweep} x{k} {b.name}"
                bar = progress.bar(len(workload.requests), desc) if progress else None
                if bar is not None:
                    with bar:
                        r = run_driver(workload, b, True, progress=bar.update)
                else:
                    r = run_driver(workload, b, True)
                stats = r.step_stats()
                point["us_per_step"][b.name] = stats["p50"]
                point["mean_us"][b.name] = stats["mean"]
                point["p99_us"][b.name] = stats["p99"]
                point["mean_batch_seqs"] = r.mean_batch_seqs
            points.append(point)
        doc[sweep] = points
    if out is not None:
        print(file=out)
        print(format_scaling(doc), file=out, flush=True)
    return doc


def format_scaling(doc: Dict[str, Any]) -> str:
    """The sweep as a table: mean manager us per step per backend, and per running sequence."""
    names = list(doc["batch"][0]["us_per_step"]) if doc.get("batch") else []
    lines = [
        "== Scaling (W1 mix, caching on): manager us per step, median (and per running sequence) =="
    ]
    header = f"{'sweep':<6} {'x':>3} {'seqs/step':>9} {'GPU blocks':>10}  " + "  ".join(
        f"{n:>22}" for n in names
    )
    lines.append(header)
    for sweep in ("batch", "pool"):
        for p in doc.get(sweep, []):
            seqs = p["mean_batch_seqs"] or 1.0
            cells = "  ".join(
                f"{p['us_per_step'][n]:>10.1f} ({p['us_per_step'][n] / seqs:>6.2f}/seq)"
                for n in names
            )
            lines.append(
                f"{sweep:<6} {p['factor']:>3} {p['mean_batch_seqs']:>9.1f} "
                f"{p['num_gpu_blocks']:>10}  {cells}"
            )
    return "\n".join(lines)
