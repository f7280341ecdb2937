"""``pagedkv bench --plot out.png``: one figure of the run (needs ``pip install 'pagedkv[plot]'``).

Panels, top to bottom:

* **the headline**, one panel per workload: the whole engine step against vLLM, one group of
  bars per vLLM generation compared (``--compare``) and caching setting, one bar per pagedkv
  path (``compat``, ``batch``): vLLM's total step time / the path's, measured in the same run
  (above 1: pagedkv is faster). Without ``--compare`` the panel says so;
* the block manager alone (the replayed schedule, manager time only): the speedup of each
  backend over the pure-Python reference, the ratio of mean per-step times in the same run;
* with ``--compare``, the same against vLLM's own block manager, in a panel of its own;
* the distribution of the manager's per-step time for every backend and caching setting, one
  panel per workload (box: p25-p75 with the median, whiskers: p1-p99; log scale);
* the scaling sweep (with ``--scale``, which ``--plot`` implies): median per-step time (the batch
  step's whole step, the native managers' replay) vs running sequences (W1 x1, x4, x16) and vs
  GPU pool size (x1, x4, x16 blocks, same batch).

The JSON output (``--json``) holds every number drawn here.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["require_matplotlib", "whole_step_bars", "write_plot"]

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
    whole_step: Optional[Dict[str, List[Dict[str, Any]]]] = None,
) -> None:
    """Draw the whole-step sections (``whole_step``: workload name -> sections), the replays
    (``results``: workload name -> RunResults) and ``scaling`` into the PNG ``path``."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display needed, and never a window
    import matplotlib.pyplot as plt

    whole_step = whole_step or {}
    workloads = [w for w, runs in results.items() if runs]
    ncols = max(2, len(workloads), len(whole_step))
    vs_ref = _speedup_bars(results, lambda runs: ["reference"])
    vs_vllm = _speedup_bars(results, _vllm_names)
    rows = 3 + bool(vs_vllm[0]) + (scaling is not None)
    width = max(7 * ncols, 1.4 * max(len(vs_ref[0]), len(vs_vllm[0])) + 2)
    fig = plt.figure(figsize=(width, 5 * rows), dpi=100, layout="constrained")
    grid = fig.add_gridspec(rows, ncols)
    for i, name in enumerate(whole_step or {"": []}):
        _whole_step_panel(fig.add_subplot(grid[0, i]), name, whole_step.get(name, []))
    _speedups(fig.add_subplot(grid[1, :]), *vs_ref, "the pure-Python reference")
    row = 2
    if vs_vllm[0]:
        _speedups(fig.add_subplot(grid[row, :]), *vs_vllm, "vLLM's own block manager")
        row += 1
    for i, name in enumerate(workloads):
        _distribution(fig.add_subplot(grid[row, i]), name, results[name])
    if scaling is not None:
        _scaling(fig.add_subplot(grid[row + 1, 0]), scaling, "batch")
        _scaling(fig.add_subplot(grid[row + 1, 1]), scaling, "pool")
    if title:
        fig.suptitle(title, fontsize=13)
    fig.savefig(path)
    plt.close(fig)


def whole_step_bars(sections: List[Dict[str, Any]]) -> Tuple[List[str], Dict[str, List[float]]]:
    """The headline's bars for one workload: a group per (vLLM generation, caching setting),
    a bar per pagedkv path, the value vLLM's total step time / the path's (0: none)."""
    groups: List[str] = []
    bars: Dict[str, List[float]] = {}
    for sec in sections:
        lanes = sec["lanes"]
        paths = [n for n, st in lanes.items() if not st.get("baseline")]
        for vllm, st in lanes.items():
            if not st.get("baseline"):
                continue
            label = f"vLLM {st.get('release') or vllm}\ncache {'on' if sec['caching'] else 'off'}"
            if sec.get("kv_events"):
                label += " + KV events"
            if "decisions_differ_at_step" in st:
                label += f"\ndiffers from step {st['decisions_differ_at_step']}"
            if "error" in st:  # the ratio is over the steps it ran
                label += f"\nfailed at step {st['steps']}"
            groups.append(label)
            for path in paths:
                _put(bars, len(groups), path, sec["ratios"].get(f"{path}_vs_{vllm}") or 0.0)
    return groups, _pad(bars, len(groups))


def _put(bars: Dict[str, List[float]], groups: int, name: str, value: float) -> None:
    """``name``'s bar in the last of ``groups`` groups (0 in the groups it has none)."""
    row = bars.setdefault(name, [])
    row += [0.0] * (groups - 1 - len(row)) + [value]


def _pad(bars: Dict[str, List[float]], groups: int) -> Dict[str, List[float]]:
    for row in bars.values():
        row += [0.0] * (groups - len(row))
    return bars


def _whole_step_panel(ax: Any, name: str, sections: List[Dict[str, Any]]) -> None:
    where = f"{name.upper()}: " if name else ""
    steps = sections[0]["steps"] if sections else 0
    _ratio_panel(
        ax,
        *whole_step_bars(sections),
        f"{where}whole engine step vs vLLM ({steps} steps, same run; >1: pagedkv faster)",
        "vLLM step time / pagedkv step time\n(a vLLM that failed: over the steps it ran)",
        f"{where}whole step vs vLLM: no vLLM in this run (--compare vllm==0.4.2)",
    )


def _ratio_panel(
    ax: Any,
    groups: List[str],
    bars: Dict[str, List[float]],
    title: str,
    ylabel: str,
    empty: str,
    log: bool = False,
) -> None:
    """Grouped bars of ratios around a line at 1 (``empty``: the title when there are none)."""
    if not groups:
        ax.axis("off")
        ax.set_title(empty)
        return
    _grouped_bars(ax, groups, bars)
    ax.axhline(1.0, color="black", linewidth=0.8)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)


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


def _vllm_names(runs: List[Any]) -> List[str]:
    from pagedkv.bench.report import vllm_names

    return vllm_names(runs)


def _is_vllm(backend: str) -> bool:
    return backend.startswith("vllm")


def _speedup_bars(
    results: Dict[str, List[Any]], baselines_of: Any
) -> Tuple[List[str], Dict[str, List[float]]]:
    """Bar groups (workload, caching, baseline) and each backend's speedup in every group
    (0 where it has none: the baseline itself, or a backend absent from that run)."""
    from pagedkv.bench.report import speedups

    groups: List[str] = []
    bars: Dict[str, List[float]] = {}
    for name, runs in results.items():
        for caching in sorted({r.enable_caching for r in runs}):
            subset = [r for r in runs if r.enable_caching == caching]
            for base in baselines_of(runs):
                if not any(r.backend == base for r in subset):
                    continue
                sp = speedups(subset, base)
                groups.append(f"{name.upper()} cache {'on' if caching else 'off'}\nvs {base}")
                for i, r in enumerate(subset):
                    if r.backend == base or _is_vllm(r.backend) and _is_vllm(base):
                        continue
                    _put(bars, len(groups), r.backend, sp[i] or 0.0)
    return groups, _pad(bars, len(groups))


def _speedups(ax: Any, groups: List[str], bars: Dict[str, List[float]], against: str) -> None:
    _ratio_panel(
        ax,
        groups,
        bars,
        f"Block manager alone (replayed schedule): speedup over {against} (mean per-step "
        "time, same run)",
        "speedup (baseline mean / mean, log)",
        f"Block manager alone: {against} is not in this run",
        log=True,
    )


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
