"""The 0.4.2 generation's code lives in ``pagedkv.vllm_042``; the old module paths
(``pagedkv.sequence`` and the rest) re-export it: the same objects, never copies."""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
import types

import pytest

import pagedkv

MOVED = [
    "sequence",
    "block",
    "block_manager",
    "scheduler",
    "engine_step",
    "types",
    "outputs",
    "protocols",
    "demo_paths",
    "reference",
    "reference.hashing",
    "reference.pool",
    "reference.sequence",
    "reference.block_manager",
]


def _public(module: types.ModuleType):
    """The module's public names that are pagedkv's (not typing's, dataclasses', modules)."""
    for name, obj in vars(module).items():
        if name.startswith("_") or isinstance(obj, types.ModuleType):
            continue
        if getattr(obj, "__module__", "").startswith("pagedkv") or name in getattr(
            module, "__all__", ()
        ):
            yield name, obj


@pytest.mark.parametrize("name", MOVED)
def test_old_path_re_exports_the_same_objects(name):
    old = importlib.import_module(f"pagedkv.{name}")
    new = importlib.import_module(f"pagedkv.vllm_042.{name}")
    assert old is not new and old.__file__ != new.__file__
    assert f"pagedkv.vllm_042.{name}" in (old.__doc__ or "")
    new_all = getattr(new, "__all__", None)
    if new_all is not None:
        assert list(old.__all__[: len(new_all)]) == list(new_all)
    for attr in old.__all__:
        got, want = getattr(old, attr), getattr(new, attr)
        if isinstance(want, types.ModuleType):
            # ``pagedkv.reference.hashing``: importing the old submodule path rebinds the
            # package's attribute to that re-exporting module (the same functions).
            assert got.__name__ in (want.__name__, f"{old.__name__}.{attr}"), attr
            names = importlib.import_module(f"{old.__name__}.{attr}").__all__
            assert all(getattr(got, n) is getattr(want, n) for n in names), attr
        else:
            assert got is want, attr
    missing = [n for n, obj in _public(new) if getattr(old, n, None) is not obj]
    assert not missing, f"pagedkv.{name} lacks {missing}"


def test_package_names_are_the_vllm_042_objects():
    for name in pagedkv.__all__:
        obj = getattr(pagedkv, name)
        module = getattr(obj, "__module__", "")
        if isinstance(obj, type) and not module.startswith(("pagedkv._native", "pagedkv.errors")):
            assert module.startswith("pagedkv.vllm_042."), (name, module)
            home = importlib.import_module(module)
            assert getattr(home, name) is obj
    from pagedkv.sequence import Sequence, SequenceStatus

    assert Sequence is pagedkv.Sequence and SequenceStatus.RUNNING is pagedkv.SequenceStatus.RUNNING
    seq = pagedkv.Sequence(1, "", [1, 2, 3], 4)
    assert isinstance(seq, Sequence)


def test_pickles_name_the_new_path_and_old_ones_still_load():
    status = pagedkv.SequenceStatus.RUNNING
    assert b"pagedkv.vllm_042.sequence" in pickle.dumps(status)
    # Protocol 0 names the class in plain text (no length prefixes), as an old pickle would.
    new = pickle.dumps(status, protocol=0)
    old = new.replace(b"pagedkv.vllm_042.sequence", b"pagedkv.sequence")
    assert b"pagedkv.vllm_042" not in old
    assert pickle.loads(old) is status


def test_vllm_release_substitutes_the_new_paths():
    from pagedkv import vllm_release

    texts = [m for m, _ in vllm_release._PAGEDKV_SWAPS.values()]
    texts += list(vllm_release._PAGEDKV_OVERRIDES.values())
    texts += [vllm_release._PAGEDKV_SCHEDULER_OVERRIDE[1]]
    texts += list(vllm_release._PAGEDKV_VERSION_OVERRIDES.values())
    for old in ("sequence", "block", "block_manager", "scheduler", "types"):
        assert not any(f"pagedkv.{old}" in t for t in texts), old


def test_import_pagedkv_loads_no_old_path_no_vllm_no_torch():
    code = (
        "import sys, pagedkv\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')]\n"
        "bad += [m for m in ('pagedkv.sequence', 'pagedkv.scheduler', 'pagedkv.reference')\n"
        "        if m in sys.modules]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
