"""The one shape of an engine under test, and the one harness that drives engines in lockstep.

Every path the bench times is an :class:`EngineUnderTest` (the contract: the package docstring
and ``docs/bench.md``). :func:`run_lockstep` gives every engine the same requests at the same
steps, steps them the same number of times, in turns, in one run, keeps what each one's step
measured itself (:attr:`StepRecord.seconds`: the harness never times around ``step()``, so an
adapter's own bookkeeping stays out of the measured time) and compares every follower's
decisions with the leader's (the first engine) step by step.

The engines the whole-step section of ``pagedkv bench`` runs are registered in
:data:`PAGEDKV_PATHS` (pagedkv's ways to run a step) and :data:`VLLM_GENERATIONS` (vLLM's own,
per release ``--compare vllm==RELEASE`` accepts), as ``"module:function"`` names, so that
building the command line imports none of them.
"""

from __future__ import annotations

import gc
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from pagedkv.bench.workload import Request, WorkloadConfig

__all__ = [
    "PAGEDKV_PATHS",
    "VLLM_GENERATIONS",
    "EngineConfig",
    "EngineUnderTest",
    "InOwnProcess",
    "Lane",
    "Lockstep",
    "StepRecord",
    "make_path",
    "make_vllm",
    "run_lockstep",
]

#: pagedkv's whole-step paths: lane name -> ``"module:function"``; the function takes keyword
#: options (the batch step's buffers) and returns an :class:`EngineUnderTest`.
PAGEDKV_PATHS: Dict[str, str] = {
    "compat": "pagedkv.bench.vllm_042.vllm_scheduler:compat_engine",
    "batch": "pagedkv.bench.vllm_042.wholestep:batch_engine",
}

#: vLLM's own engines, per release: ``"module:function"``; the function takes the release and
#: returns an :class:`EngineUnderTest` whose ``baseline`` is true. A new vLLM generation is a
#: new adapter module and one line per release here.
VLLM_GENERATIONS: Dict[str, str] = {
    "0.4.2": "pagedkv.bench.vllm_042.vllm_scheduler:vllm_engine",
    "0.5.0": "pagedkv.bench.vllm_042.vllm_scheduler:vllm_engine",
}


def _load(spec: str) -> Callable[..., Any]:
    module, _, function = spec.partition(":")
    return getattr(importlib.import_module(module), function)


def make_path(name: str, **options: Any) -> EngineUnderTest:
    """The pagedkv path ``name`` of :data:`PAGEDKV_PATHS`."""
    return _load(PAGEDKV_PATHS[name])(**options)


def make_vllm(release: str) -> EngineUnderTest:
    """vLLM ``release``'s own engine (:data:`VLLM_GENERATIONS`)."""
    if release not in VLLM_GENERATIONS:
        raise ValueError(f"no engine for vLLM {release}; have {', '.join(VLLM_GENERATIONS)}")
    return _load(VLLM_GENERATIONS[release])(release)


@dataclass
class EngineConfig:
    """The engine limits every engine under test is built with (vLLM's ``SchedulerConfig``
    and ``CacheConfig`` fields)."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    caching: bool = False
    chunked_prefill: bool = False

    @classmethod
    def from_workload(cls, cfg: WorkloadConfig, caching: bool) -> EngineConfig:
        """The engine limits of a bench workload, with prefix caching ``caching``."""
        return cls(
            block_size=cfg.block_size,
            num_gpu_blocks=cfg.num_gpu_blocks,
            num_cpu_blocks=cfg.num_cpu_blocks,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.prefill_token_budget,
            max_model_len=cfg.prompt_len_max + cfg.output_len_max,
            caching=caching,
            chunked_prefill=cfg.chunked_prefill,
        )


@dataclass(frozen=True)
class StepRecord:
    """What one engine step measured and decided.

    ``seconds``: the engine's own work of the step (scheduling and applying the sampled
    tokens), timed by the adapter; ``schedule_seconds``: the scheduling call alone, where the
    engine has one. ``scheduled``: the request ids scheduled, in the engine's order (compared
    with the leader's every step). ``finished``: requests that finished in this step (compared
    as a set at the end: an engine may apply a step's tokens at its next call). ``rows`` and
    ``prefills``: the batch rows and the prompt groups of the step, where the engine knows
    them. ``detail``: fuller decisions (chunks, block tables, swaps, free blocks), compared
    step by step when both engines give it.
    """

    seconds: float
    scheduled: Tuple[str, ...]
    finished: Tuple[str, ...] = ()
    rows: Optional[int] = None
    prefills: Optional[int] = None
    schedule_seconds: Optional[float] = None
    detail: Optional[Dict[str, Any]] = None


class EngineUnderTest:
    """An engine the bench drives (subclass it; the contract is in ``docs/bench.md``).

    ``name``: its lane in reports; ``release``: the vLLM release whose API it speaks;
    ``baseline``: vLLM's own code, measured against (its disagreements are reported, they do
    not fail the run); ``description``: one line for the report.
    """

    name: str = ""
    release: str = ""
    baseline: bool = False
    description: str = ""

    def setup(self, config: EngineConfig) -> None:
        """Build the engine for ``config`` (nothing timed)."""
        raise NotImplementedError

    def add(self, request: Request) -> None:
        """Hand the engine one arriving request (not timed)."""
        raise NotImplementedError

    def busy(self) -> bool:
        """Whether it has unfinished requests."""
        raise NotImplementedError

    def step(self) -> StepRecord:
        """One engine step: schedule, then the engine's output processing with the request's
        predetermined tokens (the model's part: not timed)."""
        raise NotImplementedError

    def finish(self) -> Optional[StepRecord]:
        """After the last step: one more call, for an engine that applies a step's tokens at
        its next call (timed and counted); None if there is nothing left to do."""
        return None

    def close(self) -> None:
        """Release what :meth:`setup` took (a process, say); called once the run is over,
        also after a :meth:`setup` that raised part-way (release what was taken)."""


class EngineStartError(RuntimeError):
    """An engine under test could not be built: the message names the engine and the cause
    (the exception :meth:`EngineUnderTest.setup` raised is chained)."""


@dataclass
class Lane:
    """One engine's run: its step records' measurements, and where it failed or differed."""

    engine: EngineUnderTest
    seconds: List[float] = field(default_factory=list)
    schedule_seconds: List[float] = field(default_factory=list)
    rows: List[int] = field(default_factory=list)
    prefills: List[int] = field(default_factory=list)
    finished: List[str] = field(default_factory=list)
    error: Optional[str] = None
    failed_at: Optional[int] = None  # the step whose call raised
    differs_at: Optional[int] = None
    difference: Optional[str] = None
    added: int = 0  # arrivals handed to the engine so far

    @property
    def name(self) -> str:
        return self.engine.name

    def fail(self, step: int, exc: Exception) -> None:
        """The engine raised ``exc`` at ``step``: its lane stops there."""
        self.error, self.failed_at = f"step {step}: {type(exc).__name__}: {exc}", step

    def keep(self, rec: StepRecord) -> None:
        """Add one step's measurements and finished requests to the lane."""
        self.seconds.append(rec.seconds)
        if rec.schedule_seconds is not None:
            self.schedule_seconds.append(rec.schedule_seconds)
        if rec.rows is not None:
            self.rows.append(rec.rows)
        if rec.prefills is not None:
            self.prefills.append(rec.prefills)
        self.finished += rec.finished


@dataclass
class Lockstep:
    """A lockstep run: the leader's step count and every lane (the leader first)."""

    steps: int
    lanes: List[Lane]

    @property
    def ok(self) -> bool:
        """No engine that is not a baseline failed, differed or finished otherwise."""
        return all(lane.error is None for lane in self.lanes if not lane.engine.baseline)

    def lane(self, name: str) -> Lane:
        """The lane of the engine named ``name``."""
        return next(lane for lane in self.lanes if lane.name == name)

    def first_difference(self) -> Optional[Tuple[int, str]]:
        """``(step, description)`` of the earliest difference or failure of any lane (a lane
        that did not end as the leader did counts after the last step)."""
        found: List[Tuple[int, str]] = []
        for lane in self.lanes:
            if lane.differs_at is not None and lane.difference:
                found.append((lane.differs_at, lane.difference))
            if lane.error:
                at = self.steps if lane.failed_at is None else lane.failed_at
                found.append((at, f"{lane.name}: {lane.error}"))
        return min(found, key=lambda f: f[0]) if found else None


def run_lockstep(
    engines: Sequence[EngineUnderTest],
    config: EngineConfig,
    requests: Sequence[Request],
    per_step: int = 0,
    turn: Optional[int] = 1,
    max_steps: Optional[int] = None,
    stop_at_difference: bool = False,
    progress: Optional[Callable[[int], None]] = None,
    collect_every: int = 0,
) -> Lockstep:
    """Run ``requests`` through ``engines``, all built with ``config``.

    ``per_step`` requests arrive at each step (0: all at step 0). The first engine leads: it
    runs ``turn`` steps (None: to the end), then every other engine runs as many steps
    (alternately in order and in reverse, so the machine's noise falls on all alike), until the
    leader is done or ran ``max_steps``. An engine that raises stops (its error is kept); a
    follower whose decisions differ from the leader's is marked (``stop_at_difference``: the
    run stops there). The cyclic GC is paused (``collect_every``: collected every that many
    steps, between steps) and logging below ERROR is off (vLLM's preemption warnings).
    ``progress`` gets the number of requests the leader finished in each step."""
    if turn is not None and turn < 1:
        raise ValueError(f"turn must be >= 1, got {turn}")
    lanes = [Lane(e) for e in engines]
    arrivals = [(0 if per_step <= 0 else i // per_step, r) for i, r in enumerate(requests)]
    gc_was_enabled = gc.isenabled()
    logging.disable(logging.WARNING)
    started: List[EngineUnderTest] = []
    try:
        for e in engines:
            started.append(e)
            _start(e, config)
        gc.collect()
        gc.disable()
        steps = _drive(
            lanes, arrivals, turn, max_steps, stop_at_difference, progress, collect_every
        )
        _finish(lanes, arrivals, steps, max_steps is not None and steps >= max_steps)
    finally:
        logging.disable(logging.NOTSET)
        if gc_was_enabled:
            gc.enable()
        for e in started:
            close_quietly(e)
    return Lockstep(steps, lanes)


def _start(engine: EngineUnderTest, config: EngineConfig) -> None:
    """``engine.setup(config)``, a failure raised as one :class:`EngineStartError` naming the
    engine and the cause."""
    try:
        engine.setup(config)
    except Exception as exc:
        detail = " ".join(str(exc).split())  # one line
        if len(detail) > 400:
            detail = detail[:397] + "..."
        raise EngineStartError(
            f"engine {engine.name or type(engine).__name__} failed to start: "
            f"{type(exc).__name__}: {detail}"
        ) from exc


def close_quietly(engine: EngineUnderTest) -> None:
    """``engine.close()``; cleanup never raises (a failure is logged, the run's own outcome
    or error stands)."""
    try:
        engine.close()
    except Exception as exc:  # noqa: BLE001 - cleanup must not hide the run's result
        logging.getLogger("pagedkv.bench").warning(
            "closing %s failed: %s: %s", engine.name, type(exc).__name__, exc
        )


def _drive(
    lanes: List[Lane],
    arrivals: List[Tuple[int, Request]],
    turn: Optional[int],
    max_steps: Optional[int],
    stop_at_difference: bool,
    progress: Optional[Callable[[int], None]],
    collect_every: int,
) -> int:
    leader, steps, rounds = lanes[0], 0, 0
    while leader.error is None and (max_steps is None or steps < max_steps):
        room = (1 << 62) if max_steps is None else max_steps - steps
        ours = _turn(leader, arrivals, steps, min(room, turn or room), lead=True)
        if not ours:
            break
        others = lanes[1:] if rounds % 2 == 0 else lanes[:0:-1]
        for lane in others:
            _compare(lane, leader, ours, _turn(lane, arrivals, steps, len(ours)), steps)
        for rec in ours:
            leader.keep(rec)
            if progress is not None and rec.finished:
                progress(len(rec.finished))
        steps, rounds = steps + len(ours), rounds + 1
        if collect_every and steps // collect_every > (steps - len(ours)) // collect_every:
            gc.collect()
        if stop_at_difference and any(lane.difference for lane in lanes):
            break
    return steps


def _turn(
    lane: Lane, arrivals: List[Tuple[int, Request]], first: int, k: int, lead: bool = False
) -> List[StepRecord]:
    """Up to ``k`` steps of ``lane`` from step ``first`` (the leader stops when it is done;
    any lane stops when it raises: its error is kept, not raised)."""
    out: List[StepRecord] = []
    engine = lane.engine
    while len(out) < k and lane.error is None:
        step = first + len(out)
        while lane.added < len(arrivals) and arrivals[lane.added][0] <= step:
            engine.add(arrivals[lane.added][1])
            lane.added += 1
        if lead and not engine.busy() and lane.added == len(arrivals):
            break
        try:
            out.append(engine.step())
        except Exception as exc:
            lane.fail(step, exc)
    return out


def _compare(
    lane: Lane, leader: Lane, ours: List[StepRecord], theirs: List[StepRecord], first: int
) -> None:
    """Keep ``theirs`` and mark the first step whose decisions differ from ``ours``."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        lane.keep(b)
        if lane.differs_at is not None:
            continue
        what = _difference(a, b)
        if what:
            lane.differs_at = first + i
            lane.difference = f"step {first + i}: {what} ({leader.name}: {_show(a, what)}, "
            lane.difference += f"{lane.name}: {_show(b, what)})"
            if not lane.engine.baseline and lane.error is None:
                lane.error = f"step {first + i}: scheduled other groups than {leader.name}"
                if what != "scheduled":
                    lane.error = f"step {first + i}: decided otherwise than {leader.name} ({what})"


def _difference(a: StepRecord, b: StepRecord) -> Optional[str]:
    if a.scheduled != b.scheduled:
        return "scheduled"
    if a.detail is not None and b.detail is not None:
        for key in a.detail:
            if key in b.detail and a.detail[key] != b.detail[key]:
                return key
    return None


def _show(rec: StepRecord, what: str) -> Any:
    return rec.scheduled if what == "scheduled" else (rec.detail or {}).get(what)


def _finish(
    lanes: List[Lane], arrivals: List[Tuple[int, Request]], steps: int, capped: bool
) -> None:
    """The engines' last calls; then, for a run that was not cut short, every engine that is
    not a baseline must be done and have finished the leader's requests."""
    leader = lanes[0]
    for lane in lanes:
        if lane.error is not None:
            continue
        try:
            rec = lane.engine.finish()
        except Exception as exc:
            lane.fail(steps, exc)
            continue
        if rec is not None:
            lane.keep(rec)
    if capped:
        return
    for lane in lanes[1:]:
        if lane.error is not None or lane.engine.baseline:
            continue
        if lane.engine.busy() or lane.added < len(arrivals):
            lane.error = f"did not finish with {leader.name}"
        elif sorted(lane.finished) != sorted(leader.finished):
            lane.error = f"finished other requests than {leader.name}"


class InOwnProcess(EngineUnderTest):
    """``engine`` in a process of its own (forked at :meth:`setup`): in production one engine
    runs, and a second one's objects in the same heap would slow the first. The engine's step
    records come back over a pipe; what the harness keeps is still what the engine timed."""

    def __init__(self, engine: EngineUnderTest) -> None:
        self.engine = engine
        self.name, self.release = engine.name, engine.release
        self.baseline, self.description = engine.baseline, engine.description
        self._conn: Any = None
        self._proc: Any = None

    def setup(self, config: EngineConfig) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.engine, config), daemon=True)
        self._proc.start()
        self._call("ready")

    def _call(self, command: str, arg: Any = None) -> Any:
        self._conn.send((command, arg))
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(value)
        return value

    def add(self, request: Request) -> None:
        self._call("add", request)

    def busy(self) -> bool:
        return bool(self._call("busy"))

    def step(self) -> StepRecord:
        return self._call("step")

    def finish(self) -> Optional[StepRecord]:
        return self._call("finish")

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            self._conn.send(("stop", None))
        except OSError:  # the engine's process is gone already
            pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc = None


def _serve(conn: Any, engine: EngineUnderTest, config: EngineConfig) -> None:
    """The engine's process: builds it, then answers the harness's calls until ``stop``. GC is
    paused; it runs every 50 steps, between steps."""
    logging.disable(logging.WARNING)
    gc.disable()
    calls: Dict[str, Callable[[Any], Any]] = {
        "ready": lambda _: engine.setup(config),
        "add": engine.add,
        "busy": lambda _: engine.busy(),
        "step": lambda _: engine.step(),
        "finish": lambda _: engine.finish(),
    }
    steps = 0
    while True:
        command, arg = conn.recv()
        if command == "stop":
            return
        try:
            conn.send((True, calls[command](arg)))
        except Exception as exc:
            conn.send((False, f"{type(exc).__name__}: {exc}"))
        steps += command == "step"
        if command == "step" and steps % 50 == 0:
            gc.collect()
