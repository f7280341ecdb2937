"""The ``_native.pyi`` stub matches the compiled module: same public names, same methods."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pagedkv
from pagedkv import _native

STUB = Path(pagedkv.__file__).with_name("_native.pyi")


def _stub_tree():
    return ast.parse(STUB.read_text())


def _public(names):
    return {n for n in names if not n.startswith("_") or n == "__version__"}


def test_stub_ships_with_the_package():
    assert STUB.exists()
    assert Path(pagedkv.__file__).with_name("py.typed").exists()


def test_module_level_names_match():
    tree = _stub_tree()
    stub_names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            stub_names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            stub_names.add(node.target.id)
    native_names = _public(n for n in dir(_native) if not inspect.ismodule(getattr(_native, n)))
    native_names.discard("__all__")
    assert native_names == _public(stub_names)


def test_class_members_match():
    for node in _stub_tree().body:
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(_native, node.name)
        stub_members = {
            n.name
            for n in node.body
            if isinstance(n, ast.FunctionDef)
            and (not n.name.startswith("_") or n.name in {"__len__", "__copy__", "__deepcopy__"})
        }
        native_members = {
            n
            for n in dir(cls)
            if not n.startswith("_") or n in {"__len__", "__copy__", "__deepcopy__"}
        }
        assert stub_members == native_members, node.name
