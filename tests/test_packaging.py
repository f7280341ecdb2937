"""Package metadata and archives: one version source, the license in the sdist (and the checker
that .ci/run applies to the wheel), metadata a registry page needs."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import pagedkv

ROOT = Path(__file__).resolve().parent.parent


def _check_dist():
    spec = importlib.util.spec_from_file_location("check_dist", ROOT / "scripts" / "check_dist.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_dist = _check_dist()


def test_version_has_one_source():
    """Cargo's workspace version is the wheel's version and ``pagedkv.__version__``."""
    assert pagedkv.__version__ == importlib.metadata.version("pagedkv")
    assert pagedkv.__version__ == check_dist.cargo_version()


def test_license_file_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0")
    assert "END OF TERMS AND CONDITIONS" in text


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    if importlib.util.find_spec("maturin") is None and shutil.which("maturin") is None:
        pytest.skip("maturin is not installed (it is in the test extra)")
    out = tmp_path_factory.mktemp("sdist")
    cmd = [sys.executable, "-m", "maturin", "sdist", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=300)
    (path,) = out.glob("pagedkv-*.tar.gz")
    return path


def test_sdist_holds_license_readme_sources_and_metadata(sdist):
    version = check_dist.cargo_version()
    assert check_dist.check_sdist(sdist, version) == []
    with tarfile.open(sdist) as tar:
        shipped = tar.extractfile(f"pagedkv-{version}/LICENSE").read()
    assert shipped == (ROOT / "LICENSE").read_bytes()


def test_checker_rejects_a_wheel_without_license_or_metadata(tmp_path):
    """The wheel check .ci/run applies can fail: a wheel missing the license is caught."""
    version = check_dist.cargo_version()
    name = f"pagedkv-{version}-cp310-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(tmp_path / name, "w") as whl:
        whl.writestr("pagedkv/__init__.py", "")
        metadata = f"Name: pagedkv\nVersion: {version}\n"
        whl.writestr(f"pagedkv-{version}.dist-info/METADATA", metadata)
    problems = "\n".join(check_dist.check_wheel(tmp_path / name, version))
    assert "not a cp310-abi3 manylinux2014 wheel" in problems
    assert "licenses/LICENSE" in problems
    assert "License-Expression" in problems and "keywords" in problems


def test_ci_fails_when_a_part_of_the_readme_test_command_fails() -> None:
    """``set -e`` does not stop a script at a failure inside an ``&&`` list, so .ci/run guards
    the README's test command: with pytest failing (and every other part succeeding) the
    command as .ci/run writes it must fail the script before the next line."""
    import re
    import subprocess
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    match = re.search(r"^scripts/vllm_envs\.sh && .*?(?<!\\)\n", text, re.M | re.S)
    assert match, "the README's test command is not in .ci/run"
    command = match.group(0)
    for part, stand_in in (
        ("scripts/vllm_envs.sh", "true"),
        ("pip install '.[test]'", "true"),
        ("pytest --runslow", "false"),
        ("cargo test", "true"),
    ):
        assert part in command, part
        command = command.replace(part, stand_in)
    script = f"set -euo pipefail\n{command}echo reached\n"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert proc.returncode != 0 and "reached" not in proc.stdout, (proc.stdout, proc.stderr)
