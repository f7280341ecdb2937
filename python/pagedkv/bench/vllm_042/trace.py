"""The schedule of a bench run, recorded from a real scheduler, as block-manager calls per step.

:func:`record` runs a :class:`~pagedkv.bench.workload.Workload` through the model-free engine
loop of :mod:`pagedkv.bench.vllm_042.vllm_scheduler` (``schedule()``, then vLLM 0.4.2's output
processing: computed tokens, forks of ``n > 1`` groups after their prompt, one predetermined
token per running sequence, ``free_seq`` at the output length, ``free_finished_seq_groups``)
over :class:`pagedkv.Scheduler` (or any scheduler with vLLM 0.4.2's API: the test runs vLLM's
own). From each step's ``SchedulerOutputs``, the queues before and after and the sequences'
statuses it derives what vLLM's scheduler asks of its block manager in that step
(:class:`Step`), and it records the scheduler's free GPU/CPU block counts (and prefix-cache
counts) after the step, so that :mod:`pagedkv.bench.vllm_042.replay` can replay the calls onto any
block-manager backend and check it against the scheduler at every step.

Nothing here decides anything: every field is read off the scheduler's decisions.
"""

from __future__ import annotations

import gc
import hashlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from pagedkv.bench.workload import Workload, WorkloadConfig

__all__ = ["SCHEDULER_WATERMARK", "Step", "Trace", "record"]

#: vLLM 0.4.2's block-manager watermark (its Scheduler builds the manager with the default).
SCHEDULER_WATERMARK = 0.01


@dataclass(frozen=True)
class Step:
    """The block-manager calls of one engine step, in the order vLLM 0.4.2 makes them.

    ``order``: the running queue before the step (FCFS order). ``victims``: preempted groups,
    ``(request_id, "recompute" | "swap")`` in preemption order (from the tail of the running
    queue; a group that preempted itself comes last). ``appended``: groups scheduled from the
    running queue (``can_append_slots`` + ``append_slots`` per running sequence).
    ``swapped_in``, ``admitted``: in queue order. ``ignored``: ``(request_id, was_swapped)``.
    ``scheduled``: ``(request_id, token_chunk_size)`` in the order of the step's outputs.
    ``outputs``: per group that sampled, ``(request_id, fork, tokens)`` with ``fork`` the
    ``(parent, child)`` sequence ids or None and ``tokens`` ``(seq_id, token, finished)`` in
    the engine's order. ``free``: the scheduler's free GPU and CPU blocks after the step;
    ``prefix``: its prefix-cache ``(lookups, hits)`` after the step, if it counts them.
    ``rows``: the running sequences of the scheduled groups (the model's batch rows).
    """

    order: Tuple[str, ...]
    victims: Tuple[Tuple[str, str], ...]
    appended: Tuple[str, ...]
    swapped_in: Tuple[str, ...]
    admitted: Tuple[str, ...]
    ignored: Tuple[Tuple[str, bool], ...]
    scheduled: Tuple[Tuple[str, int], ...]
    outputs: Tuple[Tuple[str, Optional[Tuple[int, int]], Tuple[Tuple[int, int, bool], ...]], ...]
    free: Tuple[int, int]
    prefix: Optional[Tuple[int, int]]
    rows: int  # running sequences of the scheduled groups (the batch's rows)


@dataclass
class Trace:
    """A recorded run: the workload, the caching setting, the steps and the engine limits."""

    workload: Workload
    caching: bool
    steps: List[Step] = field(default_factory=list)
    num_gpu_blocks: int = 0
    num_cpu_blocks: int = 0
    _digest: Optional[Tuple[int, str]] = field(default=None, repr=False, compare=False)

    @property
    def config(self) -> WorkloadConfig:
        return self.workload.config

    def digest(self) -> str:
        """A short fingerprint of every decision (two schedulers that agree have the same);
        computed once, when the trace is complete."""
        if self._digest is None or self._digest[0] != len(self.steps):
            h = hashlib.sha256()
            for s in self.steps:
                h.update(repr(s).encode())
            self._digest = (len(self.steps), h.hexdigest()[:16])
        return self._digest[1]


def record(
    workload: Workload,
    caching: bool,
    backend: Any = None,
    max_steps: Optional[int] = None,
    progress: Any = None,
) -> Trace:
    """Run ``workload`` on ``backend``'s scheduler (default: :class:`pagedkv.Scheduler`,
    :func:`~pagedkv.bench.vllm_042.vllm_scheduler.scheduler_backend`) and record every step. Every
    request arrives at step 0, as in W1 and W2."""
    from pagedkv.bench.harness import EngineConfig
    from pagedkv.bench.vllm_042.vllm_scheduler import V0Engine, scheduler_backend

    if workload.config.watermark != SCHEDULER_WATERMARK:
        raise ValueError(
            f"watermark must be {SCHEDULER_WATERMARK}: vLLM 0.4.2's Scheduler builds its block "
            "manager with the default watermark"
        )
    engine = V0Engine(backend or scheduler_backend())
    engine.setup(EngineConfig.from_workload(workload.config, caching))
    for req in workload.requests:
        engine.add(req)
    recorder = _Recorder(engine)
    mgr = engine.scheduler.block_manager
    trace = Trace(
        workload, caching, [], mgr.get_num_free_gpu_blocks(), mgr.get_num_free_cpu_blocks()
    )
    # the steps are many small tuples: with the cyclic collector running, its passes over them
    # would cost more than the run (nothing here makes reference cycles worth collecting)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        while engine.busy() and (max_steps is None or len(trace.steps) < max_steps):
            trace.steps.append(recorder.step())
            if progress is not None and recorder.done_now:
                progress(recorder.done_now)
    finally:
        if gc_was_enabled:
            gc.enable()
    return trace


class _Recorder:
    """Steps an engine (its requests added) and reads each step's block-manager calls off its
    decisions."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.sched = engine.scheduler
        self.waiting_status = engine.backend.sequence.SequenceStatus.WAITING
        self.groups: Dict[str, Any] = {g.request_id: g for g in engine.scheduler.waiting}
        self.done_now = 0  # requests that finished or were ignored in the last step
        engine.log = []

    def step(self) -> Step:
        sched, log = self.sched, self.engine.log
        order = _fcfs(sched.running)
        swapped = _fcfs(sched.swapped)
        _, out = sched.schedule()
        scheduled = [
            (sg.seq_group.request_id, sg.token_chunk_size) for sg in out.scheduled_seq_groups
        ]
        log.clear()
        self.engine.process_outputs(out)
        chosen = {rid for rid, _ in scheduled}
        running_ids = {g.request_id for g in order}
        swapped_ids = {g.request_id for g in swapped}
        swapped_after = {g.request_id for g in sched.swapped}
        victims = tuple(
            (g.request_id, "swap" if g.request_id in swapped_after else "recompute")
            for g in reversed(order)
            if g.request_id not in chosen and _was_preempted(g, swapped_after, self.waiting_status)
        )
        ignored = tuple((g.request_id, g.request_id in swapped_ids) for g in out.ignored_seq_groups)
        outputs = tuple(log)
        self.done_now = len(ignored) + sum(
            1 for rid, _, toks in outputs if self._finishes(rid, toks)
        )
        # a group whose prompt ends this step samples best_of tokens from its one row
        rows = len(scheduled) - len(outputs)
        rows += sum(len(toks) - (fork is not None) for _, fork, toks in outputs)
        return Step(
            order=tuple(g.request_id for g in order),
            victims=victims,
            appended=tuple(g.request_id for g in order if g.request_id in chosen),
            swapped_in=tuple(g.request_id for g in swapped if g.request_id in chosen),
            admitted=tuple(
                rid for rid, _ in scheduled if rid not in running_ids and rid not in swapped_ids
            ),
            ignored=ignored,
            scheduled=tuple(scheduled),
            outputs=outputs,
            free=self._free(),
            prefix=self._prefix(),
            rows=rows,
        )

    def _finishes(self, rid: str, tokens: Tuple[Tuple[int, int, bool], ...]) -> bool:
        """Whether the group's last unfinished sequences finished in this step."""
        if not all(done for _, _, done in tokens):
            return False
        return all(s.is_finished() for s in self.groups[rid].get_seqs())

    def _free(self) -> Tuple[int, int]:
        mgr = self.sched.block_manager
        return (mgr.get_num_free_gpu_blocks(), mgr.get_num_free_cpu_blocks())

    def _prefix(self) -> Optional[Tuple[int, int]]:
        stats = getattr(self.sched.block_manager, "prefix_cache_stats", None)
        if not callable(stats):
            return None
        lookups, hits = stats()
        return (int(lookups), int(hits))


def _fcfs(queue: Any) -> List[Any]:
    """A queue as vLLM's FCFS policy sorts it each step (by arrival time, stable)."""
    return sorted(queue, key=lambda g: g.metrics.arrival_time)


def _was_preempted(group: Any, swapped_after: Set[str], waiting: Any) -> bool:
    if group.request_id in swapped_after:
        return True
    return any(s.status == waiting for s in group.get_seqs())
