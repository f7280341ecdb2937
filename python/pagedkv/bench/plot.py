"""``pagedkv bench --plot out.png``: one figure of the run (needs ``pip install 'pagedkv[plot]'``).

* top row, one panel per workload: the distribution of the manager's per-step time for every
  backend and caching setting (box: p25-p75 with the median, whiskers: p1-p99; log scale);
* middle row: the speedup of each backend over the reference (and over each compared vLLM), the
  ratio of mean per-step times measured in the same run;
* bottom row: the scaling sweep, median per-step time (the batch step's whole step, the native
  managers' replay) vs running sequences (W1 x1, x4, x16) and vs GPU pool size (x1, x4, x16
  blocks, same batch).

The JSON output (``--json``) holds every number drawn here.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["require_matplotlib", "write_plot"]

_HINT = "--plot needs matplotlib: pip install 'pagedkv[plot]'"


def require_matplotlib() -> None:
    """ImportError with the install hint if matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(_HINT) from None


def write_plot(
    path: str,
    results: Dict[str, List[Any]],
    scaling: Optional[Dict[str, Any]],
    title: str = "",
) -> None:
    """Draw ``results`` (workload name -> RunResults) and ``scaling`` into the PNG ``path``."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display needed, and never a window
    import matplotlib.pyplot as plt

    workloads = [w for w, runs in results.items() if runs]
    ncols = max(2, len(workloads))
    groups, bars = _speedup_bars(results)
    width = max(7 * ncols, 1.4 * len(groups) + 2)
    fig = plt.figure(figsize=(width, 15), dpi=100, layout="constrained")
    grid = fig.add_gridspec(3, ncols)
    for i, name in enumerate(workloads):
        _distribution(fig.add_subplot(grid[0, i]), name, results[name])
    _speedups(fig.add_subplot(grid[1, :]), groups, bars)
    if scaling is not None:
        _scaling(fig.add_subplot(grid[2, 0]), scaling, "batch")
        _scaling(fig.add_subplot(grid[2, 1]), scaling, "pool")
    if title:
        fig.suptitle(title, fontsize=13)
    fig.savefig(path)
    plt.close(fig)


def _label(r: Any) -> str:
    return f"{r.backend}\ncache {'on' if r.enable_caching else 'off'}"


def _distribution(ax: Any, name: str, runs: List[Any]) -> None:
    data = [r.step_times_us[r.step_times_us > 0] for r in runs]
    ax.boxplot(data, whis=(1, 99), showfliers=False)
    ax.set_xticks(range(1, len(runs) + 1), [_label(r) for r in runs], rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("manager time per step (us, log)")
    steps = runs[0].steps
    pre = f"{runs[0].preempt_recompute}+{runs[0].preempt_swap}"
    ax.set_title(f"{name.upper()}: manager time per step ({steps} steps, preempted {pre})")
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)


def _speedup_bars(results: Dict[str, List[Any]]) -> Tuple[List[str], Dict[str, List[float]]]:
    """Bar groups (workload, caching, baseline) and each backend's speedup in every group
    (0 where it has none: the baseline itself, or a backend absent from that run)."""
    from pagedkv.bench.report import speedups, vllm_names

    groups: List[str] = []
    bars: Dict[str, List[float]] = {}
    for name, runs in results.items():
        baselines = ["reference"] + vllm_names(runs)
        for caching in sorted({r.enable_caching for r in runs}):
            subset = [r for r in runs if r.enable_caching == caching]
            for base in baselines:
                if not any(r.backend == base for r in subset):
                    continue
                sp = speedups(subset, base)
                groups.append(f"{name.upper()} cache {'on' if caching else 'off'}\nvs {base}")
                for i, r in enumerate(subset):
                    row = bars.setdefault(r.backend, [])
                    row += [0.0] * (len(groups) - 1 - len(row))
                    row.append(0.0 if r.backend == base else (sp[i] or 0.0))
    for row in bars.values():
        row += [0.0] * (len(groups) - len(row))
    return groups, bars


def _speedups(ax: Any, groups: List[str], bars: Dict[str, List[float]]) -> None:
    if not groups:
        ax.axis("off")
        ax.set_title("Speedups: no baseline (reference or a compared vLLM) in this run")
        return
    _grouped_bars(ax, groups, bars)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("speedup (baseline mean / mean, log)")
    ax.set_title("Speedup over the baseline named under each group (mean per-step time, same run)")


def _grouped_bars(ax: Any, groups: Sequence[str], bars: Dict[str, List[float]]) -> None:
    n = max(1, len(bars))
    width = 0.8 / n
    for j, (backend, values) in enumerate(bars.items()):
        xs = [g + (j - (n - 1) / 2) * width for g in range(len(groups))]
        shown = [v if v > 0 else float("nan") for v in values]
        drawn = ax.bar(xs, shown, width, label=backend)
        for rect, v in zip(drawn, values):
            if v > 0:
                text = f"{v:.1f}x" if v >= 10 else f"{v:.2f}x"
                ax.annotate(
                    text,
                    (rect.get_x() + rect.get_width() / 2, v),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars
    ax.grid(axis="y", which="both", alpha=0.3)


def _scaling(ax: Any, scaling: Dict[str, Any], sweep: str) -> None:
    points = scaling.get(sweep, [])
    if not points:
        return
    backends = list(points[0]["us_per_step"])
    if sweep == "batch":
        xs = [p["mean_batch_seqs"] for p in points]
        ax.set_xlabel("running sequences per step (mean; W1 x1, x4, x16)")
        ax.set_title("Per-step cost vs running sequences (batch and pool grow together)")
    else:
        xs = [p["num_gpu_blocks"] for p in points]
        ax.set_xlabel("GPU pool (blocks; x1, x4, x16, same batch)")
        ax.set_title("Per-step cost vs pool size (same batch)")
    for b in backends:
        ax.plot(xs, [p["us_per_step"][b] for p in points], marker="o", label=b)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylabel("us per step, median (batch-step: whole step; others: manager only; log)")
    ax.legend(fontsize=8)
    ax.grid(which="both", alpha=0.3)
