"""Text tables, the cross-backend schedule check and the JSON document of ``pagedkv bench``."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from pagedkv.bench.vllm_042.replay import RunResult

__all__ = [
    "cross_check",
    "describe_workload",
    "format_cross_check",
    "format_micro",
    "format_runs",
    "format_whole_step",
    "format_w1",
    "run_dicts",
    "speedups",
    "vllm_names",
]


def _table(headers: Sequence[str], rows: List[Sequence[str]], right: Sequence[bool]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def _f(x: Optional[float], fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ratio(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}x" if x >= 10 else f"{x:.2f}x"


# -------------------------------------------------------------------------------------- micro


def format_micro(micro: Dict[str, Any]) -> str:
    h = micro["hashing"]
    lines = [
        f"Chained block hashing, one {h['prompt_tokens']}-token prompt, "
        f"block size {h['block_size']}:"
    ]
    rows = []
    labels = [
        ("native_list", "pagedkv.hash_blocks(list)"),
        ("native_array", "pagedkv.hash_blocks(np.int32 array)"),
        ("reference_list", "reference.hashing.hash_blocks(list)"),
    ]
    for key, label in labels:
        if key in h:
            r = h[key]
            rows.append(
                [
                    label,
                    _f(r["us_per_prompt"]),
                    _f(r["mtok_per_s"], "{:.2f}"),
                    _ratio(r.get("speedup_vs_reference")),
                ]
            )
    lines.append(
        _table(["", "us/prompt", "Mtok/s", "vs reference"], rows, [False, True, True, True])
    )
    if "note" in h:
        lines.append(f"  note: {h['note']}")

    p = micro["pool"]
    lines.append("")
    lines.append(
        f"Block pool, {p['pool_blocks']:,} blocks, caching on "
        f"(ns per operation, Python loop of calls; cache cycle on {p['cache_cycle_blocks']:,} "
        "blocks):"
    )
    nat = p.get("native", {})
    ref = p.get("reference", {})
    sp = p.get("speedup_vs_reference", {})
    op_labels = [
        ("allocate", "allocate()                  per call"),
        ("free", "free(b)                     per call"),
        ("allocate_many", "allocate_many(n)            batched, per block"),
        ("free_many", "free_many(blocks)           batched, per block"),
        ("register", "register(b, hash, tokens)   per call"),
        ("lookup_hit", "lookup(hash, tokens) hit    per call"),
        ("incref_revive", "incref(b) revive evictable  per call"),
        ("free_to_evictable", "free(b) -> evictable        per call"),
        ("cycle", "register+lookup+incref+free cycle"),
    ]
    rows = []
    for key, label in op_labels:
        if key not in nat and key not in ref:
            continue
        rows.append([label, _f(nat.get(key)), _f(ref.get(key)), _ratio(sp.get(key))])
    lines.append(_table(["", "native", "reference", "speedup"], rows, [False, True, True, True]))
    for key in ("note", "errors"):
        if key in p:
            lines.append(f"  {key}: {p[key]}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- workloads


def describe_workload(cfg: Any, summary: Dict[str, Any], seed: int) -> str:
    """One paragraph: the request mix and the engine limits of a run."""
    if cfg.chunked_prefill:
        budget = f"chunked prefill, {cfg.prefill_token_budget} tokens/step"
    else:
        budget = f"{cfg.prefill_token_budget} prefill tokens/step"
    return (
        f"{summary['num_requests']} requests ({summary['prefixed_requests']} with one of "
        f"{cfg.num_prefixes} shared prefixes, {summary['n2_requests']} with n=2), "
        f"{summary['prompt_tokens']:,} prompt tokens (mean {summary['prompt_len_mean']:.0f}), "
        f"mean output {summary['output_len_mean']:.0f}; "
        f"{cfg.num_gpu_blocks} GPU / {cfg.num_cpu_blocks} CPU blocks of {cfg.block_size}, "
        f"watermark {cfg.watermark}, max {cfg.max_num_seqs} seqs, {budget}; "
        f"seed {seed}, digest {summary['digest']}"
    )


def vllm_names(results: List[RunResult]) -> List[str]:
    """The vLLM backends among ``results`` (``vllm-<version>``), in order of appearance."""
    return list(dict.fromkeys(r.backend for r in results if r.backend.startswith("vllm")))


def run_dicts(results: List[RunResult]) -> List[Dict[str, Any]]:
    """The JSON form of ``results``, with speedups against the reference and each vLLM."""
    sp = speedups(results)
    against = {name: speedups(results, name) for name in vllm_names(results)}
    runs = []
    for i, r in enumerate(results):
        d = r.to_dict()
        d["speedup_vs_reference"] = sp[i]
        d["speedup_vs"] = {name: against[name][i] for name in against}
        runs.append(d)
    return runs


def speedups(results: List[RunResult], against: str = "reference") -> Dict[int, Optional[float]]:
    """For each result (by index): ``against``'s mean step time / its mean step time (same
    caching setting)."""
    ref = {r.enable_caching: r.step_stats()["mean"] for r in results if r.backend == against}
    out: Dict[int, Optional[float]] = {}
    for i, r in enumerate(results):
        base = ref.get(r.enable_caching)
        mean = r.step_stats()["mean"]
        out[i] = base / mean if base and mean > 0 else None
    return out


def format_runs(results: List[RunResult]) -> str:
    """The per-run table (step times, speedups, preemptions) and the phase breakdown."""
    text = _runs_table(results)
    text += "\n\nWhere the manager time goes (share of total) and mean sequences per step:\n"
    text += _phases_table(results)
    return text


def _run_row(r: RunResult, speedup: Optional[float]) -> List[str]:
    """One run's row of the per-run table (before the vs-vLLM and ignored/aborted columns)."""
    st = r.step_stats()
    hit = r.hit_rate
    return [
        r.backend,
        "on" if r.enable_caching else "off",
        str(r.steps),
        _f(st["mean"]),
        _f(st["p50"]),
        _f(st["p99"]),
        _ratio(speedup),
        "-" if hit is None or not r.enable_caching else f"{100 * hit:.1f}%",
        f"{r.preempt_recompute}/{r.preempt_swap}",
        str(r.partial_prefills),
        str(r.cow_copies),
        "yes" if r.all_blocks_free else "NO",
        f"{r.wall_s:.1f}",
    ]


def _add_extra_columns(results: List[RunResult], headers: List[str], rows: List[List[str]]) -> None:
    """Append the speedup vs each vLLM release run, and ignored/aborted where any run has
    some, to ``headers`` and every row."""
    for name in vllm_names(results):
        vs_vllm = speedups(results, name)
        headers.append(f"vs {name.replace('vllm-', 'vLLM ')}")
        for i, row in enumerate(rows):
            row.append(_ratio(vs_vllm[i]))
    if any(r.ignored or r.aborted for r in results):
        headers.append("ignored/aborted")
        for row, r in zip(rows, results):
            row.append(f"{r.ignored}/{r.aborted}")


def _runs_table(results: List[RunResult]) -> str:
    """The per-run table, with its title line."""
    sp = speedups(results)
    rows = [_run_row(r, sp[i]) for i, r in enumerate(results)]
    headers = [
        "backend",
        "cache",
        "steps",
        "us/step mean",
        "p50",
        "p99",
        "speedup",
        "hit rate",
        "preempt rec/swap",
        "chunks",
        "CoW",
        "all free",
        "wall s",
    ]
    _add_extra_columns(results, headers, rows)
    right = [False, False] + [True] * (len(headers) - 2)
    text = (
        "Block-manager time per step (us; only time inside manager calls), "
        "speedup = reference mean / mean; preemptions by recompute/swap; chunks = prompt "
        "chunks that did not finish their prompt (chunked prefill):\n"
    )
    text += _table(headers, rows, right)
    return text


def _phases_table(results: List[RunResult]) -> str:
    """Each run's share of manager time per phase and its mean sequences per step."""
    phase_rows = []
    for r in results:
        total = sum(r.phase_us.values()) or 1.0
        phase_rows.append(
            [r.backend, "on" if r.enable_caching else "off"]
            + [
                f"{100 * r.phase_us[k] / total:.0f}%"
                for k in ("decode", "swap_admit", "prepare", "post")
            ]
            + [f"{r.mean_batch_seqs:.1f}"]
        )
    return _table(
        [
            "backend",
            "cache",
            "append",
            "swap+admit",
            "tables+access",
            "mark+fork+free",
            "seqs/step",
        ],
        phase_rows,
        [False, False, True, True, True, True, True],
    )


#: The name the table was introduced under.
format_w1 = format_runs


def cross_check(results: List[RunResult]) -> Dict[str, Any]:
    """Compare every backend's schedule with the first one of the same caching setting."""
    out: Dict[str, Any] = {"ok": True, "groups": {}}
    by_caching: Dict[bool, List[RunResult]] = {}
    from pagedkv.bench.vllm_042.backends import CROSS_CHECKED

    for r in results:
        if r.backend in CROSS_CHECKED:
            by_caching.setdefault(r.enable_caching, []).append(r)
    for r in results:  # the others (vLLM) are compared too, but only reported
        if r.backend not in CROSS_CHECKED and r.enable_caching in by_caching:
            key, base_key = r.schedule_key(), by_caching[r.enable_caching][0].schedule_key()
            same = all(key[k] == base_key[k] for k in set(key) & set(base_key))
            verdict = "same calls and free counts" if same else "different results"
            if r.mismatch:
                verdict = f"diverged from pagedkv.Scheduler: {r.mismatch}"
            out.setdefault("informational", {}).setdefault(
                "caching_on" if r.enable_caching else "caching_off", {}
            )[r.backend] = verdict
    for caching, group in by_caching.items():
        base = group[0]
        base_key = base.schedule_key()
        mismatches = []
        for other in group[1:]:
            key = other.schedule_key()
            for k in sorted(set(base_key) & set(key)):
                if base_key[k] != key[k]:
                    mismatches.append(
                        {
                            "backend": other.backend,
                            "field": k,
                            "expected": base_key[k],
                            "got": key[k],
                            "against": base.backend,
                        }
                    )
        for r in group:
            if r.mismatch:
                mismatches.append(
                    {
                        "backend": r.backend,
                        "field": "replay",
                        "expected": "the scheduler's decisions and free counts",
                        "got": r.mismatch,
                        "against": "pagedkv.Scheduler",
                    }
                )
        not_free = [r.backend for r in group if not r.all_blocks_free]
        ok = not mismatches and not not_free
        out["ok"] = out["ok"] and ok
        out["groups"]["caching_on" if caching else "caching_off"] = {
            "backends": [r.backend for r in group],
            "ok": ok,
            "mismatches": mismatches,
            "not_all_free": not_free,
            "steps": base.steps,
            "preemptions": [base.preempt_recompute, base.preempt_swap],
            "final_free": [base.final_free_gpu, base.final_free_cpu],
        }
    return out


def format_cross_check(check: Dict[str, Any]) -> str:
    parts = []
    for name, g in check["groups"].items():
        if g["ok"]:
            status = "identical" if len(g["backends"]) > 1 else "only one backend"
        else:
            status = "MISMATCH"
        parts.append(
            f"{name.replace('_', ' ')}: {status} across {'/'.join(g['backends'])} "
            f"(steps {g['steps']}, preemptions {g['preemptions'][0]}+{g['preemptions'][1]}, "
            f"final free {g['final_free'][0]}/{g['final_free'][1]})"
        )
    line = ("Schedule cross-check OK: " if check["ok"] else "Schedule cross-check FAILED: ") + (
        "; ".join(parts) if parts else "no runs"
    )
    for name, verdicts in check.get("informational", {}).items():
        said = ", ".join(f"{b}: {v}" for b, v in verdicts.items())
        line += f"\n  not cross-checked, {name.replace('_', ' ')} (same workload, compared to "
        line += f"the first backend; vLLM may differ by design with caching): {said}"
    if not check["ok"]:
        for g in check["groups"].values():
            for m in g["mismatches"][:10]:
                line += (
                    f"\n  {m['backend']} vs {m['against']}: {m['field']} = {m['got']!r}, "
                    f"expected {m['expected']!r}"
                )
            if g["not_all_free"]:
                line += f"\n  blocks left allocated after the run: {g['not_all_free']}"
    return line


def format_whole_step(runs: List[Dict[str, Any]]) -> str:
    """The whole-step section: per caching setting, each lane's µs per step and per batch row,
    and the ratios measured in the same run."""
    turn = runs[0]["turn"] if runs else 1
    lines = [
        "Whole engine step (schedule + applying the sampled tokens + frees), same run, in "
        f"turns of {turn} steps: compat = pagedkv.Scheduler.schedule() + Python output "
        "processing, batch = BatchEngine.step(sampled); us per step and per running sequence "
        "of the batch; batch speedup = that engine's total step time / the batch step's:"
    ]
    rows = []
    for r in runs:
        for name, st in r["lanes"].items():
            ratio = r["ratios"].get(f"batch_vs_{name}") if name != "batch" else None
            note = st.get("error", "")
            if "decisions_differ_at_step" in st:
                note = f"decisions differ from step {st['decisions_differ_at_step']}; {note}"
            rows.append(
                [
                    r["workload"],
                    "on" if r["caching"] else "off",
                    name,
                    str(st["steps"]),
                    _f(st["mean_us"]),
                    _f(st["p50_us"]),
                    _f(st["p99_us"]),
                    _f(st["us_per_row"], "{:.3f}"),
                    _ratio(ratio),
                    note.strip("; "),
                ]
            )
    headers = ["workload", "cache", "engine", "steps", "us/step mean", "p50", "p99"]
    headers += ["us/seq", "batch speedup", "note"]
    lines.append(_table(headers, rows, [False, False, False] + [True] * 6 + [False]))
    for r in runs:
        for name, st in r["lanes"].items():
            if "error" in st and not st.get("baseline"):
                lines.append(
                    f"  {name.upper()} STEP DIFFERED ({r['workload']}, caching "
                    f"{'on' if r['caching'] else 'off'}): {st['error']}"
                )
    return "\n".join(lines)
