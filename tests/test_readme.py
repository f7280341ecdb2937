"""Every Python block of README.md and of the user's guides in docs/ runs as written; where the
text after a block says "It prints `...`", that is what the block prints."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The pages whose Python blocks are runnable examples.
PAGES = (ROOT / "README.md", ROOT / "docs" / "vllm_042.md")
BLOCK = re.compile(r"```python\n(.*?)```\n(.*?)(?=\n```|\Z)", re.DOTALL)


def _blocks():
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            claim = re.match(r"\s*It prints `([^`]*)`", m.group(2))
            printed = claim.group(1) if claim else None
            out.append(pytest.param(page, m.group(1), printed, id=f"{page.name}:{line}"))
    return out


def test_guides_have_python_blocks():
    assert len(_blocks()) >= 2


@pytest.mark.parametrize("page, code, printed", _blocks())
def test_python_block_runs(page, code, printed):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(code, str(page), "exec"), {"__name__": "__readme__"})
    if printed is not None:
        assert stdout.getvalue().strip() == printed
