"""Replay a recorded schedule onto one block-manager backend, timing only the manager's calls.

The schedule comes from :func:`pagedkv.bench.vllm_042.trace.record` (``pagedkv.Scheduler`` on a
workload); a backend (:mod:`pagedkv.bench.vllm_042.backends`) brings a manager and its own Sequence
family. Each step makes the calls vLLM 0.4.2's scheduler and engine make, in its order:

1. **running groups** in queue order: ``can_append_slots(group)``; while the replayed manager
   says no, the next recorded victim is preempted (recompute: ``free`` each sequence; swap:
   ``can_swap_out`` + ``swap_out``), the way vLLM pops victims from the tail of its running
   queue at the moment a head group cannot append; then ``append_slots`` per running sequence.
   A group that preempted itself is reached after every other victim and goes last.
2. **swap-ins**: ``can_swap_in`` + ``swap_in`` + ``append_slots`` per sequence.
3. **admissions**: ``can_allocate`` + ``allocate``.
4. **prepare**: ``get_block_table`` + ``access_all_blocks_in_seq`` per running sequence of each
   scheduled group and ``get_common_computed_block_ids`` per scheduled group (``now`` = the
   step number, so eviction order is deterministic).
5. **post**: ``mark_blocks_as_computed`` per scheduled group; then the engine's ``fork`` of
   ``n = 2`` groups after their prompt and ``free`` of finished sequences, in its order.

The ``native-batch`` backend makes the same calls in batch form: one ``append_slots_batch``
for every running sequence when nobody is preempted (else one per group, with the per-group
checks above), ``append_slots_batch`` per swapped-in group, ``fill_block_tables`` for the
admitted groups' tables, ``access_all_blocks_in_seqs`` and ``compute_full_blocks_in_seqs``.

The player decides nothing: a victim comes from the record, and the replayed manager only
says when. If it disagrees with the scheduler (it can append where the scheduler preempted,
or cannot where the scheduler did not), or its free GPU/CPU block counts (or prefix-cache
lookups and hits) differ from the scheduler's after any step, the run records the first
divergence in :attr:`RunResult.mismatch` and stops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from pagedkv.bench.harness import EngineConfig, EngineUnderTest, StepRecord, run_lockstep
from pagedkv.bench.vllm_042.backends import Backend
from pagedkv.bench.vllm_042.trace import SCHEDULER_WATERMARK, Step, Trace
from pagedkv.bench.workload import Request

__all__ = ["Divergence", "ManagerReplay", "RunResult", "replay"]


class Divergence(AssertionError):
    """The replayed manager disagreed with the scheduler that recorded the trace."""


@dataclass
class RunResult:
    """One backend's replay of a trace: manager time per step and what it reported."""

    backend: str
    enable_caching: bool
    steps: int
    step_times_us: np.ndarray
    phase_us: Dict[str, float]
    finished: int
    ignored: int
    preempt_recompute: int
    preempt_swap: int
    swap_ins: int
    cow_copies: int
    forks: int
    prefix_lookups: Optional[int]
    prefix_hits: Optional[int]
    final_free_gpu: int
    final_free_cpu: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    mean_batch_seqs: float
    schedule_digest: str
    wall_s: float
    partial_prefills: int = 0  # prompt chunks that did not finish their prompt
    mismatch: Optional[str] = None  # the first divergence from the scheduler, if any
    aborted: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def all_blocks_free(self) -> bool:
        return self.final_free_gpu == self.num_gpu_blocks and (
            self.final_free_cpu == self.num_cpu_blocks
        )

    @property
    def hit_rate(self) -> Optional[float]:
        if self.prefix_lookups is None or self.prefix_hits is None:
            return None
        return self.prefix_hits / self.prefix_lookups if self.prefix_lookups else 0.0

    def step_stats(self) -> Dict[str, float]:
        t = self.step_times_us
        if len(t) == 0:
            return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0, "total_ms": 0.0}
        return {
            "mean": float(t.mean()),
            "p50": float(np.percentile(t, 50)),
            "p99": float(np.percentile(t, 99)),
            "max": float(t.max()),
            "total_ms": float(t.sum() / 1e3),
        }

    def schedule_key(self) -> Dict[str, Any]:
        """What must be identical across backends replaying the same trace."""
        key = {
            "steps": self.steps,
            "finished": self.finished,
            "preempt_recompute": self.preempt_recompute,
            "preempt_swap": self.preempt_swap,
            "cow_copies": self.cow_copies,
            "final_free_gpu": self.final_free_gpu,
            "final_free_cpu": self.final_free_cpu,
            "schedule_digest": self.schedule_digest,
            "mismatch": self.mismatch,
        }
        if self.prefix_hits is not None:
            key["prefix_lookups"] = self.prefix_lookups
            key["prefix_hits"] = self.prefix_hits
        return key

    def to_dict(self) -> Dict[str, Any]:
        d = {
            "backend": self.backend,
            "enable_caching": self.enable_caching,
            "step_us": self.step_stats(),
            "phase_total_ms": {k: v / 1e3 for k, v in self.phase_us.items()},
            "prefix_hit_rate": self.hit_rate,
            "mean_batch_seqs": self.mean_batch_seqs,
            "all_blocks_free": self.all_blocks_free,
            "num_gpu_blocks": self.num_gpu_blocks,
            "num_cpu_blocks": self.num_cpu_blocks,
            "wall_s": self.wall_s,
            "ignored": self.ignored,
            "swap_ins": self.swap_ins,
            "forks": self.forks,
            "partial_prefills": self.partial_prefills,
        }
        d.update(self.schedule_key())
        d.update(self.extra)
        return d


def replay(
    trace: Trace,
    backend: Backend,
    progress: Optional[Callable[[int], None]] = None,
    check: bool = True,
) -> RunResult:
    """Replay ``trace`` onto a fresh manager of ``backend`` (module docstring), through the
    bench's harness as a lane of its own. With ``check`` (vLLM's own manager is replayed with
    it off only where it differs by design), the free counts and prefix-cache counts are
    compared with the scheduler's after every step. The cyclic garbage collector is paused
    during the run (as ``timeit`` does), so that its pauses do not land at random in the timed
    regions."""
    engine = ManagerReplay(trace, backend, check)
    wall0 = time.perf_counter()
    run = run_lockstep(
        [engine],
        EngineConfig.from_workload(trace.config, trace.caching),
        trace.workload.requests,
        turn=None,
        progress=progress,
    )
    return engine.result(time.perf_counter() - wall0, run.lanes[0].error)


class ManagerReplay(EngineUnderTest):
    """One backend's manager, its own sequences and groups, and the timers: an engine under
    test whose step replays the next recorded step (it decides nothing; a divergence from the
    recorded scheduler raises :class:`Divergence`, which stops the lane)."""

    def __init__(self, trace: Trace, backend: Backend, check: bool = True) -> None:
        self.trace, self.backend, self.checked = trace, backend, check
        self.name = backend.name
        self.baseline = self.name.startswith("vllm-")  # vLLM's own manager
        self.release = self.name[len("vllm-") :] if self.baseline else "0.4.2"
        self.description = backend.description
        self.index = 0

    def setup(self, config: EngineConfig) -> None:
        cfg, backend, trace = self.trace.config, self.backend, self.trace
        self.mgr = backend.make_manager(
            cfg.block_size,
            cfg.num_gpu_blocks,
            cfg.num_cpu_blocks,
            SCHEDULER_WATERMARK,
            trace.caching,
        )
        self.requests = {r.request_id: r for r in trace.workload.requests}
        self.groups: Dict[str, Any] = {}
        self.seqs: Dict[int, Any] = {}
        st = backend.status
        self.RUNNING, self.WAITING, self.SWAPPED = st.RUNNING, st.WAITING, st.SWAPPED
        self.FINISHED, self.IGNORED = st.FINISHED_LENGTH_CAPPED, st.FINISHED_IGNORED
        self.logprob = backend.logprob_cls(0.0)
        self.phase = {"decode": 0.0, "swap_admit": 0.0, "prepare": 0.0, "post": 0.0}
        self.step_times: List[float] = []
        self.counts = {"recompute": 0, "swap": 0, "swap_in": 0, "cow": 0, "forks": 0}
        self.counts.update(finished=0, ignored=0, partial=0, rows=0)
        self.done_in_step: List[str] = []
        if backend.batch:
            rows = cfg.max_num_seqs
            self.tables = np.zeros((rows, cfg.max_blocks_per_seq + 1), dtype=np.int32)
            self.lens = np.zeros(rows, dtype=np.int32)
            self.slots = np.zeros(rows, dtype=np.int32)

    def add(self, request: Request) -> None:
        """Nothing: a group is built when the trace admits it."""

    def busy(self) -> bool:
        return self.index < len(self.trace.steps)

    def step(self) -> StepRecord:
        i, step = self.index, self.trace.steps[self.index]
        self.index += 1
        self.play(i, step)
        if self.checked:
            self.check(step)
        return StepRecord(
            seconds=self.step_times[-1],
            scheduled=tuple(rid for rid, _ in step.scheduled),
            finished=tuple(self.done_in_step),
            rows=step.rows,
        )

    # ---- one step -------------------------------------------------------------------------

    def play(self, i: int, step: Step) -> None:
        """Step ``i`` of the trace onto the manager, each call timed."""
        self.done_in_step = []
        t_decode = self._running(step)
        t_admit = self._swap_in(step) + self._admit(step)
        t_prepare = self._prepare(step, float(i))
        t_post = self._outputs(step)
        self.phase["decode"] += t_decode
        self.phase["swap_admit"] += t_admit
        self.phase["prepare"] += t_prepare
        self.phase["post"] += t_post
        self.step_times.append(t_decode + t_admit + t_prepare + t_post)
        self.counts["rows"] += step.rows

    def check(self, step: Step) -> None:
        mgr = self.mgr
        free = (mgr.get_num_free_gpu_blocks(), mgr.get_num_free_cpu_blocks())
        if free != step.free:
            raise Divergence(f"free GPU/CPU blocks {free}, the scheduler had {step.free}")
        stats = getattr(mgr, "prefix_cache_stats", None)
        if step.prefix is not None and callable(stats):
            mine = tuple(int(x) for x in stats())
            if mine != step.prefix:
                raise Divergence(
                    f"prefix-cache lookups/hits {mine}, the scheduler had {step.prefix}"
                )

    def _running(self, step: Step) -> float:
        """Appends of the running groups, with the recorded preemptions interleaved."""
        pending = list(step.victims)
        appended = set(step.appended)
        if self.backend.batch and not pending:
            seqs = [s for rid in step.appended for s in self._running_seqs(rid)]
            pc = time.perf_counter
            t0 = pc()
            cow = (
                self.mgr.append_slots_batch(seqs, self.tables, self.lens, self.slots)
                if seqs
                else {}
            )
            spent = pc() - t0
            self._count_cow(cow)
            return spent
        spent = 0.0
        for rid in step.order:
            if rid in appended:
                spent += self._preempt_until_appendable(rid, pending)
                spent += self._append(rid)
            elif pending and pending[-1][0] == rid:  # it preempted itself, after the rest
                while pending:
                    if self._timed(self.mgr.can_append_slots, self.groups[rid])[0]:
                        raise Divergence(f"{rid}: the manager can append, the scheduler preempted")
                    spent += self._preempt(*pending.pop(0))
                break
        if pending:
            raise Divergence(f"preempted {pending} but the manager could append every group")
        return spent

    def _preempt_until_appendable(self, rid: str, pending: List[Any]) -> float:
        spent = 0.0
        group = self.groups[rid]
        while True:
            ok, dt = self._timed(self.mgr.can_append_slots, group)
            spent += dt
            if ok:
                return spent
            if not pending:
                raise Divergence(f"{rid}: the manager cannot append, the scheduler appended")
            spent += self._preempt(*pending.pop(0))

    def _append(self, rid: str) -> float:
        seqs = self._running_seqs(rid)
        pc = time.perf_counter
        if self.backend.batch:
            t0 = pc()
            cow = self.mgr.append_slots_batch(seqs, self.tables, self.lens, self.slots)
            spent = pc() - t0
            self._count_cow(cow)
            return spent
        append = self.mgr.append_slots
        t0 = pc()
        cows = [append(s) for s in seqs]
        spent = pc() - t0
        for cow in cows:
            self._count_cow(cow)
        return spent

    def _preempt(self, rid: str, mode: str) -> float:
        group, mgr, pc = self.groups[rid], self.mgr, time.perf_counter
        seqs = self._running_seqs(rid)
        if mode == "swap":
            t0 = pc()
            if not mgr.can_swap_out(group):
                raise Divergence(f"{rid}: the manager cannot swap out, the scheduler swapped")
            mgr.swap_out(group)
            spent = pc() - t0
            for s in seqs:
                s.status = self.SWAPPED
            self.counts["swap"] += 1
            return spent
        spent = 0.0
        for s in seqs:
            s.status = self.WAITING
            t0 = pc()
            mgr.free(s)
            spent += pc() - t0
            s.reset_state_for_recompute()
        self.counts["recompute"] += 1
        return spent

    def _swap_in(self, step: Step) -> float:
        spent = 0.0
        for rid in step.swapped_in:
            group = self.groups[rid]
            spent += self._move(rid, group, "can_swap_in", "swap_in", "swapped in")
            for s in group.get_seqs(status=self.SWAPPED):
                s.status = self.RUNNING
            spent += self._append(rid)
            self.counts["swap_in"] += 1
        for rid, was_swapped in step.ignored:
            spent += self._ignore(rid, was_swapped)
        return spent

    def _ignore(self, rid: str, was_swapped: bool) -> float:
        group = self._group(rid)
        spent = 0.0
        for s in group.get_seqs():
            if was_swapped:  # a swapped group that can never come back: its CPU blocks go
                spent += self._timed(self.mgr.free, s)[1]
            s.status = self.IGNORED
        self.counts["ignored"] += 1
        self.done_in_step.append(rid)
        return spent

    def _admit(self, step: Step) -> float:
        spent = 0.0
        for rid in step.admitted:
            group = self._group(rid)
            spent += self._move(rid, group, "can_allocate", "allocate", "admitted")
            for s in group.get_seqs(status=self.WAITING):
                s.status = self.RUNNING
        return spent

    def _move(self, rid: str, group: Any, can: str, do: str, done: str) -> float:
        """The manager's ``can`` must say OK for ``group`` (the scheduler ``done`` it); then
        its ``do``. Both calls are timed."""
        status, dt = self._timed(getattr(self.mgr, can), group)
        if _name(status) != "OK":
            raise Divergence(f"{rid}: {can} says {_name(status)}, the scheduler {done}")
        return dt + self._timed(getattr(self.mgr, do), group)[1]

    def _prepare(self, step: Step, now: float) -> float:
        """Block tables, access times and common computed blocks of the scheduled groups,
        then ``mark_blocks_as_computed`` (vLLM 0.4.2's ``schedule()`` ends with it)."""
        mgr, pc = self.mgr, time.perf_counter
        groups = [self.groups[rid] for rid, _ in step.scheduled]
        running = [g.get_seqs(status=self.RUNNING) for g in groups]
        if self.backend.batch:
            fresh = [s for rid in step.admitted for s in self._running_seqs(rid)]
            every = [s for seqs in running for s in seqs]
            marked = [s for g in groups for s in g.get_seqs()]
            t0 = pc()
            if fresh:
                mgr.fill_block_tables(fresh, self.tables, context_lens=self.lens)
            mgr.access_all_blocks_in_seqs(every, now)
            for seqs in running:
                mgr.get_common_computed_block_ids(seqs)
            mgr.compute_full_blocks_in_seqs(marked)
            return pc() - t0
        table, access = mgr.get_block_table, mgr.access_all_blocks_in_seq
        common, mark = mgr.get_common_computed_block_ids, mgr.mark_blocks_as_computed
        t0 = pc()
        for seqs in running:
            for s in seqs:
                table(s)
                access(s, now)
            common(seqs)
        for g in groups:
            mark(g)
        return pc() - t0

    def _outputs(self, step: Step) -> float:
        """The engine's output processing: forks after a prompt, tokens, finishes + frees."""
        mgr, pc = self.mgr, time.perf_counter
        spent = 0.0
        self.counts["partial"] += len(step.scheduled) - len(step.outputs)
        for rid, fork, tokens in step.outputs:
            group = self.groups[rid]
            if fork is not None:
                parent = self.seqs[fork[0]]
                child = parent.fork(fork[1])
                group.add(child)
                self.seqs[fork[1]] = child
                spent += self._timed(mgr.fork, parent, child)[1]
                self.counts["forks"] += 1
            for seq_id, token, finished in tokens:
                seq = self.seqs[seq_id]
                seq.append_token_id(token, {token: self.logprob})
                if finished:
                    seq.status = self.FINISHED
                    t0 = pc()
                    mgr.free(seq)
                    spent += pc() - t0
            if group.is_finished():
                self.counts["finished"] += 1
                self.done_in_step.append(rid)
        return spent

    # ---- helpers --------------------------------------------------------------------------

    def _group(self, rid: str) -> Any:
        group = self.groups.get(rid)
        if group is None:
            req = self.requests[rid]
            b = self.backend
            seq = b.make_sequence(
                req.index, list(req.prompt_token_ids), self.trace.config.block_size
            )
            params = b.sampling_params_cls(n=req.n, best_of=req.n, max_tokens=req.output_len)
            group = b.make_group(rid, [seq], params, req.arrival_time)
            self.groups[rid] = group
            self.seqs[req.index] = seq
        return group

    def _running_seqs(self, rid: str) -> List[Any]:
        return self.groups[rid].get_seqs(status=self.RUNNING)

    def _count_cow(self, cow: Any) -> None:
        # {src: [dst, ...]} (vLLM 0.4, pagedkv) or [(src, dst), ...] (vLLM 0.5)
        if cow:
            n = sum(len(d) for d in cow.values()) if hasattr(cow, "values") else len(cow)
            self.counts["cow"] += n

    @staticmethod
    def _timed(fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - t0

    def result(self, wall_s: float, mismatch: Optional[str]) -> RunResult:
        c, mgr, trace = self.counts, self.mgr, self.trace
        stats = getattr(mgr, "prefix_cache_stats", None)
        lookups = hits = None
        if callable(stats):
            lookups, hits = (int(x) for x in stats())
        steps = len(self.step_times)
        return RunResult(
            backend=self.backend.name,
            enable_caching=trace.caching,
            steps=steps,
            step_times_us=np.asarray(self.step_times) * 1e6,
            phase_us={k: v * 1e6 for k, v in self.phase.items()},
            finished=c["finished"],
            ignored=c["ignored"],
            preempt_recompute=c["recompute"],
            preempt_swap=c["swap"],
            swap_ins=c["swap_in"],
            cow_copies=c["cow"],
            forks=c["forks"],
            prefix_lookups=lookups,
            prefix_hits=hits,
            final_free_gpu=mgr.get_num_free_gpu_blocks(),
            final_free_cpu=mgr.get_num_free_cpu_blocks(),
            num_gpu_blocks=trace.config.num_gpu_blocks,
            num_cpu_blocks=trace.config.num_cpu_blocks,
            mean_batch_seqs=c["rows"] / steps if steps else 0.0,
            schedule_digest=trace.digest(),
            wall_s=wall_s,
            partial_prefills=c["partial"],
            mismatch=mismatch,
        )


def _name(status: Any) -> str:
    """AllocStatus member name; tolerant of either backend's enum."""
    return getattr(status, "name", str(status)).rsplit(".", 1)[-1]
