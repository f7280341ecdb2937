"""What an operator sees of pagedkv in vLLM's log (pagedkv.vllm_v1._report): one INFO line per
scheduler at start, through vLLM's own default handler; per-step fallbacks to vLLM's loop
counted by reason on the scheduler (``pagedkv_steps``) and in a periodic line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import vllm
from v1_harness import (
    RequestSpec,
    SchedConfig,
    build_request,
    make_scheduler,
    model_runner_output,
    request_block_hasher,
    write_tiny_model,
)

import pagedkv
from pagedkv.errors import InvalidArgumentError
from pagedkv.vllm_v1 import Scheduler, _report

ROOT = Path(__file__).resolve().parents[2]

#: Builds schedulers the way vLLM's engine process does (vLLM's logging configured by its
#: import, nothing configured by the user) and prints nothing itself: stdout is vLLM's log.
BUILD_SCRIPT = textwrap.dedent(
    """
    import os, sys, tempfile
    from vllm.config import LoggingConfig
    from vllm.logger import configure_logging
    configure_logging(LoggingConfig())  # vLLM's default logging, as its engine process sets it
    sys.path.insert(0, os.path.join(sys.argv[1], "tests", "vllm_v1"))
    from v1_harness import SchedConfig, make_scheduler, write_tiny_model
    import pagedkv.vllm_v1 as pv

    with tempfile.TemporaryDirectory() as d:
        model = write_tiny_model(__import__("pathlib").Path(d))
        make_scheduler(SchedConfig(), model, pv.KVCacheManager)
        make_scheduler(SchedConfig(enable_caching=False), model, pv.KVCacheManager)
        os.environ["PAGEDKV_VLLM_NATIVE_LOOP"] = "0"
        make_scheduler(SchedConfig(), model, pv.KVCacheManager)
    """
)


def test_one_start_line_per_scheduler_in_vllms_default_log(tmp_path: Path) -> None:
    # pagedkv is imported as this process imports it (the inner suite's PYTHONPATH).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_VLLM")}
    proc = subprocess.run(
        [sys.executable, "-c", BUILD_SCRIPT, str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    head = f"pagedkv {pagedkv.__version__} on vLLM {vllm.__version__}: Scheduler with KV cache"
    lines = [line for line in proc.stdout.splitlines() if "pagedkv" in line]
    assert len(lines) == 3, proc.stdout[-4000:]
    assert all(" INFO " in line and head in line for line in lines), lines  # vLLM's format
    assert lines[0].endswith("manager native, scheduling loop native, block hashing native"), lines[
        0
    ]
    assert lines[1].endswith("manager native, scheduling loop native, prefix caching off")
    assert lines[2].endswith(
        "manager native, scheduling loop vLLM's (PAGEDKV_VLLM_NATIVE_LOOP=0), block hashing native"
    ), lines[2]


def test_start_line_names_why_vllms_manager_runs() -> None:
    line = _report.start_line(
        "AsyncScheduler", "2 KV cache groups (hybrid model)", "vLLM's KV cache manager runs", "x"
    )
    assert line.endswith(
        "AsyncScheduler with KV cache manager vLLM's (2 KV cache groups (hybrid model)), "
        "scheduling loop vLLM's (vLLM's KV cache manager runs), x"
    ), line


def test_the_loop_names_a_connector_rather_than_the_manager_it_keeps() -> None:
    """With a KV connector and vLLM's manager kept (a hybrid cache), the loop's reason names
    the connector."""
    from types import SimpleNamespace

    from pagedkv.vllm_v1._scope import engine_out_of_scope

    model = SimpleNamespace(runner_type="generate")
    sched = SimpleNamespace(
        kv_cache_manager=object(),
        connector=object(),
        num_lookahead_tokens=0,
        num_spec_tokens=0,
        vllm_config=SimpleNamespace(model_config=model),
    )
    assert engine_out_of_scope(sched) == "a KV connector"
    sched.connector = None
    assert engine_out_of_scope(sched) == "vLLM's KV cache manager runs"


def _plain(i: int, **kw) -> RequestSpec:
    return RequestSpec(f"r{i}", tuple(range(100 + i, 140 + i)), 4, True, 0, **kw)


def test_fallback_steps_are_counted_by_reason_and_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A request the native loop does not cover (a priority beyond 64 bits) puts the steps it is
    held for on vLLM's loop; every step is counted, and with a tiny interval each step logs
    the interval's share and reasons."""
    monkeypatch.setenv(_report.INTERVAL_ENV, "1e-9")
    cfg = SchedConfig(max_num_seqs=4)
    sched = make_scheduler(cfg, write_tiny_model(tmp_path), pagedkv.vllm_v1.KVCacheManager)
    assert isinstance(sched, Scheduler)
    hasher = request_block_hasher(cfg)
    sched.add_request(build_request(_plain(0), hasher))
    with caplog.at_level(logging.INFO, logger="pagedkv.vllm_v1"):
        _step(sched)  # native
        sched.add_request(build_request(_plain(1, held=True), hasher))
        while sched.has_unfinished_requests():
            _step(sched)
        sched.add_request(build_request(_plain(2), hasher))
        while sched.has_unfinished_requests():
            _step(sched)
    steps = sched.pagedkv_steps
    assert steps["priority"] == sched.pagedkv_vllm_steps > 0, steps
    assert steps[_report.NATIVE] == sched.pagedkv_native_steps > 1, steps
    assert set(steps) == {_report.NATIVE, "priority"}, steps
    logged = [r.getMessage() for r in caplog.records if "scheduler steps in the last" in r.message]
    assert len(logged) == sum(steps.values())  # each step ends an interval of 1 ns
    assert any("0.0% native; on vLLM's loop because of priority: 1" in m for m in logged)
    assert logged[-1].endswith("100.0% native; on vLLM's loop because of none"), logged[-1]


def _step(sched: Scheduler) -> None:
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = sched.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens  # schedule() advanced it
        sampled.append([7] if done else [])
    sched.update_from_output(out, model_runner_output(ids, sampled))


@pytest.mark.parametrize("raw", ["abc", "nan", "1e-x"])
def test_a_bad_interval_is_refused(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(_report.INTERVAL_ENV, raw)
    with pytest.raises(InvalidArgumentError, match=_report.INTERVAL_ENV) as info:
        _report.interval_from_env()
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("raw", "seconds"), [("", 60.0), ("0", 0.0), ("-5", 0.0), ("2.5", 2.5)])
def test_interval_values(monkeypatch: pytest.MonkeyPatch, raw: str, seconds: float) -> None:
    monkeypatch.setenv(_report.INTERVAL_ENV, raw)
    assert _report.interval_from_env() == seconds


def test_a_user_logging_setup_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    ours = logging.getLogger("pagedkv")
    handler = logging.NullHandler()
    monkeypatch.setattr(ours, "handlers", [handler])
    monkeypatch.setattr(ours, "level", logging.WARNING)
    _report.route_to_vllm_log()
    assert ours.handlers == [handler] and ours.level == logging.WARNING


def test_records_reach_vllms_handlers_only_while_the_root_logger_has_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [Keep(logging.INFO)])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    forward = _report._ToVllmLog()
    record = logging.LogRecord("pagedkv.vllm_v1", logging.INFO, __file__, 1, "hello", (), None)
    forward.emit(record)
    debug = logging.LogRecord("pagedkv.vllm_v1", logging.DEBUG, __file__, 1, "quiet", (), None)
    forward.emit(debug)  # below vLLM's handler level
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    forward.emit(record)  # the root logger has a handler: the record propagates there instead
    assert seen == ["hello"]
