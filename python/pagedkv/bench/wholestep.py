"""The whole engine step of ``pagedkv bench``: the compat step, the batch step and vLLM's own.

Three engines take the same workload in lockstep, in one process, in turns of :data:`TURN`
steps each (the compat engine's first, the others in alternating order, so that the machine's
noise falls on all alike):

* ``compat``: :class:`pagedkv.Scheduler` driven through vLLM 0.4.2's API by the model-free
  engine loop of :mod:`pagedkv.bench.vllm_scheduler`: ``schedule()`` plus vLLM's output
  processing in Python (computed tokens, forks of ``n > 1`` groups after their prompt, one
  token per running sequence, ``free_seq`` at the output length, ``free_finished_seq_groups``);
* ``batch``: :meth:`pagedkv.engine_step.BatchEngine.step`: one call applies the previous step's
  sampled tokens (stop checks, forks, frees), schedules, and writes the model inputs into
  caller-owned buffers;
* ``vllm-<version>`` (with ``--compare``): vLLM's own Scheduler and Sequence family on the
  compat loop. vLLM 0.4.2's scheduler fails on some chunked-prefill loads with ``n > 1``
  (``docs/scheduler.md``); its lane then stops and the failure is reported.

A step's time is the whole step (schedule + applying the sampled tokens + frees); the sampled
tokens are the workload's predetermined ones (building the array is the model's work, not
timed). The batch step must make the compat step's decisions: the scheduled groups of every
step are compared, and so are the finished requests. GC is paused while stepping.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from pagedkv.bench.trace import engine_config, scheduler_backend
from pagedkv.bench.workload import Request, Workload, WorkloadConfig

__all__ = ["TURN", "BatchDriver", "run_whole_step", "step_stats"]

#: Steps one engine takes before the next one's turn. One engine serves alone in production, its
#: data warm in the CPU caches from one step to the next; stepping the engines in strict
#: alternation (1) evicts it every step, which costs the native steps far more than vLLM's
#: Python loop (see the README). Turns of 16 keep each engine's data warm while the machine's
#: noise still falls on all of them alike.
TURN = 16


class BatchDriver:
    """A workload's requests through :class:`~pagedkv.engine_step.BatchEngine`, with the
    model's sampled tokens taken from the workload (``incremental``: buffers that also carry
    the block-table increments, :class:`~pagedkv.engine_step.BatchBuffers`; ``stable_rows``:
    a running sequence keeps its row, :class:`~pagedkv.engine_step.BatchEngine`)."""

    def __init__(
        self,
        cfg: WorkloadConfig,
        caching: bool,
        incremental: bool = False,
        stable_rows: bool = False,
    ) -> None:
        import pagedkv
        from pagedkv import scheduler as conf
        from pagedkv.engine_step import BatchBuffers, BatchEngine

        ec = engine_config(cfg, caching)
        sched_cfg = conf.SchedulerConfig(
            ec.max_num_batched_tokens,
            ec.max_num_seqs,
            ec.max_model_len,
            enable_chunked_prefill=ec.chunked_prefill,
        )
        cache_cfg = conf.CacheConfig(ec.block_size, enable_prefix_caching=caching)
        cache_cfg.num_gpu_blocks = ec.num_gpu_blocks
        cache_cfg.num_cpu_blocks = ec.num_cpu_blocks
        self.scheduler = pagedkv.Scheduler(sched_cfg, cache_cfg, None)
        self.next_child = 1 << 40  # the compat loop's child ids
        buffers = BatchBuffers.for_scheduler(self.scheduler, incremental=incremental)
        self.engine = BatchEngine(
            self.scheduler, buffers, seq_counter=self._new_id, stable_rows=stable_rows
        )
        self.pagedkv = pagedkv
        self.block_size = cfg.block_size
        # seq id -> (request, row of its output_token_ids, prompt length)
        self.owner: Dict[int, Tuple[Request, int, int]] = {}
        self.sampled = np.zeros(0, np.int32)
        self.seconds: List[float] = []
        self.rows: List[int] = []
        self.prefills: List[int] = []  # prefill groups per step

    def _new_id(self) -> int:
        self.next_child += 1
        return self.next_child - 1

    def add(self, req: Request) -> None:
        p = self.pagedkv
        seq = p.Sequence(req.index, "", list(req.prompt_token_ids), self.block_size)
        params = p.SamplingParams(n=req.n, best_of=req.n, max_tokens=req.output_len)
        self.owner[req.index] = (req, 0, len(req.prompt_token_ids))
        self.engine.add_seq_group(p.SequenceGroup(req.request_id, [seq], params, req.arrival_time))

    def busy(self) -> bool:
        return self.engine.has_unfinished_seqs()

    def step(self) -> Any:
        t0 = time.perf_counter()
        res = self.engine.step(self.sampled, now=0.0)
        self.seconds.append(time.perf_counter() - t0)
        self.rows.append(res.num_rows)
        self.prefills.append(res.num_prefill_groups)
        self.sampled = self._model(res)
        return res

    def _model(self, res: Any) -> np.ndarray:
        """The tokens the compat loop appends, for ``res``'s rows (children take rows 1..).
        The engine draws children's ids in schedule order (with stable rows that is not the
        rows' order): a group forks from at most one row, its first."""
        b, out, forking = res.buffers, [], []
        for i in range(res.num_rows):
            k = int(b.num_samples[i])
            if not k:
                continue
            req, row, plen = self.owner[int(b.seq_ids[i])]
            pos = int(b.context_lens[i]) - plen
            rows = req.output_token_ids
            for _ in range(k - 1):
                out.append(rows[(row + 1) % len(rows)][pos])
            if k > 1:
                forking.append((req, row, plen, k - 1))
            out.append(rows[row % len(rows)][pos])
        if forking:
            at = {g.request_id: j for j, g in enumerate(res.scheduled)}
            forking.sort(key=lambda f: at[f[0].request_id])
            child = self.next_child
            for req, row, plen, kids in forking:
                for _ in range(kids):
                    self.owner[child] = (req, row + 1, plen)
                    child += 1
        return np.array(out, dtype=np.int32)


@dataclass
class _Lane:
    """One engine in the lockstep: its step times and what it scheduled and finished."""

    name: str
    step: Callable[[], Tuple[List[str], List[str]]]  # -> (scheduled ids, finished ids)
    seconds: List[float]
    busy: Callable[[], bool]
    error: Optional[str] = None
    differs_at: Optional[int] = None
    finished: List[str] = field(default_factory=list)


def _compat_lane(name: str, engine: Any) -> _Lane:
    def step() -> Tuple[List[str], List[str]]:
        engine.step()
        groups = [sg.seq_group for sg in engine.last_out.scheduled_seq_groups]
        done = [g.request_id for g in groups if g.is_finished()]
        return [g.request_id for g in groups], done

    return _Lane(name, step, engine.step_seconds, engine.busy)


def _batch_lane(driver: BatchDriver) -> _Lane:
    def step() -> Tuple[List[str], List[str]]:
        res = driver.step()
        return [g.request_id for g in res.scheduled], [g.request_id for g in res.finished]

    return _Lane("batch", step, driver.seconds, driver.busy)


def _engines(
    workload: Workload, caching: bool, vllm: Sequence[str], batch: Tuple[bool, bool]
) -> Tuple[List[_Lane], BatchDriver]:
    from pagedkv.bench.vllm_scheduler import Engine, make_backend

    ec = engine_config(workload.config, caching)
    compat = Engine(scheduler_backend(), ec)
    driver = BatchDriver(workload.config, caching, *batch)
    lanes = [_compat_lane("compat", compat), _batch_lane(driver)]
    adders = [compat.add, driver.add]
    for version in vllm:
        theirs = Engine(make_backend(version, "vllm"), ec)
        lanes.append(_compat_lane(f"vllm-{version}", theirs))
        adders.append(theirs.add)
    for req in workload.requests:
        for add in adders:
            add(req)
    return lanes, driver


def run_whole_step(
    workload: Workload,
    caching: bool,
    vllm: Sequence[str] = (),
    max_steps: Optional[int] = None,
    progress: Optional[Callable[[int], None]] = None,
    turn: int = TURN,
    incremental: bool = False,
    stable_rows: bool = False,
) -> Dict[str, Any]:
    """Step the engines in lockstep over ``workload`` (all of it, or ``max_steps``), with a
    lane of vLLM's own Scheduler for each release in ``vllm``; the section's JSON: per lane
    step statistics (``lanes``), the ratios of total step time measured in this run
    (``ratios``: ``batch_vs_compat``, ``batch_vs_vllm-0.4.2``, ...), and ``ok`` (the batch
    step made the compat step's decisions). The lanes take turns of ``turn`` steps. The
    batch step writes plain buffers unless ``incremental``, rows in schedule order unless
    ``stable_rows``."""
    if turn < 1:
        raise ValueError(f"turn must be >= 1, got {turn}")
    import logging

    logging.disable(logging.WARNING)  # vLLM's preemption warnings
    lanes, driver = _engines(workload, caching, vllm, (incremental, stable_rows))
    compat, batch = lanes[0], lanes[1]
    gc.collect()
    gc.disable()
    try:
        steps = _lockstep(lanes, max_steps, turn, progress)
        # the batch step applies a step's tokens at its next call: one more call applies the
        # last step's (timed, and counted against the same steps)
        _, done = batch.step()
        batch.finished += done
    finally:
        gc.enable()
        logging.disable(logging.NOTSET)
    if max_steps is None and driver.busy() and batch.error is None:
        batch.error = "the batch step did not finish with the compat step"
    if batch.error is None and sorted(batch.finished) != sorted(compat.finished):
        batch.error = "the batch step finished other requests than the compat step"
    return _section(workload, caching, steps, lanes, driver.rows, turn)


def _lockstep(lanes: List[_Lane], max_steps: Optional[int], turn: int, progress: Any) -> int:
    """Step the lanes in turns of ``turn`` steps (the compat engine's first, the others in
    alternating order) until the compat engine is done; a lane that raises stops (its error is
    kept) and a lane whose scheduled groups differ from the compat step's is marked."""
    compat, batch = lanes[0], lanes[1]
    steps = 0
    while compat.busy() and (max_steps is None or steps < max_steps):
        k = turn if max_steps is None else min(turn, max_steps - steps)
        ours = _turn(compat, k, steps, compat.busy)
        others = lanes[1:] if (steps // turn) % 2 == 0 else lanes[:0:-1]
        for lane in others:
            theirs = _turn(lane, len(ours), steps)
            for i, (a, b) in enumerate(zip(ours, theirs)):
                lane.finished += b[1]
                if lane.differs_at is None and a[0] != b[0]:
                    lane.differs_at = steps + i
        for _, done in ours:
            compat.finished += done
            if progress is not None and done:
                progress(len(done))
        if batch.differs_at is not None and batch.error is None:
            batch.error = f"step {batch.differs_at}: the batch step scheduled other groups"
        steps += len(ours)
    return steps


def _turn(
    lane: _Lane, k: int, first: int, busy: Optional[Callable[[], bool]] = None
) -> List[Tuple[List[str], List[str]]]:
    """Up to ``k`` steps of ``lane`` (fewer once ``busy`` says done, or when it raises: its
    failures are vLLM's own, reported, not raised)."""
    out: List[Tuple[List[str], List[str]]] = []
    while len(out) < k and lane.error is None and (busy is None or busy()):
        try:
            out.append(lane.step())
        except Exception as exc:
            lane.error = f"step {first + len(out)}: {type(exc).__name__}: {exc}"
    return out


def step_stats(seconds: List[float], rows: int) -> Dict[str, float]:
    """Mean, p50, p99 and total of a lane's step times (µs), and µs per batch row."""
    us = np.asarray(seconds) * 1e6
    if len(us) == 0:
        return {"steps": 0, "mean_us": 0.0, "p50_us": 0.0, "p99_us": 0.0, "us_per_row": 0.0}
    return {
        "steps": int(len(us)),
        "mean_us": float(us.mean()),
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "total_ms": float(us.sum() / 1e3),
        "us_per_row": float(us.sum() / max(1, rows)),
    }


def _section(
    workload: Workload, caching: bool, steps: int, lanes: List[_Lane], rows: List[int], turn: int
) -> Dict[str, Any]:
    compat = lanes[0]
    total_rows = sum(rows)
    out: Dict[str, Any] = {
        "workload": workload.config.name,
        "caching": caching,
        "steps": steps,
        "rows_per_step": total_rows / max(1, steps),
        "finished": len(compat.finished),
        "turn": turn,
        "lanes": {},
        "ratios": {},
    }
    base = sum(compat.seconds[:steps])
    for lane in lanes:
        n = len(lane.seconds)
        stats = step_stats(lane.seconds, sum(rows[:n]))
        if lane.error:
            stats["error"] = lane.error
        if lane.differs_at is not None and lane.name != "batch":
            stats["decisions_differ_at_step"] = lane.differs_at
        out["lanes"][lane.name] = stats
    batch_s = sum(lanes[1].seconds)
    out["ratios"]["batch_vs_compat"] = base / batch_s if batch_s else None
    for lane in lanes[2:]:
        k = len(lane.seconds)  # a lane that failed ran fewer steps: compare those
        theirs = sum(lane.seconds[:k])
        for name, mine in (("compat", compat.seconds[:k]), ("batch", lanes[1].seconds[:k])):
            out["ratios"][f"{name}_vs_{lane.name}"] = theirs / sum(mine) if sum(mine) else None
    out["ok"] = lanes[1].error is None
    return out
