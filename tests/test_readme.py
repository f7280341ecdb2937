"""Every Python block of README.md runs as written; where the text after a block says
"It prints `...`", that is what the block prints."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"```python\n(.*?)```\n(.*?)(?=\n```|\Z)", re.DOTALL)


def _blocks():
    text = README.read_text()
    out = []
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        claim = re.match(r"\s*It prints `([^`]*)`", m.group(2))
        out.append(pytest.param(m.group(1), claim.group(1) if claim else None, id=f"line{line}"))
    return out


def test_readme_has_python_blocks():
    assert len(_blocks()) >= 2


@pytest.mark.parametrize("code, printed", _blocks())
def test_readme_python_block_runs(code, printed):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    if printed is not None:
        assert stdout.getvalue().strip() == printed
