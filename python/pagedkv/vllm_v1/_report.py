"""What pagedkv tells the operator of a vLLM engine: one line at start, then the fallbacks.

**At start** (:func:`log_start`): each scheduler pagedkv builds (one per engine process) logs
one INFO line: pagedkv's version, vLLM's, the scheduler class, whether the KV cache manager and
the scheduling loop are native, and for each that is not, the reason. The line goes through
logger ``pagedkv.vllm_v1``; unless the user configured the ``pagedkv`` logger, its records are
handed to the handlers of vLLM's own ``vllm`` logger (:func:`route_to_vllm_log`), so they
appear in vLLM's default log with vLLM's format, in every engine process.

**While serving** (:class:`StepCounter`): each ``schedule()`` call counts as native, or as a
step of vLLM's loop with the reason (the kind of out-of-scope request held, a paused engine,
...). The counts are the scheduler's ``pagedkv_steps`` (a ``collections.Counter``: key
``"native"``, and one key per fallback reason), readable at any time, and every
``PAGEDKV_VLLM_LOG_INTERVAL`` seconds (default 60; 0 turns the line off) a line with the share
of native steps in that interval and its fallback reasons is logged, when the interval saw a
step. Cost per step: one counter increment and one clock read.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from typing import Any, Optional

logger = logging.getLogger("pagedkv.vllm_v1")

#: Seconds between two fallback lines (``0``: none).
INTERVAL_ENV = "PAGEDKV_VLLM_LOG_INTERVAL"
DEFAULT_INTERVAL_S = 60.0
#: The counter key of a native step.
NATIVE = "native"


class _ToVllmLog(logging.Handler):
    """Hands pagedkv's records to the handlers of vLLM's ``vllm`` logger, as they are when
    the record is made (vLLM configures them in each engine process, before or after pagedkv
    is imported), while the root logger has none (otherwise the record propagates there)."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        for handler in logging.getLogger("vllm").handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def route_to_vllm_log() -> None:
    """pagedkv's lines into vLLM's log, in vLLM's format: vLLM configures only its own
    ``vllm`` logger (which does not propagate), so pagedkv's INFO lines would reach no
    handler. Unless the user configured the ``pagedkv`` logger (a handler or a level), it
    gets a handler forwarding to vLLM's handlers, and level INFO. Nothing reaches vLLM's log
    where vLLM configured none (``VLLM_CONFIGURE_LOGGING=0``). Idempotent."""
    ours = logging.getLogger("pagedkv")
    if ours.handlers or ours.level != logging.NOTSET:
        return
    ours.addHandler(_ToVllmLog())
    ours.setLevel(logging.INFO)


def start_line(
    scheduler_cls: str, manager_why: Optional[str], loop_why: Optional[str], hashing: str
) -> str:
    """The start line's text (``*_why``: why that part is vLLM's, ``None``: it is native;
    ``hashing``: who hashes blocks, or that prefix caching is off)."""
    import pagedkv

    from ._version import vllm_version

    manager = "native" if manager_why is None else f"vLLM's ({manager_why})"
    loop = "native" if loop_why is None else f"vLLM's ({loop_why})"
    return (
        f"pagedkv {pagedkv.__version__} on vLLM {vllm_version()}: {scheduler_cls} with KV cache "
        f"manager {manager}, scheduling loop {loop}, {hashing}"
    )


def log_start(
    scheduler_cls: str, manager_why: Optional[str], loop_why: Optional[str], hashing: str
) -> None:
    """Log the start line (INFO), routed to vLLM's log if nobody configured logging."""
    route_to_vllm_log()
    logger.info("%s", start_line(scheduler_cls, manager_why, loop_why, hashing))


def interval_from_env() -> float:
    """``PAGEDKV_VLLM_LOG_INTERVAL`` in seconds (default 60; ``0`` or less: no line). A value
    that is not a number is refused with ``InvalidArgumentError``."""
    from pagedkv.errors import InvalidArgumentError

    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgumentError(f"{INTERVAL_ENV}={raw!r} is not a number of seconds") from None
    if value != value:  # NaN
        raise InvalidArgumentError(f"{INTERVAL_ENV}={raw!r} is not a number of seconds")
    return max(0.0, value)


class StepCounter:
    """Counts ``schedule()`` calls by loop (``"native"``, or vLLM's with its reason) and logs
    the interval's share every ``interval`` seconds. ``total`` is the running count since
    construction (the scheduler's ``pagedkv_steps``)."""

    def __init__(self, interval: float, clock: Any = time.monotonic) -> None:
        self.total: Counter = Counter()
        self._window: Counter = Counter()
        self._interval = interval
        self._clock = clock
        self._due = clock() + interval if interval > 0 else float("inf")

    def count(self, reason: str) -> None:
        """One step: ``NATIVE``, or the reason it ran on vLLM's loop."""
        self.total[reason] += 1
        self._window[reason] += 1
        if self._due != float("inf"):
            now = self._clock()
            if now >= self._due:
                self._due = now + self._interval
                logger.info("%s", self.window_line())
                self._window.clear()

    def window_line(self) -> str:
        """The interval's line: steps, the native share, each fallback reason's steps."""
        steps = sum(self._window.values())
        native = self._window.get(NATIVE, 0)
        fallbacks = sorted(
            ((n, why) for why, n in self._window.items() if why != NATIVE), key=lambda t: -t[0]
        )
        reasons = "; ".join(f"{why}: {n}" for n, why in fallbacks) or "none"
        share = native / steps if steps else 0.0
        return (
            f"pagedkv: {steps} scheduler steps in the last {self._interval:g} s, "
            f"{share:.1%} native; on vLLM's loop because of {reasons}"
        )
