"""Progress bars for ``pagedkv bench``: drawn on stderr, and only when stderr is a terminal.

With ``tqdm`` installed (``pip install 'pagedkv[bench]'``) the bar is tqdm's; without it a plain
one-line counter is drawn instead. Either way nothing is written when stderr is a pipe or a file
(so redirected output and ``--json`` results never contain a bar), and the finished bar stays on
the terminal as a one-line record of the run.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional, TextIO

__all__ = ["Progress", "stream_is_terminal"]


def stream_is_terminal(stream: Any) -> bool:
    """True when ``stream`` is an interactive terminal that can redraw a line."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty()) and os.environ.get("TERM") != "dumb"
    except ValueError:  # a closed stream
        return False


class _Silent:
    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None


class _LineBar:
    """``desc: done/total`` redrawn in place at most ten times a second (no tqdm)."""

    def __init__(self, total: int, desc: str, stream: TextIO) -> None:
        self.total, self.desc, self.stream = total, desc, stream
        self.done = 0
        self._last = 0.0
        self._start = time.perf_counter()

    def __enter__(self) -> _LineBar:
        self._draw()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._draw()
        self.stream.write("\n")
        self.stream.flush()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self._last >= 0.1:
            self._draw()

    def _draw(self) -> None:
        self._last = time.perf_counter()
        width = 24
        filled = width * self.done // self.total if self.total else width
        elapsed = self._last - self._start
        self.stream.write(
            f"\r{self.desc}: [{'#' * filled}{'.' * (width - filled)}] "
            f"{self.done}/{self.total} req, {elapsed:.1f}s"
        )
        self.stream.flush()


class Progress:
    """Makes one bar per run: ``with progress.bar(total, desc) as bar: ... bar.update(k)``."""

    def __init__(self, enabled: bool = True, stream: Optional[TextIO] = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled and stream_is_terminal(self.stream)

    def bar(self, total: int, desc: str) -> Any:
        if not self.enabled:
            return _Silent()
        try:
            from tqdm import tqdm
        except ImportError:
            return _LineBar(total, desc, self.stream)
        # A terminal that reports no size (a fresh pseudo-terminal, some CI consoles) would get
        # a zero-width bar on a zero-line screen, that is nothing at all: give tqdm a size then.
        known = _size_known(self.stream)
        return tqdm(
            total=total,
            desc=desc,
            unit="req",
            file=self.stream,
            leave=True,
            mininterval=0.1,
            dynamic_ncols=known,
            ncols=None if known else 100,
            nrows=None if known else 24,
        )


def _size_known(stream: Any) -> bool:
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return size.columns > 0 and size.lines > 0
