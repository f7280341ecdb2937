"""The whole engine step of ``pagedkv bench``: pagedkv's paths and vLLM's own, in lockstep.

The engines (:class:`~pagedkv.bench.harness.EngineUnderTest`, registered in
:mod:`pagedkv.bench.harness`) take the same workload in lockstep, in one process, in turns of
:data:`TURN` steps each (the compat engine's first, the others in alternating order, so that
the machine's noise falls on all alike):

* ``compat``: :class:`pagedkv.Scheduler` driven through vLLM 0.4.2's API by the model-free
  engine loop of :mod:`pagedkv.bench.vllm_042.vllm_scheduler`: ``schedule()`` plus vLLM's output
  processing in Python (computed tokens, forks of ``n > 1`` groups after their prompt, one
  token per running sequence, ``free_seq`` at the output length, ``free_finished_seq_groups``);
* ``batch`` (:class:`BatchStepEngine`): :meth:`pagedkv.vllm_042.engine_step.BatchEngine.step`:
  one call applies the previous step's sampled tokens (stop checks, forks, frees), schedules, and
  writes the model inputs into caller-owned buffers;
* ``vllm-<version>`` (with ``--compare``): vLLM's own engine of that release
  (:data:`~pagedkv.bench.harness.VLLM_GENERATIONS`). vLLM 0.4.2's scheduler fails on some
  chunked-prefill loads with ``n > 1`` (``docs/scheduler.md``); its lane then stops and the
  failure is reported.

A step's time is the whole step (schedule + applying the sampled tokens + frees); the sampled
tokens are the workload's predetermined ones (building the array is the model's work, not
timed). The batch step must make the compat step's decisions: the scheduled groups of every
step are compared, and so are the finished requests. GC is paused while stepping.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from pagedkv.bench.harness import (
    EngineConfig,
    EngineUnderTest,
    Lockstep,
    StepRecord,
    make_path,
    make_vllm,
    run_lockstep,
)
from pagedkv.bench.workload import Request, Workload

__all__ = ["TURN", "BatchStepEngine", "batch_engine", "run_whole_step", "step_stats"]

#: Steps one engine takes before the next one's turn. One engine serves alone in production, its
#: data warm in the CPU caches from one step to the next; stepping the engines in strict
#: alternation (1) evicts it every step, which costs the native steps far more than vLLM's
#: Python loop (see the README). Turns of 16 keep each engine's data warm while the machine's
#: noise still falls on all of them alike.
TURN = 16


class BatchStepEngine(EngineUnderTest):
    """A workload's requests through :class:`~pagedkv.vllm_042.engine_step.BatchEngine`, with the
    model's sampled tokens taken from the workload (``incremental``: buffers that also carry
    the block-table increments, :class:`~pagedkv.vllm_042.engine_step.BatchBuffers`;
    ``stable_rows``: a running sequence keeps its row,
    :class:`~pagedkv.vllm_042.engine_step.BatchEngine`). A step's tokens are applied at the next
    call; :meth:`finish` applies the last step's."""

    name = "batch"
    release = "0.4.2"
    description = "BatchEngine.step(sampled): apply the tokens, schedule, write the inputs"

    def __init__(self, incremental: bool = False, stable_rows: bool = False) -> None:
        self.incremental, self.stable_rows = incremental, stable_rows

    def setup(self, config: EngineConfig) -> None:
        import pagedkv
        from pagedkv import scheduler as conf
        from pagedkv.vllm_042.engine_step import BatchBuffers, BatchEngine

        ec = config
        sched_cfg = conf.SchedulerConfig(
            ec.max_num_batched_tokens,
            ec.max_num_seqs,
            ec.max_model_len,
            enable_chunked_prefill=ec.chunked_prefill,
        )
        cache_cfg = conf.CacheConfig(ec.block_size, enable_prefix_caching=ec.caching)
        cache_cfg.num_gpu_blocks = ec.num_gpu_blocks
        cache_cfg.num_cpu_blocks = ec.num_cpu_blocks
        self.scheduler = pagedkv.Scheduler(sched_cfg, cache_cfg, None)
        self.next_child = 1 << 40  # the compat loop's child ids
        buffers = BatchBuffers.for_scheduler(self.scheduler, incremental=self.incremental)
        self.engine = BatchEngine(
            self.scheduler, buffers, seq_counter=self._new_id, stable_rows=self.stable_rows
        )
        self.pagedkv = pagedkv
        self.block_size = ec.block_size
        # seq id -> (request, row of its output_token_ids, prompt length)
        self.owner: Dict[int, Tuple[Request, int, int]] = {}
        self.sampled = np.zeros(0, np.int32)

    def _new_id(self) -> int:
        self.next_child += 1
        return self.next_child - 1

    def add(self, request: Request) -> None:
        p, req = self.pagedkv, request
        seq = p.Sequence(req.index, "", list(req.prompt_token_ids), self.block_size)
        params = p.SamplingParams(n=req.n, best_of=req.n, max_tokens=req.output_len)
        self.owner[req.index] = (req, 0, len(req.prompt_token_ids))
        self.engine.add_seq_group(p.SequenceGroup(req.request_id, [seq], params, req.arrival_time))

    def busy(self) -> bool:
        return self.engine.has_unfinished_seqs()

    def step(self) -> StepRecord:
        t0 = time.perf_counter()
        res = self.engine.step(self.sampled, now=0.0)
        seconds = time.perf_counter() - t0
        self.sampled = self._model(res)
        return StepRecord(
            seconds=seconds,
            scheduled=tuple(g.request_id for g in res.scheduled),
            finished=tuple(g.request_id for g in res.finished),
            rows=res.num_rows,
            prefills=res.num_prefill_groups,
        )

    def finish(self) -> StepRecord:
        return self.step()

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


def batch_engine(incremental: bool = False, stable_rows: bool = False) -> BatchStepEngine:
    """The whole step's ``batch`` path (registered in :mod:`pagedkv.bench.harness`)."""
    return BatchStepEngine(incremental, stable_rows)


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
    lane of vLLM's own engine for each release in ``vllm``; the section's JSON: per lane
    step statistics (``lanes``), the ratios of total step time measured in this run
    (``ratios``: ``batch_vs_compat``, ``batch_vs_vllm-0.4.2``, ...), and ``ok`` (every pagedkv
    path made the compat step's decisions). The lanes take turns of ``turn`` steps. The
    batch step writes plain buffers unless ``incremental``, rows in schedule order unless
    ``stable_rows``."""
    engines = [
        make_path("compat"),
        make_path("batch", incremental=incremental, stable_rows=stable_rows),
    ]
    engines += [make_vllm(release) for release in vllm]
    run = run_lockstep(
        engines,
        EngineConfig.from_workload(workload.config, caching),
        workload.requests,
        turn=turn,
        max_steps=max_steps,
        progress=progress,
    )
    return _section(workload, caching, run, turn)


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


def _section(workload: Workload, caching: bool, run: Lockstep, turn: int) -> Dict[str, Any]:
    leader, steps = run.lanes[0], run.steps
    rows = next((lane.rows for lane in run.lanes if lane.rows), [])  # the batch's rows
    out: Dict[str, Any] = {
        "workload": workload.config.name,
        "caching": caching,
        "steps": steps,
        "rows_per_step": sum(rows) / max(1, steps),
        "finished": len(leader.finished),
        "turn": turn,
        "lanes": {},
        "ratios": {},
    }
    for lane in run.lanes:
        stats = step_stats(lane.seconds, sum(rows[: len(lane.seconds)]))
        engine = lane.engine
        stats.update(
            release=engine.release, baseline=engine.baseline, description=engine.description
        )
        if lane.error:
            stats["error"] = lane.error
        if lane.differs_at is not None and lane.engine.baseline:
            stats["decisions_differ_at_step"] = lane.differs_at
        out["lanes"][lane.name] = stats
    out["ratios"] = _ratios(run.lanes)
    out["ok"] = run.ok
    return out


def _ratios(lanes: List[Any]) -> Dict[str, Optional[float]]:
    """Total step time of the leader over each other pagedkv path's (``batch_vs_compat``),
    and of each vLLM baseline over each pagedkv path's over the steps the baseline ran
    (``compat_vs_vllm-0.4.2``: a baseline that failed ran fewer)."""
    leader = lanes[0]
    paths = [lane for lane in lanes if not lane.engine.baseline]
    ratios: Dict[str, Optional[float]] = {}
    base = sum(leader.seconds)
    for lane in paths[1:]:
        ours = sum(lane.seconds)
        ratios[f"{lane.name}_vs_{leader.name}"] = base / ours if ours else None
    for vllm in (lane for lane in lanes if lane.engine.baseline):
        k = len(vllm.seconds)
        theirs = sum(vllm.seconds[:k])
        for lane in paths:
            mine = sum(lane.seconds[:k])
            ratios[f"{lane.name}_vs_{vllm.name}"] = theirs / mine if mine else None
    return ratios
