"""The adapters of vLLM V0's scheduler API (vLLM 0.4.2 and 0.5.0): a model-free engine loop.

The scheduler code is vLLM's real ``vllm/core/scheduler.py`` of a release, loaded by
:mod:`pagedkv.vllm_release` (nothing of vLLM needs to be installed). What changes between
backends is the classes it drives:

* ``"vllm"``: vLLM's own Sequence family and BlockSpaceManagerV1 (the baseline);
* ``"pagedkv-dropin"``: pagedkv's Sequence family and ``BlockSpaceManager``, swapped in by an
  import change (``vllm_release.load(version, "pagedkv")``): the drop-in claim;
* ``"pagedkv-manager"``: vLLM's own Sequence family with pagedkv's ``BlockSpaceManager`` (the
  manager accepts foreign sequences);
* ``"pagedkv-scheduler"``: :class:`pagedkv.Scheduler` (vLLM 0.4.2's policy, its loop in Rust)
  over pagedkv's Sequence family, built from the same vLLM config objects (0.4.2 only).

:class:`V0Engine` is what vLLM's LLMEngine does around the scheduler, minus the model, as an
:class:`~pagedkv.bench.harness.EngineUnderTest`: each step it calls ``schedule()``, then
processes the outputs (advance the computed tokens, fork ``n > 1`` requests after their
prefill, append one sampled token per running sequence, finish and free sequences at their
output length, free finished groups). The sampled tokens are fixed in advance per request and
sequence, so every backend replays the same run. :func:`compat_engine` (the ``compat`` path of
the whole step: :class:`pagedkv.Scheduler` on pagedkv's own config classes) and
:func:`vllm_engine` (vLLM's own, a baseline) are registered in :mod:`pagedkv.bench.harness`.

:func:`compare_decisions` checks that backends make identical decisions at every step;
:func:`compare_scheduler_step` times the whole step of any of them on W1, each engine in a
process of its own. Both run :func:`pagedkv.bench.harness.run_lockstep`.
"""

from __future__ import annotations

import inspect
import random
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pagedkv.bench.harness import (
    EngineConfig,
    EngineUnderTest,
    InOwnProcess,
    StepRecord,
    run_lockstep,
)
from pagedkv.bench.vllm_042 import driver
from pagedkv.bench.vllm_042.driver import BACKENDS, Backend, make_backend, scheduler_backend
from pagedkv.bench.workload import W1_FULL, W1_QUICK, Request, generate

__all__ = [
    "BACKENDS",
    "Backend",
    "V0Engine",
    "compare_decisions",
    "compare_scheduler_step",
    "compat_engine",
    "make_backend",
    "random_requests",
    "scheduler_backend",
    "vllm_engine",
]

# ---- the engine loop -------------------------------------------------------------------------


def _canonical(tables: List[List[int]]) -> List[List[int]]:
    """Renumber blocks by first appearance: two runs with the same sharing compare equal
    (vLLM's free-list order after a free depends on object addresses)."""
    names: Dict[int, int] = {}
    return [[names.setdefault(b, len(names)) for b in t] for t in tables]


def _pair_count(mapping: Any) -> int:
    """(src, dst) pairs of a 0.4 dict ({src: dst} / {src: [dst]}) or a 0.5 list of pairs."""
    if isinstance(mapping, dict):
        return sum(len(v) if isinstance(v, list) else 1 for v in mapping.values())
    return len(mapping)


class V0Engine(EngineUnderTest):
    """A model-free LLMEngine loop around ``backend``'s scheduler (the module docstring).

    ``name``: the lane (default: the backend's); ``baseline``: vLLM's own classes;
    ``detail``: every step also reports its chunks, block tables, computed blocks, swaps,
    copies, ignored requests and free blocks (built outside the timed part)."""

    def __init__(
        self,
        backend: Backend,
        name: Optional[str] = None,
        baseline: bool = False,
        detail: bool = False,
    ) -> None:
        self.backend, self.detail = backend, detail
        self.name, self.release, self.baseline = name or backend.name, backend.version, baseline
        self.description = f"{backend.name} on vLLM {backend.version}'s scheduler API"
        self.scheduler: Any = None
        self.requests: Dict[str, Request] = {}
        self.next_child_id = 1 << 40
        #: When a list, the output processing appends ``(request_id, (parent, child) or None,
        #: ((seq_id, token, finished), ...))`` per group that sampled (bench.vllm_042.trace).
        self.log: Optional[List[Any]] = None

    def setup(self, config: EngineConfig) -> None:
        c, ns = config, self.backend.release
        sched_cfg, cache_cfg = driver.scheduler_configs(
            ns.config,
            c.max_num_batched_tokens,
            c.max_num_seqs,
            c.max_model_len,
            c.block_size,
            c.num_gpu_blocks,
            c.num_cpu_blocks,
            chunked_prefill=c.chunked_prefill,
            caching=c.caching,
        )
        self.block_size = c.block_size
        self.scheduler = self.backend.make_scheduler(sched_cfg, cache_cfg)
        seq_params = list(inspect.signature(self.backend.sequence.Sequence.__init__).parameters)
        self._inputs_dict = len(seq_params) > 2 and seq_params[2] == "inputs"  # vLLM 0.5
        self._running = self.backend.sequence.SequenceStatus.RUNNING
        self._capped = self.backend.sequence.SequenceStatus.FINISHED_LENGTH_CAPPED
        self._logprob = self.backend.sequence.Logprob

    def add(self, request: Request) -> None:
        mod, bs, req = self.backend.sequence, self.block_size, request
        tokens = list(req.prompt_token_ids)
        if self._inputs_dict:
            inputs = {"prompt": "", "prompt_token_ids": tokens, "multi_modal_data": None}
            seq = mod.Sequence(req.index, inputs, bs)
        else:
            seq = mod.Sequence(req.index, "", tokens, bs)
        params = self.backend.sampling_params(n=req.n, best_of=req.n, max_tokens=req.output_len)
        group = mod.SequenceGroup(
            request_id=req.request_id,
            seqs=[seq],
            sampling_params=params,
            arrival_time=req.arrival_time,
        )
        self.requests[req.request_id] = req
        self.scheduler.add_seq_group(group)

    def busy(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def step(self) -> StepRecord:
        """``schedule()`` and the output processing (timed); the record is built after."""
        t0 = time.perf_counter()
        metas, out = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.process_outputs(out)
        t2 = time.perf_counter()
        groups = [sg.seq_group for sg in out.scheduled_seq_groups]
        return StepRecord(
            seconds=t2 - t0,
            schedule_seconds=t1 - t0,
            scheduled=tuple(g.request_id for g in groups),
            finished=tuple(g.request_id for g in groups if g.is_finished()),
            detail=self._detail(metas, out) if self.detail else None,
        )

    def process_outputs(self, out: Any) -> None:
        """vLLM's output processing of one step's ``SchedulerOutputs``
        (:func:`~pagedkv.bench.vllm_042.driver.process_outputs`), with the requests'
        predetermined tokens: a group samples once its prompt is computed."""
        driver.process_outputs(
            self.scheduler, out, lambda sg: not sg.seq_group.is_prefill(), self._sample_group
        )

    def _sample_group(self, group: Any) -> None:
        req = self.requests[group.request_id]
        rows = req.output_token_ids
        seqs = group.get_seqs()
        # One child, forked once from the group's one sequence (whatever ``n``), after its prompt.
        fork = 2 if req.n > 1 and len(seqs) == 1 else 1

        def samples(parent: Any) -> List[int]:
            pos, row = parent.get_output_len(), seqs.index(parent)
            return [rows[(row + k) % len(rows)][pos] for k in range(1, fork)] + [
                rows[row % len(rows)][pos]
            ]

        def stop(seq: Any) -> None:
            if seq.get_output_len() >= req.output_len:
                seq.status = self._capped

        pairs = driver.process_group_samples(
            self.scheduler, group, samples, self._new_seq_id, stop, self._running, self._logprob
        )
        if self.log is not None:
            self.log.append(_log_entry(group.request_id, pairs))

    def _new_seq_id(self) -> int:
        self.next_child_id += 1
        return self.next_child_id - 1

    def _detail(self, metas: Any, out: Any) -> Dict[str, Any]:
        mgr = self.scheduler.block_manager
        return {
            "requests": [(m.request_id, m.is_prompt, m.token_chunk_size) for m in metas],
            "tables": _canonical([t for m in metas for _, t in sorted(m.block_tables.items())]),
            "computed": [len(m.computed_block_nums or []) for m in metas],
            "swap": (_pair_count(out.blocks_to_swap_in), _pair_count(out.blocks_to_swap_out)),
            "copies": _pair_count(out.blocks_to_copy),
            "ignored": [g.request_id for g in out.ignored_seq_groups],
            "free": (mgr.get_num_free_gpu_blocks(), mgr.get_num_free_cpu_blocks()),
        }


def _log_entry(request_id: str, pairs: List[Tuple[Any, Any]]) -> Tuple[str, Any, tuple]:
    """The trace's record of a group's samples (:mod:`pagedkv.bench.vllm_042.trace`): its id,
    the fork ``(parent, child)`` the block manager made or None, and ``(seq_id, token,
    finished)`` per sequence the block manager holds, the parent first (a child finished at
    birth was never forked: vLLM leaves it out of the block manager)."""
    fork = None
    tokens = []
    for seq, parent in sorted(pairs, key=lambda p: p[0] is not p[1]):
        if seq is not parent:
            if seq.is_finished():
                continue
            fork = (parent.seq_id, seq.seq_id)
        tokens.append((seq.seq_id, seq.get_last_token_id(), seq.is_finished()))
    return request_id, fork, tuple(tokens)


def compat_engine() -> V0Engine:
    """The whole step's ``compat`` path: :class:`pagedkv.Scheduler` through vLLM 0.4.2's API
    (``schedule()`` + vLLM's output processing in Python)."""
    engine = V0Engine(scheduler_backend(), name="compat")
    engine.description = "pagedkv.Scheduler.schedule() + vLLM's output processing in Python"
    return engine


def vllm_engine(release: str) -> V0Engine:
    """vLLM ``release``'s own Scheduler and Sequence family (a baseline)."""
    engine = V0Engine(make_backend(release, "vllm"), name=f"vllm-{release}", baseline=True)
    engine.description = f"vLLM {release}'s Scheduler + Sequence family, its own files"
    return engine


# ---- decisions ---------------------------------------------------------------------------------


def random_requests(
    num: int,
    seed: int,
    caching: bool,
    block_size: int = 4,
    prompt_blocks: Tuple[int, int] = (1, 15),
    max_n: int = 2,
) -> List[Request]:
    """A small random mix: prompts of a few blocks (whole blocks with a shared prefix when
    ``caching``), 1..``max_n`` sequences, outputs of 1..40 tokens."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(1000) for _ in range(block_size * rng.randrange(1, 8))] for _ in range(4)
    ]
    out = []
    for i in range(num):
        if caching:
            head = rng.choice(prefixes) if rng.random() < 0.7 else []
            own = block_size * rng.randrange(1, 6)
            toks = head + [rng.randrange(1000) for _ in range(own)]
        else:
            lo, hi = prompt_blocks
            toks = [rng.randrange(1000) for _ in range(rng.randrange(lo, hi * block_size))]
        n = rng.randrange(1, max_n + 1) if rng.random() < 0.3 else 1
        olen = rng.randrange(1, 40)
        rows = [[rng.randrange(1000) for _ in range(olen)] for _ in range(n)]
        out.append(Request(i, f"r{i}", toks, olen, n, None, 0.0, rows))
    return out


def compare_decisions(
    version: str,
    backends: Sequence[str] = ("vllm", "pagedkv-dropin"),
    requests: int = 60,
    seed: int = 3,
    caching: bool = False,
    chunked_prefill: bool = False,
    per_step: int = 1,
    config: Optional[EngineConfig] = None,
    max_n: int = 2,
    prompt_blocks: Tuple[int, int] = (1, 15),
    max_steps: int = 200_000,
) -> Tuple[int, Optional[str]]:
    """Run vLLM ``version``'s Scheduler over ``backends`` on the same random requests and
    compare every step's decisions (the first backend leads). Returns ``(steps, None)`` when
    they agree at every step, else ``(step, description of the difference)``. Without caching
    the pool is small (so requests are preempted by recompute and swapped); with caching it is
    large and prompts share whole-block prefixes."""
    if config is None:
        config = EngineConfig(
            block_size=4,
            num_gpu_blocks=4096 if caching else 64,
            num_cpu_blocks=256 if caching else 48,
            max_num_seqs=24,
            max_num_batched_tokens=48 if chunked_prefill else 1024,
            max_model_len=1024,
            caching=caching,
            chunked_prefill=chunked_prefill,
        )
    reqs = random_requests(requests, seed, caching, config.block_size, prompt_blocks, max_n)
    engines = [V0Engine(make_backend(version, b), detail=True) for b in backends]
    run = run_lockstep(
        engines, config, reqs, per_step, max_steps=max_steps, stop_at_difference=True
    )
    problem = run.first_difference()
    if problem is not None:
        return problem
    return (run.steps, "did not finish") if run.steps >= max_steps else (run.steps, None)


# ---- timing ------------------------------------------------------------------------------------


def _summary(seconds: List[float]) -> Dict[str, float]:
    total = sum(seconds)
    ordered = sorted(seconds)
    return {
        "steps": len(seconds),
        "total_s": total,
        "mean_step_us": 1e6 * total / max(1, len(seconds)),
        "median_step_us": 1e6 * ordered[len(ordered) // 2] if ordered else 0.0,
    }


def compare_scheduler_step(
    version: str = "0.4.2",
    caching: bool = True,
    quick: bool = False,
    seed: int = 0,
    backends: Sequence[str] = ("vllm", "pagedkv-dropin"),
    max_steps: int = 200_000,
) -> Dict[str, Any]:
    """Time the whole engine step (``schedule()`` + output processing) of vLLM ``version``'s
    real Scheduler on W1 (``quick``: W1_QUICK) with each backend, in the same run.

    Each backend's engine lives in a process of its own (:class:`InOwnProcess`) and the
    engines step in lockstep, one step each in turn, so the machine's noise hits them alike.
    Returns per-backend step statistics, ``speedup`` (the first backend's total step time over
    each backend's) and ``median_step_ratio`` (the median over steps of the same ratio, step
    by step); ``error`` is set if a backend failed, decided otherwise or took another number
    of steps."""
    cfg = W1_QUICK if quick else W1_FULL
    engines = [InOwnProcess(V0Engine(make_backend(version, name))) for name in backends]
    run = run_lockstep(
        engines,
        EngineConfig.from_workload(cfg, caching),
        generate(cfg, seed).requests,
        max_steps=max_steps,
    )
    times = {lane.name: lane.seconds for lane in run.lanes}
    stats = {name: _summary(times[name]) for name in backends}
    result: Dict[str, Any] = {
        "version": version,
        "caching": caching,
        "workload": "W1_QUICK" if quick else "W1",
        "backends": stats,
    }
    problem = run.first_difference()
    if problem is not None:
        result["error"] = problem[1]
    elif len({s["steps"] for s in stats.values()}) != 1:
        result["error"] = "the backends took different numbers of steps"
    base = stats[backends[0]]["total_s"]
    result["speedup"] = {name: base / st["total_s"] for name, st in stats.items()}
    # Robust to a noisy machine: the engines ran each step back to back, so the median of the
    # per-step time ratios shrugs off steps that another process interrupted.
    first = times[backends[0]]
    result["median_step_ratio"] = {
        name: _median([a / b for a, b in zip(first, times[name]) if b > 0]) for name in backends
    }
    return result


def _median(values: List[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")
