"""The ``vllm.general_plugins`` entry point: with ``PAGEDKV_VLLM=1``, pagedkv's scheduler is
vLLM's default.

vLLM loads general plugins in every engine process before it builds the scheduler. With the
variable unset (or ``0``) this does nothing. With it set, a configuration that names no
scheduler class gets ``pagedkv.vllm_v1.Scheduler`` (``AsyncScheduler`` under async
scheduling); a configuration that names one keeps it.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "PAGEDKV_VLLM"


def enabled() -> bool:
    return os.environ.get(ENV, "0").strip().lower() not in ("", "0", "false", "no", "off")


def register() -> None:
    """Entry point: make pagedkv's scheduler the default when ``PAGEDKV_VLLM`` is set."""
    if not enabled():
        return
    from vllm.config.scheduler import SchedulerConfig

    from ._version import require_supported_vllm

    require_supported_vllm()
    original = SchedulerConfig.get_scheduler_cls
    if getattr(original, "_pagedkv", False):
        return

    def get_scheduler_cls(self: Any) -> Any:
        if self.scheduler_cls is None:
            from . import _scheduler

            return _scheduler.AsyncScheduler if self.async_scheduling else _scheduler.Scheduler
        return original(self)

    get_scheduler_cls._pagedkv = True  # type: ignore[attr-defined]
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls  # type: ignore[method-assign]
