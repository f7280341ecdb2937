"""Check the release artifacts in a folder: the wheel and the sdist that scripts/build_dist.sh
makes. Usage: ``python scripts/check_dist.py DIST``.

Checks, for each archive: the files a user and a registry need are inside (LICENSE, README,
stubs, ``py.typed``, the sources for the sdist); the metadata has the one version (Cargo's
workspace version), the SPDX license with its file, classifiers, keywords, the readme; and the
wheel's platform tag claims no more than ``auditwheel show`` finds it needs (when auditwheel is
installed). Exits non-zero with every problem listed. ``tests/test_packaging.py`` runs the sdist
checks on a fresh ``maturin sdist``.
"""

from __future__ import annotations

import email.parser
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cargo_version(root: Path = ROOT) -> str:
    """``[workspace.package] version`` of Cargo.toml: the package's one version source."""
    text = (root / "Cargo.toml").read_text()
    section = text.split("[workspace.package]", 1)[1]
    match = re.search(r'^version\s*=\s*"([^"]+)"', section, re.MULTILINE)
    if match is None:
        raise SystemExit("Cargo.toml: no [workspace.package] version")
    return match.group(1)


def check_metadata(raw: str, where: str, version: str) -> list[str]:
    """Problems with a PKG-INFO / METADATA file's fields."""
    meta = email.parser.Parser().parsestr(raw)
    problems = []
    if meta["Name"] != "pagedkv":
        problems.append(f"{where}: Name is {meta['Name']!r}")
    if meta["Version"] != version:
        problems.append(f"{where}: Version {meta['Version']!r} != Cargo's {version!r}")
    if meta["License-Expression"] != "Apache-2.0":
        problems.append(f"{where}: License-Expression is {meta['License-Expression']!r}")
    if "LICENSE" not in (meta.get_all("License-File") or []):
        problems.append(f"{where}: no License-File: LICENSE")
    if len(meta.get_all("Classifier") or []) < 5:
        problems.append(f"{where}: too few classifiers")
    if not meta["Keywords"]:
        problems.append(f"{where}: no keywords")
    if meta["Requires-Python"] != ">=3.10":
        problems.append(f"{where}: Requires-Python is {meta['Requires-Python']!r}")
    if not (meta["Description-Content-Type"] or "").startswith("text/markdown"):
        problems.append(f"{where}: the README is not the long description")
    if "# pagedkv" not in (meta.get_payload() or ""):
        problems.append(f"{where}: the README text is missing from the metadata")
    return problems


def check_sdist(path: Path, version: str) -> list[str]:
    with tarfile.open(path) as tar:
        names = set(tar.getnames())
        top = f"pagedkv-{version}"
        member = tar.extractfile(f"{top}/PKG-INFO")
        raw = member.read().decode() if member else ""
    needed = [
        "LICENSE",
        "README.md",
        "pyproject.toml",
        "Cargo.toml",
        "Cargo.lock",
        "rust/core/Cargo.toml",
        "rust/core/src/lib.rs",
        "rust/py/Cargo.toml",
        "rust/py/src/lib.rs",
        "python/pagedkv/__init__.py",
        "python/pagedkv/_native.pyi",
        "python/pagedkv/py.typed",
        "python/pagedkv/vllm_042/__init__.py",
        "python/pagedkv/vllm_042/sequence.py",
        "python/pagedkv/sequence.py",
    ]
    problems = [f"{path.name}: missing {n}" for n in needed if f"{top}/{n}" not in names]
    return problems + check_metadata(raw, path.name, version)


def check_wheel(path: Path, version: str) -> list[str]:
    problems = []
    if not re.search(r"-cp310-abi3-manylinux2014_x86_64\.manylinux_2_17_x86_64\.whl$", path.name):
        problems.append(f"{path.name}: not a cp310-abi3 manylinux2014 wheel")
    with zipfile.ZipFile(path) as whl:
        names = set(whl.namelist())
        info = f"pagedkv-{version}.dist-info"
        raw = whl.read(f"{info}/METADATA").decode() if f"{info}/METADATA" in names else ""
    needed = [
        f"{info}/licenses/LICENSE",
        "pagedkv/_native.abi3.so",
        "pagedkv/_native.pyi",
        "pagedkv/py.typed",
        "pagedkv/__init__.py",
        "pagedkv/vllm_042/__init__.py",
        "pagedkv/vllm_042/sequence.py",
        "pagedkv/sequence.py",
    ]
    problems += [f"{path.name}: missing {n}" for n in needed if n not in names]
    return problems + check_metadata(raw, path.name, version) + check_platform_tag(path)


def check_platform_tag(path: Path) -> list[str]:
    """The glibc version ``auditwheel show`` finds the wheel needs is at most the one it claims."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "auditwheel", "show", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return []
    if "No module named auditwheel" in proc.stderr:
        print("check_dist: auditwheel not installed; platform tag not audited", file=sys.stderr)
        return []
    verdict = r'consistent with the following platform tag:\s*"manylinux_(\d+)_(\d+)_'
    found = re.search(verdict, proc.stdout)
    claimed = re.search(r"manylinux_(\d+)_(\d+)_x86_64\.whl$", path.name)
    if found is None or claimed is None:
        return [f"{path.name}: cannot read auditwheel's verdict:\n{proc.stdout}{proc.stderr}"]
    needs = tuple(map(int, found.groups()))
    claims = tuple(map(int, claimed.groups()))
    if needs > claims:
        return [f"{path.name}: claims glibc {claims} but needs {needs} (auditwheel)"]
    print(f"check_dist: {path.name}: auditwheel: needs manylinux_{needs[0]}_{needs[1]}")
    return []


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    dist = Path(argv[0])
    version = cargo_version()
    wheels = sorted(dist.glob("pagedkv-*.whl"))
    sdists = sorted(dist.glob("pagedkv-*.tar.gz"))
    problems = []
    if len(wheels) != 1 or len(sdists) != 1:
        problems.append(f"{dist}: want one wheel and one sdist, found {wheels + sdists}")
    for wheel in wheels:
        problems += check_wheel(wheel, version)
    for sdist in sdists:
        problems += check_sdist(sdist, version)
    for p in problems:
        print(f"check_dist: {p}", file=sys.stderr)
    if not problems:
        print(f"check_dist: {', '.join(p.name for p in wheels + sdists)}: OK")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
