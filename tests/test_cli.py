"""The ``pagedkv`` command line: help without torch, one-line errors, exit statuses, the JSON
document, the progress bar on a (pseudo-)terminal and the plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pagedkv import cli
from pagedkv.bench import apply_overrides
from pagedkv.bench.workload import W1_QUICK, W2_QUICK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the fastest real bench run: one small workload, the native backends, no micro benchmarks
TINY = ["bench", "--quick", "--no-micro", "--workloads", "w1", "--caching", "off"]


def run_cli(args, block=(), env=None, **kwargs):
    """``pagedkv ARGS`` in a fresh interpreter with the modules in ``block`` unimportable."""
    code = textwrap.dedent(
        f"""
        import sys
        for name in {list(block)!r}:
            sys.modules[name] = None  # "import name" raises ModuleNotFoundError
        from pagedkv.cli import main
        rc = main({list(args)!r})
        leaked = [m for m in {list(block)!r} if sys.modules.get(m) is not None]
        assert not leaked, leaked
        sys.exit(rc)
        """
    )
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    return subprocess.run(
        [sys.executable, "-c", code], text=True, timeout=300, env=env, cwd=ROOT, **kwargs
    )


# --------------------------------------------------------------------------- help without torch


@pytest.mark.parametrize(
    "args", [["--help"], [], ["demo", "--help"], ["bench", "--help"], ["--version"]]
)
def test_help_works_without_torch(args):
    proc = run_cli(args, block=["torch"])
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "pagedkv" in proc.stdout


def test_bare_pagedkv_lists_the_subcommands(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "bench" in out and "demo" in out


def test_demo_without_torch_says_how_to_get_it():
    proc = run_cli(["demo"], block=["torch"])
    assert proc.returncode == 1
    assert "pip install 'pagedkv[torch]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0  # one line


def test_building_the_parser_imports_neither_torch_nor_the_bench_drivers():
    code = (
        "import sys; from pagedkv.cli import build_parser; build_parser(); "
        "heavy = [m for m in ('torch', 'pagedkv.demo.engine', 'pagedkv.bench.vllm_042.trace', "
        "'pagedkv.bench.vllm_042.replay', 'pagedkv.bench.vllm_042.wholestep', "
        "'pagedkv.bench.vllm_042.driver', 'pagedkv.bench.vllm_v1', 'pagedkv.bench.harness', "
        "'matplotlib', 'tqdm') if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_demo_options_match_the_demo_engine():
    """The torch-free options of pagedkv.demo name what its engine (torch) accepts."""
    from pagedkv import demo

    engine = pytest.importorskip("pagedkv.demo.engine")  # needs torch
    assert set(engine._DTYPES) == set(demo.DTYPES)
    assert engine.DemoConfig().num_requests == demo.DEFAULT_REQUESTS
    from pagedkv.demo_paths import PATHS

    assert tuple(PATHS) == demo.PATHS and engine.DemoConfig().path == demo.PATHS[0]


def test_cli_and_demo_do_not_import_each_other():
    """cli owns the command tree and imports pagedkv.demo only to build it; the demo package
    never imports cli (no cycle)."""
    code = "import sys; import pagedkv.demo; sys.exit(1 if 'pagedkv.cli' in sys.modules else 0)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_console_entry_point_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    for flag in ("--quick", "--json", "--backends", "--compare", "--plot", "--scale", "--set"):
        assert flag in proc.stdout


# ------------------------------------------------------------------------------ errors, status


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--set", "num_gpu_blocks=-5"], "num_gpu_blocks must be >= 1"),
        (["--set", "num_cpu_blocks=-1"], "num_cpu_blocks must be >= 0"),
        (["--set", "watermark=abc"], "bad value for watermark"),
        (["--set", "watermark=1.5"], "watermark must be in [0, 1)"),
        (["--set", "watermark=0"], "watermark must be 0.01"),
        (["--set", "block_size=3"], "block_size must be a power of two"),
        (["--set", "chunked_prefill=maybe"], "expected true or false"),
        (["--set", "nope=1"], "bad --set 'nope=1'"),
        (["--set", "num_requests"], "bad --set 'num_requests'"),
        (["--set", "w2.max_num_seqs=1"], "max_num_seqs must be >= 2"),
        (["--backends", "nope"], "unknown backend"),
        (["--backends", "vllm"], "--compare vllm==VERSION"),
        (["--compare", "vllm0.4.2"], "expected vllm==VERSION"),
        (["--compare", "torch==2.0"], "expected vllm==VERSION"),
        (["--compare", "vllm==9.9.9"], "vllm==9.9.9"),
        (["--workloads", "w3"], "unknown workload"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--set", "w3.watermark=0"], "--set for unknown workload(s) ['w3']"),
        (["--set", "w1.nope=0", "--compare", "vllm==0.4.2"], "bad --set 'w1.nope=0'"),
        (["--json", "/nonexistent-dir/r.json"], "no such directory"),
        (["--plot", "/nonexistent-dir/p.png"], "no such directory"),
    ],
)
def test_bad_arguments_get_one_line_and_status_2(extra, message, capsys):
    assert cli.main(["bench", *extra]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("pagedkv bench: ") and "\n" not in err, err
    assert message in err
    assert captured.out == ""  # nothing ran


def test_bad_set_in_a_subprocess_has_no_traceback():
    proc = run_cli(["bench", "--set", "num_gpu_blocks=-5"])
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == "pagedkv bench: w2: bad --set: num_gpu_blocks must be >= 1, got -5"
    )


def test_requested_backend_that_cannot_run_is_an_error(monkeypatch, capsys):
    import pagedkv.bench.vllm_042.backends as backends

    real = backends._import
    monkeypatch.setattr(
        backends,
        "_import",
        lambda m: None if m.startswith("pagedkv.vllm_042.reference") else real(m),
    )
    assert cli.main([*TINY, "--backends", "reference,native", "--no-progress"]) == 2
    assert "reference: skipped" in capsys.readouterr().err
    # not asked for by name: the default set runs what it can and says what it skipped
    assert cli.main([*TINY, "--no-progress"]) == 0
    assert "reference: skipped" in capsys.readouterr().out


def test_a_diverging_manager_is_exit_status_1(monkeypatch, capsys):
    """A backend whose manager leaks a block: the replay cross-check fails, exit status 1."""
    import types

    import pagedkv.bench.vllm_042.backends as backends

    real = backends._RESOLVERS["native"]

    def leaky_native():
        backend, note = real()
        make = backend.make_manager

        def make_manager(*args):
            mgr = make(*args)
            methods = {n: getattr(mgr, n) for n in dir(mgr) if not n.startswith("_")}
            frees = []

            def free(seq):
                frees.append(seq)
                if len(frees) != 2:
                    mgr.free(seq)

            methods["free"] = free
            return types.SimpleNamespace(**methods)

        backend.make_manager = make_manager
        return backend, note

    monkeypatch.setitem(backends._RESOLVERS, "native", leaky_native)
    assert cli.main([*TINY, "--backends", "reference,native", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "Schedule cross-check FAILED" in out and "free GPU/CPU blocks" in out


def test_a_batch_step_that_decides_otherwise_is_exit_status_1(monkeypatch, capsys):
    import dataclasses

    from pagedkv.bench.vllm_042 import wholestep

    real_add = wholestep.BatchStepEngine.add

    def add(self, req):
        real_add(self, dataclasses.replace(req, output_len=max(1, req.output_len - 1)))

    monkeypatch.setattr(wholestep.BatchStepEngine, "add", add)
    assert cli.main([*TINY, "--backends", "native", "--no-progress"]) == 1
    assert "BATCH STEP DIFFERED" in capsys.readouterr().out


def test_set_scopes_to_one_workload():
    assert apply_overrides(W1_QUICK, ["w1.num_gpu_blocks=3000"]).num_gpu_blocks == 3000
    cfg = apply_overrides(
        W2_QUICK, ["watermark=0", "chunked-prefill=off", "w2.prefill_token_budget=4096"]
    )
    assert cfg.watermark == 0.0 and cfg.chunked_prefill is False
    with pytest.raises(ValueError, match="bad --set"):
        apply_overrides(W1_QUICK, ["name=W9"])


def test_quick_run_only_one_workload_with_set(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli.main(
        [
            *TINY,
            "--backends",
            "native",
            "--set",
            "w1.num_gpu_blocks=3000",
            "--set",
            "w2.num_gpu_blocks=1",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0, capsys.readouterr()
    doc = json.loads(out.read_text())
    assert "w2" not in doc and doc["w1"]["config"]["num_gpu_blocks"] == 3000


def test_broken_pipe_is_quiet():
    proc = subprocess.run(
        f"{sys.executable} -m pagedkv.cli {' '.join(TINY)} --backends native | head -c 10",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


# -------------------------------------------------------------------------- the whole document


def test_bench_quick_json(tmp_path, capsys):
    out = tmp_path / "out.json"
    rc = cli.main(["bench", "--quick", "--json", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.count("Schedule cross-check OK") == 2
    doc = json.loads(out.read_text())
    assert {"pagedkv_version", "seed", "quick", "micro", "w1", "w2"} <= set(doc)
    assert doc["quick"] is True and "scaling" not in doc
    assert doc["micro"]["hashing"]["native_list"]["mtok_per_s"] > 0
    assert "cycle" in doc["micro"]["pool"]["native"]
    for name, cfg in (("w1", W1_QUICK), ("w2", W2_QUICK)):
        section = doc[name]
        assert section["config"]["num_requests"] == cfg.num_requests
        runs = section["runs"]
        assert {(r["backend"], r["enable_caching"]) for r in runs} == {
            (b, c) for b in ("reference", "native", "native-batch") for c in (False, True)
        }
        for r in runs:
            assert r["finished"] == cfg.num_requests and r["all_blocks_free"] is True
            assert r["steps"] > 0 and r["step_us"]["mean"] > 0
            for key in ("preempt_recompute", "preempt_swap", "partial_prefills", "speedup_vs"):
                assert key in r
            if r["backend"] == "reference":
                assert r["speedup_vs_reference"] == pytest.approx(1.0)
            if name == "w2":  # the pressure workload preempts both ways and chunks prompts
                assert r["preempt_recompute"] > 0 and r["preempt_swap"] > 0
                assert r["partial_prefills"] > 0
            else:  # quick W1 never does (full W1 recomputes once: test_w1_preempts_once)
                assert r["preempt_recompute"] == r["preempt_swap"] == r["partial_prefills"] == 0
            assert r["mismatch"] is None
        assert section["cross_check"]["ok"] is True
        # the whole step: the batch step makes the compat step's decisions, every request
        # finishes, and both are timed per step and per running sequence
        assert [w["caching"] for w in section["whole_step"]] == [False, True]
        for w in section["whole_step"]:
            assert w["ok"] and w["finished"] == cfg.num_requests
            compat, batch = w["lanes"]["compat"], w["lanes"]["batch"]
            assert compat["steps"] == w["steps"] == batch["steps"] - 1  # + applying the last
            assert w["steps"] in {r["steps"] for r in runs}  # the replayed schedule's length
            assert batch["us_per_row"] > 0 and w["ratios"]["batch_vs_compat"] > 0
    # the output lines: W2 leads
    assert text.index("workload W2") < text.index("workload W1")


# ------------------------------------------------------------------------------- progress bar


def _run_on_pty(args, block=()):
    """Run ``pagedkv ARGS`` with stderr on a pseudo-terminal and stdout on a pipe."""
    pty = pytest.importorskip("pty")
    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "120"}
    try:
        with subprocess.Popen(
            [sys.executable, "-c", _blocked_main(args, block)],
            stdout=subprocess.PIPE,
            stderr=slave,
            env=env,
            cwd=ROOT,
        ) as proc:
            os.close(slave)
            chunks = []
            while True:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            stdout = proc.stdout.read().decode()
            proc.wait(timeout=120)
    finally:
        os.close(master)
    return proc.returncode, stdout, b"".join(chunks).decode(errors="replace")


def _blocked_main(args, block):
    return (
        "import sys\n"
        f"for name in {list(block)!r}: sys.modules[name] = None\n"
        "from pagedkv.cli import main\n"
        f"sys.exit(main({list(args)!r}))\n"
    )


@pytest.mark.parametrize("block", [(), ("tqdm",)], ids=["tqdm", "without-tqdm"])
def test_progress_bar_is_drawn_on_a_terminal(block):
    rc, stdout, terminal = _run_on_pty([*TINY, "--backends", "native"], block)
    assert rc == 0, terminal
    assert "W1 native caching=off" in terminal
    assert f"{W1_QUICK.num_requests}/{W1_QUICK.num_requests}" in terminal
    # stdout (a pipe) has the tables and no bar
    assert "Schedule cross-check OK" in stdout
    assert "\r" not in stdout and "caching=off" not in stdout


def test_no_progress_bar_off_a_terminal_or_when_asked(tmp_path):
    proc = run_cli([*TINY, "--backends", "native", "--json", str(tmp_path / "r.json")])
    assert proc.returncode == 0
    assert proc.stderr == ""  # stderr is a pipe: no bar
    assert "caching=off" not in (tmp_path / "r.json").read_text()
    rc, _, terminal = _run_on_pty([*TINY, "--backends", "native", "--no-progress"])
    assert rc == 0 and "caching=off" not in terminal


# ------------------------------------------------------------------------------------- plot


def test_plot_needs_matplotlib_and_says_so_before_running():
    proc = run_cli([*TINY, "--plot", "x.png"], block=["matplotlib"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "pagedkv bench: --plot needs matplotlib: pip install 'pagedkv[plot]'"
    )
    assert proc.stdout == ""


def test_plot_and_scaling_sweep(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png, out = tmp_path / "bench.png", tmp_path / "r.json"
    args = [
        "bench",
        "--quick",
        "--no-micro",
        "--caching",
        "on",
        "--backends",
        "native,native-batch",
    ]
    rc = cli.main([*args, "--plot", str(png), "--json", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
    doc = json.loads(out.read_text())
    scaling = doc["scaling"]
    assert scaling["factors"] == [1, 4, 16]
    batch, pool = scaling["batch"], scaling["pool"]
    assert [p["max_num_seqs"] // batch[0]["max_num_seqs"] for p in batch] == [1, 4, 16]
    assert [p["num_gpu_blocks"] // pool[0]["num_gpu_blocks"] for p in pool] == [1, 4, 16]
    assert len({p["max_num_seqs"] for p in pool}) == 1
    # more running sequences per step at x16 than at x1, and a time for every backend
    assert batch[2]["mean_batch_seqs"] > 4 * batch[0]["mean_batch_seqs"]
    for p in batch + pool:
        assert set(p["us_per_step"]) == {
            "batch-step",
            "batch-step-inc",
            "batch-step-stable",
            "native",
            "native-batch",
        }
        assert all(v > 0 for v in p["us_per_step"].values())
        assert all(v > 0 for v in p["us_per_row"].values()) and "mismatch" not in p
    assert "Scaling (W1 mix" in text


def test_base_install_pulls_in_no_torch_and_no_bench_extras():
    """``pip install .`` (the README's first command) installs numpy only; torch, matplotlib
    and tqdm are the ``torch``, ``plot`` and ``progress`` extras."""
    import re

    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    deps = re.search(r"^dependencies = \[(.*?)\]", text, re.S | re.M).group(1)
    names = {
        re.split(r"[<>=!~\[ ]", d.strip().strip("\"'"))[0] for d in deps.split(",") if d.strip()
    }
    assert names == {"numpy"}
    for extra, package in (("torch", "torch"), ("plot", "matplotlib"), ("progress", "tqdm")):
        assert re.search(rf'^{extra} = \[[^\]]*"{package}', text, re.M), extra
