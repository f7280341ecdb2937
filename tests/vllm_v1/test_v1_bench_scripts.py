"""The v1 measurement scripts of docs/benchmarks.md ("vLLM v1: the measurements behind the
native loop") run to completion inside a vLLM virtualenv (this interpreter) on their smallest
settings, and print what that page cites."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHES = ROOT / "benches"


def _run(argv: list) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cpu"),
        OPENBLAS_NUM_THREADS="1",
    )
    built = [*(ROOT / "python" / "pagedkv").glob("_native*.so")]  # `maturin develop`
    if built:
        env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(BENCHES / argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_profile_script_reports_the_step_split(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    proc = _run(
        [
            "profile_vllm_v1_step.py",
            "--quick",
            "--modes",
            "on,events",
            "--max-steps",
            "40",
            "--profile-steps",
            "5:20",
            "--json",
            str(out),
        ]
    )
    assert re.search(r"== on/native: 40 steps; step [\d.]+ us = schedule", proc.stdout)
    assert re.search(r"== on/vllm: 40 steps; step [\d.]+ us = schedule", proc.stdout)
    assert re.search(r"== events/vllm: 40 steps; step [\d.]+ us = schedule", proc.stdout)
    data = json.loads(out.read_text())
    for mode in ("on", "events"):
        # The printed line says what the JSON holds (the measurement itself is not judged:
        # the share moves with the machine's load), and the bound is 1 / (1 - share) exactly.
        bound = data["bounds"][mode]
        share, ratio = bound["vllm_manager_share"], bound["cost_free_manager_ratio"]
        assert ratio == pytest.approx(1 / max(1e-9, 1 - share))
        line = (
            f"vLLM's manager is {share:.0%} of its step, so a manager that cost nothing "
            f"would give {ratio:.2f}x"
        )
        assert re.search(rf"mode {mode}: vLLM step .*" + re.escape(line), proc.stdout), line
    assert data["runs"]["events/native"]["steps"] == 40
    native = data["runs"]["on/native"]
    assert native["steps"] == 40 and native["profile"]["steps_profiled"] == 15
    assert native["manager_calls_per_step"]["allocate_slots"] > 0
    assert "scheduler.py:schedule" in native["profile"]["groups_us_per_step"]


def test_outgrow_repro_shows_vllm_stalls_and_livelocks(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = _run(["vllm_v1_outgrow_repro.py", "--steps", "80", "--json", str(out)])
    by = {(r["case"], r["caching"], r["reserve_full_isl"]): r for r in json.loads(out.read_text())}
    # A prompt larger than the pool is never admitted with vLLM's default admission gate.
    assert by[("prompt>pool", True, True)]["verdict"] == "stalled"
    assert by[("prompt>pool", True, True)]["tokens_scheduled"] == 0
    # Without the gate and without caching it is prefilled, preempts itself, and starts over.
    assert by[("prompt>pool", False, False)]["verdict"] == "livelock"
    # A request that outgrows the pool while decoding is preempted and never resumes, and a
    # small request queued behind it never finishes either.
    small = by[("grow>pool+small", True, True)]
    assert small["verdict"] == "stalled" and small["finished_at"] == {}
    assert "stalled" in proc.stdout


@pytest.mark.vllm_cpu_build  # runs a model: deselected (never skipped) elsewhere, see conftest
def test_e2e_share_script_runs_a_dummy_model(tmp_path: Path) -> None:
    out = tmp_path / "e.json"
    proc = _run(["vllm_v1_e2e_share.py", "--native", "--requests", "6", "--json", str(out)])
    assert "scheduler share" in proc.stdout
    data = json.loads(out.read_text())
    assert data["manager"] == "pagedkv.vllm_v1._manager" and data["tokens"] > 0
    # Shares and seconds are measurements: their shape, not their values, is checked.
    assert isinstance(data["scheduler_share"], float) and isinstance(data["model_s"], float)


def test_the_drivers_import_no_vllm() -> None:
    """``import pagedkv``, ``pagedkv.bench`` and both generations' drivers leave vLLM unimported
    (each driver function imports it when called), here where vLLM is installed."""
    code = (
        "import sys, pagedkv, pagedkv.bench, pagedkv.bench.vllm_v1, pagedkv.bench.vllm_042.driver; "
        "sys.exit(1 if any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules) else 0)"
    )
    env = dict(os.environ)
    if [*(ROOT / "python" / "pagedkv").glob("_native*.so")]:
        env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- the v1 bench's mixed workload and its native-loop share -----------------------------


def test_mixed_workload_is_w1_with_request_kinds() -> None:
    """MIXED is W1's requests (the same prompts and output lengths) with disjoint kinds in
    the configured shares; a repetition request's outputs repeat from REPEAT_FROM on."""
    from pagedkv.bench.vllm_v1 import mixed
    from pagedkv.bench.workload import W1_QUICK, generate

    work = mixed.generate(mixed.MIXED_QUICK, seed=0)
    w1 = generate(W1_QUICK, seed=0)
    assert [r.prompt_token_ids for r in work.requests] == [r.prompt_token_ids for r in w1.requests]
    assert [r.output_len for r in work.requests] == [r.output_len for r in w1.requests]
    n = len(work.requests)
    counts = {kind: list(work.kinds.values()).count(kind) for kind in mixed.KINDS}
    assert counts == {
        "json": round(0.25 * n),
        "lora": round(0.10 * n),
        "repetition": round(0.03 * n),
        "embeds": round(0.03 * n),
    }
    for r in work.requests:
        if work.kinds.get(r.request_id) == "repetition" and r.output_len > mixed.REPEAT_FROM + 8:
            tail = r.output_token_ids[0][mixed.REPEAT_FROM :]
            assert (
                tail[: mixed.REPEAT_PERIOD] == tail[mixed.REPEAT_PERIOD : 2 * mixed.REPEAT_PERIOD]
            )


def _section(name: str, max_steps: int | None = None, caching: bool = True) -> tuple:
    import vllm

    from pagedkv.bench.vllm_v1 import section as v1
    from pagedkv.vllm_v1._version import release_of

    release = release_of(vllm.__version__)
    workload = v1.make_workload(v1.V1_WORKLOADS[name][1], seed=0)
    spec = v1.workload_spec(workload, caching)
    engines = v1.section_engines(release, spec, workload)
    sec = v1.run_section(workload, spec, release, max_steps=max_steps, engines=engines)
    return release, workload, engines, sec


def _check_loop_steps(sec: dict, engines: list) -> None:
    """Each lane's reported loop steps are its scheduler's own counts."""
    from pagedkv.bench.vllm_v1.section import loop_off_reason

    for engine in engines:
        got = sec["lanes"][engine.name]["loop_steps"]
        if not engine.native:
            assert got is None
            continue
        sched = engine.scheduler
        assert got["native"] == sched.pagedkv_native_steps
        assert got["total"] == sched.pagedkv_native_steps + sched.pagedkv_vllm_steps
        assert got["total"] == sec["steps"]
        assert got["native_share"] == got["native"] / got["total"]
        own = dict(sched.pagedkv_steps) or {loop_off_reason(sched): sched.pagedkv_vllm_steps}
        own.pop("native", None)
        assert got["fallbacks"] == own
        for why, n in got["by_reason"].items():
            assert n == sum(k for key, k in own.items() if why in key.split(", "))


def test_mixed_section_decides_as_vllm_and_reports_the_schedulers_loop_counts() -> None:
    """The mixed workload (--quick, caching on) runs to the end with every step's decisions
    equal to vLLM's; JSON-mode requests get their grammar and bitmask, LoRA requests their
    adapters, repetition requests end early; the native share reported per lane is the
    scheduler's own count (whatever it is: these kinds may fall back)."""
    from pagedkv.bench.vllm_v1.section import format_loop_steps

    release, work, engines, sec = _section("mixed")
    assert sec["ok"], sec.get("difference")
    leader = engines[0]
    for engine in engines:  # every request of every engine ran to its end
        assert engine.scheduler.structured_output_manager._grammar_bitmask is not None
        assert len(engine.requests) == sum(r.n for r in work.requests)
        assert all(req.is_finished() for req in engine.requests.values())
    _check_loop_steps(sec, engines)
    assert sec["lanes"][engines[1].name]["loop_steps"]["native"] == 0  # the loop is off there
    assert sec["ratios"][f"{engines[0].name}_vs_{engines[2].name}"] is not None
    for engine in engines:
        kinds = {rid.rsplit("-", 1)[0]: req for rid, req in engine.requests.items()}
        for wid, kind in work.kinds.items():
            req = kinds[wid]
            if kind == "json":
                assert req.structured_output_request.grammar.num_accepted == req.num_output_tokens
            elif kind == "repetition" and req.max_tokens > 40:
                assert req.num_output_tokens < req.max_tokens  # detection ended it
    counts = sec["lanes"][leader.name]["loop_steps"]
    line = format_loop_steps(release, sec["lanes"])
    assert f"loop {counts['native']}/{counts['total']} steps" in line
    _check_grammar_report(release, sec, engines)


def _check_grammar_report(release: str, sec: dict, engines: list) -> None:
    """Every lane reports the seconds its engine spent in get_grammar_bitmask(), and the
    printed line gives them per step and the ratios of the steps without them."""
    from pagedkv.bench.vllm_v1.section import format_grammar

    lanes, steps = sec["lanes"], sec["steps"]
    for engine in engines:
        report = lanes[engine.name]["structured_output"]
        assert report == {"get_grammar_bitmask_s": engine.grammar_seconds}
        assert engine.grammar_seconds > 0
    line = format_grammar(release, lanes, steps)
    vllm, loop = lanes[engines[2].name], lanes[engines[0].name]

    def rest(lane: dict) -> float:
        return lane["mean_us"] - lane["structured_output"]["get_grammar_bitmask_s"] / steps * 1e6

    grammar_us = vllm["structured_output"]["get_grammar_bitmask_s"] / steps * 1e6
    assert f"get_grammar_bitmask vLLM {grammar_us:.0f} us" in line
    assert f"loop {rest(vllm) / rest(loop):.2f}x" in line


def test_a_plain_workload_reports_every_step_native() -> None:
    """W1 holds only plain requests: the native loop's lane reports all its steps native."""
    _, _, engines, sec = _section("w1", max_steps=30)
    assert sec["ok"]
    _check_loop_steps(sec, engines)
    counts = sec["lanes"][engines[0].name]["loop_steps"]
    assert counts["native"] == counts["total"] == 30 and counts["fallbacks"] == {}


# ---- the v1 bench's speculative-decoding workloads -----------------------------------------


def test_the_drafter_stand_in_is_deterministic_and_verifies_a_prefix() -> None:
    """Drafts depend only on (seed, request, position): right ones are the predetermined next
    tokens, wrong ones differ from them; the verifier keeps the matching prefix and adds the
    predetermined token after it (past the output's end: FILLER)."""
    from pagedkv.bench.vllm_v1 import spec

    truth = list(range(100, 140))
    drafter = spec.Drafter(num_spec_tokens=3, accept_rate=0.5, no_match_share=0.2)
    rows = [drafter.propose("r-0", pos, truth) for pos in range(30)]
    assert rows == [drafter.propose("r-0", pos, truth) for pos in range(30)]
    assert any(not row for row in rows) and any(len(row) == 3 for row in rows)
    right = [d == truth[pos + k] for pos, row in enumerate(rows) for k, d in enumerate(row)]
    assert any(right) and not all(right)
    assert spec.verify([101, 102, 7], 1, truth) == ([101, 102, 103], 2)
    assert spec.verify([9], 1, truth) == ([101], 0)
    assert spec.verify([], 1, truth) == ([101], 0)
    assert spec.verify([139], 39, truth) == ([139, spec.FILLER], 1)


def test_spec_joins_w1_in_the_compare_run() -> None:
    """``pagedkv bench --compare`` runs MIXED, SPEC, GPTOSS and GEMMA3 over W1's configuration
    with W1."""
    import dataclasses

    from pagedkv.bench.vllm_v1 import section as v1
    from pagedkv.bench.workload import W1_QUICK

    w1 = dataclasses.replace(W1_QUICK, num_requests=7)
    got = dict(v1.with_w1_variants([("w1", w1)], quick=True))
    assert list(got) == ["w1", "mixed", "spec", "gptoss", "gemma3"]
    assert all(got[name].base == w1 for name in ("mixed", "spec", "gptoss", "gemma3"))
    assert (got["gptoss"].layout, got["gemma3"].layout) == ("gptoss", "gemma3")
    assert v1.with_w1_variants([("w2", w1)], quick=True) == [("w2", w1)]


def _check_drafts(sec: dict, engines: list) -> None:
    """Drafts were scheduled, some accepted and some rejected; each lane's stand-in counts
    equal its scheduler's own spec-decoding stats, and every lane saw the same drafts."""
    reports = [dict(sec["lanes"][engine.name]["drafts"]) for engine in engines]
    for report in reports:  # a measurement: its shape, not its value
        assert isinstance(report.pop("update_draft_token_ids_s"), float)
    assert all(report == reports[0] for report in reports)
    drafts = reports[0]
    assert 0 < drafts["accepted"] < drafts["scheduled"] and drafts["rows"] > 0
    assert drafts["scheduler"] == {
        "draft_tokens": drafts["scheduled"],
        "accepted_tokens": drafts["accepted"],
    }


@pytest.mark.parametrize("name, max_steps", [("spec", None), ("mixed-spec", 120)])
def test_spec_section_decides_as_vllm_with_drafts_scheduled_natively(
    name: str, max_steps: int | None
) -> None:
    """A speculative workload (--quick, caching on) runs with every step's decisions, the
    scheduled draft tokens included, equal to vLLM's; drafts are scheduled, some accepted and
    some rejected; the native share reported is the scheduler's own count, every step."""
    from pagedkv.bench.vllm_v1 import section as v1

    release, work, engines, sec = _section(name, max_steps=max_steps)
    assert sec["ok"], sec.get("difference")
    assert engines[0].scheduler.vllm_config.speculative_config.num_speculative_tokens == 3
    _check_drafts(sec, engines)
    _check_loop_steps(sec, engines)
    counts = sec["lanes"][engines[0].name]["loop_steps"]
    assert counts["native"] == counts["total"] == sec["steps"]
    if max_steps is None:
        for engine in engines:
            assert all(req.is_finished() for req in engine.requests.values())
    assert "drafts: " in v1.format_sections(release, {name: [dict(sec, mode="on")]})


def test_eagle_section_runs_eagles_kv_rules_natively() -> None:
    """The ``eagle`` workload (--quick, caching on): every engine built for an EAGLE-family
    drafter (0.33: lookahead block hashes, no drop; 0.32: the dropped block), every step's
    decisions equal to vLLM's and native, the requests' hashes vLLM's hasher's shape."""
    release, work, engines, sec = _section("eagle")
    assert sec["ok"], sec.get("difference")
    for engine in engines:
        sched = engine.scheduler
        if release == "0.32.0":
            assert sched.use_eagle_block_drop
        else:
            assert sched.num_hash_lookahead_tokens == 1 and not sched.use_eagle_block_drop
    _check_drafts(sec, engines)
    _check_loop_steps(sec, engines)
    counts = sec["lanes"][engines[0].name]["loop_steps"]
    assert counts["native"] == counts["total"] == sec["steps"]
    for engine in engines:
        assert all(req.is_finished() for req in engine.requests.values())


def test_decisions_include_the_scheduled_draft_tokens() -> None:
    """Two steps that differ only by their scheduled drafts do not decide alike."""
    from types import SimpleNamespace

    from pagedkv.bench.vllm_v1.section import decisions

    def step(drafts: dict) -> SimpleNamespace:
        cached = SimpleNamespace(req_ids=["a"], new_block_ids=[None])
        return SimpleNamespace(
            num_scheduled_tokens={"a": 4},
            scheduled_new_reqs=[],
            scheduled_cached_reqs=cached,
            scheduled_spec_decode_tokens=drafts,
            preempted_req_ids=set(),
            finished_req_ids=set(),
        )

    assert decisions(step({"a": [1, 2, 3]})) != decisions(step({"a": [1, 2, 4]}))
    assert decisions(step({"a": [1, 2, 3]}))[-1] == ()  # finished requests stay last


# ---- the v1 bench's hybrid workloads -------------------------------------------------------

#: The KV cache groups vLLM's grouping makes of each bench layout's layers, in group order.
HYBRID_GROUPS = {
    "gptoss": ["SlidingWindowSpec", "FullAttentionSpec"],
    "gemma3": ["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"],
    "llama4": ["ChunkedLocalAttentionSpec"] * 3 + ["FullAttentionSpec"],
    "granite4": ["MambaSpec"] * 3 + ["FullAttentionSpec"],
    "swa-only": ["SlidingWindowSpec"],
}


def test_hybrid_workloads_are_w1_over_their_layouts() -> None:
    """A hybrid workload is W1's requests (named after the layout) with the layout attached;
    its engines run W1's pool memory as vLLM groups the layout's layers."""
    from pagedkv.bench.vllm_v1 import hybrid
    from pagedkv.bench.vllm_v1 import section as v1
    from pagedkv.bench.workload import W1_QUICK, generate

    w1 = generate(W1_QUICK, seed=0)
    assert sorted(hybrid.LAYOUTS) == sorted(HYBRID_GROUPS)
    for name, kinds in HYBRID_GROUPS.items():
        work = v1.make_workload(v1.V1_WORKLOADS[name][1], seed=0)
        assert hybrid.layout_of(work) == name
        assert [r.prompt_token_ids for r in work.requests] == [
            r.prompt_token_ids for r in w1.requests
        ]
        assert work.requests[0].request_id == f"{name}-0"
        groups = hybrid.groups(name, 16)
        assert [type(g.kv_cache_spec).__name__ for g in groups] == kinds
        assert hybrid.num_blocks(name, 100, 16) == 100 * len(kinds)


@pytest.mark.parametrize("name", sorted(HYBRID_GROUPS))
def test_hybrid_section_decides_as_vllm_over_vllms_groups(name: str) -> None:
    """A hybrid workload (--quick, caching on) runs to the end with every step's decisions
    (block ids of every group) equal to vLLM's: every engine over vLLM's groups of the layout
    and the same pool, pagedkv's lanes over its native hybrid manager, at the retention
    setting the section reports; the loop counts are the schedulers' own."""
    from pagedkv.bench.vllm_v1 import hybrid
    from pagedkv.bench.workload import W1_QUICK
    from pagedkv.vllm_v1._hybrid import HybridKVCacheManager

    release, work, engines, sec = _section(name)
    assert sec["ok"], sec.get("difference")
    info = sec["hybrid"]
    assert info["groups"] == HYBRID_GROUPS[name]
    for engine in engines:
        sched = engine.scheduler
        cfg = sched.kv_cache_config
        assert [type(g.kv_cache_spec).__name__ for g in cfg.kv_cache_groups] == info["groups"]
        assert cfg.num_blocks == W1_QUICK.num_gpu_blocks * len(info["groups"])
        assert cfg.prefix_cache_retention_interval == info["retention"]
        manager = type(sched.kv_cache_manager)
        if engine.native:
            assert manager is HybridKVCacheManager
        else:
            assert manager.__module__.startswith("vllm.")
        assert all(req.is_finished() for req in engine.requests.values())
    setting = hybrid.retention(hybrid.layers(name), 16, caching=True)
    assert info["retention"] == setting
    assert info["retention_is_vllm_default"] == (setting == hybrid.VLLM_DEFAULT_RETENTION)
    _check_loop_steps(sec, engines)
    if hybrid.is_mamba(name):
        _check_mamba_align(sec, engines)


def _check_mamba_align(sec: dict, engines: list) -> None:
    """A Mamba hybrid with caching on runs in ``mamba_cache_mode`` "align": pagedkv's manager
    in both pagedkv lanes, its loop lane native every step (splitting prefills at block
    boundaries as vLLM's scheduler does, decisions equal)."""
    from pagedkv.bench.vllm_v1.section import LOOP_OFF

    assert sec["hybrid"]["mamba_cache_mode"] == "align"
    loop, manager, vllm = engines
    for engine in engines:
        assert engine.scheduler.vllm_config.cache_config.mamba_cache_mode == "align"
        assert engine.scheduler.need_mamba_block_aligned_split
    steps = sec["steps"]
    assert sec["lanes"][loop.name]["loop_steps"]["fallbacks"] == {}
    assert sec["lanes"][loop.name]["loop_steps"]["native"] == steps
    assert sec["lanes"][manager.name]["loop_steps"]["fallbacks"] == {LOOP_OFF: steps}


def test_mamba_hybrid_without_caching_runs_every_step_native() -> None:
    """``granite4`` with caching off (``mamba_cache_mode`` "none", one state block of
    ``max_model_len`` tokens per request, block sizes the lcm vLLM's engine resolves) decides
    as vLLM every step, and pagedkv's native loop schedules every step over its hybrid
    manager."""
    from pagedkv.vllm_v1._hybrid import HybridKVCacheManager

    release, work, engines, sec = _section("granite4", caching=False)
    assert sec["ok"], sec.get("difference")
    assert sec["hybrid"]["mamba_cache_mode"] == "none"
    max_len = work.config.prompt_len_max + work.config.output_len_max
    for engine in engines:
        sched = engine.scheduler
        assert sched.vllm_config.cache_config.mamba_cache_mode == "none"
        assert not sched.need_mamba_block_aligned_split
        sizes = [g.kv_cache_spec.block_size for g in sched.kv_cache_config.kv_cache_groups]
        assert sizes == [max_len] * 3 + [16]
        assert sched.block_size == sched.hash_block_size == math.lcm(*sizes)
        if engine.native:
            assert type(sched.kv_cache_manager) is HybridKVCacheManager
        assert all(req.is_finished() for req in engine.requests.values())
    loop = sec["lanes"][engines[0].name]["loop_steps"]
    assert loop["native"] == loop["total"] == sec["steps"] > 0
    _check_loop_steps(sec, engines)


def _section_lines(release: str, sec: dict) -> list:
    """The lines the bench prints for one section, rebuilt from its JSON."""
    from pagedkv.bench.vllm_v1.section import engine_name

    lanes, vllm = sec["lanes"], engine_name(release, False)
    parts = [f"vLLM {lanes[vllm]['mean_us']:8.0f} us"]
    for label, loop in (("loop", True), ("manager", False)):
        lane = engine_name(release, True, loop)
        ratio = sec["ratios"][f"{lane}_vs_{vllm}"]
        parts.append(f"{label} {lanes[lane]['mean_us']:7.0f} us {ratio:5.2f}x")
    counts = [
        f"{label} {c['native']}/{c['total']} steps ({c['native_share']:.0%} native"
        for label, c in (
            ("loop", lanes[engine_name(release, True)]["loop_steps"]),
            ("manager", lanes[engine_name(release, True, False)]["loop_steps"]),
        )
    ]
    return [", ".join(parts) + f"  ({sec['steps']} steps, decisions equal)", *counts]


def test_hybrid_bench_prints_what_its_json_holds(tmp_path: Path) -> None:
    """``python -m pagedkv.bench.vllm_v1 --workloads gptoss,gemma3,llama4,granite4,swa-only
    --quick --memory`` (first steps only): every section's printed lines (step times, ratios, native
    share, layout, retention and Mamba cache mode) and every memory line are what the same
    run's JSON holds, one memory line per attention-only hybrid layout (none for the Mamba
    hybrid). The measurements themselves are not judged."""
    from pagedkv.bench.vllm_v1.hybrid import format_layout
    from pagedkv.bench.vllm_v1.manager_costs import format_memory

    out = tmp_path / "h.json"
    names = ",".join(HYBRID_GROUPS)
    argv = ["--workloads", names, "--quick", "--max-steps", "40"]
    argv += ["--memory", "--json", str(out)]
    env = dict(os.environ, VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cpu"))
    if [*(ROOT / "python" / "pagedkv").glob("_native*.so")]:
        env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv.bench.vllm_v1", *argv],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    lines = proc.stdout.splitlines()
    assert [m["layout"] for m in doc["memory"]] == ["", "gptoss", "gemma3", "llama4", "swa-only"]
    for mem in doc["memory"]:
        assert format_memory(mem) in lines
    assert set(doc["sections"]) == set(HYBRID_GROUPS)
    for name, secs in doc["sections"].items():
        assert [sec["mode"] for sec in secs] == ["on", "off", "events"]
        for sec in secs:
            assert sec["steps"] == 40 and sec["ok"]
            head, *counts = _section_lines(doc["release"], sec)
            assert f"{name.upper():8} {sec['mode']:>6}: {head}" in lines
            for text in counts:
                assert text in proc.stdout
            assert " " * 14 + format_layout(sec["hybrid"]) in lines
            if sec["mode"] == "off":
                assert sec["hybrid"]["retention_is_vllm_default"]
            if name == "granite4":
                mode = "align" if sec["mode"] != "off" else "none"
                assert sec["hybrid"]["mamba_cache_mode"] == mode


def test_decode_section_runs_the_native_loop_with_external_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ``decode`` workload (--quick): vLLM's ``DecodeBenchConnector`` on every engine, so
    every request is admitted with the connector's external tokens; pagedkv's loop lane runs
    every step natively (the connector's calls made from the native walk), its manager lane
    vLLM's loop over the native manager, decisions equal to vLLM's to the end."""
    from pagedkv.bench.vllm_v1 import section as v1
    from pagedkv.vllm_v1 import KVCacheManager

    external: dict = {}
    build = v1.build_scheduler

    def counting_build(*args: Any, **kw: Any) -> Any:
        """The scheduler, the requests its connector was told about with external tokens
        counted (``update_state_after_alloc``, called by either loop)."""
        sched = build(*args, **kw)
        if isinstance(sched.kv_cache_manager, KVCacheManager):
            connector = sched.connector
            told = connector.update_state_after_alloc

            def counting(request: Any, blocks: Any, num_external: int) -> Any:
                if num_external:
                    external.setdefault(id(sched), set()).add(request.request_id)
                return told(request, blocks, num_external)

            connector.update_state_after_alloc = counting
        return sched

    monkeypatch.setattr(v1, "build_scheduler", counting_build)
    _, work, engines, sec = _section("decode")
    assert sec["ok"], sec.get("difference")
    loop, manager, _vllm = engines
    for engine in engines:
        sched = engine.scheduler
        assert type(sched.connector).__name__ == "DecodeBenchConnector"
        assert (type(sched.kv_cache_manager) is KVCacheManager) == engine.native
        assert all(req.is_finished() for req in engine.requests.values())
    # Both native lanes admitted the same requests with external tokens: nearly all (a fork
    # whose local hit leaves only its last token to compute takes none).
    first, second = external.values()
    assert first == second and len(first) > 0.9 * len(loop.requests)
    steps = sec["steps"]
    assert sec["lanes"][loop.name]["loop_steps"]["fallbacks"] == {}
    assert sec["lanes"][loop.name]["loop_steps"]["native"] == steps
    assert sec["lanes"][manager.name]["loop_steps"]["fallbacks"] == {v1.LOOP_OFF: steps}
    _check_loop_steps(sec, engines)
