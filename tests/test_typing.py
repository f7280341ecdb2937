"""The typing surface: stubs agree with the binary (mypy.stubtest), typed usage type-checks,
mypy's messages name public classes, signatures and docstrings are real."""

from __future__ import annotations

import inspect
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import pagedkv
from pagedkv import _native
from pagedkv.vllm_042 import (
    block,
    block_manager,
    engine_step,
    outputs,
    protocols,
    scheduler,
    sequence,
    types,
)

pytest.importorskip("mypy")

ROOT = Path(__file__).resolve().parent.parent
TYPING = Path(__file__).resolve().parent / "typing"
ALLOWLIST = TYPING / "stubtest_allowlist.txt"


@pytest.fixture
def mypy_config(request, tmp_path) -> Path:
    """A mypy config whose cache persists across runs (numpy's stubs take a while to parse)."""
    pytest_cache = getattr(request.config, "cache", None)  # absent with -p no:cacheprovider
    cache = pytest_cache.mkdir("mypy") if pytest_cache else tmp_path / "mypy_cache"
    config = tmp_path / "mypy.ini"
    config.write_text(f"[mypy]\ncache_dir = {cache}\n")
    return config


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=600)


def test_stubtest_finds_no_error(mypy_config):
    """``_native.pyi`` matches the compiled module: names, signatures, defaults, properties."""
    args = ["mypy.stubtest", "pagedkv._native", "--allowlist", str(ALLOWLIST)]
    proc = _run([*args, "--mypy-config-file", str(mypy_config)], mypy_config.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_typed_usage_type_checks_and_runs(mypy_config):
    example = TYPING / "usage_ok.py"
    args = ["mypy", "--strict", "--no-error-summary", "--config-file", str(mypy_config)]
    proc = _run([*args, str(example)], mypy_config.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runpy.run_path(str(example), run_name="__main__")


def test_mypy_errors_name_public_types(mypy_config):
    example = TYPING / "usage_errors.py"
    args = ["mypy", "--no-error-summary", "--hide-error-context", "--config-file"]
    proc = _run([*args, str(mypy_config), str(example)], mypy_config.parent)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors: dict[int, list[str]] = {}
    for line in proc.stdout.splitlines():
        m = re.match(r".*usage_errors\.py:(\d+): error: (.*)", line)
        if m:
            errors.setdefault(int(m.group(1)), []).append(m.group(2))
    expected = {
        i: text.split("# E: ", 1)[1].strip()
        for i, text in enumerate(example.read_text().splitlines(), start=1)
        if "# E: " in text
    }
    assert set(errors) == set(expected), proc.stdout
    for line, want in expected.items():
        assert any(want in e for e in errors[line]), (line, want, errors[line])
    assert "BlockManager" not in re.sub(r"BlockSpaceManager", "", proc.stdout)


def _public_members(cls: type):
    for name, member in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        yield name, member


NATIVE_CLASSES = [c for c in map(_native.__dict__.get, _native.__all__) if isinstance(c, type)]
NATIVE_FUNCTIONS = [f for f in map(_native.__dict__.get, _native.__all__) if callable(f)]
NATIVE_FUNCTIONS = [f for f in NATIVE_FUNCTIONS if not isinstance(f, type)]
# Python classes whose methods must all be documented (pagedkv.sequence: see the report of
# issue 12; its methods follow vLLM's names and are documented where they differ).
PYTHON_MODULES = [
    block_manager,
    block,
    protocols,
    types,
    sequence,
    outputs,
    scheduler,
    engine_step,
]


def _python_classes():
    for module in PYTHON_MODULES:
        for name in getattr(module, "__all__", dir(module)):
            obj = getattr(module, name)
            if isinstance(obj, type) and obj.__module__ == module.__name__:
                yield obj


def test_signatures_show_real_defaults():
    """``inspect.signature`` of every native callable parses, with no ``...`` default."""
    callables = list(NATIVE_FUNCTIONS) + list(NATIVE_CLASSES)
    for cls in NATIVE_CLASSES:
        callables += [m for n, m in _public_members(cls) if callable(m) and n != "__init__"]
    for fn in callables:
        sig = inspect.signature(fn)
        for p in sig.parameters.values():
            assert p.default is not Ellipsis, f"{fn.__qualname__}{sig}"
    mgr = pagedkv.BlockSpaceManager(16, 8, 8)
    assert str(inspect.signature(mgr.append_slots)) == "(seq, num_lookahead_slots=0)"
    assert str(inspect.signature(mgr.swap_in)) == "(seq_group, num_lookahead_slots=0)"
    sig = inspect.signature(pagedkv.BlockSpaceManager)
    assert sig.parameters["watermark"].default == 0.01
    assert sig.parameters["strict"].kind is inspect.Parameter.KEYWORD_ONLY


def test_every_public_method_has_a_docstring():
    missing = []
    classes = NATIVE_CLASSES + list(_python_classes())
    assert pagedkv.BlockSpaceManager in classes and pagedkv.BlockMapping in classes
    for cls in classes:
        for name, member in _public_members(cls):
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            is_method = inspect.isroutine(member) or inspect.isdatadescriptor(member)
            if name == "__init__" or not is_method or inspect.ismemberdescriptor(member):
                continue  # plain attributes (dataclass defaults, enum members, __slots__)
            doc = getattr(member, "__doc__", None)
            if not (doc and doc.strip()):
                missing.append(f"{cls.__name__}.{name}")
    missing += [f.__name__ for f in NATIVE_FUNCTIONS if not (f.__doc__ or "").strip()]
    assert not missing, missing


def test_stub_docstrings_cover_every_method():
    """The stub documents each method too (what an IDE shows)."""
    import ast

    tree = ast.parse((Path(pagedkv.__file__).with_name("_native.pyi")).read_text())
    missing = [
        f"{cls.name}.{fn.name}"
        for cls in tree.body
        if isinstance(cls, ast.ClassDef)
        for fn in cls.body
        if isinstance(fn, ast.FunctionDef)
        and not fn.name.startswith("_")
        and ast.get_docstring(fn) is None
    ]
    assert not missing, missing
