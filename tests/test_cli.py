"""``pagedkv bench``: the CLI end to end, the W1 generator, and the cross-backend schedule check."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from pagedkv import cli
from pagedkv.bench import apply_overrides
from pagedkv.bench.backends import BACKEND_NAMES, Backend, resolve_backends
from pagedkv.bench.driver import run_w1
from pagedkv.bench.report import cross_check
from pagedkv.bench.workload import W1_FULL, W1_QUICK, W1Config, generate_w1

BACKENDS, SKIP_NOTES = resolve_backends(list(BACKEND_NAMES))
BY_NAME = {b.name: b for b in BACKENDS}

needs_backends = pytest.mark.skipif(not BACKENDS, reason=f"no W1 backend: {SKIP_NOTES}")

# A small, tight W1: few GPU blocks, no watermark and many n=2 requests, so that recompute and
# swap preemption (and copy-on-write after forks) all happen within a few hundred steps.
TIGHT = W1Config(
    num_requests=32,
    prompt_len_min=512,
    prompt_len_max=2048,
    num_prefixes=4,
    prefix_len_min=128,
    prefix_len_max=448,
    output_len_min=64,
    output_len_max=384,
    n2_share=0.3,
    num_gpu_blocks=600,
    num_cpu_blocks=200,
    watermark=0.0,
    max_num_seqs=16,
    prefill_token_budget=4096,
)


# ------------------------------------------------------------------------------ CLI end to end


@needs_backends
def test_bench_quick_json(tmp_path, capsys):
    out = tmp_path / "out.json"
    rc = cli.main(["bench", "--quick", "--json", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "Schedule cross-check OK" in text
    doc = json.loads(out.read_text())
    assert {"pagedkv_version", "seed", "quick", "micro", "w1", "elapsed_s"} <= set(doc)
    assert doc["quick"] is True

    micro = doc["micro"]
    hashing = micro["hashing"]
    for key in ("native_list", "native_array"):
        assert hashing[key]["mtok_per_s"] > 0
    pool = micro["pool"]
    assert {
        "allocate",
        "free",
        "allocate_many",
        "free_many",
        "register",
        "lookup_hit",
        "incref_revive",
        "free_to_evictable",
        "cycle",
    } <= set(pool["native"])
    if "reference" in pool:
        assert "speedup_vs_reference" in pool
        assert hashing["reference_list"]["mtok_per_s"] > 0

    w1 = doc["w1"]
    assert w1["config"]["num_requests"] == W1_QUICK.num_requests
    assert w1["workload"]["num_requests"] == W1_QUICK.num_requests
    runs = w1["runs"]
    assert {(r["backend"], r["enable_caching"]) for r in runs} == {
        (b.name, c) for b in BACKENDS for c in (False, True)
    }
    for r in runs:
        assert {"mean", "p50", "p99"} <= set(r["step_us"])
        assert r["steps"] > 0 and r["step_us"]["mean"] > 0
        assert r["finished"] == W1_QUICK.num_requests
        assert r["all_blocks_free"] is True
        assert r["final_free_gpu"] == W1_QUICK.num_gpu_blocks
        assert r["final_free_cpu"] == W1_QUICK.num_cpu_blocks
        for key in (
            "preempt_recompute",
            "preempt_swap",
            "cow_copies",
            "prefix_hit_rate",
            "speedup_vs_reference",
            "schedule_digest",
        ):
            assert key in r
        if r["enable_caching"]:
            assert r["prefix_hit_rate"] is not None and 0.05 < r["prefix_hit_rate"] < 1
        else:
            assert not r["prefix_hit_rate"]
        if r["backend"] == "reference":
            assert r["speedup_vs_reference"] == pytest.approx(1.0)
    assert w1["cross_check"]["ok"] is True


def test_console_entry_point_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    for flag in ("--quick", "--json", "--backends", "--caching", "--seed", "--no-caching"):
        assert flag in proc.stdout


def test_demo_not_available_and_registry(monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "nothere", ("pagedkv._no_such_module_", "x"))
    assert cli.main(["nothere", "--whatever"]) == 1
    assert "not available" in capsys.readouterr().err
    try:
        import pagedkv.demo  # noqa: F401
    except ModuleNotFoundError:
        assert cli.main(["demo"]) == 1
        assert "not available" in capsys.readouterr().err


def test_registered_subcommand_runs(monkeypatch):
    mod = SimpleNamespace(
        HELP="test",
        add_arguments=lambda p: p.add_argument("--x", type=int, default=1),
        run=lambda args: args.x + 40,
    )
    monkeypatch.setitem(sys.modules, "fake_pagedkv_sub", mod)
    cli.register_subcommand("fake", "fake_pagedkv_sub")
    try:
        assert cli.main(["fake", "--x", "2"]) == 42
    finally:
        cli.SUBCOMMANDS.pop("fake")


def test_subcommand_with_its_own_main(monkeypatch):
    seen = []
    mod = SimpleNamespace(main=lambda argv: seen.append(argv) or 7)
    monkeypatch.setitem(sys.modules, "fake_pagedkv_main", mod)
    monkeypatch.setitem(cli.SUBCOMMANDS, "fakemain", ("fake_pagedkv_main", "x"))
    assert cli.main(["fakemain", "--steps", "3", "x"]) == 7
    assert seen == [["--steps", "3", "x"]]


def test_bad_arguments():
    assert cli.main(["bench", "--backends", "nope", "--no-micro"]) == 2
    assert cli.main(["bench", "--set", "nope=1", "--no-micro"]) == 2
    assert cli.main([]) == 2
    cfg = apply_overrides(W1_QUICK, ["num_gpu_blocks=1000", "watermark=0"])
    assert cfg.num_gpu_blocks == 1000 and cfg.watermark == 0.0


def test_missing_backend_is_skipped_with_a_note(monkeypatch):
    import pagedkv.bench.backends as backends

    real = backends._import
    monkeypatch.setattr(
        backends, "_import", lambda m: None if m.startswith("pagedkv.reference") else real(m)
    )
    found, notes = backends.resolve_backends(["reference", "native"])
    assert "reference" not in [b.name for b in found]
    assert any(n.startswith("reference: skipped") for n in notes)
    with pytest.raises(ValueError):
        backends.resolve_backends(["nope"])


# ------------------------------------------------------------------------------- W1 generator


def test_w1_deterministic():
    a = generate_w1(W1_QUICK, seed=3)
    b = generate_w1(W1_QUICK, seed=3)
    c = generate_w1(W1_QUICK, seed=4)
    assert a.digest() == b.digest()
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert [r.output_token_ids for r in a.requests] == [r.output_token_ids for r in b.requests]
    assert a.digest() != c.digest()


def test_w1_matches_spec():
    cfg = W1_FULL
    w = generate_w1(cfg, seed=0)
    reqs = w.requests
    assert len(reqs) == 1024
    assert len(w.prefixes) == 16
    assert all(256 <= len(p) <= 1536 for p in w.prefixes)
    assert min(len(p) for p in w.prefixes) == 256 and max(len(p) for p in w.prefixes) == 1536
    plens = np.array([len(r.prompt_token_ids) for r in reqs])
    assert plens.min() >= 512 and plens.max() <= 4096
    assert plens.min() < 700 and plens.max() > 3900  # spans the range
    olens = np.array([r.output_len for r in reqs])
    assert olens.min() >= 32 and olens.max() <= 256
    prefixed = [r for r in reqs if r.prefix_id is not None]
    assert len(prefixed) == round(0.8 * 1024)
    for r in prefixed:
        p = w.prefixes[r.prefix_id]
        assert r.prompt_token_ids[: len(p)] == p
        assert len(r.prompt_token_ids) >= len(p) + cfg.min_own_tokens
    assert len({r.prefix_id for r in prefixed}) == 16
    n2 = [r for r in reqs if r.n == 2]
    assert len(n2) == round(0.05 * 1024)
    assert all(r.n in (1, 2) for r in reqs)
    for r in reqs:
        assert len(r.output_token_ids) == r.n
        assert all(len(row) == r.output_len for row in r.output_token_ids)
        assert all(0 <= t < cfg.vocab_size for t in r.output_token_ids[0])
        assert r.arrival_time == 0.0
    # no two unprefixed prompts share their first block
    heads = [tuple(r.prompt_token_ids[:16]) for r in reqs if r.prefix_id is None]
    assert len(set(heads)) == len(heads)


def test_quick_config_is_scaled_w1():
    q = W1_QUICK
    assert q.num_requests < W1_FULL.num_requests
    assert q.num_gpu_blocks / q.num_requests == pytest.approx(
        W1_FULL.num_gpu_blocks / W1_FULL.num_requests
    )
    assert (q.prompt_len_min, q.prompt_len_max) == (W1_FULL.prompt_len_min, W1_FULL.prompt_len_max)


# -------------------------------------------------------------------------------- cross-check


@needs_backends
@pytest.mark.parametrize("caching", [False, True], ids=["nocache", "cache"])
def test_backends_agree_under_preemption(caching):
    w = generate_w1(TIGHT, seed=1)
    results = [run_w1(w, b, caching) for b in BACKENDS]
    for r in results:
        assert r.finished == TIGHT.num_requests
        assert r.all_blocks_free, r.backend
        assert r.preempt_recompute > 0 and r.preempt_swap > 0
        assert r.swap_ins == r.preempt_swap
        assert r.forks == sum(q.n == 2 for q in w.requests)
        assert r.cow_copies > 0
    check = cross_check(results)
    assert check["ok"], check


@needs_backends
def test_backends_agree_on_ignored_and_aborted():
    # a GPU pool too small for the longest prompts (NEVER -> ignored) and a CPU pool too small
    # to swap a forked group out (aborted)
    cfg = W1Config(
        **{**TIGHT.to_dict(), "num_gpu_blocks": 120, "num_cpu_blocks": 30, "num_requests": 24}
    )
    w = generate_w1(cfg, seed=1)
    results = [run_w1(w, b, True) for b in BACKENDS]
    for r in results:
        assert r.ignored > 0 and r.aborted > 0
        assert r.finished + r.ignored + r.aborted == cfg.num_requests
        assert r.all_blocks_free
    assert cross_check(results)["ok"]


@pytest.mark.skipif("native-batch" not in BY_NAME, reason="native-batch backend not available")
def test_batch_buffers_match_block_tables():
    """Every row append_slots_batch writes equals get_block_table / get_len / the newest slot."""
    nb = BY_NAME["native-batch"]
    bs = TIGHT.block_size
    checked = {"rows": 0}

    def make_manager(*args):
        mgr = nb.make_manager(*args)
        real = mgr.append_slots_batch

        def append_slots_batch(seqs, block_tables, context_lens, slot_mapping, **kw):
            cow = real(seqs, block_tables, context_lens, slot_mapping, **kw)
            for i, s in enumerate(seqs):
                table = mgr.get_block_table(s)
                n = s.get_len()
                assert context_lens[i] == n
                assert list(block_tables[i, : len(table)]) == table
                assert not block_tables[i, len(table) :].any()
                assert slot_mapping[i] == table[(n - 1) // bs] * bs + (n - 1) % bs
                checked["rows"] += 1
            return cow

        methods = {name: getattr(mgr, name) for name in dir(mgr) if not name.startswith("_")}
        methods["append_slots_batch"] = append_slots_batch
        return SimpleNamespace(**methods)

    backend = Backend(**{**nb.__dict__, "make_manager": make_manager})
    w = generate_w1(TIGHT, seed=2)
    r = run_w1(w, backend, True)
    assert r.all_blocks_free and checked["rows"] > 1000
    if "native" in BY_NAME:
        assert cross_check([run_w1(w, BY_NAME["native"], True), r])["ok"]
