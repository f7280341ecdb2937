"""Shared pytest configuration: the ``slow`` marker runs only with ``--runslow``; tests/vllm_v1
is collected only where vLLM is installed (the vLLM virtualenvs that tests/test_vllm_v1.py runs
it in), never in the main suite's own environment."""

from __future__ import annotations

import importlib.util

import pytest

collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_v1"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--runslow",
        action="store_true",
        default=False,
        help="also run tests marked slow (the README's full test command does)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
